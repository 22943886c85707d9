//! A seeded check of a core's peer link table (`core::peer`, pure): one forwarding core and
//! two owner brokers, in an order a seed picks: forwards with different waits, dials that
//! complete or not, handshakes, owners that answer, stay silent (frozen) or answer as
//! another node, links cut, and time moving on. Every effect is carried out as the driver
//! would, and every answer is held to the rules:
//! - `answered_once`: each forward the table took is answered exactly once;
//! - `typed_truthfully`: `unavailable` only for a forward never handed to a link ("nothing
//!   was done"), `outcome_unknown` only for one that was, an owner's answer only for one the
//!   owner received;
//! - `none_overdue`: after every tick, no forward is unanswered past its deadline (its wait
//!   plus the forward timeout);
//! - `bounded`: forwards waiting or in flight never exceed `forwards_max` per link;
//! - at rest, `nothing_forgotten`: once time has moved past every deadline, every forward is
//!   answered.
//!
//! `FELIX_PEER_SEED=N` runs seed N alone; `FELIX_PEER_SEEDS` sets how many (default 1000).
//! Two negative twins (`peer::breaks`) show the check catches a broken link that answers a
//! sent forward `unavailable`, and one that forgets its forwards.

use super::peer::{breaks, FwdAnswer, FwdClient, FwdTarget, Lane, LinkEffect, Links, LinksCfg};
use super::sim::Rng;
use felix_quic::server::ConnKey;
use felix_quic::wire::{
    ErrorCode, ForwardHead, Frame, PeerFrame, Records, ShardSelector, StreamName,
};
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

const FORWARD_TIMEOUT: Duration = Duration::from_millis(50);
const CONNECT_TIMEOUT: Duration = Duration::from_millis(100);
const NODES: [u64; 2] = [2, 3];

#[derive(Default)]
struct Track {
    /// Handed to a link (a `Send` effect carried it).
    sent: bool,
    /// Received by its owner (and so answerable by it).
    received: bool,
    deadline: Option<Instant>,
    answered: bool,
}

/// What a run covered.
#[derive(Default, Debug)]
struct Covered {
    answered_by_owner: usize,
    outcome_unknown: usize,
    unavailable: usize,
    refused_at_once: usize,
}

struct Conn {
    node: u64,
    hello_sent: bool,
    /// Link ids of the forwards this owner received and has not answered.
    pending: Vec<u64>,
}

struct Run {
    rng: Rng,
    links: Links,
    forwards_max: usize,
    now: Instant,
    tracks: BTreeMap<u64, Track>,
    conns: BTreeMap<ConnKey, Conn>,
    dials: Vec<u64>,
    next_key: ConnKey,
    next_rid: u64,
    /// Link id → client id, learned from what was sent.
    by_link_id: HashMap<u64, u64>,
    frozen: [bool; 2],
    covered: Covered,
}

fn target(node: u64) -> FwdTarget {
    FwdTarget {
        node,
        addr: format!("127.0.0.{node}:7402"),
        head: ForwardHead {
            incarnation: 1,
            generation: 1,
            origin_node: 1,
            principal: String::new(),
            frame_bytes_max: 0,
        },
    }
}

impl Run {
    fn new(seed: u64) -> Run {
        let mut rng = Rng::new(seed);
        let forwards_max = 1 + rng.below(6) as usize;
        let mut links = Links::new(LinksCfg {
            node_id: 1,
            max_frame_bytes: 1 << 20,
            connect_timeout: CONNECT_TIMEOUT,
            forward_timeout: FORWARD_TIMEOUT,
            forwards_max,
        });
        links.set_cluster_id("c");
        let frozen = [rng.chance(20), rng.chance(20)];
        Run {
            rng,
            links,
            forwards_max,
            now: Instant::now(),
            tracks: BTreeMap::new(),
            conns: BTreeMap::new(),
            dials: Vec::new(),
            next_key: 100,
            next_rid: 1,
            by_link_id: HashMap::new(),
            frozen,
            covered: Covered::default(),
        }
    }

    fn step(&mut self) -> Result<(), String> {
        match self.rng.below(10) {
            0..=2 => self.forward(),
            3 => {
                if !self.dials.is_empty() {
                    let i = self.rng.below(self.dials.len() as u64) as usize;
                    let node = self.dials.remove(i);
                    let key = self.next_key;
                    self.next_key += 1;
                    self.conns.insert(
                        key,
                        Conn {
                            node,
                            hello_sent: false,
                            pending: Vec::new(),
                        },
                    );
                    self.links.on_dialed(node, key);
                }
            }
            4 => {
                if let Some(key) = self.pick_conn() {
                    self.links.on_established(key);
                }
            }
            5 => {
                if let Some(key) = self.pick_conn() {
                    let c = &self.conns[&key];
                    if c.hello_sent && !self.frozen[(c.node - 2) as usize] {
                        // Now and then an owner answers as another node: the link is dropped.
                        let node_id = if self.rng.chance(3) { 9 } else { c.node };
                        let ok = Frame::Peer(PeerFrame::PeerHelloOk {
                            node_id,
                            cluster_id: "c".into(),
                            capabilities: 1,
                            max_frame_bytes: 1 << 20,
                        });
                        self.links.on_frame(self.now, key, ok);
                    }
                }
            }
            6 => self.owner_answers(),
            7 => {
                if let Some(key) = self.pick_conn() {
                    if self.rng.chance(30) {
                        self.conns.remove(&key);
                        self.links.on_closed(self.now, key, "cut".into());
                    }
                }
            }
            _ => {
                self.now += Duration::from_millis(self.rng.below(40));
                self.links.tick(self.now);
                self.effects()?;
                self.overdue()?;
            }
        }
        self.effects()?;
        if self.links.in_flight() > self.forwards_max * NODES.len() {
            return Err(format!(
                "INVARIANT bounded: {} in flight over {} per link",
                self.links.in_flight(),
                self.forwards_max
            ));
        }
        Ok(())
    }

    fn pick_conn(&mut self) -> Option<ConnKey> {
        if self.conns.is_empty() {
            return None;
        }
        let i = self.rng.below(self.conns.len() as u64) as usize;
        self.conns.keys().nth(i).copied()
    }

    fn forward(&mut self) {
        let node = NODES[self.rng.below(2) as usize];
        let rid = self.next_rid;
        self.next_rid += 1;
        let wait = Duration::from_millis(10 * self.rng.below(3));
        // The client's id rides in the payload, so the check knows what each send carried.
        let inner = Frame::Publish {
            request_id: rid,
            stream: StreamName::new("t", "n", "s"),
            shard: ShardSelector::Shard(0),
            ack: true,
            records: Records::encode([rid.to_le_bytes().as_slice()]),
        };
        let client = FwdClient::Request {
            conn: 5,
            stream: 0,
            request_id: rid,
            cache: false,
        };
        match self.links.forward(
            self.now,
            target(node),
            &inner,
            client,
            Lane::Publish,
            wait,
            None,
        ) {
            Ok(()) => {
                let t = Track {
                    deadline: Some(self.now + wait + FORWARD_TIMEOUT),
                    ..Track::default()
                };
                self.tracks.insert(rid, t);
            }
            Err(_) => self.covered.refused_at_once += 1,
        }
    }

    fn owner_answers(&mut self) {
        let Some(key) = self.pick_conn() else { return };
        let c = self.conns.get_mut(&key).expect("picked");
        if c.pending.is_empty() || self.frozen[(c.node - 2) as usize] {
            return;
        }
        let i = self.rng.below(c.pending.len() as u64) as usize;
        let id = c.pending.remove(i);
        let ack = Frame::PublishAck {
            request_id: id,
            shard: 0,
            first_offset: 0,
            count: 1,
            owner: 0,
        };
        self.links.on_frame(self.now, key, ack);
    }

    /// Carry the table's effects out, as the core's driver does, and check each answer.
    fn effects(&mut self) -> Result<(), String> {
        loop {
            let effects = self.links.drain_effects();
            if effects.is_empty() {
                return Ok(());
            }
            for e in effects {
                match e {
                    LinkEffect::Dial { node, .. } => self.dials.push(node),
                    LinkEffect::Send { key, bytes, .. } => self.sent(key, &bytes)?,
                    LinkEffect::Close { key } => {
                        if self.conns.remove(&key).is_some() {
                            self.links.on_closed(self.now, key, "closed".into());
                        }
                    }
                    LinkEffect::Answer { client, answer, .. } => self.answered(client, *answer)?,
                }
            }
        }
    }

    fn sent(&mut self, key: ConnKey, bytes: &[u8]) -> Result<(), String> {
        let mut r = felix_quic::wire::FrameReader::new(1 << 24);
        r.push(bytes);
        while let Some(f) = r
            .next_frame()
            .map_err(|e| format!("undecodable send: {e:?}"))?
        {
            match f {
                Frame::Peer(PeerFrame::PeerHello { .. }) => {
                    if let Some(c) = self.conns.get_mut(&key) {
                        c.hello_sent = true;
                    }
                }
                Frame::Peer(PeerFrame::Forward { inner, .. }) => {
                    let Frame::Publish {
                        request_id: link_id,
                        records,
                        ..
                    } = *inner
                    else {
                        return Err("a forward carried something else".into());
                    };
                    let p = records.iter().next().ok_or("empty forward")?;
                    let rid = u64::from_le_bytes(p[..8].try_into().map_err(|_| "short")?);
                    let t = self.tracks.get_mut(&rid).ok_or("a forward never taken")?;
                    t.sent = true;
                    self.by_link_id.insert(link_id, rid);
                    if let Some(c) = self.conns.get_mut(&key) {
                        t.received = true;
                        c.pending.push(link_id);
                    }
                }
                other => return Err(format!("sent {other:?}")),
            }
        }
        Ok(())
    }

    fn answered(&mut self, client: FwdClient, answer: FwdAnswer) -> Result<(), String> {
        let FwdClient::Request {
            request_id: rid, ..
        } = client
        else {
            return Err("a publish client in a request-only run".into());
        };
        let t = self
            .tracks
            .get_mut(&rid)
            .ok_or(format!("answer for {rid}, never forwarded"))?;
        if t.answered {
            return Err(format!("INVARIANT answered_once: {rid} answered twice"));
        }
        t.answered = true;
        match answer {
            FwdAnswer::Frame(..) if t.received => self.covered.answered_by_owner += 1,
            FwdAnswer::Frame(..) => {
                return Err(format!(
                    "INVARIANT typed_truthfully: {rid} answered by an owner that never got it"
                ))
            }
            FwdAnswer::Refused(r) if r.code == ErrorCode::Unavailable => {
                if t.sent {
                    return Err(format!(
                        "INVARIANT typed_truthfully: {rid} was sent, answered unavailable (nothing was done): {}",
                        r.message
                    ));
                }
                self.covered.unavailable += 1;
            }
            FwdAnswer::Refused(r) if r.code == ErrorCode::OutcomeUnknown => {
                if !t.sent {
                    return Err(format!(
                        "INVARIANT typed_truthfully: {rid} never sent, answered outcome_unknown"
                    ));
                }
                self.covered.outcome_unknown += 1;
            }
            FwdAnswer::Refused(r) => return Err(format!("unexpected refusal {r:?}")),
        }
        Ok(())
    }

    fn overdue(&self) -> Result<(), String> {
        for (rid, t) in &self.tracks {
            if !t.answered && t.deadline.is_some_and(|d| d <= self.now) {
                return Err(format!(
                    "INVARIANT none_overdue: {rid} unanswered past its deadline"
                ));
            }
        }
        Ok(())
    }
}

fn run(seed: u64) -> Result<Covered, String> {
    let mut r = Run::new(seed);
    for _ in 0..300 {
        r.step().map_err(|e| format!("seed {seed}: {e}"))?;
    }
    // At rest: time moves past every deadline.
    r.now += Duration::from_secs(10);
    r.links.tick(r.now);
    r.effects().map_err(|e| format!("seed {seed}: {e}"))?;
    if let Some((rid, _)) = r.tracks.iter().find(|(_, t)| !t.answered) {
        return Err(format!(
            "seed {seed}: INVARIANT nothing_forgotten: {rid} never answered"
        ));
    }
    Ok(r.covered)
}

fn seeds() -> Vec<u64> {
    super::sim::seeds_from_env("FELIX_PEER_SEED", "FELIX_PEER_SEEDS", 1000)
}

#[test]
fn peer_links_answer_every_forward_once_typed_and_in_time() {
    let mut total = Covered::default();
    for seed in seeds() {
        let c = run(seed).unwrap_or_else(|e| {
            panic!(
                "{e}\nreplay: FELIX_PEER_SEED={seed} cargo nextest run -p felix-broker peer_check"
            )
        });
        total.answered_by_owner += c.answered_by_owner;
        total.outcome_unknown += c.outcome_unknown;
        total.unavailable += c.unavailable;
        total.refused_at_once += c.refused_at_once;
    }
    // Every way a forward ends was reached.
    assert!(
        total.answered_by_owner > 0
            && total.outcome_unknown > 0
            && total.unavailable > 0
            && total.refused_at_once > 0,
        "coverage {total:?}"
    );
}

/// The negative twins: each broken rule is caught within the first seeds.
fn caught(b: &std::sync::atomic::AtomicBool, rules: &[&str]) {
    b.store(true, std::sync::atomic::Ordering::Relaxed);
    let found = (0..200).find_map(|s| run(s).err());
    b.store(false, std::sync::atomic::Ordering::Relaxed);
    let e = found.unwrap_or_else(|| panic!("the broken rule went unnoticed ({rules:?})"));
    assert!(rules.iter().any(|r| e.contains(r)), "{e}");
}

#[test]
fn the_check_catches_a_sent_forward_answered_as_never_sent() {
    caught(&breaks::SENT_AS_UNSENT, &["typed_truthfully"]);
}

#[test]
fn the_check_catches_forwards_forgotten_on_a_break() {
    // Forgotten forwards are seen past their deadline, or at rest.
    caught(
        &breaks::FORGET_ON_BREAK,
        &["none_overdue", "nothing_forgotten"],
    );
}

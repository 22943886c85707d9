//! The cluster simulator: three brokers, each a `World` (its cores, stream shard hosts and
//! disk twin) with its own catalog view and the real peer link table (`core::peer::Links`),
//! joined by a simulated network of peer links. A client's publish passes the real shard
//! admission (`admit::shard_admit`) at the broker it was sent to, and a forward passes it
//! again at the broker it reaches. A seed picks every next event:
//! - a broker's world steps (mesh, disk, I/O, its clock);
//! - a client publishes through any broker to any shard;
//! - a link is dialed, finishes its handshake, carries one frame either way, or is cut;
//! - an ephemeral shard moves to another broker (generation + 1), and each broker learns
//!   of it from its own catalog feed at its own later time, so brokers disagree meanwhile;
//! - a broker freezes (SIGSTOP: nothing it does or receives moves) and thaws, or crashes
//!   and restarts from its disk;
//! - a broker's clock moves and its links are ticked.
//!
//! Invariants, after every event (per broker, the single-broker `check::after_step` too):
//! - `answered_once`: each client publish gets at most one answer;
//! - `forwarded_once`: a publish crosses at most one link (a forward is never forwarded
//!   again, even while two brokers disagree about the owner);
//! - `answers_truthful`: an acknowledgement is exactly what the owner's log acknowledged
//!   (offset, count and owner node), and a refusal other than `outcome_unknown` means no
//!   broker appended the records;
//!
//! and once the run is at rest (`check::at_rest` per broker too): `nothing_forgotten`, every
//! publish of a client whose broker lived is answered.
//!
//! `FELIX_CLUSTER_SEED=N` replays seed N and prints its trace; `FELIX_CLUSTER_SEEDS` sets
//! how many seeds run (default 300). Negative twins: `admit::breaks::FORWARD_AGAIN` (a
//! forward admitted as a client's request) and `peer::breaks::SENT_AS_UNSENT` (a broken link
//! answers a sent forward "nothing was done") are each caught.

mod run;

use super::scenarios::def;
use super::{Rng, World, CORES};
use crate::catalog::{Catalog, ControlView, ViewPlace, ViewStream};
use crate::core::admit::{shard_admit, Asker, ShardAdmit};
use crate::core::peer::{FwdAnswer, FwdClient, Lane, LinkEffect, Links, LinksCfg};
use crate::core::{Origin, ShardKey};
use bytes::Bytes;
use felix_quic::server::ConnKey;
use felix_quic::wire::{
    ErrorCode, ForwardHead, Frame, FrameReader, PeerFrame, Records, ShardSelector, StreamName,
};
use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

const NODES: u64 = 3;
const CLUSTER: &str = "sim";
const FORWARD_TIMEOUT: Duration = Duration::from_millis(200);
const CONNECT_TIMEOUT: Duration = Duration::from_millis(300);
/// Slot 0 is ephemeral (its shards move), slot 1 durable (its shards stay put).
const STREAMS: [(&str, bool); 2] = [("eph", false), ("dur", true)];
/// The link stream each lane uses, as the driver maps them.
const LANE_STREAMS: [u64; 2] = [0, 4];

fn lane_index(lane: Lane) -> usize {
    match lane {
        Lane::Control => 0,
        Lane::Publish => 1,
        // Nothing in this simulator sends replica messages (no shard has replicas here).
        Lane::Replication => unreachable!("the cluster simulator hosts no replicas"),
    }
}

struct Node {
    id: u64,
    world: World,
    links: Links,
    frozen: bool,
    /// Catalog versions the control plane published that this broker has not applied yet.
    feed: VecDeque<ControlView>,
}

/// One peer link: dialed by `from`, accepted by `to` (its session lives on `to`'s core
/// `core`). Each direction keeps one FIFO per lane, as a QUIC stream does.
struct Wire {
    from: u64,
    to: u64,
    core: u8,
    established: bool,
    up: [VecDeque<Bytes>; 2],
    down: [VecDeque<Frame>; 2],
}

/// A client's publish.
struct Req {
    node: u64,
    key: ShardKey,
    answers: Vec<Result<(u64, u32, u64), ErrorCode>>,
    /// `Forward` frames that carried it onto a link.
    forwards_sent: u32,
    /// Where it was handed to a broker's shard host: (node, that world's publish id).
    handed: Vec<(u64, u64)>,
    /// The broker it was sent to crashed before answering: nothing more is owed.
    lost: bool,
}

/// Who a publish handed to a world answers.
#[derive(Clone, Copy)]
enum AnswerTo {
    Client(u64),
    Link {
        key: ConnKey,
        lane: usize,
        link_id: u64,
    },
}

#[derive(Default, Debug)]
struct Covered {
    acked_local: u64,
    acked_forwarded: u64,
    outcome_unknown: u64,
    unavailable: u64,
    refused_by_owner: u64,
    moves: u64,
}

struct Cluster {
    rng: Rng,
    nodes: Vec<Node>,
    view: ControlView,
    wires: BTreeMap<ConnKey, Wire>,
    dials: Vec<(u64, u64)>,
    next_key: ConnKey,
    reqs: BTreeMap<u64, Req>,
    /// Publishes handed to a broker's world and not answered yet: (node, publish id).
    served: BTreeMap<(u64, u64), AnswerTo>,
    /// Who has owned each ephemeral shard (a shard moves only to a broker new to it, so an
    /// ephemeral shard's offsets restart once per owner).
    owned: BTreeMap<u32, Vec<u64>>,
    steps: u64,
    trace: VecDeque<String>,
    covered: Covered,
}

fn stream_name(slot: u32) -> StreamName {
    StreamName::new("t", "ns", STREAMS[slot as usize].0)
}

fn links_cfg(node_id: u64) -> LinksCfg {
    LinksCfg {
        node_id,
        max_frame_bytes: 1 << 20,
        connect_timeout: CONNECT_TIMEOUT,
        forward_timeout: FORWARD_TIMEOUT,
        forwards_max: 8,
    }
}

fn new_links(node_id: u64) -> Links {
    let mut l = Links::new(links_cfg(node_id));
    l.set_cluster_id(CLUSTER);
    l
}

/// The gid a payload was made for (`g{gid}.{i}`).
fn gid_of(payload: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(payload).ok()?;
    s.strip_prefix('g')?.split('.').next()?.parse().ok()
}

fn decode_all(bytes: &[u8]) -> Result<Vec<Frame>, String> {
    let mut r = FrameReader::new(1 << 24);
    r.push(bytes);
    let mut out = Vec::new();
    while let Some(f) = r
        .next_frame()
        .map_err(|e| format!("undecodable link bytes: {e:?}"))?
    {
        out.push(f);
    }
    Ok(out)
}

impl Cluster {
    fn new(seed: u64) -> Cluster {
        let mut rng = Rng::new(seed);
        let mut view = ControlView {
            revision: 1,
            cluster_id: CLUSTER.into(),
            ..Default::default()
        };
        view.tenants.insert("t".into());
        view.namespaces.insert(("t".into(), "ns".into()));
        for n in 1..=NODES {
            view.broker_addrs.insert(n, format!("127.0.0.{n}:7400"));
            view.peer_addrs.insert(n, format!("127.0.0.{n}:7402"));
        }
        let mut owned = BTreeMap::new();
        for (i, (name, durable)) in STREAMS.into_iter().enumerate() {
            let placement: Vec<ViewPlace> = (0..2)
                .map(|shard| {
                    let owner = 1 + rng.below(NODES);
                    if !durable {
                        owned.insert(shard, vec![owner]);
                    }
                    ViewPlace::Assigned {
                        owner,
                        generation: 1,
                    }
                })
                .collect();
            view.streams.push(ViewStream {
                def: def(name, durable),
                incarnation: 1 + i as u64,
                deleting: false,
                placement,
            });
        }
        let nodes = (1..=NODES)
            .map(|id| {
                let catalog = Catalog::from_view(&Catalog::default(), &view, id, false);
                Node {
                    id,
                    world: World::new(seed.wrapping_mul(31).wrapping_add(id), catalog),
                    links: new_links(id),
                    frozen: false,
                    feed: VecDeque::new(),
                }
            })
            .collect();
        Cluster {
            rng,
            nodes,
            view,
            wires: BTreeMap::new(),
            dials: Vec::new(),
            next_key: 1000,
            reqs: BTreeMap::new(),
            served: BTreeMap::new(),
            owned,
            steps: 0,
            trace: VecDeque::new(),
            covered: Covered::default(),
        }
    }

    fn note(&mut self, s: String) {
        if self.trace.len() == 80 {
            self.trace.pop_front();
        }
        self.trace.push_back(format!("[{}] {s}", self.steps));
    }

    fn node(&mut self, id: u64) -> &mut Node {
        &mut self.nodes[(id - 1) as usize]
    }

    fn frozen(&self, id: u64) -> bool {
        self.nodes[(id - 1) as usize].frozen
    }

    // ---------- requests: admission, forwarding, answers ----------

    /// A client publishes through broker `node`.
    fn client_publish(&mut self, node: u64) {
        let gid = self.reqs.len() as u64 + 1;
        let key = (self.rng.below(2) as u32, self.rng.below(2) as u32);
        let n = 1 + self.rng.below(3);
        let payloads: Vec<Bytes> = (0..n).map(|i| Bytes::from(format!("g{gid}.{i}"))).collect();
        self.note(format!(
            "client publish g{gid} of {n} to {key:?} via broker {node}"
        ));
        self.reqs.insert(
            gid,
            Req {
                node,
                key,
                answers: Vec::new(),
                forwards_sent: 0,
                handed: Vec::new(),
                lost: false,
            },
        );
        let core = self.rng.below(CORES as u64) as u8;
        self.route(node, core, key, payloads, None, AnswerTo::Client(gid));
    }

    /// Admit a publish at broker `node` and serve, forward or refuse it.
    fn route(
        &mut self,
        node: u64,
        core: u8,
        key: ShardKey,
        payloads: Vec<Bytes>,
        forwarded: Option<&ForwardHead>,
        to: AnswerTo,
    ) {
        let gid = gid_of(&payloads[0]).expect("simulated payloads name their request");
        let n = self.node(node);
        let asker = Asker {
            node_id: node,
            forwarded,
            links: true,
            frame_bytes_max: 1 << 20,
            principal: "",
        };
        match shard_admit(&n.world.catalog, &asker, false, key.0, key.1) {
            Ok(ShardAdmit::Serve) => {
                let wid = n.world.publish_payloads(core, key, payloads);
                self.reqs
                    .get_mut(&gid)
                    .expect("a request")
                    .handed
                    .push((node, wid));
                self.served.insert((node, wid), to);
            }
            Ok(ShardAdmit::Forward(target)) => {
                let records = Records::encode(payloads.iter().map(|p| &p[..]));
                let inner = Frame::Publish {
                    request_id: gid,
                    stream: stream_name(key.0),
                    shard: ShardSelector::Shard(key.1),
                    ack: true,
                    records: records.clone(),
                };
                let (conn, request_id, quic_stream) = match to {
                    AnswerTo::Client(gid) => (0, gid, 4),
                    AnswerTo::Link { key, lane, link_id } => (key, link_id, LANE_STREAMS[lane]),
                };
                let origin = Origin {
                    core,
                    conn,
                    quic_stream,
                    request_id,
                    ack: true,
                    bytes: records.payload_bytes() as u64,
                };
                let now = n.world.now();
                let r = n.links.forward(
                    now,
                    target,
                    &inner,
                    FwdClient::Publish(origin),
                    Lane::Publish,
                    Duration::ZERO,
                    None,
                );
                if let Err(refusal) = r {
                    self.answer(to, node, Err(refusal.code));
                }
                self.link_effects(node);
            }
            Err(crate::core::Refusal { code, .. }) => {
                if forwarded.is_some() {
                    self.covered.refused_by_owner += 1;
                }
                self.answer(to, node, Err(code));
            }
        }
    }

    /// Answer `to` from broker `node`: a client's answer, or a frame back down a link.
    fn answer(&mut self, to: AnswerTo, node: u64, r: Result<(u64, u32, u64), ErrorCode>) {
        match to {
            AnswerTo::Client(gid) => {
                self.note(format!("g{gid} answered at broker {node}: {r:?}"));
                let req = self.reqs.get_mut(&gid).expect("a request");
                match r {
                    Ok((.., owner)) if owner == req.node => self.covered.acked_local += 1,
                    Ok(_) => self.covered.acked_forwarded += 1,
                    Err(ErrorCode::OutcomeUnknown) => self.covered.outcome_unknown += 1,
                    Err(ErrorCode::Unavailable) => self.covered.unavailable += 1,
                    Err(_) => {}
                }
                req.answers.push(r);
            }
            AnswerTo::Link { key, lane, link_id } => {
                let frame = match r {
                    Ok((first_offset, count, owner)) => Frame::PublishAck {
                        request_id: link_id,
                        shard: 0,
                        first_offset,
                        count,
                        owner,
                    },
                    Err(code) => Frame::Error {
                        request_id: link_id,
                        code: code.number(),
                        message: format!("refused by broker {node}"),
                    },
                };
                // A link cut meanwhile loses the answer (the forwarder says outcome_unknown).
                if let Some(w) = self.wires.get_mut(&key) {
                    w.down[lane].push_back(frame);
                }
            }
        }
    }

    /// Publishes handed to a world that its shard host has answered since: pass the answer on.
    fn collect_answers(&mut self) {
        // (node, publish id) → its answer, or None: lost in a crash.
        type Done = ((u64, u64), Option<Result<(u64, u32), ErrorCode>>);
        let done: Vec<Done> = self
            .served
            .keys()
            .filter_map(|&(node, wid)| {
                let p = &self.nodes[(node - 1) as usize].world.pubs[&wid];
                if let Some(a) = p.answers.first() {
                    Some(((node, wid), Some(*a)))
                } else if p.lost {
                    Some(((node, wid), None))
                } else {
                    None
                }
            })
            .collect();
        for (k, a) in done {
            let to = self.served.remove(&k).expect("listed");
            match a {
                Some(a) => self.answer(to, k.0, a.map(|(first, count)| (first, count, k.0))),
                None => {
                    if let AnswerTo::Client(gid) = to {
                        self.reqs.get_mut(&gid).expect("a request").lost = true;
                    }
                }
            }
        }
    }

    /// Carry out what broker `node`'s link table decided.
    fn link_effects(&mut self, node: u64) {
        for _ in 0..1000 {
            let effects = self.node(node).links.drain_effects();
            if effects.is_empty() {
                return;
            }
            for e in effects {
                match e {
                    LinkEffect::Dial { node: to, .. } => self.dials.push((node, to)),
                    LinkEffect::Send { key, lane, bytes } => {
                        for f in decode_all(&bytes).expect("a link sends whole frames") {
                            if let Frame::Peer(PeerFrame::Forward { inner, .. }) = f {
                                if let Frame::Publish { records, .. } = *inner {
                                    let p = records.iter().next().expect("records");
                                    let gid = gid_of(&p).expect("a simulated payload");
                                    self.reqs.get_mut(&gid).expect("a request").forwards_sent += 1;
                                    self.note(format!("broker {node} forwards g{gid} on {key}"));
                                }
                            }
                        }
                        let w = self.wires.get_mut(&key).expect("links send on live wires");
                        w.up[lane_index(lane)].push_back(bytes);
                    }
                    LinkEffect::Close { key } => {
                        if self.wires.remove(&key).is_some() {
                            let n = self.node(node);
                            let now = n.world.now();
                            n.links.on_closed(now, key, "closed".into());
                        }
                    }
                    LinkEffect::Answer { client, answer, .. } => {
                        let FwdClient::Publish(origin) = client else {
                            panic!("the cluster simulation forwards publishes only");
                        };
                        let r = match *answer {
                            FwdAnswer::Frame(
                                Frame::PublishAck {
                                    first_offset,
                                    count,
                                    owner,
                                    ..
                                },
                                _,
                            ) => Ok((first_offset, count, owner)),
                            FwdAnswer::Frame(Frame::Error { code, .. }, _) => {
                                Err(ErrorCode::from_number(code).expect("a registered code"))
                            }
                            FwdAnswer::Frame(other, _) => panic!("answered with {other:?}"),
                            FwdAnswer::Refused(r) => Err(r.code),
                        };
                        let to = if origin.conn == 0 {
                            AnswerTo::Client(origin.request_id)
                        } else {
                            AnswerTo::Link {
                                key: origin.conn,
                                lane: LANE_STREAMS
                                    .iter()
                                    .position(|s| *s == origin.quic_stream)
                                    .expect("a lane's stream"),
                                link_id: origin.request_id,
                            }
                        };
                        self.answer(to, node, r);
                    }
                }
            }
        }
        panic!("broker {node}'s link effects do not settle");
    }

    // ---------- the network ----------

    /// Dial `i` of the pending dials completes at its broker.
    fn dial(&mut self, i: usize) {
        let (from, to) = self.dials.swap_remove(i);
        let key = self.next_key;
        self.next_key += 1;
        let core = self.rng.below(CORES as u64) as u8;
        self.note(format!("broker {from} dials {to}: link {key}"));
        self.wires.insert(
            key,
            Wire {
                from,
                to,
                core,
                established: false,
                up: Default::default(),
                down: Default::default(),
            },
        );
        self.node(from).links.on_dialed(to, key);
        self.link_effects(from);
    }

    fn establish(&mut self, key: ConnKey) {
        let w = self.wires.get_mut(&key).expect("picked");
        w.established = true;
        let from = w.from;
        self.note(format!("link {key} established"));
        self.node(from).links.on_established(key);
        self.link_effects(from);
    }

    /// One frame (or send) crosses link `key`, upward (to the owner) or downward.
    fn carry(&mut self, key: ConnKey, up: bool, lane: usize) {
        let w = self.wires.get_mut(&key).expect("picked");
        let (from, to, core) = (w.from, w.to, w.core);
        if !up {
            let frame = w.down[lane].pop_front().expect("picked");
            let n = self.node(from);
            let now = n.world.now();
            n.links.on_frame(now, key, frame);
            self.link_effects(from);
            return;
        }
        let bytes = w.up[lane].pop_front().expect("picked");
        for f in decode_all(&bytes).expect("whole frames") {
            match f {
                Frame::Peer(PeerFrame::PeerHello { .. }) => {
                    let ok = Frame::Peer(PeerFrame::PeerHelloOk {
                        node_id: to,
                        cluster_id: CLUSTER.into(),
                        capabilities: 1,
                        max_frame_bytes: 1 << 20,
                    });
                    if let Some(w) = self.wires.get_mut(&key) {
                        w.down[0].push_back(ok);
                    }
                }
                Frame::Peer(PeerFrame::Forward { head, inner }) => {
                    let Frame::Publish {
                        request_id: link_id,
                        stream,
                        shard: ShardSelector::Shard(shard),
                        records,
                        ..
                    } = *inner
                    else {
                        panic!("the cluster simulation forwards publishes to a shard only");
                    };
                    let idx = self
                        .node(to)
                        .world
                        .catalog
                        .lookup(&stream)
                        .expect("the simulated streams stay")
                        .0 as u32;
                    let payloads: Vec<Bytes> = records.iter().collect();
                    let gid = gid_of(&payloads[0]).expect("a simulated payload");
                    self.note(format!("broker {to} receives g{gid} on link {key}"));
                    let answer_to = AnswerTo::Link { key, lane, link_id };
                    self.route(to, core, (idx, shard), payloads, Some(&head), answer_to);
                }
                other => panic!("a link carried {other:?}"),
            }
        }
    }

    fn cut(&mut self, key: ConnKey) {
        let w = self.wires.remove(&key).expect("picked");
        self.note(format!("link {key} ({} -> {}) is cut", w.from, w.to));
        let n = self.node(w.from);
        let now = n.world.now();
        n.links.on_closed(now, key, "cut".into());
        self.link_effects(w.from);
    }

    // ---------- the control plane and the brokers' lives ----------

    /// An ephemeral shard moves to a broker that never owned it; each broker hears later.
    fn move_shard(&mut self) -> bool {
        let shard = self.rng.below(2) as u32;
        let had = self.owned.get(&shard).cloned().unwrap_or_default();
        let fresh: Vec<u64> = (1..=NODES).filter(|n| !had.contains(n)).collect();
        if fresh.is_empty() {
            return false;
        }
        let owner = fresh[self.rng.below(fresh.len() as u64) as usize];
        let place = &mut self.view.streams[0].placement[shard as usize];
        let ViewPlace::Assigned { generation, .. } = *place else {
            unreachable!("simulated shards are always assigned")
        };
        *place = ViewPlace::Assigned {
            owner,
            generation: generation + 1,
        };
        self.view.revision += 1;
        self.owned.entry(shard).or_default().push(owner);
        self.covered.moves += 1;
        self.note(format!(
            "shard {shard} of eph moves to broker {owner} (generation {})",
            generation + 1
        ));
        for n in &mut self.nodes {
            n.feed.push_back(self.view.clone());
        }
        true
    }

    fn apply_feed(&mut self, node: u64) {
        let n = self.node(node);
        let view = n.feed.pop_front().expect("picked");
        let c = Catalog::from_view(&n.world.catalog, &view, node, false);
        n.world.set_catalog(c);
        self.note(format!(
            "broker {node} applies catalog revision {}",
            view.revision
        ));
    }

    /// Broker `node`'s process dies and starts again: its links break at both ends.
    fn crash(&mut self, node: u64) {
        self.note(format!("broker {node} crashes and restarts"));
        self.node(node).world.crash(false);
        let keys: Vec<ConnKey> = self
            .wires
            .iter()
            .filter(|(_, w)| w.from == node || w.to == node)
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            let w = self.wires.remove(&key).expect("listed");
            if w.to == node {
                let n = self.node(w.from);
                let now = n.world.now();
                n.links.on_closed(now, key, "peer restarted".into());
                self.link_effects(w.from);
            }
        }
        self.dials.retain(|(from, _)| *from != node);
        // Its own link table starts empty; the forwards it held die with the process.
        self.node(node).links = new_links(node);
        for r in self.reqs.values_mut() {
            if r.node == node && r.answers.is_empty() {
                r.lost = true;
            }
        }
    }

    fn advance(&mut self, node: u64, ms: u64) {
        let n = self.node(node);
        n.world.advance(ms);
        let now = n.world.now();
        n.links.tick(now);
        self.link_effects(node);
    }
}

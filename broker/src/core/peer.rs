//! Peer links: this core's connections to other brokers and the forwards in flight on them
//! (the forwarding side; the owner side is an ordinary session on the peer listener, see
//! `conn::peer_in`).
//!
//! Pure, like the shard hosts: it is handed what happened (a request to forward, a link
//! dialed or established, an answer, a close) and the time, and returns effects (dial, send
//! bytes on a link, answer a client). It never reads a clock or touches a socket; the core's
//! driver (`conn::peer_out`) carries the effects out.
//!
//! Rules it keeps:
//! - every forward is answered exactly once: by the owner's answer, or, when the link
//!   breaks, the owner is unreachable or the answer is late, by a typed refusal. A forward
//!   never sent is refused `unavailable` (nothing was applied); one sent and not answered is
//!   `outcome_unknown` (it may have been applied);
//! - bounded: at most `forwards_max` forwards per link, waiting or in flight;
//! - a broken link is dialed again after a backoff that doubles up to `BACKOFF_MAX`;
//!   forwards that arrive meanwhile are refused at once rather than queued behind it.

use super::shard::Refusal;
use super::Origin;
use bytes::{Bytes, BytesMut};
use felix_quic::server::ConnKey;
use felix_quic::wire::{patch_request_id, peer, ErrorCode, ForwardHead, Frame, PeerFrame};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The first wait before dialing a broken link again; it doubles per failure.
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
/// The longest wait between dials of one link.
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Settings of the links of one core.
#[derive(Debug, Clone)]
pub(in crate::core) struct LinksCfg {
    pub node_id: u64,
    pub max_frame_bytes: u32,
    pub connect_timeout: Duration,
    pub forward_timeout: Duration,
    pub forwards_max: usize,
}

/// Where a forward goes, as the catalog says.
#[derive(Debug, Clone)]
pub(in crate::core) struct FwdTarget {
    pub node: u64,
    pub addr: String,
    pub head: ForwardHead,
}

/// Who a forward answers.
#[derive(Debug, Clone)]
pub(in crate::core) enum FwdClient {
    /// A publish: answered through the publish path (its caps and stream accounting).
    Publish(Origin),
    /// A cache or group request: answered on the client's stream under its own id.
    Request {
        conn: ConnKey,
        stream: u64,
        request_id: u64,
        /// A cache request (counted in the session's `cache_inflight` until answered).
        cache: bool,
    },
}

impl FwdClient {
    fn request_id(&self) -> u64 {
        match self {
            FwdClient::Publish(o) => o.request_id,
            FwdClient::Request { request_id, .. } => *request_id,
        }
    }

    fn conn(&self) -> ConnKey {
        match self {
            FwdClient::Publish(o) => o.conn,
            FwdClient::Request { conn, .. } => *conn,
        }
    }
}

/// Which stream of a link a forward travels on. Publishes have their own, at a lower
/// urgency than the control stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::core) enum Lane {
    Control,
    Publish,
}

/// The answer a client gets for its forward.
#[derive(Debug)]
pub(in crate::core) enum FwdAnswer {
    /// The owner's answer as it came (under the link's id), and encoded with the client's
    /// request id written back.
    Frame(Frame, Bytes),
    Refused(Refusal),
}

#[derive(Debug)]
pub(in crate::core) enum LinkEffect {
    /// Dial `node` at `addr` (then report `on_dialed` or `on_dial_failed`).
    Dial { node: u64, addr: SocketAddr },
    /// Queue these bytes (one or more whole frames) on the link's lane.
    Send {
        key: ConnKey,
        lane: Lane,
        bytes: Bytes,
    },
    /// Close a link that timed out dialing.
    Close { key: ConnKey },
    /// Answer a client whose forward went to broker `node`.
    Answer {
        client: FwdClient,
        answer: Box<FwdAnswer>,
        node: u64,
    },
}

struct Fwd {
    client: FwdClient,
    lane: Lane,
    /// The encoded `Forward`, until it is handed to the link.
    unsent: Option<Bytes>,
    deadline: Instant,
    /// A long poll's cancel, encoded under this forward's link id: sent when the client
    /// cancels it or its connection closes, so the owner stops holding it.
    cancel: Option<Bytes>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Dial asked for, no connection yet.
    Dialing {
        until: Instant,
    },
    /// Connection made, handshake (QUIC, TLS, PeerHello) under way.
    Opening {
        key: ConnKey,
        until: Instant,
    },
    Ready {
        key: ConnKey,
    },
    /// Broken; dialed again on the first forward after `until`.
    Backoff {
        until: Instant,
    },
}

struct Link {
    addr: SocketAddr,
    state: State,
    failures: u32,
    /// Why it last failed (said in refusals during the backoff).
    last_error: String,
    hello_sent: bool,
    /// The largest frame the owner takes (its `PeerHelloOk`; this broker's own until then).
    peer_max_frame_bytes: usize,
    fwds: BTreeMap<u64, Fwd>,
    /// Forwards not yet handed to the link, in arrival order.
    waiting: VecDeque<u64>,
}

pub(in crate::core) struct Links {
    cfg: LinksCfg,
    cluster_id: String,
    links: HashMap<u64, Link>,
    by_key: HashMap<ConnKey, u64>,
    /// Links this table closed that the driver has not reaped yet: still links (their late
    /// packets are not a client's), already failed.
    closing: std::collections::HashSet<ConnKey>,
    /// Forward id → node, for answers and deadlines.
    owner_of: HashMap<u64, u64>,
    deadlines: BTreeMap<(Instant, u64), ()>,
    next_id: u64,
    effects: Vec<LinkEffect>,
}

impl Links {
    pub fn new(cfg: LinksCfg) -> Self {
        Links {
            cfg,
            cluster_id: String::new(),
            links: HashMap::new(),
            by_key: HashMap::new(),
            closing: Default::default(),
            owner_of: HashMap::new(),
            deadlines: BTreeMap::new(),
            next_id: 1,
            effects: Vec::new(),
        }
    }

    /// The cluster this core's catalog names (sent in `PeerHello`, checked in the answer).
    pub fn set_cluster_id(&mut self, id: &str) {
        if self.cluster_id != id {
            self.cluster_id = id.to_string();
        }
    }

    pub fn is_link(&self, key: ConnKey) -> bool {
        self.by_key.contains_key(&key) || self.closing.contains(&key)
    }

    /// Close link `key` (the driver closes the connection; its reaping is not a failure again).
    fn close(&mut self, key: ConnKey) {
        self.closing.insert(key);
        self.effects.push(LinkEffect::Close { key });
    }

    /// Forwards waiting or in flight (a draining core waits for them to be answered).
    pub fn in_flight(&self) -> usize {
        self.owner_of.len()
    }

    pub fn drain_effects(&mut self) -> Vec<LinkEffect> {
        std::mem::take(&mut self.effects)
    }

    pub fn next_deadline(&self) -> Option<Instant> {
        let fwd = self.deadlines.keys().next().map(|(t, _)| *t);
        let link = self
            .links
            .values()
            .filter_map(|l| match l.state {
                State::Dialing { until } | State::Opening { until, .. } => Some(until),
                _ => None,
            })
            .min();
        fwd.into_iter().chain(link).min()
    }

    /// Forward `inner` (the client's request, with its own id) to `target`. `wait` is how
    /// long the request itself may take at the owner (a publish's timeout, a long poll's
    /// wait); the answer may come `forward_timeout` after that. Refused at once, with
    /// nothing sent, when the link is down or full.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        now: Instant,
        target: FwdTarget,
        inner: &Frame,
        client: FwdClient,
        lane: Lane,
        wait: Duration,
        cancel: Option<&Frame>,
    ) -> Result<(), Refusal> {
        let addr: SocketAddr = target.addr.parse().map_err(|_| {
            Refusal::new(
                ErrorCode::Unavailable,
                format!(
                    "broker {} registered peer address {:?}, which has not resolved to an address yet; nothing was sent",
                    target.node, target.addr
                ),
            )
        })?;
        let max = self.cfg.forwards_max;
        let own_max = self.cfg.max_frame_bytes as usize;
        let link = self.links.entry(target.node).or_insert_with(|| Link {
            addr,
            state: State::Backoff { until: now },
            failures: 0,
            last_error: String::new(),
            hello_sent: false,
            peer_max_frame_bytes: own_max,
            fwds: BTreeMap::new(),
            waiting: VecDeque::new(),
        });
        if link.addr != addr {
            // Re-registered elsewhere: a link to the old address is dropped (what it carries
            // is answered), and the next dial goes to the new one.
            let old = std::mem::replace(&mut link.addr, addr);
            if let State::Opening { key, .. } | State::Ready { key } = link.state {
                self.close(key);
                let why = format!("broker {} moved from {old} to {addr}", target.node);
                self.fail_link(now, target.node, why);
                // Dialed again at once, not after a backoff: nothing failed at the new address.
                let link = self.links.get_mut(&target.node).expect("present");
                link.state = State::Backoff { until: now };
                link.failures = 0;
            }
        }
        let link = self.links.get_mut(&target.node).expect("inserted above");
        if link.fwds.len() >= max {
            return Err(Refusal::new(
                ErrorCode::InflightLimit,
                format!(
                    "{max} forwards already wait for broker {} on this core (peer_forwards_max); nothing was sent",
                    target.node
                ),
            ));
        }
        if let State::Backoff { until } = link.state {
            if now < until {
                return Err(Refusal::new(
                    ErrorCode::Unavailable,
                    format!(
                        "the link to broker {} is down ({}); nothing was sent",
                        target.node, link.last_error
                    ),
                ));
            }
            link.state = State::Dialing {
                until: now + self.cfg.connect_timeout,
            };
            link.hello_sent = false;
            self.effects.push(LinkEffect::Dial {
                node: target.node,
                addr,
            });
        }
        let id = self.next_id;
        let bytes = encode_forward(&target.head, inner, id);
        if bytes.len() > link.peer_max_frame_bytes {
            return Err(Refusal::new(
                ErrorCode::FrameTooLarge,
                format!(
                    "forwarded, the request is {} bytes, over broker {}'s max_frame_bytes ({}); nothing was sent",
                    bytes.len(),
                    target.node,
                    link.peer_max_frame_bytes
                ),
            ));
        }
        self.next_id += 1;
        let cancel = cancel.map(|c| encode_forward(&target.head, c, id));
        let deadline = now + wait + self.cfg.forward_timeout;
        link.fwds.insert(
            id,
            Fwd {
                client,
                lane,
                unsent: Some(bytes),
                deadline,
                cancel,
            },
        );
        link.waiting.push_back(id);
        self.owner_of.insert(id, target.node);
        self.deadlines.insert((deadline, id), ());
        if let State::Ready { key } = link.state {
            Self::send_waiting(link, key, &mut self.effects);
        }
        Ok(())
    }

    fn send_waiting(link: &mut Link, key: ConnKey, effects: &mut Vec<LinkEffect>) {
        while let Some(id) = link.waiting.pop_front() {
            let Some(f) = link.fwds.get_mut(&id) else {
                continue; // answered (refused) while it waited
            };
            if let Some(bytes) = f.unsent.take() {
                effects.push(LinkEffect::Send {
                    key,
                    lane: f.lane,
                    bytes,
                });
            }
        }
    }

    /// The client on `conn` cancels its long poll `client_rid`: the cancel goes to the owner
    /// under the poll's link id (the owner answers the poll, which answers the client). False
    /// when no forward of that connection and id waits here.
    pub fn cancel_poll(&mut self, conn: ConnKey, client_rid: u64) -> bool {
        for link in self.links.values_mut() {
            let key = match link.state {
                State::Ready { key } => Some(key),
                _ => None,
            };
            for f in link.fwds.values_mut() {
                if f.client.conn() != conn || f.client.request_id() != client_rid {
                    continue;
                }
                let Some(cancel) = f.cancel.take() else {
                    return false; // not a long poll (or cancelled already)
                };
                Self::send_cancel(f, key, cancel, &mut self.effects);
                return true;
            }
        }
        false
    }

    /// A client connection closed: its long polls waiting at owners are cancelled there, so
    /// the owners do not hold them (their answers then find no client and are dropped).
    pub fn conn_closed(&mut self, conn: ConnKey) -> u64 {
        let mut cancelled = 0;
        for link in self.links.values_mut() {
            let key = match link.state {
                State::Ready { key } => Some(key),
                _ => None,
            };
            for f in link.fwds.values_mut() {
                if f.client.conn() == conn {
                    if let Some(cancel) = f.cancel.take() {
                        Self::send_cancel(f, key, cancel, &mut self.effects);
                        cancelled += 1;
                    }
                }
            }
        }
        cancelled
    }

    /// Send a cancel after its poll: at once if the poll left, else right behind it.
    fn send_cancel(f: &mut Fwd, key: Option<ConnKey>, cancel: Bytes, out: &mut Vec<LinkEffect>) {
        match (&mut f.unsent, key) {
            (Some(poll), _) => {
                let mut both = BytesMut::from(&poll[..]);
                both.extend_from_slice(&cancel);
                *poll = both.freeze();
            }
            (None, Some(key)) => out.push(LinkEffect::Send {
                key,
                lane: Lane::Control,
                bytes: cancel,
            }),
            // Sent on a link that is gone: the forward is answered by the break.
            (None, None) => {}
        }
    }

    /// The driver dialed `node`: the connection is `key`.
    pub fn on_dialed(&mut self, node: u64, key: ConnKey) {
        let Some(link) = self.links.get_mut(&node) else {
            return;
        };
        if let State::Dialing { until } = link.state {
            link.state = State::Opening { key, until };
            self.by_key.insert(key, node);
        }
    }

    /// The driver could not dial `node` at all.
    pub fn on_dial_failed(&mut self, now: Instant, node: u64, why: String) {
        self.fail_link(now, node, why);
    }

    /// The QUIC and TLS handshake of link `key` finished: say who we are.
    pub fn on_established(&mut self, key: ConnKey) {
        let Some(&node) = self.by_key.get(&key) else {
            return;
        };
        let link = self.links.get_mut(&node).expect("by_key names live links");
        if link.hello_sent {
            return;
        }
        link.hello_sent = true;
        let hello = Frame::Peer(PeerFrame::PeerHello {
            node_id: self.cfg.node_id,
            cluster_id: self.cluster_id.clone(),
            capabilities: peer::capabilities::ALL,
            max_frame_bytes: self.cfg.max_frame_bytes,
        });
        self.effects.push(LinkEffect::Send {
            key,
            lane: Lane::Control,
            bytes: hello.encode(),
        });
    }

    /// A whole frame arrived on link `key`.
    pub fn on_frame(&mut self, now: Instant, key: ConnKey, frame: Frame) {
        let Some(&node) = self.by_key.get(&key) else {
            return;
        };
        if let Frame::Peer(PeerFrame::PeerHelloOk {
            node_id,
            cluster_id,
            max_frame_bytes,
            ..
        }) = &frame
        {
            let link = self.links.get_mut(&node).expect("by_key names live links");
            if *node_id != node || (!self.cluster_id.is_empty() && *cluster_id != self.cluster_id) {
                let why = format!(
                    "broker {node}'s listener answered as node {node_id} of cluster {cluster_id:?}"
                );
                self.close(key);
                self.fail_link(now, node, why);
                return;
            }
            link.peer_max_frame_bytes = *max_frame_bytes as usize;
            link.state = State::Ready { key };
            link.failures = 0;
            Self::send_waiting(link, key, &mut self.effects);
            return;
        }
        // Only answers carry the request id back; anything else (a peer frame) is ignored.
        let Some(id) = frame
            .request_id()
            .filter(|_| !matches!(frame, Frame::Peer(_)))
        else {
            return;
        };
        let Some(link) = self.links.get_mut(&node) else {
            return;
        };
        let Some(fwd) = link.fwds.remove(&id) else {
            return; // already refused (late answer): the client was told outcome_unknown
        };
        self.owner_of.remove(&id);
        self.deadlines.remove(&(fwd.deadline, id));
        let mut bytes = BytesMut::from(&frame.encode()[..]);
        let patched = patch_request_id(&mut bytes, fwd.client.request_id());
        debug_assert!(
            patched,
            "request_id() is Some only for kinds that start with one"
        );
        self.effects.push(LinkEffect::Answer {
            client: fwd.client,
            answer: Box::new(FwdAnswer::Frame(frame, bytes.freeze())),
            node,
        });
    }

    /// An answer on link `key` that could not be decoded, naming request `id`: whatever the
    /// owner did is unknown.
    pub fn on_bad_answer(&mut self, key: ConnKey, id: u64, why: String) {
        let Some(&node) = self.by_key.get(&key) else {
            return;
        };
        let Some(fwd) = self.links.get_mut(&node).and_then(|l| l.fwds.remove(&id)) else {
            return;
        };
        self.owner_of.remove(&id);
        self.deadlines.remove(&(fwd.deadline, id));
        let refusal = Refusal::new(
            ErrorCode::OutcomeUnknown,
            format!("broker {node}'s answer could not be read ({why}): the request may or may not have been applied"),
        );
        self.refuse(fwd.client, node, refusal);
    }

    /// Cancel every long poll forwarded from this core (a draining broker answers its long
    /// polls at once; the owners hold these). Returns how many.
    pub fn cancel_all_polls(&mut self) -> u64 {
        let mut n = 0;
        for link in self.links.values_mut() {
            let key = match link.state {
                State::Ready { key } => Some(key),
                _ => None,
            };
            for f in link.fwds.values_mut() {
                if let Some(cancel) = f.cancel.take() {
                    Self::send_cancel(f, key, cancel, &mut self.effects);
                    n += 1;
                }
            }
        }
        n
    }

    /// Link `key` closed (by either side, or its handshake failed).
    pub fn on_closed(&mut self, now: Instant, key: ConnKey, why: String) {
        if self.closing.remove(&key) {
            return; // closed by this table, which already failed it
        }
        let Some(node) = self.by_key.remove(&key) else {
            return;
        };
        let link = self.links.get_mut(&node).expect("by_key names live links");
        if matches!(link.state, State::Ready { .. }) && link.fwds.is_empty() {
            // A ready link with nothing on it closed (its idle timeout, the owner restarting):
            // no failure, the next forward dials again at once.
            link.state = State::Backoff { until: now };
            return;
        }
        self.fail_link(now, node, why);
    }

    /// Refuse what waits on the link and start its backoff. A forward already handed to the
    /// link may have been applied: `outcome_unknown`; one never sent: `unavailable`.
    fn fail_link(&mut self, now: Instant, node: u64, why: String) {
        let Some(link) = self.links.get_mut(&node) else {
            return;
        };
        if let State::Opening { key, .. } | State::Ready { key } = link.state {
            self.by_key.remove(&key);
        }
        link.failures = link.failures.saturating_add(1);
        let backoff = BACKOFF_FIRST
            .saturating_mul(1u32 << link.failures.min(10).saturating_sub(1))
            .min(BACKOFF_MAX);
        link.state = State::Backoff {
            until: now + backoff,
        };
        link.last_error = why.clone();
        link.waiting.clear();
        let fwds = std::mem::take(&mut link.fwds);
        for (id, f) in fwds {
            self.owner_of.remove(&id);
            self.deadlines.remove(&(f.deadline, id));
            #[cfg(test)]
            if breaks::on(&breaks::FORGET_ON_BREAK) {
                continue; // the twin: a forward of a broken link is never answered
            }
            #[cfg(test)]
            let unsent = f.unsent.is_some() || breaks::on(&breaks::SENT_AS_UNSENT);
            #[cfg(not(test))]
            let unsent = f.unsent.is_some();
            let refusal = fate_refusal(
                unsent,
                format!("broker {node} is unreachable ({why}); nothing was sent"),
                format!("the link to broker {node} broke after the request was sent ({why}): it may or may not have been applied"),
            );
            self.refuse(f.client, node, refusal);
        }
    }

    /// Answer a forward's client with a refusal of the link's own.
    fn refuse(&mut self, client: FwdClient, node: u64, refusal: Refusal) {
        self.effects.push(LinkEffect::Answer {
            client,
            answer: Box::new(FwdAnswer::Refused(refusal)),
            node,
        });
    }

    /// Time moved: links that took too long to open fail, forwards past their deadline are
    /// answered.
    pub fn tick(&mut self, now: Instant) {
        let late_links: Vec<(u64, Option<ConnKey>)> = self
            .links
            .iter()
            .filter_map(|(n, l)| match l.state {
                State::Dialing { until } if until <= now => Some((*n, None)),
                State::Opening { key, until } if until <= now => Some((*n, Some(key))),
                _ => None,
            })
            .collect();
        for (node, key) in late_links {
            if let Some(key) = key {
                self.close(key);
            }
            self.fail_link(
                now,
                node,
                format!(
                    "no link within peer_connect_timeout_ms ({} ms)",
                    self.cfg.connect_timeout.as_millis()
                ),
            );
        }
        while let Some((&(deadline, id), _)) = self.deadlines.first_key_value() {
            if deadline > now {
                break;
            }
            self.deadlines.remove(&(deadline, id));
            let Some(node) = self.owner_of.remove(&id) else {
                continue;
            };
            let Some(f) = self.links.get_mut(&node).and_then(|l| l.fwds.remove(&id)) else {
                continue;
            };
            let refusal = fate_refusal(
                f.unsent.is_some(),
                format!("the link to broker {node} did not open in time; nothing was sent"),
                format!("broker {node} did not answer in time (forward_timeout_ms past the request's own wait): it may or may not have been applied"),
            );
            self.refuse(f.client, node, refusal);
        }
    }
}

/// The refusal of a forward the link gave up on: `unavailable` if it was never handed to the
/// link (nothing was done), else `outcome_unknown` (it may have been applied).
fn fate_refusal(unsent: bool, unsent_why: String, sent_why: String) -> Refusal {
    if unsent {
        Refusal::new(ErrorCode::Unavailable, unsent_why)
    } else {
        Refusal::new(ErrorCode::OutcomeUnknown, sent_why)
    }
}

/// Test-build switches that break one rule each, for the seeded check's negative twins
/// (`core::peer_check`).
#[cfg(test)]
pub(crate) mod breaks {
    use std::sync::atomic::AtomicBool;
    /// A broken link answers its forwards already sent `unavailable` ("nothing was done"),
    /// which could make a client write twice.
    pub(crate) static SENT_AS_UNSENT: AtomicBool = AtomicBool::new(false);
    /// A broken link drops its forwards without answering them.
    pub(crate) static FORGET_ON_BREAK: AtomicBool = AtomicBool::new(false);

    pub(crate) fn on(b: &AtomicBool) -> bool {
        b.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The `Forward` frame of `inner` under link-wide id `id` (the inner request's id is
/// rewritten, so answers from every client of this core are told apart on the link).
fn encode_forward(head: &ForwardHead, inner: &Frame, id: u64) -> Bytes {
    let mut inner_bytes = BytesMut::from(&inner.encode()[..]);
    let patched = patch_request_id(&mut inner_bytes, id);
    assert!(patched, "only requests are forwarded");
    peer::encode_forward(head, &inner_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use felix_quic::wire::{decode_frame, Records, ShardSelector, StreamName};

    const MAX: usize = 1 << 24;

    fn links(forwards_max: usize) -> Links {
        let mut l = Links::new(LinksCfg {
            node_id: 1,
            max_frame_bytes: 1 << 20,
            connect_timeout: Duration::from_millis(100),
            forward_timeout: Duration::from_millis(50),
            forwards_max,
        });
        l.set_cluster_id("c");
        l
    }

    fn target() -> FwdTarget {
        FwdTarget {
            node: 2,
            addr: "127.0.0.1:9".into(),
            head: ForwardHead {
                incarnation: 7,
                generation: 3,
                origin_node: 1,
                principal: String::new(),
                frame_bytes_max: 0,
            },
        }
    }

    fn publish(rid: u64) -> Frame {
        Frame::Publish {
            request_id: rid,
            stream: StreamName::new("t", "n", "s"),
            shard: ShardSelector::Shard(0),
            ack: true,
            records: Records::encode([&b"x"[..]]),
        }
    }

    fn hello_ok(node_id: u64, max_frame_bytes: u32) -> Frame {
        Frame::Peer(PeerFrame::PeerHelloOk {
            node_id,
            cluster_id: "c".into(),
            capabilities: 1,
            max_frame_bytes,
        })
    }

    fn client(rid: u64) -> FwdClient {
        FwdClient::Request {
            conn: 5,
            stream: 0,
            request_id: rid,
            cache: false,
        }
    }

    /// Forward one request with client id `rid`; returns the refusal, if any.
    fn fwd(l: &mut Links, now: Instant, rid: u64) -> Result<(), Refusal> {
        l.forward(
            now,
            target(),
            &publish(rid),
            client(rid),
            Lane::Publish,
            Duration::ZERO,
            None,
        )
    }

    /// The forwards sent on the link, decoded: (link id, head).
    fn sent(effects: &[LinkEffect]) -> Vec<(u64, ForwardHead)> {
        effects
            .iter()
            .filter_map(|e| match e {
                LinkEffect::Send { bytes, .. } => match decode_frame(bytes, MAX).unwrap() {
                    Frame::Peer(PeerFrame::Forward { head, inner }) => {
                        Some((inner.request_id().unwrap(), head))
                    }
                    _ => None,
                },
                _ => None,
            })
            .collect()
    }

    /// Answers to clients: (client id, answer code: 0 for a frame).
    fn answers(effects: Vec<LinkEffect>) -> Vec<(u64, u16)> {
        effects
            .into_iter()
            .filter_map(|e| match e {
                LinkEffect::Answer { client, answer, .. } => Some((
                    client.request_id(),
                    match *answer {
                        FwdAnswer::Frame(_, bytes) => {
                            // The client's id was written back into the answer.
                            let f = decode_frame(&bytes, MAX).unwrap();
                            assert_eq!(f.request_id(), Some(client.request_id()));
                            0
                        }
                        FwdAnswer::Refused(r) => r.code.number(),
                    },
                )),
                _ => None,
            })
            .collect()
    }

    /// Dial, handshake and hello: the link to node 2 is ready (key 40).
    fn open(l: &mut Links, now: Instant) -> Vec<LinkEffect> {
        let e = l.drain_effects();
        assert!(matches!(e[..], [LinkEffect::Dial { node: 2, .. }]), "{e:?}");
        l.on_dialed(2, 40);
        l.on_established(40);
        let e = l.drain_effects();
        match &e[..] {
            [LinkEffect::Send {
                key: 40,
                lane: Lane::Control,
                bytes,
            }] => assert!(matches!(
                decode_frame(bytes, MAX).unwrap(),
                Frame::Peer(PeerFrame::PeerHello { node_id: 1, ref cluster_id, .. }) if cluster_id == "c"
            )),
            other => panic!("{other:?}"),
        }
        l.on_frame(now, 40, hello_ok(2, 1 << 20));
        l.drain_effects()
    }

    /// Forwards wait for the link, leave in order under link ids once it is ready, and each
    /// answer goes to its client under the client's id.
    #[test]
    fn forwards_wait_for_the_link_and_answers_find_their_clients() {
        let t0 = Instant::now();
        let mut l = links(8);
        fwd(&mut l, t0, 100).unwrap();
        let out = open(&mut l, t0);
        fwd(&mut l, t0, 200).unwrap();
        let out: Vec<LinkEffect> = out.into_iter().chain(l.drain_effects()).collect();
        let ids: Vec<u64> = sent(&out).iter().map(|s| s.0).collect();
        assert_eq!(ids.len(), 2);
        assert_eq!(sent(&out)[0].1, target().head);
        assert_eq!(l.in_flight(), 2);
        // Answers out of order.
        for (id, shard) in [(ids[1], 1), (ids[0], 0)] {
            l.on_frame(
                t0,
                40,
                Frame::PublishAck {
                    request_id: id,
                    shard,
                    first_offset: 0,
                    count: 1,
                    owner: 2,
                },
            );
        }
        assert_eq!(answers(l.drain_effects()), vec![(200, 0), (100, 0)]);
        assert_eq!(l.in_flight(), 0);
        // A late duplicate answer is dropped.
        l.on_frame(t0, 40, Frame::error(ids[0], ErrorCode::Internal, "late"));
        assert!(l.drain_effects().is_empty());
    }

    /// A broken link: what was sent is `outcome_unknown`, what was not is `unavailable`; the
    /// backoff refuses at once, then the next forward dials again.
    #[test]
    fn a_broken_link_answers_everything_typed_and_backs_off() {
        let t0 = Instant::now();
        let mut l = links(8);
        fwd(&mut l, t0, 1).unwrap();
        open(&mut l, t0);
        l.on_closed(t0, 40, "killed".into());
        assert_eq!(
            answers(l.drain_effects()),
            vec![(1, ErrorCode::OutcomeUnknown.number())]
        );
        let r = fwd(&mut l, t0 + Duration::from_millis(10), 2).unwrap_err();
        assert_eq!(r.code, ErrorCode::Unavailable);
        assert!(r.message.contains("killed"), "{}", r.message);
        // After the first backoff (100 ms) a forward dials again, and waits unsent.
        let t1 = t0 + BACKOFF_FIRST;
        fwd(&mut l, t1, 3).unwrap();
        assert!(matches!(l.drain_effects()[..], [LinkEffect::Dial { .. }]));
        // The dial never completes: the forward's own deadline (its wait, 0, plus the forward
        // timeout, 50 ms) refuses it unavailable (never sent); the link gives up at the
        // connect timeout (100 ms).
        l.tick(t1 + Duration::from_millis(49));
        assert!(l.drain_effects().is_empty());
        l.tick(t1 + Duration::from_millis(50));
        assert_eq!(
            answers(l.drain_effects()),
            vec![(3, ErrorCode::Unavailable.number())]
        );
        l.tick(t1 + Duration::from_millis(100));
        assert!(answers(l.drain_effects()).is_empty());
        // The second failure doubles the backoff.
        assert!(fwd(&mut l, t1 + Duration::from_millis(100) + BACKOFF_FIRST, 4).is_err());
        assert!(fwd(
            &mut l,
            t1 + Duration::from_millis(100) + 2 * BACKOFF_FIRST,
            5
        )
        .is_ok());
    }

    /// A frozen owner: a sent forward is answered `outcome_unknown` at its deadline (the
    /// request's wait plus the forward timeout), never later, and never twice.
    #[test]
    fn an_unanswered_forward_times_out_as_outcome_unknown() {
        let t0 = Instant::now();
        let mut l = links(8);
        l.forward(
            t0,
            target(),
            &publish(9),
            client(9),
            Lane::Publish,
            Duration::from_millis(20),
            None,
        )
        .unwrap();
        open(&mut l, t0);
        assert_eq!(l.next_deadline(), Some(t0 + Duration::from_millis(70)));
        l.tick(t0 + Duration::from_millis(69));
        assert!(l.drain_effects().is_empty());
        l.tick(t0 + Duration::from_millis(70));
        assert_eq!(
            answers(l.drain_effects()),
            vec![(9, ErrorCode::OutcomeUnknown.number())]
        );
        l.tick(t0 + Duration::from_secs(1));
        assert!(l.drain_effects().is_empty());
        assert_eq!(l.in_flight(), 0);
    }

    /// Bounded: past `forwards_max` a forward is refused, nothing sent.
    #[test]
    fn forwards_per_link_are_bounded() {
        let t0 = Instant::now();
        let mut l = links(2);
        fwd(&mut l, t0, 1).unwrap();
        fwd(&mut l, t0, 2).unwrap();
        assert_eq!(
            fwd(&mut l, t0, 3).unwrap_err().code,
            ErrorCode::InflightLimit
        );
        assert_eq!(l.in_flight(), 2);
    }

    /// An idle link that closes is no failure: the next forward dials again at once.
    #[test]
    fn an_idle_link_that_closes_is_dialed_again_at_once() {
        let t0 = Instant::now();
        let mut l = links(8);
        fwd(&mut l, t0, 1).unwrap();
        let out = open(&mut l, t0);
        let id = sent(&out)[0].0;
        l.on_frame(t0, 40, Frame::error(id, ErrorCode::NotFound, "x"));
        assert_eq!(answers(l.drain_effects()), vec![(1, 0)]);
        l.on_closed(t0, 40, "idle timeout".into());
        assert!(l.drain_effects().is_empty());
        fwd(&mut l, t0, 2).expect("not refused: the link is dialed again");
        assert!(matches!(l.drain_effects()[..], [LinkEffect::Dial { .. }]));
    }

    /// A listener that answers as another node (or cluster) is dropped, and what waited on it
    /// is refused unavailable.
    #[test]
    fn a_listener_answering_as_another_node_is_dropped() {
        let t0 = Instant::now();
        let mut l = links(8);
        fwd(&mut l, t0, 1).unwrap();
        l.drain_effects();
        l.on_dialed(2, 40);
        l.on_established(40);
        l.drain_effects();
        l.on_frame(t0, 40, hello_ok(3, 1 << 20));
        let e = l.drain_effects();
        assert!(matches!(e[0], LinkEffect::Close { key: 40 }));
        assert_eq!(answers(e), vec![(1, ErrorCode::Unavailable.number())]);
        // Still a link until the driver reaps it, then gone.
        assert!(l.is_link(40));
        l.on_closed(t0, 40, "closed".into());
        assert!(!l.is_link(40));
    }

    /// An address that is not IP:port is refused, typed, nothing dialed.
    #[test]
    fn a_peer_address_that_is_not_an_ip_is_refused() {
        let mut l = links(8);
        let mut t = target();
        t.addr = "broker-2.example:7402".into();
        let r = l
            .forward(
                Instant::now(),
                t,
                &publish(1),
                client(1),
                Lane::Control,
                Duration::ZERO,
                None,
            )
            .unwrap_err();
        assert_eq!(r.code, ErrorCode::Unavailable);
        assert!(l.drain_effects().is_empty());
    }

    /// A long poll's cancel goes under the poll's link id: right behind it while the link
    /// opens, on its own once the poll left; a connection that closes cancels its polls; a
    /// cancel of a poll that is not waiting here says so.
    #[test]
    fn long_polls_are_cancelled_under_their_link_id() {
        use felix_quic::wire::{GroupFrame, GroupRef};
        let t0 = Instant::now();
        let mut l = links(8);
        let gref = GroupRef {
            stream: StreamName::new("t", "n", "s"),
            group: "g".into(),
            shard: 0,
        };
        let poll = |rid| {
            Frame::Group(GroupFrame::GroupPoll {
                request_id: rid,
                target: gref.clone(),
                max: 1,
                visibility_timeout_ms: 0,
                wait_ms: 1000,
            })
        };
        let cancel = |rid| {
            Frame::Group(GroupFrame::GroupPollCancel {
                request_id: rid,
                target: gref.clone(),
            })
        };
        let wait = Duration::from_secs(1);
        for rid in [1, 2] {
            let c = client(rid);
            l.forward(
                t0,
                target(),
                &poll(rid),
                c,
                Lane::Control,
                wait,
                Some(&cancel(rid)),
            )
            .unwrap();
        }
        assert!(!l.cancel_poll(5, 99), "no such poll");
        assert!(l.cancel_poll(5, 1), "poll 1 waits to be sent");
        assert!(!l.cancel_poll(5, 1), "cancelled once");
        let out = open(&mut l, t0);
        // Decode every frame sent, in order: poll 1 and its cancel under one link id, poll 2.
        let mut frames = Vec::new();
        for e in &out {
            if let LinkEffect::Send { bytes, .. } = e {
                let mut r = felix_quic::wire::FrameReader::new(MAX);
                r.push(bytes);
                while let Some(f) = r.next_frame().unwrap() {
                    frames.push(f);
                }
            }
        }
        let inner: Vec<(u8, u64)> = frames
            .iter()
            .map(|f| match f {
                Frame::Peer(PeerFrame::Forward { inner, .. }) => {
                    (inner.kind(), inner.request_id().unwrap())
                }
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(inner.len(), 3, "{inner:?}");
        assert_eq!(
            inner[0].1, inner[1].1,
            "the cancel names its poll's link id"
        );
        assert_ne!(inner[0].0, inner[1].0);
        // The connection closes: poll 2's cancel leaves on its own.
        assert_eq!(l.conn_closed(5), 1);
        let out = l.drain_effects();
        assert_eq!(sent(&out).len(), 1);
        assert_eq!(sent(&out)[0].0, inner[2].1);
        assert_eq!(l.conn_closed(5), 0, "once");
    }

    /// A forward over the owner's frame maximum is refused before anything is sent; an
    /// answer that cannot be read is `outcome_unknown`; a broker that moved gets a new link.
    #[test]
    fn oversize_unreadable_and_moved() {
        let t0 = Instant::now();
        let mut l = links(8);
        fwd(&mut l, t0, 1).unwrap();
        l.drain_effects();
        l.on_dialed(2, 40);
        l.on_established(40);
        l.drain_effects();
        l.on_frame(t0, 40, hello_ok(2, 100));
        let out = l.drain_effects();
        let id = sent(&out)[0].0;
        let big = Frame::Publish {
            request_id: 2,
            stream: StreamName::new("t", "n", "s"),
            shard: ShardSelector::Shard(0),
            ack: true,
            records: Records::encode([&[0u8; 200][..]]),
        };
        let r = l
            .forward(
                t0,
                target(),
                &big,
                client(2),
                Lane::Publish,
                Duration::ZERO,
                None,
            )
            .unwrap_err();
        assert_eq!(r.code, ErrorCode::FrameTooLarge);
        assert_eq!(l.in_flight(), 1);
        l.on_bad_answer(40, id, "bad body".into());
        assert_eq!(
            answers(l.drain_effects()),
            vec![(1, ErrorCode::OutcomeUnknown.number())]
        );
        // Broker 2 re-registered elsewhere: the old link is closed, the next one dialed at once.
        let mut moved = target();
        moved.addr = "127.0.0.1:10".into();
        l.forward(
            t0,
            moved,
            &publish(3),
            client(3),
            Lane::Publish,
            Duration::ZERO,
            None,
        )
        .unwrap();
        let e = l.drain_effects();
        assert!(matches!(e[0], LinkEffect::Close { key: 40 }), "{e:?}");
        assert!(e
            .iter()
            .any(|x| matches!(x, LinkEffect::Dial { addr, .. } if addr.port() == 10)));
        assert!(l.is_link(40), "closing, not a client's");
        l.on_closed(t0, 40, "closed".into());
        assert!(!l.is_link(40));
        assert!(
            l.drain_effects().is_empty(),
            "the close was already handled"
        );
    }
}

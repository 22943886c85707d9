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
    /// Replica messages: leases, fences, shipments (served before everything else).
    Replication,
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
        self.link_to(now, target.node, &target.addr)?;
        let max = self.cfg.forwards_max;
        if self.links[&target.node].fwds.len() >= max {
            return Err(Refusal::new(
                ErrorCode::InflightLimit,
                format!(
                    "{max} forwards already wait for broker {} on this core (peer_forwards_max); nothing was sent",
                    target.node
                ),
            ));
        }
        self.dial_if_down(now, target.node)?;
        let link = self.links.get_mut(&target.node).expect("link_to made it");
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

    /// The link to `node` at `addr`: made if there is none, moved if the broker re-registered
    /// elsewhere. Refused (nothing sent) while the address does not parse.
    fn link_to(&mut self, now: Instant, node: u64, addr: &str) -> Result<(), Refusal> {
        let addr: SocketAddr = addr.parse().map_err(|_| {
            Refusal::new(
                ErrorCode::Unavailable,
                format!(
                    "broker {node} registered peer address {addr:?}, which has not resolved to an address yet; nothing was sent"
                ),
            )
        })?;
        let own_max = self.cfg.max_frame_bytes as usize;
        let link = self.links.entry(node).or_insert_with(|| Link {
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
                let why = format!("broker {node} moved from {old} to {addr}");
                self.fail_link(now, node, why);
                // Dialed again at once, not after a backoff: nothing failed at the new address.
                let link = self.links.get_mut(&node).expect("present");
                link.state = State::Backoff { until: now };
                link.failures = 0;
            }
        }
        Ok(())
    }

    /// Dial the link to `node` if it is down past its backoff; refused (nothing sent) while it
    /// backs off.
    fn dial_if_down(&mut self, now: Instant, node: u64) -> Result<(), Refusal> {
        let link = self.links.get_mut(&node).expect("link_to made it");
        if let State::Backoff { until } = link.state {
            if now < until {
                return Err(Refusal::new(
                    ErrorCode::Unavailable,
                    format!(
                        "the link to broker {node} is down ({}); nothing was sent",
                        link.last_error
                    ),
                ));
            }
            link.state = State::Dialing {
                until: now + self.cfg.connect_timeout,
            };
            link.hello_sent = false;
            let addr = link.addr;
            self.effects.push(LinkEffect::Dial { node, addr });
        }
        Ok(())
    }

    /// Send one replica message (an encoded `Replicate`) to broker `node` on the replication
    /// lane, fire and forget. The replica protocol tolerates loss and sends again on its own
    /// ticks (docs/replication-design.md), so a message for a link that is not ready is
    /// dropped, not queued (a queue would deliver stale leases and fences late), and the
    /// link is dialed if it is down. `Ok(false)`: dropped for now; `Err`: refused for good
    /// (the address does not parse, the link backs off, the message is over the peer's
    /// frame maximum).
    pub fn send_replica(
        &mut self,
        now: Instant,
        node: u64,
        addr: &str,
        bytes: Bytes,
    ) -> Result<bool, Refusal> {
        self.link_to(now, node, addr)?;
        self.dial_if_down(now, node)?;
        let link = self.links.get_mut(&node).expect("link_to made it");
        if bytes.len() > link.peer_max_frame_bytes {
            return Err(Refusal::new(
                ErrorCode::FrameTooLarge,
                format!(
                    "a replica message of {} bytes is over broker {node}'s max_frame_bytes ({}); nothing was sent",
                    bytes.len(),
                    link.peer_max_frame_bytes
                ),
            ));
        }
        let State::Ready { key } = link.state else {
            return Ok(false);
        };
        self.effects.push(LinkEffect::Send {
            key,
            lane: Lane::Replication,
            bytes,
        });
        Ok(true)
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
mod tests;

//! felix-client: the Rust client for Felix over QUIC (tokio).
//!
//! `Client::connect` (TLS 1.3 verified against a CA file, or an explicit insecure mode) and
//! the Felix handshake; `describe_stream`; acked `publish` / `publish_batch` on per-publisher
//! bidirectional streams ([`Client::publisher`] opens another one); fire-and-forget
//! publishes on their own unidirectional stream; `subscribe` to one shard or
//! `subscribe_stream` to every shard of a stream (merged, per-shard order kept); clean
//! `close`. Every call is bounded by a timeout from [`ClientConfig`]. Consumer groups are in
//! `group` ([`GroupConsumer`]); caches, watches and counters in `cache` ([`CacheWatch`]).
//!
//! Back-pressure: each subscription buffers at most `SubscribeOptions::buffer_events`
//! events; when the application stops reading, the client stops reading that QUIC stream,
//! flow control holds the broker, and the broker's queue policy for the subscription applies.

use bytes::Bytes;
use felix_quic::conn::{ConnEvent, FelixConn};
use felix_quic::tls::{client_config, TransportConfig, Verify};
use felix_quic::tokio_driver::{spawn_client, Handler};
use felix_quic::wire::{
    features, AuthFrame, ErrorCode, Frame, Limits, QueuePolicy, Records, ShardSelector, StartAt,
    StreamName, DEFAULT_MAX_FRAME_BYTES,
};
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

mod cache;
mod cluster;
mod cluster_group;
mod cluster_watch;
mod group;
mod lanes;
mod mux;
mod sink;
mod submux;
mod watchset;
pub use cache::{
    CacheEntry, CacheInfo, CacheWatch, CounterValue, Deleted, WatchItem, WatchOptions, Written,
};
pub use cluster::{ClusterClient, ClusterConfig, ShardedSubscription};
pub use cluster_group::ClusterGroupConsumer;
pub use cluster_watch::ClusterWatch;
use felix_quic::wire::CacheFrame;
pub use felix_quic::wire::{
    AnswerOp, ClaimId, DeadLetterAction, DeadLetterRef, EventKind, GroupInfo, WatchFilter,
    WatchStart, WriteCond,
};
pub use group::{DeadLetterPage, GroupConsumer, GroupOptions, GroupRecord};
pub use watchset::{WatchId, WatchSet};

/// Everything a client call can fail with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error("connect to {0} failed: {1}")]
    Connect(SocketAddr, String),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("connection closed: {0}")]
    Closed(String),
    #[error("broker refused ({code}): {message}")]
    Broker { code: ErrorCode, message: String },
    #[error("broker answered with unknown error number {number}: {message}")]
    UnknownBrokerError { number: u16, message: String },
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("TLS configuration: {0}")]
    Tls(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Nothing completed a QUIC handshake at the address within the connect timeout.
    #[error("no Felix broker answered at {addr} within {} ms (nothing listening, or UDP blocked)", waited.as_millis())]
    Unreachable { addr: String, waited: Duration },
    /// The address could not be parsed or resolved.
    #[error("bad broker address {addr:?}: {why}")]
    Address { addr: String, why: String },
    /// Refused before sending: the frame is over the broker's `max_frame_bytes` (HelloOk).
    #[error(
        "a frame of {len} bytes is over the broker's max_frame_bytes ({max}); nothing was sent"
    )]
    FrameTooLarge { len: usize, max: usize },
}

impl Error {
    /// The registry code, when the broker refused.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Error::Broker { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// Client settings.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub addr: SocketAddr,
    /// Name checked against the broker certificate (SNI + hostname verification).
    pub server_name: String,
    pub verify: Verify,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    pub close_timeout: Duration,
    pub transport: TransportConfig,
    /// The address as the user wrote it (error messages name it).
    pub display_addr: String,
    /// The largest frame this client takes (announced in Hello; the broker refuses a value
    /// below its `max_payload_bytes` + 1 KiB).
    pub max_frame_bytes: usize,
    /// Ask for the watch mux (every watch of the connection on one stream; docs/protocol.md,
    /// "Watch mux"). Off: one stream per watch, paused when its buffer is full.
    pub watch_mux: bool,
    /// Ask for the subscription mux (every drop_new subscription of the connection on one
    /// stream; docs/protocol.md, "Subscription mux"). Off: one stream per subscription,
    /// paused when its buffer is full.
    pub sub_mux: bool,
    /// Ping the broker this often (`None`: never). With an idle timeout
    /// (`transport.idle_timeout_ms`) a few times longer, a broker that died or froze is
    /// noticed within the idle timeout even on a connection that only receives (a
    /// subscription, a watch), and an idle connection to a live broker stays open.
    pub keepalive: Option<Duration>,
    /// The token presented at connect (`Authenticate` after `Hello`); a broker with auth on
    /// refuses every request without one. `FELIX_TOKEN` when the caller reads it.
    pub token: Option<String>,
}

/// Resolve a broker address as people write it — `host:port`, `ip:port` or `[v6]:port` — to a
/// socket address and the name its certificate must carry (the host name; `localhost` for an
/// IP literal, which is what the generated dev certificate names).
pub fn resolve_broker(addr: &str) -> Result<(SocketAddr, String), Error> {
    let bad = |why: String| Error::Address {
        addr: addr.to_string(),
        why,
    };
    if let Ok(sa) = addr.parse::<SocketAddr>() {
        return Ok((sa, "localhost".into()));
    }
    let (host, port) = addr
        .rsplit_once(':')
        .ok_or_else(|| bad("expected HOST:PORT".into()))?;
    port.parse::<u16>()
        .map_err(|_| bad(format!("port {port:?} is not a number 0-65535")))?;
    if host.is_empty() {
        return Err(bad("the host is empty".into()));
    }
    use std::net::ToSocketAddrs;
    let mut found = addr
        .to_socket_addrs()
        .map_err(|e| bad(format!("cannot resolve {host}: {e}")))?;
    // Prefer an IPv4 address: a name such as localhost may list ::1 first while the broker
    // listens on 127.0.0.1 (its default).
    let all: Vec<SocketAddr> = found.by_ref().collect();
    let sa = all
        .iter()
        .find(|a| a.is_ipv4())
        .or(all.first())
        .copied()
        .ok_or_else(|| bad(format!("{host} has no address")))?;
    Ok((sa, host.trim_matches(['[', ']']).to_string()))
}

impl ClientConfig {
    /// Defaults for a broker at `addr` (see [`resolve_broker`]) whose certificate is signed by
    /// `ca`; the certificate must name the host.
    pub fn for_broker(addr: &str, ca: Option<PathBuf>) -> Result<Self, Error> {
        let (sa, name) = resolve_broker(addr)?;
        let mut c = ClientConfig::new(sa, ca);
        c.server_name = name;
        c.display_addr = addr.to_string();
        Ok(c)
    }

    /// Defaults for a broker at `addr` whose certificate is signed by `ca`.
    pub fn new(addr: SocketAddr, ca: Option<PathBuf>) -> Self {
        ClientConfig {
            addr,
            server_name: "localhost".into(),
            verify: ca.map(Verify::CaFile).unwrap_or(Verify::System),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            close_timeout: Duration::from_secs(2),
            transport: TransportConfig::default(),
            display_addr: addr.to_string(),
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            watch_mux: true,
            sub_mux: true,
            keepalive: None,
            token: None,
        }
    }
}

/// What a broker verified of a token (`Client::authenticate`): empty names and 0 when the
/// broker runs with auth off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authenticated {
    pub subject: String,
    pub tenant: String,
    /// When the token expires, milliseconds since the Unix epoch.
    pub expires_at_ms: u64,
}

/// A handshake that ended before it was established, in words: which part of TLS refused.
fn handshake_error(cfg: &ClientConfig, reason: &str) -> Error {
    // quiche reports a TLS alert as CRYPTO_ERROR 0x100 + alert, locally or from the peer.
    let code = reason
        .trim_start_matches("local ")
        .strip_prefix("code ")
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok());
    let ca = match &cfg.verify {
        Verify::CaFile(p) => format!("the CA file {}", p.display()),
        Verify::System => "the system trust store".into(),
        Verify::Insecure => "nothing (insecure)".into(),
    };
    let at = &cfg.display_addr;
    let what = match code.map(|c| c.wrapping_sub(0x100)) {
        Some(48) | Some(46) => format!(
            "certificate refused: the certificate of {at} is not signed by a CA in {ca}"
        ),
        Some(42) => format!(
            "certificate refused: the certificate of {at} does not name {:?} (name), or is not trusted by {ca}",
            cfg.server_name
        ),
        Some(45) => format!("certificate refused: the certificate of {at} has expired"),
        Some(120) => format!(
            "ALPN refused: the server at {at} does not speak felix/1 (is it a Felix broker?)"
        ),
        _ => format!("handshake with {at} failed: {reason}"),
    };
    Error::Tls(what)
}

/// What a stream looks like.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamInfo {
    pub shards: u32,
    pub durable: bool,
    /// The owner broker's node id of each shard, as the answering broker knows it (0: not
    /// placed; empty from a broker without a cluster map).
    pub owners: Vec<u64>,
}

/// The broker's answer to an acked publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ack {
    pub shard: u32,
    pub first_offset: u64,
    pub count: u32,
    /// The node id of the broker that owns the shard and wrote the records (`None` from a
    /// broker that does not say: older, or standalone without a node id in the ack).
    pub owner: Option<u64>,
}

/// How a subscription starts and is queued on the broker.
#[derive(Debug, Clone)]
pub struct SubscribeOptions {
    pub start: StartAt,
    pub policy: QueuePolicy,
    /// Broker-side queue bound in records (0 = broker default, which is also the maximum).
    pub queue_records_max: u32,
    /// Broker-side queue bound in bytes (0 = broker default).
    pub queue_bytes_max: u64,
    /// Events buffered in the client before it stops reading the stream.
    pub buffer_events: usize,
}

impl Default for SubscribeOptions {
    fn default() -> Self {
        SubscribeOptions {
            start: StartAt::Latest,
            policy: QueuePolicy::DropNew,
            queue_records_max: 0,
            queue_bytes_max: 0,
            buffer_events: 1024,
        }
    }
}

/// What a subscription yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Consecutive records of one shard starting at `first_offset`.
    Records {
        shard: u32,
        first_offset: u64,
        records: Records,
    },
    /// The broker's queue for this subscriber overflowed: `lost` records from `from_offset`
    /// were not delivered.
    Lag {
        shard: u32,
        from_offset: u64,
        lost: u64,
    },
    /// The broker ended the subscription (`code` 0 = normal end).
    End {
        shard: u32,
        code: u16,
        message: String,
    },
    /// An item of a cache watch (see [`CacheWatch`]).
    Watch(WatchItem),
}

impl Event {
    /// `(offset, payload)` pairs of a `Records` event (empty for the others).
    pub fn records(&self) -> Vec<(u64, Bytes)> {
        match self {
            Event::Records {
                first_offset,
                records,
                ..
            } => records
                .iter()
                .enumerate()
                .map(|(i, p)| (first_offset + i as u64, p))
                .collect(),
            _ => Vec::new(),
        }
    }
}

enum Lane {
    /// Acked publishes on the bidi stream of publisher `n`.
    Acked(u32),
    /// Fire-and-forget publishes on the client's unidirectional publish stream.
    Fire,
}

enum Cmd {
    Request {
        frame: Frame,
        request_id: u64,
        reply: oneshot::Sender<Result<Frame, Error>>,
    },
    Publish {
        frame: Frame,
        request_id: u64,
        lane: Lane,
        reply: Option<oneshot::Sender<Result<Frame, Error>>>,
    },
    Subscribe {
        frame: Frame,
        request_id: u64,
        reply: oneshot::Sender<Result<Frame, Error>>,
        slot: SubSlot,
    },
    Unsubscribe {
        subscription_id: u64,
        request_id: u64,
    },
    /// A frame on the control stream that gets no answer of its own.
    Send {
        frame: Frame,
    },
    /// An application drained a paused subscription: try to resume reading.
    Resume,
    /// Finish the fire-and-forget stream and answer once the broker acknowledged all of it.
    FlushFire {
        done: oneshot::Sender<Result<(), Error>>,
    },
    Close {
        done: oneshot::Sender<()>,
    },
}

#[derive(Clone)]
struct SubSlot {
    events: sink::Sink,
    paused: Arc<AtomicBool>,
    shard: u32,
    /// A cache watch (on the mux stream when the connection negotiated it).
    watch: bool,
    /// A subscription on the subscription mux stream (set when its Subscribe is sent).
    mux: bool,
}

#[derive(Default)]
struct FireErrors {
    count: AtomicU64,
    last: Mutex<Option<Error>>,
}

struct ConnHandler {
    established: Option<oneshot::Sender<()>>,
    hello: Option<oneshot::Sender<Result<Frame, Error>>>,
    pending: HashMap<u64, oneshot::Sender<Result<Frame, Error>>>,
    pending_subs: HashMap<u64, SubSlot>,
    /// By subscription or watch id (looked up per watch per change: a fast hash).
    subs: felix_quic::idmap::IdMap<u64, SubSlot>,
    stream_sub: HashMap<u64, u64>,
    /// Frames of a subscription stream that arrived before its `SubscribeOk`.
    early: HashMap<u64, Vec<Frame>>,
    /// Events waiting for room in a full subscription buffer (their stream is paused).
    blocked: HashMap<u64, VecDeque<Event>>,
    lanes: lanes::Lanes,
    fire_stream: Option<u64>,
    fire_errors: Arc<FireErrors>,
    closing: Vec<oneshot::Sender<()>>,
    /// Request ids of recent poll cancels (bounded): a cancel that reaches the broker after
    /// its poll was answered is answered `not_found`, which is no fire-and-forget refusal.
    cancels: VecDeque<u64>,
    /// Fire-and-forget streams finished and waiting for the broker's acknowledgement.
    flushing: Vec<(u64, oneshot::Sender<Result<(), Error>>)>,
    /// Bytes of fire-and-forget publishes queued in this client, not yet taken by QUIC.
    fire_backlog: Arc<AtomicU64>,
    /// The frame maximum announced in Hello.
    max_frame_bytes: usize,
    /// Features asked for in Hello.
    features: u64,
    /// The watch mux's state (`mux.rs`).
    mux: mux::MuxState,
    /// The subscription mux's state (`submux.rs`).
    submux: submux::SubMuxState,
    keepalive: Option<Duration>,
    /// Why the connection closed, kept for requests made after it: they would otherwise
    /// only see their channel gone ("connection task ended") and lose the broker's reason.
    close_reason: Arc<std::sync::OnceLock<String>>,
}

/// Poll cancels remembered for their late `not_found` answers.
const CANCELS_REMEMBERED: usize = 1024;

fn request_id_of(f: &Frame) -> Option<u64> {
    match f {
        Frame::StreamInfo { request_id, .. }
        | Frame::ClusterInfo { request_id, .. }
        | Frame::Error { request_id, .. }
        | Frame::PublishAck { request_id, .. }
        | Frame::SubscribeOk { request_id, .. } => Some(*request_id),
        Frame::Group(g) => Some(g.request_id()),
        Frame::Cache(c) => Some(c.request_id()),
        Frame::Auth(a) => Some(a.request_id()),
        _ => None,
    }
}

/// The last frame of a subscription or watch stream.
fn is_end(f: &Frame) -> bool {
    matches!(
        f,
        Frame::SubEnd { .. } | Frame::Cache(CacheFrame::CacheWatchEnd { .. })
    )
}

fn broker_error(code: u16, message: String) -> Error {
    match ErrorCode::from_number(code) {
        Some(code) => Error::Broker { code, message },
        None => Error::UnknownBrokerError {
            number: code,
            message,
        },
    }
}

impl ConnHandler {
    /// A publisher stream closed: when the broker had ended it, fail what it never read.
    fn lane_closed(&mut self, stream: u64) {
        let Some((ids, why)) = self.lanes.closed(stream) else {
            return;
        };
        for id in ids {
            if let Some(tx) = self.pending.remove(&id) {
                let _ = tx.send(Err(why.clone()));
            }
        }
    }

    fn to_event(shard: u32, f: Frame) -> Option<Event> {
        match f {
            Frame::Delivery {
                shard,
                first_offset,
                records,
            } => Some(Event::Records {
                shard,
                first_offset,
                records,
            }),
            Frame::Lag { from_offset, lost } => Some(Event::Lag {
                shard,
                from_offset,
                lost,
            }),
            Frame::SubEnd { code, message, .. } => Some(Event::End {
                shard,
                code,
                message,
            }),
            Frame::Cache(c) => cache::watch_item(shard, c).map(Event::Watch),
            _ => None,
        }
    }

    /// Hand an event to its subscription, pausing the QUIC stream when the buffer is full.
    fn deliver(&mut self, c: &mut FelixConn, stream: u64, slot: &SubSlot, ev: Event) {
        if let Some(q) = self.blocked.get_mut(&stream) {
            q.push_back(ev);
            return;
        }
        match slot.events.try_send(ev) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(ev)) => {
                self.blocked.entry(stream).or_default().push_back(ev);
                c.pause(stream);
                slot.paused.store(true, Ordering::Release);
            }
            // The application dropped the subscription; its Drop sent Unsubscribe.
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }

    fn on_sub_frame(&mut self, c: &mut FelixConn, stream: u64, frame: Frame) {
        if let Frame::Cache(CacheFrame::CacheMux { watch_ids, frame }) = frame {
            self.on_mux(c, watch_ids, *frame);
            return;
        }
        if let Frame::SubMux {
            subscription_ids,
            frame,
        } = frame
        {
            self.on_sub_mux(subscription_ids, *frame);
            return;
        }
        if let Frame::SubStream { subscription_id } = frame {
            self.stream_sub.insert(stream, subscription_id);
            return;
        }
        let Some(&sid) = self.stream_sub.get(&stream) else {
            return;
        };
        let Some(slot) = self.subs.get(&sid).cloned() else {
            self.early.entry(sid).or_default().push(frame);
            return;
        };
        let end = is_end(&frame);
        if let Some(ev) = Self::to_event(slot.shard, frame) {
            self.deliver(c, stream, &slot, ev);
        }
        if end && !self.blocked.contains_key(&stream) {
            self.subs.remove(&sid);
            self.stream_sub.remove(&stream);
        }
    }
}

impl Handler for ConnHandler {
    type Cmd = Cmd;
    fn on_established(&mut self, c: &mut FelixConn) {
        if let Some(every) = self.keepalive {
            c.set_keepalive(every);
        }
        c.send_frame(
            0,
            &Frame::Hello {
                features: self.features,
                max_frame_bytes: self.max_frame_bytes as u32,
                client: "felix-rs".into(),
            },
        );
        if let Some(t) = self.established.take() {
            let _ = t.send(());
        }
    }
    fn on_event(&mut self, c: &mut FelixConn, ev: ConnEvent) {
        let (frame, stream) = match ev {
            ConnEvent::Frame { frame, stream } => (frame, stream),
            ConnEvent::Finished { stream } | ConnEvent::Reset { stream, .. } => {
                self.lane_closed(stream);
                return;
            }
            // An answer this client cannot read fails its request at once rather than
            // leaving it to time out.
            ConnEvent::BadFrame { stream, error } => {
                tracing::warn!(stream, ?error, "unreadable frame from the broker");
                if let Some(id) = error.request_id {
                    self.lanes.answered(id);
                }
                if let Some(tx) = error.request_id.and_then(|id| self.pending.remove(&id)) {
                    let _ = tx.send(Err(Error::Protocol(format!(
                        "the broker's answer could not be read: {}",
                        error.error
                    ))));
                }
                return;
            }
        };
        // Server-initiated unidirectional streams (id % 4 == 3) are subscriptions.
        if stream % 4 == 3 {
            self.on_sub_frame(c, stream, frame);
            return;
        }
        if let Frame::HelloOk {
            limits, features, ..
        } = &frame
        {
            // Each side sends at most the other's maximum.
            c.set_peer_max_frame_bytes(limits.max_frame_bytes as usize);
            self.mux.on = features & self.features & features::WATCH_MUX != 0;
            self.submux.on = features & self.features & features::SUB_MUX != 0;
            if let Some(h) = self.hello.take() {
                let _ = h.send(Ok(frame));
            }
            return;
        }
        let Some(id) = request_id_of(&frame) else {
            return;
        };
        if let (0, Frame::Error { code, message, .. }) = (id, &frame) {
            if stream != 0 {
                let why = broker_error(*code, message.clone());
                if !self.lanes.ended_by_broker(stream, why) {
                    tracing::warn!(stream, code, %message, "the broker ended an unknown stream");
                }
                return;
            }
        }
        let opened = match &frame {
            Frame::SubscribeOk {
                subscription_id, ..
            } => Some(*subscription_id),
            Frame::Cache(CacheFrame::CacheWatchOk { watch_id, .. }) => Some(*watch_id),
            _ => None,
        };
        if let Some(sid) = opened {
            if let Some(mut slot) = self.pending_subs.remove(&id) {
                if let Frame::Cache(CacheFrame::CacheWatchOk { shard, .. }) = &frame {
                    slot.shard = *shard;
                }
                self.subs.insert(sid, slot.clone());
                let stream = self
                    .stream_sub
                    .iter()
                    .find(|(_, s)| **s == sid)
                    .map(|(st, _)| *st);
                let mut ended = false;
                for f in self.early.remove(&sid).unwrap_or_default() {
                    ended |= is_end(&f);
                    match (Self::to_event(slot.shard, f), stream) {
                        (Some(ev), Some(st)) => self.deliver(c, st, &slot, ev),
                        // Held from the mux stream until this answer.
                        (Some(ev), None) if slot.watch => self.deliver_mux(c, sid, &slot, ev),
                        (Some(ev), None) if slot.mux => self.deliver_sub_mux(sid, &slot, ev),
                        _ => {}
                    }
                }
                if let (true, Some(st)) = (ended, stream) {
                    if !self.blocked.contains_key(&st) {
                        self.subs.remove(&sid);
                        self.stream_sub.remove(&st);
                    }
                }
            }
        }
        if let Frame::Error { .. } = &frame {
            self.pending_subs.remove(&id);
        }
        if let Some(tx) = self.pending.remove(&id) {
            self.lanes.answered(id);
            let _ = tx.send(Ok(frame));
        } else if id == 0 && self.hello.is_some() {
            if let Some(h) = self.hello.take() {
                let _ = h.send(Ok(frame));
            }
        } else if let Some(i) = self.cancels.iter().position(|r| *r == id) {
            // The late answer to a poll cancel (its poll had been answered).
            self.cancels.remove(i);
        } else if let Frame::Error { code, message, .. } = frame {
            // A refused fire-and-forget publish.
            self.fire_errors.count.fetch_add(1, Ordering::Relaxed);
            *self.fire_errors.last.lock().unwrap() = Some(broker_error(code, message));
        }
    }
    fn on_command(&mut self, c: &mut FelixConn, cmd: Cmd) {
        // A frame over the broker's maximum is refused here, before anything is sent.
        let too_large = |e: felix_quic::wire::WireError| match e {
            felix_quic::wire::WireError::FrameTooLarge { len, max } => {
                Error::FrameTooLarge { len, max }
            }
            other => Error::Protocol(other.to_string()),
        };
        match cmd {
            Cmd::Request {
                frame,
                request_id,
                reply,
            } => match c.try_send_frame(0, &frame) {
                Ok(()) => {
                    self.pending.insert(request_id, reply);
                }
                Err(e) => {
                    let _ = reply.send(Err(too_large(e)));
                }
            },
            Cmd::Publish {
                frame,
                request_id,
                lane,
                reply,
            } => {
                let stream = match lane {
                    Lane::Acked(n) => self.lanes.stream(n, || c.open_bidi()),
                    Lane::Fire => *self.fire_stream.get_or_insert_with(|| c.open_uni()),
                };
                match (c.try_send_frame(stream, &frame), reply) {
                    (Ok(()), Some(reply)) => {
                        self.pending.insert(request_id, reply);
                        self.lanes.sent(request_id, stream);
                    }
                    (Ok(()), None) => {}
                    (Err(e), Some(reply)) => {
                        let _ = reply.send(Err(too_large(e)));
                    }
                    (Err(e), None) => {
                        self.fire_errors.count.fetch_add(1, Ordering::Relaxed);
                        *self.fire_errors.last.lock().unwrap() = Some(too_large(e));
                    }
                }
            }
            Cmd::Subscribe {
                frame,
                request_id,
                reply,
                mut slot,
            } => {
                // The broker puts drop_new subscriptions on the mux stream.
                if let Frame::Subscribe { policy, .. } = &frame {
                    slot.mux = self.submux.on && *policy == QueuePolicy::DropNew;
                }
                self.pending.insert(request_id, reply);
                self.pending_subs.insert(request_id, slot);
                c.send_frame(0, &frame);
            }
            Cmd::Unsubscribe {
                subscription_id,
                request_id,
            } => {
                let removed = self.subs.remove(&subscription_id);
                self.sub_mux_unsubscribed(subscription_id, removed.as_ref());
                self.mux_unsubscribed(subscription_id, removed);
                // Frames still in flight on its stream (its end included) are dropped, not
                // kept as "early" frames of a subscription that never comes.
                self.stream_sub.retain(|_, s| *s != subscription_id);
                self.early.remove(&subscription_id);
                c.send_frame(
                    0,
                    &Frame::Unsubscribe {
                        request_id,
                        subscription_id,
                    },
                );
            }
            Cmd::Send { frame } => {
                if let Frame::Group(felix_quic::wire::GroupFrame::GroupPollCancel {
                    request_id,
                    ..
                }) = &frame
                {
                    if self.cancels.len() == CANCELS_REMEMBERED {
                        self.cancels.pop_front();
                    }
                    self.cancels.push_back(*request_id);
                }
                c.send_frame(0, &frame)
            }
            Cmd::Resume => {}
            Cmd::FlushFire { done } => match self.fire_stream.take() {
                None => {
                    let _ = done.send(Ok(()));
                }
                Some(s) => {
                    c.finish(s);
                    self.flushing.push((s, done));
                }
            },
            Cmd::Close { done } => {
                c.close(0, "client close");
                self.closing.push(done);
            }
        }
    }
    fn before_flush(&mut self, c: &mut FelixConn, events: &mut Vec<ConnEvent>) {
        // The broker stopped the fire-and-forget stream (its refusal came on the control
        // stream): the next fire-and-forget publish opens a fresh one.
        if let Some(s) = self.fire_stream {
            if let Some(code) = c.stopped(s) {
                self.fire_stream = None;
                self.fire_errors.count.fetch_add(1, Ordering::Relaxed);
                let mut last = self.fire_errors.last.lock().unwrap();
                if last.is_none() {
                    *last = Some(Error::Closed(format!(
                        "the broker stopped fire-and-forget stream {s} (code {code}): publishes queued on it are lost"
                    )));
                }
            }
        }
        let backlog = self.fire_stream.map_or(0, |s| c.queued_bytes(s));
        self.fire_backlog.store(backlog as u64, Ordering::Relaxed);
        let mut i = 0;
        while i < self.flushing.len() {
            match c.send_settled(self.flushing[i].0) {
                None => i += 1,
                Some(ok) => {
                    let (s, done) = self.flushing.swap_remove(i);
                    let _ = done.send(if ok {
                        Ok(())
                    } else {
                        Err(Error::Closed(format!(
                            "the broker stopped fire-and-forget stream {s}: some of its records may be lost"
                        )))
                    });
                }
            }
        }
        self.drain_mux_blocked();
        self.drain_sub_mux_blocked();
        let streams: Vec<u64> = self.blocked.keys().copied().collect();
        for stream in streams {
            let Some(&sid) = self.stream_sub.get(&stream) else {
                self.blocked.remove(&stream);
                continue;
            };
            let Some(slot) = self.subs.get(&sid).cloned() else {
                self.blocked.remove(&stream);
                c.resume(stream);
                continue;
            };
            let q = self.blocked.get_mut(&stream).unwrap();
            let mut ended = false;
            while let Some(ev) = q.pop_front() {
                let end = matches!(ev, Event::End { .. } | Event::Watch(WatchItem::End { .. }));
                match slot.events.try_send(ev) {
                    Ok(()) => ended |= end,
                    Err(mpsc::error::TrySendError::Full(ev)) => {
                        q.push_front(ev);
                        break;
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => q.clear(),
                }
            }
            if !q.is_empty() {
                // Still full: ask the application side to wake us again after its next read.
                slot.paused.store(true, Ordering::Release);
            } else if ended {
                // Its last event is out: forget the slot (a later connection close must not
                // end it twice).
                self.blocked.remove(&stream);
                self.subs.remove(&sid);
                self.stream_sub.remove(&stream);
            } else {
                self.blocked.remove(&stream);
                slot.paused.store(false, Ordering::Release);
                c.resume(stream);
                c.read_stream(stream, events);
            }
        }
    }
    fn on_closed(&mut self, reason: String) {
        let _ = self.close_reason.set(reason.clone());
        for (_, done) in self.flushing.drain(..) {
            let _ = done.send(Err(Error::Closed(reason.clone())));
        }
        for (_, tx) in self.pending.drain() {
            let _ = tx.send(Err(Error::Closed(reason.clone())));
        }
        self.lanes.clear();
        if let Some(h) = self.hello.take() {
            let _ = h.send(Err(Error::Closed(reason.clone())));
        }
        self.mux = Default::default();
        for (_, slot) in self.subs.drain() {
            slot.events.send_end(Event::End {
                shard: slot.shard,
                code: u16::MAX,
                message: format!("connection closed: {reason}"),
            });
        }
        for d in self.closing.drain(..) {
            let _ = d.send(());
        }
    }
}

struct Inner {
    tx: mpsc::UnboundedSender<Cmd>,
    cfg: ClientConfig,
    next_id: AtomicU64,
    next_lane: AtomicU64,
    fire_errors: Arc<FireErrors>,
    fire_backlog: Arc<AtomicU64>,
    close_reason: Arc<std::sync::OnceLock<String>>,
}

impl Inner {
    /// A request that found the connection gone: the reason it closed, when it said one.
    fn ended(&self) -> Error {
        Error::Closed(
            self.close_reason
                .get()
                .cloned()
                .unwrap_or_else(|| "connection task ended".into()),
        )
    }
    /// A `Publish` frame with a fresh request id; refuses an empty batch.
    fn publish_frame<P: Into<Bytes>>(
        &self,
        stream: &StreamName,
        selector: ShardSelector,
        payloads: Vec<P>,
        ack: bool,
    ) -> Result<(u64, Frame), Error> {
        if payloads.is_empty() {
            return Err(Error::InvalidArgument(
                "a publish needs at least one record".into(),
            ));
        }
        let request_id = self.id();
        let records = Records::encode(payloads.into_iter().map(|p| p.into()));
        let frame = Frame::Publish {
            request_id,
            stream: stream.clone(),
            shard: selector,
            ack,
            records,
        };
        Ok((request_id, frame))
    }
    fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
    fn send(&self, cmd: Cmd) -> Result<(), Error> {
        self.tx.send(cmd).map_err(|_| self.ended())
    }
    async fn wait_result(&self, rx: oneshot::Receiver<Result<(), Error>>) -> Result<(), Error> {
        self.answer(rx, self.cfg.request_timeout).await
    }
    async fn wait(&self, rx: oneshot::Receiver<Result<Frame, Error>>) -> Result<Frame, Error> {
        self.answer(rx, self.cfg.request_timeout).await
    }
    /// The answer the connection task sends, within `limit`; a dropped sender means the
    /// connection is gone ([`Inner::ended`]).
    async fn answer<T>(
        &self,
        rx: oneshot::Receiver<Result<T, Error>>,
        limit: Duration,
    ) -> Result<T, Error> {
        match tokio::time::timeout(limit, rx).await {
            Err(_) => Err(Error::Timeout(limit)),
            Ok(Err(_)) => Err(self.ended()),
            Ok(Ok(r)) => r,
        }
    }
}

fn unexpected(f: Frame) -> Error {
    match f {
        Frame::Error { code, message, .. } => broker_error(code, message),
        other => Error::Protocol(format!("unexpected answer kind {}", other.kind())),
    }
}

/// A connection to one broker.
pub struct Client {
    inner: Arc<Inner>,
    /// Limits the broker announced.
    pub limits: Limits,
    /// The broker core that holds this connection.
    pub core: u16,
}

/// An acked publisher with its own QUIC stream (so one slow shard's acks never delay
/// another publisher's).
#[derive(Clone)]
pub struct Publisher {
    inner: Arc<Inner>,
    lane: u32,
}

impl Publisher {
    /// Publish records in one batch to the shard `selector` picks; waits for the ack.
    pub async fn publish_batch<P: Into<Bytes>>(
        &self,
        stream: &StreamName,
        selector: ShardSelector,
        payloads: Vec<P>,
    ) -> Result<Ack, Error> {
        let (request_id, frame) = self.inner.publish_frame(stream, selector, payloads, true)?;
        let (reply, rx) = oneshot::channel();
        self.inner.send(Cmd::Publish {
            frame,
            request_id,
            lane: Lane::Acked(self.lane),
            reply: Some(reply),
        })?;
        match self.inner.wait(rx).await? {
            Frame::PublishAck {
                shard,
                first_offset,
                count,
                owner,
                ..
            } => Ok(Ack {
                shard,
                first_offset,
                count,
                owner: (owner != 0).then_some(owner),
            }),
            other => Err(unexpected(other)),
        }
    }
}

/// A live subscription (one shard, or every shard of a stream merged).
pub struct Subscription {
    /// None for a member of a [`WatchSet`], whose items come through the set's channel.
    rx: Option<mpsc::Receiver<Event>>,
    paused: Arc<AtomicBool>,
    inner: Arc<Inner>,
    /// `(shard, subscription id)` per shard covered.
    pub ids: Vec<(u32, u64)>,
    /// The first offset per shard, as the broker answered.
    pub start_offsets: Vec<(u32, u64)>,
    lost: u64,
}

impl Subscription {
    /// The next event; `None` once the connection is gone and everything was read.
    pub async fn next(&mut self) -> Option<Event> {
        let ev = self.rx.as_mut()?.recv().await;
        self.after_recv(&ev);
        ev
    }
    /// The next event if one arrives within `timeout`.
    pub async fn next_timeout(&mut self, timeout: Duration) -> Result<Option<Event>, Error> {
        let Some(rx) = self.rx.as_mut() else {
            return Ok(None);
        };
        match tokio::time::timeout(timeout, rx.recv()).await {
            Ok(ev) => {
                self.after_recv(&ev);
                Ok(ev)
            }
            Err(_) => Err(Error::Timeout(timeout)),
        }
    }
    fn after_recv(&mut self, ev: &Option<Event>) {
        if let Some(Event::Lag { lost, .. }) = ev {
            self.lost += lost;
        }
        // An ended shard is not unsubscribed again on drop.
        if let Some(Event::End { shard, .. } | Event::Watch(WatchItem::End { shard, .. })) = ev {
            self.ids.retain(|(s, _)| s != shard);
        }
        // A load first: the swap is a locked write, and it runs once per item per
        // subscription while the flag is almost never set.
        if self.paused.load(Ordering::Acquire) && self.paused.swap(false, Ordering::AcqRel) {
            let _ = self.inner.send(Cmd::Resume);
        }
    }
    /// Records the broker announced as lost to this subscription so far.
    pub fn lost_records(&self) -> u64 {
        self.lost
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        for (_, sid) in &self.ids {
            let _ = self.inner.send(Cmd::Unsubscribe {
                subscription_id: *sid,
                request_id: self.inner.id(),
            });
        }
    }
}

impl Client {
    /// The connection task has ended (the connection closed or was lost): every call on
    /// this client fails from now on.
    pub fn is_closed(&self) -> bool {
        self.inner.tx.is_closed()
    }

    /// Connect, complete TLS 1.3 and the Felix handshake within `connect_timeout`.
    pub async fn connect(cfg: ClientConfig) -> Result<Client, Error> {
        let mut qc =
            client_config(&cfg.verify, &cfg.transport).map_err(|e| Error::Tls(e.to_string()))?;
        let (etx, erx) = oneshot::channel();
        let (htx, hrx) = oneshot::channel();
        let fire_errors = Arc::new(FireErrors::default());
        let fire_backlog = Arc::new(AtomicU64::new(0));
        let close_reason = Arc::new(std::sync::OnceLock::new());
        let handler = ConnHandler {
            close_reason: close_reason.clone(),
            established: Some(etx),
            hello: Some(htx),
            pending: HashMap::new(),
            pending_subs: HashMap::new(),
            subs: Default::default(),
            stream_sub: HashMap::new(),
            early: HashMap::new(),
            blocked: HashMap::new(),
            lanes: Default::default(),
            fire_stream: None,
            fire_errors: fire_errors.clone(),
            closing: Vec::new(),
            cancels: VecDeque::new(),
            flushing: Vec::new(),
            fire_backlog: fire_backlog.clone(),
            max_frame_bytes: cfg.max_frame_bytes,
            features: features::ALL
                & !(if cfg.watch_mux {
                    0
                } else {
                    features::WATCH_MUX
                })
                & !(if cfg.sub_mux { 0 } else { features::SUB_MUX }),
            mux: Default::default(),
            submux: Default::default(),
            keepalive: cfg.keepalive,
        };
        let tx = spawn_client(
            cfg.addr,
            Some(&cfg.server_name),
            &mut qc,
            cfg.max_frame_bytes,
            handler,
        )
        .await
        .map_err(|e| Error::Connect(cfg.addr, e.to_string()))?;
        let t = cfg.connect_timeout;
        let started = tokio::time::Instant::now();
        match tokio::time::timeout(t, erx).await {
            Err(_) => {
                return Err(Error::Unreachable {
                    addr: cfg.display_addr.clone(),
                    waited: t,
                })
            }
            // Closed before the handshake completed: the connection task said why.
            Ok(Err(_)) => {
                let reason = match hrx.await {
                    Ok(Err(Error::Closed(r))) => r,
                    _ => "closed".into(),
                };
                return Err(handshake_error(&cfg, &reason));
            }
            Ok(Ok(())) => {}
        }
        let left = t.saturating_sub(started.elapsed());
        let hello = tokio::time::timeout(left, hrx)
            .await
            .map_err(|_| Error::Timeout(t))?
            .map_err(|_| Error::Closed("connection task ended".into()))??;
        let client = match hello {
            Frame::HelloOk { limits, core, .. } => Client {
                inner: Arc::new(Inner {
                    tx,
                    cfg,
                    next_id: AtomicU64::new(1),
                    next_lane: AtomicU64::new(1),
                    fire_errors,
                    fire_backlog,
                    close_reason,
                }),
                limits,
                core,
            },
            other => return Err(unexpected(other)),
        };
        // A token presented at connect: refused here rather than at the first request.
        if let Some(token) = client.inner.cfg.token.clone() {
            client.authenticate(&token).await?;
        }
        Ok(client)
    }

    /// Present `token` on this connection (again at any time: a fresh token replaces the old
    /// one in place, and a day-long subscription outlives an hour-long token this way). A
    /// refused token leaves the connection's principal as it was.
    pub async fn authenticate(&self, token: &str) -> Result<Authenticated, Error> {
        if token.len() > felix_quic::wire::auth::TOKEN_BYTES_MAX {
            return Err(Error::InvalidArgument(format!(
                "a token of {} bytes is over the {}-byte maximum",
                token.len(),
                felix_quic::wire::auth::TOKEN_BYTES_MAX
            )));
        }
        match self
            .request(|request_id| {
                Frame::Auth(AuthFrame::Authenticate {
                    request_id,
                    token: token.to_string(),
                })
            })
            .await?
        {
            Frame::Auth(AuthFrame::Authenticated {
                subject,
                tenant,
                expires_at_ms,
                ..
            }) => Ok(Authenticated {
                subject,
                tenant,
                expires_at_ms,
            }),
            other => Err(unexpected(other)),
        }
    }

    async fn request(&self, make: impl FnOnce(u64) -> Frame) -> Result<Frame, Error> {
        let request_id = self.inner.id();
        let (reply, rx) = oneshot::channel();
        self.inner.send(Cmd::Request {
            frame: make(request_id),
            request_id,
            reply,
        })?;
        self.inner.wait(rx).await
    }

    /// Shard count and durability of a stream.
    pub async fn describe_stream(&self, stream: &StreamName) -> Result<StreamInfo, Error> {
        match self
            .request(|request_id| Frame::DescribeStream {
                request_id,
                stream: stream.clone(),
            })
            .await?
        {
            Frame::StreamInfo {
                shards,
                durable,
                owners,
                ..
            } => Ok(StreamInfo {
                shards,
                durable,
                owners,
            }),
            other => Err(unexpected(other)),
        }
    }

    /// The brokers of the cluster as this broker knows them: its own node id, and every
    /// registered broker's node id and client address (empty for a standalone broker).
    pub async fn describe_cluster(&self) -> Result<(u64, Vec<(u64, String)>), Error> {
        match self
            .request(|request_id| Frame::DescribeCluster { request_id })
            .await?
        {
            Frame::ClusterInfo {
                node_id, brokers, ..
            } => Ok((node_id, brokers)),
            other => Err(unexpected(other)),
        }
    }

    /// A new acked publisher on its own QUIC stream.
    pub fn publisher(&self) -> Publisher {
        Publisher {
            inner: self.inner.clone(),
            lane: self.inner.next_lane.fetch_add(1, Ordering::Relaxed) as u32,
        }
    }

    fn default_publisher(&self) -> Publisher {
        Publisher {
            inner: self.inner.clone(),
            lane: 0,
        }
    }

    /// Publish one record (round robin over shards); waits for the ack.
    pub async fn publish(
        &self,
        stream: &StreamName,
        payload: impl Into<Bytes>,
    ) -> Result<Ack, Error> {
        self.default_publisher()
            .publish_batch(stream, ShardSelector::RoundRobin, vec![payload.into()])
            .await
    }

    /// Publish a batch to one shard (explicit, by key, or round robin); waits for the ack.
    pub async fn publish_batch<P: Into<Bytes>>(
        &self,
        stream: &StreamName,
        selector: ShardSelector,
        payloads: Vec<P>,
    ) -> Result<Ack, Error> {
        self.default_publisher()
            .publish_batch(stream, selector, payloads)
            .await
    }

    /// Fire-and-forget: hands the batch to the connection and returns. Refusals are counted
    /// in [`Client::fire_and_forget_errors`].
    pub fn publish_fire<P: Into<Bytes>>(
        &self,
        stream: &StreamName,
        selector: ShardSelector,
        payloads: Vec<P>,
    ) -> Result<(), Error> {
        let (request_id, frame) = self
            .inner
            .publish_frame(stream, selector, payloads, false)?;
        self.inner.send(Cmd::Publish {
            frame,
            request_id,
            lane: Lane::Fire,
            reply: None,
        })
    }

    /// Bytes of fire-and-forget publishes queued in this client that QUIC has not taken yet
    /// (flow control holds them): a publisher that outruns the network waits on this.
    pub fn fire_backlog_bytes(&self) -> u64 {
        self.inner.fire_backlog.load(Ordering::Relaxed)
    }

    /// Finish the fire-and-forget stream and wait (bounded by the request timeout) until the
    /// broker has acknowledged every byte of it: after `Ok`, every fire-and-forget publish sent
    /// so far reached the broker (which may still refuse one: `fire_and_forget_errors`). The
    /// next fire-and-forget publish opens a new stream.
    pub async fn flush_fire(&self) -> Result<(), Error> {
        let (done, rx) = oneshot::channel();
        self.inner.send(Cmd::FlushFire { done })?;
        self.inner.wait_result(rx).await
    }

    /// Fire-and-forget publishes the broker refused so far, and the last refusal.
    pub fn fire_and_forget_errors(&self) -> (u64, Option<Error>) {
        let f = &self.inner.fire_errors;
        (
            f.count.load(Ordering::Relaxed),
            f.last.lock().unwrap().clone(),
        )
    }

    async fn subscribe_on(
        &self,
        stream: &StreamName,
        shard: u32,
        opts: &SubscribeOptions,
        slot: SubSlot,
    ) -> Result<(u64, u64), Error> {
        let request_id = self.inner.id();
        let frame = Frame::Subscribe {
            request_id,
            stream: stream.clone(),
            shard,
            start: opts.start,
            policy: opts.policy,
            queue_records_max: opts.queue_records_max,
            queue_bytes_max: opts.queue_bytes_max,
        };
        let (reply, rx) = oneshot::channel();
        self.inner.send(Cmd::Subscribe {
            frame,
            request_id,
            reply,
            slot,
        })?;
        match self.inner.wait(rx).await? {
            Frame::SubscribeOk {
                subscription_id,
                next_offset,
                ..
            } => Ok((subscription_id, next_offset)),
            other => Err(unexpected(other)),
        }
    }

    /// Subscribe to one shard.
    pub async fn subscribe(
        &self,
        stream: &StreamName,
        shard: u32,
        opts: SubscribeOptions,
    ) -> Result<Subscription, Error> {
        self.subscribe_shards(stream, &[shard], opts).await
    }

    /// Subscribe to every shard of a stream, merged into one subscription (each shard's
    /// order is kept). Either every shard opens or none stays open.
    pub async fn subscribe_stream(
        &self,
        stream: &StreamName,
        opts: SubscribeOptions,
    ) -> Result<Subscription, Error> {
        let info = self.describe_stream(stream).await?;
        let shards: Vec<u32> = (0..info.shards).collect();
        self.subscribe_shards(stream, &shards, opts).await
    }

    async fn subscribe_shards(
        &self,
        stream: &StreamName,
        shards: &[u32],
        opts: SubscribeOptions,
    ) -> Result<Subscription, Error> {
        if opts.buffer_events == 0 {
            return Err(Error::InvalidArgument(
                "buffer_events must be positive".into(),
            ));
        }
        let (tx, rx) = mpsc::channel(opts.buffer_events);
        let paused = Arc::new(AtomicBool::new(false));
        let mut sub = Subscription {
            rx: Some(rx),
            paused: paused.clone(),
            inner: self.inner.clone(),
            ids: Vec::new(),
            start_offsets: Vec::new(),
            lost: 0,
        };
        for &shard in shards {
            let slot = SubSlot {
                events: sink::Sink::Own(tx.clone()),
                paused: paused.clone(),
                shard,
                watch: false,
                mux: false,
            };
            // On failure `sub` is dropped, which unsubscribes the shards already opened.
            let (sid, start) = self.subscribe_on(stream, shard, &opts, slot).await?;
            sub.ids.push((shard, sid));
            sub.start_offsets.push((shard, start));
        }
        Ok(sub)
    }

    /// Close cleanly, waiting at most `close_timeout` for the broker to acknowledge.
    pub async fn close(self) -> Result<(), Error> {
        let (done, rx) = oneshot::channel();
        if self.inner.send(Cmd::Close { done }).is_err() {
            return Ok(());
        }
        let t = self.inner.cfg.close_timeout;
        match tokio::time::timeout(t, rx).await {
            Ok(_) => Ok(()),
            Err(_) => Err(Error::Timeout(t)),
        }
    }
}

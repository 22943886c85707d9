//! One core's runtime: its UDP socket, QUIC endpoint, sessions, the shards it owns, the
//! subscribers whose connections it holds, and the core mesh.
//!
//! Tasks per core, all on the core's glommio executor: the receive loop (never cancelled, so
//! no datagram is lost to cancellation), one mesh receiver per peer, the mesh pump, and the
//! flusher that writes packets when woken or when the earliest timer expires.
//!
//! The path of a publish: the connection's core validates it (stream, shard, payload size,
//! the connection's in-flight caps) and routes it to the shard's owner core (itself, or over
//! the mesh). The owner assigns offsets, encodes the delivery frame once
//! ([`crate::fanout::Batch`]), keeps it in the replay ring and sends **one** copy to every
//! core that has subscribers for the shard, then answers the publish. Each core offers the
//! batch to its subscribers' queues ([`crate::fanout::SubQueue`]) and moves queued items onto
//! the subscription streams as QUIC flow control allows.
//!
//! Mesh rule: a handler never awaits a full cross-core channel. `route` try-sends and
//! otherwise appends to an accounted per-peer overflow queue drained by the pump task, and
//! messages to self go through a local inbox, so two cores can never wedge each other.

use crate::catalog::{core_for_shard, Catalog, CatalogCell, Place, Slot};
use crate::config::Config;
use crate::fanout::{Batch, Item, Lag, Offer, ReplayRing, ShardOwner, SubQueue};
use crate::metrics::CoreCounters;
use felix_quic::conn::ConnEvent;
use felix_quic::glommio_driver::{wake_pair, DatagramIo, GlommioUdp, Wake, WakeRx};
use felix_quic::idmap::IdMap;
use felix_quic::server::{ConnKey, Endpoint, Route, TxBatch};
use felix_quic::wire::{
    admit, answer_stream, features, streams, ErrorCode, Frame, Limits, QueuePolicy, Records,
    ShardSelector, StartAt, Verdict,
};
use felix_quic::wire::{FrameError, FRAME_OVERHEAD_BYTES};
use felix_storage::{FsyncMode, Log, LogConfig, LogError, RecordIn};
use glommio::channels::channel_mesh::{Receivers, Senders};
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod cache_logs;
mod caches;
mod groups;
pub use caches::{CacheOrigin, Ev, Opened, WatchReq};
pub use groups::GroupOrigin;

/// Where a publish came from, so its answer finds its way back.
#[derive(Debug, Clone, Copy)]
pub struct Origin {
    pub core: u8,
    pub conn: ConnKey,
    pub quic_stream: u64,
    pub request_id: u64,
    pub ack: bool,
    pub bytes: u64,
}

/// A publish on its way to (or waiting at) the shard owner.
#[derive(Debug)]
pub struct PublishReq {
    pub origin: Origin,
    pub stream: u32,
    pub shard: u32,
    pub records: Records,
    /// Past this instant a held publish is answered `publish_timeout` and never appended.
    pub deadline: Instant,
}

type PubResult = Result<(u32, u64, u32), (ErrorCode, String)>;

/// Messages between cores (and from a core to itself, through its inbox).
pub enum MeshMsg {
    /// A datagram for a connection that lives on the receiving core.
    Packet { buf: Vec<u8>, from: SocketAddr },
    /// Connection core → owner.
    Publish(PublishReq),
    /// Owner → connection core: `(shard, first_offset, count)` or the refusal.
    PublishResult { origin: Origin, result: PubResult },
    /// Owner → every core with subscribers for the shard: one per core per batch.
    Delivery {
        stream: u32,
        shard: u32,
        batch: Batch,
    },
    /// Connection core → owner: a subscriber on `core` wants the shard from `start`.
    Attach {
        core: u8,
        sub: u64,
        stream: u32,
        shard: u32,
        start: StartAt,
    },
    /// Owner → connection core: what to replay, and the offset live deliveries continue at.
    AttachResult {
        sub: u64,
        result: Result<AttachOk, (ErrorCode, String)>,
    },
    /// Connection core → owner of a durable shard: the next history chunk from `from`.
    Fetch {
        core: u8,
        sub: u64,
        stream: u32,
        shard: u32,
        from: u64,
    },
    /// Owner → connection core: a history chunk (from disk), or the ring's tail and the
    /// switch to live delivery (`live`).
    FetchResult {
        sub: u64,
        result: Result<Fetched, (ErrorCode, String)>,
    },
    /// Connection core → owner: one subscriber of `core` is gone.
    Detach { core: u8, stream: u32, shard: u32 },
    /// Connection core → owner: whether any Block subscriber of `core` has parked batches.
    Parked {
        core: u8,
        stream: u32,
        shard: u32,
        parked: bool,
    },
    /// Connection core → owner of a durable shard: a consumer-group request.
    Group {
        origin: GroupOrigin,
        stream: u32,
        frame: felix_quic::wire::GroupFrame,
    },
    /// Owner → connection core: the answer to a group request.
    GroupReply { origin: GroupOrigin, frame: Frame },
    /// Connection core → every core: a connection that long-polled is gone.
    GroupConnClosed { core: u8, conn: ConnKey },
    /// A cache request, to the owner of its shard.
    CacheReq {
        origin: CacheOrigin,
        cache: u32,
        shard: u32,
        frame: felix_quic::wire::CacheFrame,
    },
    /// The answer, back to the connection's core.
    CacheReply { origin: CacheOrigin, frame: Frame },
    /// Register a watch and compute its start, at the owner.
    WatchOpen(WatchReq),
    WatchOpened {
        watch: u64,
        result: Result<Opened, (ErrorCode, String)>,
    },
    /// A change of a cache shard, to a core with a matching watch.
    CacheChange { cache: u32, shard: u32, ev: Arc<Ev> },
    /// Unregister a watch at the owner.
    WatchClose { watch: u64, cache: u32, shard: u32 },
    /// The owner dropped a shard (its storage failed): end the local watches on it.
    WatchesEnded {
        cache: u32,
        shard: u32,
        code: ErrorCode,
        message: String,
    },
    /// Owner → itself: try the next held publish (queued behind the deliveries just sent, so
    /// local subscribers park before the next append if they are full).
    DrainHeld { stream: u32, shard: u32 },
}

/// A successful attach.
#[derive(Debug)]
pub struct AttachOk {
    pub lag: Option<Lag>,
    pub replay: Vec<Batch>,
    pub from: u64,
    /// The subscriber starts below the owner's in-memory tail: it fetches history from disk
    /// (one chunk at a time, as its queue empties) and ignores live batches until a fetch
    /// answers `live`.
    pub catch_up: bool,
}

/// A history chunk.
#[derive(Debug)]
pub struct Fetched {
    /// Records retention deleted while the subscriber was catching up.
    pub lag: Option<Lag>,
    pub batches: Vec<Batch>,
    /// These batches reach the owner's current end: live deliveries follow them.
    pub live: bool,
}

/// A durable shard's log and the publishes waiting for their commit.
struct DurableShard {
    /// None when the log could not be opened (the shard is failed from the start).
    log: Option<Log>,
    /// In offset order: answered and delivered once the log acknowledges them.
    /// With the time each was handed to the log (for the commit latency histogram).
    pending: VecDeque<(PublishReq, std::ops::Range<u64>, Instant)>,
    failed: Option<String>,
    /// This shard's commit latency histogram (labelled stream and shard).
    commit_hist: Option<Arc<crate::metrics::Histogram>>,
    /// Publishes and attaches that arrived while the log was opening; handled again once
    /// it is open (or failed). Bounded by the connections' in-flight and subscription caps.
    deferred: Vec<MeshMsg>,
}

impl DurableShard {
    /// Placeholder while the log opens: mesh requests for the shard wait in `deferred`
    /// (see `defer_while_opening`) rather than taking the ephemeral path.
    fn opening() -> Self {
        DurableShard {
            log: None,
            pending: VecDeque::new(),
            failed: None,
            commit_hist: None,
            deferred: Vec::new(),
        }
    }

    fn is_opening(&self) -> bool {
        self.log.is_none() && self.failed.is_none()
    }

    /// The log, or the `unavailable` refusal every durable operation answers instead.
    fn usable(&self) -> Result<&Log, (ErrorCode, String)> {
        match (&self.failed, &self.log) {
            (None, Some(log)) => Ok(log),
            (Some(why), _) => Err((
                ErrorCode::Unavailable,
                format!("shard storage failed: {why}"),
            )),
            (None, None) => Err((ErrorCode::Unavailable, "shard storage is not open".into())),
        }
    }
}

/// Static settings of a core.
pub struct CoreSettings {
    pub cores: u8,
    pub cfg: Arc<Config>,
    /// The latest catalog (fixed when standalone, published by the ops thread otherwise).
    pub catalog: Arc<CatalogCell>,
    pub counters: Arc<CoreCounters>,
    /// Per durable shard latency histograms, shared with the ops listener.
    pub shard_metrics: Arc<crate::metrics::ShardMetrics>,
    pub shutdown: Arc<AtomicBool>,
    /// Set by a core whose drain hit the deadline with work unanswered (a forced exit).
    pub drain_forced: Arc<AtomicBool>,
    /// Per core: nothing left to answer while draining (see the flusher).
    pub drain_idle: Arc<Vec<AtomicBool>>,
    /// Counts cores that have opened their durable logs and serve (readiness waits for all).
    pub started: Arc<std::sync::atomic::AtomicUsize>,
}

#[derive(Default)]
struct PubStream {
    pending: u32,
    fin_requested: bool,
}

#[derive(Default)]
struct Session {
    hello_done: bool,
    /// Being closed by the broker (`close_with`): frames still arriving are ignored.
    closing: bool,
    /// Answer stream → the streams not read until it drains (refusals piled up unread).
    held_sources: HashMap<u64, Vec<u64>>,
    inflight_bytes: u64,
    unacked: u32,
    subs: Vec<u64>,
    /// Subscription stream id → subscription id.
    sub_streams: IdMap<u64, u64>,
    pub_streams: HashMap<u64, PubStream>,
    /// Sent a long poll (its close must reach the groups' owners).
    long_polls: bool,
    /// Cache watches (their streams are in `sub_streams` too).
    watches: Vec<u64>,
    /// Cache requests routed to an owner and not answered yet.
    cache_inflight: u32,
}

impl Session {
    /// Subscriptions and watches share `max_subscriptions`: refuse one more past it.
    fn room_for_one_more(&self, max: u32) -> Result<(), (ErrorCode, String)> {
        let held = self.subs.len() + self.watches.len();
        if held >= max as usize {
            return Err((
                ErrorCode::TooManySubscriptions,
                format!("connection holds {held} subscriptions and watches (max_subscriptions)"),
            ));
        }
        Ok(())
    }
}

/// A queue bound a client asked for: 0 takes the configured bound, which is also the most it
/// may ask for.
fn queue_bound(asked: u64, max: u64) -> u64 {
    if asked == 0 {
        max
    } else {
        asked.min(max)
    }
}

struct Sub {
    conn: ConnKey,
    quic_stream: u64,
    stream: u32,
    shard: u32,
    queue: SubQueue,
    /// None until the owner answered the attach; then the next offset this subscriber takes.
    next_offset: Option<u64>,
    request_id: u64,
    reply_stream: u64,
    /// Catching up from disk: `Some(fetch in flight)`; live once `None`.
    catch_up: Option<bool>,
}

type ShardKey = (u32, u32);

struct CoreState {
    id: u8,
    /// The catalog version this core acts on, refreshed from `s.catalog` (see
    /// `refresh_catalog`); slot indexes are stream identities on the data path.
    catalog: Arc<Catalog>,
    catalog_version: u64,
    ep: Endpoint,
    sessions: IdMap<ConnKey, Session>,
    s: CoreSettings,
    senders: Rc<Senders<MeshMsg>>,
    mesh_wake: Wake,
    mesh_overflow: Vec<VecDeque<MeshMsg>>,
    inbox: VecDeque<MeshMsg>,
    owned: HashMap<ShardKey, ShardOwner<PublishReq>>,
    held_total: usize,
    subs: IdMap<u64, Sub>,
    local_subs: HashMap<ShardKey, Vec<u64>>,
    parked_subs: HashMap<ShardKey, u32>,
    rr: HashMap<u32, u32>,
    next_sub: u64,
    durable: HashMap<ShardKey, DurableShard>,
    me: Weak<RefCell<CoreState>>,
    wake: Wake,
    /// Logs are being closed for shutdown: their `closed` answers are not failures.
    closing_logs: bool,
    /// Shutting down: new publishes are refused with `shutting_down` while those in flight
    /// are answered.
    draining: bool,
    /// Consumer groups of the durable shards this core owns (see `groups`).
    groups: HashMap<ShardKey, groups::ShardGroups>,
    /// Zero of the groups' millisecond clock.
    group_epoch: Instant,
    /// When a group next changes by time (a claim lapses, a wait ends); `u64::MAX`: never.
    group_due_ms: u64,
    /// Group tasks running (disk reads for polls, file removals) that owe an answer.
    group_tasks: usize,
    /// Cache shards this core owns.
    caches: HashMap<ShardKey, caches::OwnedCache>,
    /// Cache watches whose connections this core holds.
    watches: IdMap<u64, caches::Watch>,
    local_watches: HashMap<ShardKey, Vec<u64>>,
    /// Log-backed cache shards whose logs are opening, with the messages waiting for them.
    cache_opening: HashMap<ShardKey, Vec<MeshMsg>>,
    /// Log-backed cache shards that could not open or failed (answer unavailable).
    cache_failed: HashMap<ShardKey, String>,
    /// Log-backed cache shards whose logs are closing (dropped here), with the messages that
    /// wait for the close.
    cache_closing: HashMap<ShardKey, Vec<MeshMsg>>,
    /// Epoch of the last log-backed cache shard opened.
    next_cache_epoch: u64,
    /// When the queue gauges were last refreshed.
    gauges_at: Instant,
    /// Connections that have not said Hello yet, with their deadline (FIFO: one timeout).
    hello_waits: VecDeque<(Instant, ConnKey)>,
    /// Connections closing after their Error frame, with the moment the close is forced even
    /// if the frame could not leave (FIFO: one grace period).
    closes_due: VecDeque<(Instant, ConnKey)>,
}

/// Run one core until shutdown. `sock` is this core's SO_REUSEPORT socket.
pub async fn run_core(
    sock: socket2::Socket,
    quic_config: quiche::Config,
    settings: CoreSettings,
    mesh: (Senders<MeshMsg>, Receivers<MeshMsg>),
) {
    let (senders, mut receivers) = mesh;
    let id = senders.peer_id() as u8;
    let sock = Rc::new(GlommioUdp::new(sock));
    let local = sock.local_addr().expect("bound socket");
    let ep = Endpoint::new(
        id,
        settings.cores,
        quic_config,
        local,
        settings.cfg.max_frame_bytes,
    );
    let n = settings.cores as usize;
    let senders = Rc::new(senders);
    let (wake, wake_rx) = wake_pair();
    let (mesh_wake, mesh_wake_rx) = wake_pair();
    let (catalog_version, catalog) = settings.catalog.load();
    let state = Rc::new(RefCell::new(CoreState {
        id,
        catalog,
        catalog_version,
        ep,
        sessions: IdMap::default(),
        s: settings,
        senders: senders.clone(),
        mesh_wake: mesh_wake.clone(),
        mesh_overflow: (0..n).map(|_| Default::default()).collect(),
        inbox: VecDeque::new(),
        owned: HashMap::new(),
        held_total: 0,
        subs: IdMap::default(),
        local_subs: HashMap::new(),
        parked_subs: HashMap::new(),
        rr: HashMap::new(),
        next_sub: 1,
        durable: HashMap::new(),
        me: Weak::new(),
        wake: wake.clone(),
        draining: false,
        closing_logs: false,
        groups: HashMap::new(),
        group_epoch: Instant::now(),
        group_due_ms: u64::MAX,
        group_tasks: 0,
        caches: HashMap::new(),
        watches: IdMap::default(),
        local_watches: HashMap::new(),
        cache_opening: HashMap::new(),
        cache_failed: HashMap::new(),
        cache_closing: HashMap::new(),
        next_cache_epoch: 0,
        gauges_at: Instant::now(),
        hello_waits: VecDeque::new(),
        closes_due: VecDeque::new(),
    }));
    state.borrow_mut().me = Rc::downgrade(&state);
    open_durable_shards(&state).await;
    state.borrow().s.started.fetch_add(1, Ordering::AcqRel);

    // Mesh receivers: one task per peer.
    for (_peer, rx) in receivers.streams() {
        let state = state.clone();
        let wake = wake.clone();
        let sock = sock.clone();
        glommio::spawn_local(async move {
            use futures_lite::StreamExt;
            let mut rx = rx;
            while let Some(msg) = rx.next().await {
                let reply = {
                    let mut st = state.borrow_mut();
                    if matches!(msg, MeshMsg::Delivery { .. }) {
                        CoreCounters::inc(&st.s.counters.mesh_deliveries_in);
                    }
                    let r = st.on_mesh(msg);
                    st.drain_inbox();
                    r
                };
                if let Some((buf, to)) = reply {
                    let _ = sock.send_one(&buf, to).await;
                }
                wake.wake();
            }
        })
        .detach();
    }

    // Mesh pump: sends what try_send could not (a full channel is awaited here, never in a
    // handler, so two cores cannot wedge each other).
    {
        let state = state.clone();
        let senders = senders.clone();
        glommio::spawn_local(async move {
            loop {
                mesh_wake_rx.wait(Some(Duration::from_millis(50))).await;
                loop {
                    let next = {
                        let mut st = state.borrow_mut();
                        st.mesh_overflow
                            .iter_mut()
                            .enumerate()
                            .find_map(|(i, q)| q.pop_front().map(|m| (i, m)))
                    };
                    let Some((to, msg)) = next else { break };
                    if senders.send_to(to, msg).await.is_err() {
                        break;
                    }
                }
            }
        })
        .detach();
    }

    // Receive loop.
    {
        let state = state.clone();
        let wake = wake.clone();
        let sock = sock.clone();
        glommio::spawn_local(async move {
            // Room for the largest GRO-coalesced read (64 KiB of datagrams).
            let mut buf = vec![0u8; 1 << 17];
            loop {
                let (len, from, segment) = match sock.recv(&mut buf).await {
                    Ok(v) => v,
                    Err(_) => continue,
                };
                for seg in felix_quic::udp::gro_segments(len, segment) {
                    let reply = {
                        let mut st = state.borrow_mut();
                        CoreCounters::inc(&st.s.counters.packets_received);
                        let r = st.on_datagram(&mut buf[seg], from);
                        st.drain_inbox();
                        r
                    };
                    if let Some(r) = reply {
                        let _ = sock.send_one(&r, from).await;
                    }
                }
                wake.wake();
            }
        })
        .detach();
    }

    flusher(state, sock, wake_rx).await;
}

/// The log directory of one durable shard of the standalone catalog.
pub fn shard_dir(
    root: &std::path::Path,
    name: &felix_quic::wire::StreamName,
    shard: u32,
) -> std::path::PathBuf {
    slot_shard_dir(root, name, 0, shard)
}

/// The log directory of one shard of a stream incarnation (see [`stream_dir`]).
fn slot_shard_dir(
    root: &std::path::Path,
    name: &felix_quic::wire::StreamName,
    incarnation: u64,
    shard: u32,
) -> std::path::PathBuf {
    stream_dir(root, name, incarnation).join(format!("{shard:05}"))
}

/// Close a deleted shard's log (if open) and remove its directory, then the stream's
/// directory once it is empty (removing it fails while another core's shard is still there).
fn remove_deleted_shard(
    log: Option<Log>,
    root: Option<std::path::PathBuf>,
    slot: &Slot,
    shard: u32,
) {
    let name = slot.def.name();
    let incarnation = slot.incarnation;
    glommio::spawn_local(async move {
        if let Some(log) = log {
            let _ = log.close().await;
        }
        let Some(root) = root else { return };
        let dir = slot_shard_dir(&root, &name, incarnation, shard);
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot remove a deleted shard's log");
            }
        }
        let _ = std::fs::remove_dir(stream_dir(&root, &name, incarnation));
    })
    .detach();
}

/// A stream's directory: `tenant/namespace/stream`, and for a control-plane stream
/// `tenant/namespace/stream@incarnation` (`@` is outside the name charset), so a stream
/// deleted and created again never reads the old incarnation's records.
pub fn stream_dir(
    root: &std::path::Path,
    name: &felix_quic::wire::StreamName,
    incarnation: u64,
) -> std::path::PathBuf {
    let ns = root.join(&name.tenant).join(&name.namespace);
    if incarnation == 0 {
        ns.join(&name.stream)
    } else {
        ns.join(format!("{}@{incarnation}", name.stream))
    }
}

/// Remove directories of older incarnations of a stream (deleted while this broker was
/// down). Errors are ignored: another core may be removing the same directory.
fn remove_older_incarnations(root: &std::path::Path, slot: &Slot) {
    let name = slot.def.name();
    let ns = root.join(&name.tenant).join(&name.namespace);
    let Ok(rd) = std::fs::read_dir(&ns) else {
        return;
    };
    let prefix = format!("{}@", name.stream);
    for e in rd.flatten() {
        let f = e.file_name().to_string_lossy().to_string();
        let Some(inc) = f.strip_prefix(&prefix).and_then(|n| n.parse::<u64>().ok()) else {
            continue;
        };
        if inc < slot.incarnation {
            tracing::info!(stream = %name, incarnation = inc, "removing the logs of a deleted incarnation");
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

fn commit_bytes_max(cfg: &Config) -> usize {
    let seg = cfg.durable_segment_bytes as usize - 2 * felix_storage::segment::BLOCK;
    cfg.max_frame_bytes
        .saturating_mul(4)
        .min(seg)
        .min(256 << 20)
}

/// The storage settings of a durable stream (its own, else the broker's defaults).
pub fn log_config(cfg: &Config, def: &crate::catalog::StreamDef) -> LogConfig {
    let mode = def.fsync.as_deref().unwrap_or(&cfg.durable_fsync);
    LogConfig {
        segment_bytes_max: cfg.durable_segment_bytes,
        // A frame's records grow on disk (24 more header bytes per record): allow 4x the
        // frame, within the segment. A batch beyond it is refused `payload_too_large`.
        commit_bytes_max: commit_bytes_max(cfg),
        pending_bytes_max: cfg.durable_pending_bytes_max.max(commit_bytes_max(cfg)),
        fsync: FsyncMode::parse(mode, cfg.durable_fsync_interval_ms).expect("validated at start"),
        retention: felix_storage::retention::RetentionLimits {
            bytes_max: def.retention_bytes.or(cfg.durable_retention_bytes),
            age_max_ms: def
                .retention_seconds
                .or(cfg.durable_retention_seconds)
                .map(|s| s.saturating_mul(1000)),
        },
        inline_write_slow_us: cfg.durable_inline_write_slow_us,
        ..LogConfig::default()
    }
}

/// Open the logs of the durable shards this core owns (before serving, standalone). A log
/// that cannot be opened (refused: corruption in the middle, or an I/O error) leaves its
/// shard failed: it answers `unavailable`, the rest serve.
async fn open_durable_shards(state: &Rc<RefCell<CoreState>>) {
    let keys: Vec<ShardKey> = {
        let mut st = state.borrow_mut();
        let keys = st.durable_keys_to_open();
        for k in &keys {
            st.durable.insert(*k, DurableShard::opening());
        }
        keys
    };
    for key in keys {
        let job = state.borrow().open_job(key);
        let r = job.run().await;
        state.borrow_mut().on_durable_opened(key, r);
    }
}

/// Everything needed to open one durable shard's log off the core state.
struct OpenJob {
    root: Option<std::path::PathBuf>,
    slot: Slot,
    shard: u32,
    config: LogConfig,
}

type OpenResult = Result<(Log, felix_storage::log::OpenReport), String>;

impl OpenJob {
    async fn run(self) -> OpenResult {
        let Some(root) = self.root else {
            return Err("no durable storage directory is configured on this broker (durable_storage_dir / FELIX_DURABLE_STORAGE_DIR)".into());
        };
        if self.slot.incarnation != 0 {
            remove_older_incarnations(&root, &self.slot);
        }
        let dir = slot_shard_dir(
            &root,
            &self.slot.def.name(),
            self.slot.incarnation,
            self.shard,
        );
        Log::open(&dir, self.config)
            .await
            .map_err(|e| e.to_string())
    }
}

/// Re-enter the core after a task awaited: run `f` on the state (unless the core is gone),
/// then handle what it queued for this core and wake the flusher to send it.
fn reenter(me: &Weak<RefCell<CoreState>>, f: impl FnOnce(&mut CoreState)) {
    let Some(st) = me.upgrade() else { return };
    let mut st = st.borrow_mut();
    f(&mut st);
    st.drain_inbox();
    st.wake.wake();
}

/// Answer and deliver publishes as their commits complete; fail the shard on a device error.
async fn commit_watcher(state: Weak<RefCell<CoreState>>, key: ShardKey, log: Log) {
    let mut seen = log.acked();
    loop {
        let r = log.wait_acked_beyond(seen).await;
        let Some(st) = state.upgrade() else { return };
        let mut st = st.borrow_mut();
        match r {
            Ok(acked) => {
                seen = acked;
                st.on_durable_acked(key, acked);
            }
            Err(e) => {
                st.on_durable_failed(key, e.to_string());
                st.drain_inbox();
                st.wake.wake();
                return;
            }
        }
        st.drain_inbox();
        st.wake.wake();
    }
}

/// Shutdown phases of a core's flusher.
enum Drain {
    Serving,
    /// Refusing new publishes, answering those in flight (until idle or the deadline).
    Answering {
        since: Instant,
    },
    /// Logs closed; every subscription and watch was ended `shutting_down` (the going-away
    /// notice) and gets a moment to flush before the connections close.
    Notified {
        since: Instant,
    },
    /// Connections told `shutting_down`; waiting for them to close.
    Closing {
        since: Instant,
    },
}

/// How long the going-away notices may take to flush before connections close.
const NOTIFY_FLUSH_MS: u64 = 200;

async fn flusher(state: Rc<RefCell<CoreState>>, sock: Rc<GlommioUdp>, wake_rx: WakeRx) {
    // 64 packets of ~1.3 KiB, or ~31 of 16 KiB, per round (packets are packed end to end).
    let mut batch = TxBatch::new(64, 1 << 20);
    let mut drain = Drain::Serving;
    loop {
        let shutdown = state.borrow().s.shutdown.load(Ordering::Acquire);
        if shutdown && matches!(drain, Drain::Serving) {
            let mut st = state.borrow_mut();
            st.ep.set_accepting(false);
            st.draining = true;
            drain = Drain::Answering {
                since: Instant::now(),
            };
        }
        if let Drain::Answering { since } = drain {
            let deadline_ms = state.borrow().s.cfg.drain_timeout_ms;
            // Every core publishes whether it still owes an answer; logs close only once no
            // core does, so an owner core keeps serving a peer's forwarded publishes (an
            // obligation shows on the core that owes it: the connection core until it gets
            // the result, the owner while it holds or commits).
            let idle = {
                let st = state.borrow();
                let mine = st.drain_idle();
                st.s.drain_idle[st.id as usize].store(mine, Ordering::Release);
                mine && st.s.drain_idle.iter().all(|f| f.load(Ordering::Acquire))
            };
            if idle || since.elapsed() > Duration::from_millis(deadline_ms / 2) {
                if !idle {
                    tracing::warn!(
                        core = state.borrow().id,
                        "drain deadline: closing with publishes unanswered"
                    );
                    state.borrow().s.drain_forced.store(true, Ordering::Release);
                }
                // Flush and fsync every log this core owns before telling clients we go.
                let logs: Vec<Log> = {
                    let mut st = state.borrow_mut();
                    st.closing_logs = true;
                    let mut logs: Vec<Log> =
                        st.durable.values().filter_map(|d| d.log.clone()).collect();
                    logs.extend(st.cache_logs());
                    logs
                };
                for log in logs {
                    if let Err(e) = log.close().await {
                        tracing::error!(error = %e, "durable log did not close cleanly");
                    }
                }
                state.borrow_mut().notify_going_away();
                drain = Drain::Notified {
                    since: Instant::now(),
                };
            }
        }
        if let Drain::Notified { since } = drain {
            let mut st = state.borrow_mut();
            let flushed = st
                .ep
                .keys()
                .into_iter()
                .all(|k| st.ep.get(k).is_none_or(|e| e.conn.queued_total() == 0));
            if flushed || since.elapsed() > Duration::from_millis(NOTIFY_FLUSH_MS) {
                for k in st.ep.keys() {
                    if let Some(e) = st.ep.get(k) {
                        e.conn.close(
                            ErrorCode::ShuttingDown.number() as u64,
                            "broker shutting down",
                        );
                    }
                    st.ep.mark_dirty(k);
                }
                drain = Drain::Closing {
                    since: Instant::now(),
                };
            }
        }
        loop {
            batch.clear();
            let now = Instant::now();
            {
                let mut st = state.borrow_mut();
                st.refresh_catalog();
                st.expire_held(now);
                st.groups_tick();
                st.caches_tick();
                st.gauges_tick(now);
                st.expire_hellos(now);
                st.drain_inbox();
                st.ep.on_timeouts(now);
                // Round robin over the connections dirty at the start of this round (those
                // dirtied meanwhile wait for the next): one that fills the batch goes to the
                // back, and the ones not reached stay queued in order.
                for _ in 0..st.ep.dirty_count() {
                    let Some(k) = st.ep.pop_dirty() else { break };
                    st.flush_conn(k);
                    if !st.ep.transmit(k, now, &mut batch) {
                        st.ep.mark_dirty(k);
                        break;
                    }
                }
                st.drain_inbox();
                for k in st.ep.reap_closed() {
                    st.on_conn_closed(k);
                    CoreCounters::inc(&st.s.counters.connections_closed);
                }
                st.drain_inbox();
            }
            if batch.is_empty() {
                break;
            }
            sock.send_batch(&batch).await;
        }
        if let Drain::Closing { since } = drain {
            let st = state.borrow();
            let close_ms = st.s.cfg.drain_timeout_ms / 2;
            if st.ep.conn_count() == 0 || since.elapsed() > Duration::from_millis(close_ms) {
                return;
            }
        }
        let timeout = {
            let st = state.borrow();
            [
                st.ep.next_timeout(Instant::now()),
                st.group_timeout(),
                st.cache_timeout(),
            ]
            .into_iter()
            .flatten()
            .min()
        };
        let cap = Duration::from_millis(
            if state.borrow().held_total > 0 || !matches!(drain, Drain::Serving) {
                10
            } else {
                100
            },
        );
        wake_rx.wait(Some(timeout.unwrap_or(cap).min(cap))).await;
        // Publishes on this core's durable shards wait for their commit: let the committer
        // (an inline page-cache write finishes in its turn) and then the commit watcher run
        // before flushing, so the QUIC ACK of the publish packets and the PublishAcks leave
        // together (one sendmsg and one wake-up of the client instead of two). Bounded: a
        // commit still in flight after two turns is not waited for.
        for _ in 0..2 {
            if !state.borrow().commit_pending() {
                break;
            }
            futures_lite::future::yield_now().await;
        }
    }
}

/// Refusals queued on one answer stream past this stop the reading of the stream that caused
/// them until they drain: refused frames are cheap to send, and a peer that does not read its
/// answers must not grow the broker's memory.
const REFUSALS_QUEUED_BYTES_MAX: usize = 1 << 20;

/// How long a close waits for its Error frame to leave before it is forced.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// A shard count in words for people: "shard 0" or "shards 0–3" (0..n in Rust reads wrong).
pub(crate) fn shard_range(shards: u32) -> String {
    match shards {
        0 => "no shards".into(),
        1 => "only shard 0".into(),
        n => format!("shards 0–{}", n - 1),
    }
}

/// The conformance suite's negative twin: in debug builds only, `FELIX_TEST_BREAK_RULE=
/// publish-on-control` serves a Publish on the control stream, breaking one row of the
/// conformance table so `broker/tests/conformance.rs` can show it catches the break.
#[cfg(debug_assertions)]
fn broken_for_tests(v: Verdict, kind: u8, stream: u64) -> Verdict {
    static BREAK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *BREAK.get_or_init(|| {
        std::env::var("FELIX_TEST_BREAK_RULE").is_ok_and(|r| r == "publish-on-control")
    });
    if on && kind == felix_quic::wire::kind::PUBLISH && stream == 0 {
        return Verdict::Serve;
    }
    v
}

#[cfg(not(debug_assertions))]
fn broken_for_tests(v: Verdict, _kind: u8, _stream: u64) -> Verdict {
    v
}

impl CoreState {
    /// Some publish on a durable shard this core owns waits for its commit.
    fn commit_pending(&self) -> bool {
        self.durable.values().any(|d| !d.pending.is_empty())
    }

    /// Nothing this core must still answer: no acked publish of its connections unanswered,
    /// nothing held or waiting for a commit on the shards it owns.
    fn drain_idle(&self) -> bool {
        self.sessions
            .values()
            .all(|s| s.unacked == 0 && s.cache_inflight == 0)
            && self.held_total == 0
            && self
                .durable
                .values()
                .all(|d| d.pending.is_empty() && d.deferred.is_empty())
            && self.inbox.is_empty()
            && self.mesh_overflow.iter().all(|q| q.is_empty())
            && self.groups_idle()
            && self.caches.values().all(|c| !c.has_pending())
            && self.cache_opening.is_empty()
            && self.cache_closing.is_empty()
    }

    /// `c` with this core's fsync latency histogram as its sync observer.
    fn observed(&self, mut c: LogConfig) -> LogConfig {
        let counters = self.s.counters.clone();
        c.on_sync = Some(Rc::new(move |us| counters.fsync.observe_us(us)));
        c
    }

    /// The going-away notice: end every subscription (`SubEnd`) and watch (`CacheWatchEnd`)
    /// of this core's connections with `shutting_down`, so clients learn it on each stream
    /// before the connection closes.
    fn notify_going_away(&mut self) {
        let why = "the broker is shutting down; subscribe again elsewhere or after it restarts";
        let sids: Vec<u64> = self.subs.keys().copied().collect();
        for sid in sids {
            self.remove_sub(sid, Some((ErrorCode::ShuttingDown.number(), why.into())));
        }
        let keys: Vec<ShardKey> = self.local_watches.keys().copied().collect();
        for key in keys {
            self.end_local_watches(key, (ErrorCode::ShuttingDown, why.into()));
        }
    }

    /// Refresh the queue gauges about once a second (a walk over this core's subscriptions
    /// and watches, off the per-message path).
    fn gauges_tick(&mut self, now: Instant) {
        if now.duration_since(self.gauges_at) < Duration::from_secs(1) {
            return;
        }
        self.gauges_at = now;
        let (mut recs, mut bytes, mut max) = (0u64, 0u64, 0u64);
        for sub in self.subs.values() {
            let r = sub.queue.queued_records();
            recs += r;
            bytes += sub.queue.queued_bytes();
            max = max.max(r);
        }
        let (ev, wb) = self.watch_queue_totals();
        let c = &self.s.counters;
        c.sub_queue_records.store(recs, Ordering::Relaxed);
        c.sub_queue_bytes.store(bytes, Ordering::Relaxed);
        c.sub_queue_max_records.store(max, Ordering::Relaxed);
        c.subscriptions_open
            .store(self.subs.len() as u64, Ordering::Relaxed);
        c.connections_open
            .store(self.ep.conn_count() as u64, Ordering::Relaxed);
        c.cache_watch_queue_events.store(ev, Ordering::Relaxed);
        c.cache_watch_queue_bytes.store(wb, Ordering::Relaxed);
        c.cache_watches_open
            .store(self.watches.len() as u64, Ordering::Relaxed);
        c.durable_inline_write_stalls
            .store(felix_storage::log::inline_write_stalls(), Ordering::Relaxed);
    }

    // ---------- catalog ----------

    /// Act on a newer catalog version if one was published: end this core's subscriptions
    /// on shards deleted, moved away or re-generationed (each told why, so the client can
    /// follow the redirect or re-subscribe), clean up deleted streams' owned state, and
    /// open the logs of durable shards newly placed here.
    fn refresh_catalog(&mut self) {
        if self.s.catalog.version() == self.catalog_version {
            return;
        }
        let (v, new) = self.s.catalog.load();
        let old = std::mem::replace(&mut self.catalog, new.clone());
        self.catalog_version = v;
        self.refresh_caches(&old);
        for (i, slot) in new.slots().iter().enumerate() {
            let idx = i as u32;
            let was = old.slots().get(i);
            if slot.deleted {
                if was.is_some_and(|w| !w.deleted) {
                    self.on_stream_deleted(idx);
                }
                continue;
            }
            for shard in 0..slot.def.shards {
                let place = &slot.places[shard as usize];
                // Where this core served the shard before (not fenced, placed here), a change
                // of place or generation, or a new fence, ends its subscriptions.
                let before = was
                    .filter(|_| !old.fenced)
                    .and_then(|w| w.places.get(shard as usize));
                if matches!(before, Some(Place::Mine { .. }))
                    && (new.fenced || before != Some(place))
                {
                    let why = new.serve_check(idx, shard).err().unwrap_or((
                        ErrorCode::NotLeader,
                        format!(
                            "shard {shard} of {} was placed again (new generation); subscribe again",
                            slot.def.name()
                        ),
                    ));
                    self.end_local_subs((idx, shard), why);
                }
            }
        }
        for key in self.durable_keys_to_open() {
            self.durable.insert(key, DurableShard::opening());
            let job = self.open_job(key);
            let me = self.me.clone();
            glommio::spawn_local(async move {
                let r = job.run().await;
                reenter(&me, |st| st.on_durable_opened(key, r));
            })
            .detach();
        }
    }

    /// Durable shards of active streams placed on this broker, owned by this core, whose
    /// log is not open or opening yet.
    fn durable_keys_to_open(&self) -> Vec<ShardKey> {
        let mut keys = Vec::new();
        if self.catalog.fenced {
            return keys;
        }
        for (i, slot) in self.catalog.slots().iter().enumerate() {
            if slot.deleted || !slot.def.durable {
                continue;
            }
            for shard in 0..slot.def.shards {
                let key = (i as u32, shard);
                if matches!(slot.places[shard as usize], Place::Mine { .. })
                    && self.owner_core(key.0, shard) == self.id
                    && !self.durable.contains_key(&key)
                {
                    keys.push(key);
                }
            }
        }
        keys
    }

    fn open_job(&self, key: ShardKey) -> OpenJob {
        let slot = self.catalog.slot(key.0).clone();
        OpenJob {
            root: self.s.cfg.durable_storage_dir.clone(),
            config: self.observed(log_config(&self.s.cfg, &slot.def)),
            slot,
            shard: key.1,
        }
    }

    fn on_durable_opened(&mut self, key: ShardKey, r: OpenResult) {
        let name = self.catalog.slot(key.0).def.name();
        let still_wanted = matches!(
            self.durable.get(&key),
            Some(DurableShard {
                log: None,
                failed: None,
                ..
            })
        );
        // Whatever waited for the open is handled again after this (as open or failed).
        if let Some(d) = self.durable.get_mut(&key) {
            let deferred = std::mem::take(&mut d.deferred);
            self.inbox.extend(deferred);
        }
        match r {
            Ok((log, report)) if still_wanted => {
                tracing::info!(stream = %name, shard = key.1, next_offset = report.next_offset,
                    oldest = report.oldest_offset, verdict = ?report.verdict, "durable shard open");
                self.owner(key.0, key.1).start_at(report.next_offset);
                self.load_groups(key, report.next_offset);
                let hist = self.s.shard_metrics.register(name.to_string(), key.1);
                let d = self.durable.get_mut(&key).expect("checked above");
                d.log = Some(log.clone());
                d.commit_hist = Some(hist);
                glommio::spawn_local(commit_watcher(self.me.clone(), key, log)).detach();
            }
            Ok((log, _)) => {
                // Deleted while opening: close it and remove what the open (re)created.
                remove_deleted_shard(
                    Some(log),
                    self.s.cfg.durable_storage_dir.clone(),
                    self.catalog.slot(key.0),
                    key.1,
                );
            }
            Err(e) if still_wanted => {
                tracing::error!(stream = %name, shard = key.1, error = %e, "durable shard cannot open; it will answer unavailable");
                CoreCounters::inc(&self.s.counters.durable_shards_failed);
                self.durable.get_mut(&key).expect("checked above").failed = Some(e);
            }
            Err(_) => {}
        }
    }

    fn end_local_subs(&mut self, key: ShardKey, (code, msg): (ErrorCode, String)) {
        let sids = self.local_subs.get(&key).cloned().unwrap_or_default();
        for sid in sids {
            self.remove_sub(sid, Some((code.number(), msg.clone())));
        }
    }

    /// A stream was deleted: end its subscriptions on this core with `stream_deleted`; where
    /// this core owns a shard, refuse what waits (held or pending commit) and, for a durable
    /// shard, close its log and remove its files.
    fn on_stream_deleted(&mut self, idx: u32) {
        let slot = self.catalog.slot(idx).clone();
        let name = slot.def.name();
        tracing::info!(stream = %name, incarnation = slot.incarnation, "stream deleted");
        let why = (
            ErrorCode::StreamDeleted,
            format!("stream {name} was deleted"),
        );
        for shard in 0..slot.def.shards {
            let key = (idx, shard);
            self.end_local_subs(key, why.clone());
            self.drop_groups(key, &why);
            let mut refused: Vec<PublishReq> = Vec::new();
            if let Some(o) = self.owned.get_mut(&key) {
                self.held_total -= o.held.len();
                refused.extend(o.held.drain(..));
            }
            if let Some(d) = self.durable.remove(&key) {
                self.s
                    .shard_metrics
                    .unregister(&slot.def.name().to_string(), shard);
                refused.extend(d.pending.into_iter().map(|(r, _, _)| r));
                // Deferred publishes and attaches meet the deleted slot when handled again.
                self.inbox.extend(d.deferred);
                remove_deleted_shard(d.log, self.s.cfg.durable_storage_dir.clone(), &slot, shard);
            }
            for req in refused {
                self.route(
                    req.origin.core,
                    MeshMsg::PublishResult {
                        origin: req.origin,
                        result: Err(why.clone()),
                    },
                );
            }
            self.drop_if_deleted_and_idle(key);
        }
    }

    /// Drop a deleted stream's shard state once no core is attached to it any more.
    fn drop_if_deleted_and_idle(&mut self, key: ShardKey) {
        if !self.catalog.slot(key.0).deleted {
            return;
        }
        if let Some(o) = self.owned.get(&key) {
            if o.interested_cores().next().is_none() && o.held.is_empty() {
                self.owned.remove(&key);
            }
        }
    }

    // ---------- mesh plumbing ----------

    fn route(&mut self, to: u8, msg: MeshMsg) {
        if to == self.id {
            self.inbox.push_back(msg);
            return;
        }
        let to = to as usize;
        if !self.mesh_overflow[to].is_empty() {
            self.mesh_overflow[to].push_back(msg);
            self.mesh_wake.wake();
            return;
        }
        match self.senders.try_send_to(to, msg) {
            Ok(()) => {}
            Err(glommio::GlommioError::WouldBlock(glommio::ResourceType::Channel(msg))) => {
                self.mesh_overflow[to].push_back(msg);
                self.mesh_wake.wake();
            }
            // Closed peer (shutdown): nothing can carry it any more.
            Err(_) => {}
        }
    }

    fn drain_inbox(&mut self) {
        while let Some(m) = self.inbox.pop_front() {
            self.on_mesh(m);
        }
    }

    fn owner_core(&self, stream: u32, shard: u32) -> u8 {
        let def = &self.catalog.slot(stream).def;
        core_for_shard(&def.name(), shard, self.s.cores as u32) as u8
    }

    fn owner(&mut self, stream: u32, shard: u32) -> &mut ShardOwner<PublishReq> {
        debug_assert_eq!(
            self.owner_core(stream, shard),
            self.id,
            "only the owner core holds shard state"
        );
        let cfg = &self.s.cfg;
        let cores = self.s.cores as usize;
        self.owned.entry((stream, shard)).or_insert_with(|| {
            ShardOwner::new(
                shard,
                cores,
                ReplayRing::new(cfg.ring_records_max as u64, cfg.ring_bytes_max),
            )
        })
    }

    /// Publishes, attaches, detaches and park notices for a durable shard whose log is still
    /// opening wait in arrival order (per sender) and are handled once it is open or failed;
    /// anything else is handed back.
    fn defer_while_opening(&mut self, msg: MeshMsg) -> Option<MeshMsg> {
        let key = match &msg {
            MeshMsg::Publish(req) => (req.stream, req.shard),
            MeshMsg::Group { stream, frame, .. } => match frame.target() {
                Some(t) => (*stream, t.shard),
                None => return Some(msg),
            },
            MeshMsg::Attach { stream, shard, .. }
            | MeshMsg::Detach { stream, shard, .. }
            | MeshMsg::Parked { stream, shard, .. } => (*stream, *shard),
            _ => return Some(msg),
        };
        match self.durable.get_mut(&key) {
            Some(d) if d.is_opening() => {
                d.deferred.push(msg);
                None
            }
            _ => Some(msg),
        }
    }

    fn on_mesh(&mut self, msg: MeshMsg) -> Option<(Vec<u8>, SocketAddr)> {
        // A peer may act on a newer catalog than ours (a slot we have not seen yet): catch up
        // first. The cell only moves forward, so after this we know every slot it knows.
        self.refresh_catalog();
        let msg = self.defer_while_opening(msg)?;
        let msg = self.cache_gate(msg)?;
        match msg {
            MeshMsg::Packet { mut buf, from } => {
                CoreCounters::inc(&self.s.counters.packets_forwarded_in);
                match self.ep.on_datagram(&mut buf, from, true) {
                    Route::Conn { key, new } => self.after_recv(key, new),
                    Route::Reply(r) => return Some((r, from)),
                    _ => {}
                }
            }
            MeshMsg::Publish(req) => self.on_publish_at_owner(req),
            MeshMsg::PublishResult { origin, result } => self.on_publish_result(origin, result),
            MeshMsg::Delivery {
                stream,
                shard,
                batch,
            } => self.on_delivery(stream, shard, batch),
            MeshMsg::Attach {
                core,
                sub,
                stream,
                shard,
                start,
            } => self.on_attach(core, sub, stream, shard, start),
            MeshMsg::AttachResult { sub, result } => self.on_attach_result(sub, result),
            MeshMsg::Fetch {
                core,
                sub,
                stream,
                shard,
                from,
            } => self.on_fetch(core, sub, stream, shard, from),
            MeshMsg::FetchResult { sub, result } => self.on_fetch_result(sub, result),
            MeshMsg::Detach {
                core,
                stream,
                shard,
            } => {
                // Only a deleted stream's shard state is ever dropped (slots are not reused),
                // so a Detach for state that is gone is a late one for a deleted stream.
                let o = self.owned.get_mut(&(stream, shard))?;
                o.detach(core as usize);
                self.drop_if_deleted_and_idle((stream, shard));
            }
            MeshMsg::Parked {
                core,
                stream,
                shard,
                parked,
            } => {
                let o = self.owned.get_mut(&(stream, shard))?;
                o.set_parked(core as usize, parked);
                if !parked {
                    self.drain_held(stream, shard);
                }
            }
            MeshMsg::DrainHeld { stream, shard } => self.drain_held(stream, shard),
            MeshMsg::Group {
                origin,
                stream,
                frame,
            } => self.on_group(origin, stream, frame),
            MeshMsg::GroupReply { origin, frame } => self.on_group_reply(origin, frame),
            MeshMsg::GroupConnClosed { core, conn } => self.on_group_conn_closed(core, conn),
            MeshMsg::CacheReq {
                origin,
                cache,
                shard,
                frame,
            } => self.on_cache_req(origin, cache, shard, frame),
            MeshMsg::CacheReply { origin, frame } => self.on_cache_reply(origin, frame),
            MeshMsg::WatchOpen(req) => self.on_watch_open(req),
            MeshMsg::WatchOpened { watch, result } => self.on_watch_opened(watch, result),
            MeshMsg::CacheChange { cache, shard, ev } => self.on_cache_change(cache, shard, ev),
            MeshMsg::WatchClose {
                watch,
                cache,
                shard,
            } => self.on_watch_close(watch, cache, shard),
            MeshMsg::WatchesEnded {
                cache,
                shard,
                code,
                message,
            } => self.end_local_watches((cache, shard), (code, message)),
        }
        None
    }

    fn on_datagram(&mut self, buf: &mut [u8], from: SocketAddr) -> Option<Vec<u8>> {
        self.refresh_catalog();
        match self.ep.on_datagram(buf, from, false) {
            Route::Conn { key, new } => self.after_recv(key, new),
            Route::Forward(core) => {
                CoreCounters::inc(&self.s.counters.packets_forwarded_out);
                self.route(
                    core,
                    MeshMsg::Packet {
                        buf: buf.to_vec(),
                        from,
                    },
                );
            }
            Route::Reply(r) => return Some(r),
            Route::Dropped => {}
        }
        None
    }

    // ---------- owner side ----------

    fn on_publish_at_owner(&mut self, req: PublishReq) {
        if let Err(e) = self.catalog.serve_check(req.stream, req.shard) {
            self.route(
                req.origin.core,
                MeshMsg::PublishResult {
                    origin: req.origin,
                    result: Err(e),
                },
            );
            return;
        }
        let o = self.owner(req.stream, req.shard);
        if o.holding() || !o.held.is_empty() {
            o.held.push_back(req);
            self.held_total += 1;
            CoreCounters::inc(&self.s.counters.publishes_held);
            return;
        }
        self.append(req);
    }

    fn append(&mut self, req: PublishReq) {
        let key = (req.stream, req.shard);
        let Some(d) = self.durable.get_mut(&key) else {
            self.publish_committed(req);
            return;
        };
        // Durable: queue into the log now; answer and deliver when the commit completes.
        let (code, msg) = match d.usable() {
            Err(e) => e,
            Ok(log) => {
                let recs: Vec<bytes::Bytes> = req.records.iter().collect();
                let ins: Vec<RecordIn> = recs.iter().map(|p| RecordIn::new(p)).collect();
                match log.append(&ins, felix_storage::log::now_ms()) {
                    Ok(range) => {
                        d.pending.push_back((req, range, Instant::now()));
                        return;
                    }
                    Err(LogError::Backpressure { pending_bytes }) => (
                        ErrorCode::Unavailable,
                        format!(
                            "shard storage has {pending_bytes} bytes waiting to be written; retry"
                        ),
                    ),
                    Err(LogError::TooLarge { bytes, max }) => (
                        ErrorCode::PayloadTooLarge,
                        format!("a batch of {bytes} bytes exceeds the storage commit limit {max}"),
                    ),
                    Err(e) => (ErrorCode::Unavailable, format!("shard storage: {e}")),
                }
            }
        };
        CoreCounters::inc(&self.s.counters.durable_publishes_refused);
        self.route(
            req.origin.core,
            MeshMsg::PublishResult {
                origin: req.origin,
                result: Err((code, msg)),
            },
        );
    }

    /// Commit progress of a durable shard: every pending publish wholly below `acked` is now
    /// on disk — append it to the in-memory tail (ring), deliver it, answer it.
    fn on_durable_acked(&mut self, key: ShardKey, acked: u64) {
        CoreCounters::inc(&self.s.counters.durable_commits);
        loop {
            let Some(d) = self.durable.get_mut(&key) else {
                return;
            };
            match d.pending.front() {
                Some((_, r, _)) if r.end <= acked => {}
                _ => return,
            }
            let (req, range, at) = d.pending.pop_front().unwrap();
            let us = at.elapsed().as_micros() as u64;
            self.s.counters.durable_commit.observe_us(us);
            if let Some(h) = &d.commit_hist {
                h.observe_us(us);
            }
            let next = self.owner(key.0, key.1).next_offset();
            assert_eq!(
                next, range.start,
                "the ring continues exactly where the log assigned"
            );
            CoreCounters::add(
                &self.s.counters.durable_records_committed,
                range.end - range.start,
            );
            self.publish_committed(req);
        }
    }

    /// The log failed: nothing pending will be acknowledged.
    fn on_durable_failed(&mut self, key: ShardKey, why: String) {
        let closing = self.closing_logs;
        let Some(d) = self.durable.get_mut(&key) else {
            return;
        };
        if closing && d.pending.is_empty() {
            // Closed for shutdown with nothing waiting: not a failure.
            return;
        }
        if d.failed.is_none() && !closing {
            CoreCounters::inc(&self.s.counters.durable_shards_failed);
            d.failed = Some(why.clone());
        }
        let pending: Vec<_> = d.pending.drain(..).collect();
        let (code, msg) = if closing {
            (
                ErrorCode::ShuttingDown,
                "the broker shut down before this publish was committed; it was not acknowledged"
                    .to_string(),
            )
        } else {
            (
                ErrorCode::Unavailable,
                format!("shard storage failed; the publish was not acknowledged: {why}"),
            )
        };
        for (req, _, _) in pending {
            CoreCounters::inc(&self.s.counters.durable_publishes_refused);
            self.route(
                req.origin.core,
                MeshMsg::PublishResult {
                    origin: req.origin,
                    result: Err((code, msg.clone())),
                },
            );
        }
    }

    fn publish_committed(&mut self, req: PublishReq) {
        let (stream, shard) = (req.stream, req.shard);
        let o = self.owner(stream, shard);
        let batch = o.append(&req.records);
        let cores: Vec<usize> = o.interested_cores().collect();
        let c = self.s.counters.clone();
        CoreCounters::inc(&c.batches_appended);
        CoreCounters::add(&c.records_appended, batch.count as u64);
        CoreCounters::add(&c.bytes_appended, req.records.payload_bytes() as u64);
        let result = Ok((shard, batch.first_offset, batch.count));
        for core in cores {
            if core as u8 != self.id {
                CoreCounters::inc(&c.mesh_deliveries_out);
            }
            self.route(
                core as u8,
                MeshMsg::Delivery {
                    stream,
                    shard,
                    batch: batch.clone(),
                },
            );
        }
        self.route(
            req.origin.core,
            MeshMsg::PublishResult {
                origin: req.origin,
                result,
            },
        );
        if self.groups.contains_key(&(stream, shard)) {
            self.groups_records_committed((stream, shard));
        }
    }

    /// Append held publishes while nothing is parked: one at a time, each followed by a
    /// self-message so this core's subscribers see the batch (and may park) first.
    fn drain_held(&mut self, stream: u32, shard: u32) {
        if !self.owned.contains_key(&(stream, shard)) && self.catalog.slot(stream).deleted {
            return; // a deleted stream's state is gone; do not create it again
        }
        let now = Instant::now();
        loop {
            let o = self.owner(stream, shard);
            if o.holding() {
                return;
            }
            let Some(req) = o.held.pop_front() else {
                return;
            };
            self.held_total -= 1;
            if req.deadline <= now {
                self.time_out(req);
                continue;
            }
            self.append(req);
            if !self.owner(stream, shard).held.is_empty() {
                self.route(self.id, MeshMsg::DrainHeld { stream, shard });
            }
            return;
        }
    }

    fn time_out(&mut self, req: PublishReq) {
        CoreCounters::inc(&self.s.counters.publish_timeouts);
        let msg = format!(
            "a Block subscriber stayed full for {} ms; the publish was not appended",
            self.s.cfg.publish_timeout_ms
        );
        self.route(
            req.origin.core,
            MeshMsg::PublishResult {
                origin: req.origin,
                result: Err((ErrorCode::PublishTimeout, msg)),
            },
        );
    }

    fn expire_held(&mut self, now: Instant) {
        if self.held_total == 0 {
            return;
        }
        let mut expired = Vec::new();
        for o in self.owned.values_mut() {
            if o.held.iter().any(|r| r.deadline <= now) {
                let (dead, keep): (VecDeque<_>, VecDeque<_>) =
                    o.held.drain(..).partition(|r| r.deadline <= now);
                o.held = keep;
                expired.extend(dead);
            }
        }
        self.held_total -= expired.len();
        for req in expired {
            self.time_out(req);
        }
    }

    fn on_attach(&mut self, core: u8, sub: u64, stream: u32, shard: u32, start: StartAt) {
        if self.catalog.slot(stream).deleted {
            // No state is (re)created for a deleted stream: the subscriber's later Detach
            // finds none and is ignored. If state is still there (other subscribers not yet
            // detached), count this attach so that Detach stays balanced.
            if let Some(o) = self.owned.get_mut(&(stream, shard)) {
                o.attach(core as usize);
            }
            let name = self.catalog.slot(stream).def.name();
            self.route(
                core,
                MeshMsg::AttachResult {
                    sub,
                    result: Err((
                        ErrorCode::StreamDeleted,
                        format!("stream {name} was deleted"),
                    )),
                },
            );
            return;
        }
        // Interest counts every attach, even a refused one, so the subscriber's core can
        // always answer its removal with one Detach.
        self.owner(stream, shard).attach(core as usize);
        if let Err(e) = self.catalog.serve_check(stream, shard) {
            self.route(
                core,
                MeshMsg::AttachResult {
                    sub,
                    result: Err(e),
                },
            );
            return;
        }
        if let Some(d) = self.durable.get(&(stream, shard)) {
            let result = match d.usable() {
                Err(e) => Err(e),
                Ok(log) => {
                    let oldest = log.oldest_offset();
                    let o = self.owned.get(&(stream, shard)).expect("attached above");
                    let next = o.next_offset();
                    let from = match start {
                        StartAt::Latest => Ok(next),
                        StartAt::Earliest => Ok(oldest),
                        StartAt::Offset(x) if x < oldest => Err((
                            ErrorCode::RevisionTooOld,
                            format!("offset {x} is below retention; the oldest retained offset is {oldest}"),
                        )),
                        StartAt::Offset(x) if x > next => Err((
                            ErrorCode::InvalidRequest,
                            format!("offset {x} is beyond the tail of the shard ({next})"),
                        )),
                        StartAt::Offset(x) => Ok(x),
                    };
                    from.map(|from| {
                        if from >= o.ring.oldest().unwrap_or(next) {
                            let (lag, replay) = o.ring.replay_from(shard, from);
                            debug_assert!(lag.is_none());
                            AttachOk {
                                lag,
                                replay,
                                from,
                                catch_up: false,
                            }
                        } else {
                            AttachOk {
                                lag: None,
                                replay: vec![],
                                from,
                                catch_up: true,
                            }
                        }
                    })
                }
            };
            self.route(core, MeshMsg::AttachResult { sub, result });
            return;
        }
        let o = self.owner(stream, shard);
        let next = o.next_offset();
        let oldest = o.ring.oldest().unwrap_or(next);
        let from = match start {
            StartAt::Latest => Ok(next),
            StartAt::Earliest => Ok(oldest),
            StartAt::Offset(x) if x <= next => Ok(x),
            StartAt::Offset(x) => Err((
                ErrorCode::InvalidRequest,
                format!("offset {x} is beyond the end of the shard ({next})"),
            )),
        };
        let result = from.map(|from| {
            let (lag, replay) = o.ring.replay_from(shard, from);
            AttachOk {
                lag,
                replay,
                from,
                catch_up: false,
            }
        });
        self.route(core, MeshMsg::AttachResult { sub, result });
    }

    /// Owner: the next history chunk for a catching-up subscriber. From the ring (and live)
    /// once `from` is inside it, else read from disk on a task (appends go on meanwhile).
    fn on_fetch(&mut self, core: u8, sub: u64, stream: u32, shard: u32, from: u64) {
        let key = (stream, shard);
        let log = match self.durable.get(&key).map(DurableShard::usable) {
            Some(Ok(log)) => log.clone(),
            Some(Err(e)) => {
                self.route(
                    core,
                    MeshMsg::FetchResult {
                        sub,
                        result: Err(e),
                    },
                );
                return;
            }
            None => {
                self.route(
                    core,
                    MeshMsg::FetchResult {
                        sub,
                        result: Err((ErrorCode::Unavailable, "not a durable shard".into())),
                    },
                );
                return;
            }
        };
        let o = self.owner(stream, shard);
        let next = o.next_offset();
        if from >= o.ring.oldest().unwrap_or(next) {
            let (_, batches) = o.ring.replay_from(shard, from);
            self.route(
                core,
                MeshMsg::FetchResult {
                    sub,
                    result: Ok(Fetched {
                        lag: None,
                        batches,
                        live: true,
                    }),
                },
            );
            return;
        }
        let weak = self.me.clone();
        let bytes_max = self.s.cfg.history_fetch_bytes;
        CoreCounters::inc(&self.s.counters.history_reads);
        glommio::spawn_local(async move {
            let r = log.read(from, 4096, bytes_max).await;
            let Some(st) = weak.upgrade() else { return };
            let mut st = st.borrow_mut();
            let result = match r {
                Ok(recs) if !recs.is_empty() => {
                    CoreCounters::add(&st.s.counters.history_records_read, recs.len() as u64);
                    let first = recs[0].offset;
                    let records =
                        felix_quic::wire::Records::encode(recs.iter().map(|r| &r.payload[..]));
                    Ok(Fetched {
                        lag: None,
                        batches: vec![Batch::new(shard, first, &records)],
                        live: false,
                    })
                }
                // Nothing to read below the ring is impossible (the ring holds only committed
                // records); answer with the ring so the subscriber can go live.
                Ok(_) => {
                    let o = st.owner(stream, shard);
                    let (_, batches) = o.ring.replay_from(shard, from);
                    Ok(Fetched {
                        lag: None,
                        batches,
                        live: true,
                    })
                }
                Err(LogError::BelowRetention { oldest, .. }) => Ok(Fetched {
                    lag: Some(Lag {
                        from_offset: from,
                        lost: oldest - from,
                    }),
                    batches: vec![],
                    live: false,
                }),
                Err(e) => Err((ErrorCode::Unavailable, format!("history read failed: {e}"))),
            };
            st.route(core, MeshMsg::FetchResult { sub, result });
            st.drain_inbox();
            st.wake.wake();
        })
        .detach();
    }

    // ---------- connection side ----------

    fn on_publish_result(&mut self, origin: Origin, result: PubResult) {
        let Some(session) = self.sessions.get_mut(&origin.conn) else {
            return;
        };
        session.inflight_bytes -= origin.bytes;
        let Some(e) = self.ep.get(origin.conn) else {
            return;
        };
        if origin.ack {
            session.unacked -= 1;
            let frame = match result {
                Ok((shard, first_offset, count)) => {
                    CoreCounters::inc(&self.s.counters.publish_acks);
                    Frame::PublishAck {
                        request_id: origin.request_id,
                        shard,
                        first_offset,
                        count,
                    }
                }
                Err((code, msg)) => Frame::error(origin.request_id, code, msg),
            };
            e.conn.send_frame(origin.quic_stream, &frame);
            if let Some(ps) = session.pub_streams.get_mut(&origin.quic_stream) {
                ps.pending -= 1;
                if ps.pending == 0 && ps.fin_requested {
                    session.pub_streams.remove(&origin.quic_stream);
                    e.conn.finish(origin.quic_stream);
                }
            }
        } else if let Err((code, msg)) = result {
            e.conn
                .send_frame(0, &Frame::error(origin.request_id, code, msg));
        }
        self.ep.mark_dirty(origin.conn);
    }

    fn on_delivery(&mut self, stream: u32, shard: u32, batch: Batch) {
        let Some(ids) = self.local_subs.get(&(stream, shard)) else {
            return;
        };
        for sid in ids.clone() {
            if self.subs.get(&sid).is_some_and(|s| s.catch_up.is_some()) {
                continue; // catching up from disk: this batch comes back through a fetch
            }
            self.offer_to_sub(sid, batch.clone());
            self.pump_sub(sid);
        }
    }

    fn offer_to_sub(&mut self, sid: u64, mut b: Batch) {
        let Some(sub) = self.subs.get_mut(&sid) else {
            return;
        };
        let Some(next) = sub.next_offset else { return }; // attach not answered yet
        if b.end() <= next {
            return; // already covered by the replay
        }
        if b.first_offset < next {
            b = b.tail(sub.shard, (next - b.first_offset) as u32);
        }
        sub.next_offset = Some(b.end());
        let key = (sub.stream, sub.shard);
        let c = &self.s.counters;
        let dropped_before = sub.queue.dropped_records;
        let offer = sub.queue.offer(b);
        // Losses are counted when they happen (the queue's own count of records it lost, not
        // the notice, which folds older losses in and may wait behind a stalled subscriber's
        // full stream for a long time).
        let lost = sub.queue.dropped_records - dropped_before;
        match offer {
            Offer::Queued | Offer::Parked { first: false } => {}
            Offer::Dropped => {
                CoreCounters::add(&c.records_dropped, lost);
                CoreCounters::add(&c.records_dropped_new, lost);
            }
            Offer::Evicted(_) => {
                CoreCounters::add(&c.records_dropped, lost);
                CoreCounters::add(&c.records_dropped_old, lost);
            }
            Offer::Parked { first: true } => {
                let n = self.parked_subs.entry(key).or_default();
                *n += 1;
                if *n == 1 {
                    let owner = self.owner_core(key.0, key.1);
                    self.route(
                        owner,
                        MeshMsg::Parked {
                            core: self.id,
                            stream: key.0,
                            shard: key.1,
                            parked: true,
                        },
                    );
                }
            }
        }
    }

    fn unparked(&mut self, key: ShardKey) {
        let n = self
            .parked_subs
            .get_mut(&key)
            .expect("parked count exists for a parked sub");
        *n -= 1;
        if *n == 0 {
            self.parked_subs.remove(&key);
            let owner = self.owner_core(key.0, key.1);
            self.route(
                owner,
                MeshMsg::Parked {
                    core: self.id,
                    stream: key.0,
                    shard: key.1,
                    parked: false,
                },
            );
        }
    }

    /// Move the subscriber's next queued items onto its stream while the stream has nothing
    /// waiting for quiche (flow control is the back-pressure that makes the queue fill).
    fn pump_sub(&mut self, sid: u64) {
        loop {
            let Some(sub) = self.subs.get_mut(&sid) else {
                return;
            };
            let Some(e) = self.ep.get(sub.conn) else {
                return;
            };
            if e.conn.queued_bytes(sub.quic_stream) > 0 {
                return;
            }
            let (item, unparked) = sub.queue.pop();
            let (conn, qs, key) = (sub.conn, sub.quic_stream, (sub.stream, sub.shard));
            let c = &self.s.counters;
            match item {
                Some(Item::Batch(b)) => {
                    CoreCounters::inc(&c.batches_delivered);
                    CoreCounters::add(&c.records_delivered, b.count as u64);
                    CoreCounters::add(&c.bytes_delivered, b.bytes());
                    // Each side sends at most the other's maximum (Hello.max_frame_bytes).
                    for piece in b.split_to_fit(key.1, e.conn.peer_max_frame_bytes()) {
                        e.conn.send_bytes(qs, piece.head);
                        e.conn.send_bytes(qs, piece.region);
                    }
                }
                Some(Item::Lag(l)) => {
                    CoreCounters::inc(&c.lag_notices);
                    e.conn.send_frame(
                        qs,
                        &Frame::Lag {
                            from_offset: l.from_offset,
                            lost: l.lost,
                        },
                    );
                }
                None => {}
            }
            self.ep.mark_dirty(conn);
            if unparked {
                self.unparked(key);
            }
            if item_is_none(&self.subs, sid) {
                self.maybe_fetch(sid);
                return;
            }
        }
    }

    /// Flush a connection's streams into quiche; refill subscription streams that drained.
    fn flush_conn(&mut self, key: ConnKey) {
        for _ in 0..64 {
            let Some(e) = self.ep.get(key) else { return };
            let drained = e.conn.flush_streams();
            self.release_held(key, &drained);
            let Some(session) = self.sessions.get(&key) else {
                return;
            };
            let refill: Vec<u64> = drained
                .iter()
                .filter_map(|s| session.sub_streams.get(s).copied())
                .collect();
            if refill.is_empty() {
                return;
            }
            let mut sent = false;
            for sid in refill {
                if self.is_watch(sid) {
                    sent |= !self.watch_idle(sid);
                    self.pump_watch(sid);
                    continue;
                }
                let before = self
                    .subs
                    .get(&sid)
                    .map(|s| s.queue.is_empty())
                    .unwrap_or(true);
                self.pump_sub(sid);
                sent |= !before;
            }
            if !sent {
                return;
            }
        }
        // More to move than one pass allows: come back on the next flush.
        self.ep.mark_dirty(key);
    }

    fn on_attach_result(&mut self, sid: u64, result: Result<AttachOk, (ErrorCode, String)>) {
        let Some(sub) = self.subs.get_mut(&sid) else {
            return;
        };
        let (conn, rid, reply, shard) = (sub.conn, sub.request_id, sub.reply_stream, sub.shard);
        match result {
            Err((code, msg)) => {
                if let Some(e) = self.ep.get(conn) {
                    e.conn.send_frame(reply, &Frame::error(rid, code, msg));
                }
                self.remove_sub(sid, Some((code.number(), "subscribe refused".into())));
            }
            Ok(AttachOk {
                lag,
                replay,
                from,
                catch_up,
            }) => {
                sub.next_offset = Some(from);
                if catch_up {
                    sub.catch_up = Some(false);
                }
                if let Some(l) = lag {
                    sub.queue.offer_lag(l);
                    sub.next_offset = Some(l.from_offset + l.lost);
                }
                let (records_max, bytes_max) = sub.queue.bounds();
                for b in replay {
                    self.offer_to_sub(sid, b);
                }
                let ok = Frame::SubscribeOk {
                    request_id: rid,
                    subscription_id: sid,
                    shard,
                    next_offset: from,
                    queue_records_max: records_max as u32,
                    queue_bytes_max: bytes_max,
                };
                if let Some(e) = self.ep.get(conn) {
                    e.conn.send_frame(reply, &ok);
                }
                self.ep.mark_dirty(conn);
                self.pump_sub(sid);
                self.maybe_fetch(sid);
            }
        }
    }

    /// A catching-up subscriber with an empty queue and no fetch in flight asks its shard's
    /// owner for the next chunk (so history never outruns the subscriber's queue bound).
    fn maybe_fetch(&mut self, sid: u64) {
        let Some(sub) = self.subs.get_mut(&sid) else {
            return;
        };
        if sub.catch_up != Some(false) || !sub.queue.is_empty() {
            return;
        }
        let Some(from) = sub.next_offset else { return };
        sub.catch_up = Some(true);
        let (stream, shard) = (sub.stream, sub.shard);
        let owner = self.owner_core(stream, shard);
        self.route(
            owner,
            MeshMsg::Fetch {
                core: self.id,
                sub: sid,
                stream,
                shard,
                from,
            },
        );
    }

    fn on_fetch_result(&mut self, sid: u64, result: Result<Fetched, (ErrorCode, String)>) {
        let Some(sub) = self.subs.get_mut(&sid) else {
            return;
        };
        match result {
            Err((code, msg)) => {
                self.remove_sub(sid, Some((code.number(), msg)));
            }
            Ok(Fetched { lag, batches, live }) => {
                sub.catch_up = if live { None } else { Some(false) };
                if let Some(l) = lag {
                    sub.queue.offer_lag(l);
                    sub.next_offset = Some(l.from_offset + l.lost);
                }
                for b in batches {
                    self.offer_to_sub(sid, b);
                }
                self.pump_sub(sid);
                self.maybe_fetch(sid);
            }
        }
    }

    /// Drop a subscription: detach from the owner, release a parked hold, optionally end
    /// its stream with `SubEnd`.
    fn remove_sub(&mut self, sid: u64, end: Option<(u16, String)>) {
        let Some(sub) = self.subs.remove(&sid) else {
            return;
        };
        let key = (sub.stream, sub.shard);
        CoreCounters::inc(&self.s.counters.subscriptions_closed);
        if let Some(v) = self.local_subs.get_mut(&key) {
            v.retain(|s| *s != sid);
            if v.is_empty() {
                self.local_subs.remove(&key);
            }
        }
        if let Some(session) = self.sessions.get_mut(&sub.conn) {
            session.subs.retain(|s| *s != sid);
            session.sub_streams.remove(&sub.quic_stream);
        }
        if sub.queue.is_parked() {
            self.unparked(key);
        }
        let owner = self.owner_core(key.0, key.1);
        self.route(
            owner,
            MeshMsg::Detach {
                core: self.id,
                stream: key.0,
                shard: key.1,
            },
        );
        if let (Some((code, message)), Some(e)) = (end, self.ep.get(sub.conn)) {
            e.conn.send_frame(
                sub.quic_stream,
                &Frame::SubEnd {
                    subscription_id: sid,
                    code,
                    message,
                },
            );
            e.conn.finish(sub.quic_stream);
            self.ep.mark_dirty(sub.conn);
        }
    }

    fn on_conn_closed(&mut self, key: ConnKey) {
        if let Some(session) = self.sessions.remove(&key) {
            for sid in session.subs {
                self.remove_sub(sid, None);
            }
            self.watches_conn_closed(session.watches);
            self.group_conn_closed(key, session.long_polls);
        }
    }

    fn after_recv(&mut self, key: ConnKey, new: bool) {
        if new {
            CoreCounters::inc(&self.s.counters.connections_accepted);
            self.sessions.insert(key, Session::default());
            let wait_ms = self.hello_wait_ms();
            let deadline = Instant::now() + Duration::from_millis(wait_ms);
            self.hello_waits.push_back((deadline, key));
        }
        let mut events = Vec::new();
        let Some(e) = self.ep.get(key) else { return };
        e.conn.poll_readable(&mut events);
        for ev in events {
            self.on_event(key, ev);
        }
        // Streams quiche could not take earlier may have room now (peer acked, window grew).
        self.ep.mark_dirty(key);
    }

    /// Take a Hello: record the client's frame maximum and answer HelloOk, or refuse a maximum
    /// that could not carry every record this broker accepts and close.
    fn on_hello(&mut self, key: ConnKey, stream: u64, f: u64, peer_max_frame_bytes: u32) {
        let cfg = self.s.cfg.clone();
        let floor = cfg.max_payload_bytes as usize + FRAME_OVERHEAD_BYTES;
        if (peer_max_frame_bytes as usize) < floor {
            let msg = format!(
                "Hello.max_frame_bytes {peer_max_frame_bytes} is below {floor}, the smallest frame that carries every record this broker accepts (max_payload_bytes {} + {FRAME_OVERHEAD_BYTES}); the connection is closed",
                cfg.max_payload_bytes
            );
            self.close_with(key, stream, ErrorCode::InvalidRequest, msg);
            return;
        }
        let Some(session) = self.sessions.get_mut(&key) else {
            return;
        };
        session.hello_done = true;
        let hello = Frame::HelloOk {
            features: f & features::ALL,
            limits: Limits {
                max_frame_bytes: cfg.max_frame_bytes as u32,
                max_payload_bytes: cfg.max_payload_bytes,
                max_subscriptions: cfg.max_subscriptions,
                max_key_bytes: cfg.cache_key_bytes_max,
            },
            core: self.id as u16,
            server: concat!("felix-broker/", env!("CARGO_PKG_VERSION")).into(),
        };
        if let Some(e) = self.ep.get(key) {
            // Each side sends at most the other's maximum.
            e.conn
                .set_peer_max_frame_bytes(peer_max_frame_bytes as usize);
            e.conn.send_frame(stream, &hello);
        }
    }

    /// Answer a frame that could not be taken off `stream`.
    fn on_bad_frame(&mut self, key: ConnKey, stream: u64, err: FrameError) {
        let code = err.error.code();
        let what = match err.kind {
            Some(k) => format!("{}: {}", streams::kind_name(k), err.error),
            None => err.error.to_string(),
        };
        if err.fatal && stream == 0 {
            // Nothing more can be read on the control stream and a client cannot open
            // another, so no request could be made on this connection again: end it.
            let msg = format!(
                "{what}; the control stream's framing is lost, so the connection is closed"
            );
            self.close_with(key, 0, code, msg);
            return;
        }
        let msg = if err.truncated_at_end {
            format!("{what}; the stream ended inside a frame")
        } else if err.fatal {
            format!("{what}; the stream's framing is lost and the stream was stopped")
        } else if code == ErrorCode::FrameTooLarge {
            format!("{what}; the frame is discarded and the stream goes on")
        } else {
            format!("{what}; the frame was skipped and the stream goes on")
        };
        self.send_err(
            key,
            answer_stream(stream),
            err.request_id.unwrap_or(0),
            code,
            msg,
        );
        if !err.fatal {
            self.hold_if_unread(key, stream, answer_stream(stream));
        }
    }

    /// How long a new connection has for its Hello: `hello_timeout_ms`, or the idle timeout
    /// when that is shorter (0 means no idle timeout to quiche, so it does not count).
    fn hello_wait_ms(&self) -> u64 {
        let cfg = &self.s.cfg;
        match cfg.idle_timeout_ms {
            0 => cfg.hello_timeout_ms,
            idle => cfg.hello_timeout_ms.min(idle),
        }
    }

    /// Send `Error code msg` on `stream`, then close the connection with the code's number as
    /// the QUIC application error and the same text as the reason. Once per connection: what
    /// it sends afterwards is ignored. The close waits for the Error frame to leave, at most
    /// `CLOSE_GRACE` (a peer that grants no flow control cannot hold the connection open).
    fn close_with(&mut self, key: ConnKey, stream: u64, code: ErrorCode, msg: String) {
        let Some(session) = self.sessions.get_mut(&key) else {
            return;
        };
        if std::mem::replace(&mut session.closing, true) {
            return;
        }
        CoreCounters::inc(&self.s.counters.connections_closed_hello);
        tracing::debug!(conn = key, code = code.name(), "{msg}");
        self.send_err(key, stream, 0, code, msg.clone());
        if let Some(e) = self.ep.get(key) {
            e.conn
                .close_after_flush(code.number() as u64, &format!("{}: {msg}", code.name()));
        }
        self.closes_due
            .push_back((Instant::now() + CLOSE_GRACE, key));
        self.ep.mark_dirty(key);
    }

    /// Force the closes whose Error frame could not leave within `CLOSE_GRACE`.
    fn force_due_closes(&mut self, now: Instant) {
        while let Some(&(at, key)) = self.closes_due.front() {
            if at > now {
                break;
            }
            self.closes_due.pop_front();
            if let Some(e) = self.ep.get(key) {
                e.conn.close_pending_now();
                self.ep.mark_dirty(key);
            }
        }
    }

    /// Close the connections that said no Hello within `hello_timeout_ms`.
    fn expire_hellos(&mut self, now: Instant) {
        self.force_due_closes(now);
        while let Some(&(at, key)) = self.hello_waits.front() {
            if at > now {
                break;
            }
            self.hello_waits.pop_front();
            if self.sessions.get(&key).is_some_and(|s| !s.hello_done) {
                let ms = self.hello_wait_ms();
                let msg = format!("no Hello within {ms} ms (hello_timeout_ms) of the connection's first packet; the connection is closed");
                self.close_with(key, 0, ErrorCode::InvalidRequest, msg);
            }
        }
    }

    /// After a refusal of a frame from `source` answered on `answer`: stop reading `source`
    /// while `answer` holds more than `REFUSALS_QUEUED_BYTES_MAX` (see `release_held`).
    fn hold_if_unread(&mut self, key: ConnKey, source: u64, answer: u64) {
        let Some(e) = self.ep.get(key) else { return };
        if e.conn.queued_bytes(answer) <= REFUSALS_QUEUED_BYTES_MAX {
            return;
        }
        e.conn.pause(source);
        if let Some(s) = self.sessions.get_mut(&key) {
            let held = s.held_sources.entry(answer).or_default();
            if !held.contains(&source) {
                held.push(source);
            }
        }
    }

    /// Resume the streams held for answer streams that just drained, and take what they hold.
    fn release_held(&mut self, key: ConnKey, drained: &[u64]) {
        let Some(session) = self.sessions.get_mut(&key) else {
            return;
        };
        if session.held_sources.is_empty() {
            return;
        }
        let release: Vec<u64> = drained
            .iter()
            .filter_map(|d| session.held_sources.remove(d))
            .flatten()
            .collect();
        let mut events = Vec::new();
        if let Some(e) = self.ep.get(key) {
            for s in release {
                e.conn.resume(s);
                e.conn.read_stream(s, &mut events);
            }
        }
        for ev in events {
            self.on_event(key, ev);
        }
    }

    fn send_err(&mut self, key: ConnKey, stream: u64, rid: u64, code: ErrorCode, msg: String) {
        CoreCounters::inc(&self.s.counters.errors_sent);
        if let Some(e) = self.ep.get(key) {
            e.conn.send_frame(stream, &Frame::error(rid, code, msg));
        }
    }

    fn on_event(&mut self, key: ConnKey, ev: ConnEvent) {
        let counters = self.s.counters.clone();
        match ev {
            ConnEvent::Frame { stream, frame } => {
                CoreCounters::inc(&counters.frames_received);
                let Some(session) = self.sessions.get(&key) else {
                    return;
                };
                if session.closing {
                    return; // answered and closing: nothing more is taken
                }
                // Which stream carries what (docs/protocol.md, conformance table).
                let ack = matches!(frame, Frame::Publish { ack: true, .. });
                let verdict = admit(frame.kind(), stream, ack, session.hello_done);
                match broken_for_tests(verdict, frame.kind(), stream) {
                    Verdict::Serve => {}
                    Verdict::Skip => return,
                    Verdict::Refuse {
                        answer_on,
                        code,
                        message,
                    } => {
                        CoreCounters::inc(&counters.frames_refused);
                        // A refused request is named by its id; a broker-only frame is no
                        // request of the client's, so its refusal carries 0.
                        let rid = match streams::kind_info(frame.kind()) {
                            Some((_, streams::Placement::BrokerOnly)) => 0,
                            _ => frame.request_id().unwrap_or(0),
                        };
                        self.send_err(key, answer_on, rid, code, message);
                        self.hold_if_unread(key, stream, answer_on);
                        return;
                    }
                }
                match frame {
                    Frame::Hello {
                        features: f,
                        max_frame_bytes,
                        ..
                    } => self.on_hello(key, stream, f, max_frame_bytes),
                    Frame::DescribeStream {
                        request_id,
                        stream: name,
                    } => {
                        let reply = match self.catalog.lookup(&name) {
                            Ok((_, def)) => Frame::StreamInfo {
                                request_id,
                                shards: def.shards,
                                durable: def.durable,
                            },
                            Err((code, msg)) => Frame::error(request_id, code, msg),
                        };
                        if let Some(e) = self.ep.get(key) {
                            e.conn.send_frame(stream, &reply);
                        }
                    }
                    Frame::Publish {
                        request_id,
                        stream: name,
                        shard,
                        ack,
                        records,
                    } => {
                        if let Err((code, msg)) =
                            self.on_publish(key, stream, request_id, &name, shard, ack, records)
                        {
                            CoreCounters::inc(&counters.publishes_refused);
                            self.send_err(key, answer_stream(stream), request_id, code, msg);
                        }
                    }
                    Frame::Subscribe {
                        request_id,
                        stream: name,
                        shard,
                        start,
                        policy,
                        queue_records_max,
                        queue_bytes_max,
                    } => {
                        if let Err((code, msg)) = self.on_subscribe(
                            key,
                            stream,
                            request_id,
                            &name,
                            shard,
                            start,
                            policy,
                            queue_records_max,
                            queue_bytes_max,
                        ) {
                            self.send_err(key, stream, request_id, code, msg);
                        }
                    }
                    Frame::Unsubscribe {
                        request_id,
                        subscription_id,
                    } => {
                        let owned = self
                            .subs
                            .get(&subscription_id)
                            .map(|s| s.conn == key)
                            .unwrap_or(false);
                        if owned {
                            self.remove_sub(subscription_id, Some((0, "unsubscribed".into())));
                        } else if !self.unwatch(key, subscription_id) {
                            self.send_err(
                                key,
                                stream,
                                request_id,
                                ErrorCode::NotFound,
                                format!("no subscription {subscription_id} on this connection"),
                            );
                        }
                    }
                    Frame::Group(g) => {
                        let rid = g.request_id();
                        if let Err((code, msg)) = self.on_group_request(key, stream, g) {
                            self.send_err(key, stream, rid, code, msg);
                        }
                    }
                    Frame::Cache(c) => {
                        let rid = c.request_id();
                        if let Err((code, msg)) = self.on_cache_request(key, stream, c) {
                            CoreCounters::inc(&counters.cache_refused);
                            self.send_err(key, stream, rid, code, msg);
                        }
                    }
                    other => {
                        // `admit` serves only the kinds above; anything else is a table defect.
                        tracing::error!(kind = other.kind(), "admitted frame has no handler");
                        self.send_err(
                            key,
                            answer_stream(stream),
                            other.request_id().unwrap_or(0),
                            ErrorCode::Internal,
                            format!("{} has no handler", streams::kind_name(other.kind())),
                        );
                    }
                }
            }
            ConnEvent::BadFrame { stream, error } => {
                CoreCounters::inc(&counters.bad_frames);
                if self.sessions.get(&key).is_some_and(|s| !s.closing) {
                    self.on_bad_frame(key, stream, error);
                }
            }
            ConnEvent::Finished { stream } => {
                if stream % 4 == 0 && stream != 0 {
                    // Finish our side of a publisher stream once its last answer is queued.
                    let Some(session) = self.sessions.get_mut(&key) else {
                        return;
                    };
                    let pending = session
                        .pub_streams
                        .get(&stream)
                        .map(|p| p.pending)
                        .unwrap_or(0);
                    if pending == 0 {
                        session.pub_streams.remove(&stream);
                        if let Some(e) = self.ep.get(key) {
                            e.conn.finish(stream);
                        }
                    } else {
                        session.pub_streams.entry(stream).or_default().fin_requested = true;
                    }
                }
            }
            ConnEvent::Reset { .. } => {}
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn on_publish(
        &mut self,
        key: ConnKey,
        quic_stream: u64,
        request_id: u64,
        name: &felix_quic::wire::StreamName,
        sel: ShardSelector,
        ack: bool,
        records: Records,
    ) -> Result<(), (ErrorCode, String)> {
        if self.draining {
            return Err((
                ErrorCode::ShuttingDown,
                "the broker is shutting down; nothing was appended".into(),
            ));
        }
        let cfg = self.s.cfg.clone();
        let catalog = self.catalog.clone();
        let (idx, def) = catalog.lookup(name)?;
        let shards = def.shards;
        let idx = idx as u32;
        if records.count() == 0 {
            return Err((
                ErrorCode::InvalidRequest,
                "a publish carries at least one record".into(),
            ));
        }
        let max_payload = records.max_payload();
        if max_payload > cfg.max_payload_bytes as usize {
            return Err((
                ErrorCode::PayloadTooLarge,
                format!(
                    "a record of {max_payload} bytes exceeds max_payload_bytes {}",
                    cfg.max_payload_bytes
                ),
            ));
        }
        let shard = match sel {
            ShardSelector::Shard(s) if s < shards => s,
            ShardSelector::Shard(s) => {
                return Err((
                    ErrorCode::UnknownShard,
                    format!("stream {name} has {}, not {s}", shard_range(shards)),
                ))
            }
            ShardSelector::Key(k) => felix_quic::wire::hash::shard_for_key(&k, shards),
            ShardSelector::RoundRobin => {
                let n = self.rr.entry(idx).or_insert(0);
                *n = n.wrapping_add(1);
                *n % shards
            }
        };
        catalog.serve_check(idx, shard)?;
        let bytes = records.region_len() as u64;
        let session = self
            .sessions
            .get_mut(&key)
            .expect("frames come from live sessions");
        // Refuse before queueing anything, so a retry cannot write twice.
        if session.inflight_bytes + bytes > cfg.conn_inflight_bytes_max
            && session.inflight_bytes > 0
        {
            return Err((
                ErrorCode::InflightLimit,
                format!(
                    "connection has {} bytes in flight (cap {})",
                    session.inflight_bytes, cfg.conn_inflight_bytes_max
                ),
            ));
        }
        if ack && session.unacked >= cfg.conn_unacked_max {
            return Err((
                ErrorCode::InflightLimit,
                format!(
                    "connection has {} unanswered acked publishes (cap {})",
                    session.unacked, cfg.conn_unacked_max
                ),
            ));
        }
        session.inflight_bytes += bytes;
        if ack {
            session.unacked += 1;
            session.pub_streams.entry(quic_stream).or_default().pending += 1;
        }
        let origin = Origin {
            core: self.id,
            conn: key,
            quic_stream,
            request_id,
            ack,
            bytes,
        };
        CoreCounters::inc(&self.s.counters.publishes_received);
        let owner = self.owner_core(idx, shard);
        if owner != self.id {
            CoreCounters::inc(&self.s.counters.publishes_forwarded);
        }
        let deadline = Instant::now() + Duration::from_millis(cfg.publish_timeout_ms);
        self.route(
            owner,
            MeshMsg::Publish(PublishReq {
                origin,
                stream: idx,
                shard,
                records,
                deadline,
            }),
        );
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn on_subscribe(
        &mut self,
        key: ConnKey,
        reply_stream: u64,
        request_id: u64,
        name: &felix_quic::wire::StreamName,
        shard: u32,
        start: StartAt,
        policy: QueuePolicy,
        queue_records_max: u32,
        queue_bytes_max: u64,
    ) -> Result<(), (ErrorCode, String)> {
        let cfg = self.s.cfg.clone();
        let catalog = self.catalog.clone();
        let (idx, def) = catalog.lookup(name)?;
        if shard >= def.shards {
            return Err((
                ErrorCode::UnknownShard,
                format!("stream {name} has {}, not {shard}", shard_range(def.shards)),
            ));
        }
        let idx = idx as u32;
        catalog.serve_check(idx, shard)?;
        let session = self
            .sessions
            .get_mut(&key)
            .expect("frames come from live sessions");
        session.room_for_one_more(cfg.max_subscriptions)?;
        let records_max = queue_bound(queue_records_max as u64, cfg.sub_queue_records_max as u64);
        let bytes_max = queue_bound(queue_bytes_max, cfg.sub_queue_bytes_max);
        let e = self.ep.get(key).expect("session has a connection");
        if !e.conn.can_open_uni() {
            return Err((
                ErrorCode::TooManySubscriptions,
                "the client's unidirectional stream limit is exhausted".into(),
            ));
        }
        let qs = e.conn.open_uni();
        let sid = ((self.id as u64) << 48) | self.next_sub;
        self.next_sub += 1; // subscription and watch ids share this space
        e.conn.send_frame(
            qs,
            &Frame::SubStream {
                subscription_id: sid,
            },
        );
        session.subs.push(sid);
        session.sub_streams.insert(qs, sid);
        self.subs.insert(
            sid,
            Sub {
                conn: key,
                quic_stream: qs,
                stream: idx,
                shard,
                queue: SubQueue::new(policy, records_max, bytes_max),
                next_offset: None,
                request_id,
                reply_stream,
                catch_up: None,
            },
        );
        self.local_subs.entry((idx, shard)).or_default().push(sid);
        CoreCounters::inc(&self.s.counters.subscriptions_opened);
        let owner = self.owner_core(idx, shard);
        self.route(
            owner,
            MeshMsg::Attach {
                core: self.id,
                sub: sid,
                stream: idx,
                shard,
                start,
            },
        );
        Ok(())
    }
}

fn item_is_none(subs: &IdMap<u64, Sub>, sid: u64) -> bool {
    subs.get(&sid).map(|s| s.queue.is_empty()).unwrap_or(true)
}

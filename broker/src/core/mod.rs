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
//! Where things are: this file holds the core's state, `run_core` and the flusher (the tasks
//! and the clock); `mesh` the messages between cores and their routing; `conn` the connection
//! side (admission of every frame, refusals, closes, starting publishes and subscriptions) and
//! `conn::subs` subscription delivery; `owner` the owner side of stream shards (append, hold,
//! attach, fetch); `durable` durable shards (directories, opening, commits, failures);
//! `caches`, `cache_logs` and `groups` the caches and consumer groups.
//!
//! Mesh rule: a handler never awaits a full cross-core channel. `route` try-sends and
//! otherwise appends to an accounted per-peer overflow queue drained by the pump task, and
//! messages to self go through a local inbox, so two cores can never wedge each other.

use crate::catalog::{core_for_shard, Catalog, CatalogCell, Place, Slot};
use crate::config::Config;
use crate::fanout::{Batch, Lag, SubQueue};
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
mod conn;
mod durable;
mod groups;
mod mesh;
mod owner;
pub(crate) mod shard;
#[cfg(test)]
mod sim;
mod timers;
pub use caches::{CacheOrigin, Ev, Opened, WatchReq};
pub(crate) use conn::shard_range;
use durable::{commit_bytes_max, open_durable_shards, remove_deleted_shard, slot_shard_dir};
pub use durable::{log_config, shard_dir, stream_dir};
pub use groups::GroupOrigin;
pub use mesh::{AttachOk, Fetched, MeshMsg};
use shard::stream::{HostCfg, StreamHost};
use shard::StreamChange;

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

pub(crate) type ShardKey = (u32, u32);

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
    /// The stream shards this core owns (see `shard::stream`).
    streams: StreamHost<Log>,
    /// Subscriptions whose connections this core holds (see `conn::subs`).
    subs: conn::subs::SubHost,
    rr: HashMap<u32, u32>,
    next_sub: u64,
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
    let streams = StreamHost::new(HostCfg {
        cores: n,
        ring_records_max: settings.cfg.ring_records_max as u64,
        ring_bytes_max: settings.cfg.ring_bytes_max,
        publish_timeout_ms: settings.cfg.publish_timeout_ms,
    });
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
        streams,
        subs: Default::default(),
        rr: HashMap::new(),
        next_sub: 1,
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
                mesh_wake_rx.wait(Some(timers::MESH_POLL)).await;
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

/// Re-enter the core after a task awaited: run `f` on the state (unless the core is gone),
/// then handle what it queued for this core and wake the flusher to send it.
fn reenter(me: &Weak<RefCell<CoreState>>, f: impl FnOnce(&mut CoreState)) {
    let Some(st) = me.upgrade() else { return };
    let mut st = st.borrow_mut();
    f(&mut st);
    st.drain_inbox();
    st.wake.wake();
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
                    let mut logs: Vec<Log> = st.streams.begin_close();
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
            if flushed || since.elapsed() > timers::NOTIFY_FLUSH {
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
                st.with_streams(|h, ctx| h.tick(ctx));
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
            let now = Instant::now();
            [
                st.ep.next_timeout(now),
                st.group_timeout(),
                st.cache_timeout(),
                // The first held publish to time out.
                st.streams
                    .next_deadline()
                    .map(|d| d.saturating_duration_since(now)),
            ]
            .into_iter()
            .flatten()
            .min()
        };
        let cap = if state.borrow().streams.held_total() > 0 || !matches!(drain, Drain::Serving) {
            timers::FLUSH_WAIT_BUSY
        } else {
            timers::FLUSH_WAIT_IDLE
        };
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

impl CoreState {
    /// Some publish on a durable shard this core owns waits for its commit.
    fn commit_pending(&self) -> bool {
        self.streams.commit_pending()
    }

    /// Nothing this core must still answer: no acked publish of its connections unanswered,
    /// nothing held or waiting for a commit on the shards it owns.
    fn drain_idle(&self) -> bool {
        self.sessions
            .values()
            .all(|s| s.unacked == 0 && s.cache_inflight == 0)
            && self.streams.idle()
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
        for sid in self.subs.ids() {
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
        if now.duration_since(self.gauges_at) < timers::GAUGES_PERIOD {
            return;
        }
        self.gauges_at = now;
        let (mut recs, mut bytes, mut max) = (0u64, 0u64, 0u64);
        for sub in self.subs.iter() {
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
        for change in shard::stream_changes(&old, &new) {
            match change {
                StreamChange::Deleted(idx) => self.on_stream_deleted(idx),
                StreamChange::Ended(key, why) => self.end_local_subs(key, why),
            }
        }
        for key in self.durable_keys_to_open() {
            self.streams.begin_open(key);
            let job = self.open_job(key);
            let me = self.me.clone();
            glommio::spawn_local(async move {
                let r = job.run().await;
                reenter(&me, |st| st.on_durable_opened(key, r));
            })
            .detach();
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
            let gone = self.with_streams(|h, ctx| h.on_deleted(key, &why, ctx));
            if let Some(log) = gone {
                self.s
                    .shard_metrics
                    .unregister(&slot.def.name().to_string(), shard);
                remove_deleted_shard(log, self.s.cfg.durable_storage_dir.clone(), &slot, shard);
            }
        }
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
}

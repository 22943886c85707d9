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
//! Where things are: this file holds the core's state, catalog refresh and stream deletes;
//! `driver` the tasks (`run_core`, the receive loop, the mesh receivers and pump, the flusher
//! and the shutdown phases: the only clock reads of the core's own loop); `timers` the timer
//! table; `mesh` the messages between cores and their routing; `shard` the pure shard hosts
//! (`shard::stream`, driven by `owner`); `conn` the connection side (admission of every
//! frame, refusals, closes, starting publishes and subscriptions), with `conn::subs` the pure
//! subscription host, driven by `conn::deliver`; `durable` durable shards' directories,
//! opening and commit watcher; `caches`, `cache_logs` and `groups` the caches and consumer
//! groups (not hosts yet); `sim` the deterministic simulator (tests).
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
use felix_quic::server::{ConnKey, Endpoint, PeerSide, Route, Sock, TxBatch, SOCKS};
use felix_quic::wire::{
    admit, admit_peer, answer_stream, features, streams, AuthFrame, ErrorCode, Frame, Limits,
    PeerFrame, QueuePolicy, Records, ShardSelector, StartAt, Verdict,
};
use felix_quic::wire::{FrameError, FRAME_OVERHEAD_BYTES};
use felix_storage::{FsyncMode, Log, LogConfig, LogError};
use glommio::channels::channel_mesh::{Receivers, Senders};
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod admit;
mod authz;
mod cache_logs;
mod caches;
mod conn;
mod driver;
mod durable;
pub(crate) use durable::atomic_write;
mod groups;
mod mesh;
mod owner;
mod peer;
#[cfg(test)]
mod peer_check;
mod replica;
#[cfg(test)]
pub(crate) use replica::ReplicaCfg;
mod replica_driver;
mod replica_host;
mod replica_store;
pub(crate) mod shard;
pub use shard::Refusal;
#[cfg(test)]
mod sim;
mod timers;
pub use caches::{CacheOrigin, Ev, Opened, WatchReq};
pub(crate) use conn::shard_range;
use driver::reenter;
pub use driver::{run_core, PeerSockets};
use durable::{commit_bytes_max, open_durable_shards, remove_deleted_shard, slot_shard_dir};
pub use durable::{log_config, shard_dir, stream_dir};
pub use groups::GroupOrigin;
pub use mesh::{AttachOk, Fetched, MeshMsg, ToConn, ToOwner};
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

type PubResult = Result<(u32, u64, u32), Refusal>;

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
    /// Set when a durable log failed to close (flush and fsync) at drain: the stop is then
    /// not clean, and the storage identity is not marked so (rule 9).
    pub log_close_failed: Arc<AtomicBool>,
    /// Per core: nothing left to answer while draining (see the flusher).
    pub drain_idle: Arc<Vec<AtomicBool>>,
    /// Counts cores that have opened their durable logs and serve (readiness waits for all).
    pub started: Arc<std::sync::atomic::AtomicUsize>,
    /// Verifies tokens; `None`: auth is off (`--auth off`).
    pub auth: Option<Arc<crate::auth::AuthKeys>>,
    /// Replica reports to and answers from the control plane (`None` standalone).
    pub reports: Option<Arc<crate::replica_reports::ReportBox>>,
}

#[derive(Default)]
struct PubStream {
    pending: u32,
    fin_requested: bool,
    /// Ended by the broker (its principal was revoked or its token expired): the broker
    /// stopped reading it and told the client why.
    ended: bool,
}

#[derive(Default)]
struct Session {
    hello_done: bool,
    /// Features both sides announced (`HelloOk.features`).
    features: u64,
    /// Being closed by the broker (`close_with`): frames still arriving are ignored.
    closing: bool,
    /// Answer stream → the streams not read until it drains (refusals piled up unread).
    held_sources: HashMap<u64, Vec<u64>>,
    inflight_bytes: u64,
    unacked: u32,
    subs: Vec<u64>,
    /// Subscription stream id → subscription id.
    sub_streams: IdMap<u64, u64>,
    /// The subscription mux stream (`SUB_MUX`), opened with the first mux subscription and
    /// kept while the connection lives.
    sub_mux_stream: Option<u64>,
    /// Every publisher and one-way stream a publish was admitted on, until the client
    /// finishes or resets it (a revocation ends them all).
    pub_streams: HashMap<u64, PubStream>,
    /// Sent a long poll (its close must reach the groups' owners).
    long_polls: bool,
    /// Cache watches (their streams are in `sub_streams` too).
    watches: Vec<u64>,
    /// Cache requests routed to an owner and not answered yet.
    cache_inflight: u32,
    /// Came in on the peer listener: another broker, which speaks the peer link's frames.
    peer_link: bool,
    /// The node id its `PeerHello` named (checked against its certificate).
    peer_node: Option<u64>,
    /// While a forwarded request is handled: what the forwarder routed it by.
    forwarded: Option<felix_quic::wire::ForwardHead>,
    /// Who the connection's token says it is (auth on), and the token itself (carried in
    /// the forwards made for it, so the owner checks the same principal).
    principal: Option<(felix_control::auth::Principal, Arc<str>)>,
    /// Why the principal was taken away (its token was revoked): what its requests are
    /// refused with until it authenticates with a token that verifies.
    revoked: Option<String>,
}

impl Session {
    /// Subscriptions and watches share `max_subscriptions`: refuse one more past it.
    fn room_for_one_more(&self, max: u32) -> Result<(), Refusal> {
        let held = self.subs.len() + self.watches.len();
        if held >= max as usize {
            return Err(Refusal::new(
                ErrorCode::TooManySubscriptions,
                format!("connection holds {held} subscriptions and watches (max_subscriptions)"),
            ));
        }
        Ok(())
    }
}

/// Counts the tasks that owe the core an answer. A task holds a pass, and the pass counts it
/// out when dropped, however the task ends (answered, or dropped with the core), so the count
/// cannot drift from what it counts (it was a hand-kept `+= 1` / `-= 1` before).
#[derive(Default)]
pub(in crate::core) struct TaskGate(Rc<std::cell::Cell<usize>>);

pub(in crate::core) struct TaskPass(Rc<std::cell::Cell<usize>>);

impl TaskGate {
    pub(in crate::core) fn enter(&self) -> TaskPass {
        self.0.set(self.0.get() + 1);
        TaskPass(self.0.clone())
    }

    pub(in crate::core) fn idle(&self) -> bool {
        self.0.get() == 0
    }
}

impl Drop for TaskPass {
    fn drop(&mut self) {
        self.0.set(self.0.get() - 1);
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
    groups: shard::groups::GroupHost<Log>,
    /// Group tasks running (disk reads for polls, file removals) that owe an answer.
    group_tasks: TaskGate,
    /// Cache shards this core owns.
    caches: shard::caches::CacheHost,
    /// Cache watches whose connections this core holds (see `conn::watches`).
    watches: conn::watches::WatchHost,
    /// When the queue gauges were last refreshed.
    gauges_at: Instant,
    /// Connections that have not said Hello yet, with their deadline (FIFO: one timeout).
    hello_waits: VecDeque<(Instant, ConnKey)>,
    /// When connections' token expiries were last checked (`conn::auth::expire_principals`).
    auth_checked_at: Instant,
    /// Principals of the tokens forwards carried, verified once (bounded; see `conn::auth`).
    forward_principals: HashMap<Arc<str>, felix_control::auth::Principal>,
    /// The revocation revision the sessions were last checked against.
    revocations_seen: u64,
    /// Connections closing after their Error frame, with the moment the close is forced even
    /// if the frame could not leave (FIFO: one grace period).
    closes_due: VecDeque<(Instant, ConnKey)>,
    /// This core's links to other brokers and the forwards on them (`None` without a peer
    /// listener: requests for shards owned elsewhere are answered `not_leader`).
    links: Option<peer::Links>,
    /// The shards this core hosts as a replica.
    replicas: replica_host::ReplicaHost,
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
            && self.caches.idle()
            && self.links.as_ref().is_none_or(|l| l.in_flight() == 0)
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
        for key in self.watches.shards() {
            self.end_local_watches(key, Refusal::new(ErrorCode::ShuttingDown, why));
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
        let (ev, wb) = self.watches.queue_totals();
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
        for change in shard::cache_changes(&old, &new) {
            self.on_cache_catalog_change(change);
        }
        for change in shard::stream_changes(&old, &new) {
            match change {
                StreamChange::Deleted(idx) => self.on_stream_deleted(idx),
                StreamChange::Ended(key, why) => self.end_local_subs(key, why),
            }
        }
        self.refresh_replicas();
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
        let why = Refusal::new(
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

    fn on_datagram(&mut self, buf: &mut [u8], from: SocketAddr, sock: Sock) -> Option<Vec<u8>> {
        self.refresh_catalog();
        match self.ep.on_datagram(buf, from, sock, false) {
            Route::Conn { key, new } => self.after_recv(key, new),
            Route::Forward(core) => {
                CoreCounters::inc(&self.s.counters.packets_forwarded_out);
                self.route(
                    core,
                    MeshMsg::Packet {
                        buf: buf.to_vec(),
                        from,
                        sock,
                    },
                );
            }
            Route::Reply(r) => return Some(r),
            Route::Dropped => {}
        }
        None
    }
}

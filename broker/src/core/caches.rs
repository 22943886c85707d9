//! The cache driver of a core, around the pure state in [`crate::cache`]: in-memory caches
//! (log-backed ones are not built yet and are refused with `unsupported`).
//!
//! - A request is validated by the connection's core, which hashes the key (or counter
//!   name) to a shard and routes it to the shard's owner core; the owner applies it and
//!   answers through the mesh ([`MeshMsg::CacheReply`]).
//! - Every applied change gets the next offset of the shard. An in-memory shard starts its
//!   offsets at `wall-clock ms << 20` when it is created, so versions never repeat across
//!   restarts (a process would need a million writes per millisecond to catch up with the
//!   next one's start; a wall clock stepped back by more than the process lived breaks this).
//! - The owner keeps the last changes in a bounded replay ring (entries and bytes), which is
//!   what a watch resuming by offset replays; below the ring (or from an earlier process)
//!   the resume is answered with a marked snapshot of current values.
//! - Watches: the owner registers the watch and computes its start (current values, or the
//!   replay) in the same step, then sends each later matching change to the watching core;
//!   the mesh keeps per-pair order, so the start and the changes meet with no gap and no
//!   duplicate. The watching core queues events under the watch's bound
//!   ([`crate::cache::WatchQueue`]) and moves them onto the watch's stream as flow control
//!   allows; an overflow ends the watch with `watch_lagged` naming the offset to resume from
//!   (after everything queued before it was delivered).
//! - Expired keys are reclaimed by the owner's timer (Expire changes, seen by watches); reads
//!   never return an expired value before that.

use super::*;
use crate::cache::{
    CacheError, CacheLimits, CacheShard, ChangeKind, Cond, Counters, Filter, ResumePlan, WatchQueue,
};
use bytes::Bytes;
use felix_quic::wire::cache::encode_event;
use felix_quic::wire::{CacheFrame, EventKind, WatchFilter, WatchStart, WriteCond};

/// Where a cache request came from.
#[derive(Debug, Clone, Copy)]
pub struct CacheOrigin {
    pub core: u8,
    pub conn: ConnKey,
    pub quic_stream: u64,
    pub request_id: u64,
}

/// One applied change as watchers get it.
#[derive(Debug)]
pub struct Ev {
    pub offset: u64,
    pub key: Bytes,
    /// The encoded `CacheEvent` frame, shared by every watcher.
    pub frame: Bytes,
}

/// A watch's start, computed by the owner.
#[derive(Debug)]
pub struct Opened {
    pub shard: u32,
    pub live_from: u64,
    /// Where a resume would start before any change is delivered (the replay's start, else
    /// `live_from`).
    pub resume_from: u64,
    /// State phase: encoded retained events and the `CacheStateDone` frame after them.
    pub state: Option<(Vec<Bytes>, Bytes)>,
    /// Changes to replay before live ones (offset order, filtered).
    pub replay: Vec<Arc<Ev>>,
    /// The replay stopped at this offset (past the watch's bound): the watch ends lagged there
    /// once the replay is delivered (the owner did not register it).
    pub truncated_at: Option<u64>,
}

/// Watch parameters the owner needs.
#[derive(Debug, Clone)]
pub struct WatchReq {
    pub core: u8,
    pub watch: u64,
    pub cache: u32,
    pub shard: u32,
    pub filter: Filter,
    pub start: WatchStart,
    pub events_max: u32,
    pub bytes_max: u64,
}

struct Reg {
    core: u8,
    watch: u64,
    filter: Filter,
}

/// One cache shard this core owns.
pub(super) struct OwnedCache {
    shard: CacheShard,
    counters: Counters,
    ring: VecDeque<Arc<Ev>>,
    ring_bytes: u64,
    /// Lowest offset from which the ring still holds every change.
    replayable_from: u64,
    watches: Vec<Reg>,
    /// Log-backed shards: their logs, and answers waiting for commits (in offset order).
    pub(super) logs: Option<cache_logs::CacheLogs>,
    pending: VecDeque<(u64, CacheOrigin, Frame)>,
    pending_counters: VecDeque<(u64, CacheOrigin, Frame)>,
    /// Records appended since the last snapshot was taken.
    since_snapshot: u64,
    compacting: bool,
    /// Which open of the key this is (its logs' commit watchers carry it).
    pub(super) epoch: u64,
    /// Expiry appends refused (back-pressure): not retried before this wall-clock ms.
    expire_retry_at_ms: u64,
}

/// An answer that waits until its log's acknowledged offset reaches `upto`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Wait {
    counters: bool,
    upto: u64,
}

impl OwnedCache {
    fn new(
        shard: CacheShard,
        counters: Counters,
        logs: Option<cache_logs::CacheLogs>,
        epoch: u64,
    ) -> Self {
        let from = shard.next_offset();
        OwnedCache {
            shard,
            counters,
            ring: VecDeque::new(),
            ring_bytes: 0,
            replayable_from: from,
            watches: Vec::new(),
            logs,
            pending: VecDeque::new(),
            pending_counters: VecDeque::new(),
            since_snapshot: 0,
            compacting: false,
            epoch,
            expire_retry_at_ms: 0,
        }
    }

    /// The state to snapshot, when a log-backed shard has appended `every` records since the
    /// last one and no compaction runs.
    pub(super) fn snapshot_due(&mut self, every: u64) -> Option<crate::cache::snapshot::Snapshot> {
        let logs = self.logs.as_ref()?;
        if self.compacting || self.since_snapshot < every {
            return None;
        }
        self.compacting = true;
        self.since_snapshot = 0;
        Some(crate::cache::snapshot::Snapshot {
            cache_log_id: logs.cache.log_id(),
            counter_log_id: logs.counters.log_id(),
            cache_next: self.shard.next_offset(),
            counters_next: self.counters.next_offset(),
            entries: self
                .shard
                .entries()
                .map(|(k, e)| (k.clone(), e.clone()))
                .collect(),
            counters: self.counters.sums().map(|(k, v)| (k.clone(), v)).collect(),
        })
    }

    pub(super) fn compaction_done(&mut self) {
        self.compacting = false;
    }

    pub(super) fn with_logs(
        shard: CacheShard,
        counters: Counters,
        logs: cache_logs::CacheLogs,
        epoch: u64,
    ) -> Self {
        OwnedCache::new(shard, counters, Some(logs), epoch)
    }

    fn wait_for_commit(&mut self, w: Wait, origin: CacheOrigin, f: Frame) {
        let q = if w.counters {
            &mut self.pending_counters
        } else {
            &mut self.pending
        };
        debug_assert!(q.back().is_none_or(|(u, _, _)| *u < w.upto));
        q.push_back((w.upto, origin, f));
    }

    /// The answers whose records are now committed (`acked`: the log's acknowledged end).
    pub(super) fn take_committed(
        &mut self,
        counters: bool,
        acked: u64,
    ) -> Vec<(CacheOrigin, Frame)> {
        let q = if counters {
            &mut self.pending_counters
        } else {
            &mut self.pending
        };
        let mut out = Vec::new();
        while q.front().is_some_and(|(u, _, _)| *u <= acked) {
            let (_, o, f) = q.pop_front().expect("front checked");
            out.push((o, f));
        }
        out
    }

    pub(super) fn take_all_pending(&mut self) -> Vec<(CacheOrigin, Frame)> {
        self.pending
            .drain(..)
            .chain(self.pending_counters.drain(..))
            .map(|(_, o, f)| (o, f))
            .collect()
    }

    /// Every waiting answer: `(counter log, offset it waits for, origin, answer)`.
    pub(super) fn take_pending_with_upto(&mut self) -> Vec<(bool, u64, CacheOrigin, Frame)> {
        let a = self.pending.drain(..).map(|(u, o, f)| (false, u, o, f));
        let b = self
            .pending_counters
            .drain(..)
            .map(|(u, o, f)| (true, u, o, f));
        a.chain(b).collect()
    }

    pub(super) fn has_pending(&self) -> bool {
        !self.pending.is_empty() || !self.pending_counters.is_empty()
    }

    pub(super) fn watch_cores(&self) -> impl Iterator<Item = u8> + '_ {
        self.watches.iter().map(|r| r.core)
    }
}

/// A watch whose connection this core holds.
pub(super) struct Watch {
    conn: ConnKey,
    /// The watch's stream, opened once the owner accepted the watch (a refused watch never
    /// opens one).
    quic_stream: Option<u64>,
    cache: u32,
    shard: u32,
    filter: Filter,
    request_id: u64,
    /// Where the watch request came from (its answer goes there).
    reply_stream: u64,
    /// None until the owner answered; then the first offset taken live.
    live_from: Option<u64>,
    /// State-phase frames (sent before anything in `queue`).
    state: VecDeque<Bytes>,
    queue: WatchQueue,
    frames: VecDeque<Bytes>,
    /// Set once ended (lag): sent after what is queued, then the watch is gone.
    end: Option<Frame>,
    /// The offset after the last change handed to the connection: nothing from it on has
    /// been delivered (what an end names when it drops the queue).
    resume_at: u64,
}

/// Bytes a watch may have waiting in quiche before the pump stops (flow control does the
/// rest: the queue fills behind it).
const WATCH_PUMP_BYTES: usize = 64 << 10;

/// Expired keys reclaimed per shard per tick (the rest on the next tick).
const EXPIRE_BATCH: usize = 4096;

/// Wall-clock ms since the epoch (cache expiries are absolute).
use felix_storage::log::now_ms as wall_ms;

fn cond(c: WriteCond) -> Cond {
    match c {
        WriteCond::Always => Cond::Always,
        WriteCond::Version(v) => Cond::Version(v),
        WriteCond::Absent => Cond::Absent,
    }
}

fn cache_code(e: &CacheError) -> ErrorCode {
    match e {
        CacheError::KeySize { .. } | CacheError::TtlOutOfRange { .. } => ErrorCode::InvalidRequest,
        CacheError::ValueTooLarge { .. } => ErrorCode::PayloadTooLarge,
        CacheError::ConditionFailed { .. } => ErrorCode::ConditionFailed,
        CacheError::NotFound => ErrorCode::NotFound,
        CacheError::Full { .. } => ErrorCode::CacheFull,
    }
}

fn event_frame(offset: u64, key: &Bytes, kind: &ChangeKind) -> Bytes {
    match kind {
        ChangeKind::Put {
            value,
            expires_at_ms,
        } => encode_event(
            EventKind::Put,
            offset,
            key.clone(),
            expires_at_ms.unwrap_or(0),
            value.clone(),
        ),
        ChangeKind::Delete => encode_event(EventKind::Delete, offset, key.clone(), 0, Bytes::new()),
        ChangeKind::Expire => encode_event(EventKind::Expire, offset, key.clone(), 0, Bytes::new()),
    }
}

fn filter_of(f: &WatchFilter) -> Filter {
    match f {
        WatchFilter::Key(k) => Filter::Key(k.clone()),
        WatchFilter::Prefix { prefix, .. } => Filter::Prefix(prefix.clone()),
    }
}

impl CoreState {
    pub(super) fn cache_owner_core(&self, cache: u32, shard: u32) -> u8 {
        let def = &self.catalog.cache_slot(cache).def;
        core_for_shard(&def.name(), shard, self.s.cores as u32) as u8
    }

    pub(super) fn cache_limits(&self) -> CacheLimits {
        let c = &self.s.cfg;
        CacheLimits {
            key_bytes_max: c.cache_key_bytes_max as usize,
            value_bytes_max: c.max_payload_bytes as usize,
            entries_max: c.cache_entries_max as usize,
            bytes_max: c.cache_bytes_max,
        }
    }

    fn owned_cache(&mut self, key: ShardKey) -> &mut OwnedCache {
        debug_assert_eq!(self.cache_owner_core(key.0, key.1), self.id);
        let limits = self.cache_limits();
        let durable = self.catalog.cache_slot(key.0).def.durable;
        self.caches.entry(key).or_insert_with(|| {
            // A log-backed shard is inserted once its logs are open (`cache_gate`).
            assert!(!durable, "a log-backed cache shard is used only once open");
            let base = wall_ms() << 20;
            OwnedCache::new(CacheShard::new(limits, base), Counters::new(base), None, 0)
        })
    }

    // ---------- connection side ----------

    /// A cache frame from a client: answer it here (describe, unwatch) or route it to the
    /// owner of the key's shard.
    pub(super) fn on_cache_request(
        &mut self,
        key: ConnKey,
        quic_stream: u64,
        frame: CacheFrame,
    ) -> Result<(), (ErrorCode, String)> {
        let rid = frame.request_id();
        let Some(name) = frame.cache().cloned() else {
            return Err((
                ErrorCode::InvalidRequest,
                format!("frame kind {} is not a cache request", frame.kind()),
            ));
        };
        let catalog = self.catalog.clone();
        let (idx, def) = catalog.lookup_cache(&name)?;
        let idx = idx as u32;
        if let CacheFrame::DescribeCache { .. } = frame {
            let reply = Frame::Cache(CacheFrame::CacheInfo {
                request_id: rid,
                shards: def.shards,
                durable: def.durable,
                default_ttl_ms: def.default_ttl_ms.unwrap_or(0),
            });
            if let Some(e) = self.ep.get(key) {
                e.conn.send_frame(quic_stream, &reply);
            }
            return Ok(());
        }
        if def.durable && self.s.cfg.durable_storage_dir.is_none() {
            return Err((
                ErrorCode::Unsupported,
                format!("cache {name} is log-backed (durable) and this broker has no durable_storage_dir (FELIX_DURABLE_STORAGE_DIR)"),
            ));
        }
        let routing: &[u8] = match &frame {
            CacheFrame::CachePut { key, .. }
            | CacheFrame::CacheGet { key, .. }
            | CacheFrame::CacheDelete { key, .. } => key,
            CacheFrame::CounterAdd { name, .. } | CacheFrame::CounterGet { name, .. } => name,
            CacheFrame::CacheWatch {
                filter: WatchFilter::Key(k),
                ..
            } => k,
            _ => &[],
        };
        let shard = match &frame {
            CacheFrame::CacheWatch {
                filter: WatchFilter::Prefix { shard, .. },
                ..
            } => {
                if *shard >= def.shards {
                    return Err((
                        ErrorCode::UnknownShard,
                        format!(
                            "cache {name} has {}, not {shard}",
                            crate::core::shard_range(def.shards)
                        ),
                    ));
                }
                *shard
            }
            _ => {
                let max = self.s.cfg.cache_key_bytes_max as usize;
                if routing.is_empty() || routing.len() > max {
                    return Err((
                        ErrorCode::InvalidRequest,
                        format!("key of {} bytes is outside 1..={max}", routing.len()),
                    ));
                }
                felix_quic::wire::hash::shard_for_key(routing, def.shards)
            }
        };
        catalog.cache_serve_check(idx, shard)?;
        if let CacheFrame::CacheWatch {
            filter,
            start,
            queue_events_max,
            queue_bytes_max,
            ..
        } = frame
        {
            return self.open_watch(
                key,
                quic_stream,
                rid,
                idx,
                shard,
                filter,
                start,
                queue_events_max,
                queue_bytes_max,
            );
        }
        let write = matches!(
            frame,
            CacheFrame::CachePut { .. }
                | CacheFrame::CacheDelete { .. }
                | CacheFrame::CounterAdd { .. }
        );
        if write && self.draining {
            return Err((
                ErrorCode::ShuttingDown,
                "the broker is shutting down; the write was not applied".into(),
            ));
        }
        if let Some(sess) = self.sessions.get_mut(&key) {
            sess.cache_inflight += 1; // until its answer comes back (drain waits for it)
        }
        CoreCounters::inc(&self.s.counters.cache_requests);
        let origin = CacheOrigin {
            core: self.id,
            conn: key,
            quic_stream,
            request_id: rid,
        };
        let owner = self.cache_owner_core(idx, shard);
        self.route(
            owner,
            MeshMsg::CacheReq {
                origin,
                cache: idx,
                shard,
                frame,
            },
        );
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn open_watch(
        &mut self,
        key: ConnKey,
        reply_stream: u64,
        request_id: u64,
        cache: u32,
        shard: u32,
        filter: WatchFilter,
        start: WatchStart,
        events_max: u32,
        bytes_max: u64,
    ) -> Result<(), (ErrorCode, String)> {
        let cfg = self.s.cfg.clone();
        if let WatchFilter::Prefix { prefix, .. } = &filter {
            if prefix.len() > cfg.cache_key_bytes_max as usize {
                return Err((
                    ErrorCode::InvalidRequest,
                    format!(
                        "prefix of {} bytes is longer than cache_key_bytes_max ({})",
                        prefix.len(),
                        cfg.cache_key_bytes_max
                    ),
                ));
            }
        }
        let session = self
            .sessions
            .get_mut(&key)
            .expect("frames come from live sessions");
        session.room_for_one_more(cfg.max_subscriptions)?;
        let events_max = queue_bound(events_max as u64, cfg.cache_watch_max_events as u64) as u32;
        let bytes_max = queue_bound(bytes_max, cfg.cache_watch_max_bytes);
        let wid = ((self.id as u64) << 48) | self.next_sub;
        self.next_sub += 1;
        session.watches.push(wid);
        let f = filter_of(&filter);
        self.watches.insert(
            wid,
            Watch {
                conn: key,
                quic_stream: None,
                cache,
                shard,
                filter: f.clone(),
                request_id,
                reply_stream,
                live_from: None,
                state: VecDeque::new(),
                queue: WatchQueue::new(events_max as usize, bytes_max),
                frames: VecDeque::new(),
                end: None,
                resume_at: 0,
            },
        );
        self.local_watches
            .entry((cache, shard))
            .or_default()
            .push(wid);
        let owner = self.cache_owner_core(cache, shard);
        self.route(
            owner,
            MeshMsg::WatchOpen(WatchReq {
                core: self.id,
                watch: wid,
                cache,
                shard,
                filter: f,
                start,
                events_max,
                bytes_max,
            }),
        );
        Ok(())
    }

    pub(super) fn on_cache_reply(&mut self, origin: CacheOrigin, frame: Frame) {
        if let Some(sess) = self.sessions.get_mut(&origin.conn) {
            sess.cache_inflight = sess.cache_inflight.saturating_sub(1);
        }
        if let Some(e) = self.ep.get(origin.conn) {
            e.conn.send_frame(origin.quic_stream, &frame);
            self.ep.mark_dirty(origin.conn);
        }
    }

    pub(super) fn on_watch_opened(
        &mut self,
        wid: u64,
        result: Result<Opened, (ErrorCode, String)>,
    ) {
        let Some(w) = self.watches.get_mut(&wid) else {
            return; // closed meanwhile; its WatchClose follows the open at the owner
        };
        let (conn, rid, rs) = (w.conn, w.request_id, w.reply_stream);
        let refuse = |st: &mut Self, code, msg| {
            st.remove_watch(wid, None, false);
            st.send_err(conn, rs, rid, code, msg);
            st.ep.mark_dirty(conn);
        };
        let opened = match result {
            Ok(o) => o,
            Err((code, msg)) => return refuse(self, code, msg),
        };
        // The stream opens only now, so a refused watch leaves nothing on the connection.
        let Some(e) = self.ep.get(conn) else {
            return self.remove_watch(wid, None, false);
        };
        if !e.conn.can_open_uni() {
            return refuse(
                self,
                ErrorCode::TooManySubscriptions,
                "the client's unidirectional stream limit is exhausted".into(),
            );
        }
        let qs = e.conn.open_uni();
        e.conn.send_frame(
            qs,
            &Frame::SubStream {
                subscription_id: wid,
            },
        );
        if let Some(session) = self.sessions.get_mut(&conn) {
            session.sub_streams.insert(qs, wid);
        }
        CoreCounters::inc(&self.s.counters.cache_watches_opened);
        let w = self.watches.get_mut(&wid).expect("looked up above");
        w.quic_stream = Some(qs);
        w.resume_at = opened.resume_from;
        w.live_from = Some(opened.live_from);
        if let Some((retained, done)) = opened.state {
            w.state.extend(retained);
            w.state.push_back(done);
        }
        let mut lagged = None;
        for ev in opened.replay {
            if w.queue.offer(ev.offset, ev.frame.len() as u64) {
                w.frames.push_back(ev.frame.clone());
            } else {
                lagged = w.queue.ended_at();
                break;
            }
        }
        let (events_max, bytes_max) = w.queue.bounds();
        let ok = Frame::Cache(CacheFrame::CacheWatchOk {
            request_id: w.request_id,
            watch_id: wid,
            shard: opened.shard,
            live_from: opened.live_from,
            queue_events_max: events_max as u32,
            queue_bytes_max: bytes_max,
        });
        self.send_to_conn(conn, rs, &ok);
        if let Some(at) = lagged.or(opened.truncated_at) {
            self.lag_end(wid, at);
        }
        self.pump_watch(wid);
    }

    fn send_to_conn(&mut self, conn: ConnKey, stream: u64, f: &Frame) {
        if let Some(e) = self.ep.get(conn) {
            e.conn.send_frame(stream, f);
            self.ep.mark_dirty(conn);
        }
    }

    /// A change of an owned shard reached this core: offer it to the matching watches.
    pub(super) fn on_cache_change(&mut self, cache: u32, shard: u32, ev: Arc<Ev>) {
        let Some(ids) = self.local_watches.get(&(cache, shard)) else {
            return;
        };
        for wid in ids.clone() {
            let Some(w) = self.watches.get_mut(&wid) else {
                continue;
            };
            let live = w.live_from.is_some_and(|lf| ev.offset >= lf);
            if !live || w.end.is_some() || !w.filter.matches(&ev.key) {
                continue;
            }
            if w.queue.offer(ev.offset, ev.frame.len() as u64) {
                w.frames.push_back(ev.frame.clone());
                self.pump_watch(wid);
            } else {
                let at = w.queue.ended_at().expect("a refused offer ends the queue");
                self.lag_end(wid, at);
                self.pump_watch(wid);
            }
        }
    }

    /// The watch overflowed at `at`: stop taking changes (unregister at the owner) and end
    /// it once what it queued before is delivered.
    fn lag_end(&mut self, wid: u64, at: u64) {
        let Some(w) = self.watches.get_mut(&wid) else {
            return;
        };
        if w.end.is_some() {
            return;
        }
        CoreCounters::inc(&self.s.counters.cache_watches_lagged);
        w.end = Some(Frame::Cache(CacheFrame::CacheWatchEnd {
            code: ErrorCode::WatchLagged.number(),
            resume_from: at,
            message: format!(
                "watch fell behind its queue bound; nothing from offset {at} on was delivered: watch again from {at}"
            ),
        }));
        let key = (w.cache, w.shard);
        self.unindex_watch(wid, key);
    }

    fn unindex_watch(&mut self, wid: u64, key: ShardKey) {
        if let Some(v) = self.local_watches.get_mut(&key) {
            v.retain(|x| *x != wid);
            if v.is_empty() {
                self.local_watches.remove(&key);
            }
        }
        let owner = self.cache_owner_core(key.0, key.1);
        self.route(
            owner,
            MeshMsg::WatchClose {
                watch: wid,
                cache: key.0,
                shard: key.1,
            },
        );
    }

    /// Move queued events onto the watch's stream while quiche has little of it waiting.
    pub(super) fn pump_watch(&mut self, wid: u64) {
        let Some(w) = self.watches.get_mut(&wid) else {
            return;
        };
        let Some(qs) = w.quic_stream else {
            return; // not accepted by the owner yet
        };
        let Some(e) = self.ep.get(w.conn) else {
            return;
        };
        let mut sent = 0u64;
        while e.conn.queued_bytes(qs) < WATCH_PUMP_BYTES {
            let next = match w.state.pop_front() {
                Some(b) => Some(b),
                None => {
                    let f = w.frames.pop_front();
                    if f.is_some() {
                        let off = w.queue.pop().expect("frames and queue move together");
                        w.resume_at = off + 1;
                    }
                    f
                }
            };
            match next {
                Some(b) => {
                    sent += 1;
                    e.conn.send_bytes(qs, b)
                }
                None => break,
            }
        }
        let conn = w.conn;
        let done = w.end.is_some() && w.state.is_empty() && w.frames.is_empty();
        CoreCounters::add(&self.s.counters.cache_watch_events, sent);
        self.ep.mark_dirty(conn);
        if done {
            let end = w.end.take();
            self.remove_watch(wid, end, true);
        }
    }

    /// Forget a watch here; `end` is sent as its last frame (then the stream is finished).
    /// `unindexed`: already unregistered (lag end).
    pub(super) fn remove_watch(&mut self, wid: u64, end: Option<Frame>, unindexed: bool) {
        let Some(w) = self.watches.remove(&wid) else {
            return;
        };
        if !unindexed {
            self.unindex_watch(wid, (w.cache, w.shard));
        }
        if let Some(session) = self.sessions.get_mut(&w.conn) {
            session.watches.retain(|x| *x != wid);
            if let Some(qs) = w.quic_stream {
                session.sub_streams.remove(&qs);
            }
        }
        if let (Some(e), Some(qs)) = (self.ep.get(w.conn), w.quic_stream) {
            if let Some(f) = end {
                e.conn.send_frame(qs, &f);
            }
            e.conn.finish(qs);
            self.ep.mark_dirty(w.conn);
        }
    }

    /// Events and bytes queued over this core's watches (state phases included).
    pub(super) fn watch_queue_totals(&self) -> (u64, u64) {
        self.watches.values().fold((0, 0), |(e, b), w| {
            let state: u64 = w.state.iter().map(|f| f.len() as u64).sum();
            (
                e + (w.queue.len() + w.state.len()) as u64,
                b + w.queue.bytes() + state,
            )
        })
    }

    pub(super) fn is_watch(&self, id: u64) -> bool {
        self.watches.contains_key(&id)
    }

    /// Nothing queued for the watch (it is gone, or everything was handed to quiche).
    pub(super) fn watch_idle(&self, id: u64) -> bool {
        self.watches
            .get(&id)
            .is_none_or(|w| w.state.is_empty() && w.frames.is_empty() && w.end.is_none())
    }

    /// `Unsubscribe` naming a watch of this connection.
    pub(super) fn unwatch(&mut self, key: ConnKey, wid: u64) -> bool {
        let Some(w) = self.watches.get(&wid).filter(|w| w.conn == key) else {
            return false;
        };
        let end = Frame::Cache(CacheFrame::CacheWatchEnd {
            code: 0,
            resume_from: w.resume_at,
            message: "unwatched".into(),
        });
        let unindexed = self.watches[&wid].end.is_some();
        self.remove_watch(wid, Some(end), unindexed);
        true
    }

    /// End every local watch on `key`'s shard (cache deleted or moved). What they had
    /// queued is dropped; each end names the offset after the last change delivered.
    pub(super) fn end_local_watches(&mut self, key: ShardKey, (code, msg): (ErrorCode, String)) {
        let ids = self.local_watches.get(&key).cloned().unwrap_or_default();
        for wid in ids {
            let w = &self.watches[&wid];
            if w.quic_stream.is_none() {
                // Not answered by the owner yet: refuse the request itself (its open, if it
                // comes, finds the watch gone).
                let (conn, rs, rid) = (w.conn, w.reply_stream, w.request_id);
                self.remove_watch(wid, None, false);
                self.send_err(conn, rs, rid, code, msg.clone());
                self.ep.mark_dirty(conn);
                continue;
            }
            let resume_from = w.resume_at;
            let end = Frame::Cache(CacheFrame::CacheWatchEnd {
                code: code.number(),
                resume_from,
                message: msg.clone(),
            });
            self.remove_watch(wid, Some(end), false);
        }
    }

    pub(super) fn watches_conn_closed(&mut self, watches: Vec<u64>) {
        for wid in watches {
            let unindexed = self.watches.get(&wid).is_some_and(|w| w.end.is_some());
            self.remove_watch(wid, None, unindexed);
        }
    }

    /// Catalog moved on: end watches of caches deleted or shards moved, drop owned state of
    /// shards no longer served here (an in-memory shard's contents go with it).
    pub(super) fn refresh_caches(&mut self, old: &Catalog) {
        let new = self.catalog.clone();
        for (i, slot) in new.cache_slots().iter().enumerate() {
            let idx = i as u32;
            let was = old.cache_slots().get(i);
            for shard in 0..slot.def.shards {
                let served_before = was.is_some_and(|w| {
                    !w.deleted
                        && !old.fenced
                        && matches!(w.places.get(shard as usize), Some(Place::Mine { .. }))
                });
                let serves = new.cache_serve_check(idx, shard);
                let same = was.and_then(|w| w.places.get(shard as usize))
                    == slot.places.get(shard as usize);
                if served_before && (serves.is_err() || !same) {
                    let why = serves.err().unwrap_or((
                        ErrorCode::NotLeader,
                        format!(
                            "shard {shard} of cache {} was placed again (new generation); watch again",
                            slot.def.name()
                        ),
                    ));
                    self.end_local_watches((idx, shard), why.clone());
                    match self.caches.remove(&(idx, shard)) {
                        Some(oc) if oc.logs.is_some() => self.retire_cache_shard((idx, shard), oc),
                        Some(mut oc) => self.drop_owned_cache((idx, shard), &mut oc, why, false),
                        None => {}
                    }
                }
                // A deleted log-backed cache's shard this core owns but has not open: its
                // logs go too (one that is opening is retired when its open completes).
                let newly_deleted = slot.deleted && was.is_some_and(|w| !w.deleted);
                if newly_deleted
                    && slot.def.durable
                    && self.cache_owner_core(idx, shard) == self.id
                    && !self.caches.contains_key(&(idx, shard))
                    && !self.cache_opening.contains_key(&(idx, shard))
                    && !self.cache_closing.contains_key(&(idx, shard))
                {
                    self.remove_unopened_cache_shard((idx, shard));
                }
            }
        }
    }

    // ---------- owner side ----------

    pub(super) fn on_cache_req(
        &mut self,
        origin: CacheOrigin,
        cache: u32,
        shard: u32,
        frame: CacheFrame,
    ) {
        let reply = match self.catalog.cache_serve_check(cache, shard) {
            Err((code, msg)) => Frame::error(origin.request_id, code, msg),
            Ok(()) => match self.apply_cache_op(origin.request_id, cache, shard, frame) {
                (f, None) => f,
                (f, Some(wait)) => {
                    let oc = self.caches.get_mut(&(cache, shard)).expect("applied on it");
                    oc.wait_for_commit(wait, origin, f);
                    oc.since_snapshot += 1;
                    self.maybe_compact((cache, shard));
                    return;
                }
            },
        };
        self.route(
            origin.core,
            MeshMsg::CacheReply {
                origin,
                frame: reply,
            },
        );
    }

    /// Apply one request; the answer now, or (log-backed writes) once its record commits.
    fn apply_cache_op(
        &mut self,
        rid: u64,
        cache: u32,
        shard: u32,
        frame: CacheFrame,
    ) -> (Frame, Option<Wait>) {
        let now = wall_ms();
        let default_ttl = self.catalog.cache_slot(cache).def.default_ttl_ms;
        let counters_max = self.s.cfg.cache_entries_max as usize;
        let key = (cache, shard);
        let oc = self.owned_cache(key);
        let now_frame = |f: Frame| (f, None);
        let err = |e: &CacheError| now_frame(Frame::error(rid, cache_code(e), e.to_string()));
        // Check, append (log-backed), then apply: the state never runs ahead of the log.
        let (answer, change) = match frame {
            CacheFrame::CachePut {
                key: k,
                value,
                ttl_ms,
                cond: c,
                ..
            } => {
                let ttl = if ttl_ms == 0 {
                    default_ttl
                } else {
                    Some(ttl_ms)
                };
                let ch = match oc.shard.prepare_put(k, value, ttl, cond(c), now) {
                    Ok(ch) => ch,
                    Err(e) => return err(&e),
                };
                let expires = match &ch.kind {
                    ChangeKind::Put { expires_at_ms, .. } => expires_at_ms.unwrap_or(0),
                    _ => 0,
                };
                let f = Frame::Cache(CacheFrame::CacheWritten {
                    request_id: rid,
                    shard,
                    version: ch.offset,
                    expires_at_ms: expires,
                });
                (f, ch)
            }
            CacheFrame::CacheGet { key: k, .. } => {
                let f = match oc.shard.get(&k, now) {
                    Some(e) => CacheFrame::CacheValue {
                        request_id: rid,
                        shard,
                        found: true,
                        version: e.version,
                        change_offset: 0,
                        expires_at_ms: e.expires_at_ms.unwrap_or(0),
                        value: e.value.clone(),
                    },
                    None => CacheFrame::CacheValue {
                        request_id: rid,
                        shard,
                        found: false,
                        version: 0,
                        change_offset: 0,
                        expires_at_ms: 0,
                        value: Bytes::new(),
                    },
                };
                return now_frame(Frame::Cache(f));
            }
            CacheFrame::CacheDelete {
                key: k, cond: c, ..
            } => {
                let (ch, old) = match oc.shard.prepare_delete(k, cond(c), now) {
                    Ok(x) => x,
                    Err(e) => return err(&e),
                };
                let f = Frame::Cache(CacheFrame::CacheValue {
                    request_id: rid,
                    shard,
                    found: true,
                    version: old.version,
                    change_offset: ch.offset,
                    expires_at_ms: old.expires_at_ms.unwrap_or(0),
                    value: old.value,
                });
                (f, ch)
            }
            CacheFrame::CounterAdd { name, delta, .. } => {
                if !oc.counters.contains(&name) && oc.counters.len() >= counters_max {
                    return now_frame(Frame::error(
                        rid,
                        ErrorCode::CacheFull,
                        format!(
                            "shard holds {} counters (cache_entries_max)",
                            oc.counters.len()
                        ),
                    ));
                }
                let (offset, sum) = match oc.counters.prepare_add(&name, delta) {
                    Ok(x) => x,
                    Err(e) => {
                        return now_frame(Frame::error(
                            rid,
                            ErrorCode::InvalidRequest,
                            e.to_string(),
                        ))
                    }
                };
                if let Some(logs) = &oc.logs {
                    let d = delta.to_le_bytes();
                    let rec = RecordIn {
                        key: &name,
                        payload: &d,
                        flags: 0,
                    };
                    match logs.counters.append(&[rec], now) {
                        Ok(r) => assert_eq!(r.start, offset, "counter log and state agree"),
                        Err(e) => {
                            let (code, msg) = cache_logs::append_refusal(&e);
                            return now_frame(Frame::error(rid, code, msg));
                        }
                    }
                }
                oc.counters.apply(offset, name, delta);
                let f = Frame::Cache(CacheFrame::CounterValue {
                    request_id: rid,
                    shard,
                    sum,
                    offset,
                });
                let wait = oc.logs.as_ref().map(|_| Wait {
                    counters: true,
                    upto: offset + 1,
                });
                return (f, wait);
            }
            CacheFrame::CounterGet { name, .. } => {
                return now_frame(Frame::Cache(CacheFrame::CounterValue {
                    request_id: rid,
                    shard,
                    sum: oc.counters.get(&name),
                    offset: oc.counters.next_offset(),
                }));
            }
            other => {
                return now_frame(Frame::error(
                    rid,
                    ErrorCode::InvalidRequest,
                    format!("frame kind {} is not a cache operation", other.kind()),
                ))
            }
        };
        if let Some(logs) = &oc.logs {
            let (k, flags, payload) = crate::cache::record::encode(&change);
            let rec = RecordIn {
                key: &k,
                payload: &payload,
                flags,
            };
            match logs.cache.append(&[rec], now) {
                Ok(r) => assert_eq!(r.start, change.offset, "cache log and state agree"),
                Err(e) => {
                    let (code, msg) = cache_logs::append_refusal(&e);
                    return now_frame(Frame::error(rid, code, msg));
                }
            }
        }
        oc.shard.apply(&change);
        let wait = oc.logs.as_ref().map(|_| Wait {
            counters: false,
            upto: change.offset + 1,
        });
        CoreCounters::inc(&self.s.counters.cache_writes);
        self.emit(key, change.offset, change.key, &change.kind);
        (answer, wait)
    }

    /// Record a change in the replay ring and send it to every core with a matching watch.
    fn emit(&mut self, key: ShardKey, offset: u64, k: Bytes, kind: &ChangeKind) {
        let frame = event_frame(offset, &k, kind);
        let ev = Arc::new(Ev {
            offset,
            key: k,
            frame,
        });
        let (entries_max, bytes_max) = (
            self.s.cfg.cache_replay_entries_max as usize,
            self.s.cfg.cache_replay_bytes_max,
        );
        let cores = self.s.cores as usize;
        let oc = self.caches.get_mut(&key).expect("emit on an owned shard");
        if let Some(last) = oc.ring.back() {
            assert_eq!(last.offset + 1, offset, "cache changes are contiguous");
        }
        oc.ring_bytes += ev.frame.len() as u64;
        oc.ring.push_back(ev.clone());
        while oc.ring.len() > entries_max || oc.ring_bytes > bytes_max {
            let old = oc
                .ring
                .pop_front()
                .expect("ring over its caps is not empty");
            oc.ring_bytes -= old.frame.len() as u64;
            oc.replayable_from = old.offset + 1;
        }
        let mut to = vec![false; cores];
        for r in &oc.watches {
            if r.filter.matches(&ev.key) {
                to[r.core as usize] = true;
            }
        }
        for (core, yes) in to.into_iter().enumerate() {
            if yes {
                self.route(
                    core as u8,
                    MeshMsg::CacheChange {
                        cache: key.0,
                        shard: key.1,
                        ev: ev.clone(),
                    },
                );
            }
        }
    }

    pub(super) fn on_watch_open(&mut self, req: WatchReq) {
        // A resume below the replay ring that the log still holds is read from the log.
        if let WatchStart::Offset(from) = req.start {
            let key = (req.cache, req.shard);
            let from_log = self.catalog.cache_serve_check(req.cache, req.shard).is_ok()
                && self.caches.get(&key).is_some_and(|oc| {
                    oc.logs.as_ref().is_some_and(|l| {
                        from < oc.replayable_from
                            && from >= l.cache.oldest_offset()
                            && from <= oc.shard.next_offset()
                    })
                });
            if from_log {
                return self.start_log_replay(req, from);
            }
        }
        let result = self.start_watch(&req);
        self.route(
            req.core,
            MeshMsg::WatchOpened {
                watch: req.watch,
                result,
            },
        );
    }

    fn start_watch(&mut self, req: &WatchReq) -> Result<Opened, (ErrorCode, String)> {
        self.catalog.cache_serve_check(req.cache, req.shard)?;
        let now = wall_ms();
        let oc = self.owned_cache((req.cache, req.shard));
        let next = oc.shard.next_offset();
        let (state, replay) = match req.start {
            WatchStart::Latest => (None, Vec::new()),
            WatchStart::Current => (Some(false), Vec::new()),
            WatchStart::Offset(from) => {
                match crate::cache::plan_resume(from, oc.replayable_from, next) {
                    ResumePlan::BeyondTail { next_offset } => {
                        return Err((
                            ErrorCode::InvalidRequest,
                            format!(
                                "offset {from} is beyond the tail of the shard ({next_offset})"
                            ),
                        ))
                    }
                    ResumePlan::Snapshot => (Some(true), Vec::new()),
                    ResumePlan::Replay { from } => (
                        None,
                        oc.ring
                            .iter()
                            .filter(|e| e.offset >= from && req.filter.matches(&e.key))
                            .cloned()
                            .collect(),
                    ),
                }
            }
        };
        let resume_from = match req.start {
            WatchStart::Offset(from) if state.is_none() => from,
            _ => next,
        };
        let state = match state {
            None => None,
            Some(snapshot) => {
                let ws = oc.shard.watch_start(&req.filter, now);
                let frames: Vec<Bytes> = ws
                    .retained
                    .into_iter()
                    .map(|(k, e)| {
                        encode_event(
                            EventKind::Retained,
                            e.version,
                            k,
                            e.expires_at_ms.unwrap_or(0),
                            e.value,
                        )
                    })
                    .collect();
                let bytes: u64 = frames.iter().map(|f| f.len() as u64).sum();
                if frames.len() > req.events_max as usize || bytes > req.bytes_max {
                    return Err((
                        ErrorCode::InvalidRequest,
                        format!(
                            "the current state ({} keys, {bytes} bytes) exceeds the watch's queue bound ({} events, {} bytes); narrow the filter or raise the bound",
                            frames.len(),
                            req.events_max,
                            req.bytes_max
                        ),
                    ));
                }
                let done = Frame::Cache(CacheFrame::CacheStateDone {
                    count: frames.len() as u64,
                    snapshot,
                    live_from: ws.live_from,
                })
                .encode();
                Some((frames, done))
            }
        };
        oc.watches.push(Reg {
            core: req.core,
            watch: req.watch,
            filter: req.filter.clone(),
        });
        Ok(Opened {
            shard: req.shard,
            live_from: next,
            resume_from,
            truncated_at: None,
            state,
            replay,
        })
    }

    /// Read `[from, ring start)` from the shard's log (the ring start may move while it
    /// reads: read on until the ring covers the rest), then register the watch and send its
    /// replay — log part, then ring part — in one step, so it joins live with no gap. A
    /// replay past the watch's bound stops there and the watch ends lagged at that offset.
    fn start_log_replay(&mut self, req: WatchReq, from: u64) {
        let key = (req.cache, req.shard);
        let oc = self.caches.get(&key).expect("checked by the caller");
        let epoch = oc.epoch;
        let log = oc.logs.as_ref().expect("checked").cache.clone();
        let me = self.me.clone();
        glommio::spawn_local(async move {
            cache_logs::yield_once().await; // the caller holds the state
            let mut events: Vec<Arc<Ev>> = Vec::new();
            let (mut at, mut bytes, mut truncated) = (from, 0u64, None);
            loop {
                let need = {
                    let Some(st) = me.upgrade() else { return };
                    let mut st = st.borrow_mut();
                    let need = st.finish_log_replay(&req, epoch, &mut events, at, truncated);
                    if need.is_none() {
                        st.drain_inbox();
                        st.wake.wake();
                    }
                    need
                };
                let Some(ring_start) = need else { return };
                let recs = match log.read(at, 1024, 1 << 20).await {
                    Ok(r) => r,
                    Err(e) => {
                        let err = (
                            ErrorCode::Unavailable,
                            format!("reading the cache log: {e}"),
                        );
                        let opened = MeshMsg::WatchOpened {
                            watch: req.watch,
                            result: Err(err),
                        };
                        return reenter(&me, |st| st.route(req.core, opened));
                    }
                };
                if recs.is_empty() {
                    // Appended but not acknowledged yet: wait for the commit.
                    let _ = log.wait_acked_beyond(at).await;
                    continue;
                }
                for r in recs {
                    if r.offset >= ring_start {
                        break;
                    }
                    at = r.offset + 1;
                    let Ok(c) = crate::cache::record::decode(r.offset, r.key, r.flags, r.payload)
                    else {
                        continue; // a bad record fails the open, not a watch
                    };
                    if !req.filter.matches(&c.key) {
                        continue;
                    }
                    let frame = event_frame(c.offset, &c.key, &c.kind);
                    bytes += frame.len() as u64;
                    if events.len() >= req.events_max as usize || bytes > req.bytes_max {
                        truncated = Some(c.offset);
                        break;
                    }
                    events.push(Arc::new(Ev {
                        offset: c.offset,
                        key: c.key,
                        frame,
                    }));
                }
            }
        })
        .detach();
    }

    /// Finish a log replay if the ring now covers everything from `at` (or the replay is cut
    /// short); else the ring start to read up to.
    fn finish_log_replay(
        &mut self,
        req: &WatchReq,
        epoch: u64,
        events: &mut Vec<Arc<Ev>>,
        at: u64,
        truncated: Option<u64>,
    ) -> Option<u64> {
        let key = (req.cache, req.shard);
        let served = self.catalog.cache_serve_check(req.cache, req.shard);
        let result = match (served, self.caches.get_mut(&key)) {
            (Err(e), _) => Err(e),
            (Ok(()), Some(oc)) if oc.epoch == epoch => {
                if truncated.is_none() && at < oc.replayable_from {
                    return Some(oc.replayable_from);
                }
                let next = oc.shard.next_offset();
                let mut replay = std::mem::take(events);
                if truncated.is_none() {
                    replay.extend(
                        oc.ring
                            .iter()
                            .filter(|e| e.offset >= at && req.filter.matches(&e.key))
                            .cloned(),
                    );
                    oc.watches.push(Reg {
                        core: req.core,
                        watch: req.watch,
                        filter: req.filter.clone(),
                    });
                }
                let WatchStart::Offset(from) = req.start else {
                    unreachable!("log replays are resumes")
                };
                Ok(Opened {
                    shard: req.shard,
                    live_from: next,
                    resume_from: from,
                    state: None,
                    replay,
                    truncated_at: truncated,
                })
            }
            (Ok(()), _) => Err((
                ErrorCode::Unavailable,
                "the cache shard closed while the watch was replaying its log".into(),
            )),
        };
        self.route(
            req.core,
            MeshMsg::WatchOpened {
                watch: req.watch,
                result,
            },
        );
        None
    }

    pub(super) fn on_watch_close(&mut self, watch: u64, cache: u32, shard: u32) {
        if let Some(oc) = self.caches.get_mut(&(cache, shard)) {
            oc.watches.retain(|r| r.watch != watch);
        }
    }

    /// When the owner must next reclaim expired keys, if any key expires.
    pub(super) fn cache_timeout(&self) -> Option<Duration> {
        let t = self
            .caches
            .values()
            .filter_map(|c| {
                c.shard
                    .next_expiry_ms()
                    .map(|t| t.max(c.expire_retry_at_ms))
            })
            .min()?;
        Some(Duration::from_millis(t.saturating_sub(wall_ms())))
    }

    /// Reclaim expired keys of the owned shards (each an Expire change watches see).
    pub(super) fn caches_tick(&mut self) {
        let now = wall_ms();
        let due: Vec<ShardKey> = self
            .caches
            .iter()
            .filter(|(_, c)| {
                c.expire_retry_at_ms <= now && c.shard.next_expiry_ms().is_some_and(|t| t <= now)
            })
            .map(|(k, _)| *k)
            .collect();
        // One commit must hold the batch: stay well under the log's commit bound.
        let batch_bytes_max = commit_bytes_max(&self.s.cfg) / 2;
        for key in due {
            let oc = self.caches.get_mut(&key).expect("due shard is owned");
            let mut changes = oc.shard.prepare_expire(now, EXPIRE_BATCH);
            if let Some(logs) = &oc.logs {
                let mut bytes = 0usize;
                let fit = changes
                    .iter()
                    .take_while(|c| {
                        bytes += felix_storage::record::HEADER_BYTES + c.key.len() + 1;
                        bytes <= batch_bytes_max
                    })
                    .count()
                    .max(1);
                changes.truncate(fit);
                let encoded: Vec<_> = changes.iter().map(crate::cache::record::encode).collect();
                let recs: Vec<RecordIn> = encoded
                    .iter()
                    .map(|(k, flags, p)| RecordIn {
                        key: k,
                        payload: p,
                        flags: *flags,
                    })
                    .collect();
                match logs.cache.append(&recs, now) {
                    Ok(r) => assert_eq!(r.start, changes[0].offset, "cache log and state agree"),
                    // Back-pressure (or a failing log, which fails the shard through its
                    // commit watcher): try again later rather than spin; reads already hide
                    // the expired values.
                    Err(_) => {
                        oc.expire_retry_at_ms = now + 100;
                        continue;
                    }
                }
            }
            for ch in &changes {
                oc.shard.apply(ch);
            }
            if oc.logs.is_some() {
                oc.since_snapshot += changes.len() as u64;
            }
            CoreCounters::add(&self.s.counters.cache_expired, changes.len() as u64);
            for ch in changes {
                self.emit(key, ch.offset, ch.key, &ch.kind);
            }
        }
    }
}

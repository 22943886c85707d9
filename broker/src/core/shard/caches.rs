//! Cache shards at their owner core, as a pure host: requests applied (check, append when
//! log-backed, apply), changes recorded in the replay ring and sent to the cores with
//! matching watches, watch starts computed (current state, replay from the ring), answers
//! released as the logs commit, and the TTL clock. It reads no clock (`Ctx::ts_ms` is the
//! wall time expiries are compared with), spawns nothing and touches no file: what needs I/O
//! (reading a log for a resume below the ring, a compaction) comes out as an effect the
//! driver carries out (`core/caches`, `core/cache_logs`), and the simulator runs the same
//! code (`core/sim`).
//!
//! Every shard is on the one lifecycle of `shard::Life` (`life.rs`): in-memory shards are
//! open from their first use; log-backed ones open on their first request, close when no
//! longer served here, and fail.

use crate::cache::snapshot::Snapshot;
use crate::cache::{CacheError, CacheLimits, CacheShard, ChangeKind, Counters, Filter, ResumePlan};
use crate::core::cache_logs::{self, CacheLogs};
use crate::core::shard::{Ctx, Life, Refusal};
use crate::core::{CacheOrigin, Ev, MeshMsg, Opened, ShardKey, ToConn, WatchReq};
use crate::metrics::CoreCounters;
use bytes::Bytes;
use felix_quic::wire::{CacheFrame, ErrorCode, Frame, WatchStart};
use felix_storage::{Log, RecordIn};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

mod life;
mod ops;
pub(crate) use ops::event_frame;
use ops::{cache_code, cache_value, cond, counter_add, state_phase};

/// Expired keys reclaimed per shard per tick (the rest on the next tick).
const EXPIRE_BATCH: usize = 4096;

/// An expiry append the log refused (back-pressure) is not retried for this long.
const EXPIRE_RETRY_MS: u64 = 100;

/// What the host is configured with (from the broker's config).
#[derive(Debug, Clone)]
pub(crate) struct CacheHostCfg {
    pub limits: CacheLimits,
    /// Counters one shard may hold.
    pub counters_max: usize,
    /// The replay ring's bounds, per shard.
    pub replay_entries_max: usize,
    pub replay_bytes_max: u64,
    /// One expiry batch's bytes in the log (one commit must hold it).
    pub expire_batch_bytes_max: usize,
    /// A log-backed shard is compacted after this many appended records.
    pub compact_every: u64,
    /// The broker has a durable storage directory (log-backed shards can open).
    pub durable_dir: bool,
}

/// What the host asks its driver to do.
pub(crate) enum CacheEffect {
    /// A message to a core (an answer, a change, a watch's start or end).
    Send(u8, MeshMsg),
    /// Read the shard's log from `from` up to the replay ring's start for a resuming watch,
    /// then hand the events to `finish_log_replay`.
    ReplayLog {
        req: WatchReq,
        from: u64,
        epoch: u64,
        log: Log,
    },
    /// Write `snap` (once the records it covers are synced) and delete the segments below it.
    Compact {
        key: ShardKey,
        snap: Snapshot,
        cache: Log,
        counters: Log,
    },
    /// Open the logs of log-backed shard `key`, then `on_opened`.
    Open(ShardKey),
    /// Report the commits (`on_acked`) and the failure (`on_failed`) of the logs of shard
    /// `key`'s open number `epoch`.
    WatchCommits {
        key: ShardKey,
        epoch: u64,
        cache: Log,
        counters: Log,
    },
    /// Close the logs of a failed shard (nothing waits for them).
    CloseLogs(CacheLogs),
    /// Close the logs of a shard no longer served here (removing its directory if
    /// `remove`), then `on_closed` with the answers that waited for commits.
    Retire {
        key: ShardKey,
        logs: CacheLogs,
        pending: Vec<Pending>,
        remove: bool,
        why: Refusal,
    },
    /// Remove the directory of a deleted cache's shard that is not open here.
    RemoveDir(ShardKey),
    /// Handle these messages again, in order (they waited for an open or a close).
    Requeue(Vec<MeshMsg>),
}

/// An answer that waited for a commit: `(counter log, offset it waits for, origin, answer)`.
pub(crate) type Pending = (bool, u64, CacheOrigin, Frame);

/// A watch registered at the owner.
struct Reg {
    core: u8,
    watch: u64,
    filter: Filter,
}

/// One cache shard this core owns.
pub(crate) struct OwnedCache {
    shard: CacheShard,
    counters: Counters,
    ring: VecDeque<Arc<Ev>>,
    ring_bytes: u64,
    /// Lowest offset from which the ring still holds every change.
    replayable_from: u64,
    watches: Vec<Reg>,
    /// Log-backed shards: their logs, and answers waiting for commits (in offset order).
    pub(crate) logs: Option<CacheLogs>,
    pending: VecDeque<(u64, CacheOrigin, Frame)>,
    pending_counters: VecDeque<(u64, CacheOrigin, Frame)>,
    /// Records appended since the last snapshot was taken.
    since_snapshot: u64,
    compacting: bool,
    /// Which open of the key this is (its logs' commit watchers carry it).
    pub(crate) epoch: u64,
    /// Expiry appends refused (back-pressure): not retried before this wall-clock ms.
    expire_retry_at_ms: u64,
}

/// An answer that waits until its log's acknowledged offset reaches `upto`.
#[derive(Debug, Clone, Copy)]
struct Wait {
    counters: bool,
    upto: u64,
}

impl OwnedCache {
    fn new(shard: CacheShard, counters: Counters, logs: Option<CacheLogs>, epoch: u64) -> Self {
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

    fn with_logs(shard: CacheShard, counters: Counters, logs: CacheLogs, epoch: u64) -> Self {
        OwnedCache::new(shard, counters, Some(logs), epoch)
    }

    /// The state to snapshot, when a log-backed shard has appended `every` records since the
    /// last one and no compaction runs.
    fn snapshot_due(&mut self, every: u64) -> Option<Snapshot> {
        let logs = self.logs.as_ref()?;
        if self.compacting || self.since_snapshot < every {
            return None;
        }
        self.compacting = true;
        self.since_snapshot = 0;
        Some(Snapshot {
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
    fn take_committed(&mut self, counters: bool, acked: u64) -> Vec<(CacheOrigin, Frame)> {
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

    fn take_all_pending(&mut self) -> Vec<(CacheOrigin, Frame)> {
        self.pending
            .drain(..)
            .chain(self.pending_counters.drain(..))
            .map(|(_, o, f)| (o, f))
            .collect()
    }

    /// Every waiting answer: `(counter log, offset it waits for, origin, answer)`.
    fn take_pending_with_upto(&mut self) -> Vec<Pending> {
        let a = self.pending.drain(..).map(|(u, o, f)| (false, u, o, f));
        let b = self
            .pending_counters
            .drain(..)
            .map(|(u, o, f)| (true, u, o, f));
        a.chain(b).collect()
    }

    fn has_pending(&self) -> bool {
        !self.pending.is_empty() || !self.pending_counters.is_empty()
    }

    /// The cores with a watch whose filter `pick` takes.
    fn watch_cores(&self, pick: impl Fn(&Filter) -> bool) -> std::collections::BTreeSet<u8> {
        self.watches
            .iter()
            .filter(|r| pick(&r.filter))
            .map(|r| r.core)
            .collect()
    }

    /// Record a change in the replay ring (evicting past its bounds).
    fn record(&mut self, ev: Arc<Ev>, entries_max: usize, bytes_max: u64) {
        if let Some(last) = self.ring.back() {
            assert_eq!(last.offset + 1, ev.offset, "cache changes are contiguous");
        }
        self.ring_bytes += ev.frame.len() as u64;
        self.ring.push_back(ev);
        while self.ring.len() > entries_max || self.ring_bytes > bytes_max {
            let old = self
                .ring
                .pop_front()
                .expect("ring over its caps is not empty");
            self.ring_bytes -= old.frame.len() as u64;
            self.replayable_from = old.offset + 1;
        }
        debug_assert!(self
            .ring
            .front()
            .is_none_or(|e| e.offset == self.replayable_from));
    }
}

/// The cache shards one core owns.
pub(crate) struct CacheHost {
    cfg: CacheHostCfg,
    /// Every shard on the one lifecycle (`shard::Life`): in-memory shards are open from
    /// their first use; log-backed ones open, close and fail (`life.rs`).
    shards: BTreeMap<ShardKey, Life<OwnedCache, MeshMsg>>,
    /// Shutdown closes the logs: a log closing under a shard is not its failure.
    closing: bool,
    /// Opens of log-backed shards so far (each open's number tags its commit watchers).
    opens: u64,
    effects: Vec<CacheEffect>,
}

impl CacheHost {
    pub(crate) fn new(cfg: CacheHostCfg) -> Self {
        CacheHost {
            cfg,
            shards: BTreeMap::new(),
            closing: false,
            opens: 0,
            effects: Vec::new(),
        }
    }

    pub(crate) fn drain_effects(&mut self) -> Vec<CacheEffect> {
        std::mem::take(&mut self.effects)
    }

    fn send(&mut self, to: u8, msg: MeshMsg) {
        self.effects.push(CacheEffect::Send(to, msg));
    }

    fn reply(&mut self, origin: CacheOrigin, frame: Frame) {
        self.send(
            origin.core,
            MeshMsg::Conn(ToConn::CacheReply { origin, frame }),
        );
    }

    /// The open shard `key`.
    fn open(&self, key: ShardKey) -> Option<&OwnedCache> {
        match self.shards.get(&key) {
            Some(Life::Open(oc)) => Some(oc),
            _ => None,
        }
    }

    fn open_mut(&mut self, key: ShardKey) -> Option<&mut OwnedCache> {
        match self.shards.get_mut(&key) {
            Some(Life::Open(oc)) => Some(oc),
            _ => None,
        }
    }

    fn open_shards(&self) -> impl Iterator<Item = (&ShardKey, &OwnedCache)> {
        self.shards.iter().filter_map(|(k, l)| match l {
            Life::Open(oc) => Some((k, oc)),
            _ => None,
        })
    }

    /// Take open shard `key` out of the host (dropped, failed, or to retire).
    pub(crate) fn remove(&mut self, key: ShardKey) -> Option<OwnedCache> {
        match self.shards.remove(&key) {
            Some(Life::Open(oc)) => Some(oc),
            Some(other) => {
                self.shards.insert(key, other);
                None
            }
            None => None,
        }
    }

    /// No answer waits for a commit, and no log opens or closes.
    pub(crate) fn idle(&self) -> bool {
        self.shards.values().all(|l| match l {
            Life::Open(c) => !c.has_pending(),
            Life::Opening { .. } | Life::Closing { .. } => false,
            Life::Failed { .. } => true,
        })
    }

    /// The logs of the log-backed shards (closed at shutdown).
    pub(crate) fn logs(&self) -> Vec<Log> {
        self.open_shards()
            .filter_map(|(_, c)| c.logs.as_ref())
            .flat_map(|l| [l.cache.clone(), l.counters.clone()])
            .collect()
    }

    /// The shard, created in memory on its first use (a log-backed one is inserted once
    /// open). An in-memory shard's offsets start at `wall ms << 20`, so versions never repeat
    /// across restarts.
    fn owned(&mut self, key: ShardKey, ctx: &Ctx) -> &mut OwnedCache {
        debug_assert_eq!(ctx.cache_owner_core(key), ctx.me);
        let limits = self.cfg.limits.clone();
        let durable = ctx.catalog.cache_slot(key.0).def.durable;
        let life = self.shards.entry(key).or_insert_with(|| {
            assert!(!durable, "a log-backed cache shard is used only once open");
            let base = ctx.ts_ms << 20;
            Life::Open(OwnedCache::new(
                CacheShard::new(limits, base),
                Counters::new(base),
                None,
                0,
            ))
        });
        match life {
            Life::Open(oc) => oc,
            _ => unreachable!("requests reach a log-backed shard only once it is open (gate)"),
        }
    }

    // ---------- requests ----------

    /// A cache request at the owner: answered now, or (a log-backed write) once its record
    /// commits.
    pub(crate) fn on_req(
        &mut self,
        origin: CacheOrigin,
        cache: u32,
        shard: u32,
        frame: CacheFrame,
        ctx: &Ctx,
    ) {
        let reply = match ctx.catalog.cache_serve_check(cache, shard) {
            Err((code, msg)) => Frame::error(origin.request_id, code, msg),
            Ok(()) => match self.apply(origin.request_id, (cache, shard), frame, ctx) {
                (f, None) => f,
                (f, Some(wait)) => {
                    let oc = self.open_mut((cache, shard)).expect("applied on it");
                    oc.wait_for_commit(wait, origin, f);
                    oc.since_snapshot += 1;
                    self.maybe_compact((cache, shard));
                    return;
                }
            },
        };
        self.reply(origin, reply);
    }

    /// Apply one request; the answer now, or (log-backed writes) once its record commits.
    fn apply(
        &mut self,
        rid: u64,
        key: ShardKey,
        frame: CacheFrame,
        ctx: &Ctx,
    ) -> (Frame, Option<Wait>) {
        let now = ctx.ts_ms;
        let shard = key.1;
        let default_ttl = ctx.catalog.cache_slot(key.0).def.default_ttl_ms;
        let counters_max = self.cfg.counters_max;
        let oc = self.owned(key, ctx);
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
                return now_frame(cache_value(oc, rid, shard, &k, now));
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
                return counter_add(oc, rid, shard, name, delta, counters_max, now);
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
                    let Refusal { code, message: msg } = cache_logs::append_refusal(&e);
                    return now_frame(Frame::error(rid, code, msg));
                }
            }
        }
        oc.shard.apply(&change);
        debug_assert_eq!(oc.shard.next_offset(), change.offset + 1);
        let wait = oc.logs.as_ref().map(|_| Wait {
            counters: false,
            upto: change.offset + 1,
        });
        CoreCounters::inc(&ctx.counters.cache_writes);
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
        let (entries_max, bytes_max) = (self.cfg.replay_entries_max, self.cfg.replay_bytes_max);
        let oc = self.open_mut(key).expect("emit on an owned shard");
        oc.record(ev.clone(), entries_max, bytes_max);
        let cores = oc.watch_cores(|f| f.matches(&ev.key));
        self.send_to_cores(cores, || {
            MeshMsg::Conn(ToConn::CacheChange {
                cache: key.0,
                shard: key.1,
                ev: ev.clone(),
            })
        });
    }

    /// A snapshot is due for a log-backed shard: the driver writes it and compacts.
    fn maybe_compact(&mut self, key: ShardKey) {
        let every = self.cfg.compact_every;
        let Some(oc) = self.open_mut(key) else {
            return;
        };
        let Some(snap) = oc.snapshot_due(every) else {
            return;
        };
        let logs = oc.logs.as_ref().expect("a due snapshot has logs");
        let (cache, counters) = (logs.cache.clone(), logs.counters.clone());
        self.effects.push(CacheEffect::Compact {
            key,
            snap,
            cache,
            counters,
        });
    }

    /// The compaction of `key` finished (or gave up): another may start.
    pub(crate) fn compaction_done(&mut self, key: ShardKey) {
        if let Some(oc) = self.open_mut(key) {
            oc.compacting = false;
        }
    }

    /// A log of `key` (open number `epoch`) acknowledged up to `acked`: release the answers
    /// it covers.
    pub(crate) fn on_acked(&mut self, key: ShardKey, epoch: u64, counters: bool, acked: u64) {
        let Some(oc) = self.open_mut(key).filter(|c| c.epoch == epoch) else {
            return;
        };
        for (origin, frame) in oc.take_committed(counters, acked) {
            self.reply(origin, frame);
        }
    }

    /// Answer everything `oc` (taken out of the host) owes with `err`; with `notify`, end its
    /// watches on every core (a catalog change needs not: every core ends its own then).
    pub(crate) fn answer_dropped(
        &mut self,
        key: ShardKey,
        oc: &mut OwnedCache,
        err: Refusal,
        notify: bool,
    ) {
        for (origin, _) in oc.take_all_pending() {
            let frame = err.clone().frame(origin.request_id);
            self.reply(origin, frame);
        }
        if !notify {
            return;
        }
        let cores = oc.watch_cores(|_| true);
        self.send_to_cores(cores, || {
            MeshMsg::Conn(ToConn::WatchesEnded {
                cache: key.0,
                shard: key.1,
                why: err.clone(),
            })
        });
    }

    /// One message to each of `cores` (each once, in core order).
    fn send_to_cores(&mut self, cores: std::collections::BTreeSet<u8>, msg: impl Fn() -> MeshMsg) {
        for core in cores {
            self.send(core, msg());
        }
    }

    // ---------- watches ----------

    /// A watch asks for its start. A resume below the replay ring that the log still holds
    /// is read from the log first (`ReplayLog`).
    pub(crate) fn watch_open(&mut self, req: WatchReq, ctx: &Ctx) {
        if let WatchStart::Offset(from) = req.start {
            let key = (req.cache, req.shard);
            let served = ctx.catalog.cache_serve_check(req.cache, req.shard).is_ok();
            let from_log = self.open(key).filter(|_| served).and_then(|oc| {
                let l = oc.logs.as_ref()?;
                let below_ring = from < oc.replayable_from
                    && from >= l.cache.oldest_offset()
                    && from <= oc.shard.next_offset();
                below_ring.then(|| (oc.epoch, l.cache.clone()))
            });
            if let Some((epoch, log)) = from_log {
                self.effects.push(CacheEffect::ReplayLog {
                    req,
                    from,
                    epoch,
                    log,
                });
                return;
            }
        }
        let result = self.start_watch(&req, ctx);
        self.send(
            req.core,
            MeshMsg::Conn(ToConn::WatchOpened {
                watch: req.watch,
                result,
            }),
        );
    }

    /// Register the watch and compute its start in the same step (the changes after it go
    /// to its core from now on, so start and changes meet with no gap).
    fn start_watch(&mut self, req: &WatchReq, ctx: &Ctx) -> Result<Opened, Refusal> {
        ctx.catalog.cache_serve_check(req.cache, req.shard)?;
        let now = ctx.ts_ms;
        let oc = self.owned((req.cache, req.shard), ctx);
        let next = oc.shard.next_offset();
        let (state, replay) = match req.start {
            WatchStart::Latest => (None, Vec::new()),
            WatchStart::Current => (Some(false), Vec::new()),
            WatchStart::Offset(from) => {
                match crate::cache::plan_resume(from, oc.replayable_from, next) {
                    ResumePlan::BeyondTail { next_offset } => {
                        return Err(Refusal::new(
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
            Some(snapshot) => Some(state_phase(oc, req, snapshot, now)?),
        };
        oc.watches.push(Reg {
            core: req.core,
            watch: req.watch,
            filter: req.filter.clone(),
        });
        #[cfg(test)]
        let next = next + u64::from(state.is_none() && breaks::on(&breaks::GAP_AT_JOIN));
        Ok(Opened {
            shard: req.shard,
            live_from: next,
            resume_from,
            truncated_at: None,
            state,
            replay,
        })
    }

    /// Finish a log replay if the ring now covers everything from `at` (or the replay is cut
    /// short), registering the watch and answering it; else the ring start to read up to.
    pub(crate) fn finish_log_replay(
        &mut self,
        req: &WatchReq,
        epoch: u64,
        events: &mut Vec<Arc<Ev>>,
        at: u64,
        truncated: Option<u64>,
        ctx: &Ctx,
    ) -> Option<u64> {
        let key = (req.cache, req.shard);
        let served = ctx.catalog.cache_serve_check(req.cache, req.shard);
        let result = match (served, self.open_mut(key)) {
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
        }
        .map_err(Refusal::from);
        self.send(
            req.core,
            MeshMsg::Conn(ToConn::WatchOpened {
                watch: req.watch,
                result,
            }),
        );
        None
    }

    pub(crate) fn watch_close(&mut self, watch: u64, key: ShardKey) {
        if let Some(oc) = self.open_mut(key) {
            oc.watches.retain(|r| r.watch != watch);
        }
    }

    // ---------- the TTL clock ----------

    /// The wall-clock ms at which the host must next reclaim expired keys, if any key expires.
    pub(crate) fn next_expiry_ms(&self) -> Option<u64> {
        self.open_shards()
            .filter_map(|(_, c)| {
                c.shard
                    .next_expiry_ms()
                    .map(|t| t.max(c.expire_retry_at_ms))
            })
            .min()
    }

    /// Reclaim expired keys of the owned shards (each an Expire change watches see).
    pub(crate) fn tick(&mut self, ctx: &Ctx) {
        let now = ctx.ts_ms;
        let due: Vec<ShardKey> = self
            .open_shards()
            .filter(|(_, c)| {
                c.expire_retry_at_ms <= now && c.shard.next_expiry_ms().is_some_and(|t| t <= now)
            })
            .map(|(k, _)| *k)
            .collect();
        for key in due {
            let batch_bytes_max = self.cfg.expire_batch_bytes_max;
            let oc = self.open_mut(key).expect("due shard is owned");
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
                        oc.expire_retry_at_ms = now + EXPIRE_RETRY_MS;
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
            CoreCounters::add(&ctx.counters.cache_expired, changes.len() as u64);
            for ch in changes {
                self.emit(key, ch.offset, ch.key, &ch.kind);
            }
        }
    }
}

/// Test-build switches that break one rule each, so the simulator's negative twins show its
/// checks catch the break (`core/sim`).
#[cfg(test)]
pub(crate) mod breaks {
    use std::sync::atomic::AtomicBool;
    /// A watch without a state phase goes live one offset late: the change at its join is
    /// neither in its start nor among its changes (the gap a watch must never have).
    pub(crate) static GAP_AT_JOIN: AtomicBool = AtomicBool::new(false);
    /// A state phase leaves out one retained value (and counts what it sent).
    pub(crate) static STATE_DROPS_ONE: AtomicBool = AtomicBool::new(false);

    pub(crate) use crate::core::shard::stream::breaks::on;
}

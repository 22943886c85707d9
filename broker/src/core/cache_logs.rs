//! Log-backed caches: each shard of a `durable: true` cache keeps two felix-storage logs
//! under `<durable_storage_dir>/@caches/<tenant>/<namespace>/<cache>[@incarnation]/<shard>/`
//! (`@` is outside the name charset, so no tenant collides with it): `log`, one record per
//! applied change (the codec of [`crate::cache::record`]: key = cache key, flags = kind,
//! payload = expiry + value), and `counters`, one record per counter delta (key = name,
//! payload = delta i64 LE).
//!
//! - The shard opens on the owner core on its first request; requests and watch opens that
//!   arrive meanwhile wait in order. Opening loads `keys.idx` (the state at an offset, see
//!   [`crate::cache::snapshot`]) when there is one and replays both logs from there.
//! - Compaction: every `cache_compact_records` appended records the owner writes a new
//!   `keys.idx` (after the records it covers are synced: temp file, fdatasync, rename,
//!   directory fsync) and then deletes the sealed segments wholly below it. Offsets are never
//!   renumbered; the logs' oldest offsets move up. A snapshot that cannot be read while the
//!   log below it is gone refuses the shard (`unavailable`) rather than serving a partial
//!   state.
//! - A write is checked against the state, appended, then applied; its answer waits for the
//!   commit under the broker's fsync mode (`durable_fsync`), as an acked publish does.
//!   Watches see a change when it is applied (before its commit).
//! - A device error fails the shard: the answers waiting for a commit get `unavailable`,
//!   its watches end `unavailable`, later requests are refused until the broker restarts.

use super::shard::caches::Pending;
use super::*;
use crate::cache::snapshot::{self, Snapshot};
use crate::cache::{record, CacheLimits, CacheShard, Counters};
use bytes::Bytes;
use std::path::PathBuf;

/// Give the spawning code its borrow back: glommio polls a task spawned with `spawn_local`
/// at once, so a task that borrows the core state must first return to the executor.
pub(super) async fn yield_once() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            std::task::Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            std::task::Poll::Pending
        }
    })
    .await
}

/// The snapshot file of a shard (beside its two log directories).
pub const SNAPSHOT_FILE: &str = "keys.idx";

/// The directory of one shard of a log-backed cache.
pub fn cache_shard_dir(
    root: &std::path::Path,
    name: &felix_quic::wire::StreamName,
    incarnation: u64,
    shard: u32,
) -> PathBuf {
    stream_dir(&root.join("@caches"), name, incarnation).join(format!("{shard:05}"))
}

/// A shard's two logs.
pub(crate) struct CacheLogs {
    pub cache: Log,
    pub counters: Log,
}

/// What opening a shard needs, taken off the core state.
pub(super) struct CacheOpenJob {
    dir: PathBuf,
    config: LogConfig,
    limits: CacheLimits,
}

pub(super) type CacheOpenResult = Result<(CacheLogs, CacheShard, Counters), String>;

/// Records read per replay step (bounded memory while opening).
const REPLAY_RECORDS: usize = 4096;
const REPLAY_BYTES: usize = 4 << 20;

impl CacheOpenJob {
    pub(super) async fn run(self) -> CacheOpenResult {
        let (cache, _) = Log::open(&self.dir.join("log"), self.config.clone())
            .await
            .map_err(|e| format!("cache log: {e}"))?;
        let counters = match Log::open(&self.dir.join("counters"), self.config.clone()).await {
            Ok((l, _)) => l,
            Err(e) => {
                let _ = cache.close().await;
                return Err(format!("counter log: {e}"));
            }
        };
        match self.load(&cache, &counters).await {
            Ok((shard, sums)) => Ok((CacheLogs { cache, counters }, shard, sums)),
            Err(e) => {
                // Stop the logs' tasks: nothing of a refused shard keeps running.
                let _ = cache.close().await;
                let _ = counters.close().await;
                Err(e)
            }
        }
    }

    /// The state: `keys.idx` if usable, then both logs replayed from it.
    async fn load(&self, cache: &Log, counters: &Log) -> Result<(CacheShard, Counters), String> {
        let path = self.dir.join(SNAPSHOT_FILE);
        let read = glommio::executor()
            .spawn_blocking(move || std::fs::read(path))
            .await;
        let snap = match read {
            Ok(b) => Some(snapshot::decode(&Bytes::from(b))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(format!("{SNAPSHOT_FILE}: {e}")),
        };
        let compacted = cache.oldest_offset() > 0 || counters.oldest_offset() > 0;
        let usable = |s: &Snapshot| -> Result<(), String> {
            if s.cache_log_id != cache.log_id() || s.counter_log_id != counters.log_id() {
                return Err("it belongs to other logs".into());
            }
            let fits = |at: u64, log: &Log| at >= log.oldest_offset() && at <= log.next_offset();
            if !fits(s.cache_next, cache) || !fits(s.counters_next, counters) {
                return Err(format!(
                    "it covers offsets below {} / {} but the logs hold {}..{} / {}..{}",
                    s.cache_next,
                    s.counters_next,
                    cache.oldest_offset(),
                    cache.next_offset(),
                    counters.oldest_offset(),
                    counters.next_offset()
                ));
            }
            Ok(())
        };
        let snap = match snap {
            Some(Ok(s)) => match usable(&s) {
                Ok(()) => Some(s),
                Err(why) if !compacted => {
                    tracing::warn!(dir = %self.dir.display(), %why, "ignoring keys.idx: replaying the whole log");
                    None
                }
                Err(why) => return Err(format!("{SNAPSHOT_FILE} cannot be used ({why}) and the log below it was compacted away")),
            },
            Some(Err(e)) if !compacted => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "ignoring an unreadable keys.idx: replaying the whole log");
                None
            }
            Some(Err(e)) => return Err(format!("{SNAPSHOT_FILE}: {e}; the log below it was compacted away")),
            None if compacted => {
                return Err(format!(
                    "the logs start at offsets {} / {} (compacted) but there is no {SNAPSHOT_FILE}",
                    cache.oldest_offset(),
                    counters.oldest_offset()
                ))
            }
            None => None,
        };
        let (mut shard, mut at, mut sums, counters_from) = match snap {
            Some(s) => (
                CacheShard::restore(self.limits.clone(), s.entries, s.cache_next),
                s.cache_next,
                Counters::restore(s.counters, s.counters_next),
                s.counters_next,
            ),
            None => (
                CacheShard::new(self.limits.clone(), cache.oldest_offset()),
                cache.oldest_offset(),
                Counters::new(counters.oldest_offset()),
                counters.oldest_offset(),
            ),
        };
        while at < cache.next_offset() {
            let recs = cache
                .read(at, REPLAY_RECORDS, REPLAY_BYTES)
                .await
                .map_err(|e| format!("cache log replay at {at}: {e}"))?;
            if recs.is_empty() {
                return Err(format!("cache log replay at {at}: no record"));
            }
            for r in recs {
                let c = record::decode(r.offset, r.key, r.flags, r.payload)
                    .map_err(|e| format!("cache log record {}: {e}", r.offset))?;
                if c.offset < shard.next_offset() {
                    return Err(format!(
                        "cache log record {} is below the replayed state's next offset {}",
                        c.offset,
                        shard.next_offset()
                    ));
                }
                shard.advance_to(c.offset);
                shard.apply(&c);
                at = c.offset + 1;
            }
        }
        shard.advance_to(cache.next_offset());
        let mut at = counters_from;
        while at < counters.next_offset() {
            let recs = counters
                .read(at, REPLAY_RECORDS, REPLAY_BYTES)
                .await
                .map_err(|e| format!("counter log replay at {at}: {e}"))?;
            if recs.is_empty() {
                return Err(format!("counter log replay at {at}: no record"));
            }
            for r in recs {
                let delta: [u8; 8] = r.payload[..].try_into().map_err(|_| {
                    format!(
                        "counter log record {}: payload of {} bytes is no i64",
                        r.offset,
                        r.payload.len()
                    )
                })?;
                if r.offset != sums.next_offset() || r.key.is_empty() {
                    return Err(format!(
                        "counter log record {}: out of order or unnamed",
                        r.offset
                    ));
                }
                sums.apply(r.offset, r.key, i64::from_le_bytes(delta));
                at = r.offset + 1;
            }
        }
        Ok((shard, sums))
    }
}

/// The refusal for an append the log did not take.
pub(crate) fn append_refusal(e: &LogError) -> Refusal {
    match e {
        LogError::Backpressure { .. } => Refusal::new(
            ErrorCode::InflightLimit,
            format!("the cache shard's write queue is full: {e}"),
        ),
        LogError::TooLarge { .. } => Refusal::new(ErrorCode::PayloadTooLarge, e.to_string()),
        _ => Refusal::new(ErrorCode::Unavailable, format!("cache shard storage: {e}")),
    }
}

impl CoreState {
    /// Open the logs of log-backed cache shard `key` off the core state; the host learns
    /// the outcome (`on_opened`).
    pub(super) fn open_cache_shard(&mut self, key: ShardKey) {
        let Some(root) = self.s.cfg.durable_storage_dir.clone() else {
            let r = Err("no durable_storage_dir on this broker".to_string());
            return self.with_caches(|h, ctx| h.on_opened(key, r, ctx));
        };
        let slot = self.catalog.cache_slot(key.0);
        let job = CacheOpenJob {
            dir: cache_shard_dir(&root, &slot.def.name(), slot.incarnation, key.1),
            config: self.observed(self.cache_log_config()),
            limits: self.cache_limits(),
        };
        let me = self.me.clone();
        glommio::spawn_local(async move {
            yield_once().await;
            let r = job.run().await;
            reenter(&me, |st| st.with_caches(|h, ctx| h.on_opened(key, r, ctx)));
        })
        .detach();
    }

    /// Follow the two logs of open number `epoch` of shard `key`: their commits release
    /// answers, their failure fails the shard. `epoch` names the open the logs belong to: a
    /// watcher of logs closed for a dropped shard never touches a newer one on the same key.
    pub(super) fn watch_cache_commits(&mut self, key: ShardKey, epoch: u64, logs: [Log; 2]) {
        for (log, counters) in logs.into_iter().zip([false, true]) {
            let seen = log.acked();
            glommio::spawn_local(super::durable::watch_commits(
                self.me.clone(),
                log,
                seen,
                move |st, acked| st.with_caches(|h, _| h.on_acked(key, epoch, counters, acked)),
                move |st, why| st.with_caches(|h, ctx| h.on_failed(key, epoch, why, ctx)),
            ))
            .detach();
        }
    }

    /// Close the logs of a failed shard.
    pub(super) fn close_cache_logs(&mut self, logs: CacheLogs) {
        glommio::spawn_local(async move {
            let _ = logs.cache.close().await;
            let _ = logs.counters.close().await;
        })
        .detach();
    }

    /// Close a retired shard's logs (which commits what was appended), remove its directory
    /// if the cache was deleted, then tell the host (`on_closed`).
    pub(super) fn retire_cache_logs(
        &mut self,
        key: ShardKey,
        logs: CacheLogs,
        pending: Vec<Pending>,
        remove: bool,
        why: Refusal,
    ) {
        let slot = self.catalog.cache_slot(key.0).clone();
        let dir = match (&self.s.cfg.durable_storage_dir, remove) {
            (Some(root), true) => Some(cache_shard_dir(
                root,
                &slot.def.name(),
                slot.incarnation,
                key.1,
            )),
            _ => None,
        };
        let me = self.me.clone();
        glommio::spawn_local(async move {
            yield_once().await;
            let _ = logs.cache.close().await;
            let _ = logs.counters.close().await;
            let acked = (logs.cache.acked(), logs.counters.acked());
            let removed = dir.is_some();
            if let Some(d) = dir {
                let _ = glommio::executor()
                    .spawn_blocking(move || super::durable::remove_shard_dir(&d))
                    .await;
            }
            reenter(&me, |st| {
                st.with_caches(|h, _| h.on_closed(key, pending, acked, removed, why))
            });
        })
        .detach();
    }

    /// Remove the logs of a deleted cache's shard this core owns that is not open here (never
    /// opened since the start, or failed).
    pub(super) fn remove_cache_dir(&mut self, key: ShardKey) {
        let Some(root) = self.s.cfg.durable_storage_dir.clone() else {
            return;
        };
        let slot = self.catalog.cache_slot(key.0);
        let dir = cache_shard_dir(&root, &slot.def.name(), slot.incarnation, key.1);
        glommio::spawn_local(async move {
            let _ = glommio::executor()
                .spawn_blocking(move || super::durable::remove_shard_dir(&dir))
                .await;
        })
        .detach();
    }

    fn cache_log_config(&self) -> LogConfig {
        let cfg = &self.s.cfg;
        LogConfig {
            segment_bytes_max: cfg.durable_segment_bytes,
            commit_bytes_max: commit_bytes_max(cfg),
            pending_bytes_max: cfg.durable_pending_bytes_max.max(commit_bytes_max(cfg)),
            fsync: FsyncMode::parse(&cfg.durable_fsync, cfg.durable_fsync_interval_ms)
                .expect("validated at start"),
            inline_write_slow_us: cfg.durable_inline_write_slow_us,
            ..LogConfig::default()
        }
    }

    /// Write a snapshot of the shard and delete the log segments it covers (the host found
    /// one due: `cache_compact_records` records appended since the last).
    pub(super) fn compact_cache(&mut self, key: ShardKey, snap: Snapshot, clog: Log, nlog: Log) {
        let Some(root) = self.s.cfg.durable_storage_dir.clone() else {
            return self.caches.compaction_done(key);
        };
        let slot = self.catalog.cache_slot(key.0);
        let dir = cache_shard_dir(&root, &slot.def.name(), slot.incarnation, key.1);
        let me = self.me.clone();
        glommio::spawn_local(async move {
            yield_once().await;
            let r = compact(dir, clog, nlog, snap).await;
            reenter(&me, |st| st.on_compacted(key, r));
        })
        .detach();
    }

    fn on_compacted(&mut self, key: ShardKey, r: Result<usize, String>) {
        self.caches.compaction_done(key);
        match r {
            Ok(deleted) => {
                CoreCounters::inc(&self.s.counters.cache_compactions);
                CoreCounters::add(&self.s.counters.cache_segments_compacted, deleted as u64);
            }
            // Nothing was deleted without its snapshot on disk; a failing log fails the
            // shard through its commit watcher.
            Err(why) => {
                tracing::warn!(cache = key.0, shard = key.1, %why, "cache compaction did not finish")
            }
        }
    }

    /// The logs of log-backed shards this core holds (closed at shutdown).
    pub(super) fn cache_logs(&self) -> Vec<Log> {
        self.caches.logs()
    }
}

/// Snapshot (after every record it covers is synced), then delete the segments below it.
async fn compact(dir: PathBuf, cache: Log, counters: Log, snap: Snapshot) -> Result<usize, String> {
    let e = |w: &str, x: LogError| format!("{w}: {x}");
    cache
        .wait_acked(snap.cache_next)
        .await
        .map_err(|x| e("cache log", x))?;
    cache.sync_now().await.map_err(|x| e("cache log", x))?;
    counters
        .wait_acked(snap.counters_next)
        .await
        .map_err(|x| e("counter log", x))?;
    counters.sync_now().await.map_err(|x| e("counter log", x))?;
    let bytes = snapshot::encode(&snap);
    let d = dir.clone();
    glommio::executor()
        .spawn_blocking(move || write_snapshot(&d, &bytes))
        .await
        .map_err(|x| format!("{SNAPSHOT_FILE}: {x}"))?;
    let a = cache.delete_below(snap.cache_next).await;
    let b = counters.delete_below(snap.counters_next).await;
    Ok(a + b)
}

/// `dir/keys.idx`: temporary file, fdatasync, rename, directory fsync.
fn write_snapshot(dir: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    super::durable::atomic_write(dir, SNAPSHOT_FILE, bytes)
}

//! Log-backed caches: each shard of a `durable: true` cache keeps two felix-storage logs
//! under `<durable_storage_dir>/@caches/<tenant>/<namespace>/<cache>[@incarnation]/<shard>/`
//! (`@` is outside the name charset, so no tenant collides with it): `log`, one record per
//! applied change (the codec of [`crate::cache::record`]: key = cache key, flags = kind,
//! payload = expiry + value), and `counters`, one record per counter delta (key = name,
//! payload = delta i64 LE).
//!
//! - The shard opens on the owner core on its first request; requests and watch opens that
//!   arrive meanwhile wait in order. Opening replays both logs into the pure state (every
//!   record; there is no key index snapshot or compaction yet, so open time and disk grow
//!   with the number of writes, not the number of keys).
//! - A write is checked against the state, appended, then applied; its answer waits for the
//!   commit under the broker's fsync mode (`durable_fsync`), as an acked publish does.
//!   Watches see a change when it is applied (before its commit).
//! - A device error fails the shard: the answers waiting for a commit get `unavailable`,
//!   its watches end `unavailable`, later requests are refused until the broker restarts.

use super::caches::OwnedCache;
use super::*;
use crate::cache::{record, CacheLimits, CacheShard, Counters};
use std::path::PathBuf;

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
pub(super) struct CacheLogs {
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
        let (counters, _) = Log::open(&self.dir.join("counters"), self.config)
            .await
            .map_err(|e| format!("counter log: {e}"))?;
        let mut shard = CacheShard::new(self.limits, cache.oldest_offset());
        let mut at = cache.oldest_offset();
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
                if c.offset > shard.next_offset() {
                    shard.advance_to(c.offset);
                }
                shard.apply(&c);
                at = c.offset + 1;
            }
        }
        shard.advance_to(cache.next_offset());
        let mut sums = Counters::new(counters.oldest_offset());
        let mut at = counters.oldest_offset();
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
        Ok((CacheLogs { cache, counters }, shard, sums))
    }
}

/// Answer writes as their commits complete; fail the shard on a device error.
async fn cache_commit_watcher(
    state: Weak<RefCell<CoreState>>,
    key: ShardKey,
    log: Log,
    counters: bool,
) {
    let mut seen = log.acked();
    loop {
        let r = log.wait_acked_beyond(seen).await;
        let Some(st) = state.upgrade() else { return };
        let mut st = st.borrow_mut();
        match r {
            Ok(acked) => {
                seen = acked;
                st.on_cache_acked(key, counters, acked);
            }
            Err(e) => {
                st.on_cache_failed(key, e.to_string());
                st.drain_inbox();
                st.wake.wake();
                return;
            }
        }
        st.drain_inbox();
        st.wake.wake();
    }
}

/// The refusal for an append the log did not take.
pub(super) fn append_refusal(e: &LogError) -> (ErrorCode, String) {
    match e {
        LogError::Backpressure { .. } => (
            ErrorCode::InflightLimit,
            format!("the cache shard's write queue is full: {e}"),
        ),
        LogError::TooLarge { .. } => (ErrorCode::PayloadTooLarge, e.to_string()),
        _ => (ErrorCode::Unavailable, format!("cache shard storage: {e}")),
    }
}

impl CoreState {
    fn cache_is_durable(&self, cache: u32) -> bool {
        self.catalog.cache_slot(cache).def.durable
    }

    /// Hold a message for a log-backed shard until its logs are open (opening them on the
    /// first one); answer it at once when the shard failed. `None`: held or answered.
    pub(super) fn cache_gate(&mut self, msg: MeshMsg) -> Option<MeshMsg> {
        let key = match &msg {
            MeshMsg::CacheReq { cache, shard, .. } => (*cache, *shard),
            MeshMsg::WatchOpen(r) => (r.cache, r.shard),
            MeshMsg::WatchClose { cache, shard, .. } => (*cache, *shard),
            _ => return Some(msg),
        };
        if self.caches.contains_key(&key)
            || !self.cache_is_durable(key.0)
            || self.catalog.cache_serve_check(key.0, key.1).is_err()
        {
            return Some(msg); // served, in memory, or refused by the handler
        }
        if let Some(why) = self.cache_failed.get(&key).cloned() {
            let err = (ErrorCode::Unavailable, format!("cache shard failed: {why}"));
            match msg {
                MeshMsg::CacheReq { origin, .. } => {
                    let frame = Frame::error(origin.request_id, err.0, err.1);
                    self.route(origin.core, MeshMsg::CacheReply { origin, frame });
                }
                MeshMsg::WatchOpen(r) => self.route(
                    r.core,
                    MeshMsg::WatchOpened {
                        watch: r.watch,
                        result: Err(err),
                    },
                ),
                _ => {}
            }
            return None;
        }
        if let Some(q) = self.cache_opening.get_mut(&key) {
            q.push(msg);
            return None;
        }
        if matches!(msg, MeshMsg::WatchClose { .. }) {
            return None; // nothing registered on a shard never opened
        }
        let Some(root) = self.s.cfg.durable_storage_dir.clone() else {
            return Some(msg); // refused by the connection core already; be safe
        };
        self.cache_opening.insert(key, vec![msg]);
        let slot = self.catalog.cache_slot(key.0);
        let job = CacheOpenJob {
            dir: cache_shard_dir(&root, &slot.def.name(), slot.incarnation, key.1),
            config: self.cache_log_config(),
            limits: self.cache_limits(),
        };
        let me = self.me.clone();
        glommio::spawn_local(async move {
            let r = job.run().await;
            if let Some(st) = me.upgrade() {
                let mut st = st.borrow_mut();
                st.on_cache_opened(key, r);
                st.drain_inbox();
                st.wake.wake();
            }
        })
        .detach();
        None
    }

    fn cache_log_config(&self) -> LogConfig {
        let cfg = &self.s.cfg;
        LogConfig {
            segment_bytes_max: cfg.durable_segment_bytes,
            commit_bytes_max: commit_bytes_max(cfg),
            pending_bytes_max: cfg.durable_pending_bytes_max.max(commit_bytes_max(cfg)),
            fsync: FsyncMode::parse(&cfg.durable_fsync, cfg.durable_fsync_interval_ms)
                .expect("validated at start"),
            ..LogConfig::default()
        }
    }

    fn on_cache_opened(&mut self, key: ShardKey, r: CacheOpenResult) {
        let held = self.cache_opening.remove(&key).unwrap_or_default();
        let still_served = self.catalog.cache_serve_check(key.0, key.1).is_ok();
        match r {
            Ok((logs, shard, counters)) if still_served => {
                let me = self.me.clone();
                glommio::spawn_local(cache_commit_watcher(
                    me.clone(),
                    key,
                    logs.cache.clone(),
                    false,
                ))
                .detach();
                glommio::spawn_local(cache_commit_watcher(me, key, logs.counters.clone(), true))
                    .detach();
                self.caches
                    .insert(key, OwnedCache::with_logs(shard, counters, logs));
            }
            Ok((logs, _, _)) => close_logs(logs),
            Err(why) => {
                tracing::error!(cache = key.0, shard = key.1, %why, "cache shard cannot open");
                CoreCounters::inc(&self.s.counters.durable_shards_failed);
                self.cache_failed.insert(key, why);
            }
        }
        for msg in held {
            self.on_mesh(msg);
        }
    }

    fn on_cache_acked(&mut self, key: ShardKey, counters: bool, acked: u64) {
        let Some(oc) = self.caches.get_mut(&key) else {
            return;
        };
        for (origin, frame) in oc.take_committed(counters, acked) {
            self.route(origin.core, MeshMsg::CacheReply { origin, frame });
        }
    }

    /// A device error (or the log closed under it): answer what waited, end the watches,
    /// refuse what comes later.
    pub(super) fn on_cache_failed(&mut self, key: ShardKey, why: String) {
        let Some(mut oc) = self.caches.remove(&key) else {
            return; // dropped already (deleted, moved, shutting down)
        };
        tracing::error!(cache = key.0, shard = key.1, %why, "cache shard failed");
        CoreCounters::inc(&self.s.counters.durable_shards_failed);
        let err = (ErrorCode::Unavailable, format!("cache shard failed: {why}"));
        self.drop_owned_cache(key, &mut oc, err.clone());
        if let Some(logs) = oc.logs.take() {
            close_logs(logs);
        }
        self.cache_failed.insert(key, why);
    }

    /// Answer everything `oc` owes with `err` and end its watches on every core.
    pub(super) fn drop_owned_cache(
        &mut self,
        key: ShardKey,
        oc: &mut OwnedCache,
        err: (ErrorCode, String),
    ) {
        for (origin, _) in oc.take_all_pending() {
            let frame = Frame::error(origin.request_id, err.0, err.1.clone());
            self.route(origin.core, MeshMsg::CacheReply { origin, frame });
        }
        let mut cores = vec![false; self.s.cores as usize];
        for core in oc.watch_cores() {
            cores[core as usize] = true;
        }
        for (core, yes) in cores.into_iter().enumerate() {
            if yes {
                self.route(
                    core as u8,
                    MeshMsg::WatchesEnded {
                        cache: key.0,
                        shard: key.1,
                        code: err.0,
                        message: err.1.clone(),
                    },
                );
            }
        }
    }

    /// The logs of log-backed shards this core holds (closed at shutdown).
    pub(super) fn cache_logs(&self) -> Vec<Log> {
        self.caches
            .values()
            .filter_map(|c| c.logs.as_ref())
            .flat_map(|l| [l.cache.clone(), l.counters.clone()])
            .collect()
    }
}

/// Close a shard's logs off the hot path.
pub(super) fn close_logs(logs: CacheLogs) {
    glommio::spawn_local(async move {
        let _ = logs.cache.close().await;
        let _ = logs.counters.close().await;
    })
    .detach();
}

/// Close a deleted cache shard's logs and remove its directory.
pub(super) fn remove_cache_shard(logs: Option<CacheLogs>, dir: Option<PathBuf>) {
    glommio::spawn_local(async move {
        if let Some(l) = logs {
            let _ = l.cache.close().await;
            let _ = l.counters.close().await;
        }
        if let Some(dir) = dir {
            if let Err(e) = std::fs::remove_dir_all(&dir) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot remove a deleted cache shard's logs");
                }
            }
            if let Some(parent) = dir.parent() {
                let _ = std::fs::remove_dir(parent);
            }
        }
    })
    .detach();
}

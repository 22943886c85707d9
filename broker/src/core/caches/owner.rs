//! The driver of the owner side of cache shards (`shard::caches`, pure): the host stepped
//! with this core's context, its messages routed, and its I/O carried out: a resuming
//! watch's read of the log below the replay ring, and compactions.

use super::*;
use crate::core::owner::step_ctx;
use crate::core::shard::caches::{event_frame, CacheEffect, CacheHost, CacheHostCfg};
use crate::core::shard::Ctx;

impl CacheHostCfg {
    pub(in crate::core) fn of(cfg: &Config) -> Self {
        CacheHostCfg {
            limits: CacheLimits {
                key_bytes_max: cfg.cache_key_bytes_max as usize,
                value_bytes_max: cfg.max_payload_bytes as usize,
                entries_max: cfg.cache_entries_max as usize,
                bytes_max: cfg.cache_bytes_max,
            },
            counters_max: cfg.cache_entries_max as usize,
            replay_entries_max: cfg.cache_replay_entries_max as usize,
            replay_bytes_max: cfg.cache_replay_bytes_max,
            // One commit must hold an expiry batch: stay well under the log's commit bound.
            expire_batch_bytes_max: commit_bytes_max(cfg) / 2,
            compact_every: cfg.cache_compact_records,
            durable_dir: cfg.durable_storage_dir.is_some(),
        }
    }
}

impl CoreState {
    /// Run `f` on the cache host with this core's context, then carry out its effects.
    pub(in crate::core) fn with_caches<R>(
        &mut self,
        f: impl FnOnce(&mut CacheHost, &Ctx) -> R,
    ) -> R {
        let ctx = step_ctx(self.id, &self.s, &self.catalog);
        let r = f(&mut self.caches, &ctx);
        for e in self.caches.drain_effects() {
            match e {
                CacheEffect::Send(to, msg) => self.route(to, msg),
                CacheEffect::ReplayLog {
                    req,
                    from,
                    epoch,
                    log,
                } => self.replay_log(req, from, epoch, log),
                CacheEffect::Compact {
                    key,
                    snap,
                    cache,
                    counters,
                } => self.compact_cache(key, snap, cache, counters),
                CacheEffect::Open(key) => self.open_cache_shard(key),
                CacheEffect::WatchCommits {
                    key,
                    epoch,
                    cache,
                    counters,
                } => self.watch_cache_commits(key, epoch, [cache, counters]),
                CacheEffect::CloseLogs(logs) => self.close_cache_logs(logs),
                CacheEffect::Retire {
                    key,
                    logs,
                    pending,
                    remove,
                    why,
                } => self.retire_cache_logs(key, logs, pending, remove, why),
                CacheEffect::RemoveDir(key) => self.remove_cache_dir(key),
                CacheEffect::Requeue(msgs) => {
                    for m in msgs {
                        self.on_mesh(m);
                    }
                }
            }
        }
        r
    }

    pub(in crate::core) fn on_cache_req(
        &mut self,
        origin: CacheOrigin,
        cache: u32,
        shard: u32,
        frame: CacheFrame,
    ) {
        self.with_caches(|h, ctx| h.on_req(origin, cache, shard, frame, ctx));
    }

    pub(in crate::core) fn on_watch_open(&mut self, req: WatchReq) {
        self.with_caches(|h, ctx| h.watch_open(req, ctx));
    }

    pub(in crate::core) fn on_watch_close(&mut self, watch: u64, cache: u32, shard: u32) {
        self.caches.watch_close(watch, (cache, shard));
    }

    /// When the owner must next reclaim expired keys, if any key expires.
    pub(in crate::core) fn cache_timeout(&self) -> Option<Duration> {
        let t = self.caches.next_expiry_ms()?;
        Some(Duration::from_millis(
            t.saturating_sub(felix_storage::log::now_ms()),
        ))
    }

    /// Reclaim expired keys of the owned shards.
    pub(in crate::core) fn caches_tick(&mut self) {
        self.with_caches(|h, ctx| h.tick(ctx));
    }

    /// Read `[from, ring start)` from the shard's log (the ring start may move while it
    /// reads: read on until the ring covers the rest), then the host registers the watch and
    /// sends its replay (log part, then ring part) in one step, so it joins live with no gap.
    /// A replay past the watch's bound stops there and the watch ends lagged at that offset.
    fn replay_log(&mut self, req: WatchReq, from: u64, epoch: u64, log: Log) {
        let me = self.me.clone();
        glommio::spawn_local(async move {
            cache_logs::yield_once().await; // the caller holds the state
            let mut events: Vec<Arc<Ev>> = Vec::new();
            let (mut at, mut bytes, mut truncated) = (from, 0u64, None);
            loop {
                let need = {
                    let Some(st) = me.upgrade() else { return };
                    let mut st = st.borrow_mut();
                    let need = st.with_caches(|h, ctx| {
                        h.finish_log_replay(&req, epoch, &mut events, at, truncated, ctx)
                    });
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
                        let opened = MeshMsg::Conn(ToConn::WatchOpened {
                            watch: req.watch,
                            result: Err(err.into()),
                        });
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
}

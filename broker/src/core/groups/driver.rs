//! The driver of the consumer-group host (`shard::groups`, pure): the host stepped with this
//! core's context and its stream host, and its I/O carried out: claimed payloads read from
//! the log, group directories created, group files written whole and removed on the
//! blocking pool. Each outcome goes back to the host.

use super::*;
use crate::core::owner::step_ctx;
use crate::core::shard::groups::{GroupEffect, GroupHost, GroupHostCfg, Payload};
use crate::core::shard::stream::StreamHost;
use crate::core::shard::Ctx;

impl GroupHostCfg {
    pub(in crate::core) fn of(cfg: &Config) -> Self {
        GroupHostCfg {
            poll_wait_max_ms: cfg.group_poll_wait_max_ms,
            poll_waiters_max: cfg.group_poll_waiters_max as usize,
            max_per_shard: cfg.group_max_per_shard as usize,
            max_frame_bytes: cfg.max_frame_bytes,
        }
    }
}

impl CoreState {
    /// Run `f` on the group host with this core's context and stream host, then carry out
    /// its effects (and those their outcomes bring, until none is left).
    pub(in crate::core) fn with_groups<R>(
        &mut self,
        f: impl FnOnce(&mut GroupHost<Log>, &StreamHost<Log>, &Ctx) -> R,
    ) -> R {
        let ctx = step_ctx(self.id, &self.s, &self.catalog);
        let r = f(&mut self.groups, &self.streams, &ctx);
        // Bounded: an effect's outcome adds at most a write and its answers.
        for _ in 0..1000 {
            let effects = self.groups.drain_effects();
            if effects.is_empty() {
                return r;
            }
            for e in effects {
                self.group_effect(e);
            }
        }
        panic!("the group host's effects do not settle");
    }

    fn group_effect(&mut self, e: GroupEffect<Log>) {
        match e {
            GroupEffect::Send(to, msg) => self.route(to, msg),
            GroupEffect::ReadClaims {
                key,
                name,
                origin,
                claims,
                payloads,
                log,
            } => self.read_claims(key, name, origin, claims, payloads, log),
            GroupEffect::Create {
                key,
                name,
                group,
                origin,
            } => {
                let rid = origin.request_id;
                let Some(dir) = self.groups_dir(key) else {
                    let msg = "no durable storage directory on this broker";
                    return self
                        .group_reply(origin, Frame::error(rid, ErrorCode::Unavailable, msg));
                };
                if let Err(e) = std::fs::create_dir_all(&dir) {
                    let msg = format!("cannot create {}: {e}", dir.display());
                    return self
                        .group_reply(origin, Frame::error(rid, ErrorCode::Unavailable, msg));
                }
                self.groups.created(key, name, group, origin);
            }
            GroupEffect::Write {
                key,
                name,
                bytes,
                replies,
            } => {
                let dir = self.groups_dir(key);
                let me = self.me.clone();
                glommio::spawn_local(async move {
                    let n = name.clone();
                    let r = match dir {
                        Some(dir) => {
                            glommio::executor()
                                .spawn_blocking(move || write_group_file(&dir, &n, &bytes))
                                .await
                        }
                        None => Err(std::io::Error::other("no durable storage directory")),
                    };
                    let r = r.map_err(|e| e.to_string());
                    reenter(&me, |st| {
                        st.with_groups(|g, _, ctx| g.on_written(key, name, r, replies, ctx))
                    });
                })
                .detach();
            }
            GroupEffect::Remove { key, name, broken } => {
                let dir = self.groups_dir(key);
                let me = self.me.clone();
                let pass = self.group_tasks.enter();
                glommio::spawn_local(async move {
                    let r = remove_off_core(dir, name.clone()).await;
                    let r = r.map_err(|e| e.to_string());
                    reenter(&me, move |st| {
                        drop(pass);
                        st.with_groups(|g, _, _| g.on_removed(key, name, broken, r));
                    });
                })
                .detach();
            }
        }
    }

    /// Read the claimed records missing from the ring off the log (a run of consecutive
    /// offsets in one read, or a few, by bytes), then answer the poll.
    fn read_claims(
        &mut self,
        key: ShardKey,
        name: String,
        origin: GroupOrigin,
        claims: Vec<crate::group::Claim>,
        payloads: Vec<Option<bytes::Bytes>>,
        log: Log,
    ) {
        let bytes_max = self.s.cfg.history_fetch_bytes;
        let me = self.me.clone();
        let pass = self.group_tasks.enter();
        glommio::spawn_local(async move {
            let mut out: Vec<Payload> = Vec::with_capacity(claims.len());
            let mut i = 0;
            while i < claims.len() {
                if let Some(p) = &payloads[i] {
                    out.push(Payload::Ready(p.clone()));
                    i += 1;
                    continue;
                }
                let mut j = i + 1;
                while j < claims.len()
                    && payloads[j].is_none()
                    && claims[j].offset == claims[j - 1].offset + 1
                {
                    j += 1;
                }
                while i < j {
                    let from = claims[i].offset;
                    match log.read(from, j - i, bytes_max).await {
                        Ok(recs) if !recs.is_empty() => {
                            for r in recs.into_iter().take(j - i) {
                                debug_assert_eq!(r.offset, claims[i].offset);
                                out.push(Payload::Ready(r.payload));
                                i += 1;
                            }
                        }
                        Err(LogError::BelowRetention { .. }) => {
                            out.push(Payload::Gone);
                            i += 1;
                        }
                        _ => {
                            out.push(Payload::Failed);
                            i += 1;
                        }
                    }
                }
            }
            reenter(&me, move |st| {
                drop(pass);
                st.with_groups(|g, _, ctx| g.finish_claims(key, &name, origin, claims, out, ctx));
            });
        })
        .detach();
    }

    pub(in crate::core) fn on_group(
        &mut self,
        origin: GroupOrigin,
        stream: u32,
        frame: GroupFrame,
    ) {
        self.with_groups(|g, streams, ctx| g.on_group(origin, stream, frame, streams, ctx));
    }

    /// When the flusher must run the group timers next, if anything is timed.
    pub(in crate::core) fn group_timeout(&self) -> Option<Duration> {
        // One clock read (the flusher asks every round; the whole step context reads two).
        self.groups.next_due(Instant::now())
    }

    /// The group timers (run by the flusher): lapse claims, end waits, serve waiters.
    pub(in crate::core) fn groups_tick(&mut self) {
        let tasks_idle = self.group_tasks.idle();
        self.with_groups(|g, streams, ctx| g.tick(streams, ctx, tasks_idle));
    }

    /// New records were committed on a durable shard: serve its waiting polls.
    pub(in crate::core) fn groups_records_committed(&mut self, key: ShardKey) {
        self.with_groups(|g, streams, ctx| g.records_committed(key, streams, ctx));
    }

    pub(in crate::core) fn groups_dir(&self, key: ShardKey) -> Option<PathBuf> {
        let root = self.s.cfg.durable_storage_dir.as_ref()?;
        let slot = self.catalog.slot(key.0);
        Some(slot_shard_dir(root, &slot.def.name(), slot.incarnation, key.1).join("groups"))
    }

    /// Load a durable shard's groups once its log is open.
    pub(in crate::core) fn load_groups(&mut self, key: ShardKey, tail: u64) {
        let Some(dir) = self.groups_dir(key) else {
            return;
        };
        let files = read_group_files(&dir);
        self.with_groups(|g, _, ctx| g.load(key, files, tail, ctx));
    }

    /// A durable shard's stream is gone: its groups end (files go with the shard directory).
    pub(in crate::core) fn drop_groups(&mut self, key: ShardKey, why: &Refusal) {
        self.with_groups(|g, _, _| g.drop_shard(key, why));
    }

    /// Nothing left to answer or write (drain).
    pub(in crate::core) fn groups_idle(&self) -> bool {
        self.group_tasks.idle() && self.groups.idle()
    }
}

/// Remove group `name`'s file on the blocking pool (no directory: nothing to remove).
async fn remove_off_core(dir: Option<PathBuf>, name: String) -> std::io::Result<()> {
    match dir {
        Some(dir) => {
            glommio::executor()
                .spawn_blocking(move || remove_group_file(&dir, &name))
                .await
        }
        None => Ok(()),
    }
}

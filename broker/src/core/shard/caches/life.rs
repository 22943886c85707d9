//! The lifecycle of log-backed cache shards on the owner (`shard::Life`): opened on their
//! first request (requests and watch opens that arrive meanwhile wait, in order), failed
//! (answers `unavailable` until the broker restarts), and closed when the shard is no longer
//! served here (requests wait for the close, so a reopen never races it). The I/O (opening,
//! following commits, closing, removing) is the driver's (`core/cache_logs.rs`).

use super::*;
use crate::cache::{CacheShard, Counters};
use crate::core::ToOwner;

impl CacheHost {
    /// Shutdown closes the logs: what fails from now on is the close, not the device.
    pub(crate) fn set_closing(&mut self) {
        self.closing = true;
    }

    /// Hold a message for a log-backed shard until its logs are open (opening them on the
    /// first one), or until an earlier open's logs are closed; answer it at once when the
    /// shard failed. `None`: held or answered; else the message to handle now.
    pub(crate) fn gate(&mut self, msg: MeshMsg, ctx: &Ctx) -> Option<MeshMsg> {
        let Some(key) = msg.cache_shard() else {
            return Some(msg);
        };
        match self.shards.get_mut(&key) {
            Some(Life::Closing { waiting }) => {
                waiting.push(msg); // an earlier incarnation's logs are still closing
                return None;
            }
            Some(Life::Open(_)) => return Some(msg),
            _ => {}
        }
        let durable = ctx.catalog.cache_slot(key.0).def.durable;
        if !durable || ctx.catalog.cache_serve_check(key.0, key.1).is_err() {
            return Some(msg); // in memory, or refused by the handler
        }
        if self.closing || !self.cfg.durable_dir {
            let err = if self.closing {
                Refusal::new(ErrorCode::ShuttingDown, "the broker is shutting down")
            } else {
                Refusal::new(
                    ErrorCode::Unsupported,
                    "no durable_storage_dir on this broker",
                )
            };
            self.refuse(msg, err);
            return None;
        }
        match self.shards.get_mut(&key) {
            Some(Life::Failed { why, .. }) => {
                let err =
                    Refusal::new(ErrorCode::Unavailable, format!("cache shard failed: {why}"));
                self.refuse(msg, err);
                return None;
            }
            Some(Life::Opening { deferred }) => {
                deferred.push(msg);
                return None;
            }
            _ => {}
        }
        if matches!(msg, MeshMsg::Owner(ToOwner::WatchClose { .. })) {
            return None; // nothing registered on a shard never opened
        }
        self.shards.insert(
            key,
            Life::Opening {
                deferred: vec![msg],
            },
        );
        self.effects.push(CacheEffect::Open(key));
        None
    }

    /// Answer a held or gated message with `err`.
    fn refuse(&mut self, msg: MeshMsg, err: Refusal) {
        match msg {
            MeshMsg::Owner(ToOwner::CacheReq { origin, .. }) => {
                let frame = err.frame(origin.request_id);
                self.reply(origin, frame);
            }
            MeshMsg::Owner(ToOwner::WatchOpen(r)) => self.send(
                r.core,
                MeshMsg::Conn(ToConn::WatchOpened {
                    watch: r.watch,
                    result: Err(err),
                }),
            ),
            _ => {}
        }
    }

    /// The logs of `key` opened (with the state they hold) or could not. The messages that
    /// waited are handled again, in order.
    pub(crate) fn on_opened(
        &mut self,
        key: ShardKey,
        r: Result<(CacheLogs, CacheShard, Counters), String>,
        ctx: &Ctx,
    ) {
        let held = self.take_waiting(key, false);
        let still_served = ctx.catalog.cache_serve_check(key.0, key.1).is_ok();
        match r {
            Ok((logs, shard, counters)) if still_served && !self.closing => {
                self.opens += 1;
                let epoch = self.opens;
                self.effects.push(CacheEffect::WatchCommits {
                    key,
                    epoch,
                    cache: logs.cache.clone(),
                    counters: logs.counters.clone(),
                });
                let oc = OwnedCache::with_logs(shard, counters, logs, epoch);
                self.shards.insert(key, Life::Open(oc));
            }
            Ok((logs, shard, counters)) => {
                // The catalog moved on while it opened (or the broker is closing): close
                // it again, removing it if the cache was deleted.
                let oc = OwnedCache::with_logs(shard, counters, logs, 0);
                self.retire(key, oc, ctx);
            }
            Err(why) => {
                tracing::error!(cache = key.0, shard = key.1, %why, "cache shard cannot open");
                CoreCounters::inc(&ctx.counters.cache_shards_failed);
                self.shards.insert(key, Life::Failed { why, log: None });
            }
        }
        self.effects.push(CacheEffect::Requeue(held));
    }

    /// A device error (or the log closed under it) on open number `epoch` of `key`: answer
    /// what waited, end the watches, refuse what comes later.
    pub(crate) fn on_failed(&mut self, key: ShardKey, epoch: u64, why: String, ctx: &Ctx) {
        if self.open(key).is_none_or(|c| c.epoch != epoch) {
            return; // dropped already (deleted, moved), or a newer open
        }
        let mut oc = self.remove(key).expect("checked above");
        if self.closing {
            // Shutdown closed the log: not a failure. Whatever still waits is told so.
            let err = Refusal::new(ErrorCode::ShuttingDown, "the broker is shutting down");
            return self.answer_dropped(key, &mut oc, err, true);
        }
        tracing::error!(cache = key.0, shard = key.1, %why, "cache shard failed");
        CoreCounters::inc(&ctx.counters.cache_shards_failed);
        let err = Refusal::new(ErrorCode::Unavailable, format!("cache shard failed: {why}"));
        self.answer_dropped(key, &mut oc, err, true);
        if let Some(logs) = oc.logs.take() {
            self.effects.push(CacheEffect::CloseLogs(logs));
        }
        self.shards.insert(key, Life::Failed { why, log: None });
    }

    /// Shard `key` is no longer served here (deleted, moved, placed again): an in-memory
    /// shard's waiting answers get `why` (every core ends its own watches); a log-backed one
    /// closes (`retire`).
    pub(crate) fn drop_shard(&mut self, key: ShardKey, why: Refusal, ctx: &Ctx) {
        match self.remove(key) {
            Some(oc) if oc.logs.is_some() => self.retire(key, oc, ctx),
            Some(mut oc) => self.answer_dropped(key, &mut oc, why, false),
            None => {}
        }
    }

    /// Close a log-backed shard's logs (which commits what was appended), then answer each
    /// waiting write by whether its record committed (`on_closed`), and only then let the
    /// messages that arrived meanwhile through.
    fn retire(&mut self, key: ShardKey, mut oc: OwnedCache, ctx: &Ctx) {
        let Some(logs) = oc.logs.take() else {
            return;
        };
        let pending = oc.take_pending_with_upto();
        let remove = ctx.catalog.cache_slot(key.0).deleted;
        let why = ctx
            .catalog
            .cache_serve_check(key.0, key.1)
            .err()
            .map(Refusal::from)
            .unwrap_or(Refusal::new(
                ErrorCode::Unavailable,
                "the cache shard was placed again",
            ));
        self.shards.insert(
            key,
            Life::Closing {
                waiting: Vec::new(),
            },
        );
        self.effects.push(CacheEffect::Retire {
            key,
            logs,
            pending,
            remove,
            why,
        });
    }

    /// The logs of a retired shard are closed (`acked`: each log's acknowledged end;
    /// `removed`: its directory went with it; `why`: why it was retired): answer what
    /// waited, then hand back what arrived meanwhile.
    pub(crate) fn on_closed(
        &mut self,
        key: ShardKey,
        pending: Vec<Pending>,
        acked: (u64, u64),
        removed: bool,
        why: Refusal,
    ) {
        for (counters, upto, origin, frame) in pending {
            let done = upto <= if counters { acked.1 } else { acked.0 };
            let frame = if removed {
                why.clone().frame(origin.request_id)
            } else if done {
                frame // committed before the close: its answer stands
            } else {
                Frame::error(
                    origin.request_id,
                    ErrorCode::Unavailable,
                    format!("outcome unknown: {}", why.message),
                )
            };
            self.reply(origin, frame);
        }
        let waiting = self.take_waiting(key, true);
        self.effects.push(CacheEffect::Requeue(waiting));
    }

    /// End `key`'s open (or, with `closing`, its close): the messages that waited for it.
    /// A shard in any other state is left as it is.
    fn take_waiting(&mut self, key: ShardKey, closing: bool) -> Vec<MeshMsg> {
        match (self.shards.remove(&key), closing) {
            (Some(Life::Opening { deferred }), false) => deferred,
            (Some(Life::Closing { waiting }), true) => waiting,
            (Some(other), _) => {
                self.shards.insert(key, other);
                Vec::new()
            }
            (None, _) => Vec::new(),
        }
    }

    /// A log-backed cache's shard was deleted: if it is not open, opening or closing here,
    /// its directory goes (a failed one is forgotten).
    pub(crate) fn deleted_unopened(&mut self, key: ShardKey) {
        match self.shards.get(&key) {
            Some(Life::Open(_)) | Some(Life::Opening { .. }) | Some(Life::Closing { .. }) => {}
            Some(Life::Failed { .. }) | None => {
                self.shards.remove(&key);
                self.effects.push(CacheEffect::RemoveDir(key));
            }
        }
    }
}

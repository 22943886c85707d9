//! The durable lifecycle of stream shards in the host: which logs to open, their opens,
//! commits and failures, and a stream's deletion (what waits is refused; the log goes to the
//! driver to close and remove).

use super::*;

impl<L: ShardLog> StreamHost<L> {
    /// Durable shards of active streams placed on this broker and owned by core `me`, whose
    /// log is not open or opening yet.
    pub(crate) fn to_open(&self, catalog: &Catalog, me: u8, cores: u8) -> Vec<ShardKey> {
        let mut keys = Vec::new();
        if catalog.fenced {
            return keys;
        }
        for (i, slot) in catalog.slots().iter().enumerate() {
            if slot.deleted || !slot.def.durable {
                continue;
            }
            let name = slot.def.name();
            for shard in 0..slot.def.shards {
                let key = (i as u32, shard);
                if matches!(slot.places[shard as usize], Place::Mine { .. })
                    && core_for_shard(&name, shard, cores as u32) as u8 == me
                    && !self.is_durable(key)
                {
                    keys.push(key);
                }
            }
        }
        keys
    }

    /// The shard is durable and its log starts opening: its requests wait (`defer`).
    pub(crate) fn begin_open(&mut self, key: ShardKey) {
        let s = self.shard(key);
        assert!(s.durable.is_none(), "a durable shard opens once");
        s.durable = Some(Durable {
            life: Life::Opening {
                deferred: Vec::new(),
            },
            pending: VecDeque::new(),
            commit_hist: None,
            replica: None,
        });
    }

    pub(crate) fn is_opening(&self, key: ShardKey) -> bool {
        self.durable(key)
            .is_some_and(|d| matches!(d.life, Life::Opening { .. }))
    }

    /// The open finished (`Ok((log, next_offset))`, or why it failed). What waited for it is
    /// handed back to be handled again (`Effect::Requeue`), as open or failed.
    pub(crate) fn on_opened(
        &mut self,
        key: ShardKey,
        r: Result<(L, u64), String>,
        commit_hist: impl FnOnce() -> Arc<Histogram>,
    ) -> OpenOutcome<L> {
        let still_wanted = self.is_opening(key);
        if !still_wanted {
            return OpenOutcome::Unwanted(r.ok().map(|(log, _)| log));
        }
        let s = self.shards.get_mut(&key).expect("opening");
        let d = s.durable.as_mut().expect("opening");
        let deferred = match &mut d.life {
            Life::Opening { deferred } => std::mem::take(deferred),
            _ => unreachable!("checked above"),
        };
        let outcome = match r {
            Ok((log, next_offset)) => {
                s.owner.start_at(next_offset);
                d.life = Life::Open(log);
                d.commit_hist = Some(commit_hist());
                OpenOutcome::Serving { next_offset }
            }
            Err(why) => {
                d.life = Life::Failed { why, log: None };
                OpenOutcome::Failed
            }
        };
        self.effects.push(Effect::Requeue(deferred));
        outcome
    }

    /// Commit progress of a durable shard: every pending publish wholly below `acked` is now
    /// on disk — append it to the in-memory tail (ring), deliver it, answer it.
    pub(crate) fn on_acked(&mut self, key: ShardKey, acked: u64, ctx: &Ctx) {
        CoreCounters::inc(&ctx.counters.durable_commits);
        loop {
            let Some(s) = self.shards.get_mut(&key) else {
                return;
            };
            let Some(d) = s.durable.as_mut() else { return };
            match d.pending.front() {
                Some(p) if p.range.end <= acked => {}
                _ => return,
            }
            let p = d.pending.pop_front().expect("checked above");
            let us = ctx.now.saturating_duration_since(p.at).as_micros() as u64;
            ctx.counters.durable_commit.observe_us(us);
            if let Some(h) = &d.commit_hist {
                h.observe_us(us);
            }
            assert_eq!(
                s.owner.next_offset(),
                p.range.start,
                "the ring continues exactly where the log assigned"
            );
            let n = p.range.end - p.range.start;
            CoreCounters::add(&ctx.counters.durable_records_committed, n);
            self.publish_committed(key, p.req, ctx);
        }
    }

    /// The log failed: nothing pending will be acknowledged.
    pub(crate) fn on_failed(&mut self, key: ShardKey, why: String, ctx: &Ctx) {
        let closing = self.closing;
        let Some(d) = self.shards.get_mut(&key).and_then(|s| s.durable.as_mut()) else {
            return;
        };
        if closing && d.pending.is_empty() {
            // Closed for shutdown with nothing waiting: not a failure.
            return;
        }
        if let Life::Opening { deferred } = &mut d.life {
            // Nothing reports a failure before the open answers; if it did, what waited for
            // the open must not be lost with it.
            self.effects.push(Effect::Requeue(std::mem::take(deferred)));
        }
        if !closing && !matches!(d.life, Life::Failed { .. }) {
            CoreCounters::inc(&ctx.counters.durable_shards_failed);
            d.life.fail(why.clone());
            // Its subscribers are told, as a failed cache shard's watches are: nothing more
            // will reach them from this shard.
            let cores: Vec<usize> = self.shards[&key].owner.interested_cores().collect();
            #[cfg(test)]
            let cores = if breaks::on(&breaks::SILENT_FAILURE) {
                Vec::new()
            } else {
                cores
            };
            let end = Refusal::new(
                ErrorCode::Unavailable,
                format!("shard storage failed: {why}; subscribe again after the broker reopens it"),
            );
            self.end_subs(key, cores, &end);
        }
        let Some(d) = self.shards.get_mut(&key).and_then(|s| s.durable.as_mut()) else {
            return;
        };
        let pending: Vec<Pending> = d.pending.drain(..).collect();
        let why = if closing {
            Refusal::new(
                ErrorCode::ShuttingDown,
                "the broker shut down before this publish was committed; it was not acknowledged"
                    .to_string(),
            )
        } else {
            Refusal::new(
                ErrorCode::Unavailable,
                format!("shard storage failed; the publish was not acknowledged: {why}"),
            )
        };
        for p in pending {
            CoreCounters::inc(&ctx.counters.durable_publishes_refused);
            self.refuse_publish(p.req, why.clone());
        }
    }

    /// The shard's stream was deleted: refuse what waits (held, pending commit); requests
    /// that waited for the open are handed back (they meet the deleted slot). Returns
    /// `Some(log)` for a durable shard, whose log the driver closes and whose files it
    /// removes.
    pub(crate) fn on_deleted(
        &mut self,
        key: ShardKey,
        why: &Refused,
        ctx: &Ctx,
    ) -> Option<Option<L>> {
        let mut refused: Vec<PublishReq> = Vec::new();
        let mut gone = None;
        if let Some(s) = self.shards.get_mut(&key) {
            self.held_total -= s.owner.held.len();
            refused.extend(s.owner.held.drain(..));
            if let Some(d) = s.durable.take() {
                refused.extend(d.pending.into_iter().map(|p| p.req));
                let replica = d.replica.is_some();
                let log = match d.life {
                    Life::Opening { deferred } => {
                        self.effects.push(Effect::Requeue(deferred));
                        None
                    }
                    other => other.into_log(),
                };
                // A replicated shard's log and files are its replica host's to close and
                // remove.
                gone = (!replica).then_some(log);
            }
        }
        for req in refused {
            self.refuse_publish(req, why.clone());
        }
        self.drop_if_deleted_and_idle(key, ctx.catalog);
        gone
    }

    /// Drop a deleted stream's shard state once no core is attached to it any more.
    pub(super) fn drop_if_deleted_and_idle(&mut self, key: ShardKey, catalog: &Catalog) {
        if !catalog.slot(key.0).deleted {
            return;
        }
        if let Some(s) = self.shards.get(&key) {
            if s.owner.interested_cores().next().is_none() && s.owner.held.is_empty() {
                self.shards.remove(&key);
            }
        }
    }
}

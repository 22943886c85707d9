//! The driver of the stream shard host (`shard::stream`): messages for the stream shards this
//! core owns go in with the time, and the host's effects come out here and are carried out —
//! mesh messages routed, history reads run on a task, groups told of commits.

use super::shard::stream::{Effect, StreamMsg};
use super::shard::Ctx;
use super::*;

/// The context a host steps with on this core: who, the time now (the driver's clock read),
/// the catalog it acts on, the counters. Built from the state's fields, not `&self`, so the
/// host (another field) can be borrowed mutably beside it.
pub(in crate::core) fn step_ctx<'a>(id: u8, s: &'a CoreSettings, catalog: &'a Catalog) -> Ctx<'a> {
    Ctx {
        me: id,
        cores: s.cores,
        now: Instant::now(),
        ts_ms: felix_storage::log::now_ms(),
        catalog,
        counters: &s.counters,
    }
}

impl CoreState {
    pub(in crate::core) fn owner_core(&self, stream: u32, shard: u32) -> u8 {
        let def = &self.catalog.slot(stream).def;
        core_for_shard(&def.name(), shard, self.s.cores as u32) as u8
    }

    /// Run `f` on the stream shard host with this core's context, then carry out its effects.
    pub(in crate::core) fn with_streams<R>(
        &mut self,
        f: impl FnOnce(&mut StreamHost<Log>, &Ctx) -> R,
    ) -> R {
        let ctx = step_ctx(self.id, &self.s, &self.catalog);
        let r = f(&mut self.streams, &ctx);
        for e in self.streams.drain_effects() {
            self.stream_effect(e);
        }
        r
    }

    /// Hand a message to the shard host of stream shard `key` (owned by this core).
    pub(in crate::core) fn tell_stream_shard(&mut self, key: ShardKey, msg: StreamMsg) {
        debug_assert_eq!(
            self.owner_core(key.0, key.1),
            self.id,
            "only the owner core holds shard state"
        );
        self.with_streams(|h, ctx| h.handle(key, msg, ctx));
    }

    fn stream_effect(&mut self, e: Effect<Log>) {
        match e {
            Effect::Send(to, msg) => self.route(to, msg),
            Effect::Committed(key) => {
                if self.groups.has(key) {
                    self.groups_records_committed(key);
                }
            }
            Effect::Requeue(msgs) => self.inbox.extend(msgs),
            Effect::Read {
                key,
                log,
                core,
                sub,
                from,
                upto,
            } => {
                let bytes_max = self.s.cfg.history_fetch_bytes;
                let me = self.me.clone();
                // Never past `upto`: a replicated shard's log holds uncommitted records.
                let want =
                    (upto.saturating_sub(from) as usize).min(timers::HISTORY_READ_RECORDS_MAX);
                glommio::spawn_local(async move {
                    let r = log.read(from, want, bytes_max).await.map(|recs| {
                        let first = recs.first()?.offset;
                        let records =
                            felix_quic::wire::Records::encode(recs.iter().map(|r| &r.payload[..]));
                        Some((first, records))
                    });
                    reenter(&me, |st| {
                        st.with_streams(|h, ctx| h.on_read(key, (core, sub, from), r, ctx))
                    });
                })
                .detach();
            }
        }
    }
}

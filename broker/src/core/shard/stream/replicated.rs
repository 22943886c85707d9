//! A replicated shard in the stream host (issue 23). Its log is its replica's: the replica's
//! driver (`core/replica_driver.rs`) writes it, and the replica host (`core/replica_host.rs`)
//! answers its publishes. What the stream host keeps is the readers' side: while this
//! broker's replica leads and its commit mark has passed its generation-start record, the
//! committed records are handed over in order (`replica_visible`) and go to the ring and the
//! subscribers exactly as a one-copy shard's committed publishes do; history below the ring
//! is read from the replica's log, never past the ring's start. So no reader is handed a
//! record a failover could cut. While the replica does not serve, attaches and fetches are
//! refused `unavailable` (retryable), and when it stops serving its subscriptions end.

use super::{Durable, Effect, Life, Refusal, Refused, ShardLog, StreamHost};
use crate::core::shard::Ctx;
use crate::core::ShardKey;
use felix_quic::wire::{ErrorCode, Records};
use std::collections::VecDeque;

/// What this broker may serve of a replicated shard now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Serve {
    /// Its replica does not lead, or leads but has not committed a record of its
    /// generation yet: readers wait.
    NotLeading,
    /// Its replica leads and hands over what commits.
    Serving,
}

impl<L: ShardLog> StreamHost<L> {
    /// The shard is replicated here: its replica's log is opening, and what asks for it
    /// waits (`defer`) until `replica_opened`.
    pub(crate) fn replica_begin(&mut self, key: ShardKey) {
        let s = self.shard(key);
        // Hosted again after a failure: open afresh.
        let failed = |d: &Durable<L>| d.replica.is_some() && matches!(d.life, Life::Failed { .. });
        if s.durable.as_ref().is_some_and(|d| !failed(d)) {
            return;
        }
        s.durable = Some(Durable {
            life: Life::Opening {
                deferred: Vec::new(),
            },
            pending: VecDeque::new(),
            commit_hist: None,
            replica: Some(Serve::NotLeading),
        });
    }

    /// The replica's log opened (or failed to): what waited is handled again.
    pub(crate) fn replica_opened(&mut self, key: ShardKey, r: Result<L, String>) {
        let Some(d) = self.replica_state(key) else {
            return;
        };
        let deferred = match &mut d.life {
            Life::Opening { deferred } => std::mem::take(deferred),
            _ => return,
        };
        d.life = match r {
            Ok(log) => Life::Open(log),
            Err(why) => Life::Failed { why, log: None },
        };
        self.effects.push(Effect::Requeue(deferred));
    }

    /// The replica leads and its mark passed its generation-start record at `from`: the
    /// ring numbers from there (empty: what it held under an earlier leadership may have
    /// been followed by records this generation cut).
    pub(crate) fn replica_serving(&mut self, key: ShardKey, from: u64) {
        let Some(s) = self.shards.get_mut(&key) else {
            return;
        };
        let Some(d) = s.durable.as_mut().filter(|d| d.replica.is_some()) else {
            return;
        };
        debug_assert!(
            d.life.log().is_some(),
            "a replica serves once its log is open"
        );
        s.owner.restart_at(from);
        d.replica = Some(Serve::Serving);
    }

    /// Committed records from `first` on, in order: to the ring and the subscribers.
    pub(crate) fn replica_visible(
        &mut self,
        key: ShardKey,
        first: u64,
        records: &Records,
        ctx: &Ctx,
    ) {
        let Some(s) = self.shards.get(&key) else {
            return;
        };
        if s.durable.as_ref().and_then(|d| d.replica) != Some(Serve::Serving) {
            return;
        }
        // Both sides of the hand-over: the driver hands over contiguously from `Serving`.
        assert_eq!(
            s.owner.next_offset(),
            first,
            "a replica hands over committed records in order"
        );
        self.append_and_deliver(key, records, ctx);
        self.effects.push(Effect::Committed(key));
    }

    /// The replica stopped serving (deposed, failed, no longer hosted here): its
    /// subscriptions end with `why`, and readers wait again.
    pub(crate) fn replica_stopped(&mut self, key: ShardKey, why: Refused) {
        let Some(s) = self.shards.get_mut(&key) else {
            return;
        };
        let Some(d) = s.durable.as_mut().filter(|d| d.replica.is_some()) else {
            return;
        };
        let was = d.replica.replace(Serve::NotLeading);
        if was != Some(Serve::Serving) {
            return;
        }
        let cores: Vec<usize> = s.owner.interested_cores().collect();
        self.end_subs(key, cores, &why);
    }

    /// The replica failed: the shard answers `unavailable` with why until it is hosted
    /// again.
    pub(crate) fn replica_failed(&mut self, key: ShardKey, why: &str) {
        let end = Refusal::new(
            ErrorCode::Unavailable,
            format!("the shard's replica failed: {why}; subscribe again"),
        );
        self.replica_stopped(key, end);
        if let Some(d) = self.replica_state(key) {
            d.life.fail(why.to_string());
        }
    }

    /// The replica is no longer hosted here: the shard's state goes with it (its log is the
    /// replica host's to close).
    pub(crate) fn replica_unhosted(&mut self, key: ShardKey, why: Refused) {
        self.replica_stopped(key, why);
        if let Some(s) = self.shards.get_mut(&key) {
            if s.durable.as_ref().is_some_and(|d| d.replica.is_some()) {
                s.durable = None;
            }
        }
    }

    /// Readers of a replicated shard are served only while its replica serves.
    pub(super) fn replica_check(&self, key: ShardKey, ctx: &Ctx) -> Result<(), Refused> {
        let serve = self.durable(key).and_then(|d| d.replica);
        let name = || ctx.catalog.slot(key.0).def.name();
        match serve {
            Some(Serve::Serving) => Ok(()),
            None if !ctx.catalog.replicated(key.0, key.1) => Ok(()),
            // Placement names this broker, but its replica is not hosted (yet, or any more).
            None => Err(Refusal::new(
                ErrorCode::Unavailable,
                format!("shard {} of {} has no replica open on this broker yet; retry", key.1, name()),
            )),
            Some(Serve::NotLeading) => Err(Refusal::new(
                ErrorCode::Unavailable,
                format!(
                    "shard {} of {} is led here but its leadership is not serving yet (fencing, or waiting for its first commit); retry",
                    key.1,
                    name()
                ),
            )),
        }
    }

    fn replica_state(&mut self, key: ShardKey) -> Option<&mut Durable<L>> {
        self.shards
            .get_mut(&key)
            .and_then(|s| s.durable.as_mut())
            .filter(|d| d.replica.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::super::HostCfg;
    use super::super::{MeshMsg, StreamMsg, ToConn};
    use super::*;
    use crate::catalog::{Catalog, ControlView, ViewPlace, ViewStream};
    use crate::core::sim::disk::MemLog;
    use crate::core::ToOwner;
    use crate::metrics::CoreCounters;
    use felix_quic::wire::StartAt;
    use std::time::Instant;

    /// Stream `t/ns/r` of one shard, replicated on brokers 1, 2, 3 and led by `leader`, as
    /// broker 1 sees it.
    fn catalog(leader: u64, generation: u64) -> Catalog {
        let def = crate::catalog::StreamDef {
            tenant: "t".into(),
            namespace: "ns".into(),
            stream: "r".into(),
            shards: 1,
            durable: true,
            fsync: None,
            retention_bytes: None,
            retention_seconds: None,
            quorum: true,
        };
        let view = ControlView {
            streams: vec![ViewStream {
                def,
                incarnation: 1,
                deleting: false,
                placement: vec![ViewPlace::Replicated {
                    leader,
                    generation,
                    replicas: vec![1, 2, 3],
                    settled: vec![],
                }],
            }],
            ..ControlView::default()
        };
        Catalog::from_view(&Catalog::default(), &view, 1, false)
    }

    fn host() -> StreamHost<MemLog> {
        StreamHost::new(HostCfg {
            cores: 1,
            ring_records_max: 1024,
            ring_bytes_max: 1 << 20,
            publish_timeout_ms: 1_000,
        })
    }

    fn attach(
        h: &mut StreamHost<MemLog>,
        sub: u64,
        start: StartAt,
        ctx: &Ctx,
    ) -> Result<u64, Refused> {
        h.handle(
            (0, 0),
            StreamMsg::Attach {
                core: 0,
                sub,
                start,
            },
            ctx,
        );
        let mut got = None;
        for e in h.drain_effects() {
            if let Effect::Send(_, MeshMsg::Conn(ToConn::AttachResult { result, .. })) = e {
                got = Some(result.map(|ok| ok.from));
            }
        }
        got.expect("an attach is answered")
    }

    fn records(payloads: &[&str]) -> Records {
        Records::encode(payloads.iter().map(|p| p.as_bytes()))
    }

    /// Readers wait for the leadership to serve, then see exactly what was handed over from
    /// its start; a deposed leadership ends them `not_leader` and they wait again; a new
    /// leadership numbers its ring afresh.
    #[test]
    fn readers_follow_the_replicas_leadership() {
        let counters = CoreCounters::default();
        let cat = catalog(1, 1);
        let ctx = Ctx {
            me: 0,
            cores: 1,
            now: Instant::now(),
            ts_ms: 0,
            catalog: &cat,
            counters: &counters,
        };
        let mut h = host();
        let key = (0, 0);
        h.replica_begin(key);
        // While the replica's log opens, an attach waits for it.
        let msg = MeshMsg::Owner(ToOwner::Attach {
            core: 0,
            sub: 9,
            stream: 0,
            shard: 0,
            start: StartAt::Earliest,
        });
        assert!(h.defer(key, msg).is_none(), "deferred while opening");
        h.replica_opened(key, Ok(MemLog(Default::default())));
        let requeued = h.drain_effects();
        assert!(matches!(&requeued[..], [Effect::Requeue(m)] if m.len() == 1));
        // Led here but not serving: refused, retryable.
        let e = attach(&mut h, 1, StartAt::Earliest, &ctx).unwrap_err();
        assert_eq!(e.code, ErrorCode::Unavailable, "{e}");
        // Serving from the generation-start record at 5: the ring numbers from there.
        h.replica_serving(key, 5);
        assert_eq!(attach(&mut h, 2, StartAt::Latest, &ctx), Ok(5));
        h.replica_visible(key, 5, &records(&["", "a", "b"]), &ctx);
        let fx = h.drain_effects();
        let delivered: Vec<(u64, u32)> = fx
            .iter()
            .filter_map(|e| match e {
                Effect::Send(_, MeshMsg::Conn(ToConn::Delivery { batch, .. })) => {
                    Some((batch.first_offset, batch.count))
                }
                _ => None,
            })
            .collect();
        assert_eq!(delivered, vec![(5, 3)]);
        assert!(fx.iter().any(|e| matches!(e, Effect::Committed(_))));
        assert_eq!(h.tail(key), Some(8));
        // Deposed: its subscribers are told, and readers wait again.
        let why = Refusal::new(ErrorCode::NotLeader, "superseded");
        h.replica_stopped(key, why.clone());
        let ended: Vec<Refused> = h
            .drain_effects()
            .into_iter()
            .filter_map(|e| match e {
                Effect::Send(_, MeshMsg::Conn(ToConn::SubsEnded { why, .. })) => Some(why),
                _ => None,
            })
            .collect();
        assert_eq!(ended, vec![why]);
        let e = attach(&mut h, 3, StartAt::Latest, &ctx).unwrap_err();
        assert_eq!(e.code, ErrorCode::Unavailable);
        // A later leadership here starts its ring at its own start record.
        h.replica_serving(key, 20);
        assert_eq!(attach(&mut h, 4, StartAt::Latest, &ctx), Ok(20));
        assert_eq!(
            h.ring(key).and_then(|r| r.oldest()),
            None,
            "the ring starts empty"
        );
        // Unhosted: the shard's state goes, and readers are refused until hosted again.
        h.replica_unhosted(key, Refusal::new(ErrorCode::NotLeader, "moved"));
        h.drain_effects();
        let e = attach(&mut h, 5, StartAt::Latest, &ctx).unwrap_err();
        assert_eq!(e.code, ErrorCode::Unavailable);
        assert!(e.message.contains("no replica open"), "{e}");
    }
}

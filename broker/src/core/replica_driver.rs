//! The driver of one shard's replica: the pure machine (`core/replica/`) and its storage
//! (`core/replica_store.rs`) joined. An input goes into the machine with the time; the
//! machine's effects are carried out **in order**, each finished before the next starts (a
//! promise is on disk before the answer that relies on it leaves, appended records are
//! acknowledged by the log before the answer naming them), and what must leave the broker
//! comes back as [`Output`]s: peer messages with the records a shipment carries (read from
//! the log), reports for placement, and the answers owed to publishes.
//!
//! It reads no clock (the caller passes the machine's monotonic time and the wall clock for
//! record timestamps) and sends nothing itself. `core/replica_host.rs` runs one per hosted
//! replica; the tests in `replica_store` route its outputs between three drivers over real
//! logs.

use super::replica::{Effect, Msg, NodeId, NotLeader, Replica, ReplicaCfg};
use super::replica_store::{records_for, Carried, ReplicaStore};
use bytes::Bytes;
use felix_control::replication::{Assignment, Report, ReportAnswer, StorageId};
use felix_quic::wire::replica::ShippedRecord;
use felix_storage::LogConfig;
use std::path::Path;

/// What the driver is handed.
#[derive(Debug)]
pub(crate) enum Input {
    /// A peer's message, with the records it carries (a shipment's, else none).
    Msg {
        msg: Msg,
        records: Vec<ShippedRecord>,
    },
    ReportAnswer(ReportAnswer),
    Assign(Assignment),
    /// A client's record for this shard (the leader appends and ships it). The shard host
    /// does not route publishes to replicas yet (replicated shards refuse them).
    #[cfg_attr(not(test), allow(dead_code))]
    Propose {
        payload: Bytes,
        flags: u8,
    },
    Tick,
}

/// What the driver's caller must carry further, in order.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Output {
    Send {
        to: NodeId,
        msg: Msg,
        records: Vec<ShippedRecord>,
    },
    Report(Report),
    /// The proposal was taken at this offset; its answer is a later `Ack` or `CannotVouch`.
    Proposed {
        at: u64,
    },
    /// The proposal was not taken.
    NotTaken(NotLeader),
    Ack {
        from: u64,
        below: u64,
    },
    CannotVouch {
        from: u64,
        below: u64,
    },
    Elected {
        gen: u64,
    },
    SteppedDown {
        gen: u64,
    },
}

pub(crate) struct ReplicaDriver {
    r: Replica,
    store: ReplicaStore,
}

impl ReplicaDriver {
    /// Open the shard's replica in `dir` (its log and durable promise): the machine comes up
    /// as a follower with exactly what the files hold.
    pub(crate) async fn open(
        me: NodeId,
        sid: StorageId,
        set: Vec<NodeId>,
        dir: &Path,
        log_cfg: LogConfig,
        cfg: ReplicaCfg,
    ) -> Result<ReplicaDriver, String> {
        cfg.validate()?;
        if !set.contains(&me) {
            return Err(format!("node {me} is not in the replica set {set:?}"));
        }
        let (store, durable, view) = ReplicaStore::open(dir, log_cfg).await?;
        let r = Replica::new(me, sid, set, durable, view, cfg);
        Ok(ReplicaDriver { r, store })
    }

    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn replica(&self) -> &Replica {
        &self.r
    }

    pub(crate) fn store(&self) -> &ReplicaStore {
        &self.store
    }

    /// Hand the machine one input at `now_ms` (its monotonic clock; `wall_ms` stamps the
    /// records a leader writes) and carry its effects out. An error leaves the files as a
    /// crash at that point would: the caller closes the shard and reopens it.
    pub(crate) async fn handle(
        &mut self,
        input: Input,
        now_ms: u64,
        wall_ms: u64,
    ) -> Result<Vec<Output>, String> {
        let mut out = Vec::new();
        let mut client = None;
        let mut in_hand: Vec<Carried> = Vec::new();
        match input {
            Input::Msg { msg, records } => {
                if let Msg::Ship { gens, .. } = &msg {
                    if gens.len() != records.len() {
                        return Err(format!(
                            "a shipment of {} records carries {}",
                            gens.len(),
                            records.len()
                        ));
                    }
                    in_hand = gens
                        .iter()
                        .zip(records)
                        .map(|(&gen, r)| carried(gen, r))
                        .collect();
                }
                self.r.on_msg(msg, now_ms);
            }
            Input::ReportAnswer(a) => self.r.on_report_answer(a, now_ms),
            Input::Assign(a) => self.r.assign(a, now_ms),
            Input::Tick => self.r.tick(now_ms),
            Input::Propose { payload, flags } => match self.r.propose(now_ms) {
                Ok(at) => {
                    let gen = self.r.leading().expect("a taken proposal has a leader");
                    client = Some(Carried {
                        gen,
                        ts_ms: wall_ms,
                        flags,
                        payload,
                    });
                    out.push(Output::Proposed { at });
                }
                Err(e) => out.push(Output::NotTaken(e)),
            },
        }
        for e in self.r.drain_effects() {
            self.carry_out(e, client.as_ref(), &in_hand, wall_ms, &mut out)
                .await?;
        }
        // Rule 10: retention stops at the mark this replica has learnt.
        self.store.hold_at(self.r.known_commit()).await?;
        Ok(out)
    }

    async fn carry_out(
        &mut self,
        e: Effect,
        client: Option<&Carried>,
        in_hand: &[Carried],
        wall_ms: u64,
        out: &mut Vec<Output>,
    ) -> Result<(), String> {
        match e {
            Effect::Persist(d) => self.store.persist(d).await?,
            Effect::Truncate { from } => {
                self.store.truncate(from).await.map_err(|e| e.to_string())?
            }
            Effect::Append { at, gens, source } => {
                let recs = records_for(source, &gens, client, in_hand, wall_ms)?;
                self.store.append(at, &gens, &recs).await?;
            }
            Effect::Send { to, msg } => {
                let records = match &msg {
                    Msg::Ship { start, gens, .. } => self
                        .store
                        .read_shipment(*start, gens)
                        .await?
                        .into_iter()
                        .map(|c| ShippedRecord {
                            ts_ms: c.ts_ms,
                            flags: c.flags,
                            payload: c.payload,
                        })
                        .collect(),
                    _ => Vec::new(),
                };
                out.push(Output::Send { to, msg, records });
            }
            Effect::Report(r) => out.push(Output::Report(r)),
            Effect::Ack { from, below } => out.push(Output::Ack { from, below }),
            Effect::CannotVouch { from, below } => out.push(Output::CannotVouch { from, below }),
            Effect::Elected { gen } => out.push(Output::Elected { gen }),
            Effect::SteppedDown { gen } => out.push(Output::SteppedDown { gen }),
        }
        Ok(())
    }
}

fn carried(gen: u64, r: ShippedRecord) -> Carried {
    Carried {
        gen,
        ts_ms: r.ts_ms,
        flags: r.flags,
        payload: r.payload,
    }
}

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
    /// A client's batch of records for this shard: the leader appends it in one piece and
    /// ships it.
    Propose {
        payloads: Vec<Bytes>,
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
    /// The proposal was taken at this offset (its first record's), and written: its answer
    /// is a later `Ack` or `CannotVouch`.
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
    /// This follower's log was emptied and goes on at its leader's base (rule 10).
    Rebuilt {
        base: u64,
    },
    SteppedDown {
        gen: u64,
    },
    /// This leader's commit mark passed its generation-start record at `from`: from now on
    /// the records below the mark may be read, and `Visible` hands them over in order.
    Serving {
        from: u64,
    },
    /// Committed records `first..first + payloads.len()`, read back from the log, in order
    /// and contiguous from `Serving`'s `from` (the generation-start record is one with an
    /// empty payload).
    Visible {
        first: u64,
        payloads: Vec<Bytes>,
    },
}

/// A change of whether this replica serves (rules 2 and 4), in the machine's milliseconds.
/// The host logs each on CLOCK_MONOTONIC, which every process on a machine shares, so that
/// the serving intervals of one shard's replicas can be checked never to overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ServingEvent {
    /// It serves from `at_ms` on: the first input at which it did.
    Started { gen: u64, at_ms: u64 },
    /// It served no more from `at_ms` on: the input at which it stepped down, or the end of
    /// its lease if that came first (nothing is decided between inputs).
    Ended { gen: u64, at_ms: u64 },
}

/// Committed records handed over per input at most (`Output::Visible`); the rest follow at
/// the next input or tick.
const VISIBLE_RECORDS_MAX: usize = 4096;
/// Bytes of committed records read per input at most.
const VISIBLE_BYTES_MAX: usize = 4 << 20;

pub(crate) struct ReplicaDriver {
    r: Replica,
    store: ReplicaStore,
    /// While leading and serving: the records below this were handed over as `Visible`.
    visible: Option<u64>,
    /// While serving, as of the last input: the generation and the lease's end.
    serving: Option<(u64, u64)>,
    /// Serving changes not taken yet ([`ReplicaDriver::take_serving_events`]).
    serving_events: Vec<ServingEvent>,
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
        Ok(ReplicaDriver {
            r,
            store,
            visible: None,
            serving: None,
            serving_events: Vec::new(),
        })
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
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) async fn handle(
        &mut self,
        input: Input,
        now_ms: u64,
        wall_ms: u64,
    ) -> Result<Vec<Output>, String> {
        self.handle_all(vec![input], now_ms, wall_ms).await
    }

    /// [`ReplicaDriver::handle`] for several inputs in order, with one wait for the log at
    /// the end (a group commit): nothing of the outputs leaves before the log acknowledged
    /// everything appended, so no answer claims what is not written.
    pub(crate) async fn handle_all(
        &mut self,
        inputs: Vec<Input>,
        now_ms: u64,
        wall_ms: u64,
    ) -> Result<Vec<Output>, String> {
        let mut out = Vec::new();
        for input in inputs {
            self.learn_trimmed();
            self.step(input, now_ms, wall_ms, &mut out).await?;
            self.observe_serving(now_ms);
        }
        self.store.settle().await?;
        // Rule 10: retention stops at the mark this replica has learnt, and on a leader at
        // what readers were handed (the hand-over reads the records below the mark).
        let known = self.r.known_commit();
        let hold = self.visible.map_or(known, |v| v.min(known));
        self.store.hold_at(hold).await?;
        self.hand_over(&mut out).await?;
        Ok(out)
    }

    async fn step(
        &mut self,
        input: Input,
        now_ms: u64,
        wall_ms: u64,
        out: &mut Vec<Output>,
    ) -> Result<(), String> {
        let mut client: Vec<Carried> = Vec::new();
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
            Input::Propose { payloads } if payloads.is_empty() => {
                return Err("a proposal of no records".into());
            }
            Input::Propose { payloads } => match self.r.propose(payloads.len(), now_ms) {
                Ok(at) => {
                    let gen = self.r.leading().expect("a taken proposal has a leader");
                    client = payloads
                        .into_iter()
                        .map(|payload| Carried {
                            gen,
                            ts_ms: wall_ms,
                            flags: 0,
                            payload,
                        })
                        .collect();
                    out.push(Output::Proposed { at });
                }
                Err(e) => out.push(Output::NotTaken(e)),
            },
        }
        for e in self.r.drain_effects() {
            self.carry_out(e, &client, &in_hand, wall_ms, out).await?;
        }
        Ok(())
    }

    /// Note a change of whether the machine serves, after an input at `now_ms`.
    fn observe_serving(&mut self, now_ms: u64) {
        let is = self.r.serving_until(now_ms);
        match (self.serving, is) {
            // Still serving the same generation; a renewal may have moved the lease's end.
            (Some((was, _)), Some((gen, _))) if was == gen => {}
            (was, _) => {
                if let Some((gen, until)) = was {
                    let at_ms = now_ms.min(until);
                    self.serving_events.push(ServingEvent::Ended { gen, at_ms });
                }
                if let Some((gen, _)) = is {
                    let at_ms = now_ms;
                    self.serving_events
                        .push(ServingEvent::Started { gen, at_ms });
                }
            }
        }
        self.serving = is;
    }

    /// The serving changes since the last call, in order.
    pub(crate) fn take_serving_events(&mut self) -> Vec<ServingEvent> {
        std::mem::take(&mut self.serving_events)
    }

    /// While serving, as of the last input: the generation and the lease's end (exclusive).
    pub(crate) fn serving_until(&self) -> Option<(u64, u64)> {
        self.serving
    }

    /// Tell the machine what retention removed (it runs on the log's own task): the
    /// records below the log's oldest offset.
    fn learn_trimmed(&mut self) {
        let oldest = self.store.log().oldest_offset();
        if oldest > self.r.log().base() {
            self.r.trimmed(oldest);
        }
    }

    /// While serving, hand over the committed records not handed over yet (bounded per
    /// input), read back from the log.
    async fn hand_over(&mut self, out: &mut Vec<Output>) -> Result<(), String> {
        let Some(from) = self.r.serving_from() else {
            self.visible = None;
            return Ok(());
        };
        let v = match self.visible {
            Some(v) => v,
            None => {
                out.push(Output::Serving { from });
                *self.visible.insert(from)
            }
        };
        let commit = if super::replica::breaks::on(&super::replica::breaks::HAND_OVER_UNCOMMITTED) {
            self.store.log().next_offset()
        } else {
            self.r.known_commit()
        };
        debug_assert!(commit <= self.store.log().next_offset());
        if commit <= v {
            return Ok(());
        }
        let payloads = self
            .store
            .read_committed(v, commit, VISIBLE_RECORDS_MAX, VISIBLE_BYTES_MAX)
            .await?;
        if payloads.is_empty() {
            return Err(format!(
                "the log holds nothing at {v}, below the commit mark {commit}"
            ));
        }
        self.visible = Some(v + payloads.len() as u64);
        out.push(Output::Visible { first: v, payloads });
        Ok(())
    }

    async fn carry_out(
        &mut self,
        e: Effect,
        client: &[Carried],
        in_hand: &[Carried],
        wall_ms: u64,
        out: &mut Vec<Output>,
    ) -> Result<(), String> {
        match e {
            Effect::Persist(d) => self.store.persist(d).await?,
            Effect::Truncate { from } => {
                self.store.truncate(from).await.map_err(|e| e.to_string())?
            }
            Effect::Rebuild { base } => {
                self.store.rebuild(base).await?;
                out.push(Output::Rebuilt { base });
            }
            Effect::Append { at, gens, source } => {
                let recs = records_for(source, &gens, client, in_hand, wall_ms)?;
                self.store.append(at, &gens, &recs).await?;
            }
            Effect::Send { to, msg } => {
                let records = match &msg {
                    Msg::Ship { start, gens, .. } => {
                        match self.store.read_shipment(*start, gens).await? {
                            Some(recs) => recs
                                .into_iter()
                                .map(|c| ShippedRecord {
                                    ts_ms: c.ts_ms,
                                    flags: c.flags,
                                    payload: c.payload,
                                })
                                .collect(),
                            // Retention removed them since the machine last heard: the
                            // shipment is dropped, as the network may drop it; the next
                            // tick ships from the new base.
                            None => return Ok(()),
                        }
                    }
                    _ => Vec::new(),
                };
                out.push(Output::Send { to, msg, records });
            }
            Effect::Report(mut r) => {
                let log = self.store.log();
                r.behind_bytes = r
                    .holders
                    .iter()
                    .map(|h| (h.node, log.bytes_from(h.pos.end)))
                    .collect();
                out.push(Output::Report(r));
            }
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

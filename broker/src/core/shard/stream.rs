//! The stream shard host: every stream shard a core owns, as a pure state machine. It appends
//! publishes (to the replay ring, or through a durable log and then the ring once committed),
//! holds them while a Block subscriber is full, answers attaches and history fetches, and
//! refuses what waits when a shard fails or its stream is deleted.
//!
//! It reads no clock (time comes in `Ctx::now`), spawns nothing and touches no file. What it
//! decides comes out of `drain_effects` as mesh messages to send and history reads to run;
//! the outcome of I/O comes back through `on_opened`, `on_acked`, `on_failed` and `on_read`.
//! The core driver (`core/mod.rs`) and the simulator (`core/sim`) are its two drivers.

use super::log::ShardLog;
use super::{Ctx, Life, Refusal, Refused};
use replicated::Serve;

mod durable;
mod replicated;
use crate::catalog::{core_for_shard, Catalog, Place};
use crate::core::{AttachOk, Fetched, MeshMsg, PublishReq, ShardKey, ToConn, ToOwner};
use crate::fanout::{Lag, ReplayRing, ShardOwner};
use crate::metrics::{CoreCounters, Histogram};
use felix_quic::idmap::IdMap;
use felix_quic::wire::{ErrorCode, Records, StartAt};
use felix_storage::LogError;
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// A message for a stream shard's owner: the stream part of what the mesh carries to owners.
#[derive(Debug)]
pub(crate) enum StreamMsg {
    Publish(PublishReq),
    Attach {
        core: u8,
        sub: u64,
        start: StartAt,
    },
    Fetch {
        core: u8,
        sub: u64,
        from: u64,
    },
    Detach {
        core: u8,
    },
    Parked {
        core: u8,
        parked: bool,
    },
    /// Try the next held publish (sent to itself behind the deliveries of the last append).
    DrainHeld,
}

/// What the host asks its driver to do.
pub(crate) enum Effect<L> {
    /// A message to a core (this one included: the driver queues it in the inbox).
    Send(u8, MeshMsg),
    /// Read history from `from` for subscriber `sub` of core `core`, then call `on_read`.
    /// Nothing at or past `upto` is read: the ring serves from there, and a replicated
    /// shard's log holds records past its commit mark that readers must not see.
    Read {
        key: ShardKey,
        log: L,
        core: u8,
        sub: u64,
        from: u64,
        upto: u64,
    },
    /// Records were committed on this shard (consumer groups may serve waiting polls).
    Committed(ShardKey),
    /// Messages that waited for the shard's log to open: handle them again, in order.
    Requeue(Vec<MeshMsg>),
}

/// Settings fixed for the host's life.
pub(crate) struct HostCfg {
    pub cores: usize,
    pub ring_records_max: u64,
    pub ring_bytes_max: u64,
    /// How long a held publish may wait (named in its `publish_timeout` refusal).
    pub publish_timeout_ms: u64,
}

/// A publish handed to the log, waiting for its commit.
struct Pending {
    req: PublishReq,
    range: Range<u64>,
    /// When it was handed to the log (the commit latency histogram).
    at: Instant,
}

struct Durable<L> {
    life: Life<L, MeshMsg>,
    /// In offset order: answered and delivered once the log acknowledges them.
    pending: VecDeque<Pending>,
    /// This shard's commit latency histogram (labelled stream and shard).
    commit_hist: Option<Arc<Histogram>>,
    /// A replicated shard (its log is its replica's, written by the replica's driver): what
    /// this broker may serve of it now. None for a shard of one copy.
    replica: Option<Serve>,
}

struct StreamShard<L> {
    owner: ShardOwner<PublishReq>,
    /// None for an ephemeral shard (the ring is all there is).
    durable: Option<Durable<L>>,
}

/// How an open ended.
pub(crate) enum OpenOutcome<L> {
    /// The shard serves from `next_offset`.
    Serving { next_offset: u64 },
    /// The open failed: the shard answers `unavailable`.
    Failed,
    /// The shard was deleted while its log opened: close this log and remove its files.
    Unwanted(Option<L>),
}

pub(crate) struct StreamHost<L> {
    cfg: HostCfg,
    /// Deterministic hashing (`IdMap`): iteration order is the same in every run, which the
    /// simulator's replays rely on.
    shards: IdMap<ShardKey, StreamShard<L>>,
    /// Held publishes over all shards (kept in step by `handle`, `tick` and `on_deleted`;
    /// `check_held_total` recounts it).
    held_total: usize,
    /// The logs are being closed for shutdown: their failures answer `shutting_down`.
    closing: bool,
    effects: Vec<Effect<L>>,
}

impl<L: ShardLog> StreamHost<L> {
    pub(crate) fn new(cfg: HostCfg) -> Self {
        StreamHost {
            cfg,
            shards: IdMap::default(),
            held_total: 0,
            closing: false,
            effects: Vec::new(),
        }
    }

    pub(crate) fn drain_effects(&mut self) -> Vec<Effect<L>> {
        std::mem::take(&mut self.effects)
    }

    fn send(&mut self, to: u8, msg: MeshMsg) {
        self.effects.push(Effect::Send(to, msg));
    }

    fn refuse_publish(&mut self, req: PublishReq, why: Refused) {
        self.send(
            req.origin.core,
            MeshMsg::Conn(ToConn::PublishResult {
                origin: req.origin,
                result: Err(why),
            }),
        );
    }

    /// The shard's state, created on first use (an ephemeral shard starts at offset 0).
    fn shard(&mut self, key: ShardKey) -> &mut StreamShard<L> {
        let cfg = &self.cfg;
        self.shards.entry(key).or_insert_with(|| StreamShard {
            owner: ShardOwner::new(
                key.1,
                cfg.cores,
                ReplayRing::new(cfg.ring_records_max, cfg.ring_bytes_max),
            ),
            durable: None,
        })
    }

    // ---------- what the rest of the core reads ----------

    /// The shard's next offset, if it has state here.
    pub(crate) fn tail(&self, key: ShardKey) -> Option<u64> {
        self.shards.get(&key).map(|s| s.owner.next_offset())
    }

    /// The shard's replay ring, if it has state here.
    pub(crate) fn ring(&self, key: ShardKey) -> Option<&ReplayRing> {
        self.shards.get(&key).map(|s| &s.owner.ring)
    }

    /// The log of a durable shard, whatever its state (None while opening or failed).
    pub(crate) fn log(&self, key: ShardKey) -> Option<&L> {
        self.durable(key).and_then(|d| d.life.log())
    }

    fn durable(&self, key: ShardKey) -> Option<&Durable<L>> {
        self.shards.get(&key).and_then(|s| s.durable.as_ref())
    }

    /// For a durable shard: its log, or the refusal every durable operation answers instead.
    /// None for a shard that is not durable here.
    pub(crate) fn usable(&self, key: ShardKey) -> Option<Result<&L, Refused>> {
        self.durable(key).map(|d| d.life.usable())
    }

    pub(crate) fn is_durable(&self, key: ShardKey) -> bool {
        self.durable(key).is_some()
    }

    /// Wait for the shard's log to open, if it is opening; otherwise hand `msg` back.
    pub(crate) fn defer(&mut self, key: ShardKey, msg: MeshMsg) -> Option<MeshMsg> {
        match self.shards.get_mut(&key).and_then(|s| s.durable.as_mut()) {
            Some(Durable {
                life: Life::Opening { deferred },
                ..
            }) => {
                deferred.push(msg);
                None
            }
            _ => Some(msg),
        }
    }

    /// Shards with held publishes, and how many each holds.
    #[cfg(test)]
    pub(crate) fn held(&self) -> impl Iterator<Item = (ShardKey, usize)> + '_ {
        self.shards
            .iter()
            .filter(|(_, s)| !s.owner.held.is_empty())
            .map(|(k, s)| (*k, s.owner.held.len()))
    }

    pub(crate) fn held_total(&self) -> usize {
        self.held_total
    }

    /// The hand-kept `held_total` against what it counts.
    pub(crate) fn check_held_total(&self) -> bool {
        self.held_total
            == self
                .shards
                .values()
                .map(|s| s.owner.held.len())
                .sum::<usize>()
    }

    /// Some publish on a durable shard waits for its commit.
    pub(crate) fn commit_pending(&self) -> bool {
        self.shards
            .values()
            .any(|s| s.durable.as_ref().is_some_and(|d| !d.pending.is_empty()))
    }

    /// Nothing owed: no publish held, waiting for a commit, or waiting for an open.
    pub(crate) fn idle(&self) -> bool {
        debug_assert!(
            self.check_held_total(),
            "held_total counts the held publishes"
        );
        self.held_total == 0
            && self.shards.values().all(|s| {
                s.durable.as_ref().is_none_or(|d| {
                    d.pending.is_empty()
                        && !matches!(&d.life, Life::Opening { deferred } if !deferred.is_empty())
                })
            })
    }

    /// Shutdown: every open log is about to be closed; return them (a replicated shard's
    /// log is its replica's, closed with the replicas). A failure reported by a log from now
    /// on is the close, and answers what still waits `shutting_down`.
    pub(crate) fn begin_close(&mut self) -> Vec<L> {
        self.closing = true;
        self.shards
            .values()
            .filter_map(|s| s.durable.as_ref().filter(|d| d.replica.is_none()))
            .filter_map(|d| d.life.log().cloned())
            .collect()
    }

    /// The earliest moment a held publish times out.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        if self.held_total == 0 {
            return None;
        }
        self.shards
            .values()
            .flat_map(|s| s.owner.held.iter().map(|r| r.deadline))
            .min()
    }

    // ---------- messages ----------

    pub(crate) fn handle(&mut self, key: ShardKey, msg: StreamMsg, ctx: &Ctx) {
        match msg {
            StreamMsg::Publish(req) => self.publish(key, req, ctx),
            StreamMsg::Attach { core, sub, start } => self.attach(key, core, sub, start, ctx),
            StreamMsg::Fetch { core, sub, from } => self.fetch(key, core, sub, from, ctx),
            StreamMsg::Detach { core } => {
                // Only a deleted stream's shard state is ever dropped (slots are not reused),
                // so a Detach for state that is gone is a late one for a deleted stream.
                let Some(s) = self.shards.get_mut(&key) else {
                    return;
                };
                s.owner.detach(core as usize);
                self.drop_if_deleted_and_idle(key, ctx.catalog);
            }
            StreamMsg::Parked { core, parked } => {
                let Some(s) = self.shards.get_mut(&key) else {
                    return;
                };
                #[cfg(test)]
                if !parked && breaks::on(&breaks::IGNORE_UNPARK) {
                    return;
                }
                s.owner.set_parked(core as usize, parked);
                if !parked {
                    self.drain_held(key, ctx);
                }
            }
            StreamMsg::DrainHeld => self.drain_held(key, ctx),
        }
    }

    fn publish(&mut self, key: ShardKey, req: PublishReq, ctx: &Ctx) {
        if let Err(e) = ctx.catalog.serve_check(key.0, key.1) {
            return self.refuse_publish(req, e.into());
        }
        // A replicated shard's publishes go to its replica (`core/replica_host.rs`).
        debug_assert!(!ctx.catalog.replicated(key.0, key.1), "{key:?}");
        let o = &mut self.shard(key).owner;
        if o.holding() || !o.held.is_empty() {
            o.held.push_back(req);
            self.held_total += 1;
            CoreCounters::inc(&ctx.counters.publishes_held);
            return;
        }
        self.append(key, req, ctx);
    }

    fn append(&mut self, key: ShardKey, req: PublishReq, ctx: &Ctx) {
        let Some(d) = self.shards.get_mut(&key).and_then(|s| s.durable.as_mut()) else {
            return self.publish_committed(key, req, ctx);
        };
        // Durable: queue into the log now; answer and deliver when the commit completes.
        let why = match d.life.usable() {
            Err(e) => e,
            Ok(log) => {
                let payloads: Vec<bytes::Bytes> = req.records.iter().collect();
                match log.append(&payloads, ctx.ts_ms) {
                    Ok(range) => {
                        debug_assert_eq!(range.end - range.start, req.records.count() as u64);
                        #[cfg(test)]
                        if breaks::on(&breaks::ACK_BEFORE_COMMIT) {
                            let origin = req.origin;
                            let result = Ok((key.1, range.start, req.records.count()));
                            self.effects.push(Effect::Send(
                                origin.core,
                                MeshMsg::Conn(ToConn::PublishResult { origin, result }),
                            ));
                        }
                        d.pending.push_back(Pending {
                            req,
                            range,
                            at: ctx.now,
                        });
                        return;
                    }
                    Err(LogError::Backpressure { pending_bytes }) => Refusal::new(
                        ErrorCode::Unavailable,
                        format!(
                            "shard storage has {pending_bytes} bytes waiting to be written; retry"
                        ),
                    ),
                    Err(LogError::TooLarge { bytes, max }) => Refusal::new(
                        ErrorCode::PayloadTooLarge,
                        format!("a batch of {bytes} bytes exceeds the storage commit limit {max}"),
                    ),
                    Err(e) => Refusal::new(ErrorCode::Unavailable, format!("shard storage: {e}")),
                }
            }
        };
        CoreCounters::inc(&ctx.counters.durable_publishes_refused);
        self.refuse_publish(req, why);
    }

    /// Give the records their offsets in the ring, send one copy of the batch to every core
    /// with subscribers, answer the publish.
    fn publish_committed(&mut self, key: ShardKey, req: PublishReq, ctx: &Ctx) {
        let batch = self.append_and_deliver(key, &req.records, ctx);
        let result = Ok((key.1, batch.first_offset, batch.count));
        let origin = req.origin;
        self.send(
            origin.core,
            MeshMsg::Conn(ToConn::PublishResult { origin, result }),
        );
        if self.is_durable(key) {
            self.effects.push(Effect::Committed(key));
        }
    }

    /// Give `records` the shard's next offsets in the ring and send one copy of the batch to
    /// every core with subscribers.
    fn append_and_deliver(
        &mut self,
        key: ShardKey,
        records: &Records,
        ctx: &Ctx,
    ) -> crate::fanout::Batch {
        let o = &mut self.shard(key).owner;
        let before = o.next_offset();
        let batch = o.append(records);
        assert_eq!(
            batch.first_offset, before,
            "offsets are contiguous per shard"
        );
        let cores: Vec<usize> = o.interested_cores().collect();
        let c = ctx.counters;
        CoreCounters::inc(&c.batches_appended);
        CoreCounters::add(&c.records_appended, batch.count as u64);
        CoreCounters::add(&c.bytes_appended, records.payload_bytes() as u64);
        for core in cores {
            if core as u8 != ctx.me {
                CoreCounters::inc(&c.mesh_deliveries_out);
            }
            let delivery = MeshMsg::Conn(ToConn::Delivery {
                stream: key.0,
                shard: key.1,
                batch: batch.clone(),
            });
            self.send(core as u8, delivery);
        }
        batch
    }

    /// Tell each of `cores` that the subscriptions to shard `key` end, with `why`.
    fn end_subs(&mut self, key: ShardKey, cores: Vec<usize>, why: &Refused) {
        for core in cores {
            let msg = ToConn::SubsEnded {
                stream: key.0,
                shard: key.1,
                why: why.clone(),
            };
            self.send(core as u8, MeshMsg::Conn(msg));
        }
    }

    /// Append held publishes while nothing is parked: one at a time, each followed by a
    /// self-message so this core's subscribers see the batch (and may park) first.
    fn drain_held(&mut self, key: ShardKey, ctx: &Ctx) {
        if !self.shards.contains_key(&key) && ctx.catalog.slot(key.0).deleted {
            return; // a deleted stream's state is gone; do not create it again
        }
        loop {
            let o = &mut self.shard(key).owner;
            if o.holding() {
                return;
            }
            let Some(req) = o.held.pop_front() else {
                return;
            };
            self.held_total -= 1;
            if req.deadline <= ctx.now {
                self.time_out(req, ctx);
                continue;
            }
            self.append(key, req, ctx);
            if !self.shard(key).owner.held.is_empty() {
                self.send(
                    ctx.me,
                    MeshMsg::Owner(ToOwner::DrainHeld {
                        stream: key.0,
                        shard: key.1,
                    }),
                );
            }
            return;
        }
    }

    fn time_out(&mut self, req: PublishReq, ctx: &Ctx) {
        CoreCounters::inc(&ctx.counters.publish_timeouts);
        let msg = format!(
            "a Block subscriber stayed full for {} ms; the publish was not appended",
            self.cfg.publish_timeout_ms
        );
        self.refuse_publish(req, Refusal::new(ErrorCode::PublishTimeout, msg));
    }

    /// The clock moved: answer held publishes past their deadline `publish_timeout`.
    pub(crate) fn tick(&mut self, ctx: &Ctx) {
        if self.held_total == 0 {
            return;
        }
        let mut expired = Vec::new();
        for s in self.shards.values_mut() {
            let held = &mut s.owner.held;
            if held.iter().any(|r| r.deadline <= ctx.now) {
                let (dead, keep): (VecDeque<_>, VecDeque<_>) =
                    held.drain(..).partition(|r| r.deadline <= ctx.now);
                *held = keep;
                expired.extend(dead);
            }
        }
        self.held_total -= expired.len();
        for req in expired {
            self.time_out(req, ctx);
        }
    }

    fn attach(&mut self, key: ShardKey, core: u8, sub: u64, start: StartAt, ctx: &Ctx) {
        let result = self.attach_result(key, core, start, ctx);
        self.send(core, MeshMsg::Conn(ToConn::AttachResult { sub, result }));
    }

    fn attach_result(
        &mut self,
        key: ShardKey,
        core: u8,
        start: StartAt,
        ctx: &Ctx,
    ) -> Result<AttachOk, Refused> {
        let (stream, shard) = key;
        if ctx.catalog.slot(stream).deleted {
            // No state is (re)created for a deleted stream: the subscriber's later Detach
            // finds none and is ignored. If state is still there (other subscribers not yet
            // detached), count this attach so that Detach stays balanced.
            if let Some(s) = self.shards.get_mut(&key) {
                s.owner.attach(core as usize);
            }
            let name = ctx.catalog.slot(stream).def.name();
            return Err(Refusal::new(
                ErrorCode::StreamDeleted,
                format!("stream {name} was deleted"),
            ));
        }
        // Interest counts every attach, even a refused one, so the subscriber's core can
        // always answer its removal with one Detach.
        self.shard(key).owner.attach(core as usize);
        ctx.catalog.serve_check(stream, shard)?;
        self.replica_check(key, ctx)?;
        let s = &self.shards[&key];
        let o = &s.owner;
        let next = o.next_offset();
        let Some(d) = &s.durable else {
            let oldest = o.ring.oldest().unwrap_or(next);
            let from = match start {
                StartAt::Latest => next,
                StartAt::Earliest => oldest,
                StartAt::Offset(x) if x <= next => x,
                StartAt::Offset(x) => {
                    return Err(Refusal::new(
                        ErrorCode::InvalidRequest,
                        format!("offset {x} is beyond the end of the shard ({next})"),
                    ))
                }
            };
            let (lag, replay) = o.ring.replay_from(shard, from);
            return Ok(AttachOk {
                lag,
                replay,
                from,
                catch_up: false,
            });
        };
        let oldest = d.life.usable()?.oldest_offset();
        let from = match start {
            StartAt::Latest => next,
            StartAt::Earliest => oldest,
            StartAt::Offset(x) if x < oldest => {
                return Err(Refusal::new(
                    ErrorCode::RevisionTooOld,
                    format!(
                        "offset {x} is below retention; the oldest retained offset is {oldest}"
                    ),
                ))
            }
            StartAt::Offset(x) if x > next => {
                return Err(Refusal::new(
                    ErrorCode::InvalidRequest,
                    format!("offset {x} is beyond the tail of the shard ({next})"),
                ))
            }
            StartAt::Offset(x) => x,
        };
        if from >= o.ring.oldest().unwrap_or(next) {
            let (lag, replay) = o.ring.replay_from(shard, from);
            debug_assert!(lag.is_none());
            return Ok(AttachOk {
                lag,
                replay,
                from,
                catch_up: false,
            });
        }
        Ok(AttachOk {
            lag: None,
            replay: vec![],
            from,
            catch_up: true,
        })
    }

    /// The next history chunk for a catching-up subscriber: from the ring (and live) once
    /// `from` is inside it, else a read of the log (appends go on meanwhile).
    fn fetch(&mut self, key: ShardKey, core: u8, sub: u64, from: u64, ctx: &Ctx) {
        if let Err(e) = self.replica_check(key, ctx) {
            let result = Err(e);
            return self.send(core, MeshMsg::Conn(ToConn::FetchResult { sub, result }));
        }
        let log = match self.usable(key) {
            Some(Ok(log)) => log.clone(),
            Some(Err(e)) => {
                return self.send(
                    core,
                    MeshMsg::Conn(ToConn::FetchResult {
                        sub,
                        result: Err(e),
                    }),
                )
            }
            None => {
                let e = Refusal::new(ErrorCode::Unavailable, "not a durable shard");
                return self.send(
                    core,
                    MeshMsg::Conn(ToConn::FetchResult {
                        sub,
                        result: Err(e),
                    }),
                );
            }
        };
        let o = &self.shards[&key].owner;
        if from >= o.ring.oldest().unwrap_or(o.next_offset()) {
            let (_, batches) = o.ring.replay_from(key.1, from);
            let result = Ok(Fetched {
                lag: None,
                batches,
                live: true,
            });
            return self.send(core, MeshMsg::Conn(ToConn::FetchResult { sub, result }));
        }
        CoreCounters::inc(&ctx.counters.history_reads);
        let upto = o.ring.oldest().unwrap_or(o.next_offset());
        self.effects.push(Effect::Read {
            key,
            log,
            core,
            sub,
            from,
            upto,
        });
    }

    /// A history read finished: `Ok(None)` read nothing, `Ok(Some((first, records)))` read
    /// records from offset `first`.
    pub(crate) fn on_read(
        &mut self,
        key: ShardKey,
        (core, sub, from): (u8, u64, u64),
        r: Result<Option<(u64, Records)>, LogError>,
        ctx: &Ctx,
    ) {
        let result = match r {
            Ok(Some((first, records))) => {
                CoreCounters::add(&ctx.counters.history_records_read, records.count() as u64);
                debug_assert_eq!(first, from, "a read starts where it was asked");
                Ok(Fetched {
                    lag: None,
                    batches: vec![crate::fanout::Batch::new(key.1, first, &records)],
                    live: false,
                })
            }
            // Nothing to read below the ring is impossible (the ring holds only committed
            // records); answer with the ring so the subscriber can go live.
            Ok(None) => {
                let o = &self.shard(key).owner;
                let (_, batches) = o.ring.replay_from(key.1, from);
                Ok(Fetched {
                    lag: None,
                    batches,
                    live: true,
                })
            }
            Err(LogError::BelowRetention { oldest, .. }) => Ok(Fetched {
                lag: Some(Lag {
                    from_offset: from,
                    lost: oldest - from,
                }),
                batches: vec![],
                live: false,
            }),
            Err(e) => Err(Refusal::new(
                ErrorCode::Unavailable,
                format!("history read failed: {e}"),
            )),
        };
        self.send(core, MeshMsg::Conn(ToConn::FetchResult { sub, result }));
    }
}

/// Test-build switches that break one rule each, so the simulator's negative twins can show
/// that its checkers catch the break (`core::sim::scenarios`).
#[cfg(test)]
pub(crate) mod breaks {
    use std::sync::atomic::AtomicBool;
    /// Answer a durable publish when it is handed to the log, before its commit.
    pub(crate) static ACK_BEFORE_COMMIT: AtomicBool = AtomicBool::new(false);
    /// Ignore the notice that a core's Block subscribers are no longer full.
    pub(crate) static IGNORE_UNPARK: AtomicBool = AtomicBool::new(false);
    /// Leave a failed shard's subscriptions open (untold).
    pub(crate) static SILENT_FAILURE: AtomicBool = AtomicBool::new(false);

    pub(crate) fn on(b: &AtomicBool) -> bool {
        b.load(std::sync::atomic::Ordering::Relaxed)
    }
}

//! The shard owner's side of streams: appending publishes (ephemeral rings, durable logs),
//! holding them for Block subscribers, and answering attaches and history fetches.

use super::*;

impl CoreState {
    pub(in crate::core) fn owner_core(&self, stream: u32, shard: u32) -> u8 {
        let def = &self.catalog.slot(stream).def;
        core_for_shard(&def.name(), shard, self.s.cores as u32) as u8
    }

    pub(in crate::core) fn owner(
        &mut self,
        stream: u32,
        shard: u32,
    ) -> &mut ShardOwner<PublishReq> {
        debug_assert_eq!(
            self.owner_core(stream, shard),
            self.id,
            "only the owner core holds shard state"
        );
        let cfg = &self.s.cfg;
        let cores = self.s.cores as usize;
        self.owned.entry((stream, shard)).or_insert_with(|| {
            ShardOwner::new(
                shard,
                cores,
                ReplayRing::new(cfg.ring_records_max as u64, cfg.ring_bytes_max),
            )
        })
    }

    // ---------- owner side ----------

    pub(in crate::core) fn on_publish_at_owner(&mut self, req: PublishReq) {
        if let Err(e) = self.catalog.serve_check(req.stream, req.shard) {
            self.route(
                req.origin.core,
                MeshMsg::PublishResult {
                    origin: req.origin,
                    result: Err(e),
                },
            );
            return;
        }
        let o = self.owner(req.stream, req.shard);
        if o.holding() || !o.held.is_empty() {
            o.held.push_back(req);
            self.held_total += 1;
            CoreCounters::inc(&self.s.counters.publishes_held);
            return;
        }
        self.append(req);
    }

    pub(in crate::core) fn append(&mut self, req: PublishReq) {
        let key = (req.stream, req.shard);
        let Some(d) = self.durable.get_mut(&key) else {
            self.publish_committed(req);
            return;
        };
        // Durable: queue into the log now; answer and deliver when the commit completes.
        let (code, msg) = match d.usable() {
            Err(e) => e,
            Ok(log) => {
                let recs: Vec<bytes::Bytes> = req.records.iter().collect();
                let ins: Vec<RecordIn> = recs.iter().map(|p| RecordIn::new(p)).collect();
                match log.append(&ins, felix_storage::log::now_ms()) {
                    Ok(range) => {
                        d.pending.push_back((req, range, Instant::now()));
                        return;
                    }
                    Err(LogError::Backpressure { pending_bytes }) => (
                        ErrorCode::Unavailable,
                        format!(
                            "shard storage has {pending_bytes} bytes waiting to be written; retry"
                        ),
                    ),
                    Err(LogError::TooLarge { bytes, max }) => (
                        ErrorCode::PayloadTooLarge,
                        format!("a batch of {bytes} bytes exceeds the storage commit limit {max}"),
                    ),
                    Err(e) => (ErrorCode::Unavailable, format!("shard storage: {e}")),
                }
            }
        };
        CoreCounters::inc(&self.s.counters.durable_publishes_refused);
        self.route(
            req.origin.core,
            MeshMsg::PublishResult {
                origin: req.origin,
                result: Err((code, msg)),
            },
        );
    }

    pub(in crate::core) fn publish_committed(&mut self, req: PublishReq) {
        let (stream, shard) = (req.stream, req.shard);
        let o = self.owner(stream, shard);
        let batch = o.append(&req.records);
        let cores: Vec<usize> = o.interested_cores().collect();
        let c = self.s.counters.clone();
        CoreCounters::inc(&c.batches_appended);
        CoreCounters::add(&c.records_appended, batch.count as u64);
        CoreCounters::add(&c.bytes_appended, req.records.payload_bytes() as u64);
        let result = Ok((shard, batch.first_offset, batch.count));
        for core in cores {
            if core as u8 != self.id {
                CoreCounters::inc(&c.mesh_deliveries_out);
            }
            self.route(
                core as u8,
                MeshMsg::Delivery {
                    stream,
                    shard,
                    batch: batch.clone(),
                },
            );
        }
        self.route(
            req.origin.core,
            MeshMsg::PublishResult {
                origin: req.origin,
                result,
            },
        );
        if self.groups.contains_key(&(stream, shard)) {
            self.groups_records_committed((stream, shard));
        }
    }

    /// Append held publishes while nothing is parked: one at a time, each followed by a
    /// self-message so this core's subscribers see the batch (and may park) first.
    pub(in crate::core) fn drain_held(&mut self, stream: u32, shard: u32) {
        if !self.owned.contains_key(&(stream, shard)) && self.catalog.slot(stream).deleted {
            return; // a deleted stream's state is gone; do not create it again
        }
        let now = Instant::now();
        loop {
            let o = self.owner(stream, shard);
            if o.holding() {
                return;
            }
            let Some(req) = o.held.pop_front() else {
                return;
            };
            self.held_total -= 1;
            if req.deadline <= now {
                self.time_out(req);
                continue;
            }
            self.append(req);
            if !self.owner(stream, shard).held.is_empty() {
                self.route(self.id, MeshMsg::DrainHeld { stream, shard });
            }
            return;
        }
    }

    pub(in crate::core) fn time_out(&mut self, req: PublishReq) {
        CoreCounters::inc(&self.s.counters.publish_timeouts);
        let msg = format!(
            "a Block subscriber stayed full for {} ms; the publish was not appended",
            self.s.cfg.publish_timeout_ms
        );
        self.route(
            req.origin.core,
            MeshMsg::PublishResult {
                origin: req.origin,
                result: Err((ErrorCode::PublishTimeout, msg)),
            },
        );
    }

    pub(in crate::core) fn expire_held(&mut self, now: Instant) {
        if self.held_total == 0 {
            return;
        }
        let mut expired = Vec::new();
        for o in self.owned.values_mut() {
            if o.held.iter().any(|r| r.deadline <= now) {
                let (dead, keep): (VecDeque<_>, VecDeque<_>) =
                    o.held.drain(..).partition(|r| r.deadline <= now);
                o.held = keep;
                expired.extend(dead);
            }
        }
        self.held_total -= expired.len();
        for req in expired {
            self.time_out(req);
        }
    }

    pub(in crate::core) fn on_attach(
        &mut self,
        core: u8,
        sub: u64,
        stream: u32,
        shard: u32,
        start: StartAt,
    ) {
        if self.catalog.slot(stream).deleted {
            // No state is (re)created for a deleted stream: the subscriber's later Detach
            // finds none and is ignored. If state is still there (other subscribers not yet
            // detached), count this attach so that Detach stays balanced.
            if let Some(o) = self.owned.get_mut(&(stream, shard)) {
                o.attach(core as usize);
            }
            let name = self.catalog.slot(stream).def.name();
            self.route(
                core,
                MeshMsg::AttachResult {
                    sub,
                    result: Err((
                        ErrorCode::StreamDeleted,
                        format!("stream {name} was deleted"),
                    )),
                },
            );
            return;
        }
        // Interest counts every attach, even a refused one, so the subscriber's core can
        // always answer its removal with one Detach.
        self.owner(stream, shard).attach(core as usize);
        if let Err(e) = self.catalog.serve_check(stream, shard) {
            self.route(
                core,
                MeshMsg::AttachResult {
                    sub,
                    result: Err(e),
                },
            );
            return;
        }
        if let Some(d) = self.durable.get(&(stream, shard)) {
            let result = match d.usable() {
                Err(e) => Err(e),
                Ok(log) => {
                    let oldest = log.oldest_offset();
                    let o = self.owned.get(&(stream, shard)).expect("attached above");
                    let next = o.next_offset();
                    let from = match start {
                        StartAt::Latest => Ok(next),
                        StartAt::Earliest => Ok(oldest),
                        StartAt::Offset(x) if x < oldest => Err((
                            ErrorCode::RevisionTooOld,
                            format!("offset {x} is below retention; the oldest retained offset is {oldest}"),
                        )),
                        StartAt::Offset(x) if x > next => Err((
                            ErrorCode::InvalidRequest,
                            format!("offset {x} is beyond the tail of the shard ({next})"),
                        )),
                        StartAt::Offset(x) => Ok(x),
                    };
                    from.map(|from| {
                        if from >= o.ring.oldest().unwrap_or(next) {
                            let (lag, replay) = o.ring.replay_from(shard, from);
                            debug_assert!(lag.is_none());
                            AttachOk {
                                lag,
                                replay,
                                from,
                                catch_up: false,
                            }
                        } else {
                            AttachOk {
                                lag: None,
                                replay: vec![],
                                from,
                                catch_up: true,
                            }
                        }
                    })
                }
            };
            self.route(core, MeshMsg::AttachResult { sub, result });
            return;
        }
        let o = self.owner(stream, shard);
        let next = o.next_offset();
        let oldest = o.ring.oldest().unwrap_or(next);
        let from = match start {
            StartAt::Latest => Ok(next),
            StartAt::Earliest => Ok(oldest),
            StartAt::Offset(x) if x <= next => Ok(x),
            StartAt::Offset(x) => Err((
                ErrorCode::InvalidRequest,
                format!("offset {x} is beyond the end of the shard ({next})"),
            )),
        };
        let result = from.map(|from| {
            let (lag, replay) = o.ring.replay_from(shard, from);
            AttachOk {
                lag,
                replay,
                from,
                catch_up: false,
            }
        });
        self.route(core, MeshMsg::AttachResult { sub, result });
    }

    /// Owner: the next history chunk for a catching-up subscriber. From the ring (and live)
    /// once `from` is inside it, else read from disk on a task (appends go on meanwhile).
    pub(in crate::core) fn on_fetch(
        &mut self,
        core: u8,
        sub: u64,
        stream: u32,
        shard: u32,
        from: u64,
    ) {
        let key = (stream, shard);
        let log = match self.durable.get(&key).map(DurableShard::usable) {
            Some(Ok(log)) => log.clone(),
            Some(Err(e)) => {
                self.route(
                    core,
                    MeshMsg::FetchResult {
                        sub,
                        result: Err(e),
                    },
                );
                return;
            }
            None => {
                self.route(
                    core,
                    MeshMsg::FetchResult {
                        sub,
                        result: Err((ErrorCode::Unavailable, "not a durable shard".into())),
                    },
                );
                return;
            }
        };
        let o = self.owner(stream, shard);
        let next = o.next_offset();
        if from >= o.ring.oldest().unwrap_or(next) {
            let (_, batches) = o.ring.replay_from(shard, from);
            self.route(
                core,
                MeshMsg::FetchResult {
                    sub,
                    result: Ok(Fetched {
                        lag: None,
                        batches,
                        live: true,
                    }),
                },
            );
            return;
        }
        let weak = self.me.clone();
        let bytes_max = self.s.cfg.history_fetch_bytes;
        CoreCounters::inc(&self.s.counters.history_reads);
        glommio::spawn_local(async move {
            let r = log.read(from, 4096, bytes_max).await;
            let Some(st) = weak.upgrade() else { return };
            let mut st = st.borrow_mut();
            let result = match r {
                Ok(recs) if !recs.is_empty() => {
                    CoreCounters::add(&st.s.counters.history_records_read, recs.len() as u64);
                    let first = recs[0].offset;
                    let records =
                        felix_quic::wire::Records::encode(recs.iter().map(|r| &r.payload[..]));
                    Ok(Fetched {
                        lag: None,
                        batches: vec![Batch::new(shard, first, &records)],
                        live: false,
                    })
                }
                // Nothing to read below the ring is impossible (the ring holds only committed
                // records); answer with the ring so the subscriber can go live.
                Ok(_) => {
                    let o = st.owner(stream, shard);
                    let (_, batches) = o.ring.replay_from(shard, from);
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
                Err(e) => Err((ErrorCode::Unavailable, format!("history read failed: {e}"))),
            };
            st.route(core, MeshMsg::FetchResult { sub, result });
            st.drain_inbox();
            st.wake.wake();
        })
        .detach();
    }
}

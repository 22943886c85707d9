//! The shards this broker hosts as a replica (issue 23's data path; **partial**): for each
//! shard of a replicated stream whose replica set names this broker, owned by this core, a
//! task runs a [`ReplicaDriver`] over the shard's directory. Its inputs come from the peer
//! links (`ToOwner::Replica`), the catalog (an assignment when placement names this broker
//! the leader of a newer generation), publishes (`replica_publish`), the control plane
//! (report answers, taken from the [`crate::replica_reports::ReportBox`] each flush round)
//! and its own tick; its outputs go to the peer links (`Links::send_replica`), to the control
//! plane (reports), to the publishers (answers) and to the stream host (the committed
//! records readers may see, `shard/stream/replicated.rs`).
//!
//! A publish is answered when its batch is written on the leader (`leader` consistency) or
//! when the commit mark passes it (`quorum`); a batch the leader cannot vouch for (its quorum
//! wait ran out, the leader was deposed, the replica failed) is answered `outcome_unknown`.
//! A replica the catalog no longer names ends (its files stay: the broker was replaced in the
//! set, rule 11, and may be swapped in again), and a deleted stream's files go. A broker the
//! catalog swaps into a set hosts the replica from an empty log (or what it kept). An
//! assignment carries the generation's set and the settled set its fence must cover. Not
//! built yet: consumer groups.

use super::replica::{NotLeader, ReplicaCfg};
use super::replica_driver::{Input, Output, ReplicaDriver};
use super::*;
use crate::replica_reports::ReportJob;
use felix_control::replication::Assignment;
use felix_quic::wire::replica::{ReplicaMsg, ShardRef, ShippedRecord};
use felix_quic::wire::Records;
use glommio::channels::local_channel::{self, LocalReceiver, LocalSender};
use std::ops::Range;

/// Inputs queued per hosted replica; past it, one is dropped (the protocol sends again).
const REPLICA_INPUTS_MAX: usize = 1024;
/// How often a hosted replica's machine is ticked: lease renewals, retries, reports.
const REPLICA_TICK: Duration = Duration::from_millis(50);
/// Inputs already queued that one step of a replica takes together, at most: their appends
/// share one wait for the log (a group commit).
const REPLICA_INPUTS_PER_STEP_MAX: usize = 256;
/// Publishes a named leader holds while it is not serving yet, at most (well under
/// [`REPLICA_INPUTS_MAX`], since they are proposed again together).
const HELD_PUBLISHES_MAX: usize = 256;
/// Held publishes are proposed again at most this often, and at once when the replica is
/// elected or starts serving: proposing them after every batch of outputs made the refusals
/// of one batch the proposals of the next, a loop that kept the core busy.
const HELD_RETRY_EVERY: Duration = Duration::from_millis(20);
/// How often the held publishes are checked for their deadline and their leader.
const HELD_CHECK_EVERY: Duration = Duration::from_millis(10);

pub(in crate::core) struct Hosted {
    tx: LocalSender<Input>,
    ident: ShardRef,
    /// The newest generation this replica was assigned to lead (0: none).
    assigned: u64,
    /// Its log, once open: flushed and closed with the core's other logs at shutdown.
    log: Option<Log>,
    /// Publishes are acknowledged at the commit mark (else once written on the leader).
    quorum: bool,
    /// Publishes handed to the replica, waiting for `Proposed` or `NotTaken`, in order (the
    /// driver answers its inputs in the order it takes them), with the deadline of their hold
    /// if they were held before.
    proposing: VecDeque<(PublishReq, Option<Instant>)>,
    /// Publishes this broker, named leader, could not take yet (its replica fences, or waits
    /// out the old lease, rule 4): nothing appended, proposed again after each batch of the
    /// replica's outputs, in arrival order (a publish arriving while some are held is held
    /// behind them), until taken, refused, or past the deadline (`--publish-timeout-ms` from
    /// the first refusal). So a failover or a planned hand-off delays publishes instead of
    /// refusing them.
    held: VecDeque<(PublishReq, Instant)>,
    /// The held publishes are proposed again no sooner than this (see `retry_held`).
    retry_at: Instant,
    /// `quorum` publishes written (when), waiting for `Ack` or `CannotVouch`, in offset
    /// order.
    waiting: VecDeque<(Range<u64>, PublishReq, Instant)>,
}

#[derive(Default)]
pub(in crate::core) struct ReplicaHost {
    shards: HashMap<ShardKey, Hosted>,
    /// When `replica_held_tick` last looked at the held publishes.
    held_checked: Option<Instant>,
}

/// What a replica task opens.
struct OpenReplica {
    me: u64,
    sid: u64,
    set: Vec<u64>,
    dir: std::path::PathBuf,
    log_cfg: felix_storage::LogConfig,
    cfg: ReplicaCfg,
}

impl CoreState {
    /// Host every replica the catalog names this broker for (on this core) that is not
    /// hosted yet, and assign the leadership placement gave this broker. Run after every
    /// catalog change.
    pub(in crate::core) fn refresh_replicas(&mut self) {
        if self.closing_logs {
            return; // shutting down: the hosted replicas' logs are closed
        }
        let node = self.s.cfg.node_id;
        let Some(&sid) = self.catalog.storage_ids.get(&node) else {
            // Not registered with an identity: nothing to vouch with (rule 9).
            tracing::debug!(
                node,
                "no storage identity in the catalog yet: no replica hosted"
            );
            return;
        };
        let Some(root) = self.s.cfg.durable_storage_dir.clone() else {
            return; // no durable storage: no log to replicate (a durable stream refuses here)
        };
        let mut wanted = Vec::new();
        for idx in 0..self.catalog.slots().len() as u32 {
            let slot = self.catalog.slot(idx);
            if slot.deleted || !slot.def.durable {
                continue;
            }
            for (shard, place) in slot.places.iter().enumerate() {
                let Place::Replicated {
                    leader,
                    generation,
                    replicas,
                    settled,
                    ..
                } = place
                else {
                    continue;
                };
                if replicas.contains(&node) && self.owner_core(idx, shard as u32) == self.id {
                    let lead = (*leader == node).then_some(*generation);
                    // `settled` is empty once the set settled: the machine reads that as the set.
                    let settled = settled.clone();
                    wanted.push(((idx, shard as u32), replicas.clone(), lead, settled));
                }
            }
        }
        // Hosted replicas the catalog no longer names here (the stream deleted, or this
        // broker out of the set): their tasks end; a deleted stream's files go too.
        let gone: Vec<ShardKey> = self
            .replicas
            .shards
            .keys()
            .copied()
            .filter(|k| !wanted.iter().any(|(w, ..)| w == k))
            .collect();
        for key in gone {
            let mut h = self.replicas.shards.remove(&key).expect("listed above");
            let slot = self.catalog.slot(key.0).clone();
            tracing::info!(stream = %h.ident.stream, shard = key.1, deleted = slot.deleted, "no longer hosting a replica");
            let why = format!(
                "shard {} of {} is no longer replicated on this broker",
                key.1, h.ident.stream
            );
            self.fail_publishes(&mut h, &why);
            let end = Refusal::new(ErrorCode::NotLeader, why);
            self.with_streams(|s, _| s.replica_unhosted(key, end));
            if slot.deleted {
                durable::remove_deleted_shard(h.log, Some(root.clone()), &slot, key.1);
            } else if let Some(log) = h.log {
                glommio::spawn_local(async move {
                    let _ = log.close().await;
                })
                .detach();
            }
        }
        for (key, set, lead, settled) in wanted {
            if !self.replicas.shards.contains_key(&key) {
                self.host_replica(&root, key, sid, set.clone());
            }
            let Some(h) = self.replicas.shards.get_mut(&key) else {
                continue;
            };
            if let Some(gen) = lead.filter(|&g| g > h.assigned) {
                h.assigned = gen;
                // Rule 11: the generation's set and the settled set, which its fence covers.
                let a = Assignment {
                    gen,
                    leader: node,
                    sid,
                    set,
                    settled,
                };
                if h.tx.try_send(Input::Assign(a)).is_err() {
                    CoreCounters::inc(&self.s.counters.replica_inputs_dropped);
                }
            }
        }
    }

    fn host_replica(&mut self, root: &std::path::Path, key: ShardKey, sid: u64, set: Vec<u64>) {
        let slot = self.catalog.slot(key.0).clone();
        let open = OpenReplica {
            me: self.s.cfg.node_id,
            sid,
            set,
            dir: durable::slot_shard_dir(root, &slot.def.name(), slot.incarnation, key.1),
            log_cfg: self.observed(durable::log_config(&self.s.cfg, &slot.def)),
            cfg: ReplicaCfg::from_config(&self.s.cfg),
        };
        let ident = ShardRef {
            stream: slot.def.name(),
            incarnation: slot.incarnation,
            shard: key.1,
        };
        tracing::info!(stream = %ident.stream, shard = key.1, "hosting a replica");
        let (tx, rx) = local_channel::new_bounded(REPLICA_INPUTS_MAX);
        self.replicas.shards.insert(
            key,
            Hosted {
                tx,
                ident,
                assigned: 0,
                log: None,
                quorum: slot.def.quorum,
                proposing: VecDeque::new(),
                held: VecDeque::new(),
                retry_at: Instant::now(),
                waiting: VecDeque::new(),
            },
        );
        self.streams.replica_begin(key);
        let serving = ServingLog::new(self.replicas.shards[&key].ident.clone());
        glommio::spawn_local(run_replica(self.me.clone(), key, open, rx, serving)).detach();
    }

    /// A replica message for a shard this core owns: to its replica, if hosted.
    pub(in crate::core) fn on_replica_msg(
        &mut self,
        key: ShardKey,
        from: u64,
        msg: ReplicaMsg,
        records: Vec<ShippedRecord>,
    ) {
        let Some(h) = self.replicas.shards.get(&key) else {
            CoreCounters::inc(&self.s.counters.replica_msgs_unhosted);
            tracing::debug!(
                ?key,
                from,
                "replica message for a shard not hosted as a replica"
            );
            return;
        };
        if h.tx.try_send(Input::Msg { msg, records }).is_err() {
            CoreCounters::inc(&self.s.counters.replica_inputs_dropped);
        }
    }

    /// The control plane's answers to this core's reports, to their replicas.
    pub(in crate::core) fn replica_answers_tick(&mut self) {
        let Some(reports) = self.s.reports.clone() else {
            return;
        };
        for (key, a) in reports.take_answers(self.id as usize) {
            if let Some(h) = self.replicas.shards.get(&key) {
                if h.tx.try_send(Input::ReportAnswer(a)).is_err() {
                    CoreCounters::inc(&self.s.counters.replica_inputs_dropped);
                }
            }
        }
    }

    /// Carry out what a replica's driver decided, in order.
    fn on_replica_outputs(&mut self, key: ShardKey, outputs: Vec<Output>) {
        let Some(ident) = self.replicas.shards.get(&key).map(|h| h.ident.clone()) else {
            return;
        };
        // Elected or serving now: what is held may be taken.
        let changed = outputs
            .iter()
            .any(|o| matches!(o, Output::Elected { .. } | Output::Serving { .. }));
        for o in outputs {
            match o {
                Output::Send { to, msg, records } => {
                    if matches!(msg, ReplicaMsg::Refuse { .. }) {
                        CoreCounters::inc(&self.s.counters.replica_refusals_sent);
                    }
                    self.send_replica(to, &ident, msg, records)
                }
                Output::Report(report) => {
                    let Some(reports) = self.s.reports.clone() else {
                        continue;
                    };
                    let job = ReportJob {
                        core: self.id as usize,
                        key,
                        tenant: ident.stream.tenant.clone(),
                        namespace: ident.stream.namespace.clone(),
                        stream: ident.stream.stream.clone(),
                        shard: ident.shard,
                        report,
                    };
                    if !reports.push(job) {
                        CoreCounters::inc(&self.s.counters.replica_inputs_dropped);
                    }
                }
                Output::Elected { gen } => {
                    CoreCounters::inc(&self.s.counters.replica_elections);
                    tracing::info!(stream = %ident.stream, shard = ident.shard, gen, "leading the shard's replicas");
                }
                Output::Rebuilt { base } => {
                    CoreCounters::inc(&self.s.counters.replica_rebuilds);
                    tracing::warn!(stream = %ident.stream, shard = ident.shard, base, "the leader no longer holds records this replica needs (retention): its log was dropped and goes on at the leader's base");
                }
                Output::SteppedDown { gen } => {
                    CoreCounters::inc(&self.s.counters.replica_step_downs);
                    tracing::info!(stream = %ident.stream, shard = ident.shard, gen, "stepped down");
                    let why = Refusal::new(
                        ErrorCode::NotLeader,
                        format!("broker {} no longer leads shard {} of {} (generation {gen} was superseded); subscribe again where placement names the leader", self.s.cfg.node_id, ident.shard, ident.stream),
                    );
                    self.with_streams(|h, _| h.replica_stopped(key, why));
                }
                Output::Proposed { at } => self.replica_proposed(key, Ok(at)),
                Output::NotTaken(why) => self.replica_proposed(key, Err(why)),
                Output::Ack { below, .. } => self.replica_acked(key, below),
                Output::CannotVouch { below, .. } => self.replica_not_vouched(key, below),
                Output::Serving { from } => {
                    tracing::info!(stream = %ident.stream, shard = ident.shard, from, "serving readers");
                    self.with_streams(|h, _| h.replica_serving(key, from));
                }
                Output::Visible { first, payloads } => {
                    let records = Records::encode(payloads.iter().map(|p| &p[..]));
                    self.with_streams(|h, ctx| h.replica_visible(key, first, &records, ctx));
                }
            }
        }
        self.retry_held(key, changed);
    }

    /// A publish for a replicated shard this core owns: to its replica, which takes it only
    /// while it leads with a lease.
    pub(in crate::core) fn replica_publish(&mut self, req: PublishReq) {
        let key = (req.stream, req.shard);
        if let Err(e) = self.catalog.serve_check(key.0, key.1) {
            return self.answer_publish(req, Err(e.into()));
        }
        if req.records.iter().any(|p| p.is_empty()) {
            let why = Refusal::new(
                ErrorCode::InvalidRequest,
                "a replicated stream's records carry a payload: an empty record marks the start of a generation",
            );
            return self.answer_publish(req, Err(why));
        }
        let Some(h) = self.replicas.shards.get_mut(&key) else {
            let why = Refusal::new(
                ErrorCode::Unavailable,
                "the shard's replica is not open on this broker yet; nothing was appended; retry",
            );
            return self.answer_publish(req, Err(why));
        };
        if !h.held.is_empty() {
            // Behind the ones held, in order.
            let deadline = Instant::now() + self.publish_hold();
            return self.hold_publish(key, req, deadline, true);
        }
        self.propose(key, req, None);
    }

    /// How long a publish may be held while its leader is not serving yet.
    fn publish_hold(&self) -> Duration {
        Duration::from_millis(self.s.cfg.publish_timeout_ms)
    }

    /// Hand `req` to the replica of `key` (hosted), held until `deadline` if it was before.
    fn propose(&mut self, key: ShardKey, req: PublishReq, deadline: Option<Instant>) {
        let Some(h) = self.replicas.shards.get_mut(&key) else {
            return;
        };
        let payloads = req.records.iter().collect();
        match h.tx.try_send(Input::Propose { payloads }) {
            Ok(()) => h.proposing.push_back((req, deadline)),
            Err(_) => {
                CoreCounters::inc(&self.s.counters.replica_inputs_dropped);
                let why = Refusal::new(
                    ErrorCode::Unavailable,
                    format!("the shard's replica has {REPLICA_INPUTS_MAX} inputs waiting; nothing was appended; retry"),
                );
                self.answer_publish(req, Err(why));
            }
        }
    }

    /// Hold `req` (nothing appended) until its replica serves or `deadline`; refused
    /// `unavailable` when [`HELD_PUBLISHES_MAX`] are held already.
    fn hold_publish(&mut self, key: ShardKey, req: PublishReq, deadline: Instant, first: bool) {
        let Some(h) = self.replicas.shards.get_mut(&key) else {
            return;
        };
        if h.held.len() >= HELD_PUBLISHES_MAX {
            let why = Refusal::new(
                ErrorCode::Unavailable,
                format!("shard {} of {} is changing leaders and {HELD_PUBLISHES_MAX} publishes wait already; nothing was appended; retry", key.1, h.ident.stream),
            );
            return self.answer_publish(req, Err(why));
        }
        if first {
            CoreCounters::inc(&self.s.counters.replica_publishes_held);
        }
        h.held.push_back((req, deadline));
    }

    /// Propose the held publishes of `key` again (after a batch of its replica's outputs: its
    /// election or lease may have moved on). Those still not taken come back held.
    fn retry_held(&mut self, key: ShardKey, now: bool) {
        let Some(h) = self.replicas.shards.get_mut(&key) else {
            return;
        };
        let t = Instant::now();
        if h.held.is_empty() || (!now && t < h.retry_at) {
            return;
        }
        h.retry_at = t + HELD_RETRY_EVERY;
        let held: Vec<(PublishReq, Instant)> = h.held.drain(..).collect();
        for (req, deadline) in held {
            self.propose(key, req, Some(deadline));
        }
    }

    /// On every flush round: held publishes past their deadline are refused `unavailable`,
    /// and all of a shard's are refused as its catalog entry says once this broker no longer
    /// leads it (the client or the forwarding broker follows the new leader).
    pub(in crate::core) fn replica_held_tick(&mut self) {
        let now = Instant::now();
        // Flush rounds come often under load; every hosted replica is looked at, so not on
        // each one (deadlines are kept to within this).
        if self
            .replicas
            .held_checked
            .is_some_and(|t| now.duration_since(t) < HELD_CHECK_EVERY)
        {
            return;
        }
        self.replicas.held_checked = Some(now);
        let keys: Vec<ShardKey> = self
            .replicas
            .shards
            .iter()
            .filter(|(_, h)| !h.held.is_empty())
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            let check = self.catalog.serve_check(key.0, key.1);
            let h = self.replicas.shards.get_mut(&key).expect("listed above");
            let name = h.ident.stream.clone();
            let mut done = Vec::new();
            while let Some((_, deadline)) = h.held.front() {
                if check.is_ok() && *deadline > now {
                    break;
                }
                done.push(h.held.pop_front().expect("checked").0);
            }
            for req in done {
                let why = match &check {
                    Err(e) => e.clone().into(),
                    Ok(()) => Refusal::new(
                        ErrorCode::Unavailable,
                        format!("shard {} of {name} found no serving leader within {} ms; nothing was appended; retry", key.1, self.s.cfg.publish_timeout_ms),
                    ),
                };
                self.answer_publish(req, Err(why));
            }
        }
    }

    fn answer_publish(&mut self, req: PublishReq, result: PubResult) {
        let c = &self.s.counters;
        CoreCounters::inc(match &result {
            Ok(_) => &c.replica_publishes_acked,
            Err(r) if r.code == ErrorCode::OutcomeUnknown => &c.replica_publishes_not_vouched,
            Err(_) => &c.replica_publishes_refused,
        });
        let origin = req.origin;
        self.route(
            origin.core,
            MeshMsg::Conn(ToConn::PublishResult { origin, result }),
        );
    }

    /// The replica took the oldest proposal at `at`, or did not take it.
    fn replica_proposed(&mut self, key: ShardKey, r: Result<u64, NotLeader>) {
        let Some(h) = self.replicas.shards.get_mut(&key) else {
            return;
        };
        let Some((req, held_until)) = h.proposing.pop_front() else {
            debug_assert!(false, "an answer to a proposal nobody made");
            return;
        };
        // Not taken while this broker is the named leader and its replica fences or waits out
        // the old lease: held, not refused (the deadline counts from the first refusal).
        if matches!(r, Err(NotLeader::Fencing | NotLeader::NoLease))
            && self.catalog.serve_check(key.0, key.1).is_ok()
        {
            let deadline = held_until.unwrap_or_else(|| Instant::now() + self.publish_hold());
            if deadline > Instant::now() {
                return self.hold_publish(key, req, deadline, held_until.is_none());
            }
        }
        let Some(h) = self.replicas.shards.get_mut(&key) else {
            return;
        };
        let (name, shard) = (h.ident.stream.clone(), key.1);
        let result = match r {
            Ok(at) => {
                let n = req.records.count();
                let range = at..at + n as u64;
                // Both sides of the hand-off: answers come in offset order.
                debug_assert!(h.waiting.back().is_none_or(|(r, _, _)| r.end <= at));
                if h.quorum {
                    h.waiting.push_back((range, req, Instant::now()));
                    return;
                }
                Ok((shard, at, n))
            }
            Err(NotLeader::Follower) => Err(Refusal::new(
                ErrorCode::NotLeader,
                format!("broker {} does not lead shard {shard} of {name} (its replica follows); nothing was appended", self.s.cfg.node_id),
            )),
            Err(NotLeader::Fencing) => Err(Refusal::new(
                ErrorCode::Unavailable,
                format!("shard {shard} of {name} is electing its leader here; nothing was appended; retry"),
            )),
            Err(NotLeader::NoLease) => Err(Refusal::new(
                ErrorCode::Unavailable,
                format!("no majority of the replicas of shard {shard} of {name} answered within the lease; nothing was appended; retry"),
            )),
        };
        self.answer_publish(req, result);
    }

    /// The commit mark passed everything below `below`: acknowledge what it covers whole.
    fn replica_acked(&mut self, key: ShardKey, below: u64) {
        let Some(h) = self.replicas.shards.get_mut(&key) else {
            return;
        };
        let mut done = Vec::new();
        while h.waiting.front().is_some_and(|(r, _, _)| r.end <= below) {
            done.push(h.waiting.pop_front().expect("checked"));
        }
        for (range, req, written) in done {
            let n = req.records.count();
            debug_assert_eq!(range.end - range.start, n as u64);
            let us = written.elapsed().as_micros() as u64;
            self.s.counters.quorum_wait.observe_us(us);
            self.answer_publish(req, Ok((key.1, range.start, n)));
        }
    }

    /// The leader cannot vouch for the records below `below`: every batch not acknowledged
    /// that reaches below it is answered `outcome_unknown` (it may still commit).
    fn replica_not_vouched(&mut self, key: ShardKey, below: u64) {
        let Some(h) = self.replicas.shards.get_mut(&key) else {
            return;
        };
        let mut done = Vec::new();
        while h.waiting.front().is_some_and(|(r, _, _)| r.start < below) {
            done.push(h.waiting.pop_front().expect("checked"));
        }
        let name = h.ident.stream.clone();
        for (range, req, _) in done {
            let why = Refusal::new(
                ErrorCode::OutcomeUnknown,
                format!("records {}..{} of shard {} of {name} were written on the leader but it cannot vouch for them (no majority confirmed them in time, or it was deposed); they may or may not survive", range.start, range.end, key.1),
            );
            self.answer_publish(req, Err(why));
        }
    }

    /// A hosted replica ends (failed, unhosted, shut down): what waits for it is answered
    /// `outcome_unknown` (a proposal may have been written and shipped).
    fn fail_publishes(&mut self, h: &mut Hosted, why: &str) {
        let reqs: Vec<PublishReq> = h
            .proposing
            .drain(..)
            .map(|(r, _)| r)
            .chain(h.waiting.drain(..).map(|(_, r, _)| r))
            .collect();
        for req in reqs {
            let msg = format!("{why}; the publish may or may not have been written");
            self.answer_publish(req, Err(Refusal::new(ErrorCode::OutcomeUnknown, msg)));
        }
        // Held ones were never handed to the replica: nothing of them was appended.
        let held: Vec<PublishReq> = h.held.drain(..).map(|(r, _)| r).collect();
        for req in held {
            let msg = format!("{why}; nothing was appended; retry");
            self.answer_publish(req, Err(Refusal::new(ErrorCode::Unavailable, msg)));
        }
    }

    fn send_replica(
        &mut self,
        to: u64,
        ident: &ShardRef,
        msg: ReplicaMsg,
        records: Vec<ShippedRecord>,
    ) {
        let Some(addr) = self.catalog.peer_addrs.get(&to).cloned() else {
            return; // no peer listener registered: lost, as on a cut link
        };
        let Some(links) = self.links.as_mut() else {
            return;
        };
        links.set_cluster_id(&self.catalog.cluster_id.clone());
        let frame = Frame::Replicate {
            shard: ident.clone(),
            msg,
            records,
        };
        match links.send_replica(Instant::now(), to, &addr, frame.encode()) {
            Ok(true) => CoreCounters::inc(&self.s.counters.replica_msgs_sent),
            Ok(false) | Err(_) => CoreCounters::inc(&self.s.counters.replica_msgs_unsent),
        }
        self.link_effects();
    }

    /// The logs of the replicas this core hosts, to close at shutdown; their tasks end (no
    /// input reaches them any more).
    pub(in crate::core) fn close_replicas(&mut self) -> Vec<Log> {
        let hosted: Vec<Hosted> = self.replicas.shards.drain().map(|(_, h)| h).collect();
        let mut logs = Vec::new();
        for mut h in hosted {
            self.fail_publishes(&mut h, "the broker shut down");
            logs.extend(h.log);
        }
        logs
    }

    fn on_replica_opened(&mut self, key: ShardKey, log: Log) {
        match self.replicas.shards.get_mut(&key) {
            Some(h) => {
                h.log = Some(log.clone());
                self.with_streams(|s, _| s.replica_opened(key, Ok(log)));
            }
            // No longer wanted while it opened (its task ends at its next input).
            None => {
                glommio::spawn_local(async move {
                    let _ = log.close().await;
                })
                .detach();
            }
        }
    }

    fn on_replica_failed(&mut self, key: ShardKey, why: String) {
        if self.closing_logs {
            return; // its log was closed under it at shutdown
        }
        if let Some(mut h) = self.replicas.shards.remove(&key) {
            CoreCounters::inc(&self.s.counters.replica_failures);
            tracing::error!(stream = %h.ident.stream, shard = h.ident.shard, error = %why, "replica failed; it is hosted again at the next catalog change");
            self.fail_publishes(&mut h, &format!("the shard's replica failed: {why}"));
            self.with_streams(|s, _| {
                s.replica_opened(key, Err(why.clone()));
                s.replica_failed(key, &why);
            });
        }
    }
}

/// One hosted replica: open its driver, then hand it each input (a tick at least every
/// [`REPLICA_TICK`]) and carry its outputs out on the core, until its sender is dropped or
/// it fails.
async fn run_replica(
    state: Weak<RefCell<CoreState>>,
    key: ShardKey,
    o: OpenReplica,
    rx: LocalReceiver<Input>,
    mut serving: ServingLog,
) {
    let opened = ReplicaDriver::open(o.me, o.sid, o.set, &o.dir, o.log_cfg, o.cfg);
    let mut d = match opened.await {
        Ok(d) => d,
        Err(e) => {
            reenter(&state, |st| st.on_replica_failed(key, e));
            return;
        }
    };
    let log = d.store().log().clone();
    reenter(&state, |st| st.on_replica_opened(key, log));
    let t0 = Instant::now();
    let mut next_tick = t0;
    step_replica(&state, key, &mut d, rx, t0, &mut next_tick, &mut serving).await;
    // Hosted no more, failed or shutting down: it serves no more from here.
    serving.exit(&d);
}

/// [`run_replica`]'s loop, until the replica is hosted no more or fails.
async fn step_replica(
    state: &Weak<RefCell<CoreState>>,
    key: ShardKey,
    d: &mut ReplicaDriver,
    rx: LocalReceiver<Input>,
    t0: Instant,
    next_tick: &mut Instant,
    serving: &mut ServingLog,
) {
    loop {
        let now = Instant::now();
        // A tick is due even while messages keep coming: leases are renewed on ticks.
        let input = if now >= *next_tick {
            *next_tick = now + REPLICA_TICK;
            Input::Tick
        } else {
            let wait = *next_tick - now;
            let got = futures_lite::future::or(async { Some(rx.recv().await) }, async {
                glommio::timer::sleep(wait).await;
                None
            })
            .await;
            match got {
                Some(Some(i)) => i,
                Some(None) => return, // no longer hosted
                None => continue,
            }
        };
        // Take what else is queued already (a dropped `recv` that was not ready takes
        // nothing).
        let mut inputs = vec![input];
        let mut closed = false;
        while inputs.len() < REPLICA_INPUTS_PER_STEP_MAX {
            match futures_lite::future::poll_once(rx.recv()).await {
                Some(Some(i)) => inputs.push(i),
                Some(None) => {
                    closed = true;
                    break;
                }
                None => break,
            }
        }
        let now_ms = t0.elapsed().as_millis() as u64;
        serving.at(now_ms);
        let wall_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let handled = d.handle_all(inputs, now_ms, wall_ms).await;
        // Logged before any output leaves: what a serving leader answers follows its line.
        serving.log(d.take_serving_events());
        match handled {
            Ok(out) if out.is_empty() => {}
            Ok(out) => reenter(state, |st| st.on_replica_outputs(key, out)),
            Err(e) => {
                reenter(state, |st| st.on_replica_failed(key, e));
                return;
            }
        }
        if closed || state.upgrade().is_none() {
            return;
        }
    }
}

/// CLOCK_MONOTONIC in nanoseconds: unlike `Instant`'s origin, the same in every process on the
/// machine, so two brokers' serving intervals can be compared.
fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Logs a hosted replica's serving intervals (target `felix::serving`, info) on
/// CLOCK_MONOTONIC: an operator sees which broker served a shard when, and the fault tests
/// check that no two brokers served one shard at once (rules 2 and 4).
struct ServingLog {
    ident: ShardRef,
    /// The machine's clock (ms) and CLOCK_MONOTONIC (ns), read together before the last input.
    at: (u64, u64),
}

impl ServingLog {
    fn new(ident: ShardRef) -> ServingLog {
        ServingLog { ident, at: (0, 0) }
    }

    /// The machine's clock reads `now_ms`: take CLOCK_MONOTONIC with it. Read after the
    /// machine's clock, so a time converted from it is never earlier than the instant the
    /// machine meant (a start is no earlier than any act at that input, and a lease's end no
    /// earlier than the last instant the machine could still serve under it).
    fn at(&mut self, now_ms: u64) {
        self.at = (now_ms, mono_ns());
    }

    /// A time of the machine's clock on CLOCK_MONOTONIC.
    fn mono_ns_of(&self, ms: u64) -> u64 {
        let (now_ms, mono) = self.at;
        if ms >= now_ms {
            mono.saturating_add((ms - now_ms).saturating_mul(1_000_000))
        } else {
            mono.saturating_sub((now_ms - ms).saturating_mul(1_000_000))
        }
    }

    fn log(&self, events: Vec<super::replica_driver::ServingEvent>) {
        use super::replica_driver::ServingEvent;
        let id = &self.ident;
        for e in events {
            match e {
                ServingEvent::Started { gen, at_ms } => tracing::info!(
                    target: "felix::serving",
                    stream = %id.stream, incarnation = id.incarnation, shard = id.shard, gen,
                    from_mono_ns = self.mono_ns_of(at_ms),
                    "replica serves"
                ),
                ServingEvent::Ended { gen, at_ms } => tracing::info!(
                    target: "felix::serving",
                    stream = %id.stream, incarnation = id.incarnation, shard = id.shard, gen,
                    to_mono_ns = self.mono_ns_of(at_ms),
                    "replica serves no more"
                ),
            }
        }
    }

    /// The replica's task ends: if it served, it serves no more from now (or from its lease's
    /// end, if that came first).
    fn exit(&self, d: &ReplicaDriver) {
        if let Some((gen, until_ms)) = d.serving_until() {
            let now_ns = mono_ns();
            let id = &self.ident;
            tracing::info!(
                target: "felix::serving",
                stream = %id.stream, incarnation = id.incarnation, shard = id.shard, gen,
                to_mono_ns = now_ns.min(self.mono_ns_of(until_ms)),
                "replica serves no more"
            );
        }
    }
}

//! The replica of one durable shard as a pure state machine, after
//! `docs/replication-design.md`. It implements rules 1 to 11:
//! - generations (rule 1);
//! - the leader's lease on its monotonic clock (rule 2, `lease.rs`);
//! - fencing with a durable promise (rule 3, `follower.rs`);
//! - waiting out the old lease after the fence (rule 4, `lease.rs`);
//! - ballots (rule 5, `follower.rs`);
//! - log shipping, with log matching by generation and truncation of a divergent suffix
//!   (rule 6, `leader.rs` and `follower.rs`), the generation-start record included;
//! - reports to placement, the commit mark moved only by a landed report, and the
//!   acknowledgements it releases (rule 7, `leader.rs`);
//! - promotion of the furthest-ahead vouched replica (rule 8, placement's side, in
//!   `felix_control::replication`);
//! - storage identities: answers and reports name them, placement counts only current ones,
//!   and a broker refuses an assignment made for an identity it no longer has (rule 9);
//! - logs trimmed by retention below the learnt mark, and followers rebuilt from a leader's
//!   base (rule 10);
//! - a replica set that changes one replica at a time: an assignment names its generation's
//!   set and the settled set, and the fence needs a majority of both (rule 11).
//!
//! It reads no clock and touches no socket or file: the time of each input is an argument
//! (milliseconds of the driver's monotonic clock). Its inputs are placement's assignment
//! ([`Replica::assign`]), a client's record ([`Replica::propose`]), peer messages
//! ([`Replica::on_msg`]), placement's answers to reports ([`Replica::on_report_answer`]) and
//! ticks ([`Replica::tick`]: lease renewals and retransmission). Its outputs are
//! [`Effect`]s, which the driver carries out **in order**, as raft-rs's `Ready` asks: a
//! [`Effect::Persist`] must be durable (fsynced) before any later effect of the same batch is
//! carried out, because a promise or ballot is never answered before it is kept (rule 3).
//!
//! Retention (rule 10): a log may start at a base ([`GenLog`]); a leader ships a follower
//! that needs records below its base from the base, and the follower rebuilds its log there
//! unless it agrees (`follower.rs`). The machine keeps generations, not records ([`GenLog`]): the driver
//! holds the records, reads a shipment's from its log and writes what an `Effect::Append`
//! names (`core/replica_store.rs` does both on real files, with the durable promise).
//! Brokers run one per hosted replica (`core/replica_host.rs`); so do the simulator
//! (`sim.rs`) and `replica_store`'s tests, three machines over real logs.
#![cfg_attr(not(test), allow(dead_code))]

use std::collections::BTreeMap;

mod follower;
mod genlog;
mod leader;
mod lease;
pub(crate) use genlog::GenLog;
pub(crate) use lease::{Lease, ReplicaCfg};
#[cfg(test)]
mod sim;

pub(crate) use felix_control::replication::{
    Assignment, Holding, NodeId, Pos, Report, ReportAnswer, StorageId,
};

/// Where the records of an [`Effect::Append`] come from: the driver holds them (the machine
/// knows only their generations).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// The generation-start record (rule 6): no payload, the first record a new leader writes.
    Start,
    /// The client records just proposed ([`Replica::propose`]).
    Client,
    /// The records of the shipment just handed in ([`Msg::Ship`]), from index `skip` on.
    Shipment { skip: usize },
}

/// What must survive any crash, written with an fsync before it is answered (rules 1, 3, 5).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Durable {
    /// The highest generation promised: messages of lower generations are refused.
    pub promised: u64,
    /// The leader accepted at `promised` (rule 5).
    pub ballot: Option<NodeId>,
    /// The highest generation this broker led: it never leads one twice (rule 1).
    pub led: u64,
}

/// The replica messages are the wire's own (`Replicate` frames, docs/protocol.md): what the
/// machine sends is what a peer link carries.
pub(crate) use felix_quic::wire::replica::{ReplicaMsg as Msg, Shipped};

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Effect {
    /// Write and fsync before anything after it.
    Persist(Durable),
    /// Drop every record at `from` and above (they were never committed: rule 6).
    Truncate {
        from: u64,
    },
    /// Drop the whole log and go on at `base`, past its end or not: the leader holds nothing
    /// below `base` (rule 10), and this log may differ from it there.
    Rebuild {
        base: u64,
    },
    /// Append records at the log's end, which is `at`: one per generation in `gens`, taken
    /// from `source`.
    Append {
        at: u64,
        gens: Vec<u64>,
        source: Source,
    },
    Send {
        to: NodeId,
        msg: Msg,
    },
    /// The fence of `gen` completed: this replica leads it.
    Elected {
        gen: u64,
    },
    /// This replica stopped leading (or fencing) `gen`: a newer generation exists.
    SteppedDown {
        gen: u64,
    },
    /// Send to placement (rule 7).
    Report(Report),
    /// The commit mark passed the records `from..below` and the lease is held: acknowledge
    /// the `Quorum` publishes among them (rule 7).
    Ack {
        from: u64,
        below: u64,
    },
    /// This broker cannot vouch for the records `from..below` (rule 7): their quorum wait
    /// ran out, or the leader was deposed with them uncommitted. They may still commit; a
    /// client may retry. The driver answers each publish on the first of `Ack` and
    /// `CannotVouch` that covers it.
    CannotVouch {
        from: u64,
        below: u64,
    },
}

/// Reports a leader keeps unanswered at once (a tick sends the newest again whatever the
/// count). Any number is safe: placement stores a report only over an older one (`Stale`
/// otherwise), and the mark moves only on what a landed report counted (rule 7); the sim
/// delivers reports late and reordered. One, measured: with two, a record no longer waits for
/// the rest of the report in flight, but a leader sends half as many records per report again
/// as many reports, and on this machine, where the brokers and the control plane share one
/// core, the extra reports cost more than the wait (32 publishes awaiting on a `quorum`
/// stream: about 6,400 acks/s with two, 7,500 with one; 2026-12-07; measured again once the
/// answers rang the core's doorbell: 8,045 with two, 10,144 with one, three alternated
/// rounds).
pub(crate) const REPORTS_IN_FLIGHT_MAX: u8 = 1;

/// A follower as its leader knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Peer {
    /// The offset the next shipment starts at: the follower agrees with this leader below it,
    /// as far as its answers said.
    next: u64,
    /// Shipped up to here (exclusive), answered or not: a new record is shipped from here,
    /// so shipments are pipelined; a tick or a mismatch ships again from `next`.
    sent: u64,
    /// From its last answer to a shipment: it agrees with the leader's log below this end
    /// (exclusive), under that storage identity. None until it answers one.
    held: Option<(u64, StorageId)>,
}

/// A leader's state (its fence completed).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Lead {
    gen: u64,
    peers: BTreeMap<NodeId, Peer>,
    /// The commit mark: the records below it are committed (rule 7). It starts at the
    /// generation-start record's offset and moves only onto a record of `gen`. Until it has
    /// moved it is a floor, not a mark: the records of earlier generations below it commit
    /// only with a record of this one.
    commit: u64,
    /// The generation-start record's offset (where `commit` starts).
    first: u64,
    /// `Quorum` publishes below this were acknowledged.
    acked: u64,
    /// Publishes below this were answered "cannot vouch" (or acknowledged).
    gave_up: u64,
    /// Each client record's offset and the time (ms) its quorum wait runs out, in order.
    waits: std::collections::VecDeque<(u64, u64)>,
    /// Reports on their way to placement, unanswered (at most [`REPORTS_IN_FLIGHT_MAX`] but
    /// on a tick).
    reports_out: u8,
    /// The number of the last report built.
    report_seq: u64,
    /// Something the report would say changed since the last one was built.
    report_due: bool,
    /// When this leader last reported that it resigns (it has held no lease for a whole
    /// lease period); None while it holds one.
    resigned_ms: Option<u64>,
}

impl Lead {
    /// What this leader knows committed: its mark once it moved past the generation-start
    /// record, else what it knew before it led (`before`).
    fn known(&self, before: u64) -> u64 {
        if self.commit > self.first {
            self.commit.max(before)
        } else {
            before
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Role {
    Follower,
    Fencing {
        gen: u64,
        /// Who promised `gen` (this replica included), with their log end.
        answered: BTreeMap<NodeId, u64>,
    },
    Leading(Lead),
}

/// Why a record was not taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NotLeader {
    Follower,
    Fencing,
    /// Leading, but without a lease now: no majority answered within the lease, or the wait
    /// after the fence is not over. A publish with no reachable majority is refused (rule 7).
    NoLease,
}

/// The replica of one shard on one broker.
pub(crate) struct Replica {
    me: NodeId,
    /// This broker's storage identity (rule 9), named in every answer and report.
    sid: StorageId,
    /// The replica set: of the generation this replica leads or fences (from its assignment),
    /// else the one it was created with (a follower counts nothing on it). This broker
    /// included.
    set: Vec<NodeId>,
    /// While fencing or leading: the settled set its assignment named (rule 11). The fence
    /// completes only with a majority of it as well as of `set`.
    settled: Vec<NodeId>,
    durable: Durable,
    /// The generations of the log's records (what the log holds, mirrored).
    log: GenLog,
    role: Role,
    /// While leading: the lease (rules 2 and 4).
    lease: Option<Lease>,
    /// The records below this are committed, as far as this replica has learnt: from its own
    /// mark while it led, from its leaders' shipments for what it holds in agreement with
    /// them. It never passes the log's end, and only grows, since no leader ever cuts a
    /// committed record (the simulator checks that on every cut, with the seed). Not
    /// persisted: after a restart it starts at the log's base (what retention left was
    /// trimmed below a learnt mark), a true lower bound. Retention holds at it (rule 10).
    known_commit: u64,
    cfg: ReplicaCfg,
    effects: Vec<Effect>,
}

impl Replica {
    /// A replica as it comes up: a follower, with what its disk kept.
    pub(crate) fn new(
        me: NodeId,
        sid: StorageId,
        set: Vec<NodeId>,
        durable: Durable,
        log: GenLog,
        cfg: ReplicaCfg,
    ) -> Self {
        assert!(set.contains(&me), "replica {me} is not in its set {set:?}");
        debug_assert!(cfg.validate().is_ok(), "{cfg:?}");
        Replica {
            me,
            sid,
            settled: set.clone(),
            set,
            durable,
            role: Role::Follower,
            lease: None,
            // What retention left was trimmed at a mark this replica had learnt (rule 10).
            known_commit: log.base(),
            log,
            cfg,
            effects: Vec::new(),
        }
    }

    /// Whether this replica may acknowledge a write or serve a read at `now_ms`: it leads,
    /// has waited out every older lease, and holds its own (rules 2 and 4).
    pub(crate) fn serving(&self, now_ms: u64) -> bool {
        self.serving_until(now_ms).is_some()
    }

    /// While [`Replica::serving`] at `now_ms`: the generation it leads and the end of its
    /// lease (exclusive), the latest time it may still act as the serving leader.
    pub(crate) fn serving_until(&self, now_ms: u64) -> Option<(u64, u64)> {
        let gen = self.leading()?;
        let until = self.lease.as_ref()?.serving_until(now_ms)?;
        Some((gen, until))
    }

    /// The effects produced since the last drain, in the order they must be carried out.
    pub(crate) fn drain_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    pub(crate) fn durable(&self) -> Durable {
        self.durable
    }

    /// The records below this are known committed (see the field).
    pub(crate) fn known_commit(&self) -> u64 {
        match &self.role {
            Role::Leading(l) => l.known(self.known_commit),
            _ => self.known_commit,
        }
    }

    pub(crate) fn log(&self) -> &GenLog {
        &self.log
    }

    /// The generation this replica leads (its fence completed), if any.
    pub(crate) fn leading(&self) -> Option<u64> {
        match &self.role {
            Role::Leading(l) => Some(l.gen),
            _ => None,
        }
    }

    fn majority(&self) -> usize {
        self.set.len() / 2 + 1
    }

    /// Whether `answered` holds a majority of the set and (rule 11, the joint fence) of the
    /// settled set.
    fn fence_complete<'a>(&self, answered: impl Iterator<Item = &'a NodeId> + Clone) -> bool {
        let of = |s: &[NodeId]| 2 * answered.clone().filter(|n| s.contains(n)).count() > s.len();
        of(&self.set) && (of(&self.settled) || breaks::on(&breaks::NO_JOINT_FENCE))
    }

    fn persist(&mut self, d: Durable) {
        debug_assert!(d.promised >= self.durable.promised && d.led >= self.durable.led);
        self.durable = d;
        self.effects.push(Effect::Persist(d));
    }

    fn send(&mut self, to: NodeId, msg: Msg) {
        debug_assert_ne!(to, self.me);
        self.effects.push(Effect::Send { to, msg });
    }

    fn append(&mut self, gens: Vec<u64>, source: Source) {
        if gens.is_empty() {
            return;
        }
        let at = self.log.end();
        for &g in &gens {
            self.log.push(g);
        }
        self.effects.push(Effect::Append { at, gens, source });
    }

    /// Retention removed the records below `to` (rule 10: only below a mark this replica had
    /// learnt, so they are committed). The driver says so before it carries out anything
    /// that would read them; a leader then ships from its new base.
    pub(crate) fn trimmed(&mut self, to: u64) {
        let to = to.min(self.log.end());
        self.log.trim(to);
        self.known_commit = self.known_commit.max(self.log.base());
    }

    fn truncate(&mut self, from: u64) {
        debug_assert!(from < self.log.end());
        self.known_commit = self.known_commit.min(from);
        self.log.truncate(from);
        self.effects.push(Effect::Truncate { from });
    }

    /// The generation this replica is fencing or leading, if any.
    fn taken(&self) -> Option<u64> {
        match &self.role {
            Role::Fencing { gen, .. } => Some(*gen),
            Role::Leading(l) => Some(l.gen),
            Role::Follower => None,
        }
    }

    fn step_down(&mut self) {
        let Some(gen) = self.taken() else { return };
        // Every publish still waiting is answered: this broker can no longer vouch for it.
        if let Role::Leading(l) = &self.role {
            self.known_commit = l.known(self.known_commit);
            let from = l.acked.max(l.gave_up);
            let below = self.log.end();
            if below > from && !breaks::on(&breaks::FORGET_WAITS_ON_STEP_DOWN) {
                self.effects.push(Effect::CannotVouch { from, below });
            }
        }
        self.role = Role::Follower;
        // A deposed leader refuses new readers at once, whatever its lease says (rule 2).
        self.lease = None;
        self.effects.push(Effect::SteppedDown { gen });
    }

    /// Placement names `a.leader` for generation `a.gen`. Only the named broker acts: it takes
    /// the generation (promise, ballot and `led`, persisted) and fences the others. It refuses
    /// a generation it led before, one at which it accepted another leader (rules 1, 5), and
    /// an assignment decided on a storage identity it no longer has (rule 9: its log may have
    /// lost what placement counted it for).
    ///
    /// Rule 11: the assignment names the generation's replica set and the settled set; the
    /// fence goes to both, and completes only with a majority of each (`maybe_elected`).
    pub(crate) fn assign(&mut self, a: Assignment, now_ms: u64) {
        let Assignment {
            gen,
            leader,
            sid,
            set,
            settled,
        } = a;
        if leader != self.me || gen <= self.durable.led || !self.accepts(gen, self.me) {
            return;
        }
        if !set.is_empty() && !set.contains(&self.me) {
            debug_assert!(false, "placement named {leader} outside its set {set:?}");
            return;
        }
        if sid != self.sid && !felix_control::replication::breaks::on(&breaks::NO_STORAGE_IDENTITY)
        {
            return;
        }
        self.step_down();
        if !set.is_empty() {
            self.set = set;
        }
        self.settled = if settled.is_empty() {
            self.set.clone()
        } else {
            settled
        };
        self.persist(Durable {
            promised: gen,
            ballot: Some(self.me),
            led: gen,
        });
        let end = self.log.end();
        self.role = Role::Fencing {
            gen,
            answered: BTreeMap::from([(self.me, end)]),
        };
        for to in self.fenced_ones() {
            self.send(
                to,
                Msg::Fence {
                    gen,
                    leader: self.me,
                },
            );
        }
        self.maybe_elected(now_ms);
    }

    /// Whom a fence goes to: the set and the settled set (rule 11), this broker excepted.
    fn fenced_ones(&self) -> Vec<NodeId> {
        let mut v: Vec<NodeId> = self.others();
        v.extend(self.settled.iter().filter(|&&n| n != self.me));
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Whether this replica leads `gen` and `n`, of its set, has not answered its fence.
    fn missing_from_lead(&self, gen: u64, n: NodeId) -> bool {
        match &self.role {
            Role::Leading(l) => {
                l.gen == gen && n != self.me && self.set.contains(&n) && !l.peers.contains_key(&n)
            }
            _ => false,
        }
    }

    fn others(&self) -> Vec<NodeId> {
        self.set.iter().copied().filter(|&n| n != self.me).collect()
    }

    /// A client's batch of `n` records, appended by the leader in one piece (the driver
    /// holds them: [`Source::Client`]) and shipped; the offset of its first record. The
    /// batch's offsets are contiguous: no other input can come between its records.
    pub(crate) fn propose(&mut self, n: usize, now_ms: u64) -> Result<u64, NotLeader> {
        assert!(n > 0, "a proposal carries at least one record");
        let serving = self.serving(now_ms);
        let at = self.log.end();
        let gen = match &mut self.role {
            Role::Leading(_) if !serving => return Err(NotLeader::NoLease),
            Role::Leading(l) => {
                l.report_due = true;
                // One wait per batch, at its last record: a "cannot vouch" for it covers the
                // whole batch.
                let last = at + n as u64 - 1;
                l.waits.push_back((last, now_ms + self.cfg.quorum_wait_ms));
                l.gen
            }
            Role::Fencing { .. } => return Err(NotLeader::Fencing),
            Role::Follower => return Err(NotLeader::Follower),
        };
        self.append(vec![gen; n], Source::Client);
        self.ship_all(false);
        Ok(at)
    }

    /// While leading: the offset of this generation's start record, once the commit mark
    /// has passed it (from then on, everything below the mark is committed and may be read).
    pub(crate) fn serving_from(&self) -> Option<u64> {
        match &self.role {
            Role::Leading(l) if l.commit > l.first => Some(l.first),
            _ => None,
        }
    }

    /// Send again what may have been lost (fences not answered, shipments to every follower),
    /// and renew the lease when due.
    pub(crate) fn tick(&mut self, now_ms: u64) {
        match &self.role {
            Role::Fencing { gen, answered } => {
                let (gen, answered) = (*gen, answered.clone());
                for to in self.fenced_ones() {
                    if !answered.contains_key(&to) {
                        self.send(
                            to,
                            Msg::Fence {
                                gen,
                                leader: self.me,
                            },
                        );
                    }
                }
            }
            Role::Leading(_) => {
                self.renew(now_ms);
                self.resign_if_stranded(now_ms);
                self.ship_all(true);
                // A report or its answer may have been lost: send the newest again.
                self.report(true);
                self.release(now_ms);
                self.give_up(now_ms);
            }
            Role::Follower => {}
        }
    }

    pub(crate) fn on_msg(&mut self, msg: Msg, now_ms: u64) {
        match msg {
            Msg::Fence { gen, leader } => self.on_fence(gen, leader),
            Msg::FenceAnswer { gen, from, end } => {
                if let Role::Fencing { gen: g, answered } = &mut self.role {
                    if *g == gen {
                        answered.insert(from, end);
                        self.maybe_elected(now_ms);
                    }
                } else if let Role::Leading(l) = &mut self.role {
                    // A late promise: that follower is shipped to from now on (a replica of
                    // the settled set only is not: rule 11).
                    if l.gen == gen && !l.peers.contains_key(&from) && self.set.contains(&from) {
                        let peer = Peer {
                            next: end,
                            sent: end,
                            held: None,
                        };
                        l.peers.insert(from, peer);
                        self.ship(from, true);
                    }
                }
            }
            Msg::Ship {
                gen,
                leader,
                start,
                prev_gen,
                commit,
                gens,
            } => self.on_ship(gen, leader, start, prev_gen, commit, gens),
            Msg::ShipAnswer {
                gen,
                from,
                sid,
                shipped,
            } => self.on_ship_answer(gen, from, sid, shipped, now_ms),
            Msg::LeaseAsk { gen, leader, round } => {
                // Only the leader accepted at the promised generation (rule 3: a lower one is
                // refused, so a deposed leader renews nothing through a fenced replica).
                if !self.takes_from(gen, leader) || self.leading().is_some() {
                    return self.refuse(leader, gen);
                }
                let from = self.me;
                self.send(leader, Msg::LeaseGrant { gen, from, round });
            }
            Msg::LeaseGrant { gen, from, round } => {
                let majority = self.majority();
                if let Some(l) = self.lease.as_mut().filter(|l| l.gen == gen) {
                    l.granted(round, from, majority, &self.cfg);
                }
                if self.missing_from_lead(gen, from) {
                    // It promised this generation (it grants), but its answer to the fence
                    // was lost: without one it is never shipped to and stays behind until the
                    // next generation (found with real brokers all restarted at once). Fence
                    // it again so it answers with its log end; the same fence, late.
                    let leader = self.me;
                    self.send(from, Msg::Fence { gen, leader });
                }
            }
            Msg::Refuse {
                gen,
                from,
                promised,
            } => {
                if self.taken() == Some(gen) && promised > gen {
                    self.step_down();
                } else if promised < gen && self.missing_from_lead(gen, from) {
                    // A replica that never answered this generation's fence (it was down or
                    // cut off during the election) refuses the lease renewals: fence it
                    // again, so it rejoins now instead of staying out of the set until the
                    // next generation. Safe: it is the same fence, late.
                    let leader = self.me;
                    self.send(from, Msg::Fence { gen, leader });
                }
            }
        }
    }
}

/// Test-build switches that break one rule each, so the simulator's negative twins show its
/// checkers catch the break (`sim.rs`).
pub(crate) mod breaks {
    use std::sync::atomic::AtomicBool;
    /// Rule 5 dropped: a replica takes a second leader's fence at the generation it promised.
    pub(crate) static NO_BALLOT: AtomicBool = AtomicBool::new(false);
    /// Rule 3 dropped: a replica still takes records and lease exchanges of a generation below
    /// the one it promised.
    pub(crate) static NO_FENCE: AtomicBool = AtomicBool::new(false);
    /// Rule 4 dropped: a new leader serves as soon as its fence completes.
    pub(crate) static NO_LEASE_WAIT: AtomicBool = AtomicBool::new(false);
    /// Rule 6 dropped: a follower keeps a record that differs from the leader's at the same
    /// offset instead of dropping the suffix from there.
    pub(crate) static NO_TRUNCATE: AtomicBool = AtomicBool::new(false);
    /// Rule 7 dropped: the leader moves its commit mark, and acknowledges, on its followers'
    /// answers, whether or not placement has the report.
    pub(crate) static ACK_BEFORE_REPORT: AtomicBool = AtomicBool::new(false);
    // Rule 9's twin (NO_STORAGE_IDENTITY) and placement's twins live with placement, in
    // `felix_control::replication::breaks`: one switch breaks both sides of rule 9.
    #[cfg_attr(not(test), allow(unused_imports))]
    pub(crate) use felix_control::replication::breaks::{
        NO_STORAGE_IDENTITY, PROMOTE_BEHIND_COMMIT,
    };
    /// A follower takes its leader's commit mark as soon as a shipment arrives, before
    /// matching it against its own log: it may then believe records committed that it holds
    /// from a deposed leader, and that the leader cuts.
    pub(crate) static COMMIT_BEFORE_MATCH: AtomicBool = AtomicBool::new(false);
    /// A leader hands readers every record it has written, not only the committed ones
    /// (`replica_driver`'s hand-over).
    pub(crate) static HAND_OVER_UNCOMMITTED: AtomicBool = AtomicBool::new(false);
    /// A deposed leader drops the publishes still waiting for the mark without an answer.
    pub(crate) static FORGET_WAITS_ON_STEP_DOWN: AtomicBool = AtomicBool::new(false);
    /// Rule 10's rebuild dropped: a follower takes a shipment from its leader's base like any
    /// other, keeping whatever it holds below that base (which may differ from the leader's
    /// committed records there).
    pub(crate) static NO_REBUILD: AtomicBool = AtomicBool::new(false);
    /// Rule 11's joint fence dropped: a fence completes with a majority of the new set alone,
    /// whatever the settled set answered.
    pub(crate) static NO_JOINT_FENCE: AtomicBool = AtomicBool::new(false);

    #[inline]
    pub(crate) fn on(b: &AtomicBool) -> bool {
        #[cfg(test)]
        return b.load(std::sync::atomic::Ordering::Relaxed);
        #[cfg(not(test))]
        {
            let _ = b;
            false
        }
    }
}

#[cfg(test)]
mod tests;

//! Placement's side of one shard's replication, as a pure state machine: the generations it
//! issues and the leader it names at each (rule 1), the reports it takes and what it counts in
//! them (rules 7 and 9), and promotion (rule 8). The control plane is to hold this state in
//! its Raft store; here it is what the replica simulator drives. No clock, no I/O: every
//! decision is a function of what it was told.

use super::{breaks, Assignment, Holding, NodeId, Pos, Report, ReportAnswer, StorageId};
use std::collections::BTreeMap;

/// Why placement did not name a leader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PromoteError {
    /// The candidate is not the furthest ahead among the replicas the last landed report
    /// vouches for, or is not vouched for itself (rule 8).
    NotEligible { node: NodeId },
    /// No replica qualifies: the shard stays unavailable rather than served short.
    NoneQualifies,
}

/// One shard's placement.
#[derive(Clone, Debug)]
pub(crate) struct Placement {
    set: Vec<NodeId>,
    /// The newest generation issued, and the leader named at it.
    gen: u64,
    leader: Option<NodeId>,
    /// Each replica's storage identity as it registered it last (rule 9).
    registered: BTreeMap<NodeId, StorageId>,
    /// Each replica's position and identity as the last landed report that named it said.
    rep: BTreeMap<NodeId, Holding>,
    /// The number of the newest report stored at generation `gen` (0: none yet).
    rep_seq: u64,
}

impl Placement {
    /// A new shard: every replica registered under `sids`, each at the empty position.
    pub(crate) fn new(sids: BTreeMap<NodeId, StorageId>) -> Placement {
        let set: Vec<NodeId> = sids.keys().copied().collect();
        assert!(!set.is_empty(), "a shard needs a replica");
        let rep = sids
            .iter()
            .map(|(&node, &sid)| {
                let pos = Pos::default();
                (node, Holding { node, pos, sid })
            })
            .collect();
        Placement {
            set,
            gen: 0,
            leader: None,
            registered: sids,
            rep,
            rep_seq: 0,
        }
    }

    /// The newest generation and its named leader.
    pub(crate) fn newest(&self) -> (u64, Option<NodeId>) {
        (self.gen, self.leader)
    }

    /// What the last landed reports say `n` holds.
    pub(crate) fn reported(&self, n: NodeId) -> Option<Holding> {
        self.rep.get(&n).copied()
    }

    /// `n` came back under storage identity `sid` (a rotation after a machine crash, rule 9).
    /// A broker registers before it answers any leader.
    pub(crate) fn register(&mut self, n: NodeId, sid: StorageId) {
        assert!(self.set.contains(&n), "{n} is not a replica of this shard");
        self.registered.insert(n, sid);
    }

    /// Whether the last report naming `n` still vouches for it: it was made under the
    /// identity `n` has registered now (rule 9).
    pub(crate) fn vouched(&self, n: NodeId) -> bool {
        let Some(h) = self.rep.get(&n) else {
            return false;
        };
        breaks::on(&breaks::NO_STORAGE_IDENTITY) || self.registered.get(&n) == Some(&h.sid)
    }

    /// The replicas placement may promote (rule 8): vouched for, and no vouched replica is
    /// reported further ahead. Empty when none is vouched.
    pub(crate) fn eligible(&self) -> Vec<NodeId> {
        let vouched: Vec<&Holding> = self
            .set
            .iter()
            .filter(|&&n| self.vouched(n))
            .map(|n| &self.rep[n])
            .collect();
        let Some(best) = vouched.iter().map(|h| h.pos).max() else {
            return Vec::new();
        };
        vouched
            .iter()
            .filter(|h| h.pos == best)
            .map(|h| h.node)
            .collect()
    }

    /// Name `c` the leader of the next generation, decided on the identity it was reported
    /// under (rule 8). With `reuse_gen`, the newest generation is issued again: not something
    /// placement does, but a fault the simulator injects (a racing placement pass, a control
    /// plane restored from a backup), which ballots (rule 5) exist for.
    pub(crate) fn promote(
        &mut self,
        c: NodeId,
        reuse_gen: bool,
    ) -> Result<Assignment, PromoteError> {
        let eligible = self.eligible();
        if eligible.is_empty() {
            return Err(PromoteError::NoneQualifies);
        }
        if !eligible.contains(&c) {
            return Err(PromoteError::NotEligible { node: c });
        }
        if !(reuse_gen && self.gen > 0) {
            self.gen += 1;
        }
        // A new leader numbers its reports from 1.
        self.rep_seq = 0;
        self.leader = Some(c);
        let sid = self.rep[&c].sid;
        Ok(Assignment {
            gen: self.gen,
            leader: c,
            sid,
        })
    }

    /// A leader's report (rule 7): taken only from the leader named at the newest generation,
    /// stored (durably, before the answer, in the control plane), and answered with the
    /// holders placement vouches for. A report older than the one stored (delivered late) is
    /// not stored over it: it would bring back positions and identities that newer reports
    /// replaced, and a replica could be promoted on what it held before a machine crash.
    pub(crate) fn on_report(&mut self, r: &Report) -> ReportAnswer {
        if r.gen != self.gen || Some(r.leader) != self.leader {
            return ReportAnswer::Refused {
                gen: r.gen,
                newest: self.gen,
            };
        }
        if r.seq < self.rep_seq && !breaks::on(&breaks::REPORTS_IN_ANY_ORDER) {
            return ReportAnswer::Stale {
                gen: r.gen,
                seq: self.rep_seq,
            };
        }
        self.rep_seq = r.seq;
        for h in &r.holders {
            if !self.set.contains(&h.node) {
                continue;
            }
            // An entry under an identity the replica no longer has counts for nothing; it
            // must not displace one under the identity it has now. (A leader can report one:
            // a follower's answer from before its machine crash, delivered late.)
            let current = |sid| self.registered.get(&h.node) == Some(&sid);
            let keep_old = self.rep.get(&h.node).is_some_and(|old| current(old.sid))
                && !current(h.sid)
                && !breaks::on(&breaks::STALE_IDENTITY_OVER_CURRENT);
            if !keep_old {
                self.rep.insert(h.node, *h);
            }
        }
        let counted = r
            .holders
            .iter()
            .filter(|h| self.set.contains(&h.node) && self.vouched(h.node))
            .copied()
            .collect();
        ReportAnswer::Landed {
            gen: r.gen,
            counted,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Node 1's report at `gen`, numbered `seq`.
    fn from_1(gen: u64, seq: u64, holders: Vec<Holding>) -> Report {
        let leader = 1;
        Report {
            gen,
            leader,
            seq,
            holders,
        }
    }

    fn at(node: NodeId, last_gen: u64, end: u64, sid: StorageId) -> Holding {
        let pos = Pos { last_gen, end };
        Holding { node, pos, sid }
    }

    #[test]
    fn placement_promotes_the_furthest_ahead_vouched_replica_and_counts_current_identities() {
        let mut p = Placement::new(BTreeMap::from([(1, 10), (2, 20), (3, 30)]));
        assert_eq!(
            p.eligible(),
            vec![1, 2, 3],
            "a new shard: all tied at the start"
        );
        let a = p.promote(1, false).unwrap();
        assert_eq!((a.gen, a.leader, a.sid), (1, 1, 10));
        // Node 2 holds 5 records of generation 1; node 3 only 2.
        let holders = vec![at(1, 1, 5, 10), at(2, 1, 5, 20), at(3, 1, 2, 30)];
        let report = from_1(1, 1, holders);
        let ReportAnswer::Landed { counted, .. } = p.on_report(&report) else {
            panic!("the named leader's report lands")
        };
        assert_eq!(counted.len(), 3);
        assert_eq!(p.eligible(), vec![1, 2]);
        assert_eq!(
            p.promote(3, false),
            Err(PromoteError::NotEligible { node: 3 }),
            "a replica behind is never promoted"
        );
        // Node 2's machine crashed: it registers a new identity, and the report no longer
        // vouches for it; it is neither counted nor promoted.
        p.register(2, 21);
        assert_eq!(p.eligible(), vec![1]);
        let a = p.promote(1, false).unwrap();
        assert_eq!((a.gen, a.sid), (2, 10));
        // A report from the generation before is refused.
        assert_eq!(
            p.on_report(&report),
            ReportAnswer::Refused { gen: 1, newest: 2 }
        );
        let r2 = from_1(
            2,
            1,
            vec![at(1, 2, 6, 10), at(2, 1, 5, 20), at(3, 2, 6, 30)],
        );
        let ReportAnswer::Landed { counted, .. } = p.on_report(&r2) else {
            panic!()
        };
        let counted: Vec<NodeId> = counted.iter().map(|h| h.node).collect();
        assert_eq!(counted, vec![1, 3], "node 2's old identity is not counted");
        // The generation's first report, delivered again late, is not stored over it.
        let late = Report {
            seq: 0,
            holders: vec![at(3, 1, 2, 29)],
            ..r2.clone()
        };
        assert_eq!(p.on_report(&late), ReportAnswer::Stale { gen: 2, seq: 1 });
        assert_eq!(p.reported(3), Some(at(3, 2, 6, 30)));
        // A newer report naming node 3 under an identity it no longer has (an answer from
        // before a crash, delivered late to the leader) leaves its current entry alone.
        let r3 = Report {
            seq: 2,
            holders: vec![at(1, 2, 6, 10), at(3, 2, 6, 29)],
            ..r2.clone()
        };
        assert!(matches!(p.on_report(&r3), ReportAnswer::Landed { .. }));
        assert_eq!(p.reported(3), Some(at(3, 2, 6, 30)));
        assert!(p.vouched(3));
        breaks::STALE_IDENTITY_OVER_CURRENT.store(true, std::sync::atomic::Ordering::Relaxed);
        let r4 = Report {
            seq: 3,
            ..r3.clone()
        };
        p.on_report(&r4);
        breaks::STALE_IDENTITY_OVER_CURRENT.store(false, std::sync::atomic::Ordering::Relaxed);
        assert!(!p.vouched(3), "the twin lets the stale entry in");
        // Node 1 and node 3 lose their identities too: none qualifies.
        p.register(1, 11);
        p.register(3, 31);
        assert_eq!(p.promote(2, false), Err(PromoteError::NoneQualifies));
    }
}

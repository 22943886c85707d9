//! Placement's side of one shard's replication (docs/replication-design.md), as a pure state
//! machine: the generations it issues and the leader it names at each (rule 1), the reports
//! it takes and what it counts in them (rules 7 and 9), and promotion (rule 8); and the types
//! brokers and the control plane exchange about it. It lives in the control plane's crate
//! because the control plane is to hold this state in its Raft store (it does not yet); the
//! broker's replica machine (`broker/src/core/replica`) uses the same types, and its
//! simulator drives this machine. No clock, no I/O: every decision is a function of what it
//! was told.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub type NodeId = u64;

/// A data directory's storage identity (rule 9): it names the bytes a broker wrote. A machine
/// crash that may have lost unsynced records rotates it, and placement then stops counting
/// what the broker was reported to hold under the old one.
pub type StorageId = u64;

/// A position on a log, ordered as rule 6 compares them: the generation of the last record
/// first, then the end (the offset after the last record).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Pos {
    pub last_gen: u64,
    pub end: u64,
}

/// One replica in a report: it holds the leader's log up to `pos.end`, as it answered under
/// storage identity `sid`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holding {
    pub node: NodeId,
    pub pos: Pos,
    pub sid: StorageId,
}

/// The leader's report to placement: who holds what (rule 7).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    pub gen: u64,
    pub leader: NodeId,
    /// Numbers the leader's reports within its generation: a report delivered late, after a
    /// newer one, is not stored over it.
    pub seq: u64,
    pub holders: Vec<Holding>,
    /// The leader has held no lease for a whole lease period: it cannot reach a majority of
    /// its replicas. Placement names another leader if one qualifies (rule 8,
    /// [`Placement::resign`]); else the leader stays named.
    #[serde(default)]
    pub resign: bool,
    /// For each holder, the bytes of the leader's log past its end (what it still has to
    /// receive; the leader's own entry 0). What operators see as lag in bytes: placement
    /// keeps the last landed report's and decides nothing on it.
    #[serde(default, deserialize_with = "node_keyed::deserialize")]
    pub behind_bytes: BTreeMap<NodeId, u64>,
}

/// Maps keyed by node id, as JSON objects (`{"1": 0}`). A report travels inside the
/// internally tagged `Command`, which serde buffers before it knows the variant; the buffered
/// keys are strings then, and serde's own map refuses them ("expected u64"). This reads a key
/// from a number or from a string of one.
mod node_keyed {
    use super::NodeId;
    use serde::de::{Deserializer, Error, MapAccess, Visitor};
    use std::collections::BTreeMap;
    use std::fmt;

    struct Key(NodeId);

    impl<'de> serde::Deserialize<'de> for Key {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
            struct V;
            impl Visitor<'_> for V {
                type Value = Key;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("a node id, as a number or a string of one")
                }
                fn visit_u64<E: Error>(self, v: u64) -> Result<Key, E> {
                    Ok(Key(v))
                }
                fn visit_str<E: Error>(self, v: &str) -> Result<Key, E> {
                    v.parse()
                        .map(Key)
                        .map_err(|_| E::custom(format!("node id {v:?} is not a number")))
                }
            }
            d.deserialize_any(V)
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<NodeId, u64>, D::Error> {
        struct M;
        impl<'de> Visitor<'de> for M {
            type Value = BTreeMap<NodeId, u64>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map from node id to a number")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Self::Value, A::Error> {
                let mut out = BTreeMap::new();
                while let Some((Key(k), v)) = a.next_entry::<Key, u64>()? {
                    out.insert(k, v);
                }
                Ok(out)
            }
        }
        d.deserialize_map(M)
    }
}

/// Placement's answer to a [`Report`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "snake_case")]
pub enum ReportAnswer {
    /// Stored durably. `counted` are the holders placement vouches for: those whose identity
    /// is still the one they registered (rule 9). Only these move the commit mark.
    Landed { gen: u64, counted: Vec<Holding> },
    /// Placement names another leader at `gen`, or has issued a newer generation `newest`.
    Refused { gen: u64, newest: u64 },
    /// Placement holds a newer report of this leader (`seq` is the one it holds): this one
    /// arrived late and was not stored.
    Stale { gen: u64, seq: u64 },
}

/// Placement names `leader` for `gen`, decided on the storage identity `sid` it was reported
/// under (rule 9: a broker whose identity has rotated since refuses it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    pub gen: u64,
    pub leader: NodeId,
    pub sid: StorageId,
    /// The replica set of `gen`, the leader included: the one its leases, shipments, reports
    /// and commit mark count (rule 11: it may differ from the set of the generation before).
    pub set: Vec<NodeId>,
    /// The settled set when `gen` was issued: the set of the newest generation whose leader's
    /// report landed. The fence needs a majority of it as well as of `set` (rule 11, the
    /// joint fence); it equals `set` unless the set changed and has not settled since.
    #[serde(default)]
    pub settled: Vec<NodeId>,
}

/// Test-build switches that break one rule each, so the replica simulator's negative twins
/// show its checkers catch the break (`broker/src/core/replica/sim.rs`). They are read only in
/// this crate's tests and with the `twins` feature (the broker's tests turn it on); otherwise
/// [`breaks::on`] is `false`.
pub mod breaks {
    use std::sync::atomic::AtomicBool;
    /// Rule 9 dropped: placement counts a report entry whatever identity it was made under,
    /// and a broker takes an assignment decided on an identity it no longer has.
    pub static NO_STORAGE_IDENTITY: AtomicBool = AtomicBool::new(false);
    /// Placement stores a report delivered late over a newer one of the same leader.
    pub static REPORTS_IN_ANY_ORDER: AtomicBool = AtomicBool::new(false);
    /// Placement stores a report entry under an identity the replica no longer has over one
    /// under the identity it has now.
    pub static STALE_IDENTITY_OVER_CURRENT: AtomicBool = AtomicBool::new(false);
    /// Rule 8 dropped: placement promotes any vouched replica, behind the commit mark too.
    pub static PROMOTE_BEHIND_COMMIT: AtomicBool = AtomicBool::new(false);
    /// Rule 11's "settle before change" dropped: placement changes the replica set whether or
    /// not the newest generation's set has settled.
    pub static CHANGE_UNSETTLED: AtomicBool = AtomicBool::new(false);

    #[inline]
    pub fn on(b: &AtomicBool) -> bool {
        #[cfg(any(test, feature = "twins"))]
        return b.load(std::sync::atomic::Ordering::Relaxed);
        #[cfg(not(any(test, feature = "twins")))]
        {
            let _ = b;
            false
        }
    }
}

/// What an operator's `abandon` did (see [`Placement::abandon`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Abandoned {
    pub assignment: Assignment,
    /// What the new leader was reported to hold, vouched for (the empty position if its
    /// report no longer vouches for it): the records it is known to keep.
    pub kept: Pos,
    /// The commit mark before: records from `kept.end` up to `commit.end` were held by a
    /// majority, and acknowledged ones among them may be lost.
    pub commit: Pos,
}

/// Why placement did not name a leader.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PromoteError {
    /// The candidate is not vouched for, or is reported behind the commit mark (rule 8).
    NotEligible { node: NodeId },
    /// No replica qualifies: the shard stays unavailable rather than served short.
    NoneQualifies,
}

/// Why placement did not replace a replica (rule 11).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReplaceError {
    /// The newest generation's set has not settled (no report of its leader landed): the set
    /// changes one step at a time.
    NotSettled,
    /// `out` is not in the set, or `into` already is.
    NotApplicable,
    /// No live replica other than `out` qualifies to lead the new generation (rule 8).
    NoneQualifies,
}

/// One shard's placement.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
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
    /// The commit mark the landed reports show, with the generation of the record below it
    /// (see [`Placement::commit`]); it never moves back.
    #[serde(default)]
    commit: Pos,
    /// The last landed report's [`Report::behind_bytes`], for the replicas of the set.
    #[serde(default)]
    behind_bytes: BTreeMap<NodeId, u64>,
    /// The set of the newest generation whose leader's report landed (rule 11): every fence
    /// covers a majority of it too. Empty in a state written before rule 11 was built, where
    /// the set never changed: the set.
    #[serde(default)]
    settled: Vec<NodeId>,
}

impl Placement {
    /// A new shard: every replica registered under `sids`, each at the empty position.
    pub fn new(sids: BTreeMap<NodeId, StorageId>) -> Placement {
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
            set: set.clone(),
            gen: 0,
            leader: None,
            registered: sids,
            rep,
            rep_seq: 0,
            commit: Pos::default(),
            behind_bytes: BTreeMap::new(),
            settled: set,
        }
    }

    /// The replicas, in the order they were placed.
    pub fn set(&self) -> &[NodeId] {
        &self.set
    }

    /// The set of the newest generation whose leader's report landed (rule 11).
    pub fn settled(&self) -> &[NodeId] {
        if self.settled.is_empty() {
            &self.set
        } else {
            &self.settled
        }
    }

    /// Whether the newest generation's set is the settled one: the set may change (rule 11).
    pub fn is_settled(&self) -> bool {
        let mut a = self.set.clone();
        let mut b = self.settled().to_vec();
        a.sort_unstable();
        b.sort_unstable();
        a == b
    }

    /// The storage identity `n` registered last.
    pub fn registered(&self, n: NodeId) -> Option<StorageId> {
        self.registered.get(&n).copied()
    }

    /// The commit mark as the landed reports show it: the highest end that a majority of
    /// the replica set holds in the newest generation, counting vouched replicas only (the
    /// leader's own rule 7, seen from placement). A holder whose last record is of the
    /// newest generation holds the leader's log up to its end (only that leader writes
    /// records of it). Offset 0 before any such report.
    pub fn commit(&self) -> Pos {
        self.commit
    }

    /// The bytes of the leader's log past replica `n`'s end, as the last landed report said
    /// (None before one named it).
    pub fn behind_bytes(&self, n: NodeId) -> Option<u64> {
        self.behind_bytes.get(&n).copied()
    }

    /// Name the leader of the next generation among the replicas `live` says are up: the
    /// eligible one reported furthest ahead, so that as few records as possible beyond the
    /// mark are cut (ties: lowest node id). With none live and eligible, the shard stays
    /// unavailable.
    pub fn promote_among(
        &mut self,
        live: impl Fn(NodeId) -> bool,
    ) -> Result<Assignment, PromoteError> {
        let best = self
            .eligible()
            .into_iter()
            .filter(|&n| live(n))
            .max_by_key(|&n| (self.rep[&n].pos, std::cmp::Reverse(n)));
        let Some(c) = best else {
            return Err(PromoteError::NoneQualifies);
        };
        self.promote(c, false)
    }

    /// The leader named at the newest generation restarted. A broker never leads a generation
    /// twice (rule 1), so it cannot serve this one again: name the leader of a new generation
    /// as [`Placement::promote_among`] does (the restarted broker is a candidate like any
    /// other). With none qualifying, no leader is named, and the shard is unavailable until
    /// one qualifies (rule 8). Placement may promote at any time, so this is as safe as any
    /// promotion.
    pub fn leader_restarted(
        &mut self,
        live: impl Fn(NodeId) -> bool,
    ) -> Result<Assignment, PromoteError> {
        let r = self.promote_among(live);
        if r.is_err() {
            self.leader = None;
        }
        r
    }

    /// The named leader `leader` resigned (its landed report said it cannot reach a majority):
    /// name the leader of a new generation among the other replicas `live` says are up, as
    /// [`Placement::promote_among`] does. With none qualifying, nothing changes: the leader
    /// stays named, and regains its lease if its replicas come back. As safe as any promotion.
    pub fn resign(&mut self, leader: NodeId, live: impl Fn(NodeId) -> bool) -> Option<Assignment> {
        if self.leader != Some(leader) {
            return None;
        }
        self.promote_among(|n| n != leader && live(n)).ok()
    }

    /// The newest generation and its named leader.
    pub fn newest(&self) -> (u64, Option<NodeId>) {
        (self.gen, self.leader)
    }

    /// What the last landed reports say `n` holds.
    pub fn reported(&self, n: NodeId) -> Option<Holding> {
        self.rep.get(&n).copied()
    }

    /// `n` came back under storage identity `sid` (a rotation after a machine crash, rule 9).
    /// A broker registers before it answers any leader.
    pub fn register(&mut self, n: NodeId, sid: StorageId) {
        assert!(self.set.contains(&n), "{n} is not a replica of this shard");
        self.registered.insert(n, sid);
    }

    /// Whether the last report naming `n` still vouches for it: it was made under the
    /// identity `n` has registered now (rule 9).
    pub fn vouched(&self, n: NodeId) -> bool {
        let Some(h) = self.rep.get(&n) else {
            return false;
        };
        breaks::on(&breaks::NO_STORAGE_IDENTITY) || self.registered.get(&n) == Some(&h.sid)
    }

    /// The replicas placement may promote (rule 8): vouched for, and reported at or past the
    /// commit mark (compared as rule 6 does). Every record a `quorum` publish was acknowledged
    /// for is below the mark (the leader releases an acknowledgement only on a landed report,
    /// and placement computes the same mark from the same report), and a replica at or past it
    /// holds the leader's log up to it: so each of these holds every acknowledged record. A
    /// replica behind the mark never qualifies; the leader qualifies as any replica does.
    /// In ascending node order; empty when none qualifies.
    pub fn eligible(&self) -> Vec<NodeId> {
        if breaks::on(&breaks::PROMOTE_BEHIND_COMMIT) {
            return self
                .set
                .iter()
                .copied()
                .filter(|&n| self.vouched(n))
                .collect();
        }
        let mut v: Vec<NodeId> = self
            .set
            .iter()
            .copied()
            .filter(|&n| self.vouched(n) && self.rep[&n].pos >= self.commit)
            .collect();
        v.sort_unstable();
        v
    }

    /// Name `c` the leader of the next generation, decided on the identity it was reported
    /// under (rule 8). With `reuse_gen`, the newest generation is issued again: not something
    /// placement does, but a fault the simulator injects (a racing placement pass, a control
    /// plane restored from a backup), which ballots (rule 5) exist for.
    pub fn promote(&mut self, c: NodeId, reuse_gen: bool) -> Result<Assignment, PromoteError> {
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
        Ok(self.assignment(c, sid))
    }

    fn assignment(&self, leader: NodeId, sid: StorageId) -> Assignment {
        Assignment {
            gen: self.gen,
            leader,
            sid,
            set: self.set.clone(),
            settled: self.settled().to_vec(),
        }
    }

    /// Rule 11: replace replica `out` (dead too long, as the caller judges: failure detection
    /// is never trusted for safety) by broker `into`, registered under `sid`, in a new
    /// generation. Only while the set is settled (settle before change), so at most two sets
    /// are in play and the assignment's settled set is the only older one its fence must
    /// cover. The leader stays the named one if `live` says it is up and it qualifies (rule
    /// 8), else it is the live replica that qualifies furthest ahead, as
    /// [`Placement::promote_among`] names one; `out` never leads it. `into` holds nothing
    /// yet: it counts (and may be promoted) once a landed report names it under `sid`, at or
    /// past the mark like any replica; until then the shard is under-replicated.
    pub fn replace(
        &mut self,
        out: NodeId,
        into: NodeId,
        sid: StorageId,
        live: impl Fn(NodeId) -> bool,
    ) -> Result<Assignment, ReplaceError> {
        if !self.set.contains(&out) || self.set.contains(&into) {
            return Err(ReplaceError::NotApplicable);
        }
        if !self.is_settled() && !breaks::on(&breaks::CHANGE_UNSETTLED) {
            return Err(ReplaceError::NotSettled);
        }
        let candidates: Vec<NodeId> = self
            .eligible()
            .into_iter()
            .filter(|&n| n != out && live(n))
            .collect();
        let keep = self.leader.filter(|l| candidates.contains(l));
        let best = keep.or_else(|| {
            candidates
                .iter()
                .copied()
                .max_by_key(|&n| (self.rep[&n].pos, std::cmp::Reverse(n)))
        });
        let Some(c) = best else {
            return Err(ReplaceError::NoneQualifies);
        };
        let old = self.settled().to_vec();
        for n in self.set.iter_mut().filter(|n| **n == out) {
            *n = into;
        }
        self.settled = old;
        self.registered.remove(&out);
        self.rep.remove(&out);
        self.behind_bytes.remove(&out);
        self.registered.insert(into, sid);
        let a = self
            .promote(c, false)
            .expect("a replica of the new set that qualified before the change");
        debug_assert!(a.set.contains(&into) && !a.set.contains(&out));
        Ok(a)
    }

    /// The operator's way out of a shard no replica qualifies for (rule 8 leaves it
    /// unavailable): name `c` the leader of a new generation whatever it was reported to
    /// hold, under the identity it has registered now (a broker refuses an assignment for an
    /// identity it no longer has, rule 9). What the mark covered past what `c` is known to
    /// hold may be lost; the mark drops to that, so that promotion works from it again (a
    /// replica reported further ahead in an older generation stays behind every position of
    /// the new one, rule 6). `NotEligible` when `c` is not a replica.
    pub fn abandon(&mut self, c: NodeId) -> Result<Abandoned, PromoteError> {
        let Some(&sid) = self.registered.get(&c) else {
            return Err(PromoteError::NotEligible { node: c });
        };
        let kept = if self.vouched(c) {
            self.rep[&c].pos
        } else {
            Pos::default()
        };
        let commit = self.commit;
        self.gen += 1;
        self.rep_seq = 0;
        self.leader = Some(c);
        self.rep.insert(
            c,
            Holding {
                node: c,
                pos: kept,
                sid,
            },
        );
        self.commit = self.commit.min(kept);
        let assignment = self.assignment(c, sid);
        Ok(Abandoned {
            assignment,
            kept,
            commit,
        })
    }

    /// A leader's report (rule 7): taken only from the leader named at the newest generation,
    /// stored (durably, before the answer, in the control plane), and answered with the
    /// holders placement vouches for. A report older than the one stored (delivered late) is
    /// not stored over it: it would bring back positions and identities that newer reports
    /// replaced, and a replica could be promoted on what it held before a machine crash.
    pub fn on_report(&mut self, r: &Report) -> ReportAnswer {
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
        // The newest generation's leader reported: its set is the settled one (rule 11).
        self.settled = self.set.clone();
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
        let counted: Vec<Holding> = r
            .holders
            .iter()
            .filter(|h| self.set.contains(&h.node) && self.vouched(h.node))
            .copied()
            .collect();
        self.note_commit(&counted);
        self.behind_bytes = r
            .behind_bytes
            .iter()
            .filter(|(n, _)| self.set.contains(n))
            .map(|(&n, &b)| (n, b))
            .collect();
        ReportAnswer::Landed {
            gen: r.gen,
            counted,
        }
    }
}

impl Placement {
    /// Move [`Placement::commit`] on the holders a landed report counted.
    fn note_commit(&mut self, counted: &[Holding]) {
        let majority = self.set.len() / 2 + 1;
        // One end per replica, whatever the report repeats.
        let by_node: BTreeMap<NodeId, u64> = counted
            .iter()
            .filter(|h| h.pos.last_gen == self.gen)
            .map(|h| (h.node, h.pos.end))
            .collect();
        let mut ends: Vec<u64> = by_node.into_values().collect();
        if ends.len() < majority {
            return;
        }
        ends.sort_unstable_by(|a, b| b.cmp(a));
        let mark = Pos {
            last_gen: self.gen,
            end: ends[majority - 1],
        };
        self.commit = self.commit.max(mark);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Node 1's report at `gen`, numbered `seq`.
    fn from_1(gen: u64, seq: u64, holders: Vec<Holding>) -> Report {
        report_of(gen, 1, seq, holders)
    }

    fn report_of(gen: u64, leader: NodeId, seq: u64, holders: Vec<Holding>) -> Report {
        Report {
            gen,
            leader,
            seq,
            holders,
            resign: false,
            behind_bytes: BTreeMap::new(),
        }
    }

    fn at(node: NodeId, last_gen: u64, end: u64, sid: StorageId) -> Holding {
        let pos = Pos { last_gen, end };
        Holding { node, pos, sid }
    }

    /// Rule 11 at placement: a replica is replaced in a new generation whose assignment names
    /// the settled set; the set changes again only once a report of that generation landed;
    /// the new replica counts (and may lead) only once a report names it at or past the mark.
    #[test]
    fn a_replacement_carries_the_settled_set_and_waits_for_it_to_settle() {
        let mut p = Placement::new(BTreeMap::from([(1, 10), (2, 20), (3, 30)]));
        p.promote(1, false).unwrap();
        let holders = vec![at(1, 1, 5, 10), at(2, 1, 5, 20), at(3, 1, 5, 30)];
        assert!(matches!(
            p.on_report(&from_1(1, 1, holders)),
            ReportAnswer::Landed { .. }
        ));
        assert_eq!(
            p.replace(9, 4, 40, |_| true),
            Err(ReplaceError::NotApplicable)
        );
        assert_eq!(
            p.replace(2, 3, 40, |_| true),
            Err(ReplaceError::NotApplicable)
        );
        let a = p.replace(2, 4, 40, |n| n != 2).unwrap();
        assert_eq!((a.gen, a.leader), (2, 1), "the leader stays");
        assert_eq!(
            (a.set.clone(), a.settled.clone()),
            (vec![1, 4, 3], vec![1, 2, 3])
        );
        assert!(!p.is_settled());
        assert!(!p.vouched(4), "not counted before a report names it");
        assert_eq!(p.eligible(), vec![1, 3]);
        // Settle before change.
        assert_eq!(p.replace(3, 2, 20, |_| true), Err(ReplaceError::NotSettled));
        breaks::CHANGE_UNSETTLED.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut twin = p.clone();
        let t = twin.replace(3, 2, 20, |_| true);
        breaks::CHANGE_UNSETTLED.store(false, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(
            t.map(|a| a.settled),
            Ok(vec![1, 2, 3]),
            "the twin changes anyway"
        );
        // Generation 2's report lands: settled, and node 4 counts, level with the mark.
        let r = from_1(2, 1, vec![at(1, 2, 6, 10), at(4, 2, 6, 40)]);
        assert!(matches!(p.on_report(&r), ReportAnswer::Landed { .. }));
        assert!(p.is_settled() && p.vouched(4));
        assert_eq!(
            p.commit(),
            Pos {
                last_gen: 2,
                end: 6
            }
        );
        assert_eq!(p.eligible(), vec![1, 4], "node 3 is behind the mark now");
        // With the leader down, a replacement names the qualifying live replica instead.
        let a = p.replace(3, 2, 20, |n| n != 1).unwrap();
        assert_eq!((a.gen, a.leader, a.settled), (3, 4, vec![1, 4, 3]));
        // None qualifies: nothing changes.
        let mut q = p.clone();
        q.on_report(&report_of(3, 4, 1, vec![at(4, 3, 7, 40)]));
        assert_eq!(
            q.replace(4, 3, 30, |n| n == 4),
            Err(ReplaceError::NoneQualifies)
        );
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

    /// Placement's state and answers travel as JSON (the Raft store and REST, later): a
    /// round trip keeps every decision the same.
    #[test]
    fn placement_and_its_answers_round_trip_through_json() {
        let mut p = Placement::new(BTreeMap::from([(1, 10), (2, 20), (3, 30)]));
        p.promote(2, false).unwrap();
        let r = report_of(1, 2, 1, vec![at(2, 1, 4, 20), at(3, 1, 4, 30)]);
        let a = p.on_report(&r);
        let json = serde_json::to_string(&a).unwrap();
        assert!(json.starts_with(r#"{"answer":"landed""#), "{json}");
        assert_eq!(serde_json::from_str::<ReportAnswer>(&json).unwrap(), a);
        let back: Placement = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        assert_eq!(back.eligible(), p.eligible());
        assert_eq!(back.eligible(), vec![2, 3]);
    }
}

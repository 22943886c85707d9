//! Rule 11 in the simulated world: placement swaps the fourth broker in for a replica
//! (`World::replace`), the catalog's change reaches each broker over the network
//! (`World::follow_catalog`: a broker hosts a replica from its disk once the set names it, and
//! ends the one it hosts once it does not), and partitions that split the brokers and
//! placement in two sides (`World::split`).

use super::*;

impl World {
    /// Broker `n` reads the catalog: it hosts a replica if placement's set names it now, from
    /// what its disk holds (as a broker's `refresh_replicas` opens one), and ends the one it
    /// hosts if not (its files stay).
    pub(super) fn follow_catalog(&mut self, n: NodeId) -> Option<NodeId> {
        let named = self.placement.set().contains(&n);
        let hosted = self.nodes[&n].hosted;
        if named == hosted {
            return None;
        }
        self.trace.push(format!(
            "{n} {} the replica",
            if named { "hosts" } else { "ends" }
        ));
        self.nodes.get_mut(&n).unwrap().hosted = named;
        // Either way the machine it had is gone: a new one comes up from the disk.
        self.restart(n).ok()?;
        None
    }

    /// Placement swaps a replica for the broker outside the set (rule 11): any replica, as
    /// failure detection is never trusted for safety. Refused while the set has not settled.
    pub(super) fn replace(&mut self) {
        let set = self.placement.set().to_vec();
        // The leader half the time: a leader cut off from the control plane looks dead, and
        // replacing it is where two sets race.
        let out = match self.placement.newest().1 {
            Some(l) if self.rng.chance(50) => l,
            _ => set[self.rng.below(set.len() as u64) as usize],
        };
        let Some(into) = (1..=self.span).find(|n| !set.contains(n)) else {
            return;
        };
        let sid = self.nodes[&into].sid;
        match self.placement.replace(out, into, sid, |n| n != out) {
            Ok(a) => {
                self.heard_ms = self.true_ms;
                self.swapped_in = Some(into);
                self.trace
                    .push(format!("placement replaces {out} by {into}: {a:?}"));
                // A broker looks dead to the control plane when it is cut off from it: now and
                // then the replaced one is, and hears neither the catalog nor report answers,
                // while its peers may still reach it.
                if self.partitions && self.rng.chance(30) {
                    // Cut off together with another replica of the set it left: the two
                    // still reach each other (what the joint fence exists for).
                    let others: Vec<NodeId> = set
                        .iter()
                        .copied()
                        .filter(|&n| n != out && n != a.leader)
                        .collect();
                    let with = others[self.rng.below(others.len() as u64) as usize];
                    let side: Vec<bool> = (0..=self.span).map(|n| n == out || n == with).collect();
                    self.split_by(&side);
                } else if self.partitions && self.rng.chance(30) {
                    // The new generation's leader cannot report: its set does not settle.
                    self.cut.insert((a.leader, PLACEMENT));
                    self.trace.push(format!("cut {}->{PLACEMENT}", a.leader));
                } else if self.rng.chance(50) {
                    self.cut.insert((out, PLACEMENT));
                    self.cut.insert((PLACEMENT, out));
                    self.trace.push(format!("cut {out}-{PLACEMENT}"));
                }
                self.net.push((PLACEMENT, a.leader, Wire::Assign(a)));
                for n in 1..=self.span {
                    self.net.push((PLACEMENT, n, Wire::Catalog));
                }
            }
            Err(e) => self
                .trace
                .push(format!("placement replaces {out} by {into}: {e:?}")),
        }
    }

    /// Split the brokers and placement in two sides, every link between them cut both ways
    /// (a partition of any subset: a leader and one follower on one side, the others and
    /// the control plane on the other, is what a change of replica set must survive).
    pub(super) fn split(&mut self) {
        let side: Vec<bool> = (0..=self.span).map(|_| self.rng.chance(50)).collect();
        self.split_by(&side);
    }

    /// Cut every link between the nodes (placement is 0) `side` puts on either side.
    fn split_by(&mut self, side: &[bool]) {
        for a in 0..=self.span {
            for b in 0..=self.span {
                if side[a as usize] != side[b as usize] {
                    self.cut.insert((a, b));
                }
            }
        }
        let one: Vec<u64> = (0..=self.span).filter(|&n| side[n as usize]).collect();
        self.trace.push(format!("split {one:?} from the rest"));
    }
}

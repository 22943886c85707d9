//! Rule 11 in the catalog (docs/replication-design.md): a broker dead longer than
//! `--replica-replace-after-ms` is replaced in the replica sets of replicated shards, one
//! replica at a time per shard, by a live broker outside the set. The control plane's sweep
//! judges the time ([`Command::ReplaceReplicas`]); what may change is decided here, from the
//! Raft state alone.

use super::*;

impl Catalog {
    /// The replacements rule 11 allows now for dead broker `node`: each shard of a replicated
    /// stream whose set holds it and has settled, with the live broker outside the set that
    /// takes its place (registered with a storage identity; the one holding the fewest
    /// replicas of that stream, ties to the lowest node id). Empty while `node` is live.
    pub fn replacements(&self, node: u64) -> Vec<(ShardKey, u64, StorageId)> {
        if self.brokers.get(&node).is_none_or(|b| b.live) {
            return Vec::new();
        }
        let live = self.live();
        let mut out = Vec::new();
        for ((k, shard), p) in &self.replicas {
            if !p.set().contains(&node) || !p.is_settled() {
                continue;
            }
            let Some(s) = self.streams.get(k) else {
                continue;
            };
            let mut held: BTreeMap<u64, usize> = BTreeMap::new();
            for sp in &s.placement {
                for &n in &sp.replicas {
                    *held.entry(n).or_default() += 1;
                }
            }
            let into = self
                .brokers
                .values()
                .filter(|b| b.live && !p.set().contains(&b.node_id))
                .filter_map(|b| sid_of(b).map(|sid| (b.node_id, sid)))
                .min_by_key(|&(n, _)| (held.get(&n).copied().unwrap_or(0), n));
            // The new generation needs a live leader that qualifies (rule 8).
            let leads = p.eligible().iter().any(|&n| n != node && live.contains(&n));
            if let Some((into, sid)) = into.filter(|_| leads) {
                out.push(((k.clone(), *shard), into, sid));
            }
        }
        out
    }

    /// Rule 11: replace dead broker `node` in every shard [`Catalog::replacements`] names, each
    /// in a new generation whose assignment carries the settled set its fence must cover.
    /// Returns how many shards changed.
    pub(in crate::catalog) fn replace_replicas(&mut self, node: u64) -> u64 {
        let live = self.live();
        let mut n = 0;
        for ((k, shard), into, sid) in self.replacements(node) {
            let Some(p) = self.replicas.get_mut(&(k.clone(), shard)) else {
                continue;
            };
            if p.replace(node, into, sid, |m| live.contains(&m)).is_ok() {
                let p = p.clone();
                self.publish_placement(&k, shard, &p);
                n += 1;
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{create, live, preview, register, report, shard, sid};
    use super::*;

    /// Four brokers with identities and stream "s" of one shard and three copies.
    fn four_seated() -> (Catalog, [u64; 3], u64) {
        let mut c = preview();
        for n in 1..=3 {
            register(&mut c, n, Some(sid(n)));
        }
        create(&mut c, "s", 1, 3).unwrap();
        register(&mut c, 4, Some(sid(4)));
        let sp = shard(&c, "s", 0);
        (c, [sp.leader.unwrap(), sp.replicas[1], sp.replicas[2]], 4)
    }

    fn replace(c: &mut Catalog, node: u64) -> u64 {
        match c
            .apply(&Command::ReplaceReplicas { node_id: node })
            .unwrap()
        {
            Reply::Replaced { shards } => shards,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_dead_follower_is_replaced_one_step_at_a_time_and_the_new_replica_counts_once_reported() {
        let (mut c, [l, f1, f2], spare) = four_seated();
        assert!(
            c.replacements(f1).is_empty(),
            "a live broker is not replaced"
        );
        assert_eq!(replace(&mut c, f1), 0);
        live(&mut c, f1, false);
        assert_eq!(c.replication_health().under_replicated, 1);
        // No report of generation 1 landed, but a new shard's set is settled.
        assert_eq!(
            c.replacements(f1),
            vec![((key("t", "n", "s"), 0), spare, sid(spare))]
        );
        assert_eq!(replace(&mut c, f1), 1);
        let sp = shard(&c, "s", 0);
        assert_eq!(sp.generation, 2, "a new generation");
        assert_eq!(sp.leader, Some(l), "the live leader that qualifies stays");
        let set: BTreeSet<u64> = sp.replicas.iter().copied().collect();
        assert_eq!(set, BTreeSet::from([l, f2, spare]));
        let mut settled = sp.settled.clone();
        settled.sort_unstable();
        let mut old = vec![l, f1, f2];
        old.sort_unstable();
        assert_eq!(settled, old, "the fence must cover the old set too");
        // Until a landed report names it, the new replica does not count.
        let h = c.replication_health();
        assert_eq!(h.under_replicated, 1);
        // Settle before change: another dead replica waits for generation 2 to settle.
        live(&mut c, f2, false);
        assert!(c.replacements(f2).is_empty());
        assert_eq!(replace(&mut c, f2), 0);
        // The leader's report of generation 2 lands, naming the new replica: settled.
        let a = report(
            &mut c,
            "s",
            0,
            2,
            l,
            1,
            &[(l, 2, 5, sid(l)), (spare, 2, 5, sid(spare))],
        );
        assert!(matches!(a, ReportAnswer::Landed { ref counted, .. } if counted.len() == 2));
        assert!(
            shard(&c, "s", 0).settled.is_empty(),
            "settled: the entry says so"
        );
        // f2 is dead: still under-replicated, but the spare counts now.
        let v = c.stream_replication("t", "n", "s").unwrap();
        let new = v.shards[0]
            .replicas
            .iter()
            .find(|r| r.node == spare)
            .unwrap();
        assert!(new.vouched && new.end == 5);
        // Now f2 may be replaced, by f1 only if it came back: it is dead, so nobody.
        assert!(
            c.replacements(f2).is_empty(),
            "no live broker outside the set"
        );
        live(&mut c, f1, true);
        assert_eq!(c.replacements(f2).len(), 1);
        assert_eq!(replace(&mut c, f2), 1);
        let sp = shard(&c, "s", 0);
        let set: BTreeSet<u64> = sp.replicas.iter().copied().collect();
        assert_eq!(set, BTreeSet::from([l, spare, f1]));
        assert_eq!(sp.generation, 3);
    }

    #[test]
    fn a_replacement_needs_a_live_replica_that_qualifies_to_lead() {
        let (mut c, [l, f1, f2], spare) = four_seated();
        // The leader reports f1 behind the mark, f2 level: the mark is at 5.
        report(
            &mut c,
            "s",
            0,
            1,
            l,
            1,
            &[(l, 1, 5, sid(l)), (f1, 1, 0, sid(f1)), (f2, 1, 5, sid(f2))],
        );
        // The leader dies: f2 is promoted (generation 2); then dies too.
        live(&mut c, l, false);
        assert_eq!(shard(&c, "s", 0).leader, Some(f2));
        live(&mut c, f2, false);
        // f1 is behind the mark: no live replica qualifies, so nothing is replaced (the
        // shard waits for the operator's abandon).
        assert!(c.replacements(l).is_empty());
        assert!(c.replacements(f2).is_empty());
        let _ = spare;
    }
}

//! The simulator's checks after every step, the fault model's bound on machine crashes, and
//! retention (rule 10): a node's log trimmed below the mark it learnt, as its real log's
//! retention does, the machine told at once (a driver tells it before its next input).
//!
//! Below a disk's base its records are [`GONE`]: retention removed them, which loses no
//! acknowledged record the model counts (a client reading there is told the offset is below
//! retention). So every check compares what both sides still hold, from the higher base.

use super::*;

impl Node {
    /// The machine's view of this disk: the generations from its base.
    pub(super) fn view(&self) -> GenLog {
        let held = &self.disk_log[self.disk_base as usize..];
        GenLog::from_gens_at(self.disk_base, held.iter().map(|e| e.gen))
    }

    /// The record at `off`, if this disk holds one (past its base).
    fn holds(&self, off: u64) -> Option<&Entry> {
        (off >= self.disk_base)
            .then(|| self.disk_log.get(off as usize))
            .flatten()
    }
}

impl World {
    /// Retention on node `n`: its log trimmed to a random point at or below the mark its
    /// machine learnt (the real hold lags that mark, so it may trim less, never more).
    pub(super) fn trim(&mut self, n: NodeId) {
        let x = self.nodes.get_mut(&n).unwrap();
        if !x.hosted {
            return; // a broker runs retention on the logs it hosts
        }
        let hold = x.r.known_commit();
        if hold <= x.disk_base {
            return;
        }
        let to = x.disk_base + 1 + self.rng.below(hold - x.disk_base);
        for e in &mut x.disk_log[x.disk_base as usize..to as usize] {
            *e = GONE;
        }
        x.disk_base = to;
        x.r.trimmed(to);
        self.trace
            .push(format!("retention at {n}: trimmed below {to}"));
    }

    /// Whether some disk trimmed `off` (retention removed it there, rule 10: it was committed,
    /// and a reader is told it is below retention).
    fn trimmed_somewhere(&self, off: u64) -> bool {
        self.nodes.values().any(|x| off < x.disk_base)
    }

    /// Whether a machine crash of `n` stays within the fault model: every other node is vouched
    /// for under its current identity (one node loses data at a time), and every acknowledged
    /// or committed record is also on another node that the last landed report vouches for, at
    /// or past it, unless retention removed it somewhere. The identity is compared here
    /// whatever `breaks` says: this is the world's bound, not the rule under test.
    pub(super) fn may_lose_data(&self, n: NodeId) -> bool {
        let vouched = |m: NodeId| {
            let sid = self.nodes[&m].sid;
            self.placement.reported(m).is_some_and(|h| h.sid == sid)
        };
        // Data is lost by one node at a time: every other replica counts under its identity.
        if self.placement.set().iter().any(|&m| m != n && !vouched(m)) {
            return false;
        }
        let kept = |off: u64, e: &Entry| {
            self.trimmed_somewhere(off)
                || self.nodes.iter().any(|(&m, x)| {
                    let h = self.placement.reported(m);
                    m != n
                        && x.holds(off) == Some(e)
                        && h.is_some_and(|h| h.sid == x.sid && h.pos.end > off)
                })
        };
        // Committed records are what the fault model keeps, acknowledged or not: those below
        // the highest commit mark any node learnt, as that node holds them.
        let learnt = self
            .commit_seen
            .iter()
            .max_by_key(|(_, k)| **k)
            .map(|(&m, &k)| (&self.nodes[&m], k));
        let committed_kept = learnt.is_none_or(|(x, k)| {
            (x.disk_base..k.min(x.disk_log.len() as u64))
                .all(|off| kept(off, &x.disk_log[off as usize]))
        });
        committed_kept && self.acked.iter().all(|(&off, (e, _))| kept(off, e))
    }

    /// `AtMostOneServing`, `NoAckedRecordLost` and `CommittedPrefixMatches` now, and
    /// `LogMatching` over every pair of disks.
    pub(super) fn check(&mut self) -> Result<(), String> {
        // A broker that ended its replica (out of the set, rule 11) serves nothing.
        let serving: Vec<NodeId> = (1..=self.span)
            .filter(|&n| self.nodes[&n].hosted && self.nodes[&n].r.serving(self.now(n)))
            .collect();
        if serving.len() > 1 {
            return Err(format!(
                "AtMostOneServing: nodes {serving:?} serve at true time {} ms",
                self.true_ms
            ));
        }
        self.reached.served |= !serving.is_empty();
        // NoAckedRecordLost: the leaders of placement's newest generation hold every
        // acknowledged record at its offset (unless their retention removed it).
        let (newest, _) = self.placement.newest();
        for (&n, x) in &self.nodes {
            if x.r.leading() != Some(newest) {
                continue;
            }
            for (&off, (e, by)) in &self.acked {
                if off >= x.disk_base && x.holds(off) != Some(e) {
                    return Err(format!(
                        "NoAckedRecordLost: node {n} leads generation {newest} without {e:?} at offset {off} (acknowledged by {by}); it holds {:?}",
                        x.holds(off)
                    ));
                }
            }
        }
        // CommittedPrefixMatches: what a node learnt committed is, record for record, in the
        // log of every leader of placement's newest generation (where both still hold it).
        for (&n, x) in &self.nodes {
            if x.r.leading() != Some(newest) {
                continue;
            }
            for (&m, y) in &self.nodes {
                let k = self.commit_seen.get(&m).copied().unwrap_or(0) as usize;
                let k = k.min(y.disk_log.len());
                let lo = x.disk_base.max(y.disk_base) as usize;
                if lo < k && x.disk_log.get(lo..k) != y.disk_log.get(lo..k) {
                    return Err(format!(
                        "CommittedPrefixMatches: node {m} learnt offsets below {k} committed, and node {n}, leading generation {newest}, holds other records in {lo}..{k}"
                    ));
                }
            }
        }
        let leading =
            (1..=self.span).filter(|n| self.nodes[n].hosted && self.nodes[n].r.leading().is_some());
        self.reached.two_leading |= leading.count() >= 2;
        let logs: Vec<(NodeId, &Node)> = self.nodes.iter().map(|(n, x)| (*n, x)).collect();
        for (i, (a, xa)) in logs.iter().enumerate() {
            for (b, xb) in &logs[i + 1..] {
                let (la, lb) = (&xa.disk_log, &xb.disk_log);
                let lo = xa.disk_base.max(xb.disk_base) as usize;
                let common = la.len().min(lb.len());
                let Some(o) = (lo..common).rev().find(|&o| la[o].gen == lb[o].gen) else {
                    continue;
                };
                if la[lo..=o] != lb[lo..=o] {
                    return Err(format!(
                        "LogMatching: nodes {a} and {b} both hold generation {} at offset {o} but differ at or below it (from {lo}): {:?} vs {:?}",
                        la[o].gen,
                        &la[lo..=o],
                        &lb[lo..=o]
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Every message the machines send goes through the `Replicate` frame's codec and must come
/// back the same (the records a shipment carries stand in as record identities).
pub(super) fn wire_round_trip(msg: &Msg, ids: &[u64]) -> Result<(), String> {
    use felix_quic::wire::{decode_frame, replica, Frame, StreamName};
    let frame = Frame::Replicate {
        shard: replica::ShardRef {
            stream: StreamName::new("t", "n", "s"),
            incarnation: 1,
            shard: 0,
        },
        msg: msg.clone(),
        records: ids
            .iter()
            .map(|&id| replica::ShippedRecord {
                ts_ms: id,
                flags: 0,
                payload: bytes::Bytes::new(),
            })
            .collect(),
    };
    match decode_frame(&frame.encode(), 16 << 20) {
        Ok(back) if back == frame => Ok(()),
        other => Err(format!("wire_round_trip: {msg:?} came back as {other:?}")),
    }
}

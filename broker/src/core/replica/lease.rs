//! Rules 2 and 4 of `docs/replication-design.md`: the leader's lease on its own monotonic
//! clock, and the wait after its fence completes. Times are milliseconds of the caller's
//! monotonic clock, passed in; nothing here reads a clock.

use super::NodeId;
use std::collections::{BTreeMap, BTreeSet};

/// Timing of a replica. The wait after a fence is `lease_ms + margin_ms`: the margin covers
/// the clocks' rate difference over one lease and the longest suspension between a lease
/// check and acting on it (the design's assumptions, stated, not checked).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReplicaCfg {
    pub lease_ms: u64,
    pub margin_ms: u64,
    /// How often a leader asks its replicas to renew its lease (below `lease_ms`).
    pub renew_ms: u64,
    /// Records per shipment, at most.
    pub batch_max: usize,
    /// How long a publish waits for the commit mark before it is answered "cannot vouch"
    /// (rule 7).
    pub quorum_wait_ms: u64,
}

impl Default for ReplicaCfg {
    fn default() -> Self {
        ReplicaCfg {
            lease_ms: 2_000,
            margin_ms: 500,
            renew_ms: 500,
            batch_max: 64,
            quorum_wait_ms: 5_000,
        }
    }
}

impl ReplicaCfg {
    /// The broker's settings (checked there): the lease, a margin of a quarter of it, a
    /// renewal every quarter of it.
    pub(crate) fn from_config(c: &crate::config::Config) -> ReplicaCfg {
        ReplicaCfg {
            lease_ms: c.replica_lease_ms,
            margin_ms: c.replica_lease_ms / 4,
            renew_ms: (c.replica_lease_ms / 4).max(1),
            batch_max: c.replica_ship_records_max as usize,
            quorum_wait_ms: c.replica_quorum_wait_ms,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.renew_ms == 0
            || self.renew_ms >= self.lease_ms
            || self.batch_max == 0
            || self.quorum_wait_ms == 0
        {
            return Err(format!(
                "replica timing: renew_ms 1..lease_ms ({}), batch_max 1.., quorum_wait_ms 1.., got renew_ms {} batch_max {} quorum_wait_ms {}",
                self.lease_ms, self.renew_ms, self.batch_max, self.quorum_wait_ms
            ));
        }
        Ok(())
    }
}

/// Lease exchanges kept waiting for answers; older ones are forgotten (a later one that a
/// majority answers gives a later lease anyway).
const ROUNDS_MAX: usize = 8;

/// A leader's lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Lease {
    /// The generation it is held for.
    pub gen: u64,
    /// Serving starts here: the fence completed, plus the lease and the margin (rule 4), so
    /// every lease granted before the fence has run out.
    serve_from_ms: u64,
    /// Held until (exclusive): the send time of the newest exchange a majority answered, plus
    /// the lease (rule 2).
    until_ms: Option<u64>,
    /// Exchanges in flight, by send time: who answered (the leader itself included).
    rounds: BTreeMap<u64, BTreeSet<NodeId>>,
    last_ask_ms: Option<u64>,
}

impl Lease {
    /// The lease of a leader whose fence of `gen` completed at `now_ms`.
    pub(crate) fn new(gen: u64, now_ms: u64, cfg: &ReplicaCfg) -> Lease {
        let wait_ms = if super::breaks::on(&super::breaks::NO_LEASE_WAIT) {
            0
        } else {
            cfg.lease_ms + cfg.margin_ms
        };
        Lease {
            gen,
            serve_from_ms: now_ms + wait_ms,
            until_ms: None,
            rounds: BTreeMap::new(),
            last_ask_ms: None,
        }
    }

    /// Whether the leader may acknowledge a write or serve a read at `now_ms`.
    pub(crate) fn serving(&self, now_ms: u64) -> bool {
        now_ms >= self.serve_from_ms && self.until_ms.is_some_and(|u| now_ms < u)
    }

    /// While [`Lease::serving`] at `now_ms`: the end of the lease (exclusive), past which it
    /// serves no more unless a renewal is answered first.
    pub(crate) fn serving_until(&self, now_ms: u64) -> Option<u64> {
        if self.serving(now_ms) {
            self.until_ms
        } else {
            None
        }
    }

    /// How long, at `now_ms`, the leader has gone without a lease it could serve under since
    /// it could first serve: 0 while it serves or still waits out older leases.
    pub(crate) fn lapsed_ms(&self, now_ms: u64) -> u64 {
        let since = self
            .until_ms
            .map_or(self.serve_from_ms, |u| u.max(self.serve_from_ms));
        now_ms.saturating_sub(since)
    }

    /// Whether a renewal is due at `now_ms`.
    pub(crate) fn due(&self, now_ms: u64, cfg: &ReplicaCfg) -> bool {
        self.last_ask_ms
            .is_none_or(|t| now_ms >= t.saturating_add(cfg.renew_ms))
    }

    /// A new exchange sent at `now_ms` by `me`: its round (the send time).
    pub(crate) fn ask(&mut self, me: NodeId, now_ms: u64) -> u64 {
        self.last_ask_ms = Some(now_ms);
        self.rounds.entry(now_ms).or_default().insert(me);
        while self.rounds.len() > ROUNDS_MAX {
            self.rounds.pop_first();
        }
        now_ms
    }

    /// `from` answered the exchange `round`; with a majority, the lease runs to `round +
    /// lease_ms`.
    pub(crate) fn granted(&mut self, round: u64, from: NodeId, majority: usize, cfg: &ReplicaCfg) {
        let Some(who) = self.rounds.get_mut(&round) else {
            return;
        };
        who.insert(from);
        if who.len() >= majority {
            let until = round + cfg.lease_ms;
            self.until_ms = Some(self.until_ms.map_or(until, |u| u.max(until)));
            // Answers to this round or older ones can only give an earlier lease.
            self.rounds.retain(|&r, _| r > round);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_serves_only_after_the_wait_and_a_majority_and_never_shrinks() {
        let cfg = ReplicaCfg {
            lease_ms: 1_000,
            margin_ms: 250,
            renew_ms: 300,
            batch_max: 8,
            quorum_wait_ms: 2_000,
        };
        assert!(cfg.validate().is_ok());
        assert!(ReplicaCfg {
            renew_ms: 1_000,
            ..cfg
        }
        .validate()
        .is_err());
        let mut l = Lease::new(4, 10_000, &cfg);
        let r1 = l.ask(1, 10_000);
        l.granted(r1, 2, 2, &cfg);
        // Held from 10,000 to 11,000, but the wait runs to 11,250: never served.
        assert!(!l.serving(10_500) && !l.serving(11_100));
        assert!(l.due(10_300, &cfg) && !l.due(10_299, &cfg));
        let r2 = l.ask(1, 10_900);
        assert!(!l.serving(11_300), "the renewal is not answered yet");
        l.granted(r2, 3, 2, &cfg);
        assert!(l.serving(11_300) && !l.serving(11_900));
        // A late answer to the older round gives nothing back.
        l.granted(r1, 3, 2, &cfg);
        assert!(!l.serving(11_900));
    }
}

//! Shard placement: which broker owns each shard of one stream or cache. Pure and deterministic.
//!
//! Rules, applied by [`place`] to one resource at a time:
//! 1. A shard whose owner is dead: an ephemeral one is released (it has no offsets worth
//!    keeping); a durable one keeps its owner and turns `unavailable` — without replication a
//!    move would restart its log empty on another broker and reset its offsets.
//!    A durable shard whose owner comes back is `assigned` again.
//! 2. Every shard without an owner goes to the live broker holding the fewest shards of this
//!    resource (ties: lowest node id).
//! 3. Ephemeral shards are moved, one at a time, from the broker holding the most shards of this
//!    resource to the one holding the fewest, until the two differ by at most one. Durable
//!    shards are never moved between live brokers either.
//!
//! Every owner change bumps the shard's `generation`.

use crate::api::{ShardPlacement, ShardState};
use std::collections::{BTreeMap, BTreeSet};

/// A fresh, unplaced shard list.
pub fn unplaced(shards: u32) -> Vec<ShardPlacement> {
    (0..shards)
        .map(|shard| ShardPlacement {
            shard,
            owner: None,
            generation: 0,
            state: ShardState::Unassigned,
            replicas: Vec::new(),
            leader: None,
            settled: Vec::new(),
        })
        .collect()
}

/// Re-place one resource's shards against the set of live brokers. Returns whether anything
/// changed. Idempotent: a second call with the same inputs changes nothing.
pub fn place(shards: &mut [ShardPlacement], durable: bool, live: &BTreeSet<u64>) -> bool {
    let changed = place_owners(shards, durable, live);
    // The replica set of one copy follows the owner (an image from before it had none).
    let mut filled = false;
    for p in shards.iter_mut() {
        let replicas: Vec<u64> = p.owner.into_iter().collect();
        if p.replicas != replicas || p.leader != p.owner {
            p.replicas = replicas;
            p.leader = p.owner;
            filled = true;
        }
    }
    changed || filled
}

fn place_owners(shards: &mut [ShardPlacement], durable: bool, live: &BTreeSet<u64>) -> bool {
    let mut changed = false;
    for p in shards.iter_mut() {
        match p.owner {
            Some(o) if !live.contains(&o) => {
                if durable {
                    if p.state != ShardState::Unavailable {
                        p.state = ShardState::Unavailable;
                        changed = true;
                    }
                } else {
                    p.owner = None;
                    p.state = ShardState::Unassigned;
                    p.generation += 1;
                    changed = true;
                }
            }
            Some(_) if p.state != ShardState::Assigned => {
                p.state = ShardState::Assigned;
                changed = true;
            }
            _ => {}
        }
    }
    if live.is_empty() {
        return changed;
    }
    let mut counts: BTreeMap<u64, usize> = live.iter().map(|&b| (b, 0)).collect();
    for p in shards.iter() {
        if let Some(c) = p.owner.and_then(|o| counts.get_mut(&o)) {
            *c += 1;
        }
    }
    let least = |counts: &BTreeMap<u64, usize>| {
        counts
            .iter()
            .min_by_key(|(id, c)| (**c, **id))
            .map(|(id, _)| *id)
            .expect("live is not empty")
    };
    for p in shards.iter_mut().filter(|p| p.owner.is_none()) {
        let b = least(&counts);
        p.owner = Some(b);
        p.state = ShardState::Assigned;
        p.generation += 1;
        *counts.get_mut(&b).expect("live") += 1;
        changed = true;
    }
    if durable {
        return changed;
    }
    // Bounded: each move lowers the spread's sum of squares, and there are at most
    // `shards.len()` useful moves.
    for _ in 0..shards.len() {
        let (&most, &hi) = counts
            .iter()
            .max_by_key(|(id, c)| (**c, std::cmp::Reverse(**id)))
            .expect("live");
        let low = least(&counts);
        if hi <= counts[&low] + 1 {
            break;
        }
        let Some(p) = shards.iter_mut().rev().find(|p| p.owner == Some(most)) else {
            break;
        };
        p.owner = Some(low);
        p.generation += 1;
        *counts.get_mut(&most).expect("live") -= 1;
        *counts.get_mut(&low).expect("live") += 1;
        changed = true;
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn live(ids: &[u64]) -> BTreeSet<u64> {
        ids.iter().copied().collect()
    }

    fn owners(s: &[ShardPlacement]) -> Vec<Option<u64>> {
        s.iter().map(|p| p.owner).collect()
    }

    #[test]
    fn spreads_evenly_and_is_idempotent() {
        let mut s = unplaced(7);
        assert!(place(&mut s, false, &live(&[3, 1, 2])));
        assert_eq!(
            owners(&s),
            vec![
                Some(1),
                Some(2),
                Some(3),
                Some(1),
                Some(2),
                Some(3),
                Some(1)
            ]
        );
        assert!(!place(&mut s, false, &live(&[1, 2, 3])));
    }

    #[test]
    fn no_brokers_leaves_shards_unassigned() {
        let mut s = unplaced(2);
        assert!(!place(&mut s, false, &live(&[])));
        assert!(s.iter().all(|p| p.state == ShardState::Unassigned));
    }

    #[test]
    fn durable_shard_stays_on_dead_owner_and_recovers() {
        let mut s = unplaced(2);
        place(&mut s, true, &live(&[1, 2]));
        let before = s.clone();
        assert!(place(&mut s, true, &live(&[2])));
        assert_eq!(s[0].owner, Some(1));
        assert_eq!(s[0].state, ShardState::Unavailable);
        assert_eq!(s[0].generation, before[0].generation);
        assert_eq!(s[1], before[1]);
        assert!(place(&mut s, true, &live(&[1, 2])));
        assert_eq!(s, before);
    }

    #[test]
    fn ephemeral_shard_moves_off_dead_owner_and_rebalances_on_join() {
        let mut s = unplaced(4);
        place(&mut s, false, &live(&[1, 2]));
        place(&mut s, false, &live(&[2]));
        assert!(s.iter().all(|p| p.owner == Some(2)));
        place(&mut s, false, &live(&[1, 2]));
        let on1 = s.iter().filter(|p| p.owner == Some(1)).count();
        assert_eq!(on1, 2);
    }

    proptest! {
        /// Any sequence of liveness sets: ephemeral shards always sit on live brokers, evenly;
        /// durable shards, once owned, never change owner; generations only grow; every pass
        /// reaches a fixed point.
        #[test]
        fn placement_invariants(
            shards in 1u32..40,
            durable in any::<bool>(),
            steps in proptest::collection::vec(proptest::collection::btree_set(1u64..6, 0..5), 1..12),
        ) {
            let mut s = unplaced(shards);
            let mut first_owner: Vec<Option<u64>> = vec![None; shards as usize];
            for l in steps {
                let before = s.clone();
                place(&mut s, durable, &l);
                prop_assert!(!place(&mut s, durable, &l), "not a fixed point");
                for (i, p) in s.iter().enumerate() {
                    // The replica set (one copy) is the owner, which leads it.
                    prop_assert_eq!(&p.replicas, &p.owner.into_iter().collect::<Vec<_>>());
                    prop_assert_eq!(p.leader, p.owner);
                    prop_assert!(p.generation >= before[i].generation);
                    if p.owner != before[i].owner {
                        prop_assert!(p.generation > before[i].generation);
                    }
                    if durable {
                        if let Some(o) = first_owner[i] {
                            prop_assert_eq!(p.owner, Some(o));
                        } else {
                            first_owner[i] = p.owner;
                        }
                        let want = match p.owner {
                            None => ShardState::Unassigned,
                            Some(o) if l.contains(&o) => ShardState::Assigned,
                            Some(_) => ShardState::Unavailable,
                        };
                        prop_assert_eq!(p.state, want);
                    } else if l.is_empty() {
                        prop_assert_eq!(p.owner, None);
                    } else {
                        prop_assert!(l.contains(&p.owner.unwrap()));
                        prop_assert_eq!(p.state, ShardState::Assigned);
                    }
                }
                if !durable && !l.is_empty() {
                    let counts: Vec<usize> = l.iter().map(|b| s.iter().filter(|p| p.owner == Some(*b)).count()).collect();
                    let (mn, mx) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
                    prop_assert!(mx - mn <= 1, "uneven {:?}", counts);
                }
            }
        }
    }
}

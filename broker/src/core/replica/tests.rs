//! The replica machine's unit tests: elections, truncation, identities, the joint fence.

use super::*;
use std::collections::BTreeSet;

/// Deliver every message until none is left; what each node's effects were, in order.
fn settle(rs: &mut BTreeMap<NodeId, Replica>) {
    let mut net: Vec<(NodeId, Msg)> = Vec::new();
    for _ in 0..1000 {
        for r in rs.values_mut() {
            for e in r.drain_effects() {
                if let Effect::Send { to, msg } = e {
                    net.push((to, msg));
                }
            }
        }
        if net.is_empty() {
            return;
        }
        for (to, msg) in std::mem::take(&mut net) {
            rs.get_mut(&to).unwrap().on_msg(msg, 0);
        }
    }
    panic!("the replicas never went quiet");
}

/// Rule 11: the set {1,2,3} changed to {1,2,4} (3 replaced by 4), not settled yet. Node
/// 1's fence of the new generation goes to 2, 3 and 4; answered by 4 it holds a majority
/// of the new set but not of the settled one, and does not lead; once 3 answers too it
/// leads, and ships to 4 (of its set), not to 3.
#[test]
fn a_fence_across_a_change_of_set_needs_a_majority_of_both_sets() {
    let mut rs: BTreeMap<NodeId, Replica> = (1..=4)
        .map(|n| {
            let set = if n == 4 { vec![1, 2, 4] } else { vec![1, 2, 3] };
            let (d, l, cfg) = (Durable::default(), GenLog::default(), ReplicaCfg::default());
            (n, Replica::new(n, 100 + n, set, d, l, cfg))
        })
        .collect();
    let a = Assignment {
        gen: 1,
        leader: 1,
        sid: 101,
        set: vec![1, 2, 4],
        settled: vec![1, 2, 3],
    };
    rs.get_mut(&1).unwrap().assign(a.clone(), 0);
    let fences = sent_to(rs.get_mut(&1).unwrap(), |m| matches!(m, Msg::Fence { .. }));
    assert_eq!(fences, BTreeSet::from([2, 3, 4]));
    let answer = |from: NodeId| Msg::FenceAnswer {
        gen: 1,
        from,
        end: 0,
    };
    let r1 = rs.get_mut(&1).unwrap();
    r1.on_msg(answer(4), 0);
    assert_eq!(r1.leading(), None, "a majority of the new set alone");
    breaks::NO_JOINT_FENCE.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut twin = Replica::new(
        1,
        101,
        vec![1, 2, 3],
        Durable::default(),
        GenLog::default(),
        ReplicaCfg::default(),
    );
    twin.assign(a, 0);
    twin.on_msg(answer(4), 0);
    breaks::NO_JOINT_FENCE.store(false, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        twin.leading(),
        Some(1),
        "the twin leads on the new set alone"
    );
    let r1 = rs.get_mut(&1).unwrap();
    r1.on_msg(answer(3), 0);
    assert_eq!(r1.leading(), Some(1));
    let shipped = sent_to(r1, |m| matches!(m, Msg::Ship { .. }));
    assert_eq!(shipped, BTreeSet::from([4]));
}

/// Whom `r`'s effects since the last drain send a message `pick` selects.
fn sent_to(r: &mut Replica, pick: impl Fn(&Msg) -> bool) -> BTreeSet<NodeId> {
    r.drain_effects()
        .into_iter()
        .filter_map(|e| match e {
            Effect::Send { to, msg } if pick(&msg) => Some(to),
            _ => None,
        })
        .collect()
}

/// Placement names node 1 (identity 101) leader of `gen` over the set {1,2,3}, settled.
fn to_1(gen: u64) -> Assignment {
    Assignment {
        gen,
        leader: 1,
        sid: 101,
        set: vec![1, 2, 3],
        settled: vec![1, 2, 3],
    }
}

fn three(logs: [GenLog; 3]) -> BTreeMap<NodeId, Replica> {
    let set = vec![1, 2, 3];
    (1..=3)
        .zip(logs)
        .map(|(n, l)| {
            let cfg = ReplicaCfg::default();
            let d = Durable::default();
            (n, Replica::new(n, 100 + n, set.clone(), d, l, cfg))
        })
        .collect()
}

#[test]
fn a_new_leader_fences_writes_its_start_record_and_cuts_a_divergent_suffix() {
    // Node 3 holds a record of generation 1 that the others never got.
    let base = GenLog::from_gens([1, 1]);
    let mut rs = three([base.clone(), base.clone(), GenLog::from_gens([1, 1, 1])]);
    for r in rs.values_mut() {
        r.durable = Durable {
            promised: 1,
            ballot: Some(3),
            led: 0,
        };
    }
    let gen_2 = to_1(2);
    // An assignment decided on an identity node 1 no longer has is refused (rule 9).
    let stale = Assignment {
        sid: 99,
        ..gen_2.clone()
    };
    rs.get_mut(&1).unwrap().assign(stale, 0);
    assert!(rs.get_mut(&1).unwrap().drain_effects().is_empty());
    rs.get_mut(&1).unwrap().assign(gen_2.clone(), 0);
    let fx = rs.get_mut(&1).unwrap().drain_effects();
    assert_eq!(
        fx[0],
        Effect::Persist(Durable {
            promised: 2,
            ballot: Some(1),
            led: 2
        }),
        "the promise is kept before the fence goes out"
    );
    for e in fx {
        if let Effect::Send { to, msg } = e {
            rs.get_mut(&to).unwrap().on_msg(msg, 0);
        }
    }
    settle(&mut rs);
    assert_eq!(rs[&1].leading(), Some(2));
    // It serves once the wait after its fence is over and a renewal was answered.
    let later = 3_000;
    assert_eq!(
        rs.get_mut(&1).unwrap().propose(1, 0),
        Err(NotLeader::NoLease),
        "no lease yet: refused"
    );
    rs.get_mut(&1).unwrap().tick(later);
    settle(&mut rs);
    rs.get_mut(&1).unwrap().propose(1, later).unwrap();
    settle(&mut rs);
    // Node 3's third record (generation 1) was cut for generation 2's start record.
    let want = GenLog::from_gens([1, 1, 2, 2]);
    for r in rs.values() {
        assert_eq!(r.log(), &want, "node {}", r.me);
    }
    // Node 3 refuses generation 2's fence from another leader (its ballot is node 1),
    // and a lower generation's fence; node 1 will not lead generation 2 twice.
    rs.get_mut(&3)
        .unwrap()
        .on_msg(Msg::Fence { gen: 2, leader: 2 }, 0);
    rs.get_mut(&3)
        .unwrap()
        .on_msg(Msg::Fence { gen: 1, leader: 2 }, 0);
    let refusals = rs.get_mut(&3).unwrap().drain_effects();
    assert!(refusals.iter().all(|e| matches!(
        e,
        Effect::Send {
            msg: Msg::Refuse { promised: 2, .. },
            ..
        }
    )));
    assert_eq!(refusals.len(), 2);
    rs.get_mut(&1).unwrap().assign(gen_2, 0);
    assert!(rs.get_mut(&1).unwrap().drain_effects().is_empty());
    assert_eq!(
        rs.get_mut(&2).unwrap().propose(1, later),
        Err(NotLeader::Follower)
    );
}

/// The `resign` flag of each report among `r`'s effects.
fn resigns(r: &mut Replica) -> Vec<bool> {
    r.drain_effects()
        .into_iter()
        .filter_map(|e| match e {
            Effect::Report(rep) => Some(rep.resign),
            _ => None,
        })
        .collect()
}

#[test]
fn a_leader_without_a_lease_for_a_lease_period_resigns_until_it_holds_one_again() {
    let mut rs = three(Default::default());
    let a = to_1(1);
    rs.get_mut(&1).unwrap().assign(a, 0);
    settle(&mut rs);
    rs.get_mut(&1).unwrap().tick(3_000);
    settle(&mut rs);
    assert!(rs[&1].serving(3_000), "the lease runs to 5,000");
    // The followers go silent (nothing is delivered from here on). The lease runs out at
    // 5,000; no resignation before a whole lease period (2,000) past that.
    let l = rs.get_mut(&1).unwrap();
    for t in (3_500..7_000).step_by(500) {
        l.tick(t);
        assert!(!resigns(l).contains(&true), "resigned at {t}");
    }
    l.tick(7_000);
    assert!(resigns(l).contains(&true), "no resignation at 7,000");
    l.tick(7_050);
    assert_eq!(resigns(l), vec![true], "the report in flight says it again");
    // The followers answer again: a renewal gives it a lease, and its next report
    // withdraws the resignation.
    l.tick(7_500);
    settle(&mut rs);
    assert!(rs[&1].serving(7_600));
    let l = rs.get_mut(&1).unwrap();
    l.tick(7_600);
    let r = resigns(l);
    assert!(!r.is_empty() && !r.contains(&true), "{r:?}");
}

/// A follower that promised the generation but whose answer to the fence was lost grants the
/// leader's lease renewals; the leader fences it again and ships to it, so it catches up
/// instead of staying behind until the next generation.
#[test]
fn a_follower_whose_fence_answer_was_lost_is_fenced_again_and_caught_up() {
    let mut rs = three([
        GenLog::from_gens([1, 1]),
        GenLog::default(),
        GenLog::default(),
    ]);
    let a = to_1(2);
    rs.get_mut(&1).unwrap().assign(a, 0);
    // Deliver every message but node 2's answers to the fence at first.
    let mut dropped = false;
    let mut net: Vec<(NodeId, Msg)> = Vec::new();
    for round in 0..200u64 {
        let now = round * 100;
        for r in rs.values_mut() {
            if r.me == 1 {
                r.tick(now);
            }
            for e in r.drain_effects() {
                if let Effect::Send { to, msg } = e {
                    net.push((to, msg));
                }
            }
        }
        for (to, msg) in std::mem::take(&mut net) {
            // Lost for the first half second (every fence the leader sent meanwhile).
            if round < 5 && matches!(msg, Msg::FenceAnswer { from: 2, .. }) {
                dropped = true;
                continue;
            }
            rs.get_mut(&to).unwrap().on_msg(msg, now);
        }
    }
    assert!(dropped);
    assert_eq!(rs[&1].leading(), Some(2));
    assert_eq!(
        rs[&2].log(),
        rs[&1].log(),
        "node 2 caught up with its leader"
    );
}

/// Rule 11's "settle before change", on the real machines and placement, along TLC's
/// counterexample (`FelixShardChangeUnsettled`, docs/replication-design.md): placement swaps 3
/// for 4 ({1,2,4}, generation 2, led by 1, settled {1,2,3}) and, with the twin, swaps the
/// leader 1 for 3 ({2,3,4}, generation 3, led by 2) before generation 2 settled. Node 1's joint
/// fence completes with 3 and 4; node 2's with 3 alone (a majority of {2,3,4} and of the
/// settled {1,2,3}); 1 renews its lease with 4, which generation 3 never fenced, and 2 with 3:
/// both serve. Without the twin placement refuses the second change (`NotSettled`).
#[test]
fn a_change_before_the_last_one_settled_lets_two_leaders_serve() {
    use felix_control::replication::{breaks as pb, Placement, ReplaceError};
    use std::sync::atomic::Ordering::Relaxed;
    let sids: BTreeMap<NodeId, StorageId> = (1..=3).map(|n| (n, 100 + n)).collect();
    let mut p = Placement::new(sids);
    let g1 = p.promote(1, false).unwrap();
    let g2 = p.replace(3, 4, 104, |_| true).unwrap();
    assert_eq!((g2.gen, g2.leader), (2, 1));
    assert_eq!(
        p.replace(1, 3, 103, |n| n != 1),
        Err(ReplaceError::NotSettled)
    );
    pb::CHANGE_UNSETTLED.store(true, Relaxed);
    let g3 = p.replace(1, 3, 103, |n| n != 1);
    pb::CHANGE_UNSETTLED.store(false, Relaxed);
    let g3 = g3.unwrap();
    assert_eq!((g3.gen, g3.leader, &g3.settled), (3, 2, &vec![1, 2, 3]));

    let mut rs: BTreeMap<NodeId, Replica> = (1..=4)
        .map(|n| {
            let (d, l, cfg) = (Durable::default(), GenLog::default(), ReplicaCfg::default());
            (n, Replica::new(n, 100 + n, vec![n], d, l, cfg))
        })
        .collect();
    // Which links carry messages: 1 with 3 and 4, 2 with 3; nothing else.
    let open = |a: NodeId, b: NodeId| {
        let (x, y) = (a.min(b), a.max(b));
        matches!((x, y), (1, 3) | (1, 4) | (2, 3))
    };
    let mut net: Vec<(NodeId, NodeId, Msg)> = Vec::new();
    let mut run = |rs: &mut BTreeMap<NodeId, Replica>, from_ms: u64, to_ms: u64| -> bool {
        let mut both = false;
        for now in (from_ms..to_ms).step_by(50) {
            for (&n, r) in rs.iter_mut() {
                r.tick(now);
                for e in r.drain_effects() {
                    if let Effect::Send { to, msg } = e {
                        net.push((n, to, msg));
                    }
                }
            }
            for (from, to, msg) in std::mem::take(&mut net) {
                if open(from, to) {
                    rs.get_mut(&to).unwrap().on_msg(msg, now);
                }
            }
            both |= rs[&1].serving(now) && rs[&2].serving(now);
        }
        both
    };
    // Generation 1 never served (its leader 1 took generation 2 at once).
    let _ = g1;
    rs.get_mut(&1).unwrap().assign(g2, 0);
    assert!(!run(&mut rs, 0, 4_000));
    assert_eq!(rs[&1].leading(), Some(2));
    assert!(rs[&1].serving(3_999), "1 serves generation 2 with 4");
    rs.get_mut(&2).unwrap().assign(g3, 4_000);
    assert!(
        run(&mut rs, 4_000, 10_000),
        "generation 3 (2 with 3) and generation 2 (1 with 4) serve at once"
    );
    assert_eq!(rs[&2].leading(), Some(3));
}

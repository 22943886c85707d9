//! The simulator's negative twins: with one rule broken (a `breaks` switch), some seed within
//! the twin's budget must violate the invariant that rule protects, so the simulator cannot
//! pass vacuously.

use super::*;

/// A negative twin: with `switch` on, some seed among the first `seeds_max` breaks
/// `invariant` (or one of `a|b`) (`FELIX_REPLICA_TWIN_SEEDS` overrides the bound). The search is deterministic,
/// so the seed it finds is the same on every run until the simulator or the machine changes.
fn negative_twin(switch: &AtomicBool, mix: Mix, invariant: &str, seeds_max: u64) {
    switch.store(true, Ordering::Relaxed);
    let n: u64 = std::env::var("FELIX_REPLICA_TWIN_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(seeds_max);
    let found = (0..n).find_map(|s| run(s, mix).err());
    switch.store(false, Ordering::Relaxed);
    let why = found.unwrap_or_else(|| panic!("{invariant}: the break went unnoticed in {n} seeds"));
    eprintln!("caught: {why}");
    assert!(invariant.split('|').any(|i| why.contains(i)), "{why}");
}

#[test]
fn negative_twin_no_ballot_is_caught() {
    let mix = Mix {
        racing: true,
        partitions: false,
        idle: false,
        crashy: false,
        eager: true,
        replace: false,
    };
    negative_twin(&breaks::NO_BALLOT, mix, "OneLeaderPerGeneration", 2_000);
}

#[test]
fn negative_twin_commit_before_match_is_caught() {
    negative_twin(
        &breaks::COMMIT_BEFORE_MATCH,
        Mix::of_seed(0),
        "Committed",
        2_000,
    );
}

#[test]
fn negative_twin_no_truncate_is_caught() {
    // A follower that keeps a divergent suffix then learns a commit mark over records the
    // leader does not have: caught there, or as logs that do not match.
    negative_twin(
        &breaks::NO_TRUNCATE,
        Mix::of_seed(0),
        "LogMatching|CommittedPrefixMatches",
        2_000,
    );
}

#[test]
fn negative_twin_no_fence_is_caught() {
    let mix = Mix {
        racing: false,
        partitions: true,
        idle: true,
        crashy: false,
        eager: true,
        replace: false,
    };
    // A deposed leader must hear from neither its successor nor placement for a whole
    // lease while a follower still answers it: rarer since placement promotes only a
    // replica level with the leader.
    // Unfenced, an old leader keeps shipping beside the new one: two serve at once, or a
    // follower takes the old leader's suffix and cuts below a mark it learnt.
    negative_twin(
        &breaks::NO_FENCE,
        mix,
        "AtMostOneServing|CommittedNeverCut",
        10_000,
    );
}

#[test]
fn negative_twin_no_lease_wait_is_caught() {
    negative_twin(
        &breaks::NO_LEASE_WAIT,
        Mix::of_seed(0),
        "AtMostOneServing",
        // Seed 2,477 catches it since proposals became batches (2026-12-07).
        5_000,
    );
}

#[test]
fn negative_twin_ack_before_report_is_caught() {
    negative_twin(
        &breaks::ACK_BEFORE_REPORT,
        Mix::of_seed(0),
        // Placement's mark lags the leader's: it promotes a replica behind records the
        // leader acknowledged, which followers learnt committed.
        "NoAckedRecordLost|CommittedPrefixMatches",
        2_000,
    );
}

#[test]
fn negative_twin_forget_waits_on_step_down_is_caught() {
    negative_twin(
        &breaks::FORGET_WAITS_ON_STEP_DOWN,
        Mix::of_seed(0),
        "PublishAnswered",
        2_000,
    );
}

#[test]
fn negative_twin_no_storage_identity_is_caught() {
    // Counting a replica on bytes a machine crash lost loses committed records: caught as
    // the committed prefix a replica learnt, missing from the new leader (or, on other
    // schedules, as an acknowledged record lost).
    negative_twin(
        &breaks::NO_STORAGE_IDENTITY,
        Mix::of_seed(0),
        "CommittedPrefixMatches|NoAckedRecordLost",
        2_000,
    );
}

#[test]
fn negative_twin_promote_behind_commit_is_caught() {
    // Promoting a replica that a landed report shows behind the commit mark loses records
    // that a majority held, acknowledged ones among them.
    negative_twin(
        &breaks::PROMOTE_BEHIND_COMMIT,
        Mix::of_seed(0),
        "CommittedPrefixMatches|NoAckedRecordLost|CommittedNeverCut",
        2_000,
    );
}

// Placement's two other guards, never storing a late report over a newer one
// (`breaks::REPORTS_IN_ANY_ORDER`) nor a report entry under an identity a replica no longer
// has over one under its current identity (`breaks::STALE_IDENTITY_OVER_CURRENT`), have no
// twin here since promotion is bounded by the commit mark (rule 8): both only lower what
// placement believes a replica holds, which can only take candidates away. They keep
// placement's view current (for promotion's choice and the lag it shows), and
// `control/src/replication.rs`'s unit tests hold them.

#[test]
fn negative_twin_no_rebuild_is_caught() {
    // A follower shipped from its leader's base keeps what it held below it: a prefix that
    // differs from the committed records there, next to the leader's records from the base.
    negative_twin(
        &breaks::NO_REBUILD,
        Mix::of_seed(0),
        "LogMatching|CommittedPrefixMatches|NoAckedRecordLost|append_at_end",
        2_000,
    );
}

#[test]
fn negative_twin_no_joint_fence_is_caught() {
    // Rule 11: a fence answered by a majority of the new set only leaves a majority of the
    // settled set free to renew the old leader's lease. Placement replaces a leader cut off
    // (with one follower) from the rest and the control plane; the new leader's fence
    // completes with the broker swapped in, and both serve.
    let mix = Mix {
        racing: false,
        partitions: true,
        idle: false,
        crashy: false,
        eager: false,
        replace: true,
    };
    negative_twin(&breaks::NO_JOINT_FENCE, mix, "AtMostOneServing", 3_000);
}

// Rule 11's other rule, "settle before change" (`breaks::CHANGE_UNSETTLED`, placement's side),
// has no simulator twin: its counterexample needs a change made while the one before has not
// settled, its leader serving on one side of a partition with the broker it swapped in, and
// the next change's fence completed on the other side, all within one lease. The simulator
// makes such changes (about 1.6 per seed in the twin's mix, 2026-12-07) but did not reach that
// schedule in 20,000 seeds, nor in 60,000 before the faults aimed at it (a replaced broker cut
// off with a follower; a new leader cut off from placement) were added. TLC does
// (`FelixShardChangeUnsettled`, 14 states); `felix_control::replication`'s unit test holds
// the guard; and `replica::tests::a_change_before_the_last_one_settled_lets_two_leaders_serve`
// plays TLC's counterexample on the real machines and placement, twin on: two leaders serve.

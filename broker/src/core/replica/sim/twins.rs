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
    };
    // A deposed leader must hear from neither its successor nor placement for a whole
    // lease while a follower still answers it: rarer since placement promotes only a
    // replica level with the leader.
    negative_twin(&breaks::NO_FENCE, mix, "AtMostOneServing", 10_000);
}

#[test]
fn negative_twin_no_lease_wait_is_caught() {
    negative_twin(
        &breaks::NO_LEASE_WAIT,
        Mix::of_seed(0),
        "AtMostOneServing",
        2_000,
    );
}

#[test]
fn negative_twin_ack_before_report_is_caught() {
    negative_twin(
        &breaks::ACK_BEFORE_REPORT,
        Mix::of_seed(0),
        "NoAckedRecordLost",
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
fn negative_twin_reports_in_any_order_is_caught() {
    negative_twin(
        &breaks::REPORTS_IN_ANY_ORDER,
        Mix::of_seed(0),
        "NoAckedRecordLost",
        10_000,
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

/// The twin of placement's rule that a report entry under an identity a replica no longer has
/// never displaces one under its current identity. The schedule it needs (a machine crash, a
/// pre-crash answer delivered late to the leader and reported, then a second node losing
/// data) comes up about once in 100,000 seeds, too rarely to search for in CI, so this twin
/// starts at a seed that reached it. A change to the simulator's draws moves the schedule:
/// then search for another (`FELIX_SEEDS_FROM=0 FELIX_REPLICA_TWIN_SEEDS=400000`, each seed
/// with its own mix) and put it here.
#[test]
fn negative_twin_stale_identity_over_current_is_caught_from_its_seed() {
    const SEED: u64 = STALE_IDENTITY_SEED;
    let number = |name: &str| std::env::var(name).ok().and_then(|v| v.parse().ok());
    let from: u64 = number("FELIX_SEEDS_FROM").unwrap_or(SEED);
    let n: u64 = number("FELIX_REPLICA_TWIN_SEEDS").unwrap_or(1);
    breaks::STALE_IDENTITY_OVER_CURRENT.store(true, Ordering::Relaxed);
    let found = (from..from + n).find_map(|s| run(s, Mix::of_seed(s)).err());
    breaks::STALE_IDENTITY_OVER_CURRENT.store(false, Ordering::Relaxed);
    let why = found.expect("the break went unnoticed");
    eprintln!("caught: {why}");
    assert!(why.contains("NoAckedRecordLost"), "{why}");
}

/// The seed `negative_twin_stale_identity_over_current_is_caught_from_its_seed` starts at.
const STALE_IDENTITY_SEED: u64 = 80_529;

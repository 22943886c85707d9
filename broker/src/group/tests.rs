use super::*;
use proptest::prelude::*;

const S: u32 = 7;

fn cfg() -> GroupConfig {
    GroupConfig {
        max_attempts: 3,
        default_visibility_timeout_ms: 100,
        max_visibility_timeout_ms: 1_000,
        max_nack_delay_ms: 500,
        max_in_flight_records: 8,
        max_poll_records: 4,
        max_window_records: 16,
        max_dead_letters: 4,
    }
}

fn group(tail: u64) -> Group {
    Group::new(S, cfg(), 0, tail).unwrap()
}

fn offsets(claims: &[Claim]) -> Vec<u64> {
    claims.iter().map(|c| c.offset).collect()
}

fn stale(r: Result<impl std::fmt::Debug, GroupError>) -> StaleReason {
    match r {
        Err(GroupError::StaleClaim { reason, .. }) => reason,
        other => panic!("expected stale_claim, got {other:?}"),
    }
}

fn all_dead(g: &Group) -> Vec<DeadLetter> {
    let mut out = Vec::new();
    let mut after = None;
    loop {
        let page = g.dead_letters(after, 2).unwrap();
        out.extend(page.letters);
        match page.next_after {
            Some(a) => after = Some(a),
            None => return out,
        }
    }
}

// ---- config -------------------------------------------------------------------------------

#[test]
fn default_config_is_valid() {
    GroupConfig::default().validate().unwrap();
    cfg().validate().unwrap();
}

#[test]
fn every_config_bound_is_checked() {
    type Edit = fn(&mut GroupConfig);
    let cases: &[(&str, Edit)] = &[
        ("max_attempts", |c| c.max_attempts = 0),
        ("max_attempts", |c| c.max_attempts = MAX_ATTEMPTS_LIMIT + 1),
        ("max_visibility_timeout_ms", |c| {
            c.max_visibility_timeout_ms = 0
        }),
        ("max_visibility_timeout_ms", |c| {
            c.max_visibility_timeout_ms = DURATION_LIMIT_MS + 1
        }),
        ("default_visibility_timeout_ms", |c| {
            c.default_visibility_timeout_ms = 0
        }),
        ("default_visibility_timeout_ms", |c| {
            c.default_visibility_timeout_ms = 1_001
        }),
        ("max_nack_delay_ms", |c| {
            c.max_nack_delay_ms = DURATION_LIMIT_MS + 1
        }),
        ("max_in_flight_records", |c| c.max_in_flight_records = 0),
        ("max_in_flight_records", |c| {
            c.max_in_flight_records = IN_FLIGHT_LIMIT_RECORDS + 1
        }),
        ("max_poll_records", |c| c.max_poll_records = 0),
        ("max_poll_records", |c| c.max_poll_records = 9),
        ("max_window_records", |c| c.max_window_records = 7),
        ("max_window_records", |c| {
            c.max_window_records = TRACKED_LIMIT_RECORDS + 1
        }),
        ("max_dead_letters", |c| c.max_dead_letters = 0),
        ("max_dead_letters", |c| {
            c.max_dead_letters = TRACKED_LIMIT_RECORDS + 1
        }),
    ];
    for (field, edit) in cases {
        let mut c = cfg();
        edit(&mut c);
        let err = c.validate().unwrap_err();
        assert_eq!(err.field, *field);
        assert!(!(err.min..=err.max).contains(&err.value));
        let e = Group::new(S, c, 0, 0).unwrap_err();
        assert_eq!(e.code(), "invalid_config");
    }
}

#[test]
fn start_beyond_tail_is_refused() {
    assert_eq!(
        Group::new(S, cfg(), 5, 4).unwrap_err(),
        GroupError::BeyondTail { offset: 5, tail: 4 }
    );
    assert_eq!(Group::new(S, cfg(), 4, 4).unwrap().cursor(), 4);
}

// ---- claim ids -----------------------------------------------------------------------------

#[test]
fn claim_id_formats_and_parses() {
    let id = ClaimId {
        shard: 3,
        offset: 42,
        attempt: 2,
    };
    assert_eq!(id.to_string(), "3:42:2");
    assert_eq!("3:42:2".parse::<ClaimId>().unwrap(), id);
    let max = ClaimId {
        shard: u32::MAX,
        offset: u64::MAX,
        attempt: u32::MAX,
    };
    assert_eq!(max.to_string().parse::<ClaimId>().unwrap(), max);
    assert_eq!("0:0:1".parse::<ClaimId>().unwrap().offset, 0);
}

#[test]
fn malformed_claim_ids_are_refused() {
    for bad in [
        "",
        "1:2",
        "1:2:3:4",
        "1::3",
        "01:2:3",
        "1:02:3",
        "1:2:03",
        "1:2:0",
        "-1:2:3",
        "+1:2:3",
        " 1:2:3",
        "1:2:3 ",
        "1:2:x",
        "4294967296:0:1",
        "0:18446744073709551616:1",
        "0:0:4294967296",
        "1;2;3",
    ] {
        let err = bad.parse::<ClaimId>().unwrap_err();
        assert_eq!(err.input, bad);
    }
}

proptest! {
    #[test]
    fn claim_id_round_trips(shard: u32, offset: u64, attempt in 1u32..) {
        let id = ClaimId { shard, offset, attempt };
        prop_assert_eq!(id.to_string().parse::<ClaimId>().unwrap(), id);
    }

    #[test]
    fn claim_id_parse_never_panics_and_is_canonical(s in "[0-9:+ -]{0,24}") {
        if let Ok(id) = s.parse::<ClaimId>() {
            prop_assert_eq!(id.to_string(), s);
        }
    }
}

// ---- poll ----------------------------------------------------------------------------------

#[test]
fn poll_claims_lowest_offsets_with_attempt_and_deadline() {
    let mut g = group(10);
    let c = g.poll(3, None, 1_000).unwrap();
    assert_eq!(offsets(&c), vec![0, 1, 2]);
    assert!(c
        .iter()
        .all(|c| c.attempt == 1 && c.deadline_ms == 1_100 && c.shard == S));
    let c = g.poll(4, Some(50), 1_000).unwrap();
    assert_eq!(offsets(&c), vec![3, 4, 5, 6]);
    assert_eq!(c[0].deadline_ms, 1_050);
    assert_eq!(offsets(&g.poll(4, None, 1_000).unwrap()), vec![7]);
    assert_eq!(g.stats().in_flight, 8);
    g.check_invariants();
}

#[test]
fn poll_stops_at_tail_and_follows_records_available() {
    let mut g = group(2);
    assert_eq!(offsets(&g.poll(4, None, 0).unwrap()), vec![0, 1]);
    assert!(g.poll(4, None, 0).unwrap().is_empty());
    g.records_available(4);
    g.records_available(3); // a smaller tail is ignored
    assert_eq!(g.tail(), 4);
    assert_eq!(offsets(&g.poll(4, None, 0).unwrap()), vec![2, 3]);
}

#[test]
fn poll_arguments_are_checked() {
    let mut g = group(4);
    assert_eq!(
        g.poll(0, None, 0).unwrap_err(),
        GroupError::PollMaxOutOfRange {
            requested: 0,
            max: 4
        }
    );
    assert!(matches!(
        g.poll(5, None, 0),
        Err(GroupError::PollMaxOutOfRange { requested: 5, .. })
    ));
    assert!(matches!(
        g.poll(1, Some(0), 0),
        Err(GroupError::VisibilityTimeoutOutOfRange {
            requested_ms: 0,
            ..
        })
    ));
    let e = g.poll(1, Some(1_001), 0).unwrap_err();
    assert_eq!(e.code(), "invalid_argument");
    assert_eq!(g.stats().in_flight, 0, "a refused poll claims nothing");
}

#[test]
fn a_claimed_record_is_not_handed_out_again_until_it_lapses() {
    let mut g = group(1);
    let first = g.poll(1, None, 0).unwrap()[0];
    assert!(g.poll(4, None, 99).unwrap().is_empty());
    let again = g.poll(4, None, 100).unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!((again[0].offset, again[0].attempt), (0, 2));
    assert_eq!(
        stale(g.ack(first.id(), 100)),
        StaleReason::AttemptMismatch { current: 2 }
    );
    g.ack(again[0].id(), 100).unwrap();
    assert_eq!(g.cursor(), 1);
}

#[test]
fn redeliveries_go_out_in_offset_order_with_fresh_records() {
    let mut g = group(6);
    let c = g.poll(2, Some(10), 0).unwrap(); // 0, 1
    g.ack(c[0].id(), 0).unwrap();
    let later = g.poll(2, Some(500), 5).unwrap(); // 2, 3
    assert_eq!(offsets(&later), vec![2, 3]);
    // 1 lapses at 10; it goes out before the fresh 4 and 5.
    let c = g.poll(3, None, 10).unwrap();
    assert_eq!(offsets(&c), vec![1, 4, 5]);
    assert_eq!(c[0].attempt, 2);
    assert_eq!(c[1].attempt, 1);
}

#[test]
fn in_flight_bound_holds_across_polls() {
    let mut c = cfg();
    c.max_in_flight_records = 5;
    let mut g = Group::new(S, c, 0, 100).unwrap();
    assert_eq!(g.poll(4, None, 0).unwrap().len(), 4);
    assert_eq!(g.poll(4, None, 0).unwrap().len(), 1);
    assert!(g.poll(4, None, 0).unwrap().is_empty());
    g.ack(
        ClaimId {
            shard: S,
            offset: 2,
            attempt: 1,
        },
        0,
    )
    .unwrap();
    assert_eq!(offsets(&g.poll(4, None, 0).unwrap()), vec![5]);
}

#[test]
fn window_bounds_what_is_tracked_ahead_of_the_cursor() {
    let mut c = cfg();
    c.max_in_flight_records = 2;
    c.max_poll_records = 2;
    c.max_window_records = 3;
    let mut g = Group::new(S, c, 0, 100).unwrap();
    let a = g.poll(2, None, 0).unwrap(); // 0, 1
    g.ack(a[1].id(), 0).unwrap(); // 1 finished beyond the cursor
    let b = g.poll(2, None, 0).unwrap(); // 2
    assert_eq!(offsets(&b), vec![2]);
    g.ack(b[0].id(), 0).unwrap();
    // Tracked: 0 (in flight), 1 and 2 (finished beyond the cursor): the window is full.
    assert!(g.poll(2, None, 0).unwrap().is_empty());
    g.ack(a[0].id(), 0).unwrap();
    assert_eq!(g.cursor(), 3);
    assert_eq!(offsets(&g.poll(2, None, 0).unwrap()), vec![3, 4]);
    g.check_invariants();
}

// ---- ack and the cursor --------------------------------------------------------------------

#[test]
fn cursor_moves_only_over_a_contiguous_run() {
    let mut g = group(5);
    let c = g.poll(4, None, 0).unwrap();
    g.ack(c[1].id(), 1).unwrap();
    g.ack(c[3].id(), 1).unwrap();
    assert_eq!(g.cursor(), 0);
    assert_eq!(g.stats().finished_beyond_cursor, 2);
    g.ack(c[0].id(), 1).unwrap();
    assert_eq!(g.cursor(), 2);
    g.ack(c[2].id(), 1).unwrap();
    assert_eq!(g.cursor(), 4);
    assert_eq!(g.stats().finished_beyond_cursor, 0);
    // Late and double acks are refused and cannot move anything.
    assert_eq!(stale(g.ack(c[0].id(), 2)), StaleReason::Finished);
    assert_eq!(g.cursor(), 4);
    g.check_invariants();
}

#[test]
fn stale_reasons_and_wrong_shard() {
    let mut g = group(4);
    let c = g.poll(3, Some(10), 0).unwrap();
    // Lapsed at exactly its deadline, before any expire ran.
    assert_eq!(stale(g.ack(c[0].id(), 10)), StaleReason::Lapsed);
    g.nack(c[1].id(), 100, 5).unwrap();
    assert_eq!(stale(g.ack(c[1].id(), 6)), StaleReason::NotInFlight);
    g.dead_letter(c[2].id(), 5).unwrap();
    assert_eq!(stale(g.ack(c[2].id(), 6)), StaleReason::DeadLettered);
    let never = ClaimId {
        shard: S,
        offset: 3,
        attempt: 1,
    };
    assert_eq!(stale(g.ack(never, 6)), StaleReason::NeverDelivered);
    let beyond = ClaimId {
        shard: S,
        offset: 99,
        attempt: 1,
    };
    assert_eq!(stale(g.extend(beyond, 10, 6)), StaleReason::NeverDelivered);
    let wrong = ClaimId {
        shard: S + 1,
        ..c[0].id()
    };
    assert_eq!(
        g.ack(wrong, 0).unwrap_err(),
        GroupError::WrongShard {
            claim: wrong,
            shard: S
        }
    );
    let e = g.ack(c[0].id(), 10).unwrap_err();
    assert_eq!(e.code(), "stale_claim");
    assert!(e.to_string().starts_with("stale_claim: 7:0:1"));
}

// ---- nack, extend, expire, next_wakeup -----------------------------------------------------

#[test]
fn nack_hands_the_record_back_now_or_after_its_delay() {
    let mut g = group(2);
    let c = g.poll(2, None, 0).unwrap();
    assert_eq!(g.nack(c[0].id(), 0, 10).unwrap(), Fate::Redeliver);
    assert_eq!(g.nack(c[1].id(), 50, 10).unwrap(), Fate::Redeliver);
    assert_eq!(g.next_wakeup_ms(), Some(60));
    let c = g.poll(4, None, 20).unwrap();
    assert_eq!(offsets(&c), vec![0]);
    assert_eq!(c[0].attempt, 2);
    assert_eq!(
        g.next_wakeup_ms(),
        Some(60),
        "the delay is due before the new claim's 120"
    );
    let c = g.poll(4, None, 60).unwrap();
    assert_eq!((c[0].offset, c[0].attempt), (1, 2));
    assert_eq!(
        g.nack(c[0].id(), 501, 60).unwrap_err(),
        GroupError::NackDelayOutOfRange {
            requested_ms: 501,
            max_ms: 500
        }
    );
    // A nack naming an old delivery cannot park the new one.
    assert_eq!(
        stale(g.nack(
            ClaimId {
                attempt: 1,
                ..c[0].id()
            },
            100,
            60
        )),
        StaleReason::AttemptMismatch { current: 2 }
    );
    g.check_invariants();
}

#[test]
fn extend_moves_the_deadline_and_refuses_a_lapsed_claim() {
    let mut g = group(1);
    let c = g.poll(1, Some(10), 0).unwrap()[0];
    let e = g.extend(c.id(), 100, 5).unwrap();
    assert_eq!(e.deadline_ms, 105);
    assert_eq!(e.id(), c.id());
    assert!(g.expire(104).is_empty());
    assert!(g.poll(1, None, 104).unwrap().is_empty());
    assert!(matches!(
        g.extend(c.id(), 0, 5),
        Err(GroupError::VisibilityTimeoutOutOfRange { .. })
    ));
    assert!(matches!(
        g.extend(c.id(), 1_001, 5),
        Err(GroupError::VisibilityTimeoutOutOfRange { .. })
    ));
    assert_eq!(stale(g.extend(c.id(), 10, 105)), StaleReason::Lapsed);
    assert_eq!(
        g.expire(105),
        vec![Expired {
            offset: 0,
            attempt: 1,
            fate: Fate::Redeliver
        }]
    );
    g.check_invariants();
}

#[test]
fn next_wakeup_is_the_earliest_lapse_or_delay() {
    let mut g = group(3);
    assert_eq!(g.next_wakeup_ms(), None);
    let c = g.poll(3, Some(40), 0).unwrap();
    assert_eq!(g.next_wakeup_ms(), Some(40));
    g.nack(c[0].id(), 20, 10).unwrap();
    assert_eq!(g.next_wakeup_ms(), Some(30));
    g.ack(c[1].id(), 10).unwrap();
    g.ack(c[2].id(), 10).unwrap();
    assert_eq!(g.next_wakeup_ms(), Some(30));
    let c = g.poll(1, Some(40), 30).unwrap();
    assert_eq!(g.next_wakeup_ms(), Some(70));
    g.ack(c[0].id(), 31).unwrap();
    assert_eq!(g.next_wakeup_ms(), None);
    assert_eq!(g.cursor(), 3);
}

// ---- dead letters --------------------------------------------------------------------------

#[test]
fn past_max_attempts_a_record_is_dead_lettered_and_never_handed_out() {
    let mut g = group(2);
    let mut now = 0;
    for attempt in 1..=3 {
        let c = g.poll(1, Some(10), now).unwrap();
        assert_eq!((c[0].offset, c[0].attempt), (0, attempt));
        now += 10;
    }
    let fates = g.expire(now);
    assert_eq!(
        fates,
        vec![Expired {
            offset: 0,
            attempt: 3,
            fate: Fate::DeadLettered
        }]
    );
    assert_eq!(
        all_dead(&g),
        vec![DeadLetter {
            offset: 0,
            attempts: 3,
            reason: DeadLetterReason::Expired,
            redriving: false
        }]
    );
    assert_eq!(g.cursor(), 1, "a dead letter does not hold the cursor");
    // Offset 0 never comes back.
    let c = g.poll(4, None, now).unwrap();
    assert_eq!(offsets(&c), vec![1]);
    // Via nack the reason is Nacked.
    g.nack(c[0].id(), 0, now).unwrap();
    let c = g.poll(1, None, now).unwrap();
    g.nack(c[0].id(), 0, now).unwrap();
    let c = g.poll(1, None, now).unwrap();
    assert_eq!(c[0].attempt, 3);
    assert_eq!(g.nack(c[0].id(), 0, now).unwrap(), Fate::DeadLettered);
    assert_eq!(all_dead(&g)[1].reason, DeadLetterReason::Nacked);
    assert_eq!(g.cursor(), 2);
    g.check_invariants();
}

#[test]
fn a_released_claim_goes_out_again_first_without_spending_its_budget() {
    let mut g = group(3);
    let c = g.poll(2, None, 0).unwrap();
    assert_eq!(offsets(&c), vec![0, 1]);
    g.release(c[1].id(), 5).unwrap();
    // The old number is stale now; the record is next (lowest eligible), numbered on.
    assert_eq!(stale(g.ack(c[1].id(), 5)), StaleReason::NotInFlight);
    let again = g.poll(1, None, 5).unwrap();
    assert_eq!((again[0].offset, again[0].attempt), (1, 2));
    // Releases never dead-letter: three deliveries still allowed after any number of them.
    let mut id = again[0].id();
    for _ in 0..5 {
        g.release(id, 6).unwrap();
        id = g.poll(1, None, 6).unwrap()[0].id();
    }
    for _ in 0..2 {
        assert_eq!(g.nack(id, 0, 7).unwrap(), Fate::Redeliver);
        id = g.poll(1, None, 7).unwrap()[0].id();
    }
    assert_eq!(g.nack(id, 0, 7).unwrap(), Fate::DeadLettered);
    assert_eq!(stale(g.release(c[1].id(), 8)), StaleReason::DeadLettered);
    g.check_invariants();
}

#[test]
fn expire_makes_passed_nack_delays_eligible_so_the_wakeup_is_never_in_the_past() {
    let mut g = group(1);
    let c = g.poll(1, None, 0).unwrap()[0];
    g.nack(c.id(), 50, 10).unwrap();
    assert_eq!(g.next_wakeup_ms(), Some(60));
    g.expire(70);
    assert_eq!(
        g.next_wakeup_ms(),
        None,
        "nothing timed once the delay passed"
    );
    let again = g.poll(1, None, 70).unwrap()[0].id();
    assert!(g.is_live(again, 70));
    assert!(!g.is_live(c.id(), 70));
    g.check_invariants();
}

#[test]
fn a_consumer_can_dead_letter_its_claim() {
    let mut g = group(1);
    let c = g.poll(1, None, 0).unwrap()[0];
    assert_eq!(g.dead_letter(c.id(), 1).unwrap(), Fate::DeadLettered);
    let dl = all_dead(&g)[0];
    assert_eq!((dl.attempts, dl.reason), (1, DeadLetterReason::Rejected));
    assert_eq!(stale(g.dead_letter(c.id(), 1)), StaleReason::DeadLettered);
}

#[test]
fn redrive_gives_a_fresh_budget_and_ack_clears_the_pointer() {
    let mut g = group(1);
    let c = g.poll(1, None, 0).unwrap()[0];
    g.dead_letter(c.id(), 0).unwrap();
    assert_eq!(
        g.redrive(5).unwrap_err(),
        GroupError::NotDeadLettered { offset: 5 }
    );
    g.redrive(0).unwrap();
    assert_eq!(
        g.redrive(0).unwrap_err(),
        GroupError::RedriveInProgress { offset: 0 }
    );
    assert_eq!(
        g.discard(0).unwrap_err(),
        GroupError::RedriveInProgress { offset: 0 }
    );
    assert!(all_dead(&g)[0].redriving);
    // Numbering continues (2, 3, 4): no answer from before the redrive matches.
    let mut now = 0;
    for attempt in 2..=4 {
        let c = g.poll(1, Some(10), now).unwrap()[0];
        assert_eq!(c.attempt, attempt);
        assert_eq!(
            stale(g.ack(
                ClaimId {
                    attempt: 1,
                    ..c.id()
                },
                now
            ))
            .clone(),
            StaleReason::AttemptMismatch { current: attempt }
        );
        now += 10;
    }
    assert_eq!(g.expire(now)[0].fate, Fate::DeadLettered);
    let dl = all_dead(&g)[0];
    assert_eq!(
        (dl.attempts, dl.reason, dl.redriving),
        (4, DeadLetterReason::Expired, false)
    );
    g.redrive(0).unwrap();
    let c = g.poll(1, None, now).unwrap()[0];
    assert_eq!(c.attempt, 5);
    g.ack(c.id(), now).unwrap();
    assert!(all_dead(&g).is_empty());
    assert_eq!(g.cursor(), 1);
    g.check_invariants();
}

#[test]
fn discard_drops_the_pointer_and_the_record_stays_finished() {
    let mut g = group(3);
    let c = g.poll(3, None, 0).unwrap();
    g.dead_letter(c[1].id(), 0).unwrap();
    assert_eq!(g.cursor(), 0);
    let dl = g.discard(1).unwrap();
    assert_eq!(dl.offset, 1);
    assert_eq!(
        g.discard(1).unwrap_err(),
        GroupError::NotDeadLettered { offset: 1 }
    );
    assert_eq!(g.stats().finished_beyond_cursor, 1);
    g.ack(c[0].id(), 0).unwrap();
    assert_eq!(g.cursor(), 2);
    g.check_invariants();
}

#[test]
fn dead_letter_pages() {
    let mut c = cfg();
    c.max_dead_letters = 10;
    let mut g = Group::new(S, c, 0, 5).unwrap();
    for cl in g.poll(4, None, 0).unwrap() {
        g.dead_letter(cl.id(), 0).unwrap();
    }
    let p = g.dead_letters(None, 3).unwrap();
    assert_eq!(
        p.letters.iter().map(|d| d.offset).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    assert_eq!(p.next_after, Some(2));
    let p = g.dead_letters(Some(2), 3).unwrap();
    assert_eq!(p.letters.len(), 1);
    assert_eq!(p.next_after, None);
    assert!(g
        .dead_letters(Some(u64::MAX), 3)
        .unwrap()
        .letters
        .is_empty());
    assert_eq!(
        g.dead_letters(None, 0).unwrap_err(),
        GroupError::PageLimitOutOfRange {
            requested: 0,
            max: DEAD_LETTER_PAGE_LIMIT
        }
    );
    assert!(g.dead_letters(None, DEAD_LETTER_PAGE_LIMIT + 1).is_err());
    assert_eq!(
        g.dead_letters(None, DEAD_LETTER_PAGE_LIMIT)
            .unwrap()
            .letters
            .len(),
        4
    );
}

#[test]
fn a_full_dead_letter_list_parks_records_until_it_has_room() {
    let mut c = cfg();
    c.max_dead_letters = 1;
    let mut g = Group::new(S, c, 0, 3).unwrap();
    let cl = g.poll(3, None, 0).unwrap();
    assert_eq!(g.dead_letter(cl[0].id(), 0).unwrap(), Fate::DeadLettered);
    assert_eq!(g.dead_letter(cl[1].id(), 0).unwrap(), Fate::Parked);
    assert_eq!(g.stats().parked, 1);
    assert_eq!(g.cursor(), 1, "a parked record holds the cursor");
    assert_eq!(stale(g.ack(cl[1].id(), 0)), StaleReason::NotInFlight);
    g.ack(cl[2].id(), 0).unwrap();
    assert!(
        g.poll(4, None, 1_000).unwrap().is_empty(),
        "never handed out"
    );
    g.discard(0).unwrap();
    assert_eq!(g.stats().parked, 0);
    assert_eq!(all_dead(&g)[0].offset, 1);
    assert_eq!(all_dead(&g)[0].reason, DeadLetterReason::Rejected);
    assert_eq!(g.cursor(), 3);
    g.check_invariants();
}

// ---- seek ----------------------------------------------------------------------------------

#[test]
fn seek_forward_skips_and_makes_claims_below_stale() {
    let mut g = group(10);
    let c = g.poll(4, None, 0).unwrap(); // 0..4
    g.ack(c[3].id(), 0).unwrap();
    g.dead_letter(c[0].id(), 0).unwrap();
    assert_eq!(
        g.seek(11).unwrap_err(),
        GroupError::BeyondTail {
            offset: 11,
            tail: 10
        }
    );
    g.seek(2).unwrap();
    assert_eq!(g.cursor(), 2);
    assert_eq!(stale(g.ack(c[1].id(), 0)), StaleReason::Finished);
    g.ack(c[2].id(), 0).unwrap(); // 2 was above the target: still live
    assert_eq!(g.cursor(), 4);
    assert_eq!(all_dead(&g).len(), 1, "dead letters survive a seek");
    assert_eq!(offsets(&g.poll(4, None, 0).unwrap()), vec![4, 5, 6, 7]);
    g.seek(10).unwrap();
    assert_eq!(g.cursor(), 10);
    assert_eq!(g.stats().in_flight, 0);
    g.check_invariants();
}

#[test]
fn seek_backward_replays_everything_but_dead_letters() {
    let mut g = group(6);
    let c = g.poll(4, None, 0).unwrap(); // 0..4
    g.ack(c[0].id(), 0).unwrap();
    g.dead_letter(c[1].id(), 0).unwrap();
    g.ack(c[2].id(), 0).unwrap();
    assert_eq!(g.cursor(), 3);
    // 3 in flight at attempt 1; 4 and 5 fresh.
    g.seek(0).unwrap();
    assert_eq!(g.cursor(), 0);
    assert_eq!(stale(g.ack(c[3].id(), 0)), StaleReason::NotInFlight);
    let again = g.poll(4, None, 0).unwrap();
    assert_eq!(
        again
            .iter()
            .map(|c| (c.offset, c.attempt))
            .collect::<Vec<_>>(),
        vec![(0, 1), (2, 1), (3, 2), (4, 1)]
    );
    assert_eq!(all_dead(&g).len(), 1);
    for c in &again {
        g.ack(c.id(), 0).unwrap();
    }
    assert_eq!(g.cursor(), 5, "the dead letter at 1 is passed again");
    g.check_invariants();
}

// ---- snapshot ------------------------------------------------------------------------------

fn busy_group() -> Group {
    let mut c = cfg();
    c.max_dead_letters = 8;
    let mut g = Group::new(S, c, 3, 40).unwrap();
    let cl = g.poll(4, None, 0).unwrap(); // 3..7
    g.ack(cl[1].id(), 0).unwrap();
    g.ack(cl[2].id(), 0).unwrap();
    g.dead_letter(cl[3].id(), 0).unwrap();
    let cl = g.poll(4, None, 0).unwrap(); // 7..11
    g.ack(cl[1].id(), 0).unwrap();
    g.dead_letter(cl[3].id(), 0).unwrap();
    g.redrive(10).unwrap();
    g
}

#[test]
fn snapshot_round_trips_and_restores_the_durable_part() {
    let g = busy_group();
    let snap = g.snapshot();
    assert_eq!(snap.cursor, 3);
    assert_eq!(snap.finished, vec![4, 5, 8]);
    assert_eq!(snap.dead_letters.len(), 2);
    let bytes = snap.encode();
    assert_eq!(GroupSnapshot::decode(&bytes).unwrap(), snap);
    let mut r = Group::restore(g.config().clone(), &snap, 40).unwrap();
    r.check_invariants();
    assert_eq!(r.cursor(), 3);
    assert_eq!(all_dead(&r), all_dead(&g));
    // In-flight claims were not persisted: 3, 7, 9 go out again from attempt 1; the
    // redriving dead letter 10 continues its numbering; acked 4, 5, 8 never come back.
    let c = r.poll(4, None, 0).unwrap();
    assert_eq!(
        c.iter().map(|c| (c.offset, c.attempt)).collect::<Vec<_>>(),
        vec![(3, 1), (7, 1), (9, 1), (10, 2)]
    );
    assert!(matches!(
        Group::restore(g.config().clone(), &snap, 10),
        Err(GroupError::BeyondTail {
            offset: 10,
            tail: 10
        })
    ));
    let empty = Group::new(S, cfg(), 0, 0).unwrap().snapshot();
    assert_eq!(GroupSnapshot::decode(&empty.encode()).unwrap(), empty);
}

#[test]
fn every_single_byte_corruption_is_refused() {
    let bytes = busy_group().snapshot().encode();
    for i in 0..bytes.len() {
        for x in 1..=255u8 {
            let mut b = bytes.clone();
            b[i] ^= x;
            assert!(
                GroupSnapshot::decode(&b).is_err(),
                "byte {i} ^ {x:#x} accepted"
            );
        }
    }
    for len in 0..bytes.len() {
        assert!(
            GroupSnapshot::decode(&bytes[..len]).is_err(),
            "truncated to {len}"
        );
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(GroupSnapshot::decode(&longer).is_err());
}

fn reseal(mut body: Vec<u8>) -> Vec<u8> {
    let crc = crc32c::crc32c(&body);
    body.extend_from_slice(&crc.to_le_bytes());
    body
}

#[test]
fn well_checksummed_nonsense_is_refused_by_type() {
    let good = busy_group().snapshot().encode();
    let body = good[..good.len() - 4].to_vec();
    let mut b = body.clone();
    b[0] = b'X';
    assert_eq!(
        GroupSnapshot::decode(&reseal(b)),
        Err(SnapshotError::BadMagic)
    );
    let mut b = body.clone();
    b[4] = 2;
    assert_eq!(
        GroupSnapshot::decode(&reseal(b)),
        Err(SnapshotError::UnsupportedVersion(2))
    );
    let mut b = body.clone();
    b.push(0);
    assert_eq!(
        GroupSnapshot::decode(&reseal(b)),
        Err(SnapshotError::Malformed("trailing bytes"))
    );
    assert_eq!(
        GroupSnapshot::decode(&reseal(body[..body.len() - 1].to_vec())),
        Err(SnapshotError::Truncated)
    );
    assert!(matches!(
        GroupSnapshot::decode(&good[..10]),
        Err(SnapshotError::TooShort { len: 10 })
    ));
    let mut b = good.clone();
    b[20] ^= 1;
    assert!(matches!(
        GroupSnapshot::decode(&b),
        Err(SnapshotError::Checksum { .. })
    ));
    let header = |cursor: u64| {
        let mut h = b"FXGS\x01".to_vec();
        h.extend_from_slice(&S.to_le_bytes());
        h.extend_from_slice(&cursor.to_le_bytes());
        h
    };
    let with = |cursor, tail: &[u8]| {
        let mut b = header(cursor);
        b.extend_from_slice(tail);
        GroupSnapshot::decode(&reseal(b))
    };
    // finished {1}, dead letter at 1 too
    assert_eq!(
        with(0, &[1, 0, 0, 1, 1, 1, 0]),
        Err(SnapshotError::Malformed("offset both finished and dead"))
    );
    assert_eq!(
        with(0, &[0, 1, 0, 1, 3]),
        Err(SnapshotError::Malformed("unknown dead letter reason"))
    );
    assert_eq!(
        with(0, &[0, 1, 0, 1, 8]),
        Err(SnapshotError::Malformed("unknown dead letter flags"))
    );
    assert_eq!(
        with(0, &[0, 1, 0, 0, 0]),
        Err(SnapshotError::Malformed(
            "dead letter attempts outside 1..=u32"
        ))
    );
    assert_eq!(
        with(0, &[0x80, 0x00, 0]),
        Err(SnapshotError::Malformed("overlong varint"))
    );
    assert_eq!(
        with(u64::MAX, &[1, 0, 0, 0]),
        Err(SnapshotError::Malformed("offset overflows u64"))
    );
    let mut huge = vec![0xff; 9];
    huge.push(0x01);
    assert_eq!(
        with(0, &huge),
        Err(SnapshotError::Malformed("entry count beyond limit"))
    );
    assert_eq!(with(0, &[0, 0]).unwrap().cursor, 0);
}

proptest! {
    #[test]
    fn snapshot_round_trips(
        cursor in 0u64..1_000,
        finished in proptest::collection::btree_set(1u64..500, 0..40),
        dead in proptest::collection::btree_map(0u64..2_000, (1u32..10, 0u8..3, any::<bool>()), 0..20),
    ) {
        let finished: Vec<u64> = finished
            .into_iter()
            .map(|d| cursor + d)
            .filter(|o| !dead.contains_key(o))
            .collect();
        let dead_letters = dead
            .into_iter()
            .map(|(offset, (attempts, r, redriving))| DeadLetter {
                offset,
                attempts,
                reason: [DeadLetterReason::Expired, DeadLetterReason::Nacked, DeadLetterReason::Rejected][r as usize],
                redriving,
            })
            .collect();
        let snap = GroupSnapshot { shard: S, cursor, finished, dead_letters };
        prop_assert_eq!(GroupSnapshot::decode(&snap.encode()).unwrap(), snap);
    }
}

// ---- model-based test ----------------------------------------------------------------------
//
// The reference model keeps one plain struct per offset and recomputes everything by
// scanning all of them: no indexes, no scan pointer, no counters.

#[derive(Clone, Copy, Debug, PartialEq)]
enum MPhase {
    Out(u64),
    Wait(u64),
    Parked(DeadLetterReason),
}

#[derive(Clone, Copy, Debug)]
struct MDeliv {
    att: u32,
    base: u32,
    ph: MPhase,
}

#[derive(Clone, Copy, Debug, Default)]
struct MRec {
    done: bool,
    dead: Option<(u32, DeadLetterReason)>,
    deliv: Option<MDeliv>,
}

struct Model {
    cfg: GroupConfig,
    tail: u64,
    cursor: u64,
    recs: Vec<MRec>, // indexed by offset, grown with the tail
}

impl Model {
    fn new(cfg: GroupConfig, tail: u64) -> Model {
        Model {
            cfg,
            tail,
            cursor: 0,
            recs: vec![MRec::default(); tail as usize],
        }
    }
    fn fresh(&self, o: usize) -> bool {
        let r = &self.recs[o];
        !r.done && r.dead.is_none() && r.deliv.is_none()
    }
    fn dead_count(&self) -> usize {
        self.recs.iter().filter(|r| r.dead.is_some()).count()
    }
    fn tracked(&self) -> usize {
        let delivered = self
            .recs
            .iter()
            .filter(|r| r.deliv.is_some() && r.dead.is_none())
            .count();
        let finished_beyond = (self.cursor as usize..self.recs.len())
            .filter(|&o| self.recs[o].done)
            .count();
        delivered + finished_beyond
    }
    fn out_count(&self) -> usize {
        self.recs
            .iter()
            .filter(|r| {
                matches!(
                    r.deliv,
                    Some(MDeliv {
                        ph: MPhase::Out(_),
                        ..
                    })
                )
            })
            .count()
    }
    fn advance(&mut self) {
        while self.cursor < self.tail {
            let r = &self.recs[self.cursor as usize];
            if r.done || r.dead.is_some() {
                self.cursor += 1;
            } else {
                break;
            }
        }
    }
    fn append(&mut self, n: u64) {
        self.tail += n;
        self.recs.resize(self.tail as usize, MRec::default());
    }
    fn live(&self, id: ClaimId, now: u64) -> bool {
        id.shard == S
            && (id.offset as usize) < self.recs.len()
            && matches!(self.recs[id.offset as usize].deliv,
                Some(MDeliv { att, ph: MPhase::Out(d), .. }) if att == id.attempt && d > now)
    }
    fn kill(&mut self, o: usize, reason: DeadLetterReason) -> Fate {
        let d = self.recs[o].deliv.unwrap();
        if reason != DeadLetterReason::Rejected {
            assert_eq!(
                d.att - d.base,
                self.cfg.max_attempts,
                "dead only past max_attempts"
            );
        }
        if self.recs[o].dead.is_some() {
            self.recs[o].dead = Some((d.att, reason));
            self.recs[o].deliv = None;
            return Fate::DeadLettered;
        }
        if self.dead_count() >= self.cfg.max_dead_letters as usize {
            self.recs[o].deliv = Some(MDeliv {
                ph: MPhase::Parked(reason),
                ..d
            });
            return Fate::Parked;
        }
        self.recs[o].dead = Some((d.att, reason));
        self.recs[o].deliv = None;
        self.advance();
        Fate::DeadLettered
    }
    fn unpark(&mut self) {
        while self.dead_count() < self.cfg.max_dead_letters as usize {
            let Some(o) = (0..self.recs.len()).find(|&o| {
                matches!(
                    self.recs[o].deliv,
                    Some(MDeliv {
                        ph: MPhase::Parked(_),
                        ..
                    })
                )
            }) else {
                break;
            };
            let MPhase::Parked(reason) = self.recs[o].deliv.unwrap().ph else {
                unreachable!()
            };
            self.recs[o].dead = Some((self.recs[o].deliv.unwrap().att, reason));
            self.recs[o].deliv = None;
            self.advance();
        }
    }
    fn hand_back(&mut self, o: usize, nb: u64, reason: DeadLetterReason) -> Fate {
        let d = self.recs[o].deliv.unwrap();
        if d.att - d.base >= self.cfg.max_attempts {
            return self.kill(o, reason);
        }
        self.recs[o].deliv = Some(MDeliv {
            ph: MPhase::Wait(nb),
            ..d
        });
        Fate::Redeliver
    }
    fn expire(&mut self, now: u64) -> Vec<Expired> {
        let mut lapsed: Vec<(u64, usize)> = (0..self.recs.len())
            .filter_map(|o| match self.recs[o].deliv {
                Some(MDeliv {
                    ph: MPhase::Out(d), ..
                }) if d <= now => Some((d, o)),
                _ => None,
            })
            .collect();
        lapsed.sort();
        lapsed
            .into_iter()
            .map(|(_, o)| {
                let attempt = self.recs[o].deliv.unwrap().att;
                let fate = self.hand_back(o, 0, DeadLetterReason::Expired);
                Expired {
                    offset: o as u64,
                    attempt,
                    fate,
                }
            })
            .collect()
    }
    fn poll(&mut self, max: u32, vt: u64, now: u64) -> Vec<Claim> {
        self.expire(now);
        let mut out = Vec::new();
        for o in 0..self.recs.len() {
            if out.len() == max as usize
                || self.out_count() == self.cfg.max_in_flight_records as usize
            {
                break;
            }
            let next = match self.recs[o].deliv {
                Some(MDeliv {
                    att,
                    base,
                    ph: MPhase::Wait(nb),
                }) if nb <= now => Some((att, base)),
                None if self.fresh(o) && self.tracked() < self.cfg.max_window_records as usize => {
                    Some((0, 0))
                }
                _ => None,
            };
            if let Some((att, base)) = next {
                self.recs[o].deliv = Some(MDeliv {
                    att: att + 1,
                    base,
                    ph: MPhase::Out(now + vt),
                });
                out.push(Claim {
                    shard: S,
                    offset: o as u64,
                    attempt: att + 1,
                    deadline_ms: now + vt,
                });
            }
        }
        out
    }
    fn ack(&mut self, id: ClaimId, now: u64) -> bool {
        if !self.live(id, now) {
            return false;
        }
        let o = id.offset as usize;
        self.recs[o].deliv = None;
        self.recs[o].done = true;
        if self.recs[o].dead.take().is_some() {
            self.unpark();
        }
        self.advance();
        true
    }
    fn seek(&mut self, t: u64) -> bool {
        if t > self.tail {
            return false;
        }
        if t >= self.cursor {
            for r in &mut self.recs[..t as usize] {
                if r.dead.is_none() {
                    r.done = true;
                    r.deliv = None;
                }
            }
        } else {
            for r in &mut self.recs[t as usize..] {
                if r.dead.is_none() {
                    r.done = false;
                    if let Some(d) = r.deliv {
                        r.deliv = Some(MDeliv {
                            att: d.att,
                            base: d.att,
                            ph: MPhase::Wait(0),
                        });
                    }
                }
            }
        }
        self.cursor = t;
        self.advance();
        true
    }
    fn dead_list(&self) -> Vec<DeadLetter> {
        (0..self.recs.len())
            .filter_map(|o| {
                self.recs[o].dead.map(|(attempts, reason)| DeadLetter {
                    offset: o as u64,
                    attempts,
                    reason,
                    redriving: self.recs[o].deliv.is_some(),
                })
            })
            .collect()
    }
}

#[derive(Clone, Debug)]
enum Op {
    Poll { max: u32, vt: Option<u64> },
    Ack(usize),
    Nack(usize, u64),
    Extend(usize, u64),
    Reject(usize),
    Release(usize),
    Forge { offset: u64, attempt: u32 },
    Expire,
    Advance(u64),
    Append(u64),
    Redrive(usize),
    Discard(usize),
    Seek(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (1u32..=4, proptest::option::of(1u64..=40)).prop_map(|(max, vt)| Op::Poll { max, vt }),
        5 => any::<usize>().prop_map(Op::Ack),
        3 => (any::<usize>(), prop_oneof![Just(0u64), 1u64..=30]).prop_map(|(i, d)| Op::Nack(i, d)),
        2 => (any::<usize>(), 1u64..=40).prop_map(|(i, v)| Op::Extend(i, v)),
        1 => any::<usize>().prop_map(Op::Reject),
        1 => any::<usize>().prop_map(Op::Release),
        1 => (0u64..24, 1u32..=5).prop_map(|(offset, attempt)| Op::Forge { offset, attempt }),
        2 => Just(Op::Expire),
        4 => (1u64..=25).prop_map(Op::Advance),
        2 => (1u64..=4).prop_map(Op::Append),
        2 => any::<usize>().prop_map(Op::Redrive),
        2 => any::<usize>().prop_map(Op::Discard),
        1 => any::<usize>().prop_map(Op::Seek),
    ]
}

fn small_cfg() -> impl Strategy<Value = GroupConfig> {
    (1u32..=3, 1u32..=5, 0u32..=4, 1u32..=4).prop_map(|(max_attempts, in_flight, extra, dead)| {
        GroupConfig {
            max_attempts,
            default_visibility_timeout_ms: 10,
            max_visibility_timeout_ms: 40,
            max_nack_delay_ms: 30,
            max_in_flight_records: in_flight,
            max_poll_records: in_flight.min(4),
            max_window_records: in_flight + extra,
            max_dead_letters: dead,
        }
    })
}

fn is_stale<T: std::fmt::Debug>(r: &Result<T, GroupError>) -> bool {
    match r {
        Ok(_) => false,
        Err(GroupError::StaleClaim { .. }) => true,
        Err(e) => panic!("unexpected error {e:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn group_matches_the_reference_model(
        cfg in small_cfg(),
        tail in 0u64..8,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let mut g = Group::new(S, cfg.clone(), 0, tail).unwrap();
        let mut m = Model::new(cfg.clone(), tail);
        let mut now = 0u64;
        // Every claim ever handed out (answers are picked from here, so many are late).
        let mut history: Vec<ClaimId> = Vec::new();
        // What consumers believe they hold: claim id -> deadline; cleared by a seek.
        let mut held: Vec<Claim> = Vec::new();
        for op in ops {
            let pick = |i: usize| history.get(i % history.len().max(1)).copied();
            match op {
                Op::Poll { max, vt } => {
                    let max = max.min(cfg.max_poll_records);
                    let got = g.poll(max, vt, now).unwrap();
                    let want = m.poll(max, vt.unwrap_or(10), now);
                    prop_assert_eq!(&got, &want);
                    for c in &got {
                        prop_assert!(
                            !held.iter().any(|h| h.offset == c.offset && h.deadline_ms > now),
                            "offset {} handed out while another claim on it holds", c.offset
                        );
                        history.push(c.id());
                        held.push(*c);
                    }
                }
                Op::Ack(i) => if let Some(id) = pick(i) {
                    let r = g.ack(id, now);
                    prop_assert_eq!(is_stale(&r), !m.ack(id, now));
                    held.retain(|h| h.id() != id);
                },
                Op::Forge { offset, attempt } => {
                    let id = ClaimId { shard: S, offset, attempt };
                    let r = g.ack(id, now);
                    prop_assert_eq!(is_stale(&r), !m.ack(id, now));
                    held.retain(|h| h.id() != id);
                }
                Op::Nack(i, delay) => if let Some(id) = pick(i) {
                    let r = g.nack(id, delay, now);
                    let live = m.live(id, now);
                    prop_assert_eq!(is_stale(&r), !live);
                    if live {
                        let fate = m.hand_back(id.offset as usize, now + delay, DeadLetterReason::Nacked);
                        prop_assert_eq!(r.unwrap(), fate);
                    }
                    held.retain(|h| h.id() != id);
                },
                Op::Extend(i, vt) => if let Some(id) = pick(i) {
                    let r = g.extend(id, vt, now);
                    let live = m.live(id, now);
                    prop_assert_eq!(is_stale(&r), !live);
                    if live {
                        let o = id.offset as usize;
                        let d = m.recs[o].deliv.unwrap();
                        m.recs[o].deliv = Some(MDeliv { ph: MPhase::Out(now + vt), ..d });
                        let c = r.unwrap();
                        prop_assert_eq!(c.deadline_ms, now + vt);
                        held.retain(|h| h.id() != id);
                        held.push(c);
                    }
                },
                Op::Reject(i) => if let Some(id) = pick(i) {
                    let r = g.dead_letter(id, now);
                    let live = m.live(id, now);
                    prop_assert_eq!(is_stale(&r), !live);
                    if live {
                        prop_assert_eq!(r.unwrap(), m.kill(id.offset as usize, DeadLetterReason::Rejected));
                    }
                    held.retain(|h| h.id() != id);
                },
                Op::Release(i) => if let Some(id) = pick(i) {
                    let r = g.release(id, now);
                    let live = m.live(id, now);
                    prop_assert_eq!(is_stale(&r), !live);
                    if live {
                        let o = id.offset as usize;
                        let d = m.recs[o].deliv.unwrap();
                        m.recs[o].deliv = Some(MDeliv { base: d.base + 1, ph: MPhase::Wait(0), ..d });
                    }
                    held.retain(|h| h.id() != id);
                },
                Op::Expire => {
                    prop_assert_eq!(g.expire(now), m.expire(now));
                    prop_assert!(g.next_wakeup_ms().is_none_or(|w| w > now), "wake-up in the past after expire");
                }
                Op::Advance(d) => now += d,
                Op::Append(n) => {
                    m.append(n);
                    g.records_available(m.tail);
                }
                Op::Redrive(i) => {
                    let o = i % (m.tail as usize + 1);
                    let r = g.redrive(o as u64);
                    match m.recs.get(o).copied() {
                        Some(MRec { dead: Some((att, _)), deliv: None, .. }) => {
                            prop_assert_eq!(r, Ok(()));
                            m.recs[o].deliv = Some(MDeliv { att, base: att, ph: MPhase::Wait(0) });
                        }
                        Some(MRec { dead: Some(_), .. }) => {
                            prop_assert_eq!(r, Err(GroupError::RedriveInProgress { offset: o as u64 }))
                        }
                        _ => prop_assert_eq!(r, Err(GroupError::NotDeadLettered { offset: o as u64 })),
                    }
                }
                Op::Discard(i) => {
                    let o = i % (m.tail as usize + 1);
                    let r = g.discard(o as u64);
                    match m.recs.get(o).copied() {
                        Some(MRec { dead: Some((att, reason)), deliv: None, .. }) => {
                            prop_assert_eq!(r, Ok(DeadLetter { offset: o as u64, attempts: att, reason, redriving: false }));
                            m.recs[o].dead = None;
                            m.recs[o].done = true;
                            m.unpark();
                            m.advance();
                        }
                        Some(MRec { dead: Some(_), .. }) => {
                            prop_assert_eq!(r, Err(GroupError::RedriveInProgress { offset: o as u64 }))
                        }
                        _ => prop_assert_eq!(r, Err(GroupError::NotDeadLettered { offset: o as u64 })),
                    }
                }
                Op::Seek(i) => {
                    let t = (i % (m.tail as usize + 2)) as u64;
                    let r = g.seek(t);
                    prop_assert_eq!(r.is_ok(), m.seek(t));
                    held.clear();
                }
            }
            g.check_invariants();
            prop_assert_eq!(g.cursor(), m.cursor);
            prop_assert_eq!(all_dead(&g), m.dead_list());
            let st = g.stats();
            prop_assert_eq!(st.in_flight as usize, m.out_count());
            let parked = m.recs.iter().filter(|r| matches!(r.deliv, Some(MDeliv { ph: MPhase::Parked(_), .. }))).count();
            prop_assert_eq!(st.parked as usize, parked);
            // Never two live claims on one record, from the consumers' point of view.
            let mut live: Vec<u64> = held.iter().filter(|h| h.deadline_ms > now).map(|h| h.offset).collect();
            live.sort();
            let n = live.len();
            live.dedup();
            prop_assert_eq!(live.len(), n);
            // The wake-up time is no later than anything the model has timed.
            for r in &m.recs {
                if let Some(MDeliv { ph: MPhase::Out(t), .. }) | Some(MDeliv { ph: MPhase::Wait(t), .. }) = r.deliv {
                    if t > now || matches!(r.deliv, Some(MDeliv { ph: MPhase::Out(_), .. })) {
                        prop_assert!(g.next_wakeup_ms().is_some_and(|w| w <= t));
                    }
                }
            }
            // The snapshot always round-trips and restores to the same durable state.
            let snap = g.snapshot();
            prop_assert_eq!(GroupSnapshot::decode(&snap.encode()).unwrap(), snap.clone());
            let r = Group::restore(cfg.clone(), &snap, m.tail).unwrap();
            r.check_invariants();
            prop_assert_eq!(r.cursor(), m.cursor);
            prop_assert_eq!(all_dead(&r), m.dead_list());
        }
    }

    /// Competing consumers that answer every claim, some of them too late: every record
    /// finishes exactly once (acked once, or dead-lettered after max_attempts late answers),
    /// the cursor reaches the tail, and nothing is stuck.
    #[test]
    fn consumers_that_always_ack_finish_every_record(
        cfg in small_cfg(),
        tail in 0u64..40,
        consumers in 1usize..=10,
        late in proptest::collection::vec(proptest::bool::weighted(0.3), 1..50),
        maxes in proptest::collection::vec(1u32..=4, 1..10),
    ) {
        let mut g = Group::new(S, cfg.clone(), 0, tail).unwrap();
        let mut now = 0u64;
        let mut acked = vec![0u32; tail as usize];
        let mut step = 0usize;
        let mut rounds = 0;
        while g.cursor() < tail {
            rounds += 1;
            prop_assert!(rounds < 10_000, "stuck at cursor {}", g.cursor());
            let mut any = false;
            for _ in 0..consumers {
                let max = maxes[step % maxes.len()].min(cfg.max_poll_records);
                let claims = g.poll(max, None, now).unwrap();
                for c in claims {
                    any = true;
                    step += 1;
                    if late[step % late.len()] {
                        // Answered after it lapsed: refused, the record goes out again.
                        prop_assert!(is_stale(&g.ack(c.id(), c.deadline_ms)));
                    } else {
                        g.ack(c.id(), now).unwrap();
                        acked[c.offset as usize] += 1;
                    }
                }
                g.check_invariants();
            }
            // A dead-letter list that fills parks records: an operator would discard.
            if g.stats().parked > 0 {
                let first = g.dead_letters(None, 1).unwrap().letters[0].offset;
                g.discard(first).unwrap();
                continue;
            }
            if !any {
                match g.next_wakeup_ms() {
                    Some(w) => now = now.max(w),
                    None => prop_assert!(g.cursor() == tail, "idle with nothing timed at {}", g.cursor()),
                }
            } else {
                now += 1;
            }
        }
        let dead: Vec<u64> = all_dead(&g).iter().map(|d| d.offset).collect();
        for (o, &n) in acked.iter().enumerate() {
            prop_assert!(n <= 1, "offset {o} acked {n} times");
        }
        prop_assert_eq!(g.stats().in_flight, 0);
        prop_assert_eq!(g.stats().finished_beyond_cursor, 0);
        if late.iter().all(|l| !l) {
            prop_assert!(acked.iter().all(|&n| n == 1));
            prop_assert!(dead.is_empty());
        }
        for o in dead {
            prop_assert_eq!(acked[o as usize], 0);
        }
    }
}

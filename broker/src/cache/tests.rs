use super::record::{decode, encode, RecordError};
use super::*;
use proptest::prelude::*;

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

fn shard() -> CacheShard {
    CacheShard::new(CacheLimits::default(), 100)
}

#[test]
fn put_get_delete_with_versions_that_are_offsets() {
    let mut c = shard();
    let p = c.put(b("a"), b("1"), None, Cond::Always, 0).unwrap();
    assert_eq!(p.offset, 100);
    assert_eq!(c.get(b"a", 0).unwrap().version, 100);
    let p2 = c.put(b("a"), b("2"), None, Cond::Always, 0).unwrap();
    assert_eq!(
        (p2.offset, c.get(b"a", 0).unwrap().value.clone()),
        (101, b("2"))
    );
    let (d, old) = c.delete(b("a"), Cond::Always, 0).unwrap();
    assert_eq!(
        (d.offset, d.kind, old.value, old.version),
        (102, ChangeKind::Delete, b("2"), 101)
    );
    assert_eq!(c.get(b"a", 0), None);
    assert_eq!(
        c.delete(b("a"), Cond::Always, 0).unwrap_err(),
        CacheError::NotFound
    );
    assert_eq!(c.next_offset(), 103, "a refused delete uses no offset");
    assert_eq!((c.len(), c.bytes()), (0, 0));
}

#[test]
fn ttl_is_absolute_lazy_on_read_and_reclaimed_as_changes() {
    let mut c = shard();
    c.put(b("x"), b("v"), Some(50), Cond::Always, 1_000)
        .unwrap();
    c.put(b("y"), b("v"), Some(10), Cond::Always, 1_000)
        .unwrap();
    c.put(b("z"), b("v"), None, Cond::Always, 1_000).unwrap();
    assert_eq!(c.get(b"x", 1_000).unwrap().expires_at_ms, Some(1_050));
    assert_eq!(c.next_expiry_ms(), Some(1_010));
    assert!(c.get(b"y", 1_010).is_none(), "expired at its instant");
    assert!(c.get(b"y", 1_009).is_some());
    let e = c.expire(1_100, 10);
    assert_eq!(
        e.iter()
            .map(|c| (c.offset, c.key.clone(), c.kind.clone()))
            .collect::<Vec<_>>(),
        vec![
            (103, b("y"), ChangeKind::Expire),
            (104, b("x"), ChangeKind::Expire)
        ],
        "expiry order"
    );
    assert_eq!(c.len(), 1);
    assert_eq!(c.next_expiry_ms(), None);
    // The bound on one reclamation pass.
    for i in 0..5 {
        c.put(b(&format!("t{i}")), b("v"), Some(1), Cond::Always, 0)
            .unwrap();
    }
    assert_eq!(c.expire(10, 2).len(), 2);
    assert_eq!(c.expire(10, 10).len(), 3);
    // A rewrite without TTL clears the old expiry.
    c.put(b("k"), b("v"), Some(5), Cond::Always, 0).unwrap();
    c.put(b("k"), b("w"), None, Cond::Always, 0).unwrap();
    assert!(c.expire(u64::MAX, 10).is_empty());
    for bad in [0, TTL_LIMIT_MS + 1] {
        assert!(matches!(
            c.put(b("k"), b("v"), Some(bad), Cond::Always, 0),
            Err(CacheError::TtlOutOfRange { .. })
        ));
    }
}

#[test]
fn conditional_writes_name_the_current_version() {
    let mut c = shard();
    assert_eq!(
        c.put(b("a"), b("1"), None, Cond::Version(5), 0)
            .unwrap_err(),
        CacheError::ConditionFailed { current: None }
    );
    let v = c.put(b("a"), b("1"), None, Cond::Absent, 0).unwrap().offset;
    assert_eq!(
        c.put(b("a"), b("x"), None, Cond::Absent, 0).unwrap_err(),
        CacheError::ConditionFailed { current: Some(v) }
    );
    let v2 = c
        .put(b("a"), b("2"), None, Cond::Version(v), 0)
        .unwrap()
        .offset;
    assert_eq!(
        c.put(b("a"), b("3"), None, Cond::Version(v), 0)
            .unwrap_err(),
        CacheError::ConditionFailed { current: Some(v2) },
        "a stale version loses"
    );
    assert_eq!(
        c.delete(b("a"), Cond::Version(v), 0).unwrap_err(),
        CacheError::ConditionFailed { current: Some(v2) }
    );
    c.delete(b("a"), Cond::Version(v2), 0).unwrap();
    // An expired key has no version: Absent succeeds, its old version fails.
    let t = c
        .put(b("e"), b("1"), Some(5), Cond::Always, 0)
        .unwrap()
        .offset;
    assert!(c.put(b("e"), b("2"), None, Cond::Version(t), 5).is_err());
    c.put(b("e"), b("2"), None, Cond::Absent, 5).unwrap();
}

#[test]
fn caps_refuse_without_changing_anything() {
    let limits = CacheLimits {
        key_bytes_max: 4,
        value_bytes_max: 8,
        entries_max: 2,
        bytes_max: 16,
    };
    let mut c = CacheShard::new(limits, 0);
    assert!(matches!(
        c.put(b(""), b("v"), None, Cond::Always, 0),
        Err(CacheError::KeySize { .. })
    ));
    assert!(matches!(
        c.put(b("toolong"), b("v"), None, Cond::Always, 0),
        Err(CacheError::KeySize { .. })
    ));
    assert!(matches!(
        c.put(b("k"), b("123456789"), None, Cond::Always, 0),
        Err(CacheError::ValueTooLarge { .. })
    ));
    c.put(b("a"), b("12345678"), None, Cond::Always, 0).unwrap();
    c.put(b("b"), b("1234"), None, Cond::Always, 0).unwrap();
    assert!(matches!(
        c.put(b("c"), b("1"), None, Cond::Always, 0),
        Err(CacheError::Full { .. })
    ));
    assert!(
        matches!(
            c.put(b("b"), b("12345678"), None, Cond::Always, 0),
            Err(CacheError::Full { .. })
        ),
        "bytes cap"
    );
    c.put(b("b"), b("123"), None, Cond::Always, 0).unwrap();
    assert_eq!((c.len(), c.bytes(), c.next_offset()), (2, 9 + 4, 3));
}

#[test]
fn resume_plans() {
    assert_eq!(plan_resume(10, 5, 20), ResumePlan::Replay { from: 10 });
    assert_eq!(plan_resume(20, 5, 20), ResumePlan::Replay { from: 20 });
    assert_eq!(plan_resume(4, 5, 20), ResumePlan::Snapshot);
    assert_eq!(
        plan_resume(21, 5, 20),
        ResumePlan::BeyondTail { next_offset: 20 }
    );
}

#[test]
fn a_full_watch_queue_ends_naming_the_first_offset_it_could_not_take() {
    let mut q = WatchQueue::new(2, 100);
    assert!(q.offer(5, 10) && q.offer(7, 10));
    assert!(!q.offer(9, 10));
    assert_eq!(q.ended_at(), Some(9));
    assert!(!q.offer(11, 1), "nothing after the end");
    assert_eq!((q.pop(), q.pop(), q.pop()), (Some(5), Some(7), None));
    let mut q = WatchQueue::new(10, 15);
    assert!(q.offer(1, 10));
    assert!(!q.offer(2, 10), "bytes cap");
    assert_eq!(q.ended_at(), Some(2));
    // An empty queue takes one event over the byte cap, so a watch always progresses.
    let mut q = WatchQueue::new(1, 5);
    assert!(q.offer(3, 50));
    assert!(!q.offer(4, 1));
    assert_eq!(q.pop(), Some(3));
    let mut q = WatchQueue::new(1, 5);
    assert!(
        q.offer(4, 50),
        "the resume takes the event the last watch lagged at"
    );
}

#[test]
fn counters_fold_check_overflow_and_checkpoint() {
    let mut c = Counters::new(7);
    assert_eq!(c.add(b("n"), 5).unwrap(), (7, 5));
    assert_eq!(c.add(b("n"), -8).unwrap(), (8, -3));
    assert_eq!(c.add(b("m"), i64::MAX).unwrap().1, i64::MAX);
    assert_eq!(
        c.add(b("m"), 1).unwrap_err(),
        CounterOverflow {
            sum: i64::MAX,
            delta: 1
        }
    );
    assert_eq!(c.next_offset(), 10, "a refused add uses no offset");
    // A checkpoint (sums replayed as deltas) is the same state.
    let mut r = Counters::new(100);
    for (i, (k, v)) in c.sums().enumerate() {
        r.apply(100 + i as u64, k.clone(), v);
    }
    assert_eq!(
        (r.get(b"n"), r.get(b"m"), r.get(b"none")),
        (-3, i64::MAX, 0)
    );
}

#[test]
fn hostile_records_are_refused_by_type() {
    assert_eq!(
        decode(0, b(""), 0, Bytes::from(vec![0; 8])),
        Err(RecordError::EmptyKey)
    );
    assert_eq!(
        decode(0, b("k"), 0, Bytes::from(vec![0; 7])),
        Err(RecordError::ShortPut(7))
    );
    assert_eq!(
        decode(0, b("k"), 1, b("xy")),
        Err(RecordError::BadTombstone(2))
    );
    assert_eq!(
        decode(0, b("k"), 1, b("x")),
        Err(RecordError::BadTombstone(1))
    );
    assert_eq!(
        decode(0, b("k"), 2, Bytes::new()),
        Err(RecordError::UnknownFlags(2))
    );
    assert_eq!(
        decode(0, b("k"), 9, Bytes::new()),
        Err(RecordError::UnknownFlags(9))
    );
}

#[derive(Clone, Debug)]
enum Op {
    Put {
        k: u8,
        v: u8,
        ttl: Option<u64>,
        cond: u8,
    },
    Delete {
        k: u8,
        cond: u8,
    },
    Expire,
    Advance(u64),
    Watch {
        key: Option<u8>,
        prefix: u8,
    },
}

fn key(k: u8) -> Bytes {
    // Two-level keys so prefixes select several: "a/0".."d/3".
    b(&format!("{}/{}", (b'a' + k % 4) as char, k / 4 % 4))
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (any::<u8>(), any::<u8>(), proptest::option::of(1u64..40), 0u8..6)
            .prop_map(|(k, v, ttl, cond)| Op::Put { k, v, ttl, cond }),
        2 => (any::<u8>(), 0u8..6).prop_map(|(k, cond)| Op::Delete { k, cond }),
        2 => Just(Op::Expire),
        2 => (1u64..20).prop_map(Op::Advance),
        2 => (proptest::option::of(any::<u8>()), 0u8..5).prop_map(|(key, prefix)| Op::Watch { key, prefix }),
    ]
}

struct Watcher {
    filter: Filter,
    live_from: u64,
    /// key -> (value, version) as the watcher reconstructs it.
    map: BTreeMap<Bytes, (Bytes, u64)>,
    events: Vec<u64>,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Writers and expiry interleaved with watches joining at random points: every watcher's
    /// retained state plus the changes it receives rebuild exactly the shard's final state
    /// for its filter, and its events are exactly the change log filtered to it after its
    /// join point (no gap, no duplicate). Replaying the log (through the record codec) into a
    /// fresh shard gives the same state.
    #[test]
    fn watches_join_without_gap_or_duplicate_and_replay_matches(
        ops in proptest::collection::vec(op(), 1..150),
    ) {
        let mut c = CacheShard::new(CacheLimits { entries_max: 12, ..CacheLimits::default() }, 0);
        let mut now = 0u64;
        let mut log: Vec<Change> = Vec::new();
        let mut watchers: Vec<Watcher> = Vec::new();
        for o in ops {
            let mut changes = Vec::new();
            match o {
                Op::Put { k, v, ttl, cond } => {
                    let cond = match cond {
                        0 => Cond::Absent,
                        1 => Cond::Version(c.get(&key(k), now).map_or(999_999, |e| e.version)),
                        2 => Cond::Version(v as u64),
                        _ => Cond::Always,
                    };
                    let before = c.next_offset();
                    match c.put(key(k), Bytes::from(vec![v]), ttl, cond, now) {
                        Ok(ch) => changes.push(ch),
                        Err(_) => prop_assert_eq!(c.next_offset(), before),
                    }
                }
                Op::Delete { k, cond } => {
                    let cond = match cond {
                        0 => Cond::Version(c.get(&key(k), now).map_or(999_999, |e| e.version)),
                        1 => Cond::Absent,
                        _ => Cond::Always,
                    };
                    if let Ok((ch, old)) = c.delete(key(k), cond, now) {
                        prop_assert!(old.version < ch.offset);
                        changes.push(ch);
                    }
                }
                Op::Expire => changes.extend(c.expire(now, 3)),
                Op::Advance(d) => now += d,
                Op::Watch { key: k, prefix } => {
                    let filter = match k {
                        Some(k) => Filter::Key(key(k)),
                        None => Filter::Prefix(b(["", "a", "b/", "c/1", "zz"][prefix as usize])),
                    };
                    let s = c.watch_start(&filter, now);
                    prop_assert_eq!(s.live_from, c.next_offset());
                    for (k, e) in &s.retained {
                        prop_assert!(filter.matches(k) && e.version < s.live_from);
                        prop_assert_eq!(c.get(k, now), Some(e), "retained values are live");
                    }
                    let map = s.retained.iter().map(|(k, e)| (k.clone(), (e.value.clone(), e.version))).collect();
                    watchers.push(Watcher { filter, live_from: s.live_from, map, events: Vec::new() });
                }
            }
            for ch in changes {
                if let Some(last) = log.last() {
                    prop_assert_eq!(ch.offset, last.offset + 1, "offsets contiguous");
                }
                for w in watchers.iter_mut().filter(|w| w.filter.matches(&ch.key)) {
                    w.events.push(ch.offset);
                    match &ch.kind {
                        ChangeKind::Put { value, .. } => { w.map.insert(ch.key.clone(), (value.clone(), ch.offset)); }
                        _ => { w.map.remove(&ch.key); }
                    }
                }
                log.push(ch);
            }
        }
        // Reclaim everything expired so "live" and "held" agree, then compare.
        for ch in c.expire(now, usize::MAX) {
            for w in watchers.iter_mut().filter(|w| w.filter.matches(&ch.key)) {
                w.events.push(ch.offset);
                w.map.remove(&ch.key);
            }
            log.push(ch);
        }
        for w in &watchers {
            let truth: BTreeMap<Bytes, (Bytes, u64)> = c.watch_start(&w.filter, now).retained
                .into_iter().map(|(k, e)| (k, (e.value, e.version))).collect();
            prop_assert_eq!(&w.map, &truth, "watcher state equals the cache's");
            let want: Vec<u64> = log.iter()
                .filter(|ch| ch.offset >= w.live_from && w.filter.matches(&ch.key))
                .map(|ch| ch.offset).collect();
            prop_assert_eq!(&w.events, &want);
        }
        // Recovery: the log through the codec into a fresh shard.
        let mut r = CacheShard::new(CacheLimits::default(), 0);
        for ch in &log {
            let (k, f, p) = encode(ch);
            let back = decode(ch.offset, k, f, p).unwrap();
            prop_assert_eq!(&back, ch);
            r.apply(&back);
        }
        let all = Filter::Prefix(Bytes::new());
        prop_assert_eq!(r.watch_start(&all, now), c.watch_start(&all, now));
        prop_assert_eq!((r.len(), r.bytes(), r.next_offset()), (c.len(), c.bytes(), c.next_offset()));
        // A compaction keeping only current records (plus nothing else: every key is live
        // after the final expire) restores the same values.
        let mut k2 = CacheShard::new(CacheLimits::default(), 0);
        let kept: Vec<&Change> = log.iter().filter(|ch| c.is_current(&ch.key, ch.offset)).collect();
        for ch in kept {
            k2.advance_to(ch.offset);
            k2.apply(ch);
        }
        k2.advance_to(c.next_offset());
        prop_assert_eq!(k2.watch_start(&all, now), c.watch_start(&all, now));

        // keys.idx: a snapshot taken midway, through its codec, plus the log after it,
        // rebuilds the same state as the whole log.
        let cut = log.len() / 2;
        let mut mid = CacheShard::new(CacheLimits::default(), 0);
        for ch in &log[..cut] {
            mid.apply(ch);
        }
        let snap = super::snapshot::Snapshot {
            cache_log_id: [7; 16],
            counter_log_id: [8; 16],
            cache_next: mid.next_offset(),
            counters_next: 0,
            entries: mid.entries().map(|(k, e)| (k.clone(), e.clone())).collect(),
            counters: vec![],
        };
        let bytes = Bytes::from(super::snapshot::encode(&snap));
        let back = super::snapshot::decode(&bytes).unwrap();
        prop_assert_eq!(&back, &snap);
        let mut s2 = CacheShard::restore(CacheLimits::default(), back.entries, back.cache_next);
        for ch in &log[cut..] {
            s2.apply(ch);
        }
        prop_assert_eq!(s2.watch_start(&all, now), c.watch_start(&all, now));
        prop_assert_eq!((s2.len(), s2.bytes(), s2.next_offset()), (c.len(), c.bytes(), c.next_offset()));
        prop_assert_eq!(s2.next_expiry_ms(), c.next_expiry_ms());
    }
}

#[test]
fn cache_snapshots_refuse_every_single_byte_corruption_and_bad_content() {
    use super::snapshot::{decode, encode, Snapshot, SnapshotError};
    let e = |v: &str, version: u64, exp: Option<u64>| Entry {
        value: b(v),
        version,
        expires_at_ms: exp,
    };
    let snap = Snapshot {
        cache_log_id: [1; 16],
        counter_log_id: [2; 16],
        cache_next: 10,
        counters_next: 4,
        entries: vec![(b("a"), e("x", 3, None)), (b("b/1"), e("", 9, Some(77)))],
        counters: vec![(b("hits"), -5), (b("z"), i64::MAX)],
    };
    let good = encode(&snap);
    assert_eq!(decode(&Bytes::from(good.clone())).unwrap(), snap);
    for i in 0..good.len() {
        for bit in [0x01u8, 0x80] {
            let mut bad = good.clone();
            bad[i] ^= bit;
            assert!(
                decode(&Bytes::from(bad)).is_err(),
                "flip at byte {i} accepted"
            );
        }
    }
    for n in 0..good.len() {
        assert!(
            decode(&Bytes::from(good[..n].to_vec())).is_err(),
            "truncated to {n}"
        );
    }
    // Well-formed bytes with bad content are refused too (the CRC is recomputed here).
    for bad in [
        Snapshot {
            entries: vec![(b("b"), e("x", 1, None)), (b("a"), e("y", 2, None))],
            ..snap.clone()
        },
        Snapshot {
            entries: vec![(b("a"), e("x", 10, None))],
            ..snap.clone()
        },
        Snapshot {
            entries: vec![(b(""), e("x", 1, None))],
            ..snap.clone()
        },
        Snapshot {
            counters: vec![(b("z"), 1), (b("a"), 2)],
            ..snap.clone()
        },
    ] {
        assert!(
            matches!(
                decode(&Bytes::from(encode(&bad))),
                Err(SnapshotError::Entry(..))
            ),
            "{bad:?}"
        );
    }
}

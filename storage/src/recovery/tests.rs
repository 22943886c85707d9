//! Planner tests. The property test is an oracle: the expected verdict and surviving offsets
//! follow from where the fault was injected (which commit, which byte), never from the
//! planner or scanner themselves.

use super::*;
use crate::segment::tests::build;
use crate::segment::{scan_segment, COMMIT_HEADER_BYTES};
use proptest::prelude::*;

const INTERVAL: u32 = 0;

fn sealed_view(base: u64, commits: &[Vec<Vec<u8>>]) -> (SegmentView, u64) {
    let (b, _, _) = build(base, commits);
    let scan = scan_segment(&b, base, INTERVAL);
    assert_eq!(scan.end, ScanEnd::Clean);
    let idx = scan.as_index().encode();
    let v = SegmentView::from_read(
        base,
        b.len() as u64,
        &b[..BLOCK],
        Some(&idx),
        None,
        INTERVAL,
    );
    (v, scan.end_offset)
}

fn last_view(base: u64, b: &[u8]) -> SegmentView {
    SegmentView::from_read(
        base,
        b.len() as u64,
        &b[..b.len().min(BLOCK)],
        None,
        Some(b),
        INTERVAL,
    )
}

#[derive(Debug, Clone)]
enum Fault {
    Truncate(usize),
    ZeroFrom(usize),
    /// (record index, bit) — bit is taken modulo the record's bits.
    FlipRecord(usize, usize),
    /// (commit index, bit) — a bit of the commit header.
    FlipCommitHeader(usize, usize),
}

fn payloads() -> impl Strategy<Value = Vec<Vec<u8>>> {
    proptest::collection::vec(proptest::collection::vec(1u8..=255, 1..3000), 1..5)
}

#[derive(Debug, PartialEq, Eq)]
enum Expect {
    Clean { next: u64 },
    Cut { pos: u64, next: u64 },
    Refuse { pos: u64 },
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]
    #[test]
    fn verdict_follows_from_the_fault(
        sealed in proptest::collection::vec(proptest::collection::vec(payloads(), 1..3), 0..3),
        last in proptest::collection::vec(payloads(), 0..5),
        kind in 0u8..4, a in any::<usize>(), bit in any::<usize>(),
    ) {
        let mut view = DiskView::default();
        let mut base = 0u64;
        for c in &sealed {
            let (v, end) = sealed_view(base, c);
            view.segments.push(v);
            base = end;
        }
        let (mut b, recs, spans) = build(base, &last);
        let count_before = |c: usize| -> u64 { last[..c].iter().map(|x| x.len() as u64).sum() };
        let total = count_before(last.len());
        let fault = match kind {
            0 => Fault::Truncate(BLOCK + a % (b.len() - BLOCK + 1)),
            1 => Fault::ZeroFrom(BLOCK + a % (b.len() - BLOCK + 1)),
            2 if !recs.is_empty() => Fault::FlipRecord(a % recs.len(), bit),
            3 if !spans.is_empty() => Fault::FlipCommitHeader(a % spans.len(), bit % (COMMIT_HEADER_BYTES * 8)),
            _ => Fault::Truncate(b.len()),
        };
        // The oracle: computed from the fault's position only.
        let expect = match fault {
            Fault::Truncate(k) | Fault::ZeroFrom(k) => {
                if matches!(fault, Fault::Truncate(_)) { b.truncate(k) } else { b[k..].fill(0) }
                match spans.iter().position(|&(s, e)| s <= k && k < e) {
                    Some(c) if spans[c].0 == k => Expect::Clean { next: base + count_before(c) },
                    Some(c) => Expect::Cut { pos: spans[c].0 as u64, next: base + count_before(c) },
                    None => Expect::Clean { next: base + count_before(spans.iter().filter(|&&(_, e)| e <= k).count()) },
                }
            }
            Fault::FlipRecord(r, bit) => {
                let (_, s, e) = recs[r];
                let bit = bit % ((e - s) * 8);
                b[s + bit / 8] ^= 1 << (bit % 8);
                let c = spans.iter().position(|&(cs, ce)| cs <= s && s < ce).unwrap();
                if c + 1 == spans.len() {
                    Expect::Cut { pos: spans[c].0 as u64, next: base + count_before(c) }
                } else {
                    Expect::Refuse { pos: s as u64 }
                }
            }
            Fault::FlipCommitHeader(c, bit) => {
                let s = spans[c].0;
                b[s + bit / 8] ^= 1 << (bit % 8);
                if c + 1 == spans.len() {
                    Expect::Cut { pos: s as u64, next: base + count_before(c) }
                } else {
                    Expect::Refuse { pos: s as u64 }
                }
            }
        };
        view.segments.push(last_view(base, &b));
        let plan = plan_recovery(&view, 0);
        let got = match &plan.verdict {
            Verdict::Clean => Expect::Clean { next: plan.next_offset },
            Verdict::Repair => {
                prop_assert_eq!(plan.actions.len(), 1, "{:?}", plan.actions);
                let Action::TruncateSegment { base: sb, pos } = plan.actions[0].clone() else {
                    panic!("unexpected action {:?}", plan.actions)
                };
                prop_assert_eq!(sb, base);
                Expect::Cut { pos, next: plan.next_offset }
            }
            Verdict::Refuse { segment, pos, .. } => {
                prop_assert_eq!(*segment, base);
                Expect::Refuse { pos: *pos }
            }
        };
        prop_assert_eq!(got, expect, "fault {:?}, {} records in the last segment", fault, total);
        if !matches!(plan.verdict, Verdict::Refuse { .. }) {
            // The active segment continues right after the last surviving commit.
            let r = plan.segments.last().unwrap();
            prop_assert_eq!(plan.active.clone(), Active::Continue { base, write_pos: crate::segment::align_up(r.end_pos as usize) as u64 });
        }
    }
}

#[test]
fn empty_directory_starts_at_first_offset() {
    let p = plan_recovery(&DiskView::default(), 5);
    assert_eq!(p.verdict, Verdict::Clean);
    assert_eq!(p.active, Active::Create { base: 5 });
    assert_eq!(p.log_id, None);
}

#[test]
fn interrupted_roll_is_deleted() {
    let (s0, end) = sealed_view(0, &[vec![vec![1; 10]]]);
    let mut view = DiskView {
        segments: vec![s0],
        orphan_indexes: vec![],
    };
    view.segments.push(last_view(end, &[0u8; BLOCK]));
    let p = plan_recovery(&view, 0);
    assert_eq!(p.verdict, Verdict::Repair);
    assert_eq!(p.actions, vec![Action::DeleteSegment { base: end }]);
    // The sealed segment is now last and sealed: a fresh segment is created at its end.
    assert_eq!(p.active, Active::Create { base: end });
    assert_eq!(p.next_offset, 1);
}

#[test]
fn sealed_segment_without_index_is_rebuilt_and_bad_index_too() {
    let commits = vec![vec![vec![1; 10], vec![2; 20]], vec![vec![3; 5000]]];
    let (b, _, _) = build(0, &commits);
    let (b1, _, _) = build(3, &[vec![vec![4; 7]]]);
    for idx in [None, Some(vec![0xFFu8; 64])] {
        let s0 = SegmentView::from_read(
            0,
            b.len() as u64,
            &b[..BLOCK],
            idx.as_deref(),
            Some(&b),
            INTERVAL,
        );
        let view = DiskView {
            segments: vec![s0, last_view(3, &b1)],
            orphan_indexes: vec![],
        };
        assert_eq!(must_scan(&view), vec![0, 1]);
        let p = plan_recovery(&view, 0);
        assert_eq!(p.verdict, Verdict::Repair);
        let Action::WriteIndex { index } = &p.actions[0] else {
            panic!("{:?}", p.actions)
        };
        assert_eq!((index.base_offset, index.end_offset), (0, 3));
        assert_eq!(p.next_offset, 4);
    }
}

#[test]
fn gap_between_segments_is_refused() {
    let (s0, _) = sealed_view(0, &[vec![vec![1; 10]]]);
    let (b1, _, _) = build(2, &[vec![vec![4; 7]]]);
    let view = DiskView {
        segments: vec![s0, last_view(2, &b1)],
        orphan_indexes: vec![],
    };
    let p = plan_recovery(&view, 0);
    assert!(
        matches!(p.verdict, Verdict::Refuse { segment: 2, .. }),
        "{:?}",
        p.verdict
    );
}

#[test]
fn damaged_sealed_segment_found_by_scan_is_refused() {
    // A sealed segment with no index is scanned; a torn tail in it is not repairable
    // because a newer segment follows.
    let (mut b, recs, _) = build(0, &[vec![vec![1; 10], vec![2; 10]]]);
    b[recs[1].1 + 30] ^= 1;
    let (b1, _, _) = build(2, &[vec![vec![4; 7]]]);
    let s0 = SegmentView::from_read(0, b.len() as u64, &b[..BLOCK], None, Some(&b), INTERVAL);
    let p = plan_recovery(
        &DiskView {
            segments: vec![s0, last_view(2, &b1)],
            orphan_indexes: vec![],
        },
        0,
    );
    assert!(
        matches!(p.verdict, Verdict::Refuse { segment: 0, pos, .. } if pos == recs[1].1 as u64),
        "{:?}",
        p.verdict
    );
}

#[test]
fn last_segment_index_sealed_or_stale() {
    let (b, _, _) = build(0, &[vec![vec![1; 10]]]);
    let scan = scan_segment(&b, 0, INTERVAL);
    let good = scan.as_index().encode();
    let v = SegmentView::from_read(
        0,
        b.len() as u64,
        &b[..BLOCK],
        Some(&good),
        Some(&b),
        INTERVAL,
    );
    let p = plan_recovery(
        &DiskView {
            segments: vec![v],
            orphan_indexes: vec![7],
        },
        0,
    );
    assert_eq!(p.actions, vec![Action::RemoveOrphanIndex { base: 7 }]);
    assert_eq!(
        p.active,
        Active::Create { base: 1 },
        "a sealed last segment is not appended to"
    );
    let mut torn = good.clone();
    torn[60] ^= 0xFF;
    let v = SegmentView::from_read(
        0,
        b.len() as u64,
        &b[..BLOCK],
        Some(&torn),
        Some(&b),
        INTERVAL,
    );
    let p = plan_recovery(
        &DiskView {
            segments: vec![v],
            orphan_indexes: vec![],
        },
        0,
    );
    assert_eq!(p.actions, vec![Action::RemoveIndex { base: 0 }]);
    assert!(matches!(p.active, Active::Continue { base: 0, .. }));
}

#[test]
fn segments_of_another_log_are_refused() {
    let (s0, end) = sealed_view(0, &[vec![vec![1; 10]]]);
    let (mut b1, _, _) = build(end, &[vec![vec![4; 7]]]);
    let mut h = SegmentHeader::decode(&b1[..BLOCK]).unwrap();
    h.log_id = [9; 16];
    b1[..BLOCK].copy_from_slice(&h.encode());
    let p = plan_recovery(
        &DiskView {
            segments: vec![s0, last_view(end, &b1)],
            orphan_indexes: vec![],
        },
        0,
    );
    assert!(
        matches!(p.verdict, Verdict::Refuse { segment: 1, .. }),
        "{:?}",
        p.verdict
    );
}

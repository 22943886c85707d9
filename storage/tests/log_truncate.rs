//! Generations on records and cutting a suffix (`Log::append_in`, `Log::truncate_from`),
//! against real files through glommio DMA: what replication's rule 6 needs from the log.

use felix_storage::log::{FaultPoint, FsyncMode, Log, LogError};
use felix_storage::recovery::Verdict;
use felix_storage::segment::{
    segment_file_name, CommitHeader, SegmentHeader, BLOCK, FORMAT_VERSION,
};
use felix_storage::RecordIn;
use std::path::Path;
use std::rc::Rc;
use std::sync::{Arc, Mutex};

mod common;
use common::*;

/// Offsets 0..100 in generation 1 (5 per commit), 100..200 in 2 (7 per commit), 200..300 in
/// 3 (one per commit): several segments, commits of several sizes.
async fn three_generations(log: &Log) {
    append_n_in(log, Some(1), 0, 100, 5).await;
    append_n_in(log, Some(2), 100, 100, 7).await;
    append_n_in(log, Some(3), 200, 100, 1).await;
}

fn gen_of(offset: u64) -> u64 {
    1 + offset / 100
}

async fn check_gens(log: &Log, from: u64, to: u64, gen: impl Fn(u64) -> u64) {
    for o in from..to {
        assert_eq!(log.gen_at(o), Some(gen(o)), "generation of {o}");
    }
    let mut at = from;
    while at < to {
        for r in log.read(at, 50, 1 << 20).await.unwrap() {
            assert_eq!(
                r.gen,
                gen(r.offset),
                "read back the generation of {}",
                r.offset
            );
            at = r.offset + 1;
        }
    }
}

fn segment_bases(d: &Path) -> Vec<u64> {
    felix_storage::log::list_log_dir(d).unwrap().0
}

#[test]
fn generations_are_kept_per_commit_and_never_go_back() {
    let (_t, d) = dir();
    run(move || async move {
        let (log, _) = Log::open(&d, small(FsyncMode::OnCommit)).await.unwrap();
        assert_eq!(log.newest_gen(), None);
        three_generations(&log).await;
        assert_eq!(log.newest_gen(), Some(3));
        check_gens(&log, 0, 300, gen_of).await;
        assert_eq!(log.gen_at(300), None, "not written");
        // Appends of two generations queued together land in two commits.
        let a = log
            .append_in(3, &[RecordIn::new(&payload(300))], 1)
            .unwrap();
        let b = log
            .append_in(5, &[RecordIn::new(&payload(301))], 1)
            .unwrap();
        assert_eq!((a.start, b.start), (300, 301));
        log.wait_acked(302).await.unwrap();
        assert_eq!((log.gen_at(300), log.gen_at(301)), (Some(3), Some(5)));
        // An older generation is refused, and loses nothing.
        let e = log.append_in(4, &[RecordIn::new(b"x")], 1).unwrap_err();
        assert_eq!(e, LogError::GenerationBehind { gen: 4, newest: 5 });
        assert_eq!(log.next_offset(), 302);
        // A plain append continues the newest generation.
        let c = log.append(&[RecordIn::new(&payload(302))], 1).unwrap();
        log.wait_acked(c.end).await.unwrap();
        assert_eq!(log.gen_at(302), Some(5));
        log.close().await.unwrap();
        // Sealed segments keep their runs in their index, the active one in its commits.
        let (log, rep) = Log::open(&d, small(FsyncMode::OnCommit)).await.unwrap();
        assert_eq!(rep.verdict, Verdict::Clean);
        assert!(rep.segments > 3, "{} segments", rep.segments);
        let gen = |o: u64| match o {
            0..300 => gen_of(o),
            300 => 3,
            _ => 5,
        };
        check_gens(&log, 0, 303, gen).await;
        assert_eq!(log.newest_gen(), Some(5));
        log.close().await.unwrap();
    });
}

/// Cut at the end (nothing to do), inside a commit, at a commit start, at a generation's
/// start, at a segment's base, and down to the oldest offset, under both write paths; then
/// append in a new generation and reopen.
#[test]
fn a_cut_anywhere_keeps_every_record_below_it_and_reopens_clean() {
    for fsync in [FsyncMode::OnCommit, FsyncMode::Periodic { interval_ms: 50 }] {
        // Where the segments start, from a first build.
        let (_t, d) = dir();
        let bases = {
            let d2 = d.clone();
            run(move || async move {
                let (log, _) = Log::open(&d2, small(fsync)).await.unwrap();
                three_generations(&log).await;
                log.close().await.unwrap();
            });
            segment_bases(&d)
        };
        assert!(bases.len() >= 4, "{bases:?}");
        let cuts = [
            300,
            299,
            250,
            201,
            150,
            149,
            103,
            100,
            bases[2],
            bases[1] + 2,
            1,
            0,
        ];
        for to in cuts {
            let (_t, d) = dir();
            run(move || async move {
                let (log, _) = Log::open(&d, small(fsync)).await.unwrap();
                three_generations(&log).await;
                log.truncate_from(to).await.unwrap();
                let ctx = format!("{fsync:?}, cut to {to}");
                assert_eq!((log.next_offset(), log.acked()), (to, to), "{ctx}");
                assert_eq!(log.newest_gen(), to.checked_sub(1).map(gen_of), "{ctx}");
                check_all(&log, 0, to).await;
                check_gens(&log, 0, to, gen_of).await;
                assert!(
                    matches!(
                        log.read(to + 1, 1, 1).await,
                        Err(LogError::BeyondTail { .. })
                    ),
                    "{ctx}"
                );
                // The cut offsets are assigned again, in a newer generation.
                append_n_in(&log, Some(7), to, 10, 3).await;
                let gen = |o: u64| if o < to { gen_of(o) } else { 7 };
                check_gens(&log, 0, to + 10, gen).await;
                log.close().await.unwrap();
                let (log, rep) = Log::open(&d, small(fsync)).await.unwrap();
                assert_eq!(
                    (rep.verdict, rep.next_offset),
                    (Verdict::Clean, to + 10),
                    "{ctx}"
                );
                check_all(&log, 0, to + 10).await;
                check_gens(&log, 0, to + 10, gen).await;
                log.close().await.unwrap();
            });
        }
    }
}

/// A cut stopped before each of its steps (as a crash there would stop it) leaves files
/// that open as a log holding at least every record below the cut; cutting again finishes.
#[test]
fn a_cut_stopped_at_any_step_reopens_and_can_be_finished() {
    let (_t, d) = dir();
    let to = {
        let d2 = d.clone();
        run(move || async move {
            let (log, _) = Log::open(&d2, small(FsyncMode::OnCommit)).await.unwrap();
            three_generations(&log).await;
            log.close().await.unwrap();
        });
        // Inside the first commit of the second segment (five records each): every step runs.
        segment_bases(&d)[1] + 2
    };
    // Which steps a whole cut passes, first without stopping.
    let mut seen_all = Vec::new();
    for stop_at in [None, Some(1u8), Some(2), Some(3), Some(4), Some(5)] {
        let (_t, d) = dir();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        run(move || async move {
            let seen = s2;
            let mut cfg = small(FsyncMode::OnCommit);
            let s = seen.clone();
            cfg.faults = Some(Rc::new(move |p| match p {
                FaultPoint::Truncate(k) => {
                    s.lock().unwrap().push(k);
                    (Some(k) == stop_at).then_some(libc::EIO)
                }
                _ => None,
            }));
            let (log, _) = Log::open(&d, cfg).await.unwrap();
            three_generations(&log).await;
            let r = log.truncate_from(to).await;
            let Some(k) = stop_at else {
                r.unwrap();
                log.close().await.unwrap();
                return;
            };
            assert!(r.is_err(), "stopped before step {k}");
            assert!(log.failed().is_some(), "a cut that stopped fails the log");
            assert!(matches!(
                log.append(&[RecordIn::new(b"x")], 1),
                Err(LogError::Failed(_))
            ));
            drop(log);
            let (log, rep) = Log::open(&d, small(FsyncMode::OnCommit)).await.unwrap();
            assert!(
                (to..=300).contains(&rep.next_offset),
                "stopped before step {k}: reopened at {}",
                rep.next_offset
            );
            check_all(&log, 0, to).await;
            log.truncate_from(to).await.unwrap();
            append_n_in(&log, Some(9), to, 5, 2).await;
            log.close().await.unwrap();
            let (log, rep) = Log::open(&d, small(FsyncMode::OnCommit)).await.unwrap();
            assert_eq!(
                (rep.verdict, rep.next_offset),
                (Verdict::Clean, to + 5),
                "step {k}"
            );
            check_all(&log, 0, to + 5).await;
            log.close().await.unwrap();
        });
        if stop_at.is_none() {
            seen_all = seen.lock().unwrap().clone();
        }
    }
    seen_all.dedup();
    assert_eq!(seen_all, vec![1, 2, 3, 4, 5], "this cut passes every step");
}

/// A wait for records a cut removed ends `Truncated`, never with another record's
/// acknowledgement; appends while the cut runs are refused, and bad cuts are refused.
#[test]
fn a_cut_ends_the_waits_it_overtakes_and_refuses_appends_meanwhile() {
    let (_t, d) = dir();
    run(move || async move {
        let (log, _) = Log::open(&d, small(FsyncMode::Periodic { interval_ms: 50 }))
            .await
            .unwrap();
        append_n_in(&log, Some(1), 0, 50, 5).await;
        let l = log.clone();
        let waiter = glommio::spawn_local(async move { l.wait_acked(60).await });
        glommio::executor().yield_now().await;
        // Queued but not written when the cut starts: the cut waits for the write first.
        log.append_in(1, &[RecordIn::new(&payload(50))], 1).unwrap();
        let l = log.clone();
        let cut = glommio::spawn_local(async move { l.truncate_from(40).await });
        glommio::executor().yield_now().await;
        assert_eq!(
            log.append_in(1, &[RecordIn::new(b"x")], 1),
            Err(LogError::Truncating)
        );
        cut.await.unwrap();
        assert_eq!(waiter.await, Err(LogError::Truncated { to: 40 }));
        append_n_in(&log, Some(2), 40, 30, 4).await;
        assert_eq!(log.acked(), 70);
        check_all(&log, 0, 70).await;
        assert!(matches!(
            log.truncate_from(71).await,
            Err(LogError::BeyondTail {
                requested: 71,
                tail: 70
            })
        ));
        log.close().await.unwrap();
        assert_eq!(log.truncate_from(10).await, Err(LogError::Closed));
    });
}

/// A directory written by the previous release (format version 1: no generations) opens,
/// reads as generation 0, and takes new commits in a new segment of the current version,
/// so that the previous release refuses the directory instead of misreading it.
#[test]
fn a_version_1_log_opens_as_generation_0_and_continues_in_a_new_segment() {
    let (_t, d) = dir();
    std::fs::create_dir_all(&d).unwrap();
    let mut seg = SegmentHeader {
        version: 1,
        base_offset: 0,
        log_id: [5; 16],
        created_ms: 1,
    }
    .encode()
    .to_vec();
    for c in 0..3u64 {
        let mut body = Vec::new();
        for k in 0..4 {
            let o = c * 4 + k;
            felix_storage::record::encode_into(&mut body, o, 1000 + o, &RecordIn::new(&payload(o)));
        }
        let mut h = CommitHeader::new(body.len() as u32, 4, c * 4, 1003 + c * 4, 0);
        h.version = 1;
        let start = seg.len();
        seg.extend_from_slice(&h.encode());
        seg.extend_from_slice(&body);
        seg.resize(start + (h.span()).div_ceil(BLOCK) * BLOCK, 0);
    }
    std::fs::write(d.join(segment_file_name(0)), &seg).unwrap();
    run(move || async move {
        let (log, rep) = Log::open(&d, small(FsyncMode::OnCommit)).await.unwrap();
        assert_eq!(rep.next_offset, 12);
        check_all(&log, 0, 12).await;
        check_gens(&log, 0, 12, |_| 0).await;
        assert_eq!(log.newest_gen(), Some(0));
        append_n(&log, 12, 5, 5).await;
        assert_eq!(log.segment_count(), 2, "the old-format segment was sealed");
        let bases = segment_bases(&d);
        let head = std::fs::read(d.join(segment_file_name(bases[1]))).unwrap();
        assert_eq!(
            SegmentHeader::decode(&head[..BLOCK]).unwrap().version,
            FORMAT_VERSION
        );
        log.close().await.unwrap();
        let (log, rep) = Log::open(&d, small(FsyncMode::OnCommit)).await.unwrap();
        assert_eq!((rep.verdict, rep.next_offset), (Verdict::Clean, 17));
        check_all(&log, 0, 17).await;
        check_gens(&log, 0, 17, |_| 0).await;
        // Inside the old segment there is nothing to cut: it never took a generation.
        assert!(matches!(
            log.truncate_from(5).await,
            Err(LogError::CannotTruncate(_))
        ));
    });
}

/// A log restarted at a base past its end (a follower rebuilt from its leader's base, rule
/// 10) holds nothing below the base, takes its next record there, and reopens so. Stopped
/// before any of its steps (as a crash there would stop it), it reopens as a prefix of the
/// old log or empty, never with records at other offsets; restarting again finishes.
#[test]
fn a_log_restarted_at_a_base_holds_nothing_below_it_and_a_stopped_restart_can_be_finished() {
    let stops = [
        None,
        Some(FaultPoint::Truncate(1)),
        Some(FaultPoint::Truncate(3)),
        Some(FaultPoint::Truncate(6)),
        Some(FaultPoint::CreateSegment),
    ];
    for stop_at in stops {
        let (_t, d) = dir();
        run(move || async move {
            let armed = Rc::new(std::cell::Cell::new(false));
            let mut cfg = small(FsyncMode::OnCommit);
            let a = armed.clone();
            cfg.faults = Some(Rc::new(move |p| {
                (a.get() && Some(p) == stop_at).then_some(libc::EIO)
            }));
            let (log, _) = Log::open(&d, cfg).await.unwrap();
            three_generations(&log).await;
            assert!(segment_bases(&d).len() > 2, "several segments to remove");
            assert!(matches!(
                log.restart_at(299).await,
                Err(LogError::CannotTruncate(_))
            ));
            armed.set(true);
            let r = log.restart_at(1000).await;
            if let Some(p) = stop_at {
                assert!(r.is_err(), "stopped at {p:?}");
                assert!(
                    log.failed().is_some(),
                    "a restart that stopped fails the log"
                );
                drop(log);
                let (log, rep) = Log::open(&d, small(FsyncMode::OnCommit)).await.unwrap();
                assert_eq!(rep.oldest_offset, 0, "stopped at {p:?}");
                assert!(
                    rep.next_offset <= 300,
                    "stopped at {p:?}: {}",
                    rep.next_offset
                );
                check_all(&log, 0, rep.next_offset).await;
                log.restart_at(1000).await.unwrap();
                log.close().await.unwrap();
            } else {
                r.unwrap();
                log.close().await.unwrap();
            }
            let (log, rep) = Log::open(&d, small(FsyncMode::OnCommit)).await.unwrap();
            assert_eq!((rep.oldest_offset, rep.next_offset), (1000, 1000));
            assert_eq!(segment_bases(&d), vec![1000]);
            append_n_in(&log, Some(9), 1000, 5, 2).await;
            assert_eq!(log.gen_at(999), None);
            assert!(matches!(
                log.read(500, 10, 1 << 20).await,
                Err(LogError::BelowRetention { .. })
            ));
            log.close().await.unwrap();
            let (log, rep) = Log::open(&d, small(FsyncMode::OnCommit)).await.unwrap();
            assert_eq!((rep.oldest_offset, rep.next_offset), (1000, 1005));
            check_all(&log, 1000, 1005).await;
            check_gens(&log, 1000, 1005, |_| 9).await;
            log.close().await.unwrap();
        });
    }
}

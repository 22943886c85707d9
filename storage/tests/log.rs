//! The log driver against real files through glommio DMA (io_uring, O_DIRECT).

use felix_storage::log::{FaultPoint, FsyncMode, Log, LogConfig, LogError};
use felix_storage::recovery::{Action, Verdict};
use felix_storage::retention::RetentionLimits;
use felix_storage::segment::{segment_file_name, BLOCK};
use felix_storage::RecordIn;
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::rc::Rc;

mod common;
use common::*;

#[test]
fn append_read_roll_and_reopen() {
    let (_t, d) = dir();
    run(move || async move {
        let (log, rep) = Log::open(&d, small(FsyncMode::OnCommit)).await.unwrap();
        assert_eq!((rep.verdict.clone(), rep.next_offset), (Verdict::Clean, 0));
        let end = append_n(&log, 0, 300, 5).await;
        assert_eq!(end, 300);
        assert!(
            log.segment_count() > 3,
            "small segments roll: {}",
            log.segment_count()
        );
        check_all(&log, 0, 300).await;
        // Random access lands through the sparse index.
        for at in [0u64, 1, 99, 150, 299] {
            let r = log.read(at, 1, 1).await.unwrap();
            assert_eq!(r[0].offset, at);
        }
        assert_eq!(log.read(300, 10, 10).await.unwrap(), vec![]);
        assert!(matches!(
            log.read(301, 1, 1).await,
            Err(LogError::BeyondTail { tail: 300, .. })
        ));
        let id = log.log_id();
        log.close().await.unwrap();
        assert!(matches!(
            log.append(&[RecordIn::new(b"x")], 0),
            Err(LogError::Closed)
        ));

        let (log, rep) = Log::open(&d, small(FsyncMode::OnCommit)).await.unwrap();
        assert_eq!(rep.verdict, Verdict::Clean, "{:?}", rep.actions);
        assert_eq!(rep.next_offset, 300);
        assert_eq!(log.log_id(), id, "storage identity survives reopen");
        check_all(&log, 0, 300).await;
        let end = append_n(&log, 300, 50, 7).await;
        check_all(&log, 0, end).await;
        log.close().await.unwrap();
    });
}

/// Page-cache commits written inline (plain pwrite; `u64::MAX` never backs off) and through
/// io_uring (`0`) leave the same log: every record reads back before and after a reopen,
/// across segment rolls.
#[test]
fn page_cache_commits_inline_or_through_io_uring_read_back_alike() {
    for slow_us in [u64::MAX, 0] {
        let (_t, d) = dir();
        run(move || async move {
            let cfg = LogConfig {
                inline_write_slow_us: slow_us,
                ..small(FsyncMode::None)
            };
            let (log, _) = Log::open(&d, cfg.clone()).await.unwrap();
            assert_eq!(append_n(&log, 0, 300, 7).await, 300);
            assert!(log.segment_count() > 3, "small segments roll");
            check_all(&log, 0, 300).await;
            log.close().await.unwrap();
            let (log, rep) = Log::open(&d, cfg).await.unwrap();
            assert_eq!(
                rep.verdict,
                Verdict::Clean,
                "slow_us {slow_us}: {:?}",
                rep.actions
            );
            assert_eq!(rep.next_offset, 300);
            check_all(&log, 0, 300).await;
            log.close().await.unwrap();
        });
    }
}

#[test]
fn group_commit_batches_concurrent_appends() {
    let (_t, d) = dir();
    run(move || async move {
        let (log, _) = Log::open(&d, small(FsyncMode::Periodic { interval_ms: 50 }))
            .await
            .unwrap();
        // Many appends queued before the committer runs share commits.
        let mut last = 0;
        for i in 0..40u64 {
            let p = payload(i);
            last = log.append(&[RecordIn::new(&p)], i).unwrap().end;
        }
        log.wait_acked(last).await.unwrap();
        check_all(&log, 0, 40).await;
        // Acked under periodic means written; the periodic sync catches up soon after.
        for _ in 0..100 {
            if log.synced() >= 40 {
                break;
            }
            glommio::timer::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert_eq!(log.synced(), 40, "periodic fdatasync ran");
        log.close().await.unwrap();
    });
}

#[test]
fn oversized_and_backpressure_are_refused_and_lose_nothing() {
    let (_t, d) = dir();
    run(move || async move {
        let mut cfg = small(FsyncMode::None);
        cfg.pending_bytes_max = 40 << 10;
        let (log, _) = Log::open(&d, cfg).await.unwrap();
        let big = vec![1u8; 20 << 10];
        assert!(matches!(
            log.append(&[RecordIn::new(&big)], 0),
            Err(LogError::TooLarge { .. })
        ));
        let p = vec![2u8; 10 << 10];
        let mut refused = 0;
        let mut accepted = 0u64;
        for _ in 0..10 {
            match log.append(&[RecordIn::new(&p)], 0) {
                Ok(r) => accepted = r.end,
                Err(LogError::Backpressure { .. }) => refused += 1,
                Err(e) => panic!("{e}"),
            }
        }
        assert!(refused > 0, "pending bound enforced");
        log.wait_acked(accepted).await.unwrap();
        assert_eq!(
            log.next_offset(),
            accepted,
            "a refused append assigns no offset"
        );
        log.close().await.unwrap();
    });
}

/// A failing device stops acknowledgements: nothing the device refused is acked, later
/// appends are refused, and a reopen serves exactly what was acked before.
#[test]
fn device_errors_stop_acknowledging() {
    for (point, errno) in [
        (FaultPoint::Write, libc::EIO),
        (FaultPoint::Sync, libc::EIO),
        (FaultPoint::Write, libc::ENOSPC),
        (FaultPoint::CreateSegment, libc::ENOSPC),
    ] {
        let (_t, d) = dir();
        run(move || async move {
            let armed = Rc::new(Cell::new(false));
            let a = armed.clone();
            let mut cfg = small(FsyncMode::OnCommit);
            cfg.faults = Some(Rc::new(move |p| (a.get() && p == point).then_some(errno)));
            let (log, _) = Log::open(&d, cfg).await.unwrap();
            let good = append_n(&log, 0, 20, 4).await;
            armed.set(true);
            // Enough to force a roll (for the CreateSegment fault).
            let mut results = Vec::new();
            for i in 0..200u64 {
                let p = payload(good + i);
                match log.append(&[RecordIn::new(&p)], 0) {
                    Ok(r) => results.push(r),
                    Err(LogError::Failed(_)) => break,
                    Err(e) => panic!("{e}"),
                }
                if i % 10 == 9 {
                    let _ = log.wait_acked(results.last().unwrap().end).await;
                }
            }
            let last = results.last().unwrap().end;
            let err = log.wait_acked(last).await.unwrap_err();
            assert!(matches!(err, LogError::Failed(_)), "{point:?}: {err}");
            assert!(log.failed().is_some());
            let acked = log.acked();
            assert!(
                acked >= good && acked < last,
                "{point:?}: acked {acked}, last {last}"
            );
            assert!(matches!(
                log.append(&[RecordIn::new(b"x")], 0),
                Err(LogError::Failed(_))
            ));
            drop(log);
            // Reopen without faults: everything acked is there, bytes intact.
            let (log, rep) = Log::open(&d, small(FsyncMode::OnCommit)).await.unwrap();
            assert!(
                rep.next_offset >= acked,
                "{point:?}: reopened at {} < acked {acked}",
                rep.next_offset
            );
            check_all(&log, 0, acked).await;
            log.close().await.unwrap();
        });
    }
}

fn last_segment(d: &Path) -> PathBuf {
    let (bases, _) = felix_storage::log::list_log_dir(d).unwrap();
    d.join(segment_file_name(*bases.last().unwrap()))
}

#[test]
fn torn_tail_is_cut_and_middle_corruption_refused() {
    let (_t, d) = dir();
    let d2 = d.clone();
    run(move || async move {
        let (log, _) = Log::open(&d2, small(FsyncMode::OnCommit)).await.unwrap();
        for i in 0..5 {
            append_n(&log, 2 * i, 2, 2).await; // waits: 5 commits in one segment
        }
        log.close().await.unwrap();
    });
    // Tear the last commit: zero its second half.
    let seg = last_segment(&d);
    let mut b = std::fs::read(&seg).unwrap();
    let len = b.len();
    let last_commit = (BLOCK..len)
        .step_by(BLOCK)
        .filter(|p| &b[*p..p + 4] == b"FXC2")
        .max()
        .unwrap();
    let cut = last_commit + 48;
    b[cut..].fill(0);
    std::fs::write(&seg, &b).unwrap();
    let d2 = d.clone();
    run(move || async move {
        let (log, rep) = Log::open(&d2, small(FsyncMode::OnCommit)).await.unwrap();
        assert_eq!(rep.verdict, Verdict::Repair);
        assert!(
            matches!(rep.actions[..], [Action::TruncateSegment { pos, .. }] if pos as usize == last_commit)
        );
        assert_eq!(
            rep.next_offset, 8,
            "the torn commit (offsets 8, 9) is cut whole: {rep:?} {last_commit}"
        );
        check_all(&log, 0, 8).await;
        // New appends reuse offsets 8.. after the cut, and reopen clean.
        append_n(&log, 8, 4, 1).await;
        log.close().await.unwrap();
        let (log, rep) = Log::open(&d2, small(FsyncMode::OnCommit)).await.unwrap();
        assert_eq!(rep.verdict, Verdict::Clean);
        check_all(&log, 0, 12).await;
        log.close().await.unwrap();
    });
    // Flip a bit in the first commit: intact commits follow, so open refuses.
    let mut b = std::fs::read(&seg).unwrap();
    b[BLOCK + 100] ^= 0x10;
    std::fs::write(&seg, &b).unwrap();
    let name = seg.file_name().unwrap().to_string_lossy().into_owned();
    run(move || async move {
        match Log::open(&d, small(FsyncMode::OnCommit)).await {
            Err(LogError::Refused { segment, pos, .. }) => {
                assert_eq!(segment_file_name(segment), name);
                assert!(pos >= BLOCK as u64 && pos <= BLOCK as u64 + 100, "{pos}");
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("corruption in the middle must be refused"),
        }
    });
}

/// Rule 10's storage side: retention deletes no segment holding an offset at or above the
/// hold, the hold is in force from open (before any sweep), and raising it lets retention
/// go on; a compaction's trim stops at it too.
#[test]
fn retention_stops_at_the_hold_from_open_and_moves_with_it() {
    let (_t, d) = dir();
    run(move || async move {
        let mut cfg = small(FsyncMode::None);
        cfg.retention = RetentionLimits {
            bytes_max: Some(100 << 10),
            age_max_ms: None,
        };
        cfg.retention_hold = Some(0);
        let (log, _) = Log::open(&d, cfg.clone()).await.unwrap();
        let end = append_n(&log, 0, 1000, 10).await;
        assert!(log.segment_count() > 5, "{} segments", log.segment_count());
        assert_eq!(
            log.oldest_offset(),
            0,
            "nothing deleted at or above the hold"
        );
        assert_eq!(
            log.delete_below(500).await,
            0,
            "a compaction stops at it too"
        );
        log.close().await.unwrap();
        // Reopened with the hold at 300: the first sweep (at the next roll) keeps 300 and on.
        cfg.retention_hold = Some(300);
        let (log, _) = Log::open(&d, cfg.clone()).await.unwrap();
        let end = append_n(&log, end, 300, 10).await;
        let oldest = log.oldest_offset();
        assert!(oldest > 0 && oldest <= 300, "oldest {oldest}");
        check_all(&log, oldest, end).await;
        // The hold moves: retention goes on to its own bound.
        log.set_retention_hold(None);
        let end = append_n(&log, end, 300, 10).await;
        assert!(log.oldest_offset() > 300, "oldest {}", log.oldest_offset());
        check_all(&log, log.oldest_offset(), end).await;
        log.close().await.unwrap();
    });
}

#[test]
fn retention_deletes_whole_old_segments() {
    let (_t, d) = dir();
    run(move || async move {
        let mut cfg = small(FsyncMode::None);
        cfg.retention = RetentionLimits {
            bytes_max: Some(200 << 10),
            age_max_ms: None,
        };
        let (log, _) = Log::open(&d, cfg.clone()).await.unwrap();
        let end = append_n(&log, 0, 1000, 10).await;
        let oldest = log.oldest_offset();
        assert!(oldest > 0, "old segments deleted");
        let files = std::fs::read_dir(&d)
            .unwrap()
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
            .count();
        assert!(
            files <= 5,
            "{files} segments kept under a 200 KiB bound with 64 KiB segments"
        );
        match log.read(0, 1, 1).await {
            Err(LogError::BelowRetention { oldest: o, .. }) => assert_eq!(o, oldest),
            other => panic!("{other:?}"),
        }
        check_all(&log, oldest, end).await;
        log.close().await.unwrap();
        let (log, rep) = Log::open(&d, cfg).await.unwrap();
        assert_eq!(rep.verdict, Verdict::Clean);
        assert_eq!((log.oldest_offset(), rep.next_offset), (oldest, end));
        log.close().await.unwrap();
    });
}

/// `Log::bytes_from`: how far an offset is behind the end, in bytes. Zero at the end, never
/// less than the records' own encoded bytes from there, never more than those plus the
/// commits' headers and padding and one index interval, non-increasing, and the whole log
/// below the oldest offset.
#[test]
fn bytes_from_an_offset_count_what_follows_it() {
    let (_t, d) = dir();
    run(move || async move {
        let cfg = small(FsyncMode::OnCommit);
        let interval = u64::from(cfg.index_interval_bytes);
        let (log, _) = Log::open(&d, cfg).await.unwrap();
        let n = 300;
        append_n(&log, 0, n, 5).await;
        assert!(log.segment_count() > 2);
        let enc = |o: u64| RecordIn::new(&payload(o)).encoded_len() as u64 + 20;
        let commits = n.div_ceil(5);
        let mut prev = u64::MAX;
        for o in 0..=n {
            let b = log.bytes_from(o);
            let records: u64 = (o..n)
                .map(|r| RecordIn::new(&payload(r)).encoded_len() as u64)
                .sum();
            assert!(b >= records, "offset {o}: {b} < {records} record bytes");
            let slack =
                interval + commits * (BLOCK as u64) + (o..n).map(enc).sum::<u64>() - records;
            assert!(
                b <= records + slack,
                "offset {o}: {b} > {records} + {slack}"
            );
            assert!(b <= prev, "non-increasing at {o}");
            prev = b;
        }
        assert_eq!(log.bytes_from(n), 0);
        assert_eq!(log.bytes_from(u64::MAX), 0);
        assert!(log.delete_below(150).await > 0);
        let oldest = log.oldest_offset();
        assert_eq!(
            log.bytes_from(0),
            log.bytes_from(oldest),
            "below the oldest: all of it"
        );
        log.close().await.unwrap();
    });
}

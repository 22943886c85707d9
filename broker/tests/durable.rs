//! Durable streams through the real broker binary: ack after commit with offsets, restart on
//! the same directory, history from disk joining live delivery with no gap and no duplicate,
//! resume by offset, typed offset errors, SIGKILL crash rounds under on_commit and periodic,
//! and `felix-broker inspect segments` exit codes. Every loop is bounded by count and time.

mod common;

use bytes::Bytes;
use common::Broker;
use felix_client::{Client, Event, SubscribeOptions, Subscription};
use felix_quic::wire::{ErrorCode, ShardSelector, StartAt, StreamName};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(30);

const CATALOG: &str = "streams:
  - {tenant: default, namespace: default, stream: events, shards: 2}
  - {tenant: default, namespace: default, stream: orders, shards: 2, durable: true, fsync: on_commit}
  - {tenant: default, namespace: default, stream: logs, shards: 1, durable: true, fsync: periodic}
  - {tenant: default, namespace: default, stream: small, shards: 1, durable: true, fsync: none, retention_bytes: 1048576}
caches:
  - {tenant: default, namespace: default, cache: kv, shards: 2}
";

fn name(s: &str) -> StreamName {
    StreamName::new("default", "default", s)
}

fn payload(tag: &str, i: u64) -> Bytes {
    Bytes::from(format!("{tag}-{i:07}-{}", "d".repeat((i % 200) as usize)))
}

/// Start (or restart) a broker whose catalog has durable streams, on `dir`.
fn start(dir: tempfile::TempDir, extra: &[&str]) -> Broker {
    let cat = dir.path().join("catalog.yaml");
    std::fs::write(&cat, CATALOG).unwrap();
    let durable = dir.path().join("durable");
    let mut args = vec![
        "--catalog".to_string(),
        cat.display().to_string(),
        "--durable-storage-dir".to_string(),
        durable.display().to_string(),
        "--durable-segment-bytes".to_string(),
        (1 << 20).to_string(),
        // A small ring, so history beyond a few batches must come from disk.
        "--ring-records-max".to_string(),
        "64".to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Broker::start_in(dir, 2, &args)
}

fn durable_dir(b: &Broker) -> std::path::PathBuf {
    b.dir.path().join("durable")
}

/// Read a subscription until `want` records arrived (or the deadline); `(offset, payload)`.
async fn collect(sub: &mut Subscription, want: usize) -> Vec<(u64, Bytes)> {
    let deadline = Instant::now() + WAIT;
    let mut got = Vec::new();
    while got.len() < want {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "timed out with {} of {want} records",
            got.len()
        );
        match sub.next_timeout(left).await {
            Ok(Some(ev @ Event::Records { .. })) => got.extend(ev.records()),
            Ok(Some(Event::Lag {
                from_offset, lost, ..
            })) => {
                panic!("durable history never lags here: lost {lost} from {from_offset}")
            }
            Ok(Some(Event::End { code, message, .. })) => panic!("ended ({code}): {message}"),
            Ok(Some(Event::Watch(w))) => panic!("a watch item on a subscription: {w:?}"),
            Ok(None) => panic!("subscription closed"),
            Err(e) => panic!("subscription error: {e}"),
        }
    }
    got
}

fn from(start: StartAt) -> SubscribeOptions {
    SubscribeOptions {
        start,
        ..Default::default()
    }
}

fn assert_exact(got: &[(u64, Bytes)], first: u64, expected: &BTreeMap<u64, Bytes>) {
    for (i, (o, p)) in got.iter().enumerate() {
        assert_eq!(
            *o,
            first + i as u64,
            "offsets contiguous, no gap, no duplicate"
        );
        assert_eq!(Some(p), expected.get(o), "bytes of offset {o}");
    }
}

#[test]
fn ack_after_commit_restart_history_and_resume() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(tempfile::tempdir().unwrap(), &[]);
    let expected = rt.block_on(async {
        let c = b.client().await;
        let info = c.describe_stream(&name("orders")).await.unwrap();
        assert!(info.durable && info.shards == 2);
        let mut expected = BTreeMap::new();
        for i in 0..100u64 {
            let ps: Vec<Bytes> = (0..5).map(|k| payload("o", i * 5 + k)).collect();
            let ack = c
                .publish_batch(&name("orders"), ShardSelector::Shard(0), ps.clone())
                .await
                .unwrap();
            assert_eq!(
                (ack.shard, ack.first_offset, ack.count),
                (0, i * 5, 5),
                "ack carries the offset"
            );
            for (k, p) in ps.into_iter().enumerate() {
                expected.insert(ack.first_offset + k as u64, p);
            }
        }
        let mut sub = c
            .subscribe(&name("orders"), 0, from(StartAt::Earliest))
            .await
            .unwrap();
        assert_exact(&collect(&mut sub, 500).await, 0, &expected);
        expected
    });
    // SIGKILL, restart on the same directory: every record at the same offset.
    let dir = b.kill();
    let b = start(dir, &[]);
    rt.block_on(async {
        let c = b.client().await;
        let mut sub = c
            .subscribe(&name("orders"), 0, from(StartAt::Earliest))
            .await
            .unwrap();
        assert_exact(&collect(&mut sub, 500).await, 0, &expected);
        let ack = c
            .publish_batch(
                &name("orders"),
                ShardSelector::Shard(0),
                vec![payload("o", 500)],
            )
            .await
            .unwrap();
        assert_eq!(ack.first_offset, 500, "numbering continues after restart");
        // Resume: read some, drop the subscription, resume at offset + 1 — exactly once.
        let mut sub = c
            .subscribe(&name("orders"), 0, from(StartAt::Offset(120)))
            .await
            .unwrap();
        let mut first = collect(&mut sub, 30).await;
        first.truncate(30); // a history chunk may carry more; resume from the 30th
        assert_eq!(first[0].0, 120);
        let last = first.last().unwrap().0;
        drop(sub);
        let mut sub = c
            .subscribe(&name("orders"), 0, from(StartAt::Offset(last + 1)))
            .await
            .unwrap();
        let rest = collect(&mut sub, (500 - last) as usize).await;
        assert_eq!(rest[0].0, last + 1);
        assert_eq!(rest.last().unwrap().0, 500);
        // Typed offset errors.
        let e = c
            .subscribe(&name("orders"), 0, from(StartAt::Offset(10_000)))
            .await
            .err()
            .expect("beyond the tail");
        assert_eq!(e.code(), Some(ErrorCode::InvalidRequest));
        assert!(e.to_string().contains("501"), "names the tail: {e}");
    });
    assert!(b.total("durable_records_committed") >= 1, "counters move");
}

/// Publish batches `range` of 10 records each to shard 0; what each acked offset holds.
async fn publish_batches(
    c: &Client,
    s: &StreamName,
    range: std::ops::Range<u64>,
) -> BTreeMap<u64, Bytes> {
    let mut acked = BTreeMap::new();
    for i in range {
        let ps: Vec<Bytes> = (0..10).map(|k| payload("l", i * 10 + k)).collect();
        let ack = c
            .publish_batch(s, ShardSelector::Shard(0), ps.clone())
            .await
            .unwrap();
        for (k, p) in ps.into_iter().enumerate() {
            acked.insert(ack.first_offset + k as u64, p);
        }
    }
    acked
}

/// A subscriber far behind reads history from disk while publishing continues, and joins
/// live delivery with no gap and no duplicate.
#[test]
fn history_joins_live_without_gap_or_duplicate() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(
        tempfile::tempdir().unwrap(),
        &["--history-fetch-bytes", "8192"],
    );
    rt.block_on(async {
        let c = b.client().await;
        let s = name("logs");
        let mut expected = publish_batches(&c, &s, 0..200).await;
        let mut sub = c.subscribe(&s, 0, from(StartAt::Earliest)).await.unwrap();
        // Keep publishing while the subscriber catches up.
        let pc = b.client().await;
        let s2 = s.clone();
        let publisher = tokio::spawn(async move { publish_batches(&pc, &s2, 200..400).await });
        let got = collect(&mut sub, 4000).await;
        expected.extend(publisher.await.unwrap());
        assert_eq!(expected.len(), 4000);
        assert_exact(&got, 0, &expected);
    });
    assert!(b.total("history_reads") > 2, "the catch-up read from disk");
}

#[test]
fn retention_and_offset_errors_are_typed() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(tempfile::tempdir().unwrap(), &[]);
    rt.block_on(async {
        let c = b.client().await;
        let s = name("small"); // retention 1 MiB, 1 MiB segments
        let big = Bytes::from(vec![7u8; 60_000]);
        let mut last = 0;
        for _ in 0..60 {
            last = c
                .publish_batch(&s, ShardSelector::Shard(0), vec![big.clone()])
                .await
                .unwrap()
                .first_offset;
        }
        // Retention runs after rolls and every second.
        let deadline = Instant::now() + WAIT;
        let oldest = loop {
            match c.subscribe(&s, 0, from(StartAt::Offset(0))).await {
                Err(e) if e.code() == Some(ErrorCode::RevisionTooOld) => break e.to_string(),
                Ok(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await
                }
                other => panic!("expected revision_too_old, got {:?}", other.map(|_| ())),
            }
        };
        assert!(oldest.contains("oldest retained offset is"), "{oldest}");
        let mut sub = c.subscribe(&s, 0, from(StartAt::Earliest)).await.unwrap();
        let got = collect(&mut sub, 1).await;
        assert!(
            got[0].0 > 0 && got[0].0 <= last,
            "earliest is the oldest retained record"
        );
    });
}

#[test]
fn durable_stream_without_storage_dir_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let cat = dir.path().join("catalog.yaml");
    std::fs::write(&cat, CATALOG).unwrap();
    let err = Broker::try_start_in(dir, 1, &["--catalog", cat.to_str().unwrap()])
        .err()
        .expect("must not start");
    assert!(err.contains("durable storage directory"), "{err}");
}

/// SIGKILL the broker at random points while acked publishes run on an on_commit and a
/// periodic stream; after each restart every acknowledged offset holds its exact bytes and
/// offsets are contiguous.
#[test]
fn sigkill_rounds_lose_no_acknowledged_record() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut dir = tempfile::tempdir().unwrap();
    let mut acked: BTreeMap<(String, u64), Bytes> = BTreeMap::new();
    let mut seq = 0u64;
    let mut seed = 0x9e37_79b9u64;
    for round in 0..10 {
        let b = start(dir, &[]);
        // Verify everything acknowledged so far survived the previous kill.
        rt.block_on(async {
            let c = b.client().await;
            for s in ["orders", "logs"] {
                let want: Vec<(u64, Bytes)> = acked
                    .iter()
                    .filter(|((n, _), _)| n == s)
                    .map(|((_, o), p)| (*o, p.clone()))
                    .collect();
                if want.is_empty() {
                    continue;
                }
                let mut sub = c
                    .subscribe(&name(s), 1, from(StartAt::Earliest))
                    .await
                    .unwrap();
                let top = want.last().unwrap().0;
                let got = collect(&mut sub, top as usize + 1).await;
                for (i, (o, _)) in got.iter().enumerate() {
                    assert_eq!(*o, i as u64, "round {round} {s}: offsets contiguous");
                }
                for (o, p) in &want {
                    assert_eq!(
                        &got[*o as usize].1, p,
                        "round {round} {s}: acked offset {o} intact"
                    );
                }
            }
        });
        // Publish; SIGKILL after a random 50..350 ms while publishes are in flight.
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let run_ms = 50 + (seed >> 33) % 300;
        let c = rt.block_on(b.client());
        let killer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(run_ms));
            b.kill()
        });
        let results = rt.block_on(async {
            // Bounded: the kill ends the loop; the deadline and count are a backstop.
            let stop = Instant::now() + Duration::from_millis(run_ms + 10_000);
            let mut tasks = Vec::new();
            for s in ["orders", "logs"] {
                let p = c.publisher();
                let base = seq;
                tasks.push(tokio::spawn(async move {
                    let mut out = Vec::new();
                    let mut failed = false;
                    let mut i = 0u64;
                    while Instant::now() < stop && i < 100_000 {
                        let pl = payload(s, base + i);
                        match tokio::time::timeout(
                            Duration::from_millis(300),
                            p.publish_batch(&name(s), ShardSelector::Shard(1), vec![pl.clone()]),
                        )
                        .await
                        {
                            Ok(Ok(ack)) => out.push((s.to_string(), ack.first_offset, pl)),
                            _ => {
                                failed = true;
                                break;
                            }
                        }
                        i += 1;
                    }
                    (out, failed)
                }));
            }
            let mut all = Vec::new();
            for t in tasks {
                let (out, failed) = t.await.unwrap();
                assert!(failed, "the kill interrupted publishing");
                all.extend(out);
            }
            all
        });
        drop(c);
        seq += 1_000_000;
        for (s, o, p) in results {
            assert!(
                acked.insert((s, o), p).is_none(),
                "an offset acknowledged twice"
            );
        }
        dir = killer.join().unwrap();
    }
    eprintln!(
        "{} acknowledged records across 10 SIGKILL rounds",
        acked.len()
    );
    assert!(
        acked.len() > 100,
        "the rounds published something: {}",
        acked.len()
    );
}

fn last_segment(d: &Path) -> std::path::PathBuf {
    let (bases, _) = felix_storage::log::list_log_dir(d).unwrap();
    d.join(felix_storage::segment::segment_file_name(
        *bases.last().expect("a segment"),
    ))
}

fn inspect(dir: &Path, json: bool) -> (i32, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_felix-broker"));
    cmd.args(["inspect", "segments"]).arg(dir);
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn inspect_reports_clean_repair_and_corrupt() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(tempfile::tempdir().unwrap(), &[]);
    rt.block_on(async {
        let c = b.client().await;
        for i in 0..20u64 {
            c.publish_batch(
                &name("orders"),
                ShardSelector::Shard(0),
                vec![payload("i", i)],
            )
            .await
            .unwrap();
        }
    });
    let root = durable_dir(&b);
    let shard = root.join("default/default/orders/00000");
    let before = std::fs::read(last_segment(&shard)).unwrap();
    let dir = b.kill();
    let root = dir.path().join("durable");
    let (code, out) = inspect(&root, true);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("\"startup\":\"clean\""), "{out}");
    // Format version 2, every record of generation 0 (the stream is not replicated).
    assert!(
        out.contains("\"version\":2,\"generations\":[\"0@0\"]"),
        "{out}"
    );
    let (code, _) = inspect(&shard, false);
    assert_eq!(code, 0);
    let seg = last_segment(&shard);
    // Read-only: inspect changed nothing.
    assert_eq!(std::fs::read(&seg).unwrap(), before);
    let commits: Vec<usize> = (4096..before.len())
        .step_by(4096)
        .filter(|p| &before[*p..p + 4] == b"FXC2")
        .collect();
    assert!(commits.len() >= 2, "one commit per acked publish");
    // Torn tail: the last commit cut short.
    let mut torn = before.clone();
    torn.truncate(commits[commits.len() - 1] + 48);
    std::fs::write(&seg, &torn).unwrap();
    let (code, out) = inspect(&root, false);
    assert_eq!(code, 6, "{out}");
    assert!(out.contains("repair"), "{out}");
    // Corruption in the middle: a flipped byte in the first commit.
    let mut bad = before.clone();
    bad[commits[0] + 50] ^= 0x40;
    std::fs::write(&seg, &bad).unwrap();
    let (code, out) = inspect(&root, false);
    assert_eq!(code, 7, "{out}");
    assert!(out.contains("refuse"), "{out}");
    // The broker agrees: that shard refuses to serve, the other shard still does.
    let b = start(dir, &[]);
    rt.block_on(async {
        let c = b.client().await;
        let e = c
            .publish_batch(
                &name("orders"),
                ShardSelector::Shard(0),
                vec![Bytes::from_static(b"x")],
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::Unavailable), "{e}");
        c.publish_batch(
            &name("orders"),
            ShardSelector::Shard(1),
            vec![Bytes::from_static(b"x")],
        )
        .await
        .unwrap();
    });
    assert_eq!(b.total("durable_shards_failed"), 1);
}

/// SIGTERM during acked publishing: the broker exits cleanly (code 0) within its drain
/// budget; every publish ends, acknowledged or refused with `shutting_down` (a typed refusal,
/// or the connection closed with that code for publishes sent after the drain finished);
/// after a restart every acknowledged record is there with its bytes and offsets.
/// (The fsync at close is not observable here: a process exit keeps the page cache.)
#[test]
fn sigterm_drains_acked_publishes_and_exits_clean() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(
        tempfile::tempdir().unwrap(),
        &["--drain-timeout-ms", "4000"],
    );
    let s = name("logs");
    let acked: BTreeMap<u64, Bytes> = rt.block_on(async {
        let c = b.client().await;
        let publisher = c.publisher();
        let mut acked = BTreeMap::new();
        let deadline = Instant::now() + WAIT;
        let mut i = 0u64;
        let mut signalled = false;
        let mut tasks = tokio::task::JoinSet::new();
        // 8 publishers in flight; SIGTERM once 400 are acknowledged.
        loop {
            while tasks.len() < 8 {
                let publisher = publisher.clone();
                let s = s.clone();
                let p = payload("drain", i);
                i += 1;
                tasks.spawn(async move {
                    let r = publisher
                        .publish_batch(&s, ShardSelector::Shard(0), vec![p.clone()])
                        .await;
                    (p, r)
                });
            }
            let (p, r) = tasks.join_next().await.unwrap().unwrap();
            match r {
                Ok(a) => {
                    acked.insert(a.first_offset, p);
                }
                Err(e) => {
                    assert!(signalled, "an error before the signal: {e}");
                    assert_shutdown_answer(&e);
                    break;
                }
            }
            if acked.len() == 400 && !signalled {
                b.signal(libc::SIGTERM);
                signalled = true;
            }
            assert!(Instant::now() < deadline, "publishing never ended");
        }
        // The rest end too, each acknowledged or refused.
        while let Some(j) = tasks.join_next().await {
            match j.unwrap() {
                (p, Ok(a)) => {
                    acked.insert(a.first_offset, p);
                }
                (_, Err(e)) => assert_shutdown_answer(&e),
            }
        }
        acked
    });
    let (code, dir) = b.wait_exit(Duration::from_secs(10));
    assert_eq!(code, Some(0), "clean exit after the drain");
    assert!(acked.len() >= 400);
    let b = start(dir, &[]);
    rt.block_on(async {
        let c = b.client().await;
        let mut sub = c.subscribe(&s, 0, from(StartAt::Earliest)).await.unwrap();
        let last = *acked.keys().last().unwrap();
        let got = collect(&mut sub, last as usize + 1).await;
        for (o, p) in &acked {
            assert_eq!(
                Some(p),
                got.get(*o as usize).map(|(_, p)| p),
                "acked offset {o}"
            );
        }
        assert_exact(&got, 0, &got.iter().cloned().collect());
    });
}

fn assert_shutdown_answer(e: &felix_client::Error) {
    let closed_shutting_down = matches!(e, felix_client::Error::Closed(m) if m.contains("code 22"));
    assert!(
        e.code() == Some(ErrorCode::ShuttingDown) || closed_shutting_down,
        "unexpected answer during shutdown: {e}"
    );
}

/// `/metrics` parsed with a Prometheus text parser during a real run: counters move by exactly
/// what was published, delivered and committed; the commit latency histogram counts every
/// durable publish.
#[test]
fn metrics_move_by_the_right_amounts() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(tempfile::tempdir().unwrap(), &[]);
    let scrape = || {
        let http = b.http_get("/metrics");
        let body = http.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or(&http);
        prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string())))
            .expect("Prometheus text")
    };
    let total = |m: &prometheus_parse::Scrape, name: &str| -> f64 {
        m.samples
            .iter()
            .filter(|x| x.metric == name)
            .map(|x| match &x.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => *v,
                prometheus_parse::Value::Histogram(h) => h
                    .iter()
                    .find(|b| b.less_than.is_infinite())
                    .map(|b| b.count)
                    .unwrap_or(0.0),
                other => panic!("{name}: {other:?}"),
            })
            .sum()
    };
    let before = scrape();
    rt.block_on(async {
        let c = b.client().await;
        let mut sub = c
            .subscribe(&name("events"), 0, from(StartAt::Latest))
            .await
            .unwrap();
        for i in 0..50 {
            c.publish_batch(
                &name("events"),
                ShardSelector::Shard(0),
                vec![payload("m", i)],
            )
            .await
            .unwrap();
        }
        for i in 0..30 {
            c.publish_batch(
                &name("orders"),
                ShardSelector::Shard(1),
                vec![payload("d", i)],
            )
            .await
            .unwrap();
        }
        assert_eq!(collect(&mut sub, 50).await.len(), 50);
    });
    let after = scrape();
    let d = |n: &str| total(&after, n) - total(&before, n);
    assert_eq!(d("felix_publishes_received"), 80.0);
    assert_eq!(d("felix_records_appended"), 80.0);
    assert_eq!(d("felix_durable_records_committed"), 30.0);
    assert_eq!(d("felix_records_delivered"), 50.0);
    assert_eq!(d("felix_durable_commit_seconds"), 30.0);
    // on_commit: at least one fdatasync per commit of `orders` (commits may cover several).
    assert!(d("felix_fsync_seconds") >= 1.0, "fsync latency observed");
    // The per-shard histogram carries the stream and shard: the 30 went to orders/1.
    let shard_count = |m: &prometheus_parse::Scrape, shard: &str| -> f64 {
        m.samples
            .iter()
            .filter(|x| {
                x.metric == "felix_shard_commit_seconds"
                    && x.labels.get("stream") == Some("default/default/orders")
                    && x.labels.get("shard") == Some(shard)
            })
            .map(|x| match &x.value {
                prometheus_parse::Value::Histogram(h) => h
                    .iter()
                    .find(|b| b.less_than.is_infinite())
                    .map(|b| b.count)
                    .unwrap_or(0.0),
                other => panic!("{other:?}"),
            })
            .sum()
    };
    assert_eq!(shard_count(&after, "1") - shard_count(&before, "1"), 30.0);
    assert_eq!(shard_count(&after, "0"), 0.0);
    assert_eq!(d("felix_subscriptions_opened"), 1.0);
    assert_eq!(d("felix_publish_acks"), 80.0);
    // payload(tag, i) is 10 + i % 200 bytes: 50 of "m" and 30 of "d".
    let bytes: u64 = (0..50u64).chain(0..30).map(|i| 10 + i % 200).sum();
    assert_eq!(d("felix_bytes_appended"), bytes as f64);
    assert!(
        d("felix_bytes_delivered") > 50.0 * 10.0,
        "delivery frames carry the payloads"
    );
}

/// An inline page-cache write slower than `--durable-inline-write-slow-us` is counted and
/// sends the core's commits through io_uring; every publish is still acknowledged and read
/// back in order. (A 1 µs threshold: copying a 64 KiB commit into the page cache takes
/// longer, so the first inline write stalls by definition.)
#[test]
fn a_slow_inline_write_is_counted_and_loses_nothing() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(
        tempfile::tempdir().unwrap(),
        &["--durable-inline-write-slow-us", "1"],
    );
    assert_eq!(b.total("durable_inline_write_stalls"), 0);
    let big = |i: u64| Bytes::from(vec![b'a' + (i % 26) as u8; 64 << 10]);
    rt.block_on(async {
        let c = b.client().await;
        for i in 0..20u64 {
            let ack = c
                .publish_batch(&name("logs"), ShardSelector::Shard(0), vec![big(i)])
                .await
                .unwrap();
            assert_eq!(ack.first_offset, i, "offsets contiguous");
        }
        let mut sub = c
            .subscribe(&name("logs"), 0, from(StartAt::Earliest))
            .await
            .unwrap();
        let got = collect(&mut sub, 20).await;
        for (i, (off, p)) in got.iter().enumerate() {
            assert_eq!((*off, p), (i as u64, &big(i as u64)));
        }
        c.close().await.unwrap();
    });
    until("an inline-write stall counted", &|| {
        b.total("durable_inline_write_stalls") > 0
    });
}

/// Wait until `f` holds (metrics gauges refresh about once a second); fails after 30 s.
fn until(what: &str, f: &dyn Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The queue gauges: a stalled subscriber's queued records show in
/// `felix_sub_queue_records` (refreshed about once a second), open subscriptions and watches
/// are counted, and all fall back to zero once they close.
#[test]
fn queue_gauges_show_a_stalled_subscriber_and_open_watches() {
    use felix_client::{WatchFilter, WatchOptions, WatchStart};
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(tempfile::tempdir().unwrap(), &[]);
    rt.block_on(async {
        // Its own stream (no subscription mux), so the broker's queue fills behind it.
        let mut cfg = b.client_config();
        cfg.sub_mux = false;
        let c = felix_client::Client::connect(cfg).await.unwrap();
        let stalled = SubscribeOptions {
            buffer_events: 1,
            ..from(StartAt::Latest)
        };
        let _sub = c.subscribe(&name("events"), 0, stalled).await.unwrap();
        let w = c
            .cache_watch(
                &StreamName::new("default", "default", "kv"),
                WatchFilter::Key("k".into()),
                WatchStart::Latest,
                WatchOptions::default(),
            )
            .await
            .unwrap();
        // 24 MB of 4 KiB records: past the subscription stream's 16 MiB window, so the
        // broker-side queue fills behind it.
        let big = Bytes::from(vec![b'x'; 4096]);
        for _ in 0..(24 << 20) / (4096 * 64) {
            c.publish_batch(
                &name("events"),
                ShardSelector::Shard(0),
                vec![big.clone(); 64],
            )
            .await
            .unwrap();
        }
        until("queued records show", &|| b.total("sub_queue_records") > 0);
        assert!(b.total("sub_queue_bytes") >= 4096 * b.total("sub_queue_records"));
        assert_eq!(b.total("subscriptions_open"), 1);
        assert!(b.total("connections_open") >= 1);
        assert_eq!(b.total("cache_watches_open"), 1);
        drop(w);
        until("the watch closed", &|| b.total("cache_watches_open") == 0);
        c.close().await.unwrap();
    });
    until("gauges back to zero", &|| {
        b.total("subscriptions_open") == 0
            && b.total("sub_queue_records") == 0
            && b.total("connections_open") == 0
    });
}

/// The going-away notice: on SIGTERM every subscription ends with `SubEnd { shutting_down }`
/// and every cache watch with `CacheWatchEnd { shutting_down }` on its own stream before the
/// connection closes, and the broker exits cleanly.
#[test]
fn sigterm_tells_subscribers_and_watchers_the_broker_is_going_away() {
    use felix_client::{WatchFilter, WatchItem, WatchOptions, WatchStart};
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(tempfile::tempdir().unwrap(), &[]);
    rt.block_on(async {
        let c = b.client().await;
        let mut subs = Vec::new();
        for shard in 0..2 {
            subs.push(
                c.subscribe(&name("events"), shard, from(StartAt::Latest))
                    .await
                    .unwrap(),
            );
        }
        let mut w = c
            .cache_watch(
                &StreamName::new("default", "default", "kv"),
                WatchFilter::Key("k".into()),
                WatchStart::Current,
                WatchOptions::default(),
            )
            .await
            .unwrap();
        match w.next_timeout(WAIT).await.unwrap() {
            Some(WatchItem::StateDone { count: 0, .. }) => {}
            other => panic!("{other:?}"),
        }
        b.signal(libc::SIGTERM);
        for sub in &mut subs {
            match sub.next_timeout(WAIT).await.unwrap() {
                Some(Event::End { code, .. }) => assert_eq!(code, ErrorCode::ShuttingDown.number()),
                other => panic!("expected the going-away end, got {other:?}"),
            }
        }
        match w.next_timeout(WAIT).await.unwrap() {
            Some(WatchItem::End { code, .. }) => assert_eq!(code, ErrorCode::ShuttingDown.number()),
            other => panic!("expected the going-away end, got {other:?}"),
        }
    });
    let (code, _) = b.wait_exit(Duration::from_secs(10));
    assert_eq!(code, Some(0));
}

//! Consumer groups through the real broker binary: competing consumers (2 and 10, each on
//! its own connection, polling every shard from one call), redelivery after the visibility
//! timeout, dead letters after max_attempts (list, redrive, discard), stale_claim for late
//! answers, a consumer that vanishes mid-claim, long polls, answers kept under the frame
//! bound, history read from disk, and SIGKILL + restart keeping cursor and dead letters.
//! Every loop is bounded by count and time.

mod common;

use bytes::Bytes;
use common::Broker;
use felix_client::{ClaimId, Client, DeadLetterAction, GroupOptions, GroupRecord};
use felix_quic::wire::{ErrorCode, ShardSelector, StartAt, StreamName};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(30);

const CATALOG: &str = "streams:
  - {tenant: default, namespace: default, stream: jobs, shards: 2, durable: true, fsync: on_commit}
  - {tenant: default, namespace: default, stream: one, shards: 1, durable: true, fsync: periodic}
  - {tenant: default, namespace: default, stream: events, shards: 1}
  - {tenant: default, namespace: default, stream: small, shards: 1, durable: true, fsync: none, retention_bytes: 1048576}
";

fn name(s: &str) -> StreamName {
    StreamName::new("default", "default", s)
}

fn start(dir: tempfile::TempDir, extra: &[&str]) -> Broker {
    let cat = dir.path().join("catalog.yaml");
    std::fs::write(&cat, CATALOG).unwrap();
    let durable = dir.path().join("durable");
    let mut args = vec![
        "--catalog".to_string(),
        cat.display().to_string(),
        "--durable-storage-dir".to_string(),
        durable.display().to_string(),
        // A small tail cache, so older claims are read from disk.
        "--ring-records-max".to_string(),
        "32".to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Broker::start_in(dir, 2, &args)
}

fn payload(shard: u32, i: u64) -> Bytes {
    Bytes::from(format!("job-{shard}-{i:06}"))
}

/// Publish `n` records to each shard of `stream`; `(shard, offset) → payload`.
async fn publish(c: &Client, stream: &str, shards: u32, n: u64) -> BTreeMap<(u32, u64), Bytes> {
    let mut out = BTreeMap::new();
    for s in 0..shards {
        for chunk in 0..n.div_ceil(50) {
            let ps: Vec<Bytes> = (chunk * 50..((chunk + 1) * 50).min(n))
                .map(|i| payload(s, i))
                .collect();
            let ack = c
                .publish_batch(&name(stream), ShardSelector::Shard(s), ps.clone())
                .await
                .unwrap();
            for (k, p) in ps.into_iter().enumerate() {
                out.insert((s, ack.first_offset + k as u64), p);
            }
        }
    }
    out
}

fn opts(max_attempts: u32, vt_ms: u64) -> GroupOptions {
    GroupOptions {
        start: StartAt::Earliest,
        max_attempts,
        visibility_timeout_ms: vt_ms,
    }
}

fn code(e: &felix_client::Error) -> Option<ErrorCode> {
    e.code()
}

/// `consumers` competing consumers, each on its own connection, poll the group across both
/// shards and ack everything: every record is processed exactly once (claims are long, so
/// nothing lapses), payloads match, and the cursor reaches the tail on every shard.
async fn competing(b: &Broker, group: &str, consumers: usize, per_shard: u64) {
    let c = b.client().await;
    // Created before the records: it starts at the tail (earlier runs' records excluded).
    let start = GroupOptions {
        start: StartAt::Latest,
        ..opts(5, 60_000)
    };
    c.group_create(&name("jobs"), group, None, start)
        .await
        .unwrap();
    let expected = publish(&c, "jobs", 2, per_shard).await;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(BTreeMap::<(u32, u64), Bytes>::new()));
    let total = expected.len();
    let mut tasks = Vec::new();
    for k in 0..consumers {
        let cfg = b.client_config();
        let seen = seen.clone();
        let group = group.to_string();
        tasks.push(tokio::spawn(async move {
            let c = Client::connect(cfg).await.unwrap();
            let mut cons = c.group_consumer(&name("jobs"), &group).await.unwrap();
            let deadline = Instant::now() + WAIT;
            let mut mine = 0usize;
            loop {
                assert!(Instant::now() < deadline, "consumer {k} timed out");
                if seen.lock().unwrap().len() >= total {
                    break;
                }
                let recs = cons
                    .poll(7, None, Duration::from_millis(200))
                    .await
                    .unwrap();
                let ids: Vec<ClaimId> = recs.iter().map(GroupRecord::claim).collect();
                for r in &recs {
                    assert_eq!(r.attempt, 1, "nothing lapses with 60 s claims");
                    let dup = seen
                        .lock()
                        .unwrap()
                        .insert((r.shard, r.offset), r.payload.clone());
                    assert!(dup.is_none(), "{} handed out twice", r.claim());
                }
                mine += recs.len();
                for r in c.group_ack(&name("jobs"), &group, &ids).await.unwrap() {
                    r.unwrap();
                }
            }
            drop(cons);
            c.close().await.unwrap();
            mine
        }));
    }
    let mut counts = Vec::new();
    for t in tasks {
        counts.push(t.await.unwrap());
    }
    assert_eq!(counts.iter().sum::<usize>(), total);
    assert_eq!(
        *seen.lock().unwrap(),
        expected,
        "every record, its own payload"
    );
    for (shard, info) in c.group_describe(&name("jobs"), group, None).await.unwrap() {
        assert_eq!(info.cursor, info.tail, "shard {shard} cursor at the tail");
        assert_eq!((info.in_flight, info.dead_letters), (0, 0));
    }
}

#[test]
fn two_and_ten_competing_consumers_process_every_record_once() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(tempfile::tempdir().unwrap(), &[]);
    rt.block_on(async {
        competing(&b, "two", 2, 150).await;
        competing(&b, "ten", 10, 150).await;
    });
    assert!(b.total("group_acks") >= 600);
    assert_eq!(b.total("group_stale_answers"), 0);
}

#[test]
fn redelivery_dead_letters_and_stale_claims() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(tempfile::tempdir().unwrap(), &[]);
    rt.block_on(async {
        let c = b.client().await;
        let s = name("one");
        publish(&c, "one", 1, 3).await;
        c.group_create(&s, "g", None, opts(2, 300)).await.unwrap();
        let poll = |max| c.group_poll(&s, "g", 0, max, None, Duration::ZERO);
        let first = poll(1).await.unwrap();
        assert_eq!((first[0].offset, first[0].attempt), (0, 1));
        // Unanswered: delivered again after the visibility timeout (first, being the lowest
        // offset), with its attempt count.
        tokio::time::sleep(Duration::from_millis(400)).await;
        let again = poll(1).await.unwrap();
        assert_eq!(again[0].offset, 0);
        assert_eq!(again[0].attempt, 2);
        // A late answer naming the first delivery is refused.
        let late = c.group_ack(&s, "g", &[first[0].claim()]).await.unwrap();
        assert_eq!(
            late[0].as_ref().err().and_then(code),
            Some(ErrorCode::StaleClaim)
        );
        // Past max_attempts (2) the record is dead-lettered and not handed out again.
        tokio::time::sleep(Duration::from_millis(400)).await;
        let page = c.dead_letters(&s, "g", 0, None, 10).await.unwrap();
        assert_eq!(page.letters.len(), 1, "{page:?}");
        assert_eq!((page.letters[0].offset, page.letters[0].attempts), (0, 2));
        assert_eq!(page.letters[0].reason, 0, "expired");
        let rest = poll(10).await.unwrap();
        assert!(rest.iter().all(|r| r.offset != 0), "{rest:?}");
        // Reject → dead letter at once; nack → delivered again.
        let ids: Vec<ClaimId> = rest.iter().map(GroupRecord::claim).collect();
        for r in c.group_reject(&s, "g", &ids).await.unwrap() {
            r.unwrap();
        }
        let info = &c.group_describe(&s, "g", None).await.unwrap()[0].1;
        assert_eq!(info.cursor, 3, "dead letters do not hold the cursor");
        // Redrive: out again with a fresh budget and the numbering continued; ack clears it.
        c.dead_letter_op(&s, "g", 0, 0, DeadLetterAction::Redrive)
            .await
            .unwrap();
        let red = poll(1).await.unwrap();
        assert_eq!((red[0].offset, red[0].attempt), (0, 3));
        let n = c.group_nack(&s, "g", &[red[0].claim()], 0).await.unwrap();
        n[0].clone().unwrap();
        let red2 = poll(1).await.unwrap();
        assert_eq!((red2[0].offset, red2[0].attempt), (0, 4));
        c.group_ack(&s, "g", &[red2[0].claim()]).await.unwrap()[0]
            .clone()
            .unwrap();
        // Discard the others; discarding twice is not_found.
        let page = c.dead_letters(&s, "g", 0, None, 10).await.unwrap();
        let offs: Vec<u64> = page.letters.iter().map(|l| l.offset).collect();
        assert_eq!(offs, rest.iter().map(|r| r.offset).collect::<Vec<_>>());
        for o in &offs {
            c.dead_letter_op(&s, "g", 0, *o, DeadLetterAction::Discard)
                .await
                .unwrap();
        }
        let e = c
            .dead_letter_op(&s, "g", 0, offs[0], DeadLetterAction::Discard)
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::NotFound));
        assert!(c
            .dead_letters(&s, "g", 0, None, 10)
            .await
            .unwrap()
            .letters
            .is_empty());
        // Extend keeps a claim past its original deadline.
        publish(&c, "one", 1, 1).await;
        let r = poll(1).await.unwrap();
        tokio::time::sleep(Duration::from_millis(150)).await;
        c.group_extend(&s, "g", &[r[0].claim()], 5_000)
            .await
            .unwrap()[0]
            .clone()
            .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            poll(1).await.unwrap().is_empty(),
            "extended claim still holds"
        );
        c.group_ack(&s, "g", &[r[0].claim()]).await.unwrap()[0]
            .clone()
            .unwrap();
    });
    assert!(b.total("group_redeliveries") >= 2);
    assert!(b.total("group_stale_answers") >= 1);
}

#[test]
fn a_vanished_consumers_claims_go_to_the_others_and_long_polls_wait() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(tempfile::tempdir().unwrap(), &[]);
    rt.block_on(async {
        let c = b.client().await;
        let s = name("jobs");
        publish(&c, "jobs", 2, 10).await;
        c.group_create(&s, "g", None, opts(5, 500)).await.unwrap();
        // A consumer claims everything and disappears without answering.
        {
            let gone = b.client().await;
            let mut cons = gone.group_consumer(&s, "g").await.unwrap();
            let got = cons.poll(100, None, Duration::ZERO).await.unwrap();
            assert_eq!(got.len(), 20);
            drop(cons);
            drop(gone);
        }
        let mut cons = c.group_consumer(&s, "g").await.unwrap();
        assert!(cons
            .poll(100, None, Duration::ZERO)
            .await
            .unwrap()
            .is_empty());
        // Its claims lapse; the long poll wakes for them.
        let mut got = BTreeSet::new();
        let deadline = Instant::now() + WAIT;
        while got.len() < 20 {
            assert!(Instant::now() < deadline);
            let recs = cons.poll(100, None, Duration::from_secs(5)).await.unwrap();
            for r in &recs {
                assert_eq!(r.attempt, 2);
                got.insert((r.shard, r.offset));
            }
            let ids: Vec<ClaimId> = recs.iter().map(GroupRecord::claim).collect();
            c.group_ack(&s, "g", &ids).await.unwrap();
        }
        // A long poll across shards returns the record published while it waits, on
        // whichever shard it lands.
        for shard in [1u32, 0] {
            let pc = b.client().await;
            let t = tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                pc.publish_batch(
                    &name("jobs"),
                    ShardSelector::Shard(shard),
                    vec![Bytes::from("late")],
                )
                .await
                .unwrap();
                pc
            });
            let recs = cons.poll(10, None, Duration::from_secs(20)).await.unwrap();
            assert_eq!(recs.len(), 1, "{recs:?}");
            assert_eq!((recs[0].shard, &recs[0].payload[..]), (shard, &b"late"[..]));
            c.group_ack(&s, "g", &[recs[0].claim()]).await.unwrap()[0]
                .clone()
                .unwrap();
            t.await.unwrap().close().await.unwrap();
        }
        // A long poll with nothing to come ends empty once its wait is over.
        let t0 = Instant::now();
        let none = c
            .group_poll(&s, "g", 0, 10, None, Duration::from_millis(300))
            .await
            .unwrap();
        assert!(none.is_empty());
        assert!(t0.elapsed() >= Duration::from_millis(250), "it waited");
    });
}

#[test]
fn typed_refusals() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(tempfile::tempdir().unwrap(), &[]);
    rt.block_on(async {
        let c = b.client().await;
        let s = name("jobs");
        let e = c
            .group_create(&name("events"), "g", None, GroupOptions::default())
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::InvalidRequest), "{e}");
        let e = c
            .group_create(&s, "bad/name", None, GroupOptions::default())
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::InvalidName));
        let e = c
            .group_poll(&s, "nope", 0, 1, None, Duration::ZERO)
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::NotFound));
        let e = c
            .group_create(&s, "g", Some(9), GroupOptions::default())
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::UnknownShard));
        c.group_create(&s, "g", None, GroupOptions::default())
            .await
            .unwrap();
        let e = c
            .group_create(&s, "g", Some(0), GroupOptions::default())
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::AlreadyExists));
        let e = c
            .group_poll(&s, "g", 0, 0, None, Duration::ZERO)
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::InvalidRequest), "poll max 0");
        let e = c
            .group_create(
                &s,
                "h",
                Some(0),
                GroupOptions {
                    start: StartAt::Offset(99),
                    ..GroupOptions::default()
                },
            )
            .await
            .unwrap_err();
        assert_eq!(
            e.code(),
            Some(ErrorCode::InvalidRequest),
            "beyond the tail: {e}"
        );
        c.group_delete(&s, "g", None).await.unwrap();
        let e = c.group_describe(&s, "g", Some(1)).await.unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::NotFound));
        // Deleted means gone: created again, it starts over.
        c.group_create(&s, "g", None, GroupOptions::default())
            .await
            .unwrap();
    });
}

#[test]
fn answers_stay_under_the_frame_bound_and_old_claims_come_from_disk() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(
        tempfile::tempdir().unwrap(),
        &["--max-frame-bytes", "65536", "--max-payload-bytes", "16384"],
    );
    rt.block_on(async {
        let c = b.client().await;
        let s = name("one");
        let mut expected = Vec::new();
        for i in 0..40u64 {
            let p = Bytes::from(vec![(i % 251) as u8; 10_000]);
            c.publish_batch(&s, ShardSelector::Shard(0), vec![p.clone()])
                .await
                .unwrap();
            expected.push(p);
        }
        c.group_create(&s, "g", None, opts(1, 60_000))
            .await
            .unwrap();
        let mut next = 0u64;
        let deadline = Instant::now() + WAIT;
        while next < 40 {
            assert!(Instant::now() < deadline);
            let recs = c
                .group_poll(&s, "g", 0, 100, None, Duration::ZERO)
                .await
                .unwrap();
            assert!(
                !recs.is_empty() && recs.len() <= 6,
                "{} records in 64 KiB",
                recs.len()
            );
            for r in &recs {
                assert_eq!(r.offset, next, "in order, none skipped");
                assert_eq!(r.payload, expected[next as usize], "offset {next} bytes");
                next += 1;
            }
            let ids: Vec<ClaimId> = recs.iter().map(GroupRecord::claim).collect();
            for r in c.group_ack(&s, "g", &ids).await.unwrap() {
                r.unwrap();
            }
        }
        // Records released for lack of room were not counted as deliveries: max_attempts
        // is 1, yet nothing was dead-lettered.
        assert!(c
            .dead_letters(&s, "g", 0, None, 10)
            .await
            .unwrap()
            .letters
            .is_empty());
    });
    assert!(
        b.total("history_reads") > 0,
        "claims beyond the tail cache read from disk"
    );
}

#[test]
fn sigkill_and_restart_keep_cursor_and_dead_letters() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(tempfile::tempdir().unwrap(), &[]);
    let s = name("jobs");
    rt.block_on(async {
        let c = b.client().await;
        publish(&c, "jobs", 1, 100).await;
        c.group_create(&s, "g", Some(0), opts(3, 60_000))
            .await
            .unwrap();
        let mut acked = 0;
        while acked < 60 {
            let recs = c
                .group_poll(&s, "g", 0, 10, None, Duration::ZERO)
                .await
                .unwrap();
            let (dead, ok): (Vec<_>, Vec<_>) = recs.iter().partition(|r| r.offset == 5);
            let ok: Vec<ClaimId> = ok.iter().map(|r| r.claim()).collect();
            for r in c.group_ack(&s, "g", &ok).await.unwrap() {
                r.unwrap();
            }
            let dead: Vec<ClaimId> = dead.iter().map(|r| r.claim()).collect();
            for r in c.group_reject(&s, "g", &dead).await.unwrap() {
                r.unwrap();
            }
            acked += recs.len();
        }
        // Claimed, not answered: delivered again after the restart.
        let open = c
            .group_poll(&s, "g", 0, 5, None, Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(open[0].offset, 60);
    });
    let b = start(b.kill(), &[]);
    rt.block_on(async {
        let c = b.client().await;
        let info = &c.group_describe(&s, "g", Some(0)).await.unwrap()[0].1;
        assert_eq!(info.cursor, 60, "every acked record stays finished");
        assert_eq!(info.dead_letters, 1);
        let page = c.dead_letters(&s, "g", 0, None, 10).await.unwrap();
        assert_eq!((page.letters[0].offset, page.letters[0].reason), (5, 2));
        let mut offsets = Vec::new();
        let deadline = Instant::now() + WAIT;
        while offsets.len() < 40 {
            assert!(Instant::now() < deadline);
            let recs = c
                .group_poll(&s, "g", 0, 10, None, Duration::ZERO)
                .await
                .unwrap();
            offsets.extend(recs.iter().map(|r| r.offset));
            let ids: Vec<ClaimId> = recs.iter().map(GroupRecord::claim).collect();
            c.group_ack(&s, "g", &ids).await.unwrap();
        }
        assert_eq!(
            offsets,
            (60..100).collect::<Vec<_>>(),
            "no acked record again"
        );
        assert!(c
            .group_poll(&s, "g", 0, 10, None, Duration::ZERO)
            .await
            .unwrap()
            .is_empty());
    });
}

#[test]
fn felixctl_group_commands() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(tempfile::tempdir().unwrap(), &[]);
    let ctl = |args: &[&str]| b.felixctl(args);
    let ok = common::ok;
    rt.block_on(async {
        let c = b.client().await;
        publish(&c, "jobs", 2, 3).await;
    });
    ok(ctl(&[
        "group",
        "create",
        "jobs",
        "g",
        "--max-attempts",
        "2",
    ]));
    let out = ok(ctl(&[
        "--json", "group", "poll", "jobs", "g", "--max", "10",
    ]));
    let claims: Vec<String> = out
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["claim"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(claims.len(), 6, "{out}");
    let (first, rest) = claims.split_first().unwrap();
    let mut args = vec!["group", "ack", "jobs", "g"];
    args.extend(rest.iter().map(String::as_str));
    ok(ctl(&args));
    ok(ctl(&["group", "reject", "jobs", "g", first]));
    // A second answer to the same delivery is refused (exit 1, stale_claim).
    let o = ctl(&["group", "ack", "jobs", "g", first]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stdout).contains("stale_claim"));
    let shard: u32 = first.split(':').next().unwrap().parse().unwrap();
    let offset: u64 = first.split(':').nth(1).unwrap().parse().unwrap();
    let ls = ok(ctl(&["group", "dead-letters", "ls", "jobs", "g"]));
    assert!(
        ls.contains(&format!("{shard}:{offset} attempts 1 rejected")),
        "{ls}"
    );
    let desc = ok(ctl(&["--json", "group", "describe", "jobs", "g"]));
    for l in desc.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert_eq!(v["cursor"], 3, "{l}");
    }
    // Destructive commands need --yes without a terminal.
    let o = ctl(&[
        "group",
        "dead-letters",
        "discard",
        "jobs",
        "g",
        "--shard",
        &shard.to_string(),
        &offset.to_string(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    let o = ctl(&["group", "seek", "jobs", "g", "earliest"]);
    assert_eq!(o.status.code(), Some(2), "a backward seek asks");
    ok(ctl(&[
        "--yes",
        "group",
        "dead-letters",
        "discard",
        "jobs",
        "g",
        "--shard",
        &shard.to_string(),
        &offset.to_string(),
    ]));
    assert_eq!(ok(ctl(&["group", "dead-letters", "ls", "jobs", "g"])), "");
    assert_eq!(
        ctl(&["group", "ack", "jobs", "g", "0:1"]).status.code(),
        Some(2),
        "malformed claim"
    );
    assert_eq!(ctl(&["group", "rm", "jobs", "g"]).status.code(), Some(2));
    ok(ctl(&["--yes", "group", "rm", "jobs", "g"]));
    assert_eq!(
        ctl(&["group", "describe", "jobs", "g"]).status.code(),
        Some(1)
    );
}

#[test]
fn an_unreadable_group_file_is_refused_not_reset_and_retention_skips() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(
        tempfile::tempdir().unwrap(),
        &["--durable-segment-bytes", "1048576"],
    );
    let s = name("one");
    rt.block_on(async {
        let c = b.client().await;
        publish(&c, "one", 1, 10).await;
        c.group_create(&s, "g", None, opts(3, 60_000))
            .await
            .unwrap();
        // Retention: a group at offset 0 of a log whose head segments are deleted skips
        // what is gone and never hands it out.
        c.group_create(&name("small"), "r", None, opts(3, 60_000))
            .await
            .unwrap();
        for _ in 0..300 {
            c.publish_batch(
                &name("small"),
                ShardSelector::Shard(0),
                vec![Bytes::from(vec![7u8; 10_000])],
            )
            .await
            .unwrap();
        }
        let recs = c
            .group_poll(&name("small"), "r", 0, 1, None, Duration::ZERO)
            .await
            .unwrap();
        assert!(
            recs[0].offset > 0,
            "the head was deleted by retention: {}",
            recs[0].offset
        );
        let info = &c.group_describe(&name("small"), "r", None).await.unwrap()[0].1;
        assert_eq!(info.cursor, recs[0].offset);
    });
    let dir = b.kill();
    let f = dir
        .path()
        .join("durable/default/default/one/00000/groups/g.grp");
    let mut bytes = std::fs::read(&f).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&f, bytes).unwrap();
    let b = start(dir, &["--durable-segment-bytes", "1048576"]);
    rt.block_on(async {
        let c = b.client().await;
        let e = c.group_describe(&s, "g", None).await.unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::Unavailable), "{e}");
        let e = c
            .group_create(&s, "g", None, GroupOptions::default())
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::AlreadyExists));
        c.group_delete(&s, "g", None).await.unwrap();
        assert!(!f.exists());
        c.group_create(&s, "g", None, GroupOptions::default())
            .await
            .unwrap();
        let info = &c.group_describe(&s, "g", None).await.unwrap()[0].1;
        assert_eq!((info.cursor, info.tail), (0, 10));
    });
}

#[test]
fn short_waits_are_not_held_by_long_ones_and_one_shards_refusal_loses_nothing() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(tempfile::tempdir().unwrap(), &[]);
    rt.block_on(async {
        let c = b.client().await;
        let s = name("jobs");
        c.group_create(&s, "g", Some(0), opts(5, 60_000))
            .await
            .unwrap();
        // A long poll first, then a short one on the same group: the short one ends on time.
        let long_c = b.client().await;
        let long = tokio::spawn(async move {
            let r = long_c
                .group_poll(&name("jobs"), "g", 0, 1, None, Duration::from_secs(20))
                .await
                .unwrap();
            (r, long_c)
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let t0 = Instant::now();
        let short = c
            .group_poll(&s, "g", 0, 1, None, Duration::from_millis(200))
            .await
            .unwrap();
        assert!(short.is_empty());
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "answered at its own deadline"
        );
        publish(&c, "jobs", 1, 1).await;
        let (r, long_c) = long.await.unwrap();
        assert_eq!(r.len(), 1, "the long poll got the record");
        long_c.close().await.unwrap();
        // The group exists on shard 0 only: a poll over both shards still returns shard 0's
        // records (shard 1's refusal does not drop them).
        publish(&c, "jobs", 1, 3).await;
        let mut cons = c.group_consumer(&s, "g").await.unwrap();
        let recs = cons.poll(10, None, Duration::ZERO).await.unwrap();
        assert_eq!(
            recs.iter().map(|r| r.offset).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
        drop(cons);
        let e = c
            .group_consumer(&s, "nope")
            .await
            .unwrap()
            .poll(1, None, Duration::ZERO)
            .await;
        assert_eq!(e.unwrap_err().code(), Some(ErrorCode::NotFound));
    });
}

#[test]
#[allow(clippy::async_yields_async)] // the block hands back the waiting poll's JoinHandle
fn sigterm_answers_waiting_long_polls_and_exits_clean() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(tempfile::tempdir().unwrap(), &[]);
    let waiting = rt.block_on(async {
        let c = b.client().await;
        c.group_create(&name("jobs"), "g", None, opts(5, 60_000))
            .await
            .unwrap();
        let poll = tokio::spawn(async move {
            let mut cons = c.group_consumer(&name("jobs"), "g").await.unwrap();
            let r = cons.poll(5, None, Duration::from_secs(25)).await;
            drop(cons);
            r
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        poll
    });
    let t0 = Instant::now();
    b.signal(libc::SIGTERM);
    let r = rt.block_on(waiting).unwrap();
    assert!(
        r.unwrap().is_empty(),
        "answered with nothing rather than left hanging"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "answered by the drain, not its wait"
    );
    let (code, _) = b.wait_exit(Duration::from_secs(20));
    assert_eq!(code, Some(0), "a clean drain");
}

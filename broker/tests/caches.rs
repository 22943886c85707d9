//! Caches through the real broker binary (in-memory caches): put/get/delete with versions,
//! conditional writes, TTL (lazy on read, reclaimed as Expire events), counters, typed
//! refusals and caps; watches with retained delivery under concurrent writers checked
//! against the writers' log of acknowledged (key, offset) pairs; resume by offset, a marked
//! snapshot below the replay window and after a restart, lag end and resume; felixctl kv.
//! Every loop is bounded by count and time.

mod common;

use bytes::Bytes;
use common::Broker;
use felix_client::{
    CacheWatch, EventKind, WatchFilter, WatchItem, WatchOptions, WatchStart, WriteCond,
};
use felix_quic::wire::{ErrorCode, StreamName};
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(30);

const CATALOG: &str = "streams:
  - {tenant: default, namespace: default, stream: events, shards: 1}
caches:
  - {tenant: default, namespace: default, cache: kv, shards: 4}
  - {tenant: default, namespace: default, cache: one, shards: 1}
  - {tenant: default, namespace: default, cache: short, shards: 1, default_ttl_ms: 300}
  - {tenant: default, namespace: default, cache: logged, shards: 1, durable: true}
";

fn name(s: &str) -> StreamName {
    StreamName::new("default", "default", s)
}

fn start(dir: tempfile::TempDir, extra: &[&str]) -> Broker {
    let cat = dir.path().join("catalog.yaml");
    std::fs::write(&cat, CATALOG).unwrap();
    let mut args = vec!["--catalog".to_string(), cat.display().to_string()];
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Broker::start_in(dir, 2, &args)
}

fn code(e: &felix_client::Error) -> Option<ErrorCode> {
    e.code()
}

/// A small deterministic generator (xorshift64*), seeded per run and printed on failure.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn seed() -> u64 {
    let s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    eprintln!("seed {s}");
    s
}

/// Read a watch until it is idle for `idle` (or WAIT passes); every item.
async fn drain(w: &mut CacheWatch, idle: Duration) -> Vec<WatchItem> {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    while Instant::now() < deadline {
        match w.next_timeout(idle).await {
            Ok(Some(it)) => out.push(it),
            Ok(None) | Err(_) => break,
        }
    }
    out
}

/// Read until `n` change events (not retained) arrived, or panic after WAIT.
async fn changes(w: &mut CacheWatch, n: usize) -> Vec<(u64, Bytes, EventKind, Bytes)> {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    while out.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "timed out with {} of {n} events",
            out.len()
        );
        match w.next_timeout(left).await {
            Ok(Some(WatchItem::Event {
                kind,
                offset,
                key,
                value,
                ..
            })) if kind != EventKind::Retained => out.push((offset, key, kind, value)),
            Ok(Some(WatchItem::End { code, message, .. })) => panic!("ended ({code}): {message}"),
            Ok(Some(_)) => {}
            other => panic!("watch stopped: {other:?}"),
        }
    }
    out
}

#[test]
fn put_get_delete_conditions_ttl_counters_and_refusals() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(tempfile::tempdir().unwrap(), &["--cache-entries-max", "20"]);
    rt.block_on(async {
        let c = b.client().await;
        let c2 = b.client().await;
        let kv = name("kv");
        let info = c.describe_cache(&kv).await.unwrap();
        assert_eq!(
            (info.shards, info.durable, info.default_ttl_ms),
            (4, false, None)
        );

        // Put / get, from two connections (a key's shard may be on either core).
        let w1 = c.cache_put(&kv, "a", "1", None).await.unwrap();
        assert_eq!(w1.expires_at_ms, None);
        let e = c2.cache_get(&kv, "a").await.unwrap().expect("a value");
        assert_eq!(
            (e.value, e.version, e.shard),
            (Bytes::from("1"), w1.version, w1.shard)
        );
        assert_eq!(c.cache_get(&kv, "nope").await.unwrap(), None);

        // Conditional writes: versions are offsets; a failed condition writes nothing.
        let e = c
            .cache_put_if(&kv, "a", "x", None, WriteCond::Version(w1.version + 99))
            .await
            .unwrap_err();
        assert_eq!(code(&e), Some(ErrorCode::ConditionFailed), "{e}");
        let e = c
            .cache_put_if(&kv, "a", "x", None, WriteCond::Absent)
            .await
            .unwrap_err();
        assert_eq!(code(&e), Some(ErrorCode::ConditionFailed), "{e}");
        assert_eq!(
            c.cache_get(&kv, "a").await.unwrap().unwrap().value,
            Bytes::from("1")
        );
        let w2 = c
            .cache_put_if(&kv, "a", "2", None, WriteCond::Version(w1.version))
            .await
            .unwrap();
        assert!(w2.version > w1.version);
        c.cache_put_if(&kv, "b", "b1", None, WriteCond::Absent)
            .await
            .unwrap();

        // Delete reports the value it removed and its own offset.
        let e = c
            .cache_delete_if(&kv, "a", WriteCond::Version(w1.version))
            .await
            .unwrap_err();
        assert_eq!(code(&e), Some(ErrorCode::ConditionFailed), "{e}");
        let d = c.cache_delete(&kv, "a").await.unwrap().expect("removed");
        assert_eq!(
            (d.removed.value, d.removed.version),
            (Bytes::from("2"), w2.version)
        );
        assert!(d.offset > w2.version);
        assert_eq!(c.cache_delete(&kv, "a").await.unwrap(), None);
        assert_eq!(c2.cache_get(&kv, "a").await.unwrap(), None);
        let e = c
            .cache_delete_if(&kv, "a", WriteCond::Always)
            .await
            .unwrap_err();
        assert_eq!(code(&e), Some(ErrorCode::NotFound), "{e}");

        // TTL: absolute expiry, lazy on read; the cache default applies when none is named.
        let t = c.cache_put(&kv, "t", "soon", Some(200)).await.unwrap();
        let exp = t.expires_at_ms.expect("an expiry");
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        assert!(
            exp > now_ms && exp <= now_ms + 1_000,
            "{exp} vs now {now_ms}"
        );
        let short = c.cache_put(&name("short"), "d", "x", None).await.unwrap();
        assert!(short.expires_at_ms.is_some(), "default_ttl_ms applies");
        tokio::time::sleep(Duration::from_millis(450)).await;
        assert_eq!(c.cache_get(&kv, "t").await.unwrap(), None);
        assert_eq!(c.cache_get(&name("short"), "d").await.unwrap(), None);
        // An expired key counts as absent for conditions.
        c.cache_put_if(&kv, "t", "again", None, WriteCond::Absent)
            .await
            .unwrap();

        // Counters: one round trip answers the new sum; overflow is refused, not wrapped.
        assert_eq!(c.counter_get(&kv, "hits").await.unwrap().sum, 0);
        assert_eq!(c.counter_add(&kv, "hits", 5).await.unwrap().sum, 5);
        assert_eq!(c2.counter_add(&kv, "hits", -2).await.unwrap().sum, 3);
        assert_eq!(c.counter_get(&kv, "hits").await.unwrap().sum, 3);
        c.counter_add(&kv, "big", i64::MAX).await.unwrap();
        let e = c.counter_add(&kv, "big", 1).await.unwrap_err();
        assert_eq!(code(&e), Some(ErrorCode::InvalidRequest), "{e}");
        assert_eq!(c.counter_get(&kv, "big").await.unwrap().sum, i64::MAX);

        // Typed refusals; nothing is written by any of them.
        let e = c.cache_get(&name("nope"), "a").await.unwrap_err();
        assert_eq!(code(&e), Some(ErrorCode::NotFound), "{e}");
        let e = c
            .cache_get(&StreamName::new("default", "default", "bad/name"), "a")
            .await
            .unwrap_err();
        assert_eq!(code(&e), Some(ErrorCode::InvalidName), "{e}");
        let e = c.cache_put(&kv, "", "v", None).await.unwrap_err();
        assert_eq!(code(&e), Some(ErrorCode::InvalidRequest), "{e}");
        // A key over the broker's cache_key_bytes_max is refused by the client before sending,
        // naming the broker's own limit (HelloOk.max_key_bytes).
        let e = c
            .cache_put(&kv, vec![b'k'; 513], "v", None)
            .await
            .unwrap_err();
        assert!(
            matches!(&e, felix_client::Error::InvalidArgument(m) if m.contains("cache_key_bytes_max (512)")),
            "{e}"
        );
        let e = c
            .cache_put(&kv, "big", vec![0u8; (1 << 20) + 1], None)
            .await
            .unwrap_err();
        assert!(
            matches!(
                code(&e),
                Some(ErrorCode::PayloadTooLarge | ErrorCode::FrameTooLarge)
            ),
            "{e}"
        );
        let e = c
            .cache_put(&kv, "k", "v", Some(u64::MAX))
            .await
            .unwrap_err();
        assert_eq!(code(&e), Some(ErrorCode::InvalidRequest), "{e}");
        let e = c
            .cache_put(&name("logged"), "k", "v", None)
            .await
            .unwrap_err();
        assert_eq!(code(&e), Some(ErrorCode::Unsupported), "{e}");
        let e = c
            .cache_watch(
                &kv,
                WatchFilter::Prefix {
                    prefix: "a".into(),
                    shard: 4,
                },
                WatchStart::Latest,
                WatchOptions::default(),
            )
            .await
            .err()
            .expect("shard 4 of 4 is refused");
        assert_eq!(code(&e), Some(ErrorCode::UnknownShard), "{e}");

        // Caps refuse, never evict: cache `one` has one shard of at most 20 entries.
        let one = name("one");
        for i in 0..20 {
            c.cache_put(&one, format!("k{i}"), "v", None).await.unwrap();
        }
        let e = c.cache_put(&one, "k20", "v", None).await.unwrap_err();
        assert_eq!(code(&e), Some(ErrorCode::CacheFull), "{e}");
        c.cache_put(&one, "k0", "overwrite", None).await.unwrap();
        assert_eq!(
            c.cache_get(&one, "k19").await.unwrap().unwrap().value,
            Bytes::from("v")
        );
        c.close().await.unwrap();
        c2.close().await.unwrap();
    });
}

/// One acknowledged write: `(shard, offset) -> (key, value or None for a delete)`.
type AckLog = BTreeMap<(u32, u64), (Bytes, Option<Bytes>)>;

#[test]
fn watchers_joining_under_concurrent_writers_see_exactly_the_acknowledged_log() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(tempfile::tempdir().unwrap(), &[]);
    let base_seed = seed();
    rt.block_on(async {
        let kv = name("kv");
        let keys: Vec<String> = (0..24).map(|i| format!("k{i:02}")).collect();
        // Writers: 3 connections, at least 250 acknowledged operations each, and on until
        // every watcher has joined (so each joins under concurrent writes).
        let joined = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut writers = Vec::new();
        for wi in 0..3u64 {
            let c = b.client().await;
            let keys = keys.clone();
            let kv = kv.clone();
            let joined = joined.clone();
            writers.push(tokio::spawn(async move {
                let mut rng = Rng(base_seed ^ (wi + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                let mut log = Vec::new();
                let deadline = Instant::now() + WAIT;
                for i in 0..20_000u64 {
                    let all_in = joined.load(std::sync::atomic::Ordering::Acquire) == 6;
                    if i >= 250 && (all_in || Instant::now() > deadline) {
                        break;
                    }
                    let k = keys[rng.below(keys.len() as u64) as usize].clone();
                    if rng.below(4) == 0 {
                        if let Some(d) = c.cache_delete(&kv, k.clone()).await.unwrap() {
                            log.push((d.removed.shard, d.offset, Bytes::from(k), None));
                        }
                    } else {
                        let v = Bytes::from(format!("w{wi}-{i}"));
                        let w = c.cache_put(&kv, k.clone(), v.clone(), None).await.unwrap();
                        log.push((w.shard, w.version, Bytes::from(k), Some(v)));
                    }
                    if rng.below(8) == 0 {
                        tokio::task::yield_now().await;
                    }
                }
                c.close().await.unwrap();
                log
            }));
        }
        // Watchers join at random points while the writers run: key watches and prefix
        // watches over every shard, all from current state.
        let mut rng = Rng(base_seed);
        // One connection with the watch mux, one with a stream per watch: each gets key and
        // prefix watches.
        let wc = [b.client().await, b.client_without_mux().await];
        let mut watchers = Vec::new();
        for i in 0..6 {
            tokio::time::sleep(Duration::from_millis(rng.below(60))).await;
            let c = &wc[(i / 2) % 2];
            let (filter, w) = if i % 2 == 0 {
                let k = Bytes::from(keys[rng.below(keys.len() as u64) as usize].clone());
                let w = c
                    .cache_watch(
                        &kv,
                        WatchFilter::Key(k.clone()),
                        WatchStart::Current,
                        WatchOptions::default(),
                    )
                    .await
                    .unwrap();
                ((Some(k), None), w)
            } else {
                let p = Bytes::from(format!("k{}", i % 3));
                let w = c
                    .cache_watch_prefix(
                        &kv,
                        p.clone(),
                        WatchStart::Current,
                        WatchOptions::default(),
                    )
                    .await
                    .unwrap();
                ((None, Some(p)), w)
            };
            watchers.push((filter, w));
            joined.fetch_add(1, std::sync::atomic::Ordering::Release);
        }
        let mut log = AckLog::new();
        for w in writers {
            for (shard, offset, k, v) in w.await.unwrap() {
                assert!(
                    log.insert((shard, offset), (k, v)).is_none(),
                    "offset {shard}:{offset} acknowledged twice"
                );
            }
        }
        // Offsets of each shard are contiguous across writers.
        for s in 0..4u32 {
            let offs: Vec<u64> = log
                .range((s, 0)..(s + 1, 0))
                .map(|((_, o), _)| *o)
                .collect();
            for pair in offs.windows(2) {
                assert_eq!(pair[0] + 1, pair[1], "shard {s}: offsets contiguous");
            }
        }
        for ((key, prefix), mut w) in watchers {
            let matches = |k: &[u8]| match (&key, &prefix) {
                (Some(key), _) => k == &key[..],
                (_, Some(p)) => k.starts_with(p),
                _ => unreachable!(),
            };
            let items = drain(&mut w, Duration::from_millis(1500)).await;
            let mut retained: HashMap<u32, BTreeMap<Bytes, (u64, Bytes)>> = HashMap::new();
            let mut done: HashMap<u32, u64> = HashMap::new();
            let mut events: HashMap<u32, Vec<(u64, Bytes, Option<Bytes>)>> = HashMap::new();
            for it in items {
                match it {
                    WatchItem::Event {
                        shard,
                        kind: EventKind::Retained,
                        offset,
                        key,
                        value,
                        ..
                    } => {
                        assert!(!done.contains_key(&shard), "retained after the state phase");
                        retained
                            .entry(shard)
                            .or_default()
                            .insert(key, (offset, value));
                    }
                    WatchItem::StateDone {
                        shard,
                        count,
                        snapshot,
                        live_from,
                    } => {
                        assert!(!snapshot);
                        let n = retained.get(&shard).map_or(0, |m| m.len()) as u64;
                        assert_eq!(count, n, "the state phase counts its keys");
                        assert!(done.insert(shard, live_from).is_none());
                    }
                    WatchItem::Event {
                        shard,
                        kind,
                        offset,
                        key,
                        value,
                        ..
                    } => {
                        assert!(
                            done.contains_key(&shard),
                            "a change before the state phase ended"
                        );
                        let v = match kind {
                            EventKind::Put => Some(value),
                            EventKind::Delete => None,
                            k => panic!("unexpected {k:?}"),
                        };
                        events.entry(shard).or_default().push((offset, key, v));
                    }
                    WatchItem::End { code, message, .. } => {
                        panic!("watch ended ({code}): {message}")
                    }
                }
            }
            let shards_watched = if key.is_some() { 1 } else { 4 };
            assert_eq!(
                done.len(),
                shards_watched,
                "every watched shard finished its state phase"
            );
            for (&shard, &live_from) in &done {
                // The state phase is exactly the state just before live_from.
                let mut at_join: BTreeMap<Bytes, (u64, Bytes)> = BTreeMap::new();
                for ((_, o), (k, v)) in log.range((shard, 0)..(shard, live_from)) {
                    if matches(k) {
                        match v {
                            Some(v) => at_join.insert(k.clone(), (*o, v.clone())),
                            None => at_join.remove(k),
                        };
                    }
                }
                assert_eq!(
                    retained.remove(&shard).unwrap_or_default(),
                    at_join,
                    "shard {shard} state at {live_from}"
                );
                // After the join: exactly the acknowledged log, filtered, in offset order.
                let want: Vec<(u64, Bytes, Option<Bytes>)> = log
                    .range((shard, live_from)..(shard + 1, 0))
                    .filter(|(_, (k, _))| matches(k))
                    .map(|((_, o), (k, v))| (*o, k.clone(), v.clone()))
                    .collect();
                let got = events.remove(&shard).unwrap_or_default();
                assert_eq!(got, want, "shard {shard}: events after {live_from}");
            }
            drop(w);
        }
        for c in wc {
            c.close().await.unwrap();
        }
    });
}

#[test]
fn resume_snapshot_lag_expiry_and_restart() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(
        tempfile::tempdir().unwrap(),
        &["--cache-replay-entries-max", "1000"],
    );
    let one = name("one");
    let (old_version, dir) = rt.block_on(async {
        let c = b.client().await;
        // Resume by offset: read 5 of 10 changes, drop, resume after the last one read.
        let mut w = c
            .cache_watch(
                &one,
                WatchFilter::Key("r".into()),
                WatchStart::Latest,
                WatchOptions::default(),
            )
            .await
            .unwrap();
        let mut acked = Vec::new();
        for i in 0..10 {
            acked.push(
                c.cache_put(&one, "r", format!("v{i}"), None)
                    .await
                    .unwrap()
                    .version,
            );
        }
        let first = changes(&mut w, 5).await;
        assert_eq!(first.iter().map(|e| e.0).collect::<Vec<_>>(), acked[..5]);
        drop(w);
        let mut w = c
            .cache_watch(
                &one,
                WatchFilter::Key("r".into()),
                WatchStart::Offset(acked[4] + 1),
                WatchOptions::default(),
            )
            .await
            .unwrap();
        acked.push(c.cache_put(&one, "r", "v10", None).await.unwrap().version);
        let rest = changes(&mut w, 6).await;
        assert_eq!(
            rest.iter().map(|e| e.0).collect::<Vec<_>>(),
            acked[5..],
            "no gap, no duplicate"
        );
        assert_eq!(rest[5].3, Bytes::from("v10"));
        drop(w);

        // Below the replay window (1000 changes): a marked snapshot of current values.
        for i in 0..1100 {
            c.cache_put(&one, format!("s{}", i % 3), format!("{i}"), None)
                .await
                .unwrap();
        }
        let mut w = c
            .cache_watch(
                &one,
                WatchFilter::Prefix {
                    prefix: "s".into(),
                    shard: 0,
                },
                WatchStart::Offset(acked[0]),
                WatchOptions::default(),
            )
            .await
            .unwrap();
        let items = drain(&mut w, Duration::from_millis(300)).await;
        let retained: Vec<(Bytes, Bytes)> = items
            .iter()
            .filter_map(|i| match i {
                WatchItem::Event {
                    kind: EventKind::Retained,
                    key,
                    value,
                    ..
                } => Some((key.clone(), value.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(
            retained,
            vec![
                ("s0".into(), "1098".into()),
                ("s1".into(), "1099".into()),
                ("s2".into(), "1097".into())
            ]
        );
        assert!(
            items.iter().any(|i| matches!(
                i,
                WatchItem::StateDone {
                    snapshot: true,
                    count: 3,
                    ..
                }
            )),
            "{items:?}"
        );
        drop(w);
        // Beyond the tail: refused, naming it.
        let e = c
            .cache_watch(
                &one,
                WatchFilter::Key("r".into()),
                WatchStart::Offset(u64::MAX),
                WatchOptions::default(),
            )
            .await
            .err()
            .expect("beyond the tail");
        assert_eq!(code(&e), Some(ErrorCode::InvalidRequest), "{e}");

        // A current-state watch bigger than its queue bound is refused at open.
        let small = WatchOptions {
            queue_events_max: 2,
            ..Default::default()
        };
        let e = c
            .cache_watch(
                &one,
                WatchFilter::Prefix {
                    prefix: "s".into(),
                    shard: 0,
                },
                WatchStart::Current,
                small,
            )
            .await
            .err()
            .expect("3 keys > 2 events");
        assert_eq!(code(&e), Some(ErrorCode::InvalidRequest), "{e}");

        // Lag, on a connection with a stream per watch (the broker ends it), then on one
        // with the mux (the client ends it).
        lag_and_resume(&b, &c, &one, b.client_without_mux().await, "lag").await;
        lag_and_resume(&b, &c, &one, b.client().await, "lag-mux").await;

        // Expiry: reclaimed in the background and delivered as an Expire event.
        let mut w = c
            .cache_watch(
                &one,
                WatchFilter::Key("ttl".into()),
                WatchStart::Current,
                WatchOptions::default(),
            )
            .await
            .unwrap();
        let put = c.cache_put(&one, "ttl", "brief", Some(150)).await.unwrap();
        let ev = changes(&mut w, 2).await;
        assert_eq!((ev[0].0, ev[0].2), (put.version, EventKind::Put));
        assert_eq!((ev[1].0, ev[1].2), (put.version + 1, EventKind::Expire));
        drop(w);
        let v = c.cache_put(&one, "keep", "v", None).await.unwrap().version;
        c.close().await.unwrap();
        (v, b.kill())
    });
    // Restart: an in-memory cache starts empty, its versions above every earlier one; a
    // resume from an earlier process's offset is answered with a (here empty) snapshot.
    let b = start(dir, &[]);
    rt.block_on(async {
        let c = b.client().await;
        assert_eq!(c.cache_get(&one, "keep").await.unwrap(), None);
        let v = c
            .cache_put(&one, "keep", "again", None)
            .await
            .unwrap()
            .version;
        assert!(
            v > old_version,
            "versions never repeat across restarts: {v} <= {old_version}"
        );
        let mut w = c
            .cache_watch(
                &one,
                WatchFilter::Key("gone".into()),
                WatchStart::Offset(old_version),
                WatchOptions::default(),
            )
            .await
            .unwrap();
        let items = drain(&mut w, Duration::from_millis(300)).await;
        assert!(
            matches!(
                items.as_slice(),
                [WatchItem::StateDone {
                    snapshot: true,
                    count: 0,
                    ..
                }]
            ),
            "{items:?}"
        );
        drop(w);
        c.close().await.unwrap();
    });
}

#[test]
fn felixctl_kv_commands() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start(tempfile::tempdir().unwrap(), &[]);
    let ctl = |args: &[&str]| b.felixctl(args);
    let ok = common::ok;
    let put: serde_json::Value =
        serde_json::from_str(&ok(ctl(&["--json", "kv", "put", "kv", "color", "red"]))).unwrap();
    let v = put["version"].as_u64().unwrap();
    assert_eq!(ok(ctl(&["kv", "get", "kv", "color"])), "red\n");
    // A failed condition exits 1 and changes nothing.
    let o = ctl(&[
        "kv",
        "put",
        "kv",
        "color",
        "blue",
        "--if-version",
        &(v + 7).to_string(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("condition_failed"));
    ok(ctl(&[
        "kv",
        "put",
        "kv",
        "color",
        "blue",
        "--if-version",
        &v.to_string(),
    ]));
    // watch --from current prints the current value, then changes made meanwhile.
    let mut watch = b
        .felixctl_cmd()
        .args([
            "--json",
            "kv",
            "watch",
            "kv",
            "--key",
            "color",
            "--count",
            "3",
            "--idle-exit-ms",
            "10000",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The retained value is printed once the watch is registered: write only after it.
    let mut stdout = std::io::BufReader::new(watch.stdout.take().unwrap());
    let mut first = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut first).unwrap();
    rt.block_on(async {
        let c = b.client().await;
        c.cache_put(&name("kv"), "color", "green", None)
            .await
            .unwrap();
        c.cache_delete(&name("kv"), "color").await.unwrap();
        c.close().await.unwrap();
    });
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    let out = watch.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = format!("{first}{rest}")
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v.get("kind").is_some())
        .collect();
    let kinds: Vec<(&str, &str)> = lines
        .iter()
        .map(|l| (l["kind"].as_str().unwrap(), l["value"].as_str().unwrap()))
        .collect();
    assert_eq!(
        kinds,
        vec![("retained", "blue"), ("put", "green"), ("delete", "")]
    );
    let o = ctl(&["kv", "get", "kv", "color"]);
    assert_eq!(o.status.code(), Some(1), "no value exits 1");
    assert_eq!(ok(ctl(&["kv", "counter", "add", "kv", "n", "5"])), "5\n");
    assert_eq!(ok(ctl(&["kv", "counter", "add", "kv", "n", "-7"])), "-2\n");
    assert_eq!(ok(ctl(&["kv", "counter", "get", "kv", "n"])), "-2\n");
    let d: serde_json::Value =
        serde_json::from_str(&ok(ctl(&["--json", "kv", "describe", "kv"]))).unwrap();
    assert_eq!(d["shards"], 4);
    let o = ctl(&["kv", "get", "missing-cache", "k"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not_found"));
}

#[test]
fn log_backed_cache_keeps_acknowledged_writes_across_sigkill_and_restart() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let durable = dir.path().join("durable");
    let args = ["--durable-storage-dir", durable.to_str().unwrap()];
    let b = start(dir, &args);
    let logged = name("logged");
    let mut rng = Rng(seed());
    // key -> (version, value) as acknowledged; None = deleted.
    let (want, sum, long_ttl, acked, dir) = rt.block_on(async {
        let c = b.client().await;
        let mut want: BTreeMap<String, Option<(u64, Bytes)>> = BTreeMap::new();
        let mut acked: Vec<(u64, Bytes, Option<Bytes>)> = Vec::new();
        for i in 0..300u64 {
            let k = format!("k{}", rng.below(40));
            if rng.below(5) == 0 {
                if let Some(d) = c.cache_delete(&logged, k.clone()).await.unwrap() {
                    assert_eq!(
                        want.get(&k).cloned().flatten().map(|e| e.0),
                        Some(d.removed.version)
                    );
                    acked.push((d.offset, Bytes::from(k.clone()), None));
                    want.insert(k, None);
                }
            } else {
                let v = Bytes::from(format!("v{i}"));
                let w = c
                    .cache_put(&logged, k.clone(), v.clone(), None)
                    .await
                    .unwrap();
                acked.push((w.version, Bytes::from(k.clone()), Some(v.clone())));
                want.insert(k, Some((w.version, v)));
            }
        }
        let mut sum = 0i64;
        for d in [5i64, -2, 40, -1] {
            sum = c.counter_add(&logged, "n", d).await.unwrap().sum;
        }
        let long = c
            .cache_put(&logged, "long", "stays", Some(3_600_000))
            .await
            .unwrap();
        // "gone" expires and is reclaimed (an Expire record) before the kill: after the
        // restart the replayed record keeps it gone without reclaiming it again.
        let mut w = c
            .cache_watch(
                &logged,
                WatchFilter::Key("gone".into()),
                WatchStart::Latest,
                WatchOptions::default(),
            )
            .await
            .unwrap();
        c.cache_put(&logged, "gone", "soon", Some(100))
            .await
            .unwrap();
        let ev = changes(&mut w, 2).await;
        assert_eq!(ev[1].2, EventKind::Expire);
        drop(w);
        c.cache_put(&logged, "brief", "goes", Some(300))
            .await
            .unwrap();
        c.close().await.unwrap();
        // SIGKILL: no shutdown path runs; periodic fsync still kept every acknowledged write
        // in the file (a process crash is not a machine crash).
        (want, sum, long, acked, b.kill())
    });
    std::thread::sleep(Duration::from_millis(400)); // "brief" expires while the broker is down
    let b = start(dir, &args);
    rt.block_on(async {
        let c = b.client().await;
        let mut last = 0;
        for (k, v) in &want {
            let got = c.cache_get(&logged, k.clone()).await.unwrap();
            match v {
                Some((version, value)) => {
                    let e = got.unwrap_or_else(|| panic!("{k} lost"));
                    assert_eq!((&e.value, e.version), (value, *version), "{k}");
                    last = last.max(*version);
                }
                None => assert_eq!(got, None, "{k} was deleted"),
            }
        }
        assert_eq!(c.counter_get(&logged, "n").await.unwrap().sum, sum);
        let e = c
            .cache_get(&logged, "long")
            .await
            .unwrap()
            .expect("long TTL survives");
        assert_eq!(
            e.expires_at_ms, long_ttl.expires_at_ms,
            "the expiry is absolute"
        );
        assert_eq!(
            c.cache_get(&logged, "brief").await.unwrap(),
            None,
            "expired while down"
        );
        assert_eq!(c.cache_get(&logged, "gone").await.unwrap(), None);
        // Only "brief" is reclaimed after the restart (within a tick); "gone"'s Expire record
        // was replayed.
        let deadline = Instant::now() + WAIT;
        while b.total("cache_expired") < 1 {
            assert!(Instant::now() < deadline, "brief never reclaimed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            b.total("cache_expired"),
            1,
            "the replayed expiry is not reclaimed twice"
        );
        // Offsets continue the log: a new write's version is above every earlier one.
        let v = c
            .cache_put(&logged, "fresh", "x", None)
            .await
            .unwrap()
            .version;
        assert!(v > last && v > long_ttl.version);
        // A current-state watch after the restart: the rebuilt state with its versions.
        let mut w = c
            .cache_watch(
                &logged,
                WatchFilter::Prefix {
                    prefix: "k".into(),
                    shard: 0,
                },
                WatchStart::Current,
                WatchOptions::default(),
            )
            .await
            .unwrap();
        let items = drain(&mut w, Duration::from_millis(300)).await;
        let retained: BTreeMap<String, (u64, Bytes)> = items
            .iter()
            .filter_map(|i| match i {
                WatchItem::Event {
                    kind: EventKind::Retained,
                    key,
                    value,
                    offset,
                    ..
                } => Some((
                    String::from_utf8(key.to_vec()).unwrap(),
                    (*offset, value.clone()),
                )),
                _ => None,
            })
            .collect();
        let live: BTreeMap<String, (u64, Bytes)> = want
            .iter()
            .filter_map(|(k, v)| v.clone().map(|v| (k.clone(), v)))
            .collect();
        assert_eq!(retained, live, "one shard holds every key of this cache");
        drop(w);
        // A resume by offset after the restart (the replay ring is empty): read from the
        // log, exactly the acknowledged changes from there on, then live.
        let from = acked[acked.len() / 3].0;
        let mut w = c
            .cache_watch(
                &logged,
                WatchFilter::Prefix {
                    prefix: "k".into(),
                    shard: 0,
                },
                WatchStart::Offset(from),
                WatchOptions::default(),
            )
            .await
            .unwrap();
        let want_ev: Vec<(u64, Bytes, Option<Bytes>)> =
            acked.iter().filter(|e| e.0 >= from).cloned().collect();
        let got: Vec<(u64, Bytes, Option<Bytes>)> = changes(&mut w, want_ev.len())
            .await
            .into_iter()
            .map(|(o, k, kind, v)| (o, k, (kind == EventKind::Put).then_some(v)))
            .collect();
        assert_eq!(got, want_ev, "replayed from the log");
        c.cache_put(&logged, "k0", "live", None).await.unwrap();
        assert_eq!(
            changes(&mut w, 1).await[0].3,
            Bytes::from("live"),
            "then live"
        );
        drop(w);
        c.close().await.unwrap();
    });
}

#[test]
fn log_backed_cache_compacts_into_keys_idx_and_reopens_from_it() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let durable = dir.path().join("durable");
    let args = [
        "--durable-storage-dir",
        durable.to_str().unwrap(),
        "--durable-segment-bytes",
        "1048576",
        "--cache-compact-records",
        "400",
    ];
    let b = start(dir, &args);
    let logged = name("logged");
    let shard_dir = durable.join("@caches/default/default/logged/00000");
    let segments = |log: &str| -> usize {
        std::fs::read_dir(shard_dir.join(log))
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.file_name().to_string_lossy().ends_with(".log"))
                    .count()
            })
            .unwrap_or(0)
    };
    // key -> (version, value), and every acknowledged write of "hot" (watched throughout).
    let (want, hot_log, first_version, dir) = rt.block_on(async {
        let c = b.client().await;
        let mut w = c
            .cache_watch(
                &logged,
                WatchFilter::Key("hot".into()),
                WatchStart::Current,
                WatchOptions::default(),
            )
            .await
            .unwrap();
        let mut want: BTreeMap<String, (u64, Bytes)> = BTreeMap::new();
        let mut hot_log = Vec::new();
        let mut first_version = None;
        // ~3.5 MB of 1 KiB values over 30 keys: several 1 MiB segments, snapshots every 400.
        for i in 0..3000u64 {
            let k = if i % 10 == 0 {
                "hot".to_string()
            } else {
                format!("k{}", i % 29)
            };
            let v = Bytes::from(format!("{i:06}{}", "x".repeat(1024)));
            let wr = c
                .cache_put(&logged, k.clone(), v.clone(), None)
                .await
                .unwrap();
            first_version.get_or_insert(wr.version);
            if k == "hot" {
                hot_log.push(wr.version);
            }
            want.insert(k, (wr.version, v));
        }
        for _ in 0..3 {
            c.counter_add(&logged, "n", 7).await.unwrap();
        }
        // The watch saw every write of "hot", in order, while compactions ran.
        let got: Vec<u64> = changes(&mut w, hot_log.len())
            .await
            .iter()
            .map(|e| e.0)
            .collect();
        assert_eq!(got, hot_log);
        drop(w);
        let deadline = Instant::now() + WAIT;
        while b.total("cache_segments_compacted") == 0 {
            assert!(Instant::now() < deadline, "no segment was compacted");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(b.total("cache_compactions") >= 1);
        c.close().await.unwrap();
        (want, hot_log, first_version.unwrap(), b.kill())
    });
    assert!(shard_dir.join("keys.idx").exists());
    let kept = segments("log");
    assert!(
        (1..3).contains(&kept),
        "compaction deleted covered segments: {kept} left"
    );
    // Restart: the state comes from keys.idx plus the log after it; versions are kept (no
    // renumbering), new offsets continue above.
    let b = start(dir, &args);
    rt.block_on(async {
        let c = b.client().await;
        for (k, (version, value)) in &want {
            let e = c
                .cache_get(&logged, k.clone())
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("{k} lost"));
            assert_eq!((&e.value, e.version), (value, *version), "{k}");
        }
        assert_eq!(c.counter_get(&logged, "n").await.unwrap().sum, 21);
        let v = c
            .cache_put(&logged, "after", "x", None)
            .await
            .unwrap()
            .version;
        assert!(v > *hot_log.last().unwrap());
        // A resume from the first offset, long compacted away: a marked snapshot of current
        // values, never a silent gap.
        let mut w = c
            .cache_watch(
                &logged,
                WatchFilter::Key("hot".into()),
                WatchStart::Offset(first_version),
                WatchOptions::default(),
            )
            .await
            .unwrap();
        let items = drain(&mut w, Duration::from_millis(300)).await;
        match items.as_slice() {
            [WatchItem::Event {
                kind: EventKind::Retained,
                offset,
                ..
            }, WatchItem::StateDone {
                snapshot: true,
                count: 1,
                ..
            }] => {
                assert_eq!(*offset, *hot_log.last().unwrap())
            }
            other => panic!("{other:?}"),
        }
        drop(w);
        // A resume inside what the log still holds (after the compaction point): replayed.
        let from = hot_log[hot_log.len() - 3];
        let mut w = c
            .cache_watch(
                &logged,
                WatchFilter::Key("hot".into()),
                WatchStart::Offset(from),
                WatchOptions::default(),
            )
            .await
            .unwrap();
        let got: Vec<u64> = changes(&mut w, 3).await.iter().map(|e| e.0).collect();
        assert_eq!(got, hot_log[hot_log.len() - 3..]);
        drop(w);
        c.close().await.unwrap();
    });
}

/// A watcher of `key` that does not read (client buffer 1, broker queue 4) is ended
/// watch_lagged naming the offset to resume from (without the mux, once the QUIC stream
/// window, 16 MiB, is full and the broker queue with it; with the mux — a key ending in "mux"
/// — once its client buffer is full); what it got plus the resume is the whole log of the
/// key. `c` writes.
async fn lag_and_resume(
    b: &Broker,
    c: &felix_client::Client,
    one: &StreamName,
    lc: felix_client::Client,
    key: &'static str,
) {
    let mux = key.ends_with("mux");
    let lag_opts = WatchOptions {
        queue_events_max: 4,
        buffer_items: 1,
        ..Default::default()
    };
    let mut w = lc
        .cache_watch(
            one,
            WatchFilter::Key(key.into()),
            WatchStart::Latest,
            lag_opts,
        )
        .await
        .unwrap();
    let mut log = Vec::new();
    for i in 0..500 {
        // 48 KiB values: 24 MB, past the stream window.
        let v = format!("{i:04}{}", "x".repeat(48 << 10));
        log.push(
            c.cache_put(one, key.to_string(), v, None)
                .await
                .unwrap()
                .version,
        );
    }
    let mut got = Vec::new();
    let resume = loop {
        match w.next_timeout(WAIT).await.unwrap() {
            Some(WatchItem::Event { offset, .. }) => got.push(offset),
            Some(WatchItem::End {
                code,
                resume_from,
                message,
                ..
            }) => {
                assert_eq!(
                    code,
                    ErrorCode::WatchLagged.number(),
                    "{message}; {} events got; lagged {}",
                    got.len(),
                    b.total("cache_watches_lagged")
                );
                // With the mux the client ends it (one stream is never paused for one reader).
                assert_eq!(message.contains("client buffer"), mux, "{message}");
                break resume_from;
            }
            other => panic!("unexpected {other:?}"),
        }
    };
    assert!(got.len() < log.len(), "the watcher lagged");
    let cut = log
        .iter()
        .position(|o| *o == resume)
        .expect("resume_from is one of the key's offsets");
    assert_eq!(
        got,
        log[..cut],
        "everything before resume_from was delivered, in order"
    );
    drop(w);
    let mut w = lc
        .cache_watch(
            one,
            WatchFilter::Key(key.into()),
            WatchStart::Offset(resume),
            WatchOptions::default(),
        )
        .await
        .unwrap();
    let rest = changes(&mut w, log.len() - cut).await;
    assert_eq!(rest.iter().map(|e| e.0).collect::<Vec<_>>(), log[cut..]);
    drop(w);
    lc.close().await.unwrap();
}

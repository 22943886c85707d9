//! A `WatchSet` (many watches read by one task) through the real broker binary: each member
//! keeps a watch's contract. Its changes arrive in order with their offsets, retained values
//! first; its own buffer bound decides when it is full, whatever its siblings hold; it ends on
//! its own (`watch_lagged` naming where to resume, or its connection's close). Every loop is
//! bounded by count and time.

mod common;

use common::Broker;
use felix_client::{Client, WatchFilter, WatchItem, WatchOptions, WatchSet, WatchStart};
use felix_quic::wire::{ErrorCode, EventKind, StreamName};
use std::collections::HashMap;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(30);

fn start() -> Broker {
    Broker::start_with_cache_one()
}

fn one() -> StreamName {
    StreamName::new("default", "default", "one")
}

fn bound(buffer_items: usize) -> WatchOptions {
    WatchOptions {
        buffer_items,
        ..Default::default()
    }
}

async fn put_n(writer: &Client, key: &str, n: usize) -> Vec<u64> {
    let mut log = Vec::with_capacity(n);
    for i in 0..n {
        let w = writer
            .cache_put(&one(), key.to_string(), format!("v{i}"), None)
            .await;
        log.push(w.unwrap().version);
    }
    log
}

/// Wait until the broker's gauge (refreshed by each core's tick) shows `n` watches open.
async fn watches_open(b: &Broker, n: u64) {
    let deadline = Instant::now() + WAIT;
    while b.total("cache_watches_open") != n {
        assert!(
            Instant::now() < deadline,
            "cache_watches_open never reached {n}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What each member read until `done` says it has enough: live change offsets, retained
/// keys, and its end `(code, resume_from)`.
#[derive(Default, Debug)]
struct Read {
    changes: Vec<u64>,
    retained: Vec<String>,
    end: Option<(u16, u64)>,
}

async fn read_until(
    set: &mut WatchSet,
    mut done: impl FnMut(&HashMap<u64, Read>) -> bool,
) -> HashMap<u64, Read> {
    let mut got: HashMap<u64, Read> = HashMap::new();
    let deadline = Instant::now() + WAIT;
    while !done(&got) {
        assert!(Instant::now() < deadline, "timed out; read so far: {got:?}");
        let Some((id, item)) = set.next_timeout(WAIT).await.unwrap() else {
            break;
        };
        let r = got.entry(id).or_default();
        assert!(r.end.is_none(), "member {id} read {item:?} after its end");
        match item {
            WatchItem::Event {
                kind: EventKind::Retained,
                key,
                ..
            } => r.retained.push(String::from_utf8_lossy(&key).into()),
            WatchItem::Event { offset, .. } => r.changes.push(offset),
            WatchItem::End {
                code, resume_from, ..
            } => r.end = Some((code, resume_from)),
            WatchItem::StateDone { .. } => {}
        }
    }
    got
}

/// Members on two connections (one with the mux, one without), read by one task while a
/// writer changes their keys: each sees exactly its key's (or prefix's) changes in order, the
/// `Current` member its retained value first.
#[test]
fn a_watch_set_reads_each_member_in_order_across_connections() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start();
    rt.block_on(async {
        let (c1, c2, writer) = (
            b.client().await,
            b.client_without_mux().await,
            b.client().await,
        );
        writer.cache_put(&one(), "c", "before", None).await.unwrap();
        let mut set = WatchSet::new();
        let key = |k: &str| WatchFilter::Key(k.to_string().into());
        let opts = WatchOptions::default();
        let a = set
            .watch(&c1, &one(), key("a"), WatchStart::Latest, opts)
            .await
            .unwrap();
        let bb = set
            .watch(&c2, &one(), key("b"), WatchStart::Latest, opts)
            .await
            .unwrap();
        let c = set
            .watch(&c1, &one(), key("c"), WatchStart::Current, opts)
            .await
            .unwrap();
        let pre = set
            .watch_prefix_shards(&c2, &one(), "c", &[0], WatchStart::Latest, opts)
            .await
            .unwrap();
        assert_eq!(set.len(), 4);
        let (mut la, mut lb, mut lc) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..300 {
            let (k, log) = match i % 3 {
                0 => ("a", &mut la),
                1 => ("b", &mut lb),
                _ => ("c", &mut lc),
            };
            log.extend(put_n(&writer, k, 1).await);
        }
        let want = [
            (a, la.len()),
            (bb, lb.len()),
            (c, lc.len()),
            (pre, lc.len()),
        ];
        let got = read_until(&mut set, |g| {
            want.iter()
                .all(|(id, n)| g.get(id).is_some_and(|r| r.changes.len() >= *n))
        })
        .await;
        assert_eq!(got[&a].changes, la);
        assert_eq!(got[&bb].changes, lb);
        assert_eq!(got[&c].changes, lc);
        assert_eq!(got[&c].retained, ["c"], "retained delivery first");
        assert_eq!(got[&pre].changes, lc, "a prefix member on shard 0");
        assert!(got[&a].retained.is_empty());
        // Where each would resume: after the last change read.
        assert_eq!(set.resume_offsets(a).unwrap(), [(0, la[99] + 1)]);
        assert!(set.try_next().is_none(), "nothing more was written");
        for cl in [c1, c2, writer] {
            cl.close().await.unwrap();
        }
    });
}

/// Nobody reads the set while a writer makes 2,000 changes to one key watched by a member with
/// an 8-item bound and one with the default bound, on the mux: the small one is ended by the
/// client `watch_lagged` after exactly its 8 and resumes at the 9th; its sibling in the same
/// set, on the same connection, gets every change. The broker ends nothing.
#[test]
fn a_set_member_is_full_at_its_own_bound_and_ends_alone() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start();
    rt.block_on(async {
        let (c, writer) = (b.client().await, b.client().await);
        let mut set = WatchSet::new();
        let key = || WatchFilter::Key("k".into());
        let small = set
            .watch(&c, &one(), key(), WatchStart::Latest, bound(8))
            .await
            .unwrap();
        let big = set
            .watch(
                &c,
                &one(),
                key(),
                WatchStart::Latest,
                WatchOptions::default(),
            )
            .await
            .unwrap();
        let log = put_n(&writer, "k", 2000).await;
        let got = read_until(&mut set, |g| {
            g.get(&small).is_some_and(|r| r.end.is_some())
                && g.get(&big).is_some_and(|r| r.changes.len() >= log.len())
        })
        .await;
        assert_eq!(
            got[&small].changes,
            log[..8],
            "its buffer's worth, in order"
        );
        assert_eq!(
            got[&small].end,
            Some((ErrorCode::WatchLagged.number(), log[8])),
            "ended, resuming at the first change it could not take"
        );
        assert_eq!(got[&big].changes, log, "its sibling sees the whole log");
        assert_eq!(set.len(), 1, "the ended member is forgotten");
        assert_eq!(
            b.total("cache_watches_lagged"),
            0,
            "the broker ended nothing"
        );
        c.close().await.unwrap();
        writer.close().await.unwrap();
    });
}

/// Without the mux a member has a stream of its own: at its bound the client stops reading
/// that stream (flow control holds the broker), and once the set is read again every change
/// arrives, none lost.
#[test]
fn a_set_member_without_the_mux_is_held_at_its_bound_and_loses_nothing() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start();
    rt.block_on(async {
        let (c, writer) = (b.client_without_mux().await, b.client().await);
        let mut set = WatchSet::new();
        let id = set
            .watch(
                &c,
                &one(),
                WatchFilter::Key("k".into()),
                WatchStart::Latest,
                bound(8),
            )
            .await
            .unwrap();
        let log = put_n(&writer, "k", 500).await;
        let got = read_until(&mut set, |g| {
            g.get(&id)
                .is_some_and(|r| r.changes.len() >= log.len() || r.end.is_some())
        })
        .await;
        assert_eq!(got[&id].changes, log);
        assert_eq!(got[&id].end, None);
        c.close().await.unwrap();
        writer.close().await.unwrap();
    });
}

/// Closing one of the set's connections ends its members (code u16::MAX, the connection's
/// end) and leaves the other connection's member reading; a removed member's watch ends at
/// the broker; the set reads `None` once no member is open.
#[test]
fn a_closed_connection_ends_its_members_and_an_empty_set_reads_none() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start();
    rt.block_on(async {
        let (c1, c2, writer) = (b.client().await, b.client().await, b.client().await);
        let mut set = WatchSet::new();
        let key = || WatchFilter::Key("k".into());
        let opts = WatchOptions::default();
        let on1 = set
            .watch(&c1, &one(), key(), WatchStart::Latest, opts)
            .await
            .unwrap();
        let on2 = set
            .watch(&c2, &one(), key(), WatchStart::Latest, opts)
            .await
            .unwrap();
        let gone = set
            .watch(&c2, &one(), key(), WatchStart::Latest, opts)
            .await
            .unwrap();
        watches_open(&b, 3).await;
        assert!(set.remove(gone));
        assert!(!set.remove(gone), "removed once");
        watches_open(&b, 2).await;
        c1.close().await.unwrap();
        let log = put_n(&writer, "k", 50).await;
        let got = read_until(&mut set, |g| {
            g.get(&on1).is_some_and(|r| r.end.is_some())
                && g.get(&on2).is_some_and(|r| r.changes.len() >= log.len())
        })
        .await;
        assert_eq!(
            got[&on1].end.map(|e| e.0),
            Some(u16::MAX),
            "the connection's end"
        );
        assert!(got[&on1].changes.is_empty());
        assert_eq!(got[&on2].changes, log);
        assert!(
            !got.contains_key(&gone),
            "nothing of a removed member is read"
        );
        c2.close().await.unwrap();
        let rest = read_until(&mut set, |_| false).await;
        assert_eq!(rest[&on2].end.map(|e| e.0), Some(u16::MAX));
        assert!(set.is_empty());
        assert!(set.next().await.is_none(), "an empty set reads None");
        writer.close().await.unwrap();
    });
}

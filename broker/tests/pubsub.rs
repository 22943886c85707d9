//! Publish/subscribe through the real broker binary with the real client: round trip,
//! fanout across cores, routing keys, the three queue policies against a stalled
//! subscriber, publish timeouts and typed refusals. Every loop is bounded by count and time.

mod common;

use bytes::Bytes;
use common::Broker;
use felix_client::{Client, Error, Event, SubscribeOptions, Subscription};
use felix_quic::wire::{ErrorCode, QueuePolicy, ShardSelector, StartAt, StreamName};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(20);

fn events() -> StreamName {
    StreamName::new("default", "default", "events")
}

fn payload(i: u64) -> Bytes {
    Bytes::from(format!("record-{i:06}-{}", "x".repeat(80)))
}

/// What a subscriber saw, in arrival order.
#[derive(Default, Debug)]
struct Seen {
    records: Vec<(u32, u64, Bytes)>,
    lags: Vec<(u32, u64, u64)>,
}

impl Seen {
    fn offsets(&self, shard: u32) -> Vec<u64> {
        self.records
            .iter()
            .filter(|r| r.0 == shard)
            .map(|r| r.1)
            .collect()
    }
    fn push(&mut self, ev: &Event) {
        match ev {
            Event::Records { shard, .. } => {
                for (o, p) in ev.records() {
                    self.records.push((*shard, o, p));
                }
            }
            Event::Lag {
                shard,
                from_offset,
                lost,
            } => self.lags.push((*shard, *from_offset, *lost)),
            Event::End { code, message, .. } => panic!("subscription ended ({code}): {message}"),
            Event::Watch(w) => panic!("a watch item on a subscription: {w:?}"),
        }
    }
    /// Delivered records plus announced losses of shard 0 cover `0..n` exactly once, in order.
    fn assert_exact_coverage(&self, n: u64) {
        let mut spans: Vec<(u64, u64, bool)> = Vec::new();
        let mut recs = self.offsets(0).into_iter().peekable();
        let mut lags = self.lags.iter().filter(|l| l.0 == 0).peekable();
        // Merge by arrival is not recorded across kinds, so merge by offset; each kind is
        // itself checked to be increasing.
        loop {
            let r = recs.peek().copied();
            let l = lags.peek().map(|l| l.1);
            match (r, l) {
                (None, None) => break,
                (Some(r), l) if l.map(|l| r < l).unwrap_or(true) => {
                    spans.push((r, r + 1, true));
                    recs.next();
                }
                _ => {
                    let l = lags.next().unwrap();
                    spans.push((l.1, l.1 + l.2, false));
                }
            }
        }
        let mut at = 0;
        for (from, end, _) in &spans {
            assert_eq!(
                *from, at,
                "coverage is contiguous and never repeats: {spans:?}"
            );
            at = *end;
        }
        assert_eq!(at, n, "every offset delivered or announced lost");
    }
}

/// Read events until `want` records of shard 0 were delivered or announced lost.
async fn read_until(sub: &mut Subscription, seen: &mut Seen, want: u64) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let covered = seen.records.len() as u64 + seen.lags.iter().map(|l| l.2).sum::<u64>();
        if covered >= want {
            return;
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match sub.next_timeout(left).await {
            Ok(Some(ev)) => seen.push(&ev),
            Ok(None) => panic!("subscription closed after {covered} of {want}"),
            Err(_) => panic!(
                "only {covered} of {want} records arrived in {WAIT:?}: {:?}",
                seen.lags
            ),
        }
    }
}

/// Connect clients until there are at least `n` and both cores hold at least one.
async fn clients_on_both_cores(b: &Broker, n: usize) -> Vec<Client> {
    let mut out = Vec::new();
    for _ in 0..64 {
        let c = b.client().await;
        out.push(c);
        let cores: std::collections::HashSet<u16> = out.iter().map(|c| c.core).collect();
        if out.len() >= n && cores.len() == 2 {
            return out;
        }
    }
    panic!("64 connections never covered both cores");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fanout_to_ten_subscribers_across_both_cores_in_order() {
    let b = Broker::start(2, &[]);
    let subs_clients = clients_on_both_cores(&b, 10).await;
    let mut subs = Vec::new();
    for c in &subs_clients {
        subs.push(
            c.subscribe(&events(), 0, SubscribeOptions::default())
                .await
                .unwrap(),
        );
    }
    let publisher = b.client().await;
    const N: u64 = 300;
    let mut sent = 0u64;
    let mut batches = 0u64;
    while sent < N {
        // Batches of 1..=5 records, explicit shard 0.
        let k = (batches % 5 + 1).min(N - sent);
        let ack = publisher
            .publish_batch(
                &events(),
                ShardSelector::Shard(0),
                (sent..sent + k).map(payload).collect(),
            )
            .await
            .unwrap();
        assert_eq!(
            (ack.shard, ack.first_offset, ack.count as u64),
            (0, sent, k),
            "acks carry offsets"
        );
        sent += k;
        batches += 1;
    }
    for sub in &mut subs {
        let mut seen = Seen::default();
        read_until(sub, &mut seen, N).await;
        assert!(seen.lags.is_empty(), "no loss for readers that keep up");
        assert_eq!(
            seen.offsets(0),
            (0..N).collect::<Vec<_>>(),
            "every record, in order"
        );
        for (_, o, p) in &seen.records {
            assert_eq!(p, &payload(*o));
        }
    }
    let c = b.counters();
    let delivered = &c["batches_delivered"];
    assert!(
        delivered[0] > 0 && delivered[1] > 0,
        "subscribers served from both cores: {delivered:?}"
    );
    assert_eq!(
        c["records_delivered"].iter().sum::<u64>(),
        subs.len() as u64 * N
    );
    let appended: u64 = c["batches_appended"].iter().sum();
    assert_eq!(appended, batches);
    // Exactly one core has the shard and the other has subscribers: one mesh delivery per
    // batch, not one per subscriber.
    assert_eq!(
        c["mesh_deliveries_out"].iter().sum::<u64>(),
        batches,
        "one copy per core: {c:?}"
    );
    assert_eq!(c["mesh_deliveries_in"].iter().sum::<u64>(), batches);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_keys_pick_shards_and_whole_stream_subscribe_merges_them() {
    let b = Broker::start(2, &[]);
    let c = b.client().await;
    let mut sub = c
        .subscribe_stream(&events(), SubscribeOptions::default())
        .await
        .unwrap();
    assert_eq!(sub.ids.len(), 4, "one subscription per shard");
    let keys = ["alpha", "beta", "gamma", "delta", "user-1", "user-2"];
    let mut per_key: std::collections::HashMap<&str, Vec<Bytes>> = Default::default();
    for round in 0..10 {
        for k in keys {
            let p = Bytes::from(format!("{k}-{round}"));
            let ack = c
                .publish_batch(
                    &events(),
                    ShardSelector::Key(Bytes::from(k)),
                    vec![p.clone()],
                )
                .await
                .unwrap();
            assert_eq!(
                ack.shard,
                felix_quic::wire::hash::shard_for_key(k.as_bytes(), 4),
                "key {k} lands on its hash shard"
            );
            per_key.entry(k).or_default().push(p);
        }
    }
    let mut got: Vec<(u32, u64, Bytes)> = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    while got.len() < 60 {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let ev = sub
            .next_timeout(left)
            .await
            .expect("records in time")
            .expect("open");
        let Event::Records { shard, .. } = &ev else {
            panic!("unexpected {ev:?}")
        };
        let shard = *shard;
        for (o, p) in ev.records() {
            got.push((shard, o, p));
        }
    }
    for shard in 0..4 {
        let offs: Vec<u64> = got.iter().filter(|g| g.0 == shard).map(|g| g.1).collect();
        assert_eq!(
            offs,
            (0..offs.len() as u64).collect::<Vec<_>>(),
            "per-shard order kept in the merge"
        );
    }
    for (k, want) in per_key {
        let have: Vec<Bytes> = got
            .iter()
            .filter(|g| g.2.starts_with(k.as_bytes()))
            .map(|g| g.2.clone())
            .collect();
        assert_eq!(have, want, "key {k}: every record, in publish order");
    }
    // Round robin without a key visits every shard.
    let mut shards = std::collections::HashSet::new();
    for _ in 0..8 {
        shards.insert(c.publish(&events(), "rr").await.unwrap().shard);
    }
    assert_eq!(shards.len(), 4);
}

/// A subscriber that will not read: a tiny QUIC window and client buffer, so the broker's
/// queue (8 records) fills after a few dozen records.
/// A subscriber that reads nothing. `mux`: on the subscription mux (drop_new only), where the
/// client keeps reading the connection's one stream and applies drop_new itself; else on a
/// stream of its own with a small window, so the broker's queue for it fills.
async fn stalled(b: &Broker, policy: QueuePolicy, mux: bool) -> (Client, Subscription) {
    let mut cfg = b.client_config();
    cfg.transport.max_stream_data_uni_bytes = 2048;
    cfg.sub_mux = mux;
    let c = Client::connect(cfg).await.unwrap();
    let opts = SubscribeOptions {
        policy,
        queue_records_max: 8,
        buffer_events: 2,
        start: StartAt::Latest,
        ..Default::default()
    };
    let s = c.subscribe(&events(), 0, opts).await.unwrap();
    (c, s)
}

async fn fast_pair(b: &Broker) -> (Vec<Client>, Vec<Subscription>) {
    let mut cs = Vec::new();
    let mut ss = Vec::new();
    for _ in 0..2 {
        let c = b.client().await;
        ss.push(
            c.subscribe(&events(), 0, SubscribeOptions::default())
                .await
                .unwrap(),
        );
        cs.push(c);
    }
    (cs, ss)
}

async fn drop_policy_case(policy: QueuePolicy, mux: bool) {
    let b = Broker::start(2, &[]);
    let (_sc, mut slow) = stalled(&b, policy, mux).await;
    let (_fc, mut fast) = fast_pair(&b).await;
    let publisher = b.client().await;
    const N: u64 = 1500;
    // Fast readers drain concurrently while the publisher runs.
    let readers: Vec<_> = fast
        .drain(..)
        .map(|mut s| {
            tokio::spawn(async move {
                let mut seen = Seen::default();
                read_until(&mut s, &mut seen, N).await;
                seen
            })
        })
        .collect();
    for i in 0..N {
        // Never waits on the stalled subscriber: each ack comes back while it is full.
        let ack = tokio::time::timeout(
            WAIT,
            publisher.publish_batch(&events(), ShardSelector::Shard(0), vec![payload(i)]),
        )
        .await
        .expect("publisher never blocked by the stalled subscriber")
        .unwrap();
        assert_eq!(ack.first_offset, i);
    }
    for r in readers {
        let seen = r.await.unwrap();
        assert!(seen.lags.is_empty(), "fast subscribers lose nothing");
        assert_eq!(seen.offsets(0), (0..N).collect::<Vec<_>>());
    }
    // Now the stalled subscriber reads everything it was left with.
    let mut seen = Seen::default();
    read_until(&mut slow, &mut seen, N).await;
    seen.assert_exact_coverage(N);
    let lost: u64 = seen.lags.iter().map(|l| l.2).sum();
    assert!(lost > 0, "the stalled subscriber overflowed");
    assert_eq!(lost + seen.records.len() as u64, N);
    assert_eq!(
        seen.lags.len(),
        1,
        "one merged notice for one overflow: {:?}",
        seen.lags
    );
    let last = *seen.offsets(0).last().unwrap();
    match policy {
        QueuePolicy::DropNew => {
            assert_eq!(
                seen.offsets(0),
                (0..N - lost).collect::<Vec<_>>(),
                "drop_new keeps the oldest"
            );
            assert_eq!(
                seen.lags[0],
                (0, N - lost, lost),
                "the notice names the newest records"
            );
        }
        QueuePolicy::DropOld => {
            assert_eq!(last, N - 1, "drop_old keeps the newest");
            let (_, from, lost) = seen.lags[0];
            let kept_tail = seen
                .offsets(0)
                .iter()
                .filter(|o| **o >= from + lost)
                .count();
            assert_eq!(
                kept_tail, 8,
                "the full queue kept exactly its bound of newest records"
            );
        }
        QueuePolicy::Block => unreachable!(),
    }
    if mux {
        // Dropped in the client, which never stopped reading the mux stream: the broker's
        // queue for it never filled.
        assert_eq!(b.total("records_dropped"), 0, "the broker dropped nothing");
        return;
    }
    assert_eq!(
        b.total("records_dropped"),
        lost,
        "the broker counted the same loss it announced"
    );
    let (by_new, by_old) = match policy {
        QueuePolicy::DropNew => (lost, 0),
        _ => (0, lost),
    };
    assert_eq!(
        (
            b.total("records_dropped_new"),
            b.total("records_dropped_old")
        ),
        (by_new, by_old),
        "counted under its policy"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_new_isolates_a_stalled_subscriber_and_keeps_the_oldest() {
    drop_policy_case(QueuePolicy::DropNew, false).await;
}

/// The same on the subscription mux: the client applies drop_new to the subscriber whose
/// buffer is full, with one exact notice, and its fast neighbours lose nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_new_on_the_mux_isolates_a_stalled_subscriber_in_the_client() {
    drop_policy_case(QueuePolicy::DropNew, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_old_isolates_a_stalled_subscriber_and_keeps_the_newest() {
    drop_policy_case(QueuePolicy::DropOld, false).await;
}

/// Publish `n` records one per acked publish in a task; reports each acked offset.
fn spawn_publisher(
    c: Client,
    n: u64,
) -> (
    tokio::task::JoinHandle<Vec<Result<u64, Error>>>,
    tokio::sync::watch::Receiver<u64>,
) {
    let (tx, rx) = tokio::sync::watch::channel(0u64);
    let h = tokio::spawn(async move {
        let mut out = Vec::new();
        for i in 0..n {
            let r = c
                .publish_batch(&events(), ShardSelector::Shard(0), vec![payload(i)])
                .await
                .map(|a| a.first_offset);
            if r.is_ok() {
                let _ = tx.send(i + 1);
            }
            out.push(r);
        }
        out
    });
    (h, rx)
}

/// Wait until the acked count stops moving for `quiet` (the publisher is being held).
async fn wait_until_held(acked: &mut tokio::sync::watch::Receiver<u64>, quiet: Duration) -> u64 {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the publisher was never held"
        );
        match tokio::time::timeout(quiet, acked.changed()).await {
            Err(_) => return *acked.borrow(),
            Ok(r) => r.expect("publisher alive"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_holds_the_publisher_only_on_the_stalled_subscriber() {
    let b = Broker::start(2, &["--publish-timeout-ms", "60000"]);
    let (_sc, mut slow) = stalled(&b, QueuePolicy::Block, false).await;
    let (_fc, mut fast) = fast_pair(&b).await;
    const N: u64 = 400;
    let (pubh, mut acked) = spawn_publisher(b.client().await, N);
    let held_at = wait_until_held(&mut acked, Duration::from_millis(700)).await;
    assert!(
        held_at < N,
        "the stalled Block subscriber holds the publisher"
    );
    assert!(b.total("publishes_held") >= 1);
    // The fast subscribers already have every appended record while the publisher waits.
    let mut fast_seen: Vec<Seen> = Vec::new();
    for s in &mut fast {
        let mut seen = Seen::default();
        read_until(s, &mut seen, held_at).await;
        assert_eq!(seen.offsets(0), (0..held_at).collect::<Vec<_>>());
        fast_seen.push(seen);
    }
    // Resume the stalled subscriber: everything flows, nothing is lost anywhere.
    let mut slow_seen = Seen::default();
    read_until(&mut slow, &mut slow_seen, N).await;
    assert!(slow_seen.lags.is_empty(), "block never drops");
    assert_eq!(slow_seen.offsets(0), (0..N).collect::<Vec<_>>());
    let results = tokio::time::timeout(WAIT, pubh)
        .await
        .expect("publisher finishes")
        .unwrap();
    assert!(
        results.iter().all(|r| r.is_ok()),
        "every held publish was appended once resumed"
    );
    for (s, seen) in fast.iter_mut().zip(fast_seen.iter_mut()) {
        read_until(s, seen, N).await;
        assert_eq!(seen.offsets(0), (0..N).collect::<Vec<_>>());
    }
    assert_eq!(b.total("records_dropped"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_publish_times_out_unappended_and_inflight_cap_refuses_before_queueing() {
    let b = Broker::start(
        1,
        &["--publish-timeout-ms", "400", "--conn-unacked-max", "2"],
    );
    let (_sc, mut slow) = stalled(&b, QueuePolicy::Block, false).await;
    let publisher = b.client().await;
    // Fill the stalled subscriber until a publish is held and times out.
    let mut next = 0u64;
    let timed_out = loop {
        assert!(next < 2000, "a publish should have been held by now");
        match publisher
            .publish_batch(&events(), ShardSelector::Shard(0), vec![payload(next)])
            .await
        {
            Ok(a) => {
                assert_eq!(a.first_offset, next);
                next += 1;
            }
            Err(e) => break e,
        }
    };
    assert_eq!(
        timed_out.code(),
        Some(ErrorCode::PublishTimeout),
        "{timed_out}"
    );
    // While held, a connection at its unanswered-ack cap is refused at once with a
    // retryable inflight_limit (nothing queued).
    let held_before = b.total("publishes_held");
    let p2 = publisher.publisher();
    let p3 = publisher.publisher();
    let p4 = publisher.publisher();
    let h2 = tokio::spawn({
        let p = p2.clone();
        async move {
            p.publish_batch(
                &events(),
                ShardSelector::Shard(0),
                vec![Bytes::from("held-a")],
            )
            .await
        }
    });
    let h3 = tokio::spawn(async move {
        p3.publish_batch(
            &events(),
            ShardSelector::Shard(0),
            vec![Bytes::from("held-b")],
        )
        .await
    });
    // Wait (bounded) until both are held at the shard owner.
    let deadline = std::time::Instant::now() + WAIT;
    while b.total("publishes_held") < held_before + 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "publishes were not held"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let refused = p4
        .publish_batch(
            &events(),
            ShardSelector::Shard(0),
            vec![Bytes::from("refused")],
        )
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::InflightLimit), "{refused}");
    for h in [h2, h3] {
        let e = h.await.unwrap().unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::PublishTimeout));
    }
    // Resume: the stalled subscriber sees offsets 0..next and nothing of the refused ones;
    // the next publish continues at `next` (nothing was appended twice or out of order).
    let mut seen = Seen::default();
    read_until(&mut slow, &mut seen, next).await;
    assert_eq!(seen.offsets(0), (0..next).collect::<Vec<_>>());
    let a = publisher
        .publish_batch(
            &events(),
            ShardSelector::Shard(0),
            vec![Bytes::from("after")],
        )
        .await
        .unwrap();
    assert_eq!(a.first_offset, next);
    assert!(b.total("publish_timeouts") >= 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_refusals_lose_nothing() {
    let b = Broker::start(
        2,
        &["--max-payload-bytes", "1024", "--max-subscriptions", "2"],
    );
    let c = b.client().await;
    let code = |r: Result<felix_client::Ack, Error>| r.unwrap_err().code();
    assert_eq!(
        code(
            c.publish(&StreamName::new("default", "default", "nope"), "x")
                .await
        ),
        Some(ErrorCode::UnknownStream)
    );
    assert_eq!(
        code(
            c.publish(&StreamName::new("bad name", "default", "events"), "x")
                .await
        ),
        Some(ErrorCode::InvalidName)
    );
    assert_eq!(
        code(
            c.publish(&StreamName::new("default", "nope", "events"), "x")
                .await
        ),
        Some(ErrorCode::UnknownNamespace)
    );
    assert_eq!(
        code(
            c.publish_batch(&events(), ShardSelector::Shard(9), vec!["x"])
                .await
        ),
        Some(ErrorCode::UnknownShard)
    );
    let big = Bytes::from(vec![7u8; 1025]);
    assert_eq!(
        code(
            c.publish_batch(
                &events(),
                ShardSelector::Shard(0),
                vec![Bytes::from("ok"), big]
            )
            .await
        ),
        Some(ErrorCode::PayloadTooLarge)
    );
    // Nothing of the refused batch was appended.
    let a = c
        .publish_batch(&events(), ShardSelector::Shard(0), vec!["first"])
        .await
        .unwrap();
    assert_eq!(a.first_offset, 0);
    let _s1 = c
        .subscribe(&events(), 0, SubscribeOptions::default())
        .await
        .unwrap();
    let _s2 = c
        .subscribe(&events(), 1, SubscribeOptions::default())
        .await
        .unwrap();
    match c.subscribe(&events(), 2, SubscribeOptions::default()).await {
        Err(e) => assert_eq!(e.code(), Some(ErrorCode::TooManySubscriptions)),
        Ok(_) => panic!("third subscription accepted past max_subscriptions 2"),
    }
    match c
        .subscribe(
            &events(),
            0,
            SubscribeOptions {
                start: StartAt::Offset(99),
                ..Default::default()
            },
        )
        .await
    {
        Err(e) => assert_eq!(e.code(), Some(ErrorCode::TooManySubscriptions)),
        Ok(_) => panic!("accepted"),
    }
    let c2 = b.client().await;
    match c2
        .subscribe(
            &events(),
            0,
            SubscribeOptions {
                start: StartAt::Offset(99),
                ..Default::default()
            },
        )
        .await
    {
        Err(e) => assert_eq!(
            e.code(),
            Some(ErrorCode::InvalidRequest),
            "offset beyond the end"
        ),
        Ok(_) => panic!("accepted an offset beyond the end"),
    }
    // Replay from the ring: earliest gets the one record appended.
    let mut s = c2
        .subscribe(
            &events(),
            0,
            SubscribeOptions {
                start: StartAt::Earliest,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let ev = s.next_timeout(WAIT).await.unwrap().unwrap();
    assert_eq!(ev.records(), vec![(0, Bytes::from("first"))]);
}

/// A publish held by a stalled Block subscriber keeps the drain busy: a second SIGTERM forces
/// the exit at once (exit code 3); without it, the drain deadline forces it (also 3). The
/// stall is not perfectly steady (the stalled client still trickles flow-control credit), so a
/// drain may find nothing held and exit 0; each path gets up to five fresh brokers and must
/// be seen forced at least once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_a_held_publish_is_forced_by_a_second_signal_or_the_deadline() {
    for second_signal in [true, false] {
        let mut forced = false;
        for _attempt in 0..5 {
            let b = Broker::start(
                2,
                &[
                    "--publish-timeout-ms",
                    "60000",
                    "--drain-timeout-ms",
                    "4000",
                ],
            );
            let (_sc, _slow) = stalled(&b, QueuePolicy::Block, false).await;
            let (_pubh, mut acked) = spawn_publisher(b.client().await, 400);
            let held_at = wait_until_held(&mut acked, Duration::from_millis(700)).await;
            assert!(held_at < 400, "a publish is held");
            let t0 = std::time::Instant::now();
            b.signal(libc::SIGTERM);
            if second_signal {
                tokio::time::sleep(Duration::from_millis(200)).await;
                b.signal(libc::SIGTERM);
            }
            let (code, _dir) =
                tokio::task::spawn_blocking(move || b.wait_exit(Duration::from_secs(10)))
                    .await
                    .unwrap();
            let took = t0.elapsed();
            match code {
                Some(0) => continue, // nothing was held when the drain looked: try again
                Some(3) if second_signal => {
                    assert!(
                        took < Duration::from_millis(1500),
                        "second signal forces at once: {took:?}"
                    );
                }
                Some(3) => {
                    // Half the budget (2 s) answering before the deadline cuts it.
                    assert!(
                        took >= Duration::from_millis(1800),
                        "drain waited for its deadline: {took:?}"
                    );
                }
                other => panic!("exit {other:?} (second signal: {second_signal})"),
            }
            forced = true;
            break;
        }
        assert!(
            forced,
            "no forced exit seen (second signal: {second_signal})"
        );
    }
}

/// Drops are counted when they happen, not when the notice that announces them is finally
/// written: a subscriber whose stream is not read at all has received no Lag, yet the
/// broker's `records_dropped_new` already shows its losses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drops_are_counted_while_the_subscriber_is_still_stalled() {
    use common::raw::Raw;
    use felix_quic::wire::Frame;
    let b = Broker::start(1, &[]);
    // A 16 KiB window on the subscription stream, and the stream never read.
    let mut raw = Raw::connect(b.quic, &b.ca(), 1 << 24, 16 << 10).await;
    raw.hello(1 << 24).await;
    raw.send(
        0,
        &Frame::Subscribe {
            request_id: 1,
            stream: events(),
            shard: 0,
            start: StartAt::Latest,
            policy: QueuePolicy::DropNew,
            queue_records_max: 4,
            queue_bytes_max: 0,
        },
    );
    let (sub_stream, _) = raw.next_server_uni().await;
    raw.pause(sub_stream);
    assert!(matches!(raw.next_on(0).await, Frame::SubscribeOk { .. }));
    let publisher = b.client().await;
    const N: u64 = 200;
    for i in 0..N {
        publisher
            .publish_batch(
                &events(),
                ShardSelector::Shard(0),
                vec![vec![i as u8; 1000]],
            )
            .await
            .unwrap();
    }
    // At most 4 queued and ~16 in the window reach the subscriber; the rest are lost now.
    let mut dropped = 0;
    for _ in 0..100 {
        dropped = b.total("records_dropped_new");
        if dropped >= N - 4 - 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(dropped >= N - 4 - 20, "dropped_new {dropped} while stalled");
    assert_eq!(b.total("records_dropped_old"), 0);
    assert_eq!(b.total("lag_notices"), 0, "no notice could be written yet");
}

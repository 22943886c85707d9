//! Broker + control plane, all real processes: `felix-controlplane`, `felix-broker`
//! registered to it (`--controlplane-url`), `felixctl` for administration, the Rust client
//! over QUIC for data.

use felix_client::{Client, Error, Event, SubscribeOptions};
use felix_quic::wire::{ErrorCode, ShardSelector, StartAt, StreamName};
use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

mod common;
use common::cp::{eventually, felixctl, start_control_plane, ControlPlane};
use common::Broker;

fn ok(o: Output) -> String {
    assert!(
        o.status.success(),
        "felixctl failed ({:?}): {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

fn start_broker(cp: &ControlPlane, durable: &Path) -> Broker {
    Broker::start(
        2,
        &[
            "--controlplane-url",
            &cp.url,
            "--node-id",
            "1",
            "--durable-storage-dir",
            durable.to_str().unwrap(),
        ],
    )
}

/// An acked publish, retried while the answer is retryable (a durable log still opening).
async fn publish(c: &Client, s: &StreamName, shard: u32, p: &str) -> Result<u64, Error> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match c
            .publish_batch(s, ShardSelector::Shard(shard), vec![p.to_string()])
            .await
        {
            Ok(a) => return Ok(a.first_offset),
            Err(Error::Broker {
                code: ErrorCode::Unavailable,
                ..
            }) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => return Err(e),
        }
    }
}

/// Subscribe to shard 0 from the earliest retained record.
async fn subscribe_earliest(c: &Client, s: &StreamName) -> felix_client::Subscription {
    let opts = SubscribeOptions {
        start: StartAt::Earliest,
        ..Default::default()
    };
    c.subscribe(s, 0, opts).await.unwrap()
}

fn stream_dirs(durable: &Path, stream: &str) -> Vec<String> {
    let ns = durable.join("acme").join("prod");
    let mut v: Vec<String> = std::fs::read_dir(&ns)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| n.starts_with(&format!("{stream}@")))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn felixctl_stream_then_publish_subscribe_delete_and_recreate() {
    let cp = start_control_plane(5_000);
    let tmp = tempfile::tempdir().unwrap();
    let durable = tmp.path().join("durable");
    let b = start_broker(&cp, &durable);
    let c = b.client().await;
    let orders = StreamName::new("acme", "prod", "orders");

    // Before the tenant exists the broker says so, typed.
    match c.describe_stream(&orders).await {
        Err(Error::Broker {
            code: ErrorCode::UnknownTenant,
            ..
        }) => {}
        other => panic!("expected unknown_tenant, got {other:?}"),
    }
    let scope = ["--tenant", "acme", "--namespace", "prod"];
    let ctl = |args: &[&str]| {
        let mut a = scope.to_vec();
        a.extend_from_slice(args);
        felixctl(&cp, tmp.path(), &a)
    };
    ok(felixctl(&cp, tmp.path(), &["tenant", "create", "acme"]));
    ok(felixctl(
        &cp,
        tmp.path(),
        &["--tenant", "acme", "namespace", "create", "prod"],
    ));
    ok(ctl(&[
        "stream",
        "create",
        "orders",
        "--shards",
        "2",
        "--durable",
        "--fsync",
        "on_commit",
    ]));
    let info = eventually("stream visible on the broker", || async {
        c.describe_stream(&orders).await.map_err(|e| e.to_string())
    })
    .await;
    assert_eq!((info.shards, info.durable), (2, true));

    let mut sub = subscribe_earliest(&c, &orders).await;
    for i in 0..10u64 {
        assert_eq!(publish(&c, &orders, 0, &format!("r{i}")).await.unwrap(), i);
    }
    let mut got = Vec::new();
    while got.len() < 10 {
        match sub.next_timeout(Duration::from_secs(10)).await.unwrap() {
            Some(ev @ Event::Records { .. }) => got.extend(ev.records()),
            other => panic!("unexpected {other:?}"),
        }
    }
    let offsets: Vec<u64> = got.iter().map(|(o, _)| *o).collect();
    assert_eq!(offsets, (0..10).collect::<Vec<_>>());
    let dirs = stream_dirs(&durable, "orders");
    assert_eq!(dirs.len(), 1, "one incarnation directory: {dirs:?}");

    // Delete: the subscription ends with stream_deleted, publishes are refused, files go.
    ok(ctl(&["stream", "rm", "orders", "--yes"]));
    let end = loop {
        match sub.next_timeout(Duration::from_secs(10)).await.unwrap() {
            Some(Event::End { code, message, .. }) => break (code, message),
            Some(Event::Records { .. }) => continue,
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(end.0, ErrorCode::StreamDeleted.number(), "{}", end.1);
    match c
        .publish_batch(&orders, ShardSelector::Shard(0), vec!["late".to_string()])
        .await
    {
        Err(Error::Broker { code, .. })
            if code == ErrorCode::UnknownStream || code == ErrorCode::StreamDeleted => {}
        other => panic!("expected unknown_stream or stream_deleted, got {other:?}"),
    }
    eventually("deleted stream's logs removed", || async {
        let d = stream_dirs(&durable, "orders");
        if d.is_empty() {
            Ok(())
        } else {
            Err(format!("{d:?}"))
        }
    })
    .await;

    // Created again (once the control plane finished the delete): a new incarnation with
    // fresh offsets, nothing of the old records.
    eventually("re-create after the delete finished", || async {
        let o = ctl(&["stream", "create", "orders", "--shards", "1", "--durable"]);
        if o.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&o.stderr).to_string())
        }
    })
    .await;
    let info = eventually("new incarnation visible", || async {
        match c.describe_stream(&orders).await {
            Ok(i) if i.shards == 1 => Ok(i),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert!(info.durable);
    assert_eq!(publish(&c, &orders, 0, "fresh").await.unwrap(), 0);
    let mut sub = subscribe_earliest(&c, &orders).await;
    match sub.next_timeout(Duration::from_secs(10)).await.unwrap() {
        Some(ev @ Event::Records { .. }) => {
            assert_eq!(ev.records(), vec![(0, bytes::Bytes::from("fresh"))])
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(stream_dirs(&durable, "orders").len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caches_from_the_control_plane_are_served_and_deleting_one_ends_its_watches() {
    use felix_client::{WatchFilter, WatchItem, WatchOptions, WatchStart};
    let cp = start_control_plane(5_000);
    let tmp = tempfile::tempdir().unwrap();
    let b = start_broker(&cp, &tmp.path().join("durable"));
    let c = b.client().await;
    let sessions = StreamName::new("acme", "prod", "sessions");
    let ctl = |args: &[&str]| {
        let mut a = vec!["--tenant", "acme", "--namespace", "prod"];
        a.extend_from_slice(args);
        felixctl(&cp, tmp.path(), &a)
    };
    ok(felixctl(&cp, tmp.path(), &["tenant", "create", "acme"]));
    ok(felixctl(
        &cp,
        tmp.path(),
        &["--tenant", "acme", "namespace", "create", "prod"],
    ));
    ok(ctl(&[
        "cache",
        "create",
        "sessions",
        "--shards",
        "2",
        "--ttl-seconds",
        "60",
    ]));
    ok(ctl(&["cache", "create", "logged", "--durable"]));
    let info = eventually("cache visible on the broker", || async {
        c.describe_cache(&sessions).await.map_err(|e| e.to_string())
    })
    .await;
    assert_eq!(
        (info.shards, info.durable, info.default_ttl_ms),
        (2, false, Some(60_000))
    );
    let w = c.cache_put(&sessions, "u1", "alice", None).await.unwrap();
    assert!(
        w.expires_at_ms.is_some(),
        "the cache's ttl_seconds is the default TTL"
    );
    assert_eq!(
        c.cache_get(&sessions, "u1").await.unwrap().unwrap().value,
        bytes::Bytes::from("alice")
    );
    // A log-backed cache: served from its logs under the durable dir; deleting it removes them.
    let logged = StreamName::new("acme", "prod", "logged");
    eventually("durable cache visible", || async {
        c.cache_put(&logged, "k", "v", None)
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    let cache_dirs = || -> Vec<String> {
        std::fs::read_dir(tmp.path().join("durable/@caches/acme/prod"))
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().to_string())
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(cache_dirs().len(), 1, "{:?}", cache_dirs());
    assert!(cache_dirs()[0].starts_with("logged@"), "{:?}", cache_dirs());
    ok(ctl(&["cache", "rm", "logged", "--yes"]));
    eventually("the deleted cache's logs removed", || async {
        if cache_dirs().is_empty() {
            Ok(())
        } else {
            Err(format!("{:?}", cache_dirs()))
        }
    })
    .await;
    let mut watch = c
        .cache_watch(
            &sessions,
            WatchFilter::Key("u1".into()),
            WatchStart::Current,
            WatchOptions::default(),
        )
        .await
        .unwrap();
    match watch.next_timeout(Duration::from_secs(10)).await.unwrap() {
        Some(WatchItem::Event { value, .. }) => assert_eq!(value, bytes::Bytes::from("alice")),
        other => panic!("unexpected {other:?}"),
    }
    ok(ctl(&["cache", "rm", "sessions", "--yes"]));
    let end = loop {
        match watch.next_timeout(Duration::from_secs(10)).await.unwrap() {
            Some(WatchItem::End { code, message, .. }) => break (code, message),
            Some(_) => continue,
            None => panic!("watch closed without an end"),
        }
    };
    assert_eq!(end.0, ErrorCode::NotFound.number(), "{}", end.1);
    let e = c.cache_get(&sessions, "u1").await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}");
    drop(watch);
    c.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_placed_on_another_broker_answer_not_leader_naming_it() {
    // A long dead-after, so the second (REST-only) broker stays live for the whole test.
    let cp = start_control_plane(120_000);
    let tmp = tempfile::tempdir().unwrap();
    let b = start_broker(&cp, &tmp.path().join("durable"));
    let http = reqwest::Client::new();
    let r = http
        .post(format!("{}/v1/brokers", cp.url))
        .json(&serde_json::json!({"node_id": 2, "quic_addr": "127.0.0.1:9", "cores": 1}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{:?}", r.text().await);
    ok(felixctl(&cp, tmp.path(), &["tenant", "create", "acme"]));
    ok(felixctl(
        &cp,
        tmp.path(),
        &["--tenant", "acme", "namespace", "create", "prod"],
    ));
    ok(felixctl(
        &cp,
        tmp.path(),
        &[
            "--tenant",
            "acme",
            "--namespace",
            "prod",
            "stream",
            "create",
            "spread",
            "--shards",
            "4",
        ],
    ));
    let s: serde_json::Value = http
        .get(format!(
            "{}/v1/tenants/acme/namespaces/prod/streams/spread",
            cp.url
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let owners: Vec<u64> = s["placement"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["owner"].as_u64().unwrap())
        .collect();
    assert!(
        owners.contains(&1) && owners.contains(&2),
        "spread over both: {owners:?}"
    );

    let c = b.client().await;
    let name = StreamName::new("acme", "prod", "spread");
    eventually("stream visible", || async {
        c.describe_stream(&name).await.map_err(|e| e.to_string())
    })
    .await;
    for (shard, owner) in owners.iter().enumerate() {
        let r = c
            .publish_batch(
                &name,
                ShardSelector::Shard(shard as u32),
                vec!["x".to_string()],
            )
            .await;
        match (owner, r) {
            (1, Ok(_)) => {}
            (2, Err(Error::Broker { code, message })) => {
                assert_eq!(code, ErrorCode::NotLeader);
                assert!(message.contains("broker 2 at 127.0.0.1:9"), "{message}");
            }
            (o, r) => panic!("shard {shard} owned by {o}: {r:?}"),
        }
        let sub = c
            .subscribe(&name, shard as u32, SubscribeOptions::default())
            .await;
        match (owner, sub) {
            (1, Ok(_)) => {}
            (2, Err(Error::Broker { code, .. })) => assert_eq!(code, ErrorCode::NotLeader),
            (o, r) => panic!("subscribe shard {shard} owned by {o}: {:?}", r.map(|_| ())),
        }
    }
}

/// A broker whose control plane dies keeps serving its last catalog, and its /readyz says the
/// catalog source is lost; when the control plane is back, the note goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_shows_a_lost_catalog_source() {
    let cp = start_control_plane(5_000);
    let durable = tempfile::tempdir().unwrap();
    let b = start_broker(&cp, durable.path());
    let ready = b.http_get("/readyz");
    assert!(
        ready.contains("200 OK") && !ready.contains("lost"),
        "{ready}"
    );
    drop(cp);
    let body = eventually("readyz names the lost source", || async {
        let r = b.http_get("/readyz");
        if r.contains("catalog source lost") {
            Ok(r)
        } else {
            Err(r)
        }
    })
    .await;
    assert!(body.contains("200 OK"), "still serving: {body}");
    assert!(body.contains("serving the last catalog"), "{body}");
}

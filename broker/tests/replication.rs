//! Replicated shards on real brokers (issue 23's data path, **partial**): a control plane run
//! with `--replication-preview`, three `felix-broker` processes with peer listeners (mutual
//! TLS from one cluster CA). The replicas of a stream of three copies fence, elect and ship
//! over the peer links, and the leader's reports land in the control plane, which shows the
//! generation-start record committed on every replica. Publishes on its leader (or forwarded
//! there by a follower) are acknowledged at the commit mark, a subscriber receives exactly the
//! committed records, and after the leader is killed the new leader serves every
//! acknowledged record at its offset.

use bytes::Bytes;
use felix_client::{
    Client, ClientConfig, ClusterClient, ClusterConfig, Event, GroupOptions, SubscribeOptions,
    Subscription,
};
use felix_quic::tls::generate_cluster_certs;
use felix_quic::wire::{ErrorCode, ShardSelector, StartAt, StreamName};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

mod common;
use common::cluster::{start_node, wait_for_storage_ids};
use common::cp::{felixctl, start_control_plane};
use common::{ok, Broker};

/// `GET .../streams/{name}/replication` of tenant acme, namespace prod.
async fn replication(url: &str, name: &str) -> serde_json::Value {
    reqwest::get(format!(
        "{url}/v1/tenants/acme/namespaces/prod/streams/{name}/replication"
    ))
    .await
    .unwrap()
    .json()
    .await
    .unwrap()
}

/// A client of `b`, trusting the cluster CA the test's brokers present.
async fn client(b: &Broker) -> Client {
    let ca = CLUSTER_CA.get().expect("set at the start").clone();
    Client::connect(ClientConfig::new(b.quic, Some(ca)))
        .await
        .expect("connect")
}

/// The cluster CA of the test's certificates.
static CLUSTER_CA: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// Retry `f` while it is refused with a retryable code a new leadership answers (fencing,
/// waiting out the old lease, its first commit; `not_leader` while a client follows it): 20 s
/// at most.
async fn retrying<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, felix_client::Error>>,
{
    let t = Instant::now();
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e)
                if matches!(
                    e.code(),
                    Some(ErrorCode::Unavailable | ErrorCode::NotLeader)
                ) =>
            {
                assert!(t.elapsed() < Duration::from_secs(20), "{what}: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

/// Subscribe to shard 0 of `name` from `start`, retrying while the leadership is not serving.
async fn subscribe(c: &Client, name: &StreamName, start: StartAt) -> Subscription {
    let opts = SubscribeOptions {
        start,
        ..SubscribeOptions::default()
    };
    retrying("subscribe", || c.subscribe(name, 0, opts.clone())).await
}

/// The next `n` records of `sub`, as `(offset, payload)`; 20 s at most.
async fn records(sub: &mut Subscription, n: usize) -> Vec<(u64, Bytes)> {
    let mut out = Vec::new();
    let t = Instant::now();
    while out.len() < n {
        let left = Duration::from_secs(20).saturating_sub(t.elapsed());
        match sub.next_timeout(left).await {
            Ok(Some(ev @ Event::Records { .. })) => out.extend(ev.records()),
            other => panic!("after {} of {n} records: {other:?}", out.len()),
        }
    }
    out
}

/// Publish `batch` to shard 0 through `c`, retrying while the leadership is not serving; the
/// offset of its first record.
async fn publish(c: &Client, name: &StreamName, batch: &[String]) -> u64 {
    let a = retrying("publish", || {
        c.publish_batch(name, ShardSelector::Shard(0), batch.to_vec())
    })
    .await;
    assert_eq!(a.count as usize, batch.len());
    a.first_offset
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_on_three_brokers_elect_ship_and_report_through_the_control_plane() {
    // Inherited by the control plane (and harmlessly by the brokers): this test process
    // starts no other.
    std::env::set_var("FELIX_REPLICATION_PREVIEW", "true");
    // A broker silent for 1.5 s is counted dead, and its shards' leadership moves.
    let cp = start_control_plane(1_500);
    let tmp = tempfile::tempdir().unwrap();
    let certs = tmp.path().join("certs");
    generate_cluster_certs(&certs, &[1, 2, 3]).unwrap();
    CLUSTER_CA.set(certs.join("ca.pem")).unwrap();
    let dirs: Vec<String> = (1..=3)
        .map(|i| {
            tmp.path()
                .join(format!("durable-{i}"))
                .display()
                .to_string()
        })
        .collect();
    let mut nodes: Vec<_> = (1..=3u64)
        .map(|i| {
            let dir = &dirs[i as usize - 1];
            // Client certificates from the cluster CA too, so one ClusterClient trusts all.
            let cert = certs.join(format!("node-{i}.pem")).display().to_string();
            let key = certs
                .join(format!("node-{i}-key.pem"))
                .display()
                .to_string();
            let args = [
                "--durable-storage-dir",
                dir,
                "--tls-cert",
                &cert,
                "--tls-key",
                &key,
            ];
            start_node(&cp, &certs, i, &args)
        })
        .collect();
    let ctl = |args: &[&str]| ok(felixctl(&cp, tmp.path(), args));
    // Three brokers registered with a storage identity, or a stream of three copies is
    // refused (and would wait unplaced).
    wait_for_storage_ids(&cp, 3).await;
    ctl(&["tenant", "create", "acme"]);
    ctl(&["--tenant", "acme", "namespace", "create", "prod"]);
    let ns = ["--tenant", "acme", "--namespace", "prod"];
    ctl(&[
        &ns[..],
        &[
            "stream",
            "create",
            "r3",
            "--durable",
            "--replication-factor",
            "3",
            "--consistency",
            "quorum",
        ],
    ]
    .concat());

    // The leader fences the others, writes its generation-start record, ships it, and
    // reports: once a report lands, the mark covers it on all three.
    let t = Instant::now();
    let shard = loop {
        let v = replication(&cp.url, "r3").await;
        let s = v["shards"][0].clone();
        let ends: Vec<u64> = s["replicas"].as_array().map_or(Vec::new(), |r| {
            r.iter().filter_map(|x| x["end"].as_u64()).collect()
        });
        if s["commit"].as_u64() >= Some(1) && ends.len() == 3 && ends.iter().all(|&e| e >= 1) {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no landed report shows the replicas holding the generation start: {v}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("replication: {shard}");
    let leader = shard["leader"].as_u64().unwrap();
    assert!(
        shard["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .all(|x| x["vouched"] == true && x["lag_records"] == 0),
        "{shard}"
    );
    let lead = &nodes[leader as usize - 1];
    assert!(lead.total("replica_elections") >= 1);
    assert!(
        lead.total("replica_msgs_sent") >= 2,
        "a fence to each follower"
    );
    let followers_routed: u64 = nodes
        .iter()
        .filter(|n| !std::ptr::eq(*n, lead))
        .map(|n| n.total("replica_msgs_routed"))
        .sum();
    assert!(followers_routed >= 2, "{followers_routed}");
    // A subscriber from the start, then ten batches of three published on the leader: each
    // is acknowledged at the commit mark, at contiguous offsets after the generation-start
    // record (offset 0), and the subscriber receives that record (an empty payload) and
    // every acknowledged one, in order.
    let c = client(lead).await;
    let name = StreamName::new("acme", "prod", "r3");
    let mut sub = subscribe(&c, &name, StartAt::Earliest).await;
    let mut acked: BTreeMap<u64, Bytes> = BTreeMap::new();
    for i in 0..10 {
        let batch: Vec<String> = (0..3).map(|k| format!("a{i}.{k}")).collect();
        let at = publish(&c, &name, &batch).await;
        for (k, p) in batch.iter().enumerate() {
            acked.insert(at + k as u64, Bytes::from(p.clone()));
        }
    }
    assert_eq!(
        acked.keys().copied().collect::<Vec<_>>(),
        (1..31).collect::<Vec<_>>()
    );
    let got = records(&mut sub, 31).await;
    assert_eq!(got[0], (0, Bytes::new()), "the generation-start record");
    assert_eq!(
        got[1..].to_vec(),
        acked.clone().into_iter().collect::<Vec<_>>()
    );
    // Through a follower: forwarded to the leader over the peer link.
    let follower = nodes.iter().find(|n| !std::ptr::eq(*n, lead)).unwrap();
    let cf = client(follower).await;
    let at = publish(&cf, &name, &["via-follower".to_string()]).await;
    assert_eq!(at, 31);
    acked.insert(at, Bytes::from_static(b"via-follower"));
    // An empty record would read as a generation's start: refused, nothing written.
    let e = c
        .publish_batch(&name, ShardSelector::Shard(0), vec![Bytes::new()])
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::InvalidRequest), "{e}");
    assert_eq!(records(&mut sub, 1).await, vec![(31, acked[&31].clone())]);
    // The leader counted them: acknowledged, each with its quorum wait, and the empty
    // record refused.
    assert!(lead.total("replica_publishes_acked") >= 11);
    assert!(lead.total("replica_quorum_wait_seconds_count") >= 11);
    assert!(lead.total("replica_publishes_refused") >= 1);
    let metrics = lead.http_get("/metrics");
    let posted = metrics
        .lines()
        .find_map(|l| l.strip_prefix("felix_replica_reports_posted_total "))
        .and_then(|v| v.trim().parse::<u64>().ok());
    assert!(
        posted >= Some(1),
        "the leader's reports were posted: {posted:?}"
    );
    // Consumer groups do not serve replicated shards yet: refused, typed.
    let e = c
        .group_create(&name, "g", Some(0), GroupOptions::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Unsupported), "{e}");
    drop(sub);
    // A `leader` stream of three copies: a publish is answered once its leader wrote it, and
    // its readers still see it only once committed.
    ctl(&[
        &ns[..],
        &[
            "stream",
            "create",
            "r3l",
            "--durable",
            "--replication-factor",
            "3",
        ],
    ]
    .concat());
    let t = Instant::now();
    let l_leader = loop {
        let v = replication(&cp.url, "r3l").await;
        if v["shards"][0]["commit"].as_u64() >= Some(1) {
            break v["shards"][0]["leader"].as_u64().unwrap();
        }
        assert!(t.elapsed() < Duration::from_secs(30), "r3l: {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let cl = client(&nodes[l_leader as usize - 1]).await;
    let lname = StreamName::new("acme", "prod", "r3l");
    let mut lsub = subscribe(&cl, &lname, StartAt::Earliest).await;
    let at = publish(&c, &lname, &["l0".to_string(), "l1".to_string()]).await;
    assert_eq!(at, 1);
    let want = vec![
        (0, Bytes::new()),
        (1, Bytes::from_static(b"l0")),
        (2, Bytes::from_static(b"l1")),
    ];
    assert_eq!(records(&mut lsub, 3).await, want);
    drop(lsub);

    // The leader is killed (SIGKILL): once the control plane counts it dead, it promotes a
    // follower at the mark (rule 8) in generation 2; that one fences the other, writes its
    // own generation-start record at offset 32 and ships it, and its report lands.
    let gone = nodes.remove(leader as usize - 1);
    let gone_addr = gone.quic.to_string();
    let _dir = gone.kill();
    let t = Instant::now();
    let shard = loop {
        let v = replication(&cp.url, "r3").await;
        let s = v["shards"][0].clone();
        let live_at_2 = s["replicas"].as_array().map_or(0, |r| {
            r.iter()
                .filter(|x| x["live"] == true && x["last_generation"] == 2 && x["end"] == 33)
                .count()
        });
        if s["generation"] == 2 && s["commit"] == 33 && live_at_2 == 2 {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no failover to a follower committed generation 2: {v}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("after the failover: {shard}");
    let new_leader = shard["leader"].as_u64().unwrap();
    assert_ne!(new_leader, leader);
    assert_eq!(shard["state"], "assigned");
    // The new leader serves every acknowledged record at its offset, both generation-start
    // records, and takes publishes after them; a resume by offset starts exactly there.
    let nl = nodes
        .iter()
        .find(|n| n.total("replica_elections") >= 1)
        .expect("the new leader counted its election");
    let c2 = client(nl).await;
    let at = publish(&c2, &name, &["b0".to_string()]).await;
    assert_eq!(at, 33);
    acked.insert(at, Bytes::from_static(b"b0"));
    let mut sub = subscribe(&c2, &name, StartAt::Earliest).await;
    let got: BTreeMap<u64, Bytes> = records(&mut sub, 34).await.into_iter().collect();
    assert_eq!(
        got.keys().copied().collect::<Vec<_>>(),
        (0..34).collect::<Vec<_>>()
    );
    for (o, p) in &acked {
        assert_eq!(&got[o], p, "acknowledged record at {o}");
    }
    assert!(
        got[&0].is_empty() && got[&32].is_empty(),
        "the two generations' start records"
    );
    let mut resumed = subscribe(&c2, &name, StartAt::Offset(20)).await;
    let first = records(&mut resumed, 1).await;
    assert_eq!(first[0], (20, acked[&20].clone()), "no gap, no duplicate");
    // A ClusterClient seeded with all three addresses (one dead) follows the stream to the
    // new leader.
    let seeds: Vec<String> = nodes
        .iter()
        .map(|n| n.quic.to_string())
        .chain([gone_addr])
        .collect();
    let mut cfg = ClusterConfig::new(&seeds.join(","), CLUSTER_CA.get().cloned()).unwrap();
    cfg.connect_timeout = Duration::from_millis(500);
    let cc = ClusterClient::connect(cfg).await.unwrap();
    let a = retrying("cluster publish", || {
        cc.publish_batch(&name, ShardSelector::Shard(0), vec!["c0".to_string()])
    })
    .await;
    assert_eq!((a.first_offset, a.owner), (34, Some(new_leader)));
    // Each replica holds its log in the stream incarnation's directory.
    let holds_r3 = |dir: &str| {
        std::fs::read_dir(std::path::Path::new(dir).join("acme").join("prod"))
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .any(|e| e.file_name().to_string_lossy().starts_with("r3@"))
            })
            .unwrap_or(false)
    };
    let live_dirs: Vec<&String> = dirs
        .iter()
        .enumerate()
        .filter(|(i, _)| *i as u64 + 1 != leader)
        .map(|(_, d)| d)
        .collect();
    assert!(live_dirs.iter().all(|d| holds_r3(d)), "{live_dirs:?}");

    // Deleted: the live brokers stop hosting its replicas and remove their files.
    ctl(&[&ns[..], &["--yes", "stream", "rm", "r3"]].concat());
    let t = Instant::now();
    while live_dirs.iter().any(|d| holds_r3(d)) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "a deleted stream's replica files stay: {live_dirs:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

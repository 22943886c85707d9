//! Replicated shards on real brokers (issue 23's data path, **partial**): a control plane run
//! with `--replication-preview`, three `felix-broker` processes with peer listeners (mutual
//! TLS from one cluster CA). The replicas of a stream of three copies fence, elect and ship
//! over the peer links, and the leader's reports land in the control plane, which shows the
//! generation-start record committed on every replica. Publishes to such a stream are still
//! refused `unsupported`.

use felix_quic::tls::generate_cluster_certs;
use felix_quic::wire::{ErrorCode, ShardSelector, StreamName};
use std::time::{Duration, Instant};

mod common;
use common::cluster::start_node;
use common::cp::{felixctl, start_control_plane};
use common::ok;

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
            start_node(&cp, &certs, i, &["--durable-storage-dir", dir])
        })
        .collect();
    let ctl = |args: &[&str]| ok(felixctl(&cp, tmp.path(), args));
    // Three brokers registered with a storage identity, or a stream of three copies is
    // refused (and would wait unplaced).
    let t = Instant::now();
    loop {
        let v: serde_json::Value = reqwest::get(format!("{}/v1/brokers", cp.url))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let with_id = v.as_array().map_or(0, |a| {
            a.iter().filter(|b| b["storage_id"].is_string()).count()
        });
        if with_id == 3 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "brokers: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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
    // Publishes are not taken by replicated shards yet: refused, typed, naming the leader.
    let c = lead.client().await;
    let name = StreamName::new("acme", "prod", "r3");
    let e = c
        .publish_batch(&name, ShardSelector::Shard(0), vec!["x".to_string()])
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Unsupported), "{e}");

    // The leader is killed (SIGKILL): once the control plane counts it dead, it promotes a
    // follower at the mark (rule 8) in generation 2; that one fences the other, writes its
    // own generation-start record at offset 1 and ships it, and its report lands.
    let gone = nodes.remove(leader as usize - 1);
    let _dir = gone.kill();
    let t = Instant::now();
    let shard = loop {
        let v = replication(&cp.url, "r3").await;
        let s = v["shards"][0].clone();
        let live_at_2 = s["replicas"].as_array().map_or(0, |r| {
            r.iter()
                .filter(|x| x["live"] == true && x["last_generation"] == 2 && x["end"] == 2)
                .count()
        });
        if s["generation"] == 2 && s["commit"] == 2 && live_at_2 == 2 {
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

//! Several brokers as one service, all real processes on loopback: `felix-controlplane`, three
//! `felix-broker`s with peer listeners (mutual TLS from one cluster CA), the Rust client and
//! raw peer connections over QUIC. Brokers run `--cores 1 --spin-before-park-us 0`: three
//! share this machine's two cores.

use felix_client::{Error, SubscribeOptions};
use felix_quic::tls::generate_cluster_certs;
use felix_quic::wire::{ErrorCode, Frame, PeerFrame, ShardSelector, StartAt, StreamName};
use std::time::{Duration, Instant};

mod common;
use common::cluster::{
    cluster_id, make_resources, make_resources_with, placement, publish_forward, raw_peer,
    raw_peer_with, refusal_of, start_node, visible,
};
use common::cp::{
    eventually, felixctl, sibling, start_control_plane, start_control_plane_settling,
};
use common::{ok, Broker};

/// The settle window: a durable stream made before any broker registered (its shards never
/// move once placed) is spread over the three brokers that start together, within one shard
/// of each other, once the window closes; before it, nothing is placed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokers_started_together_share_the_shards() {
    let cp = start_control_plane_settling(120_000, 1_500);
    let tmp = tempfile::tempdir().unwrap();
    let certs = tmp.path().join("certs");
    generate_cluster_certs(&certs, &[1, 2, 3]).unwrap();
    make_resources_with(&cp, tmp.path(), "8", &["--durable"]);
    let mut nodes = Vec::new();
    for id in 1..=3u64 {
        let dir = tmp.path().join(format!("durable-{id}"));
        let d = dir.to_str().unwrap().to_string();
        nodes.push(start_node(&cp, &certs, id, &["--durable-storage-dir", &d]));
        let (_, places) = placement(&cp, "streams", "spread").await;
        assert!(
            places.iter().all(|p| p.0 == 0),
            "placed in the window: {places:?}"
        );
    }
    let places = eventually("the window closes", || async {
        let (_, places) = placement(&cp, "streams", "spread").await;
        if places.iter().all(|p| p.0 != 0) {
            Ok(places)
        } else {
            Err(format!("{places:?}"))
        }
    })
    .await;
    let mut n = std::collections::BTreeMap::<u64, usize>::new();
    for p in &places {
        *n.entry(p.0).or_default() += 1;
    }
    let (lo, hi) = (n.values().min().unwrap(), n.values().max().unwrap());
    assert!(n.len() == 3 && hi - lo <= 1, "{n:?}");
    // And they serve: a publish through broker 1 to every shard is acked.
    let c = nodes[0].client().await;
    let name = StreamName::new("acme", "prod", "spread");
    visible(std::slice::from_ref(&c), &name).await;
    for shard in 0..8 {
        let r = eventually("durable shard open", || async {
            c.publish_batch(&name, ShardSelector::Shard(shard), vec!["d"])
                .await
                .map_err(|e| e.to_string())
        })
        .await;
        assert_eq!(r.shard, shard);
    }
}

/// Publish through every broker to every shard, read each shard back on its owner, and do
/// cache writes through one broker and reads through the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_broker_serves_every_shard_by_forwarding() {
    let cp = start_control_plane(120_000);
    let tmp = tempfile::tempdir().unwrap();
    let certs = tmp.path().join("certs");
    generate_cluster_certs(&certs, &[1, 2, 3]).unwrap();
    let nodes: Vec<Broker> = (1..=3).map(|id| start_node(&cp, &certs, id, &[])).collect();
    make_resources(&cp, tmp.path(), "6");
    let (_, places) = placement(&cp, "streams", "spread").await;
    let owners: Vec<u64> = places.iter().map(|p| p.0).collect();
    for id in 1..=3 {
        assert!(
            owners.contains(&id),
            "every broker owns a shard: {owners:?}"
        );
    }
    let mut clients = Vec::new();
    for b in &nodes {
        clients.push(b.client().await);
    }
    let name = StreamName::new("acme", "prod", "spread");
    visible(&clients, &name).await;

    // Every broker, every shard: acked, at the next offset of the shard (one total order).
    for (i, c) in clients.iter().enumerate() {
        for shard in 0..6u32 {
            let ack = c
                .publish_batch(
                    &name,
                    ShardSelector::Shard(shard),
                    vec![format!("{shard}-{i}")],
                )
                .await
                .unwrap_or_else(|e| panic!("publish via broker {} to shard {shard}: {e}", i + 1));
            assert_eq!((ack.shard, ack.first_offset), (shard, i as u64));
            // The ack names the owner, also when another broker relayed it.
            assert_eq!(ack.owner, Some(owners[shard as usize]));
        }
    }
    // Fire-and-forget through a non-owner arrives too.
    let c1 = &clients[0];
    let far = owners.iter().position(|&o| o != 1).unwrap() as u32;
    c1.publish_fire(&name, ShardSelector::Shard(far), vec!["ff"])
        .unwrap();
    // Read back on the owners: each shard holds what every broker sent, in order.
    for (shard, owner) in owners.iter().enumerate() {
        let c = &clients[*owner as usize - 1];
        let opts = SubscribeOptions {
            start: StartAt::Earliest,
            ..Default::default()
        };
        let mut sub = c.subscribe(&name, shard as u32, opts).await.unwrap();
        let want: Vec<String> = (0..3)
            .map(|i| format!("{shard}-{i}"))
            .chain((shard as u32 == far).then(|| "ff".to_string()))
            .collect();
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while got.len() < want.len() && Instant::now() < deadline {
            if let Ok(Some(felix_client::Event::Records { records, .. })) =
                tokio::time::timeout(Duration::from_secs(5), sub.next()).await
            {
                got.extend(
                    records
                        .iter()
                        .map(|r| String::from_utf8_lossy(&r).to_string()),
                );
            }
        }
        assert_eq!(got, want, "shard {shard} on its owner {owner}");
        // A subscription is not relayed: a non-owner answers not_leader naming the owner.
        let other = &clients[(*owner as usize) % 3];
        match other
            .subscribe(&name, shard as u32, SubscribeOptions::default())
            .await
        {
            Err(Error::Broker { code, message }) => {
                assert_eq!(code, ErrorCode::NotLeader);
                assert!(message.contains(&format!("broker {owner}")), "{message}");
            }
            r => panic!("subscribe through a non-owner: {:?}", r.map(|_| ())),
        }
    }

    // Caches: put through broker 1, read through 2 and 3, delete through 3.
    let kv = StreamName::new("acme", "prod", "kv");
    for c in &clients {
        eventually("cache visible", || async {
            c.describe_cache(&kv).await.map_err(|e| e.to_string())
        })
        .await;
    }
    for k in 0..12 {
        clients[0]
            .cache_put(&kv, format!("k{k}"), format!("v{k}"), None)
            .await
            .unwrap();
    }
    for c in &clients[1..] {
        for k in 0..12 {
            let e = c
                .cache_get(&kv, format!("k{k}"))
                .await
                .unwrap()
                .expect("present");
            assert_eq!(e.value, format!("v{k}").as_bytes());
        }
    }
    clients[2].cache_delete(&kv, "k0").await.unwrap();
    assert!(clients[1].cache_get(&kv, "k0").await.unwrap().is_none());
    assert_eq!(clients[0].counter_add(&kv, "n", 5).await.unwrap().sum, 5);
    assert_eq!(clients[1].counter_add(&kv, "n", 2).await.unwrap().sum, 7);

    let sent: u64 = nodes.iter().map(|b| b.total("forwards_sent")).sum();
    let served: u64 = nodes.iter().map(|b| b.total("forwards_served")).sum();
    assert!(sent >= 12 + 16, "forwards sent {sent}");
    assert_eq!(sent, served, "every forward served once");

    // felixctl --brokers: a dead broker first, then broker 2, which forwards to the owner.
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker")).with_file_name("felixctl");
    let far_of_2 = owners.iter().position(|&o| o != 2).unwrap();
    let o = std::process::Command::new(exe)
        .env_remove("FELIX_CONTEXT")
        .env(
            "FELIX_CONTEXT_FILE",
            nodes[1].dir.path().join("no-context.json"),
        )
        .args(["--brokers", &format!("127.0.0.1:1,{}", nodes[1].quic)])
        .arg("--ca")
        .arg(nodes[1].ca())
        .args([
            "--timeout-ms",
            "1000",
            "--tenant",
            "acme",
            "--namespace",
            "prod",
        ])
        .args([
            "publish",
            "spread",
            "via-ctl",
            "--shard",
            &far_of_2.to_string(),
        ])
        .env_remove("FELIX_BROKER")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// The owner's checks: a peer whose certificate names another node is refused; a forward
/// with a stale incarnation or generation is refused; a forward for a shard this broker
/// does not own is `not_leader`, never forwarded again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owners_check_who_forwards_and_what() {
    let cp = start_control_plane(120_000);
    let tmp = tempfile::tempdir().unwrap();
    let certs = tmp.path().join("certs");
    generate_cluster_certs(&certs, &[1, 2, 3]).unwrap();
    let n1 = start_node(&cp, &certs, 1, &[]);
    // Node 2 advertises its peer listener by host name: node 1 resolves it off the data path.
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (listen, named) = (format!("127.0.0.1:{port}"), format!("localhost:{port}"));
    let n2 = start_node(
        &cp,
        &certs,
        2,
        &["--peer-listen", &listen, "--peer-advertise-addr", &named],
    );
    make_resources(&cp, tmp.path(), "4");
    let (incarnation, places) = placement(&cp, "streams", "spread").await;
    let name = StreamName::new("acme", "prod", "spread");
    visible(&[n1.client().await, n2.client().await], &name).await;
    let theirs = places.iter().position(|p| p.0 == 2).unwrap() as u32;
    let c1 = n1.client().await;
    eventually("forwarded to a broker registered by name", || async {
        c1.publish_batch(&name, ShardSelector::Shard(theirs), vec!["by-name"])
            .await
            .map_err(|e| e.to_string())
    })
    .await;

    // Node 3's certificate, claiming to be node 2: closed.
    let cluster = cluster_id(&cp).await;
    let (mut raw, answer) = raw_peer(&n1, &certs, &cluster, (1, 3, 2)).await;
    match answer {
        Frame::Error { code, message, .. } => {
            assert_eq!(
                ErrorCode::from_number(code),
                Some(ErrorCode::InvalidRequest)
            );
            assert!(message.contains("certificate names"), "{message}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    raw.wait_closed().await;
    assert_eq!(n1.total("peer_links_refused"), 1);

    // Node 3 of another cluster: closed.
    let (mut raw, answer) = raw_peer(&n1, &certs, "another", (1, 3, 3)).await;
    assert!(matches!(answer, Frame::Error { .. }), "{answer:?}");
    raw.wait_closed().await;
    assert_eq!(n1.total("peer_links_refused"), 2);

    // Node 3 as itself: accepted.
    let (raw, answer) = raw_peer(&n1, &certs, &cluster, (1, 3, 3)).await;
    assert!(
        matches!(
            answer,
            Frame::Peer(PeerFrame::PeerHelloOk { node_id: 1, .. })
        ),
        "{answer:?}"
    );
    let mut raw = raw;
    let mine = places.iter().position(|p| p.0 == 1).unwrap() as u32;
    let fwd = |rid: u64, shard: u32, incarnation: u64, generation: u64| {
        publish_forward(
            &name,
            (rid, shard),
            (incarnation, generation),
            String::new(),
            b"x",
        )
    };
    let code_of = refusal_of;
    let generation = places[mine as usize].1;
    raw.send(4, &fwd(1, mine, incarnation + 1, generation));
    assert_eq!(
        code_of(raw.next_on(4).await),
        (1, Some(ErrorCode::Conflict))
    );
    raw.send(4, &fwd(2, mine, incarnation, generation + 1));
    assert_eq!(
        code_of(raw.next_on(4).await),
        (2, Some(ErrorCode::Conflict))
    );
    raw.send(4, &fwd(3, theirs, incarnation, places[theirs as usize].1));
    assert_eq!(
        code_of(raw.next_on(4).await),
        (3, Some(ErrorCode::NotLeader))
    );
    raw.send(4, &fwd(4, mine, incarnation, generation));
    match raw.next_on(4).await {
        Frame::PublishAck {
            request_id: 4,
            shard,
            first_offset: 0,
            count: 1,
            ..
        } => assert_eq!(shard, mine),
        other => panic!("expected the ack, got {other:?}"),
    }
    // Nothing of the refused ones was appended: the next publish takes offset 1.
    let c = n1.client().await;
    let ack = c
        .publish_batch(&name, ShardSelector::Shard(mine), vec!["y".to_string()])
        .await
        .unwrap();
    assert_eq!(ack.first_offset, 1);

    // Replica messages: refused on a link that did not negotiate replication, and from a
    // node other than the link's; routed to the shard's core (which hosts no replica yet, and
    // counts them) from the dialer itself; dropped when they name a stream incarnation this
    // broker does not know.
    use felix_quic::wire::replica::{ReplicaMsg, ShardRef};
    let replicate = |incarnation: u64, leader: u64| Frame::Replicate {
        shard: ShardRef {
            stream: name.clone(),
            incarnation,
            shard: mine,
        },
        msg: ReplicaMsg::Fence { gen: 1, leader },
        records: Vec::new(),
    };
    raw.send(8, &replicate(incarnation, 3));
    assert_eq!(
        code_of(raw.next_on(8).await),
        (0, Some(ErrorCode::InvalidRequest))
    );
    let (mut rep, answer) = raw_peer_with(&n1, &certs, &cluster, (1, 3, 3), 3).await;
    assert!(
        matches!(
            answer,
            Frame::Peer(PeerFrame::PeerHelloOk {
                capabilities: 3,
                ..
            })
        ),
        "{answer:?}"
    );
    rep.send(8, &replicate(incarnation, 2));
    assert_eq!(
        code_of(rep.next_on(8).await),
        (0, Some(ErrorCode::InvalidRequest))
    );
    assert_eq!(n1.total("replica_msgs_refused"), 2);
    rep.send(8, &replicate(incarnation, 3));
    rep.send(8, &replicate(incarnation + 1, 3));
    eventually("the replica messages counted", || async {
        let (routed, unhosted, stale) = (
            n1.total("replica_msgs_routed"),
            n1.total("replica_msgs_unhosted"),
            n1.total("replica_msgs_stale"),
        );
        if (routed, unhosted, stale) == (1, 1, 1) {
            Ok(())
        } else {
            Err(format!(
                "routed {routed}, unhosted {unhosted}, stale {stale}"
            ))
        }
    })
    .await;
}

/// A forward to a broker that is frozen (SIGSTOP) is answered `outcome_unknown` within the
/// publish timeout plus the forward timeout; to a killed one, typed and fast.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwards_to_a_frozen_or_killed_owner_are_answered_typed() {
    let cp = start_control_plane(120_000);
    let tmp = tempfile::tempdir().unwrap();
    let certs = tmp.path().join("certs");
    generate_cluster_certs(&certs, &[1, 2]).unwrap();
    let fast = [
        "--forward-timeout-ms",
        "500",
        "--publish-timeout-ms",
        "500",
        "--peer-connect-timeout-ms",
        "500",
        "--idle-timeout-ms",
        "2000",
    ];
    let n1 = start_node(&cp, &certs, 1, &fast);
    let n2 = start_node(&cp, &certs, 2, &fast);
    make_resources(&cp, tmp.path(), "4");
    let (_, places) = placement(&cp, "streams", "spread").await;
    let name = StreamName::new("acme", "prod", "spread");
    let c = n1.client().await;
    visible(&[n1.client().await, n2.client().await], &name).await;
    let theirs = places.iter().position(|p| p.0 == 2).unwrap() as u32;
    let send = || c.publish_batch(&name, ShardSelector::Shard(theirs), vec!["z".to_string()]);
    send().await.expect("the link works");

    n2.signal(libc::SIGSTOP);
    let t = Instant::now();
    match send().await {
        Err(Error::Broker { code, message }) => {
            assert_eq!(code, ErrorCode::OutcomeUnknown, "{message}")
        }
        r => panic!("a forward to a frozen owner: {r:?}"),
    }
    let took = t.elapsed();
    assert!(took >= Duration::from_millis(900), "waited {took:?}");
    assert!(
        took < Duration::from_secs(5),
        "answered within the timeouts: {took:?}"
    );
    n2.signal(libc::SIGCONT);

    let _ = n2.kill();
    // Whatever the link was doing, the answer is typed and comes within the timeouts: the
    // first sees the link break (outcome_unknown or unavailable), later ones are refused at
    // once while the link backs off (unavailable: nothing was sent).
    for _ in 0..3 {
        let t = Instant::now();
        match send().await {
            Err(Error::Broker { code, .. }) => assert!(
                matches!(code, ErrorCode::OutcomeUnknown | ErrorCode::Unavailable),
                "{code:?}"
            ),
            r => panic!("a forward to a killed owner: {r:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(5));
    }
}

/// Consumer groups across brokers: created, polled (at once and long), acked and cancelled
/// through a broker that owns none of the shards; a forwarded long poll is answered by a
/// publish that lands while it waits, and one whose client cancels it is released at the
/// owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_are_served_through_any_broker() {
    use felix_client::{GroupOptions, GroupRecord};
    let cp = start_control_plane(120_000);
    let tmp = tempfile::tempdir().unwrap();
    let certs = tmp.path().join("certs");
    generate_cluster_certs(&certs, &[1, 2]).unwrap();
    let nodes: Vec<Broker> = (1..=2u64)
        .map(|id| {
            let d = tmp.path().join(format!("durable-{id}"));
            start_node(
                &cp,
                &certs,
                id,
                &["--durable-storage-dir", d.to_str().unwrap()],
            )
        })
        .collect();
    make_resources_with(&cp, tmp.path(), "2", &["--durable"]);
    let (_, places) = placement(&cp, "streams", "spread").await;
    let name = StreamName::new("acme", "prod", "spread");
    let cs = [nodes[0].client().await, nodes[1].client().await];
    visible(&cs, &name).await;
    let [c1, c2] = cs;
    // Through broker 2 for both shards: one is its own, one is forwarded to broker 1.
    let mine_of_1 = places.iter().position(|p| p.0 == 1).unwrap() as u32;
    eventually("group created", || async {
        c2.group_create(&name, "g", None, GroupOptions::default())
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    for shard in 0..2u32 {
        for i in 0..3 {
            c1.publish_batch(
                &name,
                ShardSelector::Shard(shard),
                vec![format!("{shard}-{i}")],
            )
            .await
            .unwrap();
        }
    }
    let recs = c2
        .group_poll(&name, "g", mine_of_1, 10, None, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(recs.len(), 3, "claimed through the forwarding broker");
    let ids: Vec<_> = recs.iter().map(GroupRecord::claim).collect();
    let acked = c2.group_ack(&name, "g", &ids).await.unwrap();
    assert!(acked.iter().all(|r| r.is_ok()), "{acked:?}");
    let info = c2
        .group_describe(&name, "g", Some(mine_of_1))
        .await
        .unwrap();
    assert_eq!(info.len(), 1);

    // A long poll through broker 2 waits at broker 1 and wakes for a publish.
    let c2b = nodes[1].client().await;
    let n2 = name.clone();
    let waiting = tokio::spawn(async move {
        c2b.group_poll(&n2, "g", mine_of_1, 10, None, Duration::from_secs(10))
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    c1.publish_batch(&name, ShardSelector::Shard(mine_of_1), vec!["late"])
        .await
        .unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the long poll woke")
        .unwrap()
        .unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(&got[0].payload[..], b"late");

    // A consumer over both shards: its long polls go to both owners; when one shard answers,
    // the other's (forwarded) poll is cancelled and released at its owner.
    let mut cons = c2.group_consumer(&name, "g").await.unwrap();
    let got = cons.poll(100, None, Duration::ZERO).await.unwrap();
    assert_eq!(got.len(), 3, "the other shard's three");
    let ids: Vec<_> = got.iter().map(GroupRecord::claim).collect();
    c2.group_ack(&name, "g", &ids).await.unwrap();
    let c1b = nodes[0].client().await;
    let n1 = name.clone();
    let other = 1 - mine_of_1;
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        c1b.publish_batch(&n1, ShardSelector::Shard(other), vec!["wake"])
            .await
            .unwrap();
    });
    let got = tokio::time::timeout(
        Duration::from_secs(8),
        cons.poll(10, None, Duration::from_secs(5)),
    )
    .await
    .expect("answered")
    .unwrap();
    assert_eq!(got.len(), 1);
    drop(cons);
    // The other shard's forwarded long poll was cancelled, and its cancel served at the
    // owner: one more forward served than sent.
    let sent: u64 = nodes.iter().map(|b| b.total("forwards_sent")).sum();
    let cancelled: u64 = nodes.iter().map(|b| b.total("forwards_cancelled")).sum();
    let served: u64 = nodes.iter().map(|b| b.total("forwards_served")).sum();
    assert!(cancelled >= 1, "no cancel sent");
    assert_eq!(sent + cancelled, served);

    // Broker 2 drains (SIGTERM) while a long poll it forwarded waits at broker 1: the poll is
    // cancelled there and answered, and broker 2 exits cleanly (0, not a forced drain).
    let c2c = nodes[1].client().await;
    let n3 = name.clone();
    let waiting = tokio::spawn(async move {
        c2c.group_poll(&n3, "g", mine_of_1, 10, None, Duration::from_secs(20))
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut nodes = nodes;
    let n2 = nodes.remove(1);
    n2.signal(libc::SIGTERM);
    let t = Instant::now();
    let (code, _) = n2.wait_exit(Duration::from_secs(15));
    assert_eq!(code, Some(0), "a clean drain");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let answer = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the forwarded long poll was answered")
        .unwrap();
    assert!(
        matches!(answer, Ok(ref r) if r.is_empty()) || answer.is_err(),
        "{answer:?}"
    );
}

/// The ClusterClient: one live seed among dead ones finds every broker; publishes go straight
/// to the owners (nothing forwarded); a sharded subscription merges every shard from its
/// owner; when a broker is killed, publishes to the shards of the others carry on at once,
/// those to the dead broker's durable shards fail typed and bounded, and nothing acknowledged
/// on the surviving shards is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_client_finds_the_owners_and_survives_a_broker_dying() {
    use felix_client::{ClusterClient, ClusterConfig};
    use std::collections::{BTreeMap, BTreeSet};
    use std::sync::Arc;
    let cp = start_control_plane(1_000);
    let tmp = tempfile::tempdir().unwrap();
    let certs = tmp.path().join("certs");
    generate_cluster_certs(&certs, &[1, 2, 3]).unwrap();
    // Client listeners signed by the cluster CA too: one CA verifies every broker.
    let nodes: Vec<Broker> = (1..=3u64)
        .map(|id| {
            let d = tmp.path().join(format!("durable-{id}"));
            let cert = certs.join(format!("node-{id}.pem"));
            let key = certs.join(format!("node-{id}-key.pem"));
            start_node(
                &cp,
                &certs,
                id,
                &[
                    "--durable-storage-dir",
                    d.to_str().unwrap(),
                    "--tls-cert",
                    cert.to_str().unwrap(),
                    "--tls-key",
                    key.to_str().unwrap(),
                ],
            )
        })
        .collect();
    make_resources_with(&cp, tmp.path(), "6", &["--durable"]);
    let (_, places) = placement(&cp, "streams", "spread").await;
    let name = StreamName::new("acme", "prod", "spread");

    let seeds = format!("127.0.0.1:1,{}", nodes[1].quic);
    let mut cfg = ClusterConfig::new(&seeds, Some(certs.join("ca.pem"))).unwrap();
    cfg.connect_timeout = Duration::from_millis(500);
    cfg.resend_for = Duration::from_secs(2);
    cfg.request_timeout = Duration::from_secs(2);
    cfg.idle_timeout = Duration::from_millis(1_500);
    let cc = Arc::new(ClusterClient::connect(cfg).await.unwrap());
    let found: Vec<u64> = cc.brokers().keys().copied().collect();
    assert_eq!(found, vec![1, 2, 3], "found from one seed");

    // Durable shards open lazily: wait until every shard takes a publish.
    for shard in 0..6u32 {
        eventually("shard open", || async {
            cc.publish_batch(
                &name,
                ShardSelector::Shard(shard),
                vec![format!("w{shard}")],
            )
            .await
            .map_err(|e| e.to_string())
        })
        .await;
    }
    let forwarded_before: u64 = nodes.iter().map(|b| b.total("forwards_sent")).sum();
    let mut acked: BTreeMap<u32, BTreeSet<u64>> = BTreeMap::new();
    for i in 0..60u32 {
        let a = cc
            .publish_batch(&name, ShardSelector::RoundRobin, vec![format!("r{i}")])
            .await
            .unwrap();
        acked.entry(a.shard).or_default().insert(a.first_offset);
    }
    assert_eq!(acked.len(), 6, "round robin over every shard");
    let forwarded: u64 = nodes.iter().map(|b| b.total("forwards_sent")).sum();
    assert_eq!(
        forwarded, forwarded_before,
        "sent to the owners, never relayed"
    );

    let opts = SubscribeOptions {
        start: StartAt::Earliest,
        ..Default::default()
    };
    let mut sub = cc.subscribe_sharded(&name, opts).await.unwrap();
    let mut seen: BTreeMap<u32, BTreeSet<u64>> = BTreeMap::new();
    let want = 66;
    let total =
        |seen: &BTreeMap<u32, BTreeSet<u64>>| seen.values().map(BTreeSet::len).sum::<usize>();
    read_until(&mut sub, &mut seen, |s| total(s) >= want).await;
    assert_eq!(total(&seen), want);

    // A cluster-wide prefix watch: each shard watched on its owner, merged; the puts go
    // through whichever broker the client holds (it forwards them).
    let kv = StreamName::new("acme", "prod", "kv");
    let mut watch = cc
        .cache_watch_prefix(
            &kv,
            "user/",
            felix_quic::wire::WatchStart::Current,
            felix_client::WatchOptions::default(),
        )
        .await
        .unwrap();
    let any = cc.client().await.unwrap();
    for k in 0..12 {
        any.cache_put(&kv, format!("user/{k}"), format!("v{k}"), None)
            .await
            .unwrap();
    }
    let mut keys = BTreeSet::new();
    let mut states = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    while keys.len() < 12 && Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_secs(5), watch.next()).await {
            Ok(Some(felix_client::WatchItem::Event { key, .. })) => {
                keys.insert(key);
            }
            Ok(Some(felix_client::WatchItem::StateDone { .. })) => states += 1,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(keys.len(), 12, "every shard's changes, from every owner");
    assert!(states >= 1);

    // The cluster's group consumer: each shard polled and acked at its owner, nothing relayed.
    any.group_create(&name, "cg", None, felix_client::GroupOptions::default())
        .await
        .unwrap();
    let mut cons = cc.group_consumer(&name, "cg").await.unwrap();
    let forwarded_before: u64 = nodes.iter().map(|b| b.total("forwards_sent")).sum();
    let mut claimed = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    while claimed < want && Instant::now() < deadline {
        let recs = cons
            .poll(25, None, Duration::from_millis(200))
            .await
            .unwrap();
        let ids: Vec<_> = recs.iter().map(felix_client::GroupRecord::claim).collect();
        let acks = cons.ack(&ids).await.unwrap();
        assert!(acks.iter().all(Result::is_ok), "{acks:?}");
        claimed += recs.len();
    }
    assert_eq!(claimed, want, "every record of every shard, once");
    let forwarded: u64 = nodes.iter().map(|b| b.total("forwards_sent")).sum();
    assert_eq!(
        forwarded, forwarded_before,
        "polled and acked at the owners"
    );

    // felix-loadgen --brokers in group mode: loaded and consumed at the owners, lossless.
    let ctl = |args: &[&str]| ok(felixctl(&cp, tmp.path(), args));
    ctl(&["tenant", "create", "default"]);
    ctl(&["--tenant", "default", "namespace", "create", "default"]);
    let lg_ns = ["--tenant", "default", "--namespace", "default"];
    ctl(&[
        &lg_ns[..],
        &["stream", "create", "lg", "--shards", "3", "--durable"],
    ]
    .concat());
    let lg = StreamName::new("default", "default", "lg");
    eventually("lg visible", || async {
        cc.client()
            .await
            .map_err(|e| e.to_string())?
            .describe_stream(&lg)
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    let seeds = nodes
        .iter()
        .map(|b| b.quic.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let o = std::process::Command::new(sibling("felix-loadgen"))
        .args(["--brokers", &seeds, "--mode", "group", "--stream", "lg"])
        .args(["--count", "300", "--batch", "10", "--consumers", "2"])
        .args(["--json", "--max-secs", "60"])
        .arg("--ca")
        .arg(certs.join("ca.pem"))
        .env_remove("FELIX_BROKER")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let g: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&o.stdout).trim()).unwrap();
    assert_eq!(g["brokers"], 3, "{g}");
    assert_eq!(g["processed"], 300, "{g}");
    assert_eq!(g["lossless"], true, "{g}");

    // Broker 3 dies.
    let (_, kv_places) = placement(&cp, "caches", "kv").await;
    let dead = 3u64;
    let mut nodes = nodes;
    let _ = nodes.remove(2).kill();
    let theirs: Vec<u32> = (0..6).filter(|&s| places[s as usize].0 == dead).collect();
    let ours: Vec<u32> = (0..6).filter(|&s| places[s as usize].0 != dead).collect();
    assert!(!theirs.is_empty() && !ours.is_empty());
    for &shard in &ours {
        let t = Instant::now();
        let a = cc
            .publish_batch(&name, ShardSelector::Shard(shard), vec!["after"])
            .await
            .unwrap_or_else(|e| panic!("shard {shard} on a live broker: {e}"));
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        acked.entry(a.shard).or_default().insert(a.first_offset);
    }
    for &shard in &theirs {
        let t = Instant::now();
        let r = cc
            .publish_batch(&name, ShardSelector::Shard(shard), vec!["lost"])
            .await;
        assert!(r.is_err(), "a durable shard of a dead broker is not moved");
        // At most one request timeout on the dead connection, then a typed refusal.
        assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    }
    // The prefix watch outlives broker 3: its shards of the (ephemeral) cache move to live
    // brokers and are watched again there, with no end in the merged stream; every key
    // written again after the move is seen.
    assert!(
        kv_places.iter().any(|p| p.0 == dead),
        "broker 3 owned a cache shard"
    );
    for k in 0..12 {
        eventually("put after the move", || async {
            let c = cc.client().await.map_err(|e| e.to_string())?;
            c.cache_put(&kv, format!("user/{k}"), format!("after{k}"), None)
                .await
                .map_err(|e| e.to_string())
        })
        .await;
    }
    let mut again = BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(15);
    while again.len() < 12 && Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_secs(5), watch.next()).await {
            Ok(Some(felix_client::WatchItem::Event { key, value, .. })) => {
                if value.starts_with(b"after") {
                    again.insert(key);
                }
            }
            Ok(Some(felix_client::WatchItem::StateDone { .. })) => {}
            other => panic!("the watch should carry on: {other:?}"),
        }
    }
    assert_eq!(again.len(), 12, "every shard watched again: {again:?}");
    drop(watch);

    // The group consumer carries on over the surviving shards: their new records are
    // claimed (a poll may first report the dead broker; the next one polls the owners again).
    let mut after = 0;
    let deadline = Instant::now() + Duration::from_secs(15);
    while after < ours.len() && Instant::now() < deadline {
        if let Ok(recs) = cons.poll(10, None, Duration::from_millis(300)).await {
            assert!(recs.iter().all(|r| &r.payload[..] == b"after"), "{recs:?}");
            let ids: Vec<_> = recs.iter().map(felix_client::GroupRecord::claim).collect();
            let _ = cons.ack(&ids).await;
            after += recs.len();
        }
    }
    assert_eq!(after, ours.len(), "the surviving shards' records, claimed");

    // Every acked record of the surviving shards reaches the merged subscription.
    let complete = |seen: &BTreeMap<u32, BTreeSet<u64>>| {
        ours.iter().all(|s| {
            acked
                .get(s)
                .is_none_or(|a| a.iter().all(|o| seen.get(s).is_some_and(|v| v.contains(o))))
        })
    };
    read_until(&mut sub, &mut seen, complete).await;
    assert!(
        complete(&seen),
        "acked on surviving shards, not delivered: {acked:?} vs {seen:?}"
    );
}

/// Ephemeral shards move: one that is rebalanced onto a new broker ends its subscriptions
/// with `not_leader` naming the new owner; one whose broker dies moves to a live broker and
/// starts there with an empty ring at offset 0, so a subscriber resuming at the old next
/// offset is refused (`invalid_request`, beyond the end) and one starting from the earliest
/// sees only what was published after the move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ephemeral_shards_move_and_restart_empty() {
    let cp = start_control_plane(1_000);
    let tmp = tempfile::tempdir().unwrap();
    let certs = tmp.path().join("certs");
    generate_cluster_certs(&certs, &[1, 2, 3]).unwrap();
    let mut nodes: Vec<Broker> = (1..=2u64)
        .map(|id| start_node(&cp, &certs, id, &[]))
        .collect();
    make_resources(&cp, tmp.path(), "4");
    let name = StreamName::new("acme", "prod", "spread");
    let (_, before) = placement(&cp, "streams", "spread").await;
    let cs = [nodes[0].client().await, nodes[1].client().await];
    visible(&cs, &name).await;
    let [c1, c2] = cs;
    // Subscriptions on node 1 to each shard it owns.
    let mut subs = Vec::new();
    for (shard, p) in before.iter().enumerate() {
        if p.0 == 1 {
            let s = c1
                .subscribe(&name, shard as u32, SubscribeOptions::default())
                .await
                .unwrap();
            subs.push((shard, s));
        }
    }
    // Node 3 joins: an ephemeral shard of node 1 is rebalanced onto it.
    nodes.push(start_node(&cp, &certs, 3, &[]));
    let after = eventually("a shard moved to node 3", || async {
        let (_, p) = placement(&cp, "streams", "spread").await;
        if p.iter().any(|x| x.0 == 3) {
            Ok(p)
        } else {
            Err(format!("{p:?}"))
        }
    })
    .await;
    let moved: Vec<usize> = (0..4)
        .filter(|&s| before[s].0 == 1 && after[s].0 == 3)
        .collect();
    assert!(!moved.is_empty(), "{before:?} -> {after:?}");
    for (shard, mut sub) in subs {
        if !moved.contains(&shard) {
            continue;
        }
        let end = loop {
            match tokio::time::timeout(Duration::from_secs(10), sub.next()).await {
                Ok(Some(felix_client::Event::End { code, message, .. })) => break (code, message),
                Ok(Some(_)) => continue,
                other => panic!("shard {shard}: no end ({other:?})"),
            }
        };
        assert_eq!(
            ErrorCode::from_number(end.0),
            Some(ErrorCode::NotLeader),
            "{}",
            end.1
        );
        assert!(end.1.contains("broker 3"), "names the new owner: {}", end.1);
    }

    // Node 2 dies with records in a shard it owns; the shard moves and starts empty.
    let (_, now) = placement(&cp, "streams", "spread").await;
    let on2 = now.iter().position(|p| p.0 == 2).unwrap() as u32;
    for i in 0..5 {
        let a = c2
            .publish_batch(&name, ShardSelector::Shard(on2), vec![format!("old{i}")])
            .await
            .unwrap();
        assert_eq!(a.first_offset, i);
    }
    drop(c2);
    let _ = nodes.remove(1).kill();
    let new_owner = eventually("the shard moved off the dead broker", || async {
        let (_, p) = placement(&cp, "streams", "spread").await;
        match p[on2 as usize].0 {
            2 => Err("still on node 2".to_string()),
            o => Ok(o),
        }
    })
    .await;
    // nodes is now [node 1, node 3].
    let owner_client = nodes[if new_owner == 1 { 0 } else { 1 }].client().await;
    let a = eventually("publish to the moved shard", || async {
        c1.publish_batch(&name, ShardSelector::Shard(on2), vec!["new0"])
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    assert_eq!(a.first_offset, 0, "offsets restart on the new owner");
    let resume = SubscribeOptions {
        start: StartAt::Offset(5),
        ..Default::default()
    };
    match owner_client.subscribe(&name, on2, resume).await {
        Err(Error::Broker { code, .. }) => assert_eq!(code, ErrorCode::InvalidRequest),
        r => panic!("a resume beyond the new end: {:?}", r.map(|_| ())),
    }
    let earliest = SubscribeOptions {
        start: StartAt::Earliest,
        ..Default::default()
    };
    let mut sub = owner_client.subscribe(&name, on2, earliest).await.unwrap();
    match tokio::time::timeout(Duration::from_secs(5), sub.next()).await {
        Ok(Some(ev @ felix_client::Event::Records { .. })) => {
            let recs = ev.records();
            assert_eq!(recs[0].0, 0);
            assert_eq!(&recs[0].1[..], b"new0");
        }
        other => panic!("{other:?}"),
    }
}

/// Read a merged subscription into `seen` (shard → offsets) until `done` says so, or 15 s.
async fn read_until(
    sub: &mut felix_client::ShardedSubscription,
    seen: &mut std::collections::BTreeMap<u32, std::collections::BTreeSet<u64>>,
    done: impl Fn(&std::collections::BTreeMap<u32, std::collections::BTreeSet<u64>>) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !done(seen) && Instant::now() < deadline {
        if let Ok(Some(felix_client::Event::Records {
            shard,
            first_offset,
            records,
        })) = tokio::time::timeout(Duration::from_secs(5), sub.next()).await
        {
            for i in 0..records.count() as u64 {
                seen.entry(shard).or_default().insert(first_offset + i);
            }
        }
    }
}

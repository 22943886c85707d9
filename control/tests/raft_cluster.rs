//! Three real `felix-controlplane` processes forming a Raft group on loopback.

mod common;

use common::*;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Cluster {
    dirs: Vec<tempfile::TempDir>,
    addrs: Vec<String>,
    peers: String,
    nodes: Vec<Option<Server>>,
    auth: bool,
    /// With auth on, the member secret file every member is given, and (the auth clusters
    /// also serve HTTPS) the shared certificate, key and CA under `tls/`.
    secret: Option<tempfile::TempDir>,
}

/// The member secret the auth clusters share.
const MEMBER_SECRET: &str = "0123456789abcdef0123456789abcdef-test-only";

impl Cluster {
    fn start() -> Cluster {
        Cluster::start_as(false)
    }

    fn start_as(auth: bool) -> Cluster {
        let addrs: Vec<String> = (0..3)
            .map(|_| format!("127.0.0.1:{}", free_port()))
            .collect();
        let peers = addrs
            .iter()
            .enumerate()
            .map(|(i, a)| format!("{}={a}", i + 1))
            .collect::<Vec<_>>()
            .join(",");
        let mut c = Cluster {
            dirs: (0..3).map(|_| tempdir()).collect(),
            addrs,
            peers,
            nodes: vec![None, None, None],
            auth,
            secret: auth.then(|| {
                let d = tempdir();
                std::fs::write(d.path().join("member.secret"), format!("{MEMBER_SECRET}\n"))
                    .unwrap();
                felix_quic::tls::ensure_server_cert(&d.path().join("tls"), "controlplane").unwrap();
                d
            }),
        };
        for i in 0..3 {
            c.up(i);
        }
        c
    }

    fn up(&mut self, i: usize) {
        let mut args = vec!["--listen".to_string(), self.addrs[i].clone()];
        args.extend(if self.auth {
            base_args_auth_on()
        } else {
            base_args()
        });
        args.extend([
            "--store".into(),
            "raft".into(),
            "--raft-node-id".into(),
            (i + 1).to_string(),
            "--raft-data-dir".into(),
            p(self.dirs[i].path()),
            "--raft-peers".into(),
            self.peers.clone(),
            "--raft-snapshot-logs".into(),
            "40".into(),
        ]);
        if let Some(d) = &self.secret {
            let tls = d.path().join("tls");
            args.extend([
                "--member-secret-file".into(),
                p(&d.path().join("member.secret")),
                "--tls".into(),
                "on".into(),
                "--tls-cert-file".into(),
                p(&tls.join("controlplane.pem")),
                "--tls-key-file".into(),
                p(&tls.join("controlplane-key.pem")),
                "--tls-ca-file".into(),
                p(&tls.join("ca.pem")),
            ]);
        }
        self.nodes[i] = Some(Server::start_exact(args));
    }

    fn url(&self, i: usize, path: &str) -> String {
        let scheme = if self.secret.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}{}", self.addrs[i], path)
    }

    /// The CA the HTTPS (auth) clusters' certificate is signed by.
    fn ca(&self) -> PathBuf {
        self.secret
            .as_ref()
            .expect("an auth cluster")
            .path()
            .join("tls/ca.pem")
    }

    fn kill(&mut self, i: usize) {
        if let Some(mut s) = self.nodes[i].take() {
            s.kill();
        }
    }

    fn stop(&mut self, i: usize) {
        if let Some(mut s) = self.nodes[i].take() {
            s.stop();
        }
    }

    fn wipe(&mut self, i: usize) {
        let d = self.dirs[i].path().to_path_buf();
        std::fs::remove_dir_all(&d).unwrap();
        std::fs::create_dir_all(&d).unwrap();
    }
}

async fn status(c: &reqwest::Client, url: String) -> Option<Value> {
    let r = c
        .get(url)
        .timeout(Duration::from_millis(800))
        .send()
        .await
        .ok()?;
    r.json().await.ok()
}

/// Wait until every running member is ready, agrees on one leader, and the group has three
/// voters; returns the leader's index.
async fn settled(c: &reqwest::Client, cl: &Cluster, secs: u64) -> usize {
    eventually(secs, "a settled group of three voters", || async {
        let mut leader = None;
        for i in 0..3 {
            cl.nodes[i].as_ref()?;
            let s = status(c, cl.url(i, "/v1/cluster")).await?;
            let ready = c
                .get(cl.url(i, "/readyz"))
                .timeout(Duration::from_millis(800))
                .send()
                .await
                .ok()?
                .status()
                .is_success();
            if !ready || s["voters"].as_array()?.len() != 3 || !s["learners"].as_array()?.is_empty()
            {
                return None;
            }
            let l = s["leader"].as_u64()?;
            if leader.is_some_and(|x| x != l) {
                return None;
            }
            leader = Some(l);
        }
        leader.map(|l| l as usize - 1)
    })
    .await
}

async fn setup_scope(c: &reqwest::Client, cl: &Cluster, via: usize) {
    let (st, b) = call(
        c,
        "POST",
        &cl.url(via, "/v1/tenants"),
        Some(json!({"name": "t"})),
    )
    .await;
    assert_eq!(st, 201, "{b}");
    let (st, b) = call(
        c,
        "POST",
        &cl.url(via, "/v1/tenants/t/namespaces"),
        Some(json!({"name": "n"})),
    )
    .await;
    assert_eq!(st, 201, "{b}");
}

#[tokio::test]
async fn three_members_forward_writes_to_the_leader() {
    let cl = Cluster::start();
    let c = client();
    let leader = settled(&c, &cl, 30).await;
    let follower = (leader + 1) % 3;
    setup_scope(&c, &cl, follower).await;
    let (st, b) = call(
        &c,
        "POST",
        &cl.url(follower, "/v1/tenants/t/namespaces/n/streams"),
        Some(json!({"name": "s", "shards": 2})),
    )
    .await;
    assert_eq!(st, 201, "written through a follower: {b}");
    let (st, e) = call(
        &c,
        "POST",
        &cl.url((leader + 2) % 3, "/v1/tenants/t/namespaces/n/streams"),
        Some(json!({"name": "s"})),
    )
    .await;
    assert_eq!((st, e["code"].as_str()), (409, Some("already_exists")));
    // Heartbeats through a follower reach the leader's liveness view.
    let (st, _) = call(
        &c,
        "POST",
        &cl.url(follower, "/v1/brokers"),
        Some(json!({"node_id": 9, "quic_addr": "127.0.0.1:7400", "cores": 1})),
    )
    .await;
    assert_eq!(st, 200);
    let (st, hb) = call(
        &c,
        "POST",
        &cl.url(follower, "/v1/brokers/9/heartbeat"),
        Some(json!({})),
    )
    .await;
    assert_eq!((st, hb["live"].as_bool()), (200, Some(true)));
    for i in 0..3 {
        eventually(10, "replicated to every member", || async {
            let (st, s) = call(
                &c,
                "GET",
                &cl.url(i, "/v1/tenants/t/namespaces/n/streams/s"),
                None,
            )
            .await;
            (st == 200 && s["placement"][0]["owner"] == 9).then_some(())
        })
        .await;
    }
    // One catalog, one feed.
    let (_, a) = call(&c, "GET", &cl.url(0, "/v1/catalog"), None).await;
    let (_, b) = call(&c, "GET", &cl.url(2, "/v1/catalog"), None).await;
    assert_eq!(a["catalog_id"], b["catalog_id"]);
}

/// Continuous writes through every member while the leader is SIGKILLed, a member is
/// stopped and restarted, and a member's data dir is wiped (it rejoins under a new
/// generation). No acknowledged write may be lost.
/// With auth on (and HTTPS, members' calls included): the keys are created once through Raft
/// (every member writes the same admin token), and a follower forwards a write to the leader
/// with its member credential.
#[tokio::test]
async fn with_auth_every_member_holds_the_same_keys_and_followers_forward() {
    let cl = Cluster::start_as(true);
    let tokens: Vec<String> = (0..3)
        .map(|i| admin_token(&cl.dirs[i].path().join("admin.token")))
        .collect();
    assert!(
        tokens.iter().all(|t| *t == tokens[0]),
        "one bootstrap, one admin token"
    );
    // Every call, members' included, is HTTPS: the group formed and forwards over it.
    let c = client_tls(Some(&tokens[0]), &cl.ca());
    let anonymous = client_tls(None, &cl.ca());
    let leader = settled(&c, &cl, 30).await;
    let follower = (leader + 1) % 3;
    let (st, b) = call(
        &c,
        "POST",
        &cl.url(follower, "/v1/tenants"),
        Some(json!({"name": "t"})),
    )
    .await;
    assert_eq!(st, 201, "a forwarded write: {b}");
    let (st, b) = call(
        &anonymous,
        "POST",
        &cl.url(follower, "/v1/tenants"),
        Some(json!({"name": "u"})),
    )
    .await;
    assert_eq!(st, 401, "{b}");
    let (st, b) = call(
        &anonymous,
        "POST",
        &cl.url(follower, "/internal/v1/write"),
        Some(json!({"op": "delete_tenant", "name": "t"})),
    )
    .await;
    assert_eq!(
        st, 401,
        "the internal endpoint needs a member credential: {b}"
    );
    // The member protocol needs the member secret: without it, or with another, a stranger
    // can neither learn identities nor vote; even the admin token is not enough.
    let member = format!("/raft/{}/vote", (follower as u64 + 1) << 32);
    let vote = json!({"vote": {"leader_id": {"term": 99, "node_id": 7}, "committed": false}, "last_log_id": null});
    for secret in [None, Some("0123456789abcdef0123456789abcdef-guessed!!")] {
        for (method, path, body) in [
            ("GET", "/internal/v1/identity", None),
            ("POST", member.as_str(), Some(vote.clone())),
            ("POST", "/internal/v1/assign", Some(json!(7u64 << 32))),
        ] {
            let mut rb = c.request(method.parse().unwrap(), cl.url(follower, path));
            if let Some(s) = secret {
                rb = rb.header("x-felix-member-secret", s);
            }
            if let Some(b) = &body {
                rb = rb.json(b);
            }
            let r = rb.send().await.unwrap();
            let st = r.status().as_u16();
            let b: Value = r.json().await.unwrap_or_default();
            assert_eq!(st, 401, "{method} {path} with {secret:?}: {b}");
            assert_eq!(b["code"], "unauthenticated", "{b}");
        }
    }
    let r = c
        .get(cl.url(follower, "/internal/v1/identity"))
        .header("x-felix-member-secret", MEMBER_SECRET)
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status().as_u16(),
        200,
        "a member's own secret is accepted"
    );
}

#[tokio::test]
async fn chaos_no_acknowledged_write_is_lost() {
    let mut cl = Cluster::start();
    let c = client();
    let leader = settled(&c, &cl, 30).await;
    setup_scope(&c, &cl, leader).await;

    let acked: Arc<Mutex<Vec<String>>> = Arc::default();
    let failed = Arc::new(AtomicU64::new(0));
    let attempts = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..2usize {
        let (c, acked, failed, attempts, stop) = (
            c.clone(),
            acked.clone(),
            failed.clone(),
            attempts.clone(),
            stop.clone(),
        );
        let urls: Vec<String> = (0..3)
            .map(|i| cl.url(i, "/v1/tenants/t/namespaces/n/streams"))
            .collect();
        writers.push(tokio::spawn(async move {
            let t0 = Instant::now();
            let mut n = 0u64;
            // Bounded: at most 5000 writes per writer and 90 s.
            while !stop.load(Ordering::Relaxed)
                && n < 5000
                && t0.elapsed() < Duration::from_secs(90)
            {
                let name = format!("w{w}-{n}");
                let url = &urls[(n as usize + w) % 3];
                attempts.fetch_add(1, Ordering::Relaxed);
                let r = c
                    .post(url)
                    .timeout(Duration::from_secs(6))
                    .json(&json!({"name": name}))
                    .send()
                    .await;
                match r {
                    Ok(r) if r.status().as_u16() == 201 => acked.lock().unwrap().push(name),
                    _ => {
                        failed.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
                n += 1;
            }
        }));
    }
    let wait_acks = |min: usize| {
        let acked = acked.clone();
        async move {
            eventually(30, "writes to be acknowledged", || async {
                (acked.lock().unwrap().len() >= min).then_some(())
            })
            .await
        }
    };
    wait_acks(20).await;

    // 1. SIGKILL the leader; the others elect a new one and keep accepting writes.
    let old = settled(&c, &cl, 30).await;
    cl.kill(old);
    let before = acked.lock().unwrap().len();
    wait_acks(before + 20).await;
    cl.up(old);
    let leader = settled(&c, &cl, 30).await;

    // 2. Stop (SIGTERM) a follower and restart it.
    let f = (leader + 1) % 3;
    cl.stop(f);
    let before = acked.lock().unwrap().len();
    wait_acks(before + 20).await;
    cl.up(f);
    let leader = settled(&c, &cl, 30).await;

    // 3. Wipe a follower's data dir: it must rejoin under a new generation.
    let w = (leader + 2) % 3;
    cl.kill(w);
    cl.wipe(w);
    let before = acked.lock().unwrap().len();
    wait_acks(before + 10).await;
    cl.up(w);
    settled(&c, &cl, 40).await;
    // The remove + re-add runs asynchronously after the restart: the wiped node may first
    // replay the old membership from the leader. Wait for the new identity to be a voter.
    let s = eventually(40, "the wiped node to rejoin as a voter", || async {
        let s = status(&c, cl.url(w, "/v1/cluster")).await?;
        let me: Vec<&Value> = s["members"]
            .as_array()?
            .iter()
            .filter(|m| m["node_id"] == (w as u64 + 1))
            .collect();
        let rejoined = me.len() == 1
            && me[0]["generation"].as_u64().unwrap_or(0) >= 1
            && me[0]["voter"] == true;
        rejoined.then_some(s.clone())
    })
    .await;
    let me: Vec<&Value> = s["members"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["node_id"] == (w as u64 + 1))
        .collect();
    assert_eq!(me.len(), 1, "exactly one identity for the wiped node: {s}");
    assert!(
        me[0]["generation"].as_u64().unwrap() >= 1,
        "new generation: {s}"
    );
    let before = acked.lock().unwrap().len();
    wait_acks(before + 10).await;

    stop.store(true, Ordering::Relaxed);
    for h in writers {
        h.await.unwrap();
    }
    let acked: BTreeSet<String> = acked.lock().unwrap().iter().cloned().collect();
    let failed = failed.load(Ordering::Relaxed);
    let attempts = attempts.load(Ordering::Relaxed);
    println!(
        "chaos: {attempts} write calls, {} acknowledged, {failed} failed",
        acked.len()
    );
    eprintln!(
        "chaos: {attempts} write calls, {} acknowledged, {failed} failed",
        acked.len()
    );

    // Every member converges on a catalog that holds every acknowledged write.
    for i in 0..3 {
        let missing = eventually(20, "every acknowledged write on every member", || async {
            let (st, l) = call(
                &c,
                "GET",
                &cl.url(i, "/v1/tenants/t/namespaces/n/streams"),
                None,
            )
            .await;
            if st != 200 {
                return None;
            }
            let have: BTreeSet<String> = l
                .as_array()?
                .iter()
                .filter_map(|s| s["name"].as_str().map(String::from))
                .collect();
            let missing: Vec<&String> = acked.difference(&have).collect();
            missing.is_empty().then_some(missing.len())
        })
        .await;
        assert_eq!(missing, 0);
    }
    // And on the same feed: same revision and catalog identity everywhere.
    eventually(
        10,
        "one revision and one catalog id on every member",
        || async {
            let mut revs = BTreeSet::new();
            let mut ids = BTreeSet::new();
            for i in 0..3 {
                let (_, s) = call(&c, "GET", &cl.url(i, "/v1/catalog"), None).await;
                revs.insert(s["revision"].as_u64()?);
                ids.insert(s["catalog_id"].as_str()?.to_string());
            }
            (revs.len() == 1 && ids.len() == 1).then_some(())
        },
    )
    .await;
}

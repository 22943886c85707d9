//! The REST suite against the real `felix-controlplane` binary, run once per store.

mod common;

use common::*;
use serde_json::{json, Value};

/// The suite's settings on a single-member Raft store under `dir`.
fn raft_suite_args(dir: &std::path::Path) -> Vec<String> {
    let mut a = suite_args();
    a.extend([
        "--store".into(),
        "raft".into(),
        "--raft-data-dir".into(),
        p(dir),
    ]);
    a
}

fn suite_args() -> Vec<String> {
    ["--delete-grace-ms", "600000", "--max-body-bytes", "4096"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

#[tokio::test]
async fn rest_suite_memory() {
    let s = Server::start(&suite_args());
    suite(&s).await;
}

#[tokio::test]
async fn rest_suite_raft_single_member() {
    let d = tempdir();
    let s = Server::start(&raft_suite_args(d.path()));
    suite(&s).await;
}

/// A single-member Raft store keeps everything across a clean stop and across SIGKILL, and
/// compacts its log behind snapshots.
#[tokio::test]
async fn raft_single_member_restart_keeps_data() {
    let d = tempdir();
    let c = client();
    let args: Vec<String> = vec![
        "--store".into(),
        "raft".into(),
        "--raft-data-dir".into(),
        p(d.path()),
        "--raft-snapshot-logs".into(),
        "50".into(),
    ];
    let mut s = Server::start(&args);
    wait_ready(&c, &s).await;
    assert_eq!(
        call(
            &c,
            "POST",
            &s.url("/v1/tenants"),
            Some(json!({"name": "keep"}))
        )
        .await
        .0,
        201
    );
    assert_eq!(
        call(
            &c,
            "POST",
            &s.url("/v1/tenants/keep/namespaces"),
            Some(json!({"name": "ns"}))
        )
        .await
        .0,
        201
    );
    let streams = "/v1/tenants/keep/namespaces/ns/streams";
    for i in 0..120 {
        let (st, b) = call(
            &c,
            "POST",
            &s.url(streams),
            Some(json!({"name": format!("s{i}"), "shards": 2})),
        )
        .await;
        assert_eq!(st, 201, "{b}");
    }
    let (_, before) = call(&c, "GET", &s.url("/v1/catalog"), None).await;
    let id = before["catalog_id"].clone();
    s.stop();
    let mut s = Server::start(&args);
    wait_ready(&c, &s).await;
    let (_, after) = call(&c, "GET", &s.url("/v1/catalog"), None).await;
    assert_eq!(after["catalog_id"], id);
    assert_eq!(after["streams"], before["streams"]);
    assert!(after["revision"].as_u64() >= before["revision"].as_u64());
    // Writes after a restart, then SIGKILL: still there.
    assert_eq!(
        call(
            &c,
            "POST",
            &s.url(streams),
            Some(json!({"name": "after-restart"}))
        )
        .await
        .0,
        201
    );
    s.kill();
    let s = Server::start(&args);
    wait_ready(&c, &s).await;
    let (st, _) = call(&c, "GET", &s.url(&format!("{streams}/after-restart")), None).await;
    assert_eq!(st, 200);
    let (_, l) = call(&c, "GET", &s.url(streams), None).await;
    assert_eq!(l.as_array().unwrap().len(), 121);
    assert!(
        d.path().join("snapshot.bin").exists(),
        "a snapshot was taken"
    );
    // The feed continues across restarts without a gap.
    let (st, page) = call(&c, "GET", &s.url("/v1/catalog/changes?since=100"), None).await;
    assert_eq!(st, 200);
    assert_eq!(page["changes"][0]["revision"], 101);
}

/// `/metrics` is Prometheus text (parsed with a Prometheus parser): requests counted by
/// status class and in the latency histogram, the Raft view of a single member.
#[tokio::test]
async fn metrics_count_requests_and_show_raft_state() {
    let d = tempdir();
    let s = Server::start(&raft_suite_args(d.path()));
    let c = client();
    wait_ready(&c, &s).await;
    let scrape = || async {
        let text = get_text(&c, &s.url("/metrics")).await;
        let lines = text.lines().map(|l| Ok(l.to_string()));
        prometheus_parse::Scrape::parse(lines).expect("Prometheus text")
    };
    let value = |m: &prometheus_parse::Scrape, name: &str, label: Option<(&str, &str)>| -> f64 {
        m.samples
            .iter()
            .find(|x| x.metric == name && label.is_none_or(|(k, v)| x.labels.get(k) == Some(v)))
            .map(|x| match x.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Gauge(v) => v,
                prometheus_parse::Value::Untyped(v) => v,
                _ => f64::NAN,
            })
            .unwrap_or_else(|| panic!("no sample {name} {label:?}"))
    };
    let before = scrape().await;
    for _ in 0..10 {
        assert_eq!(call(&c, "GET", &s.url("/v1/tenants"), None).await.0, 200);
    }
    for _ in 0..3 {
        assert_eq!(
            call(&c, "GET", &s.url("/v1/tenants/nope"), None).await.0,
            404
        );
    }
    let after = scrape().await;
    let ok = |m| {
        value(
            m,
            "felix_controlplane_requests_total",
            Some(("class", "2xx")),
        )
    };
    let nf = |m| {
        value(
            m,
            "felix_controlplane_requests_total",
            Some(("class", "4xx")),
        )
    };
    // The first scrape itself is a 2xx counted after it was rendered.
    assert_eq!(ok(&after) - ok(&before), 11.0);
    assert_eq!(nf(&after) - nf(&before), 3.0);
    assert_eq!(
        value(&after, "felix_controlplane_raft_is_leader", None),
        1.0
    );
    assert!(value(&after, "felix_controlplane_raft_term", None) >= 1.0);
    assert_eq!(value(&after, "felix_controlplane_ready", None), 1.0);
    let hist = after
        .samples
        .iter()
        .find(|x| x.metric == "felix_controlplane_request_seconds")
        .expect("latency histogram");
    match &hist.value {
        prometheus_parse::Value::Histogram(h) => {
            let inf = h.iter().find(|b| b.less_than.is_infinite()).unwrap().count;
            assert!(inf >= 14.0, "every request observed: {inf}");
        }
        other => panic!("not a histogram: {other:?}"),
    }
}

async fn wait_ready(c: &reqwest::Client, s: &Server) {
    eventually(20, "readyz", || async {
        (call(c, "GET", &s.url("/readyz"), None).await.0 == 200).then_some(())
    })
    .await;
}

fn code(v: &Value) -> &str {
    v["code"].as_str().unwrap_or("<none>")
}

async fn suite(s: &Server) {
    let c = client();
    let u = |p: &str| s.url(p);
    wait_ready(&c, s).await;
    assert_eq!(call(&c, "GET", &u("/livez"), None).await.0, 200);

    // OpenAPI document, generated from the handlers.
    let (st, doc) = call(&c, "GET", &u("/v1/openapi.json"), None).await;
    assert_eq!(st, 200);
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    for path in [
        "/v1/tenants",
        "/v1/tenants/{tenant}/namespaces/{namespace}/streams/{stream}",
        "/v1/catalog/changes",
        "/v1/brokers/{node_id}/heartbeat",
    ] {
        assert!(doc["paths"][path].is_object(), "openapi lacks {path}");
    }
    assert!(doc["components"]["schemas"]["ErrorBody"].is_object());

    let (_, snap0) = call(&c, "GET", &u("/v1/catalog"), None).await;
    let rev0 = snap0["revision"].as_u64().unwrap();
    assert!(!snap0["catalog_id"].as_str().unwrap().is_empty());

    // Tenants.
    let (st, t) = call(
        &c,
        "POST",
        &u("/v1/tenants"),
        Some(json!({"name": "acme", "description": "first"})),
    )
    .await;
    assert_eq!(st, 201, "{t}");
    assert_eq!(t["name"], "acme");
    let (st, e) = call(&c, "POST", &u("/v1/tenants"), Some(json!({"name": "acme"}))).await;
    assert_eq!((st, code(&e)), (409, "already_exists"));
    for bad in ["a/b", ".hidden", "sp ace", &"x".repeat(65)] {
        let (st, e) = call(&c, "POST", &u("/v1/tenants"), Some(json!({"name": bad}))).await;
        assert_eq!((st, code(&e)), (400, "invalid_name"), "{bad:?}");
    }
    let (st, e) = call(&c, "GET", &u("/v1/tenants/sp%20ace"), None).await;
    assert_eq!((st, code(&e)), (400, "invalid_name"));
    let (st, e) = call(&c, "GET", &u("/v1/tenants/nobody"), None).await;
    assert_eq!((st, code(&e)), (404, "unknown_tenant"));
    let (st, t) = call(
        &c,
        "PATCH",
        &u("/v1/tenants/acme"),
        Some(json!({"description": "changed"})),
    )
    .await;
    assert_eq!((st, t["description"].as_str()), (200, Some("changed")));
    let (st, l) = call(&c, "GET", &u("/v1/tenants"), None).await;
    assert_eq!(st, 200);
    assert!(l.as_array().unwrap().iter().any(|t| t["name"] == "acme"));

    // Bodies: unknown fields, bad JSON, wrong content type, too large: typed 4xx, never 5xx.
    let (st, e) = call(
        &c,
        "POST",
        &u("/v1/tenants"),
        Some(json!({"name": "x", "bogus": 1})),
    )
    .await;
    assert_eq!((st, code(&e)), (400, "invalid_request"));
    let r = c
        .post(u("/v1/tenants"))
        .header("content-type", "application/json")
        .body("{nope")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let r = c
        .post(u("/v1/tenants"))
        .body("{\"name\":\"x\"}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 415);
    let big = json!({"name": "x", "description": "d".repeat(5000)});
    let (st, e) = call(&c, "POST", &u("/v1/tenants"), Some(big)).await;
    assert_eq!((st, code(&e)), (413, "payload_too_large"));
    let (st, e) = call(&c, "GET", &u("/v1/nothing/here"), None).await;
    assert_eq!((st, code(&e)), (404, "not_found"));
    let (st, e) = call(&c, "PUT", &u("/v1/tenants"), None).await;
    assert_eq!((st, code(&e)), (405, "invalid_request"));

    // Namespaces.
    let ns = u("/v1/tenants/acme/namespaces");
    let (st, e) = call(
        &c,
        "POST",
        &u("/v1/tenants/ghost/namespaces"),
        Some(json!({"name": "n"})),
    )
    .await;
    assert_eq!((st, code(&e)), (404, "unknown_tenant"));
    assert_eq!(
        call(&c, "POST", &ns, Some(json!({"name": "prod"}))).await.0,
        201
    );
    let (st, e) = call(&c, "POST", &ns, Some(json!({"name": "prod"}))).await;
    assert_eq!((st, code(&e)), (409, "already_exists"));
    let (st, e) = call(&c, "GET", &u("/v1/tenants/acme/namespaces/none"), None).await;
    assert_eq!((st, code(&e)), (404, "unknown_namespace"));
    let (st, e) = call(&c, "DELETE", &u("/v1/tenants/acme"), None).await;
    assert_eq!((st, code(&e)), (409, "conflict"));

    // Streams.
    let streams = u("/v1/tenants/acme/namespaces/prod/streams");
    let (st, e) = call(
        &c,
        "POST",
        &streams,
        Some(json!({"name": "s", "replication_factor": 3})),
    )
    .await;
    assert_eq!((st, code(&e)), (400, "invalid_request"), "ephemeral: {e}");
    let (st, e) = call(
        &c,
        "POST",
        &streams,
        Some(json!({"name": "s", "replication_factor": 3, "durable": true})),
    )
    .await;
    assert_eq!((st, code(&e)), (400, "invalid_request"), "no brokers: {e}");
    assert!(e.to_string().contains("0 registered"), "{e}");
    let (st, e) = call(
        &c,
        "POST",
        &streams,
        Some(json!({"name": "s", "consistency": "quorum", "durable": true})),
    )
    .await;
    assert_eq!((st, code(&e)), (400, "unsupported"));
    let (st, e) = call(
        &c,
        "POST",
        &streams,
        Some(json!({"name": "s", "shards": 0})),
    )
    .await;
    assert_eq!((st, code(&e)), (400, "invalid_request"));
    let (st, e) = call(
        &c,
        "POST",
        &streams,
        Some(json!({"name": "s", "fsync": "sometimes"})),
    )
    .await;
    assert_eq!((st, code(&e)), (400, "invalid_request"));
    let (st, e) = call(
        &c,
        "POST",
        &u("/v1/tenants/acme/namespaces/nope/streams"),
        Some(json!({"name": "s"})),
    )
    .await;
    assert_eq!((st, code(&e)), (404, "unknown_namespace"));
    let (st, sv) = call(
        &c,
        "POST",
        &streams,
        Some(json!({"name": "orders", "shards": 4, "durable": true, "retention_bytes": 1048576, "fsync": "periodic"})),
    )
    .await;
    assert_eq!(st, 201, "{sv}");
    assert_eq!(sv["shards"], 4);
    assert_eq!(sv["consistency"], "leader");
    assert_eq!(sv["replication_factor"], 1);
    assert_eq!(sv["state"], "active");
    assert_eq!(sv["placement"].as_array().unwrap().len(), 4);
    let (st, e) = call(&c, "POST", &streams, Some(json!({"name": "orders"}))).await;
    assert_eq!((st, code(&e)), (409, "already_exists"));
    let so = format!("{streams}/orders");
    let (st, sv) = call(
        &c,
        "PATCH",
        &so,
        Some(json!({"retention_seconds": 60, "retention_bytes": 0})),
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(sv["retention_seconds"], 60);
    assert!(sv["retention_bytes"].is_null());
    let (st, e) = call(&c, "PATCH", &so, Some(json!({"shards": 8}))).await;
    assert_eq!((st, code(&e)), (400, "unsupported"));
    let (st, e) = call(&c, "PATCH", &so, Some(json!({"replication_factor": 2}))).await;
    assert_eq!((st, code(&e)), (400, "unsupported"));
    let (st, sh) = call(&c, "GET", &format!("{so}/shards"), None).await;
    assert_eq!(st, 200);
    assert!(sh
        .as_array()
        .unwrap()
        .iter()
        .all(|p| p["state"] == "unassigned"));
    let (st, e) = call(&c, "GET", &format!("{streams}/missing"), None).await;
    assert_eq!((st, code(&e)), (404, "unknown_stream"));
    let (st, l) = call(&c, "GET", &streams, None).await;
    assert_eq!((st, l.as_array().unwrap().len()), (200, 1));

    // Caches.
    let caches = u("/v1/tenants/acme/namespaces/prod/caches");
    let (st, cv) = call(
        &c,
        "POST",
        &caches,
        Some(json!({"name": "sessions", "shards": 2, "ttl_seconds": 30})),
    )
    .await;
    assert_eq!((st, cv["ttl_seconds"].as_u64()), (201, Some(30)));
    let (st, e) = call(&c, "POST", &caches, Some(json!({"name": "sessions"}))).await;
    assert_eq!((st, code(&e)), (409, "already_exists"));
    let (st, cv) = call(
        &c,
        "PATCH",
        &format!("{caches}/sessions"),
        Some(json!({"ttl_seconds": 0})),
    )
    .await;
    assert_eq!(st, 200);
    assert!(cv["ttl_seconds"].is_null());
    // A default TTL past what brokers accept (about 10 years) is refused, on create and update.
    let (st, e) = call(
        &c,
        "PATCH",
        &format!("{caches}/sessions"),
        Some(json!({"ttl_seconds": 315_360_001u64})),
    )
    .await;
    assert_eq!((st, code(&e)), (400, "invalid_request"));
    let (st, e) = call(
        &c,
        "POST",
        &caches,
        Some(json!({"name": "forever", "ttl_seconds": u64::MAX})),
    )
    .await;
    assert_eq!((st, code(&e)), (400, "invalid_request"));
    let (st, e) = call(&c, "GET", &format!("{caches}/nope"), None).await;
    assert_eq!((st, code(&e)), (404, "not_found"));
    // No live broker: a delete completes on the next sweep.
    let (st, cv) = call(&c, "DELETE", &format!("{caches}/sessions"), None).await;
    assert_eq!((st, cv["state"].as_str()), (202, Some("deleting")));
    eventually(10, "cache delete to finish", || async {
        (call(&c, "GET", &format!("{caches}/sessions"), None).await.0 == 404).then_some(())
    })
    .await;

    // The feed: every change after rev0, consecutive, replaying to the snapshot's contents.
    let (st, page) = call(
        &c,
        "GET",
        &u(&format!("/v1/catalog/changes?since={rev0}")),
        None,
    )
    .await;
    assert_eq!(st, 200);
    let revs: Vec<u64> = page["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["revision"].as_u64().unwrap())
        .collect();
    assert!(!revs.is_empty());
    for (i, r) in revs.iter().enumerate() {
        assert_eq!(*r, rev0 + 1 + i as u64, "gap in feed");
    }
    let types: Vec<&str> = page["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["event"]["type"].as_str().unwrap())
        .collect();
    assert!(
        types.contains(&"tenant_put")
            && types.contains(&"stream_put")
            && types.contains(&"cache_deleted")
    );
    let (_, snap) = call(&c, "GET", &u("/v1/catalog"), None).await;
    let head = snap["revision"].as_u64().unwrap();
    assert_eq!(page["next_since"].as_u64().unwrap(), head);
    // Paging.
    let (_, p1) = call(
        &c,
        "GET",
        &u(&format!("/v1/catalog/changes?since={rev0}&limit=2")),
        None,
    )
    .await;
    assert_eq!(p1["changes"].as_array().unwrap().len(), 2);
    assert_eq!(p1["more"], true);
    // Nothing new: an immediate empty answer; a long-poll is woken by a write.
    let (st, empty) = call(
        &c,
        "GET",
        &u(&format!("/v1/catalog/changes?since={head}")),
        None,
    )
    .await;
    assert_eq!((st, empty["changes"].as_array().unwrap().len()), (200, 0));
    let poll = {
        let c = c.clone();
        let url = u(&format!("/v1/catalog/changes?since={head}&wait_ms=5000"));
        tokio::spawn(async move { call(&c, "GET", &url, None).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert_eq!(
        call(&c, "POST", &ns, Some(json!({"name": "staging"})))
            .await
            .0,
        201
    );
    let (st, woke) = poll.await.unwrap();
    assert_eq!(st, 200);
    assert_eq!(woke["changes"][0]["revision"].as_u64().unwrap(), head + 1);
    assert_eq!(woke["changes"][0]["event"]["type"], "namespace_put");
    let (st, e) = call(
        &c,
        "GET",
        &u("/v1/catalog/changes?since=0&wait_ms=999999"),
        None,
    )
    .await;
    assert_eq!((st, code(&e)), (400, "invalid_request"));
    let (st, e) = call(&c, "GET", &u("/v1/catalog/changes?since=-1"), None).await;
    assert_eq!((st, code(&e)), (400, "invalid_request"));
    let (st, e) = call(&c, "GET", &u("/v1/catalog/changes?since=999999"), None).await;
    assert_eq!((st, code(&e)), (410, "revision_too_old"));
    // Push the ring (200 long) past revision 0.
    for i in 0..210 {
        let (st, _) = call(
            &c,
            "PATCH",
            &u("/v1/tenants/acme"),
            Some(json!({"description": format!("d{i}")})),
        )
        .await;
        assert_eq!(st, 200);
    }
    let (st, e) = call(&c, "GET", &u("/v1/catalog/changes?since=0"), None).await;
    assert_eq!((st, code(&e)), (410, "revision_too_old"));

    // Brokers and placement.
    let (st, e) = call(&c, "POST", &u("/v1/brokers/77/heartbeat"), Some(json!({}))).await;
    assert_eq!((st, code(&e)), (404, "not_found"));
    let (st, e) = call(
        &c,
        "POST",
        &u("/v1/brokers"),
        Some(json!({"node_id": 1, "quic_addr": "nohost", "cores": 2})),
    )
    .await;
    assert_eq!((st, code(&e)), (400, "invalid_request"));
    let (st, e) = call(&c, "POST", &u("/v1/brokers/abc/heartbeat"), Some(json!({}))).await;
    assert_eq!((st, code(&e)), (400, "invalid_request"));
    let mut incarnation = [0u64; 3];
    for id in [1u64, 2] {
        let (st, r) = call(
            &c,
            "POST",
            &u("/v1/brokers"),
            Some(
                json!({"node_id": id, "quic_addr": format!("127.0.0.1:{}", 7400 + id), "cores": 2}),
            ),
        )
        .await;
        assert_eq!(st, 200, "{r}");
        assert_eq!(r["broker"]["live"], true);
        assert!(r["heartbeat_interval_ms"].as_u64().unwrap() > 0);
        incarnation[id as usize] = r["broker"]["incarnation"].as_u64().unwrap();
    }
    // A heartbeat with a stale incarnation is refused.
    let (st, e) = call(
        &c,
        "POST",
        &u("/v1/brokers/1/heartbeat"),
        Some(json!({"incarnation": 999})),
    )
    .await;
    assert_eq!((st, code(&e)), (409, "conflict"));
    // The durable stream created before any broker went whole to the first one: a durable
    // shard is never moved once placed (no replication yet).
    let (_, sh) = call(&c, "GET", &format!("{so}/shards"), None).await;
    assert!(
        sh.as_array()
            .unwrap()
            .iter()
            .all(|p| p["owner"] == 1 && p["state"] == "assigned"),
        "{sh}"
    );
    let (st, lv) = call(
        &c,
        "POST",
        &streams,
        Some(json!({"name": "ledger", "shards": 4, "durable": true})),
    )
    .await;
    assert_eq!(st, 201);
    let owners: Vec<u64> = lv["placement"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["owner"].as_u64().unwrap())
        .collect();
    assert_eq!(owners, vec![1, 2, 1, 2]);
    let so = format!("{streams}/ledger");
    let (st, ev) = call(
        &c,
        "POST",
        &streams,
        Some(json!({"name": "events", "shards": 6})),
    )
    .await;
    assert_eq!(st, 201);
    let n1 = ev["placement"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["owner"] == 1)
        .count();
    assert_eq!(n1, 3);
    let (st, bl) = call(&c, "GET", &u("/v1/brokers"), None).await;
    assert_eq!((st, bl.as_array().unwrap().len()), (200, 2));

    // Broker 1 keeps heartbeating (reporting the catalog revision); broker 2 goes silent.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hb = {
        let (c, url, stop) = (c.clone(), u("/v1/brokers/1/heartbeat"), stop.clone());
        let cat = u("/v1/catalog");
        let inc = incarnation[1];
        tokio::spawn(async move {
            for _ in 0..600 {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let (_, snap) = call(&c, "GET", &cat, None).await;
                let rev = snap["revision"].as_u64().unwrap_or(0);
                let _ = call(
                    &c,
                    "POST",
                    &url,
                    Some(json!({"incarnation": inc, "catalog_revision": rev})),
                )
                .await;
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        })
    };
    eventually(20, "broker 2 counted dead", || async {
        let (_, b) = call(&c, "GET", &u("/v1/brokers/2"), None).await;
        (b["live"] == false).then_some(())
    })
    .await;
    assert_eq!(
        call(&c, "GET", &u("/v1/brokers/1"), None).await.1["live"],
        true
    );
    // Ephemeral shards moved to broker 1; durable shards stayed on 2, unavailable.
    let (_, ev) = call(&c, "GET", &format!("{streams}/events"), None).await;
    assert!(
        ev["placement"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["owner"] == 1 && p["state"] == "assigned"),
        "{ev}"
    );
    let (_, sh) = call(&c, "GET", &format!("{so}/shards"), None).await;
    for p in sh.as_array().unwrap() {
        if p["owner"] == 2 {
            assert_eq!(p["state"], "unavailable");
        } else {
            assert_eq!(p["state"], "assigned");
        }
    }

    // Delete while a live broker has not caught up: the name is held (409) until it has.
    // Broker 3 registers and never heartbeats a revision, so it holds the delete until it is
    // counted dead.
    let (st, _) = call(
        &c,
        "POST",
        &u("/v1/brokers"),
        Some(json!({"node_id": 3, "quic_addr": "broker-3.local:7400", "cores": 1})),
    )
    .await;
    assert_eq!(st, 200);
    let (st, d) = call(&c, "DELETE", &format!("{streams}/events"), None).await;
    assert_eq!((st, d["state"].as_str()), (202, Some("deleting")));
    let (st, e) = call(&c, "POST", &streams, Some(json!({"name": "events"}))).await;
    assert_eq!((st, code(&e)), (409, "conflict"), "re-create mid-delete");
    let (st, e) = call(&c, "PATCH", &format!("{streams}/events"), Some(json!({}))).await;
    assert_eq!((st, code(&e)), (409, "conflict"));
    let (st, _) = call(&c, "DELETE", &format!("{streams}/events"), None).await;
    assert_eq!(st, 202, "delete is idempotent while deleting");
    // Once broker 3 is dead and broker 1 has reported a revision past the delete, it finishes.
    eventually(20, "stream delete to finish", || async {
        (call(&c, "GET", &format!("{streams}/events"), None).await.0 == 404).then_some(())
    })
    .await;
    assert_eq!(
        call(&c, "POST", &streams, Some(json!({"name": "events"})))
            .await
            .0,
        201
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    hb.await.unwrap();

    // A silent broker that heartbeats again comes back live; its durable shards are served again.
    let (st, r) = call(
        &c,
        "POST",
        &u("/v1/brokers/2/heartbeat"),
        Some(json!({"incarnation": incarnation[2]})),
    )
    .await;
    assert_eq!((st, r["live"].as_bool()), (200, Some(true)));
    let (_, sh) = call(&c, "GET", &format!("{so}/shards"), None).await;
    assert!(
        sh.as_array()
            .unwrap()
            .iter()
            .all(|p| p["state"] == "assigned"),
        "{sh}"
    );

    // A stopping broker says it leaves: counted dead at once, not after dead_after_ms. Only
    // with its own incarnation (an older process never undoes a newer one's registration).
    let leave = |inc: Option<u64>| json!({"incarnation": inc, "leaving": true});
    let (st, e) = call(&c, "POST", &u("/v1/brokers/2/heartbeat"), Some(leave(None))).await;
    assert_eq!((st, code(&e)), (400, "invalid_request"));
    let (st, e) = call(
        &c,
        "POST",
        &u("/v1/brokers/2/heartbeat"),
        Some(leave(Some(999))),
    )
    .await;
    assert_eq!((st, code(&e)), (409, "conflict"));
    let (st, r) = call(
        &c,
        "POST",
        &u("/v1/brokers/2/heartbeat"),
        Some(leave(Some(incarnation[2]))),
    )
    .await;
    assert_eq!((st, r["live"].as_bool()), (200, Some(false)), "{r}");
    let (_, b) = call(&c, "GET", &u("/v1/brokers/2"), None).await;
    assert_eq!(b["live"], false, "{b}");
    let (_, sh) = call(&c, "GET", &format!("{so}/shards"), None).await;
    assert!(
        sh.as_array()
            .unwrap()
            .iter()
            .any(|p| p["owner"] == 2 && p["state"] == "unavailable"),
        "its durable shards wait for it: {sh}"
    );

    // Cluster status.
    let (st, cl) = call(&c, "GET", &u("/v1/cluster"), None).await;
    assert_eq!((st, cl["ready"].as_bool()), (200, Some(true)));
    assert_eq!(cl["is_leader"], true);
}

/// `--print-config` prints the effective settings (flag over environment over default) and
/// exits.
#[test]
fn print_config_shows_effective_settings() {
    let out = std::process::Command::new(common::BIN)
        .args(["--print-config", "--dead-after-ms", "7777", "--auth", "off"])
        .args(["--tls", "off"])
        .env("FELIX_CONTROLPLANE_DEAD_AFTER_MS", "1234")
        .env("FELIX_CONTROLPLANE_MAX_SHARDS", "99")
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["dead_after_ms"], 7777, "flag beats environment");
    assert_eq!(v["max_shards"], 99, "environment beats default");
    assert_eq!(v["max_wait_ms"], 30000, "default");
    assert_eq!(v["log_format"], "text");
    // With auth on (the default), the memory store needs a place for the admin token.
    let out = std::process::Command::new(common::BIN)
        .args(["--print-config", "--store", "memory"])
        .env_remove("FELIX_RAFT_DATA_DIR")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--admin-token-file"));
    // HTTPS is the default: its development certificate needs a directory too, and the
    // refusal names the way out.
    let out = std::process::Command::new(common::BIN)
        .args(["--print-config", "--store", "memory", "--auth", "off"])
        .env_remove("FELIX_RAFT_DATA_DIR")
        .env_remove("FELIX_CONTROLPLANE_TLS")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tls off"));
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(common::BIN)
        .args(["--print-config", "--store", "memory", "--admin-token-file"])
        .arg(dir.path().join("admin.token"))
        .env_remove("FELIX_CONTROLPLANE_TLS")
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (v["tls"].as_str(), v["auth"].as_str()),
        (Some("on"), Some("on"))
    );
}

/// SIGTERM drains: a changes long poll waiting 30 s is answered at once (200, an empty
/// page), and the process exits 0 inside its drain budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_answers_long_polls_and_exits_clean() {
    let mut args: Vec<String> = ["--listen", "127.0.0.1:0", "--max-wait-ms", "30000"]
        .iter()
        .map(|a| a.to_string())
        .collect();
    args.extend(
        common::base_args()
            .into_iter()
            .filter(|a| a != "--max-wait-ms" && a != "5000"),
    );
    let mut s = common::Server::start_exact(args);
    let c = common::client();
    let (st, snap) = common::call(&c, "GET", &s.url("/v1/catalog"), None).await;
    assert_eq!(st, 200);
    let rev = snap["revision"].as_u64().unwrap();
    let url = s.url(&format!("/v1/catalog/changes?since={rev}&wait_ms=30000"));
    let poll =
        tokio::spawn(async move { common::call(&common::client(), "GET", &url, None).await });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!poll.is_finished(), "the poll waits while serving");
    let mut child = s.take_child();
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let (st, page) = tokio::time::timeout(std::time::Duration::from_secs(10), poll)
        .await
        .expect("the long poll is answered by the drain, not by its 30 s wait")
        .unwrap();
    assert_eq!(st, 200, "{page}");
    assert_eq!(page["changes"].as_array().map(|a| a.len()), Some(0));
    let t = std::time::Instant::now();
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "did not exit"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(code, Some(0), "a clean drain exits 0");
}

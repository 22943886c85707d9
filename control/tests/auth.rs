//! Bearer tokens on the REST API, against real `felix-controlplane` processes with auth on
//! (its default): the bootstrap admin token, tenant-scoped tokens, node credentials, key
//! rotation, and the bootstrap happening once across restarts.

mod common;

use common::*;
use serde_json::{json, Value};

struct Authed {
    s: Server,
    _dir: tempfile::TempDir,
    admin: String,
}

fn start_memory() -> Authed {
    let d = tempdir();
    let file = d.path().join("admin.token");
    let mut args = vec!["--listen".to_string(), "127.0.0.1:0".to_string()];
    args.extend(base_args_auth_on());
    args.extend([
        "--store".into(),
        "memory".into(),
        "--admin-token-file".into(),
        p(&file),
    ]);
    let s = Server::start_exact(args);
    let admin = admin_token(&file);
    Authed { s, _dir: d, admin }
}

async fn as_(token: &str, method: &str, url: &str, body: Option<Value>) -> (u16, Value) {
    call(&client_with(token), method, url, body).await
}

fn code(b: &Value) -> &str {
    b["code"].as_str().unwrap_or("")
}

async fn mint(a: &Authed, by: &str, body: Value) -> (u16, Value) {
    as_(by, "POST", &a.s.url("/v1/tokens"), Some(body)).await
}

#[tokio::test]
async fn everything_but_health_and_the_document_needs_a_valid_token() {
    let a = start_memory();
    let c = client();
    for path in ["/livez", "/readyz", "/v1/openapi.json"] {
        let (st, _) = call(&c, "GET", &a.s.url(path), None).await;
        assert_eq!(st, 200, "{path} is open");
    }
    for (m, path) in [
        ("GET", "/v1/tenants"),
        ("POST", "/v1/tenants"),
        ("GET", "/v1/catalog"),
        ("GET", "/v1/catalog/changes"),
        ("GET", "/v1/brokers"),
        ("GET", "/v1/cluster"),
        ("GET", "/metrics"),
        ("GET", "/v1/auth/jwks"),
        ("POST", "/v1/tokens"),
        ("POST", "/internal/v1/write"),
        ("GET", "/v1/no-such-route"),
    ] {
        let (st, b) = call(&c, m, &a.s.url(path), None).await;
        assert_eq!((st, code(&b)), (401, "unauthenticated"), "{m} {path}: {b}");
    }
    // Hostile bearers are refused typed, and the server keeps serving.
    let garbage = "x".repeat(300);
    let big = "a".repeat(9_000);
    for bad in [
        "not-a-token",
        "a.b.c",
        &garbage,
        &big,
        "eyJhbGciOiJub25lIn0.e30.",
    ] {
        let (st, b) = as_(bad, "GET", &a.s.url("/v1/tenants"), None).await;
        assert_eq!((st, code(&b)), (401, "unauthenticated"), "{b}");
    }
    let (st, b) = as_(&a.admin, "GET", &a.s.url("/v1/tenants"), None).await;
    assert_eq!(st, 200, "{b}");
    let (st, _) = as_(&a.admin, "GET", &a.s.url("/metrics"), None).await;
    assert_eq!(st, 200);
}

#[tokio::test]
async fn a_tenant_token_reaches_only_its_tenant_and_grants_no_more_than_it_holds() {
    let a = start_memory();
    let admin = a.admin.clone();
    for (path, body) in [
        ("/v1/tenants", json!({"name": "acme"})),
        ("/v1/tenants", json!({"name": "other"})),
        ("/v1/tenants/acme/namespaces", json!({"name": "prod"})),
        ("/v1/tenants/acme/namespaces", json!({"name": "dev"})),
        ("/v1/tenants/other/namespaces", json!({"name": "prod"})),
    ] {
        let (st, b) = as_(&admin, "POST", &a.s.url(path), Some(body)).await;
        assert_eq!(st, 201, "{path}: {b}");
    }
    let (st, b) = mint(
        &a,
        &admin,
        json!({"subject": "ops", "tenant": "acme", "perms": ["manage:prod/*", "stream.publish:prod/*"]}),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    let ops = b["token"].as_str().unwrap().to_string();
    assert_eq!(b["record"]["tenant"], "acme");

    let prod = "/v1/tenants/acme/namespaces/prod";
    let (st, b) = as_(
        &ops,
        "POST",
        &a.s.url(&format!("{prod}/streams")),
        Some(json!({"name": "orders", "shards": 1})),
    )
    .await;
    assert_eq!(st, 201, "manage:prod/* creates in prod: {b}");
    for (m, path, body) in [
        (
            "POST",
            "/v1/tenants/acme/namespaces/dev/streams".to_string(),
            Some(json!({"name": "x", "shards": 1})),
        ),
        (
            "POST",
            "/v1/tenants/acme/namespaces".to_string(),
            Some(json!({"name": "new"})),
        ),
        ("GET", "/v1/tenants/other/namespaces/prod".to_string(), None),
        ("GET", "/v1/tenants".to_string(), None),
        ("GET", "/v1/catalog".to_string(), None),
    ] {
        let (st, b) = as_(&ops, m, &a.s.url(&path), body).await;
        assert_eq!((st, code(&b)), (403, "forbidden"), "{m} {path}: {b}");
        assert!(
            b["message"].as_str().unwrap().contains("lacks"),
            "names the permission: {b}"
        );
    }
    // Minting: within what it holds, for its own tenant only. (manage:prod/* is not the
    // tenant's manage:*, which minting needs.)
    let (st, b) = mint(
        &a,
        &ops,
        json!({"subject": "app", "tenant": "acme", "perms": ["stream.publish:prod/orders"]}),
    )
    .await;
    assert_eq!((st, code(&b)), (403, "forbidden"), "{b}");
    let (st, b) = mint(&a, &admin, json!({"subject": "lead", "tenant": "acme", "perms": ["manage:*", "stream.publish:prod/*"]})).await;
    assert_eq!(st, 200, "{b}");
    let lead = b["token"].as_str().unwrap().to_string();
    let (st, b) = mint(&a, &lead, json!({"subject": "app", "tenant": "acme", "perms": ["stream.publish:prod/orders"], "ttl_s": 60})).await;
    assert_eq!(st, 200, "{b}");
    let (st, b) = mint(
        &a,
        &lead,
        json!({"subject": "app", "tenant": "acme", "perms": ["stream.subscribe:prod/orders"]}),
    )
    .await;
    assert_eq!(
        (st, code(&b)),
        (403, "forbidden"),
        "cannot grant what it lacks: {b}"
    );
    let (st, b) = mint(
        &a,
        &lead,
        json!({"subject": "app", "tenant": "other", "perms": ["stream.publish:prod/*"]}),
    )
    .await;
    assert_eq!((st, code(&b)), (403, "forbidden"), "{b}");
    let (st, b) = mint(
        &a,
        &lead,
        json!({"subject": "app", "tenant": "*", "perms": ["stream.publish:*"]}),
    )
    .await;
    assert_eq!((st, code(&b)), (403, "forbidden"), "{b}");
    // Bad requests are typed.
    for body in [
        json!({"subject": "", "tenant": "acme", "perms": ["manage:*"]}),
        json!({"subject": "a", "tenant": "acme", "perms": []}),
        json!({"subject": "a", "tenant": "acme", "perms": ["fly:*"]}),
        json!({"subject": "a", "tenant": "acme", "perms": ["manage:*"], "ttl_s": 0}),
        json!({"subject": "a", "tenant": "acme", "perms": ["manage:*"], "ttl_s": 999_999_999u64}),
    ] {
        let (st, b) = mint(&a, &admin, body.clone()).await;
        assert_eq!(st, 400, "{body}: {b}");
    }
    // The register lists what was issued, by tenant for the tenant's manager.
    let (st, b) = as_(&lead, "GET", &a.s.url("/v1/tokens?tenant=acme"), None).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b.as_array().unwrap().len(), 3, "{b}");
    assert!(b.to_string().find("eyJ").is_none(), "no token in a listing");
    let (st, _) = as_(&lead, "GET", &a.s.url("/v1/tokens"), None).await;
    assert_eq!(st, 403, "all tenants' tokens need cluster scope");
}

#[tokio::test]
async fn a_node_credential_acts_only_as_its_own_broker() {
    let a = start_memory();
    let (st, b) = as_(
        &a.admin,
        "POST",
        &a.s.url("/v1/nodes/3/token"),
        Some(json!({})),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    let node = b["token"].as_str().unwrap().to_string();
    let reg = |id: u64| json!({"node_id": id, "quic_addr": "127.0.0.1:7400", "cores": 1});
    let (st, b) = as_(&node, "POST", &a.s.url("/v1/brokers"), Some(reg(4))).await;
    assert_eq!((st, code(&b)), (403, "forbidden"), "another node's id: {b}");
    let (st, b) = as_(&node, "POST", &a.s.url("/v1/brokers"), Some(reg(3))).await;
    assert_eq!(st, 200, "{b}");
    let inc = b["broker"]["incarnation"].as_u64().unwrap();
    let (st, b) = as_(
        &node,
        "POST",
        &a.s.url("/v1/brokers/3/heartbeat"),
        Some(json!({"incarnation": inc})),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    let (st, _) = as_(
        &node,
        "POST",
        &a.s.url("/v1/brokers/4/heartbeat"),
        Some(json!({})),
    )
    .await;
    assert_eq!(st, 403);
    // A shard report speaks for its leader: only as itself.
    let report = |leader: u64| json!({"generation": 1, "leader": leader, "seq": 1, "holders": []});
    let at =
        a.s.url("/v1/tenants/t/namespaces/n/streams/s/shards/0/report");
    let (st, b) = as_(&node, "POST", &at, Some(report(4))).await;
    assert_eq!((st, code(&b)), (403, "forbidden"), "as another broker: {b}");
    let (st, b) = as_(&node, "POST", &at, Some(report(3))).await;
    assert_eq!(st, 404, "as itself it passes, to an unknown stream: {b}");
    for path in ["/v1/catalog", "/v1/auth/jwks"] {
        let (st, b) = as_(&node, "GET", &a.s.url(path), None).await;
        assert_eq!(st, 200, "{path}: {b}");
    }
    for (m, path) in [
        ("GET", "/v1/tenants"),
        ("POST", "/v1/nodes/4/token"),
        ("POST", "/v1/auth/keys"),
    ] {
        let (st, _) = as_(&node, m, &a.s.url(path), Some(json!({}))).await;
        assert_eq!(st, 403, "{m} {path}");
    }
    // It renews its own.
    let (st, b) = as_(
        &node,
        "POST",
        &a.s.url("/v1/nodes/3/token"),
        Some(json!({"ttl_s": 600})),
    )
    .await;
    assert_eq!(st, 200, "{b}");
}

#[tokio::test]
async fn a_rotation_keeps_both_keys_valid_until_the_old_one_is_removed() {
    let a = start_memory();
    let old_admin = a.admin.clone();
    let (st, b) = as_(&old_admin, "POST", &a.s.url("/v1/auth/keys"), None).await;
    assert_eq!(st, 200, "{b}");
    let keys = b.as_array().unwrap().clone();
    assert_eq!(keys.len(), 2);
    let old_kid = keys[0]["kid"].as_str().unwrap().to_string();
    assert!(keys[0]["retired_at_s"].is_u64() && keys[1]["retired_at_s"].is_null());
    let (_, jwks) = as_(&old_admin, "GET", &a.s.url("/v1/auth/jwks"), None).await;
    assert_eq!(jwks["keys"].as_array().unwrap().len(), 2, "{jwks}");
    // The old admin token still works; a new one is signed by the new key.
    let (st, b) = mint(
        &a,
        &old_admin,
        json!({"subject": "admin2", "tenant": "*", "perms": ["cluster.admin:*", "manage:*"]}),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    let admin2 = b["token"].as_str().unwrap().to_string();
    let (st, b) = as_(
        &admin2,
        "DELETE",
        &a.s.url(&format!(
            "/v1/auth/keys/{}",
            keys[1]["kid"].as_str().unwrap()
        )),
        None,
    )
    .await;
    assert_eq!((st, code(&b)), (409, "conflict"), "the signer stays: {b}");
    let (st, b) = as_(
        &admin2,
        "DELETE",
        &a.s.url(&format!("/v1/auth/keys/{old_kid}")),
        None,
    )
    .await;
    assert_eq!(st, 200, "{b}");
    let (st, b) = as_(&old_admin, "GET", &a.s.url("/v1/tenants"), None).await;
    assert_eq!(
        (st, code(&b)),
        (401, "unauthenticated"),
        "signed by a removed key: {b}"
    );
    let (st, _) = as_(&admin2, "GET", &a.s.url("/v1/tenants"), None).await;
    assert_eq!(st, 200);
}

#[tokio::test]
async fn the_bootstrap_happens_once_and_survives_a_restart() {
    let d = tempdir();
    let args = || {
        let mut v = vec!["--listen".to_string(), "127.0.0.1:0".to_string()];
        v.extend(base_args_auth_on());
        v.extend([
            "--store".into(),
            "raft".into(),
            "--raft-data-dir".into(),
            p(d.path()),
        ]);
        v
    };
    let file = d.path().join("admin.token");
    let mut s = Server::start_exact(args());
    let first = admin_token(&file);
    let (st, b) = as_(
        &first,
        "POST",
        &s.url("/v1/tenants"),
        Some(json!({"name": "t"})),
    )
    .await;
    assert_eq!(st, 201, "{b}");
    s.stop();
    std::fs::remove_file(&file).unwrap();
    let s = Server::start_exact(args());
    let again = admin_token(&file);
    assert_eq!(first, again, "the same key and admin token after a restart");
    let (st, b) = as_(&again, "GET", &s.url("/v1/tenants/t"), None).await;
    assert_eq!(st, 200, "{b}");
}

#[tokio::test]
async fn a_revocation_refuses_what_it_names_at_once_and_the_feed_long_polls_for_it() {
    let a = start_memory();
    let admin = a.admin.clone();
    for name in ["acme", "other"] {
        let (st, b) = as_(
            &admin,
            "POST",
            &a.s.url("/v1/tenants"),
            Some(json!({"name": name})),
        )
        .await;
        assert_eq!(st, 201, "{b}");
    }
    let mut tok = std::collections::HashMap::new();
    for (who, subject, tenant) in [
        ("lead", "lead", "acme"),
        ("t1", "app1", "acme"),
        ("t2", "app2", "acme"),
        ("o1", "app1", "other"),
    ] {
        let (st, b) = mint(
            &a,
            &admin,
            json!({"subject": subject, "tenant": tenant, "perms": ["manage:*"]}),
        )
        .await;
        assert_eq!(st, 200, "{b}");
        let t = b["token"].as_str().unwrap().to_string();
        tok.insert(who, (t, b["record"]["jti"].as_str().unwrap().to_string()));
    }
    let feed = a.s.url("/v1/auth/revocations");
    let (st, b) = as_(&admin, "GET", &format!("{feed}?since=0"), None).await;
    assert_eq!(
        (st, &b["revision"], &b["revocations"]),
        (200, &json!(0), &json!([])),
        "{b}"
    );
    let (st, b) = as_(&tok["lead"].0, "GET", &feed, None).await;
    assert_eq!(
        (st, code(&b)),
        (403, "forbidden"),
        "the feed is cluster scope: {b}"
    );
    let poll = {
        let (admin, feed) = (admin.clone(), feed.clone());
        tokio::spawn(async move {
            as_(&admin, "GET", &format!("{feed}?since=0&wait_ms=4000"), None).await
        })
    };

    // The tenant's manager revokes one of its tokens; nothing else.
    let revoke = a.s.url("/v1/tokens/revoke");
    let (st, b) = as_(
        &tok["lead"].0,
        "POST",
        &revoke,
        Some(json!({"jti": tok["t1"].1})),
    )
    .await;
    assert_eq!((st, &b["kind"]), (200, &json!("jti")), "{b}");
    let (st, b) = tokio::time::timeout(std::time::Duration::from_secs(10), poll)
        .await
        .expect("the long poll answers on the revocation")
        .unwrap();
    assert_eq!((st, &b["revision"]), (200, &json!(1)), "{b}");
    assert_eq!(b["revocations"][0]["value"], json!(tok["t1"].1));
    let acme = a.s.url("/v1/tenants/acme");
    let (st, b) = as_(&tok["t1"].0, "GET", &acme, None).await;
    assert_eq!((st, code(&b)), (401, "revoked"), "{b}");
    let (st, b) = as_(&tok["t2"].0, "GET", &acme, None).await;
    assert_eq!(st, 200, "another token of the tenant still works: {b}");

    // What a tenant's manager may not revoke, and what nobody may.
    for body in [
        json!({"jti": tok["o1"].1}),
        json!({"subject": "app2"}),
        json!({"tenant": "acme"}),
    ] {
        let (st, b) = as_(&tok["lead"].0, "POST", &revoke, Some(body.clone())).await;
        assert_eq!((st, code(&b)), (403, "forbidden"), "{body}: {b}");
    }
    for body in [
        json!({"subject": "admin"}),
        json!({"tenant": "*"}),
        json!({"jti": "a", "subject": "b"}),
        json!({}),
        json!({"subject": ""}),
    ] {
        let (st, b) = as_(&admin, "POST", &revoke, Some(body.clone())).await;
        assert_eq!((st, code(&b)), (400, "invalid_request"), "{body}: {b}");
    }

    // A subject across tenants, then a whole tenant; a token minted afterwards verifies.
    let (st, b) = as_(&admin, "POST", &revoke, Some(json!({"subject": "app1"}))).await;
    assert_eq!(st, 200, "{b}");
    let (st, b) = as_(&tok["o1"].0, "GET", &a.s.url("/v1/tenants/other"), None).await;
    assert_eq!((st, code(&b)), (401, "revoked"), "{b}");
    let (st, b) = as_(&admin, "POST", &revoke, Some(json!({"tenant": "acme"}))).await;
    assert_eq!(st, 200, "{b}");
    for who in ["lead", "t2"] {
        let (st, b) = as_(&tok[who].0, "GET", &acme, None).await;
        assert_eq!((st, code(&b)), (401, "revoked"), "{who}: {b}");
    }
    let (st, b) = mint(
        &a,
        &admin,
        json!({"subject": "app1", "tenant": "acme", "perms": ["manage:*"]}),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    let fresh = b["token"].as_str().unwrap();
    let (st, b) = as_(fresh, "GET", &acme, None).await;
    assert_eq!(
        st, 200,
        "minted after the revocations, in the same second or not: {b}"
    );
    let (st, b) = as_(&admin, "GET", &format!("{feed}?since=1&wait_ms=0"), None).await;
    assert_eq!((st, &b["revision"]), (200, &json!(3)), "{b}");
    assert_eq!(b["revocations"].as_array().unwrap().len(), 3);
    let (st, b) = as_(&admin, "GET", &format!("{feed}?wait_ms=99999999"), None).await;
    assert_eq!((st, code(&b)), (400, "invalid_request"), "{b}");
}

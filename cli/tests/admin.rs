//! felixctl's REST admin commands against a real control plane (the felix-control server,
//! started in this test process on a free loopback port).

use felix_control::config::Config;
use felix_control::server::{serve, AppState};
use felix_control::store::memory::MemoryStore;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;

const CTL: &str = env!("CARGO_BIN_EXE_felixctl");

fn start_control_plane() -> String {
    start_control_plane_with(None)
}

/// With `Some(file)`, auth is on and the admin token is written there.
fn start_control_plane_with(admin_token_file: Option<std::path::PathBuf>) -> String {
    start_control_plane_full(admin_token_file, |_| {})
}

/// `tune` changes the configuration before the start (`--replication-preview` and the like).
fn start_control_plane_full(
    admin_token_file: Option<std::path::PathBuf>,
    tune: fn(&mut Config),
) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(l.local_addr().unwrap().to_string()).unwrap();
            let mut cfg = Config::defaults();
            cfg.sweep_interval_ms = 50;
            tune(&mut cfg);
            // `serve` is handed a plain listener here (HTTPS is felix-controlplane's main
            // wrapping it), so the members' scheme must say so.
            cfg.tls = felix_control::config::TlsSwitch::Off;
            match admin_token_file {
                Some(f) => cfg.admin_token_file = Some(f),
                None => cfg.auth = felix_control::config::AuthSwitch::Off,
            }
            let cfg = Arc::new(cfg);
            let st = AppState::new(Arc::new(MemoryStore::new(cfg.limits(), false)), cfg);
            let (_stop_tx, stop) = tokio::sync::watch::channel(false);
            serve(l, st, axum::Router::new(), stop).await.unwrap();
        });
    });
    format!("http://{}", rx.recv().unwrap())
}

fn ctl(url: &str, cfg: &std::path::Path, args: &[&str]) -> Output {
    let mut c = Command::new(CTL);
    if !url.is_empty() {
        c.args(["--controlplane", url]);
    }
    c.args(["--config", cfg.to_str().unwrap()])
        .args(args)
        .env_remove("FELIX_CONTROLPLANE_URL")
        .env_remove("FELIX_CONTEXT")
        .env_remove("FELIX_TOKEN")
        .env("FELIX_DATA_DIR", cfg.with_extension("no-data-dir"))
        .stdin(Stdio::null())
        .output()
        .expect("run felixctl")
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "felixctl failed ({:?}): {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

#[test]
fn admin_commands_over_rest() {
    let url = start_control_plane();
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("felixctl.json");
    let u = url.as_str();

    ok(&ctl(
        u,
        &cfg,
        &["tenant", "create", "acme", "--description", "first tenant"],
    ));
    ok(&ctl(
        u,
        &cfg,
        &["--tenant", "acme", "namespace", "create", "prod"],
    ));
    let out = ok(&ctl(u, &cfg, &["tenant", "ls"]));
    assert!(out.starts_with("NAME"), "{out}");
    assert!(
        out.contains("acme") && out.contains("first tenant"),
        "{out}"
    );

    let scope = ["--tenant", "acme", "--namespace", "prod"];
    let run = |args: &[&str]| {
        let mut a: Vec<&str> = scope.to_vec();
        a.extend_from_slice(args);
        ctl(u, &cfg, &a)
    };
    ok(&run(&[
        "stream",
        "create",
        "orders",
        "--shards",
        "3",
        "--durable",
        "--retention-bytes",
        "1000",
        "--fsync",
        "periodic",
    ]));
    let j: serde_json::Value =
        serde_json::from_str(ok(&run(&["--json", "stream", "get", "orders"])).trim()).unwrap();
    assert_eq!(j["shards"], 3);
    assert_eq!(j["fsync"], "periodic");
    assert_eq!(j["retention_bytes"], 1000);
    let out = ok(&run(&[
        "stream",
        "set",
        "orders",
        "--retention-seconds",
        "60",
    ]));
    assert!(out.contains("60"), "{out}");
    let lines = ok(&run(&["--json", "stream", "ls"]));
    assert_eq!(lines.lines().count(), 1);

    // Refusals are typed and exit 1; bad flags exit 2.
    let o = run(&["stream", "create", "r3", "--replication-factor", "3"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("invalid_request") && err.contains("durable"),
        "{err}"
    );
    let o = run(&["stream", "create", "x", "--fsync", "sometimes"]);
    assert_eq!(o.status.code(), Some(2));
    let o = run(&["stream", "get", "bad name"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("invalid_name"));

    // Caches.
    ok(&run(&[
        "cache",
        "create",
        "sessions",
        "--shards",
        "2",
        "--ttl-seconds",
        "30",
    ]));
    let out = ok(&run(&["cache", "ls"]));
    assert!(out.contains("sessions") && out.contains("30"), "{out}");

    // Nodes and shards: register a broker over REST, as a broker would.
    // An unknown field is ignored (a newer broker talking to this control plane).
    let body = r#"{"node_id": 7, "quic_addr": "127.0.0.1:7400", "cores": 2,
        "peer_addr": "127.0.0.1:7402", "storage_id": "0123456789abcdef",
        "rack": "from-a-newer-broker"}"#;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let st = rt.block_on(async {
        reqwest::Client::new()
            .post(format!("{u}/v1/brokers"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap()
            .status()
    });
    assert!(st.is_success());
    let out = ok(&ctl(u, &cfg, &["node", "ls"]));
    assert!(
        out.contains("127.0.0.1:7400")
            && out.contains("127.0.0.1:7402")
            && out.contains("true")
            && out.contains("0123456789abcdef"),
        "{out}"
    );
    // Every shard of the catalog (the stream orders' and the cache sessions') is node 7's.
    let row: Vec<&str> = out.lines().nth(1).unwrap().split_whitespace().collect();
    let placed = ok(&run(&["shard", "ls", "orders"])).lines().count() - 1
        + ok(&run(&["shard", "ls", "sessions", "--cache"]))
            .lines()
            .count()
        - 1;
    assert_eq!(
        row.last().copied(),
        Some(placed.to_string().as_str()),
        "{out}"
    );
    let out = ok(&run(&["shard", "ls", "orders"]));
    assert_eq!(out.lines().count(), 4, "{out}");
    assert!(
        out.lines()
            .skip(1)
            .all(|l| l.contains("assigned") && l.contains(" 7 ")),
        "{out}"
    );
    let out = ok(&run(&["--json", "shard", "ls", "sessions", "--cache"]));
    assert_eq!(out.lines().count(), 2);

    // Deletes: no terminal and no --yes -> exit 2, nothing deleted.
    let o = run(&["stream", "rm", "orders"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--yes"));
    ok(&run(&["stream", "get", "orders"]));
    ok(&run(&["--yes", "stream", "rm", "orders"]));
    ok(&run(&["--yes", "cache", "rm", "sessions"]));

    // Contexts: the URL comes from the config file when no flag names one.
    ok(&ctl("", &cfg, &["context", "set", "local", "--url", u]));
    let out = ok(&ctl("", &cfg, &["context", "ls"]));
    assert!(out.contains("local") && out.contains('*'), "{out}");
    let out = ok(&ctl("", &cfg, &["tenant", "get", "acme"]));
    assert!(out.contains("acme"));
    let o = ctl("", &cfg, &["--context", "nope", "tenant", "ls"]);
    assert_eq!(o.status.code(), Some(2));

    // Completions.
    let out = ok(&ctl("", &cfg, &["completions", "bash"]));
    assert!(out.contains("felixctl") && out.contains("namespace"));
}

/// With auth on: the admin token (from --token) issues tenant tokens and node credentials;
/// a tenant token reaches its tenant only, and the refusal names the missing permission; a
/// context keeps a token in a private file.
#[test]
fn tokens_over_rest() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("admin.token");
    let url = start_control_plane_with(Some(file.clone()));
    let u = url.as_str();
    let cfg = dir.path().join("felixctl.json");
    let t0 = std::time::Instant::now();
    let admin = loop {
        if let Ok(t) = std::fs::read_to_string(&file) {
            break t.trim().to_string();
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(20),
            "no admin token"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let o = ctl(u, &cfg, &["tenant", "ls"]);
    assert_eq!(o.status.code(), Some(1), "refused without a token");
    assert!(String::from_utf8_lossy(&o.stderr).contains("unauthenticated"));
    let a = |args: &[&str]| {
        let mut v = vec!["--token", admin.as_str()];
        v.extend_from_slice(args);
        ctl(u, &cfg, &v)
    };
    ok(&a(&["tenant", "create", "acme"]));
    let tok = ok(&a(&[
        "--tenant", "acme", "token", "create", "--allow", "manage:*", "--ttl", "30m",
    ]));
    let tok = tok.trim().to_string();
    assert!(tok.starts_with("eyJ"), "{tok}");
    let t = |args: &[&str]| {
        let mut v = vec!["--token", tok.as_str(), "--tenant", "acme"];
        v.extend_from_slice(args);
        ctl(u, &cfg, &v)
    };
    ok(&t(&["namespace", "create", "prod"]));
    let o = t(&["tenant", "ls"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("forbidden") && err.contains("cluster.admin:tenants"),
        "{err}"
    );
    let ls = ok(&t(&["token", "ls"]));
    assert!(ls.starts_with("ID") && ls.contains("manage:*"), "{ls}");
    let node = ok(&a(&["node", "enroll", "3", "--ttl", "1d"]));
    assert!(node.trim().starts_with("eyJ"), "{node}");
    let keys = ok(&a(&["--json", "key", "rotate"]));
    assert_eq!(keys.lines().count(), 2, "{keys}");
    // A context holds the token; its file is private.
    ok(&ctl(
        "",
        &cfg,
        &["context", "set", "acme", "--url", u, "--token", &tok],
    ));
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&cfg).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let out = ok(&ctl("", &cfg, &["--tenant", "acme", "namespace", "ls"]));
    assert!(out.contains("prod"), "{out}");
}

/// POST `body` to `url` as a broker would, and return the status and the JSON answer.
fn post(url: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let r = reqwest::Client::new()
            .post(url)
            .json(&body)
            .send()
            .await
            .unwrap();
        let st = r.status().as_u16();
        (st, r.json().await.unwrap_or(serde_json::Value::Null))
    })
}

/// A stream of three copies under `--replication-preview`: placed on three brokers with
/// storage identities, its leader's report lands and moves the mark `shard ls` prints, and a
/// report from a broker placement does not name is refused.
#[test]
fn replicated_shards_show_leader_followers_commit_and_lag() {
    let url = start_control_plane_full(None, |c| c.replication_preview = true);
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("felixctl.json");
    let u = url.as_str();
    replicated_stream(u, &cfg);
    let run = |args: &[&str]| in_tn(u, &cfg, args);
    let shards = format!("{u}/v1/tenants/t/namespaces/n/streams/s");
    let out = ok(&run(&["--json", "shard", "ls", "s"]));
    let row: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    let r = &row["replication"];
    let leader = r["leader"].as_u64().unwrap();
    let followers: Vec<u64> = r["followers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(followers.len(), 2, "{row}");
    assert_eq!(row["owner"].as_u64(), Some(leader), "{row}");
    let holder = |n: u64, end: u64| {
        serde_json::json!({"node": n, "last_generation": 1, "end": end,
            "storage_id": format!("{:016x}", n * 0x11), "behind_bytes": (12 - end) * 1000})
    };
    let report = |from: u64, seq: u64| {
        serde_json::json!({"generation": 1, "leader": from, "seq": seq, "holders": [
            holder(leader, 12), holder(followers[0], 9), holder(followers[1], 4)]})
    };
    let (st, b) = post(
        &format!("{shards}/shards/0/report"),
        report(followers[0], 1),
    );
    assert_eq!((st, b["answer"].as_str()), (200, Some("refused")), "{b}");
    let (st, b) = post(&format!("{shards}/shards/0/report"), report(leader, 1));
    assert_eq!((st, b["answer"].as_str()), (200, Some("landed")), "{b}");
    assert_eq!(b["counted"].as_array().unwrap().len(), 3, "{b}");
    assert_eq!(metric(u, "felix_controlplane_replicated_shards"), 1);
    assert_eq!(metric(u, "felix_controlplane_under_replicated_shards"), 0);
    let out = ok(&run(&["shard", "ls", "s"]));
    let cols: Vec<&str> = out.lines().nth(1).unwrap().split_whitespace().collect();
    // SHARD OWNER QUIC_ADDR STATE GENERATION FOLLOWERS COMMIT LAG
    assert_eq!(
        cols[5],
        format!("{},{}", followers[0], followers[1]),
        "{out}"
    );
    assert_eq!(cols[6], "9", "the mark a majority holds: {out}");
    assert_eq!(
        cols[7],
        format!("{}:3:3000,{}:8:8000", followers[0], followers[1]),
        "{out}"
    );
    assert_eq!(
        metric(u, "felix_controlplane_replica_lag_bytes_max"),
        8000,
        "the leader's report's bytes"
    );
    // A malformed report is refused, typed, and changes nothing.
    let (st, b) = post(
        &format!("{shards}/shards/0/report"),
        serde_json::json!({"generation": 1, "leader": leader, "seq": 2,
            "holders": [{"node": leader, "last_generation": 1, "end": 20, "storage_id": "XYZ"}]}),
    );
    assert_eq!(
        (st, b["code"].as_str()),
        (400, Some("invalid_request")),
        "{b}"
    );
    // A body of the wrong shape is a typed 400 too, never axum's 422 (Schemathesis).
    let (st, b) = post(
        &format!("{shards}/shards/0/report"),
        serde_json::json!({"generation": 1, "leader": leader, "seq": false, "holders": []}),
    );
    assert_eq!(
        (st, b["code"].as_str()),
        (400, Some("invalid_request")),
        "{b}"
    );
    let (st, _) = post(&format!("{shards}/shards/9/report"), report(leader, 2));
    assert_eq!(st, 404);
    let out = ok(&run(&["shard", "ls", "s"]));
    assert!(out.lines().nth(1).unwrap().contains(" 9 "), "{out}");
}

/// `shard abandon`: refused while the shard is served; once no live replica qualifies (the
/// leader and the follower at the mark are dead, the live one is behind it), it says what may
/// be lost, needs --yes, and promotes the live replica.
#[test]
fn an_unavailable_replicated_shard_is_abandoned_to_its_live_replica() {
    let url = start_control_plane_full(None, |c| {
        c.replication_preview = true;
        // Long enough for the setup below to run with every broker live.
        c.dead_after_ms = 1500;
    });
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("felixctl.json");
    let u = url.as_str();
    replicated_stream(u, &cfg);
    let run = |args: &[&str]| in_tn(u, &cfg, args);
    let row = || -> serde_json::Value {
        let out = ok(&run(&["--json", "shard", "ls", "s"]));
        serde_json::from_str(out.lines().next().unwrap()).unwrap()
    };
    let r = row();
    let leader = r["replication"]["leader"].as_u64().unwrap();
    let f: Vec<u64> = r["replication"]["followers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let holder = |n: u64, end: u64| {
        serde_json::json!({"node": n, "last_generation": 1, "end": end,
            "storage_id": format!("{:016x}", n * 0x11)})
    };
    let (st, b) = post(
        &format!("{u}/v1/tenants/t/namespaces/n/streams/s/shards/0/report"),
        serde_json::json!({"generation": 1, "leader": leader, "seq": 1, "holders": [
            holder(leader, 12), holder(f[0], 9), holder(f[1], 4)]}),
    );
    assert_eq!(b["answer"].as_str(), Some("landed"), "{st} {b}");
    // Served: nothing to abandon.
    let o = run(&["--yes", "shard", "abandon", "s", "0"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("conflict"));
    // Only f[1] (at 4, behind the mark 9) stays live.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let beat = {
        let (u, stop, id) = (url.clone(), stop.clone(), f[1]);
        std::thread::spawn(move || {
            for _ in 0..400 {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                post(
                    &format!("{u}/v1/brokers/{id}/heartbeat"),
                    serde_json::json!({"incarnation": 1}),
                );
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        })
    };
    let mut state = String::new();
    for _ in 0..200 {
        state = row()["state"].as_str().unwrap().to_string();
        if state == "unavailable" {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(state, "unavailable");
    assert_eq!(
        metric(u, "felix_controlplane_unavailable_replicated_shards"),
        1
    );
    assert_eq!(metric(u, "felix_controlplane_under_replicated_shards"), 1);
    // f[1] at 4 behind the leader's 12, or behind f[0]'s 9 if f[0] led before it died.
    let lag = metric(u, "felix_controlplane_replica_lag_records_max");
    assert!(lag == 8 || lag == 5, "{lag}");
    // (f[0] may have led a generation before it died too, if the sweep saw the leader
    // silent first.)
    let gen = row()["generation"].as_u64().unwrap();
    // Without --yes (stdin is not a terminal): refused, after saying what may be lost.
    let o = run(&["shard", "abandon", "s", "0"]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!("promote node {}", f[1])) && err.contains("up to 5 committed"),
        "{err}"
    );
    let out = ok(&run(&["--yes", "--json", "shard", "abandon", "s", "0"]));
    let a: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        (a["leader"].as_u64(), a["generation"].as_u64()),
        (Some(f[1]), Some(gen + 1)),
        "{a}"
    );
    assert_eq!(a["may_lose_records"].as_u64(), Some(5), "{a}");
    let r = row();
    assert_eq!(
        (r["state"].as_str(), r["leader"].as_u64()),
        (Some("assigned"), Some(f[1])),
        "{r}"
    );
    assert_eq!(
        metric(u, "felix_controlplane_unavailable_replicated_shards"),
        0
    );
    assert!(metric(u, "felix_controlplane_abandons_total") >= 1);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    beat.join().unwrap();
}

/// One unlabelled sample of the control plane's `/metrics`.
fn metric(url: &str, name: &str) -> u64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let text = rt.block_on(async {
        reqwest::get(format!("{url}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    });
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no {name} in /metrics:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// felixctl in tenant t, namespace n.
fn in_tn(url: &str, cfg: &std::path::Path, args: &[&str]) -> Output {
    let mut a = vec!["--tenant", "t", "--namespace", "n"];
    a.extend_from_slice(args);
    ctl(url, cfg, &a)
}

/// Tenant t, namespace n, three brokers registered over REST with storage identities
/// (node N: N × 0x11), and stream "s" of one shard and three copies.
fn replicated_stream(url: &str, cfg: &std::path::Path) {
    ok(&ctl(url, cfg, &["tenant", "create", "t"]));
    ok(&ctl(
        url,
        cfg,
        &["--tenant", "t", "namespace", "create", "n"],
    ));
    for n in 1..=3u64 {
        let (st, b) = post(
            &format!("{url}/v1/brokers"),
            serde_json::json!({"node_id": n, "quic_addr": format!("127.0.0.1:{}", 7400 + n),
                "cores": 1, "storage_id": format!("{:016x}", n * 0x11)}),
        );
        assert!(st < 300, "{st} {b}");
    }
    ok(&in_tn(
        url,
        cfg,
        &[
            "stream",
            "create",
            "s",
            "--durable",
            "--replication-factor",
            "3",
        ],
    ));
}

//! felix-loadgen smoke runs against a real broker (tiny counts): every mode finishes, its JSON
//! result line (`--json`) carries the accounting, and a `block` throughput run is lossless with
//! every subscriber counting every record; without `--json` a summary for people names the
//! losses and their cause; `--duration` runs for a time; `--broker` takes a host name.
//! Checks the accounting, never the speed.

mod common;

use common::Broker;
use std::process::{Command, Output};

fn exe() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker")).with_file_name("felix-loadgen")
}

/// felix-loadgen against `broker` (an address as a user writes it), trusting `b`'s CA.
fn command(b: &Broker, broker: &str, args: &[&str]) -> Command {
    let mut c = Command::new(exe());
    c.args(["--broker", broker])
        .arg("--ca")
        .arg(b.ca())
        .args(args);
    c
}

/// Run felix-loadgen against `broker` (an address as a user writes it); its output, which
/// must be a success.
fn run_at(b: &Broker, broker: &str, args: &[&str]) -> Output {
    let out = command(b, broker, args)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", exe().display()));
    assert!(
        out.status.success(),
        "felix-loadgen {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A `--json` run: its one stdout line, parsed.
fn loadgen(b: &Broker, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["--json", "--max-secs", "30"];
    all.extend_from_slice(args);
    let out = run_at(b, &b.quic.to_string(), &all);
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "--json prints exactly one line: {text}");
    serde_json::from_str(lines[0]).unwrap_or_else(|e| panic!("{e}: {text}"))
}

#[test]
fn every_mode_runs_and_accounts_for_every_record() {
    let b = Broker::start(2, &[]);
    let tp = loadgen(
        &b,
        &[
            "--mode",
            "throughput",
            "--payload",
            "256",
            "--fanout",
            "3",
            "--count",
            "3000",
            "--batch",
            "16",
            "--inflight",
            "8",
            "--queue-policy",
            "block",
        ],
    );
    assert_eq!(tp["mode"], "throughput");
    assert_eq!(tp["queue_policy"], "block");
    assert_eq!(tp["count"], 3000);
    assert_eq!(tp["lost"], 0, "{tp}");
    assert_eq!(tp["out_of_order"], 0, "{tp}");
    assert_eq!(tp["truncated"], false);
    assert!(tp["per_sub_msgs_per_s_min"].as_f64().unwrap() > 0.0);
    // Empty records are records too (the campaign's 0-byte case). This run and the latency
    // one use one thread, as campaigns pinned to one core do (tokio's current-thread runtime).
    let empty = loadgen(
        &b,
        &[
            "--mode",
            "throughput",
            "--payload",
            "0",
            "--count",
            "500",
            "--batch",
            "8",
            "--queue-policy",
            "block",
            "--threads",
            "1",
        ],
    );
    assert_eq!(
        (empty["count"].as_u64(), empty["lost"].as_u64()),
        (Some(500), Some(0)),
        "{empty}"
    );
    assert_eq!(empty["out_of_order"], 0, "{empty}");

    let lat = loadgen(
        &b,
        &[
            "--mode",
            "latency",
            "--payload",
            "64",
            "--fanout",
            "2",
            "--count",
            "50",
            "--threads",
            "1",
        ],
    );
    assert_eq!(lat["mode"], "latency");
    assert_eq!(lat["count"], 50);
    let (p50, p99) = (
        lat["all_f"]["p50"].as_u64().unwrap(),
        lat["all_f"]["p99"].as_u64().unwrap(),
    );
    assert!(p50 > 0 && p50 <= p99, "{lat}");

    // The request round trip is its own mode: every acked publish is one sample.
    let rtt = loadgen(
        &b,
        &[
            "--mode",
            "rtt",
            "--payload",
            "64",
            "--count",
            "40",
            "--threads",
            "1",
        ],
    );
    assert_eq!(rtt["mode"], "rtt");
    assert_eq!(rtt["rtt"]["samples"], 40, "{rtt}");
    let (p50, p99) = (
        rtt["rtt"]["p50"].as_u64().unwrap(),
        rtt["rtt"]["p99"].as_u64().unwrap(),
    );
    assert!(p50 > 0 && p50 <= p99, "{rtt}");
    assert!(rtt["requests_per_s"].as_f64().unwrap() > 0.0, "{rtt}");

    let ing = loadgen(
        &b,
        &[
            "--mode",
            "ingest",
            "--payload",
            "128",
            "--inflight",
            "4",
            "--count",
            "200",
        ],
    );
    let pid = b.pid().to_string();
    let fs = loadgen(
        &b,
        &[
            "--mode",
            "fanout-scale",
            "--subscribers",
            "60",
            "--connections",
            "2",
            "--rate",
            "200",
            "--secs",
            "1",
            "--payload",
            "64",
            "--queue-policy",
            "block",
            "--broker-pid",
            &pid,
        ],
    );
    assert_eq!(fs["mode"], "fanout-scale");
    assert_eq!(fs["published"], 200, "{fs}");
    assert_eq!(fs["delivered"], 200 * 60, "{fs}");
    assert_eq!(
        (fs["lost"].as_u64(), fs["lossless"].as_bool()),
        (Some(0), Some(true)),
        "{fs}"
    );
    assert!(fs["broker_rss_per_sub_bytes"].is_number(), "{fs}");
    assert!(fs["latency_sampled"]["samples"].as_u64().unwrap() > 0);

    // Cache: put/get latency (COUNT puts), then 30 watchers on one key over 3 connections,
    // read as READER says.
    let cache = |count: &str, reader: &str| {
        let args = [
            "--mode",
            "cache",
            "--count",
            count,
            "--subscribers",
            "30",
            "--connections",
            "3",
            "--rate",
            "100",
            "--secs",
            "1",
            "--payload",
            "64",
            "--watch-reader",
            reader,
        ];
        loadgen(&b, &args)
    };
    let kv = cache("100", "set");
    assert_eq!(kv["mode"], "cache");
    // Every result line carries what makes it comparable later.
    for line in [&fs, &kv] {
        let online = line["machine"]["cores_online"].as_u64().unwrap();
        let allowed = line["machine"]["cores_allowed"].as_u64().unwrap();
        assert!(allowed >= 1 && allowed <= online, "{line}");
        assert!(
            !line["machine"]["kernel"].as_str().unwrap().is_empty(),
            "{line}"
        );
        assert!(line["date"].as_str().unwrap().ends_with('Z'), "{line}");
        assert!(
            line["git_rev"].is_string() && line["load1_end"].is_number(),
            "{line}"
        );
    }
    assert_eq!(kv["puts"], 100, "{kv}");
    assert_eq!(kv["put_latency"]["samples"], 100, "{kv}");
    assert_eq!(kv["get_latency"]["samples"], 100, "{kv}");
    assert_eq!(kv["changes"], 100, "{kv}");
    assert_eq!(kv["delivered"], 100 * 30, "{kv}");
    assert_eq!(kv["lossless"], true, "{kv}");
    // Lossless means each watcher saw exactly the writer's acknowledged offsets, in order.
    assert_eq!(kv["watchers_exact_offsets"], 30, "{kv}");
    assert!(kv["first_offset_mismatch"].is_null(), "{kv}");
    assert_eq!(kv["put_latency_under_fanout"]["samples"], 100, "{kv}");
    assert_eq!(kv["change_to_watcher_latency"]["samples"], 100 * 30, "{kv}");
    assert_eq!(kv["watch_reader"], "set", "{kv}");
    // The same with a task per watch instead of a WatchSet per connection.
    let kt = cache("10", "task");
    assert_eq!(kt["watch_reader"], "task", "{kt}");
    assert_eq!(kt["delivered"], 100 * 30, "{kt}");
    assert_eq!(kt["watchers_exact_offsets"], 30, "{kt}");
    assert_eq!(kt["change_to_watcher_latency"]["samples"], 100 * 30, "{kt}");

    assert_eq!(ing["mode"], "ingest");
    assert_eq!(ing["count"], 200);
    assert!(ing["acks_per_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn group_mode_processes_every_record_once() {
    let dir = tempfile::tempdir().unwrap();
    let cat = dir.path().join("catalog.yaml");
    std::fs::write(
        &cat,
        "streams:\n  - {tenant: default, namespace: default, stream: jobs, shards: 2, durable: true}\n",
    )
    .unwrap();
    let durable = dir.path().join("durable");
    let (cat, durable) = (cat.display().to_string(), durable.display().to_string());
    let b = Broker::start_in(
        dir,
        2,
        &["--catalog", &cat, "--durable-storage-dir", &durable],
    );
    for consumers in ["1", "3"] {
        let g = loadgen(
            &b,
            &[
                "--mode",
                "group",
                "--stream",
                "jobs",
                "--payload",
                "100",
                "--batch",
                "16",
                "--consumers",
                consumers,
                "--count",
                "500",
            ],
        );
        assert_eq!(g["mode"], "group");
        assert_eq!(g["processed"], 500, "{g}");
        assert_eq!(g["duplicates"], 0, "{g}");
        assert_eq!(g["lossless"], true, "{g}");
        assert!(g["records_per_s"].as_f64().unwrap() > 0.0);
    }
}

/// Without `--json`: a summary for people that says what was measured and why records were
/// lost (a subscriber stalled on purpose under drop_new with a 64-record queue), reached by a
/// host name; `--duration` ends a run by time; `--progress` shows both sides; an unresolvable
/// broker is a clear error.
#[test]
fn summary_for_people_duration_and_host_names() {
    let b = Broker::start(2, &[]);
    let by_name = format!("localhost:{}", b.quic.port());
    let out = run_at(
        &b,
        &by_name,
        &[
            "--mode",
            "throughput",
            "--payload",
            "64",
            "--fanout",
            "2",
            "--count",
            "4000",
            "--batch",
            "16",
            "--queue-policy",
            "drop_new",
            "--queue-records",
            "64",
            "--stall-ms",
            "400",
            "--max-secs",
            "30",
            "--progress",
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        !text.trim_start().starts_with('{'),
        "a summary, not JSON: {text}"
    );
    for want in [
        &format!(
            "felix-loadgen throughput: 4,000 records of 64 B to 2 subscribers on stream events shard 0 at {by_name}"
        ) as &str,
        "queue policy drop_new",
        "the last subscriber stalled for its first 400 ms",
        "ran to --count 4,000",
        "records/s per subscriber",
        "queue policy drop_new discarded the newest records",
        "of 2 subscribers fell behind; the worst, subscriber ",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
    let lost = text
        .lines()
        .find_map(|l| l.strip_prefix("lost       "))
        .and_then(|l| l.split_whitespace().next())
        .map(|n| n.replace(',', "").parse::<u64>().unwrap())
        .unwrap_or_else(|| panic!("no lost line: {text}"));
    assert!(lost > 0 && lost < 2 * 4000, "{text}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if let Some(p) = stderr.lines().find(|l| l.starts_with("progress")) {
        assert!(p.contains("published") && p.contains("delivered"), "{p}");
    }

    // --duration: a run ended by time reports it (generous bounds: this is a debug build on
    // a shared machine).
    let d = loadgen(
        &b,
        &[
            "--mode",
            "throughput",
            "--payload",
            "64",
            "--duration",
            "700ms",
            "--queue-policy",
            "block",
            "--threads",
            "1",
        ],
    );
    assert_eq!(d["duration_target_s"], 0.7, "{d}");
    let secs = d["duration_s"].as_f64().unwrap();
    assert!((0.6..20.0).contains(&secs), "{d}");
    assert!(d["count"].as_u64().unwrap() > 0, "{d}");
    assert_eq!(
        (d["lost"].as_u64(), d["truncated"].as_bool()),
        (Some(0), Some(false)),
        "{d}"
    );
    let r = loadgen(
        &b,
        &["--mode", "rtt", "--duration", "300ms", "--threads", "1"],
    );
    assert!(r["rtt"]["samples"].as_u64().unwrap() > 0, "{r}");
    assert!(r["duration_s"].as_f64().unwrap() >= 0.25, "{r}");
    // --count and --duration together are a usage error; --duration where it does not apply too.
    for args in [
        &["--mode", "rtt", "--count", "5", "--duration", "1s"][..],
        &["--mode", "group", "--duration", "1s"][..],
        &["--mode", "rtt", "--duration", "5 parsecs"][..],
        // --brokers where it does not apply (it measures one broker).
        &["--mode", "rtt", "--brokers", "127.0.0.1:1"][..],
    ] {
        let out = Command::new(exe())
            .args(["--broker", &by_name])
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
    }

    // A name that does not resolve: a clear error, exit 2, nothing on stdout.
    let out = Command::new(exe())
        .args(["--broker", "no-such-host.invalid:7400", "--mode", "rtt"])
        .env("RES_OPTIONS", "timeout:1 attempts:1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("no-such-host.invalid") && err.contains("resolve"),
        "{err}"
    );
    assert!(out.stdout.is_empty());
}

/// `--mode connect`: every sample is its own connection, with auth off and with auth on (the
/// standalone broker's admin token); against auth on, no token is refused, not measured.
#[test]
fn connect_mode_opens_one_connection_per_sample() {
    let off = Broker::start(1, &[]);
    // An empty token is none (the auth-off side of scripts/bench-auth.sh).
    let r = loadgen(
        &off,
        &[
            "--mode",
            "connect",
            "--count",
            "12",
            "--threads",
            "1",
            "--token",
            "",
        ],
    );
    assert_eq!(r["mode"], "connect");
    assert_eq!(r["token"], false, "{r}");
    assert_eq!(r["connect"]["samples"], 12, "{r}");
    assert_eq!(r["handshake"]["samples"], 12, "{r}");
    let (hs, first) = (
        r["handshake"]["p50"].as_u64().unwrap(),
        r["connect"]["p50"].as_u64().unwrap(),
    );
    // The first ack comes after the handshake of the same connection.
    assert!(hs > 0 && hs <= first, "{r}");
    drop(off);

    let on = Broker::start(1, &["--auth", "standalone"]);
    let token = std::fs::read_to_string(on.dir.path().join("auth/admin.token")).unwrap();
    let r = loadgen(
        &on,
        &["--mode", "connect", "--count", "8", "--token", token.trim()],
    );
    assert_eq!(r["token"], true, "{r}");
    assert_eq!(r["connect"]["samples"], 8, "{r}");
    let bare = command(
        &on,
        &on.quic.to_string(),
        &[
            "--json",
            "--max-secs",
            "30",
            "--mode",
            "connect",
            "--count",
            "3",
        ],
    )
    .env_remove("FELIX_TOKEN")
    .output()
    .unwrap();
    assert!(!bare.status.success(), "no token against auth on must fail");
    let err = String::from_utf8_lossy(&bare.stderr);
    assert!(err.contains("unauthenticated"), "{err}");
}

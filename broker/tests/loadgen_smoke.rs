//! felix-loadgen smoke runs against a real broker (tiny counts): every mode finishes, its JSON
//! result line carries the accounting, and a `block` throughput run is lossless with every
//! subscriber counting every record. Checks the accounting, never the speed.

mod common;

use common::Broker;
use std::process::Command;

fn loadgen(b: &Broker, args: &[&str]) -> serde_json::Value {
    let exe =
        std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker")).with_file_name("felix-loadgen");
    let out = Command::new(&exe)
        .args(["--broker", &b.quic.to_string(), "--max-secs", "30"])
        .arg("--ca")
        .arg(b.ca())
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", exe.display()));
    assert!(
        out.status.success(),
        "felix-loadgen {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8_lossy(&out.stdout);
    let line = line.lines().last().expect("one result line");
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"))
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

    // Cache: put/get latency, then 30 watchers on one key over 3 connections.
    let kv = loadgen(
        &b,
        &[
            "--mode",
            "cache",
            "--count",
            "100",
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
        ],
    );
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
    assert_eq!(kv["change_to_watcher_latency"]["samples"], 100 * 30, "{kv}");

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

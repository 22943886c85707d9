//! Failover time of a replicated stream (issue 23's benchmark), ignored in the suite:
//! `scripts/bench-failover.sh` runs it on release binaries. A control plane and three brokers
//! (pinned to core 0, this process to core 1) hold a `quorum` stream of three copies. Kill
//! after kill, the leader is SIGKILLed right after an acknowledged publish, and the run times
//! two things from the kill:
//! - `named_ms`: until the control plane names another leader (its broker counted dead after
//!   `FELIX_FAILOVER_DEAD_AFTER_MS`, then a promotion);
//! - `acked_ms`: until the new leader acknowledges a publish (it fenced the others and waited
//!   out the old lease, rule 4).
//!
//! The killed broker is restarted and the shard is whole again before the next kill. At the
//! end every acknowledged record must be on the leader at its offset. One JSON line per kill,
//! and a summary line, are appended to `FELIX_FAILOVER_OUT` (if set).

use bytes::Bytes;
use std::collections::BTreeMap;
use std::io::Write;
use std::time::{Duration, Instant};

mod common;
use common::replicated::{check_acked_on_leader, publish_one, Trio};

/// Any one wait of the run.
const WAIT_MAX: Duration = Duration::from_secs(60);

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().unwrap_or_else(|_| panic!("{name} is a number")))
        .unwrap_or(default)
}

/// Pin every thread of process `pid` to `cpu` (util-linux `taskset`).
fn pin(pid: u32, cpu: u32) {
    let ok = std::process::Command::new("taskset")
        .args(["-a", "-c", "-p", &cpu.to_string(), &pid.to_string()])
        .stdout(std::process::Stdio::null())
        .status()
        .expect("taskset")
        .success();
    assert!(ok, "taskset -p {cpu} {pid}");
}

fn pin_cluster(t: &Trio) {
    pin(t.cp.child.id(), 0);
    for b in t.nodes.values() {
        pin(b.pid(), 0);
    }
}

/// The value at quantile `q` of sorted `v`.
fn quantile(v: &[u64], q: f64) -> u64 {
    v[((v.len() - 1) as f64 * q).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: scripts/bench-failover.sh runs it"]
async fn failover_time_over_leader_kills() {
    let kills = env_or("FELIX_FAILOVER_KILLS", 20) as usize;
    let dead_after_ms = env_or("FELIX_FAILOVER_DEAD_AFTER_MS", 5_000);
    let out = std::env::var("FELIX_FAILOVER_OUT").ok();
    assert!(kills >= 1, "FELIX_FAILOVER_KILLS is at least 1");
    pin(std::process::id(), 1);
    let mut t = Trio::start(dead_after_ms, &[]).await;
    pin_cluster(&t);
    t.create_stream("q", "quorum");
    t.publish_until_acked("q", "first", WAIT_MAX).await;
    t.wait_full("q", WAIT_MAX).await;
    let mut acked = BTreeMap::new();
    let (mut named, mut served) = (Vec::new(), Vec::new());
    let mut lines = Vec::new();
    for k in 0..kills {
        let old = t.leader("q").await.expect("a leader");
        let p = format!("before-kill-{k}");
        let c = t.client(old).await.expect("the leader answers");
        let o = publish_one(&c, "q", &p, WAIT_MAX)
            .await
            .unwrap_or_else(|e| panic!("{p}: {e}"));
        acked.insert(o, Bytes::from(p));
        drop(c);
        let t0 = Instant::now();
        t.kill(old);
        let new = loop {
            match t.leader("q").await {
                Some(l) if l != old => break l,
                _ => {}
            }
            assert!(t0.elapsed() < WAIT_MAX, "kill {k}: {old} never replaced");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let named_ms = t0.elapsed().as_millis() as u64;
        let c = t.client(new).await.expect("the new leader answers");
        let p = format!("after-kill-{k}");
        let o = loop {
            if let Ok(o) = publish_one(&c, "q", &p, Duration::from_millis(500)).await {
                break o;
            }
            assert!(
                t0.elapsed() < WAIT_MAX,
                "kill {k}: {new} never acknowledged"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let acked_ms = t0.elapsed().as_millis() as u64;
        acked.insert(o, Bytes::from(p));
        let line = serde_json::json!({"case": "failover", "kill": k, "killed": old, "new_leader": new,
            "dead_after_ms": dead_after_ms, "named_ms": named_ms, "acked_ms": acked_ms});
        eprintln!("{line}");
        lines.push(line.to_string());
        named.push(named_ms);
        served.push(acked_ms);
        t.restart(old);
        pin_cluster(&t);
        t.wait_full("q", WAIT_MAX).await;
    }
    check_acked_on_leader(&t, "q", &acked, WAIT_MAX).await;
    named.sort_unstable();
    served.sort_unstable();
    let summary = serde_json::json!({"case": "failover-summary", "kills": kills,
        "dead_after_ms": dead_after_ms, "lease_ms": 2000,
        "named_ms": {"p50": quantile(&named, 0.5), "p90": quantile(&named, 0.9), "min": named[0], "max": named[kills - 1]},
        "acked_ms": {"p50": quantile(&served, 0.5), "p90": quantile(&served, 0.9), "min": served[0], "max": served[kills - 1]},
        "acked_records": acked.len()});
    eprintln!("{summary}");
    lines.push(summary.to_string());
    if let Some(path) = out {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap();
        for l in lines {
            writeln!(f, "{l}").unwrap();
        }
    }
}

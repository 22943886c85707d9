//! What felix-loadgen prints for people, pure and unit-tested: the summary of a result line
//! (what was measured, throughput, latency percentiles, losses and why they happened), the
//! `--progress` line, and the `--duration` parser.

use serde_json::Value;
use std::fmt::Write as _;
use std::time::Duration;

/// `--duration`: a number with a unit — `ms`, `s`, `m` or `h` (`1.5s`, `500ms`, `2m`); a bare
/// number is seconds. More than zero, at most 600 s (the bound of any run).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let x: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (examples: 500ms, 30s, 2m)"))?;
    let scale = match unit.trim() {
        "ms" => 1e-3,
        "" | "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        u => {
            return Err(format!(
                "unknown unit {u:?} in {s:?} (use ms, s, m or h: 500ms, 30s, 2m)"
            ))
        }
    };
    let secs = x * scale;
    if secs.is_nan() || secs <= 0.0 {
        return Err(format!("{s:?}: the duration must be more than zero"));
    }
    if secs > 600.0 {
        return Err(format!("{s:?}: at most 600 s (10m)"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// `1234567` → `1,234,567`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A rate or count for people: whole numbers with separators from 100 up, else one decimal.
fn num(x: f64) -> String {
    if !x.is_finite() {
        return "-".into();
    }
    if x.abs() >= 100.0 {
        thousands(x.round() as u64)
    } else {
        format!("{x:.1}")
    }
}

/// MB/s, one decimal.
fn mb(x: f64) -> String {
    format!("{x:.1}")
}

/// Microseconds for people: `77 µs`, `1.23 ms`, `2.50 s`.
fn micros(us: u64) -> String {
    match us {
        0..=999 => format!("{us} µs"),
        1_000..=999_999 => format!("{:.2} ms", us as f64 / 1e3),
        _ => format!("{:.2} s", us as f64 / 1e6),
    }
}

/// Bytes for people: `512 B`, `1.0 KiB`, `2.5 MiB`.
fn bytes(n: u64) -> String {
    match n {
        0..=1023 => format!("{n} B"),
        1024..=1_048_575 => format!("{:.1} KiB", n as f64 / 1024.0),
        _ => format!("{:.1} MiB", n as f64 / 1_048_576.0),
    }
}

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or(0)
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or(0.0)
}

fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{} {}", thousands(n), if n == 1 { one } else { many })
}

/// `p50 77 µs, p90 …, p99 …, p99.9 …, max … (N samples)` of a percentile object.
fn percentiles(p: &Value) -> String {
    let mut parts = Vec::new();
    for (k, label) in [
        ("p50", "p50"),
        ("p90", "p90"),
        ("p99", "p99"),
        ("p999", "p99.9"),
        ("max", "max"),
    ] {
        if let Some(x) = p[k].as_u64() {
            parts.push(format!("{label} {}", micros(x)));
        }
    }
    let mut s = parts.join(", ");
    if let Some(n) = p["samples"].as_u64() {
        let _ = write!(s, " ({})", plural(n, "sample", "samples"));
    }
    s
}

/// What a queue policy does when a subscriber's queue on the broker is full.
fn policy_why(policy: &str) -> &'static str {
    match policy {
        "drop_new" => "a subscriber's queue on the broker was full and queue policy drop_new discarded the newest records (what was queued stays)",
        "drop_old" => "a subscriber's queue on the broker was full and queue policy drop_old discarded the oldest queued records to make room",
        "block" => "queue policy block holds the publisher instead of dropping, so these records were not dropped by the queue",
        _ => "a subscriber's queue on the broker was full",
    }
}

/// The first line: mode, what and where.
fn header(v: &Value, what: &str) -> String {
    let mode = v["mode"].as_str().unwrap_or("?");
    let broker = v["broker"].as_str().unwrap_or("?");
    let target = match (v["stream"].as_str(), v["shard"].as_u64()) {
        (Some(s), Some(sh)) => format!("stream {s} shard {sh}"),
        (Some(s), None) => format!("stream {s}"),
        _ => String::new(),
    };
    let target = match v["cache"].as_str() {
        Some(c) => format!("cache {c}"),
        None => target,
    };
    format!("felix-loadgen {mode}: {what} on {target} at {broker}\n")
}

/// How the run was bounded: a count, a duration, or cut short by --max-secs.
fn bounded(v: &Value, out: &mut String) {
    let secs = v["duration_s"].as_f64();
    let took = secs.map_or(String::new(), |s| format!(" in {s:.2} s"));
    if let Some(d) = v["duration_target_s"].as_f64() {
        let _ = writeln!(out, "  ran for --duration {d} s (measured{took})");
    } else if let Some(c) = v["count_target"].as_u64() {
        let _ = writeln!(out, "  ran to --count {}{took}", thousands(c));
    }
    if v["truncated"] == true {
        let _ = writeln!(
            out,
            "  CUT SHORT: the run reached --max-secs {} before finishing; figures cover what was done",
            u(v, "max_secs")
        );
    }
    if let Some(cap) = v["count_capped"].as_u64() {
        let _ = writeln!(out, "  note: --count capped at {}", thousands(cap));
    }
}

/// Refused publishes: `refused` is `{code: batches}`; `publish_refused` counts records (acked
/// modes) or fire-and-forget publishes; `refused_last` names the last fire-and-forget one.
fn refusals(v: &Value, out: &mut String) {
    let n = u(v, "publish_refused");
    if n == 0 {
        return;
    }
    let codes: Vec<String> = v["refused"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, c)| format!("{k} ×{}", c.as_u64().unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default();
    let what = if v["mode"] == "throughput" || v["mode"] == "ingest" || v["mode"] == "rtt" {
        "records"
    } else {
        "publishes"
    };
    let mut line = format!(
        "refused    {} {what} by the broker (not appended, not counted as published)",
        thousands(n)
    );
    if !codes.is_empty() {
        let _ = write!(line, ": {}", codes.join(", "));
    }
    if let Some(last) = v["refused_last"].as_str() {
        let _ = write!(line, "; last: {last}");
    }
    out.push_str(&line);
    out.push('\n');
}

/// Losses of a subscribing mode and why: the policy, which subscriber fell behind and by how
/// much, the lag notices, records nobody accounted for, subscriptions the broker ended.
fn losses(v: &Value, per_sub_expected: u64, subs: u64, out: &mut String) {
    let lost = u(v, "lost");
    let policy = v["queue_policy"].as_str().unwrap_or("?");
    let deliveries = per_sub_expected * subs;
    if lost == 0 {
        let _ = writeln!(
            out,
            "lost       0 records: every subscriber got every published record (queue policy {policy})"
        );
        return;
    }
    let share = if deliveries > 0 {
        format!(
            " ({:.2}% of {} deliveries)",
            100.0 * lost as f64 / deliveries as f64,
            thousands(deliveries)
        )
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "lost       {}{share}",
        plural(lost, "record", "records")
    );
    let lagged = u(v, "lost_lag");
    let notices = u(v, "lag_notices");
    if lagged > 0 {
        let _ = writeln!(
            out,
            "  why: {} announced in {}: {}",
            plural(lagged, "record", "records"),
            plural(notices, "lag notice", "lag notices"),
            policy_why(policy)
        );
    }
    let lossy = u(v, "subs_lossy");
    let w = &v["worst_sub"];
    if w.is_object() {
        let _ = writeln!(
            out,
            "  {} of {} fell behind; the worst, subscriber {}, received {} of {} ({} dropped in {}, {} never arrived)",
            thousands(lossy),
            plural(subs, "subscriber", "subscribers"),
            u(w, "index"),
            thousands(u(w, "received")),
            thousands(per_sub_expected),
            thousands(u(w, "lost")),
            plural(u(w, "lag_notices"), "lag notice", "lag notices"),
            thousands(u(w, "missing")),
        );
    }
    let missing = u(v, "missing");
    if missing > 0 {
        let _ = writeln!(
            out,
            "  {} never arrived and no lag notice covered them: the reader stopped at --max-secs or the subscription ended",
            plural(missing, "record", "records")
        );
    }
    if let Some(ends) = v["ended"].as_array().filter(|e| !e.is_empty()) {
        for e in ends.iter().take(3) {
            let _ = writeln!(
                out,
                "  the broker ended subscriber {}'s subscription: {} ({})",
                u(e, "index"),
                e["code"].as_str().unwrap_or("?"),
                e["message"].as_str().unwrap_or("")
            );
        }
        if ends.len() > 3 {
            let _ = writeln!(out, "  … and {} more ended", ends.len() - 3);
        }
    }
}

fn footer(v: &Value, out: &mut String) {
    let m = &v["machine"];
    let _ = writeln!(
        out,
        "(git {}, {} cores online, {} allowed to felix-loadgen, load {:.2} at the end; --json for the result line)",
        v["git_rev"].as_str().unwrap_or("?"),
        u(m, "cores_online"),
        u(m, "cores_allowed"),
        f(v, "load1_end"),
    );
}

/// The summary for people of one result line (the JSON object `--json` prints).
pub fn human(v: &Value) -> String {
    let mut o = String::new();
    let payload = u(v, "payload");
    let pl = bytes(payload);
    match v["mode"].as_str().unwrap_or("") {
        "throughput" => {
            let fanout = u(v, "fanout");
            o += &header(
                v,
                &format!(
                    "{} of {pl} to {}",
                    plural(u(v, "count"), "record", "records"),
                    plural(fanout, "subscriber", "subscribers")
                ),
            );
            let _ = writeln!(
                o,
                "  one publisher, acked batches of {} records, up to {} batches awaiting their ack; queue policy {}{}",
                u(v, "batch"),
                u(v, "inflight"),
                v["queue_policy"].as_str().unwrap_or("?"),
                match u(v, "stall_ms") {
                    0 => String::new(),
                    ms => format!("; the last subscriber stalled for its first {ms} ms"),
                }
            );
            bounded(v, &mut o);
            let _ = writeln!(
                o,
                "published  {} records/s ({} MB/s, acked)",
                num(f(v, "publish_msgs_per_s")),
                mb(f(v, "publish_mb_per_s"))
            );
            let _ = writeln!(
                o,
                "delivered  {} records/s per subscriber on average ({} MB/s), slowest {} records/s; {} records/s in all",
                num(f(v, "per_sub_msgs_per_s_avg")),
                mb(f(v, "per_sub_mb_per_s_avg")),
                num(f(v, "per_sub_msgs_per_s_min")),
                num(f(v, "total_msgs_per_s"))
            );
            losses(v, u(v, "count"), fanout, &mut o);
            refusals(v, &mut o);
            if u(v, "out_of_order") > 0 {
                let _ = writeln!(
                    o,
                    "ORDER      {} deliveries did not start where the previous one ended",
                    thousands(u(v, "out_of_order"))
                );
            }
        }
        "latency" => {
            let fanout = u(v, "fanout");
            o += &header(
                v,
                &format!(
                    "publish → delivered to all {}, {pl} records, one in flight",
                    plural(fanout, "subscriber", "subscribers")
                ),
            );
            let _ = writeln!(
                o,
                "  fire-and-forget publishes; each waits until every subscriber has it; queue policy {}",
                v["queue_policy"].as_str().unwrap_or("?")
            );
            bounded(v, &mut o);
            let _ = writeln!(
                o,
                "latency    to all {fanout}: {}",
                percentiles(&v["all_f"])
            );
            let _ = writeln!(o, "  to each:  {}", percentiles(&v["each"]));
            let _ = writeln!(
                o,
                "lost       0 records (a missing record would stop the run with an error)"
            );
            refusals(v, &mut o);
        }
        "rtt" => {
            o += &header(
                v,
                &format!("request round trip, one acked publish of {pl} at a time"),
            );
            let durable = if v["durable"] == true {
                "a durable"
            } else {
                "an ephemeral"
            };
            let _ = writeln!(o, "  publish → its ack on {durable} stream, no subscriber");
            bounded(v, &mut o);
            let _ = writeln!(o, "throughput {} requests/s", num(f(v, "requests_per_s")));
            let _ = writeln!(o, "round trip {}", percentiles(&v["rtt"]));
            refusals(v, &mut o);
        }
        "connect" => {
            o += &header(v, "connection cost, one fresh connection at a time");
            let auth = if v["token"] == true {
                "with a token"
            } else {
                "without a token"
            };
            let _ = writeln!(
                o,
                "  connect ({auth}) → its first acked publish of {pl}, then close"
            );
            bounded(v, &mut o);
            let _ = writeln!(o, "to first ack {}", percentiles(&v["connect"]));
            let _ = writeln!(o, "handshake    {}", percentiles(&v["handshake"]));
            refusals(v, &mut o);
        }
        "ingest" => {
            let durable = if v["durable"] == true {
                "durable"
            } else {
                "ephemeral"
            };
            o += &header(
                v,
                &format!(
                    "acked ingest of {} of {pl}",
                    plural(u(v, "count"), "record", "records")
                ),
            );
            let _ = writeln!(
                o,
                "  one record per publish, up to {} awaiting their ack, {durable} stream, no subscriber",
                u(v, "inflight")
            );
            bounded(v, &mut o);
            let _ = writeln!(
                o,
                "throughput {} acks/s ({} MB/s)",
                num(f(v, "acks_per_s")),
                mb(f(v, "mb_per_s"))
            );
            let _ = writeln!(o, "ack        {}", percentiles(&v["ack"]));
            refusals(v, &mut o);
        }
        "group" => {
            o += &header(
                v,
                &format!(
                    "consumer group: {} of {pl} loaded, then consumed by {}",
                    plural(u(v, "count"), "record", "records"),
                    plural(u(v, "consumers"), "consumer", "consumers")
                ),
            );
            let _ = writeln!(
                o,
                "  {} shards, up to {} records per poll, each poll's claims acked in one answer",
                u(v, "shards"),
                u(v, "batch")
            );
            bounded(v, &mut o);
            let _ = writeln!(
                o,
                "throughput {} records/s processed ({} MB/s)",
                num(f(v, "records_per_s")),
                mb(f(v, "mb_per_s"))
            );
            let _ = writeln!(o, "poll+ack   {}", percentiles(&v["poll_ack"]));
            let (count, processed) = (u(v, "count"), u(v, "processed"));
            if v["lossless"] == true {
                let _ = writeln!(
                    o,
                    "lost       0: every record processed exactly once ({} redelivered)",
                    thousands(u(v, "redelivered"))
                );
            } else {
                let _ = writeln!(
                    o,
                    "lost       {} of {} not processed, {} processed twice, {} redelivered{}",
                    thousands(count.saturating_sub(processed)),
                    thousands(count),
                    thousands(u(v, "duplicates")),
                    thousands(u(v, "redelivered")),
                    if v["truncated"] == true {
                        " (the run reached --max-secs first)"
                    } else {
                        ""
                    }
                );
            }
        }
        "fanout-scale" => {
            let subs = u(v, "subscribers");
            o += &header(
                v,
                &format!(
                    "{} of {pl} at {} records/s to {} over {}",
                    plural(u(v, "published"), "record", "records"),
                    thousands(u(v, "rate_target")),
                    plural(subs, "subscription", "subscriptions"),
                    plural(u(v, "connections"), "connection", "connections")
                ),
            );
            let _ = writeln!(
                o,
                "  fire-and-forget publishes every 1 ms for {} s; queue policy {}",
                u(v, "secs"),
                v["queue_policy"].as_str().unwrap_or("?")
            );
            bounded(v, &mut o);
            let _ = writeln!(o, "published  {} records/s", num(f(v, "publish_rate")));
            let _ = writeln!(
                o,
                "delivered  {} events/s in all ({} of {} expected); {} of {} subscribers got every record",
                num(f(v, "delivered_per_s")),
                thousands(u(v, "delivered")),
                thousands(u(v, "expected")),
                thousands(u(v, "subs_complete")),
                thousands(subs)
            );
            let _ = writeln!(
                o,
                "latency    publish → delivered (first record of each delivery): {}",
                percentiles(&v["latency_sampled"])
            );
            if let Some(b) = v["broker_rss_per_sub_bytes"].as_f64() {
                let _ = writeln!(
                    o,
                    "memory     broker resident memory per subscriber: {}",
                    bytes(b.max(0.0) as u64)
                );
            }
            losses(v, u(v, "published"), subs, &mut o);
            refusals(v, &mut o);
        }
        "cache" => {
            let w = u(v, "watchers");
            o += &header(
                v,
                &format!(
                    "{} puts and gets of {pl}, then {} on one key",
                    thousands(u(v, "puts")),
                    plural(w, "watcher", "watchers")
                ),
            );
            let _ = writeln!(
                o,
                "  one writer, one request in flight; watch phase: {} puts/s for {} s over {}",
                thousands(u(v, "rate_target")),
                u(v, "secs"),
                plural(u(v, "connections"), "connection", "connections")
            );
            let _ = writeln!(o, "put        {}", percentiles(&v["put_latency"]));
            let _ = writeln!(o, "get        {}", percentiles(&v["get_latency"]));
            let _ = writeln!(
                o,
                "watch      {} events/s delivered ({} of {} expected); change → watcher {}",
                num(f(v, "delivered_per_s")),
                thousands(u(v, "delivered")),
                thousands(u(v, "expected")),
                percentiles(&v["change_to_watcher_latency"])
            );
            if !v["put_latency_under_fanout"].is_null() {
                let _ = writeln!(
                    o,
                    "put        {} while watchers are served (acked, one at a time)",
                    percentiles(&v["put_latency_under_fanout"])
                );
            }
            if let Some(b) = v["broker_rss_per_watcher_bytes"].as_f64() {
                let _ = writeln!(o, "memory     {} bytes of broker RSS per watcher", num(b));
            }
            if let Some(m) = v["first_offset_mismatch"].as_str() {
                let _ = writeln!(
                    o,
                    "ORDER      a watcher's offsets differ from the acknowledged ones: {m}"
                );
            }
            if v["lossless"] == true {
                let _ = writeln!(
                    o,
                    "lost       0: every watcher got exactly the acknowledged offsets, in order"
                );
            } else {
                let ended = u(v, "watches_ended");
                let _ = writeln!(
                    o,
                    "lost       {} changes; {} of {} watchers got every change",
                    thousands(u(v, "expected").saturating_sub(u(v, "delivered"))),
                    thousands(u(v, "watchers_complete")),
                    thousands(w)
                );
                if ended > 0 {
                    let _ = writeln!(
                        o,
                        "  why: {} ended by the broker (watch_lagged: the watch fell behind its queue bound)",
                        plural(ended, "watch was", "watches were")
                    );
                }
            }
        }
        _ => {
            let _ = writeln!(o, "{v}");
            return o;
        }
    }
    footer(v, &mut o);
    o
}

/// Counters a `--progress` line reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub published: u64,
    pub acked: u64,
    pub delivered: u64,
    pub lost: u64,
}

/// Which counters a mode feeds; `subscribers` > 0 shows delivered (and lost).
#[derive(Debug, Clone, Copy, Default)]
pub struct Shown {
    pub published: bool,
    pub acked: bool,
    pub subscribers: usize,
}

/// One `--progress` line: totals, and rates over the last `dt` seconds.
pub fn progress_line(secs: f64, now: &Snapshot, prev: &Snapshot, dt: f64, show: &Shown) -> String {
    let rate = |a: u64, b: u64| num(a.saturating_sub(b) as f64 / dt.max(1e-9));
    let mut parts = Vec::new();
    if show.published {
        parts.push(format!(
            "published {} ({}/s)",
            thousands(now.published),
            rate(now.published, prev.published)
        ));
    }
    if show.acked {
        parts.push(format!(
            "acked {} ({}/s)",
            thousands(now.acked),
            rate(now.acked, prev.acked)
        ));
    }
    if show.subscribers > 0 {
        parts.push(format!(
            "delivered {} ({}/s over {})",
            thousands(now.delivered),
            rate(now.delivered, prev.delivered),
            plural(show.subscribers as u64, "subscriber", "subscribers")
        ));
        parts.push(format!("lost {}", thousands(now.lost)));
    }
    format!("progress {secs:.0} s: {}", parts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn machine() -> Value {
        json!({"cores_online": 2, "cores_allowed": 1, "cpu": "x", "kernel": "6"})
    }

    #[test]
    fn durations_with_units() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration(" 10m "), Ok(Duration::from_secs(600)));
        for bad in [
            "",
            "s",
            "0s",
            "-1s",
            "1.2.3s",
            "5 parsecs",
            "11m",
            "1h",
            "x5",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
        }
        assert!(parse_duration("3w").unwrap_err().contains("unknown unit"));
    }

    #[test]
    fn numbers_for_people() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(num(12.34), "12.3");
        assert_eq!(num(412_345.6), "412,346");
        assert_eq!(micros(77), "77 µs");
        assert_eq!(micros(1_234), "1.23 ms");
        assert_eq!(micros(2_500_000), "2.50 s");
        assert_eq!(bytes(128), "128 B");
        assert_eq!(bytes(1024), "1.0 KiB");
    }

    fn lossy_throughput() -> Value {
        json!({
            "tool": "felix-loadgen", "mode": "throughput", "broker": "localhost:7400",
            "stream": "events", "shard": 0, "payload": 1024, "fanout": 3, "batch": 64,
            "inflight": 32, "count": 100000, "count_target": 100000, "duration_s": 1.5,
            "truncated": false, "out_of_order": 0, "publish_msgs_per_s": 66666.7,
            "publish_mb_per_s": 68.3, "per_sub_msgs_per_s_avg": 60000.0,
            "per_sub_mb_per_s_avg": 61.4, "per_sub_msgs_per_s_min": 40000.0,
            "total_msgs_per_s": 180000.0, "lost": 20000, "lost_lag": 19000, "missing": 1000,
            "lag_notices": 7, "subs_lossy": 1,
            "worst_sub": {"index": 2, "received": 80000, "lost": 19000, "lag_notices": 7, "missing": 1000},
            "ended": [], "queue_policy": "drop_new", "stall_ms": 500,
            "publish_refused": 128, "refused": {"publish_timeout": 2},
            "machine": machine(), "git_rev": "abc1234", "load1_end": 0.5,
        })
    }

    #[test]
    fn throughput_summary_says_what_why_and_who() {
        let s = human(&lossy_throughput());
        for want in [
            "felix-loadgen throughput: 100,000 records of 1.0 KiB to 3 subscribers on stream events shard 0 at localhost:7400",
            "acked batches of 64 records, up to 32 batches awaiting their ack; queue policy drop_new",
            "the last subscriber stalled for its first 500 ms",
            "ran to --count 100,000 in 1.50 s",
            "published  66,667 records/s (68.3 MB/s, acked)",
            "60,000 records/s per subscriber on average (61.4 MB/s), slowest 40,000 records/s",
            "lost       20,000 records (6.67% of 300,000 deliveries)",
            "19,000 records announced in 7 lag notices: a subscriber's queue on the broker was full and queue policy drop_new discarded the newest records",
            "1 of 3 subscribers fell behind; the worst, subscriber 2, received 80,000 of 100,000 (19,000 dropped in 7 lag notices, 1,000 never arrived)",
            "1,000 records never arrived and no lag notice covered them",
            "refused    128 records by the broker (not appended, not counted as published): publish_timeout ×2",
            "git abc1234, 2 cores online, 1 allowed",
        ] {
            assert!(s.contains(want), "missing {want:?} in\n{s}");
        }
        assert!(!s.contains("CUT SHORT"), "{s}");
    }

    #[test]
    fn lossless_and_truncated_and_duration_runs() {
        let mut v = lossy_throughput();
        let o = v.as_object_mut().unwrap();
        for k in [
            "lost",
            "lost_lag",
            "missing",
            "lag_notices",
            "subs_lossy",
            "publish_refused",
            "stall_ms",
        ] {
            o.insert(k.into(), 0.into());
        }
        o.remove("worst_sub");
        o.remove("count_target");
        o.insert("duration_target_s".into(), 2.0.into());
        o.insert("truncated".into(), true.into());
        o.insert("max_secs".into(), 60.into());
        o.insert("queue_policy".into(), "block".into());
        let s = human(&v);
        assert!(s.contains("lost       0 records: every subscriber got every published record (queue policy block)"), "{s}");
        assert!(
            s.contains("ran for --duration 2 s (measured in 1.50 s)"),
            "{s}"
        );
        assert!(
            s.contains("CUT SHORT: the run reached --max-secs 60"),
            "{s}"
        );
        assert!(!s.contains("refused"), "{s}");
        assert!(!s.contains("stalled"), "{s}");
    }

    #[test]
    fn ended_subscriptions_are_named() {
        let mut v = lossy_throughput();
        v["ended"] = json!([{"index": 1, "code": "stream_deleted", "message": "gone"}]);
        let s = human(&v);
        assert!(
            s.contains("the broker ended subscriber 1's subscription: stream_deleted (gone)"),
            "{s}"
        );
    }

    #[test]
    fn latency_rtt_ingest_summaries() {
        let pct =
            json!({"p50": 77, "p90": 90, "p99": 1234, "p999": 2000, "max": 3000, "samples": 10000});
        let lat = json!({"mode": "latency", "broker": "127.0.0.1:7400", "stream": "events",
            "shard": 0, "payload": 128, "fanout": 2, "count": 10000, "all_f": pct, "each": pct,
            "queue_policy": "drop_new", "machine": machine(), "git_rev": "r", "load1_end": 0.1,
            "publish_refused": 3, "refused_last": "broker refused (inflight_limit): full"});
        let s = human(&lat);
        assert!(
            s.contains("publish → delivered to all 2 subscribers, 128 B records"),
            "{s}"
        );
        assert!(
            s.contains("to all 2: p50 77 µs, p90 90 µs, p99 1.23 ms, p99.9 2.00 ms, max 3.00 ms (10,000 samples)"),
            "{s}"
        );
        assert!(s.contains("refused    3 publishes by the broker"), "{s}");
        assert!(
            s.contains("last: broker refused (inflight_limit): full"),
            "{s}"
        );
        let rtt = json!({"mode": "rtt", "broker": "b:1", "stream": "events", "shard": 0,
            "payload": 64, "durable": true, "requests_per_s": 12000.0, "rtt": pct});
        let s = human(&rtt);
        assert!(s.contains("on a durable stream"), "{s}");
        assert!(s.contains("throughput 12,000 requests/s"), "{s}");
        let ing = json!({"mode": "ingest", "broker": "b:1", "stream": "s", "shard": 1,
            "payload": 1024, "inflight": 32, "count": 5000, "acks_per_s": 100000.0,
            "mb_per_s": 102.4, "ack": pct, "duration_target_s": 5.0, "duration_s": 5.01});
        let s = human(&ing);
        assert!(
            s.contains("acked ingest of 5,000 records of 1.0 KiB on stream s shard 1"),
            "{s}"
        );
        assert!(s.contains("throughput 100,000 acks/s (102.4 MB/s)"), "{s}");
        assert!(
            s.contains("ran for --duration 5 s (measured in 5.01 s)"),
            "{s}"
        );
    }

    #[test]
    fn fanout_scale_cache_group_summaries() {
        let pct = json!({"p50": 500, "p99": 900, "max": 1000, "samples": 30});
        let fs = json!({"mode": "fanout-scale", "broker": "b:1", "stream": "events", "shard": 0,
            "subscribers": 1000, "connections": 1, "payload": 64, "rate_target": 100, "secs": 5,
            "publish_rate": 100.0, "published": 500, "delivered": 499000, "delivered_per_s": 99800.0,
            "expected": 500000, "lost": 1000, "lost_lag": 1000, "lag_notices": 10, "missing": 0,
            "subs_lossy": 10, "subs_complete": 990,
            "worst_sub": {"index": 7, "received": 400, "lost": 100, "lag_notices": 1, "missing": 0},
            "queue_policy": "drop_old", "latency_sampled": pct, "broker_rss_per_sub_bytes": 1800.0});
        let s = human(&fs);
        assert!(
            s.contains(
                "500 records of 64 B at 100 records/s to 1,000 subscriptions over 1 connection"
            ),
            "{s}"
        );
        assert!(
            s.contains("990 of 1,000 subscribers got every record"),
            "{s}"
        );
        assert!(
            s.contains("queue policy drop_old discarded the oldest"),
            "{s}"
        );
        assert!(
            s.contains(
                "10 of 1,000 subscribers fell behind; the worst, subscriber 7, received 400 of 500"
            ),
            "{s}"
        );
        assert!(
            s.contains("broker resident memory per subscriber: 1.8 KiB"),
            "{s}"
        );
        let kv = json!({"mode": "cache", "broker": "b:1", "cache": "kv", "payload": 64,
            "puts": 100, "put_latency": pct, "get_latency": pct, "watchers": 30, "connections": 3,
            "rate_target": 100, "secs": 1, "changes": 100, "delivered": 2900,
            "delivered_per_s": 2900.0, "expected": 3000, "watches_ended": 1,
            "watchers_complete": 29, "lossless": false, "change_to_watcher_latency": pct});
        let s = human(&kv);
        assert!(s.contains("on cache kv at b:1"), "{s}");
        assert!(
            s.contains("lost       100 changes; 29 of 30 watchers got every change"),
            "{s}"
        );
        assert!(
            s.contains("1 watch was ended by the broker (watch_lagged"),
            "{s}"
        );
        let g = json!({"mode": "group", "broker": "b:1", "stream": "jobs", "shards": 2,
            "payload": 100, "batch": 16, "consumers": 3, "count": 500, "processed": 500,
            "duplicates": 0, "redelivered": 0, "lossless": true, "records_per_s": 5000.0,
            "mb_per_s": 0.5, "poll_ack": pct});
        let s = human(&g);
        assert!(s.contains("consumer group: 500 records of 100 B loaded, then consumed by 3 consumers on stream jobs at b:1"), "{s}");
        assert!(
            s.contains("lost       0: every record processed exactly once"),
            "{s}"
        );
    }

    #[test]
    fn progress_lines_show_both_sides() {
        let prev = Snapshot {
            published: 1000,
            acked: 900,
            delivered: 2700,
            lost: 0,
        };
        let now = Snapshot {
            published: 3000,
            acked: 2900,
            delivered: 8400,
            lost: 12,
        };
        let show = Shown {
            published: true,
            acked: true,
            subscribers: 3,
        };
        assert_eq!(
            progress_line(2.0, &now, &prev, 1.0, &show),
            "progress 2 s: published 3,000 (2,000/s), acked 2,900 (2,000/s), delivered 8,400 (5,700/s over 3 subscribers), lost 12"
        );
        let show = Shown {
            published: false,
            acked: true,
            subscribers: 0,
        };
        assert_eq!(
            progress_line(1.0, &now, &Snapshot::default(), 0.5, &show),
            "progress 1 s: acked 2,900 (5,800/s)"
        );
    }
}

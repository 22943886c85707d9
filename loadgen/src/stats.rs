//! Result math of felix-loadgen, pure and unit-tested: latency percentiles from an
//! hdrhistogram, the UTC timestamp of a result line, medians, and the Felix / NATS campaign
//! summary (medians per case and side, ratio of medians).

use std::time::{SystemTime, UNIX_EPOCH};

/// `{p50, p90, p99, p999, max, samples}` of `h` (its unit is the caller's).
pub fn pct(h: &hdrhistogram::Histogram<u64>) -> serde_json::Value {
    serde_json::json!({
        "p50": h.value_at_quantile(0.5),
        "p90": h.value_at_quantile(0.9),
        "p99": h.value_at_quantile(0.99),
        "p999": h.value_at_quantile(0.999),
        "max": h.max(),
        "samples": h.len(),
    })
}

/// `t` as `YYYY-MM-DDTHH:MM:SSZ` (UTC, whole seconds; before the epoch clamps to it).
pub fn utc_rfc3339(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian (the standard
/// era-based conversion: 400-year eras of 146,097 days).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// The median of `xs` (the mean of the middle two for an even count); None when empty.
pub fn median(xs: &[f64]) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// The figures of one result line (felix-loadgen or peer-bench) a campaign compares.
fn figures(d: &serde_json::Value) -> Vec<(&'static str, f64)> {
    let f = |v: &serde_json::Value| v.as_f64();
    let pick = |pairs: [(&'static str, Option<f64>); 2]| -> Vec<(&'static str, f64)> {
        pairs
            .into_iter()
            .filter_map(|(k, v)| v.map(|v| (k, v)))
            .collect()
    };
    let mode = d["mode"].as_str().unwrap_or("");
    if d["tool"] == "felix-loadgen" {
        match mode {
            // Empty records move no bytes: count them.
            "throughput" if d["payload"] == 0 => pick([
                ("msgs/s per sub", f(&d["per_sub_msgs_per_s_avg"])),
                ("lost", f(&d["lost"])),
            ]),
            "throughput" => pick([
                ("MB/s per sub", f(&d["per_sub_mb_per_s_avg"])),
                ("lost", f(&d["lost"])),
            ]),
            "latency" => pick([
                ("p50 us", f(&d["all_f"]["p50"])),
                ("p99 us", f(&d["all_f"]["p99"])),
            ]),
            "ingest" => pick([
                ("acks/s", f(&d["acks_per_s"])),
                ("ack p99 us", f(&d["ack"]["p99"])),
            ]),
            "rtt" => pick([
                ("rtt p50 us", f(&d["rtt"]["p50"])),
                ("rtt p99 us", f(&d["rtt"]["p99"])),
            ]),
            "connect" => pick([
                ("connect p50 us", f(&d["connect"]["p50"])),
                ("connect p99 us", f(&d["connect"]["p99"])),
            ]),
            _ => vec![],
        }
    } else {
        let r = &d["result"];
        match mode {
            "core-throughput" => pick([
                ("MB/s per sub", f(&r["per_sub_mb_per_s_avg"])),
                ("lost", f(&r["total_lost"])),
            ]),
            "core-latency" => {
                let a = &r["all_subscribers_delivered"];
                pick([("p50 us", f(&a["p50_us"])), ("p99 us", f(&a["p99_us"]))])
            }
            "js-publish" => pick([
                ("acks/s", f(&r["publishes_per_s"])),
                ("ack p99 us", f(&r["ack_latency"]["p99_us"])),
            ]),
            _ => vec![],
        }
    }
}

/// The Markdown summary of a bench-vs-nats JSONL file: each line carries `"case": "SIDE
/// CASE"` (SIDE `felix`, `nats-tls`, or `nats` without TLS); per case and figure, each side's
/// median over its runs and Felix's ratio of medians to each NATS side (not for `lost`).
/// Lines that are not JSON objects are skipped.
pub fn summarize(jsonl: &str) -> String {
    use std::collections::BTreeMap;
    let mut runs: BTreeMap<(String, &'static str), BTreeMap<String, Vec<f64>>> = BTreeMap::new();
    for line in jsonl.lines().map(str::trim).filter(|l| l.starts_with('{')) {
        let Ok(d) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let Some((side, case)) = d["case"].as_str().and_then(|c| c.split_once(' ')) else {
            continue;
        };
        for (k, v) in figures(&d) {
            runs.entry((case.to_string(), k))
                .or_default()
                .entry(side.to_string())
                .or_default()
                .push(v);
        }
    }
    let mut out = String::from(
        "| case | figure | Felix median | NATS-TLS median | Felix / NATS-TLS | NATS median (no TLS) | Felix / NATS | runs |\n|---|---|---|---|---|---|---|---|\n",
    );
    for ((case, k), sides) in &runs {
        let side = |s: &str| sides.get(s).and_then(|v| median(v));
        let (f, t, n) = (side("felix"), side("nats-tls"), side("nats"));
        let ratio = |other: Option<f64>| match (f, other, *k) {
            (_, _, "lost") => "-".to_string(),
            (Some(f), Some(o), _) if o != 0.0 => format!("{:.2}", f / o),
            _ => "-".to_string(),
        };
        let show = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.1}"));
        let count = sides.values().map(Vec::len).max().unwrap_or(0);
        out.push_str(&format!(
            "| {case} | {k} | {} | {} | {} | {} | {} | {count} |\n",
            show(f),
            show(t),
            ratio(t),
            show(n),
            ratio(n)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn percentiles_of_a_known_distribution() {
        let mut h = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
        for v in 1..=1000u64 {
            h.record(v).unwrap();
        }
        let p = pct(&h);
        let v = |k: &str| p[k].as_u64().unwrap();
        // hdrhistogram answers the value at which that share of samples is reached (here
        // exact to ±1 at 3 significant digits).
        assert_eq!(v("samples"), 1000);
        for (k, want) in [
            ("p50", 500),
            ("p90", 900),
            ("p99", 990),
            ("p999", 999),
            ("max", 1000),
        ] {
            assert!(v(k).abs_diff(want) <= 1, "{k} = {} (want {want})", v(k));
        }
        // A single outlier moves the max, not the median.
        h.record(50_000).unwrap();
        let p = pct(&h);
        assert!(p["p50"].as_u64().unwrap().abs_diff(500) <= 1);
        assert!(p["max"].as_u64().unwrap() >= 50_000);
    }

    #[test]
    fn utc_dates_across_leap_years_and_centuries() {
        let at = |s: u64| utc_rfc3339(UNIX_EPOCH + Duration::from_secs(s));
        assert_eq!(at(0), "1970-01-01T00:00:00Z");
        assert_eq!(at(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(at(951_868_799), "2000-02-29T23:59:59Z");
        assert_eq!(at(1_709_164_800), "2024-02-29T00:00:00Z");
        assert_eq!(
            at(4_107_542_400),
            "2100-03-01T00:00:00Z",
            "2100 is not a leap year"
        );
        assert_eq!(at(1_796_353_445), "2026-12-04T03:04:05Z");
        assert_eq!(
            utc_rfc3339(UNIX_EPOCH - Duration::from_secs(5)),
            "1970-01-01T00:00:00Z"
        );
    }

    #[test]
    fn medians_odd_even_and_empty() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0]), Some(3.0));
        assert_eq!(median(&[5.0, 1.0, 3.0]), Some(3.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
    }

    #[test]
    fn summary_is_the_ratio_of_medians_per_case() {
        let felix = |mb: f64, lost: u64| {
            format!(
                r#"{{"tool":"felix-loadgen","mode":"throughput","per_sub_mb_per_s_avg":{mb},"lost":{lost},"case":"felix 1KiB-f1"}}"#
            )
        };
        let nats = |mb: f64| {
            format!(
                r#"{{"tool":"peer-bench","mode":"core-throughput","result":{{"per_sub_mb_per_s_avg":{mb},"total_lost":7}},"case":"nats-tls 1KiB-f1"}}"#
            )
        };
        let plain = |mb: f64| {
            format!(
                r#"{{"tool":"peer-bench","mode":"core-throughput","result":{{"per_sub_mb_per_s_avg":{mb},"total_lost":0}},"case":"nats 1KiB-f1"}}"#
            )
        };
        let lat = |side: &str, p99: u64| {
            if side == "felix" {
                format!(
                    r#"{{"tool":"felix-loadgen","mode":"latency","all_f":{{"p50":10,"p99":{p99}}},"case":"felix lat-f1"}}"#
                )
            } else {
                format!(
                    r#"{{"tool":"peer-bench","mode":"core-latency","result":{{"all_subscribers_delivered":{{"p50_us":20,"p99_us":{p99}}}}},"case":"nats-tls lat-f1"}}"#
                )
            }
        };
        let text = [
            felix(300.0, 0),
            nats(100.0),
            felix(100.0, 2),
            nats(200.0),
            felix(200.0, 0),
            nats(150.0),
            plain(400.0),
            "not json".to_string(),
            lat("felix", 90),
            lat("nats-tls", 60),
            r#"{"tool":"felix-loadgen","mode":"throughput","payload":0,"per_sub_msgs_per_s_avg":2e6,"per_sub_mb_per_s_avg":0.0,"lost":0,"case":"felix tp-0"}"#.to_string(),
            r#"{"tool":"felix-loadgen","mode":"ingest","acks_per_s":30000.0,"ack":{"p99":900},"case":"felix ingest"}"#.to_string(),
            r#"{"tool":"peer-bench","mode":"js-publish","result":{"publishes_per_s":20000.0,"ack_latency":{"p99_us":1800.0}},"case":"nats-tls ingest"}"#.to_string(),
            r#"{"tool":"felix-loadgen","mode":"rtt","rtt":{"p50":40,"p99":70},"case":"felix rtt"}"#.to_string(),
            r#"{"tool":"felix-loadgen","mode":"rtt","rtt":{"p50":60,"p99":90},"case":"felix rtt"}"#.to_string(),
        ]
        .join("\n");
        let s = summarize(&text);
        // Felix median 200, NATS median 150: 1.33.
        assert!(
            s.contains("| 1KiB-f1 | MB/s per sub | 200.0 | 150.0 | 1.33 | 400.0 | 0.50 | 3 |"),
            "{s}"
        );
        assert!(
            s.contains("| 1KiB-f1 | lost | 0.0 | 7.0 | - | 0.0 | - | 3 |"),
            "{s}"
        );
        assert!(
            s.contains("| lat-f1 | p99 us | 90.0 | 60.0 | 1.50 | - | - | 1 |"),
            "{s}"
        );
        assert!(
            s.contains("| lat-f1 | p50 us | 10.0 | 20.0 | 0.50 | - | - | 1 |"),
            "{s}"
        );
        assert!(
            s.contains("| tp-0 | msgs/s per sub | 2000000.0 | - | - | - | - | 1 |"),
            "{s}"
        );
        assert!(
            s.contains("| ingest | acks/s | 30000.0 | 20000.0 | 1.50 | - | - | 1 |"),
            "{s}"
        );
        assert!(
            s.contains("| ingest | ack p99 us | 900.0 | 1800.0 | 0.50 | - | - | 1 |"),
            "{s}"
        );
        // Felix-only request round trips: medians, no ratio.
        assert!(
            s.contains("| rtt | rtt p50 us | 50.0 | - | - | - | - | 2 |"),
            "{s}"
        );
        assert!(
            s.contains("| rtt | rtt p99 us | 80.0 | - | - | - | - | 2 |"),
            "{s}"
        );
    }
}

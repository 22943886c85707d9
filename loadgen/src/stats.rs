//! Result math of felix-loadgen, pure and unit-tested: latency percentiles from an
//! hdrhistogram and the UTC timestamp of a result line.

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
}

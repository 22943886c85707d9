//! Retention (pure): which sealed segments to delete, oldest first, whole segments only.

/// What retention needs to know about one segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentFacts {
    pub base: u64,
    /// Bytes the segment occupies (records and padding).
    pub bytes: u64,
    /// Largest record timestamp in the segment (0 when it holds none).
    pub max_ts_ms: u64,
    pub sealed: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetentionLimits {
    /// Keep the log's total bytes at or under this (None: unlimited).
    pub bytes_max: Option<u64>,
    /// Delete segments whose newest record is older than this (None: forever).
    pub age_max_ms: Option<u64>,
}

/// How many of the oldest segments (a prefix of `segs`, which is in offset order) to delete.
/// Never the active (unsealed) segment, never a segment out of order: a segment is only
/// deleted if every older one is too, so the retained log stays contiguous.
pub fn segments_to_delete(segs: &[SegmentFacts], limits: RetentionLimits, now_ms: u64) -> usize {
    let mut total: u64 = segs.iter().map(|s| s.bytes).sum();
    let mut n = 0;
    for s in segs {
        if !s.sealed {
            break;
        }
        let over_bytes = limits.bytes_max.is_some_and(|max| total > max);
        let too_old = limits
            .age_max_ms
            .is_some_and(|age| now_ms.saturating_sub(s.max_ts_ms) > age);
        if !(over_bytes || too_old) {
            break;
        }
        total -= s.bytes;
        n += 1;
    }
    n
}

/// How many of the oldest segments hold only offsets below `offset` (a snapshot covers them):
/// segment `i` holds `[base_i, base_{i+1})`, so it qualifies when it is sealed, is not the
/// last, and the next one starts at or below `offset`. A prefix only, like retention.
pub fn segments_below(segs: &[SegmentFacts], offset: u64) -> usize {
    segs.windows(2)
        .take_while(|w| w[0].sealed && w[1].base <= offset)
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn seg(base: u64, bytes: u64, ts: u64, sealed: bool) -> SegmentFacts {
        SegmentFacts {
            base,
            bytes,
            max_ts_ms: ts,
            sealed,
        }
    }

    #[test]
    fn off_by_default_and_never_the_active_segment() {
        let s = [seg(0, 100, 1, true), seg(10, 100, 2, false)];
        assert_eq!(
            segments_to_delete(&s, RetentionLimits::default(), 1_000_000),
            0
        );
        let all = RetentionLimits {
            bytes_max: Some(0),
            age_max_ms: Some(0),
        };
        assert_eq!(segments_to_delete(&s, all, 1_000_000), 1);
    }

    #[test]
    fn by_age_only_a_prefix() {
        // The middle one is old but the first is young: nothing goes (stay contiguous).
        let s = [
            seg(0, 1, 900, true),
            seg(1, 1, 10, true),
            seg(2, 1, 0, false),
        ];
        let l = RetentionLimits {
            bytes_max: None,
            age_max_ms: Some(500),
        };
        assert_eq!(segments_to_delete(&s, l, 1000), 0);
        let s = [
            seg(0, 1, 10, true),
            seg(1, 1, 600, true),
            seg(2, 1, 999, false),
        ];
        assert_eq!(segments_to_delete(&s, l, 1000), 1);
    }

    proptest! {
        /// After deleting, the remaining total is within the bound unless only the active
        /// segment (or segments that cannot go) remain; and deleting one fewer would not be.
        #[test]
        fn bytes_bound_is_minimal(sizes in proptest::collection::vec(1u64..1000, 1..12), max in 0u64..5000) {
            let n = sizes.len();
            let segs: Vec<_> = sizes.iter().enumerate().map(|(i, b)| seg(i as u64, *b, 0, i + 1 < n)).collect();
            let l = RetentionLimits { bytes_max: Some(max), age_max_ms: None };
            let k = segments_to_delete(&segs, l, 0);
            let left: u64 = sizes[k..].iter().sum();
            prop_assert!(k < n);
            prop_assert!(left <= max || k == n - 1);
            if k > 0 {
                let before: u64 = sizes[k - 1..].iter().sum();
                prop_assert!(before > max);
            }
        }
    }

    proptest! {
        #[test]
        fn segments_below_deletes_only_covered_offsets(
            sizes in proptest::collection::vec(1u64..50, 1..10),
            unsealed_last in any::<bool>(),
            offset in 0u64..400,
        ) {
            let mut segs = Vec::new();
            let mut base = 0;
            for (i, n) in sizes.iter().enumerate() {
                let last = i + 1 == sizes.len();
                segs.push(seg(base, *n, 0, !(last && unsealed_last)));
                base += n;
            }
            let k = segments_below(&segs, offset);
            prop_assert!(k < segs.len(), "never the last segment");
            for i in 0..k {
                prop_assert!(segs[i].sealed && segs[i + 1].base <= offset);
            }
            // Minimal: the next segment is not wholly below the offset (or is the last).
            if k + 1 < segs.len() && segs[k].sealed {
                prop_assert!(segs[k + 1].base > offset);
            }
        }
    }
}

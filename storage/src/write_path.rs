//! Which way a page-cache commit (`periodic`, `none`) goes into the file: the pure policy.
//!
//! A buffered write that needs no I/O is a memory copy of a few µs. Three ways to do it:
//! - `pwritev2(RWF_NOWAIT)`: never blocks; refused outright by filesystems without
//!   non-blocking buffered writes (ext4 on Linux 6.18 answers EOPNOTSUPP).
//! - a plain `pwrite` on the core: the cheapest, but it can block the whole core (and every
//!   shard on it) when the kernel throttles dirty pages or waits for the journal.
//! - io_uring: never blocks the core, but on such filesystems io_uring punts every buffered
//!   write to an io-wq worker thread, a context switch each way per commit on the pinned
//!   core (measured: ~13% of the broker's time at ~100k acked 1 KiB publishes/s).
//!
//! The policy: write inline while inline writes are fast; when one takes longer than
//! `slow_us` (the kernel blocked it), commit through io_uring for `backoff_ms`, then try
//! inline again. A blocked inline write therefore costs the core at most one stall per
//! back-off period. `slow_us == 0` turns inline writes off (io_uring only).
//! No clock here: callers pass the time.

/// How the next page-cache commit is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteWay {
    /// A plain blocking `pwrite` on the core.
    Inline,
    /// An io_uring write (may run on a kernel worker thread).
    Ring,
}

#[derive(Debug, Clone)]
pub struct WritePath {
    slow_us: u64,
    backoff_ms: u64,
    /// Inline writes resume at this time (ms); 0 = now.
    ring_until_ms: u64,
    /// How many times an inline write was slow (the core stalled): for metrics and tests.
    pub stalls: u64,
}

impl WritePath {
    pub fn new(slow_us: u64, backoff_ms: u64) -> Self {
        WritePath {
            slow_us,
            backoff_ms,
            ring_until_ms: 0,
            stalls: 0,
        }
    }

    /// The way for a commit starting at `now_ms`.
    pub fn choose(&self, now_ms: u64) -> WriteWay {
        if self.slow_us == 0 || now_ms < self.ring_until_ms {
            WriteWay::Ring
        } else {
            WriteWay::Inline
        }
    }

    /// An inline write that started at `now_ms` took `took_us`.
    pub fn observe_inline(&mut self, took_us: u64, now_ms: u64) {
        if took_us > self.slow_us {
            self.stalls += 1;
            self.ring_until_ms = now_ms.saturating_add(self.backoff_ms);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fast_writes_stay_inline() {
        let mut p = WritePath::new(1000, 500);
        for t in 0..100 {
            assert_eq!(p.choose(t), WriteWay::Inline);
            p.observe_inline(999, t);
        }
        assert_eq!(p.stalls, 0);
    }

    #[test]
    fn a_slow_write_sends_commits_to_the_ring_for_the_backoff() {
        let mut p = WritePath::new(1000, 500);
        p.observe_inline(1001, 10);
        assert_eq!(p.stalls, 1);
        assert_eq!(p.choose(10), WriteWay::Ring);
        assert_eq!(p.choose(509), WriteWay::Ring);
        assert_eq!(p.choose(510), WriteWay::Inline);
    }

    #[test]
    fn zero_threshold_never_writes_inline() {
        let p = WritePath::new(0, 500);
        assert_eq!(p.choose(0), WriteWay::Ring);
        assert_eq!(p.choose(u64::MAX), WriteWay::Ring);
    }

    proptest! {
        /// Against a direct statement of the rule: inline exactly when the threshold is on
        /// and no slow inline write happened within the back-off before now; at most one
        /// stall is possible per back-off window (a stall needs an inline write).
        #[test]
        fn matches_the_rule(slow in 0u64..50, backoff in 0u64..20,
                            steps in proptest::collection::vec((0u64..5, 0u64..100), 1..200)) {
            let mut p = WritePath::new(slow, backoff);
            let mut now = 0u64;
            let mut last_slow: Option<u64> = None;
            for (dt, took) in steps {
                now += dt;
                let expect_inline = slow != 0 && last_slow.is_none_or(|s| now >= s + backoff);
                let way = p.choose(now);
                prop_assert_eq!(way == WriteWay::Inline, expect_inline);
                if way == WriteWay::Inline {
                    p.observe_inline(took, now);
                    if took > slow {
                        last_slow = Some(now);
                    }
                }
            }
        }
    }
}

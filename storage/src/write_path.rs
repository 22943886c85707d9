//! Which way a page-cache commit (`periodic`, `none`) goes into the file: the pure policy.
//!
//! A buffered write that needs no I/O is a memory copy of a few µs. Three ways to do it:
//! - `pwritev2(RWF_NOWAIT)`: never blocks; when the kernel would have to wait it says so
//!   (EAGAIN or a short write). Refused outright by filesystems without non-blocking buffered
//!   writes (ext4 on Linux 6.18 answers EOPNOTSUPP).
//! - a plain `pwrite` on the core: the cheapest, but it can block the whole core (and every
//!   shard on it) when the kernel throttles dirty pages or waits for the journal.
//! - io_uring: never blocks the core, but on such filesystems io_uring punts every buffered
//!   write to an io-wq worker thread, a context switch each way per commit on the pinned
//!   core (measured: ~13% of the broker's time at ~100k acked 1 KiB publishes/s).
//!
//! The policy:
//! - RWF_NOWAIT first where the filesystem supports it; what it could not write goes to
//!   io_uring (the kernel just said a plain write would block).
//! - Where RWF_NOWAIT is refused: a plain `pwrite` for commits up to
//!   [`INLINE_WRITE_BYTES_MAX`] while inline writes stay fast; larger commits go to io_uring
//!   (their copy alone is long next to the worker round trip it would save).
//! - An inline write that took longer than `slow_us` (the kernel blocked it) sends every
//!   commit of the core through io_uring for `backoff_ms`, counted from the end of that
//!   write. The back-off is the core's, not one log's ([`Backoff`] lives per thread in the
//!   driver): dirty throttling and journal waits hit every log on the filesystem, so a core
//!   stalls at most once per back-off period whatever the number of logs it owns.
//! - `slow_us == 0` turns inline writes off (io_uring only).
//!
//! No clock here: callers pass the time.

/// Commits larger than this are never written inline (bytes).
pub const INLINE_WRITE_BYTES_MAX: usize = 256 << 10;

/// What an `RWF_NOWAIT` attempt did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoWait {
    /// Not tried: the filesystem refuses RWF_NOWAIT buffered writes.
    Unsupported,
    /// Wrote this many bytes, then the kernel would have blocked (or it wrote all).
    Wrote(usize),
}

/// How the rest of a page-cache commit is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteWay {
    /// Nothing left: RWF_NOWAIT wrote it all.
    Done,
    /// A plain blocking `pwrite` on the core.
    Inline,
    /// An io_uring write (may run on a kernel worker thread).
    Ring,
}

/// A log's settings for the policy.
#[derive(Debug, Clone, Copy)]
pub struct WritePath {
    pub slow_us: u64,
    pub backoff_ms: u64,
}

/// The per-core state of the policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Backoff {
    /// Inline writes resume at this time (ms); 0 = now.
    pub ring_until_ms: u64,
    /// How many inline writes were slow (the core stalled): for logs and tests.
    pub stalls: u64,
}

impl WritePath {
    /// The way for the rest of a commit of `len` bytes, at `now_ms`.
    pub fn choose(&self, st: &Backoff, len: usize, nowait: NoWait, now_ms: u64) -> WriteWay {
        match nowait {
            NoWait::Wrote(n) if n >= len => WriteWay::Done,
            NoWait::Wrote(_) => WriteWay::Ring,
            NoWait::Unsupported
                if self.slow_us == 0
                    || len > INLINE_WRITE_BYTES_MAX
                    || now_ms < st.ring_until_ms =>
            {
                WriteWay::Ring
            }
            NoWait::Unsupported => WriteWay::Inline,
        }
    }

    /// An inline write that ended at `end_ms` took `took_us`. True when it was slow (the
    /// core's commits now go through io_uring for the back-off).
    pub fn observe_inline(&self, st: &mut Backoff, took_us: u64, end_ms: u64) -> bool {
        if took_us <= self.slow_us {
            return false;
        }
        st.stalls += 1;
        st.ring_until_ms = end_ms.saturating_add(self.backoff_ms);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const P: WritePath = WritePath {
        slow_us: 1000,
        backoff_ms: 500,
    };

    #[test]
    fn fast_small_writes_stay_inline() {
        let mut st = Backoff::default();
        for t in 0..100 {
            assert_eq!(
                P.choose(&st, 4096, NoWait::Unsupported, t),
                WriteWay::Inline
            );
            assert!(!P.observe_inline(&mut st, 1000, t));
        }
        assert_eq!(st.stalls, 0);
    }

    #[test]
    fn a_slow_write_sends_commits_to_the_ring_for_the_backoff_after_it_ended() {
        let mut st = Backoff::default();
        // Started at 10, ended at 1,210 (1.2 s blocked): the back-off runs from the end.
        assert!(P.observe_inline(&mut st, 1_200_000, 1_210));
        assert_eq!(st.stalls, 1);
        assert_eq!(
            P.choose(&st, 10, NoWait::Unsupported, 1_210),
            WriteWay::Ring
        );
        assert_eq!(
            P.choose(&st, 10, NoWait::Unsupported, 1_709),
            WriteWay::Ring
        );
        assert_eq!(
            P.choose(&st, 10, NoWait::Unsupported, 1_710),
            WriteWay::Inline
        );
    }

    #[test]
    fn nowait_answers_come_first() {
        let st = Backoff::default();
        assert_eq!(P.choose(&st, 100, NoWait::Wrote(100), 0), WriteWay::Done);
        // The kernel said a plain write would block: never inline.
        assert_eq!(P.choose(&st, 100, NoWait::Wrote(40), 0), WriteWay::Ring);
        assert_eq!(P.choose(&st, 100, NoWait::Wrote(0), 0), WriteWay::Ring);
    }

    #[test]
    fn large_commits_and_a_zero_threshold_go_to_the_ring() {
        let st = Backoff::default();
        let big = INLINE_WRITE_BYTES_MAX + 1;
        assert_eq!(P.choose(&st, big, NoWait::Unsupported, 0), WriteWay::Ring);
        assert_eq!(
            P.choose(&st, INLINE_WRITE_BYTES_MAX, NoWait::Unsupported, 0),
            WriteWay::Inline
        );
        let off = WritePath {
            slow_us: 0,
            backoff_ms: 500,
        };
        assert_eq!(off.choose(&st, 10, NoWait::Unsupported, 0), WriteWay::Ring);
    }

    proptest! {
        /// Against a direct statement of the rule, for a filesystem without RWF_NOWAIT:
        /// inline exactly when the threshold is on, the commit is small enough, and no slow
        /// inline write ended within the back-off before now; a stall needs an inline write,
        /// so there is at most one per back-off window.
        #[test]
        fn matches_the_rule(slow in 0u64..50, backoff in 0u64..20,
                            steps in proptest::collection::vec(
                                (0u64..5, 0u64..100, 0usize..2 * INLINE_WRITE_BYTES_MAX), 1..200)) {
            let p = WritePath { slow_us: slow, backoff_ms: backoff };
            let mut st = Backoff::default();
            let mut now = 0u64;
            let mut last_slow_end: Option<u64> = None;
            let mut stalls = 0u64;
            for (dt, took_us, len) in steps {
                now += dt;
                let expect_inline = slow != 0
                    && len <= INLINE_WRITE_BYTES_MAX
                    && last_slow_end.is_none_or(|e| now >= e + backoff);
                let way = p.choose(&st, len, NoWait::Unsupported, now);
                prop_assert_eq!(way == WriteWay::Inline, expect_inline);
                prop_assert_ne!(way, WriteWay::Done);
                if way == WriteWay::Inline {
                    let end = now + took_us / 1000;
                    let slow_now = p.observe_inline(&mut st, took_us, end);
                    prop_assert_eq!(slow_now, took_us > slow);
                    if slow_now {
                        stalls += 1;
                        last_slow_end = Some(end);
                    }
                    now = end;
                }
                prop_assert_eq!(st.stalls, stalls);
            }
        }
    }
}

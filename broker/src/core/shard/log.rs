//! The log a durable shard host writes through, as a small trait: the real
//! [`felix_storage::Log`] in the broker, and the in-memory twin of the simulator
//! (`core::sim::disk`), which can fail a write and knows a process crash from a machine crash.
//!
//! Only what the host does **synchronously** is here: queue an append (offsets are assigned at
//! once) and read the retention floor. Commits, failures and history reads are I/O: the driver
//! awaits them and hands the outcome back (`StreamHost::on_acked`, `on_failed`, `on_read`), so
//! the host never awaits.
//!
//! Shaped for replication (the next issues), not built: a follower's log will open at a base
//! offset and truncate a suffix, and each record will carry its generation. Those become
//! methods here; the host's lifecycle gains the replica roles beside `Open`.

use bytes::Bytes;
use felix_storage::{Log, LogError, RecordIn};
use std::ops::Range;

pub(crate) trait ShardLog: Clone {
    /// Queue `payloads` for the next commit. The offsets are assigned now, contiguously; the
    /// commit is reported later (`acked` beyond the range's end) or the log fails.
    fn append(&self, payloads: &[Bytes], ts_ms: u64) -> Result<Range<u64>, LogError>;
    /// The oldest offset retention still holds.
    fn oldest_offset(&self) -> u64;
}

impl ShardLog for Log {
    fn append(&self, payloads: &[Bytes], ts_ms: u64) -> Result<Range<u64>, LogError> {
        let ins: Vec<RecordIn> = payloads.iter().map(|p| RecordIn::new(p)).collect();
        Log::append(self, &ins, ts_ms)
    }

    fn oldest_offset(&self) -> u64 {
        Log::oldest_offset(self)
    }
}

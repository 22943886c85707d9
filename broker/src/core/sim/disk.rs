//! The in-memory twin of a shard's log, for the simulator. Records move through three places,
//! as in the real log: queued in the process (appended, offsets assigned), written (in the
//! page cache: a process crash keeps them) and synced (fsynced: a machine crash keeps only
//! these). The simulator decides when writes and syncs happen, and can fail the log.

use crate::core::shard::log::ShardLog;
use bytes::Bytes;
use felix_storage::LogError;
use std::cell::RefCell;
use std::ops::Range;
use std::rc::Rc;

/// What one shard's storage holds. It outlives a broker restart (it is the disk).
#[derive(Debug, Default)]
pub(crate) struct Stored {
    /// Record `i` is at offset `i`.
    pub records: Vec<Bytes>,
    /// The end offset of each append: the log writes whole commits, so the page cache and
    /// the fsynced prefix always end at one of these.
    pub bounds: Vec<u64>,
    /// Records below this reached the page cache.
    pub written: u64,
    /// Records below this were fsynced.
    pub synced: u64,
    /// Why the device failed (appends and reads are refused from then on).
    pub failed: Option<String>,
    /// The log was closed (shutdown): appends are refused.
    pub closed: bool,
}

impl Stored {
    /// The commit mark the log acknowledges: synced records (fsync on commit, the mode the
    /// simulator runs, so an acknowledged record survives a machine crash).
    pub(crate) fn acked(&self) -> u64 {
        self.synced
    }

    /// A process crash: what was only queued in the process is gone; the page cache
    /// survives (the kernel writes it out), and the reopened log counts it as committed.
    pub(crate) fn process_crash(&mut self) {
        self.records.truncate(self.written as usize);
        let written = self.written;
        self.bounds.retain(|b| *b <= written);
        self.synced = self.written;
        self.closed = false;
    }

    /// A machine crash: what was not fsynced is gone.
    pub(crate) fn machine_crash(&mut self) {
        self.records.truncate(self.synced as usize);
        let synced = self.synced;
        self.bounds.retain(|b| *b <= synced);
        self.written = self.synced;
        self.closed = false;
    }
}

/// A handle on one shard's storage, as the shard host holds it.
#[derive(Clone, Debug)]
pub(crate) struct MemLog(pub Rc<RefCell<Stored>>);

impl MemLog {
    /// Records from `from`, at most `records_max`, among those acknowledged (a history read
    /// sees only committed records, as the ring does).
    pub(crate) fn read(
        &self,
        from: u64,
        records_max: usize,
    ) -> Result<Option<(u64, Vec<Bytes>)>, LogError> {
        let st = self.0.borrow();
        if let Some(why) = &st.failed {
            return Err(LogError::Failed(why.clone()));
        }
        let end = st.acked().min(from + records_max as u64);
        if from >= end {
            return Ok(None);
        }
        Ok(Some((
            from,
            st.records[from as usize..end as usize].to_vec(),
        )))
    }
}

impl ShardLog for MemLog {
    fn append(&self, payloads: &[Bytes], _ts_ms: u64) -> Result<Range<u64>, LogError> {
        let mut st = self.0.borrow_mut();
        if let Some(why) = &st.failed {
            return Err(LogError::Failed(why.clone()));
        }
        if st.closed {
            return Err(LogError::Closed);
        }
        let start = st.records.len() as u64;
        st.records.extend(payloads.iter().cloned());
        let end = st.records.len() as u64;
        st.bounds.push(end);
        Ok(start..end)
    }

    fn oldest_offset(&self) -> u64 {
        0
    }
}

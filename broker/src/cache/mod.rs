//! Pure state of one cache shard: key → current entry, versions that are log offsets,
//! absolute expiry, conditional writes, and the change stream that watches follow. No
//! clock (the caller passes `now_ms`, wall-clock milliseconds, because expiry is absolute and
//! survives restarts), no I/O: the driver appends every [`Change`] this returns to the shard's
//! log (the change *is* the record, see [`record`]) and replays a recovered log through
//! [`CacheShard::apply`].
//!
//! # Rules
//! - Every applied write — put, delete, and the expiry of a key — is a [`Change`] with the
//!   next offset of the shard. Offsets are contiguous and a key's **version** is the offset
//!   of the change that wrote its current value. (For an in-memory cache the driver starts
//!   the offsets above any a previous process could have used, so versions never repeat.)
//! - TTL is an absolute expiry (`expires_at_ms`). A read at or after it sees no value (lazy
//!   expiry); [`CacheShard::expire`] turns expired keys into `Expire` changes (background
//!   reclamation), which watches see like deletes.
//! - Conditional writes: [`Cond::Version`] applies only if the key's current version is
//!   exactly that (an expired key has no version); [`Cond::Absent`] only if there is no live
//!   value. A failed condition changes nothing and names the current version.
//! - Watches: [`CacheShard::watch_start`] gives the matching keys' current values (each with
//!   its version) and the offset live changes continue at; every later change whose key
//!   matches follows in offset order. Because one owner applies changes one at a time, the
//!   state phase and the live phase meet with no gap and no duplicate (property-tested).
//! - Bounds: key and value sizes, entry count and total bytes are capped ([`CacheLimits`]);
//!   a put that would pass a cap is refused, never evicts silently.

pub mod record;
pub mod snapshot;
#[cfg(test)]
mod tests;

use bytes::Bytes;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Largest TTL accepted: about 10 years in milliseconds.
pub const TTL_LIMIT_MS: u64 = 10 * 365 * 24 * 60 * 60 * 1000;

/// Caps of one shard. Every field carries its unit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheLimits {
    pub key_bytes_max: usize,
    pub value_bytes_max: usize,
    pub entries_max: usize,
    /// Keys plus values of live entries.
    pub bytes_max: u64,
}

impl Default for CacheLimits {
    fn default() -> Self {
        CacheLimits {
            key_bytes_max: 1024,
            value_bytes_max: 1 << 20,
            entries_max: 1_000_000,
            bytes_max: 1 << 30,
        }
    }
}

/// A key's current value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub value: Bytes,
    /// The offset of the change that wrote it.
    pub version: u64,
    pub expires_at_ms: Option<u64>,
}

impl Entry {
    fn live(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_none_or(|t| now_ms < t)
    }
}

/// What one applied write did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChangeKind {
    Put {
        value: Bytes,
        expires_at_ms: Option<u64>,
    },
    /// Removed by a delete.
    Delete,
    /// Removed because its expiry passed.
    Expire,
}

/// One applied write, at its offset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub offset: u64,
    pub key: Bytes,
    pub kind: ChangeKind,
}

/// The condition of a write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cond {
    Always,
    /// Only if the key's current version is exactly this.
    Version(u64),
    /// Only if the key has no live value.
    Absent,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    #[error("a key of {len} bytes is outside 1 to {max} bytes (cache_key_bytes_max)")]
    KeySize { len: usize, max: usize },
    #[error("value of {len} bytes exceeds {max}")]
    ValueTooLarge { len: usize, max: usize },
    #[error("a ttl of {ttl_ms} ms is outside 1 to {max_ms} ms")]
    TtlOutOfRange { ttl_ms: u64, max_ms: u64 },
    #[error("condition failed: {}", match current { Some(v) => format!("the current version is {v}"), None => "the key has no current value".into() })]
    ConditionFailed { current: Option<u64> },
    #[error("no such key")]
    NotFound,
    #[error("shard is full: {entries} entries, {bytes} bytes (caps {entries_max}, {bytes_max})")]
    Full {
        entries: usize,
        bytes: u64,
        entries_max: usize,
        bytes_max: u64,
    },
}

/// What a watch follows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Filter {
    Key(Bytes),
    Prefix(Bytes),
}

impl Filter {
    pub fn matches(&self, key: &[u8]) -> bool {
        match self {
            Filter::Key(k) => key == &k[..],
            Filter::Prefix(p) => key.starts_with(p),
        }
    }
}

/// The state phase of a watch: current values, then live changes from `live_from`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchStart {
    /// Matching keys' live values, in key order.
    pub retained: Vec<(Bytes, Entry)>,
    /// The offset of the first change the watch receives live.
    pub live_from: u64,
}

/// One cache shard.
#[derive(Debug)]
pub struct CacheShard {
    limits: CacheLimits,
    next_offset: u64,
    entries: BTreeMap<Bytes, Entry>,
    /// `(expires_at_ms, key)` for every entry with an expiry.
    expiry: BTreeSet<(u64, Bytes)>,
    bytes: u64,
}

fn entry_bytes(key: &[u8], e: &Entry) -> u64 {
    (key.len() + e.value.len()) as u64
}

impl CacheShard {
    /// An empty shard whose next change gets offset `next_offset`.
    pub fn new(limits: CacheLimits, next_offset: u64) -> CacheShard {
        CacheShard {
            limits,
            next_offset,
            entries: BTreeMap::new(),
            expiry: BTreeSet::new(),
            bytes: 0,
        }
    }

    pub fn next_offset(&self) -> u64 {
        self.next_offset
    }
    /// Entries held (expired ones not yet reclaimed included).
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The key's live value.
    pub fn get(&self, key: &[u8], now_ms: u64) -> Option<&Entry> {
        self.entries.get(key).filter(|e| e.live(now_ms))
    }

    fn check(&self, key: &[u8], cond: Cond, now_ms: u64) -> Result<(), CacheError> {
        if key.is_empty() || key.len() > self.limits.key_bytes_max {
            return Err(CacheError::KeySize {
                len: key.len(),
                max: self.limits.key_bytes_max,
            });
        }
        let current = self.get(key, now_ms).map(|e| e.version);
        let ok = match cond {
            Cond::Always => true,
            Cond::Version(v) => current == Some(v),
            Cond::Absent => current.is_none(),
        };
        if ok {
            Ok(())
        } else {
            Err(CacheError::ConditionFailed { current })
        }
    }

    /// Write `value` under `key`, expiring `ttl_ms` after `now_ms` (never when `None`).
    pub fn put(
        &mut self,
        key: Bytes,
        value: Bytes,
        ttl_ms: Option<u64>,
        cond: Cond,
        now_ms: u64,
    ) -> Result<Change, CacheError> {
        let change = self.prepare_put(key, value, ttl_ms, cond, now_ms)?;
        self.apply(&change);
        Ok(change)
    }

    /// The change a put would make, checked but not applied: a log-backed driver appends it
    /// first and [`CacheShard::apply`]s it once the append was accepted, so state never runs
    /// ahead of the log.
    pub fn prepare_put(
        &self,
        key: Bytes,
        value: Bytes,
        ttl_ms: Option<u64>,
        cond: Cond,
        now_ms: u64,
    ) -> Result<Change, CacheError> {
        self.check(&key, cond, now_ms)?;
        if value.len() > self.limits.value_bytes_max {
            return Err(CacheError::ValueTooLarge {
                len: value.len(),
                max: self.limits.value_bytes_max,
            });
        }
        if let Some(t) = ttl_ms {
            if t == 0 || t > TTL_LIMIT_MS {
                return Err(CacheError::TtlOutOfRange {
                    ttl_ms: t,
                    max_ms: TTL_LIMIT_MS,
                });
            }
        }
        let old = self
            .entries
            .get(&key)
            .map(|e| entry_bytes(&key, e))
            .unwrap_or(0);
        let new = (key.len() + value.len()) as u64;
        let entries = self.entries.len() + usize::from(!self.entries.contains_key(&key));
        let bytes = self.bytes - old + new;
        if entries > self.limits.entries_max || bytes > self.limits.bytes_max {
            return Err(CacheError::Full {
                entries: self.entries.len(),
                bytes: self.bytes,
                entries_max: self.limits.entries_max,
                bytes_max: self.limits.bytes_max,
            });
        }
        Ok(Change {
            offset: self.next_offset,
            key,
            kind: ChangeKind::Put {
                value,
                expires_at_ms: ttl_ms.map(|t| now_ms.saturating_add(t)),
            },
        })
    }

    /// Remove `key`; the change and the value it removed.
    pub fn delete(
        &mut self,
        key: Bytes,
        cond: Cond,
        now_ms: u64,
    ) -> Result<(Change, Entry), CacheError> {
        let (change, old) = self.prepare_delete(key, cond, now_ms)?;
        self.apply(&change);
        Ok((change, old))
    }

    /// The change a delete would make and the value it would remove, not applied.
    pub fn prepare_delete(
        &self,
        key: Bytes,
        cond: Cond,
        now_ms: u64,
    ) -> Result<(Change, Entry), CacheError> {
        self.check(&key, cond, now_ms)?;
        let Some(old) = self.get(&key, now_ms).cloned() else {
            return Err(CacheError::NotFound);
        };
        let change = Change {
            offset: self.next_offset,
            key,
            kind: ChangeKind::Delete,
        };
        Ok((change, old))
    }

    /// Reclaim up to `max` keys whose expiry is at or before `now_ms`, each as an `Expire`
    /// change (in expiry, then key order).
    pub fn expire(&mut self, now_ms: u64, max: usize) -> Vec<Change> {
        let out = self.prepare_expire(now_ms, max);
        for c in &out {
            self.apply(c);
        }
        out
    }

    /// The Expire changes [`CacheShard::expire`] would make (at consecutive offsets), not
    /// applied.
    pub fn prepare_expire(&self, now_ms: u64, max: usize) -> Vec<Change> {
        self.expiry
            .iter()
            .take_while(|(t, _)| *t <= now_ms)
            .take(max)
            .enumerate()
            .map(|(i, (_, key))| Change {
                offset: self.next_offset + i as u64,
                key: key.clone(),
                kind: ChangeKind::Expire,
            })
            .collect()
    }

    /// When the next key expires, if any does.
    pub fn next_expiry_ms(&self) -> Option<u64> {
        self.expiry.first().map(|(t, _)| *t)
    }

    /// Apply one change at the next offset: what put/delete/expire do, and what replaying a
    /// recovered log does. Offsets must be contiguous (a gap in the log is a bug upstream).
    pub fn apply(&mut self, c: &Change) {
        assert_eq!(
            c.offset, self.next_offset,
            "cache changes are applied at contiguous offsets"
        );
        self.next_offset += 1;
        if let Some(old) = self.entries.remove(&c.key) {
            self.bytes -= entry_bytes(&c.key, &old);
            if let Some(t) = old.expires_at_ms {
                self.expiry.remove(&(t, c.key.clone()));
            }
        }
        if let ChangeKind::Put {
            value,
            expires_at_ms,
        } = &c.kind
        {
            let e = Entry {
                value: value.clone(),
                version: c.offset,
                expires_at_ms: *expires_at_ms,
            };
            self.bytes += entry_bytes(&c.key, &e);
            if let Some(t) = expires_at_ms {
                self.expiry.insert((*t, c.key.clone()));
            }
            self.entries.insert(c.key.clone(), e);
        }
    }

    /// Every entry (expired ones not yet reclaimed included), in key order: what a
    /// snapshot holds.
    pub fn entries(&self) -> impl Iterator<Item = (&Bytes, &Entry)> {
        self.entries.iter()
    }

    /// A shard holding exactly `entries` (as [`CacheShard::entries`] gave them) whose next
    /// change gets `next_offset`: the state a snapshot recorded. Caps are not applied (the
    /// state was accepted under them when it was written).
    pub fn restore(
        limits: CacheLimits,
        entries: Vec<(Bytes, Entry)>,
        next_offset: u64,
    ) -> CacheShard {
        let mut s = CacheShard::new(limits, next_offset);
        for (k, e) in entries {
            assert!(
                e.version < next_offset,
                "a restored version is below the next offset"
            );
            s.bytes += entry_bytes(&k, &e);
            if let Some(t) = e.expires_at_ms {
                s.expiry.insert((t, k.clone()));
            }
            s.entries.insert(k, e);
        }
        s
    }

    /// Skip offsets no change occupies (a log whose records were compacted away, or an
    /// in-memory cache starting above earlier incarnations' offsets).
    pub fn advance_to(&mut self, next_offset: u64) {
        assert!(next_offset >= self.next_offset, "offsets never go back");
        self.next_offset = next_offset;
    }

    /// The state phase of a watch on `filter` now.
    pub fn watch_start(&self, filter: &Filter, now_ms: u64) -> WatchStart {
        let matching: Box<dyn Iterator<Item = (&Bytes, &Entry)>> = match filter {
            Filter::Key(k) => Box::new(self.entries.get_key_value(k).into_iter()),
            Filter::Prefix(p) => Box::new(
                self.entries
                    .range(p.clone()..)
                    .take_while(move |(k, _)| k.starts_with(p)),
            ),
        };
        WatchStart {
            retained: matching
                .filter(|(_, e)| e.live(now_ms))
                .map(|(k, e)| (k.clone(), e.clone()))
                .collect(),
            live_from: self.next_offset,
        }
    }

    /// Whether the record at `offset` for `key` still holds the key's current value (a
    /// compaction keeps exactly these records, and the expiry/delete records after them).
    pub fn is_current(&self, key: &[u8], offset: u64) -> bool {
        self.entries.get(key).is_some_and(|e| e.version == offset)
    }
}

/// How a watch that resumes at `from` starts, given the offsets the log can still replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResumePlan {
    /// Replay the log from `from` and join live at the tail: no gap.
    Replay { from: u64 },
    /// `from` is below what compaction kept: answer with a marked snapshot of current values
    /// and continue live (never a silent gap).
    Snapshot,
    /// `from` is beyond the next offset: refused, naming the tail.
    BeyondTail { next_offset: u64 },
}

/// `replayable_from`: the lowest offset from which the log still holds every change (the
/// compaction floor).
pub fn plan_resume(from: u64, replayable_from: u64, next_offset: u64) -> ResumePlan {
    if from > next_offset {
        ResumePlan::BeyondTail { next_offset }
    } else if from < replayable_from {
        ResumePlan::Snapshot
    } else {
        ResumePlan::Replay { from }
    }
}

/// A watcher's bounded queue of events not yet sent. When an event would pass either cap
/// the watch ends, naming the offset to re-watch from (the first event it could not take):
/// a slow watcher never holds the writer and never silently skips a change. An empty queue
/// always takes one event, whatever its size, so a bound below one event cannot make a
/// watch that can never progress (each resume would lag at the same offset).
#[derive(Debug)]
pub struct WatchQueue {
    entries_max: usize,
    bytes_max: u64,
    queue: VecDeque<(u64, u64)>,
    bytes: u64,
    /// Set once the queue overflowed: the offset to resume from.
    ended_at: Option<u64>,
}

impl WatchQueue {
    pub fn new(entries_max: usize, bytes_max: u64) -> WatchQueue {
        WatchQueue {
            entries_max,
            bytes_max,
            queue: VecDeque::new(),
            bytes: 0,
            ended_at: None,
        }
    }

    /// The bounds granted: `(entries_max, bytes_max)`.
    pub fn bounds(&self) -> (usize, u64) {
        (self.entries_max, self.bytes_max)
    }

    /// Offer the event at `offset` of `bytes`; false (and ended) when it does not fit.
    pub fn offer(&mut self, offset: u64, bytes: u64) -> bool {
        if self.ended_at.is_some() {
            return false;
        }
        if let Some(&(last, _)) = self.queue.back() {
            assert!(offset > last, "watch events in offset order");
        }
        let full = self.queue.len() >= self.entries_max || self.bytes + bytes > self.bytes_max;
        if full && !self.queue.is_empty() {
            self.ended_at = Some(offset);
            return false;
        }
        self.queue.push_back((offset, bytes));
        self.bytes += bytes;
        true
    }

    /// The oldest queued event was sent.
    pub fn pop(&mut self) -> Option<u64> {
        let (o, b) = self.queue.pop_front()?;
        self.bytes -= b;
        Some(o)
    }

    /// The newest queued offset.
    pub fn last(&self) -> Option<u64> {
        self.queue.back().map(|(o, _)| *o)
    }

    /// Bytes queued (what the bytes bound counts).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The offset to re-watch from, once the queue overflowed.
    pub fn ended_at(&self) -> Option<u64> {
        self.ended_at
    }

    pub fn len(&self) -> usize {
        self.queue.len()
    }
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

/// Counters of one shard: a log of deltas folded into sums. `add` is at least once: an add
/// retried after a lost answer counts twice.
#[derive(Debug, Default)]
pub struct Counters {
    sums: BTreeMap<Bytes, i64>,
    next_offset: u64,
}

/// An add that would leave the i64 range.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("counter {sum} + {delta} overflows i64")]
pub struct CounterOverflow {
    pub sum: i64,
    pub delta: i64,
}

impl Counters {
    pub fn new(next_offset: u64) -> Counters {
        Counters {
            sums: BTreeMap::new(),
            next_offset,
        }
    }
    /// Add `delta`: the delta record's offset and the new sum.
    pub fn add(&mut self, name: Bytes, delta: i64) -> Result<(u64, i64), CounterOverflow> {
        let (offset, new) = self.prepare_add(&name, delta)?;
        self.apply(offset, name, delta);
        Ok((offset, new))
    }
    /// The offset and new sum an add would give, checked but not applied.
    pub fn prepare_add(&self, name: &[u8], delta: i64) -> Result<(u64, i64), CounterOverflow> {
        let sum = self.get(name);
        let new = sum
            .checked_add(delta)
            .ok_or(CounterOverflow { sum, delta })?;
        Ok((self.next_offset, new))
    }
    /// Replay one delta record (recovery), or a checkpoint's sum as a delta from zero.
    pub fn apply(&mut self, offset: u64, name: Bytes, delta: i64) {
        assert_eq!(offset, self.next_offset, "counter deltas are contiguous");
        self.next_offset += 1;
        let s = self.sums.entry(name).or_insert(0);
        *s = s.wrapping_add(delta);
    }
    pub fn get(&self, name: &[u8]) -> i64 {
        self.sums.get(name).copied().unwrap_or(0)
    }
    /// Counters held.
    pub fn len(&self) -> usize {
        self.sums.len()
    }
    pub fn is_empty(&self) -> bool {
        self.sums.is_empty()
    }
    /// Whether `name` has a sum (an add of 0 creates one).
    pub fn contains(&self, name: &[u8]) -> bool {
        self.sums.contains_key(name)
    }
    pub fn next_offset(&self) -> u64 {
        self.next_offset
    }
    /// Counters holding exactly `sums`, the next delta at `next_offset` (a snapshot's).
    pub fn restore(sums: Vec<(Bytes, i64)>, next_offset: u64) -> Counters {
        Counters {
            sums: sums.into_iter().collect(),
            next_offset,
        }
    }
    /// Every sum (a checkpoint: replaying these as deltas gives the same state).
    pub fn sums(&self) -> impl Iterator<Item = (&Bytes, i64)> {
        self.sums.iter().map(|(k, v)| (k, *v))
    }
}

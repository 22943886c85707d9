//! `keys.idx`: a log-backed cache shard's state at an offset, so opening does not replay the
//! whole log and compaction can delete the segments it covers (docs/storage-format.md,
//! "Cache records"). Pure codec, every field little-endian:
//!
//! ```text
//! magic "FXKI" | version u8 = 1 | 3 zero bytes
//! cache log id [16] | counter log id [16]
//! cache_next u64 | counters_next u64 | entry count u64 | counter count u64
//! entries:  key_len u16, key, version u64, expires_at_ms u64 (0 = never), value_len u32, value
//! counters: name_len u16, name, sum i64
//! crc32c u32 of every byte before it
//! ```
//!
//! The snapshot holds the state after every record below `cache_next` (and every delta below
//! `counters_next`); the logs continue from there. Decoding refuses, by type, a wrong magic or
//! version, a short or overlong body, a bad CRC, an empty key, and entries out of key order
//! or with a version at or beyond `cache_next`.

use super::Entry;
use bytes::Bytes;

const MAGIC: &[u8; 4] = b"FXKI";
const VERSION: u8 = 1;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub cache_log_id: [u8; 16],
    pub counter_log_id: [u8; 16],
    pub cache_next: u64,
    pub counters_next: u64,
    /// In key order.
    pub entries: Vec<(Bytes, Entry)>,
    /// In name order.
    pub counters: Vec<(Bytes, i64)>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    #[error("not a cache snapshot (magic {0:?})")]
    Magic([u8; 4]),
    #[error("cache snapshot version {0} is not 1")]
    Version(u8),
    #[error("cache snapshot is truncated at byte {0}")]
    Truncated(usize),
    #[error("cache snapshot CRC mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    Crc { stored: u32, computed: u32 },
    #[error("cache snapshot has {0} bytes after its CRC")]
    Trailing(usize),
    #[error("cache snapshot entry {0}: {1}")]
    Entry(u64, &'static str),
}

pub fn encode(s: &Snapshot) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&[VERSION, 0, 0, 0]);
    b.extend_from_slice(&s.cache_log_id);
    b.extend_from_slice(&s.counter_log_id);
    for v in [
        s.cache_next,
        s.counters_next,
        s.entries.len() as u64,
        s.counters.len() as u64,
    ] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    for (k, e) in &s.entries {
        b.extend_from_slice(&(k.len() as u16).to_le_bytes());
        b.extend_from_slice(k);
        b.extend_from_slice(&e.version.to_le_bytes());
        b.extend_from_slice(&e.expires_at_ms.unwrap_or(0).to_le_bytes());
        b.extend_from_slice(&(e.value.len() as u32).to_le_bytes());
        b.extend_from_slice(&e.value);
    }
    for (n, sum) in &s.counters {
        b.extend_from_slice(&(n.len() as u16).to_le_bytes());
        b.extend_from_slice(n);
        b.extend_from_slice(&sum.to_le_bytes());
    }
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

struct Cur<'a> {
    b: &'a Bytes,
    pos: usize,
    end: usize,
}

impl Cur<'_> {
    fn take(&mut self, n: usize) -> Result<Bytes, SnapshotError> {
        if self.end - self.pos < n {
            return Err(SnapshotError::Truncated(self.pos));
        }
        let out = self.b.slice(self.pos..self.pos + n);
        self.pos += n;
        Ok(out)
    }
    fn u16(&mut self) -> Result<u16, SnapshotError> {
        Ok(u16::from_le_bytes(self.take(2)?[..].try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32, SnapshotError> {
        Ok(u32::from_le_bytes(self.take(4)?[..].try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, SnapshotError> {
        Ok(u64::from_le_bytes(self.take(8)?[..].try_into().unwrap()))
    }
}

pub fn decode(b: &Bytes) -> Result<Snapshot, SnapshotError> {
    if b.len() < 8 {
        return Err(SnapshotError::Truncated(b.len()));
    }
    let magic: [u8; 4] = b[..4].try_into().unwrap();
    if &magic != MAGIC {
        return Err(SnapshotError::Magic(magic));
    }
    if b[4] != VERSION {
        return Err(SnapshotError::Version(b[4]));
    }
    if b.len() < 8 + 32 + 32 + 4 {
        return Err(SnapshotError::Truncated(b.len()));
    }
    // The CRC is checked before anything after the header is trusted.
    let body_end = b.len() - 4;
    let stored = u32::from_le_bytes(b[body_end..].try_into().unwrap());
    let computed = crc32c::crc32c(&b[..body_end]);
    if stored != computed {
        return Err(SnapshotError::Crc { stored, computed });
    }
    let mut c = Cur {
        b,
        pos: 8,
        end: body_end,
    };
    let cache_log_id: [u8; 16] = c.take(16)?[..].try_into().unwrap();
    let counter_log_id: [u8; 16] = c.take(16)?[..].try_into().unwrap();
    let cache_next = c.u64()?;
    let counters_next = c.u64()?;
    let n_entries = c.u64()?;
    let n_counters = c.u64()?;
    // Each entry takes at least 23 bytes and each counter 11: refuse counts the body cannot
    // hold before allocating for them.
    let left = (c.end - c.pos) as u64;
    if n_entries.saturating_mul(23) > left || n_counters.saturating_mul(11) > left {
        return Err(SnapshotError::Truncated(c.pos));
    }
    let mut entries: Vec<(Bytes, Entry)> = Vec::with_capacity(n_entries as usize);
    for i in 0..n_entries {
        let kl = c.u16()? as usize;
        let key = c.take(kl)?;
        let version = c.u64()?;
        let exp = c.u64()?;
        let vl = c.u32()? as usize;
        let value = c.take(vl)?;
        if key.is_empty() {
            return Err(SnapshotError::Entry(i, "empty key"));
        }
        if entries.last().is_some_and(|(k, _)| *k >= key) {
            return Err(SnapshotError::Entry(i, "keys out of order"));
        }
        if version >= cache_next {
            return Err(SnapshotError::Entry(
                i,
                "version at or beyond the snapshot's offset",
            ));
        }
        entries.push((
            key,
            Entry {
                value,
                version,
                expires_at_ms: (exp != 0).then_some(exp),
            },
        ));
    }
    let mut counters: Vec<(Bytes, i64)> = Vec::with_capacity(n_counters as usize);
    for i in 0..n_counters {
        let nl = c.u16()? as usize;
        let name = c.take(nl)?;
        let sum = c.u64()? as i64;
        if name.is_empty() || counters.last().is_some_and(|(n, _)| *n >= name) {
            return Err(SnapshotError::Entry(
                i,
                "counter names empty or out of order",
            ));
        }
        counters.push((name, sum));
    }
    if c.pos != c.end {
        return Err(SnapshotError::Trailing(c.end - c.pos));
    }
    Ok(Snapshot {
        cache_log_id,
        counter_log_id,
        cache_next,
        counters_next,
        entries,
        counters,
    })
}

//! Compact encoding of a group's durable part, checked by CRC32C.
//!
//! ```text
//! "FXGS" | version u8 = 1 | shard u32 LE | cursor u64 LE
//! | runs: varint n, then n × (varint gap, varint len-1)   finished offsets above the cursor
//! | dead: varint n, then n × (varint delta, varint attempts, u8 flags)
//! | crc32c u32 LE of every byte before it
//! ```
//! Varints are LEB128 (canonical, at most 10 bytes). A run starts `gap + 1` past the
//! previous run's end (the first: past the cursor), so runs never touch; a dead letter's
//! offset is `delta` (the first) or `previous + 1 + delta`. Flags: bits 0–1 the reason
//! (expired, nacked, rejected), bit 2 redriving, the rest zero.

use super::{DeadLetter, DeadLetterReason, TRACKED_LIMIT_RECORDS};

const MAGIC: &[u8; 4] = b"FXGS";
const VERSION: u8 = 1;
const HEADER: usize = 4 + 1 + 4 + 8;
/// Most finished offsets or dead letters a snapshot may name (window + dead-letter bounds).
pub const SNAPSHOT_ENTRIES_LIMIT: u64 = 2 * TRACKED_LIMIT_RECORDS as u64;

/// The durable part of one group on one shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSnapshot {
    pub shard: u32,
    pub cursor: u64,
    /// Finished offsets above the cursor (acked, discarded), ascending.
    pub finished: Vec<u64>,
    /// Ascending by offset.
    pub dead_letters: Vec<DeadLetter>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    #[error("group snapshot of {len} bytes is shorter than its header and checksum")]
    TooShort { len: usize },
    #[error(
        "group snapshot checksum {stored:#010x} does not match its contents ({computed:#010x})"
    )]
    Checksum { stored: u32, computed: u32 },
    #[error("not a group snapshot (bad magic)")]
    BadMagic,
    #[error("group snapshot version {0} is not supported")]
    UnsupportedVersion(u8),
    #[error("group snapshot ends inside an entry")]
    Truncated,
    #[error("malformed group snapshot: {0}")]
    Malformed(&'static str),
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn reason_code(r: DeadLetterReason) -> u8 {
    match r {
        DeadLetterReason::Expired => 0,
        DeadLetterReason::Nacked => 1,
        DeadLetterReason::Rejected => 2,
    }
}

impl GroupSnapshot {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + 16 + 4 * self.dead_letters.len());
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&self.shard.to_le_bytes());
        out.extend_from_slice(&self.cursor.to_le_bytes());
        let mut runs: Vec<(u64, u64)> = Vec::new(); // (start, end exclusive)
        for &o in &self.finished {
            assert!(o > self.cursor, "finished offsets lie above the cursor");
            match runs.last_mut() {
                Some((_, end)) if *end == o => *end += 1,
                Some((_, end)) => {
                    assert!(o > *end, "finished offsets ascend");
                    runs.push((o, o + 1));
                }
                None => runs.push((o, o + 1)),
            }
        }
        put_varint(&mut out, runs.len() as u64);
        let mut prev_end = self.cursor;
        for &(start, end) in &runs {
            put_varint(&mut out, start - prev_end - 1);
            put_varint(&mut out, end - start - 1);
            prev_end = end;
        }
        put_varint(&mut out, self.dead_letters.len() as u64);
        let mut prev: Option<u64> = None;
        for dl in &self.dead_letters {
            let delta = match prev {
                None => dl.offset,
                Some(p) => {
                    assert!(dl.offset > p, "dead letters ascend");
                    dl.offset - p - 1
                }
            };
            prev = Some(dl.offset);
            put_varint(&mut out, delta);
            put_varint(&mut out, dl.attempts as u64);
            out.push(reason_code(dl.reason) | if dl.redriving { 4 } else { 0 });
        }
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<GroupSnapshot, SnapshotError> {
        if bytes.len() < HEADER + 4 {
            return Err(SnapshotError::TooShort { len: bytes.len() });
        }
        let (body, crc) = bytes.split_at(bytes.len() - 4);
        let stored = u32::from_le_bytes(crc.try_into().unwrap());
        let computed = crc32c::crc32c(body);
        if stored != computed {
            return Err(SnapshotError::Checksum { stored, computed });
        }
        if &body[..4] != MAGIC {
            return Err(SnapshotError::BadMagic);
        }
        if body[4] != VERSION {
            return Err(SnapshotError::UnsupportedVersion(body[4]));
        }
        let shard = u32::from_le_bytes(body[5..9].try_into().unwrap());
        let cursor = u64::from_le_bytes(body[9..17].try_into().unwrap());
        let mut r = Reader {
            buf: &body[HEADER..],
        };
        let overflow = SnapshotError::Malformed("offset overflows u64");

        let n_runs = r.count()?;
        let mut finished = Vec::new();
        let mut prev_end = cursor;
        for _ in 0..n_runs {
            let gap = r.varint()?;
            let len = r.varint()?.checked_add(1).ok_or(overflow.clone())?;
            let start = prev_end
                .checked_add(1)
                .and_then(|s| s.checked_add(gap))
                .ok_or(overflow.clone())?;
            let end = start.checked_add(len).ok_or(overflow.clone())?;
            if finished.len() as u64 + len > SNAPSHOT_ENTRIES_LIMIT {
                return Err(SnapshotError::Malformed("too many finished offsets"));
            }
            finished.extend(start..end);
            prev_end = end;
        }

        let n_dead = r.count()?;
        let mut dead_letters: Vec<DeadLetter> = Vec::new();
        for _ in 0..n_dead {
            let delta = r.varint()?;
            let offset = match dead_letters.last() {
                None => delta,
                Some(p) => p
                    .offset
                    .checked_add(1)
                    .and_then(|o| o.checked_add(delta))
                    .ok_or(overflow.clone())?,
            };
            let attempts = r.varint()?;
            if attempts == 0 || attempts > u32::MAX as u64 {
                return Err(SnapshotError::Malformed(
                    "dead letter attempts outside 1..=u32",
                ));
            }
            let flags = r.byte()?;
            let reason = match flags & 3 {
                0 => DeadLetterReason::Expired,
                1 => DeadLetterReason::Nacked,
                2 => DeadLetterReason::Rejected,
                _ => return Err(SnapshotError::Malformed("unknown dead letter reason")),
            };
            if flags & !7 != 0 {
                return Err(SnapshotError::Malformed("unknown dead letter flags"));
            }
            if finished.binary_search(&offset).is_ok() {
                return Err(SnapshotError::Malformed("offset both finished and dead"));
            }
            dead_letters.push(DeadLetter {
                offset,
                attempts: attempts as u32,
                reason,
                redriving: flags & 4 != 0,
            });
        }
        if !r.buf.is_empty() {
            return Err(SnapshotError::Malformed("trailing bytes"));
        }
        Ok(GroupSnapshot {
            shard,
            cursor,
            finished,
            dead_letters,
        })
    }
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl Reader<'_> {
    fn byte(&mut self) -> Result<u8, SnapshotError> {
        let (&b, rest) = self.buf.split_first().ok_or(SnapshotError::Truncated)?;
        self.buf = rest;
        Ok(b)
    }

    fn varint(&mut self) -> Result<u64, SnapshotError> {
        let mut v: u64 = 0;
        for i in 0..10 {
            let b = self.byte()?;
            let bits = (b & 0x7f) as u64;
            if i == 9 && bits > 1 {
                return Err(SnapshotError::Malformed("varint overflows u64"));
            }
            v |= bits << (7 * i);
            if b & 0x80 == 0 {
                if i > 0 && b == 0 {
                    return Err(SnapshotError::Malformed("overlong varint"));
                }
                return Ok(v);
            }
        }
        Err(SnapshotError::Malformed("varint longer than 10 bytes"))
    }

    fn count(&mut self) -> Result<u64, SnapshotError> {
        let n = self.varint()?;
        if n > SNAPSHOT_ENTRIES_LIMIT {
            return Err(SnapshotError::Malformed("entry count beyond limit"));
        }
        Ok(n)
    }
}

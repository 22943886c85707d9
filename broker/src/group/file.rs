//! The file that holds one group of one shard: its settings and its durable part, written
//! whole (temporary file, fdatasync, rename, directory fsync) so a crash leaves either the
//! old or the new file, never a mix.
//!
//! ```text
//! "FXGF" | version u8 = 1
//! | max_attempts u32 | default_visibility_timeout_ms u64 | max_visibility_timeout_ms u64
//! | max_nack_delay_ms u64 | max_in_flight_records u32 | max_poll_records u32
//! | max_window_records u32 | max_dead_letters u32
//! | snapshot_len u32 | snapshot (see `snapshot`, itself checksummed)
//! | crc32c u32 LE of every byte before it
//! ```
//! The group's name is the file's name (`<group>.grp`), so it cannot disagree with it.

use super::{GroupConfig, GroupSnapshot, SnapshotError};

const MAGIC: &[u8; 4] = b"FXGF";
const VERSION: u8 = 1;
const FIXED: usize = 4 + 1 + 4 + 8 + 8 + 8 + 4 + 4 + 4 + 4 + 4;
/// File name suffix of group files.
pub const SUFFIX: &str = ".grp";

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GroupFileError {
    #[error("group file of {len} bytes is too short")]
    TooShort { len: usize },
    #[error("group file checksum {stored:#010x} does not match its contents ({computed:#010x})")]
    Checksum { stored: u32, computed: u32 },
    #[error("not a group file (bad magic)")]
    BadMagic,
    #[error("group file version {0} is not supported")]
    UnsupportedVersion(u8),
    #[error("group file snapshot length {0} does not match the file")]
    BadLength(u32),
    #[error("group file settings are invalid: {0}")]
    Config(String),
    #[error("group file snapshot: {0}")]
    Snapshot(#[from] SnapshotError),
}

pub fn encode(cfg: &GroupConfig, snap: &GroupSnapshot) -> Vec<u8> {
    let snap = snap.encode();
    let mut out = Vec::with_capacity(FIXED + snap.len() + 4);
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.extend_from_slice(&cfg.max_attempts.to_le_bytes());
    out.extend_from_slice(&cfg.default_visibility_timeout_ms.to_le_bytes());
    out.extend_from_slice(&cfg.max_visibility_timeout_ms.to_le_bytes());
    out.extend_from_slice(&cfg.max_nack_delay_ms.to_le_bytes());
    out.extend_from_slice(&cfg.max_in_flight_records.to_le_bytes());
    out.extend_from_slice(&cfg.max_poll_records.to_le_bytes());
    out.extend_from_slice(&cfg.max_window_records.to_le_bytes());
    out.extend_from_slice(&cfg.max_dead_letters.to_le_bytes());
    out.extend_from_slice(&(snap.len() as u32).to_le_bytes());
    out.extend_from_slice(&snap);
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

pub fn decode(b: &[u8]) -> Result<(GroupConfig, GroupSnapshot), GroupFileError> {
    if b.len() < FIXED + 4 {
        return Err(GroupFileError::TooShort { len: b.len() });
    }
    let (body, tail) = b.split_at(b.len() - 4);
    let stored = u32::from_le_bytes(tail.try_into().unwrap());
    let computed = crc32c::crc32c(body);
    if stored != computed {
        return Err(GroupFileError::Checksum { stored, computed });
    }
    if &body[..4] != MAGIC {
        return Err(GroupFileError::BadMagic);
    }
    if body[4] != VERSION {
        return Err(GroupFileError::UnsupportedVersion(body[4]));
    }
    let mut pos = 5;
    let mut take = |n: usize| {
        let s = &body[pos..pos + n];
        pos += n;
        s
    };
    let u32_ = |s: &[u8]| u32::from_le_bytes(s.try_into().unwrap());
    let u64_ = |s: &[u8]| u64::from_le_bytes(s.try_into().unwrap());
    let cfg = GroupConfig {
        max_attempts: u32_(take(4)),
        default_visibility_timeout_ms: u64_(take(8)),
        max_visibility_timeout_ms: u64_(take(8)),
        max_nack_delay_ms: u64_(take(8)),
        max_in_flight_records: u32_(take(4)),
        max_poll_records: u32_(take(4)),
        max_window_records: u32_(take(4)),
        max_dead_letters: u32_(take(4)),
    };
    let snap_len = u32_(take(4));
    debug_assert_eq!(pos, FIXED);
    if FIXED + snap_len as usize != body.len() {
        return Err(GroupFileError::BadLength(snap_len));
    }
    cfg.validate()
        .map_err(|e| GroupFileError::Config(e.to_string()))?;
    let snap = GroupSnapshot::decode(&body[FIXED..])?;
    Ok((cfg, snap))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::{DeadLetter, DeadLetterReason};

    fn sample() -> (GroupConfig, GroupSnapshot) {
        let cfg = GroupConfig {
            max_attempts: 7,
            default_visibility_timeout_ms: 1234,
            ..GroupConfig::default()
        };
        let snap = GroupSnapshot {
            shard: 3,
            cursor: 10,
            finished: vec![12, 13, 20],
            dead_letters: vec![DeadLetter {
                offset: 11,
                attempts: 7,
                reason: DeadLetterReason::Nacked,
                redriving: true,
            }],
        };
        (cfg, snap)
    }

    #[test]
    fn round_trips() {
        let (cfg, snap) = sample();
        assert_eq!(decode(&encode(&cfg, &snap)).unwrap(), (cfg, snap));
    }

    #[test]
    fn every_single_byte_corruption_and_every_cut_is_refused() {
        let (cfg, snap) = sample();
        let b = encode(&cfg, &snap);
        for i in 0..b.len() {
            let mut c = b.clone();
            c[i] ^= 0x5a;
            assert!(decode(&c).is_err(), "flip at {i} accepted");
        }
        for n in 0..b.len() {
            assert!(decode(&b[..n]).is_err(), "cut at {n} accepted");
        }
    }

    #[test]
    fn checksummed_but_invalid_settings_are_refused_by_type() {
        let (mut cfg, snap) = sample();
        cfg.max_attempts = 0;
        assert!(matches!(
            decode(&encode(&cfg, &snap)),
            Err(GroupFileError::Config(_))
        ));
    }
}

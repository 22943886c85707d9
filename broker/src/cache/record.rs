//! How a cache change is stored as one record of the shard's log (felix-storage records
//! carry a key, a flags byte whose only defined bit is `FLAG_TOMBSTONE`, and a payload;
//! docs/storage-format.md):
//!
//! | flags | kind | payload |
//! |---|---|---|
//! | 0 | put | expires_at_ms u64 LE (0 = never), then the value |
//! | tombstone | delete | empty |
//! | tombstone | expire | one byte, 1 |
//!
//! The record's key is the cache key. Deletes and expiries are both storage tombstones (a
//! compaction treats them alike); the payload byte tells them apart for watches. Anything
//! else is refused by type, never guessed.

use super::{Change, ChangeKind};
use bytes::Bytes;
use felix_storage::record::FLAG_TOMBSTONE;

pub const FLAG_PUT: u8 = 0;
/// Payload of an expire record (a delete's is empty).
const EXPIRE_MARK: u8 = 1;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("cache record flags {0} name no cache change")]
    UnknownFlags(u8),
    #[error("cache put record payload of {0} bytes is shorter than its expiry")]
    ShortPut(usize),
    #[error("cache tombstone record carries a payload that is neither empty (delete) nor the expire mark: {0} bytes")]
    BadTombstone(usize),
    #[error("cache record has an empty key")]
    EmptyKey,
}

/// `(key, flags, payload)` of a change's record.
pub fn encode(c: &Change) -> (Bytes, u8, Bytes) {
    match &c.kind {
        ChangeKind::Put {
            value,
            expires_at_ms,
        } => {
            let mut p = Vec::with_capacity(8 + value.len());
            p.extend_from_slice(&expires_at_ms.unwrap_or(0).to_le_bytes());
            p.extend_from_slice(value);
            (c.key.clone(), FLAG_PUT, Bytes::from(p))
        }
        ChangeKind::Delete => (c.key.clone(), FLAG_TOMBSTONE, Bytes::new()),
        ChangeKind::Expire => (
            c.key.clone(),
            FLAG_TOMBSTONE,
            Bytes::from_static(&[EXPIRE_MARK]),
        ),
    }
}

/// The change a record at `offset` holds.
pub fn decode(offset: u64, key: Bytes, flags: u8, payload: Bytes) -> Result<Change, RecordError> {
    if key.is_empty() {
        return Err(RecordError::EmptyKey);
    }
    let kind = match flags {
        FLAG_PUT => {
            if payload.len() < 8 {
                return Err(RecordError::ShortPut(payload.len()));
            }
            let t = u64::from_le_bytes(payload[..8].try_into().unwrap());
            ChangeKind::Put {
                value: payload.slice(8..),
                expires_at_ms: (t != 0).then_some(t),
            }
        }
        FLAG_TOMBSTONE => match &payload[..] {
            [] => ChangeKind::Delete,
            [EXPIRE_MARK] => ChangeKind::Expire,
            p => return Err(RecordError::BadTombstone(p.len())),
        },
        f => return Err(RecordError::UnknownFlags(f)),
    };
    Ok(Change { offset, key, kind })
}

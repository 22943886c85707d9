//! How a cache change is stored as one record of the shard's log (felix-storage records
//! carry a key, a flags byte and a payload; docs/storage-format.md):
//!
//! | flags | kind | payload |
//! |---|---|---|
//! | 0 | put | expires_at_ms u64 LE (0 = never), then the value |
//! | 1 | delete | empty |
//! | 2 | expire | empty |
//!
//! The record's key is the cache key. Anything else is refused by type, never guessed.

use super::{Change, ChangeKind};
use bytes::Bytes;

pub const FLAG_PUT: u8 = 0;
pub const FLAG_DELETE: u8 = 1;
pub const FLAG_EXPIRE: u8 = 2;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("cache record flags {0} name no cache change")]
    UnknownFlags(u8),
    #[error("cache put record payload of {0} bytes is shorter than its expiry")]
    ShortPut(usize),
    #[error("cache delete/expire record carries a {0}-byte payload")]
    PayloadOnRemoval(usize),
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
        ChangeKind::Delete => (c.key.clone(), FLAG_DELETE, Bytes::new()),
        ChangeKind::Expire => (c.key.clone(), FLAG_EXPIRE, Bytes::new()),
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
        FLAG_DELETE | FLAG_EXPIRE if !payload.is_empty() => {
            return Err(RecordError::PayloadOnRemoval(payload.len()))
        }
        FLAG_DELETE => ChangeKind::Delete,
        FLAG_EXPIRE => ChangeKind::Expire,
        f => return Err(RecordError::UnknownFlags(f)),
    };
    Ok(Change { offset, key, kind })
}

//! The on-disk record codec (pure; `docs/storage-format.md` documents it byte by byte).
//!
//! ```text
//! 0   len        u32  total record bytes, header included (28 + key_len + payload_len)
//! 4   crc32c     u32  CRC32C (Castagnoli) of bytes [8, len)
//! 8   offset     u64  the record's log offset
//! 16  ts_ms      u64  the append timestamp, milliseconds since the Unix epoch
//! 24  flags      u8   bit 0 = tombstone, bit 1 = generation start; other bits must be zero
//! 25  reserved   u8   zero
//! 26  key_len    u16
//! 28  key        key_len bytes
//! ..  payload    len - 28 - key_len bytes
//! ```
//! All integers little-endian. A `len` of zero is never a record: it marks padding (to the
//! next block) or the end of written data.

/// Bytes before the key.
pub const HEADER_BYTES: usize = 28;
/// Hard upper bound on one encoded record (header + key + payload).
pub const RECORD_BYTES_MAX: usize = 16 << 20;
/// Flag bit: the record deletes its key (used by caches).
pub const FLAG_TOMBSTONE: u8 = 0x01;
/// Flag bit: the generation-start record a new leader writes first (replication rule 6; no
/// key, no payload). It occupies an offset like any record.
pub const FLAG_GEN_START: u8 = 0x02;
const FLAGS_KNOWN: u8 = FLAG_TOMBSTONE | FLAG_GEN_START;

/// A record to append (offset and timestamp are assigned by the log).
#[derive(Debug, Clone, Copy)]
pub struct RecordIn<'a> {
    pub key: &'a [u8],
    pub payload: &'a [u8],
    pub flags: u8,
}

impl<'a> RecordIn<'a> {
    pub fn new(payload: &'a [u8]) -> Self {
        RecordIn {
            key: &[],
            payload,
            flags: 0,
        }
    }
    pub fn encoded_len(&self) -> usize {
        HEADER_BYTES + self.key.len() + self.payload.len()
    }
}

/// A decoded record borrowing the bytes it was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordRef<'a> {
    pub offset: u64,
    pub ts_ms: u64,
    pub flags: u8,
    pub key: &'a [u8],
    pub payload: &'a [u8],
    /// Total encoded length (the distance to the next record in the same commit).
    pub len: usize,
}

/// Why bytes at a position are not a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeError {
    /// `len` is zero: padding or end of data, not a record.
    Zero,
    /// Fewer bytes remain than the header or the declared length needs.
    Truncated,
    /// `len` is below the header size, above [`RECORD_BYTES_MAX`], or disagrees with key_len.
    BadLength,
    /// The CRC does not match the bytes.
    BadCrc,
    /// Unknown flag bits or a non-zero reserved byte (checked after the CRC).
    BadFlags,
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DecodeError::Zero => "zero length",
            DecodeError::Truncated => "truncated record",
            DecodeError::BadLength => "impossible length",
            DecodeError::BadCrc => "CRC mismatch",
            DecodeError::BadFlags => "unknown flags",
        })
    }
}

/// Append one encoded record to `out`.
///
/// Panics if the record exceeds [`RECORD_BYTES_MAX`] or the key exceeds `u16::MAX`: callers
/// validate sizes first (the log returns a typed error).
pub fn encode_into(out: &mut Vec<u8>, offset: u64, ts_ms: u64, rec: &RecordIn<'_>) {
    let len = rec.encoded_len();
    assert!(len <= RECORD_BYTES_MAX, "record of {len} bytes");
    assert!(rec.key.len() <= u16::MAX as usize, "key too long");
    assert_eq!(rec.flags & !FLAGS_KNOWN, 0, "unknown flags");
    let start = out.len();
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.extend_from_slice(&[0u8; 4]); // CRC, filled below
    out.extend_from_slice(&offset.to_le_bytes());
    out.extend_from_slice(&ts_ms.to_le_bytes());
    out.push(rec.flags);
    out.push(0);
    out.extend_from_slice(&(rec.key.len() as u16).to_le_bytes());
    out.extend_from_slice(rec.key);
    out.extend_from_slice(rec.payload);
    let crc = crc32c::crc32c(&out[start + 8..]);
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    debug_assert_eq!(out.len() - start, len);
}

fn u32_at(b: &[u8], p: usize) -> u32 {
    u32::from_le_bytes(b[p..p + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], p: usize) -> u64 {
    u64::from_le_bytes(b[p..p + 8].try_into().unwrap())
}

/// Decode the record starting at `bytes[pos..]`. The CRC is always verified.
pub fn decode_at(bytes: &[u8], pos: usize) -> Result<RecordRef<'_>, DecodeError> {
    let rest = bytes.get(pos..).unwrap_or(&[]);
    if rest.len() < 4 {
        return if rest.iter().all(|b| *b == 0) {
            Err(DecodeError::Zero)
        } else {
            Err(DecodeError::Truncated)
        };
    }
    let len = u32_at(rest, 0) as usize;
    if len == 0 {
        return Err(DecodeError::Zero);
    }
    if !(HEADER_BYTES..=RECORD_BYTES_MAX).contains(&len) {
        return Err(DecodeError::BadLength);
    }
    if rest.len() < len {
        return Err(DecodeError::Truncated);
    }
    let r = &rest[..len];
    let key_len = u16::from_le_bytes([r[26], r[27]]) as usize;
    if HEADER_BYTES + key_len > len {
        return Err(DecodeError::BadLength);
    }
    if crc32c::crc32c(&r[8..]) != u32_at(r, 4) {
        return Err(DecodeError::BadCrc);
    }
    if r[24] & !FLAGS_KNOWN != 0 || r[25] != 0 {
        return Err(DecodeError::BadFlags);
    }
    Ok(RecordRef {
        offset: u64_at(r, 8),
        ts_ms: u64_at(r, 16),
        flags: r[24],
        key: &r[HEADER_BYTES..HEADER_BYTES + key_len],
        payload: &r[HEADER_BYTES + key_len..],
        len,
    })
}

/// Peek the offset field of a would-be record without checking anything (for resync).
pub fn peek_offset(bytes: &[u8], pos: usize) -> Option<u64> {
    bytes
        .get(pos + 8..pos + 16)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn doc_vector() {
        // Pinned bytes: docs/storage-format.md shows this record; a change here is a format change.
        let mut out = Vec::new();
        encode_into(
            &mut out,
            7,
            1_700_000_000_000,
            &RecordIn {
                key: b"k",
                payload: b"hi",
                flags: 0,
            },
        );
        let hex: String = out.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex, "1f000000812c5ee907000000000000000068e5cf8b010000000001006b6869",
            "record vector changed: {hex}"
        );
    }

    proptest! {
        #[test]
        fn round_trip(offset: u64, ts: u64, tomb: bool,
                      key in proptest::collection::vec(any::<u8>(), 0..64),
                      payload in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut out = vec![0xAA; 3]; // records need not start at 0
            let rec = RecordIn { key: &key, payload: &payload, flags: if tomb { FLAG_TOMBSTONE } else { 0 } };
            encode_into(&mut out, offset, ts, &rec);
            let r = decode_at(&out, 3).unwrap();
            prop_assert_eq!(r.offset, offset);
            prop_assert_eq!(r.ts_ms, ts);
            prop_assert_eq!(r.key, &key[..]);
            prop_assert_eq!(r.payload, &payload[..]);
            prop_assert_eq!(r.len, out.len() - 3);
            prop_assert_eq!(r.flags & FLAG_TOMBSTONE != 0, tomb);
        }

        /// Any single flipped bit is detected (CRC32C catches all 1-bit errors; length and
        /// flag flips are caught by their own checks).
        #[test]
        fn every_bit_flip_is_detected(payload in proptest::collection::vec(any::<u8>(), 0..200), bit in 0usize..10_000) {
            let mut out = Vec::new();
            encode_into(&mut out, 42, 9, &RecordIn { key: b"key", payload: &payload, flags: 0 });
            let bit = bit % (out.len() * 8);
            out[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(decode_at(&out, 0).is_err());
        }

        #[test]
        fn every_truncation_is_detected(payload in proptest::collection::vec(1u8..=255, 0..200), cut in 1usize..400) {
            let mut out = Vec::new();
            encode_into(&mut out, 1, 2, &RecordIn::new(&payload));
            let cut = cut % out.len();
            prop_assert!(decode_at(&out[..cut], 0).is_err());
        }
    }

    #[test]
    fn zero_is_not_a_record() {
        assert_eq!(decode_at(&[0u8; 64], 0), Err(DecodeError::Zero));
        assert_eq!(decode_at(&[0u8; 2], 0), Err(DecodeError::Zero));
        assert_eq!(decode_at(&[], 0), Err(DecodeError::Zero));
        assert_eq!(decode_at(&[1, 0], 0), Err(DecodeError::Truncated));
    }
}

//! The routing-key hash, shared by clients, the broker and (later) caches.
//!
//! Algorithm: 64-bit FNV-1a (offset basis `0xcbf29ce484222325`, prime `0x100000001b3`) over
//! the key bytes; shard = hash mod shard count. Specified with vectors in docs/protocol.md,
//! so any client in any language routes a key to the same shard.

/// FNV-1a 64 offset basis (the seed).
pub const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a 64 prime.
pub const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// 64-bit FNV-1a of `bytes`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    fnv1a64_from(FNV_OFFSET_BASIS, bytes)
}

/// Continue an FNV-1a hash from a previous state.
pub fn fnv1a64_from(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// The shard a routing key maps to. `shards` must be non-zero.
pub fn shard_for_key(key: &[u8], shards: u32) -> u32 {
    assert!(shards > 0, "a stream has at least one shard");
    (fnv1a64(key) % shards as u64) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_reference_values() {
        // Published FNV-1a 64 reference values.
        assert_eq!(fnv1a64(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a64(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x85944171f73967e8);
    }

    #[test]
    fn shard_vectors_match_docs() {
        // The same table is in docs/protocol.md ("Routing-key hash").
        for (key, shards, want) in [
            (&b"user-1"[..], 4u32, fnv1a64(b"user-1") % 4),
            (b"", 4, 0xcbf29ce484222325 % 4),
            (b"a", 3, 0xaf63dc4c8601ec8c % 3),
            (b"foobar", 16, 0x85944171f73967e8 % 16),
        ] {
            assert_eq!(shard_for_key(key, shards) as u64, want);
        }
        assert_eq!(shard_for_key(b"a", 3), 1);
        assert_eq!(fnv1a64(b"user-1"), 0xf84ba2aa754a4bd4);
        assert_eq!(shard_for_key(b"user-1", 4), 0);
        assert_eq!(shard_for_key(b"foobar", 16), 8);
        assert_eq!(shard_for_key(b"", 4), 1);
    }
}

//! The subscription mux (`features::SUB_MUX`, frame `SubMux`): every subscription of a
//! connection whose queue policy is drop_new is delivered on one server-opened stream, each
//! frame naming the subscriptions it is for and wrapping what each of them would have got on
//! its own stream (a `Delivery`, a `Lag` or a `SubEnd`). A record delivered to the 1,000
//! subscriptions of a connection is one frame naming 1,000 ids, not 1,000 stream writes.

use super::{header_bytes, kind, Frame, Reader, WireError, HEADER_LEN};
use bytes::{BufMut, Bytes, BytesMut};

/// The kinds a `SubMux` may wrap: what a subscription stream carries after its `SubStream`.
pub fn wraps(inner_kind: u8) -> bool {
    matches!(inner_kind, kind::DELIVERY | kind::LAG | kind::SUB_END)
}

/// Bytes a `SubMux` head adds for `ids` subscriptions, beyond the wrapped frame's own header
/// and body (count, the ids, the inner kind).
pub fn overhead_bytes(ids: usize) -> usize {
    4 + 8 * ids + 1
}

/// The head of a `SubMux` naming `ids` around `inner_head`, the start of an encoded
/// subscription-stream frame (header included; for a delivery, its head without the records
/// region, which the caller sends after, shared). `head ++ rest of inner` is exactly the
/// `SubMux` frame's encoding.
pub fn encode_head(ids: &[u64], inner_head: &[u8]) -> Bytes {
    assert!(!ids.is_empty(), "a SubMux names at least one subscription");
    assert!(
        inner_head.len() >= HEADER_LEN,
        "an inner frame has a header"
    );
    let inner_kind = inner_head[3];
    assert!(
        wraps(inner_kind),
        "a SubMux wraps a subscription-stream frame"
    );
    let inner_len = u32::from_le_bytes(inner_head[6..10].try_into().expect("4 bytes")) as usize;
    let body_len = overhead_bytes(ids.len()) + inner_len;
    let mut b = BytesMut::with_capacity(HEADER_LEN + overhead_bytes(ids.len()) + inner_head.len());
    b.put_slice(&header_bytes(kind::SUB_MUX, 0, body_len));
    b.put_u32_le(ids.len() as u32);
    for id in ids {
        b.put_u64_le(*id);
    }
    b.put_u8(inner_kind);
    b.put_slice(&inner_head[HEADER_LEN..]);
    b.freeze()
}

/// Encode a `SubMux` body (not on the broker's hot path, which sends [`encode_head`] and the
/// shared records).
pub(super) fn encode_body(b: &mut BytesMut, ids: &[u64], inner: &Frame) {
    b.put_u32_le(ids.len() as u32);
    for id in ids {
        b.put_u64_le(*id);
    }
    b.put_u8(inner.kind());
    b.put_slice(&inner.encode()[HEADER_LEN..]);
}

/// Decode a `SubMux` body: at least one id, no id twice, a wrapped kind the mux carries.
pub(super) fn decode_body(r: &mut Reader) -> Result<Frame, WireError> {
    let ids = r.distinct_ids("subscription_count", "subscription_ids")?;
    let inner = r.u8("inner_kind")?;
    if !wraps(inner) {
        return Err(WireError::InvalidValue {
            field: "inner_kind",
            value: inner as u64,
        });
    }
    let rest = r.rest();
    Ok(Frame::SubMux {
        subscription_ids: ids,
        frame: Box::new(super::decode_body(inner, 0, rest)?),
    })
}

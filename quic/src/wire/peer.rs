//! Frames of the peer link between brokers (docs/protocol.md, "Peer links"). They travel only
//! on a broker's internal listener (`--peer-listen`, mutual TLS); a client connection that
//! sends one is refused with `invalid_request`.
//!
//! - `PeerHello` opens a link (first frame on its control stream): the dialing broker's node
//!   id, the cluster id it got from the control plane, its capability bits and its frame
//!   maximum. The listener checks that the node id is the one its TLS certificate names.
//! - `PeerHelloOk` answers it with the same fields of the listening broker.
//! - `Forward` carries one client request that the dialing broker does not own a shard of.
//!   It starts with the inner request's id (so a refusal of the forward itself names it), and
//!   names the stream (or cache) incarnation and the placement generation the forwarder
//!   routed by, the node it came from, the caller's principal (empty until auth) and the
//!   largest frame the caller takes. The
//!   owner refuses a mismatch and never forwards it again. The answer is the inner request's
//!   own answer frame, on the stream the forward came on, under the inner request's id.

use super::{put_str, Frame, Reader, WireError, HEADER_LEN};
use bytes::{BufMut, Bytes, BytesMut};

/// Frame kinds of this module (stable numbers, after the cache kinds).
pub mod kind {
    pub const PEER_HELLO: u8 = 45;
    pub const PEER_HELLO_OK: u8 = 46;
    pub const FORWARD: u8 = 47;
    pub const FIRST: u8 = PEER_HELLO;
    pub const LAST: u8 = FORWARD;
}

/// Capability bits of a peer link (negotiated: a feature is used only when both sides set it).
pub mod capabilities {
    /// Forwarded requests (`Forward`).
    pub const FORWARD: u64 = 1 << 0;
    /// Replica messages (`Replicate`, kind 52) on the link, from the dialer.
    pub const REPLICATION: u64 = 1 << 1;
    /// Every capability this build implements.
    pub const ALL: u64 = FORWARD | REPLICATION;
}

/// The lanes of a peer link: one QUIC stream each, opened by the dialing broker, with a
/// scheduling urgency (0 is sent first; quiche's default is 127). Replication traffic
/// (leases, fences, log shipping) must never wait behind a burst of forwarded publishes: a
/// starved lease is a false failover. Its lane is reserved here, at the top, before any of it
/// exists, and the peer transport is checked to leave it connection credit (below).
pub mod lanes {
    /// `PeerHello` and forwarded requests other than publishes (cache, group), at the
    /// default urgency.
    pub const CONTROL_STREAM: u64 = 0;
    /// Forwarded publishes.
    pub const PUBLISH_STREAM: u64 = 4;
    pub const PUBLISH_URGENCY: u8 = 200;
    /// Replication (the replication issue's traffic): served before everything else.
    pub const REPLICATION_STREAM: u64 = 8;
    pub const REPLICATION_URGENCY: u8 = 0;
    /// How many lanes a link has. A peer transport's connection window must hold every
    /// lane's stream window, so that a lane whose receiver stopped reading (an owner behind
    /// on forwarded publishes) can never take the credit another lane needs.
    pub const COUNT: u64 = 3;
}

/// What a forward is checked against at the owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardHead {
    /// The catalog revision that created the stream or cache the request names (its
    /// incarnation): a stream deleted and made again under the same name is another one.
    pub incarnation: u64,
    /// The placement generation of the shard the forwarder routed by.
    pub generation: u64,
    /// The node id of the forwarding broker.
    pub origin_node: u64,
    /// The caller's principal (empty: no auth yet; the auth issue fills it).
    pub principal: String,
    /// The largest frame the client takes (its Hello's `max_frame_bytes`): the owner sizes
    /// answers to it (group polls, dead-letter pages). 0: the link's own maximum.
    pub frame_bytes_max: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerFrame {
    PeerHello {
        node_id: u64,
        cluster_id: String,
        capabilities: u64,
        max_frame_bytes: u32,
    },
    PeerHelloOk {
        node_id: u64,
        cluster_id: String,
        capabilities: u64,
        max_frame_bytes: u32,
    },
    Forward {
        head: ForwardHead,
        /// The client's request, whole (a `Publish`, cache or group request).
        inner: Box<Frame>,
    },
}

impl PeerFrame {
    pub fn kind(&self) -> u8 {
        match self {
            PeerFrame::PeerHello { .. } => kind::PEER_HELLO,
            PeerFrame::PeerHelloOk { .. } => kind::PEER_HELLO_OK,
            PeerFrame::Forward { .. } => kind::FORWARD,
        }
    }

    pub(super) fn encode_body(&self, b: &mut BytesMut) {
        match self {
            PeerFrame::PeerHello {
                node_id,
                cluster_id,
                capabilities,
                max_frame_bytes,
            }
            | PeerFrame::PeerHelloOk {
                node_id,
                cluster_id,
                capabilities,
                max_frame_bytes,
            } => {
                b.put_u64_le(*node_id);
                put_str(b, cluster_id);
                b.put_u64_le(*capabilities);
                b.put_u32_le(*max_frame_bytes);
            }
            PeerFrame::Forward { head, inner } => forward_body(b, head, &inner.encode()),
        }
    }

    pub(super) fn decode(k: u8, r: &mut Reader) -> Result<PeerFrame, WireError> {
        Ok(match k {
            kind::PEER_HELLO | kind::PEER_HELLO_OK => {
                let node_id = r.u64("node_id")?;
                let cluster_id = r.string("cluster_id")?;
                let capabilities = r.u64("capabilities")?;
                let max_frame_bytes = r.u32("max_frame_bytes")?;
                if k == kind::PEER_HELLO {
                    PeerFrame::PeerHello {
                        node_id,
                        cluster_id,
                        capabilities,
                        max_frame_bytes,
                    }
                } else {
                    PeerFrame::PeerHelloOk {
                        node_id,
                        cluster_id,
                        capabilities,
                        max_frame_bytes,
                    }
                }
            }
            kind::FORWARD => {
                let id = r.u64("request_id")?;
                let head = ForwardHead {
                    incarnation: r.u64("incarnation")?,
                    generation: r.u64("generation")?,
                    origin_node: r.u64("origin_node")?,
                    principal: r.string("principal")?,
                    frame_bytes_max: r.u32("frame_bytes_max")?,
                };
                let n = r.u32("inner_bytes")? as usize;
                let inner = r.take(n, "inner")?;
                let inner = decode_inner(inner)?;
                if inner.request_id() != Some(id) {
                    return Err(WireError::InvalidValue {
                        field: "request_id",
                        value: id,
                    });
                }
                PeerFrame::Forward {
                    head,
                    inner: Box::new(inner),
                }
            }
            other => {
                return Err(WireError::InvalidValue {
                    field: "kind",
                    value: other as u64,
                })
            }
        })
    }
}

fn forward_body(b: &mut BytesMut, head: &ForwardHead, inner: &[u8]) {
    // The inner request's id first, as in every request: an owner that cannot take the
    // forward (too large, undecodable) refuses it under that id, so the forwarder can answer
    // its client instead of waiting out the deadline.
    let id = if inner.len() >= HEADER_LEN + 8 && super::has_request_id(inner[3]) {
        u64::from_le_bytes(
            inner[HEADER_LEN..HEADER_LEN + 8]
                .try_into()
                .expect("8 bytes"),
        )
    } else {
        0
    };
    b.put_u64_le(id);
    b.put_u64_le(head.incarnation);
    b.put_u64_le(head.generation);
    b.put_u64_le(head.origin_node);
    put_str(b, &head.principal);
    b.put_u32_le(head.frame_bytes_max);
    b.put_u32_le(inner.len() as u32);
    b.put_slice(inner);
}

/// A whole `Forward` frame around an already encoded request (a forwarder renames the
/// request's id on the link without decoding it again). Equal to encoding
/// `PeerFrame::Forward` of the decoded request.
pub fn encode_forward(head: &ForwardHead, inner: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(HEADER_LEN + 40 + head.principal.len() + inner.len());
    b.put_bytes(0, HEADER_LEN);
    forward_body(&mut b, head, inner);
    let len = b.len() - HEADER_LEN;
    b[..HEADER_LEN].copy_from_slice(&super::header_bytes(kind::FORWARD, 0, len));
    b.freeze()
}

/// The forwarded request: a whole frame of a kind a client may send (never another
/// `Forward`: a forward is not forwarded again, and nesting is refused here already).
fn decode_inner(buf: Bytes) -> Result<Frame, WireError> {
    if buf.len() < HEADER_LEN {
        return Err(WireError::Truncated {
            field: "inner_header",
            needed: HEADER_LEN - buf.len(),
        });
    }
    let (k, flags, len) = super::decode_header(
        buf[..HEADER_LEN].try_into().expect("checked length"),
        usize::MAX,
    )?;
    if (kind::FIRST..=kind::LAST).contains(&k) || k == super::replica::kind::REPLICATE {
        return Err(WireError::InvalidValue {
            field: "inner_kind",
            value: k as u64,
        });
    }
    if buf.len() - HEADER_LEN != len {
        return Err(WireError::InvalidValue {
            field: "inner_length",
            value: len as u64,
        });
    }
    super::decode_body(k, flags, buf.slice(HEADER_LEN..))
}

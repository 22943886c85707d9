//! Frame codec of Felix protocol v1 (see docs/protocol.md).
//!
//! Every frame is a 10-byte header followed by a body:
//! `magic "FX" | version u8 | kind u8 | flags u16 LE | length u32 LE | body[length]`.
//! Bodies are hand-laid little-endian. Decoders read the fields they know and ignore any
//! trailing bytes, so a newer peer may append fields; a newer message kind decodes as
//! [`Frame::Unknown`] and is skipped. New behaviour is only used once both sides announced
//! its feature bit in `Hello`/`HelloOk`.
//!
//! Record batches (publish and delivery) keep their records as one raw region of
//! `[len u32 LE][payload]` entries, so the broker re-frames a publish as a delivery without
//! touching payloads and one delivery frame is shared (as `Bytes`) by every subscriber.

pub mod auth;
pub mod cache;
pub mod error;
pub mod group;
pub mod hash;
pub mod peer;
pub mod replica;
pub mod streams;
pub mod submux;

pub use auth::AuthFrame;
pub use cache::{CacheFrame, EventKind, WatchFilter, WatchStart, WriteCond};
pub use error::{ErrorCode, Retry};
pub use group::{
    AnswerOp, ClaimId, ClaimIdError, ClaimRef, DeadLetterAction, DeadLetterRef, GroupFrame,
    GroupInfo, GroupRef,
};
pub use peer::{ForwardHead, PeerFrame};
pub use streams::{admit, admit_peer, answer_stream, kind_name, StreamClass, Verdict};

use bytes::{BufMut, Bytes, BytesMut};
use std::fmt;

/// Frame magic.
pub const MAGIC: [u8; 2] = *b"FX";
/// Protocol version spoken by this build.
pub const VERSION: u8 = 1;
/// Header length in bytes.
pub const HEADER_LEN: usize = 10;
/// Default maximum frame length (header + body).
pub const DEFAULT_MAX_FRAME_BYTES: usize = 16 * 1024 * 1024;
/// Per-record length prefix.
pub const RECORD_PREFIX_LEN: usize = 4;
/// Maximum length of a name (tenant, namespace, stream).
pub const NAME_BYTES_MAX: usize = 64;
/// Longest message an `Error`, `SubEnd` or `CacheWatchEnd` carries, bytes; longer text is cut
/// at a character boundary when encoded, so an error always fits the smallest frame a peer
/// may announce.
pub const MESSAGE_BYTES_MAX: usize = 1000;
/// Room a broker keeps above its largest record payload for the fields of the frame that
/// carries one record (a delivery, a cache event or value, a group record): a peer that
/// announces a `max_frame_bytes` below `max_payload_bytes + FRAME_OVERHEAD_BYTES` could not be
/// sent every record the broker accepts, and is refused at `Hello`.
pub const FRAME_OVERHEAD_BYTES: usize = 1024;

/// Feature bits negotiated at the handshake. Unknown bits are ignored.
pub mod features {
    /// Batched publish and delivery frames (always on in v1).
    pub const BATCH: u64 = 1 << 0;
    /// Lag notices on subscription streams (always on in v1).
    pub const LAG_NOTICE: u64 = 1 << 1;
    /// Every watch of a connection on one stream, each frame naming its watch ids
    /// (`CacheMux`); negotiated: a broker uses it only when the client's Hello asks for it.
    pub const WATCH_MUX: u64 = 1 << 2;
    /// `PublishAck` names the broker that owns the shard and wrote the records (`owner`), so
    /// a client of a cluster learns where to send that shard's publishes next.
    pub const OWNER_IN_ACK: u64 = 1 << 3;
    /// Every drop_new subscription of a connection on one stream, each frame naming its
    /// subscription ids (`SubMux`); negotiated: a broker uses it only when the client's Hello
    /// asks for it.
    pub const SUB_MUX: u64 = 1 << 4;
    /// Every feature this build implements.
    pub const ALL: u64 = BATCH | LAG_NOTICE | WATCH_MUX | OWNER_IN_ACK | SUB_MUX;
}

/// Frame kinds. Numbers are stable.
pub mod kind {
    pub const HELLO: u8 = 1;
    pub const HELLO_OK: u8 = 2;
    pub const PUBLISH: u8 = 3;
    pub const PUBLISH_ACK: u8 = 4;
    pub const ERROR: u8 = 5;
    pub const SUBSCRIBE: u8 = 6;
    pub const SUBSCRIBE_OK: u8 = 7;
    pub const SUB_STREAM: u8 = 8;
    pub const DELIVERY: u8 = 9;
    pub const LAG: u8 = 10;
    pub const UNSUBSCRIBE: u8 = 11;
    pub const SUB_END: u8 = 12;
    pub const DESCRIBE_STREAM: u8 = 13;
    pub const STREAM_INFO: u8 = 14;
    /// After the peer kinds (45..=47).
    pub const DESCRIBE_CLUSTER: u8 = 48;
    pub const CLUSTER_INFO: u8 = 49;
    /// The subscription mux's frame (`submux.rs`).
    pub const SUB_MUX: u8 = 53;
    pub const LAST: u8 = SUB_MUX;
}

/// A decode failure. Every malformed input maps to one of these; decoding never panics.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 2]),
    #[error("unsupported protocol version {0}")]
    UnsupportedVersion(u8),
    #[error("frame of {len} bytes exceeds the maximum of {max}")]
    FrameTooLarge { len: usize, max: usize },
    #[error("frame body truncated: needed {needed} more bytes in {field}")]
    Truncated { field: &'static str, needed: usize },
    #[error("field {field} has invalid value {value}")]
    InvalidValue { field: &'static str, value: u64 },
    #[error("field {0} is not UTF-8")]
    InvalidUtf8(&'static str),
    #[error("record region malformed: {0}")]
    InvalidRecords(&'static str),
}

impl WireError {
    /// The registry code a receiver answers with.
    pub fn code(&self) -> ErrorCode {
        match self {
            WireError::FrameTooLarge { .. } => ErrorCode::FrameTooLarge,
            WireError::UnsupportedVersion(_) => ErrorCode::UnsupportedVersion,
            _ => ErrorCode::InvalidFrame,
        }
    }
}

/// How a publish picks its shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardSelector {
    /// The broker picks round robin.
    RoundRobin,
    /// This exact shard.
    Shard(u32),
    /// Hash of this routing key (see [`hash::shard_for_key`]).
    Key(Bytes),
}

/// Where a subscription starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartAt {
    /// The next record appended after the subscription is registered.
    Latest,
    /// The oldest retained record.
    Earliest,
    /// This exact offset (clamped to what is retained, with a lag notice for the gap).
    Offset(u64),
}

/// Subscriber queue policy when the queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QueuePolicy {
    /// Drop the incoming batch (the subscriber keeps the oldest). Default.
    DropNew,
    /// Evict the oldest queued batches (the subscriber keeps the newest).
    DropOld,
    /// Hold the publisher (bounded by the publish timeout) until there is room.
    Block,
}

impl QueuePolicy {
    fn to_u8(self) -> u8 {
        match self {
            QueuePolicy::DropNew => 0,
            QueuePolicy::DropOld => 1,
            QueuePolicy::Block => 2,
        }
    }
    fn from_u8(v: u8) -> Result<Self, WireError> {
        Ok(match v {
            0 => QueuePolicy::DropNew,
            1 => QueuePolicy::DropOld,
            2 => QueuePolicy::Block,
            v => {
                return Err(WireError::InvalidValue {
                    field: "policy",
                    value: v as u64,
                })
            }
        })
    }
    /// Stable lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            QueuePolicy::DropNew => "drop_new",
            QueuePolicy::DropOld => "drop_old",
            QueuePolicy::Block => "block",
        }
    }
    /// Parse a name as printed by [`QueuePolicy::name`] (also accepts `dropnew`, `DropNew`...).
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().replace(['_', '-'], "").as_str() {
            "dropnew" => Some(QueuePolicy::DropNew),
            "dropold" => Some(QueuePolicy::DropOld),
            "block" => Some(QueuePolicy::Block),
            _ => None,
        }
    }
}

/// A stream address: every data-plane operation carries tenant and namespace.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamName {
    pub tenant: String,
    pub namespace: String,
    pub stream: String,
}

impl StreamName {
    pub fn new(tenant: &str, namespace: &str, stream: &str) -> Self {
        StreamName {
            tenant: tenant.into(),
            namespace: namespace.into(),
            stream: stream.into(),
        }
    }
}

impl fmt::Display for StreamName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.tenant, self.namespace, self.stream)
    }
}

/// Validate a tenant/namespace/stream name: 1..=64 bytes of `[A-Za-z0-9_.-]`, not starting
/// with `.` (one path segment, safe as a directory name and a URL segment).
pub fn validate_name(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > NAME_BYTES_MAX {
        return Err(format!(
            "name must be 1..={NAME_BYTES_MAX} bytes, got {}",
            s.len()
        ));
    }
    if s.starts_with('.') {
        return Err(format!("name {s:?} must not start with '.'"));
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
    {
        return Err(format!(
            "name {s:?} contains {c:?}; allowed: A-Z a-z 0-9 _ - ."
        ));
    }
    Ok(())
}

/// A validated raw record region: `count` entries of `[len u32 LE][payload]`.
#[derive(Clone, PartialEq, Eq)]
pub struct Records {
    count: u32,
    bytes: Bytes,
}

impl fmt::Debug for Records {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Records {{ count: {}, bytes: {} }}",
            self.count,
            self.bytes.len()
        )
    }
}

impl Records {
    /// Check that `bytes` holds exactly `count` well-formed entries.
    pub fn from_region(count: u32, bytes: Bytes) -> Result<Self, WireError> {
        let mut pos = 0usize;
        for _ in 0..count {
            if bytes.len() - pos < RECORD_PREFIX_LEN {
                return Err(WireError::InvalidRecords("record length prefix truncated"));
            }
            let len = u32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
            pos += RECORD_PREFIX_LEN;
            if bytes.len() - pos < len {
                return Err(WireError::InvalidRecords("record payload truncated"));
            }
            pos += len;
        }
        if pos != bytes.len() {
            return Err(WireError::InvalidRecords("bytes after the last record"));
        }
        Ok(Records { count, bytes })
    }

    /// Encode payloads into a region.
    pub fn encode<I, P>(payloads: I) -> Self
    where
        I: IntoIterator<Item = P>,
        P: AsRef<[u8]>,
    {
        let payloads: Vec<P> = payloads.into_iter().collect();
        let bytes: usize = payloads
            .iter()
            .map(|p| RECORD_PREFIX_LEN + p.as_ref().len())
            .sum();
        // Sized up front: growing from empty copied the region again at every doubling.
        let mut buf = BytesMut::with_capacity(bytes);
        let mut count = 0u32;
        for p in payloads {
            let p = p.as_ref();
            buf.put_u32_le(p.len() as u32);
            buf.put_slice(p);
            count += 1;
        }
        Records {
            count,
            bytes: buf.freeze(),
        }
    }

    pub fn empty() -> Self {
        Records {
            count: 0,
            bytes: Bytes::new(),
        }
    }
    pub fn count(&self) -> u32 {
        self.count
    }
    /// Bytes of the region including length prefixes.
    pub fn region_len(&self) -> usize {
        self.bytes.len()
    }
    /// The raw region (shared, no copy).
    pub fn region(&self) -> &Bytes {
        &self.bytes
    }
    /// Payload bytes excluding prefixes.
    pub fn payload_bytes(&self) -> usize {
        self.bytes.len() - RECORD_PREFIX_LEN * self.count as usize
    }
    /// Iterate payloads as zero-copy slices of the region.
    pub fn iter(&self) -> RecordIter {
        RecordIter {
            bytes: self.bytes.clone(),
            pos: 0,
        }
    }
    /// The largest single payload.
    pub fn max_payload(&self) -> usize {
        self.iter().map(|p| p.len()).max().unwrap_or(0)
    }
}

/// Iterator over payloads of a validated [`Records`] region.
pub struct RecordIter {
    bytes: Bytes,
    pos: usize,
}

impl Iterator for RecordIter {
    type Item = Bytes;
    fn next(&mut self) -> Option<Bytes> {
        if self.pos >= self.bytes.len() {
            return None;
        }
        // The region was validated at construction, so these slices are in bounds.
        let len =
            u32::from_le_bytes(self.bytes[self.pos..self.pos + 4].try_into().unwrap()) as usize;
        let start = self.pos + RECORD_PREFIX_LEN;
        self.pos = start + len;
        Some(self.bytes.slice(start..start + len))
    }
}

/// Limits a peer announces in its hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_frame_bytes: u32,
    pub max_payload_bytes: u32,
    pub max_subscriptions: u32,
    /// Longest cache key (and counter name) the broker takes, bytes (`cache_key_bytes_max`).
    pub max_key_bytes: u32,
}

/// Every Felix frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Hello {
        features: u64,
        max_frame_bytes: u32,
        client: String,
    },
    HelloOk {
        features: u64,
        limits: Limits,
        core: u16,
        server: String,
    },
    Publish {
        request_id: u64,
        stream: StreamName,
        shard: ShardSelector,
        /// Whether the publisher wants a `PublishAck`.
        ack: bool,
        records: Records,
    },
    PublishAck {
        request_id: u64,
        shard: u32,
        first_offset: u64,
        count: u32,
        /// Node id of the broker that owns the shard and wrote the records; 0 when not said
        /// (`OWNER_IN_ACK` not negotiated, or an older broker). Appended field, sent only
        /// when not 0.
        owner: u64,
    },
    Error {
        request_id: u64,
        code: u16,
        message: String,
    },
    Subscribe {
        request_id: u64,
        stream: StreamName,
        shard: u32,
        start: StartAt,
        policy: QueuePolicy,
        /// Queue bound in records; 0 = broker default.
        queue_records_max: u32,
        /// Queue bound in bytes; 0 = broker default.
        queue_bytes_max: u64,
    },
    SubscribeOk {
        request_id: u64,
        subscription_id: u64,
        shard: u32,
        next_offset: u64,
        /// The queue bound granted, records (the ask, or the broker's maximum when it asked
        /// for 0 or more).
        queue_records_max: u32,
        /// The queue bound granted, bytes.
        queue_bytes_max: u64,
    },
    /// First frame on a server-opened subscription stream: which subscription it carries.
    SubStream {
        subscription_id: u64,
    },
    /// A batch of consecutive records of one shard. Carries no per-subscription field, so one
    /// encoded frame is shared by every subscriber.
    Delivery {
        shard: u32,
        first_offset: u64,
        records: Records,
    },
    /// The subscriber lost `lost` records starting at `from_offset`; the next delivery starts
    /// at or after `from_offset + lost`.
    Lag {
        from_offset: u64,
        lost: u64,
    },
    Unsubscribe {
        request_id: u64,
        subscription_id: u64,
    },
    /// The subscription ended (last frame on its stream); `code` 0 means a normal end.
    SubEnd {
        subscription_id: u64,
        code: u16,
        message: String,
    },
    /// On the connection's subscription mux stream (`features::SUB_MUX`): `frame` (a
    /// `Delivery`, `Lag` or `SubEnd`) for each subscription named, in order.
    SubMux {
        subscription_ids: Vec<u64>,
        frame: Box<Frame>,
    },
    DescribeStream {
        request_id: u64,
        stream: StreamName,
    },
    StreamInfo {
        request_id: u64,
        shards: u32,
        durable: bool,
        /// Node id of each shard's owner broker as this broker's catalog has it (0: none, or
        /// standalone). Appended field: absent from older brokers (empty).
        owners: Vec<u64>,
    },
    /// Which brokers make up the cluster, as this broker's catalog has them.
    DescribeCluster {
        request_id: u64,
    },
    ClusterInfo {
        request_id: u64,
        /// The answering broker's node id.
        node_id: u64,
        /// Every registered broker (the answering one included): node id and the address
        /// clients dial.
        brokers: Vec<(u64, String)>,
    },
    /// Consumer-group requests and answers (kinds 15..=28, see [`group`]).
    Group(GroupFrame),
    /// Cache, watch and counter frames (kinds 29..=44, see [`cache`]).
    Cache(CacheFrame),
    /// Frames of the peer link between brokers (kinds 45..=47, see [`peer`]).
    Peer(PeerFrame),
    /// Authentication frames (kinds 50–51, see [`auth`]).
    Auth(AuthFrame),
    /// A replica message about one shard, and a shipment's records (kind 52, see
    /// [`replica`]; peer links only).
    Replicate {
        shard: replica::ShardRef,
        msg: replica::ReplicaMsg,
        records: Vec<replica::ShippedRecord>,
    },
    /// A kind this build does not know (from a newer peer); skipped by receivers.
    Unknown {
        kind: u8,
        flags: u16,
        body: Bytes,
    },
}

// ---------- encoding ----------

fn put_str(b: &mut BytesMut, s: &str) {
    let s = s.as_bytes();
    let n = s.len().min(u16::MAX as usize);
    b.put_u16_le(n as u16);
    b.put_slice(&s[..n]);
}

/// A message string, cut to [`MESSAGE_BYTES_MAX`] at a character boundary.
fn put_message(b: &mut BytesMut, s: &str) {
    let mut n = s.len().min(MESSAGE_BYTES_MAX);
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    put_str(b, &s[..n]);
}

fn put_stream(b: &mut BytesMut, s: &StreamName) {
    put_str(b, &s.tenant);
    put_str(b, &s.namespace);
    put_str(b, &s.stream);
}

/// A frame header: `magic | version | kind | flags LE | length LE`.
fn header_bytes(kind: u8, flags: u16, body_len: usize) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..2].copy_from_slice(&MAGIC);
    h[2] = VERSION;
    h[3] = kind;
    h[4..6].copy_from_slice(&flags.to_le_bytes());
    h[6..10].copy_from_slice(&(body_len as u32).to_le_bytes());
    h
}

/// Encode the header and fixed fields of a delivery frame; the record region follows it on
/// the wire unchanged, so the caller can send `head` and `records.region()` as two zero-copy
/// buffers. `head ++ region` is exactly `Frame::Delivery.encode()`.
pub fn encode_delivery_head(shard: u32, first_offset: u64, records: &Records) -> Bytes {
    let body_len = 4 + 8 + 4 + 4 + records.region_len();
    let mut b = BytesMut::with_capacity(HEADER_LEN + 20);
    b.put_slice(&header_bytes(kind::DELIVERY, 0, body_len));
    b.put_u32_le(shard);
    b.put_u64_le(first_offset);
    b.put_u32_le(records.count());
    b.put_u32_le(records.region_len() as u32);
    b.freeze()
}

impl Frame {
    /// The kind number of this frame.
    pub fn kind(&self) -> u8 {
        match self {
            Frame::Hello { .. } => kind::HELLO,
            Frame::HelloOk { .. } => kind::HELLO_OK,
            Frame::Publish { .. } => kind::PUBLISH,
            Frame::PublishAck { .. } => kind::PUBLISH_ACK,
            Frame::Error { .. } => kind::ERROR,
            Frame::Subscribe { .. } => kind::SUBSCRIBE,
            Frame::SubscribeOk { .. } => kind::SUBSCRIBE_OK,
            Frame::SubStream { .. } => kind::SUB_STREAM,
            Frame::Delivery { .. } => kind::DELIVERY,
            Frame::Lag { .. } => kind::LAG,
            Frame::Unsubscribe { .. } => kind::UNSUBSCRIBE,
            Frame::SubEnd { .. } => kind::SUB_END,
            Frame::SubMux { .. } => kind::SUB_MUX,
            Frame::DescribeStream { .. } => kind::DESCRIBE_STREAM,
            Frame::StreamInfo { .. } => kind::STREAM_INFO,
            Frame::DescribeCluster { .. } => kind::DESCRIBE_CLUSTER,
            Frame::ClusterInfo { .. } => kind::CLUSTER_INFO,
            Frame::Group(g) => g.kind(),
            Frame::Cache(c) => c.kind(),
            Frame::Peer(p) => p.kind(),
            Frame::Auth(a) => a.kind(),
            Frame::Replicate { .. } => replica::kind::REPLICATE,
            Frame::Unknown { kind, .. } => *kind,
        }
    }

    /// The request id this frame carries, for kinds that carry one (requests and answers).
    pub fn request_id(&self) -> Option<u64> {
        match self {
            Frame::Publish { request_id, .. }
            | Frame::PublishAck { request_id, .. }
            | Frame::Error { request_id, .. }
            | Frame::Subscribe { request_id, .. }
            | Frame::SubscribeOk { request_id, .. }
            | Frame::Unsubscribe { request_id, .. }
            | Frame::DescribeStream { request_id, .. }
            | Frame::StreamInfo { request_id, .. }
            | Frame::DescribeCluster { request_id }
            | Frame::ClusterInfo { request_id, .. } => Some(*request_id),
            Frame::Group(g) => Some(g.request_id()),
            Frame::Cache(c) => has_request_id(c.kind()).then(|| c.request_id()),
            // A forward is answered under its inner request's id.
            Frame::Peer(PeerFrame::Forward { inner, .. }) => inner.request_id(),
            Frame::Auth(a) => Some(a.request_id()),
            _ => None,
        }
    }

    /// Build an error frame from a registry code.
    pub fn error(request_id: u64, code: ErrorCode, message: impl Into<String>) -> Frame {
        Frame::Error {
            request_id,
            code: code.number(),
            message: message.into(),
        }
    }

    /// Encode header and body into one buffer.
    pub fn encode(&self) -> Bytes {
        self.encode_with(true)
    }

    /// The frame as byte strings to send in order, without copying the records of a publish
    /// or a delivery: the header and fixed fields, then the records region (shared, zero
    /// copy). Other frames are one buffer. Concatenated, the parts equal [`Frame::encode`].
    pub fn encode_parts(&self) -> (Bytes, Option<Bytes>) {
        match self {
            Frame::Publish { records, .. } if records.region_len() > 0 => {
                (self.encode_with(false), Some(records.region().clone()))
            }
            Frame::Delivery {
                shard,
                first_offset,
                records,
            } if records.region_len() > 0 => (
                encode_delivery_head(*shard, *first_offset, records),
                Some(records.region().clone()),
            ),
            _ => (self.encode(), None),
        }
    }

    /// `inline_records == false`: a publish's records region is left out of the buffer but
    /// counted in the header's length (the caller sends it after the buffer).
    fn encode_with(&self, inline_records: bool) -> Bytes {
        // One buffer, header first (patched at the end): no growth from an empty buffer and
        // no second copy of the body.
        let (records_len, left_out) = match self {
            Frame::Publish { records, .. } if inline_records => (records.region_len(), 0),
            Frame::Publish { records, .. } => (0, records.region_len()),
            _ => (0, 0),
        };
        let mut body = BytesMut::with_capacity(HEADER_LEN + 96 + records_len);
        body.put_bytes(0, HEADER_LEN);
        let mut flags = 0u16;
        match self {
            Frame::Hello {
                features,
                max_frame_bytes,
                client,
            } => {
                body.put_u64_le(*features);
                body.put_u32_le(*max_frame_bytes);
                put_str(&mut body, client);
            }
            Frame::HelloOk {
                features,
                limits,
                core,
                server,
            } => {
                body.put_u64_le(*features);
                body.put_u32_le(limits.max_frame_bytes);
                body.put_u32_le(limits.max_payload_bytes);
                body.put_u32_le(limits.max_subscriptions);
                body.put_u16_le(*core);
                put_str(&mut body, server);
                body.put_u32_le(limits.max_key_bytes);
            }
            Frame::Publish {
                request_id,
                stream,
                shard,
                ack,
                records,
            } => {
                body.put_u64_le(*request_id);
                put_stream(&mut body, stream);
                match shard {
                    ShardSelector::RoundRobin => body.put_u8(0),
                    ShardSelector::Shard(s) => {
                        body.put_u8(1);
                        body.put_u32_le(*s);
                    }
                    ShardSelector::Key(k) => {
                        body.put_u8(2);
                        let n = k.len().min(u16::MAX as usize);
                        body.put_u16_le(n as u16);
                        body.put_slice(&k[..n]);
                    }
                }
                body.put_u8(*ack as u8);
                body.put_u32_le(records.count());
                body.put_u32_le(records.region_len() as u32);
                if inline_records {
                    body.put_slice(records.region());
                }
            }
            Frame::PublishAck {
                request_id,
                shard,
                first_offset,
                count,
                owner,
            } => {
                body.put_u64_le(*request_id);
                body.put_u32_le(*shard);
                body.put_u64_le(*first_offset);
                body.put_u32_le(*count);
                if *owner != 0 {
                    body.put_u64_le(*owner);
                }
            }
            Frame::Error {
                request_id,
                code,
                message,
            } => {
                body.put_u64_le(*request_id);
                body.put_u16_le(*code);
                put_message(&mut body, message);
            }
            Frame::Subscribe {
                request_id,
                stream,
                shard,
                start,
                policy,
                queue_records_max,
                queue_bytes_max,
            } => {
                body.put_u64_le(*request_id);
                put_stream(&mut body, stream);
                body.put_u32_le(*shard);
                let (tag, off) = match start {
                    StartAt::Latest => (0u8, 0u64),
                    StartAt::Earliest => (1, 0),
                    StartAt::Offset(o) => (2, *o),
                };
                body.put_u8(tag);
                body.put_u64_le(off);
                body.put_u8(policy.to_u8());
                body.put_u32_le(*queue_records_max);
                body.put_u64_le(*queue_bytes_max);
            }
            Frame::SubscribeOk {
                request_id,
                subscription_id,
                shard,
                next_offset,
                queue_records_max,
                queue_bytes_max,
            } => {
                body.put_u64_le(*request_id);
                body.put_u64_le(*subscription_id);
                body.put_u32_le(*shard);
                body.put_u64_le(*next_offset);
                body.put_u32_le(*queue_records_max);
                body.put_u64_le(*queue_bytes_max);
            }
            Frame::SubStream { subscription_id } => body.put_u64_le(*subscription_id),
            Frame::Delivery {
                shard,
                first_offset,
                records,
            } => {
                let head = encode_delivery_head(*shard, *first_offset, records);
                let mut out = BytesMut::with_capacity(head.len() + records.region_len());
                out.put_slice(&head);
                out.put_slice(records.region());
                return out.freeze();
            }
            Frame::Lag { from_offset, lost } => {
                body.put_u64_le(*from_offset);
                body.put_u64_le(*lost);
            }
            Frame::Unsubscribe {
                request_id,
                subscription_id,
            } => {
                body.put_u64_le(*request_id);
                body.put_u64_le(*subscription_id);
            }
            Frame::SubEnd {
                subscription_id,
                code,
                message,
            } => {
                body.put_u64_le(*subscription_id);
                body.put_u16_le(*code);
                put_message(&mut body, message);
            }
            Frame::DescribeStream { request_id, stream } => {
                body.put_u64_le(*request_id);
                put_stream(&mut body, stream);
            }
            Frame::StreamInfo {
                request_id,
                shards,
                durable,
                owners,
            } => {
                body.put_u64_le(*request_id);
                body.put_u32_le(*shards);
                body.put_u8(*durable as u8);
                body.put_u32_le(owners.len() as u32);
                for o in owners {
                    body.put_u64_le(*o);
                }
            }
            Frame::DescribeCluster { request_id } => body.put_u64_le(*request_id),
            Frame::ClusterInfo {
                request_id,
                node_id,
                brokers,
            } => {
                body.put_u64_le(*request_id);
                body.put_u64_le(*node_id);
                body.put_u32_le(brokers.len() as u32);
                for (id, addr) in brokers {
                    body.put_u64_le(*id);
                    put_str(&mut body, addr);
                }
            }
            Frame::Group(g) => g.encode_body(&mut body),
            Frame::SubMux {
                subscription_ids,
                frame,
            } => submux::encode_body(&mut body, subscription_ids, frame),
            Frame::Cache(c) => c.encode_body(&mut body),
            Frame::Peer(p) => p.encode_body(&mut body),
            Frame::Auth(a) => a.encode_body(&mut body),
            Frame::Replicate {
                shard,
                msg,
                records,
            } => replica::encode_body(&mut body, shard, msg, records),
            Frame::Unknown {
                flags: f, body: b, ..
            } => {
                flags = *f;
                body.put_slice(b);
            }
        }
        let body_len = body.len() - HEADER_LEN + left_out;
        body[..HEADER_LEN].copy_from_slice(&header_bytes(self.kind(), flags, body_len));
        body.freeze()
    }
}

// ---------- decoding ----------

/// A bounds-checked little-endian reader over a body.
struct Reader {
    buf: Bytes,
    pos: usize,
}

impl Reader {
    /// A mux frame's ids: a count u32 (at least one), then that many u64, none twice.
    fn distinct_ids(
        &mut self,
        count_field: &'static str,
        ids_field: &'static str,
    ) -> Result<Vec<u64>, WireError> {
        let count = self.u32(count_field)? as usize;
        if count == 0 {
            return Err(WireError::InvalidValue {
                field: count_field,
                value: 0,
            });
        }
        // Bounded by the bytes present before anything is allocated.
        let raw = self.take(count.saturating_mul(8), ids_field)?;
        let ids: Vec<u64> = raw
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")))
            .collect();
        let mut seen = std::collections::HashSet::with_capacity(count);
        if let Some(dup) = ids.iter().find(|id| !seen.insert(**id)) {
            return Err(WireError::InvalidValue {
                field: ids_field,
                value: *dup,
            });
        }
        Ok(ids)
    }

    /// Everything not read yet.
    fn rest(&mut self) -> Bytes {
        let out = self.buf.slice(self.pos..);
        self.pos = self.buf.len();
        out
    }

    fn take(&mut self, n: usize, field: &'static str) -> Result<Bytes, WireError> {
        let left = self.buf.len() - self.pos;
        if left < n {
            return Err(WireError::Truncated {
                field,
                needed: n - left,
            });
        }
        let out = self.buf.slice(self.pos..self.pos + n);
        self.pos += n;
        Ok(out)
    }
    /// Bytes not read yet.
    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn u8(&mut self, f: &'static str) -> Result<u8, WireError> {
        Ok(self.take(1, f)?[0])
    }
    fn u16(&mut self, f: &'static str) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.take(2, f)?[..].try_into().unwrap()))
    }
    fn u32(&mut self, f: &'static str) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take(4, f)?[..].try_into().unwrap()))
    }
    fn u64(&mut self, f: &'static str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take(8, f)?[..].try_into().unwrap()))
    }
    /// A field a newer peer appends: read when present, else `default` (an older peer that
    /// does not send it still decodes).
    fn appended_u32(&mut self, f: &'static str, default: u32) -> Result<u32, WireError> {
        if self.buf.len() - self.pos >= 4 {
            self.u32(f)
        } else {
            Ok(default)
        }
    }
    fn appended_u64(&mut self, f: &'static str, default: u64) -> Result<u64, WireError> {
        if self.buf.len() - self.pos >= 8 {
            self.u64(f)
        } else {
            Ok(default)
        }
    }
    fn bool(&mut self, f: &'static str) -> Result<bool, WireError> {
        match self.u8(f)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(WireError::InvalidValue {
                field: f,
                value: v as u64,
            }),
        }
    }
    /// `n` items read by `item`; a count larger than the bytes left could hold is refused
    /// before anything is allocated for it (every item takes at least 8 bytes).
    fn list<T>(
        &mut self,
        n: u32,
        f: &'static str,
        mut item: impl FnMut(&mut Self) -> Result<T, WireError>,
    ) -> Result<Vec<T>, WireError> {
        let left = self.buf.len() - self.pos;
        if (n as usize).saturating_mul(8) > left {
            return Err(WireError::InvalidValue {
                field: f,
                value: n as u64,
            });
        }
        let mut out = Vec::with_capacity(n as usize);
        for _ in 0..n {
            out.push(item(self)?);
        }
        Ok(out)
    }
    fn string(&mut self, f: &'static str) -> Result<String, WireError> {
        let n = self.u16(f)? as usize;
        let b = self.take(n, f)?;
        String::from_utf8(b.to_vec()).map_err(|_| WireError::InvalidUtf8(f))
    }
    fn stream(&mut self) -> Result<StreamName, WireError> {
        Ok(StreamName {
            tenant: self.string("tenant")?,
            namespace: self.string("namespace")?,
            stream: self.string("stream")?,
        })
    }
    fn records(&mut self) -> Result<Records, WireError> {
        let count = self.u32("record_count")?;
        let len = self.u32("records_bytes")? as usize;
        let region = self.take(len, "records")?;
        Records::from_region(count, region)
    }
}

/// Parse a header; returns `(kind, flags, body_len)`.
pub fn decode_header(
    h: &[u8; HEADER_LEN],
    max_frame_bytes: usize,
) -> Result<(u8, u16, usize), WireError> {
    if h[0..2] != MAGIC {
        return Err(WireError::BadMagic([h[0], h[1]]));
    }
    if h[2] != VERSION {
        return Err(WireError::UnsupportedVersion(h[2]));
    }
    let flags = u16::from_le_bytes([h[4], h[5]]);
    let len = u32::from_le_bytes([h[6], h[7], h[8], h[9]]) as usize;
    if len.saturating_add(HEADER_LEN) > max_frame_bytes {
        return Err(WireError::FrameTooLarge {
            len: len + HEADER_LEN,
            max: max_frame_bytes,
        });
    }
    Ok((h[3], flags, len))
}

/// Decode a body of a known header.
pub fn decode_body(kind_: u8, flags: u16, body: Bytes) -> Result<Frame, WireError> {
    let mut r = Reader { buf: body, pos: 0 };
    let f = match kind_ {
        kind::HELLO => Frame::Hello {
            features: r.u64("features")?,
            max_frame_bytes: r.u32("max_frame_bytes")?,
            client: r.string("client")?,
        },
        kind::HELLO_OK => {
            let features = r.u64("features")?;
            let (max_frame_bytes, max_payload_bytes, max_subscriptions) = (
                r.u32("max_frame_bytes")?,
                r.u32("max_payload_bytes")?,
                r.u32("max_subscriptions")?,
            );
            let core = r.u16("core")?;
            let server = r.string("server")?;
            Frame::HelloOk {
                features,
                limits: Limits {
                    max_frame_bytes,
                    max_payload_bytes,
                    max_subscriptions,
                    max_key_bytes: r.appended_u32("max_key_bytes", u16::MAX as u32)?,
                },
                core,
                server,
            }
        }
        kind::PUBLISH => {
            let request_id = r.u64("request_id")?;
            let stream = r.stream()?;
            let shard = match r.u8("shard_selector")? {
                0 => ShardSelector::RoundRobin,
                1 => ShardSelector::Shard(r.u32("shard")?),
                2 => {
                    let n = r.u16("key")? as usize;
                    ShardSelector::Key(r.take(n, "key")?)
                }
                v => {
                    return Err(WireError::InvalidValue {
                        field: "shard_selector",
                        value: v as u64,
                    })
                }
            };
            let ack = r.bool("ack")?;
            let records = r.records()?;
            Frame::Publish {
                request_id,
                stream,
                shard,
                ack,
                records,
            }
        }
        kind::PUBLISH_ACK => Frame::PublishAck {
            request_id: r.u64("request_id")?,
            shard: r.u32("shard")?,
            first_offset: r.u64("first_offset")?,
            count: r.u32("count")?,
            owner: r.appended_u64("owner", 0)?,
        },
        kind::ERROR => Frame::Error {
            request_id: r.u64("request_id")?,
            code: r.u16("code")?,
            message: r.string("message")?,
        },
        kind::SUBSCRIBE => {
            let request_id = r.u64("request_id")?;
            let stream = r.stream()?;
            let shard = r.u32("shard")?;
            let tag = r.u8("start")?;
            let off = r.u64("start_offset")?;
            let start = match tag {
                0 => StartAt::Latest,
                1 => StartAt::Earliest,
                2 => StartAt::Offset(off),
                v => {
                    return Err(WireError::InvalidValue {
                        field: "start",
                        value: v as u64,
                    })
                }
            };
            Frame::Subscribe {
                request_id,
                stream,
                shard,
                start,
                policy: QueuePolicy::from_u8(r.u8("policy")?)?,
                queue_records_max: r.u32("queue_records_max")?,
                queue_bytes_max: r.u64("queue_bytes_max")?,
            }
        }
        kind::SUBSCRIBE_OK => Frame::SubscribeOk {
            request_id: r.u64("request_id")?,
            subscription_id: r.u64("subscription_id")?,
            shard: r.u32("shard")?,
            next_offset: r.u64("next_offset")?,
            queue_records_max: r.appended_u32("queue_records_max", 0)?,
            queue_bytes_max: r.appended_u64("queue_bytes_max", 0)?,
        },
        kind::SUB_STREAM => Frame::SubStream {
            subscription_id: r.u64("subscription_id")?,
        },
        kind::DELIVERY => Frame::Delivery {
            shard: r.u32("shard")?,
            first_offset: r.u64("first_offset")?,
            records: r.records()?,
        },
        kind::LAG => Frame::Lag {
            from_offset: r.u64("from_offset")?,
            lost: r.u64("lost")?,
        },
        kind::UNSUBSCRIBE => Frame::Unsubscribe {
            request_id: r.u64("request_id")?,
            subscription_id: r.u64("subscription_id")?,
        },
        kind::SUB_END => Frame::SubEnd {
            subscription_id: r.u64("subscription_id")?,
            code: r.u16("code")?,
            message: r.string("message")?,
        },
        kind::DESCRIBE_STREAM => Frame::DescribeStream {
            request_id: r.u64("request_id")?,
            stream: r.stream()?,
        },
        kind::STREAM_INFO => {
            let (request_id, shards, durable) =
                (r.u64("request_id")?, r.u32("shards")?, r.bool("durable")?);
            let n = r.appended_u32("owners", 0)?;
            let owners = r.list(n, "owners", |r| r.u64("owner"))?;
            Frame::StreamInfo {
                request_id,
                shards,
                durable,
                owners,
            }
        }
        kind::DESCRIBE_CLUSTER => Frame::DescribeCluster {
            request_id: r.u64("request_id")?,
        },
        kind::CLUSTER_INFO => {
            let (request_id, node_id) = (r.u64("request_id")?, r.u64("node_id")?);
            let n = r.u32("brokers")?;
            let brokers = r.list(n, "brokers", |r| {
                Ok((r.u64("node_id")?, r.string("quic_addr")?))
            })?;
            Frame::ClusterInfo {
                request_id,
                node_id,
                brokers,
            }
        }
        k @ group::kind::FIRST..=group::kind::LAST => Frame::Group(GroupFrame::decode(k, &mut r)?),
        k @ cache::kind::FIRST..=cache::kind::LAST => Frame::Cache(CacheFrame::decode(k, &mut r)?),
        k @ peer::kind::FIRST..=peer::kind::LAST => Frame::Peer(PeerFrame::decode(k, &mut r)?),
        k @ auth::kind::FIRST..=auth::kind::LAST => Frame::Auth(AuthFrame::decode(k, &mut r)?),
        kind::SUB_MUX => submux::decode_body(&mut r)?,
        replica::kind::REPLICATE => {
            let (shard, msg, records) = replica::decode_body(&mut r)?;
            Frame::Replicate {
                shard,
                msg,
                records,
            }
        }
        k => Frame::Unknown {
            kind: k,
            flags,
            body: r.buf,
        },
    };
    Ok(f)
}

/// Decode exactly one whole frame from `buf` (header + body; trailing bytes are an error).
pub fn decode_frame(buf: &[u8], max_frame_bytes: usize) -> Result<Frame, WireError> {
    if buf.len() < HEADER_LEN {
        return Err(WireError::Truncated {
            field: "header",
            needed: HEADER_LEN - buf.len(),
        });
    }
    let (k, flags, len) = decode_header(buf[..HEADER_LEN].try_into().unwrap(), max_frame_bytes)?;
    let body = &buf[HEADER_LEN..];
    if body.len() < len {
        return Err(WireError::Truncated {
            field: "body",
            needed: len - body.len(),
        });
    }
    if body.len() > len {
        return Err(WireError::InvalidValue {
            field: "frame_length",
            value: len as u64,
        });
    }
    decode_body(k, flags, Bytes::copy_from_slice(body))
}

/// Whether the body of frames of `kind` starts with `request_id u64` (every request and every
/// answer to one), so a receiver that cannot decode the rest can still name the request.
pub fn has_request_id(kind: u8) -> bool {
    match kind {
        kind::PUBLISH
        | kind::PUBLISH_ACK
        | kind::ERROR
        | kind::SUBSCRIBE
        | kind::SUBSCRIBE_OK
        | kind::UNSUBSCRIBE
        | kind::DESCRIBE_STREAM
        | kind::STREAM_INFO
        | kind::DESCRIBE_CLUSTER
        | kind::CLUSTER_INFO
        | peer::kind::FORWARD
        | auth::kind::AUTHENTICATE
        | auth::kind::AUTHENTICATED => true,
        group::kind::FIRST..=group::kind::LAST => true,
        k @ cache::kind::FIRST..=cache::kind::LAST => !matches!(
            k,
            cache::kind::CACHE_EVENT
                | cache::kind::CACHE_STATE_DONE
                | cache::kind::CACHE_WATCH_END
                | cache::kind::CACHE_MUX
        ),
        _ => false,
    }
}

/// Rewrite the request id of an encoded frame whose kind starts its body with one
/// ([`has_request_id`]): a broker that forwards a request renames it on the link and gives
/// the answer back its client's id. False (and nothing written) for other kinds.
pub fn patch_request_id(frame: &mut [u8], id: u64) -> bool {
    if frame.len() < HEADER_LEN + 8 || !has_request_id(frame[3]) {
        return false;
    }
    frame[HEADER_LEN..HEADER_LEN + 8].copy_from_slice(&id.to_le_bytes());
    true
}

/// A frame that could not be taken off a stream, with what was learnt of it first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameError {
    pub error: WireError,
    /// The header's kind, once the header was read.
    pub kind: Option<u8>,
    /// The frame's request id, when its kind starts with one and those 8 bytes arrived.
    pub request_id: Option<u64>,
    /// The framing is lost (bad magic or version): nothing more on the stream can be read.
    /// Otherwise the frame's length was known, the frame was skipped, and the stream goes on.
    pub fatal: bool,
    /// The stream finished inside a frame (set by the connection at the stream's end).
    pub truncated_at_end: bool,
}

impl FrameError {
    fn fatal(error: WireError) -> Self {
        FrameError {
            error,
            kind: None,
            request_id: None,
            fatal: true,
            truncated_at_end: false,
        }
    }
}

/// Incremental decoder for one QUIC stream: push bytes as they arrive, pull whole frames.
///
/// A frame whose body does not decode is skipped (its length is known) and reported with its
/// kind and request id; the stream goes on. A frame longer than the maximum is reported as
/// soon as its header and request id are in, and its body is then discarded as it arrives,
/// never buffered. Only a header that is not Felix framing (bad magic or version) ends the
/// stream: nothing after it can be delimited.
#[derive(Debug)]
pub struct FrameReader {
    buf: BytesMut,
    max_frame_bytes: usize,
    /// Bytes of a refused (oversized) frame still to discard.
    skip_bytes: u64,
    /// Framing was lost: everything pushed is dropped.
    broken: bool,
}

impl FrameReader {
    pub fn new(max_frame_bytes: usize) -> Self {
        FrameReader {
            buf: BytesMut::new(),
            max_frame_bytes,
            skip_bytes: 0,
            broken: false,
        }
    }
    /// Append received bytes.
    pub fn push(&mut self, data: &[u8]) {
        if self.broken {
            return;
        }
        // Discard an oversized frame's body as it arrives rather than buffering it.
        let skip = (self.skip_bytes.min(data.len() as u64)) as usize;
        self.skip_bytes -= skip as u64;
        self.buf.extend_from_slice(&data[skip..]);
    }
    /// Bytes buffered but not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }
    /// Whether bytes of a frame not yet whole are buffered (at a stream's end: a truncated
    /// frame). The rest of a refused frame being discarded does not count: it was answered.
    pub fn mid_frame(&self) -> bool {
        !self.broken && !self.buf.is_empty()
    }
    /// Next whole frame, `Ok(None)` if more bytes are needed. After a fatal error the reader
    /// drops everything (the caller stops the stream).
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        if self.broken || self.buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let h: [u8; HEADER_LEN] = self.buf[..HEADER_LEN].try_into().unwrap();
        let (k, flags, len) = match decode_header(&h, self.max_frame_bytes) {
            Ok(v) => v,
            Err(error @ WireError::FrameTooLarge { .. }) => return self.refuse_oversized(error),
            Err(error) => {
                self.broken = true;
                self.buf = BytesMut::new();
                return Err(FrameError::fatal(error));
            }
        };
        if self.buf.len() < HEADER_LEN + len {
            self.buf.reserve(HEADER_LEN + len - self.buf.len());
            return Ok(None);
        }
        let mut frame = self.buf.split_to(HEADER_LEN + len);
        let body = frame.split_off(HEADER_LEN).freeze();
        let request_id = (has_request_id(k) && body.len() >= 8)
            .then(|| u64::from_le_bytes(body[..8].try_into().unwrap()));
        decode_body(k, flags, body)
            .map(Some)
            .map_err(|error| FrameError {
                error,
                kind: Some(k),
                request_id,
                fatal: false,
                truncated_at_end: false,
            })
    }

    /// The header in `buf` declares a frame over the maximum: report it once its request id
    /// (if its kind has one) is in, then drop the header and discard the body.
    fn refuse_oversized(&mut self, error: WireError) -> Result<Option<Frame>, FrameError> {
        let k = self.buf[3];
        let len = u32::from_le_bytes(self.buf[6..10].try_into().unwrap()) as u64;
        let request_id = if has_request_id(k) && len >= 8 {
            if self.buf.len() < HEADER_LEN + 8 {
                return Ok(None);
            }
            Some(u64::from_le_bytes(
                self.buf[HEADER_LEN..HEADER_LEN + 8].try_into().unwrap(),
            ))
        } else {
            None
        };
        let _ = self.buf.split_to(HEADER_LEN);
        let take = (len.min(self.buf.len() as u64)) as usize;
        let _ = self.buf.split_to(take);
        self.skip_bytes = len - take as u64;
        Err(FrameError {
            error,
            kind: Some(k),
            request_id,
            fatal: false,
            truncated_at_end: false,
        })
    }
}

#[cfg(test)]
mod tests;

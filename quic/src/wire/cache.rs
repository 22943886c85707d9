//! Cache, watch and counter frames (docs/protocol.md, "Caches"). A request names its cache
//! by `(tenant, namespace, cache)` (a [`StreamName`] whose third part is the cache name);
//! the broker hashes the key (or counter name) to a shard with
//! [`super::hash::shard_for_key`]. Answers come on the request's stream, or an `Error` with
//! the same `request_id`.
//!
//! | request | answer |
//! |---|---|
//! | `CachePut` | `CacheWritten` (the version = offset of the write) |
//! | `CacheGet` | `CacheValue` (`found = false` when the key has no live value) |
//! | `CacheDelete` | `CacheValue` (the value it removed, and the delete's own offset) |
//! | `CounterAdd`, `CounterGet` | `CounterValue` |
//! | `DescribeCache` | `CacheInfo` |
//! | `CacheWatch` | `CacheWatchOk` naming the watch id |
//!
//! A watch is delivered like a subscription: on a server-opened unidirectional stream whose
//! first frame is `SubStream { subscription_id: watch id }`, then `CacheEvent`s, one
//! `CacheStateDone` when the watch asked for current state (or got a snapshot), and a last
//! `CacheWatchEnd`. `Unsubscribe` with the watch id ends it (`CacheWatchEnd` code 0). Watch
//! ids and subscription ids share one space per connection, and both count toward
//! `max_subscriptions`. Event frames carry no per-watch field: one encoded event is shared by
//! every watcher of a core.
//!
//! With the `WATCH_MUX` feature negotiated, every watch of a connection is delivered on one
//! server-opened unidirectional stream (no `SubStream` first): each frame on it is a
//! `CacheMux` naming the watch ids it is for, wrapping a `CacheEvent`, `CacheStateDone` or
//! `CacheWatchEnd`. One event then costs one frame per connection, not one per watcher.

use super::{put_message, put_stream, Reader, StreamName, WireError};
use bytes::{BufMut, Bytes, BytesMut};

/// Frame kinds of this module (stable numbers, after the group kinds).
pub mod kind {
    pub const CACHE_PUT: u8 = 29;
    pub const CACHE_GET: u8 = 30;
    pub const CACHE_DELETE: u8 = 31;
    pub const CACHE_VALUE: u8 = 32;
    pub const CACHE_WRITTEN: u8 = 33;
    pub const CACHE_WATCH: u8 = 34;
    pub const CACHE_WATCH_OK: u8 = 35;
    pub const CACHE_EVENT: u8 = 36;
    pub const CACHE_STATE_DONE: u8 = 37;
    pub const CACHE_WATCH_END: u8 = 38;
    pub const COUNTER_ADD: u8 = 39;
    pub const COUNTER_GET: u8 = 40;
    pub const COUNTER_VALUE: u8 = 41;
    pub const DESCRIBE_CACHE: u8 = 42;
    pub const CACHE_INFO: u8 = 43;
    pub const CACHE_MUX: u8 = 44;
    pub const FIRST: u8 = CACHE_PUT;
    pub const LAST: u8 = CACHE_MUX;
}

/// The condition of a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteCond {
    Always,
    /// Only if the key's current version is exactly this.
    Version(u64),
    /// Only if the key has no live value.
    Absent,
}

/// What a watch follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchFilter {
    /// One key (the broker picks its shard).
    Key(Bytes),
    /// Every key with this prefix on one shard (a prefix spans shards: watch each).
    Prefix { prefix: Bytes, shard: u32 },
}

/// Where a watch starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchStart {
    /// Changes after the watch is registered.
    Latest,
    /// The matching keys' current values (retained events), a `CacheStateDone`, then changes.
    Current,
    /// Every change from this offset (resume); below what the shard can replay, a marked
    /// snapshot of current values instead (`CacheStateDone { snapshot: true }`).
    Offset(u64),
}

/// The kind of a watch event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// A key's current value in the state phase (its offset is the key's version).
    Retained,
    Put,
    Delete,
    Expire,
}

impl EventKind {
    fn to_u8(self) -> u8 {
        match self {
            EventKind::Retained => 0,
            EventKind::Put => 1,
            EventKind::Delete => 2,
            EventKind::Expire => 3,
        }
    }
    fn from_u8(v: u8) -> Result<Self, WireError> {
        Ok(match v {
            0 => EventKind::Retained,
            1 => EventKind::Put,
            2 => EventKind::Delete,
            3 => EventKind::Expire,
            v => {
                return Err(WireError::InvalidValue {
                    field: "event_kind",
                    value: v as u64,
                })
            }
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheFrame {
    CachePut {
        request_id: u64,
        cache: StreamName,
        key: Bytes,
        value: Bytes,
        /// Time to live from now; 0 = the cache's default (none if it has none).
        ttl_ms: u64,
        cond: WriteCond,
    },
    CacheGet {
        request_id: u64,
        cache: StreamName,
        key: Bytes,
    },
    CacheDelete {
        request_id: u64,
        cache: StreamName,
        key: Bytes,
        cond: WriteCond,
    },
    CacheValue {
        request_id: u64,
        shard: u32,
        found: bool,
        version: u64,
        /// For a delete: the offset of the delete itself (0 for a get).
        change_offset: u64,
        /// Absolute expiry, wall-clock ms since the Unix epoch; 0 = never.
        expires_at_ms: u64,
        value: Bytes,
    },
    CacheWritten {
        request_id: u64,
        shard: u32,
        version: u64,
        expires_at_ms: u64,
    },
    CacheWatch {
        request_id: u64,
        cache: StreamName,
        filter: WatchFilter,
        start: WatchStart,
        /// Queue bound in events; 0 = broker default.
        queue_events_max: u32,
        /// Queue bound in bytes; 0 = broker default.
        queue_bytes_max: u64,
    },
    CacheWatchOk {
        request_id: u64,
        watch_id: u64,
        shard: u32,
        /// The offset of the first live change this watch can receive.
        live_from: u64,
        /// The queue bound granted, events (the ask, or the broker's maximum when it asked
        /// for 0 or more).
        queue_events_max: u32,
        /// The queue bound granted, bytes.
        queue_bytes_max: u64,
    },
    CacheEvent {
        kind: EventKind,
        offset: u64,
        key: Bytes,
        expires_at_ms: u64,
        /// Empty for deletes and expiries.
        value: Bytes,
    },
    /// The state phase is over: `count` retained events were sent (0 is a definite "no
    /// matching key"); `snapshot` when they replace a replay the shard could not give.
    CacheStateDone {
        count: u64,
        snapshot: bool,
        live_from: u64,
    },
    /// Last frame of a watch. `code` 0 is a normal end; otherwise `resume_from` is the
    /// offset to watch again from (nothing at or after it was delivered).
    CacheWatchEnd {
        code: u16,
        resume_from: u64,
        message: String,
    },
    /// A watch frame (`CacheEvent`, `CacheStateDone` or `CacheWatchEnd`) for each watch named
    /// (`WATCH_MUX`): on the wire `count u32 | watch ids u64 × count | inner kind u8 | inner
    /// body`. At least one id, none repeated.
    CacheMux {
        watch_ids: Vec<u64>,
        frame: Box<CacheFrame>,
    },
    CounterAdd {
        request_id: u64,
        cache: StreamName,
        name: Bytes,
        delta: i64,
    },
    CounterGet {
        request_id: u64,
        cache: StreamName,
        name: Bytes,
    },
    CounterValue {
        request_id: u64,
        shard: u32,
        sum: i64,
        /// add: the delta's offset; get: the counter log's next offset (every delta below it
        /// is in the sum).
        offset: u64,
    },
    DescribeCache {
        request_id: u64,
        cache: StreamName,
    },
    CacheInfo {
        request_id: u64,
        shards: u32,
        durable: bool,
        /// The cache's default TTL; 0 = none.
        default_ttl_ms: u64,
        /// Node id of each shard's owner broker (0: none); appended, empty from an older
        /// broker.
        owners: Vec<u64>,
    },
}

fn put_key(b: &mut BytesMut, k: &[u8]) {
    let n = k.len().min(u16::MAX as usize);
    b.put_u16_le(n as u16);
    b.put_slice(&k[..n]);
}

fn put_value(b: &mut BytesMut, v: &[u8]) {
    b.put_u32_le(v.len() as u32);
    b.put_slice(v);
}

fn put_cond(b: &mut BytesMut, c: &WriteCond) {
    let (t, v) = match c {
        WriteCond::Always => (0, 0),
        WriteCond::Version(v) => (1, *v),
        WriteCond::Absent => (2, 0),
    };
    b.put_u8(t);
    b.put_u64_le(v);
}

impl Reader {
    fn key(&mut self, f: &'static str) -> Result<Bytes, WireError> {
        let n = self.u16(f)? as usize;
        self.take(n, f)
    }
    fn value(&mut self) -> Result<Bytes, WireError> {
        let n = self.u32("value_len")? as usize;
        self.take(n, "value")
    }
    fn cond(&mut self) -> Result<WriteCond, WireError> {
        let t = self.u8("cond")?;
        let v = self.u64("cond_version")?;
        Ok(match t {
            0 => WriteCond::Always,
            1 => WriteCond::Version(v),
            2 => WriteCond::Absent,
            v => {
                return Err(WireError::InvalidValue {
                    field: "cond",
                    value: v as u64,
                })
            }
        })
    }
}

impl CacheFrame {
    pub fn kind(&self) -> u8 {
        use CacheFrame::*;
        match self {
            CachePut { .. } => kind::CACHE_PUT,
            CacheGet { .. } => kind::CACHE_GET,
            CacheDelete { .. } => kind::CACHE_DELETE,
            CacheValue { .. } => kind::CACHE_VALUE,
            CacheWritten { .. } => kind::CACHE_WRITTEN,
            CacheWatch { .. } => kind::CACHE_WATCH,
            CacheWatchOk { .. } => kind::CACHE_WATCH_OK,
            CacheEvent { .. } => kind::CACHE_EVENT,
            CacheStateDone { .. } => kind::CACHE_STATE_DONE,
            CacheWatchEnd { .. } => kind::CACHE_WATCH_END,
            CounterAdd { .. } => kind::COUNTER_ADD,
            CounterGet { .. } => kind::COUNTER_GET,
            CounterValue { .. } => kind::COUNTER_VALUE,
            DescribeCache { .. } => kind::DESCRIBE_CACHE,
            CacheInfo { .. } => kind::CACHE_INFO,
            CacheMux { .. } => kind::CACHE_MUX,
        }
    }

    /// The request id; 0 for watch-stream frames, which answer no request.
    pub fn request_id(&self) -> u64 {
        use CacheFrame::*;
        match self {
            CachePut { request_id, .. }
            | CacheGet { request_id, .. }
            | CacheDelete { request_id, .. }
            | CacheValue { request_id, .. }
            | CacheWritten { request_id, .. }
            | CacheWatch { request_id, .. }
            | CacheWatchOk { request_id, .. }
            | CounterAdd { request_id, .. }
            | CounterGet { request_id, .. }
            | CounterValue { request_id, .. }
            | DescribeCache { request_id, .. }
            | CacheInfo { request_id, .. } => *request_id,
            CacheEvent { .. } | CacheStateDone { .. } | CacheWatchEnd { .. } | CacheMux { .. } => 0,
        }
    }

    /// The cache a request names (None for answers and watch-stream frames).
    pub fn cache(&self) -> Option<&StreamName> {
        use CacheFrame::*;
        match self {
            CachePut { cache, .. }
            | CacheGet { cache, .. }
            | CacheDelete { cache, .. }
            | CacheWatch { cache, .. }
            | CounterAdd { cache, .. }
            | CounterGet { cache, .. }
            | DescribeCache { cache, .. } => Some(cache),
            _ => None,
        }
    }

    pub(super) fn encode_body(&self, b: &mut BytesMut) {
        use CacheFrame::*;
        match self {
            CachePut {
                request_id,
                cache,
                key,
                value,
                ttl_ms,
                cond,
            } => {
                b.put_u64_le(*request_id);
                put_stream(b, cache);
                put_key(b, key);
                put_value(b, value);
                b.put_u64_le(*ttl_ms);
                put_cond(b, cond);
            }
            CacheGet {
                request_id,
                cache,
                key,
            } => {
                b.put_u64_le(*request_id);
                put_stream(b, cache);
                put_key(b, key);
            }
            CacheDelete {
                request_id,
                cache,
                key,
                cond,
            } => {
                b.put_u64_le(*request_id);
                put_stream(b, cache);
                put_key(b, key);
                put_cond(b, cond);
            }
            CacheValue {
                request_id,
                shard,
                found,
                version,
                change_offset,
                expires_at_ms,
                value,
            } => {
                b.put_u64_le(*request_id);
                b.put_u32_le(*shard);
                b.put_u8(*found as u8);
                b.put_u64_le(*version);
                b.put_u64_le(*change_offset);
                b.put_u64_le(*expires_at_ms);
                put_value(b, value);
            }
            CacheWritten {
                request_id,
                shard,
                version,
                expires_at_ms,
            } => {
                b.put_u64_le(*request_id);
                b.put_u32_le(*shard);
                b.put_u64_le(*version);
                b.put_u64_le(*expires_at_ms);
            }
            CacheWatch {
                request_id,
                cache,
                filter,
                start,
                queue_events_max,
                queue_bytes_max,
            } => {
                b.put_u64_le(*request_id);
                put_stream(b, cache);
                match filter {
                    WatchFilter::Key(k) => {
                        b.put_u8(0);
                        put_key(b, k);
                        b.put_u32_le(0);
                    }
                    WatchFilter::Prefix { prefix, shard } => {
                        b.put_u8(1);
                        put_key(b, prefix);
                        b.put_u32_le(*shard);
                    }
                }
                let (t, o) = match start {
                    WatchStart::Latest => (0, 0),
                    WatchStart::Current => (1, 0),
                    WatchStart::Offset(o) => (2, *o),
                };
                b.put_u8(t);
                b.put_u64_le(o);
                b.put_u32_le(*queue_events_max);
                b.put_u64_le(*queue_bytes_max);
            }
            CacheWatchOk {
                request_id,
                watch_id,
                shard,
                live_from,
                queue_events_max,
                queue_bytes_max,
            } => {
                b.put_u64_le(*request_id);
                b.put_u64_le(*watch_id);
                b.put_u32_le(*shard);
                b.put_u64_le(*live_from);
                b.put_u32_le(*queue_events_max);
                b.put_u64_le(*queue_bytes_max);
            }
            CacheEvent {
                kind,
                offset,
                key,
                expires_at_ms,
                value,
            } => {
                b.put_u8(kind.to_u8());
                b.put_u64_le(*offset);
                put_key(b, key);
                b.put_u64_le(*expires_at_ms);
                put_value(b, value);
            }
            CacheStateDone {
                count,
                snapshot,
                live_from,
            } => {
                b.put_u64_le(*count);
                b.put_u8(*snapshot as u8);
                b.put_u64_le(*live_from);
            }
            CacheWatchEnd {
                code,
                resume_from,
                message,
            } => {
                b.put_u16_le(*code);
                b.put_u64_le(*resume_from);
                put_message(b, message);
            }
            CacheMux { watch_ids, frame } => {
                b.put_u32_le(watch_ids.len() as u32);
                for id in watch_ids {
                    b.put_u64_le(*id);
                }
                b.put_u8(frame.kind());
                frame.encode_body(b);
            }
            CounterAdd {
                request_id,
                cache,
                name,
                delta,
            } => {
                b.put_u64_le(*request_id);
                put_stream(b, cache);
                put_key(b, name);
                b.put_i64_le(*delta);
            }
            CounterGet {
                request_id,
                cache,
                name,
            } => {
                b.put_u64_le(*request_id);
                put_stream(b, cache);
                put_key(b, name);
            }
            CounterValue {
                request_id,
                shard,
                sum,
                offset,
            } => {
                b.put_u64_le(*request_id);
                b.put_u32_le(*shard);
                b.put_i64_le(*sum);
                b.put_u64_le(*offset);
            }
            DescribeCache { request_id, cache } => {
                b.put_u64_le(*request_id);
                put_stream(b, cache);
            }
            CacheInfo {
                request_id,
                shards,
                durable,
                default_ttl_ms,
                owners,
            } => {
                b.put_u64_le(*request_id);
                b.put_u32_le(*shards);
                b.put_u8(*durable as u8);
                b.put_u64_le(*default_ttl_ms);
                b.put_u32_le(owners.len() as u32);
                for o in owners {
                    b.put_u64_le(*o);
                }
            }
        }
    }

    pub(super) fn decode(k: u8, r: &mut Reader) -> Result<CacheFrame, WireError> {
        use CacheFrame::*;
        Ok(match k {
            kind::CACHE_PUT => CachePut {
                request_id: r.u64("request_id")?,
                cache: r.stream()?,
                key: r.key("key")?,
                value: r.value()?,
                ttl_ms: r.u64("ttl_ms")?,
                cond: r.cond()?,
            },
            kind::CACHE_GET => CacheGet {
                request_id: r.u64("request_id")?,
                cache: r.stream()?,
                key: r.key("key")?,
            },
            kind::CACHE_DELETE => CacheDelete {
                request_id: r.u64("request_id")?,
                cache: r.stream()?,
                key: r.key("key")?,
                cond: r.cond()?,
            },
            kind::CACHE_VALUE => CacheValue {
                request_id: r.u64("request_id")?,
                shard: r.u32("shard")?,
                found: r.bool("found")?,
                version: r.u64("version")?,
                change_offset: r.u64("change_offset")?,
                expires_at_ms: r.u64("expires_at_ms")?,
                value: r.value()?,
            },
            kind::CACHE_WRITTEN => CacheWritten {
                request_id: r.u64("request_id")?,
                shard: r.u32("shard")?,
                version: r.u64("version")?,
                expires_at_ms: r.u64("expires_at_ms")?,
            },
            kind::CACHE_WATCH => {
                let request_id = r.u64("request_id")?;
                let cache = r.stream()?;
                let tag = r.u8("filter")?;
                let bytes = r.key("filter_key")?;
                let shard = r.u32("filter_shard")?;
                let filter = match tag {
                    0 => WatchFilter::Key(bytes),
                    1 => WatchFilter::Prefix {
                        prefix: bytes,
                        shard,
                    },
                    v => {
                        return Err(WireError::InvalidValue {
                            field: "filter",
                            value: v as u64,
                        })
                    }
                };
                let t = r.u8("start")?;
                let o = r.u64("start_offset")?;
                let start = match t {
                    0 => WatchStart::Latest,
                    1 => WatchStart::Current,
                    2 => WatchStart::Offset(o),
                    v => {
                        return Err(WireError::InvalidValue {
                            field: "start",
                            value: v as u64,
                        })
                    }
                };
                CacheWatch {
                    request_id,
                    cache,
                    filter,
                    start,
                    queue_events_max: r.u32("queue_events_max")?,
                    queue_bytes_max: r.u64("queue_bytes_max")?,
                }
            }
            kind::CACHE_WATCH_OK => CacheWatchOk {
                request_id: r.u64("request_id")?,
                watch_id: r.u64("watch_id")?,
                shard: r.u32("shard")?,
                live_from: r.u64("live_from")?,
                queue_events_max: r.appended_u32("queue_events_max", 0)?,
                queue_bytes_max: r.appended_u64("queue_bytes_max", 0)?,
            },
            kind::CACHE_EVENT => CacheEvent {
                kind: EventKind::from_u8(r.u8("event_kind")?)?,
                offset: r.u64("offset")?,
                key: r.key("key")?,
                expires_at_ms: r.u64("expires_at_ms")?,
                value: r.value()?,
            },
            kind::CACHE_STATE_DONE => CacheStateDone {
                count: r.u64("count")?,
                snapshot: r.bool("snapshot")?,
                live_from: r.u64("live_from")?,
            },
            kind::CACHE_WATCH_END => CacheWatchEnd {
                code: r.u16("code")?,
                resume_from: r.u64("resume_from")?,
                message: r.string("message")?,
            },
            kind::COUNTER_ADD => CounterAdd {
                request_id: r.u64("request_id")?,
                cache: r.stream()?,
                name: r.key("name")?,
                delta: r.u64("delta")? as i64,
            },
            kind::COUNTER_GET => CounterGet {
                request_id: r.u64("request_id")?,
                cache: r.stream()?,
                name: r.key("name")?,
            },
            kind::COUNTER_VALUE => CounterValue {
                request_id: r.u64("request_id")?,
                shard: r.u32("shard")?,
                sum: r.u64("sum")? as i64,
                offset: r.u64("offset")?,
            },
            kind::DESCRIBE_CACHE => DescribeCache {
                request_id: r.u64("request_id")?,
                cache: r.stream()?,
            },
            kind::CACHE_INFO => {
                let (request_id, shards, durable, default_ttl_ms) = (
                    r.u64("request_id")?,
                    r.u32("shards")?,
                    r.bool("durable")?,
                    r.u64("default_ttl_ms")?,
                );
                let n = r.appended_u32("owners", 0)?;
                CacheInfo {
                    request_id,
                    shards,
                    durable,
                    default_ttl_ms,
                    owners: r.list(n, "owners", |r| r.u64("owner"))?,
                }
            }
            kind::CACHE_MUX => {
                let watch_ids = r.distinct_ids("watch_count", "watch_ids")?;
                let inner = r.u8("inner_kind")?;
                if !matches!(
                    inner,
                    kind::CACHE_EVENT | kind::CACHE_STATE_DONE | kind::CACHE_WATCH_END
                ) {
                    return Err(WireError::InvalidValue {
                        field: "inner_kind",
                        value: inner as u64,
                    });
                }
                CacheMux {
                    watch_ids,
                    frame: Box::new(CacheFrame::decode(inner, r)?),
                }
            }
            other => unreachable!("kind {other} is outside the cache range"),
        })
    }
}

/// The head of a `CacheMux` frame naming `watch_ids` around an encoded watch frame `inner`
/// (header included): send the head, then `inner[HEADER_LEN..]` (shared, zero copy).
/// `head ++ inner[HEADER_LEN..]` is exactly the `CacheMux` frame's encoding.
pub fn encode_mux_head(watch_ids: &[u64], inner: &[u8]) -> Bytes {
    use super::HEADER_LEN;
    assert!(!watch_ids.is_empty(), "a CacheMux names at least one watch");
    let inner_kind = inner[3];
    assert!(
        matches!(
            inner_kind,
            kind::CACHE_EVENT | kind::CACHE_STATE_DONE | kind::CACHE_WATCH_END
        ),
        "a CacheMux wraps a watch-stream frame"
    );
    let inner_body = inner.len() - HEADER_LEN;
    let body_len = 4 + 8 * watch_ids.len() + 1 + inner_body;
    let mut b = BytesMut::with_capacity(HEADER_LEN + body_len - inner_body);
    b.put_slice(&super::header_bytes(kind::CACHE_MUX, 0, body_len));
    b.put_u32_le(watch_ids.len() as u32);
    for id in watch_ids {
        b.put_u64_le(*id);
    }
    b.put_u8(inner_kind);
    b.freeze()
}

/// Encode one watch event frame once, to share its bytes among watchers.
pub fn encode_event(
    kind: EventKind,
    offset: u64,
    key: Bytes,
    expires_at_ms: u64,
    value: Bytes,
) -> Bytes {
    super::Frame::Cache(CacheFrame::CacheEvent {
        kind,
        offset,
        key,
        expires_at_ms,
        value,
    })
    .encode()
}

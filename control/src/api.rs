//! The REST API's JSON shapes, usable without the server (`default-features = false`).
//!
//! A broker or felixctl depends on these types only; the server derives the OpenAPI schemas from
//! the same definitions (`utoipa`), so the document can never drift from the code.

use felix_quic::wire::ErrorCode;
use serde::{Deserialize, Serialize};

#[cfg(feature = "server")]
use utoipa::ToSchema;

/// The typed error body of every refusal: `code` is a name from the wire's error registry
/// (`felix_quic::wire::ErrorCode`), so REST and QUIC speak one vocabulary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct ErrorBody {
    /// Registry name, e.g. `invalid_name`, `not_found`, `already_exists`, `conflict`.
    pub code: String,
    /// Human-readable detail.
    pub message: String,
}

/// A refusal: a registry code and a message. Serialized as [`ErrorBody`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidRequest, message)
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            code: self.code.name().to_string(),
            message: self.message.clone(),
        }
    }

    /// Rebuild from a body; an unknown code (a newer server) maps to `internal`.
    pub fn from_body(b: ErrorBody) -> Self {
        let code = ErrorCode::from_name(&b.code).unwrap_or(ErrorCode::Internal);
        ApiError {
            code,
            message: b.message,
        }
    }

    /// The HTTP status a code answers with.
    pub fn http_status(&self) -> u16 {
        status_for(self.code)
    }
}

/// HTTP status for each registry code.
pub fn status_for(code: ErrorCode) -> u16 {
    use ErrorCode::*;
    match code {
        InvalidFrame | InvalidName | InvalidRequest | Unsupported | UnsupportedVersion
        | UnknownShard => 400,
        NotFound | UnknownTenant | UnknownNamespace | UnknownStream => 404,
        AlreadyExists | Conflict | StaleClaim | WatchLagged => 409,
        ConditionFailed => 412,
        RevisionTooOld | StreamDeleted => 410,
        PayloadTooLarge | FrameTooLarge => 413,
        TooManySubscriptions | InflightLimit | PublishTimeout | CacheFull => 429,
        NotLeader | Unavailable | ShuttingDown => 503,
        Internal => 500,
        // The answer of another node was lost: 504, the gateway's timeout.
        OutcomeUnknown => 504,
        Unauthenticated | TokenExpired | Revoked => 401,
        Forbidden => 403,
    }
}

impl Serialize for ApiError {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.body().serialize(s)
    }
}

impl<'de> Deserialize<'de> for ApiError {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        ErrorBody::deserialize(d).map(ApiError::from_body)
    }
}

/// How a durable shard syncs its log before acknowledging.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum FsyncMode {
    /// Acknowledge after the record's group commit is fdatasynced.
    OnCommit,
    /// Acknowledge once written; fdatasync on a timer (the broker's
    /// `durable_fsync_interval_ms`, 250 ms by default). A machine crash may lose the last
    /// interval of acknowledged records; a process crash loses nothing acknowledged (default).
    #[default]
    Periodic,
    /// Acknowledge once written and never fsync; the page cache decides.
    None,
}

/// What a publish waits for before it is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Consistency {
    /// The shard's owner alone (default; the only level this build serves).
    #[default]
    Leader,
    /// A quorum of the replica set, and the control plane's record of it (refused with
    /// `unsupported` unless the control plane runs with `--replication-preview`).
    Quorum,
}

/// Lifecycle of a stream or cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ResourceState {
    Active,
    /// Deleted, waiting for brokers to drop it; the name cannot be reused until it is gone.
    Deleting,
}

/// Where one shard lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ShardState {
    /// Owned by a live broker.
    Assigned,
    /// No live broker to own it (none registered, or all dead).
    Unassigned,
    /// Durable and owned by a dead broker: it is not moved (a move would reset the offsets of
    /// a shard of one copy), so it cannot serve until that broker returns. A replicated
    /// shard is unavailable while no replica qualifies to lead it.
    Unavailable,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct ShardPlacement {
    pub shard: u32,
    /// Node id of the owner broker, if any: the leader of the replica set (kept beside
    /// `leader` for readers of the single-copy shape).
    pub owner: Option<u64>,
    /// Bumped every time the owner changes; a broker fences on it.
    pub generation: u64,
    pub state: ShardState,
    /// The brokers holding a copy of the shard, the leader first. One copy until
    /// replication (`replication_factor` > 1) is built: `[owner]`, or empty when unplaced.
    #[serde(default)]
    pub replicas: Vec<u64>,
    /// The replica that serves the shard in this `generation`.
    #[serde(default)]
    pub leader: Option<u64>,
    /// While a change of replica set has not settled (docs/replication-design.md rule 11):
    /// the set of the newest generation whose leader's report landed. A new leader's fence
    /// needs a majority of it as well as of `replicas`. Absent once the set settled.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub settled: Vec<u64>,
}

/// One replica of a shard, as the last landed report of its leader named it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct ReplicaLag {
    pub node: u64,
    /// The offset after the last record it holds, as reported (0 before any report).
    pub end: u64,
    /// The generation of its last record, as reported.
    pub last_generation: u64,
    /// Records behind the leader's reported end.
    pub lag_records: u64,
    /// Bytes of the leader's log past its end, as the leader's last landed report said (the
    /// segment bytes: records, commit headers, padding; counted from the nearest index entry
    /// at or before its end). Null before a report named it.
    pub lag_bytes: Option<u64>,
    /// Whether its report entry counts: made under the storage identity the broker has
    /// registered now (rule 9). Only these move the commit mark and may be promoted.
    pub vouched: bool,
    /// Whether its broker is live.
    pub live: bool,
}

/// One shard's replication as placement holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct ShardReplication {
    pub shard: u32,
    pub state: ShardState,
    /// The newest generation placement issued.
    pub generation: u64,
    /// The leader placement named at `generation`.
    pub leader: Option<u64>,
    pub followers: Vec<u64>,
    /// The commit mark the landed reports show: every record below it is held by a majority
    /// of the replicas. `null` for a shard of one copy or one not yet seated.
    pub commit: Option<u64>,
    /// Each replica, in placement order; empty for a shard of one copy.
    pub replicas: Vec<ReplicaLag>,
}

/// `GET .../streams/{stream}/replication`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct StreamReplication {
    pub tenant: String,
    pub namespace: String,
    pub name: String,
    pub replication_factor: u32,
    pub consistency: Consistency,
    pub shards: Vec<ShardReplication>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct Tenant {
    pub name: String,
    pub description: Option<String>,
    /// Catalog revision that created it.
    pub created_revision: u64,
    /// Catalog revision of its last change.
    pub revision: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct Namespace {
    pub tenant: String,
    pub name: String,
    pub description: Option<String>,
    pub created_revision: u64,
    pub revision: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct Stream {
    pub tenant: String,
    pub namespace: String,
    pub name: String,
    pub shards: u32,
    pub durable: bool,
    /// Per-shard retention bound in bytes; `null` = unbounded.
    pub retention_bytes: Option<u64>,
    /// Per-shard retention bound in seconds; `null` = unbounded.
    pub retention_seconds: Option<u64>,
    pub fsync: FsyncMode,
    pub consistency: Consistency,
    pub replication_factor: u32,
    pub state: ResourceState,
    pub created_revision: u64,
    pub revision: u64,
    /// One entry per shard, in shard order.
    pub placement: Vec<ShardPlacement>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct Cache {
    pub tenant: String,
    pub namespace: String,
    pub name: String,
    pub shards: u32,
    pub durable: bool,
    /// Default time-to-live of an entry in seconds; `null` = entries do not expire.
    pub ttl_seconds: Option<u64>,
    pub state: ResourceState,
    pub created_revision: u64,
    pub revision: u64,
    pub placement: Vec<ShardPlacement>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct Broker {
    pub node_id: u64,
    /// `host:port` clients reach its QUIC listener at.
    pub quic_addr: String,
    pub cores: u32,
    /// Whether the control plane currently counts it alive (heartbeats arriving).
    pub live: bool,
    /// Bumped on every registration (a broker restart registers again).
    pub incarnation: u64,
    pub revision: u64,
    /// `host:port` of its peer listener (other brokers forward there), if it has one.
    #[serde(default)]
    pub peer_addr: Option<String>,
    /// The storage identity of its durable directory at its last registration (16 hex
    /// digits; replication rule 9): it names the bytes the broker wrote. When it changes,
    /// what the broker was reported to hold under the old one no longer counts.
    #[serde(default)]
    pub storage_id: Option<String>,
    /// The catalog revision at which `storage_id` was first registered: a restart that
    /// kept it leaves this, a rotation moves it.
    #[serde(default)]
    pub storage_id_since: Option<u64>,
}

// ---- requests ----

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateTenant {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
}

/// A field left out is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct UpdateTenant {
    /// New description; `""` clears it.
    #[serde(default)]
    pub description: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateNamespace {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct UpdateNamespace {
    /// New description; `""` clears it.
    #[serde(default)]
    pub description: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateStream {
    pub name: String,
    /// Default 1.
    #[serde(default)]
    pub shards: Option<u32>,
    #[serde(default)]
    pub durable: bool,
    /// `0` or absent = unbounded.
    #[serde(default)]
    pub retention_bytes: Option<u64>,
    /// `0` or absent = unbounded.
    #[serde(default)]
    pub retention_seconds: Option<u64>,
    #[serde(default)]
    pub fsync: Option<FsyncMode>,
    #[serde(default)]
    pub consistency: Option<Consistency>,
    /// Default 1; above 1 is refused (`unsupported`) unless the control plane runs with
    /// `--replication-preview`.
    #[serde(default)]
    pub replication_factor: Option<u32>,
}

impl CreateStream {
    pub fn named(name: impl Into<String>) -> Self {
        CreateStream {
            name: name.into(),
            shards: None,
            durable: false,
            retention_bytes: None,
            retention_seconds: None,
            fsync: None,
            consistency: None,
            replication_factor: None,
        }
    }
}

/// A field left out is unchanged. Shard count and durability are fixed at creation.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct UpdateStream {
    /// `0` clears the bound.
    #[serde(default)]
    pub retention_bytes: Option<u64>,
    /// `0` clears the bound.
    #[serde(default)]
    pub retention_seconds: Option<u64>,
    #[serde(default)]
    pub fsync: Option<FsyncMode>,
    #[serde(default)]
    pub consistency: Option<Consistency>,
    #[serde(default)]
    pub replication_factor: Option<u32>,
    /// Must equal the current count if given (changing it is `unsupported`).
    #[serde(default)]
    pub shards: Option<u32>,
    /// Must equal the current value if given (changing it is `unsupported`).
    #[serde(default)]
    pub durable: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateCache {
    pub name: String,
    /// Default 1.
    #[serde(default)]
    pub shards: Option<u32>,
    #[serde(default)]
    pub durable: bool,
    /// `0` or absent = entries do not expire.
    #[serde(default)]
    pub ttl_seconds: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct UpdateCache {
    /// `0` clears the default TTL.
    #[serde(default)]
    pub ttl_seconds: Option<u64>,
    /// Must equal the current count if given.
    #[serde(default)]
    pub shards: Option<u32>,
    /// Must equal the current value if given.
    #[serde(default)]
    pub durable: Option<bool>,
}

/// What a control plane of this build understands in a registration or heartbeat (the
/// `capabilities` it answers with). Registration and heartbeat bodies take fields they do not
/// know and ignore them, so a newer broker can talk to an older control plane: the broker
/// learns from the answer which of its fields were understood, instead of being refused.
pub const CONTROL_CAPABILITIES: &[&str] = &["peer_addr", "storage_id"];

/// `POST /v1/brokers`: a broker announces itself (at start, and again whenever a heartbeat
/// answers `not_found`). Unknown fields are ignored (see [`CONTROL_CAPABILITIES`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct RegisterBroker {
    pub node_id: u64,
    /// `host:port` of its QUIC listener.
    pub quic_addr: String,
    pub cores: u32,
    /// `host:port` of its peer listener (`--peer-listen`), if it has one.
    #[serde(default)]
    pub peer_addr: Option<String>,
    /// The capabilities the broker uses in this registration (for example `peer_addr`).
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// The storage identity of its durable directory (16 lowercase hex digits), if it has
    /// one: settled at every start, kept across a clean stop or a process crash, rotated
    /// after a machine crash, on any doubt, or by `felix-broker restore-point`.
    #[serde(default)]
    pub storage_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct RegisterBrokerReply {
    pub broker: Broker,
    /// How often to heartbeat.
    pub heartbeat_interval_ms: u64,
    /// A broker silent for this long is counted dead.
    pub dead_after_ms: u64,
    /// Catalog revision at registration; read `GET /v1/catalog` next.
    pub catalog_revision: u64,
    /// The broker's capabilities this control plane understood (the rest were ignored).
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// The cluster's identity (the catalog id): brokers name it in their peer `PeerHello`,
    /// and refuse a peer of another cluster.
    #[serde(default)]
    pub cluster_id: String,
}

/// `POST /v1/brokers/{node_id}/heartbeat`. Unknown fields are ignored (see
/// [`CONTROL_CAPABILITIES`]).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct Heartbeat {
    /// The incarnation the registration answered; a stale one is refused with `conflict`.
    #[serde(default)]
    pub incarnation: Option<u64>,
    /// The catalog revision this broker has applied (lets deletes finish sooner).
    #[serde(default)]
    pub catalog_revision: Option<u64>,
    /// The broker is stopping (SIGTERM): count it dead now rather than after
    /// `dead_after_ms`, so that the replicated shards it leads get new leaders at once. Needs
    /// `incarnation`: a newer process's registration is never undone by an older one leaving.
    #[serde(default)]
    pub leaving: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct HeartbeatReply {
    pub live: bool,
    pub heartbeat_interval_ms: u64,
    pub dead_after_ms: u64,
    pub catalog_revision: u64,
}

// ---- catalog feed ----

/// `GET /v1/catalog`: everything, at one revision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct CatalogSnapshot {
    /// Identity of this catalog; a change means the catalog was replaced (re-read it whole).
    pub catalog_id: String,
    pub revision: u64,
    pub tenants: Vec<Tenant>,
    pub namespaces: Vec<Namespace>,
    pub streams: Vec<Stream>,
    pub caches: Vec<Cache>,
    pub brokers: Vec<Broker>,
    /// In the placement settle window (`FELIX_PLACEMENT_SETTLE_MS`): shards wait unplaced
    /// until the brokers starting together have registered.
    #[serde(default)]
    pub placement_held: bool,
}

/// One change; revisions are consecutive (every change bumps the revision by one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct Change {
    pub revision: u64,
    pub event: ChangeEvent,
}

/// What changed. `*_put` carries the whole new resource (upsert); `*_deleted` the name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ChangeEvent {
    TenantPut {
        tenant: Tenant,
    },
    TenantDeleted {
        name: String,
    },
    NamespacePut {
        namespace: Namespace,
    },
    NamespaceDeleted {
        tenant: String,
        name: String,
    },
    StreamPut {
        stream: Stream,
    },
    StreamDeleted {
        tenant: String,
        namespace: String,
        name: String,
    },
    CachePut {
        cache: Cache,
    },
    CacheDeleted {
        tenant: String,
        namespace: String,
        name: String,
    },
    BrokerPut {
        broker: Broker,
    },
}

/// `GET /v1/catalog/changes?since=R`: every change with revision > R, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct ChangesPage {
    pub catalog_id: String,
    /// Ask next with `since` = this (the revision of the last change included, or `since` if none).
    pub next_since: u64,
    /// The catalog's revision when answered.
    pub revision: u64,
    pub changes: Vec<Change>,
    /// More changes are ready beyond this page.
    pub more: bool,
}

// ---- cluster ----

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct ClusterStatus {
    /// `memory` or `raft`.
    pub store: String,
    /// This member's node id (`FELIX_RAFT_NODE_ID`), 0 for the memory store.
    pub node_id: u64,
    pub ready: bool,
    pub is_leader: bool,
    /// Node id of the current leader, if known.
    pub leader: Option<u64>,
    /// Voting members (node ids).
    pub voters: Vec<u64>,
    /// Non-voting members being caught up.
    pub learners: Vec<u64>,
    pub catalog_revision: u64,
    /// Raft term and last applied log index (0 for the memory store).
    pub term: u64,
    pub applied_index: u64,
    /// Every member of the Raft group (empty for the memory store, or before the group forms).
    pub members: Vec<Member>,
}

/// One Raft member. A member whose data dir was wiped rejoins under a new `generation`: the
/// old identity is removed first and never votes again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(ToSchema))]
pub struct Member {
    pub node_id: u64,
    pub generation: u32,
    /// Its REST listener (`host:port`).
    pub addr: String,
    pub voter: bool,
}

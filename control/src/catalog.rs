//! The catalog state machine: `apply(command) -> result`. Pure and deterministic — no clock, no
//! socket, no randomness — so every Raft member that applies the same commands in the same order
//! holds the same catalog, and it can be tested without a runtime.
//!
//! Every change bumps the revision by exactly one and is kept in a bounded ring, which is what
//! the gap-free changes feed reads. Time-based decisions (a broker is dead, a delete may finish)
//! are taken by the driver and arrive here as commands.

use crate::api::*;
use crate::placement;
use felix_quic::wire::{validate_name, ErrorCode};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

pub mod auth_state;
mod replicas;
use auth_state::{AuthCommand, AuthState};
pub use replicas::{ReplicaImage, ReplicationHealth};

/// Bounds of the catalog. Every member of a Raft group must run with the same values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    pub max_shards: u32,
    /// Tenants + namespaces + streams + caches.
    pub max_objects: usize,
    pub max_brokers: usize,
    pub max_cores: u32,
    pub max_description_bytes: usize,
    /// Changes kept for the feed; an older `since` is answered `revision_too_old`.
    pub change_log_len: usize,
    /// Streams of more than one copy, or `quorum`, are accepted and placed
    /// (`--replication-preview`): placement seats the replicas, promotes and takes reports,
    /// and brokers replicate; it is partial (no follower replacement or rebuild, no groups),
    /// so it is off by default. Every member of a Raft group must be started with the same
    /// value, as with every limit here.
    pub replication_preview: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_shards: 4096,
            max_objects: 100_000,
            max_brokers: 1024,
            max_cores: 4096,
            max_description_bytes: 256,
            change_log_len: 10_000,
            replication_preview: false,
        }
    }
}

/// A write to the catalog. This is what the Raft log carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Command {
    /// Give a new catalog its identity (first one wins; later ones are no-ops). With
    /// `hold_placement`, shards are not placed until [`Command::ReleasePlacement`]: the
    /// settle window, so a cluster started all at once spreads its shards over the brokers
    /// that registered in it instead of piling them onto the first.
    Init {
        catalog_id: String,
        #[serde(default)]
        hold_placement: bool,
    },
    /// End the settle window: place every shard over the live brokers.
    ReleasePlacement,
    /// A replicated shard's leader reports who holds what (rule 7); answered
    /// [`Reply::Report`].
    ReplicaReport {
        tenant: String,
        namespace: String,
        stream: String,
        shard: u32,
        report: crate::replication::Report,
    },
    /// The operator promotes a replica of an unavailable replicated shard, accepting what
    /// may be lost (`to`: which one; default the furthest ahead that is live); answered
    /// [`Reply::Abandoned`].
    AbandonShard {
        tenant: String,
        namespace: String,
        stream: String,
        shard: u32,
        to: Option<u64>,
    },
    CreateTenant {
        req: CreateTenant,
    },
    UpdateTenant {
        name: String,
        req: UpdateTenant,
    },
    DeleteTenant {
        name: String,
    },
    CreateNamespace {
        tenant: String,
        req: CreateNamespace,
    },
    UpdateNamespace {
        tenant: String,
        name: String,
        req: UpdateNamespace,
    },
    DeleteNamespace {
        tenant: String,
        name: String,
    },
    CreateStream {
        tenant: String,
        namespace: String,
        req: CreateStream,
    },
    UpdateStream {
        tenant: String,
        namespace: String,
        name: String,
        req: UpdateStream,
    },
    /// Marks the stream `deleting`; [`Command::FinishStreamDelete`] removes it.
    DeleteStream {
        tenant: String,
        namespace: String,
        name: String,
    },
    /// Removes a `deleting` stream if it is still the one deleted at `revision`.
    FinishStreamDelete {
        tenant: String,
        namespace: String,
        name: String,
        revision: u64,
    },
    CreateCache {
        tenant: String,
        namespace: String,
        req: CreateCache,
    },
    UpdateCache {
        tenant: String,
        namespace: String,
        name: String,
        req: UpdateCache,
    },
    DeleteCache {
        tenant: String,
        namespace: String,
        name: String,
    },
    FinishCacheDelete {
        tenant: String,
        namespace: String,
        name: String,
        revision: u64,
    },
    RegisterBroker {
        req: RegisterBroker,
    },
    /// Liveness as judged by the leader's driver from heartbeats.
    SetBrokerLive {
        node_id: u64,
        live: bool,
    },
    /// Broker `node_id` has been dead longer than `--replica-replace-after-ms` (the leader's
    /// driver judges): replace it in every replicated shard whose set may change now
    /// (docs/replication-design.md rule 11). Nothing changes if it came back meanwhile.
    ReplaceReplicas {
        node_id: u64,
    },
    /// Signing keys, the bootstrap admin, issued tokens (see [`auth_state`]).
    Auth {
        cmd: AuthCommand,
    },
}

/// What a successful command answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "value", rename_all = "snake_case")]
pub enum Reply {
    Done,
    Tenant(Tenant),
    Namespace(Namespace),
    Stream(Stream),
    Cache(Cache),
    Broker(Broker),
    /// Placement's answer to a leader's report.
    Report(crate::replication::ReportAnswer),
    /// What an operator's abandon did.
    Abandoned(crate::replication::Abandoned),
    /// How many shards [`Command::ReplaceReplicas`] changed.
    Replaced {
        shards: u64,
    },
}

pub type Outcome = Result<Reply, ApiError>;

type NsKey = (String, String);
type ObjKey = (String, String, String);

/// The whole catalog, plus its change ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Catalog {
    limits: Limits,
    catalog_id: String,
    revision: u64,
    tenants: BTreeMap<String, Tenant>,
    namespaces: BTreeMap<NsKey, Namespace>,
    streams: BTreeMap<ObjKey, Stream>,
    caches: BTreeMap<ObjKey, Cache>,
    brokers: BTreeMap<u64, Broker>,
    changes: VecDeque<Change>,
    /// In the settle window: placement waits (see [`Command::Init`]).
    placement_held: bool,
    auth: AuthState,
    /// Each replicated shard's placement (catalog/replicas.rs).
    replicas: BTreeMap<replicas::ShardKey, crate::replication::Placement>,
}

/// The serialized form of a catalog (Raft snapshots, persistence).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CatalogImage {
    pub snapshot: CatalogSnapshot,
    pub changes: Vec<Change>,
    /// Absent in images written before auth existed.
    #[serde(default)]
    pub auth: AuthState,
    /// Replicated shards' placements; absent in images written before replication.
    #[serde(default)]
    pub replicas: Vec<replicas::ReplicaImage>,
}

fn invalid_name(what: &str, e: String) -> ApiError {
    ApiError::new(ErrorCode::InvalidName, format!("{what}: {e}"))
}

fn check_name(what: &str, s: &str) -> Result<(), ApiError> {
    validate_name(s).map_err(|e| invalid_name(what, e))
}

fn nz(v: Option<u64>) -> Option<u64> {
    v.filter(|&x| x != 0)
}

impl Catalog {
    pub fn new(limits: Limits) -> Self {
        let limits = Limits {
            change_log_len: limits.change_log_len.max(1),
            ..limits
        };
        Catalog {
            limits,
            catalog_id: String::new(),
            revision: 0,
            tenants: BTreeMap::new(),
            namespaces: BTreeMap::new(),
            streams: BTreeMap::new(),
            caches: BTreeMap::new(),
            brokers: BTreeMap::new(),
            changes: VecDeque::new(),
            placement_held: false,
            auth: AuthState::default(),
            replicas: BTreeMap::new(),
        }
    }

    /// Whether placement waits for the settle window to end.
    pub fn placement_held(&self) -> bool {
        self.placement_held
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }
    pub fn revision(&self) -> u64 {
        self.revision
    }
    pub fn catalog_id(&self) -> &str {
        &self.catalog_id
    }
    pub fn initialized(&self) -> bool {
        !self.catalog_id.is_empty()
    }

    // ---------------------------------------------------------------- reads

    pub fn tenant(&self, name: &str) -> Result<&Tenant, ApiError> {
        check_name("tenant", name)?;
        self.tenants.get(name).ok_or_else(|| {
            ApiError::new(
                ErrorCode::UnknownTenant,
                format!("tenant {name} does not exist"),
            )
        })
    }

    pub fn namespace(&self, tenant: &str, name: &str) -> Result<&Namespace, ApiError> {
        self.tenant(tenant)?;
        check_name("namespace", name)?;
        self.namespaces
            .get(&(tenant.to_string(), name.to_string()))
            .ok_or_else(|| {
                ApiError::new(
                    ErrorCode::UnknownNamespace,
                    format!("namespace {tenant}/{name} does not exist"),
                )
            })
    }

    pub fn stream(&self, tenant: &str, namespace: &str, name: &str) -> Result<&Stream, ApiError> {
        self.namespace(tenant, namespace)?;
        check_name("stream", name)?;
        self.streams
            .get(&key(tenant, namespace, name))
            .ok_or_else(|| {
                ApiError::new(
                    ErrorCode::UnknownStream,
                    format!("stream {tenant}/{namespace}/{name} does not exist"),
                )
            })
    }

    pub fn cache(&self, tenant: &str, namespace: &str, name: &str) -> Result<&Cache, ApiError> {
        self.namespace(tenant, namespace)?;
        check_name("cache", name)?;
        self.caches
            .get(&key(tenant, namespace, name))
            .ok_or_else(|| {
                ApiError::new(
                    ErrorCode::NotFound,
                    format!("cache {tenant}/{namespace}/{name} does not exist"),
                )
            })
    }

    pub fn broker(&self, node_id: u64) -> Result<&Broker, ApiError> {
        self.brokers.get(&node_id).ok_or_else(|| {
            ApiError::new(
                ErrorCode::NotFound,
                format!("broker {node_id} is not registered"),
            )
        })
    }

    pub fn tenants(&self) -> impl Iterator<Item = &Tenant> {
        self.tenants.values()
    }

    pub fn namespaces(&self, tenant: &str) -> Result<Vec<Namespace>, ApiError> {
        self.tenant(tenant)?;
        Ok(self
            .namespaces
            .range((tenant.to_string(), String::new())..)
            .take_while(|((t, _), _)| t == tenant)
            .map(|(_, n)| n.clone())
            .collect())
    }

    pub fn streams(&self, tenant: &str, namespace: &str) -> Result<Vec<Stream>, ApiError> {
        self.namespace(tenant, namespace)?;
        Ok(in_ns(&self.streams, tenant, namespace))
    }

    pub fn caches(&self, tenant: &str, namespace: &str) -> Result<Vec<Cache>, ApiError> {
        self.namespace(tenant, namespace)?;
        Ok(in_ns(&self.caches, tenant, namespace))
    }

    pub fn brokers(&self) -> impl Iterator<Item = &Broker> {
        self.brokers.values()
    }

    pub fn all_streams(&self) -> impl Iterator<Item = &Stream> {
        self.streams.values()
    }

    pub fn all_caches(&self) -> impl Iterator<Item = &Cache> {
        self.caches.values()
    }

    pub fn snapshot(&self) -> CatalogSnapshot {
        CatalogSnapshot {
            catalog_id: self.catalog_id.clone(),
            revision: self.revision,
            tenants: self.tenants.values().cloned().collect(),
            namespaces: self.namespaces.values().cloned().collect(),
            streams: self.streams.values().cloned().collect(),
            caches: self.caches.values().cloned().collect(),
            brokers: self.brokers.values().cloned().collect(),
            placement_held: self.placement_held,
        }
    }

    /// Oldest `since` the feed can still answer.
    pub fn oldest_since(&self) -> u64 {
        self.changes
            .front()
            .map(|c| c.revision - 1)
            .unwrap_or(self.revision)
    }

    /// Every change after `since`, at most `limit` of them. `since` must not be ahead of the
    /// catalog (the driver waits for that case) nor older than the ring keeps.
    pub fn changes_since(&self, since: u64, limit: usize) -> Result<ChangesPage, ApiError> {
        if since > self.revision {
            return Err(ApiError::new(
                ErrorCode::RevisionTooOld,
                format!(
                    "revision {since} is ahead of this catalog (at {}); it was replaced or reset: read GET /v1/catalog again",
                    self.revision
                ),
            ));
        }
        let oldest = self.oldest_since();
        if since < oldest {
            return Err(ApiError::new(
                ErrorCode::RevisionTooOld,
                format!(
                    "revision {since} is older than the retained changes (oldest since={oldest}); read GET /v1/catalog again"
                ),
            ));
        }
        let skip = (since - oldest) as usize;
        let changes: Vec<Change> = self
            .changes
            .iter()
            .skip(skip)
            .take(limit.max(1))
            .cloned()
            .collect();
        let next_since = changes.last().map(|c| c.revision).unwrap_or(since);
        Ok(ChangesPage {
            catalog_id: self.catalog_id.clone(),
            next_since,
            revision: self.revision,
            more: next_since < self.revision,
            changes,
        })
    }

    pub fn to_image(&self) -> CatalogImage {
        CatalogImage {
            snapshot: self.snapshot(),
            changes: self.changes.iter().cloned().collect(),
            auth: self.auth.clone(),
            replicas: replicas::to_images(&self.replicas),
        }
    }

    pub fn auth(&self) -> &AuthState {
        &self.auth
    }

    pub fn from_image(limits: Limits, img: CatalogImage) -> Self {
        let mut c = Catalog::new(limits);
        let s = img.snapshot;
        c.catalog_id = s.catalog_id;
        c.revision = s.revision;
        c.tenants = s.tenants.into_iter().map(|t| (t.name.clone(), t)).collect();
        c.namespaces = s
            .namespaces
            .into_iter()
            .map(|n| ((n.tenant.clone(), n.name.clone()), n))
            .collect();
        c.streams = s
            .streams
            .into_iter()
            .map(|x| (key(&x.tenant, &x.namespace, &x.name), x))
            .collect();
        c.caches = s
            .caches
            .into_iter()
            .map(|x| (key(&x.tenant, &x.namespace, &x.name), x))
            .collect();
        c.brokers = s.brokers.into_iter().map(|b| (b.node_id, b)).collect();
        c.placement_held = s.placement_held;
        c.changes = img.changes.into_iter().collect();
        c.auth = img.auth;
        c.replicas = replicas::from_images(img.replicas);
        c.trim();
        c
    }

    fn object_count(&self) -> usize {
        self.tenants.len() + self.namespaces.len() + self.streams.len() + self.caches.len()
    }

    // ---------------------------------------------------------------- writes

    /// Apply one command. A refusal changes nothing.
    pub fn apply(&mut self, cmd: &Command) -> Outcome {
        match cmd {
            Command::Init {
                catalog_id,
                hold_placement,
            } => {
                if self.catalog_id.is_empty() && !catalog_id.is_empty() {
                    self.catalog_id = catalog_id.clone();
                    self.placement_held = *hold_placement;
                }
                Ok(Reply::Done)
            }
            Command::ReleasePlacement => {
                if self.placement_held {
                    self.placement_held = false;
                    self.place_all();
                }
                Ok(Reply::Done)
            }
            Command::Auth { cmd } => self.auth.apply(cmd).map(|()| Reply::Done),
            Command::CreateTenant { req } => self.create_tenant(req),
            Command::UpdateTenant { name, req } => {
                let d = self.description(&req.description)?;
                let rev = self.revision + 1;
                let t = self.tenant(name)?.clone();
                let Some(d) = d else {
                    return Ok(Reply::Tenant(t));
                };
                let t = Tenant {
                    description: d,
                    revision: rev,
                    ..t
                };
                self.tenants.insert(t.name.clone(), t.clone());
                self.emit(ChangeEvent::TenantPut { tenant: t.clone() });
                Ok(Reply::Tenant(t))
            }
            Command::DeleteTenant { name } => {
                self.tenant(name)?;
                if self.namespaces.keys().any(|(t, _)| t == name) {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!("tenant {name} still has namespaces; delete them first"),
                    ));
                }
                self.tenants.remove(name);
                self.emit(ChangeEvent::TenantDeleted { name: name.clone() });
                Ok(Reply::Done)
            }
            Command::CreateNamespace { tenant, req } => self.create_namespace(tenant, req),
            Command::UpdateNamespace { tenant, name, req } => {
                let d = self.description(&req.description)?;
                let rev = self.revision + 1;
                let n = self.namespace(tenant, name)?.clone();
                let Some(d) = d else {
                    return Ok(Reply::Namespace(n));
                };
                let n = Namespace {
                    description: d,
                    revision: rev,
                    ..n
                };
                self.namespaces
                    .insert((tenant.clone(), name.clone()), n.clone());
                self.emit(ChangeEvent::NamespacePut {
                    namespace: n.clone(),
                });
                Ok(Reply::Namespace(n))
            }
            Command::DeleteNamespace { tenant, name } => {
                self.namespace(tenant, name)?;
                let has_streams = !in_ns(&self.streams, tenant, name).is_empty();
                let has_caches = !in_ns(&self.caches, tenant, name).is_empty();
                if has_streams || has_caches {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!("namespace {tenant}/{name} still has streams or caches (possibly still deleting); delete them first"),
                    ));
                }
                self.namespaces.remove(&(tenant.clone(), name.clone()));
                self.emit(ChangeEvent::NamespaceDeleted {
                    tenant: tenant.clone(),
                    name: name.clone(),
                });
                Ok(Reply::Done)
            }
            Command::CreateStream {
                tenant,
                namespace,
                req,
            } => self.create_stream(tenant, namespace, req),
            Command::UpdateStream {
                tenant,
                namespace,
                name,
                req,
            } => self.update_stream(tenant, namespace, name, req),
            Command::DeleteStream {
                tenant,
                namespace,
                name,
            } => {
                let s = self.stream(tenant, namespace, name)?.clone();
                if s.state == ResourceState::Deleting {
                    return Ok(Reply::Stream(s));
                }
                let s = Stream {
                    state: ResourceState::Deleting,
                    revision: self.revision + 1,
                    ..s
                };
                self.streams.insert(key(tenant, namespace, name), s.clone());
                self.emit(ChangeEvent::StreamPut { stream: s.clone() });
                Ok(Reply::Stream(s))
            }
            Command::FinishStreamDelete {
                tenant,
                namespace,
                name,
                revision,
            } => {
                let k = key(tenant, namespace, name);
                if self
                    .streams
                    .get(&k)
                    .is_some_and(|s| s.state == ResourceState::Deleting && s.revision == *revision)
                {
                    self.streams.remove(&k);
                    self.forget_replicas(&k);
                    self.emit(ChangeEvent::StreamDeleted {
                        tenant: tenant.clone(),
                        namespace: namespace.clone(),
                        name: name.clone(),
                    });
                }
                Ok(Reply::Done)
            }
            Command::CreateCache {
                tenant,
                namespace,
                req,
            } => self.create_cache(tenant, namespace, req),
            Command::UpdateCache {
                tenant,
                namespace,
                name,
                req,
            } => self.update_cache(tenant, namespace, name, req),
            Command::DeleteCache {
                tenant,
                namespace,
                name,
            } => {
                let c = self.cache(tenant, namespace, name)?.clone();
                if c.state == ResourceState::Deleting {
                    return Ok(Reply::Cache(c));
                }
                let c = Cache {
                    state: ResourceState::Deleting,
                    revision: self.revision + 1,
                    ..c
                };
                self.caches.insert(key(tenant, namespace, name), c.clone());
                self.emit(ChangeEvent::CachePut { cache: c.clone() });
                Ok(Reply::Cache(c))
            }
            Command::FinishCacheDelete {
                tenant,
                namespace,
                name,
                revision,
            } => {
                let k = key(tenant, namespace, name);
                if self
                    .caches
                    .get(&k)
                    .is_some_and(|s| s.state == ResourceState::Deleting && s.revision == *revision)
                {
                    self.caches.remove(&k);
                    self.emit(ChangeEvent::CacheDeleted {
                        tenant: tenant.clone(),
                        namespace: namespace.clone(),
                        name: name.clone(),
                    });
                }
                Ok(Reply::Done)
            }
            Command::RegisterBroker { req } => self.register_broker(req),
            Command::ReplicaReport {
                tenant,
                namespace,
                stream,
                shard,
                report,
            } => self.replica_report(tenant, namespace, stream, *shard, report),
            Command::AbandonShard {
                tenant,
                namespace,
                stream,
                shard,
                to,
            } => self.abandon_shard(tenant, namespace, stream, *shard, *to),
            Command::ReplaceReplicas { node_id } => Ok(Reply::Replaced {
                shards: self.replace_replicas(*node_id),
            }),
            Command::SetBrokerLive { node_id, live } => {
                let b = self.broker(*node_id)?.clone();
                if b.live == *live {
                    return Ok(Reply::Broker(b));
                }
                let b = Broker {
                    live: *live,
                    revision: self.revision + 1,
                    ..b
                };
                self.brokers.insert(*node_id, b.clone());
                self.emit(ChangeEvent::BrokerPut { broker: b.clone() });
                self.place_all();
                Ok(Reply::Broker(b))
            }
        }
    }

    fn emit(&mut self, event: ChangeEvent) {
        self.revision += 1;
        self.changes.push_back(Change {
            revision: self.revision,
            event,
        });
        self.trim();
    }

    fn trim(&mut self) {
        while self.changes.len() > self.limits.change_log_len {
            self.changes.pop_front();
        }
    }

    /// `Some(None)` clears, `Some(Some(d))` sets, `None` leaves unchanged.
    #[allow(clippy::option_option)]
    fn description(&self, d: &Option<String>) -> Result<Option<Option<String>>, ApiError> {
        match d {
            None => Ok(None),
            Some(s) if s.is_empty() => Ok(Some(None)),
            Some(s) if s.len() > self.limits.max_description_bytes => {
                Err(ApiError::invalid(format!(
                    "description is {} bytes; the maximum is {}",
                    s.len(),
                    self.limits.max_description_bytes
                )))
            }
            Some(s) if s.chars().any(|c| c.is_control()) => Err(ApiError::invalid(
                "description must not contain control characters",
            )),
            Some(s) => Ok(Some(Some(s.clone()))),
        }
    }

    fn room(&self) -> Result<(), ApiError> {
        if self.object_count() >= self.limits.max_objects {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "the catalog holds its maximum of {} objects",
                    self.limits.max_objects
                ),
            ));
        }
        Ok(())
    }

    fn shards(&self, shards: Option<u32>) -> Result<u32, ApiError> {
        let n = shards.unwrap_or(1);
        if n == 0 || n > self.limits.max_shards {
            return Err(ApiError::invalid(format!(
                "shards must be 1..={}, got {n}",
                self.limits.max_shards
            )));
        }
        Ok(n)
    }

    fn create_tenant(&mut self, req: &CreateTenant) -> Outcome {
        check_name("tenant", &req.name)?;
        let d = self.description(&req.description)?.flatten();
        if self.tenants.contains_key(&req.name) {
            return Err(ApiError::new(
                ErrorCode::AlreadyExists,
                format!("tenant {} already exists", req.name),
            ));
        }
        self.room()?;
        let rev = self.revision + 1;
        let t = Tenant {
            name: req.name.clone(),
            description: d,
            created_revision: rev,
            revision: rev,
        };
        self.tenants.insert(t.name.clone(), t.clone());
        self.emit(ChangeEvent::TenantPut { tenant: t.clone() });
        Ok(Reply::Tenant(t))
    }

    fn create_namespace(&mut self, tenant: &str, req: &CreateNamespace) -> Outcome {
        self.tenant(tenant)?;
        check_name("namespace", &req.name)?;
        let d = self.description(&req.description)?.flatten();
        let k = (tenant.to_string(), req.name.clone());
        if self.namespaces.contains_key(&k) {
            return Err(ApiError::new(
                ErrorCode::AlreadyExists,
                format!("namespace {tenant}/{} already exists", req.name),
            ));
        }
        self.room()?;
        let rev = self.revision + 1;
        let n = Namespace {
            tenant: tenant.to_string(),
            name: req.name.clone(),
            description: d,
            created_revision: rev,
            revision: rev,
        };
        self.namespaces.insert(k, n.clone());
        self.emit(ChangeEvent::NamespacePut {
            namespace: n.clone(),
        });
        Ok(Reply::Namespace(n))
    }

    /// The replication a new stream asks for, checked in this order: a factor of 1..=5;
    /// more than one copy or `quorum` only on a durable stream (an ephemeral one keeps no
    /// log to replicate); no more copies than brokers registered (each copy needs its own).
    /// A request that passes and asks for more than one copy or `quorum` is still refused
    /// `unsupported`, unless [`Limits::replication_preview`]: replication is partial
    /// (docs/replication-design.md).
    fn replication(
        consistency: Option<Consistency>,
        rf: Option<u32>,
        durable: bool,
        brokers: usize,
        preview: bool,
    ) -> Result<(Consistency, u32), ApiError> {
        let c = consistency.unwrap_or_default();
        let rf = rf.unwrap_or(1);
        if !(1..=REPLICATION_FACTOR_MAX).contains(&rf) {
            return Err(ApiError::invalid(format!(
                "replication_factor must be 1..={REPLICATION_FACTOR_MAX}, got {rf}"
            )));
        }
        if (rf > 1 || c == Consistency::Quorum) && !durable {
            return Err(ApiError::invalid(format!(
                "replication_factor {rf} with consistency {c:?} needs a durable stream: an ephemeral stream keeps no log to replicate"
            )));
        }
        if rf as usize > brokers && rf > 1 {
            return Err(ApiError::invalid(format!(
                "replication_factor {rf} needs {rf} brokers, one per copy; {brokers} registered"
            )));
        }
        if preview {
            return Ok((c, rf));
        }
        if rf > 1 {
            return Err(ApiError::new(
                ErrorCode::Unsupported,
                format!("replication_factor {rf} is not supported yet: shards are not replicated in this build (use 1)"),
            ));
        }
        if c == Consistency::Quorum {
            return Err(ApiError::new(
                ErrorCode::Unsupported,
                "consistency quorum is not supported yet: shards are not replicated in this build (use leader)",
            ));
        }
        Ok((c, rf))
    }

    fn obj_exists<T>(
        map: &BTreeMap<ObjKey, T>,
        k: &ObjKey,
        what: &str,
        state: impl Fn(&T) -> ResourceState,
    ) -> Result<(), ApiError> {
        match map.get(k).map(state) {
            Some(ResourceState::Active) => Err(ApiError::new(
                ErrorCode::AlreadyExists,
                format!("{what} {}/{}/{} already exists", k.0, k.1, k.2),
            )),
            Some(ResourceState::Deleting) => Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "{what} {}/{}/{} is still being deleted; retry once it is gone",
                    k.0, k.1, k.2
                ),
            )),
            None => Ok(()),
        }
    }

    fn create_stream(&mut self, tenant: &str, namespace: &str, req: &CreateStream) -> Outcome {
        self.namespace(tenant, namespace)?;
        check_name("stream", &req.name)?;
        let shards = self.shards(req.shards)?;
        let (consistency, replication_factor) = Self::replication(
            req.consistency,
            req.replication_factor,
            req.durable,
            self.brokers.len(),
            self.limits.replication_preview,
        )?;
        let k = key(tenant, namespace, &req.name);
        Self::obj_exists(&self.streams, &k, "stream", |s| s.state)?;
        self.room()?;
        let rev = self.revision + 1;
        let mut s = Stream {
            tenant: tenant.to_string(),
            namespace: namespace.to_string(),
            name: req.name.clone(),
            shards,
            durable: req.durable,
            retention_bytes: nz(req.retention_bytes),
            retention_seconds: nz(req.retention_seconds),
            fsync: req.fsync.unwrap_or_default(),
            consistency,
            replication_factor,
            state: ResourceState::Active,
            created_revision: rev,
            revision: rev,
            placement: placement::unplaced(shards),
        };
        if !self.placement_held {
            replicas::place_stream(&mut s, &k, &mut self.replicas, &self.brokers);
        }
        self.streams.insert(k, s.clone());
        self.emit(ChangeEvent::StreamPut { stream: s.clone() });
        Ok(Reply::Stream(s))
    }

    fn fixed<T: PartialEq + std::fmt::Debug>(
        field: &str,
        now: T,
        asked: Option<T>,
    ) -> Result<(), ApiError> {
        match asked {
            Some(a) if a != now => Err(ApiError::new(
                ErrorCode::Unsupported,
                format!("{field} cannot change after creation (is {now:?}, asked {a:?})"),
            )),
            _ => Ok(()),
        }
    }

    fn update_stream(
        &mut self,
        tenant: &str,
        namespace: &str,
        name: &str,
        req: &UpdateStream,
    ) -> Outcome {
        let cur = self.stream(tenant, namespace, name)?.clone();
        if cur.state == ResourceState::Deleting {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!("stream {tenant}/{namespace}/{name} is being deleted"),
            ));
        }
        Self::fixed("shards", cur.shards, req.shards)?;
        Self::fixed("durable", cur.durable, req.durable)?;
        // A stream's copies and what acknowledges a write are settled at creation: moving
        // between them would need a reconfiguration protocol nothing implements.
        Self::fixed(
            "replication_factor",
            cur.replication_factor,
            req.replication_factor,
        )?;
        Self::fixed("consistency", cur.consistency, req.consistency)?;
        let (consistency, replication_factor) = (cur.consistency, cur.replication_factor);
        let mut s = cur.clone();
        if let Some(b) = req.retention_bytes {
            s.retention_bytes = nz(Some(b));
        }
        if let Some(b) = req.retention_seconds {
            s.retention_seconds = nz(Some(b));
        }
        if let Some(f) = req.fsync {
            s.fsync = f;
        }
        s.consistency = consistency;
        s.replication_factor = replication_factor;
        if s == cur {
            return Ok(Reply::Stream(cur));
        }
        s.revision = self.revision + 1;
        self.streams.insert(key(tenant, namespace, name), s.clone());
        self.emit(ChangeEvent::StreamPut { stream: s.clone() });
        Ok(Reply::Stream(s))
    }

    fn create_cache(&mut self, tenant: &str, namespace: &str, req: &CreateCache) -> Outcome {
        self.namespace(tenant, namespace)?;
        check_name("cache", &req.name)?;
        check_ttl(req.ttl_seconds)?;
        let shards = self.shards(req.shards)?;
        let k = key(tenant, namespace, &req.name);
        Self::obj_exists(&self.caches, &k, "cache", |c| c.state)?;
        self.room()?;
        let rev = self.revision + 1;
        let mut c = Cache {
            tenant: tenant.to_string(),
            namespace: namespace.to_string(),
            name: req.name.clone(),
            shards,
            durable: req.durable,
            ttl_seconds: nz(req.ttl_seconds),
            state: ResourceState::Active,
            created_revision: rev,
            revision: rev,
            placement: placement::unplaced(shards),
        };
        if !self.placement_held {
            placement::place(&mut c.placement, c.durable, &self.live());
        }
        self.caches.insert(k, c.clone());
        self.emit(ChangeEvent::CachePut { cache: c.clone() });
        Ok(Reply::Cache(c))
    }

    fn update_cache(
        &mut self,
        tenant: &str,
        namespace: &str,
        name: &str,
        req: &UpdateCache,
    ) -> Outcome {
        let cur = self.cache(tenant, namespace, name)?.clone();
        if cur.state == ResourceState::Deleting {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!("cache {tenant}/{namespace}/{name} is being deleted"),
            ));
        }
        Self::fixed("shards", cur.shards, req.shards)?;
        Self::fixed("durable", cur.durable, req.durable)?;
        check_ttl(req.ttl_seconds)?;
        let mut c = cur.clone();
        if let Some(t) = req.ttl_seconds {
            c.ttl_seconds = nz(Some(t));
        }
        if c == cur {
            return Ok(Reply::Cache(cur));
        }
        c.revision = self.revision + 1;
        self.caches.insert(key(tenant, namespace, name), c.clone());
        self.emit(ChangeEvent::CachePut { cache: c.clone() });
        Ok(Reply::Cache(c))
    }

    fn register_broker(&mut self, req: &RegisterBroker) -> Outcome {
        if req.node_id == 0 {
            return Err(ApiError::invalid("node_id must be at least 1"));
        }
        if req.cores == 0 || req.cores > self.limits.max_cores {
            return Err(ApiError::invalid(format!(
                "cores must be 1..={}, got {}",
                self.limits.max_cores, req.cores
            )));
        }
        check_addr(&req.quic_addr)?;
        if let Some(p) = &req.peer_addr {
            check_addr(p).map_err(|_| {
                ApiError::invalid(format!("peer_addr must be host:port, got {p:?}"))
            })?;
        }
        if let Some(id) = &req.storage_id {
            check_storage_id(id)?;
        }
        let prev = self.brokers.get(&req.node_id).cloned();
        if prev.is_none() && self.brokers.len() >= self.limits.max_brokers {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "the catalog holds its maximum of {} brokers",
                    self.limits.max_brokers
                ),
            ));
        }
        // The identity's revision moves only when the identity does (rule 9).
        let storage_id_since = match (&prev, &req.storage_id) {
            (_, None) => None,
            (Some(p), Some(id)) if p.storage_id.as_ref() == Some(id) => p.storage_id_since,
            (_, Some(_)) => Some(self.revision + 1),
        };
        let b = Broker {
            node_id: req.node_id,
            quic_addr: req.quic_addr.clone(),
            cores: req.cores,
            live: true,
            incarnation: prev.as_ref().map(|p| p.incarnation + 1).unwrap_or(1),
            revision: self.revision + 1,
            peer_addr: req.peer_addr.clone(),
            storage_id: req.storage_id.clone(),
            storage_id_since,
        };
        self.brokers.insert(b.node_id, b.clone());
        self.register_replica_identity(b.node_id, b.storage_id.as_deref());
        if prev.is_some() {
            self.replica_leader_restarted(b.node_id);
        }
        self.emit(ChangeEvent::BrokerPut { broker: b.clone() });
        self.place_all();
        Ok(Reply::Broker(b))
    }

    fn live(&self) -> BTreeSet<u64> {
        self.brokers
            .values()
            .filter(|b| b.live)
            .map(|b| b.node_id)
            .collect()
    }

    /// Re-run placement over every active stream and cache; emit one change per resource that
    /// moved.
    fn place_all(&mut self) {
        if self.placement_held {
            return; // the settle window: ReleasePlacement places everything at once
        }
        let live = self.live();
        let mut moved_streams = Vec::new();
        for (k, s) in self.streams.iter_mut() {
            if s.state == ResourceState::Active
                && replicas::place_stream(s, k, &mut self.replicas, &self.brokers)
            {
                moved_streams.push(k.clone());
            }
        }
        for k in moved_streams {
            let rev = self.revision + 1;
            let s = self.streams.get_mut(&k).expect("present");
            s.revision = rev;
            let s = s.clone();
            self.emit(ChangeEvent::StreamPut { stream: s });
        }
        let mut moved_caches = Vec::new();
        for (k, c) in self.caches.iter_mut() {
            if c.state == ResourceState::Active
                && placement::place(&mut c.placement, c.durable, &live)
            {
                moved_caches.push(k.clone());
            }
        }
        for k in moved_caches {
            let rev = self.revision + 1;
            let c = self.caches.get_mut(&k).expect("present");
            c.revision = rev;
            let c = c.clone();
            self.emit(ChangeEvent::CachePut { cache: c });
        }
    }
}

fn key(t: &str, n: &str, s: &str) -> ObjKey {
    (t.to_string(), n.to_string(), s.to_string())
}

fn in_ns<T: Clone>(m: &BTreeMap<ObjKey, T>, tenant: &str, namespace: &str) -> Vec<T> {
    m.range((tenant.to_string(), namespace.to_string(), String::new())..)
        .take_while(|((t, n, _), _)| t == tenant && n == namespace)
        .map(|(_, v)| v.clone())
        .collect()
}

/// `host:port` with a non-empty host of sane characters and a non-zero port.
/// The most copies a stream may ask for.
pub const REPLICATION_FACTOR_MAX: u32 = 5;

/// A storage identity as brokers write it: 16 lowercase hex digits.
pub fn check_storage_id(id: &str) -> Result<(), ApiError> {
    if id.len() == 16 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(())
    } else {
        Err(ApiError::invalid(format!(
            "storage_id must be 16 lowercase hex digits, got {id:?}"
        )))
    }
}

pub fn check_addr(a: &str) -> Result<(), ApiError> {
    let bad = || ApiError::invalid(format!("quic_addr must be host:port, got {a:?}"));
    if a.len() > 255 {
        return Err(bad());
    }
    let (host, port) = a.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    if port == 0 || host.is_empty() {
        return Err(bad());
    }
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if !host
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '_'))
    {
        return Err(bad());
    }
    Ok(())
}

#[cfg(test)]
mod tests;

/// Longest default TTL of a cache, seconds (about 10 years: what a broker accepts).
pub const TTL_SECONDS_MAX: u64 = 10 * 365 * 24 * 60 * 60;

fn check_ttl(ttl_seconds: Option<u64>) -> Result<(), ApiError> {
    match ttl_seconds {
        Some(t) if t > TTL_SECONDS_MAX => Err(ApiError::invalid(format!(
            "ttl_seconds must be at most {TTL_SECONDS_MAX} (about 10 years), got {t}"
        ))),
        _ => Ok(()),
    }
}

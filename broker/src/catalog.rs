//! The broker's catalog. Standalone: streams declared in a YAML file (`--catalog`), with a
//! built-in default (`default/default/events`, 4 shards) so the out-of-the-box start works.
//! With a control plane (`FELIX_CONTROLPLANE_URL`): versions built from the control plane's
//! catalog by the ops thread (`control_link`), with per-shard placement.

use felix_quic::wire::{validate_name, ErrorCode, StreamName};
use serde::Deserialize;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamDef {
    pub tenant: String,
    pub namespace: String,
    pub stream: String,
    #[serde(default = "default_shards")]
    pub shards: u32,
    /// Persist records in a segment log (needs `durable_storage_dir`).
    #[serde(default)]
    pub durable: bool,
    /// Per-stream fsync mode (on_commit, periodic, none); default `durable_fsync`.
    #[serde(default)]
    pub fsync: Option<String>,
    /// Per-stream retention by size, bytes per shard; default `durable_retention_bytes`.
    #[serde(default)]
    pub retention_bytes: Option<u64>,
    /// Per-stream retention by age, seconds; default `durable_retention_seconds`.
    #[serde(default)]
    pub retention_seconds: Option<u64>,
    /// A replicated stream's publishes are acknowledged at the commit mark (`quorum`), not
    /// when the leader has written them (`leader`). Only the control plane sets it.
    #[serde(skip)]
    pub quorum: bool,
}

impl StreamDef {
    pub fn name(&self) -> StreamName {
        StreamName::new(&self.tenant, &self.namespace, &self.stream)
    }
}

fn default_shards() -> u32 {
    4
}

/// A cache: key -> value with TTL and watches, served per shard by one core
/// (`crate::core::caches`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheDef {
    pub tenant: String,
    pub namespace: String,
    pub cache: String,
    #[serde(default = "default_shards")]
    pub shards: u32,
    /// Log-backed (needs `durable_storage_dir`; a broker without one refuses such a cache
    /// `unsupported` rather than serving it from memory under a durable name).
    #[serde(default)]
    pub durable: bool,
    /// TTL of a put that names none; `None`: such entries do not expire.
    #[serde(default)]
    pub default_ttl_ms: Option<u64>,
}

impl CacheDef {
    pub fn name(&self) -> StreamName {
        StreamName::new(&self.tenant, &self.namespace, &self.cache)
    }
}

/// What slots of both kinds need of their definition.
pub trait Def: Clone {
    fn def_name(&self) -> StreamName;
    fn def_shards(&self) -> u32;
    fn check(&self) -> Result<(), String>;
}

impl Def for StreamDef {
    fn def_name(&self) -> StreamName {
        self.name()
    }
    fn def_shards(&self) -> u32 {
        self.shards
    }
    fn check(&self) -> Result<(), String> {
        Catalog::check_def(self)
    }
}

impl Def for CacheDef {
    fn def_name(&self) -> StreamName {
        self.name()
    }
    fn def_shards(&self) -> u32 {
        self.shards
    }
    fn check(&self) -> Result<(), String> {
        for n in [&self.tenant, &self.namespace, &self.cache] {
            validate_name(n)?;
        }
        if self.shards == 0 || self.shards > SHARDS_MAX {
            return Err(format!(
                "cache {}: shards must be 1..={SHARDS_MAX}",
                self.cache
            ));
        }
        if let Some(t) = self.default_ttl_ms {
            if t == 0 || t > crate::cache::TTL_LIMIT_MS {
                return Err(format!(
                    "cache {}: default_ttl_ms must be 1..={}",
                    self.cache,
                    crate::cache::TTL_LIMIT_MS
                ));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct CatalogFile {
    #[serde(default)]
    streams: Vec<StreamDef>,
    #[serde(default)]
    caches: Vec<CacheDef>,
}

/// Where one shard of a stream is served, as this broker sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// This broker owns it (standalone: every shard), at the control plane's generation.
    Mine { generation: u64 },
    /// Another live broker owns it.
    Elsewhere {
        owner: u64,
        addr: String,
        generation: u64,
    },
    /// No live broker owns it.
    Unassigned,
    /// Durable and owned by a broker that is down; it is not moved (offsets would reset).
    OwnerDown { owner: u64 },
    /// A shard of a stream of more than one copy (a control plane run with
    /// `--replication-preview`): its replicas (`core/replica_host.rs`) keep it, and the one
    /// placement names leader serves it once its machine leads. `leader` is that replica (0:
    /// none qualifies), `mine` whether it is this broker, `replicas` the replica set (the
    /// leader first), `settled` the settled set while a change of set has not settled (rule
    /// 11; empty once it has: the set).
    Replicated {
        leader: u64,
        mine: bool,
        generation: u64,
        replicas: Vec<u64>,
        settled: Vec<u64>,
    },
}

/// One stream incarnation. Slots are never reused within a process: the slot index is the
/// stream's identity on the data path (mesh messages, shard keys), so a stream deleted and
/// created again under the same name is a different slot and nothing of the old one leaks
/// into it.
#[derive(Debug, Clone)]
pub struct Slot<D = StreamDef> {
    pub def: D,
    /// The control plane's `created_revision` (0 for the standalone catalog).
    pub incarnation: u64,
    pub deleted: bool,
    /// One entry per shard.
    pub places: Vec<Place>,
}

/// A catalog version, identical on every core. Cores hold an `Arc` of the latest one they
/// have seen (see [`CatalogCell`]).
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    slots: Vec<Slot>,
    index: HashMap<StreamName, usize>,
    /// Caches: their own slots (cache slot indexes are cache identities on the data path).
    cache_slots: Vec<Slot<CacheDef>>,
    cache_index: HashMap<StreamName, usize>,
    tenants: HashSet<String>,
    namespaces: HashSet<(String, String)>,
    /// The control plane's catalog revision this version reflects (0 standalone).
    pub revision: u64,
    /// Registration superseded (another process registered under this node id): serve nothing.
    pub fenced: bool,
    /// The peer listener of every broker that has one (`node id → host:port`).
    pub peer_addrs: HashMap<u64, String>,
    /// The registered storage identity of every broker that sent one (an assignment names
    /// its leader's, replication rule 9).
    pub storage_ids: HashMap<u64, u64>,
    /// The client address of every registered broker (`node id → host:port`).
    pub broker_addrs: HashMap<u64, String>,
    /// The cluster's identity (the control plane's catalog id; empty standalone).
    pub cluster_id: String,
}

/// Maximum shards per stream.
pub const SHARDS_MAX: u32 = 4096;

impl Catalog {
    pub fn default_catalog() -> Self {
        Self::from_defs_and_caches(
            vec![StreamDef {
                tenant: "default".into(),
                namespace: "default".into(),
                stream: "events".into(),
                shards: 4,
                durable: false,
                fsync: None,
                retention_bytes: None,
                retention_seconds: None,
                quorum: false,
            }],
            vec![CacheDef {
                tenant: "default".into(),
                namespace: "default".into(),
                cache: "kv".into(),
                shards: 4,
                durable: false,
                default_ttl_ms: None,
            }],
        )
        .expect("built-in catalog is valid")
    }

    pub fn from_yaml(text: &str) -> Result<Self, String> {
        let f: CatalogFile = serde_saphyr::from_str(text).map_err(|e| e.to_string())?;
        Self::from_defs_and_caches(f.streams, f.caches)
    }

    fn check_def(s: &StreamDef) -> Result<(), String> {
        for n in [&s.tenant, &s.namespace, &s.stream] {
            validate_name(n)?;
        }
        if s.shards == 0 || s.shards > SHARDS_MAX {
            return Err(format!(
                "stream {}: shards must be 1..={SHARDS_MAX}",
                s.stream
            ));
        }
        if let Some(f) = &s.fsync {
            felix_storage::FsyncMode::parse(f, 1)
                .map_err(|e| format!("stream {}: {e}", s.stream))?;
        }
        if !s.durable
            && (s.fsync.is_some() || s.retention_bytes.is_some() || s.retention_seconds.is_some())
        {
            return Err(format!(
                "stream {}: fsync and retention apply only to durable streams",
                s.stream
            ));
        }
        Ok(())
    }

    /// The standalone catalog: every shard is this broker's.
    pub fn from_defs(streams: Vec<StreamDef>) -> Result<Self, String> {
        Self::from_defs_and_caches(streams, Vec::new())
    }

    /// The standalone catalog of streams and caches.
    pub fn from_defs_and_caches(
        streams: Vec<StreamDef>,
        caches: Vec<CacheDef>,
    ) -> Result<Self, String> {
        let mut c = Catalog::default();
        for d in caches {
            d.check()?;
            let name = d.name();
            if c.cache_index.contains_key(&name) {
                return Err(format!("cache {name} declared twice"));
            }
            c.tenants.insert(d.tenant.clone());
            c.namespaces.insert((d.tenant.clone(), d.namespace.clone()));
            c.cache_index.insert(name, c.cache_slots.len());
            c.cache_slots.push(Slot {
                places: vec![Place::Mine { generation: 0 }; d.shards as usize],
                def: d,
                incarnation: 0,
                deleted: false,
            });
        }
        for s in streams {
            Self::check_def(&s)?;
            let name = s.name();
            if c.index.contains_key(&name) {
                return Err(format!("stream {name} declared twice"));
            }
            c.tenants.insert(s.tenant.clone());
            c.namespaces.insert((s.tenant.clone(), s.namespace.clone()));
            c.index.insert(name, c.slots.len());
            c.slots.push(Slot {
                places: vec![Place::Mine { generation: 0 }; s.shards as usize],
                def: s,
                incarnation: 0,
                deleted: false,
            });
        }
        Ok(c)
    }

    /// The next version after `prev`, from the control plane's view. Pure: slots of `prev`
    /// keep their index (a stream gone from `view`, being deleted, or replaced by a new
    /// incarnation is marked deleted), new incarnations get new slots at the end.
    pub fn from_view(prev: &Catalog, view: &ControlView, node_id: u64, fenced: bool) -> Catalog {
        let (slots, index) = merge_slots(&prev.slots, &view.streams, view, node_id);
        let (cache_slots, cache_index) =
            merge_slots(&prev.cache_slots, &view.caches, view, node_id);
        Catalog {
            slots,
            index,
            cache_slots,
            cache_index,
            tenants: view.tenants.clone(),
            namespaces: view.namespaces.clone(),
            revision: view.revision,
            fenced,
            peer_addrs: view.peer_addrs.clone(),
            storage_ids: view.storage_ids.clone(),
            broker_addrs: view.broker_addrs.clone(),
            cluster_id: view.cluster_id.clone(),
        }
    }

    /// Resolve an active stream, with the registry error a client should see.
    pub fn lookup(&self, name: &StreamName) -> Result<(usize, &StreamDef), (ErrorCode, String)> {
        self.check_names(name)?;
        if let Some(&i) = self.index.get(name) {
            return Ok((i, &self.slots[i].def));
        }
        self.scope_check(name)?;
        Err((
            ErrorCode::UnknownStream,
            format!("stream {name} does not exist"),
        ))
    }

    /// Resolve an active cache (`name.stream` is the cache name).
    pub fn lookup_cache(
        &self,
        name: &StreamName,
    ) -> Result<(usize, &CacheDef), (ErrorCode, String)> {
        self.check_names(name)?;
        if let Some(&i) = self.cache_index.get(name) {
            return Ok((i, &self.cache_slots[i].def));
        }
        self.scope_check(name)?;
        Err((ErrorCode::NotFound, format!("cache {name} does not exist")))
    }

    fn check_names(&self, name: &StreamName) -> Result<(), (ErrorCode, String)> {
        for n in [&name.tenant, &name.namespace, &name.stream] {
            validate_name(n).map_err(|m| (ErrorCode::InvalidName, m))?;
        }
        Ok(())
    }

    fn scope_check(&self, name: &StreamName) -> Result<(), (ErrorCode, String)> {
        if !self.tenants.contains(&name.tenant) {
            return Err((
                ErrorCode::UnknownTenant,
                format!("tenant {} does not exist", name.tenant),
            ));
        }
        if !self
            .namespaces
            .contains(&(name.tenant.clone(), name.namespace.clone()))
        {
            return Err((
                ErrorCode::UnknownNamespace,
                format!(
                    "namespace {}/{} does not exist",
                    name.tenant, name.namespace
                ),
            ));
        }
        Ok(())
    }

    /// Whether this broker serves `shard` of slot `idx` now; else the typed refusal (a
    /// redirect naming the owner when another broker has it).
    pub fn serve_check(&self, idx: u32, shard: u32) -> Result<(), (ErrorCode, String)> {
        let slot = &self.slots[idx as usize];
        if slot.deleted {
            return Err((
                ErrorCode::StreamDeleted,
                format!("stream {} was deleted", slot.def.name()),
            ));
        }
        self.place_check(&slot.def.name(), &slot.places, shard)
    }

    /// [`Catalog::serve_check`] for a cache shard.
    pub fn cache_serve_check(&self, idx: u32, shard: u32) -> Result<(), (ErrorCode, String)> {
        let slot = &self.cache_slots[idx as usize];
        if slot.deleted {
            return Err((
                ErrorCode::NotFound,
                format!("cache {} was deleted", slot.def.name()),
            ));
        }
        self.place_check(&slot.def.name(), &slot.places, shard)
    }

    /// The owner broker of each shard of stream slot `idx` (`own` for this broker's; 0 when
    /// none is placed): what `StreamInfo.owners` tells clients.
    pub fn shard_owners(&self, idx: usize, own: u64) -> Vec<u64> {
        owners_of(&self.slots[idx].places, own)
    }

    /// [`Catalog::shard_owners`] of cache slot `idx`.
    pub fn cache_shard_owners(&self, idx: usize, own: u64) -> Vec<u64> {
        owners_of(&self.cache_slots[idx].places, own)
    }
}

/// The owner node of each place (`own` for this broker's; 0 when none is placed).
fn owners_of(places: &[Place], own: u64) -> Vec<u64> {
    places
        .iter()
        .map(|p| match p {
            Place::Mine { .. } => own,
            Place::Elsewhere { owner, .. } | Place::OwnerDown { owner } => *owner,
            Place::Replicated { leader, .. } => *leader,
            Place::Unassigned => 0,
        })
        .collect()
}

impl Catalog {
    /// Where to forward a request for shard `shard` of stream (or, with `cache`, cache)
    /// slot `idx` that this broker does not own: the owner's node id, its peer address and
    /// what the owner checks the forward against. `None` when the shard is not placed on
    /// another live broker with a peer listener (the caller answers with `serve_check`'s
    /// refusal then).
    pub fn forward_target(
        &self,
        cache: bool,
        idx: u32,
        shard: u32,
    ) -> Option<(u64, String, u64, u64)> {
        let (places, incarnation, deleted) = if cache {
            let s = self.cache_slots.get(idx as usize)?;
            (&s.places, s.incarnation, s.deleted)
        } else {
            let s = self.slots.get(idx as usize)?;
            (&s.places, s.incarnation, s.deleted)
        };
        if deleted || self.fenced {
            return None;
        }
        match places.get(shard as usize)? {
            Place::Elsewhere {
                owner, generation, ..
            }
            | Place::Replicated {
                leader: owner,
                mine: false,
                generation,
                ..
            } if *owner != 0 => {
                let addr = self.peer_addrs.get(owner)?;
                Some((*owner, addr.clone(), incarnation, *generation))
            }
            _ => None,
        }
    }

    /// The owner's check of a forward: the forwarder routed by this incarnation and this
    /// placement generation, and this broker owns the shard at that generation. A forward is
    /// never forwarded again: a shard placed elsewhere is refused `not_leader` here.
    pub fn forward_check(
        &self,
        cache: bool,
        idx: u32,
        shard: u32,
        incarnation: u64,
        generation: u64,
    ) -> Result<(), (ErrorCode, String)> {
        if cache {
            self.cache_serve_check(idx, shard)?;
        } else {
            self.serve_check(idx, shard)?;
        }
        let (places, have, name) = if cache {
            let s = &self.cache_slots[idx as usize];
            (&s.places, s.incarnation, s.def.name())
        } else {
            let s = &self.slots[idx as usize];
            (&s.places, s.incarnation, s.def.name())
        };
        if have != incarnation {
            return Err((
                ErrorCode::Conflict,
                format!("{name} here is incarnation {have}, the forward names {incarnation} (deleted and made again, or a catalog behind); nothing was done"),
            ));
        }
        match places[shard as usize] {
            Place::Mine { generation: g }
            | Place::Replicated {
                mine: true,
                generation: g,
                ..
            } if g == generation => Ok(()),
            Place::Mine { generation: g }
            | Place::Replicated {
                mine: true,
                generation: g,
                ..
            } => Err((
                ErrorCode::Conflict,
                format!("shard {shard} of {name} is at placement generation {g} here, the forward names {generation}; nothing was done"),
            )),
            _ => unreachable!("serve_check passed: the shard is mine"),
        }
    }

    fn place_check(
        &self,
        name: &StreamName,
        places: &[Place],
        shard: u32,
    ) -> Result<(), (ErrorCode, String)> {
        if self.fenced {
            return Err((
                ErrorCode::Unavailable,
                "this broker's registration was superseded by another process with its node id; it serves nothing".into(),
            ));
        }
        match &places[shard as usize] {
            Place::Mine { .. } => Ok(()),
            Place::Elsewhere {
                owner,
                addr,
                generation,
            } => Err((
                ErrorCode::NotLeader,
                format!("shard {shard} of {name} is owned by broker {owner} at {addr} (generation {generation})"),
            )),
            Place::Unassigned => Err((
                ErrorCode::Unavailable,
                format!("shard {shard} of {name} has no live broker to own it"),
            )),
            Place::OwnerDown { owner } => Err((
                ErrorCode::Unavailable,
                format!("shard {shard} of {name} is durable and its owner broker {owner} is down; it is not moved"),
            )),
            Place::Replicated { mine: true, .. } => Ok(()),
            Place::Replicated {
                leader: 0,
                generation,
                ..
            } => Err((
                ErrorCode::Unavailable,
                format!("shard {shard} of {name} has no replica that may lead it (generation {generation}); it is not served until one qualifies or an operator abandons it"),
            )),
            Place::Replicated {
                leader, generation, ..
            } => {
                let addr = self
                    .broker_addrs
                    .get(leader)
                    .map_or("an unknown address", String::as_str);
                Err((
                    ErrorCode::NotLeader,
                    format!("shard {shard} of {name} is led by broker {leader} at {addr} (generation {generation})"),
                ))
            }
        }
    }

    /// Whether shard `shard` of stream slot `idx` has more than one copy (consumer groups do
    /// not serve those yet).
    pub fn replicated(&self, idx: u32, shard: u32) -> bool {
        matches!(
            self.slots[idx as usize].places.get(shard as usize),
            Some(Place::Replicated { .. })
        )
    }

    pub fn slot(&self, idx: u32) -> &Slot {
        &self.slots[idx as usize]
    }

    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    pub fn cache_slot(&self, idx: u32) -> &Slot<CacheDef> {
        &self.cache_slots[idx as usize]
    }

    pub fn cache_slots(&self) -> &[Slot<CacheDef>] {
        &self.cache_slots
    }

    /// Active stream definitions.
    pub fn streams(&self) -> impl Iterator<Item = &StreamDef> {
        self.slots.iter().filter(|s| !s.deleted).map(|s| &s.def)
    }
}

/// The next version of one kind of slots: slots of `prev` keep their index (one gone from
/// `views`, being deleted, or replaced by a new incarnation is marked deleted), new
/// incarnations get new slots at the end. Pure.
fn merge_slots<D: Def>(
    prev: &[Slot<D>],
    views: &[ViewStream<D>],
    view: &ControlView,
    node_id: u64,
) -> (Vec<Slot<D>>, HashMap<StreamName, usize>) {
    let mut slots = prev.to_vec();
    let mut index = HashMap::new();
    let mut live: HashMap<(StreamName, u64), &ViewStream<D>> = HashMap::new();
    for s in views {
        if !s.deleting {
            live.insert((s.def.def_name(), s.incarnation), s);
        }
    }
    for (i, slot) in slots.iter_mut().enumerate() {
        if slot.deleted {
            continue;
        }
        match live.remove(&(slot.def.def_name(), slot.incarnation)) {
            Some(v) => {
                // Same incarnation: settings and placement may change; the shard count and
                // durability are fixed at creation.
                debug_assert_eq!(v.def.def_shards(), slot.def.def_shards());
                slot.def = v.def.clone();
                slot.places = places(v, view, node_id);
                index.insert(slot.def.def_name(), i);
            }
            None => slot.deleted = true,
        }
    }
    let mut fresh: Vec<&ViewStream<D>> = live.into_values().collect();
    fresh.sort_by_key(|s| s.incarnation);
    for v in fresh {
        if let Err(why) = v.def.check() {
            // The control plane validates the same rules; a definition this build cannot
            // serve is left out (lookups answer unknown) rather than half-served.
            tracing::warn!(name = %v.def.def_name(), %why, "control plane definition refused by this broker");
            continue;
        }
        index.insert(v.def.def_name(), slots.len());
        slots.push(Slot {
            places: places(v, view, node_id),
            def: v.def.clone(),
            incarnation: v.incarnation,
            deleted: false,
        });
    }
    (slots, index)
}

fn places<D: Def>(v: &ViewStream<D>, view: &ControlView, node_id: u64) -> Vec<Place> {
    (0..v.def.def_shards() as usize)
        .map(|i| match v.placement.get(i) {
            Some(ViewPlace::Assigned { owner, generation }) if *owner == node_id => Place::Mine {
                generation: *generation,
            },
            Some(ViewPlace::Assigned { owner, generation }) => Place::Elsewhere {
                owner: *owner,
                addr: view
                    .broker_addrs
                    .get(owner)
                    .cloned()
                    .unwrap_or_else(|| "an unknown address".into()),
                generation: *generation,
            },
            Some(ViewPlace::OwnerDown { owner }) => Place::OwnerDown { owner: *owner },
            Some(ViewPlace::Replicated {
                leader,
                generation,
                replicas,
                settled,
            }) => Place::Replicated {
                leader: *leader,
                mine: *leader == node_id,
                generation: *generation,
                replicas: replicas.clone(),
                settled: settled.clone(),
            },
            Some(ViewPlace::Unassigned) | None => Place::Unassigned,
        })
        .collect()
}

/// What the broker needs of the control plane's catalog, independent of the REST shapes
/// (built by `control_link`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ControlView {
    pub revision: u64,
    pub tenants: HashSet<String>,
    pub namespaces: HashSet<(String, String)>,
    pub streams: Vec<ViewStream>,
    pub caches: Vec<ViewStream<CacheDef>>,
    pub broker_addrs: HashMap<u64, String>,
    /// Peer listeners (`node id → host:port`) of the brokers that have one.
    pub peer_addrs: HashMap<u64, String>,
    /// Registered storage identities (replication rule 9) of the brokers that sent one.
    pub storage_ids: HashMap<u64, u64>,
    pub cluster_id: String,
}

/// A stream (or, with `D = CacheDef`, a cache) as the control plane has it.
#[derive(Debug, Clone, PartialEq)]
pub struct ViewStream<D = StreamDef> {
    pub def: D,
    pub incarnation: u64,
    pub deleting: bool,
    pub placement: Vec<ViewPlace>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ViewPlace {
    Assigned {
        owner: u64,
        generation: u64,
    },
    Unassigned,
    OwnerDown {
        owner: u64,
    },
    /// A shard of more than one copy: see [`Place::Replicated`].
    Replicated {
        leader: u64,
        generation: u64,
        replicas: Vec<u64>,
        settled: Vec<u64>,
    },
}

/// The latest catalog, published by the ops thread and read by every core. A core checks
/// `version` (one atomic load) on every datagram and mesh message and takes the lock only
/// when it changed, so the hot path never contends.
pub struct CatalogCell {
    version: AtomicU64,
    cur: Mutex<(u64, Arc<Catalog>)>,
}

impl CatalogCell {
    pub fn new(c: Catalog) -> Self {
        CatalogCell {
            version: AtomicU64::new(1),
            cur: Mutex::new((1, Arc::new(c))),
        }
    }

    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    pub fn load(&self) -> (u64, Arc<Catalog>) {
        let g = self.cur.lock().unwrap_or_else(|p| p.into_inner());
        (g.0, g.1.clone())
    }

    /// Publish the next version.
    pub fn publish(&self, c: Catalog) {
        let mut g = self.cur.lock().unwrap_or_else(|p| p.into_inner());
        let v = g.0 + 1;
        *g = (v, Arc::new(c));
        self.version.store(v, Ordering::Release);
    }
}

/// Shard → core inside one broker: `splitmix64(fnv1a64(tenant 0 namespace 0 stream) ^ shard)
/// mod cores` (docs/protocol.md). Each shard lands on its own hash, so a placement that gives
/// this broker only even shards still spreads them over its cores.
pub fn core_for_shard(name: &StreamName, shard: u32, cores: u32) -> u32 {
    use felix_quic::wire::hash::{fnv1a64, fnv1a64_from};
    let mut h = fnv1a64(name.tenant.as_bytes());
    h = fnv1a64_from(h, &[0]);
    h = fnv1a64_from(h, name.namespace.as_bytes());
    h = fnv1a64_from(h, &[0]);
    h = fnv1a64_from(h, name.stream.as_bytes());
    (splitmix64(h ^ shard as u64) % cores as u64) as u32
}

/// The catalog example of docs/operations.md (the YAML block between its
/// `catalog-example` markers): its unit test loads it and the wire conformance suite serves
/// it, so the documented example is a working one.
#[doc(hidden)]
pub fn operations_doc_catalog_example() -> String {
    let doc = include_str!("../../docs/operations.md");
    let block = doc
        .split_once("<!-- catalog-example:begin -->")
        .and_then(|(_, r)| r.split_once("<!-- catalog-example:end -->"))
        .expect("docs/operations.md has the catalog example")
        .0;
    block
        .lines()
        .filter(|l| !l.starts_with("```"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_errors_are_typed() {
        let c = Catalog::default_catalog();
        assert!(c
            .lookup(&StreamName::new("default", "default", "events"))
            .is_ok());
        assert_eq!(
            c.lookup(&StreamName::new("nope", "default", "events"))
                .unwrap_err()
                .0,
            ErrorCode::UnknownTenant
        );
        assert_eq!(
            c.lookup(&StreamName::new("default", "x", "events"))
                .unwrap_err()
                .0,
            ErrorCode::UnknownNamespace
        );
        assert_eq!(
            c.lookup(&StreamName::new("default", "default", "x"))
                .unwrap_err()
                .0,
            ErrorCode::UnknownStream
        );
        assert_eq!(
            c.lookup(&StreamName::new("a/b", "default", "x"))
                .unwrap_err()
                .0,
            ErrorCode::InvalidName
        );
    }

    #[test]
    fn yaml_catalog_refuses_bad_input() {
        assert!(Catalog::from_yaml(
            "streams:\n  - {tenant: t, namespace: n, stream: s, shards: 2}\n"
        )
        .is_ok());
        assert!(Catalog::from_yaml(
            "streams:\n  - {tenant: t, namespace: n, stream: s, shards: 0}\n"
        )
        .is_err());
        assert!(Catalog::from_yaml(
            "streams:\n  - {tenant: t, namespace: n, stream: s, bogus: 1}\n"
        )
        .is_err());
        assert!(Catalog::from_yaml("streams:\n  - {tenant: t, namespace: n, stream: s}\n  - {tenant: t, namespace: n, stream: s}\n").is_err());
    }

    #[test]
    fn the_operations_doc_example_loads() {
        let c = Catalog::from_yaml(&operations_doc_catalog_example()).unwrap();
        let (_, orders) = c
            .lookup(&StreamName::new("acme", "prod", "orders"))
            .unwrap();
        assert_eq!((orders.shards, orders.durable), (2, true));
        assert_eq!(orders.fsync.as_deref(), Some("on_commit"));
        assert_eq!(orders.retention_bytes, Some(1 << 30));
        assert!(c
            .lookup(&StreamName::new("default", "default", "events"))
            .is_ok());
        let (_, sessions) = c
            .lookup_cache(&StreamName::new("acme", "prod", "sessions"))
            .unwrap();
        assert_eq!(
            (sessions.shards, sessions.default_ttl_ms),
            (8, Some(3_600_000))
        );
        // The file replaces the built-in catalog: only what it declares exists.
        let only =
            Catalog::from_yaml("streams:\n  - {tenant: t, namespace: n, stream: s}\n").unwrap();
        assert_eq!(
            only.lookup(&StreamName::new("default", "default", "events"))
                .unwrap_err()
                .0,
            ErrorCode::UnknownTenant
        );
        assert_eq!(
            only.lookup(&StreamName::new("t", "n", "s"))
                .unwrap()
                .1
                .shards,
            4,
            "default shards"
        );
    }

    #[test]
    fn even_shards_spread_over_two_cores() {
        // A two-broker placement gives this broker shards 0, 2, 4, ...: both cores get some.
        let n = StreamName::new("default", "default", "events");
        let cores: std::collections::HashSet<u32> = (0..16)
            .step_by(2)
            .map(|s| core_for_shard(&n, s, 2))
            .collect();
        assert_eq!(cores.len(), 2);
        for s in 0..64 {
            assert!(core_for_shard(&n, s, 3) < 3);
        }
    }
}

//! The broker's link to `felix-controlplane` (`FELIX_CONTROLPLANE_URL`), on the ops thread —
//! never on a data core. It registers the broker, heartbeats, reads the catalog snapshot and
//! then follows the changes feed, publishing each new catalog version to the cores through
//! [`CatalogCell`].
//!
//! [`Mirror`] is the pure part: the control plane's catalog as this broker knows it, fed by a
//! snapshot and then by change pages, refusing anything that is not gap-free (a resync reads
//! the snapshot again). The driver around it is thin: HTTP calls, backoff, timers.

use crate::catalog::{
    CacheDef, Catalog, CatalogCell, ControlView, StreamDef, ViewPlace, ViewStream,
};
use felix_control::api::{
    self, CatalogSnapshot, ChangeEvent, ChangesPage, ErrorBody, FsyncMode, ResourceState,
    ShardState,
};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The control plane's catalog as last seen: a snapshot plus every change applied in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Mirror {
    pub catalog_id: String,
    pub revision: u64,
    tenants: BTreeSet<String>,
    namespaces: BTreeSet<(String, String)>,
    streams: BTreeMap<(String, String, String), api::Stream>,
    caches: BTreeMap<(String, String, String), api::Cache>,
    brokers: BTreeMap<u64, api::Broker>,
}

/// Why a page cannot be applied: read the snapshot again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resync(pub String);

impl Mirror {
    pub fn from_snapshot(s: CatalogSnapshot) -> Mirror {
        Mirror {
            catalog_id: s.catalog_id,
            revision: s.revision,
            tenants: s.tenants.into_iter().map(|t| t.name).collect(),
            namespaces: s
                .namespaces
                .into_iter()
                .map(|n| (n.tenant, n.name))
                .collect(),
            streams: s
                .streams
                .into_iter()
                .map(|s| ((s.tenant.clone(), s.namespace.clone(), s.name.clone()), s))
                .collect(),
            caches: s
                .caches
                .into_iter()
                .map(|c| ((c.tenant.clone(), c.namespace.clone(), c.name.clone()), c))
                .collect(),
            brokers: s.brokers.into_iter().map(|b| (b.node_id, b)).collect(),
        }
    }

    /// Apply one page of the feed. Returns whether anything changed; refuses a page from
    /// another catalog or with a revision gap (nothing is applied then).
    pub fn apply(&mut self, page: &ChangesPage) -> Result<bool, Resync> {
        if page.catalog_id != self.catalog_id {
            return Err(Resync(format!(
                "catalog replaced ({} -> {})",
                self.catalog_id, page.catalog_id
            )));
        }
        let mut expect = self.revision;
        for c in &page.changes {
            if c.revision != expect + 1 {
                return Err(Resync(format!(
                    "change feed gap: expected revision {}, got {}",
                    expect + 1,
                    c.revision
                )));
            }
            expect = c.revision;
        }
        if page.changes.is_empty() && page.revision < self.revision {
            // A member behind the one we read before (e.g. after a leader change): wait.
            return Ok(false);
        }
        for c in &page.changes {
            match &c.event {
                ChangeEvent::TenantPut { tenant } => {
                    self.tenants.insert(tenant.name.clone());
                }
                ChangeEvent::TenantDeleted { name } => {
                    self.tenants.remove(name);
                }
                ChangeEvent::NamespacePut { namespace } => {
                    self.namespaces
                        .insert((namespace.tenant.clone(), namespace.name.clone()));
                }
                ChangeEvent::NamespaceDeleted { tenant, name } => {
                    self.namespaces.remove(&(tenant.clone(), name.clone()));
                }
                ChangeEvent::StreamPut { stream } => {
                    self.streams.insert(
                        (
                            stream.tenant.clone(),
                            stream.namespace.clone(),
                            stream.name.clone(),
                        ),
                        stream.clone(),
                    );
                }
                ChangeEvent::StreamDeleted {
                    tenant,
                    namespace,
                    name,
                } => {
                    self.streams
                        .remove(&(tenant.clone(), namespace.clone(), name.clone()));
                }
                ChangeEvent::BrokerPut { broker } => {
                    self.brokers.insert(broker.node_id, broker.clone());
                }
                ChangeEvent::CachePut { cache } => {
                    self.caches.insert(
                        (
                            cache.tenant.clone(),
                            cache.namespace.clone(),
                            cache.name.clone(),
                        ),
                        cache.clone(),
                    );
                }
                ChangeEvent::CacheDeleted {
                    tenant,
                    namespace,
                    name,
                } => {
                    self.caches
                        .remove(&(tenant.clone(), namespace.clone(), name.clone()));
                }
            }
        }
        self.revision = expect.max(self.revision);
        Ok(!page.changes.is_empty())
    }

    /// What the broker's catalog is built from.
    pub fn view(&self) -> ControlView {
        ControlView {
            revision: self.revision,
            tenants: self.tenants.iter().cloned().collect(),
            namespaces: self.namespaces.iter().cloned().collect(),
            streams: self.streams.values().map(view_stream).collect(),
            caches: self.caches.values().map(view_cache).collect(),
            broker_addrs: self
                .brokers
                .values()
                .map(|b| (b.node_id, b.quic_addr.clone()))
                .collect(),
            peer_addrs: self
                .brokers
                .values()
                .filter_map(|b| Some((b.node_id, b.peer_addr.clone()?)))
                .collect(),
            storage_ids: self
                .brokers
                .values()
                .filter_map(|b| {
                    let id = b.storage_id.as_deref()?;
                    Some((b.node_id, u64::from_str_radix(id, 16).ok()?))
                })
                .collect(),
            cluster_id: self.catalog_id.clone(),
        }
    }
}

/// `replicated`: the stream has more than one copy; its shards are not served here yet.
fn view_places(placement: &[api::ShardPlacement], replicated: bool) -> Vec<ViewPlace> {
    placement
        .iter()
        .map(|p| match (p.state, p.owner) {
            _ if replicated => ViewPlace::Replicated {
                leader: p.leader.unwrap_or(0),
                generation: p.generation,
                replicas: p.replicas.clone(),
                settled: p.settled.clone(),
            },
            (ShardState::Assigned, Some(owner)) => ViewPlace::Assigned {
                owner,
                generation: p.generation,
            },
            (ShardState::Unavailable, Some(owner)) => ViewPlace::OwnerDown { owner },
            _ => ViewPlace::Unassigned,
        })
        .collect()
}

fn view_cache(c: &api::Cache) -> ViewStream<CacheDef> {
    ViewStream {
        def: CacheDef {
            tenant: c.tenant.clone(),
            namespace: c.namespace.clone(),
            cache: c.name.clone(),
            shards: c.shards,
            durable: c.durable,
            // Clamped to what the broker accepts, so an update from an older control plane
            // cannot leave a served cache whose default TTL refuses every put.
            default_ttl_ms: c
                .ttl_seconds
                .map(|t| t.saturating_mul(1000).min(crate::cache::TTL_LIMIT_MS)),
        },
        incarnation: c.created_revision,
        deleting: c.state == ResourceState::Deleting,
        placement: view_places(&c.placement, false),
    }
}

fn view_stream(s: &api::Stream) -> ViewStream {
    ViewStream {
        def: StreamDef {
            tenant: s.tenant.clone(),
            namespace: s.namespace.clone(),
            stream: s.name.clone(),
            shards: s.shards,
            durable: s.durable,
            fsync: s.durable.then(|| {
                match s.fsync {
                    FsyncMode::OnCommit => "on_commit",
                    FsyncMode::Periodic => "periodic",
                    FsyncMode::None => "none",
                }
                .to_string()
            }),
            retention_bytes: s.retention_bytes.filter(|_| s.durable),
            retention_seconds: s.retention_seconds.filter(|_| s.durable),
            quorum: s.consistency == api::Consistency::Quorum,
        },
        incarnation: s.created_revision,
        deleting: s.state == ResourceState::Deleting,
        placement: view_places(&s.placement, s.replication_factor > 1),
    }
}

/// Settings of the link.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// Base URL, e.g. `http://127.0.0.1:7500`.
    pub url: String,
    pub node_id: u64,
    /// What clients dial to reach this broker.
    pub quic_addr: String,
    pub cores: u32,
    /// Long-poll bound of one changes request.
    pub wait_ms: u64,
    /// What other brokers dial to reach this broker's peer listener.
    pub peer_addr: Option<String>,
    /// The node credential, sent as the bearer of every request and renewed before it expires.
    pub token: Option<crate::auth::Secret>,
    /// The hosted replicas' reports, posted from here (replication rule 7).
    pub reports: Option<Arc<crate::replica_reports::ReportBox>>,
    /// Where the node credential was read from; a renewed one is written back there.
    pub token_file: Option<std::path::PathBuf>,
    /// With `auth = controlplane`: the keys to fill from the control plane's key set.
    pub keys: Option<Arc<crate::auth::AuthKeys>>,
    /// How often the key set is fetched again.
    pub jwks_refresh_ms: u64,
    /// CA certificates trusted for an `https://` control plane, besides the system's roots.
    pub ca: Vec<reqwest::Certificate>,
    /// The durable directory's storage identity (replication rule 9), registered with the
    /// broker.
    pub storage_id: Option<String>,
}

/// The certificates of a PEM file (`controlplane_ca`); errors name the file.
pub fn load_ca(path: &std::path::Path) -> Result<Vec<reqwest::Certificate>, String> {
    felix_control::ca_bundle::load(path).map_err(|e| format!("controlplane_ca {e}"))
}

/// Shared between the feed and heartbeat tasks (never held across an await).
struct LinkState {
    mirror: Option<Mirror>,
    catalog: Catalog,
    fenced: bool,
    /// `(catalog_id, revision)` last published: a snapshot of the same catalog at a lower
    /// revision (a lagging Raft member) is never applied — it would read as deletions.
    published: Option<(String, u64)>,
    /// Peer addresses registered as host names, resolved here (`name:port` → `ip:port`):
    /// the cores dial IP addresses only, and never wait for a resolver.
    resolved: HashMap<String, String>,
}

impl LinkState {
    fn republish(&mut self, cell: &CatalogCell, node_id: u64) {
        let Some(m) = &self.mirror else { return };
        let mut view = m.view();
        for a in view.peer_addrs.values_mut() {
            if let Some(ip) = self.resolved.get(a) {
                *a = ip.clone();
            }
        }
        self.catalog = Catalog::from_view(&self.catalog, &view, node_id, self.fenced);
        self.published = Some((m.catalog_id.clone(), m.revision));
        cell.publish(self.catalog.clone());
    }

    /// Peer addresses that are names not resolved yet.
    fn unresolved(&self) -> Vec<String> {
        let Some(m) = &self.mirror else {
            return Vec::new();
        };
        m.view()
            .peer_addrs
            .into_values()
            .filter(|a| {
                a.parse::<std::net::SocketAddr>().is_err() && !self.resolved.contains_key(a)
            })
            .collect()
    }
}

/// Resolve the peer addresses that are host names (each within 2 s; IPv4 first), then publish
/// the catalog again if any resolved. A name that does not resolve stays as it is: forwards to
/// that broker are refused `unavailable` naming it, and it is tried again after the next feed
/// answer.
async fn resolve_peers(state: &Mutex<LinkState>, cell: &CatalogCell, node_id: u64) {
    let names = state.lock().unwrap_or_else(|p| p.into_inner()).unresolved();
    let mut found = Vec::new();
    for name in names {
        let lookup = tokio::net::lookup_host(name.clone());
        match tokio::time::timeout(std::time::Duration::from_secs(2), lookup).await {
            Ok(Ok(addrs)) => {
                let addrs: Vec<std::net::SocketAddr> = addrs.collect();
                if let Some(a) = addrs.iter().find(|a| a.is_ipv4()).or(addrs.first()) {
                    found.push((name, a.to_string()));
                }
            }
            Ok(Err(e)) => {
                tracing::warn!(peer_addr = %name, error = %e, "peer address does not resolve")
            }
            Err(_) => tracing::warn!(peer_addr = %name, "peer address lookup timed out"),
        }
    }
    if !found.is_empty() {
        let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
        st.resolved.extend(found);
        st.republish(cell, node_id);
    }
}

/// Start the ops thread. `synced` turns true once the first catalog is published.
pub fn spawn(
    cfg: LinkConfig,
    cell: Arc<CatalogCell>,
    synced: Arc<AtomicBool>,
    shutdown: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("felix-ops-link".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime for the control-plane link");
            rt.block_on(run(cfg, cell, synced, shutdown));
        })
}

#[derive(Debug)]
enum CallError {
    /// The control plane answered with a typed refusal.
    Api(u16, ErrorBody),
    /// Unreachable, timed out, or an undecodable answer.
    Transport(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Api(s, b) => write!(f, "HTTP {s} {}: {}", b.code, b.message),
            CallError::Transport(e) => write!(f, "{e}"),
        }
    }
}

/// An error and its causes, outermost first: reqwest's own text ("error sending request")
/// hides the reason (a refused connection, an untrusted certificate).
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

async fn call<T: serde::de::DeserializeOwned>(rb: reqwest::RequestBuilder) -> Result<T, CallError> {
    let r = rb
        .send()
        .await
        .map_err(|e| CallError::Transport(with_causes(&e)))?;
    let status = r.status().as_u16();
    if r.status().is_success() {
        return r
            .json::<T>()
            .await
            .map_err(|e| CallError::Transport(format!("bad answer: {e}")));
    }
    let body = r.json::<ErrorBody>().await.unwrap_or(ErrorBody {
        code: "internal".into(),
        message: format!("HTTP {status} without an error body"),
    });
    Err(CallError::Api(status, body))
}

/// Set once a stopping broker has told the control plane it leaves (or tried to, for at most
/// [`LEAVE_WAIT`]); the stop waits for it (see [`wait_for_leave`]).
pub static LEFT: AtomicBool = AtomicBool::new(false);

/// How long a stopping broker tries to tell the control plane it leaves.
pub const LEAVE_WAIT: Duration = Duration::from_millis(1_000);

/// Tell the control plane this process stops (a heartbeat saying `leaving`): it counts the
/// broker dead at once, and the replicated shards it leads get new leaders without waiting
/// out `dead_after_ms`. Best effort, bounded by [`LEAVE_WAIT`]: a stop that cannot say so is
/// noticed the usual way.
async fn leave(http: &credential::Http, base: &str, node_id: u64, incarnation: u64) {
    let hb = api::Heartbeat {
        incarnation: Some(incarnation),
        catalog_revision: None,
        leaving: Some(true),
    };
    let url = format!("{base}/v1/brokers/{node_id}/heartbeat");
    match tokio::time::timeout(
        LEAVE_WAIT,
        call::<api::HeartbeatReply>(http.post(&url).json(&hb)),
    )
    .await
    {
        Ok(Ok(_)) => tracing::info!("told the control plane this broker leaves"),
        Ok(Err(e)) => tracing::warn!(error = %e, "could not tell the control plane this broker leaves; it is counted dead after dead_after_ms"),
        Err(_) => tracing::warn!("the control plane did not answer that this broker leaves; it is counted dead after dead_after_ms"),
    }
    LEFT.store(true, Ordering::Release);
}

/// Wait (at most [`LEAVE_WAIT`] and a little) until the control link said this broker leaves.
pub fn wait_for_leave() {
    let until = std::time::Instant::now() + LEAVE_WAIT + Duration::from_millis(200);
    while !LEFT.load(Ordering::Acquire) && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
}

async fn sleep_unless_stopped(ms: u64, shutdown: &AtomicBool) -> bool {
    let mut left = ms;
    while left > 0 {
        if shutdown.load(Ordering::Acquire) {
            return false;
        }
        let step = left.min(100);
        tokio::time::sleep(Duration::from_millis(step)).await;
        left -= step;
    }
    !shutdown.load(Ordering::Acquire)
}

/// Whether the catalog source (the control plane) answers, for `/readyz`: one per process,
/// as the control link is.
pub struct SourceHealth {
    /// Unix ms since when the control plane has not answered; 0 while it answers.
    lost_since_ms: AtomicU64,
    why: Mutex<String>,
}

/// The process's catalog source health (read by the ops listener).
pub static SOURCE: SourceHealth = SourceHealth {
    lost_since_ms: AtomicU64::new(0),
    why: Mutex::new(String::new()),
};

impl SourceHealth {
    /// The control plane answered. Returns how long it had been lost (ms), if it had.
    fn answered(&self) -> Option<u64> {
        let since = self.lost_since_ms.swap(0, Ordering::AcqRel);
        (since != 0).then(|| felix_storage::log::now_ms().saturating_sub(since))
    }

    /// The control plane did not answer; true when this starts a loss (log it once).
    fn failed(&self, why: &str) -> bool {
        *self.why.lock().unwrap_or_else(|p| p.into_inner()) = why.to_string();
        self.lost_since_ms
            .compare_exchange(
                0,
                felix_storage::log::now_ms().max(1),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    /// `Some(description)` while the control plane is lost.
    pub fn lost(&self) -> Option<String> {
        let since = self.lost_since_ms.load(Ordering::Acquire);
        if since == 0 {
            return None;
        }
        let secs = felix_storage::log::now_ms().saturating_sub(since) / 1000;
        let why = self.why.lock().unwrap_or_else(|p| p.into_inner()).clone();
        Some(format!(
            "catalog source lost: the control plane has not answered for {secs} s ({why}); serving the last catalog"
        ))
    }
}

/// Log a failed control-plane call: a warning when a loss starts, then quietly (debug) while
/// it lasts, so a control plane that is gone does not fill the log.
fn note_failure(what: &str, e: &dyn std::fmt::Display) {
    let why = format!("{what}: {e}");
    if SOURCE.failed(&why) {
        tracing::warn!(error = %e, "{what}; retrying with backoff (further failures at debug level)");
    } else {
        tracing::debug!(error = %e, "{what}");
    }
}

fn note_answer() {
    if let Some(ms) = SOURCE.answered() {
        tracing::info!(lost_ms = ms, "control plane answers again");
    }
}

/// Post the hosted replicas' reports and leave each answer for its core, up to
/// [`REPORTS_POSTING_MAX`] at once (a leader keeps two out, and every shard's leader reports:
/// one at a time, a report waited for the others' round trips). A report that is not answered
/// is dropped: its replica reports again on a tick while none has landed.
async fn post_reports(
    http: credential::Http,
    base: String,
    reports: Arc<crate::replica_reports::ReportBox>,
    shutdown: Arc<AtomicBool>,
) {
    let failing = Arc::new(AtomicBool::new(false));
    let slots = Arc::new(tokio::sync::Semaphore::new(REPORTS_POSTING_MAX));
    let mut posting = tokio::task::JoinSet::new();
    while !shutdown.load(Ordering::Acquire) {
        while let Some(job) = reports.pop() {
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return;
            };
            let (http, base, reports, failing) =
                (http.clone(), base.clone(), reports.clone(), failing.clone());
            posting.spawn(async move {
                post_one_report(&http, &base, &reports, &failing, job).await;
                drop(slot);
            });
            while posting.try_join_next().is_some() {}
        }
        let _ = tokio::time::timeout(Duration::from_millis(200), reports.wake.notified()).await;
    }
    // Shutting down: the posts under way end (their answers no longer matter).
    posting.abort_all();
}

/// Reports posted to the control plane at once, at most.
const REPORTS_POSTING_MAX: usize = 8;

async fn post_one_report(
    http: &credential::Http,
    base: &str,
    reports: &crate::replica_reports::ReportBox,
    failing: &AtomicBool,
    job: crate::replica_reports::ReportJob,
) {
    use crate::replica_reports::{REPORTS_FAILED, REPORTS_POSTED};
    match post_report(http, base, &job).await {
        Ok(a) => {
            REPORTS_POSTED.fetch_add(1, Ordering::Relaxed);
            failing.store(false, Ordering::Relaxed);
            reports.answer(job.core, job.key, a)
        }
        Err(e) => {
            // Warn when posts start failing; the rest are counted.
            REPORTS_FAILED.fetch_add(1, Ordering::Relaxed);
            if !failing.swap(true, Ordering::Relaxed) {
                tracing::warn!(error = %e, stream = %job.stream, shard = job.shard, "replica report not posted; the replica reports again on a tick");
            } else {
                tracing::debug!(error = %e, "replica report not posted");
            }
        }
    }
    reports.posted(job.core);
}

async fn post_report(
    http: &credential::Http,
    base: &str,
    job: &crate::replica_reports::ReportJob,
) -> Result<felix_control::replication::ReportAnswer, String> {
    use felix_control::replication::{Holding, Pos, ReportAnswer};
    let holders: Vec<serde_json::Value> = job
        .report
        .holders
        .iter()
        .map(|h| {
            let behind = job.report.behind_bytes.get(&h.node);
            serde_json::json!({"node": h.node, "last_generation": h.pos.last_gen,
                "end": h.pos.end, "storage_id": format!("{:016x}", h.sid),
                "behind_bytes": behind})
        })
        .collect();
    let body = serde_json::json!({"generation": job.report.gen, "leader": job.report.leader,
        "seq": job.report.seq, "holders": holders, "resign": job.report.resign});
    // Names are one path segment of [A-Za-z0-9_.-] each (the catalog checked them).
    let url = format!(
        "{base}/v1/tenants/{}/namespaces/{}/streams/{}/shards/{}/report",
        job.tenant, job.namespace, job.stream, job.shard
    );
    let r = http
        .post(url)
        .json(&body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = r.status();
    let v: serde_json::Value = r.json().await.map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(format!("{status}: {v}"));
    }
    let num = |f: &str| v[f].as_u64().ok_or_else(|| format!("no {f} in {v}"));
    let gen = num("generation")?;
    match v["answer"].as_str() {
        Some("landed") => {
            let counted = v["counted"]
                .as_array()
                .ok_or_else(|| format!("no counted in {v}"))?
                .iter()
                .map(|h| {
                    let sid = h["storage_id"]
                        .as_str()
                        .and_then(|s| u64::from_str_radix(s, 16).ok());
                    match (
                        h["node"].as_u64(),
                        h["last_generation"].as_u64(),
                        h["end"].as_u64(),
                        sid,
                    ) {
                        (Some(node), Some(last_gen), Some(end), Some(sid)) => Ok(Holding {
                            node,
                            pos: Pos { last_gen, end },
                            sid,
                        }),
                        _ => Err(format!("a counted holder is malformed: {h}")),
                    }
                })
                .collect::<Result<Vec<_>, String>>()?;
            Ok(ReportAnswer::Landed { gen, counted })
        }
        Some("refused") => Ok(ReportAnswer::Refused {
            gen,
            newest: num("newest")?,
        }),
        Some("stale") => Ok(ReportAnswer::Stale {
            gen,
            seq: num("seq")?,
        }),
        _ => Err(format!("an answer this broker does not know: {v}")),
    }
}

async fn run(
    cfg: LinkConfig,
    cell: Arc<CatalogCell>,
    synced: Arc<AtomicBool>,
    shutdown: Arc<AtomicBool>,
) {
    let mut http = reqwest::Client::builder();
    for c in &cfg.ca {
        http = http.add_root_certificate(c.clone());
    }
    let http = http
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_millis(cfg.wait_ms + 10_000))
        .build()
        .expect("HTTP client");
    let mut token = cfg.token.as_ref().map(|crate::auth::Secret(t)| t.clone());
    let http = credential::Http::new(http, token.as_deref());
    let base = cfg.url.trim_end_matches('/').to_string();
    // An enrolment token is good for nothing else: exchange it before anything is asked.
    if token.as_deref().is_some_and(credential::is_enrolment) {
        let file = cfg.token_file.as_deref();
        match credential::enrol(&http, &base, cfg.node_id, file, &shutdown).await {
            Some(t) => token = Some(t),
            None => return,
        }
    }
    if let Some(t) = token {
        tokio::spawn(credential::follow(
            http.clone(),
            base.clone(),
            cfg.node_id,
            cfg.token_file.clone(),
            t,
            shutdown.clone(),
        ));
    }
    if let Some(reports) = cfg.reports.clone() {
        tokio::spawn(post_reports(
            http.clone(),
            base.clone(),
            reports,
            shutdown.clone(),
        ));
    }
    if let Some(keys) = cfg.keys.clone() {
        tokio::spawn(follow_keys(
            http.clone(),
            base.clone(),
            keys.clone(),
            cfg.jwks_refresh_ms,
            shutdown.clone(),
        ));
        tokio::spawn(follow_revocations(
            http.clone(),
            base.clone(),
            keys,
            cfg.wait_ms,
            shutdown.clone(),
        ));
    }
    let state = Arc::new(Mutex::new(LinkState {
        mirror: None,
        catalog: Catalog::default(),
        fenced: false,
        published: None,
        resolved: HashMap::new(),
    }));
    let incarnation = Arc::new(AtomicU64::new(0));
    let applied = Arc::new(AtomicU64::new(0));

    // Register until it works (the control plane may start after the broker).
    let mut backoff_ms = 200;
    let hb_interval_ms = loop {
        match register(&http, &base, &cfg).await {
            Ok(r) => {
                note_answer();
                incarnation.store(r.broker.incarnation, Ordering::Release);
                tracing::info!(node_id = cfg.node_id, incarnation = r.broker.incarnation,
                    url = %base, "registered with the control plane");
                break r.heartbeat_interval_ms.max(50);
            }
            // A refused credential is a configuration error that retrying cannot fix, and a
            // broker that never registers would otherwise wait silently: stop, saying why.
            Err(CallError::Api(401 | 403, b)) => {
                tracing::error!(code = %b.code, message = %b.message, "the control plane refused this broker's credential");
                eprintln!(
                    "felix-broker: the control plane at {base} refused to register node {}: {} ({}); check controlplane_token_file (felixctl node enroll {} prints one)",
                    cfg.node_id, b.message, b.code, cfg.node_id
                );
                std::process::exit(2);
            }
            // So is a certificate this broker does not trust.
            Err(CallError::Transport(e)) if e.to_ascii_lowercase().contains("certificate") => {
                tracing::error!(error = %e, "the control plane's certificate is not trusted");
                eprintln!(
                    "felix-broker: the control plane at {base} presented a certificate this broker does not trust ({e}); set controlplane_ca (FELIX_CONTROLPLANE_CA) to the CA that signs it"
                );
                std::process::exit(2);
            }
            Err(e) => {
                note_failure(&format!("registration at {base} failed"), &e);
                if !sleep_unless_stopped(backoff_ms, &shutdown).await {
                    return;
                }
                backoff_ms = (backoff_ms * 2).min(5_000);
            }
        }
    };

    // Heartbeats: a `not_found` (the control plane forgot us) registers again; a `conflict`
    // (a newer registration under our node id) fences this process: it serves nothing.
    {
        let (http, base, cfg) = (http.clone(), base.clone(), cfg.clone());
        let (state, cell, shutdown) = (state.clone(), cell.clone(), shutdown.clone());
        let (incarnation, applied) = (incarnation.clone(), applied.clone());
        tokio::spawn(async move {
            let mut hb_ok = true;
            loop {
                if !sleep_unless_stopped(hb_interval_ms, &shutdown).await {
                    leave(
                        &http,
                        &base,
                        cfg.node_id,
                        incarnation.load(Ordering::Acquire),
                    )
                    .await;
                    return;
                }
                let hb = api::Heartbeat {
                    incarnation: Some(incarnation.load(Ordering::Acquire)),
                    catalog_revision: Some(applied.load(Ordering::Acquire)),
                    leaving: None,
                };
                let url = format!("{base}/v1/brokers/{}/heartbeat", cfg.node_id);
                match call::<api::HeartbeatReply>(http.post(&url).json(&hb)).await {
                    Ok(_) => hb_ok = true,
                    Err(CallError::Api(404, _)) => match register(&http, &base, &cfg).await {
                        Ok(r) => {
                            incarnation.store(r.broker.incarnation, Ordering::Release);
                            tracing::info!(incarnation = r.broker.incarnation, "registered again");
                        }
                        Err(e) => tracing::warn!(error = %e, "re-registration failed"),
                    },
                    Err(CallError::Api(409, b)) => {
                        tracing::error!(message = %b.message, "registration superseded: this broker is fenced and serves nothing");
                        let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
                        st.fenced = true;
                        st.republish(&cell, cfg.node_id);
                        return;
                    }
                    // The feed alone says whether the catalog source is lost (/readyz): a
                    // heartbeat failing while the feed answers would make it flap. Logged at
                    // warn when failures start, then at debug.
                    Err(e) if hb_ok => {
                        hb_ok = false;
                        tracing::warn!(error = %e, "heartbeat failed (further failures at debug level)");
                    }
                    Err(e) => tracing::debug!(error = %e, "heartbeat failed"),
                }
            }
        });
    }

    // The feed: snapshot, then long-polled changes; any gap or replaced catalog re-reads the
    // snapshot. While the control plane is unreachable the last catalog keeps serving.
    let mut backoff_ms = 200;
    loop {
        if shutdown.load(Ordering::Acquire) {
            return;
        }
        let since = {
            let st = state.lock().unwrap_or_else(|p| p.into_inner());
            st.mirror.as_ref().map(|m| m.revision)
        };
        let result = match since {
            None => call::<CatalogSnapshot>(http.get(format!("{base}/v1/catalog")))
                .await
                .and_then(|snap| {
                    let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
                    if let Some((id, rev)) = &st.published {
                        if *id == snap.catalog_id && snap.revision < *rev {
                            return Err(CallError::Transport(format!(
                                "snapshot at revision {} is behind the applied {rev}; retrying",
                                snap.revision
                            )));
                        }
                    }
                    tracing::info!(revision = snap.revision, "catalog snapshot read");
                    st.mirror = Some(Mirror::from_snapshot(snap));
                    st.republish(&cell, cfg.node_id);
                    applied.store(st.catalog.revision, Ordering::Release);
                    synced.store(true, Ordering::Release);
                    Ok(())
                }),
            Some(since) => call::<ChangesPage>(http.get(format!(
                "{base}/v1/catalog/changes?since={since}&wait_ms={}",
                cfg.wait_ms
            )))
            .await
            .map(|page| {
                let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
                let m = st.mirror.as_mut().expect("snapshot read first");
                match m.apply(&page) {
                    Ok(true) => {
                        st.republish(&cell, cfg.node_id);
                        applied.store(st.catalog.revision, Ordering::Release);
                    }
                    Ok(false) => {}
                    Err(Resync(why)) => {
                        tracing::warn!(reason = %why, "re-reading the catalog snapshot");
                        st.mirror = None;
                    }
                }
            }),
        };
        match result {
            Ok(()) => {
                note_answer();
                backoff_ms = 200;
                resolve_peers(&state, &cell, cfg.node_id).await;
            }
            Err(CallError::Api(410, b)) => {
                tracing::warn!(message = %b.message, "feed position too old; re-reading the snapshot");
                state.lock().unwrap_or_else(|p| p.into_inner()).mirror = None;
            }
            Err(e) => {
                note_failure(&format!("the catalog feed at {base} failed"), &e);
                if !sleep_unless_stopped(backoff_ms, &shutdown).await {
                    return;
                }
                backoff_ms = (backoff_ms * 2).min(5_000);
            }
        }
    }
}

/// How often the key loop looks for a fetch asked for by an unknown key; also the bound on
/// how often a stream of tokens naming unknown keys can make this broker fetch.
const KEYS_POLL_MS: u64 = 200;

/// Keep `keys` equal to the control plane's key set: at once, every `refresh_ms`, and when a
/// token named a key not known here. A failed fetch keeps the keys this broker has.
async fn follow_keys(
    http: credential::Http,
    base: String,
    keys: Arc<crate::auth::AuthKeys>,
    refresh_ms: u64,
    shutdown: Arc<AtomicBool>,
) {
    let refresh = Duration::from_millis(refresh_ms);
    let mut last: Option<std::time::Instant> = None;
    let mut warned = false;
    loop {
        let asked = keys.take_refetch();
        if asked || !keys.loaded() || last.is_none_or(|t| t.elapsed() >= refresh) {
            last = Some(std::time::Instant::now());
            let url = format!("{base}/v1/auth/jwks");
            match call::<felix_control::auth::Jwks>(http.get(&url)).await {
                Ok(j) if j.keys.is_empty() => {
                    if !warned {
                        tracing::warn!("the control plane's key set is empty (is auth off there?); no token verifies");
                    }
                    warned = true;
                }
                Ok(j) => match keys.replace(&j) {
                    Ok(()) => {
                        if warned {
                            tracing::info!(keys = j.keys.len(), "key set fetched");
                        }
                        warned = false;
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "the control plane's key set is unusable")
                    }
                },
                Err(e) => {
                    if !warned {
                        tracing::warn!(error = %e, url = %url, "cannot fetch the key set; keeping the keys held");
                    }
                    warned = true;
                }
            }
        }
        if !sleep_unless_stopped(KEYS_POLL_MS, &shutdown).await {
            return;
        }
    }
}

/// How often an unreachable revocation feed is warned about.
const REVOCATION_WARN_MS: u64 = 60_000;
/// The pause after a failed poll of the revocation feed.
const REVOCATION_RETRY_MS: u64 = 1_000;

/// Keep `keys`' revocations equal to the control plane's: a long poll that answers as soon as
/// a revocation is recorded, so the cores refuse it within one round trip plus their
/// once-a-second sweep. While the feed is unreachable the revocations held stay in force and
/// tokens that verify are accepted (fail open: an outage of the control plane must not stop
/// the data plane); the gauge, a warning once a minute and `/readyz` say so.
async fn follow_revocations(
    http: credential::Http,
    base: String,
    keys: Arc<crate::auth::AuthKeys>,
    wait_ms: u64,
    shutdown: Arc<AtomicBool>,
) {
    let mut warned_at_ms = 0u64;
    loop {
        if shutdown.load(Ordering::Acquire) {
            return;
        }
        let since = keys.revocation_revision();
        // The first poll answers at once, so the gauge shows a sync from the start.
        let wait = if keys.revocations_synced_ms() == 0 {
            0
        } else {
            wait_ms
        };
        let url = format!("{base}/v1/auth/revocations?since={since}&wait_ms={wait}");
        let now_ms = || felix_storage::log::now_ms();
        match call::<felix_control::auth::RevocationFeed>(http.get(&url)).await {
            Ok(feed) => {
                if warned_at_ms != 0 {
                    tracing::info!(
                        revision = feed.revision,
                        "the revocation feed answers again"
                    );
                    warned_at_ms = 0;
                }
                if feed.revision != since {
                    tracing::info!(
                        revision = feed.revision,
                        revocations = feed.revocations.len(),
                        "revocations updated"
                    );
                }
                keys.set_revocations(&feed, now_ms());
            }
            Err(e) => {
                keys.revocation_feed_failed(now_ms());
                if now_ms().saturating_sub(warned_at_ms) >= REVOCATION_WARN_MS {
                    warned_at_ms = now_ms();
                    tracing::warn!(error = %e, url = %url, "the revocation feed is unreachable: revocations held stay in force, verified tokens are accepted (fail open)");
                }
                if !sleep_unless_stopped(REVOCATION_RETRY_MS, &shutdown).await {
                    return;
                }
            }
        }
    }
}

async fn register(
    http: &credential::Http,
    base: &str,
    cfg: &LinkConfig,
) -> Result<api::RegisterBrokerReply, CallError> {
    let req = api::RegisterBroker {
        node_id: cfg.node_id,
        quic_addr: cfg.quic_addr.clone(),
        cores: cfg.cores,
        peer_addr: cfg.peer_addr.clone(),
        capabilities: [
            cfg.peer_addr.as_ref().map(|_| "peer_addr"),
            cfg.storage_id.as_ref().map(|_| "storage_id"),
        ]
        .into_iter()
        .flatten()
        .map(String::from)
        .collect(),
        storage_id: cfg.storage_id.clone(),
    };
    let reply: api::RegisterBrokerReply =
        call(http.post(format!("{base}/v1/brokers")).json(&req)).await?;
    // An older control plane ignores what it does not know: say so rather than wait for
    // forwards that can never come.
    for c in &req.capabilities {
        if !reply.capabilities.contains(c) {
            let what = match c.as_str() {
                "peer_addr" => "other brokers cannot reach this one's peer listener",
                "storage_id" => "it cannot tell this broker's data from a wiped or restored copy, so replication must stay off",
                _ => "it ignores this field",
            };
            tracing::error!(capability = %c, "the control plane does not understand this registration field: {what}");
        }
    }
    Ok(reply)
}

pub mod credential;
#[cfg(test)]
mod tests;

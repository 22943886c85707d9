//! The REST server: thin axum handlers over a [`MetadataStore`] and the OpenAPI document
//! generated from the handlers and types (utoipa). The tenant resources' handlers are in
//! `server/resources.rs`, the bearer check in `server/rest_auth.rs`, and the leader's sweep
//! (time turned into commands for the deterministic state machine) in `server/sweep.rs`.

use crate::api::*;
use crate::catalog::{Command, Reply};
use crate::config::Config;
use crate::store::{MetadataStore, Route};
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use felix_quic::wire::ErrorCode;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use utoipa::{IntoParams, OpenApi};

mod replication;
mod resources;
mod sweep;
mod unread_body;
pub use sweep::sweep;
pub mod rest_auth;
use crate::catalog::auth_state::TokenRecord;
use resources::*;
use rest_auth::{Caller, CreateToken, IssuedToken, KeyInfo, NodeTokenRequest, RevokeRequest};

// ------------------------------------------------------------------ errors and extractors

/// A refusal as an HTTP response: status + `{code, message}`.
#[derive(Debug)]
pub struct Refusal {
    pub status: StatusCode,
    pub err: ApiError,
}

impl From<ApiError> for Refusal {
    fn from(err: ApiError) -> Self {
        let status = StatusCode::from_u16(err.http_status()).unwrap_or(StatusCode::BAD_REQUEST);
        Refusal { status, err }
    }
}

impl Refusal {
    fn new(status: StatusCode, code: ErrorCode, msg: impl Into<String>) -> Self {
        Refusal {
            status,
            err: ApiError::new(code, msg),
        }
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.err.body())).into_response()
    }
}

impl From<JsonRejection> for Refusal {
    fn from(r: JsonRejection) -> Self {
        let status = r.status();
        let code = if status == StatusCode::PAYLOAD_TOO_LARGE {
            ErrorCode::PayloadTooLarge
        } else {
            ErrorCode::InvalidRequest
        };
        // 415 stays 415; everything else about a body is a 400 (never axum's 422).
        let status = match status {
            StatusCode::PAYLOAD_TOO_LARGE | StatusCode::UNSUPPORTED_MEDIA_TYPE => status,
            _ => StatusCode::BAD_REQUEST,
        };
        Refusal::new(status, code, r.body_text())
    }
}

impl From<PathRejection> for Refusal {
    fn from(r: PathRejection) -> Self {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidRequest,
            r.body_text(),
        )
    }
}

impl From<QueryRejection> for Refusal {
    fn from(r: QueryRejection) -> Self {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidRequest,
            r.body_text(),
        )
    }
}

/// JSON body whose rejections are typed error bodies.
#[derive(FromRequest)]
#[from_request(via(axum::Json), rejection(Refusal))]
pub struct Json<T>(pub T);

impl<T: Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(Refusal))]
pub struct Path<T>(pub T);

#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(Refusal))]
pub struct Query<T>(pub T);

type Res<T> = Result<T, Refusal>;

// ------------------------------------------------------------------ state

pub struct AppState {
    pub store: Arc<dyn MetadataStore>,
    pub cfg: Arc<Config>,
    soft: Mutex<Soft>,
    http: reqwest::Client,
    requests: RequestMetrics,
    /// Set on shutdown: /readyz says not ready and waiting long polls answer at once.
    draining: tokio::sync::watch::Sender<bool>,
    /// The verifier of the current keys, with their ids (rebuilt when they change).
    verifier: Mutex<Option<(Vec<String>, Arc<crate::auth::Verifier>)>>,
}

/// Upper bounds of the request latency histogram, microseconds.
const LATENCY_BUCKETS_US: [u64; 12] = [
    250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000, 5_000_000,
];

/// REST request counters and a latency histogram (relaxed atomics: no lock per request).
#[derive(Default)]
struct RequestMetrics {
    /// By status class 1xx..5xx.
    by_class: [std::sync::atomic::AtomicU64; 5],
    /// Cumulative per bucket of `LATENCY_BUCKETS_US`, plus +Inf last.
    buckets: [std::sync::atomic::AtomicU64; 13],
    sum_us: std::sync::atomic::AtomicU64,
}

impl RequestMetrics {
    fn observe(&self, status: u16, elapsed_us: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let class = (status / 100).clamp(1, 5) as usize - 1;
        self.by_class[class].fetch_add(1, Relaxed);
        for (i, b) in LATENCY_BUCKETS_US.iter().enumerate() {
            if elapsed_us <= *b {
                self.buckets[i].fetch_add(1, Relaxed);
            }
        }
        self.buckets[LATENCY_BUCKETS_US.len()].fetch_add(1, Relaxed);
        self.sum_us.fetch_add(elapsed_us, Relaxed);
    }
}

/// Leader soft state: what heartbeats taught this node. Lost on a leader change, which only
/// delays decisions (every broker gets a fresh `dead_after` on the new leader).
#[derive(Default)]
struct Soft {
    leader_since: Option<Instant>,
    /// node id -> (incarnation, last heartbeat or first sight).
    last_seen: HashMap<u64, (u64, Instant)>,
    /// node id -> catalog revision the broker reported applied.
    reported: HashMap<u64, u64>,
    /// (is_cache, tenant, namespace, name, revision) -> first seen deleting.
    deleting: HashMap<(bool, String, String, String, u64), Instant>,
    /// In the settle window: when this leader first saw a registered broker.
    first_broker: Option<Instant>,
    /// When the last sweep ran (see `sweep::forgive_stall`).
    swept_at: Option<Instant>,
    /// node id -> when this leader first saw it counted dead (rule 11's replacement clock).
    dead_since: HashMap<u64, Instant>,
}

impl AppState {
    pub fn new(store: Arc<dyn MetadataStore>, cfg: Arc<Config>) -> Arc<Self> {
        // Forwarding to the leader trusts what the member protocol trusts; `Config::check`
        // and `https::prepare` ran before, so a bad CA file has been refused already.
        let http = crate::https::client_builder(cfg.member_ca().as_deref())
            .expect("the member CA was checked at start")
            .timeout(cfg.write_timeout())
            .build()
            .expect("http client");
        Arc::new(AppState {
            store,
            cfg,
            soft: Mutex::new(Soft::default()),
            requests: RequestMetrics::default(),
            http,
            draining: tokio::sync::watch::channel(false).0,
            verifier: Mutex::new(None),
        })
    }

    /// Start draining: readiness off, long polls answered now (with what they have).
    pub fn drain(&self) {
        self.draining.send_replace(true);
    }

    pub fn is_draining(&self) -> bool {
        *self.draining.borrow()
    }

    async fn write(&self, cmd: Command) -> Res<Reply> {
        match tokio::time::timeout(self.cfg.write_timeout(), self.store.write(cmd)).await {
            Ok(r) => r.map_err(Refusal::from),
            Err(_) => Err(ApiError::new(
                ErrorCode::Unavailable,
                "the store did not commit the write in time; its outcome is unknown",
            )
            .into()),
        }
    }

    fn read<R>(&self, f: impl FnOnce(&crate::catalog::Catalog) -> R) -> R {
        self.store.shared().read(f)
    }
}

// ------------------------------------------------------------------ router

pub fn router(st: Arc<AppState>) -> Router {
    let t = "/v1/tenants/{tenant}";
    let n = "/v1/tenants/{tenant}/namespaces/{namespace}";
    let api = Router::new()
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/openapi.json", get(openapi_json))
        .route("/v1/tenants", get(list_tenants).post(create_tenant))
        .route(
            t,
            get(get_tenant).patch(update_tenant).delete(delete_tenant),
        )
        .route(
            &format!("{t}/namespaces"),
            get(list_namespaces).post(create_namespace),
        )
        .route(
            n,
            get(get_namespace)
                .patch(update_namespace)
                .delete(delete_namespace),
        )
        .route(
            &format!("{n}/streams"),
            get(list_streams).post(create_stream),
        )
        .route(
            &format!("{n}/streams/{{stream}}"),
            get(get_stream).patch(update_stream).delete(delete_stream),
        )
        .route(
            &format!("{n}/streams/{{stream}}/shards"),
            get(stream_shards),
        )
        .route(
            &format!("{n}/streams/{{stream}}/replication"),
            get(replication::stream_replication),
        )
        .route(
            &format!("{n}/streams/{{stream}}/shards/{{shard}}/report"),
            post(replication::shard_report),
        )
        .route(
            &format!("{n}/streams/{{stream}}/shards/{{shard}}/abandon"),
            post(replication::shard_abandon),
        )
        .route(&format!("{n}/caches"), get(list_caches).post(create_cache))
        .route(
            &format!("{n}/caches/{{cache}}"),
            get(get_cache).patch(update_cache).delete(delete_cache),
        )
        .route(&format!("{n}/caches/{{cache}}/shards"), get(cache_shards))
        .route("/v1/catalog", get(catalog))
        .route("/v1/catalog/changes", get(changes))
        .route("/v1/brokers", get(list_brokers).post(register_broker))
        .route("/v1/brokers/{node_id}", get(get_broker))
        .route("/v1/brokers/{node_id}/heartbeat", post(heartbeat))
        .route("/v1/cluster", get(cluster))
        .route("/internal/v1/write", post(internal_write))
        .route(
            "/v1/tokens",
            get(rest_auth::list_tokens).post(rest_auth::create_token),
        )
        .route("/v1/tokens/revoke", post(rest_auth::revoke))
        .route("/v1/auth/revocations", get(rest_auth::revocations))
        .route("/v1/nodes/{node_id}/token", post(rest_auth::node_token))
        .route(
            "/v1/nodes/{node_id}/enrolment",
            post(rest_auth::enrol::node_enrolment),
        )
        .route(
            "/v1/nodes/{node_id}/enrol",
            post(rest_auth::enrol::node_enrol),
        )
        .route("/v1/auth/jwks", get(rest_auth::jwks))
        .route(
            "/v1/auth/keys",
            get(rest_auth::list_keys).post(rest_auth::add_key),
        )
        .route(
            "/v1/auth/keys/{kid}",
            axum::routing::delete(rest_auth::remove_key),
        )
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(st.cfg.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(
            st.clone(),
            rest_auth::authorize,
        ))
        .layer(axum::middleware::from_fn_with_state(
            st.clone(),
            observe_request,
        ))
        // Outermost, so that it sees every refusal made before a body was read.
        .layer(axum::middleware::from_fn(unread_body::close_if_unread))
        .with_state(st.clone());
    api
}

async fn not_found(uri: Uri) -> Refusal {
    Refusal::new(
        StatusCode::NOT_FOUND,
        ErrorCode::NotFound,
        format!("no route {}", uri.path()),
    )
}

async fn method_not_allowed() -> Refusal {
    Refusal::new(
        StatusCode::METHOD_NOT_ALLOWED,
        ErrorCode::InvalidRequest,
        "method not allowed on this path",
    )
}

// ------------------------------------------------------------------ health

#[derive(Serialize, Deserialize, utoipa::ToSchema)]
pub struct Health {
    pub status: String,
}

#[utoipa::path(get, path = "/livez", tag = "health", responses((status = 200, body = Health)))]
async fn livez() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
    })
}

/// Ready when the store can serve: the catalog is initialized and, under Raft, a leader is
/// known and answering.
#[utoipa::path(get, path = "/readyz", tag = "health", responses(
    (status = 200, body = Health), (status = 503, body = ErrorBody)))]
async fn readyz(State(st): State<Arc<AppState>>) -> Res<Json<Health>> {
    if st.is_draining() {
        return Err(ApiError::new(
            ErrorCode::ShuttingDown,
            "the control plane is shutting down",
        )
        .into());
    }
    st.store.ready().await.map_err(Refusal::from)?;
    Ok(Json(Health {
        status: "ready".into(),
    }))
}

async fn observe_request(
    State(st): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let t0 = Instant::now();
    let resp = next.run(req).await;
    st.requests
        .observe(resp.status().as_u16(), t0.elapsed().as_micros() as u64);
    resp
}

/// Prometheus text exposition: REST requests (by status class, latency histogram), the
/// store's Raft view (term, leader, applied index), catalog revision, brokers.
async fn metrics(State(st): State<Arc<AppState>>) -> impl IntoResponse {
    use std::fmt::Write;
    use std::sync::atomic::Ordering::Relaxed;
    let status = st.store.status();
    let (live, total) = st.read(|c| {
        let all: Vec<_> = c.brokers().collect();
        (all.iter().filter(|b| b.live).count(), all.len())
    });
    let mut o = String::new();
    let mut gauge = |name: &str, help: &str, v: u64| {
        let _ = write!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}\n");
    };
    gauge(
        "felix_controlplane_ready",
        "1 when the store can serve",
        status.ready as u64,
    );
    gauge(
        "felix_controlplane_catalog_revision",
        "catalog revision applied by this member",
        status.catalog_revision,
    );
    gauge(
        "felix_controlplane_raft_term",
        "Raft term (0 for the memory store)",
        status.term,
    );
    gauge(
        "felix_controlplane_raft_is_leader",
        "1 when this member leads",
        status.is_leader as u64,
    );
    gauge(
        "felix_controlplane_raft_leader",
        "node id of the known leader (0 unknown)",
        status.leader.unwrap_or(0),
    );
    gauge(
        "felix_controlplane_raft_applied_index",
        "last applied Raft log index",
        status.applied_index,
    );
    gauge(
        "felix_controlplane_raft_voters",
        "voting members",
        status.voters.len() as u64,
    );
    gauge(
        "felix_controlplane_brokers",
        "registered brokers",
        total as u64,
    );
    gauge(
        "felix_controlplane_brokers_live",
        "brokers counted live",
        live as u64,
    );
    let h = st.read(|c| c.replication_health());
    gauge(
        "felix_controlplane_replicated_shards",
        "shards of streams of more than one copy, seated",
        h.shards,
    );
    gauge(
        "felix_controlplane_under_replicated_shards",
        "replicated shards with a replica down or no longer vouched for",
        h.under_replicated,
    );
    gauge(
        "felix_controlplane_unavailable_replicated_shards",
        "replicated shards no live replica qualifies to lead",
        h.unavailable,
    );
    gauge(
        "felix_controlplane_replica_lag_records_max",
        "largest lag of a replica behind its leader's reported end, records",
        h.lag_records_max,
    );
    gauge(
        "felix_controlplane_replica_lag_bytes_max",
        "largest lag of a replica behind its leader's log, bytes (the leaders' last landed reports)",
        h.lag_bytes_max,
    );
    for (answer, c) in [
        ("landed", &replication::REPORTS_LANDED),
        ("refused", &replication::REPORTS_REFUSED),
        ("stale", &replication::REPORTS_STALE),
    ] {
        if answer == "landed" {
            let _ = write!(o, "# HELP felix_controlplane_replica_reports_total leaders' reports answered here, by answer\n# TYPE felix_controlplane_replica_reports_total counter\n");
        }
        let _ = writeln!(
            o,
            "felix_controlplane_replica_reports_total{{answer=\"{answer}\"}} {}",
            c.load(Relaxed)
        );
    }
    let _ = write!(
        o,
        "# HELP felix_controlplane_abandons_total replicated shards an operator abandoned to a replica here\n# TYPE felix_controlplane_abandons_total counter\nfelix_controlplane_abandons_total {}\n",
        replication::ABANDONS.load(Relaxed)
    );
    let _ = write!(
        o,
        "# HELP felix_controlplane_replica_replacements_total replicas of dead brokers this member's sweep replaced (one per shard changed)\n# TYPE felix_controlplane_replica_replacements_total counter\nfelix_controlplane_replica_replacements_total {}\n",
        replication::REPLACEMENTS.load(Relaxed)
    );
    let r = &st.requests;
    let _ = write!(o, "# HELP felix_controlplane_requests_total REST requests answered, by status class\n# TYPE felix_controlplane_requests_total counter\n");
    for (i, c) in r.by_class.iter().enumerate() {
        let _ = writeln!(
            o,
            "felix_controlplane_requests_total{{class=\"{}xx\"}} {}",
            i + 1,
            c.load(Relaxed)
        );
    }
    let _ = write!(o, "# HELP felix_controlplane_request_seconds REST request latency\n# TYPE felix_controlplane_request_seconds histogram\n");
    for (i, b) in LATENCY_BUCKETS_US.iter().enumerate() {
        let _ = writeln!(
            o,
            "felix_controlplane_request_seconds_bucket{{le=\"{}\"}} {}",
            *b as f64 / 1e6,
            r.buckets[i].load(Relaxed)
        );
    }
    let count = r.buckets[LATENCY_BUCKETS_US.len()].load(Relaxed);
    let _ = writeln!(
        o,
        "felix_controlplane_request_seconds_bucket{{le=\"+Inf\"}} {count}"
    );
    let _ = writeln!(
        o,
        "felix_controlplane_request_seconds_sum {}",
        r.sum_us.load(Relaxed) as f64 / 1e6
    );
    let _ = writeln!(o, "felix_controlplane_request_seconds_count {count}");
    let _ = write!(
        o,
        "# HELP felix_controlplane_tls_handshake_failures_total TLS handshakes on the REST listener that failed or timed out\n# TYPE felix_controlplane_tls_handshake_failures_total counter\nfelix_controlplane_tls_handshake_failures_total {}\n",
        crate::https::HANDSHAKE_FAILURES.load(Relaxed)
    );
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        o,
    )
}

async fn openapi_json() -> impl IntoResponse {
    axum::Json(openapi_document().clone())
}

/// The OpenAPI document: generated from the handlers and types, plus the refusals every JSON
/// body can meet before a handler runs (413 too large, 415 not JSON).
pub fn openapi_document() -> &'static serde_json::Value {
    static DOC: std::sync::OnceLock<serde_json::Value> = std::sync::OnceLock::new();
    DOC.get_or_init(|| {
        let mut doc = serde_json::to_value(ApiDoc::openapi()).expect("openapi serializes");
        let err = serde_json::json!({
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
        });
        if let Some(paths) = doc.get_mut("paths").and_then(|p| p.as_object_mut()) {
            for ops in paths.values_mut().filter_map(|o| o.as_object_mut()) {
                for op in ops.values_mut().filter_map(|o| o.as_object_mut()) {
                    if !op.contains_key("requestBody") {
                        continue;
                    }
                    if let Some(r) = op.get_mut("responses").and_then(|r| r.as_object_mut()) {
                        for (code, what) in [
                            ("413", "Body larger than the limit"),
                            ("415", "Body is not application/json"),
                        ] {
                            let mut e = err.clone();
                            e["description"] = what.into();
                            r.entry(code).or_insert(e);
                        }
                    }
                }
            }
        }
        doc
    })
}

// ------------------------------------------------------------------ catalog feed

#[utoipa::path(get, path = "/v1/catalog", tag = "catalog",
    responses((status = 200, body = CatalogSnapshot)))]
async fn catalog(State(st): State<Arc<AppState>>) -> Json<CatalogSnapshot> {
    Json(st.read(|c| c.snapshot()))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ChangesQuery {
    /// Answer the changes after this revision (a snapshot's `revision`, or the last `next_since`).
    pub since: u64,
    /// Wait up to this long for a change when none is ready (0 = answer at once). At most the
    /// server's `max_wait_ms` (30000 by default).
    pub wait_ms: Option<u64>,
    /// At most this many changes (default and maximum: the server's page maximum, 1000).
    pub limit: Option<u32>,
}

/// Every change after `since`, gap-free and in order. Long-polls up to `wait_ms` when there is
/// none yet. `since` older than the retained changes (or ahead of this catalog) answers 410
/// `revision_too_old`: read `GET /v1/catalog` again.
#[utoipa::path(get, path = "/v1/catalog/changes", tag = "catalog", params(ChangesQuery),
    responses((status = 200, body = ChangesPage), (status = 400, body = ErrorBody), (status = 410, body = ErrorBody)))]
async fn changes(
    State(st): State<Arc<AppState>>,
    Query(q): Query<ChangesQuery>,
) -> Res<Json<ChangesPage>> {
    let wait = check_wait_ms(&st, q.wait_ms)?;
    let max = st.cfg.changes_page_max.max(1);
    let limit = match q.limit {
        None => max,
        Some(0) => return Err(ApiError::invalid("limit must be at least 1").into()),
        Some(l) => (l as usize).min(max),
    };
    // A `since` this member has not reached yet waits too.
    long_poll(&st, wait, || st.read(|c| c.revision()) > q.since).await;
    Ok(Json(st.read(|c| c.changes_since(q.since, limit))?))
}

/// `wait_ms` of a long poll, refused past the server's `max_wait_ms`.
pub(crate) fn check_wait_ms(st: &AppState, wait_ms: Option<u64>) -> Res<u64> {
    let wait = wait_ms.unwrap_or(0);
    if wait > st.cfg.max_wait_ms {
        return Err(ApiError::invalid(format!(
            "wait_ms must be at most {}, got {wait}",
            st.cfg.max_wait_ms
        ))
        .into());
    }
    Ok(wait)
}

/// Wait until `ready()` (checked at every applied change), `wait_ms` passes, or the server
/// drains (a shutdown never waits out a poll).
pub(crate) async fn long_poll(st: &AppState, wait_ms: u64, mut ready: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_millis(wait_ms);
    let mut rx = st.store.shared().watch();
    let mut drain = st.draining.subscribe();
    loop {
        rx.borrow_and_update();
        if ready() || *drain.borrow_and_update() {
            return;
        }
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        if remaining.is_zero() {
            return;
        }
        let changed = tokio::select! {
            r = tokio::time::timeout(remaining, rx.changed()) => r.is_ok_and(|r| r.is_ok()),
            _ = drain.changed() => false,
        };
        if !changed {
            return;
        }
    }
}

// ------------------------------------------------------------------ brokers

#[utoipa::path(get, path = "/v1/brokers", tag = "brokers", responses((status = 200, body = Vec<Broker>)))]
async fn list_brokers(State(st): State<Arc<AppState>>) -> Json<Vec<Broker>> {
    Json(st.read(|c| c.brokers().cloned().collect()))
}

#[utoipa::path(get, path = "/v1/brokers/{node_id}", tag = "brokers", params(("node_id" = u64, Path)),
    responses((status = 200, body = Broker), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn get_broker(State(st): State<Arc<AppState>>, Path(id): Path<u64>) -> Res<Json<Broker>> {
    Ok(Json(st.read(|c| c.broker(id).cloned())?))
}

/// Register (or re-register after a restart: the incarnation goes up). Placement runs.
#[utoipa::path(post, path = "/v1/brokers", tag = "brokers", request_body = RegisterBroker,
    responses((status = 200, body = RegisterBrokerReply), (status = 400, body = ErrorBody),
              (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn register_broker(
    State(st): State<Arc<AppState>>,
    caller: Option<axum::Extension<Caller>>,
    Json(req): Json<RegisterBroker>,
) -> Res<Json<RegisterBrokerReply>> {
    // A node credential registers only its own node id.
    rest_auth::permit(
        &caller,
        crate::auth::Action::ClusterAdmin,
        crate::auth::ANY_TENANT,
        &format!("brokers/{}", req.node_id),
    )?;
    let capabilities: Vec<String> = req
        .capabilities
        .iter()
        .filter(|c| crate::api::CONTROL_CAPABILITIES.contains(&c.as_str()))
        .cloned()
        .collect();
    match st.write(Command::RegisterBroker { req }).await? {
        Reply::Broker(b) => Ok(Json(RegisterBrokerReply {
            catalog_revision: b.revision.max(st.read(|c| c.revision())),
            broker: b,
            heartbeat_interval_ms: st.cfg.heartbeat_interval_ms,
            dead_after_ms: st.cfg.dead_after_ms,
            capabilities,
            cluster_id: st.read(|c| c.catalog_id().to_string()),
        })),
        other => Err(unexpected(other)),
    }
}

/// Heartbeat. 404 `not_found` means "register again"; 409 `conflict` means the incarnation
/// is stale (another process registered under this node id since).
#[utoipa::path(post, path = "/v1/brokers/{node_id}/heartbeat", tag = "brokers",
    params(("node_id" = u64, Path)), request_body = Heartbeat,
    responses((status = 200, body = HeartbeatReply), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn heartbeat(
    State(st): State<Arc<AppState>>,
    caller: Option<axum::Extension<Caller>>,
    Path(id): Path<u64>,
    Json(hb): Json<Heartbeat>,
) -> Res<Json<HeartbeatReply>> {
    match st.store.route() {
        Route::Local => local_heartbeat(&st, id, hb).await.map(Json),
        Route::Leader(addr) => {
            let url = format!("{}://{addr}/v1/brokers/{id}/heartbeat", st.cfg.scheme());
            // The leader checks the broker's own credential again (every member verifies
            // with the same keys).
            let mut rb = st.http.post(url).json(&hb);
            if let Some(axum::Extension(c)) = &caller {
                rb = rb.bearer_auth(&*c.token);
            }
            let r = rb.send().await.map_err(|e| {
                Refusal::from(ApiError::new(
                    ErrorCode::Unavailable,
                    format!("leader at {addr} unreachable: {e}"),
                ))
            })?;
            let status =
                StatusCode::from_u16(r.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
            if status.is_success() {
                let body: HeartbeatReply = r.json().await.map_err(|e| {
                    Refusal::from(ApiError::new(
                        ErrorCode::Unavailable,
                        format!("leader answer: {e}"),
                    ))
                })?;
                Ok(Json(body))
            } else {
                let body: ErrorBody = r.json().await.unwrap_or(ErrorBody {
                    code: "unavailable".into(),
                    message: format!("leader answered {status}"),
                });
                Err(Refusal {
                    status,
                    err: ApiError::from_body(body),
                })
            }
        }
        Route::NoLeader => {
            Err(ApiError::new(ErrorCode::Unavailable, "no leader elected yet").into())
        }
    }
}

async fn local_heartbeat(st: &AppState, id: u64, hb: Heartbeat) -> Res<HeartbeatReply> {
    let b = st.read(|c| c.broker(id).cloned())?;
    if let Some(i) = hb.incarnation {
        if i != b.incarnation {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "incarnation {i} of broker {id} is stale (now {}); register again",
                    b.incarnation
                ),
            )
            .into());
        }
    }
    if hb.leaving == Some(true) {
        if hb.incarnation != Some(b.incarnation) {
            return Err(
                ApiError::invalid("a leaving heartbeat names the incarnation that leaves").into(),
            );
        }
        let live = match st
            .write(Command::SetBrokerLive {
                node_id: id,
                live: false,
            })
            .await?
        {
            Reply::Broker(ref b) => b.live,
            _ => false,
        };
        return Ok(heartbeat_reply(st, live));
    }
    {
        let mut s = st.soft.lock().unwrap_or_else(|e| e.into_inner());
        s.last_seen.insert(id, (b.incarnation, Instant::now()));
        if let Some(r) = hb.catalog_revision {
            s.reported.insert(id, r);
        }
    }
    let live = if b.live {
        true
    } else {
        matches!(
            st.write(Command::SetBrokerLive { node_id: id, live: true }).await?,
            Reply::Broker(ref b) if b.live
        )
    };
    Ok(heartbeat_reply(st, live))
}

/// What a heartbeat is answered: the broker's liveness now, the timing it keeps, and the
/// catalog revision.
fn heartbeat_reply(st: &AppState, live: bool) -> HeartbeatReply {
    HeartbeatReply {
        live,
        heartbeat_interval_ms: st.cfg.heartbeat_interval_ms,
        dead_after_ms: st.cfg.dead_after_ms,
        catalog_revision: st.read(|c| c.revision()),
    }
}

#[utoipa::path(get, path = "/v1/cluster", tag = "cluster", responses((status = 200, body = ClusterStatus)))]
async fn cluster(State(st): State<Arc<AppState>>) -> Json<ClusterStatus> {
    Json(st.store.status())
}

/// Receiving end of a follower's forwarded write: applied only by the leader (never forwarded
/// again, so a forward cannot loop).
async fn internal_write(
    State(st): State<Arc<AppState>>,
    Json(cmd): Json<Command>,
) -> axum::Json<Result<Reply, ApiError>> {
    let r = match tokio::time::timeout(st.cfg.write_timeout(), st.store.write_local(cmd)).await {
        Ok(r) => r,
        Err(_) => Err(ApiError::new(
            ErrorCode::Unavailable,
            "the leader did not commit the write in time; its outcome is unknown",
        )),
    };
    axum::Json(r)
}

fn unexpected(r: Reply) -> Refusal {
    ApiError::new(ErrorCode::Internal, format!("unexpected store reply {r:?}")).into()
}

// ------------------------------------------------------------------ serve

/// Serve until `stop` fires: REST (+ the store's internal routes) and the sweep.
pub async fn serve<L>(
    listener: L,
    st: Arc<AppState>,
    extra: Router,
    stop: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()>
where
    L: axum::serve::Listener<Addr = std::net::SocketAddr>,
{
    let app = router(st.clone()).merge(extra);
    let sweeper = tokio::spawn(sweep(st.clone(), stop.clone()));
    let mut s2 = stop.clone();
    let r = axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            while !*s2.borrow() {
                if s2.changed().await.is_err() {
                    break;
                }
            }
        })
        .await;
    sweeper.abort();
    r
}

// ------------------------------------------------------------------ OpenAPI

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Felix control plane",
        description = "Tenants, namespaces, streams, caches, brokers, placement and the catalog feed. Errors are `{code, message}` with codes from the wire's error registry."
    ),
    paths(
        livez,
        readyz,
        list_tenants,
        create_tenant,
        get_tenant,
        update_tenant,
        delete_tenant,
        list_namespaces,
        create_namespace,
        get_namespace,
        update_namespace,
        delete_namespace,
        list_streams,
        create_stream,
        get_stream,
        update_stream,
        delete_stream,
        stream_shards,
        replication::stream_replication,
        replication::shard_report,
        replication::shard_abandon,
        list_caches,
        create_cache,
        get_cache,
        update_cache,
        delete_cache,
        cache_shards,
        catalog,
        changes,
        list_brokers,
        register_broker,
        get_broker,
        heartbeat,
        cluster,
        rest_auth::create_token,
        rest_auth::list_tokens,
        rest_auth::revoke,
        rest_auth::revocations,
        rest_auth::node_token,
        rest_auth::enrol::node_enrolment,
        rest_auth::enrol::node_enrol,
        rest_auth::jwks,
        rest_auth::list_keys,
        rest_auth::add_key,
        rest_auth::remove_key,
    ),
    components(schemas(
        ErrorBody,
        Health,
        Tenant,
        Namespace,
        Stream,
        Cache,
        Broker,
        ShardPlacement,
        ShardState,
        StreamReplication,
        ShardReplication,
        ReplicaLag,
        replication::ReportRequest,
        replication::HolderEntry,
        replication::ReportReply,
        replication::AbandonRequest,
        replication::AbandonReply,
        ResourceState,
        FsyncMode,
        Consistency,
        CreateTenant,
        UpdateTenant,
        CreateNamespace,
        UpdateNamespace,
        CreateStream,
        UpdateStream,
        CreateCache,
        UpdateCache,
        RegisterBroker,
        RegisterBrokerReply,
        Heartbeat,
        HeartbeatReply,
        CatalogSnapshot,
        Change,
        ChangeEvent,
        ChangesPage,
        ClusterStatus,
        CreateToken,
        IssuedToken,
        TokenRecord,
        NodeTokenRequest,
        KeyInfo,
        RevokeRequest,
        crate::auth::Revocation,
        crate::auth::RevocationFeed,
        crate::auth::RevokeKind,
        crate::auth::Jwks,
        crate::auth::Jwk,
    )),
    modifiers(&BearerScheme),
    security(("bearer" = []))
)]
pub struct ApiDoc;

/// Declares the bearer scheme every operation but health and this document needs, and the
/// 401 and 403 answers every such operation may give.
struct BearerScheme;

/// Paths served without a token.
pub const PUBLIC_PATHS: [&str; 3] = ["/livez", "/readyz", "/v1/openapi.json"];

impl utoipa::Modify for BearerScheme {
    fn modify(&self, api: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::content::ContentBuilder;
        use utoipa::openapi::security::{
            HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme,
        };
        use utoipa::openapi::{Ref, ResponseBuilder};
        let answer = |what: &str| {
            ResponseBuilder::new()
                .description(what)
                .content(
                    "application/json",
                    ContentBuilder::new()
                        .schema(Some(Ref::from_schema_name("ErrorBody")))
                        .build(),
                )
                .build()
        };
        let unauth = answer("No valid bearer token: unauthenticated or token_expired");
        let forbidden = answer("The token lacks the permission the operation needs (forbidden)");
        for (path, item) in api.paths.paths.iter_mut() {
            let public = PUBLIC_PATHS.contains(&path.as_str());
            for op in [
                &mut item.get,
                &mut item.post,
                &mut item.put,
                &mut item.patch,
                &mut item.delete,
            ]
            .into_iter()
            .flatten()
            {
                if public {
                    op.security = Some(vec![SecurityRequirement::default()]);
                    continue;
                }
                let r = &mut op.responses.responses;
                r.entry("401".into())
                    .or_insert_with(|| unauth.clone().into());
                r.entry("403".into())
                    .or_insert_with(|| forbidden.clone().into());
            }
        }
        let c = api.components.get_or_insert_with(Default::default);
        c.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("JWT")
                    .build(),
            ),
        );
    }
}

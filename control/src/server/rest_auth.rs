//! Bearer tokens on the REST API: which permission each path needs ([`need`], pure and
//! table-tested), the middleware that verifies the token against the replicated keys and
//! checks it, and the endpoints that issue tokens and rotate keys.
//!
//! Resources of the `cluster.admin` action name what they guard: `tenants`, `catalog` (the
//! catalog, its changes feed, the broker list, the cluster status), `brokers/N` (register and
//! heartbeat as broker N, and its node token; report as the leader of a replicated shard),
//! `placement` (abandon an unavailable replicated shard), `enrolments` (issue one-time enrolment tokens),
//! `enrol/N` (exchange broker N's enrolment token for its node token), `tokens`, `keys`, `jwks`, `revocations` (the
//! revocation feed), `metrics` and
//! `internal` (writes forwarded between members). `manage` resources are `*` for the tenant
//! itself and its namespaces, `NS/` for a namespace and its collections, `NS/NAME` for a
//! stream or cache.

use super::*;
use crate::auth::{
    admin_claims, node_claims, Action, AuthError, Claims, Jwks, Permission, Principal, Revocation,
    RevocationFeed, RevokeKind, Verifier, ANY_TENANT, ISSUER,
};
use crate::catalog::auth_state::{hex_of_seed, AuthCommand, AuthState, TokenRecord};
use crate::config::AuthSwitch;
use axum::http::{HeaderMap, Method};
use axum::Extension;

/// What a request needs before its handler runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Need {
    Public,
    /// A valid token allowed `action` on `resource` of `tenant`.
    Allow {
        action: Action,
        tenant: String,
        resource: String,
    },
    /// A valid token; the handler checks what the body or query names.
    InHandler,
}

fn cluster(resource: impl Into<String>) -> Need {
    Need::Allow {
        action: Action::ClusterAdmin,
        tenant: ANY_TENANT.into(),
        resource: resource.into(),
    }
}

fn manage(tenant: &str, resource: impl Into<String>) -> Need {
    Need::Allow {
        action: Action::Manage,
        tenant: tenant.into(),
        resource: resource.into(),
    }
}

/// The permission `method path` needs. Unknown paths need cluster scope, so probing for routes
/// without a token learns nothing.
pub fn need(method: &Method, path: &str, metrics_public: bool) -> Need {
    let seg: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let get = method == Method::GET;
    match seg.as_slice() {
        ["livez"] | ["readyz"] | ["v1", "openapi.json"] => Need::Public,
        ["metrics"] if metrics_public => Need::Public,
        ["metrics"] => cluster("metrics"),
        ["v1", "tenants"] => cluster("tenants"),
        ["v1", "tenants", t] if get => manage(t, "*"),
        ["v1", "tenants", _] => cluster("tenants"),
        ["v1", "tenants", t, "namespaces"] => manage(t, "*"),
        ["v1", "tenants", t, "namespaces", n] => manage(t, format!("{n}/")),
        ["v1", "tenants", t, "namespaces", n, "streams" | "caches"] => manage(t, format!("{n}/")),
        ["v1", "tenants", t, "namespaces", n, "streams" | "caches", o]
        | ["v1", "tenants", t, "namespaces", n, "streams" | "caches", o, "shards"]
        | ["v1", "tenants", t, "namespaces", n, "streams", o, "replication"] => {
            manage(t, format!("{n}/{o}"))
        }
        // Broker `leader` of the body, checked in the handler.
        ["v1", "tenants", _, "namespaces", _, "streams", _, "shards", _, "report"] => {
            Need::InHandler
        }
        // Overrides rule 8: the cluster's operator only.
        ["v1", "tenants", _, "namespaces", _, "streams", _, "shards", _, "abandon"] => {
            cluster("placement")
        }
        ["v1", "catalog"] | ["v1", "catalog", "changes"] | ["v1", "cluster"] => cluster("catalog"),
        ["v1", "brokers"] if get => cluster("catalog"),
        ["v1", "brokers"] => Need::InHandler,
        ["v1", "brokers", _] => cluster("catalog"),
        ["v1", "brokers", id, "heartbeat"] => cluster(format!("brokers/{id}")),
        ["v1", "nodes", id, "token"] => cluster(format!("brokers/{id}")),
        ["v1", "nodes", _, "enrolment"] => cluster("enrolments"),
        ["v1", "nodes", id, "enrol"] => cluster(format!("enrol/{id}")),
        ["v1", "tokens"] | ["v1", "tokens", "revoke"] => Need::InHandler,
        ["v1", "auth", "revocations"] => cluster("revocations"),
        ["v1", "auth", "jwks"] => cluster("jwks"),
        ["v1", "auth", "keys"] | ["v1", "auth", "keys", _] => cluster("keys"),
        ["internal", "v1", "write"] => cluster("internal"),
        // The member protocol below Raft: a wiped or new member asks for its identity before
        // it holds any key, so these cannot carry a credential derived from the keys. The Raft
        // router checks the member secret there instead (raft/member_auth.rs).
        ["internal", "v1", "identity" | "rejoin" | "assign"] | ["raft", ..] => Need::Public,
        ["internal", ..] => cluster("internal"),
        _ => cluster("*"),
    }
}

/// Who is calling, as the middleware verified it.
#[derive(Clone)]
pub struct Caller {
    pub principal: Arc<Principal>,
    pub token: Arc<str>,
}

/// The handler-side check; with auth off there is no caller and everything is allowed.
pub fn permit(
    caller: &Option<Extension<Caller>>,
    action: Action,
    tenant: &str,
    resource: &str,
) -> Res<()> {
    match caller {
        None => Ok(()),
        Some(Extension(c)) => c
            .principal
            .check(action, tenant, resource)
            .map_err(|why| ApiError::new(ErrorCode::Forbidden, why).into()),
    }
}

pub fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn refused(e: AuthError) -> Refusal {
    let code = match e {
        AuthError::Expired(_) => ErrorCode::TokenExpired,
        AuthError::Revoked(_) => ErrorCode::Revoked,
        AuthError::Unauthenticated(_) | AuthError::UnknownKey(_) => ErrorCode::Unauthenticated,
    };
    ApiError::new(code, e.to_string()).into()
}

/// The bearer token of a request, or a 401 saying how to send one.
fn bearer(headers: &HeaderMap) -> Res<&str> {
    let missing = || -> Refusal {
        ApiError::new(
            ErrorCode::Unauthenticated,
            "no bearer token: send `Authorization: Bearer TOKEN` (felixctl takes --token, FELIX_TOKEN or the admin token file)",
        )
        .into()
    };
    let v = headers
        .get(axum::http::header::AUTHORIZATION)
        .ok_or_else(missing)?;
    let v = v.to_str().map_err(|_| missing())?;
    v.strip_prefix("Bearer ")
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or_else(missing)
}

impl AppState {
    /// A verifier of the keys the store holds now, rebuilt only when they change.
    fn verifier(&self) -> Res<Arc<Verifier>> {
        let (kids, initialized) = self.read(|c| {
            let a = c.auth();
            let kids: Vec<String> = a.keys.iter().map(|k| k.kid.clone()).collect();
            (kids, a.initialized())
        });
        if !initialized {
            return Err(ApiError::new(
                ErrorCode::Unavailable,
                "the signing keys are not created yet (the first leader creates them at start); retry",
            )
            .into());
        }
        let mut cache = self.verifier.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((k, v)) = cache.as_ref() {
            if *k == kids {
                return Ok(v.clone());
            }
        }
        // The public keys only on a change: deriving them from the seeds is a scalar
        // multiplication per key, which every request used to pay.
        let (kids, jwks) = self.read(|c| {
            let a = c.auth();
            (a.keys.iter().map(|k| k.kid.clone()).collect(), a.jwks())
        });
        let v = Arc::new(Verifier::new(&jwks).map_err(|e| ApiError::new(ErrorCode::Internal, e))?);
        *cache = Some((kids, v.clone()));
        Ok(v)
    }

    fn authenticate(&self, headers: &HeaderMap) -> Res<Caller> {
        let token = bearer(headers)?;
        let p = self.verifier()?.verify(token, now_s()).map_err(refused)?;
        if let Some(why) = self.read(|c| c.auth().revoked(&p)) {
            return Err(refused(AuthError::Revoked(why)));
        }
        Ok(Caller {
            principal: Arc::new(p),
            token: token.into(),
        })
    }

    fn signer(&self) -> Res<crate::auth::SigningKey> {
        if self.cfg.auth == AuthSwitch::Off {
            return Err(ApiError::new(
                ErrorCode::Unsupported,
                "auth is off on this control plane: it issues no tokens",
            )
            .into());
        }
        self.read(|c| c.auth().signer().map(|k| k.signing_key()))
            .ok_or_else(|| {
                ApiError::new(
                    ErrorCode::Unavailable,
                    "the signing keys are not created yet; retry",
                )
                .into()
            })
    }
}

/// Verify the bearer token and check what the path needs; the verified caller rides in the
/// request's extensions for the handlers that check more.
pub(super) async fn authorize(
    State(st): State<Arc<AppState>>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if st.cfg.auth == AuthSwitch::Off {
        return next.run(req).await;
    }
    let need = need(req.method(), req.uri().path(), st.cfg.metrics_public);
    if need == Need::Public {
        return next.run(req).await;
    }
    let caller = match st.authenticate(req.headers()) {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    if let Need::Allow {
        action,
        tenant,
        resource,
    } = &need
    {
        if let Err(why) = caller.principal.check(*action, tenant, resource) {
            return Refusal::from(ApiError::new(ErrorCode::Forbidden, why)).into_response();
        }
    }
    req.extensions_mut().insert(caller);
    next.run(req).await
}

// ------------------------------------------------------------------ bootstrap

/// The bootstrap command a leader proposes when auth is on and no key exists yet.
pub(super) fn bootstrap(st: &AppState) -> Option<Command> {
    if st.cfg.auth == AuthSwitch::Off || st.read(|c| c.auth().initialized()) {
        return None;
    }
    Some(Command::Auth {
        cmd: AuthCommand::Init {
            kid: format!("k{:016x}", rand::random::<u64>()),
            seed_hex: hex_of_seed(&rand::random::<[u8; 32]>()),
            admin_jti: format!("admin-{:016x}", rand::random::<u64>()),
            at_s: now_s(),
            admin_ttl_s: st.cfg.admin_token_ttl_s,
        },
    })
}

/// The bootstrap admin token, the same bytes on every member.
pub fn admin_token(a: &AuthState) -> Option<String> {
    let r = a.admin.as_ref()?;
    let k = a.keys.iter().find(|k| k.kid == r.kid)?;
    Some(
        k.signing_key()
            .issue(&admin_claims(ADMIN_SUBJECT, &r.jti, r.issued_at_s, r.ttl_s)),
    )
}

/// Write the admin token file (mode 0600, replaced atomically) once the keys exist, if it is
/// missing or differs. Called from the sweep on every member.
pub(super) fn keep_admin_token_file(st: &AppState) {
    let (Some(path), Some(token)) = (
        st.cfg.admin_token_path(),
        st.read(|c| admin_token(c.auth())),
    ) else {
        return;
    };
    if std::fs::read_to_string(&path).is_ok_and(|t| t.trim() == token) {
        return;
    }
    let r = (|| -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let tmp = path.with_extension("token.tmp");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(token.as_bytes())?;
        f.write_all(b"\n")?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    })();
    match r {
        Ok(()) => tracing::info!(path = %path.display(), "wrote the bootstrap admin token"),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot write the admin token")
        }
    }
}

// ------------------------------------------------------------------ tokens

/// A token to issue.
#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateToken {
    /// Who the token speaks for (1..=128 printable characters).
    pub subject: String,
    /// The tenant it acts in, or `*` for every tenant (needs `cluster.admin` on `tokens`).
    pub tenant: String,
    /// `ACTION:PATTERN` strings; each must be covered by the caller's own permissions.
    pub perms: Vec<String>,
    /// Lifetime, seconds (default 3600; at most the control plane's `token_ttl_max_s`).
    #[serde(default)]
    pub ttl_s: Option<u64>,
}

/// An issued token. The token itself is shown once and not kept.
#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
pub struct IssuedToken {
    pub token: String,
    pub record: TokenRecord,
}

/// Query of `GET /v1/tokens`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
pub struct TokenQuery {
    /// Only this tenant's tokens (needs its `manage`); absent: all (needs cluster scope).
    pub tenant: Option<String>,
}

/// Lifetime of a node token asked for.
#[derive(Debug, Default, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NodeTokenRequest {
    /// Seconds (default and maximum: `token_ttl_max_s`).
    #[serde(default)]
    pub ttl_s: Option<u64>,
}

const DEFAULT_TTL_S: u64 = 3600;
const PERMS_MAX: usize = 64;
const SUBJECT_BYTES_MAX: usize = 128;

fn invalid(msg: impl Into<String>) -> Refusal {
    ApiError::new(ErrorCode::InvalidRequest, msg).into()
}

/// A subject (or another name a token carries, as a revocation names it): 1..=128 bytes
/// without control characters.
fn check_label(what: &str, value: &str) -> Res<()> {
    if value.is_empty() || value.len() > SUBJECT_BYTES_MAX || value.chars().any(char::is_control) {
        return Err(invalid(format!(
            "{what}: 1..={SUBJECT_BYTES_MAX} bytes without control characters"
        )));
    }
    Ok(())
}

/// Validate a request to mint and return its parsed permissions.
fn check_create(st: &AppState, req: &CreateToken) -> Res<(Vec<Permission>, u64)> {
    check_label("subject", &req.subject)?;
    if req.tenant != ANY_TENANT {
        felix_quic::wire::validate_name(&req.tenant).map_err(|e| {
            Refusal::from(ApiError::new(
                ErrorCode::InvalidName,
                format!("tenant: {e}"),
            ))
        })?;
    }
    if req.perms.is_empty() || req.perms.len() > PERMS_MAX {
        return Err(invalid(format!("perms: 1..={PERMS_MAX} permissions")));
    }
    let perms = req
        .perms
        .iter()
        .map(|p| Permission::parse(p))
        .collect::<Result<Vec<_>, _>>()
        .map_err(invalid)?;
    let ttl_s = req.ttl_s.unwrap_or(DEFAULT_TTL_S);
    if ttl_s == 0 || ttl_s > st.cfg.token_ttl_max_s {
        return Err(invalid(format!(
            "ttl_s {ttl_s}: 1..={} (token_ttl_max_s)",
            st.cfg.token_ttl_max_s
        )));
    }
    Ok((perms, ttl_s))
}

/// Nobody grants what they do not hold.
fn check_grant(caller: &Option<Extension<Caller>>, tenant: &str, perms: &[Permission]) -> Res<()> {
    if tenant == ANY_TENANT {
        permit(caller, Action::ClusterAdmin, ANY_TENANT, "tokens")?;
    } else {
        permit(caller, Action::Manage, tenant, "*")?;
    }
    let Some(Extension(c)) = caller else {
        return Ok(());
    };
    for want in perms {
        if !c.principal.perms.iter().any(|have| have.covers(want)) {
            return Err(ApiError::new(
                ErrorCode::Forbidden,
                format!(
                    "{} cannot grant {want}: it holds no permission covering it",
                    c.principal.subject
                ),
            )
            .into());
        }
    }
    Ok(())
}

/// Record a token in the register, then sign it.
async fn issue(st: &AppState, claims: Claims) -> Res<IssuedToken> {
    issue_spending(st, claims, None).await
}

/// Issue `claims`; with `spend` (an enrolment token's id and expiry) only if that token is
/// spent in the same Raft command, so it is exchanged once.
async fn issue_spending(
    st: &AppState,
    mut claims: Claims,
    spend: Option<(String, u64)>,
) -> Res<IssuedToken> {
    let key = st.signer()?;
    // A revocation covers tokens issued in its second too (`iat` is whole seconds), so a token
    // minted for a target revoked this very second is dated the second after.
    let revoked_at_s = st.read(|c| {
        let a = c.auth();
        [
            a.revoked_at(RevokeKind::Subject, &claims.sub),
            a.revoked_at(RevokeKind::Tenant, &claims.tenant),
        ]
        .into_iter()
        .flatten()
        .max()
    });
    if let Some(at_s) = revoked_at_s {
        claims.iat = claims.iat.max(at_s + 1);
    }
    let record = TokenRecord {
        jti: claims.jti.clone(),
        subject: claims.sub.clone(),
        tenant: claims.tenant.clone(),
        perms: claims.perms.clone(),
        issued_at_s: claims.iat,
        expires_at_s: claims.exp,
    };
    let cmd = match spend {
        None => AuthCommand::RecordToken {
            token: record.clone(),
            now_s: claims.iat,
            tokens_max: st.cfg.auth_tokens_max,
        },
        Some((used_jti, used_until_s)) => AuthCommand::Enrol {
            used_jti,
            used_until_s,
            token: record.clone(),
            now_s: claims.iat,
            tokens_max: st.cfg.auth_tokens_max,
            revocations_max: st.cfg.auth_revocations_max,
        },
    };
    st.write(Command::Auth { cmd }).await?;
    Ok(IssuedToken {
        token: key.issue(&claims),
        record,
    })
}

fn new_jti() -> String {
    format!(
        "{:016x}{:016x}",
        rand::random::<u64>(),
        rand::random::<u64>()
    )
}

/// Issue a token for a tenant (its `manage`), or for every tenant (cluster scope). The caller
/// must hold each permission granted.
#[utoipa::path(post, path = "/v1/tokens", tag = "auth", request_body = CreateToken,
    responses((status = 200, body = IssuedToken), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
              (status = 403, body = ErrorBody), (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(super) async fn create_token(
    State(st): State<Arc<AppState>>,
    caller: Option<Extension<Caller>>,
    Json(req): Json<CreateToken>,
) -> Res<Json<IssuedToken>> {
    let (perms, ttl_s) = check_create(&st, &req)?;
    check_grant(&caller, &req.tenant, &perms)?;
    let now = now_s();
    let claims = Claims {
        iss: ISSUER.into(),
        sub: req.subject,
        tenant: req.tenant,
        perms: perms.iter().map(|p| p.to_string()).collect(),
        iat: now,
        nbf: now,
        exp: now + ttl_s,
        jti: new_jti(),
    };
    issue(&st, claims).await.map(Json)
}

/// The unexpired tokens issued, without the tokens themselves.
#[utoipa::path(get, path = "/v1/tokens", tag = "auth", params(TokenQuery),
    responses((status = 200, body = [TokenRecord]), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
              (status = 403, body = ErrorBody)))]
pub(super) async fn list_tokens(
    State(st): State<Arc<AppState>>,
    caller: Option<Extension<Caller>>,
    Query(q): Query<TokenQuery>,
) -> Res<Json<Vec<TokenRecord>>> {
    match &q.tenant {
        None => permit(&caller, Action::ClusterAdmin, ANY_TENANT, "tokens")?,
        Some(t) => permit(&caller, Action::Manage, t, "*")?,
    }
    let now = now_s();
    Ok(Json(st.read(|c| {
        c.auth()
            .tokens
            .iter()
            .filter(|r| r.expires_at_s > now)
            .filter(|r| q.tenant.as_ref().is_none_or(|t| &r.tenant == t))
            .cloned()
            .collect()
    })))
}

/// What to revoke: exactly one of the three.
#[derive(Debug, Default, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RevokeRequest {
    /// One token, by its id (`token ls` lists them). Its tenant's `manage` suffices.
    #[serde(default)]
    pub jti: Option<String>,
    /// Every token of a subject issued until now (needs `cluster.admin` on `tokens`).
    #[serde(default)]
    pub subject: Option<String>,
    /// Every token of a tenant issued until now (needs `cluster.admin` on `tokens`).
    #[serde(default)]
    pub tenant: Option<String>,
}

/// The subject of the bootstrap admin token.
const ADMIN_SUBJECT: &str = "admin";

/// Revoke a token, a subject or a tenant: every token of it issued until now is refused, on
/// REST at once and on brokers within their feed's round trip (`revoked`), and their open
/// subscriptions and watches end. Tokens minted afterwards verify.
#[utoipa::path(post, path = "/v1/tokens/revoke", tag = "auth", request_body = RevokeRequest,
    responses((status = 200, body = Revocation), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
              (status = 403, body = ErrorBody), (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(super) async fn revoke(
    State(st): State<Arc<AppState>>,
    caller: Option<Extension<Caller>>,
    Json(req): Json<RevokeRequest>,
) -> Res<Json<Revocation>> {
    st.signer()?;
    let (kind, value) = match (req.jti, req.subject, req.tenant) {
        (Some(v), None, None) => (RevokeKind::Jti, v),
        (None, Some(v), None) => (RevokeKind::Subject, v),
        (None, None, Some(v)) => (RevokeKind::Tenant, v),
        _ => return Err(invalid("name exactly one of jti, subject, tenant")),
    };
    check_label(kind.name(), &value)?;
    let (admin_jti, record) = st.read(|c| {
        let a = c.auth();
        (
            a.admin.as_ref().map(|r| r.jti.clone()),
            a.tokens.iter().find(|t| t.jti == value).cloned(),
        )
    });
    // A token of one tenant may be revoked by that tenant's manager; the rest needs cluster
    // scope (a subject or token id alone does not say which tenant it belongs to).
    match (&kind, &record) {
        (RevokeKind::Jti, Some(r)) if r.tenant != ANY_TENANT => {
            permit(&caller, Action::Manage, &r.tenant, "*")?
        }
        _ => permit(&caller, Action::ClusterAdmin, ANY_TENANT, "tokens")?,
    }
    let locks_out_admin = match kind {
        RevokeKind::Jti => admin_jti.as_deref() == Some(value.as_str()),
        RevokeKind::Subject => value == ADMIN_SUBJECT,
        RevokeKind::Tenant => value == ANY_TENANT,
    };
    if locks_out_admin {
        return Err(invalid(format!(
            "revoking {} {value:?} would revoke the bootstrap admin token, the way back in; rotate the signing key and remove the old one to retire every token instead",
            kind.name()
        )));
    }
    let now = now_s();
    // Kept until no token it covers can be unexpired: a registered token's own expiry, else
    // the longest lifetime this control plane grants.
    let longest_s = st.cfg.token_ttl_max_s.max(st.cfg.admin_token_ttl_s);
    let until_s = match (&kind, &record) {
        (RevokeKind::Jti, Some(r)) => r.expires_at_s.max(now),
        _ => now.saturating_add(longest_s),
    };
    st.write(Command::Auth {
        cmd: AuthCommand::Revoke {
            revocation: Revocation {
                kind,
                value: value.clone(),
                at_s: now,
                until_s,
            },
            revocations_max: st.cfg.auth_revocations_max,
        },
    })
    .await?;
    let stored = st.read(|c| {
        c.auth()
            .revocations
            .iter()
            .find(|r| r.kind == kind && r.value == value)
            .cloned()
    });
    stored
        .map(Json)
        .ok_or_else(|| ApiError::new(ErrorCode::Internal, "the revocation was not kept").into())
}

/// Query of `GET /v1/auth/revocations`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct RevocationQuery {
    /// The revision the caller holds; the answer waits for a newer one (up to `wait_ms`).
    #[serde(default)]
    pub since: u64,
    /// Wait up to this long for a revocation when none is newer (0 = answer at once). At most
    /// the server's `max_wait_ms`.
    pub wait_ms: Option<u64>,
}

/// Every revocation in force (the whole list, bounded by `auth_revocations_max`), long-polled:
/// brokers follow it with their node credential.
#[utoipa::path(get, path = "/v1/auth/revocations", tag = "auth", params(RevocationQuery),
    responses((status = 200, body = RevocationFeed), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
              (status = 403, body = ErrorBody)))]
pub(super) async fn revocations(
    State(st): State<Arc<AppState>>,
    Query(q): Query<RevocationQuery>,
) -> Res<Json<RevocationFeed>> {
    let wait = check_wait_ms(&st, q.wait_ms)?;
    long_poll(&st, wait, || {
        st.read(|c| c.auth().revocation_revision) != q.since
    })
    .await;
    Ok(Json(st.read(|c| c.auth().revocation_feed())))
}

/// Issue broker `node_id`'s node credential: register and heartbeat as that broker, read the
/// catalog feeds and the JWKS. A broker renews its own with the one it holds.
#[utoipa::path(post, path = "/v1/nodes/{node_id}/token", tag = "auth", params(("node_id" = u64, Path)),
    request_body = NodeTokenRequest,
    responses((status = 200, body = IssuedToken), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
              (status = 403, body = ErrorBody), (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(super) async fn node_token(
    State(st): State<Arc<AppState>>,
    Path(node_id): Path<u64>,
    Json(req): Json<NodeTokenRequest>,
) -> Res<Json<IssuedToken>> {
    let ttl_s = node_ttl_s(&st, node_id, req.ttl_s, st.cfg.token_ttl_max_s)?;
    issue(&st, node_claims(node_id, &new_jti(), now_s(), ttl_s))
        .await
        .map(Json)
}

/// The lifetime a node-token request asks for (`default_s` if none), checked with its node id.
fn node_ttl_s(st: &AppState, node_id: u64, ttl_s: Option<u64>, default_s: u64) -> Res<u64> {
    let ttl_s = ttl_s.unwrap_or(default_s);
    if node_id == 0 || ttl_s == 0 || ttl_s > st.cfg.token_ttl_max_s {
        return Err(invalid(format!(
            "node id 1.., ttl_s 1..={} (token_ttl_max_s)",
            st.cfg.token_ttl_max_s
        )));
    }
    Ok(ttl_s)
}

pub(super) mod enrol;

/// The public keys that verify this cluster's tokens (brokers fetch it).
#[utoipa::path(get, path = "/v1/auth/jwks", tag = "auth",
    responses((status = 200, body = Jwks), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)))]
pub(super) async fn jwks(State(st): State<Arc<AppState>>) -> Json<Jwks> {
    Json(st.read(|c| c.auth().jwks()))
}

/// A signing key, without its secret.
#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
pub struct KeyInfo {
    pub kid: String,
    pub created_at_s: u64,
    /// When a newer key took over signing; it still verifies until removed.
    pub retired_at_s: Option<u64>,
}

fn key_infos(a: &AuthState) -> Vec<KeyInfo> {
    a.keys
        .iter()
        .map(|k| KeyInfo {
            kid: k.kid.clone(),
            created_at_s: k.created_at_s,
            retired_at_s: k.retired_at_s,
        })
        .collect()
}

#[utoipa::path(get, path = "/v1/auth/keys", tag = "auth",
    responses((status = 200, body = [KeyInfo]), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)))]
pub(super) async fn list_keys(State(st): State<Arc<AppState>>) -> Json<Vec<KeyInfo>> {
    Json(st.read(|c| key_infos(c.auth())))
}

/// Rotate: a new key signs from now on; the old one still verifies until it is removed.
#[utoipa::path(post, path = "/v1/auth/keys", tag = "auth",
    responses((status = 200, body = [KeyInfo]), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
              (status = 403, body = ErrorBody), (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(super) async fn add_key(State(st): State<Arc<AppState>>) -> Res<Json<Vec<KeyInfo>>> {
    st.signer()?;
    st.write(Command::Auth {
        cmd: AuthCommand::AddKey {
            kid: format!("k{:016x}", rand::random::<u64>()),
            seed_hex: hex_of_seed(&rand::random::<[u8; 32]>()),
            at_s: now_s(),
        },
    })
    .await?;
    Ok(Json(st.read(|c| key_infos(c.auth()))))
}

/// Remove a retired key: tokens it signed stop verifying.
#[utoipa::path(delete, path = "/v1/auth/keys/{kid}", tag = "auth", params(("kid" = String, Path)),
    responses((status = 200, body = [KeyInfo]), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(super) async fn remove_key(
    State(st): State<Arc<AppState>>,
    Path(kid): Path<String>,
) -> Res<Json<Vec<KeyInfo>>> {
    st.write(Command::Auth {
        cmd: AuthCommand::RemoveKey { kid },
    })
    .await?;
    Ok(Json(st.read(|c| key_infos(c.auth()))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allow(action: Action, tenant: &str, resource: &str) -> Need {
        Need::Allow {
            action,
            tenant: tenant.into(),
            resource: resource.into(),
        }
    }

    #[test]
    fn every_path_needs_what_the_table_says() {
        use Action::{ClusterAdmin as C, Manage as M};
        let g = Method::GET;
        let p = Method::POST;
        let d = Method::DELETE;
        let ns = "/v1/tenants/acme/namespaces/prod";
        let rows: Vec<(&Method, String, Need)> = vec![
            (&g, "/livez".into(), Need::Public),
            (&g, "/readyz".into(), Need::Public),
            (&g, "/v1/openapi.json".into(), Need::Public),
            (&g, "/metrics".into(), allow(C, "*", "metrics")),
            (&g, "/v1/tenants".into(), allow(C, "*", "tenants")),
            (&p, "/v1/tenants".into(), allow(C, "*", "tenants")),
            (&g, "/v1/tenants/acme".into(), allow(M, "acme", "*")),
            (&d, "/v1/tenants/acme".into(), allow(C, "*", "tenants")),
            (
                &p,
                "/v1/tenants/acme/namespaces".into(),
                allow(M, "acme", "*"),
            ),
            (&d, ns.into(), allow(M, "acme", "prod/")),
            (&p, format!("{ns}/streams"), allow(M, "acme", "prod/")),
            (&g, format!("{ns}/caches"), allow(M, "acme", "prod/")),
            (
                &d,
                format!("{ns}/streams/orders"),
                allow(M, "acme", "prod/orders"),
            ),
            (
                &g,
                format!("{ns}/caches/kv/shards"),
                allow(M, "acme", "prod/kv"),
            ),
            (
                &g,
                format!("{ns}/streams/orders/replication"),
                allow(M, "acme", "prod/orders"),
            ),
            (
                &p,
                format!("{ns}/streams/orders/shards/0/report"),
                Need::InHandler,
            ),
            (
                &p,
                format!("{ns}/streams/orders/shards/0/abandon"),
                allow(C, "*", "placement"),
            ),
            (&g, "/v1/catalog".into(), allow(C, "*", "catalog")),
            (&g, "/v1/catalog/changes".into(), allow(C, "*", "catalog")),
            (&g, "/v1/cluster".into(), allow(C, "*", "catalog")),
            (&g, "/v1/brokers".into(), allow(C, "*", "catalog")),
            (&p, "/v1/brokers".into(), Need::InHandler),
            (&g, "/v1/brokers/3".into(), allow(C, "*", "catalog")),
            (
                &p,
                "/v1/brokers/3/heartbeat".into(),
                allow(C, "*", "brokers/3"),
            ),
            (&p, "/v1/nodes/3/token".into(), allow(C, "*", "brokers/3")),
            (
                &p,
                "/v1/nodes/3/enrolment".into(),
                allow(C, "*", "enrolments"),
            ),
            (&p, "/v1/nodes/3/enrol".into(), allow(C, "*", "enrol/3")),
            (&p, "/v1/tokens".into(), Need::InHandler),
            (&g, "/v1/tokens".into(), Need::InHandler),
            (&g, "/v1/auth/jwks".into(), allow(C, "*", "jwks")),
            (&p, "/v1/tokens/revoke".into(), Need::InHandler),
            (
                &g,
                "/v1/auth/revocations".into(),
                allow(C, "*", "revocations"),
            ),
            (&p, "/v1/auth/keys".into(), allow(C, "*", "keys")),
            (&d, "/v1/auth/keys/k1".into(), allow(C, "*", "keys")),
            (&p, "/internal/v1/write".into(), allow(C, "*", "internal")),
            (&g, "/internal/v1/identity".into(), Need::Public),
            (&p, "/raft/1/vote".into(), Need::Public),
            (&g, "/no/such/route".into(), allow(C, "*", "*")),
        ];
        for (m, path, want) in rows {
            assert_eq!(need(m, &path, false), want, "{m} {path}");
        }
        assert_eq!(need(&g, "/metrics", true), Need::Public);
    }
}

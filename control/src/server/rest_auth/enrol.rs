//! One-time enrolment: an admin issues a short-lived token that a new broker exchanges, once,
//! for its node credential. The enrolment token can do nothing else, and the exchange spends
//! it in the same Raft command that records the credential (`AuthCommand::Enrol`), so of two
//! brokers presenting the same one, one wins and the other is refused `revoked`.

use super::*;
use crate::auth::{enrolment_claims, enrolment_subject};

/// Default lifetime of an enrolment token: long enough to start a machine, short enough that
/// a leaked one is soon worthless.
const ENROLMENT_TTL_S: u64 = 3600;

/// Issue a one-time enrolment token for broker `node_id` (`felixctl node enroll N --one-time`).
#[utoipa::path(post, path = "/v1/nodes/{node_id}/enrolment", tag = "auth", params(("node_id" = u64, Path)),
    request_body = NodeTokenRequest,
    responses((status = 200, body = IssuedToken), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
              (status = 403, body = ErrorBody), (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(in crate::server) async fn node_enrolment(
    State(st): State<Arc<AppState>>,
    Path(node_id): Path<u64>,
    Json(req): Json<NodeTokenRequest>,
) -> Res<Json<IssuedToken>> {
    let default_s = ENROLMENT_TTL_S.min(st.cfg.token_ttl_max_s);
    let ttl_s = node_ttl_s(&st, node_id, req.ttl_s, default_s)?;
    if st.cfg.auth == AuthSwitch::Off {
        return Err(invalid("auth is off: brokers need no credential"));
    }
    issue(&st, enrolment_claims(node_id, &new_jti(), now_s(), ttl_s))
        .await
        .map(Json)
}

/// Exchange the enrolment token presented as the bearer for broker `node_id`'s node
/// credential (`ttl_s` absent: `token_ttl_max_s`). The enrolment token is spent.
#[utoipa::path(post, path = "/v1/nodes/{node_id}/enrol", tag = "auth", params(("node_id" = u64, Path)),
    request_body = NodeTokenRequest,
    responses((status = 200, body = IssuedToken), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
              (status = 403, body = ErrorBody), (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(in crate::server) async fn node_enrol(
    State(st): State<Arc<AppState>>,
    caller: Option<Extension<Caller>>,
    Path(node_id): Path<u64>,
    Json(req): Json<NodeTokenRequest>,
) -> Res<Json<IssuedToken>> {
    let ttl_s = node_ttl_s(&st, node_id, req.ttl_s, st.cfg.token_ttl_max_s)?;
    let Some(Extension(c)) = caller else {
        return Err(invalid("auth is off: brokers need no credential"));
    };
    // The admin's `cluster.admin:*` passes the path check too, but has nothing to spend.
    if c.principal.subject != enrolment_subject(node_id) {
        return Err(ApiError::new(
            ErrorCode::Forbidden,
            format!(
                "{} is not node {node_id}'s enrolment token (felixctl node enroll {node_id} --one-time issues one)",
                c.principal.subject
            ),
        )
        .into());
    }
    let spend = (c.principal.jti.clone(), c.principal.expires_at_s);
    let claims = node_claims(node_id, &new_jti(), now_s(), ttl_s);
    issue_spending(&st, claims, Some(spend)).await.map(Json)
}

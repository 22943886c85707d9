//! The node credential on the link: every request carries the one held now, and the broker
//! renews it before it expires (`POST /v1/nodes/N/token`, authorised by the credential
//! itself), writing the new one to `controlplane_token_file` first so a restart picks it up.
//!
//! Without renewal a broker stops being able to register, heartbeat or read the catalog
//! the moment its credential expires (90 days by default), a silent cliff months after
//! enrolment.

use super::{call, sleep_unless_stopped, CallError};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// The HTTP client of the link, with the node credential held now attached to every request.
#[derive(Clone)]
pub(super) struct Http {
    client: reqwest::Client,
    bearer: Arc<RwLock<Option<reqwest::header::HeaderValue>>>,
}

impl Http {
    pub(super) fn new(client: reqwest::Client, token: Option<&str>) -> Http {
        let h = Http {
            client,
            bearer: Arc::default(),
        };
        if let Some(t) = token {
            h.set_token(t);
        }
        h
    }

    /// Use `token` from the next request on.
    fn set_token(&self, token: &str) {
        match reqwest::header::HeaderValue::from_str(&format!("Bearer {token}")) {
            Ok(mut v) => {
                v.set_sensitive(true);
                *self.bearer.write().unwrap_or_else(|p| p.into_inner()) = Some(v);
            }
            Err(_) => tracing::error!(
                "the node credential is not a valid header value; requests go without it"
            ),
        }
    }

    fn with_bearer(&self, rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &*self.bearer.read().unwrap_or_else(|p| p.into_inner()) {
            Some(v) => rb.header(reqwest::header::AUTHORIZATION, v.clone()),
            None => rb,
        }
    }

    pub(super) fn get(&self, url: impl reqwest::IntoUrl) -> reqwest::RequestBuilder {
        self.with_bearer(self.client.get(url))
    }

    pub(super) fn post(&self, url: impl reqwest::IntoUrl) -> reqwest::RequestBuilder {
        self.with_bearer(self.client.post(url))
    }
}

/// The claims of a token, read without verifying it: the broker only needs to know when to
/// renew its own credential and whether it is an enrolment token; the control plane
/// verifies it.
fn claims_of(token: &str) -> Option<felix_control::auth::Claims> {
    use base64::Engine;
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload)
        .ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// `(iat, exp)` of a token, if it has a readable, non-empty life.
pub fn lifetime_of(token: &str) -> Option<(u64, u64)> {
    let c = claims_of(token)?;
    (c.exp > c.iat).then_some((c.iat, c.exp))
}

/// Whether `token` is a one-time enrolment token (`felixctl node enroll N --one-time`).
pub fn is_enrolment(token: &str) -> bool {
    claims_of(token).is_some_and(|c| c.sub.starts_with("enrol/"))
}

/// Exchange the enrolment token held for this node's credential (`POST /v1/nodes/N/enrol`),
/// write it to `file` where the next start reads it, and use it. Retried while the control
/// plane is unreachable; a refusal (spent, expired, another node's) stops the broker with
/// exit code 2, because only an admin can issue another. `None`: shut down meanwhile.
pub(super) async fn enrol(
    http: &Http,
    base: &str,
    node_id: u64,
    file: Option<&std::path::Path>,
    shutdown: &AtomicBool,
) -> Option<String> {
    let url = format!("{base}/v1/nodes/{node_id}/enrol");
    let mut backoff_ms = 200;
    loop {
        match ask(http, &url, None).await {
            Ok((t, l)) => {
                // Kept first: the enrolment token is spent, and this is the only copy.
                keep(file, &t);
                http.set_token(&t);
                tracing::info!(
                    node_id,
                    expires_at_s = l.1,
                    "enrolled: the enrolment token was exchanged for this node's credential"
                );
                return Some(t);
            }
            Err(CallError::Api(401 | 403, b)) => {
                tracing::error!(code = %b.code, message = %b.message, "the control plane refused this broker's enrolment token");
                eprintln!(
                    "felix-broker: the control plane at {base} refused node {node_id}'s enrolment token: {} ({}); it is used once and expires (felixctl node enroll {node_id} --one-time issues another)",
                    b.message, b.code
                );
                std::process::exit(2);
            }
            Err(e) => {
                tracing::warn!(error = %e, "exchanging the enrolment token failed; retrying");
                if !sleep_unless_stopped(backoff_ms, shutdown).await {
                    return None;
                }
                backoff_ms = (backoff_ms * 2).min(5_000);
            }
        }
    }
}

/// When a credential issued at `iat_s` and expiring at `exp_s` is renewed: with a third of
/// its life left, so a control plane that is down for a while (up to a third of the lifetime:
/// a month for the 90-day default) does not cost the broker its credential.
pub fn renew_at_s((iat_s, exp_s): (u64, u64)) -> u64 {
    debug_assert!(exp_s > iat_s);
    exp_s - (exp_s - iat_s) / 3
}

/// What `POST /v1/nodes/N/token` answers (the part the broker reads).
#[derive(serde::Deserialize)]
struct Issued {
    token: String,
}

/// The pause after a failed renewal; also how often a due renewal is retried.
const RENEW_RETRY_MS: u64 = 5_000;
/// How often a renewal that keeps failing is warned about, seconds.
const RENEW_WARN_S: u64 = 60;
/// The longest sleep between two looks at the credential, so a wall clock that jumps ahead
/// (a suspended VM) is noticed within this bound.
const RENEW_LOOK_MS: u64 = 60_000;

/// The expiry of the node credential held, seconds since the epoch (0: none or unreadable),
/// for `felix_node_credential_expires_at_seconds`.
pub static EXPIRES_AT_S: AtomicU64 = AtomicU64::new(0);
/// Renewals that succeeded and failed, for `/metrics`.
pub static RENEWED: AtomicU64 = AtomicU64::new(0);
pub static RENEW_FAILED: AtomicU64 = AtomicU64::new(0);
/// New credentials that could not be written to `controlplane_token_file`.
pub static KEEP_FAILED: AtomicU64 = AtomicU64::new(0);

/// The node credential's gauge and counters, as Prometheus text (nothing without one).
pub fn render(out: &mut String) {
    let exp = EXPIRES_AT_S.load(Ordering::Relaxed);
    if exp == 0 {
        return;
    }
    for (name, kind, help, v) in [
        (
            "felix_node_credential_expires_at_seconds",
            "gauge",
            "Unix time the node credential held expires (renewed with a third of its life left)",
            exp,
        ),
        (
            "felix_node_credential_renewals_total",
            "counter",
            "node credentials renewed",
            RENEWED.load(Ordering::Relaxed),
        ),
        (
            "felix_node_credential_renewal_failures_total",
            "counter",
            "renewals of the node credential that failed (retried every 5 s; the one held stays in use)",
            RENEW_FAILED.load(Ordering::Relaxed),
        ),
        (
            "felix_node_credential_write_failures_total",
            "counter",
            "new node credentials that could not be written to controlplane_token_file (a restart would read the older one)",
            KEEP_FAILED.load(Ordering::Relaxed),
        ),
    ] {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
        ));
    }
}

/// Renew the node credential before it expires, for as long as the broker runs: ask the
/// control plane for a fresh one of the same lifetime, write it to `file` (0600, atomically),
/// then use it. A failure is logged and retried; it never drops the credential held.
pub(super) async fn follow(
    http: Http,
    base: String,
    node_id: u64,
    file: Option<PathBuf>,
    token: String,
    shutdown: Arc<AtomicBool>,
) {
    let Some(mut life) = lifetime_of(&token) else {
        tracing::warn!("the node credential's expiry cannot be read; it is not renewed");
        return;
    };
    EXPIRES_AT_S.store(life.1, Ordering::Relaxed);
    let mut warned_at_s: Option<u64> = None;
    loop {
        let now = crate::auth::now_s();
        let due = renew_at_s(life);
        if now < due {
            let wait_ms = (due - now).saturating_mul(1000).min(RENEW_LOOK_MS);
            if !sleep_unless_stopped(wait_ms, &shutdown).await {
                return;
            }
            continue;
        }
        let url = format!("{base}/v1/nodes/{node_id}/token");
        match ask(&http, &url, Some(life.1 - life.0)).await {
            Ok((t, l)) => {
                // Used even if it cannot be kept: the broker runs on; only a restart would
                // fall back to the file's older credential.
                keep(file.as_deref(), &t);
                http.set_token(&t);
                life = l;
                EXPIRES_AT_S.store(l.1, Ordering::Relaxed);
                RENEWED.fetch_add(1, Ordering::Relaxed);
                warned_at_s = None;
                tracing::info!(node_id, expires_at_s = l.1, "node credential renewed");
            }
            Err(e) => {
                RENEW_FAILED.fetch_add(1, Ordering::Relaxed);
                let left_s = life.1.saturating_sub(now);
                // Retried every 5 s: warned once a minute, each time with the life left.
                if warned_at_s.is_none_or(|t| now >= t + RENEW_WARN_S) {
                    warned_at_s = Some(now);
                    tracing::warn!(error = %e, left_s, "renewing the node credential failed; retrying");
                } else {
                    tracing::debug!(error = %e, left_s, "renewing the node credential failed");
                }
                if !sleep_unless_stopped(RENEW_RETRY_MS, &shutdown).await {
                    return;
                }
            }
        }
    }
}

/// Ask `url` for a node credential (the bearer held authorises it; `ttl_s` absent: the
/// control plane's longest) and read its times.
async fn ask(
    http: &Http,
    url: &str,
    ttl_s: Option<u64>,
) -> Result<(String, (u64, u64)), CallError> {
    let req = serde_json::json!({ "ttl_s": ttl_s });
    let t = call::<Issued>(http.post(url).json(&req)).await?;
    let l = lifetime_of(&t.token).ok_or_else(|| {
        CallError::Transport("the control plane's node credential has no readable expiry".into())
    })?;
    Ok((t.token, l))
}

/// Write a new credential to `file`, where the next start reads it. A failure is an error in
/// the log and a counter, not a stop: the credential in memory still serves this process.
fn keep(file: Option<&std::path::Path>, token: &str) {
    let Some(f) = file else { return };
    if let Err(e) = crate::auth::write_private(f, token.as_bytes()) {
        KEEP_FAILED.fetch_add(1, Ordering::Relaxed);
        tracing::error!(error = %e, "cannot write the new node credential to controlplane_token_file; this process uses it, a restart would read the older one (make the file writable by the broker)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_falls_at_two_thirds_of_the_life() {
        assert_eq!(renew_at_s((1_000, 1_900)), 1_600);
        // A one-second life renews at its end, never before it began.
        assert_eq!(renew_at_s((10, 11)), 11);
    }

    #[test]
    fn the_lifetime_is_read_from_the_claims() {
        let k = felix_control::auth::SigningKey::from_seed("k", [7; 32]);
        let t = k.issue(&felix_control::auth::node_claims(3, "j", 100, 60));
        assert_eq!(lifetime_of(&t), Some((100, 160)));
        assert!(!is_enrolment(&t));
        let e = k.issue(&felix_control::auth::enrolment_claims(3, "e", 100, 60));
        assert!(is_enrolment(&e));
        assert_eq!(lifetime_of("garbage"), None);
        assert_eq!(lifetime_of("a.!!.c"), None);
    }
}

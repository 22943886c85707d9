//! Member authentication on the member protocol: `/raft/*` and
//! `/internal/v1/{identity,assign,rejoin}`.
//!
//! Why a shared secret rather than the signed tokens: a new or wiped member asks its peers for
//! its identity *before* it holds any signing key (the keys are Raft state it has not received
//! yet), and the founder assigns identities before the group exists. Only something configured
//! out of band can vouch for a member at that point. Every member reads the same secret from
//! `--member-secret-file` and sends it in `x-felix-member-secret` on each member RPC; a member
//! refuses an RPC without it (401 `unauthenticated`). Mutual TLS would replace this once the
//! control plane serves HTTPS.

use crate::api::ApiError;
use crate::server::Refusal;
use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use felix_quic::wire::ErrorCode;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub const HEADER: HeaderName = HeaderName::from_static("x-felix-member-secret");

/// Shortest secret accepted, bytes: 32 random bytes hex- or base64-encoded are longer.
pub const SECRET_BYTES_MIN: usize = 32;
/// Longest secret accepted, bytes (it travels in a header on every RPC).
pub const SECRET_BYTES_MAX: usize = 1024;

/// The cluster's member secret. Debug never prints it.
#[derive(Clone)]
pub struct MemberSecret(Arc<str>);

impl std::fmt::Debug for MemberSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MemberSecret(..)")
    }
}

impl MemberSecret {
    /// The secret in `text` (surrounding whitespace trimmed), if it is usable: 32..=1024 bytes of
    /// visible ASCII, so it fits a header unchanged on every member.
    pub fn parse(text: &str) -> Result<Self, String> {
        let s = text.trim();
        if s.len() < SECRET_BYTES_MIN || s.len() > SECRET_BYTES_MAX {
            return Err(format!(
                "the member secret is {} bytes; it must be {SECRET_BYTES_MIN}..={SECRET_BYTES_MAX} (for example `openssl rand -hex 32`)",
                s.len()
            ));
        }
        if !s.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(
                "the member secret must be visible ASCII with no spaces (for example `openssl rand -hex 32`)"
                    .into(),
            );
        }
        Ok(MemberSecret(s.into()))
    }

    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("member secret {}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("member secret {}: {e}", path.display()))
    }

    /// The header value the member's own client sends, marked sensitive so it is never logged.
    pub fn header_value(&self) -> HeaderValue {
        let mut v = HeaderValue::from_str(&self.0).expect("checked visible ASCII");
        v.set_sensitive(true);
        v
    }

    /// Whether `presented` is the secret, in time that does not depend on where they differ
    /// (so a remote caller cannot find it byte by byte from response times).
    pub fn matches(&self, presented: &[u8]) -> bool {
        let want = self.0.as_bytes();
        if presented.len() != want.len() {
            return false;
        }
        let diff = want
            .iter()
            .zip(presented)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        diff == 0
    }
}

/// What the middleware needs: the secret, and when it last warned (ms since start), so a
/// misconfigured peer is reported once a minute rather than on every RPC.
#[derive(Clone)]
pub struct Guard {
    pub secret: MemberSecret,
    warned_ms: Arc<AtomicU64>,
    started: std::time::Instant,
}

impl Guard {
    pub fn new(secret: MemberSecret) -> Self {
        Guard {
            secret,
            warned_ms: Arc::new(AtomicU64::new(u64::MAX)),
            started: std::time::Instant::now(),
        }
    }

    fn warn_due(&self) -> bool {
        let now = self.started.elapsed().as_millis() as u64;
        let last = self.warned_ms.load(Ordering::Relaxed);
        if last != u64::MAX && now.saturating_sub(last) < 60_000 {
            return false;
        }
        self.warned_ms
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }
}

/// The layer on the member routes: refuse a request that does not carry the secret.
pub async fn require(State(g): State<Guard>, req: Request, next: Next) -> Response {
    let ok = req
        .headers()
        .get(&HEADER)
        .is_some_and(|v| g.secret.matches(v.as_bytes()));
    if ok {
        return next.run(req).await;
    }
    if g.warn_due() {
        tracing::warn!(
            path = %req.uri().path(),
            "refused a member RPC without the cluster's member secret (is every member started with the same --member-secret-file?)"
        );
    }
    Refusal::from(ApiError::new(
        ErrorCode::Unauthenticated,
        "member RPCs need the cluster's member secret (x-felix-member-secret, from --member-secret-file)",
    ))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_bounded_and_visible_ascii() {
        assert!(MemberSecret::parse("short").is_err());
        assert!(MemberSecret::parse(&"a".repeat(1025)).is_err());
        assert!(MemberSecret::parse(&format!("{} {}", "a".repeat(20), "b".repeat(20))).is_err());
        let s = MemberSecret::parse(&format!("  {}\n", "k".repeat(40))).unwrap();
        assert_eq!(format!("{s:?}"), "MemberSecret(..)");
        assert_eq!(s.header_value().as_bytes(), "k".repeat(40).as_bytes());
        assert!(s.header_value().is_sensitive());
    }

    #[test]
    fn only_the_exact_secret_matches() {
        let s = MemberSecret::parse(&"k".repeat(40)).unwrap();
        assert!(s.matches("k".repeat(40).as_bytes()));
        assert!(!s.matches("k".repeat(39).as_bytes()));
        assert!(!s.matches(b""));
        let mut wrong = "k".repeat(40).into_bytes();
        wrong[39] = b'j';
        assert!(!s.matches(&wrong));
    }
}

//! Felix tokens: JWTs signed with Ed25519 (`alg: EdDSA`), their permissions, the public key
//! set (JWKS) that verifies them, and the verification itself.
//!
//! Pure: the caller passes the time (`now_s`, seconds since the Unix epoch) and the key seed;
//! nothing here reads a clock, a file or a socket. The control plane signs (and, standalone,
//! a broker signs its own admin token); brokers verify against the JWKS they hold.
//!
//! A token names a subject, a tenant, permissions as `action:pattern` strings, an expiry
//! (`exp`), a not-before (`nbf`), an issue time (`iat`) and an id (`jti`). Its header names the
//! key (`kid`). See `docs/security.md` for the permission strings and the matching.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// The issuer every Felix token names.
pub const ISSUER: &str = "felix";
/// The largest token a verifier reads; a larger one is refused before any parsing.
pub const TOKEN_BYTES_MAX: usize = 8 * 1024;
/// How far a token's `nbf` may be ahead of the verifier's clock (clock skew between hosts).
pub const NBF_LEEWAY_S: u64 = 30;
/// The tenant of a token that spans every tenant (the bootstrap admin, node credentials).
pub const ANY_TENANT: &str = "*";

/// What a permission allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    StreamPublish,
    StreamSubscribe,
    CacheRead,
    CacheWrite,
    GroupConsume,
    /// The tenant's own streams, caches, namespaces and tokens.
    Manage,
    /// Tenants, brokers, placement, the catalog feeds.
    ClusterAdmin,
}

impl Action {
    pub const ALL: [Action; 7] = [
        Action::StreamPublish,
        Action::StreamSubscribe,
        Action::CacheRead,
        Action::CacheWrite,
        Action::GroupConsume,
        Action::Manage,
        Action::ClusterAdmin,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Action::StreamPublish => "stream.publish",
            Action::StreamSubscribe => "stream.subscribe",
            Action::CacheRead => "cache.read",
            Action::CacheWrite => "cache.write",
            Action::GroupConsume => "group.consume",
            Action::Manage => "manage",
            Action::ClusterAdmin => "cluster.admin",
        }
    }

    pub fn parse(s: &str) -> Option<Action> {
        Action::ALL.into_iter().find(|a| a.name() == s)
    }
}

/// An action on the resources a pattern matches, within the token's tenant. A pattern is
/// `NAMESPACE/NAME`, where a trailing `*` matches any rest (`prod/orders*`, `prod/*`), or `*`
/// alone (every resource of the tenant).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permission {
    pub action: Action,
    pub pattern: String,
}

impl Permission {
    /// Parse `action:pattern` (`stream.publish:prod/orders*`).
    pub fn parse(s: &str) -> Result<Permission, String> {
        let (a, p) = s
            .split_once(':')
            .ok_or_else(|| format!("permission {s:?} is not ACTION:PATTERN"))?;
        let action = Action::parse(a).ok_or_else(|| {
            let names: Vec<&str> = Action::ALL.iter().map(|a| a.name()).collect();
            format!("unknown action {a:?} (one of {})", names.join(", "))
        })?;
        let body = p.strip_suffix('*').unwrap_or(p);
        let ok = !p.is_empty()
            && p.len() <= 130
            && !body.contains('*')
            && body
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
            && body.matches('/').count() <= 1;
        if !ok {
            return Err(format!(
                "pattern {p:?}: NAMESPACE/NAME with an optional trailing *, or * alone"
            ));
        }
        Ok(Permission {
            action,
            pattern: p.to_string(),
        })
    }

    /// Whether it allows `action` on `resource` (`NAMESPACE/NAME`).
    pub fn allows(&self, action: Action, resource: &str) -> bool {
        if self.action != action {
            return false;
        }
        match self.pattern.strip_suffix('*') {
            Some(prefix) => resource.starts_with(prefix),
            None => resource == self.pattern,
        }
    }
}

impl Permission {
    /// Whether holding `self` covers granting `other`: the same action, and every resource
    /// `other` allows is one `self` allows. Who mints a token cannot grant more than they hold.
    pub fn covers(&self, other: &Permission) -> bool {
        if self.action != other.action {
            return false;
        }
        match (
            self.pattern.strip_suffix('*'),
            other.pattern.strip_suffix('*'),
        ) {
            (Some(mine), Some(theirs)) => theirs.starts_with(mine),
            (Some(mine), None) => other.pattern.starts_with(mine),
            (None, Some(_)) => false,
            (None, None) => self.pattern == other.pattern,
        }
    }
}

impl std::fmt::Display for Permission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.action.name(), self.pattern)
    }
}

/// The claims of a Felix token.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Claims {
    pub iss: String,
    pub sub: String,
    pub tenant: String,
    pub perms: Vec<String>,
    pub iat: u64,
    pub nbf: u64,
    pub exp: u64,
    pub jti: String,
}

/// Who a verified token speaks for, and what it may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub subject: String,
    pub tenant: String,
    pub perms: Vec<Permission>,
    pub issued_at_s: u64,
    pub expires_at_s: u64,
    pub jti: String,
}

impl Principal {
    /// Allowed to do `action` on `namespace/name` of `tenant`, or the refusal naming the
    /// permission that is missing.
    pub fn check(&self, action: Action, tenant: &str, resource: &str) -> Result<(), String> {
        let tenant_ok = self.tenant == ANY_TENANT || self.tenant == tenant;
        if tenant_ok && self.perms.iter().any(|p| p.allows(action, resource)) {
            return Ok(());
        }
        Err(format!(
            "{} of tenant {:?} lacks {}:{resource} in tenant {tenant:?}",
            self.subject,
            self.tenant,
            action.name()
        ))
    }
}

/// Why a token was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// Not a valid token of this cluster (malformed, forged, wrong algorithm or issuer, not
    /// yet valid, too large).
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    #[error("token_expired: {0}")]
    Expired(String),
    /// Signed by a key this verifier does not know (a broker refetches the JWKS once).
    #[error("unauthenticated: signed by unknown key {0:?}")]
    UnknownKey(String),
    /// Valid, but its id, subject or tenant was revoked after it was issued.
    #[error("revoked: {0}")]
    Revoked(String),
}

/// The PKCS#8 wrapping of an Ed25519 seed (RFC 8410): what the signer takes.
fn pkcs8_of_seed(seed: &[u8; 32]) -> Vec<u8> {
    const PREFIX: [u8; 16] = [
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    let mut der = PREFIX.to_vec();
    der.extend_from_slice(seed);
    der
}

/// A signing key of the cluster: Ed25519, named by `kid`.
pub struct SigningKey {
    pub kid: String,
    seed: [u8; 32],
    public: [u8; 32],
    encoding: EncodingKey,
}

impl SigningKey {
    /// The key whose secret is `seed` (32 random bytes, kept secret by the caller).
    pub fn from_seed(kid: &str, seed: [u8; 32]) -> SigningKey {
        let public = ed25519_dalek::SigningKey::from_bytes(&seed)
            .verifying_key()
            .to_bytes();
        SigningKey {
            kid: kid.to_string(),
            seed,
            public,
            encoding: EncodingKey::from_ed_der(&pkcs8_of_seed(&seed)),
        }
    }

    pub fn seed(&self) -> [u8; 32] {
        self.seed
    }

    /// Sign `claims` into a token.
    pub fn issue(&self, claims: &Claims) -> String {
        let mut h = Header::new(Algorithm::EdDSA);
        h.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&h, claims, &self.encoding)
            .expect("an Ed25519 key from a seed always signs")
    }

    /// Its public half, as a JWKS entry.
    pub fn jwk(&self) -> Jwk {
        Jwk {
            kty: "OKP".into(),
            crv: "Ed25519".into(),
            alg: "EdDSA".into(),
            use_: "sig".into(),
            kid: self.kid.clone(),
            x: URL_SAFE_NO_PAD.encode(self.public),
        }
    }
}

/// One public key (RFC 8037 OKP).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "server", derive(utoipa::ToSchema))]
pub struct Jwk {
    pub kty: String,
    pub crv: String,
    pub alg: String,
    #[serde(rename = "use")]
    pub use_: String,
    pub kid: String,
    pub x: String,
}

/// The public keys that verify the cluster's tokens.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
#[cfg_attr(feature = "server", derive(utoipa::ToSchema))]
pub struct Jwks {
    pub keys: Vec<Jwk>,
}

/// Verifies tokens against a JWKS.
pub struct Verifier {
    keys: HashMap<String, DecodingKey>,
    /// Tokens this verifier verified, with what they grant: a token's signature is checked
    /// once per verifier (a set of keys; a removed key makes a new verifier), after which only
    /// its expiry is. The caller checks revocation on every use. At most
    /// [`VERIFIED_TOKENS_MAX`] (emptied when full). An Ed25519 verification (with the point
    /// decompression the library does per call) was a sixth of the control plane's time
    /// under replica reports, which present the same node token each time.
    verified: std::sync::Mutex<HashMap<String, Principal>>,
}

/// Verified tokens a [`Verifier`] remembers, at most.
pub const VERIFIED_TOKENS_MAX: usize = 1024;

impl Verifier {
    /// A verifier of the keys of `jwks`; a key that is not an Ed25519 public key is refused.
    pub fn new(jwks: &Jwks) -> Result<Verifier, String> {
        let mut keys = HashMap::new();
        for k in &jwks.keys {
            if k.kty != "OKP" || k.crv != "Ed25519" || k.alg != "EdDSA" {
                return Err(format!(
                    "key {:?} is {}/{}/{}, not OKP/Ed25519/EdDSA",
                    k.kid, k.kty, k.crv, k.alg
                ));
            }
            let raw = URL_SAFE_NO_PAD
                .decode(&k.x)
                .map_err(|e| format!("key {:?}: x is not base64url: {e}", k.kid))?;
            if raw.len() != 32 {
                return Err(format!("key {:?}: x is {} bytes, not 32", k.kid, raw.len()));
            }
            keys.insert(k.kid.clone(), DecodingKey::from_ed_der(&raw));
        }
        Ok(Verifier {
            keys,
            verified: Default::default(),
        })
    }

    pub fn knows(&self, kid: &str) -> bool {
        self.keys.contains_key(kid)
    }

    /// Verify `token` at time `now_s`: its size, header (EdDSA, a known key), signature,
    /// issuer, validity window and permissions.
    pub fn verify(&self, token: &str, now_s: u64) -> Result<Principal, AuthError> {
        let known = self
            .verified
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(token)
            .cloned();
        if let Some(p) = known {
            if now_s >= p.expires_at_s {
                return Err(expired(&p.subject, &p.jti, p.expires_at_s, now_s));
            }
            return Ok(p);
        }
        let p = self.verify_signed(token, now_s)?;
        let mut v = self.verified.lock().unwrap_or_else(|p| p.into_inner());
        if v.len() >= VERIFIED_TOKENS_MAX {
            v.clear();
        }
        v.insert(token.to_string(), p.clone());
        Ok(p)
    }

    /// [`Verifier::verify`] without what was verified before.
    fn verify_signed(&self, token: &str, now_s: u64) -> Result<Principal, AuthError> {
        let bad = |why: String| AuthError::Unauthenticated(why);
        if token.len() > TOKEN_BYTES_MAX {
            return Err(bad(format!(
                "a token of {} bytes exceeds the {TOKEN_BYTES_MAX}-byte maximum",
                token.len()
            )));
        }
        let header =
            jsonwebtoken::decode_header(token).map_err(|e| bad(format!("not a token: {e}")))?;
        if header.alg != Algorithm::EdDSA {
            return Err(bad(format!(
                "algorithm {:?}: only EdDSA is accepted",
                header.alg
            )));
        }
        let kid = header
            .kid
            .ok_or_else(|| bad("the token names no key (kid)".into()))?;
        let key = self
            .keys
            .get(&kid)
            .ok_or_else(|| AuthError::UnknownKey(kid.clone()))?;
        // The time checks are ours (the caller's clock), so the library checks only the
        // signature and the shape.
        let mut v = Validation::new(Algorithm::EdDSA);
        v.validate_exp = false;
        v.validate_nbf = false;
        v.required_spec_claims.clear();
        v.validate_aud = false;
        let data = jsonwebtoken::decode::<Claims>(token, key, &v)
            .map_err(|e| bad(format!("the token does not verify: {e}")))?;
        let c = data.claims;
        if c.iss != ISSUER {
            return Err(bad(format!("issuer {:?}, not {ISSUER:?}", c.iss)));
        }
        if c.nbf > now_s + NBF_LEEWAY_S {
            return Err(bad(format!("not valid before {} (now {now_s})", c.nbf)));
        }
        if now_s >= c.exp {
            return Err(expired(&c.sub, &c.jti, c.exp, now_s));
        }
        let perms = c
            .perms
            .iter()
            .map(|p| Permission::parse(p))
            .collect::<Result<Vec<_>, _>>()
            .map_err(bad)?;
        Ok(Principal {
            subject: c.sub,
            tenant: c.tenant,
            perms,
            issued_at_s: c.iat,
            expires_at_s: c.exp,
            jti: c.jti,
        })
    }
}

fn expired(sub: &str, jti: &str, exp: u64, now_s: u64) -> AuthError {
    AuthError::Expired(format!(
        "{sub}'s token {jti} expired at {exp} (now {now_s})"
    ))
}

/// Claims granting every action on everything in every tenant, for `ttl_s` from `now_s`: the
/// bootstrap admin token.
pub fn admin_claims(subject: &str, jti: &str, now_s: u64, ttl_s: u64) -> Claims {
    Claims {
        iss: ISSUER.into(),
        sub: subject.into(),
        tenant: ANY_TENANT.into(),
        perms: Action::ALL
            .iter()
            .map(|a| format!("{}:*", a.name()))
            .collect(),
        iat: now_s,
        nbf: now_s,
        exp: now_s.saturating_add(ttl_s),
        jti: jti.into(),
    }
}

/// The claims of a broker's node credential: register and heartbeat as `node_id`, read the
/// catalog feeds and the JWKS, nothing of any tenant's data.
pub fn node_claims(node_id: u64, jti: &str, now_s: u64, ttl_s: u64) -> Claims {
    Claims {
        iss: ISSUER.into(),
        sub: format!("node/{node_id}"),
        tenant: ANY_TENANT.into(),
        perms: vec![
            format!("cluster.admin:brokers/{node_id}"),
            "cluster.admin:catalog".into(),
            "cluster.admin:jwks".into(),
            "cluster.admin:revocations".into(),
        ],
        iat: now_s,
        nbf: now_s,
        exp: now_s.saturating_add(ttl_s),
        jti: jti.into(),
    }
}

/// A one-time enrolment token for broker `node_id`: all it can do is be exchanged, once, for
/// that node's credential (`POST /v1/nodes/N/enrol`).
pub fn enrolment_claims(node_id: u64, jti: &str, now_s: u64, ttl_s: u64) -> Claims {
    Claims {
        iss: ISSUER.into(),
        sub: enrolment_subject(node_id),
        tenant: ANY_TENANT.into(),
        perms: vec![format!("cluster.admin:enrol/{node_id}")],
        iat: now_s,
        nbf: now_s,
        exp: now_s.saturating_add(ttl_s),
        jti: jti.into(),
    }
}

/// The subject of node `node_id`'s enrolment tokens.
pub fn enrolment_subject(node_id: u64) -> String {
    format!("enrol/{node_id}")
}

mod revocation;
pub use revocation::{Revocation, RevocationFeed, RevocationSet, RevokeKind};

#[cfg(test)]
mod tests;

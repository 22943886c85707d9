//! The auth part of the replicated state: the signing keys, the bootstrap admin token's
//! identity and the register of issued tokens (what `token ls` lists).
//!
//! It rides in the same Raft log and snapshots as the catalog, so every member signs with the
//! same keys and the bootstrap happens once: the first [`AuthCommand::Init`] wins and later
//! ones change nothing. Randomness (the key seed, the ids) and the time come in the command,
//! chosen by the member that proposed it; applying stays pure.
//!
//! Auth changes do not move the catalog revision nor enter the changes feed: brokers follow
//! the catalog there, and a token issued is not a catalog change.

use crate::api::ApiError;
use crate::auth::{Jwk, Jwks, Revocation, RevocationFeed, RevocationSet, SigningKey};
use felix_quic::wire::ErrorCode;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Lifetime of a member's forwarding credential: one write's round trip, with room for skew.
pub const MEMBER_TOKEN_TTL_S: u64 = 120;

/// Keys kept at once (the signer plus the retired ones still verifying during an overlap).
pub const KEYS_MAX: usize = 8;

/// A signing key. The seed is secret: it lives in the Raft log and snapshots (which is why the
/// data dir must be private) and never in a REST answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    pub kid: String,
    /// The Ed25519 seed, 64 hex digits.
    pub seed_hex: String,
    pub created_at_s: u64,
    /// Set when a newer key took over signing; the key still verifies until removed.
    #[serde(default)]
    pub retired_at_s: Option<u64>,
}

impl KeyRecord {
    pub fn signing_key(&self) -> SigningKey {
        SigningKey::from_seed(
            &self.kid,
            seed_of_hex(&self.seed_hex).expect("validated at apply"),
        )
    }
}

/// The one bootstrap admin token, as created at the first start. Every member mints the same
/// bytes from it (Ed25519 signatures are deterministic), so each can write the token file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdminRecord {
    pub jti: String,
    pub issued_at_s: u64,
    pub ttl_s: u64,
    /// The key that signed it.
    pub kid: String,
}

/// A token the control plane issued (the token itself is not kept, only what it says).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(utoipa::ToSchema))]
pub struct TokenRecord {
    pub jti: String,
    pub subject: String,
    pub tenant: String,
    pub perms: Vec<String>,
    pub issued_at_s: u64,
    pub expires_at_s: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(from = "AuthStateImage")]
pub struct AuthState {
    #[serde(default)]
    pub keys: Vec<KeyRecord>,
    #[serde(default)]
    pub admin: Option<AdminRecord>,
    #[serde(default)]
    pub tokens: VecDeque<TokenRecord>,
    /// The revocations in force (the feed brokers follow).
    #[serde(default)]
    pub revocations: Vec<Revocation>,
    /// Goes up by one with every revocation recorded.
    #[serde(default)]
    pub revocation_revision: u64,
    /// `revocations` indexed for the check on every REST call, rebuilt at each change.
    #[serde(skip)]
    revoked: RevocationSet,
}

impl PartialEq for AuthState {
    fn eq(&self, o: &Self) -> bool {
        // `revoked` is derived from `revocations`.
        self.keys == o.keys
            && self.admin == o.admin
            && self.tokens == o.tokens
            && self.revocations == o.revocations
            && self.revocation_revision == o.revocation_revision
    }
}
impl Eq for AuthState {}

/// What a snapshot holds; [`AuthState`] is built from it with its index.
#[derive(Deserialize)]
struct AuthStateImage {
    #[serde(default)]
    keys: Vec<KeyRecord>,
    #[serde(default)]
    admin: Option<AdminRecord>,
    #[serde(default)]
    tokens: VecDeque<TokenRecord>,
    #[serde(default)]
    revocations: Vec<Revocation>,
    #[serde(default)]
    revocation_revision: u64,
}

impl From<AuthStateImage> for AuthState {
    fn from(i: AuthStateImage) -> AuthState {
        AuthState {
            revoked: RevocationSet::new(&i.revocations),
            keys: i.keys,
            admin: i.admin,
            tokens: i.tokens,
            revocations: i.revocations,
            revocation_revision: i.revocation_revision,
        }
    }
}

/// A write to the auth state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "auth_op", rename_all = "snake_case")]
pub enum AuthCommand {
    /// The first signing key and the bootstrap admin token (first one wins).
    Init {
        kid: String,
        seed_hex: String,
        admin_jti: String,
        at_s: u64,
        admin_ttl_s: u64,
    },
    /// Register an issued token. Expired records are dropped first; a register still full
    /// of live tokens refuses.
    RecordToken {
        token: TokenRecord,
        now_s: u64,
        tokens_max: usize,
    },
    /// A new key signs from now on; the previous signer is retired but still verifies.
    AddKey {
        kid: String,
        seed_hex: String,
        at_s: u64,
    },
    /// Remove a retired key: tokens it signed stop verifying.
    RemoveKey { kid: String },
    /// Spend a one-time enrolment token (`used_jti`, expiring at `used_until_s`) for the
    /// node credential `token`: both or neither. A token spent or revoked already refuses,
    /// so of two brokers racing with the same enrolment token one wins.
    Enrol {
        used_jti: String,
        used_until_s: u64,
        token: TokenRecord,
        now_s: u64,
        tokens_max: usize,
        revocations_max: usize,
    },
    /// Revoke a token, a subject or a tenant. Revocations past their `until_s` are dropped
    /// first; a list still full of live ones refuses.
    Revoke {
        revocation: Revocation,
        revocations_max: usize,
    },
}

/// Parse 64 hex digits into a seed.
pub fn seed_of_hex(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

pub fn hex_of_seed(seed: &[u8; 32]) -> String {
    seed.iter().map(|b| format!("{b:02x}")).collect()
}

fn invalid(msg: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::InvalidRequest, msg)
}

impl AuthState {
    /// Whether the bootstrap ran (keys exist).
    pub fn initialized(&self) -> bool {
        !self.keys.is_empty()
    }

    /// The key that signs new tokens: the newest not retired.
    pub fn signer(&self) -> Option<&KeyRecord> {
        self.keys.iter().rev().find(|k| k.retired_at_s.is_none())
    }

    /// Every key that verifies (signer and retired ones in their overlap).
    pub fn jwks(&self) -> Jwks {
        Jwks {
            keys: self
                .keys
                .iter()
                .map(|k| k.signing_key().jwk())
                .collect::<Vec<Jwk>>(),
        }
    }

    /// Why `p` is revoked, if it is.
    pub fn revoked(&self, p: &crate::auth::Principal) -> Option<String> {
        self.revoked.revoked(p)
    }

    /// When `value` was last revoked as a `kind`, if it is revoked.
    pub fn revoked_at(&self, kind: crate::auth::RevokeKind, value: &str) -> Option<u64> {
        self.revocations
            .iter()
            .filter(|r| r.kind == kind && r.value == value)
            .map(|r| r.at_s)
            .max()
    }

    /// The feed's answer: every revocation in force.
    pub fn revocation_feed(&self) -> RevocationFeed {
        RevocationFeed {
            revision: self.revocation_revision,
            revocations: self.revocations.clone(),
        }
    }

    fn revoke(&mut self, r: &Revocation, revocations_max: usize) -> Result<(), ApiError> {
        if r.value.is_empty() || r.until_s < r.at_s {
            return Err(invalid("revoke: a value, and until_s at or after at_s"));
        }
        let now = r.at_s;
        let same = |x: &Revocation| x.kind == r.kind && x.value == r.value;
        let live = self
            .revocations
            .iter()
            .filter(|x| x.until_s > now && !same(x))
            .count();
        // Count before pruning: a refusal changes nothing.
        if live >= revocations_max {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "{revocations_max} revocations are in force (auth_revocations_max); rotate the signing key to retire many tokens at once"
                ),
            ));
        }
        // Revoked again: the later time holds (members' clocks may differ a little).
        let mut r = r.clone();
        for old in self.revocations.iter().filter(|x| same(x)) {
            r.at_s = r.at_s.max(old.at_s);
            r.until_s = r.until_s.max(old.until_s);
        }
        self.revocations.retain(|x| x.until_s > now && !same(x));
        self.revocations.push(r);
        self.revocation_revision += 1;
        self.revoked = RevocationSet::new(&self.revocations);
        debug_assert!(self.revocations.len() <= revocations_max);
        Ok(())
    }

    /// A short-lived credential member `node_id` attaches to a write it forwards to the
    /// leader (`cluster.admin` on `internal`). Members hold the signing keys, so none is
    /// configured; before the bootstrap there is none, and nothing could be authorized yet.
    pub fn member_token(&self, node_id: u64, now_s: u64) -> Option<String> {
        let claims = crate::auth::Claims {
            iss: crate::auth::ISSUER.into(),
            sub: format!("member/{node_id}"),
            tenant: crate::auth::ANY_TENANT.into(),
            perms: vec!["cluster.admin:internal".into()],
            iat: now_s,
            nbf: now_s,
            exp: now_s + MEMBER_TOKEN_TTL_S,
            jti: format!("member-{node_id}-{now_s}"),
        };
        Some(self.signer()?.signing_key().issue(&claims))
    }

    pub fn apply(&mut self, cmd: &AuthCommand) -> Result<(), ApiError> {
        match cmd {
            AuthCommand::Init {
                kid,
                seed_hex,
                admin_jti,
                at_s,
                admin_ttl_s,
            } => {
                if self.initialized() {
                    return Ok(());
                }
                if seed_of_hex(seed_hex).is_none() || kid.is_empty() {
                    return Err(invalid("auth init: a key id and a 64-hex-digit seed"));
                }
                self.keys.push(KeyRecord {
                    kid: kid.clone(),
                    seed_hex: seed_hex.clone(),
                    created_at_s: *at_s,
                    retired_at_s: None,
                });
                self.admin = Some(AdminRecord {
                    jti: admin_jti.clone(),
                    issued_at_s: *at_s,
                    ttl_s: *admin_ttl_s,
                    kid: kid.clone(),
                });
                Ok(())
            }
            AuthCommand::RecordToken {
                token,
                now_s,
                tokens_max,
            } => {
                if self.tokens.iter().any(|t| t.jti == token.jti) {
                    return Err(ApiError::new(
                        ErrorCode::AlreadyExists,
                        format!("token id {} is registered already", token.jti),
                    ));
                }
                // Count before pruning: a refusal changes nothing.
                let live = self
                    .tokens
                    .iter()
                    .filter(|t| t.expires_at_s > *now_s)
                    .count();
                if live >= *tokens_max {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!(
                            "the token register holds {tokens_max} unexpired tokens (auth_tokens_max); revoke some or wait for them to expire"
                        ),
                    ));
                }
                self.tokens.retain(|t| t.expires_at_s > *now_s);
                self.tokens.push_back(token.clone());
                Ok(())
            }
            AuthCommand::AddKey {
                kid,
                seed_hex,
                at_s,
            } => {
                if seed_of_hex(seed_hex).is_none() || kid.is_empty() {
                    return Err(invalid("add key: a key id and a 64-hex-digit seed"));
                }
                if self.keys.iter().any(|k| &k.kid == kid) {
                    return Err(ApiError::new(
                        ErrorCode::AlreadyExists,
                        format!("key {kid} exists already"),
                    ));
                }
                if self.keys.len() >= KEYS_MAX {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!("{KEYS_MAX} keys are kept at most; remove a retired key first"),
                    ));
                }
                for k in self.keys.iter_mut().filter(|k| k.retired_at_s.is_none()) {
                    k.retired_at_s = Some(*at_s);
                }
                self.keys.push(KeyRecord {
                    kid: kid.clone(),
                    seed_hex: seed_hex.clone(),
                    created_at_s: *at_s,
                    retired_at_s: None,
                });
                Ok(())
            }
            AuthCommand::RemoveKey { kid } => {
                let Some(k) = self.keys.iter().find(|k| &k.kid == kid) else {
                    return Err(ApiError::new(ErrorCode::NotFound, format!("no key {kid}")));
                };
                if k.retired_at_s.is_none() {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!("key {kid} is the signing key; add a new key first"),
                    ));
                }
                self.keys.retain(|k| &k.kid != kid);
                Ok(())
            }
            AuthCommand::Revoke {
                revocation,
                revocations_max,
            } => self.revoke(revocation, *revocations_max),
            AuthCommand::Enrol {
                used_jti,
                used_until_s,
                token,
                now_s,
                tokens_max,
                revocations_max,
            } => {
                if self
                    .revoked_at(crate::auth::RevokeKind::Jti, used_jti)
                    .is_some()
                {
                    return Err(ApiError::new(
                        ErrorCode::Revoked,
                        format!("enrolment token {used_jti} was used (or revoked) already; `felixctl node enroll N --one-time` issues another"),
                    ));
                }
                // Applied to a copy, kept only if both steps succeed: a refusal changes nothing.
                let mut next = self.clone();
                next.apply(&AuthCommand::RecordToken {
                    token: token.clone(),
                    now_s: *now_s,
                    tokens_max: *tokens_max,
                })?;
                next.revoke(
                    &Revocation {
                        kind: crate::auth::RevokeKind::Jti,
                        value: used_jti.clone(),
                        at_s: *now_s,
                        until_s: (*used_until_s).max(*now_s),
                    },
                    *revocations_max,
                )?;
                *self = next;
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn init(kid: &str, seed: u8) -> AuthCommand {
        AuthCommand::Init {
            kid: kid.into(),
            seed_hex: hex_of_seed(&[seed; 32]),
            admin_jti: format!("admin-{kid}"),
            at_s: 100,
            admin_ttl_s: 1000,
        }
    }

    #[test]
    fn an_enrolment_token_is_spent_once_and_a_refusal_changes_nothing() {
        let record = |jti: &str| TokenRecord {
            jti: jti.into(),
            subject: "node/3".into(),
            tenant: "*".into(),
            perms: vec![],
            issued_at_s: 100,
            expires_at_s: 1000,
        };
        let enrol = |jti: &str, tokens_max| AuthCommand::Enrol {
            used_jti: "e1".into(),
            used_until_s: 200,
            token: record(jti),
            now_s: 100,
            tokens_max,
            revocations_max: 10,
        };
        let mut a = AuthState::default();
        // A full register refuses, and the enrolment token stays unspent.
        a.apply(&AuthCommand::RecordToken {
            token: record("other"),
            now_s: 100,
            tokens_max: 1,
        })
        .unwrap();
        assert_eq!(
            a.apply(&enrol("n1", 1)).unwrap_err().code,
            ErrorCode::Conflict
        );
        assert_eq!(a.revoked_at(crate::auth::RevokeKind::Jti, "e1"), None);
        assert_eq!(a.revocation_revision, 0);
        a.apply(&enrol("n1", 10)).unwrap();
        assert!(a.tokens.iter().any(|t| t.jti == "n1"));
        assert_eq!(a.revoked_at(crate::auth::RevokeKind::Jti, "e1"), Some(100));
        // Spent: a second exchange refuses and records nothing.
        let err = a.apply(&enrol("n2", 10)).unwrap_err();
        assert_eq!(err.code, ErrorCode::Revoked);
        assert!(!a.tokens.iter().any(|t| t.jti == "n2"));
    }

    #[test]
    fn the_first_init_wins_and_rotation_keeps_both_keys_until_removed() {
        let mut a = AuthState::default();
        a.apply(&init("k1", 1)).unwrap();
        a.apply(&init("k2", 2)).unwrap();
        assert_eq!(a.keys.len(), 1);
        assert_eq!(a.admin.as_ref().unwrap().jti, "admin-k1");
        assert_eq!(a.signer().unwrap().kid, "k1");
        a.apply(&AuthCommand::AddKey {
            kid: "k2".into(),
            seed_hex: hex_of_seed(&[2; 32]),
            at_s: 200,
        })
        .unwrap();
        assert_eq!(a.signer().unwrap().kid, "k2");
        assert_eq!(a.jwks().keys.len(), 2, "both verify in the overlap");
        let err = a.apply(&AuthCommand::RemoveKey { kid: "k2".into() });
        assert_eq!(
            err.unwrap_err().code,
            ErrorCode::Conflict,
            "the signer stays"
        );
        a.apply(&AuthCommand::RemoveKey { kid: "k1".into() })
            .unwrap();
        assert_eq!(a.jwks().keys.len(), 1);
    }

    #[test]
    fn the_token_register_is_bounded_and_drops_expired_records() {
        let mut a = AuthState::default();
        let rec = |jti: &str, exp: u64| AuthCommand::RecordToken {
            token: TokenRecord {
                jti: jti.into(),
                subject: "s".into(),
                tenant: "t".into(),
                perms: vec![],
                issued_at_s: 0,
                expires_at_s: exp,
            },
            now_s: 50,
            tokens_max: 2,
        };
        a.apply(&rec("a", 60)).unwrap();
        assert_eq!(
            a.apply(&rec("a", 60)).unwrap_err().code,
            ErrorCode::AlreadyExists
        );
        a.apply(&rec("b", 60)).unwrap();
        assert_eq!(
            a.apply(&rec("c", 60)).unwrap_err().code,
            ErrorCode::Conflict
        );
        let later = AuthCommand::RecordToken {
            token: TokenRecord {
                jti: "c".into(),
                subject: "s".into(),
                tenant: "t".into(),
                perms: vec![],
                issued_at_s: 0,
                expires_at_s: 200,
            },
            now_s: 100,
            tokens_max: 2,
        };
        a.apply(&later).unwrap();
        assert_eq!(a.tokens.len(), 1, "the expired ones made room");
    }

    #[test]
    fn revocations_are_bounded_merge_per_target_and_expire() {
        use crate::auth::{Principal, RevokeKind};
        let mut a = AuthState::default();
        let rev = |kind, value: &str, at_s, until_s| AuthCommand::Revoke {
            revocation: Revocation {
                kind,
                value: value.into(),
                at_s,
                until_s,
            },
            revocations_max: 2,
        };
        let alice = |iat| Principal {
            subject: "alice".into(),
            tenant: "t".into(),
            perms: vec![],
            issued_at_s: iat,
            expires_at_s: iat + 10,
            jti: "j".into(),
        };
        a.apply(&rev(RevokeKind::Subject, "alice", 100, 200))
            .unwrap();
        assert!(a.revoked(&alice(100)).is_some());
        assert!(a.revoked(&alice(101)).is_none());
        assert_eq!(a.revocation_revision, 1);
        // Again with an earlier clock: the later time holds, still one entry.
        a.apply(&rev(RevokeKind::Subject, "alice", 90, 190))
            .unwrap();
        assert_eq!(a.revocations.len(), 1);
        assert_eq!(a.revocations[0].at_s, 100);
        a.apply(&rev(RevokeKind::Tenant, "t2", 110, 150)).unwrap();
        let before = a.clone();
        let full = a.apply(&rev(RevokeKind::Jti, "x", 120, 130));
        assert_eq!(full.unwrap_err().code, ErrorCode::Conflict);
        assert_eq!(a, before, "a refusal changes nothing");
        // Past t2's until_s it makes room.
        a.apply(&rev(RevokeKind::Jti, "x", 160, 170)).unwrap();
        assert_eq!(a.revocations.len(), 2);
        assert_eq!(a.revocation_feed().revision, 4);
        // The index survives a snapshot round trip.
        let back: AuthState = serde_json::from_str(&serde_json::to_string(&a).unwrap()).unwrap();
        assert_eq!(back, a);
        assert!(back.revoked(&alice(100)).is_some());
        let bad = rev(RevokeKind::Jti, "", 1, 2);
        assert_eq!(a.apply(&bad).unwrap_err().code, ErrorCode::InvalidRequest);
    }

    #[test]
    fn a_bad_seed_is_refused_and_changes_nothing() {
        let mut a = AuthState::default();
        let bad = AuthCommand::Init {
            kid: "k".into(),
            seed_hex: "zz".into(),
            admin_jti: "j".into(),
            at_s: 0,
            admin_ttl_s: 1,
        };
        assert_eq!(a.apply(&bad).unwrap_err().code, ErrorCode::InvalidRequest);
        assert_eq!(a, AuthState::default());
    }
}

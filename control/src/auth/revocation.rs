//! Revocation: what the control plane records when a token, a subject or a tenant is revoked,
//! the feed brokers follow, and the match a verifier runs after the signature.
//!
//! A revocation covers every token of its target **issued at or before** it (`iat <= at_s`,
//! whole seconds), so a subject or tenant whose credentials leaked gets fresh tokens minted
//! after the revocation, and those verify. A revocation is kept until `until_s`, past which no
//! token it covers can still be unexpired; then it is dropped. Pure: times come in.

use super::Principal;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// What a revocation names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum RevokeKind {
    /// One token, by its id.
    Jti,
    /// Every token of a subject.
    Subject,
    /// Every token of a tenant.
    Tenant,
}

impl RevokeKind {
    pub fn name(self) -> &'static str {
        match self {
            RevokeKind::Jti => "jti",
            RevokeKind::Subject => "subject",
            RevokeKind::Tenant => "tenant",
        }
    }
}

/// One revocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(utoipa::ToSchema))]
pub struct Revocation {
    pub kind: RevokeKind,
    pub value: String,
    /// Tokens of the target issued at or before this time (Unix seconds) are refused.
    pub at_s: u64,
    /// Kept until then: no token it covers can be unexpired later.
    pub until_s: u64,
}

/// The revocation feed's answer: every revocation in force, and the revision it reflects.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "server", derive(utoipa::ToSchema))]
pub struct RevocationFeed {
    /// Goes up with every revocation recorded; `since` of the next poll.
    pub revision: u64,
    pub revocations: Vec<Revocation>,
}

/// The revocations indexed for a verifier: one hash lookup per kind.
#[derive(Debug, Clone, Default)]
pub struct RevocationSet {
    /// (kind, value) -> the latest `at_s` recorded for it.
    at_s: HashMap<(RevokeKind, String), u64>,
}

impl RevocationSet {
    pub fn new(list: &[Revocation]) -> RevocationSet {
        let mut at_s: HashMap<(RevokeKind, String), u64> = HashMap::with_capacity(list.len());
        for r in list {
            let e = at_s.entry((r.kind, r.value.clone())).or_insert(r.at_s);
            *e = (*e).max(r.at_s);
        }
        RevocationSet { at_s }
    }

    pub fn len(&self) -> usize {
        self.at_s.len()
    }

    pub fn is_empty(&self) -> bool {
        self.at_s.is_empty()
    }

    /// Why `p` is revoked, if it is.
    pub fn revoked(&self, p: &Principal) -> Option<String> {
        if self.at_s.is_empty() {
            return None;
        }
        [
            (RevokeKind::Jti, &p.jti),
            (RevokeKind::Subject, &p.subject),
            (RevokeKind::Tenant, &p.tenant),
        ]
        .into_iter()
        .find_map(|(kind, value)| {
            let at = *self.at_s.get(&(kind, value.clone()))?;
            (p.issued_at_s <= at).then(|| {
                format!(
                    "token {} of {} (tenant {:?}, issued at {}) is revoked: {} {value:?} revoked at {at}",
                    p.jti,
                    p.subject,
                    p.tenant,
                    p.issued_at_s,
                    kind.name()
                )
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(jti: &str, subject: &str, tenant: &str, iat: u64) -> Principal {
        Principal {
            subject: subject.into(),
            tenant: tenant.into(),
            perms: vec![],
            issued_at_s: iat,
            expires_at_s: iat + 100,
            jti: jti.into(),
        }
    }

    fn r(kind: RevokeKind, value: &str, at_s: u64) -> Revocation {
        Revocation {
            kind,
            value: value.into(),
            at_s,
            until_s: at_s + 1000,
        }
    }

    #[test]
    fn each_kind_covers_tokens_issued_at_or_before_it_and_nothing_else() {
        let set = RevocationSet::new(&[
            r(RevokeKind::Jti, "j1", 50),
            r(RevokeKind::Subject, "alice", 100),
            r(RevokeKind::Tenant, "acme", 200),
        ]);
        assert!(set.revoked(&p("j1", "bob", "other", 10)).is_some());
        assert!(set.revoked(&p("j2", "bob", "other", 10)).is_none());
        assert!(set.revoked(&p("j3", "alice", "other", 100)).is_some());
        assert!(
            set.revoked(&p("j4", "alice", "other", 101)).is_none(),
            "a token minted after the revocation verifies"
        );
        assert!(set.revoked(&p("j5", "bob", "acme", 200)).is_some());
        assert!(set.revoked(&p("j6", "bob", "acme", 201)).is_none());
        assert!(
            set.revoked(&p("j7", "carol", "acme2", 0)).is_none(),
            "values match whole, not as prefixes"
        );
        let why = set.revoked(&p("j3", "alice", "other", 1)).unwrap();
        assert!(why.contains("subject \"alice\""), "{why}");
    }

    #[test]
    fn a_target_revoked_twice_holds_the_later_time() {
        let set = RevocationSet::new(&[
            r(RevokeKind::Subject, "alice", 300),
            r(RevokeKind::Subject, "alice", 100),
        ]);
        assert_eq!(set.len(), 1);
        assert!(set.revoked(&p("j", "alice", "t", 250)).is_some());
    }
}

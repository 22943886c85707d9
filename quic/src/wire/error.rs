//! The one error registry of Felix.
//!
//! Every refusal on the wire carries one of these codes; the REST API of the control plane
//! uses the same names in its `{code, message}` bodies, so a user sees one vocabulary.
//! Numbers are stable forever: add new codes at the end, never renumber.

use std::fmt;

/// Whether a client may retry the same request unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Retrying the same request can succeed later (after backoff).
    Retryable,
    /// The request is wrong; retrying it unchanged fails the same way.
    Fatal,
}

macro_rules! registry {
    ($( $variant:ident = $num:literal, $name:literal, $retry:ident, $meaning:literal; )*) => {
        /// A registered error code. `repr(u16)` values are the wire numbers.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u16)]
        pub enum ErrorCode { $( #[doc = $meaning] $variant = $num, )* }

        impl ErrorCode {
            /// Every registered code, in number order.
            pub const ALL: &'static [ErrorCode] = &[ $( ErrorCode::$variant, )* ];

            /// The wire number.
            pub const fn number(self) -> u16 { self as u16 }

            /// The stable snake_case name (also the REST `code` field).
            pub const fn name(self) -> &'static str {
                match self { $( ErrorCode::$variant => $name, )* }
            }

            /// Whether a retry of the same request may succeed.
            pub const fn retry(self) -> Retry {
                match self { $( ErrorCode::$variant => Retry::$retry, )* }
            }

            /// One-line meaning, as documented in docs/protocol.md.
            pub const fn meaning(self) -> &'static str {
                match self { $( ErrorCode::$variant => $meaning, )* }
            }

            /// Look a code up by wire number; unknown numbers (from a newer peer) give `None`.
            pub fn from_number(n: u16) -> Option<ErrorCode> {
                match n { $( $num => Some(ErrorCode::$variant), )* _ => None }
            }

            /// Look a code up by name.
            pub fn from_name(s: &str) -> Option<ErrorCode> {
                match s { $( $name => Some(ErrorCode::$variant), )* _ => None }
            }
        }
    };
}

registry! {
    InvalidFrame = 1, "invalid_frame", Fatal, "A frame could not be decoded (bad magic, kind, length or body).";
    FrameTooLarge = 2, "frame_too_large", Fatal, "A frame's declared length exceeds the negotiated maximum.";
    UnsupportedVersion = 3, "unsupported_version", Fatal, "The peer speaks a protocol version this side does not.";
    UnknownStream = 4, "unknown_stream", Fatal, "The (tenant, namespace, stream) is not in the catalog.";
    UnknownShard = 5, "unknown_shard", Fatal, "The shard number is outside the stream's shard count.";
    InvalidName = 6, "invalid_name", Fatal, "A tenant, namespace, stream or cache name breaks the naming rules.";
    PayloadTooLarge = 7, "payload_too_large", Fatal, "A record payload exceeds the configured maximum.";
    TooManySubscriptions = 8, "too_many_subscriptions", Fatal, "The connection already holds the maximum number of subscriptions.";
    PublishTimeout = 9, "publish_timeout", Retryable, "A Block-policy publish waited past the publish timeout; it was not appended.";
    InflightLimit = 10, "inflight_limit", Retryable, "The connection's in-flight bytes or unanswered acks are at their cap; nothing was appended.";
    UnknownTenant = 11, "unknown_tenant", Fatal, "The tenant does not exist.";
    UnknownNamespace = 12, "unknown_namespace", Fatal, "The namespace does not exist.";
    NotFound = 13, "not_found", Fatal, "The named resource does not exist.";
    AlreadyExists = 14, "already_exists", Fatal, "A resource with that name already exists.";
    Conflict = 15, "conflict", Retryable, "The resource is in a state that forbids the operation (e.g. being deleted).";
    Unsupported = 16, "unsupported", Fatal, "The feature or field value is not supported by this build.";
    Unavailable = 17, "unavailable", Retryable, "The resource exists but cannot serve now (owner down, storage failed).";
    NotLeader = 18, "not_leader", Retryable, "This node is not the leader/owner; the message names the one that is.";
    RevisionTooOld = 19, "revision_too_old", Fatal, "The requested revision or offset is older than what is retained.";
    InvalidRequest = 20, "invalid_request", Fatal, "The request is well-formed but its values are invalid.";
    Internal = 21, "internal", Retryable, "An unexpected internal error; the broker logged it.";
    ShuttingDown = 22, "shutting_down", Retryable, "The broker is draining and accepts no new work.";
    StreamDeleted = 23, "stream_deleted", Fatal, "The stream was deleted; its subscriptions end and its records are gone.";
    StaleClaim = 24, "stale_claim", Fatal, "A group answer names a delivery that is no longer live (lapsed, answered, or out again under a newer attempt).";
    WatchLagged = 25, "watch_lagged", Retryable, "A cache watch fell behind its queue bound and was ended; watch again from the offset it names.";
    ConditionFailed = 26, "condition_failed", Fatal, "A conditional cache write found another version (or a value where none was required); nothing was written.";
    CacheFull = 27, "cache_full", Retryable, "A cache shard is at its entry or byte cap; the write was refused, nothing was evicted.";
    OutcomeUnknown = 28, "outcome_unknown", Retryable, "The request reached another broker, and its answer was lost (link broken, owner killed or frozen, timeout): it may or may not have been applied; retry only what is idempotent.";
    Unauthenticated = 29, "unauthenticated", Fatal, "No valid token: none was presented, or it is malformed, forged, of another cluster or not yet valid. Present a valid token (Authenticate).";
    Forbidden = 30, "forbidden", Fatal, "The token is valid but lacks the permission the operation needs; the message names it.";
    TokenExpired = 31, "token_expired", Fatal, "The token expired; present a fresh one (Authenticate) on the same connection.";
    Revoked = 32, "revoked", Fatal, "The token, its subject or its tenant was revoked.";
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_names_are_unique_and_round_trip() {
        let mut nums = std::collections::HashSet::new();
        let mut names = std::collections::HashSet::new();
        for c in ErrorCode::ALL {
            assert!(nums.insert(c.number()), "duplicate number {}", c.number());
            assert!(names.insert(c.name()), "duplicate name {}", c.name());
            assert_eq!(ErrorCode::from_number(c.number()), Some(*c));
            assert_eq!(ErrorCode::from_name(c.name()), Some(*c));
        }
        assert_eq!(ErrorCode::from_number(0), None);
        assert_eq!(ErrorCode::from_number(9999), None);
    }

    #[test]
    fn protocol_doc_lists_every_code() {
        let doc =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/protocol.md"))
                .unwrap();
        for c in ErrorCode::ALL {
            let retry = match c.retry() {
                Retry::Retryable => "retryable",
                Retry::Fatal => "fatal",
            };
            let row = format!(
                "| {} | {} | {} | {} |",
                c.number(),
                c.name(),
                retry,
                c.meaning()
            );
            assert!(doc.contains(&row), "docs/protocol.md lacks row {row}");
        }
    }
}

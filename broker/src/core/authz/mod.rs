//! Authorization, pure: which permission each frame needs, and whether a connection's
//! principal has it at a given time. The admission (`conn::admit_frame`) asks this for every
//! frame, a forwarded request's included (with the forward's principal).
//!
//! | frames | action, on the frame's `namespace/name` in its tenant |
//! |---|---|
//! | Publish | `stream.publish` |
//! | Subscribe | `stream.subscribe` |
//! | DescribeStream | any of `stream.publish`, `stream.subscribe`, `group.consume`, `manage` |
//! | GroupCreate, GroupDelete | `manage` |
//! | every other group request | `group.consume` |
//! | CachePut, CacheDelete, CounterAdd | `cache.write` |
//! | CacheGet, CounterGet, CacheWatch, DescribeCache | `cache.read` |
//! | DescribeCluster, Unsubscribe | a valid token |
//! | Hello, Authenticate, peer frames | none (the peer link is mutual TLS; a `Forward` is checked by its inner request) |

use crate::core::Refusal;
use felix_control::auth::{Action, Principal};
use felix_quic::wire::cache::CacheFrame;
use felix_quic::wire::group::GroupFrame;
use felix_quic::wire::{ErrorCode, Frame, StreamName};

/// What a frame needs of the principal.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Need<'a> {
    /// Nothing: it comes before or outside authentication.
    Nothing,
    /// A valid token, any permission.
    Token,
    /// One of `actions` on `name`.
    AnyOf(&'static [Action], &'a StreamName),
}

const PUBLISH: &[Action] = &[Action::StreamPublish];
const SUBSCRIBE: &[Action] = &[Action::StreamSubscribe];
const DESCRIBE: &[Action] = &[
    Action::StreamPublish,
    Action::StreamSubscribe,
    Action::GroupConsume,
    Action::Manage,
];
const MANAGE: &[Action] = &[Action::Manage];
const CONSUME: &[Action] = &[Action::GroupConsume];
const CACHE_WRITE: &[Action] = &[Action::CacheWrite];
const CACHE_READ: &[Action] = &[Action::CacheRead];

/// The permission `frame` needs.
pub(crate) fn need(frame: &Frame) -> Need<'_> {
    match frame {
        Frame::Hello { .. } | Frame::Auth(_) | Frame::Peer(_) => Need::Nothing,
        Frame::Publish { stream, .. } => Need::AnyOf(PUBLISH, stream),
        Frame::Subscribe { stream, .. } => Need::AnyOf(SUBSCRIBE, stream),
        Frame::DescribeStream { stream, .. } => Need::AnyOf(DESCRIBE, stream),
        Frame::Group(g) => match g {
            GroupFrame::GroupCreate { target, .. } | GroupFrame::GroupDelete { target, .. } => {
                Need::AnyOf(MANAGE, &target.stream)
            }
            GroupFrame::GroupDescribe { target, .. }
            | GroupFrame::GroupPoll { target, .. }
            | GroupFrame::GroupPollCancel { target, .. }
            | GroupFrame::GroupAnswer { target, .. }
            | GroupFrame::GroupSeek { target, .. }
            | GroupFrame::DeadLetterList { target, .. }
            | GroupFrame::DeadLetterOp { target, .. } => Need::AnyOf(CONSUME, &target.stream),
            // Answers a client never sends (the stream rules refuse them first).
            _ => Need::Token,
        },
        Frame::Cache(c) => match c {
            CacheFrame::CachePut { cache, .. }
            | CacheFrame::CacheDelete { cache, .. }
            | CacheFrame::CounterAdd { cache, .. } => Need::AnyOf(CACHE_WRITE, cache),
            CacheFrame::CacheGet { cache, .. }
            | CacheFrame::CounterGet { cache, .. }
            | CacheFrame::CacheWatch { cache, .. }
            | CacheFrame::DescribeCache { cache, .. } => Need::AnyOf(CACHE_READ, cache),
            _ => Need::Token,
        },
        _ => Need::Token,
    }
}

/// Whether `principal` meets `need` at `now_s`; else the typed refusal (`unauthenticated`,
/// `token_expired`, `forbidden` naming the permission that is missing).
pub(crate) fn check(principal: Option<&Principal>, now_s: u64, need: &Need) -> Result<(), Refusal> {
    if *need == Need::Nothing {
        return Ok(());
    }
    let Some(p) = principal else {
        return Err(Refusal::new(
            ErrorCode::Unauthenticated,
            "no token was presented on this connection (Authenticate after Hello)",
        ));
    };
    if now_s >= p.expires_at_s {
        return Err(Refusal::new(
            ErrorCode::TokenExpired,
            format!(
                "{}'s token {} expired at {}; present a fresh one (Authenticate)",
                p.subject, p.jti, p.expires_at_s
            ),
        ));
    }
    let Need::AnyOf(actions, name) = need else {
        return Ok(());
    };
    let resource = format!("{}/{}", name.namespace, name.stream);
    let mut first = None;
    for a in actions.iter() {
        match p.check(*a, &name.tenant, &resource) {
            Ok(()) => return Ok(()),
            Err(why) => {
                first.get_or_insert(why);
            }
        }
    }
    Err(Refusal::new(
        ErrorCode::Forbidden,
        first.expect("every need names at least one action"),
    ))
}

#[cfg(test)]
mod tests;

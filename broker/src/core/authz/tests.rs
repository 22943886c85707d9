//! Table-driven: every client request kind × every action, allowed exactly when the action is
//! the one (or one of those) the table in `authz` names; and the refusals' codes.

use super::*;
use crate::core::Refusal;
use bytes::Bytes;
use felix_control::auth::Permission;
use felix_quic::wire::cache::{WatchFilter, WatchStart, WriteCond};
use felix_quic::wire::group::{AnswerOp, DeadLetterAction, GroupRef};
use felix_quic::wire::{QueuePolicy, Records, ShardSelector, StartAt};

const NOW: u64 = 1_000;

fn name() -> StreamName {
    StreamName::new("acme", "prod", "orders")
}

fn target() -> GroupRef {
    GroupRef {
        stream: name(),
        group: "g".into(),
        shard: 0,
    }
}

/// One frame of every client request kind, with the actions that allow it.
fn table() -> Vec<(&'static str, Frame, &'static [Action])> {
    let rid = 1;
    let g = |f: GroupFrame| Frame::Group(f);
    let c = |f: CacheFrame| Frame::Cache(f);
    vec![
        (
            "Publish",
            Frame::Publish {
                request_id: rid,
                stream: name(),
                shard: ShardSelector::Shard(0),
                ack: true,
                records: Records::encode([&b"x"[..]]),
            },
            PUBLISH,
        ),
        (
            "Subscribe",
            Frame::Subscribe {
                request_id: rid,
                stream: name(),
                shard: 0,
                start: StartAt::Latest,
                policy: QueuePolicy::DropOld,
                queue_records_max: 0,
                queue_bytes_max: 0,
            },
            SUBSCRIBE,
        ),
        (
            "DescribeStream",
            Frame::DescribeStream {
                request_id: rid,
                stream: name(),
            },
            DESCRIBE,
        ),
        (
            "GroupCreate",
            g(GroupFrame::GroupCreate {
                request_id: rid,
                target: target(),
                start: StartAt::Earliest,
                max_attempts: 0,
                visibility_timeout_ms: 0,
            }),
            MANAGE,
        ),
        (
            "GroupDelete",
            g(GroupFrame::GroupDelete {
                request_id: rid,
                target: target(),
            }),
            MANAGE,
        ),
        (
            "GroupDescribe",
            g(GroupFrame::GroupDescribe {
                request_id: rid,
                target: target(),
            }),
            CONSUME,
        ),
        (
            "GroupPoll",
            g(GroupFrame::GroupPoll {
                request_id: rid,
                target: target(),
                max: 1,
                visibility_timeout_ms: 0,
                wait_ms: 0,
            }),
            CONSUME,
        ),
        (
            "GroupPollCancel",
            g(GroupFrame::GroupPollCancel {
                request_id: rid,
                target: target(),
            }),
            CONSUME,
        ),
        (
            "GroupAnswer",
            g(GroupFrame::GroupAnswer {
                request_id: rid,
                target: target(),
                op: AnswerOp::Ack,
                claims: vec![],
            }),
            CONSUME,
        ),
        (
            "GroupSeek",
            g(GroupFrame::GroupSeek {
                request_id: rid,
                target: target(),
                to: StartAt::Latest,
            }),
            CONSUME,
        ),
        (
            "DeadLetterList",
            g(GroupFrame::DeadLetterList {
                request_id: rid,
                target: target(),
                after: None,
                limit: 1,
            }),
            CONSUME,
        ),
        (
            "DeadLetterOp",
            g(GroupFrame::DeadLetterOp {
                request_id: rid,
                target: target(),
                action: DeadLetterAction::Discard,
                offset: 0,
            }),
            CONSUME,
        ),
        (
            "CachePut",
            c(CacheFrame::CachePut {
                request_id: rid,
                cache: name(),
                key: Bytes::from_static(b"k"),
                value: Bytes::from_static(b"v"),
                ttl_ms: 0,
                cond: WriteCond::Always,
            }),
            CACHE_WRITE,
        ),
        (
            "CacheDelete",
            c(CacheFrame::CacheDelete {
                request_id: rid,
                cache: name(),
                key: Bytes::from_static(b"k"),
                cond: WriteCond::Always,
            }),
            CACHE_WRITE,
        ),
        (
            "CounterAdd",
            c(CacheFrame::CounterAdd {
                request_id: rid,
                cache: name(),
                name: Bytes::from_static(b"n"),
                delta: 1,
            }),
            CACHE_WRITE,
        ),
        (
            "CacheGet",
            c(CacheFrame::CacheGet {
                request_id: rid,
                cache: name(),
                key: Bytes::from_static(b"k"),
            }),
            CACHE_READ,
        ),
        (
            "CounterGet",
            c(CacheFrame::CounterGet {
                request_id: rid,
                cache: name(),
                name: Bytes::from_static(b"n"),
            }),
            CACHE_READ,
        ),
        (
            "CacheWatch",
            c(CacheFrame::CacheWatch {
                request_id: rid,
                cache: name(),
                filter: WatchFilter::Key(Bytes::from_static(b"k")),
                start: WatchStart::Latest,
                queue_events_max: 0,
                queue_bytes_max: 0,
            }),
            CACHE_READ,
        ),
        (
            "DescribeCache",
            c(CacheFrame::DescribeCache {
                request_id: rid,
                cache: name(),
            }),
            CACHE_READ,
        ),
    ]
}

fn principal(tenant: &str, perms: &[&str], expires_at_s: u64) -> Principal {
    Principal {
        subject: "alice".into(),
        tenant: tenant.into(),
        perms: perms
            .iter()
            .map(|p| Permission::parse(p).unwrap())
            .collect(),
        issued_at_s: 0,
        expires_at_s,
        jti: "t".into(),
    }
}

#[test]
fn every_request_kind_against_every_action() {
    for (kind, frame, allowed) in table() {
        let need = need(&frame);
        for action in Action::ALL {
            let p = principal("acme", &[&format!("{}:prod/*", action.name())], NOW + 60);
            let r = check(Some(&p), NOW, &need);
            if allowed.contains(&action) {
                assert_eq!(r, Ok(()), "{kind} with {}", action.name());
            } else {
                let Refusal { code, message: msg } = r.expect_err(kind);
                assert_eq!(code, ErrorCode::Forbidden, "{kind} with {}", action.name());
                assert!(
                    msg.contains(allowed[0].name()) && msg.contains("prod/orders"),
                    "{kind}: the refusal names the missing permission: {msg}"
                );
            }
        }
        // The right action on another resource, or in another tenant: forbidden.
        let action = allowed[0].name();
        let elsewhere = principal("acme", &[&format!("{action}:staging/*")], NOW + 60);
        assert_eq!(
            check(Some(&elsewhere), NOW, &need).unwrap_err().code,
            ErrorCode::Forbidden
        );
        let other = principal("globex", &[&format!("{action}:*")], NOW + 60);
        assert_eq!(
            check(Some(&other), NOW, &need).unwrap_err().code,
            ErrorCode::Forbidden
        );
        // No token; an expired one.
        assert_eq!(
            check(None, NOW, &need).unwrap_err().code,
            ErrorCode::Unauthenticated
        );
        let expired = principal("acme", &[&format!("{action}:*")], NOW);
        assert_eq!(
            check(Some(&expired), NOW, &need).unwrap_err().code,
            ErrorCode::TokenExpired
        );
    }
}

#[test]
fn handshake_and_link_frames_need_nothing_and_the_rest_a_token() {
    let hello = Frame::Hello {
        features: 0,
        max_frame_bytes: 0,
        client: "x".into(),
    };
    assert_eq!(need(&hello), Need::Nothing);
    assert_eq!(check(None, NOW, &need(&hello)), Ok(()));
    let cluster = Frame::DescribeCluster { request_id: 1 };
    assert_eq!(need(&cluster), Need::Token);
    assert_eq!(
        check(None, NOW, &need(&cluster)).unwrap_err().code,
        ErrorCode::Unauthenticated
    );
    let any = principal("acme", &["cache.read:x/y"], NOW + 1);
    assert_eq!(check(Some(&any), NOW, &need(&cluster)), Ok(()));
}

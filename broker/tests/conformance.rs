//! The wire contract: every row of docs/protocol.md's two conformance tables, checked over a
//! real QUIC connection to the real broker with raw frames (not through the Rust client).
//!
//! One test walks every case against one broker and records which rows it covered; a row of
//! either table without a case fails it (`missing_rows`, whose own test below shows it does).
//! The broker serves docs/operations.md's example catalog, with small frame and payload
//! bounds so the oversized and split cases stay cheap.

use bytes::Bytes;
use felix_quic::wire::streams::{doc_table, Placement, KINDS};
use felix_quic::wire::{
    features, AnswerOp, CacheFrame, ClaimRef, DeadLetterAction, DeadLetterRef, ErrorCode,
    EventKind, ForwardHead, Frame, GroupFrame, GroupInfo, GroupRef, Limits, PeerFrame, QueuePolicy,
    Records, ShardSelector, StartAt, StreamName, WatchFilter, WatchStart, WriteCond, HEADER_LEN,
};
use std::collections::BTreeSet;

mod common;
use common::raw::{hello_frame, Raw};
use common::Broker;

const FRAME_MAX: usize = 65_536;
const PAYLOAD_MAX: usize = 4096;
/// The smallest Hello.max_frame_bytes this broker takes.
const PEER_FLOOR: u32 = (PAYLOAD_MAX + 1024) as u32;
const WINDOW: u64 = 16 << 20;

fn events() -> StreamName {
    StreamName::new("default", "default", "events")
}
fn orders() -> StreamName {
    StreamName::new("acme", "prod", "orders")
}
fn kv() -> StreamName {
    StreamName::new("default", "default", "kv")
}

fn publish(rid: u64, stream: StreamName, shard: u32, ack: bool, payloads: &[&[u8]]) -> Frame {
    Frame::Publish {
        request_id: rid,
        stream,
        shard: ShardSelector::Shard(shard),
        ack,
        records: Records::encode(payloads.iter().copied()),
    }
}

fn describe(rid: u64) -> Frame {
    Frame::DescribeStream {
        request_id: rid,
        stream: events(),
    }
}

fn target(group: &str) -> GroupRef {
    GroupRef {
        stream: orders(),
        group: group.into(),
        shard: 0,
    }
}

fn subscribe(rid: u64, shard: u32, start: StartAt, records_max: u32, bytes_max: u64) -> Frame {
    Frame::Subscribe {
        request_id: rid,
        stream: events(),
        shard,
        start,
        policy: QueuePolicy::DropNew,
        queue_records_max: records_max,
        queue_bytes_max: bytes_max,
    }
}

/// One well-formed frame of every kind a client sends to the control stream, `rid` as its id.
fn control_requests(rid: u64) -> Vec<Frame> {
    let g = |f: GroupFrame| Frame::Group(f);
    let c = |f: CacheFrame| Frame::Cache(f);
    vec![
        subscribe(rid, 0, StartAt::Latest, 0, 0),
        Frame::Unsubscribe {
            request_id: rid,
            subscription_id: 1,
        },
        describe(rid),
        g(GroupFrame::GroupCreate {
            request_id: rid,
            target: target("x"),
            start: StartAt::Earliest,
            max_attempts: 0,
            visibility_timeout_ms: 0,
        }),
        g(GroupFrame::GroupDelete {
            request_id: rid,
            target: target("x"),
        }),
        g(GroupFrame::GroupDescribe {
            request_id: rid,
            target: target("x"),
        }),
        g(GroupFrame::GroupPoll {
            request_id: rid,
            target: target("x"),
            max: 1,
            visibility_timeout_ms: 0,
            wait_ms: 0,
        }),
        g(GroupFrame::GroupPollCancel {
            request_id: rid,
            target: target("x"),
        }),
        g(GroupFrame::GroupAnswer {
            request_id: rid,
            target: target("x"),
            op: AnswerOp::Ack,
            claims: vec![ClaimRef {
                offset: 0,
                attempt: 1,
            }],
        }),
        g(GroupFrame::GroupSeek {
            request_id: rid,
            target: target("x"),
            to: StartAt::Latest,
        }),
        g(GroupFrame::DeadLetterList {
            request_id: rid,
            target: target("x"),
            after: None,
            limit: 10,
        }),
        g(GroupFrame::DeadLetterOp {
            request_id: rid,
            target: target("x"),
            action: DeadLetterAction::Discard,
            offset: 0,
        }),
        c(CacheFrame::CachePut {
            request_id: rid,
            cache: kv(),
            key: Bytes::from_static(b"k"),
            value: Bytes::from_static(b"v"),
            ttl_ms: 0,
            cond: WriteCond::Always,
        }),
        c(CacheFrame::CacheGet {
            request_id: rid,
            cache: kv(),
            key: Bytes::from_static(b"k"),
        }),
        c(CacheFrame::CacheDelete {
            request_id: rid,
            cache: kv(),
            key: Bytes::from_static(b"k"),
            cond: WriteCond::Always,
        }),
        c(CacheFrame::CacheWatch {
            request_id: rid,
            cache: kv(),
            filter: WatchFilter::Key(Bytes::from_static(b"k")),
            start: WatchStart::Latest,
            queue_events_max: 0,
            queue_bytes_max: 0,
        }),
        c(CacheFrame::CounterAdd {
            request_id: rid,
            cache: kv(),
            name: Bytes::from_static(b"n"),
            delta: 1,
        }),
        c(CacheFrame::CounterGet {
            request_id: rid,
            cache: kv(),
            name: Bytes::from_static(b"n"),
        }),
        c(CacheFrame::DescribeCache {
            request_id: rid,
            cache: kv(),
        }),
    ]
}

/// One well-formed frame of every kind only a broker sends.
fn broker_frames() -> Vec<Frame> {
    let g = |f: GroupFrame| Frame::Group(f);
    let c = |f: CacheFrame| Frame::Cache(f);
    let records = Records::encode([&b"r"[..]]);
    vec![
        Frame::HelloOk {
            features: 0,
            limits: Limits {
                max_frame_bytes: 1 << 20,
                max_payload_bytes: 1024,
                max_subscriptions: 1,
                max_key_bytes: 1,
            },
            core: 0,
            server: "x".into(),
        },
        Frame::PublishAck {
            request_id: 1,
            shard: 0,
            first_offset: 0,
            count: 1,
            owner: 0,
        },
        Frame::error(1, ErrorCode::Internal, "x"),
        Frame::SubscribeOk {
            request_id: 1,
            subscription_id: 1,
            shard: 0,
            next_offset: 0,
            queue_records_max: 1,
            queue_bytes_max: 1,
        },
        Frame::SubStream { subscription_id: 1 },
        Frame::Delivery {
            shard: 0,
            first_offset: 0,
            records: records.clone(),
        },
        Frame::Lag {
            from_offset: 0,
            lost: 1,
        },
        Frame::SubEnd {
            subscription_id: 1,
            code: 0,
            message: String::new(),
        },
        Frame::SubMux {
            subscription_ids: vec![1],
            frame: Box::new(Frame::Lag {
                from_offset: 0,
                lost: 1,
            }),
        },
        Frame::StreamInfo {
            request_id: 1,
            shards: 1,
            durable: false,
            owners: vec![],
        },
        Frame::ClusterInfo {
            request_id: 1,
            node_id: 1,
            brokers: vec![],
        },
        Frame::Auth(felix_quic::wire::AuthFrame::Authenticated {
            request_id: 1,
            subject: String::new(),
            tenant: String::new(),
            expires_at_ms: 0,
        }),
        g(GroupFrame::GroupInfo {
            request_id: 1,
            shard: 0,
            info: GroupInfo::default(),
        }),
        g(GroupFrame::GroupRecords {
            request_id: 1,
            shard: 0,
            visibility_timeout_ms: 1,
            claims: vec![ClaimRef {
                offset: 0,
                attempt: 1,
            }],
            records,
        }),
        g(GroupFrame::GroupAnswered {
            request_id: 1,
            codes: vec![0],
        }),
        g(GroupFrame::DeadLetterPage {
            request_id: 1,
            letters: vec![DeadLetterRef {
                offset: 0,
                attempts: 1,
                reason: 0,
                redriving: false,
            }],
            next_after: None,
        }),
        g(GroupFrame::GroupOk { request_id: 1 }),
        c(CacheFrame::CacheValue {
            request_id: 1,
            shard: 0,
            found: false,
            version: 0,
            change_offset: 0,
            expires_at_ms: 0,
            value: Bytes::new(),
        }),
        c(CacheFrame::CacheWritten {
            request_id: 1,
            shard: 0,
            version: 0,
            expires_at_ms: 0,
        }),
        c(CacheFrame::CacheWatchOk {
            request_id: 1,
            watch_id: 1,
            shard: 0,
            live_from: 0,
            queue_events_max: 1,
            queue_bytes_max: 1,
        }),
        c(CacheFrame::CacheEvent {
            kind: EventKind::Put,
            offset: 0,
            key: Bytes::from_static(b"k"),
            expires_at_ms: 0,
            value: Bytes::new(),
        }),
        c(CacheFrame::CacheStateDone {
            count: 0,
            snapshot: false,
            live_from: 0,
        }),
        c(CacheFrame::CacheWatchEnd {
            code: 0,
            resume_from: 0,
            message: String::new(),
        }),
        c(CacheFrame::CounterValue {
            request_id: 1,
            shard: 0,
            sum: 0,
            offset: 0,
        }),
        c(CacheFrame::CacheMux {
            watch_ids: vec![1],
            frame: Box::new(CacheFrame::CacheStateDone {
                count: 0,
                snapshot: false,
                live_from: 0,
            }),
        }),
        c(CacheFrame::CacheInfo {
            request_id: 1,
            shards: 1,
            durable: false,
            default_ttl_ms: 0,
            owners: vec![],
        }),
    ]
}

/// The Error a frame got: `(request_id, code)`, panicking on anything else.
fn error_of(f: Frame) -> (u64, ErrorCode) {
    match f {
        Frame::Error {
            request_id, code, ..
        } => (request_id, ErrorCode::from_number(code).unwrap()),
        other => panic!("expected an Error, got {other:?}"),
    }
}

/// The application error code of a broker close (`code N reason`).
fn close_code(reason: &str) -> u64 {
    reason
        .strip_prefix("code ")
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not a peer close: {reason}"))
}

/// Rows of the two tables that no case covered.
fn missing_rows(doc: &str, covered: &BTreeSet<String>) -> Vec<String> {
    let mut rows: Vec<String> = Vec::new();
    for (marker, col) in [("conformance-kinds", 1), ("conformance-rules", 0)] {
        let table = doc_table(doc, marker).unwrap_or_else(|| panic!("no {marker} table"));
        assert!(!table.is_empty(), "{marker} has rows");
        rows.extend(table.into_iter().map(|r| r[col].clone()));
    }
    rows.into_iter().filter(|r| !covered.contains(r)).collect()
}

struct Suite {
    b: Broker,
    covered: BTreeSet<String>,
    _dir: tempfile::TempDir,
}

impl Suite {
    fn cover(&mut self, rows: &[&str]) {
        self.covered.extend(rows.iter().map(|r| r.to_string()));
    }
    async fn conn(&self) -> Raw {
        Raw::connect(self.b.quic, &self.b.ca(), FRAME_MAX, WINDOW).await
    }
    async fn ready(&self) -> Raw {
        let mut c = self.conn().await;
        c.hello(FRAME_MAX as u32).await;
        c
    }
}

/// The suite's broker: docs/operations.md's example catalog, small bounds, `env` set.
fn suite(env: &[(&str, &str)]) -> Suite {
    let dir = tempfile::tempdir().unwrap();
    let catalog = dir.path().join("catalog.yaml");
    std::fs::write(
        &catalog,
        felix_broker::catalog::operations_doc_catalog_example(),
    )
    .unwrap();
    let durable = dir.path().join("durable");
    let b = Broker::try_start_env(
        tempfile::tempdir().unwrap(),
        2,
        &[
            "--catalog",
            catalog.to_str().unwrap(),
            "--durable-storage-dir",
            durable.to_str().unwrap(),
            "--max-frame-bytes",
            &FRAME_MAX.to_string(),
            "--max-payload-bytes",
            &PAYLOAD_MAX.to_string(),
            "--hello-timeout-ms",
            "700",
            "--ring-records-max",
            "4",
        ],
        env,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    Suite {
        b,
        covered: BTreeSet::new(),
        _dir: dir,
    }
}

/// The suite catches a broken rule: a debug broker told to serve a Publish on the control
/// stream (`FELIX_TEST_BREAK_RULE`, see `broken_for_tests` in the core) fails the
/// stream-rule cases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_suite_catches_a_broken_rule() {
    let mut s = suite(&[("FELIX_TEST_BREAK_RULE", "publish-on-control")]);
    let r = tokio::spawn(async move { stream_rules(&mut s).await }).await;
    let e = r.expect_err("the broken rule went unnoticed");
    assert!(e.is_panic());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_table() {
    let mut s = suite(&[]);
    handshake(&mut s).await;
    closes(&mut s).await;
    stream_rules(&mut s).await;
    framing(&mut s).await;
    streams_served(&mut s).await;
    groups_served(&mut s).await;
    caches_served(&mut s).await;
    watch_mux_served(&mut s).await;
    sub_mux_served(&mut s).await;
    peer_max(&mut s).await;
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/protocol.md"))
        .unwrap();
    let missing = missing_rows(&doc, &s.covered);
    assert!(
        missing.is_empty(),
        "conformance rows with no case: {missing:?}"
    );
}

/// The coverage check can fail: a covered set missing one row is reported.
#[test]
fn a_row_without_a_case_fails_the_suite() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/protocol.md"))
        .unwrap();
    let mut all: BTreeSet<String> = KINDS.iter().map(|k| k.1.to_string()).collect();
    for r in doc_table(&doc, "conformance-rules").unwrap() {
        all.insert(r[0].clone());
    }
    assert!(missing_rows(&doc, &all).is_empty());
    all.remove("too-large");
    all.remove("GroupPollCancel");
    assert_eq!(
        missing_rows(&doc, &all),
        vec!["GroupPollCancel", "too-large"]
    );
}

async fn handshake(s: &mut Suite) {
    let mut c = s.conn().await;
    // Before Hello: refused with its id, not executed.
    c.send(0, &describe(5));
    assert_eq!(error_of(c.next_on(0).await), (5, ErrorCode::InvalidRequest));
    // Hello on a publisher stream is "before Hello" too.
    c.send(4, &hello_frame(FRAME_MAX as u32));
    assert_eq!(error_of(c.next_on(4).await), (0, ErrorCode::InvalidRequest));
    // A later Hello on stream 0 is taken.
    c.hello(FRAME_MAX as u32).await;
    c.send(0, &hello_frame(FRAME_MAX as u32));
    assert_eq!(error_of(c.next_on(0).await), (0, ErrorCode::InvalidRequest));
    c.send(0, &describe(6));
    assert!(matches!(
        c.next_on(0).await,
        Frame::StreamInfo {
            request_id: 6,
            shards: 4,
            ..
        }
    ));
    // A standalone broker's cluster: itself only, with no registered brokers.
    c.send(0, &Frame::DescribeCluster { request_id: 7 });
    assert_eq!(
        c.next_on(0).await,
        Frame::ClusterInfo {
            request_id: 7,
            node_id: 1,
            brokers: vec![],
        }
    );
    s.cover(&["DescribeCluster", "ClusterInfo"]);
    // Authenticate on a broker with auth off: answered, naming no one (docs/security.md).
    c.send(
        0,
        &Frame::Auth(felix_quic::wire::AuthFrame::Authenticate {
            request_id: 8,
            token: "anything".into(),
        }),
    );
    assert_eq!(
        c.next_on(0).await,
        Frame::Auth(felix_quic::wire::AuthFrame::Authenticated {
            request_id: 8,
            subject: String::new(),
            tenant: String::new(),
            expires_at_ms: 0,
        })
    );
    s.cover(&["Authenticate"]);
    s.cover(&[
        "Hello",
        "HelloOk",
        "before-hello",
        "hello-elsewhere",
        "hello-twice",
        "DescribeStream",
        "StreamInfo",
    ]);
}

async fn closes(s: &mut Suite) {
    // No Hello within the deadline (700 ms here): closed with invalid_request's number.
    let mut c = s.conn().await;
    let reason = c.wait_closed().await;
    assert_eq!(close_code(&reason), 20, "{reason}");
    assert!(reason.contains("no Hello"), "{reason}");

    // A maximum too small for the broker's largest record.
    let mut c = s.conn().await;
    c.send(0, &hello_frame(PEER_FLOOR - 1));
    assert_eq!(error_of(c.next_on(0).await), (0, ErrorCode::InvalidRequest));
    let reason = c.wait_closed().await;
    assert_eq!(close_code(&reason), 20, "{reason}");
    assert!(
        reason.contains(&PEER_FLOOR.to_string()),
        "names the floor: {reason}"
    );

    // Another protocol version on the control stream: answered, then closed.
    let mut c = s.conn().await;
    let mut h = hello_frame(FRAME_MAX as u32).encode().to_vec();
    h[2] = 2;
    c.send_raw(0, h);
    assert_eq!(
        error_of(c.next_on(0).await).1,
        ErrorCode::UnsupportedVersion
    );
    assert_eq!(close_code(&c.wait_closed().await), 3);

    // Lost framing on the control stream after Hello: closed with invalid_frame's number.
    let mut c = s.ready().await;
    c.send_raw(0, b"XX\x01\x0d\0\0\x00\0\0\0".to_vec());
    assert_eq!(error_of(c.next_on(0).await).1, ErrorCode::InvalidFrame);
    assert_eq!(close_code(&c.wait_closed().await), 1);
    s.cover(&[
        "hello-deadline",
        "hello-small-max",
        "bad-version",
        "bad-magic-control",
    ]);
}

async fn stream_rules(s: &mut Suite) {
    let mut c = s.ready().await;
    // Every control request on a publisher stream, then on a one-way stream.
    for (i, f) in control_requests(0).into_iter().enumerate() {
        let rid = 100 + i as u64;
        let f = with_rid(f, rid);
        c.send(4, &f);
        assert_eq!(
            error_of(c.next_on(4).await),
            (rid, ErrorCode::InvalidRequest),
            "{f:?} on a publisher stream"
        );
        c.send(2, &f);
        assert_eq!(
            error_of(c.next_on(0).await),
            (rid, ErrorCode::InvalidRequest),
            "{f:?} on a one-way stream"
        );
    }
    // Every broker-only kind, on the control stream, a publisher stream and a one-way stream.
    for f in broker_frames() {
        c.send(0, &f);
        assert_eq!(
            error_of(c.next_on(0).await),
            (0, ErrorCode::InvalidRequest),
            "{f:?} from a client"
        );
        c.send(4, &f);
        assert_eq!(error_of(c.next_on(4).await), (0, ErrorCode::InvalidRequest));
        c.send(6, &f);
        assert_eq!(error_of(c.next_on(0).await), (0, ErrorCode::InvalidRequest));
        let name = KINDS.iter().find(|k| k.0 == f.kind()).unwrap().1;
        s.cover(&[name]);
    }
    assert_eq!(
        KINDS
            .iter()
            .filter(|k| k.2 == Placement::BrokerOnly)
            .count(),
        broker_frames().len(),
        "a case for every broker-only kind"
    );
    // The peer link's frames from a client: refused on any stream, nothing done (a forward's
    // refusal names its inner request's id). The owner side is broker/tests/cluster.rs.
    let peer_frames = [
        Frame::Peer(PeerFrame::PeerHello {
            node_id: 9,
            cluster_id: String::new(),
            capabilities: 1,
            max_frame_bytes: 1 << 20,
        }),
        Frame::Peer(PeerFrame::PeerHelloOk {
            node_id: 9,
            cluster_id: String::new(),
            capabilities: 1,
            max_frame_bytes: 1 << 20,
        }),
        Frame::Peer(PeerFrame::Forward {
            head: ForwardHead {
                incarnation: 0,
                generation: 0,
                origin_node: 9,
                principal: String::new(),
                frame_bytes_max: 0,
            },
            inner: Box::new(publish(210, events(), 3, true, &[b"x"])),
        }),
        Frame::Replicate {
            shard: felix_quic::wire::replica::ShardRef {
                stream: events(),
                incarnation: 0,
                shard: 3,
            },
            msg: felix_quic::wire::replica::ReplicaMsg::Fence { gen: 1, leader: 9 },
            records: vec![],
        },
    ];
    for f in &peer_frames {
        let rid = f.request_id().unwrap_or(0);
        c.send(0, f);
        assert_eq!(
            error_of(c.next_on(0).await),
            (rid, ErrorCode::InvalidRequest)
        );
        c.send(4, f);
        assert_eq!(
            error_of(c.next_on(4).await),
            (rid, ErrorCode::InvalidRequest)
        );
        let name = KINDS.iter().find(|k| k.0 == f.kind()).unwrap().1;
        s.cover(&[name]);
    }
    assert_eq!(
        KINDS.iter().filter(|k| k.2 == Placement::PeerLink).count(),
        peer_frames.len()
    );
    // A Publish on the control stream, and an acked one on a one-way stream: refused, and
    // not appended (shard 3's next offset is still 0 after both).
    c.send(0, &publish(200, events(), 3, true, &[b"x"]));
    assert_eq!(
        error_of(c.next_on(0).await),
        (200, ErrorCode::InvalidRequest)
    );
    c.send(10, &publish(201, events(), 3, true, &[b"x"]));
    assert_eq!(
        error_of(c.next_on(0).await),
        (201, ErrorCode::InvalidRequest)
    );
    // A fire-and-forget publish refused: its Error comes on stream 0 with its id.
    c.send(
        10,
        &publish(
            202,
            StreamName::new("default", "default", "nope"),
            0,
            false,
            &[b"x"],
        ),
    );
    assert_eq!(
        error_of(c.next_on(0).await),
        (202, ErrorCode::UnknownStream)
    );
    // Fire-and-forget on a publisher stream is served; its refusal comes on that stream.
    c.send(
        8,
        &publish(
            204,
            StreamName::new("default", "default", "nope"),
            0,
            false,
            &[b"x"],
        ),
    );
    assert_eq!(
        error_of(c.next_on(8).await),
        (204, ErrorCode::UnknownStream)
    );
    c.send(8, &publish(203, events(), 3, true, &[b"first"]));
    match c.next_on(8).await {
        Frame::PublishAck {
            request_id: 203,
            first_offset,
            ..
        } => assert_eq!(first_offset, 0, "the refused publishes appended nothing"),
        other => panic!("{other:?}"),
    }
    s.cover(&[
        "wrong-stream",
        "publish-on-control",
        "acked-publish-one-way",
        "fire-refused",
        "broker-kind",
        "Publish",
        "PublishAck",
        "Error",
    ]);
}

/// `f` with its request id replaced.
fn with_rid(f: Frame, rid: u64) -> Frame {
    let mut bytes = f.encode().to_vec();
    bytes[HEADER_LEN..HEADER_LEN + 8].copy_from_slice(&rid.to_le_bytes());
    felix_quic::wire::decode_frame(&bytes, usize::MAX >> 1).unwrap()
}

async fn framing(s: &mut Suite) {
    let mut c = s.ready().await;
    // Unknown kind: skipped, no answer; the describe behind it is the first answer.
    let mut unknown = Frame::Unknown {
        kind: 200,
        flags: 0,
        body: Bytes::from_static(b"from a newer peer"),
    }
    .encode()
    .to_vec();
    unknown.extend_from_slice(&describe(300).encode());
    c.send_raw(0, unknown);
    assert!(matches!(
        c.next_on(0).await,
        Frame::StreamInfo {
            request_id: 300,
            ..
        }
    ));
    // A body that does not decode (shard selector 7), then a good publish on the same stream.
    let mut bad = publish(42, events(), 1, true, &[b"a"]).encode().to_vec();
    let at = HEADER_LEN + 8 + 9 + 9 + 8;
    assert_eq!(bad[at], 1);
    bad[at] = 7;
    c.send_raw(12, bad);
    c.send(12, &publish(43, events(), 1, true, &[b"b"]));
    assert_eq!(error_of(c.next_on(12).await), (42, ErrorCode::InvalidFrame));
    assert!(matches!(
        c.next_on(12).await,
        Frame::PublishAck { request_id: 43, .. }
    ));
    // The same on the control stream: it stays usable.
    let mut bad_get = Frame::Cache(CacheFrame::CacheGet {
        request_id: 44,
        cache: kv(),
        key: Bytes::from_static(b"k"),
    })
    .encode()
    .to_vec();
    bad_get[HEADER_LEN + 8] = 0xff; // tenant length now overruns the body
    c.send_raw(0, bad_get);
    assert_eq!(error_of(c.next_on(0).await), (44, ErrorCode::InvalidFrame));
    c.send(0, &describe(45));
    assert!(matches!(
        c.next_on(0).await,
        Frame::StreamInfo { request_id: 45, .. }
    ));
    // Over the maximum: frame_too_large with the id, the body discarded, the stream goes on;
    // on a publisher stream and on the control stream (a cache put of a big value).
    let big = vec![7u8; FRAME_MAX + 100];
    c.send(16, &publish(50, events(), 1, true, &[&big]));
    c.send(16, &publish(51, events(), 1, true, &[b"after"]));
    assert_eq!(
        error_of(c.next_on(16).await),
        (50, ErrorCode::FrameTooLarge)
    );
    assert!(matches!(
        c.next_on(16).await,
        Frame::PublishAck { request_id: 51, .. }
    ));
    c.send(
        0,
        &Frame::Cache(CacheFrame::CachePut {
            request_id: 52,
            cache: kv(),
            key: Bytes::from_static(b"big"),
            value: Bytes::from(big),
            ttl_ms: 0,
            cond: WriteCond::Always,
        }),
    );
    c.send(0, &describe(53));
    assert_eq!(error_of(c.next_on(0).await), (52, ErrorCode::FrameTooLarge));
    assert!(matches!(
        c.next_on(0).await,
        Frame::StreamInfo { request_id: 53, .. }
    ));
    // Lost framing on a publisher stream and on a one-way stream: that stream only.
    c.send_raw(20, b"XX\x01\x03\0\0\0\0\0\0garbage".to_vec());
    assert_eq!(error_of(c.next_on(20).await), (0, ErrorCode::InvalidFrame));
    c.send_raw(14, b"XX\x01\x03\0\0\0\0\0\0garbage".to_vec());
    assert_eq!(error_of(c.next_on(0).await), (0, ErrorCode::InvalidFrame));
    c.send(24, &publish(54, events(), 1, true, &[b"c"]));
    assert!(matches!(
        c.next_on(24).await,
        Frame::PublishAck { request_id: 54, .. }
    ));
    // A stream finished inside a frame.
    let half = publish(55, events(), 1, true, &[b"d"]).encode().to_vec();
    c.send_raw(28, half[..half.len() / 2].to_vec());
    c.fin(28);
    assert_eq!(error_of(c.next_on(28).await), (0, ErrorCode::InvalidFrame));
    // A refused request pipelined between two good ones: every answer names its request.
    c.send(32, &publish(60, events(), 2, true, &[b"e"]));
    c.send(32, &publish(61, events(), 99, true, &[b"f"]));
    c.send(32, &publish(62, events(), 2, true, &[b"g"]));
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(match c.next_on(32).await {
            Frame::PublishAck { request_id, .. } => (request_id, None),
            Frame::Error {
                request_id, code, ..
            } => (request_id, ErrorCode::from_number(code)),
            other => panic!("{other:?}"),
        });
    }
    got.sort_by_key(|g| g.0);
    assert_eq!(
        got,
        vec![(60, None), (61, Some(ErrorCode::UnknownShard)), (62, None)]
    );
    s.cover(&[
        "unknown-kind",
        "bad-body",
        "too-large",
        "bad-magic-stream",
        "truncated",
        "error-request-id",
    ]);
}

async fn streams_served(s: &mut Suite) {
    let mut c = s.ready().await;
    // The ring keeps 4 records: 10 single-record publishes, then a subscribe from 0 starts
    // with a Lag for the 6 no longer retained.
    for i in 0..10u64 {
        c.send(4, &publish(400 + i, events(), 0, true, &[b"r"]));
        assert!(matches!(c.next_on(4).await, Frame::PublishAck { .. }));
    }
    // A queue bound asked over the broker's maximum is granted the maximum, and reported.
    c.send(0, &subscribe(410, 0, StartAt::Offset(0), u32::MAX, 1 << 40));
    let (sub_stream, first) = c.next_server_uni().await;
    let sid = match first {
        Frame::SubStream { subscription_id } => subscription_id,
        other => panic!("{other:?}"),
    };
    match c.next_on(0).await {
        Frame::SubscribeOk {
            request_id: 410,
            subscription_id,
            queue_records_max,
            queue_bytes_max,
            ..
        } => {
            assert_eq!(subscription_id, sid);
            assert_eq!(
                (queue_records_max, queue_bytes_max),
                (4096, 16 << 20),
                "the broker's bounds"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        c.next_on(sub_stream).await,
        Frame::Lag {
            from_offset: 0,
            lost: 6
        }
    );
    match c.next_on(sub_stream).await {
        Frame::Delivery { first_offset, .. } => assert_eq!(first_offset, 6),
        other => panic!("{other:?}"),
    }
    // An ask of 0 gets the default, one below the maximum gets itself.
    c.send(0, &subscribe(411, 1, StartAt::Latest, 7, 1000));
    let (other_stream, _) = c.next_server_uni().await;
    match c.next_on(0).await {
        Frame::SubscribeOk {
            queue_records_max,
            queue_bytes_max,
            ..
        } => assert_eq!((queue_records_max, queue_bytes_max), (7, 1000)),
        other => panic!("{other:?}"),
    }
    // Unsubscribe is answered by the SubEnd on the subscription's own stream.
    c.send(
        0,
        &Frame::Unsubscribe {
            request_id: 412,
            subscription_id: sid,
        },
    );
    loop {
        match c.next_on(sub_stream).await {
            Frame::Delivery { .. } => continue,
            Frame::SubEnd { code, .. } => {
                assert_eq!(code, 0);
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    c.send(
        0,
        &Frame::Unsubscribe {
            request_id: 413,
            subscription_id: 12345,
        },
    );
    assert_eq!(error_of(c.next_on(0).await), (413, ErrorCode::NotFound));
    let _ = other_stream;
    s.cover(&[
        "Subscribe",
        "SubscribeOk",
        "SubStream",
        "Lag",
        "Delivery",
        "Unsubscribe",
        "SubEnd",
        "queue-bound",
    ]);
}

async fn groups_served(s: &mut Suite) {
    let mut c = s.ready().await;
    let g = |f: GroupFrame| Frame::Group(f);
    c.send(
        0,
        &g(GroupFrame::GroupCreate {
            request_id: 500,
            target: target("w"),
            start: StartAt::Earliest,
            max_attempts: 0,
            visibility_timeout_ms: 0,
        }),
    );
    assert!(matches!(
        c.next_on(0).await,
        Frame::Group(GroupFrame::GroupOk { request_id: 500 })
    ));
    c.send(4, &publish(501, orders(), 0, true, &[b"job"]));
    assert!(matches!(c.next_on(4).await, Frame::PublishAck { .. }));
    c.send(
        0,
        &g(GroupFrame::GroupPoll {
            request_id: 502,
            target: target("w"),
            max: 1,
            visibility_timeout_ms: 0,
            wait_ms: 0,
        }),
    );
    let claim = match c.next_on(0).await {
        Frame::Group(GroupFrame::GroupRecords {
            request_id: 502,
            claims,
            ..
        }) => claims[0],
        other => panic!("{other:?}"),
    };
    c.send(
        0,
        &g(GroupFrame::GroupAnswer {
            request_id: 503,
            target: target("w"),
            op: AnswerOp::Reject,
            claims: vec![claim],
        }),
    );
    assert_eq!(
        c.next_on(0).await,
        Frame::Group(GroupFrame::GroupAnswered {
            request_id: 503,
            codes: vec![0]
        })
    );
    c.send(
        0,
        &g(GroupFrame::DeadLetterList {
            request_id: 504,
            target: target("w"),
            after: None,
            limit: 10,
        }),
    );
    match c.next_on(0).await {
        Frame::Group(GroupFrame::DeadLetterPage {
            request_id: 504,
            letters,
            ..
        }) => assert_eq!(letters.len(), 1),
        other => panic!("{other:?}"),
    }
    c.send(
        0,
        &g(GroupFrame::DeadLetterOp {
            request_id: 505,
            target: target("w"),
            action: DeadLetterAction::Discard,
            offset: claim.offset,
        }),
    );
    assert!(matches!(
        c.next_on(0).await,
        Frame::Group(GroupFrame::GroupOk { request_id: 505 })
    ));
    c.send(
        0,
        &g(GroupFrame::GroupSeek {
            request_id: 506,
            target: target("w"),
            to: StartAt::Latest,
        }),
    );
    assert!(matches!(
        c.next_on(0).await,
        Frame::Group(GroupFrame::GroupOk { request_id: 506 })
    ));
    c.send(
        0,
        &g(GroupFrame::GroupDescribe {
            request_id: 507,
            target: target("w"),
        }),
    );
    assert!(matches!(
        c.next_on(0).await,
        Frame::Group(GroupFrame::GroupInfo {
            request_id: 507,
            ..
        })
    ));
    // A long poll waits (nothing past the cursor); its cancel answers it, empty.
    c.send(
        0,
        &g(GroupFrame::GroupPoll {
            request_id: 508,
            target: target("w"),
            max: 1,
            visibility_timeout_ms: 0,
            wait_ms: 30_000,
        }),
    );
    c.send(
        0,
        &g(GroupFrame::GroupPollCancel {
            request_id: 508,
            target: target("w"),
        }),
    );
    match c.next_on(0).await {
        Frame::Group(GroupFrame::GroupRecords {
            request_id: 508,
            claims,
            ..
        }) => assert!(claims.is_empty()),
        other => panic!("{other:?}"),
    }
    // No poll waits under that id any more: the cancel is answered not_found.
    c.send(
        0,
        &g(GroupFrame::GroupPollCancel {
            request_id: 508,
            target: target("w"),
        }),
    );
    assert_eq!(error_of(c.next_on(0).await), (508, ErrorCode::NotFound));
    c.send(
        0,
        &g(GroupFrame::GroupDelete {
            request_id: 509,
            target: target("w"),
        }),
    );
    assert!(matches!(
        c.next_on(0).await,
        Frame::Group(GroupFrame::GroupOk { request_id: 509 })
    ));
    s.cover(&[
        "GroupCreate",
        "GroupOk",
        "GroupPoll",
        "GroupRecords",
        "GroupAnswer",
        "GroupAnswered",
        "DeadLetterList",
        "DeadLetterPage",
        "DeadLetterOp",
        "GroupSeek",
        "GroupDescribe",
        "GroupInfo",
        "GroupPollCancel",
        "poll-cancel-none",
        "GroupDelete",
    ]);
}

async fn caches_served(s: &mut Suite) {
    let mut c = s.ready().await;
    let k = Bytes::from_static(b"user/1");
    c.send(
        0,
        &Frame::Cache(CacheFrame::CachePut {
            request_id: 600,
            cache: kv(),
            key: k.clone(),
            value: Bytes::from_static(b"alice"),
            ttl_ms: 0,
            cond: WriteCond::Always,
        }),
    );
    let version = match c.next_on(0).await {
        Frame::Cache(CacheFrame::CacheWritten {
            request_id: 600,
            version,
            ..
        }) => version,
        other => panic!("{other:?}"),
    };
    c.send(
        0,
        &Frame::Cache(CacheFrame::CacheGet {
            request_id: 601,
            cache: kv(),
            key: k.clone(),
        }),
    );
    assert!(matches!(
        c.next_on(0).await,
        Frame::Cache(CacheFrame::CacheValue {
            request_id: 601,
            found: true,
            ..
        })
    ));
    // A key watch as the doc lays it out (its shard field present, 0), from current state,
    // asking for more than the broker's bounds: granted the bounds, reported.
    c.send(
        0,
        &Frame::Cache(CacheFrame::CacheWatch {
            request_id: 602,
            cache: kv(),
            filter: WatchFilter::Key(k.clone()),
            start: WatchStart::Current,
            queue_events_max: u32::MAX,
            queue_bytes_max: u64::MAX,
        }),
    );
    let (ws, first) = c.next_server_uni().await;
    let wid = match first {
        Frame::SubStream { subscription_id } => subscription_id,
        other => panic!("{other:?}"),
    };
    match c.next_on(0).await {
        Frame::Cache(CacheFrame::CacheWatchOk {
            request_id: 602,
            watch_id,
            queue_events_max,
            queue_bytes_max,
            ..
        }) => {
            assert_eq!(watch_id, wid);
            assert_eq!((queue_events_max, queue_bytes_max), (65_536, 64 << 20));
        }
        other => panic!("{other:?}"),
    }
    match c.next_on(ws).await {
        Frame::Cache(CacheFrame::CacheEvent {
            kind: EventKind::Retained,
            offset,
            ..
        }) => assert_eq!(offset, version),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        c.next_on(ws).await,
        Frame::Cache(CacheFrame::CacheStateDone { count: 1, .. })
    ));
    c.send(
        0,
        &Frame::Cache(CacheFrame::CacheDelete {
            request_id: 603,
            cache: kv(),
            key: k.clone(),
            cond: WriteCond::Always,
        }),
    );
    assert!(matches!(
        c.next_on(0).await,
        Frame::Cache(CacheFrame::CacheValue {
            request_id: 603,
            ..
        })
    ));
    assert!(matches!(
        c.next_on(ws).await,
        Frame::Cache(CacheFrame::CacheEvent {
            kind: EventKind::Delete,
            ..
        })
    ));
    c.send(
        0,
        &Frame::Unsubscribe {
            request_id: 604,
            subscription_id: wid,
        },
    );
    assert!(matches!(
        c.next_on(ws).await,
        Frame::Cache(CacheFrame::CacheWatchEnd { code: 0, .. })
    ));
    for (rid, f) in [
        (
            605,
            CacheFrame::CounterAdd {
                request_id: 605,
                cache: kv(),
                name: Bytes::from_static(b"hits"),
                delta: 3,
            },
        ),
        (
            606,
            CacheFrame::CounterGet {
                request_id: 606,
                cache: kv(),
                name: Bytes::from_static(b"hits"),
            },
        ),
    ] {
        c.send(0, &Frame::Cache(f));
        match c.next_on(0).await {
            Frame::Cache(CacheFrame::CounterValue {
                request_id, sum, ..
            }) => assert_eq!((request_id, sum), (rid, 3)),
            other => panic!("{other:?}"),
        }
    }
    c.send(
        0,
        &Frame::Cache(CacheFrame::DescribeCache {
            request_id: 607,
            cache: kv(),
        }),
    );
    assert!(matches!(
        c.next_on(0).await,
        Frame::Cache(CacheFrame::CacheInfo {
            request_id: 607,
            shards: 4,
            ..
        })
    ));
    s.cover(&[
        "CachePut",
        "CacheWritten",
        "CacheGet",
        "CacheValue",
        "CacheWatch",
        "CacheWatchOk",
        "CacheEvent",
        "CacheStateDone",
        "CacheDelete",
        "CacheWatchEnd",
        "CounterAdd",
        "CounterGet",
        "CounterValue",
        "DescribeCache",
        "CacheInfo",
    ]);
}

/// A client asking for the watch mux: two watches of one key on one stream, with no
/// `SubStream`; the state phase of each, then one frame naming both per change, then the end of
/// the one unwatched.
async fn watch_mux_served(s: &mut Suite) {
    let mut c = s.conn().await;
    match c
        .hello_with(Frame::Hello {
            features: features::ALL,
            max_frame_bytes: FRAME_MAX as u32,
            client: "raw-mux".into(),
        })
        .await
    {
        Frame::HelloOk { features: f, .. } => assert_ne!(f & features::WATCH_MUX, 0),
        other => panic!("{other:?}"),
    }
    let k = Bytes::from_static(b"mux/1");
    let put = |rid: u64, v: &'static [u8]| {
        Frame::Cache(CacheFrame::CachePut {
            request_id: rid,
            cache: kv(),
            key: k.clone(),
            value: Bytes::from_static(v),
            ttl_ms: 0,
            cond: WriteCond::Always,
        })
    };
    c.send(0, &put(700, b"a"));
    assert!(matches!(
        c.next_on(0).await,
        Frame::Cache(CacheFrame::CacheWritten { .. })
    ));
    let mut wids = Vec::new();
    let mut mux_stream = None;
    for rid in [701, 702] {
        c.send(
            0,
            &Frame::Cache(CacheFrame::CacheWatch {
                request_id: rid,
                cache: kv(),
                filter: WatchFilter::Key(k.clone()),
                start: WatchStart::Current,
                queue_events_max: 0,
                queue_bytes_max: 0,
            }),
        );
        let wid = match c.next_on(0).await {
            Frame::Cache(CacheFrame::CacheWatchOk {
                request_id,
                watch_id,
                ..
            }) if request_id == rid => watch_id,
            other => panic!("{other:?}"),
        };
        // Only the first watch opens the stream; its first frame is already a CacheMux.
        let (ms, first) = match mux_stream {
            None => c.next_server_uni().await,
            Some(ms) => (ms, c.next_on(ms).await),
        };
        mux_stream = Some(ms);
        match first {
            Frame::Cache(CacheFrame::CacheMux { watch_ids, frame }) => {
                assert_eq!(watch_ids, vec![wid]);
                assert!(matches!(
                    *frame,
                    CacheFrame::CacheEvent {
                        kind: EventKind::Retained,
                        ..
                    }
                ));
            }
            other => panic!("{other:?}"),
        }
        match c.next_on(ms).await {
            Frame::Cache(CacheFrame::CacheMux { watch_ids, frame }) => {
                assert_eq!(watch_ids, vec![wid]);
                assert!(matches!(
                    *frame,
                    CacheFrame::CacheStateDone { count: 1, .. }
                ));
            }
            other => panic!("{other:?}"),
        }
        wids.push(wid);
    }
    let ms = mux_stream.unwrap();
    c.send(0, &put(703, b"b"));
    let version = match c.next_on(0).await {
        Frame::Cache(CacheFrame::CacheWritten { version, .. }) => version,
        other => panic!("{other:?}"),
    };
    match c.next_on(ms).await {
        Frame::Cache(CacheFrame::CacheMux {
            mut watch_ids,
            frame,
        }) => {
            watch_ids.sort();
            assert_eq!(watch_ids, wids, "one frame names both watches");
            assert!(matches!(
                *frame,
                CacheFrame::CacheEvent { kind: EventKind::Put, offset, .. } if offset == version
            ));
        }
        other => panic!("{other:?}"),
    }
    c.send(
        0,
        &Frame::Unsubscribe {
            request_id: 704,
            subscription_id: wids[0],
        },
    );
    match c.next_on(ms).await {
        Frame::Cache(CacheFrame::CacheMux { watch_ids, frame }) => {
            assert_eq!(watch_ids, vec![wids[0]]);
            assert!(matches!(
                *frame,
                CacheFrame::CacheWatchEnd { code: 0, resume_from, .. } if resume_from == version + 1
            ));
        }
        other => panic!("{other:?}"),
    }
    c.assert_no_bad();
    s.cover(&["CacheMux"]);
}

/// The subscription mux: asked for, every drop_new subscription of the connection is
/// delivered on one stream opened silently with the first; a record for two of them is one
/// `SubMux` naming both; a Block subscription keeps a stream of its own; an unsubscribe is
/// answered with a wrapped `SubEnd`.
async fn sub_mux_served(s: &mut Suite) {
    let mut c = s.conn().await;
    match c
        .hello_with(Frame::Hello {
            features: features::ALL & !features::WATCH_MUX,
            max_frame_bytes: FRAME_MAX as u32,
            client: "raw-sub-mux".into(),
        })
        .await
    {
        Frame::HelloOk { features: f, .. } => assert_ne!(f & features::SUB_MUX, 0),
        other => panic!("{other:?}"),
    }
    let mut sids = Vec::new();
    for rid in [801, 802] {
        c.send(0, &subscribe(rid, 2, StartAt::Latest, 0, 0));
        match c.next_on(0).await {
            Frame::SubscribeOk {
                request_id,
                subscription_id,
                ..
            } if request_id == rid => sids.push(subscription_id),
            other => panic!("{other:?}"),
        }
    }
    c.send(4, &publish(803, events(), 2, true, &[b"m1"]));
    let offset = match c.next_on(4).await {
        Frame::PublishAck { first_offset, .. } => first_offset,
        other => panic!("{other:?}"),
    };
    let (ms, first) = c.next_server_uni().await;
    match first {
        Frame::SubMux {
            mut subscription_ids,
            frame,
        } => {
            subscription_ids.sort();
            assert_eq!(subscription_ids, sids, "one frame names both");
            assert!(
                matches!(*frame, Frame::Delivery { shard: 2, first_offset, .. } if first_offset == offset)
            );
        }
        other => panic!("{other:?}"),
    }
    // Block: a stream of its own, announced with SubStream.
    let mut block = subscribe(804, 2, StartAt::Latest, 0, 0);
    if let Frame::Subscribe { policy, .. } = &mut block {
        *policy = QueuePolicy::Block;
    }
    c.send(0, &block);
    let (bs, first) = c.next_server_uni().await;
    assert_ne!(bs, ms);
    assert!(matches!(first, Frame::SubStream { .. }), "{first:?}");
    assert!(matches!(c.next_on(0).await, Frame::SubscribeOk { .. }));
    c.send(
        0,
        &Frame::Unsubscribe {
            request_id: 805,
            subscription_id: sids[0],
        },
    );
    match c.next_on(ms).await {
        Frame::SubMux {
            subscription_ids,
            frame,
        } => {
            assert_eq!(subscription_ids, vec![sids[0]]);
            assert!(matches!(*frame, Frame::SubEnd { code: 0, .. }), "{frame:?}");
        }
        other => panic!("{other:?}"),
    }
    c.assert_no_bad();
    s.cover(&["SubMux"]);
}

async fn peer_max(s: &mut Suite) {
    // A peer that takes at most PEER_FLOOR-byte frames; anything larger from the broker
    // would arrive as an unreadable frame and fail `next_on`.
    let mut small = Raw::connect(s.b.quic, &s.b.ca(), PEER_FLOOR as usize, WINDOW).await;
    small.hello(PEER_FLOOR).await;
    small.send(0, &subscribe(700, 3, StartAt::Latest, 0, 0));
    let (st, _) = small.next_server_uni().await;
    let next = match small.next_on(0).await {
        Frame::SubscribeOk { next_offset, .. } => next_offset,
        other => panic!("{other:?}"),
    };
    // One batch of 4 records of 3,000 bytes (~12 KB), from another connection.
    let mut c = s.ready().await;
    let rec = vec![1u8; 3000];
    c.send(
        4,
        &publish(701, events(), 3, true, &[&rec, &rec, &rec, &rec]),
    );
    assert!(matches!(
        c.next_on(4).await,
        Frame::PublishAck { count: 4, .. }
    ));
    let mut offsets = Vec::new();
    let mut frames = 0;
    while offsets.len() < 4 {
        match small.next_on(st).await {
            Frame::Delivery {
                first_offset,
                records,
                ..
            } => {
                frames += 1;
                for (i, r) in records.iter().enumerate() {
                    assert_eq!(r.len(), 3000);
                    offsets.push(first_offset + i as u64);
                }
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(offsets, (next..next + 4).collect::<Vec<_>>());
    assert!(
        frames >= 3,
        "the batch came in pieces under the peer's maximum"
    );
    // A group answer is cut to it too: 4 claims asked, fewer per frame.
    small.send(
        0,
        &Frame::Group(GroupFrame::GroupCreate {
            request_id: 702,
            target: target("small"),
            start: StartAt::Latest,
            max_attempts: 0,
            visibility_timeout_ms: 0,
        }),
    );
    assert!(matches!(
        small.next_on(0).await,
        Frame::Group(GroupFrame::GroupOk { .. })
    ));
    c.send(
        4,
        &publish(703, orders(), 0, true, &[&rec, &rec, &rec, &rec]),
    );
    assert!(matches!(c.next_on(4).await, Frame::PublishAck { .. }));
    small.send(
        0,
        &Frame::Group(GroupFrame::GroupPoll {
            request_id: 704,
            target: target("small"),
            max: 4,
            visibility_timeout_ms: 0,
            wait_ms: 0,
        }),
    );
    match small.next_on(0).await {
        Frame::Group(GroupFrame::GroupRecords { claims, .. }) => {
            assert!(
                !claims.is_empty() && claims.len() < 4,
                "{} claims",
                claims.len()
            )
        }
        other => panic!("{other:?}"),
    }
    small.assert_no_bad();
    // On the subscription mux too: each piece, ids and all, under the peer's maximum.
    let mut mux = Raw::connect(s.b.quic, &s.b.ca(), PEER_FLOOR as usize, WINDOW).await;
    mux.hello_with(Frame::Hello {
        features: features::ALL & !features::WATCH_MUX,
        max_frame_bytes: PEER_FLOOR,
        client: "raw-small-mux".into(),
    })
    .await;
    let mut sids = Vec::new();
    for rid in [705, 706] {
        mux.send(0, &subscribe(rid, 3, StartAt::Latest, 0, 0));
        match mux.next_on(0).await {
            Frame::SubscribeOk {
                subscription_id, ..
            } => sids.push(subscription_id),
            other => panic!("{other:?}"),
        }
    }
    c.send(
        4,
        &publish(707, events(), 3, true, &[&rec, &rec, &rec, &rec]),
    );
    let first = match c.next_on(4).await {
        Frame::PublishAck { first_offset, .. } => first_offset,
        other => panic!("{other:?}"),
    };
    let (ms, mut f) = mux.next_server_uni().await;
    let mut got: std::collections::BTreeMap<u64, Vec<u64>> = Default::default();
    let mut frames = 0;
    loop {
        match f {
            Frame::SubMux {
                subscription_ids,
                frame,
            } => {
                frames += 1;
                let Frame::Delivery {
                    first_offset,
                    records,
                    ..
                } = *frame
                else {
                    panic!("{frame:?}")
                };
                for id in subscription_ids {
                    let offsets = got.entry(id).or_default();
                    offsets.extend(first_offset..first_offset + u64::from(records.count()));
                }
            }
            other => panic!("{other:?}"),
        }
        if got.values().all(|o| o.len() == 4) && got.len() == 2 {
            break;
        }
        f = mux.next_on(ms).await;
    }
    for id in &sids {
        assert_eq!(got[id], (first..first + 4).collect::<Vec<_>>());
    }
    assert!(
        frames >= 3,
        "the batch came in pieces under the peer's maximum"
    );
    mux.assert_no_bad();
    s.cover(&["peer-max"]);
}

/// Refused frames are cheap to send: a peer that sends them without reading the answers is
/// held (its stream is not read) once about 1 MiB of answers waits, and once it reads again
/// every frame is answered, none lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_refusals_hold_the_stream_they_come_from() {
    let b = Broker::start(1, &[]);
    let transport = felix_quic::tls::TransportConfig {
        max_stream_data_bidi_bytes: 64 << 10,
        ..Default::default()
    };
    let max = felix_quic::wire::DEFAULT_MAX_FRAME_BYTES;
    let mut c = Raw::connect_with(b.quic, &b.ca(), max, &transport)
        .await
        .unwrap();
    c.hello(max as u32).await;
    c.pause(4);
    // Without the hold all N would be answered at once (~4 MB queued); with it, about 1 MiB.
    const N: usize = 60_000;
    // A broker-only frame, refused each time: ~18 bytes in, an Error of ~120 bytes out.
    let one = Frame::Group(GroupFrame::GroupOk { request_id: 1 }).encode();
    let mut all = Vec::with_capacity(one.len() * N);
    for _ in 0..N {
        all.extend_from_slice(&one);
    }
    c.send_raw(4, all);
    // Bounded wait for the broker to take what it will.
    let mut sent = 0;
    for _ in 0..40 {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        sent = b.total("errors_sent");
    }
    assert!(
        sent < (N as u64) / 2,
        "{sent} refusals queued for a peer that reads none"
    );
    c.resume(4);
    for i in 0..N {
        match c.next_on(4).await {
            Frame::Error { code, .. } => assert_eq!(code, ErrorCode::InvalidRequest.number()),
            other => panic!("answer {i}: {other:?}"),
        }
    }
    assert_eq!(b.total("errors_sent"), N as u64);
}

/// A peer that grants no flow control on stream 0 cannot hold a refused connection open: the
/// close waits at most about 1 s for the Error frame, then happens anyway (with the code).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_is_not_held_open_by_a_peer_granting_no_window() {
    let b = Broker::start(1, &[]);
    let transport = felix_quic::tls::TransportConfig {
        max_stream_data_bidi_bytes: 0,
        ..Default::default()
    };
    let mut c = Raw::connect_with(b.quic, &b.ca(), FRAME_MAX, &transport)
        .await
        .unwrap();
    // A maximum below the floor: refused with code 20, the Error frame unable to leave.
    c.send(0, &hello_frame(64));
    let t = std::time::Instant::now();
    let reason = c.wait_closed().await;
    assert_eq!(close_code(&reason), 20, "{reason}");
    assert!(reason.contains("max_frame_bytes 64"), "{reason}");
    // Generous bound (the grace is 1 s; without it the connection would stay until idle).
    assert!(
        t.elapsed() < std::time::Duration::from_secs(8),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(b.total("connections_closed_hello"), 1, "closed once");
}

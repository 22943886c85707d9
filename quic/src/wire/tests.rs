use super::*;
use proptest::prelude::*;

const MAX: usize = DEFAULT_MAX_FRAME_BYTES;

fn sn() -> StreamName {
    StreamName::new("default", "default", "events")
}

/// The frames whose encodings are published as vectors in docs/protocol.md.
fn vector_frames() -> Vec<(&'static str, Frame)> {
    vec![
        (
            "hello",
            Frame::Hello {
                features: features::ALL,
                max_frame_bytes: 16 * 1024 * 1024,
                client: "felix-rs".into(),
            },
        ),
        (
            "publish_key_ack",
            Frame::Publish {
                request_id: 7,
                stream: sn(),
                shard: ShardSelector::Key(Bytes::from_static(b"user-1")),
                ack: true,
                records: Records::encode([&b"hi"[..], b"there"]),
            },
        ),
        (
            "publish_ack",
            Frame::PublishAck {
                request_id: 7,
                shard: 0,
                first_offset: 41,
                count: 2,
                owner: 0,
            },
        ),
        (
            "authenticate",
            Frame::Auth(AuthFrame::Authenticate {
                request_id: 1,
                token: "eyJ.e30.sig".into(),
            }),
        ),
        (
            "authenticated",
            Frame::Auth(AuthFrame::Authenticated {
                request_id: 1,
                subject: "alice".into(),
                tenant: "acme".into(),
                expires_at_ms: 1_800_000_000_000,
            }),
        ),
        (
            "error_unknown_stream",
            Frame::error(9, ErrorCode::UnknownStream, "no such stream"),
        ),
        (
            "subscribe",
            Frame::Subscribe {
                request_id: 3,
                stream: sn(),
                shard: 1,
                start: StartAt::Offset(100),
                policy: QueuePolicy::DropOld,
                queue_records_max: 1024,
                queue_bytes_max: 0,
            },
        ),
        (
            "delivery",
            Frame::Delivery {
                shard: 1,
                first_offset: 100,
                records: Records::encode([&b"a"[..], b"bc"]),
            },
        ),
        (
            "lag",
            Frame::Lag {
                from_offset: 100,
                lost: 5,
            },
        ),
        (
            "sub_mux_delivery",
            Frame::SubMux {
                subscription_ids: vec![3, 4],
                frame: Box::new(Frame::Delivery {
                    shard: 1,
                    first_offset: 100,
                    records: Records::encode([&b"a"[..], &b"bc"[..]]),
                }),
            },
        ),
        (
            "cache_mux_event",
            Frame::Cache(CacheFrame::CacheMux {
                watch_ids: vec![1, 2],
                frame: Box::new(CacheFrame::CacheEvent {
                    kind: super::cache::EventKind::Put,
                    offset: 5,
                    key: Bytes::from_static(b"k"),
                    expires_at_ms: 0,
                    value: Bytes::from_static(b"v"),
                }),
            }),
        ),
        (
            "cache_watch_key",
            Frame::Cache(CacheFrame::CacheWatch {
                request_id: 4,
                cache: StreamName::new("default", "default", "kv"),
                filter: WatchFilter::Key(Bytes::from_static(b"user/1")),
                start: WatchStart::Current,
                queue_events_max: 0,
                queue_bytes_max: 0,
            }),
        ),
        (
            "forward_cache_get",
            Frame::Peer(PeerFrame::Forward {
                head: ForwardHead {
                    incarnation: 12,
                    generation: 3,
                    origin_node: 2,
                    principal: String::new(),
                    frame_bytes_max: 0,
                },
                inner: Box::new(Frame::Cache(CacheFrame::CacheGet {
                    request_id: 5,
                    cache: StreamName::new("a", "b", "c"),
                    key: Bytes::from_static(b"k"),
                })),
            }),
        ),
    ]
}

#[test]
fn peer_frames_round_trip_and_a_forward_never_nests() {
    let hello = Frame::Peer(PeerFrame::PeerHello {
        node_id: 7,
        cluster_id: "c-1".into(),
        capabilities: peer::capabilities::ALL,
        max_frame_bytes: 1 << 20,
    });
    assert_eq!(decode_frame(&hello.encode(), MAX).unwrap(), hello);
    let ok = Frame::Peer(PeerFrame::PeerHelloOk {
        node_id: 8,
        cluster_id: "c-1".into(),
        capabilities: 0,
        max_frame_bytes: 1 << 20,
    });
    assert_eq!(decode_frame(&ok.encode(), MAX).unwrap(), ok);
    let publish = Frame::Publish {
        request_id: 9,
        stream: StreamName::new("t", "n", "s"),
        shard: ShardSelector::Shard(1),
        ack: true,
        records: Records::encode([&b"x"[..], &b"yz"[..]]),
    };
    let head = ForwardHead {
        incarnation: 1,
        generation: 2,
        origin_node: 3,
        principal: "p".into(),
        frame_bytes_max: 1 << 20,
    };
    let fwd = Frame::Peer(PeerFrame::Forward {
        head: head.clone(),
        inner: Box::new(publish),
    });
    let back = decode_frame(&fwd.encode(), MAX).unwrap();
    assert_eq!(back, fwd);
    if let Frame::Peer(PeerFrame::Forward { head, inner }) = &fwd {
        assert_eq!(peer::encode_forward(head, &inner.encode()), fwd.encode());
    }
    assert_eq!(back.request_id(), Some(9), "answered under the inner id");
    // A forward inside a forward is refused by the decoder.
    let nested = Frame::Peer(PeerFrame::Forward {
        head,
        inner: Box::new(fwd),
    });
    assert!(matches!(
        decode_frame(&nested.encode(), MAX),
        Err(WireError::InvalidValue {
            field: "inner_kind",
            ..
        })
    ));
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn an_authenticate_over_the_token_maximum_is_refused() {
    let f = Frame::Auth(AuthFrame::Authenticate {
        request_id: 1,
        token: "x".repeat(auth::TOKEN_BYTES_MAX + 1),
    });
    assert!(matches!(
        decode_frame(&f.encode(), MAX),
        Err(WireError::InvalidValue {
            field: "token_len",
            ..
        })
    ));
}

#[test]
fn protocol_doc_vectors_decode() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/protocol.md"))
        .expect("docs/protocol.md exists");
    let mut found = std::collections::HashMap::new();
    for line in doc.lines() {
        let line = line.trim().trim_matches('`');
        if let Some(rest) = line.strip_prefix("vector ") {
            let (name, h) = rest.split_once(':').expect("vector line has a colon");
            found.insert(name.trim().to_string(), unhex(h));
        }
    }
    for (name, frame) in vector_frames() {
        // A failure names the line the doc should carry, so regenerating the table is copy-paste.
        let want = format!("vector {name}: {}", hex(&frame.encode()));
        let bytes = found
            .get(name)
            .unwrap_or_else(|| panic!("missing from docs/protocol.md: {want}"));
        assert_eq!(
            decode_frame(bytes, MAX).unwrap(),
            frame,
            "vector {name} decodes"
        );
        assert_eq!(
            &frame.encode()[..],
            &bytes[..],
            "vector {name} re-encodes; doc should say {want}"
        );
    }
}

#[test]
fn delivery_head_plus_region_is_the_frame() {
    let records = Records::encode([&b"x"[..], b"", b"yz"]);
    let f = Frame::Delivery {
        shard: 2,
        first_offset: 9,
        records: records.clone(),
    };
    let mut joined = encode_delivery_head(2, 9, &records).to_vec();
    joined.extend_from_slice(records.region());
    assert_eq!(&f.encode()[..], &joined[..]);
}

#[test]
fn oversized_frame_rejected_from_header_alone() {
    let mut r = FrameReader::new(1024);
    let mut h = Vec::from(&MAGIC[..]);
    // A kind without a request id is refused from the header alone.
    h.extend_from_slice(&[VERSION, kind::LAG, 0, 0]);
    h.extend_from_slice(&(2000u32).to_le_bytes());
    r.push(&h);
    assert!(matches!(
        r.next_frame(),
        Err(FrameError {
            error: WireError::FrameTooLarge { .. },
            request_id: None,
            fatal: false,
            ..
        })
    ));
    assert_eq!(
        WireError::FrameTooLarge { len: 1, max: 0 }.code(),
        ErrorCode::FrameTooLarge
    );
}

#[test]
fn bad_magic_and_version_are_typed() {
    let mut f = Frame::Lag {
        from_offset: 1,
        lost: 1,
    }
    .encode()
    .to_vec();
    f[0] = b'X';
    assert!(matches!(decode_frame(&f, MAX), Err(WireError::BadMagic(_))));
    let mut f = Frame::Lag {
        from_offset: 1,
        lost: 1,
    }
    .encode()
    .to_vec();
    f[2] = 9;
    assert_eq!(decode_frame(&f, MAX), Err(WireError::UnsupportedVersion(9)));
}

#[test]
fn newer_peer_trailing_fields_and_kinds_are_tolerated() {
    // A newer peer appends a field to PublishAck: the old decoder ignores it.
    let f = Frame::PublishAck {
        request_id: 1,
        shard: 2,
        first_offset: 3,
        count: 4,
        owner: 0,
    };
    let mut bytes = f.encode().to_vec();
    bytes.extend_from_slice(&[0xAA, 0xBB]);
    let len = (bytes.len() - HEADER_LEN) as u32;
    bytes[6..10].copy_from_slice(&len.to_le_bytes());
    assert_eq!(decode_frame(&bytes, MAX).unwrap(), f);
    // An unknown kind decodes as Unknown and round-trips.
    let u = Frame::Unknown {
        kind: 200,
        flags: 1,
        body: Bytes::from_static(b"future"),
    };
    assert_eq!(decode_frame(&u.encode(), MAX).unwrap(), u);
}

#[test]
fn records_region_validation() {
    assert!(Records::from_region(1, Bytes::from_static(&[5, 0, 0, 0, 1])).is_err());
    assert!(Records::from_region(0, Bytes::from_static(&[0])).is_err());
    assert!(Records::from_region(2, Bytes::from_static(&[0, 0, 0, 0])).is_err());
    let r = Records::from_region(2, Bytes::from_static(&[0, 0, 0, 0, 1, 0, 0, 0, 9])).unwrap();
    assert_eq!(
        r.iter().collect::<Vec<_>>(),
        vec![Bytes::new(), Bytes::from_static(&[9])]
    );
    assert_eq!(r.payload_bytes(), 1);
}

#[test]
fn names_validate() {
    assert!(validate_name("default").is_ok());
    assert!(validate_name("a.b-c_D9").is_ok());
    for bad in ["", ".hidden", "a/b", "a b", "é", &"x".repeat(65)] {
        assert!(validate_name(bad).is_err(), "{bad:?} must be refused");
    }
}

fn arb_name() -> impl Strategy<Value = String> {
    "[a-z0-9._-]{0,12}"
}

fn arb_stream() -> impl Strategy<Value = StreamName> {
    (arb_name(), arb_name(), arb_name()).prop_map(|(t, n, s)| StreamName {
        tenant: t,
        namespace: n,
        stream: s,
    })
}

fn arb_records() -> impl Strategy<Value = Records> {
    prop::collection::vec(prop::collection::vec(any::<u8>(), 0..40), 0..6).prop_map(Records::encode)
}

fn arb_frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        (any::<u64>(), any::<u32>(), arb_name()).prop_map(|(features, max_frame_bytes, client)| {
            Frame::Hello {
                features,
                max_frame_bytes,
                client,
            }
        }),
        (
            any::<u64>(),
            any::<(u32, u32, u32, u32)>(),
            any::<u16>(),
            arb_name()
        )
            .prop_map(|(features, l, core, server)| {
                Frame::HelloOk {
                    features,
                    limits: Limits {
                        max_frame_bytes: l.0,
                        max_payload_bytes: l.1,
                        max_subscriptions: l.2,
                        max_key_bytes: l.3,
                    },
                    core,
                    server,
                }
            }),
        (
            any::<u64>(),
            arb_stream(),
            prop_oneof![
                Just(ShardSelector::RoundRobin),
                any::<u32>().prop_map(ShardSelector::Shard),
                prop::collection::vec(any::<u8>(), 0..20)
                    .prop_map(|k| ShardSelector::Key(Bytes::from(k)))
            ],
            any::<bool>(),
            arb_records()
        )
            .prop_map(|(request_id, stream, shard, ack, records)| Frame::Publish {
                request_id,
                stream,
                shard,
                ack,
                records
            }),
        any::<(u64, u32, u64, u32, u64)>().prop_map(|(a, b, c, d, e)| Frame::PublishAck {
            request_id: a,
            shard: b,
            first_offset: c,
            count: d,
            owner: e,
        }),
        (any::<u64>(), any::<u16>(), ".{0,20}").prop_map(|(request_id, code, message)| {
            Frame::Error {
                request_id,
                code,
                message,
            }
        }),
        (
            any::<u64>(),
            arb_stream(),
            any::<u32>(),
            prop_oneof![
                Just(StartAt::Latest),
                Just(StartAt::Earliest),
                any::<u64>().prop_map(StartAt::Offset)
            ],
            prop_oneof![
                Just(QueuePolicy::DropNew),
                Just(QueuePolicy::DropOld),
                Just(QueuePolicy::Block)
            ],
            any::<u32>(),
            any::<u64>()
        )
            .prop_map(|(request_id, stream, shard, start, policy, r, b)| {
                Frame::Subscribe {
                    request_id,
                    stream,
                    shard,
                    start,
                    policy,
                    queue_records_max: r,
                    queue_bytes_max: b,
                }
            }),
        any::<(u64, u64, u32, u64, u32, u64)>().prop_map(|(a, b, c, d, e, f)| Frame::SubscribeOk {
            request_id: a,
            subscription_id: b,
            shard: c,
            next_offset: d,
            queue_records_max: e,
            queue_bytes_max: f,
        }),
        any::<u64>().prop_map(|s| Frame::SubStream { subscription_id: s }),
        (any::<u32>(), any::<u64>(), arb_records()).prop_map(|(shard, first_offset, records)| {
            Frame::Delivery {
                shard,
                first_offset,
                records,
            }
        }),
        any::<(u64, u64)>().prop_map(|(a, b)| Frame::Lag {
            from_offset: a,
            lost: b
        }),
        any::<(u64, u64)>().prop_map(|(a, b)| Frame::Unsubscribe {
            request_id: a,
            subscription_id: b
        }),
        (any::<u64>(), any::<u16>(), ".{0,20}").prop_map(|(s, c, m)| Frame::SubEnd {
            subscription_id: s,
            code: c,
            message: m
        }),
        (any::<u64>(), arb_stream())
            .prop_map(|(request_id, stream)| Frame::DescribeStream { request_id, stream }),
        (
            any::<u64>(),
            any::<u32>(),
            any::<bool>(),
            proptest::collection::vec(any::<u64>(), 0..5)
        )
            .prop_map(|(request_id, shards, durable, owners)| {
                Frame::StreamInfo {
                    request_id,
                    shards,
                    durable,
                    owners,
                }
            }),
        any::<u64>().prop_map(|request_id| Frame::DescribeCluster { request_id }),
        (
            any::<u64>(),
            any::<u64>(),
            proptest::collection::vec((any::<u64>(), "[a-z0-9.:]{0,20}"), 0..4)
        )
            .prop_map(|(request_id, node_id, brokers)| Frame::ClusterInfo {
                request_id,
                node_id,
                brokers,
            }),
        arb_group_frame().prop_map(Frame::Group),
        arb_cache_frame().prop_map(Frame::Cache),
        arb_cache_mux().prop_map(Frame::Cache),
        (any::<u64>(), "[A-Za-z0-9._-]{0,200}").prop_map(|(request_id, token)| Frame::Auth(
            AuthFrame::Authenticate { request_id, token }
        )),
        (any::<u64>(), arb_name(), arb_name(), any::<u64>()).prop_map(
            |(request_id, subject, tenant, expires_at_ms)| Frame::Auth(AuthFrame::Authenticated {
                request_id,
                subject,
                tenant,
                expires_at_ms,
            })
        ),
        (
            100u8..=255,
            any::<u16>(),
            prop::collection::vec(any::<u8>(), 0..30)
        )
            .prop_map(|(kind, flags, b)| Frame::Unknown {
                kind,
                flags,
                body: Bytes::from(b)
            }),
    ]
}

proptest! {
    #[test]
    fn every_frame_round_trips(f in arb_frame()) {
        let bytes = f.encode();
        prop_assert_eq!(decode_frame(&bytes, MAX).unwrap(), f);
    }

    /// What `send_frame` queues (head, then the shared records) is exactly the encoding.
    #[test]
    fn parts_concatenate_to_the_encoding(f in arb_frame()) {
        let (head, rest) = f.encode_parts();
        let mut joined = head.to_vec();
        if let Some(r) = &rest {
            prop_assert!(!r.is_empty());
            joined.extend_from_slice(r);
        }
        prop_assert_eq!(&joined[..], &f.encode()[..]);
    }

    #[test]
    fn reader_reassembles_any_chunking(frames in prop::collection::vec(arb_frame(), 1..5), cut in 1usize..17) {
        let mut all = Vec::new();
        for f in &frames { all.extend_from_slice(&f.encode()); }
        let mut r = FrameReader::new(MAX);
        let mut out = Vec::new();
        for chunk in all.chunks(cut) {
            r.push(chunk);
            while let Some(f) = r.next_frame().unwrap() { out.push(f); }
        }
        prop_assert_eq!(out, frames);
        prop_assert_eq!(r.buffered(), 0);
    }

    /// Hostile input: random bytes never panic, in one piece or streamed.
    #[test]
    fn hostile_bytes_never_panic(data in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = decode_frame(&data, MAX);
        let mut r = FrameReader::new(4096);
        r.push(&data);
        while let Ok(Some(_)) = r.next_frame() {}
    }

    /// Hostile input with a valid header: random bodies for every known kind never panic.
    #[test]
    fn hostile_bodies_never_panic(k in 0u8..40, body in prop::collection::vec(any::<u8>(), 0..120)) {
        let _ = decode_body(k, 0, Bytes::from(body));
    }

    /// Corrupting any single byte of a valid frame gives a frame or a typed error, never a panic.
    #[test]
    fn mutated_frames_never_panic(f in arb_frame(), pos in any::<prop::sample::Index>(), val in any::<u8>()) {
        let mut b = f.encode().to_vec();
        let i = pos.index(b.len());
        b[i] = val;
        let _ = decode_frame(&b, MAX);
    }
}

fn arb_target() -> impl Strategy<Value = GroupRef> {
    (arb_stream(), arb_name(), any::<u32>()).prop_map(|(stream, group, shard)| GroupRef {
        stream,
        group,
        shard,
    })
}

fn arb_start() -> impl Strategy<Value = StartAt> {
    prop_oneof![
        Just(StartAt::Latest),
        Just(StartAt::Earliest),
        any::<u64>().prop_map(StartAt::Offset),
    ]
}

fn arb_claims() -> impl Strategy<Value = Vec<ClaimRef>> {
    prop::collection::vec(
        (any::<u64>(), any::<u32>()).prop_map(|(offset, attempt)| ClaimRef { offset, attempt }),
        0..6,
    )
}

fn arb_group_frame() -> impl Strategy<Value = GroupFrame> {
    use GroupFrame::*;
    let rid = any::<u64>();
    prop_oneof![
        (rid, arb_target(), arb_start(), any::<u32>(), any::<u64>()).prop_map(
            |(request_id, target, start, max_attempts, visibility_timeout_ms)| GroupCreate {
                request_id,
                target,
                start,
                max_attempts,
                visibility_timeout_ms
            }
        ),
        (rid, arb_target()).prop_map(|(request_id, target)| GroupDelete { request_id, target }),
        (rid, arb_target()).prop_map(|(request_id, target)| GroupDescribe { request_id, target }),
        (rid, arb_target()).prop_map(|(request_id, target)| GroupPollCancel { request_id, target }),
        (rid, any::<u32>(), any::<[u64; 7]>(), any::<u32>()).prop_map(
            |(request_id, shard, v, m)| {
                GroupInfo {
                    request_id,
                    shard,
                    info: super::GroupInfo {
                        cursor: v[0],
                        tail: v[1],
                        in_flight: v[2],
                        waiting: v[3],
                        parked: v[4],
                        dead_letters: v[5],
                        max_attempts: m,
                        visibility_timeout_ms: v[6],
                    },
                }
            }
        ),
        (rid, arb_target(), any::<u32>(), any::<u64>(), any::<u64>()).prop_map(
            |(request_id, target, max, visibility_timeout_ms, wait_ms)| GroupPoll {
                request_id,
                target,
                max,
                visibility_timeout_ms,
                wait_ms
            }
        ),
        (rid, any::<u32>(), any::<u64>(), arb_claims()).prop_map(
            |(request_id, shard, visibility_timeout_ms, claims)| {
                let records = Records::encode(claims.iter().map(|c| c.offset.to_le_bytes()));
                GroupRecords {
                    request_id,
                    shard,
                    visibility_timeout_ms,
                    claims,
                    records,
                }
            }
        ),
        (
            rid,
            arb_target(),
            prop_oneof![
                Just(AnswerOp::Ack),
                any::<u64>().prop_map(|delay_ms| AnswerOp::Nack { delay_ms }),
                any::<u64>().prop_map(|v| AnswerOp::Extend {
                    visibility_timeout_ms: v
                }),
                Just(AnswerOp::Reject),
            ],
            arb_claims()
        )
            .prop_map(|(request_id, target, op, claims)| GroupAnswer {
                request_id,
                target,
                op,
                claims
            }),
        (rid, prop::collection::vec(any::<u16>(), 0..8))
            .prop_map(|(request_id, codes)| GroupAnswered { request_id, codes }),
        (rid, arb_target(), arb_start()).prop_map(|(request_id, target, to)| GroupSeek {
            request_id,
            target,
            to
        }),
        (
            rid,
            arb_target(),
            proptest::option::of(any::<u64>()),
            any::<u32>()
        )
            .prop_map(|(request_id, target, after, limit)| DeadLetterList {
                request_id,
                target,
                after,
                limit
            }),
        (
            rid,
            prop::collection::vec(
                (any::<u64>(), any::<u32>(), 0u8..3, any::<bool>()).prop_map(
                    |(offset, attempts, reason, redriving)| DeadLetterRef {
                        offset,
                        attempts,
                        reason,
                        redriving
                    }
                ),
                0..5
            ),
            proptest::option::of(any::<u64>())
        )
            .prop_map(|(request_id, letters, next_after)| DeadLetterPage {
                request_id,
                letters,
                next_after
            }),
        (
            rid,
            arb_target(),
            prop_oneof![
                Just(DeadLetterAction::Redrive),
                Just(DeadLetterAction::Discard)
            ],
            any::<u64>()
        )
            .prop_map(|(request_id, target, action, offset)| DeadLetterOp {
                request_id,
                target,
                action,
                offset
            }),
        rid.prop_map(|request_id| GroupOk { request_id }),
    ]
}

#[test]
fn group_records_need_one_payload_per_claim() {
    let f = Frame::Group(GroupFrame::GroupRecords {
        request_id: 1,
        shard: 0,
        visibility_timeout_ms: 10,
        claims: vec![ClaimRef {
            offset: 4,
            attempt: 1,
        }],
        records: Records::encode([&b"a"[..], b"b"]),
    });
    assert!(matches!(
        decode_frame(&f.encode(), MAX),
        Err(WireError::InvalidRecords(_))
    ));
}

#[test]
fn a_hostile_claim_count_is_refused_without_allocating() {
    let f = Frame::Group(GroupFrame::GroupAnswered {
        request_id: 1,
        codes: vec![0],
    });
    let mut b = f.encode().to_vec();
    // The count sits right after the request id: claim four billion codes.
    b[HEADER_LEN + 8..HEADER_LEN + 12].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        decode_frame(&b, MAX),
        Err(WireError::Truncated { .. })
    ));
}

fn arb_bytes(max: usize) -> impl Strategy<Value = Bytes> {
    prop::collection::vec(any::<u8>(), 0..max).prop_map(Bytes::from)
}

fn arb_cond() -> impl Strategy<Value = super::WriteCond> {
    use super::WriteCond;
    prop_oneof![
        Just(WriteCond::Always),
        Just(WriteCond::Absent),
        any::<u64>().prop_map(WriteCond::Version),
    ]
}

fn arb_cache_frame() -> impl Strategy<Value = super::CacheFrame> {
    use super::cache::{CacheFrame::*, EventKind, WatchFilter, WatchStart};
    let rid = any::<u64>();
    let filter = prop_oneof![
        arb_bytes(20).prop_map(WatchFilter::Key),
        (arb_bytes(20), any::<u32>())
            .prop_map(|(prefix, shard)| WatchFilter::Prefix { prefix, shard }),
    ];
    let start = prop_oneof![
        Just(WatchStart::Latest),
        Just(WatchStart::Current),
        any::<u64>().prop_map(WatchStart::Offset),
    ];
    let ek = prop_oneof![
        Just(EventKind::Retained),
        Just(EventKind::Put),
        Just(EventKind::Delete),
        Just(EventKind::Expire),
    ];
    prop_oneof![
        (
            rid,
            arb_stream(),
            arb_bytes(20),
            arb_bytes(40),
            any::<u64>(),
            arb_cond()
        )
            .prop_map(|(request_id, cache, key, value, ttl_ms, cond)| CachePut {
                request_id,
                cache,
                key,
                value,
                ttl_ms,
                cond
            }),
        (rid, arb_stream(), arb_bytes(20)).prop_map(|(request_id, cache, key)| CacheGet {
            request_id,
            cache,
            key
        }),
        (rid, arb_stream(), arb_bytes(20), arb_cond()).prop_map(
            |(request_id, cache, key, cond)| CacheDelete {
                request_id,
                cache,
                key,
                cond
            }
        ),
        (
            rid,
            any::<u32>(),
            any::<bool>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            arb_bytes(40)
        )
            .prop_map(
                |(request_id, shard, found, version, change_offset, expires_at_ms, value)| {
                    CacheValue {
                        request_id,
                        shard,
                        found,
                        version,
                        change_offset,
                        expires_at_ms,
                        value,
                    }
                }
            ),
        (rid, any::<u32>(), any::<u64>(), any::<u64>()).prop_map(
            |(request_id, shard, version, expires_at_ms)| CacheWritten {
                request_id,
                shard,
                version,
                expires_at_ms
            }
        ),
        (rid, arb_stream(), filter, start, any::<u32>(), any::<u64>()).prop_map(
            |(request_id, cache, filter, start, queue_events_max, queue_bytes_max)| CacheWatch {
                request_id,
                cache,
                filter,
                start,
                queue_events_max,
                queue_bytes_max
            }
        ),
        (
            rid,
            any::<u64>(),
            any::<u32>(),
            any::<u64>(),
            any::<(u32, u64)>()
        )
            .prop_map(
                |(request_id, watch_id, shard, live_from, (queue_events_max, queue_bytes_max))| {
                    CacheWatchOk {
                        request_id,
                        watch_id,
                        shard,
                        live_from,
                        queue_events_max,
                        queue_bytes_max,
                    }
                }
            ),
        (ek, any::<u64>(), arb_bytes(20), any::<u64>(), arb_bytes(40)).prop_map(
            |(kind, offset, key, expires_at_ms, value)| CacheEvent {
                kind,
                offset,
                key,
                expires_at_ms,
                value
            }
        ),
        (any::<u64>(), any::<bool>(), any::<u64>()).prop_map(|(count, snapshot, live_from)| {
            CacheStateDone {
                count,
                snapshot,
                live_from,
            }
        }),
        (any::<u16>(), any::<u64>(), "[a-z ]{0,20}").prop_map(|(code, resume_from, message)| {
            CacheWatchEnd {
                code,
                resume_from,
                message,
            }
        }),
        (rid, arb_stream(), arb_bytes(20), any::<i64>()).prop_map(
            |(request_id, cache, name, delta)| CounterAdd {
                request_id,
                cache,
                name,
                delta
            }
        ),
        (rid, arb_stream(), arb_bytes(20)).prop_map(|(request_id, cache, name)| CounterGet {
            request_id,
            cache,
            name
        }),
        (rid, any::<u32>(), any::<i64>(), any::<u64>()).prop_map(
            |(request_id, shard, sum, offset)| CounterValue {
                request_id,
                shard,
                sum,
                offset
            }
        ),
        (rid, arb_stream()).prop_map(|(request_id, cache)| DescribeCache { request_id, cache }),
        (
            rid,
            any::<u32>(),
            any::<bool>(),
            any::<u64>(),
            proptest::collection::vec(any::<u64>(), 0..4)
        )
            .prop_map(
                |(request_id, shards, durable, default_ttl_ms, owners)| CacheInfo {
                    request_id,
                    shards,
                    durable,
                    default_ttl_ms,
                    owners,
                }
            ),
    ]
}

/// A `CacheMux` around any watch-stream frame, naming 1..40 distinct watch ids.
fn arb_cache_mux() -> impl Strategy<Value = super::CacheFrame> {
    use super::cache::CacheFrame;
    let inner = arb_cache_frame().prop_filter("a watch-stream frame", |f| {
        matches!(
            f,
            CacheFrame::CacheEvent { .. }
                | CacheFrame::CacheStateDone { .. }
                | CacheFrame::CacheWatchEnd { .. }
        )
    });
    (proptest::collection::btree_set(any::<u64>(), 1..40), inner).prop_map(|(ids, f)| {
        CacheFrame::CacheMux {
            watch_ids: ids.into_iter().collect(),
            frame: Box::new(f),
        }
    })
}

#[test]
fn mux_head_and_shared_event_bytes_equal_the_frame_encoding() {
    use super::cache::{encode_event, encode_mux_head, CacheFrame, EventKind};
    let ev = encode_event(
        EventKind::Put,
        7,
        Bytes::from_static(b"k"),
        0,
        Bytes::from_static(b"v"),
    );
    let head = encode_mux_head(&[3, 1, 2], &ev);
    let mut whole = head.to_vec();
    whole.extend_from_slice(&ev[HEADER_LEN..]);
    let f = Frame::Cache(CacheFrame::CacheMux {
        watch_ids: vec![3, 1, 2],
        frame: Box::new(CacheFrame::CacheEvent {
            kind: EventKind::Put,
            offset: 7,
            key: Bytes::from_static(b"k"),
            expires_at_ms: 0,
            value: Bytes::from_static(b"v"),
        }),
    });
    assert_eq!(whole, f.encode().to_vec());
    assert_eq!(decode_frame(&whole, MAX).unwrap(), f);
}

#[test]
fn a_mux_frame_naming_no_watch_a_watch_twice_or_wrapping_a_request_is_refused() {
    use super::cache::kind;
    let body = |count: u32, ids: &[u64], inner: u8| {
        let mut b = count.to_le_bytes().to_vec();
        for id in ids {
            b.extend_from_slice(&id.to_le_bytes());
        }
        b.push(inner);
        // a CacheStateDone body: count u64, snapshot u8, live_from u64
        b.extend_from_slice(&[0u8; 17]);
        Bytes::from(b)
    };
    let field = |b: Bytes| match decode_body(kind::CACHE_MUX, 0, b) {
        Err(WireError::InvalidValue { field, .. }) => field,
        other => panic!("expected a refusal, got {other:?}"),
    };
    assert_eq!(field(body(0, &[], kind::CACHE_STATE_DONE)), "watch_count");
    assert_eq!(field(body(2, &[5, 5], kind::CACHE_STATE_DONE)), "watch_ids");
    assert_eq!(field(body(1, &[5], kind::CACHE_PUT)), "inner_kind");
    // A count past the bytes present is truncated, not allocated.
    assert!(matches!(
        decode_body(
            kind::CACHE_MUX,
            0,
            body(u32::MAX, &[5], kind::CACHE_STATE_DONE)
        ),
        Err(WireError::Truncated { .. })
    ));
    assert!(decode_body(kind::CACHE_MUX, 0, body(1, &[5], kind::CACHE_STATE_DONE)).is_ok());
}

#[test]
fn shared_event_bytes_equal_the_frame_encoding() {
    use super::cache::{encode_event, CacheFrame, EventKind};
    let f = Frame::Cache(CacheFrame::CacheEvent {
        kind: EventKind::Put,
        offset: 7,
        key: Bytes::from_static(b"k"),
        expires_at_ms: 9,
        value: Bytes::from_static(b"v"),
    });
    let b = encode_event(
        EventKind::Put,
        7,
        Bytes::from_static(b"k"),
        9,
        Bytes::from_static(b"v"),
    );
    assert_eq!(b, f.encode());
    assert_eq!(decode_frame(&b, MAX).unwrap(), f);
}

// ---------- the stream reader: what survives a bad frame ----------

fn publish_bytes(rid: u64, region_ok: bool) -> Vec<u8> {
    let f = Frame::Publish {
        request_id: rid,
        stream: sn(),
        shard: ShardSelector::Shard(1),
        ack: true,
        records: Records::encode([&b"abc"[..]]),
    };
    let mut b = f.encode().to_vec();
    if !region_ok {
        // The record count says 2 while the region holds one record.
        let at = b.len() - 7 - 8;
        b[at] = 2;
    }
    b
}

#[test]
fn a_body_that_does_not_decode_is_skipped_with_its_request_id() {
    let mut r = FrameReader::new(MAX);
    r.push(&publish_bytes(42, false));
    r.push(&publish_bytes(43, true));
    let e = r.next_frame().unwrap_err();
    assert_eq!(e.request_id, Some(42));
    assert_eq!(e.kind, Some(kind::PUBLISH));
    assert!(!e.fatal);
    assert_eq!(e.error.code(), ErrorCode::InvalidFrame);
    match r.next_frame().unwrap() {
        Some(Frame::Publish { request_id, .. }) => assert_eq!(request_id, 43, "the stream goes on"),
        other => panic!("{other:?}"),
    }
    assert_eq!(r.next_frame().unwrap(), None);
}

#[test]
fn a_selector_out_of_range_keeps_the_request_id() {
    let mut b = publish_bytes(42, true);
    // The selector byte follows request_id (8) and three names (2 + 7, 2 + 7, 2 + 6).
    let at = HEADER_LEN + 8 + 9 + 9 + 8;
    assert_eq!(b[at], 1, "selector 'shard'");
    b[at] = 7;
    let mut r = FrameReader::new(MAX);
    r.push(&b);
    let e = r.next_frame().unwrap_err();
    assert_eq!((e.request_id, e.fatal), (Some(42), false));
}

#[test]
fn an_oversized_frame_is_refused_at_once_and_discarded_as_it_arrives() {
    let max = 4096;
    let big = Frame::Publish {
        request_id: 9,
        stream: sn(),
        shard: ShardSelector::RoundRobin,
        ack: true,
        records: Records::encode([vec![7u8; 10_000]]),
    }
    .encode();
    let mut r = FrameReader::new(max);
    // Header alone: the request id is not in yet, so nothing is said.
    r.push(&big[..HEADER_LEN]);
    assert_eq!(r.next_frame().unwrap(), None);
    r.push(&big[HEADER_LEN..HEADER_LEN + 100]);
    let e = r.next_frame().unwrap_err();
    assert_eq!(e.error.code(), ErrorCode::FrameTooLarge);
    assert_eq!((e.request_id, e.fatal), (Some(9), false));
    // The rest of the body is discarded, never buffered.
    for chunk in big[HEADER_LEN + 100..].chunks(1000) {
        r.push(chunk);
        assert_eq!(r.buffered(), 0);
        assert_eq!(r.next_frame().unwrap(), None);
    }
    r.push(&publish_bytes(10, true));
    match r.next_frame().unwrap() {
        Some(Frame::Publish { request_id, .. }) => assert_eq!(request_id, 10),
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_magic_and_version_lose_the_framing() {
    for (at, v) in [(0usize, b'Z'), (2, 2u8)] {
        let mut b = publish_bytes(1, true);
        b[at] = v;
        let mut r = FrameReader::new(MAX);
        r.push(&b);
        let e = r.next_frame().unwrap_err();
        assert!(e.fatal);
        assert_eq!(e.request_id, None);
        r.push(&publish_bytes(2, true));
        assert_eq!(
            r.next_frame().unwrap(),
            None,
            "nothing is read after lost framing"
        );
        assert_eq!(r.buffered(), 0);
    }
}

#[test]
fn messages_are_cut_to_the_bound_at_a_char_boundary() {
    let long = "é".repeat(MESSAGE_BYTES_MAX);
    match decode_frame(&Frame::error(1, ErrorCode::Internal, long).encode(), MAX).unwrap() {
        Frame::Error { message, .. } => {
            assert!(message.len() <= MESSAGE_BYTES_MAX && message.len() >= MESSAGE_BYTES_MAX - 1);
            assert!(message.chars().all(|c| c == 'é'));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn request_id_is_known_for_exactly_the_kinds_that_start_with_one() {
    for (k, name, _) in streams::KINDS {
        let has = has_request_id(*k);
        let known = !matches!(
            *k,
            kind::HELLO
                | kind::HELLO_OK
                | kind::SUB_STREAM
                | kind::DELIVERY
                | kind::LAG
                | kind::SUB_END
                | kind::SUB_MUX
        ) && !matches!(
            *k,
            cache::kind::CACHE_EVENT
                | cache::kind::CACHE_STATE_DONE
                | cache::kind::CACHE_WATCH_END
                | cache::kind::CACHE_MUX
        ) && !matches!(
            *k,
            peer::kind::PEER_HELLO | peer::kind::PEER_HELLO_OK | replica::kind::REPLICATE
        );
        assert_eq!(has, known, "{name}");
    }
}

/// The rows of a marked table in docs/protocol.md.
fn doc_table(marker: &str) -> Vec<Vec<String>> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/protocol.md"))
        .expect("docs/protocol.md exists");
    streams::doc_table(&doc, marker)
        .unwrap_or_else(|| panic!("docs/protocol.md has no {marker} table"))
}

/// Differences between the doc's kinds table and [`streams::KINDS`]: kind, name, streams.
fn kinds_table_mismatches(rows: &[Vec<String>]) -> Vec<String> {
    let mut out = Vec::new();
    let code: Vec<(String, String, String)> = streams::KINDS
        .iter()
        .map(|(k, n, p)| (k.to_string(), n.to_string(), p.doc().to_string()))
        .collect();
    let doc: Vec<(String, String, String)> = rows
        .iter()
        .map(|r| (r[0].clone(), r[1].clone(), r[2].clone()))
        .collect();
    for c in &code {
        if !doc.contains(c) {
            out.push(format!("doc lacks | {} | {} | {} |", c.0, c.1, c.2));
        }
    }
    for d in &doc {
        if !code.contains(d) {
            out.push(format!(
                "code lacks the doc's | {} | {} | {} |",
                d.0, d.1, d.2
            ));
        }
    }
    out
}

#[test]
fn docs_conformance_table_matches_code() {
    let rows = doc_table("conformance-kinds");
    let bad = kinds_table_mismatches(&rows);
    assert!(
        bad.is_empty(),
        "docs/protocol.md conformance table vs code:\n{}",
        bad.join("\n")
    );
}

/// The checker above can fail: a row whose placement the doc changes is caught.
#[test]
fn docs_conformance_check_catches_a_changed_row() {
    let mut rows = doc_table("conformance-kinds");
    let publish = rows.iter_mut().find(|r| r[1] == "Publish").unwrap();
    publish[2] = "control".into();
    assert_eq!(kinds_table_mismatches(&rows).len(), 2);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Fuzz the stream reader: any bytes, pushed in any chunking, never panic, never buffer
    /// past one frame's maximum, and after a non-fatal error the stream goes on.
    #[test]
    fn reader_survives_arbitrary_bytes(
        data in proptest::collection::vec(any::<u8>(), 0..600),
        cuts in proptest::collection::vec(1usize..64, 1..20),
        max in 16usize..300,
    ) {
        let mut r = FrameReader::new(max);
        let mut pos = 0;
        let mut i = 0;
        while pos < data.len() {
            let n = cuts[i % cuts.len()].min(data.len() - pos);
            r.push(&data[pos..pos + n]);
            pos += n;
            i += 1;
            for _ in 0..data.len() + 1 {
                match r.next_frame() {
                    Ok(Some(_)) => continue,
                    Ok(None) => break,
                    Err(e) if e.fatal => break,
                    Err(_) => continue,
                }
            }
            prop_assert!(r.buffered() <= max + HEADER_LEN + data.len());
        }
    }

    /// Fuzz the reader with well-formed frames around one corrupted byte: every frame after
    /// the corrupted one is still read unless the corruption hit a header's magic or version.
    #[test]
    fn reader_recovers_after_a_corrupt_body(
        n in 2u64..6,
        victim in 0usize..6,
        byte in HEADER_LEN + 8..HEADER_LEN + 40,
        value in any::<u8>(),
    ) {
        let rids: Vec<u64> = (1..=n).collect();
        let victim = victim % rids.len();
        let mut r = FrameReader::new(MAX);
        for (i, rid) in rids.iter().enumerate() {
            let mut b = publish_bytes(*rid, true);
            if i == victim {
                b[byte] = value;
            }
            r.push(&b);
        }
        let mut after = Vec::new();
        let mut seen_victim = false;
        loop {
            match r.next_frame() {
                Ok(Some(f)) => {
                    if seen_victim {
                        after.push(f.request_id().unwrap());
                    }
                    if f.request_id() == Some(rids[victim]) {
                        seen_victim = true;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    prop_assert!(!e.fatal, "a body byte never loses the framing");
                    prop_assert_eq!(e.request_id, Some(rids[victim]));
                    seen_victim = true;
                }
            }
        }
        prop_assert_eq!(&after[..], &rids[victim + 1..]);
    }
}

/// Fields appended in this version decode as their defaults when an older peer leaves them
/// out (the evolution rule: newer peers append; older ones still decode).
#[test]
fn appended_fields_are_optional_on_decode() {
    let full = Frame::SubscribeOk {
        request_id: 1,
        subscription_id: 2,
        shard: 3,
        next_offset: 4,
        queue_records_max: 5,
        queue_bytes_max: 6,
    }
    .encode();
    let mut old = full[..full.len() - 12].to_vec();
    let body_len = (old.len() - HEADER_LEN) as u32;
    old[6..10].copy_from_slice(&body_len.to_le_bytes());
    match decode_frame(&old, MAX).unwrap() {
        Frame::SubscribeOk {
            next_offset,
            queue_records_max,
            queue_bytes_max,
            ..
        } => assert_eq!((next_offset, queue_records_max, queue_bytes_max), (4, 0, 0)),
        other => panic!("{other:?}"),
    }
    let hello_ok = Frame::HelloOk {
        features: 0,
        limits: Limits {
            max_frame_bytes: 1,
            max_payload_bytes: 2,
            max_subscriptions: 3,
            max_key_bytes: 4,
        },
        core: 0,
        server: "s".into(),
    }
    .encode();
    let mut old = hello_ok[..hello_ok.len() - 4].to_vec();
    let body_len = (old.len() - HEADER_LEN) as u32;
    old[6..10].copy_from_slice(&body_len.to_le_bytes());
    match decode_frame(&old, MAX).unwrap() {
        Frame::HelloOk { limits, .. } => assert_eq!(limits.max_key_bytes, 65_535),
        other => panic!("{other:?}"),
    }
}

#[test]
fn request_ids_are_patched_in_place_for_kinds_that_carry_one() {
    let f = Frame::error(5, ErrorCode::NotFound, "x");
    let mut b = f.encode().to_vec();
    assert!(patch_request_id(&mut b, 77));
    assert_eq!(
        decode_frame(&b, MAX).unwrap(),
        Frame::error(77, ErrorCode::NotFound, "x")
    );
    let mut lag = Frame::Lag {
        from_offset: 1,
        lost: 2,
    }
    .encode()
    .to_vec();
    let before = lag.clone();
    assert!(!patch_request_id(&mut lag, 9));
    assert_eq!(lag, before);
}

/// An older broker's StreamInfo (no owners appended) still decodes: owners empty.
#[test]
fn stream_info_without_owners_decodes() {
    let mut b = Frame::StreamInfo {
        request_id: 3,
        shards: 2,
        durable: true,
        owners: vec![],
    }
    .encode()
    .to_vec();
    b.truncate(b.len() - 4);
    let body_len = (b.len() - HEADER_LEN) as u32;
    b[6..10].copy_from_slice(&body_len.to_le_bytes());
    assert_eq!(
        decode_frame(&b, MAX).unwrap(),
        Frame::StreamInfo {
            request_id: 3,
            shards: 2,
            durable: true,
            owners: vec![],
        }
    );
}

mod replicate {
    use super::super::replica::{ReplicaMsg, ShardRef, Shipped, ShippedRecord};
    use super::*;

    fn shard() -> ShardRef {
        ShardRef {
            stream: StreamName::new("t", "n", "orders"),
            incarnation: 17,
            shard: 3,
        }
    }

    fn rec(ts_ms: u64, flags: u8, p: &'static [u8]) -> ShippedRecord {
        ShippedRecord {
            ts_ms,
            flags,
            payload: Bytes::from_static(p),
        }
    }

    fn frame(msg: ReplicaMsg, records: Vec<ShippedRecord>) -> Frame {
        Frame::Replicate {
            shard: shard(),
            msg,
            records,
        }
    }

    #[test]
    fn every_replica_message_round_trips() {
        let ship = ReplicaMsg::Ship {
            gen: 4,
            leader: 2,
            start: 10,
            prev_gen: Some(3),
            commit: 12,
            gens: vec![3, 3, 4, 4, 4],
        };
        let recs = vec![
            rec(1, 0, b"a"),
            rec(2, 0, b""),
            rec(3, 2, b""),
            rec(4, 0, b"dd"),
            rec(5, 0, b"eee"),
        ];
        let frames = [
            frame(ship, recs),
            frame(
                ReplicaMsg::Ship {
                    gen: 1,
                    leader: 1,
                    start: 0,
                    prev_gen: None,
                    commit: 0,
                    gens: vec![],
                },
                vec![],
            ),
            frame(ReplicaMsg::Fence { gen: 9, leader: 1 }, vec![]),
            frame(
                ReplicaMsg::FenceAnswer {
                    gen: 9,
                    from: 2,
                    end: 77,
                },
                vec![],
            ),
            frame(
                ReplicaMsg::ShipAnswer {
                    gen: 9,
                    from: 3,
                    sid: u64::MAX,
                    shipped: Shipped::Holds { end: 5 },
                },
                vec![],
            ),
            frame(
                ReplicaMsg::ShipAnswer {
                    gen: 9,
                    from: 3,
                    sid: 1,
                    shipped: Shipped::Mismatch { below: 4 },
                },
                vec![],
            ),
            frame(
                ReplicaMsg::LeaseAsk {
                    gen: 9,
                    leader: 1,
                    round: 123,
                },
                vec![],
            ),
            frame(
                ReplicaMsg::LeaseGrant {
                    gen: 9,
                    from: 2,
                    round: 123,
                },
                vec![],
            ),
            frame(
                ReplicaMsg::Refuse {
                    gen: 8,
                    from: 2,
                    promised: 9,
                },
                vec![],
            ),
        ];
        for f in frames {
            assert_eq!(decode_frame(&f.encode(), MAX).unwrap(), f);
            assert_eq!(f.request_id(), None);
            assert_eq!(f.kind(), replica::kind::REPLICATE);
        }
    }

    #[test]
    fn a_replicate_frame_that_lies_is_refused() {
        let ship = frame(
            ReplicaMsg::Ship {
                gen: 2,
                leader: 1,
                start: 0,
                prev_gen: None,
                commit: 0,
                gens: vec![2, 2],
            },
            vec![rec(1, 0, b"x"), rec(2, 0, b"y")],
        );
        let good = ship.encode().to_vec();
        let body_at = HEADER_LEN;
        // The message tag sits after the stream address (3 strings), incarnation and shard.
        let tag_at = body_at + (2 + 1) + (2 + 1) + (2 + 6) + 8 + 4;
        assert_eq!(good[tag_at], 3, "the Ship tag");
        let mut bad_tag = good.clone();
        bad_tag[tag_at] = 99;
        assert!(matches!(
            decode_frame(&bad_tag, MAX),
            Err(WireError::InvalidValue {
                field: "replica_tag",
                value: 99
            })
        ));
        // A record count that is not the runs' total.
        let count_at = tag_at + 1 + 8 + 8 + 8 + 1 + 8 + 8 + 4 + 12;
        assert_eq!(good[count_at], 2, "the record count");
        let mut bad_count = good.clone();
        bad_count[count_at] = 1;
        assert!(matches!(
            decode_frame(&bad_count, MAX),
            Err(WireError::InvalidValue {
                field: "records",
                ..
            })
        ));
        // A run claiming more records than the frame could hold is refused before any
        // allocation for them.
        let mut huge_run = good.clone();
        huge_run[count_at - 12..count_at - 8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode_frame(&huge_run, MAX),
            Err(WireError::InvalidValue {
                field: "gen_runs",
                ..
            })
        ));
        // Cut anywhere: never a panic, always an error.
        for cut in HEADER_LEN..good.len() {
            let mut f = good[..cut].to_vec();
            let len = (cut - HEADER_LEN) as u32;
            f[6..10].copy_from_slice(&len.to_le_bytes());
            assert!(decode_frame(&f, MAX).is_err(), "cut at {cut}");
        }
        // Not inside a Forward, nor on a client connection; on a peer link after PeerHello.
        assert_eq!(
            streams::kind_info(replica::kind::REPLICATE).map(|i| i.1),
            Some(streams::Placement::PeerLink)
        );
        assert!(matches!(
            streams::admit_peer(replica::kind::REPLICATE, 8, false),
            Verdict::Refuse { .. }
        ));
        assert_eq!(
            streams::admit_peer(replica::kind::REPLICATE, 8, true),
            Verdict::Serve
        );
        // The sender each message names: the leader's, or the answering replica's.
        let fence = replica::ReplicaMsg::Fence { gen: 2, leader: 7 };
        let refuse = replica::ReplicaMsg::Refuse {
            gen: 2,
            from: 9,
            promised: 3,
        };
        assert_eq!((fence.sender(), refuse.sender()), (7, 9));
    }
}

use super::*;
use felix_quic::wire::{decode_frame, Records, ShardSelector, StreamName};

const MAX: usize = 1 << 24;

fn links(forwards_max: usize) -> Links {
    let mut l = Links::new(LinksCfg {
        node_id: 1,
        max_frame_bytes: 1 << 20,
        connect_timeout: Duration::from_millis(100),
        forward_timeout: Duration::from_millis(50),
        forwards_max,
    });
    l.set_cluster_id("c");
    l
}

fn target() -> FwdTarget {
    FwdTarget {
        node: 2,
        addr: "127.0.0.1:9".into(),
        head: ForwardHead {
            incarnation: 7,
            generation: 3,
            origin_node: 1,
            principal: String::new(),
            frame_bytes_max: 0,
        },
    }
}

fn publish(rid: u64) -> Frame {
    Frame::Publish {
        request_id: rid,
        stream: StreamName::new("t", "n", "s"),
        shard: ShardSelector::Shard(0),
        ack: true,
        records: Records::encode([&b"x"[..]]),
    }
}

fn hello_ok(node_id: u64, max_frame_bytes: u32) -> Frame {
    Frame::Peer(PeerFrame::PeerHelloOk {
        node_id,
        cluster_id: "c".into(),
        capabilities: 1,
        max_frame_bytes,
    })
}

fn client(rid: u64) -> FwdClient {
    FwdClient::Request {
        conn: 5,
        stream: 0,
        request_id: rid,
        cache: false,
    }
}

/// Forward one request with client id `rid`; returns the refusal, if any.
fn fwd(l: &mut Links, now: Instant, rid: u64) -> Result<(), Refusal> {
    l.forward(
        now,
        target(),
        &publish(rid),
        client(rid),
        Lane::Publish,
        Duration::ZERO,
        None,
    )
}

/// The forwards sent on the link, decoded: (link id, head).
fn sent(effects: &[LinkEffect]) -> Vec<(u64, ForwardHead)> {
    effects
        .iter()
        .filter_map(|e| match e {
            LinkEffect::Send { bytes, .. } => match decode_frame(bytes, MAX).unwrap() {
                Frame::Peer(PeerFrame::Forward { head, inner }) => {
                    Some((inner.request_id().unwrap(), head))
                }
                _ => None,
            },
            _ => None,
        })
        .collect()
}

/// Answers to clients: (client id, answer code: 0 for a frame).
fn answers(effects: Vec<LinkEffect>) -> Vec<(u64, u16)> {
    effects
        .into_iter()
        .filter_map(|e| match e {
            LinkEffect::Answer { client, answer, .. } => Some((
                client.request_id(),
                match *answer {
                    FwdAnswer::Frame(_, bytes) => {
                        // The client's id was written back into the answer.
                        let f = decode_frame(&bytes, MAX).unwrap();
                        assert_eq!(f.request_id(), Some(client.request_id()));
                        0
                    }
                    FwdAnswer::Refused(r) => r.code.number(),
                },
            )),
            _ => None,
        })
        .collect()
}

/// Dial, handshake and hello: the link to node 2 is ready (key 40).
fn open(l: &mut Links, now: Instant) -> Vec<LinkEffect> {
    let e = l.drain_effects();
    assert!(matches!(e[..], [LinkEffect::Dial { node: 2, .. }]), "{e:?}");
    l.on_dialed(2, 40);
    l.on_established(40);
    let e = l.drain_effects();
    match &e[..] {
        [LinkEffect::Send {
            key: 40,
            lane: Lane::Control,
            bytes,
        }] => assert!(matches!(
            decode_frame(bytes, MAX).unwrap(),
            Frame::Peer(PeerFrame::PeerHello { node_id: 1, ref cluster_id, .. }) if cluster_id == "c"
        )),
        other => panic!("{other:?}"),
    }
    l.on_frame(now, 40, hello_ok(2, 1 << 20));
    l.drain_effects()
}

/// Forwards wait for the link, leave in order under link ids once it is ready, and each
/// answer goes to its client under the client's id.
#[test]
fn forwards_wait_for_the_link_and_answers_find_their_clients() {
    let t0 = Instant::now();
    let mut l = links(8);
    fwd(&mut l, t0, 100).unwrap();
    let out = open(&mut l, t0);
    fwd(&mut l, t0, 200).unwrap();
    let out: Vec<LinkEffect> = out.into_iter().chain(l.drain_effects()).collect();
    let ids: Vec<u64> = sent(&out).iter().map(|s| s.0).collect();
    assert_eq!(ids.len(), 2);
    assert_eq!(sent(&out)[0].1, target().head);
    assert_eq!(l.in_flight(), 2);
    // Answers out of order.
    for (id, shard) in [(ids[1], 1), (ids[0], 0)] {
        l.on_frame(
            t0,
            40,
            Frame::PublishAck {
                request_id: id,
                shard,
                first_offset: 0,
                count: 1,
                owner: 2,
            },
        );
    }
    assert_eq!(answers(l.drain_effects()), vec![(200, 0), (100, 0)]);
    assert_eq!(l.in_flight(), 0);
    // A late duplicate answer is dropped.
    l.on_frame(t0, 40, Frame::error(ids[0], ErrorCode::Internal, "late"));
    assert!(l.drain_effects().is_empty());
}

/// A broken link: what was sent is `outcome_unknown`, what was not is `unavailable`; the
/// backoff refuses at once, then the next forward dials again.
#[test]
fn a_broken_link_answers_everything_typed_and_backs_off() {
    let t0 = Instant::now();
    let mut l = links(8);
    fwd(&mut l, t0, 1).unwrap();
    open(&mut l, t0);
    l.on_closed(t0, 40, "killed".into());
    assert_eq!(
        answers(l.drain_effects()),
        vec![(1, ErrorCode::OutcomeUnknown.number())]
    );
    let r = fwd(&mut l, t0 + Duration::from_millis(10), 2).unwrap_err();
    assert_eq!(r.code, ErrorCode::Unavailable);
    assert!(r.message.contains("killed"), "{}", r.message);
    // After the first backoff (100 ms) a forward dials again, and waits unsent.
    let t1 = t0 + BACKOFF_FIRST;
    fwd(&mut l, t1, 3).unwrap();
    assert!(matches!(l.drain_effects()[..], [LinkEffect::Dial { .. }]));
    // The dial never completes: the forward's own deadline (its wait, 0, plus the forward
    // timeout, 50 ms) refuses it unavailable (never sent); the link gives up at the
    // connect timeout (100 ms).
    l.tick(t1 + Duration::from_millis(49));
    assert!(l.drain_effects().is_empty());
    l.tick(t1 + Duration::from_millis(50));
    assert_eq!(
        answers(l.drain_effects()),
        vec![(3, ErrorCode::Unavailable.number())]
    );
    l.tick(t1 + Duration::from_millis(100));
    assert!(answers(l.drain_effects()).is_empty());
    // The second failure doubles the backoff.
    assert!(fwd(&mut l, t1 + Duration::from_millis(100) + BACKOFF_FIRST, 4).is_err());
    assert!(fwd(
        &mut l,
        t1 + Duration::from_millis(100) + 2 * BACKOFF_FIRST,
        5
    )
    .is_ok());
}

/// A frozen owner: a sent forward is answered `outcome_unknown` at its deadline (the
/// request's wait plus the forward timeout), never later, and never twice.
#[test]
fn an_unanswered_forward_times_out_as_outcome_unknown() {
    let t0 = Instant::now();
    let mut l = links(8);
    l.forward(
        t0,
        target(),
        &publish(9),
        client(9),
        Lane::Publish,
        Duration::from_millis(20),
        None,
    )
    .unwrap();
    open(&mut l, t0);
    assert_eq!(l.next_deadline(), Some(t0 + Duration::from_millis(70)));
    l.tick(t0 + Duration::from_millis(69));
    assert!(l.drain_effects().is_empty());
    l.tick(t0 + Duration::from_millis(70));
    assert_eq!(
        answers(l.drain_effects()),
        vec![(9, ErrorCode::OutcomeUnknown.number())]
    );
    l.tick(t0 + Duration::from_secs(1));
    assert!(l.drain_effects().is_empty());
    assert_eq!(l.in_flight(), 0);
}

/// Bounded: past `forwards_max` a forward is refused, nothing sent.
#[test]
fn forwards_per_link_are_bounded() {
    let t0 = Instant::now();
    let mut l = links(2);
    fwd(&mut l, t0, 1).unwrap();
    fwd(&mut l, t0, 2).unwrap();
    assert_eq!(
        fwd(&mut l, t0, 3).unwrap_err().code,
        ErrorCode::InflightLimit
    );
    assert_eq!(l.in_flight(), 2);
}

/// An idle link that closes is no failure: the next forward dials again at once.
#[test]
fn an_idle_link_that_closes_is_dialed_again_at_once() {
    let t0 = Instant::now();
    let mut l = links(8);
    fwd(&mut l, t0, 1).unwrap();
    let out = open(&mut l, t0);
    let id = sent(&out)[0].0;
    l.on_frame(t0, 40, Frame::error(id, ErrorCode::NotFound, "x"));
    assert_eq!(answers(l.drain_effects()), vec![(1, 0)]);
    l.on_closed(t0, 40, "idle timeout".into());
    assert!(l.drain_effects().is_empty());
    fwd(&mut l, t0, 2).expect("not refused: the link is dialed again");
    assert!(matches!(l.drain_effects()[..], [LinkEffect::Dial { .. }]));
}

/// A listener that answers as another node (or cluster) is dropped, and what waited on it
/// is refused unavailable.
#[test]
fn a_listener_answering_as_another_node_is_dropped() {
    let t0 = Instant::now();
    let mut l = links(8);
    fwd(&mut l, t0, 1).unwrap();
    l.drain_effects();
    l.on_dialed(2, 40);
    l.on_established(40);
    l.drain_effects();
    l.on_frame(t0, 40, hello_ok(3, 1 << 20));
    let e = l.drain_effects();
    assert!(matches!(e[0], LinkEffect::Close { key: 40 }));
    assert_eq!(answers(e), vec![(1, ErrorCode::Unavailable.number())]);
    // Still a link until the driver reaps it, then gone.
    assert!(l.is_link(40));
    l.on_closed(t0, 40, "closed".into());
    assert!(!l.is_link(40));
}

/// An address that is not IP:port is refused, typed, nothing dialed.
#[test]
fn a_peer_address_that_is_not_an_ip_is_refused() {
    let mut l = links(8);
    let mut t = target();
    t.addr = "broker-2.example:7402".into();
    let r = l
        .forward(
            Instant::now(),
            t,
            &publish(1),
            client(1),
            Lane::Control,
            Duration::ZERO,
            None,
        )
        .unwrap_err();
    assert_eq!(r.code, ErrorCode::Unavailable);
    assert!(l.drain_effects().is_empty());
}

/// A long poll's cancel goes under the poll's link id: right behind it while the link
/// opens, on its own once the poll left; a connection that closes cancels its polls; a
/// cancel of a poll that is not waiting here says so.
#[test]
fn long_polls_are_cancelled_under_their_link_id() {
    use felix_quic::wire::{GroupFrame, GroupRef};
    let t0 = Instant::now();
    let mut l = links(8);
    let gref = GroupRef {
        stream: StreamName::new("t", "n", "s"),
        group: "g".into(),
        shard: 0,
    };
    let poll = |rid| {
        Frame::Group(GroupFrame::GroupPoll {
            request_id: rid,
            target: gref.clone(),
            max: 1,
            visibility_timeout_ms: 0,
            wait_ms: 1000,
        })
    };
    let cancel = |rid| {
        Frame::Group(GroupFrame::GroupPollCancel {
            request_id: rid,
            target: gref.clone(),
        })
    };
    let wait = Duration::from_secs(1);
    for rid in [1, 2] {
        let c = client(rid);
        l.forward(
            t0,
            target(),
            &poll(rid),
            c,
            Lane::Control,
            wait,
            Some(&cancel(rid)),
        )
        .unwrap();
    }
    assert!(!l.cancel_poll(5, 99), "no such poll");
    assert!(l.cancel_poll(5, 1), "poll 1 waits to be sent");
    assert!(!l.cancel_poll(5, 1), "cancelled once");
    let out = open(&mut l, t0);
    // Decode every frame sent, in order: poll 1 and its cancel under one link id, poll 2.
    let mut frames = Vec::new();
    for e in &out {
        if let LinkEffect::Send { bytes, .. } = e {
            let mut r = felix_quic::wire::FrameReader::new(MAX);
            r.push(bytes);
            while let Some(f) = r.next_frame().unwrap() {
                frames.push(f);
            }
        }
    }
    let inner: Vec<(u8, u64)> = frames
        .iter()
        .map(|f| match f {
            Frame::Peer(PeerFrame::Forward { inner, .. }) => {
                (inner.kind(), inner.request_id().unwrap())
            }
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(inner.len(), 3, "{inner:?}");
    assert_eq!(
        inner[0].1, inner[1].1,
        "the cancel names its poll's link id"
    );
    assert_ne!(inner[0].0, inner[1].0);
    // The connection closes: poll 2's cancel leaves on its own.
    assert_eq!(l.conn_closed(5), 1);
    let out = l.drain_effects();
    assert_eq!(sent(&out).len(), 1);
    assert_eq!(sent(&out)[0].0, inner[2].1);
    assert_eq!(l.conn_closed(5), 0, "once");
}

/// A forward over the owner's frame maximum is refused before anything is sent; an
/// answer that cannot be read is `outcome_unknown`; a broker that moved gets a new link.
#[test]
fn oversize_unreadable_and_moved() {
    let t0 = Instant::now();
    let mut l = links(8);
    fwd(&mut l, t0, 1).unwrap();
    l.drain_effects();
    l.on_dialed(2, 40);
    l.on_established(40);
    l.drain_effects();
    l.on_frame(t0, 40, hello_ok(2, 100));
    let out = l.drain_effects();
    let id = sent(&out)[0].0;
    let big = Frame::Publish {
        request_id: 2,
        stream: StreamName::new("t", "n", "s"),
        shard: ShardSelector::Shard(0),
        ack: true,
        records: Records::encode([&[0u8; 200][..]]),
    };
    let r = l
        .forward(
            t0,
            target(),
            &big,
            client(2),
            Lane::Publish,
            Duration::ZERO,
            None,
        )
        .unwrap_err();
    assert_eq!(r.code, ErrorCode::FrameTooLarge);
    assert_eq!(l.in_flight(), 1);
    l.on_bad_answer(40, id, "bad body".into());
    assert_eq!(
        answers(l.drain_effects()),
        vec![(1, ErrorCode::OutcomeUnknown.number())]
    );
    // Broker 2 re-registered elsewhere: the old link is closed, the next one dialed at once.
    let mut moved = target();
    moved.addr = "127.0.0.1:10".into();
    l.forward(
        t0,
        moved,
        &publish(3),
        client(3),
        Lane::Publish,
        Duration::ZERO,
        None,
    )
    .unwrap();
    let e = l.drain_effects();
    assert!(matches!(e[0], LinkEffect::Close { key: 40 }), "{e:?}");
    assert!(e
        .iter()
        .any(|x| matches!(x, LinkEffect::Dial { addr, .. } if addr.port() == 10)));
    assert!(l.is_link(40), "closing, not a client's");
    l.on_closed(t0, 40, "closed".into());
    assert!(!l.is_link(40));
    assert!(
        l.drain_effects().is_empty(),
        "the close was already handled"
    );
}

/// Replica messages go on the replication lane of a ready link, fire and forget: one for a
/// link that is not ready is dropped (the link is dialed), none waits for it, one over the
/// peer's frame maximum or to a link backing off is refused, and no forward bookkeeping is
/// made for any of them.
#[test]
fn replica_messages_ride_the_replication_lane_of_a_ready_link_or_are_dropped() {
    let t0 = Instant::now();
    let mut l = links(8);
    let msg = Bytes::from_static(b"replica message");
    // No link yet: dialed, and the message dropped.
    assert_eq!(l.send_replica(t0, 2, "127.0.0.1:9", msg.clone()), Ok(false));
    // Ready: the hello went, nothing of the dropped message follows it.
    let out = open(&mut l, t0);
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(l.send_replica(t0, 2, "127.0.0.1:9", msg.clone()), Ok(true));
    match &l.drain_effects()[..] {
        [LinkEffect::Send {
            key: 40,
            lane: Lane::Replication,
            bytes,
        }] => assert_eq!(bytes, &msg),
        other => panic!("{other:?}"),
    }
    assert_eq!(l.in_flight(), 0, "nothing waits for an answer");
    assert_eq!(l.next_deadline(), None);
    // Over the peer's maximum (its hello said 1 MiB): refused, nothing sent.
    let big = Bytes::from(vec![0u8; (1 << 20) + 1]);
    let r = l.send_replica(t0, 2, "127.0.0.1:9", big).unwrap_err();
    assert_eq!(r.code, ErrorCode::FrameTooLarge);
    assert!(l.drain_effects().is_empty());
    // An idle link that closes is dialed again at once; one whose dial fails backs off, and
    // is refused (nothing sent) until the backoff has passed.
    l.on_closed(t0, 40, "reset".into());
    l.drain_effects();
    assert_eq!(l.send_replica(t0, 2, "127.0.0.1:9", msg.clone()), Ok(false));
    assert!(matches!(
        l.drain_effects()[..],
        [LinkEffect::Dial { node: 2, .. }]
    ));
    l.on_dial_failed(t0, 2, "no route".into());
    l.drain_effects();
    let r = l
        .send_replica(t0, 2, "127.0.0.1:9", msg.clone())
        .unwrap_err();
    assert_eq!(r.code, ErrorCode::Unavailable);
    assert!(r.message.contains("no route"), "{r:?}");
    let later = t0 + Duration::from_secs(60);
    assert_eq!(l.send_replica(later, 2, "127.0.0.1:9", msg), Ok(false));
    assert!(matches!(
        l.drain_effects()[..],
        [LinkEffect::Dial { node: 2, .. }]
    ));
    // An address that does not parse is refused.
    let r = l
        .send_replica(t0, 3, "not-an-address", Bytes::new())
        .unwrap_err();
    assert_eq!(r.code, ErrorCode::Unavailable);
}

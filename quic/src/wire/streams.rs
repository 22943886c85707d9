//! Which QUIC stream carries which frame kind, and what a broker does with a frame that
//! arrives where it does not belong (the conformance table in docs/protocol.md).
//!
//! Pure: the broker asks [`admit`] for every whole frame a client sent and carries out the
//! verdict. The table here is the one the doc states; `docs_conformance_table_matches_code`
//! compares them row by row, and the broker's raw-frame suite has a case for every row.

use super::{cache, group, kind, peer, ErrorCode};

/// The kinds of client-initiated stream a broker reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamClass {
    /// The first client bidirectional stream (id 0).
    Control,
    /// Any other client bidirectional stream (one per publisher).
    Publisher,
    /// A client unidirectional stream (fire-and-forget publishes).
    OneWay,
    /// A server-initiated stream id (QUIC itself refuses client data there).
    ServerOpened,
}

impl StreamClass {
    pub fn of(stream: u64) -> StreamClass {
        match stream % 4 {
            0 if stream == 0 => StreamClass::Control,
            0 => StreamClass::Publisher,
            2 => StreamClass::OneWay,
            _ => StreamClass::ServerOpened,
        }
    }
}

/// Where frames of a kind may travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// `Hello`: once, first, on the control stream.
    Handshake,
    /// Requests answered on the control stream.
    Control,
    /// `Publish`: publisher streams (acked or not) and one-way streams (`ack` 0 only).
    PublishLanes,
    /// Frames only a broker sends.
    BrokerOnly,
    /// Frames of the peer link between brokers (`PeerHello`, `Forward`): a client connection
    /// that sends one is refused; a peer connection is admitted by its own rules.
    PeerLink,
}

impl Placement {
    /// The words the conformance table uses for this placement.
    pub fn doc(self) -> &'static str {
        match self {
            Placement::Handshake => "control, first frame",
            Placement::Control => "control",
            Placement::PublishLanes => "publisher; one-way if ack=0",
            Placement::BrokerOnly => "broker only",
            Placement::PeerLink => "peer link only",
        }
    }
}

/// Every kind of protocol v1: number, name, placement.
pub const KINDS: &[(u8, &str, Placement)] = &[
    (kind::HELLO, "Hello", Placement::Handshake),
    (kind::HELLO_OK, "HelloOk", Placement::BrokerOnly),
    (kind::PUBLISH, "Publish", Placement::PublishLanes),
    (kind::PUBLISH_ACK, "PublishAck", Placement::BrokerOnly),
    (kind::ERROR, "Error", Placement::BrokerOnly),
    (kind::SUBSCRIBE, "Subscribe", Placement::Control),
    (kind::SUBSCRIBE_OK, "SubscribeOk", Placement::BrokerOnly),
    (kind::SUB_STREAM, "SubStream", Placement::BrokerOnly),
    (kind::DELIVERY, "Delivery", Placement::BrokerOnly),
    (kind::LAG, "Lag", Placement::BrokerOnly),
    (kind::UNSUBSCRIBE, "Unsubscribe", Placement::Control),
    (kind::SUB_END, "SubEnd", Placement::BrokerOnly),
    (kind::DESCRIBE_STREAM, "DescribeStream", Placement::Control),
    (kind::STREAM_INFO, "StreamInfo", Placement::BrokerOnly),
    (group::kind::GROUP_CREATE, "GroupCreate", Placement::Control),
    (group::kind::GROUP_DELETE, "GroupDelete", Placement::Control),
    (
        group::kind::GROUP_DESCRIBE,
        "GroupDescribe",
        Placement::Control,
    ),
    (group::kind::GROUP_INFO, "GroupInfo", Placement::BrokerOnly),
    (group::kind::GROUP_POLL, "GroupPoll", Placement::Control),
    (
        group::kind::GROUP_POLL_CANCEL,
        "GroupPollCancel",
        Placement::Control,
    ),
    (
        group::kind::GROUP_RECORDS,
        "GroupRecords",
        Placement::BrokerOnly,
    ),
    (group::kind::GROUP_ANSWER, "GroupAnswer", Placement::Control),
    (
        group::kind::GROUP_ANSWERED,
        "GroupAnswered",
        Placement::BrokerOnly,
    ),
    (group::kind::GROUP_SEEK, "GroupSeek", Placement::Control),
    (
        group::kind::DEAD_LETTER_LIST,
        "DeadLetterList",
        Placement::Control,
    ),
    (
        group::kind::DEAD_LETTER_PAGE,
        "DeadLetterPage",
        Placement::BrokerOnly,
    ),
    (
        group::kind::DEAD_LETTER_OP,
        "DeadLetterOp",
        Placement::Control,
    ),
    (group::kind::GROUP_OK, "GroupOk", Placement::BrokerOnly),
    (cache::kind::CACHE_PUT, "CachePut", Placement::Control),
    (cache::kind::CACHE_GET, "CacheGet", Placement::Control),
    (cache::kind::CACHE_DELETE, "CacheDelete", Placement::Control),
    (
        cache::kind::CACHE_VALUE,
        "CacheValue",
        Placement::BrokerOnly,
    ),
    (
        cache::kind::CACHE_WRITTEN,
        "CacheWritten",
        Placement::BrokerOnly,
    ),
    (cache::kind::CACHE_WATCH, "CacheWatch", Placement::Control),
    (
        cache::kind::CACHE_WATCH_OK,
        "CacheWatchOk",
        Placement::BrokerOnly,
    ),
    (
        cache::kind::CACHE_EVENT,
        "CacheEvent",
        Placement::BrokerOnly,
    ),
    (
        cache::kind::CACHE_STATE_DONE,
        "CacheStateDone",
        Placement::BrokerOnly,
    ),
    (
        cache::kind::CACHE_WATCH_END,
        "CacheWatchEnd",
        Placement::BrokerOnly,
    ),
    (cache::kind::COUNTER_ADD, "CounterAdd", Placement::Control),
    (cache::kind::COUNTER_GET, "CounterGet", Placement::Control),
    (
        cache::kind::COUNTER_VALUE,
        "CounterValue",
        Placement::BrokerOnly,
    ),
    (
        cache::kind::DESCRIBE_CACHE,
        "DescribeCache",
        Placement::Control,
    ),
    (cache::kind::CACHE_INFO, "CacheInfo", Placement::BrokerOnly),
    (cache::kind::CACHE_MUX, "CacheMux", Placement::BrokerOnly),
    (kind::SUB_MUX, "SubMux", Placement::BrokerOnly),
    (peer::kind::PEER_HELLO, "PeerHello", Placement::PeerLink),
    (
        peer::kind::PEER_HELLO_OK,
        "PeerHelloOk",
        Placement::PeerLink,
    ),
    (peer::kind::FORWARD, "Forward", Placement::PeerLink),
    (
        super::replica::kind::REPLICATE,
        "Replicate",
        Placement::PeerLink,
    ),
    (
        kind::DESCRIBE_CLUSTER,
        "DescribeCluster",
        Placement::Control,
    ),
    (kind::CLUSTER_INFO, "ClusterInfo", Placement::BrokerOnly),
    (
        super::auth::kind::AUTHENTICATE,
        "Authenticate",
        Placement::Control,
    ),
    (
        super::auth::kind::AUTHENTICATED,
        "Authenticated",
        Placement::BrokerOnly,
    ),
];

/// The row of `k`, if it is a v1 kind.
pub fn kind_info(k: u8) -> Option<(&'static str, Placement)> {
    KINDS.iter().find(|r| r.0 == k).map(|r| (r.1, r.2))
}

/// The name of kind `k` ("kind 200" when v1 has none).
pub fn kind_name(k: u8) -> String {
    kind_info(k).map_or_else(|| format!("kind {k}"), |(n, _)| n.to_string())
}

/// The stream a refusal of a frame received on `stream` goes on: a bidirectional stream is
/// answered on itself, a one-way stream on the control stream.
pub fn answer_stream(stream: u64) -> u64 {
    if stream.is_multiple_of(4) {
        stream
    } else {
        0
    }
}

/// What a broker does with a whole frame a client sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Serve it.
    Serve,
    /// A kind this build does not know: skipped, no answer (evolution rule).
    Skip,
    /// Refuse it without acting on it: an `Error` with `code` on `answer_on`.
    Refuse {
        answer_on: u64,
        code: ErrorCode,
        message: String,
    },
}

/// The verdict for a frame of kind `k` on `stream`. `ack` is the Publish's ack flag (false
/// for other kinds); `hello_done` says whether the connection's Hello was taken.
pub fn admit(k: u8, stream: u64, ack: bool, hello_done: bool) -> Verdict {
    let Some((name, placement)) = kind_info(k) else {
        return Verdict::Skip;
    };
    let class = StreamClass::of(stream);
    let refuse = |message: String| Verdict::Refuse {
        answer_on: answer_stream(stream),
        code: ErrorCode::InvalidRequest,
        message,
    };
    if !hello_done && placement != Placement::PeerLink {
        return if placement == Placement::Handshake && class == StreamClass::Control {
            Verdict::Serve
        } else {
            refuse(format!(
                "{name} before Hello: the first frame of a connection is Hello, on the control stream (stream 0); nothing was done"
            ))
        };
    }
    match (placement, class) {
        (Placement::Handshake, _) => refuse("Hello sent twice".into()),
        (Placement::BrokerOnly, _) => refuse(format!(
            "{name} (kind {k}) is sent by the broker only"
        )),
        (Placement::PeerLink, _) => refuse(format!(
            "{name} (kind {k}) travels only between brokers, on the peer listener"
        )),
        (Placement::Control, StreamClass::Control) => Verdict::Serve,
        (Placement::Control, _) => refuse(format!(
            "{name} goes on the control stream (stream 0), not stream {stream}; nothing was done"
        )),
        (Placement::PublishLanes, StreamClass::Publisher) => Verdict::Serve,
        (Placement::PublishLanes, StreamClass::OneWay) if !ack => Verdict::Serve,
        (Placement::PublishLanes, StreamClass::OneWay) => refuse(
            "an acked Publish (ack=1) needs a bidirectional stream to be answered on; nothing was appended"
                .into(),
        ),
        (Placement::PublishLanes, _) => refuse(
            "Publish goes on a publisher stream (a client bidirectional stream other than 0) or, with ack=0, a unidirectional one; nothing was appended"
                .into(),
        ),
    }
}

/// The verdict for a frame of kind `k` on `stream` of a peer link's listening side (a
/// connection that came in on the peer listener). Before `PeerHello` only `PeerHello` on the
/// control stream is taken; after it, only `Forward`, whose inner request then passes
/// [`admit`] as if a client had sent it on the same stream, and `Replicate` (its handler
/// checks the link negotiated the capability and that it speaks for the dialer).
pub fn admit_peer(k: u8, stream: u64, hello_done: bool) -> Verdict {
    let refuse = |message: String| Verdict::Refuse {
        answer_on: answer_stream(stream),
        code: ErrorCode::InvalidRequest,
        message,
    };
    let name = kind_name(k);
    match (k, hello_done) {
        (peer::kind::PEER_HELLO, false) if StreamClass::of(stream) == StreamClass::Control => {
            Verdict::Serve
        }
        (_, false) => refuse(format!(
            "{name} before PeerHello: a peer link starts with PeerHello on its control stream"
        )),
        (peer::kind::PEER_HELLO, true) => refuse("PeerHello sent twice".into()),
        (peer::kind::FORWARD, true) => Verdict::Serve,
        (super::replica::kind::REPLICATE, true) => Verdict::Serve,
        _ if kind_info(k).is_none() => Verdict::Skip,
        _ => refuse(format!(
            "{name} on a peer link: requests travel inside Forward"
        )),
    }
}

/// The data rows of the table between `<!-- marker:begin -->` and `<!-- marker:end -->` in a
/// markdown document, as trimmed cells (the conformance tests read docs/protocol.md with it).
pub fn doc_table(doc: &str, marker: &str) -> Option<Vec<Vec<String>>> {
    let begin = format!("<!-- {marker}:begin -->");
    let end = format!("<!-- {marker}:end -->");
    let (_, rest) = doc.split_once(&begin)?;
    let (body, _) = rest.split_once(&end)?;
    Some(
        body.lines()
            .filter(|l| l.starts_with('|'))
            .skip(2)
            .map(|l| {
                l.trim()
                    .trim_matches('|')
                    .split('|')
                    .map(|c| c.trim().to_string())
                    .collect()
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_in_range_has_a_row_and_rows_are_unique() {
        for k in 1..=kind::LAST {
            assert!(kind_info(k).is_some(), "kind {k} has no row");
        }
        let mut kinds = std::collections::HashSet::new();
        let mut names = std::collections::HashSet::new();
        for (k, n, _) in KINDS {
            assert!(kinds.insert(*k), "kind {k} twice");
            assert!(names.insert(*n), "name {n} twice");
        }
        assert_eq!(KINDS.len(), kind::LAST as usize);
        assert_eq!(
            admit(200, 0, false, false),
            Verdict::Skip,
            "unknown kinds are skipped"
        );
    }

    #[test]
    fn stream_classes_and_answer_streams() {
        assert_eq!(StreamClass::of(0), StreamClass::Control);
        assert_eq!(StreamClass::of(4), StreamClass::Publisher);
        assert_eq!(StreamClass::of(2), StreamClass::OneWay);
        assert_eq!(StreamClass::of(3), StreamClass::ServerOpened);
        assert_eq!(answer_stream(8), 8);
        assert_eq!(answer_stream(6), 0);
    }

    #[test]
    fn verdicts_follow_the_table() {
        use Verdict::*;
        let refused = |v: Verdict, on: u64| matches!(v, Refuse { answer_on, code: ErrorCode::InvalidRequest, .. } if answer_on == on);
        assert_eq!(admit(kind::HELLO, 0, false, false), Serve);
        assert!(refused(admit(kind::HELLO, 0, false, true), 0));
        assert!(refused(admit(kind::HELLO, 4, false, false), 4));
        assert!(refused(admit(kind::SUBSCRIBE, 0, false, false), 0));
        assert_eq!(admit(kind::SUBSCRIBE, 0, false, true), Serve);
        assert!(refused(admit(kind::SUBSCRIBE, 4, false, true), 4));
        assert!(refused(admit(kind::SUBSCRIBE, 2, false, true), 0));
        assert!(refused(admit(kind::PUBLISH, 0, true, true), 0));
        assert_eq!(admit(kind::PUBLISH, 4, true, true), Serve);
        assert_eq!(admit(kind::PUBLISH, 4, false, true), Serve);
        assert_eq!(admit(kind::PUBLISH, 2, false, true), Serve);
        assert!(refused(admit(kind::PUBLISH, 2, true, true), 0));
        assert!(refused(admit(kind::PUBLISH_ACK, 4, false, true), 4));
        assert!(refused(admit(kind::DELIVERY, 6, false, true), 0));
        // Peer frames on a client connection, before or after Hello.
        assert!(refused(admit(peer::kind::FORWARD, 0, false, true), 0));
        assert!(refused(admit(peer::kind::PEER_HELLO, 0, false, false), 0));
        // A peer link's listening side.
        assert_eq!(admit_peer(peer::kind::PEER_HELLO, 0, false), Serve);
        assert!(refused(admit_peer(peer::kind::PEER_HELLO, 4, false), 4));
        assert!(refused(admit_peer(peer::kind::FORWARD, 0, false), 0));
        assert!(refused(admit_peer(peer::kind::PEER_HELLO, 0, true), 0));
        assert_eq!(admit_peer(peer::kind::FORWARD, 4, true), Serve);
        assert!(refused(admit_peer(kind::PUBLISH, 4, true), 4));
        assert_eq!(admit_peer(200, 0, true), Skip);
    }
}

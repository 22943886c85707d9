//! Starts the real felix-broker binary on loopback and talks Felix over QUIC (TLS 1.3,
//! verified against the generated dev certificate) with raw frames (`common::raw`).

use felix_quic::wire::{features, ErrorCode, Frame, StreamName, DEFAULT_MAX_FRAME_BYTES};

mod common;
use common::raw::Raw;
use common::Broker;

fn hello() -> Frame {
    Frame::Hello {
        features: features::ALL | (1 << 40),
        max_frame_bytes: 1 << 24,
        client: "test".into(),
    }
}

fn describe(rid: u64, s: &str) -> Frame {
    Frame::DescribeStream {
        request_id: rid,
        stream: StreamName::new("default", "default", s),
    }
}

async fn connect(b: &Broker) -> Raw {
    Raw::connect(b.quic, &b.ca(), DEFAULT_MAX_FRAME_BYTES, 16 << 20).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_describe_and_typed_errors_over_verified_tls() {
    let b = Broker::start(2, &[]);
    assert!(b.ca().exists(), "dev certificate generated in the data dir");
    let mut c = connect(&b).await;
    c.send(0, &hello());
    match c.next_on(0).await {
        Frame::HelloOk {
            features: f,
            limits,
            ..
        } => {
            assert_eq!(f, features::ALL, "unknown feature bits are not echoed");
            assert_eq!(limits.max_frame_bytes as usize, DEFAULT_MAX_FRAME_BYTES);
        }
        other => panic!("expected HelloOk, got {other:?}"),
    }
    c.send(0, &describe(1, "events"));
    assert_eq!(
        c.next_on(0).await,
        Frame::StreamInfo {
            request_id: 1,
            shards: 4,
            durable: false,
            owners: vec![1; 4],
        }
    );
    c.send(0, &describe(2, "nope"));
    match c.next_on(0).await {
        Frame::Error {
            request_id: 2,
            code,
            ..
        } => assert_eq!(code, ErrorCode::UnknownStream.number()),
        other => panic!("expected unknown_stream, got {other:?}"),
    }
    // Malformed bytes on another bidi stream: a typed error there, the connection lives on.
    c.send_raw(4, b"XX\x01\x03\0\0\0\0\0\0garbage".to_vec());
    match c.next_on(4).await {
        Frame::Error { code, .. } => assert_eq!(code, ErrorCode::InvalidFrame.number()),
        other => panic!("expected invalid_frame on stream 4, got {other:?}"),
    }
    // A frame declaring more than the maximum: frame_too_large from the header and the
    // request id alone (the body never comes).
    let mut big = Vec::from(&b"FX\x01\x03\0\0"[..]);
    big.extend_from_slice(&(u32::MAX).to_le_bytes());
    big.extend_from_slice(&77u64.to_le_bytes());
    c.send_raw(8, big);
    match c.next_on(8).await {
        Frame::Error {
            code, request_id, ..
        } => {
            assert_eq!(code, ErrorCode::FrameTooLarge.number());
            assert_eq!(request_id, 77, "the refusal names the request");
        }
        other => panic!("expected frame_too_large, got {other:?}"),
    }
    c.send(0, &describe(3, "events"));
    assert!(matches!(
        c.next_on(0).await,
        Frame::StreamInfo { request_id: 3, .. }
    ));
    // Another connection is served normally after the malformed frames.
    let other = b.client().await;
    let info = other
        .describe_stream(&StreamName::new("default", "default", "events"))
        .await
        .expect("the broker keeps serving other connections");
    assert_eq!(info.shards, 4);
    assert!(b.total("bad_frames") >= 2, "malformed frames counted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_spread_over_cores_and_untrusted_certs_are_refused() {
    let b = Broker::start(2, &[]);
    let mut cores = std::collections::HashSet::new();
    for _ in 0..16 {
        let mut c = connect(&b).await;
        c.send(0, &hello());
        if let Frame::HelloOk { core, .. } = c.next_on(0).await {
            cores.insert(core);
        }
        if cores.len() == 2 {
            break;
        }
    }
    assert_eq!(
        cores.len(),
        2,
        "SO_REUSEPORT spread 16 connections over both cores"
    );
    let metrics = b.http_get("/metrics");
    assert!(
        metrics.contains("felix_connections_accepted{core=\"1\"}"),
        "{metrics}"
    );

    // A client trusting a different CA must not complete the handshake.
    let other = tempfile::tempdir().unwrap();
    let (p, _) = felix_quic::tls::ensure_dev_cert(other.path()).unwrap();
    assert!(
        Raw::try_connect(b.quic, &p.cert, DEFAULT_MAX_FRAME_BYTES, 16 << 20)
            .await
            .is_err()
    );
}

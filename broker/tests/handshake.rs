//! Starts the real felix-broker binary on loopback and talks Felix over QUIC (TLS 1.3,
//! verified against the generated dev certificate) with the tokio driver.

use bytes::Bytes;
use felix_quic::conn::{ConnEvent, FelixConn};
use felix_quic::tls::{client_config, TransportConfig, Verify};
use felix_quic::tokio_driver::{spawn_client, Handler};
use felix_quic::wire::{features, ErrorCode, Frame, StreamName, DEFAULT_MAX_FRAME_BYTES};
use std::time::Duration;
use tokio::sync::mpsc;

mod common;
use common::Broker;

/// Test handler: frames out over the command channel, frames in over an mpsc.
struct H {
    inbox: mpsc::UnboundedSender<(u64, Frame)>,
    established: Option<tokio::sync::oneshot::Sender<()>>,
}

enum Cmd {
    Send(u64, Bytes),
    Close,
}

impl Handler for H {
    type Cmd = Cmd;
    fn on_established(&mut self, _c: &mut FelixConn) {
        if let Some(t) = self.established.take() {
            let _ = t.send(());
        }
    }
    fn on_event(&mut self, _c: &mut FelixConn, ev: ConnEvent) {
        if let ConnEvent::Frame { stream, frame } = ev {
            let _ = self.inbox.send((stream, frame));
        }
    }
    fn on_command(&mut self, c: &mut FelixConn, cmd: Cmd) {
        match cmd {
            Cmd::Send(s, b) => c.send_bytes(s, b),
            Cmd::Close => c.close(0, "bye"),
        }
    }
    fn before_flush(&mut self, _c: &mut FelixConn, _e: &mut Vec<ConnEvent>) {}
    fn on_closed(&mut self, _r: String) {}
}

async fn connect(
    b: &Broker,
    ca: &std::path::Path,
) -> (
    mpsc::UnboundedSender<Cmd>,
    mpsc::UnboundedReceiver<(u64, Frame)>,
) {
    let mut cfg = client_config(
        &Verify::CaFile(ca.to_path_buf()),
        &TransportConfig::default(),
    )
    .unwrap();
    let (itx, irx) = mpsc::unbounded_channel();
    let (etx, erx) = tokio::sync::oneshot::channel();
    let tx = spawn_client(
        b.quic,
        Some("localhost"),
        &mut cfg,
        DEFAULT_MAX_FRAME_BYTES,
        H {
            inbox: itx,
            established: Some(etx),
        },
    )
    .await
    .unwrap();
    tokio::time::timeout(Duration::from_secs(10), erx)
        .await
        .expect("handshake in time")
        .unwrap();
    (tx, irx)
}

async fn next(rx: &mut mpsc::UnboundedReceiver<(u64, Frame)>) -> (u64, Frame) {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("answer in time")
        .expect("connection open")
}

fn hello() -> Bytes {
    Frame::Hello {
        features: features::ALL | (1 << 40),
        max_frame_bytes: 1 << 24,
        client: "test".into(),
    }
    .encode()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_describe_and_typed_errors_over_verified_tls() {
    let b = Broker::start(2, &[]);
    let ca = b.ca();
    assert!(ca.exists(), "dev certificate generated in the data dir");
    let (tx, mut rx) = connect(&b, &ca).await;
    tx.send(Cmd::Send(0, hello())).unwrap();
    match next(&mut rx).await {
        (
            0,
            Frame::HelloOk {
                features: f,
                limits,
                ..
            },
        ) => {
            assert_eq!(f, features::ALL, "unknown feature bits are not echoed");
            assert_eq!(limits.max_frame_bytes as usize, DEFAULT_MAX_FRAME_BYTES);
        }
        other => panic!("expected HelloOk, got {other:?}"),
    }
    let describe = |rid, s: &str| {
        Frame::DescribeStream {
            request_id: rid,
            stream: StreamName::new("default", "default", s),
        }
        .encode()
    };
    tx.send(Cmd::Send(0, describe(1, "events"))).unwrap();
    assert_eq!(
        next(&mut rx).await.1,
        Frame::StreamInfo {
            request_id: 1,
            shards: 4,
            durable: false
        }
    );
    tx.send(Cmd::Send(0, describe(2, "nope"))).unwrap();
    match next(&mut rx).await.1 {
        Frame::Error {
            request_id: 2,
            code,
            ..
        } => assert_eq!(code, ErrorCode::UnknownStream.number()),
        other => panic!("expected unknown_stream, got {other:?}"),
    }
    // Malformed bytes on another bidi stream: a typed error there, the connection lives on.
    tx.send(Cmd::Send(
        4,
        Bytes::from_static(b"XX\x01\x03\0\0\0\0\0\0garbage"),
    ))
    .unwrap();
    match next(&mut rx).await {
        (4, Frame::Error { code, .. }) => assert_eq!(code, ErrorCode::InvalidFrame.number()),
        other => panic!("expected invalid_frame on stream 4, got {other:?}"),
    }
    // A frame declaring more than the maximum: frame_too_large from the header and the
    // request id alone (the body never comes).
    let mut big = Vec::from(&b"FX\x01\x03\0\0"[..]);
    big.extend_from_slice(&(u32::MAX).to_le_bytes());
    big.extend_from_slice(&77u64.to_le_bytes());
    tx.send(Cmd::Send(8, Bytes::from(big))).unwrap();
    match next(&mut rx).await {
        (
            8,
            Frame::Error {
                code, request_id, ..
            },
        ) => {
            assert_eq!(code, ErrorCode::FrameTooLarge.number());
            assert_eq!(request_id, 77, "the refusal names the request");
        }
        other => panic!("expected frame_too_large, got {other:?}"),
    }
    tx.send(Cmd::Send(0, describe(3, "events"))).unwrap();
    assert_eq!(
        next(&mut rx).await.1,
        Frame::StreamInfo {
            request_id: 3,
            shards: 4,
            durable: false
        }
    );
    // Another connection is served normally after the malformed frames.
    let other = b.client().await;
    let info = other
        .describe_stream(&StreamName::new("default", "default", "events"))
        .await
        .expect("the broker keeps serving other connections");
    assert_eq!(info.shards, 4);
    assert!(b.total("bad_frames") >= 2, "malformed frames counted");
    tx.send(Cmd::Close).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_spread_over_cores_and_untrusted_certs_are_refused() {
    let b = Broker::start(2, &[]);
    let ca = b.ca();
    let mut cores = std::collections::HashSet::new();
    for _ in 0..16 {
        let (tx, mut rx) = connect(&b, &ca).await;
        tx.send(Cmd::Send(0, hello())).unwrap();
        if let (_, Frame::HelloOk { core, .. }) = next(&mut rx).await {
            cores.insert(core);
        }
        tx.send(Cmd::Close).unwrap();
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
    let mut cfg = client_config(&Verify::CaFile(p.cert), &TransportConfig::default()).unwrap();
    let (itx, _irx) = mpsc::unbounded_channel();
    let (etx, erx) = tokio::sync::oneshot::channel();
    let _tx = spawn_client(
        b.quic,
        Some("localhost"),
        &mut cfg,
        DEFAULT_MAX_FRAME_BYTES,
        H {
            inbox: itx,
            established: Some(etx),
        },
    )
    .await
    .unwrap();
    assert!(!tokio::time::timeout(Duration::from_secs(3), erx)
        .await
        .map(|r| r.is_ok())
        .unwrap_or(false));
}

//! felix-client: the Rust client for Felix over QUIC (tokio).
//!
//! **State (first landing):** `Client::connect` (TLS 1.3 verified against a CA file, or an
//! explicit insecure mode), the Felix handshake, `describe_stream`, and a clean `close`, each
//! bounded by a timeout. Publish and subscribe land with the broker's shard runtime.

use felix_quic::conn::{ConnEvent, FelixConn};
use felix_quic::tls::{client_config, TransportConfig, Verify};
use felix_quic::tokio_driver::{spawn_client, Handler};
use felix_quic::wire::{features, ErrorCode, Frame, Limits, StreamName, DEFAULT_MAX_FRAME_BYTES};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Everything a client call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("connect to {0} failed: {1}")]
    Connect(SocketAddr, String),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("connection closed: {0}")]
    Closed(String),
    #[error("broker refused ({code}): {message}")]
    Broker { code: ErrorCode, message: String },
    #[error("broker answered with unknown error number {number}: {message}")]
    UnknownBrokerError { number: u16, message: String },
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("TLS configuration: {0}")]
    Tls(String),
}

/// Client settings.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub addr: SocketAddr,
    /// Name checked against the broker certificate (SNI + hostname verification).
    pub server_name: String,
    pub verify: Verify,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    pub close_timeout: Duration,
    pub transport: TransportConfig,
}

impl ClientConfig {
    /// Defaults for a broker at `addr` whose certificate is signed by `ca`.
    pub fn new(addr: SocketAddr, ca: Option<PathBuf>) -> Self {
        ClientConfig {
            addr,
            server_name: "localhost".into(),
            verify: ca.map(Verify::CaFile).unwrap_or(Verify::System),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            close_timeout: Duration::from_secs(2),
            transport: TransportConfig::default(),
        }
    }
}

/// What a stream looks like.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamInfo {
    pub shards: u32,
    pub durable: bool,
}

enum Cmd {
    Request {
        frame: Frame,
        request_id: u64,
        reply: oneshot::Sender<Result<Frame, Error>>,
    },
    Close {
        done: oneshot::Sender<()>,
    },
}

struct ConnHandler {
    established: Option<oneshot::Sender<()>>,
    pending: HashMap<u64, oneshot::Sender<Result<Frame, Error>>>,
    hello: Option<oneshot::Sender<Result<Frame, Error>>>,
    closing: Vec<oneshot::Sender<()>>,
}

fn request_id_of(f: &Frame) -> Option<u64> {
    match f {
        Frame::StreamInfo { request_id, .. }
        | Frame::Error { request_id, .. }
        | Frame::PublishAck { request_id, .. }
        | Frame::SubscribeOk { request_id, .. } => Some(*request_id),
        _ => None,
    }
}

impl Handler for ConnHandler {
    type Cmd = Cmd;
    fn on_established(&mut self, c: &mut FelixConn) {
        c.send_frame(
            0,
            &Frame::Hello {
                features: features::ALL,
                max_frame_bytes: DEFAULT_MAX_FRAME_BYTES as u32,
                client: "felix-rs".into(),
            },
        );
        if let Some(t) = self.established.take() {
            let _ = t.send(());
        }
    }
    fn on_event(&mut self, _c: &mut FelixConn, ev: ConnEvent) {
        let ConnEvent::Frame { frame, .. } = ev else {
            return;
        };
        if let Frame::HelloOk { .. } = frame {
            if let Some(h) = self.hello.take() {
                let _ = h.send(Ok(frame));
            }
            return;
        }
        if let Some(id) = request_id_of(&frame) {
            if let Some(tx) = self.pending.remove(&id) {
                let _ = tx.send(Ok(frame));
            } else if id == 0 {
                if let Some(h) = self.hello.take() {
                    let _ = h.send(Ok(frame));
                }
            }
        }
    }
    fn on_command(&mut self, c: &mut FelixConn, cmd: Cmd) {
        match cmd {
            Cmd::Request {
                frame,
                request_id,
                reply,
            } => {
                self.pending.insert(request_id, reply);
                c.send_frame(0, &frame);
            }
            Cmd::Close { done } => {
                c.close(0, "client close");
                self.closing.push(done);
            }
        }
    }
    fn before_flush(&mut self, _c: &mut FelixConn, _e: &mut Vec<ConnEvent>) {}
    fn on_closed(&mut self, reason: String) {
        for (_, tx) in self.pending.drain() {
            let _ = tx.send(Err(Error::Closed(reason.clone())));
        }
        if let Some(h) = self.hello.take() {
            let _ = h.send(Err(Error::Closed(reason.clone())));
        }
        for d in self.closing.drain(..) {
            let _ = d.send(());
        }
    }
}

/// A connection to one broker.
pub struct Client {
    tx: mpsc::UnboundedSender<Cmd>,
    cfg: ClientConfig,
    next_id: std::sync::atomic::AtomicU64,
    /// Limits the broker announced.
    pub limits: Limits,
    /// The broker core that holds this connection.
    pub core: u16,
}

fn broker_error(code: u16, message: String) -> Error {
    match ErrorCode::from_number(code) {
        Some(code) => Error::Broker { code, message },
        None => Error::UnknownBrokerError {
            number: code,
            message,
        },
    }
}

impl Client {
    /// Connect, complete TLS 1.3 and the Felix handshake within `connect_timeout`.
    pub async fn connect(cfg: ClientConfig) -> Result<Client, Error> {
        let mut qc =
            client_config(&cfg.verify, &cfg.transport).map_err(|e| Error::Tls(e.to_string()))?;
        let (etx, erx) = oneshot::channel();
        let (htx, hrx) = oneshot::channel();
        let handler = ConnHandler {
            established: Some(etx),
            pending: HashMap::new(),
            hello: Some(htx),
            closing: Vec::new(),
        };
        let tx = spawn_client(
            cfg.addr,
            Some(&cfg.server_name),
            &mut qc,
            DEFAULT_MAX_FRAME_BYTES,
            handler,
        )
        .await
        .map_err(|e| Error::Connect(cfg.addr, e.to_string()))?;
        let t = cfg.connect_timeout;
        let hello = tokio::time::timeout(t, async {
            erx.await.map_err(|_| {
                Error::Connect(
                    cfg.addr,
                    "handshake failed (certificate or ALPN refused)".into(),
                )
            })?;
            hrx.await
                .map_err(|_| Error::Closed("connection task ended".into()))?
        })
        .await
        .map_err(|_| Error::Timeout(t))??;
        match hello {
            Frame::HelloOk { limits, core, .. } => Ok(Client {
                tx,
                cfg,
                next_id: std::sync::atomic::AtomicU64::new(1),
                limits,
                core,
            }),
            Frame::Error { code, message, .. } => Err(broker_error(code, message)),
            other => Err(Error::Protocol(format!(
                "expected HelloOk, got kind {}",
                other.kind()
            ))),
        }
    }

    async fn request(&self, make: impl FnOnce(u64) -> Frame) -> Result<Frame, Error> {
        let request_id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Cmd::Request {
                frame: make(request_id),
                request_id,
                reply,
            })
            .map_err(|_| Error::Closed("connection task ended".into()))?;
        let t = self.cfg.request_timeout;
        match tokio::time::timeout(t, rx).await {
            Err(_) => Err(Error::Timeout(t)),
            Ok(Err(_)) => Err(Error::Closed("connection task ended".into())),
            Ok(Ok(r)) => r,
        }
    }

    /// Shard count and durability of a stream.
    pub async fn describe_stream(&self, stream: &StreamName) -> Result<StreamInfo, Error> {
        match self
            .request(|request_id| Frame::DescribeStream {
                request_id,
                stream: stream.clone(),
            })
            .await?
        {
            Frame::StreamInfo {
                shards, durable, ..
            } => Ok(StreamInfo { shards, durable }),
            Frame::Error { code, message, .. } => Err(broker_error(code, message)),
            other => Err(Error::Protocol(format!(
                "unexpected answer kind {}",
                other.kind()
            ))),
        }
    }

    /// Close cleanly, waiting at most `close_timeout` for the broker to acknowledge.
    pub async fn close(self) -> Result<(), Error> {
        let (done, rx) = oneshot::channel();
        if self.tx.send(Cmd::Close { done }).is_err() {
            return Ok(());
        }
        let t = self.cfg.close_timeout;
        match tokio::time::timeout(t, rx).await {
            Ok(_) => Ok(()),
            Err(_) => Err(Error::Timeout(t)),
        }
    }
}

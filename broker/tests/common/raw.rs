//! A raw Felix peer for wire tests: real QUIC + TLS to the real broker, but frames (or any
//! bytes) are written to stream ids the test picks, and everything the broker sends comes back
//! as it arrived, per stream. Nothing of the Rust client's logic is in the way.

use bytes::Bytes;
use felix_quic::conn::{ConnEvent, FelixConn};
use felix_quic::tls::{client_config, TransportConfig, Verify};
use felix_quic::tokio_driver::{spawn_client, Handler};
use felix_quic::wire::{features, Frame, FrameError};
use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::time::Duration;
use tokio::sync::mpsc;

/// What the peer saw.
#[derive(Debug)]
pub enum In {
    Frame(u64, Frame),
    /// A frame from the broker that did not decode (or was over this peer's maximum).
    Bad(u64, FrameError),
    Finished(u64),
    Reset(u64, u64),
    /// The connection closed; the reason as `code N reason` when the broker closed it.
    Closed(String),
}

enum Cmd {
    Send(u64, Bytes),
    Fin(u64),
    Pause(u64),
    Resume(u64),
    PeerMax(usize),
}

struct H {
    inbox: mpsc::UnboundedSender<In>,
    /// Told once: established, or why the connection closed before it was.
    established: Option<tokio::sync::oneshot::Sender<Result<(), String>>>,
}

impl Handler for H {
    type Cmd = Cmd;
    fn on_established(&mut self, _c: &mut FelixConn) {
        if let Some(t) = self.established.take() {
            let _ = t.send(Ok(()));
        }
    }
    fn on_event(&mut self, _c: &mut FelixConn, ev: ConnEvent) {
        let _ = self.inbox.send(match ev {
            ConnEvent::Frame { stream, frame } => In::Frame(stream, frame),
            ConnEvent::BadFrame { stream, error } => In::Bad(stream, error),
            ConnEvent::Finished { stream } => In::Finished(stream),
            ConnEvent::Reset { stream, code } => In::Reset(stream, code),
        });
    }
    fn on_command(&mut self, c: &mut FelixConn, cmd: Cmd) {
        match cmd {
            Cmd::Send(s, b) => c.send_bytes(s, b),
            Cmd::Fin(s) => c.finish(s),
            Cmd::Pause(s) => c.pause(s),
            Cmd::Resume(s) => {
                c.resume(s);
                let mut events = Vec::new();
                c.read_stream(s, &mut events);
                for ev in events {
                    self.on_event(c, ev);
                }
            }
            Cmd::PeerMax(n) => c.set_peer_max_frame_bytes(n),
        }
    }
    fn before_flush(&mut self, _c: &mut FelixConn, _e: &mut Vec<ConnEvent>) {}
    fn on_closed(&mut self, r: String) {
        if let Some(t) = self.established.take() {
            let _ = t.send(Err(r.clone()));
        }
        let _ = self.inbox.send(In::Closed(r));
    }
}

/// How long any one expected event may take.
const WAIT: Duration = Duration::from_secs(10);

pub struct Raw {
    tx: mpsc::UnboundedSender<Cmd>,
    rx: mpsc::UnboundedReceiver<In>,
    /// Frames already read but not yet asked for, per stream.
    held: HashMap<u64, VecDeque<Frame>>,
    /// Events other than frames, in arrival order.
    other: VecDeque<In>,
    pub closed: Option<String>,
}

impl Raw {
    /// Connect (TLS verified against `ca`); frames over `max_frame_bytes` from the broker show
    /// up as [`In::Bad`]. `uni_window_bytes` is the per-stream window granted to the broker's
    /// subscription streams.
    pub async fn connect(
        addr: std::net::SocketAddr,
        ca: &Path,
        max_frame_bytes: usize,
        uni_window_bytes: u64,
    ) -> Raw {
        Raw::try_connect(addr, ca, max_frame_bytes, uni_window_bytes)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// As [`Raw::connect`], but a handshake that does not complete (within 3 s) is an error.
    pub async fn try_connect(
        addr: std::net::SocketAddr,
        ca: &Path,
        max_frame_bytes: usize,
        uni_window_bytes: u64,
    ) -> Result<Raw, String> {
        let transport = TransportConfig {
            max_stream_data_uni_bytes: uni_window_bytes,
            ..TransportConfig::default()
        };
        Raw::connect_with(addr, ca, max_frame_bytes, &transport).await
    }

    /// Connect with these transport settings (windows, limits).
    pub async fn connect_with(
        addr: std::net::SocketAddr,
        ca: &Path,
        max_frame_bytes: usize,
        transport: &TransportConfig,
    ) -> Result<Raw, String> {
        let cfg = client_config(&Verify::CaFile(ca.to_path_buf()), transport).unwrap();
        Raw::connect_config(addr, "localhost", cfg, max_frame_bytes).await
    }

    /// Connect with a ready quiche config, checking the server's certificate names
    /// `server_name` (a peer link: `peer_client_config` and `node-<id>`).
    pub async fn connect_config(
        addr: std::net::SocketAddr,
        server_name: &str,
        mut cfg: quiche::Config,
        max_frame_bytes: usize,
    ) -> Result<Raw, String> {
        let (itx, irx) = mpsc::unbounded_channel();
        let (etx, erx) = tokio::sync::oneshot::channel();
        let h = H {
            inbox: itx,
            established: Some(etx),
        };
        let tx = spawn_client(addr, Some(server_name), &mut cfg, max_frame_bytes, h)
            .await
            .unwrap();
        match tokio::time::timeout(Duration::from_secs(3), erx).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(why))) => return Err(format!("the handshake failed: {why}")),
            Ok(Err(_)) => return Err("the handshake failed (connection closed)".into()),
            Err(_) => return Err("no QUIC handshake within 3 s".into()),
        }
        Ok(Raw {
            tx,
            rx: irx,
            held: HashMap::new(),
            other: VecDeque::new(),
            closed: None,
        })
    }

    /// Send `Hello` announcing `max_frame_bytes` and return the `HelloOk` (panics otherwise).
    pub async fn hello(&mut self, max_frame_bytes: u32) -> Frame {
        self.hello_with(hello_frame(max_frame_bytes)).await
    }

    /// Send this `Hello` and return the `HelloOk` (panics otherwise).
    pub async fn hello_with(&mut self, hello: Frame) -> Frame {
        self.send(0, &hello);
        let f = self.next_on(0).await;
        assert!(matches!(f, Frame::HelloOk { .. }), "HelloOk, got {f:?}");
        if let Frame::HelloOk { limits, .. } = &f {
            let _ = self.tx.send(Cmd::PeerMax(limits.max_frame_bytes as usize));
        }
        f
    }

    pub fn send(&self, stream: u64, f: &Frame) {
        self.send_raw(stream, f.encode().to_vec());
    }

    pub fn send_raw(&self, stream: u64, bytes: Vec<u8>) {
        let _ = self.tx.send(Cmd::Send(stream, Bytes::from(bytes)));
    }

    pub fn fin(&self, stream: u64) {
        let _ = self.tx.send(Cmd::Fin(stream));
    }

    /// Stop reading `stream` (flow control then holds the broker).
    pub fn pause(&self, stream: u64) {
        let _ = self.tx.send(Cmd::Pause(stream));
    }

    /// Read `stream` again.
    pub fn resume(&self, stream: u64) {
        let _ = self.tx.send(Cmd::Resume(stream));
    }

    /// Pull one event from the connection into the per-stream holds; false on timeout.
    async fn pump(&mut self, deadline: tokio::time::Instant) -> bool {
        match tokio::time::timeout_at(deadline, self.rx.recv()).await {
            Ok(Some(In::Frame(s, f))) => self.held.entry(s).or_default().push_back(f),
            Ok(Some(In::Closed(r))) => self.closed = Some(r),
            Ok(Some(ev)) => self.other.push_back(ev),
            Ok(None) => {
                if self.closed.is_none() {
                    self.closed = Some("driver ended".into());
                }
                return false;
            }
            Err(_) => return false,
        }
        true
    }

    /// The next frame the broker sent on `stream`.
    pub async fn next_on(&mut self, stream: u64) -> Frame {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if let Some(f) = self.held.get_mut(&stream).and_then(|q| q.pop_front()) {
                return f;
            }
            self.assert_no_bad();
            if !self.pump(deadline).await {
                panic!(
                    "no frame on stream {stream} (closed: {:?}; other streams: {:?})",
                    self.closed, self.held
                );
            }
        }
    }

    /// The next frame on any server-opened unidirectional stream (id % 4 == 3): its stream
    /// and the frame.
    pub async fn next_server_uni(&mut self) -> (u64, Frame) {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if let Some((s, q)) = self
                .held
                .iter_mut()
                .filter(|(s, q)| *s % 4 == 3 && !q.is_empty())
                .min_by_key(|(s, _)| **s)
            {
                return (*s, q.pop_front().unwrap());
            }
            self.assert_no_bad();
            assert!(self.pump(deadline).await, "no frame on a server stream");
        }
    }

    /// Wait for the broker to close the connection; its `code N reason` text.
    pub async fn wait_closed(&mut self) -> String {
        let deadline = tokio::time::Instant::now() + WAIT;
        while self.closed.is_none() {
            if !self.pump(deadline).await && self.closed.is_none() {
                panic!("connection still open; held: {:?}", self.held);
            }
        }
        self.closed.clone().unwrap()
    }

    /// Fail if the broker sent anything this peer could not read.
    pub fn assert_no_bad(&self) {
        for ev in &self.other {
            if let In::Bad(s, e) = ev {
                panic!("the broker sent an unreadable frame on stream {s}: {e:?}");
            }
        }
    }
}

/// The raw peer's Hello: every feature but the watch mux (its watches get a stream each, as
/// the per-watch layout is written; `hello_with` asks for the mux).
pub fn hello_frame(max_frame_bytes: u32) -> Frame {
    Frame::Hello {
        features: features::ALL & !features::WATCH_MUX & !features::SUB_MUX,
        max_frame_bytes,
        client: "raw-test".into(),
    }
}

//! One core's runtime: its UDP socket, QUIC endpoint, sessions and the core mesh.
//!
//! Three tasks per core, all on the core's glommio executor: the receive loop (never
//! cancelled, so no datagram is lost to cancellation), the mesh receivers, and the flusher
//! that writes packets when woken or when the earliest connection timer expires.

use crate::catalog::Catalog;
use crate::metrics::CoreCounters;
use felix_quic::conn::{ConnEvent, FelixConn};
use felix_quic::glommio_driver::{wake_pair, DatagramIo, GlommioUdp, Wake, WakeRx};
use felix_quic::server::{ConnKey, Endpoint, Route, TxBatch};
use felix_quic::wire::{features, ErrorCode, Frame, Limits};
use glommio::channels::channel_mesh::{Receivers, Senders};
use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Messages between cores.
pub enum MeshMsg {
    /// A datagram for a connection that lives on the receiving core.
    Packet { buf: Vec<u8>, from: SocketAddr },
}

/// Static settings of a core.
pub struct CoreSettings {
    pub cores: u8,
    pub max_frame_bytes: usize,
    pub max_payload_bytes: u32,
    pub max_subscriptions: u32,
    pub catalog: Arc<Catalog>,
    pub counters: Arc<CoreCounters>,
    pub shutdown: Arc<AtomicBool>,
}

#[derive(Default)]
struct Session {
    hello_done: bool,
}

struct CoreState {
    id: u8,
    ep: Endpoint,
    sessions: HashMap<ConnKey, Session>,
    s: CoreSettings,
    mesh_overflow: Vec<std::collections::VecDeque<MeshMsg>>,
}

/// Run one core until shutdown. `sock` is this core's SO_REUSEPORT socket.
pub async fn run_core(
    sock: socket2::Socket,
    quic_config: quiche::Config,
    settings: CoreSettings,
    mesh: (Senders<MeshMsg>, Receivers<MeshMsg>),
) {
    let (senders, mut receivers) = mesh;
    let id = senders.peer_id() as u8;
    let sock = Rc::new(GlommioUdp::new(sock));
    let local = sock.local_addr().expect("bound socket");
    let ep = Endpoint::new(
        id,
        settings.cores,
        quic_config,
        local,
        settings.max_frame_bytes,
    );
    let n = settings.cores as usize;
    let state = Rc::new(RefCell::new(CoreState {
        id,
        ep,
        sessions: HashMap::new(),
        s: settings,
        mesh_overflow: (0..n).map(|_| Default::default()).collect(),
    }));
    let senders = Rc::new(senders);
    let (wake, wake_rx) = wake_pair();
    let (mesh_wake, mesh_wake_rx) = wake_pair();

    // Mesh receivers: one task per peer.
    for (_peer, rx) in receivers.streams() {
        let state = state.clone();
        let wake = wake.clone();
        let sock = sock.clone();
        glommio::spawn_local(async move {
            use futures_lite::StreamExt;
            let mut rx = rx;
            while let Some(msg) = rx.next().await {
                let reply = state.borrow_mut().on_mesh(msg);
                if let Some((buf, to)) = reply {
                    let _ = sock.send_one(&buf, to).await;
                }
                wake.wake();
            }
        })
        .detach();
    }

    // Mesh pump: sends what try_send could not (a full channel is awaited here, never in the
    // receive path, so two cores cannot wedge each other).
    {
        let state = state.clone();
        let senders = senders.clone();
        glommio::spawn_local(async move {
            loop {
                mesh_wake_rx.wait(Some(Duration::from_millis(50))).await;
                loop {
                    let next = {
                        let mut st = state.borrow_mut();
                        st.mesh_overflow
                            .iter_mut()
                            .enumerate()
                            .find_map(|(i, q)| q.pop_front().map(|m| (i, m)))
                    };
                    let Some((to, msg)) = next else { break };
                    if senders.send_to(to, msg).await.is_err() {
                        break;
                    }
                }
            }
        })
        .detach();
    }

    // Receive loop.
    {
        let state = state.clone();
        let wake = wake.clone();
        let sock = sock.clone();
        let senders = senders.clone();
        let mesh_wake = mesh_wake.clone();
        glommio::spawn_local(async move {
            let mut buf = vec![0u8; 65536];
            loop {
                let (len, from) = match sock.recv(&mut buf).await {
                    Ok(v) => v,
                    Err(_) => continue,
                };
                let reply = {
                    let mut st = state.borrow_mut();
                    CoreCounters::inc(&st.s.counters.packets_received);
                    st.on_datagram(&mut buf[..len], from, false, &senders, &mesh_wake)
                };
                if let Some(r) = reply {
                    let _ = sock.send_one(&r, from).await;
                }
                wake.wake();
            }
        })
        .detach();
    }

    flusher(state, sock, wake_rx, wake).await;
}

async fn flusher(
    state: Rc<RefCell<CoreState>>,
    sock: Rc<GlommioUdp>,
    wake_rx: WakeRx,
    _wake: Wake,
) {
    let mut batch = TxBatch::new(64);
    let mut closing_since: Option<Instant> = None;
    loop {
        let shutdown = state.borrow().s.shutdown.load(Ordering::Acquire);
        if shutdown && closing_since.is_none() {
            closing_since = Some(Instant::now());
            let mut st = state.borrow_mut();
            st.ep.set_accepting(false);
            for k in st.ep.keys() {
                if let Some(e) = st.ep.get(k) {
                    e.conn.close(
                        ErrorCode::ShuttingDown.number() as u64,
                        "broker shutting down",
                    );
                }
                st.ep.mark_dirty(k);
            }
        }
        loop {
            batch.clear();
            let now = Instant::now();
            {
                let mut st = state.borrow_mut();
                st.ep.on_timeouts(now);
                for k in st.ep.take_dirty() {
                    if let Some(e) = st.ep.get(k) {
                        e.conn.flush_streams();
                    }
                    if !st.ep.transmit(k, now, &mut batch) {
                        break;
                    }
                }
                for k in st.ep.reap_closed() {
                    st.sessions.remove(&k);
                    CoreCounters::inc(&st.s.counters.connections_closed);
                }
            }
            if batch.is_empty() {
                break;
            }
            sock.send_batch(&batch).await;
        }
        if let Some(t) = closing_since {
            let st = state.borrow();
            if st.ep.conn_count() == 0 || t.elapsed() > Duration::from_secs(2) {
                return;
            }
        }
        let timeout = state.borrow().ep.next_timeout(Instant::now());
        let timeout = Some(
            timeout
                .unwrap_or(Duration::from_millis(100))
                .min(Duration::from_millis(100)),
        );
        wake_rx.wait(timeout).await;
    }
}

impl CoreState {
    fn mesh_send(&mut self, to: usize, msg: MeshMsg, senders: &Senders<MeshMsg>, pump: &Wake) {
        if !self.mesh_overflow[to].is_empty() {
            self.mesh_overflow[to].push_back(msg);
            pump.wake();
            return;
        }
        match senders.try_send_to(to, msg) {
            Ok(()) => {}
            Err(glommio::GlommioError::WouldBlock(glommio::ResourceType::Channel(msg))) => {
                self.mesh_overflow[to].push_back(msg);
                pump.wake();
            }
            // Closed peer (shutdown) or a send to self: nothing can carry it any more.
            Err(_) => {}
        }
    }

    fn on_mesh(&mut self, msg: MeshMsg) -> Option<(Vec<u8>, SocketAddr)> {
        match msg {
            MeshMsg::Packet { mut buf, from } => {
                CoreCounters::inc(&self.s.counters.packets_forwarded_in);
                match self.ep.on_datagram(&mut buf, from, true) {
                    Route::Conn { key, new } => self.after_recv(key, new),
                    Route::Reply(r) => return Some((r, from)),
                    _ => {}
                }
                None
            }
        }
    }

    fn on_datagram(
        &mut self,
        buf: &mut [u8],
        from: SocketAddr,
        forwarded: bool,
        senders: &Senders<MeshMsg>,
        pump: &Wake,
    ) -> Option<Vec<u8>> {
        match self.ep.on_datagram(buf, from, forwarded) {
            Route::Conn { key, new } => self.after_recv(key, new),
            Route::Forward(core) => {
                CoreCounters::inc(&self.s.counters.packets_forwarded_out);
                self.mesh_send(
                    core as usize,
                    MeshMsg::Packet {
                        buf: buf.to_vec(),
                        from,
                    },
                    senders,
                    pump,
                );
            }
            Route::Reply(r) => return Some(r),
            Route::Dropped => {}
        }
        None
    }

    fn after_recv(&mut self, key: ConnKey, new: bool) {
        if new {
            CoreCounters::inc(&self.s.counters.connections_accepted);
            self.sessions.insert(key, Session::default());
        }
        let mut events = Vec::new();
        let Some(e) = self.ep.get(key) else { return };
        e.conn.poll_readable(&mut events);
        for ev in events {
            self.on_event(key, ev);
        }
    }

    fn on_event(&mut self, key: ConnKey, ev: ConnEvent) {
        let id = self.id;
        let counters = self.s.counters.clone();
        let max_frame = self.s.max_frame_bytes as u32;
        let limits = Limits {
            max_frame_bytes: max_frame,
            max_payload_bytes: self.s.max_payload_bytes,
            max_subscriptions: self.s.max_subscriptions,
        };
        let catalog = self.s.catalog.clone();
        let Some(session) = self.sessions.get_mut(&key) else {
            return;
        };
        let Some(e) = self.ep.get(key) else { return };
        let conn: &mut FelixConn = &mut e.conn;
        match ev {
            ConnEvent::Frame { stream, frame } => {
                CoreCounters::inc(&counters.frames_received);
                let reply_stream = if stream % 4 == 0 { Some(stream) } else { None };
                let err = |conn: &mut FelixConn, rid: u64, code: ErrorCode, msg: String| {
                    CoreCounters::inc(&counters.errors_sent);
                    conn.send_frame(reply_stream.unwrap_or(0), &Frame::error(rid, code, msg));
                };
                if !session.hello_done {
                    match frame {
                        Frame::Hello { features: f, .. } => {
                            session.hello_done = true;
                            conn.send_frame(
                                stream,
                                &Frame::HelloOk {
                                    features: f & features::ALL,
                                    limits,
                                    core: id as u16,
                                    server: concat!("felix-broker/", env!("CARGO_PKG_VERSION"))
                                        .into(),
                                },
                            );
                        }
                        _ => err(
                            conn,
                            0,
                            ErrorCode::InvalidRequest,
                            "the first frame must be Hello".into(),
                        ),
                    }
                    return;
                }
                match frame {
                    Frame::DescribeStream { request_id, stream: name } => match catalog.lookup(&name) {
                        Ok((_, def)) => conn.send_frame(
                            stream,
                            &Frame::StreamInfo { request_id, shards: def.shards, durable: false },
                        ),
                        Err((code, msg)) => err(conn, request_id, code, msg),
                    },
                    Frame::Publish { request_id, .. } | Frame::Subscribe { request_id, .. } => err(
                        conn,
                        request_id,
                        ErrorCode::Unsupported,
                        "publish/subscribe are not served by this build yet (shard runtime pending)".into(),
                    ),
                    Frame::Unknown { .. } => {}
                    Frame::Hello { .. } => err(conn, 0, ErrorCode::InvalidRequest, "Hello sent twice".into()),
                    other => err(conn, 0, ErrorCode::InvalidRequest, format!("unexpected frame kind {}", other.kind())),
                }
            }
            ConnEvent::BadFrame { stream, error } => {
                CoreCounters::inc(&counters.bad_frames);
                CoreCounters::inc(&counters.errors_sent);
                // Answer on the offending bidi stream, else on the control stream.
                let to = if stream % 4 == 0 { stream } else { 0 };
                conn.send_frame(to, &Frame::error(0, error.code(), error.to_string()));
            }
            ConnEvent::Finished { stream } => {
                if stream % 4 == 0 && stream != 0 {
                    conn.finish(stream);
                }
            }
            ConnEvent::Reset { .. } => {}
        }
    }
}

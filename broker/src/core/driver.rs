//! The core's driver tasks: `run_core` builds the core's state and starts the receive loop
//! (never cancelled, so no datagram is lost to cancellation), one mesh receiver per peer, the
//! mesh pump, and the flusher, which writes packets when woken or when the earliest timer
//! expires and walks the shutdown phases. These are the only tasks of the core's own loop and
//! its only clock reads; the hosts they step are pure.

use super::*;
use crate::core::shard::caches::{CacheHost, CacheHostCfg};
use crate::core::shard::groups::{GroupHost, GroupHostCfg};

/// The peer side of a core: its SO_REUSEPORT socket on the peer listener, its own socket for
/// dialing peers, and the two mutual-TLS configs.
pub struct PeerSockets {
    pub listen: socket2::Socket,
    pub dial: socket2::Socket,
    pub server: quiche::Config,
    pub client: quiche::Config,
}

/// A core's sockets, by kind ([`Sock`]); the peer ones only with a peer listener.
#[derive(Clone)]
struct Socks([Option<Rc<GlommioUdp>>; SOCKS]);

impl Socks {
    fn get(&self, sock: Sock) -> &Rc<GlommioUdp> {
        self.0[sock as usize]
            .as_ref()
            .expect("a connection lives only on a socket the core has")
    }
}

/// Run one core until shutdown. `sock` is this core's SO_REUSEPORT client socket.
pub async fn run_core(
    sock: socket2::Socket,
    quic_config: quiche::Config,
    settings: CoreSettings,
    mesh: (Senders<MeshMsg>, Receivers<MeshMsg>),
    peer: Option<PeerSockets>,
) {
    let (senders, mut receivers) = mesh;
    let id = senders.peer_id() as u8;
    let client_sock = Rc::new(GlommioUdp::new(sock));
    let local = client_sock.local_addr().expect("bound socket");
    let mut ep = Endpoint::new(
        id,
        settings.cores,
        quic_config,
        local,
        settings.cfg.max_frame_bytes,
    );
    let mut socks = Socks([Some(client_sock), None, None]);
    if let Some(p) = peer {
        let listen = Rc::new(GlommioUdp::new(p.listen));
        let dial = Rc::new(GlommioUdp::new(p.dial));
        ep.set_peer(PeerSide {
            listen: listen.local_addr().expect("bound socket"),
            dial: dial.local_addr().expect("bound socket"),
            server: p.server,
            client: p.client,
        });
        socks.0[Sock::PeerListen as usize] = Some(listen);
        socks.0[Sock::PeerDial as usize] = Some(dial);
    }
    let senders = Rc::new(senders);
    let (wake, wake_rx) = wake_pair();
    let (mesh_wake, mesh_wake_rx) = wake_pair();
    let has_peer = socks.0[Sock::PeerListen as usize].is_some();
    let state = CoreState::new(
        id,
        ep,
        settings,
        senders.clone(),
        (wake.clone(), mesh_wake),
        has_peer,
    );
    open_durable_shards(&state).await;
    state.borrow().s.started.fetch_add(1, Ordering::AcqRel);
    for (_peer, rx) in receivers.streams() {
        spawn_mesh_receiver(state.clone(), rx, wake.clone(), socks.clone());
    }
    spawn_mesh_pump(state.clone(), senders, mesh_wake_rx);
    spawn_report_doorbell(&state);
    for kind in [Sock::Client, Sock::PeerListen, Sock::PeerDial] {
        if let Some(sock) = &socks.0[kind as usize] {
            spawn_receive_loop(state.clone(), wake.clone(), sock.clone(), kind);
        }
    }
    flusher(state, socks, wake_rx).await;
}

impl CoreState {
    fn new(
        id: u8,
        ep: Endpoint,
        settings: CoreSettings,
        senders: Rc<Senders<MeshMsg>>,
        (wake, mesh_wake): (Wake, Wake),
        has_peer: bool,
    ) -> Rc<RefCell<CoreState>> {
        let n = settings.cores as usize;
        let links = has_peer.then(|| {
            let cfg = &settings.cfg;
            peer::Links::new(peer::LinksCfg {
                node_id: cfg.node_id,
                max_frame_bytes: cfg.max_frame_bytes as u32,
                connect_timeout: Duration::from_millis(cfg.peer_connect_timeout_ms),
                forward_timeout: Duration::from_millis(cfg.forward_timeout_ms),
                forwards_max: cfg.peer_forwards_max as usize,
            })
        });
        // The core starts from an empty catalog, and its first round takes the published one
        // as a change from nothing: what that version asks of this core (replicas to host,
        // durable logs to open) is done even when it was published before the core started.
        // (Loading it here skipped that: a broker restarted on a quiet cluster never hosted
        // its replicas, tests/replication_faults.rs.) No version is u64::MAX.
        let (catalog_version, catalog) = (u64::MAX, Arc::new(crate::catalog::Catalog::default()));
        let streams = StreamHost::new(HostCfg {
            cores: n,
            ring_records_max: settings.cfg.ring_records_max as u64,
            ring_bytes_max: settings.cfg.ring_bytes_max,
            publish_timeout_ms: settings.cfg.publish_timeout_ms,
        });
        let caches = CacheHost::new(CacheHostCfg::of(&settings.cfg));
        let settings_cfg = settings.cfg.clone();
        let state = Rc::new(RefCell::new(CoreState {
            id,
            catalog,
            catalog_version,
            ep,
            sessions: IdMap::default(),
            s: settings,
            senders,
            mesh_wake,
            mesh_overflow: (0..n).map(|_| Default::default()).collect(),
            inbox: VecDeque::new(),
            streams,
            subs: Default::default(),
            rr: HashMap::new(),
            next_sub: 1,
            me: Weak::new(),
            wake,
            draining: false,
            closing_logs: false,
            groups: GroupHost::new(GroupHostCfg::of(&settings_cfg), Instant::now()),
            group_tasks: TaskGate::default(),
            caches,
            watches: Default::default(),
            gauges_at: Instant::now(),
            hello_waits: VecDeque::new(),
            forward_principals: HashMap::new(),
            revocations_seen: 0,
            auth_checked_at: Instant::now(),
            closes_due: VecDeque::new(),
            links,
            replicas: Default::default(),
        }));
        state.borrow_mut().me = Rc::downgrade(&state);
        state
    }
}

/// One task per peer core: hand what arrives to the core.
fn spawn_mesh_receiver(
    state: Rc<RefCell<CoreState>>,
    mut rx: impl futures_lite::Stream<Item = MeshMsg> + Unpin + 'static,
    wake: Wake,
    socks: Socks,
) {
    glommio::spawn_local(async move {
        use futures_lite::StreamExt;
        while let Some(msg) = rx.next().await {
            let reply = {
                let mut st = state.borrow_mut();
                if matches!(msg, MeshMsg::Conn(ToConn::Delivery { .. })) {
                    CoreCounters::inc(&st.s.counters.mesh_deliveries_in);
                }
                let r = st.on_mesh(msg);
                st.drain_inbox();
                r
            };
            if let Some((buf, to, kind)) = reply {
                let _ = socks.get(kind).send_one(&buf, to).await;
            }
            wake.wake();
        }
    })
    .detach();
}

/// The mesh pump: sends what `route` could not try-send (a full channel is awaited here,
/// never in a handler, so two cores cannot wedge each other).
fn spawn_mesh_pump(
    state: Rc<RefCell<CoreState>>,
    senders: Rc<Senders<MeshMsg>>,
    mesh_wake_rx: WakeRx,
) {
    glommio::spawn_local(async move {
        loop {
            mesh_wake_rx.wait(Some(timers::MESH_POLL)).await;
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

/// The doorbell the ops thread rings when the control plane answers one of this core's
/// replica reports (`replica_reports.rs`): the answers go to their replicas at once, not at
/// the next poll. Only with a control plane (reports); a doorbell that cannot be bound
/// leaves the poll alone, and says so.
fn spawn_report_doorbell(state: &Rc<RefCell<CoreState>>) {
    let (reports, id) = {
        let st = state.borrow();
        let Some(r) = st.s.reports.clone() else {
            return;
        };
        (r, st.id as usize)
    };
    let sock = match glommio::net::UdpSocket::bind("127.0.0.1:0") {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(core = id, error = %e, "no report doorbell: report answers are polled for");
            return;
        }
    };
    let Ok(port) = sock.local_addr().map(|a| a.port()) else {
        return;
    };
    reports.set_doorbell(id, port);
    let me = Rc::downgrade(state);
    glommio::spawn_local(async move {
        let mut buf = [0u8; 64];
        loop {
            if let Err(e) = sock.recv_from(&mut buf).await {
                tracing::warn!(core = id, error = %e, "the report doorbell failed: report answers are polled for");
                return;
            }
            if me.strong_count() == 0 {
                return;
            }
            crate::replica_reports::DOORBELLS_HEARD.fetch_add(1, Ordering::Relaxed);
            reenter(&me, |st| st.replica_answers_tick());
        }
    })
    .detach();
}

/// The receive loop of one socket: datagrams (GRO-coalesced reads cut into segments) into
/// the endpoint.
fn spawn_receive_loop(state: Rc<RefCell<CoreState>>, wake: Wake, sock: Rc<GlommioUdp>, kind: Sock) {
    glommio::spawn_local(async move {
        // Room for the largest GRO-coalesced read (64 KiB of datagrams).
        let mut buf = vec![0u8; 1 << 17];
        loop {
            let (len, from, segment) = match sock.recv(&mut buf).await {
                Ok(v) => v,
                Err(_) => continue,
            };
            for seg in felix_quic::udp::gro_segments(len, segment) {
                let reply = {
                    let mut st = state.borrow_mut();
                    CoreCounters::inc(&st.s.counters.packets_received);
                    let r = st.on_datagram(&mut buf[seg], from, kind);
                    st.drain_inbox();
                    r
                };
                if let Some(r) = reply {
                    let _ = sock.send_one(&r, from).await;
                }
            }
            wake.wake();
        }
    })
    .detach();
}

/// Re-enter the core after a task awaited: run `f` on the state (unless the core is gone),
/// then handle what it queued for this core and wake the flusher to send it.
pub(in crate::core) fn reenter(me: &Weak<RefCell<CoreState>>, f: impl FnOnce(&mut CoreState)) {
    let Some(st) = me.upgrade() else { return };
    let mut st = st.borrow_mut();
    f(&mut st);
    st.drain_inbox();
    st.wake.wake();
}

/// Shutdown phases of a core's flusher.
enum Drain {
    Serving,
    /// Refusing new publishes, answering those in flight (until idle or the deadline).
    Answering {
        since: Instant,
    },
    /// Logs closed; every subscription and watch was ended `shutting_down` (the going-away
    /// notice) and gets a moment to flush before the connections close.
    Notified {
        since: Instant,
    },
    /// Connections told `shutting_down`; waiting for them to close.
    Closing {
        since: Instant,
    },
}

async fn flusher(state: Rc<RefCell<CoreState>>, socks: Socks, wake_rx: WakeRx) {
    // 64 packets of ~1.3 KiB, or ~31 of 16 KiB, per round (packets are packed end to end);
    // one batch per socket kind (the peer ones stay empty without a peer listener).
    let mut batches: Vec<TxBatch> = (0..SOCKS).map(|_| TxBatch::new(64, 1 << 20)).collect();
    let mut drain = Drain::Serving;
    loop {
        drain = drain_phase(&state, drain).await;
        loop {
            batches.iter_mut().for_each(TxBatch::clear);
            flush_round(&mut state.borrow_mut(), &mut batches);
            if batches.iter().all(TxBatch::is_empty) {
                break;
            }
            for kind in [Sock::Client, Sock::PeerListen, Sock::PeerDial] {
                let batch = &batches[kind as usize];
                if !batch.is_empty() {
                    socks.get(kind).send_batch(batch).await;
                }
            }
        }
        if let Drain::Closing { since } = drain {
            let st = state.borrow();
            let close_ms = st.s.cfg.drain_timeout_ms / 2;
            if st.ep.conn_count() == 0 || since.elapsed() > Duration::from_millis(close_ms) {
                return;
            }
        }
        let wait = next_wait(&state.borrow(), &drain);
        wake_rx.wait(Some(wait)).await;
        // Publishes on this core's durable shards wait for their commit: let the committer
        // (an inline page-cache write finishes in its turn) and then the commit watcher run
        // before flushing, so the QUIC ACK of the publish packets and the PublishAcks leave
        // together (one sendmsg and one wake-up of the client instead of two). Bounded: a
        // commit still in flight after two turns is not waited for.
        for _ in 0..2 {
            if !state.borrow().commit_pending() {
                break;
            }
            futures_lite::future::yield_now().await;
        }
    }
}

/// Move the shutdown phases on: start draining when shutdown is asked, close the logs once
/// no core owes an answer (or at half the drain deadline), then close the connections once
/// the going-away notices flushed.
async fn drain_phase(state: &Rc<RefCell<CoreState>>, mut drain: Drain) -> Drain {
    let shutdown = state.borrow().s.shutdown.load(Ordering::Acquire);
    if shutdown && matches!(drain, Drain::Serving) {
        let mut st = state.borrow_mut();
        st.ep.set_accepting(false);
        st.draining = true;
        st.groups.set_draining();
        st.links_drain();
        drain = Drain::Answering {
            since: Instant::now(),
        };
    }
    if let Drain::Answering { since } = drain {
        let deadline_ms = state.borrow().s.cfg.drain_timeout_ms;
        // Every core publishes whether it still owes an answer; logs close only once no
        // core does, so an owner core keeps serving a peer's forwarded publishes (an
        // obligation shows on the core that owes it: the connection core until it gets
        // the result, the owner while it holds or commits).
        let idle = {
            let st = state.borrow();
            let mine = st.drain_idle();
            st.s.drain_idle[st.id as usize].store(mine, Ordering::Release);
            mine && st.s.drain_idle.iter().all(|f| f.load(Ordering::Acquire))
        };
        if idle || since.elapsed() > Duration::from_millis(deadline_ms / 2) {
            if !idle {
                tracing::warn!(
                    core = state.borrow().id,
                    "drain deadline: closing with publishes unanswered"
                );
                state.borrow().s.drain_forced.store(true, Ordering::Release);
            }
            // Flush and fsync every log this core owns before telling clients we go.
            let logs: Vec<Log> = {
                let mut st = state.borrow_mut();
                st.closing_logs = true;
                st.caches.set_closing();
                let mut logs: Vec<Log> = st.streams.begin_close();
                logs.extend(st.cache_logs());
                logs.extend(st.close_replicas());
                logs
            };
            for log in logs {
                if let Err(e) = log.close().await {
                    state
                        .borrow()
                        .s
                        .log_close_failed
                        .store(true, Ordering::Release);
                    tracing::error!(error = %e, "durable log did not close cleanly");
                }
            }
            state.borrow_mut().notify_going_away();
            drain = Drain::Notified {
                since: Instant::now(),
            };
        }
    }
    if let Drain::Notified { since } = drain {
        let mut st = state.borrow_mut();
        let flushed = st
            .ep
            .keys()
            .into_iter()
            .all(|k| st.ep.get(k).is_none_or(|e| e.conn.queued_total() == 0));
        if flushed || since.elapsed() > timers::NOTIFY_FLUSH {
            for k in st.ep.keys() {
                if let Some(e) = st.ep.get(k) {
                    e.conn.close(
                        ErrorCode::ShuttingDown.number() as u64,
                        "broker shutting down",
                    );
                }
                st.ep.mark_dirty(k);
            }
            drain = Drain::Closing {
                since: Instant::now(),
            };
        }
    }
    drain
}

/// One round of the flusher: the timers that came due, then the packets of the connections
/// dirty at the start of the round, into the batch of each one's socket.
fn flush_round(st: &mut CoreState, batches: &mut [TxBatch]) {
    let now = Instant::now();
    st.refresh_catalog();
    st.links_tick(now);
    st.replica_answers_tick();
    st.replica_held_tick();
    st.with_streams(|h, ctx| h.tick(ctx));
    st.groups_tick();
    st.caches_tick();
    st.gauges_tick(now);
    st.expire_hellos(now);
    st.expire_principals(now);
    st.drain_inbox();
    st.ep.on_timeouts(now);
    // Round robin over the connections dirty at the start of this round (those dirtied
    // meanwhile wait for the next): one that fills the batch goes to the back, and the ones
    // not reached stay queued in order.
    for _ in 0..st.ep.dirty_count() {
        let Some(k) = st.ep.pop_dirty() else { break };
        st.flush_conn(k);
        let Some(sock) = st.ep.peek(k).map(|e| e.sock) else {
            continue;
        };
        if !st.ep.transmit(k, now, &mut batches[sock as usize]) {
            st.ep.mark_dirty(k);
            break;
        }
    }
    st.drain_inbox();
    for (k, why) in st.ep.reap_closed() {
        if st.is_link(k) {
            st.on_link_closed(k, why);
            continue;
        }
        st.on_conn_closed(k);
        CoreCounters::inc(&st.s.counters.connections_closed);
    }
    st.drain_inbox();
}

/// How long the flusher may sleep: until the earliest timer (QUIC, groups, caches, a held
/// publish's deadline), capped shorter while publishes are held or the core drains.
fn next_wait(st: &CoreState, drain: &Drain) -> Duration {
    let now = Instant::now();
    let timeout = [
        st.ep.next_timeout(now),
        st.group_timeout(),
        st.cache_timeout(),
        // The first held publish to time out.
        st.streams
            .next_deadline()
            .map(|d| d.saturating_duration_since(now)),
        st.links_deadline()
            .map(|d| d.saturating_duration_since(now)),
    ]
    .into_iter()
    .flatten()
    .min();
    let cap = if st.streams.held_total() > 0 || !matches!(drain, Drain::Serving) {
        timers::FLUSH_WAIT_BUSY
    } else if st
        .s
        .reports
        .as_ref()
        .is_some_and(|r| r.awaited(st.id as usize))
    {
        timers::REPORT_ANSWER_POLL
    } else {
        timers::FLUSH_WAIT_IDLE
    };
    timeout.unwrap_or(cap).min(cap)
}

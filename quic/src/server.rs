//! Runtime-agnostic server endpoint of one core: the connection table, accepting new
//! connections, routing packets by the core id in their destination connection id, and
//! collecting outgoing packets. Time is passed in (`now`), never read here.

use crate::conn::{connection_id_for_core, BytesFactory, FelixConn};
use crate::CONN_ID_LEN;
use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Stable handle of a connection on its core.
pub type ConnKey = u64;

/// What to do with a received datagram.
#[derive(Debug, PartialEq, Eq)]
pub enum Route {
    /// Fed to the connection `key` (`new` if it was just accepted).
    Conn { key: ConnKey, new: bool },
    /// Belongs to a connection of another core: hand the packet to that core.
    Forward(u8),
    /// Send this reply (version negotiation) back to the sender.
    Reply(Vec<u8>),
    /// Not ours or not valid: ignored (QUIC tolerates loss; nothing is answered to junk).
    Dropped,
}

/// Which of a core's sockets a connection lives on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Sock {
    /// The client listener (SO_REUSEPORT, one per core).
    Client = 0,
    /// The peer listener: other brokers dial it (SO_REUSEPORT, one per core; mutual TLS).
    PeerListen = 1,
    /// This core's own socket for dialing peers (an ephemeral port, so every answer comes
    /// back to the core that dialed: nothing to route, nothing to accept).
    PeerDial = 2,
}

/// How many kinds of socket a core has.
pub const SOCKS: usize = 3;

/// The peer side of an endpoint: its two sockets' addresses and the two TLS configs.
pub struct PeerSide {
    pub listen: SocketAddr,
    pub dial: SocketAddr,
    /// Accepts dialers that present a certificate of the cluster CA.
    pub server: quiche::Config,
    /// Dials with this node's certificate, verifying the listener's.
    pub client: quiche::Config,
}

/// A connection and its bookkeeping.
pub struct ConnEntry {
    pub conn: FelixConn,
    pub peer: SocketAddr,
    /// The socket it lives on.
    pub sock: Sock,
    cids: Vec<Vec<u8>>,
    deadline: Option<Instant>,
}

/// One core's QUIC endpoint.
pub struct Endpoint {
    core: u8,
    cores: u8,
    config: quiche::Config,
    local: SocketAddr,
    peer: Option<PeerSide>,
    max_frame_bytes: usize,
    accepting: bool,
    conns: HashMap<ConnKey, ConnEntry>,
    by_cid: HashMap<Vec<u8>, ConnKey>,
    next_key: ConnKey,
    /// Connections with output, in the order they became dirty (round robin: a connection
    /// that filled a batch goes behind those still waiting).
    dirty: DirtyList,
    max_conns: usize,
}

impl Endpoint {
    pub fn new(
        core: u8,
        cores: u8,
        config: quiche::Config,
        local: SocketAddr,
        max_frame_bytes: usize,
    ) -> Self {
        Endpoint {
            core,
            cores,
            config,
            local,
            peer: None,
            max_frame_bytes,
            accepting: true,
            conns: HashMap::new(),
            by_cid: HashMap::new(),
            next_key: 1,
            dirty: DirtyList::default(),
            max_conns: 100_000,
        }
    }

    pub fn core(&self) -> u8 {
        self.core
    }

    /// Give the endpoint its peer sockets and configs (a broker with `--peer-listen`).
    pub fn set_peer(&mut self, peer: PeerSide) {
        self.peer = Some(peer);
    }

    /// The local address of a socket (the client listener's when there is no peer side).
    fn local_of(&self, sock: Sock) -> SocketAddr {
        match (sock, &self.peer) {
            (Sock::PeerListen, Some(p)) => p.listen,
            (Sock::PeerDial, Some(p)) => p.dial,
            _ => self.local,
        }
    }

    /// Dial a peer broker at `to`, verifying that its certificate names `server_name`.
    /// The connection lives on the dial socket; its first packets are queued (dirty).
    pub fn connect(&mut self, server_name: &str, to: SocketAddr) -> Result<ConnKey, String> {
        let Some(peer) = self.peer.as_mut() else {
            return Err("this broker has no peer listener".into());
        };
        let scid_bytes = connection_id_for_core(self.core, CONN_ID_LEN);
        let scid = quiche::ConnectionId::from_ref(&scid_bytes);
        let q = quiche::connect_with_buffer_factory::<BytesFactory>(
            Some(server_name),
            &scid,
            peer.dial,
            to,
            &mut peer.client,
        )
        .map_err(|e| format!("dial {server_name} at {to}: {e}"))?;
        let key = self.next_key;
        self.next_key += 1;
        self.by_cid.insert(scid_bytes.clone(), key);
        self.conns.insert(
            key,
            ConnEntry {
                conn: FelixConn::new(q, false, self.max_frame_bytes),
                peer: to,
                sock: Sock::PeerDial,
                cids: vec![scid_bytes],
                deadline: None,
            },
        );
        self.dirty.push(key);
        Ok(key)
    }

    /// Stop accepting new connections (drain); existing ones keep working. The socket stays
    /// open so the kernel never remaps live connections to another core.
    pub fn set_accepting(&mut self, on: bool) {
        self.accepting = on;
    }

    /// Cap on connections on this core.
    pub fn set_max_conns(&mut self, n: usize) {
        self.max_conns = n;
    }

    pub fn conn_count(&self) -> usize {
        self.conns.len()
    }

    pub fn get(&mut self, key: ConnKey) -> Option<&mut ConnEntry> {
        self.conns.get_mut(&key)
    }

    /// Read-only access to a connection (what a pure host asks about its streams).
    pub fn peek(&self, key: ConnKey) -> Option<&ConnEntry> {
        self.conns.get(&key)
    }

    pub fn keys(&self) -> Vec<ConnKey> {
        self.conns.keys().copied().collect()
    }

    /// Mark a connection as having output to send.
    pub fn mark_dirty(&mut self, key: ConnKey) {
        self.dirty.push(key);
    }

    /// Handle a datagram received on this core's socket `sock` (`forwarded` when another
    /// core handed it over, in which case it is never forwarded again).
    pub fn on_datagram(
        &mut self,
        buf: &mut [u8],
        from: SocketAddr,
        sock: Sock,
        forwarded: bool,
    ) -> Route {
        let hdr = match quiche::Header::from_slice(buf, CONN_ID_LEN) {
            Ok(h) => h,
            Err(_) => return Route::Dropped,
        };
        let dcid = hdr.dcid.to_vec();
        if let Some(&key) = self.by_cid.get(&dcid) {
            let to = self.local_of(sock);
            let e = self
                .conns
                .get_mut(&key)
                .expect("cid table and conn table agree");
            if let Err(err) = e.conn.recv(buf, quiche::RecvInfo { from, to }) {
                tracing::trace!(error = %err, "packet refused by connection");
            }
            e.peer = from;
            self.dirty.push(key);
            return Route::Conn { key, new: false };
        }
        if sock == Sock::PeerDial {
            // Only the connections this core dialed live there, and they were found above.
            return Route::Dropped;
        }
        if hdr.ty != quiche::Type::Initial {
            if !forwarded
                && dcid.len() == CONN_ID_LEN
                && dcid[0] != self.core
                && dcid[0] < self.cores
            {
                return Route::Forward(dcid[0]);
            }
            return Route::Dropped;
        }
        if !quiche::version_is_supported(hdr.version) {
            let mut out = vec![0u8; crate::UDP_PAYLOAD_MIN];
            return match quiche::negotiate_version(&hdr.scid, &hdr.dcid, &mut out) {
                Ok(n) => {
                    out.truncate(n);
                    Route::Reply(out)
                }
                Err(_) => Route::Dropped,
            };
        }
        if !self.accepting || self.conns.len() >= self.max_conns {
            return Route::Dropped;
        }
        let scid_bytes = connection_id_for_core(self.core, CONN_ID_LEN);
        let scid = quiche::ConnectionId::from_ref(&scid_bytes);
        let local = self.local_of(sock);
        let config = match (sock, self.peer.as_mut()) {
            (Sock::PeerListen, Some(p)) => &mut p.server,
            (Sock::PeerListen, None) => return Route::Dropped,
            _ => &mut self.config,
        };
        let q =
            match quiche::accept_with_buf_factory::<BytesFactory>(&scid, None, local, from, config)
            {
                Ok(q) => q,
                Err(_) => return Route::Dropped,
            };
        let key = self.next_key;
        self.next_key += 1;
        let mut conn = FelixConn::new(q, true, self.max_frame_bytes);
        let _ = conn.recv(buf, quiche::RecvInfo { from, to: local });
        self.by_cid.insert(scid_bytes.clone(), key);
        // The client retransmits its Initial to the original DCID until it hears back.
        self.by_cid.insert(dcid.clone(), key);
        self.conns.insert(
            key,
            ConnEntry {
                conn,
                peer: from,
                sock,
                cids: vec![scid_bytes, dcid],
                deadline: None,
            },
        );
        self.dirty.push(key);
        Route::Conn { key, new: true }
    }

    /// Earliest connection deadline, relative to `now`.
    pub fn next_timeout(&self, now: Instant) -> Option<Duration> {
        self.conns
            .values()
            .filter_map(|e| e.deadline)
            .min()
            .map(|d| d.saturating_duration_since(now))
    }

    /// Fire every expired connection timer.
    pub fn on_timeouts(&mut self, now: Instant) {
        for (k, e) in self.conns.iter_mut() {
            if let Some(d) = e.deadline {
                if d <= now {
                    e.conn.on_timeout();
                    e.deadline = None;
                    self.dirty.push(*k);
                }
            }
        }
    }

    /// How many connections have pending output.
    pub fn dirty_count(&self) -> usize {
        self.dirty.order.len()
    }

    /// The connection that has waited longest with pending output; it stays off the list
    /// until marked again, so a caller that stops early loses no one still waiting.
    pub fn pop_dirty(&mut self) -> Option<ConnKey> {
        self.dirty.pop()
    }

    /// Write as many packets of connection `key` as fit into `batch`; returns true when the
    /// connection has nothing more to send right now (when false, mark it dirty again).
    pub fn transmit(&mut self, key: ConnKey, now: Instant, batch: &mut TxBatch) -> bool {
        let Some(e) = self.conns.get_mut(&key) else {
            return true;
        };
        let mut done = false;
        while let Some(slot) = batch.slot() {
            match e.conn.poll_transmit(slot) {
                Some((n, info)) => batch.commit(n, info.to),
                None => {
                    done = true;
                    break;
                }
            }
        }
        e.deadline = e.conn.timeout().map(|t| now + t);
        // Not done: the caller marks it dirty again, behind the connections still waiting.
        done
    }

    /// Remove closed connections and return their keys, each with why it closed.
    pub fn reap_closed(&mut self) -> Vec<(ConnKey, String)> {
        let closed: Vec<ConnKey> = self
            .conns
            .iter()
            .filter(|(_, e)| e.conn.is_closed())
            .map(|(k, _)| *k)
            .collect();
        let mut out = Vec::with_capacity(closed.len());
        for k in closed {
            if let Some(e) = self.conns.remove(&k) {
                crate::conn::trace_close_stats("server", e.conn.quic());
                out.push((k, e.conn.close_reason()));
                for c in e.cids {
                    self.by_cid.remove(&c);
                }
            }
            self.dirty.remove(k);
        }
        out
    }
}

/// A batch of outgoing UDP payloads packed end to end in one buffer (so a GSO-capable socket
/// layer can send runs of equal-size packets to one peer with a single sendmsg). Bounded two
/// ways: at most `max_packets` packets, and a new packet is started only while a whole
/// [`crate::UDP_PAYLOAD_SLOT`] still fits in `buffer_bytes` — so small packets are not capped by
/// the room large ones would need.
pub struct TxBatch {
    buf: Vec<u8>,
    /// (offset, len, destination) of each packet.
    pub packets: Vec<(usize, usize, SocketAddr)>,
    used: usize,
    max_packets: usize,
}

impl TxBatch {
    pub fn new(max_packets: usize, buffer_bytes: usize) -> Self {
        TxBatch {
            buf: vec![0; buffer_bytes.max(crate::UDP_PAYLOAD_SLOT)],
            packets: Vec::with_capacity(max_packets),
            used: 0,
            max_packets: max_packets.max(1),
        }
    }
    fn slot(&mut self) -> Option<&mut [u8]> {
        if self.is_full() {
            return None;
        }
        Some(&mut self.buf[self.used..self.used + crate::UDP_PAYLOAD_SLOT])
    }
    fn commit(&mut self, n: usize, to: SocketAddr) {
        assert!(
            n <= crate::UDP_PAYLOAD_SLOT,
            "packet of {n} bytes exceeds its slot"
        );
        self.packets.push((self.used, n, to));
        self.used += n;
    }
    pub fn is_full(&self) -> bool {
        self.packets.len() >= self.max_packets
            || self.buf.len() - self.used < crate::UDP_PAYLOAD_SLOT
    }
    pub fn is_empty(&self) -> bool {
        self.packets.is_empty()
    }
    pub fn packet(&self, i: usize) -> (&[u8], SocketAddr) {
        let (o, n, to) = self.packets[i];
        (&self.buf[o..o + n], to)
    }
    pub fn clear(&mut self) {
        self.packets.clear();
        self.used = 0;
    }
}

/// An insertion-ordered set of connection keys.
#[derive(Default)]
struct DirtyList {
    order: VecDeque<ConnKey>,
    member: HashSet<ConnKey>,
}

impl DirtyList {
    fn push(&mut self, k: ConnKey) {
        if self.member.insert(k) {
            self.order.push_back(k);
        }
    }
    fn pop(&mut self) -> Option<ConnKey> {
        let k = self.order.pop_front()?;
        self.member.remove(&k);
        Some(k)
    }
    fn remove(&mut self, k: ConnKey) {
        if self.member.remove(&k) {
            self.order.retain(|&x| x != k);
        }
    }
}

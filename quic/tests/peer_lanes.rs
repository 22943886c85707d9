//! The lanes of a peer link on real quiche and TLS (an in-memory pair of connections, every
//! packet carried by hand): the replication lane is served before a burst of forwarded
//! publishes, and keeps connection credit while the owner has stopped reading them.
//!
//! Each property has a twin with the rule broken (the replication lane at the bottom urgency;
//! a transport whose connection window does not hold every lane's stream window), and the
//! same measurement shows the difference, so the checks can fail.

use bytes::Bytes;
use felix_quic::conn::{BytesFactory, FelixConn};
use felix_quic::tls::{self, PeerTls, TransportConfig, Verify};
use felix_quic::wire::peer::lanes;
use std::net::SocketAddr;

type Quic = quiche::Connection<BytesFactory>;

const MIB: usize = 1 << 20;
/// One replication message.
const REPLICATION_BYTES: usize = 64 * 1024;
/// Rounds (one flight each way) a test may take: bounded.
const ROUNDS_MAX: usize = 2_000;

struct Pair {
    client: FelixConn,
    server: Quic,
    c_addr: SocketAddr,
    s_addr: SocketAddr,
    buf: Vec<u8>,
    /// Bytes the server read, per lane stream (4, 8).
    read_publish: usize,
    read_replication: usize,
    /// `read_publish` when the replication message had arrived whole.
    publish_at_replication: Option<usize>,
}

fn certs(dir: &std::path::Path) -> Vec<PeerTls> {
    tls::generate_cluster_certs(dir, &[1, 2]).expect("cluster certificates")
}

impl Pair {
    fn new(mut ccfg: quiche::Config, mut scfg: quiche::Config) -> Pair {
        let c_addr: SocketAddr = "127.0.0.1:40001".parse().unwrap();
        let s_addr: SocketAddr = "127.0.0.1:40002".parse().unwrap();
        let cid = [7u8; 16];
        let q = quiche::connect_with_buffer_factory::<BytesFactory>(
            Some(&tls::node_name(2)),
            &quiche::ConnectionId::from_ref(&cid),
            c_addr,
            s_addr,
            &mut ccfg,
        )
        .expect("connect");
        let mut client = FelixConn::new(q, false, MIB);
        let mut buf = vec![0u8; 65_535];
        let (n, _) = client.poll_transmit(&mut buf).expect("an Initial");
        let scid = [9u8; 16];
        let mut server = quiche::accept_with_buf_factory::<BytesFactory>(
            &quiche::ConnectionId::from_ref(&scid),
            None,
            s_addr,
            c_addr,
            &mut scfg,
        )
        .expect("accept");
        server
            .recv(
                &mut buf[..n],
                quiche::RecvInfo {
                    from: c_addr,
                    to: s_addr,
                },
            )
            .expect("the Initial is taken");
        let mut p = Pair {
            client,
            server,
            c_addr,
            s_addr,
            buf,
            read_publish: 0,
            read_replication: 0,
            publish_at_replication: None,
        };
        for _ in 0..50 {
            p.round(true);
            if p.client.is_established() && p.server.is_established() {
                return p;
            }
        }
        panic!("the handshake did not complete");
    }

    /// One flight each way; the server reads the replication lane, and the publish lane
    /// only when `read_publish` (an owner that keeps up).
    fn round(&mut self, read_publish: bool) {
        self.client.flush_streams();
        let mut chunk = vec![0u8; 64 * 1024];
        while let Some((n, _)) = self.client.poll_transmit(&mut self.buf) {
            let info = quiche::RecvInfo {
                from: self.c_addr,
                to: self.s_addr,
            };
            let _ = self.server.recv(&mut self.buf[..n], info);
            // Read after every packet, so what arrived first is counted first.
            while let Ok((n, _)) = self
                .server
                .stream_recv(lanes::REPLICATION_STREAM, &mut chunk)
            {
                self.read_replication += n;
            }
            if self.read_replication == REPLICATION_BYTES && self.publish_at_replication.is_none() {
                self.publish_at_replication = Some(self.read_publish);
            }
            if read_publish && self.read_replication < REPLICATION_BYTES {
                while let Ok((n, _)) = self.server.stream_recv(lanes::PUBLISH_STREAM, &mut chunk) {
                    self.read_publish += n;
                }
            }
        }
        if read_publish {
            while let Ok((n, _)) = self.server.stream_recv(lanes::PUBLISH_STREAM, &mut chunk) {
                self.read_publish += n;
            }
        }
        while let Ok((n, _)) = self.server.send(&mut self.buf) {
            let info = quiche::RecvInfo {
                from: self.s_addr,
                to: self.c_addr,
            };
            let _ = self.client.recv(&mut self.buf[..n], info);
        }
    }

    fn queue(&mut self, stream: u64, urgency: u8, bytes: usize) {
        for _ in 0..bytes / (64 * 1024) {
            self.client
                .send_bytes(stream, Bytes::from(vec![1u8; 64 * 1024]));
        }
        self.client.flush_streams();
        self.client.set_urgency(stream, urgency);
    }
}

fn peer_pair(dir: &std::path::Path, t: &TransportConfig) -> Pair {
    let c = certs(dir);
    Pair::new(
        tls::peer_client_config(&c[0], t).expect("client config"),
        tls::peer_server_config(&c[1], t).expect("server config"),
    )
}

/// How many bytes of a 4 MiB publish burst, queued first, the owner has read when a 64 KiB
/// replication message queued after it at `urgency` has arrived whole. At the top urgency
/// that is what quiche had already taken before the message was queued (one congestion
/// window: quiche takes a stream's bytes only up to its send capacity).
fn publish_read_before_replication(urgency: u8) -> usize {
    let dir = tempfile::tempdir().unwrap();
    let mut p = peer_pair(dir.path(), &TransportConfig::default());
    p.queue(lanes::PUBLISH_STREAM, lanes::PUBLISH_URGENCY, 4 * MIB);
    let before = p.read_publish;
    p.queue(lanes::REPLICATION_STREAM, urgency, REPLICATION_BYTES);
    for _ in 0..ROUNDS_MAX {
        p.round(true);
        if let Some(at) = p.publish_at_replication {
            eprintln!(
                "urgency {urgency}: {} bytes of publishes first",
                at - before
            );
            return at - before;
        }
    }
    panic!("the replication message never arrived");
}

#[test]
fn the_replication_lane_overtakes_a_burst_of_forwarded_publishes() {
    let first = publish_read_before_replication(lanes::REPLICATION_URGENCY);
    assert!(
        first < 256 * 1024,
        "{first} bytes of forwarded publishes were read before the replication message"
    );
    // The twin: the same message at the bottom urgency waits behind the burst, so the
    // measurement above tells the two apart.
    let last = publish_read_before_replication(255);
    assert!(
        last >= 3 * MIB,
        "at the bottom urgency only {last} bytes of publishes went first"
    );
}

/// Whether a replication message gets through once the owner has stopped reading a publish
/// burst larger than the publish lane's stream window.
fn replication_passes_a_stalled_publish_lane(pair: &mut Pair) -> bool {
    pair.queue(lanes::PUBLISH_STREAM, lanes::PUBLISH_URGENCY, 20 * MIB);
    // The burst fills what the owner grants and stops there.
    for _ in 0..200 {
        pair.round(false);
    }
    assert!(
        pair.client.queued_bytes(lanes::PUBLISH_STREAM) > 0,
        "the publish lane should be blocked by its unread window"
    );
    pair.queue(
        lanes::REPLICATION_STREAM,
        lanes::REPLICATION_URGENCY,
        REPLICATION_BYTES,
    );
    for _ in 0..200 {
        pair.round(false);
        if pair.read_replication == REPLICATION_BYTES {
            return true;
        }
    }
    false
}

#[test]
fn an_owner_that_stops_reading_publishes_cannot_starve_replication() {
    let dir = tempfile::tempdir().unwrap();
    let t = TransportConfig {
        max_data_bytes: 12 * MIB as u64,
        max_stream_data_bidi_bytes: 4 * MIB as u64,
        ..TransportConfig::default()
    };
    let mut p = peer_pair(dir.path(), &t);
    assert!(replication_passes_a_stalled_publish_lane(&mut p));

    // The twin: a connection window no larger than one lane's window, which the peer
    // configs refuse. Built with the client configs, the stalled lane takes all the credit.
    let bad = TransportConfig {
        max_data_bytes: 4 * MIB as u64,
        max_stream_data_bidi_bytes: 4 * MIB as u64,
        ..TransportConfig::default()
    };
    let c = certs(dir.path());
    assert!(tls::peer_client_config(&c[0], &bad).is_err());
    assert!(tls::peer_server_config(&c[1], &bad).is_err());
    let mut ccfg = tls::client_config(&Verify::CaFile(c[0].ca.clone()), &bad).unwrap();
    ccfg.verify_peer(false);
    let mut p = Pair::new(ccfg, tls::server_config(&c[1].cert, &bad).unwrap());
    assert!(
        !replication_passes_a_stalled_publish_lane(&mut p),
        "with the credit taken by the stalled lane nothing else should pass"
    );
}

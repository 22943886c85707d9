//! tokio driver for clients: one task owns the UDP socket and the [`FelixConn`]; the
//! application plugs in a [`Handler`] that receives stream events and commands.

use crate::conn::{BytesFactory, ConnEvent, FelixConn};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::UdpSocket;
use tokio::sync::mpsc;

/// Application logic driven by the connection task.
pub trait Handler: Send + 'static {
    type Cmd: Send + 'static;
    /// The handshake completed.
    fn on_established(&mut self, conn: &mut FelixConn);
    /// A stream event.
    fn on_event(&mut self, conn: &mut FelixConn, ev: ConnEvent);
    /// A command from the application side.
    fn on_command(&mut self, conn: &mut FelixConn, cmd: Self::Cmd);
    /// Called before every flush (to refill streams, resume paused ones...).
    fn before_flush(&mut self, conn: &mut FelixConn, events: &mut Vec<ConnEvent>);
    /// The connection is gone; `reason` says why.
    fn on_closed(&mut self, reason: String);
}

/// Open a client connection and spawn its task. Returns the command sender.
pub async fn spawn_client<H: Handler>(
    peer: SocketAddr,
    server_name: Option<&str>,
    config: &mut quiche::Config,
    max_frame_bytes: usize,
    handler: H,
) -> std::io::Result<mpsc::UnboundedSender<H::Cmd>> {
    let bind: SocketAddr = if peer.is_ipv4() {
        "0.0.0.0:0".parse().unwrap()
    } else {
        "[::]:0".parse().unwrap()
    };
    let std_sock = std::net::UdpSocket::bind(bind)?;
    let s2 = socket2::Socket::from(std_sock);
    let _ = s2.set_recv_buffer_size(8 << 20);
    let _ = s2.set_send_buffer_size(8 << 20);
    s2.set_nonblocking(true)?;
    {
        use std::os::fd::AsRawFd;
        if !crate::udp::set_pmtu_probe(s2.as_raw_fd(), peer.is_ipv6()) {
            tracing::debug!("IP_PMTUDISC_PROBE refused: path MTU probes may be fragmented");
        }
    }
    let sock = UdpSocket::from_std(s2.into())?;
    let local = sock.local_addr()?;
    let scid_bytes = crate::conn::connection_id_for_core(0, crate::CONN_ID_LEN);
    let scid = quiche::ConnectionId::from_ref(&scid_bytes);
    let q = quiche::connect_with_buffer_factory::<BytesFactory>(
        server_name,
        &scid,
        local,
        peer,
        config,
    )
    .map_err(|e| std::io::Error::other(format!("quiche connect: {e}")))?;
    let conn = FelixConn::new(q, false, max_frame_bytes);
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(run(sock, local, conn, handler, rx));
    Ok(tx)
}

async fn run<H: Handler>(
    sock: UdpSocket,
    local: SocketAddr,
    mut conn: FelixConn,
    mut h: H,
    mut rx: mpsc::UnboundedReceiver<H::Cmd>,
) {
    use std::os::fd::AsRawFd;
    let fd = sock.as_raw_fd();
    let mut gso = std::env::var_os("FELIX_UDP_NO_GSO").is_none();
    if !crate::udp::enable_gro(fd) {
        tracing::debug!("UDP GRO unavailable: one receive per datagram");
    }
    // Room for the largest GRO-coalesced read (64 KiB of datagrams).
    let mut inbuf = vec![0u8; 1 << 17];
    // Packets packed end to end: 64 small ones or ~15 of 16 KiB per round.
    let mut out = vec![0u8; 1 << 20];
    let mut events = Vec::new();
    let mut established = false;
    let mut cmds_open = true;
    loop {
        // Output first: streams into quiche, quiche into packets.
        h.before_flush(&mut conn, &mut events);
        for ev in events.drain(..) {
            h.on_event(&mut conn, ev);
        }
        conn.flush_streams();
        loop {
            // Up to 64 packets per round, sent as GSO runs (one sendmsg per run).
            let mut lens: Vec<(usize, SocketAddr)> = Vec::new();
            let mut used = 0;
            while lens.len() < crate::udp::GSO_SEGMENTS_MAX
                && out.len() - used >= crate::UDP_PAYLOAD_SLOT
            {
                match conn.poll_transmit(&mut out[used..used + crate::UDP_PAYLOAD_SLOT]) {
                    Some((n, info)) => {
                        lens.push((n, info.to));
                        used += n;
                    }
                    None => break,
                }
            }
            if lens.is_empty() {
                break;
            }
            let full = lens.len() == crate::udp::GSO_SEGMENTS_MAX
                || out.len() - used < crate::UDP_PAYLOAD_SLOT;
            let mut o = 0;
            let list: Vec<(&[u8], SocketAddr)> = lens
                .iter()
                .map(|&(n, to)| {
                    o += n;
                    (&out[o - n..o], to)
                })
                .collect();
            let mut b = crate::udp::BatchSend::new(&list);
            let mut waits = 0u32;
            while b.send(fd, &mut gso).is_err() {
                // Clear tokio's readiness (the raw send saw EAGAIN), then wait for the edge;
                // bounded so a missed edge costs at most a millisecond.
                let _ = sock.try_io(tokio::io::Interest::WRITABLE, || {
                    Err::<(), _>(std::io::ErrorKind::WouldBlock.into())
                });
                let _ = tokio::time::timeout(Duration::from_millis(1), sock.writable()).await;
                waits += 1;
                if waits.is_multiple_of(100) {
                    b.give_up_run(gso);
                }
            }
            let failed = b.failed;
            if failed > 0 {
                tracing::debug!(failed, "udp packets not sent");
            }
            if !full {
                break;
            }
        }
        if conn.is_closed() {
            crate::conn::trace_close_stats("client", conn.quic());
            h.on_closed(conn.close_reason());
            return;
        }
        let timeout = conn.timeout().unwrap_or(Duration::from_secs(3600));
        tokio::select! {
            r = sock.async_io(tokio::io::Interest::READABLE, || crate::udp::recv_gro(fd, &mut inbuf)) => {
                if let Ok((n, from, seg)) = r {
                    feed(&mut conn, &mut inbuf, n, from, seg, local);
                    // Drain whatever else is already queued on the socket before flushing.
                    for _ in 0..64 {
                        match sock.try_io(tokio::io::Interest::READABLE, || crate::udp::recv_gro(fd, &mut inbuf)) {
                            Ok((n, from, seg)) => feed(&mut conn, &mut inbuf, n, from, seg, local),
                            Err(_) => break,
                        }
                    }
                    if !established && conn.is_established() {
                        established = true;
                        h.on_established(&mut conn);
                    }
                    conn.poll_readable(&mut events);
                    let delivered = !events.is_empty();
                    for ev in events.drain(..) {
                        h.on_event(&mut conn, ev);
                    }
                    if delivered {
                        // Let the application take what was just handed over before this
                        // task builds and sends its ACK packets: quiche acknowledges every
                        // ack-eliciting packet, and on a one-thread runtime those sends
                        // (one syscall per connection) would otherwise sit between the
                        // arrival and its reader.
                        tokio::task::yield_now().await;
                    }
                }
            }
            c = rx.recv(), if cmds_open => {
                match c {
                    Some(c) => {
                        h.on_command(&mut conn, c);
                        while let Ok(c) = rx.try_recv() {
                            h.on_command(&mut conn, c);
                        }
                    }
                    None => {
                        // Every handle dropped: close cleanly.
                        cmds_open = false;
                        conn.close(0, "client dropped");
                    }
                }
            }
            _ = tokio::time::sleep(timeout) => conn.on_timeout(),
        }
    }
}

/// Feed `n` received bytes (one datagram, or several coalesced by GRO at `seg` bytes) to quiche.
fn feed(
    conn: &mut FelixConn,
    buf: &mut [u8],
    n: usize,
    from: SocketAddr,
    seg: Option<usize>,
    to: SocketAddr,
) {
    for r in crate::udp::gro_segments(n, seg) {
        let _ = conn.recv(&mut buf[r], quiche::RecvInfo { from, to });
    }
}

//! glommio driver pieces for the broker: the per-core UDP socket (SO_REUSEPORT) behind a
//! small trait, and a wake signal for the core's flusher task.
//!
//! glommio's `UdpSocket` passes no control messages, so [`GlommioUdp`] sends and receives
//! through [`crate::udp`] (non-blocking `sendmsg` with `UDP_SEGMENT`, `recvmsg` with
//! `UDP_GRO`) on the socket's fd, and uses glommio's io_uring only to wait: a `MSG_PEEK`
//! receive that completes when a datagram is waiting. One GSO `sendmsg` carries up to 64
//! packets of one connection; one GRO `recvmsg` returns several datagrams of one flow.

use crate::server::TxBatch;
use std::io;
use std::net::SocketAddr;

/// The datagram I/O a core needs.
#[allow(async_fn_in_trait)]
pub trait DatagramIo {
    /// Receive one datagram, or several of one sender coalesced by GRO: bytes, sender, and
    /// the segment size when coalesced (split with [`crate::udp::gro_segments`]).
    async fn recv(&self, buf: &mut [u8]) -> io::Result<(usize, SocketAddr, Option<usize>)>;
    /// Send every packet of `batch` (errors on individual packets are counted, not fatal).
    async fn send_batch(&self, batch: &TxBatch) -> usize;
    /// Send one datagram.
    async fn send_one(&self, buf: &[u8], to: SocketAddr) -> io::Result<()>;
}

/// A core's UDP socket: GSO/GRO through [`crate::udp`], glommio for readiness.
pub struct GlommioUdp {
    sock: glommio::net::UdpSocket,
    gso: std::cell::Cell<bool>,
}

/// Bind a UDP socket with SO_REUSEPORT (one per core on the same address) and large buffers.
pub fn bind_reuseport(addr: SocketAddr, buffer_bytes: usize) -> io::Result<socket2::Socket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    s.set_reuse_port(true)?;
    s.set_reuse_address(true)?;
    // Force variants need CAP_NET_ADMIN; fall back to the capped ones.
    if setsockopt_int(&s, libc::SO_RCVBUFFORCE, buffer_bytes).is_err() {
        let _ = s.set_recv_buffer_size(buffer_bytes);
    }
    if setsockopt_int(&s, libc::SO_SNDBUFFORCE, buffer_bytes).is_err() {
        let _ = s.set_send_buffer_size(buffer_bytes);
    }
    s.set_nonblocking(true)?;
    {
        use std::os::fd::AsRawFd;
        if !crate::udp::set_pmtu_probe(s.as_raw_fd(), addr.is_ipv6()) {
            tracing::debug!("IP_PMTUDISC_PROBE refused: path MTU probes may be fragmented");
        }
    }
    s.bind(&addr.into())?;
    Ok(s)
}

fn setsockopt_int(s: &socket2::Socket, opt: libc::c_int, v: usize) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let v = v.min(i32::MAX as usize) as libc::c_int;
    // SAFETY: plain setsockopt on an owned, open socket with a correctly sized int.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            &v as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl GlommioUdp {
    /// Wrap a bound socket (must be called on the executor that will use it).
    pub fn new(s: socket2::Socket) -> Self {
        use std::os::fd::AsRawFd;
        use std::os::fd::{FromRawFd, IntoRawFd};
        let gro = crate::udp::enable_gro(s.as_raw_fd());
        if !gro {
            tracing::warn!("UDP GRO unavailable: one receive per datagram");
        }
        // SAFETY: the fd is a bound, non-blocking UDP socket whose ownership moves here.
        let sock = unsafe { glommio::net::UdpSocket::from_raw_fd(s.into_raw_fd()) };
        GlommioUdp {
            sock,
            gso: std::cell::Cell::new(std::env::var_os("FELIX_UDP_NO_GSO").is_none()),
        }
    }
    fn fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.sock.as_raw_fd()
    }
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.sock
            .local_addr()
            .map_err(|e| io::Error::other(e.to_string()))
    }
}

impl DatagramIo for GlommioUdp {
    async fn recv(&self, buf: &mut [u8]) -> io::Result<(usize, SocketAddr, Option<usize>)> {
        let mut probe = [0u8; 1];
        loop {
            match crate::udp::recv_gro(self.fd(), buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Wait on io_uring until a datagram is there; the peek consumes nothing.
                    let _ = self.sock.peek_from(&mut probe).await;
                }
                r => return r,
            }
        }
    }
    async fn send_batch(&self, batch: &TxBatch) -> usize {
        let list: Vec<(&[u8], SocketAddr)> =
            (0..batch.packets.len()).map(|i| batch.packet(i)).collect();
        let mut gso = self.gso.get();
        let mut b = crate::udp::BatchSend::new(&list);
        let mut waits = 0u32;
        // A full socket buffer is rare with 8 MiB buffers: retry shortly, give up on a run
        // after ~100 ms (QUIC retransmits what was not sent).
        while b.send(self.fd(), &mut gso).is_err() {
            waits += 1;
            if waits.is_multiple_of(1000) {
                b.give_up_run(gso);
            }
            glommio::timer::sleep(std::time::Duration::from_micros(100)).await;
        }
        let failed = b.failed;
        self.gso.set(gso);
        failed
    }
    async fn send_one(&self, buf: &[u8], to: SocketAddr) -> io::Result<()> {
        self.sock
            .send_to(buf, to)
            .await
            .map(|_| ())
            .map_err(|e| io::Error::other(e.to_string()))
    }
}

/// A coalescing wake signal for one task on the same executor.
#[derive(Clone)]
pub struct Wake(std::rc::Rc<glommio::channels::local_channel::LocalSender<()>>);

/// The receiving side of [`Wake`].
pub struct WakeRx(glommio::channels::local_channel::LocalReceiver<()>);

/// A new wake pair.
pub fn wake_pair() -> (Wake, WakeRx) {
    let (tx, rx) = glommio::channels::local_channel::new_bounded(1);
    (Wake(std::rc::Rc::new(tx)), WakeRx(rx))
}

impl Wake {
    /// Wake the task (a no-op if already woken).
    pub fn wake(&self) {
        let _ = self.0.try_send(());
    }
}

impl WakeRx {
    /// Wait for a wake or until `timeout` passes. Cancel-safe: no wake is lost.
    pub async fn wait(&self, timeout: Option<std::time::Duration>) {
        let recv = async {
            let _ = self.0.recv().await;
        };
        match timeout {
            Some(t) => futures_lite::future::or(recv, glommio::timer::sleep(t)).await,
            None => recv.await,
        }
    }
}

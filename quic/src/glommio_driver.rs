//! glommio driver pieces for the broker: the per-core UDP socket (SO_REUSEPORT) behind a
//! small trait, and a wake signal for the core's flusher task.
//!
//! The socket layer is its own piece so that a cmsg-capable path (io_uring sendmsg/recvmsg
//! with UDP_SEGMENT/UDP_GRO) can replace [`GlommioUdp`] without touching the connection core.
//! Today [`GlommioUdp`] sends one datagram per syscall (glommio's `UdpSocket` passes no
//! control messages) — see docs/architecture.md for the measured ceiling.

use crate::server::TxBatch;
use std::io;
use std::net::SocketAddr;

/// The datagram I/O a core needs.
#[allow(async_fn_in_trait)]
pub trait DatagramIo {
    /// Receive one datagram.
    async fn recv(&self, buf: &mut [u8]) -> io::Result<(usize, SocketAddr)>;
    /// Send every packet of `batch` (errors on individual packets are counted, not fatal).
    async fn send_batch(&self, batch: &TxBatch) -> usize;
    /// Send one datagram.
    async fn send_one(&self, buf: &[u8], to: SocketAddr) -> io::Result<()>;
}

/// glommio's UDP socket: one syscall per datagram.
pub struct GlommioUdp(glommio::net::UdpSocket);

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
        use std::os::fd::{FromRawFd, IntoRawFd};
        // SAFETY: the fd is a bound, non-blocking UDP socket whose ownership moves here.
        GlommioUdp(unsafe { glommio::net::UdpSocket::from_raw_fd(s.into_raw_fd()) })
    }
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.0
            .local_addr()
            .map_err(|e| io::Error::other(e.to_string()))
    }
}

impl DatagramIo for GlommioUdp {
    async fn recv(&self, buf: &mut [u8]) -> io::Result<(usize, SocketAddr)> {
        self.0
            .recv_from(buf)
            .await
            .map_err(|e| io::Error::other(e.to_string()))
    }
    async fn send_batch(&self, batch: &TxBatch) -> usize {
        let mut failed = 0;
        for i in 0..batch.packets.len() {
            let (p, to) = batch.packet(i);
            if self.0.send_to(p, to).await.is_err() {
                failed += 1;
            }
        }
        failed
    }
    async fn send_one(&self, buf: &[u8], to: SocketAddr) -> io::Result<()> {
        self.0
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

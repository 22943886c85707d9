//! A lingering close for the REST listener.
//!
//! A refusal can come before a request's body is read (the bearer check's 401, a 413 cut at
//! the limit), and hyper then closes the connection (`server/unread_body.rs` says so with
//! `Connection: close`). Closing a TCP socket whose receive queue still holds unread bytes
//! makes the kernel send a reset instead of a FIN. A client still writing the body then gets
//! "broken pipe" or "connection reset" before it reads the answer, so it sees a failed request
//! instead of the 401. Under load this hit `control/tests/https.rs` in about one run in eight.
//!
//! So when hyper shuts a connection down, this wrapper first shuts down the write side (TLS
//! close_notify, then a FIN: the answer is out), and then reads and discards what the client
//! still sends until it closes, for at most `LINGER_MS_MAX` and `LINGER_BYTES_MAX`. Only then
//! is the socket dropped. Both bounds keep a client that never stops sending from holding the
//! connection.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// How long a closing connection keeps reading what its client still sends.
pub const LINGER_MS_MAX: u64 = 2_000;
/// How much it reads and discards at most.
pub const LINGER_BYTES_MAX: usize = 1 << 20;

/// A listener whose connections close lingering (see the module doc).
pub struct LingerListener<L>(pub L);

impl<L: axum::serve::Listener> axum::serve::Listener for LingerListener<L>
where
    L::Io: Unpin,
{
    type Io = Linger<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (io, addr) = self.0.accept().await;
        (Linger::new(io), addr)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.0.local_addr()
    }
}

/// A connection whose shutdown lingers.
pub struct Linger<T> {
    inner: T,
    /// Set once the write side is shut: then the shutdown drains.
    draining: Option<Drain>,
}

struct Drain {
    deadline: Pin<Box<tokio::time::Sleep>>,
    read_bytes: usize,
}

impl<T> Linger<T> {
    pub fn new(inner: T) -> Self {
        Linger {
            inner,
            draining: None,
        }
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncRead for Linger<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Linger<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.draining.is_none() {
            // The answer first: a failed shutdown has nothing to linger for.
            ready!(Pin::new(&mut this.inner).poll_shutdown(cx))?;
            this.draining = Some(Drain {
                deadline: Box::pin(tokio::time::sleep(Duration::from_millis(LINGER_MS_MAX))),
                read_bytes: 0,
            });
        }
        let drain = this.draining.as_mut().expect("set above");
        let mut scratch = [0u8; 8192];
        loop {
            if drain.read_bytes >= LINGER_BYTES_MAX || drain.deadline.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Ok(()));
            }
            let mut rb = ReadBuf::new(&mut scratch);
            match Pin::new(&mut this.inner).poll_read(cx, &mut rb) {
                // The client closed (or the connection failed): nothing left to reset.
                Poll::Ready(Ok(())) if rb.filled().is_empty() => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(())) => drain.read_bytes += rb.filled().len(),
                Poll::Ready(Err(_)) => return Poll::Ready(Ok(())),
                // Woken by more bytes, or by the deadline polled above.
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

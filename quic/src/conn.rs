//! Runtime-agnostic connection core: a quiche connection plus Felix framing per QUIC stream.
//!
//! No clock and no socket here: drivers feed packets in ([`FelixConn::recv`]), pull packets
//! out ([`FelixConn::poll_transmit`]), and call [`FelixConn::on_timeout`] when
//! [`FelixConn::timeout`] expires. Outgoing frames are queued per stream as `Bytes` and handed
//! to quiche with `stream_send_zc`, so a delivery frame shared by many subscribers is never
//! copied on its way into quiche.

use crate::idmap::{IdMap, IdSet};
use crate::wire::{Frame, FrameError, FrameReader, WireError, DEFAULT_MAX_FRAME_BYTES};
use bytes::{Buf, Bytes};
use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

/// quiche buffer factory whose stream buffers are `Bytes` (cheap clone, zero-copy split).
#[derive(Debug, Clone, Default)]
pub struct BytesFactory;

/// A `Bytes` buffer quiche can keep and split without copying.
#[derive(Debug, Clone, Default)]
pub struct ZcBuf(pub Bytes);

impl AsRef<[u8]> for ZcBuf {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl quiche::BufSplit for ZcBuf {
    fn split_at(&mut self, at: usize) -> Self {
        ZcBuf(self.0.split_off(at))
    }
}

impl quiche::BufFactory for BytesFactory {
    type Buf = ZcBuf;
    type DgramBuf = Vec<u8>;
    fn buf_from_slice(buf: &[u8]) -> ZcBuf {
        ZcBuf(Bytes::copy_from_slice(buf))
    }
    fn dgram_buf_from_slice(buf: &[u8]) -> Vec<u8> {
        buf.to_vec()
    }
}

/// The quiche connection type used by Felix.
pub type QuicConn = quiche::Connection<BytesFactory>;

/// quiche's urgency of a stream nobody prioritized.
const DEFAULT_URGENCY: u8 = 127;

/// What happened on the connection's streams.
#[derive(Debug)]
pub enum ConnEvent {
    /// A whole frame arrived on `stream`.
    Frame { stream: u64, frame: Frame },
    /// A frame on `stream` could not be taken. When `error.fatal` the framing is lost and the
    /// stream has been shut down for reading (STOP_SENDING); otherwise the frame was skipped
    /// and the stream goes on. The app answers with an `Error` frame.
    BadFrame { stream: u64, error: FrameError },
    /// The peer finished its side of `stream` (after all its frames were delivered).
    Finished { stream: u64 },
    /// The peer reset `stream`.
    Reset { stream: u64, code: u64 },
}

#[derive(Default)]
struct OutStream {
    queue: VecDeque<Bytes>,
    queued_bytes: usize,
    fin_pending: bool,
}

/// A Felix connection over quiche.
pub struct FelixConn {
    q: QuicConn,
    readers: IdMap<u64, FrameReader>,
    paused: IdSet<u64>,
    out: IdMap<u64, OutStream>,
    dirty: BTreeSet<u64>,
    /// Where the next flush starts in `dirty` (round robin across flushes).
    flush_from: u64,
    next_bidi: u64,
    next_uni: u64,
    max_frame_bytes: usize,
    /// The largest frame the peer accepts (its Hello or HelloOk); frames over it are never
    /// queued (see [`FelixConn::try_send_frame`]).
    peer_max_frame_bytes: usize,
    /// Frames refused by [`FelixConn::send_frame`] for being over the peer's maximum.
    oversized_refused: u64,
    /// Streams given an urgency other than quiche's default ([`FelixConn::set_urgency`]).
    /// quiche takes a stream's bytes only up to the connection's send capacity, and orders
    /// by urgency only what it has taken, so the flush hands urgent streams their bytes
    /// first and the least urgent last; otherwise a full low-urgency stream would take the
    /// capacity first on every flush.
    urgency: IdMap<u64, u8>,
    /// Keepalive: (interval, next ping due), when set ([`FelixConn::set_keepalive`]).
    keepalive: Option<(Duration, std::time::Instant)>,
    /// A close to start once every queued frame has gone out in a packet (see
    /// [`FelixConn::close_after_flush`]).
    pending_close: Option<(u64, String)>,
    scratch: Vec<u8>,
}

impl FelixConn {
    /// Wrap a quiche connection. `is_server` selects the stream-id spaces this side opens.
    pub fn new(q: QuicConn, is_server: bool, max_frame_bytes: usize) -> Self {
        // A client's stream 0 is its control stream (the Hello opens it): the bidirectional
        // streams it opens for publishers start at 4.
        let (bidi, uni) = if is_server { (1, 3) } else { (4, 2) };
        FelixConn {
            q,
            readers: IdMap::default(),
            paused: IdSet::default(),
            out: IdMap::default(),
            dirty: BTreeSet::new(),
            flush_from: 0,
            next_bidi: bidi,
            next_uni: uni,
            max_frame_bytes,
            peer_max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            oversized_refused: 0,
            urgency: IdMap::default(),
            keepalive: None,
            pending_close: None,
            scratch: vec![0; 64 * 1024],
        }
    }

    /// Record the largest frame the peer accepts (from its Hello or HelloOk).
    pub fn set_peer_max_frame_bytes(&mut self, n: usize) {
        self.peer_max_frame_bytes = n;
    }

    /// The largest frame the peer accepts.
    pub fn peer_max_frame_bytes(&self) -> usize {
        self.peer_max_frame_bytes
    }

    /// Frames [`FelixConn::send_frame`] refused for being over the peer's maximum.
    pub fn oversized_refused(&self) -> u64 {
        self.oversized_refused
    }

    /// The underlying quiche connection (for stats and trace ids).
    pub fn quic(&self) -> &QuicConn {
        &self.q
    }

    /// Feed one received UDP payload.
    pub fn recv(&mut self, buf: &mut [u8], info: quiche::RecvInfo) -> Result<usize, quiche::Error> {
        self.q.recv(buf, info)
    }

    /// Allocate a new locally-initiated bidirectional stream id.
    pub fn open_bidi(&mut self) -> u64 {
        let id = self.next_bidi;
        self.next_bidi += 4;
        id
    }

    /// Allocate a new locally-initiated unidirectional stream id.
    pub fn open_uni(&mut self) -> u64 {
        let id = self.next_uni;
        self.next_uni += 4;
        id
    }

    /// Stop reading `stream` (back-pressure: QUIC flow control then holds the peer).
    pub fn pause(&mut self, stream: u64) {
        self.paused.insert(stream);
    }

    /// Resume reading `stream`.
    pub fn resume(&mut self, stream: u64) {
        self.paused.remove(&stream);
    }

    /// Read every readable, unpaused stream and decode whole frames into `events`.
    pub fn poll_readable(&mut self, events: &mut Vec<ConnEvent>) {
        let ids: Vec<u64> = self.q.readable().collect();
        for id in ids {
            if self.paused.contains(&id) {
                continue;
            }
            self.read_stream(id, events);
        }
    }

    /// Read one stream now (e.g. right after resuming it).
    pub fn read_stream(&mut self, id: u64, events: &mut Vec<ConnEvent>) {
        loop {
            if self.paused.contains(&id) {
                return;
            }
            match self.q.stream_recv(id, &mut self.scratch) {
                Ok((n, fin)) => {
                    let max = self.max_frame_bytes;
                    let r = self
                        .readers
                        .entry(id)
                        .or_insert_with(|| FrameReader::new(max));
                    r.push(&self.scratch[..n]);
                    loop {
                        match r.next_frame() {
                            Ok(Some(frame)) => events.push(ConnEvent::Frame { stream: id, frame }),
                            Ok(None) => break,
                            Err(error) => {
                                if error.fatal {
                                    // Framing is lost: stop the peer sending more on this
                                    // stream; the reader drops whatever still arrives.
                                    let _ = self.q.stream_shutdown(
                                        id,
                                        quiche::Shutdown::Read,
                                        error.error.code().number() as u64,
                                    );
                                }
                                let fatal = error.fatal;
                                events.push(ConnEvent::BadFrame { stream: id, error });
                                if fatal {
                                    break;
                                }
                            }
                        }
                    }
                    if fin {
                        let truncated = self.readers.remove(&id).is_some_and(|r| r.mid_frame());
                        if truncated {
                            events.push(ConnEvent::BadFrame {
                                stream: id,
                                error: FrameError {
                                    error: WireError::Truncated {
                                        field: "frame at stream end",
                                        needed: 1,
                                    },
                                    kind: None,
                                    request_id: None,
                                    // The stream is over anyway; no framing was lost that
                                    // anything after it depended on.
                                    fatal: false,
                                    truncated_at_end: true,
                                },
                            });
                        }
                        events.push(ConnEvent::Finished { stream: id });
                        return;
                    }
                    // A paused stream may have been paused by a handler between reads; the
                    // caller sees the events and decides.
                    if !events.is_empty() && self.paused.contains(&id) {
                        return;
                    }
                }
                Err(quiche::Error::Done) => return,
                Err(quiche::Error::StreamReset(code)) => {
                    self.readers.remove(&id);
                    events.push(ConnEvent::Reset { stream: id, code });
                    return;
                }
                Err(_) => return,
            }
        }
    }

    /// Set a stream's scheduling urgency (0 is served first; quiche's default is 127): a
    /// peer link puts forwarded requests below its own control traffic, so what must not
    /// starve (the link's hello now, replication's leases next) never waits behind them.
    pub fn set_urgency(&mut self, stream: u64, urgency: u8) {
        let _ = self.q.stream_priority(stream, urgency, true);
        if urgency == DEFAULT_URGENCY {
            self.urgency.remove(&stream);
        } else {
            self.urgency.insert(stream, urgency);
        }
    }

    /// The order in which a flush visits the streams with queued bytes: urgent ones first
    /// (most urgent first), then the rest round robin from `flush_from`, then the ones
    /// below the default urgency.
    fn flush_order(&self) -> Vec<u64> {
        let round_robin = self
            .dirty
            .range(self.flush_from..)
            .chain(self.dirty.range(..self.flush_from))
            .copied();
        if self.urgency.is_empty() {
            return round_robin.collect();
        }
        let mut ranked: Vec<(u8, u64)> = self
            .urgency
            .iter()
            .filter(|(id, _)| self.dirty.contains(id))
            .map(|(id, u)| (*u, *id))
            .collect();
        ranked.sort_unstable();
        let mut ids: Vec<u64> = ranked
            .iter()
            .filter(|(u, _)| *u < DEFAULT_URGENCY)
            .map(|(_, id)| *id)
            .collect();
        ids.extend(round_robin.filter(|id| !self.urgency.contains_key(id)));
        ids.extend(
            ranked
                .iter()
                .filter(|(u, _)| *u > DEFAULT_URGENCY)
                .map(|(_, id)| *id),
        );
        ids
    }

    /// Queue a frame (already encoded) on `stream`.
    pub fn send_bytes(&mut self, stream: u64, data: Bytes) {
        if data.is_empty() {
            return;
        }
        let o = self.out.entry(stream).or_default();
        o.queued_bytes += data.len();
        o.queue.push_back(data);
        self.dirty.insert(stream);
    }

    /// Queue one frame on `stream`, unless it is over the peer's maximum: then nothing is
    /// queued and `FrameTooLarge` names both sizes (a client turns it into the request's error).
    pub fn try_send_frame(&mut self, stream: u64, frame: &Frame) -> Result<(), WireError> {
        // Records travel as their own shared buffer (quiche keeps Bytes without copying).
        let (head, records) = frame.encode_parts();
        let len = head.len() + records.as_ref().map_or(0, |r| r.len());
        if len > self.peer_max_frame_bytes {
            self.oversized_refused += 1;
            return Err(WireError::FrameTooLarge {
                len,
                max: self.peer_max_frame_bytes,
            });
        }
        self.send_bytes(stream, head);
        if let Some(r) = records {
            self.send_bytes(stream, r);
        }
        Ok(())
    }

    /// Queue one frame on `stream`. The frames a broker sends are built to fit the peer's
    /// maximum; one that does not is a defect, logged and counted here rather than sent to a
    /// peer that would have to refuse it.
    pub fn send_frame(&mut self, stream: u64, frame: &Frame) {
        if let Err(e) = self.try_send_frame(stream, frame) {
            tracing::error!(stream, kind = frame.kind(), error = %e, "frame over the peer's maximum not sent");
        }
    }

    /// Finish `stream` after everything queued on it has been written.
    pub fn finish(&mut self, stream: u64) {
        self.out.entry(stream).or_default().fin_pending = true;
        self.dirty.insert(stream);
    }

    /// Abandon `stream` in both directions with an application error code.
    pub fn reset_stream(&mut self, stream: u64, code: u64) {
        self.out.remove(&stream);
        self.dirty.remove(&stream);
        let _ = self
            .q
            .stream_shutdown(stream, quiche::Shutdown::Write, code);
        let _ = self.q.stream_shutdown(stream, quiche::Shutdown::Read, code);
    }

    /// Stop reading `stream`: quiche drops what arrives on it and asks the peer, with
    /// STOP_SENDING and `code`, to send no more. The sending side (if any) stays open.
    pub fn stop_reading(&mut self, stream: u64, code: u64) {
        self.readers.remove(&stream);
        let _ = self.q.stream_shutdown(stream, quiche::Shutdown::Read, code);
    }

    /// The code of the peer's STOP_SENDING on `stream`, once it stopped our sending side.
    pub fn stopped(&mut self, stream: u64) -> Option<u64> {
        match self.q.stream_capacity(stream) {
            Err(quiche::Error::StreamStopped(code)) => Some(code),
            _ => None,
        }
    }

    /// Where the sending side of a locally opened stream stands after [`FelixConn::finish`]:
    /// `Some(true)` once every byte and the FIN were acknowledged by the peer (quiche then
    /// collects the stream), `Some(false)` when the peer stopped it (the data may be lost),
    /// `None` while bytes are still queued or unacknowledged.
    pub fn send_settled(&mut self, stream: u64) -> Option<bool> {
        if self.out.contains_key(&stream) {
            return None;
        }
        match self.q.stream_capacity(stream) {
            Err(quiche::Error::InvalidStreamState(_)) => Some(true),
            Err(quiche::Error::StreamStopped(_)) => Some(false),
            _ => None,
        }
    }

    /// Bytes queued on `stream` that quiche has not taken yet.
    pub fn queued_bytes(&self, stream: u64) -> usize {
        self.out.get(&stream).map(|o| o.queued_bytes).unwrap_or(0)
    }

    /// Bytes queued on every stream that quiche has not taken yet.
    pub fn queued_total(&self) -> usize {
        self.out.values().map(|o| o.queued_bytes).sum()
    }

    /// How much more quiche would accept on `stream` now (flow control and congestion).
    pub fn stream_capacity(&mut self, stream: u64) -> usize {
        self.q.stream_capacity(stream).unwrap_or(0)
    }

    /// Move queued frames into quiche as far as flow control allows. Returns the streams
    /// that drained completely (so the app can refill them).
    ///
    /// Streams are tried round robin from where the previous flush stopped. Once quiche
    /// refuses bytes and has no connection-level room left (congestion window or connection
    /// flow control), the flush stops: every other stream would be refused too, and trying
    /// each of thousands of subscription streams on every flush was most of a busy broker's
    /// time at 10,000 subscribers.
    pub fn flush_streams(&mut self) -> Vec<u64> {
        let mut drained = Vec::new();
        let ids = self.flush_order();
        let mut conn_checked = false;
        for id in ids {
            let Some(o) = self.out.get_mut(&id) else {
                self.dirty.remove(&id);
                continue;
            };
            let mut failed = false;
            let mut refused = false;
            loop {
                let last = o.queue.len() == 1;
                let Some(front) = o.queue.front_mut() else {
                    break;
                };
                let fin = last && o.fin_pending;
                // quiche drops the buffer on Err(Done), so hand it a cheap clone.
                match self.q.stream_send_zc(id, ZcBuf(front.clone()), fin) {
                    Ok((n, _rest)) => {
                        o.queued_bytes -= n;
                        if n == front.len() {
                            o.queue.pop_front();
                            if fin {
                                o.fin_pending = false;
                            }
                        } else {
                            front.advance(n);
                            refused = true;
                            break;
                        }
                    }
                    Err(quiche::Error::Done) => {
                        refused = true;
                        break;
                    }
                    Err(_) => {
                        failed = true;
                        break;
                    }
                }
            }
            if failed {
                self.out.remove(&id);
                self.dirty.remove(&id);
                continue;
            }
            if refused && !conn_checked {
                conn_checked = true;
                // `writable()` is empty exactly when the connection has no send capacity.
                if self.q.writable().next().is_none() {
                    // The round robin resumes at this stream (an urgent or least urgent
                    // one keeps its place in the order by itself).
                    if !self.urgency.contains_key(&id) {
                        self.flush_from = id;
                    }
                    break;
                }
            }
            if o.queue.is_empty() {
                if o.fin_pending {
                    match self.q.stream_send_zc(id, ZcBuf(Bytes::new()), true) {
                        Ok(_) => o.fin_pending = false,
                        Err(quiche::Error::Done) => continue,
                        Err(_) => o.fin_pending = false,
                    }
                }
                self.out.remove(&id);
                self.dirty.remove(&id);
                drained.push(id);
            }
        }
        drained
    }

    /// Streams with frames still waiting for quiche.
    pub fn has_queued(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// Close with `code` and `reason` once the frames queued now have left in packets: quiche
    /// sends no stream data after a close, so an `Error` frame queued just before a plain
    /// [`FelixConn::close`] would never reach the peer. The close's reason carries the same
    /// text, so a peer that lost the packet with the frame still learns why.
    pub fn close_after_flush(&mut self, code: u64, reason: &str) {
        self.pending_close = Some((code, reason.to_string()));
    }

    /// Start the close [`FelixConn::close_after_flush`] asked for now, whatever is still
    /// queued (the caller's grace period ran out).
    pub fn close_pending_now(&mut self) {
        if let Some((code, reason)) = self.pending_close.take() {
            let _ = self.q.close(true, code, reason.as_bytes());
        }
    }

    /// Next UDP payload to send, written into `out`.
    pub fn poll_transmit(&mut self, out: &mut [u8]) -> Option<(usize, quiche::SendInfo)> {
        match self.q.send(out) {
            Ok(v) => Some(v),
            Err(quiche::Error::Done) if self.dirty.is_empty() && self.pending_close.is_some() => {
                let (code, reason) = self.pending_close.take().expect("checked");
                let _ = self.q.close(true, code, reason.as_bytes());
                self.q.send(out).ok()
            }
            Err(quiche::Error::Done) => None,
            Err(e) => {
                tracing::debug!(error = %e, "quiche send failed; closing");
                let _ = self.q.close(false, 0x1, b"send error");
                None
            }
        }
    }

    /// When the driver must call [`FelixConn::on_timeout`]: quiche's timers, and the next
    /// keepalive ping.
    pub fn timeout(&self) -> Option<Duration> {
        let q = self.q.timeout();
        match self.keepalive {
            None => q,
            Some((_, due)) => {
                let k = due.saturating_duration_since(std::time::Instant::now());
                Some(q.map_or(k, |q| q.min(k)))
            }
        }
    }

    pub fn on_timeout(&mut self) {
        self.q.on_timeout();
        if let Some((every, due)) = self.keepalive {
            let now = std::time::Instant::now();
            if now >= due {
                // Ack-eliciting: a live peer answers it, so the idle timer of both ends keeps
                // running only while the peer is really gone.
                let _ = self.q.send_ack_eliciting();
                self.keepalive = Some((every, now + every));
            }
        }
    }

    /// Send a ping every `every` (a connection that carries nothing else stays alive, and a
    /// dead peer is noticed within the idle timeout rather than never).
    pub fn set_keepalive(&mut self, every: Duration) {
        self.keepalive = Some((every, std::time::Instant::now() + every));
    }
    pub fn is_established(&self) -> bool {
        self.q.is_established()
    }
    pub fn is_closed(&self) -> bool {
        self.q.is_closed()
    }
    pub fn is_draining(&self) -> bool {
        self.q.is_draining()
    }
    /// Start a clean application close with `code` and `reason`.
    pub fn close(&mut self, code: u64, reason: &str) {
        let _ = self.q.close(true, code, reason.as_bytes());
    }
    /// The peer's close reason, if it closed.
    pub fn peer_error(&self) -> Option<String> {
        self.q.peer_error().map(|e| {
            format!(
                "code {} {}",
                e.error_code,
                String::from_utf8_lossy(&e.reason)
            )
        })
    }
    /// Why the connection closed, for people: `code N reason` when the peer closed it,
    /// `local code N reason` when this side did (a TLS alert this side raised is
    /// `0x100 + alert`), else `idle timeout` or `closed`.
    pub fn close_reason(&self) -> String {
        if let Some(p) = self.peer_error() {
            return p;
        }
        if let Some(e) = self.q.local_error() {
            return format!(
                "local code {} {}",
                e.error_code,
                String::from_utf8_lossy(&e.reason)
            );
        }
        if self.q.is_timed_out() {
            "idle timeout".into()
        } else {
            "closed".into()
        }
    }

    /// Whether the peer still lets this side open a unidirectional stream.
    pub fn can_open_uni(&self) -> bool {
        self.q.peer_streams_left_uni() > 0
    }
}

/// Generate a connection id of `len` bytes whose first byte is `core` (the broker routes
/// packets to the core named in the destination connection id).
pub fn connection_id_for_core(core: u8, len: usize) -> Vec<u8> {
    let mut id = vec![0u8; len];
    boring::rand::rand_bytes(&mut id).expect("BoringSSL RNG");
    id[0] = core;
    id
}

/// Log a closed connection's transport statistics at debug level (loss, RTT, congestion
/// window: what explains a slow connection after the fact). Never on the hot path.
pub fn trace_close_stats(side: &str, q: &QuicConn) {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return;
    }
    let s = q.stats();
    let p = q.path_stats().next();
    tracing::debug!(
        side,
        sent = s.sent,
        recv = s.recv,
        lost = s.lost,
        retrans = s.retrans,
        sent_bytes = s.sent_bytes,
        recv_bytes = s.recv_bytes,
        rtt_us = p.as_ref().map(|p| p.rtt.as_micros() as u64).unwrap_or(0),
        min_rtt_us = p
            .as_ref()
            .and_then(|p| p.min_rtt)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0),
        cwnd = p.as_ref().map(|p| p.cwnd).unwrap_or(0),
        delivery_rate = p.as_ref().map(|p| p.delivery_rate).unwrap_or(0),
        pmtu = p.as_ref().map(|p| p.pmtu).unwrap_or(0),
        max_send_udp = q.max_send_udp_payload_size(),
        "connection closed"
    );
}

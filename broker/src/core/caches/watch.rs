//! The driver of the watch side (`conn::watches`, pure): the host stepped with this core's
//! context and its streams' room, its effects written onto QUIC streams, and the stream a
//! watch gets once its owner accepted it.

use super::*;
use crate::core::conn::watches::{Room, StreamOpened, WatchEffect, WatchHost, MUX_SID};
use crate::core::owner::step_ctx;
use crate::core::shard::Ctx;

/// Bytes a watch may have waiting in quiche before the pump stops (flow control does the
/// rest: the queue fills behind it).
const WATCH_PUMP_BYTES: usize = 64 << 10;

impl CoreState {
    /// Run `f` on the watch host with this core's context and its streams' room, then write
    /// out its effects.
    pub(in crate::core) fn with_watches<R>(
        &mut self,
        f: impl FnOnce(&mut WatchHost, Room, &Ctx) -> R,
    ) -> R {
        let ctx = step_ctx(self.id, &self.s, &self.catalog);
        let ep = &self.ep;
        let room = |conn: ConnKey, qs: u64| {
            ep.peek(conn)
                .map(|e| WATCH_PUMP_BYTES.saturating_sub(e.conn.queued_bytes(qs)))
        };
        let r = f(&mut self.watches, &room, &ctx);
        for e in self.watches.drain_effects() {
            self.watch_effect(e);
        }
        r
    }

    fn watch_effect(&mut self, e: WatchEffect) {
        match e {
            WatchEffect::Route(to, msg) => self.route(to, msg),
            WatchEffect::Frame(conn, qs, f) => {
                self.send_to_conn(conn, qs, &f);
                self.ep.mark_dirty(conn);
            }
            WatchEffect::Bytes(conn, qs, b) => {
                if let Some(e) = self.ep.get(conn) {
                    e.conn.send_bytes(qs, b);
                    self.ep.mark_dirty(conn);
                }
            }
            WatchEffect::Finish(conn, qs) => {
                if let Some(e) = self.ep.get(conn) {
                    e.conn.finish(qs);
                    self.ep.mark_dirty(conn);
                }
            }
            WatchEffect::Refuse {
                conn,
                reply_stream,
                request_id,
                why,
            } => {
                self.send_err(conn, reply_stream, request_id, why.code, why.message);
                self.ep.mark_dirty(conn);
            }
            WatchEffect::Removed {
                conn,
                wid,
                quic_stream,
            } => {
                if let Some(session) = self.sessions.get_mut(&conn) {
                    session.watches.retain(|x| *x != wid);
                    if let Some(qs) = quic_stream {
                        session.sub_streams.remove(&qs);
                    }
                }
            }
        }
    }

    /// The owner answered a watch: open its stream if it was accepted, then hand the answer
    /// to the watch host.
    pub(in crate::core) fn on_watch_opened(&mut self, wid: u64, result: Result<Opened, Refusal>) {
        let stream = match (&result, self.watches.get(wid)) {
            (Ok(_), Some(w)) if w.mux => Some(self.mux_stream(w.conn)),
            (Ok(_), Some(w)) => Some(self.open_watch_stream(w.conn, wid)),
            _ => None,
        };
        self.with_watches(|h, room, ctx| h.on_opened(wid, result, stream, room, ctx));
    }

    /// The connection's watch mux stream, opened with its first accepted watch (no
    /// `SubStream`: it carries only `CacheMux` frames).
    fn mux_stream(&mut self, conn: ConnKey) -> StreamOpened {
        match self.watches.mux_stream(conn) {
            Some(qs) => Ok(qs),
            None => self.open_stream(conn, MUX_SID, None),
        }
    }

    /// A watch's own stream, announced with `SubStream` (the stream opens only once the
    /// owner accepted the watch, so a refused watch leaves nothing on the connection).
    fn open_watch_stream(&mut self, conn: ConnKey, wid: u64) -> StreamOpened {
        let first = Frame::SubStream {
            subscription_id: wid,
        };
        self.open_stream(conn, wid, Some(first))
    }

    /// Open a server stream on `conn` whose refills go to `sid` (a watch, or the mux), with
    /// `first` as its first frame.
    fn open_stream(&mut self, conn: ConnKey, sid: u64, first: Option<Frame>) -> StreamOpened {
        let Some(e) = self.ep.get(conn) else {
            return Err(None);
        };
        if !e.conn.can_open_uni() {
            return Err(Some(Refusal::new(
                ErrorCode::TooManySubscriptions,
                "the client's unidirectional stream limit is exhausted",
            )));
        }
        let qs = e.conn.open_uni();
        if let Some(f) = first {
            e.conn.send_frame(qs, &f);
        }
        if let Some(session) = self.sessions.get_mut(&conn) {
            session.sub_streams.insert(qs, sid);
        }
        Ok(qs)
    }

    pub(in crate::core) fn on_cache_change(&mut self, cache: u32, shard: u32, ev: Arc<Ev>) {
        self.with_watches(|h, room, ctx| h.on_change((cache, shard), ev, room, ctx));
    }

    pub(in crate::core) fn pump_watch(&mut self, wid: u64) {
        self.with_watches(|h, room, ctx| h.pump(wid, room, ctx));
    }

    /// Refill a connection's drained mux stream; true if anything went.
    pub(in crate::core) fn pump_mux(&mut self, conn: ConnKey) -> bool {
        self.with_watches(|h, room, ctx| h.pump_mux(conn, room, ctx))
    }

    /// `Unsubscribe` naming a watch of this connection.
    pub(in crate::core) fn unwatch(&mut self, conn: ConnKey, wid: u64) -> bool {
        self.with_watches(|h, room, ctx| h.unwatch(conn, wid, room, ctx))
    }

    /// End watch `wid` of connection `conn` with a refusal's code and message.
    pub(in crate::core) fn end_watch(&mut self, conn: ConnKey, wid: u64, why: Refusal) {
        let end = (why.code.number(), why.message);
        self.with_watches(|h, room, ctx| h.end_one(conn, wid, end, room, ctx));
    }

    /// End every local watch on `key`'s shard (cache deleted or moved).
    pub(in crate::core) fn end_local_watches(&mut self, key: ShardKey, why: Refusal) {
        self.with_watches(|h, room, ctx| h.end_shard(key, why, room, ctx));
    }

    pub(in crate::core) fn watches_conn_closed(&mut self, conn: ConnKey, watches: Vec<u64>) {
        self.with_watches(|h, _, ctx| h.conn_closed(conn, watches, ctx));
    }
}

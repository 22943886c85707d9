//! The driver of the subscription side (`subs`): answers to publishes, the pure subscription
//! host stepped with this core's context and the state of its QUIC streams, its effects
//! written onto those streams, and the flush that refills subscription streams as they drain.

use super::subs::{self, SubEffect, SubHost, Writable};
use super::*;
use crate::core::owner::step_ctx;
use crate::core::shard::Ctx;
use felix_quic::wire::submux;

impl CoreState {
    /// Answer a publish. `owner`: the broker that owns the shard (0: this one), named in the
    /// ack to clients that asked for it (`OWNER_IN_ACK`).
    pub(in crate::core) fn on_publish_result(
        &mut self,
        origin: Origin,
        result: PubResult,
        owner: u64,
    ) {
        let node_id = self.s.cfg.node_id;
        let Some(session) = self.sessions.get_mut(&origin.conn) else {
            return;
        };
        let owner = match (session.features & features::OWNER_IN_ACK != 0, owner) {
            (false, _) => 0,
            (true, 0) => node_id,
            (true, o) => o,
        };
        session.inflight_bytes -= origin.bytes;
        let Some(e) = self.ep.get(origin.conn) else {
            return;
        };
        if origin.ack {
            session.unacked -= 1;
            let frame = match result {
                Ok((shard, first_offset, count)) => {
                    CoreCounters::inc(&self.s.counters.publish_acks);
                    Frame::PublishAck {
                        request_id: origin.request_id,
                        shard,
                        first_offset,
                        count,
                        owner,
                    }
                }
                Err(why) => why.frame(origin.request_id),
            };
            e.conn.send_frame(origin.quic_stream, &frame);
            if let Some(ps) = session.pub_streams.get_mut(&origin.quic_stream) {
                ps.pending -= 1;
                if ps.pending == 0 && ps.fin_requested {
                    session.pub_streams.remove(&origin.quic_stream);
                    e.conn.finish(origin.quic_stream);
                }
            }
        } else if let Err(why) = result {
            e.conn.send_frame(0, &why.frame(origin.request_id));
        }
        self.ep.mark_dirty(origin.conn);
    }

    /// Run `f` on the subscription host with this core's context and its streams' state,
    /// then write out its effects.
    pub(in crate::core) fn with_subs<R>(
        &mut self,
        f: impl FnOnce(&mut SubHost, Writable, &Ctx) -> R,
    ) -> R {
        let ctx = step_ctx(self.id, &self.s, &self.catalog);
        let ep = &self.ep;
        let writable =
            |conn: ConnKey, qs: u64| ep.peek(conn).is_some_and(|e| e.conn.queued_bytes(qs) == 0);
        let r = f(&mut self.subs, &writable, &ctx);
        for e in self.subs.drain_effects() {
            self.sub_effect(e);
        }
        r
    }

    fn sub_effect(&mut self, e: SubEffect) {
        match e {
            SubEffect::Route(to, msg) => self.route(to, msg),
            SubEffect::Frame(conn, qs, frame) => {
                if let Some(e) = self.ep.get(conn) {
                    e.conn.send_frame(qs, &frame);
                    self.ep.mark_dirty(conn);
                }
            }
            SubEffect::Batch(conn, qs, shard, b) => {
                if let Some(e) = self.ep.get(conn) {
                    // Each side sends at most the other's maximum (Hello.max_frame_bytes).
                    for piece in b.split_to_fit(shard, e.conn.peer_max_frame_bytes()) {
                        e.conn.send_bytes(qs, piece.head);
                        e.conn.send_bytes(qs, piece.region);
                    }
                    self.ep.mark_dirty(conn);
                }
            }
            SubEffect::MuxBatch(conn, qs, shard, ids, b) => {
                if let Some(e) = self.ep.get(conn) {
                    // The mux head (the ids) counts against the peer's frame maximum too.
                    let max = e.conn.peer_max_frame_bytes();
                    let room = max.saturating_sub(submux::overhead_bytes(ids.len()));
                    for piece in b.split_to_fit(shard, room) {
                        // A single record too large to share a frame with every id goes to
                        // fewer ids a frame (a peer takes at least max_payload + 1 KiB: room
                        // for over 100 ids beside the largest record).
                        let used = piece.bytes() as usize + submux::overhead_bytes(0);
                        let ids_max = (max.saturating_sub(used) / 8).max(1);
                        for some in ids.chunks(ids_max) {
                            e.conn
                                .send_bytes(qs, submux::encode_head(some, &piece.head));
                            e.conn.send_bytes(qs, piece.region.clone());
                        }
                    }
                    self.ep.mark_dirty(conn);
                }
            }
            SubEffect::MuxFrame(conn, qs, ids, frame) => {
                if let Some(e) = self.ep.get(conn) {
                    e.conn
                        .send_bytes(qs, submux::encode_head(&ids, &frame.encode()));
                    self.ep.mark_dirty(conn);
                }
            }
            SubEffect::Finish(conn, qs) => {
                if let Some(e) = self.ep.get(conn) {
                    e.conn.finish(qs);
                    self.ep.mark_dirty(conn);
                }
            }
            SubEffect::Removed {
                conn,
                sid,
                quic_stream,
            } => {
                if let Some(session) = self.sessions.get_mut(&conn) {
                    session.subs.retain(|s| *s != sid);
                    // The mux stream stays for the connection's other and later subscriptions.
                    if session.sub_mux_stream != Some(quic_stream) {
                        session.sub_streams.remove(&quic_stream);
                    }
                }
            }
        }
    }

    pub(in crate::core) fn on_delivery(&mut self, stream: u32, shard: u32, batch: Batch) {
        self.with_subs(|h, w, ctx| h.on_delivery((stream, shard), batch, w, ctx));
    }

    pub(in crate::core) fn on_attach_result(
        &mut self,
        sid: u64,
        result: Result<AttachOk, Refusal>,
    ) {
        self.with_subs(|h, w, ctx| h.on_attach_result(sid, result, w, ctx));
    }

    pub(in crate::core) fn on_fetch_result(&mut self, sid: u64, result: Result<Fetched, Refusal>) {
        self.with_subs(|h, w, ctx| h.on_fetch_result(sid, result, w, ctx));
    }

    /// Drop a subscription, optionally ending its stream with `SubEnd` (code, message).
    pub(in crate::core) fn remove_sub(&mut self, sid: u64, end: Option<(u16, String)>) {
        self.with_subs(|h, _, ctx| h.remove(sid, end, ctx));
    }

    pub(in crate::core) fn end_local_subs(&mut self, key: ShardKey, why: Refusal) {
        self.with_subs(|h, _, ctx| h.end_shard(key, why, ctx));
    }

    /// Flush a connection's streams into quiche; refill subscription streams that drained.
    pub(in crate::core) fn flush_conn(&mut self, key: ConnKey) {
        for _ in 0..timers::FLUSH_PASSES_MAX {
            let Some(e) = self.ep.get(key) else { return };
            let drained = e.conn.flush_streams();
            self.release_held(key, &drained);
            let Some(session) = self.sessions.get(&key) else {
                return;
            };
            let refill: Vec<u64> = drained
                .iter()
                .filter_map(|s| session.sub_streams.get(s).copied())
                .collect();
            if refill.is_empty() {
                return;
            }
            let mut sent = false;
            for sid in refill {
                if sid == crate::core::conn::watches::MUX_SID {
                    sent |= self.pump_mux(key);
                    continue;
                }
                if sid == subs::SUB_MUX_SID {
                    sent |= self.with_subs(|h, w, ctx| h.pump_mux(key, w, ctx));
                    continue;
                }
                if self.watches.contains(sid) {
                    sent |= !self.watches.idle(sid);
                    self.pump_watch(sid);
                    continue;
                }
                let before = self.subs.queue_empty(sid);
                self.with_subs(|h, w, ctx| h.pump(sid, w, ctx));
                sent |= !before;
            }
            if !sent {
                return;
            }
        }
        // More to move than one pass allows: come back on the next flush.
        self.ep.mark_dirty(key);
    }
}

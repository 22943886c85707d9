//! Subscriptions on the connection's core: answers to attaches and fetches, offering batches
//! to each subscriber's queue, and moving queued items onto its QUIC stream as flow control
//! allows (catching up from disk one chunk at a time).

use super::*;

impl CoreState {
    // ---------- connection side ----------

    pub(in crate::core) fn on_publish_result(&mut self, origin: Origin, result: PubResult) {
        let Some(session) = self.sessions.get_mut(&origin.conn) else {
            return;
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
                    }
                }
                Err((code, msg)) => Frame::error(origin.request_id, code, msg),
            };
            e.conn.send_frame(origin.quic_stream, &frame);
            if let Some(ps) = session.pub_streams.get_mut(&origin.quic_stream) {
                ps.pending -= 1;
                if ps.pending == 0 && ps.fin_requested {
                    session.pub_streams.remove(&origin.quic_stream);
                    e.conn.finish(origin.quic_stream);
                }
            }
        } else if let Err((code, msg)) = result {
            e.conn
                .send_frame(0, &Frame::error(origin.request_id, code, msg));
        }
        self.ep.mark_dirty(origin.conn);
    }

    pub(in crate::core) fn on_delivery(&mut self, stream: u32, shard: u32, batch: Batch) {
        let Some(ids) = self.local_subs.get(&(stream, shard)) else {
            return;
        };
        for sid in ids.clone() {
            if self.subs.get(&sid).is_some_and(|s| s.catch_up.is_some()) {
                continue; // catching up from disk: this batch comes back through a fetch
            }
            self.offer_to_sub(sid, batch.clone());
            self.pump_sub(sid);
        }
    }

    pub(in crate::core) fn offer_to_sub(&mut self, sid: u64, mut b: Batch) {
        let Some(sub) = self.subs.get_mut(&sid) else {
            return;
        };
        let Some(next) = sub.next_offset else { return }; // attach not answered yet
        if b.end() <= next {
            return; // already covered by the replay
        }
        if b.first_offset < next {
            b = b.tail(sub.shard, (next - b.first_offset) as u32);
        }
        sub.next_offset = Some(b.end());
        let key = (sub.stream, sub.shard);
        let c = &self.s.counters;
        let dropped_before = sub.queue.dropped_records;
        let offer = sub.queue.offer(b);
        // Losses are counted when they happen (the queue's own count of records it lost, not
        // the notice, which folds older losses in and may wait behind a stalled subscriber's
        // full stream for a long time).
        let lost = sub.queue.dropped_records - dropped_before;
        match offer {
            Offer::Queued | Offer::Parked { first: false } => {}
            Offer::Dropped => {
                CoreCounters::add(&c.records_dropped, lost);
                CoreCounters::add(&c.records_dropped_new, lost);
            }
            Offer::Evicted(_) => {
                CoreCounters::add(&c.records_dropped, lost);
                CoreCounters::add(&c.records_dropped_old, lost);
            }
            Offer::Parked { first: true } => {
                let n = self.parked_subs.entry(key).or_default();
                *n += 1;
                if *n == 1 {
                    self.tell_owner_parked(key, true);
                }
            }
        }
    }

    pub(in crate::core) fn unparked(&mut self, key: ShardKey) {
        let n = self
            .parked_subs
            .get_mut(&key)
            .expect("parked count exists for a parked sub");
        *n -= 1;
        if *n == 0 {
            self.parked_subs.remove(&key);
            self.tell_owner_parked(key, false);
        }
    }

    /// Tell the shard's owner whether any Block subscriber on this core has parked batches
    /// (sent when the count leaves or returns to zero).
    fn tell_owner_parked(&mut self, key: ShardKey, parked: bool) {
        let owner = self.owner_core(key.0, key.1);
        let msg = MeshMsg::Parked {
            core: self.id,
            stream: key.0,
            shard: key.1,
            parked,
        };
        self.route(owner, msg);
    }

    /// Move the subscriber's next queued items onto its stream while the stream has nothing
    /// waiting for quiche (flow control is the back-pressure that makes the queue fill).
    pub(in crate::core) fn pump_sub(&mut self, sid: u64) {
        loop {
            let Some(sub) = self.subs.get_mut(&sid) else {
                return;
            };
            let Some(e) = self.ep.get(sub.conn) else {
                return;
            };
            if e.conn.queued_bytes(sub.quic_stream) > 0 {
                return;
            }
            let (item, unparked) = sub.queue.pop();
            let (conn, qs, key) = (sub.conn, sub.quic_stream, (sub.stream, sub.shard));
            let c = &self.s.counters;
            match item {
                Some(Item::Batch(b)) => {
                    CoreCounters::inc(&c.batches_delivered);
                    CoreCounters::add(&c.records_delivered, b.count as u64);
                    CoreCounters::add(&c.bytes_delivered, b.bytes());
                    // Each side sends at most the other's maximum (Hello.max_frame_bytes).
                    for piece in b.split_to_fit(key.1, e.conn.peer_max_frame_bytes()) {
                        e.conn.send_bytes(qs, piece.head);
                        e.conn.send_bytes(qs, piece.region);
                    }
                }
                Some(Item::Lag(l)) => {
                    CoreCounters::inc(&c.lag_notices);
                    e.conn.send_frame(
                        qs,
                        &Frame::Lag {
                            from_offset: l.from_offset,
                            lost: l.lost,
                        },
                    );
                }
                None => {}
            }
            self.ep.mark_dirty(conn);
            if unparked {
                self.unparked(key);
            }
            if item_is_none(&self.subs, sid) {
                self.maybe_fetch(sid);
                return;
            }
        }
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
                if self.is_watch(sid) {
                    sent |= !self.watch_idle(sid);
                    self.pump_watch(sid);
                    continue;
                }
                let before = self
                    .subs
                    .get(&sid)
                    .map(|s| s.queue.is_empty())
                    .unwrap_or(true);
                self.pump_sub(sid);
                sent |= !before;
            }
            if !sent {
                return;
            }
        }
        // More to move than one pass allows: come back on the next flush.
        self.ep.mark_dirty(key);
    }

    pub(in crate::core) fn on_attach_result(
        &mut self,
        sid: u64,
        result: Result<AttachOk, (ErrorCode, String)>,
    ) {
        let Some(sub) = self.subs.get_mut(&sid) else {
            return;
        };
        let (conn, rid, reply, shard) = (sub.conn, sub.request_id, sub.reply_stream, sub.shard);
        match result {
            Err((code, msg)) => {
                if let Some(e) = self.ep.get(conn) {
                    e.conn.send_frame(reply, &Frame::error(rid, code, msg));
                }
                self.remove_sub(sid, Some((code.number(), "subscribe refused".into())));
            }
            Ok(AttachOk {
                lag,
                replay,
                from,
                catch_up,
            }) => {
                sub.next_offset = Some(from);
                if catch_up {
                    sub.catch_up = Some(false);
                }
                if let Some(l) = lag {
                    sub.queue.offer_lag(l);
                    sub.next_offset = Some(l.from_offset + l.lost);
                }
                let (records_max, bytes_max) = sub.queue.bounds();
                for b in replay {
                    self.offer_to_sub(sid, b);
                }
                let ok = Frame::SubscribeOk {
                    request_id: rid,
                    subscription_id: sid,
                    shard,
                    next_offset: from,
                    queue_records_max: records_max as u32,
                    queue_bytes_max: bytes_max,
                };
                if let Some(e) = self.ep.get(conn) {
                    e.conn.send_frame(reply, &ok);
                }
                self.ep.mark_dirty(conn);
                self.pump_sub(sid);
                self.maybe_fetch(sid);
            }
        }
    }

    /// A catching-up subscriber with an empty queue and no fetch in flight asks its shard's
    /// owner for the next chunk (so history never outruns the subscriber's queue bound).
    pub(in crate::core) fn maybe_fetch(&mut self, sid: u64) {
        let Some(sub) = self.subs.get_mut(&sid) else {
            return;
        };
        if sub.catch_up != Some(false) || !sub.queue.is_empty() {
            return;
        }
        let Some(from) = sub.next_offset else { return };
        sub.catch_up = Some(true);
        let (stream, shard) = (sub.stream, sub.shard);
        let owner = self.owner_core(stream, shard);
        self.route(
            owner,
            MeshMsg::Fetch {
                core: self.id,
                sub: sid,
                stream,
                shard,
                from,
            },
        );
    }

    pub(in crate::core) fn on_fetch_result(
        &mut self,
        sid: u64,
        result: Result<Fetched, (ErrorCode, String)>,
    ) {
        let Some(sub) = self.subs.get_mut(&sid) else {
            return;
        };
        match result {
            Err((code, msg)) => {
                self.remove_sub(sid, Some((code.number(), msg)));
            }
            Ok(Fetched { lag, batches, live }) => {
                sub.catch_up = if live { None } else { Some(false) };
                if let Some(l) = lag {
                    sub.queue.offer_lag(l);
                    sub.next_offset = Some(l.from_offset + l.lost);
                }
                for b in batches {
                    self.offer_to_sub(sid, b);
                }
                self.pump_sub(sid);
                self.maybe_fetch(sid);
            }
        }
    }

    /// Drop a subscription: detach from the owner, release a parked hold, optionally end
    /// its stream with `SubEnd`.
    pub(in crate::core) fn remove_sub(&mut self, sid: u64, end: Option<(u16, String)>) {
        let Some(sub) = self.subs.remove(&sid) else {
            return;
        };
        let key = (sub.stream, sub.shard);
        CoreCounters::inc(&self.s.counters.subscriptions_closed);
        if let Some(v) = self.local_subs.get_mut(&key) {
            v.retain(|s| *s != sid);
            if v.is_empty() {
                self.local_subs.remove(&key);
            }
        }
        if let Some(session) = self.sessions.get_mut(&sub.conn) {
            session.subs.retain(|s| *s != sid);
            session.sub_streams.remove(&sub.quic_stream);
        }
        if sub.queue.is_parked() {
            self.unparked(key);
        }
        let owner = self.owner_core(key.0, key.1);
        self.route(
            owner,
            MeshMsg::Detach {
                core: self.id,
                stream: key.0,
                shard: key.1,
            },
        );
        if let (Some((code, message)), Some(e)) = (end, self.ep.get(sub.conn)) {
            e.conn.send_frame(
                sub.quic_stream,
                &Frame::SubEnd {
                    subscription_id: sid,
                    code,
                    message,
                },
            );
            e.conn.finish(sub.quic_stream);
            self.ep.mark_dirty(sub.conn);
        }
    }
}

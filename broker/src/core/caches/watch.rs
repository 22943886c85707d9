//! Cache watches on the connection's core: changes offered to each watch's queue, the pump
//! onto its QUIC stream, lag ends, and the bookkeeping when watches or connections go.

use super::*;

impl CoreState {
    /// A change of an owned shard reached this core: offer it to the matching watches.
    pub(in crate::core) fn on_cache_change(&mut self, cache: u32, shard: u32, ev: Arc<Ev>) {
        let Some(ids) = self.local_watches.get(&(cache, shard)) else {
            return;
        };
        for wid in ids.clone() {
            let Some(w) = self.watches.get_mut(&wid) else {
                continue;
            };
            let live = w.live_from.is_some_and(|lf| ev.offset >= lf);
            if !live || w.end.is_some() || !w.filter.matches(&ev.key) {
                continue;
            }
            if w.queue.offer(ev.offset, ev.frame.len() as u64) {
                w.frames.push_back(ev.frame.clone());
                self.pump_watch(wid);
            } else {
                let at = w.queue.ended_at().expect("a refused offer ends the queue");
                self.lag_end(wid, at);
                self.pump_watch(wid);
            }
        }
    }

    /// The watch overflowed at `at`: stop taking changes (unregister at the owner) and end
    /// it once what it queued before is delivered.
    pub(in crate::core) fn lag_end(&mut self, wid: u64, at: u64) {
        let Some(w) = self.watches.get_mut(&wid) else {
            return;
        };
        if w.end.is_some() {
            return;
        }
        CoreCounters::inc(&self.s.counters.cache_watches_lagged);
        w.end = Some(Frame::Cache(CacheFrame::CacheWatchEnd {
            code: ErrorCode::WatchLagged.number(),
            resume_from: at,
            message: format!(
                "watch fell behind its queue bound; nothing from offset {at} on was delivered: watch again from {at}"
            ),
        }));
        let key = (w.cache, w.shard);
        self.unindex_watch(wid, key);
    }

    pub(in crate::core) fn unindex_watch(&mut self, wid: u64, key: ShardKey) {
        if let Some(v) = self.local_watches.get_mut(&key) {
            v.retain(|x| *x != wid);
            if v.is_empty() {
                self.local_watches.remove(&key);
            }
        }
        let owner = self.cache_owner_core(key.0, key.1);
        self.route(
            owner,
            MeshMsg::WatchClose {
                watch: wid,
                cache: key.0,
                shard: key.1,
            },
        );
    }

    /// Move queued events onto the watch's stream while quiche has little of it waiting.
    pub(in crate::core) fn pump_watch(&mut self, wid: u64) {
        let Some(w) = self.watches.get_mut(&wid) else {
            return;
        };
        let Some(qs) = w.quic_stream else {
            return; // not accepted by the owner yet
        };
        let Some(e) = self.ep.get(w.conn) else {
            return;
        };
        let mut sent = 0u64;
        while e.conn.queued_bytes(qs) < WATCH_PUMP_BYTES {
            let next = match w.state.pop_front() {
                Some(b) => Some(b),
                None => {
                    let f = w.frames.pop_front();
                    if f.is_some() {
                        let off = w.queue.pop().expect("frames and queue move together");
                        w.resume_at = off + 1;
                    }
                    f
                }
            };
            match next {
                Some(b) => {
                    sent += 1;
                    e.conn.send_bytes(qs, b)
                }
                None => break,
            }
        }
        let conn = w.conn;
        let done = w.end.is_some() && w.state.is_empty() && w.frames.is_empty();
        CoreCounters::add(&self.s.counters.cache_watch_events, sent);
        self.ep.mark_dirty(conn);
        if done {
            let end = w.end.take();
            self.remove_watch(wid, end, true);
        }
    }

    /// Forget a watch here; `end` is sent as its last frame (then the stream is finished).
    /// `unindexed`: already unregistered (lag end).
    pub(in crate::core) fn remove_watch(&mut self, wid: u64, end: Option<Frame>, unindexed: bool) {
        let Some(w) = self.watches.remove(&wid) else {
            return;
        };
        if !unindexed {
            self.unindex_watch(wid, (w.cache, w.shard));
        }
        if let Some(session) = self.sessions.get_mut(&w.conn) {
            session.watches.retain(|x| *x != wid);
            if let Some(qs) = w.quic_stream {
                session.sub_streams.remove(&qs);
            }
        }
        if let (Some(e), Some(qs)) = (self.ep.get(w.conn), w.quic_stream) {
            if let Some(f) = end {
                e.conn.send_frame(qs, &f);
            }
            e.conn.finish(qs);
            self.ep.mark_dirty(w.conn);
        }
    }

    /// Events and bytes queued over this core's watches (state phases included).
    pub(in crate::core) fn watch_queue_totals(&self) -> (u64, u64) {
        self.watches.values().fold((0, 0), |(e, b), w| {
            let state: u64 = w.state.iter().map(|f| f.len() as u64).sum();
            (
                e + (w.queue.len() + w.state.len()) as u64,
                b + w.queue.bytes() + state,
            )
        })
    }

    pub(in crate::core) fn is_watch(&self, id: u64) -> bool {
        self.watches.contains_key(&id)
    }

    /// Nothing queued for the watch (it is gone, or everything was handed to quiche).
    pub(in crate::core) fn watch_idle(&self, id: u64) -> bool {
        self.watches
            .get(&id)
            .is_none_or(|w| w.state.is_empty() && w.frames.is_empty() && w.end.is_none())
    }

    /// `Unsubscribe` naming a watch of this connection.
    pub(in crate::core) fn unwatch(&mut self, key: ConnKey, wid: u64) -> bool {
        let Some(w) = self.watches.get(&wid).filter(|w| w.conn == key) else {
            return false;
        };
        let end = Frame::Cache(CacheFrame::CacheWatchEnd {
            code: 0,
            resume_from: w.resume_at,
            message: "unwatched".into(),
        });
        let unindexed = self.watches[&wid].end.is_some();
        self.remove_watch(wid, Some(end), unindexed);
        true
    }

    /// End every local watch on `key`'s shard (cache deleted or moved). What they had
    /// queued is dropped; each end names the offset after the last change delivered.
    pub(in crate::core) fn end_local_watches(
        &mut self,
        key: ShardKey,
        (code, msg): (ErrorCode, String),
    ) {
        let ids = self.local_watches.get(&key).cloned().unwrap_or_default();
        for wid in ids {
            let w = &self.watches[&wid];
            if w.quic_stream.is_none() {
                // Not answered by the owner yet: refuse the request itself (its open, if it
                // comes, finds the watch gone).
                let (conn, rs, rid) = (w.conn, w.reply_stream, w.request_id);
                self.remove_watch(wid, None, false);
                self.send_err(conn, rs, rid, code, msg.clone());
                self.ep.mark_dirty(conn);
                continue;
            }
            let resume_from = w.resume_at;
            let end = Frame::Cache(CacheFrame::CacheWatchEnd {
                code: code.number(),
                resume_from,
                message: msg.clone(),
            });
            self.remove_watch(wid, Some(end), false);
        }
    }

    pub(in crate::core) fn watches_conn_closed(&mut self, watches: Vec<u64>) {
        for wid in watches {
            let unindexed = self.watches.get(&wid).is_some_and(|w| w.end.is_some());
            self.remove_watch(wid, None, unindexed);
        }
    }
}

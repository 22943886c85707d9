//! Cache watches on the connection's core, as a pure state machine: the watch's start from
//! its owner, changes offered to each watch's bounded queue, the pump onto its QUIC stream,
//! lag ends, and the bookkeeping when watches or connections go.
//!
//! No socket: how many more bytes a watch's stream may take before the pump stops is asked of
//! the driver (`Room`), a new stream is opened by the driver before `on_opened`, and what to
//! write comes out as effects. `caches/watch.rs` drives it.
//!
//! A connection that negotiated `WATCH_MUX` has one stream for all its watches: a change is
//! queued once per connection as a `CacheMux` naming the watches that take it (the head is
//! per connection, the event's bytes are shared), and each watch's own bound is still
//! counted in its `WatchQueue`.

use crate::cache::{Filter, WatchQueue};
use crate::core::shard::{Ctx, Refused};
use crate::core::{Ev, MeshMsg, Opened, ShardKey, ToOwner, WatchReq};
use crate::metrics::CoreCounters;
use bytes::Bytes;
use felix_quic::idmap::IdMap;
use felix_quic::server::ConnKey;
use felix_quic::wire::cache::encode_mux_head;
use felix_quic::wire::{CacheFrame, ErrorCode, Frame, HEADER_LEN};
use std::collections::VecDeque;
use std::sync::Arc;

/// A watch whose connection this core holds.
pub(crate) struct Watch {
    pub conn: ConnKey,
    /// The watch's stream, opened once the owner accepted the watch (a refused watch never
    /// opens one).
    pub quic_stream: Option<u64>,
    pub cache: u32,
    pub shard: u32,
    pub filter: Filter,
    pub request_id: u64,
    /// Where the watch request came from (its answer goes there).
    pub reply_stream: u64,
    /// None until the owner answered; then the first offset taken live.
    pub live_from: Option<u64>,
    /// State-phase frames (sent before anything in `queue`).
    pub state: VecDeque<Bytes>,
    pub queue: WatchQueue,
    pub frames: VecDeque<Bytes>,
    /// Set once ended (lag): sent after what is queued, then the watch is gone.
    pub end: Option<Frame>,
    /// The offset after the last change handed to the connection: nothing from it on has
    /// been delivered (what an end names when it drops the queue).
    pub resume_at: u64,
    /// Delivered on its connection's mux stream (`WATCH_MUX`): `state`, `frames` stay empty
    /// (its frames wait in the connection's `Mux`) and `end` only marks an end queued there.
    pub mux: bool,
}

impl Watch {
    /// A watch of connection `conn` as its request asked (`req`), not answered by its owner
    /// yet; its answer goes to `reply_stream` under `request_id`.
    pub(crate) fn new(
        conn: ConnKey,
        req: &WatchReq,
        request_id: u64,
        reply_stream: u64,
        mux: bool,
    ) -> Watch {
        Watch {
            conn,
            quic_stream: None,
            cache: req.cache,
            shard: req.shard,
            filter: req.filter.clone(),
            request_id,
            reply_stream,
            live_from: None,
            state: VecDeque::new(),
            queue: crate::cache::WatchQueue::new(req.events_max as usize, req.bytes_max),
            frames: VecDeque::new(),
            end: None,
            resume_at: 0,
            mux,
        }
    }
}

/// The value a connection's mux stream has in the session's stream → subscription map.
pub(crate) const MUX_SID: u64 = u64::MAX;

/// One frame waiting for a connection's mux stream: `head` (naming the watches) then `body`
/// (the wrapped frame's body, shared by every connection).
struct MuxEntry {
    head: Bytes,
    body: Bytes,
    /// The change's offset, for the watches in `pops` (each pops it off its queue when sent).
    offset: u64,
    pops: Vec<u64>,
    /// The watch this frame ends: gone once it is sent.
    ends: Option<u64>,
    /// Watch frames this one stands for (one per watch named).
    count: u64,
}

impl MuxEntry {
    fn new(ids: Vec<u64>, frame: &Bytes, offset: u64, changes: bool) -> MuxEntry {
        MuxEntry {
            head: encode_mux_head(&ids, frame),
            body: frame.slice(HEADER_LEN..),
            offset,
            count: ids.len() as u64,
            pops: if changes { ids } else { Vec::new() },
            ends: None,
        }
    }

    fn len(&self) -> usize {
        self.head.len() + self.body.len()
    }
}

/// A connection's mux stream and what waits for it, in order.
#[derive(Default)]
struct Mux {
    stream: Option<u64>,
    queue: VecDeque<MuxEntry>,
    bytes: u64,
}

impl Mux {
    fn push(&mut self, e: MuxEntry) {
        self.bytes += e.len() as u64;
        self.queue.push_back(e);
    }
}

/// What the watch side asks its driver to do.
pub(crate) enum WatchEffect {
    /// A message to a core (the cache shard's owner).
    Route(u8, MeshMsg),
    /// A frame on a stream of a connection.
    Frame(ConnKey, u64, Frame),
    /// Encoded frames (events, state) on a watch's stream.
    Bytes(ConnKey, u64, Bytes),
    /// End the stream after what was written on it.
    Finish(ConnKey, u64),
    /// Refuse the watch request itself, on its request stream.
    Refuse {
        conn: ConnKey,
        reply_stream: u64,
        request_id: u64,
        why: Refused,
    },
    /// The watch is gone: its connection forgets it (and its stream).
    Removed {
        conn: ConnKey,
        wid: u64,
        quic_stream: Option<u64>,
    },
}

/// How many more bytes a connection's stream may take before the pump stops (quiche holds
/// the rest back under flow control); None for a connection that is gone.
pub(crate) type Room<'a> = &'a dyn Fn(ConnKey, u64) -> Option<usize>;

/// How a watch's stream opened: `Ok(stream)`, `Err(None)` when the connection is gone, or
/// `Err(Some(why))` when it cannot open one.
pub(crate) type StreamOpened = Result<u64, Option<Refused>>;

#[derive(Default)]
pub(crate) struct WatchHost {
    watches: IdMap<u64, Watch>,
    /// Watches of this core per cache shard (changes arrive once per core), each on its own
    /// stream.
    local: IdMap<ShardKey, Vec<u64>>,
    /// Mux watches of this core per cache shard, by connection (a change is one frame per
    /// connection).
    local_mux: IdMap<ShardKey, IdMap<ConnKey, Vec<u64>>>,
    muxes: IdMap<ConnKey, Mux>,
    effects: Vec<WatchEffect>,
}

impl WatchHost {
    pub(crate) fn drain_effects(&mut self) -> Vec<WatchEffect> {
        std::mem::take(&mut self.effects)
    }

    pub(crate) fn len(&self) -> usize {
        self.watches.len()
    }

    pub(crate) fn get(&self, wid: u64) -> Option<&Watch> {
        self.watches.get(&wid)
    }

    pub(crate) fn contains(&self, wid: u64) -> bool {
        self.watches.contains_key(&wid)
    }

    /// Cache shards with watches on this core.
    pub(crate) fn shards(&self) -> Vec<ShardKey> {
        let mut v: Vec<ShardKey> = self.local.keys().copied().collect();
        v.extend(
            self.local_mux
                .keys()
                .filter(|k| !self.local.contains_key(k)),
        );
        v
    }

    /// The mux stream of connection `conn`, once it has one.
    pub(crate) fn mux_stream(&self, conn: ConnKey) -> Option<u64> {
        self.muxes.get(&conn).and_then(|m| m.stream)
    }

    /// Frames and bytes queued over this core's watches (state phases included; a mux frame
    /// counts once however many watches it names).
    pub(crate) fn queue_totals(&self) -> (u64, u64) {
        let own = self
            .watches
            .values()
            .filter(|w| !w.mux)
            .fold((0, 0), |(e, b), w| {
                let state: u64 = w.state.iter().map(|f| f.len() as u64).sum();
                (
                    e + (w.queue.len() + w.state.len()) as u64,
                    b + w.queue.bytes() + state,
                )
            });
        self.muxes
            .values()
            .fold(own, |(e, b), m| (e + m.queue.len() as u64, b + m.bytes))
    }

    /// Nothing queued for the watch on its own stream (it is gone, on the mux, or everything
    /// was handed to quiche).
    pub(crate) fn idle(&self, wid: u64) -> bool {
        self.watches
            .get(&wid)
            .is_none_or(|w| w.mux || (w.state.is_empty() && w.frames.is_empty() && w.end.is_none()))
    }

    fn send(&mut self, to: u8, msg: MeshMsg) {
        self.effects.push(WatchEffect::Route(to, msg));
    }

    /// A new watch: register it here and ask the shard's owner to compute its start.
    pub(crate) fn open(&mut self, wid: u64, w: Watch, req: WatchReq, ctx: &Ctx) {
        let key = (w.cache, w.shard);
        if w.mux {
            let conns = self.local_mux.entry(key).or_default();
            conns.entry(w.conn).or_default().push(wid);
        } else {
            self.local.entry(key).or_default().push(wid);
        }
        let prev = self.watches.insert(wid, w);
        assert!(prev.is_none(), "watch ids are unique");
        self.send(
            ctx.cache_owner_core(key),
            MeshMsg::Owner(ToOwner::WatchOpen(req)),
        );
    }

    /// The owner answered the watch: refused, or its start (state phase, replay, live
    /// offset) with the stream the driver opened for it.
    pub(crate) fn on_opened(
        &mut self,
        wid: u64,
        result: Result<Opened, Refused>,
        stream: Option<StreamOpened>,
        room: Room,
        ctx: &Ctx,
    ) {
        let Some(w) = self.watches.get(&wid) else {
            return; // closed meanwhile; its WatchClose follows the open at the owner
        };
        let (conn, request_id, reply_stream) = (w.conn, w.request_id, w.reply_stream);
        let refuse = |h: &mut Self, why: Refused| {
            h.remove(wid, None, false, ctx);
            h.effects.push(WatchEffect::Refuse {
                conn,
                reply_stream,
                request_id,
                why,
            });
        };
        let opened = match result {
            Ok(o) => o,
            Err(why) => return refuse(self, why),
        };
        // The stream opens only now, so a refused watch leaves nothing on the connection.
        let qs = match stream.expect("the driver opens a stream for an accepted watch") {
            Ok(qs) => qs,
            Err(None) => return self.remove(wid, None, false, ctx),
            Err(Some(why)) => return refuse(self, why),
        };
        CoreCounters::inc(&ctx.counters.cache_watches_opened);
        let w = self.watches.get_mut(&wid).expect("looked up above");
        w.quic_stream = Some(qs);
        w.resume_at = opened.resume_from;
        w.live_from = Some(opened.live_from);
        let mux = w.mux;
        if mux {
            let m = self.muxes.entry(conn).or_default();
            assert!(
                m.stream.is_none_or(|s| s == qs),
                "one mux stream per connection"
            );
            m.stream = Some(qs);
        }
        // The state phase, then the replay, each frame on the watch's stream or the mux.
        if let Some((retained, done)) = opened.state {
            #[cfg(test)]
            let (retained, done) = breaks::state_done_first(retained, done);
            for f in retained.into_iter().chain(std::iter::once(done)) {
                match self.muxes.get_mut(&conn).filter(|_| mux) {
                    Some(m) => m.push(MuxEntry::new(vec![wid], &f, 0, false)),
                    None => w.state.push_back(f),
                }
            }
        }
        let mut lagged = None;
        for ev in opened.replay {
            if !w.queue.offer(ev.offset, ev.frame.len() as u64) {
                lagged = w.queue.ended_at();
                break;
            }
            match self.muxes.get_mut(&conn).filter(|_| mux) {
                Some(m) => m.push(MuxEntry::new(vec![wid], &ev.frame, ev.offset, true)),
                None => w.frames.push_back(ev.frame.clone()),
            }
        }
        let (events_max, bytes_max) = w.queue.bounds();
        let ok = Frame::Cache(CacheFrame::CacheWatchOk {
            request_id,
            watch_id: wid,
            shard: opened.shard,
            live_from: opened.live_from,
            queue_events_max: events_max as u32,
            queue_bytes_max: bytes_max,
        });
        self.effects
            .push(WatchEffect::Frame(conn, reply_stream, ok));
        if let Some(at) = lagged.or(opened.truncated_at) {
            self.lag_end(wid, at, ctx);
        }
        self.pump(wid, room, ctx);
    }

    /// Offer a change to the mux watches of `key`'s shard: one frame per connection naming
    /// the watches that took it. Returns the watches that overflowed (with the offset they
    /// resume from) and the connections to pump.
    fn offer_mux(&mut self, key: ShardKey, ev: &Ev) -> (Vec<(u64, u64)>, Vec<ConnKey>) {
        let (mut lagged, mut touched) = (Vec::new(), Vec::new());
        let Some(conns) = self.local_mux.get(&key) else {
            return (lagged, touched);
        };
        for (conn, wids) in conns {
            let mut ids = Vec::new();
            for wid in wids {
                let w = self.watches.get_mut(wid).expect("indexed watches exist");
                let live = w.live_from.is_some_and(|lf| ev.offset >= lf);
                if !live || w.end.is_some() || !w.filter.matches(&ev.key) {
                    continue;
                }
                if w.queue.offer(ev.offset, ev.frame.len() as u64) {
                    ids.push(*wid);
                } else {
                    let at = w.queue.ended_at().expect("a refused offer ends the queue");
                    lagged.push((*wid, at));
                }
            }
            if !ids.is_empty() {
                let m = self
                    .muxes
                    .get_mut(conn)
                    .expect("an opened mux watch has a mux");
                m.push(MuxEntry::new(ids, &ev.frame, ev.offset, true));
                touched.push(*conn);
            }
        }
        (lagged, touched)
    }

    /// A change of an owned shard reached this core: offer it to the matching watches.
    pub(crate) fn on_change(&mut self, key: ShardKey, ev: Arc<Ev>, room: Room, ctx: &Ctx) {
        let (lagged, touched) = self.offer_mux(key, &ev);
        for (wid, at) in lagged {
            self.lag_end(wid, at, ctx);
        }
        for conn in touched {
            self.pump_mux(conn, room, ctx);
        }
        let Some(ids) = self.local.get(&key) else {
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
            } else {
                let at = w.queue.ended_at().expect("a refused offer ends the queue");
                self.lag_end(wid, at, ctx);
            }
            self.pump(wid, room, ctx);
        }
    }

    /// The watch overflowed at `at`: stop taking changes (unregister at the owner) and end
    /// it once what it queued before is delivered.
    fn lag_end(&mut self, wid: u64, at: u64, ctx: &Ctx) {
        let Some(w) = self.watches.get_mut(&wid) else {
            return;
        };
        if w.end.is_some() {
            return;
        }
        CoreCounters::inc(&ctx.counters.cache_watches_lagged);
        #[cfg(test)]
        let at = at + u64::from(breaks::on(&breaks::MUX_RESUME_PAST_LAG));
        let end = Frame::Cache(CacheFrame::CacheWatchEnd {
            code: ErrorCode::WatchLagged.number(),
            resume_from: at,
            message: format!(
                "watch fell behind its queue bound; nothing from offset {at} on was delivered: watch again from {at}"
            ),
        });
        let (key, conn, mux) = ((w.cache, w.shard), w.conn, w.mux);
        self.unindex(wid, key, conn, mux, ctx);
        if mux {
            self.queue_mux_end(wid, end);
        } else {
            self.watches.get_mut(&wid).expect("looked up above").end = Some(end);
        }
    }

    /// Queue the end of mux watch `wid` after everything queued for it (it is forgotten once
    /// the end is sent); `w.end` marks it as ending.
    fn queue_mux_end(&mut self, wid: u64, end: Frame) {
        let w = self
            .watches
            .get_mut(&wid)
            .expect("a watch being ended exists");
        assert!(w.mux && w.end.is_none(), "one end per mux watch");
        let mut e = MuxEntry::new(vec![wid], &end.encode(), 0, false);
        e.ends = Some(wid);
        w.end = Some(end);
        let m = self
            .muxes
            .get_mut(&w.conn)
            .expect("an opened mux watch has a mux");
        #[cfg(test)]
        if breaks::on(&breaks::MUX_END_FIRST) {
            // Broken on purpose: the end overtakes what was queued for the watch.
            m.bytes += e.len() as u64;
            m.queue.push_front(e);
            return;
        }
        m.push(e);
    }

    /// Where a watch ended now resumes: after what is queued for it on the mux (that is still
    /// delivered, before its end), or after what its own stream was handed.
    fn resume_point(w: &Watch) -> u64 {
        match (w.mux, w.queue.last()) {
            (true, Some(last)) => last + 1,
            _ => w.resume_at,
        }
    }

    fn unindex(&mut self, wid: u64, key: ShardKey, conn: ConnKey, mux: bool, ctx: &Ctx) {
        if mux {
            if let Some(conns) = self.local_mux.get_mut(&key) {
                if let Some(v) = conns.get_mut(&conn) {
                    v.retain(|x| *x != wid);
                    if v.is_empty() {
                        conns.remove(&conn);
                    }
                }
                if conns.is_empty() {
                    self.local_mux.remove(&key);
                }
            }
        } else if let Some(v) = self.local.get_mut(&key) {
            v.retain(|x| *x != wid);
            if v.is_empty() {
                self.local.remove(&key);
            }
        }
        let close = MeshMsg::Owner(ToOwner::WatchClose {
            watch: wid,
            cache: key.0,
            shard: key.1,
        });
        self.send(ctx.cache_owner_core(key), close);
    }

    /// Move queued frames onto the watch's stream while it has room; an ended watch whose
    /// queue is delivered sends its end and is gone.
    pub(crate) fn pump(&mut self, wid: u64, room: Room, ctx: &Ctx) {
        let Some(w) = self.watches.get_mut(&wid) else {
            return;
        };
        if w.mux {
            let conn = w.conn;
            self.pump_mux(conn, room, ctx);
            return;
        }
        let Some(qs) = w.quic_stream else {
            return; // not accepted by the owner yet
        };
        let Some(mut left) = room(w.conn, qs) else {
            return;
        };
        let mut sent = 0u64;
        while left > 0 {
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
            let Some(b) = next else { break };
            sent += 1;
            left = left.saturating_sub(b.len());
            self.effects.push(WatchEffect::Bytes(w.conn, qs, b));
        }
        let done = w.end.is_some() && w.state.is_empty() && w.frames.is_empty();
        CoreCounters::add(&ctx.counters.cache_watch_events, sent);
        if done {
            let end = w.end.take();
            self.remove(wid, end, true, ctx);
        }
    }

    /// Move frames of connection `conn`'s mux queue onto its mux stream while it has room;
    /// true if any went. A frame of changes pops each named watch's queue (those still here);
    /// a watch whose end went is gone.
    pub(crate) fn pump_mux(&mut self, conn: ConnKey, room: Room, ctx: &Ctx) -> bool {
        let Some(m) = self.muxes.get_mut(&conn) else {
            return false;
        };
        let Some(qs) = m.stream else {
            return false;
        };
        let Some(mut left) = room(conn, qs) else {
            return false;
        };
        let (mut frames, mut sent, mut gone) = (0u64, 0u64, Vec::new());
        while left > 0 {
            let Some(e) = m.queue.pop_front() else { break };
            m.bytes -= e.len() as u64;
            for wid in &e.pops {
                if let Some(w) = self.watches.get_mut(wid) {
                    let off = w
                        .queue
                        .pop()
                        .expect("a queued change is in its watch's queue");
                    assert_eq!(off, e.offset, "mux frames and watch queues move together");
                    w.resume_at = off + 1;
                }
            }
            frames += 1;
            sent += e.count;
            left = left.saturating_sub(e.len());
            gone.extend(e.ends);
            self.effects.push(WatchEffect::Bytes(conn, qs, e.head));
            self.effects.push(WatchEffect::Bytes(conn, qs, e.body));
        }
        CoreCounters::add(&ctx.counters.cache_watch_events, sent);
        for wid in gone {
            self.remove(wid, None, true, ctx);
        }
        frames > 0
    }

    /// Forget a watch here; `end` is sent as its last frame (then the stream is finished).
    /// `unindexed`: already unregistered (lag end). A mux watch's end was queued on the mux
    /// (`end` is None), and the mux stream stays.
    pub(crate) fn remove(&mut self, wid: u64, end: Option<Frame>, unindexed: bool, ctx: &Ctx) {
        let Some(w) = self.watches.remove(&wid) else {
            return;
        };
        if !unindexed {
            self.unindex(wid, (w.cache, w.shard), w.conn, w.mux, ctx);
        }
        self.effects.push(WatchEffect::Removed {
            conn: w.conn,
            wid,
            quic_stream: w.quic_stream.filter(|_| !w.mux),
        });
        if w.mux {
            assert!(
                end.is_none(),
                "a mux watch's end goes through its mux queue"
            );
            return;
        }
        if let Some(qs) = w.quic_stream {
            if let Some(f) = end {
                self.effects.push(WatchEffect::Frame(w.conn, qs, f));
            }
            self.effects.push(WatchEffect::Finish(w.conn, qs));
        }
    }

    /// `Unsubscribe` naming a watch of connection `conn`: false if it names none.
    pub(crate) fn unwatch(&mut self, conn: ConnKey, wid: u64, room: Room, ctx: &Ctx) -> bool {
        self.end_one(conn, wid, (0, "unwatched".into()), room, ctx)
    }

    /// End watch `wid` of connection `conn` with `(code, message)` (0: a normal end), after
    /// what it has queued on a mux: false if it names none.
    pub(crate) fn end_one(
        &mut self,
        conn: ConnKey,
        wid: u64,
        (code, message): (u16, String),
        room: Room,
        ctx: &Ctx,
    ) -> bool {
        let Some(w) = self.watches.get(&wid).filter(|w| w.conn == conn) else {
            return false;
        };
        let end = Frame::Cache(CacheFrame::CacheWatchEnd {
            code,
            resume_from: Self::resume_point(w),
            message,
        });
        let unindexed = w.end.is_some();
        if w.mux && w.quic_stream.is_some() {
            // An end already queued answers the unwatch; else this one goes after the rest.
            if !unindexed {
                let (key, mux) = ((w.cache, w.shard), w.mux);
                self.unindex(wid, key, conn, mux, ctx);
                self.queue_mux_end(wid, end);
                self.pump_mux(conn, room, ctx);
            }
            return true;
        }
        self.remove(wid, Some(end), unindexed, ctx);
        true
    }

    /// End every local watch on `key`'s shard (cache deleted or moved). What they had
    /// queued is dropped; each end names the offset after the last change delivered.
    pub(crate) fn end_shard(&mut self, key: ShardKey, why: Refused, room: Room, ctx: &Ctx) {
        let mut ids = self.local.get(&key).cloned().unwrap_or_default();
        if let Some(conns) = self.local_mux.get(&key) {
            ids.extend(conns.values().flatten());
        }
        let mut touched = Vec::new();
        for wid in ids {
            let w = &self.watches[&wid];
            if w.quic_stream.is_none() {
                // Not answered by the owner yet: refuse the request itself (its open, if it
                // comes, finds the watch gone).
                let (conn, reply_stream, request_id) = (w.conn, w.reply_stream, w.request_id);
                self.remove(wid, None, false, ctx);
                self.effects.push(WatchEffect::Refuse {
                    conn,
                    reply_stream,
                    request_id,
                    why: why.clone(),
                });
                continue;
            }
            let end = Frame::Cache(CacheFrame::CacheWatchEnd {
                code: why.code.number(),
                resume_from: Self::resume_point(w),
                message: why.message.clone(),
            });
            if w.mux {
                // What it has queued is still delivered, before its end.
                let conn = w.conn;
                self.unindex(wid, key, conn, true, ctx);
                self.queue_mux_end(wid, end);
                touched.push(conn);
                continue;
            }
            self.remove(wid, Some(end), false, ctx);
        }
        touched.dedup();
        for conn in touched {
            self.pump_mux(conn, room, ctx);
        }
    }

    /// The connection of these watches closed.
    pub(crate) fn conn_closed(&mut self, conn: ConnKey, wids: Vec<u64>, ctx: &Ctx) {
        self.muxes.remove(&conn);
        for wid in wids {
            let unindexed = self.watches.get(&wid).is_some_and(|w| w.end.is_some());
            self.remove(wid, None, unindexed, ctx);
        }
    }
}

/// Test-build switches that break one rule each, so the mux checker's negative twin can show
/// it catches the break (`mux_check.rs`).
#[cfg(test)]
pub(crate) mod breaks {
    use std::sync::atomic::AtomicBool;
    /// Queue a mux watch's end ahead of the changes queued for it.
    pub(crate) static MUX_END_FIRST: AtomicBool = AtomicBool::new(false);
    /// Name the offset after the refused change as a lag end's resume point.
    pub(crate) static MUX_RESUME_PAST_LAG: AtomicBool = AtomicBool::new(false);
    /// Send a state phase's `CacheStateDone` before its retained events.
    pub(crate) static MUX_STATE_DONE_FIRST: AtomicBool = AtomicBool::new(false);

    pub(crate) use crate::core::shard::stream::breaks::on;

    /// With `MUX_STATE_DONE_FIRST` on, the state phase's end goes before its values.
    pub(crate) fn state_done_first(
        mut retained: Vec<bytes::Bytes>,
        done: bytes::Bytes,
    ) -> (Vec<bytes::Bytes>, bytes::Bytes) {
        if !on(&MUX_STATE_DONE_FIRST) {
            return (retained, done);
        }
        retained.insert(0, done);
        let last = retained.pop().expect("done was put in");
        (retained, last)
    }
}

#[cfg(test)]
#[path = "mux_check.rs"]
mod mux_check;

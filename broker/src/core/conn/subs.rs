//! Subscriptions on the connection's core, as a pure state machine: answers to attaches and
//! fetches, offering batches to each subscriber's queue, telling the owner when a Block
//! subscriber parks, catching up from disk one chunk at a time, and ends.
//!
//! No socket: whether a subscription stream can take its next item (nothing of it waits for
//! quiche, which is the flow-control back-pressure that fills the queue) is asked of the
//! driver, and what to write comes out as effects. The core driver (`conn/deliver.rs`) and
//! the simulator run this same code.

use crate::core::shard::{Ctx, Refusal};
use crate::core::{AttachOk, Fetched, MeshMsg, ShardKey, ToOwner};
use crate::fanout::{Batch, Item, Offer, SubQueue};
use crate::metrics::CoreCounters;
use felix_quic::idmap::IdMap;
use felix_quic::server::ConnKey;
use felix_quic::wire::{Frame, StartAt};

pub(crate) struct Sub {
    pub conn: ConnKey,
    pub quic_stream: u64,
    pub stream: u32,
    pub shard: u32,
    pub queue: SubQueue,
    /// None until the owner answered the attach; then the next offset this subscriber takes.
    pub next_offset: Option<u64>,
    pub request_id: u64,
    pub reply_stream: u64,
    /// Catching up from disk: `Some(fetch in flight)`; live once `None`.
    pub catch_up: Option<bool>,
    /// Delivered on its connection's subscription mux stream (`SUB_MUX`; `quic_stream` is
    /// that stream): its items leave in `SubMux` frames naming every subscription of the
    /// connection that takes the same item.
    pub mux: bool,
}

/// What the subscription side asks its driver to do.
pub(crate) enum SubEffect {
    /// A message to a core (the shard's owner).
    Route(u8, MeshMsg),
    /// A frame on a stream of a connection.
    Frame(ConnKey, u64, Frame),
    /// A delivery of shard `.2` on a subscription stream (the driver cuts it to the peer's
    /// frame maximum).
    Batch(ConnKey, u64, u32, Batch),
    /// A delivery of shard `.2` on the connection's mux stream `.1`, for the subscriptions
    /// `.3` (one `SubMux` frame per piece the driver cuts).
    MuxBatch(ConnKey, u64, u32, Vec<u64>, Batch),
    /// A frame (`Lag`, `SubEnd`) on the connection's mux stream `.1`, for the subscriptions
    /// `.2`.
    MuxFrame(ConnKey, u64, Vec<u64>, Frame),
    /// End the stream after what was written on it.
    Finish(ConnKey, u64),
    /// The subscription is gone: its connection forgets it (and its stream).
    Removed {
        conn: ConnKey,
        sid: u64,
        quic_stream: u64,
    },
}

/// Asks whether a connection's stream has nothing waiting for quiche (so the next item may
/// be written). False for a connection that is gone.
pub(crate) type Writable<'a> = &'a dyn Fn(ConnKey, u64) -> bool;

#[derive(Default)]
pub(crate) struct SubHost {
    subs: IdMap<u64, Sub>,
    /// Subscriptions of this core per shard (deliveries arrive once per core per batch).
    local: IdMap<ShardKey, Vec<u64>>,
    /// Per shard: how many Block subscribers of this core have parked batches (the owner holds
    /// publishes while it is above zero).
    parked: IdMap<ShardKey, u32>,
    /// Per connection with mux subscriptions: its mux stream and those subscriptions.
    muxes: IdMap<ConnKey, mux::MuxConn>,
    effects: Vec<SubEffect>,
}

mod mux;
#[cfg(test)]
pub(crate) use mux::SUB_MUX_IDS_MAX;
pub(crate) use mux::SUB_MUX_SID;

impl SubHost {
    pub(crate) fn drain_effects(&mut self) -> Vec<SubEffect> {
        std::mem::take(&mut self.effects)
    }

    pub(crate) fn len(&self) -> usize {
        self.subs.len()
    }

    pub(crate) fn get(&self, sid: u64) -> Option<&Sub> {
        self.subs.get(&sid)
    }

    pub(crate) fn ids(&self) -> Vec<u64> {
        self.subs.keys().copied().collect()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &Sub> {
        self.subs.values()
    }

    /// Subscriptions of this core on shard `key`.
    pub(crate) fn on_shard(&self, key: ShardKey) -> Vec<u64> {
        self.local.get(&key).cloned().unwrap_or_default()
    }

    /// The queue of `sid` is empty (or `sid` is gone).
    pub(crate) fn queue_empty(&self, sid: u64) -> bool {
        self.subs.get(&sid).is_none_or(|s| s.queue.is_empty())
    }

    /// Shards whose parked count is above zero, with the count (for the invariant checkers).
    #[cfg(test)]
    pub(crate) fn parked_counts(&self) -> &IdMap<ShardKey, u32> {
        &self.parked
    }

    /// A new subscription: register it and ask the shard's owner to attach it from `start`.
    pub(crate) fn open(&mut self, sid: u64, sub: Sub, start: StartAt, ctx: &Ctx) {
        let key = (sub.stream, sub.shard);
        let prev = self.subs.insert(sid, sub);
        assert!(prev.is_none(), "subscription ids are unique");
        self.local.entry(key).or_default().push(sid);
        let sub = self.subs.get(&sid).expect("just inserted");
        if sub.mux {
            let (conn, qs) = (sub.conn, sub.quic_stream);
            self.mux_join(conn, qs, sid);
        }
        CoreCounters::inc(&ctx.counters.subscriptions_opened);
        let attach = MeshMsg::Owner(ToOwner::Attach {
            core: ctx.me,
            sub: sid,
            stream: key.0,
            shard: key.1,
            start,
        });
        self.effects
            .push(SubEffect::Route(ctx.owner_core(key), attach));
    }

    pub(crate) fn on_delivery(&mut self, key: ShardKey, batch: Batch, w: Writable, ctx: &Ctx) {
        // Taken out and put back (offers and pumps leave the list alone): no copy of the
        // list per delivery.
        let Some(ids) = self.local.get_mut(&key).map(std::mem::take) else {
            return;
        };
        let mut mux_conns: Vec<ConnKey> = Vec::new();
        for &sid in &ids {
            let Some(sub) = self.subs.get(&sid) else {
                continue;
            };
            if sub.catch_up.is_some() {
                continue; // catching up from disk: this batch comes back through a fetch
            }
            let (mux, conn) = (sub.mux, sub.conn);
            self.offer(sid, batch.clone(), ctx);
            if !mux {
                self.pump(sid, w, ctx);
            } else if !mux_conns.contains(&conn) {
                mux_conns.push(conn);
            }
        }
        let restored = self.local.insert(key, ids);
        debug_assert!(
            restored.is_some_and(|v| v.is_empty()),
            "nothing else touched it"
        );
        for conn in mux_conns {
            self.pump_mux(conn, w, ctx);
        }
    }

    fn offer(&mut self, sid: u64, mut b: Batch, ctx: &Ctx) {
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
        let c = ctx.counters;
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
                let n = self.parked.entry(key).or_default();
                *n += 1;
                if *n == 1 {
                    self.tell_owner_parked(key, true, ctx);
                }
            }
        }
    }

    fn unparked(&mut self, key: ShardKey, ctx: &Ctx) {
        let n = self
            .parked
            .get_mut(&key)
            .expect("parked count exists for a parked sub");
        *n -= 1;
        if *n == 0 {
            self.parked.remove(&key);
            self.tell_owner_parked(key, false, ctx);
        }
    }

    /// Tell the shard's owner whether any Block subscriber on this core has parked batches
    /// (sent when the count leaves or returns to zero).
    fn tell_owner_parked(&mut self, key: ShardKey, parked: bool, ctx: &Ctx) {
        let msg = MeshMsg::Owner(ToOwner::Parked {
            core: ctx.me,
            stream: key.0,
            shard: key.1,
            parked,
        });
        self.effects
            .push(SubEffect::Route(ctx.owner_core(key), msg));
    }

    /// Move the subscriber's next queued item onto its stream if the stream has nothing
    /// waiting for quiche (one item: once written, the stream has bytes waiting). Returns
    /// whether an item was written.
    pub(crate) fn pump(&mut self, sid: u64, w: Writable, ctx: &Ctx) -> bool {
        let Some(sub) = self.subs.get_mut(&sid) else {
            return false;
        };
        if sub.mux {
            let conn = sub.conn;
            return self.pump_mux(conn, w, ctx);
        }
        let (conn, qs, key) = (sub.conn, sub.quic_stream, (sub.stream, sub.shard));
        if !w(conn, qs) {
            return false;
        }
        let (item, unparked) = sub.queue.pop();
        let sent = item.is_some();
        if let Some(item) = &item {
            count_sent(ctx.counters, item);
        }
        match item {
            Some(Item::Batch(b)) => self.effects.push(SubEffect::Batch(conn, qs, key.1, b)),
            Some(Item::Lag(l)) => self.effects.push(SubEffect::Frame(conn, qs, lag_frame(l))),
            None => {}
        }
        self.after_pop(sid, key, unparked, ctx);
        sent
    }

    /// After an item of `sid` (on shard `key`) left: release a parked hold it ended, and ask
    /// for the next history chunk when its queue is empty.
    fn after_pop(&mut self, sid: u64, key: ShardKey, unparked: bool, ctx: &Ctx) {
        if unparked {
            self.unparked(key, ctx);
        }
        if self.queue_empty(sid) {
            self.maybe_fetch(sid, ctx);
        }
    }

    pub(crate) fn on_attach_result(
        &mut self,
        sid: u64,
        result: Result<AttachOk, Refusal>,
        w: Writable,
        ctx: &Ctx,
    ) {
        let Some(sub) = self.subs.get_mut(&sid) else {
            return;
        };
        let (conn, rid, reply, shard) = (sub.conn, sub.request_id, sub.reply_stream, sub.shard);
        match result {
            Err(why) => {
                let code = why.code.number();
                self.effects
                    .push(SubEffect::Frame(conn, reply, why.frame(rid)));
                self.remove(sid, Some((code, "subscribe refused".into())), ctx);
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
                    self.offer(sid, b, ctx);
                }
                let ok = Frame::SubscribeOk {
                    request_id: rid,
                    subscription_id: sid,
                    shard,
                    next_offset: from,
                    queue_records_max: records_max as u32,
                    queue_bytes_max: bytes_max,
                };
                self.effects.push(SubEffect::Frame(conn, reply, ok));
                self.pump(sid, w, ctx);
                self.maybe_fetch(sid, ctx);
            }
        }
    }

    /// A catching-up subscriber with an empty queue and no fetch in flight asks its shard's
    /// owner for the next chunk (so history never outruns the subscriber's queue bound).
    fn maybe_fetch(&mut self, sid: u64, ctx: &Ctx) {
        let Some(sub) = self.subs.get_mut(&sid) else {
            return;
        };
        if sub.catch_up != Some(false) || !sub.queue.is_empty() {
            return;
        }
        let Some(from) = sub.next_offset else { return };
        sub.catch_up = Some(true);
        let (stream, shard) = (sub.stream, sub.shard);
        let fetch = MeshMsg::Owner(ToOwner::Fetch {
            core: ctx.me,
            sub: sid,
            stream,
            shard,
            from,
        });
        let owner = ctx.owner_core((stream, shard));
        self.effects.push(SubEffect::Route(owner, fetch));
    }

    pub(crate) fn on_fetch_result(
        &mut self,
        sid: u64,
        result: Result<Fetched, Refusal>,
        w: Writable,
        ctx: &Ctx,
    ) {
        let Some(sub) = self.subs.get_mut(&sid) else {
            return;
        };
        match result {
            Err(why) => self.remove(sid, Some((why.code.number(), why.message)), ctx),
            Ok(Fetched { lag, batches, live }) => {
                sub.catch_up = if live { None } else { Some(false) };
                if let Some(l) = lag {
                    sub.queue.offer_lag(l);
                    sub.next_offset = Some(l.from_offset + l.lost);
                }
                for b in batches {
                    self.offer(sid, b, ctx);
                }
                self.pump(sid, w, ctx);
                self.maybe_fetch(sid, ctx);
            }
        }
    }

    /// Drop a subscription: detach from the owner, release a parked hold, optionally end
    /// its stream with `SubEnd`.
    pub(crate) fn remove(&mut self, sid: u64, end: Option<(u16, String)>, ctx: &Ctx) {
        let Some(sub) = self.subs.remove(&sid) else {
            return;
        };
        let key = (sub.stream, sub.shard);
        CoreCounters::inc(&ctx.counters.subscriptions_closed);
        if let Some(v) = self.local.get_mut(&key) {
            v.retain(|s| *s != sid);
            if v.is_empty() {
                self.local.remove(&key);
            }
        }
        let (conn, qs) = (sub.conn, sub.quic_stream);
        if sub.mux {
            self.mux_leave(conn, sid);
        }
        self.effects.push(SubEffect::Removed {
            conn,
            sid,
            quic_stream: qs,
        });
        if sub.queue.is_parked() {
            self.unparked(key, ctx);
        }
        let detach = MeshMsg::Owner(ToOwner::Detach {
            core: ctx.me,
            stream: key.0,
            shard: key.1,
        });
        self.effects
            .push(SubEffect::Route(ctx.owner_core(key), detach));
        if let Some((code, message)) = end {
            let end = Frame::SubEnd {
                subscription_id: sid,
                code,
                message,
            };
            if sub.mux {
                // The mux stream lives as long as the connection.
                self.effects
                    .push(SubEffect::MuxFrame(conn, qs, vec![sid], end));
            } else {
                self.effects.push(SubEffect::Frame(conn, qs, end));
                self.effects.push(SubEffect::Finish(conn, qs));
            }
        }
    }

    /// End every subscription of this core on shard `key`, telling each why.
    pub(crate) fn end_shard(&mut self, key: ShardKey, why: Refusal, ctx: &Ctx) {
        for sid in self.on_shard(key) {
            self.remove(sid, Some((why.code.number(), why.message.clone())), ctx);
        }
    }
}

/// Count an item as sent to one subscriber (per subscriber, on its own stream or the mux).
fn count_sent(c: &CoreCounters, item: &Item) {
    match item {
        Item::Batch(b) => {
            CoreCounters::inc(&c.batches_delivered);
            CoreCounters::add(&c.records_delivered, b.count as u64);
            CoreCounters::add(&c.bytes_delivered, b.bytes());
        }
        Item::Lag(_) => CoreCounters::inc(&c.lag_notices),
    }
}

fn lag_frame(l: crate::fanout::Lag) -> Frame {
    Frame::Lag {
        from_offset: l.from_offset,
        lost: l.lost,
    }
}

/// Test-build switches that break one rule each (`core::sim::scenarios`' negative twins).
#[cfg(test)]
pub(crate) mod breaks {
    use std::sync::atomic::AtomicBool;
    /// A mux frame names only its lead, though every subscription grouped with it had its
    /// item taken: the others lose it silently.
    pub(crate) static MUX_NAMES_ONLY_LEAD: AtomicBool = AtomicBool::new(false);
    pub(crate) use crate::core::shard::stream::breaks::on;
}

//! The subscription mux on the broker side (`SUB_MUX`, docs/protocol.md "Subscription
//! mux"): every drop_new subscription of a connection leaves on one stream. Each keeps its
//! own queue, bounds and lag notices exactly as on its own stream; only the
//! writing is shared. When the mux stream can take more, the pump takes the head item of one
//! subscription (round robin, so none waits behind the others for ever) and every other
//! subscription of the connection whose head is the same batch, and writes one `SubMux`
//! frame naming them all.

use super::{SubEffect, SubHost, Writable};
use crate::core::shard::Ctx;
use crate::fanout::Item;
use felix_quic::server::ConnKey;

/// The `sub_streams` entry of a connection's subscription mux stream (no subscription has
/// this id: ids are the core's number shifted left by 48, then a count).
pub(crate) const SUB_MUX_SID: u64 = u64::MAX - 1;

/// Subscriptions one `SubMux` frame names at most (8 bytes each): a connection with more
/// subscriptions taking one batch gets several frames.
pub(crate) const SUB_MUX_IDS_MAX: usize = 4096;

/// A connection's mux subscriptions.
pub(crate) struct MuxConn {
    /// The mux stream.
    qs: u64,
    /// Its mux subscriptions, in the order they opened.
    subs: Vec<u64>,
    /// Where the next pump starts looking for a head item (round robin).
    next: usize,
}

/// What makes two queued batches the same delivery: the same shard of the same stream, the
/// same offsets and the same shared records.
#[derive(PartialEq, Eq, Clone, Copy)]
struct Same {
    stream: u32,
    shard: u32,
    first_offset: u64,
    count: u32,
    region: *const u8,
}

impl SubHost {
    pub(super) fn mux_join(&mut self, conn: ConnKey, qs: u64, sid: u64) {
        let m = self.muxes.entry(conn).or_insert_with(|| MuxConn {
            qs,
            subs: Vec::new(),
            next: 0,
        });
        assert_eq!(m.qs, qs, "a connection has one subscription mux stream");
        m.subs.push(sid);
    }

    pub(super) fn mux_leave(&mut self, conn: ConnKey, sid: u64) {
        let Some(m) = self.muxes.get_mut(&conn) else {
            return;
        };
        m.subs.retain(|s| *s != sid);
        if m.subs.is_empty() {
            self.muxes.remove(&conn);
        }
    }

    /// Write the next `SubMux` of connection `conn` if its mux stream has nothing waiting for
    /// quiche. Returns whether a frame was written.
    pub(crate) fn pump_mux(&mut self, conn: ConnKey, w: Writable, ctx: &Ctx) -> bool {
        let Some(m) = self.muxes.get(&conn) else {
            return false;
        };
        let qs = m.qs;
        if !w(conn, qs) {
            return false;
        }
        let Some((ids, lead_at)) = self.mux_group(m) else {
            return false;
        };
        let n = m.subs.len();
        self.muxes.get_mut(&conn).expect("looked up above").next = (lead_at + 1) % n;
        let mut first: Option<(u32, Item)> = None;
        for &sid in &ids {
            let sub = self.subs.get_mut(&sid).expect("a mux subscription is live");
            let key = (sub.stream, sub.shard);
            let (item, unparked) = sub.queue.pop();
            let item = item.expect("grouped by its head item");
            super::count_sent(ctx.counters, &item);
            first.get_or_insert((key.1, item));
            self.after_pop(sid, key, unparked, ctx);
        }
        let (shard, item) = first.expect("a group names at least one subscription");
        #[cfg(test)]
        let ids = if super::breaks::on(&super::breaks::MUX_NAMES_ONLY_LEAD) {
            ids[..1].to_vec()
        } else {
            ids
        };
        self.effects.push(match item {
            Item::Batch(b) => SubEffect::MuxBatch(conn, qs, shard, ids, b),
            Item::Lag(l) => SubEffect::MuxFrame(conn, qs, ids, super::lag_frame(l)),
        });
        true
    }

    /// The subscriptions whose head item leaves in the next frame, and the lead's position:
    /// from `next` on, the first with a queued item leads; a lag notice goes alone, a batch
    /// with every subscription whose head is the same batch.
    fn mux_group(&self, m: &MuxConn) -> Option<(Vec<u64>, usize)> {
        let n = m.subs.len();
        let (lead_at, lead) = (0..n).map(|k| (m.next + k) % n).find_map(|at| {
            let sub = self.subs.get(&m.subs[at])?;
            sub.queue.peek().map(|item| (at, (sub, item)))
        })?;
        let same = |sub: &super::Sub, item: &Item| match item {
            Item::Batch(b) => Some(Same {
                stream: sub.stream,
                shard: sub.shard,
                first_offset: b.first_offset,
                count: b.count,
                region: b.region.as_ptr(),
            }),
            Item::Lag(_) => None,
        };
        let Some(want) = same(lead.0, lead.1) else {
            return Some((vec![m.subs[lead_at]], lead_at));
        };
        let mut ids = Vec::with_capacity(n.min(SUB_MUX_IDS_MAX));
        for k in 0..n {
            let sid = m.subs[(lead_at + k) % n];
            let Some(sub) = self.subs.get(&sid) else {
                continue;
            };
            if sub.queue.peek().and_then(|i| same(sub, i)) == Some(want) {
                ids.push(sid);
                if ids.len() == SUB_MUX_IDS_MAX {
                    break;
                }
            }
        }
        Some((ids, lead_at))
    }
}

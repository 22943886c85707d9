//! The watch mux on the client side (docs/protocol.md, "Watch mux"): every watch of the
//! connection arrives on one stream as `CacheMux` frames naming watch ids, and is handed to
//! each watch's own buffer.
//!
//! One stream carries every watch, so it is never paused for one slow reader: a watch whose
//! buffer is full when a change arrives is ended here, `watch_lagged`, naming that change's
//! offset as where to resume, and unsubscribed at the broker. Its end waits until the
//! application has read what was buffered before it. Items of the state phase are never dropped:
//! they wait here (the broker sent them as one snapshot of current values, and no offset could
//! name a resume inside it).

use super::*;
use felix_quic::idmap::{IdMap, IdSet};
use felix_quic::wire::CacheFrame;

/// Request ids this side picks for its own unsubscribes, counting down from the top so they
/// never meet the application's (which count up from 1).
const OWN_IDS_TOP: u64 = u64::MAX;

#[derive(Default)]
pub(crate) struct MuxState {
    /// Both Hellos carried `WATCH_MUX`.
    pub on: bool,
    /// Watches unsubscribed whose broker end has not arrived yet: their frames are dropped.
    gone: IdSet<u64>,
    /// Watches in their state phase (a retained event came, `CacheStateDone` not yet).
    in_state: IdSet<u64>,
    /// Per watch: items waiting for room in its buffer, in order (its last may be its end).
    blocked: IdMap<u64, (SubSlot, VecDeque<Event>)>,
    own_ids_used: u64,
}

fn is_watch_end(ev: &Event) -> bool {
    matches!(ev, Event::Watch(WatchItem::End { .. }))
}

impl ConnHandler {
    /// A `CacheMux`: the wrapped frame for each watch named.
    pub(crate) fn on_mux(&mut self, c: &mut FelixConn, ids: Vec<u64>, inner: CacheFrame) {
        let end = matches!(inner, CacheFrame::CacheWatchEnd { .. });
        // A live change (not retained, not an end) may take the fast path below.
        let change =
            matches!(inner, CacheFrame::CacheEvent { kind, .. } if kind != EventKind::Retained);
        for wid in ids {
            if !self.mux.gone.is_empty() && self.mux.gone.contains(&wid) {
                if end {
                    self.mux.gone.remove(&wid);
                }
                continue;
            }
            let Some(slot) = self.subs.get(&wid) else {
                // Before its CacheWatchOk (another stream): held until the answer.
                self.early
                    .entry(wid)
                    .or_default()
                    .push(Frame::Cache(inner.clone()));
                continue;
            };
            let Some(ev) = cache::watch_item(slot.shard, inner.clone()).map(Event::Watch) else {
                continue;
            };
            // The common case, per watch per change: nothing waiting, room in its buffer.
            let waiting = !self.mux.blocked.is_empty() && self.mux.blocked.contains_key(&wid);
            let stating = !self.mux.in_state.is_empty() && self.mux.in_state.contains(&wid);
            let ev = if change && !waiting && !stating {
                match slot.events.try_send(ev) {
                    Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => continue,
                    Err(mpsc::error::TrySendError::Full(ev)) => ev,
                }
            } else {
                ev
            };
            let slot = slot.clone();
            self.deliver_mux(c, wid, &slot, ev);
        }
    }

    /// Hand a mux item to watch `wid`'s buffer; a full buffer holds state-phase items and
    /// ends the watch on a change.
    pub(crate) fn deliver_mux(&mut self, c: &mut FelixConn, wid: u64, slot: &SubSlot, ev: Event) {
        let end = is_watch_end(&ev);
        match &ev {
            Event::Watch(WatchItem::Event {
                kind: EventKind::Retained,
                ..
            }) => {
                self.mux.in_state.insert(wid);
            }
            Event::Watch(WatchItem::StateDone { .. } | WatchItem::End { .. }) => {
                self.mux.in_state.remove(&wid);
            }
            _ => {}
        }
        if end {
            // Its last item: the broker sends nothing more for it.
            self.subs.remove(&wid);
        }
        // Only a live change may end a watch here: its offset names where to resume.
        let droppable = !end
            && !self.mux.in_state.contains(&wid)
            && matches!(ev, Event::Watch(WatchItem::Event { .. }));
        if let Some((_, q)) = self.mux.blocked.get_mut(&wid) {
            // Waiting behind a state phase: changes may wait as many as the buffer holds.
            if !droppable || q.len() < slot.events.max_capacity() {
                q.push_back(ev);
            } else {
                self.lag_locally(c, wid, &ev);
            }
            return;
        }
        match slot.events.try_send(ev) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(ev)) => {
                self.mux
                    .blocked
                    .insert(wid, (slot.clone(), VecDeque::new()));
                slot.paused.store(true, Ordering::Release);
                if droppable {
                    self.lag_locally(c, wid, &ev);
                } else {
                    let q = &mut self.mux.blocked.get_mut(&wid).expect("just inserted").1;
                    q.push_back(ev);
                }
            }
            // The application dropped the watch; its Drop sent Unsubscribe.
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }

    /// End watch `wid` here: it could not take the change `ev` (its end is queued after what
    /// waits), and unsubscribe it at the broker.
    fn lag_locally(&mut self, c: &mut FelixConn, wid: u64, ev: &Event) {
        let Event::Watch(WatchItem::Event { shard, offset, .. }) = ev else {
            unreachable!("only a change ends a watch locally");
        };
        let (shard, at) = (*shard, *offset);
        let end = Event::Watch(WatchItem::End {
            shard,
            code: ErrorCode::WatchLagged.number(),
            resume_from: at,
            message: format!(
                "watch fell behind its client buffer; nothing from offset {at} on was delivered: watch again from {at}"
            ),
        });
        let q = &mut self
            .mux
            .blocked
            .get_mut(&wid)
            .expect("a lagging watch is blocked")
            .1;
        debug_assert!(!q.iter().any(is_watch_end), "one end per watch");
        q.push_back(end);
        self.subs.remove(&wid);
        self.mux.in_state.remove(&wid);
        self.mux.gone.insert(wid);
        let request_id = OWN_IDS_TOP - self.mux.own_ids_used;
        self.mux.own_ids_used += 1;
        // Its answer (the end, or not_found when the broker ended it first) is not awaited.
        if self.cancels.len() == CANCELS_REMEMBERED {
            self.cancels.pop_front();
        }
        self.cancels.push_back(request_id);
        c.send_frame(
            0,
            &Frame::Unsubscribe {
                request_id,
                subscription_id: wid,
            },
        );
    }

    /// The application unsubscribed `wid` (its slot was `removed`): frames still coming for
    /// it on the mux are dropped until the broker's end.
    pub(crate) fn mux_unsubscribed(&mut self, wid: u64, removed: Option<SubSlot>) {
        self.mux.blocked.remove(&wid);
        self.mux.in_state.remove(&wid);
        if self.mux.on && removed.is_some_and(|s| s.watch) {
            self.mux.gone.insert(wid);
        }
    }

    /// Move blocked mux items into their buffers as the application makes room.
    pub(crate) fn drain_mux_blocked(&mut self) {
        drain_waiting(&mut self.mux.blocked);
    }
}

/// Move what waits for each of `blocked` (a watch's or a subscription's items, in order) into
/// its buffer while it has room; forget those whose application is gone.
pub(crate) fn drain_waiting(blocked: &mut IdMap<u64, (SubSlot, VecDeque<Event>)>) {
    blocked.retain(|_, (slot, q)| {
        while let Some(ev) = q.pop_front() {
            match slot.events.try_send(ev) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(ev)) => {
                    q.push_front(ev);
                    // Wake this side again after the application's next read.
                    slot.paused.store(true, Ordering::Release);
                    return true;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => return false,
            }
        }
        false
    });
}

//! The subscription mux on the client side (docs/protocol.md, "Subscription mux"): every
//! drop_new subscription of the connection arrives on one stream as `SubMux` frames naming
//! subscription ids, and is handed to each subscription's own buffer.
//!
//! One stream carries them all, so it is never paused for one slow reader. When a
//! subscription's buffer is full, what arrives for it is dropped here and announced, in order,
//! as a `Lag` naming exactly the offsets lost (consecutive losses fold into one notice), as
//! the broker's own queue does under `drop_new` (the only policy the mux carries). A `Lag` or the end the broker sends meanwhile
//! waits behind it. Nothing waits unbounded: a blocked subscription holds at most its
//! pending notices and its end.

use super::*;
use felix_quic::idmap::{IdMap, IdSet};

#[derive(Default)]
pub(crate) struct SubMuxState {
    /// Both Hellos carried `SUB_MUX`.
    pub on: bool,
    /// Subscriptions unsubscribed whose broker end has not arrived yet: their frames are
    /// dropped.
    gone: IdSet<u64>,
    /// Per subscription whose buffer was full: what waits for room, in order (lag notices,
    /// then perhaps its end).
    blocked: IdMap<u64, (SubSlot, VecDeque<Event>)>,
}

/// Fold `ev` into what waits for a full buffer: records become (or extend) a lag notice; a
/// broker's notice contiguous with the last one extends it; an end is kept.
fn wait_behind(q: &mut VecDeque<Event>, ev: Event) {
    let (shard, from, lost) = match ev {
        Event::Records {
            shard,
            first_offset,
            records,
        } => (shard, first_offset, u64::from(records.count())),
        Event::Lag {
            shard,
            from_offset,
            lost,
        } => (shard, from_offset, lost),
        other => return q.push_back(other),
    };
    if let Some(Event::Lag {
        from_offset: f,
        lost: l,
        ..
    }) = q.back_mut()
    {
        if *f + *l == from {
            *l += lost;
            return;
        }
    }
    q.push_back(Event::Lag {
        shard,
        from_offset: from,
        lost,
    });
}

impl ConnHandler {
    /// A `SubMux`: the wrapped frame for each subscription named.
    pub(crate) fn on_sub_mux(&mut self, ids: Vec<u64>, inner: Frame) {
        let end = matches!(inner, Frame::SubEnd { .. });
        for sid in ids {
            if !self.submux.gone.is_empty() && self.submux.gone.contains(&sid) {
                if end {
                    self.submux.gone.remove(&sid);
                }
                continue;
            }
            let Some(slot) = self.subs.get(&sid) else {
                // Before its SubscribeOk (another stream): held until the answer.
                self.early.entry(sid).or_default().push(inner.clone());
                continue;
            };
            let Some(ev) = Self::to_event(slot.shard, inner.clone()) else {
                continue;
            };
            // The common case, per subscription per frame: nothing waiting, room in its buffer.
            let ev = if !end
                && (self.submux.blocked.is_empty() || !self.submux.blocked.contains_key(&sid))
            {
                match slot.events.try_send(ev) {
                    Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => continue,
                    Err(mpsc::error::TrySendError::Full(ev)) => ev,
                }
            } else {
                ev
            };
            let slot = slot.clone();
            self.deliver_sub_mux(sid, &slot, ev);
        }
    }

    /// Hand a mux item to subscription `sid`'s buffer; a full buffer folds it into a lag
    /// notice (an end waits).
    pub(crate) fn deliver_sub_mux(&mut self, sid: u64, slot: &SubSlot, ev: Event) {
        if matches!(ev, Event::End { .. }) {
            // Its last item: the broker sends nothing more for it.
            self.subs.remove(&sid);
        }
        if let Some((_, q)) = self.submux.blocked.get_mut(&sid) {
            wait_behind(q, ev);
            return;
        }
        match slot.events.try_send(ev) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(ev)) => {
                let mut q = VecDeque::new();
                wait_behind(&mut q, ev);
                self.submux.blocked.insert(sid, (slot.clone(), q));
                // Wake this side after the application's next read.
                slot.paused.store(true, Ordering::Release);
            }
            // The application dropped the subscription; its Drop sent Unsubscribe.
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }

    /// The application unsubscribed `sid` (its slot was `removed`): frames still coming for
    /// it on the mux are dropped until the broker's end.
    pub(crate) fn sub_mux_unsubscribed(&mut self, sid: u64, removed: Option<&SubSlot>) {
        self.submux.blocked.remove(&sid);
        if removed.is_some_and(|s| s.mux) {
            self.submux.gone.insert(sid);
        }
    }

    /// Move what waits into the buffers as the application makes room.
    pub(crate) fn drain_sub_mux_blocked(&mut self) {
        super::mux::drain_waiting(&mut self.submux.blocked);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recs(n: usize) -> Records {
        let payloads: Vec<Vec<u8>> = (0..n).map(|k| vec![k as u8; 3]).collect();
        Records::encode(&payloads)
    }

    /// Records dropped for a full buffer become one notice naming exactly what was lost;
    /// a broker notice contiguous with it extends it; an end waits after it; a gap starts a
    /// new notice.
    #[test]
    fn what_waits_for_room_is_exact_lag_notices_then_the_end() {
        let mut q = VecDeque::new();
        let batch = |first: u64, n: usize| Event::Records {
            shard: 2,
            first_offset: first,
            records: recs(n),
        };
        wait_behind(&mut q, batch(10, 3));
        wait_behind(&mut q, batch(13, 2));
        wait_behind(
            &mut q,
            Event::Lag {
                shard: 2,
                from_offset: 15,
                lost: 5,
            },
        );
        wait_behind(&mut q, batch(30, 1));
        wait_behind(
            &mut q,
            Event::End {
                shard: 2,
                code: 0,
                message: String::new(),
            },
        );
        let lag = |from_offset, lost| Event::Lag {
            shard: 2,
            from_offset,
            lost,
        };
        assert_eq!(
            Vec::from(q),
            vec![
                lag(10, 10),
                lag(30, 1),
                Event::End {
                    shard: 2,
                    code: 0,
                    message: String::new()
                }
            ]
        );
    }
}

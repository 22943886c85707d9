//! Where the connection task puts a subscription's or a watch's items: the subscription's own
//! bounded channel, or its place in a [`crate::WatchSet`]'s channel, shared by many watches
//! and read by one task.
//!
//! Either way the bound is per subscription: a set member counts what it holds in the shared
//! channel and reports itself full at its own `buffer_items`, so every rule that a full buffer
//! triggers (pausing its stream, ending a mux watch `watch_lagged`) applies to each member
//! alone. The shared channel is unbounded in tokio's sense because its members bound it: it
//! holds at most the sum of their buffers, plus one end per shard.

use super::Event;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;

/// One item of a watch set's channel: the member's tag and its event.
pub(crate) type Tagged = (u64, Event);

#[derive(Clone)]
pub(crate) enum Sink {
    Own(mpsc::Sender<Event>),
    Shared(SharedSink),
}

#[derive(Clone)]
pub(crate) struct SharedSink {
    pub tx: mpsc::UnboundedSender<Tagged>,
    /// The member's tag in its set.
    pub tag: u64,
    /// Items of this member in the channel, not yet read: incremented here, decremented by
    /// the set's reader.
    pub held: Arc<AtomicUsize>,
    pub cap: usize,
}

impl Sink {
    /// As `mpsc::Sender::try_send`: `Full` when this subscription's own buffer is.
    pub fn try_send(&self, ev: Event) -> Result<(), TrySendError<Event>> {
        match self {
            Sink::Own(tx) => tx.try_send(ev),
            Sink::Shared(s) => {
                // Only this connection's task sends for a member, and the reader only takes
                // away, so the count cannot pass the bound between this check and the add.
                if s.held.load(Ordering::Acquire) >= s.cap {
                    return Err(TrySendError::Full(ev));
                }
                let held = s.push(ev)?;
                debug_assert!(held <= s.cap, "a set member holds {held} of {}", s.cap);
                Ok(())
            }
        }
    }

    /// An end the connection itself makes (it closed): it must reach the application even
    /// when the buffer is full. A shared channel takes it past the bound (one per shard);
    /// an own channel that is full is closed right after, which the reader sees as the end.
    pub fn send_end(&self, ev: Event) {
        match self {
            Sink::Own(tx) => {
                let _ = tx.try_send(ev);
            }
            Sink::Shared(s) => {
                let _ = s.push(ev);
            }
        }
    }

    pub fn max_capacity(&self) -> usize {
        match self {
            Sink::Own(tx) => tx.max_capacity(),
            Sink::Shared(s) => s.cap,
        }
    }
}

impl SharedSink {
    /// Queue `ev`; the member's count after it.
    fn push(&self, ev: Event) -> Result<usize, TrySendError<Event>> {
        let held = self.held.fetch_add(1, Ordering::AcqRel) + 1;
        match self.tx.send((self.tag, ev)) {
            Ok(()) => Ok(held),
            Err(e) => {
                self.held.fetch_sub(1, Ordering::AcqRel);
                Err(TrySendError::Closed(e.0 .1))
            }
        }
    }
}

//! A set of watches read by one task: every member's items arrive through one channel,
//! tagged with the member's id.
//!
//! Why: an application that keeps many keys in sync (an agent with a few hundred watches, a
//! gateway fanning state out) would otherwise hold one task per watch, and each change would
//! cost a task wake-up and a poll per watch. A set costs one queue push per watch per change,
//! and the reader is woken once for whatever arrived meanwhile.
//!
//! Each member keeps the contract of a [`CacheWatch`]: its items in order with their offsets,
//! retained delivery first, its own `buffer_items` bound (a member is full when it holds that
//! many unread items in the set, whatever the others hold), and its own end (`watch_lagged`
//! naming where to resume, or the connection's end). A member that ended is forgotten; the set
//! reads `None` once no member is open.

use super::*;
use crate::sink::{SharedSink, Tagged};
use felix_quic::idmap::IdMap;
use std::sync::atomic::AtomicUsize;

/// A member of a [`WatchSet`], as its items name it.
pub type WatchId = u64;

struct Member {
    watch: CacheWatch,
    /// Its unread items in the set's channel (see `sink::SharedSink`).
    held: Arc<AtomicUsize>,
}

/// Watches, possibly on several connections, read together. See the module doc.
pub struct WatchSet {
    /// A weak handle: the channel closes once every connection let go of every member, so a
    /// reader never waits on a channel nobody can feed.
    tx: mpsc::WeakUnboundedSender<Tagged>,
    rx: mpsc::UnboundedReceiver<Tagged>,
    members: IdMap<WatchId, Member>,
    next_id: WatchId,
    /// A strong sender kept only while a member is being added (none is open yet).
    adding: Option<mpsc::UnboundedSender<Tagged>>,
}

impl Default for WatchSet {
    fn default() -> Self {
        Self::new()
    }
}

impl WatchSet {
    pub fn new() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        WatchSet {
            tx: tx.downgrade(),
            rx,
            members: Default::default(),
            next_id: 1,
            adding: Some(tx),
        }
    }

    /// Open a watch on `client`'s connection as a member of this set, like
    /// [`Client::cache_watch`]; its items are read with [`WatchSet::next`] under the id
    /// returned.
    pub async fn watch(
        &mut self,
        client: &Client,
        cache: &StreamName,
        filter: WatchFilter,
        start: WatchStart,
        opts: WatchOptions,
    ) -> Result<WatchId, Error> {
        self.add(client, cache, vec![(filter, start)], opts).await
    }

    /// Watch `prefix` on the given shards of the cache as one member, like
    /// [`Client::cache_watch_prefix_shards`].
    pub async fn watch_prefix_shards(
        &mut self,
        client: &Client,
        cache: &StreamName,
        prefix: impl Into<Bytes>,
        shards: &[u32],
        start: WatchStart,
        opts: WatchOptions,
    ) -> Result<WatchId, Error> {
        let specs = cache::prefix_specs(prefix.into(), shards, start);
        self.add(client, cache, specs, opts).await
    }

    async fn add(
        &mut self,
        client: &Client,
        cache: &StreamName,
        specs: Vec<(WatchFilter, WatchStart)>,
        opts: WatchOptions,
    ) -> Result<WatchId, Error> {
        if specs.is_empty() {
            return Err(Error::InvalidArgument("a watch needs a shard".into()));
        }
        // Strong for the call: the first member's slots must find the channel open.
        let tx = match (&self.adding, self.tx.upgrade()) {
            (Some(tx), _) => tx.clone(),
            (None, Some(tx)) => tx,
            // Every member's connection let go and the channel closed: start a new one, with
            // what the old one still held first.
            (None, None) => {
                let (tx, rx) = mpsc::unbounded_channel();
                while let Ok(item) = self.rx.try_recv() {
                    let _ = tx.send(item);
                }
                self.tx = tx.downgrade();
                self.rx = rx;
                tx
            }
        };
        let id = self.next_id;
        self.next_id += 1;
        let held = Arc::new(AtomicUsize::new(0));
        let sink = SharedSink {
            tx,
            tag: id,
            held: held.clone(),
            cap: opts.buffer_items,
        };
        let watch = client.watch_into(cache, specs, opts, Some(sink)).await?;
        self.members.insert(id, Member { watch, held });
        // The members' slots now hold the channel open.
        self.adding = None;
        Ok(id)
    }

    /// The next item of any member, with the member's id; `None` once no member is open (each
    /// ended, was removed, or lost its connection) and everything was read.
    pub async fn next(&mut self) -> Option<(WatchId, WatchItem)> {
        loop {
            if self.members.is_empty() {
                return None;
            }
            let (id, ev) = self.rx.recv().await?;
            if let Some(it) = self.take(id, ev) {
                return Some(it);
            }
        }
    }

    /// An item already waiting, without waiting for one.
    pub fn try_next(&mut self) -> Option<(WatchId, WatchItem)> {
        while let Ok((id, ev)) = self.rx.try_recv() {
            if let Some(it) = self.take(id, ev) {
                return Some(it);
            }
        }
        None
    }

    /// The next item if one arrives within `timeout` (`Ok(None)`: no member is open).
    pub async fn next_timeout(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<(WatchId, WatchItem)>, Error> {
        tokio::time::timeout(timeout, self.next())
            .await
            .map_err(|_| Error::Timeout(timeout))
    }

    /// One item read from the channel: counted off its member, then the member's own rules
    /// (lag accounting, resume offsets, its end).
    fn take(&mut self, id: WatchId, ev: Event) -> Option<(WatchId, WatchItem)> {
        // Items of a member removed meanwhile are dropped (its unsubscribe is on the way).
        let m = self.members.get_mut(&id)?;
        let before = m.held.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(before > 0, "member {id} read an item it did not hold");
        let ev = Some(ev);
        m.watch.sub.after_recv(&ev);
        let it = m.watch.item(ev?)?;
        if m.watch.open == 0 {
            // Its last shard ended: nothing more comes for it.
            self.members.remove(&id);
        }
        Some((id, it))
    }

    /// End a member's watches at the broker; what it had buffered is dropped. False when no
    /// such member is open.
    pub fn remove(&mut self, id: WatchId) -> bool {
        self.members.remove(&id).is_some()
    }

    /// Members open.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// `(shard, live_from)` of each shard a member watches, as the broker answered.
    pub fn live_from(&self, id: WatchId) -> Option<&[(u32, u64)]> {
        self.members.get(&id).map(|m| m.watch.live_from.as_slice())
    }

    /// Per shard of a member, the offset to resume from to miss nothing after what was read.
    pub fn resume_offsets(&self, id: WatchId) -> Option<Vec<(u32, u64)>> {
        self.members.get(&id).map(|m| m.watch.resume_offsets())
    }
}

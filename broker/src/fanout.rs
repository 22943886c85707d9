//! Pure fanout state: the encoded delivery batch, the shard owner's replay ring and offset
//! counter, and the per-subscriber queue with its three policies. No clock, no socket: the
//! core driver (`core/`) feeds these and moves what they hand back onto QUIC streams.

use bytes::Bytes;
use felix_quic::wire::{encode_delivery_head, QueuePolicy, Records};
use std::collections::VecDeque;

/// One appended batch, encoded once as a delivery frame (`head ++ region`). Cloning shares
/// the bytes; every subscriber on every core sends these same two buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub first_offset: u64,
    pub count: u32,
    pub head: Bytes,
    pub region: Bytes,
}

impl Batch {
    pub fn new(shard: u32, first_offset: u64, records: &Records) -> Batch {
        assert!(
            records.count() > 0,
            "empty batches are refused before append"
        );
        Batch {
            first_offset,
            count: records.count(),
            head: encode_delivery_head(shard, first_offset, records),
            region: records.region().clone(),
        }
    }
    /// Wire bytes of the delivery frame.
    pub fn bytes(&self) -> u64 {
        (self.head.len() + self.region.len()) as u64
    }
    /// One past the last offset.
    pub fn end(&self) -> u64 {
        self.first_offset + self.count as u64
    }
    /// The same batch without its first `skip` records (re-encodes only the small head).
    pub fn tail(&self, shard: u32, skip: u32) -> Batch {
        assert!(skip < self.count, "tail keeps at least one record");
        let mut pos = 0usize;
        for _ in 0..skip {
            let len = u32::from_le_bytes(self.region[pos..pos + 4].try_into().unwrap()) as usize;
            pos += 4 + len;
        }
        let records = Records::from_region(self.count - skip, self.region.slice(pos..))
            .expect("suffix of a valid region is valid");
        Batch::new(shard, self.first_offset + skip as u64, &records)
    }
}

impl Batch {
    /// The batch as delivery frames of at most `frame_bytes_max` each (a peer that announced a
    /// smaller maximum than the broker's gets a big batch in pieces). Each piece holds at
    /// least one record: the broker refuses a Hello whose maximum cannot carry its largest
    /// record. A batch that fits is returned whole (the shared encoding, no copy).
    pub fn split_to_fit(&self, shard: u32, frame_bytes_max: usize) -> Vec<Batch> {
        if self.bytes() as usize <= frame_bytes_max {
            return vec![self.clone()];
        }
        let fixed = self.head.len();
        let mut out = Vec::new();
        let (mut start, mut pos, mut n, mut first) = (0usize, 0usize, 0u32, self.first_offset);
        while pos < self.region.len() {
            let len = u32::from_le_bytes(self.region[pos..pos + 4].try_into().unwrap()) as usize;
            let end = pos + 4 + len;
            if n > 0 && fixed + (end - start) > frame_bytes_max {
                out.push(Self::piece(shard, first, n, self.region.slice(start..pos)));
                first += n as u64;
                (start, n) = (pos, 0);
            }
            pos = end;
            n += 1;
        }
        out.push(Self::piece(shard, first, n, self.region.slice(start..)));
        debug_assert_eq!(out.iter().map(|b| b.count).sum::<u32>(), self.count);
        out
    }

    fn piece(shard: u32, first_offset: u64, count: u32, region: Bytes) -> Batch {
        let records = Records::from_region(count, region).expect("a run of a valid region");
        Batch::new(shard, first_offset, &records)
    }
}

/// A range of records a subscriber lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lag {
    pub from_offset: u64,
    pub lost: u64,
}

impl Lag {
    fn end(&self) -> u64 {
        self.from_offset + self.lost
    }
}

/// The owner's bounded replay ring of one ephemeral shard (whole batches, newest kept).
#[derive(Debug)]
pub struct ReplayRing {
    records_max: u64,
    bytes_max: u64,
    batches: VecDeque<Batch>,
    records: u64,
    bytes: u64,
}

impl ReplayRing {
    pub fn new(records_max: u64, bytes_max: u64) -> Self {
        ReplayRing {
            records_max,
            bytes_max,
            batches: VecDeque::new(),
            records: 0,
            bytes: 0,
        }
    }

    /// Keep `b`, evicting the oldest batches while over either bound (the newest batch is
    /// always kept, even if alone it is over the bounds).
    pub fn push(&mut self, b: Batch) {
        if let Some(last) = self.batches.back() {
            assert_eq!(last.end(), b.first_offset, "ring offsets are contiguous");
        }
        self.records += b.count as u64;
        self.bytes += b.bytes();
        self.batches.push_back(b);
        while self.batches.len() > 1
            && (self.records > self.records_max || self.bytes > self.bytes_max)
        {
            let old = self.batches.pop_front().unwrap();
            self.records -= old.count as u64;
            self.bytes -= old.bytes();
        }
    }

    /// Oldest retained offset, if any.
    pub fn oldest(&self) -> Option<u64> {
        self.batches.front().map(|b| b.first_offset)
    }

    /// What a subscriber starting at `from` gets: a lag for what is no longer retained, then
    /// the retained batches from `from` on (the first one cut to start exactly at `from`).
    pub fn replay_from(&self, shard: u32, from: u64) -> (Option<Lag>, Vec<Batch>) {
        let Some(oldest) = self.oldest() else {
            return (None, Vec::new());
        };
        let lag = (from < oldest).then(|| Lag {
            from_offset: from,
            lost: oldest - from,
        });
        let mut out = Vec::new();
        for b in &self.batches {
            if b.end() <= from {
                continue;
            }
            if b.first_offset < from {
                out.push(b.tail(shard, (from - b.first_offset) as u32));
            } else {
                out.push(b.clone());
            }
        }
        (lag, out)
    }

    pub fn records(&self) -> u64 {
        self.records
    }

    /// The payload of the record at `offset`, if the ring still holds it.
    pub fn get(&self, offset: u64) -> Option<Bytes> {
        let i = self.batches.partition_point(|b| b.end() <= offset);
        let b = self.batches.get(i)?;
        if offset < b.first_offset {
            return None;
        }
        let mut pos = 0usize;
        for _ in 0..offset - b.first_offset {
            let len = u32::from_le_bytes(b.region[pos..pos + 4].try_into().unwrap()) as usize;
            pos += 4 + len;
        }
        let len = u32::from_le_bytes(b.region[pos..pos + 4].try_into().unwrap()) as usize;
        Some(b.region.slice(pos + 4..pos + 4 + len))
    }
}

/// What the subscriber's connection sends next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Item {
    Batch(Batch),
    Lag(Lag),
}

/// Result of offering a batch to a subscriber queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    Queued,
    /// DropNew: the batch was dropped (a lag notice is queued).
    Dropped,
    /// DropOld: the batch was queued after evicting this many older records.
    Evicted(u64),
    /// Block: the batch waits in the parked list; `first` says this made the list non-empty.
    Parked {
        first: bool,
    },
}

/// Test-build switch that breaks the lag rule (losses go unannounced), so the simulator's
/// negative twin can show its checker catches it.
#[cfg(test)]
pub(crate) static BREAK_SKIP_LAG_NOTICE: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// A subscriber queue bounded in records **and** bytes. A batch larger than the bounds is
/// admitted into an empty queue, so a subscriber always makes progress. Lag notices take a
/// slot of their own but count against neither bound; adjacent losses merge into one notice,
/// so there are never more notices than batches plus one.
#[derive(Debug)]
pub struct SubQueue {
    pub policy: QueuePolicy,
    records_max: u64,
    bytes_max: u64,
    items: VecDeque<Item>,
    records: u64,
    bytes: u64,
    /// Block only: batches waiting for room, in order.
    parked: VecDeque<Batch>,
    /// Records this subscriber lost (DropNew + DropOld).
    pub dropped_records: u64,
    /// Offset the next offered batch must start at (contiguity check).
    next_expected: Option<u64>,
}

impl SubQueue {
    pub fn new(policy: QueuePolicy, records_max: u64, bytes_max: u64) -> Self {
        assert!(records_max > 0 && bytes_max > 0, "bounds are positive");
        SubQueue {
            policy,
            records_max,
            bytes_max,
            items: VecDeque::new(),
            records: 0,
            bytes: 0,
            parked: VecDeque::new(),
            dropped_records: 0,
            next_expected: None,
        }
    }

    /// The bounds granted: `(records_max, bytes_max)`.
    pub fn bounds(&self) -> (u64, u64) {
        (self.records_max, self.bytes_max)
    }

    fn fits(&self, b: &Batch) -> bool {
        self.records == 0
            || (self.records + b.count as u64 <= self.records_max
                && self.bytes + b.bytes() <= self.bytes_max)
    }

    fn push_batch(&mut self, b: Batch) {
        self.records += b.count as u64;
        self.bytes += b.bytes();
        self.items.push_back(Item::Batch(b));
    }

    /// Announce a loss at the back of the queue, merging with an adjacent notice.
    fn push_lag(&mut self, l: Lag) {
        self.dropped_records += l.lost;
        #[cfg(test)]
        if BREAK_SKIP_LAG_NOTICE.load(std::sync::atomic::Ordering::Relaxed) {
            return; // the simulator's negative twin: a loss nobody is told about
        }
        if let Some(Item::Lag(last)) = self.items.back_mut() {
            if last.end() == l.from_offset {
                last.lost += l.lost;
                return;
            }
        }
        self.items.push_back(Item::Lag(l));
    }

    /// A loss that happened before anything queued (replay gap at subscribe time).
    pub fn offer_lag(&mut self, l: Lag) {
        if l.lost == 0 {
            return;
        }
        self.check_contiguous(l.from_offset, l.end());
        self.push_lag(l);
    }

    fn check_contiguous(&mut self, first: u64, end: u64) {
        if let Some(n) = self.next_expected {
            assert_eq!(n, first, "subscriber offsets are contiguous");
        }
        self.next_expected = Some(end);
    }

    /// Offer the next batch of the shard.
    pub fn offer(&mut self, b: Batch) -> Offer {
        self.check_contiguous(b.first_offset, b.end());
        match self.policy {
            QueuePolicy::DropNew => {
                if self.fits(&b) {
                    self.push_batch(b);
                    Offer::Queued
                } else {
                    self.push_lag(Lag {
                        from_offset: b.first_offset,
                        lost: b.count as u64,
                    });
                    Offer::Dropped
                }
            }
            QueuePolicy::DropOld => {
                let mut evicted: Option<Lag> = None;
                while !self.fits(&b) {
                    // Evict from the front; notices at the front are folded into the new one
                    // (they are older and contiguous with what is evicted after them).
                    match self.items.pop_front() {
                        Some(Item::Batch(old)) => {
                            self.records -= old.count as u64;
                            self.bytes -= old.bytes();
                            let l = evicted.get_or_insert(Lag {
                                from_offset: old.first_offset,
                                lost: 0,
                            });
                            assert_eq!(l.end(), old.first_offset, "evicted ranges are contiguous");
                            l.lost += old.count as u64;
                            self.dropped_records += old.count as u64;
                        }
                        Some(Item::Lag(old)) => {
                            let l = evicted.get_or_insert(Lag {
                                from_offset: old.from_offset,
                                lost: 0,
                            });
                            assert_eq!(l.end(), old.from_offset, "evicted ranges are contiguous");
                            l.lost += old.lost;
                        }
                        None => unreachable!("an empty queue fits any batch"),
                    }
                }
                let lost = evicted.map(|l| l.lost).unwrap_or(0);
                if let Some(l) = evicted {
                    // Merge with a notice that is now at the front (adjacent, older).
                    self.items.push_front(Item::Lag(l));
                    if let (Some(Item::Lag(a)), Some(Item::Lag(b2))) =
                        (self.items.front(), self.items.get(1))
                    {
                        if a.end() == b2.from_offset {
                            let merged = Lag {
                                from_offset: a.from_offset,
                                lost: a.lost + b2.lost,
                            };
                            self.items.pop_front();
                            self.items[0] = Item::Lag(merged);
                        }
                    }
                }
                self.push_batch(b);
                if lost > 0 {
                    Offer::Evicted(lost)
                } else {
                    Offer::Queued
                }
            }
            QueuePolicy::Block => {
                if self.parked.is_empty() && self.fits(&b) {
                    self.push_batch(b);
                    Offer::Queued
                } else {
                    let first = self.parked.is_empty();
                    self.parked.push_back(b);
                    Offer::Parked { first }
                }
            }
        }
    }

    /// Take the next item to send. The bool is true when this emptied the parked list (the
    /// owner may release held publishes).
    pub fn pop(&mut self) -> (Option<Item>, bool) {
        let item = self.items.pop_front();
        if let Some(Item::Batch(b)) = &item {
            self.records -= b.count as u64;
            self.bytes -= b.bytes();
        }
        let had_parked = !self.parked.is_empty();
        while let Some(p) = self.parked.front() {
            if !self.fits(p) {
                break;
            }
            let p = self.parked.pop_front().unwrap();
            self.push_batch(p);
        }
        (item, had_parked && self.parked.is_empty())
    }

    /// The next item to send, left in place.
    pub fn peek(&self) -> Option<&Item> {
        self.items.front()
    }

    pub fn is_parked(&self) -> bool {
        !self.parked.is_empty()
    }
    pub fn queued_records(&self) -> u64 {
        self.records
    }
    /// Payload bytes queued (what the bytes bound counts).
    pub fn queued_bytes(&self) -> u64 {
        self.bytes
    }
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// The owner's state of one shard: next offset, replay ring, which cores have subscribers,
/// and which cores hold parked (Block) batches. Publishes that arrive while any core is
/// parked wait in `held` (the driver answers them `publish_timeout` past their deadline).
#[derive(Debug)]
pub struct ShardOwner<H> {
    pub shard: u32,
    next_offset: u64,
    pub ring: ReplayRing,
    interest: Vec<u32>,
    parked_cores: Vec<bool>,
    pub held: VecDeque<H>,
}

impl<H> ShardOwner<H> {
    pub fn new(shard: u32, cores: usize, ring: ReplayRing) -> Self {
        ShardOwner {
            shard,
            next_offset: 0,
            ring,
            interest: vec![0; cores],
            parked_cores: vec![false; cores],
            held: VecDeque::new(),
        }
    }
    pub fn next_offset(&self) -> u64 {
        self.next_offset
    }
    /// Continue an existing log's numbering (a durable shard reopened at `next`).
    pub fn start_at(&mut self, next: u64) {
        assert!(self.ring.oldest().is_none(), "start_at before any append");
        self.next_offset = next;
    }
    /// Number again from `next`, with an empty ring (a replicated shard's new leadership
    /// here: what the ring held may not be the log's committed history any more). Interest
    /// and held publishes stay.
    pub fn restart_at(&mut self, next: u64) {
        self.ring = ReplayRing::new(self.ring.records_max, self.ring.bytes_max);
        self.next_offset = next;
    }
    /// Assign offsets, encode the delivery once, keep it in the ring.
    pub fn append(&mut self, records: &Records) -> Batch {
        let b = Batch::new(self.shard, self.next_offset, records);
        self.next_offset = b.end();
        self.ring.push(b.clone());
        b
    }
    /// Cores that get one copy of every batch.
    pub fn interested_cores(&self) -> impl Iterator<Item = usize> + '_ {
        self.interest
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(c, _)| c)
    }
    pub fn attach(&mut self, core: usize) {
        self.interest[core] += 1;
    }
    pub fn detach(&mut self, core: usize) {
        assert!(self.interest[core] > 0, "detach without attach");
        self.interest[core] -= 1;
    }
    pub fn set_parked(&mut self, core: usize, parked: bool) {
        self.parked_cores[core] = parked;
    }
    /// Whether publishes must wait (some Block subscriber has parked batches).
    pub fn holding(&self) -> bool {
        self.parked_cores.iter().any(|p| *p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn batch(first: u64, n: u32) -> Batch {
        let payloads: Vec<Vec<u8>> = (0..n)
            .map(|i| format!("r{}", first + i as u64).into_bytes())
            .collect();
        Batch::new(0, first, &Records::encode(payloads))
    }

    /// Offsets a drained queue yields, with lags expanded, must cover `0..end` exactly once.
    fn drain(q: &mut SubQueue) -> (Vec<u64>, Vec<Lag>) {
        let mut got = Vec::new();
        let mut lags = Vec::new();
        while let (Some(item), _) = q.pop() {
            match item {
                Item::Batch(b) => got.extend(b.first_offset..b.end()),
                Item::Lag(l) => lags.push(l),
            }
        }
        (got, lags)
    }

    #[test]
    fn drop_new_keeps_oldest_with_one_exact_notice() {
        let mut q = SubQueue::new(QueuePolicy::DropNew, 4, 1 << 20);
        for i in 0..10 {
            q.offer(batch(i, 1));
        }
        let (got, lags) = drain(&mut q);
        assert_eq!(got, vec![0, 1, 2, 3]);
        assert_eq!(
            lags,
            vec![Lag {
                from_offset: 4,
                lost: 6
            }]
        );
        assert_eq!(q.dropped_records, 6);
    }

    #[test]
    fn drop_old_keeps_newest_with_one_exact_notice() {
        let mut q = SubQueue::new(QueuePolicy::DropOld, 4, 1 << 20);
        for i in 0..10 {
            q.offer(batch(i, 1));
        }
        let (got, lags) = drain(&mut q);
        assert_eq!(got, vec![6, 7, 8, 9]);
        assert_eq!(
            lags,
            vec![Lag {
                from_offset: 0,
                lost: 6
            }]
        );
    }

    #[test]
    fn block_parks_then_releases_in_order() {
        let mut q = SubQueue::new(QueuePolicy::Block, 2, 1 << 20);
        assert_eq!(q.offer(batch(0, 1)), Offer::Queued);
        assert_eq!(q.offer(batch(1, 1)), Offer::Queued);
        assert_eq!(q.offer(batch(2, 1)), Offer::Parked { first: true });
        assert_eq!(q.offer(batch(3, 1)), Offer::Parked { first: false });
        assert!(matches!(q.pop(), (Some(Item::Batch(_)), false)));
        assert!(
            matches!(q.pop(), (Some(Item::Batch(_)), true)),
            "last parked moved in"
        );
        let (got, lags) = drain(&mut q);
        assert_eq!(got, vec![2, 3]);
        assert!(lags.is_empty());
    }

    #[test]
    fn byte_bound_applies_and_oversized_batch_enters_empty_queue() {
        let big = batch(0, 50);
        let mut q = SubQueue::new(QueuePolicy::DropNew, 1000, big.bytes() - 1);
        assert_eq!(
            q.offer(big),
            Offer::Queued,
            "empty queue admits an oversized batch"
        );
        assert_eq!(q.offer(batch(50, 1)), Offer::Dropped, "byte bound holds");
    }

    #[test]
    fn ring_replay_cuts_and_lags() {
        let mut r = ReplayRing::new(6, 1 << 20);
        for i in 0..4 {
            r.push(batch(i * 3, 3));
        }
        // 12 records pushed, 6 kept: offsets 6..12.
        assert_eq!(r.oldest(), Some(6));
        let (lag, bs) = r.replay_from(0, 2);
        assert_eq!(
            lag,
            Some(Lag {
                from_offset: 2,
                lost: 4
            })
        );
        assert_eq!(
            bs.iter().map(|b| b.first_offset).collect::<Vec<_>>(),
            vec![6, 9]
        );
        let (lag, bs) = r.replay_from(0, 7);
        assert_eq!(lag, None);
        assert_eq!(bs[0].first_offset, 7);
        assert_eq!(bs[0].count, 2);
        let mut joined = bs[0].head.to_vec();
        joined.extend_from_slice(&bs[0].region);
        let f = felix_quic::wire::decode_frame(&joined, 1 << 20).unwrap();
        match f {
            felix_quic::wire::Frame::Delivery {
                first_offset,
                records,
                ..
            } => {
                assert_eq!(first_offset, 7);
                let p: Vec<_> = records.iter().collect();
                assert_eq!(p, vec![Bytes::from("r7"), Bytes::from("r8")]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn owner_offsets_interest_and_hold() {
        let mut o: ShardOwner<u32> = ShardOwner::new(0, 2, ReplayRing::new(100, 1 << 20));
        let b = o.append(&Records::encode([&b"a"[..], b"b"]));
        assert_eq!((b.first_offset, b.count, o.next_offset()), (0, 2, 2));
        o.attach(1);
        assert_eq!(o.interested_cores().collect::<Vec<_>>(), vec![1]);
        o.detach(1);
        assert_eq!(o.interested_cores().count(), 0);
        o.set_parked(1, true);
        assert!(o.holding());
        o.set_parked(1, false);
        assert!(!o.holding());
    }

    proptest! {
        /// A batch cut to a peer's frame maximum: contiguous pieces, each under the bound
        /// unless it is one record, that decode to the same payloads in order.
        #[test]
        fn split_to_fit_keeps_every_record_in_order_under_the_bound(
            sizes in proptest::collection::vec(0usize..300, 1..40),
            max in 64usize..2000,
        ) {
            let payloads: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, n)| vec![i as u8; *n]).collect();
            let records = Records::encode(&payloads);
            let b = Batch::new(3, 100, &records);
            let pieces = b.split_to_fit(3, max);
            let mut next = 100u64;
            let mut got: Vec<Vec<u8>> = Vec::new();
            for p in &pieces {
                prop_assert_eq!(p.first_offset, next, "pieces are contiguous");
                next = p.end();
                let one_record = p.count == 1;
                prop_assert!(p.bytes() as usize <= max || one_record, "over the bound only with one record");
                let frame = [p.head.clone(), p.region.clone()].concat();
                match felix_quic::wire::decode_frame(&frame, usize::MAX >> 1).unwrap() {
                    felix_quic::wire::Frame::Delivery { shard, first_offset, records } => {
                        prop_assert_eq!(shard, 3);
                        prop_assert_eq!(first_offset, p.first_offset);
                        got.extend(records.iter().map(|r| r.to_vec()));
                    }
                    other => prop_assert!(false, "not a delivery: {:?}", other),
                }
            }
            prop_assert_eq!(next, b.end());
            prop_assert_eq!(got, payloads);
        }

        /// Under every policy, with arbitrary batches and arbitrary interleaved pops, what the
        /// subscriber receives plus what the notices announce covers every offset exactly
        /// once, in order; the bounds hold (beyond a lone oversized batch); Block loses nothing.
        #[test]
        fn coverage_is_exact(policy in 0u8..3, records_max in 1u64..8, sizes in proptest::collection::vec(1u32..5, 1..60), pops in proptest::collection::vec(0u8..3, 60)) {
            let policy = [QueuePolicy::DropNew, QueuePolicy::DropOld, QueuePolicy::Block][policy as usize];
            let mut q = SubQueue::new(policy, records_max, 1 << 30);
            let mut seen: Vec<(u64, u64, bool)> = Vec::new(); // (from, end, delivered)
            let mut next = 0u64;
            let take = |q: &mut SubQueue, seen: &mut Vec<(u64, u64, bool)>| {
                if let (Some(item), _) = q.pop() {
                    match item {
                        Item::Batch(b) => seen.push((b.first_offset, b.end(), true)),
                        Item::Lag(l) => seen.push((l.from_offset, l.end(), false)),
                    }
                }
            };
            for (i, n) in sizes.iter().enumerate() {
                q.offer(batch(next, *n));
                next += *n as u64;
                prop_assert!(q.queued_records() <= records_max.max(4), "bound held");
                for _ in 0..pops[i % pops.len()] {
                    take(&mut q, &mut seen);
                }
            }
            while !q.is_empty() || q.is_parked() {
                take(&mut q, &mut seen);
            }
            let mut at = 0u64;
            for (from, end, delivered) in &seen {
                prop_assert_eq!(*from, at, "contiguous coverage");
                prop_assert!(end > from);
                if policy == QueuePolicy::Block { prop_assert!(*delivered, "block never loses"); }
                at = *end;
            }
            prop_assert_eq!(at, next);
        }
    }
}

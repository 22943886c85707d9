//! Caches, watches and counters. A cache is named `(tenant, namespace, cache)` (a
//! [`StreamName`] whose third part is the cache name); the broker hashes each key (or
//! counter name) to its shard.
//!
//! - Versions are the offsets of the writes that made them; `cache_put_if` /
//!   `cache_delete_if` apply only when the key is at the version named (or absent), else
//!   the broker refuses with `condition_failed` and nothing is written.
//! - [`Client::cache_watch`] follows one key or a prefix on one shard;
//!   [`Client::cache_watch_prefix`] follows a prefix on every shard of the cache, merged
//!   (each shard's order is kept; offsets are per shard).
//! - Counters are at least once: an add retried after a lost answer counts twice.

use super::*;
use crate::sink::{SharedSink, Sink};

/// A key's live value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheEntry {
    pub shard: u32,
    /// The offset of the write that made it.
    pub version: u64,
    /// Absolute expiry, wall-clock ms since the Unix epoch.
    pub expires_at_ms: Option<u64>,
    pub value: Bytes,
}

/// What a delete did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deleted {
    /// The offset of the delete (watches see it there).
    pub offset: u64,
    pub removed: CacheEntry,
}

/// What a put did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    pub shard: u32,
    pub version: u64,
    pub expires_at_ms: Option<u64>,
}

/// A counter's sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterValue {
    pub shard: u32,
    pub sum: i64,
    /// add: the delta's offset in the shard's counter log; get: the log's next offset.
    pub offset: u64,
}

/// Shape of a cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheInfo {
    pub shards: u32,
    pub durable: bool,
    pub default_ttl_ms: Option<u64>,
    /// The owner broker's node id of each shard (0: not placed; empty from a broker without
    /// a cluster map).
    pub owners: Vec<u64>,
}

/// What a watch yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchItem {
    /// A key's current value in the state phase (`kind` Retained; `offset` is its version)
    /// or a change (Put / Delete / Expire) at `offset`.
    Event {
        shard: u32,
        kind: EventKind,
        offset: u64,
        key: Bytes,
        value: Bytes,
        expires_at_ms: Option<u64>,
    },
    /// The state phase of `shard` is complete: `count` retained events came before it (0 is a
    /// definite "no matching key"). `snapshot`: they replace a replay the shard could no
    /// longer give (a resume below its replay window).
    StateDone {
        shard: u32,
        count: u64,
        snapshot: bool,
        live_from: u64,
    },
    /// The watch of `shard` ended. `code` 0 is a normal end (unwatched); `watch_lagged`
    /// (and others) name `resume_from`, the offset to watch again from. `u16::MAX`: the
    /// connection closed.
    End {
        shard: u32,
        code: u16,
        resume_from: u64,
        message: String,
    },
}

pub(crate) fn watch_item(shard: u32, f: CacheFrame) -> Option<WatchItem> {
    Some(match f {
        CacheFrame::CacheEvent {
            kind,
            offset,
            key,
            expires_at_ms,
            value,
        } => WatchItem::Event {
            shard,
            kind,
            offset,
            key,
            value,
            expires_at_ms: (expires_at_ms != 0).then_some(expires_at_ms),
        },
        CacheFrame::CacheStateDone {
            count,
            snapshot,
            live_from,
        } => WatchItem::StateDone {
            shard,
            count,
            snapshot,
            live_from,
        },
        CacheFrame::CacheWatchEnd {
            code,
            resume_from,
            message,
        } => WatchItem::End {
            shard,
            code,
            resume_from,
            message,
        },
        _ => return None,
    })
}

/// Options of a watch.
#[derive(Debug, Clone, Copy)]
pub struct WatchOptions {
    /// Broker-side queue bound, events; 0 = broker default (also the maximum).
    pub queue_events_max: u32,
    /// Broker-side queue bound, bytes; 0 = broker default (also the maximum).
    pub queue_bytes_max: u64,
    /// Items buffered in this client before it stops reading (flow control holds the broker).
    pub buffer_items: usize,
}

impl Default for WatchOptions {
    fn default() -> Self {
        WatchOptions {
            queue_events_max: 0,
            queue_bytes_max: 0,
            buffer_items: 4096,
        }
    }
}

/// A live watch of one or more shards. Dropping it ends the watches at the broker.
pub struct CacheWatch {
    pub(crate) sub: Subscription,
    /// `(shard, live_from)` of each shard watched, as the broker answered.
    pub live_from: Vec<(u32, u64)>,
    pub(crate) open: usize,
    /// Shards whose end was returned (a second end, e.g. from a connection close, is not).
    ended: std::collections::HashSet<u32>,
    /// Per shard: the offset after the last change received (where a resume would start).
    next: felix_quic::idmap::IdMap<u32, u64>,
}

impl CacheWatch {
    /// The next item; `None` once every shard's watch ended (its `End` was returned) or the
    /// connection is gone.
    pub async fn next(&mut self) -> Option<WatchItem> {
        while self.open > 0 {
            let ev = self.sub.next().await?;
            if let Some(it) = self.item(ev) {
                return Some(it);
            }
        }
        None
    }

    /// The next item if one arrives within `timeout`.
    pub async fn next_timeout(&mut self, timeout: Duration) -> Result<Option<WatchItem>, Error> {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.open > 0 {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let Some(ev) = self.sub.next_timeout(left).await? else {
                return Ok(None);
            };
            if let Some(it) = self.item(ev) {
                return Ok(Some(it));
            }
        }
        Ok(None)
    }

    pub(crate) fn item(&mut self, ev: Event) -> Option<WatchItem> {
        let it = match ev {
            Event::Watch(it) => it,
            Event::End {
                shard,
                code,
                message,
            } => WatchItem::End {
                shard,
                code,
                resume_from: self.next.get(&shard).copied().unwrap_or(0),
                message,
            },
            other => WatchItem::End {
                shard: 0,
                code: u16::MAX,
                resume_from: 0,
                message: format!("unexpected event on a watch stream: {other:?}"),
            },
        };
        match &it {
            WatchItem::Event {
                shard,
                kind,
                offset,
                ..
            } if *kind != EventKind::Retained => {
                // Updated in place: this runs once per change per watch.
                match self.next.get_mut(shard) {
                    Some(n) => *n = offset + 1,
                    None => {
                        self.next.insert(*shard, offset + 1);
                    }
                }
            }
            WatchItem::StateDone {
                shard, live_from, ..
            } => {
                let n = self.next.entry(*shard).or_insert(*live_from);
                *n = (*n).max(*live_from);
            }
            WatchItem::End { shard, .. } => {
                if !self.ended.insert(*shard) {
                    return None;
                }
                self.open = self.open.saturating_sub(1);
            }
            _ => {}
        }
        Some(it)
    }

    /// Per shard, the offset to resume from to miss nothing after what was received.
    pub fn resume_offsets(&self) -> Vec<(u32, u64)> {
        let mut v: Vec<(u32, u64)> = self.next.iter().map(|(s, o)| (*s, *o)).collect();
        v.sort();
        v
    }
}

fn opt_ms(v: u64) -> Option<u64> {
    (v != 0).then_some(v)
}

impl Client {
    /// A key (or counter name) longer than the broker takes is refused here, before sending,
    /// naming the broker's own limit (`HelloOk.max_key_bytes`, its `cache_key_bytes_max`):
    /// one source for the number. An empty key is left to the broker to refuse.
    fn key_fits(&self, k: &[u8]) -> Result<(), Error> {
        let max = self.limits.max_key_bytes as usize;
        if k.len() > max {
            return Err(Error::InvalidArgument(format!(
                "a key of {} bytes is over the broker's cache_key_bytes_max ({max})",
                k.len()
            )));
        }
        Ok(())
    }

    /// Shard count, durability and default TTL of a cache.
    pub async fn describe_cache(&self, cache: &StreamName) -> Result<CacheInfo, Error> {
        match self
            .request(|request_id| {
                Frame::Cache(CacheFrame::DescribeCache {
                    request_id,
                    cache: cache.clone(),
                })
            })
            .await?
        {
            Frame::Cache(CacheFrame::CacheInfo {
                shards,
                durable,
                default_ttl_ms,
                owners,
                ..
            }) => Ok(CacheInfo {
                shards,
                durable,
                default_ttl_ms: opt_ms(default_ttl_ms),
                owners,
            }),
            other => Err(unexpected(other)),
        }
    }

    /// Write `value` under `key`; `ttl_ms` None takes the cache's default TTL.
    pub async fn cache_put(
        &self,
        cache: &StreamName,
        key: impl Into<Bytes>,
        value: impl Into<Bytes>,
        ttl_ms: Option<u64>,
    ) -> Result<Written, Error> {
        self.cache_put_if(cache, key, value, ttl_ms, WriteCond::Always)
            .await
    }

    /// A conditional put: refused `condition_failed` unless `cond` holds.
    pub async fn cache_put_if(
        &self,
        cache: &StreamName,
        key: impl Into<Bytes>,
        value: impl Into<Bytes>,
        ttl_ms: Option<u64>,
        cond: WriteCond,
    ) -> Result<Written, Error> {
        if ttl_ms == Some(0) {
            return Err(Error::InvalidArgument(
                "ttl_ms must be positive (None = the cache's default)".into(),
            ));
        }
        let (key, value) = (key.into(), value.into());
        self.key_fits(&key)?;
        match self
            .request(|request_id| {
                Frame::Cache(CacheFrame::CachePut {
                    request_id,
                    cache: cache.clone(),
                    key,
                    value,
                    ttl_ms: ttl_ms.unwrap_or(0),
                    cond,
                })
            })
            .await?
        {
            Frame::Cache(CacheFrame::CacheWritten {
                shard,
                version,
                expires_at_ms,
                ..
            }) => Ok(Written {
                shard,
                version,
                expires_at_ms: opt_ms(expires_at_ms),
            }),
            other => Err(unexpected(other)),
        }
    }

    /// The key's live value, if it has one.
    pub async fn cache_get(
        &self,
        cache: &StreamName,
        key: impl Into<Bytes>,
    ) -> Result<Option<CacheEntry>, Error> {
        let key = key.into();
        self.key_fits(&key)?;
        let f = self
            .request(|request_id| {
                Frame::Cache(CacheFrame::CacheGet {
                    request_id,
                    cache: cache.clone(),
                    key,
                })
            })
            .await?;
        Ok(value_of(f)?.map(|(e, _)| e))
    }

    /// Delete the key: the value it removed, or None when it had none.
    pub async fn cache_delete(
        &self,
        cache: &StreamName,
        key: impl Into<Bytes>,
    ) -> Result<Option<Deleted>, Error> {
        match self.cache_delete_if(cache, key, WriteCond::Always).await {
            Err(e) if e.code() == Some(ErrorCode::NotFound) => Ok(None),
            r => r.map(Some),
        }
    }

    /// A conditional delete: the value removed; `condition_failed` unless `cond` holds,
    /// `not_found` when the key has no value.
    pub async fn cache_delete_if(
        &self,
        cache: &StreamName,
        key: impl Into<Bytes>,
        cond: WriteCond,
    ) -> Result<Deleted, Error> {
        let key = key.into();
        self.key_fits(&key)?;
        let f = self
            .request(|request_id| {
                Frame::Cache(CacheFrame::CacheDelete {
                    request_id,
                    cache: cache.clone(),
                    key,
                    cond,
                })
            })
            .await?;
        match value_of(f)? {
            Some((removed, offset)) => Ok(Deleted { offset, removed }),
            None => Err(Error::Protocol("delete answered without a value".into())),
        }
    }

    /// Add `delta` to a counter: the new sum. At least once (a retry after a lost answer
    /// counts twice).
    pub async fn counter_add(
        &self,
        cache: &StreamName,
        name: impl Into<Bytes>,
        delta: i64,
    ) -> Result<CounterValue, Error> {
        let name = name.into();
        self.key_fits(&name)?;
        let f = self
            .request(|request_id| {
                Frame::Cache(CacheFrame::CounterAdd {
                    request_id,
                    cache: cache.clone(),
                    name,
                    delta,
                })
            })
            .await?;
        counter_of(f)
    }

    /// A counter's sum (0 if it was never added to).
    pub async fn counter_get(
        &self,
        cache: &StreamName,
        name: impl Into<Bytes>,
    ) -> Result<CounterValue, Error> {
        let name = name.into();
        self.key_fits(&name)?;
        let f = self
            .request(|request_id| {
                Frame::Cache(CacheFrame::CounterGet {
                    request_id,
                    cache: cache.clone(),
                    name,
                })
            })
            .await?;
        counter_of(f)
    }

    /// Watch one key (its shard is the key's) or a prefix on one shard.
    pub async fn cache_watch(
        &self,
        cache: &StreamName,
        filter: WatchFilter,
        start: WatchStart,
        opts: WatchOptions,
    ) -> Result<CacheWatch, Error> {
        self.watch_many(cache, vec![(filter, start)], opts).await
    }

    /// Watch `prefix` on every shard of the cache, merged. `start` applies to every shard;
    /// to resume, use [`Client::cache_watch_prefix_from`] (offsets are per shard).
    pub async fn cache_watch_prefix(
        &self,
        cache: &StreamName,
        prefix: impl Into<Bytes>,
        start: WatchStart,
        opts: WatchOptions,
    ) -> Result<CacheWatch, Error> {
        if let WatchStart::Offset(_) = start {
            return Err(Error::InvalidArgument(
                "offsets are per shard: resume a multi-shard watch with cache_watch_prefix_from"
                    .into(),
            ));
        }
        let info = self.describe_cache(cache).await?;
        let shards: Vec<u32> = (0..info.shards).collect();
        self.cache_watch_prefix_shards(cache, prefix, &shards, start, opts)
            .await
    }

    /// Resume a multi-shard prefix watch from per-shard offsets (e.g.
    /// [`CacheWatch::resume_offsets`] of an earlier one); every shard must be named.
    pub async fn cache_watch_prefix_from(
        &self,
        cache: &StreamName,
        prefix: impl Into<Bytes>,
        from: &[(u32, u64)],
        opts: WatchOptions,
    ) -> Result<CacheWatch, Error> {
        let info = self.describe_cache(cache).await?;
        let mut shards: Vec<u32> = from.iter().map(|(s, _)| *s).collect();
        shards.sort();
        shards.dedup();
        if shards != (0..info.shards).collect::<Vec<_>>() || shards.len() != from.len() {
            return Err(Error::InvalidArgument(format!(
                "name every shard 0..{} exactly once",
                info.shards
            )));
        }
        let prefix = prefix.into();
        let specs = from
            .iter()
            .map(|(shard, off)| {
                (
                    WatchFilter::Prefix {
                        prefix: prefix.clone(),
                        shard: *shard,
                    },
                    WatchStart::Offset(*off),
                )
            })
            .collect();
        self.watch_many(cache, specs, opts).await
    }

    /// Watch `prefix` on the named shards of the cache (each from `start`), merged: the part
    /// of a cluster-wide prefix watch that one broker owns (see
    /// [`crate::ClusterClient::cache_watch_prefix`]).
    pub async fn cache_watch_prefix_shards(
        &self,
        cache: &StreamName,
        prefix: impl Into<Bytes>,
        shards: &[u32],
        start: WatchStart,
        opts: WatchOptions,
    ) -> Result<CacheWatch, Error> {
        self.watch_many(cache, prefix_specs(prefix.into(), shards, start), opts)
            .await
    }

    async fn watch_many(
        &self,
        cache: &StreamName,
        specs: Vec<(WatchFilter, WatchStart)>,
        opts: WatchOptions,
    ) -> Result<CacheWatch, Error> {
        self.watch_into(cache, specs, opts, None).await
    }

    /// Open the watches of `specs` as one [`CacheWatch`]. Its items go to a channel of its
    /// own, or, given `shared` (its place in a set's channel, bounded at `opts.buffer_items`),
    /// to that channel; the returned watch then has no receiver and the set reads for it.
    pub(crate) async fn watch_into(
        &self,
        cache: &StreamName,
        specs: Vec<(WatchFilter, WatchStart)>,
        opts: WatchOptions,
        shared: Option<SharedSink>,
    ) -> Result<CacheWatch, Error> {
        if opts.buffer_items == 0 {
            return Err(Error::InvalidArgument(
                "buffer_items must be positive".into(),
            ));
        }
        for (f, _) in &specs {
            let (WatchFilter::Key(k) | WatchFilter::Prefix { prefix: k, .. }) = f;
            self.key_fits(k)?;
        }
        let (sink, rx) = match shared {
            None => {
                let (tx, rx) = mpsc::channel(opts.buffer_items);
                (Sink::Own(tx), Some(rx))
            }
            Some(s) => {
                debug_assert_eq!(s.cap, opts.buffer_items, "a member's bound is its buffer");
                (Sink::Shared(s), None)
            }
        };
        let paused = Arc::new(AtomicBool::new(false));
        let mut w = CacheWatch {
            sub: Subscription {
                rx,
                paused: paused.clone(),
                inner: self.inner.clone(),
                ids: Vec::new(),
                start_offsets: Vec::new(),
                lost: 0,
            },
            live_from: Vec::new(),
            open: 0,
            ended: Default::default(),
            next: Default::default(),
        };
        for (filter, start) in specs {
            let request_id = self.inner.id();
            let frame = Frame::Cache(CacheFrame::CacheWatch {
                request_id,
                cache: cache.clone(),
                filter: filter.clone(),
                start,
                queue_events_max: opts.queue_events_max,
                queue_bytes_max: opts.queue_bytes_max,
            });
            // A key watch's shard is known from the answer: the connection task sets the
            // slot's shard from `CacheWatchOk` before it hands out any item.
            let shard = match &filter {
                WatchFilter::Prefix { shard, .. } => *shard,
                WatchFilter::Key(_) => u32::MAX,
            };
            let (reply, rx) = oneshot::channel();
            let slot = SubSlot {
                events: sink.clone(),
                paused: paused.clone(),
                shard,
                watch: true,
                mux: false,
            };
            self.inner.send(Cmd::Subscribe {
                frame,
                request_id,
                reply,
                slot,
            })?;
            // On failure `w` is dropped, which ends the watches already opened.
            match self.inner.wait(rx).await? {
                Frame::Cache(CacheFrame::CacheWatchOk {
                    watch_id,
                    shard,
                    live_from,
                    ..
                }) => {
                    w.sub.ids.push((shard, watch_id));
                    w.sub.start_offsets.push((shard, live_from));
                    w.live_from.push((shard, live_from));
                    w.open += 1;
                    // Before any change arrives, a resume starts where this watch did.
                    let from = match start {
                        WatchStart::Offset(o) => o,
                        _ => live_from,
                    };
                    w.next.insert(shard, from);
                }
                other => return Err(unexpected(other)),
            }
        }
        Ok(w)
    }
}

/// One watch of `prefix` per shard, each from `start`.
pub(crate) fn prefix_specs(
    prefix: Bytes,
    shards: &[u32],
    start: WatchStart,
) -> Vec<(WatchFilter, WatchStart)> {
    let filter = |shard| WatchFilter::Prefix {
        prefix: prefix.clone(),
        shard,
    };
    shards.iter().map(|&shard| (filter(shard), start)).collect()
}

/// The entry and the answer's change offset.
fn value_of(f: Frame) -> Result<Option<(CacheEntry, u64)>, Error> {
    match f {
        Frame::Cache(CacheFrame::CacheValue {
            shard,
            found,
            version,
            change_offset,
            expires_at_ms,
            value,
            ..
        }) => Ok(found.then_some((
            CacheEntry {
                shard,
                version,
                expires_at_ms: opt_ms(expires_at_ms),
                value,
            },
            change_offset,
        ))),
        other => Err(unexpected(other)),
    }
}

fn counter_of(f: Frame) -> Result<CounterValue, Error> {
    match f {
        Frame::Cache(CacheFrame::CounterValue {
            shard, sum, offset, ..
        }) => Ok(CounterValue { shard, sum, offset }),
        other => Err(unexpected(other)),
    }
}

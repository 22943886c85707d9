//! The ClusterClient's prefix watch over every shard of a cache: one watch per owner broker
//! (over the shards it owns, from `CacheInfo.owners`), merged into one stream of items.
//!
//! A shard whose watch ends for any reason but a normal unwatch (its broker died or drains,
//! the shard moved, the watch lagged) is watched again on its owner, learned anew from any
//! broker, from the offset its end named, without disturbing the other shards: the consumer
//! sees no `End` for it, and nothing is skipped (a resume below what the shard can replay is a
//! marked snapshot, as on one broker). An ephemeral shard that moved restarts empty on its
//! new owner: the offset is beyond its end there, so it is watched again from its current
//! state instead, and the consumer sees that shard's state phase again (`StateDone`). A shard
//! that cannot be watched again within the ClusterClient's `resend_for` ends with its `End`.

use crate::cluster::{connection_lost, retryable, Backoff, ClusterClient};
use crate::{CacheWatch, Client, Error, WatchItem, WatchOptions, WatchStart};
use bytes::Bytes;
use felix_quic::wire::{ErrorCode, StreamName};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// What every shard's pump shares.
struct Shared {
    cc: Arc<ClusterClient>,
    cache: StreamName,
    prefix: Bytes,
    opts: WatchOptions,
    tx: mpsc::Sender<WatchItem>,
    /// Every pump task, aborted when the watch is dropped.
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

/// A cluster-wide prefix watch: every shard's items, merged (order per shard only).
pub struct ClusterWatch {
    rx: mpsc::Receiver<WatchItem>,
    shared: Arc<Shared>,
}

impl ClusterWatch {
    /// The next item of any shard; `None` once every shard's watch ended.
    pub async fn next(&mut self) -> Option<WatchItem> {
        self.rx.recv().await
    }
}

impl Drop for ClusterWatch {
    fn drop(&mut self) {
        let tasks = self.shared.tasks.lock().unwrap_or_else(|p| p.into_inner());
        for t in tasks.iter() {
            t.abort();
        }
    }
}

impl ClusterClient {
    /// Watch `prefix` on every shard of a cache, each shard on its owner, merged: order is per
    /// shard only. It refuses to open rather than cover some shards. See the module doc for
    /// what happens when a shard's watch ends.
    pub async fn cache_watch_prefix(
        self: &Arc<Self>,
        cache: &StreamName,
        prefix: impl Into<Bytes>,
        start: WatchStart,
        opts: WatchOptions,
    ) -> Result<ClusterWatch, Error> {
        if let WatchStart::Offset(_) = start {
            return Err(Error::InvalidArgument(
                "offsets are per shard: a cluster-wide prefix watch starts at current, latest or earliest"
                    .into(),
            ));
        }
        let prefix = prefix.into();
        let info = self.any().await?.describe_cache(cache).await?;
        let mut by_owner: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
        for shard in 0..info.shards {
            let owner = info.owners.get(shard as usize).copied().unwrap_or(0);
            by_owner.entry(owner).or_default().push(shard);
        }
        let mut watches = Vec::new();
        for (owner, shards) in by_owner {
            let c = self.to_node(owner).await?;
            let w = c
                .cache_watch_prefix_shards(cache, prefix.clone(), &shards, start, opts)
                .await?;
            watches.push((c, w));
        }
        let (tx, rx) = mpsc::channel(1024);
        let shared = Arc::new(Shared {
            cc: self.clone(),
            cache: cache.clone(),
            prefix,
            opts,
            tx,
            tasks: Mutex::new(Vec::new()),
        });
        for (c, w) in watches {
            spawn_pump(&shared, c, w);
        }
        Ok(ClusterWatch { rx, shared })
    }
}

fn spawn_pump(shared: &Arc<Shared>, c: Arc<Client>, w: CacheWatch) {
    let t = tokio::spawn(pump(shared.clone(), c, w));
    let mut tasks = shared.tasks.lock().unwrap_or_else(|p| p.into_inner());
    // Finished pumps are dropped, so a long watch that reopens often stays bounded.
    tasks.retain(|t| !t.is_finished());
    tasks.push(t);
}

/// Pass one watch's items on; reopen each shard that ends abnormally.
async fn pump(shared: Arc<Shared>, c: Arc<Client>, mut w: CacheWatch) {
    // The connection lives as long as its watch.
    let _c = c;
    while let Some(item) = w.next().await {
        let item = match item {
            WatchItem::End {
                shard,
                code,
                resume_from,
                message,
            } if code != 0 => match reopen(&shared, shard, resume_from).await {
                Ok((c2, w2)) => {
                    spawn_pump(&shared, c2, w2);
                    continue;
                }
                Err(e) => WatchItem::End {
                    shard,
                    code,
                    resume_from,
                    message: format!("{message}; watching it again failed: {e}"),
                },
            },
            other => other,
        };
        if shared.tx.send(item).await.is_err() {
            return;
        }
    }
}

/// Watch `shard` again on its owner from `from` (from its current state if `from` is beyond
/// the end there: an ephemeral shard that moved), retrying until `resend_for` passes.
async fn reopen(
    shared: &Shared,
    shard: u32,
    from: u64,
) -> Result<(Arc<Client>, CacheWatch), Error> {
    let cc = &shared.cc;
    let mut backoff = Backoff::new(cc.resend_for(), Duration::from_millis(50));
    let mut start = WatchStart::Offset(from);
    loop {
        let r = async {
            let info = cc.any().await?.describe_cache(&shared.cache).await?;
            let owner = info.owners.get(shard as usize).copied().unwrap_or(0);
            let c = cc.to_node(owner).await?;
            let w = c
                .cache_watch_prefix_shards(
                    &shared.cache,
                    shared.prefix.clone(),
                    &[shard],
                    start,
                    shared.opts,
                )
                .await;
            match w {
                Ok(w) => Ok((c, w)),
                Err(e) => {
                    if connection_lost(&e) {
                        cc.forget_conn(&c);
                    }
                    Err(e)
                }
            }
        }
        .await;
        let e = match r {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        if matches!(e.code(), Some(ErrorCode::InvalidRequest))
            && matches!(start, WatchStart::Offset(_))
        {
            // Beyond the end: the shard restarted empty on a new owner.
            start = WatchStart::Current;
            continue;
        }
        if !retryable(&e) || !backoff.pause().await {
            return Err(e);
        }
    }
}

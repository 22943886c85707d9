//! A client of a cluster of brokers: seeds in, every broker found, requests sent to the
//! broker that owns their shard.
//!
//! - It reaches the first seed that answers (each within the connect timeout), asks it for
//!   the cluster (`DescribeCluster`) and for each stream it uses the shards' owners
//!   (`StreamInfo.owners`), and keeps one connection per broker it talks to.
//! - A request goes to its shard's owner when the owner is known and reachable, else to any
//!   broker it has a connection to: every broker forwards what it does not own, so a cold or
//!   stale owner map costs a relay, never a failure.
//! - A broker that stops answering is dropped: the failed call reports its error (`publish`)
//!   or is resent (`publish_at_least_once`), and the next call goes to another broker, found
//!   again from the seeds and the cluster map within the connect timeout.
//!
//! Every broker of the cluster must be verifiable with the one CA the client is given (the
//! cluster CA of `scripts/dev-certs.sh`, which `scripts/cluster.sh` uses for the client
//! listeners too).

use crate::{Ack, Client, ClientConfig, Error, Event, SubscribeOptions};
use bytes::Bytes;
use felix_quic::wire::{ErrorCode, ShardSelector, StartAt, StreamName};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Settings of a [`ClusterClient`].
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Brokers to start from, `host:port` (names are resolved); at least one.
    pub seeds: Vec<String>,
    /// The CA every broker's certificate is signed by.
    pub ca: Option<PathBuf>,
    /// How long reaching one broker may take (`FELIX_CONNECT_TIMEOUT_MS`, default 5 s).
    pub connect_timeout: Duration,
    /// How long `publish_at_least_once` keeps resending, at most.
    pub resend_for: Duration,
    /// How long one request waits for its answer before its connection is counted lost.
    pub request_timeout: Duration,
    /// A connection that hears nothing from its broker for this long is lost
    /// (`FELIX_IDLE_TIMEOUT_MS`, default 5 s). Each connection pings its broker at a third of
    /// it, so an idle connection to a live broker stays open, and a subscription or watch on
    /// a broker that died or froze is reopened elsewhere within about this bound.
    pub idle_timeout: Duration,
    /// The token every connection presents at connect (a broker with auth on refuses
    /// requests without one).
    pub token: Option<String>,
}

impl ClusterConfig {
    /// Seeds from a comma-separated list (`--brokers a,b,c`, `FELIX_BROKERS`).
    pub fn new(seeds: &str, ca: Option<PathBuf>) -> Result<Self, Error> {
        let seeds: Vec<String> = seeds
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        if seeds.is_empty() {
            return Err(Error::InvalidArgument("no broker address given".into()));
        }
        let connect_ms = env_ms("FELIX_CONNECT_TIMEOUT_MS", 5_000)?;
        let idle_ms = env_ms("FELIX_IDLE_TIMEOUT_MS", 5_000)?;
        Ok(ClusterConfig {
            seeds,
            ca,
            connect_timeout: Duration::from_millis(connect_ms),
            resend_for: Duration::from_secs(30),
            request_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_millis(idle_ms),
            token: None,
        })
    }
}

/// A positive number of milliseconds from the environment, or `default`.
fn env_ms(name: &str, default: u64) -> Result<u64, Error> {
    match std::env::var(name) {
        Ok(v) => v.parse::<u64>().ok().filter(|&ms| ms > 0).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{name} must be a positive number of milliseconds, got {v:?}"
            ))
        }),
        Err(_) => Ok(default),
    }
}

#[derive(Default)]
struct Map {
    /// node id → client address.
    brokers: BTreeMap<u64, String>,
    /// address → connection.
    conns: HashMap<String, Arc<Client>>,
    /// stream → (shards, owner of each shard: 0 unknown).
    streams: HashMap<StreamName, (u32, Vec<u64>)>,
    /// Round-robin position per stream.
    rr: HashMap<StreamName, u32>,
}

/// A client of every broker of a cluster.
pub struct ClusterClient {
    cfg: ClusterConfig,
    map: Mutex<Map>,
}

/// Doubling pauses (up to 1 s) until a deadline: the ClusterClient's retry loops.
pub(crate) struct Backoff {
    deadline: Instant,
    pause: Duration,
}

impl Backoff {
    pub(crate) fn new(within: Duration, first: Duration) -> Self {
        Backoff {
            deadline: Instant::now() + within,
            pause: first,
        }
    }

    /// Sleep before the next try; false (at once) when that try would pass the deadline.
    pub(crate) async fn pause(&mut self) -> bool {
        if Instant::now() + self.pause > self.deadline {
            return false;
        }
        tokio::time::sleep(self.pause).await;
        self.pause = (self.pause * 2).min(Duration::from_secs(1));
        true
    }
}

/// Worth trying again: the connection was lost, or the broker said "later".
pub(crate) fn retryable(e: &Error) -> bool {
    connection_lost(e)
        || matches!(
            e.code().map(|c| c.retry()),
            Some(felix_quic::wire::Retry::Retryable)
        )
}

/// Errors after which a connection is not trusted any more.
pub(crate) fn connection_lost(e: &Error) -> bool {
    matches!(
        e,
        Error::Closed(_) | Error::Timeout(_) | Error::Unreachable { .. } | Error::Connect(..)
    )
}

impl ClusterClient {
    /// Reach the first seed that answers and learn the cluster from it. A dead seed is
    /// skipped; it fails only if no seed answers.
    pub async fn connect(cfg: ClusterConfig) -> Result<ClusterClient, Error> {
        let cc = ClusterClient {
            cfg,
            map: Mutex::new(Map::default()),
        };
        cc.any().await?;
        Ok(cc)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Map> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How long a request is resent, and a lost watch or subscription reopened, before the
    /// failure is reported.
    pub(crate) fn resend_for(&self) -> Duration {
        self.cfg.resend_for
    }

    /// The brokers known, node id → address.
    pub fn brokers(&self) -> BTreeMap<u64, String> {
        self.lock().brokers.clone()
    }

    async fn dial(&self, addr: &str) -> Result<Arc<Client>, Error> {
        let open = self.lock().conns.get(addr).cloned();
        if let Some(c) = open {
            return Ok(c);
        }
        let mut cfg = ClientConfig::for_broker(addr, self.cfg.ca.clone())?;
        cfg.connect_timeout = self.cfg.connect_timeout;
        cfg.request_timeout = self.cfg.request_timeout;
        cfg.transport.idle_timeout_ms = self.cfg.idle_timeout.as_millis() as u64;
        cfg.keepalive = Some(self.cfg.idle_timeout / 3);
        cfg.token = self.cfg.token.clone();
        let c = Arc::new(Client::connect(cfg).await?);
        // Learn the cluster from every broker reached (a newer map replaces the old one).
        if let Ok((node, brokers)) = c.describe_cluster().await {
            let mut m = self.lock();
            if brokers.is_empty() {
                m.brokers.insert(node, addr.to_string());
            } else {
                m.brokers = brokers.into_iter().collect();
            }
        }
        self.lock().conns.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    /// A connection to any broker: one already open, else the known brokers and the seeds in
    /// turn (each within the connect timeout). The error names every address tried.
    pub(crate) async fn any(&self) -> Result<Arc<Client>, Error> {
        // A connection whose task ended is dropped here rather than handed out.
        self.lock().conns.retain(|_, c| !c.is_closed());
        let open = self.lock().conns.values().next().cloned();
        if let Some(c) = open {
            return Ok(c);
        }
        let mut tried = Vec::new();
        let known: Vec<String> = self.lock().brokers.values().cloned().collect();
        for addr in known.iter().chain(self.cfg.seeds.iter()) {
            if tried.iter().any(|(a, _): &(String, String)| a == addr) {
                continue;
            }
            match self.dial(addr).await {
                Ok(c) => return Ok(c),
                Err(e) => tried.push((addr.clone(), e.to_string())),
            }
        }
        let what: Vec<String> = tried.iter().map(|(a, e)| format!("{a}: {e}")).collect();
        Err(Error::Closed(format!(
            "no broker of the cluster answered ({})",
            what.join("; ")
        )))
    }

    /// A connection to broker `node`, or to any broker if it is unknown or unreachable.
    pub(crate) async fn to_node(&self, node: u64) -> Result<Arc<Client>, Error> {
        let addr = self.lock().brokers.get(&node).cloned();
        if let Some(addr) = addr {
            match self.dial(&addr).await {
                Ok(c) => return Ok(c),
                Err(_) => self.forget(&addr),
            }
        }
        self.any().await
    }

    /// Drop a connection that failed, and the owner maps (they may name a dead broker).
    fn forget(&self, addr: &str) {
        let mut m = self.lock();
        m.conns.remove(addr);
        m.streams.clear();
    }

    /// Forget what is known of a stream's owners (asked again on next use).
    pub(crate) fn forget_layout(&self, stream: &StreamName) {
        self.lock().streams.remove(stream);
    }

    pub(crate) fn forget_conn(&self, c: &Arc<Client>) {
        let addr = {
            let m = self.lock();
            m.conns
                .iter()
                .find(|(_, v)| Arc::ptr_eq(v, c))
                .map(|(a, _)| a.clone())
        };
        if let Some(a) = addr {
            self.forget(&a);
        }
    }

    /// Shards and owners of a stream (asked once, then again after a failure).
    pub(crate) async fn layout(&self, stream: &StreamName) -> Result<(u32, Vec<u64>), Error> {
        let known = self.lock().streams.get(stream).cloned();
        if let Some(l) = known {
            return Ok(l);
        }
        let c = self.any().await?;
        let info = match c.describe_stream(stream).await {
            Ok(i) => i,
            Err(e) => {
                if connection_lost(&e) {
                    self.forget_conn(&c);
                }
                return Err(e);
            }
        };
        let l = (info.shards, info.owners);
        self.lock().streams.insert(stream.clone(), l.clone());
        Ok(l)
    }

    /// The shard a selector names (round robin here, per stream; the key hash as the broker
    /// computes it).
    fn shard_of(&self, stream: &StreamName, shards: u32, sel: &ShardSelector) -> u32 {
        match sel {
            ShardSelector::Shard(s) => *s,
            ShardSelector::Key(k) => felix_quic::wire::hash::shard_for_key(k, shards),
            ShardSelector::RoundRobin => {
                let mut m = self.lock();
                let n = m.rr.entry(stream.clone()).or_insert(0);
                *n = n.wrapping_add(1);
                *n % shards.max(1)
            }
        }
    }

    /// An acked publish, sent to the shard's owner (or any broker, which forwards it). On a
    /// lost connection the error is returned, with the connection already replaced for the
    /// next call.
    pub async fn publish_batch<P: Into<Bytes>>(
        &self,
        stream: &StreamName,
        selector: ShardSelector,
        payloads: Vec<P>,
    ) -> Result<Ack, Error> {
        let payloads: Vec<Bytes> = payloads.into_iter().map(Into::into).collect();
        self.publish_once(stream, &selector, payloads).await
    }

    async fn publish_once(
        &self,
        stream: &StreamName,
        selector: &ShardSelector,
        payloads: Vec<Bytes>,
    ) -> Result<Ack, Error> {
        let (shards, owners) = self.layout(stream).await?;
        let shard = self.shard_of(stream, shards, selector);
        let owner = owners.get(shard as usize).copied().unwrap_or(0);
        let c = self.to_node(owner).await?;
        match c
            .publish_batch(stream, ShardSelector::Shard(shard), payloads)
            .await
        {
            Ok(a) => {
                // The ack names the owner: learn it (a relayed publish teaches the way).
                if let Some(o) = a.owner.filter(|&o| o != owner) {
                    let mut m = self.lock();
                    if let Some((_, owners)) = m.streams.get_mut(stream) {
                        if let Some(slot) = owners.get_mut(shard as usize) {
                            *slot = o;
                        }
                    }
                }
                Ok(a)
            }
            Err(e) => {
                if connection_lost(&e) {
                    self.forget_conn(&c);
                    // Replace it now, so the caller's next call does not wait for it.
                    let _ = self.any().await;
                } else if matches!(e.code(), Some(ErrorCode::NotLeader)) {
                    self.lock().streams.remove(stream);
                }
                Err(e)
            }
        }
    }

    /// An acked publish that is resent after a lost connection, an `outcome_unknown` or a
    /// retryable refusal, until acked or `resend_for` passes. **A resend can duplicate**: a
    /// publish whose answer was lost may have been appended, and is appended again.
    pub async fn publish_at_least_once<P: Into<Bytes>>(
        &self,
        stream: &StreamName,
        selector: ShardSelector,
        payloads: Vec<P>,
    ) -> Result<Ack, Error> {
        let payloads: Vec<Bytes> = payloads.into_iter().map(Into::into).collect();
        let mut backoff = Backoff::new(self.cfg.resend_for, Duration::from_millis(20));
        loop {
            match self.publish_once(stream, &selector, payloads.clone()).await {
                Ok(a) => return Ok(a),
                Err(e) => {
                    if !retryable(&e) || !backoff.pause().await {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Cache reads and writes go to the key's shard's owner through any broker: the broker
    /// forwards. The connection used is the first one open.
    pub async fn client(&self) -> Result<Arc<Client>, Error> {
        self.any().await
    }

    /// One subscription per shard, each on its shard's owner, merged into one stream of
    /// events. Order is per shard only. It refuses to open rather than cover some shards.
    /// A shard whose subscription ends (its broker died, the shard moved) is opened again
    /// on its owner from the offset after the last record it delivered, without disturbing
    /// the others; a shard that cannot be opened again within `resend_for` ends with an
    /// `End` event carrying the error.
    pub async fn subscribe_sharded(
        self: &Arc<Self>,
        stream: &StreamName,
        opts: SubscribeOptions,
    ) -> Result<ShardedSubscription, Error> {
        let (shards, _) = self.layout(stream).await?;
        let mut subs = Vec::new();
        for shard in 0..shards {
            subs.push(self.open_shard(stream, shard, opts.clone()).await?);
        }
        let (tx, rx) = mpsc::channel(1024);
        let mut tasks = Vec::new();
        for (shard, sub) in subs.into_iter().enumerate() {
            let me = self.clone();
            let tx = tx.clone();
            let stream = stream.clone();
            let opts = opts.clone();
            tasks.push(tokio::spawn(async move {
                me.pump_shard(stream, shard as u32, sub, opts, tx).await
            }));
        }
        Ok(ShardedSubscription { rx, tasks })
    }

    async fn open_shard(
        &self,
        stream: &StreamName,
        shard: u32,
        opts: SubscribeOptions,
    ) -> Result<crate::Subscription, Error> {
        let (_, owners) = self.layout(stream).await?;
        let owner = owners.get(shard as usize).copied().unwrap_or(0);
        let c = self.to_node(owner).await?;
        match c.subscribe(stream, shard, opts).await {
            Ok(s) => Ok(s),
            Err(e) => {
                if connection_lost(&e) {
                    self.forget_conn(&c);
                } else {
                    self.lock().streams.remove(stream);
                }
                Err(e)
            }
        }
    }

    /// Move one shard's events into the merged stream; reopen it when it ends abnormally.
    async fn pump_shard(
        &self,
        stream: StreamName,
        shard: u32,
        mut sub: crate::Subscription,
        mut opts: SubscribeOptions,
        tx: mpsc::Sender<Event>,
    ) {
        // Where a reopen starts: after the last record delivered, or, before any, where the
        // broker said this subscription starts (a `latest` start must not skip what was
        // published while the shard was being reopened).
        let mut next: Option<u64> = sub.start_offsets.first().map(|&(_, o)| o);
        loop {
            let ended = loop {
                match sub.next().await {
                    Some(Event::End { code: 0, .. }) | None => break None,
                    Some(Event::End { code, message, .. }) => break Some((code, message)),
                    Some(ev) => {
                        if let Event::Records {
                            first_offset,
                            records,
                            ..
                        } = &ev
                        {
                            next = Some(first_offset + records.count() as u64);
                        }
                        if tx.send(ev).await.is_err() {
                            return; // the merged subscription was dropped
                        }
                    }
                }
            };
            // A normal end (unsubscribed) or a closed connection both reopen unless the
            // merged subscription is gone; only a refusal to reopen ends the shard.
            let why = ended.map_or("connection lost".to_string(), |(c, m)| format!("{c} {m}"));
            self.lock().streams.remove(&stream);
            if let Some(n) = next {
                opts.start = StartAt::Offset(n);
            }
            let mut backoff = Backoff::new(self.cfg.resend_for, Duration::from_millis(50));
            sub = loop {
                let e = match self.open_shard(&stream, shard, opts.clone()).await {
                    Ok(s) => {
                        if next.is_none() {
                            next = s.start_offsets.first().map(|&(_, o)| o);
                        }
                        break s;
                    }
                    Err(e) => e,
                };
                tracing::debug!(shard, error = %e, "reopening a shard");
                if !backoff.pause().await {
                    let _ = tx
                        .send(Event::End {
                            shard,
                            code: e.code().map_or(0, |c| c.number()),
                            message: format!("{why}; could not reopen: {e}"),
                        })
                        .await;
                    return;
                }
            };
        }
    }
}

/// Every shard's events of one stream, merged (order per shard only).
pub struct ShardedSubscription {
    rx: mpsc::Receiver<Event>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl ShardedSubscription {
    /// The next event of any shard.
    pub async fn next(&mut self) -> Option<Event> {
        self.rx.recv().await
    }
}

impl Drop for ShardedSubscription {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

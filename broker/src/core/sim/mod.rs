//! The deterministic simulator (test-only). Its unit is one broker: `CORES` cores, each with
//! the real stream shard host (`shard::stream`) and the real subscription host
//! (`conn::subs`), joined by in-memory mesh channels, over the in-memory disk twin
//! (`disk`), on a manual clock. A seeded scheduler picks every next event: which mesh
//! message arrives (each channel stays FIFO, as glommio's are; a core's messages to itself go
//! through its inbox, drained after each step, as in the driver), which client reads its
//! stream, which write or fsync lands, which read or open completes, when the clock moves,
//! and when a scenario acts (publish, subscribe, delete, move, fail, crash, drain).
//!
//! Where it is cut: at what a session hands the core and what the core writes back. Frames
//! are not decoded here and quiche is not run (it reads `Instant::now()` inside, so replays
//! would not repeat); a subscription is opened as `conn::on_subscribe` opens it, and what
//! the hosts write on a stream lands in that client's unread buffer (the stream is writable
//! once the client has read it all, as `queued_bytes == 0` says in the driver).
//!
//! The invariants (`check`) run after every step. A failing run prints its seed;
//! `FELIX_SIM_SEED=N cargo nextest run -p felix-broker sim` replays exactly that run.

mod caches;
mod check;
mod clients;
mod cluster;
pub(in crate::core) mod disk;
mod groups;
mod scenarios;
mod submux;

use crate::catalog::Catalog;
use crate::core::conn::subs::{SubEffect, SubHost};
use crate::core::shard::stream::{Effect, HostCfg, OpenOutcome, StreamHost};
use crate::core::shard::{stream_changes, Ctx, Refused, StreamChange};
use crate::core::{MeshMsg, ShardKey, ToConn, ToOwner};
use crate::metrics::{CoreCounters, Histogram};
use bytes::Bytes;
use disk::{MemLog, Stored};
use felix_quic::wire::{ErrorCode, Frame, QueuePolicy, Records};
use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) const CORES: u8 = 3;

/// How long a held publish may wait in the simulation.
pub(crate) const PUBLISH_TIMEOUT_MS: u64 = 500;

/// The seeds a seeded check runs: `ONE=N` runs seed N alone (a replay), else `MANY` seeds
/// (from the environment, or `default`) starting at `FELIX_SEEDS_FROM` (0): a long search can
/// go on where an earlier one stopped.
pub(crate) fn seeds_from_env(one: &str, many: &str, default: u64) -> Vec<u64> {
    if let Ok(s) = std::env::var(one) {
        return vec![s.parse().unwrap_or_else(|_| panic!("{one} is a number"))];
    }
    let number = |name: &str| {
        std::env::var(name)
            .ok()
            .map(|s| s.parse().unwrap_or_else(|_| panic!("{name} is a number")))
    };
    let n = number(many).unwrap_or(default);
    let from = number("FELIX_SEEDS_FROM").unwrap_or(0);
    (from..from + n).collect()
}

/// SplitMix64: small, fast, and the same sequence for a seed on every machine.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub(crate) fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

struct SimCore {
    streams: StreamHost<MemLog>,
    subs: SubHost,
    caches: crate::core::shard::caches::CacheHost,
    watches: crate::core::conn::watches::WatchHost,
    groups: crate::core::shard::groups::GroupHost<MemLog>,
    inbox: VecDeque<MeshMsg>,
}

/// I/O a core asked for, completed by the scheduler in any order.
enum Io {
    Open {
        core: u8,
        key: ShardKey,
    },
    Read {
        core: u8,
        key: ShardKey,
        log: MemLog,
        to: (u8, u64, u64),
        upto: u64,
    },
    Group(groups::GroupIo),
}

/// What a client read on its subscription (or was answered on its request stream).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Got {
    Batch { first: u64, records: Vec<Bytes> },
    Lag { from: u64, lost: u64 },
    End { code: u16 },
}

/// A subscriber: one connection with one subscription.
pub(crate) struct Client {
    pub core: u8,
    pub key: ShardKey,
    pub policy: QueuePolicy,
    /// Written by the broker and not read yet.
    pub unread: Vec<Got>,
    pub read: Vec<Got>,
    /// Reads nothing while stalled.
    pub stalled: bool,
    /// `SubscribeOk.next_offset`, or the refusal's code.
    pub answer: Option<Result<u64, u16>>,
    /// The broker this client talked to crashed: nothing more is owed to it.
    pub lost: bool,
    /// The broker life it subscribed in.
    pub life: u32,
    /// On its core's mux connection (`submux.rs`).
    pub mux: bool,
}

/// A publish and the answers it got (exactly one is owed).
pub(crate) struct Pub {
    pub key: ShardKey,
    pub payloads: Vec<Bytes>,
    pub answers: Vec<Result<(u64, u32), ErrorCode>>,
    pub lost: bool,
    /// The broker life it was published in.
    pub life: u32,
}

pub(crate) struct World {
    pub rng: Rng,
    epoch: Instant,
    pub now_ms: u64,
    pub catalog: Arc<Catalog>,
    pub counters: CoreCounters,
    cores: Vec<SimCore>,
    /// One FIFO channel per (from, to) pair of distinct cores: `from * CORES + to`.
    mesh: Vec<VecDeque<MeshMsg>>,
    io: Vec<Io>,
    pub disk: BTreeMap<ShardKey, Rc<RefCell<Stored>>>,
    pub clients: BTreeMap<u64, Client>,
    /// Drop_new subscriptions share their core's mux connection (odd seeds).
    pub sub_mux: bool,
    pub mux_conns: BTreeMap<u64, submux::MuxConn>,
    pub pubs: BTreeMap<u64, Pub>,
    /// Cache writes, watch connections and watches (`caches`).
    pub cache_writes: BTreeMap<u64, caches::CacheWrite>,
    pub wconns: BTreeMap<u64, caches::WConn>,
    pub watchers: BTreeMap<u64, caches::Watcher>,
    /// Group files (durable once written), consumers, their requests, and what the group
    /// checker knows of claims (`groups`).
    pub group_files: BTreeMap<(ShardKey, String), Vec<u8>>,
    pub gclients: BTreeMap<u64, groups::GClient>,
    pub greqs: BTreeMap<u64, groups::GReq>,
    pub gclaims: groups::Claims,
    /// The round-robin counters of the connection side's shard choice.
    rr: std::collections::HashMap<u32, u32>,
    next_id: u64,
    /// Broker restarts so far (ephemeral shards start again at offset 0 after one).
    pub life: u32,
    /// The broker is draining: new publishes are refused, logs close once idle.
    pub draining: bool,
    pub steps: u64,
    /// The last events, printed with a failure.
    pub trace: VecDeque<String>,
}

fn host_cfg() -> HostCfg {
    HostCfg {
        cores: CORES as usize,
        // Small rings, so that subscribers fall behind them and catch up from disk.
        ring_records_max: 8,
        ring_bytes_max: 1 << 20,
        publish_timeout_ms: PUBLISH_TIMEOUT_MS,
    }
}

impl World {
    pub(crate) fn new(seed: u64, catalog: Catalog) -> Self {
        let mut w = World {
            rng: Rng::new(seed),
            epoch: Instant::now(),
            now_ms: 0,
            catalog: Arc::new(catalog),
            counters: CoreCounters::default(),
            cores: Vec::new(),
            mesh: (0..CORES as usize * CORES as usize)
                .map(|_| VecDeque::new())
                .collect(),
            io: Vec::new(),
            disk: BTreeMap::new(),
            clients: BTreeMap::new(),
            sub_mux: seed % 2 == 1,
            mux_conns: BTreeMap::new(),
            pubs: BTreeMap::new(),
            cache_writes: BTreeMap::new(),
            wconns: BTreeMap::new(),
            watchers: BTreeMap::new(),
            group_files: BTreeMap::new(),
            gclients: BTreeMap::new(),
            greqs: BTreeMap::new(),
            gclaims: Default::default(),
            rr: Default::default(),
            next_id: 1,
            life: 0,
            draining: false,
            steps: 0,
            trace: VecDeque::new(),
        };
        w.boot();
        w
    }

    /// Start the broker's cores (again, after a crash): empty hosts, durable shards opening.
    fn boot(&mut self) {
        self.cores = (0..CORES)
            .map(|_| SimCore {
                streams: StreamHost::new(host_cfg()),
                subs: SubHost::default(),
                caches: crate::core::shard::caches::CacheHost::new(caches::host_cfg()),
                watches: Default::default(),
                groups: crate::core::shard::groups::GroupHost::new(groups::host_cfg(), self.epoch),
                inbox: VecDeque::new(),
            })
            .collect();
        for c in 0..CORES {
            self.open_placed(c);
        }
    }

    /// Begin opening the durable shards core `c` now owns.
    fn open_placed(&mut self, c: u8) {
        let keys = self.cores[c as usize]
            .streams
            .to_open(&self.catalog, c, CORES);
        for key in keys {
            self.cores[c as usize].streams.begin_open(key);
            self.disk.entry(key).or_default();
            self.io.push(Io::Open { core: c, key });
        }
    }

    pub(crate) fn note(&mut self, s: String) {
        if self.trace.len() == 64 {
            self.trace.pop_front();
        }
        self.trace
            .push_back(format!("[{} @{}ms] {s}", self.steps, self.now_ms));
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// This broker's clock.
    pub(crate) fn now(&self) -> Instant {
        self.epoch + Duration::from_millis(self.now_ms)
    }

    fn ctx(&self, me: u8) -> Ctx<'_> {
        Ctx {
            me,
            cores: CORES,
            now: self.epoch + Duration::from_millis(self.now_ms),
            ts_ms: self.now_ms,
            catalog: &self.catalog,
            counters: &self.counters,
        }
    }

    fn send(&mut self, from: u8, to: u8, msg: MeshMsg) {
        if from == to {
            self.cores[from as usize].inbox.push_back(msg);
        } else {
            self.mesh[from as usize * CORES as usize + to as usize].push_back(msg);
        }
    }

    /// Messages in flight anywhere (mesh channels and inboxes).
    pub(crate) fn in_flight(&self) -> impl Iterator<Item = &MeshMsg> {
        self.mesh
            .iter()
            .flatten()
            .chain(self.cores.iter().flat_map(|c| c.inbox.iter()))
    }

    // ---------- stepping the hosts ----------

    fn with_streams<R>(&mut self, c: u8, f: impl FnOnce(&mut StreamHost<MemLog>, &Ctx) -> R) -> R {
        let mut core = std::mem::replace(
            &mut self.cores[c as usize].streams,
            StreamHost::new(host_cfg()),
        );
        let r = f(&mut core, &self.ctx(c));
        let effects = core.drain_effects();
        self.cores[c as usize].streams = core;
        for e in effects {
            match e {
                Effect::Send(to, msg) => self.send(c, to, msg),
                Effect::Read {
                    key,
                    log,
                    core,
                    sub,
                    from,
                    upto,
                } => self.io.push(Io::Read {
                    core: c,
                    key,
                    log,
                    to: (core, sub, from),
                    upto,
                }),
                Effect::Committed(key) => {
                    if self.cores[c as usize].groups.has(key) {
                        self.with_groups(c, |g, s, ctx| g.records_committed(key, s, ctx));
                    }
                }
                Effect::Requeue(msgs) => self.cores[c as usize].inbox.extend(msgs),
            }
        }
        r
    }

    fn with_subs<R>(
        &mut self,
        c: u8,
        f: impl FnOnce(&mut SubHost, &dyn Fn(u64, u64) -> bool, &Ctx) -> R,
    ) -> R {
        let mut subs = std::mem::take(&mut self.cores[c as usize].subs);
        let (clients, muxes) = (&self.clients, &self.mux_conns);
        // A subscription stream is writable once its client read everything on it.
        let writable = |conn: u64, _qs: u64| {
            if submux::is_mux_conn(conn) {
                return muxes.get(&conn).is_none_or(|m| m.unread.is_empty());
            }
            clients.get(&conn).is_some_and(|cl| cl.unread.is_empty())
        };
        let r = f(&mut subs, &writable, &self.ctx(c));
        let effects = subs.drain_effects();
        self.cores[c as usize].subs = subs;
        for e in effects {
            self.sub_effect(c, e);
        }
        r
    }

    fn sub_effect(&mut self, c: u8, e: SubEffect) {
        match e {
            SubEffect::Route(to, msg) => self.send(c, to, msg),
            // Connection `conn` is client `conn`; its subscription stream is stream `conn`
            // and its request stream is 0.
            SubEffect::Frame(conn, qs, frame) => {
                let frame = wire(&frame);
                // A mux subscription's answers go to its connection: the client is the
                // request's.
                let client = match &frame {
                    Frame::SubscribeOk { request_id, .. } | Frame::Error { request_id, .. }
                        if submux::is_mux_conn(conn) =>
                    {
                        *request_id
                    }
                    _ => conn,
                };
                let Some(cl) = self.clients.get_mut(&client) else {
                    return;
                };
                match frame {
                    Frame::SubscribeOk { next_offset, .. } if qs == 0 => {
                        assert!(cl.answer.is_none(), "one answer per subscribe");
                        cl.answer = Some(Ok(next_offset));
                    }
                    Frame::Error { code, .. } if qs == 0 => {
                        assert!(cl.answer.is_none(), "one answer per subscribe");
                        cl.answer = Some(Err(code));
                    }
                    Frame::Lag { from_offset, lost } => cl.unread.push(Got::Lag {
                        from: from_offset,
                        lost,
                    }),
                    Frame::SubEnd { code, .. } => cl.unread.push(Got::End { code }),
                    other => panic!("unexpected frame on stream {qs}: {other:?}"),
                }
            }
            SubEffect::Batch(conn, _, _, b) => {
                let Some(cl) = self.clients.get_mut(&conn) else {
                    return;
                };
                let records = Records::from_region(b.count, b.region.clone())
                    .expect("a delivered batch decodes")
                    .iter()
                    .collect();
                cl.unread.push(Got::Batch {
                    first: b.first_offset,
                    records,
                });
            }
            e @ (SubEffect::MuxBatch(..) | SubEffect::MuxFrame(..)) => self.on_mux_effect(e),
            SubEffect::Finish(..) | SubEffect::Removed { .. } => {}
        }
    }

    /// Handle one message at core `c`, as the driver's `on_mesh` does for streams.
    fn on_mesh(&mut self, c: u8, msg: MeshMsg) {
        let msg = match msg.waits_for_open() {
            Some(key) => match self.cores[c as usize].streams.defer(key, msg) {
                Some(m) => m,
                None => return,
            },
            None => msg,
        };
        let msg = match msg.into_stream() {
            Ok((key, m)) => return self.with_streams(c, |h, ctx| h.handle(key, m, ctx)),
            Err(m) => m,
        };
        let Some(msg) = self.on_cache_mesh(c, msg) else {
            return;
        };
        let Some(msg) = self.on_group_mesh(c, msg) else {
            return;
        };
        match msg {
            MeshMsg::Conn(ToConn::PublishResult { origin, result }) => {
                let id = origin.request_id;
                let p = self.pubs.get_mut(&id).expect("a publish of the simulation");
                p.answers.push(match result {
                    Ok((_, first, count)) => Ok((first, count)),
                    Err(why) => Err(why.code),
                });
            }
            MeshMsg::Conn(ToConn::Delivery {
                stream,
                shard,
                batch,
            }) => self.with_subs(c, |h, w, ctx| h.on_delivery((stream, shard), batch, w, ctx)),
            MeshMsg::Conn(ToConn::SubsEnded { stream, shard, why }) => {
                self.with_subs(c, |h, _, ctx| h.end_shard((stream, shard), why, ctx))
            }
            MeshMsg::Conn(ToConn::AttachResult { sub, result }) => {
                self.with_subs(c, |h, w, ctx| h.on_attach_result(sub, result, w, ctx))
            }
            MeshMsg::Conn(ToConn::FetchResult { sub, result }) => {
                self.with_subs(c, |h, w, ctx| h.on_fetch_result(sub, result, w, ctx))
            }
            other => panic!(
                "the simulation sends no such message: {}",
                mesh_name(&other)
            ),
        }
    }

    fn drain_inbox(&mut self, c: u8) {
        // Bounded: a handler queues finitely many messages to itself.
        for _ in 0..100_000 {
            let Some(m) = self.cores[c as usize].inbox.pop_front() else {
                return;
            };
            self.on_mesh(c, m);
        }
        panic!("core {c}'s inbox does not drain");
    }

    // ---------- what operators do (clients: `clients.rs`) ----------

    /// A new catalog version reaches every core (the driver's `refresh_catalog`).
    pub(crate) fn set_catalog(&mut self, new: Catalog) {
        let old = std::mem::replace(&mut self.catalog, Arc::new(new));
        self.note(format!(
            "catalog changes: {:?}",
            stream_changes(&old, &self.catalog)
        ));
        for c in 0..CORES {
            for change in stream_changes(&old, &self.catalog) {
                match change {
                    StreamChange::Deleted(idx) => {
                        let slot = self.catalog.slot(idx).clone();
                        let why = Refused::new(
                            ErrorCode::StreamDeleted,
                            format!("stream {} was deleted", slot.def.name()),
                        );
                        for shard in 0..slot.def.shards {
                            let key = (idx, shard);
                            self.with_subs(c, |h, _, ctx| h.end_shard(key, why.clone(), ctx));
                            self.with_groups(c, |g, _, _| g.drop_shard(key, &why));
                            self.with_streams(c, |h, ctx| h.on_deleted(key, &why, ctx));
                        }
                    }
                    StreamChange::Ended(key, why) => {
                        self.with_subs(c, |h, _, ctx| h.end_shard(key, why, ctx))
                    }
                }
            }
            self.open_placed(c);
            self.drain_inbox(c);
        }
    }

    /// The log of `key` fails (a device error).
    pub(crate) fn fail_log(&mut self, key: ShardKey) {
        let Some(st) = self.disk.get(&key) else {
            return;
        };
        if st.borrow().failed.is_some() {
            return;
        }
        st.borrow_mut().failed = Some("injected device error".into());
        self.note(format!("log of {key:?} fails"));
        let owner = self.ctx(0).owner_core(key);
        if self.cores[owner as usize].streams.is_opening(key) {
            return; // the open answers the failure
        }
        self.with_streams(owner, |h, ctx| {
            h.on_failed(key, "injected device error".into(), ctx)
        });
        self.drain_inbox(owner);
    }

    /// The broker crashes and restarts from its disk: a process crash keeps the page cache,
    /// a machine crash only what was fsynced. Every client of the old process is lost.
    pub(crate) fn crash(&mut self, machine: bool) {
        self.note(format!(
            "crash ({})",
            if machine { "machine" } else { "process" }
        ));
        for st in self.disk.values() {
            let mut st = st.borrow_mut();
            if machine {
                st.machine_crash();
            } else {
                st.process_crash();
            }
        }
        for m in &mut self.mesh {
            m.clear();
        }
        self.io.clear();
        for c in self.clients.values_mut() {
            c.lost = true;
        }
        for p in self.pubs.values_mut() {
            if p.answers.is_empty() {
                p.lost = true;
            }
        }
        self.groups_crash();
        // The caches are in memory: they, their watches and what was asked of them go.
        self.cache_writes.clear();
        self.wconns.clear();
        self.watchers.clear();
        self.mux_conns.clear();
        self.life += 1;
        self.draining = false;
        self.boot();
    }

    /// Shutdown's first phase: refuse new publishes, answer those in flight.
    pub(crate) fn begin_drain(&mut self) {
        self.note("drain begins".into());
        self.draining = true;
        for c in &mut self.cores {
            c.groups.set_draining();
        }
    }

    /// Shutdown's second phase: every log closes (flushing and fsyncing what it holds, then
    /// reporting itself closed), and every subscription is ended `shutting_down`.
    pub(crate) fn finish_drain(&mut self) {
        self.note("logs close; subscriptions are told the broker goes away".into());
        for c in 0..CORES {
            self.cores[c as usize].streams.begin_close();
        }
        let keys: Vec<ShardKey> = self.disk.keys().copied().collect();
        for key in keys {
            let acked = {
                let mut st = self.disk[&key].borrow_mut();
                if st.failed.is_some() {
                    continue;
                }
                st.written = st.records.len() as u64;
                st.synced = st.written;
                st.closed = true;
                st.acked()
            };
            let owner = self.ctx(0).owner_core(key);
            self.with_streams(owner, |h, ctx| {
                h.on_acked(key, acked, ctx);
                h.on_failed(key, "log is closed".into(), ctx);
            });
            self.drain_inbox(owner);
        }
        let why = "the broker is shutting down";
        for c in 0..CORES {
            let ids = self.cores[c as usize].subs.ids();
            for sid in ids {
                let end = Some((ErrorCode::ShuttingDown.number(), why.to_string()));
                self.with_subs(c, |h, _, ctx| h.remove(sid, end, ctx));
            }
            self.drain_inbox(c);
        }
    }

    // ---------- the scheduler ----------

    /// One random event. Returns false when nothing at all can happen.
    pub(crate) fn step(&mut self) -> bool {
        self.steps += 1;
        let mut options = self.options();
        if options.is_empty() {
            return false;
        }
        // The clock moves now and then while anything else can happen.
        options.push(4);
        match options[self.rng.below(options.len() as u64) as usize] {
            0 => self.deliver_one(),
            1 => self.client_reads(),
            2 => self.disk_progress(),
            3 => self.complete_io(),
            5 => self.watch_client_reads(),
            6 => self.mux_conn_reads(),
            _ => {
                let ms = 1 + self.rng.below(50);
                self.advance(ms);
            }
        }
        true
    }

    /// Something can happen without the clock moving (a message, a read, disk progress, I/O).
    pub(crate) fn busy(&self) -> bool {
        !self.options().is_empty()
    }

    /// The kinds of event that can happen now, weighted by repetition.
    fn options(&self) -> Vec<u8> {
        let mut options: Vec<u8> = Vec::new();
        if self.mesh.iter().any(|q| !q.is_empty()) {
            options.extend([0, 0, 0]);
        }
        if self.readable().next().is_some() {
            options.extend([1, 1]);
        }
        if self.disk.values().any(|s| {
            let s = s.borrow();
            s.failed.is_none() && (s.written < s.records.len() as u64 || s.synced < s.written)
        }) {
            options.extend([2, 2]);
        }
        if !self.io.is_empty() {
            options.push(3);
        }
        if self.watch_readable().next().is_some() {
            options.extend([5, 5]);
        }
        if self.mux_readable().next().is_some() {
            options.extend([6, 6]);
        }
        options
    }

    fn deliver_one(&mut self) {
        let busy: Vec<usize> = (0..self.mesh.len())
            .filter(|i| !self.mesh[*i].is_empty())
            .collect();
        let i = busy[self.rng.below(busy.len() as u64) as usize];
        let msg = self.mesh[i].pop_front().expect("busy");
        let to = (i % CORES as usize) as u8;
        self.note(format!(
            "core {} -> {to}: {}",
            i / CORES as usize,
            mesh_name(&msg)
        ));
        self.on_mesh(to, msg);
        self.drain_inbox(to);
    }

    fn readable(&self) -> impl Iterator<Item = u64> + '_ {
        self.clients
            .iter()
            .filter(|(_, c)| !c.stalled && !c.lost && !c.unread.is_empty())
            .map(|(id, _)| *id)
    }

    /// A client reads everything on its stream; the stream drains and the core refills it.
    fn client_reads(&mut self) {
        let ids: Vec<u64> = self.readable().collect();
        let sid = ids[self.rng.below(ids.len() as u64) as usize];
        let cl = self.clients.get_mut(&sid).expect("readable");
        let got = std::mem::take(&mut cl.unread);
        cl.read.extend(got);
        let core = cl.core;
        self.with_subs(core, |h, w, ctx| h.pump(sid, w, ctx));
        self.drain_inbox(core);
    }

    /// Some queued records reach the page cache, or the page cache is fsynced; the owner
    /// learns the new commit mark.
    fn disk_progress(&mut self) {
        let keys: Vec<ShardKey> = self
            .disk
            .iter()
            .filter(|(_, s)| {
                let s = s.borrow();
                s.failed.is_none() && (s.written < s.records.len() as u64 || s.synced < s.written)
            })
            .map(|(k, _)| *k)
            .collect();
        let key = keys[self.rng.below(keys.len() as u64) as usize];
        let acked = {
            let mut s = self.disk[&key].borrow_mut();
            let before = s.acked();
            if s.written < s.records.len() as u64 && (s.synced == s.written || self.rng.chance(50))
            {
                // Whole commits reach the page cache: up to a later append's end.
                let written = s.written;
                let later: Vec<u64> = s.bounds.iter().copied().filter(|b| *b > written).collect();
                s.written = later[self.rng.below(later.len() as u64) as usize];
            } else {
                s.synced = s.written;
            }
            (s.acked() > before).then_some(s.acked())
        };
        if let Some(acked) = acked {
            let owner = self.ctx(0).owner_core(key);
            self.note(format!("log of {key:?} commits to {acked}"));
            self.with_streams(owner, |h, ctx| h.on_acked(key, acked, ctx));
            self.drain_inbox(owner);
        }
    }

    fn complete_io(&mut self) {
        let i = self.rng.below(self.io.len() as u64) as usize;
        match self.io.swap_remove(i) {
            Io::Open { core, key } => {
                let st = self.disk.entry(key).or_default().clone();
                let next = st.borrow().records.len() as u64;
                let failed = st.borrow().failed.clone();
                self.note(format!(
                    "log of {key:?} opens at {next} on core {core}: {failed:?}"
                ));
                let r = match failed {
                    None => Ok((MemLog(st), next)),
                    Some(why) => Err(why),
                };
                let out = self.with_streams(core, |h, _| {
                    h.on_opened(key, r, || Arc::new(Histogram::default()))
                });
                match out {
                    OpenOutcome::Unwanted(_) => {
                        self.note(format!("log of {key:?} unwanted (deleted while opening)"))
                    }
                    OpenOutcome::Serving { next_offset } => {
                        self.load_groups(core, key, next_offset)
                    }
                    _ => {}
                }
                self.drain_inbox(core);
            }
            Io::Read {
                core,
                key,
                log,
                to,
                upto,
            } => {
                let want = (crate::core::timers::HISTORY_READ_RECORDS_MAX as u64)
                    .min(upto.saturating_sub(to.2));
                let r = log.read(to.2, want as usize).map(|o| {
                    o.map(|(first, recs)| (first, Records::encode(recs.iter().map(|p| &p[..]))))
                });
                self.with_streams(core, |h, ctx| h.on_read(key, to, r, ctx));
                self.drain_inbox(core);
            }
            Io::Group(g) => self.complete_group_io(g),
        }
    }

    /// The clock moves by `ms`; held publishes past their deadline are answered.
    pub(crate) fn advance(&mut self, ms: u64) {
        self.now_ms += ms;
        for c in 0..CORES {
            self.with_streams(c, |h, ctx| h.tick(ctx));
            self.with_caches(c, |h, ctx| h.tick(ctx));
            let io_idle = !self.io.iter().any(|i| matches!(i, Io::Group(_)));
            self.with_groups(c, |g, s, ctx| g.tick(s, ctx, io_idle));
            self.drain_inbox(c);
        }
    }

    /// Run events until nothing is left to happen, unstalling every client and letting the
    /// clock run out every deadline. Bounded.
    pub(crate) fn quiesce(&mut self) -> Result<(), String> {
        for c in self.clients.values_mut() {
            c.stalled = false;
        }
        for c in self.wconns.values_mut() {
            c.stalled = false;
        }
        for m in self.mux_conns.values_mut() {
            m.stalled = false;
        }
        for _ in 0..20 {
            for _ in 0..100_000 {
                if !self.step() {
                    break;
                }
                check::after_step(self)?;
            }
            let held = self.cores.iter().any(|c| c.streams.held_total() > 0);
            let waits = self.cores.iter().any(|c| !c.groups.idle());
            if !held && !waits && self.io.is_empty() {
                break;
            }
            self.advance(PUBLISH_TIMEOUT_MS);
        }
        check::at_rest(self)
    }
}

/// `f` as a session hands it over: encoded, then decoded from those bytes (the simulation's
/// cut is at frames in and out of a session).
pub(crate) fn wire(f: &Frame) -> Frame {
    let b = f.encode();
    let h: &[u8; felix_quic::wire::HEADER_LEN] = b[..felix_quic::wire::HEADER_LEN]
        .try_into()
        .expect("a frame has a header");
    let (kind, flags, len) = felix_quic::wire::decode_header(h, usize::MAX).expect("a header");
    assert_eq!(
        felix_quic::wire::HEADER_LEN + len,
        b.len(),
        "one whole frame"
    );
    felix_quic::wire::decode_body(kind, flags, b.slice(felix_quic::wire::HEADER_LEN..))
        .expect("what the code encodes decodes")
}

/// A message's name, for the trace.
fn mesh_name(m: &MeshMsg) -> String {
    match m {
        MeshMsg::Owner(ToOwner::Publish(r)) => format!("Publish #{}", r.origin.request_id),
        MeshMsg::Conn(ToConn::PublishResult { origin, result }) => {
            format!(
                "PublishResult #{} {:?}",
                origin.request_id,
                result.as_ref().map_err(|e| e.code)
            )
        }
        MeshMsg::Conn(ToConn::Delivery { batch, .. }) => {
            format!("Delivery {}..{}", batch.first_offset, batch.end())
        }
        MeshMsg::Owner(ToOwner::Attach { sub, .. }) => format!("Attach #{sub}"),
        MeshMsg::Conn(ToConn::AttachResult { sub, result }) => {
            format!("AttachResult #{sub} ok={}", result.is_ok())
        }
        MeshMsg::Owner(ToOwner::Fetch { sub, from, .. }) => format!("Fetch #{sub} from {from}"),
        MeshMsg::Conn(ToConn::FetchResult { sub, .. }) => format!("FetchResult #{sub}"),
        MeshMsg::Owner(ToOwner::Detach { core, .. }) => format!("Detach from core {core}"),
        MeshMsg::Owner(ToOwner::Parked { core, parked, .. }) => {
            format!("Parked core {core} {parked}")
        }
        MeshMsg::Owner(ToOwner::DrainHeld { .. }) => "DrainHeld".into(),
        _ => "other".into(),
    }
}

//! Scenarios, each run over many seeds (`FELIX_SIM_SEEDS`, default 1000, within
//! `FELIX_SIM_BUDGET_S` seconds each, default 60). `FELIX_SIM_SEED=N` runs seed N alone and
//! prints its trace. Copies of what `broker/tests` covers by spawning processes (those tests
//! stay): here every interleaving a seed picks is checked, step by step.

use super::caches::cache_watch_joins_under_concurrent_writers;
use super::groups::group_claims_expire_and_redeliver;
use super::{check, Got, World, CORES, PUBLISH_TIMEOUT_MS};
use crate::catalog::{CacheDef, Catalog, ControlView, StreamDef, ViewPlace, ViewStream};
use crate::core::shard::stream::breaks;
use crate::core::ShardKey;
use crate::metrics::CoreCounters;
use felix_quic::wire::{ErrorCode, QueuePolicy, StartAt};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Slot 0: an ephemeral stream; slot 1: a durable one. Two shards each.
const EPH: u32 = 0;
const DUR: u32 = 1;
const NODE: u64 = 1;

/// A two-shard stream `t/ns/NAME` (the simulations' streams).
pub(super) fn def(name: &str, durable: bool) -> StreamDef {
    StreamDef {
        tenant: "t".into(),
        namespace: "ns".into(),
        stream: name.into(),
        shards: 2,
        durable,
        fsync: None,
        retention_bytes: None,
        retention_seconds: None,
        quorum: false,
    }
}

/// Where each shard of the two streams is: `(owner node, generation)`; `None`: deleted.
type Layout = [Option<[(u64, u64); 2]>; 2];

fn catalog(prev: &Catalog, layout: Layout) -> Catalog {
    let mut view = ControlView {
        revision: 1,
        ..Default::default()
    };
    view.tenants.insert("t".into());
    view.namespaces.insert(("t".into(), "ns".into()));
    view.broker_addrs.insert(2, "127.0.0.1:1".into());
    for (i, (name, durable)) in [("eph", false), ("dur", true)].into_iter().enumerate() {
        let Some(places) = layout[i] else { continue };
        view.streams.push(ViewStream {
            def: def(name, durable),
            incarnation: 1 + i as u64,
            deleting: false,
            placement: places
                .iter()
                .map(|(owner, generation)| ViewPlace::Assigned {
                    owner: *owner,
                    generation: *generation,
                })
                .collect(),
        });
    }
    // Cache slot 0 (`sim::caches`): two in-memory shards, both here.
    view.caches.push(ViewStream {
        def: CacheDef {
            tenant: "t".into(),
            namespace: "ns".into(),
            cache: "kv".into(),
            shards: super::caches::CACHE_SHARDS,
            durable: false,
            default_ttl_ms: None,
        },
        incarnation: 3,
        deleting: false,
        placement: (0..super::caches::CACHE_SHARDS)
            .map(|_| ViewPlace::Assigned {
                owner: NODE,
                generation: 1,
            })
            .collect(),
    });
    Catalog::from_view(prev, &view, NODE, false)
}

const HERE: Option<[(u64, u64); 2]> = Some([(NODE, 1), (NODE, 1)]);

fn base() -> Catalog {
    catalog(&Catalog::default(), [HERE, HERE])
}

impl World {
    /// Up to `n` random events, checking the invariants after each.
    pub(super) fn run(&mut self, n: u64) -> Result<(), String> {
        for _ in 0..n {
            if !self.step() {
                return Ok(());
            }
            check::after_step(self)?;
        }
        Ok(())
    }

    fn any_core(&mut self) -> u8 {
        self.rng.below(CORES as u64) as u8
    }

    fn any_shard(&mut self, stream: u32) -> ShardKey {
        (stream, self.rng.below(2) as u32)
    }

    fn some_publishes(&mut self, stream: u32, n: u64) -> Result<Vec<u64>, String> {
        let mut ids = Vec::new();
        for _ in 0..n {
            let (c, key) = (self.any_core(), self.any_shard(stream));
            let count = 1 + self.rng.below(3) as u32;
            ids.push(self.publish(c, key, count));
            let k = self.rng.below(4);
            self.run(k)?;
        }
        Ok(ids)
    }

    fn answer(&self, id: u64) -> Option<Result<(u64, u32), ErrorCode>> {
        self.pubs[&id].answers.first().copied()
    }
}

// ---------- the scenarios ----------

/// A stream deleted while subscribers attach and publishes are in flight: every attach and
/// publish is answered; after the deletion nothing is appended and subscriptions end
/// `stream_deleted`.
fn stream_deleted_during_attach(w: &mut World) -> Result<(), String> {
    let stream = if w.rng.chance(50) { EPH } else { DUR };
    w.run(20)?; // durable logs may still be opening
    let mut subs = Vec::new();
    for _ in 0..3 {
        let (c, key) = (w.any_core(), w.any_shard(stream));
        subs.push(w.subscribe(c, key, StartAt::Earliest, QueuePolicy::DropNew, 64));
    }
    w.some_publishes(stream, 4)?;
    let k = w.rng.below(10);
    w.run(k)?;
    let layout = if stream == EPH {
        [None, HERE]
    } else {
        [HERE, None]
    };
    let next = catalog(&w.catalog, layout);
    w.set_catalog(next);
    let after = w.some_publishes(stream, 3)?;
    let (c, key) = (w.any_core(), w.any_shard(stream));
    let late = w.subscribe(c, key, StartAt::Latest, QueuePolicy::DropNew, 64);
    w.quiesce()?;
    // Refused by the connection side (the name is gone: unknown_stream) or, in flight at
    // the deletion, by the owner (stream_deleted): the contract broker/tests/controlplane.rs
    // holds the real broker to.
    for id in after {
        let refused = |c| w.answer(id) == Some(Err(c));
        if !refused(ErrorCode::StreamDeleted) && !refused(ErrorCode::UnknownStream) {
            return Err(format!(
                "a publish after the deletion was answered {:?}",
                w.answer(id)
            ));
        }
    }
    let late_answer = w.clients[&late].answer;
    let deleted = [ErrorCode::StreamDeleted, ErrorCode::UnknownStream];
    if !deleted.iter().any(|c| late_answer == Some(Err(c.number()))) {
        return Err(format!(
            "a subscribe after the deletion was not refused stream_deleted or unknown_stream: {late_answer:?}"
        ));
    }
    for sid in subs {
        let ended = w.clients[&sid]
            .read
            .iter()
            .any(|g| matches!(g, Got::End { code } if *code == ErrorCode::StreamDeleted.number()));
        let refused = w.clients[&sid].answer == Some(Err(ErrorCode::StreamDeleted.number()));
        if !ended && !refused {
            return Err(format!("subscription #{sid} was not ended by the deletion"));
        }
    }
    Ok(())
}

/// A placement change (the shard moves to another broker, then comes back at a new
/// generation) ends the subscriptions on it `not_leader`, and publishes to it meanwhile
/// are refused; subscriptions on the other shard go on.
fn placement_change_ends_subscriptions(w: &mut World) -> Result<(), String> {
    w.run(20)?;
    let stream = if w.rng.chance(50) { EPH } else { DUR };
    let moved: ShardKey = (stream, 0);
    let stays: ShardKey = (stream, 1);
    let c_ = w.any_core();
    let a = w.subscribe(c_, moved, StartAt::Earliest, QueuePolicy::DropOld, 64);
    let c_ = w.any_core();
    let b = w.subscribe(c_, stays, StartAt::Earliest, QueuePolicy::DropOld, 64);
    w.some_publishes(stream, 4)?;
    let mut layout = [HERE, HERE];
    layout[stream as usize] = Some([(2, 2), (NODE, 1)]);
    let next = catalog(&w.catalog, layout);
    w.set_catalog(next);
    let refused = w.publish(0, moved, 1);
    w.run(30)?;
    layout[stream as usize] = Some([(NODE, 3), (NODE, 1)]);
    let next = catalog(&w.catalog, layout);
    w.set_catalog(next);
    w.some_publishes(stream, 3)?;
    w.quiesce()?;
    if w.answer(refused) != Some(Err(ErrorCode::NotLeader)) {
        return Err(format!(
            "a publish to a moved shard was answered {:?}",
            w.answer(refused)
        ));
    }
    let ended = |sid: u64| {
        w.clients[&sid]
            .read
            .iter()
            .any(|g| matches!(g, Got::End { .. }))
            || w.clients[&sid].answer.is_some_and(|a| a.is_err())
    };
    if !ended(a) {
        return Err("the moved shard's subscription was not ended".into());
    }
    if ended(b) {
        return Err("the other shard's subscription was ended".into());
    }
    Ok(())
}

/// Block holding under a stalled subscriber: publishes wait while its queue is full, the
/// ones past the deadline are refused `publish_timeout` (never appended), and the rest are
/// appended once it reads.
fn block_holds_under_stalled_subscriber(w: &mut World) -> Result<(), String> {
    w.run(20)?;
    let stream = if w.rng.chance(50) { EPH } else { DUR };
    let key = w.any_shard(stream);
    let c = w.any_core();
    let blocked = w.subscribe(c, key, StartAt::Latest, QueuePolicy::Block, 2);
    let c_ = w.any_core();
    let other = w.subscribe(c_, key, StartAt::Latest, QueuePolicy::DropNew, 2);
    w.run(10)?;
    w.set_stalled(blocked, true);
    for round in 0..3 {
        for _ in 0..4 {
            let c = w.any_core();
            let count = 1 + w.rng.below(2) as u32;
            w.publish(c, key, count);
            let k = w.rng.below(5);
            w.run(k)?;
        }
        w.run(50)?;
        let ms = w.rng.below(PUBLISH_TIMEOUT_MS);
        w.advance(ms);
        if round == 1 && w.rng.chance(50) {
            w.set_stalled(blocked, false);
            w.run(30)?;
            w.set_stalled(blocked, true);
        }
    }
    if w.rng.chance(30) {
        w.unsubscribe(blocked); // removing a parked subscriber releases the hold
    }
    w.set_stalled(other, false);
    w.quiesce()
}

/// The subscription mux: drop_new subscribers of one core share its mux connection (some
/// from the start, some from now, with small and large queues, some unsubscribing), the
/// connection reads in fits and starts, and several shards publish: each subscriber still
/// sees its log in order with every gap one exact lag notice, though one frame names many of
/// them.
fn mux_subscribers_share_frames(w: &mut World) -> Result<(), String> {
    w.sub_mux = true;
    w.run(20)?;
    let stream = if w.rng.chance(50) { EPH } else { DUR };
    let c = w.any_core();
    let mut subs = Vec::new();
    for _ in 0..(3 + w.rng.below(4)) {
        let key = w.any_shard(stream);
        let start = if w.rng.chance(50) {
            StartAt::Earliest
        } else {
            StartAt::Latest
        };
        let bound = if w.rng.chance(50) {
            1 + w.rng.below(3)
        } else {
            64
        };
        subs.push(w.subscribe(c, key, start, QueuePolicy::DropNew, bound));
    }
    for _ in 0..12 {
        let sid = subs[w.rng.below(subs.len() as u64) as usize];
        let stall = w.rng.chance(50);
        w.set_stalled(sid, stall);
        let n = 1 + w.rng.below(3);
        w.some_publishes(stream, n)?;
        if w.rng.chance(10) {
            let sid = subs.remove(w.rng.below(subs.len() as u64) as usize);
            w.unsubscribe(sid);
            if subs.is_empty() {
                break;
            }
        }
        let k = w.rng.below(8);
        w.run(k)?;
    }
    w.quiesce()
}

/// drop_new and drop_old subscribers with small queues, reading in fits and starts: each gap
/// is one exact lag notice (the checker), and publishers are never held.
fn drop_policies_announce_every_gap(w: &mut World) -> Result<(), String> {
    w.run(20)?;
    let stream = if w.rng.chance(50) { EPH } else { DUR };
    let key = w.any_shard(stream);
    let mut subs = Vec::new();
    for policy in [
        QueuePolicy::DropNew,
        QueuePolicy::DropOld,
        QueuePolicy::DropNew,
    ] {
        let c = w.any_core();
        let bound = 1 + w.rng.below(3);
        subs.push(w.subscribe(c, key, StartAt::Earliest, policy, bound));
    }
    let mut ids = Vec::new();
    for _ in 0..12 {
        for sid in &subs {
            let stall = w.rng.chance(60);
            w.set_stalled(*sid, stall);
        }
        let c = w.any_core();
        let count = 1 + w.rng.below(3) as u32;
        ids.push(w.publish(c, key, count));
        let k = w.rng.below(8);
        w.run(k)?;
    }
    w.quiesce()?;
    for id in ids {
        if !matches!(w.answer(id), Some(Ok(_))) {
            return Err(format!(
                "publish #{id} with only drop subscribers was answered {:?}",
                w.answer(id)
            ));
        }
    }
    Ok(())
}

/// Publishes and subscribes that reach a durable shard while its log is still opening wait
/// for the open and are then handled in arrival order.
fn durable_open_defers_requests(w: &mut World) -> Result<(), String> {
    // No step yet: every durable log is still opening.
    let mut ids = Vec::new();
    let mut subs = Vec::new();
    for _ in 0..5 {
        let (c, key) = (w.any_core(), w.any_shard(DUR));
        if w.rng.chance(40) {
            subs.push(w.subscribe(c, key, StartAt::Earliest, QueuePolicy::DropOld, 16));
        } else {
            let n_ = 1 + w.rng.below(3) as u32;
            ids.push(w.publish(c, key, n_));
        }
        let k = w.rng.below(3);
        w.run(k)?;
    }
    w.quiesce()?;
    for id in ids {
        if !matches!(w.answer(id), Some(Ok(_))) {
            return Err(format!(
                "a publish deferred by the open was answered {:?}",
                w.answer(id)
            ));
        }
    }
    for sid in subs {
        if !matches!(w.clients[&sid].answer, Some(Ok(0))) {
            return Err(format!(
                "a subscribe deferred by the open got {:?}",
                w.clients[&sid].answer
            ));
        }
    }
    Ok(())
}

/// A subscriber from the start of a durable shard whose history is longer than the ring
/// catches up from the log, one chunk at a time, while publishes go on, and goes live with
/// no gap and no duplicate.
fn durable_subscriber_catches_up(w: &mut World) -> Result<(), String> {
    let key = w.any_shard(DUR);
    for _ in 0..12 {
        let c = w.any_core();
        let n_ = 1 + w.rng.below(3) as u32;
        w.publish(c, key, n_);
        let k = w.rng.below(6);
        w.run(k)?;
    }
    w.run(200)?;
    let c = w.any_core();
    let start = if w.rng.chance(50) {
        StartAt::Earliest
    } else {
        StartAt::Offset(w.rng.below(4))
    };
    let n_ = 1 + w.rng.below(4);
    let sid = w.subscribe(c, key, start, QueuePolicy::Block, n_);
    for _ in 0..8 {
        let c = w.any_core();
        let n_ = 1 + w.rng.below(3) as u32;
        w.publish(c, key, n_);
        let k = w.rng.below(6);
        w.run(k)?;
    }
    w.quiesce()?;
    if w.clients[&sid]
        .read
        .iter()
        .any(|g| matches!(g, Got::End { .. }))
    {
        return Err("the catching-up subscriber was ended".into());
    }
    Ok(())
}

/// The log of a durable shard fails under publishes: what waited for a commit is refused
/// `unavailable` (never acknowledged), later publishes and attaches are refused too, and the
/// other shard goes on.
fn storage_failure_refuses_pending(w: &mut World) -> Result<(), String> {
    let key = w.any_shard(DUR);
    let c_ = w.any_core();
    let sid = w.subscribe(c_, key, StartAt::Earliest, QueuePolicy::DropOld, 64);
    w.some_publishes(DUR, 6)?;
    let k = w.rng.below(20);
    w.run(k)?;
    w.fail_log(key);
    let c_ = w.any_core();
    let after = w.publish(c_, key, 1);
    let c_ = w.any_core();
    let late = w.subscribe(c_, key, StartAt::Earliest, QueuePolicy::DropOld, 64);
    w.some_publishes(DUR, 3)?;
    w.quiesce()?;
    if w.answer(after) != Some(Err(ErrorCode::Unavailable)) {
        return Err(format!(
            "a publish to a failed shard was answered {:?}",
            w.answer(after)
        ));
    }
    let answered = w.clients[&late].answer;
    let refused = answered == Some(Err(ErrorCode::Unavailable.number()));
    // The open may not have finished before the failure: then the subscribe waited and was
    // refused the same way once the log failed... or the log failed before it opened (no
    // log yet), and the failure is reported when it opens.
    if !refused && answered.is_some_and(|a| a.is_ok()) && w.disk[&key].borrow().failed.is_some() {
        return Err(format!(
            "a subscribe to a failed shard was answered {answered:?}"
        ));
    }
    let _ = sid;
    Ok(())
}

/// Shutdown with publishes and subscriptions on every core: new publishes are refused
/// `shutting_down`, those in flight are answered, the logs close, and every subscription is
/// ended `shutting_down`.
fn drain_across_cores(w: &mut World) -> Result<(), String> {
    w.run(20)?;
    let mut subs = Vec::new();
    for _ in 0..3 {
        let stream = if w.rng.chance(50) { EPH } else { DUR };
        let (c, key) = (w.any_core(), w.any_shard(stream));
        subs.push(w.subscribe(c, key, StartAt::Earliest, QueuePolicy::DropOld, 64));
    }
    for _ in 0..8 {
        let stream = if w.rng.chance(50) { EPH } else { DUR };
        let (c, key) = (w.any_core(), w.any_shard(stream));
        let n_ = 1 + w.rng.below(2) as u32;
        w.publish(c, key, n_);
        let k = w.rng.below(5);
        w.run(k)?;
    }
    w.begin_drain();
    let refused = w.publish(0, (EPH, 0), 1);
    w.quiesce()?;
    w.finish_drain();
    w.quiesce()?;
    if w.answer(refused) != Some(Err(ErrorCode::ShuttingDown)) {
        return Err("a publish during the drain was not refused shutting_down".into());
    }
    for sid in subs {
        let c = &w.clients[&sid];
        let ended = c
            .read
            .iter()
            .any(|g| matches!(g, Got::End { code } if *code == ErrorCode::ShuttingDown.number()));
        if c.answer.is_some_and(|a| a.is_ok()) && !ended {
            return Err(format!(
                "subscription #{sid} was not told the broker shuts down"
            ));
        }
    }
    Ok(())
}

/// The broker crashes (process or machine) under durable publishes and restarts from its
/// disk: every acknowledged record is still there at its offset (the checker), and new
/// publishes continue the offsets.
fn crash_and_restart_keeps_acknowledged(w: &mut World) -> Result<(), String> {
    w.some_publishes(DUR, 6)?;
    let k = w.rng.below(40);
    w.run(k)?;
    let machine = w.rng.chance(50);
    w.crash(machine);
    let key = w.any_shard(DUR);
    let c_ = w.any_core();
    let sid = w.subscribe(c_, key, StartAt::Earliest, QueuePolicy::Block, 4);
    w.some_publishes(DUR, 4)?;
    w.quiesce()?;
    if !matches!(w.clients[&sid].answer, Some(Ok(0))) {
        return Err(format!(
            "a subscribe after the restart got {:?}",
            w.clients[&sid].answer
        ));
    }
    Ok(())
}

/// Everything at once: a random mix of publishes, subscribes (every policy, bound and start),
/// unsubscribes, stalls, clock jumps, a device error, a crash, placement moves and a stream
/// delete, interleaved with random events. The checkers watch every step.
fn everything_at_once(w: &mut World) -> Result<(), String> {
    let mut generation = 1u64;
    let (mut failed, mut crashed, mut deleted) = (false, false, false);
    let mut layout = [HERE, HERE];
    for _ in 0..60 {
        let roll = w.rng.below(100);
        let stream = if w.rng.chance(50) { EPH } else { DUR };
        let (c, key) = (w.any_core(), w.any_shard(stream));
        match roll {
            0..=29 => {
                let n = 1 + w.rng.below(3) as u32;
                w.publish(c, key, n);
            }
            30..=41 => {
                let policy = [
                    QueuePolicy::DropNew,
                    QueuePolicy::DropOld,
                    QueuePolicy::Block,
                ][w.rng.below(3) as usize];
                let start = match w.rng.below(3) {
                    0 => StartAt::Latest,
                    1 => StartAt::Earliest,
                    _ => StartAt::Offset(w.rng.below(6)),
                };
                let bound = 1 + w.rng.below(8);
                w.subscribe(c, key, start, policy, bound);
            }
            42..=49 => {
                let live: Vec<u64> = w
                    .clients
                    .iter()
                    .filter(|(_, cl)| !cl.lost && cl.answer.is_some_and(|a| a.is_ok()))
                    .map(|(id, _)| *id)
                    .collect();
                if !live.is_empty() {
                    let sid = live[w.rng.below(live.len() as u64) as usize];
                    w.unsubscribe(sid);
                }
            }
            50..=64 => {
                let ids: Vec<u64> = w.clients.keys().copied().collect();
                if !ids.is_empty() {
                    let sid = ids[w.rng.below(ids.len() as u64) as usize];
                    let stall = w.rng.chance(50);
                    w.set_stalled(sid, stall);
                }
            }
            65..=74 => {
                let ms = w.rng.below(PUBLISH_TIMEOUT_MS);
                w.advance(ms);
            }
            75..=77 if !failed => {
                failed = true;
                let k = w.any_shard(DUR);
                w.fail_log(k);
            }
            78..=80 if !crashed => {
                crashed = true;
                let machine = w.rng.chance(50);
                w.crash(machine);
            }
            81..=83 => {
                // Move a shard away, or back, at a new generation.
                generation += 1;
                let i = stream as usize;
                if let Some(mut places) = layout[i] {
                    let s = key.1 as usize;
                    places[s] = if places[s].0 == NODE {
                        (2, generation)
                    } else {
                        (NODE, generation)
                    };
                    layout[i] = Some(places);
                    let next = catalog(&w.catalog, layout);
                    w.set_catalog(next);
                }
            }
            84 if !deleted => {
                deleted = true;
                layout[stream as usize] = None;
                let next = catalog(&w.catalog, layout);
                w.set_catalog(next);
            }
            _ => {}
        }
        let k = w.rng.below(12);
        w.run(k)?;
    }
    w.quiesce()
}

// ---------- the seed loop ----------

type Scenario = fn(&mut World) -> Result<(), String>;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// Run `scenario` over the seeds, then to rest; a violation or a panic names the seed and
/// the command that replays it.
fn seeds(name: &str, scenario: Scenario) -> CoreCounters {
    let totals = CoreCounters::default();
    let one = env_u64("FELIX_SIM_SEED");
    let (first, count) = match one {
        Some(s) => (s, 1),
        None => (0, env_u64("FELIX_SIM_SEEDS").unwrap_or(1000)),
    };
    let budget = Duration::from_secs(env_u64("FELIX_SIM_BUDGET_S").unwrap_or(60));
    let started = Instant::now();
    let mut ran = 0u64;
    for seed in first..first + count {
        if started.elapsed() > budget {
            eprintln!("{name}: time budget reached after {ran} of {count} seeds");
            break;
        }
        let mut w = World::new(seed, base());
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            scenario(&mut w).and_then(|_| w.quiesce())
        }));
        let replay = format!(
            "replay: FELIX_SIM_SEED={seed} cargo nextest run -p felix-broker sim::scenarios::run::{name}"
        );
        let trace = || w.trace.iter().cloned().collect::<Vec<_>>().join("\n");
        match r {
            Ok(Ok(())) => {
                if one.is_some() {
                    eprintln!("{name} seed {seed}: {} steps\n{}", w.steps, trace());
                }
            }
            Ok(Err(v)) => panic!(
                "{name}: seed {seed} violates {v}\nlast events:\n{}\n{replay}",
                trace()
            ),
            Err(p) => {
                eprintln!(
                    "{name}: seed {seed} panicked\nlast events:\n{}\n{replay}",
                    trace()
                );
                std::panic::resume_unwind(p);
            }
        }
        ran += 1;
        add_counters(&totals, &w.counters);
    }
    assert!(ran > 0, "{name}: no seed ran");
    eprintln!("{name}: {ran} seeds passed in {:?}", started.elapsed());
    totals
}

/// Sum the counters the coverage checks read.
fn add_counters(to: &CoreCounters, from: &CoreCounters) {
    use std::sync::atomic::Ordering::Relaxed;
    macro_rules! add {
        ($($f:ident),*) => {
            $( to.$f.fetch_add(from.$f.load(Relaxed), Relaxed); )*
        };
    }
    add!(
        subscriptions_closed,
        publishes_held,
        publish_timeouts,
        lag_notices,
        records_dropped_new,
        records_dropped_old,
        durable_commits,
        history_reads,
        history_records_read,
        durable_shards_failed,
        durable_publishes_refused,
        cache_writes,
        cache_watches_opened,
        cache_watches_lagged,
        cache_watch_events,
        group_claims,
        group_redeliveries,
        group_acks,
        group_dead_letters,
        group_stale_answers,
        group_writes
    );
}

/// The first seed of `FELIX_SIM_SEEDS` (default 1000) at which `scenario` fails, if any.
pub(super) fn first_failing_seed(scenario: Scenario, seeds_max: u64) -> Option<(u64, String)> {
    for seed in 0..seeds_max {
        let mut w = World::new(seed, base());
        if let Err(v) = scenario(&mut w).and_then(|_| w.quiesce()) {
            return Some((seed, v));
        }
    }
    None
}

/// What a scenario must have exercised over its seeds, by the core counters its runs bumped
/// (a scenario that never reaches its case would pass for nothing).
macro_rules! scenarios {
    ($($name:ident => [$($counter:ident),*]),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                let totals = seeds(stringify!($name), super::$name);
                $(
                    let n = totals.$counter.load(std::sync::atomic::Ordering::Relaxed);
                    assert!(n > 0, "{}: no seed exercised {}", stringify!($name), stringify!($counter));
                )*
            }
        )*
    };
}

mod run {
    use super::seeds;
    scenarios!(
        stream_deleted_during_attach => [subscriptions_closed],
        placement_change_ends_subscriptions => [subscriptions_closed],
        block_holds_under_stalled_subscriber => [publishes_held, publish_timeouts],
        drop_policies_announce_every_gap => [lag_notices, records_dropped_new, records_dropped_old],
        durable_open_defers_requests => [durable_commits],
        durable_subscriber_catches_up => [history_reads, history_records_read],
        storage_failure_refuses_pending => [durable_shards_failed, durable_publishes_refused],
        drain_across_cores => [durable_commits, subscriptions_closed],
        crash_and_restart_keeps_acknowledged => [history_reads],
        everything_at_once => [publishes_held, lag_notices, history_reads, durable_shards_failed],
        cache_watch_joins_under_concurrent_writers => [cache_writes, cache_watches_opened, cache_watches_lagged, cache_watch_events],
        group_claims_expire_and_redeliver => [group_claims, group_redeliveries, group_acks, group_dead_letters, group_stale_answers, group_writes],
        mux_subscribers_share_frames => [lag_notices, records_dropped_new, subscriptions_closed],
    );
}

/// A negative twin: with `switch` on, the simulator must catch the broken rule within the CI
/// seed budget, and name the invariant that guards it (the checker can fail).
fn negative_twin(switch: &AtomicBool, scenario: Scenario, invariant: &str) {
    switch.store(true, Ordering::Relaxed);
    let found = first_failing_seed(scenario, 1000);
    switch.store(false, Ordering::Relaxed);
    let (seed, why) =
        found.unwrap_or_else(|| panic!("{invariant}: the break went unnoticed over 1000 seeds"));
    eprintln!("caught at seed {seed}: {why}");
    assert!(why.contains(invariant), "seed {seed}: {why}");
}

#[test]
fn negative_twin_skipped_lag_notice_is_caught() {
    negative_twin(
        &crate::fanout::BREAK_SKIP_LAG_NOTICE,
        drop_policies_announce_every_gap,
        "subscriber_sees_log_in_order",
    );
}

#[test]
fn negative_twin_mux_frame_naming_only_its_lead_is_caught() {
    negative_twin(
        &crate::core::conn::subs::breaks::MUX_NAMES_ONLY_LEAD,
        mux_subscribers_share_frames,
        "subscriber_sees_log_in_order",
    );
}

#[test]
fn negative_twin_ack_before_commit_is_caught() {
    negative_twin(
        &breaks::ACK_BEFORE_COMMIT,
        crash_and_restart_keeps_acknowledged,
        "acked_in_log",
    );
}

#[test]
fn negative_twin_silent_storage_failure_is_caught() {
    negative_twin(
        &breaks::SILENT_FAILURE,
        storage_failure_refuses_pending,
        "live_subscriber_complete",
    );
}

#[test]
fn negative_twin_ignored_unpark_is_caught() {
    negative_twin(
        &breaks::IGNORE_UNPARK,
        block_holds_under_stalled_subscriber,
        "block_held_only_while_full",
    );
}

#[test]
fn negative_twin_gap_at_watch_join_is_caught() {
    negative_twin(
        &crate::core::shard::caches::breaks::GAP_AT_JOIN,
        cache_watch_joins_under_concurrent_writers,
        "watcher_changes_exact",
    );
}

#[test]
fn negative_twin_claim_lapsing_early_is_caught() {
    negative_twin(
        &crate::group::BREAK_LAPSE_EARLY,
        group_claims_expire_and_redeliver,
        "claim_held_once",
    );
}

#[test]
fn negative_twin_state_phase_missing_a_value_is_caught() {
    negative_twin(
        &crate::core::shard::caches::breaks::STATE_DROPS_ONE,
        cache_watch_joins_under_concurrent_writers,
        "watcher_state_exact",
    );
}

#[test]
fn negative_twin_ack_answered_before_its_write_is_caught() {
    negative_twin(
        &crate::core::shard::groups::breaks::ACK_NOT_WRITTEN,
        group_claims_expire_and_redeliver,
        "acked_stays_acked",
    );
}

#[test]
fn negative_twin_claim_with_another_records_payload_is_caught() {
    negative_twin(
        &crate::core::shard::groups::breaks::PAYLOAD_SHIFTED,
        group_claims_expire_and_redeliver,
        "claim_is_the_log",
    );
}

/// A batch taken by more subscriptions of one connection than a frame may name leaves in
/// frames of at most `SUB_MUX_IDS_MAX` ids, and every subscription gets it (docs/protocol.md,
/// "Subscription mux").
#[test]
fn a_mux_frame_names_at_most_its_bound_of_subscriptions() {
    use crate::core::conn::subs::SUB_MUX_IDS_MAX;
    // Steps without the per-step checks (4,000 subscribers make them slow; the scenarios run
    // them), then the at-rest check.
    fn settle(w: &mut World) {
        for _ in 0..1_000_000 {
            if !w.step() {
                return;
            }
        }
        panic!("never at rest");
    }
    let mut w = World::new(1, base());
    w.sub_mux = true;
    settle(&mut w);
    let key = (EPH, 0);
    let subs: Vec<u64> = (0..SUB_MUX_IDS_MAX + 10)
        .map(|_| w.subscribe(0, key, StartAt::Latest, QueuePolicy::DropNew, 64))
        .collect();
    settle(&mut w);
    // The connection reads nothing: one frame is written, then the stream is full.
    w.set_stalled(subs[0], true);
    w.publish(1, key, 1);
    settle(&mut w);
    let frames = &w.mux_conns[&super::submux::mux_conn(0)].unread;
    assert_eq!(
        frames.len(),
        1,
        "one frame while the connection reads nothing"
    );
    assert_eq!(frames[0].0.len(), SUB_MUX_IDS_MAX);
    w.set_stalled(subs[0], false);
    settle(&mut w);
    check::at_rest(&w).unwrap();
    for sid in subs {
        let got = &w.clients[&sid].read;
        assert!(
            got.iter().any(|g| matches!(g, Got::Batch { .. })),
            "#{sid}: {got:?}"
        );
    }
}

/// A seed replays exactly: the same events in the same order (what `FELIX_SIM_SEED` relies
/// on). Hash maps the hosts iterate use fixed hashing for this.
#[test]
fn a_seed_replays_exactly() {
    for (i, scenario) in [
        stream_deleted_during_attach as Scenario,
        block_holds_under_stalled_subscriber,
        drop_policies_announce_every_gap,
        durable_subscriber_catches_up,
        drain_across_cores,
        crash_and_restart_keeps_acknowledged,
        cache_watch_joins_under_concurrent_writers,
        group_claims_expire_and_redeliver,
        mux_subscribers_share_frames,
    ]
    .into_iter()
    .enumerate()
    {
        for seed in [3, 77, 901] {
            let run = || {
                let mut w = World::new(seed, base());
                scenario(&mut w).and_then(|_| w.quiesce()).expect("passes");
                (w.steps, w.trace.clone(), w.pubs.len(), w.clients.len())
            };
            assert_eq!(run(), run(), "scenario {i} seed {seed} does not replay");
        }
    }
}

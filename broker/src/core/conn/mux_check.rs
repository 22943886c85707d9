//! A seeded check of the watch host's mux (pure: no socket, no clock read by the host): two
//! connections, watches opening (with or without a state phase) with small bounds, changes
//! of two keys, stalls and openings of each connection's stream, unwatches and a shard end,
//! in an order a seed picks. Everything written on each connection's mux stream is decoded,
//! and each watch's frames are held to its contract:
//! - `state_first`: its retained events and `CacheStateDone` come first, if it asked for them;
//! - `changes_exact`: its changes are exactly the matching changes from its `live_from`, in
//!   order, none missing or repeated, up to its end's `resume_from` (all of them if it did not
//!   end), and a lag end names the first matching change it did not get;
//! - `end_last`: at most one end, and nothing after it.
//!
//! `FELIX_MUX_SEED=N` runs seed N alone; `FELIX_MUX_SEEDS` sets how many (default 500).
//! The negative twin turns on `breaks::MUX_END_FIRST` and shows the check catches it.

use super::*;
use crate::catalog::Catalog;
use crate::core::caches::{Ev, Opened, WatchReq};
use felix_quic::wire::cache::encode_event;
use felix_quic::wire::{decode_body, decode_header, EventKind, WatchStart};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

const CONNS: [ConnKey; 2] = [11, 22];
/// The mux stream of each connection (any server-opened uni stream id).
const MUX_QS: u64 = 3;
const WATCHES_MAX: usize = 12;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What a run covered: watches by how they ended, and state phases.
#[derive(Default, Debug)]
struct Covered {
    lagged: usize,
    unwatched: usize,
    shard_ended: usize,
    live: usize,
    state_phases: usize,
}

/// What the test knows of a watch it opened.
struct Opening {
    conn: ConnKey,
    filter: Filter,
    live_from: u64,
    state: Option<u64>,
}

struct Run {
    host: WatchHost,
    catalog: Catalog,
    counters: CoreCounters,
    now: Instant,
    /// Bytes each connection's room allows per step (None: the connection is gone).
    room: RefCell<HashMap<ConnKey, usize>>,
    wire: HashMap<ConnKey, Vec<u8>>,
    /// Every change: (offset, key).
    log: Vec<(u64, Bytes)>,
    values: HashMap<Bytes, u64>,
    /// By watch id (ordered: a seed's choices must not depend on hashing).
    opened: BTreeMap<u64, Opening>,
    next_wid: u64,
}

impl Run {
    fn new() -> Run {
        let catalog =
            Catalog::from_yaml("caches:\n  - {tenant: t, namespace: n, cache: c, shards: 1}\n")
                .expect("a valid catalog");
        Run {
            host: WatchHost::default(),
            catalog,
            counters: CoreCounters::default(),
            now: Instant::now(),
            room: RefCell::new(CONNS.iter().map(|c| (*c, 1 << 20)).collect()),
            wire: HashMap::new(),
            log: Vec::new(),
            values: HashMap::new(),
            opened: BTreeMap::new(),
            next_wid: 1,
        }
    }

    /// Step the host with a context and the connections' room, then take its effects.
    fn step<R>(&mut self, f: impl FnOnce(&mut WatchHost, Room, &Ctx) -> R) -> Result<R, String> {
        let ctx = Ctx {
            me: 0,
            cores: 1,
            now: self.now,
            ts_ms: 0,
            catalog: &self.catalog,
            counters: &self.counters,
        };
        let rooms = &self.room;
        let room = |c: ConnKey, _qs: u64| rooms.borrow().get(&c).copied();
        let r = f(&mut self.host, &room, &ctx);
        for e in self.host.drain_effects() {
            match e {
                WatchEffect::Bytes(conn, qs, b) => {
                    assert_eq!(qs, MUX_QS, "mux watches write on the mux stream");
                    self.wire.entry(conn).or_default().extend_from_slice(&b);
                }
                WatchEffect::Route(..) | WatchEffect::Frame(..) | WatchEffect::Removed { .. } => {}
                WatchEffect::Finish(..) => return Err("end_last: a mux stream was finished".into()),
                WatchEffect::Refuse { .. } => return Err("an opened watch was refused".into()),
            }
        }
        Ok(r)
    }

    fn open(&mut self, rng: &mut Rng) -> Result<(), String> {
        let conn = CONNS[rng.below(2) as usize];
        let wid = self.next_wid;
        self.next_wid += 1;
        let filter = if rng.below(3) == 0 {
            Filter::Prefix(Bytes::new())
        } else {
            Filter::Key(Bytes::from_static(b"k"))
        };
        let events_max = 1 + rng.below(6) as usize;
        let live_from = self.log.last().map_or(1, |(o, _)| o + 1);
        let w = Watch {
            conn,
            quic_stream: None,
            cache: 0,
            shard: 0,
            filter: filter.clone(),
            request_id: wid,
            reply_stream: 0,
            live_from: None,
            state: VecDeque::new(),
            queue: WatchQueue::new(events_max, 1 << 30),
            frames: VecDeque::new(),
            end: None,
            resume_at: 0,
            mux: true,
        };
        let req = WatchReq {
            core: 0,
            watch: wid,
            cache: 0,
            shard: 0,
            filter: filter.clone(),
            start: WatchStart::Latest,
            events_max: events_max as u32,
            bytes_max: 1 << 30,
        };
        self.step(|h, _, ctx| h.open(wid, w, req, ctx))?;
        // Half of them start from current state: the current value of each matching key.
        let state = (rng.below(2) == 0).then(|| {
            let mut keys: Vec<_> = self
                .values
                .iter()
                .filter(|(k, _)| filter.matches(k))
                .collect();
            keys.sort();
            let frames: Vec<Bytes> = keys
                .iter()
                .map(|(k, v)| encode_event(EventKind::Retained, **v, (*k).clone(), 0, Bytes::new()))
                .collect();
            let done = Frame::Cache(CacheFrame::CacheStateDone {
                count: frames.len() as u64,
                snapshot: false,
                live_from,
            })
            .encode();
            (frames, done)
        });
        let count = state.as_ref().map(|(f, _)| f.len() as u64);
        let opened = Opened {
            shard: 0,
            live_from,
            resume_from: live_from,
            state,
            replay: Vec::new(),
            truncated_at: None,
        };
        self.step(|h, room, ctx| h.on_opened(wid, Ok(opened), Some(Ok(MUX_QS)), room, ctx))?;
        self.opened.insert(
            wid,
            Opening {
                conn,
                filter,
                live_from,
                state: count,
            },
        );
        Ok(())
    }

    fn change(&mut self, rng: &mut Rng) -> Result<(), String> {
        let offset = self.log.last().map_or(1, |(o, _)| o + 1);
        let key = Bytes::from_static(if rng.below(5) == 0 { b"x" } else { b"k" });
        let frame = encode_event(
            EventKind::Put,
            offset,
            key.clone(),
            0,
            Bytes::from_static(b"v"),
        );
        self.log.push((offset, key.clone()));
        self.values.insert(key.clone(), offset);
        let ev = Arc::new(Ev { offset, key, frame });
        self.step(|h, room, ctx| h.on_change((0, 0), ev, room, ctx))
    }

    fn scenario(&mut self, seed: u64) -> Result<Covered, String> {
        let mut rng = Rng(seed);
        let mut ended_shard = false;
        for _ in 0..300 {
            match rng.below(20) {
                0..=6 => self.change(&mut rng)?,
                7..=9 if self.host.len() < WATCHES_MAX => self.open(&mut rng)?,
                10 => {
                    let live: Vec<u64> = self.opened.keys().copied().collect();
                    if let Some(&wid) = live.get(rng.below(live.len().max(1) as u64) as usize) {
                        let conn = self.opened[&wid].conn;
                        self.step(|h, room, ctx| h.unwatch(conn, wid, room, ctx))?;
                    }
                }
                11 if !ended_shard && rng.below(10) == 0 => {
                    ended_shard = true;
                    let why = Refused::new(ErrorCode::NotLeader, "moved");
                    self.step(|h, room, ctx| h.end_shard((0, 0), why, room, ctx))?;
                }
                _ => {
                    // A connection stalls, or opens a little or wide, and its stream is pumped.
                    let conn = CONNS[rng.below(2) as usize];
                    let bytes = [0, 0, 200, 3000, 1 << 20][rng.below(5) as usize];
                    self.room.borrow_mut().insert(conn, bytes);
                    self.step(|h, room, ctx| h.pump_mux(conn, room, ctx))?;
                }
            }
        }
        // Everything opens: all that was queued goes out (bounded).
        for c in CONNS {
            self.room.borrow_mut().insert(c, 1 << 30);
            for _ in 0..100 {
                if !self.step(|h, room, ctx| h.pump_mux(c, room, ctx))? {
                    break;
                }
            }
        }
        self.check()
    }

    /// Each watch's frames, decoded from its connection's stream, in order.
    fn frames(&self) -> HashMap<u64, Vec<CacheFrame>> {
        let mut by_watch: HashMap<u64, Vec<CacheFrame>> = HashMap::new();
        for bytes in self.wire.values() {
            let mut at = 0;
            while at < bytes.len() {
                let h: &[u8; HEADER_LEN] = bytes[at..at + HEADER_LEN].try_into().unwrap();
                let (kind, flags, len) = decode_header(h, usize::MAX).expect("a header");
                let body = Bytes::copy_from_slice(&bytes[at + HEADER_LEN..at + HEADER_LEN + len]);
                at += HEADER_LEN + len;
                let Ok(Frame::Cache(CacheFrame::CacheMux { watch_ids, frame })) =
                    decode_body(kind, flags, body)
                else {
                    panic!("only CacheMux frames on a mux stream");
                };
                for id in watch_ids {
                    by_watch.entry(id).or_default().push((*frame).clone());
                }
            }
        }
        by_watch
    }

    /// Check every watch; returns what the run covered.
    fn check(&self) -> Result<Covered, String> {
        let mut seen = Covered::default();
        let mut frames = self.frames();
        for (wid, o) in &self.opened {
            let fs = frames.remove(wid).unwrap_or_default();
            let mut it = fs.into_iter().peekable();
            if let Some(count) = o.state {
                for i in 0..count {
                    match it.next() {
                        Some(CacheFrame::CacheEvent {
                            kind: EventKind::Retained,
                            ..
                        }) => {}
                        other => {
                            return Err(format!("state_first: watch {wid} item {i}: {other:?}"))
                        }
                    }
                }
                match it.next() {
                    Some(CacheFrame::CacheStateDone { .. }) => {}
                    other => {
                        return Err(format!("state_first: watch {wid} no StateDone: {other:?}"))
                    }
                }
            }
            let mut got = Vec::new();
            let mut end = None;
            for f in it {
                if end.is_some() {
                    return Err(format!("end_last: watch {wid} got {f:?} after its end"));
                }
                match f {
                    CacheFrame::CacheEvent {
                        kind: EventKind::Put,
                        offset,
                        ..
                    } => got.push(offset),
                    CacheFrame::CacheWatchEnd {
                        code, resume_from, ..
                    } => end = Some((code, resume_from)),
                    other => return Err(format!("changes_exact: watch {wid} got {other:?}")),
                }
            }
            let matching: Vec<u64> = self
                .log
                .iter()
                .filter(|(off, k)| *off >= o.live_from && o.filter.matches(k))
                .map(|(off, _)| *off)
                .collect();
            let want: Vec<u64> = match end {
                Some((_, resume)) => matching.iter().copied().filter(|x| *x < resume).collect(),
                None => matching.clone(),
            };
            if got != want {
                return Err(format!(
                    "changes_exact: watch {wid} (from {}, end {end:?}) got {got:?}, want {want:?}",
                    o.live_from
                ));
            }
            seen.state_phases += usize::from(o.state.is_some());
            match end {
                Some((0, _)) => seen.unwatched += 1,
                Some((c, _)) if c == ErrorCode::WatchLagged.number() => seen.lagged += 1,
                Some(_) => seen.shard_ended += 1,
                None => seen.live += 1,
            }
            if let Some((code, resume)) = end {
                if code == ErrorCode::WatchLagged.number() && !matching.contains(&resume) {
                    return Err(format!(
                        "changes_exact: watch {wid} lagged at {resume}, not a change it matched"
                    ));
                }
            }
        }
        Ok(seen)
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// The first of `seeds` at which the check fails, else what they covered together.
fn run_seeds(seeds: std::ops::Range<u64>) -> Result<Covered, (u64, String)> {
    let mut all = Covered::default();
    for seed in seeds {
        let c = Run::new().scenario(seed).map_err(|why| (seed, why))?;
        all.lagged += c.lagged;
        all.unwatched += c.unwatched;
        all.shard_ended += c.shard_ended;
        all.live += c.live;
        all.state_phases += c.state_phases;
    }
    Ok(all)
}

#[test]
fn mux_watches_keep_each_watch_contract() {
    let seeds = match env_u64("FELIX_MUX_SEED") {
        Some(s) => s..s + 1,
        None => 0..env_u64("FELIX_MUX_SEEDS").unwrap_or(500),
    };
    let many = seeds.end - seeds.start > 100;
    match run_seeds(seeds) {
        Err((seed, why)) => panic!(
            "seed {seed}: {why}\nreplay: FELIX_MUX_SEED={seed} cargo nextest run -p felix-broker mux_check"
        ),
        Ok(c) if many => {
            eprintln!("covered: {c:?}");
            // The seeds reach every way a watch ends, and state phases.
            assert!(
                c.lagged > 0 && c.unwatched > 0 && c.shard_ended > 0 && c.live > 0,
                "{c:?}"
            );
            assert!(c.state_phases > 0, "{c:?}");
        }
        Ok(_) => {}
    }
}

/// Run the seeds with `switch` on: the check must fail, naming `invariant`.
fn negative_twin(switch: &std::sync::atomic::AtomicBool, invariant: &str) {
    use std::sync::atomic::Ordering;
    switch.store(true, Ordering::Relaxed);
    let found = run_seeds(0..500);
    switch.store(false, Ordering::Relaxed);
    let (seed, why) = found.expect_err("the break went unnoticed over 500 seeds");
    eprintln!("caught at seed {seed}: {why}");
    assert!(why.starts_with(invariant), "{why}");
}

#[test]
fn the_mux_check_fails_when_an_end_overtakes_its_changes() {
    negative_twin(&breaks::MUX_END_FIRST, "end_last");
}

#[test]
fn the_mux_check_fails_when_a_lag_end_names_the_wrong_resume_point() {
    negative_twin(&breaks::MUX_RESUME_PAST_LAG, "changes_exact");
}

#[test]
fn the_mux_check_fails_when_a_state_phase_ends_before_its_values() {
    negative_twin(&breaks::MUX_STATE_DONE_FIRST, "state_first");
}

//! Caches in the simulator: each core runs the real owner-side host (`shard::caches`) and the
//! real watch host (`conn::watches`), joined by the same mesh as the stream hosts. Writers
//! put and delete (with conditions) from any core; watchers open key and prefix watches from
//! any core, with or without a state phase, by resume offset, on their own streams or on a
//! connection's mux stream, with small bounds; connections stall and read.
//!
//! Cut as the stream side is: requests enter as the connection side routes them (no frame
//! decoding of requests, no quiche). What the watch host writes on a stream lands in that
//! stream's unread bytes; a stream takes at most `STREAM_ROOM_BYTES` unread (flow control).
//!
//! INVARIANTS (at rest, `check_at_rest`):
//! - `cache_answered_once`: every write and every watch request gets exactly one answer.
//! - `cache_offsets_contiguous`: the acknowledged writes of a shard have contiguous offsets
//!   (a refused write takes none).
//! - `watcher_state_exact`: a state phase is exactly the shard's acknowledged history folded
//!   up to the watch's `live_from` (keys, versions, values), then `CacheStateDone`.
//! - `watcher_changes_exact`: the changes a watch got are exactly the history's matching
//!   changes from its start, in order, with their keys and values, up to its end's
//!   `resume_from` (all of them if it did not end); a lag end names a matching change.
//! - `watcher_end_last`: nothing follows a watch's end; a refused watch got nothing.

use super::World;
use crate::cache::{CacheLimits, Filter};
use crate::core::conn::checks;
use crate::core::conn::watches::{StreamOpened, Watch, WatchEffect, WatchHost};
use crate::core::shard::caches::{CacheEffect, CacheHost, CacheHostCfg};
use crate::core::shard::Ctx;
use crate::core::{CacheOrigin, MeshMsg, ShardKey, ToConn, ToOwner, WatchReq};
use bytes::Bytes;
use felix_quic::wire::{
    decode_body, decode_header, CacheFrame, ErrorCode, EventKind, Frame, StreamName, WatchFilter,
    WatchStart, WriteCond, HEADER_LEN,
};
use std::collections::BTreeMap;

/// The cache of the simulations' catalog (slot 0): two in-memory shards.
pub(crate) const CACHE: u32 = 0;
pub(crate) const CACHE_SHARDS: u32 = 2;

/// Unread bytes a watch stream takes before its pump stops.
const STREAM_ROOM_BYTES: usize = 240;

pub(super) fn host_cfg() -> CacheHostCfg {
    CacheHostCfg {
        limits: CacheLimits {
            key_bytes_max: 64,
            value_bytes_max: 1024,
            entries_max: 1000,
            bytes_max: 1 << 20,
        },
        counters_max: 1000,
        // A small ring, so that resumes fall below it (and get a marked snapshot).
        replay_entries_max: 6,
        replay_bytes_max: 1 << 20,
        expire_batch_bytes_max: 1 << 20,
        compact_every: u64::MAX,
        durable_dir: false,
    }
}

pub(crate) fn cache_name() -> StreamName {
    StreamName::new("t", "ns", "kv")
}

/// A write and its answers (exactly one is owed).
pub(crate) struct CacheWrite {
    pub key: ShardKey,
    pub k: Bytes,
    /// `Some(value)` for a put, `None` for a delete.
    pub value: Option<Bytes>,
    pub answers: Vec<Frame>,
}

/// A watch connection's stream.
#[derive(Default)]
pub(crate) struct WStream {
    pub unread: Vec<u8>,
    pub read: Vec<u8>,
    /// The watch it carries (None: the connection's mux stream).
    pub watch: Option<u64>,
    pub finished: bool,
}

/// A connection holding watches.
pub(crate) struct WConn {
    pub core: u8,
    pub mux: bool,
    pub stalled: bool,
    pub streams: BTreeMap<u64, WStream>,
}

/// A watch request and what it was answered.
pub(crate) struct Watcher {
    pub conn: u64,
    pub key: ShardKey,
    pub filter: Filter,
    pub start: WatchStart,
    /// `CacheWatchOk.live_from`, or the refusal's code.
    pub answers: Vec<Result<u64, u16>>,
}

impl World {
    pub(super) fn with_caches<R>(&mut self, c: u8, f: impl FnOnce(&mut CacheHost, &Ctx) -> R) -> R {
        let mut host = std::mem::replace(
            &mut self.cores[c as usize].caches,
            CacheHost::new(host_cfg()),
        );
        let r = f(&mut host, &self.ctx(c));
        let effects = host.drain_effects();
        self.cores[c as usize].caches = host;
        for e in effects {
            match e {
                CacheEffect::Send(to, msg) => self.send(c, to, msg),
                _ => panic!("the simulation's caches are in memory: no log I/O"),
            }
        }
        r
    }

    pub(super) fn with_watches<R>(
        &mut self,
        c: u8,
        f: impl FnOnce(&mut WatchHost, &dyn Fn(u64, u64) -> Option<usize>, &Ctx) -> R,
    ) -> R {
        let mut host = std::mem::take(&mut self.cores[c as usize].watches);
        let conns = &self.wconns;
        let room = |conn: u64, qs: u64| {
            let s = conns.get(&conn)?.streams.get(&qs)?;
            Some(STREAM_ROOM_BYTES.saturating_sub(s.unread.len()))
        };
        let r = f(&mut host, &room, &self.ctx(c));
        let effects = host.drain_effects();
        self.cores[c as usize].watches = host;
        for e in effects {
            self.watch_effect(c, e);
        }
        r
    }

    fn watch_effect(&mut self, c: u8, e: WatchEffect) {
        fn stream(w: &mut World, conn: u64, qs: u64) -> Option<&mut Vec<u8>> {
            let s = w.wconns.get_mut(&conn)?.streams.get_mut(&qs)?;
            assert!(
                !s.finished,
                "watcher_end_last: written after the stream's end"
            );
            Some(&mut s.unread)
        }
        match e {
            WatchEffect::Route(to, msg) => self.send(c, to, msg),
            // The request stream of every watch is stream 0; its request id is its watch id.
            WatchEffect::Frame(
                _,
                0,
                Frame::Cache(CacheFrame::CacheWatchOk {
                    request_id,
                    live_from,
                    ..
                }),
            ) => {
                self.watchers
                    .get_mut(&request_id)
                    .expect("a watch of the simulation")
                    .answers
                    .push(Ok(live_from));
            }
            WatchEffect::Frame(conn, qs, f) => {
                assert_ne!(qs, 0, "only CacheWatchOk goes on a request stream");
                if let Some(u) = stream(self, conn, qs) {
                    u.extend_from_slice(&f.encode());
                }
            }
            WatchEffect::Bytes(conn, qs, b) => {
                if let Some(u) = stream(self, conn, qs) {
                    u.extend_from_slice(&b);
                }
            }
            WatchEffect::Finish(conn, qs) => {
                if let Some(s) = self
                    .wconns
                    .get_mut(&conn)
                    .and_then(|cn| cn.streams.get_mut(&qs))
                {
                    s.finished = true;
                }
            }
            WatchEffect::Refuse {
                request_id, why, ..
            } => {
                self.watchers
                    .get_mut(&request_id)
                    .expect("a watch of the simulation")
                    .answers
                    .push(Err(why.code.number()));
            }
            WatchEffect::Removed { .. } => {}
        }
    }

    /// A cache message at core `c` (the driver's `on_mesh` arms for caches), or the message
    /// back if it is none.
    pub(super) fn on_cache_mesh(&mut self, c: u8, msg: MeshMsg) -> Option<MeshMsg> {
        match msg {
            MeshMsg::Owner(ToOwner::CacheReq {
                origin,
                cache,
                shard,
                frame,
            }) => self.with_caches(c, |h, ctx| h.on_req(origin, cache, shard, frame, ctx)),
            MeshMsg::Owner(ToOwner::WatchOpen(req)) => {
                self.with_caches(c, |h, ctx| h.watch_open(req, ctx))
            }
            MeshMsg::Owner(ToOwner::WatchClose {
                watch,
                cache,
                shard,
            }) => self.cores[c as usize]
                .caches
                .watch_close(watch, (cache, shard)),
            MeshMsg::Conn(ToConn::CacheReply { origin, frame }) => {
                let w = self
                    .cache_writes
                    .get_mut(&origin.request_id)
                    .expect("a write of the simulation");
                w.answers.push(super::wire(&frame));
            }
            MeshMsg::Conn(ToConn::WatchOpened { watch, result }) => {
                let stream = match (&result, self.cores[c as usize].watches.get(watch)) {
                    (Ok(_), Some(w)) => Some(self.open_stream(c, w.conn, w.mux, watch)),
                    _ => None,
                };
                self.with_watches(c, |h, room, ctx| {
                    h.on_opened(watch, result, stream, room, ctx)
                })
            }
            MeshMsg::Conn(ToConn::CacheChange { cache, shard, ev }) => {
                self.with_watches(c, |h, room, ctx| h.on_change((cache, shard), ev, room, ctx))
            }
            MeshMsg::Conn(ToConn::WatchesEnded { cache, shard, why }) => self
                .with_watches(c, |h, room, ctx| {
                    h.end_shard((cache, shard), why, room, ctx)
                }),
            other => return Some(other),
        }
        None
    }

    /// The stream an accepted watch is written on: the connection's mux stream (opened with
    /// its first watch) or a new stream of its own (as `caches/watch.rs` opens them).
    fn open_stream(&mut self, c: u8, conn: u64, mux: bool, wid: u64) -> StreamOpened {
        if mux {
            if let Some(qs) = self.cores[c as usize].watches.mux_stream(conn) {
                return Ok(qs);
            }
        }
        let qs = self.id();
        let cn = self.wconns.get_mut(&conn).ok_or(None)?;
        cn.streams.insert(
            qs,
            WStream {
                watch: (!mux).then_some(wid),
                ..Default::default()
            },
        );
        Ok(qs)
    }

    // ---------- what writers and watchers do ----------

    /// A client on core `core` puts `value` at `k` (or deletes `k` when `value` is None)
    /// under `cond`; returns the write's id.
    pub(crate) fn cache_write(
        &mut self,
        core: u8,
        k: &[u8],
        value: Option<Bytes>,
        cond: WriteCond,
    ) -> u64 {
        let id = self.id();
        let k = Bytes::copy_from_slice(k);
        let shard = felix_quic::wire::hash::shard_for_key(&k, CACHE_SHARDS);
        let key = (CACHE, shard);
        self.note(format!(
            "cache write #{id} on core {core}: {:?} {:?} {cond:?}",
            k, value
        ));
        let frame = match &value {
            Some(v) => CacheFrame::CachePut {
                request_id: id,
                cache: cache_name(),
                key: k.clone(),
                value: v.clone(),
                ttl_ms: 0,
                cond,
            },
            None => CacheFrame::CacheDelete {
                request_id: id,
                cache: cache_name(),
                key: k.clone(),
                cond,
            },
        };
        self.cache_writes.insert(
            id,
            CacheWrite {
                key,
                k,
                value,
                answers: Vec::new(),
            },
        );
        let origin = CacheOrigin {
            core,
            conn: id,
            quic_stream: 0,
            request_id: id,
        };
        // As a session hands it over: the frame through the wire, the connection side's checks.
        let Frame::Cache(frame) = super::wire(&Frame::Cache(frame)) else {
            unreachable!("a cache frame decodes as one")
        };
        let (cache, shard) = match checks::cache_target(&self.catalog, &frame, 64, false) {
            Ok((c, Some(s))) => (c, s),
            Ok((_, None)) => unreachable!("writes name a shard"),
            Err(why) => {
                let w = self.cache_writes.get_mut(&id).expect("inserted");
                w.answers.push(why.frame(id));
                return id;
            }
        };
        assert_eq!((cache, shard), key, "the key's shard");
        let owner = self.ctx(core).cache_owner_core(key);
        let msg = MeshMsg::Owner(ToOwner::CacheReq {
            origin,
            cache,
            shard,
            frame,
        });
        self.send(core, owner, msg);
        self.drain_inbox(core);
        id
    }

    /// A watch connection on core `core` (`mux`: its watches share one stream).
    pub(crate) fn watch_conn(&mut self, core: u8, mux: bool) -> u64 {
        let id = self.id();
        self.wconns.insert(
            id,
            WConn {
                core,
                mux,
                stalled: false,
                streams: BTreeMap::new(),
            },
        );
        id
    }

    /// Connection `conn` watches `filter` on shard `shard` from `start`, queueing at most
    /// `events_max` events; returns the watch's id.
    pub(crate) fn watch(
        &mut self,
        conn: u64,
        shard: u32,
        filter: Filter,
        start: WatchStart,
        events_max: u32,
    ) -> u64 {
        let wid = self.id();
        let (core, mux) = (self.wconns[&conn].core, self.wconns[&conn].mux);
        self.note(format!(
            "watch #{wid} on conn {conn} (core {core}, mux {mux}): shard {shard} {filter:?} from {start:?}, bound {events_max}"
        ));
        let bytes_max = 1 << 20;
        let wire_filter = match &filter {
            Filter::Key(k) => WatchFilter::Key(k.clone()),
            Filter::Prefix(p) => WatchFilter::Prefix {
                prefix: p.clone(),
                shard,
            },
        };
        let asked = super::wire(&Frame::Cache(CacheFrame::CacheWatch {
            request_id: wid,
            cache: cache_name(),
            filter: wire_filter,
            start,
            queue_events_max: events_max,
            queue_bytes_max: bytes_max,
        }));
        self.watchers.insert(
            wid,
            Watcher {
                conn,
                key: (CACHE, shard),
                filter: filter.clone(),
                start,
                answers: Vec::new(),
            },
        );
        let Frame::Cache(asked) = asked else {
            unreachable!("a watch decodes as one")
        };
        let shard = match checks::cache_target(&self.catalog, &asked, 64, false) {
            Ok((_, Some(s))) => s,
            Ok((_, None)) => unreachable!("a watch names a shard"),
            Err(why) => {
                let wt = self.watchers.get_mut(&wid).expect("inserted");
                wt.answers.push(Err(why.code.number()));
                return wid;
            }
        };
        let CacheFrame::CacheWatch {
            filter: asked_filter,
            start,
            queue_events_max: events_max,
            queue_bytes_max: bytes_max,
            ..
        } = asked
        else {
            unreachable!("matched above")
        };
        let req = WatchReq {
            core,
            watch: wid,
            cache: CACHE,
            shard,
            filter: crate::core::caches::filter_of(&asked_filter),
            start,
            events_max,
            bytes_max,
        };
        let w = Watch::new(conn, &req, wid, 0, mux);
        self.with_watches(core, |h, _, ctx| h.open(wid, w, req, ctx));
        self.drain_inbox(core);
        wid
    }

    /// The client ends an accepted watch (`Unsubscribe` naming it).
    pub(crate) fn unwatch(&mut self, wid: u64) {
        let conn = self.watchers[&wid].conn;
        let core = self.wconns[&conn].core;
        self.note(format!("unwatch #{wid}"));
        self.with_watches(core, |h, room, ctx| h.unwatch(conn, wid, room, ctx));
        self.drain_inbox(core);
    }

    pub(crate) fn stall_watch_conn(&mut self, conn: u64, stalled: bool) {
        if let Some(c) = self.wconns.get_mut(&conn) {
            c.stalled = stalled;
        }
    }

    /// Watch connections with unread bytes that read.
    pub(super) fn watch_readable(&self) -> impl Iterator<Item = u64> + '_ {
        self.wconns
            .iter()
            .filter(|(_, c)| !c.stalled && c.streams.values().any(|s| !s.unread.is_empty()))
            .map(|(id, _)| *id)
    }

    /// A watch connection reads everything on its streams; the core refills them.
    pub(super) fn watch_client_reads(&mut self) {
        let ids: Vec<u64> = self.watch_readable().collect();
        let conn = ids[self.rng.below(ids.len() as u64) as usize];
        let cn = self.wconns.get_mut(&conn).expect("readable");
        let mut pumps = Vec::new();
        for (qs, s) in cn.streams.iter_mut() {
            if !s.unread.is_empty() {
                let b = std::mem::take(&mut s.unread);
                s.read.extend_from_slice(&b);
                pumps.push((*qs, s.watch));
            }
        }
        let core = cn.core;
        for (_, watch) in pumps {
            match watch {
                Some(wid) => self.with_watches(core, |h, room, ctx| h.pump(wid, room, ctx)),
                None => {
                    self.with_watches(core, |h, room, ctx| h.pump_mux(conn, room, ctx));
                }
            }
        }
        self.drain_inbox(core);
    }
}

// ---------- the invariants ----------

/// The acknowledged history of each shard: offset → (key, value; None for a delete).
type History = BTreeMap<ShardKey, BTreeMap<u64, (Bytes, Option<Bytes>)>>;

fn history(w: &World) -> Result<History, String> {
    let mut h: History = BTreeMap::new();
    for (id, wr) in &w.cache_writes {
        if wr.answers.len() != 1 {
            return Err(format!(
                "cache_answered_once: write #{id} got {} answers",
                wr.answers.len()
            ));
        }
        let offset = match (&wr.answers[0], &wr.value) {
            (Frame::Cache(CacheFrame::CacheWritten { version, .. }), Some(_)) => *version,
            (Frame::Cache(CacheFrame::CacheValue { change_offset, .. }), None) => *change_offset,
            (Frame::Error { .. }, _) => continue,
            (other, _) => return Err(format!("cache_answered_once: write #{id} got {other:?}")),
        };
        let m = h.entry(wr.key).or_default();
        if m.insert(offset, (wr.k.clone(), wr.value.clone())).is_some() {
            return Err(format!(
                "cache_offsets_contiguous: offset {offset} of {:?} acknowledged twice",
                wr.key
            ));
        }
    }
    for (key, m) in &h {
        let (first, last) = (m.keys().next(), m.keys().last());
        if let (Some(a), Some(b)) = (first, last) {
            if b - a + 1 != m.len() as u64 {
                return Err(format!(
                    "cache_offsets_contiguous: {key:?} acknowledged {} writes over {a}..={b}",
                    m.len()
                ));
            }
        }
    }
    Ok(h)
}

/// The frames each watch got, in order, from its own stream or its connection's mux.
fn frames_by_watch(w: &World) -> BTreeMap<u64, Vec<CacheFrame>> {
    let mut out: BTreeMap<u64, Vec<CacheFrame>> = BTreeMap::new();
    for cn in w.wconns.values() {
        for s in cn.streams.values() {
            assert!(s.unread.is_empty(), "at rest every stream was read");
            let mut at = 0;
            let b = &s.read;
            while at < b.len() {
                let h: &[u8; HEADER_LEN] = b[at..at + HEADER_LEN].try_into().expect("a header");
                let (kind, flags, len) = decode_header(h, usize::MAX).expect("a header");
                let body = Bytes::copy_from_slice(&b[at + HEADER_LEN..at + HEADER_LEN + len]);
                at += HEADER_LEN + len;
                match (decode_body(kind, flags, body).expect("a frame"), s.watch) {
                    (Frame::Cache(CacheFrame::CacheMux { watch_ids, frame }), None) => {
                        for id in watch_ids {
                            out.entry(id).or_default().push((*frame).clone());
                        }
                    }
                    (Frame::Cache(f), Some(wid)) => out.entry(wid).or_default().push(f),
                    (other, _) => panic!("unexpected frame on a watch stream: {other:?}"),
                }
            }
        }
    }
    out
}

/// Every invariant of the caches, once the run is at rest.
pub(super) fn check_at_rest(w: &World) -> Result<(), String> {
    let h = history(w)?;
    let mut frames = frames_by_watch(w);
    for (wid, wt) in &w.watchers {
        let got = frames.remove(wid).unwrap_or_default();
        let live_from = match wt.answers.as_slice() {
            [Ok(lf)] => *lf,
            [Err(_)] if got.is_empty() => continue,
            [Err(_)] => return Err(format!("watcher_end_last: refused watch #{wid} got frames")),
            other => {
                return Err(format!(
                    "cache_answered_once: watch #{wid} answered {other:?}"
                ))
            }
        };
        let empty = BTreeMap::new();
        check_watch(*wid, wt, live_from, h.get(&wt.key).unwrap_or(&empty), got)?;
    }
    Ok(())
}

fn check_watch(
    wid: u64,
    wt: &Watcher,
    live_from: u64,
    hist: &BTreeMap<u64, (Bytes, Option<Bytes>)>,
    got: Vec<CacheFrame>,
) -> Result<(), String> {
    let mut it = got.into_iter().peekable();
    // The state phase, if it has one.
    let mut snapshot = false;
    let wants_state = matches!(wt.start, WatchStart::Current)
        || matches!(wt.start, WatchStart::Offset(_))
            && matches!(
                it.peek(),
                Some(CacheFrame::CacheEvent {
                    kind: EventKind::Retained,
                    ..
                }) | Some(CacheFrame::CacheStateDone { .. })
            );
    if wants_state {
        snapshot = check_state(wid, wt, live_from, hist, &mut it)?;
    }
    let from = match wt.start {
        WatchStart::Offset(x) if !snapshot => x,
        _ => live_from,
    };
    let matching: Vec<u64> = hist
        .range(from..)
        .filter(|(_, (k, _))| wt.filter.matches(k))
        .map(|(o, _)| *o)
        .collect();
    let mut changes = Vec::new();
    let mut end = None;
    for f in it {
        if end.is_some() {
            return Err(format!(
                "watcher_end_last: watch #{wid} got {f:?} after its end"
            ));
        }
        match f {
            CacheFrame::CacheEvent {
                kind,
                offset,
                key,
                value,
                ..
            } if kind != EventKind::Retained => {
                let Some((k, v)) = hist.get(&offset) else {
                    return Err(format!(
                        "watcher_changes_exact: watch #{wid} got offset {offset}, not in the history"
                    ));
                };
                let same = *k == key
                    && match (kind, v) {
                        (EventKind::Put, Some(v)) => *v == value,
                        (EventKind::Delete, None) => true,
                        _ => false,
                    };
                if !same {
                    return Err(format!("watcher_changes_exact: watch #{wid} offset {offset} is {kind:?} {key:?}, the history says {k:?} {v:?}"));
                }
                changes.push(offset);
            }
            CacheFrame::CacheWatchEnd {
                code, resume_from, ..
            } => end = Some((code, resume_from)),
            other => {
                return Err(format!(
                    "watcher_changes_exact: watch #{wid} got {other:?} among its changes"
                ))
            }
        }
    }
    let want: Vec<u64> = match end {
        Some((_, r)) => matching.iter().copied().filter(|o| *o < r).collect(),
        None => matching.clone(),
    };
    if changes != want {
        return Err(format!(
            "watcher_changes_exact: watch #{wid} ({:?} from {from}, end {end:?}) got {changes:?}, the history's matching changes are {want:?}",
            wt.filter
        ));
    }
    if let Some((code, r)) = end {
        if code == ErrorCode::WatchLagged.number() && !matching.contains(&r) {
            return Err(format!(
                "watcher_changes_exact: watch #{wid} lagged at {r}, not a change it matched"
            ));
        }
    }
    Ok(())
}

/// INVARIANT `watcher_state_exact`: the state phase a watch got (consumed from `it`) is the
/// history folded up to its `live_from`; returns whether it was a marked snapshot.
fn check_state(
    wid: u64,
    wt: &Watcher,
    live_from: u64,
    hist: &BTreeMap<u64, (Bytes, Option<Bytes>)>,
    it: &mut std::iter::Peekable<std::vec::IntoIter<CacheFrame>>,
) -> Result<bool, String> {
    let snapshot;
    let mut retained = BTreeMap::new();
    loop {
        match it.next() {
            Some(CacheFrame::CacheEvent {
                kind: EventKind::Retained,
                offset,
                key,
                value,
                ..
            }) => {
                retained.insert(key, (offset, value));
            }
            Some(CacheFrame::CacheStateDone {
                count,
                snapshot: s,
                live_from: lf,
            }) => {
                snapshot = s;
                if count != retained.len() as u64 || lf != live_from {
                    return Err(format!("watcher_state_exact: watch #{wid} StateDone count {count} live_from {lf}, got {} values, live_from {live_from}", retained.len()));
                }
                break;
            }
            other => {
                return Err(format!(
                    "watcher_state_exact: watch #{wid} state phase holds {other:?}"
                ))
            }
        }
    }
    let mut want = BTreeMap::new();
    for (off, (k, v)) in hist.range(..live_from) {
        match v {
            Some(v) => want.insert(k.clone(), (*off, v.clone())),
            None => want.remove(k),
        };
    }
    want.retain(|k, _| wt.filter.matches(k));
    if retained != want {
        return Err(format!(
            "watcher_state_exact: watch #{wid} at {live_from} got {retained:?}, the history says {want:?}"
        ));
    }
    // A current-state start is no snapshot; a resume's state phase is one (below the ring).
    if snapshot != matches!(wt.start, WatchStart::Offset(_)) {
        return Err(format!(
            "watcher_state_exact: watch #{wid} from {:?} has a state phase marked snapshot={snapshot}",
            wt.start
        ));
    }
    Ok(snapshot)
}

// ---------- the scenario ----------

/// Keys the writers and watchers use (both shards get some).
const KEYS: [&[u8]; 5] = [b"a", b"b", b"c", b"d", b"e"];

/// Watches joining a cache under concurrent writers on every core: key and prefix watches,
/// from now, with the current state, or resuming by offset (in the ring, below it, beyond
/// the tail), each on its own stream or on a connection's mux, with bounds small enough to
/// lag; connections stall and read; watches are ended by their clients. Copied from
/// `broker/tests/caches.rs` (`watchers_joining_under_concurrent_writers_see_exactly_the_acknowledged_log`).
pub(super) fn cache_watch_joins_under_concurrent_writers(w: &mut World) -> Result<(), String> {
    let conns: Vec<u64> = (0..4)
        .map(|i| {
            let core = w.rng.below(super::CORES as u64) as u8;
            w.watch_conn(core, i % 2 == 0)
        })
        .collect();
    let mut versions: Vec<u64> = Vec::new();
    for _ in 0..60 {
        match w.rng.below(12) {
            0..=5 => {
                let core = w.rng.below(super::CORES as u64) as u8;
                let k = KEYS[w.rng.below(KEYS.len() as u64) as usize];
                let cond = match w.rng.below(6) {
                    0 => WriteCond::Absent,
                    1 if !versions.is_empty() => {
                        WriteCond::Version(versions[w.rng.below(versions.len() as u64) as usize])
                    }
                    _ => WriteCond::Always,
                };
                let value = (w.rng.below(5) != 0).then(|| Bytes::from(format!("v{}", w.steps)));
                w.cache_write(core, k, value, cond);
            }
            6..=8 => {
                let conn = conns[w.rng.below(conns.len() as u64) as usize];
                let (shard, filter) = if w.rng.chance(30) {
                    let shard = w.rng.below(CACHE_SHARDS as u64) as u32;
                    (shard, Filter::Prefix(Bytes::new()))
                } else {
                    let k = Bytes::from_static(KEYS[w.rng.below(KEYS.len() as u64) as usize]);
                    let shard = felix_quic::wire::hash::shard_for_key(&k, CACHE_SHARDS);
                    (shard, Filter::Key(k))
                };
                // Offsets so far: the writes' answers name them.
                let top = w
                    .cache_writes
                    .values()
                    .filter_map(|x| match x.answers.first() {
                        Some(Frame::Cache(CacheFrame::CacheWritten { version, .. })) => {
                            Some(*version)
                        }
                        _ => None,
                    })
                    .max()
                    .unwrap_or(0);
                versions.push(top);
                let start = match w.rng.below(4) {
                    0 => WatchStart::Latest,
                    1 => WatchStart::Current,
                    _ => WatchStart::Offset(w.rng.below(top + 3)),
                };
                let bound = 1 + w.rng.below(8) as u32;
                w.watch(conn, shard, filter, start, bound);
            }
            9 => {
                let conn = conns[w.rng.below(conns.len() as u64) as usize];
                let stalled = w.rng.chance(60);
                w.stall_watch_conn(conn, stalled);
            }
            10 => {
                let accepted: Vec<u64> = w
                    .watchers
                    .iter()
                    .filter(|(_, x)| matches!(x.answers.as_slice(), [Ok(_)]))
                    .map(|(id, _)| *id)
                    .collect();
                if !accepted.is_empty() {
                    let wid = accepted[w.rng.below(accepted.len() as u64) as usize];
                    w.unwatch(wid);
                }
            }
            _ => {}
        }
        let k = w.rng.below(10);
        w.run(k)?;
    }
    Ok(())
}

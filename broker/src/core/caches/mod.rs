//! The cache driver of a core, around the pure state in [`crate::cache`]: in-memory caches,
//! and log-backed ones whose two logs (changes, counter deltas) are `cache_logs`; a
//! log-backed cache is refused `unsupported` only on a broker without `durable_storage_dir`.
//! This file: the connection side of requests; `owner` drives the pure owner-side host
//! (`shard::caches`: requests applied, watches started, the TTL clock) and carries out its
//! I/O; `watch` drives the watch side (`conn::watches`) on the watching core.
//!
//! - A request is validated by the connection's core, which hashes the key (or counter
//!   name) to a shard and routes it to the shard's owner core; the owner applies it and
//!   answers through the mesh ([`MeshMsg::CacheReply`]).
//! - Every applied change gets the next offset of the shard. An in-memory shard starts its
//!   offsets at `wall-clock ms << 20` when it is created, so versions never repeat across
//!   restarts (a process would need a million writes per millisecond to catch up with the
//!   next one's start; a wall clock stepped back by more than the process lived breaks this).
//! - The owner keeps the last changes in a bounded replay ring (entries and bytes), which is
//!   what a watch resuming by offset replays; below the ring (or from an earlier process)
//!   the resume is answered with a marked snapshot of current values.
//! - Watches: the owner registers the watch and computes its start (current values, or the
//!   replay) in the same step, then sends each later matching change to the watching core;
//!   the mesh keeps per-pair order, so the start and the changes meet with no gap and no
//!   duplicate. The watching core queues events under the watch's bound
//!   ([`crate::cache::WatchQueue`]) and moves them onto the watch's stream as flow control
//!   allows; an overflow ends the watch with `watch_lagged` naming the offset to resume from
//!   (after everything queued before it was delivered).
//! - Expired keys are reclaimed by the owner's timer (Expire changes, seen by watches); reads
//!   never return an expired value before that.

use super::*;
use crate::core::conn::checks;

mod owner;
mod watch;
use crate::cache::{CacheLimits, Filter};
use bytes::Bytes;
use felix_quic::wire::{CacheFrame, WatchFilter, WatchStart};

/// Where a cache request came from.
#[derive(Debug, Clone, Copy)]
pub struct CacheOrigin {
    pub core: u8,
    pub conn: ConnKey,
    pub quic_stream: u64,
    pub request_id: u64,
}

/// One applied change as watchers get it.
#[derive(Debug)]
pub struct Ev {
    pub offset: u64,
    pub key: Bytes,
    /// The encoded `CacheEvent` frame, shared by every watcher.
    pub frame: Bytes,
}

/// A watch's start, computed by the owner.
#[derive(Debug)]
pub struct Opened {
    pub shard: u32,
    pub live_from: u64,
    /// Where a resume would start before any change is delivered (the replay's start, else
    /// `live_from`).
    pub resume_from: u64,
    /// State phase: encoded retained events and the `CacheStateDone` frame after them.
    pub state: Option<(Vec<Bytes>, Bytes)>,
    /// Changes to replay before live ones (offset order, filtered).
    pub replay: Vec<Arc<Ev>>,
    /// The replay stopped at this offset (past the watch's bound): the watch ends lagged there
    /// once the replay is delivered (the owner did not register it).
    pub truncated_at: Option<u64>,
}

/// Watch parameters the owner needs.
#[derive(Debug, Clone)]
pub struct WatchReq {
    pub core: u8,
    pub watch: u64,
    pub cache: u32,
    pub shard: u32,
    pub filter: Filter,
    pub start: WatchStart,
    pub events_max: u32,
    pub bytes_max: u64,
}

pub(in crate::core) fn filter_of(f: &WatchFilter) -> Filter {
    match f {
        WatchFilter::Key(k) => Filter::Key(k.clone()),
        WatchFilter::Prefix { prefix, .. } => Filter::Prefix(prefix.clone()),
    }
}

impl CoreState {
    pub(in crate::core) fn cache_owner_core(&self, cache: u32, shard: u32) -> u8 {
        let def = &self.catalog.cache_slot(cache).def;
        core_for_shard(&def.name(), shard, self.s.cores as u32) as u8
    }

    pub(in crate::core) fn cache_limits(&self) -> CacheLimits {
        let c = &self.s.cfg;
        CacheLimits {
            key_bytes_max: c.cache_key_bytes_max as usize,
            value_bytes_max: c.max_payload_bytes as usize,
            entries_max: c.cache_entries_max as usize,
            bytes_max: c.cache_bytes_max,
        }
    }

    // ---------- connection side ----------

    /// A cache frame from a client: answer it here (describe, unwatch) or route it to the
    /// owner of the key's shard.
    pub(in crate::core) fn on_cache_request(
        &mut self,
        key: ConnKey,
        quic_stream: u64,
        frame: CacheFrame,
    ) -> Result<(), Refusal> {
        let rid = frame.request_id();
        let catalog = self.catalog.clone();
        let key_max = self.s.cfg.cache_key_bytes_max as usize;
        let durable_dir = self.s.cfg.durable_storage_dir.is_some();
        let (idx, shard) = checks::cache_target(&catalog, &frame, key_max, durable_dir)?;
        let Some(shard) = shard else {
            let def = &catalog.cache_slot(idx).def;
            let reply = Frame::Cache(CacheFrame::CacheInfo {
                request_id: rid,
                shards: def.shards,
                durable: def.durable,
                default_ttl_ms: def.default_ttl_ms.unwrap_or(0),
                owners: catalog.cache_shard_owners(idx as usize, self.s.cfg.node_id),
            });
            if let Some(e) = self.ep.get(key) {
                e.conn.send_frame(quic_stream, &reply);
            }
            return Ok(());
        };
        let route = self.admit_shard(key, true, idx, shard)?;
        if matches!(frame, CacheFrame::CacheWatch { .. }) {
            // Watches are not relayed: a watch for a shard owned elsewhere is `not_leader`
            // naming the owner, whose address the client dials.
            catalog.cache_serve_check(idx, shard)?;
        }
        if let CacheFrame::CacheWatch {
            filter,
            start,
            queue_events_max,
            queue_bytes_max,
            ..
        } = frame
        {
            return self.open_watch(
                key,
                quic_stream,
                rid,
                idx,
                shard,
                filter,
                start,
                queue_events_max,
                queue_bytes_max,
            );
        }
        let write = matches!(
            frame,
            CacheFrame::CachePut { .. }
                | CacheFrame::CacheDelete { .. }
                | CacheFrame::CounterAdd { .. }
        );
        if write && self.draining {
            return Err(Refusal::new(
                ErrorCode::ShuttingDown,
                "the broker is shutting down; the write was not applied",
            ));
        }
        if let Some(sess) = self.sessions.get_mut(&key) {
            sess.cache_inflight += 1; // until its answer comes back (drain waits for it)
        }
        CoreCounters::inc(&self.s.counters.cache_requests);
        if let crate::core::conn::ShardAdmit::Forward(target) = route {
            let client = crate::core::peer::FwdClient::Request {
                conn: key,
                stream: quic_stream,
                request_id: rid,
                cache: true,
            };
            let inner = Frame::Cache(frame);
            let lane = crate::core::peer::Lane::Control;
            if let Err(why) = self.forward(target, &inner, client, lane, (Duration::ZERO, None)) {
                let origin = CacheOrigin {
                    core: self.id,
                    conn: key,
                    quic_stream,
                    request_id: rid,
                };
                self.on_cache_reply(origin, why.frame(rid));
            }
            return Ok(());
        }
        let origin = CacheOrigin {
            core: self.id,
            conn: key,
            quic_stream,
            request_id: rid,
        };
        let owner = self.cache_owner_core(idx, shard);
        self.route(
            owner,
            MeshMsg::Owner(ToOwner::CacheReq {
                origin,
                cache: idx,
                shard,
                frame,
            }),
        );
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(in crate::core) fn open_watch(
        &mut self,
        key: ConnKey,
        reply_stream: u64,
        request_id: u64,
        cache: u32,
        shard: u32,
        filter: WatchFilter,
        start: WatchStart,
        events_max: u32,
        bytes_max: u64,
    ) -> Result<(), Refusal> {
        let cfg = self.s.cfg.clone();
        if let WatchFilter::Prefix { prefix, .. } = &filter {
            if prefix.len() > cfg.cache_key_bytes_max as usize {
                return Err(Refusal::new(
                    ErrorCode::InvalidRequest,
                    format!(
                        "prefix of {} bytes is longer than cache_key_bytes_max ({})",
                        prefix.len(),
                        cfg.cache_key_bytes_max
                    ),
                ));
            }
        }
        let session = self
            .sessions
            .get_mut(&key)
            .expect("frames come from live sessions");
        session.room_for_one_more(cfg.max_subscriptions)?;
        let events_max = queue_bound(events_max as u64, cfg.cache_watch_max_events as u64) as u32;
        let bytes_max = queue_bound(bytes_max, cfg.cache_watch_max_bytes);
        let wid = ((self.id as u64) << 48) | self.next_sub;
        self.next_sub += 1;
        session.watches.push(wid);
        let mux = session.features & features::WATCH_MUX != 0;
        let req = WatchReq {
            core: self.id,
            watch: wid,
            cache,
            shard,
            filter: filter_of(&filter),
            start,
            events_max,
            bytes_max,
        };
        let w = crate::core::conn::watches::Watch::new(key, &req, request_id, reply_stream, mux);
        self.with_watches(|h, _, ctx| h.open(wid, w, req, ctx));
        Ok(())
    }

    pub(in crate::core) fn on_cache_reply(&mut self, origin: CacheOrigin, frame: Frame) {
        if let Some(sess) = self.sessions.get_mut(&origin.conn) {
            sess.cache_inflight = sess.cache_inflight.saturating_sub(1);
        }
        if let Some(e) = self.ep.get(origin.conn) {
            e.conn.send_frame(origin.quic_stream, &frame);
            self.ep.mark_dirty(origin.conn);
        }
    }

    pub(in crate::core) fn send_to_conn(&mut self, conn: ConnKey, stream: u64, f: &Frame) {
        if let Some(e) = self.ep.get(conn) {
            e.conn.send_frame(stream, f);
            self.ep.mark_dirty(conn);
        }
    }

    /// A catalog change for a cache shard (`shard::cache_changes`): end this core's watches
    /// of a shard no longer served here and drop its owned state (an in-memory shard's
    /// contents go with it; a log-backed one closes), or remove a deleted cache's logs.
    pub(in crate::core) fn on_cache_catalog_change(
        &mut self,
        change: crate::core::shard::CacheChange,
    ) {
        use crate::core::shard::CacheChange;
        match change {
            CacheChange::Ended(key, why) => {
                self.end_local_watches(key, why.clone());
                self.with_caches(|h, ctx| h.drop_shard(key, why, ctx));
            }
            CacheChange::Deleted(key) => {
                if self.cache_owner_core(key.0, key.1) == self.id {
                    self.with_caches(|h, _| h.deleted_unopened(key));
                }
            }
        }
    }
}

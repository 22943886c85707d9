//! The shard host: the shards a core owns, as pure state machines keyed by `ShardKey`. A host
//! is handed messages and the outcome of I/O, with the time; it returns effects (messages to
//! send, I/O to run) from `drain_effects`. It never awaits, spawns, reads a clock or touches a
//! file, so the core driver (`core/mod.rs`) and the simulator (`core/sim`) run the same code.
//!
//! Built: stream shards (`stream`) behind the log trait (`log`), the owner side of cache
//! shards (`caches`), and the consumer groups of durable stream shards (`groups`). Stream
//! and cache shards share one lifecycle (`Life`).

pub(crate) mod caches;
pub(crate) mod groups;
pub(crate) mod log;
pub(crate) mod stream;

use crate::catalog::{core_for_shard, Catalog, Place};
use crate::metrics::CoreCounters;
use felix_quic::wire::ErrorCode;
use std::time::Instant;

/// What a pure host needs from its core for one step: who it is, the time, the catalog it acts
/// on and the counters it bumps. Hosts read no clock of their own.
pub(crate) struct Ctx<'a> {
    /// This core.
    pub me: u8,
    /// Cores of the broker (a shard's owner core is a hash of its name over them).
    pub cores: u8,
    pub now: Instant,
    /// Wall-clock milliseconds stamped on appended records.
    pub ts_ms: u64,
    pub catalog: &'a Catalog,
    pub counters: &'a CoreCounters,
}

impl Ctx<'_> {
    /// The core that owns stream shard `key`.
    pub(crate) fn owner_core(&self, key: (u32, u32)) -> u8 {
        let def = &self.catalog.slot(key.0).def;
        core_for_shard(&def.name(), key.1, self.cores as u32) as u8
    }

    /// The core that owns cache shard `key`.
    pub(crate) fn cache_owner_core(&self, key: (u32, u32)) -> u8 {
        let def = &self.catalog.cache_slot(key.0).def;
        core_for_shard(&def.name(), key.1, self.cores as u32) as u8
    }
}

/// A refusal as it is answered: the registry code and a message for people. Everything the
/// core refuses (publishes, attaches, fetches, watches, opens) carries one; the catalog's
/// checks return `(code, message)` pairs, which convert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: ErrorCode,
    pub message: String,
}

impl Refusal {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Refusal {
            code,
            message: message.into(),
        }
    }

    /// The `Error` frame that answers request `request_id` with this refusal.
    pub fn frame(self, request_id: u64) -> felix_quic::wire::Frame {
        felix_quic::wire::Frame::error(request_id, self.code, self.message)
    }
}

impl From<(ErrorCode, String)> for Refusal {
    fn from((code, message): (ErrorCode, String)) -> Self {
        Refusal { code, message }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code.name(), self.message)
    }
}

/// The name the shard hosts use for it.
pub(crate) type Refused = Refusal;

/// The lifecycle of a shard with a log, for stream shards (`L`: the log) and cache shards
/// (`L`: the open shard, which holds its logs). `M` is what waits for an open or a close.
///
/// Replication adds its roles here (leader, follower, fencing, waiting out a lease, deposed)
/// as states beside `Open`: what a role may do is decided in one match, not in flags.
pub(crate) enum Life<L, M> {
    /// The log is opening; requests for the shard wait, in arrival order.
    Opening {
        deferred: Vec<M>,
    },
    Open(L),
    /// An earlier open's log is closing (the shard was dropped here); requests for the shard
    /// wait for the close, in arrival order, so a reopen never races it.
    Closing {
        waiting: Vec<M>,
    },
    /// The log could not open (no log) or failed later (the log is kept, to be closed): the
    /// shard answers `unavailable`, with why.
    Failed {
        why: String,
        log: Option<L>,
    },
}

impl<L, M> Life<L, M> {
    /// The log, or the `unavailable` refusal every durable operation answers instead.
    pub(crate) fn usable(&self) -> Result<&L, Refused> {
        match self {
            Life::Open(log) => Ok(log),
            Life::Failed { why, .. } => Err(Refusal::new(
                ErrorCode::Unavailable,
                format!("shard storage failed: {why}"),
            )),
            Life::Opening { .. } | Life::Closing { .. } => Err(Refusal::new(
                ErrorCode::Unavailable,
                "shard storage is not open",
            )),
        }
    }

    /// The log, open or failed.
    pub(crate) fn log(&self) -> Option<&L> {
        match self {
            Life::Open(log) | Life::Failed { log: Some(log), .. } => Some(log),
            _ => None,
        }
    }

    pub(crate) fn into_log(self) -> Option<L> {
        match self {
            Life::Open(log) | Life::Failed { log: Some(log), .. } => Some(log),
            _ => None,
        }
    }

    /// Fail the shard, keeping its log (if open) to be closed.
    pub(crate) fn fail(&mut self, why: String) {
        let old = std::mem::replace(self, Life::Opening { deferred: vec![] });
        *self = Life::Failed {
            why,
            log: old.into_log(),
        };
    }
}

/// What a new catalog version changes for the stream shards a core serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StreamChange {
    /// The stream of this slot was deleted.
    Deleted(u32),
    /// This broker served the shard and no longer does as before (moved, placed again at a
    /// new generation, or the broker is fenced): its subscriptions end, told why.
    Ended((u32, u32), Refused),
}

/// The changes from catalog `old` to `new`, in slot and shard order.
pub(crate) fn stream_changes(old: &Catalog, new: &Catalog) -> Vec<StreamChange> {
    let mut out = Vec::new();
    for (i, slot) in new.slots().iter().enumerate() {
        let idx = i as u32;
        let was = old.slots().get(i);
        if slot.deleted {
            if was.is_some_and(|w| !w.deleted) {
                out.push(StreamChange::Deleted(idx));
            }
            continue;
        }
        for shard in 0..slot.def.shards {
            let place = &slot.places[shard as usize];
            // Where this core served the shard before (not fenced, placed here), a change of
            // place or generation, or a new fence, ends its subscriptions.
            let before = was
                .filter(|_| !old.fenced)
                .and_then(|w| w.places.get(shard as usize));
            // A replicated shard led here, no longer named so: its readers move with the
            // leadership (its replica steps down when it learns of the new generation).
            let led_here = |p: Option<&Place>| {
                matches!(
                    p,
                    Some(Place::Mine { .. }) | Some(Place::Replicated { mine: true, .. })
                )
            };
            if led_here(before) && (new.fenced || before != Some(place)) {
                let why = new
                    .serve_check(idx, shard)
                    .err()
                    .map(Refusal::from)
                    .unwrap_or(Refusal::new(
                        ErrorCode::NotLeader,
                        format!(
                        "shard {shard} of {} was placed again (new generation); subscribe again",
                        slot.def.name()
                    ),
                    ));
                out.push(StreamChange::Ended((idx, shard), why));
            }
        }
    }
    out
}

/// What a new catalog version changes for the cache shards a core serves (the cache twin of
/// [`stream_changes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CacheChange {
    /// This broker served the shard and no longer does as before (deleted, moved, placed
    /// again at a new generation, or the broker is fenced): its watches end and its owner
    /// drops it, told why.
    Ended((u32, u32), Refused),
    /// A log-backed cache was deleted: on the shard's owner core, its logs go if they are
    /// not open there (an open one is removed as it retires).
    Deleted((u32, u32)),
}

/// The changes from catalog `old` to `new`, in slot and shard order.
pub(crate) fn cache_changes(old: &Catalog, new: &Catalog) -> Vec<CacheChange> {
    let mut out = Vec::new();
    for (i, slot) in new.cache_slots().iter().enumerate() {
        let idx = i as u32;
        let was = old.cache_slots().get(i);
        for shard in 0..slot.def.shards {
            let served_before = was.is_some_and(|w| {
                !w.deleted
                    && !old.fenced
                    && matches!(w.places.get(shard as usize), Some(Place::Mine { .. }))
            });
            let serves = new.cache_serve_check(idx, shard);
            let same =
                was.and_then(|w| w.places.get(shard as usize)) == slot.places.get(shard as usize);
            if served_before && (serves.is_err() || !same) {
                let why = serves.err().map(Refusal::from).unwrap_or(Refusal::new(
                    ErrorCode::NotLeader,
                    format!(
                        "shard {shard} of cache {} was placed again (new generation); watch again",
                        slot.def.name()
                    ),
                ));
                out.push(CacheChange::Ended((idx, shard), why));
            }
            if slot.deleted && slot.def.durable && was.is_some_and(|w| !w.deleted) {
                out.push(CacheChange::Deleted((idx, shard)));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{CacheDef, ControlView, ViewPlace, ViewStream};

    /// This node's view: caches `a` (two in-memory shards) and `b` (one log-backed), those
    /// `present`, every shard here at `generation`.
    fn view(present: &[&str], generation: u64, prev: &Catalog) -> Catalog {
        let mut v = ControlView {
            revision: 1,
            ..Default::default()
        };
        v.tenants.insert("t".into());
        v.namespaces.insert(("t".into(), "n".into()));
        for (i, (name, shards, durable)) in
            [("a", 2, false), ("b", 1, true)].into_iter().enumerate()
        {
            if !present.contains(&name) {
                continue;
            }
            v.caches.push(ViewStream {
                def: CacheDef {
                    tenant: "t".into(),
                    namespace: "n".into(),
                    cache: name.into(),
                    shards,
                    durable,
                    default_ttl_ms: None,
                },
                incarnation: 1 + i as u64,
                deleting: false,
                placement: (0..shards)
                    .map(|_| ViewPlace::Assigned {
                        owner: 1,
                        generation,
                    })
                    .collect(),
            });
        }
        Catalog::from_view(prev, &v, 1, false)
    }

    #[test]
    fn cache_changes_name_ended_and_deleted_shards() {
        let old = view(&["a", "b"], 1, &Catalog::default());
        assert!(
            cache_changes(&old, &old).is_empty(),
            "no change, nothing to do"
        );
        // Placed again at a new generation: every shard's watches end, not_leader.
        let again = view(&["a", "b"], 2, &old);
        let changes = cache_changes(&old, &again);
        assert_eq!(changes.len(), 3, "{changes:?}");
        assert!(
            changes.iter().all(
                |c| matches!(c, CacheChange::Ended(_, why) if why.code == ErrorCode::NotLeader)
            ),
            "{changes:?}"
        );
        // The log-backed cache deleted: its shard ends, and its logs are to go.
        let gone = view(&["a"], 1, &old);
        let changes = cache_changes(&old, &gone);
        assert!(
            matches!(
                changes.as_slice(),
                [CacheChange::Ended((1, 0), _), CacheChange::Deleted((1, 0))]
            ),
            "{changes:?}"
        );
    }
}

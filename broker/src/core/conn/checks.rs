//! The connection side's checks of a request, pure: which stream or cache shard a decoded
//! request goes to, or the typed refusal it is answered with. The driver (`conn/mod.rs`,
//! `caches/mod.rs`, `groups/mod.rs`) and the simulator (`core/sim`, on frames it encoded and
//! decoded) run the same checks. What depends on the session (its caps, its stream limit, its
//! principal) and on placement (`admit.rs`) is checked after these.

use crate::catalog::{CacheDef, Catalog};
use crate::core::shard_range;
use crate::core::Refusal;
use felix_quic::wire::{
    CacheFrame, ErrorCode, GroupFrame, GroupRef, Records, ShardSelector, StreamName, WatchFilter,
};
use std::collections::HashMap;

/// A publish's records checked (at least one, none over `max_payload_bytes`) and its shard
/// chosen (named, by key, or round robin over `rr`): `(stream slot, shard)`.
pub(crate) fn publish_target(
    catalog: &Catalog,
    max_payload_bytes: u32,
    rr: &mut HashMap<u32, u32>,
    name: &StreamName,
    sel: ShardSelector,
    records: &Records,
) -> Result<(u32, u32), Refusal> {
    let (idx, def) = catalog.lookup(name)?;
    let shards = def.shards;
    let idx = idx as u32;
    if records.count() == 0 {
        return Err(Refusal::new(
            ErrorCode::InvalidRequest,
            "a publish carries at least one record",
        ));
    }
    let max_payload = records.max_payload();
    if max_payload > max_payload_bytes as usize {
        return Err(Refusal::new(
            ErrorCode::PayloadTooLarge,
            format!(
                "a record of {max_payload} bytes exceeds max_payload_bytes {max_payload_bytes}"
            ),
        ));
    }
    let shard = match sel {
        ShardSelector::Shard(s) if s < shards => s,
        ShardSelector::Shard(s) => {
            return Err(Refusal::new(
                ErrorCode::UnknownShard,
                format!("stream {name} has {}, not {s}", shard_range(shards)),
            ))
        }
        ShardSelector::Key(k) => felix_quic::wire::hash::shard_for_key(&k, shards),
        ShardSelector::RoundRobin => {
            let n = rr.entry(idx).or_insert(0);
            *n = n.wrapping_add(1);
            *n % shards
        }
    };
    Ok((idx, shard))
}

/// A subscription's stream and shard: known, in range, and served here (`stream slot`).
pub(crate) fn subscribe_target(
    catalog: &Catalog,
    name: &StreamName,
    shard: u32,
) -> Result<u32, Refusal> {
    let (idx, def) = catalog.lookup(name)?;
    if shard >= def.shards {
        return Err(Refusal::new(
            ErrorCode::UnknownShard,
            format!("stream {name} has {}, not {shard}", shard_range(def.shards)),
        ));
    }
    let idx = idx as u32;
    catalog.serve_check(idx, shard)?;
    Ok(idx)
}

/// A group request's stream slot and target: a request (not an answer), a valid group name,
/// a known stream, a shard in range, a durable stream.
pub(crate) fn group_target(
    catalog: &Catalog,
    frame: &GroupFrame,
) -> Result<(u32, GroupRef), Refusal> {
    let Some(target) = frame.target().cloned() else {
        return Err(Refusal::new(
            ErrorCode::InvalidRequest,
            format!("frame kind {} is an answer, not a request", frame.kind()),
        ));
    };
    felix_quic::wire::validate_name(&target.group)
        .map_err(|e| Refusal::new(ErrorCode::InvalidName, format!("group name: {e}")))?;
    let (idx, def) = catalog.lookup(&target.stream)?;
    if target.shard >= def.shards {
        return Err(Refusal::new(
            ErrorCode::UnknownShard,
            format!(
                "stream {} has {}, not {}",
                target.stream,
                shard_range(def.shards),
                target.shard
            ),
        ));
    }
    if !def.durable {
        return Err(Refusal::new(
            ErrorCode::InvalidRequest,
            format!(
                "stream {} is not durable; consumer groups need a durable stream",
                target.stream
            ),
        ));
    }
    Ok((idx as u32, target))
}

/// The shard a cache request goes to: a key's or counter's hash, or the shard a prefix watch
/// names (checked against the cache's shards). A routing key outside `1..=key_bytes_max` is
/// refused.
pub(crate) fn cache_shard(
    frame: &CacheFrame,
    def: &CacheDef,
    key_bytes_max: usize,
) -> Result<u32, Refusal> {
    let routing: &[u8] = match frame {
        CacheFrame::CachePut { key, .. }
        | CacheFrame::CacheGet { key, .. }
        | CacheFrame::CacheDelete { key, .. } => key,
        CacheFrame::CounterAdd { name, .. } | CacheFrame::CounterGet { name, .. } => name,
        CacheFrame::CacheWatch {
            filter: WatchFilter::Key(k),
            ..
        } => k,
        _ => &[],
    };
    Ok(match frame {
        CacheFrame::CacheWatch {
            filter: WatchFilter::Prefix { shard, .. },
            ..
        } => {
            if *shard >= def.shards {
                return Err(Refusal::new(
                    ErrorCode::UnknownShard,
                    format!(
                        "cache {} has {}, not {shard}",
                        def.name(),
                        shard_range(def.shards)
                    ),
                ));
            }
            *shard
        }
        _ => {
            if routing.is_empty() || routing.len() > key_bytes_max {
                return Err(Refusal::new(
                    ErrorCode::InvalidRequest,
                    format!(
                        "key of {} bytes is outside 1..={key_bytes_max}",
                        routing.len()
                    ),
                ));
            }
            felix_quic::wire::hash::shard_for_key(routing, def.shards)
        }
    })
}

/// A cache request's cache slot and shard (a describe names no shard: `None`). A log-backed
/// cache is refused `unsupported` on a broker without a durable storage directory
/// (`durable_dir`), rather than served from memory under a durable name.
pub(crate) fn cache_target(
    catalog: &Catalog,
    frame: &CacheFrame,
    key_bytes_max: usize,
    durable_dir: bool,
) -> Result<(u32, Option<u32>), Refusal> {
    let Some(name) = frame.cache() else {
        return Err(Refusal::new(
            ErrorCode::InvalidRequest,
            format!("frame kind {} is not a cache request", frame.kind()),
        ));
    };
    let (idx, def) = catalog.lookup_cache(name)?;
    if let CacheFrame::DescribeCache { .. } = frame {
        return Ok((idx as u32, None));
    }
    if def.durable && !durable_dir {
        return Err(Refusal::new(
            ErrorCode::Unsupported,
            format!("cache {name} is log-backed (durable) and this broker has no durable_storage_dir (FELIX_DURABLE_STORAGE_DIR)"),
        ));
    }
    Ok((idx as u32, Some(cache_shard(frame, def, key_bytes_max)?)))
}

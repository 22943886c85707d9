//! The owner's operations on one cache shard that need nothing of the host: a value read, a
//! counter added, a watch's state phase, and the codes and frames they answer with.

use super::{OwnedCache, Wait};
use crate::cache::{CacheError, ChangeKind, Cond};
use crate::core::cache_logs;
use crate::core::{Refusal, WatchReq};
use bytes::Bytes;
use felix_quic::wire::cache::encode_event;
use felix_quic::wire::{CacheFrame, ErrorCode, EventKind, Frame, WriteCond};
use felix_storage::RecordIn;

/// A watch's state phase: the retained values its filter matches, and the `CacheStateDone`
/// after them; refused when they exceed the watch's bound.
pub(super) fn state_phase(
    oc: &OwnedCache,
    req: &WatchReq,
    snapshot: bool,
    now: u64,
) -> Result<(Vec<Bytes>, Bytes), Refusal> {
    let ws = oc.shard.watch_start(&req.filter, now);
    #[allow(unused_mut)]
    let mut frames: Vec<Bytes> = ws
        .retained
        .into_iter()
        .map(|(k, e)| {
            encode_event(
                EventKind::Retained,
                e.version,
                k,
                e.expires_at_ms.unwrap_or(0),
                e.value,
            )
        })
        .collect();
    #[cfg(test)]
    if super::breaks::on(&super::breaks::STATE_DROPS_ONE) {
        frames.pop(); // broken on purpose: one retained value left out
    }
    let bytes: u64 = frames.iter().map(|f| f.len() as u64).sum();
    if frames.len() > req.events_max as usize || bytes > req.bytes_max {
        return Err(Refusal::new(
            ErrorCode::InvalidRequest,
            format!(
                "the current state ({} keys, {bytes} bytes) exceeds the watch's queue bound ({} events, {} bytes); narrow the filter or raise the bound",
                frames.len(),
                req.events_max,
                req.bytes_max
            ),
        ));
    }
    let done = Frame::Cache(CacheFrame::CacheStateDone {
        count: frames.len() as u64,
        snapshot,
        live_from: ws.live_from,
    })
    .encode();
    Ok((frames, done))
}

pub(super) fn cond(c: WriteCond) -> Cond {
    match c {
        WriteCond::Always => Cond::Always,
        WriteCond::Version(v) => Cond::Version(v),
        WriteCond::Absent => Cond::Absent,
    }
}

pub(super) fn cache_code(e: &CacheError) -> ErrorCode {
    match e {
        CacheError::KeySize { .. } | CacheError::TtlOutOfRange { .. } => ErrorCode::InvalidRequest,
        CacheError::ValueTooLarge { .. } => ErrorCode::PayloadTooLarge,
        CacheError::ConditionFailed { .. } => ErrorCode::ConditionFailed,
        CacheError::NotFound => ErrorCode::NotFound,
        CacheError::Full { .. } => ErrorCode::CacheFull,
    }
}

/// The encoded `CacheEvent` of a change (shared by every watcher).
pub(crate) fn event_frame(offset: u64, key: &Bytes, kind: &ChangeKind) -> Bytes {
    match kind {
        ChangeKind::Put {
            value,
            expires_at_ms,
        } => encode_event(
            EventKind::Put,
            offset,
            key.clone(),
            expires_at_ms.unwrap_or(0),
            value.clone(),
        ),
        ChangeKind::Delete => encode_event(EventKind::Delete, offset, key.clone(), 0, Bytes::new()),
        ChangeKind::Expire => encode_event(EventKind::Expire, offset, key.clone(), 0, Bytes::new()),
    }
}

/// CacheGet: the key's current value (or `found: false`), read at the owner.
pub(super) fn cache_value(oc: &OwnedCache, rid: u64, shard: u32, k: &Bytes, now: u64) -> Frame {
    let f = match oc.shard.get(k, now) {
        Some(e) => CacheFrame::CacheValue {
            request_id: rid,
            shard,
            found: true,
            version: e.version,
            change_offset: 0,
            expires_at_ms: e.expires_at_ms.unwrap_or(0),
            value: e.value.clone(),
        },
        None => CacheFrame::CacheValue {
            request_id: rid,
            shard,
            found: false,
            version: 0,
            change_offset: 0,
            expires_at_ms: 0,
            value: Bytes::new(),
        },
    };
    Frame::Cache(f)
}

/// CounterAdd: check, append (log-backed), then apply; the answer waits for the counter log's
/// commit when there is one.
pub(super) fn counter_add(
    oc: &mut OwnedCache,
    rid: u64,
    shard: u32,
    name: Bytes,
    delta: i64,
    counters_max: usize,
    now: u64,
) -> (Frame, Option<Wait>) {
    let now_frame = |f: Frame| (f, None);
    if !oc.counters.contains(&name) && oc.counters.len() >= counters_max {
        return now_frame(Frame::error(
            rid,
            ErrorCode::CacheFull,
            format!(
                "shard holds {} counters (cache_entries_max)",
                oc.counters.len()
            ),
        ));
    }
    let (offset, sum) = match oc.counters.prepare_add(&name, delta) {
        Ok(x) => x,
        Err(e) => return now_frame(Frame::error(rid, ErrorCode::InvalidRequest, e.to_string())),
    };
    if let Some(logs) = &oc.logs {
        let d = delta.to_le_bytes();
        let rec = RecordIn {
            key: &name,
            payload: &d,
            flags: 0,
        };
        match logs.counters.append(&[rec], now) {
            Ok(r) => assert_eq!(r.start, offset, "counter log and state agree"),
            Err(e) => {
                let Refusal { code, message: msg } = cache_logs::append_refusal(&e);
                return now_frame(Frame::error(rid, code, msg));
            }
        }
    }
    oc.counters.apply(offset, name, delta);
    let f = Frame::Cache(CacheFrame::CounterValue {
        request_id: rid,
        shard,
        sum,
        offset,
    });
    let wait = oc.logs.as_ref().map(|_| Wait {
        counters: true,
        upto: offset + 1,
    });
    (f, wait)
}

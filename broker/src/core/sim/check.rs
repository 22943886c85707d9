//! The simulator's invariants, checked after every step (`after_step`) and once the run is at
//! rest (`at_rest`). Each returns the first violation, named.

use super::{Got, World};
use crate::core::ShardKey;
use bytes::Bytes;
use felix_quic::wire::{ErrorCode, QueuePolicy};
use std::collections::BTreeMap;

/// Offsets' payloads per shard, from acknowledged publishes: `(key, life)` → offset →
/// (publish id, payload). A durable shard keeps its offsets across restarts (life 0); an
/// ephemeral one starts again at 0 in each broker life.
type Acked = BTreeMap<(ShardKey, u32), BTreeMap<u64, (u64, Bytes)>>;

fn durable(w: &World, key: ShardKey) -> bool {
    w.catalog.slot(key.0).def.durable
}

fn life_of(w: &World, key: ShardKey, life: u32) -> u32 {
    if durable(w, key) {
        0
    } else {
        life
    }
}

/// INVARIANT `acked_exactly_once`: every publish is answered at most once, and no offset is
/// acknowledged to two publishes (offsets are assigned once, contiguously, per shard).
fn acked(w: &World) -> Result<Acked, String> {
    let mut out: Acked = BTreeMap::new();
    for (id, p) in &w.pubs {
        if p.answers.len() > 1 {
            return Err(format!(
                "acked_exactly_once: publish #{id} was answered {} times: {:?}",
                p.answers.len(),
                p.answers
            ));
        }
        let Some(Ok((first, count))) = p.answers.first() else {
            continue;
        };
        if *count as usize != p.payloads.len() {
            return Err(format!(
                "acked_exactly_once: publish #{id} of {} records acknowledged as {count}",
                p.payloads.len()
            ));
        }
        let m = out.entry((p.key, life_of(w, p.key, p.life))).or_default();
        for (i, payload) in p.payloads.iter().enumerate() {
            let off = first + i as u64;
            if let Some((other, _)) = m.insert(off, (*id, payload.clone())) {
                return Err(format!(
                    "acked_exactly_once: offset {off} of {:?} acknowledged to #{other} and #{id}",
                    p.key
                ));
            }
        }
    }
    Ok(out)
}

/// INVARIANT `acked_in_log`: an acknowledged durable record is in its shard's log at its
/// acknowledged offset, committed (it survives any crash the simulator injects, since the
/// log acknowledges what was fsynced).
fn acked_in_log(w: &World, acked: &Acked) -> Result<(), String> {
    for ((key, _), offsets) in acked {
        if !durable(w, *key) {
            continue;
        }
        let Some(st) = w.disk.get(key) else {
            return Err(format!(
                "acked_in_log: {key:?} has acknowledged records and no log"
            ));
        };
        let st = st.borrow();
        for (off, (id, payload)) in offsets {
            if *off >= st.acked() {
                return Err(format!(
                    "acked_in_log: #{id} acknowledged at {off} of {key:?}, the log committed only {}",
                    st.acked()
                ));
            }
            if st.records[*off as usize] != payload {
                return Err(format!(
                    "acked_in_log: offset {off} of {key:?} holds another record than #{id}'s"
                ));
            }
        }
    }
    Ok(())
}

/// INVARIANT `subscriber_sees_log_in_order`: what a subscriber receives starts at its
/// `SubscribeOk` offset and is the shard's log in order: each batch starts where the last
/// item ended, each gap is one lag notice naming it exactly, a Block subscriber has no gap
/// after the one retention may announce first (records gone before it subscribed), nothing
/// follows the end, and every record is the one acknowledged at its offset.
/// Returns where each subscriber's stream stands (`None`: ended).
fn subscribers_in_order(w: &World, acked: &Acked) -> Result<BTreeMap<u64, Option<u64>>, String> {
    let mut out = BTreeMap::new();
    for (sid, c) in &w.clients {
        let Some(Ok(start)) = c.answer else {
            // Refused, or ended before the attach was answered: the stream carries at most
            // its end.
            let items: Vec<&Got> = c.read.iter().chain(&c.unread).collect();
            if !matches!(items.as_slice(), [] | [Got::End { .. }]) {
                return Err(format!(
                    "subscriber_sees_log_in_order: #{sid} ({:?}) got {items:?} without a subscription",
                    c.answer
                ));
            }
            out.insert(*sid, None);
            continue;
        };
        let offsets = acked.get(&(c.key, life_of(w, c.key, c.life)));
        let mut next = Some(start);
        for (i, item) in c.read.iter().chain(&c.unread).enumerate() {
            let Some(expect) = next else {
                return Err(format!(
                    "subscriber_sees_log_in_order: #{sid} got {item:?} after its end"
                ));
            };
            match item {
                Got::Batch { first, records } => {
                    if *first != expect || records.is_empty() {
                        return Err(format!(
                            "subscriber_sees_log_in_order: #{sid} expected offset {expect}, got a batch at {first} of {}",
                            records.len()
                        ));
                    }
                    for (i, r) in records.iter().enumerate() {
                        let off = first + i as u64;
                        if let Some((id, p)) = offsets.and_then(|o| o.get(&off)) {
                            if p != r {
                                return Err(format!(
                                    "subscriber_sees_log_in_order: #{sid} got another record at {off} than #{id} acknowledged there"
                                ));
                            }
                        }
                    }
                    next = Some(first + records.len() as u64);
                }
                Got::Lag { from, lost } => {
                    // Block loses nothing once subscribed; what retention no longer held when
                    // it subscribed is announced first, for every policy.
                    let retention = i == 0 && *from == start;
                    if *from != expect
                        || *lost == 0
                        || (c.policy == QueuePolicy::Block && !retention)
                    {
                        return Err(format!(
                            "subscriber_sees_log_in_order: #{sid} ({:?}) expected offset {expect}, got a lag notice {from}+{lost}",
                            c.policy
                        ));
                    }
                    next = Some(from + lost);
                }
                Got::End { .. } => next = None,
            }
        }
        out.insert(*sid, next);
    }
    Ok(out)
}

/// INVARIANT `block_held_only_while_full`: an owner holds publishes for a shard only while
/// some Block subscriber of the shard has parked batches, or while the release of the last
/// one is on its way to the owner.
fn held_only_while_full(w: &World) -> Result<(), String> {
    for (c, core) in w.cores.iter().enumerate() {
        if !core.streams.check_held_total() {
            return Err(format!(
                "held_total: core {c}'s count of held publishes is not what it holds"
            ));
        }
        for (key, n) in core.streams.held() {
            let parked = w
                .cores
                .iter()
                .any(|d| d.subs.parked_counts().get(&key).is_some_and(|p| *p > 0));
            let releasing =
                w.in_flight().any(|m| match m {
                    crate::core::MeshMsg::Owner(crate::core::ToOwner::Parked {
                        stream,
                        shard,
                        parked: false,
                        ..
                    })
                    | crate::core::MeshMsg::Owner(crate::core::ToOwner::DrainHeld {
                        stream,
                        shard,
                    }) => (*stream, *shard) == key,
                    _ => false,
                });
            if !parked && !releasing {
                return Err(format!(
                    "block_held_only_while_full: core {c} holds {n} publishes for {key:?} and no subscriber is full"
                ));
            }
        }
    }
    Ok(())
}

pub(super) fn after_step(w: &World) -> Result<(), String> {
    let acked = acked(w)?;
    acked_in_log(w, &acked)?;
    subscribers_in_order(w, &acked)?;
    held_only_while_full(w)?;
    super::groups::after_step(w)
}

/// At rest, after `after_step`'s checks:
/// INVARIANT `nothing_forgotten`: every publish of a live client got its answer, every
/// subscribe its answer, and no host holds or waits for anything.
/// INVARIANT `live_subscriber_complete`: a subscription still open has received (or been told
/// it lost) every record up to its shard's tail, and every record it received was
/// acknowledged; a subscription on a shard whose storage failed was ended (told), not left
/// open with nothing more coming.
pub(super) fn at_rest(w: &World) -> Result<(), String> {
    after_step(w)?;
    for (id, p) in &w.pubs {
        if !p.lost && p.answers.is_empty() {
            return Err(format!(
                "nothing_forgotten: publish #{id} to {:?} was never answered",
                p.key
            ));
        }
    }
    for (c, core) in w.cores.iter().enumerate() {
        if !core.streams.idle() || core.streams.commit_pending() {
            return Err(format!(
                "nothing_forgotten: core {c}'s stream host is not idle at rest"
            ));
        }
    }
    super::caches::check_at_rest(w)?;
    super::groups::at_rest(w)?;
    let acked = acked(w)?;
    let stands = subscribers_in_order(w, &acked)?;
    for (conn, m) in &w.mux_conns {
        if !m.unread.is_empty() {
            return Err(format!(
                "nothing_forgotten: mux connection {conn:#x} has unread frames at rest"
            ));
        }
    }
    for (sid, c) in &w.clients {
        if c.lost {
            continue;
        }
        let ended = c.read.iter().any(|g| matches!(g, Got::End { .. }));
        if c.answer.is_none() && !ended {
            return Err(format!(
                "nothing_forgotten: subscribe #{sid} was never answered"
            ));
        }
        if !c.unread.is_empty() {
            return Err(format!(
                "nothing_forgotten: #{sid} has unread items at rest"
            ));
        }
        let Some(Some(at)) = stands.get(sid) else {
            continue; // ended or refused
        };
        // The shard's tail: for a durable shard its log's commit mark (acknowledged
        // publishes of a crashed broker's clients are in it too), else the acknowledged end.
        let failed = durable(w, c.key)
            && w.disk
                .get(&c.key)
                .is_some_and(|st| st.borrow().failed.is_some());
        if failed {
            return Err(format!(
                "live_subscriber_complete: #{sid} on {:?} is still open after its shard's storage failed (never told)",
                c.key
            ));
        }
        let tail = match w.disk.get(&c.key).filter(|_| durable(w, c.key)) {
            Some(st) => st.borrow().acked(),
            None => acked
                .get(&(c.key, life_of(w, c.key, c.life)))
                .and_then(|o| o.keys().next_back())
                .map(|o| o + 1)
                .unwrap_or(0),
        };
        if *at != tail.max(c.answer.and_then(|a| a.ok()).unwrap_or(0)) {
            return Err(format!(
                "live_subscriber_complete: #{sid} ({:?}) on {:?} stands at {at}, the tail is {tail}",
                c.policy, c.key
            ));
        }
    }
    for (id, p) in &w.pubs {
        if let Some(Err(code)) = p.answers.first() {
            if !expected_refusal(*code) {
                return Err(format!("nothing_forgotten: publish #{id} refused {code:?}"));
            }
        }
    }
    Ok(())
}

/// A code that a publish may be refused with in the simulated scenarios.
fn expected_refusal(code: ErrorCode) -> bool {
    matches!(
        code,
        ErrorCode::PublishTimeout
            // A publish to a stream deleted before it was sent: the connection side no
            // longer knows the name (one in flight at the deletion gets stream_deleted).
            | ErrorCode::UnknownStream
            | ErrorCode::StreamDeleted
            | ErrorCode::NotLeader
            | ErrorCode::Unavailable
            | ErrorCode::ShuttingDown
    )
}

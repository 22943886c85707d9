//! The group requests at the owner (poll, answer, seek, describe, delete, cancel, dead
//! letters), the waiting polls, the clock's lapses, and claims answered with their payloads.

use super::*;
use crate::core::shard::stream::StreamHost;
use crate::group::{ClaimId, Fate};
use crate::metrics::CoreCounters;
use felix_quic::wire::{AnswerOp, ClaimRef, DeadLetterAction, DeadLetterRef, GroupInfo};

impl<L: ShardLog> GroupHost<L> {
    fn slot_mut(&mut self, key: ShardKey, name: &str) -> &mut GroupSlot {
        slot_in(&mut self.groups, key, name).expect("checked by on_group")
    }

    /// Apply a request to an existing group (not a create).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn apply(
        &mut self,
        origin: GroupOrigin,
        key: ShardKey,
        name: String,
        frame: GroupFrame,
        (oldest, tail): (u64, u64),
        now: u64,
        streams: &StreamHost<L>,
        ctx: &Ctx,
    ) {
        let rid = origin.request_id;
        match frame {
            GroupFrame::GroupCreate { .. } => unreachable!("handled by on_group"),
            GroupFrame::GroupDelete { .. } => self.delete(origin, key, name),
            GroupFrame::GroupDescribe { .. } => self.describe(origin, key, &name, now, ctx),
            GroupFrame::GroupPoll {
                max,
                visibility_timeout_ms,
                wait_ms,
                ..
            } => {
                let ask = (max, visibility_timeout_ms, wait_ms);
                self.poll(origin, key, name, ask, now, streams, ctx)
            }
            GroupFrame::GroupPollCancel { .. } => self.poll_cancel(origin, key, &name),
            GroupFrame::GroupAnswer { op, claims, .. } => {
                self.answer(origin, key, &name, op, &claims, now, streams, ctx)
            }
            GroupFrame::GroupSeek { to, .. } => {
                let offset = start_offset(to, oldest, tail);
                self.seek(origin, key, &name, offset, oldest, streams, ctx)
            }
            GroupFrame::DeadLetterList { after, limit, .. } => {
                let slot = self.slot_mut(key, &name);
                let f = dead_letter_page(&slot.group, &origin, after, limit);
                self.reply(origin, f);
            }
            GroupFrame::DeadLetterOp { action, offset, .. } => {
                let slot = self.slot_mut(key, &name);
                let r = match action {
                    DeadLetterAction::Redrive => slot.group.redrive(offset),
                    DeadLetterAction::Discard => slot.group.discard(offset).map(|_| ()),
                };
                match r {
                    Err(e) => self.reply(origin, err_frame(rid, &e)),
                    Ok(()) => {
                        self.persist(key, &name, Some((origin, ok(rid))));
                        self.serve_waiters(key, &name, streams, ctx);
                    }
                }
            }
            GroupFrame::GroupInfo { .. }
            | GroupFrame::GroupRecords { .. }
            | GroupFrame::GroupAnswered { .. }
            | GroupFrame::DeadLetterPage { .. }
            | GroupFrame::GroupOk { .. } => unreachable!("answers are refused before routing"),
        }
    }

    /// Lapse claims past their deadline; persist what became a dead letter.
    pub(super) fn expire(&mut self, key: ShardKey, name: &str, now: u64, ctx: &Ctx) {
        let Some(slot) = slot_in(&mut self.groups, key, name) else {
            return;
        };
        let expired = slot.group.expire(now);
        let c = ctx.counters;
        let mut dead = false;
        for e in &expired {
            match e.fate {
                Fate::Redeliver => CoreCounters::inc(&c.group_redeliveries),
                Fate::DeadLettered => {
                    CoreCounters::inc(&c.group_dead_letters);
                    dead = true;
                }
                Fate::Parked => {}
            }
        }
        if dead {
            self.persist(key, name, None);
        }
    }

    /// Hand what is eligible now to the waiting polls, in arrival order; answer the ones
    /// whose wait ended with no records.
    pub(super) fn serve_waiters(
        &mut self,
        key: ShardKey,
        name: &str,
        streams: &StreamHost<L>,
        ctx: &Ctx,
    ) {
        let now = self.now_ms(ctx);
        let Some(tail) = streams.tail(key) else {
            return;
        };
        loop {
            let draining = self.draining;
            let Some(slot) = slot_in(&mut self.groups, key, name) else {
                return;
            };
            if slot.deleting.is_some() {
                return;
            }
            slot.group.records_available(tail);
            // Waits that ended are answered whatever their place in line (a short wait behind
            // a long one must not wait for it).
            let (ended, waiting): (VecDeque<Waiter>, VecDeque<Waiter>) =
                std::mem::take(&mut slot.waiters)
                    .into_iter()
                    .partition(|w| w.until_ms <= now || draining);
            slot.waiters = waiting;
            if !ended.is_empty() {
                for w in ended {
                    self.reply(w.origin, empty_records(w.origin.request_id, key.1));
                }
                continue;
            }
            let Some(w) = slot.waiters.front() else { break };
            match slot.group.poll(w.max, w.visibility_timeout_ms, now) {
                Ok(claims) if claims.is_empty() => break,
                Ok(claims) => {
                    let w = slot.waiters.pop_front().expect("front checked");
                    self.send_claims(key, name.to_string(), w.origin, claims, streams, ctx);
                }
                Err(e) => {
                    let w = slot.waiters.pop_front().expect("front checked");
                    self.reply(w.origin, err_frame(w.origin.request_id, &e));
                }
            }
        }
        self.note_due(key, name);
    }

    /// Answer a poll with its claims: from the ring at once, or once the driver has read the
    /// missing payloads from the log (`ReadClaims`).
    fn send_claims(
        &mut self,
        key: ShardKey,
        name: String,
        origin: GroupOrigin,
        claims: Vec<Claim>,
        streams: &StreamHost<L>,
        ctx: &Ctx,
    ) {
        CoreCounters::add(&ctx.counters.group_claims, claims.len() as u64);
        let ring = streams.ring(key).expect("owner state of a durable shard");
        #[cfg(test)]
        let shift = u64::from(super::breaks::on(&super::breaks::PAYLOAD_SHIFTED));
        #[cfg(not(test))]
        let shift = 0;
        let payloads: Vec<Option<Bytes>> =
            claims.iter().map(|c| ring.get(c.offset + shift)).collect();
        if payloads.iter().all(Option::is_some) {
            let p = payloads
                .into_iter()
                .map(|p| Payload::Ready(p.expect("all present")))
                .collect();
            return self.finish_claims(key, &name, origin, claims, p, ctx);
        }
        let Some(log) = streams.log(key).cloned() else {
            let p = payloads.into_iter().map(|_| Payload::Failed).collect();
            return self.finish_claims(key, &name, origin, claims, p, ctx);
        };
        CoreCounters::inc(&ctx.counters.history_reads);
        self.effects.push(GroupEffect::ReadClaims {
            key,
            name,
            origin,
            claims,
            payloads,
            log,
        });
    }

    /// Answer a poll with the claims whose payloads are at hand, within the frame bound;
    /// release the rest (they go out again first), finish records retention removed.
    pub(crate) fn finish_claims(
        &mut self,
        key: ShardKey,
        name: &str,
        origin: GroupOrigin,
        claims: Vec<Claim>,
        payloads: Vec<Payload>,
        ctx: &Ctx,
    ) {
        debug_assert_eq!(claims.len(), payloads.len(), "a payload per claim");
        let now = self.now_ms(ctx);
        // GroupRecords: header 10, request_id 8, shard 4, visibility 8, claim count 4,
        // record count + region length 8; per record a 12-byte claim and a 4-byte length.
        // Config keeps max_payload_bytes 1 KiB under max_frame_bytes, and a Hello must announce
        // at least max_payload_bytes + 1 KiB, so one record fits either bound.
        let frame_max = self
            .cfg
            .max_frame_bytes
            .min(origin.frame_bytes_max as usize);
        let budget = frame_max - (10 + 8 + 4 + 8 + 4 + 8);
        let Some(slot) = slot_in(&mut self.groups, key, name) else {
            let msg = format!("consumer group {name} was deleted");
            return self.reply(
                origin,
                Frame::error(origin.request_id, ErrorCode::NotFound, msg),
            );
        };
        let mut kept: Vec<ClaimRef> = Vec::new();
        let mut bodies: Vec<Bytes> = Vec::new();
        let mut used = 0usize;
        let mut vt_ms = 0;
        let mut skipped = false;
        for (c, p) in claims.iter().zip(payloads) {
            // A claim that lapsed (or was reset by a seek) while its payload was read may be
            // out again under a newer delivery: it is not this poll's to send any more.
            if !slot.group.is_live(c.id(), now) {
                continue;
            }
            match p {
                Payload::Ready(b) if kept.is_empty() || used + 16 + b.len() <= budget => {
                    used += 16 + b.len();
                    vt_ms = c.deadline_ms.saturating_sub(now);
                    kept.push(ClaimRef {
                        offset: c.offset,
                        attempt: c.attempt,
                    });
                    bodies.push(b);
                }
                Payload::Gone => {
                    skipped |= slot.group.ack(c.id(), now).is_ok();
                }
                _ => {
                    let _ = slot.group.release(c.id(), now);
                }
            }
        }
        if skipped {
            self.persist(key, name, None);
        }
        let f = Frame::Group(GroupFrame::GroupRecords {
            request_id: origin.request_id,
            shard: key.1,
            visibility_timeout_ms: vt_ms,
            records: Records::encode(bodies.iter().map(|b| &b[..])),
            claims: kept,
        });
        self.reply(origin, f);
        // Released claims are eligible again now.
        self.due_ms = self.due_ms.min(now);
    }

    /// Delete a group: its waiting polls are answered `not_found`, and its file is removed
    /// once no write of it is in flight.
    fn delete(&mut self, origin: GroupOrigin, key: ShardKey, name: String) {
        let slot = self.slot_mut(key, &name);
        slot.deleting = Some(origin);
        let waiters: Vec<GroupOrigin> = slot.waiters.drain(..).map(|w| w.origin).collect();
        let writing = slot.writing;
        for o in waiters {
            let msg = format!("consumer group {name} was deleted");
            self.reply(o, Frame::error(o.request_id, ErrorCode::NotFound, msg));
        }
        if !writing {
            self.finish_delete(key, name);
        }
    }

    /// Cancel a waiting poll, matched to the original by its connection and request id.
    fn poll_cancel(&mut self, origin: GroupOrigin, key: ShardKey, name: &str) {
        let rid = origin.request_id;
        let slot = self.slot_mut(key, name);
        let pos = slot.waiters.iter().position(|w| {
            w.origin.core == origin.core
                && w.origin.conn == origin.conn
                && w.origin.request_id == rid
        });
        match pos.and_then(|p| slot.waiters.remove(p)) {
            Some(w) => self.reply(w.origin, empty_records(rid, key.1)),
            // Every request is answered: nothing of this connection's waits under that id
            // (the poll was answered already, or never waited).
            None => {
                let msg = format!(
                    "no poll {rid} of this connection is waiting on group {name} shard {}",
                    key.1
                );
                self.reply(origin, Frame::error(rid, ErrorCode::NotFound, msg));
            }
        }
    }

    /// Acks, nacks, extensions and rejections of claims, answered per claim.
    #[allow(clippy::too_many_arguments)]
    fn answer(
        &mut self,
        origin: GroupOrigin,
        key: ShardKey,
        name: &str,
        op: AnswerOp,
        claims: &[ClaimRef],
        now: u64,
        streams: &StreamHost<L>,
        ctx: &Ctx,
    ) {
        let rid = origin.request_id;
        let group = &mut self.slot_mut(key, name).group;
        let (codes, durable_change) = answer_claims(group, key.1, op, claims, now, ctx.counters);
        let f = Frame::Group(GroupFrame::GroupAnswered {
            request_id: rid,
            codes,
        });
        if durable_change {
            self.persist(key, name, Some((origin, f)));
        } else {
            self.reply(origin, f);
        }
        self.note_due(key, name);
        self.serve_waiters(key, name, streams, ctx);
    }

    #[allow(clippy::too_many_arguments)]
    fn seek(
        &mut self,
        origin: GroupOrigin,
        key: ShardKey,
        name: &str,
        offset: u64,
        oldest: u64,
        streams: &StreamHost<L>,
        ctx: &Ctx,
    ) {
        let rid = origin.request_id;
        if offset < oldest {
            let msg = format!("offset {offset} is below the oldest retained offset {oldest}");
            return self.reply(origin, Frame::error(rid, ErrorCode::RevisionTooOld, msg));
        }
        match self.slot_mut(key, name).group.seek(offset) {
            Err(e) => self.reply(origin, err_frame(rid, &e)),
            Ok(()) => {
                self.persist(key, name, Some((origin, ok(rid))));
                self.serve_waiters(key, name, streams, ctx);
            }
        }
    }

    /// GroupDescribe: the group's counts and settings, after expiring what lapsed.
    fn describe(&mut self, origin: GroupOrigin, key: ShardKey, name: &str, now: u64, ctx: &Ctx) {
        self.expire(key, name, now, ctx);
        let slot = &self.groups[&key].groups[name];
        let st = slot.group.stats();
        let cfg = slot.group.config();
        let info = GroupInfo {
            cursor: st.cursor,
            tail: st.tail,
            in_flight: st.in_flight,
            waiting: st.waiting,
            parked: st.parked,
            dead_letters: st.dead_letters,
            max_attempts: cfg.max_attempts,
            visibility_timeout_ms: cfg.default_visibility_timeout_ms,
        };
        let f = Frame::Group(GroupFrame::GroupInfo {
            request_id: origin.request_id,
            shard: key.1,
            info,
        });
        self.reply(origin, f);
    }

    /// GroupPoll: claims now, or a long poll that waits (bounded by `poll_wait_max_ms` and
    /// `poll_waiters_max`) for records to arrive.
    #[allow(clippy::too_many_arguments)]
    fn poll(
        &mut self,
        origin: GroupOrigin,
        key: ShardKey,
        name: String,
        (max, visibility_timeout_ms, wait_ms): (u32, u64, u64),
        now: u64,
        streams: &StreamHost<L>,
        ctx: &Ctx,
    ) {
        let vt = (visibility_timeout_ms > 0).then_some(visibility_timeout_ms);
        CoreCounters::inc(&ctx.counters.group_polls);
        self.expire(key, &name, now, ctx);
        let (draining, waiters_max, wait_max_ms) = (
            self.draining,
            self.cfg.poll_waiters_max,
            self.cfg.poll_wait_max_ms,
        );
        let slot = self.slot_mut(key, &name);
        match slot.group.poll(max, vt, now) {
            Err(e) => self.reply(origin, err_frame(origin.request_id, &e)),
            Ok(claims) if claims.is_empty() && wait_ms > 0 && !draining => {
                if slot.waiters.len() >= waiters_max {
                    let msg = format!(
                        "group {name} has {} polls waiting (group_poll_waiters_max)",
                        slot.waiters.len()
                    );
                    return self.reply(
                        origin,
                        Frame::error(origin.request_id, ErrorCode::InflightLimit, msg),
                    );
                }
                let wait = wait_ms.min(wait_max_ms);
                slot.waiters.push_back(Waiter {
                    origin,
                    max,
                    visibility_timeout_ms: vt,
                    until_ms: now.saturating_add(wait),
                });
                self.note_due(key, &name);
            }
            Ok(claims) => {
                self.note_due(key, &name);
                self.send_claims(key, name, origin, claims, streams, ctx);
            }
        }
    }
}

/// Apply a GroupAnswer's `op` to each claim: the answer codes (0 = done, else the registry
/// number) and whether the group's durable state changed (a write must cover the answer).
fn answer_claims(
    group: &mut Group,
    shard: u32,
    op: AnswerOp,
    claims: &[ClaimRef],
    now: u64,
    c: &CoreCounters,
) -> (Vec<u16>, bool) {
    let mut codes = Vec::with_capacity(claims.len());
    let mut durable_change = false;
    for cl in claims.iter() {
        let id = ClaimId {
            shard,
            offset: cl.offset,
            attempt: cl.attempt,
        };
        let r = match op {
            AnswerOp::Ack => group.ack(id, now).map(|_| {
                CoreCounters::inc(&c.group_acks);
                // Broken on purpose in the twin: the ack is answered before any write.
                #[cfg(test)]
                if super::breaks::on(&super::breaks::ACK_NOT_WRITTEN) {
                    return false;
                }
                true
            }),
            AnswerOp::Nack { delay_ms } => group.nack(id, delay_ms, now).map(|f| match f {
                Fate::Redeliver => {
                    CoreCounters::inc(&c.group_redeliveries);
                    false
                }
                Fate::DeadLettered => {
                    CoreCounters::inc(&c.group_dead_letters);
                    true
                }
                Fate::Parked => false,
            }),
            AnswerOp::Extend {
                visibility_timeout_ms,
            } => group.extend(id, visibility_timeout_ms, now).map(|_| false),
            AnswerOp::Reject => group.dead_letter(id, now).map(|f| {
                if f == Fate::DeadLettered {
                    CoreCounters::inc(&c.group_dead_letters);
                }
                true
            }),
        };
        codes.push(match r {
            Ok(changed) => {
                durable_change |= changed;
                0
            }
            Err(e) => {
                if matches!(e, GroupError::StaleClaim { .. }) {
                    CoreCounters::inc(&c.group_stale_answers);
                }
                group_code(&e).number()
            }
        });
    }
    (codes, durable_change)
}

/// A DeadLetterList page. It stays under the client's frame maximum (14 bytes an entry, 64
/// for the rest); the client pages on with next_after. An invalid ask (0, over 1000) is left
/// as asked so it is refused.
fn dead_letter_page(group: &Group, origin: &GroupOrigin, after: Option<u64>, limit: u32) -> Frame {
    let rid = origin.request_id;
    let fit = ((origin.frame_bytes_max as usize).saturating_sub(64) / 14).max(1);
    let limit = if limit <= 1000 {
        limit.min(fit as u32)
    } else {
        limit
    };
    match group.dead_letters(after, limit) {
        Err(e) => err_frame(rid, &e),
        Ok(page) => Frame::Group(GroupFrame::DeadLetterPage {
            request_id: rid,
            letters: page
                .letters
                .iter()
                .map(|d| DeadLetterRef {
                    offset: d.offset,
                    attempts: d.attempts,
                    reason: reason_code(d.reason),
                    redriving: d.redriving,
                })
                .collect(),
            next_after: page.next_after,
        }),
    }
}

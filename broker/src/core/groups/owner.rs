//! Consumer groups at the owner of their shard: requests applied to the pure group state,
//! long polls served as records arrive, claims answered with their payloads (ring or disk),
//! and the group clock (lapsed claims, ended waits).

use super::*;

impl CoreState {
    pub(in crate::core) fn note_group_due(&mut self, key: ShardKey, name: &str) {
        let Some(slot) = self.groups.get(&key).and_then(|g| g.groups.get(name)) else {
            return;
        };
        let w = slot.waiters.iter().map(|w| w.until_ms).min();
        for d in [slot.group.next_wakeup_ms(), w].into_iter().flatten() {
            self.group_due_ms = self.group_due_ms.min(d);
        }
    }

    /// When the flusher must run the group timers next, if anything is timed.
    pub(in crate::core) fn group_timeout(&self) -> Option<Duration> {
        if self.group_due_ms == u64::MAX {
            return None;
        }
        Some(Duration::from_millis(
            self.group_due_ms.saturating_sub(self.group_now_ms()),
        ))
    }

    // ---------- owner side ----------

    pub(in crate::core) fn on_group(
        &mut self,
        origin: GroupOrigin,
        stream: u32,
        frame: GroupFrame,
    ) {
        let rid = origin.request_id;
        let target = frame
            .target()
            .cloned()
            .expect("routed requests name a group");
        let key = (stream, target.shard);
        let Some((log, tail)) = self.group_log(origin, key) else {
            return;
        };
        let name = target.group.clone();
        if let GroupFrame::GroupCreate {
            start,
            max_attempts,
            visibility_timeout_ms,
            ..
        } = frame
        {
            return self.group_create(
                origin,
                key,
                name,
                &log,
                tail,
                start,
                max_attempts,
                visibility_timeout_ms,
            );
        }
        if let Some(why) = self.groups.get(&key).and_then(|g| g.broken.get(&name)) {
            if matches!(frame, GroupFrame::GroupDelete { .. }) {
                return self.group_delete_broken(origin, key, name);
            }
            let msg = format!("group {name} could not be read at open: {why}");
            return self.group_reply(origin, Frame::error(rid, ErrorCode::Unavailable, msg));
        }
        let now = self.group_now_ms();
        let oldest = log.oldest_offset();
        let Some(slot) = self
            .groups
            .get_mut(&key)
            .and_then(|g| g.groups.get_mut(&name))
            .filter(|s| s.deleting.is_none())
        else {
            let msg = format!(
                "no consumer group {name} on shard {} of {}",
                target.shard, target.stream
            );
            return self.group_reply(origin, Frame::error(rid, ErrorCode::NotFound, msg));
        };
        slot.group.records_available(tail);
        // Records retention deleted are finished for the group (skipped), never handed out.
        if slot.group.cursor() < oldest {
            let _ = slot.group.seek(oldest);
        }
        match frame {
            GroupFrame::GroupCreate { .. } => unreachable!("handled above"),
            GroupFrame::GroupDelete { .. } => self.group_delete(origin, key, name),
            GroupFrame::GroupDescribe { .. } => self.group_describe(origin, key, &name, now),
            GroupFrame::GroupPoll {
                max,
                visibility_timeout_ms,
                wait_ms,
                ..
            } => self.group_poll(origin, key, name, max, visibility_timeout_ms, wait_ms, now),
            GroupFrame::GroupPollCancel { .. } => self.group_poll_cancel(origin, key, &name),
            GroupFrame::GroupAnswer { op, claims, .. } => {
                self.group_answer(origin, key, &name, op, &claims, now)
            }
            GroupFrame::GroupSeek { to, .. } => {
                let offset = match to {
                    StartAt::Latest => tail,
                    StartAt::Earliest => oldest,
                    StartAt::Offset(o) => o,
                };
                self.group_seek(origin, key, &name, offset, oldest)
            }
            GroupFrame::DeadLetterList { after, limit, .. } => {
                let f = dead_letter_page(&slot.group, &origin, after, limit);
                self.group_reply(origin, f);
            }
            GroupFrame::DeadLetterOp { action, offset, .. } => {
                let r = match action {
                    DeadLetterAction::Redrive => slot.group.redrive(offset),
                    DeadLetterAction::Discard => slot.group.discard(offset).map(|_| ()),
                };
                match r {
                    Err(e) => self.group_reply(origin, err_frame(rid, &e)),
                    Ok(()) => {
                        self.persist_group(key, &name, Some((origin, ok(rid))));
                        self.serve_waiters(key, &name);
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
    pub(in crate::core) fn expire_group(&mut self, key: ShardKey, name: &str, now: u64) {
        let Some(slot) = self
            .groups
            .get_mut(&key)
            .and_then(|g| g.groups.get_mut(name))
        else {
            return;
        };
        let expired = slot.group.expire(now);
        let c = self.s.counters.clone();
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
            self.persist_group(key, name, None);
        }
    }

    /// Hand what is eligible now to the waiting polls, in arrival order; answer the ones
    /// whose wait ended with no records.
    pub(in crate::core) fn serve_waiters(&mut self, key: ShardKey, name: &str) {
        let now = self.group_now_ms();
        let Some(tail) = self.streams.tail(key) else {
            return;
        };
        loop {
            let draining = self.draining;
            let Some(slot) = self
                .groups
                .get_mut(&key)
                .and_then(|g| g.groups.get_mut(name))
            else {
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
                    self.group_reply(w.origin, empty_records(w.origin.request_id, key.1));
                }
                continue;
            }
            let Some(w) = slot.waiters.front() else { break };
            match slot.group.poll(w.max, w.visibility_timeout_ms, now) {
                Ok(claims) if claims.is_empty() => break,
                Ok(claims) => {
                    let w = slot.waiters.pop_front().unwrap();
                    self.send_claims(key, name.to_string(), w.origin, claims);
                }
                Err(e) => {
                    let w = slot.waiters.pop_front().unwrap();
                    self.group_reply(w.origin, err_frame(w.origin.request_id, &e));
                }
            }
        }
        self.note_group_due(key, name);
    }

    /// New records were committed on a durable shard: serve its waiting polls.
    pub(in crate::core) fn groups_records_committed(&mut self, key: ShardKey) {
        let names: Vec<String> = match self.groups.get(&key) {
            Some(sg) => sg
                .groups
                .iter()
                .filter(|(_, s)| !s.waiters.is_empty())
                .map(|(n, _)| n.clone())
                .collect(),
            None => return,
        };
        for n in names {
            self.serve_waiters(key, &n);
        }
    }

    /// The group timers (run by the flusher): lapse claims, end waits, serve waiters.
    pub(in crate::core) fn groups_tick(&mut self) {
        let now = self.group_now_ms();
        if now < self.group_due_ms && (!self.draining || self.groups_idle()) {
            return;
        }
        self.group_due_ms = u64::MAX;
        let all: Vec<(ShardKey, String)> = self
            .groups
            .iter()
            .flat_map(|(k, sg)| sg.groups.keys().map(move |n| (*k, n.clone())))
            .collect();
        for (key, name) in all {
            self.expire_group(key, &name, now);
            self.serve_waiters(key, &name);
        }
    }

    /// Read the claimed records' payloads (tail cache, else disk) and answer the poll.
    pub(in crate::core) fn send_claims(
        &mut self,
        key: ShardKey,
        name: String,
        origin: GroupOrigin,
        claims: Vec<Claim>,
    ) {
        CoreCounters::add(&self.s.counters.group_claims, claims.len() as u64);
        let ring = self
            .streams
            .ring(key)
            .expect("owner state of a durable shard");
        let payloads: Vec<Option<Bytes>> = claims.iter().map(|c| ring.get(c.offset)).collect();
        if payloads.iter().all(Option::is_some) {
            let p = payloads
                .into_iter()
                .map(|p| Payload::Ready(p.unwrap()))
                .collect();
            return self.finish_claims(key, &name, origin, claims, p);
        }
        let Some(log) = self.streams.log(key).cloned() else {
            let p = payloads.into_iter().map(|_| Payload::Failed).collect();
            return self.finish_claims(key, &name, origin, claims, p);
        };
        let bytes_max = self.s.cfg.history_fetch_bytes;
        let me = self.me.clone();
        CoreCounters::inc(&self.s.counters.history_reads);
        let pass = self.group_tasks.enter();
        glommio::spawn_local(async move {
            let mut out: Vec<Payload> = Vec::with_capacity(claims.len());
            let mut i = 0;
            while i < claims.len() {
                if let Some(p) = &payloads[i] {
                    out.push(Payload::Ready(p.clone()));
                    i += 1;
                    continue;
                }
                // A run of consecutive missing offsets: one read (or a few, by bytes).
                let mut j = i + 1;
                while j < claims.len()
                    && payloads[j].is_none()
                    && claims[j].offset == claims[j - 1].offset + 1
                {
                    j += 1;
                }
                while i < j {
                    let from = claims[i].offset;
                    match log.read(from, j - i, bytes_max).await {
                        Ok(recs) if !recs.is_empty() => {
                            for r in recs.into_iter().take(j - i) {
                                debug_assert_eq!(r.offset, claims[i].offset);
                                out.push(Payload::Ready(r.payload));
                                i += 1;
                            }
                        }
                        Err(LogError::BelowRetention { .. }) => {
                            out.push(Payload::Gone);
                            i += 1;
                        }
                        _ => {
                            out.push(Payload::Failed);
                            i += 1;
                        }
                    }
                }
            }
            reenter(&me, move |st| {
                drop(pass);
                st.finish_claims(key, &name, origin, claims, out);
            });
        })
        .detach();
    }

    /// Answer a poll with the claims whose payloads are at hand, within the frame bound;
    /// release the rest (they go out again first), finish records retention removed.
    pub(in crate::core) fn finish_claims(
        &mut self,
        key: ShardKey,
        name: &str,
        origin: GroupOrigin,
        claims: Vec<Claim>,
        payloads: Vec<Payload>,
    ) {
        let now = self.group_now_ms();
        // GroupRecords: header 10, request_id 8, shard 4, visibility 8, claim count 4,
        // record count + region length 8; per record a 12-byte claim and a 4-byte length.
        // Config keeps max_payload_bytes 1 KiB under max_frame_bytes, and a Hello must announce
        // at least max_payload_bytes + 1 KiB, so one record fits either bound.
        let frame_max = self
            .s
            .cfg
            .max_frame_bytes
            .min(origin.frame_bytes_max as usize);
        let budget = frame_max - (10 + 8 + 4 + 8 + 4 + 8);
        let Some(slot) = self
            .groups
            .get_mut(&key)
            .and_then(|g| g.groups.get_mut(name))
        else {
            let msg = format!("consumer group {name} was deleted");
            return self.group_reply(
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
            self.persist_group(key, name, None);
        }
        let f = Frame::Group(GroupFrame::GroupRecords {
            request_id: origin.request_id,
            shard: key.1,
            visibility_timeout_ms: vt_ms,
            records: Records::encode(bodies.iter().map(|b| &b[..])),
            claims: kept,
        });
        self.group_reply(origin, f);
        // Released claims are eligible again now.
        self.group_due_ms = self.group_due_ms.min(now);
    }
}

impl CoreState {
    /// GroupDescribe: the group's counts and settings, after expiring what lapsed.
    /// A group request's shard must be served here with its log open: the log and the
    /// shard's tail, or the refusal is answered and None returned.
    fn group_log(&mut self, origin: GroupOrigin, key: ShardKey) -> Option<(Log, u64)> {
        let rid = origin.request_id;
        if let Err((code, msg)) = self.catalog.serve_check(key.0, key.1) {
            self.group_reply(origin, Frame::error(rid, code, msg));
            return None;
        }
        if self.catalog.replicated(key.0, key.1) {
            // A group's cursor would have to hold at the commit mark and skip the
            // generation-start records: not built yet (issue 23).
            let msg = "consumer groups on a replicated stream are not served by this build yet";
            self.group_reply(origin, Frame::error(rid, ErrorCode::Unsupported, msg));
            return None;
        }
        let log = match self.streams.usable(key) {
            Some(Ok(log)) => log.clone(),
            Some(Err(why)) => {
                self.group_reply(origin, why.frame(rid));
                return None;
            }
            None => {
                let msg = "the shard's log is not open on its owner";
                self.group_reply(origin, Frame::error(rid, ErrorCode::Unavailable, msg));
                return None;
            }
        };
        let tail = self.streams.tail(key).expect("a durable shard has state");
        Some((log, tail))
    }

    fn slot_mut(&mut self, key: ShardKey, name: &str) -> &mut GroupSlot {
        self.groups
            .get_mut(&key)
            .and_then(|g| g.groups.get_mut(name))
            .expect("checked by on_group")
    }

    /// Delete a group: its waiting polls are answered `not_found`, and its file is removed
    /// once no write of it is in flight.
    fn group_delete(&mut self, origin: GroupOrigin, key: ShardKey, name: String) {
        let slot = self.slot_mut(key, &name);
        slot.deleting = Some(origin);
        let waiters: Vec<GroupOrigin> = slot.waiters.drain(..).map(|w| w.origin).collect();
        let writing = slot.writing;
        for o in waiters {
            let msg = format!("consumer group {name} was deleted");
            self.group_reply(o, Frame::error(o.request_id, ErrorCode::NotFound, msg));
        }
        if !writing {
            self.finish_delete(key, name);
        }
    }

    /// Cancel a waiting poll, matched to the original by its connection and request id.
    fn group_poll_cancel(&mut self, origin: GroupOrigin, key: ShardKey, name: &str) {
        let rid = origin.request_id;
        let slot = self.slot_mut(key, name);
        let pos = slot.waiters.iter().position(|w| {
            w.origin.core == origin.core
                && w.origin.conn == origin.conn
                && w.origin.request_id == rid
        });
        match pos.and_then(|p| slot.waiters.remove(p)) {
            Some(w) => self.group_reply(w.origin, empty_records(rid, key.1)),
            // Every request is answered: nothing of this connection's waits under that id
            // (the poll was answered already, or never waited).
            None => {
                let msg = format!(
                    "no poll {rid} of this connection is waiting on group {name} shard {}",
                    key.1
                );
                self.group_reply(origin, Frame::error(rid, ErrorCode::NotFound, msg));
            }
        }
    }

    /// Acks, nacks, extensions and rejections of claims, answered per claim.
    fn group_answer(
        &mut self,
        origin: GroupOrigin,
        key: ShardKey,
        name: &str,
        op: felix_quic::wire::AnswerOp,
        claims: &[felix_quic::wire::ClaimRef],
        now: u64,
    ) {
        let rid = origin.request_id;
        let (codes, durable_change) = answer_claims(
            &mut self
                .groups
                .get_mut(&key)
                .and_then(|g| g.groups.get_mut(name))
                .expect("checked by on_group")
                .group,
            key.1,
            op,
            claims,
            now,
            &self.s.counters,
        );
        let f = Frame::Group(GroupFrame::GroupAnswered {
            request_id: rid,
            codes,
        });
        if durable_change {
            self.persist_group(key, name, Some((origin, f)));
        } else {
            self.group_reply(origin, f);
        }
        self.note_group_due(key, name);
        self.serve_waiters(key, name);
    }

    fn group_seek(
        &mut self,
        origin: GroupOrigin,
        key: ShardKey,
        name: &str,
        offset: u64,
        oldest: u64,
    ) {
        let rid = origin.request_id;
        if offset < oldest {
            let msg = format!("offset {offset} is below the oldest retained offset {oldest}");
            return self.group_reply(origin, Frame::error(rid, ErrorCode::RevisionTooOld, msg));
        }
        match self.slot_mut(key, name).group.seek(offset) {
            Err(e) => self.group_reply(origin, err_frame(rid, &e)),
            Ok(()) => {
                self.persist_group(key, name, Some((origin, ok(rid))));
                self.serve_waiters(key, name);
            }
        }
    }

    fn group_describe(&mut self, origin: GroupOrigin, key: ShardKey, name: &str, now: u64) {
        self.expire_group(key, name, now);
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
        self.group_reply(origin, f);
    }

    /// GroupPoll: claims now, or a long poll that waits (bounded by `group_poll_wait_max_ms`
    /// and `group_poll_waiters_max`) for records to arrive.
    #[allow(clippy::too_many_arguments)]
    fn group_poll(
        &mut self,
        origin: GroupOrigin,
        key: ShardKey,
        name: String,
        max: u32,
        visibility_timeout_ms: u64,
        wait_ms: u64,
        now: u64,
    ) {
        let vt = (visibility_timeout_ms > 0).then_some(visibility_timeout_ms);
        CoreCounters::inc(&self.s.counters.group_polls);
        self.expire_group(key, &name, now);
        let slot = self
            .groups
            .get_mut(&key)
            .unwrap()
            .groups
            .get_mut(&name)
            .unwrap();
        match slot.group.poll(max, vt, now) {
            Err(e) => self.group_reply(origin, err_frame(origin.request_id, &e)),
            Ok(claims) if claims.is_empty() && wait_ms > 0 && !self.draining => {
                if slot.waiters.len() >= self.s.cfg.group_poll_waiters_max as usize {
                    let msg = format!(
                        "group {name} has {} polls waiting (group_poll_waiters_max)",
                        slot.waiters.len()
                    );
                    return self.group_reply(
                        origin,
                        Frame::error(origin.request_id, ErrorCode::InflightLimit, msg),
                    );
                }
                let wait = wait_ms.min(self.s.cfg.group_poll_wait_max_ms);
                slot.waiters.push_back(Waiter {
                    origin,
                    max,
                    visibility_timeout_ms: vt,
                    until_ms: now.saturating_add(wait),
                });
                self.note_group_due(key, &name);
            }
            Ok(claims) => {
                self.note_group_due(key, &name);
                self.send_claims(key, name, origin, claims);
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

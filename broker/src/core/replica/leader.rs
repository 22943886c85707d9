//! The leader's side of the replica machine: election when the fence completes and the
//! generation-start record (rules 3 and 6), lease renewal (rule 2), shipping to the
//! followers (rule 6), and reports to placement, the commit mark and the acknowledgements it
//! releases (rule 7).

use super::{
    breaks, Effect, Holding, Lead, Lease, Msg, NodeId, Peer, Pos, Replica, Report, ReportAnswer,
    Role, Shipped, Source, StorageId,
};

/// Unanswered records a leader keeps in flight to one follower, at most, in whole batches of
/// `ReplicaCfg::batch_max` records (a partial batch waits for the answer to the one in
/// flight).
const SHIP_WINDOW_BATCHES: u64 = 8;

impl Replica {
    /// Ask the replicas to renew the lease if due: an exchange sent now (rule 2).
    pub(super) fn renew(&mut self, now_ms: u64) {
        let Some(l) = self.lease.as_mut() else { return };
        if !l.due(now_ms, &self.cfg) {
            return;
        }
        let (gen, round) = (l.gen, l.ask(self.me, now_ms));
        for to in self.others() {
            let leader = self.me;
            self.send(to, Msg::LeaseAsk { gen, leader, round });
        }
        // A replica set of one is its own majority.
        let majority = self.majority();
        if let Some(l) = self.lease.as_mut() {
            l.granted(round, self.me, majority, &self.cfg);
        }
    }

    /// A majority promised (of the set and of the settled set, rule 11): lead. The generation-start record goes first (rule 6), then
    /// every follower that answered is shipped to from the end it reported.
    pub(super) fn maybe_elected(&mut self, now_ms: u64) {
        let Role::Fencing { gen, answered } = &self.role else {
            return;
        };
        if !self.fence_complete(answered.keys()) {
            return;
        }
        let (gen, answered) = (*gen, answered.clone());
        let end = self.log.end();
        // Shipped to: the answering replicas of this generation's set (one of the settled set
        // only answered the fence, rule 11, and is no longer a replica).
        let peers = answered
            .into_iter()
            .filter(|(n, _)| *n != self.me && self.set.contains(n))
            .map(|(n, e)| {
                let peer = Peer {
                    next: e.min(end),
                    sent: e.min(end),
                    held: None,
                };
                (n, peer)
            })
            .collect();
        // The mark starts at the generation-start record: records of earlier generations
        // commit only with a record of this one (rule 7).
        self.role = Role::Leading(Lead {
            gen,
            peers,
            commit: end,
            first: end,
            acked: end + 1,
            gave_up: end + 1,
            waits: std::collections::VecDeque::new(),
            reports_out: 0,
            report_seq: 0,
            report_due: true,
            resigned_ms: None,
        });
        self.lease = Some(Lease::new(gen, now_ms, &self.cfg));
        self.effects.push(Effect::Elected { gen });
        self.append(vec![gen], Source::Start);
        self.renew(now_ms);
        self.ship_all(true);
        self.report(false);
    }

    /// Ship to every follower: `again` from what each last answered (a tick: shipments may
    /// be lost, and the followers learn the mark), else only what was not shipped yet.
    pub(super) fn ship_all(&mut self, again: bool) {
        let peers: Vec<NodeId> = match &self.role {
            Role::Leading(l) => l.peers.keys().copied().collect(),
            _ => return,
        };
        for p in peers {
            self.ship(p, again);
        }
    }

    /// One shipment to `to`: from its `next` when `again`, else from what was shipped last
    /// (pipelined, nothing when nothing is new or [`SHIP_WINDOW_BATCHES`] shipments are
    /// unanswered).
    pub(super) fn ship(&mut self, to: NodeId, again: bool) {
        let end = self.log.end();
        let base = self.log.base();
        let batch_max = self.cfg.batch_max as u64;
        let Role::Leading(l) = &mut self.role else {
            return;
        };
        let Some(peer) = l.peers.get_mut(&to) else {
            return;
        };
        // A follower that needs records from below this log's base (retention removed them,
        // rule 10) is shipped from the base, with no generation before it to match: it
        // agrees there, or rebuilds its log from the base (`follower.rs`).
        if peer.next < base {
            peer.next = base;
            peer.sent = peer.sent.max(base);
        }
        let start = if !again {
            let from = peer.sent.max(peer.next);
            let waiting = end.saturating_sub(from);
            // While a shipment is unanswered, new records wait for its answer unless a whole
            // batch is ready (and the window has room): one shipment per answer, not one per
            // record, so a follower's answers cannot flood the leader's inputs.
            let in_flight = peer.sent > peer.next;
            let window_full = peer.sent >= peer.next + SHIP_WINDOW_BATCHES * batch_max;
            if waiting == 0 || (in_flight && (waiting < batch_max || window_full)) {
                return;
            }
            from
        } else {
            peer.next.min(end)
        };
        let upto = (start + batch_max).min(end);
        peer.sent = peer.sent.max(upto);
        let gen = l.gen;
        let commit = l.known(self.known_commit);
        let from_base = start == base && base > 0;
        if from_base && upto == start {
            return; // nothing to match a rebuild against (a leader holds its start record)
        }
        let prev_gen = if from_base {
            None
        } else {
            start.checked_sub(1).map(|p| self.log.gen_at(p))
        };
        let gens = self.log.gens(start..upto);
        self.send(
            to,
            Msg::Ship {
                gen,
                leader: self.me,
                start,
                prev_gen,
                commit,
                gens,
            },
        );
    }

    pub(super) fn on_ship_answer(
        &mut self,
        gen: u64,
        from: NodeId,
        sid: StorageId,
        shipped: Shipped,
        now_ms: u64,
    ) {
        let len = self.log.end();
        let Role::Leading(l) = &mut self.role else {
            return;
        };
        let Some(peer) = l.peers.get_mut(&from) else {
            return;
        };
        if l.gen != gen {
            return;
        }
        match shipped {
            Shipped::Holds { end } => {
                debug_assert!(end <= len, "a follower holds {end} of a log of {len}");
                // Under one identity a follower's agreement with this leader only grows; an
                // answer under another identity replaces what the older one said (if it is
                // the stale one, placement will not count it: rule 9).
                let held = match peer.held {
                    Some((h, s)) if s == sid => h.max(end),
                    _ => end,
                };
                if peer.held != Some((held, sid)) {
                    peer.held = Some((held, sid));
                    l.report_due = true;
                }
                peer.next = end;
                peer.sent = peer.sent.max(end);
                if end < len {
                    self.ship(from, false);
                }
                self.report(false);
            }
            Shipped::Mismatch { below } => {
                peer.next = below.min(peer.next.saturating_sub(1));
                peer.sent = peer.next;
                self.ship(from, true);
            }
        }
        if breaks::on(&breaks::ACK_BEFORE_REPORT) {
            self.commit_on_answers(now_ms);
        }
    }

    /// Send placement a report of who holds what (rule 7): this leader at its log end, and
    /// every follower at the end and under the identity of its last answer. At most
    /// [`super::REPORTS_IN_FLIGHT_MAX`] are in flight, unless `again` (a tick: those in flight
    /// may be lost).
    pub(super) fn report(&mut self, again: bool) {
        let Role::Leading(l) = &self.role else { return };
        let send = if again {
            l.report_due || l.reports_out > 0
        } else {
            l.report_due && l.reports_out < super::REPORTS_IN_FLIGHT_MAX
        };
        if !send {
            return;
        }
        let pos_at = |end: u64| Pos {
            last_gen: self.log.gen_before(end),
            end,
        };
        let mut holders = vec![Holding {
            node: self.me,
            pos: pos_at(self.log.end()),
            sid: self.sid,
        }];
        for (&node, p) in &l.peers {
            if let Some((end, sid)) = p.held {
                let pos = pos_at(end);
                holders.push(Holding { node, pos, sid });
            }
        }
        let (gen, seq) = (l.gen, l.report_seq + 1);
        let report = Report {
            gen,
            leader: self.me,
            seq,
            holders,
            resign: l.resigned_ms.is_some(),
            // The machine knows records, not bytes: the driver fills these in from its log.
            behind_bytes: Default::default(),
        };
        if let Role::Leading(l) = &mut self.role {
            // A tick sends again what may have been lost: the reports counted out before it
            // are taken for lost (an answer that comes anyway only lowers the count).
            l.reports_out = if again { 1 } else { l.reports_out + 1 };
            l.report_due = false;
            l.report_seq = seq;
        }
        self.effects.push(Effect::Report(report));
    }

    /// A leader that has held no lease for a whole lease period cannot reach a majority (its
    /// followers are down, or cut off from it while it still reaches placement): it says so
    /// in a report, again every lease period while it lasts, and placement names another
    /// leader if one qualifies (`Placement::resign`). Once it holds a lease again, its next
    /// report withdraws that.
    pub(super) fn resign_if_stranded(&mut self, now_ms: u64) {
        let lapsed = self.lease.as_ref().map_or(0, |l| l.lapsed_ms(now_ms));
        let lease_ms = self.cfg.lease_ms;
        let Role::Leading(l) = &mut self.role else {
            return;
        };
        if lapsed < lease_ms {
            if l.resigned_ms.take().is_some() {
                l.report_due = true;
            }
            return;
        }
        if l.resigned_ms.is_none_or(|t| now_ms >= t + lease_ms) {
            l.resigned_ms = Some(now_ms);
            l.report_due = true;
        }
    }

    /// Placement answered a report. A landed report moves the commit mark, on what it
    /// counted only (rule 7); a refused one means placement names someone else now.
    pub(crate) fn on_report_answer(&mut self, answer: ReportAnswer, now_ms: u64) {
        match answer {
            ReportAnswer::Landed { gen, counted } => {
                if self.leading() != Some(gen) {
                    return;
                }
                let ends: Vec<u64> = counted
                    .iter()
                    .filter(|h| self.on_my_log(h.pos))
                    .map(|h| h.pos.end)
                    .collect();
                self.commit_to(ends);
                if let Role::Leading(l) = &mut self.role {
                    l.reports_out = l.reports_out.saturating_sub(1);
                }
                self.report(false);
                self.release(now_ms);
            }
            // A newer report landed (or will): its own answer moves the mark.
            ReportAnswer::Stale { gen, .. } => {
                if self.leading() == Some(gen) {
                    if let Role::Leading(l) = &mut self.role {
                        l.reports_out = l.reports_out.saturating_sub(1);
                    }
                    self.report(false);
                }
            }
            ReportAnswer::Refused { gen, newest } => {
                if self.taken() == Some(gen) {
                    debug_assert!(newest >= gen);
                    self.step_down();
                }
            }
        }
    }

    /// Whether a reported position is on this leader's log (the holder agrees with it there).
    fn on_my_log(&self, pos: Pos) -> bool {
        pos.end <= self.log.end() && self.log.gen_before(pos.end) == pos.last_gen
    }

    /// Move the mark to the highest end a majority holds, if the record below it is of this
    /// leader's generation (rule 7); `ends` names each holder once.
    fn commit_to(&mut self, mut ends: Vec<u64>) {
        let majority = self.majority();
        let Role::Leading(l) = &mut self.role else {
            return;
        };
        if ends.len() < majority {
            return;
        }
        ends.sort_unstable_by(|a, b| b.cmp(a));
        let e = ends[majority - 1];
        if e > l.commit && self.log.gen_before(e) == l.gen {
            l.commit = e;
        }
        debug_assert!(l.commit <= self.log.end());
    }

    /// The twin of rule 7 (`breaks::ACK_BEFORE_REPORT`): the mark moves on the followers'
    /// answers, with no report landed.
    fn commit_on_answers(&mut self, now_ms: u64) {
        let Role::Leading(l) = &self.role else { return };
        let mut ends = vec![self.log.end()];
        ends.extend(l.peers.values().filter_map(|p| p.held.map(|(e, _)| e)));
        self.commit_to(ends);
        self.release(now_ms);
    }

    /// Answer "cannot vouch" for the publishes whose quorum wait ran out at `now_ms` (rule 7).
    pub(super) fn give_up(&mut self, now_ms: u64) {
        let Role::Leading(l) = &mut self.role else {
            return;
        };
        let mut upto = None;
        while let Some(&(at, deadline_ms)) = l.waits.front() {
            if at < l.acked {
                l.waits.pop_front(); // acknowledged meanwhile
            } else if deadline_ms <= now_ms {
                upto = Some(at + 1);
                l.waits.pop_front();
            } else {
                break;
            }
        }
        let from = l.acked.max(l.gave_up);
        if let Some(below) = upto.filter(|&b| b > from) {
            l.gave_up = below;
            self.effects.push(Effect::CannotVouch { from, below });
        }
    }

    /// Acknowledge what the mark passed, if the lease is held now (rule 2: a leader checks
    /// its lease before every write it acknowledges).
    pub(super) fn release(&mut self, now_ms: u64) {
        if !self.serving(now_ms) {
            return;
        }
        let Role::Leading(l) = &mut self.role else {
            return;
        };
        if l.commit > l.acked {
            let from = l.acked;
            l.acked = l.commit;
            self.effects.push(Effect::Ack {
                from,
                below: l.commit,
            });
        }
    }
}

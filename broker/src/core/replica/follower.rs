//! The follower's side of the replica machine: which generations and leaders it takes
//! messages from (rules 3 and 5), its answer to a fence, and log shipping's receiving end
//! (rule 6). Every answer names this replica's storage identity (rule 9).

use super::{breaks, Durable, Effect, GenLog, Msg, NodeId, Replica, Shipped, Source};

impl Replica {
    /// Whether a message of generation `gen` from `leader` is taken (rules 3 and 5): a lower
    /// generation never; the promised one only from the leader accepted at it.
    pub(super) fn accepts(&self, gen: u64, leader: NodeId) -> bool {
        let d = &self.durable;
        if breaks::on(&breaks::NO_BALLOT) {
            return gen >= d.promised;
        }
        gen > d.promised || (gen == d.promised && d.ballot.is_none_or(|b| b == leader))
    }

    /// Whether this replica takes records and lease exchanges of `gen` from `leader`: only
    /// from the leader whose fence it answered, at the generation it promised.
    pub(super) fn takes_from(&self, gen: u64, leader: NodeId) -> bool {
        if breaks::on(&breaks::NO_FENCE) && gen < self.durable.promised {
            return true;
        }
        gen == self.durable.promised && self.durable.ballot == Some(leader)
    }

    pub(super) fn refuse(&mut self, to: NodeId, gen: u64) {
        let promised = self.durable.promised;
        self.send(
            to,
            Msg::Refuse {
                gen,
                from: self.me,
                promised,
            },
        );
    }

    pub(super) fn on_fence(&mut self, gen: u64, leader: NodeId) {
        if !self.accepts(gen, leader) {
            return self.refuse(leader, gen);
        }
        if self.taken().is_some_and(|m| m < gen) {
            self.step_down();
        }
        if self.durable.promised != gen || self.durable.ballot != Some(leader) {
            let led = self.durable.led;
            self.persist(Durable {
                promised: gen,
                ballot: Some(leader),
                led,
            });
        }
        let end = self.log.end();
        self.send(
            leader,
            Msg::FenceAnswer {
                gen,
                from: self.me,
                end,
            },
        );
    }

    /// Rule 6, the follower's side: take records only from the leader accepted at the
    /// promised generation; find where the logs agree; drop a divergent suffix; append.
    pub(super) fn on_ship(
        &mut self,
        gen: u64,
        leader: NodeId,
        start: u64,
        prev_gen: Option<u64>,
        commit: u64,
        gens: Vec<u64>,
    ) {
        // Only a leader whose fence this replica answered ships to it: a higher generation it
        // has not promised is refused too (that leader fences it first).
        if !self.takes_from(gen, leader) || self.leading().is_some() {
            return self.refuse(leader, gen);
        }
        if breaks::on(&breaks::COMMIT_BEFORE_MATCH) {
            self.known_commit = self.known_commit.max(commit.min(self.log.end()));
        }
        let end = self.log.end();
        let (me, sid) = (self.me, self.sid);
        let answer = move |shipped| Msg::ShipAnswer {
            gen,
            from: me,
            sid,
            shipped,
        };
        if prev_gen.is_none() && start > 0 && !breaks::on(&breaks::NO_REBUILD) {
            // The leader ships from its base (rule 10): it holds nothing below `start` to
            // match this log against.
            if gens.is_empty() {
                return;
            }
            if !self.agrees_below(start, gens[0]) {
                self.rebuild(start);
            }
        } else {
            if start > end {
                let a = answer(Shipped::Mismatch { below: end });
                return self.send(leader, a);
            }
            // Below this log's base the records were committed: they agree with the leader's.
            if let (Some(p), Some(pg)) = (start.checked_sub(1), prev_gen) {
                if p >= self.log.base() && self.log.gen_at(p) != pg {
                    let a = answer(Shipped::Mismatch { below: p });
                    return self.send(leader, a);
                }
            }
        }
        // The first record that differs (by generation) starts what is appended.
        let mut skip = 0;
        while skip < gens.len() {
            let at = start + skip as u64;
            if at >= self.log.end() {
                break;
            }
            if at < self.log.base() {
                skip += 1; // committed, and trimmed here: the leader's record alike
                continue;
            }
            if self.log.gen_at(at) != gens[skip] && !breaks::on(&breaks::NO_TRUNCATE) {
                self.truncate(at);
                break;
            }
            skip += 1;
        }
        let n = gens.len() as u64;
        self.append(gens[skip..].to_vec(), Source::Shipment { skip });
        // The log now agrees with the leader's below `start + n`: what of it lies below the
        // leader's mark is committed (rule 7).
        self.known_commit = self.known_commit.max(commit.min(start + n));
        let a = answer(Shipped::Holds { end: start + n });
        self.send(leader, a);
    }

    /// Whether this log agrees with a leader's below `base`, the leader's own base, where its
    /// record is of generation `first_gen`. It does when it holds nothing from before `base`
    /// that could differ: its own base is at or past it (what it holds below its base was
    /// committed). Or when it holds a record of that generation at `base`: only that
    /// generation's leader wrote records of it, and shipped them matched (rule 6), so the
    /// logs agree below it too.
    fn agrees_below(&self, base: u64, first_gen: u64) -> bool {
        self.log.base() >= base || (base < self.log.end() && self.log.gen_at(base) == first_gen)
    }

    /// Drop the whole log and go on at `base` (rule 10): the leader holds nothing below it,
    /// and this log may differ from the leader's there. Everything below `base` is committed
    /// (a leader trims only below the mark it knows), and this log's own records it knew
    /// committed are below `base` too: a record it knew committed at or past `base` would be
    /// the leader's record there, and [`Replica::agrees_below`] would have held.
    fn rebuild(&mut self, base: u64) {
        debug_assert!(self.known_commit <= base, "{} > {base}", self.known_commit);
        self.log = GenLog::empty_at(base);
        self.known_commit = base;
        self.effects.push(Effect::Rebuild { base });
    }
}

//! The replica of one durable shard as a pure state machine, after
//! `docs/replication-design.md`. So far it implements rules 1 to 6:
//! - generations (rule 1);
//! - the leader's lease on its monotonic clock (rule 2, `lease.rs`);
//! - fencing with a durable promise (rule 3);
//! - waiting out the old lease after the fence (rule 4, `lease.rs`);
//! - ballots (rule 5);
//! - log shipping, with log matching by generation and truncation of a divergent suffix
//!   (rule 6), the generation-start record included.
//!
//! It reads no clock and touches no socket or file: the time of each input is an argument
//! (milliseconds of the driver's monotonic clock). Its inputs are placement's assignment
//! ([`Replica::assign`]), a client's record ([`Replica::propose`]), peer messages
//! ([`Replica::on_msg`]) and ticks ([`Replica::tick`]: lease renewals and retransmission). Its
//! outputs are
//! [`Effect`]s, which the driver carries out **in order**, as raft-rs's `Ready` asks: a
//! [`Effect::Persist`] must be durable (fsynced) before any later effect of the same batch is
//! carried out, because a promise or ballot is never answered before it is kept (rule 3).
//!
//! Not here yet (later slices of issue 23): reports and the commit mark (7), promotion (8),
//! storage identity (9) and retention (10). The shard
//! host does not run this machine yet; only its simulator (`sim.rs`) does.
#![cfg_attr(not(test), allow(dead_code))]

use std::collections::BTreeMap;

mod lease;
pub(crate) use lease::{Lease, ReplicaCfg};
#[cfg(test)]
mod sim;

pub(crate) type NodeId = u64;

/// One record as replication sees it: the generation it was written in, and an identity the
/// simulator uses to tell records apart (the payload lives in the log, not here). The
/// machine itself compares generations only, as the real log can.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub gen: u64,
    pub id: u64,
}

impl Entry {
    /// The generation-start record (rule 6): no payload, the first record a new leader writes.
    pub(crate) fn start(gen: u64) -> Entry {
        Entry { gen, id: 0 }
    }
}

/// What must survive any crash, written with an fsync before it is answered (rules 1, 3, 5).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Durable {
    /// The highest generation promised: messages of lower generations are refused.
    pub promised: u64,
    /// The leader accepted at `promised` (rule 5).
    pub ballot: Option<NodeId>,
    /// The highest generation this broker led: it never leads one twice (rule 1).
    pub led: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Msg {
    /// A new leader's fence for `gen` (rule 3).
    Fence {
        gen: u64,
        leader: NodeId,
    },
    /// `from` promised `gen` to the leader, and holds records up to `end` (exclusive).
    FenceAnswer {
        gen: u64,
        from: NodeId,
        end: u64,
    },
    /// Records from offset `start`; `prev_gen` is the generation of the record at `start - 1`.
    Ship {
        gen: u64,
        leader: NodeId,
        start: u64,
        prev_gen: Option<u64>,
        entries: Vec<Entry>,
    },
    ShipAnswer {
        gen: u64,
        from: NodeId,
        shipped: Shipped,
    },
    /// Renew the leader's lease: the exchange sent at `round` (the leader's clock, rule 2).
    LeaseAsk {
        gen: u64,
        leader: NodeId,
        round: u64,
    },
    LeaseGrant {
        gen: u64,
        from: NodeId,
        round: u64,
    },
    /// `from` refused a message of generation `gen`: it promised `promised` (to another).
    Refuse {
        gen: u64,
        from: NodeId,
        promised: u64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shipped {
    /// The follower's log agrees with the leader's up to `end` (exclusive).
    Holds { end: u64 },
    /// The follower's log does not agree at `start - 1`: ship again from `below` or lower.
    Mismatch { below: u64 },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Effect {
    /// Write and fsync before anything after it.
    Persist(Durable),
    /// Drop every record at `from` and above (they were never committed: rule 6).
    Truncate {
        from: u64,
    },
    /// Append at the log's end.
    Append(Vec<Entry>),
    Send {
        to: NodeId,
        msg: Msg,
    },
    /// The fence of `gen` completed: this replica leads it.
    Elected {
        gen: u64,
    },
    /// This replica stopped leading (or fencing) `gen`: a newer generation exists.
    SteppedDown {
        gen: u64,
    },
}

/// A follower as its leader knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Peer {
    /// The offset the next shipment starts at.
    next: u64,
    /// Agrees with the leader's log below this (exclusive).
    held: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Role {
    Follower,
    Fencing {
        gen: u64,
        /// Who promised `gen` (this replica included), with their log end.
        answered: BTreeMap<NodeId, u64>,
    },
    Leading {
        gen: u64,
        peers: BTreeMap<NodeId, Peer>,
    },
}

/// Why a record was not taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NotLeader {
    Follower,
    Fencing,
}

/// The replica of one shard on one broker.
pub(crate) struct Replica {
    me: NodeId,
    /// The replica set, this broker included.
    set: Vec<NodeId>,
    durable: Durable,
    /// The generations of the log's records, offset 0 first (what the log holds, mirrored).
    log: Vec<Entry>,
    role: Role,
    /// While leading: the lease (rules 2 and 4).
    lease: Option<Lease>,
    cfg: ReplicaCfg,
    effects: Vec<Effect>,
}

impl Replica {
    /// A replica as it comes up: a follower, with what its disk kept.
    pub(crate) fn new(
        me: NodeId,
        set: Vec<NodeId>,
        durable: Durable,
        log: Vec<Entry>,
        cfg: ReplicaCfg,
    ) -> Self {
        assert!(set.contains(&me), "replica {me} is not in its set {set:?}");
        debug_assert!(cfg.validate().is_ok(), "{cfg:?}");
        Replica {
            me,
            set,
            durable,
            log,
            role: Role::Follower,
            lease: None,
            cfg,
            effects: Vec::new(),
        }
    }

    /// Whether this replica may acknowledge a write or serve a read at `now_ms`: it leads,
    /// has waited out every older lease, and holds its own (rules 2 and 4).
    pub(crate) fn serving(&self, now_ms: u64) -> bool {
        self.leading().is_some() && self.lease.as_ref().is_some_and(|l| l.serving(now_ms))
    }

    /// The effects produced since the last drain, in the order they must be carried out.
    pub(crate) fn drain_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    pub(crate) fn durable(&self) -> Durable {
        self.durable
    }

    pub(crate) fn log(&self) -> &[Entry] {
        &self.log
    }

    /// The generation this replica leads (its fence completed), if any.
    pub(crate) fn leading(&self) -> Option<u64> {
        match self.role {
            Role::Leading { gen, .. } => Some(gen),
            _ => None,
        }
    }

    fn majority(&self) -> usize {
        self.set.len() / 2 + 1
    }

    fn persist(&mut self, d: Durable) {
        debug_assert!(d.promised >= self.durable.promised && d.led >= self.durable.led);
        self.durable = d;
        self.effects.push(Effect::Persist(d));
    }

    fn send(&mut self, to: NodeId, msg: Msg) {
        debug_assert_ne!(to, self.me);
        self.effects.push(Effect::Send { to, msg });
    }

    fn append(&mut self, entries: Vec<Entry>) {
        if entries.is_empty() {
            return;
        }
        self.log.extend_from_slice(&entries);
        self.effects.push(Effect::Append(entries));
    }

    fn truncate(&mut self, from: u64) {
        debug_assert!(from < self.log.len() as u64);
        self.log.truncate(from as usize);
        self.effects.push(Effect::Truncate { from });
    }

    /// The generation this replica is fencing or leading, if any.
    fn taken(&self) -> Option<u64> {
        match self.role {
            Role::Fencing { gen, .. } | Role::Leading { gen, .. } => Some(gen),
            Role::Follower => None,
        }
    }

    fn step_down(&mut self) {
        let Some(gen) = self.taken() else { return };
        self.role = Role::Follower;
        // A deposed leader refuses new readers at once, whatever its lease says (rule 2).
        self.lease = None;
        self.effects.push(Effect::SteppedDown { gen });
    }

    /// Whether a message of generation `gen` from `leader` is taken (rules 3 and 5): a lower
    /// generation never; the promised one only from the leader accepted at it.
    fn accepts(&self, gen: u64, leader: NodeId) -> bool {
        let d = &self.durable;
        if breaks::on(&breaks::NO_BALLOT) {
            return gen >= d.promised;
        }
        gen > d.promised || (gen == d.promised && d.ballot.is_none_or(|b| b == leader))
    }

    /// Whether this replica takes records and lease exchanges of `gen` from `leader`: only
    /// from the leader whose fence it answered, at the generation it promised.
    fn takes_from(&self, gen: u64, leader: NodeId) -> bool {
        if breaks::on(&breaks::NO_FENCE) && gen < self.durable.promised {
            return true;
        }
        gen == self.durable.promised && self.durable.ballot == Some(leader)
    }

    /// Placement names `leader` for generation `gen`. Only the named broker acts: it takes
    /// the generation (promise, ballot and `led`, persisted) and fences the others. It refuses
    /// a generation it led before or one at which it accepted another leader.
    pub(crate) fn assign(&mut self, gen: u64, leader: NodeId, now_ms: u64) {
        if leader != self.me || gen <= self.durable.led || !self.accepts(gen, self.me) {
            return;
        }
        self.step_down();
        self.persist(Durable {
            promised: gen,
            ballot: Some(self.me),
            led: gen,
        });
        let end = self.log.len() as u64;
        self.role = Role::Fencing {
            gen,
            answered: BTreeMap::from([(self.me, end)]),
        };
        for to in self.others() {
            self.send(
                to,
                Msg::Fence {
                    gen,
                    leader: self.me,
                },
            );
        }
        self.maybe_elected(now_ms);
    }

    fn others(&self) -> Vec<NodeId> {
        self.set.iter().copied().filter(|&n| n != self.me).collect()
    }

    /// A client's record, appended by the leader and shipped; its offset.
    pub(crate) fn propose(&mut self, id: u64) -> Result<u64, NotLeader> {
        let gen = match self.role {
            Role::Leading { gen, .. } => gen,
            Role::Fencing { .. } => return Err(NotLeader::Fencing),
            Role::Follower => return Err(NotLeader::Follower),
        };
        let at = self.log.len() as u64;
        self.append(vec![Entry { gen, id }]);
        self.ship_all();
        Ok(at)
    }

    /// Send again what may have been lost (fences not answered, shipments to every follower),
    /// and renew the lease when due.
    pub(crate) fn tick(&mut self, now_ms: u64) {
        match &self.role {
            Role::Fencing { gen, answered } => {
                let (gen, answered) = (*gen, answered.clone());
                for to in self.others() {
                    if !answered.contains_key(&to) {
                        self.send(
                            to,
                            Msg::Fence {
                                gen,
                                leader: self.me,
                            },
                        );
                    }
                }
            }
            Role::Leading { .. } => {
                self.renew(now_ms);
                self.ship_all();
            }
            Role::Follower => {}
        }
    }

    /// Ask the replicas to renew the lease if due: an exchange sent now (rule 2).
    fn renew(&mut self, now_ms: u64) {
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

    pub(crate) fn on_msg(&mut self, msg: Msg, now_ms: u64) {
        match msg {
            Msg::Fence { gen, leader } => self.on_fence(gen, leader),
            Msg::FenceAnswer { gen, from, end } => {
                if let Role::Fencing { gen: g, answered } = &mut self.role {
                    if *g == gen {
                        answered.insert(from, end);
                        self.maybe_elected(now_ms);
                    }
                } else if let Role::Leading { gen: g, peers } = &mut self.role {
                    // A late promise: that follower is shipped to from now on.
                    if *g == gen && !peers.contains_key(&from) {
                        peers.insert(from, Peer { next: end, held: 0 });
                        self.ship(from);
                    }
                }
            }
            Msg::Ship {
                gen,
                leader,
                start,
                prev_gen,
                entries,
            } => self.on_ship(gen, leader, start, prev_gen, entries),
            Msg::ShipAnswer { gen, from, shipped } => self.on_ship_answer(gen, from, shipped),
            Msg::LeaseAsk { gen, leader, round } => {
                // Only the leader accepted at the promised generation (rule 3: a lower one is
                // refused, so a deposed leader renews nothing through a fenced replica).
                if !self.takes_from(gen, leader) || self.leading().is_some() {
                    return self.refuse(leader, gen);
                }
                let from = self.me;
                self.send(leader, Msg::LeaseGrant { gen, from, round });
            }
            Msg::LeaseGrant { gen, from, round } => {
                let majority = self.majority();
                if let Some(l) = self.lease.as_mut().filter(|l| l.gen == gen) {
                    l.granted(round, from, majority, &self.cfg);
                }
            }
            Msg::Refuse { gen, promised, .. } => {
                if self.taken() == Some(gen) && promised > gen {
                    self.step_down();
                }
            }
        }
    }

    fn refuse(&mut self, to: NodeId, gen: u64) {
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

    fn on_fence(&mut self, gen: u64, leader: NodeId) {
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
        let end = self.log.len() as u64;
        self.send(
            leader,
            Msg::FenceAnswer {
                gen,
                from: self.me,
                end,
            },
        );
    }

    /// A majority promised: lead. The generation-start record goes first (rule 6), then
    /// every follower that answered is shipped to from the end it reported.
    fn maybe_elected(&mut self, now_ms: u64) {
        let Role::Fencing { gen, answered } = &self.role else {
            return;
        };
        if answered.len() < self.majority() {
            return;
        }
        let (gen, answered) = (*gen, answered.clone());
        let end = self.log.len() as u64;
        let peers = answered
            .into_iter()
            .filter(|(n, _)| *n != self.me)
            .map(|(n, e)| {
                (
                    n,
                    Peer {
                        next: e.min(end),
                        held: 0,
                    },
                )
            })
            .collect();
        self.role = Role::Leading { gen, peers };
        self.lease = Some(Lease::new(gen, now_ms, &self.cfg));
        self.effects.push(Effect::Elected { gen });
        self.append(vec![Entry::start(gen)]);
        self.renew(now_ms);
        self.ship_all();
    }

    fn ship_all(&mut self) {
        let peers: Vec<NodeId> = match &self.role {
            Role::Leading { peers, .. } => peers.keys().copied().collect(),
            _ => return,
        };
        for p in peers {
            self.ship(p);
        }
    }

    fn ship(&mut self, to: NodeId) {
        let Role::Leading { gen, peers } = &self.role else {
            return;
        };
        let Some(peer) = peers.get(&to) else { return };
        let gen = *gen;
        let start = peer.next.min(self.log.len() as u64);
        let prev_gen = start.checked_sub(1).map(|p| self.log[p as usize].gen);
        let upto = (start as usize + self.cfg.batch_max).min(self.log.len());
        let entries = self.log[start as usize..upto].to_vec();
        self.send(
            to,
            Msg::Ship {
                gen,
                leader: self.me,
                start,
                prev_gen,
                entries,
            },
        );
    }

    /// Rule 6, the follower's side: take records only from the leader accepted at the
    /// promised generation; find where the logs agree; drop a divergent suffix; append.
    fn on_ship(
        &mut self,
        gen: u64,
        leader: NodeId,
        start: u64,
        prev_gen: Option<u64>,
        entries: Vec<Entry>,
    ) {
        // Only a leader whose fence this replica answered ships to it: a higher generation it
        // has not promised is refused too (that leader fences it first).
        if !self.takes_from(gen, leader) || self.leading().is_some() {
            return self.refuse(leader, gen);
        }
        let end = self.log.len() as u64;
        let me = self.me;
        let answer = move |shipped| Msg::ShipAnswer {
            gen,
            from: me,
            shipped,
        };
        if start > end {
            let a = answer(Shipped::Mismatch { below: end });
            return self.send(leader, a);
        }
        if let (Some(p), Some(pg)) = (start.checked_sub(1), prev_gen) {
            if self.log[p as usize].gen != pg {
                let a = answer(Shipped::Mismatch { below: p });
                return self.send(leader, a);
            }
        }
        // The first record that differs (by generation) starts what is appended.
        let mut skip = 0;
        while skip < entries.len() {
            let at = start as usize + skip;
            if at >= self.log.len() {
                break;
            }
            if self.log[at].gen != entries[skip].gen && !breaks::on(&breaks::NO_TRUNCATE) {
                self.truncate(at as u64);
                break;
            }
            skip += 1;
        }
        let n = entries.len() as u64;
        self.append(entries[skip..].to_vec());
        let a = answer(Shipped::Holds { end: start + n });
        self.send(leader, a);
    }

    fn on_ship_answer(&mut self, gen: u64, from: NodeId, shipped: Shipped) {
        let len = self.log.len() as u64;
        let Role::Leading { gen: g, peers } = &mut self.role else {
            return;
        };
        let Some(peer) = peers.get_mut(&from) else {
            return;
        };
        if *g != gen {
            return;
        }
        match shipped {
            Shipped::Holds { end } => {
                debug_assert!(end <= len, "a follower holds {end} of a log of {len}");
                peer.held = peer.held.max(end);
                peer.next = end;
                if end < len {
                    self.ship(from);
                }
            }
            Shipped::Mismatch { below } => {
                peer.next = below.min(peer.next.saturating_sub(1));
                self.ship(from);
            }
        }
    }
}

/// Test-build switches that break one rule each, so the simulator's negative twins show its
/// checkers catch the break (`sim.rs`).
pub(crate) mod breaks {
    use std::sync::atomic::AtomicBool;
    /// Rule 5 dropped: a replica takes a second leader's fence at the generation it promised.
    pub(crate) static NO_BALLOT: AtomicBool = AtomicBool::new(false);
    /// Rule 3 dropped: a replica still takes records and lease exchanges of a generation below
    /// the one it promised.
    pub(crate) static NO_FENCE: AtomicBool = AtomicBool::new(false);
    /// Rule 4 dropped: a new leader serves as soon as its fence completes.
    pub(crate) static NO_LEASE_WAIT: AtomicBool = AtomicBool::new(false);
    /// Rule 6 dropped: a follower keeps a record that differs from the leader's at the same
    /// offset instead of dropping the suffix from there.
    pub(crate) static NO_TRUNCATE: AtomicBool = AtomicBool::new(false);

    #[inline]
    pub(crate) fn on(b: &AtomicBool) -> bool {
        #[cfg(test)]
        return b.load(std::sync::atomic::Ordering::Relaxed);
        #[cfg(not(test))]
        {
            let _ = b;
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deliver every message until none is left; what each node's effects were, in order.
    fn settle(rs: &mut BTreeMap<NodeId, Replica>) {
        let mut net: Vec<(NodeId, Msg)> = Vec::new();
        for _ in 0..1000 {
            for r in rs.values_mut() {
                for e in r.drain_effects() {
                    if let Effect::Send { to, msg } = e {
                        net.push((to, msg));
                    }
                }
            }
            if net.is_empty() {
                return;
            }
            for (to, msg) in std::mem::take(&mut net) {
                rs.get_mut(&to).unwrap().on_msg(msg, 0);
            }
        }
        panic!("the replicas never went quiet");
    }

    fn three(logs: [Vec<Entry>; 3]) -> BTreeMap<NodeId, Replica> {
        let set = vec![1, 2, 3];
        (1..=3)
            .zip(logs)
            .map(|(n, l)| {
                let cfg = ReplicaCfg::default();
                (n, Replica::new(n, set.clone(), Durable::default(), l, cfg))
            })
            .collect()
    }

    #[test]
    fn a_new_leader_fences_writes_its_start_record_and_cuts_a_divergent_suffix() {
        let e = |gen, id| Entry { gen, id };
        // Node 3 holds a record of generation 1 that the others never got.
        let base = vec![Entry::start(1), e(1, 7)];
        let mut rs = three([
            base.clone(),
            base.clone(),
            vec![Entry::start(1), e(1, 7), e(1, 8)],
        ]);
        for r in rs.values_mut() {
            r.durable = Durable {
                promised: 1,
                ballot: Some(3),
                led: 0,
            };
        }
        rs.get_mut(&1).unwrap().assign(2, 1, 0);
        let fx = rs.get_mut(&1).unwrap().drain_effects();
        assert_eq!(
            fx[0],
            Effect::Persist(Durable {
                promised: 2,
                ballot: Some(1),
                led: 2
            }),
            "the promise is kept before the fence goes out"
        );
        for e in fx {
            if let Effect::Send { to, msg } = e {
                rs.get_mut(&to).unwrap().on_msg(msg, 0);
            }
        }
        settle(&mut rs);
        assert_eq!(rs[&1].leading(), Some(2));
        rs.get_mut(&1).unwrap().propose(9).unwrap();
        settle(&mut rs);
        let want = vec![Entry::start(1), e(1, 7), Entry::start(2), e(2, 9)];
        for r in rs.values() {
            assert_eq!(r.log(), want.as_slice(), "node {}", r.me);
        }
        // Node 3 refuses generation 2's fence from another leader (its ballot is node 1),
        // and a lower generation's fence; node 1 will not lead generation 2 twice.
        rs.get_mut(&3)
            .unwrap()
            .on_msg(Msg::Fence { gen: 2, leader: 2 }, 0);
        rs.get_mut(&3)
            .unwrap()
            .on_msg(Msg::Fence { gen: 1, leader: 2 }, 0);
        let refusals = rs.get_mut(&3).unwrap().drain_effects();
        assert!(refusals.iter().all(|e| matches!(
            e,
            Effect::Send {
                msg: Msg::Refuse { promised: 2, .. },
                ..
            }
        )));
        assert_eq!(refusals.len(), 2);
        rs.get_mut(&1).unwrap().assign(2, 1, 0);
        assert!(rs.get_mut(&1).unwrap().drain_effects().is_empty());
        assert_eq!(rs.get_mut(&2).unwrap().propose(1), Err(NotLeader::Follower));
    }
}

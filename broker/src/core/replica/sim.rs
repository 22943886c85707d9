//! The replica machine's simulator: three replicas of one shard (and, in half the seeds, a
//! fourth broker that placement swaps in for one of them, rule 11), placement
//! (`felix_control::replication`, an actor on the network like the replicas), and a network
//! that drops, duplicates, delays, reorders and partitions (any link, placement's included,
//! one way or both, or the brokers and placement split in two sides), driven from a seed. Reports, their answers and assignments travel over it too. Each node's disk is the
//! twin of what its effects wrote (a promise, a ballot, the log), so a process crash, even
//! between two effects of one batch, restarts the node from exactly what it had written.
//! A machine crash also loses a random tail of the log (the fsync window of a relaxed fsync
//! mode) and rotates the node's storage identity, registered with placement as it comes back.
//! Retention trims any node's log below the mark it learnt (rule 10, `sim/check.rs`), so
//! followers that fall behind a leader's base are rebuilt from it.
//!
//! The fault model's bound "at most a minority loses data at once" is kept as the oracle
//! sees it: a machine crash may hit a node only while every other node is vouched for under
//! its current identity, and every acknowledged record is also on another node that the last
//! landed report vouches for at or past it (TigerBeetle's
//! simulator bounds its faults the same way: never every copy). Without it no protocol could
//! keep an acknowledged record.
//!
//! Time: one true clock moves in random steps; each node reads its own monotonic clock, which
//! starts at its own offset and runs at its own rate, within 5 % of true time (the design's
//! bounded drift; the margin, a quarter of the lease, covers it).
//!
//! After every step it checks the model's invariants (`tla/FelixShard.tla`) that this slice
//! covers, against the replicas' real state:
//! - `AtMostOneServing`: at most one replica may serve at the true time now, each judged on
//!   its own clock;
//! - `OneLeaderPerGeneration`: no two replicas complete a fence at one generation;
//! - `LogMatching`: two logs with a record of the same generation at the same offset agree up
//!   to it (compared by record identity, which the machine never reads);
//! - `PublishAnswered`: at the end of a run, with every node ticked past its quorum wait,
//!   every publish a leader accepted has been answered, acknowledged or "cannot vouch"
//!   (unless its node crashed since);
//! - `NoAckedRecordLost`: every record acknowledged as `Quorum` is, at its offset, in the log of
//!   every leader of placement's newest generation, and no offset is acknowledged twice with
//!   different records;
//! - promises and `led` never go backwards on disk, and each replica's view of its log is
//!   what its disk holds;
//! - `CommittedNeverCut`: no node cuts below the highest commit mark it has learnt (kept
//!   across process crashes, lowered only by what a machine crash loses), and
//!   `CommittedPrefixMatches`: what any node learnt committed is, record for record, in the
//!   log of every leader of placement's newest generation (twin `COMMIT_BEFORE_MATCH`).
//! - `TrimmedCommitted`: a follower is rebuilt only at a base some node learnt committed (and
//!   never drops a record it learnt committed at or past it).
//!
//! Where a log was trimmed, every check compares from the higher base.
//!
//! Seeds: `FELIX_REPLICA_SEEDS` (default 2000) or `FELIX_REPLICA_SEED=N` to replay one:
//! `FELIX_REPLICA_SEED=N cargo nextest run -p felix-broker replica::sim`. With
//! `FELIX_REPLICA_BUDGET_S` the positive run goes on past its seeds until that many seconds
//! are spent (`scripts/test.sh`, the CI run, gives it 200). Every message also goes through
//! the `Replicate` frame's codec and back (`wire_round_trip`).

use super::*;
use crate::core::sim::{seeds_from_env, Rng};
use felix_control::replication::Placement;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};

/// The replica set's size; with [`Mix::replace`] one more broker stands outside it, which
/// placement may swap in for a replica (rule 11).
const RF: u64 = 3;
/// Placement's address on the simulated network.
const PLACEMENT: NodeId = 0;
const STEPS: usize = 900;
/// Placement suspects a leader it has not heard a report from for this long (true time).
const SUSPECT_AFTER_MS: u64 = 2_500;
/// Client load comes in windows of this much true time, busy and quiet in turn.
const QUIET_EVERY_MS: u64 = 3_000;
/// Lease 1 s, margin 250 ms (covers the clocks' 5 % drift over a lease), renewal every 300 ms.
const CFG: ReplicaCfg = ReplicaCfg {
    lease_ms: 1_000,
    margin_ms: 250,
    renew_ms: 300,
    batch_max: 8,
    quorum_wait_ms: 2_000,
};

/// One record as a simulated disk holds it: its generation, and an identity that tells
/// records apart (0: a generation-start record). The machine never sees the identity: it
/// travels beside a shipment as a real driver's record bytes would.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    gen: u64,
    id: u64,
}

/// What a disk holds below its base: retention removed the record (rule 10). It equals no
/// record, so no check takes it for one.
const GONE: Entry = Entry {
    gen: 0,
    id: u64::MAX,
};

/// What travels on the simulated network.
#[derive(Clone, Debug)]
enum Wire {
    /// A peer message; a shipment carries the identities of its records, read from the
    /// sender's disk as a driver reads the records from its log.
    Peer(Msg, Vec<u64>),
    Report(Report),
    Answer(ReportAnswer),
    Assign(Assignment),
    /// The catalog changed the replica set (rule 11): the broker hosts a replica if
    /// placement's set names it when this arrives, and ends the one it hosts if not (a real
    /// broker follows the catalog late, or not at all while it is cut off).
    Catalog,
}

struct Node {
    r: Replica,
    sid: StorageId,
    disk: Durable,
    /// The log by offset; below `disk_base`, [`GONE`].
    disk_log: Vec<Entry>,
    disk_base: u64,
    /// Its monotonic clock: `offset_ms + true_ms * rate_ppm / 1e6`.
    offset_ms: u64,
    rate_ppm: u64,
    /// Whether the broker hosts the shard's replica (it is in the set as it last learnt
    /// it): one that does not drops every message for it, as a real broker counts them
    /// `unhosted`, and its machine is gone.
    hosted: bool,
}

/// What the seeds reached, so a passing run shows it exercised the rules.
#[derive(Default, Debug, Clone, Copy)]
struct Reached {
    truncated: bool,
    refused_step_down: bool,
    two_generations_elected: bool,
    crash_mid_batch: bool,
    served: bool,
    /// Two replicas believed they led (different generations) at once: the case the lease
    /// and the fence exist for.
    two_leading: bool,
    /// A record was acknowledged, and later another replica led a newer generation.
    acked_then_failover: bool,
    /// A machine crash lost records that placement's last report still says the node holds,
    /// under its old identity (what rule 9 exists for).
    stale_report_after_crash: bool,
    /// A leader without a lease for a whole lease period resigned, and placement named
    /// another.
    resigned: bool,
    /// A follower's log was rebuilt from its leader's base (rule 10).
    rebuilt: bool,
    /// Placement replaced a replica, and a landed report then counted the new one (rule 11).
    replaced: bool,
}

struct World {
    rng: Rng,
    nodes: BTreeMap<NodeId, Node>,
    /// In flight: (from, to, message), in no order (any may be delivered next).
    net: Vec<(NodeId, NodeId, Wire)>,
    placement: Placement,
    /// True time placement last stored a report of the leader it names, or named it.
    heard_ms: u64,
    /// Acknowledged `Quorum` records: offset → (record, the leader that acknowledged it).
    acked: BTreeMap<u64, (Entry, NodeId)>,
    /// Each node's accepted proposals not answered yet (by `Ack` or `CannotVouch`); a crash
    /// clears them (the client sees its connection drop).
    waiting: BTreeMap<NodeId, BTreeSet<u64>>,
    next_sid: StorageId,
    /// Links cut, one way each: a message sent over one is lost when it would arrive.
    cut: BTreeSet<(NodeId, NodeId)>,
    /// Placement may name a second leader at a generation it already issued (a racing pass,
    /// a restored control plane): what rule 5 exists for.
    racing: bool,
    /// Partitions four times as often (the schedules a deposed leader needs to stay cut off
    /// from its successor while it still reaches a follower).
    partitions: bool,
    /// No client records at all: followers stay level with their leader, so placement can
    /// fail over to any of them (what a deposed leader that still serves needs).
    idle: bool,
    /// Crashes (process and machine) two and a half times as often.
    crashy: bool,
    /// Placement suspects its leader at every chance, not only when it went silent (churn:
    /// generations overtaking each other before they serve).
    eager: bool,
    /// A fourth broker, and placement swaps it in for a replica now and then (rule 11).
    replace: bool,
    /// Brokers: the set's and, with `replace`, one more.
    span: u64,
    /// The broker placement swapped in last, until a landed report counts it.
    swapped_in: Option<NodeId>,
    next_id: u64,
    /// The identities of the client records just proposed (their `Source::Client` append).
    proposed: Vec<u64>,
    /// The record identities of the shipment just delivered (its `Source::Shipment` append).
    in_hand: Vec<u64>,
    /// The highest commit mark each node has learnt, kept across process crashes (committed
    /// is committed) and cut only by what a machine crash loses.
    commit_seen: BTreeMap<NodeId, u64>,
    /// True time, ms.
    true_ms: u64,
    elected: BTreeMap<u64, NodeId>,
    reached: Reached,
    trace: Vec<String>,
}

impl World {
    fn new(
        seed: u64,
        Mix {
            racing,
            partitions,
            idle,
            crashy,
            eager,
            replace,
        }: Mix,
    ) -> World {
        let mut rng = Rng::new(seed);
        let set: Vec<NodeId> = (1..=RF).collect();
        let span = if replace { RF + 1 } else { RF };
        let nodes: BTreeMap<NodeId, Node> = (1..=span)
            .map(|n| {
                let d = Durable::default();
                let own = if n <= RF { set.clone() } else { vec![n] };
                let r = Replica::new(n, n, own, d, GenLog::default(), CFG);
                let node = Node {
                    r,
                    sid: n,
                    disk: Durable::default(),
                    disk_log: Vec::new(),
                    disk_base: 0,
                    offset_ms: rng.below(1_000_000),
                    rate_ppm: 950_000 + rng.below(100_001),
                    hosted: n <= RF,
                };
                (n, node)
            })
            .collect();
        let placement = Placement::new(set.iter().map(|&n| (n, nodes[&n].sid)).collect());
        World {
            rng,
            nodes,
            net: Vec::new(),
            placement,
            heard_ms: 0,
            acked: BTreeMap::new(),
            waiting: BTreeMap::new(),
            next_sid: span + 1,
            cut: BTreeSet::new(),
            racing,
            partitions,
            idle,
            crashy,
            eager,
            replace,
            span,
            swapped_in: None,
            next_id: 1,
            proposed: Vec::new(),
            in_hand: Vec::new(),
            commit_seen: BTreeMap::new(),
            true_ms: 0,
            elected: BTreeMap::new(),
            reached: Reached::default(),
            trace: Vec::new(),
        }
    }

    fn pick_node(&mut self) -> NodeId {
        1 + self.rng.below(self.span)
    }

    /// What node `n`'s monotonic clock reads now.
    fn now(&self, n: NodeId) -> u64 {
        let x = &self.nodes[&n];
        x.offset_ms + self.true_ms * x.rate_ppm / 1_000_000
    }

    /// Send `msg` from `n` to `to`, as a driver does: the records a shipment names are read
    /// from `n`'s log (and must be there).
    fn ship(&mut self, n: NodeId, to: NodeId, msg: Msg) -> Result<(), String> {
        let node = &self.nodes[&n];
        let ids = match &msg {
            Msg::Ship { start, gens, .. } => {
                let s = *start as usize;
                let on_disk = node.disk_log.get(s..s + gens.len());
                if on_disk.is_none_or(|d| !d.iter().map(|e| e.gen).eq(gens.iter().copied())) {
                    return Err(format!(
                        "ship_from_disk: node {n} ships {gens:?} from {start}, its disk holds {on_disk:?}"
                    ));
                }
                on_disk.unwrap().iter().map(|e| e.id).collect()
            }
            _ => Vec::new(),
        };
        check::wire_round_trip(&msg, &ids)?;
        self.net.push((n, to, Wire::Peer(msg, ids)));
        Ok(())
    }

    /// `n` was elected leader of generation `gen`.
    fn elected(&mut self, n: NodeId, gen: u64) -> Result<(), String> {
        if let Some(&other) = self.elected.get(&gen) {
            if other != n {
                return Err(format!(
                    "OneLeaderPerGeneration: nodes {other} and {n} both lead generation {gen}"
                ));
            }
        }
        self.elected.insert(gen, n);
        if self.acked.values().any(|(e, by)| e.gen < gen && *by != n) {
            self.reached.acked_then_failover = true;
        }
        if self.elected.len() >= 2 {
            self.reached.two_generations_elected = true;
        }
        Ok(())
    }

    /// Carry out `n`'s effects in order; with `crash_after`, crash it after that many.
    fn carry_out(&mut self, n: NodeId, crash_after: Option<usize>) -> Result<(), String> {
        let effects = self.nodes.get_mut(&n).unwrap().r.drain_effects();
        let upto = crash_after.map_or(effects.len(), |k| k.min(effects.len()));
        for e in effects.into_iter().take(upto) {
            let node = self.nodes.get_mut(&n).unwrap();
            match e {
                Effect::Persist(d) => {
                    if d.promised < node.disk.promised || d.led < node.disk.led {
                        return Err(format!(
                            "promise_monotonic: node {n} persisted {d:?} over {:?}",
                            node.disk
                        ));
                    }
                    node.disk = d;
                }
                Effect::Truncate { from } => {
                    if from as usize >= node.disk_log.len() {
                        return Err(format!("truncate_in_log: node {n} cut at {from}"));
                    }
                    let seen = self.commit_seen.get(&n).copied().unwrap_or(0);
                    if from < seen {
                        return Err(format!(
                            "CommittedNeverCut: node {n} cuts at {from}, below the commit mark {seen} it learnt"
                        ));
                    }
                    node.disk_log.truncate(from as usize);
                    self.reached.truncated = true;
                }
                Effect::Rebuild { base } => {
                    let seen = self.commit_seen.get(&n).copied().unwrap_or(0);
                    if base < seen {
                        return Err(format!(
                            "CommittedNeverCut: node {n} rebuilds from {base}, dropping what it learnt committed below {seen}"
                        ));
                    }
                    let marked = self.commit_seen.values().copied().max().unwrap_or(0);
                    if base > marked {
                        return Err(format!(
                            "TrimmedCommitted: node {n} rebuilds from {base}, past every commit mark learnt ({marked})"
                        ));
                    }
                    node.disk_log = vec![GONE; base as usize];
                    node.disk_base = base;
                    self.reached.rebuilt = true;
                }
                Effect::Append { at, gens, source } => {
                    if at as usize != node.disk_log.len() {
                        return Err(format!(
                            "append_at_end: node {n} appends at {at} to a log of {}",
                            node.disk_log.len()
                        ));
                    }
                    let ids = match source {
                        Source::Start => vec![0],
                        Source::Client => std::mem::take(&mut self.proposed),
                        Source::Shipment { skip } => self.in_hand[skip..].to_vec(),
                    };
                    if ids.len() != gens.len() {
                        return Err(format!(
                            "append_source: node {n} appends {} records from {source:?} holding {}",
                            gens.len(),
                            ids.len()
                        ));
                    }
                    let new = gens.iter().zip(ids).map(|(&gen, id)| Entry { gen, id });
                    node.disk_log.extend(new);
                }
                Effect::Send { to, msg } => self.ship(n, to, msg)?,
                Effect::Report(r) => self.net.push((n, PLACEMENT, Wire::Report(r))),
                Effect::Ack { from, below } => {
                    self.answered(n, from, below);
                    self.acknowledge(n, from, below)?
                }
                Effect::CannotVouch { from, below } => self.answered(n, from, below),
                Effect::Elected { gen } => self.elected(n, gen)?,
                Effect::SteppedDown { .. } => {}
            }
        }
        if crash_after.is_some() {
            self.reached.crash_mid_batch = true;
            return self.restart(n);
        }
        let node = &self.nodes[&n];
        if node.r.known_commit() > node.r.log().end() {
            return Err(format!(
                "known_commit_in_log: node {n} knows {} committed of a log of {}",
                node.r.known_commit(),
                node.r.log().end()
            ));
        }
        let seen = self.commit_seen.entry(n).or_default();
        *seen = (*seen).max(node.r.known_commit());
        // Both sides of the write: the machine's view is what the disk holds.
        if *node.r.log() != node.view() || node.r.durable() != node.disk {
            return Err(format!("view_is_disk: node {n} drifted from its disk"));
        }
        Ok(())
    }

    fn answered(&mut self, n: NodeId, from: u64, below: u64) {
        if let Some(w) = self.waiting.get_mut(&n) {
            w.retain(|&at| at < from || at >= below);
        }
    }

    /// `PublishAnswered`: once every node has been ticked past its quorum wait, no accepted
    /// proposal of a node that did not crash since is left without an answer.
    fn settle_answers(&mut self) -> Result<(), String> {
        self.true_ms += CFG.quorum_wait_ms * 11 / 10 + 1;
        for n in 1..=self.span {
            if !self.nodes[&n].hosted {
                continue;
            }
            let now = self.now(n);
            self.nodes.get_mut(&n).unwrap().r.tick(now);
            self.carry_out(n, None)?;
        }
        for (n, w) in &self.waiting {
            if let Some(at) = w.first() {
                return Err(format!(
                    "PublishAnswered: node {n} never answered the publish at offset {at} ({} waiting)",
                    w.len()
                ));
            }
        }
        Ok(())
    }

    /// A process crash: the node comes back as a follower with what it made durable.
    fn restart(&mut self, n: NodeId) -> Result<(), String> {
        self.waiting.remove(&n);
        // A broker hosts a replica with the set the catalog names (a follower counts nothing
        // on it; an assignment brings the one a leader counts).
        let mut set = self.placement.set().to_vec();
        if !set.contains(&n) {
            set = vec![n];
        }
        let node = self.nodes.get_mut(&n).unwrap();
        let log = node.view();
        node.r = Replica::new(n, node.sid, set, node.disk, log, CFG);
        Ok(())
    }

    /// The leader `n` acknowledged the records `from..below` of its log: remember the client
    /// records among them.
    fn acknowledge(&mut self, n: NodeId, from: u64, below: u64) -> Result<(), String> {
        let log = &self.nodes[&n].disk_log;
        if below as usize > log.len() || from > below {
            return Err(format!(
                "ack_in_log: node {n} acknowledged {from}..{below} of a log of {}",
                log.len()
            ));
        }
        for off in from..below {
            let e = log[off as usize];
            if e.id == 0 || e == GONE {
                continue; // a generation-start record (no client waits on it), or trimmed
            }
            if let Some((old, by)) = self.acked.get(&off) {
                if *old != e {
                    return Err(format!(
                        "NoAckedRecordLost: offset {off} acknowledged as {old:?} by {by}, then as {e:?} by {n}"
                    ));
                }
            }
            self.acked.insert(off, (e, n));
        }
        Ok(())
    }

    /// A machine crash: a tail of the log is lost, the identity rotates and is registered
    /// with placement before the node answers anyone (rule 9).
    fn machine_crash(&mut self, n: NodeId) -> Result<(), String> {
        let len = self.nodes[&n].disk_log.len() as u64;
        let base = self.nodes[&n].disk_base;
        let keep = base + self.rng.below(len - base + 1);
        let stale = self
            .placement
            .reported(n)
            .filter(|h| h.sid == self.nodes[&n].sid);
        if stale.is_some_and(|h| h.pos.end > keep) {
            self.reached.stale_report_after_crash = true;
        }
        let sid = self.next_sid;
        self.next_sid += 1;
        let node = self.nodes.get_mut(&n).unwrap();
        node.disk_log.truncate(keep as usize);
        node.sid = sid;
        if let Some(seen) = self.commit_seen.get_mut(&n) {
            *seen = (*seen).min(keep);
        }
        if self.placement.set().contains(&n) {
            self.placement.register(n, sid);
        }
        self.trace.push(format!(
            "machine crash {n}: kept {keep} of {len}, identity {sid}"
        ));
        self.restart(n)
    }

    /// Deliver one message; the node it reached, if its effects are to be carried out.
    fn deliver(&mut self, from: NodeId, to: NodeId, w: Wire) -> Option<NodeId> {
        if self.cut.contains(&(from, to)) {
            self.trace.push(format!("lost {from}->{to}: {w:?}"));
            return None;
        }
        self.trace.push(format!("deliver {from}->{to}: {w:?}"));
        if to == PLACEMENT {
            if let Wire::Report(r) = w {
                let a = self.placement.on_report(&r);
                let landed = matches!(a, ReportAnswer::Landed { .. });
                if landed {
                    self.heard_ms = self.true_ms;
                }
                if let ReportAnswer::Landed { counted, .. } = &a {
                    if counted.iter().any(|h| Some(h.node) == self.swapped_in) {
                        self.reached.replaced = true;
                        self.swapped_in = None;
                    }
                }
                self.net.push((PLACEMENT, from, Wire::Answer(a)));
                // A resigning leader: another qualifying replica leads (placement here
                // takes every replica for up; promotion is safe whoever it names).
                if landed && r.resign {
                    if let Some(a) = self.placement.resign(r.leader, |_| true) {
                        self.reached.resigned = true;
                        self.trace
                            .push(format!("placement on a resignation: {a:?}"));
                        self.net.push((PLACEMENT, a.leader, Wire::Assign(a)));
                    }
                }
            }
            return None;
        }
        if matches!(w, Wire::Catalog) {
            return self.follow_catalog(to);
        }
        if !self.nodes[&to].hosted {
            self.trace.push(format!("unhosted at {to}"));
            return None;
        }
        let now = self.now(to);
        let was = self.nodes[&to].r.leading();
        let r = &mut self.nodes.get_mut(&to).unwrap().r;
        match w {
            Wire::Peer(msg, ids) => {
                self.in_hand = ids;
                let refusal = matches!(msg, Msg::Refuse { .. });
                r.on_msg(msg, now);
                if refusal && was.is_some() && r.leading().is_none() {
                    self.reached.refused_step_down = true;
                }
            }
            Wire::Answer(a) => r.on_report_answer(a, now),
            Wire::Assign(a) => r.assign(a, now),
            Wire::Report(_) => unreachable!("reports go to placement"),
            Wire::Catalog => unreachable!("taken above"),
        }
        Some(to)
    }

    /// Placement names a leader: one that qualifies (rule 8), sometimes at a generation it
    /// already issued (a racing pass). It acts as if it suspected the current leader: another
    /// replica that qualifies is preferred, and the current one is named again only now and
    /// then (a shard whose only qualifying replica is its leader waits for it).
    fn promote(&mut self) {
        if self.replace && self.rng.chance(40) {
            return self.replace();
        }
        let (gen, leader) = self.placement.newest();
        // Suspect a leader not heard from for a while; now and then suspect a live one too
        // (failure detection is never trusted for safety, so promotion may come any time).
        let silent = self.true_ms.saturating_sub(self.heard_ms) >= SUSPECT_AFTER_MS;
        if !self.eager && leader.is_some() && !silent && !self.rng.chance(15) {
            return;
        }
        let eligible = self.placement.eligible();
        let others: Vec<NodeId> = eligible
            .iter()
            .copied()
            .filter(|&c| Some(c) != leader)
            .collect();
        let pool = if others.is_empty() { eligible } else { others };
        if pool.is_empty() {
            self.trace.push("placement: none qualifies".into());
            return;
        }
        if pool.len() == 1 && Some(pool[0]) == leader && !self.rng.chance(30) {
            return;
        }
        let c = pool[self.rng.below(pool.len() as u64) as usize];
        let reuse = self.racing && gen > 0 && leader != Some(c) && self.rng.chance(30);
        let a = self
            .placement
            .promote(c, reuse)
            .expect("an eligible replica");
        self.heard_ms = self.true_ms;
        self.trace.push(format!("placement: {a:?}"));
        self.net.push((PLACEMENT, c, Wire::Assign(a)));
    }

    fn step(&mut self) -> Result<(), String> {
        let roll = self.rng.below(100);
        if (83..=96).contains(&roll) {
            let d = 1 + self.rng.below(300);
            self.true_ms += d;
            self.trace.push(format!("time +{d} ms"));
            return self.check();
        }
        // One input to one node, then its effects (sometimes cut short by a crash).
        let roll = if self.partitions && (63..=65).contains(&roll) {
            97
        } else if self.crashy && (80..=82).contains(&roll) {
            99
        } else if roll <= 46 && self.net.is_empty() {
            // Nothing to deliver: a tick (timers are what move a quiet replica set).
            63
        } else if (49..=62).contains(&roll)
            && (self.idle || (self.true_ms / QUIET_EVERY_MS) % 2 == 1)
        {
            // A quiet window: no client records, so followers catch up and reports show
            // them level with the leader (the ties a failover to another replica needs).
            63
        } else {
            roll
        };
        let n = match roll {
            0..=39 if !self.net.is_empty() => {
                let i = self.rng.below(self.net.len() as u64) as usize;
                let (from, to, w) = self.net.swap_remove(i);
                match self.deliver(from, to, w) {
                    Some(n) => n,
                    None => return self.check(),
                }
            }
            40..=43 if !self.net.is_empty() => {
                let i = self.rng.below(self.net.len() as u64) as usize;
                let (from, to, w) = self.net.swap_remove(i);
                self.trace.push(format!("drop {from}->{to}: {w:?}"));
                return Ok(());
            }
            44..=46 if !self.net.is_empty() => {
                let i = self.rng.below(self.net.len() as u64) as usize;
                let m = self.net[i].clone();
                self.trace
                    .push(format!("duplicate {}->{}: {:?}", m.0, m.1, m.2));
                self.net.push(m);
                return Ok(());
            }
            47..=48 => {
                self.promote();
                return Ok(());
            }
            49..=62 => {
                // Clients follow `not_leader` to the leader placement names; some still
                // reach another node (an old address, a partition).
                let named = self.placement.newest().1;
                let n = match named {
                    Some(l) if self.rng.chance(70) => l,
                    _ => self.pick_node(),
                };
                // Batches of one to three records (a client's publish of several).
                let k = 1 + self.rng.below(3);
                let ids: Vec<u64> = (self.next_id..self.next_id + k).collect();
                self.next_id += k;
                if !self.nodes[&n].hosted {
                    self.trace
                        .push(format!("propose {ids:?} at {n}: not hosted"));
                    return Ok(());
                }
                let now = self.now(n);
                let r = self.nodes.get_mut(&n).unwrap().r.propose(k as usize, now);
                if let Ok(at) = r {
                    self.waiting.entry(n).or_default().extend(at..at + k);
                    self.proposed = ids.clone();
                }
                self.trace.push(format!("propose {ids:?} at {n}: {r:?}"));
                n
            }
            78..=79 => {
                let n = self.pick_node();
                self.trim(n);
                return self.check();
            }
            63..=82 => {
                let n = self.pick_node();
                if self.replace && self.rng.chance(5) && !self.cut.contains(&(PLACEMENT, n)) {
                    // The catalog reaches a broker in the end, even if every push was lost.
                    self.follow_catalog(n);
                }
                if !self.nodes[&n].hosted {
                    return self.check();
                }
                self.trace.push(format!("tick {n}"));
                let now = self.now(n);
                self.nodes.get_mut(&n).unwrap().r.tick(now);
                n
            }
            97 => {
                self.partition();
                return Ok(());
            }
            _ => {
                let n = self.pick_node();
                if self.rng.chance(50) && self.may_lose_data(n) {
                    self.machine_crash(n)?;
                } else {
                    self.trace.push(format!("crash {n}"));
                    self.carry_out(n, Some(0))?;
                }
                return self.check();
            }
        };
        // Now and then the node crashes partway through carrying out what it decided.
        let crash_after = self.rng.chance(1).then(|| self.rng.below(4) as usize);
        if let Some(k) = crash_after {
            self.trace.push(format!("crash {n} after {k} effects"));
        }
        self.carry_out(n, crash_after)?;
        self.check()
    }

    /// Heal every link, or cut a node off from another node or from placement (one way or
    /// both).
    fn partition(&mut self) {
        if self.rng.chance(40) {
            self.cut.clear();
            self.trace.push("heal".into());
            return;
        }
        if self.replace && self.rng.chance(40) {
            return self.split();
        }
        let a = self.pick_node();
        // Another replica, or placement (0).
        let b = (a + 1 + self.rng.below(self.span)) % (self.span + 1);
        self.cut.insert((a, b));
        if self.rng.chance(70) {
            self.cut.insert((b, a));
        }
        self.trace.push(format!("cut {a}-{b}"));
    }
}

/// One seeded run; `Err` names the broken invariant, the seed and the last steps.
fn run(seed: u64, mix: Mix) -> Result<Reached, String> {
    let mut w = World::new(seed, mix);
    for i in 0..=STEPS {
        let r = if i < STEPS {
            w.step()
        } else {
            w.settle_answers()
        };
        if let Err(why) = r {
            let tail: Vec<&String> = w.trace.iter().rev().take(trace_n()).rev().collect();
            return Err(format!(
                "seed {seed}: {why}\nlast steps:\n  {}\nreplay: FELIX_REPLICA_SEED={seed} cargo nextest run -p felix-broker replica::sim",
                tail.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n  ")
            ));
        }
    }
    Ok(w.reached)
}

#[test]
fn replicas_keep_one_server_one_leader_per_generation_matching_logs_and_acked_records() {
    let seeds = seeds_from_env("FELIX_REPLICA_SEED", "FELIX_REPLICA_SEEDS", 2000);
    if std::env::var("FELIX_REPLICA_DUMP").is_ok() {
        let mut w = World::new(seeds[0], Mix::of_seed(seeds[0]));
        for _ in 0..STEPS {
            w.step().unwrap();
        }
        for t in &w.trace {
            eprintln!("T {t}");
        }
    }
    let names = [
        "a follower truncated",
        "a refusal deposed a leader",
        "two generations led",
        "a crash mid-batch",
        "a leader served",
        "two leading at once",
        "an ack, then another replica led",
        "a stale report after a machine crash",
        "a resignation",
        "a follower rebuilt from its leader's base",
        "a replica replaced and the new one counted",
    ];
    let mut counts = [0u64; 11];
    // With FELIX_REPLICA_BUDGET_S (scripts/test.sh sets it), seeds go on past the ones asked
    // for until the budget is spent: as many as fit, never fewer than asked.
    let budget = std::env::var("FELIX_REPLICA_BUDGET_S")
        .ok()
        .filter(|_| seeds.len() > 1)
        .map(|s| {
            std::time::Duration::from_secs(s.parse().expect("FELIX_REPLICA_BUDGET_S is seconds"))
        });
    let started = std::time::Instant::now();
    let mut more = seeds.last().map_or(0, |s| s + 1)..;
    let mut asked = seeds.iter().copied();
    let mut ran = 0u64;
    loop {
        let seed = match asked.next() {
            Some(s) => s,
            None if budget.is_some_and(|b| started.elapsed() < b) => more.next().unwrap(),
            None => break,
        };
        ran += 1;
        let r = run(seed, Mix::of_seed(seed)).unwrap_or_else(|e| panic!("{e}"));
        for (c, hit) in counts.iter_mut().zip([
            r.truncated,
            r.refused_step_down,
            r.two_generations_elected,
            r.crash_mid_batch,
            r.served,
            r.two_leading,
            r.acked_then_failover,
            r.stale_report_after_crash,
            r.resigned,
            r.rebuilt,
            r.replaced,
        ]) {
            *c += u64::from(hit);
        }
    }
    let reached: Vec<String> = names
        .iter()
        .zip(counts)
        .map(|(what, c)| format!("{what} {c}"))
        .collect();
    eprintln!(
        "{ran} seeds in {:.1} s; reached: {}",
        started.elapsed().as_secs_f64(),
        reached.join(", ")
    );
    // Probes: a run that never reaches these exercised nothing (a replay of one seed is
    // exempt). Each must be reached in at least 1 seed in 100, but an acknowledgement
    // followed by a failover in 1 in 200: it needs a served lease, a landed report and then a
    // promotion in one 900-step run, and the leader's fence of a replica that missed its
    // election (which keeps replica sets whole) made it rarer (25 of the first 2,000 seeds
    // before, 18 after).
    if ran >= 1000 {
        for (what, c) in names.iter().zip(counts) {
            let per = if *what == "an ack, then another replica led" {
                200
            } else {
                100
            };
            assert!(c * per >= ran, "{what}: reached in only {c} seeds");
        }
    }
}

/// How many of the last steps a failure prints (`FELIX_REPLICA_TRACE`, default 12).
fn trace_n() -> usize {
    std::env::var("FELIX_REPLICA_TRACE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12)
}

mod check;
mod mix;
use mix::Mix;

/// Rule 11 in the simulated world: the catalog reaching brokers, replacements, splits.
mod replace;
/// The negative twins: each breaks one rule and must be caught.
mod twins;

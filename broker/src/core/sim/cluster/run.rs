//! The cluster simulator's scheduler, its invariants and its seeded runs (see `cluster`).

use super::super::check;
use super::{Cluster, Covered, NODES};
use crate::core::admit::breaks::FORWARD_AGAIN;
use crate::core::peer::breaks::SENT_AS_UNSENT;
use felix_quic::server::ConnKey;
use felix_quic::wire::ErrorCode;
use std::sync::atomic::{AtomicBool, Ordering};

/// Events per run before it is brought to rest.
const STEPS: u64 = 400;

/// One kind of event the scheduler can pick.
#[derive(Clone, Copy, Debug)]
enum Ev {
    World(u64),
    Publish(u64),
    Dial,
    Establish(ConnKey),
    Carry(ConnKey, bool, usize),
    Clock(u64),
    Feed(u64),
    Move,
    Cut(ConnKey),
    Freeze(u64),
    Thaw(u64),
    Crash(u64),
}

impl Cluster {
    /// What can happen now. `active`: clients publish and things break; otherwise the run
    /// is being brought to rest and only what is already under way moves on.
    fn options(&self, active: bool) -> Vec<Ev> {
        let mut o = Vec::new();
        let live = |id: u64| !self.frozen(id);
        for n in &self.nodes {
            if n.frozen {
                continue;
            }
            if n.world.busy() {
                o.extend([Ev::World(n.id); 3]);
            }
            if !n.feed.is_empty() {
                o.push(Ev::Feed(n.id));
            }
            if active {
                o.extend([Ev::Publish(n.id); 2]);
                o.push(Ev::Clock(n.id));
            }
        }
        if self.dials.iter().any(|(from, _)| live(*from)) {
            o.push(Ev::Dial);
        }
        for (key, w) in &self.wires {
            if !w.established && live(w.from) && live(w.to) {
                o.push(Ev::Establish(*key));
            }
            for lane in 0..2 {
                if !w.up[lane].is_empty() && live(w.to) {
                    o.extend([Ev::Carry(*key, true, lane); 2]);
                }
                if !w.down[lane].is_empty() && live(w.from) {
                    o.extend([Ev::Carry(*key, false, lane); 2]);
                }
            }
        }
        if active {
            // Disruptions are rarer than traffic.
            if self.rng_peek_chance() {
                o.push(Ev::Move);
                if let Some((k, _)) = self.wires.iter().next() {
                    o.push(Ev::Cut(*k));
                }
                match self.nodes.iter().find(|n| n.frozen) {
                    Some(n) => o.push(Ev::Thaw(n.id)),
                    None => o.push(Ev::Freeze(1 + self.steps % NODES)),
                }
                o.push(Ev::Crash(1 + (self.steps / 7) % NODES));
            }
        }
        o
    }

    /// One disruption is offered in about every tenth step (decided by the step count, so
    /// the option list is a pure function of the state).
    fn rng_peek_chance(&self) -> bool {
        self.steps % 10 == 3
    }

    fn apply(&mut self, ev: Ev) {
        match ev {
            Ev::World(n) => {
                self.node(n).world.step();
            }
            Ev::Publish(n) => self.client_publish(n),
            Ev::Dial => {
                // Only a live broker dials.
                let live: Vec<usize> = (0..self.dials.len())
                    .filter(|i| !self.frozen(self.dials[*i].0))
                    .collect();
                let i = live[self.rng.below(live.len() as u64) as usize];
                self.dial(i);
            }
            Ev::Establish(k) => self.establish(k),
            Ev::Carry(k, up, lane) => self.carry(k, up, lane),
            Ev::Clock(n) => {
                let ms = 1 + self.rng.below(60);
                self.advance(n, ms);
            }
            Ev::Feed(n) => self.apply_feed(n),
            Ev::Move => {
                self.move_shard();
            }
            Ev::Cut(k) => self.cut(k),
            Ev::Freeze(n) => {
                self.note(format!("broker {n} freezes"));
                self.node(n).frozen = true;
            }
            Ev::Thaw(n) => {
                self.note(format!("broker {n} thaws"));
                self.node(n).frozen = false;
            }
            Ev::Crash(n) => {
                self.node(n).frozen = false;
                self.crash(n);
            }
        }
        self.collect_answers();
    }

    /// One random event; false when nothing can happen.
    fn step(&mut self, active: bool) -> Result<bool, String> {
        self.steps += 1;
        let o = self.options(active);
        if o.is_empty() {
            return Ok(false);
        }
        let ev = o[self.rng.below(o.len() as u64) as usize];
        self.apply(ev);
        self.after_step()?;
        Ok(true)
    }

    /// Every deadline of every broker runs out: clocks move a second, links are ticked.
    fn time_runs_out(&mut self) -> Result<(), String> {
        for n in 1..=NODES {
            self.advance(n, 1000);
        }
        self.collect_answers();
        self.after_step()
    }

    /// Thaw everything, hear every catalog, and run what is under way to its end. Bounded.
    fn quiesce(&mut self) -> Result<(), String> {
        for n in &mut self.nodes {
            n.frozen = false;
        }
        for _ in 0..30 {
            for _ in 0..100_000 {
                if !self.step(false)? {
                    break;
                }
            }
            self.time_runs_out()?;
            let pending = self.reqs.values().any(|r| !r.lost && r.answers.is_empty());
            if !pending && self.options(false).is_empty() {
                break;
            }
        }
        self.at_rest()
    }

    // ---------- invariants ----------

    fn after_step(&self) -> Result<(), String> {
        for n in &self.nodes {
            check::after_step(&n.world).map_err(|e| format!("broker {}: {e}", n.id))?;
        }
        for (gid, r) in &self.reqs {
            if r.answers.len() > 1 {
                return Err(format!(
                    "INVARIANT answered_once: g{gid} answered {} times: {:?}",
                    r.answers.len(),
                    r.answers
                ));
            }
            if r.forwards_sent > 1 {
                return Err(format!(
                    "INVARIANT forwarded_once: g{gid} crossed {} links (a forward was forwarded again)",
                    r.forwards_sent
                ));
            }
            self.truthful(*gid)?;
        }
        Ok(())
    }

    /// INVARIANT `answers_truthful` for request `gid`.
    fn truthful(&self, gid: u64) -> Result<(), String> {
        let r = &self.reqs[&gid];
        let Some(answer) = r.answers.first() else {
            return Ok(());
        };
        let owner_said = |node: u64, wid: u64| {
            self.nodes[(node - 1) as usize].world.pubs[&wid]
                .answers
                .first()
                .copied()
        };
        match answer {
            Ok((first, count, owner)) => {
                let found = r.handed.iter().any(|(node, wid)| {
                    node == owner && owner_said(*node, *wid) == Some(Ok((*first, *count)))
                });
                if !found {
                    return Err(format!(
                        "INVARIANT answers_truthful: g{gid} acknowledged at {first}+{count} by broker {owner}, which acknowledged no such thing (handed to {:?})",
                        r.handed
                    ));
                }
            }
            Err(ErrorCode::OutcomeUnknown) => {}
            Err(code) => {
                for (node, wid) in &r.handed {
                    if let Some(Ok((first, _))) = owner_said(*node, *wid) {
                        return Err(format!(
                            "INVARIANT answers_truthful: g{gid} was refused {code:?} (nothing was done), but broker {node} appended it at {first} of {:?}",
                            r.key
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    fn at_rest(&self) -> Result<(), String> {
        self.after_step()?;
        for n in &self.nodes {
            check::at_rest(&n.world).map_err(|e| format!("broker {}: {e}", n.id))?;
        }
        for (gid, r) in &self.reqs {
            if !r.lost && r.answers.is_empty() {
                return Err(format!(
                    "INVARIANT nothing_forgotten: g{gid} (to {:?} via broker {}) was never answered",
                    r.key, r.node
                ));
            }
        }
        Ok(())
    }
}

fn run(seed: u64) -> Result<Covered, String> {
    let mut c = Cluster::new(seed);
    let r = (|| {
        for _ in 0..STEPS {
            c.step(true)?;
        }
        c.quiesce()
    })();
    match r {
        Ok(()) => Ok(c.covered),
        Err(e) => {
            let trace: Vec<String> = c.trace.iter().cloned().collect();
            Err(format!(
                "seed {seed}: {e}\nlast events:\n  {}",
                trace.join("\n  ")
            ))
        }
    }
}

fn seeds() -> Vec<u64> {
    super::super::seeds_from_env("FELIX_CLUSTER_SEED", "FELIX_CLUSTER_SEEDS", 300)
}

#[test]
fn brokers_forward_once_and_answer_truthfully_across_moves_cuts_and_crashes() {
    let mut total = Covered::default();
    for seed in seeds() {
        let c = run(seed).unwrap_or_else(|e| {
            panic!(
                "{e}\nreplay: FELIX_CLUSTER_SEED={seed} cargo nextest run -p felix-broker cluster"
            )
        });
        total.acked_local += c.acked_local;
        total.acked_forwarded += c.acked_forwarded;
        total.outcome_unknown += c.outcome_unknown;
        total.unavailable += c.unavailable;
        total.refused_by_owner += c.refused_by_owner;
        total.moves += c.moves;
    }
    eprintln!("coverage: {total:?}");
    // Every way a publish ends was reached, and placements moved under it.
    if std::env::var("FELIX_CLUSTER_SEED").is_err() {
        assert!(
            total.acked_local > 0
                && total.acked_forwarded > 0
                && total.outcome_unknown > 0
                && total.unavailable > 0
                && total.refused_by_owner > 0
                && total.moves > 0,
            "coverage {total:?}"
        );
    }
}

/// A negative twin: with `switch` on, a run among the first seeds breaks `rule`.
fn caught(switch: &AtomicBool, rule: &str) {
    switch.store(true, Ordering::Relaxed);
    let found = (0..300).find_map(|s| run(s).err());
    switch.store(false, Ordering::Relaxed);
    let e = found.unwrap_or_else(|| panic!("the broken rule went unnoticed ({rule})"));
    assert!(e.contains(rule), "{e}");
    eprintln!("caught: {e}");
}

#[test]
fn the_cluster_check_catches_a_forward_forwarded_again() {
    caught(&FORWARD_AGAIN, "forwarded_once");
}

#[test]
fn the_cluster_check_catches_a_sent_forward_answered_as_never_sent() {
    caught(&SENT_AS_UNSENT, "answers_truthful");
}

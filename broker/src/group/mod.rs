//! Pure state of one consumer group on one shard: claims, acks, nacks, visibility
//! timeouts, redelivery, dead letters and the group's cursor. No clock, no socket, no
//! runtime: the caller passes the time (`now_ms`, any monotonic millisecond clock) and the
//! log's tail (the next offset the shard's log will assign); a driver persists
//! [`GroupSnapshot`]s and moves claims on and off the wire.
//!
//! # Rules
//! - A record is handed out by [`Group::poll`] as a [`Claim`] naming its delivery:
//!   `SHARD:OFFSET:ATTEMPTS` ([`ClaimId`]). Attempts count deliveries from 1. While a claim
//!   holds (its deadline is in the future) the record is never handed to anyone else.
//! - [`Group::ack`], [`Group::nack`], [`Group::extend`], [`Group::dead_letter`] and
//!   [`Group::release`] (a driver's take-back of a claim it could not send) answer a
//!   delivery. An answer naming any other delivery than the record's current, live one — an
//!   older attempt, a claim whose deadline has passed (even before [`Group::expire`] ran), a
//!   record already acked, skipped or dead-lettered — is refused with
//!   [`GroupError::StaleClaim`]. A lapsed claim never comes back to life.
//! - Poll order: strictly by offset among everything eligible now (fresh records,
//!   redeliveries after a lapse, nacked records whose delay passed, redriven dead letters).
//!   Lowest first is what lets the cursor move, so a redelivery never waits behind newer
//!   records. Every poll first expires lapsed claims.
//! - A delivery that lapses or is nacked when the record has had `max_attempts` deliveries
//!   dead-letters it: it becomes a pointer ([`DeadLetter`]: offset, attempts, reason) and is
//!   never handed out again unless redriven. A consumer can also dead-letter a claim at once
//!   ([`Group::dead_letter`], reason `Rejected`).
//! - The cursor is the first offset not finished. Finished = acked, dead-lettered (so one
//!   poison record cannot stall the group forever), discarded, or skipped by a forward seek.
//!   It advances only over a contiguous run of finished offsets and never moves backwards,
//!   except by an explicit backward [`Group::seek`] (an operator's replay).
//! - Dead letters are listed in offset order ([`Group::dead_letters`], bounded pages),
//!   [`Group::redrive`]n (handed out again with a fresh budget of `max_attempts`
//!   deliveries; attempt numbers keep counting up so no answer to a delivery from before the
//!   redrive can be taken for a new one; while redriving the pointer stays in the list,
//!   marked `redriving`, until the record is acked — removed — or fails again — back to
//!   dead) or [`Group::discard`]ed (the pointer is dropped; the record stays finished).
//!   Dead letters, redriving or not, do not hold back the cursor.
//! - [`Group::seek`] to an offset at or below the tail. Forward: every offset below it is
//!   finished (skipped); claims on them become stale. Backward: the cursor moves back and
//!   every offset from the target on that is not a dead letter is to be delivered again;
//!   live claims become stale; records that had a delivery keep counting attempts (fresh
//!   budget), records that had finished start again at attempt 1. Dead letters are never
//!   touched by a seek. (A caller's answer to a claim lapsed long before a backward seek
//!   could match a new delivery with the same number: the claim id has no room for an epoch.)
//!
//! # Bounds (memory)
//! At most `max_in_flight_records` live claims. A fresh offset is only handed out while the
//! group tracks fewer than `max_window_records` records (undelivered-but-touched records plus
//! finished records beyond the cursor); at most `max_dead_letters` pointers — when the list is
//! full a record that runs out of attempts is *parked* (not handed out, not finished, holding
//! the cursor) until a discard or a finished redrive makes room: nothing is ever dropped
//! silently, the group stalls visibly ([`GroupStats::parked`]) instead.
//!
//! # Durability
//! [`GroupSnapshot`] holds the durable part: cursor, finished offsets beyond the cursor,
//! dead letters. Live claims and delays are not persisted: after a restart every record not
//! finished is delivered again from attempt 1 (redriving dead letters continue their
//! numbering). That is the at-least-once window: a record acked after the last persisted
//! snapshot is delivered again, and an answer to a claim from before the restart can match a
//! new delivery of the same number. Attempt budgets also restart, so a record can be
//! delivered more than `max_attempts` times in total across restarts.

use std::collections::{BTreeMap, BTreeSet};

pub mod file;
mod snapshot;
#[cfg(test)]
mod tests;

pub use snapshot::{GroupSnapshot, SnapshotError};

/// Test-build switch that breaks the claim rule on purpose: claims lapse 20 ms before their
/// deadline, so a record can be handed out while its claim still holds. The simulator's
/// negative twin shows its `claim_held_once` check catches it.
#[cfg(test)]
pub(crate) static BREAK_LAPSE_EARLY: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

#[cfg(test)]
fn lapse_early_ms() -> u64 {
    if BREAK_LAPSE_EARLY.load(std::sync::atomic::Ordering::Relaxed) {
        20
    } else {
        0
    }
}

/// Largest accepted `max_attempts` (deliveries).
pub const MAX_ATTEMPTS_LIMIT: u32 = 1_000;
/// Largest accepted visibility timeout or nack delay: 12 hours in milliseconds.
pub const DURATION_LIMIT_MS: u64 = 12 * 60 * 60 * 1000;
/// Largest accepted `max_in_flight_records` and `max_poll_records`.
pub const IN_FLIGHT_LIMIT_RECORDS: u32 = 1_000_000;
/// Largest accepted `max_window_records` and `max_dead_letters`.
pub const TRACKED_LIMIT_RECORDS: u32 = 10_000_000;
/// Largest page of dead letters one list returns.
pub const DEAD_LETTER_PAGE_LIMIT: u32 = 1_000;

/// Per-group limits. Every field carries its unit; [`GroupConfig::validate`] checks them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupConfig {
    /// Deliveries of one record before it is dead-lettered (1..=[`MAX_ATTEMPTS_LIMIT`]).
    pub max_attempts: u32,
    /// Visibility timeout of a poll that names none (1..=`max_visibility_timeout_ms`).
    pub default_visibility_timeout_ms: u64,
    /// Longest visibility timeout a poll or extend may ask for (1..=[`DURATION_LIMIT_MS`]).
    pub max_visibility_timeout_ms: u64,
    /// Longest nack delay (0..=[`DURATION_LIMIT_MS`]; 0 allows only immediate nacks).
    pub max_nack_delay_ms: u64,
    /// Live claims at once over all consumers (1..=[`IN_FLIGHT_LIMIT_RECORDS`]).
    pub max_in_flight_records: u32,
    /// Records one poll may claim (1..=`max_in_flight_records`).
    pub max_poll_records: u32,
    /// Records tracked ahead of the cursor before fresh ones stop being handed out
    /// (`max_in_flight_records`..=[`TRACKED_LIMIT_RECORDS`]).
    pub max_window_records: u32,
    /// Dead-letter pointers kept (1..=[`TRACKED_LIMIT_RECORDS`]).
    pub max_dead_letters: u32,
}

impl Default for GroupConfig {
    fn default() -> Self {
        GroupConfig {
            max_attempts: 5,
            default_visibility_timeout_ms: 30_000,
            max_visibility_timeout_ms: DURATION_LIMIT_MS,
            max_nack_delay_ms: DURATION_LIMIT_MS,
            max_in_flight_records: 10_000,
            max_poll_records: 1_000,
            max_window_records: 100_000,
            max_dead_letters: 100_000,
        }
    }
}

/// A [`GroupConfig`] field outside its bounds.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("group config {field} = {value} is outside {min}..={max}")]
pub struct ConfigError {
    pub field: &'static str,
    pub value: u64,
    pub min: u64,
    pub max: u64,
}

fn in_range(field: &'static str, value: u64, min: u64, max: u64) -> Result<(), ConfigError> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(ConfigError {
            field,
            value,
            min,
            max,
        })
    }
}

impl GroupConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        in_range(
            "max_attempts",
            self.max_attempts as u64,
            1,
            MAX_ATTEMPTS_LIMIT as u64,
        )?;
        in_range(
            "max_visibility_timeout_ms",
            self.max_visibility_timeout_ms,
            1,
            DURATION_LIMIT_MS,
        )?;
        in_range(
            "default_visibility_timeout_ms",
            self.default_visibility_timeout_ms,
            1,
            self.max_visibility_timeout_ms,
        )?;
        in_range(
            "max_nack_delay_ms",
            self.max_nack_delay_ms,
            0,
            DURATION_LIMIT_MS,
        )?;
        in_range(
            "max_in_flight_records",
            self.max_in_flight_records as u64,
            1,
            IN_FLIGHT_LIMIT_RECORDS as u64,
        )?;
        in_range(
            "max_poll_records",
            self.max_poll_records as u64,
            1,
            self.max_in_flight_records as u64,
        )?;
        in_range(
            "max_window_records",
            self.max_window_records as u64,
            self.max_in_flight_records as u64,
            TRACKED_LIMIT_RECORDS as u64,
        )?;
        in_range(
            "max_dead_letters",
            self.max_dead_letters as u64,
            1,
            TRACKED_LIMIT_RECORDS as u64,
        )?;
        Ok(())
    }
}

pub use felix_quic::wire::group::{ClaimId, ClaimIdError};

/// One delivery handed out by [`Group::poll`] (or renewed by [`Group::extend`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claim {
    pub shard: u32,
    pub offset: u64,
    /// This delivery's number, from 1.
    pub attempt: u32,
    /// The claim holds while `now_ms < deadline_ms`.
    pub deadline_ms: u64,
}

impl Claim {
    pub fn id(&self) -> ClaimId {
        ClaimId {
            shard: self.shard,
            offset: self.offset,
            attempt: self.attempt,
        }
    }
}

/// Why a dead letter was abandoned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeadLetterReason {
    /// Its last allowed delivery lapsed unanswered.
    Expired,
    /// Its last allowed delivery was nacked.
    Nacked,
    /// A consumer dead-lettered its claim ([`Group::dead_letter`]).
    Rejected,
}

/// A pointer to an abandoned record in the shard's log (not a copy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    pub offset: u64,
    /// The number of the delivery that abandoned it.
    pub attempts: u32,
    pub reason: DeadLetterReason,
    /// Redriven and not yet acked or failed again.
    pub redriving: bool,
}

/// One page of [`Group::dead_letters`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetterPage {
    pub letters: Vec<DeadLetter>,
    /// Pass as `after` for the next page; `None` on the last page.
    pub next_after: Option<u64>,
}

/// What became of a lapsed claim in [`Group::expire`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    /// Eligible again; the next delivery is `attempt + 1`.
    Redeliver,
    DeadLettered,
    /// Out of attempts but the dead-letter list is full: held until it has room.
    Parked,
}

/// A claim that lapsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expired {
    pub offset: u64,
    pub attempt: u32,
    pub fate: Fate,
}

/// Why an answer was refused as stale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StaleReason {
    /// The record is out under another delivery.
    AttemptMismatch { current: u32 },
    /// The claim's deadline passed.
    Lapsed,
    /// The record is not out under any claim (waiting, parked or reset by a seek).
    NotInFlight,
    /// The record was acked, discarded or skipped.
    Finished,
    /// The record is a dead letter.
    DeadLettered,
    /// That offset was never handed out.
    NeverDelivered,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GroupError {
    #[error("stale_claim: {claim} ({reason:?})")]
    StaleClaim { claim: ClaimId, reason: StaleReason },
    #[error("claim {claim} names shard {}, this group is on shard {shard}", claim.shard)]
    WrongShard { claim: ClaimId, shard: u32 },
    #[error("poll max {requested} is outside 1..={max} records")]
    PollMaxOutOfRange { requested: u32, max: u32 },
    #[error("visibility timeout {requested_ms} ms is outside 1..={max_ms} ms")]
    VisibilityTimeoutOutOfRange { requested_ms: u64, max_ms: u64 },
    #[error("nack delay {requested_ms} ms exceeds {max_ms} ms")]
    NackDelayOutOfRange { requested_ms: u64, max_ms: u64 },
    #[error("dead-letter page limit {requested} is outside 1..={max}")]
    PageLimitOutOfRange { requested: u32, max: u32 },
    #[error("offset {offset} is not a dead letter")]
    NotDeadLettered { offset: u64 },
    #[error("dead letter {offset} is being redriven")]
    RedriveInProgress { offset: u64 },
    #[error("offset {offset} is beyond the log's tail {tail}")]
    BeyondTail { offset: u64, tail: u64 },
    #[error(transparent)]
    Config(#[from] ConfigError),
}

impl GroupError {
    /// Stable snake_case name for the wire.
    pub fn code(&self) -> &'static str {
        match self {
            GroupError::StaleClaim { .. } => "stale_claim",
            GroupError::WrongShard { .. } => "wrong_shard",
            GroupError::PollMaxOutOfRange { .. }
            | GroupError::VisibilityTimeoutOutOfRange { .. }
            | GroupError::NackDelayOutOfRange { .. }
            | GroupError::PageLimitOutOfRange { .. } => "invalid_argument",
            GroupError::NotDeadLettered { .. } => "not_dead_lettered",
            GroupError::RedriveInProgress { .. } => "redrive_in_progress",
            GroupError::BeyondTail { .. } => "offset_beyond_tail",
            GroupError::Config(_) => "invalid_config",
        }
    }
}

/// Counts for `describe`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupStats {
    pub cursor: u64,
    pub tail: u64,
    pub in_flight: u64,
    /// Delivered before, waiting for redelivery (now or after a nack delay).
    pub waiting: u64,
    pub parked: u64,
    pub dead_letters: u64,
    pub finished_beyond_cursor: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Waiting { not_before_ms: u64 },
    InFlight { deadline_ms: u64 },
    Parked { reason: DeadLetterReason },
}

/// A record delivered at least once and not finished.
#[derive(Clone, Copy, Debug)]
struct Rec {
    /// Deliveries so far (the last claim's number).
    attempts: u32,
    /// `attempts` when the current budget started (0, or at a redrive / backward seek).
    base: u32,
    phase: Phase,
}

/// One consumer group on one shard.
#[derive(Debug)]
pub struct Group {
    shard: u32,
    cfg: GroupConfig,
    tail: u64,
    cursor: u64,
    /// No offset below `scan` is fresh (never delivered since the last reset).
    scan: u64,
    recs: BTreeMap<u64, Rec>,
    /// Records in `recs` that are redriven dead letters (not counted against the window).
    redrive_recs: usize,
    /// Finished offsets above the cursor that are not dead letters.
    finished: BTreeSet<u64>,
    dead: BTreeMap<u64, DeadLetter>,
    ready: BTreeSet<u64>,
    delayed: BTreeSet<(u64, u64)>,
    deadlines: BTreeSet<(u64, u64)>,
    parked: BTreeSet<u64>,
}

impl Group {
    /// A new group whose cursor starts at `start` (the driver resolves earliest / latest /
    /// an exact offset) on a log whose next offset is `tail`.
    pub fn new(shard: u32, cfg: GroupConfig, start: u64, tail: u64) -> Result<Group, GroupError> {
        cfg.validate()?;
        if start > tail {
            return Err(GroupError::BeyondTail {
                offset: start,
                tail,
            });
        }
        Ok(Group {
            shard,
            cfg,
            tail,
            cursor: start,
            scan: start,
            recs: BTreeMap::new(),
            redrive_recs: 0,
            finished: BTreeSet::new(),
            dead: BTreeMap::new(),
            ready: BTreeSet::new(),
            delayed: BTreeSet::new(),
            deadlines: BTreeSet::new(),
            parked: BTreeSet::new(),
        })
    }

    pub fn shard(&self) -> u32 {
        self.shard
    }
    pub fn config(&self) -> &GroupConfig {
        &self.cfg
    }
    /// The first offset not finished; everything below it is done for this group.
    pub fn cursor(&self) -> u64 {
        self.cursor
    }
    pub fn tail(&self) -> u64 {
        self.tail
    }

    pub fn stats(&self) -> GroupStats {
        GroupStats {
            cursor: self.cursor,
            tail: self.tail,
            in_flight: self.deadlines.len() as u64,
            waiting: (self.ready.len() + self.delayed.len()) as u64,
            parked: self.parked.len() as u64,
            dead_letters: self.dead.len() as u64,
            finished_beyond_cursor: self.finished.len() as u64,
        }
    }

    /// The log's next offset grew to `tail` (a smaller value than known is ignored).
    pub fn records_available(&mut self, tail: u64) {
        self.tail = self.tail.max(tail);
    }

    /// Records that count against `max_window_records`.
    fn tracked(&self) -> usize {
        self.recs.len() - self.redrive_recs + self.finished.len()
    }

    fn fresh_candidate(&mut self) -> Option<u64> {
        while self.scan < self.tail {
            let o = self.scan;
            if self.recs.contains_key(&o)
                || self.finished.contains(&o)
                || self.dead.contains_key(&o)
            {
                self.scan += 1;
            } else {
                return Some(o);
            }
        }
        None
    }

    fn visibility(&self, requested: Option<u64>) -> Result<u64, GroupError> {
        let ms = requested.unwrap_or(self.cfg.default_visibility_timeout_ms);
        if ms == 0 || ms > self.cfg.max_visibility_timeout_ms {
            return Err(GroupError::VisibilityTimeoutOutOfRange {
                requested_ms: ms,
                max_ms: self.cfg.max_visibility_timeout_ms,
            });
        }
        Ok(ms)
    }

    /// Claim up to `max` of the lowest eligible offsets for `visibility_timeout_ms` (the
    /// config's default when `None`). Expires lapsed claims first. Returns fewer (or none)
    /// when nothing more is eligible, the in-flight bound or the window is reached.
    pub fn poll(
        &mut self,
        max: u32,
        visibility_timeout_ms: Option<u64>,
        now_ms: u64,
    ) -> Result<Vec<Claim>, GroupError> {
        if max == 0 || max > self.cfg.max_poll_records {
            return Err(GroupError::PollMaxOutOfRange {
                requested: max,
                max: self.cfg.max_poll_records,
            });
        }
        let vt = self.visibility(visibility_timeout_ms)?;
        self.expire(now_ms);
        let deadline_ms = now_ms.saturating_add(vt);
        let mut out = Vec::new();
        while out.len() < max as usize
            && self.deadlines.len() < self.cfg.max_in_flight_records as usize
        {
            let redelivery = self.ready.first().copied();
            let fresh = if self.tracked() < self.cfg.max_window_records as usize {
                self.fresh_candidate()
            } else {
                None
            };
            let offset = match (redelivery, fresh) {
                (Some(r), Some(f)) if f < r => {
                    self.take_fresh(f);
                    f
                }
                (Some(r), _) => {
                    self.ready.remove(&r);
                    r
                }
                (None, Some(f)) => {
                    self.take_fresh(f);
                    f
                }
                (None, None) => break,
            };
            let rec = self
                .recs
                .get_mut(&offset)
                .expect("eligible record is tracked");
            debug_assert!(
                matches!(rec.phase, Phase::Waiting { not_before_ms } if not_before_ms <= now_ms),
                "offset {offset} handed out while not eligible: {rec:?}"
            );
            rec.attempts += 1;
            rec.phase = Phase::InFlight { deadline_ms };
            let fresh_in = self.deadlines.insert((deadline_ms, offset));
            debug_assert!(fresh_in, "offset {offset} claimed twice");
            out.push(Claim {
                shard: self.shard,
                offset,
                attempt: rec.attempts,
                deadline_ms,
            });
        }
        Ok(out)
    }

    fn take_fresh(&mut self, offset: u64) {
        debug_assert_eq!(offset, self.scan);
        self.scan = offset + 1;
        self.recs.insert(
            offset,
            Rec {
                attempts: 0,
                base: 0,
                phase: Phase::Waiting { not_before_ms: 0 },
            },
        );
    }

    /// The live delivery `claim` names, or why it is stale. Returns its deadline.
    fn live(&self, claim: ClaimId, now_ms: u64) -> Result<u64, GroupError> {
        if claim.shard != self.shard {
            return Err(GroupError::WrongShard {
                claim,
                shard: self.shard,
            });
        }
        let stale = |reason| Err(GroupError::StaleClaim { claim, reason });
        let Some(rec) = self.recs.get(&claim.offset) else {
            return if self.dead.contains_key(&claim.offset) {
                stale(StaleReason::DeadLettered)
            } else if claim.offset < self.cursor || self.finished.contains(&claim.offset) {
                stale(StaleReason::Finished)
            } else {
                stale(StaleReason::NeverDelivered)
            };
        };
        match rec.phase {
            Phase::InFlight { .. } if rec.attempts != claim.attempt => {
                stale(StaleReason::AttemptMismatch {
                    current: rec.attempts,
                })
            }
            Phase::InFlight { deadline_ms } if deadline_ms <= now_ms => stale(StaleReason::Lapsed),
            Phase::InFlight { deadline_ms } => Ok(deadline_ms),
            Phase::Waiting { .. } | Phase::Parked { .. } => stale(StaleReason::NotInFlight),
        }
    }

    /// Whether `claim` names the record's live delivery now (what every answer checks).
    pub fn is_live(&self, claim: ClaimId, now_ms: u64) -> bool {
        self.live(claim, now_ms).is_ok()
    }

    /// The record is done for this group.
    pub fn ack(&mut self, claim: ClaimId, now_ms: u64) -> Result<(), GroupError> {
        let deadline = self.live(claim, now_ms)?;
        let o = claim.offset;
        self.deadlines.remove(&(deadline, o));
        self.recs.remove(&o);
        if self.dead.remove(&o).is_some() {
            self.redrive_recs -= 1;
            self.unpark();
        }
        if o >= self.cursor {
            self.finished.insert(o);
        }
        self.advance_cursor();
        Ok(())
    }

    /// Hand the record back: eligible again after `delay_ms` (0: at once), or dead-lettered
    /// if this was its last allowed delivery.
    pub fn nack(&mut self, claim: ClaimId, delay_ms: u64, now_ms: u64) -> Result<Fate, GroupError> {
        if delay_ms > self.cfg.max_nack_delay_ms {
            return Err(GroupError::NackDelayOutOfRange {
                requested_ms: delay_ms,
                max_ms: self.cfg.max_nack_delay_ms,
            });
        }
        let deadline = self.live(claim, now_ms)?;
        self.deadlines.remove(&(deadline, claim.offset));
        Ok(self.hand_back(
            claim.offset,
            now_ms.saturating_add(delay_ms),
            now_ms,
            DeadLetterReason::Nacked,
        ))
    }

    fn hand_back(
        &mut self,
        o: u64,
        not_before_ms: u64,
        now_ms: u64,
        reason: DeadLetterReason,
    ) -> Fate {
        let rec = self
            .recs
            .get_mut(&o)
            .expect("handed back record is tracked");
        if rec.attempts - rec.base >= self.cfg.max_attempts {
            return self.kill(o, reason);
        }
        rec.phase = Phase::Waiting { not_before_ms };
        if not_before_ms <= now_ms {
            self.ready.insert(o);
        } else {
            self.delayed.insert((not_before_ms, o));
        }
        Fate::Redeliver
    }

    /// Dead-letter the record now (reason `Rejected`), whatever attempts it has left.
    pub fn dead_letter(&mut self, claim: ClaimId, now_ms: u64) -> Result<Fate, GroupError> {
        let deadline = self.live(claim, now_ms)?;
        self.deadlines.remove(&(deadline, claim.offset));
        Ok(self.kill(claim.offset, DeadLetterReason::Rejected))
    }

    /// Move a tracked record (not in any index) to the dead letters, or park it.
    fn kill(&mut self, o: u64, reason: DeadLetterReason) -> Fate {
        let attempts = self.recs[&o].attempts;
        if let Some(dl) = self.dead.get_mut(&o) {
            // A redrive that failed again: back to dead, no room needed.
            *dl = DeadLetter {
                offset: o,
                attempts,
                reason,
                redriving: false,
            };
            self.recs.remove(&o);
            self.redrive_recs -= 1;
            return Fate::DeadLettered;
        }
        if self.dead.len() >= self.cfg.max_dead_letters as usize {
            self.recs.get_mut(&o).unwrap().phase = Phase::Parked { reason };
            self.parked.insert(o);
            return Fate::Parked;
        }
        self.recs.remove(&o);
        self.dead.insert(
            o,
            DeadLetter {
                offset: o,
                attempts,
                reason,
                redriving: false,
            },
        );
        self.advance_cursor();
        Fate::DeadLettered
    }

    fn unpark(&mut self) {
        while self.dead.len() < self.cfg.max_dead_letters as usize {
            let Some(o) = self.parked.pop_first() else {
                break;
            };
            let Phase::Parked { reason } = self.recs[&o].phase else {
                unreachable!("parked index names a parked record");
            };
            self.kill(o, reason);
        }
    }

    /// Take back a live claim that never reached its consumer (the driver could not send it,
    /// e.g. the poll answer would exceed the frame bound or the connection went away): the
    /// record is eligible again at once and the delivery does not count against its budget
    /// (its number is not reused, so no answer to it can match a later delivery).
    pub fn release(&mut self, claim: ClaimId, now_ms: u64) -> Result<(), GroupError> {
        let deadline = self.live(claim, now_ms)?;
        let o = claim.offset;
        self.deadlines.remove(&(deadline, o));
        let rec = self.recs.get_mut(&o).expect("live claim is tracked");
        rec.base += 1;
        rec.phase = Phase::Waiting { not_before_ms: 0 };
        self.ready.insert(o);
        Ok(())
    }

    /// Renew a live claim: its deadline becomes `now_ms + visibility_timeout_ms`.
    pub fn extend(
        &mut self,
        claim: ClaimId,
        visibility_timeout_ms: u64,
        now_ms: u64,
    ) -> Result<Claim, GroupError> {
        let vt = self.visibility(Some(visibility_timeout_ms))?;
        let old = self.live(claim, now_ms)?;
        let deadline_ms = now_ms.saturating_add(vt);
        self.deadlines.remove(&(old, claim.offset));
        self.deadlines.insert((deadline_ms, claim.offset));
        self.recs.get_mut(&claim.offset).unwrap().phase = Phase::InFlight { deadline_ms };
        Ok(Claim {
            shard: self.shard,
            offset: claim.offset,
            attempt: claim.attempt,
            deadline_ms,
        })
    }

    /// Lapse every claim whose deadline is at or before `now_ms` (in deadline, then offset
    /// order): the record is eligible again, or dead-lettered (parked) if that was its last
    /// allowed delivery. Nacked records whose delay has passed become eligible too, so
    /// [`Group::next_wakeup_ms`] never names a time already past.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Expired> {
        while let Some(&(nb, o)) = self.delayed.first() {
            if nb > now_ms {
                break;
            }
            self.delayed.pop_first();
            self.ready.insert(o);
        }
        let mut out = Vec::new();
        #[cfg(test)]
        let now_ms = now_ms + lapse_early_ms();
        while let Some(&(deadline, o)) = self.deadlines.first() {
            if deadline > now_ms {
                break;
            }
            self.deadlines.pop_first();
            let attempt = self.recs[&o].attempts;
            let fate = self.hand_back(o, 0, 0, DeadLetterReason::Expired);
            out.push(Expired {
                offset: o,
                attempt,
                fate,
            });
        }
        out
    }

    /// When the group next changes by time alone (a claim lapses or a nack delay passes):
    /// a driver long-polling sleeps until then, or until records arrive or claims are
    /// answered. `None`: nothing is timed.
    pub fn next_wakeup_ms(&self) -> Option<u64> {
        let lapse = self.deadlines.first().map(|&(d, _)| d);
        let delay = self.delayed.first().map(|&(nb, _)| nb);
        match (lapse, delay) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn advance_cursor(&mut self) {
        let old = self.cursor;
        while self.cursor < self.tail
            && (self.finished.remove(&self.cursor) || self.dead.contains_key(&self.cursor))
        {
            self.cursor += 1;
        }
        assert!(self.cursor >= old, "group cursor moved backwards");
        self.scan = self.scan.max(self.cursor);
    }

    /// Drop a tracked record's index entries (not the record itself).
    fn unindex(&mut self, o: u64) {
        match self.recs[&o].phase {
            Phase::InFlight { deadline_ms } => {
                self.deadlines.remove(&(deadline_ms, o));
            }
            Phase::Waiting { not_before_ms } => {
                self.ready.remove(&o);
                self.delayed.remove(&(not_before_ms, o));
            }
            Phase::Parked { .. } => {
                self.parked.remove(&o);
            }
        }
    }

    /// Move the cursor to `offset` (at most the tail). See the module docs for both
    /// directions; dead letters are never touched.
    pub fn seek(&mut self, offset: u64) -> Result<(), GroupError> {
        if offset > self.tail {
            return Err(GroupError::BeyondTail {
                offset,
                tail: self.tail,
            });
        }
        if offset >= self.cursor {
            let skipped: Vec<u64> = self
                .recs
                .range(..offset)
                .map(|(&o, _)| o)
                .filter(|o| !self.dead.contains_key(o))
                .collect();
            for o in skipped {
                self.unindex(o);
                self.recs.remove(&o);
            }
            self.finished = self.finished.split_off(&offset);
            self.cursor = offset;
            self.scan = self.scan.max(offset);
        } else {
            let reset: Vec<u64> = self
                .recs
                .keys()
                .copied()
                .filter(|o| !self.dead.contains_key(o))
                .collect();
            for o in reset {
                self.unindex(o);
                let rec = self.recs.get_mut(&o).unwrap();
                rec.base = rec.attempts;
                rec.phase = Phase::Waiting { not_before_ms: 0 };
                self.ready.insert(o);
            }
            self.finished.clear();
            self.cursor = offset;
            self.scan = offset;
        }
        self.advance_cursor();
        Ok(())
    }

    /// One page of dead letters with offsets above `after` (all when `None`), at most `limit`.
    pub fn dead_letters(
        &self,
        after: Option<u64>,
        limit: u32,
    ) -> Result<DeadLetterPage, GroupError> {
        if limit == 0 || limit > DEAD_LETTER_PAGE_LIMIT {
            return Err(GroupError::PageLimitOutOfRange {
                requested: limit,
                max: DEAD_LETTER_PAGE_LIMIT,
            });
        }
        let range = match after {
            None => self.dead.range(..),
            Some(u64::MAX) => self.dead.range(u64::MAX..u64::MAX),
            Some(a) => self.dead.range(a + 1..),
        };
        let mut iter = range.map(|(_, dl)| *dl);
        let letters: Vec<DeadLetter> = iter.by_ref().take(limit as usize).collect();
        let next_after = match iter.next() {
            Some(_) => letters.last().map(|dl| dl.offset),
            None => None,
        };
        Ok(DeadLetterPage {
            letters,
            next_after,
        })
    }

    /// Hand a dead letter out again with a fresh budget of `max_attempts` deliveries.
    pub fn redrive(&mut self, offset: u64) -> Result<(), GroupError> {
        let dl = self
            .dead
            .get_mut(&offset)
            .ok_or(GroupError::NotDeadLettered { offset })?;
        if dl.redriving {
            return Err(GroupError::RedriveInProgress { offset });
        }
        dl.redriving = true;
        let attempts = dl.attempts;
        self.recs.insert(
            offset,
            Rec {
                attempts,
                base: attempts,
                phase: Phase::Waiting { not_before_ms: 0 },
            },
        );
        self.redrive_recs += 1;
        self.ready.insert(offset);
        Ok(())
    }

    /// Drop a dead letter's pointer; the record stays finished for the group.
    pub fn discard(&mut self, offset: u64) -> Result<DeadLetter, GroupError> {
        match self.dead.get(&offset) {
            None => return Err(GroupError::NotDeadLettered { offset }),
            Some(dl) if dl.redriving => return Err(GroupError::RedriveInProgress { offset }),
            Some(_) => {}
        }
        let dl = self.dead.remove(&offset).unwrap();
        if offset >= self.cursor {
            self.finished.insert(offset);
        }
        self.unpark();
        self.advance_cursor();
        Ok(dl)
    }

    /// The durable part of the group (see the module docs).
    pub fn snapshot(&self) -> GroupSnapshot {
        GroupSnapshot {
            shard: self.shard,
            cursor: self.cursor,
            finished: self.finished.iter().copied().collect(),
            dead_letters: self.dead.values().copied().collect(),
        }
    }

    /// A group from its snapshot on a log whose next offset is `tail`. Live claims are gone:
    /// every unfinished record is delivered again; redriving dead letters are eligible again.
    pub fn restore(cfg: GroupConfig, snap: &GroupSnapshot, tail: u64) -> Result<Group, GroupError> {
        let highest = [
            Some(snap.cursor),
            snap.finished.last().copied(),
            snap.dead_letters.last().map(|d| d.offset),
        ];
        for o in highest.into_iter().flatten() {
            let beyond = if o == snap.cursor {
                o > tail
            } else {
                o >= tail
            };
            if beyond {
                return Err(GroupError::BeyondTail { offset: o, tail });
            }
        }
        let mut g = Group::new(snap.shard, cfg, snap.cursor, tail)?;
        g.finished = snap.finished.iter().copied().collect();
        for dl in &snap.dead_letters {
            g.dead.insert(
                dl.offset,
                DeadLetter {
                    redriving: false,
                    ..*dl
                },
            );
            if dl.redriving {
                g.redrive(dl.offset).expect("dead letter just inserted");
            }
        }
        g.advance_cursor();
        Ok(g)
    }

    /// Check every structural invariant (O(n); tests and debug checks).
    pub fn check_invariants(&self) {
        let in_flight = self
            .recs
            .values()
            .filter(|r| matches!(r.phase, Phase::InFlight { .. }))
            .count();
        assert_eq!(
            in_flight,
            self.deadlines.len(),
            "one deadline per live claim"
        );
        assert!(in_flight <= self.cfg.max_in_flight_records as usize);
        for &(d, o) in &self.deadlines {
            assert!(
                matches!(self.recs[&o].phase, Phase::InFlight { deadline_ms } if deadline_ms == d)
            );
        }
        for &o in &self.ready {
            assert!(matches!(self.recs[&o].phase, Phase::Waiting { .. }));
        }
        for &(nb, o) in &self.delayed {
            assert!(
                matches!(self.recs[&o].phase, Phase::Waiting { not_before_ms } if not_before_ms == nb)
            );
            assert!(!self.ready.contains(&o));
        }
        for &o in &self.parked {
            assert!(matches!(self.recs[&o].phase, Phase::Parked { .. }));
            assert!(!self.dead.contains_key(&o), "a redrive never parks");
        }
        let mut redrives = 0;
        for (&o, r) in &self.recs {
            assert!(r.attempts >= r.base && r.attempts - r.base <= self.cfg.max_attempts);
            if self.dead.contains_key(&o) {
                redrives += 1;
                assert!(self.dead[&o].redriving);
            } else {
                assert!(
                    o >= self.cursor,
                    "cursor {} passed unfinished {o}",
                    self.cursor
                );
                assert!(o < self.tail);
            }
            assert!(!self.finished.contains(&o));
        }
        assert_eq!(redrives, self.redrive_recs);
        for (&o, dl) in &self.dead {
            assert_eq!(dl.redriving, self.recs.contains_key(&o));
            assert!(!self.finished.contains(&o));
        }
        assert!(self
            .finished
            .iter()
            .all(|&o| o > self.cursor && o < self.tail));
        assert!(self.cursor <= self.scan);
        assert!(!self.dead.contains_key(&self.cursor) && !self.finished.contains(&self.cursor));
        let non_redrive = self.recs.len() - self.redrive_recs;
        assert!(non_redrive <= self.cfg.max_window_records as usize);
        let dead_above = self.dead.range(self.cursor..).count();
        assert!(
            self.tracked() + dead_above
                <= self.cfg.max_window_records as usize + self.cfg.max_dead_letters as usize
        );
    }
}

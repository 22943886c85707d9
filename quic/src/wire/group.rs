//! Consumer-group frames (queue semantics over a durable stream shard; docs/protocol.md,
//! "Consumer groups"). Every request names its group by [`GroupRef`] — stream, group name,
//! shard — and is answered on the stream it came on by the frame named below or by an
//! `Error` with the same `request_id`.
//!
//! | request | answer |
//! |---|---|
//! | `GroupCreate`, `GroupDelete`, `GroupSeek`, `DeadLetterOp` | `GroupOk` |
//! | `GroupDescribe` | `GroupInfo` |
//! | `GroupPoll` (and its `GroupPollCancel`) | `GroupRecords` (possibly empty) |
//! | `GroupAnswer` | `GroupAnswered` (one result code per claim, 0 = done) |
//! | `DeadLetterList` | `DeadLetterPage` |

use super::{put_str, put_stream, Reader, Records, StartAt, StreamName, WireError};
use bytes::{BufMut, BytesMut};
use std::fmt;
use std::str::FromStr;

/// Frame kinds of this module (stable numbers, after the core kinds).
pub mod kind {
    pub const GROUP_CREATE: u8 = 15;
    pub const GROUP_DELETE: u8 = 16;
    pub const GROUP_DESCRIBE: u8 = 17;
    pub const GROUP_INFO: u8 = 18;
    pub const GROUP_POLL: u8 = 19;
    pub const GROUP_POLL_CANCEL: u8 = 20;
    pub const GROUP_RECORDS: u8 = 21;
    pub const GROUP_ANSWER: u8 = 22;
    pub const GROUP_ANSWERED: u8 = 23;
    pub const GROUP_SEEK: u8 = 24;
    pub const DEAD_LETTER_LIST: u8 = 25;
    pub const DEAD_LETTER_PAGE: u8 = 26;
    pub const DEAD_LETTER_OP: u8 = 27;
    pub const GROUP_OK: u8 = 28;
    pub const FIRST: u8 = GROUP_CREATE;
    pub const LAST: u8 = GROUP_OK;
}

/// Names one delivery of one record: `SHARD:OFFSET:ATTEMPTS`, decimal, attempts from 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClaimId {
    pub shard: u32,
    pub offset: u64,
    pub attempt: u32,
}

impl fmt::Display for ClaimId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.shard, self.offset, self.attempt)
    }
}

/// A string that is not a canonical `SHARD:OFFSET:ATTEMPTS`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("claim id {input:?} is not SHARD:OFFSET:ATTEMPTS: {why}")]
pub struct ClaimIdError {
    pub input: String,
    pub why: &'static str,
}

fn decimal(part: &str, max: u64, why: &'static str) -> Result<u64, &'static str> {
    let canonical = !part.is_empty()
        && part.bytes().all(|b| b.is_ascii_digit())
        && (part == "0" || !part.starts_with('0'));
    if !canonical {
        return Err(why);
    }
    match part.parse::<u64>() {
        Ok(v) if v <= max => Ok(v),
        _ => Err(why),
    }
}

impl FromStr for ClaimId {
    type Err = ClaimIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let fail = |why| ClaimIdError {
            input: s.chars().take(64).collect(),
            why,
        };
        let mut parts = s.split(':');
        let (Some(shard), Some(offset), Some(attempt), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(fail("needs exactly three ':'-separated parts"));
        };
        let shard =
            decimal(shard, u32::MAX as u64, "shard is not a canonical u32").map_err(fail)?;
        let offset = decimal(offset, u64::MAX, "offset is not a canonical u64").map_err(fail)?;
        let attempt =
            decimal(attempt, u32::MAX as u64, "attempts is not a canonical u32").map_err(fail)?;
        if attempt == 0 {
            return Err(fail("attempts count from 1"));
        }
        Ok(ClaimId {
            shard: shard as u32,
            offset,
            attempt: attempt as u32,
        })
    }
}

/// One group on one shard of a stream.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GroupRef {
    pub stream: StreamName,
    pub group: String,
    pub shard: u32,
}

/// One delivery of one record: the wire form of `SHARD:OFFSET:ATTEMPTS` (the shard is the
/// frame's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClaimRef {
    pub offset: u64,
    pub attempt: u32,
}

/// What a `GroupAnswer` does to each claim it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerOp {
    Ack,
    /// Hand back; eligible again after `delay_ms` (0: at once) or dead-lettered if it was
    /// the last allowed delivery.
    Nack {
        delay_ms: u64,
    },
    /// Renew the claim for this long from now.
    Extend {
        visibility_timeout_ms: u64,
    },
    /// Dead-letter now.
    Reject,
}

/// Dead-letter list operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadLetterAction {
    /// Hand the record out again with a fresh attempt budget.
    Redrive,
    /// Drop the pointer; the record stays finished for the group.
    Discard,
}

/// One dead-letter pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeadLetterRef {
    pub offset: u64,
    pub attempts: u32,
    /// 0 expired (last delivery lapsed), 1 nacked, 2 rejected.
    pub reason: u8,
    pub redriving: bool,
}

/// Counts and settings of one group on one shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GroupInfo {
    pub cursor: u64,
    pub tail: u64,
    pub in_flight: u64,
    pub waiting: u64,
    pub parked: u64,
    pub dead_letters: u64,
    pub max_attempts: u32,
    pub visibility_timeout_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupFrame {
    GroupCreate {
        request_id: u64,
        target: GroupRef,
        start: StartAt,
        /// 0 = broker default.
        max_attempts: u32,
        /// Default visibility timeout of the group's polls; 0 = broker default.
        visibility_timeout_ms: u64,
    },
    GroupDelete {
        request_id: u64,
        target: GroupRef,
    },
    GroupDescribe {
        request_id: u64,
        target: GroupRef,
    },
    GroupInfo {
        request_id: u64,
        shard: u32,
        info: GroupInfo,
    },
    GroupPoll {
        request_id: u64,
        target: GroupRef,
        max: u32,
        /// 0 = the group's default.
        visibility_timeout_ms: u64,
        /// With nothing to claim, wait up to this long for a record (long poll); 0 = answer now.
        wait_ms: u64,
    },
    /// Stop waiting: a long poll still waiting is answered with no records.
    GroupPollCancel {
        request_id: u64,
        target: GroupRef,
    },
    /// Claims in offset order, each with its record's payload (`records`, same order).
    GroupRecords {
        request_id: u64,
        shard: u32,
        /// Every claim holds this long from when the broker made it.
        visibility_timeout_ms: u64,
        claims: Vec<ClaimRef>,
        records: Records,
    },
    GroupAnswer {
        request_id: u64,
        target: GroupRef,
        op: AnswerOp,
        claims: Vec<ClaimRef>,
    },
    /// One error-registry number per claim of the answer, in its order (0 = done).
    GroupAnswered {
        request_id: u64,
        codes: Vec<u16>,
    },
    GroupSeek {
        request_id: u64,
        target: GroupRef,
        to: StartAt,
    },
    DeadLetterList {
        request_id: u64,
        target: GroupRef,
        /// Offsets above this one; `None` from the first.
        after: Option<u64>,
        limit: u32,
    },
    DeadLetterPage {
        request_id: u64,
        letters: Vec<DeadLetterRef>,
        next_after: Option<u64>,
    },
    DeadLetterOp {
        request_id: u64,
        target: GroupRef,
        action: DeadLetterAction,
        offset: u64,
    },
    GroupOk {
        request_id: u64,
    },
}

fn put_target(b: &mut BytesMut, t: &GroupRef) {
    put_stream(b, &t.stream);
    put_str(b, &t.group);
    b.put_u32_le(t.shard);
}

fn put_start(b: &mut BytesMut, s: &StartAt) {
    let (tag, off) = match s {
        StartAt::Latest => (0u8, 0u64),
        StartAt::Earliest => (1, 0),
        StartAt::Offset(o) => (2, *o),
    };
    b.put_u8(tag);
    b.put_u64_le(off);
}

fn put_opt(b: &mut BytesMut, v: Option<u64>) {
    b.put_u8(v.is_some() as u8);
    b.put_u64_le(v.unwrap_or(0));
}

fn put_claims(b: &mut BytesMut, claims: &[ClaimRef]) {
    b.put_u32_le(claims.len() as u32);
    for c in claims {
        b.put_u64_le(c.offset);
        b.put_u32_le(c.attempt);
    }
}

/// A count read from the wire, checked against the bytes left so a hostile count cannot
/// make the decoder allocate more than the frame carries.
fn count(r: &mut Reader, field: &'static str, entry_bytes: usize) -> Result<usize, WireError> {
    let n = r.u32(field)? as usize;
    let left = r.buf.len() - r.pos;
    if n.saturating_mul(entry_bytes) > left {
        return Err(WireError::Truncated {
            field,
            needed: n * entry_bytes - left,
        });
    }
    Ok(n)
}

impl Reader {
    fn target(&mut self) -> Result<GroupRef, WireError> {
        Ok(GroupRef {
            stream: self.stream()?,
            group: self.string("group")?,
            shard: self.u32("shard")?,
        })
    }
    fn start(&mut self) -> Result<StartAt, WireError> {
        let tag = self.u8("start")?;
        let off = self.u64("start_offset")?;
        Ok(match tag {
            0 => StartAt::Latest,
            1 => StartAt::Earliest,
            2 => StartAt::Offset(off),
            v => {
                return Err(WireError::InvalidValue {
                    field: "start",
                    value: v as u64,
                })
            }
        })
    }
    fn opt(&mut self, f: &'static str) -> Result<Option<u64>, WireError> {
        let some = self.bool(f)?;
        let v = self.u64(f)?;
        Ok(some.then_some(v))
    }
    fn claims(&mut self) -> Result<Vec<ClaimRef>, WireError> {
        let n = count(self, "claim_count", 12)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(ClaimRef {
                offset: self.u64("claim_offset")?,
                attempt: self.u32("claim_attempt")?,
            });
        }
        Ok(out)
    }
}

impl GroupFrame {
    pub fn kind(&self) -> u8 {
        use GroupFrame::*;
        match self {
            GroupCreate { .. } => kind::GROUP_CREATE,
            GroupDelete { .. } => kind::GROUP_DELETE,
            GroupDescribe { .. } => kind::GROUP_DESCRIBE,
            GroupInfo { .. } => kind::GROUP_INFO,
            GroupPoll { .. } => kind::GROUP_POLL,
            GroupPollCancel { .. } => kind::GROUP_POLL_CANCEL,
            GroupRecords { .. } => kind::GROUP_RECORDS,
            GroupAnswer { .. } => kind::GROUP_ANSWER,
            GroupAnswered { .. } => kind::GROUP_ANSWERED,
            GroupSeek { .. } => kind::GROUP_SEEK,
            DeadLetterList { .. } => kind::DEAD_LETTER_LIST,
            DeadLetterPage { .. } => kind::DEAD_LETTER_PAGE,
            DeadLetterOp { .. } => kind::DEAD_LETTER_OP,
            GroupOk { .. } => kind::GROUP_OK,
        }
    }

    /// The request id every group frame carries first.
    pub fn request_id(&self) -> u64 {
        use GroupFrame::*;
        match self {
            GroupCreate { request_id, .. }
            | GroupDelete { request_id, .. }
            | GroupDescribe { request_id, .. }
            | GroupInfo { request_id, .. }
            | GroupPoll { request_id, .. }
            | GroupPollCancel { request_id, .. }
            | GroupRecords { request_id, .. }
            | GroupAnswer { request_id, .. }
            | GroupAnswered { request_id, .. }
            | GroupSeek { request_id, .. }
            | DeadLetterList { request_id, .. }
            | DeadLetterPage { request_id, .. }
            | DeadLetterOp { request_id, .. }
            | GroupOk { request_id } => *request_id,
        }
    }

    /// The group a request names (`None` for answers).
    pub fn target(&self) -> Option<&GroupRef> {
        use GroupFrame::*;
        match self {
            GroupCreate { target, .. }
            | GroupDelete { target, .. }
            | GroupDescribe { target, .. }
            | GroupPoll { target, .. }
            | GroupPollCancel { target, .. }
            | GroupAnswer { target, .. }
            | GroupSeek { target, .. }
            | DeadLetterList { target, .. }
            | DeadLetterOp { target, .. } => Some(target),
            _ => None,
        }
    }

    pub(super) fn encode_body(&self, b: &mut BytesMut) {
        use GroupFrame::*;
        b.put_u64_le(self.request_id());
        match self {
            GroupCreate {
                target,
                start,
                max_attempts,
                visibility_timeout_ms,
                ..
            } => {
                put_target(b, target);
                put_start(b, start);
                b.put_u32_le(*max_attempts);
                b.put_u64_le(*visibility_timeout_ms);
            }
            GroupDelete { target, .. }
            | GroupDescribe { target, .. }
            | GroupPollCancel { target, .. } => put_target(b, target),
            GroupInfo { shard, info, .. } => {
                b.put_u32_le(*shard);
                for v in [
                    info.cursor,
                    info.tail,
                    info.in_flight,
                    info.waiting,
                    info.parked,
                    info.dead_letters,
                ] {
                    b.put_u64_le(v);
                }
                b.put_u32_le(info.max_attempts);
                b.put_u64_le(info.visibility_timeout_ms);
            }
            GroupPoll {
                target,
                max,
                visibility_timeout_ms,
                wait_ms,
                ..
            } => {
                put_target(b, target);
                b.put_u32_le(*max);
                b.put_u64_le(*visibility_timeout_ms);
                b.put_u64_le(*wait_ms);
            }
            GroupRecords {
                shard,
                visibility_timeout_ms,
                claims,
                records,
                ..
            } => {
                b.put_u32_le(*shard);
                b.put_u64_le(*visibility_timeout_ms);
                put_claims(b, claims);
                b.put_u32_le(records.count());
                b.put_u32_le(records.region_len() as u32);
                b.put_slice(records.region());
            }
            GroupAnswer {
                target, op, claims, ..
            } => {
                put_target(b, target);
                let (tag, v) = match op {
                    AnswerOp::Ack => (0u8, 0u64),
                    AnswerOp::Nack { delay_ms } => (1, *delay_ms),
                    AnswerOp::Extend {
                        visibility_timeout_ms,
                    } => (2, *visibility_timeout_ms),
                    AnswerOp::Reject => (3, 0),
                };
                b.put_u8(tag);
                b.put_u64_le(v);
                put_claims(b, claims);
            }
            GroupAnswered { codes, .. } => {
                b.put_u32_le(codes.len() as u32);
                for c in codes {
                    b.put_u16_le(*c);
                }
            }
            GroupSeek { target, to, .. } => {
                put_target(b, target);
                put_start(b, to);
            }
            DeadLetterList {
                target,
                after,
                limit,
                ..
            } => {
                put_target(b, target);
                put_opt(b, *after);
                b.put_u32_le(*limit);
            }
            DeadLetterPage {
                letters,
                next_after,
                ..
            } => {
                b.put_u32_le(letters.len() as u32);
                for l in letters {
                    b.put_u64_le(l.offset);
                    b.put_u32_le(l.attempts);
                    b.put_u8(l.reason);
                    b.put_u8(l.redriving as u8);
                }
                put_opt(b, *next_after);
            }
            DeadLetterOp {
                target,
                action,
                offset,
                ..
            } => {
                put_target(b, target);
                b.put_u8(match action {
                    DeadLetterAction::Redrive => 0,
                    DeadLetterAction::Discard => 1,
                });
                b.put_u64_le(*offset);
            }
            GroupOk { .. } => {}
        }
    }

    pub(super) fn decode(k: u8, r: &mut Reader) -> Result<GroupFrame, WireError> {
        use GroupFrame::*;
        let request_id = r.u64("request_id")?;
        Ok(match k {
            kind::GROUP_CREATE => GroupCreate {
                request_id,
                target: r.target()?,
                start: r.start()?,
                max_attempts: r.u32("max_attempts")?,
                visibility_timeout_ms: r.u64("visibility_timeout_ms")?,
            },
            kind::GROUP_DELETE => GroupDelete {
                request_id,
                target: r.target()?,
            },
            kind::GROUP_DESCRIBE => GroupDescribe {
                request_id,
                target: r.target()?,
            },
            kind::GROUP_INFO => GroupInfo {
                request_id,
                shard: r.u32("shard")?,
                info: super::group::GroupInfo {
                    cursor: r.u64("cursor")?,
                    tail: r.u64("tail")?,
                    in_flight: r.u64("in_flight")?,
                    waiting: r.u64("waiting")?,
                    parked: r.u64("parked")?,
                    dead_letters: r.u64("dead_letters")?,
                    max_attempts: r.u32("max_attempts")?,
                    visibility_timeout_ms: r.u64("visibility_timeout_ms")?,
                },
            },
            kind::GROUP_POLL => GroupPoll {
                request_id,
                target: r.target()?,
                max: r.u32("max")?,
                visibility_timeout_ms: r.u64("visibility_timeout_ms")?,
                wait_ms: r.u64("wait_ms")?,
            },
            kind::GROUP_POLL_CANCEL => GroupPollCancel {
                request_id,
                target: r.target()?,
            },
            kind::GROUP_RECORDS => {
                let shard = r.u32("shard")?;
                let visibility_timeout_ms = r.u64("visibility_timeout_ms")?;
                let claims = r.claims()?;
                let records = r.records()?;
                if records.count() as usize != claims.len() {
                    return Err(WireError::InvalidRecords(
                        "group records carry one payload per claim",
                    ));
                }
                GroupRecords {
                    request_id,
                    shard,
                    visibility_timeout_ms,
                    claims,
                    records,
                }
            }
            kind::GROUP_ANSWER => {
                let target = r.target()?;
                let tag = r.u8("op")?;
                let v = r.u64("op_value")?;
                let op = match tag {
                    0 => AnswerOp::Ack,
                    1 => AnswerOp::Nack { delay_ms: v },
                    2 => AnswerOp::Extend {
                        visibility_timeout_ms: v,
                    },
                    3 => AnswerOp::Reject,
                    v => {
                        return Err(WireError::InvalidValue {
                            field: "op",
                            value: v as u64,
                        })
                    }
                };
                GroupAnswer {
                    request_id,
                    target,
                    op,
                    claims: r.claims()?,
                }
            }
            kind::GROUP_ANSWERED => {
                let n = count(r, "code_count", 2)?;
                let mut codes = Vec::with_capacity(n);
                for _ in 0..n {
                    codes.push(r.u16("code")?);
                }
                GroupAnswered { request_id, codes }
            }
            kind::GROUP_SEEK => GroupSeek {
                request_id,
                target: r.target()?,
                to: r.start()?,
            },
            kind::DEAD_LETTER_LIST => DeadLetterList {
                request_id,
                target: r.target()?,
                after: r.opt("after")?,
                limit: r.u32("limit")?,
            },
            kind::DEAD_LETTER_PAGE => {
                let n = count(r, "letter_count", 14)?;
                let mut letters = Vec::with_capacity(n);
                for _ in 0..n {
                    let offset = r.u64("letter_offset")?;
                    let attempts = r.u32("letter_attempts")?;
                    let reason = r.u8("letter_reason")?;
                    if reason > 2 {
                        return Err(WireError::InvalidValue {
                            field: "letter_reason",
                            value: reason as u64,
                        });
                    }
                    letters.push(DeadLetterRef {
                        offset,
                        attempts,
                        reason,
                        redriving: r.bool("letter_redriving")?,
                    });
                }
                DeadLetterPage {
                    request_id,
                    letters,
                    next_after: r.opt("next_after")?,
                }
            }
            kind::DEAD_LETTER_OP => {
                let target = r.target()?;
                let action = match r.u8("action")? {
                    0 => DeadLetterAction::Redrive,
                    1 => DeadLetterAction::Discard,
                    v => {
                        return Err(WireError::InvalidValue {
                            field: "action",
                            value: v as u64,
                        })
                    }
                };
                DeadLetterOp {
                    request_id,
                    target,
                    action,
                    offset: r.u64("offset")?,
                }
            }
            kind::GROUP_OK => GroupOk { request_id },
            _ => unreachable!("caller dispatches only group kinds"),
        })
    }
}

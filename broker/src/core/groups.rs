//! The consumer-group driver of a core: the groups of the durable shards this core owns,
//! around the pure state machine in [`crate::group`].
//!
//! - A request reaches the shard's owner core (validated and routed by the connection's core,
//!   like a publish) and is answered back through the mesh ([`MeshMsg::GroupReply`]).
//! - Records are handed out with the payloads read from the shard's in-memory tail, or from
//!   disk when the tail no longer holds them. An answer is kept under the frame bound: claims
//!   that do not fit are released (not counted as deliveries).
//! - A poll with nothing to claim and a `wait_ms` waits (bounded per group) until records
//!   are committed, a claim lapses, a nack delay passes, or its wait ends (then it is answered
//!   with no records). The flusher wakes for the earliest of these (`group_due_ms`).
//! - Durable changes (acks, dead letters, seeks, redrives, discards, create) are written
//!   whole to `<shard dir>/groups/<group>.grp` (see [`crate::group::file`]) on the blocking
//!   pool, one write per group at a time; each answer waits for the write that covers it, so
//!   an acknowledged ack survives a broker crash. Changes made while a write runs go in the
//!   next one (group commit). Claims are not persisted: after a restart every unfinished
//!   record is delivered again (the at-least-once window of [`crate::group`]).

use super::*;
use crate::group::{
    file as gfile, Claim, ClaimId, DeadLetterReason, Fate, Group, GroupConfig, GroupError,
};
use bytes::Bytes;
use felix_quic::wire::{
    AnswerOp, ClaimRef, DeadLetterAction, DeadLetterRef, GroupFrame, GroupInfo,
};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Where a group request came from.
#[derive(Debug, Clone, Copy)]
pub struct GroupOrigin {
    pub core: u8,
    pub conn: ConnKey,
    pub quic_stream: u64,
    pub request_id: u64,
    /// The largest frame the connection's client accepts (its Hello): answers are cut to it.
    pub frame_bytes_max: u32,
}

/// The groups of one durable shard.
#[derive(Default)]
pub(super) struct ShardGroups {
    groups: BTreeMap<String, GroupSlot>,
    /// Group files that could not be read at open (name → why): they answer `unavailable`
    /// until deleted, never silently reset.
    broken: BTreeMap<String, String>,
}

struct Waiter {
    origin: GroupOrigin,
    max: u32,
    visibility_timeout_ms: Option<u64>,
    until_ms: u64,
}

type Reply = (GroupOrigin, Frame);

struct GroupSlot {
    group: Group,
    waiters: VecDeque<Waiter>,
    /// A write of the group file is running.
    writing: bool,
    /// Changed since the running write took its snapshot.
    dirty: bool,
    /// Answers that wait for the next write.
    queued: Vec<Reply>,
    /// Deleted; removed (file and state) once the running write is done.
    deleting: Option<GroupOrigin>,
}

fn ok(request_id: u64) -> Frame {
    Frame::Group(GroupFrame::GroupOk { request_id })
}

fn empty_records(request_id: u64, shard: u32) -> Frame {
    Frame::Group(GroupFrame::GroupRecords {
        request_id,
        shard,
        visibility_timeout_ms: 0,
        claims: Vec::new(),
        records: Records::empty(),
    })
}

fn group_code(e: &GroupError) -> ErrorCode {
    match e {
        GroupError::StaleClaim { .. } => ErrorCode::StaleClaim,
        GroupError::NotDeadLettered { .. } => ErrorCode::NotFound,
        GroupError::RedriveInProgress { .. } => ErrorCode::Conflict,
        _ => ErrorCode::InvalidRequest,
    }
}

fn err_frame(request_id: u64, e: &GroupError) -> Frame {
    Frame::error(request_id, group_code(e), e.to_string())
}

fn reason_code(r: DeadLetterReason) -> u8 {
    match r {
        DeadLetterReason::Expired => 0,
        DeadLetterReason::Nacked => 1,
        DeadLetterReason::Rejected => 2,
    }
}

/// Write `bytes` as `dir/name.grp`: temporary file, fdatasync, rename, directory fsync.
fn write_group_file(dir: &std::path::Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = dir.join(format!("{name}{}.tmp", gfile::SUFFIX));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_data()?;
    std::fs::rename(&tmp, dir.join(format!("{name}{}", gfile::SUFFIX)))?;
    std::fs::File::open(dir)?.sync_all()
}

fn remove_group_file(dir: &std::path::Path, name: &str) -> std::io::Result<()> {
    match std::fs::remove_file(dir.join(format!("{name}{}", gfile::SUFFIX))) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::fs::File::open(dir)?.sync_all()
}

type GroupFileContents = (GroupConfig, crate::group::GroupSnapshot);

/// Read every group file of a shard (at open): `(name, parsed or why not)`. Leftover
/// temporary files (a crash mid-write: the old file is intact) are removed.
pub(super) fn read_group_files(
    dir: &std::path::Path,
) -> Vec<(String, Result<GroupFileContents, String>)> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let f = e.file_name().to_string_lossy().to_string();
        if f.ends_with(".tmp") {
            let _ = std::fs::remove_file(e.path());
            continue;
        }
        let Some(name) = f.strip_suffix(gfile::SUFFIX) else {
            continue;
        };
        let parsed = std::fs::read(e.path())
            .map_err(|e| e.to_string())
            .and_then(|b| gfile::decode(&b).map_err(|e| e.to_string()));
        out.push((name.to_string(), parsed));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Restore one group at open. A snapshot beyond the log's tail (the log lost records a
/// machine crash took before their fsync, under `periodic`/`none`) is cut to the tail: the
/// group cannot have finished records the log no longer has.
fn restore(
    cfg: GroupConfig,
    mut snap: crate::group::GroupSnapshot,
    tail: u64,
) -> Result<Group, String> {
    if snap.cursor > tail {
        tracing::warn!(
            cursor = snap.cursor,
            tail,
            "group cursor beyond the log's tail after recovery; cut to the tail"
        );
        snap.cursor = tail;
    }
    snap.finished.retain(|&o| o < tail && o > snap.cursor);
    snap.dead_letters.retain(|d| d.offset < tail);
    Group::restore(cfg, &snap, tail).map_err(|e| e.to_string())
}

enum Payload {
    Ready(Bytes),
    /// Below the log's retention: the record is gone.
    Gone,
    Failed,
}

impl CoreState {
    pub(super) fn group_now_ms(&self) -> u64 {
        self.group_epoch.elapsed().as_millis() as u64
    }

    fn groups_dir(&self, key: ShardKey) -> Option<PathBuf> {
        let root = self.s.cfg.durable_storage_dir.as_ref()?;
        let slot = self.catalog.slot(key.0);
        Some(slot_shard_dir(root, &slot.def.name(), slot.incarnation, key.1).join("groups"))
    }

    fn note_group_due(&mut self, key: ShardKey, name: &str) {
        let Some(slot) = self.groups.get(&key).and_then(|g| g.groups.get(name)) else {
            return;
        };
        let w = slot.waiters.iter().map(|w| w.until_ms).min();
        for d in [slot.group.next_wakeup_ms(), w].into_iter().flatten() {
            self.group_due_ms = self.group_due_ms.min(d);
        }
    }

    /// When the flusher must run the group timers next, if anything is timed.
    pub(super) fn group_timeout(&self) -> Option<Duration> {
        if self.group_due_ms == u64::MAX {
            return None;
        }
        Some(Duration::from_millis(
            self.group_due_ms.saturating_sub(self.group_now_ms()),
        ))
    }

    /// Load a durable shard's groups once its log is open.
    pub(super) fn load_groups(&mut self, key: ShardKey, tail: u64) {
        let Some(dir) = self.groups_dir(key) else {
            return;
        };
        let name = self.catalog.slot(key.0).def.name();
        let mut sg = ShardGroups::default();
        for (g, parsed) in read_group_files(&dir) {
            match parsed.and_then(|(cfg, snap)| restore(cfg, snap, tail)) {
                Ok(group) => {
                    tracing::info!(stream = %name, shard = key.1, group = %g, cursor = group.cursor(), "consumer group restored");
                    sg.groups.insert(
                        g,
                        GroupSlot {
                            group,
                            waiters: VecDeque::new(),
                            writing: false,
                            dirty: false,
                            queued: Vec::new(),
                            deleting: None,
                        },
                    );
                }
                Err(why) => {
                    tracing::error!(stream = %name, shard = key.1, group = %g, error = %why, "consumer group file unreadable; the group answers unavailable until deleted");
                    sg.broken.insert(g, why);
                }
            }
        }
        if !sg.groups.is_empty() || !sg.broken.is_empty() {
            self.groups.insert(key, sg);
        }
    }

    /// A durable shard's stream is gone: its groups end (files go with the shard directory).
    pub(super) fn drop_groups(&mut self, key: ShardKey, why: &(ErrorCode, String)) {
        let Some(sg) = self.groups.remove(&key) else {
            return;
        };
        for (_, slot) in sg.groups {
            let replies = slot.queued.into_iter().map(|(o, _)| o);
            let waiters = slot.waiters.into_iter().map(|w| w.origin);
            for o in replies.chain(waiters).chain(slot.deleting) {
                self.group_reply(o, Frame::error(o.request_id, why.0, why.1.clone()));
            }
        }
    }

    /// Nothing left to answer or write (drain).
    pub(super) fn groups_idle(&self) -> bool {
        self.group_tasks == 0
            && self
                .groups
                .values()
                .flat_map(|g| g.groups.values())
                .all(|s| !s.writing && s.queued.is_empty() && s.waiters.is_empty())
    }

    fn group_reply(&mut self, origin: GroupOrigin, frame: Frame) {
        self.route(origin.core, MeshMsg::GroupReply { origin, frame });
    }

    // ---------- connection side ----------

    /// A group request from a client: validate what the connection's core can, then route
    /// it to the shard's owner.
    pub(super) fn on_group_request(
        &mut self,
        key: ConnKey,
        quic_stream: u64,
        frame: GroupFrame,
    ) -> Result<(), (ErrorCode, String)> {
        let Some(target) = frame.target().cloned() else {
            return Err((
                ErrorCode::InvalidRequest,
                format!("frame kind {} is an answer, not a request", frame.kind()),
            ));
        };
        felix_quic::wire::validate_name(&target.group)
            .map_err(|e| (ErrorCode::InvalidName, format!("group name: {e}")))?;
        let (idx, def) = self.catalog.lookup(&target.stream)?;
        if target.shard >= def.shards {
            return Err((
                ErrorCode::UnknownShard,
                format!(
                    "stream {} has {}, not {}",
                    target.stream,
                    crate::core::shard_range(def.shards),
                    target.shard
                ),
            ));
        }
        if !def.durable {
            return Err((
                ErrorCode::InvalidRequest,
                format!(
                    "stream {} is not durable; consumer groups need a durable stream",
                    target.stream
                ),
            ));
        }
        let idx = idx as u32;
        self.catalog.serve_check(idx, target.shard)?;
        if matches!(frame, GroupFrame::GroupPoll { wait_ms, .. } if wait_ms > 0) {
            if let Some(s) = self.sessions.get_mut(&key) {
                s.long_polls = true;
            }
        }
        let frame_bytes_max = self.ep.get(key).map_or(self.s.cfg.max_frame_bytes, |e| {
            e.conn.peer_max_frame_bytes()
        }) as u32;
        let origin = GroupOrigin {
            core: self.id,
            conn: key,
            quic_stream,
            request_id: frame.request_id(),
            frame_bytes_max,
        };
        let owner = self.owner_core(idx, target.shard);
        self.route(
            owner,
            MeshMsg::Group {
                origin,
                stream: idx,
                frame,
            },
        );
        Ok(())
    }

    pub(super) fn on_group_reply(&mut self, origin: GroupOrigin, frame: Frame) {
        if let Some(e) = self.ep.get(origin.conn) {
            e.conn.send_frame(origin.quic_stream, &frame);
            self.ep.mark_dirty(origin.conn);
        }
    }

    /// A connection that long-polled is gone: every core drops its waiting polls.
    pub(super) fn group_conn_closed(&mut self, key: ConnKey, long_polled: bool) {
        if !long_polled {
            return;
        }
        for core in 0..self.s.cores {
            self.route(
                core,
                MeshMsg::GroupConnClosed {
                    core: self.id,
                    conn: key,
                },
            );
        }
    }

    pub(super) fn on_group_conn_closed(&mut self, core: u8, conn: ConnKey) {
        for sg in self.groups.values_mut() {
            for slot in sg.groups.values_mut() {
                slot.waiters
                    .retain(|w| !(w.origin.core == core && w.origin.conn == conn));
            }
        }
    }

    // ---------- owner side ----------

    pub(super) fn on_group(&mut self, origin: GroupOrigin, stream: u32, frame: GroupFrame) {
        let rid = origin.request_id;
        let target = frame
            .target()
            .cloned()
            .expect("routed requests name a group");
        let key = (stream, target.shard);
        if let Err((code, msg)) = self.catalog.serve_check(stream, target.shard) {
            return self.group_reply(origin, Frame::error(rid, code, msg));
        }
        let log = match self.durable.get(&key).map(DurableShard::usable) {
            Some(Ok(log)) => log.clone(),
            Some(Err((code, msg))) => {
                return self.group_reply(origin, Frame::error(rid, code, msg))
            }
            None => {
                return self.group_reply(
                    origin,
                    Frame::error(
                        rid,
                        ErrorCode::Unavailable,
                        "the shard's log is not open on its owner",
                    ),
                )
            }
        };
        let tail = self.owner(stream, target.shard).next_offset();
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
            GroupFrame::GroupDelete { .. } => {
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
            GroupFrame::GroupDescribe { .. } => {
                self.expire_group(key, &name, now);
                let slot = &self.groups[&key].groups[&name];
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
                    request_id: rid,
                    shard: target.shard,
                    info,
                });
                self.group_reply(origin, f);
            }
            GroupFrame::GroupPoll {
                max,
                visibility_timeout_ms,
                wait_ms,
                ..
            } => {
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
                    Err(e) => self.group_reply(origin, err_frame(rid, &e)),
                    Ok(claims) if claims.is_empty() && wait_ms > 0 && !self.draining => {
                        if slot.waiters.len() >= self.s.cfg.group_poll_waiters_max as usize {
                            let msg = format!(
                                "group {name} has {} polls waiting (group_poll_waiters_max)",
                                slot.waiters.len()
                            );
                            return self.group_reply(
                                origin,
                                Frame::error(rid, ErrorCode::InflightLimit, msg),
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
            GroupFrame::GroupPollCancel { .. } => {
                let pos = slot.waiters.iter().position(|w| {
                    w.origin.core == origin.core
                        && w.origin.conn == origin.conn
                        && w.origin.request_id == rid
                });
                match pos.and_then(|p| slot.waiters.remove(p)) {
                    Some(w) => self.group_reply(w.origin, empty_records(rid, target.shard)),
                    // Every request is answered: nothing of this connection's waits under
                    // that id (the poll was answered already, or never waited).
                    None => self.group_reply(
                        origin,
                        Frame::error(
                            rid,
                            ErrorCode::NotFound,
                            format!(
                                "no poll {rid} of this connection is waiting on group {name} shard {}",
                                target.shard
                            ),
                        ),
                    ),
                }
            }
            GroupFrame::GroupAnswer { op, claims, .. } => {
                let c = self.s.counters.clone();
                let mut codes = Vec::with_capacity(claims.len());
                let mut durable_change = false;
                for cl in claims {
                    let id = ClaimId {
                        shard: target.shard,
                        offset: cl.offset,
                        attempt: cl.attempt,
                    };
                    let r = match op {
                        AnswerOp::Ack => slot.group.ack(id, now).map(|_| {
                            CoreCounters::inc(&c.group_acks);
                            true
                        }),
                        AnswerOp::Nack { delay_ms } => {
                            slot.group.nack(id, delay_ms, now).map(|f| match f {
                                Fate::Redeliver => {
                                    CoreCounters::inc(&c.group_redeliveries);
                                    false
                                }
                                Fate::DeadLettered => {
                                    CoreCounters::inc(&c.group_dead_letters);
                                    true
                                }
                                Fate::Parked => false,
                            })
                        }
                        AnswerOp::Extend {
                            visibility_timeout_ms,
                        } => slot
                            .group
                            .extend(id, visibility_timeout_ms, now)
                            .map(|_| false),
                        AnswerOp::Reject => slot.group.dead_letter(id, now).map(|f| {
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
                let f = Frame::Group(GroupFrame::GroupAnswered {
                    request_id: rid,
                    codes,
                });
                if durable_change {
                    self.persist_group(key, &name, Some((origin, f)));
                } else {
                    self.group_reply(origin, f);
                }
                self.note_group_due(key, &name);
                self.serve_waiters(key, &name);
            }
            GroupFrame::GroupSeek { to, .. } => {
                let offset = match to {
                    StartAt::Latest => tail,
                    StartAt::Earliest => oldest,
                    StartAt::Offset(o) => o,
                };
                if offset < oldest {
                    let msg =
                        format!("offset {offset} is below the oldest retained offset {oldest}");
                    return self
                        .group_reply(origin, Frame::error(rid, ErrorCode::RevisionTooOld, msg));
                }
                match slot.group.seek(offset) {
                    Err(e) => self.group_reply(origin, err_frame(rid, &e)),
                    Ok(()) => {
                        self.persist_group(key, &name, Some((origin, ok(rid))));
                        self.serve_waiters(key, &name);
                    }
                }
            }
            GroupFrame::DeadLetterList { after, limit, .. } => {
                // A page stays under the client's frame maximum (14 bytes an entry, 64 for
                // the rest); the client pages on with next_after. An invalid ask (0, over
                // 1000) is left as asked so it is refused.
                let fit = ((origin.frame_bytes_max as usize).saturating_sub(64) / 14).max(1);
                let limit = if limit <= 1000 {
                    limit.min(fit as u32)
                } else {
                    limit
                };
                let f = match slot.group.dead_letters(after, limit) {
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
                };
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

    #[allow(clippy::too_many_arguments)]
    fn group_create(
        &mut self,
        origin: GroupOrigin,
        key: ShardKey,
        name: String,
        log: &Log,
        tail: u64,
        start: StartAt,
        max_attempts: u32,
        visibility_timeout_ms: u64,
    ) {
        let rid = origin.request_id;
        let sg = self.groups.entry(key).or_default();
        if sg.groups.get(&name).is_some_and(|s| s.deleting.is_some()) {
            let msg = format!(
                "consumer group {name} is being deleted; create it again once that is done"
            );
            return self.group_reply(origin, Frame::error(rid, ErrorCode::Conflict, msg));
        }
        if sg.groups.contains_key(&name) || sg.broken.contains_key(&name) {
            let msg = format!("consumer group {name} already exists on shard {}", key.1);
            return self.group_reply(origin, Frame::error(rid, ErrorCode::AlreadyExists, msg));
        }
        let max = self.s.cfg.group_max_per_shard as usize;
        if sg.groups.len() + sg.broken.len() >= max {
            let msg = format!(
                "shard {} already holds {max} groups (group_max_per_shard)",
                key.1
            );
            return self.group_reply(origin, Frame::error(rid, ErrorCode::InvalidRequest, msg));
        }
        let oldest = log.oldest_offset();
        let at = match start {
            StartAt::Latest => tail,
            StartAt::Earliest => oldest,
            StartAt::Offset(o) => o,
        };
        if at < oldest {
            let msg = format!("offset {at} is below the oldest retained offset {oldest}");
            return self.group_reply(origin, Frame::error(rid, ErrorCode::RevisionTooOld, msg));
        }
        let d = GroupConfig::default();
        let cfg = GroupConfig {
            max_attempts: if max_attempts == 0 {
                d.max_attempts
            } else {
                max_attempts
            },
            default_visibility_timeout_ms: if visibility_timeout_ms == 0 {
                d.default_visibility_timeout_ms
            } else {
                visibility_timeout_ms
            },
            ..d
        };
        let group = match Group::new(key.1, cfg, at, tail) {
            Ok(g) => g,
            Err(e) => return self.group_reply(origin, err_frame(rid, &e)),
        };
        let Some(dir) = self.groups_dir(key) else {
            let msg = "no durable storage directory on this broker";
            return self.group_reply(origin, Frame::error(rid, ErrorCode::Unavailable, msg));
        };
        if let Err(e) = std::fs::create_dir_all(&dir) {
            let msg = format!("cannot create {}: {e}", dir.display());
            return self.group_reply(origin, Frame::error(rid, ErrorCode::Unavailable, msg));
        }
        self.groups.entry(key).or_default().groups.insert(
            name.clone(),
            GroupSlot {
                group,
                waiters: VecDeque::new(),
                writing: false,
                dirty: false,
                queued: Vec::new(),
                deleting: None,
            },
        );
        self.persist_group(key, &name, Some((origin, ok(rid))));
    }

    fn group_delete_broken(&mut self, origin: GroupOrigin, key: ShardKey, name: String) {
        let dir = self.groups_dir(key);
        let me = self.me.clone();
        self.group_tasks += 1;
        glommio::spawn_local(async move {
            let n = name.clone();
            let r = match dir {
                Some(dir) => {
                    glommio::executor()
                        .spawn_blocking(move || remove_group_file(&dir, &n))
                        .await
                }
                None => Ok(()),
            };
            let Some(st) = me.upgrade() else { return };
            let mut st = st.borrow_mut();
            st.group_tasks -= 1;
            let rid = origin.request_id;
            let f = match r {
                Ok(()) => {
                    if let Some(sg) = st.groups.get_mut(&key) {
                        sg.broken.remove(&name);
                    }
                    ok(rid)
                }
                Err(e) => Frame::error(rid, ErrorCode::Unavailable, format!("cannot remove: {e}")),
            };
            st.group_reply(origin, f);
            st.drain_inbox();
            st.wake.wake();
        })
        .detach();
    }

    /// Remove a deleted group's file, then its state, then answer the delete.
    fn finish_delete(&mut self, key: ShardKey, name: String) {
        let dir = self.groups_dir(key);
        let me = self.me.clone();
        if let Some(slot) = self
            .groups
            .get_mut(&key)
            .and_then(|g| g.groups.get_mut(&name))
        {
            // No write may start (or rename over the removal) while the file is removed.
            slot.writing = true;
        }
        self.group_tasks += 1;
        glommio::spawn_local(async move {
            let n = name.clone();
            let r = match dir {
                Some(dir) => {
                    glommio::executor()
                        .spawn_blocking(move || remove_group_file(&dir, &n))
                        .await
                }
                None => Ok(()),
            };
            let Some(st) = me.upgrade() else { return };
            let mut st = st.borrow_mut();
            st.group_tasks -= 1;
            let deleting = st
                .groups
                .get(&key)
                .and_then(|g| g.groups.get(&name))
                .and_then(|s| s.deleting);
            // Gone already (the stream was deleted meanwhile): nothing left to answer here.
            let Some(origin) = deleting else { return };
            st.groups.get_mut(&key).unwrap().groups.remove(&name);
            let rid = origin.request_id;
            let f = match r {
                Ok(()) => ok(rid),
                Err(e) => {
                    // The file may come back at the next open: say so rather than pretend.
                    let msg = format!("group state removed, but its file could not be: {e}");
                    Frame::error(rid, ErrorCode::Unavailable, msg)
                }
            };
            st.group_reply(origin, f);
            st.drain_inbox();
            st.wake.wake();
        })
        .detach();
    }

    /// Queue `reply` behind a write of the group's current state.
    fn persist_group(&mut self, key: ShardKey, name: &str, reply: Option<Reply>) {
        let slot = self
            .groups
            .get_mut(&key)
            .and_then(|g| g.groups.get_mut(name))
            .expect("persisted group exists");
        if slot.deleting.is_some() {
            if let Some((o, _)) = reply {
                let msg = format!("consumer group {name} was deleted");
                self.group_reply(o, Frame::error(o.request_id, ErrorCode::NotFound, msg));
            }
            return;
        }
        slot.dirty = true;
        slot.queued.extend(reply);
        if !slot.writing {
            self.start_group_write(key, name.to_string());
        }
    }

    fn start_group_write(&mut self, key: ShardKey, name: String) {
        let dir = self.groups_dir(key);
        let slot = self
            .groups
            .get_mut(&key)
            .and_then(|g| g.groups.get_mut(&name))
            .expect("written group exists");
        let bytes = gfile::encode(slot.group.config(), &slot.group.snapshot());
        let replies = std::mem::take(&mut slot.queued);
        slot.dirty = false;
        slot.writing = true;
        let me = self.me.clone();
        glommio::spawn_local(async move {
            let n = name.clone();
            let r = match dir {
                Some(dir) => {
                    glommio::executor()
                        .spawn_blocking(move || write_group_file(&dir, &n, &bytes))
                        .await
                }
                None => Err(std::io::Error::other("no durable storage directory")),
            };
            reenter(&me, |st| st.on_group_written(key, name, r, replies));
        })
        .detach();
    }

    fn on_group_written(
        &mut self,
        key: ShardKey,
        name: String,
        r: std::io::Result<()>,
        replies: Vec<Reply>,
    ) {
        let c = self.s.counters.clone();
        match &r {
            Ok(()) => CoreCounters::inc(&c.group_writes),
            Err(e) => {
                CoreCounters::inc(&c.group_write_failures);
                tracing::error!(group = %name, shard = key.1, error = %e, "consumer group state not written; its answers get unavailable");
            }
        }
        for (origin, frame) in replies {
            let f = match &r {
                Ok(()) => frame,
                Err(e) => Frame::error(
                    origin.request_id,
                    ErrorCode::Unavailable,
                    format!("group state could not be written (the change is not durable): {e}"),
                ),
            };
            self.group_reply(origin, f);
        }
        let Some(slot) = self
            .groups
            .get_mut(&key)
            .and_then(|g| g.groups.get_mut(&name))
        else {
            return;
        };
        slot.writing = false;
        if slot.deleting.is_some() {
            let replies: Vec<Reply> = std::mem::take(&mut slot.queued);
            for (o, _) in replies {
                let msg = format!("consumer group {name} was deleted");
                self.group_reply(o, Frame::error(o.request_id, ErrorCode::NotFound, msg));
            }
            self.finish_delete(key, name);
        } else if slot.dirty || !slot.queued.is_empty() {
            self.start_group_write(key, name);
        }
    }

    /// Lapse claims past their deadline; persist what became a dead letter.
    fn expire_group(&mut self, key: ShardKey, name: &str, now: u64) {
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
    fn serve_waiters(&mut self, key: ShardKey, name: &str) {
        let now = self.group_now_ms();
        let tail = match self.owned.get(&key) {
            Some(o) => o.next_offset(),
            None => return,
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
    pub(super) fn groups_records_committed(&mut self, key: ShardKey) {
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
    pub(super) fn groups_tick(&mut self) {
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
    fn send_claims(
        &mut self,
        key: ShardKey,
        name: String,
        origin: GroupOrigin,
        claims: Vec<Claim>,
    ) {
        CoreCounters::add(&self.s.counters.group_claims, claims.len() as u64);
        let ring = &self
            .owned
            .get(&key)
            .expect("owner state of a durable shard")
            .ring;
        let payloads: Vec<Option<Bytes>> = claims.iter().map(|c| ring.get(c.offset)).collect();
        if payloads.iter().all(Option::is_some) {
            let p = payloads
                .into_iter()
                .map(|p| Payload::Ready(p.unwrap()))
                .collect();
            return self.finish_claims(key, &name, origin, claims, p);
        }
        let Some(log) = self.durable.get(&key).and_then(|d| d.log.clone()) else {
            let p = payloads.into_iter().map(|_| Payload::Failed).collect();
            return self.finish_claims(key, &name, origin, claims, p);
        };
        let bytes_max = self.s.cfg.history_fetch_bytes;
        let me = self.me.clone();
        CoreCounters::inc(&self.s.counters.history_reads);
        self.group_tasks += 1;
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
            reenter(&me, |st| {
                st.group_tasks -= 1;
                st.finish_claims(key, &name, origin, claims, out);
            });
        })
        .detach();
    }

    /// Answer a poll with the claims whose payloads are at hand, within the frame bound;
    /// release the rest (they go out again first), finish records retention removed.
    fn finish_claims(
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

//! Consumer groups in the simulator: each core runs the real group host (`shard::groups`)
//! over the durable stream shards of its stream host. Group files live on the simulated disk
//! (a completed write is durable: the driver writes them with fsync and rename), payload reads
//! and file writes are I/O the scheduler completes in any order, and a crash restarts every
//! group from its last written file.
//!
//! Consumers on any core create groups, poll (at once or waiting), and ack, nack, extend,
//! reject or keep their claims until they lapse as the clock moves.
//!
//! INVARIANTS:
//! - `claim_held_once` (after every step): a record is never handed out while an earlier
//!   claim on it holds (its deadline, as extended, not reached; not nacked) — a group never
//!   hands one claim to two consumers at once. Each handout is seen as the owner answers the
//!   poll, at the owner's clock.
//! - `claim_is_the_log` (after every step): a claimed record's payload is the record at its
//!   offset in the shard's log.
//! - `acked_stays_acked` (after every step): a record whose ack was answered done is never
//!   handed out again, across crashes (the answer waited for the group's file).
//! - `group_answered_once` (at rest): every group request of a live broker is answered
//!   exactly once.

use super::disk::MemLog;
use super::{World, CORES};
use crate::core::shard::groups::{GroupEffect, GroupHost, GroupHostCfg, Payload, Reply};
use crate::core::shard::stream::StreamHost;
use crate::core::shard::Ctx;
use crate::core::{GroupOrigin, MeshMsg, ShardKey, ToConn, ToOwner};
use crate::group::{file as gfile, Claim};
use bytes::Bytes;
use felix_quic::wire::{AnswerOp, ClaimRef, Frame, GroupFrame, GroupRef, StartAt, StreamName};
use std::collections::BTreeMap;

pub(super) fn host_cfg() -> GroupHostCfg {
    GroupHostCfg {
        poll_wait_max_ms: 400,
        poll_waiters_max: 4,
        max_per_shard: 4,
        max_frame_bytes: 1 << 20,
    }
}

/// Group I/O a core asked for.
pub(super) enum GroupIo {
    Read {
        core: u8,
        key: ShardKey,
        name: String,
        origin: GroupOrigin,
        claims: Vec<Claim>,
        payloads: Vec<Option<Bytes>>,
        log: MemLog,
    },
    Write {
        core: u8,
        key: ShardKey,
        name: String,
        bytes: Vec<u8>,
        replies: Vec<Reply>,
    },
    Remove {
        core: u8,
        key: ShardKey,
        name: String,
        broken: Option<GroupOrigin>,
    },
}

/// What a group request asked.
#[derive(Debug, Clone)]
pub(crate) enum Ask {
    Create,
    Poll,
    Answer(AnswerOp, ClaimRef),
}

/// A group request and its answers (exactly one is owed).
pub(crate) struct GReq {
    pub key: ShardKey,
    pub client: u64,
    pub ask: Ask,
    pub answers: Vec<Frame>,
    /// The broker crashed before answering: nothing more is owed.
    pub lost: bool,
}

/// A consumer: one connection on one core, and the claims it holds.
pub(crate) struct GClient {
    pub core: u8,
    pub held: Vec<(ShardKey, ClaimRef)>,
}

/// What the checker knows of each record a group handed out, by (shard, offset).
#[derive(Default)]
pub(crate) struct Claims {
    /// The claim that may hold: (attempt, deadline ms, the poll that got it).
    live: BTreeMap<(ShardKey, u64), (u32, u64, u64)>,
    /// Records whose ack was answered done (durable).
    acked: BTreeMap<(ShardKey, u64), u64>,
    pub handed: u64,
    pub redelivered: u64,
    pub violation: Option<String>,
}

impl World {
    pub(super) fn with_groups<R>(
        &mut self,
        c: u8,
        f: impl FnOnce(&mut GroupHost<MemLog>, &StreamHost<MemLog>, &Ctx) -> R,
    ) -> R {
        let mut host = std::mem::replace(
            &mut self.cores[c as usize].groups,
            GroupHost::new(host_cfg(), self.epoch),
        );
        let r = f(&mut host, &self.cores[c as usize].streams, &self.ctx(c));
        // Bounded: an outcome adds at most a write and its answers.
        for _ in 0..1000 {
            let effects = host.drain_effects();
            if effects.is_empty() {
                break;
            }
            for e in effects {
                match e {
                    GroupEffect::Send(to, msg) => {
                        self.observe_group_reply(&msg);
                        self.send(c, to, msg);
                    }
                    // The simulated disk makes a directory at once.
                    GroupEffect::Create {
                        key,
                        name,
                        group,
                        origin,
                    } => host.created(key, name, group, origin),
                    GroupEffect::ReadClaims {
                        key,
                        name,
                        origin,
                        claims,
                        payloads,
                        log,
                    } => self.io.push(super::Io::Group(GroupIo::Read {
                        core: c,
                        key,
                        name,
                        origin,
                        claims,
                        payloads,
                        log,
                    })),
                    GroupEffect::Write {
                        key,
                        name,
                        bytes,
                        replies,
                    } => self.io.push(super::Io::Group(GroupIo::Write {
                        core: c,
                        key,
                        name,
                        bytes,
                        replies,
                    })),
                    GroupEffect::Remove { key, name, broken } => {
                        self.io.push(super::Io::Group(GroupIo::Remove {
                            core: c,
                            key,
                            name,
                            broken,
                        }))
                    }
                }
            }
        }
        self.cores[c as usize].groups = host;
        r
    }

    /// Complete one group I/O.
    pub(super) fn complete_group_io(&mut self, io: GroupIo) {
        match io {
            GroupIo::Read {
                core,
                key,
                name,
                origin,
                claims,
                payloads,
                log,
            } => {
                let out: Vec<Payload> = claims
                    .iter()
                    .zip(payloads)
                    .map(|(c, p)| match p {
                        Some(b) => Payload::Ready(b),
                        None => match log.read(c.offset, 1) {
                            Ok(Some((_, mut recs))) => Payload::Ready(recs.remove(0)),
                            _ => Payload::Failed,
                        },
                    })
                    .collect();
                self.note(format!("group {name} of {key:?}: payloads read"));
                self.with_groups(core, |g, _, ctx| {
                    g.finish_claims(key, &name, origin, claims, out, ctx)
                });
                self.drain_inbox(core);
            }
            GroupIo::Write {
                core,
                key,
                name,
                bytes,
                replies,
            } => {
                self.note(format!("group {name} of {key:?}: file written"));
                self.group_files.insert((key, name.clone()), bytes);
                self.with_groups(core, |g, _, ctx| {
                    g.on_written(key, name, Ok(()), replies, ctx)
                });
                self.drain_inbox(core);
            }
            GroupIo::Remove {
                core,
                key,
                name,
                broken,
            } => {
                self.note(format!("group {name} of {key:?}: file removed"));
                self.group_files.remove(&(key, name.clone()));
                self.with_groups(core, |g, _, _| g.on_removed(key, name, broken, Ok(())));
                self.drain_inbox(core);
            }
        }
    }

    /// A durable shard opened at `tail` on core `c`: its groups come back from their files.
    pub(super) fn load_groups(&mut self, c: u8, key: ShardKey, tail: u64) {
        let files: Vec<_> = self
            .group_files
            .range((key, String::new())..)
            .take_while(|((k, _), _)| *k == key)
            .map(|((_, n), b)| (n.clone(), gfile::decode(b).map_err(|e| e.to_string())))
            .collect();
        self.with_groups(c, |g, _, ctx| g.load(key, files, tail, ctx));
    }

    /// A group message at core `c`, or the message back if it is none.
    pub(super) fn on_group_mesh(&mut self, c: u8, msg: MeshMsg) -> Option<MeshMsg> {
        match msg {
            MeshMsg::Owner(ToOwner::Group {
                origin,
                stream,
                frame,
            }) => self.with_groups(c, |g, s, ctx| g.on_group(origin, stream, frame, s, ctx)),
            MeshMsg::Owner(ToOwner::GroupConnClosed { core, conn }) => {
                self.cores[c as usize].groups.conn_closed(core, conn)
            }
            MeshMsg::Conn(ToConn::GroupReply { origin, frame }) => {
                let rid = origin.request_id;
                let r = self
                    .greqs
                    .get_mut(&rid)
                    .expect("a group request of the run");
                if let Frame::Group(GroupFrame::GroupRecords { claims, .. }) = &frame {
                    let key = r.key;
                    if let Some(cl) = self.gclients.get_mut(&r.client) {
                        cl.held.extend(claims.iter().map(|c| (key, *c)));
                    }
                }
                r.answers.push(super::wire(&frame));
            }
            other => return Some(other),
        }
        None
    }

    /// The owner answers a group request: check each handout against the claims that hold,
    /// and note what answers did.
    fn observe_group_reply(&mut self, msg: &MeshMsg) {
        let MeshMsg::Conn(ToConn::GroupReply { origin, frame }) = msg else {
            return;
        };
        let rid = origin.request_id;
        let now = self.now_ms;
        let Some(req) = self.greqs.get(&rid) else {
            return;
        };
        let key = req.key;
        match (frame, &req.ask) {
            (
                Frame::Group(GroupFrame::GroupRecords {
                    claims,
                    records,
                    visibility_timeout_ms,
                    ..
                }),
                _,
            ) => {
                let payloads: Vec<Bytes> = records.iter().collect();
                for (c, p) in claims.iter().zip(payloads) {
                    self.handout(key, *c, p, now + visibility_timeout_ms, rid);
                }
            }
            (Frame::Group(GroupFrame::GroupAnswered { codes, .. }), Ask::Answer(op, c))
                if codes.first() == Some(&0) =>
            {
                let at = (key, c.offset);
                let holds = self.gclaims.live.get(&at).is_some_and(|l| l.0 == c.attempt);
                match op {
                    AnswerOp::Ack => {
                        self.gclaims.acked.insert(at, rid);
                        self.gclaims.live.remove(&at);
                    }
                    AnswerOp::Nack { .. } | AnswerOp::Reject if holds => {
                        self.gclaims.live.remove(&at);
                    }
                    AnswerOp::Extend {
                        visibility_timeout_ms,
                    } if holds => {
                        let l = self.gclaims.live.get_mut(&at).expect("holds");
                        l.1 = now + visibility_timeout_ms;
                    }
                    _ => {}
                }
            }
            _ => {}
        }
    }

    fn handout(&mut self, key: ShardKey, c: ClaimRef, payload: Bytes, deadline: u64, rid: u64) {
        let at = (key, c.offset);
        let now = self.now_ms;
        let g = &mut self.gclaims;
        g.handed += 1;
        if g.violation.is_some() {
            return;
        }
        if let Some(by) = g.acked.get(&at) {
            g.violation = Some(format!(
                "acked_stays_acked: {key:?} offset {} handed to poll #{rid} (attempt {}) after its ack #{by} was answered done",
                c.offset, c.attempt
            ));
            return;
        }
        if let Some((attempt, until, by)) = g.live.get(&at) {
            if *until > now {
                g.violation = Some(format!(
                    "claim_held_once: {key:?} offset {} handed to poll #{rid} (attempt {}) at {now} ms while poll #{by}'s claim (attempt {attempt}) holds until {until} ms",
                    c.offset, c.attempt
                ));
                return;
            }
            g.redelivered += 1;
        }
        g.live.insert(at, (c.attempt, deadline, rid));
        let in_log = self
            .disk
            .get(&key)
            .and_then(|s| s.borrow().records.get(c.offset as usize).cloned());
        if in_log.as_ref() != Some(&payload) {
            g.violation = Some(format!(
                "claim_is_the_log: {key:?} offset {} handed as {payload:?}, the log holds {in_log:?}",
                c.offset
            ));
        }
    }

    /// A crash: the claims of the old process are gone (acks answered done stay).
    pub(super) fn groups_crash(&mut self) {
        self.gclaims.live.clear();
        for r in self.greqs.values_mut() {
            if r.answers.is_empty() {
                r.lost = true;
            }
        }
        for c in self.gclients.values_mut() {
            c.held.clear();
        }
    }

    // ---------- what consumers do ----------

    pub(crate) fn group_client(&mut self, core: u8) -> u64 {
        let id = self.id();
        self.gclients.insert(
            id,
            GClient {
                core,
                held: Vec::new(),
            },
        );
        id
    }

    fn group_request(&mut self, client: u64, key: ShardKey, ask: Ask, frame: GroupFrame) {
        let core = self.gclients[&client].core;
        let rid = frame.request_id();
        self.note(format!(
            "group request #{rid} from client {client}: {ask:?}"
        ));
        self.greqs.insert(
            rid,
            GReq {
                key,
                client,
                ask,
                answers: Vec::new(),
                lost: false,
            },
        );
        let origin = GroupOrigin {
            core,
            conn: client,
            quic_stream: 0,
            request_id: rid,
            frame_bytes_max: 1 << 20,
        };
        // As a session hands it over: the frame through the wire, the connection side's checks.
        let Frame::Group(frame) = super::wire(&Frame::Group(frame)) else {
            unreachable!("a group frame decodes as one")
        };
        let stream = match crate::core::conn::checks::group_target(&self.catalog, &frame) {
            Ok((idx, _)) => idx,
            Err(why) => {
                let r = self.greqs.get_mut(&rid).expect("inserted");
                r.answers.push(why.frame(rid));
                return;
            }
        };
        let owner = self.ctx(core).owner_core(key);
        let msg = MeshMsg::Owner(ToOwner::Group {
            origin,
            stream,
            frame,
        });
        self.send(core, owner, msg);
        self.drain_inbox(core);
    }

    fn target(&self, key: ShardKey) -> GroupRef {
        let def = &self.catalog.slot(key.0).def;
        GroupRef {
            stream: StreamName::new(&def.tenant, &def.namespace, &def.stream),
            group: "g".into(),
            shard: key.1,
        }
    }

    /// Create group `g` on `key`, from the earliest record.
    pub(crate) fn group_create(&mut self, client: u64, key: ShardKey, max_attempts: u32, vt: u64) {
        let rid = self.id();
        let frame = GroupFrame::GroupCreate {
            request_id: rid,
            target: self.target(key),
            start: StartAt::Earliest,
            max_attempts,
            visibility_timeout_ms: vt,
        };
        self.group_request(client, key, Ask::Create, frame);
    }

    pub(crate) fn group_poll(&mut self, client: u64, key: ShardKey, max: u32, vt: u64, wait: u64) {
        let rid = self.id();
        let frame = GroupFrame::GroupPoll {
            request_id: rid,
            target: self.target(key),
            max,
            visibility_timeout_ms: vt,
            wait_ms: wait,
        };
        self.group_request(client, key, Ask::Poll, frame);
    }

    /// The client answers one claim it holds (`op`) and lets go of it.
    pub(crate) fn group_answer(&mut self, client: u64, i: usize, op: AnswerOp) {
        let (key, c) = self
            .gclients
            .get_mut(&client)
            .expect("a client of the run")
            .held
            .remove(i);
        let rid = self.id();
        let frame = GroupFrame::GroupAnswer {
            request_id: rid,
            target: self.target(key),
            op,
            claims: vec![c],
        };
        self.group_request(client, key, Ask::Answer(op, c), frame);
    }
}

/// INVARIANTS `claim_held_once`, `claim_is_the_log`, `acked_stays_acked`.
pub(super) fn after_step(w: &World) -> Result<(), String> {
    match &w.gclaims.violation {
        Some(v) => Err(v.clone()),
        None => Ok(()),
    }
}

/// INVARIANT `group_answered_once`.
pub(super) fn at_rest(w: &World) -> Result<(), String> {
    for (rid, r) in &w.greqs {
        if r.answers.len() > 1 || (r.answers.is_empty() && !r.lost) {
            return Err(format!(
                "group_answered_once: group request #{rid} ({:?}) got {} answers",
                r.ask,
                r.answers.len()
            ));
        }
    }
    for (c, core) in w.cores.iter().enumerate() {
        if !core.groups.idle() {
            return Err(format!(
                "group_answered_once: core {c}'s group host is not idle at rest"
            ));
        }
    }
    Ok(())
}

// ---------- the scenario ----------

/// Consumers on every core share a group on each shard of the durable stream while records
/// are published: polls at once and waiting, acks, nacks, extensions, rejections, and claims
/// kept until they lapse as the clock moves; the broker crashes and restarts now and then.
/// Copied from `broker/tests/groups.rs` (`redelivery_dead_letters_and_stale_claims`,
/// `two_and_ten_competing_consumers_process_every_record_once`,
/// `sigkill_and_restart_keep_cursor_and_dead_letters`).
pub(super) fn group_claims_expire_and_redeliver(w: &mut World) -> Result<(), String> {
    const DUR: u32 = 1;
    let clients: Vec<u64> = (0..3)
        .map(|_| {
            let core = w.rng.below(CORES as u64) as u8;
            w.group_client(core)
        })
        .collect();
    w.run(30)?; // the durable shards open
    for shard in 0..2 {
        let vt = 40 + w.rng.below(120);
        let attempts = 2 + w.rng.below(3) as u32;
        w.group_create(clients[0], (DUR, shard), attempts, vt);
    }
    for _ in 0..80 {
        let client = clients[w.rng.below(clients.len() as u64) as usize];
        let key = (DUR, w.rng.below(2) as u32);
        match w.rng.below(20) {
            0..=4 => {
                let core = w.rng.below(CORES as u64) as u8;
                let n = 1 + w.rng.below(3) as u32;
                w.publish(core, key, n);
            }
            5..=9 => {
                let max = 1 + w.rng.below(3) as u32;
                let vt = [0, 30, 90][w.rng.below(3) as usize];
                let wait = [0, 0, 150, 400][w.rng.below(4) as usize];
                w.group_poll(client, key, max, vt, wait);
            }
            10..=16 => {
                let held = w.gclients[&client].held.len();
                if held > 0 {
                    let i = w.rng.below(held as u64) as usize;
                    let op = match w.rng.below(10) {
                        0..=4 => AnswerOp::Ack,
                        5..=6 => AnswerOp::Nack {
                            delay_ms: [0, 40][w.rng.below(2) as usize],
                        },
                        7..=8 => AnswerOp::Extend {
                            visibility_timeout_ms: 30 + w.rng.below(100),
                        },
                        _ => AnswerOp::Reject,
                    };
                    w.group_answer(client, i, op);
                }
            }
            17 => {
                let ms = 50 + w.rng.below(150);
                w.advance(ms);
            }
            18 if w.rng.chance(15) => w.crash(false),
            _ => {}
        }
        let k = w.rng.below(10);
        w.run(k)?;
    }
    Ok(())
}

//! The consumer-group driver of a core: the groups of the durable shards this core owns are
//! the pure host `shard::groups` (around the state machine in [`crate::group`]). This file:
//! the connection side (validating and routing requests, answers back) and the group files'
//! reading and writing; `driver` steps the host and carries out its I/O.
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

mod driver;
use crate::group::{file as gfile, GroupConfig};
use felix_quic::wire::GroupFrame;
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

/// Write `bytes` as `dir/name.grp`: temporary file, fdatasync, rename, directory fsync.
fn write_group_file(dir: &std::path::Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    super::durable::atomic_write(dir, &format!("{name}{}", gfile::SUFFIX), bytes)
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

impl CoreState {
    pub(in crate::core) fn group_reply(&mut self, origin: GroupOrigin, frame: Frame) {
        self.route(
            origin.core,
            MeshMsg::Conn(ToConn::GroupReply { origin, frame }),
        );
    }

    // ---------- connection side ----------

    /// A group request from a client: validate what the connection's core can, then route
    /// it to the shard's owner.
    pub(in crate::core) fn on_group_request(
        &mut self,
        key: ConnKey,
        quic_stream: u64,
        frame: GroupFrame,
    ) -> Result<(), Refusal> {
        let (idx, target) = crate::core::conn::checks::group_target(&self.catalog, &frame)?;
        // A cancel finds a poll this broker forwarded whatever the placement says now (the
        // shard may have moved since the poll left).
        if matches!(frame, GroupFrame::GroupPollCancel { .. })
            && self.cancel_forwarded_poll(key, frame.request_id())
        {
            return Ok(());
        }
        if let crate::core::conn::ShardAdmit::Forward(to) =
            self.admit_shard(key, false, idx, target.shard)?
        {
            return self.forward_group(key, quic_stream, frame, to);
        }
        if matches!(frame, GroupFrame::GroupPoll { wait_ms, .. } if wait_ms > 0) {
            if let Some(s) = self.sessions.get_mut(&key) {
                s.long_polls = true;
            }
        }
        let mut frame_bytes_max = self.ep.get(key).map_or(self.s.cfg.max_frame_bytes, |e| {
            e.conn.peer_max_frame_bytes()
        }) as u32;
        // A forwarded request is answered to its client through the link: the smaller of
        // the link's and the client's maximum.
        if let Some(m) = self
            .sessions
            .get(&key)
            .and_then(|s| s.forwarded.as_ref())
            .map(|h| h.frame_bytes_max)
            .filter(|&m| m > 0)
        {
            frame_bytes_max = frame_bytes_max.min(m);
        }
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
            MeshMsg::Owner(ToOwner::Group {
                origin,
                stream: idx,
                frame,
            }),
        );
        Ok(())
    }

    /// A group request for a shard another broker owns: forwarded there. A long poll may
    /// wait its `wait_ms` there (the forward's deadline grows by it), and carries its cancel,
    /// sent when the client cancels it or closes; a cancel finds the forwarded poll by the
    /// client's id.
    fn forward_group(
        &mut self,
        key: ConnKey,
        quic_stream: u64,
        frame: GroupFrame,
        to: crate::core::peer::FwdTarget,
    ) -> Result<(), Refusal> {
        let rid = frame.request_id();
        if let GroupFrame::GroupPollCancel { target, .. } = &frame {
            // Tried before the admission (on_group_request): no forwarded poll waits here.
            return Err(Refusal::new(
                ErrorCode::NotFound,
                format!(
                    "no poll {rid} of this connection is waiting on group {} shard {}",
                    target.group, target.shard
                ),
            ));
        }
        let mut frame = frame;
        // A draining broker answers long polls at once: one it forwards does not wait either.
        // The wait counted in the forward's deadline is the owner's bound, not the ask.
        let wait_max_ms = if self.draining {
            0
        } else {
            self.s.cfg.group_poll_wait_max_ms
        };
        if let GroupFrame::GroupPoll { wait_ms, .. } = &mut frame {
            *wait_ms = (*wait_ms).min(wait_max_ms);
        }
        let (wait, cancel) = match &frame {
            GroupFrame::GroupPoll {
                wait_ms, target, ..
            } if *wait_ms > 0 => (
                Duration::from_millis(*wait_ms),
                Some(Frame::Group(GroupFrame::GroupPollCancel {
                    request_id: rid,
                    target: target.clone(),
                })),
            ),
            _ => (Duration::ZERO, None),
        };
        let client = crate::core::peer::FwdClient::Request {
            conn: key,
            stream: quic_stream,
            request_id: rid,
            cache: false,
        };
        let lane = crate::core::peer::Lane::Control;
        let inner = Frame::Group(frame);
        self.forward(to, &inner, client, lane, (wait, cancel.as_ref()))
    }

    pub(in crate::core) fn on_group_reply(&mut self, origin: GroupOrigin, frame: Frame) {
        if let Some(e) = self.ep.get(origin.conn) {
            e.conn.send_frame(origin.quic_stream, &frame);
            self.ep.mark_dirty(origin.conn);
        }
    }

    /// A connection that long-polled is gone: every core drops its waiting polls.
    pub(in crate::core) fn group_conn_closed(&mut self, key: ConnKey, long_polled: bool) {
        if !long_polled {
            return;
        }
        for core in 0..self.s.cores {
            self.route(
                core,
                MeshMsg::Owner(ToOwner::GroupConnClosed {
                    core: self.id,
                    conn: key,
                }),
            );
        }
    }

    pub(in crate::core) fn on_group_conn_closed(&mut self, core: u8, conn: ConnKey) {
        self.groups.conn_closed(core, conn);
    }
}

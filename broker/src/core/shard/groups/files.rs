//! A group's life on disk, as the host sees it: created (once its directory exists),
//! written whole after each durable change (answers wait for the write that covers them;
//! changes made while a write runs go in the next one), deleted (once no write runs).

use super::*;
use crate::group::file as gfile;
use crate::metrics::CoreCounters;

impl<L: ShardLog> GroupHost<L> {
    /// GroupCreate: checked here; the group exists once the driver made its directory
    /// (`created`).
    pub(super) fn create(
        &mut self,
        origin: GroupOrigin,
        key: ShardKey,
        name: String,
        (oldest, tail): (u64, u64),
        (start, max_attempts, visibility_timeout_ms): (StartAt, u32, u64),
    ) {
        let rid = origin.request_id;
        let max = self.cfg.max_per_shard;
        let sg = self.groups.entry(key).or_default();
        if sg.groups.get(&name).is_some_and(|s| s.deleting.is_some()) {
            let msg = format!(
                "consumer group {name} is being deleted; create it again once that is done"
            );
            return self.reply(origin, Frame::error(rid, ErrorCode::Conflict, msg));
        }
        if sg.groups.contains_key(&name) || sg.broken.contains_key(&name) {
            let msg = format!("consumer group {name} already exists on shard {}", key.1);
            return self.reply(origin, Frame::error(rid, ErrorCode::AlreadyExists, msg));
        }
        if sg.groups.len() + sg.broken.len() >= max {
            let msg = format!(
                "shard {} already holds {max} groups (group_max_per_shard)",
                key.1
            );
            return self.reply(origin, Frame::error(rid, ErrorCode::InvalidRequest, msg));
        }
        let at = start_offset(start, oldest, tail);
        if at < oldest {
            let msg = format!("offset {at} is below the oldest retained offset {oldest}");
            return self.reply(origin, Frame::error(rid, ErrorCode::RevisionTooOld, msg));
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
            Err(e) => return self.reply(origin, err_frame(rid, &e)),
        };
        self.effects.push(GroupEffect::Create {
            key,
            name,
            group,
            origin,
        });
    }

    /// The created group's directory exists: the group is, and its create is answered once
    /// its first file is written.
    pub(crate) fn created(
        &mut self,
        key: ShardKey,
        name: String,
        group: Group,
        origin: GroupOrigin,
    ) {
        let prev = self
            .groups
            .entry(key)
            .or_default()
            .groups
            .insert(name.clone(), GroupSlot::new(group));
        assert!(prev.is_none(), "a group is created once");
        self.persist(key, &name, Some((origin, ok(origin.request_id))));
    }

    /// Queue `reply` behind a write of the group's current state.
    pub(super) fn persist(&mut self, key: ShardKey, name: &str, reply: Option<Reply>) {
        let slot = slot_in(&mut self.groups, key, name).expect("persisted group exists");
        if slot.deleting.is_some() {
            if let Some((o, _)) = reply {
                let msg = format!("consumer group {name} was deleted");
                self.reply(o, Frame::error(o.request_id, ErrorCode::NotFound, msg));
            }
            return;
        }
        slot.dirty = true;
        slot.queued.extend(reply);
        if !slot.writing {
            self.start_write(key, name.to_string());
        }
    }

    fn start_write(&mut self, key: ShardKey, name: String) {
        let slot = slot_in(&mut self.groups, key, &name).expect("written group exists");
        let bytes = gfile::encode(slot.group.config(), &slot.group.snapshot());
        let replies = std::mem::take(&mut slot.queued);
        slot.dirty = false;
        slot.writing = true;
        self.effects.push(GroupEffect::Write {
            key,
            name,
            bytes,
            replies,
        });
    }

    /// A write of group `name`'s file finished (`Err`: why not): answer what it covered.
    pub(crate) fn on_written(
        &mut self,
        key: ShardKey,
        name: String,
        r: Result<(), String>,
        replies: Vec<Reply>,
        ctx: &Ctx,
    ) {
        let c = ctx.counters;
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
            self.reply(origin, f);
        }
        let Some(slot) = slot_in(&mut self.groups, key, &name) else {
            return;
        };
        slot.writing = false;
        if slot.deleting.is_some() {
            let replies: Vec<Reply> = std::mem::take(&mut slot.queued);
            for (o, _) in replies {
                let msg = format!("consumer group {name} was deleted");
                self.reply(o, Frame::error(o.request_id, ErrorCode::NotFound, msg));
            }
            self.finish_delete(key, name);
        } else if slot.dirty || !slot.queued.is_empty() {
            self.start_write(key, name);
        }
    }

    /// Remove a deleted group's file (then its state, then answer the delete: `on_removed`).
    pub(super) fn finish_delete(&mut self, key: ShardKey, name: String) {
        if let Some(slot) = slot_in(&mut self.groups, key, &name) {
            // No write may start (or rename over the removal) while the file is removed.
            slot.writing = true;
        }
        self.effects.push(GroupEffect::Remove {
            key,
            name,
            broken: None,
        });
    }

    /// A group file's removal finished (`Err`: why not).
    pub(crate) fn on_removed(
        &mut self,
        key: ShardKey,
        name: String,
        broken: Option<GroupOrigin>,
        r: Result<(), String>,
    ) {
        if let Some(origin) = broken {
            let rid = origin.request_id;
            let f = match r {
                Ok(()) => {
                    if let Some(sg) = self.groups.get_mut(&key) {
                        sg.broken.remove(&name);
                    }
                    ok(rid)
                }
                Err(e) => Frame::error(rid, ErrorCode::Unavailable, format!("cannot remove: {e}")),
            };
            return self.reply(origin, f);
        }
        let deleting = self
            .groups
            .get(&key)
            .and_then(|g| g.groups.get(&name))
            .and_then(|s| s.deleting);
        // Gone already (the stream was deleted meanwhile): nothing left to answer here.
        let Some(origin) = deleting else { return };
        self.groups
            .get_mut(&key)
            .expect("looked up above")
            .groups
            .remove(&name);
        let rid = origin.request_id;
        let f = match r {
            Ok(()) => ok(rid),
            Err(e) => {
                // The file may come back at the next open: say so rather than pretend.
                let msg = format!("group state removed, but its file could not be: {e}");
                Frame::error(rid, ErrorCode::Unavailable, msg)
            }
        };
        self.reply(origin, f);
    }
}

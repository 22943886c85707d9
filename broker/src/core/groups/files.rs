//! Consumer groups' lifecycle on disk: loading a shard's groups, creating and deleting them,
//! and the whole-file writes every answer waits for.

use super::*;

impl CoreState {
    pub(in crate::core) fn groups_dir(&self, key: ShardKey) -> Option<PathBuf> {
        let root = self.s.cfg.durable_storage_dir.as_ref()?;
        let slot = self.catalog.slot(key.0);
        Some(slot_shard_dir(root, &slot.def.name(), slot.incarnation, key.1).join("groups"))
    }

    /// Load a durable shard's groups once its log is open.
    pub(in crate::core) fn load_groups(&mut self, key: ShardKey, tail: u64) {
        let Some(dir) = self.groups_dir(key) else {
            return;
        };
        let name = self.catalog.slot(key.0).def.name();
        let mut sg = ShardGroups::default();
        for (g, parsed) in read_group_files(&dir) {
            match parsed.and_then(|(cfg, snap)| restore(cfg, snap, tail)) {
                Ok(group) => {
                    tracing::info!(stream = %name, shard = key.1, group = %g, cursor = group.cursor(), "consumer group restored");
                    sg.groups.insert(g, GroupSlot::new(group));
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
    pub(in crate::core) fn drop_groups(&mut self, key: ShardKey, why: &Refusal) {
        let Some(sg) = self.groups.remove(&key) else {
            return;
        };
        for (_, slot) in sg.groups {
            let replies = slot.queued.into_iter().map(|(o, _)| o);
            let waiters = slot.waiters.into_iter().map(|w| w.origin);
            for o in replies.chain(waiters).chain(slot.deleting) {
                self.group_reply(o, why.clone().frame(o.request_id));
            }
        }
    }

    /// Nothing left to answer or write (drain).
    pub(in crate::core) fn groups_idle(&self) -> bool {
        self.group_tasks.idle()
            && self
                .groups
                .values()
                .flat_map(|g| g.groups.values())
                .all(|s| !s.writing && s.queued.is_empty() && s.waiters.is_empty())
    }

    #[allow(clippy::too_many_arguments)]
    pub(in crate::core) fn group_create(
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
        self.groups
            .entry(key)
            .or_default()
            .groups
            .insert(name.clone(), GroupSlot::new(group));
        self.persist_group(key, &name, Some((origin, ok(rid))));
    }

    pub(in crate::core) fn group_delete_broken(
        &mut self,
        origin: GroupOrigin,
        key: ShardKey,
        name: String,
    ) {
        let dir = self.groups_dir(key);
        let me = self.me.clone();
        let pass = self.group_tasks.enter();
        glommio::spawn_local(async move {
            let r = remove_off_core(dir, name.clone()).await;
            reenter(&me, move |st| {
                drop(pass);
                let rid = origin.request_id;
                let f = match r {
                    Ok(()) => {
                        if let Some(sg) = st.groups.get_mut(&key) {
                            sg.broken.remove(&name);
                        }
                        ok(rid)
                    }
                    Err(e) => {
                        Frame::error(rid, ErrorCode::Unavailable, format!("cannot remove: {e}"))
                    }
                };
                st.group_reply(origin, f);
            });
        })
        .detach();
    }

    /// Remove a deleted group's file, then its state, then answer the delete.
    pub(in crate::core) fn finish_delete(&mut self, key: ShardKey, name: String) {
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
        let pass = self.group_tasks.enter();
        glommio::spawn_local(async move {
            let r = remove_off_core(dir, name.clone()).await;
            reenter(&me, move |st| {
                drop(pass);
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
            });
        })
        .detach();
    }

    /// Queue `reply` behind a write of the group's current state.
    pub(in crate::core) fn persist_group(
        &mut self,
        key: ShardKey,
        name: &str,
        reply: Option<Reply>,
    ) {
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

    pub(in crate::core) fn start_group_write(&mut self, key: ShardKey, name: String) {
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

    pub(in crate::core) fn on_group_written(
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
}

/// Remove group `name`'s file on the blocking pool (no directory: nothing to remove).
async fn remove_off_core(dir: Option<PathBuf>, name: String) -> std::io::Result<()> {
    match dir {
        Some(dir) => {
            glommio::executor()
                .spawn_blocking(move || remove_group_file(&dir, &name))
                .await
        }
        None => Ok(()),
    }
}

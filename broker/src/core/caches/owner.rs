//! The owner side of cache shards: applying puts, deletes and counters (after commit when
//! log-backed), emitting changes to the cores with watches, starting watches (current state,
//! replay from the ring or the log), and the TTL clock.

use super::*;

impl CoreState {
    // ---------- owner side ----------

    pub(in crate::core) fn on_cache_req(
        &mut self,
        origin: CacheOrigin,
        cache: u32,
        shard: u32,
        frame: CacheFrame,
    ) {
        let reply = match self.catalog.cache_serve_check(cache, shard) {
            Err((code, msg)) => Frame::error(origin.request_id, code, msg),
            Ok(()) => match self.apply_cache_op(origin.request_id, cache, shard, frame) {
                (f, None) => f,
                (f, Some(wait)) => {
                    let oc = self.caches.get_mut(&(cache, shard)).expect("applied on it");
                    oc.wait_for_commit(wait, origin, f);
                    oc.since_snapshot += 1;
                    self.maybe_compact((cache, shard));
                    return;
                }
            },
        };
        self.route(
            origin.core,
            MeshMsg::Conn(ToConn::CacheReply {
                origin,
                frame: reply,
            }),
        );
    }

    /// Apply one request; the answer now, or (log-backed writes) once its record commits.
    pub(in crate::core) fn apply_cache_op(
        &mut self,
        rid: u64,
        cache: u32,
        shard: u32,
        frame: CacheFrame,
    ) -> (Frame, Option<Wait>) {
        let now = wall_ms();
        let default_ttl = self.catalog.cache_slot(cache).def.default_ttl_ms;
        let counters_max = self.s.cfg.cache_entries_max as usize;
        let key = (cache, shard);
        let oc = self.owned_cache(key);
        let now_frame = |f: Frame| (f, None);
        let err = |e: &CacheError| now_frame(Frame::error(rid, cache_code(e), e.to_string()));
        // Check, append (log-backed), then apply: the state never runs ahead of the log.
        let (answer, change) = match frame {
            CacheFrame::CachePut {
                key: k,
                value,
                ttl_ms,
                cond: c,
                ..
            } => {
                let ttl = if ttl_ms == 0 {
                    default_ttl
                } else {
                    Some(ttl_ms)
                };
                let ch = match oc.shard.prepare_put(k, value, ttl, cond(c), now) {
                    Ok(ch) => ch,
                    Err(e) => return err(&e),
                };
                let expires = match &ch.kind {
                    ChangeKind::Put { expires_at_ms, .. } => expires_at_ms.unwrap_or(0),
                    _ => 0,
                };
                let f = Frame::Cache(CacheFrame::CacheWritten {
                    request_id: rid,
                    shard,
                    version: ch.offset,
                    expires_at_ms: expires,
                });
                (f, ch)
            }
            CacheFrame::CacheGet { key: k, .. } => {
                return now_frame(cache_value(oc, rid, shard, &k, now));
            }
            CacheFrame::CacheDelete {
                key: k, cond: c, ..
            } => {
                let (ch, old) = match oc.shard.prepare_delete(k, cond(c), now) {
                    Ok(x) => x,
                    Err(e) => return err(&e),
                };
                let f = Frame::Cache(CacheFrame::CacheValue {
                    request_id: rid,
                    shard,
                    found: true,
                    version: old.version,
                    change_offset: ch.offset,
                    expires_at_ms: old.expires_at_ms.unwrap_or(0),
                    value: old.value,
                });
                (f, ch)
            }
            CacheFrame::CounterAdd { name, delta, .. } => {
                return counter_add(oc, rid, shard, name, delta, counters_max, now);
            }
            CacheFrame::CounterGet { name, .. } => {
                return now_frame(Frame::Cache(CacheFrame::CounterValue {
                    request_id: rid,
                    shard,
                    sum: oc.counters.get(&name),
                    offset: oc.counters.next_offset(),
                }));
            }
            other => {
                return now_frame(Frame::error(
                    rid,
                    ErrorCode::InvalidRequest,
                    format!("frame kind {} is not a cache operation", other.kind()),
                ))
            }
        };
        if let Some(logs) = &oc.logs {
            let (k, flags, payload) = crate::cache::record::encode(&change);
            let rec = RecordIn {
                key: &k,
                payload: &payload,
                flags,
            };
            match logs.cache.append(&[rec], now) {
                Ok(r) => assert_eq!(r.start, change.offset, "cache log and state agree"),
                Err(e) => {
                    let (code, msg) = cache_logs::append_refusal(&e);
                    return now_frame(Frame::error(rid, code, msg));
                }
            }
        }
        oc.shard.apply(&change);
        let wait = oc.logs.as_ref().map(|_| Wait {
            counters: false,
            upto: change.offset + 1,
        });
        CoreCounters::inc(&self.s.counters.cache_writes);
        self.emit(key, change.offset, change.key, &change.kind);
        (answer, wait)
    }

    /// Record a change in the replay ring and send it to every core with a matching watch.
    pub(in crate::core) fn emit(
        &mut self,
        key: ShardKey,
        offset: u64,
        k: Bytes,
        kind: &ChangeKind,
    ) {
        let frame = event_frame(offset, &k, kind);
        let ev = Arc::new(Ev {
            offset,
            key: k,
            frame,
        });
        let (entries_max, bytes_max) = (
            self.s.cfg.cache_replay_entries_max as usize,
            self.s.cfg.cache_replay_bytes_max,
        );
        let cores = self.s.cores as usize;
        let oc = self.caches.get_mut(&key).expect("emit on an owned shard");
        if let Some(last) = oc.ring.back() {
            assert_eq!(last.offset + 1, offset, "cache changes are contiguous");
        }
        oc.ring_bytes += ev.frame.len() as u64;
        oc.ring.push_back(ev.clone());
        while oc.ring.len() > entries_max || oc.ring_bytes > bytes_max {
            let old = oc
                .ring
                .pop_front()
                .expect("ring over its caps is not empty");
            oc.ring_bytes -= old.frame.len() as u64;
            oc.replayable_from = old.offset + 1;
        }
        let mut to = vec![false; cores];
        for r in &oc.watches {
            if r.filter.matches(&ev.key) {
                to[r.core as usize] = true;
            }
        }
        for (core, yes) in to.into_iter().enumerate() {
            if yes {
                self.route(
                    core as u8,
                    MeshMsg::Conn(ToConn::CacheChange {
                        cache: key.0,
                        shard: key.1,
                        ev: ev.clone(),
                    }),
                );
            }
        }
    }

    pub(in crate::core) fn on_watch_open(&mut self, req: WatchReq) {
        // A resume below the replay ring that the log still holds is read from the log.
        if let WatchStart::Offset(from) = req.start {
            let key = (req.cache, req.shard);
            let from_log = self.catalog.cache_serve_check(req.cache, req.shard).is_ok()
                && self.caches.get(&key).is_some_and(|oc| {
                    oc.logs.as_ref().is_some_and(|l| {
                        from < oc.replayable_from
                            && from >= l.cache.oldest_offset()
                            && from <= oc.shard.next_offset()
                    })
                });
            if from_log {
                return self.start_log_replay(req, from);
            }
        }
        let result = self.start_watch(&req).map_err(Refusal::from);
        self.route(
            req.core,
            MeshMsg::Conn(ToConn::WatchOpened {
                watch: req.watch,
                result,
            }),
        );
    }

    pub(in crate::core) fn start_watch(
        &mut self,
        req: &WatchReq,
    ) -> Result<Opened, (ErrorCode, String)> {
        self.catalog.cache_serve_check(req.cache, req.shard)?;
        let now = wall_ms();
        let oc = self.owned_cache((req.cache, req.shard));
        let next = oc.shard.next_offset();
        let (state, replay) = match req.start {
            WatchStart::Latest => (None, Vec::new()),
            WatchStart::Current => (Some(false), Vec::new()),
            WatchStart::Offset(from) => {
                match crate::cache::plan_resume(from, oc.replayable_from, next) {
                    ResumePlan::BeyondTail { next_offset } => {
                        return Err((
                            ErrorCode::InvalidRequest,
                            format!(
                                "offset {from} is beyond the tail of the shard ({next_offset})"
                            ),
                        ))
                    }
                    ResumePlan::Snapshot => (Some(true), Vec::new()),
                    ResumePlan::Replay { from } => (
                        None,
                        oc.ring
                            .iter()
                            .filter(|e| e.offset >= from && req.filter.matches(&e.key))
                            .cloned()
                            .collect(),
                    ),
                }
            }
        };
        let resume_from = match req.start {
            WatchStart::Offset(from) if state.is_none() => from,
            _ => next,
        };
        let state = match state {
            None => None,
            Some(snapshot) => {
                let ws = oc.shard.watch_start(&req.filter, now);
                let frames: Vec<Bytes> = ws
                    .retained
                    .into_iter()
                    .map(|(k, e)| {
                        encode_event(
                            EventKind::Retained,
                            e.version,
                            k,
                            e.expires_at_ms.unwrap_or(0),
                            e.value,
                        )
                    })
                    .collect();
                let bytes: u64 = frames.iter().map(|f| f.len() as u64).sum();
                if frames.len() > req.events_max as usize || bytes > req.bytes_max {
                    return Err((
                        ErrorCode::InvalidRequest,
                        format!(
                            "the current state ({} keys, {bytes} bytes) exceeds the watch's queue bound ({} events, {} bytes); narrow the filter or raise the bound",
                            frames.len(),
                            req.events_max,
                            req.bytes_max
                        ),
                    ));
                }
                let done = Frame::Cache(CacheFrame::CacheStateDone {
                    count: frames.len() as u64,
                    snapshot,
                    live_from: ws.live_from,
                })
                .encode();
                Some((frames, done))
            }
        };
        oc.watches.push(Reg {
            core: req.core,
            watch: req.watch,
            filter: req.filter.clone(),
        });
        Ok(Opened {
            shard: req.shard,
            live_from: next,
            resume_from,
            truncated_at: None,
            state,
            replay,
        })
    }

    /// Read `[from, ring start)` from the shard's log (the ring start may move while it
    /// reads: read on until the ring covers the rest), then register the watch and send its
    /// replay — log part, then ring part — in one step, so it joins live with no gap. A
    /// replay past the watch's bound stops there and the watch ends lagged at that offset.
    pub(in crate::core) fn start_log_replay(&mut self, req: WatchReq, from: u64) {
        let key = (req.cache, req.shard);
        let oc = self.caches.get(&key).expect("checked by the caller");
        let epoch = oc.epoch;
        let log = oc.logs.as_ref().expect("checked").cache.clone();
        let me = self.me.clone();
        glommio::spawn_local(async move {
            cache_logs::yield_once().await; // the caller holds the state
            let mut events: Vec<Arc<Ev>> = Vec::new();
            let (mut at, mut bytes, mut truncated) = (from, 0u64, None);
            loop {
                let need = {
                    let Some(st) = me.upgrade() else { return };
                    let mut st = st.borrow_mut();
                    let need = st.finish_log_replay(&req, epoch, &mut events, at, truncated);
                    if need.is_none() {
                        st.drain_inbox();
                        st.wake.wake();
                    }
                    need
                };
                let Some(ring_start) = need else { return };
                let recs = match log.read(at, 1024, 1 << 20).await {
                    Ok(r) => r,
                    Err(e) => {
                        let err = (
                            ErrorCode::Unavailable,
                            format!("reading the cache log: {e}"),
                        );
                        let opened = MeshMsg::Conn(ToConn::WatchOpened {
                            watch: req.watch,
                            result: Err(err.into()),
                        });
                        return reenter(&me, |st| st.route(req.core, opened));
                    }
                };
                if recs.is_empty() {
                    // Appended but not acknowledged yet: wait for the commit.
                    let _ = log.wait_acked_beyond(at).await;
                    continue;
                }
                for r in recs {
                    if r.offset >= ring_start {
                        break;
                    }
                    at = r.offset + 1;
                    let Ok(c) = crate::cache::record::decode(r.offset, r.key, r.flags, r.payload)
                    else {
                        continue; // a bad record fails the open, not a watch
                    };
                    if !req.filter.matches(&c.key) {
                        continue;
                    }
                    let frame = event_frame(c.offset, &c.key, &c.kind);
                    bytes += frame.len() as u64;
                    if events.len() >= req.events_max as usize || bytes > req.bytes_max {
                        truncated = Some(c.offset);
                        break;
                    }
                    events.push(Arc::new(Ev {
                        offset: c.offset,
                        key: c.key,
                        frame,
                    }));
                }
            }
        })
        .detach();
    }

    /// Finish a log replay if the ring now covers everything from `at` (or the replay is cut
    /// short); else the ring start to read up to.
    pub(in crate::core) fn finish_log_replay(
        &mut self,
        req: &WatchReq,
        epoch: u64,
        events: &mut Vec<Arc<Ev>>,
        at: u64,
        truncated: Option<u64>,
    ) -> Option<u64> {
        let key = (req.cache, req.shard);
        let served = self.catalog.cache_serve_check(req.cache, req.shard);
        let result = match (served, self.caches.get_mut(&key)) {
            (Err(e), _) => Err(e),
            (Ok(()), Some(oc)) if oc.epoch == epoch => {
                if truncated.is_none() && at < oc.replayable_from {
                    return Some(oc.replayable_from);
                }
                let next = oc.shard.next_offset();
                let mut replay = std::mem::take(events);
                if truncated.is_none() {
                    replay.extend(
                        oc.ring
                            .iter()
                            .filter(|e| e.offset >= at && req.filter.matches(&e.key))
                            .cloned(),
                    );
                    oc.watches.push(Reg {
                        core: req.core,
                        watch: req.watch,
                        filter: req.filter.clone(),
                    });
                }
                let WatchStart::Offset(from) = req.start else {
                    unreachable!("log replays are resumes")
                };
                Ok(Opened {
                    shard: req.shard,
                    live_from: next,
                    resume_from: from,
                    state: None,
                    replay,
                    truncated_at: truncated,
                })
            }
            (Ok(()), _) => Err((
                ErrorCode::Unavailable,
                "the cache shard closed while the watch was replaying its log".into(),
            )),
        }
        .map_err(Refusal::from);
        self.route(
            req.core,
            MeshMsg::Conn(ToConn::WatchOpened {
                watch: req.watch,
                result,
            }),
        );
        None
    }

    pub(in crate::core) fn on_watch_close(&mut self, watch: u64, cache: u32, shard: u32) {
        if let Some(oc) = self.caches.get_mut(&(cache, shard)) {
            oc.watches.retain(|r| r.watch != watch);
        }
    }

    /// When the owner must next reclaim expired keys, if any key expires.
    pub(in crate::core) fn cache_timeout(&self) -> Option<Duration> {
        let t = self
            .caches
            .values()
            .filter_map(|c| {
                c.shard
                    .next_expiry_ms()
                    .map(|t| t.max(c.expire_retry_at_ms))
            })
            .min()?;
        Some(Duration::from_millis(t.saturating_sub(wall_ms())))
    }

    /// Reclaim expired keys of the owned shards (each an Expire change watches see).
    pub(in crate::core) fn caches_tick(&mut self) {
        let now = wall_ms();
        let due: Vec<ShardKey> = self
            .caches
            .iter()
            .filter(|(_, c)| {
                c.expire_retry_at_ms <= now && c.shard.next_expiry_ms().is_some_and(|t| t <= now)
            })
            .map(|(k, _)| *k)
            .collect();
        // One commit must hold the batch: stay well under the log's commit bound.
        let batch_bytes_max = commit_bytes_max(&self.s.cfg) / 2;
        for key in due {
            let oc = self.caches.get_mut(&key).expect("due shard is owned");
            let mut changes = oc.shard.prepare_expire(now, EXPIRE_BATCH);
            if let Some(logs) = &oc.logs {
                let mut bytes = 0usize;
                let fit = changes
                    .iter()
                    .take_while(|c| {
                        bytes += felix_storage::record::HEADER_BYTES + c.key.len() + 1;
                        bytes <= batch_bytes_max
                    })
                    .count()
                    .max(1);
                changes.truncate(fit);
                let encoded: Vec<_> = changes.iter().map(crate::cache::record::encode).collect();
                let recs: Vec<RecordIn> = encoded
                    .iter()
                    .map(|(k, flags, p)| RecordIn {
                        key: k,
                        payload: p,
                        flags: *flags,
                    })
                    .collect();
                match logs.cache.append(&recs, now) {
                    Ok(r) => assert_eq!(r.start, changes[0].offset, "cache log and state agree"),
                    // Back-pressure (or a failing log, which fails the shard through its
                    // commit watcher): try again later rather than spin; reads already hide
                    // the expired values.
                    Err(_) => {
                        oc.expire_retry_at_ms = now + 100;
                        continue;
                    }
                }
            }
            for ch in &changes {
                oc.shard.apply(ch);
            }
            if oc.logs.is_some() {
                oc.since_snapshot += changes.len() as u64;
            }
            CoreCounters::add(&self.s.counters.cache_expired, changes.len() as u64);
            for ch in changes {
                self.emit(key, ch.offset, ch.key, &ch.kind);
            }
        }
    }
}

/// CacheGet: the key's current value (or `found: false`), read at the owner.
fn cache_value(oc: &OwnedCache, rid: u64, shard: u32, k: &Bytes, now: u64) -> Frame {
    let f = match oc.shard.get(k, now) {
        Some(e) => CacheFrame::CacheValue {
            request_id: rid,
            shard,
            found: true,
            version: e.version,
            change_offset: 0,
            expires_at_ms: e.expires_at_ms.unwrap_or(0),
            value: e.value.clone(),
        },
        None => CacheFrame::CacheValue {
            request_id: rid,
            shard,
            found: false,
            version: 0,
            change_offset: 0,
            expires_at_ms: 0,
            value: Bytes::new(),
        },
    };
    Frame::Cache(f)
}

/// CounterAdd: check, append (log-backed), then apply; the answer waits for the counter log's
/// commit when there is one.
fn counter_add(
    oc: &mut OwnedCache,
    rid: u64,
    shard: u32,
    name: Bytes,
    delta: i64,
    counters_max: usize,
    now: u64,
) -> (Frame, Option<Wait>) {
    let now_frame = |f: Frame| (f, None);
    if !oc.counters.contains(&name) && oc.counters.len() >= counters_max {
        return now_frame(Frame::error(
            rid,
            ErrorCode::CacheFull,
            format!(
                "shard holds {} counters (cache_entries_max)",
                oc.counters.len()
            ),
        ));
    }
    let (offset, sum) = match oc.counters.prepare_add(&name, delta) {
        Ok(x) => x,
        Err(e) => return now_frame(Frame::error(rid, ErrorCode::InvalidRequest, e.to_string())),
    };
    if let Some(logs) = &oc.logs {
        let d = delta.to_le_bytes();
        let rec = RecordIn {
            key: &name,
            payload: &d,
            flags: 0,
        };
        match logs.counters.append(&[rec], now) {
            Ok(r) => assert_eq!(r.start, offset, "counter log and state agree"),
            Err(e) => {
                let (code, msg) = cache_logs::append_refusal(&e);
                return now_frame(Frame::error(rid, code, msg));
            }
        }
    }
    oc.counters.apply(offset, name, delta);
    let f = Frame::Cache(CacheFrame::CounterValue {
        request_id: rid,
        shard,
        sum,
        offset,
    });
    let wait = oc.logs.as_ref().map(|_| Wait {
        counters: true,
        upto: offset + 1,
    });
    (f, wait)
}

//! Cutting a suffix of the log: how a replica drops records a new leader does not have
//! (replication rule 6, `docs/replication-design.md`). Until now only recovery cut anything,
//! and only a torn tail.
//!
//! The cut must leave, at every instant, files that open as a log holding at least the
//! records below the cut, intact: a crash part-way leaves a longer log, and the replica cuts
//! again after the restart, since it compares its log with the leader's anew. So the steps
//! go from the end backwards, each one making the files a shorter valid log:
//! 1. remove the segments wholly at or past the cut, newest first (each removal leaves a
//!    prefix; an index left without its segment is an orphan that open removes);
//! 2. remove the index of the segment the cut falls in, if it was sealed (it becomes the
//!    active segment, which open scans instead of trusting an index);
//! 3. cut that segment's file after the commit the cut falls in, and fdatasync;
//! 4. if the cut falls inside that commit, rewrite the commit in place with only the records
//!    below the cut (same header length, so they stay where they are; the rest of its blocks
//!    zeroed), cut the file after it, and fdatasync.
//!
//! [`Log::restart_at`] (a follower rebuilt from its leader's base) is a cut to the oldest
//! offset followed by step 6: the one empty segment left is replaced by one at the new base.
//!
//! Step 4 rewrites a block that holds records below the cut. A write is only torn by a
//! machine crash (power loss), and a machine crash rotates the directory's storage identity
//! (rule 9), so no replica is counted on what such a crash could damage. A process crash
//! leaves the write either done or not done: both are valid logs. Each step is a
//! [`FaultPoint::Truncate`] point, and `storage/tests/log_truncate.rs` stops a cut at every
//! one and reopens.

use super::*;

impl Log {
    /// Cut every record at offset `to` and after: `to` becomes the next offset, and the
    /// next append (in any generation not older than the newest remaining record's) takes
    /// it. Waits for what is queued to be written first; appends meanwhile get
    /// [`LogError::Truncating`], and every wait for an acknowledgement that is in progress
    /// ends with [`LogError::Truncated`]. `to` must be at or above the oldest offset and at
    /// or below the next one.
    ///
    /// An I/O error fails the log (its files are then a valid log holding at least the
    /// records below `to`: reopen it and cut again).
    pub async fn truncate_from(&self, to: u64) -> Result<(), LogError> {
        {
            let mut i = self.inner.borrow_mut();
            i.writable()?;
            let oldest = i.segs.front().map(|s| s.base).unwrap_or(i.next_offset);
            if to < oldest {
                return Err(LogError::BelowRetention {
                    requested: to,
                    oldest,
                });
            }
            if to > i.next_offset {
                return Err(LogError::BeyondTail {
                    requested: to,
                    tail: i.next_offset,
                });
            }
            // The segment the cut falls in (the last one starting below `to`, or the oldest).
            let k = i.segs.partition_point(|s| s.base < to).saturating_sub(1);
            if let Some(s) = i.segs.get(k) {
                if s.end_offset > to && s.version < FORMAT_VERSION {
                    return Err(LogError::CannotTruncate(format!(
                        "offset {to} is inside segment {} of format version {}, which has no generations (it was never replicated)",
                        s.base, s.version
                    )));
                }
            }
            i.truncating = true;
        }
        let r = self.cut(to).await;
        let mut i = self.inner.borrow_mut();
        i.truncating = false;
        match r {
            Ok(()) => Ok(()),
            Err(e) => {
                // Memory and files may disagree now: no more acknowledgements until reopened.
                i.fail(format!("truncation to {to} failed: {e}"));
                Err(e)
            }
        }
    }

    /// Drop every record and go on at `base`, at or past the next offset: the next append
    /// takes `base`, and the log holds nothing below it. This is how a follower whose
    /// history its leader no longer holds is rebuilt from the leader's base (replication
    /// rule 10, `docs/replication-design.md`).
    ///
    /// Crash-safe at every step: first a cut to the oldest offset (newest segments first, as
    /// [`Log::truncate_from`] does), which leaves one empty segment; then that segment's file
    /// is removed (step 6) and one at `base` created. A crash part-way leaves a prefix of the
    /// old log, or an empty one (at the old oldest offset, or at
    /// [`LogConfig::first_offset`] when no file is left), never records at other offsets
    /// than they had: the replica compares with its leader anew and is rebuilt again.
    pub async fn restart_at(&self, base: u64) -> Result<(), LogError> {
        let (oldest, next) = {
            let i = self.inner.borrow();
            i.writable()?;
            let oldest = i.segs.front().map(|s| s.base).unwrap_or(i.next_offset);
            (oldest, i.next_offset)
        };
        if base < next {
            return Err(LogError::CannotTruncate(format!(
                "a log cannot restart at {base}, below its next offset {next}"
            )));
        }
        self.truncate_from(oldest).await?;
        self.inner.borrow_mut().truncating = true;
        let r = self.swap_empty_segment(base).await;
        let mut i = self.inner.borrow_mut();
        i.truncating = false;
        match r {
            Ok(()) => {
                i.next_offset = base;
                i.written = base;
                i.synced = base;
                i.newest_gen = None;
                i.truncations += 1;
                i.truncated_to = base;
                i.wake_all();
                debug_assert_eq!(i.segs.len(), 1);
                Ok(())
            }
            Err(e) => {
                i.fail(format!("restarting the log at {base} failed: {e}"));
                Err(e)
            }
        }
    }

    /// [`Log::restart_at`]'s second half: the one segment left, empty, is replaced by an empty
    /// one at `base`.
    async fn swap_empty_segment(&self, base: u64) -> Result<(), LogError> {
        let (old, dir) = {
            let i = self.inner.borrow();
            let s = i.segs.back().expect("a log has a segment");
            assert!(
                i.segs.len() == 1 && s.end_offset == s.base,
                "a cut to the oldest offset leaves one empty segment"
            );
            (s.base, i.dir.clone())
        };
        if old == base {
            return Ok(());
        }
        self.inner.borrow().fault(FaultPoint::Truncate(6))?;
        let seg = self.inner.borrow_mut().segs.pop_back();
        if let Some(w) = seg
            .and_then(|s| s.wfile)
            .and_then(|w| Rc::try_unwrap(w).ok())
        {
            let _ = w.close().await;
        }
        std::fs::remove_file(dir.join(segment_file_name(old)))
            .map_err(|e| io_err("remove the emptied segment", e))?;
        match std::fs::remove_file(dir.join(index_file_name(old))) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(io_err("remove the index of the emptied segment", e))
            }
            _ => {}
        }
        sync_dir(&dir)?;
        self.create_segment(base).await
    }

    async fn cut(&self, to: u64) -> Result<(), LogError> {
        self.wait_written().await?;
        if self.inner.borrow().written == to {
            return Ok(());
        }
        let dir = self.inner.borrow().dir.clone();
        // Step 1: whole segments, newest first. The oldest segment always stays.
        loop {
            let victim = {
                let i = self.inner.borrow();
                let n = i.segs.len();
                let last = i.segs.back().expect("a log has a segment");
                (n > 1 && last.base >= to).then_some(last.base)
            };
            let Some(base) = victim else { break };
            self.inner.borrow().fault(FaultPoint::Truncate(1))?;
            std::fs::remove_file(dir.join(segment_file_name(base)))
                .map_err(|e| io_err("remove a segment past the cut", e))?;
            match std::fs::remove_file(dir.join(index_file_name(base))) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(io_err("remove the index of a segment past the cut", e))
                }
                _ => {}
            }
            let seg = self.inner.borrow_mut().segs.pop_back();
            if let Some(w) = seg
                .and_then(|s| s.wfile)
                .and_then(|w| Rc::try_unwrap(w).ok())
            {
                let _ = w.close().await;
            }
        }
        sync_dir(&dir)?;
        let (base, end_offset, sealed, version, file) = {
            let i = self.inner.borrow();
            let s = i.segs.back().expect("a log has a segment");
            (s.base, s.end_offset, s.sealed, s.version, s.file.clone())
        };
        if end_offset > to {
            assert_eq!(
                version, FORMAT_VERSION,
                "truncate_from refuses a cut in an old segment"
            );
            // Step 2: the segment becomes the active one.
            if sealed {
                self.inner.borrow().fault(FaultPoint::Truncate(2))?;
                std::fs::remove_file(dir.join(index_file_name(base)))
                    .map_err(|e| io_err("remove the index of the segment being cut", e))?;
                sync_dir(&dir)?;
                self.inner.borrow_mut().segs.back_mut().unwrap().sealed = false;
            }
            self.cut_segment(&file, base, to).await?;
        }
        let mut i = self.inner.borrow_mut();
        i.next_offset = to;
        i.written = to;
        i.synced = i.synced.min(to);
        i.newest_gen = i
            .segs
            .iter()
            .rev()
            .find_map(|s| s.gens.last())
            .map(|r| r.gen);
        i.truncations += 1;
        i.truncated_to = to;
        i.wake_all();
        Ok(())
    }

    /// Wait until every queued record is written (the committer is then idle: appends are
    /// refused while `truncating` is set, so nothing new arrives).
    async fn wait_written(&self) -> Result<(), LogError> {
        poll_fn(|cx| {
            let mut i = self.inner.borrow_mut();
            if let Some(f) = &i.failed {
                return Poll::Ready(Err(LogError::Failed(f.clone())));
            }
            if i.written == i.next_offset {
                return Poll::Ready(Ok(()));
            }
            if i.committer_done {
                return Poll::Ready(Err(LogError::Closed));
            }
            i.waiters.push(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Steps 3 and 4 on the segment `base` (the last one, active), whose records go past
    /// `to`; then its in-memory facts are rebuilt from a scan of what is left.
    async fn cut_segment(&self, file: &Rc<DmaFile>, base: u64, to: u64) -> Result<(), LogError> {
        let (from_pos, end_pos) = {
            let i = self.inner.borrow();
            let s = i.segs.back().unwrap();
            let floor = s.index.partition_point(|e| e.offset <= to);
            let from = floor
                .checked_sub(1)
                .map(|j| s.index[j].pos)
                .unwrap_or(BLOCK as u64);
            (from, s.end_pos)
        };
        let bytes = file
            .read_at(from_pos, (end_pos - from_pos) as usize)
            .await
            .map_err(|e| io_err("read the segment being cut", e))?;
        // The commit holding `to`, or starting at it.
        let mut rel = 0usize;
        let (pos, h) = loop {
            let h = CommitHeader::decode_at(&bytes, rel).ok_or_else(|| LogError::Corrupt {
                segment: base,
                pos: from_pos + rel as u64,
                why: "bad commit header while looking for the cut".into(),
            })?;
            if to < h.first_offset + h.count as u64 {
                assert!(
                    to >= h.first_offset,
                    "the index floor is at or before the cut"
                );
                break (rel, h);
            }
            rel = align_up(rel + h.span());
        };
        let commit_pos = from_pos + pos as u64;
        let commit_blocks = align_up(h.span()) as u64;
        // Step 3: everything after this commit goes.
        self.inner.borrow().fault(FaultPoint::Truncate(3))?;
        file.truncate(commit_pos + commit_blocks)
            .await
            .map_err(|e| io_err("cut the segment", e))?;
        file.fdatasync()
            .await
            .map_err(|e| io_err("sync the cut segment", e))?;
        let keep = (to - h.first_offset) as u32;
        let new_len = if keep == 0 {
            commit_pos
        } else {
            // Step 4: the same commit with only the records below the cut.
            let body = &bytes[pos + h.header_bytes()..pos + h.span()];
            let (records_bytes, max_ts_ms) =
                kept_prefix(body, h.first_offset, keep).ok_or_else(|| LogError::Corrupt {
                    segment: base,
                    pos: commit_pos,
                    why: "a record of the commit being cut does not decode".into(),
                })?;
            let mut nh = h;
            nh.count = keep;
            nh.records_bytes = records_bytes;
            nh.max_ts_ms = max_ts_ms;
            let mut buf = file.alloc_dma_buffer(commit_blocks as usize);
            let out = buf.as_bytes_mut();
            out.fill(0);
            nh.write_to(&mut out[..nh.header_bytes()]);
            out[nh.header_bytes()..nh.span()].copy_from_slice(&body[..records_bytes as usize]);
            self.inner.borrow().fault(FaultPoint::Truncate(4))?;
            let n = file
                .write_at(buf, commit_pos)
                .await
                .map_err(|e| io_err("rewrite the commit being cut", e))?;
            if n != commit_blocks as usize {
                return Err(LogError::Io(format!(
                    "short rewrite of the commit being cut: {n} of {commit_blocks} bytes"
                )));
            }
            commit_pos + align_up(nh.span()) as u64
        };
        self.inner.borrow().fault(FaultPoint::Truncate(5))?;
        file.truncate(new_len)
            .await
            .map_err(|e| io_err("cut the segment", e))?;
        file.fdatasync()
            .await
            .map_err(|e| io_err("sync the cut segment", e))?;
        // What is left, scanned like the active segment at open.
        let interval = self.inner.borrow().cfg.index_interval_bytes;
        let all = read_all(file, new_len).await?;
        let scan = crate::segment::scan_segment(&all, base, interval);
        if scan.end != crate::segment::ScanEnd::Clean || scan.end_offset != to {
            return Err(LogError::Corrupt {
                segment: base,
                pos: scan.end_pos,
                why: format!(
                    "after the cut to {to} the segment scans to {} ({:?})",
                    scan.end_offset, scan.end
                ),
            });
        }
        let mut i = self.inner.borrow_mut();
        let s = i.segs.back_mut().unwrap();
        s.end_offset = scan.end_offset;
        s.end_pos = scan.end_pos;
        s.write_pos = align_up(scan.end_pos as usize) as u64;
        s.max_ts_ms = scan.max_ts_ms;
        s.index = scan.index;
        s.gens = scan.gens;
        Ok(())
    }
}

/// The first `keep` records of a commit's record bytes `body` (offsets from `first`): their
/// length in bytes and largest timestamp; `None` if one does not decode.
fn kept_prefix(body: &[u8], first: u64, keep: u32) -> Option<(u32, u64)> {
    let mut p = 0usize;
    let mut max_ts = 0u64;
    for k in 0..keep as u64 {
        let r = crate::record::decode_at(body, p).ok()?;
        if r.offset != first + k {
            return None;
        }
        max_ts = max_ts.max(r.ts_ms);
        p += r.len;
    }
    Some((u32::try_from(p).ok()?, max_ts))
}

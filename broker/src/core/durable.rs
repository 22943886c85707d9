//! Durable stream shards on this core: their directories, opening their logs (deferring what
//! arrives meanwhile), the commit watcher that answers publishes once committed, and failures.

use super::shard::stream::OpenOutcome;
use super::*;

/// Replace `dir/name` with `bytes` atomically and durably: write a temporary file beside it,
/// fdatasync it, rename it over the old one, and fsync the directory (so the rename itself
/// survives a machine crash). A reader sees the old file or the new one, never a mix. Blocking:
/// run it on the blocking pool.
pub(crate) fn atomic_write(dir: &std::path::Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = dir.join(format!("{name}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_data()?;
    std::fs::rename(&tmp, dir.join(name))?;
    std::fs::File::open(dir)?.sync_all()
}

/// The log directory of one durable shard of the standalone catalog.
pub fn shard_dir(
    root: &std::path::Path,
    name: &felix_quic::wire::StreamName,
    shard: u32,
) -> std::path::PathBuf {
    slot_shard_dir(root, name, 0, shard)
}

/// The log directory of one shard of a stream incarnation (see [`stream_dir`]).
pub(in crate::core) fn slot_shard_dir(
    root: &std::path::Path,
    name: &felix_quic::wire::StreamName,
    incarnation: u64,
    shard: u32,
) -> std::path::PathBuf {
    stream_dir(root, name, incarnation).join(format!("{shard:05}"))
}

/// Close a deleted shard's log (if open) and remove its directory, then the stream's
/// directory once it is empty (removing it fails while another core's shard is still there).
pub(in crate::core) fn remove_deleted_shard(
    log: Option<Log>,
    root: Option<std::path::PathBuf>,
    slot: &Slot,
    shard: u32,
) {
    let name = slot.def.name();
    let incarnation = slot.incarnation;
    glommio::spawn_local(async move {
        if let Some(log) = log {
            let _ = log.close().await;
        }
        let Some(root) = root else { return };
        let dir = slot_shard_dir(&root, &name, incarnation, shard);
        // Off the executor: removing a directory tree blocks.
        let _ = glommio::executor()
            .spawn_blocking(move || remove_shard_dir(&dir))
            .await;
    })
    .detach();
}

/// Remove a deleted shard's directory (stream or cache), then its parent — the stream's or
/// cache's directory — once that is empty (removing it fails while another core's shard is
/// still there). Blocking: run it on the blocking pool.
pub(in crate::core) fn remove_shard_dir(dir: &std::path::Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot remove a deleted shard's logs");
        }
    }
    if let Some(parent) = dir.parent() {
        let _ = std::fs::remove_dir(parent);
    }
}

/// A stream's directory: `tenant/namespace/stream`, and for a control-plane stream
/// `tenant/namespace/stream@incarnation` (`@` is outside the name charset), so a stream
/// deleted and created again never reads the old incarnation's records.
pub fn stream_dir(
    root: &std::path::Path,
    name: &felix_quic::wire::StreamName,
    incarnation: u64,
) -> std::path::PathBuf {
    let ns = root.join(&name.tenant).join(&name.namespace);
    if incarnation == 0 {
        ns.join(&name.stream)
    } else {
        ns.join(format!("{}@{incarnation}", name.stream))
    }
}

/// Remove directories of older incarnations of a stream (deleted while this broker was
/// down). Errors are ignored: another core may be removing the same directory. Blocking: run
/// it on the blocking pool.
pub(in crate::core) fn remove_older_incarnations(root: &std::path::Path, slot: &Slot) {
    let name = slot.def.name();
    let ns = root.join(&name.tenant).join(&name.namespace);
    let Ok(rd) = std::fs::read_dir(&ns) else {
        return;
    };
    let prefix = format!("{}@", name.stream);
    for e in rd.flatten() {
        let f = e.file_name().to_string_lossy().to_string();
        let Some(inc) = f.strip_prefix(&prefix).and_then(|n| n.parse::<u64>().ok()) else {
            continue;
        };
        if inc < slot.incarnation {
            tracing::info!(stream = %name, incarnation = inc, "removing the logs of a deleted incarnation");
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

pub(in crate::core) fn commit_bytes_max(cfg: &Config) -> usize {
    let seg = cfg.durable_segment_bytes as usize - 2 * felix_storage::segment::BLOCK;
    cfg.max_frame_bytes
        .saturating_mul(4)
        .min(seg)
        .min(256 << 20)
}

/// The storage settings of a durable stream (its own, else the broker's defaults).
pub fn log_config(cfg: &Config, def: &crate::catalog::StreamDef) -> LogConfig {
    let mode = def.fsync.as_deref().unwrap_or(&cfg.durable_fsync);
    LogConfig {
        segment_bytes_max: cfg.durable_segment_bytes,
        // A frame's records grow on disk (24 more header bytes per record): allow 4x the
        // frame, within the segment. A batch beyond it is refused `payload_too_large`.
        commit_bytes_max: commit_bytes_max(cfg),
        pending_bytes_max: cfg.durable_pending_bytes_max.max(commit_bytes_max(cfg)),
        fsync: FsyncMode::parse(mode, cfg.durable_fsync_interval_ms).expect("validated at start"),
        retention: felix_storage::retention::RetentionLimits {
            bytes_max: def.retention_bytes.or(cfg.durable_retention_bytes),
            age_max_ms: def
                .retention_seconds
                .or(cfg.durable_retention_seconds)
                .map(|s| s.saturating_mul(1000)),
        },
        inline_write_slow_us: cfg.durable_inline_write_slow_us,
        ..LogConfig::default()
    }
}

/// Open the logs of the durable shards this core owns (before serving, standalone). A log
/// that cannot be opened (refused: corruption in the middle, or an I/O error) leaves its
/// shard failed: it answers `unavailable`, the rest serve.
pub(in crate::core) async fn open_durable_shards(state: &Rc<RefCell<CoreState>>) {
    let keys: Vec<ShardKey> = {
        let mut st = state.borrow_mut();
        let keys = st.durable_keys_to_open();
        for k in &keys {
            st.streams.begin_open(*k);
        }
        keys
    };
    for key in keys {
        let job = state.borrow().open_job(key);
        let r = job.run().await;
        state.borrow_mut().on_durable_opened(key, r);
    }
}

/// Everything needed to open one durable shard's log off the core state.
pub(in crate::core) struct OpenJob {
    root: Option<std::path::PathBuf>,
    slot: Slot,
    shard: u32,
    config: LogConfig,
}

impl OpenJob {
    pub(in crate::core) async fn run(self) -> OpenResult {
        let Some(root) = self.root else {
            return Err("no durable storage directory is configured on this broker (durable_storage_dir / FELIX_DURABLE_STORAGE_DIR)".into());
        };
        if self.slot.incarnation != 0 {
            // Off the executor: removing a directory tree blocks.
            let (r, slot) = (root.clone(), self.slot.clone());
            let _ = glommio::executor()
                .spawn_blocking(move || remove_older_incarnations(&r, &slot))
                .await;
        }
        let dir = slot_shard_dir(
            &root,
            &self.slot.def.name(),
            self.slot.incarnation,
            self.shard,
        );
        Log::open(&dir, self.config)
            .await
            .map_err(|e| e.to_string())
    }
}

pub(in crate::core) type OpenResult = Result<(Log, felix_storage::log::OpenReport), String>;

/// Follow a log's commits from `seen` on: `on_acked` with each new acknowledged end, then
/// `on_failed` once when the log fails (or closes), each back on the core. The one commit
/// watcher of durable stream shards and of log-backed cache shards (two copies before).
pub(in crate::core) async fn watch_commits(
    state: Weak<RefCell<CoreState>>,
    log: Log,
    mut seen: u64,
    mut on_acked: impl FnMut(&mut CoreState, u64),
    on_failed: impl FnOnce(&mut CoreState, String),
) {
    loop {
        let r = log.wait_acked_beyond(seen).await;
        match r {
            Ok(acked) => {
                seen = acked;
                reenter(&state, |st| on_acked(st, acked));
            }
            Err(e) => {
                reenter(&state, |st| on_failed(st, e.to_string()));
                return;
            }
        }
        if state.upgrade().is_none() {
            return;
        }
    }
}

impl CoreState {
    /// Durable shards of active streams placed on this broker, owned by this core, whose
    /// log is not open or opening yet.
    pub(in crate::core) fn durable_keys_to_open(&self) -> Vec<ShardKey> {
        self.streams.to_open(&self.catalog, self.id, self.s.cores)
    }

    pub(in crate::core) fn open_job(&self, key: ShardKey) -> OpenJob {
        let slot = self.catalog.slot(key.0).clone();
        OpenJob {
            root: self.s.cfg.durable_storage_dir.clone(),
            config: self.observed(log_config(&self.s.cfg, &slot.def)),
            slot,
            shard: key.1,
        }
    }

    pub(in crate::core) fn on_durable_opened(&mut self, key: ShardKey, r: OpenResult) {
        let name = self.catalog.slot(key.0).def.name();
        let metrics = self.s.shard_metrics.clone();
        let r = r.map(|(log, report)| {
            tracing::info!(stream = %name, shard = key.1, next_offset = report.next_offset,
                oldest = report.oldest_offset, verdict = ?report.verdict, "durable shard open");
            (log, report.next_offset)
        });
        let why = r.as_ref().err().cloned();
        let hist = || metrics.register(name.to_string(), key.1);
        match self.with_streams(|h, _| h.on_opened(key, r, hist)) {
            OpenOutcome::Serving { next_offset } => {
                self.load_groups(key, next_offset);
                let log = self.streams.log(key).expect("open").clone();
                let seen = log.acked();
                glommio::spawn_local(watch_commits(
                    self.me.clone(),
                    log,
                    seen,
                    move |st, acked| st.on_durable_acked(key, acked),
                    move |st, why| st.on_durable_failed(key, why),
                ))
                .detach();
            }
            OpenOutcome::Failed => {
                let e = why.unwrap_or_default();
                tracing::error!(stream = %name, shard = key.1, error = %e, "durable shard cannot open; it will answer unavailable");
                CoreCounters::inc(&self.s.counters.durable_shards_failed);
            }
            // Deleted while opening: close it and remove what the open (re)created.
            OpenOutcome::Unwanted(Some(log)) => remove_deleted_shard(
                Some(log),
                self.s.cfg.durable_storage_dir.clone(),
                self.catalog.slot(key.0),
                key.1,
            ),
            OpenOutcome::Unwanted(None) => {}
        }
    }

    /// Publishes, attaches, detaches, park notices and group requests for a durable shard
    /// whose log is still opening wait in arrival order (per sender) and are handled once it
    /// is open or failed; anything else is handed back.
    pub(in crate::core) fn defer_while_opening(&mut self, msg: MeshMsg) -> Option<MeshMsg> {
        match msg.waits_for_open() {
            Some(key) => self.streams.defer(key, msg),
            None => Some(msg),
        }
    }

    pub(in crate::core) fn on_durable_acked(&mut self, key: ShardKey, acked: u64) {
        self.with_streams(|h, ctx| h.on_acked(key, acked, ctx));
    }

    pub(in crate::core) fn on_durable_failed(&mut self, key: ShardKey, why: String) {
        self.with_streams(|h, ctx| h.on_failed(key, why, ctx));
    }
}

#[cfg(test)]
mod tests {
    use super::atomic_write;

    #[test]
    fn atomic_write_replaces_whole_and_leaves_no_temporary() {
        let d = tempfile::tempdir().unwrap();
        atomic_write(d.path(), "f.grp", b"one").unwrap();
        atomic_write(d.path(), "f.grp", b"second").unwrap();
        assert_eq!(std::fs::read(d.path().join("f.grp")).unwrap(), b"second");
        let names: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("f.grp")]);
        assert!(atomic_write(&d.path().join("missing"), "f", b"x").is_err());
    }
}

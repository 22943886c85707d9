//! The log driver: one [`Log`] per shard, living on the glommio executor of the core that
//! owns the shard. Files are glommio DMA files (io_uring, O_DIRECT); under `periodic` and
//! `none` commits are written through the page cache instead (see [`CommitBuf`] and
//! docs/storage-format.md, "How a commit reaches the file").
//!
//! - [`Log::append`] is synchronous: it assigns offsets and queues the encoded records. A
//!   committer task writes queued records as one commit (group commit: whatever queued while
//!   the previous write was in flight goes in the next one), one write in flight at a time.
//! - An offset is *acknowledged* ([`Log::acked`]) once its commit's write completed, and under
//!   [`FsyncMode::OnCommit`] once the fdatasync after it completed too. Nothing is ever
//!   acknowledged from a user-space buffer, so every acknowledged record survives a process
//!   crash; `Periodic` and `None` may lose what a machine crash loses.
//! - A write or fdatasync error fails the log: pending and later appends get
//!   [`LogError::Failed`], nothing after the failure is acknowledged, until it is reopened.
//! - Each append call lands in one commit (an append larger than `commit_bytes_max` is
//!   refused), so recovery keeps or cuts a batch whole.
//! - Every record carries the generation it was appended in ([`Log::append_in`]; replication
//!   rule 6), in its commit's header; generations never decrease along the log. A replica
//!   cuts a divergent suffix with [`Log::truncate_from`] (`log/truncate.rs`).

mod truncate;

use crate::record::{encode_into, RecordIn, RECORD_BYTES_MAX};
use crate::recovery::{
    must_scan, plan_recovery, Action, Active, DiskView, Plan, SegmentView, Verdict,
};
use crate::retention::{segments_below, segments_to_delete, RetentionLimits, SegmentFacts};
use crate::segment::{
    align_up, gen_in_runs, index_file_name, parse_file_name, push_gen_run, segment_file_name,
    CommitHeader, GenRun, IndexEntry, SegmentHeader, SegmentIndex, BLOCK, COMMIT_HEADER_BYTES,
    COMMIT_HEADER_V1_BYTES, FORMAT_VERSION,
};
use crate::write_path::{Backoff, NoWait, WritePath, WriteWay};
use bytes::Bytes;
use glommio::io::{BufferedFile, DmaFile, OpenOptions};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::poll_fn;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::Duration;

/// When appended data is fdatasynced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsyncMode {
    /// fdatasync each commit before acknowledging it.
    OnCommit,
    /// fdatasync every `interval_ms` (acknowledged after the write).
    Periodic { interval_ms: u64 },
    /// Never fdatasync except when a segment is sealed or the log closes.
    None,
}

impl FsyncMode {
    pub fn parse(s: &str, interval_ms: u64) -> Result<FsyncMode, String> {
        match s {
            "on_commit" => Ok(FsyncMode::OnCommit),
            "periodic" => Ok(FsyncMode::Periodic { interval_ms }),
            "none" => Ok(FsyncMode::None),
            _ => Err(format!(
                "fsync mode {s:?}: expected on_commit, periodic or none"
            )),
        }
    }
    pub fn name(&self) -> &'static str {
        match self {
            FsyncMode::OnCommit => "on_commit",
            FsyncMode::Periodic { .. } => "periodic",
            FsyncMode::None => "none",
        }
    }
}

/// Where a fault may be injected (tests only: see [`LogConfig::faults`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultPoint {
    Write,
    Sync,
    CreateSegment,
    /// Before step `n` of a truncation (`log/truncate.rs` numbers them): a failure there
    /// leaves the files as a crash at that point would.
    Truncate(u8),
}

/// A fault hook: return `Some(errno)` to make the operation fail as the device would.
pub type FaultHook = Rc<dyn Fn(FaultPoint) -> Option<i32>>;

/// Told the duration of every data fdatasync of the log (commit, periodic, seal),
/// microseconds: how a broker measures fsync latency without the log knowing its metrics.
pub type SyncObserver = Rc<dyn Fn(u64)>;

#[derive(Clone)]
pub struct LogConfig {
    /// Roll to a new segment before a commit would take the active one past this.
    pub segment_bytes_max: u64,
    /// Largest single commit (one write); also the largest single append.
    pub commit_bytes_max: usize,
    /// Queued-but-unwritten bytes beyond which appends are refused ([`LogError::Backpressure`]).
    pub pending_bytes_max: usize,
    /// Sparse index spacing.
    pub index_interval_bytes: u32,
    pub fsync: FsyncMode,
    pub retention: RetentionLimits,
    /// The offset an empty log starts at.
    pub first_offset: u64,
    /// Retention and [`Log::delete_below`] delete no segment holding an offset at or above
    /// this (replication rule 10: trims stop at the commit mark). In force from open, before
    /// any sweep; [`Log::set_retention_hold`] moves it. `None`: no hold.
    pub retention_hold: Option<u64>,
    /// Fault injection hook for device-error tests. `None` in production.
    pub faults: Option<FaultHook>,
    /// Fsync latency observer (metrics).
    pub on_sync: Option<SyncObserver>,
    /// Where the filesystem refuses RWF_NOWAIT, page-cache commits (`periodic`, `none`) of
    /// up to 256 KiB are written with a plain `pwrite` on the core while such writes take at
    /// most this long, microseconds; after a slower one every commit of the core goes through
    /// io_uring for [`INLINE_WRITE_BACKOFF_MS`]. 0: always io_uring. See
    /// [`crate::write_path`].
    pub inline_write_slow_us: u64,
}

/// How long page-cache commits go through io_uring after an inline write was slow.
pub const INLINE_WRITE_BACKOFF_MS: u64 = 1000;

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            segment_bytes_max: 64 << 20,
            commit_bytes_max: 4 << 20,
            pending_bytes_max: 32 << 20,
            index_interval_bytes: 64 << 10,
            fsync: FsyncMode::Periodic { interval_ms: 250 },
            retention: RetentionLimits::default(),
            first_offset: 0,
            retention_hold: None,
            faults: None,
            on_sync: None,
            inline_write_slow_us: 1000,
        }
    }
}

impl LogConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.commit_bytes_max < BLOCK || self.commit_bytes_max > 256 << 20 {
            return Err(format!(
                "commit_bytes_max {} must be 4096..=256 MiB",
                self.commit_bytes_max
            ));
        }
        if self.segment_bytes_max < (self.commit_bytes_max + 2 * BLOCK) as u64
            || self.segment_bytes_max > 1 << 32
        {
            return Err(format!(
                "segment_bytes_max {} must be at least commit_bytes_max + 8192 and at most 4 GiB",
                self.segment_bytes_max
            ));
        }
        if self.pending_bytes_max < self.commit_bytes_max {
            return Err("pending_bytes_max must be at least commit_bytes_max".into());
        }
        if let FsyncMode::Periodic { interval_ms } = self.fsync {
            if interval_ms == 0 {
                return Err("fsync interval must be > 0 ms".into());
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LogError {
    #[error("storage failed: {0}")]
    Failed(String),
    #[error("log refused at open: segment {segment}, byte {pos}: {reason}")]
    Refused {
        segment: u64,
        pos: u64,
        reason: String,
    },
    #[error("append of {bytes} bytes exceeds the limit of {max}")]
    TooLarge { bytes: usize, max: usize },
    #[error("{pending_bytes} bytes already wait to be written")]
    Backpressure { pending_bytes: usize },
    #[error("offset {requested} is below retention; oldest retained offset is {oldest}")]
    BelowRetention { requested: u64, oldest: u64 },
    #[error("offset {requested} is beyond the tail {tail}")]
    BeyondTail { requested: u64, tail: u64 },
    #[error("corrupt record in segment {segment} at byte {pos}: {why}")]
    Corrupt { segment: u64, pos: u64, why: String },
    #[error("log is closed")]
    Closed,
    #[error("generation {gen} is older than the log's newest record's ({newest}); generations never decrease along a log")]
    GenerationBehind { gen: u64, newest: u64 },
    #[error("the log is cutting a suffix; append again once it is done")]
    Truncating,
    /// The records a wait was for were cut by [`Log::truncate_from`]: they will never be
    /// acknowledged (offsets from `to` on are assigned again).
    #[error("the log was truncated to offset {to}; what was waited for is gone")]
    Truncated { to: u64 },
    #[error("cannot truncate: {0}")]
    CannotTruncate(String),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("i/o: {0}")]
    Io(String),
}

fn io_err(what: &str, e: impl std::fmt::Display) -> LogError {
    LogError::Io(format!("{what}: {e}"))
}

/// A record read back from the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredRecord {
    pub offset: u64,
    /// The generation the record was appended in (0 for a log never replicated).
    pub gen: u64,
    pub ts_ms: u64,
    pub flags: u8,
    pub key: Bytes,
    pub payload: Bytes,
}

/// What opening found and did.
#[derive(Debug, Clone)]
pub struct OpenReport {
    pub verdict: Verdict,
    pub actions: Vec<Action>,
    pub next_offset: u64,
    pub oldest_offset: u64,
    pub segments: usize,
}

struct Seg {
    base: u64,
    file: Rc<DmaFile>,
    /// The same segment file opened without O_DIRECT: how commits are written under
    /// `periodic` and `none` (opened at the first such commit, closed at seal).
    wfile: Option<Rc<BufferedFile>>,
    end_offset: u64,
    end_pos: u64,
    write_pos: u64,
    max_ts_ms: u64,
    index: Vec<IndexEntry>,
    /// The generations of the segment's written records.
    gens: Vec<GenRun>,
    /// The segment header's format version.
    version: u16,
    sealed: bool,
}

/// One commit's bytes: a DMA buffer written with O_DIRECT (`on_commit`: the write then the
/// fdatasync reach the device before the ack), or a plain buffer written through the page
/// cache (`periodic`, `none`: the ack follows the write into the file, which survives a
/// process crash; the periodic fdatasync of the same inode makes it durable). Why two:
/// an O_DIRECT write waits for the device (~0.4 ms per commit on this VM), which made every
/// `periodic` ack pay a device round trip that the mode does not promise
/// (bench-results/2026-12-04-matrix.md).
enum CommitBuf {
    Direct(glommio::io::DmaBuffer),
    Cached(Vec<u8>),
}

/// `pwritev2(.., RWF_NOWAIT)`: the bytes of `buf` written at `pos` without blocking
/// (`Wrote(0)` when the kernel would have to wait), or `Unsupported` (remembered for the
/// thread) when the filesystem refuses such writes.
fn write_nowait(fd: std::os::fd::RawFd, buf: &[u8], pos: u64) -> NoWait {
    if NOWAIT_UNSUPPORTED.with(|c| c.get()) {
        return NoWait::Unsupported;
    }
    let iov = libc::iovec {
        iov_base: buf.as_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: one iovec over a live buffer, on an fd the caller keeps open for the call.
    let n = unsafe { libc::pwritev2(fd, &iov, 1, pos as libc::off_t, libc::RWF_NOWAIT) };
    if n >= 0 {
        return NoWait::Wrote(n as usize);
    }
    if std::io::Error::last_os_error().raw_os_error() == Some(libc::EOPNOTSUPP) {
        NOWAIT_UNSUPPORTED.with(|c| c.set(true));
        return NoWait::Unsupported;
    }
    // EAGAIN (would block), or an error the io_uring write will meet and report.
    NoWait::Wrote(0)
}

/// Milliseconds on a monotonic clock (since this thread first asked): the write path's
/// back-off must not stretch or vanish when the wall clock jumps.
fn mono_ms() -> u64 {
    thread_local! {
        static BASE: std::time::Instant = std::time::Instant::now();
    }
    BASE.with(|b| b.elapsed().as_millis() as u64)
}

/// How many inline page-cache writes on this thread (core) blocked longer than their log's
/// `inline_write_slow_us` ([`crate::write_path`]): a running count, for metrics.
pub fn inline_write_stalls() -> u64 {
    WRITE_BACKOFF.get().stalls
}

/// A plain `pwrite` of all of `buf` at `pos` (blocking; retried on EINTR and short writes).
fn write_inline(fd: std::os::fd::RawFd, buf: &[u8], pos: u64) -> std::io::Result<usize> {
    let mut done = 0usize;
    while done < buf.len() {
        // SAFETY: a live buffer slice, on an fd the caller keeps open for the call.
        let n = unsafe {
            libc::pwrite(
                fd,
                buf[done..].as_ptr() as *const libc::c_void,
                buf.len() - done,
                (pos + done as u64) as libc::off_t,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            break;
        }
        done += n as usize;
    }
    Ok(done)
}

thread_local! {
    /// Set once the filesystem refused RWF_NOWAIT buffered writes (ext4 does): later commits
    /// on this core go straight to io_uring instead of paying a refused syscall each.
    static NOWAIT_UNSUPPORTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// The core's inline-write back-off (crate::write_path): shared by every log of the core,
    /// since what blocks one write (dirty throttling, the journal) blocks the others too.
    static WRITE_BACKOFF: std::cell::Cell<Backoff> = const {
        std::cell::Cell::new(Backoff { ring_until_ms: 0, stalls: 0 })
    };
}

impl CommitBuf {
    fn len(&self) -> usize {
        match self {
            CommitBuf::Direct(b) => b.len(),
            CommitBuf::Cached(b) => b.len(),
        }
    }
}

struct Group {
    first: u64,
    count: u32,
    bytes_end: usize,
    max_ts_ms: u64,
    /// A commit takes groups of one generation only.
    gen: u64,
}

struct Inner {
    dir: PathBuf,
    cfg: LogConfig,
    log_id: [u8; 16],
    segs: VecDeque<Seg>,
    next_offset: u64,
    written: u64,
    synced: u64,
    pending: Vec<u8>,
    groups: VecDeque<Group>,
    failed: Option<String>,
    closing: bool,
    committer_done: bool,
    committer: Option<Waker>,
    waiters: Vec<Waker>,
    /// A page-cache commit's buffer, kept between inline commits.
    scratch: Vec<u8>,
    /// The generation of the newest record appended (queued or written); `None` while the
    /// log holds no record. An append in an older one is refused.
    newest_gen: Option<u64>,
    /// Set while [`Log::truncate_from`] runs: appends are refused and retention waits.
    truncating: bool,
    /// No segment holding an offset at or above this is deleted ([`LogConfig::retention_hold`]).
    retention_hold: Option<u64>,
    /// Truncations so far, and where the last one cut: a wait for acknowledgement that a
    /// truncation overtook ends with [`LogError::Truncated`].
    truncations: u64,
    truncated_to: u64,
}

impl Inner {
    fn acked(&self) -> u64 {
        match self.cfg.fsync {
            FsyncMode::OnCommit => self.synced,
            _ => self.written,
        }
    }
    fn wake_all(&mut self) {
        for w in self.waiters.drain(..) {
            w.wake();
        }
    }
    /// Whether the log takes a write now: not failed, not closing, not cutting a suffix.
    fn writable(&self) -> Result<(), LogError> {
        if let Some(f) = &self.failed {
            return Err(LogError::Failed(f.clone()));
        }
        if self.closing {
            return Err(LogError::Closed);
        }
        if self.truncating {
            return Err(LogError::Truncating);
        }
        Ok(())
    }

    fn fail(&mut self, why: String) {
        if self.failed.is_none() {
            tracing::error!(dir = %self.dir.display(), %why, "log failed; no further acknowledgements");
            self.failed = Some(why);
        }
        self.pending.clear();
        self.groups.clear();
        self.wake_all();
    }
    fn fault(&self, p: FaultPoint) -> Result<(), LogError> {
        match self.cfg.faults.as_ref().and_then(|f| f(p)) {
            Some(errno) => Err(LogError::Failed(format!(
                "{p:?}: {}",
                std::io::Error::from_raw_os_error(errno)
            ))),
            None => Ok(()),
        }
    }
}

/// A shard's log. Cheap to clone (shared handle on one executor).
#[derive(Clone)]
pub struct Log {
    inner: Rc<RefCell<Inner>>,
}

thread_local! {
    static SEEDED: RefCell<bool> = const { RefCell::new(false) };
}

/// Work-around for glommio's DMA read probe (DEPENDENCIES.md pitfall 1, upstream #670): the
/// first DMA open on a device probes polled reads, and on an empty file the probe wrongly
/// concludes reads are unsupported, after which every DMA read fails with EOPNOTSUPP. Each
/// executor therefore opens a non-empty 4096-byte seed file once, before any segment (which
/// always starts empty) is opened. [`Log::open`] calls it; it is idempotent per thread.
pub async fn seed_dma_probe(dir: &Path) -> std::io::Result<()> {
    if SEEDED.with(|s| *s.borrow()) {
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    let seed = dir.join(".dma-seed");
    let ok = std::fs::metadata(&seed)
        .map(|m| m.len() >= 4096)
        .unwrap_or(false);
    if !ok {
        std::fs::write(&seed, vec![0x46u8; 4096])?;
    }
    let f = DmaFile::open(&seed)
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    f.close()
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    SEEDED.with(|s| *s.borrow_mut() = true);
    Ok(())
}

async fn open_rw(path: &Path, create: bool) -> Result<DmaFile, LogError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .dma_open(path)
        .await
        .map_err(|e| io_err(&format!("open {}", path.display()), e))
}

async fn read_all(f: &DmaFile, len: u64) -> Result<Vec<u8>, LogError> {
    let mut out = Vec::with_capacity(len as usize);
    let chunk = 1 << 20;
    while (out.len() as u64) < len {
        let want = chunk.min(len as usize - out.len());
        let r = f
            .read_at(out.len() as u64, want)
            .await
            .map_err(|e| io_err("read", e))?;
        if r.is_empty() {
            break;
        }
        out.extend_from_slice(&r);
    }
    Ok(out)
}

fn sync_dir(dir: &Path) -> Result<(), LogError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err("fsync directory", e))
}

fn random_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        if f.read_exact(&mut id).is_ok() {
            return id;
        }
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    id.copy_from_slice(&(t ^ (std::process::id() as u128) << 64).to_le_bytes());
    id
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The segment and index files of a log directory: (segment bases sorted, index bases).
pub fn list_log_dir(dir: &Path) -> Result<(Vec<u64>, std::collections::BTreeSet<u64>), LogError> {
    let mut logs = Vec::new();
    let mut idxs = std::collections::BTreeSet::new();
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((logs, idxs)),
        Err(e) => return Err(io_err("read directory", e)),
    };
    for e in rd {
        let e = e.map_err(|e| io_err("read directory", e))?;
        match parse_file_name(&e.file_name().to_string_lossy()) {
            Some((b, "log")) => logs.push(b),
            Some((b, _)) => {
                idxs.insert(b);
            }
            None => {}
        }
    }
    logs.sort_unstable();
    Ok((logs, idxs))
}

/// Read a log directory into a [`DiskView`] through DMA (what open does): headers and index
/// files of every segment, full bytes of the segments the planner must scan.
pub async fn read_view(dir: &Path, interval_bytes: u32) -> Result<DiskView, LogError> {
    let (logs, mut idxs) = list_log_dir(dir)?;
    let mut view = DiskView::default();
    for &base in &logs {
        let path = dir.join(segment_file_name(base));
        let f = DmaFile::open(&path)
            .await
            .map_err(|e| io_err("open segment", e))?;
        let len = f.file_size().await.map_err(|e| io_err("stat", e))?;
        let head = read_all(&f, len.min(BLOCK as u64)).await?;
        let index = if idxs.remove(&base) {
            Some(
                std::fs::read(dir.join(index_file_name(base)))
                    .map_err(|e| io_err("read index", e))?,
            )
        } else {
            None
        };
        view.segments.push(SegmentView::from_read(
            base,
            len,
            &head,
            index.as_deref(),
            None,
            interval_bytes,
        ));
        let _ = f.close().await;
    }
    view.orphan_indexes = idxs.into_iter().collect();
    for i in must_scan(&view) {
        let s = &mut view.segments[i];
        let f = DmaFile::open(dir.join(segment_file_name(s.base)))
            .await
            .map_err(|e| io_err("open segment", e))?;
        let bytes = read_all(&f, s.file_len).await?;
        let _ = f.close().await;
        s.scan = Some(crate::segment::scan_segment(&bytes, s.base, interval_bytes));
    }
    Ok(view)
}

async fn write_index(dir: &Path, idx: &SegmentIndex) -> Result<(), LogError> {
    let body = idx.encode();
    let tmp = dir.join(format!("{}.tmp", index_file_name(idx.base_offset)));
    let f = open_rw(&tmp, true).await?;
    let mut buf = f.alloc_dma_buffer(align_up(body.len()));
    buf.as_bytes_mut().fill(0);
    buf.as_bytes_mut()[..body.len()].copy_from_slice(&body);
    f.write_at(buf, 0)
        .await
        .map_err(|e| io_err("write index", e))?;
    f.fdatasync().await.map_err(|e| io_err("sync index", e))?;
    let _ = f.close().await;
    std::fs::rename(&tmp, dir.join(index_file_name(idx.base_offset)))
        .map_err(|e| io_err("rename index", e))?;
    sync_dir(dir)
}

impl Log {
    /// Open (or create) the log in `dir`: read what is on disk, plan recovery, execute the
    /// plan, and start the committer (and periodic fsync / retention) tasks on this executor.
    pub async fn open(dir: &Path, cfg: LogConfig) -> Result<(Log, OpenReport), LogError> {
        cfg.validate().map_err(LogError::Config)?;
        std::fs::create_dir_all(dir).map_err(|e| io_err("create log directory", e))?;
        seed_dma_probe(dir)
            .await
            .map_err(|e| io_err("DMA seed", e))?;
        // Leftover temporary index files of a seal that did not finish.
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().ends_with(".idx.tmp") {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let view = read_view(dir, cfg.index_interval_bytes).await?;
        let plan = plan_recovery(&view, cfg.first_offset);
        if let Verdict::Refuse {
            segment,
            pos,
            reason,
        } = &plan.verdict
        {
            return Err(LogError::Refused {
                segment: *segment,
                pos: *pos,
                reason: reason.clone(),
            });
        }
        Self::execute(dir, &plan).await?;
        let log_id = plan.log_id.unwrap_or_else(random_id);
        let mut segs = VecDeque::new();
        for r in &plan.segments {
            let file = open_rw(&dir.join(segment_file_name(r.base)), false).await?;
            segs.push_back(Seg {
                base: r.base,
                file: Rc::new(file),
                wfile: None,
                end_offset: r.end_offset,
                end_pos: r.end_pos,
                write_pos: align_up(r.end_pos as usize) as u64,
                max_ts_ms: r.max_ts_ms,
                index: r.index.clone(),
                gens: r.gens.clone(),
                version: r.version,
                sealed: r.sealed,
            });
        }
        let newest_gen = segs.iter().rev().find_map(|s| s.gens.last()).map(|r| r.gen);
        let inner = Inner {
            dir: dir.to_path_buf(),
            cfg: cfg.clone(),
            log_id,
            segs,
            next_offset: plan.next_offset,
            written: plan.next_offset,
            synced: plan.next_offset,
            pending: Vec::new(),
            groups: VecDeque::new(),
            failed: None,
            closing: false,
            committer_done: false,
            committer: None,
            waiters: Vec::new(),
            scratch: Vec::new(),
            newest_gen,
            truncating: false,
            retention_hold: cfg.retention_hold,
            truncations: 0,
            truncated_to: 0,
        };
        let log = Log {
            inner: Rc::new(RefCell::new(inner)),
        };
        if let Active::Create { base } = plan.active {
            log.create_segment(base).await?;
        }
        log.retire_old_format_segment().await?;
        let report = OpenReport {
            verdict: plan.verdict.clone(),
            actions: plan.actions.clone(),
            next_offset: plan.next_offset,
            oldest_offset: log.oldest_offset(),
            segments: log.inner.borrow().segs.len(),
        };
        if report.verdict != Verdict::Clean {
            tracing::warn!(dir = %dir.display(), actions = ?report.actions, "log repaired at open");
        }
        let l = log.clone();
        glommio::spawn_local(async move { l.committer().await }).detach();
        let l = log.clone();
        glommio::spawn_local(async move { l.housekeeping().await }).detach();
        Ok((log, report))
    }

    async fn execute(dir: &Path, plan: &Plan) -> Result<(), LogError> {
        for a in &plan.actions {
            match a {
                Action::DeleteSegment { base } => {
                    std::fs::remove_file(dir.join(segment_file_name(*base)))
                        .map_err(|e| io_err("delete segment", e))?;
                }
                Action::TruncateSegment { base, pos } => {
                    let f = open_rw(&dir.join(segment_file_name(*base)), false).await?;
                    f.truncate(*pos).await.map_err(|e| io_err("truncate", e))?;
                    f.fdatasync().await.map_err(|e| io_err("sync", e))?;
                    let _ = f.close().await;
                }
                Action::WriteIndex { index } => write_index(dir, index).await?,
                Action::RemoveIndex { base } | Action::RemoveOrphanIndex { base } => {
                    std::fs::remove_file(dir.join(index_file_name(*base)))
                        .map_err(|e| io_err("remove index", e))?;
                }
            }
        }
        if !plan.actions.is_empty() {
            sync_dir(dir)?;
        }
        Ok(())
    }

    async fn create_segment(&self, base: u64) -> Result<(), LogError> {
        let (dir, log_id, fault, bytes_max) = {
            let i = self.inner.borrow();
            (
                i.dir.clone(),
                i.log_id,
                i.fault(FaultPoint::CreateSegment),
                i.cfg.segment_bytes_max,
            )
        };
        fault?;
        let path = dir.join(segment_file_name(base));
        let f = open_rw(&path, true).await?;
        let header = SegmentHeader {
            version: FORMAT_VERSION,
            base_offset: base,
            log_id,
            created_ms: now_ms(),
        }
        .encode();
        let mut buf = f.alloc_dma_buffer(BLOCK);
        buf.as_bytes_mut().copy_from_slice(&header);
        let n = f
            .write_at(buf, 0)
            .await
            .map_err(|e| LogError::Failed(format!("write segment header: {e}")))?;
        if n != BLOCK {
            return Err(LogError::Failed(format!("short header write ({n} bytes)")));
        }
        // Reserve the segment's space up front (keeping the file size, so a scan at open
        // reads only what was written). A filesystem without fallocate just skips it.
        if let Err(e) = f.pre_allocate(bytes_max, true).await {
            let e = std::io::Error::from(e);
            if e.raw_os_error() == Some(libc::ENOSPC) {
                return Err(LogError::Failed(format!("preallocate segment: {e}")));
            }
        }
        f.fdatasync()
            .await
            .map_err(|e| LogError::Failed(format!("sync new segment: {e}")))?;
        sync_dir(&dir)?;
        self.inner.borrow_mut().segs.push_back(Seg {
            base,
            file: Rc::new(f),
            wfile: None,
            end_offset: base,
            end_pos: BLOCK as u64,
            write_pos: BLOCK as u64,
            max_ts_ms: 0,
            index: Vec::new(),
            gens: Vec::new(),
            version: FORMAT_VERSION,
            sealed: false,
        });
        Ok(())
    }

    /// An active segment of an older format version takes no commit of the current one
    /// (`segment::FORMAT_VERSION_OLDEST` says why): an empty one is replaced, a non-empty one
    /// sealed (the next commit rolls to a new segment).
    async fn retire_old_format_segment(&self) -> Result<(), LogError> {
        let (old, empty, base, dir) = {
            let i = self.inner.borrow();
            let s = i.segs.back().expect("an active segment exists after open");
            (
                s.version < FORMAT_VERSION && !s.sealed,
                s.end_offset == s.base,
                s.base,
                i.dir.clone(),
            )
        };
        if !old {
            return Ok(());
        }
        if empty {
            self.inner.borrow_mut().segs.pop_back();
            std::fs::remove_file(dir.join(segment_file_name(base)))
                .map_err(|e| io_err("remove an empty old-format segment", e))?;
            sync_dir(&dir)?;
            return self.create_segment(base).await;
        }
        tracing::info!(dir = %dir.display(), base, "sealing a segment of the previous format version; new commits go to a new segment");
        self.seal_active().await
    }

    /// Queue records for the next commit and assign their offsets, in the generation of the
    /// newest record (0 in a log never replicated). Nothing is acknowledged yet: wait for
    /// [`Log::acked`] to pass the returned range's end.
    pub fn append(&self, records: &[RecordIn<'_>], ts_ms: u64) -> Result<Range<u64>, LogError> {
        let gen = self.inner.borrow().newest_gen.unwrap_or(0);
        self.append_in(gen, records, ts_ms)
    }

    /// [`Log::append`] in generation `gen`, which must not be older than the newest record's
    /// ([`LogError::GenerationBehind`]): a leader appends in its generation, a follower in
    /// the generation each shipped record was written in.
    pub fn append_in(
        &self,
        gen: u64,
        records: &[RecordIn<'_>],
        ts_ms: u64,
    ) -> Result<Range<u64>, LogError> {
        self.append_stamped(gen, records, |_| ts_ms)
    }

    /// [`Log::append_in`] with each record's own timestamp, `ts_ms_of(k)` for the `k`-th: a
    /// follower writes the timestamps its leader wrote, so that replicas hold the same bytes.
    pub fn append_stamped(
        &self,
        gen: u64,
        records: &[RecordIn<'_>],
        ts_ms_of: impl Fn(usize) -> u64,
    ) -> Result<Range<u64>, LogError> {
        let mut i = self.inner.borrow_mut();
        i.writable()?;
        if let Some(newest) = i.newest_gen.filter(|n| *n > gen) {
            return Err(LogError::GenerationBehind { gen, newest });
        }
        let bytes: usize = records.iter().map(|r| r.encoded_len()).sum();
        let max = i.cfg.commit_bytes_max - COMMIT_HEADER_BYTES;
        if bytes > max
            || records
                .iter()
                .any(|r| r.encoded_len() > RECORD_BYTES_MAX || r.key.len() > u16::MAX as usize)
        {
            return Err(LogError::TooLarge { bytes, max });
        }
        if records.is_empty() {
            let n = i.next_offset;
            return Ok(n..n);
        }
        if i.pending.len() + bytes > i.cfg.pending_bytes_max {
            return Err(LogError::Backpressure {
                pending_bytes: i.pending.len(),
            });
        }
        let first = i.next_offset;
        let mut max_ts_ms = 0;
        for (k, r) in records.iter().enumerate() {
            let ts_ms = ts_ms_of(k);
            max_ts_ms = max_ts_ms.max(ts_ms);
            encode_into(&mut i.pending, first + k as u64, ts_ms, r);
        }
        let end = i.pending.len();
        i.groups.push_back(Group {
            first,
            count: records.len() as u32,
            bytes_end: end,
            max_ts_ms,
            gen,
        });
        i.newest_gen = Some(gen);
        i.next_offset += records.len() as u64;
        if let Some(w) = i.committer.take() {
            w.wake();
        }
        Ok(first..i.next_offset)
    }

    /// The bytes the written records at `offset` and after take in the segment files
    /// (commit headers and padding included): how far a reader or a follower at `offset`
    /// is behind the end, in bytes. Exact at a segment's start; inside a segment it counts from
    /// the index entry at or before `offset`, so it may count up to one index interval
    /// ([`LogConfig::index_interval_bytes`]) more. Below the oldest offset: the whole log.
    pub fn bytes_from(&self, offset: u64) -> u64 {
        let i = self.inner.borrow();
        i.segs
            .iter()
            .filter(|s| s.end_offset > offset)
            .map(|s| {
                let floor = s.index.partition_point(|e| e.offset <= offset);
                let from = match floor.checked_sub(1) {
                    Some(k) if offset > s.base => s.index[k].pos,
                    _ => BLOCK as u64,
                };
                s.end_pos.saturating_sub(from)
            })
            .sum()
    }

    /// The most record bytes (encoded, [`RecordIn::encoded_len`]) one append takes: it is
    /// one commit. A writer with more splits them.
    pub fn append_bytes_max(&self) -> usize {
        self.inner.borrow().cfg.commit_bytes_max - COMMIT_HEADER_BYTES
    }

    /// Offsets below this are acknowledged (written; and synced under `on_commit`).
    pub fn acked(&self) -> u64 {
        self.inner.borrow().acked()
    }
    /// Offsets below this have been fdatasynced.
    pub fn synced(&self) -> u64 {
        self.inner.borrow().synced
    }
    pub fn next_offset(&self) -> u64 {
        self.inner.borrow().next_offset
    }
    pub fn oldest_offset(&self) -> u64 {
        let i = self.inner.borrow();
        i.segs.front().map(|s| s.base).unwrap_or(i.next_offset)
    }
    pub fn failed(&self) -> Option<String> {
        self.inner.borrow().failed.clone()
    }
    pub fn log_id(&self) -> [u8; 16] {
        self.inner.borrow().log_id
    }
    pub fn segment_count(&self) -> usize {
        self.inner.borrow().segs.len()
    }
    pub fn fsync_mode(&self) -> FsyncMode {
        self.inner.borrow().cfg.fsync
    }
    /// The generation of the newest record (queued or written); `None` for an empty log.
    pub fn newest_gen(&self) -> Option<u64> {
        self.inner.borrow().newest_gen
    }
    /// Move the retention hold ([`LogConfig::retention_hold`]): a replica raises it as it
    /// learns the commit mark. A lower hold only keeps more.
    pub fn set_retention_hold(&self, hold: Option<u64>) {
        self.inner.borrow_mut().retention_hold = hold;
    }

    /// The retention hold now.
    pub fn retention_hold(&self) -> Option<u64> {
        self.inner.borrow().retention_hold
    }

    /// The generations of the written records, as runs from the oldest offset (one per change
    /// of generation, across segments).
    pub fn gen_runs(&self) -> Vec<GenRun> {
        let i = self.inner.borrow();
        let mut out: Vec<GenRun> = Vec::new();
        for r in i.segs.iter().flat_map(|s| s.gens.iter()) {
            if out.last().is_none_or(|l| l.gen != r.gen) {
                out.push(*r);
            }
        }
        out
    }

    /// Offsets below this are written (in the file, not only queued): what [`Log::gen_at`]
    /// and [`Log::gen_runs`] cover.
    pub fn written(&self) -> u64 {
        self.inner.borrow().written
    }

    /// The generation of the written record at `offset` (what log matching compares), or
    /// `None` if no written record has that offset (below retention, or not written yet).
    pub fn gen_at(&self, offset: u64) -> Option<u64> {
        let i = self.inner.borrow();
        if offset >= i.written {
            return None;
        }
        let k = i
            .segs
            .partition_point(|s| s.base <= offset)
            .checked_sub(1)?;
        let s = &i.segs[k];
        (offset < s.end_offset)
            .then(|| gen_in_runs(&s.gens, offset))
            .flatten()
    }

    /// Wait until the acknowledged mark passes `seen`; returns the new mark. Errors once the
    /// log has failed (the mark never moves again) or closed.
    /// A truncation ([`Log::truncate_from`]) while it waits ends it with
    /// [`LogError::Truncated`]: offsets past the cut are assigned again, and the mark passing
    /// `seen` would then speak of other records.
    pub async fn wait_acked_beyond(&self, seen: u64) -> Result<u64, LogError> {
        let truncations = self.inner.borrow().truncations;
        poll_fn(|cx| {
            let mut i = self.inner.borrow_mut();
            if let Some(f) = &i.failed {
                return Poll::Ready(Err(LogError::Failed(f.clone())));
            }
            if i.truncations != truncations {
                return Poll::Ready(Err(LogError::Truncated { to: i.truncated_to }));
            }
            let a = i.acked();
            if a > seen {
                return Poll::Ready(Ok(a));
            }
            if i.committer_done {
                return Poll::Ready(Err(LogError::Closed));
            }
            i.waiters.push(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Wait until every offset below `upto` is acknowledged (a truncation meanwhile ends the
    /// wait with [`LogError::Truncated`]).
    pub async fn wait_acked(&self, upto: u64) -> Result<(), LogError> {
        let truncations = self.inner.borrow().truncations;
        loop {
            let (a, t, to) = {
                let i = self.inner.borrow();
                (i.acked(), i.truncations, i.truncated_to)
            };
            if t != truncations {
                return Err(LogError::Truncated { to });
            }
            if a >= upto {
                return Ok(());
            }
            self.wait_acked_beyond(a).await?;
        }
    }

    async fn committer(&self) {
        loop {
            // Wait for work.
            let go = poll_fn(|cx| {
                let mut i = self.inner.borrow_mut();
                if i.failed.is_some() {
                    return Poll::Ready(false);
                }
                if !i.groups.is_empty() {
                    return Poll::Ready(true);
                }
                if i.closing {
                    return Poll::Ready(false);
                }
                i.committer = Some(cx.waker().clone());
                Poll::Pending
            })
            .await;
            if !go {
                break;
            }
            if let Err(e) = self.commit_once().await {
                let why = match e {
                    LogError::Failed(s) => s,
                    other => other.to_string(),
                };
                self.inner.borrow_mut().fail(why);
                break;
            }
        }
        let mut i = self.inner.borrow_mut();
        i.committer_done = true;
        i.wake_all();
    }

    /// The active segment's buffered (page-cache) writer, opened on first use.
    async fn cached_writer(&self) -> Result<Rc<BufferedFile>, LogError> {
        let (base, dir) = {
            let i = self.inner.borrow();
            let s = i.segs.back().expect("an active segment exists");
            if let Some(w) = &s.wfile {
                return Ok(w.clone());
            }
            (s.base, i.dir.clone())
        };
        let path = dir.join(segment_file_name(base));
        let w = Rc::new(
            OpenOptions::new()
                .write(true)
                .buffered_open(&path)
                .await
                .map_err(|e| {
                    LogError::Failed(format!("open {} for writing: {e}", path.display()))
                })?,
        );
        let mut i = self.inner.borrow_mut();
        let s = i.segs.back_mut().expect("an active segment exists");
        assert_eq!(
            s.base, base,
            "the active segment cannot change while its writer opens"
        );
        s.wfile = Some(w.clone());
        Ok(w)
    }

    async fn commit_once(&self) -> Result<(), LogError> {
        // Take whole append groups up to commit_bytes_max (at least one) and encode the
        // commit straight into the DMA buffer: header, the queued records, zero padding.
        let (buf, h, need_roll) = {
            let mut i = self.inner.borrow_mut();
            let limit = i.cfg.commit_bytes_max - COMMIT_HEADER_BYTES;
            let mut take = 0usize;
            let mut end = 0usize;
            let gen = i.groups[0].gen;
            while let Some(g) = i.groups.get(take) {
                if take > 0 && (g.bytes_end > limit || g.gen != gen) {
                    break;
                }
                end = g.bytes_end;
                take += 1;
            }
            let groups: Vec<Group> = i.groups.drain(..take).collect();
            for g in i.groups.iter_mut() {
                g.bytes_end -= end;
            }
            let h = CommitHeader::new(
                u32::try_from(end).expect("commit < 4 GiB"),
                groups.iter().map(|g| g.count).sum(),
                groups[0].first,
                groups.iter().map(|g| g.max_ts_ms).max().unwrap_or(0),
                gen,
            );
            assert_eq!(h.first_offset, i.written, "commits must be contiguous");
            let span = align_up(h.span());
            // The previous page-cache commit's buffer, reused (one large allocation less per
            // commit; taken before `i` is borrowed below).
            let mut scratch = std::mem::take(&mut i.scratch);
            let seg = i.segs.back().expect("an active segment exists");
            // The same bytes either way: header, records, zero padding to the block.
            let fill = |out: &mut [u8]| {
                h.write_to(&mut out[..COMMIT_HEADER_BYTES]);
                out[COMMIT_HEADER_BYTES..h.span()].copy_from_slice(&i.pending[..end]);
                out[h.span()..].fill(0);
            };
            let buf = if i.cfg.fsync == FsyncMode::OnCommit {
                // DMA buffers are not tied to a file: one allocated here serves a new segment too.
                let mut b = seg.file.alloc_dma_buffer(span);
                fill(b.as_bytes_mut());
                CommitBuf::Direct(b)
            } else {
                scratch.clear();
                scratch.resize(span, 0);
                fill(&mut scratch);
                CommitBuf::Cached(scratch)
            };
            let need_roll = seg.sealed
                || (seg.end_offset > seg.base
                    && seg.write_pos + span as u64 > i.cfg.segment_bytes_max);
            i.pending.drain(..end);
            (buf, h, need_roll)
        };
        let (first, count, max_ts, len) = (h.first_offset, h.count, h.max_ts_ms, buf.len());
        // Written into the segment header's version (a roll below makes a current one).
        if need_roll {
            self.seal_active().await?;
            self.create_segment(first).await?;
            self.apply_retention().await;
        }
        let (file, pos, fault) = {
            let i = self.inner.borrow();
            let s = i.segs.back().unwrap();
            (s.file.clone(), s.write_pos, i.fault(FaultPoint::Write))
        };
        fault?;
        let n = match buf {
            CommitBuf::Direct(b) => file.write_at(b, pos).await.map_err(|e| e.to_string()),
            CommitBuf::Cached(b) => {
                let w = self.cached_writer().await?;
                // First without blocking: a page-cache copy that needs no I/O is done in
                // place (RWF_NOWAIT). Only what would block — dirty throttling, a page to read
                // in — goes further.
                let nowait = write_nowait(w.as_raw_fd(), &b, pos);
                let done = match nowait {
                    NoWait::Wrote(n) => n,
                    NoWait::Unsupported => 0,
                };
                // What RWF_NOWAIT did not write: a plain pwrite or io_uring, per the core's
                // policy (crate::write_path).
                let path = WritePath {
                    slow_us: self.inner.borrow().cfg.inline_write_slow_us,
                    backoff_ms: INLINE_WRITE_BACKOFF_MS,
                };
                match path.choose(&WRITE_BACKOFF.get(), b.len(), nowait, mono_ms()) {
                    WriteWay::Done => Ok(done),
                    WriteWay::Inline => {
                        let t = std::time::Instant::now();
                        let r = write_inline(w.as_raw_fd(), &b[done..], pos + done as u64);
                        let took_us = t.elapsed().as_micros() as u64;
                        let mut st = WRITE_BACKOFF.get();
                        if path.observe_inline(&mut st, took_us, mono_ms()) {
                            tracing::info!(
                                took_us,
                                stalls = st.stalls,
                                backoff_ms = path.backoff_ms,
                                "an inline page-cache write blocked the core; commits go through io_uring for a while"
                            );
                        }
                        WRITE_BACKOFF.set(st);
                        // Kept for the next commit unless a large one grew it.
                        if b.capacity() <= crate::write_path::INLINE_WRITE_BYTES_MAX {
                            self.inner.borrow_mut().scratch = b;
                        }
                        r.map(|n| n + done).map_err(|e| e.to_string())
                    }
                    WriteWay::Ring => {
                        let rest = if done == 0 { b } else { b[done..].to_vec() };
                        w.write_at(rest, pos + done as u64)
                            .await
                            .map(|n| n + done)
                            .map_err(|e| e.to_string())
                    }
                }
            }
        }
        .map_err(|e| LogError::Failed(format!("write: {e}")))?;
        if n != len {
            return Err(LogError::Failed(format!("short write: {n} of {len} bytes")));
        }
        let on_commit = self.inner.borrow().cfg.fsync == FsyncMode::OnCommit;
        if on_commit {
            self.inner.borrow().fault(FaultPoint::Sync)?;
            let t = std::time::Instant::now();
            file.fdatasync()
                .await
                .map_err(|e| LogError::Failed(format!("fdatasync: {e}")))?;
            self.observe_sync(t);
        }
        let mut i = self.inner.borrow_mut();
        if i.failed.is_some() {
            return Ok(());
        }
        let interval = i.cfg.index_interval_bytes as u64;
        let s = i.segs.back_mut().unwrap();
        if s.index.last().is_none_or(|e| pos - e.pos >= interval) {
            s.index.push(IndexEntry { offset: first, pos });
        }
        s.end_offset = first + count as u64;
        s.end_pos = pos + h.span() as u64;
        s.write_pos = pos + len as u64;
        s.max_ts_ms = s.max_ts_ms.max(max_ts);
        debug_assert_eq!(
            s.version, FORMAT_VERSION,
            "an old-format segment takes no new commit"
        );
        push_gen_run(&mut s.gens, first, h.gen);
        i.written = first + count as u64;
        if on_commit {
            i.synced = i.written;
        }
        i.wake_all();
        Ok(())
    }

    /// fdatasync the active segment and write its index; it takes no more commits.
    async fn seal_active(&self) -> Result<(), LogError> {
        let (file, idx, dir, fault) = {
            let i = self.inner.borrow();
            let s = i.segs.back().unwrap();
            if s.sealed {
                return Ok(());
            }
            let idx = SegmentIndex {
                base_offset: s.base,
                end_offset: s.end_offset,
                end_pos: s.end_pos,
                max_ts_ms: s.max_ts_ms,
                interval_bytes: i.cfg.index_interval_bytes,
                entries: s.index.clone(),
                gens: s.gens.clone(),
            };
            (
                s.file.clone(),
                idx,
                i.dir.clone(),
                i.fault(FaultPoint::Sync),
            )
        };
        fault?;
        let t = std::time::Instant::now();
        file.fdatasync()
            .await
            .map_err(|e| LogError::Failed(format!("fdatasync at seal: {e}")))?;
        self.observe_sync(t);
        write_index(&dir, &idx)
            .await
            .map_err(|e| LogError::Failed(e.to_string()))?;
        let w = {
            let mut i = self.inner.borrow_mut();
            let written = i.written;
            i.synced = i.synced.max(written);
            let s = i.segs.back_mut().unwrap();
            s.sealed = true;
            s.wfile.take()
        };
        // Sealed: no more writes. Close the page-cache writer (its data was just synced).
        if let Some(w) = w.and_then(|w| Rc::try_unwrap(w).ok()) {
            let _ = w.close().await;
        }
        Ok(())
    }

    /// Delete the oldest sealed segments that hold only offsets below `offset` (whose
    /// records a snapshot now covers: a cache shard's compaction). Offsets are never
    /// renumbered: the log's oldest offset moves up to the first kept segment. Returns how
    /// many segments went.
    pub async fn delete_below(&self, offset: u64) -> usize {
        let victims: Vec<(u64, Rc<DmaFile>)> = {
            let mut i = self.inner.borrow_mut();
            if i.truncating {
                // The cut rearranges the segments' tail; the next compaction deletes these.
                return 0;
            }
            let last = i.segs.back().map(|s| s.base);
            let facts: Vec<SegmentFacts> = i
                .segs
                .iter()
                .map(|s| SegmentFacts {
                    base: s.base,
                    bytes: s.write_pos,
                    max_ts_ms: s.max_ts_ms,
                    sealed: s.sealed && Some(s.base) != last,
                })
                .collect();
            let offset = i.retention_hold.map_or(offset, |h| h.min(offset));
            let n = segments_below(&facts, offset);
            i.segs.drain(..n).map(|s| (s.base, s.file)).collect()
        };
        if victims.is_empty() {
            return 0;
        }
        let dir = self.inner.borrow().dir.clone();
        for (base, _file) in &victims {
            let _ = std::fs::remove_file(dir.join(segment_file_name(*base)));
            let _ = std::fs::remove_file(dir.join(index_file_name(*base)));
        }
        let _ = sync_dir(&dir);
        victims.len()
    }

    async fn apply_retention(&self) {
        let victims: Vec<(u64, Rc<DmaFile>)> = {
            let mut i = self.inner.borrow_mut();
            if i.truncating {
                return;
            }
            let facts: Vec<SegmentFacts> = i
                .segs
                .iter()
                .map(|s| SegmentFacts {
                    base: s.base,
                    bytes: s.write_pos,
                    max_ts_ms: s.max_ts_ms,
                    sealed: s.sealed && (s.base != i.segs.back().unwrap().base),
                })
                .collect();
            let mut n = segments_to_delete(&facts, i.cfg.retention, now_ms());
            if let Some(hold) = i.retention_hold {
                n = n.min(segments_below(&facts, hold));
            }
            i.segs.drain(..n).map(|s| (s.base, s.file)).collect()
        };
        if victims.is_empty() {
            return;
        }
        let dir = self.inner.borrow().dir.clone();
        for (base, _file) in &victims {
            // Readers holding the file keep their descriptor; unlinking is safe.
            let _ = std::fs::remove_file(dir.join(segment_file_name(*base)));
            let _ = std::fs::remove_file(dir.join(index_file_name(*base)));
        }
        let _ = sync_dir(&dir);
        tracing::debug!(dir = %dir.display(), deleted = victims.len(), "retention deleted segments");
    }

    /// Periodic fdatasync (under `periodic`) and retention by age; ends when the log closes
    /// or fails.
    async fn housekeeping(&self) {
        let (fsync_ms, retention) = {
            let i = self.inner.borrow();
            let f = match i.cfg.fsync {
                FsyncMode::Periodic { interval_ms } => Some(interval_ms),
                _ => None,
            };
            (f, i.cfg.retention)
        };
        let retention_on = retention.age_max_ms.is_some() || retention.bytes_max.is_some();
        if fsync_ms.is_none() && !retention_on {
            return;
        }
        let tick_ms = fsync_ms.unwrap_or(1000).min(1000);
        let mut since_retention_ms = 0u64;
        loop {
            glommio::timer::sleep(Duration::from_millis(tick_ms)).await;
            {
                let i = self.inner.borrow();
                if i.failed.is_some() || i.committer_done {
                    return;
                }
            }
            if fsync_ms.is_some() {
                if let Err(e) = self.sync_now().await {
                    self.inner.borrow_mut().fail(e.to_string());
                    return;
                }
            }
            since_retention_ms += tick_ms;
            if retention_on && since_retention_ms >= 1000 {
                since_retention_ms = 0;
                self.apply_retention().await;
            }
        }
    }

    /// fdatasync the active segment now if anything was written since the last sync.
    pub async fn sync_now(&self) -> Result<(), LogError> {
        let (file, target, fault) = {
            let i = self.inner.borrow();
            if i.synced >= i.written {
                return Ok(());
            }
            (
                i.segs.back().unwrap().file.clone(),
                i.written,
                i.fault(FaultPoint::Sync),
            )
        };
        fault?;
        let t = std::time::Instant::now();
        file.fdatasync()
            .await
            .map_err(|e| LogError::Failed(format!("fdatasync: {e}")))?;
        self.observe_sync(t);
        let mut i = self.inner.borrow_mut();
        // A truncation during the fdatasync may have cut below `target`.
        let target = target.min(i.written);
        i.synced = i.synced.max(target);
        Ok(())
    }

    fn observe_sync(&self, since: std::time::Instant) {
        let obs = self.inner.borrow().cfg.on_sync.clone();
        if let Some(f) = obs {
            f(since.elapsed().as_micros() as u64);
        }
    }

    /// Read acknowledged records from `from`, at most `records_max` and about `bytes_max`
    /// payload bytes (at least one record if any is available). Never blocks appends.
    pub async fn read(
        &self,
        from: u64,
        records_max: usize,
        bytes_max: usize,
    ) -> Result<Vec<StoredRecord>, LogError> {
        let mut out = Vec::new();
        let mut at = from;
        let mut bytes = 0usize;
        // (segment base, byte position of the next commit to parse) once a read started.
        let mut cursor: Option<(u64, u64)> = None;
        loop {
            let (file, base, pos, end_pos, acked) = {
                let i = self.inner.borrow();
                let acked = i.acked();
                let oldest = i.segs.front().map(|s| s.base).unwrap_or(i.next_offset);
                if at < oldest {
                    return Err(LogError::BelowRetention {
                        requested: at,
                        oldest,
                    });
                }
                if at > acked {
                    return Err(LogError::BeyondTail {
                        requested: at,
                        tail: acked,
                    });
                }
                if at == acked
                    || out.len() >= records_max
                    || (bytes >= bytes_max && !out.is_empty())
                {
                    return Ok(out);
                }
                let k = i.segs.partition_point(|s| s.base <= at) - 1;
                let s = &i.segs[k];
                let pos = match cursor {
                    Some((b, p)) if b == s.base => p,
                    _ => s
                        .index
                        .partition_point(|e| e.offset <= at)
                        .checked_sub(1)
                        .map(|j| s.index[j].pos)
                        .unwrap_or(BLOCK as u64),
                };
                (s.file.clone(), s.base, pos, s.end_pos, acked)
            };
            if pos >= end_pos {
                return Err(LogError::Corrupt {
                    segment: base,
                    pos,
                    why: format!("offset {at} not found in its segment"),
                });
            }
            let want = (bytes_max.max(64 << 10) as u64).min(end_pos - pos) as usize;
            let mut chunk = Bytes::copy_from_slice(
                &file
                    .read_at(pos, want)
                    .await
                    .map_err(|e| io_err("read", e))?,
            );
            let h = CommitHeader::decode_at(&chunk, 0).ok_or_else(|| LogError::Corrupt {
                segment: base,
                pos,
                why: "bad commit header".into(),
            })?;
            if chunk.len() < h.span() {
                // A commit larger than the chunk: read exactly it.
                chunk = Bytes::copy_from_slice(
                    &file
                        .read_at(pos, h.span())
                        .await
                        .map_err(|e| io_err("read", e))?,
                );
                if chunk.len() < h.span() {
                    return Err(LogError::Corrupt {
                        segment: base,
                        pos,
                        why: "commit cut short".into(),
                    });
                }
            }
            // Parse every commit wholly inside the chunk.
            let mut rel = 0usize;
            while rel + COMMIT_HEADER_V1_BYTES <= chunk.len() && pos + (rel as u64) < end_pos {
                let Some(h) = CommitHeader::decode_at(&chunk, rel) else {
                    return Err(LogError::Corrupt {
                        segment: base,
                        pos: pos + rel as u64,
                        why: "bad commit header".into(),
                    });
                };
                if rel + h.span() > chunk.len() {
                    break;
                }
                let mut p = rel + h.header_bytes();
                for n in 0..h.count as u64 {
                    let r = crate::record::decode_at(&chunk[..rel + h.span()], p).map_err(|e| {
                        LogError::Corrupt {
                            segment: base,
                            pos: pos + p as u64,
                            why: e.to_string(),
                        }
                    })?;
                    assert_eq!(
                        r.offset,
                        h.first_offset + n,
                        "offsets contiguous within a commit"
                    );
                    if r.offset >= at && r.offset < acked && out.len() < records_max {
                        let key_at = p + crate::record::HEADER_BYTES;
                        let pay_at = key_at + r.key.len();
                        out.push(StoredRecord {
                            offset: r.offset,
                            gen: h.gen,
                            ts_ms: r.ts_ms,
                            flags: r.flags,
                            key: chunk.slice(key_at..pay_at),
                            payload: chunk.slice(pay_at..p + r.len),
                        });
                        bytes += r.payload.len();
                        at = r.offset + 1;
                    }
                    p += r.len;
                }
                rel = align_up(rel + h.span());
                if out.len() >= records_max || bytes >= bytes_max || at >= acked {
                    break;
                }
            }
            debug_assert!(rel > 0, "every pass consumes at least one commit");
            cursor = Some((base, pos + rel as u64));
        }
    }

    /// Write everything queued, fdatasync, and stop the tasks. Appends after this are refused.
    pub async fn close(&self) -> Result<(), LogError> {
        {
            let mut i = self.inner.borrow_mut();
            i.closing = true;
            if let Some(w) = i.committer.take() {
                w.wake();
            }
        }
        // The committer drains what is queued, then ends.
        poll_fn(|cx| {
            let mut i = self.inner.borrow_mut();
            if i.committer_done {
                Poll::Ready(())
            } else {
                i.waiters.push(cx.waker().clone());
                Poll::Pending
            }
        })
        .await;
        if let Some(f) = self.failed() {
            return Err(LogError::Failed(f));
        }
        self.sync_now().await
    }
}

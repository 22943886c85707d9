//! openraft storage v2 adapters: a file-backed log (+ vote, committed) and the catalog state
//! machine with persisted snapshots, all under one data dir.
//!
//! * `raft-log.jsonl` — one JSON record per line: an entry, a truncation or a purge, fsynced
//!   before openraft is told the write is durable. A torn last line (crash mid-write) is cut off
//!   at open; a bad line anywhere else is corruption and refuses to start. Rewritten compactly
//!   after purges.
//! * `vote.json` (fsynced, atomic rename), `committed.json` (atomic rename, at most every
//!   100 ms; optional by design: a lower bound of what is committed).
//! * `snapshot.bin` — first line the snapshot's meta, then the catalog image (JSON).
//! * The state machine itself lives in memory: rebuilt from the snapshot plus the log at start.

use super::{Resp, TypeConfig};
use crate::catalog::{Catalog, CatalogImage, Limits, Reply};
use crate::store::Shared;
use openraft::storage::{LogFlushed, RaftLogStorage, RaftStateMachine};
use openraft::{
    BasicNode, Entry, EntryPayload, LogId, LogState, RaftLogReader, RaftSnapshotBuilder, Snapshot,
    SnapshotMeta, StorageError, StorageIOError, StoredMembership, Vote,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Cursor, Write};
use std::ops::RangeBounds;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

type SE = StorageError<u64>;
type Mem = StoredMembership<u64, BasicNode>;
type Meta = SnapshotMeta<u64, BasicNode>;

/// `committed.json` is written at most this often (it is optional: a lower bound).
const COMMITTED_WRITE_PERIOD: std::time::Duration = std::time::Duration::from_millis(100);

fn io_err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Write `bytes` to `path` through a unique temp file and a rename; `durable` also fsyncs.
pub fn write_atomic(path: &Path, bytes: &[u8], durable: bool) -> io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", rand::random::<u32>()));
    let mut f = File::create(&tmp)?;
    f.write_all(bytes)?;
    if durable {
        f.sync_all()?;
    }
    drop(f);
    fs::rename(&tmp, path)?;
    if durable {
        if let Some(d) = path.parent() {
            fsync_dir(d)?;
        }
    }
    Ok(())
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> io::Result<Option<T>> {
    match fs::read(path) {
        Ok(b) => serde_json::from_slice(&b).map(Some).map_err(io_err),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")] // externally tagged: u64 map keys (membership) do not survive serde's buffered (internally tagged) form
enum Rec {
    Entry { e: Entry<TypeConfig> },
    Truncate { from: u64 },
    Purge { upto: LogId<u64> },
}

struct LogInner {
    dir: PathBuf,
    file: File,
    records: usize,
    entries: BTreeMap<u64, Entry<TypeConfig>>,
    purged: Option<LogId<u64>>,
    vote: Option<Vote<u64>>,
    committed: Option<LogId<u64>>,
    /// When `committed.json` was last written (see `save_committed`).
    committed_written: Option<std::time::Instant>,
}

/// The Raft log. Clones share one log (the reader handed to replication tasks is a clone).
#[derive(Clone)]
pub struct LogStore {
    inner: Arc<Mutex<LogInner>>,
}

const LOG: &str = "raft-log.jsonl";

impl LogInner {
    fn apply_rec(&mut self, r: Rec) {
        match r {
            Rec::Entry { e } => {
                self.entries.insert(e.log_id.index, e);
            }
            Rec::Truncate { from } => {
                self.entries.split_off(&from);
            }
            Rec::Purge { upto } => {
                self.entries = self.entries.split_off(&(upto.index + 1));
                self.purged = Some(upto);
            }
        }
    }

    fn write_recs(&mut self, recs: &[Rec]) -> io::Result<()> {
        let mut buf = Vec::new();
        for r in recs {
            serde_json::to_writer(&mut buf, r).map_err(io_err)?;
            buf.push(b'\n');
        }
        self.file.write_all(&buf)?;
        self.file.sync_data()?;
        self.records += recs.len();
        Ok(())
    }

    /// Rewrite the log file with only what is live.
    fn compact(&mut self) -> io::Result<()> {
        let mut buf = Vec::new();
        let mut n = 0;
        if let Some(p) = self.purged {
            serde_json::to_writer(&mut buf, &Rec::Purge { upto: p }).map_err(io_err)?;
            buf.push(b'\n');
            n += 1;
        }
        for e in self.entries.values() {
            serde_json::to_writer(&mut buf, &Rec::Entry { e: e.clone() }).map_err(io_err)?;
            buf.push(b'\n');
            n += 1;
        }
        let path = self.dir.join(LOG);
        write_atomic(&path, &buf, true)?;
        self.file = OpenOptions::new().append(true).open(&path)?;
        self.records = n;
        Ok(())
    }
}

impl LogStore {
    pub fn open(dir: &Path) -> io::Result<Self> {
        let path = dir.join(LOG);
        let data = match fs::read(&path) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        let mut inner = LogInner {
            dir: dir.to_path_buf(),
            file: OpenOptions::new().create(true).append(true).open(&path)?,
            records: 0,
            entries: BTreeMap::new(),
            purged: None,
            vote: read_json(&dir.join("vote.json"))?,
            committed: read_json(&dir.join("committed.json")).unwrap_or(None),
            committed_written: None,
        };
        let mut good = 0usize;
        let mut rest = &data[..];
        while !rest.is_empty() {
            let Some(nl) = rest.iter().position(|b| *b == b'\n') else {
                break; // torn tail: no newline
            };
            match serde_json::from_slice::<Rec>(&rest[..nl]) {
                Ok(r) => inner.apply_rec(r),
                Err(e) if nl + 1 == rest.len() => {
                    tracing::warn!("raft log: dropping an unreadable last record: {e}");
                    break;
                }
                Err(e) => {
                    return Err(io_err(format!(
                        "raft log {} is corrupt at byte {good}: {e}",
                        path.display()
                    )))
                }
            }
            good += nl + 1;
            inner.records += 1;
            rest = &rest[nl + 1..];
        }
        if good < data.len() {
            let f = OpenOptions::new().write(true).open(&path)?;
            f.set_len(good as u64)?;
            f.sync_all()?;
        }
        Ok(LogStore {
            inner: Arc::new(Mutex::new(inner)),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LogInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, SE> {
        Ok(self
            .lock()
            .entries
            .range(range)
            .map(|(_, e)| e.clone())
            .collect())
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, SE> {
        let g = self.lock();
        let last = g
            .entries
            .values()
            .next_back()
            .map(|e| e.log_id)
            .or(g.purged);
        Ok(LogState {
            last_purged_log_id: g.purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<u64>) -> Result<(), SE> {
        let mut g = self.lock();
        let b = serde_json::to_vec(vote).map_err(|e| StorageIOError::write_vote(&io_err(e)))?;
        write_atomic(&g.dir.join("vote.json"), &b, true)
            .map_err(|e| StorageIOError::write_vote(&e))?;
        g.vote = Some(*vote);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<u64>>, SE> {
        Ok(self.lock().vote)
    }

    async fn save_committed(&mut self, committed: Option<LogId<u64>>) -> Result<(), SE> {
        let mut g = self.lock();
        // At most every COMMITTED_WRITE_PERIOD: the file is a lower bound openraft applies up
        // to at start (a leader commits and applies the rest once elected), so a stale one
        // is correct. Writing it (a new file and a rename) on every commit was a seventh of
        // the control plane's time under replica reports.
        let due = g
            .committed_written
            .is_none_or(|t| t.elapsed() >= COMMITTED_WRITE_PERIOD);
        if due {
            let b =
                serde_json::to_vec(&committed).map_err(|e| StorageIOError::write(&io_err(e)))?;
            write_atomic(&g.dir.join("committed.json"), &b, false)
                .map_err(|e| StorageIOError::write(&e))?;
            g.committed_written = Some(std::time::Instant::now());
        }
        g.committed = committed;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<u64>>, SE> {
        Ok(self.lock().committed)
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), SE>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        let mut g = self.lock();
        let recs: Vec<Rec> = entries.into_iter().map(|e| Rec::Entry { e }).collect();
        match g.write_recs(&recs) {
            Ok(()) => {
                for r in recs {
                    g.apply_rec(r);
                }
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                let se = StorageIOError::write_logs(&e);
                callback.log_io_completed(Err(e));
                Err(se.into())
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId<u64>) -> Result<(), SE> {
        let mut g = self.lock();
        let r = Rec::Truncate { from: log_id.index };
        g.write_recs(std::slice::from_ref(&r))
            .map_err(|e| StorageIOError::write_logs(&e))?;
        g.apply_rec(r);
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId<u64>) -> Result<(), SE> {
        let mut g = self.lock();
        let r = Rec::Purge { upto: log_id };
        g.write_recs(std::slice::from_ref(&r))
            .map_err(|e| StorageIOError::write_logs(&e))?;
        g.apply_rec(r);
        if g.records > 2 * g.entries.len() + 256 {
            g.compact().map_err(|e| StorageIOError::write_logs(&e))?;
        }
        Ok(())
    }
}

// ------------------------------------------------------------------ state machine

const SNAP: &str = "snapshot.bin";

/// Snapshot file operations are serialized (a builder and an install may race).
#[derive(Clone)]
struct SnapFile {
    path: PathBuf,
    lock: Arc<Mutex<()>>,
}

impl SnapFile {
    fn read(&self) -> io::Result<Option<(Meta, Vec<u8>)>> {
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let data = match fs::read(&self.path) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let nl = data
            .iter()
            .position(|b| *b == b'\n')
            .ok_or_else(|| io_err("snapshot file has no meta line"))?;
        let meta = serde_json::from_slice(&data[..nl]).map_err(io_err)?;
        Ok(Some((meta, data[nl + 1..].to_vec())))
    }

    /// Persist unless a snapshot at least as new is already there.
    fn write(&self, meta: &SnapshotMeta<u64, BasicNode>, data: &[u8]) -> io::Result<()> {
        if let Some((cur, _)) = self.read()? {
            if cur.last_log_id >= meta.last_log_id && cur.snapshot_id != meta.snapshot_id {
                return Ok(());
            }
        }
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut buf = serde_json::to_vec(meta).map_err(io_err)?;
        buf.push(b'\n');
        buf.extend_from_slice(data);
        write_atomic(&self.path, &buf, true)
    }
}

pub struct SmStore {
    shared: Arc<Shared>,
    limits: Limits,
    last_applied: Option<LogId<u64>>,
    membership: Mem,
    snap: SnapFile,
}

impl SmStore {
    /// Load the persisted snapshot (if any) into `shared`.
    pub fn open(dir: &Path, shared: Arc<Shared>, limits: Limits) -> io::Result<Self> {
        let snap = SnapFile {
            path: dir.join(SNAP),
            lock: Arc::new(Mutex::new(())),
        };
        let mut sm = SmStore {
            shared,
            limits,
            last_applied: None,
            membership: Mem::default(),
            snap,
        };
        if let Some((meta, data)) = sm.snap.read()? {
            let img: CatalogImage = serde_json::from_slice(&data).map_err(io_err)?;
            sm.shared.replace(Catalog::from_image(limits, img));
            sm.last_applied = meta.last_log_id;
            sm.membership = meta.last_membership;
        }
        Ok(sm)
    }
}

pub struct SnapBuilder {
    image: Vec<u8>,
    last_applied: Option<LogId<u64>>,
    membership: Mem,
    snap: SnapFile,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, SE> {
        let id = match self.last_applied {
            Some(l) => format!("{}-{}-{}", l.leader_id.term, l.index, rand::random::<u32>()),
            None => format!("empty-{}", rand::random::<u32>()),
        };
        let meta = SnapshotMeta {
            last_log_id: self.last_applied,
            last_membership: self.membership.clone(),
            snapshot_id: id,
        };
        self.snap
            .write(&meta, &self.image)
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(self.image.clone())),
        })
    }
}

impl RaftStateMachine<TypeConfig> for SmStore {
    type SnapshotBuilder = SnapBuilder;

    async fn applied_state(&mut self) -> Result<(Option<LogId<u64>>, Mem), SE> {
        Ok((self.last_applied, self.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Resp>, SE>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        let mut out = Vec::new();
        for e in entries {
            self.last_applied = Some(e.log_id);
            out.push(match e.payload {
                EntryPayload::Blank => Resp(Ok(Reply::Done)),
                EntryPayload::Normal(cmd) => Resp(self.shared.apply(&cmd)),
                EntryPayload::Membership(m) => {
                    self.membership = StoredMembership::new(Some(e.log_id), m);
                    Resp(Ok(Reply::Done))
                }
            });
        }
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        let image = self
            .shared
            .read(|c| serde_json::to_vec(&c.to_image()))
            .expect("catalog image serializes");
        SnapBuilder {
            image,
            last_applied: self.last_applied,
            membership: self.membership.clone(),
            snap: self.snap.clone(),
        }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, SE> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<u64, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), SE> {
        let data = snapshot.into_inner();
        let img: CatalogImage = serde_json::from_slice(&data)
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), &io_err(e)))?;
        self.snap
            .write(meta, &data)
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        self.shared.replace(Catalog::from_image(self.limits, img));
        self.last_applied = meta.last_log_id;
        self.membership = meta.last_membership.clone();
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, SE> {
        let s = self
            .snap
            .read()
            .map_err(|e| StorageIOError::read_snapshot(None, &e))?;
        Ok(s.map(|(meta, data)| Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        }))
    }
}

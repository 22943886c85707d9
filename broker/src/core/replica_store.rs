//! The replica machine's storage effects carried out on real files (`core/replica/` is the
//! pure machine; this is the part of its driver that touches the disk):
//! - `Effect::Persist` (rules 3 and 5): the promise, the ballot and `led` in
//!   `replica-state.json` beside the shard's log, replaced atomically (temporary file,
//!   fdatasync, rename, directory fsync) before anything after it is carried out;
//! - `Effect::Append` (rule 6): records appended in their generations, with the timestamps
//!   the leader wrote, and waited for until the log acknowledges them, so that an answer
//!   carried out after it never claims what is not written;
//! - `Effect::Truncate` (rule 6): the divergent suffix cut with `Log::truncate_from`;
//! - a shipment's records read back from the log, checked against the generations the
//!   machine names.
//!
//! At open the machine's view (`Durable`, `GenLog`) is read back from the files, so a
//! restarted broker resumes from exactly what it had written. The shard host does not run
//! replicas yet: the tests below drive three machines over real logs.
#![cfg_attr(not(test), allow(dead_code))]

use super::replica::{Durable, GenLog, NodeId, Source};
use bytes::Bytes;
use felix_storage::record::FLAG_GEN_START;
use felix_storage::{Log, LogConfig, LogError, RecordIn};
use std::path::{Path, PathBuf};

/// The replica's durable promise, beside the shard's log segments.
pub(crate) const STATE_FILE: &str = "replica-state.json";

#[derive(serde::Serialize, serde::Deserialize)]
struct StateFile {
    promised: u64,
    ballot: Option<NodeId>,
    led: u64,
    /// The retention hold (rule 10): the commit mark this replica had learnt when the file
    /// was written. It lags the mark (written with the promise, and every
    /// [`HOLD_PERSIST_EVERY_RECORDS`]), which only keeps more.
    #[serde(default)]
    hold: u64,
}

/// The retention hold is written again once the learnt mark has moved this many records past
/// the one on disk (a lagging hold keeps more records, never fewer).
pub(crate) const HOLD_PERSIST_EVERY_RECORDS: u64 = 4096;

/// One record as a shipment carries it: what the leader's log holds at its offset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Carried {
    pub gen: u64,
    pub ts_ms: u64,
    pub flags: u8,
    pub payload: Bytes,
}

/// The records an `Effect::Append` from `source` writes: the generation-start record, the
/// client record just proposed, or the shipment just handed in from `skip` on.
pub(crate) fn records_for(
    source: Source,
    gens: &[u64],
    client: &[Carried],
    in_hand: &[Carried],
    now_wall_ms: u64,
) -> Result<Vec<Carried>, String> {
    let recs = match source {
        Source::Start => vec![Carried {
            gen: gens[0],
            ts_ms: now_wall_ms,
            flags: FLAG_GEN_START,
            payload: Bytes::new(),
        }],
        Source::Client if client.is_empty() => {
            return Err("a client append with no client record".into())
        }
        Source::Client => client.to_vec(),
        Source::Shipment { skip } => in_hand.get(skip..).unwrap_or_default().to_vec(),
    };
    if !recs.iter().map(|r| r.gen).eq(gens.iter().copied()) {
        return Err(format!(
            "the machine appends generations {gens:?} from {source:?}, the records are of {:?}",
            recs.iter().map(|r| r.gen).collect::<Vec<_>>()
        ));
    }
    Ok(recs)
}

pub(crate) struct ReplicaStore {
    dir: PathBuf,
    log: Log,
    /// What `replica-state.json` holds now.
    durable: Durable,
    hold_on_disk: u64,
}

impl ReplicaStore {
    /// Open the shard's replica state and log in `dir`; the machine's view of both.
    pub(crate) async fn open(
        dir: &Path,
        cfg: LogConfig,
    ) -> Result<(ReplicaStore, Durable, GenLog), String> {
        let (durable, hold) = match std::fs::read(dir.join(STATE_FILE)) {
            Ok(b) => {
                let s: StateFile = serde_json::from_slice(&b).map_err(|e| {
                    format!("{} is unreadable: {e}", dir.join(STATE_FILE).display())
                })?;
                let d = Durable {
                    promised: s.promised,
                    ballot: s.ballot,
                    led: s.led,
                };
                (d, s.hold)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (Durable::default(), 0),
            Err(e) => return Err(format!("read {}: {e}", dir.join(STATE_FILE).display())),
        };
        // Rule 10: the hold is in force from open, before any retention sweep.
        let cfg = LogConfig {
            retention_hold: Some(hold),
            ..cfg
        };
        let (log, _) = Log::open(dir, cfg)
            .await
            .map_err(|e| format!("open the log in {}: {e}", dir.display()))?;
        let view = gen_view(&log)?;
        let store = ReplicaStore {
            dir: dir.to_path_buf(),
            log,
            durable,
            hold_on_disk: hold,
        };
        Ok((store, durable, view))
    }

    /// Retention stops at `known_commit` (rule 10); written to disk with the promise, or once
    /// it has moved [`HOLD_PERSIST_EVERY_RECORDS`] past what the file says.
    pub(crate) async fn hold_at(&mut self, known_commit: u64) -> Result<(), String> {
        let now = self.log.retention_hold().unwrap_or(0);
        if known_commit > now {
            self.log.set_retention_hold(Some(known_commit));
        }
        if known_commit >= self.hold_on_disk + HOLD_PERSIST_EVERY_RECORDS {
            self.write_state(self.durable, known_commit).await?;
        }
        Ok(())
    }

    pub(crate) fn log(&self) -> &Log {
        &self.log
    }

    /// `Effect::Persist`: durable before it returns.
    pub(crate) async fn persist(&mut self, d: Durable) -> Result<(), String> {
        let hold = self.log.retention_hold().unwrap_or(0);
        self.write_state(d, hold).await
    }

    async fn write_state(&mut self, d: Durable, hold: u64) -> Result<(), String> {
        let bytes = serde_json::to_vec(&StateFile {
            promised: d.promised,
            ballot: d.ballot,
            led: d.led,
            hold,
        })
        .expect("the state serializes");
        let dir = self.dir.clone();
        glommio::executor()
            .spawn_blocking(move || super::atomic_write(&dir, STATE_FILE, &bytes))
            .await
            .map_err(|e| format!("write {STATE_FILE}: {e}"))?;
        self.durable = d;
        self.hold_on_disk = hold;
        Ok(())
    }

    /// `Effect::Truncate`.
    pub(crate) async fn truncate(&self, from: u64) -> Result<(), LogError> {
        self.log.truncate_from(from).await
    }

    /// `Effect::Append { at, gens, .. }` with its records: appended in their generations
    /// (consecutive records of one generation in one append), then waited for until the log
    /// acknowledges them.
    pub(crate) async fn append(
        &self,
        at: u64,
        gens: &[u64],
        records: &[Carried],
    ) -> Result<(), String> {
        if self.log.next_offset() != at {
            return Err(format!(
                "the machine appends at {at}, the log's next offset is {}",
                self.log.next_offset()
            ));
        }
        assert!(records.iter().map(|r| r.gen).eq(gens.iter().copied()));
        let mut end = at;
        for run in records.chunk_by(|a, b| a.gen == b.gen) {
            let ins: Vec<RecordIn> = run
                .iter()
                .map(|r| RecordIn {
                    key: &[],
                    payload: &r.payload,
                    flags: r.flags,
                })
                .collect();
            let r = self
                .log
                .append_stamped(run[0].gen, &ins, |k| run[k].ts_ms)
                .map_err(|e| e.to_string())?;
            assert_eq!(r.start, end, "appends are contiguous");
            end = r.end;
        }
        self.log.wait_acked(end).await.map_err(|e| e.to_string())
    }

    /// The records a shipment of `gens` from `start` carries, read from the log; each must be
    /// of the generation the machine names.
    pub(crate) async fn read_shipment(
        &self,
        start: u64,
        gens: &[u64],
    ) -> Result<Vec<Carried>, String> {
        let mut out: Vec<Carried> = Vec::with_capacity(gens.len());
        // Bounded: every read returns at least one record or fails.
        while out.len() < gens.len() {
            let at = start + out.len() as u64;
            let want = gens.len() - out.len();
            let got = self
                .log
                .read(at, want, 1 << 20)
                .await
                .map_err(|e| format!("read the shipment at {at}: {e}"))?;
            if got.is_empty() {
                return Err(format!("nothing to ship at {at}"));
            }
            for r in got.into_iter().take(want) {
                let k = (r.offset - start) as usize;
                if r.gen != gens[k] {
                    return Err(format!(
                        "the log holds generation {} at offset {}, the machine names {}",
                        r.gen, r.offset, gens[k]
                    ));
                }
                out.push(Carried {
                    gen: r.gen,
                    ts_ms: r.ts_ms,
                    flags: r.flags,
                    payload: r.payload,
                });
            }
        }
        Ok(out)
    }
}

/// The machine's view of a log: the generation runs of what is written. A log trimmed by
/// retention (its oldest offset above 0) is not replicated yet (rule 10 is not built).
fn gen_view(log: &Log) -> Result<GenLog, String> {
    if log.oldest_offset() > 0 {
        return Err(format!(
            "the log starts at offset {}: a log trimmed by retention cannot be replicated yet",
            log.oldest_offset()
        ));
    }
    let runs = log.gen_runs().into_iter().map(|r| (r.first, r.gen));
    GenLog::from_runs(runs, log.written())
}

#[cfg(test)]
mod tests;

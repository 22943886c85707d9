//! The replica machine's storage effects carried out on real files (`core/replica/` is the
//! pure machine; this is the part of its driver that touches the disk):
//! - `Effect::Persist` (rules 3 and 5): the promise, the ballot and `led` in
//!   `replica-state.json` beside the shard's log, replaced atomically (temporary file,
//!   fdatasync, rename, directory fsync) before anything after it is carried out;
//! - `Effect::Append` (rule 6): records appended in their generations, with the timestamps
//!   the leader wrote, and waited for until the log acknowledges them, so that an answer
//!   carried out after it never claims what is not written;
//! - `Effect::Truncate` (rule 6): the divergent suffix cut with `Log::truncate_from`;
//! - `Effect::Rebuild` (rule 10): the log emptied and continued at the leader's base with
//!   `Log::restart_at`;
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

/// The newest records kept in memory for shipments and the hand-over to readers, at most
/// (older ones are read back from the log).
pub(crate) const RECENT_RECORDS_MAX: usize = 8192;
/// Payload bytes of the newest records kept in memory, at most.
pub(crate) const RECENT_BYTES_MAX: usize = 16 << 20;

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
    /// The newest records appended, from offset `recent_first` on, contiguous and bounded:
    /// a shipment or a hand-over of them is served from memory, not read back.
    recent: std::collections::VecDeque<Carried>,
    recent_first: u64,
    recent_bytes: usize,
    /// Appended, not yet waited for: the log acknowledges everything below this before any
    /// answer leaves (`settle`).
    unsettled: u64,
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
        let next = log.next_offset();
        let store = ReplicaStore {
            dir: dir.to_path_buf(),
            log,
            durable,
            hold_on_disk: hold,
            recent: std::collections::VecDeque::new(),
            recent_first: next,
            recent_bytes: 0,
            unsettled: 0,
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
    pub(crate) async fn truncate(&mut self, from: u64) -> Result<(), LogError> {
        self.settle().await.map_err(LogError::Failed)?;
        let keep = from.saturating_sub(self.recent_first) as usize;
        while self.recent.len() > keep {
            let r = self.recent.pop_back().expect("non-empty");
            self.recent_bytes -= r.payload.len();
        }
        if from < self.recent_first {
            self.recent_first = from;
        }
        self.log.truncate_from(from).await
    }

    /// `Effect::Rebuild`: the log emptied and continued at `base` (`Log::restart_at`, crash-safe
    /// at every step).
    pub(crate) async fn rebuild(&mut self, base: u64) -> Result<(), String> {
        self.settle().await?;
        self.recent.clear();
        self.recent_bytes = 0;
        self.recent_first = base;
        self.log
            .restart_at(base)
            .await
            .map_err(|e| format!("rebuild the log from {base}: {e}"))
    }

    /// Wait until the log acknowledged everything appended: run before anything that tells
    /// another party what this log holds (an answer, a report, an acknowledgement).
    pub(crate) async fn settle(&mut self) -> Result<(), String> {
        if self.unsettled > 0 {
            let upto = std::mem::take(&mut self.unsettled);
            self.log.wait_acked(upto).await.map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Keep `records`, appended at `at`, among the newest (bounded).
    fn remember(&mut self, at: u64, records: &[Carried]) {
        if at != self.recent_first + self.recent.len() as u64 {
            self.recent.clear();
            self.recent_bytes = 0;
            self.recent_first = at;
        }
        for r in records {
            self.recent_bytes += r.payload.len();
            self.recent.push_back(r.clone());
        }
        while self.recent.len() > RECENT_RECORDS_MAX || self.recent_bytes > RECENT_BYTES_MAX {
            let r = self.recent.pop_front().expect("over a bound: non-empty");
            self.recent_bytes -= r.payload.len();
            self.recent_first += 1;
        }
    }

    /// Records `start..start + n` from memory, if all of them are among the newest.
    fn recent_range(&self, start: u64, n: usize) -> Option<Vec<Carried>> {
        let skip = start.checked_sub(self.recent_first)? as usize;
        if skip + n > self.recent.len() {
            return None;
        }
        Some(self.recent.range(skip..skip + n).cloned().collect())
    }

    /// Committed records from `from`, at most `records_max` and (roughly) `bytes_max`, below
    /// `below`: from memory when they are among the newest, else read back from the log.
    pub(crate) async fn read_committed(
        &self,
        from: u64,
        below: u64,
        records_max: usize,
        bytes_max: usize,
    ) -> Result<Vec<Bytes>, String> {
        let want = (below.saturating_sub(from) as usize).min(records_max);
        if let Some(recs) = self.recent_range(from, want) {
            let mut bytes = 0;
            return Ok(recs
                .into_iter()
                .take_while(|r| {
                    bytes += r.payload.len();
                    bytes <= bytes_max || bytes == r.payload.len()
                })
                .map(|r| r.payload)
                .collect());
        }
        let got = self
            .log
            .read(from, want, bytes_max)
            .await
            .map_err(|e| format!("read the committed records at {from}: {e}"))?;
        Ok(got
            .into_iter()
            .take(want)
            .enumerate()
            .map(|(k, r)| {
                assert_eq!(r.offset, from + k as u64, "a log read is contiguous");
                r.payload
            })
            .collect())
    }

    /// `Effect::Append { at, gens, .. }` with its records: appended in their generations
    /// (consecutive records of one generation in one append). The log acknowledges them
    /// before any answer leaves ([`ReplicaStore::settle`]).
    pub(crate) async fn append(
        &mut self,
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
            // One append is one commit: a shipment of large records takes several.
            let mut k = 0;
            while k < run.len() {
                let n = self.fitting(&run[k..]);
                let chunk = &run[k..k + n];
                let r = self.append_one(chunk, end).await?;
                assert_eq!(r.start, end, "appends are contiguous");
                end = r.end;
                k += n;
            }
        }
        self.remember(at, records);
        self.unsettled = self.unsettled.max(end);
        Ok(())
    }

    /// How many of `run`'s first records fit in one append (at least one: a record too
    /// large for any commit is refused by the log).
    fn fitting(&self, run: &[Carried]) -> usize {
        let max = self.log.append_bytes_max();
        let mut bytes = 0;
        let n = run
            .iter()
            .take_while(|r| {
                bytes += record_in(r).encoded_len();
                bytes <= max
            })
            .count();
        n.max(1)
    }

    /// Append `chunk` (one generation, fitting one commit) at the log's end, `end`. The log's
    /// queue of unwritten bytes is bounded: when full, wait until what is queued is written,
    /// then try once more.
    async fn append_one(
        &mut self,
        chunk: &[Carried],
        end: u64,
    ) -> Result<std::ops::Range<u64>, String> {
        let ins: Vec<RecordIn> = chunk.iter().map(record_in).collect();
        let gen = chunk[0].gen;
        let ts = |k: usize| chunk[k].ts_ms;
        match self.log.append_stamped(gen, &ins, ts) {
            Err(LogError::Backpressure { .. }) => {
                self.log.wait_acked(end).await.map_err(|e| e.to_string())?;
                self.log.append_stamped(gen, &ins, ts)
            }
            r => r,
        }
        .map_err(|e| e.to_string())
    }

    /// The records a shipment of `gens` from `start` carries, read from the log; each must be
    /// of the generation the machine names. `None` when retention removed some of them (it
    /// runs on the log's own task, rule 10): the shipment is not sent.
    pub(crate) async fn read_shipment(
        &self,
        start: u64,
        gens: &[u64],
    ) -> Result<Option<Vec<Carried>>, String> {
        if let Some(recs) = self.recent_range(start, gens.len()) {
            if recs.iter().map(|r| r.gen).eq(gens.iter().copied()) {
                return Ok(Some(recs));
            }
            return Err(format!(
                "the newest records from {start} are of generations {:?}, the machine names {gens:?}",
                recs.iter().map(|r| r.gen).collect::<Vec<_>>()
            ));
        }
        let mut out: Vec<Carried> = Vec::with_capacity(gens.len());
        // Bounded: every round takes the rest from memory, or reads at least one record, or
        // fails.
        while out.len() < gens.len() {
            let at = start + out.len() as u64;
            let want = gens.len() - out.len();
            // The rest may be just appended and not yet acknowledged, which the log does not
            // read back (a new leader's generation-start record shipped at once to a
            // follower catching up from below it): the newest records are in memory.
            if let Some(recs) = self.recent_range(at, want) {
                for (k, r) in recs.iter().enumerate() {
                    if r.gen != gens[out.len() + k] {
                        return Err(format!(
                            "the newest record at {} is of generation {}, the machine names {}",
                            at + k as u64,
                            r.gen,
                            gens[out.len() + k]
                        ));
                    }
                }
                out.extend(recs);
                break;
            }
            let got = match self.log.read(at, want, 1 << 20).await {
                Ok(got) => got,
                Err(LogError::BelowRetention { .. }) => return Ok(None),
                Err(e) => return Err(format!("read the shipment at {at}: {e}")),
            };
            if got.is_empty() {
                // Appended, not yet acknowledged, and no longer among the newest in memory
                // (more unwritten than memory keeps): wait until the log holds it.
                if at < self.log.next_offset() && self.log.acked() <= at {
                    self.log
                        .wait_acked(at + 1)
                        .await
                        .map_err(|e| format!("wait for the shipment at {at}: {e}"))?;
                    continue;
                }
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
        Ok(Some(out))
    }
}

/// The machine's view of a log: the generation runs of what is written, from the oldest
/// offset retention left (rule 10).
fn gen_view(log: &Log) -> Result<GenLog, String> {
    let runs = log.gen_runs().into_iter().map(|r| (r.first, r.gen));
    GenLog::from_runs(runs, log.oldest_offset(), log.written())
}

#[cfg(test)]
mod tests;

fn record_in(r: &Carried) -> RecordIn<'_> {
    RecordIn {
        key: &[],
        payload: &r.payload,
        flags: r.flags,
    }
}

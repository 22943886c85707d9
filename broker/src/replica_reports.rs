//! Replica reports between the cores and the control plane (replication rule 7). A hosted
//! replica that leads reports who holds what; placement must store the report before the
//! leader may move its commit mark. Cores run on glommio and the control-plane link on the
//! ops thread's tokio runtime, so the two meet here: a core queues a report, the ops thread
//! posts it (`POST .../streams/{s}/shards/{i}/report`) and leaves the answer in the queue of
//! the core that asked, which the core takes on its next flush round.

use felix_control::replication::{Report, ReportAnswer};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Reports posted and answered by the control plane (any answer).
pub static REPORTS_POSTED: AtomicU64 = AtomicU64::new(0);
/// Reports whose post failed (no answer: the control plane unreachable, or an error status);
/// the replica reports again on a tick.
pub static REPORTS_FAILED: AtomicU64 = AtomicU64::new(0);

/// The report counters in Prometheus text.
pub fn render(out: &mut String) {
    for (name, help, c) in [
        (
            "felix_replica_reports_posted_total",
            "replica reports this broker posted to the control plane and got an answer to",
            &REPORTS_POSTED,
        ),
        (
            "felix_replica_reports_failed_total",
            "replica reports whose post to the control plane failed (sent again on a tick)",
            &REPORTS_FAILED,
        ),
    ] {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}\n",
            c.load(Ordering::Relaxed)
        ));
    }
}

/// Reports waiting to be posted, across every core; past it, new ones are dropped (the
/// replica sends its report again on a tick while none has landed).
pub const REPORTS_QUEUED_MAX: usize = 4096;

/// One report to post, and where its answer goes.
#[derive(Debug, Clone)]
pub struct ReportJob {
    pub core: usize,
    /// The shard's key on that core (stream slot, shard).
    pub key: (u32, u32),
    pub tenant: String,
    pub namespace: String,
    pub stream: String,
    pub shard: u32,
    pub report: Report,
}

/// Answers for one core: (shard key on that core, answer).
pub type Answers = Vec<((u32, u32), ReportAnswer)>;

#[derive(Debug)]
pub struct ReportBox {
    jobs: Mutex<VecDeque<ReportJob>>,
    /// Wakes the ops thread's poster.
    pub wake: tokio::sync::Notify,
    /// Per core: answers to hand to its replicas.
    answers: Vec<Mutex<Answers>>,
    /// Per core: its reports queued or being posted. The ops thread cannot wake a core, so a
    /// core with a report out polls for the answer ([`ReportBox::awaited`]).
    out: Vec<AtomicUsize>,
}

impl ReportBox {
    pub fn new(cores: usize) -> ReportBox {
        ReportBox {
            jobs: Mutex::new(VecDeque::new()),
            wake: tokio::sync::Notify::new(),
            answers: (0..cores).map(|_| Mutex::new(Vec::new())).collect(),
            out: (0..cores).map(|_| AtomicUsize::new(0)).collect(),
        }
    }

    /// Whether `core` waits for an answer or has one to take.
    pub fn awaited(&self, core: usize) -> bool {
        let out = self
            .out
            .get(core)
            .is_some_and(|o| o.load(Ordering::Acquire) > 0);
        out || self
            .answers
            .get(core)
            .is_some_and(|m| !m.lock().unwrap_or_else(|p| p.into_inner()).is_empty())
    }

    /// The report of `core` was posted (answered or not): one fewer out.
    pub fn posted(&self, core: usize) {
        if let Some(o) = self.out.get(core) {
            let _ = o.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        }
    }

    /// Queue a report (false: the queue is full, and it was dropped).
    pub fn push(&self, job: ReportJob) -> bool {
        let mut q = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() >= REPORTS_QUEUED_MAX {
            return false;
        }
        if let Some(o) = self.out.get(job.core) {
            o.fetch_add(1, Ordering::AcqRel);
        }
        q.push_back(job);
        drop(q);
        self.wake.notify_one();
        true
    }

    pub fn pop(&self) -> Option<ReportJob> {
        self.jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front()
    }

    pub fn answer(&self, core: usize, key: (u32, u32), a: ReportAnswer) {
        if let Some(m) = self.answers.get(core) {
            m.lock().unwrap_or_else(|p| p.into_inner()).push((key, a));
        }
    }

    /// The answers for `core` that arrived since it last asked.
    pub fn take_answers(&self, core: usize) -> Answers {
        match self.answers.get(core) {
            Some(m) => std::mem::take(&mut *m.lock().unwrap_or_else(|p| p.into_inner())),
            None => Vec::new(),
        }
    }
}

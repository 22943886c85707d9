//! Replica reports between the cores and the control plane (replication rule 7). A hosted
//! replica that leads reports who holds what; placement must store the report before the
//! leader may move its commit mark. Cores run on glommio and the control-plane link on the
//! ops thread's tokio runtime, so the two meet here: a core queues a report, the ops thread
//! posts it (`POST .../streams/{s}/shards/{i}/report`) and leaves the answer in the queue of
//! the core that asked, which the core takes on its next flush round.

use felix_control::replication::{Report, ReportAnswer};
use std::collections::VecDeque;
use std::sync::Mutex;

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
}

impl ReportBox {
    pub fn new(cores: usize) -> ReportBox {
        ReportBox {
            jobs: Mutex::new(VecDeque::new()),
            wake: tokio::sync::Notify::new(),
            answers: (0..cores).map(|_| Mutex::new(Vec::new())).collect(),
        }
    }

    /// Queue a report (false: the queue is full, and it was dropped).
    pub fn push(&self, job: ReportJob) -> bool {
        let mut q = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() >= REPORTS_QUEUED_MAX {
            return false;
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

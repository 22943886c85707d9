//! Replica reports between the cores and the control plane (replication rule 7). A hosted
//! replica that leads reports who holds what; placement must store the report before the
//! leader may move its commit mark. Cores run on glommio and the control-plane link on the
//! ops thread's tokio runtime, so the two meet here: a core queues a report, the ops thread
//! posts it (`POST .../streams/{s}/shards/{i}/report`) and leaves the answer in the queue of
//! the core that asked, then rings that core's doorbell (a one-byte loopback datagram), and
//! the core hands the answer to its replica at once. A `quorum` acknowledgement waits for
//! that answer: before the doorbell, a core polled for answers every millisecond, and the
//! doorbell gained 18 % of acknowledgements per second (bench-results/2026-12-07-replicated.md).

use felix_control::replication::{Report, ReportAnswer};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Reports posted and answered by the control plane (any answer).
pub static REPORTS_POSTED: AtomicU64 = AtomicU64::new(0);
/// Reports whose post failed (no answer: the control plane unreachable, or an error status);
/// the replica reports again on a tick.
pub static REPORTS_FAILED: AtomicU64 = AtomicU64::new(0);

/// Doorbells rung: datagrams the ops thread sent a core to take its answers.
pub static DOORBELLS_RUNG: AtomicU64 = AtomicU64::new(0);
/// Doorbells heard: datagrams a core's doorbell task received.
pub static DOORBELLS_HEARD: AtomicU64 = AtomicU64::new(0);

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
        (
            "felix_replica_report_doorbells_rung_total",
            "report answers the ops thread told a core of (one datagram for any number waiting)",
            &DOORBELLS_RUNG,
        ),
        (
            "felix_replica_report_doorbells_heard_total",
            "doorbell datagrams the cores received (each takes the answers waiting)",
            &DOORBELLS_HEARD,
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
    /// Per core: its reports queued or being posted. A core with a report out also polls for
    /// the answer ([`ReportBox::awaited`]), in case a doorbell is lost.
    out: Vec<AtomicUsize>,
    /// Per core: the loopback UDP port of its doorbell (0: none yet). The ops thread runs on
    /// tokio and cannot wake a glommio executor, so it sends the core a one-byte datagram
    /// when an answer arrives: a `quorum` acknowledgement waits for that answer (rule 7).
    doorbells: Vec<AtomicU16>,
    /// Per core: a doorbell was rung and the core has not taken the answers since (one
    /// datagram for any number of answers).
    rung: Vec<AtomicBool>,
    /// The ops thread's socket for ringing (non-blocking; bound once, on first use).
    ringer: std::sync::OnceLock<Option<std::net::UdpSocket>>,
}

impl ReportBox {
    pub fn new(cores: usize) -> ReportBox {
        ReportBox {
            jobs: Mutex::new(VecDeque::new()),
            wake: tokio::sync::Notify::new(),
            answers: (0..cores).map(|_| Mutex::new(Vec::new())).collect(),
            out: (0..cores).map(|_| AtomicUsize::new(0)).collect(),
            doorbells: (0..cores).map(|_| AtomicU16::new(0)).collect(),
            rung: (0..cores).map(|_| AtomicBool::new(false)).collect(),
            ringer: std::sync::OnceLock::new(),
        }
    }

    /// Core `core` takes its answers when a datagram reaches 127.0.0.1:`port`.
    pub fn set_doorbell(&self, core: usize, port: u16) {
        if let Some(d) = self.doorbells.get(core) {
            d.store(port, Ordering::Release);
        }
    }

    /// Tell `core` it has answers to take, unless it was told already.
    fn ring(&self, core: usize) {
        let port = self
            .doorbells
            .get(core)
            .map_or(0, |d| d.load(Ordering::Acquire));
        if port == 0
            || self
                .rung
                .get(core)
                .is_none_or(|r| r.swap(true, Ordering::AcqRel))
        {
            return;
        }
        let ringer = self.ringer.get_or_init(|| {
            let s = std::net::UdpSocket::bind("127.0.0.1:0").ok()?;
            s.set_nonblocking(true).ok()?;
            Some(s)
        });
        // A datagram lost (a full socket buffer) costs the core's poll interval, no more.
        if let Some(s) = ringer {
            if s.send_to(&[1], (std::net::Ipv4Addr::LOCALHOST, port))
                .is_ok()
            {
                DOORBELLS_RUNG.fetch_add(1, Ordering::Relaxed);
            }
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
            self.ring(core);
        }
    }

    /// The answers for `core` that arrived since it last asked.
    pub fn take_answers(&self, core: usize) -> Answers {
        // Cleared before taking: an answer pushed after this rings again.
        if let Some(r) = self.rung.get(core) {
            r.store(false, Ordering::Release);
        }
        match self.answers.get(core) {
            Some(m) => std::mem::take(&mut *m.lock().unwrap_or_else(|p| p.into_inner())),
            None => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// An answer rings the core's doorbell once, however many follow before the core takes
    /// them; once taken, the next answer rings again.
    #[test]
    fn an_answer_rings_the_cores_doorbell_once_until_taken() {
        let bell = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        bell.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let b = ReportBox::new(2);
        b.set_doorbell(1, bell.local_addr().unwrap().port());
        let stale = ReportAnswer::Stale { gen: 1, seq: 1 };
        let rings = |n: usize| {
            let mut buf = [0u8; 8];
            for i in 0..n {
                assert!(bell.recv(&mut buf).is_ok(), "ring {i} of {n}");
            }
            assert!(bell.recv(&mut buf).is_err(), "no more than {n}");
        };
        b.answer(1, (0, 0), stale.clone());
        b.answer(1, (0, 1), stale.clone());
        rings(1);
        assert_eq!(b.take_answers(1).len(), 2);
        b.answer(1, (0, 0), stale.clone());
        rings(1);
        // Core 0 has no doorbell: its answers wait for its poll.
        b.answer(0, (0, 0), stale);
        rings(0);
        assert_eq!(b.take_answers(0).len(), 1);
    }
}

//! Three replica machines over real logs (glommio DMA files in temporary directories), with
//! placement in process and an in-memory network the test steers: a failover that cuts a
//! deposed leader's unacknowledged suffix on disk, and a restart from the files.

use super::*;
use crate::core::replica::{Msg, Replica, ReplicaCfg, ReportAnswer};
use crate::core::replica_driver::{Input, Output, ReplicaDriver, ServingEvent};
use felix_control::replication::Placement;
use felix_quic::wire::replica::ShippedRecord;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

const CFG: ReplicaCfg = ReplicaCfg {
    lease_ms: 1_000,
    margin_ms: 250,
    renew_ms: 300,
    batch_max: 4,
    quorum_wait_ms: 5_000,
};

/// Every loop of the harness ends within this many rounds (or the test fails).
const ROUNDS_MAX: usize = 10_000;

fn log_cfg() -> LogConfig {
    LogConfig {
        segment_bytes_max: 64 << 10,
        commit_bytes_max: 16 << 10,
        fsync: felix_storage::FsyncMode::OnCommit,
        ..LogConfig::default()
    }
}

struct Node {
    d: ReplicaDriver,
    dir: PathBuf,
}

struct Harness {
    nodes: BTreeMap<NodeId, Node>,
    placement: Placement,
    /// In order: (from, to, message, the records a shipment carries).
    net: VecDeque<(NodeId, NodeId, Msg, Vec<ShippedRecord>)>,
    /// Placement's answers, in order.
    answers: VecDeque<(NodeId, ReportAnswer)>,
    /// A node cut off from its peers and from placement (frozen, or partitioned away): what
    /// it sends and what is sent to it waits here until the cut heals.
    cut: Option<NodeId>,
    held: Vec<(NodeId, NodeId, Msg, Vec<ShippedRecord>)>,
    held_reports: Vec<(NodeId, crate::core::replica::Report)>,
    /// The cut loses messages instead of holding them (a node that was down).
    lossy: bool,
    /// The machines' clock (ms); the wall clock of record timestamps is the same.
    now: u64,
    /// Acknowledged client records: offset → payload.
    acked: BTreeMap<u64, Bytes>,
    /// Offsets answered "cannot vouch".
    not_vouched: BTreeSet<u64>,
    /// What the leaders handed over to readers (`Output::Visible`): offset → payload.
    visible: BTreeMap<u64, Bytes>,
    /// Each serving leader's next offset to hand over.
    next_visible: BTreeMap<NodeId, u64>,
    /// Each `Output::Rebuilt`: (node, base).
    rebuilt: Vec<(NodeId, u64)>,
    /// Serving intervals that ended, from the drivers' events: (node, generation, from, to),
    /// in ms, both ends counted.
    served: Vec<(NodeId, u64, u64, u64)>,
    /// Serving intervals still open: node → (generation, from).
    serving: BTreeMap<NodeId, (u64, u64)>,
}

async fn open_node(root: &Path, n: NodeId) -> Node {
    let dir = root.join(format!("n{n}"));
    let d = ReplicaDriver::open(n, 100 + n, vec![1, 2, 3], &dir, log_cfg(), CFG)
        .await
        .unwrap();
    Node { d, dir }
}

impl Harness {
    async fn new(root: &Path) -> Harness {
        let mut nodes = BTreeMap::new();
        for n in 1..=3u64 {
            let node = open_node(root, n).await;
            let r = node.d.replica();
            assert_eq!((r.durable(), r.log().end()), (Durable::default(), 0));
            nodes.insert(n, node);
        }
        let placement = Placement::new((1..=3).map(|n| (n, 100 + n)).collect());
        Harness {
            nodes,
            placement,
            net: VecDeque::new(),
            answers: VecDeque::new(),
            cut: None,
            held: Vec::new(),
            held_reports: Vec::new(),
            lossy: false,
            now: 1_000,
            acked: BTreeMap::new(),
            not_vouched: BTreeSet::new(),
            visible: BTreeMap::new(),
            next_visible: BTreeMap::new(),
            rebuilt: Vec::new(),
            served: Vec::new(),
            serving: BTreeMap::new(),
        }
    }

    /// Take `n`'s serving changes, and check that no two replicas ever served at once (rules
    /// 2 and 4): an open interval runs to the end of the lease it serves under.
    fn note_serving(&mut self, n: NodeId) {
        for e in self.nodes.get_mut(&n).unwrap().d.take_serving_events() {
            match e {
                ServingEvent::Started { gen, at_ms } => {
                    let old = self.serving.insert(n, (gen, at_ms));
                    assert!(old.is_none(), "node {n} started serving twice: {old:?}");
                }
                ServingEvent::Ended { gen, at_ms } => {
                    let (g, from) = self.serving.remove(&n).expect("an end follows a start");
                    assert_eq!(g, gen, "node {n} ends the generation it served");
                    assert!(from <= at_ms, "node {n}: an interval ends before it starts");
                    self.served.push((n, gen, from, at_ms));
                }
            }
        }
        let mut all = self.served.clone();
        for (&m, &(gen, from)) in &self.serving {
            let (_, until) = self.nodes[&m]
                .d
                .serving_until()
                .expect("open while serving");
            all.push((m, gen, from, until));
        }
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert!(
                    a.0 == b.0 || a.3 < b.2 || b.3 < a.2,
                    "two replicas served at once: node {} (generation {}) over {}..={} ms and node {} (generation {}) over {}..={} ms",
                    a.0, a.1, a.2, a.3, b.0, b.1, b.2, b.3
                );
            }
        }
    }

    /// The nodes that served at some time.
    fn servers(&self) -> BTreeSet<NodeId> {
        let ended = self.served.iter().map(|s| s.0);
        ended.chain(self.serving.keys().copied()).collect()
    }

    fn post(&mut self, from: NodeId, to: NodeId, msg: Msg, recs: Vec<ShippedRecord>) {
        if self.cut.is_some_and(|c| c == from || c == to) {
            if !self.lossy {
                self.held.push((from, to, msg, recs));
            }
        } else {
            self.net.push_back((from, to, msg, recs));
        }
    }

    /// Hand `n`'s driver one input and route what comes out.
    async fn input(&mut self, n: NodeId, input: Input) -> Vec<Output> {
        let now = self.now;
        let outs = self
            .nodes
            .get_mut(&n)
            .unwrap()
            .d
            .handle(input, now, now)
            .await
            .unwrap();
        self.note_serving(n);
        let mut rest = Vec::new();
        for o in outs {
            match o {
                Output::Send { to, msg, records } => self.post(n, to, msg, records),
                Output::Report(r) if self.cut == Some(n) => self.held_reports.push((n, r)),
                Output::Report(r) => {
                    let a = self.placement.on_report(&r);
                    self.answers.push_back((n, a));
                }
                Output::Ack { from, below } => {
                    let log = self.nodes[&n].d.store().log().clone();
                    for o in from..below {
                        let r = log.read(o, 1, 1 << 20).await.unwrap();
                        if r[0].flags & FLAG_GEN_START == 0 {
                            let old = self.acked.insert(o, r[0].payload.clone());
                            assert!(
                                old.is_none_or(|p| p == r[0].payload),
                                "offset {o} acknowledged twice, with different records"
                            );
                        }
                    }
                }
                Output::CannotVouch { from, below } => self.not_vouched.extend(from..below),
                Output::Rebuilt { base } => self.rebuilt.push((n, base)),
                Output::Serving { from } => {
                    self.next_visible.insert(n, from);
                }
                Output::Visible { first, payloads } => {
                    let next = self.next_visible.get_mut(&n).expect("Serving came first");
                    assert_eq!(*next, first, "node {n} hands over contiguously");
                    *next += payloads.len() as u64;
                    for (k, p) in payloads.into_iter().enumerate() {
                        let o = first + k as u64;
                        let old = self.visible.insert(o, p.clone());
                        assert!(
                            old.is_none_or(|q| q == p),
                            "offset {o} was visible with another record: a reader saw a record a failover cut"
                        );
                    }
                }
                other => rest.push(other),
            }
        }
        rest
    }

    /// Deliver everything in flight (answers from placement first).
    async fn settle(&mut self) {
        for _ in 0..ROUNDS_MAX {
            if let Some((n, a)) = self.answers.pop_front() {
                self.input(n, Input::ReportAnswer(a)).await;
                continue;
            }
            let Some((_, to, msg, records)) = self.net.pop_front() else {
                return;
            };
            self.input(to, Input::Msg { msg, records }).await;
        }
        panic!("the replicas never went quiet");
    }

    /// Advance the clock by `ms` in renewal-sized ticks of every node, settling each.
    async fn run_for(&mut self, ms: u64) {
        let until = self.now + ms;
        while self.now < until {
            self.now += 100;
            for n in 1..=3 {
                self.input(n, Input::Tick).await;
            }
            self.settle().await;
        }
    }

    async fn assign(&mut self, leader: NodeId) {
        let a = self.placement.promote(leader, false).unwrap();
        self.input(leader, Input::Assign(a)).await;
        self.settle().await;
    }

    async fn propose(&mut self, n: NodeId, payload: &str) -> u64 {
        self.propose_batch(n, &[payload]).await
    }

    /// A client's batch at node `n`; its first record's offset.
    async fn propose_batch(&mut self, n: NodeId, batch: &[&str]) -> u64 {
        let payloads = batch
            .iter()
            .map(|p| Bytes::copy_from_slice(p.as_bytes()))
            .collect();
        let outs = self.input(n, Input::Propose { payloads }).await;
        let at = match outs.first() {
            Some(Output::Proposed { at }) => *at,
            other => panic!("proposal at node {n} not taken: {other:?}"),
        };
        self.settle().await;
        at
    }

    fn heal(&mut self) {
        self.cut = None;
        self.net.extend(self.held.drain(..));
        for (n, r) in std::mem::take(&mut self.held_reports) {
            let a = self.placement.on_report(&r);
            self.answers.push_back((n, a));
        }
    }

    fn replica(&self, n: NodeId) -> &Replica {
        self.nodes[&n].d.replica()
    }

    fn log(&self, n: NodeId) -> &felix_storage::Log {
        self.nodes[&n].d.store().log()
    }

    /// Every record `n`'s log holds, from its oldest offset: (offset, generation, payload).
    async fn held(&self, n: NodeId) -> Vec<(u64, u64, Bytes)> {
        let log = self.log(n);
        let mut out = Vec::new();
        let mut at = log.oldest_offset();
        while at < log.acked() {
            for r in log.read(at, 100, 1 << 20).await.unwrap() {
                at = r.offset + 1;
                out.push((r.offset, r.gen, r.payload));
            }
        }
        out
    }

    /// Every record of `n`'s log: (generation, flags, payload).
    async fn records(&self, n: NodeId) -> Vec<(u64, u8, Bytes)> {
        let log = self.log(n);
        let mut out = Vec::new();
        while (out.len() as u64) < log.acked() {
            for r in log.read(out.len() as u64, 100, 1 << 20).await.unwrap() {
                out.push((r.gen, r.flags, r.payload));
            }
        }
        out
    }

    /// A process crash and restart of `n`: the machine comes back from its files.
    async fn restart(&mut self, n: NodeId) {
        // A crash ends what it served: now, or at its lease's end if that came first.
        if let Some((gen, from)) = self.serving.remove(&n) {
            let until = self.nodes[&n].d.serving_until().map_or(self.now, |s| s.1);
            self.served.push((n, gen, from, self.now.min(until)));
        }
        let node = self.nodes.remove(&n).unwrap();
        node.d.store().log().close().await.unwrap();
        let root = node.dir.parent().unwrap().to_path_buf();
        let back = open_node(&root, n).await;
        let (was, is) = (node.d.replica(), back.d.replica());
        assert_eq!(
            is.durable(),
            was.durable(),
            "the promise on disk is the machine's"
        );
        assert_eq!(is.log(), was.log(), "the log on disk is the machine's view");
        self.nodes.insert(n, back);
    }
}

fn run<F, Fut>(f: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + 'static,
{
    match glommio::LocalExecutorBuilder::default()
        .io_memory(1 << 20)
        .spawn(move || async move { f().await })
        .unwrap()
        .join()
    {
        Ok(()) => {}
        // The executor's thread panicked: go on panicking here with its message.
        Err(glommio::GlommioError::BuilderError(glommio::BuilderErrorKind::ThreadPanic(p))) => {
            std::panic::resume_unwind(p)
        }
        Err(e) => panic!("{e}"),
    }
}

/// Node 1 leads generation 1 and gets ten records acknowledged; cut off from everyone, it
/// takes three more that no follower gets and no report names. Placement promotes node 2
/// (generation 2), which gets five records acknowledged. Node 1 restarts from its files, the
/// cut heals (its late reports are refused), and node 2's shipments cut node 1's three
/// records from its log on disk. Every log then holds the same records, generations and
/// timestamps, every acknowledged record among them.
#[test]
fn a_failover_cuts_the_deposed_leaders_suffix_on_disk_and_the_logs_agree() {
    let root = tempfile::tempdir().unwrap();
    let path = root.path().to_path_buf();
    run(move || failover(path));
}

/// The negative twin of the hand-over check: a leader that hands readers what it has written
/// rather than what committed (`breaks::HAND_OVER_UNCOMMITTED`) shows them the suffix the
/// failover cuts, and the harness says so.
#[test]
fn handing_readers_uncommitted_records_is_caught() {
    use crate::core::replica::breaks::HAND_OVER_UNCOMMITTED;
    caught_with(
        &HAND_OVER_UNCOMMITTED,
        failover,
        "a reader saw a record a failover cut",
    );
}

/// Run `scenario` with the break `b` on: the harness must fail it with a panic naming `what`.
fn caught_with<Fut>(
    b: &'static std::sync::atomic::AtomicBool,
    scenario: fn(PathBuf) -> Fut,
    what: &str,
) where
    Fut: std::future::Future<Output = ()> + 'static,
{
    use std::sync::atomic::Ordering;
    let root = tempfile::tempdir().unwrap();
    let path = root.path().to_path_buf();
    b.store(true, Ordering::Relaxed);
    let r = std::thread::spawn(move || run(move || scenario(path))).join();
    b.store(false, Ordering::Relaxed);
    let e = r.expect_err("the break went unnoticed");
    let why = e
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(why.contains(what), "{why}");
}

/// Node 1 serves generation 1 and is cut off; node 2 is named at once. Node 2 serves only
/// once node 1's lease ran out (rule 4): the harness checks at every input that no two
/// replicas served at once.
#[test]
fn a_new_leader_serves_only_once_the_old_lease_ran_out() {
    let root = tempfile::tempdir().unwrap();
    let path = root.path().to_path_buf();
    run(move || quick_failover(path));
}

/// The negative twin of the serving check: a new leader that serves as soon as its fence
/// completes (`breaks::NO_LEASE_WAIT`) serves while the old leader's lease still runs.
#[test]
fn serving_without_waiting_out_the_old_lease_is_caught() {
    use crate::core::replica::breaks::NO_LEASE_WAIT;
    caught_with(
        &NO_LEASE_WAIT,
        quick_failover,
        "two replicas served at once",
    );
}

async fn quick_failover(path: PathBuf) {
    let mut h = Harness::new(&path).await;
    h.assign(1).await;
    h.run_for(1_500).await;
    assert!(h.replica(1).serving(h.now));
    h.cut = Some(1);
    h.assign(2).await;
    h.run_for(2_000).await;
    assert!(h.replica(2).serving(h.now));
    assert!(!h.replica(1).serving(h.now), "its lease ran out");
    assert_eq!(h.servers(), BTreeSet::from([1, 2]), "{:?}", h.served);
}

async fn failover(path: PathBuf) {
    {
        let mut h = Harness::new(&path).await;
        h.assign(1).await;
        // Serving starts after the old lease could have run out, once a renewal is answered.
        h.run_for(1_500).await;
        assert!(h.replica(1).serving(h.now));
        for i in 0..10 {
            h.propose(1, &format!("a{i}")).await;
        }
        h.run_for(500).await;
        assert_eq!(h.acked.len(), 10, "{:?}", h.acked);
        assert_eq!(
            h.acked[&1],
            Bytes::from_static(b"a0"),
            "offset 0 is the start record"
        );

        h.cut = Some(1);
        let lost: Vec<u64> = {
            let mut v = Vec::new();
            for i in 0..3 {
                v.push(h.propose(1, &format!("lost{i}")).await);
            }
            v
        };
        assert_eq!(lost, vec![11, 12, 13]);
        assert_eq!(h.log(1).acked(), 14, "written on node 1 only");
        h.run_for(2_000).await;
        assert!(!h.replica(1).serving(h.now), "its lease ran out");
        for o in &lost {
            assert!(!h.acked.contains_key(o), "never acknowledged");
        }

        h.assign(2).await;
        h.run_for(1_500).await;
        assert!(h.replica(2).serving(h.now));
        for i in 0..5 {
            h.propose(2, &format!("b{i}")).await;
        }
        h.run_for(500).await;
        assert_eq!(h.acked.len(), 15, "{:?}", h.acked);
        // Node 1 still believes it leads generation 1, and holds its suffix.
        assert_eq!(h.replica(1).leading(), Some(1));
        assert_eq!(h.records(1).await[11].2, Bytes::from_static(b"lost0"));

        h.restart(1).await;
        h.heal();
        h.run_for(1_000).await;
        let want = h.records(2).await;
        assert_eq!(want.len(), 17, "start, 10, start, 5");
        assert_eq!((want[11].0, want[11].1), (2, FLAG_GEN_START));
        for n in [1, 3] {
            assert_eq!(h.records(n).await, want, "node {n}'s log is node 2's");
        }
        for (o, p) in &h.acked {
            assert_eq!(&want[*o as usize].2, p, "acknowledged record at {o}");
        }
        // Readers were handed exactly the committed log: both generations' records and start
        // records (empty payloads), never the cut suffix.
        let seen: Vec<(u64, Bytes)> = h.visible.clone().into_iter().collect();
        let log: Vec<(u64, Bytes)> = (0..).zip(want.iter().map(|r| r.2.clone())).collect();
        assert_eq!(seen, log);
        // The logs agree byte for byte on what a reader sees, timestamps included.
        let ts = |n: NodeId| {
            let log = h.log(n).clone();
            async move {
                let r = log.read(0, 100, 1 << 20).await.unwrap();
                r.iter().map(|r| r.ts_ms).collect::<Vec<_>>()
            }
        };
        assert_eq!(ts(1).await, ts(2).await);
        assert_eq!(ts(3).await, ts(2).await);
        // Every replica learnt the mark past the last acknowledged record, and retention
        // holds there (rule 10).
        for n in 1..=3 {
            let k = h.replica(n).known_commit();
            assert!(k >= 17, "node {n} knows {k} committed");
            assert_eq!(h.log(n).retention_hold(), Some(k), "node {n}");
        }
        // Both leaders served, one after the other (checked at every input).
        assert!(
            h.servers().is_superset(&BTreeSet::from([1, 2])),
            "{:?}",
            h.served
        );
        // And a restart reads back what every machine believes; the hold written with the
        // promise is in force from open (it lags the mark: it only keeps more).
        for n in 1..=3 {
            h.restart(n).await;
            let hold = h.log(n).retention_hold().expect("a hold from open");
            assert!(hold <= 17, "node {n}: {hold}");
        }
    }
}

/// What the store refuses rather than write or send wrongly: an append where the log does
/// not end, records of other generations than the machine names, a shipment naming
/// generations the log does not hold, an unreadable promise. The promise round-trips.
#[test]
fn the_store_refuses_what_does_not_match_the_machine() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("n");
    run(move || async move {
        let (mut store, _, _) = ReplicaStore::open(&dir, log_cfg()).await.unwrap();
        let d = Durable {
            promised: 4,
            ballot: Some(2),
            led: 3,
        };
        store.persist(d).await.unwrap();
        let rec = |gen: u64, p: &'static [u8]| Carried {
            gen,
            ts_ms: 5,
            flags: 0,
            payload: Bytes::from_static(p),
        };
        let start = records_for(Source::Start, &[3], &[], &[], 9).unwrap();
        assert_eq!(start[0].flags, FLAG_GEN_START);
        store.append(0, &[3], &start).await.unwrap();
        store
            .append(1, &[3, 4], &[rec(3, b"x"), rec(4, b"y")])
            .await
            .unwrap();
        assert!(
            store.append(1, &[4], &[rec(4, b"z")]).await.is_err(),
            "not at the end"
        );
        let shipped = [rec(4, b"a"), rec(4, b"b")];
        let e = records_for(Source::Shipment { skip: 1 }, &[5], &[], &shipped, 9);
        assert!(
            e.is_err(),
            "records of another generation than the machine names"
        );
        assert!(records_for(Source::Client, &[4], &[], &[], 9).is_err());
        assert_eq!(
            store.read_shipment(1, &[3, 4]).await.unwrap().unwrap(),
            vec![rec(3, b"x"), rec(4, b"y")]
        );
        // From memory (the newest records), and after a reopen from the log.
        let e = store.read_shipment(1, &[3, 3]).await.unwrap_err();
        assert!(e.contains("generations [3, 4]"), "{e}");
        store.settle().await.unwrap();
        // The retention hold moves with the learnt mark and is written with the promise.
        store.hold_at(2).await.unwrap();
        assert_eq!(store.log().retention_hold(), Some(2));
        store.persist(d).await.unwrap();
        store.log().close().await.unwrap();
        let (store, d2, view) = ReplicaStore::open(&dir, log_cfg()).await.unwrap();
        assert_eq!(store.log().retention_hold(), Some(2), "in force from open");
        assert_eq!(d2, d);
        assert_eq!(view, GenLog::from_gens([3, 3, 4]));
        assert_eq!(
            store.read_shipment(1, &[3, 4]).await.unwrap().unwrap(),
            vec![rec(3, b"x"), rec(4, b"y")]
        );
        let e = store.read_shipment(1, &[3, 3]).await.unwrap_err();
        assert!(e.contains("generation 4 at offset 2"), "{e}");
        store.log().close().await.unwrap();
        std::fs::write(dir.join(STATE_FILE), b"{not json").unwrap();
        let e = ReplicaStore::open(&dir, log_cfg()).await.err().unwrap();
        assert!(e.contains("unreadable"), "{e}");
    });
}

/// Node 3 is down while node 1 is elected (it never sees the fence) and while records are
/// acknowledged by nodes 1 and 2. Restarted, it is fenced again by the leader's ticks, rejoins
/// generation 1 and catches up: a replica set stays whole without waiting for a failover.
#[test]
fn a_replica_down_during_the_election_rejoins_and_catches_up() {
    let root = tempfile::tempdir().unwrap();
    let path = root.path().to_path_buf();
    run(move || async move {
        let mut h = Harness::new(&path).await;
        h.cut = Some(3);
        h.lossy = true;
        h.assign(1).await;
        h.run_for(1_500).await;
        for i in 0..6 {
            h.propose(1, &format!("c{i}")).await;
        }
        h.run_for(500).await;
        assert_eq!(h.acked.len(), 6, "a majority without node 3");
        assert!(h.records(3).await.is_empty());
        h.restart(3).await;
        h.heal();
        h.run_for(1_000).await;
        let want = h.records(1).await;
        assert_eq!(want.len(), 7);
        assert_eq!(h.records(3).await, want, "node 3 caught up");
        assert_eq!(
            h.replica(3).durable().promised,
            1,
            "it promised generation 1"
        );
    });
}

/// The driver refuses what cannot be right before the machine sees it: a node outside its
/// replica set, a shipment whose records do not match its generations; and a proposal to a
/// follower is answered, not dropped.
#[test]
fn the_driver_refuses_a_shipment_that_does_not_carry_its_records() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("n");
    run(move || async move {
        let e = ReplicaDriver::open(4, 1, vec![1, 2, 3], &dir, log_cfg(), CFG).await;
        assert!(e.err().unwrap().contains("not in the replica set"));
        let mut d = ReplicaDriver::open(1, 101, vec![1, 2, 3], &dir, log_cfg(), CFG)
            .await
            .unwrap();
        let ship = Msg::Ship {
            gen: 1,
            leader: 2,
            start: 0,
            prev_gen: None,
            commit: 0,
            gens: vec![1, 1],
        };
        let one = vec![ShippedRecord {
            ts_ms: 1,
            flags: 0,
            payload: Bytes::from_static(b"x"),
        }];
        let input = Input::Msg {
            msg: ship,
            records: one,
        };
        let e = d.handle(input, 0, 0).await.unwrap_err();
        assert!(e.contains("2 records carries 1"), "{e}");
        let p = Input::Propose {
            payloads: vec![Bytes::from_static(b"y")],
        };
        let out = d.handle(p, 0, 0).await.unwrap();
        assert_eq!(
            out,
            vec![Output::NotTaken(crate::core::replica::NotLeader::Follower)]
        );
        assert_eq!(d.store().log().next_offset(), 0, "nothing written");
    });
}

/// A batch takes contiguous offsets, is acknowledged as one range, and reaches readers in
/// order behind the generation-start record.
#[test]
fn a_batch_is_written_in_one_piece_acknowledged_and_handed_to_readers() {
    let root = tempfile::tempdir().unwrap();
    let path = root.path().to_path_buf();
    run(move || async move {
        let mut h = Harness::new(&path).await;
        h.assign(1).await;
        h.run_for(1_500).await;
        let a = h.propose_batch(1, &["x", "y", "z"]).await;
        let b = h.propose(1, "w").await;
        assert_eq!(
            (a, b),
            (1, 4),
            "the start record is offset 0; the batch takes 1..4"
        );
        h.run_for(500).await;
        let want: Vec<(u64, Bytes)> = ["", "x", "y", "z", "w"]
            .iter()
            .enumerate()
            .map(|(o, p)| (o as u64, Bytes::copy_from_slice(p.as_bytes())))
            .collect();
        assert_eq!(h.visible.clone().into_iter().collect::<Vec<_>>(), want);
        assert_eq!(h.acked.len(), 4, "every client record acknowledged");
        for n in 1..=3 {
            assert_eq!(h.records(n).await.len(), 5, "node {n} holds the batch");
        }
    });
}

/// Rule 10 over real logs: while a follower is down, retention removes segments on the
/// leader and the other follower, never at or above the mark they learnt; the follower comes
/// back needing records the leader no longer holds, and is rebuilt from the leader's base: its
/// log then holds exactly the leader's records from there, and it counts again.
#[test]
fn a_follower_behind_the_leaders_retention_is_rebuilt_from_its_base() {
    let root = tempfile::tempdir().unwrap();
    let path = root.path().to_path_buf();
    run(move || async move {
        let mut h = Harness::new(&path).await;
        // Node 3 has a record, then goes down.
        h.assign(1).await;
        h.run_for(1_500).await;
        h.propose(1, "early").await;
        h.run_for(300).await;
        assert_eq!(h.held(3).await.len(), 2, "the start record and one more");
        h.cut = Some(3);
        h.lossy = true;
        // 2 KiB records: 64 KiB segments hold about thirty.
        let big = "r".repeat(2 << 10);
        for _ in 0..20 {
            h.propose_batch(1, &[&big, &big, &big, &big, &big]).await;
            h.run_for(100).await;
        }
        h.run_for(500).await;
        assert_eq!(h.acked.len(), 101, "a majority without node 3");
        let mark = h.replica(1).known_commit();
        assert_eq!(mark, h.replica(1).log().end());
        for n in [1, 2] {
            let gone = h.log(n).delete_below(u64::MAX).await;
            assert!(gone > 0, "node {n}: retention removed segments");
            assert!(h.log(n).oldest_offset() <= mark, "never past the mark");
        }
        let base = h.log(1).oldest_offset();
        assert!(base > 2, "the leader no longer holds what node 3 needs");
        h.run_for(300).await;
        assert_eq!(h.replica(1).log().base(), base, "the machine learnt it");
        // A restart reads the base back from the files.
        h.restart(1).await;
        assert_eq!(h.replica(1).log().base(), base);
        assert!(h.replica(1).known_commit() >= base);
        h.assign(1).await;
        h.run_for(2_000).await;
        h.restart(3).await;
        h.heal();
        h.run_for(2_000).await;
        assert_eq!(
            h.rebuilt,
            vec![(3, base)],
            "node 3 rebuilt from the leader's base"
        );
        let want = h.held(1).await;
        assert_eq!(want.first().map(|r| r.0), Some(base));
        assert_eq!(
            h.held(3).await,
            want,
            "node 3 holds the leader's log from its base"
        );
        assert_eq!(h.replica(3).log().base(), base);
        // It counts again: with node 2 cut off, a record is still acknowledged.
        h.cut = Some(2);
        let at = h.propose(1, "after").await;
        h.run_for(500).await;
        assert!(h.acked.contains_key(&at), "nodes 1 and 3 are a majority");
        // Restarted, node 3 opens at its base, where its log now starts.
        h.restart(3).await;
        assert_eq!(h.log(3).oldest_offset(), base);
    });
}

/// A shipment larger than one commit (large records, a full batch) is appended in several,
/// in order, and reads back whole: it once failed the replica ("append of 1980924 bytes
/// exceeds the limit").
#[test]
fn a_shipment_larger_than_a_commit_is_appended_in_several() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("n");
    run(move || async move {
        let (mut store, _, _) = ReplicaStore::open(&dir, log_cfg()).await.unwrap();
        let max = store.log().append_bytes_max();
        let recs: Vec<Carried> = (0..12u8)
            .map(|k| Carried {
                gen: 1 + u64::from(k / 8),
                ts_ms: 5,
                flags: 0,
                payload: Bytes::from(vec![k; 5_000]),
            })
            .collect();
        assert!(recs.iter().map(|r| r.payload.len()).sum::<usize>() > 3 * max);
        let gens: Vec<u64> = recs.iter().map(|r| r.gen).collect();
        store.append(0, &gens, &recs).await.unwrap();
        store.settle().await.unwrap();
        assert_eq!(store.log().acked(), 12);
        store.log().close().await.unwrap();
        let (store, _, view) = ReplicaStore::open(&dir, log_cfg()).await.unwrap();
        assert_eq!(view, GenLog::from_gens(gens.iter().copied()));
        assert_eq!(store.read_shipment(0, &gens).await.unwrap().unwrap(), recs);
    });
}

/// A shipment that starts in what is written and ends in what was just appended (a new
/// leader's generation-start record, shipped at once to a follower catching up from the
/// start) is read whole: the old part from the log, the new part from memory. It once failed
/// the replica ("nothing to ship at 7") because the log reads only what it acknowledged.
#[test]
fn a_shipment_across_written_and_just_appended_records_is_read_whole() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("n");
    run(move || async move {
        let rec = |gen: u64, p: u8| Carried {
            gen,
            ts_ms: 5,
            flags: 0,
            payload: Bytes::from(vec![p; 16]),
        };
        let (mut store, _, _) = ReplicaStore::open(&dir, log_cfg()).await.unwrap();
        let old: Vec<Carried> = (0..7).map(|k| rec(1, k)).collect();
        store.append(0, &[1; 7], &old).await.unwrap();
        store.settle().await.unwrap();
        store.log().close().await.unwrap();
        // Reopened: nothing is among the newest in memory.
        let (mut store, _, _) = ReplicaStore::open(&dir, log_cfg()).await.unwrap();
        let start = records_for(Source::Start, &[2], &[], &[], 9).unwrap();
        store.append(7, &[2], &start).await.unwrap();
        let mut gens = vec![1; 7];
        gens.push(2);
        let got = store.read_shipment(0, &gens).await.unwrap().unwrap();
        let mut want = old.clone();
        want.extend(start);
        assert_eq!(got, want);
        store.settle().await.unwrap();
        store.log().close().await.unwrap();
    });
}

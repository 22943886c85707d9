//! Chaos on a replicated stream (issue 23), with real processes and real signals: a control
//! plane run with `--replication-preview` and three brokers hold a `quorum` stream of three
//! copies. A publisher sends one record at a time to the leader the control plane names,
//! while, round after round, one broker chosen from the seed is SIGKILLed and restarted on
//! its files, or frozen (SIGSTOP) past the control plane's dead time and thawed (SIGCONT).
//! After every round the stream must take publishes again; at the end every acknowledged
//! record is on the leader at its offset, exactly once, what a subscriber reads from the
//! start is contiguous, and no two brokers ever served the shard at once (the serving
//! intervals every broker logs on CLOCK_MONOTONIC, `common/serving.rs`). A second test
//! freezes the leader itself past its lease, and a third shows the serving check fails on
//! overlapping intervals.
//!
//! `FELIX_CHAOS_ROUNDS` (default 3, the CI budget) and `FELIX_CHAOS_SEED` (default: from the
//! clock, printed) pick the run; a failing run prints its seed, and
//! `FELIX_CHAOS_SEED=N FELIX_CHAOS_ROUNDS=R cargo nextest run -p felix-broker --test
//! replication_chaos` replays its choices (the timing of real processes is not replayed).
//! `scripts/chaos.sh` runs more rounds by hand.

use bytes::Bytes;
use felix_client::{Client, ClientConfig};
use felix_quic::wire::{ErrorCode, ShardSelector, StreamName};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod common;
use common::replicated::{
    check_acked_on_leader, leader_at, publish_one, CpView, Trio, PUBLISH_WAIT,
};

/// The control plane counts a broker dead after this long without a heartbeat.
const DEAD_AFTER_MS: u64 = 1_500;
/// A round's recovery: the stream takes a publish again within this.
const RECOVERY_MAX: Duration = Duration::from_secs(40);

/// A small deterministic generator (xorshift), so a seed replays the run's choices.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// What the publisher saw.
#[derive(Default)]
struct Seen {
    /// Acknowledged: offset → payload.
    acked: BTreeMap<u64, Bytes>,
    /// Answers that were not acknowledgements, by code (or "timeout").
    refused: BTreeMap<String, u64>,
}

/// Publish one record after another to the leader the control plane names until `stop`.
async fn publisher(
    cp: CpView,
    clients: Arc<Mutex<HashMap<u64, ClientConfig>>>,
    seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
) {
    let name = StreamName::new("acme", "prod", "c3");
    let mut conns: HashMap<u64, Client> = HashMap::new();
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let Some(node) = leader_at(&cp, "c3").await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        if let std::collections::hash_map::Entry::Vacant(slot) = conns.entry(node) {
            let Some(cfg) = clients.lock().unwrap().get(&node).cloned() else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            match tokio::time::timeout(PUBLISH_WAIT, Client::connect(cfg)).await {
                Ok(Ok(c)) => {
                    slot.insert(c);
                }
                _ => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            }
        }
        let c = &conns[&node];
        // Each payload is published once: an unanswered one is never sent again, so every
        // acknowledged payload must be found exactly once.
        let payload = Bytes::from(format!("p{i}"));
        i += 1;
        let r = tokio::time::timeout(
            PUBLISH_WAIT,
            c.publish_batch(&name, ShardSelector::Shard(0), vec![payload.clone()]),
        )
        .await;
        let refused = match r {
            Ok(Ok(a)) => {
                let old = seen.lock().unwrap().acked.insert(a.first_offset, payload);
                assert!(
                    old.is_none(),
                    "offset {} acknowledged twice",
                    a.first_offset
                );
                continue;
            }
            Ok(Err(e)) => e.code().map_or("connection", ErrorCode::name).to_string(),
            Err(_) => "timeout".to_string(),
        };
        *seen.lock().unwrap().refused.entry(refused).or_default() += 1;
        conns.remove(&node);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_records_survive_kills_and_freezes_of_any_broker() {
    let rounds: u64 = std::env::var("FELIX_CHAOS_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let seed: u64 = std::env::var("FELIX_CHAOS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("chaos: FELIX_CHAOS_SEED={seed} FELIX_CHAOS_ROUNDS={rounds}");
    let mut rng = Rng(seed | 1);
    let mut t = Trio::start(DEAD_AFTER_MS, &[]).await;
    let clients: Arc<Mutex<HashMap<u64, ClientConfig>>> = Arc::new(Mutex::new(
        t.nodes
            .iter()
            .map(|(&id, b)| (id, b.client_config()))
            .collect(),
    ));
    t.create_stream("c3", "quorum");

    let seen = Arc::new(Mutex::new(Seen::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let pub_task = tokio::spawn(publisher(
        t.view.clone(),
        clients.clone(),
        seen.clone(),
        stop.clone(),
    ));
    let progress = |at_least: usize| {
        let seen = seen.clone();
        async move {
            let t = Instant::now();
            loop {
                let n = seen.lock().unwrap().acked.len();
                if n >= at_least {
                    return n;
                }
                assert!(
                    t.elapsed() < RECOVERY_MAX,
                    "no publish acknowledged for {RECOVERY_MAX:?} (seed {seed}); {n} so far"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let mut acked = progress(5).await;
    for round in 0..rounds {
        tokio::time::sleep(Duration::from_millis(200 + rng.below(800))).await;
        let id = 1 + rng.below(3);
        let is_leader = t.leader("c3").await == Some(id);
        if rng.below(2) == 0 {
            eprintln!("round {round}: SIGKILL node {id} (leader: {is_leader}), restart in 2 s");
            clients.lock().unwrap().remove(&id);
            t.kill(id);
            tokio::time::sleep(Duration::from_millis(2_000)).await;
            t.restart(id);
            clients
                .lock()
                .unwrap()
                .insert(id, t.nodes[&id].client_config());
        } else {
            let ms = DEAD_AFTER_MS + 500 + rng.below(1_500);
            eprintln!("round {round}: SIGSTOP node {id} (leader: {is_leader}) for {ms} ms");
            t.nodes[&id].signal(libc::SIGSTOP);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            t.nodes[&id].signal(libc::SIGCONT);
        }
        acked = progress(acked + 3).await;
    }
    stop.store(true, Ordering::Relaxed);
    let _ = tokio::time::timeout(PUBLISH_WAIT * 2, pub_task).await;

    // Every acknowledged record, on the leader, at its offset, once.
    let (acked, refused) = {
        let s = seen.lock().unwrap();
        (s.acked.clone(), s.refused.clone())
    };
    eprintln!("acknowledged {}, not acknowledged {refused:?}", acked.len());
    // The seed is in the first line of the output, for a failure here.
    let got = check_acked_on_leader(&t, "c3", &acked, RECOVERY_MAX).await;
    let mut payloads: HashMap<&Bytes, u64> = HashMap::new();
    for (o, p) in got.iter().filter(|(_, p)| !p.is_empty()) {
        if let Some(first) = payloads.insert(p, *o) {
            panic!("{p:?} at offsets {first} and {o} (seed {seed})");
        }
    }
    // At most one broker served at any time, whatever was killed or frozen.
    let servers = t.check_one_server("c3");
    eprintln!("c3 was served by nodes {servers:?}, never two at once");
    assert!(!servers.is_empty());
}

/// The leader frozen (SIGSTOP) past its lease and the control plane's dead time: another
/// replica is named, waits out the old lease and acknowledges while the old leader is still
/// frozen. Thawed (SIGCONT), the old leader serves no more: what it is sent is forwarded or
/// refused, and every acknowledged record is on the new leader. Every broker's serving
/// intervals (CLOCK_MONOTONIC) show that no two brokers served at once, and that both did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_frozen_past_its_lease_serves_no_more_once_thawed() {
    let t = Trio::start(DEAD_AFTER_MS, &[]).await;
    t.create_stream("f", "quorum");
    let mut acked: BTreeMap<u64, Bytes> = BTreeMap::new();
    let o = t.publish_until_acked("f", "first", RECOVERY_MAX).await;
    acked.insert(o, Bytes::from("first"));
    let old = t.leader("f").await.expect("a leader serves");

    t.nodes[&old].signal(libc::SIGSTOP);
    let frozen = Instant::now();
    let o = t
        .publish_until_acked("f", "while-frozen", RECOVERY_MAX)
        .await;
    acked.insert(o, Bytes::from("while-frozen"));
    let new = t.leader("f").await.expect("a leader serves");
    assert_ne!(new, old, "a live replica leads");
    eprintln!(
        "node {new} acknowledged {:?} after node {old} froze",
        frozen.elapsed()
    );
    t.nodes[&old].signal(libc::SIGCONT);

    // Thawed: the old leader acknowledges nothing the cluster does not hold. It forwards to
    // the new leader, or refuses while it learns who leads.
    let c = t.client(old).await.expect("the thawed broker answers");
    let mut refused = BTreeMap::<String, u32>::new();
    for i in 0..5 {
        let p = format!("to-old-{i}");
        match publish_one(&c, "f", &p, PUBLISH_WAIT).await {
            Ok(o) => assert!(
                acked.insert(o, Bytes::from(p)).is_none(),
                "offset {o} twice"
            ),
            Err(code) => *refused.entry(code).or_default() += 1,
        }
    }
    eprintln!("sent to the thawed old leader: refused {refused:?}");
    let o = t.publish_until_acked("f", "after", RECOVERY_MAX).await;
    acked.insert(o, Bytes::from("after"));
    check_acked_on_leader(&t, "f", &acked, RECOVERY_MAX).await;
    let servers = t.check_one_server("f");
    assert!(
        servers.contains(&old) && servers.contains(&new),
        "served by {servers:?}"
    );
}

/// The serving check fails on two brokers' overlapping intervals of one shard, and passes
/// them apart, or from one process, or of two shards (its negative twin: the real brokers
/// never overlap, so the check is shown to fail on lines written as a broker writes them).
#[test]
fn the_serving_check_catches_two_brokers_serving_one_shard_at_once() {
    use common::serving::{intervals, overlap, Lines, Process};
    let line = |what: &str, shard: u32, gen: u64, key: &str, ns: u64| {
        format!(
            "2026-12-07T00:00:00Z  INFO felix::serving: {what} stream=acme/prod/f incarnation=1 shard={shard} gen={gen} {key}={ns}"
        )
    };
    let proc_of = |node: u64, lines: Vec<String>, gone_ns: Option<u64>| Process {
        node,
        lines: Lines::new(std::sync::Mutex::new(lines)),
        gone_ns,
    };
    let a = proc_of(
        1,
        vec![
            line("replica serves", 0, 1, "from_mono_ns", 100),
            line("replica serves no more", 0, 1, "to_mono_ns", 200),
        ],
        None,
    );
    // Node 2 serves from 150, while node 1 still did: caught.
    let b = proc_of(
        2,
        vec![line("replica serves", 0, 2, "from_mono_ns", 150)],
        None,
    );
    let (x, y) = overlap(&intervals(&[a.clone(), b], 1_000)).expect("an overlap");
    assert_eq!((x.node, y.node), (1, 2));
    // From 201: apart.
    let b = proc_of(
        2,
        vec![line("replica serves", 0, 2, "from_mono_ns", 201)],
        None,
    );
    assert_eq!(overlap(&intervals(&[a.clone(), b], 1_000)), None);
    // A killed process's open interval runs until it was seen gone.
    let killed = proc_of(
        1,
        vec![line("replica serves", 0, 1, "from_mono_ns", 100)],
        Some(300),
    );
    let b = proc_of(
        2,
        vec![line("replica serves", 0, 2, "from_mono_ns", 250)],
        None,
    );
    assert!(overlap(&intervals(&[killed.clone(), b], 1_000)).is_some());
    let b = proc_of(
        2,
        vec![line("replica serves", 0, 2, "from_mono_ns", 301)],
        None,
    );
    assert!(overlap(&intervals(&[killed, b], 1_000)).is_none());
    // Another shard may be served by another broker at the same time.
    let b = proc_of(
        2,
        vec![line("replica serves", 1, 2, "from_mono_ns", 150)],
        None,
    );
    assert!(overlap(&intervals(&[a, b], 1_000)).is_none());
}

//! Named faults on a replicated stream (issue 23), with real processes and real signals: a
//! control plane run with `--replication-preview` and three brokers holding `quorum` streams
//! of three copies. Where `replication_chaos.rs` kills or freezes a broker chosen from a seed,
//! each test here drives one case the issue names, and checks what clients were answered and
//! that every acknowledged record is on the leader at its offset afterwards:
//! - one follower dead: acknowledgements go on; both dead: nothing is acknowledged; both back,
//!   and then all three brokers killed and restarted at once: the shard has its three replicas
//!   again, and lost nothing;
//! - the control plane frozen (SIGSTOP): `quorum` acknowledgements stop (the leader cannot
//!   vouch), `leader` acknowledgements go on, and after SIGCONT both go on; frozen again with
//!   the leader killed, no broker takes over on its own, and after SIGCONT another does;
//! - the leader's reports blocked while its heartbeats still land (the control plane a Raft
//!   group of three, the two members the brokers do not talk to frozen): `quorum`
//!   acknowledgements stop, `leader` ones go on, no broker is counted dead and no leadership
//!   moves; unblocked, acknowledgements go on and nothing is lost;
//! - a stream deleted and created again under load: the new one is empty on every broker, and
//!   no replica fails;
//! - the leader cut off from its peers by nftables while it still reaches the control plane:
//!   it acknowledges nothing, resigns once it has held no lease for a lease period, another
//!   replica leads, and after the cut heals it follows again;
//! - a follower wiped and the leader killed: no replica qualifies, the shard waits, and the
//!   operator's way out (`felixctl shard abandon`) recovers it, saying what may be lost;
//! - the leader stopped with SIGTERM: it tells the control plane it leaves, another replica
//!   leads without waiting for it to be counted dead, and a publish sent to the new leader
//!   while it still fences and waits out the old lease is held and acknowledged, not refused;
//! - retention on a replicated stream (rule 10): it never removes records at or above the
//!   commit mark, also while the mark stands still (the control plane frozen) and after a
//!   restart; a follower that was down while the leader's retention removed what it needs is
//!   rebuilt from the leader's base when it comes back;
//! - a follower dead past `--replica-replace-after-ms` (rule 11): a fourth broker takes its
//!   place in a new generation, catches up and counts; the old one, back, is no replica; the
//!   leader then killed, a replica of the new set leads with every acknowledged record, and
//!   the dead leader is replaced in turn by the old follower, swapped in again on its files.
//!
//! Auth is on throughout (`common/replicated.rs`): the control plane checks tokens over
//! HTTPS, the brokers run on enrolled node credentials, and clients use the admin token.
//! Every test ends by checking, from the serving intervals every broker logs, that no two
//! brokers served a shard at once (`common/serving.rs`).

use bytes::Bytes;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

mod common;
use common::replicated::{
    check_acked_on_leader, check_acked_retained, publish_one, udp_ports_of, Cut, Trio, PUBLISH_WAIT,
};

/// The control plane counts a broker dead after this long without a heartbeat.
const DEAD_AFTER_MS: u64 = 1_500;
/// A leader answers a `quorum` publish it cannot vouch for after this long.
const QUORUM_WAIT_MS: &str = "1000";
/// Any recovery the tests wait for: a leader serving again, the replicas full again.
const RECOVERY_MAX: Duration = Duration::from_secs(40);

/// Publish `n` records one at a time to node `id` (the leader), each acknowledged; into `acked`.
async fn publish_acked(
    t: &Trio,
    id: u64,
    name: &str,
    tag: &str,
    n: usize,
    acked: &mut BTreeMap<u64, Bytes>,
) {
    let c = t.client(id).await.expect("the leader answers");
    for i in 0..n {
        let p = format!("{tag}-{i}");
        let o = publish_one(&c, name, &p, PUBLISH_WAIT)
            .await
            .unwrap_or_else(|e| panic!("{p} to node {id}: {e}"));
        assert!(
            acked.insert(o, Bytes::from(p)).is_none(),
            "offset {o} twice"
        );
    }
}

/// The two replicas of shard 0 of `name` that do not lead.
async fn followers(t: &Trio, name: &str, leader: u64) -> Vec<u64> {
    let s = t.shard(name).await;
    let f: Vec<u64> = s["followers"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x.as_u64()).collect())
        .unwrap_or_default();
    assert_eq!(f.len(), 2, "{s}");
    assert!(!f.contains(&leader), "{s}");
    f
}

/// No two broker processes ever served shard 0 of `name` at once (the intervals every broker
/// logged on CLOCK_MONOTONIC), and at least `at_least` brokers served it, so that the check
/// had something to compare.
fn served_one_at_a_time(t: &Trio, name: &str, at_least: usize) {
    let s = t.check_one_server(name);
    eprintln!("{name} was served by nodes {s:?}, never two at once");
    assert!(s.len() >= at_least, "served by {s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_needs_a_live_majority_and_every_replica_comes_back() {
    // A publish the leader cannot take (no lease) is held this long, then refused.
    let hold = ["--publish-timeout-ms", "1500"];
    let flags = [&["--replica-quorum-wait-ms", QUORUM_WAIT_MS][..], &hold[..]].concat();
    let mut t = Trio::start(DEAD_AFTER_MS, &flags).await;
    t.create_stream("q", "quorum");
    let mut acked = BTreeMap::new();
    t.publish_until_acked("q", "first", RECOVERY_MAX).await;
    let leader = t.leader("q").await.unwrap();
    let f = followers(&t, "q", leader).await;
    publish_acked(&t, leader, "q", "all", 5, &mut acked).await;

    // One follower dead: the other one is the majority, and acknowledgements go on.
    t.kill(f[0]);
    publish_acked(&t, leader, "q", "one-down", 10, &mut acked).await;

    // Both dead: the leader alone cannot vouch for anything. What it wrote is answered
    // `outcome_unknown` at the quorum wait; once its lease ran out it takes nothing, and
    // holds a publish for `--publish-timeout-ms`, then refuses it `unavailable`.
    t.kill(f[1]);
    let c = t.client(leader).await.expect("the leader answers");
    let mut answers = BTreeMap::<String, u32>::new();
    for i in 0..3 {
        match publish_one(&c, "q", &format!("both-down-{i}"), PUBLISH_WAIT).await {
            Ok(o) => panic!("acknowledged at {o} with both followers dead"),
            Err(code) => *answers.entry(code).or_default() += 1,
        }
    }
    eprintln!("with both followers dead: {answers:?}");
    assert!(
        answers
            .keys()
            .all(|c| matches!(c.as_str(), "outcome_unknown" | "unavailable")),
        "refused with typed codes, never left unanswered: {answers:?}"
    );
    assert!(
        t.shard("q").await["leader"].as_u64() == Some(leader),
        "nobody replaces a live leader"
    );

    // Both back: acknowledgements go on, and all three hold the shard again.
    t.restart(f[0]);
    t.restart(f[1]);
    let o = t.publish_until_acked("q", "back", RECOVERY_MAX).await;
    acked.insert(o, Bytes::from("back"));
    let s = t.wait_full("q", RECOVERY_MAX).await;
    eprintln!("after the followers came back: {s}");

    // All three killed at once and restarted on their files: the shard gets its replication
    // factor back, and nothing acknowledged is lost.
    for id in 1..=3 {
        t.kill(id);
    }
    for id in 1..=3 {
        t.restart(id);
    }
    let o = t
        .publish_until_acked("q", "after-restart", RECOVERY_MAX)
        .await;
    acked.insert(o, Bytes::from("after-restart"));
    let s = t.wait_full("q", RECOVERY_MAX).await;
    eprintln!("after all three restarted: {s}");
    check_acked_on_leader(&t, "q", &acked, RECOVERY_MAX).await;
    for b in t.nodes.values() {
        assert_eq!(b.total("replica_failures"), 0, "no replica failed");
    }
    served_one_at_a_time(&t, "q", 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_control_plane_stops_quorum_acknowledgements_and_loses_nothing() {
    let mut t = Trio::start(DEAD_AFTER_MS, &["--replica-quorum-wait-ms", QUORUM_WAIT_MS]).await;
    t.create_stream("q", "quorum");
    t.create_stream("l", "leader");
    let mut acked_q = BTreeMap::new();
    let mut acked_l = BTreeMap::new();
    t.publish_until_acked("q", "first", RECOVERY_MAX).await;
    t.publish_until_acked("l", "first", RECOVERY_MAX).await;
    let (lq, ll) = (t.leader("q").await.unwrap(), t.leader("l").await.unwrap());
    publish_acked(&t, lq, "q", "before", 3, &mut acked_q).await;
    publish_acked(&t, ll, "l", "before", 3, &mut acked_l).await;

    let generations = async || {
        let (q, l) = (t.shard("q").await, t.shard("l").await);
        (q["generation"].as_u64(), l["generation"].as_u64())
    };
    let before = generations().await;
    // Frozen: no report lands, so the commit mark cannot move and a `quorum` leader cannot
    // vouch for anything; a `leader` stream acknowledges what its leader wrote.
    t.signal_control_plane(libc::SIGSTOP);
    let frozen = Instant::now();
    let cq = t.client(lq).await.expect("the leader answers");
    for i in 0..2 {
        let r = publish_one(&cq, "q", &format!("frozen-{i}"), PUBLISH_WAIT).await;
        assert_eq!(
            r,
            Err("outcome_unknown".to_string()),
            "a quorum publish while the control plane is frozen"
        );
    }
    publish_acked(&t, ll, "l", "frozen", 3, &mut acked_l).await;
    // Frozen past the time it counts a silent broker dead.
    let past = Duration::from_millis(DEAD_AFTER_MS + 500).saturating_sub(frozen.elapsed());
    tokio::time::sleep(past).await;
    t.signal_control_plane(libc::SIGCONT);

    // Thawed: `quorum` acknowledgements go on, and nothing acknowledged is lost.
    let o = t.publish_until_acked("q", "thawed", RECOVERY_MAX).await;
    acked_q.insert(o, Bytes::from("thawed"));
    publish_acked(
        &t,
        t.leader("l").await.unwrap(),
        "l",
        "thawed",
        2,
        &mut acked_l,
    )
    .await;
    eprintln!(
        "after the thaw: q {} l {}",
        t.shard("q").await,
        t.shard("l").await
    );
    // Its own pause is no evidence against the brokers: no leadership moved.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        generations().await,
        before,
        "the control plane's own pause moved a leadership"
    );
    check_acked_on_leader(&t, "q", &acked_q, RECOVERY_MAX).await;
    check_acked_on_leader(&t, "l", &acked_l, RECOVERY_MAX).await;

    // Frozen again, and the `quorum` leader killed: only placement names a leader, so no
    // broker takes over on its own and nothing is acknowledged, however long it lasts (past
    // the lease and dead-after). Thawed, placement names another replica, which has every
    // acknowledged record.
    let lq = t.leader("q").await.unwrap();
    t.signal_control_plane(libc::SIGSTOP);
    t.kill(lq);
    tokio::time::sleep(Duration::from_millis(DEAD_AFTER_MS + 2_500)).await;
    for n in (1..=3).filter(|&n| n != lq) {
        let c = t.client(n).await.expect("a live broker answers");
        let r = publish_one(&c, "q", "headless", PUBLISH_WAIT).await;
        eprintln!("headless publish at node {n}: {r:?}");
        assert!(
            r.is_err(),
            "node {n} acknowledged with no leader named: {r:?}"
        );
    }
    t.signal_control_plane(libc::SIGCONT);
    let o = t.publish_until_acked("q", "replaced", RECOVERY_MAX).await;
    acked_q.insert(o, Bytes::from("replaced"));
    assert_ne!(t.leader("q").await, Some(lq), "a live replica leads");
    check_acked_on_leader(&t, "q", &acked_q, RECOVERY_MAX).await;
    served_one_at_a_time(&t, "q", 2);
    served_one_at_a_time(&t, "l", 1);
}

/// The leader's reports blocked while its heartbeats still reach the control plane: the
/// control plane is a Raft group of three, and the two members the brokers do not talk to are
/// frozen. The member they talk to still answers heartbeats (liveness is its own soft state,
/// no Raft write), but can commit no report. `quorum` acknowledgements stop (cannot vouch),
/// `leader` ones go on, no broker is counted dead and no leadership moves, however long it
/// lasts; thawed, acknowledgements go on and nothing acknowledged is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_blocked_while_heartbeats_flow_stop_quorum_acknowledgements_only() {
    let flags = ["--replica-quorum-wait-ms", QUORUM_WAIT_MS];
    let t = Trio::start_with_cp_group(DEAD_AFTER_MS, &flags).await;
    t.create_stream("q", "quorum");
    t.create_stream("l", "leader");
    let (mut acked_q, mut acked_l) = (BTreeMap::new(), BTreeMap::new());
    t.publish_until_acked("q", "first", RECOVERY_MAX).await;
    t.publish_until_acked("l", "first", RECOVERY_MAX).await;
    let (lq, ll) = (t.leader("q").await.unwrap(), t.leader("l").await.unwrap());
    publish_acked(&t, lq, "q", "before", 3, &mut acked_q).await;
    let generations = async || {
        let (q, l) = (t.shard("q").await, t.shard("l").await);
        (q["generation"].as_u64(), l["generation"].as_u64())
    };
    let before = generations().await;

    t.signal_cp_followers(libc::SIGSTOP);
    let blocked = Instant::now();
    let cq = t.client(lq).await.expect("the leader answers");
    let mut answers = BTreeMap::<String, u32>::new();
    // Blocked past the time a silent broker is counted dead, and past the lease.
    while blocked.elapsed() < Duration::from_millis(DEAD_AFTER_MS + 2_500) {
        match publish_one(&cq, "q", "blocked", PUBLISH_WAIT).await {
            Ok(o) => panic!("a quorum publish acknowledged at {o} with no report landing"),
            Err(code) => *answers.entry(code).or_default() += 1,
        }
        publish_acked(&t, ll, "l", "blocked", 1, &mut acked_l).await;
    }
    eprintln!("quorum publishes while the reports were blocked: {answers:?}");
    assert!(
        answers.keys().all(|c| c == "outcome_unknown"),
        "answered as cannot vouch: {answers:?}"
    );
    t.signal_cp_followers(libc::SIGCONT);

    let o = t.publish_until_acked("q", "unblocked", RECOVERY_MAX).await;
    acked_q.insert(o, Bytes::from("unblocked"));
    let brokers = t.view.get("/v1/brokers").await;
    let live = brokers.as_array().map_or(0, |a| {
        a.iter()
            .filter(|b| b["live"].as_bool() == Some(true))
            .count()
    });
    assert_eq!(live, 3, "heartbeats kept every broker live: {brokers}");
    assert_eq!(generations().await, before, "no leadership moved");
    check_acked_on_leader(&t, "q", &acked_q, RECOVERY_MAX).await;
    check_acked_on_leader(&t, "l", &acked_l, RECOVERY_MAX).await;
    served_one_at_a_time(&t, "q", 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_deleted_and_created_again_under_load_is_empty_on_every_broker() {
    let t = Trio::start(DEAD_AFTER_MS, &[]).await;
    t.create_stream("d", "quorum");
    t.publish_until_acked("d", "first", RECOVERY_MAX).await;
    let leader = t.leader("d").await.unwrap();
    let c = t.client(leader).await.expect("the leader answers");
    // Load: publishes go on (unanswered or refused while the stream is gone) across the
    // delete and the create.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let (mut acked, mut i) = (Vec::new(), 0u64);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                i += 1;
                let p = format!("load-{i}");
                if publish_one(&c, "d", &p, PUBLISH_WAIT).await.is_ok() {
                    acked.push((Bytes::from(p), Instant::now()));
                } else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            acked
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ns = ["--tenant", "acme", "--namespace", "prod"];
    let rm = Instant::now();
    t.ctl(&[&ns[..], &["stream", "rm", "d", "--yes"]].concat());
    // Created again as soon as the name is free (the delete's grace is 200 ms here).
    let t0 = Instant::now();
    loop {
        let o = common::cp::felixctl(
            &t.cp,
            t.tmp.path(),
            &[
                &["--token", &t.admin][..],
                &ns[..],
                &[
                    "stream",
                    "create",
                    "d",
                    "--durable",
                    "--replication-factor",
                    "3",
                    "--consistency",
                    "quorum",
                ],
            ]
            .concat(),
        );
        if o.status.success() {
            break;
        }
        assert!(
            t0.elapsed() < RECOVERY_MAX,
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let fresh = t.publish_until_acked("d", "fresh", RECOVERY_MAX).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let loaded = load.await.unwrap();
    let before_rm: Vec<&Bytes> = loaded
        .iter()
        .filter(|(_, at)| *at < rm)
        .map(|(p, _)| p)
        .collect();
    eprintln!(
        "{} acknowledged under load, {} before the delete; fresh at {fresh}",
        loaded.len(),
        before_rm.len()
    );
    assert!(
        !before_rm.is_empty(),
        "the load was acknowledged before the delete"
    );

    // The new stream holds its own records only: its start record, whatever the load got in
    // after the create, and `fresh`; on all three replicas, none of which failed.
    let s = t.wait_full("d", RECOVERY_MAX).await;
    eprintln!("the new stream: {s}");
    let mut acked = BTreeMap::new();
    acked.insert(fresh, Bytes::from("fresh"));
    let got = check_acked_on_leader(&t, "d", &acked, RECOVERY_MAX).await;
    assert!(
        got[&0].is_empty(),
        "offset 0 is the generation-start record"
    );
    for p in before_rm.iter().copied().chain([&Bytes::from("first")]) {
        assert!(
            !got.values().any(|g| g == p),
            "{p:?} of the deleted stream in the new one: {got:?}"
        );
    }
    for b in t.nodes.values() {
        assert_eq!(b.total("replica_failures"), 0, "no replica failed");
    }
    served_one_at_a_time(&t, "d", 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_its_peers_resigns_and_is_replaced() {
    let t = Trio::start(DEAD_AFTER_MS, &["--replica-quorum-wait-ms", QUORUM_WAIT_MS]).await;
    t.create_stream("q", "quorum");
    let mut acked = BTreeMap::new();
    t.publish_until_acked("q", "first", RECOVERY_MAX).await;
    let old = t.leader("q").await.unwrap();
    publish_acked(&t, old, "q", "before", 5, &mut acked).await;

    // Every UDP socket of the leader but its client listener: its peer listener and the
    // sockets it dials peers from. Its heartbeats and reports (TCP) still reach the control
    // plane, and clients still reach it.
    let b = &t.nodes[&old];
    let peer_ports: Vec<u16> = udp_ports_of(b.pid())
        .into_iter()
        .filter(|&p| p != b.quic.port())
        .collect();
    assert!(
        peer_ports.contains(&b.peer.unwrap().port()),
        "{peer_ports:?}"
    );
    let cut = Cut::udp_ports(&peer_ports);
    let since = Instant::now();
    let c = t
        .client(old)
        .await
        .expect("the cut-off leader still takes clients");
    let mut answers = BTreeMap::<String, u32>::new();
    let mut i = 0;
    let new = loop {
        // A short wait, so that the loop sees the new leader soon after it is named.
        match publish_one(&c, "q", &format!("cut-{i}"), Duration::from_millis(500)).await {
            Ok(o) => panic!("the cut-off leader acknowledged cut-{i} at {o}"),
            Err(code) => *answers.entry(code).or_default() += 1,
        }
        i += 1;
        match t.leader("q").await {
            Some(l) if l != old => break l,
            _ => {}
        }
        assert!(
            since.elapsed() < RECOVERY_MAX,
            "{old} never replaced: {answers:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let replaced_after = since.elapsed();
    eprintln!(
        "cut off: node {old} replaced by {new} after {replaced_after:?}; it answered {answers:?}"
    );
    let o = t.publish_until_acked("q", "after-cut", RECOVERY_MAX).await;
    acked.insert(o, Bytes::from("after-cut"));
    eprintln!("the new leader acknowledged after {:?}", since.elapsed());

    // Healed: the old leader is fenced by the new generation and follows; all three hold the
    // shard again, and nothing acknowledged was lost.
    drop(cut);
    let s = t.wait_full("q", RECOVERY_MAX).await;
    eprintln!("healed: {s}");
    assert_eq!(s["leader"].as_u64(), Some(new));
    // It follows now: a publish sent to it is forwarded to the new leader.
    let o = publish_one(&c, "q", "through-old", PUBLISH_WAIT)
        .await
        .expect("forwarded by the old leader to the new one");
    acked.insert(o, Bytes::from("through-old"));
    check_acked_on_leader(&t, "q", &acked, RECOVERY_MAX).await;
    for b in t.nodes.values() {
        assert_eq!(b.total("replica_failures"), 0, "no replica failed");
    }
    served_one_at_a_time(&t, "q", 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_follower_and_a_dead_leader_wait_for_the_operators_way_out() {
    let mut t = Trio::start(DEAD_AFTER_MS, &[]).await;
    t.create_stream("q", "quorum");
    let mut acked = BTreeMap::new();
    t.publish_until_acked("q", "first", RECOVERY_MAX).await;
    let l = t.leader("q").await.unwrap();
    let f = followers(&t, "q", l).await;
    publish_acked(&t, l, "q", "all", 5, &mut acked).await;
    // f[1] dies; the leader and f[0] commit more, past what f[1] holds.
    t.kill(f[1]);
    let mut after = BTreeMap::new();
    publish_acked(&t, l, "q", "two", 5, &mut after).await;
    // f[0] is wiped and the leader dies: f[0] comes back empty under a new identity, f[1]
    // comes back behind the mark. No replica qualifies (rule 8).
    t.kill(f[0]);
    t.wipe(f[0]);
    t.kill(l);
    t.restart(f[0]);
    t.restart(f[1]);
    let since = Instant::now();
    loop {
        let s = t.shard("q").await;
        if s["state"] == "unavailable" {
            break;
        }
        assert!(since.elapsed() < RECOVERY_MAX, "never unavailable: {s}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // It waits: still unavailable a while later, no new generation issued.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let s = t.shard("q").await;
    assert_eq!(
        (s["state"].as_str(), s["generation"].as_u64()),
        (Some("unavailable"), Some(1)),
        "{s}"
    );

    // The operator's way out: the live replica furthest ahead, f[1], leads generation 2; the
    // records committed after it died may be lost, and the command says how many.
    let out = t.ctl(&[
        "--tenant",
        "acme",
        "--namespace",
        "prod",
        "-o",
        "json",
        "shard",
        "abandon",
        "q",
        "0",
        "--yes",
    ]);
    eprintln!("abandon: {out}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    assert_eq!(v["leader"].as_u64(), Some(f[1]), "{v}");
    assert!(v["may_lose_records"].as_u64() >= Some(5), "{v}");
    let o = t
        .publish_until_acked("q", "after-abandon", RECOVERY_MAX)
        .await;
    acked.insert(o, Bytes::from("after-abandon"));
    // Everything committed before f[1] died is there; what only the dead leader and the
    // wiped follower held is gone, as the command said.
    let got = check_acked_on_leader(&t, "q", &acked, RECOVERY_MAX).await;
    assert!(
        after.values().all(|p| !got.values().any(|g| g == p)),
        "{got:?}"
    );
    // The old leader returns, is cut back to the new leader's log, and all three hold it.
    t.restart(l);
    let s = t.wait_full("q", RECOVERY_MAX).await;
    eprintln!("after the old leader came back: {s}");
    served_one_at_a_time(&t, "q", 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_stopped_with_sigterm_is_replaced_without_being_counted_dead_first() {
    // Counted dead only after 20 s of silence: a replacement sooner comes from the leave.
    const SLOW_DEAD_AFTER_MS: u64 = 20_000;
    let mut t = Trio::start(SLOW_DEAD_AFTER_MS, &[]).await;
    t.create_stream("q", "quorum");
    let mut acked = BTreeMap::new();
    t.publish_until_acked("q", "first", RECOVERY_MAX).await;
    let old = t.leader("q").await.unwrap();
    publish_acked(&t, old, "q", "before", 5, &mut acked).await;
    let since = Instant::now();
    let code = t.stop(old, Duration::from_secs(15));
    assert_eq!(code, Some(0), "a clean stop");
    let new = loop {
        match t.leader("q").await {
            Some(l) if l != old => break l,
            _ => {}
        }
        assert!(
            since.elapsed() < Duration::from_millis(SLOW_DEAD_AFTER_MS / 2),
            "not replaced within half the dead time: the stop did not say it leaves"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!(
        "SIGTERM of node {old}: node {new} named after {:?}",
        since.elapsed()
    );
    let brokers = t.view.get("/v1/brokers").await;
    let b = brokers
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["node_id"].as_u64() == Some(old))
        .unwrap();
    assert_eq!(b["live"], false, "the stopped broker is counted dead: {b}");
    // Sent at once to the new leader, which is still fencing or waiting out the old lease:
    // held, not refused, and acknowledged once it serves (one attempt, no retry).
    let c = t.client(new).await.expect("the new leader answers");
    let o = publish_one(&c, "q", "during-hand-off", Duration::from_secs(8))
        .await
        .expect("held through the hand-off and acknowledged");
    acked.insert(o, Bytes::from("during-hand-off"));
    eprintln!("the new leader acknowledged after {:?}", since.elapsed());
    assert!(
        t.nodes[&new].total("replica_publishes_held") >= 1,
        "the publish was held, not taken at once"
    );
    t.restart(old);
    t.wait_full("q", RECOVERY_MAX).await;
    check_acked_on_leader(&t, "q", &acked, RECOVERY_MAX).await;
    served_one_at_a_time(&t, "q", 2);
}

/// Publish `n` records of `bytes` each to node `id`, each acknowledged; into `acked`.
async fn publish_big(
    t: &Trio,
    id: u64,
    name: &str,
    tag: &str,
    n: usize,
    bytes: usize,
    acked: &mut BTreeMap<u64, Bytes>,
) {
    let c = t.client(id).await.expect("the leader answers");
    for i in 0..n {
        let mut p = format!("{tag}-{i}-");
        p.extend(std::iter::repeat_n('x', bytes.saturating_sub(p.len())));
        let o = publish_one(&c, name, &p, PUBLISH_WAIT)
            .await
            .unwrap_or_else(|e| panic!("{tag}-{i} to node {id}: {e}"));
        acked.insert(o, Bytes::from(p));
    }
}

/// Wait (`max` at most) until node `id`'s oldest segment on disk starts past offset 0; that
/// offset and its retention hold.
async fn trimmed_on(t: &Trio, id: u64, max: Duration) -> (u64, u64) {
    let start = Instant::now();
    loop {
        let (oldest, hold) = t.oldest_on_disk(id);
        if oldest > 0 {
            return (oldest, hold);
        }
        assert!(start.elapsed() < max, "retention never ran on node {id}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_stops_at_the_commit_mark_and_a_follower_behind_it_is_rebuilt() {
    // 1 MiB segments (the smallest) and a 2 MiB retention bound; records of 60 KB.
    const RECORD_BYTES: usize = 60_000;
    let mut t = Trio::start(DEAD_AFTER_MS, &["--durable-segment-bytes", "1048576"]).await;
    t.create_stream_with("r", "leader", &["--retention-bytes", "2097152"]);
    let mut acked = BTreeMap::new();
    t.publish_until_acked("r", "first", RECOVERY_MAX).await;
    t.wait_full("r", RECOVERY_MAX).await;
    let leader = t.leader("r").await.unwrap();
    let f = followers(&t, "r", leader).await;

    // A follower down while the leader writes three times the bound: retention on the leader
    // and on the other follower removes what the one down still needs, never past the mark.
    t.kill(f[0]);
    publish_big(&t, leader, "r", "down", 100, RECORD_BYTES, &mut acked).await;
    let (base, hold) = trimmed_on(&t, leader, RECOVERY_MAX).await;
    let s = t.shard("r").await;
    let commit = s["commit"].as_u64().unwrap();
    eprintln!("leader {leader}: oldest {base}, hold {hold}, commit {commit}");
    // Lag in bytes: the one down is behind by all the leader holds (more than a segment).
    let lag_bytes = |s: &serde_json::Value, n: u64| {
        let r = s["replicas"].as_array().unwrap();
        r.iter().find(|x| x["node"] == n).unwrap()["lag_bytes"].as_u64()
    };
    let behind = lag_bytes(&s, f[0]).unwrap_or(0);
    assert!(
        behind > 1 << 20,
        "node {} behind by {behind} bytes: {s}",
        f[0]
    );
    assert!(
        base <= commit,
        "retention removed records at or above the mark"
    );

    // Back, it is rebuilt from the leader's base and holds the shard again.
    t.restart(f[0]);
    let s = t.wait_full("r", RECOVERY_MAX).await;
    eprintln!("after the follower came back: {s}");
    for n in [f[0], f[1]] {
        assert_eq!(
            lag_bytes(&s, n),
            Some(0),
            "node {n} level with the leader: {s}"
        );
    }
    let rebuilt = t.nodes[&f[0]].total("replica_rebuilds");
    assert_eq!(rebuilt, 1, "node {} rebuilt from the leader's base", f[0]);
    let (its_base, _) = t.oldest_on_disk(f[0]);
    assert!(
        its_base > 0,
        "its log starts at the leader's base, not at 0"
    );

    // The control plane frozen: the mark stands still while a `leader` stream goes on taking
    // records. Retention keeps everything from the mark on, however far past the bound.
    let mark = t.shard("r").await["commit"].as_u64().unwrap();
    t.signal_control_plane(libc::SIGSTOP);
    publish_big(&t, leader, "r", "frozen", 60, RECORD_BYTES, &mut acked).await;
    tokio::time::sleep(Duration::from_millis(2_500)).await; // retention runs every second
    for id in 1..=3 {
        let (oldest, hold) = t.oldest_on_disk(id);
        eprintln!("frozen: node {id} oldest {oldest}, hold {hold}, mark {mark}");
        assert!(
            oldest <= mark,
            "node {id} trimmed past the standing mark {mark}"
        );
        assert!(
            hold <= mark,
            "node {id} holds at {hold}, past the mark {mark}"
        );
    }
    t.signal_control_plane(libc::SIGCONT);
    let o = t.publish_until_acked("r", "thawed", RECOVERY_MAX).await;
    acked.insert(o, Bytes::from("thawed"));

    // Restarted on its files, each broker holds from where its hold says, and the leader still
    // serves every acknowledged record it retains; then the new leader after a kill does too.
    for id in 1..=3 {
        t.kill(id);
    }
    for id in 1..=3 {
        t.restart(id);
    }
    t.wait_full("r", RECOVERY_MAX).await;
    let got = check_acked_retained(&t, "r", &acked, RECOVERY_MAX).await;
    let oldest = *got.keys().next().unwrap();
    eprintln!("after the restart the leader serves from {oldest}");
    let commit = t.shard("r").await["commit"].as_u64().unwrap();
    assert!(oldest <= commit);
    let leader = t.leader("r").await.unwrap();
    t.kill(leader);
    let o = t.publish_until_acked("r", "failover", RECOVERY_MAX).await;
    acked.insert(o, Bytes::from("failover"));
    check_acked_retained(&t, "r", &acked, RECOVERY_MAX).await;
    for b in t.nodes.values() {
        assert_eq!(b.total("replica_failures"), 0, "no replica failed");
    }
}

/// The set of shard 0 of `name` as placement shows it (the leader first).
async fn replica_set(t: &Trio, name: &str) -> Vec<u64> {
    let s = t.shard(name).await;
    s["replicas"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x["node"].as_u64()).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_dead_past_the_replace_time_is_replaced_by_a_spare_that_catches_up() {
    // Rule 11: counted dead (1.5 s) and then dead for 2 s more, a follower is swapped for the
    // fourth broker in a new generation; the spare catches up, counts, and may lead.
    std::env::set_var("FELIX_CONTROLPLANE_REPLICA_REPLACE_AFTER_MS", "2000");
    let mut t = Trio::start_n(
        4,
        DEAD_AFTER_MS,
        &["--replica-quorum-wait-ms", QUORUM_WAIT_MS],
    )
    .await;
    t.create_stream("q", "quorum");
    let mut acked = BTreeMap::new();
    let o = t.publish_until_acked("q", "first", RECOVERY_MAX).await;
    acked.insert(o, Bytes::from("first"));
    let leader = t.leader("q").await.unwrap();
    // Auth is on (common/replicated.rs): a client without a token is refused.
    let mut anon = t.nodes[&leader].client_config();
    anon.token = None;
    if let Ok(Ok(c)) = tokio::time::timeout(PUBLISH_WAIT, felix_client::Client::connect(anon)).await
    {
        let r = publish_one(&c, "q", "anonymous", PUBLISH_WAIT).await;
        eprintln!("an anonymous publish: {r:?}");
        assert!(r.is_err(), "an anonymous publish was acknowledged: {r:?}");
    }
    let set = replica_set(&t, "q").await;
    assert!(
        !set.contains(&4),
        "a new shard's set is the three lowest: {set:?}"
    );
    let f = followers(&t, "q", leader).await;
    publish_acked(&t, leader, "q", "all", 20, &mut acked).await;
    let gen = t.shard("q").await["generation"].as_u64().unwrap();

    t.kill(f[0]);
    let killed = Instant::now();
    // One follower down: acknowledgements go on while placement waits out the replace time.
    publish_acked(&t, leader, "q", "one-down", 10, &mut acked).await;
    let s = loop {
        let set = replica_set(&t, "q").await;
        if set.contains(&4) {
            break t.shard("q").await;
        }
        assert!(
            killed.elapsed() < RECOVERY_MAX,
            "node {} never replaced: {}",
            f[0],
            t.shard("q").await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let took = killed.elapsed();
    eprintln!("replaced after {took:?}: {s}");
    // Counted from the broker's last heartbeat, which may precede the kill by one heartbeat
    // interval (100 ms here): CI once saw 3.498 s against 3.5.
    assert!(
        took >= Duration::from_millis(DEAD_AFTER_MS + 2_000 - 150),
        "replaced before it was dead for the replace time: {took:?}"
    );
    assert_eq!(s["leader"].as_u64(), Some(leader), "the live leader stays");
    assert!(
        s["generation"].as_u64().unwrap() > gen,
        "in a new generation: {s}"
    );
    let set = replica_set(&t, "q").await;
    assert!(!set.contains(&f[0]) && set.len() == 3, "{set:?}");
    let metrics = t.view.get_text("/metrics").await;
    assert!(
        metrics.contains("felix_controlplane_replica_replacements_total 1\n"),
        "one replacement counted: {}",
        metrics
            .lines()
            .filter(|l| l.contains("replace"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // The spare catches up from the leader and counts once the leader reports it.
    let o = t.publish_until_acked("q", "replaced", RECOVERY_MAX).await;
    acked.insert(o, Bytes::from("replaced"));
    let s = t.wait_full("q", RECOVERY_MAX).await;
    eprintln!("the spare is level: {s}");

    // The old follower comes back: it is no replica any more and changes nothing.
    t.restart(f[0]);
    publish_acked(&t, leader, "q", "old-back", 5, &mut acked).await;
    let set = replica_set(&t, "q").await;
    assert!(!set.contains(&f[0]), "{set:?}");

    // The leader dies: the other old follower or the spare leads, with every acknowledged
    // record (the spare holds them all).
    t.kill(leader);
    let o = t
        .publish_until_acked("q", "after-failover", RECOVERY_MAX)
        .await;
    acked.insert(o, Bytes::from("after-failover"));
    let new = t.leader("q").await.unwrap();
    assert!(new == f[1] || new == 4, "led by {new}");
    check_acked_on_leader(&t, "q", &acked, RECOVERY_MAX).await;

    // The dead old leader is replaced in turn, by the one broker outside the set: the old
    // follower, which is swapped in again and starts from the files it kept (behind, and
    // from older generations: matched, cut or rebuilt, then level).
    let since = Instant::now();
    loop {
        let set = replica_set(&t, "q").await;
        if set.contains(&f[0]) && !set.contains(&leader) {
            break;
        }
        assert!(
            since.elapsed() < RECOVERY_MAX,
            "node {leader} never replaced: {}",
            t.shard("q").await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let o = t
        .publish_until_acked("q", "old-follower-back-in", RECOVERY_MAX)
        .await;
    acked.insert(o, Bytes::from("old-follower-back-in"));
    let s = t.wait_full("q", RECOVERY_MAX).await;
    eprintln!("node {} swapped in again and level: {s}", f[0]);
    check_acked_on_leader(&t, "q", &acked, RECOVERY_MAX).await;
    for b in t.nodes.values() {
        assert_eq!(b.total("replica_failures"), 0, "no replica failed");
    }
    served_one_at_a_time(&t, "q", 2);
}

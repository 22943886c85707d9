//! Three brokers and a control plane run with `--replication-preview`, for the tests of
//! replicated streams with real processes (`replication_chaos.rs`, `replication_faults.rs`):
//! start, kill and restart brokers on their files, read placement's view of a shard, publish
//! one record and say how it was answered, and read a shard back from its start.
//!
//! Auth is on, as in production: the control plane serves HTTPS and checks bearer tokens,
//! each broker runs on the node credential `felixctl node enroll` issued it (its reports to
//! placement, its heartbeats and its catalog feed carry it), brokers check clients' tokens
//! (`--auth auto`), and the tests act with the admin token.

use super::cluster::{restart_node, start_node};
use super::cp::{
    ctl_ok, read_admin_token, start_control_plane_auth_dead_after, start_control_plane_group,
    ControlPlane,
};
use super::serving::{intervals, mono_ns, overlap, Interval, Process};
use super::Broker;
use bytes::Bytes;
use felix_client::{Client, Event, SubscribeOptions};
use felix_quic::tls::generate_cluster_certs;
use felix_quic::wire::{ErrorCode, ShardSelector, StartAt, StreamName};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// One publish may take this long before the test counts it unanswered (a frozen or cut-off
/// leader does not answer).
pub const PUBLISH_WAIT: Duration = Duration::from_secs(3);

/// How the tests reach the control plane's REST API: its address, the CA its HTTPS
/// certificate is signed by, and the admin token. Cheap to clone into a task.
#[derive(Clone)]
pub struct CpView {
    pub url: String,
    http: reqwest::Client,
}

impl CpView {
    fn new(cp: &ControlPlane, token: &str) -> CpView {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert(
            reqwest::header::AUTHORIZATION,
            format!("Bearer {token}").parse().unwrap(),
        );
        let mut b = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .default_headers(h);
        if let Some(ca) = &cp.ca {
            let pem = std::fs::read(ca).expect("the control plane's CA");
            b = b.add_root_certificate(reqwest::Certificate::from_pem(&pem).unwrap());
        }
        CpView {
            url: cp.url.clone(),
            http: b.build().unwrap(),
        }
    }

    /// GET `path` as text (empty while the control plane does not answer).
    pub async fn get_text(&self, path: &str) -> String {
        match self.http.get(format!("{}{path}", self.url)).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// GET `path` as JSON (Null while the control plane does not answer).
    pub async fn get(&self, path: &str) -> serde_json::Value {
        match self.http.get(format!("{}{path}", self.url)).send().await {
            Ok(r) => r.json::<serde_json::Value>().await.unwrap_or_default(),
            Err(_) => serde_json::Value::Null,
        }
    }
}

/// A control plane and brokers 1..=3, tenant `acme` and namespace `prod` made.
pub struct Trio {
    /// The control plane the brokers talk to (with a Raft group: its leader when it started).
    pub cp: ControlPlane,
    /// With a Raft group ([`Trio::start_with_cp_group`]): the other two members.
    cp_followers: Vec<ControlPlane>,
    /// The control plane's REST API, as the admin.
    pub view: CpView,
    /// The admin token (clients and felixctl use it).
    pub admin: String,
    pub tmp: tempfile::TempDir,
    pub certs: PathBuf,
    /// The running brokers, by node id.
    pub nodes: BTreeMap<u64, Broker>,
    /// The data directories of killed brokers, kept for their restart.
    down: BTreeMap<u64, tempfile::TempDir>,
    /// Extra broker flags, given at every (re)start.
    extra: Vec<String>,
    /// Every broker process started, in order, with its serving log (`serving.rs`).
    procs: Vec<Process>,
}

impl Trio {
    /// Start the control plane (a broker silent for `dead_after_ms` is counted dead) and three
    /// brokers with `extra` flags, and wait until all three registered a storage identity.
    pub async fn start(dead_after_ms: u64, extra: &[&str]) -> Trio {
        Trio::start_n(3, dead_after_ms, extra).await
    }

    /// [`Trio::start`] with `brokers` brokers (1..=brokers); streams still get three copies,
    /// so the brokers past three start outside every replica set (a spare for rule 11).
    pub async fn start_n(brokers: u64, dead_after_ms: u64, extra: &[&str]) -> Trio {
        Trio::start_on(brokers, dead_after_ms, extra, false).await
    }

    /// [`Trio::start`] on a control plane of three Raft members. The brokers talk to the
    /// member that leads once the group settled (`Trio::cp`); [`Trio::signal_cp_followers`]
    /// signals the other two.
    pub async fn start_with_cp_group(dead_after_ms: u64, extra: &[&str]) -> Trio {
        Trio::start_on(3, dead_after_ms, extra, true).await
    }

    async fn start_on(brokers: u64, dead_after_ms: u64, extra: &[&str], group: bool) -> Trio {
        // Inherited by the control plane (and harmlessly by the brokers).
        std::env::set_var("FELIX_REPLICATION_PREVIEW", "true");
        let tmp = tempfile::tempdir().unwrap();
        let (cp, cp_followers, admin) = if group {
            let mut members = start_control_plane_group(tmp.path(), dead_after_ms);
            let admin = read_admin_token(&tmp.path().join("admin-0.token"));
            let leader = raft_leader(&members, &admin).await;
            let cp = members.remove(leader);
            (cp, members, admin)
        } else {
            let token = tmp.path().join("admin.token");
            let cp = start_control_plane_auth_dead_after(&token, dead_after_ms);
            (cp, Vec::new(), read_admin_token(&token))
        };
        let view = CpView::new(&cp, &admin);
        let certs = tmp.path().join("certs");
        let ids: Vec<u64> = (1..=brokers).collect();
        generate_cluster_certs(&certs, &ids).unwrap();
        let mut t = Trio {
            cp,
            cp_followers,
            view,
            admin,
            tmp,
            certs,
            nodes: BTreeMap::new(),
            down: BTreeMap::new(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            procs: Vec::new(),
        };
        for id in 1..=brokers {
            // The node credential the broker runs on (reports, heartbeats, the feed).
            let token = t.ctl(&["node", "enroll", &id.to_string()]);
            std::fs::write(t.node_token(id), token).unwrap();
            let a = t.args(id);
            let a: Vec<&str> = a.iter().map(String::as_str).collect();
            let b = start_node(&t.cp, &t.certs, id, &a);
            t.insert(id, b);
        }
        t.wait_for_storage_ids(brokers as usize).await;
        t.ctl(&["tenant", "create", "acme"]);
        t.ctl(&["--tenant", "acme", "namespace", "create", "prod"]);
        t
    }

    /// Node `id`'s flags: its durable directory (outside the data directory a kill hands
    /// back, so that it survives every restart), its node credential, the control plane's
    /// CA, auth from the control plane, and the extra flags.
    fn args(&self, id: u64) -> Vec<String> {
        let dir = self.tmp.path().join(format!("durable-{id}"));
        let ca = self.cp.ca.as_ref().expect("the control plane serves HTTPS");
        let mut a: Vec<String> = [
            "--durable-storage-dir",
            &dir.display().to_string(),
            "--controlplane-token-file",
            &self.node_token(id).display().to_string(),
            "--controlplane-ca",
            &ca.display().to_string(),
            "--auth",
            "auto",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(self.extra.iter().cloned());
        a
    }

    fn node_token(&self, id: u64) -> PathBuf {
        self.tmp.path().join(format!("node-{id}.token"))
    }

    /// A started broker: its clients and metrics use the admin token.
    fn insert(&mut self, id: u64, b: Broker) {
        *b.client_token.lock().unwrap() = Some(self.admin.clone());
        *b.metrics_token.lock().unwrap() = Some(self.admin.clone());
        self.procs.push(Process {
            node: id,
            lines: b.serving.clone(),
            gone_ns: None,
        });
        self.nodes.insert(id, b);
    }

    /// Node `id`'s process is gone (reaped): it served nothing from now on.
    fn gone(&mut self, id: u64) {
        let now = mono_ns();
        if let Some(p) = self.procs.iter_mut().rev().find(|p| p.node == id) {
            p.gone_ns.get_or_insert(now);
        }
    }

    /// Check that no two broker processes ever served one shard of `name` at once (rules 2
    /// and 4), from the intervals every broker logged; the nodes that served it. Call it once
    /// every frozen broker was thawed: a frozen one ends its interval when it wakes.
    pub fn check_one_server(&self, name: &str) -> BTreeSet<u64> {
        let all: Vec<Interval> = intervals(&self.procs, mono_ns())
            .into_iter()
            .filter(|i| i.shard.starts_with(&format!("acme/prod/{name} ")))
            .collect();
        for i in &all {
            eprintln!(
                "served {}: node {} (process {}) generation {} for {} ms",
                i.shard,
                i.node,
                i.process,
                i.gen,
                (i.to_ns - i.from_ns) / 1_000_000
            );
        }
        if let Some((a, b)) = overlap(&all) {
            panic!("two brokers served {name} at once: {a:?} and {b:?}");
        }
        all.iter().map(|i| i.node).collect()
    }

    /// Wait (20 s at most) until `n` brokers registered with a storage identity: a stream of
    /// three copies is refused before that.
    async fn wait_for_storage_ids(&self, n: usize) {
        let t = Instant::now();
        loop {
            let v = self.view.get("/v1/brokers").await;
            let with_id = v.as_array().map_or(0, |a| {
                a.iter().filter(|b| b["storage_id"].is_string()).count()
            });
            if with_id >= n {
                return;
            }
            assert!(t.elapsed() < Duration::from_secs(20), "brokers: {v}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// felixctl against the control plane as the admin; its stdout, and it must succeed.
    pub fn ctl(&self, args: &[&str]) -> String {
        ctl_ok(&self.cp, self.tmp.path(), &self.admin, args)
    }

    /// Create stream `name` in acme/prod: durable, one shard, three copies, `consistency`.
    pub fn create_stream(&self, name: &str, consistency: &str) {
        self.create_stream_with(name, consistency, &[]);
    }

    /// [`Trio::create_stream`] with more `stream create` flags.
    pub fn create_stream_with(&self, name: &str, consistency: &str, extra: &[&str]) {
        let mut args = vec![
            "--tenant",
            "acme",
            "--namespace",
            "prod",
            "stream",
            "create",
            name,
            "--durable",
            "--replication-factor",
            "3",
            "--consistency",
            consistency,
        ];
        args.extend_from_slice(extra);
        self.ctl(&args);
    }

    /// The oldest offset on node `id`'s disk of the one replicated shard its durable
    /// directory holds (the base of its oldest segment), and the retention hold its
    /// `replica-state.json` says.
    pub fn oldest_on_disk(&self, id: u64) -> (u64, u64) {
        let root = self.tmp.path().join(format!("durable-{id}"));
        let state = find_file(&root, "replica-state.json").expect("a replica's state file");
        let dir = state.parent().unwrap();
        let (bases, _) = felix_storage::log::list_log_dir(dir).unwrap();
        let hold = serde_json::from_slice::<serde_json::Value>(&std::fs::read(&state).unwrap())
            .unwrap()["hold"]
            .as_u64()
            .unwrap_or(0);
        (bases.first().copied().unwrap_or(0), hold)
    }

    /// SIGKILL node `id`; its files are kept for [`Trio::restart`].
    pub fn kill(&mut self, id: u64) {
        let b = self.nodes.remove(&id).expect("node running");
        self.down.insert(id, b.kill());
        self.gone(id);
    }

    /// SIGTERM node `id` and wait (`max` at most) for it to exit; its files are kept for
    /// [`Trio::restart`]. Its exit code.
    pub fn stop(&mut self, id: u64, max: Duration) -> Option<i32> {
        let b = self.nodes.remove(&id).expect("node running");
        b.signal(libc::SIGTERM);
        let (code, dir) = b.wait_exit(max);
        self.gone(id);
        self.down.insert(id, dir);
        code
    }

    /// Start node `id` again on the files a [`Trio::kill`] kept.
    pub fn restart(&mut self, id: u64) {
        let dir = self.down.remove(&id).expect("node killed");
        let a = self.args(id);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let b = restart_node(&self.cp, &self.certs, id, dir, &a);
        self.insert(id, b);
    }

    /// Delete killed node `id`'s durable directory (its logs, promises and storage identity):
    /// it comes back empty, under a new identity (rule 9).
    pub fn wipe(&self, id: u64) {
        assert!(self.down.contains_key(&id), "wipe a killed node only");
        std::fs::remove_dir_all(self.tmp.path().join(format!("durable-{id}"))).unwrap();
    }

    /// Send `sig` to the control plane's process (SIGSTOP freezes it, SIGCONT thaws it).
    pub fn signal_control_plane(&self, sig: i32) {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(self.cp.child.id() as i32, sig) };
    }

    /// Send `sig` to the two control-plane members the brokers do not talk to.
    pub fn signal_cp_followers(&self, sig: i32) {
        assert_eq!(self.cp_followers.len(), 2, "a Trio on a Raft group");
        for m in &self.cp_followers {
            // SAFETY: plain kill(2) on our own child's pid.
            unsafe { libc::kill(m.child.id() as i32, sig) };
        }
    }

    /// Placement's view of shard 0 of `name` (`GET .../replication`).
    pub async fn shard(&self, name: &str) -> serde_json::Value {
        shard_at(&self.view, name).await
    }

    /// The node placement names leader of shard 0 of `name`, once its generation's start
    /// record is committed.
    pub async fn leader(&self, name: &str) -> Option<u64> {
        leader_at(&self.view, name).await
    }

    /// Wait (`max` at most) until placement shows shard 0 of `name` with all three replicas
    /// live, vouched, holding the commit mark and where the leader is (the replication factor
    /// is back); the view.
    pub async fn wait_full(&self, name: &str, max: Duration) -> serde_json::Value {
        let t = Instant::now();
        loop {
            let s = self.shard(name).await;
            let commit = s["commit"].as_u64().unwrap_or(0);
            // Where the leader is: every replica must be there too (the same end, and the same
            // generation below it, so none holds a divergent suffix it has yet to cut).
            let at = |x: &serde_json::Value| (x["last_generation"].clone(), x["end"].clone());
            let lead = s["replicas"]
                .as_array()
                .and_then(|r| r.iter().find(|x| x["node"] == s["leader"]).map(at));
            let full = s["replicas"].as_array().is_some_and(|r| {
                r.len() == 3
                    && r.iter().all(|x| {
                        Some(at(x)) == lead
                            && x["live"] == true
                            && x["vouched"] == true
                            && x["end"].as_u64() >= Some(commit)
                    })
            });
            if commit >= 1 && full {
                return s;
            }
            if t.elapsed() >= max {
                panic!(
                    "{name} never had three full replicas: {s}\nthe brokers' replica counters: {}",
                    self.replica_counters()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Every running broker's `felix_replica_*` counters (summed over cores), for a failure's
    /// message.
    pub fn replica_counters(&self) -> String {
        let mut out = String::new();
        for (id, b) in &self.nodes {
            let mut c: Vec<(String, u64)> = b
                .counters()
                .into_iter()
                .filter(|(k, _)| k.starts_with("replica_"))
                .map(|(k, v)| (k, v.iter().sum()))
                .collect();
            c.sort();
            out.push_str(&format!("\n  node {id}: {c:?}"));
        }
        out
    }

    /// A client of node `id`, or None when it does not connect within [`PUBLISH_WAIT`].
    pub async fn client(&self, id: u64) -> Option<Client> {
        let cfg = self.nodes.get(&id)?.client_config();
        tokio::time::timeout(PUBLISH_WAIT, Client::connect(cfg))
            .await
            .ok()?
            .ok()
    }

    /// Wait (`max` at most) until the leader of `name` acknowledges `payload`; its offset.
    pub async fn publish_until_acked(&self, name: &str, payload: &str, max: Duration) -> u64 {
        let t = Instant::now();
        let mut last = String::new();
        while t.elapsed() < max {
            if let Some(l) = self.leader(name).await {
                if let Some(c) = self.client(l).await {
                    match publish_one(&c, name, payload, PUBLISH_WAIT).await {
                        Ok(o) => return o,
                        Err(e) => last = e,
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{payload} not acknowledged on {name} within {max:?} (last: {last})");
    }
}

/// Wait (30 s at most) until the three members agree on a leader with three voters; the
/// index of that leader in `members`.
async fn raft_leader(members: &[ControlPlane], admin: &str) -> usize {
    let views: Vec<CpView> = members.iter().map(|m| CpView::new(m, admin)).collect();
    let t = Instant::now();
    loop {
        let mut seen = BTreeSet::new();
        for v in &views {
            let s = v.get("/v1/cluster").await;
            let voters = s["voters"].as_array().map_or(0, |a| a.len());
            match s["leader"].as_u64() {
                Some(l) if voters == 3 => seen.insert(Some(l)),
                _ => seen.insert(None),
            };
        }
        if let [Some(l)] = seen.into_iter().collect::<Vec<_>>()[..] {
            return l as usize - 1;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the control plane's Raft group never settled"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Placement's view of shard 0 of acme/prod/`name` at the control plane `cp` (Null while
/// it does not answer).
pub async fn shard_at(cp: &CpView, name: &str) -> serde_json::Value {
    let path = format!("/v1/tenants/acme/namespaces/prod/streams/{name}/replication");
    cp.get(&path).await["shards"][0].clone()
}

/// The leader [`shard_at`] names, once its generation's start record is committed.
pub async fn leader_at(cp: &CpView, name: &str) -> Option<u64> {
    let s = shard_at(cp, name).await;
    (s["commit"].as_u64()? >= 1)
        .then(|| s["leader"].as_u64())
        .flatten()
}

/// Publish one record to shard 0 of acme/prod/`name` through `c`: its offset, or how it was
/// answered otherwise (an error code's name, "connection", or "timeout" past `wait`).
pub async fn publish_one(
    c: &Client,
    name: &str,
    payload: &str,
    wait: Duration,
) -> Result<u64, String> {
    let stream = StreamName::new("acme", "prod", name);
    let p = Bytes::from(payload.to_string());
    match tokio::time::timeout(
        wait,
        c.publish_batch(&stream, ShardSelector::Shard(0), vec![p]),
    )
    .await
    {
        Ok(Ok(a)) => Ok(a.first_offset),
        Ok(Err(e)) => Err(e.code().map_or("connection", ErrorCode::name).to_string()),
        Err(_) => Err("timeout".to_string()),
    }
}

/// Read shard 0 of acme/prod/`name` on `b` from the start (its oldest retained record)
/// through offset `last`: offset → payload, or None when the broker does not serve it now
/// (not the leader yet, not serving, or cut off). Offsets from the start must be contiguous.
pub async fn read_from_start(b: &Broker, name: &str, last: u64) -> Option<BTreeMap<u64, Bytes>> {
    let c = tokio::time::timeout(PUBLISH_WAIT, b.client()).await.ok()?;
    let stream = StreamName::new("acme", "prod", name);
    let opts = SubscribeOptions {
        start: StartAt::Earliest,
        ..SubscribeOptions::default()
    };
    let mut sub = c.subscribe(&stream, 0, opts).await.ok()?;
    let mut got = BTreeMap::new();
    let mut next: Option<u64> = None;
    while next.is_none_or(|n| n <= last) {
        match sub.next_timeout(Duration::from_secs(5)).await {
            Ok(Some(ev @ Event::Records { .. })) => {
                for (o, p) in ev.records() {
                    if let Some(n) = next {
                        assert_eq!(o, n, "offsets from the start are contiguous");
                    }
                    next = Some(o + 1);
                    got.insert(o, p);
                }
            }
            _ => return None,
        }
    }
    Some(got)
}

/// Wait (`max` at most) until the leader of `name` serves the shard from its start (offset
/// 0) through `last`, and check that every record of `acked` is there at its offset.
pub async fn check_acked_on_leader(
    t: &Trio,
    name: &str,
    acked: &BTreeMap<u64, Bytes>,
    max: Duration,
) -> BTreeMap<u64, Bytes> {
    let got = check_acked_retained(t, name, acked, max).await;
    assert_eq!(got.keys().next(), Some(&0), "{name} is read from offset 0");
    got
}

/// [`check_acked_on_leader`] on a stream with retention: the leader's log starts at its
/// oldest retained record, and every record of `acked` from there is at its offset.
pub async fn check_acked_retained(
    t: &Trio,
    name: &str,
    acked: &BTreeMap<u64, Bytes>,
    max: Duration,
) -> BTreeMap<u64, Bytes> {
    let last = *acked.keys().next_back().expect("something acknowledged");
    let start = Instant::now();
    let got = loop {
        assert!(
            start.elapsed() < max,
            "no leader of {name} serves the whole log"
        );
        if let Some(l) = t.leader(name).await {
            if let Some(b) = t.nodes.get(&l) {
                if let Some(got) = read_from_start(b, name, last).await {
                    break got;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let oldest = *got.keys().next().expect("read through `last`");
    for (o, p) in acked.range(oldest..) {
        assert_eq!(got.get(o), Some(p), "acknowledged record at {o} of {name}");
    }
    got
}

/// The local UDP ports of process `pid`'s sockets (from /proc: its socket inodes, matched in
/// its network namespace's UDP tables).
pub fn udp_ports_of(pid: u32) -> Vec<u16> {
    let mut inodes = std::collections::HashSet::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("the process's fds") {
        let Ok(target) = std::fs::read_link(e.unwrap().path()) else {
            continue;
        };
        let t = target.display().to_string();
        if let Some(i) = t.strip_prefix("socket:[").and_then(|s| s.strip_suffix(']')) {
            inodes.insert(i.to_string());
        }
    }
    let mut ports = Vec::new();
    for table in ["udp", "udp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode ...
            if f.len() > 9 && inodes.contains(f[9]) {
                let port = f[1].rsplit(':').next().unwrap();
                ports.push(u16::from_str_radix(port, 16).unwrap());
            }
        }
    }
    ports.sort_unstable();
    ports.dedup();
    ports
}

/// A cut made with nftables: every UDP datagram from or to `ports` on this host is dropped
/// (a table of its own in the host's network namespace), until dropped. Making it must
/// succeed: a test that cannot cut fails, it never skips.
pub struct Cut {
    table: String,
}

impl Cut {
    pub fn udp_ports(ports: &[u16]) -> Cut {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        assert!(!ports.is_empty(), "nothing to cut");
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let table = format!("felix_test_cut_{}_{n}", std::process::id());
        let set = ports
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        // Loopback datagrams pass the output hook once: dropping there cuts both ways.
        let script = format!(
            "table inet {table} {{\n chain out {{\n  type filter hook output priority 0; policy accept;\n  udp sport {{ {set} }} drop\n  udp dport {{ {set} }} drop\n }}\n}}\n"
        );
        nft(&["-f", "-"], Some(&script));
        Cut { table }
    }
}

impl Drop for Cut {
    fn drop(&mut self) {
        nft(&["delete", "table", "inet", &self.table], None);
    }
}

/// Run `nft` with `args` (and `stdin`); it must succeed.
fn nft(args: &[&str], stdin: Option<&str>) {
    use std::io::Write;
    let mut child = std::process::Command::new("nft")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("nft (the nftables package; scripts/setup.sh --test installs it) must run: this test cuts links with it");
    if let Some(s) = stdin {
        child.stdin.take().unwrap().write_all(s.as_bytes()).unwrap();
    }
    drop(child.stdin.take());
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "nft {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The first file named `name` under `dir` (depth first, bounded by the tree).
fn find_file(dir: &std::path::Path, name: &str) -> Option<std::path::PathBuf> {
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let p = e.path();
        if p.is_dir() {
            if let Some(f) = find_file(&p, name) {
                return Some(f);
            }
        } else if e.file_name() == name {
            return Some(p);
        }
    }
    None
}

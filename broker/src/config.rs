//! Broker configuration: built-in defaults → YAML file (`--config`) → `FELIX_*` environment →
//! command-line flags. clap resolves flag-over-env; the YAML layer fills what neither set.
//!
//! Every setting is declared once in the `settings!` table below; the flag struct, the YAML
//! struct and the effective [`Config`] are generated from it, so the three layers cannot drift.

use clap::Parser;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;

macro_rules! settings {
    (
        defaulted { $( $(#[doc = $doc:literal])* $name:ident : $ty:ty = $default:expr, $env:literal; )* }
        optional { $( $(#[doc = $odoc:literal])* $oname:ident : $oty:ty, $oenv:literal; )* }
    ) => {
        /// Command-line flags (each also readable from its `FELIX_*` variable).
        #[derive(Debug, Clone, Parser, Default)]
        #[command(name = "felix-broker", about = "Felix thread-per-core broker", version = concat!(env!("CARGO_PKG_VERSION"), " (git ", env!("FELIX_GIT_REV"), ")"))]
        pub struct Flags {
            /// YAML configuration file.
            #[arg(long, env = "FELIX_CONFIG")]
            pub config: Option<PathBuf>,
            /// Print the effective configuration and exit.
            #[arg(long)]
            pub print_config: bool,
            $( $(#[doc = $doc])* #[arg(long, env = $env)] pub $name: Option<$ty>, )*
            $( $(#[doc = $odoc])* #[arg(long, env = $oenv)] pub $oname: Option<$oty>, )*
        }

        /// The YAML file: the same keys, snake_case; unknown keys are refused.
        #[derive(Debug, Clone, Deserialize, Default)]
        #[serde(deny_unknown_fields)]
        pub struct FileConfig {
            $( pub $name: Option<$ty>, )*
            $( pub $oname: Option<$oty>, )*
        }

        /// The effective configuration.
        #[derive(Debug, Clone, serde::Serialize)]
        pub struct Config {
            $( $(#[doc = $doc])* pub $name: $ty, )*
            $( $(#[doc = $odoc])* pub $oname: Option<$oty>, )*
        }

        impl Config {
            fn merge(flags: &Flags, file: FileConfig) -> Config {
                Config {
                    $( $name: flags.$name.clone().or(file.$name).unwrap_or_else(|| $default), )*
                    $( $oname: flags.$oname.clone().or(file.$oname), )*
                }
            }
        }
    };
}

/// The CPUs this process may run on (`sched_getaffinity`: what `taskset` or systemd's
/// `CPUAffinity=` allowed), ascending. Falls back to `0..online` if the call fails (more than
/// 1024 CPUs).
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain bits; sched_getaffinity writes at most the size given.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let ok =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) }
            == 0;
    let cpus: Vec<usize> = if ok {
        (0..libc::CPU_SETSIZE as usize)
            // SAFETY: c < CPU_SETSIZE, the set's size.
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
            .collect()
    } else {
        Vec::new()
    };
    if cpus.is_empty() {
        let online = std::thread::available_parallelism().map_or(1, |n| n.get());
        (0..online).collect()
    } else {
        cpus
    }
}

/// Parse a CPU list in the kernel's and taskset's syntax: `2-3`, `0,2`, `0-1,4`. Order is
/// kept (executor i runs on the i-th CPU listed); a CPU listed twice is refused.
pub fn parse_cpu_list(s: &str) -> Result<Vec<usize>, String> {
    const LIMIT: usize = libc::CPU_SETSIZE as usize;
    let num = |t: &str| -> Result<usize, String> {
        let n: usize = t
            .trim()
            .parse()
            .map_err(|_| format!("{t:?} is not a CPU number (expected a list like 2-3 or 0,2)"))?;
        if n >= LIMIT {
            return Err(format!("CPU {n} is out of range (0..{LIMIT})"));
        }
        Ok(n)
    };
    let mut out = Vec::new();
    for item in s.split(',') {
        let (lo, hi) = match item.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => {
                let n = num(item)?;
                (n, n)
            }
        };
        if lo > hi {
            return Err(format!("range {}-{} runs backwards", lo, hi));
        }
        for c in lo..=hi {
            if out.contains(&c) {
                return Err(format!("CPU {c} is listed twice"));
            }
            out.push(c);
        }
    }
    Ok(out)
}

/// A CPU set for people: `0-3,6`.
pub fn format_cpu_list(cpus: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if j > i {
            format!("{}-{}", cpus[i], cpus[j])
        } else {
            cpus[i].to_string()
        });
        i = j + 1;
    }
    out.join(",")
}

/// Where the executors run: `Some(cpus)` pins executor i to `cpus[i]`; `None` runs them
/// unpinned (each may use any CPU of the allowed set).
///
/// With `cpu_list`, every CPU listed must be in `allowed`, and `cores` may not exceed the
/// list: executor i gets the i-th CPU listed. Without it, executor i gets the i-th allowed
/// CPU; more executors than allowed CPUs cannot be pinned one per CPU, so they run unpinned
/// within the allowed set (as before, when cores exceeded the machine's).
pub fn executor_cpus(
    cores: usize,
    allowed: &[usize],
    cpu_list: Option<&[usize]>,
) -> Result<Option<Vec<usize>>, String> {
    match cpu_list {
        Some(list) => {
            if let Some(c) = list.iter().find(|c| !allowed.contains(c)) {
                return Err(format!(
                    "cpu_list: CPU {c} is not one this process may run on (allowed: {}; set by taskset or systemd CPUAffinity=)",
                    format_cpu_list(allowed)
                ));
            }
            if cores > list.len() {
                return Err(format!(
                    "cores ({cores}) is more than the CPUs in cpu_list ({}: {})",
                    format_cpu_list(list),
                    list.len()
                ));
            }
            Ok(Some(list[..cores].to_vec()))
        }
        None if cores <= allowed.len() => Ok(Some(allowed[..cores].to_vec())),
        None => Ok(None),
    }
}

settings! {
    defaulted {
        /// QUIC listen address (UDP).
        listen: SocketAddr = "127.0.0.1:7400".parse().unwrap(), "FELIX_LISTEN";
        /// HTTP address for /metrics, /livez, /readyz (port 0 picks a free port).
        metrics_listen: SocketAddr = "127.0.0.1:7401".parse().unwrap(), "FELIX_METRICS_LISTEN";
        /// Number of cores (executors) to run; default the number of CPUs in cpu_list, else in the process's allowed set (taskset, systemd CPUAffinity=). Executor i is pinned to the i-th of those CPUs; more cores than allowed CPUs run unpinned within the allowed set; more than cpu_list holds is refused.
        cores: usize = allowed_cpus().len().min(255), "FELIX_CORES";
        /// Data directory (dev TLS certificate lives in `<data-dir>/tls`).
        data_dir: PathBuf = PathBuf::from("felix-data"), "FELIX_DATA_DIR";
        /// Largest accepted frame (header + body), bytes.
        max_frame_bytes: usize = felix_quic::wire::DEFAULT_MAX_FRAME_BYTES, "FELIX_MAX_FRAME_BYTES";
        /// Largest record payload, bytes.
        max_payload_bytes: u32 = 1 << 20, "FELIX_MAX_PAYLOAD_BYTES";
        /// Subscriptions one connection may hold.
        max_subscriptions: u32 = 1024, "FELIX_MAX_SUBSCRIPTIONS";
        /// Publish bytes one connection may have in flight (appended but not answered).
        conn_inflight_bytes_max: u64 = 64 << 20, "FELIX_CONN_INFLIGHT_BYTES_MAX";
        /// Unanswered acked publishes one connection may have.
        conn_unacked_max: u32 = 4096, "FELIX_CONN_UNACKED_MAX";
        /// Connection idle timeout, milliseconds.
        idle_timeout_ms: u64 = 30_000, "FELIX_IDLE_TIMEOUT_MS";
        /// How long a new connection has to send its Hello (and, with auth on, to present a token that verifies) before it is closed, milliseconds (the idle timeout, if shorter, applies instead).
        hello_timeout_ms: u64 = 10_000, "FELIX_HELLO_TIMEOUT_MS";
        /// Ceiling of QUIC packet (UDP payload) size, bytes, 1200..=16383; path MTU discovery finds what each path carries below it (1200 turns discovery off).
        udp_payload_max_bytes: usize = felix_quic::DEFAULT_UDP_PAYLOAD_MAX, "FELIX_UDP_PAYLOAD_MAX_BYTES";
        /// How long a publish may wait on a full Block-policy subscriber, milliseconds.
        publish_timeout_ms: u64 = 5_000, "FELIX_PUBLISH_TIMEOUT_MS";
        /// Replay ring of an ephemeral shard: records kept.
        ring_records_max: u32 = 65_536, "FELIX_RING_RECORDS_MAX";
        /// Replay ring of an ephemeral shard: bytes kept.
        ring_bytes_max: u64 = 64 << 20, "FELIX_RING_BYTES_MAX";
        /// Subscriber queue bound, records: the default, and the most a Subscribe is granted (a larger ask gets this; SubscribeOk reports the grant).
        sub_queue_records_max: u32 = 4096, "FELIX_SUB_QUEUE_RECORDS_MAX";
        /// Subscriber queue bound, bytes: the default, and the most a Subscribe is granted.
        sub_queue_bytes_max: u64 = 16 << 20, "FELIX_SUB_QUEUE_BYTES_MAX";
        /// How long an idle core polls for work before it sleeps, microseconds (0: sleep at once). Waking a sleeping core costs tens of µs per message (more on a VM); polling briefly trades idle CPU for tail latency.
        spin_before_park_us: u64 = 200, "FELIX_SPIN_BEFORE_PARK_US";
        /// glommio io_memory per executor, bytes (memlock is 8 MiB on this kind of machine).
        io_memory_bytes: usize = 1 << 20, "FELIX_IO_MEMORY_BYTES";
        /// Default fsync mode of durable streams: on_commit, periodic or none.
        durable_fsync: String = "periodic".into(), "FELIX_DURABLE_FSYNC";
        /// Interval of the periodic fsync mode, milliseconds.
        durable_fsync_interval_ms: u64 = 250, "FELIX_DURABLE_FSYNC_INTERVAL_MS";
        /// Where the filesystem refuses RWF_NOWAIT buffered writes (ext4), commits of periodic/none logs up to 256 KiB are written with a plain pwrite on the core while such writes take at most this long, microseconds; after a slower one (the kernel blocked it) the core's commits go through io_uring for a second. 0: always io_uring (never blocks the core, but costs a kernel worker round trip per commit).
        durable_inline_write_slow_us: u64 = 1000, "FELIX_DURABLE_INLINE_WRITE_SLOW_US";
        /// Segment size of durable logs before rolling, bytes.
        durable_segment_bytes: u64 = 64 << 20, "FELIX_DURABLE_SEGMENT_BYTES";
        /// Queued-but-unwritten bytes per durable shard before publishes are refused.
        durable_pending_bytes_max: usize = 32 << 20, "FELIX_DURABLE_PENDING_BYTES_MAX";
        /// Bytes one history read (a subscriber catching up from disk) fetches at a time.
        history_fetch_bytes: usize = 256 << 10, "FELIX_HISTORY_FETCH_BYTES";
        /// Shutdown budget, milliseconds: half for answering in-flight publishes, half for
        /// connections to close after durable logs are flushed and fsynced.
        drain_timeout_ms: u64 = 5_000, "FELIX_DRAIN_TIMEOUT_MS";
        /// Log line format on stderr: text or json (filters from RUST_LOG).
        log_format: String = "text".into(), "FELIX_LOG_FORMAT";
        /// This broker's node id in the control plane's registry (1 or more).
        node_id: u64 = 1, "FELIX_NODE_ID";
        /// Consumer groups one durable shard may hold.
        group_max_per_shard: u32 = 64, "FELIX_GROUP_MAX_PER_SHARD";
        /// Longest a consumer-group poll may wait for a record (longer asks are cut to it), milliseconds.
        group_poll_wait_max_ms: u64 = 30_000, "FELIX_GROUP_POLL_WAIT_MAX_MS";
        /// Long polls waiting at once on one group (more are refused with inflight_limit).
        group_poll_waiters_max: u32 = 1024, "FELIX_GROUP_POLL_WAITERS_MAX";
        /// Cache keys (and counter names) longest accepted, bytes.
        cache_key_bytes_max: u32 = 512, "FELIX_CACHE_KEY_BYTES_MAX";
        /// Entries (and, separately, counters) one cache shard may hold; a put past it is refused cache_full.
        cache_entries_max: u64 = 1_000_000, "FELIX_CACHE_ENTRIES_MAX";
        /// Keys plus values one cache shard may hold, bytes; a put past it is refused cache_full.
        cache_bytes_max: u64 = 256 << 20, "FELIX_CACHE_BYTES_MAX";
        /// Recent changes a cache shard keeps for watches resuming by offset, entries.
        cache_replay_entries_max: u32 = 65_536, "FELIX_CACHE_REPLAY_ENTRIES_MAX";
        /// Recent changes a cache shard keeps for watches resuming by offset, bytes.
        cache_replay_bytes_max: u64 = 64 << 20, "FELIX_CACHE_REPLAY_BYTES_MAX";
        /// Events one cache watch may have queued before it is ended watch_lagged (default and maximum).
        cache_watch_max_events: u32 = 65_536, "FELIX_CACHE_WATCH_MAX_EVENTS";
        /// Bytes one cache watch may have queued before it is ended watch_lagged (default and maximum).
        cache_watch_max_bytes: u64 = 64 << 20, "FELIX_CACHE_WATCH_MAX_BYTES";
        /// Records a log-backed cache shard appends between snapshots (keys.idx) and compactions.
        cache_compact_records: u64 = 100_000, "FELIX_CACHE_COMPACT_RECORDS";
        /// Long-poll bound of one catalog changes request to the control plane, milliseconds.
        controlplane_wait_ms: u64 = 30_000, "FELIX_CONTROLPLANE_WAIT_MS";
        /// How long a forward to another broker may wait for its answer, milliseconds, past
        /// the request's own wait (a publish's timeout, a long poll's wait): then it is
        /// answered `outcome_unknown`.
        forward_timeout_ms: u64 = 5_000, "FELIX_FORWARD_TIMEOUT_MS";
        /// How long dialing a peer broker may take before the forwards waiting for that link
        /// are refused `unavailable` (nothing was sent), milliseconds.
        peer_connect_timeout_ms: u64 = 2_000, "FELIX_PEER_CONNECT_TIMEOUT_MS";
        /// Forwards one core may have waiting or in flight on one peer link; past it a forward
        /// is refused `inflight_limit` (nothing was sent).
        peer_forwards_max: u32 = 4096, "FELIX_PEER_FORWARDS_MAX";
        /// A replicated shard's leader lease, milliseconds (docs/replication-design.md, rule
        /// 2): a new leader waits it out (plus 1/4 of it) before it serves, and a leader whose
        /// replicas stop answering stops acknowledging within it. Give every broker the same
        /// value.
        replica_lease_ms: u64 = 2_000, "FELIX_REPLICA_LEASE_MS";
        /// How long a `quorum` publish waits for the commit mark before it is answered
        /// `outcome_unknown`, milliseconds.
        replica_quorum_wait_ms: u64 = 5_000, "FELIX_REPLICA_QUORUM_WAIT_MS";
        /// Records per shipment from a leader to a follower, at most.
        replica_ship_records_max: u32 = 64, "FELIX_REPLICA_SHIP_RECORDS_MAX";
        /// Who may speak: `auto` (default: `controlplane` with a control plane, else
        /// `standalone`), `standalone` (this broker's own signing key and admin token under
        /// data_dir/auth; `felix-broker token create` signs more), `controlplane` (tokens
        /// verified against the control plane's key set, fetched with the node credential
        /// and followed), `jwks` (the key set in auth_jwks), or `off` (anyone who reaches
        /// the port; a warning at every start).
        auth: String = "auto".into(), "FELIX_AUTH";
        /// How often the control plane's key set is fetched again, milliseconds (a token
        /// signed by a key not yet known asks for a fetch at once).
        auth_jwks_refresh_ms: u64 = 30_000, "FELIX_AUTH_JWKS_REFRESH_MS";
        /// Lifetime of the admin token a standalone broker writes at each start, seconds.
        auth_admin_token_ttl_s: u64 = 30 * 24 * 3600, "FELIX_AUTH_ADMIN_TOKEN_TTL_S";
        /// Serve `/metrics` without a token (for a scraper on a trusted network). With auth
        /// on it otherwise needs a bearer token with `cluster.admin` on `metrics`; `/livez`
        /// and `/readyz` never need one.
        metrics_public: bool = false, "FELIX_METRICS_PUBLIC";
    }
    optional {
        /// CPUs to pin the executors to, in the kernel's list syntax (`2-3`, `0,2`): executor i runs on the i-th CPU listed. Each must be in the process's allowed set. Default: the allowed set itself.
        cpu_list: String, "FELIX_CPU_LIST";
        /// Stream catalog file (YAML).
        catalog: PathBuf, "FELIX_CATALOG";
        /// TLS certificate chain (PEM); with --tls-key. Default: generated dev certificate.
        tls_cert: PathBuf, "FELIX_TLS_CERT";
        /// TLS private key (PEM).
        tls_key: PathBuf, "FELIX_TLS_KEY";
        /// Directory of durable stream logs; without it, durable streams are refused.
        durable_storage_dir: PathBuf, "FELIX_DURABLE_STORAGE_DIR";
        /// Default retention of durable streams by size, bytes per shard (off when unset).
        durable_retention_bytes: u64, "FELIX_DURABLE_RETENTION_BYTES";
        /// Default retention of durable streams by age, seconds (off when unset).
        durable_retention_seconds: u64, "FELIX_DURABLE_RETENTION_SECONDS";
        /// Control plane base URL (e.g. https://127.0.0.1:7410): register there and serve its
        /// catalog instead of the standalone one.
        controlplane_url: String, "FELIX_CONTROLPLANE_URL";
        /// host:port clients dial to reach this broker (registered with the control plane);
        /// default the bound QUIC address.
        advertise_addr: String, "FELIX_ADVERTISE_ADDR";
        /// Internal QUIC address other brokers dial (mutual TLS; needs peer_cert, peer_key and
        /// peer_ca). Without it this broker neither forwards nor takes forwards.
        peer_listen: SocketAddr, "FELIX_PEER_LISTEN";
        /// host:port other brokers dial to reach the peer listener; default peer_listen.
        peer_advertise_addr: String, "FELIX_PEER_ADVERTISE_ADDR";
        /// This node's peer certificate (PEM): it must name `node-<node_id>`, signed by peer_ca.
        peer_cert: PathBuf, "FELIX_PEER_CERT";
        /// The peer certificate's private key (PEM).
        peer_key: PathBuf, "FELIX_PEER_KEY";
        /// The cluster's CA (PEM): every broker of the cluster is signed by it.
        peer_ca: PathBuf, "FELIX_PEER_CA";
        /// The key set (JWKS, JSON) tokens are verified against, with auth = jwks.
        auth_jwks: PathBuf, "FELIX_AUTH_JWKS";
        /// This broker's node credential (`felixctl node enroll N` prints it), or a one-time
        /// enrolment token (`--one-time`) exchanged for one at start: presented to the control
        /// plane to register, heartbeat and read the catalog and key set, renewed in place
        /// with a third of its life left.
        controlplane_token_file: PathBuf, "FELIX_CONTROLPLANE_TOKEN_FILE";
        /// The CA (PEM) an `https://` control plane's certificate is signed by, trusted besides
        /// the system's roots (`tls/ca.pem` in a control plane's data dir with `--tls on`).
        controlplane_ca: PathBuf, "FELIX_CONTROLPLANE_CA";
    }
}

impl Config {
    /// A peer listener needs its certificate, key and the cluster CA: without them the broker
    /// refuses to start rather than take or make forwards unverified.
    fn check_peer(&self) -> Result<(), String> {
        let files = [&self.peer_cert, &self.peer_key, &self.peer_ca];
        let set = files.iter().filter(|f| f.is_some()).count();
        match (self.peer_listen.is_some(), set) {
            (true, 3) => {}
            (true, _) => {
                return Err("peer_listen needs peer_cert, peer_key and peer_ca (mutual TLS between brokers; scripts/dev-certs.sh makes them for a local cluster); nothing unverified is served".into())
            }
            (false, 0) => {}
            (false, _) => {
                return Err("peer_cert, peer_key and peer_ca are only used with peer_listen".into())
            }
        }
        if self.peer_listen.is_some() && self.controlplane_url.is_none() {
            return Err(
                "peer_listen needs controlplane_url: the control plane says which broker owns what"
                    .into(),
            );
        }
        if let Some(a) = &self.peer_advertise_addr {
            if self.peer_listen.is_none() {
                return Err("peer_advertise_addr is only used with peer_listen".into());
            }
            felix_control::catalog::check_addr(a)
                .map_err(|_| format!("peer_advertise_addr must be HOST:PORT, got {a:?}"))?;
        }
        for (name, v) in [
            ("forward_timeout_ms", self.forward_timeout_ms),
            ("peer_connect_timeout_ms", self.peer_connect_timeout_ms),
        ] {
            if v == 0 || v > 600_000 {
                return Err(format!("{name} must be 1..=600000, got {v}"));
            }
        }
        match (self.auth.as_str(), &self.auth_jwks) {
            ("off" | "standalone" | "auto", _) | ("jwks", Some(_)) => {}
            ("controlplane", _) if self.controlplane_url.is_some() => {}
            ("controlplane", _) => return Err("auth = controlplane needs controlplane_url".into()),
            ("jwks", None) => return Err("auth = jwks needs auth_jwks (a JWKS file)".into()),
            (other, _) => {
                return Err(format!(
                    "auth must be auto, standalone, controlplane, jwks or off, got {other:?}"
                ))
            }
        }
        if !(100..=3_600_000).contains(&self.auth_jwks_refresh_ms) {
            return Err(format!(
                "auth_jwks_refresh_ms must be 100..=3600000, got {}",
                self.auth_jwks_refresh_ms
            ));
        }
        if self.auth_admin_token_ttl_s == 0 {
            return Err("auth_admin_token_ttl_s must be at least 1".into());
        }
        if self.peer_forwards_max == 0 {
            return Err("peer_forwards_max must be at least 1".into());
        }
        if !(100..=600_000).contains(&self.replica_lease_ms) {
            return Err(format!(
                "replica_lease_ms must be 100..=600000, got {}",
                self.replica_lease_ms
            ));
        }
        if !(1..=600_000).contains(&self.replica_quorum_wait_ms) {
            return Err(format!(
                "replica_quorum_wait_ms must be 1..=600000, got {}",
                self.replica_quorum_wait_ms
            ));
        }
        if !(1..=4096).contains(&self.replica_ship_records_max) {
            return Err(format!(
                "replica_ship_records_max must be 1..=4096, got {}",
                self.replica_ship_records_max
            ));
        }
        Ok(())
    }
}

impl Config {
    /// Merge the layers; refuses invalid combinations with a message naming the settings.
    pub fn resolve(flags: &Flags) -> Result<Config, String> {
        let file = match &flags.config {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| format!("config {}: {e}", p.display()))?;
                serde_saphyr::from_str::<FileConfig>(&text)
                    .map_err(|e| format!("config {}: {e}", p.display()))?
            }
            None => FileConfig::default(),
        };
        let cores_given = flags.cores.is_some() || file.cores.is_some();
        let mut c = Config::merge(flags, file);
        let cpu_list = c.cpu_list_cpus()?;
        if let (Some(list), false) = (&cpu_list, cores_given) {
            c.cores = list.len();
        }
        if c.cores == 0 || c.cores > 255 {
            return Err(format!("cores must be 1..=255, got {}", c.cores));
        }
        executor_cpus(c.cores, &allowed_cpus(), cpu_list.as_deref())?;
        if c.tls_cert.is_some() != c.tls_key.is_some() {
            return Err("tls_cert and tls_key must be set together".into());
        }
        if c.max_frame_bytes < 4096 {
            return Err(format!(
                "max_frame_bytes must be at least 4096, got {}",
                c.max_frame_bytes
            ));
        }
        // 1 KiB of room keeps any one record inside every frame that carries it (a delivery,
        // a consumer-group answer) whatever the names around it.
        let room = felix_quic::wire::FRAME_OVERHEAD_BYTES;
        if c.max_payload_bytes == 0 || c.max_payload_bytes as usize > c.max_frame_bytes - room {
            return Err(format!(
                "max_payload_bytes must be 1..=max_frame_bytes - {room} ({}), got {}",
                c.max_frame_bytes - room,
                c.max_payload_bytes
            ));
        }
        if c.hello_timeout_ms == 0 {
            return Err("hello_timeout_ms must be positive".into());
        }
        for (name, v) in [
            ("max_subscriptions", c.max_subscriptions as u64),
            ("conn_inflight_bytes_max", c.conn_inflight_bytes_max),
            ("conn_unacked_max", c.conn_unacked_max as u64),
            ("publish_timeout_ms", c.publish_timeout_ms),
            ("drain_timeout_ms", c.drain_timeout_ms),
            ("ring_records_max", c.ring_records_max as u64),
            ("ring_bytes_max", c.ring_bytes_max),
            ("sub_queue_records_max", c.sub_queue_records_max as u64),
            ("sub_queue_bytes_max", c.sub_queue_bytes_max),
            ("group_max_per_shard", c.group_max_per_shard as u64),
            ("group_poll_waiters_max", c.group_poll_waiters_max as u64),
            ("cache_entries_max", c.cache_entries_max),
            ("cache_bytes_max", c.cache_bytes_max),
            (
                "cache_replay_entries_max",
                c.cache_replay_entries_max as u64,
            ),
            ("cache_replay_bytes_max", c.cache_replay_bytes_max),
            ("cache_watch_max_events", c.cache_watch_max_events as u64),
            ("cache_watch_max_bytes", c.cache_watch_max_bytes),
            ("cache_compact_records", c.cache_compact_records),
        ] {
            if v == 0 {
                return Err(format!("{name} must be positive"));
            }
        }
        felix_storage::FsyncMode::parse(&c.durable_fsync, c.durable_fsync_interval_ms)
            .map_err(|e| format!("durable_fsync: {e}"))?;
        if c.group_poll_wait_max_ms > crate::group::DURATION_LIMIT_MS {
            return Err(format!(
                "group_poll_wait_max_ms must be at most {} (12 hours), got {}",
                crate::group::DURATION_LIMIT_MS,
                c.group_poll_wait_max_ms
            ));
        }
        // A key, the names and the fixed fields of a cache frame (~260 bytes) must fit in the
        // 1 KiB of room max_payload_bytes leaves, so a value of max_payload_bytes always fits.
        if c.cache_key_bytes_max == 0 || c.cache_key_bytes_max > 640 {
            return Err(format!(
                "cache_key_bytes_max must be 1..=640, got {}",
                c.cache_key_bytes_max
            ));
        }
        if c.durable_fsync_interval_ms == 0 {
            return Err("durable_fsync_interval_ms must be positive".into());
        }
        if c.durable_segment_bytes < 1 << 20 || c.durable_segment_bytes > 1 << 32 {
            return Err(format!(
                "durable_segment_bytes must be 1 MiB..=4 GiB, got {}",
                c.durable_segment_bytes
            ));
        }
        if c.history_fetch_bytes < 4096 || c.history_fetch_bytes > 16 << 20 {
            return Err("history_fetch_bytes must be 4 KiB..=16 MiB".into());
        }
        if c.log_format != "text" && c.log_format != "json" {
            return Err(format!(
                "log_format must be text or json, got {:?}",
                c.log_format
            ));
        }
        // Host names are fine (the control plane and clients resolve them); the form is
        // checked here, at start, rather than by a registration refused over and over.
        if let Some(a) = &c.advertise_addr {
            felix_control::catalog::check_addr(a)
                .map_err(|_| format!("advertise_addr must be HOST:PORT (a host name or an IP, port 1-65535), got {a:?}"))?;
        }
        if c.controlplane_url.is_some() && c.catalog.is_some() {
            return Err("catalog and controlplane_url are exclusive: the catalog comes from the control plane when it is set".into());
        }
        if c.controlplane_ca.is_some() && c.controlplane_url.is_none() {
            return Err("controlplane_ca needs controlplane_url".into());
        }
        if let Some(u) = &c.controlplane_url {
            if !(u.starts_with("http://") || u.starts_with("https://")) {
                return Err(format!(
                    "controlplane_url must be an http:// or https:// URL, got {u:?}"
                ));
            }
        }
        if !(felix_quic::UDP_PAYLOAD_MIN..=felix_quic::UDP_PAYLOAD_SLOT)
            .contains(&c.udp_payload_max_bytes)
        {
            return Err(format!(
                "udp_payload_max_bytes must be {}..={}, got {}",
                felix_quic::UDP_PAYLOAD_MIN,
                felix_quic::UDP_PAYLOAD_SLOT,
                c.udp_payload_max_bytes
            ));
        }
        if c.node_id == 0 {
            return Err("node_id must be at least 1".into());
        }
        c.check_peer()?;
        if c.controlplane_wait_ms == 0 || c.controlplane_wait_ms > 30_000 {
            return Err(
                "controlplane_wait_ms must be 1..=30000 (the control plane's maximum)".into(),
            );
        }
        if c.io_memory_bytes < 512 * 1024 {
            return Err(format!(
                "io_memory_bytes must be at least 512 KiB (glommio's minimum), got {}",
                c.io_memory_bytes
            ));
        }
        Ok(c)
    }
}

impl Config {
    fn cpu_list_cpus(&self) -> Result<Option<Vec<usize>>, String> {
        self.cpu_list
            .as_deref()
            .map(parse_cpu_list)
            .transpose()
            .map_err(|e| format!("cpu_list: {e}"))
    }

    /// The CPU of each executor, or `None` for unpinned ([`executor_cpus`] on this process's
    /// allowed set, read now).
    pub fn executor_cpus(&self) -> Result<Option<Vec<usize>>, String> {
        executor_cpus(
            self.cores,
            &allowed_cpus(),
            self.cpu_list_cpus()?.as_deref(),
        )
    }
}

/// The broker's settings table in docs/operations.md (flag, environment variable, YAML key,
/// default, meaning), rendered from the same declarations the parser uses so the document
/// cannot drift (checked by a test).
pub fn operations_table() -> String {
    use clap::CommandFactory;
    let defaults = serde_json::to_value(Config::merge(&Flags::default(), FileConfig::default()))
        .expect("config serializes");
    let mut out = String::from(
        "| flag | environment | YAML key | default | meaning |\n|---|---|---|---|---|\n",
    );
    for a in Flags::command().get_arguments() {
        let Some(long) = a.get_long() else { continue };
        if long == "help" || long == "version" {
            continue;
        }
        let key = long.replace('-', "_");
        let env = a
            .get_env()
            .map_or_else(|| "–".into(), felix_control::docs::env_cell);
        let value = defaults.get(&key);
        let default = match (key.as_str(), value) {
            ("cores", _) => "CPUs in `cpu_list`, else allowed CPUs".to_string(),
            (_, None) => "–".to_string(),
            (_, Some(serde_json::Value::Null)) => "unset".to_string(),
            (_, Some(serde_json::Value::String(s))) => format!("`{s}`"),
            (_, Some(v)) => format!("`{v}`"),
        };
        let yaml = if value.is_some() {
            format!("`{key}`")
        } else {
            "–".into()
        };
        let help = a
            .get_help()
            .map(|h| felix_control::docs::table_cell(&h.to_string()))
            .unwrap_or_default();
        out.push_str(&format!(
            "| `--{long}` | {env} | {yaml} | {default} | {help} |\n"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_doc_lists_every_setting() {
        let p = std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/operations.md"
        ));
        felix_control::docs::check_doc_block(p, "broker-settings", &operations_table()).unwrap();
    }

    #[test]
    fn cpu_lists_parse_and_each_executor_gets_an_allowed_cpu() {
        assert_eq!(parse_cpu_list("2-3").unwrap(), vec![2, 3]);
        assert_eq!(parse_cpu_list("0,2").unwrap(), vec![0, 2]);
        assert_eq!(parse_cpu_list(" 0-1, 4 ").unwrap(), vec![0, 1, 4]);
        assert_eq!(parse_cpu_list("3,1").unwrap(), vec![3, 1], "order kept");
        for bad in [
            "",
            "a",
            "1-",
            "-1",
            "3-2",
            "1,1",
            "0-2,2",
            "1024",
            "0-99999999999",
        ] {
            assert!(parse_cpu_list(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 6, 8, 9]), "0-3,6,8-9");
        assert_eq!(format_cpu_list(&[1]), "1");
        // Executor i on the i-th allowed CPU, not on CPU i.
        assert_eq!(executor_cpus(1, &[1], None).unwrap(), Some(vec![1]));
        assert_eq!(executor_cpus(2, &[2, 3], None).unwrap(), Some(vec![2, 3]));
        assert_eq!(executor_cpus(1, &[2, 3], None).unwrap(), Some(vec![2]));
        // More executors than allowed CPUs: unpinned (within the allowed set).
        assert_eq!(executor_cpus(3, &[2, 3], None).unwrap(), None);
        // An explicit list: its CPUs in order, each allowed, no more executors than listed.
        let all = [0, 1, 2, 3];
        assert_eq!(
            executor_cpus(2, &all, Some(&[3, 1])).unwrap(),
            Some(vec![3, 1])
        );
        assert_eq!(
            executor_cpus(1, &all, Some(&[2, 3])).unwrap(),
            Some(vec![2])
        );
        let e = executor_cpus(1, &[1], Some(&[0])).unwrap_err();
        assert!(
            e.contains("cpu_list: CPU 0") && e.contains("allowed: 1"),
            "{e}"
        );
        let e = executor_cpus(3, &all, Some(&[2, 3])).unwrap_err();
        assert!(
            e.contains("cores (3)") && e.contains("cpu_list (2-3"),
            "{e}"
        );
    }

    #[test]
    fn cores_default_to_the_allowed_cpus_or_the_cpu_list() {
        let allowed = allowed_cpus();
        let c = Config::resolve(&Flags::default()).unwrap();
        assert_eq!(c.cores, allowed.len().min(255));
        assert_eq!(
            c.executor_cpus().unwrap(),
            Some(allowed[..c.cores].to_vec())
        );
        // One allowed CPU listed: one core, pinned to it; from a flag or the YAML file.
        let last = *allowed.last().unwrap();
        let f = Flags {
            cpu_list: Some(last.to_string()),
            ..Default::default()
        };
        let c = Config::resolve(&f).unwrap();
        assert_eq!((c.cores, c.executor_cpus().unwrap()), (1, Some(vec![last])));
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.yaml");
        for yaml in [
            format!("cpu_list: \"{last}\"\n"),
            format!("cpu_list: {last}\n"),
        ] {
            std::fs::write(&p, &yaml).unwrap();
            let f = Flags {
                config: Some(p.clone()),
                ..Default::default()
            };
            let c = Config::resolve(&f).unwrap_or_else(|e| panic!("{yaml}: {e}"));
            assert_eq!(c.cores, 1, "{yaml}");
        }
        // A CPU outside the allowed set, a bad list, and more cores than listed are refused.
        let outside = (0..).find(|c| !allowed.contains(c)).unwrap();
        for (list, cores, want) in [
            (outside.to_string(), None, "cpu_list: CPU"),
            ("x".to_string(), None, "cpu_list: \"x\""),
            (last.to_string(), Some(2), "cores (2)"),
        ] {
            let f = Flags {
                cpu_list: Some(list),
                cores,
                ..Default::default()
            };
            let e = Config::resolve(&f).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        // glommio needs at least 512 KiB of io_memory per executor.
        let f = Flags {
            io_memory_bytes: Some(256 << 10),
            ..Default::default()
        };
        assert!(Config::resolve(&f)
            .unwrap_err()
            .contains("io_memory_bytes must be at least 512 KiB"));
    }

    #[test]
    fn replica_settings_out_of_range_are_refused_by_name() {
        for (f, want) in [
            (
                Flags {
                    replica_lease_ms: Some(50),
                    ..Default::default()
                },
                "replica_lease_ms must be 100..=600000, got 50",
            ),
            (
                Flags {
                    replica_quorum_wait_ms: Some(0),
                    ..Default::default()
                },
                "replica_quorum_wait_ms must be 1..=600000, got 0",
            ),
            (
                Flags {
                    replica_ship_records_max: Some(5000),
                    ..Default::default()
                },
                "replica_ship_records_max must be 1..=4096, got 5000",
            ),
        ] {
            let e = Config::resolve(&f).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        let c = Config::resolve(&Flags::default()).unwrap();
        let r = crate::core::ReplicaCfg::from_config(&c);
        assert_eq!(
            (r.lease_ms, r.renew_ms, r.quorum_wait_ms),
            (2_000, 500, 5_000)
        );
        assert!(r.validate().is_ok());
    }

    #[test]
    fn yaml_errors_name_key_line_and_column() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.yaml");
        std::fs::write(&p, "cores: 1\nidle_timeout_ms: soon\n").unwrap();
        let f = Flags {
            config: Some(p),
            ..Default::default()
        };
        let e = Config::resolve(&f).unwrap_err();
        assert!(e.contains("line 2"), "{e}");
        assert!(e.contains("column"), "{e}");
        let f = Flags {
            log_format: Some("xml".into()),
            ..Default::default()
        };
        assert!(Config::resolve(&f).unwrap_err().contains("log_format"));
    }

    #[test]
    fn advertise_addresses_take_host_names() {
        for (a, ok) in [
            ("broker-1.example:7400", true),
            ("localhost:7400", true),
            ("[::1]:7400", true),
            ("10.0.0.5:7400", true),
            ("localhost", false),
            ("localhost:0", false),
            (":7400", false),
        ] {
            let f = Flags {
                advertise_addr: Some(a.into()),
                ..Default::default()
            };
            let r = Config::resolve(&f);
            assert_eq!(r.is_ok(), ok, "{a}: {r:?}");
            if !ok {
                assert!(r.unwrap_err().contains("advertise_addr"));
            }
        }
    }

    #[test]
    fn precedence_file_then_flags() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.yaml");
        std::fs::write(&p, "cores: 3\nidle_timeout_ms: 5000\n").unwrap();
        let f = Flags {
            config: Some(p.clone()),
            cores: Some(1),
            ..Default::default()
        };
        let c = Config::resolve(&f).unwrap();
        assert_eq!(c.cores, 1, "flag beats file");
        assert_eq!(c.idle_timeout_ms, 5000, "file beats default");
        assert_eq!(c.publish_timeout_ms, 5000, "default when nobody sets it");
        std::fs::write(&p, "corez: 3\n").unwrap();
        assert!(
            Config::resolve(&f).unwrap_err().contains("corez"),
            "unknown key named"
        );
        std::fs::write(&p, "cores: many\n").unwrap();
        assert!(Config::resolve(&f).is_err(), "wrong type refused");
        let f = Flags {
            tls_cert: Some("x".into()),
            ..Default::default()
        };
        assert!(Config::resolve(&f).unwrap_err().contains("tls_key"));
        for bad in [1199, 16384] {
            let f = Flags {
                udp_payload_max_bytes: Some(bad),
                ..Default::default()
            };
            let e = Config::resolve(&f).unwrap_err();
            assert!(
                e.contains("udp_payload_max_bytes must be 1200..=16383"),
                "{e}"
            );
        }
        let f = Flags {
            sub_queue_records_max: Some(0),
            ..Default::default()
        };
        assert!(Config::resolve(&f)
            .unwrap_err()
            .contains("sub_queue_records_max"));
        // A record must fit every frame that carries it, with room for the frame's fields.
        let f = Flags {
            max_frame_bytes: Some(65_536),
            max_payload_bytes: Some(65_536),
            ..Default::default()
        };
        assert!(Config::resolve(&f)
            .unwrap_err()
            .contains("max_payload_bytes"));
        let f = Flags {
            group_poll_wait_max_ms: Some(u64::MAX),
            ..Default::default()
        };
        assert!(Config::resolve(&f)
            .unwrap_err()
            .contains("group_poll_wait_max_ms"));
    }
}

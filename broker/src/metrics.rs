//! Per-core counters (each core writes only its own, relaxed atomics, no locks) and the ops
//! HTTP listener serving them as Prometheus text plus /livez and /readyz.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

macro_rules! counters {
    ($($name:ident: $help:literal,)* ; gauges { $($gname:ident: $ghelp:literal,)* }) => {
        /// Counters of one core, and gauges it refreshes about once a second.
        #[derive(Default, Debug)]
        pub struct CoreCounters {
            $(pub $name: AtomicU64,)*
            $(pub $gname: AtomicU64,)*
            /// Durable publish latency, from handing it to the log to its commit.
            pub durable_commit: Histogram,
            /// fdatasync latency of the durable logs (streams and caches) this core owns.
            pub fsync: Histogram,
            /// `quorum` publishes on replicated shards led on this core: from written on the
            /// leader to acknowledged at the commit mark.
            pub quorum_wait: Histogram,
        }
        impl CoreCounters {
            /// Every family once, its samples for all cores together (the text format wants
            /// each family's lines in one group).
            fn render_all(cores: &[Arc<CoreCounters>], out: &mut String) {
                $(
                    out.push_str(&format!("# HELP felix_{} {}\n# TYPE felix_{} counter\n", stringify!($name), $help, stringify!($name)));
                    for (i, c) in cores.iter().enumerate() {
                        out.push_str(&format!("felix_{}{{core=\"{}\"}} {}\n", stringify!($name), i, c.$name.load(Ordering::Relaxed)));
                    }
                )*
                $(
                    out.push_str(&format!("# HELP felix_{} {}\n# TYPE felix_{} gauge\n", stringify!($gname), $ghelp, stringify!($gname)));
                    for (i, c) in cores.iter().enumerate() {
                        out.push_str(&format!("felix_{}{{core=\"{}\"}} {}\n", stringify!($gname), i, c.$gname.load(Ordering::Relaxed)));
                    }
                )*
                Histogram::render(
                    "felix_durable_commit_seconds",
                    "durable publishes from append to commit (acknowledged), seconds",
                    cores.iter().map(|c| &c.durable_commit),
                    out,
                );
                Histogram::render(
                    "felix_fsync_seconds",
                    "fdatasync of durable logs (commit under on_commit, periodic, segment seal), seconds",
                    cores.iter().map(|c| &c.fsync),
                    out,
                );
                Histogram::render(
                    "felix_replica_quorum_wait_seconds",
                    "quorum publishes on replicated shards: from written on the leader to acknowledged at the commit mark, seconds",
                    cores.iter().map(|c| &c.quorum_wait),
                    out,
                );
            }
        }
    };
}

counters! {
    connections_accepted: "QUIC connections accepted on this core",
    connections_closed: "QUIC connections closed on this core",
    packets_received: "UDP datagrams received on this core's socket",
    packets_forwarded_out: "datagrams handed to another core over the mesh (connection lives there)",
    packets_forwarded_in: "datagrams received from another core over the mesh",
    frames_received: "Felix frames decoded",
    bad_frames: "malformed frames answered with a typed error",
    errors_sent: "Error frames sent",
    frames_refused: "whole frames refused for their stream or for coming before Hello (docs/protocol.md, conformance table)",
    connections_closed_hello: "connections closed for a refused Hello, no Hello within hello_timeout_ms, or lost control-stream framing",
    publishes_received: "Publish frames accepted for routing on this core (connection side)",
    publishes_forwarded: "publishes sent to the owning core over the mesh",
    batches_appended: "batches appended by shards this core owns",
    records_appended: "records appended by shards this core owns",
    publishes_held: "publishes that waited for a Block subscriber",
    publish_timeouts: "held publishes answered publish_timeout (not appended)",
    publishes_refused: "publishes refused before routing (validation, in-flight caps)",
    mesh_deliveries_out: "delivery batches sent to another core (one per core, not per subscriber)",
    mesh_deliveries_in: "delivery batches received from another core",
    batches_delivered: "delivery batches written to subscription streams on this core",
    records_delivered: "records written to subscription streams on this core",
    records_dropped: "records lost by subscribers on this core (DropNew/DropOld), counted when dropped (the lag notice announcing them may come later)",
    records_dropped_new: "records lost by drop_new subscribers on this core (newest refused while full)",
    records_dropped_old: "records lost by drop_old subscribers on this core (oldest evicted while full)",
    bytes_appended: "record payload bytes appended by shards this core owns",
    bytes_delivered: "delivery frame bytes written to subscription streams on this core",
    publish_acks: "acked publishes answered with a PublishAck on this core (connection side)",
    lag_notices: "lag notices written to subscription streams",
    subscriptions_opened: "subscriptions opened on this core",
    subscriptions_closed: "subscriptions closed on this core",
    durable_commits: "commit progress events of durable shards this core owns (acked records answered)",
    durable_records_committed: "records of durable shards acknowledged after commit",
    durable_shards_failed: "durable shards on this core that failed (device error or refused at open); publishes to them get unavailable",
    durable_publishes_refused: "publishes to durable shards refused by storage (failed, write queue full)",
    history_reads: "history reads from disk for subscribers catching up",
    history_records_read: "records read from disk for subscribers catching up",
    group_polls: "consumer-group polls answered by shards this core owns (long polls once)",
    group_claims: "records claimed by consumer-group polls (every delivery, redeliveries included)",
    group_acks: "consumer-group claims acknowledged",
    group_redeliveries: "consumer-group claims that lapsed or were nacked and will be delivered again",
    group_dead_letters: "records dead-lettered by consumer groups",
    group_stale_answers: "consumer-group answers refused as stale_claim",
    group_writes: "consumer-group state files written (each covers every change queued before it)",
    group_write_failures: "consumer-group state files that could not be written (answers got unavailable)",
    cache_requests: "cache and counter requests routed to their shard's owner (connection side)",
    cache_refused: "cache requests refused before routing (validation, unknown cache, limits)",
    cache_writes: "cache puts and deletes applied by shards this core owns",
    cache_expired: "cache keys reclaimed after their expiry by shards this core owns",
    cache_watches_opened: "cache watches opened on this core",
    cache_watches_lagged: "cache watches ended watch_lagged (queue bound reached)",
    cache_watch_events: "cache watch events written to watch streams on this core",
    cache_shards_failed: "log-backed cache shards on this core that failed (device error or refused at open); their requests get unavailable",
    cache_compactions: "keys.idx snapshots of log-backed cache shards written (each followed by deleting the segments it covers)",
    cache_segments_compacted: "log segments of log-backed cache shards deleted by compaction",
    peer_dials: "peer links this core dialed to other brokers",
    peer_links_accepted: "peer links from other brokers accepted on this core (PeerHello taken)",
    peer_links_refused: "peer links refused: certificate naming another node, wrong cluster, own node id",
    forwards_sent: "requests this core forwarded to the broker that owns their shard",
    forwards_refused: "forwarded requests answered with a refusal (the owner's, or unavailable/outcome_unknown from the link)",
    forwards_served: "forwarded requests from other brokers served on this core",
    forwards_cancelled: "forwarded long polls cancelled at their owner (by the client, or because its connection closed)",
    replica_msgs_routed: "replica messages (Replicate) taken from peer links on this core and routed to their shard's core",
    replica_msgs_refused: "replica messages refused on this core: the link did not negotiate replication, or the message speaks for another node than the link's",
    replica_msgs_stale: "replica messages dropped on this core: they name a stream incarnation or shard this broker does not know (deleted, or a catalog behind)",
    replica_msgs_unhosted: "replica messages dropped by their shard's core: this broker hosts no replica of the shard",
    replica_msgs_sent: "replica messages this core put on a peer link's replication lane",
    replica_msgs_unsent: "replica messages this core dropped: the link was not ready (it is dialed), backing off, or the message too large",
    replica_inputs_dropped: "inputs to a hosted replica (messages, assignments, report answers) or reports to the control plane dropped because their queue was full",
    replica_elections: "times a replica hosted on this core finished its fence and led its shard",
    replica_failures: "replicas hosted on this core that failed (their driver's storage); hosted again at the next catalog change",
    replica_rebuilds: "times a follower hosted on this core dropped its log and went on at its leader's base: the leader's retention had removed records the follower still needed (replication rule 10)",
    replica_step_downs: "times a replica hosted on this core stopped leading or fencing: a newer generation fenced it, or placement refused its report",
    replica_refusals_sent: "replica messages of a superseded generation (or from a leader not in the ballot) that this core's replicas refused",
    replica_publishes_acked: "publishes on replicated shards led on this core answered with a PublishAck (at the commit mark for quorum, once written for leader)",
    replica_publishes_not_vouched: "publishes on replicated shards led on this core answered outcome_unknown: written, not known committed (quorum wait over, deposed, the replica failed or the broker shut down)",
    replica_publishes_refused: "publishes on replicated shards refused on their owner core with nothing appended (not leading, fencing, no lease, no replica open, an empty record, inputs full)",
    replica_publishes_held: "publishes on replicated shards held (nothing appended) because this broker, named leader, was fencing or waiting out the old lease; each answered later like any other, or refused at publish_timeout_ms",
    auth_accepted: "tokens accepted on this core (Authenticate)",
    auth_refused: "tokens refused on this core (unauthenticated, token_expired, revoked)",
    auth_denied: "frames refused by the auth check on this core (unauthenticated, forbidden, token_expired, revoked)",
    auth_revoked_ended: "connections on this core whose subscriptions, watches and publish streams were ended because their token was revoked",
    auth_publish_lanes_ended: "publish streams (acked and fire-and-forget) this core stopped reading because their principal's token was revoked or expired",
    ;
    gauges {
        connections_open: "QUIC connections open on this core",
        sub_queue_records: "records queued for subscribers on this core (not yet on their streams)",
        sub_queue_bytes: "payload bytes queued for subscribers on this core",
        sub_queue_max_records: "the fullest subscriber queue on this core, records",
        subscriptions_open: "subscriptions open on this core",
        cache_watch_queue_events: "events queued for cache watches on this core",
        cache_watch_queue_bytes: "bytes queued for cache watches on this core",
        cache_watches_open: "cache watches open on this core",
        durable_inline_write_stalls: "page-cache commit writes on this core that blocked longer than durable_inline_write_slow_us, a running count (each sends the core's commits through io_uring for a second)",
    }
}

/// Upper bounds of latency histograms, microseconds.
pub const LATENCY_BUCKETS_US: [u64; 14] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000,
    5_000_000,
];

/// A fixed-bucket latency histogram written by one core (relaxed atomics, no lock).
#[derive(Default, Debug)]
pub struct Histogram {
    /// Non-cumulative counts per bucket; the last one is +Inf.
    buckets: [AtomicU64; 15],
    sum_us: AtomicU64,
}

impl Histogram {
    pub fn observe_us(&self, us: u64) {
        let i = LATENCY_BUCKETS_US
            .iter()
            .position(|b| us <= *b)
            .unwrap_or(LATENCY_BUCKETS_US.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    fn render<'a>(
        name: &str,
        help: &str,
        per_core: impl Iterator<Item = &'a Histogram>,
        out: &mut String,
    ) {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
        for (core, h) in per_core.enumerate() {
            h.render_series(name, &format!("core=\"{core}\""), out);
        }
    }

    /// One labelled series of a histogram family (`labels` without braces).
    fn render_series(&self, name: &str, labels: &str, out: &mut String) {
        let mut cum = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            cum += b.load(Ordering::Relaxed);
            let le = LATENCY_BUCKETS_US
                .get(i)
                .map(|us| format!("{}", *us as f64 / 1e6))
                .unwrap_or_else(|| "+Inf".into());
            out.push_str(&format!("{name}_bucket{{le=\"{le}\",{labels}}} {cum}\n"));
        }
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        out.push_str(&format!("{name}_sum{{{labels}}} {sum}\n"));
        out.push_str(&format!("{name}_count{{{labels}}} {cum}\n"));
    }
}

/// Per durable shard commit latency, labelled `stream` and `shard`. A shard registers when its
/// log opens and goes when its stream is deleted (the lock is taken then and at scrape time,
/// never per record: cores update the shared histogram's atomics).
#[derive(Default, Debug)]
pub struct ShardMetrics {
    shards: std::sync::Mutex<std::collections::BTreeMap<(String, u32), Arc<Histogram>>>,
}

impl ShardMetrics {
    pub fn register(&self, stream: String, shard: u32) -> Arc<Histogram> {
        let mut m = self.shards.lock().unwrap_or_else(|p| p.into_inner());
        m.entry((stream, shard)).or_default().clone()
    }
    pub fn unregister(&self, stream: &str, shard: u32) {
        let mut m = self.shards.lock().unwrap_or_else(|p| p.into_inner());
        m.remove(&(stream.to_string(), shard));
    }
    fn render(&self, out: &mut String) {
        let name = "felix_shard_commit_seconds";
        out.push_str(&format!(
            "# HELP {name} durable publishes of one stream shard from append to commit, seconds\n# TYPE {name} histogram\n"
        ));
        let m = self.shards.lock().unwrap_or_else(|p| p.into_inner());
        for ((stream, shard), h) in m.iter() {
            // Names are [A-Za-z0-9._-] (validate_name): nothing to escape in a label value.
            h.render_series(name, &format!("stream=\"{stream}\",shard=\"{shard}\""), out);
        }
    }
}

impl CoreCounters {
    pub fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// Shared state of the ops listener.
pub struct Ops {
    pub cores: Vec<Arc<CoreCounters>>,
    pub shards: Arc<ShardMetrics>,
    pub ready: AtomicBool,
    /// The verifier (auth on), for its revocation gauges and the feed's readiness detail,
    /// and to check the token `/metrics` needs.
    pub auth: Option<Arc<crate::auth::AuthKeys>>,
    /// Serve `/metrics` without a token even with auth on (`metrics_public`).
    pub metrics_public: bool,
}

/// What `/metrics` needs, from the request head: nothing with auth off or `metrics_public`,
/// else a bearer token with `cluster.admin` on `metrics` (what the control plane's `/metrics`
/// needs, so one scraper credential serves both). Err: the status line and a body naming the
/// refusal's code. Why a token: the counters name streams, shards and tenants' traffic.
pub fn metrics_access(
    auth: Option<&crate::auth::AuthKeys>,
    public: bool,
    head: &str,
    now_s: u64,
) -> Result<(), (&'static str, String)> {
    use felix_control::auth::{Action, AuthError, ANY_TENANT};
    let Some(v) = auth.filter(|_| !public) else {
        return Ok(());
    };
    let unauth = |why: String| ("401 Unauthorized", why);
    let token = head
        .lines()
        .skip(1)
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("authorization"))
        .and_then(|(_, v)| v.trim().strip_prefix("Bearer ").map(str::trim))
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            unauth("unauthenticated: /metrics needs `Authorization: Bearer TOKEN` with cluster.admin on metrics (or start the broker with metrics_public)\n".into())
        })?;
    let p = v
        .verify(token, now_s)
        .map_err(|e: AuthError| unauth(format!("{e}\n")))?;
    p.check(Action::ClusterAdmin, ANY_TENANT, "metrics")
        .map_err(|why| ("403 Forbidden", format!("forbidden: {why}\n")))
}

impl Ops {
    pub fn render(&self) -> String {
        let mut s = String::new();
        CoreCounters::render_all(&self.cores, &mut s);
        self.shards.render(&mut s);
        if let Some(a) = &self.auth {
            a.render(&mut s);
        }
        crate::control_link::credential::render(&mut s);
        crate::replica_reports::render(&mut s);
        s
    }

    /// The body of a ready `/readyz`: what is degraded, if anything.
    fn ready_detail(&self) -> String {
        let now_ms = felix_storage::log::now_ms();
        let lost = [
            crate::control_link::SOURCE.lost(),
            self.auth
                .as_ref()
                .and_then(|a| a.revocation_feed_lost(now_ms)),
        ];
        let lost: Vec<String> = lost.into_iter().flatten().collect();
        if lost.is_empty() {
            "ready\n".to_string()
        } else {
            format!("ready; {}\n", lost.join("; "))
        }
    }
}

/// Serve /metrics, /livez, /readyz on `listener` from a plain thread (never a data core).
pub fn serve(listener: std::net::TcpListener, ops: Arc<Ops>) {
    std::thread::Builder::new()
        .name("felix-ops".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut s) = stream else { continue };
                let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(2)));
                // Read until the end of the request head (bounded), however it is split.
                let mut buf = Vec::with_capacity(1024);
                let mut chunk = [0u8; 1024];
                while buf.len() < 16 * 1024 && !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let req = String::from_utf8_lossy(&buf);
                let path = req.split_whitespace().nth(1).unwrap_or("/");
                let now_s = felix_storage::log::now_ms() / 1000;
                let (status, body) = match path {
                    "/metrics" => {
                        match metrics_access(ops.auth.as_deref(), ops.metrics_public, &req, now_s)
                        {
                            Ok(()) => ("200 OK", ops.render()),
                            Err(refused) => refused,
                        }
                    }
                    "/livez" => ("200 OK", "ok\n".to_string()),
                    // Still ready while the control plane is lost (the last catalog serves),
                    // but the body says so.
                    "/readyz" if ops.ready.load(Ordering::Acquire) => {
                        ("200 OK", ops.ready_detail())
                    }
                    "/readyz" => ("503 Service Unavailable", "not ready\n".to_string()),
                    _ => ("404 Not Found", "not found\n".to_string()),
                };
                let _ = write!(
                    s,
                    "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        })
        .expect("spawn ops thread");
}

//! felix-loadgen: bounded load against a running broker; a summary for people at the end of
//! every run, or with `--json` one JSON result line (what the campaign scripts parse).
//!
//! Modes (shapes match ../shared/tools/peer-bench so results compare side by side):
//! * `throughput`: one publisher connection, `--fanout F` subscriber connections on one
//!   shard. Acked publishes of `--batch` records of `--payload` bytes, up to `--inflight`
//!   batches awaiting their ack. Reports publish and per-subscriber rates, and what each
//!   subscriber lost and why (lag notices under the queue policy, records that never came,
//!   subscriptions the broker ended); refused publishes are counted by error code.
//! * `latency`: closed loop, one record in flight: publish, wait until all F subscribers
//!   have it, publish the next. One-way publish→delivery percentiles (same process clock).
//! * `rtt`: one acked publish at a time: publish → its ack percentiles.
//! * `connect`: a fresh connection per sample, one after another: connect (handshake, Hello,
//!   token) → the first acked publish, and the handshake alone, as percentiles.
//! * `ingest`: acked publishes of one record each, up to `--inflight K` awaiting their ack
//!   at once, no subscribers (peer-bench's `js-publish` shape). Reports acks/s, MB/s and
//!   ack latency percentiles (publish call → ack). Against a durable stream the ack follows
//!   the commit under the stream's fsync mode.
//! * `group`: queue consumption. Creates a fresh consumer group at the stream's tail, loads
//!   `--count` records (`--batch` per publish, round robin over the shards), then
//!   `--consumers` consumers, each on its own connection, poll every shard (up to `--batch`
//!   records per poll) and acknowledge each poll's claims in one answer, until every record
//!   is acknowledged. Reports processed records/s (first poll → last ack), poll+ack round
//!   percentiles, and checks every record was processed exactly once. Needs a durable stream.
//! * `fanout-scale`: `--subscribers S` subscriptions (up to 10,000) on one shard, spread
//!   over `--connections` connections (default: 1,000 per connection), and one publisher at
//!   a fixed `--rate` records/s (fire-and-forget, ticks of 1 ms) for `--secs` seconds.
//!   Reports delivered events/s, records lost (lag notices), whether every subscriber got
//!   every record, publish→deliver latency percentiles (sampled: the first record of each
//!   delivery) and, with `--broker-pid`, the broker's resident memory per subscriber
//!   (VmRSS after subscribing minus before, over S).
//! * `cache`: against cache `--cache`: `--count` puts of `--payload`-byte values, one in
//!   flight (put latency), the same number of gets (get latency), then watch fanout:
//!   `--subscribers W` watches on one key over `--connections` connections and one writer
//!   putting that key at `--rate` puts/s (acked, one in flight) for `--secs` seconds. Reports
//!   put/get latency percentiles, delivered watch events/s, watches ended lagged, whether
//!   every watcher got every change, and change→watcher latency percentiles (every event).
//! * `demo-slow-consumer`: for each policy, one fast and one stalled subscriber; prints what
//!   each received, the lag notices, and whether the publisher waited.
//!
//! A run ends at `--count` records or after `--duration` (throughput, latency, rtt, ingest),
//! and never later than `--max-secs` (at most 600; default 60, or the duration plus 30 s).
//! The summary text is `report::human` of the result line, unit-tested.

mod connect;
mod report;
mod stats;
mod watch;

use bytes::Bytes;
use clap::{Parser, ValueEnum};
use felix_client::{Client, ClientConfig, Event, SubscribeOptions, Subscription};
use felix_quic::tls::Verify;
use felix_quic::wire::{ErrorCode, QueuePolicy, ShardSelector, StartAt, StreamName};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, ValueEnum, Debug, PartialEq, Eq)]
enum Mode {
    /// Acked batches from one publisher to --fanout subscribers on one shard: publish and
    /// per-subscriber rates, and what was lost and why.
    Throughput,
    /// Publish → delivered-to-all-F, fire-and-forget publishes, one record in flight.
    Latency,
    /// Request round trip: one acked publish at a time, publish → its ack (no subscriber).
    Rtt,
    /// Connection cost: a fresh connection per sample, handshake (and token) → its first
    /// acked publish; connections one at a time.
    Connect,
    /// Acked publishes of one record each, --inflight awaiting their ack, no subscriber:
    /// acks/s and ack latency.
    Ingest,
    /// Consumer group on a durable stream: load --count records, then --consumers poll and
    /// ack them all; records/s, poll+ack latency, exactly-once check.
    Group,
    /// --subscribers subscriptions on one shard, one publisher at --rate for --secs:
    /// delivered/s, losses, sampled latency, broker memory per subscriber.
    FanoutScale,
    /// Cache put/get latency, then --subscribers watchers on one key at --rate puts/s.
    Cache,
    /// For each queue policy, a fast and a stalled subscriber: what each received.
    DemoSlowConsumer,
    /// Print the Markdown summary of a bench-vs-nats JSONL file (`--input`); no broker.
    Summarize,
}

const AFTER_HELP: &str = "\
How long a run lasts: until --count records (each mode has its own default, see --count), or
for --duration instead (throughput, latency, rtt, ingest). --max-secs bounds every run (at
most 600 s): publishing stops when it passes and the result says truncated (the summary says
CUT SHORT). fanout-scale and cache's watch phase publish for --secs.

Output: a summary for people on stdout (what was measured, throughput, percentiles, losses
and why); with --json only the JSON result line, for scripts. Progress (--progress) and errors
go to stderr. Exit status: 0 done, 1 the run failed (broker unreachable, refused setup), 2 bad
arguments or an unresolvable --broker.";

#[derive(Parser, Debug)]
#[command(
    name = "felix-loadgen",
    about = "Felix load generator: bounded load against a running broker, then a summary (or one JSON line with --json)",
    after_help = AFTER_HELP,
    version = concat!(env!("CARGO_PKG_VERSION"), " (git ", env!("FELIX_GIT_REV"), ")")
)]
struct Args {
    /// What to measure; each mode below says what it reports.
    #[arg(long, value_enum)]
    mode: Mode,
    /// The broker, HOST:PORT: a host name (localhost:7400), an IPv4 address or [IPv6]:PORT.
    /// Its certificate must name the host (an IP address is checked as `localhost`, which the
    /// dev certificate names).
    #[arg(long, env = "FELIX_BROKER", default_value = "127.0.0.1:7400")]
    broker: String,
    /// CA certificate (PEM file) the broker's certificate must be signed by; a relative path
    /// is taken from the current directory.
    #[arg(long, env = "FELIX_CA", default_value = "felix-data/tls/dev-cert.pem")]
    ca: PathBuf,
    /// Stream, in tenant `default`, namespace `default`.
    #[arg(long, default_value = "events")]
    stream: String,
    /// Shard to publish to and subscribe on (group publishes round robin over every shard).
    #[arg(long, default_value_t = 0)]
    shard: u32,
    /// Record size, bytes (at least 16 in latency and fanout-scale, which stamp each record).
    #[arg(long, default_value_t = 128)]
    payload: usize,
    /// Subscriber connections, each with one subscription (throughput, latency).
    #[arg(long, default_value_t = 1)]
    fanout: usize,
    /// Records per publish, one ack each (throughput, group; group also polls up to this
    /// many, at most 1,000).
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Publishes awaiting their ack at once: batches (throughput, group's load) or records
    /// (ingest).
    #[arg(long, default_value_t = 32)]
    inflight: usize,
    /// How many records the run publishes, then it ends. latency, rtt, ingest: measured
    /// samples, after an unmeasured warm-up of count/10 (at most 1,000; ingest count/20, at
    /// most 2,000). group: records loaded then consumed (at most 10,000,000: the exactly-once
    /// check keeps every record's id in memory). cache: puts, then as many gets.
    /// demo-slow-consumer: records per policy (at most 100,000). Default: throughput
    /// 500,000; latency, rtt, cache 10,000; ingest, group 100,000; demo 2,000. Not with
    /// --duration.
    #[arg(long, conflicts_with = "duration")]
    count: Option<u64>,
    /// Publish for this long instead of a count (throughput, latency, rtt, ingest), then
    /// drain and report: a number and a unit, ms, s, m or h (500ms, 30s, 2m; a bare number
    /// is seconds); at most 10m. In latency, rtt and ingest its first tenth (at most 1 s) is
    /// an unmeasured warm-up.
    #[arg(long, value_parser = report::parse_duration)]
    duration: Option<Duration>,
    /// Upper bound on the whole run, seconds (at most 600): publishing stops when it passes
    /// (the result says truncated) and subscribers stop waiting. Default 60, or --duration
    /// plus 30.
    #[arg(long)]
    max_secs: Option<u64>,
    /// Subscriber queue policy on the broker (throughput, latency, fanout-scale): `drop_new`,
    /// `drop_old` or `block` (the wire names, as felixctl spells them). `block` makes a
    /// throughput run lossless by holding the publisher; the drop policies report what was
    /// lost.
    #[arg(long, default_value = "drop_new", value_parser = parse_policy)]
    queue_policy: QueuePolicy,
    /// Bound of each subscriber's queue on the broker, records (throughput, latency,
    /// fanout-scale); 0 = the broker's default, which is also its maximum.
    #[arg(long, default_value_t = 0)]
    queue_records: u32,
    /// throughput: the last subscriber reads nothing for its first MS milliseconds (with a
    /// 4 KiB flow-control window and a 4-event client buffer, so its queue on the broker
    /// fills), to show what --queue-policy does to a subscriber that falls behind. 0 = off.
    #[arg(long, default_value_t = 0, value_name = "MS")]
    stall_ms: u64,
    /// Runtime worker threads; default: the CPUs this process may run on (so `taskset -c 1`
    /// gives one thread — two threads time-sharing one core wait on each other's wakeups).
    /// With one, the runtime is tokio's current-thread one: everything on the main thread.
    #[arg(long)]
    threads: Option<usize>,
    /// Competing consumers, each on its own connection (group), 1..=256.
    #[arg(long, default_value_t = 1)]
    consumers: usize,
    /// Subscriptions (fanout-scale) or watchers (cache), at most 10,000.
    #[arg(long, default_value_t = 1000)]
    subscribers: usize,
    /// Connections the subscriptions or watchers are spread over (fanout-scale, cache);
    /// default: fanout-scale 1,000 subscriptions per connection, cache 100 watchers per
    /// connection (rounded up).
    #[arg(long)]
    connections: Option<usize>,
    /// Publish rate, records/s (fanout-scale, at most 1,000,000) or puts/s (cache's watch
    /// phase, at most 100,000).
    #[arg(long, default_value_t = 100)]
    rate: u64,
    /// Publishing time, seconds (fanout-scale and cache's watch phase).
    #[arg(long, default_value_t = 5)]
    secs: u64,
    /// The broker's pid, to report its resident memory per subscriber or watcher
    /// (fanout-scale, cache); no default (not reported).
    #[arg(long)]
    broker_pid: Option<u32>,
    /// Latency mode: list every message whose delivered-to-all latency is at least this many
    /// µs, with the CLOCK_MONOTONIC time it was published (ns), in the result's `outliers`
    /// (at most 5,000), to line the tail up with a trace of the broker (`perf record -k
    /// mono`). No default (not listed).
    #[arg(long)]
    outliers_us: Option<u64>,
    /// Cache name (cache), in tenant `default`, namespace `default`.
    #[arg(long, default_value = "kv")]
    cache: String,
    /// A progress line on stderr every second: published and acked so far and per second,
    /// delivered per second over the subscribers, lost so far (throughput, latency, rtt,
    /// ingest, fanout-scale). Off by default.
    #[arg(long)]
    progress: bool,
    /// Print only the result as one JSON object on one line (for scripts), not the summary.
    /// Off by default.
    #[arg(long)]
    json: bool,
    /// The JSONL file to summarize (summarize); no default.
    #[arg(long)]
    input: Option<PathBuf>,
    /// Ceiling of this client's QUIC packet size, bytes (the broker has its own,
    /// FELIX_UDP_PAYLOAD_MAX_BYTES); the smaller of the two ends wins. 1350 reproduces the
    /// pre-PMTUD transport for before/after runs.
    #[arg(long, default_value_t = felix_quic::DEFAULT_UDP_PAYLOAD_MAX, value_parser = parse_udp_max)]
    udp_payload_max_bytes: usize,
    /// Ask for the watch mux (cache mode: every watch of a connection on one stream).
    /// `--watch-mux false` gives one stream per watch, for before/after runs.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    watch_mux: bool,
    /// Ask for the subscription mux (every drop_new subscription of a connection on one
    /// stream). `--sub-mux false` gives one stream per subscription, for before/after runs.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    sub_mux: bool,
    /// How cache mode reads its watchers: `set` (a WatchSet per connection, read by one task,
    /// the way peer-bench reads etcd's watch streams) or `task` (a task per watch).
    #[arg(long, value_enum, default_value_t = watch::WatchReader::Set)]
    watch_reader: watch::WatchReader,
    /// Brokers of a cluster, HOST:PORT,... (ingest, group): requests go through the
    /// ClusterClient, each to its shard's owner (ingest publishes round robin over every
    /// shard; group loads and consumes every shard at its owner); --broker and --shard are not
    /// used. Every broker's certificate must be signed by --ca. Env FELIX_BROKERS.
    #[arg(long, env = "FELIX_BROKERS")]
    brokers: Option<String>,
    /// Token presented to the brokers (a JWT; env FELIX_TOKEN), for a broker with auth on.
    /// An empty one is none: nothing is presented.
    #[arg(long, env = "FELIX_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The client settings, resolved once from --broker (not a flag).
    #[arg(skip)]
    client: Option<ClientConfig>,
    /// The run's bound in seconds: --max-secs, or its default (not a flag).
    #[arg(skip)]
    bound_secs: u64,
}

fn parse_udp_max(s: &str) -> Result<usize, String> {
    let (lo, hi) = (felix_quic::UDP_PAYLOAD_MIN, felix_quic::UDP_PAYLOAD_SLOT);
    match s.parse::<usize>() {
        Ok(n) if (lo..=hi).contains(&n) => Ok(n),
        _ => Err(format!("must be {lo}..={hi}, got {s:?}")),
    }
}

fn parse_policy(s: &str) -> Result<QueuePolicy, String> {
    QueuePolicy::parse(s).ok_or_else(|| format!("must be drop_new, drop_old or block, got {s:?}"))
}

/// group: the exactly-once check keeps each record's id; more is refused, not capped.
const GROUP_COUNT_MAX: u64 = 10_000_000;

/// The modes `--duration` applies to.
fn takes_duration(m: Mode) -> bool {
    matches!(
        m,
        Mode::Throughput | Mode::Latency | Mode::Rtt | Mode::Ingest | Mode::Connect
    )
}

fn cfg(a: &Args) -> ClientConfig {
    let mut c = a.client.clone().expect("resolved in run()");
    c.verify = Verify::CaFile(a.ca.clone());
    c.transport.udp_payload_max_bytes = a.udp_payload_max_bytes;
    c.watch_mux = a.watch_mux;
    c.sub_mux = a.sub_mux;
    c.token = token(a);
    c
}

/// The token to present: an empty `--token` (a campaign's auth-off side sets FELIX_TOKEN from
/// a file that is not there) is none, not an `Authenticate` with nothing in it.
fn token(a: &Args) -> Option<String> {
    a.token.clone().filter(|t| !t.trim().is_empty())
}

fn name(a: &Args) -> StreamName {
    StreamName::new("default", "default", &a.stream)
}

fn records_in(ev: &Event) -> u64 {
    match ev {
        Event::Records { records, .. } => records.count() as u64,
        _ => 0,
    }
}

/// How many records a counted run publishes and when publishing stops: `--count` (or the
/// mode's default) with the run's deadline, or no count and `--duration`'s end.
struct Plan {
    count: u64,
    begin: Instant,
    duration: Option<Duration>,
    until: Option<Instant>,
    deadline: Instant,
}

impl Plan {
    fn new(a: &Args, default_count: u64) -> Plan {
        let now = Instant::now();
        Plan {
            count: if a.duration.is_some() {
                u64::MAX
            } else {
                a.count.unwrap_or(default_count)
            },
            begin: now,
            duration: a.duration,
            until: a.duration.map(|d| now + d),
            deadline: now + Duration::from_secs(a.bound_secs),
        }
    }
    /// Publishing starts now (after connecting and subscribing): a --duration counts from
    /// here; the deadline stays where it was.
    fn start(&mut self) {
        self.begin = Instant::now();
        self.until = self.duration.map(|d| self.begin + d);
    }
    /// Whether publishing should stop now, `done` of `total` (the count, plus a warm-up)
    /// published: Some(true) when cut short by the deadline.
    fn stop(&self, done: u64, total: u64) -> Option<bool> {
        let now = Instant::now();
        if now > self.deadline {
            Some(true)
        } else if done >= total || self.until.is_some_and(|u| now >= u) {
            Some(false)
        } else {
            None
        }
    }
    /// The unmeasured warm-up of a counted run before its `count` samples: count/div, at
    /// most `max` (none with --duration, which warms up by time: see `warming`).
    fn warmup(&self, div: u64, max: u64) -> u64 {
        if self.until.is_some() {
            0
        } else {
            (self.count / div).min(max)
        }
    }
    /// Whether the `i`th record (0-based) is still warm-up, not measured: the first `warmup`
    /// of a counted run, or those sent in the first tenth of a --duration (at most 1 s).
    fn warming(&self, i: u64, warmup: u64) -> bool {
        match (self.until, self.duration) {
            (Some(_), Some(d)) => self.begin.elapsed() < (d / 10).min(Duration::from_secs(1)),
            _ => i < warmup,
        }
    }
    /// The fields saying how the run was bounded.
    fn fields(&self, a: &Args, o: &mut serde_json::Map<String, serde_json::Value>) {
        match a.duration {
            Some(d) => o.insert("duration_target_s".into(), d.as_secs_f64().into()),
            None => o.insert("count_target".into(), self.count.into()),
        };
        o.insert("max_secs".into(), a.bound_secs.into());
    }
}

/// Publishes the broker refused, by error code (batches), and the records in them.
#[derive(Default)]
struct Refused {
    by_code: BTreeMap<&'static str, u64>,
    records: u64,
}

impl Refused {
    /// Count a refusal (`Ok`), or hand back any other error (the run fails on it).
    fn take(&mut self, e: felix_client::Error, records: u64) -> Result<(), felix_client::Error> {
        match e.code() {
            Some(code) => {
                *self.by_code.entry(code.name()).or_default() += 1;
                self.records += records;
                Ok(())
            }
            None => Err(e),
        }
    }
    fn fields(&self, o: &mut serde_json::Map<String, serde_json::Value>) {
        o.insert("publish_refused".into(), self.records.into());
        o.insert("refused".into(), serde_json::json!(self.by_code));
    }
}

/// What one subscriber of a run received and lost.
#[derive(Default, Clone)]
struct SubStat {
    got: u64,
    lost: u64,
    lag_notices: u64,
    out_of_order: u64,
    end: Option<(u16, String)>,
    secs: f64,
}

/// The loss fields of a run with subscribers, `published` records each should have had:
/// totals, the subscribers that lost, the worst one, and subscriptions the broker ended.
fn loss_fields(
    subs: &[SubStat],
    published: u64,
    o: &mut serde_json::Map<String, serde_json::Value>,
) {
    let missing = |s: &SubStat| published.saturating_sub(s.got + s.lost);
    let lost_of = |s: &SubStat| published.saturating_sub(s.got);
    let (mut lag, mut notices, mut miss, mut lossy) = (0u64, 0u64, 0u64, 0u64);
    for s in subs {
        lag += s.lost;
        notices += s.lag_notices;
        miss += missing(s);
        lossy += u64::from(lost_of(s) > 0);
    }
    o.insert("lost".into(), subs.iter().map(lost_of).sum::<u64>().into());
    o.insert("lost_lag".into(), lag.into());
    o.insert("missing".into(), miss.into());
    o.insert("lag_notices".into(), notices.into());
    o.insert("subs_lossy".into(), lossy.into());
    if let Some((i, w)) = subs
        .iter()
        .enumerate()
        .filter(|(_, s)| lost_of(s) > 0)
        .max_by_key(|(_, s)| lost_of(s))
    {
        o.insert(
            "worst_sub".into(),
            serde_json::json!({"index": i, "received": w.got, "lost": w.lost,
                "lag_notices": w.lag_notices, "missing": missing(w)}),
        );
    }
    let ended: Vec<_> = subs
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            s.end.as_ref().map(|(c, m)| {
                let code =
                    ErrorCode::from_number(*c).map_or_else(|| c.to_string(), |c| c.name().into());
                serde_json::json!({"index": i, "code": code, "message": m})
            })
        })
        .take(100)
        .collect();
    o.insert("ended".into(), ended.into());
}

/// Print the result: with `--json` one line (the mode's fields plus what makes it comparable
/// later — the machine (cores, CPU, kernel), the git revision (`FELIX_GIT_REV`, else the one
/// the binary was built from), the UTC date and the load average at the end); else the
/// summary for people of that same object.
fn emit(a: &Args, mut v: serde_json::Value) {
    if let Some(o) = v.as_object_mut() {
        o.insert("broker".into(), a.broker.clone().into());
        o.insert(
            "udp_payload_max_bytes".into(),
            a.udp_payload_max_bytes.into(),
        );
        o.insert("watch_mux".into(), a.watch_mux.into());
        o.insert("sub_mux".into(), a.sub_mux.into());
        o.insert("machine".into(), machine_facts());
        o.insert("git_rev".into(), git_rev().into());
        o.insert(
            "date".into(),
            stats::utc_rfc3339(std::time::SystemTime::now()).into(),
        );
        o.insert("load1_end".into(), load1().into());
    }
    if a.json {
        println!("{v}");
    } else {
        print!("{}", report::human(&v));
    }
}

fn machine_facts() -> serde_json::Value {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default();
    serde_json::json!({
        // The machine's online cores, and the ones this process may use (taskset).
        // SAFETY: sysconf has no preconditions.
        "cores_online": unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(0),
        "cores_allowed": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "cpu": cpu,
        "kernel": read("/proc/sys/kernel/osrelease").trim(),
    })
}

/// The revision this binary was built from (`FELIX_GIT_REV` in the environment overrides it,
/// for a campaign that runs a binary built elsewhere).
fn git_rev() -> String {
    std::env::var("FELIX_GIT_REV").unwrap_or_else(|_| env!("FELIX_GIT_REV").into())
}

/// Counters a `--progress` line reads (the run's tasks feed them).
#[derive(Default)]
struct Counters {
    published: AtomicU64,
    acked: AtomicU64,
    delivered: AtomicU64,
    lost: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> report::Snapshot {
        report::Snapshot {
            published: self.published.load(Ordering::Relaxed),
            acked: self.acked.load(Ordering::Relaxed),
            delivered: self.delivered.load(Ordering::Relaxed),
            lost: self.lost.load(Ordering::Relaxed),
        }
    }
}

/// A `--progress` ticker that stops when dropped (so every return path ends it), and the
/// counters it shows (None without `--progress`, so a campaign run pays nothing for them).
struct Ticker(Option<tokio::task::JoinHandle<()>>, Option<Arc<Counters>>);
impl Drop for Ticker {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            t.abort();
        }
    }
}

impl Ticker {
    fn counters(&self) -> Option<Arc<Counters>> {
        self.1.clone()
    }
    fn add(&self, f: impl Fn(&Counters) -> &AtomicU64, n: u64) {
        if let Some(c) = &self.1 {
            f(c).fetch_add(n, Ordering::Relaxed);
        }
    }
    fn set(&self, f: impl Fn(&Counters) -> &AtomicU64, n: u64) {
        if let Some(c) = &self.1 {
            f(c).store(n, Ordering::Relaxed);
        }
    }
}

/// With `--progress`, a line on stderr every second (`report::progress_line`): the counters
/// `show` names, their totals and their rates over the last second.
fn ticker(on: bool, show: report::Shown) -> Ticker {
    if !on {
        return Ticker(None, None);
    }
    let c = Arc::new(Counters::default());
    let counters = c.clone();
    let task = tokio::spawn(async move {
        let start = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.tick().await;
        let (mut prev, mut at) = (c.snapshot(), Instant::now());
        loop {
            tick.tick().await;
            let now = c.snapshot();
            let dt = at.elapsed().as_secs_f64();
            at = Instant::now();
            eprintln!(
                "{}",
                report::progress_line(start.elapsed().as_secs_f64(), &now, &prev, dt, &show)
            );
            prev = now;
        }
    });
    Ticker(Some(task), Some(counters))
}

fn load1() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|x| x.parse().ok()))
        .unwrap_or(-1.0)
}

fn main() {
    let a = Args::parse();
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, 64);
    // One thread: a current-thread runtime, so the mode's own loop and the connection tasks
    // share that thread (under a multi-thread runtime the loop would run on the main thread
    // beside one worker, and every hand-off between them is a futex wake-up and a context
    // switch on the same core).
    let rt = if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()
    }
    .expect("tokio runtime");
    rt.block_on(run(a));
}

fn usage(msg: &str) -> ! {
    eprintln!("felix-loadgen: {msg}");
    std::process::exit(2);
}

async fn run(mut a: Args) {
    // RUST_LOG filters (default warn) to stderr: stdout carries only the result.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    // Latency-measuring modes carry a sequence and a send timestamp in each payload.
    let stamped = matches!(a.mode, Mode::Latency | Mode::FanoutScale);
    if (stamped && a.payload < 16) || a.fanout == 0 || a.batch == 0 || a.inflight == 0 {
        usage("need payload >= 16 (latency, fanout-scale), fanout/batch/inflight >= 1");
    }
    if a.max_secs.is_some_and(|s| s == 0 || s > 600) {
        usage("--max-secs must be 1..=600");
    }
    if a.outliers_us.is_some() && !matches!(a.mode, Mode::Latency) {
        usage("--outliers-us applies to --mode latency");
    }
    if let Some(d) = a.duration {
        if !takes_duration(a.mode) {
            usage("--duration applies to throughput, latency, rtt and ingest (fanout-scale and cache publish for --secs; the others take --count)");
        }
        if a.max_secs.is_some_and(|s| d.as_secs_f64() >= s as f64) {
            usage("--duration must be shorter than --max-secs (which bounds the whole run, draining included); leave --max-secs out for the duration plus 30 s");
        }
    }
    a.bound_secs = a.max_secs.unwrap_or_else(|| {
        a.duration
            .map_or(60, |d| d.as_secs_f64().ceil() as u64 + 30)
    });
    if a.mode == Mode::Group && a.count.is_some_and(|c| c > GROUP_COUNT_MAX) {
        usage("--count in group mode is at most 10,000,000 (the exactly-once check keeps every record's id in memory)");
    }
    if a.mode == Mode::DemoSlowConsumer && a.count.is_some_and(|c| c > 100_000) {
        usage("--count in demo-slow-consumer mode is at most 100,000 per policy");
    }
    if a.stall_ms > 0 && a.mode != Mode::Throughput {
        usage("--stall-ms applies to throughput");
    }
    if a.brokers.is_some() && !matches!(a.mode, Mode::Ingest | Mode::Group) {
        usage("--brokers applies to ingest and group (the other modes measure one broker: use --broker)");
    }
    if a.mode != Mode::Summarize {
        match ClientConfig::for_broker(&a.broker, Some(a.ca.clone())) {
            Ok(c) => a.client = Some(c),
            Err(e) => usage(&format!("--broker: {e}")),
        }
    }
    let r = match a.mode {
        Mode::Throughput => throughput(&a).await,
        Mode::Latency => latency(&a).await,
        Mode::Ingest => ingest(&a).await,
        Mode::Rtt => rtt(&a).await,
        Mode::Connect => connect::connect(&a).await,
        Mode::Group => group(&a).await,
        Mode::FanoutScale => fanout_scale(&a).await,
        Mode::Cache => watch::run(&a).await,
        Mode::Summarize => {
            let Some(p) = &a.input else {
                usage("--mode summarize needs --input FILE.jsonl");
            };
            match std::fs::read_to_string(p) {
                Ok(text) => {
                    print!("{}", stats::summarize(&text));
                    Ok(())
                }
                Err(e) => {
                    eprintln!("felix-loadgen: {}: {e}", p.display());
                    std::process::exit(1);
                }
            }
        }
        Mode::DemoSlowConsumer => demo(&a).await,
    };
    if let Err(e) = r {
        eprintln!("felix-loadgen: {e}");
        std::process::exit(1);
    }
}

/// `--fanout` subscriber connections; with `--stall-ms` the last one gets a 4 KiB stream
/// window and a 4-event buffer, so a stall fills its queue on the broker quickly.
async fn subscribers(
    a: &Args,
    opts: SubscribeOptions,
) -> Result<(Vec<Client>, Vec<Subscription>), felix_client::Error> {
    let mut cs = Vec::new();
    let mut ss = Vec::new();
    for i in 0..a.fanout {
        let (mut c, mut o) = (cfg(a), opts.clone());
        if a.stall_ms > 0 && i + 1 == a.fanout {
            c.transport.max_stream_data_uni_bytes = 4096;
            o.buffer_events = 4;
        }
        let c = Client::connect(c).await?;
        ss.push(c.subscribe(&name(a), a.shard, o).await?);
        cs.push(c);
    }
    Ok((cs, ss))
}
async fn throughput(a: &Args) -> Result<(), felix_client::Error> {
    let mut plan = Plan::new(a, 500_000);
    let deadline = plan.deadline;
    let load = load1();
    let (_cs, subs) = subscribers(
        a,
        SubscribeOptions {
            policy: a.queue_policy,
            queue_records_max: a.queue_records,
            ..Default::default()
        },
    )
    .await?;
    let publisher = Client::connect(cfg(a)).await?;
    let payload = Bytes::from(vec![b'x'; a.payload]);
    let tick = ticker(
        a.progress,
        report::Shown {
            published: true,
            acked: true,
            subscribers: a.fanout,
        },
    );
    // How many records each subscriber should get: the count until publishing ends, then
    // what was acked (fewer when publishes were refused, or a duration's worth).
    let (target_tx, target_rx) = tokio::sync::watch::channel(plan.count);
    plan.start();
    let start = Instant::now();
    let stall = Duration::from_millis(a.stall_ms);
    let n_subs = subs.len();
    let readers: Vec<_> = subs
        .into_iter()
        .enumerate()
        .map(|(i, mut s)| {
            let mut target = target_rx.clone();
            let progress = tick.counters();
            let stalled = !stall.is_zero() && i + 1 == n_subs;
            tokio::spawn(async move {
                if stalled {
                    tokio::time::sleep(stall).await;
                }
                let mut st = SubStat::default();
                // Order check: each event must start where the last one (records or a lag
                // notice) ended; the first one sets the start.
                let mut next = None::<u64>;
                loop {
                    let want = *target.borrow_and_update();
                    if st.got + st.lost >= want {
                        break;
                    }
                    let left = deadline.saturating_duration_since(Instant::now());
                    let ev = tokio::select! {
                        ev = s.next_timeout(left) => ev,
                        changed = target.changed() => match changed {
                            Ok(()) => continue,
                            Err(_) => break,
                        },
                    };
                    match ev {
                        Ok(Some(ev)) => {
                            let n = records_in(&ev);
                            st.got += n;
                            let (from, len) = match ev {
                                Event::Records { first_offset, .. } => (first_offset, n),
                                Event::Lag {
                                    from_offset,
                                    lost: l,
                                    ..
                                } => {
                                    st.lost += l;
                                    st.lag_notices += 1;
                                    if let Some(p) = &progress {
                                        p.lost.fetch_add(l, Ordering::Relaxed);
                                    }
                                    (from_offset, l)
                                }
                                Event::End { code, message, .. } => {
                                    st.end = Some((code, message));
                                    break;
                                }
                                Event::Watch(_) => continue,
                            };
                            if let Some(p) = &progress {
                                p.delivered.fetch_add(n, Ordering::Relaxed);
                            }
                            if next.is_some_and(|x| x != from) {
                                st.out_of_order += 1;
                            }
                            next = Some(from + len);
                        }
                        _ => break,
                    }
                }
                st.secs = start.elapsed().as_secs_f64();
                st
            })
        })
        .collect();
    let mut inflight = tokio::task::JoinSet::new();
    let (mut sent, mut acked) = (0u64, 0u64);
    let mut refused = Refused::default();
    let p = publisher.publisher();
    let mut answer = |r: Result<Result<u64, (u64, felix_client::Error)>, _>,
                      acked: &mut u64|
     -> Result<(), felix_client::Error> {
        match r.expect("publish task") {
            Ok(k) => {
                *acked += k;
                tick.set(|c| &c.acked, *acked);
                Ok(())
            }
            Err((k, e)) => refused.take(e, k),
        }
    };
    let truncated = loop {
        if let Some(cut) = plan.stop(sent, plan.count) {
            break cut;
        }
        tick.set(|c| &c.published, sent);
        while inflight.len() >= a.inflight {
            answer(inflight.join_next().await.unwrap(), &mut acked)?;
        }
        let k = (a.batch as u64).min(plan.count - sent);
        let batch: Vec<Bytes> = (0..k).map(|_| payload.clone()).collect();
        let sel = ShardSelector::Shard(a.shard);
        let (p, n) = (p.clone(), name(a));
        inflight.spawn(async move {
            p.publish_batch(&n, sel, batch)
                .await
                .map(|_| k)
                .map_err(|e| (k, e))
        });
        sent += k;
    };
    while let Some(r) = inflight.join_next().await {
        answer(r, &mut acked)?;
    }
    let pub_secs = start.elapsed().as_secs_f64();
    let _ = target_tx.send(acked);
    let mut stats = Vec::new();
    for r in readers {
        stats.push(r.await.unwrap());
    }
    drop(tick);
    let per_sub: Vec<f64> = stats.iter().map(|s| s.got as f64 / s.secs).collect();
    let out_of_order: u64 = stats.iter().map(|s| s.out_of_order).sum();
    let avg = per_sub.iter().sum::<f64>() / per_sub.len() as f64;
    let min = per_sub.iter().cloned().fold(f64::MAX, f64::min);
    let mb = |msgs: f64| msgs * a.payload as f64 / 1e6;
    let mut v = serde_json::json!({
        "tool": "felix-loadgen", "mode": "throughput", "stream": a.stream, "shard": a.shard,
        "payload": a.payload, "fanout": a.fanout,
        "batch": a.batch, "inflight": a.inflight, "count": acked, "load1": load, "truncated": truncated,
        "out_of_order": out_of_order, "duration_s": pub_secs,
        "publish_msgs_per_s": acked as f64 / pub_secs, "publish_mb_per_s": mb(acked as f64 / pub_secs),
        "per_sub_msgs_per_s_avg": avg, "per_sub_mb_per_s_avg": mb(avg), "per_sub_msgs_per_s_min": min,
        "total_msgs_per_s": avg * a.fanout as f64,
        "queue_policy": a.queue_policy.name(), "queue_records": a.queue_records,
        "stall_ms": a.stall_ms,
    });
    let o = v.as_object_mut().unwrap();
    plan.fields(a, o);
    refused.fields(o);
    loss_fields(&stats, acked, o);
    emit(a, v);
    let _ = publisher.close().await;
    Ok(())
}

async fn latency(a: &Args) -> Result<(), felix_client::Error> {
    let mut plan = Plan::new(a, 10_000);
    let warmup = plan.warmup(10, 1000);
    let total = plan.count.saturating_add(warmup);
    let deadline = plan.deadline;
    let load = load1();
    let (_cs, mut subs) = subscribers(
        a,
        SubscribeOptions {
            policy: a.queue_policy,
            queue_records_max: a.queue_records,
            ..Default::default()
        },
    )
    .await?;
    let publisher = Client::connect(cfg(a)).await?;
    let mut each = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
    let mut all = each.clone();
    let payload = Bytes::from(vec![b'x'; a.payload]);
    let tick = ticker(
        a.progress,
        report::Shown {
            published: true,
            acked: false,
            subscribers: a.fanout,
        },
    );
    plan.start();
    let start = Instant::now();
    let mut i = 0u64;
    let mut outliers: Vec<(u64, u64)> = Vec::new();
    let truncated = loop {
        if let Some(cut) = plan.stop(i, total) {
            break cut;
        }
        tick.set(|c| &c.published, i + 1);
        let measured = !plan.warming(i, warmup);
        let t0 = Instant::now();
        let mono0 = a.outliers_us.map(|_| monotonic_ns());
        // Fire-and-forget: the publish→delivery path, no ack round trip in the loop.
        publisher.publish_fire(
            &name(a),
            ShardSelector::Shard(a.shard),
            vec![payload.clone()],
        )?;
        let mut last = Duration::ZERO;
        for s in &mut subs {
            loop {
                let left = deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1));
                match s.next_timeout(left).await? {
                    Some(ev) if records_in(&ev) > 0 => break,
                    Some(Event::End { code, message, .. }) => {
                        let code = ErrorCode::from_number(code)
                            .map_or_else(|| code.to_string(), |c| c.name().into());
                        return Err(felix_client::Error::Closed(format!(
                            "the broker ended a subscription: {code}: {message}"
                        )));
                    }
                    Some(_) => continue,
                    None => return Err(felix_client::Error::Closed("subscription ended".into())),
                }
            }
            tick.add(|c| &c.delivered, 1);
            let d = t0.elapsed();
            last = last.max(d);
            if measured {
                each.record(d.as_micros().max(1) as u64).unwrap();
            }
        }
        if measured {
            let us = last.as_micros().max(1) as u64;
            all.record(us).unwrap();
            if let (Some(min), Some(at)) = (a.outliers_us, mono0) {
                if us >= min && outliers.len() < 5000 {
                    outliers.push((at, us));
                }
            }
        }
        i += 1;
    };
    let secs = start.elapsed().as_secs_f64();
    drop(tick);
    let (refused, last) = publisher.fire_and_forget_errors();
    let mut v = serde_json::json!({
        "tool": "felix-loadgen", "mode": "latency", "stream": a.stream, "shard": a.shard,
        "payload": a.payload, "fanout": a.fanout, "queue_policy": a.queue_policy.name(),
        "count": all.len(), "load1": load, "truncated": truncated, "unit": "us",
        "duration_s": secs, "each": stats::pct(&each), "all_f": stats::pct(&all),
        "publish_refused": refused, "refused_last": last.map(|e| e.to_string()),
    });
    if a.outliers_us.is_some() {
        v["outliers"] = serde_json::json!(outliers);
    }
    plan.fields(a, v.as_object_mut().unwrap());
    emit(a, v);
    let _ = publisher.close().await;
    Ok(())
}

/// One acked publish at a time on `--stream` (ephemeral or durable): the request round trip,
/// kept apart from `latency` (publish → delivery, fire-and-forget) by its mode name.
async fn rtt(a: &Args) -> Result<(), felix_client::Error> {
    let mut plan = Plan::new(a, 10_000);
    let warmup = plan.warmup(10, 1000);
    let total = plan.count.saturating_add(warmup);
    let load = load1();
    let c = Client::connect(cfg(a)).await?;
    let info = c.describe_stream(&name(a)).await?;
    let p = c.publisher();
    let (stream, payload) = (name(a), Bytes::from(vec![b'x'; a.payload]));
    let mut hist = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
    let tick = ticker(
        a.progress,
        report::Shown {
            published: false,
            acked: true,
            subscribers: 0,
        },
    );
    let mut refused = Refused::default();
    plan.start();
    let begin = Instant::now();
    let mut start = None;
    let mut i = 0u64;
    let truncated = loop {
        if let Some(cut) = plan.stop(i, total) {
            break cut;
        }
        let measured = !plan.warming(i, warmup);
        if measured && start.is_none() {
            start = Some(Instant::now());
        }
        let t0 = Instant::now();
        match p
            .publish_batch(
                &stream,
                ShardSelector::Shard(a.shard),
                vec![payload.clone()],
            )
            .await
        {
            Ok(_) if measured => hist.record(t0.elapsed().as_micros().max(1) as u64).unwrap(),
            Ok(_) => {}
            Err(e) => refused.take(e, 1)?,
        }
        i += 1;
        tick.set(|c| &c.acked, i);
    };
    let secs = start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    drop(tick);
    let mut v = serde_json::json!({
        "tool": "felix-loadgen", "mode": "rtt", "stream": a.stream, "shard": a.shard,
        "durable": info.durable, "payload": a.payload, "count": hist.len(), "load1": load,
        "truncated": truncated, "duration_s": begin.elapsed().as_secs_f64(),
        "requests_per_s": if secs > 0.0 { hist.len() as f64 / secs } else { 0.0 },
        "unit": "us", "rtt": stats::pct(&hist),
    });
    let o = v.as_object_mut().unwrap();
    plan.fields(a, o);
    refused.fields(o);
    emit(a, v);
    let _ = c.close().await;
    Ok(())
}

async fn ingest(a: &Args) -> Result<(), felix_client::Error> {
    let mut plan = Plan::new(a, 100_000);
    let warmup = plan.warmup(20, 2000);
    let total = plan.count.saturating_add(warmup);
    let load = load1();
    // With --brokers: the ClusterClient, every shard to its owner.
    let cluster = cluster_client(a).await?;
    let c = match &cluster {
        Some(cc) => cc.client().await?,
        None => std::sync::Arc::new(Client::connect(cfg(a)).await?),
    };
    let info = c.describe_stream(&name(a)).await?;
    let p = c.publisher();
    let payload = Bytes::from(vec![b'x'; a.payload]);
    let mut hist = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
    let mut inflight = tokio::task::JoinSet::new();
    plan.start();
    let begin = Instant::now();
    let mut start = None;
    let (mut acked, mut answered, mut sent) = (0u64, 0u64, 0u64);
    let tick = ticker(
        a.progress,
        report::Shown {
            published: true,
            acked: true,
            subscribers: 0,
        },
    );
    let mut refused = Refused::default();
    let mut answer = |r: Result<(bool, Result<Duration, felix_client::Error>), _>|
     -> Result<(), felix_client::Error> {
        let (measured, res) = r.expect("publish task");
        answered += 1;
        tick.set(|c| &c.acked, answered);
        match res {
            Ok(d) if measured => {
                hist.record(d.as_micros().max(1) as u64).unwrap();
                acked += 1;
                Ok(())
            }
            Ok(_) => Ok(()),
            Err(e) => refused.take(e, 1),
        }
    };
    let truncated = loop {
        if let Some(cut) = plan.stop(sent, total) {
            break cut;
        }
        tick.set(|c| &c.published, sent);
        while inflight.len() >= a.inflight {
            answer(inflight.join_next().await.unwrap())?;
        }
        let measured = !plan.warming(sent, warmup);
        if measured && start.is_none() {
            start = Some(Instant::now());
        }
        let (p, n, pl) = (p.clone(), name(a), payload.clone());
        let sel = ShardSelector::Shard(a.shard);
        let cc = cluster.clone();
        inflight.spawn(async move {
            let t0 = Instant::now();
            let r = match cc {
                Some(cc) => {
                    cc.publish_batch(&n, ShardSelector::RoundRobin, vec![pl])
                        .await
                }
                None => p.publish_batch(&n, sel, vec![pl]).await,
            };
            (measured, r.map(|_| t0.elapsed()))
        });
        sent += 1;
    };
    while let Some(r) = inflight.join_next().await {
        answer(r)?;
    }
    drop(tick);
    let secs = start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    let rate = if secs > 0.0 { acked as f64 / secs } else { 0.0 };
    let mut v = serde_json::json!({
        "tool": "felix-loadgen", "mode": "ingest", "stream": a.stream, "shard": a.shard,
        "durable": info.durable, "payload": a.payload, "inflight": a.inflight, "count": acked,
        "load1": load, "truncated": truncated, "duration_s": begin.elapsed().as_secs_f64(),
        "acks_per_s": rate, "mb_per_s": rate * a.payload as f64 / 1e6,
        "unit": "us", "ack": stats::pct(&hist),
        "brokers": cluster.as_ref().map(|cc| cc.brokers().len()),
    });
    let o = v.as_object_mut().unwrap();
    plan.fields(a, o);
    refused.fields(o);
    emit(a, v);
    drop(cluster);
    if let Ok(c) = std::sync::Arc::try_unwrap(c) {
        let _ = c.close().await;
    }
    Ok(())
}

/// The settings of a ClusterClient over `--brokers`, if given.
fn cluster_config(a: &Args) -> Result<Option<felix_client::ClusterConfig>, felix_client::Error> {
    let Some(list) = &a.brokers else {
        return Ok(None);
    };
    let mut cc = felix_client::ClusterConfig::new(list, Some(a.ca.clone()))?;
    cc.connect_timeout = cfg(a).connect_timeout;
    cc.token = token(a);
    Ok(Some(cc))
}

/// A ClusterClient over `--brokers`, if given.
async fn cluster_client(
    a: &Args,
) -> Result<Option<std::sync::Arc<felix_client::ClusterClient>>, felix_client::Error> {
    match cluster_config(a)? {
        Some(cc) => Ok(Some(std::sync::Arc::new(
            felix_client::ClusterClient::connect(cc).await?,
        ))),
        None => Ok(None),
    }
}

/// A group consumer over one broker, or (with `--brokers`) each shard at its owner.
enum Consumer<'a> {
    One(felix_client::GroupConsumer<&'a Client>, &'a Client),
    Cluster(felix_client::ClusterGroupConsumer),
}

impl Consumer<'_> {
    async fn poll(
        &mut self,
        max: u32,
    ) -> Result<Vec<felix_client::GroupRecord>, felix_client::Error> {
        let wait = Duration::from_millis(100);
        match self {
            Consumer::One(c, _) => c.poll(max, None, wait).await,
            Consumer::Cluster(c) => c.poll(max, None, wait).await,
        }
    }

    async fn ack(
        &mut self,
        sn: &StreamName,
        group: &str,
        ids: &[felix_client::ClaimId],
    ) -> Result<Vec<Result<(), felix_client::Error>>, felix_client::Error> {
        match self {
            Consumer::One(_, client) => client.group_ack(sn, group, ids).await,
            Consumer::Cluster(c) => c.ack(ids).await,
        }
    }
}

async fn group(a: &Args) -> Result<(), felix_client::Error> {
    use felix_client::{ClaimId, GroupOptions};
    let count = a.count.unwrap_or(100_000);
    if a.consumers == 0 || a.consumers > 256 {
        return Err(felix_client::Error::InvalidArgument(
            "--consumers must be 1..=256".into(),
        ));
    }
    let deadline = Instant::now() + Duration::from_secs(a.bound_secs);
    let load = load1();
    // With --brokers: records loaded to each shard's owner, and consumed there.
    let cluster = cluster_client(a).await?;
    let c = match &cluster {
        Some(cc) => cc.client().await?,
        None => std::sync::Arc::new(Client::connect(cfg(a)).await?),
    };
    let info = c.describe_stream(&name(a)).await?;
    let gname = format!("loadgen-{}-{}", std::process::id(), load_nanos());
    let opts = GroupOptions {
        start: StartAt::Latest,
        max_attempts: 0,
        visibility_timeout_ms: 60_000,
    };
    c.group_create(&name(a), &gname, None, opts).await?;
    // Load the records (acked: all committed before consumption starts).
    let payload = Bytes::from(vec![b'x'; a.payload]);
    let p = c.publisher();
    let mut inflight = tokio::task::JoinSet::new();
    let mut sent = 0u64;
    while sent < count {
        while inflight.len() >= a.inflight {
            inflight.join_next().await.unwrap().unwrap()?;
        }
        let n = (a.batch as u64).min(count - sent);
        let (p, sn, pl, cc) = (p.clone(), name(a), payload.clone(), cluster.clone());
        let shard = ((sent / a.batch as u64) % info.shards as u64) as u32;
        inflight.spawn(async move {
            let records = vec![pl; n as usize];
            match cc {
                Some(cc) => {
                    cc.publish_batch(&sn, ShardSelector::Shard(shard), records)
                        .await
                }
                None => {
                    p.publish_batch(&sn, ShardSelector::Shard(shard), records)
                        .await
                }
            }
            .map(|_| ())
        });
        sent += n;
    }
    while let Some(r) = inflight.join_next().await {
        r.unwrap()?;
    }
    let done = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..a.consumers {
        let (cfg, sn, g, done) = (cfg(a), name(a), gname.clone(), done.clone());
        let ccfg = cluster_config(a)?;
        let max = a.batch.min(1000) as u32;
        tasks.push(tokio::spawn(async move {
            let single = match &ccfg {
                Some(_) => None,
                None => Some(Client::connect(cfg).await?),
            };
            let mut cons = match (ccfg, &single) {
                (Some(ccfg), _) => {
                    let cc = std::sync::Arc::new(felix_client::ClusterClient::connect(ccfg).await?);
                    Consumer::Cluster(cc.group_consumer(&sn, &g).await?)
                }
                (None, Some(c)) => Consumer::One(c.group_consumer(&sn, &g).await?, c),
                (None, None) => unreachable!("connected above"),
            };
            let mut hist =
                hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
            let mut seen: Vec<(u32, u64)> = Vec::new();
            let mut redelivered = 0u64;
            while done.load(std::sync::atomic::Ordering::Relaxed) < count
                && Instant::now() < deadline
            {
                let t0 = Instant::now();
                let recs = cons.poll(max).await?;
                if recs.is_empty() {
                    continue;
                }
                let ids: Vec<ClaimId> = recs.iter().map(|r| r.claim()).collect();
                let answered = cons.ack(&sn, &g, &ids).await?;
                hist.record(t0.elapsed().as_micros().max(1) as u64).unwrap();
                for (r, ok) in recs.iter().zip(answered) {
                    if ok.is_ok() {
                        seen.push((r.shard, r.offset));
                    }
                    redelivered += u64::from(r.attempt > 1);
                }
                done.fetch_add(ids.len() as u64, std::sync::atomic::Ordering::Relaxed);
            }
            drop(cons);
            if let Some(c) = single {
                let _ = c.close().await;
            }
            Ok::<_, felix_client::Error>((seen, hist, redelivered))
        }));
    }
    let mut all = std::collections::HashSet::new();
    let mut dup = 0u64;
    let mut hist = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
    let mut redelivered = 0u64;
    for t in tasks {
        let (seen, h, r) = t.await.unwrap()?;
        for k in seen {
            dup += u64::from(!all.insert(k));
        }
        hist.add(h).unwrap();
        redelivered += r;
    }
    let secs = start.elapsed().as_secs_f64();
    let processed = all.len() as u64;
    let rate = processed as f64 / secs;
    let _ = c.group_delete(&name(a), &gname, None).await;
    emit(
        a,
        serde_json::json!({
            "tool": "felix-loadgen", "mode": "group", "stream": a.stream, "shards": info.shards,
            "brokers": cluster.as_ref().map(|cc| cc.brokers().len()),
            "max_secs": a.bound_secs, "duration_s": secs,
            "payload": a.payload, "batch": a.batch, "consumers": a.consumers, "count": count,
            "load1": load, "processed": processed, "duplicates": dup, "redelivered": redelivered,
            "lossless": processed == count && dup == 0, "truncated": processed < count,
            "records_per_s": rate, "mb_per_s": rate * a.payload as f64 / 1e6,
            "unit": "us", "poll_ack": {"p50": hist.value_at_quantile(0.5), "p90": hist.value_at_quantile(0.9),
            "p99": hist.value_at_quantile(0.99), "max": hist.max()},
        }),
    );
    // The ClusterClient holds its connection too: closed with it when dropped.
    drop(cluster);
    if let Ok(c) = std::sync::Arc::try_unwrap(c) {
        let _ = c.close().await;
    }
    Ok(())
}

/// VmRSS of a process, bytes.
/// CLOCK_MONOTONIC in nanoseconds: the clock `perf record -k mono` stamps samples with.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CPU seconds (user + system) used so far by process `pid`, or by this process.
fn cpu_used_secs(pid: Option<u32>) -> Option<f64> {
    let stat = std::fs::read_to_string(match pid {
        Some(p) => format!("/proc/{p}/stat"),
        None => "/proc/self/stat".to_string(),
    })
    .ok()?;
    // After "pid (comm) ": field 3 is the state; utime and stime are fields 14 and 15.
    let fields: Vec<&str> = stat[stat.rfind(')')? + 2..].split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf reads a constant of the running system.
    let per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (per_s > 0).then(|| ticks as f64 / per_s as f64)
}

/// CPU seconds used so far by this process and by the broker (`--broker-pid`), if known.
fn cpu_mark(a: &Args) -> (Option<f64>, Option<f64>) {
    (
        cpu_used_secs(None),
        a.broker_pid.and_then(|p| cpu_used_secs(Some(p))),
    )
}

/// Wait, until `drain_end` after `epoch` at most, for every one of `readers_n` readers to
/// end (`ended`) or every count in `counts` to reach `n`.
async fn drain(
    epoch: Instant,
    drain_end: Duration,
    ended: &AtomicU64,
    readers_n: usize,
    counts: &[AtomicU64],
    n: u64,
) {
    while epoch.elapsed() < drain_end
        && ended.load(Ordering::Acquire) < readers_n as u64
        && counts.iter().any(|c| c.load(Ordering::Acquire) < n)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn rss_bytes(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

async fn fanout_scale(a: &Args) -> Result<(), felix_client::Error> {
    use std::sync::Mutex;
    let subs_n = a.subscribers;
    if subs_n == 0 || subs_n > 10_000 || a.rate == 0 || a.rate > 1_000_000 || a.secs == 0 {
        return Err(felix_client::Error::InvalidArgument(
            "need 1..=10000 subscribers, rate 1..=1000000, secs >= 1".into(),
        ));
    }
    let conns_n = a
        .connections
        .unwrap_or(subs_n.div_ceil(1000))
        .clamp(1, subs_n);
    let load = load1();
    let rss0 = a.broker_pid.and_then(rss_bytes);
    let mut clients = Vec::new();
    for _ in 0..conns_n {
        clients.push(Client::connect(cfg(a)).await?);
    }
    let opts = SubscribeOptions {
        policy: a.queue_policy,
        queue_records_max: a.queue_records,
        ..Default::default()
    };
    let mut subs = Vec::with_capacity(subs_n);
    for i in 0..subs_n {
        subs.push(
            clients[i % conns_n]
                .subscribe(&name(a), a.shard, opts.clone())
                .await?,
        );
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss1 = a.broker_pid.and_then(rss_bytes);
    let epoch = Instant::now();
    let ticker = ticker(
        a.progress,
        report::Shown {
            published: true,
            acked: false,
            subscribers: subs_n,
        },
    );
    let hists: Vec<_> = (0..conns_n)
        .map(|_| {
            Arc::new(Mutex::new(
                hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 2).unwrap(),
            ))
        })
        .collect();
    let drain_end = Duration::from_secs(a.secs + 10).min(Duration::from_secs(a.bound_secs));
    // Each subscription's received + announced-lost count, and how many readers ended: the
    // main task closes the connections once every subscription has accounted for what was
    // published (or the drain time is up), which ends the readers. A reader waits on its
    // subscription alone: a timeout per read registers a timer per delivery per subscriber.
    let accounted: Arc<Vec<AtomicU64>> = Arc::new((0..subs_n).map(|_| AtomicU64::new(0)).collect());
    let ended = Arc::new(AtomicU64::new(0));
    let readers: Vec<_> = subs
        .into_iter()
        .enumerate()
        .map(|(i, mut s)| {
            let h = hists[i % conns_n].clone();
            let (accounted, ended) = (accounted.clone(), ended.clone());
            let progress = ticker.counters();
            // Every delivery and notice must start where the last one ended, from the
            // subscription's start: with frames naming many subscriptions, a count could pass
            // where the offsets do not.
            let mut next = s.start_offsets[0].1;
            tokio::spawn(async move {
                let mut st = SubStat::default();
                while let Some(ev) = s.next().await {
                    match ev {
                        Event::Records {
                            records,
                            first_offset,
                            ..
                        } => {
                            st.out_of_order += u64::from(first_offset != next);
                            next = first_offset + u64::from(records.count());
                            if let Some(p) = records.iter().next() {
                                let t = u64::from_le_bytes(p[..8].try_into().unwrap());
                                let now = epoch.elapsed().as_micros() as u64;
                                let _ = h.lock().unwrap().record(now.saturating_sub(t).max(1));
                            }
                            let k = records.count() as u64;
                            st.got += k;
                            if let Some(p) = &progress {
                                p.delivered.fetch_add(k, Ordering::Relaxed);
                            }
                        }
                        Event::Lag {
                            lost: l,
                            from_offset,
                            ..
                        } => {
                            st.out_of_order += u64::from(from_offset != next);
                            next = from_offset + l;
                            st.lost += l;
                            st.lag_notices += 1;
                            if let Some(p) = &progress {
                                p.lost.fetch_add(l, Ordering::Relaxed);
                            }
                        }
                        // u16::MAX: the connection closed (the run is over), not an end.
                        Event::End { code, message, .. } => {
                            if code != u16::MAX {
                                st.end = Some((code, message));
                            }
                            break;
                        }
                        Event::Watch(_) => {}
                    }
                    accounted[i].store(st.got + st.lost, Ordering::Release);
                }
                ended.fetch_add(1, Ordering::AcqRel);
                st
            })
        })
        .collect();
    // Publisher: every millisecond, whatever the rate says is due.
    let publisher = Client::connect(cfg(a)).await?;
    let start = Instant::now();
    let cpu0 = cpu_mark(a);
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let total = a.rate * a.secs;
    let mut n = 0u64;
    let pad = vec![b'x'; a.payload - 8];
    while n < total {
        tick.tick().await;
        let due = ((start.elapsed().as_secs_f64() * a.rate as f64) as u64 + 1).min(total);
        if due <= n {
            continue;
        }
        let ts = epoch.elapsed().as_micros() as u64;
        let batch: Vec<Bytes> = (n..due)
            .map(|_| {
                let mut p = Vec::with_capacity(a.payload);
                p.extend_from_slice(&ts.to_le_bytes());
                p.extend_from_slice(&pad);
                Bytes::from(p)
            })
            .collect();
        publisher.publish_fire(&name(a), ShardSelector::Shard(a.shard), batch)?;
        n = due;
        ticker.set(|c| &c.published, n);
    }
    let pub_secs = start.elapsed().as_secs_f64();
    // Bounded: until every subscription accounted for the n records, every reader ended, or
    // the drain time.
    drain(epoch, drain_end, &ended, subs_n, &accounted, n).await;
    // The delivery phase ends here: its time and CPU do not include closing the connections.
    let elapsed = start.elapsed().as_secs_f64();
    let cpu1 = cpu_mark(a);
    for c in std::mem::take(&mut clients) {
        let _ = c.close().await;
    }
    let (mut delivered, mut complete, mut unordered) = (0u64, 0usize, 0usize);
    let mut min_got = u64::MAX;
    let mut stats = Vec::with_capacity(subs_n);
    for r in readers {
        let st = r.await.unwrap();
        delivered += st.got;
        min_got = min_got.min(st.got);
        // Complete: every record, each where the last ended (none missing, repeated or out
        // of order).
        complete += usize::from(st.got == n && st.out_of_order == 0);
        unordered += usize::from(st.out_of_order > 0);
        stats.push(st);
    }
    // In cores over the delivery phase: a saturated load core measures the client.
    let cores =
        |x: Option<f64>, y: Option<f64>| Some(((y? - x?) / elapsed * 100.0).round() / 100.0);
    let client_us_per_delivery = match (cpu0.0, cpu1.0) {
        (Some(x), Some(y)) if delivered > 0 => Some((y - x) * 1e6 / delivered as f64),
        _ => None,
    };
    drop(ticker);
    let mut hist = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 2).unwrap();
    for h in &hists {
        hist.add(&*h.lock().unwrap()).unwrap();
    }
    let (refused, last) = publisher.fire_and_forget_errors();
    let per_sub = match (rss0, rss1) {
        (Some(a0), Some(a1)) => serde_json::json!(a1.saturating_sub(a0) as f64 / subs_n as f64),
        _ => serde_json::Value::Null,
    };
    let mut v = serde_json::json!({
        "tool": "felix-loadgen", "mode": "fanout-scale", "stream": a.stream, "shard": a.shard,
        "subscribers": subs_n, "secs": a.secs, "max_secs": a.bound_secs, "duration_s": pub_secs,
        "connections": conns_n, "payload": a.payload, "rate_target": a.rate,
        "publish_rate": n as f64 / pub_secs, "published": n, "publish_refused": refused,
        "refused_last": last.map(|e| e.to_string()),
        "delivered": delivered, "delivered_per_s": delivered as f64 / elapsed,
        "expected": n * subs_n as u64, "min_per_sub": min_got,
        "subs_complete": complete, "lossless": complete == subs_n,
        "subs_out_of_order": unordered,
        "delivery_phase_cpu": {"client_cores": cores(cpu0.0, cpu1.0),
            "broker_cores": cores(cpu0.1, cpu1.1), "client_us_per_delivery": client_us_per_delivery},
        "queue_policy": a.queue_policy.name(), "load1": load,
        "broker_rss_before": rss0, "broker_rss_after_subscribe": rss1,
        "broker_rss_per_sub_bytes": per_sub, "unit": "us",
        "latency_sampled": {"p50": hist.value_at_quantile(0.5), "p90": hist.value_at_quantile(0.9),
            "p99": hist.value_at_quantile(0.99), "max": hist.max(), "samples": hist.len()},
    });
    loss_fields(&stats, n, v.as_object_mut().unwrap());
    emit(a, v);
    let _ = publisher.close().await;
    Ok(())
}

use stats::pct;

fn load_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// For each policy: a fast subscriber, a stalled one (not read while publishing), 2000
/// records published; then the stalled one is read and both are summarized.
async fn demo(a: &Args) -> Result<(), felix_client::Error> {
    let n: u64 = a.count.unwrap_or(2000);
    println!("slow-consumer demo: {n} records of {} B to {}/{}; the slow subscriber reads nothing until publishing ends", a.payload, name(a), a.shard);
    for policy in [
        QueuePolicy::DropNew,
        QueuePolicy::DropOld,
        QueuePolicy::Block,
    ] {
        let fast_c = Client::connect(cfg(a)).await?;
        let mut fast = fast_c
            .subscribe(
                &name(a),
                a.shard,
                SubscribeOptions {
                    policy,
                    ..Default::default()
                },
            )
            .await?;
        let mut sc = cfg(a);
        sc.transport.max_stream_data_uni_bytes = 4096;
        let slow_c = Client::connect(sc).await?;
        let opts = SubscribeOptions {
            policy,
            queue_records_max: 64,
            buffer_events: 4,
            start: StartAt::Latest,
            ..Default::default()
        };
        let mut slow = slow_c.subscribe(&name(a), a.shard, opts).await?;
        let publisher = Client::connect(cfg(a)).await?;
        let payload = Bytes::from(vec![b'x'; a.payload]);
        let t0 = Instant::now();
        let pubn = name(a);
        let shard = a.shard;
        let pub_task = tokio::spawn(async move {
            let mut first_offset = None;
            for _ in 0..n {
                let ack = publisher
                    .publish_batch(&pubn, ShardSelector::Shard(shard), vec![payload.clone()])
                    .await?;
                first_offset.get_or_insert(ack.first_offset);
            }
            Ok::<_, felix_client::Error>((first_offset.unwrap_or(0), t0.elapsed()))
        });
        // Read the fast one while publishing; under Block it can only get what is appended.
        let mut fast_got = 0u64;
        let stop = Instant::now() + Duration::from_secs(a.bound_secs.min(30));
        while fast_got < n && Instant::now() < stop {
            if pub_task.is_finished() && fast_got >= n {
                break;
            }
            match fast.next_timeout(Duration::from_millis(500)).await {
                Ok(Some(ev)) => fast_got += records_in(&ev),
                Ok(None) => break,
                Err(_) => {
                    if policy == QueuePolicy::Block && !pub_task.is_finished() {
                        break; // held by the slow subscriber: resume it below
                    }
                }
            }
        }
        let fast_before_resume = fast_got;
        let published_before_resume = pub_task.is_finished();
        let (mut slow_got, mut lags) = (0u64, Vec::new());
        let (mut first, mut last) = (None, 0u64);
        while slow_got + lags.iter().map(|l: &(u64, u64)| l.1).sum::<u64>() < n {
            match slow.next_timeout(Duration::from_secs(5)).await {
                Ok(Some(ev)) => {
                    for (o, _) in ev.records() {
                        first.get_or_insert(o);
                        last = o;
                        slow_got += 1;
                    }
                    if let Event::Lag {
                        from_offset, lost, ..
                    } = ev
                    {
                        lags.push((from_offset, lost));
                    }
                }
                _ => break,
            }
        }
        while fast_got < n {
            match fast.next_timeout(Duration::from_secs(5)).await {
                Ok(Some(ev)) => fast_got += records_in(&ev),
                _ => break,
            }
        }
        let (base, pub_time) = pub_task.await.unwrap()?;
        println!("\npolicy {}:", policy.name());
        println!(
            "  publisher: {n} acked in {:.0} ms; finished before the slow subscriber resumed: {}",
            pub_time.as_secs_f64() * 1000.0,
            published_before_resume
        );
        println!("  fast subscriber: {fast_before_resume} records while the slow one stalled, {fast_got} in the end, no loss");
        println!(
            "  slow subscriber: {slow_got} records (offsets {}..={} relative to the run), lag notices: {:?}",
            first.map(|f| f - base).unwrap_or(0),
            last.saturating_sub(base),
            lags.iter().map(|(f, l)| format!("lost {l} from {}", f - base)).collect::<Vec<_>>()
        );
        let _ = fast_c.close().await;
        let _ = slow_c.close().await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every flag says what it does in --help; the counted modes' defaults and the bound of a
    /// run are spelled out; --count and --duration exclude each other.
    #[test]
    fn every_flag_is_documented() {
        let cmd = Args::command();
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if matches!(id, "help" | "version") {
                continue;
            }
            let help = arg
                .get_long_help()
                .or(arg.get_help())
                .map(|h| h.to_string());
            assert!(
                help.as_ref().is_some_and(|h| h.len() > 20),
                "--{id} has no help: {help:?}"
            );
        }
        let help = Args::command().render_long_help().to_string();
        for want in [
            "throughput 500,000",
            "at most 600",
            "500ms, 30s, 2m",
            "Default 60, or --duration plus 30",
            "localhost:7400",
            "--json",
        ] {
            assert!(help.contains(want), "--help lacks {want:?}");
        }
        let both = Args::try_parse_from([
            "felix-loadgen",
            "--mode",
            "rtt",
            "--count",
            "5",
            "--duration",
            "1s",
        ]);
        assert!(both.is_err());
        let a = Args::try_parse_from([
            "felix-loadgen",
            "--mode",
            "throughput",
            "--duration",
            "1.5s",
            "--broker",
            "localhost:7400",
        ])
        .unwrap();
        assert_eq!(a.duration, Some(Duration::from_millis(1500)));
        assert_eq!(a.broker, "localhost:7400");
    }
}

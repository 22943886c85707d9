//! felix-loadgen: bounded load against a running broker, one JSON line per run.
//!
//! Modes (shapes match ../shared/tools/peer-bench so results compare side by side):
//! * `throughput`: one publisher connection, `--fanout F` subscriber connections on one
//!   shard. Acked publishes of `--batch` records of `--payload` bytes, up to `--inflight`
//!   batches awaiting their ack. Reports publish and per-subscriber rates.
//! * `latency`: closed loop, one record in flight: publish, wait until all F subscribers
//!   have it, publish the next. One-way publish→delivery percentiles (same process clock).
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
//! Every run is bounded by `--count` (at most 10,000,000) and `--max-secs` (at most 600).

mod stats;

use bytes::Bytes;
use clap::{Parser, ValueEnum};
use felix_client::{Client, ClientConfig, Event, SubscribeOptions, Subscription};
use felix_quic::tls::Verify;
use felix_quic::wire::{QueuePolicy, ShardSelector, StartAt, StreamName};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, ValueEnum, Debug)]
enum Mode {
    Throughput,
    /// Publish → delivered-to-all-F, fire-and-forget publishes, one record in flight.
    Latency,
    /// Request round trip: one acked publish at a time, publish → its ack (no subscriber).
    Rtt,
    Ingest,
    Group,
    FanoutScale,
    Cache,
    DemoSlowConsumer,
    /// Print the Markdown summary of a bench-vs-nats JSONL file (`--input`); no broker.
    Summarize,
}

#[derive(Parser, Debug)]
#[command(name = "felix-loadgen", about = "Felix load generator", version = concat!(env!("CARGO_PKG_VERSION"), " (git ", env!("FELIX_GIT_REV"), ")"))]
struct Args {
    #[arg(long, value_enum)]
    mode: Mode,
    #[arg(long, env = "FELIX_BROKER", default_value = "127.0.0.1:7400")]
    broker: SocketAddr,
    /// CA certificate (PEM); default ./felix-data/tls/dev-cert.pem.
    #[arg(long, env = "FELIX_CA", default_value = "felix-data/tls/dev-cert.pem")]
    ca: PathBuf,
    #[arg(long, default_value = "events")]
    stream: String,
    #[arg(long, default_value_t = 0)]
    shard: u32,
    #[arg(long, default_value_t = 128)]
    payload: usize,
    #[arg(long, default_value_t = 1)]
    fanout: usize,
    /// Records per publish batch (throughput).
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Batches awaiting their ack at once (throughput).
    #[arg(long, default_value_t = 32)]
    inflight: usize,
    #[arg(long)]
    count: Option<u64>,
    #[arg(long, default_value_t = 60)]
    max_secs: u64,
    /// Subscriber queue policy on the broker (throughput, latency): `block` makes a throughput
    /// run lossless by holding the publisher; the drop policies report what was lost.
    /// `drop_new`, `drop_old` or `block` (the wire names, as felixctl spells them).
    #[arg(long, default_value = "drop_new", value_parser = parse_policy)]
    queue_policy: QueuePolicy,
    /// Runtime worker threads; default: the CPUs this process may run on (so `taskset -c 1`
    /// gives one thread — two threads time-sharing one core wait on each other's wakeups).
    /// With one, the runtime is tokio's current-thread one: everything on the main thread.
    #[arg(long)]
    threads: Option<usize>,
    /// Competing consumers, each on its own connection (group).
    #[arg(long, default_value_t = 1)]
    consumers: usize,
    /// Subscriptions (fanout-scale), at most 10,000.
    #[arg(long, default_value_t = 1000)]
    subscribers: usize,
    /// Connections the subscriptions are spread over (fanout-scale); default S/1000 rounded up.
    #[arg(long)]
    connections: Option<usize>,
    /// Publish rate, records/s (fanout-scale).
    #[arg(long, default_value_t = 100)]
    rate: u64,
    /// Publishing time, seconds (fanout-scale).
    #[arg(long, default_value_t = 5)]
    secs: u64,
    /// The broker's pid, to report its resident memory per subscriber (fanout-scale).
    #[arg(long)]
    broker_pid: Option<u32>,
    /// Cache name (cache).
    #[arg(long, default_value = "kv")]
    cache: String,
    /// A progress line on stderr every second (throughput, latency, ingest, fanout-scale).
    #[arg(long)]
    progress: bool,
    /// The JSONL file to summarize (summarize).
    #[arg(long)]
    input: Option<PathBuf>,
    /// Ceiling of this client's QUIC packet size, bytes (the broker has its own,
    /// FELIX_UDP_PAYLOAD_MAX_BYTES); the smaller of the two ends wins. 1350 reproduces the
    /// pre-PMTUD transport for before/after runs.
    #[arg(long, default_value_t = felix_quic::DEFAULT_UDP_PAYLOAD_MAX, value_parser = parse_udp_max)]
    udp_payload_max_bytes: usize,
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

const COUNT_MAX: u64 = 10_000_000;

fn cfg(a: &Args) -> ClientConfig {
    let mut c = ClientConfig::new(a.broker, None);
    c.verify = Verify::CaFile(a.ca.clone());
    c.transport.udp_payload_max_bytes = a.udp_payload_max_bytes;
    let _ = UDP_PAYLOAD_MAX.set(a.udp_payload_max_bytes);
    c
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

/// Print one result line: the mode's fields plus what makes it comparable later — the
/// machine (cores, CPU, kernel), the git revision (`FELIX_GIT_REV`, else the one the binary
/// was built from), the UTC date and the load average at the end.
fn emit(mut v: serde_json::Value) {
    if let Some(o) = v.as_object_mut() {
        if let Some(n) = UDP_PAYLOAD_MAX.get() {
            o.insert("udp_payload_max_bytes".into(), (*n).into());
        }
        o.insert("machine".into(), machine_facts());
        o.insert("git_rev".into(), git_rev().into());
        o.insert(
            "date".into(),
            stats::utc_rfc3339(std::time::SystemTime::now()).into(),
        );
        o.insert("load1_end".into(), load1().into());
    }
    println!("{v}");
}

/// This run's `--udp-payload-max-bytes`, for the result line.
static UDP_PAYLOAD_MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

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

/// A `--progress` ticker that stops when dropped (so every return path ends it).
struct Ticker(Option<tokio::task::JoinHandle<()>>);
impl Drop for Ticker {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            t.abort();
        }
    }
}

/// With `--progress`, a line on stderr every second: `label`, the count so far, its rate.
fn ticker(on: bool, label: &'static str) -> (Ticker, std::sync::Arc<std::sync::atomic::AtomicU64>) {
    let n = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    (Ticker(progress(on, label, n.clone())), n)
}

/// With `--progress`, a line on stderr every second: `label`, the count so far, its rate.
fn progress(
    on: bool,
    label: &'static str,
    count: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> Option<tokio::task::JoinHandle<()>> {
    if !on {
        return None;
    }
    Some(tokio::spawn(async move {
        let start = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.tick().await;
        loop {
            tick.tick().await;
            let n = count.load(std::sync::atomic::Ordering::Relaxed);
            let secs = start.elapsed().as_secs_f64();
            eprintln!(
                "progress: {label} {n} in {secs:.0} s ({:.0}/s)",
                n as f64 / secs
            );
        }
    }))
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

async fn run(a: Args) {
    // RUST_LOG filters (default warn) to stderr: stdout carries only the JSON result line.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    // Latency-measuring modes carry a sequence and a send timestamp in each payload.
    let stamped = matches!(a.mode, Mode::Latency | Mode::FanoutScale);
    if (stamped && a.payload < 16)
        || a.fanout == 0
        || a.batch == 0
        || a.inflight == 0
        || a.max_secs > 600
    {
        eprintln!(
            "felix-loadgen: need payload >= 16 (latency, fanout-scale), fanout/batch/inflight >= 1, max-secs <= 600"
        );
        std::process::exit(2);
    }
    let r = match a.mode {
        Mode::Throughput => throughput(&a).await,
        Mode::Latency => latency(&a).await,
        Mode::Ingest => ingest(&a).await,
        Mode::Rtt => rtt(&a).await,
        Mode::Group => group(&a).await,
        Mode::FanoutScale => fanout_scale(&a).await,
        Mode::Cache => cache(&a).await,
        Mode::Summarize => {
            let Some(p) = &a.input else {
                eprintln!("felix-loadgen: --mode summarize needs --input FILE.jsonl");
                std::process::exit(2);
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

async fn subscribers(
    a: &Args,
    opts: SubscribeOptions,
) -> Result<(Vec<Client>, Vec<Subscription>), felix_client::Error> {
    let mut cs = Vec::new();
    let mut ss = Vec::new();
    for _ in 0..a.fanout {
        let c = Client::connect(cfg(a)).await?;
        ss.push(c.subscribe(&name(a), a.shard, opts.clone()).await?);
        cs.push(c);
    }
    Ok((cs, ss))
}

async fn throughput(a: &Args) -> Result<(), felix_client::Error> {
    let count = a.count.unwrap_or(500_000).min(COUNT_MAX);
    let deadline = Instant::now() + Duration::from_secs(a.max_secs);
    let load = load1();
    let (_cs, subs) = subscribers(
        a,
        SubscribeOptions {
            policy: a.queue_policy,
            ..Default::default()
        },
    )
    .await?;
    let publisher = Client::connect(cfg(a)).await?;
    let payload = Bytes::from(vec![b'x'; a.payload]);
    let start = Instant::now();
    let readers: Vec<_> = subs
        .into_iter()
        .map(|mut s| {
            tokio::spawn(async move {
                let (mut got, mut lost) = (0u64, 0u64);
                // Order check: each event must start where the last one (records or a lag
                // notice) ended; the first one sets the start.
                let (mut next, mut out_of_order) = (None::<u64>, 0u64);
                while got + lost < count {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match s.next_timeout(left).await {
                        Ok(Some(ev)) => {
                            let n = records_in(&ev);
                            got += n;
                            let (from, len) = match ev {
                                Event::Records { first_offset, .. } => (first_offset, n),
                                Event::Lag {
                                    from_offset,
                                    lost: l,
                                    ..
                                } => {
                                    lost += l;
                                    (from_offset, l)
                                }
                                _ => continue,
                            };
                            if next.is_some_and(|x| x != from) {
                                out_of_order += 1;
                            }
                            next = Some(from + len);
                        }
                        _ => break,
                    }
                }
                (got, lost, out_of_order, start.elapsed())
            })
        })
        .collect();
    let mut inflight = tokio::task::JoinSet::new();
    let mut sent = 0u64;
    let mut truncated = false;
    let p = publisher.publisher();
    let (tick, shown) = ticker(a.progress, "published");
    while sent < count {
        if Instant::now() > deadline {
            truncated = true;
            break;
        }
        shown.store(sent, std::sync::atomic::Ordering::Relaxed);
        while inflight.len() >= a.inflight {
            inflight.join_next().await.unwrap().unwrap()?;
        }
        let k = (a.batch as u64).min(count - sent);
        let batch: Vec<Bytes> = (0..k).map(|_| payload.clone()).collect();
        let sel = ShardSelector::Shard(a.shard);
        let (p, n) = (p.clone(), name(a));
        inflight.spawn(async move { p.publish_batch(&n, sel, batch).await.map(|_| ()) });
        sent += k;
    }
    while let Some(r) = inflight.join_next().await {
        r.unwrap()?;
    }
    drop(tick);
    let pub_secs = start.elapsed().as_secs_f64();
    let mut per_sub = Vec::new();
    let mut lost_total = 0;
    let mut out_of_order = 0;
    for r in readers {
        let (got, lost, disorder, t) = r.await.unwrap();
        out_of_order += disorder;
        lost_total += lost + (sent - got - lost);
        per_sub.push(got as f64 / t.as_secs_f64());
    }
    let avg = per_sub.iter().sum::<f64>() / per_sub.len() as f64;
    let min = per_sub.iter().cloned().fold(f64::MAX, f64::min);
    let mb = |msgs: f64| msgs * a.payload as f64 / 1e6;
    emit(serde_json::json!({
        "tool": "felix-loadgen", "mode": "throughput", "payload": a.payload, "fanout": a.fanout,
        "batch": a.batch, "inflight": a.inflight, "count": sent, "load1": load, "truncated": truncated,
        "out_of_order": out_of_order,
        "publish_msgs_per_s": sent as f64 / pub_secs, "publish_mb_per_s": mb(sent as f64 / pub_secs),
        "per_sub_msgs_per_s_avg": avg, "per_sub_mb_per_s_avg": mb(avg), "per_sub_msgs_per_s_min": min,
        "total_msgs_per_s": avg * a.fanout as f64, "lost": lost_total,
        "queue_policy": a.queue_policy.name(),
    }));
    let _ = publisher.close().await;
    Ok(())
}

async fn latency(a: &Args) -> Result<(), felix_client::Error> {
    let count = a.count.unwrap_or(10_000).min(COUNT_MAX);
    let warmup = (count / 10).min(1000);
    let deadline = Instant::now() + Duration::from_secs(a.max_secs);
    let load = load1();
    let (_cs, mut subs) = subscribers(
        a,
        SubscribeOptions {
            policy: a.queue_policy,
            ..Default::default()
        },
    )
    .await?;
    let publisher = Client::connect(cfg(a)).await?;
    let mut each = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
    let mut all = each.clone();
    let payload = Bytes::from(vec![b'x'; a.payload]);
    let mut truncated = false;
    let (_ticker, shown) = ticker(a.progress, "samples");
    for i in 0..count + warmup {
        if Instant::now() > deadline {
            truncated = true;
            break;
        }
        shown.store(i, std::sync::atomic::Ordering::Relaxed);
        let t0 = Instant::now();
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
                    Some(_) => continue,
                    None => return Err(felix_client::Error::Closed("subscription ended".into())),
                }
            }
            let d = t0.elapsed();
            last = last.max(d);
            if i >= warmup {
                each.record(d.as_micros().max(1) as u64).unwrap();
            }
        }
        if i >= warmup {
            all.record(last.as_micros().max(1) as u64).unwrap();
        }
    }
    let pct = |h: &hdrhistogram::Histogram<u64>| serde_json::json!({"p50": h.value_at_quantile(0.5), "p90": h.value_at_quantile(0.9), "p99": h.value_at_quantile(0.99), "p999": h.value_at_quantile(0.999), "max": h.max()});
    emit(serde_json::json!({
        "tool": "felix-loadgen", "mode": "latency", "payload": a.payload, "fanout": a.fanout,
        "count": all.len(), "load1": load, "truncated": truncated, "unit": "us",
        "each": pct(&each), "all_f": pct(&all),
    }));
    let _ = publisher.close().await;
    Ok(())
}

/// One acked publish at a time on `--stream` (ephemeral or durable): the request round trip,
/// kept apart from `latency` (publish → delivery, fire-and-forget) by its mode name.
async fn rtt(a: &Args) -> Result<(), felix_client::Error> {
    let count = a.count.unwrap_or(10_000).min(COUNT_MAX);
    let warmup = (count / 10).min(1000);
    let deadline = Instant::now() + Duration::from_secs(a.max_secs);
    let load = load1();
    let c = Client::connect(cfg(a)).await?;
    let info = c.describe_stream(&name(a)).await?;
    let p = c.publisher();
    let (stream, payload) = (name(a), Bytes::from(vec![b'x'; a.payload]));
    let mut hist = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
    let (_ticker, shown) = ticker(a.progress, "requests");
    let mut truncated = false;
    let mut start = Instant::now();
    for i in 0..count + warmup {
        if Instant::now() > deadline {
            truncated = true;
            break;
        }
        if i == warmup {
            start = Instant::now();
        }
        shown.store(i, std::sync::atomic::Ordering::Relaxed);
        let t0 = Instant::now();
        p.publish_batch(
            &stream,
            ShardSelector::Shard(a.shard),
            vec![payload.clone()],
        )
        .await?;
        if i >= warmup {
            hist.record(t0.elapsed().as_micros().max(1) as u64).unwrap();
        }
    }
    let secs = start.elapsed().as_secs_f64();
    emit(serde_json::json!({
        "tool": "felix-loadgen", "mode": "rtt", "stream": a.stream, "durable": info.durable,
        "payload": a.payload, "count": hist.len(), "load1": load, "truncated": truncated,
        "requests_per_s": if secs > 0.0 { hist.len() as f64 / secs } else { 0.0 },
        "unit": "us", "rtt": stats::pct(&hist),
    }));
    let _ = c.close().await;
    Ok(())
}

async fn ingest(a: &Args) -> Result<(), felix_client::Error> {
    let count = a.count.unwrap_or(100_000).min(COUNT_MAX);
    let warmup = (count / 20).min(2000);
    let deadline = Instant::now() + Duration::from_secs(a.max_secs);
    let load = load1();
    let c = Client::connect(cfg(a)).await?;
    let info = c.describe_stream(&name(a)).await?;
    let p = c.publisher();
    let payload = Bytes::from(vec![b'x'; a.payload]);
    let mut hist = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
    let mut inflight = tokio::task::JoinSet::new();
    let mut truncated = false;
    let mut start = Instant::now();
    let mut acked = 0u64;
    let mut sent = 0u64;
    let (_ticker, shown) = ticker(a.progress, "acked");
    while sent < count + warmup {
        shown.store(acked, std::sync::atomic::Ordering::Relaxed);
        if Instant::now() > deadline {
            truncated = true;
            break;
        }
        while inflight.len() >= a.inflight {
            let (i, d): (u64, Duration) = inflight.join_next().await.unwrap().unwrap()?;
            if i >= warmup {
                hist.record(d.as_micros().max(1) as u64).unwrap();
                acked += 1;
            }
        }
        if sent == warmup {
            start = Instant::now();
        }
        let (p, n, pl, i) = (p.clone(), name(a), payload.clone(), sent);
        let sel = ShardSelector::Shard(a.shard);
        inflight.spawn(async move {
            let t0 = Instant::now();
            p.publish_batch(&n, sel, vec![pl])
                .await
                .map(|_| (i, t0.elapsed()))
        });
        sent += 1;
    }
    while let Some(r) = inflight.join_next().await {
        let (i, d) = r.unwrap()?;
        if i >= warmup {
            hist.record(d.as_micros().max(1) as u64).unwrap();
            acked += 1;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let rate = acked as f64 / secs;
    emit(serde_json::json!({
        "tool": "felix-loadgen", "mode": "ingest", "stream": a.stream, "durable": info.durable,
        "payload": a.payload, "inflight": a.inflight, "count": acked, "load1": load,
        "truncated": truncated, "acks_per_s": rate, "mb_per_s": rate * a.payload as f64 / 1e6,
        "unit": "us", "ack": {"p50": hist.value_at_quantile(0.5), "p90": hist.value_at_quantile(0.9),
        "p99": hist.value_at_quantile(0.99), "p999": hist.value_at_quantile(0.999), "max": hist.max()},
    }));
    let _ = c.close().await;
    Ok(())
}

async fn group(a: &Args) -> Result<(), felix_client::Error> {
    use felix_client::{ClaimId, GroupOptions};
    let count = a.count.unwrap_or(100_000).min(COUNT_MAX);
    if a.consumers == 0 || a.consumers > 256 {
        return Err(felix_client::Error::InvalidArgument(
            "--consumers must be 1..=256".into(),
        ));
    }
    let deadline = Instant::now() + Duration::from_secs(a.max_secs);
    let load = load1();
    let c = Client::connect(cfg(a)).await?;
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
        let (p, sn, pl) = (p.clone(), name(a), payload.clone());
        let shard = ((sent / a.batch as u64) % info.shards as u64) as u32;
        inflight.spawn(async move {
            p.publish_batch(&sn, ShardSelector::Shard(shard), vec![pl; n as usize])
                .await
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
        let max = a.batch.min(1000) as u32;
        tasks.push(tokio::spawn(async move {
            let c = Client::connect(cfg).await?;
            let mut cons = c.group_consumer(&sn, &g).await?;
            let mut hist =
                hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
            let mut seen: Vec<(u32, u64)> = Vec::new();
            let mut redelivered = 0u64;
            while done.load(std::sync::atomic::Ordering::Relaxed) < count
                && Instant::now() < deadline
            {
                let t0 = Instant::now();
                let recs = cons.poll(max, None, Duration::from_millis(100)).await?;
                if recs.is_empty() {
                    continue;
                }
                let ids: Vec<ClaimId> = recs.iter().map(|r| r.claim()).collect();
                let answered = c.group_ack(&sn, &g, &ids).await?;
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
            let _ = c.close().await;
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
    emit(serde_json::json!({
        "tool": "felix-loadgen", "mode": "group", "stream": a.stream, "shards": info.shards,
        "payload": a.payload, "batch": a.batch, "consumers": a.consumers, "count": count,
        "load1": load, "processed": processed, "duplicates": dup, "redelivered": redelivered,
        "lossless": processed == count && dup == 0, "truncated": processed < count,
        "records_per_s": rate, "mb_per_s": rate * a.payload as f64 / 1e6,
        "unit": "us", "poll_ack": {"p50": hist.value_at_quantile(0.5), "p90": hist.value_at_quantile(0.9),
        "p99": hist.value_at_quantile(0.99), "max": hist.max()},
    }));
    let _ = c.close().await;
    Ok(())
}

/// VmRSS of a process, bytes.
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
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
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
    let sent = Arc::new(AtomicU64::new(0));
    let _ticker = Ticker(progress(a.progress, "published", sent.clone()));
    let done = Arc::new(AtomicBool::new(false));
    let hists: Vec<_> = (0..conns_n)
        .map(|_| {
            Arc::new(Mutex::new(
                hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 2).unwrap(),
            ))
        })
        .collect();
    let drain_end = Duration::from_secs(a.secs + 10).min(Duration::from_secs(a.max_secs));
    let readers: Vec<_> = subs
        .into_iter()
        .enumerate()
        .map(|(i, mut s)| {
            let (sent, done, h) = (sent.clone(), done.clone(), hists[i % conns_n].clone());
            tokio::spawn(async move {
                let (mut got, mut lost) = (0u64, 0u64);
                loop {
                    if done.load(Ordering::Acquire) && got + lost >= sent.load(Ordering::Acquire) {
                        break;
                    }
                    let left = drain_end.saturating_sub(epoch.elapsed());
                    if left.is_zero() {
                        break;
                    }
                    match s.next_timeout(left.min(Duration::from_millis(200))).await {
                        Ok(Some(ev @ Event::Records { .. })) => {
                            let recs = ev.records();
                            if let Some((_, p)) = recs.first() {
                                let t = u64::from_le_bytes(p[..8].try_into().unwrap());
                                let now = epoch.elapsed().as_micros() as u64;
                                let _ = h.lock().unwrap().record(now.saturating_sub(t).max(1));
                            }
                            got += recs.len() as u64;
                        }
                        Ok(Some(Event::Lag { lost: l, .. })) => lost += l,
                        Ok(Some(Event::End { .. })) | Ok(None) => break,
                        Ok(Some(Event::Watch(_))) | Err(_) => {}
                    }
                }
                (got, lost)
            })
        })
        .collect();
    // Publisher: every millisecond, whatever the rate says is due.
    let publisher = Client::connect(cfg(a)).await?;
    let start = Instant::now();
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
        sent.store(n, Ordering::Release);
    }
    let pub_secs = start.elapsed().as_secs_f64();
    done.store(true, Ordering::Release);
    let (mut delivered, mut lost, mut complete) = (0u64, 0u64, 0usize);
    let mut min_got = u64::MAX;
    for r in readers {
        let (g, l) = r.await.unwrap();
        delivered += g;
        lost += l;
        min_got = min_got.min(g);
        complete += usize::from(g == n);
    }
    let elapsed = start.elapsed().as_secs_f64();
    let mut hist = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 2).unwrap();
    for h in &hists {
        hist.add(&*h.lock().unwrap()).unwrap();
    }
    let (refused, _) = publisher.fire_and_forget_errors();
    let per_sub = match (rss0, rss1) {
        (Some(a0), Some(a1)) => serde_json::json!(a1.saturating_sub(a0) as f64 / subs_n as f64),
        _ => serde_json::Value::Null,
    };
    emit(serde_json::json!({
        "tool": "felix-loadgen", "mode": "fanout-scale", "subscribers": subs_n,
        "connections": conns_n, "payload": a.payload, "rate_target": a.rate,
        "publish_rate": n as f64 / pub_secs, "published": n, "publish_refused": refused,
        "delivered": delivered, "delivered_per_s": delivered as f64 / elapsed,
        "expected": n * subs_n as u64, "lost": lost, "min_per_sub": min_got,
        "subs_complete": complete, "lossless": complete == subs_n,
        "queue_policy": a.queue_policy.name(), "load1": load,
        "broker_rss_before": rss0, "broker_rss_after_subscribe": rss1,
        "broker_rss_per_sub_bytes": per_sub, "unit": "us",
        "latency_sampled": {"p50": hist.value_at_quantile(0.5), "p90": hist.value_at_quantile(0.9),
            "p99": hist.value_at_quantile(0.99), "max": hist.max(), "samples": hist.len()},
    }));
    let _ = publisher.close().await;
    for c in clients {
        let _ = c.close().await;
    }
    Ok(())
}

use stats::pct;

async fn cache(a: &Args) -> Result<(), felix_client::Error> {
    use felix_client::{EventKind, WatchFilter, WatchItem, WatchOptions, WatchStart};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    let watchers_n = a.subscribers;
    let count = a.count.unwrap_or(10_000).min(COUNT_MAX);
    if watchers_n == 0 || watchers_n > 10_000 || a.rate == 0 || a.rate > 100_000 || a.secs == 0 {
        return Err(felix_client::Error::InvalidArgument(
            "need 1..=10000 watchers (--subscribers), rate 1..=100000, secs >= 1".into(),
        ));
    }
    let cache = StreamName::new("default", "default", &a.cache);
    let load = load1();
    let writer = Client::connect(cfg(a)).await?;
    let deadline = Instant::now() + Duration::from_secs(a.max_secs);
    let new_hist = || hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 2).unwrap();
    let value = Bytes::from(vec![b'v'; a.payload]);
    let (mut put_h, mut get_h) = (new_hist(), new_hist());
    let mut puts = 0u64;
    for i in 0..count {
        if Instant::now() > deadline {
            break;
        }
        let t = Instant::now();
        writer
            .cache_put(&cache, format!("bench/k{}", i % 1000), value.clone(), None)
            .await?;
        put_h.record(t.elapsed().as_micros().max(1) as u64).unwrap();
        puts += 1;
    }
    for i in 0..puts {
        let t = Instant::now();
        writer
            .cache_get(&cache, format!("bench/k{}", i % 1000))
            .await?;
        get_h.record(t.elapsed().as_micros().max(1) as u64).unwrap();
    }
    // Watch fanout on one key.
    let conns_n = a
        .connections
        .unwrap_or(watchers_n.div_ceil(100))
        .clamp(1, watchers_n);
    let mut clients = Vec::new();
    for _ in 0..conns_n {
        clients.push(Client::connect(cfg(a)).await?);
    }
    let key = Bytes::from_static(b"bench/watched");
    let mut watches = Vec::with_capacity(watchers_n);
    for i in 0..watchers_n {
        watches.push(
            clients[i % conns_n]
                .cache_watch(
                    &cache,
                    WatchFilter::Key(key.clone()),
                    WatchStart::Latest,
                    WatchOptions::default(),
                )
                .await?,
        );
    }
    let epoch = Instant::now();
    let sent = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let hists: Vec<_> = (0..conns_n)
        .map(|_| Arc::new(Mutex::new(new_hist())))
        .collect();
    let drain_end = Duration::from_secs(a.secs + 10).min(Duration::from_secs(a.max_secs));
    let readers: Vec<_> = watches
        .into_iter()
        .enumerate()
        .map(|(i, mut w)| {
            let (sent, done, h) = (sent.clone(), done.clone(), hists[i % conns_n].clone());
            tokio::spawn(async move {
                let (mut got, mut lagged) = (0u64, false);
                loop {
                    if done.load(Ordering::Acquire) && got >= sent.load(Ordering::Acquire) {
                        break;
                    }
                    let left = drain_end.saturating_sub(epoch.elapsed());
                    if left.is_zero() {
                        break;
                    }
                    match w.next_timeout(left.min(Duration::from_millis(200))).await {
                        Ok(Some(WatchItem::Event {
                            kind: EventKind::Put,
                            value,
                            ..
                        })) => {
                            let t = u64::from_le_bytes(value[..8].try_into().unwrap());
                            let now = epoch.elapsed().as_micros() as u64;
                            let _ = h.lock().unwrap().record(now.saturating_sub(t).max(1));
                            got += 1;
                        }
                        Ok(Some(WatchItem::End { .. })) | Ok(None) => {
                            lagged = true;
                            break;
                        }
                        Ok(Some(_)) | Err(_) => {}
                    }
                }
                (got, lagged)
            })
        })
        .collect();
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let total = a.rate * a.secs;
    let pad = vec![b'x'; a.payload.saturating_sub(8)];
    let mut n = 0u64;
    while n < total && Instant::now() < deadline {
        tick.tick().await;
        let due = ((start.elapsed().as_secs_f64() * a.rate as f64) as u64 + 1).min(total);
        while n < due {
            let mut v = Vec::with_capacity(8 + pad.len());
            v.extend_from_slice(&(epoch.elapsed().as_micros() as u64).to_le_bytes());
            v.extend_from_slice(&pad);
            writer.cache_put(&cache, key.clone(), v, None).await?;
            n += 1;
            sent.store(n, Ordering::Release);
        }
    }
    let write_secs = start.elapsed().as_secs_f64();
    done.store(true, Ordering::Release);
    let (mut delivered, mut lagged, mut complete) = (0u64, 0usize, 0usize);
    for r in readers {
        let (g, l) = r.await.unwrap();
        delivered += g;
        lagged += usize::from(l);
        complete += usize::from(g == n);
    }
    let elapsed = start.elapsed().as_secs_f64();
    let mut hist = new_hist();
    for h in &hists {
        hist.add(&*h.lock().unwrap()).unwrap();
    }
    emit(serde_json::json!({
        "tool": "felix-loadgen", "mode": "cache", "payload": a.payload, "unit": "us",
        "puts": puts, "put_latency": pct(&put_h), "get_latency": pct(&get_h),
        "watchers": watchers_n, "connections": conns_n, "rate_target": a.rate,
        "write_rate": n as f64 / write_secs, "changes": n, "delivered": delivered,
        "delivered_per_s": delivered as f64 / elapsed, "expected": n * watchers_n as u64,
        "watches_ended": lagged, "watchers_complete": complete,
        "lossless": complete == watchers_n, "load1": load,
        "change_to_watcher_latency": pct(&hist),
    }));
    let _ = writer.close().await;
    for c in clients {
        let _ = c.close().await;
    }
    Ok(())
}

fn load_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// For each policy: a fast subscriber, a stalled one (not read while publishing), 2000
/// records published; then the stalled one is read and both are summarized.
async fn demo(a: &Args) -> Result<(), felix_client::Error> {
    let n: u64 = a.count.unwrap_or(2000).min(100_000);
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
        let stop = Instant::now() + Duration::from_secs(a.max_secs.min(30));
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

//! felixctl: Felix from the command line.
//!
//! Over QUIC: `describe`, `publish`, `subscribe`, `group ...` (consumer groups, see `group`),
//! `kv ...` (cache keys, watches, counters, see `kv`). Over the control plane's REST API (see
//! `admin`): `tenant|namespace|stream|cache create|get|ls|set|rm`, `node ls`, `shard ls`,
//! `context`, `completions`. Exit codes: 0 ok, 1 refused or the connection failed, 2 usage.

mod admin;
mod group;
mod kv;

use clap::{Parser, Subcommand};
use felix_client::{Client, ClientConfig, Event, SubscribeOptions};
use felix_quic::tls::Verify;
use felix_quic::wire::StreamName;
use felix_quic::wire::{QueuePolicy, ShardSelector, StartAt};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(name = "felixctl", about = "Felix command-line tool", version = concat!(env!("CARGO_PKG_VERSION"), " (git ", env!("FELIX_GIT_REV"), ")"))]
struct Cli {
    /// Broker QUIC address.
    #[arg(
        long,
        env = "FELIX_BROKER",
        default_value = "127.0.0.1:7400",
        global = true
    )]
    broker: SocketAddr,
    /// CA certificate (PEM) to verify the broker; default: ./felix-data/tls/dev-cert.pem if present.
    #[arg(long, env = "FELIX_CA", global = true)]
    ca: Option<PathBuf>,
    /// Do not verify the broker certificate (development only).
    #[arg(long, global = true)]
    insecure: bool,
    #[arg(long, env = "FELIX_TENANT", default_value = "default", global = true)]
    tenant: String,
    #[arg(
        long,
        env = "FELIX_NAMESPACE",
        default_value = "default",
        global = true
    )]
    namespace: String,
    /// One JSON object per result line.
    #[arg(long, global = true)]
    json: bool,
    /// Per-request timeout, milliseconds.
    #[arg(long, default_value_t = 10_000, global = true)]
    timeout_ms: u64,
    /// Control-plane REST URL; default: the current context of the config file, else
    /// http://127.0.0.1:7410.
    #[arg(long, env = "FELIX_CONTROLPLANE_URL", global = true)]
    controlplane: Option<String>,
    /// Context (named control-plane URL) from the config file.
    #[arg(long, env = "FELIX_CONTEXT", global = true)]
    context: Option<String>,
    /// Config file; default: $XDG_CONFIG_HOME/felix/felixctl.json (~/.config/...).
    #[arg(long, env = "FELIX_CONFIG", global = true)]
    config: Option<PathBuf>,
    /// Do not ask before deleting (required when stdin is not a terminal).
    #[arg(long, short = 'y', global = true)]
    yes: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Show a stream's shard count and durability.
    Describe { stream: String },
    /// Publish records (the MESSAGE arguments, or one record per stdin line if none).
    Publish {
        stream: String,
        messages: Vec<String>,
        /// Routing key (the shard is fnv1a64(key) mod shards).
        #[arg(long, conflicts_with = "shard")]
        key: Option<String>,
        /// Explicit shard.
        #[arg(long)]
        shard: Option<u32>,
        /// Send all records as one batch (one ack) instead of one publish per record.
        #[arg(long)]
        batch: bool,
        /// Fire-and-forget (no acks).
        #[arg(long)]
        no_ack: bool,
    },
    /// Subscribe and print records (one line each) and lag notices.
    Subscribe {
        stream: String,
        /// One shard; default: every shard of the stream.
        #[arg(long)]
        shard: Option<u32>,
        /// latest, earliest, or an offset.
        #[arg(long, default_value = "latest")]
        from: String,
        /// drop_new, drop_old or block.
        #[arg(long, default_value = "drop_new")]
        policy: String,
        /// Exit after this many records.
        #[arg(long)]
        count: Option<u64>,
        /// Exit when nothing arrives for this long (milliseconds); default: wait forever.
        #[arg(long)]
        idle_exit_ms: Option<u64>,
    },
    /// Consumer groups: create|describe|poll|ack|nack|extend|reject|seek|rm|dead-letters.
    #[command(subcommand)]
    Group(group::GroupCmd),
    /// Cache keys, watches and counters: describe|put|get|rm|watch|counter.
    #[command(subcommand)]
    Kv(kv::KvCmd),
    #[command(flatten)]
    Admin(admin::AdminCmd),
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let cli = Cli::parse();
    std::process::exit(run(cli).await);
}

async fn run(cli: Cli) -> i32 {
    if let Cmd::Admin(a) = &cli.cmd {
        let g = admin::Globals {
            url: cli.controlplane.clone(),
            context: cli.context.clone(),
            config: cli.config.clone(),
            tenant: cli.tenant.clone(),
            namespace: cli.namespace.clone(),
            json: cli.json,
            yes: cli.yes,
            timeout: Duration::from_millis(cli.timeout_ms),
        };
        return admin::run(a, &g).await;
    }
    let mut cfg = ClientConfig::new(cli.broker, None);
    cfg.verify = if cli.insecure {
        Verify::Insecure
    } else if let Some(ca) = cli.ca.clone() {
        Verify::CaFile(ca)
    } else if std::path::Path::new("felix-data/tls/dev-cert.pem").exists() {
        Verify::CaFile("felix-data/tls/dev-cert.pem".into())
    } else {
        Verify::System
    };
    cfg.request_timeout = Duration::from_millis(cli.timeout_ms);
    let client = match Client::connect(cfg).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("felixctl: {e}");
            return 1;
        }
    };
    let code = match &cli.cmd {
        Cmd::Publish {
            stream,
            messages,
            key,
            shard,
            batch,
            no_ack,
        } => {
            let name = StreamName::new(&cli.tenant, &cli.namespace, stream);
            let mut msgs = messages.clone();
            if msgs.is_empty() {
                use std::io::BufRead;
                msgs = std::io::stdin()
                    .lock()
                    .lines()
                    .map_while(Result::ok)
                    .collect();
            }
            let sel = match (key, shard) {
                (Some(k), _) => ShardSelector::Key(bytes::Bytes::from(k.clone().into_bytes())),
                (_, Some(s)) => ShardSelector::Shard(*s),
                _ => ShardSelector::RoundRobin,
            };
            publish(&client, &name, sel, msgs, *batch, *no_ack, cli.json).await
        }
        Cmd::Subscribe {
            stream,
            shard,
            from,
            policy,
            count,
            idle_exit_ms,
        } => {
            let name = StreamName::new(&cli.tenant, &cli.namespace, stream);
            let start = match from.as_str() {
                "latest" => StartAt::Latest,
                "earliest" => StartAt::Earliest,
                n => match n.parse() {
                    Ok(o) => StartAt::Offset(o),
                    Err(_) => {
                        eprintln!(
                            "felixctl: --from must be latest, earliest or an offset, got {n:?}"
                        );
                        return 2;
                    }
                },
            };
            let Some(policy) = QueuePolicy::parse(policy) else {
                eprintln!("felixctl: --policy must be drop_new, drop_old or block, got {policy:?}");
                return 2;
            };
            let opts = SubscribeOptions {
                start,
                policy,
                ..Default::default()
            };
            subscribe(
                &client,
                &name,
                *shard,
                opts,
                *count,
                *idle_exit_ms,
                cli.json,
            )
            .await
        }
        Cmd::Admin(_) => unreachable!("handled before connecting"),
        Cmd::Group(g) => {
            let ctx = group::Ctx {
                client: &client,
                tenant: &cli.tenant,
                namespace: &cli.namespace,
                json: cli.json,
                yes: cli.yes,
            };
            group::run(g, &ctx).await
        }
        Cmd::Kv(k) => {
            let ctx = kv::Ctx {
                client: &client,
                tenant: &cli.tenant,
                namespace: &cli.namespace,
                json: cli.json,
            };
            kv::run(k, &ctx).await
        }
        Cmd::Describe { stream } => {
            let name = StreamName::new(&cli.tenant, &cli.namespace, stream);
            match client.describe_stream(&name).await {
                Ok(i) if cli.json => {
                    println!(
                        "{}",
                        serde_json::json!({"stream": name.to_string(), "shards": i.shards, "durable": i.durable})
                    );
                    0
                }
                Ok(i) => {
                    println!(
                        "{name}: {} shards, {}",
                        i.shards,
                        if i.durable { "durable" } else { "ephemeral" }
                    );
                    0
                }
                Err(e) => {
                    eprintln!("felixctl: {e}");
                    1
                }
            }
        }
    };
    let _ = client.close().await;
    code
}

async fn publish(
    client: &Client,
    name: &StreamName,
    sel: ShardSelector,
    msgs: Vec<String>,
    batch: bool,
    no_ack: bool,
    json: bool,
) -> i32 {
    if msgs.is_empty() {
        eprintln!("felixctl: nothing to publish");
        return 2;
    }
    let groups: Vec<Vec<String>> = if batch {
        vec![msgs]
    } else {
        msgs.into_iter().map(|m| vec![m]).collect()
    };
    for g in groups {
        let payloads: Vec<bytes::Bytes> = g
            .into_iter()
            .map(|m| bytes::Bytes::from(m.into_bytes()))
            .collect();
        if no_ack {
            if let Err(e) = client.publish_fire(name, sel.clone(), payloads) {
                eprintln!("felixctl: {e}");
                return 1;
            }
            continue;
        }
        match client.publish_batch(name, sel.clone(), payloads).await {
            Ok(a) if json => println!(
                "{}",
                serde_json::json!({"shard": a.shard, "first_offset": a.first_offset, "count": a.count})
            ),
            Ok(a) => println!(
                "shard {} offset {} count {}",
                a.shard, a.first_offset, a.count
            ),
            Err(e) => {
                eprintln!("felixctl: {e}");
                return 1;
            }
        }
    }
    if no_ack {
        // Give the connection a moment to report refusals before closing.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (n, last) = client.fire_and_forget_errors();
        if n > 0 {
            eprintln!(
                "felixctl: {n} fire-and-forget publishes refused; last: {}",
                last.map(|e| e.to_string()).unwrap_or_default()
            );
            return 1;
        }
    }
    0
}

async fn subscribe(
    client: &Client,
    name: &StreamName,
    shard: Option<u32>,
    opts: SubscribeOptions,
    count: Option<u64>,
    idle_exit_ms: Option<u64>,
    json: bool,
) -> i32 {
    let sub = match shard {
        Some(s) => client.subscribe(name, s, opts).await,
        None => client.subscribe_stream(name, opts).await,
    };
    let mut sub = match sub {
        Ok(s) => s,
        Err(e) => {
            eprintln!("felixctl: {e}");
            return 1;
        }
    };
    if !json {
        eprintln!(
            "subscribed to {name} ({} shard(s)); waiting for records",
            sub.ids.len()
        );
    }
    let mut seen = 0u64;
    loop {
        if count.is_some_and(|c| seen >= c) {
            return 0;
        }
        let ev = match idle_exit_ms {
            Some(ms) => match sub.next_timeout(Duration::from_millis(ms)).await {
                Ok(ev) => ev,
                Err(_) => return 0,
            },
            None => sub.next().await,
        };
        let Some(ev) = ev else { return 1 };
        match &ev {
            Event::Records { shard, .. } => {
                for (offset, payload) in ev.records() {
                    let text = String::from_utf8_lossy(&payload);
                    if json {
                        println!(
                            "{}",
                            serde_json::json!({"shard": shard, "offset": offset, "payload": text})
                        );
                    } else {
                        println!("[{shard}:{offset}] {text}");
                    }
                    seen += 1;
                    if count.is_some_and(|c| seen >= c) {
                        break;
                    }
                }
            }
            Event::Lag {
                shard,
                from_offset,
                lost,
            } => {
                if json {
                    println!(
                        "{}",
                        serde_json::json!({"shard": shard, "lag": {"from_offset": from_offset, "lost": lost}})
                    );
                } else {
                    println!("[{shard}] lag: lost {lost} records from offset {from_offset}");
                }
            }
            Event::End {
                shard,
                code,
                message,
            } => {
                eprintln!("felixctl: subscription to shard {shard} ended ({code}): {message}");
                return if *code == 0 { 0 } else { 1 };
            }
            Event::Watch(_) => {}
        }
    }
}

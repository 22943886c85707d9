//! felixctl: Felix from the command line.
//!
//! Over QUIC: `describe`, `publish`, `subscribe`, `group ...` (consumer groups, see `group`),
//! `kv ...` (cache keys, watches, counters, see `kv`). Over the control plane's REST API (see
//! `admin`): `tenant|namespace|stream|cache create|get|ls|set|rm`, `node ls`, `shard ls`,
//! `context`, `completions`. Failures and exit codes: `fail`. Reading records: `input`.

mod admin;
mod fail;
mod group;
mod input;
mod kv;
mod token;

pub use admin::print_table;
use clap::{Parser, Subcommand, ValueEnum};
use fail::{end_code_name, Fail};
use felix_client::{Client, ClientConfig, Event, SubscribeOptions};
use felix_quic::tls::Verify;
use felix_quic::wire::StreamName;
use felix_quic::wire::{QueuePolicy, ShardSelector, StartAt};
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

const GLOBAL: &str = "Global options";

/// Where the broker is when nothing says otherwise.
const DEFAULT_BROKER: &str = "127.0.0.1:7400";

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Table,
    Json,
}

#[derive(Parser)]
#[command(
    name = "felixctl",
    about = "Felix command-line tool: data over QUIC to a broker, admin over REST to the control plane",
    version = concat!(env!("CARGO_PKG_VERSION"), " (git ", env!("FELIX_GIT_REV"), ")"),
    after_help = fail::EXIT_CODES_HELP
)]
struct Cli {
    /// Broker QUIC address, HOST:PORT (host names are resolved) [default: the context's
    /// broker, else 127.0.0.1:7400].
    #[arg(long, env = "FELIX_BROKER", global = true, help_heading = GLOBAL)]
    broker: Option<String>,
    /// Brokers of a cluster, HOST:PORT,HOST:PORT,...: the first that answers serves the
    /// command (a dead one is skipped; any broker forwards what it does not own). Every
    /// broker's certificate must be signed by the one CA given.
    #[arg(long, env = "FELIX_BROKERS", global = true, conflicts_with = "broker", help_heading = GLOBAL)]
    brokers: Option<String>,
    /// CA certificate (PEM) that signs the broker's certificate [default: the context's CA,
    /// else $FELIX_CA, else felix-data/tls/dev-cert.pem under $FELIX_DATA_DIR or the current
    /// directory, else the system trust store].
    #[arg(long, global = true, help_heading = GLOBAL)]
    ca: Option<PathBuf>,
    /// Token presented to the control plane and the broker (a JWT) [default: $FELIX_TOKEN,
    /// else the context's token, else a local admin token under $FELIX_DATA_DIR or
    /// ./felix-data: control/admin.token (scripts/run.sh), then auth/admin.token (a
    /// standalone broker)].
    #[arg(long, env = "FELIX_TOKEN", global = true, hide_env_values = true, help_heading = GLOBAL)]
    token: Option<String>,
    /// Do not verify the broker's certificate (development only).
    #[arg(long, global = true, help_heading = GLOBAL)]
    insecure: bool,
    /// Tenant of the stream, cache or namespace named.
    #[arg(long, env = "FELIX_TENANT", default_value = "default", global = true, help_heading = GLOBAL)]
    tenant: String,
    /// Namespace of the stream or cache named.
    #[arg(long, env = "FELIX_NAMESPACE", default_value = "default", global = true, help_heading = GLOBAL)]
    namespace: String,
    /// Output as JSON: one object per result line; errors as one object on stderr
    /// (the same as -o json).
    #[arg(long, global = true, help_heading = GLOBAL)]
    json: bool,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "table", global = true, help_heading = GLOBAL)]
    output: Output,
    /// How long to wait for the connection and for each answer, milliseconds.
    #[arg(long, default_value_t = 10_000, global = true, help_heading = GLOBAL)]
    timeout_ms: u64,
    /// Control-plane REST URL [default: the context's URL, else https://127.0.0.1:7410].
    #[arg(long, env = "FELIX_CONTROLPLANE_URL", global = true, help_heading = GLOBAL)]
    controlplane: Option<String>,
    /// CA certificate (PEM) that signs an https:// control plane's certificate, trusted
    /// besides the system's roots [default: the context's, else
    /// felix-data/control/tls/ca.pem under $FELIX_DATA_DIR or the current directory when it
    /// exists (scripts/run.sh)].
    #[arg(long, env = "FELIX_CONTROLPLANE_CA", global = true, help_heading = GLOBAL)]
    controlplane_ca: Option<PathBuf>,
    /// Context to use (control plane, broker and CA, from the context file) [default: the
    /// current context].
    #[arg(long, env = "FELIX_CONTEXT", global = true, help_heading = GLOBAL)]
    context: Option<String>,
    /// felixctl's context file [default: $XDG_CONFIG_HOME/felix/felixctl.json, i.e.
    /// ~/.config/felix/felixctl.json].
    #[arg(long, env = "FELIX_CONTEXT_FILE", global = true, help_heading = GLOBAL, alias = "config")]
    context_file: Option<PathBuf>,
    /// Do not ask before deleting (needed when stdin is not a terminal).
    #[arg(long, short = 'y', global = true, help_heading = GLOBAL)]
    yes: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

impl Cli {
    fn json(&self) -> bool {
        self.json || self.output == Output::Json
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Show a stream's shard count and durability.
    Describe {
        /// The stream (in --tenant/--namespace).
        stream: String,
    },
    /// Publish records: the MESSAGE arguments, or else stdin, one record per line (or per
    /// --delimiter, or all of it with --raw), each published as it is read.
    #[command(alias = "pub")]
    Publish {
        /// The stream (in --tenant/--namespace).
        stream: String,
        /// Records, one per argument, as bytes; none: read stdin.
        messages: Vec<OsString>,
        /// Routing key (the shard is fnv1a64(key) mod shards).
        #[arg(long, conflicts_with = "shard")]
        key: Option<String>,
        /// Explicit shard [default: round robin].
        #[arg(long)]
        shard: Option<u32>,
        /// Send all records as one batch (one ack) instead of one publish per record.
        #[arg(long)]
        batch: bool,
        /// Fire-and-forget: no acks (refusals are still counted and reported).
        #[arg(long)]
        no_ack: bool,
        /// stdin is one record, whatever it holds.
        #[arg(long, conflicts_with = "delimiter")]
        raw: bool,
        /// Byte that ends a record on stdin: one character, or \n, \0, \t, or 0xNN.
        #[arg(long, default_value = "\\n")]
        delimiter: String,
    },
    /// Subscribe and print records (one line each) and lag notices; Ctrl-C ends it (exit 130).
    #[command(alias = "sub")]
    Subscribe {
        /// The stream (in --tenant/--namespace).
        stream: String,
        /// One shard [default: every shard of the stream].
        #[arg(long)]
        shard: Option<u32>,
        /// Where to start: latest, earliest, or an offset (with --shard).
        #[arg(long, default_value = "latest")]
        from: String,
        /// What the broker does when this subscriber falls behind: drop_new, drop_old or block.
        #[arg(long, default_value = "drop_new")]
        policy: String,
        /// Exit after this many records [default: never].
        #[arg(long)]
        count: Option<u64>,
        /// Exit when nothing arrives for this long, milliseconds [default: wait forever].
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
    let json = cli.json();
    let code = match run(cli).await {
        Ok(()) => fail::exit::OK,
        Err(f) => f.report(json),
    };
    std::process::exit(code);
}

async fn run(cli: Cli) -> Result<(), Fail> {
    if let Cmd::Admin(a) = &cli.cmd {
        let g = admin::Globals {
            url: cli.controlplane.clone(),
            context: cli.context.clone(),
            config: cli.context_file.clone(),
            tenant: cli.tenant.clone(),
            namespace: cli.namespace.clone(),
            json: cli.json(),
            yes: cli.yes,
            timeout: Duration::from_millis(cli.timeout_ms),
            token: token_choice(&cli)?,
            controlplane_ca: controlplane_ca_choice(&cli)?,
        };
        return interruptible(admin::run(a, &g)).await;
    }
    let cfg = client_config(&cli)?;
    if let Some(list) = &cli.brokers {
        let ca = match &cfg.verify {
            Verify::CaFile(p) => Some(p.clone()),
            _ => None,
        };
        let mut ccfg = felix_client::ClusterConfig::new(list, ca)?;
        ccfg.connect_timeout = cfg.connect_timeout;
        ccfg.request_timeout = cfg.request_timeout;
        ccfg.token = cfg.token.clone();
        let cc = felix_client::ClusterClient::connect(ccfg).await?;
        let client = cc.client().await?;
        return interruptible(data_command(&cli, &client)).await;
    }
    let client = Client::connect(cfg).await?;
    let r = interruptible(data_command(&cli, &client)).await;
    // A clean close either way (bounded by the client's close timeout).
    let _ = client.close().await;
    r
}

/// Run `work` until it ends or Ctrl-C, which is a clean end with exit code 130.
async fn interruptible(
    work: impl std::future::Future<Output = Result<(), Fail>>,
) -> Result<(), Fail> {
    tokio::select! {
        r = work => r,
        _ = tokio::signal::ctrl_c() => Err(Fail::Interrupted),
    }
}

/// Which CA to trust, and where that choice came from (errors name it).
fn ca_choice(cli: &Cli, ctx: &Option<(String, admin::Context)>) -> Option<(PathBuf, String)> {
    if let Some(p) = &cli.ca {
        return Some((p.clone(), "--ca".into()));
    }
    if let Some((name, c)) = ctx {
        if let Some(p) = &c.ca {
            return Some((p.clone(), format!("context {name}")));
        }
    }
    if let Some(p) = std::env::var_os("FELIX_CA") {
        return Some((PathBuf::from(p), "FELIX_CA".into()));
    }
    // A local run (scripts/run.sh) keeps its dev certificate in its data dir.
    let local = local_data_dir().join("tls/dev-cert.pem");
    local
        .exists()
        .then(|| (local, "the local data dir".to_string()))
}

fn client_config(cli: &Cli) -> Result<ClientConfig, Fail> {
    let ctx = admin::active_context(&cli.context, &cli.context_file).map_err(Fail::Usage)?;
    let broker = cli
        .broker
        .clone()
        .or_else(|| ctx.as_ref().and_then(|(_, c)| c.broker.clone()))
        .unwrap_or_else(|| DEFAULT_BROKER.to_string());
    let mut cfg = ClientConfig::for_broker(&broker, None)?;
    cfg.verify = if cli.insecure {
        Verify::Insecure
    } else {
        match ca_choice(cli, &ctx) {
            Some((p, from)) if !p.exists() => {
                return Err(Fail::Usage(format!(
                    "CA file {} (from {from}) does not exist",
                    p.display()
                )))
            }
            Some((p, _)) => Verify::CaFile(p),
            None => Verify::System,
        }
    };
    cfg.request_timeout = Duration::from_millis(cli.timeout_ms);
    cfg.connect_timeout = Duration::from_millis(cli.timeout_ms);
    cfg.token = token_choice(cli)?;
    Ok(cfg)
}

/// The token to present: --token / $FELIX_TOKEN, else the context's, else a local admin
/// token (the control plane's of scripts/run.sh, then a standalone broker's).
/// The control plane's CA: the flag (or its environment variable), the context's, else a
/// local run's development CA when it exists.
fn controlplane_ca_choice(cli: &Cli) -> Result<Option<PathBuf>, Fail> {
    if let Some(p) = &cli.controlplane_ca {
        return Ok(Some(p.clone()));
    }
    if let Some((_, c)) =
        admin::active_context(&cli.context, &cli.context_file).map_err(Fail::Usage)?
    {
        if let Some(p) = c.controlplane_ca {
            return Ok(Some(p));
        }
    }
    let local = local_data_dir().join("control/tls/ca.pem");
    Ok(local.exists().then_some(local))
}

/// A local run's data dir: $FELIX_DATA_DIR, else ./felix-data (as scripts/run.sh).
fn local_data_dir() -> PathBuf {
    std::env::var_os("FELIX_DATA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("felix-data"))
}

fn token_choice(cli: &Cli) -> Result<Option<String>, Fail> {
    if let Some(t) = &cli.token {
        return Ok(Some(t.trim().to_string()));
    }
    if let Some((_, c)) =
        admin::active_context(&cli.context, &cli.context_file).map_err(Fail::Usage)?
    {
        if let Some(t) = c.token {
            return Ok(Some(t));
        }
    }
    let data = local_data_dir();
    for local in [
        data.join("control/admin.token"),
        data.join("auth/admin.token"),
    ] {
        match std::fs::read_to_string(&local) {
            Ok(t) => return Ok(Some(t.trim().to_string())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Fail::Usage(format!("{}: {e}", local.display()))),
        }
    }
    Ok(None)
}

async fn data_command(cli: &Cli, client: &Client) -> Result<(), Fail> {
    let json = cli.json();
    let sn = |s: &str| StreamName::new(&cli.tenant, &cli.namespace, s);
    match &cli.cmd {
        Cmd::Publish {
            stream,
            messages,
            key,
            shard,
            batch,
            no_ack,
            raw,
            delimiter,
        } => {
            let sel = match (key, shard) {
                (Some(k), _) => ShardSelector::Key(bytes::Bytes::from(k.clone().into_bytes())),
                (_, Some(s)) => ShardSelector::Shard(*s),
                _ => ShardSelector::RoundRobin,
            };
            let source = if messages.is_empty() {
                let framing = if *raw {
                    input::Framing::Whole
                } else {
                    input::Framing::Delimited(
                        input::parse_delimiter(delimiter).map_err(Fail::Usage)?,
                    )
                };
                input::Source::Stdin(framing)
            } else {
                input::Source::Args(messages.clone())
            };
            let opts = input::PublishOpts {
                batch: *batch,
                no_ack: *no_ack,
                json,
            };
            input::publish(client, &sn(stream), sel, source, opts).await
        }
        Cmd::Subscribe {
            stream,
            shard,
            from,
            policy,
            count,
            idle_exit_ms,
        } => {
            let start = match from.as_str() {
                "latest" => StartAt::Latest,
                "earliest" => StartAt::Earliest,
                n => StartAt::Offset(n.parse().map_err(|_| {
                    Fail::Usage(format!(
                        "--from must be latest, earliest or an offset, got {n:?}"
                    ))
                })?),
            };
            let policy = QueuePolicy::parse(policy).ok_or_else(|| {
                Fail::Usage(format!(
                    "--policy must be drop_new, drop_old or block, got {policy:?}"
                ))
            })?;
            let opts = SubscribeOptions {
                start,
                policy,
                ..Default::default()
            };
            subscribe(
                client,
                &sn(stream),
                *shard,
                opts,
                *count,
                *idle_exit_ms,
                json,
            )
            .await
        }
        Cmd::Admin(_) => unreachable!("handled before connecting"),
        Cmd::Group(g) => {
            let ctx = group::Ctx {
                client,
                tenant: &cli.tenant,
                namespace: &cli.namespace,
                json,
                yes: cli.yes,
            };
            group::run(g, &ctx).await
        }
        Cmd::Kv(k) => {
            let ctx = kv::Ctx {
                client,
                tenant: &cli.tenant,
                namespace: &cli.namespace,
                json,
            };
            kv::run(k, &ctx).await
        }
        Cmd::Describe { stream } => {
            let name = sn(stream);
            let i = client.describe_stream(&name).await?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({"stream": name.to_string(), "shards": i.shards, "durable": i.durable})
                );
            } else {
                print_table(
                    &["STREAM", "SHARDS", "DURABLE"],
                    vec![vec![
                        name.to_string(),
                        i.shards.to_string(),
                        i.durable.to_string(),
                    ]],
                );
            }
            Ok(())
        }
    }
}

async fn subscribe(
    client: &Client,
    name: &StreamName,
    shard: Option<u32>,
    opts: SubscribeOptions,
    count: Option<u64>,
    idle_exit_ms: Option<u64>,
    json: bool,
) -> Result<(), Fail> {
    let mut sub = match shard {
        Some(s) => client.subscribe(name, s, opts).await?,
        None => client.subscribe_stream(name, opts).await?,
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
            return Ok(());
        }
        let ev = match idle_exit_ms {
            Some(ms) => match sub.next_timeout(Duration::from_millis(ms)).await {
                Ok(ev) => ev,
                Err(_) => return Ok(()),
            },
            None => sub.next().await,
        };
        let Some(ev) = ev else {
            return Err(Fail::unreachable(
                "closed",
                "the connection to the broker ended",
            ));
        };
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
                let name = end_code_name(*code);
                let msg = format!("subscription to shard {shard} ended ({name}): {message}");
                return match *code {
                    0 => {
                        if !json {
                            eprintln!("felixctl: {msg}");
                        }
                        Ok(())
                    }
                    // The connection went away under the subscription.
                    u16::MAX => Err(Fail::unreachable(&name, msg)),
                    _ => Err(Fail::refused(&name, msg)),
                };
            }
            Event::Watch(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every subcommand, flag and positional argument has help text, and no help text states
    /// a default clap also prints (the "(default 5) [default: 0]" kind of contradiction).
    fn check(cmd: &clap::Command, path: &str, bad: &mut Vec<String>) {
        for a in cmd.get_arguments() {
            let id = a.get_id().as_str();
            if matches!(id, "help" | "version") {
                continue;
            }
            match a.get_help() {
                None => bad.push(format!("{path} {id}: no help")),
                Some(h) => {
                    let h = h.to_string();
                    if !a.get_default_values().is_empty() && h.contains("default") {
                        bad.push(format!(
                            "{path} {id}: help names a default clap also prints"
                        ));
                    }
                }
            }
        }
        for sub in cmd.get_subcommands() {
            let p = format!("{path} {}", sub.get_name());
            if sub.get_name() != "help" && sub.get_about().is_none() {
                bad.push(format!("{p}: no about"));
            }
            check(sub, &p, bad);
        }
    }

    #[test]
    fn every_subcommand_flag_and_argument_is_described() {
        let mut bad = Vec::new();
        check(&Cli::command(), "felixctl", &mut bad);
        assert!(bad.is_empty(), "undescribed:\n{}", bad.join("\n"));
    }

    /// The checker above can fail: an argument without help is reported.
    #[test]
    fn the_help_check_catches_a_bare_argument() {
        let c = clap::Command::new("x")
            .about("x")
            .arg(clap::Arg::new("bare").long("bare"));
        let mut bad = Vec::new();
        check(&c, "x", &mut bad);
        assert_eq!(bad, vec!["x bare: no help".to_string()]);
    }

    #[test]
    fn the_global_options_have_their_own_heading() {
        let c = Cli::command();
        let globals: Vec<_> = c.get_arguments().filter(|a| a.is_global_set()).collect();
        assert_eq!(globals.len(), 15, "the fifteen global options");
        assert!(globals.iter().all(|a| a.get_help_heading() == Some(GLOBAL)));
        c.debug_assert();
    }
}

//! felixctl: Felix from the command line.
//!
//! Today: `felixctl describe STREAM` over QUIC. Publish/subscribe land with the broker's
//! shard runtime; admin commands over REST with the control plane.

use clap::{Parser, Subcommand};
use felix_client::{Client, ClientConfig};
use felix_quic::tls::Verify;
use felix_quic::wire::StreamName;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(name = "felixctl", about = "Felix command-line tool")]
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
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Show a stream's shard count and durability.
    Describe { stream: String },
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let cli = Cli::parse();
    std::process::exit(run(cli).await);
}

async fn run(cli: Cli) -> i32 {
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

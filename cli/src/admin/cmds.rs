//! The admin commands' arguments (clap): what each subcommand takes, with its help text.

use super::*;

#[derive(Subcommand)]
pub enum AdminCmd {
    /// Tenants (control plane).
    Tenant {
        #[command(subcommand)]
        op: ScopeOp,
    },
    /// Namespaces of --tenant (control plane).
    Namespace {
        #[command(subcommand)]
        op: ScopeOp,
    },
    /// Streams of --tenant/--namespace (control plane).
    Stream {
        #[command(subcommand)]
        op: StreamOp,
    },
    /// Caches of --tenant/--namespace (control plane).
    Cache {
        #[command(subcommand)]
        op: CacheOp,
    },
    /// Brokers registered with the control plane.
    Node {
        #[command(subcommand)]
        op: NodeOp,
    },
    /// Shard placement.
    Shard {
        #[command(subcommand)]
        op: ShardOp,
    },
    /// Tokens the control plane issued.
    Token {
        #[command(subcommand)]
        op: crate::token::TokenOp,
    },
    /// The signing keys of the cluster's tokens.
    Key {
        #[command(subcommand)]
        op: crate::token::KeyOp,
    },
    /// Named control-plane URLs in the config file.
    Context {
        #[command(subcommand)]
        op: ContextOp,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

#[derive(Subcommand)]
pub enum ScopeOp {
    /// Create one.
    Create {
        /// Its name (1-64 bytes of A-Z a-z 0-9 _ - .).
        name: String,
        /// Free text shown by get and ls.
        #[arg(long)]
        description: Option<String>,
    },
    /// Show one.
    #[command(alias = "describe")]
    Get {
        /// Its name.
        name: String,
    },
    /// List them.
    #[command(alias = "list")]
    Ls,
    /// Change the description (`""` clears it).
    Set {
        /// Its name.
        name: String,
        /// The new description.
        #[arg(long)]
        description: Option<String>,
    },
    /// Delete one (asks first; --yes when stdin is not a terminal).
    #[command(alias = "delete")]
    Rm {
        /// Its name.
        name: String,
    },
}

#[derive(Args)]
pub struct StreamFields {
    /// Bytes kept per shard (0 = unbounded).
    #[arg(long)]
    pub(super) retention_bytes: Option<u64>,
    /// Seconds kept per shard (0 = unbounded).
    #[arg(long)]
    pub(super) retention_seconds: Option<u64>,
    /// on_commit, periodic (default) or none.
    #[arg(long)]
    pub(super) fsync: Option<String>,
    /// leader or quorum (quorum needs a control plane run with --replication-preview).
    #[arg(long)]
    pub(super) consistency: Option<String>,
    /// Replicas per shard, 1..=5 (above 1 needs a control plane run with
    /// --replication-preview).
    #[arg(long)]
    pub(super) replication_factor: Option<u32>,
}

#[derive(Subcommand)]
pub enum StreamOp {
    /// Create a stream in --tenant/--namespace.
    Create {
        /// The stream's name.
        name: String,
        /// Shard count (1-4096).
        #[arg(long, default_value_t = 1)]
        shards: u32,
        /// Keep records on disk (segment logs) rather than in memory.
        #[arg(long)]
        durable: bool,
        #[command(flatten)]
        f: StreamFields,
    },
    /// Show a stream, with its placement state.
    #[command(alias = "describe")]
    Get {
        /// The stream's name.
        name: String,
    },
    /// List the streams of --tenant/--namespace.
    #[command(alias = "list")]
    Ls,
    /// Change a stream's retention, fsync or consistency.
    Set {
        /// The stream's name.
        name: String,
        #[command(flatten)]
        f: StreamFields,
    },
    /// Delete a stream and its records (asks first; --yes when stdin is not a terminal).
    #[command(alias = "delete")]
    Rm {
        /// The stream's name.
        name: String,
    },
}

#[derive(Subcommand)]
pub enum CacheOp {
    /// Create a cache in --tenant/--namespace.
    Create {
        /// The cache's name.
        name: String,
        /// Shard count (1-4096).
        #[arg(long, default_value_t = 1)]
        shards: u32,
        /// Log-backed (kept across restarts) rather than in memory.
        #[arg(long)]
        durable: bool,
        /// TTL of a put that names none, seconds; unset: entries do not expire.
        #[arg(long)]
        ttl_seconds: Option<u64>,
    },
    /// Show a cache, with its placement state.
    #[command(alias = "describe")]
    Get {
        /// The cache's name.
        name: String,
    },
    /// List the caches of --tenant/--namespace.
    #[command(alias = "list")]
    Ls,
    /// Change a cache's default TTL.
    Set {
        /// The cache's name.
        name: String,
        /// TTL of a put that names none, seconds.
        #[arg(long)]
        ttl_seconds: Option<u64>,
    },
    /// Delete a cache and its entries (asks first; --yes when stdin is not a terminal).
    #[command(alias = "delete")]
    Rm {
        /// The cache's name.
        name: String,
    },
}

#[derive(Subcommand)]
pub enum NodeOp {
    /// List the brokers, their addresses and whether they are live.
    #[command(alias = "list")]
    Ls,
    /// Issue broker NODE_ID's node credential and print it: the broker reads it from
    /// --controlplane-token-file to register, heartbeat and follow the catalog and keys, and
    /// renews it there. With --one-time, print an enrolment token instead: the broker
    /// exchanges it once, at its first start, for the node credential.
    Enroll {
        /// The broker's node id.
        node_id: u64,
        /// Lifetime (3600, 30m, 1h, 7d) [default: the control plane's token_ttl_max_s; with
        /// --one-time, 1h].
        #[arg(long)]
        ttl: Option<String>,
        /// A one-time enrolment token rather than the credential itself.
        #[arg(long)]
        one_time: bool,
    },
}

#[derive(Subcommand)]
pub enum ShardOp {
    /// Where each shard of a stream (or, with --cache, a cache) lives.
    #[command(alias = "list")]
    Ls {
        /// The stream's (or cache's) name.
        name: String,
        /// NAME is a cache.
        #[arg(long)]
        cache: bool,
    },
    /// Promote a replica of an unavailable replicated shard that no replica qualifies for
    /// (a wiped follower and a dead leader): committed records, acknowledged ones among them,
    /// may be lost. Says what first and asks (--yes skips).
    Abandon {
        /// The stream's name.
        name: String,
        /// The shard.
        shard: u32,
        /// The replica to promote (default: the live one reported furthest ahead).
        #[arg(long)]
        to: Option<u64>,
    },
}

#[derive(Subcommand)]
pub enum ContextOp {
    /// List the contexts (* marks the current one).
    #[command(alias = "list")]
    Ls,
    /// Make NAME the current context.
    Use {
        /// The context's name.
        name: String,
    },
    /// Create or change a context: where its control plane and broker are, and the CAs that
    /// sign their certificates.
    Set {
        /// The context's name.
        name: String,
        /// Control-plane URL (http:// or https://); required for a new context.
        #[arg(long)]
        url: Option<String>,
        /// Broker QUIC address, HOST:PORT.
        #[arg(long)]
        broker: Option<String>,
        /// CA certificate (PEM) that signs the broker's certificate; kept as an absolute path.
        #[arg(long)]
        ca: Option<PathBuf>,
        /// CA certificate (PEM) that signs the control plane's HTTPS certificate; kept as an
        /// absolute path.
        #[arg(long)]
        controlplane_ca: Option<PathBuf>,
        /// Token presented to the control plane and the brokers (the file is kept 0600).
        #[arg(long)]
        token: Option<String>,
    },
}

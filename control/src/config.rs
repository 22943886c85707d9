//! `felix-controlplane` settings, in the broker's scheme: built-in defaults → a YAML file
//! (`--config`, unknown keys and wrong types refused with key, line and column) → `FELIX_*`
//! environment → command-line flags. clap resolves flag-over-env-over-default and tells which
//! one a value came from; the YAML layer fills what came from a default.

use crate::catalog::Limits;
use clap::{Parser, ValueEnum};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoreKind {
    Memory,
    Raft,
}

#[derive(Debug, Clone, Parser, serde::Serialize)]
#[command(
    name = "felix-controlplane",
    about = "Felix control plane (REST + metadata store)",
    version = concat!(env!("CARGO_PKG_VERSION"), " (git ", env!("FELIX_GIT_REV"), ")")
)]
pub struct Config {
    /// YAML configuration file (the same keys, snake_case).
    #[arg(long, env = "FELIX_CONTROLPLANE_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Print the effective configuration as JSON and exit.
    #[arg(long)]
    #[serde(skip)]
    pub print_config: bool,
    /// Log line format on stderr: text or json (filters from FELIX_LOG).
    #[arg(long, env = "FELIX_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// REST listener (also carries the Raft RPCs between members).
    #[arg(
        long,
        env = "FELIX_CONTROLPLANE_LISTEN",
        default_value = "127.0.0.1:7410"
    )]
    pub listen: SocketAddr,
    /// Metadata store; default `raft` when a Raft data dir is given, else `memory`.
    #[arg(long, env = "FELIX_CONTROLPLANE_STORE", value_enum)]
    pub store: Option<StoreKind>,

    /// This member's Raft node id (1..).
    #[arg(long, env = "FELIX_RAFT_NODE_ID", default_value_t = 1)]
    pub raft_node_id: u64,
    /// Directory for the Raft log, vote and snapshot.
    #[arg(long, env = "FELIX_RAFT_DATA_DIR")]
    pub raft_data_dir: Option<PathBuf>,
    /// Members as `id=host:port,...` (their REST listeners), this member included. Empty: a
    /// single-member group of this node at `--listen`.
    #[arg(long, env = "FELIX_RAFT_PEERS", default_value = "")]
    pub raft_peers: String,
    #[arg(long, env = "FELIX_RAFT_HEARTBEAT_MS", default_value_t = 100)]
    pub raft_heartbeat_ms: u64,
    #[arg(long, env = "FELIX_RAFT_ELECTION_MIN_MS", default_value_t = 600)]
    pub raft_election_min_ms: u64,
    #[arg(long, env = "FELIX_RAFT_ELECTION_MAX_MS", default_value_t = 1200)]
    pub raft_election_max_ms: u64,
    /// Take a snapshot (and purge the log behind it) after this many applied entries.
    #[arg(long, env = "FELIX_RAFT_SNAPSHOT_LOGS", default_value_t = 2000)]
    pub raft_snapshot_logs: u64,
    /// Per-RPC timeout between members.
    #[arg(long, env = "FELIX_RAFT_RPC_TIMEOUT_MS", default_value_t = 1000)]
    pub raft_rpc_timeout_ms: u64,

    /// How often brokers are told to heartbeat.
    #[arg(
        long,
        env = "FELIX_CONTROLPLANE_HEARTBEAT_INTERVAL_MS",
        default_value_t = 1000
    )]
    pub heartbeat_interval_ms: u64,
    /// A broker silent this long is counted dead.
    #[arg(long, env = "FELIX_CONTROLPLANE_DEAD_AFTER_MS", default_value_t = 5000)]
    pub dead_after_ms: u64,
    /// A broker counted dead this long is replaced in the replica sets of replicated shards
    /// (one replica at a time per shard, by a live broker outside the set; the new replica
    /// catches up from the leader). 0: never. Counted from when the control plane's leader
    /// saw it dead; a new leader counts again.
    #[arg(
        long,
        env = "FELIX_CONTROLPLANE_REPLICA_REPLACE_AFTER_MS",
        default_value_t = 300_000
    )]
    pub replica_replace_after_ms: u64,
    /// A deleted stream/cache is removed once every live broker reported a catalog revision
    /// past the delete, or after this long at the latest.
    #[arg(
        long,
        env = "FELIX_CONTROLPLANE_DELETE_GRACE_MS",
        default_value_t = 10_000
    )]
    pub delete_grace_ms: u64,
    /// The placement settle window, milliseconds: a new cluster places no shard until this
    /// long after its first broker registered, so brokers started together share the shards
    /// instead of the first taking them all. 0: place at once (one broker).
    #[arg(long, env = "FELIX_PLACEMENT_SETTLE_MS", default_value_t = 10_000)]
    pub placement_settle_ms: u64,
    /// Period of the leader's sweep (liveness, delete completion).
    #[arg(
        long,
        env = "FELIX_CONTROLPLANE_SWEEP_INTERVAL_MS",
        default_value_t = 200
    )]
    pub sweep_interval_ms: u64,
    /// Longest `wait_ms` a changes long-poll may ask for.
    #[arg(long, env = "FELIX_CONTROLPLANE_MAX_WAIT_MS", default_value_t = 30_000)]
    pub max_wait_ms: u64,
    /// Most changes in one feed answer.
    #[arg(
        long,
        env = "FELIX_CONTROLPLANE_CHANGES_PAGE_MAX",
        default_value_t = 1000
    )]
    pub changes_page_max: usize,
    /// Largest accepted request body.
    #[arg(
        long,
        env = "FELIX_CONTROLPLANE_MAX_BODY_BYTES",
        default_value_t = 65_536
    )]
    pub max_body_bytes: usize,
    /// How long a write waits for the store (commit, or the leader when forwarded).
    #[arg(
        long,
        env = "FELIX_CONTROLPLANE_WRITE_TIMEOUT_MS",
        default_value_t = 5000
    )]
    pub write_timeout_ms: u64,

    /// Changes kept for the feed.
    #[arg(
        long,
        env = "FELIX_CONTROLPLANE_CHANGE_LOG_LEN",
        default_value_t = 10_000
    )]
    pub change_log_len: usize,
    #[arg(long, env = "FELIX_CONTROLPLANE_MAX_SHARDS", default_value_t = 4096)]
    pub max_shards: u32,
    /// Tenants + namespaces + streams + caches.
    #[arg(
        long,
        env = "FELIX_CONTROLPLANE_MAX_OBJECTS",
        default_value_t = 100_000
    )]
    pub max_objects: usize,
    #[arg(long, env = "FELIX_CONTROLPLANE_MAX_BROKERS", default_value_t = 1024)]
    pub max_brokers: usize,
    /// Shutdown budget: long polls are answered at once, requests in flight get this long to
    /// finish; past it (or on a second signal) the process exits with code 3.
    #[arg(
        long,
        env = "FELIX_CONTROLPLANE_DRAIN_TIMEOUT_MS",
        default_value_t = 5000
    )]
    pub drain_timeout_ms: u64,

    /// Bearer tokens on the REST API: `on` (default) or `off`. Off lets anyone who reaches
    /// the port change everything, and logs a warning at every start.
    #[arg(
        long,
        env = "FELIX_CONTROLPLANE_AUTH",
        value_enum,
        default_value = "on"
    )]
    pub auth: AuthSwitch,
    /// Where the bootstrap admin token is written (mode 0600). Default: `admin.token` in the
    /// Raft data dir. The memory store has no data dir, so with auth on it needs this.
    #[arg(long, env = "FELIX_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// Lifetime of the bootstrap admin token, seconds (from the first start).
    #[arg(long, env = "FELIX_ADMIN_TOKEN_TTL_S", default_value_t = 365 * 24 * 3600)]
    pub admin_token_ttl_s: u64,
    /// Longest lifetime `POST /v1/tokens` grants, seconds.
    #[arg(long, env = "FELIX_TOKEN_TTL_MAX_S", default_value_t = 90 * 24 * 3600)]
    pub token_ttl_max_s: u64,
    /// Unexpired issued tokens the register keeps (what `token ls` lists); past it, issuing
    /// refuses until tokens expire.
    #[arg(long, env = "FELIX_AUTH_TOKENS_MAX", default_value_t = 10_000)]
    pub auth_tokens_max: usize,
    /// Revocations in force at once (each is kept until every token it covers has expired);
    /// past it, revoking refuses. Rotating the signing key retires many tokens at once.
    #[arg(long, env = "FELIX_AUTH_REVOCATIONS_MAX", default_value_t = 10_000)]
    pub auth_revocations_max: usize,
    /// A file holding the secret every Raft member sends on the member protocol (`/raft/*`,
    /// `/internal/v1/{identity,assign,rejoin}`): 32..=1024 visible ASCII bytes, the same on
    /// every member (`openssl rand -hex 32`). Needed with auth on and more than one member.
    #[arg(long, env = "FELIX_MEMBER_SECRET_FILE")]
    pub member_secret_file: Option<PathBuf>,
    /// Serve `/metrics` without a token (for a scraper on a trusted network). Default: it
    /// needs a token with `cluster.admin` on `metrics`.
    #[arg(long, env = "FELIX_METRICS_PUBLIC", default_value_t = false)]
    pub metrics_public: bool,
    /// Accept streams of more than one copy and `consistency: quorum`, and place them:
    /// replica sets, leaders, promotion, leaders' reports, replacing a replica whose broker
    /// stays dead. Brokers replicate their shards and serve publishes and subscriptions on the
    /// leader; consumer groups on replicated streams are not built yet, and the quorum ingest
    /// rate is below its target, so it is a preview, off by default. Give every Raft member
    /// the same value.
    #[arg(long, env = "FELIX_REPLICATION_PREVIEW", default_value_t = false)]
    pub replication_preview: bool,

    /// HTTPS on the REST listener (which also carries the member protocol): `on` or `off`.
    /// On without `--tls-cert-file`: a development CA and certificate (for `localhost` and
    /// the loopback addresses) are made once under `tls/` in the Raft data dir (or beside the
    /// admin token file); clients trust `tls/ca.pem`.
    #[arg(long, env = "FELIX_CONTROLPLANE_TLS", value_enum, default_value = "on")]
    pub tls: TlsSwitch,
    /// The server's certificate chain (PEM, leaf first), with `--tls on`.
    #[arg(long, env = "FELIX_CONTROLPLANE_TLS_CERT_FILE")]
    pub tls_cert_file: Option<PathBuf>,
    /// The server certificate's private key (PEM), with `--tls-cert-file`.
    #[arg(long, env = "FELIX_CONTROLPLANE_TLS_KEY_FILE")]
    pub tls_key_file: Option<PathBuf>,
    /// The CA (PEM) this member trusts when it calls the other members [default: the
    /// development CA when the development certificate is served, else the system's roots].
    #[arg(long, env = "FELIX_CONTROLPLANE_TLS_CA_FILE")]
    pub tls_ca_file: Option<PathBuf>,
    /// A connection whose TLS handshake has not finished by then is closed.
    #[arg(
        long,
        env = "FELIX_CONTROLPLANE_TLS_HANDSHAKE_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    pub tls_handshake_timeout_ms: u64,
    /// TLS handshakes in progress at once; past it, new connections wait to be accepted.
    #[arg(
        long,
        env = "FELIX_CONTROLPLANE_TLS_HANDSHAKES_MAX",
        default_value_t = 1024
    )]
    pub tls_handshakes_max: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TlsSwitch {
    On,
    Off,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuthSwitch {
    On,
    Off,
}

/// The YAML layer: `plain` keys are plain fields, `opt` keys fields that are `Option`s.
macro_rules! file_layer {
    (plain { $($p:ident: $pt:ty,)* } opt { $($o:ident: $ot:ty,)* }) => {
        #[derive(Debug, Default, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct FileConfig {
            $( $p: Option<$pt>, )*
            $( $o: Option<$ot>, )*
        }

        /// Every key the file may set.
        pub const FILE_KEYS: &[&str] = &[$(stringify!($p),)* $(stringify!($o),)*];

        fn apply_file(cfg: &mut Config, m: &clap::ArgMatches, f: FileConfig) {
            use clap::parser::ValueSource;
            let unset = |id: &str| {
                !matches!(
                    m.value_source(id),
                    Some(ValueSource::CommandLine | ValueSource::EnvVariable)
                )
            };
            $( if let Some(v) = f.$p { if unset(stringify!($p)) { cfg.$p = v; } } )*
            $( if let Some(v) = f.$o { if unset(stringify!($o)) { cfg.$o = Some(v); } } )*
        }
    };
}

file_layer! {
    plain {
        log_format: LogFormat,
        listen: SocketAddr,
        raft_node_id: u64,
        raft_peers: String,
        raft_heartbeat_ms: u64,
        raft_election_min_ms: u64,
        raft_election_max_ms: u64,
        raft_snapshot_logs: u64,
        raft_rpc_timeout_ms: u64,
        heartbeat_interval_ms: u64,
        dead_after_ms: u64,
        replica_replace_after_ms: u64,
        delete_grace_ms: u64,
        placement_settle_ms: u64,
        sweep_interval_ms: u64,
        max_wait_ms: u64,
        changes_page_max: usize,
        max_body_bytes: usize,
        write_timeout_ms: u64,
        change_log_len: usize,
        max_shards: u32,
        max_objects: usize,
        max_brokers: usize,
        drain_timeout_ms: u64,
        auth: AuthSwitch,
        admin_token_ttl_s: u64,
        token_ttl_max_s: u64,
        auth_tokens_max: usize,
        auth_revocations_max: usize,
        metrics_public: bool,
        replication_preview: bool,
        tls: TlsSwitch,
        tls_handshake_timeout_ms: u64,
        tls_handshakes_max: usize,
    }
    opt {
        store: StoreKind,
        raft_data_dir: PathBuf,
        admin_token_file: PathBuf,
        member_secret_file: PathBuf,
        tls_cert_file: PathBuf,
        tls_key_file: PathBuf,
        tls_ca_file: PathBuf,
    }
}

impl Config {
    /// Defaults, as if started with no flags and no environment.
    pub fn defaults() -> Self {
        Config::parse_from(["felix-controlplane"])
    }

    /// Flags and environment from `args`, with the YAML file of `--config` under them.
    pub fn load_from<I, T>(args: I) -> Result<Config, String>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        use clap::{CommandFactory, FromArgMatches};
        let m = Config::command().try_get_matches_from(args).map_err(|e| {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                e.exit(); // --help / --version print and exit 0, as clap does
            }
            e.to_string()
        })?;
        let mut cfg = Config::from_arg_matches(&m).map_err(|e| e.to_string())?;
        if let Some(p) = cfg.config.clone() {
            let text =
                std::fs::read_to_string(&p).map_err(|e| format!("config {}: {e}", p.display()))?;
            let f: FileConfig = serde_saphyr::from_str(&text)
                .map_err(|e| format!("config {}: {e}", p.display()))?;
            apply_file(&mut cfg, &m, f);
        }
        Ok(cfg)
    }

    /// Where the admin token goes, if anywhere.
    pub fn admin_token_path(&self) -> Option<PathBuf> {
        self.admin_token_file
            .clone()
            .or_else(|| self.raft_data_dir.as_ref().map(|d| d.join("admin.token")))
    }

    /// Where the development TLS files live: `tls/` in the Raft data dir, else beside the
    /// admin token file.
    pub fn tls_dir(&self) -> Option<PathBuf> {
        self.raft_data_dir
            .as_ref()
            .map(|d| d.join("tls"))
            .or_else(|| {
                self.admin_token_file
                    .as_ref()
                    .and_then(|f| f.parent())
                    .map(|d| d.join("tls"))
            })
    }

    /// The scheme of this control plane's URLs (and of the other members').
    pub fn scheme(&self) -> &'static str {
        match self.tls {
            TlsSwitch::On => "https",
            TlsSwitch::Off => "http",
        }
    }

    /// The CA a member trusts when it calls the others, if not only the system's roots.
    pub fn member_ca(&self) -> Option<PathBuf> {
        if self.tls == TlsSwitch::Off {
            return None;
        }
        self.tls_ca_file.clone().or_else(|| {
            if self.tls_cert_file.is_none() {
                self.tls_dir().map(|d| d.join("ca.pem"))
            } else {
                None
            }
        })
    }

    fn check_tls(&self) -> Result<(), String> {
        let files = self.tls_cert_file.is_some() || self.tls_key_file.is_some();
        match self.tls {
            TlsSwitch::Off if files || self.tls_ca_file.is_some() => Err(
                "--tls-cert-file, --tls-key-file and --tls-ca-file need --tls on".into(),
            ),
            TlsSwitch::On
                if self.tls_cert_file.is_some() != self.tls_key_file.is_some() =>
            {
                Err("--tls-cert-file and --tls-key-file go together".into())
            }
            TlsSwitch::On if !files && self.tls_dir().is_none() => Err("--tls on without --tls-cert-file makes a development certificate, which needs a directory: set --raft-data-dir or --admin-token-file, give --tls-cert-file and --tls-key-file, or serve plain HTTP with --tls off".into()),
            TlsSwitch::On
                if self.tls_handshake_timeout_ms == 0 || self.tls_handshakes_max == 0 =>
            {
                Err("tls_handshake_timeout_ms and tls_handshakes_max must be above 0".into())
            }
            _ => Ok(()),
        }
    }

    /// Settings that cannot work together, refused at start.
    pub fn check(&self) -> Result<(), String> {
        self.check_tls()?;
        if self.auth == AuthSwitch::On && self.admin_token_path().is_none() {
            return Err("auth is on but there is nowhere to write the admin token: set --admin-token-file (or --raft-data-dir), or --auth off".into());
        }
        let members = self.peers().map(|p| p.len()).unwrap_or(1);
        if self.auth == AuthSwitch::On
            && self.store_kind() == StoreKind::Raft
            && members > 1
            && self.member_secret_file.is_none()
        {
            return Err(format!("auth is on and the Raft group has {members} members, so the member protocol needs a shared secret: set --member-secret-file (FELIX_MEMBER_SECRET_FILE) to the same file on every member (`openssl rand -hex 32`), or --auth off"));
        }
        if self.auth_tokens_max == 0
            || self.auth_revocations_max == 0
            || self.token_ttl_max_s == 0
            || self.admin_token_ttl_s == 0
        {
            return Err(
                "auth_tokens_max, auth_revocations_max, token_ttl_max_s and admin_token_ttl_s must be above 0".into(),
            );
        }
        Ok(())
    }

    pub fn store_kind(&self) -> StoreKind {
        self.store.unwrap_or(if self.raft_data_dir.is_some() {
            StoreKind::Raft
        } else {
            StoreKind::Memory
        })
    }

    pub fn limits(&self) -> Limits {
        Limits {
            max_shards: self.max_shards,
            max_objects: self.max_objects,
            max_brokers: self.max_brokers,
            change_log_len: self.change_log_len,
            replication_preview: self.replication_preview,
            ..Limits::default()
        }
    }

    pub fn write_timeout(&self) -> Duration {
        Duration::from_millis(self.write_timeout_ms)
    }

    /// Parse `FELIX_RAFT_PEERS`; this node is added at `--listen` if absent.
    pub fn peers(&self) -> Result<BTreeMap<u64, String>, String> {
        let mut m = BTreeMap::new();
        for part in self
            .raft_peers
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
        {
            let (id, addr) = part
                .split_once('=')
                .ok_or_else(|| format!("FELIX_RAFT_PEERS entry {part:?} is not id=host:port"))?;
            let id: u64 = id
                .trim()
                .parse()
                .map_err(|_| format!("FELIX_RAFT_PEERS id {id:?} is not a number"))?;
            if id == 0 || id > u32::MAX as u64 {
                return Err(format!("FELIX_RAFT_PEERS id {id} must be 1..={}", u32::MAX));
            }
            crate::catalog::check_addr(addr.trim()).map_err(|e| e.message)?;
            if m.insert(id, addr.trim().to_string()).is_some() {
                return Err(format!("FELIX_RAFT_PEERS names {id} twice"));
            }
        }
        m.entry(self.raft_node_id)
            .or_insert_with(|| self.listen.to_string());
        Ok(m)
    }
}

/// The control plane's settings table in docs/operations.md, rendered from the clap
/// declarations (checked by a test).
pub fn operations_table() -> String {
    use clap::CommandFactory;
    let mut out = String::from(
        "| flag | environment | YAML key | default | meaning |\n|---|---|---|---|---|\n",
    );
    for a in Config::command().get_arguments() {
        let Some(long) = a.get_long() else { continue };
        if long == "help" || long == "version" {
            continue;
        }
        let env = a
            .get_env()
            .map_or_else(|| "–".into(), crate::docs::env_cell);
        let defaults: Vec<String> = a
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().to_string())
            .collect();
        let default = match defaults.as_slice() {
            [] => "unset".to_string(),
            [d] if d.is_empty() => "empty".to_string(),
            ds => format!("`{}`", ds.join(",")),
        };
        let help = a
            .get_help()
            .map(|h| crate::docs::table_cell(&h.to_string()))
            .unwrap_or_default();
        let key = long.replace('-', "_");
        let yaml = if FILE_KEYS.contains(&key.as_str()) {
            format!("`{key}`")
        } else {
            "–".to_string()
        };
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
    fn the_file_layer_covers_every_setting() {
        use clap::CommandFactory;
        for a in Config::command().get_arguments() {
            let id = a.get_id().as_str();
            if ["config", "print_config", "help", "version"].contains(&id) {
                continue;
            }
            assert!(
                FILE_KEYS.contains(&id),
                "{id} cannot be set from the YAML file"
            );
        }
    }

    #[test]
    fn precedence_defaults_file_env_flags_and_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("cp.yaml");
        std::fs::write(
            &p,
            "max_shards: 16\nmax_brokers: 7\nstore: memory\nraft_data_dir: /tmp/x\n",
        )
        .unwrap();
        let path = p.to_str().unwrap();
        // The file fills what came from a default; a flag wins over it.
        let c = Config::load_from(["cp", "--config", path, "--max-brokers", "9"]).unwrap();
        assert_eq!((c.max_shards, c.max_brokers), (16, 9));
        assert_eq!(c.store, Some(StoreKind::Memory));
        assert_eq!(c.raft_data_dir, Some(PathBuf::from("/tmp/x")));
        assert_eq!(
            c.max_objects,
            Config::defaults().max_objects,
            "untouched keys keep defaults"
        );
        // Environment over the file (nextest runs each test in its own process).
        std::env::set_var("FELIX_CONTROLPLANE_MAX_SHARDS", "32");
        let c = Config::load_from(["cp", "--config", path]).unwrap();
        std::env::remove_var("FELIX_CONTROLPLANE_MAX_SHARDS");
        assert_eq!(c.max_shards, 32);
        // Unknown keys and wrong types name the key, line and column.
        std::fs::write(&p, "max_shards: 4\nbogus: 1\n").unwrap();
        let e = Config::load_from(["cp", "--config", path]).unwrap_err();
        assert!(e.contains("bogus") && e.contains("line 2"), "{e}");
        std::fs::write(&p, "max_shards: 4\nmax_brokers: many\n").unwrap();
        let e = Config::load_from(["cp", "--config", path]).unwrap_err();
        assert!(e.contains("line 2"), "{e}");
        let e = Config::load_from(["cp", "--config", "/nonexistent/cp.yaml"]).unwrap_err();
        assert!(e.contains("/nonexistent/cp.yaml"), "{e}");
    }

    #[test]
    fn a_raft_group_with_auth_on_needs_the_member_secret() {
        let three = [
            "cp",
            "--raft-data-dir",
            "/tmp/x",
            "--raft-node-id",
            "1",
            "--raft-peers",
            "1=127.0.0.1:1,2=127.0.0.1:2,3=127.0.0.1:3",
        ];
        let e = Config::load_from(three).unwrap().check().unwrap_err();
        assert!(e.contains("--member-secret-file"), "{e}");
        let with: Vec<&str> = three
            .iter()
            .copied()
            .chain(["--member-secret-file", "/tmp/s"])
            .collect();
        assert_eq!(Config::load_from(with).unwrap().check(), Ok(()));
        let off: Vec<&str> = three.iter().copied().chain(["--auth", "off"]).collect();
        assert_eq!(Config::load_from(off).unwrap().check(), Ok(()));
        // A single member has no peer to authenticate.
        let one = ["cp", "--raft-data-dir", "/tmp/x"];
        assert_eq!(Config::load_from(one).unwrap().check(), Ok(()));
    }

    #[test]
    fn operations_doc_lists_every_setting() {
        let p = std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/operations.md"
        ));
        crate::docs::check_doc_block(p, "controlplane-settings", &super::operations_table())
            .unwrap();
    }
}

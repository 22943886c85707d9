//! Broker configuration: built-in defaults → YAML file (`--config`) → `FELIX_*` environment →
//! command-line flags. clap resolves flag-over-env; the YAML layer fills what neither set.

use clap::Parser;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Command-line flags (each also readable from its `FELIX_*` variable).
#[derive(Debug, Clone, Parser, Default)]
#[command(name = "felix-broker", about = "Felix thread-per-core broker")]
pub struct Flags {
    /// YAML configuration file.
    #[arg(long, env = "FELIX_CONFIG")]
    pub config: Option<PathBuf>,
    /// QUIC listen address (UDP).
    #[arg(long, env = "FELIX_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// HTTP address for /metrics, /livez, /readyz (port 0 picks a free port).
    #[arg(long, env = "FELIX_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Number of cores (executors) to run; default all online.
    #[arg(long, env = "FELIX_CORES")]
    pub cores: Option<usize>,
    /// Data directory (dev TLS certificate lives in `<data-dir>/tls`).
    #[arg(long, env = "FELIX_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Stream catalog file (YAML).
    #[arg(long, env = "FELIX_CATALOG")]
    pub catalog: Option<PathBuf>,
    /// TLS certificate chain (PEM); with --tls-key. Default: generated dev certificate.
    #[arg(long, env = "FELIX_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// TLS private key (PEM).
    #[arg(long, env = "FELIX_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Largest accepted frame (header + body), bytes.
    #[arg(long, env = "FELIX_MAX_FRAME_BYTES")]
    pub max_frame_bytes: Option<usize>,
    /// Connection idle timeout, milliseconds.
    #[arg(long, env = "FELIX_IDLE_TIMEOUT_MS")]
    pub idle_timeout_ms: Option<u64>,
    /// glommio io_memory per executor, bytes (memlock is 8 MiB on this kind of machine).
    #[arg(long, env = "FELIX_IO_MEMORY_BYTES")]
    pub io_memory_bytes: Option<usize>,
    /// Print the effective configuration and exit.
    #[arg(long)]
    pub print_config: bool,
}

/// The YAML file: the same keys, snake_case; unknown keys are refused.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub listen: Option<SocketAddr>,
    pub metrics_listen: Option<SocketAddr>,
    pub cores: Option<usize>,
    pub data_dir: Option<PathBuf>,
    pub catalog: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub max_frame_bytes: Option<usize>,
    pub idle_timeout_ms: Option<u64>,
    pub io_memory_bytes: Option<usize>,
}

/// The effective configuration.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Config {
    pub listen: SocketAddr,
    pub metrics_listen: SocketAddr,
    pub cores: usize,
    pub data_dir: PathBuf,
    pub catalog: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub max_frame_bytes: usize,
    pub idle_timeout_ms: u64,
    pub io_memory_bytes: usize,
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
        let online = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        let c = Config {
            listen: flags
                .listen
                .or(file.listen)
                .unwrap_or_else(|| "127.0.0.1:7400".parse().unwrap()),
            metrics_listen: flags
                .metrics_listen
                .or(file.metrics_listen)
                .unwrap_or_else(|| "127.0.0.1:7401".parse().unwrap()),
            cores: flags.cores.or(file.cores).unwrap_or(online),
            data_dir: flags
                .data_dir
                .clone()
                .or(file.data_dir)
                .unwrap_or_else(|| PathBuf::from("felix-data")),
            catalog: flags.catalog.clone().or(file.catalog),
            tls_cert: flags.tls_cert.clone().or(file.tls_cert),
            tls_key: flags.tls_key.clone().or(file.tls_key),
            max_frame_bytes: flags
                .max_frame_bytes
                .or(file.max_frame_bytes)
                .unwrap_or(felix_quic::wire::DEFAULT_MAX_FRAME_BYTES),
            idle_timeout_ms: flags
                .idle_timeout_ms
                .or(file.idle_timeout_ms)
                .unwrap_or(30_000),
            io_memory_bytes: flags
                .io_memory_bytes
                .or(file.io_memory_bytes)
                .unwrap_or(1 << 20),
        };
        if c.cores == 0 || c.cores > 255 {
            return Err(format!("cores must be 1..=255, got {}", c.cores));
        }
        if c.tls_cert.is_some() != c.tls_key.is_some() {
            return Err("tls_cert and tls_key must be set together".into());
        }
        if c.max_frame_bytes < 1024 {
            return Err(format!(
                "max_frame_bytes must be at least 1024, got {}",
                c.max_frame_bytes
            ));
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

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}

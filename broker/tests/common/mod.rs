//! Shared harness for the broker's integration tests: the real `felix-broker` binary on
//! loopback (random ports, temp data dir), killed when dropped.
#![allow(dead_code)]

pub mod cluster;
pub mod cp;
pub mod raw;
pub mod replicated;
pub mod serving;

use felix_client::{Client, ClientConfig};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub struct Broker {
    child: Child,
    pub quic: SocketAddr,
    pub metrics: SocketAddr,
    /// The peer listener, when started with `--peer-listen`.
    pub peer: Option<SocketAddr>,
    pub dir: tempfile::TempDir,
    /// The bearer `/metrics` is read with (auth on); unset, a standalone broker's own admin
    /// token from its data dir.
    pub metrics_token: std::sync::Mutex<Option<String>>,
    /// The bearer token [`Broker::client_config`] gives clients (a broker with auth on).
    pub client_token: std::sync::Mutex<Option<String>>,
    /// Its `felix::serving` log lines (`serving.rs`).
    pub serving: serving::Lines,
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Broker {
    /// Start a broker with `cores` executors and extra flags.
    pub fn start(cores: usize, extra: &[&str]) -> Broker {
        Broker::start_in(tempfile::tempdir().unwrap(), cores, extra)
    }

    /// Start a broker on an existing data directory (a restart).
    pub fn start_in(dir: tempfile::TempDir, cores: usize, extra: &[&str]) -> Broker {
        Broker::try_start_in(dir, cores, extra).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Two cores, and a catalog declaring cache `default/default/one` with one shard.
    pub fn start_with_cache_one() -> Broker {
        let dir = tempfile::tempdir().unwrap();
        let cat = dir.path().join("catalog.yaml");
        std::fs::write(
            &cat,
            "caches:\n  - {tenant: default, namespace: default, cache: one, shards: 1}\n",
        )
        .unwrap();
        let cat = cat.display().to_string();
        Broker::start_in(dir, 2, &["--catalog", &cat])
    }

    /// SIGKILL the broker (no shutdown path runs) and hand back its data directory.
    pub fn kill(mut self) -> tempfile::TempDir {
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap())
    }

    /// Send `sig` (e.g. `libc::SIGTERM`) to the broker process.
    pub fn signal(&self, sig: i32) {
        let pid = self.child.id();
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(pid as i32, sig) };
        if sig == libc::SIGSTOP {
            // kill(2) returns once the stop is queued, not once every thread has stopped:
            // wait (bounded) until they all have, so that nothing the test sends next is
            // served by a thread still running (a forward answered by a "frozen" broker).
            wait_all_threads_stopped(pid, Duration::from_secs(5));
        }
    }

    /// Wait (bounded) for the broker to exit by itself; its exit code and data directory.
    pub fn wait_exit(mut self, timeout: Duration) -> (Option<i32>, tempfile::TempDir) {
        let deadline = std::time::Instant::now() + timeout;
        let code = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st.code();
            }
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        (
            code,
            std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap()),
        )
    }

    /// Start, or the broker's exit status and stderr if it exits instead of becoming ready.
    pub fn try_start_in(
        dir: tempfile::TempDir,
        cores: usize,
        extra: &[&str],
    ) -> Result<Broker, String> {
        Broker::try_start_env(dir, cores, extra, &[])
    }

    /// Start with extra environment variables too.
    pub fn try_start_env(
        dir: tempfile::TempDir,
        cores: usize,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Broker, String> {
        let child = Command::new(env!("CARGO_BIN_EXE_felix-broker"))
            .args([
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--cores",
                &cores.to_string(),
            ])
            .arg("--data-dir")
            .arg(dir.path())
            .args(extra)
            .env("RUST_LOG", broker_log())
            // The suites test the data path; tests/auth.rs and the cluster's auth test run
            // with auth on (a test's `--auth` flag beats this).
            .env("FELIX_AUTH", "off")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start felix-broker");
        Broker::wait_ready(child, dir)
    }

    /// Start the broker under a wrapper command (e.g. `["taskset", "-c", "1"]`), with no
    /// `--cores` unless `extra` gives it: loopback on random ports, a temp data dir.
    pub fn try_start_with_prefix(prefix: &[&str], extra: &[&str]) -> Result<Broker, String> {
        let dir = tempfile::tempdir().unwrap();
        let child = Command::new(prefix[0])
            .args(&prefix[1..])
            .arg(env!("CARGO_BIN_EXE_felix-broker"))
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .arg("--data-dir")
            .arg(dir.path())
            .args(extra)
            .env("RUST_LOG", broker_log())
            .env("FELIX_AUTH", "off")
            .env_remove("FELIX_CORES")
            .env_remove("FELIX_CPU_LIST")
            .env_remove("FELIX_CONFIG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", prefix[0]));
        Broker::wait_ready(child, dir)
    }

    /// Wait (bounded) for the ready line; the exit status and stderr if the broker exits.
    fn wait_ready(mut child: Child, dir: tempfile::TempDir) -> Result<Broker, String> {
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let sink = stderr.clone();
        let serving = serving::Lines::default();
        let served = serving.clone();
        std::thread::spawn(move || {
            // Keep draining (and echoing) stderr so the broker never blocks on a full pipe.
            let mut line = Vec::new();
            while let Ok(n) = err.read_until(b'\n', &mut line) {
                if n == 0 {
                    break;
                }
                let text = String::from_utf8_lossy(&line).into_owned();
                line.clear();
                if text.contains("felix::serving") {
                    let mut v = served.lock().unwrap();
                    if v.len() < serving::LINES_MAX {
                        v.push(text.trim_end().to_string());
                    }
                }
                eprint!("{text}");
                let mut s = sink.lock().unwrap();
                if s.len() < 64 << 10 {
                    s.push_str(&text);
                }
            }
        });
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let line = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(l) => l,
            Err(_) => {
                let status = child.wait().ok();
                std::thread::sleep(Duration::from_millis(50));
                return Err(format!(
                    "broker did not become ready (exit {:?}): {}",
                    status.and_then(|s| s.code()),
                    stderr.lock().unwrap()
                ));
            }
        };
        let field = |k: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(k))
                .expect("ready line field")
                .parse()
                .unwrap()
        };
        let peer = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("peer="))
            .map(|p| p.parse().expect("peer address"));
        Ok(Broker {
            quic: field("quic="),
            metrics: field("metrics="),
            peer,
            child,
            dir,
            metrics_token: std::sync::Mutex::new(None),
            client_token: std::sync::Mutex::new(None),
            serving,
        })
    }

    /// `felixctl --broker <this> --ca <its cert>`, built beside the broker by
    /// `cargo build --workspace`; stdin is closed (destructive commands need `--yes`).
    pub fn felixctl_cmd(&self) -> Command {
        let exe =
            std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker")).with_file_name("felixctl");
        let mut c = Command::new(exe);
        // Hermetic: never the user's own felixctl context (a local cluster writes one).
        c.args(["--broker", &self.quic.to_string()])
            .arg("--ca")
            .arg(self.ca())
            .env_remove("FELIX_CONTEXT")
            .env(
                "FELIX_CONTEXT_FILE",
                self.dir.path().join("no-context.json"),
            )
            .stdin(Stdio::null());
        c
    }

    /// Run felixctl against this broker.
    pub fn felixctl(&self, args: &[&str]) -> std::process::Output {
        self.felixctl_cmd()
            .args(args)
            .output()
            .expect("felixctl built alongside (cargo build --workspace)")
    }

    /// The broker process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The generated dev certificate (the CA clients trust).
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("tls/dev-cert.pem")
    }

    pub fn client_config(&self) -> ClientConfig {
        let mut cfg = ClientConfig::new(self.quic, Some(self.ca()));
        cfg.token = self.client_token.lock().unwrap().clone();
        cfg
    }

    pub async fn client(&self) -> Client {
        Client::connect(self.client_config())
            .await
            .expect("connect")
    }

    /// A client that does not ask for the watch mux (one stream per watch).
    pub async fn client_without_mux(&self) -> Client {
        let mut cfg = self.client_config();
        cfg.watch_mux = false;
        Client::connect(cfg).await.expect("connect")
    }

    /// GET a path from the ops listener; the whole HTTP response.
    pub fn http_get(&self, path: &str) -> String {
        let token = self.metrics_token.lock().unwrap().clone().or_else(|| {
            std::fs::read_to_string(self.dir.path().join("auth/admin.token"))
                .ok()
                .map(|t| t.trim().to_string())
        });
        self.http_get_as(path, token.as_deref())
    }

    /// GET `path` from the ops listener with `token` as the bearer, if any.
    pub fn http_get_as(&self, path: &str, token: Option<&str>) -> String {
        let auth = token
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        let mut s = std::net::TcpStream::connect(self.metrics).unwrap();
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n").as_bytes())
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    /// Per-core counters: `name → [core 0 value, core 1 value, ...]`.
    pub fn counters(&self) -> HashMap<String, Vec<u64>> {
        let mut m: HashMap<String, Vec<u64>> = HashMap::new();
        for line in self.http_get("/metrics").lines() {
            let Some(rest) = line.strip_prefix("felix_") else {
                continue;
            };
            let Some((name, rest)) = rest.split_once("{core=\"") else {
                continue;
            };
            let Some((core, value)) = rest.split_once("\"} ") else {
                continue;
            };
            // Counters only (histogram sums are floats and skipped here).
            let (Ok(core), Ok(value)) = (core.parse::<usize>(), value.trim().parse::<u64>()) else {
                continue;
            };
            let v = m.entry(name.to_string()).or_default();
            if v.len() <= core {
                v.resize(core + 1, 0);
            }
            v[core] = value;
        }
        m
    }

    /// Sum of a counter over cores.
    pub fn total(&self, name: &str) -> u64 {
        self.counters()
            .get(name)
            .map(|v| v.iter().sum())
            .unwrap_or(0)
    }
}

/// The brokers' log filter: `warn`, or `FELIX_TEST_BROKER_LOG` (e.g.
/// `info,felix_broker::core::replica_host=debug`) to see more of a failing test.
pub fn broker_log() -> String {
    let base = std::env::var("FELIX_TEST_BROKER_LOG").unwrap_or_else(|_| "warn".to_string());
    // The serving intervals are the evidence of `serving.rs`'s check.
    format!("{base},felix::serving=info")
}

/// The stdout of a felixctl run that must succeed (its stderr in the failure message).
pub fn ok(o: std::process::Output) -> String {
    assert!(
        o.status.success(),
        "felixctl failed ({:?}): {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// Wait until every thread of process `pid` is stopped (`T` in `/proc/PID/task/*/stat`), or
/// `timeout` passed (then the test goes on; what it checks will tell).
pub fn wait_all_threads_stopped(pid: u32, timeout: Duration) {
    let deadline = std::time::Instant::now() + timeout;
    let stopped = || -> Option<bool> {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
        for t in tasks.flatten() {
            let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
            // The state follows the parenthesised command name, which may hold spaces.
            let state = stat.rsplit_once(") ")?.1.chars().next()?;
            if state != 'T' && state != 't' {
                return Some(false);
            }
        }
        Some(true)
    };
    while std::time::Instant::now() < deadline {
        if stopped() != Some(false) {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

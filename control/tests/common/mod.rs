//! Test harness: real `felix-controlplane` processes on loopback, temp dirs, bounded waits.
#![allow(dead_code)]

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_felix-controlplane");

/// A running control plane. Killed (SIGKILL) on drop.
pub struct Server {
    pub child: Option<Child>,
    pub addr: String,
    pub args: Vec<String>,
}

/// Settings every test server gets (fast sweeps, short liveness).
pub fn base_args() -> Vec<String> {
    [
        "--sweep-interval-ms",
        "50",
        "--dead-after-ms",
        "1500",
        "--heartbeat-interval-ms",
        "300",
        "--max-wait-ms",
        "5000",
        "--change-log-len",
        "200",
        "--write-timeout-ms",
        "4000",
        "--placement-settle-ms",
        "0",
        // The REST suites test the API itself; tests/auth.rs runs with auth on.
        "--auth",
        "off",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// [`base_args`] with auth left on (its default).
pub fn base_args_auth_on() -> Vec<String> {
    let mut a = base_args();
    let at = a
        .iter()
        .position(|x| x == "--auth")
        .expect("base args turn auth off");
    a.drain(at..at + 2);
    a
}

/// Wait (bounded) for the admin token file the control plane writes, and check its mode.
pub fn admin_token(path: &Path) -> String {
    use std::os::unix::fs::PermissionsExt;
    let t = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            let mode = std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "the admin token file is private");
            return s.trim().to_string();
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no admin token at {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A client that sends `token` as its bearer on every request.
pub fn client_with(token: &str) -> reqwest::Client {
    let mut h = reqwest::header::HeaderMap::new();
    h.insert(
        reqwest::header::AUTHORIZATION,
        format!("Bearer {token}").parse().unwrap(),
    );
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .default_headers(h)
        .build()
        .unwrap()
}

/// A client that trusts `ca` (PEM) and sends `token`, if any, as its bearer.
pub fn client_tls(token: Option<&str>, ca: &Path) -> reqwest::Client {
    let mut h = reqwest::header::HeaderMap::new();
    if let Some(t) = token {
        h.insert(
            reqwest::header::AUTHORIZATION,
            format!("Bearer {t}").parse().unwrap(),
        );
    }
    let ca = reqwest::Certificate::from_pem(&std::fs::read(ca).unwrap()).unwrap();
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .default_headers(h)
        .add_root_certificate(ca)
        .build()
        .unwrap()
}

impl Server {
    /// Start with `--listen 127.0.0.1:0` and wait for its "listening ADDR" line.
    pub fn start(extra: &[String]) -> Server {
        let mut args = vec!["--listen".to_string(), "127.0.0.1:0".to_string()];
        args.extend(base_args());
        args.extend(extra.iter().cloned());
        Self::start_exact(args)
    }

    /// Start with exactly these arguments (which must include `--listen`).
    pub fn start_exact(args: Vec<String>) -> Server {
        let mut child = Command::new(BIN)
            .args(&args)
            .env("FELIX_LOG", "warn,openraft=off")
            .env_remove("FELIX_RAFT_PEERS")
            // HTTPS is the default; the REST suites speak plain HTTP to test the API itself,
            // and a test that wants HTTPS passes `--tls on` (a flag beats the environment).
            // tests/https.rs and the Raft auth cluster run it.
            .env("FELIX_CONTROLPLANE_TLS", "off")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn felix-controlplane");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(a) = line.strip_prefix("listening ") {
                    let _ = tx.send(a.to_string());
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("server printed its address");
        Server {
            child: Some(child),
            addr,
            args,
        }
    }

    pub fn url(&self, path: &str) -> String {
        let tls = self
            .args
            .windows(2)
            .any(|w| w[0] == "--tls" && w[1] == "on");
        let scheme = if tls { "https" } else { "http" };
        format!("{scheme}://{}{}", self.addr, path)
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map(|c| c.id() as i32).unwrap_or(0)
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Hand the process over to the test (it is no longer killed on drop).
    pub fn take_child(&mut self) -> std::process::Child {
        self.child.take().expect("running")
    }

    /// SIGTERM and wait (bounded) for a clean exit.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            unsafe {
                libc::kill(c.id() as i32, libc::SIGTERM);
            }
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(10) {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// The body of a GET that must succeed at the transport level, as text.
pub async fn get_text(c: &reqwest::Client, url: &str) -> String {
    c.get(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .text()
        .await
        .unwrap()
}

/// (status, JSON body or Null).
pub async fn call(
    c: &reqwest::Client,
    method: &str,
    url: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let m = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut rq = c.request(m, url);
    if let Some(b) = body {
        rq = rq.json(&b);
    }
    let r = rq
        .send()
        .await
        .unwrap_or_else(|e| panic!("{method} {url}: {e}"));
    let st = r.status().as_u16();
    let text = r.text().await.unwrap_or_default();
    (st, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// Poll `f` every 50 ms until it returns Some, at most `secs` seconds.
pub async fn eventually<T, F, Fut>(secs: u64, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let t = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

pub fn p(d: &Path) -> String {
    d.to_string_lossy().to_string()
}

pub fn pb(d: &Path, s: &str) -> PathBuf {
    d.join(s)
}

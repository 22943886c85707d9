//! The control plane for integration tests: the real `felix-controlplane` binary on loopback
//! (random port, memory store), killed when dropped, and `felixctl` against it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub fn sibling(bin: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_BIN_EXE_felix-broker")).with_file_name(bin);
    assert!(
        p.exists(),
        "{} not built: run `cargo build --workspace` first",
        p.display()
    );
    p
}

pub struct ControlPlane {
    pub child: Child,
    pub url: String,
    /// With HTTPS: the CA its certificate is signed by.
    pub ca: Option<PathBuf>,
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn start_control_plane(dead_after_ms: u64) -> ControlPlane {
    start_control_plane_settling(dead_after_ms, 0)
}

/// With auth on (its default) and HTTPS (a development certificate under `tls/` beside
/// the token file): the admin token is written to `admin_token_file`.
pub fn start_control_plane_auth(admin_token_file: &Path) -> ControlPlane {
    spawn_control_plane(5_000, 0, Some(admin_token_file))
}

/// [`start_control_plane_auth`] counting a silent broker dead after `dead_after_ms`.
pub fn start_control_plane_auth_dead_after(
    admin_token_file: &Path,
    dead_after_ms: u64,
) -> ControlPlane {
    spawn_control_plane(dead_after_ms, 0, Some(admin_token_file))
}

/// Wait (bounded) for the admin token the control plane writes.
pub fn read_admin_token(path: &Path) -> String {
    let t = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
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

/// With a placement settle window of `settle_ms` (0: shards are placed at once).
pub fn start_control_plane_settling(dead_after_ms: u64, settle_ms: u64) -> ControlPlane {
    spawn_control_plane(dead_after_ms, settle_ms, None)
}

/// The tests' control-plane timing: brokers heartbeat every 100 ms and are counted dead after
/// `dead_after_ms`, the sweep runs every 50 ms, deletes are final after 200 ms, and shards are
/// placed `settle_ms` after start.
fn test_timing(cmd: &mut Command, dead_after_ms: u64, settle_ms: u64) -> &mut Command {
    cmd.env("FELIX_CONTROLPLANE_HEARTBEAT_INTERVAL_MS", "100")
        .env(
            "FELIX_CONTROLPLANE_DEAD_AFTER_MS",
            dead_after_ms.to_string(),
        )
        .env("FELIX_CONTROLPLANE_SWEEP_INTERVAL_MS", "50")
        .env("FELIX_CONTROLPLANE_DELETE_GRACE_MS", "200")
        .env("FELIX_PLACEMENT_SETTLE_MS", settle_ms.to_string())
}

/// Start the control plane `cmd` describes; the child and the address its first line says it
/// listens on.
fn spawn_listening(cmd: &mut Command) -> (Child, String) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start felix-controlplane");
    let out = child.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    (child, addr)
}

fn spawn_control_plane(
    dead_after_ms: u64,
    settle_ms: u64,
    admin_token_file: Option<&Path>,
) -> ControlPlane {
    let mut cmd = Command::new(sibling("felix-controlplane"));
    match admin_token_file {
        Some(f) => cmd.arg("--admin-token-file").arg(f).args(["--tls", "on"]),
        // The suites test placement and forwarding; tests/auth.rs runs with auth and HTTPS
        // on (both the defaults).
        None => cmd
            .env("FELIX_CONTROLPLANE_AUTH", "off")
            .env("FELIX_CONTROLPLANE_TLS", "off"),
    };
    test_timing(&mut cmd, dead_after_ms, settle_ms)
        .args(["--listen", "127.0.0.1:0"])
        .env("FELIX_LOG", "warn");
    let (child, addr) = spawn_listening(&mut cmd);
    let ca = admin_token_file.map(|f| f.parent().unwrap().join("tls/ca.pem"));
    ControlPlane {
        child,
        url: format!("{}://{addr}", if ca.is_some() { "https" } else { "http" }),
        ca,
    }
}

pub fn felixctl(cp: &ControlPlane, cfg_dir: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(sibling("felixctl"));
    if let Some(ca) = &cp.ca {
        cmd.env("FELIX_CONTROLPLANE_CA", ca);
    }
    cmd.args(["--controlplane", &cp.url])
        .arg("--context-file")
        .arg(cfg_dir.join("felixctl.json"))
        .args(args)
        .env_remove("FELIX_CONTROLPLANE_URL")
        .env_remove("FELIX_CONTEXT")
        .stdin(Stdio::null())
        .output()
        .expect("run felixctl")
}

/// Until `f` succeeds or 10 s pass (the broker applies catalog changes within a feed round).
pub async fn eventually<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) if Instant::now() > deadline => panic!("{what}: still {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(25)).await,
        }
    }
}

/// Start broker `node_id` against `cp` with auth left to `auto` and, if given, the node
/// credential in `token_file`.
pub fn start_enrolled(
    cp: &ControlPlane,
    node_id: &str,
    token_file: Option<&std::path::Path>,
) -> Result<super::Broker, String> {
    let mut args = vec![
        "--controlplane-url",
        cp.url.as_str(),
        "--node-id",
        node_id,
        "--auth",
        "auto",
    ];
    if let Some(f) = token_file {
        args.extend(["--controlplane-token-file", f.to_str().unwrap()]);
    }
    if let Some(ca) = &cp.ca {
        args.extend(["--controlplane-ca", ca.to_str().unwrap()]);
    }
    super::Broker::try_start_env(tempfile::tempdir().unwrap(), 1, &args, &[])
}

/// `felixctl --token ADMIN ARGS` against `cp`, which must succeed: its trimmed stdout.
pub fn ctl_ok(cp: &ControlPlane, cfg_dir: &Path, admin: &str, args: &[&str]) -> String {
    let mut v = vec!["--token", admin];
    v.extend_from_slice(args);
    let o = felixctl(cp, cfg_dir, &v);
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap().trim().to_string()
}

/// A free loopback port (bound, then released: the member binds it again at once).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Three `felix-controlplane` members forming one Raft group on loopback under `dir`, with
/// auth and HTTPS on (one certificate and one member secret shared by the three, as an
/// operator deploys them), the same timing as [`start_control_plane_auth_dead_after`].
/// Member `i` writes the admin token to `dir/admin-{i}.token` (one bootstrap, one token).
pub fn start_control_plane_group(dir: &Path, dead_after_ms: u64) -> Vec<ControlPlane> {
    let tls = dir.join("cp-tls");
    felix_quic::tls::ensure_server_cert(&tls, "controlplane").unwrap();
    let secret = dir.join("member.secret");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef-test-only\n").unwrap();
    let addrs: Vec<String> = (0..3)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let peers = (1..)
        .zip(&addrs)
        .map(|(i, a)| format!("{i}={a}"))
        .collect::<Vec<_>>()
        .join(",");
    (0..3)
        .map(|i| {
            let data = dir.join(format!("cp-{}", i + 1));
            let mut cmd = Command::new(sibling("felix-controlplane"));
            test_timing(&mut cmd, dead_after_ms, 0)
                .args(["--listen", &addrs[i], "--store", "raft"])
                .args([
                    "--raft-node-id",
                    &(i + 1).to_string(),
                    "--raft-peers",
                    &peers,
                ])
                .arg("--raft-data-dir")
                .arg(&data)
                .arg("--admin-token-file")
                .arg(dir.join(format!("admin-{i}.token")))
                .arg("--member-secret-file")
                .arg(&secret)
                .args(["--tls", "on"])
                .arg("--tls-cert-file")
                .arg(tls.join("controlplane.pem"))
                .arg("--tls-key-file")
                .arg(tls.join("controlplane-key.pem"))
                .arg("--tls-ca-file")
                .arg(tls.join("ca.pem"))
                .env("FELIX_LOG", "warn,openraft=off")
                .env_remove("FELIX_RAFT_PEERS");
            let (child, addr) = spawn_listening(&mut cmd);
            ControlPlane {
                child,
                url: format!("https://{addr}"),
                ca: Some(tls.join("ca.pem")),
            }
        })
        .collect()
}

//! The real client and felixctl against the real broker binary.

use felix_client::{Client, ClientConfig, Error};
use felix_quic::wire::{ErrorCode, StreamName};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

struct Broker(std::process::Child, SocketAddr, tempfile::TempDir);
impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start() -> Broker {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_felix-broker"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--cores",
            "2",
        ])
        .arg("--data-dir")
        .arg(dir.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("quic="))
        .expect("ready line")
        .parse()
        .unwrap();
    Broker(child, addr, dir)
}

#[tokio::test]
async fn client_describe_errors_and_close() {
    let b = start();
    let ca = b.2.path().join("tls/dev-cert.pem");
    let c = Client::connect(ClientConfig::new(b.1, Some(ca)))
        .await
        .unwrap();
    let info = c
        .describe_stream(&StreamName::new("default", "default", "events"))
        .await
        .unwrap();
    assert_eq!(info.shards, 4);
    match c
        .describe_stream(&StreamName::new("default", "default", "nope"))
        .await
    {
        Err(Error::Broker {
            code: ErrorCode::UnknownStream,
            ..
        }) => {}
        other => panic!("expected unknown_stream, got {other:?}"),
    }
    match c
        .describe_stream(&StreamName::new("bad/name", "default", "x"))
        .await
    {
        Err(Error::Broker {
            code: ErrorCode::InvalidName,
            ..
        }) => {}
        other => panic!("expected invalid_name, got {other:?}"),
    }
    c.close()
        .await
        .expect("clean close within the close timeout");
}

#[tokio::test]
async fn connect_to_a_silent_address_times_out() {
    // A bound UDP socket that never answers: connect must give up at the connect timeout.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut cfg = ClientConfig::new(silent.local_addr().unwrap(), None);
    cfg.verify = felix_quic::tls::Verify::Insecure;
    cfg.connect_timeout = Duration::from_millis(300);
    match Client::connect(cfg).await {
        Err(Error::Timeout(_)) => {}
        other => panic!("expected a timeout, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn felixctl_describe_json() {
    let b = start();
    let ca = b.2.path().join("tls/dev-cert.pem");
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker")).with_file_name("felixctl");
    let out = Command::new(&exe)
        .args(["--broker", &b.1.to_string(), "--json", "describe", "events"])
        .arg("--ca")
        .arg(&ca)
        .output()
        .expect("felixctl built alongside (cargo build --workspace)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["shards"], 4);
    let out = Command::new(&exe)
        .args(["--broker", &b.1.to_string(), "describe", "nope"])
        .arg("--ca")
        .arg(&ca)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown_stream"));
}

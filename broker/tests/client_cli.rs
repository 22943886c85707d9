//! The real client and felixctl against the real broker binary.

use felix_client::{Client, ClientConfig, Error};
use felix_quic::wire::{ErrorCode, StreamName};
use std::process::Command;

mod common;
use common::Broker;
use std::time::Duration;

#[tokio::test]
async fn client_describe_errors_and_close() {
    let b = Broker::start(2, &[]);
    let ca = b.ca();
    let c = Client::connect(ClientConfig::new(b.quic, Some(ca)))
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
    // A bound UDP socket that never answers: connect must give up at the connect timeout and
    // say that nothing answered at that address.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    let mut cfg = ClientConfig::new(addr, None);
    cfg.verify = felix_quic::tls::Verify::Insecure;
    cfg.connect_timeout = Duration::from_millis(300);
    match Client::connect(cfg).await {
        Err(e @ Error::Unreachable { .. }) => {
            let m = e.to_string();
            assert!(m.contains(&addr.to_string()) && m.contains("300 ms"), "{m}");
            assert!(m.contains("nothing listening, or UDP blocked"), "{m}");
        }
        other => panic!("expected unreachable, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn felixctl_describe_json() {
    let b = Broker::start(2, &[]);
    let out = b.felixctl(&["--json", "describe", "events"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["shards"], 4);
    let out = b.felixctl(&["describe", "nope"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown_stream"));
}

#[test]
fn felixctl_publish_then_subscribe_json() {
    let b = Broker::start(2, &[]);
    let ctl = |args: &[&str]| b.felixctl(&[&["--json"], args].concat());
    let out = ctl(&["publish", "events", "--key", "user-1", "one", "two"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let acks: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let shard = felix_quic::wire::hash::shard_for_key(b"user-1", 4);
    assert_eq!(acks.len(), 2);
    assert_eq!(acks[0]["shard"], shard);
    assert_eq!(acks[1]["first_offset"], 1);
    let out = ctl(&[
        "publish", "events", "--shard", "3", "--batch", "x", "y", "z",
    ]);
    assert!(out.status.success());
    let out = ctl(&[
        "subscribe",
        "events",
        "--from",
        "earliest",
        "--count",
        "5",
        "--idle-exit-ms",
        "3000",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut got: Vec<(u64, u64, String)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["shard"].as_u64().unwrap(),
                v["offset"].as_u64().unwrap(),
                v["payload"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    got.sort();
    let mut want = vec![
        (shard as u64, 0, "one".to_string()),
        (shard as u64, 1, "two".to_string()),
    ];
    want.extend([
        (3, 0, "x".to_string()),
        (3, 1, "y".to_string()),
        (3, 2, "z".to_string()),
    ]);
    want.sort();
    assert_eq!(got, want);
    let out = ctl(&["publish", "nope", "x"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown_stream"));
}

/// The first line a fresh broker logs on stderr (a pipe), started with `extra` flags: it reports
/// the generated development certificate.
fn first_log_line(extra: &[&str]) -> String {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_felix-broker"))
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .args(["--cores", "1"])
        .args(extra)
        .arg("--data-dir")
        .arg(dir.path())
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let err = child.stderr.take().unwrap();
    let line = std::io::BufReader::new(err)
        .lines()
        .next()
        .unwrap()
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    line
}

#[test]
fn json_logs_are_one_object_per_line() {
    let line = first_log_line(&["--log-format", "json"]);
    let v: serde_json::Value =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
    assert_eq!(v["level"], "INFO", "{line}");
    assert!(
        v["fields"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("certificate"),
        "{line}"
    );
}

/// Text logs written to a pipe (not a terminal) carry no ANSI colour codes.
#[test]
fn text_logs_to_a_pipe_have_no_colour() {
    let line = first_log_line(&[]);
    assert!(line.contains("INFO"), "{line}");
    assert!(!line.contains('\u{1b}'), "ANSI escape in {line:?}");
}

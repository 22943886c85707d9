//! felixctl as a user meets it (issue 25): records are bytes and none is dropped, errors name
//! what failed and exit with distinct codes, host names, contexts and the CA lookup, JSON
//! errors, aliases, Ctrl-C. The real broker and the real felixctl binary.

mod common;

use common::Broker;
use felix_client::{Event, SubscribeOptions};
use felix_quic::wire::{StartAt, StreamName};
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn events() -> StreamName {
    StreamName::new("default", "default", "events")
}

fn felixctl_exe() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker")).with_file_name("felixctl")
}

/// felixctl with no --broker/--ca: what a user with a context (or nothing) runs.
fn bare(context_file: &std::path::Path) -> Command {
    let mut c = Command::new(felixctl_exe());
    c.env("FELIX_CONTEXT_FILE", context_file)
        .env_remove("FELIX_CA")
        .env_remove("FELIX_BROKER")
        .env_remove("FELIX_DATA_DIR")
        .stdin(Stdio::null());
    c
}

/// Run `cmd` with `input` on its stdin (then closed); its output.
fn with_stdin(mut cmd: Command, input: &[u8]) -> std::process::Output {
    let mut p = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    p.stdin.take().unwrap().write_all(input).unwrap();
    p.wait_with_output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Read `n` records of `shard` from offset 0 with the Rust client.
async fn records(b: &Broker, shard: u32, n: usize) -> Vec<Vec<u8>> {
    let c = b.client().await;
    let opts = SubscribeOptions {
        start: StartAt::Earliest,
        ..Default::default()
    };
    let mut sub = c.subscribe(&events(), shard, opts).await.unwrap();
    let mut out = Vec::new();
    while out.len() < n {
        match sub.next_timeout(Duration::from_secs(10)).await.unwrap() {
            Some(ev @ Event::Records { .. }) => {
                out.extend(ev.records().into_iter().map(|(_, p)| p.to_vec()))
            }
            Some(Event::Lag { .. }) => {}
            other => panic!("{other:?}"),
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_records_are_bytes_and_none_is_dropped() {
    let b = Broker::start(1, &[]);
    let mut cmd = b.felixctl_cmd();
    cmd.args(["publish", "events", "--shard", "2"]);
    let out = with_stdin(cmd, b"b1\n\xff\xfe\nb3\n");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        records(&b, 2, 3).await,
        vec![b"b1".to_vec(), vec![0xff, 0xfe], b"b3".to_vec()]
    );
    // A NUL-delimited stream and a raw one.
    let mut cmd = b.felixctl_cmd();
    cmd.args(["publish", "events", "--shard", "1", "--delimiter", "\\0"]);
    let o = with_stdin(cmd, b"x\ny\0z");
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(
        records(&b, 1, 2).await,
        vec![b"x\ny".to_vec(), b"z".to_vec()]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_writer_is_published_line_by_line() {
    let b = Broker::start(1, &[]);
    let mut p = b
        .felixctl_cmd()
        .args(["pub", "events", "--shard", "0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = p.stdin.take().unwrap();
    stdin.write_all(b"first\n").unwrap();
    stdin.flush().unwrap();
    // The first line is readable while stdin is still open (tail -f works).
    assert_eq!(records(&b, 0, 1).await, vec![b"first".to_vec()]);
    stdin.write_all(b"second\n").unwrap();
    drop(stdin);
    let out = p.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        records(&b, 0, 2).await,
        vec![b"first".to_vec(), b"second".to_vec()]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_records_are_named_and_the_rest_published() {
    let b = Broker::start(1, &["--max-payload-bytes", "1000"]);
    let mut line = vec![b'x'; 2000];
    line.push(b'\n');
    let mut input = b"a\n".to_vec();
    input.extend_from_slice(&line);
    input.extend_from_slice(b"c\n");
    let mut cmd = b.felixctl_cmd();
    cmd.args(["publish", "events", "--shard", "3"]);
    let o = with_stdin(cmd, &input);
    assert_eq!(o.status.code(), Some(4), "partial: {}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(
        err.contains("record 2 refused (payload_too_large)"),
        "{err}"
    );
    assert!(err.contains("max_payload_bytes (1000)"), "{err}");
    assert_eq!(records(&b, 3, 2).await, vec![b"a".to_vec(), b"c".to_vec()]);
    // A record too big for any frame is refused before it is sent, naming the limit.
    let big = vec![b'y'; 16_777_300];
    let mut cmd = b.felixctl_cmd();
    cmd.args(["--json", "publish", "events", "--shard", "3", "--raw"]);
    let o = with_stdin(cmd, &big);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let e: serde_json::Value = serde_json::from_slice(&o.stderr).expect("a JSON error");
    assert_eq!(e["error"]["code"], "payload_too_large");
    assert_eq!(e["error"]["exit"], 1);
}

#[test]
fn unreachable_brokers_and_control_planes_are_named_within_the_timeout() {
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let t = Instant::now();
    let o = bare(&dir.path().join("ctx.json"))
        .args(["--broker", &addr.to_string(), "--insecure"])
        .args(["--timeout-ms", "700", "describe", "events"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(
        err.contains(&format!("no Felix broker answered at {addr} within 700 ms")),
        "{err}"
    );
    // The timeout is honoured (generous bound: the old fixed wait was 5 s).
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    // A control plane: nothing listening, and a URL that is not one.
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = tcp.local_addr().unwrap().port();
    drop(tcp);
    let url = format!("http://127.0.0.1:{port}");
    let o = bare(&dir.path().join("ctx.json"))
        .args(["--controlplane", &url, "tenant", "ls"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3));
    let err = text(&o.stderr);
    assert!(
        err.contains(&format!("no control plane answered at {url}")),
        "{err}"
    );
    assert!(
        err.to_lowercase().contains("refused"),
        "names the cause: {err}"
    );
    let o = bare(&dir.path().join("ctx.json"))
        .args(["--controlplane", "127.0.0.1:7410", "tenant", "ls"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("must start with http:// or https://"));
}

#[test]
fn host_names_contexts_and_the_ca_lookup() {
    let b = Broker::start(1, &[]);
    let dir = tempfile::tempdir().unwrap();
    let ctx = dir.path().join("ctx.json");
    let port = b.quic.port();
    // A host name, and the CA from FELIX_CA.
    let o = bare(&ctx)
        .env("FELIX_CA", b.ca())
        .args([
            "--broker",
            &format!("localhost:{port}"),
            "describe",
            "events",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(text(&o.stdout).contains("default/default/events"));
    // A context carries the broker and the CA (kept absolute): felixctl run from another
    // directory with nothing else finds both.
    let o = bare(&ctx)
        .args(["context", "set", "local", "--url", "http://127.0.0.1:7410"])
        .args(["--broker", &format!("localhost:{port}")])
        .arg("--ca")
        .arg(b.ca())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let elsewhere = tempfile::tempdir().unwrap();
    let o = bare(&ctx)
        .current_dir(elsewhere.path())
        .args(["-o", "json", "describe", "events"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["shards"], 4);
    // A CA file that is not there: named, with where it came from, before connecting.
    let o = bare(&ctx)
        .args(["--ca", "/nonexistent/ca.pem", "describe", "events"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("CA file /nonexistent/ca.pem (from --ca) does not exist"));
    // A CA that did not sign the broker's certificate: the certificate is named as refused.
    let other = tempfile::tempdir().unwrap();
    let (p, _) = felix_quic::tls::ensure_dev_cert(other.path()).unwrap();
    let o = bare(&ctx)
        .arg("--ca")
        .arg(&p.cert)
        .args(["describe", "events"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(err.contains("certificate refused"), "{err}");
    assert!(
        err.contains(&p.cert.display().to_string()),
        "names the file: {err}"
    );
}

#[test]
fn errors_are_json_under_json_and_exit_codes_differ() {
    let b = Broker::start(1, &[]);
    let o = b.felixctl(&["--json", "describe", "nope"]);
    assert_eq!(o.status.code(), Some(1));
    let e: serde_json::Value = serde_json::from_slice(&o.stderr).unwrap();
    assert_eq!(e["error"]["code"], "unknown_stream");
    assert!(e["error"]["message"].as_str().unwrap().contains("nope"));
    // Usage errors are 2, also as JSON.
    let o = b.felixctl(&["-o", "json", "subscribe", "events", "--from", "soon"]);
    assert_eq!(o.status.code(), Some(2));
    let e: serde_json::Value = serde_json::from_slice(&o.stderr).unwrap();
    assert_eq!(e["error"]["code"], "usage");
    // Conditional writes fail in words, not Rust debug text.
    assert!(b.felixctl(&["kv", "put", "kv", "k", "v1"]).status.success());
    let o = b.felixctl(&["kv", "put", "kv", "k", "v2", "--if-version", "999"]);
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    assert!(
        err.contains("condition_failed") && err.contains("the current version is"),
        "{err}"
    );
    let o = b.felixctl(&["kv", "rm", "kv", "fresh", "--if-version", "3"]);
    assert!(
        text(&o.stderr).contains("the key has no current value"),
        "{}",
        text(&o.stderr)
    );
    // Shard ranges in words.
    let o = b.felixctl(&["publish", "events", "x", "--shard", "9"]);
    assert!(
        text(&o.stderr).contains("shards 0–3"),
        "{}",
        text(&o.stderr)
    );
    // One source for the key limit: the broker's (512 by default).
    let long = "k".repeat(600);
    let o = b.felixctl(&["kv", "put", "kv", &long, "v"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o.stderr).contains("cache_key_bytes_max (512)"),
        "{}",
        text(&o.stderr)
    );
}

#[test]
fn ctrl_c_ends_a_subscribe_cleanly_with_130_and_versions_name_the_revision() {
    let b = Broker::start(1, &[]);
    let mut p = b
        .felixctl_cmd()
        .args(["sub", "events", "--shard", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait (bounded) for the subscription to be in place.
    let mut err = p.stderr.take().unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while !text(&seen).contains("waiting for records") {
        let n = err.read(&mut buf).unwrap();
        assert!(n > 0, "felixctl ended early: {}", text(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(p.id() as i32, libc::SIGINT) };
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = p.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "felixctl did not end on SIGINT");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(130));
    for exe in [
        "felix-broker",
        "felix-controlplane",
        "felixctl",
        "felix-loadgen",
    ] {
        let p = std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker")).with_file_name(exe);
        let o = Command::new(p).arg("--version").output().unwrap();
        assert!(o.status.success(), "{exe} --version");
        let v = text(&o.stdout);
        assert!(v.starts_with(exe) && v.contains("(git "), "{v}");
    }
}

/// Fire-and-forget from stdin: felixctl waits until the broker has acknowledged every byte
/// before it exits, so every record arrives (none is lost to the close).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fire_and_forget_from_stdin_arrives_whole() {
    let b = Broker::start(1, &[]);
    const N: usize = 30_000;
    let mut input = Vec::new();
    for i in 0..N {
        input.extend_from_slice(format!("record-{i:06}-{}\n", "x".repeat(80)).as_bytes());
    }
    let mut cmd = b.felixctl_cmd();
    cmd.args(["publish", "events", "--shard", "0", "--no-ack"]);
    let o = with_stdin(cmd, &input);
    assert!(o.status.success(), "{}", text(&o.stderr));
    // felixctl has exited: every record is appended already (no waiting here).
    assert_eq!(b.total("records_appended"), N as u64);
    let c = b.client().await;
    let opts = SubscribeOptions {
        start: StartAt::Offset(N as u64 - 1),
        ..Default::default()
    };
    let mut sub = c.subscribe(&events(), 0, opts).await.unwrap();
    match sub.next_timeout(Duration::from_secs(10)).await.unwrap() {
        Some(ev @ Event::Records { .. }) => {
            let (offset, last) = ev.records().remove(0);
            assert_eq!(offset, N as u64 - 1);
            assert!(last.starts_with(format!("record-{:06}-", N - 1).as_bytes()));
        }
        other => panic!("{other:?}"),
    }
}

//! HTTPS on the REST listener (`--tls on`), against real `felix-controlplane` processes: the
//! development certificate made once and kept across restarts, what a client must trust, a
//! plain-HTTP or untrusting client refused and counted, and a silent connection that neither
//! blocks others nor lingers past the handshake timeout.

mod common;

use common::*;
use serde_json::{json, Value};
use std::io::Read;
use std::time::{Duration, Instant};

fn start_tls(dir: &std::path::Path, extra: &[&str]) -> Server {
    let mut args = vec!["--listen".to_string(), "127.0.0.1:0".to_string()];
    args.extend(base_args_auth_on());
    args.extend(
        [
            "--store",
            "raft",
            "--raft-data-dir",
            &p(dir),
            "--tls",
            "on",
            "--tls-handshake-timeout-ms",
            "500",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    args.extend(extra.iter().map(|s| s.to_string()));
    Server::start_exact(args)
}

/// The handshake-failure counter from `/metrics`.
async fn handshake_failures(c: &reqwest::Client, s: &Server) -> u64 {
    let text = get_text(c, &s.url("/metrics")).await;
    text.lines()
        .find_map(|l| l.strip_prefix("felix_controlplane_tls_handshake_failures_total "))
        .unwrap_or_else(|| panic!("no handshake counter in /metrics:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn https_with_the_development_certificate() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempdir();
    let mut s = start_tls(d.path(), &[]);
    assert!(s.url("/").starts_with("https://"));
    let tls = d.path().join("tls");
    let ca = tls.join("ca.pem");
    for key in ["ca-key.pem", "controlplane-key.pem"] {
        let mode = std::fs::metadata(tls.join(key))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{key} is private");
    }
    let admin = admin_token(&d.path().join("admin.token"));
    let c = client_tls(Some(&admin), &ca);

    // A client that trusts the CA is served, tokens and all.
    let (st, b) = call(
        &c,
        "POST",
        &s.url("/v1/tenants"),
        Some(json!({"name": "t"})),
    )
    .await;
    assert_eq!(st, 201, "{b}");
    let before = handshake_failures(&c, &s).await;

    // One that trusts only the system's roots does not get through; nor does plain HTTP.
    let untrusting = client();
    let e = untrusting
        .get(s.url("/livez"))
        .send()
        .await
        .expect_err("an unknown CA must fail the handshake");
    assert!(e.is_connect() || e.is_request(), "{e:?}");
    let plain = format!("http://{}/livez", s.addr);
    let r = untrusting.get(&plain).send().await;
    assert!(
        r.as_ref().map(|r| !r.status().is_success()).unwrap_or(true),
        "plain HTTP must not be served: {r:?}"
    );
    let after = eventually(5, "the failed handshakes counted", || {
        let (c, s) = (&c, &s);
        async move {
            let n = handshake_failures(c, s).await;
            (n >= before + 2).then_some(n)
        }
    })
    .await;
    assert!(after >= before + 2);

    // A connection that never speaks holds no one up, and is closed past the handshake
    // timeout (500 ms here).
    let mut silent = std::net::TcpStream::connect(&s.addr).unwrap();
    let (st, _) = call(&c, "GET", &s.url("/readyz"), None).await;
    assert_eq!(st, 200, "served beside a silent connection");
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let t = Instant::now();
    let mut buf = [0u8; 16];
    let n = silent.read(&mut buf).unwrap_or(0);
    assert_eq!(n, 0, "the silent connection is closed, not answered");
    assert!(
        t.elapsed() < Duration::from_secs(9),
        "closed by the handshake timeout, not by the read timeout"
    );

    // A restart serves the same certificate: what clients trust stays valid.
    let ca_before = std::fs::read(&ca).unwrap();
    let cert_before = std::fs::read(tls.join("controlplane.pem")).unwrap();
    s.stop();
    let s = start_tls(d.path(), &[]);
    assert_eq!(std::fs::read(&ca).unwrap(), ca_before);
    assert_eq!(
        std::fs::read(tls.join("controlplane.pem")).unwrap(),
        cert_before
    );
    let c = client_tls(Some(&admin), &ca);
    let (st, b): (u16, Value) = call(&c, "GET", &s.url("/v1/tenants/t"), None).await;
    assert_eq!(st, 200, "{b}");
}

#[tokio::test]
async fn a_configured_certificate_and_bad_tls_settings() {
    // A certificate from elsewhere (here the cluster CA helper's), served as configured.
    let d = tempdir();
    let certs = tempdir();
    let (id, _) = felix_quic::tls::ensure_server_cert(certs.path(), "cp").unwrap();
    let (cert, key) = (p(&id.cert.cert), p(&id.cert.key));
    let s = start_tls(
        d.path(),
        &["--tls-cert-file", &cert, "--tls-key-file", &key],
    );
    let admin = admin_token(&d.path().join("admin.token"));
    let (st, b) = call(
        &client_tls(Some(&admin), &id.ca),
        "GET",
        &s.url("/v1/tenants"),
        None,
    )
    .await;
    assert_eq!(st, 200, "{b}");
    assert!(
        !d.path().join("tls").exists(),
        "no development certificate is made when one is configured"
    );

    // Refused at start, with the reason: a missing key, a key that is not PEM, TLS files
    // with TLS off.
    let junk = certs.path().join("junk.pem");
    std::fs::write(&junk, "not a key").unwrap();
    let e = tempdir();
    let data = p(e.path());
    for (args, says) in [
        (vec!["--tls", "on", "--tls-cert-file", &cert], "go together"),
        (
            vec![
                "--tls",
                "on",
                "--tls-cert-file",
                &cert,
                "--tls-key-file",
                &p(&junk),
            ],
            "junk.pem",
        ),
        (
            vec![
                "--tls",
                "off",
                "--tls-cert-file",
                &cert,
                "--tls-key-file",
                &key,
            ],
            "need --tls on",
        ),
    ] {
        let mut all: Vec<String> = [
            "--listen",
            "127.0.0.1:0",
            "--store",
            "raft",
            "--raft-data-dir",
            &data,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        all.extend(args.iter().map(|s| s.to_string()));
        let out = std::process::Command::new(BIN).args(&all).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?} should say {says:?}: {err}");
    }
}

/// A refusal made before the request's body was read (the bearer check's 401) closes the
/// connection and says so with `Connection: close`: without
/// it, a client reuses the connection hyper is about to drop and its next request fails
/// (Schemathesis saw "EOF occurred in violation of protocol" on a 401 to a 100 KB POST).
/// An answer to a body that was read to its end keeps the connection.
#[tokio::test]
async fn a_refusal_before_the_body_is_read_closes_the_connection_and_says_so() {
    let d = tempdir();
    let s = start_tls(d.path(), &[]);
    let ca = d.path().join("tls").join("ca.pem");
    let admin = admin_token(&d.path().join("admin.token"));
    let closes = |r: &reqwest::Response| {
        r.headers()
            .get("connection")
            .map(|v| v.as_bytes().eq_ignore_ascii_case(b"close"))
            .unwrap_or(false)
    };
    let big = json!({"name": "x".repeat(100_000)}).to_string();
    let url = s.url("/v1/tenants");

    let anon = client_tls(None, &ca);
    let r = anon
        .post(&url)
        .header("content-type", "application/json")
        .body(big.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert!(closes(&r), "a 401 to an unread body: {:?}", r.headers());
    // The same client goes on, on a new connection.
    let r = anon.get(s.url("/livez")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    // Nothing to leave unread: the connection stays.
    let r = anon.get(&url).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert!(!closes(&r), "a 401 to a GET: {:?}", r.headers());

    let c = client_tls(Some(&admin), &ca);
    // (A 413 closes too when the body is cut at the limit with bytes still unread; a client
    // writing a body far past the limit then often meets the closed connection mid-write, a
    // broken pipe rather than the answer, so it is not asserted here. A body hyper had
    // received whole before the limit was checked is read to its end: it keeps the
    // connection.)
    // A body read to its end and refused keeps the connection.
    let r = c
        .post(&url)
        .header("content-type", "application/json")
        .body(r#"{"name": 7}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(!closes(&r), "a 400 to a read body: {:?}", r.headers());
}

//! Revocation on a broker without a control plane (`--auth standalone`): `felix-broker token
//! revoke` writes the data dir's revocation file, and the broker follows it as it would the
//! control plane's feed.

use felix_broker::auth::local_revocations::revocations_path;
use felix_client::{Client, Error, SubscribeOptions};
use felix_quic::wire::{ErrorCode, ShardSelector, StreamName};
use std::time::Duration;

mod common;
use common::Broker;

fn events() -> StreamName {
    StreamName::new("default", "default", "events")
}

/// `felix-broker token ARGS` against the broker's data dir.
fn token_cmd(b: &Broker, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_felix-broker"))
        .arg("token")
        .args(args)
        .args(["--data-dir", b.dir.path().to_str().unwrap()])
        .output()
        .unwrap()
}

fn token_for(b: &Broker, subject: &str) -> String {
    let o = token_cmd(
        b,
        &[
            "create",
            "--tenant",
            "default",
            "--subject",
            subject,
            "--allow",
            "stream.publish:default/*",
            "--allow",
            "stream.subscribe:default/*",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap().trim().to_string()
}

async fn connect(b: &Broker, token: &str) -> Result<Client, Error> {
    let mut cfg = b.client_config();
    cfg.token = Some(token.to_string());
    Client::connect(cfg).await
}

fn code<T: std::fmt::Debug>(r: Result<T, Error>) -> ErrorCode {
    match r {
        Err(Error::Broker { code, .. }) => code,
        other => panic!("expected a broker refusal, got {other:?}"),
    }
}

/// A subject revoked with `felix-broker token revoke` has its live subscription ended
/// `revoked` and its token refused, while others carry on; a token made for it afterwards
/// works; a malformed file keeps the revocations held and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standalone_broker_follows_its_revocation_file() {
    let b = Broker::start(1, &["--auth", "standalone"]);
    let alice = token_for(&b, "alice");
    let bob = token_for(&b, "bob");
    let a = connect(&b, &alice).await.unwrap();
    let mut sub = a
        .subscribe(&events(), 0, SubscribeOptions::default())
        .await
        .unwrap();
    let other = connect(&b, &bob).await.unwrap();
    let o = token_cmd(&b, &["revoke", "--subject", "alice"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Bounded: the file is looked at twice a second, the sweep runs every second.
    match tokio::time::timeout(Duration::from_secs(5), sub.next()).await {
        Ok(Some(felix_client::Event::End { code, .. })) => {
            assert_eq!(code, ErrorCode::Revoked.number())
        }
        other => panic!("the subscription should end revoked: {other:?}"),
    }
    assert_eq!(
        code(connect(&b, &alice).await.map(|_| ())),
        ErrorCode::Revoked
    );
    other
        .publish_batch(&events(), ShardSelector::Shard(0), vec!["still"])
        .await
        .unwrap();
    // Issued after the revocation (dated past its second), a new token of alice's works.
    let again = token_for(&b, "alice");
    let a2 = connect(&b, &again).await.unwrap();
    a2.publish_batch(&events(), ShardSelector::Shard(0), vec!["back"])
        .await
        .unwrap();
    // Usage errors are typed exits, and change nothing.
    let o = token_cmd(&b, &["revoke", "--subject", "x", "--tenant", "y"]);
    assert_eq!(o.status.code(), Some(2));
    // A malformed file: the revocation held stays in force, and /readyz and the counter say so.
    std::fs::write(revocations_path(b.dir.path()), b"{ not json").unwrap();
    common::cp::eventually("the malformed file is reported", || async {
        let m = b.http_get("/metrics");
        let failed = m
            .lines()
            .find_map(|l| l.strip_prefix("felix_auth_revocation_feed_failures_total "))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        (failed >= 1).then_some(()).ok_or(m)
    })
    .await;
    assert!(b.http_get("/readyz").contains("revocation"));
    assert_eq!(
        code(connect(&b, &alice).await.map(|_| ())),
        ErrorCode::Revoked
    );
}

//! A broker's node credential over its life, against the real control plane: one-time
//! enrolment (an enrolment token exchanged once, at the first start) and renewal before expiry.

use common::cp::{
    ctl_ok, eventually, felixctl, read_admin_token, start_control_plane_auth, start_enrolled,
};
use felix_broker::control_link::credential::{is_enrolment, lifetime_of, renew_at_s};
use felix_quic::wire::{ShardSelector, StreamName};
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

mod common;

fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

async fn connect(b: &common::Broker, token: &str) -> felix_client::Client {
    let mut cfg = b.client_config();
    cfg.token = Some(token.to_string());
    felix_client::Client::connect(cfg).await.expect("connect")
}

/// A control plane with auth on, its admin token, and the tenant and namespace `default`.
fn control_plane_with_default(dir: &std::path::Path) -> (common::cp::ControlPlane, String) {
    let cp = start_control_plane_auth(&dir.join("admin.token"));
    let admin = read_admin_token(&dir.join("admin.token"));
    ctl_ok(&cp, dir, &admin, &["tenant", "create", "default"]);
    ctl_ok(&cp, dir, &admin, &["namespace", "create", "default"]);
    (cp, admin)
}

/// Until the broker serves stream default/default/`name` (it learns of it through the
/// catalog feed, which needs a valid node credential): a publish is acknowledged.
async fn served(a: &felix_client::Client, name: &str) {
    let s = StreamName::new("default", "default", name);
    eventually(&format!("stream {name} is served"), || async {
        a.publish_batch(&s, ShardSelector::Shard(0), vec!["x"])
            .await
            .map_err(|e| e.to_string())
    })
    .await;
}

/// An enrolment token is exchanged once for the node credential, which the broker writes
/// where it read the enrolment token; it can do nothing else, a spent one is refused (the
/// broker stops, exit 2, saying what to do), and another node's is refused without being
/// spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enrolment_token_is_exchanged_once_for_the_node_credential() {
    let dir = tempfile::tempdir().unwrap();
    let (cp, admin) = control_plane_with_default(dir.path());
    let ctl = |args: &[&str]| ctl_ok(&cp, dir.path(), &admin, args);
    ctl(&["stream", "create", "events", "--shards", "1"]);
    let enrol = ctl(&["node", "enroll", "1", "--one-time"]);
    assert!(is_enrolment(&enrol));
    let (iat_s, exp_s) = lifetime_of(&enrol).unwrap();
    assert_eq!(
        exp_s - iat_s,
        3600,
        "an enrolment token lives an hour by default"
    );
    // It reaches nothing but the exchange.
    let o = felixctl(&cp, dir.path(), &["--token", &enrol, "node", "ls"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && stderr.contains("forbidden"),
        "{stderr}"
    );
    let file = dir.path().join("node1.token");
    std::fs::write(&file, &enrol).unwrap();
    let b = start_enrolled(&cp, "1", Some(&file)).unwrap();
    let held = std::fs::read_to_string(&file).unwrap();
    assert!(
        !is_enrolment(&held) && lifetime_of(&held).is_some(),
        "{held}"
    );
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let a = connect(&b, &admin).await;
    served(&a, "events").await;
    // Spent: the same enrolment token again is refused, and the broker says what to do.
    let again = dir.path().join("again.token");
    std::fs::write(&again, &enrol).unwrap();
    let err = start_enrolled(&cp, "1", Some(&again))
        .err()
        .expect("a spent enrolment token");
    assert!(err.contains("refused node 1's enrolment token"), "{err}");
    assert!(
        err.contains("revoked") && err.contains("--one-time"),
        "{err}"
    );
    // Another node's enrolment token is refused, and not spent by the attempt.
    let third = ctl(&["node", "enroll", "3", "--one-time"]);
    let f3 = dir.path().join("node3.token");
    std::fs::write(&f3, &third).unwrap();
    let err = start_enrolled(&cp, "4", Some(&f3))
        .err()
        .expect("node 3's token as node 4");
    assert!(err.contains("forbidden"), "{err}");
    let b3 = start_enrolled(&cp, "3", Some(&f3)).unwrap();
    // A restart reads the node credential the exchange wrote.
    drop(b);
    let b = start_enrolled(&cp, "1", Some(&file)).unwrap();
    drop((b, b3));
}

/// A broker renews its node credential with a third of its life left, writes the new one
/// (0600) where it read the old, and keeps following the catalog past the first one's expiry:
/// a stream created after it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_renews_its_node_credential_before_it_expires() {
    let dir = tempfile::tempdir().unwrap();
    let (cp, admin) = control_plane_with_default(dir.path());
    let ctl = |args: &[&str]| ctl_ok(&cp, dir.path(), &admin, args);
    let first = ctl(&["node", "enroll", "1", "--ttl", "6s"]);
    let (iat_s, exp_s) = lifetime_of(&first).expect("the credential's times");
    assert_eq!((exp_s - iat_s, renew_at_s((iat_s, exp_s))), (6, iat_s + 4));
    let file = dir.path().join("node1.token");
    std::fs::write(&file, &first).unwrap();
    let b = start_enrolled(&cp, "1", Some(&file)).unwrap();
    // Renewed at two thirds of its life; 10 s bound.
    let renewed = eventually("the credential file holds a renewed credential", || async {
        let t = std::fs::read_to_string(&file).map_err(|e| e.to_string())?;
        let t = t.trim().to_string();
        (t != first)
            .then_some(t)
            .ok_or("not renewed yet".to_string())
    })
    .await;
    let (_, exp2_s) = lifetime_of(&renewed).expect("the renewed credential's times");
    assert!(exp2_s > exp_s, "{exp2_s} <= {exp_s}");
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    // Past the first credential's expiry, streams created now reach the broker through the
    // catalog feed, which only a renewed credential can still read. The first change answers
    // the long poll sent before the expiry; the second needs a poll sent after it.
    let past_s = exp_s + 1;
    while now_s() < past_s {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let a = connect(&b, &admin).await;
    for name in ["late", "later"] {
        ctl(&["stream", "create", name, "--shards", "1"]);
        served(&a, name).await;
    }
    let m = b.http_get_as("/metrics", Some(&admin));
    let renewals = m
        .lines()
        .find_map(|l| l.strip_prefix("felix_node_credential_renewals_total "))
        .and_then(|v| v.parse::<u64>().ok())
        .expect("the renewal counter");
    assert!(renewals >= 1, "{m}");
    assert!(
        m.contains("felix_node_credential_renewal_failures_total 0"),
        "{m}"
    );
}

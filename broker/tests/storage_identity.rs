//! The durable directory's storage identity (replication rule 9) across real stops: a
//! SIGKILL on this boot keeps it (syncfs succeeds), a SIGTERM drain records a clean stop and
//! keeps it, `felix-broker restore-point` rotates it and the next start keeps the new one, and
//! an unreadable record rotates it. Registered with a control plane, the identity is what the
//! broker record shows, and its revision moves only when it rotates.
mod common;

use common::cp::{eventually, start_control_plane};
use common::Broker;
use std::path::Path;
use std::time::Duration;

fn record(durable: &Path) -> serde_json::Value {
    let path = durable.join("storage-identity.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn id(durable: &Path) -> String {
    record(durable)["id"].as_str().unwrap().to_string()
}

/// `felix-broker restore-point --durable-storage-dir DIR`, which must succeed.
fn restore_point(durable: &str) -> std::process::Output {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_felix-broker"))
        .args(["restore-point", "--durable-storage-dir", durable])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    out
}

#[test]
fn the_storage_identity_survives_process_stops_and_rotates_by_hand_or_on_doubt() {
    let data = tempfile::tempdir().unwrap();
    let durable = data.path().join("durable");
    let durable_arg = durable.to_str().unwrap().to_string();
    let args = ["--durable-storage-dir", durable_arg.as_str()];

    let b = Broker::start_in(data, 1, &args);
    let first = id(&durable);
    assert_eq!(first.len(), 16, "{first}");
    assert_eq!(record(&durable)["clean"], false, "running: not clean");

    // SIGKILL: no shutdown path runs. Same boot, syncfs succeeds: kept.
    let data = b.kill();
    let b = Broker::start_in(data, 1, &args);
    assert_eq!(
        id(&durable),
        first,
        "a process crash on this boot keeps the identity"
    );

    // SIGTERM: the drain closes (fsyncs) every log and records the clean stop.
    b.signal(libc::SIGTERM);
    let (code, data) = b.wait_exit(Duration::from_secs(20));
    assert_eq!(code, Some(0));
    assert_eq!(record(&durable)["clean"], true);
    let b = Broker::start_in(data, 1, &args);
    assert_eq!(id(&durable), first);
    assert_eq!(record(&durable)["clean"], false);
    let data = b.kill();

    // By hand, after a restore: a new identity, which the next start keeps.
    let out = restore_point(&durable_arg);
    let second = id(&durable);
    assert_ne!(second, first);
    assert!(String::from_utf8_lossy(&out.stdout).contains(&second));
    let b = Broker::start_in(data, 1, &args);
    assert_eq!(id(&durable), second);
    let data = b.kill();

    // A usage error is exit 2 and changes nothing.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_felix-broker"))
        .args(["restore-point", &durable_arg])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(id(&durable), second);

    // Doubt: an unreadable record beside the data rotates the identity.
    std::fs::write(durable.join("storage-identity.json"), b"{garbled").unwrap();
    let b = Broker::start_in(data, 1, &args);
    let third = id(&durable);
    assert!(third != second && third != first);
    drop(b);
}

/// The control plane's broker 1, once it shows incarnation `incarnation`.
async fn registered(url: &str, incarnation: u64) -> serde_json::Value {
    let url = format!("{url}/v1/brokers/1");
    eventually("broker 1 registered", || {
        let url = url.clone();
        async move {
            let b: serde_json::Value = reqwest::get(&url)
                .await
                .map_err(|e| e.to_string())?
                .json()
                .await
                .map_err(|e| e.to_string())?;
            if b["incarnation"] == incarnation {
                Ok(b)
            } else {
                Err(format!("{b}"))
            }
        }
    })
    .await
}

#[test]
fn the_control_plane_holds_the_identity_each_registration_names() {
    let cp = start_control_plane(120_000);
    let data = tempfile::tempdir().unwrap();
    let durable = data.path().join("durable");
    let durable_arg = durable.to_str().unwrap().to_string();
    let args = [
        "--controlplane-url",
        cp.url.as_str(),
        "--node-id",
        "1",
        "--durable-storage-dir",
        durable_arg.as_str(),
    ];
    let rt = tokio::runtime::Runtime::new().unwrap();

    let b = Broker::start_in(data, 1, &args);
    let first = id(&durable);
    let reg = rt.block_on(registered(&cp.url, 1));
    assert_eq!(reg["storage_id"], first.as_str(), "{reg}");
    let since = reg["storage_id_since"].as_u64().expect("a revision");

    // A process crash keeps the identity, and the control plane keeps its revision.
    let data = b.kill();
    let b = Broker::start_in(data, 1, &args);
    let reg = rt.block_on(registered(&cp.url, 2));
    assert_eq!(reg["storage_id"], first.as_str(), "{reg}");
    assert_eq!(reg["storage_id_since"], since, "{reg}");

    // A restore point rotates it: the control plane sees the new one from a later revision.
    let data = b.kill();
    restore_point(&durable_arg);
    let second = id(&durable);
    let b = Broker::start_in(data, 1, &args);
    let reg = rt.block_on(registered(&cp.url, 3));
    assert_eq!(reg["storage_id"], second.as_str(), "{reg}");
    assert!(reg["storage_id_since"].as_u64().unwrap() > since, "{reg}");
    drop(b);
}

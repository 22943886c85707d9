//! `felix-broker --print-config` round trip: the effective configuration printed from flags
//! and environment, fed back as the YAML file (JSON is YAML), prints the same configuration.

use std::process::Command;

fn print_config(args: &[&str], env: &[(&str, &str)]) -> serde_json::Value {
    let mut c = Command::new(env!("CARGO_BIN_EXE_felix-broker"));
    c.arg("--print-config").args(args);
    for k in [
        "FELIX_CONFIG",
        "FELIX_CORES",
        "FELIX_RING_RECORDS_MAX",
        "FELIX_MAX_SUBSCRIPTIONS",
    ] {
        c.env_remove(k);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().expect("run felix-broker");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

#[test]
fn print_config_round_trips_through_the_config_file() {
    let first = print_config(
        &[
            "--cores",
            "1",
            "--max-subscriptions",
            "77",
            "--log-format",
            "json",
        ],
        &[("FELIX_RING_RECORDS_MAX", "999")],
    );
    assert_eq!(first["max_subscriptions"], 77);
    assert_eq!(first["ring_records_max"], 999);
    assert_eq!(first["cores"], 1);
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("effective.yaml");
    std::fs::write(&p, serde_json::to_string_pretty(&first).unwrap()).unwrap();
    let again = print_config(&["--config", p.to_str().unwrap()], &[]);
    assert_eq!(
        again, first,
        "the printed configuration is a config file for itself"
    );
    // And a flag still wins over the file.
    let over = print_config(
        &["--config", p.to_str().unwrap(), "--max-subscriptions", "5"],
        &[],
    );
    assert_eq!(over["max_subscriptions"], 5);
}

//! `felix-broker inspect segments <durable-dir> [TENANT/NAMESPACE/STREAM/SHARD] [--json]`:
//! strictly read-only. Lists each log's segments, checks every record's CRC and each sealed
//! index against one rebuilt from its segment, and prints the verdict startup would reach.
//! Exit 0 clean, 6 startup would repair, 7 startup would refuse or data is corrupt, 2 usage.

use felix_storage::inspect::{find_logs, inspect_log, LogReport, EXIT_CLEAN};
use std::path::PathBuf;

const USAGE: &str = "usage: felix-broker inspect segments <durable-storage-dir> [TENANT/NAMESPACE/STREAM/SHARD] [--json]";

pub fn main(args: &[String]) -> i32 {
    let mut json = false;
    let mut pos = Vec::new();
    for a in args {
        match a.as_str() {
            "--json" => json = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return 0;
            }
            s if s.starts_with('-') => {
                eprintln!("unknown option {s}\n{USAGE}");
                return 2;
            }
            s => pos.push(s.to_string()),
        }
    }
    if pos.first().map(String::as_str) != Some("segments") || !(2..=3).contains(&pos.len()) {
        eprintln!("{USAGE}");
        return 2;
    }
    let root = PathBuf::from(&pos[1]);
    if !root.is_dir() {
        eprintln!("{}: not a directory", root.display());
        return 2;
    }
    let dirs = match pos.get(2) {
        Some(sel) => {
            let parts: Vec<&str> = sel.split('/').collect();
            let [t, n, s, shard] = parts[..] else {
                eprintln!("selector must be TENANT/NAMESPACE/STREAM/SHARD\n{USAGE}");
                return 2;
            };
            let Ok(shard) = shard.parse::<u32>() else {
                eprintln!("shard must be a number");
                return 2;
            };
            let name = felix_quic::wire::StreamName::new(t, n, s);
            let d = crate::core::shard_dir(&root, &name, shard);
            if !d.is_dir() {
                eprintln!("{}: no such shard log", d.display());
                return 2;
            }
            vec![d]
        }
        None => match find_logs(&root) {
            Ok(v) => v,
            Err(e) => {
                eprintln!("{}: {e}", root.display());
                return 2;
            }
        },
    };
    let mut worst = EXIT_CLEAN;
    for d in dirs {
        let report = match inspect_log(&d) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("{}: {e}", d.display());
                return 2;
            }
        };
        worst = worst.max(report.exit_code);
        if json {
            println!(
                "{}",
                serde_json::to_string(&report).expect("report serializes")
            );
        } else {
            print_table(&report);
        }
    }
    worst
}

fn print_table(r: &LogReport) {
    println!("{}", r.dir);
    println!(
        "  {:>20}  {:>12}  {:>9}  {:>20}  {:<8}  data",
        "segment", "bytes", "records", "end offset", "index"
    );
    for s in &r.segments {
        println!(
            "  {:>20}  {:>12}  {:>9}  {:>20}  {:<8}  {}",
            s.base, s.file_bytes, s.records, s.end_offset, s.index, s.data
        );
    }
    for p in &r.problems {
        println!("  problem: {p}");
    }
    println!("  startup: {}   (exit {})", r.startup, r.exit_code);
}

//! Helpers the log tests share: an executor to run in, a small configuration that rolls
//! segments often, deterministic payloads, and appending and reading them back.
#![allow(dead_code)] // each test file uses its own subset

use felix_storage::log::{FsyncMode, Log, LogConfig};
use felix_storage::RecordIn;
use std::future::Future;
use std::path::PathBuf;

pub fn run<F, Fut>(f: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    glommio::LocalExecutorBuilder::default()
        .io_memory(1 << 20)
        .spawn(move || async move { f().await })
        .unwrap()
        .join()
        .unwrap();
}

pub fn small(fsync: FsyncMode) -> LogConfig {
    LogConfig {
        segment_bytes_max: 64 << 10,
        commit_bytes_max: 16 << 10,
        pending_bytes_max: 1 << 20,
        index_interval_bytes: 8 << 10,
        fsync,
        ..LogConfig::default()
    }
}

pub fn payload(i: u64) -> Vec<u8> {
    let n = 1 + (i * 7919 % 1500) as usize;
    (0..n).map(|k| (i as usize * 31 + k) as u8).collect()
}

pub async fn append_n(log: &Log, from: u64, n: u64, batch: u64) -> u64 {
    append_n_in(log, None, from, n, batch).await
}

/// [`append_n`] in generation `gen` (`None`: the log's newest, as `Log::append` does).
pub async fn append_n_in(log: &Log, gen: Option<u64>, from: u64, n: u64, batch: u64) -> u64 {
    let mut last = 0;
    let mut i = from;
    while i < from + n {
        let ps: Vec<Vec<u8>> = (i..(i + batch).min(from + n)).map(payload).collect();
        let recs: Vec<RecordIn> = ps.iter().map(|p| RecordIn::new(p)).collect();
        let r = match gen {
            Some(g) => log.append_in(g, &recs, 1000 + i),
            None => log.append(&recs, 1000 + i),
        }
        .unwrap();
        assert_eq!(r.start, i, "offsets are assigned contiguously");
        i = r.end;
        last = r.end;
    }
    log.wait_acked(last).await.unwrap();
    last
}

pub async fn check_all(log: &Log, from: u64, to: u64) {
    let mut at = from;
    while at < to {
        let got = log.read(at, 37, 20_000).await.unwrap();
        assert!(!got.is_empty(), "read at {at} returned nothing");
        for r in got {
            assert_eq!(r.offset, at);
            assert_eq!(&r.payload[..], &payload(at)[..], "payload of {at}");
            at += 1;
        }
    }
}

pub fn dir() -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let p = t.path().join("log");
    (t, p)
}

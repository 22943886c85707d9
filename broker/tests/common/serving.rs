//! The brokers' serving intervals (issue 23: "at most one broker serves"). A broker logs each
//! change of whether a hosted replica serves (target `felix::serving`), on CLOCK_MONOTONIC,
//! which every process on the machine shares. The harness keeps those lines per broker
//! process and the time each process was seen gone, and checks that no two intervals of one
//! shard overlap.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// The `felix::serving` lines one broker process wrote, in order.
pub type Lines = Arc<Mutex<Vec<String>>>;

/// Lines kept per process, at most (a process logs one per change of leadership).
pub const LINES_MAX: usize = 100_000;

/// CLOCK_MONOTONIC in nanoseconds, the clock the brokers log on.
pub fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// One broker process as the harness saw it.
#[derive(Clone)]
pub struct Process {
    pub node: u64,
    pub lines: Lines,
    /// When it was seen gone (killed and reaped, or exited): it served nothing after.
    pub gone_ns: Option<u64>,
}

/// One interval in which a broker served a shard, both ends counted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interval {
    pub node: u64,
    /// Which process of the node (its index in the harness's list).
    pub process: usize,
    /// `stream incarnation shard`.
    pub shard: String,
    pub gen: u64,
    pub from_ns: u64,
    pub to_ns: u64,
}

/// The value of `key=` in a log line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// The intervals the processes' lines give, for every shard. An interval a process never
/// ended runs until the process was seen gone, or `now_ns` if it still runs. A line that
/// does not parse, an end without a start, or a second start fails the test: the log is the
/// evidence, so it must be whole.
pub fn intervals(procs: &[Process], now_ns: u64) -> Vec<Interval> {
    let mut out = Vec::new();
    for (process, p) in procs.iter().enumerate() {
        let mut open: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        let interval = |shard, gen, from_ns, to_ns| Interval {
            node: p.node,
            process,
            shard,
            gen,
            from_ns,
            to_ns,
        };
        for line in p.lines.lock().unwrap().iter() {
            let shard = match (
                field(line, "stream"),
                field(line, "incarnation"),
                field(line, "shard"),
            ) {
                (Some(s), Some(i), Some(n)) => format!("{s} {i} {n}"),
                _ => panic!("node {}: a serving line without its shard: {line}", p.node),
            };
            let num = |k: &str| field(line, k).map(|v| v.parse::<u64>().unwrap());
            let gen = num("gen").unwrap_or_else(|| panic!("no gen: {line}"));
            if let Some(from_ns) = num("from_mono_ns") {
                let old = open.insert(shard.clone(), (gen, from_ns));
                assert!(
                    old.is_none(),
                    "node {}: {shard} started twice: {line}",
                    p.node
                );
            } else if let Some(to_ns) = num("to_mono_ns") {
                let (g, from_ns) = open
                    .remove(&shard)
                    .unwrap_or_else(|| panic!("node {}: an end without a start: {line}", p.node));
                assert_eq!(g, gen, "node {}: {line}", p.node);
                assert!(
                    from_ns <= to_ns,
                    "node {}: ends before it starts: {line}",
                    p.node
                );
                out.push(interval(shard, gen, from_ns, to_ns));
            } else {
                panic!("node {}: a serving line with no time: {line}", p.node);
            }
        }
        let to_ns = p.gone_ns.unwrap_or(now_ns);
        for (shard, (gen, from_ns)) in open {
            out.push(interval(shard, gen, from_ns, to_ns));
        }
    }
    out
}

/// Two intervals of one shard that overlap, from two processes, if any.
pub fn overlap(all: &[Interval]) -> Option<(Interval, Interval)> {
    for (i, a) in all.iter().enumerate() {
        for b in &all[i + 1..] {
            let apart = a.to_ns < b.from_ns || b.to_ns < a.from_ns;
            if a.shard == b.shard && a.process != b.process && !apart {
                return Some((a.clone(), b.clone()));
            }
        }
    }
    None
}

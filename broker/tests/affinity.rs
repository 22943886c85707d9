//! The broker respects its CPU affinity: executors are pinned to the CPUs the process may run
//! on (`taskset`, systemd `CPUAffinity=`) or to `--cpu-list`, never to CPU i blindly; `--cores`
//! defaults to the number of those CPUs. Checked on the real binary through
//! `/proc/<pid>/task/*/status` of the executor threads (`felix-core-N-*`). Needs CPUs 0 and 1.

mod common;

use common::Broker;

/// `(felix-core-N, Cpus_allowed_list)` of each thread of `pid` that belongs to executor N,
/// sorted. glommio names an executor's thread `<name>-<executor id>` (`felix-core-0-1`); its
/// blocking-pool threads inherit that name.
fn core_threads(pid: u32) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let status = std::fs::read_to_string(t.unwrap().path().join("status")).unwrap_or_default();
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.trim().to_string())
        };
        let name = field("Name:").unwrap_or_default();
        let Some(rest) = name.strip_prefix("felix-core-") else {
            continue;
        };
        let n = rest.split('-').next().unwrap_or("");
        if n.parse::<usize>().is_ok() {
            out.push((
                format!("felix-core-{n}"),
                field("Cpus_allowed_list:").expect("Cpus_allowed_list"),
            ));
        }
    }
    out.sort();
    out
}

/// The distinct executor names, and the CPU lists their threads may run on.
fn executors(b: &Broker) -> (Vec<String>, Vec<String>) {
    let t = core_threads(b.pid());
    let mut names: Vec<String> = t.iter().map(|(n, _)| n.clone()).collect();
    names.dedup();
    let mut cpus: Vec<String> = t.into_iter().map(|(_, c)| c).collect();
    cpus.dedup();
    (names, cpus)
}

fn have_cpus_0_and_1() -> bool {
    let allowed = felix_broker::config::allowed_cpus();
    if allowed.contains(&0) && allowed.contains(&1) {
        return true;
    }
    eprintln!("SKIP: this test needs CPUs 0 and 1 in its own affinity, has {allowed:?}");
    false
}

#[test]
fn under_taskset_the_broker_runs_one_core_per_allowed_cpu_pinned_there() {
    if !have_cpus_0_and_1() {
        return;
    }
    let b = Broker::try_start_with_prefix(&["taskset", "-c", "1"], &[]).unwrap();
    let (names, cpus) = executors(&b);
    assert_eq!(names, ["felix-core-0"], "one core: the allowed set's size");
    assert_eq!(cpus, ["1"], "its executor pinned to CPU 1, not CPU 0");
    let counters = b.counters();
    assert!(
        !counters.is_empty() && counters.values().all(|v| v.len() == 1),
        "/metrics shows one core: {counters:?}"
    );
}

#[test]
fn cpu_list_picks_the_cpus_and_one_outside_the_allowed_set_is_refused() {
    if !have_cpus_0_and_1() {
        return;
    }
    // Both CPUs allowed, CPU 1 asked for: one core, on CPU 1.
    let b = Broker::try_start_with_prefix(&["env"], &["--cpu-list", "1"]).unwrap();
    assert_eq!(
        executors(&b),
        (vec!["felix-core-0".to_string()], vec!["1".to_string()])
    );
    drop(b);
    // A CPU the process may not run on (through FELIX_CPU_LIST): exit 2, naming both sets.
    let e = Broker::try_start_with_prefix(&["env", "FELIX_CPU_LIST=0", "taskset", "-c", "1"], &[])
        .err()
        .expect("CPU 0 outside taskset -c 1 refused");
    assert!(e.contains("(exit Some(2))"), "{e}");
    assert!(
        e.contains("cpu_list: CPU 0") && e.contains("allowed: 1"),
        "{e}"
    );
    // More cores than the list holds.
    let e = Broker::try_start_with_prefix(&["env"], &["--cpu-list", "1", "--cores", "2"])
        .err()
        .expect("two cores on a one-CPU list refused");
    assert!(
        e.contains("(exit Some(2))") && e.contains("cores (2)"),
        "{e}"
    );
}

#[test]
fn more_cores_than_allowed_cpus_run_unpinned_within_the_allowed_set() {
    if !have_cpus_0_and_1() {
        return;
    }
    let b = Broker::try_start_with_prefix(&["taskset", "-c", "1"], &["--cores", "2"]).unwrap();
    let (names, cpus) = executors(&b);
    assert_eq!(names, ["felix-core-0", "felix-core-1"]);
    assert_eq!(cpus, ["1"], "both stay inside the allowed set");
}

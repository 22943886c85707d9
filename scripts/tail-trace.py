#!/usr/bin/env python3
"""Who ran on each CPU while the slowest messages were in flight. Reads felix-loadgen's
latency result (with --outliers-us: each outlier's CLOCK_MONOTONIC publish time and its
delivered-to-all latency) and `perf script -F comm,tid,cpu,time,ip,sym` of a system-wide
`perf record -k mono -e cpu-clock` taken during the run. For each CPU it prints the share of
samples per task inside the outlier windows against the whole run, and the commonest symbols
inside them. A task that is rare overall but common inside the windows is where the tail comes
from. Usage: scripts/tail-trace.py RESULT.json SCRIPT.txt"""
import bisect, collections, json, re, sys

def main():
    result = json.load(open(sys.argv[1]))
    outs = sorted(result.get("outliers") or [])
    print(f"delivered-to-all {result['all_f']}; {len(outs)} outliers listed")
    per_cpu = collections.defaultdict(list)
    for line in open(sys.argv[2]):
        m = re.match(r"\s*(\S.*?)\s+(\d+)\s+\[(\d+)\]\s+([0-9]+\.[0-9]+):\s*(?:[0-9a-f]+\s+)?(.*)$", line)
        if m:
            per_cpu[int(m.group(3))].append((float(m.group(4)), m.group(1), m.group(5).strip()))
    for cpu in sorted(per_cpu):
        ss = sorted(per_cpu[cpu])
        times = [t for t, _, _ in ss]
        overall = collections.Counter(c for _, c, _ in ss)
        inside, syms = collections.Counter(), collections.Counter()
        for at_ns, us in outs:
            a = at_ns / 1e9
            i, j = bisect.bisect_left(times, a), bisect.bisect_right(times, a + us / 1e6)
            for _, comm, sym in ss[i:j]:
                inside[comm] += 1
                syms[(comm, sym.split("+")[0][:70])] += 1
        n_in, n_all = sum(inside.values()) or 1, sum(overall.values()) or 1
        print(f"cpu {cpu}: share of samples inside the outlier windows / over the run")
        for comm, n in inside.most_common(6):
            print(f"  {100 * n / n_in:5.1f}% / {100 * overall[comm] / n_all:5.1f}%  {comm}")
        for (comm, sym), n in syms.most_common(6):
            print(f"      {n:6d}  {comm:18} {sym or '?'}")

main()

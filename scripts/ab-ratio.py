#!/usr/bin/env python3
"""Ratios of medians B / A per case from an A/B campaign (scripts/bench-ab.sh), each with a
bootstrap 95% interval (10,000 resamples of each side, fixed seed). Throughput cases compare
MB/s per subscriber (above 1.0: B is faster), latency and connect cases p99 and p50 in microseconds (below
1.0: B is faster). A throughput interval wholly below 1.0, or a p99 interval wholly above 1.0,
is a regression. Usage: scripts/ab-ratio.py OUT.jsonl [--md]"""
import json, random, statistics, sys
from collections import defaultdict

def main():
    path = sys.argv[1]
    md = "--md" in sys.argv
    runs = defaultdict(list)
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        side, case = d["case"].split(" ", 1)
        runs[(case, side)].append(d)
    rng = random.Random(20261204)
    cases = sorted({c for c, _ in runs}, key=lambda c: (not c.startswith("tp"), c))
    rows = []
    for case in cases:
        a, b = runs.get((case, "A"), []), runs.get((case, "B"), [])
        if not a or not b:
            continue
        # Latency: publish to delivered-to-all (`all_f`), as the campaigns quote it.
        # Connect: a fresh connection's handshake to its first ack (felix-loadgen --mode connect).
        if case.startswith("tp"):
            metrics = [(("per_sub_mb_per_s_avg",), "MB/s per subscriber", "higher")]
        elif case.startswith("connect"):
            metrics = [(("connect", "p99"), "p99 µs", "lower"), (("connect", "p50"), "p50 µs", "lower")]
        else:
            metrics = [(("all_f", "p99"), "p99 µs", "lower"), (("all_f", "p50"), "p50 µs", "lower")]
        def get(r, path):
            for k in path:
                r = r.get(k) if isinstance(r, dict) else None
            return r
        for key, label, better in metrics:
            xa = [get(r, key) for r in a if get(r, key) is not None]
            xb = [get(r, key) for r in b if get(r, key) is not None]
            ratio = statistics.median(xb) / statistics.median(xa)
            boots = []
            for _ in range(10000):
                ra = [rng.choice(xa) for _ in xa]
                rb = [rng.choice(xb) for _ in xb]
                boots.append(statistics.median(rb) / statistics.median(ra))
            boots.sort()
            lo, hi = boots[250], boots[9749]
            regress = (better == "higher" and hi < 1.0) or (better == "lower" and label.startswith("p99") and lo > 1.0)
            rows.append((case, label, len(xa), len(xb), statistics.median(xa), statistics.median(xb),
                         ratio, lo, hi, "REGRESSION" if regress else "ok"))
    if md:
        print("| case | metric | runs A / B | median A | median B | B / A | 95% interval | verdict |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r[0]} | {r[1]} | {r[2]} / {r[3]} | {r[4]:.1f} | {r[5]:.1f} | **{r[6]:.3f}** | {r[7]:.3f}–{r[8]:.3f} | {r[9]} |")
    else:
        for r in rows:
            print(f"{r[0]:12} {r[1]:20} A={r[4]:9.1f} B={r[5]:9.1f} B/A={r[6]:.3f} [{r[7]:.3f}, {r[8]:.3f}] {r[9]}")
    sys.exit(1 if any(r[9] == "REGRESSION" for r in rows) else 0)

main()

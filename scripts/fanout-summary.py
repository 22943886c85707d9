#!/usr/bin/env python3
"""Summarize felix-loadgen fanout-scale lines (scripts/bench-fanout-scale.sh): per case the
median delivered/s over the valid runs, its range, losses, exactness, latency, CPU and broker
memory per subscription; then, for cases run with and without the subscription mux (tag
-nomux), the ratio of medians. A run whose load core used >= 0.95 cores measures the client,
not the broker: it is left out and listed.
With --png PATH, a chart of the medians, with and without the mux (needs matplotlib).
Usage: scripts/fanout-summary.py RESULTS.jsonl [--png PATH]"""
import json
import statistics
import sys
from collections import defaultdict

INVALID_CORES = 0.95


def main(path):
    runs = defaultdict(list)
    for line in open(path):
        d = json.loads(line)
        runs[d["case"]].append(d)
    med = {}
    print("| case | runs (invalid) | delivered/s (median) | range | lossless runs | out of order | p50 / p99 ms | client / broker cores | client µs per delivery | broker bytes per sub |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in sorted(runs, key=lambda c: (c.replace("-nomux", ""), c)):
        rs = runs[case]
        cpu = lambda r: r.get("delivery_phase_cpu") or {}
        valid = [r for r in rs if (cpu(r).get("client_cores") or 0) < INVALID_CORES]
        invalid = len(rs) - len(valid)
        if not valid:
            print(f"| {case} | 0 ({invalid}) | – | – | – | – | – | – | – | – |")
            continue
        m = lambda f: statistics.median(f(r) for r in valid)
        d = [r["delivered_per_s"] for r in valid]
        med[case] = statistics.median(d)
        lossless = sum(1 for r in valid if r["lossless"])
        unordered = sum(r.get("subs_out_of_order", 0) for r in valid)
        p50 = m(lambda r: r["latency_sampled"]["p50"]) / 1000
        p99 = m(lambda r: r["latency_sampled"]["p99"]) / 1000
        cc = m(lambda r: cpu(r).get("client_cores") or 0)
        bc = m(lambda r: cpu(r).get("broker_cores") or 0)
        us = m(lambda r: cpu(r).get("client_us_per_delivery") or 0)
        rss = m(lambda r: r.get("broker_rss_per_sub_bytes") or 0)
        print(f"| {case} | {len(valid)} ({invalid}) | {med[case]:,.0f} | {min(d):,.0f}–{max(d):,.0f} | "
              f"{lossless}/{len(valid)} | {unordered} | {p50:.1f} / {p99:.1f} | {cc:.2f} / {bc:.2f} | {us:.2f} | {rss:,.0f} |")
    print()
    for case in sorted(med):
        base = case + "-nomux"
        if base in med:
            print(f"- {case}: mux / no mux = {med[case] / med[base]:.2f}x the deliveries/s")
    bad = [(c, r) for c, rs in runs.items() for r in rs
           if ((r.get("delivery_phase_cpu") or {}).get("client_cores") or 0) >= INVALID_CORES]
    if bad:
        print()
        print("Invalid runs (load core saturated), each: case, delivered/s, client / broker cores:")
        for c, r in bad:
            cpu = r["delivery_phase_cpu"]
            print(f"- {c}: {r['delivered_per_s']:,.0f}, {cpu['client_cores']} / {cpu['broker_cores']}")
    if "--png" in sys.argv:
        chart(med, sys.argv[sys.argv.index("--png") + 1])


def chart(med, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no chart)", file=sys.stderr)
        return
    cases = sorted({c.replace("-nomux", "") for c in med})
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, (suffix, label) in enumerate([("", "subscription mux"), ("-nomux", "a stream per subscription")]):
        ys = [med.get(c + suffix, 0) for c in cases]
        ax.bar([x + i * 0.4 for x in range(len(cases))], ys, 0.4, label=label)
    ax.set_xticks([x + 0.2 for x in range(len(cases))], cases)
    ax.set_ylabel("deliveries/s (median of valid runs)")
    ax.set_title("Stream fanout on one shard, broker on one core (this machine)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    main(sys.argv[1])

#!/usr/bin/env python3
"""Summarize a bench-vs-nats JSONL file: per case, the median over runs of each side's
figure, and the Felix / NATS ratio of the medians. Prints a Markdown table.

Throughput cases compare per-subscriber MB/s (higher is better) and report records lost;
latency cases compare publish->delivered-to-all p50/p99 in microseconds (lower is better)."""
import json
import statistics
import sys


def figures(d):
    """(name, value) pairs of one result line, Felix or peer-bench."""
    if d.get("tool") == "felix-loadgen":
        if d["mode"] == "throughput":
            return {"MB/s per sub": d["per_sub_mb_per_s_avg"], "lost": d["lost"]}
        if d["mode"] == "latency":
            return {"p50 us": d["all_f"]["p50"], "p99 us": d["all_f"]["p99"]}
    else:
        r = d["result"]
        if d["mode"] == "core-throughput":
            return {"MB/s per sub": r["per_sub_mb_per_s_avg"], "lost": r["total_lost"]}
        if d["mode"] == "core-latency":
            a = r["all_subscribers_delivered"]
            return {"p50 us": a["p50_us"], "p99 us": a["p99_us"]}
    return {}


def median(xs):
    return statistics.median(xs) if xs else None


def main(path):
    runs = {}
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        side, case = d["case"].split(" ", 1)
        for k, v in figures(d).items():
            runs.setdefault((case, k), {}).setdefault(side, []).append(v)
    print("| case | figure | Felix median | NATS-TLS median | Felix / NATS | runs |")
    print("|---|---|---|---|---|---|")
    for (case, k), sides in sorted(runs.items()):
        f, n = median(sides.get("felix", [])), median(sides.get("nats-tls", []))
        ratio = f"{f / n:.2f}" if f is not None and n else "-"
        if k == "lost":
            ratio = "-"
        fs = f"{f:.1f}" if f is not None else "-"
        ns = f"{n:.1f}" if n is not None else "-"
        count = max(len(v) for v in sides.values())
        print(f"| {case} | {k} | {fs} | {ns} | {ratio} | {count} |")


if __name__ == "__main__":
    main(sys.argv[1])

#!/usr/bin/python3
"""The campaign chart: medians per case and side from a bench-vs-nats JSONL file, as grouped
bars in one PNG (throughput MB/s per subscriber; latency p99; acked ingest per second).
Usage: bench-chart.py IN.jsonl OUT.png   (needs python3-matplotlib)
The medians are the same ones `felix-loadgen --mode summarize` prints; this only draws them."""
import json
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SIDES = [("felix", "Felix", "#2b6cb0"), ("felix-1350", "Felix, 1,350 B packets", "#90cdf4"),
         ("nats-tls", "NATS + TLS", "#c53030"), ("nats", "NATS, no TLS", "#f6ad55")]


def figure(d):
    """(panel, value) of one result line, or None."""
    m, r = d.get("mode"), d.get("result", {})
    if d.get("tool") == "felix-loadgen":
        if m == "throughput":
            # 0-byte records carry no MB/s (SUMMARY.md has their msgs/s): not charted.
            return ("tp", d.get("per_sub_mb_per_s_avg")) if d.get("payload") else None
        if m == "latency":
            return "lat", d.get("all_f", {}).get("p99")
        if m == "ingest":
            return "ingest", d.get("acks_per_s")
    else:
        if m == "core-throughput":
            return "tp", r.get("per_sub_mb_per_s_avg")
        if m == "core-latency":
            return "lat", r.get("all_subscribers_delivered", {}).get("p99_us")
        if m == "js-publish":
            return "ingest", r.get("publishes_per_s")
    return None


def main(src, dst):
    runs = {}
    for line in open(src):
        line = line.strip()
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        side, _, case = d.get("case", "").partition(" ")
        f = figure(d)
        if not case or f is None or f[1] is None:
            continue
        runs.setdefault(f[0], {}).setdefault(case, {}).setdefault(side, []).append(float(f[1]))
    panels = [("tp", "throughput, MB/s per subscriber (higher is better)"),
              ("lat", "latency p99, µs (lower is better)"),
              ("ingest", "acked durable publishes per second (higher is better)")]
    panels = [p for p in panels if p[0] in runs]
    widths = [max(2, len(runs[p])) for p, _ in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 + 1.1 * sum(widths), 5),
                             gridspec_kw={"width_ratios": widths}, squeeze=False)
    for ax, (p, title) in zip(axes[0], panels):
        cases = sorted(runs[p])
        present = [s for s in SIDES if any(s[0] in runs[p][c] for c in cases)]
        w = 0.8 / max(1, len(present))
        for k, (side, label, color) in enumerate(present):
            xs, ys = [], []
            for i, c in enumerate(cases):
                if side in runs[p][c]:
                    xs.append(i + (k - (len(present) - 1) / 2) * w)
                    ys.append(statistics.median(runs[p][c][side]))
            ax.bar(xs, ys, w, label=label, color=color)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases, rotation=45, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
        if p == "tp":
            ax.set_yscale("log")  # 8 B and 4 KiB payloads differ by two orders of magnitude
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Felix vs NATS, medians of alternated runs ({src.split('/')[-1]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: bench-chart.py IN.jsonl OUT.png")
    main(sys.argv[1], sys.argv[2])

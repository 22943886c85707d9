#!/usr/bin/env python3
"""Summary of a watch-fanout campaign (scripts/bench-watch-vs-peers.sh): per case and system the
median puts/s achieved, events/s delivered, change-to-watcher p50/p99 (ms), watchers complete,
client and server CPU (cores) and broker/server memory per watcher; then each Felix/etcd
ratio (events/s: above 1 is Felix ahead; p99: below 1 is Felix ahead). A run whose load core
was saturated (client >= 0.95 cores) measured the client, not the server: it is marked
invalid and left out of the medians. With --png PATH, a chart (needs matplotlib).
Usage: scripts/watch-summary.py OUT.jsonl [--png PATH]"""
import json, statistics, sys
from collections import defaultdict

def row(d):
    r = d.get("result", d)  # peer-bench nests its figures under "result"
    cpu = r.get("watch_phase_cpu") or {}
    lat = r.get("change_to_watcher_latency") or {}
    return {
        "puts_s": r.get("write_rate"),
        "events_s": r.get("delivered_per_s"),
        "p50_ms": lat.get("p50", 0) / 1000,
        "p99_ms": lat.get("p99", 0) / 1000,
        "complete": r.get("watchers_complete"),
        "watchers": r.get("watchers"),
        "client": cpu.get("client_cores"),
        "server": cpu.get("broker_cores", cpu.get("server_cores")),
        "rss_w": r.get("broker_rss_per_watcher_bytes") if d.get("tool") == "felix-loadgen"
                 else r.get("broker_rss_delta_per_watcher_bytes"),
    }

def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None

def fmt(x, nd=1):
    if x is None:
        return "–"
    return f"{x:,.{nd}f}" if isinstance(x, float) else f"{x:,}"

def main():
    path = sys.argv[1]
    runs = defaultdict(list)
    invalid = defaultdict(int)
    for line in open(path):
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        system, case = d["case"].split(" ", 1)
        r = row(d)
        if r["client"] is not None and r["client"] >= 0.95:
            invalid[(case, system)] += 1
            continue
        runs[(case, system)].append(r)
    cases = sorted({c for c, _ in runs} | {c for c, _ in invalid})
    present = {s for _, s in runs} | {s for _, s in invalid}
    systems = [s for s in ["felix", "felix-task", "felix-nomux", "etcd", "nats-kv"] if s in present]
    print("| case | system | runs (invalid) | puts/s | events/s | p50 / p99 ms | complete (each run) | client / server cores | bytes per watcher |")
    print("|---|---|---|---|---|---|---|---|---|")
    meds = {}
    for c in cases:
        for s in systems:
            rs = runs.get((c, s), [])
            if not rs and not invalid.get((c, s)):
                continue
            m = {k: med([r[k] for r in rs]) for k in ["puts_s", "events_s", "p50_ms", "p99_ms", "client", "server", "rss_w"]}
            meds[(c, s)] = m
            comp = ", ".join(f'{r["complete"]}/{r["watchers"]}' for r in rs)
            print(f'| {c} | {s} | {len(rs)} ({invalid.get((c, s), 0)}) | {fmt(m["puts_s"])} | {fmt(m["events_s"], 0)} | '
                  f'{fmt(m["p50_ms"])} / {fmt(m["p99_ms"])} | {comp} | {fmt(m["client"], 2)} / {fmt(m["server"], 2)} | {fmt(m["rss_w"], 0)} |')
    print()
    print("| case | Felix / etcd events/s | Felix / etcd p99 | mux / no mux events/s | set / task reader events/s |")
    print("|---|---|---|---|---|")

    def over(a, b):
        return a["events_s"] / b["events_s"] if a and b and a["events_s"] and b["events_s"] else None

    for c in cases:
        f, e = meds.get((c, "felix")), meds.get((c, "etcd"))
        n, t = meds.get((c, "felix-nomux")), meds.get((c, "felix-task"))
        p99 = f["p99_ms"] / e["p99_ms"] if f and e and f["p99_ms"] and e["p99_ms"] else None
        print(f'| {c} | **{fmt(over(f, e), 2)}** | {fmt(p99, 2)} | {fmt(over(f, n), 2)} | {fmt(over(f, t), 2)} |')
    if "--png" in sys.argv:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("(no matplotlib: no chart)", file=sys.stderr)
            return
        out = sys.argv[sys.argv.index("--png") + 1]
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / max(len(systems), 1)
        for i, s in enumerate(systems):
            ys = [(meds.get((c, s)) or {}).get("events_s") or 0 for c in cases]
            ax.bar([x + i * width for x in range(len(cases))], ys, width, label=s)
        ax.set_xticks([x + width for x in range(len(cases))], cases)
        ax.set_ylabel("watch events/s delivered (median)")
        ax.set_title("Watch fanout on one key, one core each (this machine)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out)

main()

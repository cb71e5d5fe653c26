"""Per-step wall and thread CPU time of every phase in `strata train --timeline` traces.

  python3 scripts/bench/timeline_summary.py t.json t-worker1.json

For each trace: the steps after the first fifth (warm-up), the wall time per step, and for each
row (tid: replica 0, 1, ...; 65536 is the ring thread of a multi-worker job) and phase name (its
first word) the count, wall time and thread CPU time (`args.cpu_ms`) per step. A phase whose CPU
time is well under its wall time waited (on a peer, or for a core another thread held).
"""
import collections
import json
import sys


def summarize(path):
    ev = [e for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"]
    steps = [e for e in ev if e["name"] == "forward"]
    skip = steps[len(steps) // 5]["ts"] if steps else 0
    ev = [e for e in ev if e["ts"] >= skip]
    nsteps = max(1, len([e for e in ev if e["name"] == "forward"]))
    phases = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e in ev:
        k = (e["tid"], e["cat"], e["name"].split(" ")[0])
        a = phases[k]
        a[0] += 1
        a[1] += e["dur"]
        a[2] += e.get("args", {}).get("cpu_ms", 0) * 1000
    span = (max(e["ts"] + e["dur"] for e in ev) - skip) / nsteps
    print(f"{path} steps {nsteps}, wall per step {span / 1000:.2f} ms")
    for (tid, cat, name), (n, wall, cpu) in sorted(phases.items(), key=lambda kv: -kv[1][1]):
        print(
            f"  tid {tid:>5} {cat:8} {name:14} n/step={n / nsteps:5.1f} "
            f"wall/step={wall / nsteps / 1000:6.2f} ms cpu/step={cpu / nsteps / 1000:6.2f} ms"
        )


if __name__ == "__main__":
    for p in sys.argv[1:]:
        summarize(p)

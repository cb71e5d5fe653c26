"""Strata's parameter servers with an embedding table beside TensorFlow's ParameterServerStrategy,
on the same click-through model, records, batch, processes and optimizer, alternated A B A B.

  python3 scripts/bench/ctr_tables.py --strata target/release/strata --rows 20000000 --rounds 2 \
      --modes async,hybrid,sync

Strata's --modes: async and sync parameter servers (the table and the dense variables on the
ps tasks), and hybrid (the table asynchronous on the ps tasks, the dense layers all-reduced
over the workers: each worker's batch is --batch, the global one --batch x --workers, so a
worker step has the same size in every mode); and the AUC's references, one process of one
device on the same records in the same order: one-device (steps of --batch, the steps of async
and of hybrid's rows) and one-device-global (steps of --batch x --workers, sync's steps and
hybrid's dense ones). With a one-device mode, the table ends with each mode's test AUC below
the reference's (medians). A mode may carry `strata train` flags after `+`, each `name` or
`name=value`: `async+stale-rate=inverse+no-lookahead` is async with `--stale-rate inverse
--no-lookahead`.

Both sides: 2 ps tasks and 2 worker processes on loopback (--ps, --workers), one worker's batch
of 256 records per step (--batch), Adagrad at 0.05 on every variable and on the table's rows
(Keras' formulas on both sides), the table of --rows rows of --dim split over the ps tasks in
contiguous row ranges (FixedShardsPartitioner), asynchronous. Records: `strata ctr-data`
writes the files TensorFlow reads; Strata's workers generate the same records from the seed
(record i is a function of the seed and i). Steps: --records / --batch worker steps in all on
each side (TensorFlow: --warmup of them untimed, the rest timed).

Per run: examples/s (steady state, all workers together), the test AUC after the run, and the
peak RSS (VmHWM) of every worker and ps process (Strata's read from /proc while the job runs,
TensorFlow's as its script reports them). One JSON line per run, then a table of medians.
Needs the peers venv's Python with TensorFlow 2.21 for the TensorFlow side (--python).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def descendants(root):
    """Pids whose ancestry reaches root (read from /proc)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    out = []
    for pid in parent:
        p = pid
        while p in parent and p != root and p > 1:
            p = parent[p]
        if p == root and pid != root:
            out.append(pid)
    return out


def watch_rss(root, peaks, stop, hybrid=False):
    """Keeps the largest VmHWM (kB) of every descendant of root, keyed 'ps:<pid>' or 'worker:<pid>'
    (a hybrid job's workers are `strata train` processes, root itself worker 0)."""
    while not stop.is_set():
        for pid in descendants(root) + ([root] if hybrid else []):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
                with open(f"/proc/{pid}/status") as f:
                    hwm = next((int(l.split()[1]) for l in f if l.startswith("VmHWM")), 0)
            except OSError:
                continue
            kind = next((c.decode() for c in cmd[1:2] if c in (b"ps", b"worker")), None)
            if hybrid and cmd[1:2] == [b"train"]:
                kind = "worker"
            if kind:
                key = f"{kind}:{pid}"
                peaks[key] = max(peaks.get(key, 0), hwm)
        stop.wait(0.2)


def mode_flags(mode):
    """A mode's name and its extra flags: `async+stale-rate=inverse` is async, `--stale-rate inverse`."""
    name, *extra = mode.split("+")
    flags = []
    for e in extra:
        key, _, value = e.partition("=")
        flags += [f"--{key}"] + ([value] if value else [])
    return name, flags


def run_strata(a, records, label):
    out = tempfile.mktemp(suffix=".json")
    mode, flags = mode_flags(label)
    hybrid = mode == "hybrid"
    # A hybrid job's --batch is the global batch of its synchronous steps (each worker --batch).
    batch = a.batch * a.workers if mode in ("hybrid", "one-device-global") else a.batch
    if mode.startswith("one-device"):
        strategy = ["--strategy", "one-device"]
    else:
        strategy = ["--strategy", "parameter-server", "--ps-mode", mode, "--ps-tasks", str(a.ps),
                    "--workers", str(a.workers)]
    cmd = [a.strata, "train", "--model", "ctr", *strategy, "--embedding-rows", str(a.rows), "--embedding-dim", str(a.dim),
           "--train-records", str(records), "--test-records", str(a.test_records), "--batch", str(batch),
           "--optimizer", "adagrad", "--lr", "0.05", "--table-optimizer", "adagrad", "--table-lr", "0.05",
           "--seed", str(a.seed), "--no-progress", "--out", out, *flags]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks, stop = {}, threading.Event()
    watcher = threading.Thread(target=watch_rss, args=(proc.pid, peaks, stop, hybrid))
    watcher.start()
    _, err = proc.communicate(timeout=a.timeout)
    stop.set()
    watcher.join()
    if proc.returncode != 0:
        sys.exit(f"strata failed ({proc.returncode}): {err[-2000:]}")
    s = json.load(open(out))
    os.unlink(out)
    return {
        "framework": f"strata-{label}", "examples_per_s": s["examples_per_second"], "test_auc": s["final_test_auc"],
        "best_auc": s["best_test_auc"], "wall_s": time.time() - t0,
        "worker_rss_mb": sorted(v / 1024 for k, v in peaks.items() if k.startswith("worker")),
        "ps_rss_mb": sorted(v / 1024 for k, v in peaks.items() if k.startswith("ps")),
    }


def run_tf(a, data, records):
    steps = records // a.batch
    cmd = [a.python, os.path.join(HERE, "peers", "tf_ps_ctr.py"), "--data", data, "--ps", str(a.ps),
           "--workers", str(a.workers), "--batch", str(a.batch), "--dim", str(a.dim), "--optimizer", "adagrad",
           "--lr", "0.05", "--warmup", str(a.warmup), "--steps", str(steps - a.warmup), "--timeout", str(a.timeout)]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout + 60)
    if p.returncode != 0:
        sys.exit(f"tensorflow failed ({p.returncode}): {p.stderr[-2000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    # MiB, as the TensorFlow script reports each process's VmHWM.
    rss = r.get("rss_peak_mib") or {}
    workers = sorted(v for v in rss.get("worker", []) if v is not None)
    ps = sorted(v for v in rss.get("ps", []) if v is not None)
    return {"framework": "tensorflow", "examples_per_s": r["examples_per_s"], "test_auc": r["test_auc"],
            "wall_s": time.time() - t0, "worker_rss_mb": workers, "ps_rss_mb": ps, "tf": r}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strata", default="target/release/strata")
    ap.add_argument("--python", default=os.path.expanduser("~/.cache/strata/peers-venv/bin/python"))
    ap.add_argument("--rows", type=int, default=20_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--records", type=int, default=256 * 400)
    ap.add_argument("--test-records", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--ps", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--only", choices=("strata", "tensorflow"))
    ap.add_argument("--modes", default="async",
                    help="Strata's parameter-server modes, comma-separated: async, sync, hybrid")
    a = ap.parse_args()
    # The records TensorFlow reads (50 MB for the default run), removed however the run ends.
    data = tempfile.mkdtemp(prefix="ctr-records-")
    try:
        compare(a, data)
    finally:
        shutil.rmtree(data, ignore_errors=True)


def compare(a, data):
    if a.only != "strata":
        subprocess.run([a.strata, "ctr-data", "--out", data, "--train-records", str(a.records), "--test-records",
                        str(a.test_records), "--embedding-rows", str(a.rows), "--seed", str(a.seed)], check=True,
                       stdout=subprocess.DEVNULL)
    runs = []
    for _ in range(a.rounds):
        for mode in (a.modes.split(",") if a.only != "tensorflow" else []):
            runs.append(run_strata(a, a.records, mode))
            print(json.dumps(runs[-1]), flush=True)
        if a.only != "strata":
            runs.append(run_tf(a, data, a.records))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "tf"}), flush=True)
    print(f"\n{a.rows} rows x {a.dim}, {a.ps} ps, {a.workers} workers, {a.records // a.batch} steps of {a.batch}")
    print("| framework | examples/s (median) | test AUC | worker peak RSS MB | ps peak RSS MB |")
    print("|---|--:|--:|--:|--:|")
    med = {}
    for fw in [f"strata-{m}" for m in a.modes.split(",")] + ["tensorflow"]:
        rs = [r for r in runs if r["framework"] == fw]
        if not rs:
            continue
        med[fw] = statistics.median(r["examples_per_s"] for r in rs)
        w = max((max(r["worker_rss_mb"], default=0) for r in rs), default=0)
        p = max((max(r["ps_rss_mb"], default=0) for r in rs), default=0)
        aucs = ", ".join(f"{r['test_auc']:.4f}" for r in rs)
        print(f"| {fw} | {med[fw]:,.0f} | {aucs} | {w:,.0f} | {p:,.0f} |")
    for fw in med:
        if fw != "tensorflow" and "tensorflow" in med:
            print(f"{fw} / tensorflow examples/s: {med[fw] / med['tensorflow']:.2f}x")
    if "strata-hybrid" in med and "strata-sync" in med:
        print(f"strata-hybrid / strata-sync examples/s: {med['strata-hybrid'] / med['strata-sync']:.2f}x")
    auc = {fw: statistics.median(r["test_auc"] for r in runs if r["framework"] == fw) for fw in med}
    for fw in auc:
        for ref in ("strata-one-device", "strata-one-device-global"):
            if ref in auc and fw != ref and not fw.startswith("strata-one-device"):
                print(f"{fw} test AUC below {ref[7:]}: {auc[ref] - auc[fw]:+.4f}")


if __name__ == "__main__":
    main()

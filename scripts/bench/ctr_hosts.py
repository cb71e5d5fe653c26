#!/usr/bin/env python3
"""The click model's parameter-server jobs on emulated hosts at a shaped link rate against the
same jobs unshaped: 2 ps tasks and 2 workers, one a host (network namespaces on one bridge,
tbf-shaped links: the topology and shaping of hosts_bench.py, whose helpers this script uses).

Run it through scripts/bench/ctr-hosts.sh (root, one run at a time, cleanup on any exit):

  sudo scripts/bench/ctr-hosts.sh                              # hybrid and async, 1gbit and unshaped
  sudo scripts/bench/ctr-hosts.sh --modes hybrid --rounds 5

Hosts 1 and 2 run the ps tasks, hosts 3 and 4 the workers; an async or sync job's chief (the
coordinator) runs on host 3 beside worker 0, and a hybrid job's worker 0 is its chief. Every
process is `strata train` under TF_CONFIG with --bind its host's address. The model, table,
records, batch and optimizers are those of ctr_tables.py (a 20M-row table of 16, 307,200
training records, 256 records a worker step, Adagrad 0.05 on the dense layers and the rows).
Rounds alternate every link and mode (A B A B); the report gives each cell's median
examples/s, the shaped / unshaped ratio of every round and the median of those ratios, and
the test AUC of every run.
"""

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hosts_bench as hb  # noqa: E402

PS_HOSTS = (0, 1)
WORKER_HOSTS = (2, 3)


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", default="1gbit,unshaped", help="link rates, comma-separated (tc's units; unshaped: "
                    "no tbf); default 1gbit,unshaped")
    ap.add_argument("--modes", default="hybrid,async", help="--ps-mode of each job, comma-separated (default hybrid,async)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--rows", type=int, default=20_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--records", type=int, default=307_200)
    ap.add_argument("--test-records", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=256, help="records a worker step (a hybrid job's --batch is this x 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strata", default=os.path.join(hb.ROOT, "target", "release", "strata"))
    ap.add_argument("--strata-flags", default="", help="more flags for every strata train")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a run may take (default 900)")
    ap.add_argument("--save", help="keep the figures as JSON here")
    ap.add_argument("--command", help=argparse.SUPPRESS)
    return ap


def job(a, mode, logdir, tag):
    """One job over the 4 hosts; returns (summary, None) or (None, why not)."""
    out = os.path.join(logdir, f"{tag}.json")
    port = hb.next_port()
    ps = [f"{hb.addr(h)}:{port}" for h in PS_HOSTS]
    workers = [f"{hb.addr(h)}:{port}" for h in WORKER_HOSTS]
    cluster = {"ps": ps, "worker": workers}
    hybrid = mode == "hybrid"
    if not hybrid:
        cluster["chief"] = [f"{hb.addr(WORKER_HOSTS[0])}:{hb.next_port()}"]
    batch = a.batch * len(WORKER_HOSTS) if hybrid else a.batch
    base = [a.strata, "train", "--model", "ctr", "--strategy", "parameter-server", "--ps-mode", mode,
            "--embedding-rows", str(a.rows), "--embedding-dim", str(a.dim), "--train-records", str(a.records),
            "--test-records", str(a.test_records), "--batch", str(batch), "--optimizer", "adagrad", "--lr", "0.05",
            "--table-optimizer", "adagrad", "--table-lr", "0.05", "--seed", str(a.seed), "--no-progress",
            "--out", out] + a.strata_flags.split()
    tasks = [(h, "ps", i) for i, h in enumerate(PS_HOSTS)] + [(h, "worker", i) for i, h in enumerate(WORKER_HOSTS)]
    if not hybrid:
        tasks.append((WORKER_HOSTS[0], "chief", 0))
    files, procs = [], []
    try:
        for h, kind, i in tasks:
            env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": kind, "index": i}}))
            o = open(os.path.join(logdir, f"{tag}.{kind}{i}.out"), "w+")
            e = open(os.path.join(logdir, f"{tag}.{kind}{i}.err"), "w+")
            files.append((o, e))
            procs.append(hb.start(["ip", "netns", "exec", hb.host_ns(h)] + base + ["--bind", hb.addr(h)], env, o, e))
        # The job ends when its chief (hybrid: worker 0) ends; the ps tasks are told to stop.
        chief = procs[-1] if not hybrid else procs[len(PS_HOSTS)]
        deadline = time.time() + a.timeout
        while chief.poll() is None and time.time() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
        end = time.time() + 30
        while any(p.poll() is None for p in procs) and time.time() < end and chief.poll() == 0:
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if chief.returncode != 0 or any(c not in (None, 0) for c in codes):
            bad = [(t, c) for t, c in zip(tasks, codes) if c not in (0,)]
            first = bad[0] if bad else (tasks[0], None)
            errs = []
            for (t, c), (o, e) in zip(zip(tasks, codes), files):
                e.seek(0)
                lines = [x for x in e.read().splitlines() if x.strip()]
                if lines and c not in (0,):
                    errs.append(f"{t[1]}{t[2]} ({c}): {lines[-1][:200]}")
            return None, f"{first[0][1]}{first[0][2]} exit {first[1]}: " + "; ".join(errs)
    finally:
        for p in procs:
            if p in hb.children:
                hb.children.remove(p)
        for o, e in files:
            o.close()
            e.close()
    try:
        return json.load(open(out)), None
    except (OSError, ValueError) as e:
        return None, f"no summary from the chief: {e}"


def main(argv):
    a = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, hb.on_signal)
    signal.signal(signal.SIGINT, hb.on_signal)
    signal.signal(signal.SIGHUP, hb.on_signal)
    log = lambda *x: print(*x, file=sys.stderr, flush=True)  # noqa: E731
    links = [(l, hb.parse_rate(l)) for l in a.links.split(",")]
    modes = a.modes.split(",")
    started = datetime.datetime.now(datetime.timezone.utc)
    load0 = open("/proc/loadavg").read().split()[:3]
    logdir = tempfile.mkdtemp(prefix="strata-bh-logs-")
    hb.LOGDIR[0] = logdir
    os.environ.setdefault("STRATA_CLUSTER_TOKEN", os.urandom(24).hex())
    n = len(PS_HOSTS) + len(WORKER_HOSTS)
    log(f"building {n} hosts: namespaces {hb.BRIDGE_NS} (bridge br0) and {hb.host_ns(0)}..{hb.host_ns(n - 1)}")
    hb.build_hosts(n)
    results = {}  # (mode, link) -> [summary or None per round]
    goodput, failures, t_start = {}, [], time.time()
    for r in range(a.rounds):
        for link, bits in links:
            hb.shape(n, bits, log if r == 0 else (lambda *_: None))
            if link not in goodput:
                goodput[link] = hb.measure_link(hb.next_port())
                log(f"  {link}: TCP goodput host 1 -> host 2, one stream: "
                    + (f"{goodput[link]:.2f} Gbit/s" if goodput[link] else "failed"))
            for mode in modes:
                tag = f"{mode}-{link}-r{r}"
                t0 = time.time()
                s, why = job(a, mode, logdir, tag)
                runs = results.setdefault((mode, link), [None] * a.rounds)
                if s is None:
                    log(f"round {r + 1}, {link}, {mode}: failed ({why}); logs in {logdir}")
                    failures.append(f"{tag}: {why}")
                    continue
                runs[r] = s
                log(f"round {r + 1}, {link}, {mode}: {s['examples_per_second']:,.0f} examples/s, test AUC "
                    f"{s['final_test_auc']:.4f} ({time.time() - t0:.0f} s)")
    hb.teardown()
    load1 = open("/proc/loadavg").read().split()[:3]
    lines = [
        f"# click model on {n} emulated hosts, {started:%Y-%m-%d %H:%M} UTC",
        "",
        f"- command: `{a.command or ' '.join(['scripts/bench/ctr-hosts.sh'] + argv)}`",
        f"- CPU: {hb.cpu_model()}, {os.cpu_count()} cores; load average at the start {' '.join(load0)}, at the end "
        f"{' '.join(load1)}; {time.time() - t_start:.0f} s in all",
        f"- strata: {a.strata}; table {a.rows:,} x {a.dim}, {a.records:,} training records, {a.batch} a worker step",
        "- hosts: ps tasks on hosts 1-2, workers on hosts 3-4 (an async or sync job's chief beside worker 0); links: "
        + ", ".join(f"{l} (" + (f"tbf {hb.fmt_rate(b)}, burst {hb.burst_bytes(b) // 1024} KiB, latency {hb.LATENCY}"
                                 if b else "no tbf") + ")" for l, b in links),
        "- TCP goodput host 1 -> host 2, one stream, 1.5 s: " + ", ".join(
            f"{l} {g:.2f} Gbit/s" if g else f"{l} n/a" for l, g in goodput.items()),
    ]
    if failures:
        lines.append("- failed runs: " + "; ".join(failures))
    lines += ["", "| mode | link | examples/s (rounds) | median | test AUC (rounds) |", "|---|---|--:|--:|--:|"]
    for mode in modes:
        for link, _ in links:
            runs = results.get((mode, link), [])
            rates = [s["examples_per_second"] if s else None for s in runs]
            aucs = [s["final_test_auc"] if s else None for s in runs]
            ok = [x for x in rates if x]
            med = f"**{statistics.median(ok):,.0f}**" if ok else "n/a"
            lines.append(f"| {mode} | {link} | " + ", ".join(f"{x:,.0f}" if x else "failed" for x in rates)
                         + f" | {med} | " + ", ".join(f"{x:.4f}" if x else "-" for x in aucs) + " |")
    base = links[-1][0]
    # What a hybrid worker's link carries: its rows pulled in, its rows' gradients and ids and
    # its share of the ring's all-reduce of the dense gradients out (2 (n - 1) / n of them).
    for link, _ in links:
        runs = [s for s in results.get(("hybrid", link), []) if s and s.get("table_bytes_pulled_per_step")]
        if runs:
            s = runs[len(runs) // 2]
            steps = s["examples_per_second"] / s["global_batch"]
            n = len(WORKER_HOSTS)
            ring = 2 * (n - 1) / n * s["dense_gradient_bytes_per_step"]
            pulled, pushed = s["table_bytes_pulled_per_step"], s["table_bytes_pushed_per_step"] + ring
            lines.append(f"\nhybrid, {link}: a worker step pulls {pulled / 1e3:,.0f} KB of rows and sends "
                         f"{pushed / 1e3:,.0f} KB (rows' gradients and ids {s['table_bytes_pushed_per_step'] / 1e3:,.0f} KB, "
                         f"ring {ring / 1e3:,.0f} KB); at {steps:,.1f} steps/s a worker's link carries "
                         f"{pulled * steps * 8 / 1e9:.2f} Gbit/s in and {pushed * steps * 8 / 1e9:.2f} Gbit/s out")
    for mode in modes:
        for link, _ in links[:-1]:
            shaped = [s["examples_per_second"] if s else None for s in results.get((mode, link), [])]
            full = [s["examples_per_second"] if s else None for s in results.get((mode, base), [])]
            ratios = [x / y for x, y in zip(shaped, full) if x and y]
            if ratios:
                lines.append(f"\n{mode}: {link} / {base} by round " + ", ".join(f"{x:.0%}" for x in ratios)
                             + f"; median **{statistics.median(ratios):.0%}**")
    report = "\n".join(lines)
    if a.save:
        with open(a.save, "w") as f:
            json.dump({"started": f"{started:%Y-%m-%d %H:%M UTC}", "report": report,
                       "results": [[list(k), v] for k, v in results.items()]}, f, indent=1)
    print(report, flush=True)
    if failures:
        log(f"logs of the runs kept in {logdir}")
    else:
        shutil.rmtree(logdir, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python3
"""Training where the link is slow: per-step synchronous MultiWorkerMirrored beside local SGD and
DiLoCo (`strata train --sync-every H`), on emulated hosts (network namespaces, tbf-shaped links:
the topology and shaping of hosts_bench.py, whose helpers this script uses).

Run it through scripts/bench/slow-links.sh (root, one run at a time, cleanup on any exit):

  sudo scripts/bench/slow-links.sh                                  # 4 hosts, 50mbit and unshaped
  sudo scripts/bench/slow-links.sh --hosts 2 --links 1gbit,unshaped # 2 hosts at 1 Gbit/s
  sudo scripts/bench/slow-links.sh --configs sync,diloco:100,diloco:100:bf16,streaming:100:4

Every configuration trains the default character transformer (Tiny Shakespeare, 32 windows of
64 tokens a global batch, AdamW lr 0.003) for --steps steps, one replica a host, and reports its
steady-state tokens/s, its validation loss after the last step, and the bytes each worker sent:
a ring all-reduce of N bytes sends 2 (n - 1) / n N from each of n workers; per-step sync reduces
4P bytes every step (P parameters), local SGD the outer bytes its summary counts
(`local_sgd.outer_bytes_sent`: every meeting's fragment, and the final synchronisation).

Per-step synchronous training (Strata's sync, PyTorch's DDP) computes the same bits at any link
rate (its sums keep their order), so on a shaped link it runs --sync-steps steps (default 100)
for its rate only, and its validation loss is the unshaped run's of --steps steps (said in the
report).

Configurations (--configs, comma-separated): `sync`; `diloco:H[:WIRE]` (Nesterov 0.7/0.9 every
H steps; WIRE none, bf16, fp16 or int8: --compression); `local:H` (averaging every H steps);
`streaming:H:F[:WIRE]` (DiLoCo in F fragments at staggered steps, each exchange half the steps
between two fragments' meetings behind); `torch-ddp` and `torch-diloco:H[:bf16]`: PyTorch's
DDP and DiLoCo over gloo (scripts/bench/peers/diloco_peer.py, the same transformer, batch and
AdamW, its own data pipeline and validation windows), from --python (the peers' virtual
environment, as scripts/bench/peers.sh installs it). A Strata configuration with `+elastic` runs
as an elastic job (--min-workers one below the hosts, the chief writing per-step metrics), and
with `+kill@STEP` the same job has its last host's worker killed (SIGKILL) once the chief has
recorded STEP steps; the others must finish, and its loss is set against the `+elastic` run's. Rounds (--repeats, default 3) alternate every link and
configuration (A B C A B C); medians are reported, with each ratio taken within a round.
"""

import argparse
import datetime
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hosts_bench as hb  # noqa: E402

STEPS = 1200
SYNC_STEPS = 100
BATCH = 32
CONTEXT = 64


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=4, help="emulated hosts, one worker each (default 4)")
    ap.add_argument("--links", default="50mbit,unshaped", help="link rates, comma-separated (tc's units: 10mbit, 1gbit; "
                    "unshaped: no tbf); default 50mbit,unshaped")
    ap.add_argument("--configs", default="sync,diloco:100,diloco:100:bf16,streaming:100:4",
                    help="what runs on every link (default sync,diloco:100,diloco:100:bf16,streaming:100:4)")
    ap.add_argument("--steps", type=int, default=STEPS, help=f"training steps a run (default {STEPS})")
    ap.add_argument("--sync-steps", type=int, default=SYNC_STEPS,
                    help=f"per-step sync's steps on a shaped link, for its rate (default {SYNC_STEPS})")
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--lr", type=float, default=0.003, help="the (inner) optimizer's learning rate (default 0.003)")
    ap.add_argument("--strata", default=os.path.join(hb.ROOT, "target", "release", "strata"))
    ap.add_argument("--strata-flags", default="", help="more flags for every strata train")
    ap.add_argument("--python", default=os.path.join(os.environ.get("PEERS_VENV", os.path.expanduser(
        "~/.cache/strata/peers-venv")), "bin", "python"), help="the Python with torch for torch-* configurations")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a run may take (default 1800)")
    ap.add_argument("--save", help="keep the figures as JSON here")
    ap.add_argument("--render", help="print a saved run's report")
    ap.add_argument("--command", help=argparse.SUPPRESS)
    return ap


PER_STEP = ("sync", "torch-ddp")


def split_elastic(c):
    """A configuration's base and its elastic suffix: (base, None) without one, (base, 0) for
    `+elastic` (the job elastic, nothing killed), (base, STEP) for `+kill@STEP`; None where the
    suffix does not parse."""
    if "+" not in c:
        return c, None
    base, suffix = c.split("+", 1)
    if suffix == "elastic":
        return base, 0
    if suffix.startswith("kill@"):
        try:
            step = int(suffix[5:])
            return (base, step) if step > 0 else None
        except ValueError:
            return None
    return None


def parse_config(c):
    """A configuration's flags (strata train's, or diloco_peer.py's for torch-*), or an error
    string."""
    split = split_elastic(c)
    if split is None or (split[1] is not None and split[0].startswith("torch-")):
        return f"configuration {c!r}: a suffix is +elastic or +kill@STEP (STEP above 0), on a Strata configuration"
    c = split[0]
    parts = c.split(":")
    kind = parts[0]
    if kind == "sync" and len(parts) == 1:
        return []
    if kind == "torch-ddp" and len(parts) == 1:
        return ["--ddp"]
    if kind == "torch-diloco" and len(parts) in (2, 3):
        try:
            return ["--sync-every", str(int(parts[1]))] + (["--wire", parts[2]] if len(parts) == 3 else [])
        except ValueError:
            pass
    try:
        if kind in ("diloco", "local") and len(parts) in (2, 3):
            flags = ["--sync-every", str(int(parts[1])),
                     "--outer-optimizer", "nesterov" if kind == "diloco" else "average"]
            return flags + (["--compression", parts[2]] if len(parts) == 3 else [])
        if kind == "streaming" and len(parts) in (3, 4):
            flags = ["--sync-every", str(int(parts[1])), "--fragments", str(int(parts[2]))]
            return flags + (["--compression", parts[3]] if len(parts) == 4 else [])
    except ValueError:
        pass
    return (f"unknown configuration {c!r}: use sync, diloco:H[:WIRE], local:H, streaming:H:F[:WIRE], torch-ddp or "
            "torch-diloco:H[:bf16], a Strata one with +elastic or +kill@STEP")


def torch_run(a, n, config, steps, logdir, tag):
    """PyTorch's DiLoCo or DDP (peers/diloco_peer.py), one process per host over gloo."""
    port = hb.next_port()
    base = [a.python, os.path.join(HERE, "peers", "diloco_peer.py"), "--steps", str(steps), "--lr", str(a.lr)]
    base += parse_config(config)
    jobs = []
    for i in range(n):
        env = dict(os.environ, RANK=str(i), WORLD_SIZE=str(n), MASTER_ADDR=hb.addr(0), MASTER_PORT=str(port),
                   GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
        jobs.append((base, env))
    outs, why = hb.run_hosts(jobs, logdir, tag, a.timeout)
    if why:
        return None, why
    try:
        s = json.loads([x for x in outs[0][0].splitlines() if x.startswith("{")][-1])
    except (IndexError, ValueError) as e:
        return None, f"no result from rank 0: {e}"
    return {"rate": s["tokens_per_second"], "loss": s["validation_loss"],
            "bytes": 2 * (n - 1) / n * s["allreduced_bytes"], "steps": steps, "parameters": s["parameters"],
            "wall": None}, None


def run(a, n, config, steps, logdir, tag):
    if config.startswith("torch-"):
        return torch_run(a, n, config, steps, logdir, tag)
    out = os.path.join(logdir, f"{tag}.json")
    port = hb.next_port()
    workers = [f"{hb.addr(i)}:{port}" for i in range(n)]
    base = [a.strata, "train", "--strategy", "multi-worker-mirrored", "--replicas", "1", "--model", "transformer",
            "--batch", str(BATCH), "--lr", str(a.lr), "--steps", str(steps), "--no-progress", "--out", out]
    base += parse_config(config) + shlex.split(a.strata_flags)
    kill = split_elastic(config)[1]
    if kill is not None:
        base += ["--min-workers", str(n - 1)]
        s, why = killed_job(base, workers, out, logdir, tag, a.timeout, kill)
    else:
        s, why = hb.strata_job(base, workers, out, logdir, tag, a.timeout)
    if why:
        return None, why
    p = s["parameters"]
    ring = 2 * (n - 1) / n
    payload = s["local_sgd"]["outer_bytes_sent"] if s.get("local_sgd") else 4 * p * steps
    return {"rate": s["tokens_per_second"], "loss": s["validation_loss"], "bytes": ring * payload,
            "steps": steps, "parameters": p, "wall": s["wall_seconds"]}, None


def killed_job(base, workers, out, logdir, tag, timeout, kill):
    """hosts_bench.strata_job for an elastic job (`base` has --min-workers): the last host's
    worker is killed (SIGKILL) once the chief's metrics record `kill` steps (0: none is), and
    the others must finish. Returns (the chief's summary, None), or (None, why not)."""
    metrics = os.path.join(logdir, f"{tag}.metrics.jsonl")
    files, ps = [], []
    # The coordination service that outlives the workers, on the first host's address.
    port = hb.next_port()
    co_out = open(os.path.join(logdir, f"{tag}.coordinator.err"), "w")
    files.append(co_out)
    min_workers = base[base.index("--min-workers") + 1]
    coordinator = hb.start(["ip", "netns", "exec", hb.host_ns(0), base[0], "coordinator", "--workers", str(len(workers)),
                            "--min-workers", min_workers, "--bind", hb.addr(0), "--port", str(port)],
                           dict(os.environ), co_out, co_out)
    time.sleep(0.5)
    base = base + ["--coordinator", f"{hb.addr(0)}:{port}"]
    for i in range(len(workers)):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}))
        cmd = base + ["--bind", hb.addr(i)] + (["--metrics", metrics] if i == 0 else [])
        o = open(os.path.join(logdir, f"{tag}.h{i + 1}.out"), "w")
        e = open(os.path.join(logdir, f"{tag}.h{i + 1}.err"), "w")
        files += [o, e]
        ps.append(hb.start(["ip", "netns", "exec", hb.host_ns(i)] + cmd, env, o, e))
    deadline = time.time() + timeout
    killed = kill == 0
    why = None
    try:
        while any(p.poll() is None for p in ps[:-1] if p):
            if time.time() > deadline:
                why = f"timed out after {timeout:.0f} s"
                break
            if not killed:
                try:
                    steps = sum(1 for line in open(metrics) if '"kind":"step"' in line)
                except OSError:
                    steps = 0
                if steps >= kill:
                    os.killpg(ps[-1].pid, signal.SIGKILL)
                    killed = True
            time.sleep(0.05)
        if why is None and not killed:
            why = f"the job ended before step {kill}"
    finally:
        for p in ps + [coordinator]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            if p in hb.children:
                hb.children.remove(p)
        for f in files:
            f.close()
    if why:
        return None, why
    survivors = ps if kill == 0 else ps[:-1]
    bad = [(i, p.returncode) for i, p in enumerate(survivors) if p.returncode != 0]
    if bad:
        i, code = bad[0]
        err = open(os.path.join(logdir, f"{tag}.h{i + 1}.err")).read().strip().splitlines()
        return None, f"worker {i} exited {code}: {(err or ['(no message)'])[-1][:300]}"
    try:
        return json.load(open(out)), None
    except (OSError, ValueError) as e:
        return None, f"no summary from the chief: {e}"


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(v, spec=",.0f"):
    return "n/a" if v is None else format(v, spec)


def render(rec):
    n, links, configs, rounds = rec["hosts"], rec["links"], rec["configs"], rec["rounds"]
    lines = [f"# Local SGD and DiLoCo on {n} emulated hosts ({rec['started']})", ""] + rec["header"] + [""]
    cell = lambda link, c, r, k: (rounds[r].get(f"{link}|{c}") or {}).get(k)  # noqa: E731
    unshaped = "unshaped" if "unshaped" in links else None
    per_step_loss = {c: median([cell(unshaped, c, r, "loss") for r in range(len(rounds))]) if unshaped else None
                     for c in PER_STEP}
    for link in links:
        # Per-step sync's loss: the unshaped run's (the same bits), else this link's own; each
        # framework's runs are set against its own per-step run (Strata's sync, PyTorch's DDP).
        own = {c: per_step_loss[c] if unshaped else median([cell(link, c, r, "loss") for r in range(len(rounds))])
               for c in PER_STEP}
        lines += [f"## {link}", "",
                  "| configuration | tokens/s | / Strata sync (same link) | / Strata sync unshaped | validation loss | "
                  "- its per-step run's | bytes sent per worker | per-step / this |", "|---|--:|--:|--:|--:|--:|--:|--:|"]
        for c in configs:
            base = "torch-ddp" if c.startswith("torch-") else "sync"
            sync_loss = own[base]
            rate = median([cell(link, c, r, "rate") for r in range(len(rounds))])
            ratio = lambda other_link, other="sync": median([  # noqa: E731
                cell(link, c, r, "rate") / cell(other_link, other, r, "rate")
                for r in range(len(rounds)) if cell(link, c, r, "rate") and cell(other_link, other, r, "rate")])
            loss = median([cell(link, c, r, "loss") for r in range(len(rounds))])
            steps = median([cell(link, c, r, "steps") for r in range(len(rounds))])
            if c in PER_STEP and unshaped and link != unshaped:
                loss = per_step_loss[c]
            byt = median([cell(link, c, r, "bytes") for r in range(len(rounds))])
            sync_bytes = median([cell(link, base, r, "bytes") / cell(link, base, r, "steps")
                                 for r in range(len(rounds)) if cell(link, base, r, "bytes")])
            full = rec["steps"]
            if c in PER_STEP and byt is not None:
                byt = byt / steps * full  # the bytes of the full run
            lines.append(
                f"| {c}{' (' + str(int(steps)) + ' steps, rate only)' if c in PER_STEP and steps and steps != full else ''} "
                f"| {fmt(rate)} | {fmt(ratio(link), '.2f')}x | "
                f"{fmt(ratio(unshaped) if unshaped else None, '.2f')}x | {fmt(loss, '.4f')} | "
                f"{fmt(None if loss is None or sync_loss is None else loss - sync_loss, '+.4f')} | "
                f"{hb.fmt_bytes(byt) if byt is not None else 'n/a'} | "
                f"{fmt(None if not byt or sync_bytes is None else sync_bytes * full / byt, ',.1f')}x |")
        lines.append("")
        for c in configs:
            base, kill = split_elastic(c)
            if kill and f"{base}+elastic" in configs:
                pairs = [(cell(link, c, r, "loss"), cell(link, f"{base}+elastic", r, "loss")) for r in range(len(rounds))]
                diffs = [k - u for k, u in pairs if k is not None and u is not None]
                lines += [f"A worker killed at step {kill} ({c}): validation loss minus the undisturbed elastic run's "
                          f"({base}+elastic), by round: " + ", ".join(f"{d:+.4f}" for d in diffs)
                          + f"; median {fmt(median(diffs), '+.4f')}", ""]
    lines += ["Every run (tokens/s; validation loss):", ""]
    for r, cells in enumerate(rounds):
        lines.append(f"- round {r + 1}: " + "; ".join(
            f"{k.replace('|', ' ')} {fmt(v['rate'])} ({fmt(v['loss'], '.4f')})" if v else f"{k.replace('|', ' ')} failed"
            for k, v in cells.items()))
    return "\n".join(lines)


def main(argv):
    a = parser().parse_args(argv)
    if a.render:
        print(render(json.load(open(a.render))))
        return 0
    links = []
    for link in a.links.split(","):
        bits = None if link == "unshaped" else hb.parse_rate(link)
        if link != "unshaped" and bits is None:
            print(f"slow-links: link rate {link!r} does not parse: use tc's units (50mbit, 1gbit) or unshaped", file=sys.stderr)
            return 2
        links.append((link, bits))
    configs = a.configs.split(",")
    for c in configs:
        if isinstance(parse_config(c), str):
            print("slow-links: " + parse_config(c), file=sys.stderr)
            return 2
    if not os.access(a.strata, os.X_OK):
        print(f"slow-links: {a.strata} not found: cargo build --release -p strata-cli", file=sys.stderr)
        return 2
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, hb.on_signal)
    log = lambda *x: print(*x, file=sys.stderr, flush=True)  # noqa: E731
    started = datetime.datetime.now(datetime.timezone.utc)
    load0 = open("/proc/loadavg").read().split()[:3]
    logdir = tempfile.mkdtemp(prefix="strata-bh-logs-")
    hb.LOGDIR[0] = logdir
    os.environ.setdefault("STRATA_CLUSTER_TOKEN", os.urandom(24).hex())
    t0 = time.time()
    n = a.hosts
    hb.build_hosts(n)
    rounds, failures, goodput = [], [], {}
    for rep in range(a.repeats):
        cells = {}
        for link, bits in links:
            hb.shape(n, bits, log if rep == 0 else (lambda *_: None))
            if link not in goodput:
                goodput[link] = hb.measure_link(hb.next_port())
            for c in configs:
                steps = a.sync_steps if c in PER_STEP and bits is not None else a.steps
                tag = f"n{n}-{link}-{c}-r{rep}".replace(":", "_")
                t = time.time()
                r, why = run(a, n, c, steps, logdir, tag)
                cells[f"{link}|{c}"] = r
                if r is None:
                    failures.append(f"round {rep + 1}, {link}, {c}: {why}")
                    log(f"round {rep + 1}, {link}, {c}: failed ({why}); logs in {logdir}")
                else:
                    log(f"round {rep + 1}, {link}, {c}: {r['rate']:,.0f} tokens/s, loss {r['loss']:.4f}, "
                        f"{hb.fmt_bytes(r['bytes'])} sent ({time.time() - t:.0f} s)")
        rounds.append(cells)
    hb.teardown()
    load1 = open("/proc/loadavg").read().split()[:3]
    header = [
        f"- command: `{a.command or ' '.join(['scripts/bench/slow-links.sh'] + argv)}`",
        f"- CPU: {hb.cpu_model()}, {os.cpu_count()} cores; load average {' '.join(load0)} at the start, "
        f"{' '.join(load1)} at the end; {time.time() - t0:.0f} s in all",
        f"- strata: {a.strata}; the default transformer, {BATCH} windows of {CONTEXT} tokens a global batch, "
        f"AdamW lr {a.lr}, {a.steps} steps (per-step sync on a shaped link: {a.sync_steps} steps, its rate only; "
        f"its loss is the unshaped run's, the same bits)",
        f"- hosts: {n} network namespaces on one bridge, one worker process each; links: " + ", ".join(
            f"{link}" + (f" (tbf {hb.fmt_rate(bits)}, burst {hb.burst_bytes(bits) // 1024} KiB, latency {hb.LATENCY})"
                         if bits else "") for link, bits in links),
        "- measured TCP goodput host 1 -> host 2 (one stream, 1.5 s): " + ", ".join(
            f"{k} {v:.3f} Gbit/s" if v else f"{k} n/a" for k, v in goodput.items()),
        "- bytes sent per worker: a ring all-reduce of N bytes sends 2 (n - 1) / n N from each worker; "
        "per-step sync all-reduces 4P bytes a step, local SGD what its summary counts",
        f"- {a.repeats} rounds, every link and configuration once a round, in the order above; medians",
    ]
    if failures:
        header.append("- failed runs: " + "; ".join(failures))
    rec = {"started": started.strftime("%Y-%m-%d %H:%M UTC"), "header": header, "hosts": n,
           "links": [link for link, _ in links], "configs": configs, "rounds": rounds, "steps": a.steps}
    if a.save:
        json.dump(rec, open(a.save, "w"), indent=1)
    print(render(rec), flush=True)
    if failures:
        hb.LOGDIR[1] = True
    return 1 if failures else 0


if __name__ == "__main__":
    code = 1
    try:
        code = main(sys.argv[1:])
    finally:
        if hb.TOUCHED[0]:
            hb.teardown()
        if hb.LOGDIR[0] and not hb.LOGDIR[1]:
            import shutil
            shutil.rmtree(hb.LOGDIR[0], ignore_errors=True)
    sys.exit(code)

"""Strata's ZeRO stage 3 across worker processes beside PyTorch FSDP2 (fully_shard per block,
gloo, CPU), both on this machine, alternated A B A B. Run it through scripts/bench/fsdp.sh
(which installs PyTorch into the peers' virtual environment); see that file for what it
measures.

Each configuration is --workers processes started here with subprocess.Popen, all of one run
in one process group of their own, each reaped with os.wait4 for its own peak resident set
(ru_maxrss, KiB on Linux). A run that errs or passes --timeout has its group killed; so has
every live run when this driver ends (the end, an error, Ctrl-C, SIGTERM). Its temporary
directory (/tmp/strata-fsdp-*: a copy of the strata binary, so that every round runs the same
one, the runs' summaries and logs) is removed on exit.
"""

import argparse
import ctypes
import datetime
import glob
import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import isa  # noqa: E402

ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
CONTEXT, VOCAB = 64, 65  # strata::transformer's context and Tiny Shakespeare's characters
# `strata train` hands steps to its replicas 10 at a time (the trainer's stop check) and counts
# an execution that holds any of its first 3 steps as warm-up: the steady state starts at step 11.
STRATA_WARMUP_STEPS = 10
# The first Strata run's length is guessed from the model's training FLOPs (6 x parameters x
# tokens per step) at this many FLOP/s over the whole machine; later runs use the previous
# Strata run's measured rate.
GUESS_FLOPS = 3e10
TOKEN = "strata-fsdp-bench-" + os.urandom(8).hex()
CONFIGS = ("strata", "fsdp2")
LABEL = {"strata": "Strata ZeRO-3", "fsdp2": "FSDP2"}

try:
    LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here, not in a forked child
    LIBC.prctl  # noqa: B018
except (OSError, AttributeError):
    LIBC = None
live_groups = set()  # process groups of runs under way
TMP = [None]


def die(msg, code=1):
    print(f"fsdp.sh: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def parser():
    ap = argparse.ArgumentParser(
        prog="scripts/bench/fsdp.sh",
        description="Strata's ZeRO stage 3 (multi-worker-mirrored, 1 replica per worker process) beside PyTorch "
                    "FSDP2 (fully_shard per transformer block, gloo, 1 thread per process) on the character "
                    "transformer, alternated; examples/s in steady state and every process's peak RSS.",
        epilog="Example: scripts/bench/fsdp.sh --repeats 3 --seconds 20 --save fsdp.json")
    ap.add_argument("--repeats", type=int, help="rounds, each running Strata then FSDP2 (default 3; --quick: 1)")
    ap.add_argument("--seconds", type=float, help="each run's timed steady state, seconds (default 20; --quick: 4)")
    ap.add_argument("--width", type=int, default=512, help="the transformer's width (default 512)")
    ap.add_argument("--layers", type=int, default=8, help="blocks (default 8)")
    ap.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    ap.add_argument("--batch", type=int, default=8, help="global batch, windows of 64 characters (default 8)")
    ap.add_argument("--workers", type=int, default=4, help="processes per configuration (default 4)")
    ap.add_argument("--strata", help="the strata binary (default target/release/strata; --isa avx2: "
                                     "target/avx2/release/strata)")
    ap.add_argument("--isa", choices=isa.ISAS, default="native",
                    help="avx2: measure as on an AVX2 host: PyTorch with ATEN_CPU_CAPABILITY=avx2, "
                         "ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2; Strata built without its avx512 "
                         "feature (fsdp.sh builds it into target/avx2)")
    ap.add_argument("--zero-stage", type=int, default=3, choices=(0, 1, 2, 3),
                    help="Strata's --zero-stage (default 3; others to check the harness)")
    ap.add_argument("--strata-steps", type=int, default=0,
                    help="Strata's steady-state steps per run (default 0: as many as --seconds takes at the last "
                         "Strata run's rate; the run trains 10 warm-up steps more)")
    ap.add_argument("--fsdp-warmup", type=int, default=3, help="FSDP2's untimed warm-up steps (default 3)")
    ap.add_argument("--mesh", choices=("default", "cpu"), default="default",
                    help="FSDP2's mesh: fully_shard's default, or init_device_mesh('cpu', (workers,)) (default: default)")
    ap.add_argument("--only", choices=CONFIGS, help="run one side only")
    ap.add_argument("--quick", action="store_true", help="1 round of 4 s runs (options given beside it still apply)")
    ap.add_argument("--timeout", type=float, default=0,
                    help="seconds one run may take before its processes are killed (default 900 + 3 x --seconds; "
                         "Strata's run includes its validation pass over 1,742 windows after training)")
    ap.add_argument("--python", default=sys.executable, help="the Python with torch (fsdp.sh passes the peers venv's)")
    ap.add_argument("--save", metavar="FILE", help="also write every run's figures and the header as JSON here")
    ap.add_argument("--command", default="", help=argparse.SUPPRESS)
    return ap


def parse_args(argv):
    a = parser().parse_args(argv)
    if a.repeats is None:
        a.repeats = 1 if a.quick else 3
    if a.seconds is None:
        a.seconds = 4.0 if a.quick else 20.0
    if a.repeats < 1 or a.seconds <= 0 or a.workers < 1 or a.batch < 1 or a.strata_steps < 0 or a.fsdp_warmup < 0:
        die("--repeats, --seconds, --workers and --batch must be positive, --strata-steps and --fsdp-warmup not negative", 2)
    if min(a.width, a.layers, a.heads) < 1 or a.width % a.heads:
        die(f"a width of {a.width} does not split into {a.heads} heads (or a size is below 1)", 2)
    if a.batch % a.workers:
        die(f"a global batch of {a.batch} windows does not split over {a.workers} workers; use a multiple of {a.workers}", 2)
    if a.timeout <= 0:
        a.timeout = 900 + 3 * a.seconds
    if a.strata is None:
        a.strata = isa.strata_build(a.isa)[1]
    return a


def parameter_count(w, layers):
    """strata::transformer::TransformerConfig::parameter_count at context 64, vocabulary 65."""
    block = 2 * (2 * w) + w * 3 * w + (w * w + w) + (w * 4 * w + 4 * w) + (4 * w * w + w)
    return VOCAB * w + CONTEXT * w + layers * block + 2 * w + (w * VOCAB + VOCAB)


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError:
        pass


def last_line(path):
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return ""
    # The last line that names an error if there is one, else the last line.
    for ln in reversed(lines):
        if "error" in ln.lower():
            return ln[:400]
    return lines[-1][:400] if lines else ""


def in_group(pgid):
    """Popen's arguments that start a child in process group `pgid` (0: a new one of its own),
    killed by the kernel should this driver die without its cleanup (SIGKILL: PR_SET_PDEATHSIG)."""

    def setup():
        os.setpgid(0, pgid)
        if LIBC is not None:
            LIBC.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG

    return {"preexec_fn": setup}


def run_group(cmds, envs, logdir, timeout):
    """Starts one process per (cmd, env) in one new process group, reaps each with os.wait4.
    Returns (per-process [{"rc", "maxrss_kib", "log"}], error or None); on an error (a non-zero
    exit, a signal, the timeout) the group is killed and the rest reaped."""
    procs, pgid = [], None
    for i, (cmd, env) in enumerate(zip(cmds, envs)):
        log = os.path.join(logdir, f"log-{i}.txt")
        with open(log, "wb") as out:
            try:
                p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                     **in_group(0 if pgid is None else pgid))
            except (OSError, subprocess.SubprocessError) as e:
                if pgid is not None:
                    kill_group(pgid)
                    for q, _ in procs:
                        reap(q, 0)
                return [], f"cannot start {cmd[0]}: {e}"
        if pgid is None:
            pgid = p.pid
            live_groups.add(pgid)
        procs.append((p, log))
    results = [None] * len(procs)
    error = None
    deadline = time.monotonic() + timeout
    try:
        while any(r is None for r in results):
            for i, (p, log) in enumerate(procs):
                if results[i] is not None:
                    continue
                got = reap(p, os.WNOHANG)
                if got is None:
                    continue
                results[i] = dict(got, log=log)
                if got["rc"] != 0 and error is None:
                    how = f"exit code {got['rc']}" if got["rc"] > 0 else f"signal {-got['rc']}"
                    error = f"process {i} ended with {how}: {last_line(log) or '(no output)'}"
                    kill_group(pgid)
            if error is None and time.monotonic() > deadline and any(r is None for r in results):
                error = f"timed out after {timeout:.0f} s (processes killed)"
                kill_group(pgid)
            time.sleep(0.05)
    finally:
        kill_group(pgid)  # anything a worker left behind in the group
        live_groups.discard(pgid)
    return results, error


def reap(p, flags):
    """os.wait4 on one child: {"rc", "maxrss_kib"} or None while it runs (WNOHANG)."""
    try:
        pid, status, usage = os.wait4(p.pid, flags)
    except ChildProcessError:
        return {"rc": p.returncode if p.returncode is not None else -1, "maxrss_kib": 0}
    if pid == 0:
        return None
    rc = os.waitstatus_to_exitcode(status)
    p.returncode = rc  # reaped here: Popen must not wait for it again
    return {"rc": rc, "maxrss_kib": usage.ru_maxrss}


def strata_run(a, binary, rnd, steady_steps, tmp):
    d = tempfile.mkdtemp(prefix=f"strata-r{rnd}-", dir=tmp)
    ports = free_ports(a.workers)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    cmds, envs = [], []
    steps = STRATA_WARMUP_STEPS + steady_steps
    for i in range(a.workers):
        cmds.append([binary, "train", "--strategy", "multi-worker-mirrored", "--replicas", "1",
                     "--zero-stage", str(a.zero_stage), "--model", "transformer",
                     "--width", str(a.width), "--layers", str(a.layers), "--heads", str(a.heads),
                     "--batch", str(a.batch), "--optimizer", "adamw", "--steps", str(steps), "--no-progress",
                     "--out", os.path.join(d, f"summary-{i}.json")])
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}),
                   STRATA_CLUSTER_TOKEN=TOKEN)
        envs.append(env)
    t0 = time.monotonic()
    procs, error = run_group(cmds, envs, d, a.timeout)
    run = {"config": "strata", "round": rnd, "steps": steps, "steady_steps": steady_steps,
           "wall_seconds": time.monotonic() - t0, "maxrss_kib": [p["maxrss_kib"] for p in procs],
           "command": shlex.join(cmds[0]) if cmds else ""}
    if error is None:
        try:
            with open(os.path.join(d, "summary-0.json")) as f:
                s = json.load(f)
            run.update(examples_per_second=s["examples_per_second"], tokens_per_second=s.get("tokens_per_second"),
                       parameters=s.get("parameters"), validation_loss=s.get("validation_loss"),
                       peak_replica_bytes=s.get("peak_replica_bytes"), strata_wall_seconds=s.get("wall_seconds"))
        except (OSError, ValueError, KeyError) as e:
            error = f"the chief's summary {os.path.join(d, 'summary-0.json')} cannot be read: {e}"
    run["error"] = error
    return run


def fsdp_run(a, rnd, tmp):
    d = tempfile.mkdtemp(prefix=f"fsdp2-r{rnd}-", dir=tmp)
    port = free_ports(1)[0]
    cmd = [a.python, os.path.join(HERE, "fsdp_peer.py"), "--width", str(a.width), "--layers", str(a.layers),
           "--heads", str(a.heads), "--batch", str(a.batch), "--seconds", str(a.seconds),
           "--warmup", str(a.fsdp_warmup), "--mesh", a.mesh, "--out", d]
    envs = []
    for r in range(a.workers):
        envs.append(dict(isa.peer_env(a.isa), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), LOCAL_RANK=str(r),
                         WORLD_SIZE=str(a.workers), LOCAL_WORLD_SIZE=str(a.workers), OMP_NUM_THREADS="1",
                         PYTHONUNBUFFERED="1"))
    t0 = time.monotonic()
    procs, error = run_group([cmd] * a.workers, envs, d, a.timeout)
    run = {"config": "fsdp2", "round": rnd, "wall_seconds": time.monotonic() - t0,
           "maxrss_kib": [p["maxrss_kib"] for p in procs], "command": shlex.join(cmd)}
    if error is None:
        try:
            ranks = []
            for r in range(a.workers):
                with open(os.path.join(d, f"result-{r}.json")) as f:
                    ranks.append(json.load(f))
            r0 = ranks[0]
            run.update(examples_per_second=r0["examples_per_second"], tokens_per_second=r0["tokens_per_second"],
                       steps=r0["steps"], seconds=r0["seconds"], parameters=r0["parameters"], torch=r0["torch"],
                       fused_adamw=r0["fused_adamw"], last_loss=r0["last_loss"],
                       rss_after_import_kib=[x["rss_after_import_kib"] for x in ranks],
                       rss_after_shard_kib=[x["rss_after_shard_kib"] for x in ranks],
                       vmhwm_kib=[x["vmhwm_kib"] for x in ranks])
        except (OSError, ValueError, KeyError) as e:
            error = f"a rank's result in {d} cannot be read: {e}"
    run["error"] = error
    return run


def mib(kib):
    return kib / 1024.0


def fmt_rss(run):
    rss = run.get("maxrss_kib") or []
    if not rss or not all(rss):
        return "n/a", "n/a"
    return f"{mib(max(rss)):.0f}", " / ".join(f"{mib(k):.0f}" for k in rss)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def version_of(cmd):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        return (out.stdout.strip() or out.stderr.strip()).splitlines()[-1] if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


def report(header, runs):
    a = header["args"]
    print()
    print(f"## Strata ZeRO-{a['zero_stage']} vs PyTorch FSDP2: {a['workers']} processes on one host")
    print()
    print(f"- date: {header['date']}; CPU: {header['cpu']} ({header['cpus']} logical CPUs)")
    print(f"- model: character transformer, width {a['width']}, {a['layers']} layers, {a['heads']} heads, context "
          f"{CONTEXT}, vocabulary {VOCAB}: {header['parameters']:,} parameters (Strata's count); global batch "
          f"{a['batch']} windows ({a['batch'] // a['workers']} per process), AdamW lr 0.003, clip 1.0, f32")
    print(f"- Strata: {header['strata_version'] or 'version unknown'} (binary of {header['strata_binary_mtime']}), `train --strategy multi-worker-mirrored "
          f"--replicas 1 --zero-stage {a['zero_stage']}`, rate = the chief's steady-state examples_per_second "
          f"(after {STRATA_WARMUP_STEPS} warm-up steps)")
    print(f"- PyTorch: {header['torch_version'] or 'n/a'}, fully_shard per block + model, gloo, 1 thread per process, "
          f"mesh {a['mesh']}; rate = rank 0's windows / seconds over ~{a['seconds']:g} s after {a['fsdp_warmup']} warm-up steps")
    print(f"- ISA: {isa.describe(a.get('isa', 'native'))}")
    print(f"- peak RSS: each process's ru_maxrss from os.wait4, MiB; {a['repeats']} round(s), alternated")
    print()
    print("| config | round | examples/s | peak RSS max (MiB) | peak RSS each (MiB) | note |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        mx, each = fmt_rss(r)
        rate = f"{r['examples_per_second']:.3f}" if r.get("examples_per_second") is not None else "failed"
        note = r["error"] if r.get("error") else (
            f"{r['steady_steps']} steady steps, {r['wall_seconds']:.0f} s wall" if r["config"] == "strata"
            else f"{r['steps']} steps in {r['seconds']:.1f} s, {r['wall_seconds']:.0f} s wall")
        print(f"| {LABEL[r['config']]} | {r['round']} | {rate} | {mx} | {each} | {note} |")
    ok = {c: [r for r in runs if r["config"] == c and not r.get("error")] for c in CONFIGS}
    med = {}
    for c in CONFIGS:
        if ok[c]:
            med[c] = (statistics.median(r["examples_per_second"] for r in ok[c]),
                      statistics.median(mib(max(r["maxrss_kib"])) for r in ok[c]))
    print()
    if med:
        print("| config | runs | median examples/s | median peak RSS max (MiB) |")
        print("|---|---|---|---|")
        for c in CONFIGS:
            if c in med:
                print(f"| {LABEL[c]} | {len(ok[c])} | {med[c][0]:.3f} | {med[c][1]:.0f} |")
    pairs = []
    for rnd in sorted({r["round"] for r in runs}):
        s = next((r for r in ok["strata"] if r["round"] == rnd), None)
        f = next((r for r in ok["fsdp2"] if r["round"] == rnd), None)
        if s and f:
            pairs.append((rnd, s["examples_per_second"] / f["examples_per_second"],
                          max(s["maxrss_kib"]) / max(f["maxrss_kib"])))
    if pairs:
        print()
        print("| round | examples/s Strata / FSDP2 | peak RSS max Strata / FSDP2 |")
        print("|---|---|---|")
        for rnd, sp, rs in pairs:
            print(f"| {rnd} | {sp:.2f} | {rs:.2f} |")
        if "strata" in med and "fsdp2" in med:
            print(f"| medians | {med['strata'][0] / med['fsdp2'][0]:.2f} | {med['strata'][1] / med['fsdp2'][1]:.2f} |")
    floors = [k for r in ok["fsdp2"] for k in r.get("rss_after_import_kib") or [] if k]
    if floors:
        print()
        print(f"FSDP2's processes held {mib(statistics.median(floors)):.0f} MiB (median) right after `import torch` "
              f"({header['torch_version']}), before any model or process group; Strata's peak_replica_bytes "
              "(its own count of a replica's model state and activations) are in --save's JSON.")
    print()


def main(argv):
    a = parse_args(argv)
    cleanup_installed()
    remove_stale_dirs()
    tmp = tempfile.mkdtemp(prefix="strata-fsdp-", dir="/tmp")
    TMP[0] = tmp
    with open(os.path.join(tmp, "pid"), "w") as f:
        f.write(f"{os.getpid()}\n")
    want = [a.only] if a.only else list(CONFIGS)
    binary = None
    if "strata" in want:
        if not (os.path.isfile(a.strata) and os.access(a.strata, os.X_OK)):
            die(f"no strata binary at {a.strata}: build it with `cargo build --release -p strata-cli` or pass --strata PATH")
        binary = os.path.join(tmp, "strata")
        shutil.copy2(a.strata, binary)  # every round runs this copy, whatever happens to the original
    torch_version = None
    if "fsdp2" in want:
        torch_version = version_of([a.python, "-c", "import torch; print(torch.__version__)"])
        if torch_version is None:
            die(f"PyTorch does not import with {a.python}: install it (scripts/bench/fsdp.sh does, unless --no-install)")
    header = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "command": a.command or shlex.join(sys.argv),
        "strata_version": version_of([binary, "--version"]) if binary else None,
        "strata_binary": a.strata,
        "strata_binary_mtime": (datetime.datetime.fromtimestamp(os.path.getmtime(a.strata)).astimezone()
                                .isoformat(timespec="seconds") if binary else None),
        "torch_version": torch_version,
        "parameters": parameter_count(a.width, a.layers),
        "args": {k: v for k, v in vars(a).items() if k not in ("command", "python")},
    }
    print(f"fsdp.sh: {a.repeats} round(s) of {' then '.join(LABEL[c] for c in want)}, {a.workers} processes each, "
          f"~{a.seconds:g} s timed per run; width {a.width}, {a.layers} layers, batch {a.batch}", file=sys.stderr, flush=True)
    runs, failed = [], set()
    strata_rate = None  # windows/s of the last Strata run
    for rnd in range(1, a.repeats + 1):
        for c in want:
            if c in failed:
                continue
            if c == "strata":
                if a.strata_steps:
                    steady = a.strata_steps
                else:
                    if strata_rate is None:
                        step_s = 6 * header["parameters"] * a.batch * CONTEXT / GUESS_FLOPS
                        rate = a.batch / step_s
                    else:
                        rate = strata_rate
                    steady = max(3, min(100000, math.ceil(a.seconds * rate / a.batch)))
                print(f"  round {rnd}: Strata, {STRATA_WARMUP_STEPS} + {steady} steps ...", file=sys.stderr, flush=True)
                run = strata_run(a, binary, rnd, steady, tmp)
                if not run["error"]:
                    strata_rate = run["examples_per_second"]
            else:
                print(f"  round {rnd}: FSDP2, {a.fsdp_warmup} warm-up steps + ~{a.seconds:g} s ...", file=sys.stderr, flush=True)
                run = fsdp_run(a, rnd, tmp)
            if run["error"]:
                print(f"fsdp.sh: {LABEL[c]} round {rnd} failed: {run['error']}", file=sys.stderr, flush=True)
                failed.add(c)
            else:
                mx, _ = fmt_rss(run)
                print(f"    {run['examples_per_second']:.3f} examples/s, peak RSS max {mx} MiB, {run['wall_seconds']:.0f} s",
                      file=sys.stderr, flush=True)
            runs.append(run)
    report(header, runs)
    if a.save:
        try:
            with open(a.save, "w") as f:
                json.dump({"header": header, "runs": runs}, f, indent=2)
                f.write("\n")
        except OSError as e:
            die(f"cannot write {a.save}: {e}")
    if failed:
        die("failed: " + ", ".join(LABEL[c] for c in CONFIGS if c in failed) + " (see above)")
    return 0


def remove_stale_dirs():
    """The directories of earlier drivers that were killed before their cleanup (SIGKILL):
    those whose pid file names no live process (their workers died with them: PDEATHSIG)."""
    for d in glob.glob("/tmp/strata-fsdp-*"):
        try:
            with open(os.path.join(d, "pid")) as f:
                pid = int(f.read().strip())
            os.kill(pid, 0)
            continue  # a driver still running
        except ProcessLookupError:
            pass
        except (OSError, ValueError):
            continue  # no pid file yet, or not ours to judge
        shutil.rmtree(d, ignore_errors=True)


def cleanup(*_):
    for pgid in list(live_groups):
        kill_group(pgid)
    if TMP[0]:
        shutil.rmtree(TMP[0], ignore_errors=True)
        TMP[0] = None


def cleanup_installed():
    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        cleanup()

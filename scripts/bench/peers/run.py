"""Runs the peers' configurations (each in its own processes), then `strata bench train`, and
prints one table. See scripts/bench/peers.sh for the options and what gets installed."""

import argparse
import datetime
import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import isa  # noqa: E402

# Configuration name -> (framework, script, its --config, processes).
CONFIGS = {
    "tf-one-device": ("tensorflow", "tf_bench.py", "one-device", 1),
    "tf-mirrored": ("tensorflow", "tf_bench.py", "mirrored", 1),
    "tf-mwms": ("tensorflow", "tf_bench.py", "mwms", 2),
    "torch-threads": ("pytorch", "torch_bench.py", "threads", 1),
    "torch-ddp": ("pytorch", "torch_bench.py", "ddp", 2),
}
LABEL = {
    "tf-one-device": "TF OneDevice",
    "tf-mirrored": "TF Mirrored(2 logical CPUs)",
    "tf-mwms": "TF MultiWorkerMirrored(2 proc)",
    "torch-threads": "PyTorch 1 proc x 2 threads",
    "torch-ddp": "PyTorch DDP gloo(2 proc)",
}

children = []  # every Popen alive; killed (by process group) on any exit


def kill_children(*_):
    for p in children:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    children.clear()


def on_signal(signum, _frame):
    kill_children()
    sys.exit(128 + signum)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd, env, out=subprocess.PIPE, err=subprocess.PIPE):
    p = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
    children.append(p)
    return p


def wait_all(ps, timeout):
    """Waits for every process; the first to fail, or the timeout, ends the others (a lone
    worker would otherwise wait for its peer until the timeout). Returns None, or why not."""
    deadline = time.time() + timeout
    while True:
        codes = [p.poll() for p in ps]
        if any(c not in (None, 0) for c in codes) and None in codes:
            time.sleep(2)  # let the others print why, then end them
            break
        if None not in codes:
            return None
        if time.time() > deadline:
            kill_children()
            return f"timed out after {timeout:.0f} s"
        time.sleep(0.2)
    for p in ps:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return None


def peer_env(a):
    return isa.peer_env(a.isa)


def run_peer(name, model, a):
    """A peer configuration's result, or None and why not. A configuration of several
    processes that fails is run once more (PyTorch's gloo sometimes aborts a DDP process,
    "terminate called without an active exception", at random); the result then says so."""
    r, why = run_peer_once(name, model, a)
    if r is None and CONFIGS[name][3] > 1 and not why.startswith("timed out"):
        print(f"  failed ({why}); once more", file=sys.stderr, flush=True)
        r, why2 = run_peer_once(name, model, a)
        if r is not None:
            r["retried_after"] = why
        else:
            why = f"{why}; again: {why2}"
    return r, why


def run_peer_once(name, model, a):
    framework, script, config, procs = CONFIGS[name]
    cmd = [sys.executable, os.path.join(HERE, script), "--model", model, "--config", config,
           "--seconds", str(a.seconds), "--warmup", str(a.warmup)]
    if a.steps:
        cmd += ["--steps", str(a.steps)]
    envs = []
    base = peer_env(a)
    if procs == 1:
        envs.append(base)
    elif framework == "tensorflow":
        workers = [f"127.0.0.1:{free_port()}" for _ in range(procs)]
        for i in range(procs):
            tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
            envs.append(dict(base, TF_CONFIG=json.dumps(tf_config)))
    else:
        port = str(free_port())
        for i in range(procs):
            envs.append(dict(base, RANK=str(i), WORLD_SIZE=str(procs), MASTER_ADDR="127.0.0.1",
                             MASTER_PORT=port, OMP_NUM_THREADS="1"))
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in envs]
    ps = [start(cmd, e, o, r) for e, (o, r) in zip(envs, files)]
    try:
        why = wait_all(ps, a.timeout)
        outs = []
        for o, r in files:
            o.seek(0)
            r.seek(0)
            outs.append((o.read(), r.read()))
    finally:
        for p in ps:
            if p in children:
                children.remove(p)
        for o, r in files:
            o.close()
            r.close()
    if why:
        return None, why
    bad = [(p.returncode, err) for p, (_, err) in zip(ps, outs) if p.returncode != 0]
    bad.sort(key=lambda b: b[0] < 0)  # a process that failed before one this launcher ended
    result = next((json.loads(line) for line in reversed(outs[0][0].splitlines()) if line.startswith("{")), None)
    if bad:
        code, err = bad[0]
        last = [line for line in err.strip().splitlines() if line.strip()][-1:] or ["(no message)"]
        why = f"exit {code}: {last[0][:200]}"
        # The first process prints its result after the last timed step, which every process
        # ended together (the stop agreement is a collective): a process that failed after it
        # failed in its teardown (gloo's "terminate called without an active exception"), and
        # the measurement stands; the table says so under it.
        if result is not None and procs > 1:
            result["failed_after_result"] = why
            return result, None
        return None, why
    if result is not None:
        return result, None
    return None, "printed no result"


def run_strata(models, a):
    """{(model, 'mirrored'|'multi-worker'|...): per second}, the raw output, and a note."""
    if a.no_strata:
        return {}, "", "skipped (--no-strata)"
    exe = a.strata
    if exe is None:
        return {}, "", a.build_failed
    results, raw, notes = {}, "", []
    flags = ["--rounds", str(a.strata_rounds), "--seconds", str(a.seconds), "--replicas", "2"]
    # One invocation per model: a model this binary does not know fails alone.
    for model in models:
        p = start([exe, "bench", "train", "--models", model] + flags, dict(os.environ))
        try:
            out, err = p.communicate(timeout=a.timeout * 4)
        except subprocess.TimeoutExpired:
            kill_children()
            notes.append(f"{model}: timed out")
            continue
        finally:
            if p in children:
                children.remove(p)
        raw += out
        if p.returncode != 0:
            msg = [line for line in err.strip().splitlines() if line.strip()][-1:] or [f"exit {p.returncode}"]
            notes.append(f"{model}: {msg[0][:160]}")
            continue
        results.update(parse_strata(out))
    return results, raw, "; ".join(notes)


def build_strata(a):
    """The strata binary to run (a.strata), built here unless --strata names one; None and
    a.build_failed when the build fails. Built once, before the first round."""
    if a.no_strata or a.strata:
        return
    # `--isa avx2`: Strata built without its `avx512` feature (isa.py), into target/avx2.
    build, exe = isa.strata_build(a.isa)
    if not os.path.exists(exe) or a.isa == "avx2":
        print(f"building strata: {' '.join(build)}", file=sys.stderr, flush=True)
        if subprocess.run(build, cwd=common.ROOT).returncode != 0:
            a.strata, a.build_failed = None, f"{' '.join(build)} failed"
            return
    a.strata = exe


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    h = len(xs) // 2
    return xs[h] if len(xs) % 2 else (xs[h - 1] + xs[h]) / 2


def parse_strata(text):
    """Rows of `strata bench train`'s tables: the header names the columns; the model, config
    and rate columns (examples/s, or tokens/s where a model reports tokens) come before any
    header of two words ("of ceiling"), so their word index is the field index of a row."""
    res, cols = {}, None
    for line in text.splitlines():
        f = line.split()
        if f[:1] == ["model"] and "config" in f:
            cols = f
            continue
        if cols is None or not f or line.startswith("#"):
            continue
        rate = next((i for i, c in enumerate(cols) if c in ("examples/s", "tokens/s")), None)
        if rate is None or len(f) <= rate:
            continue
        try:
            res[(f[cols.index("model")], f[cols.index("config")])] = float(f[rate].replace(",", ""))
        except ValueError:
            pass
    return res


def cpu_info():
    model, flags = "unknown CPU", set()
    try:
        for line in open("/proc/cpuinfo"):
            k, _, v = line.partition(":")
            if k.strip() == "model name" and model == "unknown CPU":
                model = v.strip()
            elif k.strip() == "flags" and not flags:
                flags = set(v.split())
    except OSError:
        pass
    if "avx512f" in flags:
        width = "AVX-512 (avx512f, 512-bit)"
    elif "avx2" in flags:
        width = "AVX2 (256-bit, no avx512f)"
    else:
        width = "no avx2/avx512f"
    return model, width, os.cpu_count()


def installed(dist_names):
    for d in dist_names:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def fmt(v):
    return "n/a" if v is None else f"{v:,.0f}"


def ratio(s, p):
    return "n/a" if s is None or p is None or p == 0 else f"{s / p:.2f}x"


def main():
    ap = argparse.ArgumentParser(description="Strata beside TensorFlow and PyTorch, measured in one run (scripts/bench/peers.sh adds --no-install: skip the pip step).")
    ap.add_argument("--models", default="small,large,cnn,transformer", help="of " + ", ".join(common.MODELS))
    ap.add_argument("--configs", default=",".join(CONFIGS), help="of " + ", ".join(CONFIGS))
    ap.add_argument("--seconds", type=float, default=10.0, help="timed steady state of each configuration")
    ap.add_argument("--steps", type=int, default=0, help="timed steps instead of --seconds (peers only)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps before the timing")
    ap.add_argument("--quick", action="store_true", help="~2 s per configuration, 3 warm-up steps, 1 Strata round")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one configuration may take")
    ap.add_argument("--strata", default=os.environ.get("STRATA", ""), help="the strata binary (default target/release/strata, built if missing)")
    ap.add_argument("--strata-rounds", type=int, default=3, help="strata bench train --rounds (it reports medians)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="alternate: N rounds of every peer configuration then Strata; the table gives medians "
                         "and the medians of each round's ratio (this host's rate drifts from minute to minute)")
    ap.add_argument("--no-strata", action="store_true", help="the peers only")
    ap.add_argument("--raw", action="store_true", help="also print strata bench train's own table")
    ap.add_argument("--isa", choices=isa.ISAS, default="native",
                    help="avx2: measure as on an AVX2 host: the peers with ATEN_CPU_CAPABILITY=avx2, "
                         "ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2; Strata built without "
                         "its avx512 feature (into target/avx2, unless --strata names a binary)")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error(f"--rounds {a.rounds}: use 1 or more")
    a.build_failed = ""
    if a.quick:
        a.seconds, a.warmup, a.strata_rounds = 2.0, 3, 1
    models = [m for m in a.models.split(",") if m]
    configs = [c for c in a.configs.split(",") if c]
    for m in models:
        if m not in common.MODELS:
            ap.error(f"unknown model {m!r}: use {', '.join(common.MODELS)}")
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"unknown configuration {c!r}: use {', '.join(CONFIGS)}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    versions = {"tensorflow": installed(["tensorflow-cpu", "tensorflow"]), "pytorch": installed(["torch"])}
    for fw, v in versions.items():
        if v is None and any(CONFIGS[c][0] == fw for c in configs):
            print(f"{fw} is not installed in {sys.prefix}: its configurations are skipped", file=sys.stderr)
    build_strata(a)
    # Each round measures every peer configuration, then Strata, so that a round's ratios
    # compare rates taken minutes apart at most; with --rounds N the table gives the medians.
    peers, stratas, raw, notes = [], [], "", []
    for rnd in range(a.rounds):
        peer = {}
        for m in models:
            for c in configs:
                fw = CONFIGS[c][0]
                if versions[fw] is None:
                    peer[(m, c)] = (None, "not installed")
                    continue
                print(f"round {rnd + 1}/{a.rounds}: running {LABEL[c]} on {m} ...", file=sys.stderr, flush=True)
                r, err = run_peer(c, m, a)
                peer[(m, c)] = (r, err)
                print(f"  {json.dumps(r) if r else 'failed: ' + err}", file=sys.stderr, flush=True)
                if r and fw == "tensorflow" and r.get("keras"):
                    versions["keras"] = r["keras"]
        print(f"round {rnd + 1}/{a.rounds}: running strata bench train ...", file=sys.stderr, flush=True)
        strata, out, note = run_strata(models, a)
        peers.append(peer)
        stratas.append(strata)
        raw += out
        if note:
            notes.append(f"round {rnd + 1}: {note}" if a.rounds > 1 else note)
    note = "; ".join(notes)

    cpu, width, cores = cpu_info()
    print()
    print(f"# Strata beside its peers, one run, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M %Z').strip()}")
    print(f"# CPU: {cpu}, {cores} cores, vector width {width}")
    print("# peers: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v) +
          f"; Python {sys.version.split()[0]}")
    print(f"# timed {a.steps} steps" if a.steps else f"# each configuration: {a.warmup} warm-up steps, then {a.seconds:g} s timed; "
          f"strata bench train: median of {a.strata_rounds} round(s) of {a.seconds:g} s")
    if a.rounds > 1:
        print(f"# {a.rounds} rounds, each the peers then Strata: rates are the rounds' medians, "
              "ratios the medians of each round's ratio (Strata / the peer of the same round)")
    print("# global batch 256 (transformer: 32 sequences of 64 tokens), f32, AdamW; "
          "rates in examples/s (tokens/s for the transformer)")
    backend = next((ln.split("backend:", 1)[1].strip() for ln in raw.splitlines() if "backend:" in ln), None)
    if a.isa == "avx2":
        print("# ISA: avx2 (as on an AVX2 host): the peers with " + " ".join(f"{k}={v}" for k, v in isa.AVX2_PEER_ENV.items()) +
              f"; Strata: {a.strata or 'built without its avx512 feature (target/avx2)'}")
        if backend and "AVX-512 in use" in backend:
            print("# WARNING: this Strata binary uses AVX-512 (its backend line below): its rows are not AVX2 figures")
    else:
        print("# ISA: native (every framework chooses its kernels for this CPU)")
    if backend:
        print(f"# strata's backend: {backend}")
    if note:
        print(f"# strata: {note}")
    print()
    head = ("model", "peer configuration", "peer", "Strata Mirrored(2)", "ratio", "Strata MWMS(2)", "ratio")
    rows, per_round = [], []
    for m in models:
        sm = median(s.get((m, "mirrored")) for s in stratas)
        sw = median(s.get((m, "multi-worker")) for s in stratas)
        for c in configs:
            ps = [pr[(m, c)][0]["per_second"] if pr[(m, c)][0] else None for pr in peers]
            p = median(ps)
            err = next((pr[(m, c)][1] for pr in peers if pr[(m, c)][1]), None)
            rm = [s.get((m, "mirrored")) / x if x and s.get((m, "mirrored")) else None for s, x in zip(stratas, ps)]
            rw = [s.get((m, "multi-worker")) / x if x and s.get((m, "multi-worker")) else None for s, x in zip(stratas, ps)]
            cell = lambda rs: ratio(median(rs), 1.0)  # noqa: E731
            rows.append((m, LABEL[c], fmt(p) if p is not None else f"failed ({err})" if err != "not installed" else "not installed",
                         fmt(sm), cell(rm) if a.rounds > 1 else ratio(sm, p), fmt(sw), cell(rw) if a.rounds > 1 else ratio(sw, p)))
            if a.rounds > 1:
                per_round.append(f"# {m}, {LABEL[c]}: {' '.join(fmt(x) for x in ps)}; Mirrored(2) "
                                 f"{' '.join(fmt(s.get((m, 'mirrored'))) for s in stratas)}, ratios "
                                 f"{' '.join(ratio(x, 1.0) if x else 'n/a' for x in rm)}; MWMS(2) "
                                 f"{' '.join(fmt(s.get((m, 'multi-worker'))) for s in stratas)}, ratios "
                                 f"{' '.join(ratio(x, 1.0) if x else 'n/a' for x in rw)}")
    widths = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    line = lambda x: "  ".join(str(v).ljust(w) if i < 2 else str(v).rjust(w) for i, (v, w) in enumerate(zip(x, widths)))  # noqa: E731
    print(line(head))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))
    print()
    print("# ratio = Strata / peer, both measured above in this run; n/a: not measured (a model strata bench train does not have)")
    if per_round:
        print("# each round, in order: the peer; Strata's rate and its ratio to the peer of that round")
        for line_ in per_round:
            print(line_)
    for rnd, peer in enumerate(peers):
        at = f" (round {rnd + 1})" if a.rounds > 1 else ""
        for m in models:
            for c in configs:
                r, _ = peer[(m, c)]
                if r and r.get("retried_after"):
                    print(f"# {m}, {LABEL[c]}{at}: measured at the second try; the first failed: {r['retried_after']}")
                if r and r.get("failed_after_result"):
                    print(f"# {m}, {LABEL[c]}{at}: a process failed after the timed steps ended, in its teardown "
                          f"({r['failed_after_result']}); the result stands")
    for m in models:
        keys = sorted({c for s in stratas for (mm, c) in s if mm == m and c not in ("mirrored", "multi-worker")})
        other = [f"{c} {' '.join(fmt(s.get((m, c))) for s in stratas)}" for c in keys]
        if other:
            print(f"# strata bench train's other rows, same run{' (each round)' if a.rounds > 1 else ''}, {m}: " + ", ".join(other))
    if a.raw and raw:
        print("# strata bench train's own output:")
        print(raw)


if __name__ == "__main__":
    try:
        main()
    finally:
        kill_children()

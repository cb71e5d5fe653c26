"""Strata's MultiWorkerMirrored beside PyTorch DDP (gloo) across emulated hosts: network
namespaces on one bridge, each host's link shaped with tc's tbf. Run it through
scripts/bench/hosts.sh (which checks for root, installs PyTorch, builds strata and cleans up
after any exit); see that file for what it measures.

Topology (every name starts with strata-bh-; nothing is added to the root namespace):
  strata-bh-br            a namespace holding the bridge br0 (no address)
  strata-bh-h1..hN        one namespace per host: eth0 with 10.213.77.(10+i)/24, and lo;
                          its veth peer is h<i> in strata-bh-br, a port of br0
Shaping of a link at RATE (both directions, each on the egress of one end of the veth pair):
  tc -n strata-bh-h<i> qdisc add dev eth0 root tbf rate RATE burst B latency 20ms
  tc -n strata-bh-br   qdisc add dev h<i> root tbf rate RATE burst B latency 20ms
with B = max(256 KiB, 4 ms at RATE) (smaller bursts do not reach the rate on a veth: see
--help of hosts.sh); "unshaped" deletes both qdiscs.
"""

import argparse
import datetime
import gzip
import json
import os
import shlex
import re
import shutil
import signal
import socket
import math
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
PREFIX = "strata-bh-"
BRIDGE_NS = PREFIX + "br"
SUBNET = "10.213.77"
LATENCY = "20ms"

# Our model name -> (strata train flags, peers' model name, unit, global batch).
MODELS = {
    "mlp": (["--model", "mlp", "--hidden", "2048,2048"], "large", "examples/s", 256),
    "cnn": (["--model", "cnn"], "cnn", "examples/s", 256),
    "transformer": (["--model", "transformer"], "transformer", "tokens/s", 32),
}
TITLE = {
    "mlp": "4.3M MLP (64-2048-2048-10), digits, global batch 256",
    "cnn": "CNN, digits as 8x8 images, global batch 256",
    "transformer": "character transformer (4 layers, width 128), Tiny Shakespeare, 32 windows of 64 tokens",
}
# Run length at --scale 1, sized for ~10-30 s a run on 2 cores: digits epochs (5 full batches
# of 256 each: see DIGITS_ROWS) or transformer steps; DDP runs the same number of global steps.
LENGTH = {"mlp": 20, "cnn": 600, "transformer": 250}
# Strata trains the digits models on the first 1,600 rows of data/digits.csv.gz (--data): its
# 80% training split is then 1,280 rows, 5 full global batches of 256 an epoch, the same steps as
# the DDP side (peers/common.py keeps the 5 full batches of the 1,437 training rows). With all
# 1,797 rows every 6th Strata step would be a tail of 157 examples that costs a whole step's
# all-reduce on a slow link.
DIGITS_ROWS = 1600
STEPS_PER_EPOCH = 5
COMPRESSIONS = ["none", "bf16", "fp16", "powersgd:4"]
DDP_HOOKS = ["none", "fp16", "powersgd"]
# The PyTorch side's configurations: DDP's hooks, and FSDP2 (the transformer only).
PEERS = DDP_HOOKS + ["fsdp2"]
DDP_LABEL = {"none": "DDP gloo", "fp16": "DDP gloo + fp16 hook", "powersgd": "DDP gloo + PowerSGD r4",
             "fsdp2": "FSDP2 gloo (fully_shard per block)"}
DDP_HEAD = {"none": "/ DDP", "fp16": "/ DDP fp16", "powersgd": "/ DDP PowerSGD", "fsdp2": "/ FSDP2"}

children = []
TOUCHED = [False]  # whether this process built (or cleaned) namespaces: then it tears them down
LOGDIR = [None, False]  # the runs' logs and whether to keep them (a run failed)


# --------------------------------------------------------------------------- arguments

RATE_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$", re.I)
RATE_MULT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
             "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


def parse_rate(text):
    """bits/s of a tc rate (1gbit, 100mbit, 10Gbit, 125mbps: tc's units, bps = bytes/s), None
    for "unshaped"; ValueError otherwise."""
    if text == "unshaped":
        return None
    m = RATE_RE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(text)
    return float(m.group(1)) * RATE_MULT[m.group(2).lower()]


def fmt_rate(bits):
    if bits is None:
        return "unshaped"
    for unit, mult in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= mult:
            return f"{bits / mult:g} {unit}"
    return f"{bits:g} bit/s"


def burst_bytes(bits):
    return max(256 * 1024, int(bits / 8 * 0.004))


def parser():
    ap = argparse.ArgumentParser(
        prog="scripts/bench/hosts.sh",
        description="Strata MultiWorkerMirrored (one replica per host) beside PyTorch DDP over gloo "
                    "(default, fp16 hook, PowerSGD rank 4) across N emulated hosts: network namespaces "
                    "on a bridge, each link shaped with tc tbf. Needs root, ip and tc.",
        epilog="Example: scripts/bench/hosts.sh --hosts 2 --links 1gbit,10gbit,unshaped --models mlp")
    ap.add_argument("--hosts", help="host counts, comma-separated (default 2,4; 4 hosts share this machine's cores)")
    ap.add_argument("--links", help="link rates in tc's units (1gbit, 100mbit, ...) or 'unshaped' (default 1gbit,10gbit,unshaped)")
    ap.add_argument("--strata-flags", default="", help="more `strata train` flags for every Strata run, "
                    "e.g. '--bucket-mib 1' (default none)")
    ap.add_argument("--models", help="of mlp (the 4.3M MLP), cnn, transformer (default all three)")
    ap.add_argument("--repeats", type=int, help="runs of every configuration, alternated; the median is reported (default 3)")
    ap.add_argument("--scale", type=float, help="multiplies every run's length: MLP 20 epochs of 5 steps, CNN 600 epochs, "
                    "transformer 250 steps at 1 (default 1)")
    ap.add_argument("--quick", action="store_true", help="smoke run: the defaults become 1 repeat, 2 hosts, 1gbit and unshaped, "
                    "the MLP, --scale 0.5 (options given beside it still apply)")
    ap.add_argument("--no-install", action="store_true", help="do not install PyTorch into PEERS_VENV when it is missing "
                    "(hosts.sh's own option)")
    ap.add_argument("--compressions", help="Strata's compressions to run, of " + ",".join(COMPRESSIONS)
                    + " (default all this build has)")
    ap.add_argument("--zero-stages", default="0", help="ZeRO stages Strata runs without compression, of 0,1,2,3 (default 0); "
                    "stage N > 0 is the configuration none+zeroN, alternated with the others")
    ap.add_argument("--no-ddp", action="store_true", help="Strata only")
    ap.add_argument("--peers", default=",".join(DDP_HOOKS),
                    help="the PyTorch configurations, of " + ",".join(PEERS) + " (default " + ",".join(DDP_HOOKS)
                    + "; fsdp2: FSDP2 with fully_shard per block, the transformer only, beside Strata's "
                    "--zero-stages 3)")
    ap.add_argument("--no-strata", action="store_true", help="DDP only")
    ap.add_argument("--strata", default=os.path.join(ROOT, "target", "release", "strata"), help="the strata binary")
    ap.add_argument("--python", default="", help="the Python with torch for DDP (hosts.sh passes the peers venv's)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    ap.add_argument("--save", metavar="FILE", help="also write every run's figures and the header as JSON here")
    ap.add_argument("--render", metavar="FILE", help="print the report of a run saved with --save (runs nothing; no root needed)")
    ap.add_argument("--check-args", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--command", default="", help=argparse.SUPPRESS)
    ap.add_argument("--tput", nargs="+", help=argparse.SUPPRESS)
    return ap


def parse_args(argv):
    ap = parser()
    a = ap.parse_args(argv)
    # --quick changes the defaults; an option given beside it still counts.
    quick = {"repeats": 1, "hosts": "2", "links": "1gbit,unshaped", "models": "mlp", "scale": 0.5}
    full = {"repeats": 3, "hosts": "2,4", "links": "1gbit,10gbit,unshaped", "models": "mlp,cnn,transformer", "scale": 1.0}
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    bad = lambda msg: (print(f"hosts.sh: {msg}", file=sys.stderr), sys.exit(2))  # noqa: E731
    links = []
    for t in [x.strip() for x in a.links.split(",") if x.strip()]:
        try:
            links.append((t, parse_rate(t)))
        except ValueError:
            bad(f"--links: {t!r} is not a rate tc understands (e.g. 1gbit, 100mbit, 10gbit) nor 'unshaped'")
    if not links:
        bad("--links names no link")
    try:
        hosts = [int(x) for x in a.hosts.split(",") if x.strip()]
    except ValueError:
        hosts = []
    if not hosts or any(h < 2 or h > 16 for h in hosts):
        bad(f"--hosts {a.hosts!r}: host counts from 2 to 16, comma-separated (e.g. 2,4)")
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            bad(f"--models: unknown model {m!r}; use mlp, cnn, transformer")
    if not models:
        bad("--models names no model")
    if a.repeats < 1:
        bad("--repeats must be 1 or more")
    if not a.scale > 0:
        bad("--scale must be positive")
    if a.compressions is not None:
        for c in a.compressions.split(","):
            if c not in COMPRESSIONS:
                bad(f"--compressions: unknown compression {c!r}; use some of {','.join(COMPRESSIONS)}")
    a.zero_list = []
    for z in a.zero_stages.split(","):
        if z.strip() not in ("0", "1", "2", "3"):
            bad(f"--zero-stages: unknown stage {z!r}; use some of 0,1,2,3")
        a.zero_list.append(int(z))
    if a.no_ddp and a.no_strata:
        bad("--no-ddp and --no-strata leave nothing to run")
    a.peer_list = [x.strip() for x in a.peers.split(",") if x.strip()]
    for x in a.peer_list:
        if x not in PEERS:
            bad(f"--peers: unknown configuration {x!r}; use some of {','.join(PEERS)}")
    if "fsdp2" in a.peer_list and models != ["transformer"]:
        bad("--peers fsdp2 runs the transformer only: add --models transformer")
    a.link_list, a.host_list, a.model_list = links, hosts, models
    a.strata = os.path.abspath(a.strata)
    return a


# --------------------------------------------------------------------------- processes


def sh(*cmd, check=True):
    r = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")
    return r


def start(cmd, env, out, err):
    p = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
    children.append(p)
    return p


def kill_children():
    for p in children:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in children:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    children.clear()


def our_namespaces():
    r = sh("ip", "netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.startswith(PREFIX)]


def teardown():
    """Kills every process left in a strata-bh- namespace (by id) and deletes the namespaces
    (their veths go with them)."""
    kill_children()
    for ns in our_namespaces():
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()]
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if pids:
                time.sleep(0.5)
        sh("ip", "netns", "del", ns, check=False)


def on_signal(signum, _frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    kill_children()
    if TOUCHED[0]:
        teardown()
    if LOGDIR[0]:
        shutil.rmtree(LOGDIR[0], ignore_errors=True)
        LOGDIR[0] = None
    sys.exit(128 + signum)


# --------------------------------------------------------------------------- topology


def host_ns(i):
    return f"{PREFIX}h{i + 1}"


def addr(i):
    return f"{SUBNET}.{11 + i}"


def build_hosts(n):
    TOUCHED[0] = True
    teardown()
    sh("ip", "netns", "add", BRIDGE_NS)
    sh("ip", "-n", BRIDGE_NS, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", BRIDGE_NS, "link", "set", "br0", "up")
    for i in range(n):
        ns = host_ns(i)
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"h{i + 1}", "netns", BRIDGE_NS)
        sh("ip", "-n", BRIDGE_NS, "link", "set", f"h{i + 1}", "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", f"{addr(i)}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def shape(n, bits, log):
    """Sets (or, for None, removes) every link's tbf; returns the commands run."""
    cmds = []
    for i in range(n):
        for ns, dev in ((host_ns(i), "eth0"), (BRIDGE_NS, f"h{i + 1}")):
            sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            if bits is not None:
                cmd = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(bits)}bit",
                       "burst", str(burst_bytes(bits)), "latency", LATENCY]
                sh(*cmd)
                cmds.append(" ".join(cmd))
    for c in cmds[:2]:
        log(f"  {c}")
    if len(cmds) > 2:
        log(f"  ... and the same on the other {n - 1} host(s)")
    return cmds


def measure_link(port):
    """TCP goodput host 1 -> host 2 over 1.5 s (one stream, Gbit/s), or None."""
    me = [sys.executable, os.path.abspath(__file__), "--tput"]
    server = start(["ip", "netns", "exec", host_ns(1)] + me + ["server", addr(1), str(port)], dict(os.environ),
                   subprocess.PIPE, subprocess.DEVNULL)
    time.sleep(0.4)
    client = start(["ip", "netns", "exec", host_ns(0)] + me + ["client", addr(1), str(port), "1.5"], dict(os.environ),
                   subprocess.DEVNULL, subprocess.DEVNULL)
    try:
        client.wait(timeout=20)
        out, _ = server.communicate(timeout=20)
        return float(out.strip())
    except (subprocess.TimeoutExpired, ValueError):
        return None
    finally:
        for p in (client, server):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            if p in children:
                children.remove(p)


def tput(argv):
    mode, host, port = argv[0], argv[1], int(argv[2])
    if mode == "server":
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(1)
        c, _ = s.accept()
        n, t0 = 0, None
        while True:
            b = c.recv(1 << 20)
            if not b:
                break
            if t0 is None:
                t0 = time.perf_counter()
            n += len(b)
        print(n * 8 / (time.perf_counter() - t0) / 1e9)
    else:
        c = socket.create_connection((host, port))
        buf, end = b"\0" * (1 << 20), time.perf_counter() + float(argv[3])
        while time.perf_counter() < end:
            c.sendall(buf)
        c.close()


# --------------------------------------------------------------------------- runs


def wait_all(ps, timeout):
    """Waits for every process; the first to fail ends the others. None, or why not."""
    deadline = time.time() + timeout
    while True:
        codes = [p.poll() for p in ps]
        if None not in codes:
            return None
        if any(c not in (None, 0) for c in codes):
            time.sleep(2)
            break
        if time.time() > deadline:
            for p in ps:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            for p in ps:
                p.wait()
            return f"timed out after {timeout:.0f} s"
        time.sleep(0.1)
    for p in ps:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    return None


def run_hosts(cmds_envs, logdir, tag, timeout):
    """Starts one command per host (in its namespace); returns (stdouts, error or None)."""
    files, ps = [], []
    for i, (cmd, env) in enumerate(cmds_envs):
        o = open(os.path.join(logdir, f"{tag}.h{i + 1}.out"), "w+")
        e = open(os.path.join(logdir, f"{tag}.h{i + 1}.err"), "w+")
        files.append((o, e))
        ps.append(start(["ip", "netns", "exec", host_ns(i)] + cmd, env, o, e))
    try:
        why = wait_all(ps, timeout)
        outs = []
        for o, e in files:
            o.seek(0)
            e.seek(0)
            outs.append((o.read(), e.read()))
    finally:
        for p in ps:
            if p in children:
                children.remove(p)
        for o, e in files:
            o.close()
            e.close()
    if why:
        return outs, why
    bad = sorted([(p.returncode, err) for p, (_, err) in zip(ps, outs) if p.returncode != 0], key=lambda b: b[0] < 0)
    if bad:
        code, err = bad[0]
        last = [x for x in err.strip().splitlines() if x.strip()][-1:] or ["(no message)"]
        return outs, f"exit {code}: {last[0][:300]}"
    return outs, None


PORT = [20000]


def next_port():
    PORT[0] = 20000 + (PORT[0] - 19999) % 20000
    return PORT[0]


def strata_run(a, model, n, compression, logdir, tag):
    flags, _, unit, batch = MODELS[model]
    length = max(2, round(LENGTH[model] * a.scale))
    out = os.path.join(logdir, f"{tag}.json")
    port = next_port()
    workers = [f"{addr(i)}:{port}" for i in range(n)]
    base = [a.strata, "train", "--strategy", "multi-worker-mirrored", "--replicas", "1"] + flags + [
        "--batch", str(batch), "--lr", "0.003", "--no-progress", "--out", out]
    base += ["--steps", str(length)] if model == "transformer" else ["--epochs", str(length), "--data", a.digits]
    compression, zero = split_zero(compression)
    if compression is not None:
        base += ["--compression", compression]
    if zero:
        base += ["--zero-stage", str(zero)]
    base += shlex.split(a.strata_flags)
    s, why = strata_job(base, workers, out, logdir, tag, a.timeout)
    if why:
        return None, why
    rate = s.get("tokens_per_second") if unit == "tokens/s" else s.get("examples_per_second")
    return {"rate": rate, "parameters": s.get("parameters")}, None


def strata_job(base, workers, out, logdir, tag, timeout):
    """Runs `base` (a `strata train` command line) on every host of `workers` (`addr:port` of
    each, in host order) as a multi-worker job: TF_CONFIG naming them, --bind the host's address;
    returns (the chief's summary from `out`, None), or (None, why not)."""
    jobs = []
    for i in range(len(workers)):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}))
        jobs.append((base + ["--bind", addr(i)], env))
    _, why = run_hosts(jobs, logdir, tag, timeout)
    if why:
        return None, why
    try:
        return json.load(open(out)), None
    except (OSError, ValueError) as e:
        return None, f"no summary from the chief: {e}"


def fsdp_run(a, model, n, logdir, tag):
    """FSDP2 (scripts/bench/peers/fsdp_peer.py: fully_shard per block, then the model; gloo, 1
    thread), one process per host, hosts.sh's transformer (width 128, 4 layers, 4 heads) and
    global batch, the steps of the DDP side after 10 warm-up steps. Its bytes: two all-gathers
    of the parameters (forward and backward) and a reduce-scatter of the gradient a step, which
    send what an all-reduce of 1.5 times the f32 parameters does over the ring."""
    _, _, _, batch = MODELS[model]
    steps = max(2, round(LENGTH[model] * a.scale))
    port = next_port()
    out = os.path.join(logdir, f"{tag}-results")
    os.makedirs(out, exist_ok=True)
    cmd = [a.python, os.path.join(HERE, "peers", "fsdp_peer.py"), "--width", "128", "--layers", "4", "--heads", "4",
           "--batch", str(batch), "--steps", str(steps), "--warmup", "10", "--out", out]
    jobs = []
    for i in range(n):
        env = dict(os.environ, RANK=str(i), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE="1", MASTER_ADDR=addr(0),
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        jobs.append((cmd, env))
    _, why = run_hosts(jobs, logdir, tag, a.timeout)
    if why:
        return None, why
    try:
        r = json.load(open(os.path.join(out, "result-0.json")))
    except (OSError, ValueError) as e:
        return None, f"no result from rank 0: {e}"
    return {"rate": r["tokens_per_second"], "parameters": r["parameters"], "allreduced": 6 * r["parameters"]}, None


def ddp_run(a, model, n, hook, logdir, tag):
    if hook == "fsdp2":
        return fsdp_run(a, model, n, logdir, tag)
    _, peer, unit, batch = MODELS[model]
    length = max(2, round(LENGTH[model] * a.scale))
    steps = length if model == "transformer" else length * STEPS_PER_EPOCH
    port = next_port()
    cmd = [a.python, os.path.join(HERE, "ddp_hosts.py"), "--model", peer, "--hook", hook, "--rank", "4",
           "--steps", str(steps), "--warmup", "10", "--lr", "0.003"]
    jobs = []
    for i in range(n):
        env = dict(os.environ, RANK=str(i), WORLD_SIZE=str(n), MASTER_ADDR=addr(0), MASTER_PORT=str(port),
                   GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        jobs.append((cmd, env))
    outs, why = run_hosts(jobs, logdir, tag, a.timeout)
    if why:
        return None, why
    for line in reversed(outs[0][0].splitlines()):
        if line.startswith("{"):
            r = json.loads(line)
            return {"rate": r["per_second"], "parameters": r["parameters"], "shapes": r["shapes"],
                    "allreduced": r["allreduced_bytes"]}, None
    return None, "rank 0 printed no result"


# --------------------------------------------------------------------------- bytes and table


def ring_bytes(payload, n):
    """Bytes each host sends in a ring all-reduce of `payload` bytes over n hosts."""
    return 2 * (n - 1) / n * payload


def split_zero(variant):
    """A Strata configuration's compression and ZeRO stage: `none+zero2` is (none, 2)."""
    if variant is not None and "+zero" in variant:
        c, z = variant.split("+zero")
        return c, int(z)
    return variant, 0


def strata_payload(compression, params, shapes):
    # ZeRO across workers reduce-scatters the gradients and all-gathers the parameters: each
    # host sends what a ring all-reduce of the gradients sends. Stage 3 pulls every other
    # host's shard of the parameters twice (forward and backward) beside the reduce-scatter:
    # 1.5 times that (less the last forward unit, which the backward pass finds whole).
    compression, zero = split_zero(compression)
    if compression in (None, "none"):
        return 6 * params if zero == 3 else 4 * params
    if compression in ("bf16", "fp16"):
        return 2 * params
    m = re.match(r"powersgd:(\d+)", compression)
    if m and shapes:
        r, total = int(m.group(1)), 0
        for s in shapes:
            numel = 1
            for d in s:
                numel *= d
            rows, cols = s[0], numel // s[0]
            rr = min(rows, cols, r)
            total += 4 * rr * (rows + cols) if len(s) > 1 and 2 * rr * (rows + cols) < numel else 4 * numel
        return total
    return None


def fmt_bytes(b):
    if b is None:
        return "n/a"
    for unit, mult in (("MB", 1e6), ("kB", 1e3)):
        if b >= mult:
            return f"{b / mult:.2f} {unit}" if b < 10 * mult else f"{b / mult:.1f} {unit}"
    return f"{b:.0f} B"


def fmt_num(v):
    return "n/a" if v is None else f"{v:,.0f}"


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            k, _, v = line.partition(":")
            if k.strip() == "model name":
                return v.strip()
    except OSError:
        pass
    return "unknown CPU"


def main(argv):
    a = parse_args(argv)
    if a.check_args:
        return 0
    if a.render:
        print(render(json.load(open(a.render))))
        return 0
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    log = lambda *x: print(*x, file=sys.stderr, flush=True)  # noqa: E731

    has_strata = not a.no_strata and os.access(a.strata, os.X_OK)
    compressions, comp_note = [None], ""
    if not a.no_strata:
        if not has_strata:
            comp_note = f"strata: {a.strata} not found; Strata rows skipped"
        else:
            h = subprocess.run([a.strata, "train", "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout
            if "--compression" in h:
                # the options this build's help names (powersgd is not on the ring yet)
                compressions = [c for c in COMPRESSIONS if c.split(":")[0] in h]
                skipped = [c for c in COMPRESSIONS if c not in compressions]
                if a.compressions:
                    compressions = [c for c in compressions if c in a.compressions.split(",")]
                comp_note = "strata train has --compression: Strata runs each of " + ", ".join(compressions)
                if skipped:
                    comp_note += "; not in this build: " + ", ".join(skipped)
            else:
                comp_note = ("strata train has no --compression flag in this build: Strata runs only without "
                             "compression (none); the bf16, fp16 and powersgd:4 rows are not measured")
    has_torch = False
    torch_version = None
    if not a.no_ddp and a.python:
        r = subprocess.run([a.python, "-c", "import torch; print(torch.__version__)"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
        has_torch = r.returncode == 0
        torch_version = r.stdout.strip() if has_torch else None
    ddp_note = "" if a.no_ddp else (f"PyTorch {torch_version} ({a.python})" if has_torch
                                     else f"PyTorch does not import with {a.python or '(no python)'}: DDP rows skipped")
    configs = []
    if has_strata:
        configs += [("strata", c) for c in compressions]
        configs += [("strata", f"none+zero{z}") for z in a.zero_list if z > 0]
        if any(z > 0 for z in a.zero_list) and 0 not in a.zero_list:
            configs = [c for c in configs if c != ("strata", "none")]
    if has_torch:
        configs += [("ddp", h) for h in a.peer_list]
    if not configs:
        log("hosts.sh: nothing to run (" + "; ".join(x for x in (comp_note, ddp_note) if x) + ")")
        return 2

    started = datetime.datetime.now(datetime.timezone.utc)
    load0 = open("/proc/loadavg").read().split()[:3]
    logdir = tempfile.mkdtemp(prefix="strata-bh-logs-")
    LOGDIR[0] = logdir
    a.digits = os.path.join(logdir, f"digits-{DIGITS_ROWS}.csv")
    with gzip.open(os.path.join(ROOT, "data", "digits.csv.gz"), "rt") as src, open(a.digits, "w") as dst:
        dst.writelines(line for _, line in zip(range(DIGITS_ROWS), src))
    os.environ.setdefault("STRATA_CLUSTER_TOKEN", os.urandom(24).hex())
    results = {}  # (model, hosts, link, kind, variant) -> [rates]
    meta = {}  # model -> parameters / shapes
    failures = []
    links_measured = {}
    total_runs = len(a.host_list) * len(a.model_list) * len(a.link_list) * a.repeats * len(configs)
    done = 0
    t_start = time.time()
    for n in a.host_list:
        log(f"building {n} hosts: namespaces {BRIDGE_NS} (bridge br0) and {host_ns(0)}..{host_ns(n - 1)}, {SUBNET}.0/24")
        build_hosts(n)
        for model in a.model_list:
            # Each round runs every link and every configuration once, so that a change of the
            # machine's load between rounds touches all cells alike (the limit divides them).
            for rep in range(a.repeats):
                for link, bits in a.link_list:
                    log(f"round {rep + 1}, link {link}:")
                    shape(n, bits, log if rep == 0 else (lambda *_: None))
                    if (n, link) not in links_measured:
                        g = measure_link(next_port())
                        links_measured[(n, link)] = g
                        log(f"  TCP goodput host 1 -> host 2, one stream, 1.5 s: {g:.2f} Gbit/s" if g else "  link measurement failed")
                    for kind, variant in configs:
                        done += 1
                        tag = f"{model}-n{n}-{link}-{kind}-{variant}-r{rep}".replace(":", "")
                        label = f"[{done}/{total_runs}] {model}, {n} hosts, {link}, " + (
                            f"Strata MWMS compression {variant or 'none'}" if kind == "strata" else DDP_LABEL[variant])
                        t0 = time.time()
                        if kind == "strata":
                            r, why = strata_run(a, model, n, variant, logdir, tag)
                        else:
                            r, why = ddp_run(a, model, n, variant, logdir, tag)
                        runs = results.setdefault((model, n, link, kind, variant), [None] * a.repeats)
                        if r is None:
                            log(f"{label}: failed ({why}); logs in {logdir}")
                            failures.append(f"{label}: {why}")
                            continue
                        log(f"{label}: {r['rate']:,.0f} {MODELS[model][2]} ({time.time() - t0:.0f} s)")
                        runs[rep] = r["rate"]
                        m = meta.setdefault(model, {})
                        if kind == "strata":
                            m["strata_params"] = r["parameters"]
                        else:
                            m["ddp_params"] = r["parameters"]
                            if r.get("shapes") is not None:
                                m["shapes"] = r["shapes"]
                            m.setdefault("ddp_bytes", {})[variant] = r["allreduced"]
        teardown()

    load1 = open("/proc/loadavg").read().split()[:3]
    header = [
        f"- command: `{a.command or ' '.join(['scripts/bench/hosts.sh'] + argv)}`",
        f"- CPU: {cpu_model()}, {os.cpu_count()} cores; load average at the start {' '.join(load0)}, at the end "
        f"{' '.join(load1)}; {time.time() - t_start:.0f} s in all",
        f"- strata: {a.strata}" + (f"; {comp_note}" if comp_note else ""),
    ]
    if ddp_note:
        header.append(f"- DDP: {ddp_note}; one process per host, torch.set_num_threads(1), GLOO_SOCKET_IFNAME=eth0")
    header.append(f"- hosts: network namespaces on one bridge (namespace {BRIDGE_NS}), {SUBNET}.0/24; links: " + ", ".join(
        f"{link} ({fmt_rate(bits)}" + (f", tbf burst {burst_bytes(bits) // 1024} KiB latency {LATENCY}" if bits else "") + ")"
        for link, bits in a.link_list))
    header.append("- measured TCP goodput host 1 -> host 2 (one stream, 1.5 s, before the runs): " + ", ".join(
        f"{n} hosts {link} {g:.2f} Gbit/s" if g else f"{n} hosts {link} n/a" for (n, link), g in links_measured.items()))
    if failures:
        header.append("- failed runs: " + "; ".join(failures))
    record = {
        "started": started.strftime("%Y-%m-%d %H:%M UTC"), "header": header, "hosts": a.host_list,
        "links": a.link_list, "models": a.model_list, "repeats": a.repeats, "configs": configs,
        "results": [[list(k), v] for k, v in results.items()], "meta": meta, "cores": os.cpu_count(),
    }
    if a.save:
        with open(a.save, "w") as f:
            json.dump(record, f, indent=1)
    print(render(record), flush=True)
    if failures:
        LOGDIR[1] = True
        open(os.path.join(logdir, "KEPT"), "w").write("a run failed: these logs are kept\n")
        log(f"logs of the runs kept in {logdir}")
    return 1 if failures and not any(v for vs in results.values() for v in vs) else 0


def render(rec):
    """The markdown report of a run (`record` of main, or the JSON --save wrote)."""
    links = [tuple(x) for x in rec["links"]]
    configs = [tuple(x) for x in rec["configs"]]
    # The PyTorch configurations of the run (a record saved before FSDP2 had all of DDP's).
    peers = [v for k, v in configs if k == "ddp"] or DDP_HOOKS
    results = {tuple(k): v for k, v in rec["results"]}
    cores = rec["cores"]
    out = []
    p = out.append
    p(f"# Strata MultiWorkerMirrored beside PyTorch DDP across emulated hosts, {rec['started']}")
    p("")
    out.extend(rec["header"])
    p(f"- {rec['repeats']} round(s), each running every link and, on each link, every configuration once "
      f"(A B C D A B C D ...); rates: the median over the rounds; Strata: the chief's steady-state rate from --out "
      f"(the first epoch's steps excluded; digits models on the first {DIGITS_ROWS} rows, so that every step is a "
      f"full global batch as on the DDP side); DDP: 10 warm-up steps (PowerSGD's 2 vanilla all-reduce iterations "
      f"among them), then the timed steps; AdamW lr 0.003, weight decay 0.01")
    p("- bytes on the wire per step per host: computed, not measured: a ring all-reduce of G bytes sends 2(N-1)/N x G "
      "from each host; G = 4 x parameters (f32), 2 x parameters for fp16/bf16, and for PowerSGD rank r the f32 P and Q "
      "factors r(rows+cols) of each gradient that powerSGD_hook compresses (viewed as shape[0] x rest, when it shrinks "
      "it more than 2x) plus the others whole; TCP/IP framing (~4.6% at MTU 1500) not counted")
    p("- limit: a step takes at least the longer of the configuration's unshaped step time and the bytes over the link "
      "rate; limit = global batch / that. Each round's shaped run is paired with the same round's unshaped run of the "
      "configuration; the limit and % of limit shown are the medians over the rounds of those pairs (unshaped rows: "
      "100% by definition). Ratios: Strata's median over DDP's median")
    p("- ring model: what `strata compare --simulate` charges a MultiWorkerMirrored step, `compute + max(0, ring "
      "bytes over the link rate - overlap x compute)` (`[simulate] overlap`), compute being the configuration's "
      "unshaped step, each round's shaped run paired with its unshaped one (median), with the overlap fitted to the "
      "model's shaped Strata runs (least squares of the log error over their configurations; PowerSGD's, whose bytes "
      "hide in any step, not counted): the calibration `[simulate] overlap` takes for that model; in brackets, measured over "
      "modelled")
    for model in rec["models"]:
        _, _, unit, batch = MODELS[model]
        units = batch_units(model)
        m = rec["meta"].get(model, {})
        params = m.get("ddp_params") or m.get("strata_params")
        p("")
        p(f"## {TITLE[model]}")
        p("")
        if m.get("strata_params") and m.get("ddp_params") and m["strata_params"] != m["ddp_params"]:
            p(f"(parameters: Strata {m['strata_params']:,}, PyTorch {m['ddp_params']:,})")
        elif params:
            p(f"({params:,} parameters, {fmt_bytes(4 * params)} of f32 gradients)")
        p("")
        def wire_of(n, kind, variant):
            same_shapes = m.get("strata_params") == m.get("ddp_params")
            if kind == "strata":
                payload = strata_payload(variant, m.get("strata_params") or params,
                                         m.get("shapes") if same_shapes else None)
            else:
                payload = m.get("ddp_bytes", {}).get(variant)
            return ring_bytes(payload, n) if payload is not None else None

        unshaped = next((link for link, bits in links if bits is None), None)
        # The overlap share fitted to the shaped Strata runs (PowerSGD's, whose few bytes hide in
        # any step, not counted): the one that minimizes the squared log error of the ring
        # model's median against the measured median over every such configuration (hosts,
        # link, compression), searched on a grid of 0.01. A share each run implied alone
        # (compute + comm - step, over compute) is biased low on fast links, where the whole
        # transfer hides and the step shows only the share it needed.
        cases = []
        for n in rec["hosts"]:
            for link, bits in links:
                for kind, variant in configs:
                    wire = wire_of(n, kind, variant)
                    if kind != "strata" or bits is None or unshaped is None or wire is None \
                            or (variant or "").startswith("powersgd"):
                        continue
                    runs = results.get((model, n, link, kind, variant), [])
                    base = results.get((model, n, unshaped, kind, variant), [])
                    pairs = [(r, b) for r, b in zip(runs, base) if r and b]
                    if pairs:
                        cases.append((statistics.median(r for r, _ in pairs),
                                      [(units / b, wire * 8 / bits) for _, b in pairs]))

        def model_error(o):
            total = 0.0
            for measured, steps in cases:
                pred = statistics.median(units / (tc + max(0.0, tw - o * tc)) for tc, tw in steps)
                total += math.log(measured / pred) ** 2
            return total

        overlap = min((k / 100 for k in range(96)), key=model_error) if cases else 0.0
        if cases:
            p(f"Ring model overlap fitted to this model's runs: {overlap:.2f} (least squares over "
              f"{len(cases)} shaped configurations).")
            p("")
        head = ["hosts", "link", "configuration", "bytes/step/host", unit, "limit", "% of limit"] + [
            DDP_HEAD[h] for h in peers] + [f"ring model, overlap {overlap:.2f} (error)"]
        p("| " + " | ".join(head) + " |")
        p("|" + "|".join("---" if i < 3 else "---:" for i in range(len(head))) + "|")
        for n in rec["hosts"]:
            for link, bits in links:
                med = {}
                for kind, variant in configs:
                    v = [x for x in results.get((model, n, link, kind, variant), []) if x is not None]
                    med[(kind, variant)] = statistics.median(v) if v else None
                for kind, variant in configs:
                    if kind == "strata":
                        name = "Strata MWMS" + (f" {variant}" if variant not in (None, "none") else "")
                    else:
                        name = DDP_LABEL[variant]
                    wire = wire_of(n, kind, variant)
                    rate = med[(kind, variant)]
                    runs = results.get((model, n, link, kind, variant), [])
                    base = results.get((model, n, unshaped, kind, variant), []) if unshaped else []
                    limits, shares, modelled = [], [], []
                    for r, b in zip(runs, base):
                        if r is None or b is None:
                            continue
                        lim = b if bits is None else (units / max(units / b, wire * 8 / bits) if wire is not None else None)
                        if lim:
                            limits.append(lim)
                            shares.append(r / lim)
                        # strata compare's simulated ring step: the unshaped step, then what of
                        # the ring's bytes over the link (Network::ring_allreduce_s) the fitted
                        # overlap does not hide.
                        if kind == "strata" and bits is not None and wire is not None:
                            tc = units / b
                            modelled.append(units / (tc + max(0.0, wire * 8 / bits - overlap * tc)))
                    model_cell = ""
                    if modelled and rate:
                        pred = statistics.median(modelled)
                        model_cell = f"{fmt_num(pred)} ({100 * (rate / pred - 1):+.0f}%)"
                    limit = statistics.median(limits) if limits else None
                    pct = f"{100 * statistics.median(shares):.0f}%" if shares else "n/a"
                    ratios = []
                    for h in peers:
                        d = med.get(("ddp", h))
                        ratios.append(f"{rate / d:.2f}x" if kind == "strata" and rate and d else "")
                    hosts_cell = f"{n}" + (f" (share {cores} cores)" if n > cores else "")
                    p("| " + " | ".join([hosts_cell, link, name, fmt_bytes(wire), fmt_num(rate), fmt_num(limit), pct]
                                       + ratios + [model_cell]) + " |")
        runs = [f"{n}/{link}/{'Strata' if kind == 'strata' else 'DDP'} {variant or 'none'}: "
                + ", ".join(fmt_num(v) for v in vs)
                for (mm, n, link, kind, variant), vs in results.items() if mm == model]
        if runs:
            p("")
            p("Every run, round by round (hosts/link/configuration): " + "; ".join(runs))
        paired = []
        for n in rec["hosts"]:
            for link, _ in links:
                for skind, svar in configs:
                    if skind != "strata":
                        continue
                    srun = results.get((model, n, link, skind, svar), [])
                    for h in peers:
                        drun = results.get((model, n, link, "ddp", h), [])
                        rs = [s / d for s, d in zip(srun, drun) if s and d]
                        if rs:
                            paired.append(f"{n}/{link} Strata{'' if svar in (None, 'none') else ' ' + svar} / "
                                          f"{DDP_LABEL[h]}: " + ", ".join(f"{x:.2f}" for x in rs))
        if paired:
            p("")
            p("Strata / DDP within each round (runs next to each other in time): " + "; ".join(paired))
    if any(n > cores for n in rec["hosts"]):
        p("")
        p(f"With more hosts than this machine's {cores} cores, the hosts' processes share the cores: "
          "those rows measure the CPU contention as much as the links.")
    return "\n".join(out)


def batch_units(model):
    _, _, unit, batch = MODELS[model]
    return batch * 64 if unit == "tokens/s" else batch


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--tput":
        tput(sys.argv[2:])
        sys.exit(0)
    try:
        code = main(sys.argv[1:])
    finally:
        if TOUCHED[0]:
            teardown()
        if LOGDIR[0] and not LOGDIR[1]:
            shutil.rmtree(LOGDIR[0], ignore_errors=True)
    sys.exit(code)

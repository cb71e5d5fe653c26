#!/usr/bin/env bash
# What a lost worker costs an elastic job, Strata beside torchrun, in the same run on this
# machine. Both train the 4.3M MLP (64-2048-2048-10, plain SGD at --lr 0.003, the shipped digits,
# global batch 256: 6 steps an epoch, --epochs 40 = 240 steps) on 3 processes of loopback:
#   - Strata: strata launch --workers 3 --max-restarts 1 -- strata train --strategy
#     multi-worker-mirrored --min-workers 2 --hidden 2048,2048 --optimizer sgd (elastic: the
#     survivors go on, the restarted process joins at a step boundary and takes their state);
#   - torchrun: three agents, each one "node" (torchrun --nnodes 2:3 --nproc-per-node 1
#     --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT), running PyTorch DDP
#     over gloo (scripts/bench/peers/ddp_elastic.py: the same model, data cut and optimizer; a
#     snapshot every epoch, loaded on start, as torchrun's documentation does it).
# Each round runs, alternating frameworks: Strata undisturbed, torchrun undisturbed, Strata
# with worker:1 SIGKILLed, torchrun with rank 1's worker process (not its agent) SIGKILLed; the
# kill comes as soon as the chief (rank 0) has logged step --kill-step (default 63: 3 steps into
# epoch 11, half an epoch after torchrun's last snapshot). Per framework it prints:
#   - the job's wall time (start to the last process's exit), undisturbed and with the loss;
#   - the cost of a loss: wall time with the loss minus the median undisturbed wall time (and
#     minus the same round's undisturbed run), and the ratio Strata / torchrun of the medians;
#   - the replacement process: from its start (/proc/PID/stat) to the end of the first step it
#     contributes to (Strata: worker:1's new process; torchrun: every worker is a new process);
#   - the kill to the first step done after it, and the steps done again (torchrun: since the
#     snapshot; Strata: the one in flight);
#   - the step times after the join (Strata) or restart (torchrun), each divided by the median
#     time of the same step in the undisturbed runs (1.0: back to the undisturbed rate).
# Strata's step times come from the chief's --metrics file (a JSON line per step, seconds since
# its fit started), placed on the clock by its "epoch done" log lines (STRATA_LOG=info, RFC3339
# times); the loss and the join from the "training goes on" lines. torchrun's come from
# ddp_elastic.py's per-process logs.
#   scripts/bench/elastic-vs-torchrun.sh [--repeats N] [--epochs N] [--kill-step K]
#       [--strata PATH] [--python PATH] [--keep DIR] [--torch-shared-store]
# --keep DIR keeps every run's logs (launcher and agent output, metrics, step logs) in DIR.
# torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torch.distributed.elastic's opt-out:
# each worker group bootstraps its own TCPStore): with its default, one store the agents share
# across restarts, the restarted workers here failed in init_process_group ("Gloo
# connectFullMesh failed ... Connection refused"), hung until killed, or needed a second restart
# (the agents that restart for the membership change keep TORCHELASTIC_RESTART_COUNT 0, the
# failed one's becomes 1; see pytorch/pytorch#135712). --torch-shared-store runs the default.
# Needs PyTorch in the peers' virtual environment (PEERS_VENV, default ~/.cache/strata/peers-venv;
# scripts/bench/peers.sh installs it), or --python PATH of one that has torch and numpy.
{
# The whole script is one block, read before it runs: editing the file meanwhile is safe.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repeats=5
epochs=40
kill_step=63
strata="$here/../../target/release/strata"
python="${PEERS_VENV:-$HOME/.cache/strata/peers-venv}/bin/python"
keep=""
share_off=1
while [[ $# -gt 0 ]]; do
    case "$1" in
        --repeats | --epochs | --kill-step | --strata | --python | --keep)
            [[ $# -ge 2 ]] || { echo "error: $1 needs a value" >&2; exit 2; }
            case "$1" in
                --repeats) repeats="$2" ;;
                --epochs) epochs="$2" ;;
                --kill-step) kill_step="$2" ;;
                --strata) strata="$2" ;;
                --python) python="$2" ;;
                --keep) keep="$2" ;;
            esac
            shift 2 ;;
        --torch-shared-store) share_off=0; shift ;;
        -h | --help) sed -n '2,/^{$/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument $1; use --repeats N, --epochs N, --kill-step K, --strata PATH, --python PATH, --keep DIR or --torch-shared-store" >&2; exit 2 ;;
    esac
done
for v in repeats epochs kill_step; do
    [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "error: --${v//_/-} ${!v} is not a positive integer" >&2; exit 2; }
done
steps_per_epoch=6 # 1,438 training rows in batches of 256
total_steps=$((epochs * steps_per_epoch))
((kill_step + 12 <= total_steps)) || { echo "error: --kill-step $kill_step leaves fewer than 12 of the $total_steps steps after the kill; use a smaller one or more --epochs" >&2; exit 2; }
[[ -x "$strata" ]] || { echo "error: no strata binary at $strata; build it (cargo build --release -p strata-cli) or pass --strata" >&2; exit 2; }
"$python" -c 'import torch, numpy' 2>/dev/null || { echo "error: $python cannot import torch and numpy; run scripts/bench/peers.sh once (it installs PyTorch into the peers' virtual environment) or pass --python" >&2; exit 2; }
torchrun=("$python" -m torch.distributed.run)

work="$(mktemp -d "${TMPDIR:-/tmp}/elastic-vs-torchrun.XXXXXX")"
started_pids=()
# Every process of the bench carries ELASTIC_VS_TORCHRUN=$work in its environment: on exit, the
# ones started here (launchers, agents) and their tasks and workers are killed by their ids.
cleanup() {
    local p
    for p in "${started_pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    for p in /proc/[0-9]*; do
        p="${p#/proc/}"
        [[ "$p" != "$$" ]] || continue
        if { tr '\0' '\n' < "/proc/$p/environ"; } 2>/dev/null | grep -qxF "ELASTIC_VS_TORCHRUN=$work"; then
            kill -9 "$p" 2>/dev/null || true
        fi
    done
    if [[ -n "$keep" ]]; then
        mkdir -p "$keep" && cp -r "$work"/strata-* "$work"/torch-* "$work/results" "$keep"/ 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP
export ELASTIC_VS_TORCHRUN="$work"
# A copy: the binary in target/ may be rebuilt while the bench runs.
cp "$strata" "$work/strata"
strata="$work/strata"

cat > "$work/bench.py" <<'PY'
"""The bench's helpers: watch a run (kill the victim at the kill step, find its replacement),
read a run's logs into one JSON line, and print the table."""
import datetime, glob, json, os, re, signal, statistics, sys, time

MARK = os.environ["ELASTIC_VS_TORCHRUN"]

def environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(e.split("=", 1) for e in f.read().decode(errors="replace").split("\0") if "=" in e)
    except OSError:
        return None

def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []

def started(pid):
    """A process's start, Unix seconds, to the clock tick: its age (the kernel counts its start
    in ticks since boot) subtracted from now (btime from /proc/stat would be off by the wall
    clock's corrections since boot)."""
    with open(f"/proc/{pid}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age

def ours(match):
    for p in os.listdir("/proc"):
        if p.isdigit():
            env = environ(p)
            if env and env.get("ELASTIC_VS_TORCHRUN") == MARK and match(p, env):
                yield int(p)

def strata_worker1(p, env):
    c = cmdline(p)
    return env.get("STRATA_TASK") == "worker:1" and len(c) > 1 and c[1] == "train"

def torch_rank1(p, env):
    return env.get("RANK") == "1" and env.get("TORCHELASTIC_RESTART_COUNT") == "0" and any(a.endswith("ddp_elastic.py") for a in cmdline(p))

def chief_steps_strata(run):
    files = glob.glob(os.path.join(run, "metrics-worker:0-*.jsonl"))
    if not files:
        return 0
    n = 0
    with open(files[0]) as f:
        for line in f:
            if '"kind":"step"' in line:
                try:
                    n = max(n, json.loads(line)["step"])
                except ValueError:
                    pass
    return n

def chief_steps_torch(run):
    n = 0
    for path in glob.glob(os.path.join(run, "logs", "rank0-*.log")):
        with open(path) as f:
            for line in f:
                if line.startswith("step "):
                    n = max(n, int(line.split()[1]))
    return n

def watch(framework, run, kill_step, launcher_pid):
    """Kills the victim once the chief logged kill_step; records the kill and the replacement."""
    steps = chief_steps_strata if framework == "strata" else chief_steps_torch
    victim_of = strata_worker1 if framework == "strata" else torch_rank1
    out = {}
    while steps(run) < kill_step:
        if not os.path.exists(f"/proc/{launcher_pid}"):
            out["error"] = f"the job ended before step {kill_step}"
            break
        time.sleep(0.005)
    if "error" not in out:
        victims = list(ours(victim_of))
        if len(victims) != 1:
            out["error"] = f"{len(victims)} processes to kill at step {kill_step}, not 1"
        else:
            out["victim"] = victims[0]
            out["kill_after_step"] = steps(run)
            out["killed"] = time.time()
            os.kill(victims[0], signal.SIGKILL)
    if framework == "strata" and "victim" in out:
        # The launcher starts worker:1's new process at once (it polls every 20 ms).
        deadline = time.time() + 30
        while time.time() < deadline and os.path.exists(f"/proc/{launcher_pid}"):
            new = [p for p in ours(lambda p, env: env.get("STRATA_TASK") == "worker:1") if p != out["victim"]]
            if new:
                out["replacement"] = new[0]
                out["replacement_started"] = started(new[0])
                break
            time.sleep(0.005)
    json.dump(out, open(os.path.join(run, "watch.json"), "w"))

TS = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z")

def ts(line):
    m = TS.search(line)
    if not m:
        return None
    s = m.group(1)
    if "." in s:
        head, frac = s.split(".")
        s = head + "." + (frac + "000000")[:6]
    return datetime.datetime.fromisoformat(s).replace(tzinfo=datetime.timezone.utc).timestamp()

def read_strata(run):
    """(step -> end time), log events."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", l) for l in open(os.path.join(run, "err"), errors="replace")]
    records = []
    chief = glob.glob(os.path.join(run, "metrics-worker:0-*.jsonl"))
    for line in open(chief[0]) if chief else []:
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    # The chief's clock: its "epoch done" lines beside its eval records (written just before),
    # interpolated between them (the wall clock and the monotonic one the records use drift apart
    # here, by up to 0.6% while the wall clock is being corrected).
    done = [ts(l) for l in lines if l.startswith("[worker:0]") and "epoch done" in l]
    evals = [r["wall_s"] for r in records if r["kind"] == "eval"]
    pairs = sorted((w, t - w) for t, w in zip(done, evals) if t is not None)
    if not pairs:
        return None, lines

    def clock(w):
        if w <= pairs[0][0]:
            return w + pairs[0][1]
        for (w0, o0), (w1, o1) in zip(pairs, pairs[1:]):
            if w <= w1:
                return w + o0 + (o1 - o0) * (w - w0) / max(w1 - w0, 1e-9)
        return w + pairs[-1][1]

    ends = {}
    for r in records:
        if r["kind"] == "step":
            ends[r["step"]] = clock(r["wall_s"])  # a step done twice: its last time
    return ends, lines

def read_torch(run):
    """(step -> end time on rank 0, the last process's when a step was done again), processes."""
    ends, procs = {}, []
    for path in glob.glob(os.path.join(run, "logs", "*.log")):
        p = {"rank": int(re.search(r"rank(\d+)", path).group(1)), "steps": {}, "start": 0.0}
        for line in open(path):
            f = line.split()
            if f[0] == "start":
                p["start"], p["restart"] = float(f[1]), int(f[2])
            elif f[0] == "resumed":
                p["resumed"] = int(f[1])
            elif f[0] == "step":
                p["steps"][int(f[1])] = float(f[2])
        procs.append(p)
    # Later processes (a restarted group) override earlier ones: not by TORCHELASTIC_RESTART_COUNT,
    # which only the agent whose worker failed increments.
    for p in sorted(procs, key=lambda p: p["start"]):
        if p["rank"] == 0:
            ends.update(p["steps"])
    return ends, procs

def analyze(framework, run, kill, wall, rc):
    out = {"framework": framework, "run": os.path.basename(run), "kill": bool(kill), "wall": wall, "rc": rc}
    if framework == "strata":
        ends, lines = read_strata(run)
    else:
        ends, procs = read_torch(run)
    out["ends"] = ends
    if not kill or ends is None:
        return out
    w = json.load(open(os.path.join(run, "watch.json")))
    if "error" in w:
        out["error"] = w["error"]
        return out
    k = out["killed"] = w["killed"]
    out["kill_after_step"] = w["kill_after_step"]
    if framework == "strata":
        goes_on = [(l.split("]")[0] + "]", ts(l), l) for l in lines if "training goes on" in l]
        after = [g for g in goes_on if g[1] and g[1] > k]
        lost = [g for g in after if g[0] == "[worker:0]" and "workers=2" in g[2]]
        joined = [g for g in after if g[0] == "[worker:0]" and "workers=3" in g[2]]
        joiner = [g for g in after if g[0] == "[worker:1]"]
        chief = [g for g in after if g[0] == "[worker:0]"]
        if chief:
            m = re.search(r"workers=(\d+)", chief[0][2])
            out["workers_after_loss"] = int(m.group(1)) if m else None
        if lost:
            out["kill_to_going_on_without"] = lost[0][1] - k
        if joined:
            out["kill_to_going_on_with_new"] = joined[0][1] - k
            first = min((s for s, t in ends.items() if t > joined[0][1]), default=None)
            out["first_step_with_new"] = first
            if "replacement_started" in w and first is not None:
                out["replacement_start_to_first_step_end"] = ends[first] - w["replacement_started"]
                if joiner:
                    out["replacement_start_to_its_going_on"] = joiner[0][1] - w["replacement_started"]
        # The steps done after the kill: the first is the one in flight at the kill, done again.
        nxt = min((s for s, t in ends.items() if t > k), default=None)
        if nxt is not None:
            out["kill_to_first_step_after"] = ends[nxt] - k
            out["steps_redone"] = w["kill_after_step"] + 1 - nxt
    else:
        new = [p for p in procs if p["start"] > k and p["steps"]]
        if new:
            first = min(min(p["steps"]) for p in new)
            out["first_step_with_new"] = first
            out["replacement_start_to_first_step_end"] = ends[first] - max(p["start"] for p in new)
            out["kill_to_first_step_after"] = ends[first] - k
            out["resumed_from"] = min(p.get("resumed", 0) for p in new)
            out["steps_redone"] = w["kill_after_step"] + 1 - first
            out["new_processes"] = len(new)
    return out

def fmt(xs, digits=2):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a", "n/a"
    return f"{statistics.median(xs):.{digits}f}", " ".join(f"{x:.{digits}f}" for x in xs)

def table(results_path, kill_step):
    rs = [json.loads(l) for l in open(results_path)]
    fw = {"strata": "Strata", "torch": "torchrun"}
    rows, cost_med, local_med = [], {}, {}
    for f in ("strata", "torch"):
        und = [r for r in rs if r["framework"] == f and not r["kill"] and r["rc"] == 0]
        kil = [r for r in rs if r["framework"] == f and r["kill"] and r["rc"] == 0 and "error" not in r]
        bad = [r for r in rs if r["framework"] == f and (r["rc"] != 0 or "error" in r)]
        base = statistics.median([r["wall"] for r in und]) if und else None
        costs = [r["wall"] - base for r in kil] if base is not None else []
        paired = [r["wall"] - u["wall"] for r, u in zip(kil, und)]
        cost_med[f] = statistics.median(costs) if costs else None
        name = fw[f]
        rows.append((f"{name}: wall time, undisturbed (s)", *fmt([r["wall"] for r in und])))
        rows.append((f"{name}: wall time, worker killed after step {kill_step} (s)", *fmt([r["wall"] for r in kil])))
        rows.append((f"{name}: cost of the loss = killed - median undisturbed (s)", *fmt(costs)))
        rows.append((f"{name}: cost of the loss, against the same round's undisturbed run (s)", *fmt(paired)))
        # The loss's cost where it happens: from the kill to the end of the 12th step after the
        # last one done before it, against the same 12 steps undisturbed (far less noisy than
        # whole jobs on a busy machine).
        def span(ends, a, b):
            e = {int(k): v for k, v in ends.items()}
            return e[b] - e[a] if a in e and b in e else None
        local = []
        for r in kil:
            a = r["kill_after_step"]
            ref = [x for x in (span(u["ends"], a, a + 12) for u in und) if x is not None]
            end = {int(k): v for k, v in r["ends"].items()}.get(a + 12)
            if end is not None and ref:
                local.append(end - r["killed"] - statistics.median(ref))
        local_med[f] = statistics.median(local) if local else None
        rows.append((f"{name}: cost of the loss over the 12 steps after the kill = their time - undisturbed (s)", *fmt(local)))
        rows.append((f"{name}: kill to the end of the first step after it (s)", *fmt([r.get("kill_to_first_step_after") for r in kil])))
        rows.append((f"{name}: completed steps done again", *fmt([r.get("steps_redone") for r in kil], 0)))
        if f == "strata":
            rows.append((f"{name}: workers of the first generation formed after the loss (3: the new process already in it)", *fmt([r.get("workers_after_loss") for r in kil], 0)))
            rows.append((f"{name}: kill to the survivors going on without worker:1 (s)", *fmt([r.get("kill_to_going_on_without") for r in kil])))
            rows.append((f"{name}: kill to training going on with the new process (s)", *fmt([r.get("kill_to_going_on_with_new") for r in kil])))
            rows.append((f"{name}: new process's start to its \"training goes on\" (s)", *fmt([r.get("replacement_start_to_its_going_on") for r in kil])))
        rows.append((f"{name}: new process's start to the end of the first step it contributes to (s)", *fmt([r.get("replacement_start_to_first_step_end") for r in kil])))
        # Step times after the join (restart), against the median of the same steps undisturbed.
        def dur(ends, s):
            e = {int(k): v for k, v in ends.items()}
            return e[s] - e[s - 1] if s in e and s - 1 in e else None
        for i in range(5):
            ratios = []
            for r in kil:
                first = r.get("first_step_with_new")
                if first is None:
                    continue
                s = first + i
                d = dur(r["ends"], s)
                ref = [x for x in (dur(u["ends"], s) for u in und) if x is not None]
                if d is not None and ref:
                    ratios.append(d / statistics.median(ref))
            label = "first step with the new process" if f == "strata" else "first step after the restart"
            if i == 0:
                label += " (from the end of the step before: the recovery included)"
            rows.append((f"{name}: step time / undisturbed, {label} + {i}", *fmt(ratios)))
        for r in bad:
            rows.append((f"{name}: FAILED run ({'killed' if r['kill'] else 'undisturbed'})", r.get("error", f"exit code {r['rc']}"), ""))
    s, t = cost_med["strata"], cost_med["torch"]
    ratio = f"{s / t:.3f}" if s is not None and t else "n/a"
    print(f"| what | median | all (in run order) |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    print(f"| cost of a loss, Strata / torchrun (medians of whole jobs) | {ratio} | target: at most 0.333 |")
    s, t = local_med["strata"], local_med["torch"]
    print(f"| cost of a loss over the 12 steps after the kill, Strata / torchrun (medians) | {f'{s / t:.3f}' if s is not None and t else 'n/a'} | |")
    print("Step times: the time between the end of a step and the end of the one before it (Strata:"
          " the chief's --metrics records; torchrun: rank 0's log), divided by the median time of the"
          " same step in the undisturbed runs of the same framework.")

if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "watch":
        watch(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif cmd == "analyze":
        r = analyze(sys.argv[2], sys.argv[3], sys.argv[4] == "1", float(sys.argv[5]), int(sys.argv[6]))
        print(json.dumps(r))
    elif cmd == "table":
        table(sys.argv[2], int(sys.argv[3]))
    elif cmd == "port":
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        print(s.getsockname()[1])
PY

now() { date +%s.%N; }
# One job: $1 strata|torch, $2 1 to kill a worker after --kill-step. Appends its line to results.
one() {
    local framework="$1" kill="$2" run rc=0 t0 t1 watcher="" pids=()
    run="$(mktemp -d "$work/$framework-XXXX")"
    t0=$(now)
    if [[ "$framework" == strata ]]; then
        # Each process its own metrics file (every worker creates the file it is given).
        BENCH_RUN="$run" STRATA_LOG=info timeout 300 "$strata" launch --workers 3 --max-restarts 1 -- \
            sh -c 'exec "$0" train --metrics "$BENCH_RUN/metrics-$STRATA_TASK-$$.jsonl" "$@"' "$strata" \
            --strategy multi-worker-mirrored --min-workers 2 --hidden 2048,2048 --epochs "$epochs" \
            --optimizer sgd --no-progress > "$run/out" 2> "$run/err" &
        pids=($!)
    else
        local port i
        port=$("$python" "$work/bench.py" port)
        for i in 0 1 2; do
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="$share_off" LOGLEVEL=INFO OMP_NUM_THREADS=1 timeout 300 "${torchrun[@]}" --nnodes 2:3 --nproc-per-node 1 --max-restarts 1 \
                --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" --rdzv-id "bench-$(basename "$run")" \
                "$here/peers/ddp_elastic.py" --steps "$total_steps" --snapshot "$run/snapshot" \
                --log-dir "$run/logs" > "$run/out$i" 2> "$run/err$i" &
            pids+=($!)
        done
    fi
    started_pids+=("${pids[@]}")
    if ((kill)); then
        "$python" "$work/bench.py" watch "$framework" "$run" "$kill_step" "${pids[0]}" &
        watcher=$!
        started_pids+=("$watcher")
    fi
    local p
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    t1=$(now)
    [[ -z "$watcher" ]] || wait "$watcher" || true
    if ((rc != 0)); then
        echo "  $framework run failed (exit code $rc); its last lines:" >&2
        tail -n 3 "$run"/err* >&2 || true
    fi
    local wall line
    wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')
    line=$("$python" "$work/bench.py" analyze "$framework" "$run" "$kill" "$wall" "$rc") ||
        line="{\"framework\": \"$framework\", \"run\": \"$(basename "$run")\", \"kill\": $( ((kill)) && echo true || echo false), \"wall\": $wall, \"rc\": $rc, \"ends\": {}, \"error\": \"its logs could not be read\"}"
    echo "$line" >> "$work/results"
    "$python" - "$work/results" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).readlines()[-1])
extra = "".join(f", {k} {r[k]:.2f}" if isinstance(r[k], float) else f", {k} {r[k]}" for k in
                ("kill_to_first_step_after", "replacement_start_to_first_step_end", "steps_redone", "error") if k in r)
print(f"  {r['framework']:6} {'killed' if r['kill'] else 'undisturbed':11} wall {r['wall']:.2f} s{extra}")
PY
    rm -rf "$run/snapshot"
}

echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg) at the start"
echo "strata: $("$strata" --version 2>/dev/null || echo '?') ($(git -C "$here" describe --always --dirty 2>/dev/null || echo 'commit unknown')); PyTorch $("$python" -c 'import torch; print(torch.__version__)') (python $("$python" -c 'import platform; print(platform.python_version())'))"
echo "job: 3 processes, 4.3M MLP, SGD lr 0.003, global batch 256, $epochs epochs = $total_steps steps; the kill after step $kill_step; torchrun's TORCH_DISABLE_SHARE_RDZV_TCP_STORE=$share_off"
touch "$work/results"
for ((round = 1; round <= repeats; round++)); do
    echo "round $round of $repeats"
    one strata 0
    one torch 0
    one strata 1
    one torch 1
done
echo "load average $(cut -d' ' -f1-3 /proc/loadavg) at the end"
"$python" "$work/bench.py" table "$work/results" "$kill_step"
exit
}

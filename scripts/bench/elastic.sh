#!/usr/bin/env bash
# What a lost worker costs an elastic MultiWorkerMirrored job under `strata launch`: a 3-worker
# job of the 4.3M MLP (64-2048-2048-10, SGD) loses worker:1 (SIGKILL) 6 s in, alternately
#   - without a restart: from the kill to the survivors' first step without it (the heartbeat
#     timeout, 3 s, bounds it: a killed process cannot be told from a stopped or cut-off one);
#   - with --max-restarts 1: from the kill to the first step with the new process, which joins
#     and takes its state from a member (process start, model, join, the state's broadcast).
# Times come from the kill and the trainers' log lines ("training goes on"); medians printed.
#   scripts/bench/elastic.sh [--repeats N] [--strata PATH]
set -euo pipefail
repeats=5
strata="$(dirname "$0")/../../target/release/strata"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --repeats) repeats="$2"; shift 2 ;;
        --strata) strata="$2"; shift 2 ;;
        *) echo "error: unknown argument $1; use --repeats N or --strata PATH" >&2; exit 2 ;;
    esac
done
[[ -x "$strata" ]] || { echo "error: no strata binary at $strata; build it (cargo build --release -p strata-cli) or pass --strata" >&2; exit 2; }
work="$(mktemp -d)"
trap 'pkill -9 -f "STRATA_BENCH_ELASTIC=$work" 2>/dev/null || true; rm -rf "$work"' EXIT
one() { # $1: restarts
    local dir="$work/run-$RANDOM"; mkdir -p "$dir"
    STRATA_BENCH_ELASTIC="$work" STRATA_LOG=info timeout 300 "$strata" launch --workers 3 --max-restarts "$1" -- \
        strata train --strategy multi-worker-mirrored --min-workers 2 --hidden 2048,2048 --epochs 40 \
        --optimizer sgd --no-progress > "$dir/out" 2> "$dir/err" &
    local launcher=$!
    sleep 6
    local victim=""
    for p in $(pgrep -f "strata train" || true); do
        if tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "STRATA_TASK=worker:1" &&
            tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "STRATA_BENCH_ELASTIC=$work"; then victim=$p; fi
    done
    [[ -n "$victim" ]] || { echo "error: worker:1 was not running 6 s in (the job ended early?)" >&2; exit 1; }
    local killed; killed=$(date -u +%s.%N)
    kill -9 "$victim"
    wait "$launcher" || { echo "error: the elastic job failed:" >&2; tail -5 "$dir/err" >&2; exit 1; }
    python3 - "$killed" "$dir/err" <<'PY'
import datetime, re, sys
killed = float(sys.argv[1])
times = []
for line in open(sys.argv[2], errors="replace"):
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    if "training goes on" in line:
        m = re.search(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z", line)
        t = datetime.datetime.fromisoformat(m.group(1)).replace(tzinfo=datetime.timezone.utc).timestamp()
        if t > killed:
            times.append(t - killed)
print(f"{max(times):.3f}" if times else "nan")
PY
}
echo "strata $("$strata" --version 2>/dev/null || true); $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; heartbeat timeout 3 s"
no=(); yes=()
for ((i = 0; i < repeats; i++)); do
    no+=("$(one 0)"); yes+=("$(one 1)")
    echo "round $((i + 1)): lost, no restart ${no[-1]} s; lost and replaced ${yes[-1]} s"
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
echo "| what | median of $repeats (s) | all (s) |"
echo "|---|---|---|"
echo "| worker:1 killed: its loss to training going on without it | $(median "${no[@]}") | ${no[*]} |"
echo "| worker:1 killed and restarted: its loss to training going on with the new process | $(median "${yes[@]}") | ${yes[*]} |"

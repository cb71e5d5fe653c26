#!/usr/bin/env bash
# Strata's cross-worker ring all-reduce beside PyTorch's gloo backend on this machine: the same
# sizes, process counts and timing method (refill, barrier, timed all-reduce; the slowest
# worker's median), RUNS times each, interleaved. Prints, per process count and size, the
# median busbw of each and their ratio, and the ratio of the 4 KiB latencies.
#
#   scripts/bench/compare-allreduce.sh                      # 2 and 4 workers, 4 KiB to 256 MiB, 3 runs
#   RUNS=5 WORKERS=2 MAX_BYTES=64MiB scripts/bench/compare-allreduce.sh
#
# Environment: PYTHON (a python with torch; default python3), STRATA (the strata binary;
# default: build target/release/strata), RUNS, WORKERS, MIN_BYTES, MAX_BYTES, OUT (where the
# raw tables go; default a temporary directory).
set -euo pipefail

cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
RUNS=${RUNS:-3}
WORKERS=${WORKERS:-2,4}
MIN_BYTES=${MIN_BYTES:-4KiB}
MAX_BYTES=${MAX_BYTES:-256MiB}

if ! "$PYTHON" -c 'import torch, torch.distributed' 2>/dev/null; then
    echo "PyTorch is not installed for $PYTHON; install it with:" >&2
    echo "    pip install torch          # or: pip install torch --index-url https://download.pytorch.org/whl/cpu" >&2
    echo "or point PYTHON at a python that has it: PYTHON=/path/to/venv/bin/python $0" >&2
    exit 2
fi
if [[ -z "${STRATA:-}" ]]; then
    cargo build --release -p strata-cli >&2
    STRATA=target/release/strata
fi
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"

for ((run = 1; run <= RUNS; run++)); do
    echo "run $run of $RUNS: strata" >&2
    "$STRATA" bench allreduce --workers "$WORKERS" --min-bytes "$MIN_BYTES" --max-bytes "$MAX_BYTES" \
        > "$OUT/strata.$run.txt"
    echo "run $run of $RUNS: gloo" >&2
    "$PYTHON" scripts/bench/gloo_allreduce.py --workers "$WORKERS" --min-bytes "$MIN_BYTES" --max-bytes "$MAX_BYTES" \
        > "$OUT/gloo.$run.txt"
done

python3 - "$OUT" "$RUNS" <<'PY'
import re, statistics, sys

out, runs = sys.argv[1], int(sys.argv[2])

def parse(path):
    """{workers: {bytes: (time_us, busbw)}} from a table of either benchmark."""
    tables, n = {}, None
    for line in open(path):
        m = re.match(r"# (\d+) worker processes", line)
        if m:
            n = int(m.group(1))
            tables[n] = {}
            continue
        f = line.split()
        if n is not None and len(f) >= 8 and f[0].isdigit() and f[2] == "float":
            tables[n][int(f[0])] = (float(f[4]), float(f[6]))
    return tables

def medians(kind):
    per = [parse(f"{out}/{kind}.{r}.txt") for r in range(1, runs + 1)]
    res = {}
    for n in per[0]:
        res[n] = {}
        for size in per[0][n]:
            vals = [p[n][size] for p in per if n in p and size in p[n]]
            res[n][size] = (statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals))
    return res

s, g = medians("strata"), medians("gloo")
print(f"# strata ring vs PyTorch gloo, medians of {runs} runs (raw tables in {out})")
for n in sorted(s):
    print("#")
    print(f"# {n} worker processes")
    print(f"# {'size':>10} {'strata busbw':>13} {'gloo busbw':>11} {'ratio':>7} {'strata us':>10} {'gloo us':>10}")
    for size in sorted(s[n]):
        st, sb = s[n][size]
        gt, gb = g.get(n, {}).get(size, (float("nan"), float("nan")))
        ratio = sb / gb if gb and gb == gb else float("nan")
        print(f"  {size:>10} {sb:>13.3f} {gb:>11.3f} {ratio:>7.2f} {st:>10.1f} {gt:>10.1f}")
    small = min(s[n])
    st, gt = s[n][small][0], g.get(n, {}).get(small, (float("nan"),))[0]
    print(f"# {n} workers, latency at {small} bytes: strata {st:.1f} us, gloo {gt:.1f} us: "
          f"strata takes {st / gt:.2f}x gloo's time")
    big = [size for size in s[n] if size >= 1 << 20 and size in g.get(n, {})]
    if big:
        worst = min(s[n][z][1] / g[n][z][1] for z in big)
        print(f"# {n} workers, from 1 MiB up: smallest busbw ratio strata/gloo {worst:.2f}x")
PY

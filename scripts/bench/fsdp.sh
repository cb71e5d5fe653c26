#!/usr/bin/env bash
# Strata's ZeRO stage 3 beside PyTorch FSDP2 on one host, measured in the same run: N worker
# processes each (default 4), the character transformer at --width 512 --layers 8 --heads 8
# (25.3M parameters; context 64, Tiny Shakespeare's 65 characters), AdamW, a global batch of 8
# windows of 64 characters (2 per process), f32. Per run: examples/s (windows/s) in steady
# state, and the peak resident set (ru_maxrss) of every process, the max over them and each.
# Runs alternate A B A B (Strata, FSDP2, Strata, FSDP2, ...) for --repeats rounds; the report
# (markdown) gives every run, the medians, and Strata / FSDP2 per round and of the medians.
#
#   scripts/bench/fsdp.sh                          # 3 rounds, ~20 s timed per run
#   scripts/bench/fsdp.sh --quick                  # 1 round, ~4 s timed per run (a smoke test)
#   scripts/bench/fsdp.sh --repeats 5 --seconds 30 --save fsdp.json
#   scripts/bench/fsdp.sh --width 128 --layers 4 --heads 4 --batch 32 --workers 2
#   scripts/bench/fsdp.sh --isa avx2               # as on an AVX2 host (see scripts/bench/peers.sh)
#   scripts/bench/fsdp.sh --help                   # every option (scripts/bench/peers/fsdp_bench.py)
#
# Strata: each worker is `strata train --strategy multi-worker-mirrored --replicas 1
# --zero-stage 3 --model transformer --width W --layers L --heads H --batch B --optimizer adamw
# --steps N --no-progress --out summary-<i>.json` with TF_CONFIG naming every worker on
# loopback and one STRATA_CLUSTER_TOKEN; the rate is the chief's `examples_per_second` from
# --out (the steady state: the trainer leaves out its first execution of 10 steps). N is 10 +
# the steps --seconds takes at the previous Strata run's rate (the first run's is guessed from
# the model's FLOPs; --strata-steps fixes it). After training, `strata train` evaluates the
# validation text (1,742 windows): untimed, but a few minutes of each run's wall time at 25M
# parameters on 2 cores. --zero-stage 0|1|2 runs another stage instead (to check the harness).
# PyTorch: scripts/bench/peers/fsdp_peer.py, torch_bench.py's transformer (common.py
# torch_models at this shape; its qkv layer has a bias that Strata's lacks, 12,288 parameters
# at the default shape) with `fully_shard(block)` for each block, then `fully_shard(model)`
# (reshard_after_forward=True, the default), gloo, torch.set_num_threads(1) and
# OMP_NUM_THREADS=1 per process (Strata's worker runs 1 replica thread), AdamW at Strata's
# defaults (lr 0.003, betas 0.9/0.999, eps 1e-8, weight decay 0.01, fused where accepted), the
# gradient norm clipped at 1.0 as Strata's transformer does; a few warm-up steps, a barrier,
# steps for --seconds, a barrier; rate = global windows / elapsed on rank 0. --mesh cpu passes
# init_device_mesh("cpu", (N,)) to fully_shard instead of its default mesh.
#
# Each configuration's processes are started directly (no torchrun, no launcher between) in a
# process group of their own and each is reaped with os.wait4, so its ru_maxrss is its own.
# The FSDP2 processes load PyPI's torch, a CUDA build: `import torch` alone holds about 530 MB
# resident here (the report prints it), part of every FSDP2 process's peak.
#
# PyTorch comes from the peers' virtual environment (PEERS_VENV, default
# ~/.cache/strata/peers-venv; PEERS_TORCH, default torch==2.15.*), installed there as
# scripts/bench/peers.sh does when missing (see that file; several GB); --no-install skips that.
# strata: target/release/strata, built with `cargo build --release -p strata-cli` when missing
# (or --strata PATH); with `--isa avx2`, target/avx2/release/strata, built (or brought up to
# date) with `--no-default-features --target-dir target/avx2`, and PyTorch run with
# ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2 and MKL_ENABLE_INSTRUCTIONS=AVX2, as
# scripts/bench/peers.sh --isa avx2 does. The driver runs a copy of the binary, so a rebuild
# during the run changes nothing.
#
# No figure is checked against a threshold: the script reports. Exit code: 0 when every run
# succeeded, 1 when a side failed (its error in one line; a failed side is not run again), 2 on
# bad arguments. Every process started is killed on any exit (the end, an error, Ctrl-C,
# SIGTERM; and by the kernel, PR_SET_PDEATHSIG, should the driver itself be SIGKILLed), and the
# temporary directory (/tmp/strata-fsdp-*) is removed (a SIGKILLed driver's at the next start).
set -uo pipefail

cd "$(dirname "$0")/../.."
HERE=scripts/bench
# shellcheck source=scripts/bench/peers/install-torch.sh
source scripts/bench/peers/install-torch.sh
SYS_PY=${PYTHON:-python3}
VENV=${PEERS_VENV:-$HOME/.cache/strata/peers-venv}
TORCH_SPEC=${PEERS_TORCH:-torch==2.15.*}

child=
cleanup() {
    if [[ -n "$child" ]] && kill -0 "$child" 2>/dev/null; then
        kill -TERM "$child" 2>/dev/null # the driver kills its workers' process groups and removes its directory
        wait "$child" 2>/dev/null
    fi
    child=
}
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM HUP
trap cleanup EXIT

if ! command -v "$SYS_PY" >/dev/null 2>&1; then
    echo "fsdp.sh needs Python 3 ($SYS_PY not found): install python3 or set PYTHON=/path/to/python3" >&2
    exit 2
fi

install=1
args=()
for a in "$@"; do
    case "$a" in
        --no-install) install=0 ;;
        -h | --help) exec "$SYS_PY" "$HERE/peers/fsdp_bench.py" --help ;;
        *) args+=("$a") ;;
    esac
done

wants_fsdp=1 wants_strata=1
strata= isa=native
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[$i]}" in
        --isa) isa=${args[$((i + 1))]:-native} ;;
        --isa=*) isa=${args[$i]#--isa=} ;;
        --only) [[ "${args[$((i + 1))]:-}" == strata ]] && wants_fsdp=0
                [[ "${args[$((i + 1))]:-}" == fsdp2 ]] && wants_strata=0 ;;
        --only=strata) wants_fsdp=0 ;;
        --only=fsdp2) wants_strata=0 ;;
        --strata) strata=${args[$((i + 1))]:-} ;;
        --strata=*) strata=${args[$i]#--strata=} ;;
    esac
done
# Strata's binary: --strata, else built here (`--isa avx2`: without the avx512 feature, into
# target/avx2; cargo rebuilds only what changed).
build=(cargo build --release -p strata-cli)
if [[ -z "$strata" ]]; then
    case "$isa" in
        avx2) strata=target/avx2/release/strata build+=(--no-default-features --target-dir target/avx2) ;;
        *) strata=target/release/strata ;;
    esac
    if ((wants_strata)) && [[ ! -x "$strata" || "$isa" == avx2 ]]; then
        echo "building strata: ${build[*]}" >&2
        "${build[@]}" || { echo "fsdp.sh: ${build[*]} failed" >&2; exit 1; }
    fi
fi

# PyTorch, as scripts/bench/peers.sh installs it (torch and numpy only).
PY="$VENV/bin/python"
if ((wants_fsdp && install)) && ! { [[ -x "$PY" ]] && "$PY" -c 'import torch, numpy' 2>/dev/null; }; then
    install_torch_venv
fi
if ((wants_fsdp)) && ! { [[ -x "$PY" ]] && "$PY" -c 'import torch, numpy' 2>/dev/null; }; then
    echo "fsdp.sh: PyTorch and numpy do not import with $PY ($TORCH_SPEC; --no-install skips installing them): FSDP2 cannot run" >&2
    exit 1
fi

"$SYS_PY" "$HERE/peers/fsdp_bench.py" --python "$PY" --strata "$strata" --command "$0 $*" "${args[@]}" &
child=$!
wait "$child"
rc=$?
child=
exit $rc

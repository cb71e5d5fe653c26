#!/usr/bin/env bash
# Strata beside its peers, measured in the same run on this machine: TensorFlow 2.21
# (OneDevice, MirroredStrategy over 2 logical CPUs, MultiWorkerMirrored with 2 processes on
# loopback) and PyTorch (one process with 2 threads, DDP over gloo with 2 processes of 1 thread)
# train Strata's benchmark models with the same data, batch and optimizer (the MLPs `small`
# 64-256-256-10 and `large` 64-2048-2048-10 and a `cnn` on the digits, global batch 256; a
# 4-layer, width-128 character `transformer` on Tiny Shakespeare, 32 x 64 tokens; f32, AdamW),
# each configuration in its own processes, warm-up steps then a timed steady state; then
# `strata bench train` runs, and one table prints examples/s (tokens/s for the transformer)
# of each peer beside Strata's Mirrored(2) and MultiWorkerMirrored(2), with the ratios, the
# date, the CPU model, its vector width and the peers' versions. The speed claims of the README
# and the guide (docs/benchmarks.md) come from this table; its outputs are kept in docs/bench/.
#
#   scripts/bench/peers.sh                         # everything: 4 models x 5 configurations, 10 s each
#   scripts/bench/peers.sh --quick                 # ~2 s per configuration, 1 Strata round
#   scripts/bench/peers.sh --models small,cnn --configs tf-mirrored,torch-ddp --seconds 20
#   scripts/bench/peers.sh --no-strata             # the peers only
#   scripts/bench/peers.sh --isa avx2              # as on an AVX2 host, on any x86-64 machine
#   scripts/bench/peers.sh --rounds 3 --strata-rounds 1   # alternated: peers, Strata, three times; medians
#   scripts/bench/peers.sh --help                  # every option (scripts/bench/peers/run.py)
#
# `--isa avx2` measures an AVX2 host's figures on an AVX-512 one, both sides kept to AVX2 by
# their own switches: PyTorch with ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2 and
# MKL_ENABLE_INSTRUCTIONS=AVX2 (TensorFlow's oneDNN with the second), Strata built without its
# `avx512` feature (`cargo build --release -p strata-cli --no-default-features`, into
# target/avx2), so neither gemm nor strata::fused has AVX-512 code to choose. The table's header
# says which ISA, PyTorch's `cpu_capability` and Strata's backend line.
#
# Configurations: tf-one-device, tf-mirrored, tf-mwms, torch-threads, torch-ddp. Models: small,
# large, cnn, transformer (`strata bench train` may not have cnn and transformer yet: its cells
# then read n/a). Strata: target/release/strata (built with cargo if missing), or --strata PATH.
#
# What gets installed, into a virtual environment outside the repository (PEERS_VENV, default
# ~/.cache/strata/peers-venv; reused when it has the packages; --no-install skips this step):
# - TensorFlow: tensorflow-cpu==2.21.* (else tensorflow==2.21.*), which brings Keras 3.
# - PyTorch (PEERS_TORCH, default torch==2.15.*): PyPI has no CPU-only x86-64 Linux wheel of
#   torch; its wheel is a CUDA build whose dependencies are about 4 GB of nvidia-* libraries,
#   triton (1 GB) and the CUDA Python bindings. The libraries cannot be left out (libtorch_cuda.so
#   links cuBLAS, cuDNN, NCCL, cuFFT... and `import torch` loads it), but triton (a GPU kernel
#   compiler) and cuda-bindings are never used on a CPU: so the script installs torch with
#   --no-deps, then every requirement torch's own metadata declares except those two, and
#   checks that `import torch` works (if not, it falls back to a plain `pip install torch`).
#   That is about 4.3 GB for torch; the venv is about 5.8 GB in all. Where PyTorch's CPU-only
#   wheel index is reachable, PEERS_TORCH_INDEX_URL=<that index> installs the ~200 MB CPU build
#   instead.
# A package that cannot be installed is reported in one line; the other configurations run.
#
# Every configuration is killed with the script (Ctrl-C, SIGTERM): the launcher starts each in
# its own process group and kills the groups on exit.
set -uo pipefail

cd "$(dirname "$0")/../.."
# shellcheck source=scripts/bench/peers/install-torch.sh
source scripts/bench/peers/install-torch.sh
VENV=${PEERS_VENV:-$HOME/.cache/strata/peers-venv}
TORCH_SPEC=${PEERS_TORCH:-torch==2.15.*}
PYTHON=${PYTHON:-python3}

install=1
args=()
for a in "$@"; do
    if [[ "$a" == "--no-install" ]]; then install=0; else args+=("$a"); fi
done

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "creating the virtual environment $VENV" >&2
    "$PYTHON" -m venv "$VENV" || { echo "cannot create a virtual environment with $PYTHON" >&2; exit 1; }
fi
PY="$VENV/bin/python"
pip_install() { nice -n 19 "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }
has_version() { # DIST... PREFIX: whether one of the distributions is installed at a version starting with PREFIX
    "$PY" - "$@" <<'PY'
import importlib.metadata as m, sys
*dists, prefix = sys.argv[1:]
for d in dists:
    try:
        if m.version(d).startswith(prefix):
            sys.exit(0)
    except m.PackageNotFoundError:
        pass
sys.exit(1)
PY
}

if ((install)); then
    if ! has_version tensorflow-cpu tensorflow 2.21.; then
        echo "installing TensorFlow 2.21 into $VENV" >&2
        pip_install 'tensorflow-cpu==2.21.*' || pip_install 'tensorflow==2.21.*' ||
            echo "TensorFlow 2.21 cannot be installed (neither tensorflow-cpu nor tensorflow 2.21.* from PyPI): its configurations are skipped" >&2
    fi
    install_torch
    "$PY" -c 'import torch' 2>/dev/null ||
        echo "PyTorch cannot be installed or imported ($TORCH_SPEC): its configurations are skipped" >&2
fi

child=
cleanup() {
    if [[ -n "$child" ]] && kill -0 "$child" 2>/dev/null; then
        kill -TERM "$child" 2>/dev/null
        wait "$child" 2>/dev/null
    fi
}
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM HUP
trap cleanup EXIT

"$PY" scripts/bench/peers/run.py "${args[@]}" &
child=$!
wait "$child"
rc=$?
child=
exit $rc

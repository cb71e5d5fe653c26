"""`--isa avx2`: measure as on an AVX2 host, on any x86-64 machine, both sides kept to AVX2 by
their own switches (scripts/bench/peers.sh and scripts/bench/fsdp.sh).

PyTorch's own kernels (ATen), oneDNN (PyTorch's and TensorFlow's) and MKL (PyTorch's matrix
products) each by their own environment variable; Strata built without its `avx512` feature
(`cargo build --release -p strata-cli --no-default-features`, into target/avx2), so that neither
gemm nor strata::fused has AVX-512 code to choose.
"""

import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
ISAS = ("native", "avx2")
AVX2_PEER_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def peer_env(isa, base=None):
    """The environment a peer (PyTorch, TensorFlow) runs in at `isa`."""
    return dict(os.environ if base is None else base, **(AVX2_PEER_ENV if isa == "avx2" else {}))


def strata_build(isa):
    """(the cargo command that builds Strata's binary for `isa`, the binary's path)."""
    build = ["cargo", "build", "--release", "-p", "strata-cli"]
    if isa == "avx2":
        target = os.path.join(ROOT, "target", "avx2")
        return build + ["--no-default-features", "--target-dir", target], os.path.join(target, "release", "strata")
    return build, os.path.join(ROOT, "target", "release", "strata")


def describe(isa):
    """One line for a report's header: what `isa` set on each side."""
    if isa == "avx2":
        return ("avx2 (as on an AVX2 host): the peers with " + " ".join(f"{k}={v}" for k, v in AVX2_PEER_ENV.items())
                + "; Strata built without its avx512 feature (target/avx2)")
    return "native (every framework chooses its kernels for this CPU)"

# Sourced by scripts/bench/peers.sh, hosts.sh and fsdp.sh: `install_torch` installs PyTorch
# ($TORCH_SPEC, or from $PEERS_TORCH_INDEX_URL) into the virtual environment whose python is $PY
# ($VENV) with the caller's `pip_install`, unless torch already imports there. PyPI's torch is a
# CUDA build: its GPU-only requirements (triton, cuda-bindings) are left out, and installed
# after all only if torch does not import without them.
# `install_torch_venv` (hosts.sh, fsdp.sh): the virtual environment $VENV made with $SYS_PY
# where it is missing, PyTorch installed into it, and numpy (the peers' data code; peers.sh
# gets it with TensorFlow), with `pip_install` defined for them. Failures are printed; the
# caller checks that torch imports.
install_torch_venv() {
    if [[ ! -x "$PY" ]]; then
        echo "creating the virtual environment $VENV" >&2
        "$SYS_PY" -m venv "$VENV" || echo "cannot create a virtual environment with $SYS_PY" >&2
    fi
    pip_install() { nice -n 19 "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }
    if [[ -x "$PY" ]]; then install_torch; fi
    if [[ -x "$PY" ]] && ! "$PY" -c 'import numpy' 2>/dev/null; then
        pip_install numpy
    fi
}

install_torch() {
    if "$PY" -c 'import torch' 2>/dev/null; then
        return 0
    fi
    echo "installing PyTorch ($TORCH_SPEC) into $VENV (several minutes)" >&2
    if [[ -n "${PEERS_TORCH_INDEX_URL:-}" ]]; then
        pip_install "$TORCH_SPEC" --index-url "$PEERS_TORCH_INDEX_URL"
    elif pip_install --no-deps "$TORCH_SPEC"; then
        # torch's declared requirements (markers evaluated here), less the GPU-only ones.
        local reqs
        mapfile -t reqs < <("$PY" - <<'PY'
import importlib.metadata as m
from pip._vendor.packaging.requirements import Requirement
for r in m.requires("torch") or []:
    req = Requirement(r)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower().replace("_", "-") in ("triton", "cuda-bindings"):
        continue
    print(str(req).split(";")[0].strip())
PY
)
        echo "(pip may warn that torch requires triton and cuda-bindings: they are left out on purpose)" >&2
        if ((${#reqs[@]})); then pip_install "${reqs[@]}"; fi
    fi
    if ! "$PY" -c 'import torch' 2>/dev/null; then
        echo "torch without triton and cuda-bindings does not import; installing it with all its dependencies" >&2
        pip_install "$TORCH_SPEC"
    fi
}

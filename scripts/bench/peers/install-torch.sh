# Sourced by scripts/bench/peers.sh and scripts/bench/hosts.sh: `install_torch` installs PyTorch
# ($TORCH_SPEC, or from $PEERS_TORCH_INDEX_URL) into the virtual environment whose python is $PY
# ($VENV) with the caller's `pip_install`, unless torch already imports there. PyPI's torch is a
# CUDA build: its GPU-only requirements (triton, cuda-bindings) are left out, and installed
# after all only if torch does not import without them.
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

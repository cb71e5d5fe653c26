"""What every peer benchmark shares: the data, the models' shapes, the timing loop, the output.

The data and shapes are Strata's (`strata bench train`): the digits training split (80% of the
1,797 rows; a numpy permutation with seed 0, not Strata's ChaCha8 one: the work per step is the
same) cut into its 5 full global batches of 256, cycled; pixels scaled by 1/16. The transformer
reads the first 90% of Tiny Shakespeare and draws 64 fixed batches of 32 random windows of 65
characters (input 64, target shifted by one), cycled.
"""

import ast
import gzip
import json
import os
import sys
import time
import types

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
DIGITS = os.path.join(ROOT, "data", "digits.csv.gz")
SHAKESPEARE_CANDIDATES = [
    os.path.join(ROOT, "data", "tinyshakespeare.txt.gz"),
    os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare.txt.gz"),
    "/work/shared/data/tinyshakespeare.txt.gz",
]

MODELS = ("small", "large", "cnn", "transformer")
HIDDEN = {"small": (256, 256), "large": (2048, 2048)}
# The transformer: decoder-only character LM.
T_LAYERS, T_WIDTH, T_HEADS, T_CONTEXT, T_BATCH = 4, 128, 4, 64, 32
LR = {"small": 1e-3, "large": 1e-3, "cnn": 1e-3, "transformer": 3e-3}
WEIGHT_DECAY = 0.01  # candle's ParamsAdamW default, PyTorch's AdamW default
GLOBAL_BATCH = 256
# Multi-process configurations agree whether to stop every this many steps (Strata's bench
# checks once per execution of the 5 digits batches).
CHECK_EVERY = 5


def digits_batches(global_batch=GLOBAL_BATCH):
    """[(x float32 (B, 64), y int64 (B,))] the full global batches of the training split."""
    rows = np.loadtxt(gzip.open(DIGITS, "rt"), delimiter=",", dtype=np.float32)
    x, y = rows[:, :64] / 16.0, rows[:, 64].astype(np.int64)
    idx = np.random.default_rng(0).permutation(len(x))
    n_train = len(x) - int(round(0.2 * len(x)))
    x, y = x[idx[:n_train]], y[idx[:n_train]]
    full = n_train // global_batch
    return [(x[i * global_batch:(i + 1) * global_batch], y[i * global_batch:(i + 1) * global_batch]) for i in range(full)]


def shakespeare_splits():
    """(characters, train int64 array, validation int64 array): Tiny Shakespeare as character
    ids, its first 90% for training and the rest for validation."""
    path = next((p for p in SHAKESPEARE_CANDIDATES if os.path.exists(p)), None)
    if path is None:
        raise SystemExit("tinyshakespeare.txt.gz not found in " + ", ".join(SHAKESPEARE_CANDIDATES))
    text = gzip.open(path, "rt", encoding="utf-8").read()
    chars = sorted(set(text))
    table = {c: i for i, c in enumerate(chars)}
    data = np.fromiter((table[c] for c in text), dtype=np.int64, count=len(text))
    cut = int(0.9 * len(data))
    return chars, data[:cut], data[cut:]


def shakespeare_batches(n_batches=64, batch=T_BATCH, context=T_CONTEXT):
    """(vocab size, [(x int64 (B, T), y int64 (B, T))])."""
    chars, train, _ = shakespeare_splits()
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n_batches):
        starts = rng.integers(0, len(train) - context - 1, size=batch)
        w = np.stack([train[s:s + context + 1] for s in starts])
        out.append((w[:, :-1], w[:, 1:]))
    return len(chars), out


def units_per_step(model, global_batch=GLOBAL_BATCH):
    """Examples (tokens for the transformer) one global step trains on."""
    return T_BATCH * T_CONTEXT if model == "transformer" else global_batch


def split(batch, parts, index):
    """Rows [index * n / parts, (index + 1) * n / parts) of every array of a batch."""
    x, y = batch
    per = len(x) // parts
    return x[index * per:(index + 1) * per], y[index * per:(index + 1) * per]


def timed_loop(step, warmup, seconds, steps, agree=None):
    """Runs `warmup` steps, then `steps` steps (or, when steps is 0, steps for `seconds`, and at
    least CHECK_EVERY). `agree(local_stop) -> bool` makes several processes stop together: it is
    called every CHECK_EVERY steps. Returns (timed steps, elapsed seconds)."""
    for i in range(warmup):
        step(i)
    if agree is not None:
        agree(False)  # a barrier: every process starts timing together
    t0 = time.perf_counter()
    n = 0
    while True:
        step(n)
        n += 1
        if steps:
            if n >= steps:
                break
        elif n % CHECK_EVERY == 0:
            local = time.perf_counter() - t0 >= seconds
            if (agree(local) if agree is not None else local):
                break
    return n, time.perf_counter() - t0


def report(framework, version, config, model, steps, elapsed, extra=None):
    """Prints the one JSON line the launcher reads."""
    units = units_per_step(model)
    out = {
        "framework": framework,
        "version": version,
        "config": config,
        "model": model,
        "unit": "tokens/s" if model == "transformer" else "examples/s",
        "per_second": units * steps / elapsed,
        "steps": steps,
        "seconds": elapsed,
        "step_ms": 1e3 * elapsed / steps,
    }
    out.update(extra or {})
    print(json.dumps(out), flush=True)


def common_args(parser):
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--seconds", type=float, default=10.0, help="timed steady state, seconds")
    parser.add_argument("--steps", type=int, default=0, help="timed steps instead of --seconds")
    parser.add_argument("--warmup", type=int, default=10, help="untimed warm-up steps")
    return parser


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def gpt2_init(torch, model, layers=T_LAYERS):
    """Strata's initialisation of its character transformer on torch_models' transformer: every
    weight normal(0, 0.02), the projections into the residual stream normal(0, 0.02 /
    sqrt(2 layers)), biases zero and no bias on qkv (frozen at zero), layer norms as they are."""
    import math
    with torch.no_grad():
        residual = 0.02 / math.sqrt(2 * layers)
        for name, p in model.named_parameters():
            if "ln" in name:
                continue
            if name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0, residual if ("proj" in name or ".out." in name) else 0.02)
        for block in model.blocks:
            block.qkv.bias.requires_grad_(False)


def torch_models(torch, nn, F, width=None, layers=None, heads=None):
    """`build(model, vocab)` with `Block` and `Transformer` as torch_bench.py defines them (that
    file runs its benchmark when imported, so its definitions are taken from its source).
    `width`, `layers`, `heads`: the transformer's shape when not the default's (T_WIDTH,
    T_LAYERS, T_HEADS): the definitions then read a copy of this module with those replaced
    (scripts/bench/fsdp.sh builds the 25M transformer this way; the context stays T_CONTEXT)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_bench.py")
    tree = ast.parse(open(path).read(), path)
    wanted = {"Block", "Transformer", "build"}
    defs = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in wanted]
    missing = wanted - {n.name for n in defs}
    if missing:
        raise SystemExit(f"{path} no longer defines {', '.join(sorted(missing))}")
    shape = {k: v for k, v in (("T_WIDTH", width), ("T_LAYERS", layers), ("T_HEADS", heads)) if v is not None}
    module = sys.modules[__name__]
    if shape:
        module = types.ModuleType(__name__)
        module.__dict__.update(sys.modules[__name__].__dict__)
        module.__dict__.update(shape)
    scope = {"torch": torch, "nn": nn, "F": F, "common": module}
    exec(compile(ast.Module(body=defs, type_ignores=[]), path, "exec"), scope)
    return scope["build"]

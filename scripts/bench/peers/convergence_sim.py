"""PyTorch reference for two convergence questions about Strata's character transformer:
what one update of staleness costs (an asynchronous parameter server with 2 workers), and what
PowerSGD costs under AdamW. One process, one JSON line: the validation loss after training.

The model is torch_bench.py's transformer (Strata's shape); `--init gpt2` gives it Strata's
initialisation (normal 0.02, the projections into the residual stream 0.02 / sqrt(2 layers),
zero biases, no bias on qkv), `--init torch` keeps PyTorch's defaults. Training is Strata's
`strata train --model transformer` defaults: 1,200 steps of 32 random windows of 64 characters
of the first 90% of Tiny Shakespeare, AdamW (lr 0.003, weight decay 0.01) with warm-up over
min(steps / 20, 100) steps and a cosine to lr / 10, gradients clipped to a global norm of 1.
The validation loss is the mean over 16 fixed batches of 64 windows of the last 10%.

  --mode base    one device
  --mode delay   every gradient computed at the values of --delay updates before the ones it
                 is applied to (an async ps whose pushes all land --delay updates stale);
                 --predict K computes it at those values extrapolated K updates ahead along
                 the last update (Strata's look-ahead, with the staleness known exactly)
  --mode psgd    PowerSGD of --rank on every matrix that shrinks, error feedback, warm start
                 (Vogels et al. 2019; the sum over workers is linear, so one process is exact),
                 --start uncompressed steps first, --iters power iterations a step;
                 --freeze-v N keeps AdamW's second moment from step N (1-bit Adam's rule)

Run with the peers' venv (scripts/bench/peers/install-torch.sh), e.g.
  python scripts/bench/peers/convergence_sim.py --init gpt2 --mode delay --predict 1
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--mode", choices=("base", "delay", "psgd"), default="base")
ap.add_argument("--init", choices=("gpt2", "torch"), default="gpt2")
ap.add_argument("--steps", type=int, default=1200)
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--beta1", type=float, default=0.9)
ap.add_argument("--clip", type=float, default=1.0, help="global norm (0: none)")
ap.add_argument("--delay", type=int, default=1)
ap.add_argument("--predict", type=float, default=0.0)
ap.add_argument("--rank", type=int, default=4)
ap.add_argument("--start", type=int, default=0)
ap.add_argument("--iters", type=int, default=1)
ap.add_argument("--freeze-v", type=int, default=-1)
ap.add_argument("--exact", default="", help="comma-separated name prefixes of parameters PowerSGD leaves uncompressed")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--threads", type=int, default=1)
args = ap.parse_args()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.set_num_threads(args.threads)
torch.manual_seed(args.seed)

chars, train, val = common.shakespeare_splits()
rng = np.random.default_rng(args.seed)


def windows(src, n, r):
    starts = r.integers(0, len(src) - common.T_CONTEXT - 1, size=n)
    w = torch.from_numpy(np.stack([src[s:s + common.T_CONTEXT + 1] for s in starts]))
    return w[:, :-1], w[:, 1:]


val_rng = np.random.default_rng(123)
val_batches = [windows(val, 64, val_rng) for _ in range(16)]
model = common.torch_models(torch, nn, F)("transformer", len(chars))
if args.init == "gpt2":
    with torch.no_grad():
        residual = 0.02 / math.sqrt(2 * common.T_LAYERS)
        for name, p in model.named_parameters():
            if "ln" in name:
                continue
            if name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0, residual if ("proj" in name or ".out." in name) else 0.02)
        for block in model.blocks:
            block.qkv.bias.requires_grad_(False)
params = [p for p in model.parameters() if p.requires_grad]
names = {p: n for n, p in model.named_parameters()}
exact = tuple(x for x in args.exact.split(",") if x) or ("\0",)
opt = torch.optim.AdamW(params, lr=args.lr, betas=(args.beta1, 0.999), weight_decay=common.WEIGHT_DECAY)
warmup = min(args.steps // 20, 100)


def lr_at(t):
    if t < warmup:
        return args.lr * (t + 1) / warmup
    p = (t - warmup) / max(1, args.steps - warmup)
    return args.lr / 10 + 0.9 * args.lr * 0.5 * (1 + math.cos(math.pi * p))


powersgd = {}


def compress(p, g, t):
    """PowerSGD's output for gradient `g` of `p` at step `t` (the gradient itself where it
    does not apply)."""
    if g.dim() < 2 or t < args.start or names[p].startswith(exact):
        return g
    m = g.reshape(g.shape[0], -1)
    rows, cols = m.shape
    if rows * cols <= args.rank * (rows + cols):
        return g
    st = powersgd.get(p)
    if st is None:
        gen = torch.Generator().manual_seed(len(powersgd))
        st = powersgd[p] = {"error": torch.zeros_like(m), "q": torch.randn(cols, args.rank, generator=gen)}
    m = m + st["error"]
    q = st["q"]
    for _ in range(args.iters):
        pm, _ = torch.linalg.qr(m @ q)
        q = m.t() @ pm
    out = pm @ q.t()
    st["error"] = m - out
    st["q"] = q / q.norm(dim=0, keepdim=True).clamp_min(1e-30)
    return out.reshape(g.shape)


def loss_of(x, y):
    return F.cross_entropy(model(x).reshape(-1, len(chars)), y.reshape(-1))


history = []  # the values of the last delay + 2 updates
for t in range(args.steps):
    for group in opt.param_groups:
        group["lr"] = lr_at(t)
    x, y = windows(train, common.T_BATCH, rng)
    opt.zero_grad()
    if args.mode == "delay":
        now = [p.detach().clone() for p in params]
        history.append(now)
        if len(history) > args.delay + 2:
            history.pop(0)
        at = history[max(0, len(history) - 1 - args.delay)]
        before = history[max(0, len(history) - 2 - args.delay)]
        with torch.no_grad():
            for p, a, b in zip(params, at, before):
                p.copy_(a + args.predict * (a - b))
        loss_of(x, y).backward()
        with torch.no_grad():
            for p, n in zip(params, now):
                p.copy_(n)
    else:
        loss_of(x, y).backward()
    if args.mode == "psgd":
        # The reduction comes first; the global norm is the reduced gradients' (as Strata clips).
        with torch.no_grad():
            for p in params:
                p.grad.copy_(compress(p, p.grad, t))
    if args.clip > 0:
        torch.nn.utils.clip_grad_norm_(params, args.clip)
    frozen = None
    if 0 <= args.freeze_v <= t:
        frozen = {p: opt.state[p]["exp_avg_sq"].clone() for p in params if p in opt.state}
    opt.step()
    if frozen:
        for p, v in frozen.items():
            opt.state[p]["exp_avg_sq"].copy_(v)

with torch.no_grad():
    model.eval()
    val_loss = sum(loss_of(x, y).item() for x, y in val_batches) / len(val_batches)
print(json.dumps({**vars(args), "validation_loss": round(val_loss, 4), "torch": torch.__version__}))

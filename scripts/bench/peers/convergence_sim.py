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
  --mode diloco  DiLoCo / local SGD of --workers W (4) simulated in one process, as
                 diloco_peer.py: every worker its own copy of the model and its own AdamW (the
                 schedule and clipping above, each worker clipping its own gradient), each step's
                 batch of 32 drawn as in base mode and worker w taking rows [w*32/W, (w+1)*32/W)
                 (diloco_peer.py's split); at a meeting the outer gradient, the mean over the
                 workers of `global - local`, goes through torch.optim.SGD(--outer-lr,
                 --outer-momentum, nesterov=True) on the global copy, which every worker loads.
                 When they meet: --sync-every H (after steps H, 2H, ...), or --meetings, a list
                 of steps and ranges `A-B/S` (after steps A, A+S, ... <= B), e.g.
                 `10-100/10,200-1200/100`, or `qsr:C:H0` (Gu et al. 2023's quadratic rule: the
                 next meeting after max(H0, floor((C * lr_peak / lr)^2)) steps, lr the rate at
                 the meeting, its peak during the warm-up); the last step
                 always ends with a meeting, as diloco_peer.py and Strata's fit do.
                 --sync-steps K: the first K steps per-step synchronous (the workers' gradients
                 averaged, then clipped, every worker stepping alike: post-local SGD, Lin et al.
                 2020). --avg-moments m|v|mv averages AdamW's exp_avg / exp_avg_sq over the
                 workers at every meeting (at steps >= --avg-moments-from). Outer lr changes:
                 --outer-warmup N (linear over the first N meetings), --outer-lr-end E (linear in
                 the step from --outer-lr to E), --outer-reset S1,S2,... (the outer momentum
                 cleared at the first meeting at or after each). The warm-up's first step has
                 rate lr / warm-up (base mode's lr_at, for every mode here; diloco_peer.py's
                 starts at 0, one step earlier). The JSON line gives `meetings` and
                 `allreduces`: full-parameter all-reduces over the run (a meeting or a
                 synchronous step one each, each averaged moment one more).

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
ap.add_argument("--mode", choices=("base", "delay", "psgd", "diloco"), default="base")
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
ap.add_argument("--workers", type=int, default=4)
ap.add_argument("--sync-every", type=int, default=100)
ap.add_argument("--meetings", default="", help="steps after which the workers meet (overrides --sync-every)")
ap.add_argument("--sync-steps", type=int, default=0, help="per-step synchronous steps first")
ap.add_argument("--outer-lr", type=float, default=0.7)
ap.add_argument("--outer-momentum", type=float, default=0.9)
ap.add_argument("--outer-nesterov", type=int, default=1)
ap.add_argument("--outer-warmup", type=int, default=0, help="meetings of linear outer-lr warm-up")
ap.add_argument("--outer-lr-end", type=float, default=-1.0, help="outer lr at the last step (linear; <0: constant)")
ap.add_argument("--outer-reset", default="", help="comma-separated steps: momentum cleared at the first meeting at or after each")
ap.add_argument("--avg-moments", choices=("", "m", "v", "mv"), default="")
ap.add_argument("--avg-moments-from", type=int, default=0)
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
    common.gpt2_init(torch, model)
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


def meeting_steps():
    """The sorted set of 1-based steps after which the workers meet (the last always)."""
    spec = args.meetings or f"{args.sync_every}-{args.steps}/{args.sync_every}"
    out = set()
    if spec.startswith("qsr:"):
        c, h0 = spec.split(":")[1:]
        at = 0
        while at < args.steps:
            at += max(int(h0), int((float(c) * args.lr / lr_at(max(at, warmup))) ** 2))
            out.add(min(at, args.steps))
    else:
        for part in spec.split(","):
            if "-" in part:
                ab, step = part.split("/") if "/" in part else (part, "1")
                a, b = ab.split("-")
                out.update(range(int(a), int(b) + 1, int(step)))
            elif part:
                out.add(int(part))
    out = {m for m in out if args.sync_steps < m <= args.steps}
    out.add(args.steps)
    return sorted(out)


if args.mode == "diloco":
    import copy  # noqa: E402

    W = args.workers
    per = common.T_BATCH // W
    models = [copy.deepcopy(model) for _ in range(W)]
    wparams = [[p for p in m.parameters() if p.requires_grad] for m in models]
    wopts = [torch.optim.AdamW(ps, lr=args.lr, betas=(args.beta1, 0.999), weight_decay=common.WEIGHT_DECAY)
             for ps in wparams]
    glob = [p.detach().clone() for p in params]
    outer = torch.optim.SGD(glob, lr=args.outer_lr, momentum=args.outer_momentum, nesterov=bool(args.outer_nesterov) and args.outer_momentum > 0)
    meets = meeting_steps()
    meet_set = set(meets)
    resets = sorted(int(x) for x in args.outer_reset.split(",") if x)
    counts = {"meetings": 0, "allreduces": 0, "outer_steps": 0}

    def outer_lr_at(step):
        lr = args.outer_lr
        if args.outer_lr_end >= 0:
            lr = args.outer_lr + (args.outer_lr_end - args.outer_lr) * step / args.steps
        if args.outer_warmup > 0 and counts["outer_steps"] < args.outer_warmup:
            lr *= (counts["outer_steps"] + 1) / args.outer_warmup
        return lr

    def meet(step):
        with torch.no_grad():
            while resets and resets[0] <= step:
                resets.pop(0)
                outer.state.clear()
            for i, g in enumerate(glob):
                g.grad = g - torch.stack([ps[i] for ps in wparams]).mean(0)
            for group in outer.param_groups:
                group["lr"] = outer_lr_at(step)
            outer.step()
            outer.zero_grad(set_to_none=True)
            for ps in wparams:
                for p, g in zip(ps, glob):
                    p.copy_(g)
            counts["meetings"] += 1
            counts["allreduces"] += 1
            counts["outer_steps"] += 1
            if args.avg_moments and step >= args.avg_moments_from:
                for key in {"m": ("exp_avg",), "v": ("exp_avg_sq",), "mv": ("exp_avg", "exp_avg_sq")}[args.avg_moments]:
                    counts["allreduces"] += 1
                    for i in range(len(params)):
                        states = [o.state[ps[i]][key] for o, ps in zip(wopts, wparams)]
                        mean = torch.stack(states).mean(0)
                        for st in states:
                            st.copy_(mean)

    for t in range(args.steps):
        x, y = windows(train, common.T_BATCH, rng)
        for w in range(W):
            for group in wopts[w].param_groups:
                group["lr"] = lr_at(t)
            wopts[w].zero_grad()
            xw, yw = x[w * per:(w + 1) * per], y[w * per:(w + 1) * per]
            out = models[w](xw)
            F.cross_entropy(out.reshape(-1, len(chars)), yw.reshape(-1)).backward()
        if t < args.sync_steps:
            # Per-step synchronous: the mean gradient, clipped, on every worker alike.
            with torch.no_grad():
                for i in range(len(params)):
                    mean = torch.stack([ps[i].grad for ps in wparams]).mean(0)
                    for ps in wparams:
                        ps[i].grad.copy_(mean)
            counts["meetings"] += 1
            counts["allreduces"] += 1
        for w in range(W):
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(wparams[w], args.clip)
            wopts[w].step()
        if t < args.sync_steps:
            with torch.no_grad():
                for g, p in zip(glob, wparams[0]):
                    g.copy_(p)
        elif t + 1 in meet_set:
            meet(t + 1)
    with torch.no_grad():
        for p, g in zip(params, glob):
            p.copy_(g)

history = []  # the values of the last delay + 2 updates
for t in range(args.steps if args.mode != "diloco" else 0):
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
extra = {}
if args.mode == "diloco":
    extra = {"meetings": counts["meetings"], "allreduces": counts["allreduces"],
             "meeting_steps": meets if len(meets) <= 40 else f"{len(meets)} steps"}
print(json.dumps({**vars(args), **extra, "validation_loss": round(val_loss, 4), "torch": torch.__version__}))

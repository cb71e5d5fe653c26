"""PyTorch's DiLoCo (or per-step DDP) over gloo, one process per emulated host: the reference
scripts/bench/slow_links.py runs beside Strata's `--sync-every`.

The algorithm as Douillard et al. (2023) and torchft's DiLoCo write it: each worker trains its
own copy of the default character transformer (scripts/bench/peers/torch_bench.py's, read from
its source; initialised as Strata initialises it, common.gpt2_init, unless --init torch) with AdamW (weight decay 0.01, fused where torch has it; Strata's transformer
schedule: a linear warm-up over 5% of the steps, at most 100, to --lr, then a cosine decay to a
tenth of it; gradients clipped to a global norm of 1.0) on its rows of each global batch of 32
windows of 64 characters; every --sync-every H steps every worker computes
its outer gradient `global - local` for every parameter, the workers all-reduce it (f32, or
bf16 with --wire bf16), divide by their number, and torch.optim.SGD(lr --outer-lr, momentum
--outer-momentum, nesterov=True) steps the global copy, which every worker then loads. H = 1
with --outer-lr 1 --outer-momentum 0 is not DDP (it averages parameters, not gradients); for
per-step synchronous training run --ddp (DistributedDataParallel, the same loop).

Data: the first 90% of Tiny Shakespeare, a batch of 32 random windows per step from one numpy
generator (seed 0) that every worker draws alike and takes its rows of; validation: 64 fixed
windows of 32 from the last 10% (seed 1), the mean cross-entropy after the last step (a
synchronisation ends the run, as Strata's fit does). Rank 0 prints one JSON line: tokens/s over
the steps after --warmup (10), the validation loss, the bytes its all-reduces carried.
"""

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--steps", type=int, required=True)
ap.add_argument("--warmup", type=int, default=10, help="steps left out of the rate")
ap.add_argument("--sync-every", type=int, default=100)
ap.add_argument("--outer-lr", type=float, default=0.7)
ap.add_argument("--outer-momentum", type=float, default=0.9)
ap.add_argument("--wire", choices=("f32", "bf16"), default="f32")
ap.add_argument("--ddp", action="store_true", help="per-step DDP instead of DiLoCo")
ap.add_argument("--init", choices=("gpt2", "torch"), default="gpt2",
                help="gpt2: Strata's initialisation of the transformer (common.gpt2_init, the default); "
                     "torch: PyTorch's defaults")
ap.add_argument("--lr", type=float, default=0.003)
args = ap.parse_args()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

chars, train, val = common.shakespeare_splits()
T, B = common.T_CONTEXT, common.T_BATCH


def windows(source, rng, n):
    starts = rng.integers(0, len(source) - T - 1, size=n)
    w = np.stack([source[s:s + T + 1] for s in starts])
    return torch.from_numpy(w[:, :-1].copy()), torch.from_numpy(w[:, 1:].copy())


build = common.torch_models(torch, nn, F)
model = build("transformer", len(chars))
if args.init == "gpt2":
    common.gpt2_init(torch, model)
if args.ddp:
    model = nn.parallel.DistributedDataParallel(model)
params = list(model.parameters())
for p in params:  # every worker starts from rank 0's values
    dist.broadcast(p.data, 0)
try:
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=common.WEIGHT_DECAY, fused=True)
except (RuntimeError, TypeError, ValueError):
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=common.WEIGHT_DECAY)
glob = [p.detach().clone() for p in params]
outer = torch.optim.SGD(glob, lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True)
sent = [0]


def meet():
    """One outer step: the mean outer gradient all-reduced, Nesterov on the global copy."""
    deltas = [g - p.detach() for g, p in zip(glob, params)]
    flat = torch.cat([d.reshape(-1) for d in deltas])
    if args.wire == "bf16":
        wire = flat.to(torch.bfloat16)
        dist.all_reduce(wire)
        flat = wire.to(torch.float32)
        sent[0] += 2 * flat.numel()
    else:
        dist.all_reduce(flat)
        sent[0] += 4 * flat.numel()
    flat /= world
    at = 0
    for g in glob:
        g.grad = flat[at:at + g.numel()].view_as(g).clone()
        at += g.numel()
    outer.step()
    outer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for g, p in zip(glob, params):
            p.copy_(g)


def lr_at(t):
    """Strata's transformer schedule (strata-cli `transformer_schedule`): a linear warm-up from 0
    over 5% of the steps (at most 100), then a cosine decay to a tenth of --lr at the last."""
    warm = min(args.steps // 20, 100)
    if t < warm:
        return args.lr * t / warm
    if t >= args.steps:
        return args.lr / 10
    p = (t - warm) / max(1, args.steps - warm)
    return args.lr / 10 + (args.lr - args.lr / 10) * 0.5 * (1 + math.cos(math.pi * p))


rng = np.random.default_rng(0)
per = B // world
t0 = None
for step in range(1, args.steps + 1):
    if step == args.warmup + 1:
        dist.barrier()
        t0 = time.perf_counter()
    x, y = windows(train, rng, B)
    x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    # As Strata's transformer: the global norm clipped at 1.0 (DDP: of the averaged gradient;
    # DiLoCo: of the worker's own), the schedule's rate for this step.
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    for g in opt.param_groups:
        g["lr"] = lr_at(step - 1)
    opt.step()
    if args.ddp:
        sent[0] += 4 * sum(p.numel() for p in params)
    elif step % args.sync_every == 0:
        meet()
if not args.ddp and args.steps % args.sync_every:
    meet()
dist.barrier()
elapsed = time.perf_counter() - t0
with torch.no_grad():
    vrng = np.random.default_rng(1)
    total = 0.0
    for _ in range(64):
        x, y = windows(val, vrng, B)
        logits = model(x)
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
if rank == 0:
    print(json.dumps({
        "framework": "pytorch", "version": torch.__version__, "config": "ddp" if args.ddp else "diloco",
        "tokens_per_second": B * T * (args.steps - args.warmup) / elapsed, "validation_loss": total / 64,
        "allreduced_bytes": sent[0], "parameters": sum(p.numel() for p in params), "steps": args.steps,
        "sync_every": None if args.ddp else args.sync_every, "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum, "wire": args.wire, "processes": world,
    }), flush=True)
dist.barrier()
sys.stdout.flush()
os._exit(0)

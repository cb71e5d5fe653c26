"""One PyTorch FSDP2 worker of scripts/bench/fsdp.sh (its launcher, fsdp_bench.py, starts
WORLD_SIZE of these with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT on loopback).

The model is torch_bench.py's character transformer (scripts/bench/peers/common.py
`torch_models`) at --width/--layers/--heads, context 64 and Tiny Shakespeare's 65 characters;
every block is wrapped with `fully_shard(block)`, then the whole model with `fully_shard(model)`
(FSDP2's documented pattern; reshard_after_forward at its default, True: each block's
parameters are gathered for its forward pass, freed, and gathered again for its backward
pass). gloo, CPU, torch.set_num_threads(1) (Strata's worker runs 1 replica thread). AdamW at
Strata's `--optimizer adamw` defaults (lr 0.003, betas 0.9/0.999, eps 1e-8, weight decay 0.01;
fused=True where the build accepts it on sharded parameters) and the global gradient norm
clipped at 1.0 as Strata's transformer does (its warm-up/cosine learning-rate schedule costs
nothing per step and is left out). Each rank trains on its slice of every global batch of
--batch windows (common.shakespeare_batches: 16 fixed batches of random windows, cycled).

Timing: --warmup untimed steps, a barrier, then steps until --seconds have passed (every rank
agrees on the stop after each step with a one-element all-reduce) or exactly --steps steps, a
barrier; examples/s = global windows / elapsed seconds on rank 0. Each rank writes
<--out>/result-<rank>.json: the rate (rank 0's counts), its resident set after `import torch`,
after the process group's start and after sharding (VmRSS), and its high-water mark (VmHWM).
An error is one line on stderr and a non-zero exit.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 3e-3, (0.9, 0.999), 1e-8, 0.01, 1.0


def status_kib(field):
    """A /proc/self/status field in KiB (VmRSS, VmHWM), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def fail(msg):
    print(f"fsdp_peer rank {os.environ.get('RANK', '?')}: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--width", type=int, default=512)
ap.add_argument("--layers", type=int, default=8)
ap.add_argument("--heads", type=int, default=8)
ap.add_argument("--batch", type=int, default=8, help="global batch, windows of 64 characters")
ap.add_argument("--seconds", type=float, default=20.0, help="timed steady state, seconds")
ap.add_argument("--steps", type=int, default=0, help="timed steps instead of --seconds")
ap.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps")
ap.add_argument("--mesh", choices=("default", "cpu"), default="default",
                help="fully_shard's mesh: its default, or init_device_mesh('cpu', (WORLD_SIZE,)) passed explicitly")
ap.add_argument("--adamw", choices=("auto", "fused", "foreach"), default="auto",
                help="auto: fused where the first step takes it, else foreach")
ap.add_argument("--out", required=True, help="directory for result-<rank>.json")
args = ap.parse_args()

rss_start = status_kib("VmRSS")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.set_num_threads(1)
rss_import = status_kib("VmRSS")
try:
    from torch.distributed.fsdp import fully_shard
except ImportError as e:
    fail(f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2): {e}")

try:
    dist.init_process_group("gloo")
except Exception as e:  # noqa: BLE001
    fail(f"init_process_group('gloo'): {type(e).__name__}: {' '.join(str(e).split())}")
rank, world = dist.get_rank(), dist.get_world_size()
rss_init = status_kib("VmRSS")
if args.batch % world:
    fail(f"a global batch of {args.batch} windows does not split over {world} ranks")

vocab, batches = common.shakespeare_batches(n_batches=16, batch=args.batch, context=common.T_CONTEXT)
local = [tuple(torch.from_numpy(a.copy()) for a in common.split(b, world, rank)) for b in batches]

torch.manual_seed(0)
model = common.torch_models(torch, nn, F, args.width, args.layers, args.heads)("transformer", vocab)
parameters = sum(p.numel() for p in model.parameters())
kw = {}
if args.mesh == "cpu":
    from torch.distributed.device_mesh import init_device_mesh

    kw["mesh"] = init_device_mesh("cpu", (world,))
try:
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
except Exception as e:  # noqa: BLE001
    where = "mesh=init_device_mesh('cpu', ...)" if kw else "default mesh"
    fail(f"fully_shard ({where}): {type(e).__name__}: {' '.join(str(e).split())}")
rss_sharded = status_kib("VmRSS")


def make_opt(fused):
    extra = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **extra)


fused = args.adamw in ("auto", "fused")
try:
    opt = make_opt(fused)
except (RuntimeError, TypeError, ValueError) as e:
    if args.adamw == "fused":
        fail(f"AdamW(fused=True): {' '.join(str(e).split())}")
    fused, opt = False, make_opt(False)

last_loss = [float("nan")]


def step(i):
    x, y = local[i % len(local)]
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    last_loss[0] = loss.detach().item()


def first_step():
    """The first warm-up step; with --adamw auto, a fused AdamW that fails on sharded parameters
    (before it changes anything) gives way to the foreach one."""
    global fused, opt
    try:
        step(0)
    except Exception as e:  # noqa: BLE001
        if not (fused and args.adamw == "auto"):
            raise
        print(f"fsdp_peer rank {rank}: AdamW(fused=True) failed ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
              "using foreach", file=sys.stderr, flush=True)
        fused = False
        opt.zero_grad(set_to_none=True)
        opt = make_opt(False)
        step(0)


try:
    first_step()
    for i in range(1, max(args.warmup, 1)):
        step(i)
    dist.barrier()
    t0 = time.perf_counter()
    n = 0
    while True:
        step(n)
        n += 1
        if args.steps:
            if n >= args.steps:
                break
        else:
            flag = torch.tensor([1.0 if time.perf_counter() - t0 >= args.seconds else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                break
    dist.barrier()
    elapsed = time.perf_counter() - t0
except Exception as e:  # noqa: BLE001
    fail(f"training step: {type(e).__name__}: {' '.join(str(e).split())[:400]}")

result = {
    "rank": rank,
    "world": world,
    "torch": torch.__version__,
    "parameters": parameters,
    "steps": n,
    "seconds": elapsed,
    "examples_per_second": args.batch * n / elapsed,
    "tokens_per_second": args.batch * common.T_CONTEXT * n / elapsed,
    "last_loss": last_loss[0],
    "fused_adamw": fused,
    "mesh": args.mesh,
    "threads": torch.get_num_threads(),
    "rss_start_kib": rss_start,
    "rss_after_import_kib": rss_import,
    "rss_after_init_kib": rss_init,
    "rss_after_shard_kib": rss_sharded,
    "vmhwm_kib": status_kib("VmHWM"),
}
with open(os.path.join(args.out, f"result-{rank}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()

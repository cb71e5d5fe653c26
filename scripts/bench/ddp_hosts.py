"""PyTorch DDP over gloo, one process per emulated host (scripts/bench/hosts.sh starts one in
each host's network namespace): Strata's benchmark models, data and global batch, AdamW, under
DDP's default all-reduce, the fp16 compression hook, or PowerSGD.

  --hook none       DDP's own bucketed all-reduce (f32)
  --hook fp16       torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook
  --hook powersgd   powerSGD_hook.powerSGD_hook with PowerSGDState(process_group=None,
                    matrix_approximation_rank=--rank, start_powerSGD_iter=2), the model in
                    one DDP bucket (bucket_cap_mb=1024: see below)

The models are those of scripts/bench/peers/torch_bench.py: its `Block`, `Transformer` and
`build` are read from that file's source (not copied), so both benchmarks train the same
networks; the data and batches are scripts/bench/peers/common.py's. One thread per process
(torch.set_num_threads(1)). The environment names the job: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, and GLOO_SOCKET_IFNAME (the host's interface: without it gloo takes the address
its host name resolves to, which in a namespace is not the host's link).

Warm-up steps (--warmup, at least start_powerSGD_iter + 2, so PowerSGD's vanilla all-reduce
iterations and its first compressed ones are outside the timing) run untimed; then --steps
timed steps. Rank 0 prints one JSON line: the rate (examples/s; tokens/s for the transformer),
the parameter shapes, and the bytes one step all-reduces (f32 gradients, or what the hook
sends).
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.path.join(HERE, "peers")
sys.path.insert(0, PEERS)
import common  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--model", choices=common.MODELS, required=True)
ap.add_argument("--hook", choices=("none", "fp16", "powersgd"), default="none")
ap.add_argument("--rank", type=int, default=4, help="PowerSGD's matrix_approximation_rank")
ap.add_argument("--steps", type=int, required=True, help="timed steps")
ap.add_argument("--warmup", type=int, default=10, help="untimed warm-up steps")
ap.add_argument("--lr", type=float, default=0.003)
args = ap.parse_args()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
START_POWERSGD_ITER = 2


build = common.torch_models(torch, nn, F)
if args.model == "transformer":
    vocab, batches = common.shakespeare_batches()
else:
    vocab, batches = 10, common.digits_batches()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
local = [tuple(torch.from_numpy(a.copy()) for a in common.split(b, world, rank)) for b in batches]
# PowerSGD gets one bucket for the whole model: with DDP's default buckets (1 MiB first, then
# 25 MiB) the hook's chained all-reduces (uncompressed tensors, then P, then Q) of one bucket are
# launched from gloo's completion callbacks while the next bucket's are launched from the backward
# pass, so the ranks can issue them in different orders and gloo fails ("Received data size doesn't
# match expected size"), as it did here on the MLP. The other configurations keep DDP's defaults.
bucket = {"bucket_cap_mb": 1024} if args.hook == "powersgd" else {}
model = nn.parallel.DistributedDataParallel(build(args.model, vocab), **bucket)
shapes = [list(p.shape) for p in model.parameters()]

if args.hook == "fp16":
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
elif args.hook == "powersgd":
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.rank,
                                        start_powerSGD_iter=START_POWERSGD_ITER)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

try:
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=common.WEIGHT_DECAY, fused=True)
    fused = True
except (RuntimeError, TypeError, ValueError):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=common.WEIGHT_DECAY)
    fused = False


def step(i):
    x, y = local[i % len(local)]
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def agree(local_stop):
    flag = torch.tensor([1.0 if local_stop else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def allreduced_bytes():
    """Bytes one steady-state step all-reduces: f32 gradients; fp16: half; PowerSGD (as
    powerSGD_hook decides, min_compression_rate 2): P (n x r) and Q (m x r) in f32 for every
    gradient viewed as n x m = (shape[0], rest) that compresses at least 2x, the others whole."""
    numel = [int(torch.Size(s).numel()) for s in shapes]
    if args.hook == "none":
        return 4 * sum(numel)
    if args.hook == "fp16":
        return 2 * sum(numel)
    total = 0
    for s, n in zip(shapes, numel):
        if len(s) > 1:
            rows, cols = s[0], n // s[0]
            r = min(rows, cols, args.rank)
            if 2 * r * (rows + cols) < n:  # _should_compress, min_compression_rate 2
                total += 4 * r * (rows + cols)
                continue
        total += 4 * n
    return total


warmup = max(args.warmup, START_POWERSGD_ITER + 2) if args.hook == "powersgd" else args.warmup
n, dt = common.timed_loop(step, warmup, 0.0, args.steps, agree)
if rank == 0:
    common.report("pytorch", torch.__version__, f"ddp-{args.hook}", args.model, n, dt, {
        "processes": world, "threads": torch.get_num_threads(), "fused_adamw": fused, "hook": args.hook,
        "powersgd_rank": args.rank if args.hook == "powersgd" else None, "warmup": warmup,
        "parameters": sum(int(torch.Size(s).numel()) for s in shapes), "shapes": shapes,
        "allreduced_bytes": allreduced_bytes(), "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    })
# Every rank leaves together, without destroy_process_group: with a comm hook registered, gloo's
# teardown at exit sometimes aborts one rank ("terminate called without an active exception",
# seen on the CNN at 4 hosts with the fp16 and PowerSGD hooks) after the result is printed.
dist.barrier()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)

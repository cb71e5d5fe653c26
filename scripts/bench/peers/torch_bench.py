"""PyTorch on Strata's models: one configuration per process, one JSON line.

  --config threads   one process, torch.set_num_threads(2) (--threads)
  --config ddp       DistributedDataParallel over gloo; run by the launcher as 2 processes
                     (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT on loopback), 1 thread each

Eager mode, torch.optim.AdamW (fused=True where this build has the fused CPU kernel); the
transformer's attention is F.scaled_dot_product_attention(is_causal=True).

On a loaded machine `threads` can collapse: every OpenMP parallel region waits for the slower of
its 2 threads, and a niced thread is descheduled for long stretches (seen here at a load average
of 10: 1,000 examples/s on the small MLP with 2 threads against 88,000 with 1). Measure on a
quiet machine.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

ap = common.common_args(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
ap.add_argument("--config", choices=("threads", "ddp"), required=True)
ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: 2 for threads, 1 for ddp)")
args = ap.parse_args()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

threads = args.threads or (2 if args.config == "threads" else 1)
torch.set_num_threads(threads)
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.tok = nn.Embedding(vocab, common.T_WIDTH)
        self.pos = nn.Embedding(common.T_CONTEXT, common.T_WIDTH)
        self.blocks = nn.Sequential(*[Block(common.T_WIDTH, common.T_HEADS) for _ in range(common.T_LAYERS)])
        self.ln = nn.LayerNorm(common.T_WIDTH)
        self.head = nn.Linear(common.T_WIDTH, vocab)

    def forward(self, x):
        x = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def build(model, vocab):
    if model in common.HIDDEN:
        h1, h2 = common.HIDDEN[model]
        return nn.Sequential(nn.Linear(64, h1), nn.ReLU(), nn.Linear(h1, h2), nn.ReLU(), nn.Linear(h2, 10))
    if model == "cnn":
        return nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    return Transformer(vocab)


if args.model == "transformer":
    vocab, batches = common.shakespeare_batches()
else:
    vocab, batches = 10, common.digits_batches()

rank, world = 0, 1
if args.config == "ddp":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

# This process's slice of every global batch, as tensors made once.
local = [tuple(torch.from_numpy(a.copy()) for a in common.split(b, world, rank)) for b in batches]
model = build(args.model, vocab)
if args.config == "ddp":
    model = nn.parallel.DistributedDataParallel(model)
try:
    opt = torch.optim.AdamW(model.parameters(), lr=common.LR[args.model], weight_decay=common.WEIGHT_DECAY, fused=True)
    fused = True
except (RuntimeError, TypeError, ValueError):
    opt = torch.optim.AdamW(model.parameters(), lr=common.LR[args.model], weight_decay=common.WEIGHT_DECAY)
    fused = False


def step(i):
    x, y = local[i % len(local)]
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


agree = None
if args.config == "ddp":
    def agree(local_stop):
        flag = torch.tensor([1.0 if local_stop else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

n, dt = common.timed_loop(step, args.warmup, args.seconds, args.steps, agree)
if rank == 0:
    common.report("pytorch", torch.__version__, args.config, args.model, n, dt,
                  {"processes": world, "threads": threads, "fused_adamw": fused,
                   "cpu_capability": torch.backends.cpu.get_cpu_capability()})
if args.config == "ddp":
    dist.destroy_process_group()

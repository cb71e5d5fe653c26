"""PyTorch DDP (gloo) under torchrun's elastic agent: Strata's `strata train --strategy
multi-worker-mirrored --hidden 2048,2048 --optimizer sgd` for scripts/bench/elastic-vs-torchrun.sh.

  torchrun --nnodes 2:3 --nproc-per-node 1 --max-restarts 1 --rdzv-backend c10d \
      --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID ddp_elastic.py --snapshot DIR --log-dir DIR

The model: the 4.3M-parameter MLP 64-2048-2048-10 (scripts/bench/peers/torch_bench.py's `build`,
read from its source), plain SGD at strata train's default --lr 0.003, torch.manual_seed(0), one
thread per process. The data: common.py's digits training split (80% of the 1,797 rows, a
numpy permutation with seed 0) cut as Strata cuts an epoch: 5 global batches of 256 and one of
the remaining 158 rows (6 steps an epoch, in a fixed order where Strata shuffles: the same
work), cycled; each global
batch split over the current world size in contiguous parts (np.array_split: parts differing by
one row), the loss scaled so that DDP's gradient average is the mean over the whole global
batch. After every epoch rank 0 evaluates on the held-out 20% (as Strata does); --steps in all
(240: strata train --epochs 40).

Elastic, as torchrun's documentation has it: rank 0 writes a snapshot (model, optimizer, step)
every --snapshot-every steps (6: every epoch, as torchrun's example does; and at the end) to
--snapshot/snapshot.pt (written to a temporary name, then renamed), and every process loads it
when it starts, so a worker group that torchrun
restarts ("restart the world", after any worker dies or a node joins) resumes from it and redoes
the steps since. scripts/bench/elastic-vs-torchrun.sh runs the agents with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torchrun's default (one TCPStore the agents share
across restarts) the restarted group here often failed in init_process_group or hung.

Every process appends lines to --log-dir/rank<R>-pid<P>.log, flushed at once, times in Unix
seconds (time.time()):
  start <process start, from /proc/self/stat> <restart count> <rank> <world>
  imported <time>                 (torch imported, before init_process_group)
  joined <time>                   (init_process_group done)
  resumed <step>                  (a snapshot was loaded)
  step <step> <time> <world>      (the step's update done; steps count from 1)
  done <time>
"""

import argparse
import gzip
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402


def process_start():
    """This process's start, Unix seconds, to the clock tick: its age (the kernel counts its
    start in ticks since boot) subtracted from now (btime from /proc/stat would be off by the
    wall clock's corrections since boot)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[19])  # starttime: field 22 of stat(5); [0] here is field 3
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


started = process_start()

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--steps", type=int, default=240, help="steps in all (resumed runs included)")
ap.add_argument("--lr", type=float, default=0.003, help="SGD's learning rate (strata train's default)")
ap.add_argument("--snapshot", required=True, help="directory of the snapshot (shared by every node)")
ap.add_argument("--snapshot-every", type=int, default=6, help="steps between snapshots (6: every epoch)")
ap.add_argument("--log-dir", required=True, help="directory of the per-process step logs")
args = ap.parse_args()
if args.steps < 1 or args.snapshot_every < 1:
    sys.exit("error: --steps and --snapshot-every must be at least 1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)

# torchrun names the rank and the world in the environment before the process group exists.
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
os.makedirs(args.log_dir, exist_ok=True)
log = open(os.path.join(args.log_dir, f"rank{rank}-pid{os.getpid()}.log"), "a", buffering=1)
log.write(f"start {started:.3f} {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} {rank} {world}\n")
log.write(f"imported {time.time():.6f}\n")
dist.init_process_group("gloo")
log.write(f"joined {time.time():.6f}\n")

# The data: common.digits_batches' training split (a numpy permutation with seed 0), in batches of 256
# like Strata's epochs, the last one the remaining rows (1,438 = 5 x 256 + 158: 6 steps an
# epoch); the held-out 20% for the evaluation.
rows = np.loadtxt(gzip.open(common.DIGITS, "rt"), delimiter=",", dtype=np.float32)
xs, ys = rows[:, :64] / 16.0, rows[:, 64].astype(np.int64)
perm = np.random.default_rng(0).permutation(len(rows))
n_train = len(rows) - int(round(0.2 * len(rows)))
train, held = perm[:n_train], perm[n_train:]
test_x, test_y = torch.from_numpy(xs[held]), torch.from_numpy(ys[held])
local = []
for at in range(0, n_train, common.GLOBAL_BATCH):
    batch = train[at:at + common.GLOBAL_BATCH]
    part = np.array_split(batch, world)[rank]
    local.append((torch.from_numpy(xs[part]), torch.from_numpy(ys[part]), len(batch)))

build = common.torch_models(torch, nn, F)
net = build("large", 10)
opt = torch.optim.SGD(net.parameters(), lr=args.lr)
path = os.path.join(args.snapshot, "snapshot.pt")
step = 0
if os.path.exists(path):
    snap = torch.load(path, map_location="cpu")
    net.load_state_dict(snap["model"])
    opt.load_state_dict(snap["optimizer"])
    step = snap["step"]
    log.write(f"resumed {step}\n")
model = nn.parallel.DistributedDataParallel(net)


def save(step):
    os.makedirs(args.snapshot, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


while step < args.steps:
    x, y, global_len = local[step % len(local)]
    # DDP averages over the world: sum / global batch * world makes it the global batch's mean.
    loss = F.cross_entropy(model(x), y, reduction="sum") * (world / global_len)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    step += 1
    log.write(f"step {step} {time.time():.6f} {world}\n")
    if rank == 0:
        if step % len(local) == 0:
            with torch.no_grad():
                acc = (net(test_x).argmax(1) == test_y).float().mean().item()
            print(f"step {step}: test accuracy {acc:.4f}", flush=True)
        if step % args.snapshot_every == 0 or step == args.steps:
            save(step)
log.write(f"done {time.time():.6f}\n")
log.close()
# Every rank leaves together (rank 0's last snapshot is written before anyone exits).
dist.barrier()
dist.destroy_process_group()

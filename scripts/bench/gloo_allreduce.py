#!/usr/bin/env python3
"""PyTorch gloo all-reduce, timed the way `strata bench allreduce --workers N` times Strata's ring.

N processes (torch.multiprocessing) on loopback all-reduce (sum) float32 buffers from
--min-bytes to --max-bytes, stepping x4. Every iteration refills the buffer, meets the others
at a barrier, times one all_reduce and meets them again before checking the result against the
closed form (#wrong); the reported time is the slowest rank's median. Rank 0 prints the nccl-tests columns in the
same format as strata's table, so scripts/bench/compare-allreduce.sh can read both.

    python3 scripts/bench/gloo_allreduce.py --workers 2,4
"""

import argparse
import os
import socket
import statistics
import sys
import time

PERIOD = 251  # element i of rank r is (i % PERIOD) + r / 2: sums are exact in float32
ADAPTIVE_LOOP_SECS = 0.15
MIN_ITERS, MAX_ITERS = 5, 1000


def parse_bytes(s):
    s = s.strip()
    units = {"kib": 1 << 10, "k": 1 << 10, "mib": 1 << 20, "m": 1 << 20, "gib": 1 << 30, "g": 1 << 30, "b": 1}
    low = s.lower()
    for u in sorted(units, key=len, reverse=True):
        if low.endswith(u):
            return int(float(low[: -len(u)]) * units[u])
    return int(low)


def sizes(lo, hi):
    out, s = [], lo
    while 0 < s <= hi:
        out.append(s // 4 * 4)
        s *= 4
    return out


def fmt_bytes(b):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= div:
            return f"{b / div:.1f} {unit}"
    return f"{b} B"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, n, port, args, plan):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    if rank == 0:
        print("#")
        print(f"# {n} worker processes")
        print(
            f"# {'size':>10} {'count':>12} {'type':>6} {'redop':>6} {'time(us)':>11} {'algbw(GB/s)':>12} "
            f"{'busbw(GB/s)':>12} {'#wrong':>7} {'iters':>6}"
        )
    rows = []
    for nbytes in plan:
        count = nbytes // 4
        base = (torch.arange(count, dtype=torch.int64) % PERIOD).to(torch.float32)
        inp = base + rank * 0.5
        expected = base * n + n * (n - 1) / 4.0
        data = inp.clone()
        wrong = 0

        def one():
            nonlocal wrong
            data.copy_(inp)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(data, op=dist.ReduceOp.SUM)
            t = time.perf_counter() - t0
            dist.barrier()  # nobody checks (untimed work) while a slower rank is still timed
            wrong += int((data != expected).sum())
            return t

        warm = [one() for _ in range(max(1, args.warmup))]
        if args.iters:
            iters = args.iters
        else:
            v = torch.tensor([min(MAX_ITERS, max(MIN_ITERS, int(ADAPTIVE_LOOP_SECS / max(min(warm), 1e-9)) + 1))],
                             dtype=torch.float32)
            dist.broadcast(v, 0)
            iters = int(v.item())
        times = [one() for _ in range(iters)]
        med = torch.tensor([statistics.median_low(times)], dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        w = torch.tensor([wrong], dtype=torch.int64)
        dist.all_reduce(w, op=dist.ReduceOp.SUM)
        t = med.item()
        algbw = nbytes / t / 1e9
        busbw = algbw * 2 * (n - 1) / n
        rows.append((nbytes, t, busbw, int(w.item())))
        if rank == 0:
            print(
                f"  {nbytes:>10} {count:>12} {'float':>6} {'sum':>6} {t * 1e6:>11.1f} {algbw:>12.3f} "
                f"{busbw:>12.3f} {int(w.item()):>7} {iters:>6}",
                flush=True,
            )
    if rank == 0:
        small = min(rows)
        print(f"# {n} workers: median latency at {fmt_bytes(small[0])}: {small[1] * 1e6:.1f} us")
        total = sum(r[3] for r in rows)
        print(f"# {n} workers: wrong values: {total} {'OK' if total == 0 else 'FAILED'}")
        print(f"# {n} workers: avg bus bandwidth: {sum(r[2] for r in rows) / len(rows):.3f} GB/s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="2,4", help="comma-separated process counts")
    p.add_argument("--min-bytes", default="4KiB")
    p.add_argument("--max-bytes", default="256MiB")
    p.add_argument("--iters", type=int, default=0, help="timed iterations per row (0: adaptive, ~0.15 s)")
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError:
        sys.exit("PyTorch is not installed: pip install torch")
    plan = sizes(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes))
    print(f"# gloo_allreduce.py --workers {args.workers}: torch {torch.__version__}, gloo backend, "
          f"{os.cpu_count()} cores; op sum, float32, warmup {max(1, args.warmup)}, "
          f"iters {args.iters or 'adaptive'}; time = the slowest rank's median of "
          "(refill, barrier, timed all_reduce, barrier, check)")
    sys.stdout.flush()
    for n in (int(x) for x in args.workers.split(",") if x):
        mp.spawn(worker, args=(n, free_port(), args, plan), nprocs=n, join=True)


if __name__ == "__main__":
    main()

"""The bytes a parameter-server worker pulls per step of the click model, against what the step
needs: its batch's distinct table rows x D x 4 plus the dense variables' bytes.

  python scripts/bench/ctr_bytes.py --strata target/release/strata --rows 20000000 --records 51200

Runs `strata train --model ctr --strategy parameter-server --metrics` (each step record's
`bytes_received`: the tensor payloads the worker's pulls carried, f32) and `strata ctr-data` with
the same seed and records, computes each batch's distinct ids (batch b = records b*batch ..), and
compares the totals and the sorted per-step figures. Needs numpy (the peers' venv has it).
"""

import argparse
import json
import os
import subprocess
import tempfile

import numpy as np

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--strata", default="target/release/strata")
ap.add_argument("--rows", type=int, default=20_000_000)
ap.add_argument("--dim", type=int, default=16)
ap.add_argument("--records", type=int, default=51_200)
ap.add_argument("--batch", type=int, default=256)
ap.add_argument("--seed", type=int, default=0)
a = ap.parse_args()
tmp = tempfile.mkdtemp(prefix="ctr-bytes-")
metrics, out, data = os.path.join(tmp, "metrics.jsonl"), os.path.join(tmp, "s.json"), os.path.join(tmp, "data")
common = ["--embedding-rows", str(a.rows), "--train-records", str(a.records), "--seed", str(a.seed)]
subprocess.run([a.strata, "train", "--model", "ctr", "--strategy", "parameter-server", "--ps-tasks", "2",
                "--workers", "2", "--embedding-dim", str(a.dim), "--test-records", "2000", "--batch",
                str(a.batch), "--no-progress", "--metrics", metrics, "--out", out] + common, check=True,
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
subprocess.run([a.strata, "ctr-data", "--out", data, "--test-records", "1"] + common, check=True,
               stdout=subprocess.DEVNULL)
dense = json.load(open(out))["dense_gradient_bytes_per_step"]
steps = [json.loads(l) for l in open(metrics) if '"kind":"step"' in l]
ids = np.fromfile(os.path.join(data, "train.bin"), dtype=np.uint8).reshape(-1, 160)[:, 56:].copy().view("<u4")
ids = ids.reshape(-1, 26)
need = [len(np.unique(ids[b * a.batch:(b + 1) * a.batch])) * a.dim * 4 + dense for b in range(len(steps))]
got = [s["bytes_received"] for s in steps]
ratios = [g / n for g, n in zip(sorted(got), sorted(need))]
print(f"{len(steps)} steps of {a.batch} records, a {a.rows}-row table of {a.dim}; dense variables {dense} bytes")
print(f"mean distinct rows per step {np.mean([(n - dense) / (a.dim * 4) for n in need]):.1f}")
print(f"pulled {sum(got)} bytes, needed {sum(need)}: ratio {sum(got) / sum(need):.4f}")
print(f"per step (sorted): ratio {min(ratios):.4f} to {max(ratios):.4f}")

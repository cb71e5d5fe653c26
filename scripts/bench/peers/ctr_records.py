"""A FORMAT TEST FIXTURE for tf_ps_ctr.py: writes click-through records in exactly the layout
`strata ctr-data --out DIR` writes, from synthetic random data. It is NOT the benchmark's data:
records for comparisons with Strata come from `strata ctr-data` only.

  python scripts/bench/peers/ctr_records.py --out /tmp/ctr-fixture --rows 100000 \
      --train 200000 --test 20000 --seed 1

Layout (little-endian, 160 bytes a record, no header):
  label: f32 (0.0 or 1.0), dense: [f32; 13] (already log(1 + x)), ids: [u32; 26]
(global row ids into ONE table of `embedding_rows` rows), in DIR/train.bin and DIR/test.bin;
DIR/meta.json: records_train, records_test, embedding_rows, fields (26), dense (13), seed,
best_test_auc (and "fixture": true, which `strata ctr-data` does not write).

How the fixture's records are drawn (only so that a model has something to learn): the table's
rows are cut into 26 equal field ranges; field f's id is its range's start plus
floor(size * u^4), u uniform (a skewed draw: low ids recur often); dense values are log(1 + x)
of x exponential(1) counts; the label is Bernoulli(sigmoid(z)) with z a fixed function of the
record (a weight per row id from a hash of the id, plus a linear term of the dense values).
best_test_auc is the AUC of the true probabilities on the test records (what a perfect model
would reach).
"""

import argparse
import json
import os

import numpy as np

FIELDS, DENSE = 26, 13
RECORD = np.dtype([("label", "<f4"), ("dense", "<f4", (DENSE,)), ("ids", "<u4", (FIELDS,))])
assert RECORD.itemsize == 160


def row_weight(ids):
    """A fixed pseudo-random weight in about [-1.5, 1.5) for each row id (a hash of the id)."""
    h = (ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
    return (h.astype(np.float64) / float(1 << 24) - 0.5) * 3.0


def draw(rng, n, rows, dense_w):
    rec = np.zeros(n, RECORD)
    per = rows // FIELDS
    u = rng.random((n, FIELDS))
    ids = np.arange(FIELDS, dtype=np.int64)[None, :] * per + np.floor(per * u**4).astype(np.int64)
    dense = np.log1p(rng.exponential(1.0, (n, DENSE)))
    z = row_weight(ids).sum(axis=1) / np.sqrt(FIELDS) * 1.5 + (dense - 0.6) @ dense_w - 1.0
    p = 1.0 / (1.0 + np.exp(-z))
    rec["label"] = (rng.random(n) < p).astype(np.float32)
    rec["dense"] = dense
    rec["ids"] = ids.astype(np.uint32)
    return rec, p


def auc(y, s):
    order = np.argsort(s, kind="mergesort")
    s_sorted = s[order]
    _, first, counts = np.unique(s_sorted, return_index=True, return_counts=True)
    ranks = np.empty(len(s))
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)
    pos = y > 0.5
    npos, nneg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - npos * (npos + 1) / 2.0) / (npos * nneg))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=100_000, help="embedding_rows (at least 26)")
    ap.add_argument("--train", type=int, default=200_000)
    ap.add_argument("--test", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.rows < FIELDS:
        ap.error("--rows must be at least 26")
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    dense_w = rng.normal(0, 0.5, DENSE)
    chunk = 1 << 20
    for name, n in (("train", a.train), ("test", a.test)):
        probs, labels = [], []
        with open(os.path.join(a.out, f"{name}.bin"), "wb") as f:
            for start in range(0, n, chunk):
                rec, p = draw(rng, min(chunk, n - start), a.rows, dense_w)
                f.write(rec.tobytes())
                if name == "test":
                    probs.append(p)
                    labels.append(rec["label"])
    best = auc(np.concatenate(labels), np.concatenate(probs)) if a.test else None
    meta = {"records_train": a.train, "records_test": a.test, "embedding_rows": a.rows,
            "fields": FIELDS, "dense": DENSE, "seed": a.seed, "best_test_auc": best, "fixture": True}
    with open(os.path.join(a.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps(meta))


if __name__ == "__main__":
    main()

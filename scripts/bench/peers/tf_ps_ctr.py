"""TensorFlow 2.21 ParameterServerStrategy on a DLRM-style click-through model: one run, one JSON line.

  python scripts/bench/peers/tf_ps_ctr.py --data DIR [--ps 2 --workers 2 --seconds 30 ...]

Processes (real, on loopback, grpc): this script is the launcher and the chief (coordinator);
it starts --ps ps tasks and --workers worker tasks, each a `tf.distribute.Server` in a process
of its own (this file run with the internal --serve JOB:INDEX), with a `tf.train.ClusterSpec`
of free 127.0.0.1 ports; every process (chief too) has --threads intra-op and inter-op threads
(default 1), except that a worker task gets max(2, --threads) inter-op threads (--worker-inter-op
overrides): with 1 inter-op thread TF 2.21's PS worker deadlocks in its first step (measured;
the TF PS tutorial also says "workers need some inter_ops threads to work properly"). Every child is killed when the launcher exits: normally, on an error, on Ctrl-C /
SIGTERM / SIGHUP, at --timeout, or when a child dies early (the coordinator would otherwise
wait for a lost worker to come back).

Data: DIR as `strata ctr-data --out DIR` writes it: train.bin, test.bin (160-byte little-endian
records: label f32, dense [f32; 13], ids [u32; 26], ids global rows of ONE table) and meta.json
(records_train, records_test, embedding_rows, ...). Each worker reads its own contiguous shard
of train.bin, records [w * n / W, (w + 1) * n / W) for worker index w (TF 2.21's
`tf.distribute.coordinator.experimental_get_current_worker_index()` inside the dataset_fn of
`coordinator.create_per_worker_dataset`), streamed from the file by
`tf.data.FixedLengthRecordDataset` (header/footer bytes cut the shard; the worker never holds the
file), in file order, repeated. The chief reads test.bin with a numpy memmap, in chunks.
scripts/bench/peers/ctr_records.py writes a small format test fixture for trying this script.

Batch: TF's PS training is asynchronous; one scheduled step is one worker training on --batch
records (default 256) and sending its update to the ps tasks, with no synchronisation between
workers. `steps` counts such steps over all workers; examples_per_s = steps * batch / seconds,
the examples consumed per second by all workers together. (To match a synchronous global batch
G over W workers, pass --batch G/W.)

Model (Strata's CTR model, sizes by flags): one table embedding_rows x --dim, a Keras
`Embedding` created under the strategy's scope with a variable_partitioner that is
`FixedShardsPartitioner(num_ps)` for the table: a ShardedVariable of num_ps row ranges ("div":
the first rows % num_ps shards one row longer), one per ps task. (FixedShardsPartitioner alone
would cut every variable, the MLPs' kernels and biases too, into num_ps row ranges; here they
stay whole, placed round-robin over the ps tasks.) The 26 ids looked up in it; bottom MLP 13 -> 64 -> D (ReLU, ReLU);
pairwise dot products of the 27 vectors (the bottom output and the 26 embeddings: 351, i < j);
concat with the bottom output; top MLP (D + 351) -> 64 (ReLU) -> 1; sigmoid binary
cross-entropy with logits, mean over the step's batch. Keras' default initialisers (embedding
uniform(-0.05, 0.05), Dense glorot-uniform, zero biases).

The lookup (--lookup): `sparse` (default) calls `tf.nn.embedding_lookup` on the layer's
ShardedVariable: a gather on each ps task of only the rows looked up, and IndexedSlices
gradients per shard. `keras` calls the Keras 3 layer itself, whose `ops.take` converts the
variable to a tensor first: every step then reads the WHOLE table (all shards, concatenated)
into the worker; it is there to show that cost, not for comparisons.

Optimizer (--optimizer, --lr; default Adagrad 0.05): Keras 3's formulas (Strata's too), applied
with TensorFlow's resource ops on the ps task that holds each variable, sparse on the table:
  adagrad  acc += g^2; w -= lr g / (sqrt(acc) + 1e-7); acc starts at 0.1 (Keras' default).
           ResourceApplyAdagradV2 / ResourceSparseApplyAdagradV2 (a batch's duplicate ids summed
           first, as Keras 2's optimizers did).
  sgd      w -= lr g (ResourceApplyGradientDescent / ResourceScatterAdd).
  adam     beta 0.9, 0.999, eps 1e-7, bias-corrected with a shared step counter on a ps task
           (ResourceApplyAdam); on the table lazy: only the rows of the batch have their moments
           and values updated (as TF Addons' LazyAdam).
Keras 3's own optimizers are not used: their Adagrad computes sqrt(acc + eps) over the whole
accumulator every step (a dense read of a table-sized slot).

Timing: --warmup steps (tracing, dataset creation), coordinator.join(), then steps are scheduled
for --seconds (or --steps) with at most 4 per worker in flight, then join(): examples_per_s is
the steps completed over that time. Then test AUC on all of test.bin (or --eval-records), the
model evaluated on the chief (the variables read from the ps tasks): AUC computed in numpy,
rank-based (Mann-Whitney) with tied scores given their average rank.

Output, one JSON line:
  {"framework": "tensorflow", "config": "ps", "ps": 2, "workers": 2, "examples_per_s": ...,
   "test_auc": ..., "steps": ..., "batch": ..., "embedding_rows": ..., "dim": ...,
   "optimizer": ..., "lr": ..., "tf_version": ..., "keras": ..., "threads": ..., "seconds": ...,
   "lookup": ..., "best_test_auc": ..., "train_loss": ...,
   "rss_peak_mib": {"chief": ..., "ps": [...], "worker": [...]}, "table_mib": ...}
rss_peak_mib: each process's VmHWM (/proc/PID/status) just before the children are ended.
Workers hold no table (their peak is that of a TensorFlow process, the same with 100k rows or
20M); the ps tasks hold their shard and its slots. The chief's peak comes from creating the
table: TF's PS strategy evaluates a variable's initial value on the coordinator and sends it to
the ps task, and Keras 3 calls its initializer without the partition arguments, so the whole
table's initial value is made once per shard and sliced (TF logs a warning about it).

Not wired into scripts/bench/peers.sh: run.py's configurations are (script, --config, processes
with TF_CONFIG it starts) over Strata's --model set; this script starts its own cluster and
reads `strata ctr-data` records, so it is run directly:

  strata ctr-data --out /tmp/ctr ...            # the records (see that command's --help)
  ~/.cache/strata/peers-venv/bin/python scripts/bench/peers/tf_ps_ctr.py --data /tmp/ctr \
      --ps 2 --workers 2 --seconds 30
(the venv as scripts/bench/peers.sh makes it: pip install 'tensorflow-cpu==2.21.*').
"""

import argparse
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

RECORD_BYTES, FIELDS, DENSE = 160, 26, 13
FLOATS = RECORD_BYTES // 4  # 40: label, 13 dense, 26 ids


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="directory of train.bin, test.bin, meta.json (strata ctr-data --out)")
    ap.add_argument("--ps", type=int, default=2, help="ps tasks")
    ap.add_argument("--workers", type=int, default=2, help="worker tasks")
    ap.add_argument("--threads", type=int, default=1, help="intra-op and inter-op threads of every process")
    ap.add_argument("--worker-inter-op", type=int, default=0,
                    help="inter-op threads of a worker task (default max(2, --threads): with 1, TF 2.21's PS worker deadlocks)")
    ap.add_argument("--batch", type=int, default=256, help="records of one step (one worker's batch)")
    ap.add_argument("--dim", type=int, default=16, help="embedding dimension D")
    ap.add_argument("--optimizer", choices=("adagrad", "sgd", "adam"), default="adagrad")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--lookup", choices=("sparse", "keras"), default="sparse")
    ap.add_argument("--seconds", type=float, default=30.0, help="timed steady state, seconds")
    ap.add_argument("--steps", type=int, default=0, help="timed steps (over all workers) instead of --seconds")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    ap.add_argument("--eval-records", type=int, default=0, help="test records to evaluate (0: all)")
    ap.add_argument("--eval-batch", type=int, default=8192)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds the whole run may take")
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # internal: JOB:INDEX of a server process
    ap.add_argument("--cluster", help=argparse.SUPPRESS)  # internal: the cluster spec, JSON
    a = ap.parse_args()
    if not a.serve and not a.data:
        ap.error("--data is required")
    return a


def set_threads(tf, n):
    tf.config.threading.set_intra_op_parallelism_threads(n)
    tf.config.threading.set_inter_op_parallelism_threads(n)


def serve(a):
    """A ps or worker task: a tf.distribute.Server until killed."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    job, index = a.serve.split(":")
    inter = a.threads if job != "worker" else (a.worker_inter_op or max(2, a.threads))
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=a.threads,
                                      inter_op_parallelism_threads=inter)
    server = tf.distribute.Server(tf.train.ClusterSpec(json.loads(a.cluster)), job_name=job,
                                  task_index=int(index), protocol="grpc", config=config, start=True)
    server.join()


# ---- the launcher's children ---------------------------------------------------------------

children = []  # (job, index, Popen, stderr file)
stopping = threading.Event()


def kill_children():
    stopping.set()
    for _, _, p, _ in children:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for _, _, p, _ in children:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def die(msg, code=1):
    print(f"tf_ps_ctr: {msg}", file=sys.stderr, flush=True)
    kill_children()
    os._exit(code)  # the coordinator's threads would keep the interpreter alive


def tail(f, lines=5):
    try:
        f.flush()
        f.seek(0)
        text = [x for x in f.read().splitlines() if x.strip()]
        return " | ".join(text[-lines:])
    except (OSError, ValueError):
        return ""


def watch_children():
    while not stopping.wait(0.5):
        for job, index, p, err in children:
            if p.poll() is not None and not stopping.is_set():
                die(f"{job} task {index} exited with {p.returncode}: {tail(err)}")


def free_ports(n):
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def peak_rss_mib(pid="self"):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024.0, 1)
    except OSError:
        pass
    return None


def auc(y, s):
    """Rank-based AUC (Mann-Whitney U), tied scores given their average rank."""
    import numpy as np
    order = np.argsort(s, kind="mergesort")
    _, first, counts = np.unique(s[order], return_index=True, return_counts=True)
    ranks = np.empty(len(s))
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)
    pos = y > 0.5
    npos, nneg = int(pos.sum()), int((~pos).sum())
    if npos == 0 or nneg == 0:
        return None
    return float((ranks[pos].sum() - npos * (npos + 1) / 2.0) / (npos * nneg))


def main():
    a = parse_args()
    if a.serve:
        serve(a)
        return

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda signum, _f: die(f"signal {signum}", 128 + signum))
    signal.signal(signal.SIGALRM, lambda *_: die(f"timed out after {a.timeout:.0f} s", 124))
    signal.alarm(max(1, int(a.timeout)))

    meta = json.load(open(os.path.join(a.data, "meta.json")))
    n_train, n_test, rows = int(meta["records_train"]), int(meta["records_test"]), int(meta["embedding_rows"])
    if meta.get("fields", FIELDS) != FIELDS or meta.get("dense", DENSE) != DENSE:
        die(f"meta.json has fields {meta.get('fields')}, dense {meta.get('dense')}: this script reads 26 and 13")
    train_path, test_path = os.path.join(a.data, "train.bin"), os.path.join(a.data, "test.bin")
    for path, n in ((train_path, n_train), (test_path, n_test)):
        if os.path.getsize(path) != n * RECORD_BYTES:
            die(f"{path}: {os.path.getsize(path)} bytes, meta.json says {n} records of {RECORD_BYTES}")
    if n_train // a.workers < a.batch:
        die(f"{n_train} training records cannot give {a.workers} workers a batch of {a.batch} each")

    ports = free_ports(1 + a.ps + a.workers)
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"],
               "ps": [f"127.0.0.1:{p}" for p in ports[1:1 + a.ps]],
               "worker": [f"127.0.0.1:{p}" for p in ports[1 + a.ps:]]}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    env.pop("TF_CONFIG", None)
    try:
        for job in ("ps", "worker"):
            for i in range(len(cluster[job])):
                err = tempfile.TemporaryFile("w+")
                p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", f"{job}:{i}",
                                      "--cluster", json.dumps(cluster), "--threads", str(a.threads),
                                      "--worker-inter-op", str(a.worker_inter_op)],
                                     env=env, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                     text=True, start_new_session=True)
                children.append((job, i, p, err))
        threading.Thread(target=watch_children, daemon=True).start()
        result = run_chief(a, cluster, n_train, n_test, rows, meta, train_path, test_path)
    except BaseException as e:  # noqa: BLE001 - every failure ends the children
        import traceback
        traceback.print_exc()
        die(f"{type(e).__name__}: {e}")
    print(json.dumps(result), flush=True)
    kill_children()
    os._exit(0)


def run_chief(a, cluster, n_train, n_test, rows, meta, train_path, test_path):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    import keras

    set_threads(tf, a.threads)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
    fixed = tf.distribute.experimental.partitioners.FixedShardsPartitioner(a.ps)

    def partitioner(shape, dtype):
        # FixedShardsPartitioner alone would cut EVERY variable of rank >= 1 (the MLPs' kernels and
        # biases too) into num_ps row ranges; only the table is sharded here, the rest placed
        # whole, round-robin over the ps tasks.
        return fixed(shape, dtype) if tuple(shape) == (rows, a.dim) else [1] * shape.rank

    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    D, B, W = a.dim, a.batch, a.workers
    L = keras.layers

    t_build = time.perf_counter()
    with strategy.scope():
        emb = L.Embedding(rows, D, name="table")
        emb.build((None, FIELDS))
        bot1, bot2 = L.Dense(64, activation="relu"), L.Dense(D, activation="relu")
        top1, top2 = L.Dense(64, activation="relu"), L.Dense(1)
        for layer, width in ((bot1, DENSE), (bot2, 64), (top1, D + FIELDS * (FIELDS + 1) // 2), (top2, 64)):
            layer.build((None, width))
    table = emb.embeddings.value  # the tf.Variable under the Keras variable: a ShardedVariable
    shards = list(table.variables) if hasattr(table, "variables") else [table]
    dense_vars = [v.value for layer in (bot1, bot2, top1, top2) for v in layer.trainable_weights]
    assert not any(hasattr(v, "variables") for v in dense_vars), "an MLP variable was sharded"
    build_s = time.perf_counter() - t_build
    print(f"tf_ps_ctr: table {type(table).__name__}: " + ", ".join(
        f"{s.shape[0]} rows on {s.device}" for s in shards) + f" (built in {build_s:.1f} s)", file=sys.stderr, flush=True)

    # The optimizer's slots, each on the ps task of its variable.
    opt = a.optimizer
    eps = 1e-7
    slots = {}

    def slot(shape, value):  # a callable initial value, colocated with its variable (caller)
        return tf.Variable(lambda: tf.fill(shape, value), shape=shape, dtype=tf.float32, trainable=False)

    with strategy.scope():
        step_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="adam_t") if opt == "adam" else None
        for v in shards + dense_vars:
            with strategy.extended.colocate_vars_with(v):
                if opt == "adagrad":
                    slots[v.ref()] = (slot(v.shape, 0.1),)
                elif opt == "adam":
                    slots[v.ref()] = (slot(v.shape, 0.0), slot(v.shape, 0.0))
    lr = tf.constant(a.lr, tf.float32)
    b1, b2 = 0.9, 0.999

    def apply(grads, variables):
        if opt == "adam":
            t = tf.cast(step_var.assign_add(1), tf.float32)
            b1p, b2p = tf.pow(b1, t), tf.pow(b2, t)
            alpha = lr * tf.sqrt(1.0 - b2p) / (1.0 - b1p)
        for g, v in zip(grads, variables):
            s = slots.get(v.ref(), ())
            if isinstance(g, tf.IndexedSlices):
                uniq, pos = tf.unique(g.indices)
                vals = tf.math.unsorted_segment_sum(g.values, pos, tf.size(uniq))
                if opt == "adagrad":
                    tf.raw_ops.ResourceSparseApplyAdagradV2(var=v.handle, accum=s[0].handle, lr=lr, epsilon=eps,
                                                            grad=vals, indices=uniq)
                elif opt == "sgd":
                    v.scatter_sub(tf.IndexedSlices(lr * vals, uniq))
                else:  # lazy Adam: the batch's rows only
                    m = s[0].sparse_read(uniq) * b1 + (1 - b1) * vals
                    u = s[1].sparse_read(uniq) * b2 + (1 - b2) * tf.square(vals)
                    s[0].scatter_update(tf.IndexedSlices(m, uniq))
                    s[1].scatter_update(tf.IndexedSlices(u, uniq))
                    v.scatter_sub(tf.IndexedSlices(alpha * m / (tf.sqrt(u) + eps), uniq))
            elif opt == "adagrad":
                tf.raw_ops.ResourceApplyAdagradV2(var=v.handle, accum=s[0].handle, lr=lr, epsilon=eps, grad=g)
            elif opt == "sgd":
                tf.raw_ops.ResourceApplyGradientDescent(var=v.handle, alpha=lr, delta=g)
            else:
                tf.raw_ops.ResourceApplyAdam(var=v.handle, m=s[0].handle, v=s[1].handle, beta1_power=b1p,
                                             beta2_power=b2p, lr=lr, beta1=b1, beta2=b2, epsilon=eps, grad=g)

    iu, ju = np.triu_indices(FIELDS + 1, k=1)
    pairs = tf.constant(iu * (FIELDS + 1) + ju, tf.int32)  # 351 flat indices of i < j

    def forward(dense, ids):
        bottom = bot2(bot1(dense))
        if a.lookup == "sparse":
            e = tf.nn.embedding_lookup(table, ids)  # per-shard gathers on the ps tasks
        else:
            e = emb(ids)  # Keras 3: ops.take(convert_to_tensor(table)): the whole table
        vecs = tf.concat([bottom[:, None, :], e], axis=1)  # B, 27, D
        z = tf.reshape(tf.matmul(vecs, vecs, transpose_b=True), (-1, (FIELDS + 1) ** 2))
        x = tf.concat([bottom, tf.gather(z, pairs, axis=1)], axis=1)
        return top2(top1(x))[:, 0]

    def decode(raw):
        f = tf.io.decode_raw(raw, tf.float32)  # B, 40 (little-endian, as the file)
        ids = tf.io.decode_raw(raw, tf.int32)[:, 1 + DENSE:]  # u32 ids < 2^31
        return f[:, 0], f[:, 1:1 + DENSE], ids

    def dataset_fn():
        w = tf.cast(tf.distribute.coordinator.experimental_get_current_worker_index(), tf.int64)
        start, end = w * n_train // W, (w + 1) * n_train // W
        ds = tf.data.FixedLengthRecordDataset(train_path, RECORD_BYTES, header_bytes=start * RECORD_BYTES,
                                              footer_bytes=(n_train - end) * RECORD_BYTES, buffer_size=1 << 20)
        return ds.repeat().batch(B, drop_remainder=True).map(decode).prefetch(2)

    train_vars = shards + dense_vars
    grad_kinds = set()

    @tf.function
    def train_step(it):
        def replica_fn(batch):
            label, dense, ids = batch
            with tf.GradientTape() as tape:
                logits = forward(dense, ids)
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=label, logits=logits))
            grads = tape.gradient(loss, train_vars)
            grad_kinds.update(type(g).__name__ for g in grads[:len(shards)])  # at tracing
            apply(grads, train_vars)
            return loss
        return strategy.run(replica_fn, args=(next(it),))

    per_worker = coordinator.create_per_worker_dataset(dataset_fn)
    it = iter(per_worker)

    t_warm = time.perf_counter()
    for _ in range(a.warmup):
        coordinator.schedule(train_step, args=(it,))
    coordinator.join()
    warm_s = time.perf_counter() - t_warm

    inflight = collections.deque()
    losses = []
    n = 0
    t0 = time.perf_counter()
    while True:
        inflight.append(coordinator.schedule(train_step, args=(it,)))
        n += 1
        if len(inflight) > 4 * W:
            losses.append(float(inflight.popleft().fetch()))
        if a.steps:
            if n >= a.steps:
                break
        elif time.perf_counter() - t0 >= a.seconds:
            break
    coordinator.join()
    elapsed = time.perf_counter() - t0
    losses += [float(r.fetch()) for r in inflight]
    rss = {"chief": None, "ps": [], "worker": []}
    for job, _, p, _ in children:
        rss[job].append(peak_rss_mib(p.pid))
    print(f"tf_ps_ctr: {n} steps in {elapsed:.1f} s ({n * B / elapsed:,.0f} examples/s), warm-up {warm_s:.1f} s, "
          f"worker peak RSS {rss['worker']} MiB", file=sys.stderr, flush=True)

    # Test AUC, evaluated on the chief.
    predict = tf.function(lambda d, i: tf.sigmoid(forward(d, i)))
    test = np.memmap(test_path, dtype="<f4", mode="r", shape=(n_test, FLOATS))
    n_eval = min(n_test, a.eval_records) if a.eval_records else n_test
    scores, labels = [], []
    t_eval = time.perf_counter()
    for s in range(0, n_eval, a.eval_batch):
        chunk = np.array(test[s:min(n_eval, s + a.eval_batch)])
        ids = chunk[:, 1 + DENSE:].view("<u4").astype(np.int32)
        scores.append(predict(tf.constant(chunk[:, 1:1 + DENSE]), tf.constant(ids)).numpy())
        labels.append(chunk[:, 0])
    del test
    test_auc = auc(np.concatenate(labels), np.concatenate(scores).astype(np.float64)) if n_eval else None
    eval_s = time.perf_counter() - t_eval
    rss = {"chief": peak_rss_mib(), "ps": [], "worker": []}
    for job, _, p, _ in children:
        rss[job].append(peak_rss_mib(p.pid))
    return {
        "framework": "tensorflow", "config": "ps", "ps": a.ps, "workers": W,
        "examples_per_s": n * B / elapsed, "test_auc": test_auc, "steps": n, "batch": B,
        "embedding_rows": rows, "dim": D, "optimizer": opt, "lr": a.lr,
        "tf_version": tf.__version__, "keras": keras.__version__, "threads": a.threads,
        "seconds": elapsed, "warmup_steps": a.warmup, "lookup": a.lookup,
        "eval_records": n_eval, "eval_seconds": eval_s, "best_test_auc": meta.get("best_test_auc"),
        "train_loss": float(np.mean(losses[-max(1, len(losses) // 10):])) if losses else None,
        "table_grad": "/".join(sorted(grad_kinds)), "rss_peak_mib": rss, "table_mib": round(rows * D * 4 / 2**20, 1), "build_seconds": build_s,
    }


if __name__ == "__main__":
    main()

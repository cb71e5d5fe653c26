"""TensorFlow 2.21 (Keras 3) on Strata's models: one configuration per process, one JSON line.

  --config one-device   OneDeviceStrategy("/cpu:0"), TensorFlow's default thread pools
  --config mirrored     MirroredStrategy over 2 logical CPUs (set_logical_device_configuration)
  --config mwms         MultiWorkerMirroredStrategy; run by the launcher as 2 processes with
                        TF_CONFIG on loopback, 1 intra-op and 1 inter-op thread each (--threads)

A custom training loop (the tf.distribute guide's): a tf.function runs one global step through
strategy.run; per-replica batches of 256 / replicas come from distribute_datasets_from_function;
the loss is averaged over the global batch; Keras' AdamW reduces the gradients across replicas.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

ap = common.common_args(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
ap.add_argument("--config", choices=("one-device", "mirrored", "mwms"), required=True)
ap.add_argument("--replicas", type=int, default=2, help="logical CPUs of mirrored")
ap.add_argument("--threads", type=int, default=0, help="intra- and inter-op threads (0: TensorFlow's default; mwms: 1)")
args = ap.parse_args()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

threads = args.threads or (1 if args.config == "mwms" else 0)
if threads:
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)

if args.config == "one-device":
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
elif args.config == "mirrored":
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.replicas)])
else:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
replicas = strategy.num_replicas_in_sync
tf_config = json.loads(os.environ.get("TF_CONFIG", "{}"))
chief = tf_config.get("task", {}).get("index", 0) == 0

layers = keras.layers


class Block(layers.Layer):
    """Pre-layer-norm decoder block: causal multi-head self-attention, then a 4x gelu MLP."""

    def __init__(self, width, heads, **kw):
        super().__init__(**kw)
        self.width, self.heads = width, heads
        self.ln1, self.ln2 = layers.LayerNormalization(epsilon=1e-5), layers.LayerNormalization(epsilon=1e-5)
        self.qkv, self.proj = layers.Dense(3 * width), layers.Dense(width)
        self.fc, self.out = layers.Dense(4 * width, activation="gelu"), layers.Dense(width)

    def call(self, x):
        b, t = tf.shape(x)[0], tf.shape(x)[1]
        h, d = self.heads, self.width // self.heads
        qkv = tf.reshape(self.qkv(self.ln1(x)), (b, t, 3, h, d))
        qkv = tf.transpose(qkv, (2, 0, 3, 1, 4))  # 3, b, h, t, d
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = tf.matmul(q, k, transpose_b=True) * (1.0 / d**0.5)
        mask = tf.linalg.band_part(tf.ones((t, t)), -1, 0)
        att = tf.nn.softmax(att + (1.0 - mask) * -1e9, axis=-1)
        y = tf.reshape(tf.transpose(tf.matmul(att, v), (0, 2, 1, 3)), (b, t, self.width))
        x = x + self.proj(y)
        return x + self.out(self.fc(self.ln2(x)))


class Transformer(keras.Model):
    def __init__(self, vocab):
        super().__init__()
        self.tok = layers.Embedding(vocab, common.T_WIDTH)
        self.pos = layers.Embedding(common.T_CONTEXT, common.T_WIDTH)
        self.blocks = [Block(common.T_WIDTH, common.T_HEADS) for _ in range(common.T_LAYERS)]
        self.ln = layers.LayerNormalization(epsilon=1e-5)
        self.head = layers.Dense(vocab)

    def call(self, x):
        x = self.tok(x) + self.pos(tf.range(tf.shape(x)[1]))[None]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def build(model, vocab):
    if model in common.HIDDEN:
        h1, h2 = common.HIDDEN[model]
        return keras.Sequential([keras.Input((64,)), layers.Dense(h1, activation="relu"),
                                 layers.Dense(h2, activation="relu"), layers.Dense(10)])
    if model == "cnn":
        return keras.Sequential([
            keras.Input((64,)), layers.Reshape((8, 8, 1)),
            layers.Conv2D(16, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),
            layers.Conv2D(32, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),
            layers.Flatten(), layers.Dense(64, activation="relu"), layers.Dense(10)])
    m = Transformer(vocab)
    m(np.zeros((1, common.T_CONTEXT), dtype=np.int64))
    return m


if args.model == "transformer":
    vocab, batches = common.shakespeare_batches()
else:
    vocab, batches = 10, common.digits_batches()
global_batch = len(batches[0][0])
per_replica = global_batch // replicas


def dataset_fn(ctx):
    # This input pipeline's replicas, in order: per-replica slices of every global batch.
    first = ctx.input_pipeline_id * (replicas // ctx.num_input_pipelines)
    local = replicas // ctx.num_input_pipelines
    xs, ys = [], []
    for b in batches:
        for r in range(first, first + local):
            x, y = common.split(b, replicas, r)
            xs.append(x)
            ys.append(y)
    ds = tf.data.Dataset.from_tensor_slices((np.stack(xs), np.stack(ys)))
    return ds.cache().repeat().prefetch(tf.data.AUTOTUNE)


with strategy.scope():
    model = build(args.model, vocab)
    opt = keras.optimizers.AdamW(learning_rate=common.LR[args.model], weight_decay=common.WEIGHT_DECAY)
    opt.build(model.trainable_variables)

dist = iter(strategy.distribute_datasets_from_function(dataset_fn))


def replica_step(x, y):
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        if args.model == "transformer":
            per_example = tf.reduce_mean(per_example, axis=-1)
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss


@tf.function
def train_step(it):
    x, y = next(it)
    return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=(x, y)), axis=None)


@tf.function
def any_stop(flag):
    v = strategy.run(lambda: tf.constant(flag, tf.float32))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, v, axis=None)  # any worker done: > 0


def step(_):
    train_step(dist).numpy()


agree = None
if args.config == "mwms":
    agree = lambda local: bool(any_stop(1.0 if local else 0.0).numpy() > 0)  # noqa: E731

n, dt = common.timed_loop(step, args.warmup, args.seconds, args.steps, agree)
if chief:
    common.report("tensorflow", tf.__version__, args.config, args.model, n, dt,
                  {"replicas": replicas, "threads": threads or "default", "keras": keras.__version__})

//! `strata bench train`: training throughput and peak RSS of one device, Mirrored(K) and
//! MultiWorkerMirrored (K worker processes of one replica each, over loopback) on the benchmark
//! models (the MLPs `small` and `large`, the digits `cnn` and the character `transformer`),
//! beside the machine's compute ceiling measured in the same run.
//!
//! The ceiling is what this machine gives K independent single-thread copies of the same
//! per-replica step (forward, loss, backward and optimizer step on `global / K` examples)
//! running at once, with plain candle and no Strata in the loop. Mirrored(K) divided by it is
//! the share of the machine Strata delivers; `1 - that` is Strata's overhead (reduction,
//! synchronisation). Every configuration runs in its own process (this binary, re-invoked), so
//! peak RSS is per configuration, and the rounds interleave the configurations so that a
//! noisy neighbour hurts all of them alike; medians over rounds are reported.
//!
//! `--freeze` freezes variables by name (`layer0.*`, as `Replicated::freeze` takes them) in
//! every configuration (the ceiling's optimizer then updates only the others); each row prints
//! the bytes reduced per step: what each Mirrored replica hands to the all-reduce (counted by a
//! wrapper around the in-memory all-reduce), or what a multi-worker worker sends on the ring.
//! Frozen variables are never reduced, so the bytes fall by exactly their share.
//!
//! The compute limit is the matmul throughput of K threads at once (K single-thread candle
//! matmuls of 2048x2048 by 2048x2048 f32, the shape of the large MLP's hidden layer, through
//! the same backend the models use), measured in the same run, divided by the model's FLOPs per
//! example (6 per weight: 2 forward, 4 backward); `of limit` is a row's share of it. A one-device
//! row runs one thread, so its share is of `limit/1`, the same product on one thread alone (the
//! other cores idle: what that thread has), not of K threads' limit. Ratios to
//! other frameworks come only from `scripts/bench/peers.sh`, which runs them side by side.

use std::process::Command;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap, SGD};
use serde::{Deserialize, Serialize};
use strata_core::data::{Batch, BatchData, DistributedBatch};
use strata_core::optim::{FusedAdamW, FusedSgd, OptimizerMemory};
use strata_core::{Strategy, ZeroStage};
use strata_strategies::{MirroredStrategy, OneDeviceStrategy};

use strata::cnn::Cnn;
use strata::digits::{self, CLASSES, FEATURES};
use strata::model::{Classifier, Mlp};
use strata::shakespeare;
use strata::transformer::{CharTransformer, TransformerConfig};
use strata::OptimizerKind;

use crate::kinds::kind_parser;
use crate::{Error, Result};

/// The configuration that measures the limit of one thread alone.
const LIMIT_ONE: &str = "limit/1";

/// The side of the square matmuls that measure the compute limit.
const LIMIT_MATMUL: usize = 2048;

/// `strata bench train` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchTrainArgs {
    /// Replicas of Mirrored (and copies in the ceiling).
    #[arg(long, default_value_t = 2)]
    pub replicas: usize,
    /// Models (`--model` works too): the MLPs `small` (64-256-256-10, 85k parameters) and
    /// `large` (64-2048-2048-10, 4.3M), `mlp` (both), `cnn` (the digits CNN, 13.7k) and
    /// `transformer` (the character model, 0.82M, on Tiny Shakespeare; reported in tokens/s).
    #[arg(long, alias = "model", default_value = "small,large", value_delimiter = ',')]
    pub models: Vec<String>,
    /// Rounds; medians over rounds are reported.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Seconds each measurement runs (after 3 warm-up steps).
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    /// Global batch [default: 256 examples; 32 windows of 64 characters for the transformer].
    #[arg(long)]
    pub batch: Option<usize>,
    /// Optimizer (the ceiling uses the same one): `adamw` is the fused, in-place AdamW.
    #[arg(long, default_value = "adamw", value_parser = kind_parser::<OptimizerKind>())]
    pub optimizer: OptimizerKind,
    /// After every execution, agree whether to stop as `strata train` does (its SIGTERM
    /// handling: one all-reduce of one number across workers), to measure what that costs.
    #[arg(long)]
    pub stop_check: bool,
    /// Freeze the variables matching these names (`layer1.*`, comma-separated) in every
    /// configuration: they are neither reduced nor updated.
    #[arg(long, value_delimiter = ',')]
    pub freeze: Vec<String>,
    /// ZeRO stages to measure Mirrored and MultiWorkerMirrored at (`0,1,2,3`: side by side);
    /// each row prints the bytes of parameters, gradients and optimizer state per replica.
    #[arg(long, value_delimiter = ',', default_value = "0", value_parser = parse_zero_stage)]
    pub zero_stages: Vec<ZeroStage>,
    /// Also measure one-device and mirrored (at each of --zero-stages) recomputing
    /// activations in the backward pass (`strata train --recompute`: the MLPs' hidden layers,
    /// the transformer's blocks), rows `+recompute` beside the same configurations keeping them.
    #[arg(long)]
    pub recompute: bool,
    /// Also measure one-device and mirrored computing in these types besides f32 (`bf16`,
    /// `fp16`: mixed precision, `strata train --precision`, fp16 with loss scaling), rows
    /// `+bf16` and `+fp16` beside the same configurations in f32.
    #[arg(long, value_delimiter = ',', default_value = "f32", value_parser = str::parse::<strata::Precision>)]
    pub precisions: Vec<strata::Precision>,
    /// Internal: measure one `MODEL:CONFIG` in this process and print JSON.
    #[arg(long, hide = true)]
    pub worker: Option<String>,
}

/// One measurement.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Measurement {
    /// Examples per second.
    pub examples_per_second: f64,
    /// Mean seconds per global step (per per-replica step for the ceiling).
    pub step_seconds: f64,
    /// Peak resident set size of the process, bytes.
    pub peak_rss_bytes: u64,
    /// Bytes reduced per training step: each Mirrored replica's input to the all-reduce, or
    /// what a multi-worker worker sends on the ring (0 where nothing is reduced).
    #[serde(default)]
    pub reduced_bytes_per_step: f64,
    /// The `limit` configuration's matmul GFLOP/s of K threads at once (0 elsewhere).
    #[serde(default)]
    pub gflops: f64,
    /// Bytes of one replica's parameters, reduced gradients and optimizer state (replica 0's;
    /// 0 for the ceiling and the limit).
    #[serde(default)]
    pub replica_bytes: ReplicaBytes,
}

/// What one replica keeps, in bytes.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct ReplicaBytes {
    /// Its copy of the trainable parameters.
    pub params: u64,
    /// Its reduced gradients.
    pub grads: u64,
    /// Its optimizer's state (AdamW's two moments; SGD has none).
    pub optimizer: u64,
    /// The most any replica held at once in a step, counted by the strategy (parameters as
    /// resident, gradients, optimizer state and activations;
    /// `DistributedOptimizer::peak_replica_bytes`), beside the computed figures above.
    #[serde(default)]
    pub measured: u64,
}

fn parse_zero_stage(s: &str) -> std::result::Result<ZeroStage, String> {
    s.parse::<ZeroStage>().map_err(|e| e.to_string())
}

/// Optimizer state elements per element stepped.
fn state_per_element(o: OptimizerKind) -> u64 {
    match o {
        OptimizerKind::Adamw | OptimizerKind::CandleAdamw => 2,
        _ => 0,
    }
}

/// The in-memory all-reduce, counting the elements replica 0 hands it.
#[derive(Debug)]
struct Counting {
    inner: strata_core::cross_device::CpuCrossDeviceOps,
    elements: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl strata_core::cross_device::CrossDeviceOps for Counting {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn reduce(
        &self,
        req: strata_core::cross_device::ReduceRequest<'_>,
        out: &mut dyn FnMut(&[f32]),
    ) -> strata_core::Result<()> {
        if req.replica == 0 {
            self.elements.fetch_add(req.len() as u64, std::sync::atomic::Ordering::Relaxed);
        }
        self.inner.reduce(req, out)
    }
    fn takes_row_blocks(&self) -> bool {
        self.inner.takes_row_blocks()
    }
    fn sums_in_step(&self, replica: usize, elements: usize) -> bool {
        let sums = self.inner.sums_in_step(replica, elements);
        if sums && replica == 0 {
            self.elements.fetch_add(elements as u64, std::sync::atomic::Ordering::Relaxed);
        }
        sums
    }
}

/// A benchmark model: its shape, its data and what one of its training examples costs.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum BenchModel {
    /// An MLP on the digits: its name (`small`, `large`) and hidden layers.
    Mlp(&'static str, Vec<usize>),
    /// [`Cnn`] on the digits.
    Cnn,
    /// [`CharTransformer`] (the default shape) on Tiny Shakespeare.
    Transformer(TransformerConfig),
}

/// The transformer whose model state, not its activations, fills a replica's memory at a small
/// batch (`strata train --model transformer --width 512 --layers 8 --heads 8`: 25.3M
/// parameters): ZeRO's benchmark model.
const TRANSFORMER_25M: TransformerConfig =
    TransformerConfig { width: 512, layers: 8, heads: 8, ..TransformerConfig::DEFAULT };

impl BenchModel {
    /// The models a `--models` entry names (`mlp` is both MLPs).
    pub(crate) fn parse(name: &str) -> Result<Vec<Self>> {
        Ok(match name {
            "small" => vec![Self::Mlp("small", vec![256, 256])],
            "large" => vec![Self::Mlp("large", vec![2048, 2048])],
            "mlp" => vec![Self::Mlp("small", vec![256, 256]), Self::Mlp("large", vec![2048, 2048])],
            "cnn" => vec![Self::Cnn],
            "transformer" => vec![Self::Transformer(TransformerConfig::default())],
            "transformer-25m" => vec![Self::Transformer(TRANSFORMER_25M)],
            _ => {
                return Err(Error::Usage(format!(
                    "unknown model {name:?}: use small, large, mlp (both), cnn, transformer or transformer-25m"
                )))
            }
        })
    }

    /// The model named `name` (one of [`Self::parse`]'s single models).
    pub(crate) fn one(name: &str) -> Result<Self> {
        let mut v = Self::parse(name)?;
        match v.len() {
            1 => Ok(v.remove(0)),
            _ => Err(Error::Usage(format!("bad worker model {name:?}"))),
        }
    }

    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::Mlp(name, _) => name,
            Self::Cnn => "cnn",
            Self::Transformer(c) if *c == TRANSFORMER_25M => "transformer-25m",
            Self::Transformer(_) => "transformer",
        }
    }

    fn parameter_count(&self) -> usize {
        match self {
            Self::Mlp(_, hidden) => Mlp::parameter_count(FEATURES, hidden, CLASSES),
            Self::Cnn => Cnn::parameter_count(),
            Self::Transformer(c) => c.parameter_count(),
        }
    }

    /// The global batch without `--batch`: 256 examples, or 32 windows for the transformer.
    pub(crate) fn default_batch(&self) -> usize {
        match self {
            Self::Transformer(_) => 32,
            _ => 256,
        }
    }

    /// What the rates count: examples, or tokens (characters) for the transformer.
    fn unit(&self) -> &'static str {
        match self {
            Self::Transformer(_) => "tokens/s",
            _ => "examples/s",
        }
    }

    /// Units (examples or tokens) in one example (row) of a batch.
    fn units_per_example(&self) -> usize {
        match self {
            Self::Transformer(c) => c.context,
            _ => 1,
        }
    }

    /// FLOPs of training on one unit (example or token): 6 per multiply-add of the forward
    /// pass (2 forward, 4 backward: the input's gradient and the weight's). The transformer
    /// counts its dense layers and head, and the attention's two products over the whole
    /// `context x context` square it computes.
    pub(crate) fn flops_per_unit(&self) -> f64 {
        match self {
            Self::Mlp(_, hidden) => {
                let dims: Vec<usize> =
                    std::iter::once(FEATURES).chain(hidden.iter().copied()).chain([CLASSES]).collect();
                6.0 * dims.windows(2).map(|w| (w[0] * w[1]) as f64).sum::<f64>()
            }
            Self::Cnn => {
                let side = strata::cnn::SIDE;
                let conv1 = side * side * 16 * 9;
                let conv2 = (side / 2) * (side / 2) * 32 * 16 * 9;
                6.0 * (conv1 + conv2 + 128 * 64 + 64 * CLASSES) as f64
            }
            Self::Transformer(c) => {
                let (d, l, t, v) = (c.width as f64, c.layers as f64, c.context as f64, c.vocab as f64);
                6.0 * (l * 12.0 * d * d + d * v) + 12.0 * l * t * d
            }
        }
    }
}

/// How a benchmark model is built, fed and scored, for the strategies and the ceiling alike.
trait Workload: Sync {
    type Model: Send + Sync;
    type B: BatchData + Clone + Send + Sync;
    fn build(&self, vb: VarBuilder) -> candle_core::Result<Self::Model>;
    fn loss(&self, model: &Self::Model, batch: &Self::B, device: &Device) -> strata_core::Result<Tensor>;
    /// The global batches of `global` rows the timing loops cycle through.
    fn batches(&self, global: usize) -> Result<Vec<Self::B>>;
    /// The type it computes in.
    fn precision(&self) -> strata::Precision;
}

/// The MLPs and the CNN on the digits; whether the MLPs' hidden layers are recomputed; the
/// type they compute in.
struct Digits(BenchModel, bool, strata::Precision);

impl Workload for Digits {
    type Model = Box<dyn Classifier>;
    type B = Batch;
    fn build(&self, vb: VarBuilder) -> candle_core::Result<Self::Model> {
        Ok(match &self.0 {
            BenchModel::Mlp(_, hidden) => {
                Box::new(Mlp::new(vb, FEATURES, hidden, CLASSES)?.with_recompute(self.1).with_precision(self.2))
            }
            _ if self.1 => candle_core::bail!("the cnn has no blocks to recompute"),
            _ => Box::new(Cnn::new(vb)?.with_precision(self.2)),
        })
    }
    fn loss(&self, model: &Self::Model, b: &Batch, device: &Device) -> strata_core::Result<Tensor> {
        Ok(model.loss(&b.features_tensor(device)?, &b.labels_tensor(device)?)?)
    }
    fn batches(&self, global: usize) -> Result<Vec<Batch>> {
        batches(global)
    }
    fn precision(&self) -> strata::Precision {
        self.2
    }
}

/// The transformer on Tiny Shakespeare: batches of random training windows; whether its
/// blocks are recomputed; the type it computes in.
struct Chars(TransformerConfig, bool, strata::Precision);

impl Workload for Chars {
    type Model = CharTransformer;
    type B = (Tensor, Tensor);
    fn build(&self, vb: VarBuilder) -> candle_core::Result<CharTransformer> {
        Ok(CharTransformer::new(self.0, vb)?.with_recompute(self.1).with_precision(self.2))
    }
    fn loss(&self, model: &CharTransformer, b: &(Tensor, Tensor), device: &Device) -> strata_core::Result<Tensor> {
        let (x, y) = b.to_device(device)?;
        Ok(model.loss(&x, &y)?)
    }
    fn batches(&self, global: usize) -> Result<Vec<(Tensor, Tensor)>> {
        if global == 0 {
            return Err(Error::Usage("--batch must be at least 1".into()));
        }
        let corpus = shakespeare::load()?;
        (0..8).map(|i| corpus.random_windows(global, self.0.context, i)).collect()
    }
    fn precision(&self) -> strata::Precision {
        self.2
    }
}

/// Peak RSS (VmHWM) of this process, bytes; 0 where /proc is not available.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

/// The full global batches of the digits training set.
pub(crate) fn batches(global: usize) -> Result<Vec<Batch>> {
    let (train, _) = digits::train_test_split(&digits::load(None)?, 0.2, 0);
    let full = train.len() / global;
    if full == 0 {
        return Err(Error::Usage(format!("--batch {global} is larger than the {} training examples", train.len())));
    }
    Ok((0..full).map(|i| train.slice(i * global..(i + 1) * global)).collect())
}

/// Three warm-up steps, `ready()`, then steps for `seconds` (at least 5): (steps, time).
fn time_steps(
    seconds: f64,
    ready: impl FnOnce(),
    mut step: impl FnMut(usize) -> Result<()>,
) -> Result<(usize, Duration)> {
    for i in 0..3 {
        step(i)?;
    }
    ready();
    let t0 = Instant::now();
    let mut n = 0;
    while n < 5 || t0.elapsed().as_secs_f64() < seconds {
        step(n)?;
        n += 1;
    }
    Ok((n, t0.elapsed()))
}

/// The learning rate of the benchmark (it does not change the work of a step).
pub(crate) const LR: f64 = 1e-3;

fn measure_strategy<S: Strategy, O: OptimizerMemory + Send, W: Workload>(
    s: &S,
    cfg: O::Config,
    w: &W,
    data: &[W::B],
    args: &BenchTrainArgs,
    reduced_elements: Option<&std::sync::atomic::AtomicU64>,
) -> Result<Measurement>
where
    O::Config: Clone,
{
    let seconds = args.seconds;
    let mut model = s.scope(|sc| w.build(sc.var_builder()))?;
    if !args.freeze.is_empty() {
        model.freeze(&args.freeze.iter().map(String::as_str).collect::<Vec<_>>())?;
    }
    let mut opt = model.optimizer::<O>(cfg)?;
    if w.precision().needs_loss_scale() {
        opt = opt.with_loss_scale(strata::LossScale::default())?;
    }
    let trainable: usize = model.trainable_variables(0).iter().map(|(_, v)| v.elem_count()).sum();
    // Stage 3 holds its shard of the parameters, and the two largest units whole (one in use,
    // the next gathered), with their gradients.
    let gathered = opt.gathered_elements().min(trainable);
    let mut replica_bytes = ReplicaBytes {
        params: 4 * if gathered > 0 { opt.stepped_elements(0) + gathered } else { trainable } as u64,
        // The reduced gradient a replica keeps: its shard's at stages 2 and 3.
        grads: 4 * if opt.zero_stage().shards_gradients() { opt.stepped_elements(0) + gathered } else { trainable }
            as u64,
        optimizer: 4 * state_per_element(args.optimizer) * opt.stepped_elements(0) as u64,
        measured: 0,
    };
    let counted0 = reduced_elements.map_or(0, |e| e.load(std::sync::atomic::Ordering::Relaxed));
    let sent0 = strata_transport::inject::bytes().0;
    let dist: Vec<DistributedBatch<W::B>> =
        s.distribute_dataset(data.iter().cloned(), strata_core::data::TailPolicy::Split).collect();
    // One execution runs every batch of the epoch (as `Trainer::fit` does): a "step" of the
    // timing loop below is an execution of `dist.len()` training steps.
    let never = strata::trainer::StopSignal::new();
    let execute = || -> Result<()> {
        s.run_batches(&dist, |ctx, shard| {
            let loss = w.loss(model.on(ctx)?, &shard.batch, ctx.candle_device())?;
            ctx.backward_and_sync(&loss, &opt)
        })?;
        if args.stop_check {
            strata::trainer::agreed_stop(s, &never)?;
        }
        Ok(())
    };
    let (executions, dt) = match s.extended().workers() {
        None => time_steps(seconds, || {}, |_| execute())?,
        Some(w) => {
            // Workers must run the same number of executions: the chief decides when to stop
            // and broadcasts it after each execution.
            for _ in 0..3 {
                execute()?;
            }
            let t0 = Instant::now();
            let mut n = 0;
            loop {
                execute()?;
                n += 1;
                let mut stop = [f32::from(u8::from(n >= 5 && t0.elapsed().as_secs_f64() >= seconds))];
                w.broadcast(0, &mut stop)?;
                if stop[0] == 1.0 {
                    break (n, t0.elapsed());
                }
            }
        }
    };
    replica_bytes.measured = opt.peak_replica_bytes().into_iter().max().unwrap_or(0);
    let steps = executions * dist.len();
    let global = data[0].rows()?;
    // Every step of the run, the warm-up's included.
    let all_steps = ((executions + 3) * dist.len()) as f64;
    let reduced_bytes_per_step = match (reduced_elements, s.extended().workers()) {
        (Some(e), _) => 4.0 * (e.load(std::sync::atomic::Ordering::Relaxed) - counted0) as f64 / all_steps,
        (None, Some(_)) => (strata_transport::inject::bytes().0 - sent0) as f64 / all_steps,
        (None, None) => 0.0,
    };
    Ok(Measurement {
        examples_per_second: (steps * global) as f64 / dt.as_secs_f64(),
        step_seconds: dt.as_secs_f64() / steps as f64,
        peak_rss_bytes: peak_rss_bytes(),
        reduced_bytes_per_step,
        gflops: 0.0,
        replica_bytes,
    })
}

/// K independent single-thread copies of the per-replica step, plain candle, at once.
fn measure_ceiling<O: Optimizer, W: Workload>(
    k: usize,
    cfg: O::Config,
    w: &W,
    data: &[W::B],
    seconds: f64,
    freeze: &[String],
) -> Result<Measurement>
where
    O::Config: Clone + Sync,
{
    let per = data[0].rows()? / k;
    let barrier = std::sync::Barrier::new(k);
    let results: Vec<Result<(usize, Duration)>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..k)
            .map(|r| {
                let (barrier, cfg) = (&barrier, &cfg);
                s.spawn(move || -> Result<(usize, Duration)> {
                    // Each copy in a one-thread pool of its own, as each Mirrored replica's
                    // kernels run: candle's parallel kernels (convolutions, some element-wise
                    // maps) would otherwise queue for the one thread of rayon's global pool.
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(1)
                        .build()
                        .map_err(|e| Error::Usage(format!("cannot start a ceiling thread: {e}")))?;
                    pool.install(move || -> Result<(usize, Duration)> {
                        let dev = Device::Cpu;
                        let vm = VarMap::new();
                        let model = w.build(VarBuilder::from_varmap(&vm, DType::F32, &dev))?;
                        // The optimizer updates only what is not frozen.
                        let frozen = |name: &str| freeze.iter().any(|p| matches_pattern(p, name));
                        let data_lock = vm.data().lock().map_err(|_| Error::Usage("a poisoned variable map".into()))?;
                        let vars: Vec<candle_core::Var> =
                            data_lock.iter().filter(|(n, _)| !frozen(n)).map(|(_, v)| v.clone()).collect();
                        drop(data_lock);
                        let mut opt = O::new(vars, cfg.clone())?;
                        let shards: Vec<W::B> =
                            data.iter().map(|b| b.slice(r * per..(r + 1) * per)).collect::<strata_core::Result<_>>()?;
                        let step = |i: usize| -> Result<()> {
                            let loss = w.loss(&model, &shards[i % shards.len()], &dev)?;
                            opt.backward_step(&loss)?;
                            Ok(())
                        };
                        // All copies start timing together.
                        time_steps(
                            seconds,
                            || {
                                barrier.wait();
                            },
                            step,
                        )
                    })
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::Usage("a ceiling thread panicked".into()))))
            .collect()
    });
    let mut eps = 0.0;
    let mut step = 0.0;
    for r in results {
        let (n, dt) = r?;
        eps += (n * per) as f64 / dt.as_secs_f64();
        step += dt.as_secs_f64() / n as f64 / k as f64;
    }
    Ok(Measurement {
        examples_per_second: eps,
        step_seconds: step,
        peak_rss_bytes: peak_rss_bytes(),
        reduced_bytes_per_step: 0.0,
        gflops: 0.0,
        replica_bytes: ReplicaBytes::default(),
    })
}

/// The matmul GFLOP/s of `k` threads at once, each multiplying two
/// [`LIMIT_MATMUL`]-square f32 matrices on its own (one candle CPU thread each) for `seconds`.
pub(crate) fn measure_limit(k: usize, seconds: f64) -> Result<Measurement> {
    let n = LIMIT_MATMUL;
    let start = std::sync::Barrier::new(k);
    let per_thread = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..k)
            .map(|i| {
                let start = &start;
                scope.spawn(move || -> candle_core::Result<(u64, f64)> {
                    let a = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
                    let b = Tensor::randn(i as f32, 1.0, (n, n), &Device::Cpu)?;
                    a.matmul(&b)?; // warm-up: pages, packing buffers
                    start.wait();
                    let t0 = Instant::now();
                    let mut done = 0u64;
                    while done == 0 || t0.elapsed().as_secs_f64() < seconds {
                        a.matmul(&b)?;
                        done += 1;
                    }
                    Ok((done, t0.elapsed().as_secs_f64()))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect::<Vec<_>>()
    });
    let flops = 2.0 * (n as f64).powi(3);
    let mut gflops = 0.0;
    for r in per_thread {
        let (done, dt) = r?;
        gflops += done as f64 * flops / dt / 1e9;
    }
    Ok(Measurement {
        examples_per_second: 0.0,
        step_seconds: 0.0,
        peak_rss_bytes: peak_rss_bytes(),
        reduced_bytes_per_step: 0.0,
        gflops,
        replica_bytes: ReplicaBytes::default(),
    })
}

/// Whether `name` matches `pattern` (`*` for any run of characters), as `Replicated::freeze`
/// matches.
fn matches_pattern(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, tail)) => name.strip_prefix(head).is_some_and(|rest| {
            (0..=rest.len()).any(|i| rest.is_char_boundary(i) && matches_pattern(tail, &rest[i..]))
        }),
    }
}

fn worker(spec: &str, args: &BenchTrainArgs) -> Result<()> {
    let (model, config) = spec.split_once(':').ok_or_else(|| Error::Usage(format!("bad worker spec {spec:?}")))?;
    let (config, precision) = match config.rsplit_once('+') {
        Some((c, p)) if p.parse::<strata::Precision>().is_ok() => {
            (c, p.parse::<strata::Precision>().unwrap_or_default())
        }
        _ => (config, strata::Precision::F32),
    };
    let (config, recompute) = config.strip_suffix("+recompute").map_or((config, false), |c| (c, true));
    let m = if config == "limit" {
        measure_limit(args.replicas, args.seconds)?
    } else if config == LIMIT_ONE {
        measure_limit(1, args.seconds)?
    } else {
        match BenchModel::one(model)? {
            BenchModel::Transformer(c) => measure_with(config, args, &Chars(c, recompute, precision))?,
            m => measure_with(config, args, &Digits(m, recompute, precision))?,
        }
    };
    println!("{}", serde_json::to_string(&m).map_err(|e| Error::io("cannot encode", e.into()))?);
    Ok(())
}

/// The ceiling's examples/s for `model`: `k` copies, AdamW, `global` examples per step.
pub(crate) fn ceiling_examples_per_second(model: &BenchModel, k: usize, global: usize, seconds: f64) -> Result<f64> {
    let cfg = ParamsAdamW { lr: LR, ..Default::default() };
    let m = match model {
        BenchModel::Transformer(c) => {
            let w = Chars(*c, false, strata::Precision::F32);
            measure_ceiling::<FusedAdamW, _>(k, cfg, &w, &w.batches(global)?, seconds, &[])?
        }
        m => {
            let w = Digits(m.clone(), false, strata::Precision::F32);
            measure_ceiling::<FusedAdamW, _>(k, cfg, &w, &w.batches(global)?, seconds, &[])?
        }
    };
    Ok(m.examples_per_second)
}

fn measure_with<W: Workload>(config: &str, args: &BenchTrainArgs, w: &W) -> Result<Measurement> {
    let data = w.batches(args.batch.ok_or_else(|| Error::Usage("a worker needs --batch".into()))?)?;
    let adamw = ParamsAdamW { lr: LR, ..Default::default() };
    match args.optimizer {
        OptimizerKind::Adamw => measure::<FusedAdamW, W>(config, adamw, args, w, &data),
        OptimizerKind::CandleAdamw => measure::<AdamW, W>(config, adamw, args, w, &data),
        OptimizerKind::Sgd => measure::<FusedSgd, W>(config, LR, args, w, &data),
        OptimizerKind::CandleSgd => measure::<SGD, W>(config, LR, args, w, &data),
        OptimizerKind::Momentum | OptimizerKind::Adagrad => Err(Error::Usage(
            "strata bench train measures adamw and sgd; momentum and adagrad run on a parameter server (strata bench ps)"
                .into(),
        )),
    }
}

fn measure<O: OptimizerMemory + Send, W: Workload>(
    config: &str,
    cfg: O::Config,
    args: &BenchTrainArgs,
    w: &W,
    data: &[W::B],
) -> Result<Measurement>
where
    O::Config: Clone + Sync,
{
    let (config, stage) = match config.split_once("+zero") {
        Some((c, n)) => (c, n.parse::<ZeroStage>()?),
        None => (config, ZeroStage::Off),
    };
    let options = strata_core::StrategyOptions { zero_stage: stage, ..Default::default() };
    match config {
        "one-device" => measure_strategy::<_, O, W>(&OneDeviceStrategy::cpu()?, cfg, w, data, args, None),
        "mirrored" => {
            // The in-memory all-reduce Mirrored uses by default, behind a counter.
            let devices = strata_core::device::logical_cpus(args.replicas)?;
            let inner = strata_core::cross_device::CpuCrossDeviceOps::in_memory_all_reduce(args.replicas)?
                .with_devices(devices.iter().map(|d| d.spec.clone()).collect())?;
            let elements = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
            let ops = Box::new(Counting { inner, elements: elements.clone() });
            let s = MirroredStrategy::with_cross_device_ops(devices, ops, options)?;
            measure_strategy::<_, O, W>(&s, cfg, w, data, args, Some(&elements))
        }
        "ceiling" => measure_ceiling::<O, W>(args.replicas, cfg, w, data, args.seconds, &args.freeze),
        "multi-worker" => {
            let token = strata_transport::ClusterToken::resolve(None).map_err(|e| Error::Usage(e.to_string()))?;
            let resolver = strata_strategies::cluster::TFConfigClusterResolver::from_env()?;
            let mut o = strata_strategies::MultiWorkerOptions::new(token)?;
            o.options = options;
            let s = strata_strategies::MultiWorkerMirroredStrategy::from_resolver(&resolver, o)?;
            let m = measure_strategy::<_, O, W>(&s, cfg, w, data, args, None)?;
            s.finish()?;
            Ok(m)
        }
        _ => Err(Error::Usage(format!("unknown configuration {config:?}"))),
    }
}

fn command(spec: &str, args: &BenchTrainArgs, batch: usize) -> Result<Command> {
    let exe = std::env::current_exe().map_err(|e| Error::io("cannot find the strata binary", e))?;
    let mut c = Command::new(exe);
    c.args(["bench", "train", "--worker", spec])
        .args(["--replicas", &args.replicas.to_string(), "--seconds", &args.seconds.to_string()])
        .args(["--batch", &batch.to_string(), "--optimizer", args.optimizer.name()])
        .args(args.stop_check.then_some("--stop-check"))
        .args(if args.freeze.is_empty() { vec![] } else { vec!["--freeze".to_string(), args.freeze.join(",")] })
        .env("CANDLE_NUM_THREADS", "1")
        .env("RAYON_NUM_THREADS", "1");
    Ok(c)
}

/// K worker processes on loopback; the chief's measurement is the job's.
fn spawn_multi_worker(spec: &str, args: &BenchTrainArgs, batch: usize) -> Result<Measurement> {
    let k = args.replicas;
    let ports = strata_transport::ports::free_ports([127, 0, 0, 1].into(), k)
        .map_err(|e| Error::io("cannot find free loopback ports", e))?;
    let spec_json: Vec<String> = ports.iter().map(|p| format!("\"127.0.0.1:{p}\"")).collect();
    let token = format!("{:032x}", rand::random::<u128>());
    let children = (0..k)
        .map(|i| {
            command(spec, args, batch)?
                .env(
                    "TF_CONFIG",
                    format!(
                        r#"{{"cluster":{{"worker":[{}]}},"task":{{"type":"worker","index":{i}}}}}"#,
                        spec_json.join(",")
                    ),
                )
                .env("STRATA_CLUSTER_TOKEN", &token)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .map_err(|e| Error::io("cannot start a benchmark process", e))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut outs = Vec::new();
    for c in children {
        outs.push(c.wait_with_output().map_err(|e| Error::io("waiting for a benchmark process", e))?);
    }
    parse_output(spec, outs.swap_remove(0))
}

fn spawn(spec: &str, args: &BenchTrainArgs, batch: usize) -> Result<Measurement> {
    if spec.contains(":multi-worker") {
        return spawn_multi_worker(spec, args, batch);
    }
    let out = command(spec, args, batch)?.output().map_err(|e| Error::io("cannot start a benchmark process", e))?;
    parse_output(spec, out)
}

fn parse_output(spec: &str, out: std::process::Output) -> Result<Measurement> {
    if !out.status.success() {
        return Err(Error::Usage(format!(
            "benchmark process {spec} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().unwrap_or(""))
        .map_err(|e| Error::Usage(format!("benchmark process {spec} printed no result ({e}): {text}")))
}

/// Runs the benchmark and prints one table per model.
pub fn run(args: &BenchTrainArgs) -> Result<()> {
    if let Some(spec) = &args.worker {
        return worker(spec, args);
    }
    if args.replicas == 0 || args.rounds == 0 {
        return Err(Error::Usage("--replicas and --rounds must be at least 1".into()));
    }
    let mut models = Vec::new();
    for name in &args.models {
        for m in BenchModel::parse(name)? {
            if !models.contains(&m) {
                models.push(m);
            }
        }
    }
    let k = args.replicas;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let batch_note = args
        .batch
        .map_or("256 examples (32 windows of 64 characters for the transformer)".to_string(), |b| b.to_string());
    println!(
        "# strata bench train: global batch {batch_note}, f32, optimizer {}, {} rounds of {:.1} s per configuration",
        args.optimizer, args.rounds, args.seconds
    );
    println!("# machine: {cores} cores; backend: {}", strata::cpu_backend());
    println!(
        "# ceiling = {k} independent single-thread copies of the per-replica step at once (plain candle), measured now"
    );
    println!("# limit = the matmul GFLOP/s of {k} threads at once ({LIMIT_MATMUL}^3 f32, candle's CPU backend), measured now, over the model's FLOPs per example or token (6 per multiply-add of the forward pass)");
    if k > 1 {
        println!("# {LIMIT_ONE} = the same for one thread alone (the other cores idle): the one-device rows run one thread, and their `of limit` is of {LIMIT_ONE}");
    }
    println!("# every configuration in its own process; medians over rounds; peers (TensorFlow, PyTorch) side by side: scripts/bench/peers.sh");
    if args.stop_check {
        println!("# --stop-check: after every execution (one pass over the benchmark's batches), the stop agreement of strata train (an all-reduce of one number across workers)");
    }
    if !args.freeze.is_empty() {
        println!("# frozen in every configuration: {} (never reduced nor updated)", args.freeze.join(", "));
    }
    println!("# params/rep, grads/rep, optim/rep: bytes of one replica's trainable parameters, reduced gradients and optimizer state (+zeroN: ZeRO stage N, each replica's optimizer state for its shard only, from stage 2 its reduced gradient too, and at stage 3 its shard of the parameters plus the two largest units whole, with their gradients); mirrored without +zeroN steps shards as stage 1 does on one machine's CPU where the optimizer can (StrategyOptions::host_shards: the same bits, its state in shards)");
    println!("# held/rep: the most any replica held at once in a step, counted by the strategy at the end of each backward pass (parameters as resident, gradients, optimizer state and the activations the loss keeps; strata::Footprint), beside the computed columns before it");
    println!("# reduced/step: bytes each mirrored replica hands to the all-reduce, or each multi-worker worker sends on the ring, per step");
    for model in &models {
        let name = model.name();
        let batch = args.batch.unwrap_or(model.default_batch());
        let units = model.units_per_example() as f64;
        let mut configs: Vec<String> = ["limit", "ceiling", "one-device"].map(String::from).to_vec();
        if k > 1 {
            configs.insert(1, LIMIT_ONE.to_string());
        }
        for stage in &args.zero_stages {
            let suffix = match stage {
                ZeroStage::Off => String::new(),
                s => format!("+zero{}", s.number()),
            };
            for c in ["mirrored", "multi-worker"] {
                if !configs.contains(&format!("{c}{suffix}")) {
                    configs.push(format!("{c}{suffix}"));
                }
            }
        }
        if args.recompute && *model != BenchModel::Cnn {
            let kept: Vec<String> =
                configs.iter().filter(|c| *c == "one-device" || c.starts_with("mirrored")).cloned().collect();
            configs.extend(kept.into_iter().map(|c| format!("{c}+recompute")));
        }
        let base: Vec<String> =
            configs.iter().filter(|c| *c == "one-device" || c.starts_with("mirrored")).cloned().collect();
        for p in args.precisions.iter().filter(|p| **p != strata::Precision::F32) {
            configs.extend(base.iter().map(|c| format!("{c}+{p}")));
        }
        let mut runs: Vec<Vec<Measurement>> = vec![Vec::new(); configs.len()];
        for round in 0..args.rounds {
            for (i, c) in configs.iter().enumerate() {
                let m = spawn(&format!("{name}:{c}"), args, batch)?;
                tracing::info!(model = name, config = c, round, eps = m.examples_per_second, "measured");
                runs[i].push(m);
            }
        }
        let med = |i: usize, f: fn(&Measurement) -> f64| super::common::median(runs[i].iter().map(f).collect());
        let gflops = med(0, |m| m.gflops);
        let flops = model.flops_per_unit();
        // Units per second if every thread ran its matmuls at the measured rate.
        let limit = gflops * 1e9 / flops;
        let at = |name: &str| configs.iter().position(|c| c == name);
        // One thread alone: what a one-device row (one thread) is measured against.
        let limit_one = at(LIMIT_ONE).map_or(limit, |i| med(i, |m| m.gflops) * 1e9 / flops);
        let ceiling = at("ceiling").map_or(0.0, |i| med(i, |m| m.examples_per_second)) * units;
        let unit = model.unit();
        println!();
        println!(
            "# {name}: global batch {batch}; {:.3} MFLOP per {}; {k} threads' matmul {gflops:.1} GFLOP/s, so at most {limit:.0} {unit}",
            flops / 1e6,
            if units > 1.0 { "token" } else { "example" }
        );
        println!(
            "{:<11} {:>9} {:<19} {:>8} {:>12} {:>10} {:>10} {:>11} {:>9} {:>14} {:>11} {:>10} {:>10} {:>10}",
            "model",
            "params",
            "config",
            "replicas",
            unit,
            "step(ms)",
            "peakRSS",
            "of ceiling",
            "of limit",
            "reduced/step",
            "params/rep",
            "grads/rep",
            "optim/rep",
            "held/rep"
        );
        let mib = |b: u64| if b == 0 { "-".to_string() } else { format!("{:.2}M", b as f64 / (1024.0 * 1024.0)) };
        for (i, c) in configs.iter().map(String::as_str).enumerate() {
            let is_limit = c == "limit" || c == LIMIT_ONE;
            let rate = match c {
                "limit" => limit,
                LIMIT_ONE => limit_one,
                _ => med(i, |m| m.examples_per_second) * units,
            };
            let one = c.starts_with("one-device");
            let replicas = if one || c == LIMIT_ONE { 1 } else { k };
            let of_ceiling =
                if is_limit || c == "ceiling" { "-".to_string() } else { format!("{:.1}%", 100.0 * rate / ceiling) };
            let of_limit = match (is_limit, one) {
                (true, _) => "-".to_string(),
                (false, true) => format!("{:.1}%", 100.0 * rate / limit_one),
                (false, false) => format!("{:.1}%", 100.0 * rate / limit),
            };
            let reduced = med(i, |m| m.reduced_bytes_per_step);
            let reduced = if reduced > 0.0 { format!("{reduced:.0} B") } else { "-".to_string() };
            let step = if is_limit { "-".to_string() } else { format!("{:.2}", 1e3 * med(i, |m| m.step_seconds)) };
            let bytes = runs[i].first().map(|m| m.replica_bytes).unwrap_or_default();
            println!(
                "{:<11} {:>9} {:<19} {:>8} {:>12.0} {:>10} {:>9.0}M {:>11} {:>9} {:>14} {:>11} {:>10} {:>10} {:>10}",
                name,
                model.parameter_count(),
                c,
                replicas,
                rate,
                step,
                med(i, |m| m.peak_rss_bytes as f64) / (1024.0 * 1024.0),
                of_ceiling,
                of_limit,
                reduced,
                mib(bytes.params),
                mib(bytes.grads),
                mib(bytes.optimizer),
                mib(bytes.measured)
            );
        }
    }
    println!();
    println!("# targets: mirrored >= 90% of the ceiling; the large MLP under mirrored(2) and multi-worker(2) >= 85% of the limit; one-device >= 85% of {LIMIT_ONE}");
    Ok(())
}

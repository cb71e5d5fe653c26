//! `strata train`'s flags ([`TrainArgs`]), what they name ([`ModelKind`], [`PsModeKind`],
//! ...), the refusals of flags that do not go together, and the cluster resolver they select.
//! Every job `strata train` runs reads them: this process's strategy (`train`) and a
//! parameter-server job's coordinator (`ps`).

use std::path::PathBuf;
use std::sync::Arc;

use serde::Serialize;
use strata_core::cross_device::compression::Compression;
use strata_core::ZeroStage;
use strata_strategies::cluster::{ClusterResolver, SlurmClusterResolver, SlurmJobs, TFConfigClusterResolver};

use strata::optim::schedule::LrSchedule;
use strata::transformer::TransformerConfig;
use strata::{OptimizerKind, StrategyKind};
use strata_compare::inject::StepDelays;

use crate::kinds::kind_parser;
use crate::{Error, Result};

/// How parameter servers apply pushes.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PsModeKind {
    /// Apply each push as it arrives (TensorFlow's ParameterServerStrategy).
    Async,
    /// Average one push per worker per step, then apply once (--backup-workers: apply after
    /// the first workers minus backups, drop the late ones).
    Sync,
    /// Apply each push, refuse those computed from values more than --staleness versions old.
    Stale,
    /// PERSIA's hybrid (--model ctr): the embedding table asynchronous on the ps tasks (each
    /// worker's rows applied as they arrive), the dense layers synchronous across the workers
    /// by ring all-reduce, as multi-worker mirrored.
    Hybrid,
}

/// The rate at which parameter servers apply a stale push's dense variables (async and stale
/// modes; `strata::ps::StaleRate`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StaleRateKind {
    /// The optimizer's rate, however stale the push (TensorFlow's ParameterServerStrategy).
    #[default]
    Constant,
    /// lr / (1 + s) for a push computed s updates before it lands, after Zhang et al. (2016);
    /// the workers then compute at the pulled values (no look-ahead).
    Inverse,
}

impl From<StaleRateKind> for strata::ps::StaleRate {
    fn from(k: StaleRateKind) -> Self {
        match k {
            StaleRateKind::Constant => strata::ps::StaleRate::Constant,
            StaleRateKind::Inverse => strata::ps::StaleRate::Inverse,
        }
    }
}

/// The optimizer of embedding tables' rows on parameter servers (TensorFlow's sparse
/// semantics: rows no batch touched keep their values and slots).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableOptimizerKind {
    /// `w -= lr * g`.
    Sgd,
    /// Keras' Adagrad (initial accumulator 0.1, eps 1e-7).
    Adagrad,
    /// Keras' FTRL (lr power -0.5, initial accumulator 0.1, no L1 or L2).
    Ftrl,
    /// TensorFlow Addons' LazyAdam (betas 0.9 and 0.999, eps 1e-7): the touched rows' moments.
    LazyAdam,
}

impl TableOptimizerKind {
    /// The ps tasks' row optimizer at learning rate `lr`.
    pub fn row_optimizer(self, lr: f64) -> strata::ps::RowOptimizer {
        use strata::ps::RowOptimizer;
        match self {
            Self::Sgd => RowOptimizer::Sgd { lr },
            Self::Adagrad => RowOptimizer::Adagrad { lr, initial_accumulator: 0.1, eps: 1e-7 },
            Self::Ftrl => {
                RowOptimizer::Ftrl { lr, lr_power: -0.5, initial_accumulator: 0.1, l1: 0.0, l2: 0.0, beta: 0.0 }
            }
            Self::LazyAdam => RowOptimizer::LazyAdam { lr, beta1: 0.9, beta2: 0.999, eps: 1e-7 },
        }
    }
}

/// Where a multi-worker task learns its cluster.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClusterSource {
    /// The `TF_CONFIG` environment variable, as TensorFlow (and Kubeflow's TFJob) writes it.
    TfConfig,
    /// Slurm's variables (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_JOB_NODELIST`, ...).
    Slurm,
}

/// How a multi-worker job splits the data across workers.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum AutoShardKind {
    /// Every worker keeps its slice of each global batch.
    Data,
    /// No sharding: each worker's batches are its own.
    Off,
    /// Whole files per worker (TensorFlow's FILE): `--data` is a directory of digits shards;
    /// worker `i` of `W` trains on files `i`, `i + W`, ... in batches of `--batch / W`, its
    /// part of each step.
    File,
}

/// Which model `strata train` trains.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModelKind {
    /// The digits MLP (`--hidden` sizes; 30 epochs of 256 examples by default).
    Mlp,
    /// The digits CNN on 8x8 images (`strata::cnn::Cnn`; 30 epochs of 256 examples by default).
    Cnn,
    /// The character transformer on Tiny Shakespeare (`strata::transformer`, 0.82M
    /// parameters; 1 epoch of --steps steps of 32 windows of 64 characters by default, AdamW
    /// with warm-up and cosine decay, clipping at 1.0; on parameter servers the same schedule
    /// over the ps tasks' own update count, clipping on the workers).
    Transformer,
    /// A DLRM-style click model on generated Criteo-shaped records (`strata::ctr`): one
    /// embedding table of --embedding-rows rows of --embedding-dim, 1 epoch of
    /// --train-records records in batches of 256, the test AUC beside the planted model's.
    Ctr,
}

impl ModelKind {
    /// Its name on the command line and in summaries.
    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Mlp => "mlp",
            ModelKind::Cnn => "cnn",
            ModelKind::Transformer => "transformer",
            ModelKind::Ctr => "ctr",
        }
    }
}

/// The ctr model's default embedding rows (`--embedding-rows`).
pub const CTR_ROWS: u64 = 10_000;
/// The ctr model's default training records (`--train-records`): 391 steps of 256.
pub const CTR_TRAIN_RECORDS: u64 = 100_000;
/// The ctr model's default test records (`--test-records`).
pub const CTR_TEST_RECORDS: u64 = 20_000;

/// The transformer's default steps per epoch (`--steps`): sized to finish well within 5 minutes
/// on a 2-core machine in a release build.
pub const TRANSFORMER_STEPS: usize = 1200;

/// The transformer's learning-rate schedule over `total` optimizer steps, under every strategy:
/// a linear warm-up over 5% of them (at most 100), then a cosine decay from `lr` to a tenth of
/// it at the last step.
pub fn transformer_schedule(lr: f64, total: u64) -> LrSchedule {
    LrSchedule::WarmupCosine { peak: lr, warmup_steps: (total / 20).min(100), total_steps: total, final_lr: lr / 10.0 }
}

/// Which CPU reduction.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReductionKind {
    /// Each replica reduces its own chunk (reduce-scatter), then all read the result.
    InMemory,
    /// One replica reduces everything.
    ToOneDevice,
}

/// `strata train` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct TrainArgs {
    /// The distribution strategy.
    #[arg(long, default_value = "mirrored", value_parser = kind_parser::<StrategyKind>())]
    pub strategy: StrategyKind,
    /// Replicas (logical CPU devices of one thread each); one-device always uses 1.
    #[arg(long, conflicts_with = "gpus")]
    pub replicas: Option<usize>,
    /// Train on the first N visible GPUs, one replica each (mirrored, central-storage,
    /// one-device), instead of logical CPU devices. Needs a binary built with
    /// `--features candle-cuda` and a CUDA driver.
    #[arg(long, value_name = "N")]
    pub gpus: Option<usize>,
    /// With --gpus: how the replicas reduce (auto: NCCL between whole GPUs when it loads,
    /// Strata's CUDA kernels otherwise; nccl; kernels).
    #[arg(long, default_value = "auto", value_parser = parse_cross_device_ops)]
    pub cross_device_ops: strata_cuda::select::CrossDeviceChoice,
    /// The model: mlp (digits), cnn (digits as 8x8 images), transformer (Tiny Shakespeare),
    /// every strategy training each, parameter servers included; or ctr (a DLRM-style click
    /// model on generated records), under every strategy but parameter servers.
    #[arg(long, value_enum, default_value = "mlp")]
    pub model: ModelKind,
    /// Hidden layer sizes of --model mlp, comma-separated [default: 256,256].
    #[arg(long = "hidden", value_delimiter = ',', value_name = "SIZES")]
    pub hidden_flag: Option<Vec<usize>>,
    /// Passes over the training set [default: 30; transformer: 1].
    #[arg(long = "epochs", value_name = "N")]
    pub epochs_flag: Option<usize>,
    /// Global batch size, examples (transformer: windows of 64 characters) per step over all
    /// replicas; parameter-server: per worker step [default: 256; transformer: 32].
    #[arg(long = "batch", value_name = "N")]
    pub batch_flag: Option<usize>,
    /// --model transformer: steps per epoch (the training set is steps x batch windows at
    /// random offsets, drawn with --seed; parameter-server: worker steps, each drawing its
    /// --batch windows from --seed, the epoch and the step) [default: 1200].
    #[arg(long, value_name = "N")]
    pub steps: Option<usize>,
    /// --model transformer: the embedding width [default: 128].
    #[arg(long, value_name = "W")]
    pub width: Option<usize>,
    /// --model transformer: blocks [default: 4].
    #[arg(long, value_name = "L")]
    pub layers: Option<usize>,
    /// --model transformer: attention heads, which divide the width [default: 4].
    #[arg(long, value_name = "H")]
    pub heads: Option<usize>,
    /// The type the model computes in: `f32`, or mixed precision with f32 variables and
    /// optimizer state (sharded under ZeRO) and f32-summed gradients: `bf16` (forward and
    /// backward in bfloat16), or `fp16` (IEEE half, with dynamic loss scaling: from 2^15,
    /// halved and the step skipped on a gradient that is not finite, doubled after 2,000
    /// finite steps, every replica and worker alike).
    #[arg(long, default_value = "f32", value_parser = str::parse::<strata::Precision>)]
    pub precision: strata::Precision,
    /// --precision fp16: the loss scale to start from [default: 32768, TensorFlow's 2^15].
    #[arg(long, value_name = "SCALE")]
    pub initial_loss_scale: Option<f64>,
    /// Recompute activations in the backward pass instead of keeping them: the transformer's
    /// blocks and the MLP's hidden layers each keep only their input (the same gradients, less
    /// memory, one more forward pass).
    #[arg(long)]
    pub recompute: bool,
    /// --model ctr: rows of the embedding table the 26 fields share [default: 10000].
    #[arg(long, value_name = "N")]
    pub embedding_rows: Option<u64>,
    /// --model ctr: the embedding dimension [default: 16].
    #[arg(long, value_name = "D")]
    pub embedding_dim: Option<usize>,
    /// --model ctr: generated training records (each step generates its own; a process holds
    /// their keys, 8 bytes each) [default: 100000].
    #[arg(long, value_name = "N")]
    pub train_records: Option<u64>,
    /// --model ctr: generated test records, on which the AUC is measured [default: 20000].
    #[arg(long, value_name = "N")]
    pub test_records: Option<u64>,
    /// --model transformer: after training, print N characters sampled from the model.
    #[arg(long, value_name = "N")]
    pub sample: Option<usize>,
    /// Learning rate.
    #[arg(long, default_value_t = 0.003)]
    pub lr: f64,
    /// Optimizer.
    #[arg(long, default_value = "adamw", value_parser = kind_parser::<OptimizerKind>())]
    pub optimizer: OptimizerKind,
    /// Seed of initialisation and shuffling (the train/test split is fixed).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Digits CSV (.csv or .csv.gz), or a directory of them (a data set sharded into files,
    /// joined in name order; whole files per worker with --auto-shard file); default: the copy
    /// shipped in data/ (built into the binary).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Write a JSON summary here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Write a Chrome trace of every replica's step phases here (open it in Perfetto).
    #[arg(long)]
    pub timeline: Option<PathBuf>,
    /// The CPU cross-device reduction.
    #[arg(long, value_enum, default_value = "in-memory")]
    pub reduction: ReductionKind,
    /// Gradient fusion bucket size in MiB (0: one bucket per tensor; default 25); across
    /// workers, buckets are also at most an eighth of the gradient (at least 1 MiB).
    #[arg(long)]
    pub bucket_mib: Option<f64>,
    /// Across workers, a large weight's gradient is computed and reduced in blocks of rows of
    /// this many MiB, each sent while the backward pass computes the next (0: whole; default 2).
    #[arg(long)]
    pub row_block_mib: Option<f64>,
    /// How gradients cross the network: `none` (f32, exact), `fp16` or `bf16` (16 bits on the
    /// wire: multi-worker-mirrored's ring, every hop adding in f32, or the parameter server's
    /// pushes and pulls), `powersgd:RANK` (multi-worker-mirrored: matrix gradients as two
    /// rank-RANK factors, with error feedback), or `int8` (local SGD's outer gradients only:
    /// blocks of 64 values with a power-of-two scale).
    #[arg(long, default_value = "none", value_parser = parse_compression)]
    pub compression: Compression,
    /// Reduce after the backward pass instead of overlapping the reduction with it.
    #[arg(long)]
    pub no_overlap: bool,
    /// Local SGD / DiLoCo (multi-worker-mirrored): each worker steps on its own part of every
    /// batch, and the workers meet every H steps, averaging how far they moved (1: every step
    /// synchronous, the default). `--compression` then applies to what they send at a meeting.
    #[arg(long, default_value_t = 1)]
    pub sync_every: u64,
    /// What the workers' mean outer gradient does at a meeting: `average` (local SGD: the
    /// global parameters become the workers' mean) or `nesterov` (DiLoCo: SGD with Nesterov
    /// momentum; the default with --sync-every above 1).
    #[arg(long, value_enum)]
    pub outer_optimizer: Option<OuterKind>,
    /// DiLoCo's outer learning rate.
    #[arg(long, default_value_t = strata::local_sgd::DILOCO_OUTER_LR)]
    pub outer_lr: f32,
    /// DiLoCo's outer momentum.
    #[arg(long, default_value_t = strata::local_sgd::DILOCO_OUTER_MOMENTUM)]
    pub outer_momentum: f32,
    /// Streaming DiLoCo: the parameters in this many fragments (whole variables), met at
    /// staggered steps, each exchange running while the inner steps after it compute.
    #[arg(long, default_value_t = 1)]
    pub fragments: usize,
    /// Inner steps a fragment's exchange runs behind before it is applied (default: 0 with
    /// one fragment, half the steps between two fragments' meetings with several).
    #[arg(long)]
    pub sync_delay: Option<u64>,
    /// ZeRO: 0 (every replica keeps the whole optimizer state), 1 (each replica, across every
    /// worker, keeps the optimizer state of its shard of the parameters and steps that shard),
    /// 2 (and keeps the reduced gradient of its shard only) or 3 (and holds only its shard of
    /// the parameters, each unit of layers gathered while a step uses it); mirrored and
    /// multi-worker-mirrored (stage 3: mirrored), with the fused optimizers.
    #[arg(long, default_value = "0", value_parser = parse_zero_stage)]
    pub zero_stage: ZeroStage,
    /// Stage 3's units, comma-separated prefixes of the variables' names (`block0,block1`,
    /// `layer0`): each is gathered whole while a step uses it, as FSDP2's `fully_shard` per
    /// module. A variable no prefix names is in its default unit: its name's first part
    /// (`block3`, `head`). Only with `--zero-stage 3`.
    #[arg(long, value_delimiter = ',', value_name = "PREFIXES")]
    pub zero_units: Vec<String>,
    /// The memory each replica's logical CPU device may give a step, such as `40MiB` or
    /// `2GB`: a job whose model state (parameters, gradients, optimizer state) is over it stops
    /// before training, and a step that holds more (its activations counted too) fails before
    /// its update, each naming the bytes and the ZeRO stage or option that would fit.
    #[arg(long, value_name = "SIZE", value_parser = parse_memory_limit)]
    pub memory_limit: Option<u64>,
    /// parameter-server: compute each worker's gradients at the pulled values, not at the
    /// values extrapolated by the updates expected to land before its push (async and stale
    /// modes; see docs/parameter-servers.md).
    #[arg(long)]
    pub no_lookahead: bool,
    /// multi-worker-mirrored: an elastic job that runs while at least N of its workers live; a
    /// lost worker costs a step, not the job, and a worker started later joins it (under strata
    /// launch, or with --coordinator).
    #[arg(long, value_name = "N")]
    pub min_workers: Option<usize>,
    /// With --min-workers: where the job's coordination service listens (host:port), which
    /// outlives any worker; strata launch serves it and sets STRATA_COORDINATOR.
    #[arg(long, value_name = "HOST:PORT", env = "STRATA_COORDINATOR")]
    pub coordinator: Option<String>,
    /// parameter-server on this machine (no TF_CONFIG): start a worker task that dies again,
    /// up to K times per worker (its steps run on the others meanwhile, and the new process
    /// is given steps once it answers), as a cluster manager would.
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub max_restarts: usize,
    /// Do not draw a progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Multi-worker: where this task reads its cluster from.
    #[arg(long, value_enum, default_value = "tf-config")]
    pub cluster: ClusterSource,
    /// With --cluster slurm: the job step's ranks assigned to jobs in order, e.g.
    /// `chief=1,ps=1,worker=2` for a parameter-server job (default: every task a worker).
    #[arg(long, value_name = "JOB=N,...", value_parser = parse_slurm_jobs)]
    pub slurm_jobs: Option<SlurmJobs>,
    /// Multi-worker: the address servers bind to (default loopback; 0.0.0.0 on a real cluster).
    #[arg(long, default_value = "127.0.0.1")]
    pub bind: std::net::IpAddr,
    /// Multi-worker: the cluster token's file (default: STRATA_CLUSTER_TOKEN).
    #[arg(long)]
    pub cluster_token_file: Option<PathBuf>,
    /// Multi-worker: how the data is split across workers (default data).
    #[arg(long, value_enum)]
    pub auto_shard: Option<AutoShardKind>,
    /// Deadline of every collective, in seconds (default 60).
    #[arg(long)]
    pub collective_timeout: Option<f64>,
    /// Write checkpoints here (the chief does), and resume from the latest one found. A
    /// parameter-server job's ps tasks write theirs under `ps-<index>` (and a hybrid job's chief
    /// its dense layers' under `dense`); run the same command again to resume from them.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints.
    #[arg(long, default_value_t = 100)]
    pub checkpoint_every: usize,
    /// Write the final parameters here (safetensors; the chief does, or every worker with
    /// `{task}` in the path, which is replaced by the worker's index).
    #[arg(long)]
    pub save_params: Option<PathBuf>,
    /// Stop after this many steps in total (a resumed run counts the steps before its
    /// checkpoint), for tests of interruption and resumption.
    #[arg(long, hide = true)]
    pub max_steps: Option<usize>,
    /// Parameter server: ps tasks to start (without TF_CONFIG).
    #[arg(long, default_value_t = 2)]
    pub ps_tasks: usize,
    /// Parameter server: worker tasks to start (without TF_CONFIG).
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Parameter server: how pushes are applied.
    #[arg(long, value_enum, default_value = "async")]
    pub ps_mode: PsModeKind,
    /// Parameter server, sync mode: backup workers (a round is applied after workers minus
    /// this many pushes; the late ones are dropped).
    #[arg(long, default_value_t = 0)]
    pub backup_workers: u32,
    /// Parameter server, stale mode: the largest accepted staleness, in versions.
    #[arg(long, default_value_t = 4)]
    pub staleness: u64,
    /// Parameter server, async and stale modes: the rate a push's dense variables are applied
    /// at when other updates landed between its pull and it (constant: the optimizer's;
    /// inverse: lr / (1 + those updates), and the workers compute at the pulled values, with no
    /// look-ahead). Embedding tables' rows keep their rate. Default: inverse for --model ctr,
    /// constant for the others.
    #[arg(long, value_enum)]
    pub stale_rate: Option<StaleRateKind>,
    /// The optimizer of embedding tables' rows (the ctr model's table): on the ps tasks under
    /// parameter-server (default adagrad); under one-device, mirrored or central-storage the
    /// table is then rows in this process's memory, stepped one by one, instead of a variable.
    #[arg(long, value_enum)]
    pub table_optimizer: Option<TableOptimizerKind>,
    /// The learning rate of `--table-optimizer` (default 0.05).
    #[arg(long)]
    pub table_lr: Option<f64>,
    /// Parameter server: how variables are split over ps tasks: none, fixed:N,
    /// `min:BYTES[:MAX_SHARDS]`, `max:BYTES[:MAX_SHARDS]` (TensorFlow's partitioners).
    #[arg(long, default_value = "none")]
    pub partitioner: String,
    /// Momentum: the coefficient of --optimizer momentum and AdamW's beta1 (adamw,
    /// candle-adamw), under every strategy. Asynchronous parameter servers gain more from a lower
    /// --lr than from a lower momentum (the transformer with 2 async workers: --lr 0.0013; see
    /// docs/parameter-servers.md).
    #[arg(long, default_value_t = 0.9, value_parser = momentum_parser)]
    pub momentum: f64,
    /// Slow worker INDEX down by FACTOR (a straggler: its steps sleep FACTOR - 1 times their
    /// compute time), e.g. 2=5; repeatable. Workers are worker tasks in multi-worker and
    /// parameter-server jobs, replicas otherwise.
    #[arg(long, value_name = "INDEX=FACTOR")]
    pub worker_slowdown: Vec<String>,
    /// Random stragglers: the chance that a worker's step is delayed (with --straggler-delay).
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    pub straggler_probability: f64,
    /// Random stragglers: how long, fixed:50ms, uniform:10ms..50ms or exp:20ms (the mean).
    #[arg(long, value_name = "DISTRIBUTION")]
    pub straggler_delay: Option<String>,
    /// Add this delay to every data-plane message between processes (ring frames, pulls,
    /// pushes), e.g. 2ms.
    #[arg(long, value_name = "DURATION", value_parser = parse_delay)]
    pub network_delay: Option<std::time::Duration>,
    /// Parameter-server ps and worker tasks: exit with an error once no call at all has come
    /// for this long (the chief probes every task twice a second, so silence means it is gone
    /// for good); 0 serves until stopped. The chief's end of the job ends them at once.
    #[arg(long, default_value = "60s", value_name = "DURATION", value_parser = strata_compare::experiment::parse_duration_or_seconds)]
    pub chief_timeout: std::time::Duration,
    /// Write a JSON line per step and per evaluation here (wall time, loss, staleness, bytes,
    /// accuracy), as `strata compare` reads them.
    #[arg(long, value_name = "FILE")]
    pub metrics: Option<PathBuf>,
}

fn parse_delay(s: &str) -> std::result::Result<std::time::Duration, String> {
    strata_compare::experiment::parse_duration(s)
}

/// `--momentum`: a coefficient in [0, 1).
fn momentum_parser(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(m) if m.is_finite() && (0.0..1.0).contains(&m) => Ok(m),
        _ => Err(format!("momentum {s:?} is not a coefficient in [0, 1): use e.g. 0.9 (the default) or 0.4")),
    }
}

impl TrainArgs {
    /// `--sync-every` and its options as the library's settings (`None`: every step
    /// synchronous).
    pub fn local_sgd(&self) -> Option<strata::LocalSgd> {
        use strata::OuterOptimizer;
        let nesterov = OuterOptimizer::Nesterov { lr: self.outer_lr, momentum: self.outer_momentum };
        let outer = match self.outer_optimizer {
            Some(OuterKind::Average) => OuterOptimizer::Average,
            Some(OuterKind::Nesterov) => nesterov,
            None if self.sync_every > 1 => nesterov,
            None => OuterOptimizer::Average,
        };
        let l = strata::LocalSgd {
            every: self.sync_every,
            outer,
            fragments: self.fragments,
            delay: self.sync_delay,
            wire: self.compression,
        };
        (!l.is_synchronous()).then_some(l)
    }

    /// Refuses local SGD's options where they cannot apply, each in one line.
    fn check_local_sgd(&self) -> Result<()> {
        let asked =
            self.sync_every != 1 || self.outer_optimizer.is_some() || self.fragments != 1 || self.sync_delay.is_some();
        if self.compression == Compression::Int8 && self.local_sgd().is_none() {
            return Err(Error::Usage(
                "--compression int8 carries local SGD's outer gradients (--sync-every above 1), not per-step gradients: use fp16 or bf16 for those".into(),
            ));
        }
        if !asked {
            return Ok(());
        }
        let usage = |m: String| Err(Error::Usage(m));
        let Some(l) = self.local_sgd() else {
            return usage(
                "--fragments and --sync-delay apply to local SGD (--sync-every above 1, or --outer-optimizer nesterov); drop them".into(),
            );
        };
        if self.strategy != StrategyKind::MultiWorkerMirrored {
            return usage(format!(
                "--sync-every {} applies to --strategy multi-worker-mirrored, whose workers step on their own between meetings (--strategy {} has no workers to meet); drop it",
                self.sync_every,
                self.strategy.name()
            ));
        }
        l.check().map_err(|e| Error::Usage(e.to_string()))?;
        if self.zero_stage != ZeroStage::Off {
            return usage(format!(
                "--zero-stage {} shards over every worker's replicas, but --sync-every {} steps each worker on its own: use --zero-stage 0 with it",
                self.zero_stage, self.sync_every
            ));
        }
        Ok(())
    }

    /// The optimizer's learning rate and momentum (`--lr`, `--momentum`).
    pub fn hyper(&self) -> strata::Hyper {
        strata::Hyper { lr: self.lr, momentum: self.momentum }
    }

    /// The MLP's hidden layer sizes (`--hidden`, or 256,256).
    pub fn hidden(&self) -> Vec<usize> {
        self.hidden_flag.clone().unwrap_or_else(|| vec![256, 256])
    }

    /// The transformer's shape: `--width`, `--layers` and `--heads` over the default (0.82M
    /// parameters), Tiny Shakespeare's 65 characters, a context of 64.
    pub fn transformer(&self) -> TransformerConfig {
        let d = TransformerConfig::default();
        TransformerConfig {
            width: self.width.unwrap_or(d.width),
            layers: self.layers.unwrap_or(d.layers),
            heads: self.heads.unwrap_or(d.heads),
            ..d
        }
    }

    /// Passes over the training set (`--epochs`, or the model's default).
    pub fn epochs(&self) -> usize {
        self.epochs_flag.unwrap_or(if matches!(self.model, ModelKind::Transformer | ModelKind::Ctr) { 1 } else { 30 })
    }

    /// The ctr model's shape (`--embedding-rows`, `--embedding-dim`).
    pub fn ctr(&self) -> strata::ctr::DlrmConfig {
        strata::ctr::DlrmConfig::new(
            self.embedding_rows.unwrap_or(CTR_ROWS),
            self.embedding_dim.unwrap_or(strata::ctr::DlrmConfig::DEFAULT_DIM),
        )
    }

    /// The ctr model's training and test records (`--train-records`, `--test-records`).
    pub fn ctr_records(&self) -> (u64, u64) {
        (self.train_records.unwrap_or(CTR_TRAIN_RECORDS), self.test_records.unwrap_or(CTR_TEST_RECORDS))
    }

    /// The rows' optimizer: `--table-optimizer` (default adagrad) at `--table-lr` (default
    /// 0.05).
    pub fn row_optimizer(&self) -> strata::ps::RowOptimizer {
        self.table_optimizer.unwrap_or(TableOptimizerKind::Adagrad).row_optimizer(self.table_lr.unwrap_or(0.05))
    }

    /// Refuses the table flags where they do not apply, one line each: `--table-lr` not a
    /// positive rate, or without `--table-optimizer` outside parameter-server; a strategy local
    /// tables cannot serve (the library's refusal).
    fn check_table_flags(&self) -> Result<()> {
        if let Some(lr) = self.table_lr.filter(|lr| !(lr.is_finite() && *lr > 0.0)) {
            return Err(Error::Usage(format!("--table-lr {lr} is not a positive learning rate")));
        }
        if self.strategy == StrategyKind::ParameterServer {
            return Ok(());
        }
        if self.table_optimizer.is_none() && self.table_lr.is_some() {
            return Err(Error::Usage(
                "--table-lr applies to the rows of --table-optimizer; add --table-optimizer sgd, adagrad, ftrl or lazy-adam, or drop it".into(),
            ));
        }
        if self.table_optimizer.is_some() {
            let multi_worker = self.strategy == StrategyKind::MultiWorkerMirrored;
            strata_strategies::LocalTables::check_strategy(self.strategy.name(), multi_worker)
                .map_err(|e| Error::Usage(format!("--table-optimizer: {e}")))?;
        }
        Ok(())
    }

    /// Refuses what the ctr model cannot do, and its flags on other models, one line each.
    fn check_ctr_flags(&self) -> Result<()> {
        let m = self.model.name();
        if self.model != ModelKind::Ctr {
            let flags = [
                ("--embedding-rows", self.embedding_rows.is_some()),
                ("--embedding-dim", self.embedding_dim.is_some()),
                ("--train-records", self.train_records.is_some()),
                ("--test-records", self.test_records.is_some()),
                ("--table-optimizer", self.table_optimizer.is_some()),
                ("--table-lr", self.table_lr.is_some()),
            ];
            return match flags.iter().find(|(_, set)| *set) {
                Some((flag, _)) => {
                    Err(Error::Usage(format!("{flag} applies to --model ctr, not --model {m}; drop it")))
                }
                None => Ok(()),
            };
        }
        self.check_table_flags()?;
        if self.strategy == StrategyKind::ParameterServer && self.replicas.unwrap_or(1) != 1 {
            return Err(Error::Usage(format!(
                "--replicas {}: a parameter-server worker with embedding tables runs one replica; start more workers (--workers) instead",
                self.replicas.unwrap_or(1)
            )));
        }
        let refuse = |flag: &str, applies: &str| {
            Err(Error::Usage(format!("{flag} applies to {applies}, not --model ctr; drop it")))
        };
        if self.data.is_some() {
            return refuse("--data", "the digits models (--model mlp or cnn); the ctr records are generated (--seed)");
        }
        if self.auto_shard() == AutoShardKind::File {
            return refuse("--auto-shard file", "the digits models (--model mlp or cnn)");
        }
        if self.recompute {
            return refuse("--recompute", "--model mlp or transformer");
        }
        if self.precision != strata::Precision::F32 {
            return refuse(&format!("--precision {}", self.precision), "--model mlp, cnn or transformer");
        }
        let (train, test) = self.ctr_records();
        if train == 0 || test == 0 {
            return Err(Error::Usage(format!(
                "--train-records {train} and --test-records {test}: the ctr model needs at least one record of each"
            )));
        }
        if train.max(test) > 1 << 32 {
            return Err(Error::Usage(format!(
                "--train-records {train} and --test-records {test}: at most 2^32 each (their keys are held as tensors)"
            )));
        }
        self.ctr().check()
    }

    /// fp16's dynamic loss scaling (`--precision fp16`, from `--initial-loss-scale`); `None`
    /// at the other precisions.
    pub fn loss_scale(&self) -> Option<strata::LossScale> {
        let initial = self.initial_loss_scale.unwrap_or(strata::LossScale::default().initial);
        self.precision.needs_loss_scale().then(|| strata::LossScale { initial, ..Default::default() })
    }

    /// The global batch (`--batch`, or the model's default).
    pub fn batch(&self) -> usize {
        self.batch_flag.unwrap_or(if self.model == ModelKind::Transformer { 32 } else { 256 })
    }

    /// `--bucket-mib`, or 25.
    pub fn bucket_mib(&self) -> f64 {
        self.bucket_mib.unwrap_or(25.0)
    }

    /// `--row-block-mib`, or 2.
    pub fn row_block_mib(&self) -> f64 {
        self.row_block_mib.unwrap_or(2.0)
    }

    /// `--collective-timeout`, or 60 seconds.
    pub fn collective_timeout(&self) -> f64 {
        self.collective_timeout.unwrap_or(60.0)
    }

    /// `--auto-shard`, or data.
    pub fn auto_shard(&self) -> AutoShardKind {
        self.auto_shard.unwrap_or(AutoShardKind::Data)
    }

    /// The ps tasks' rate of stale pushes: `--stale-rate`, by default inverse for the click
    /// model (whose dense layers staleness pushes past their rate, and the look-ahead further:
    /// `docs/bench/2026-12-07-0154-ctr-stale-rate.md`) and constant (TensorFlow's) for the
    /// others.
    pub fn stale_rate(&self) -> StaleRateKind {
        let default = match (self.model, self.ps_mode) {
            (ModelKind::Ctr, PsModeKind::Async | PsModeKind::Stale) => StaleRateKind::Inverse,
            _ => StaleRateKind::Constant,
        };
        self.stale_rate.unwrap_or(default)
    }

    /// `--stale-rate` and `--no-lookahead`, refused where no push to a ps task can be stale.
    fn check_staleness_flags(&self) -> Result<()> {
        let stale_modes = [PsModeKind::Async, PsModeKind::Stale];
        if self.stale_rate.is_some_and(|r| r != StaleRateKind::Constant)
            && (self.strategy != StrategyKind::ParameterServer || !stale_modes.contains(&self.ps_mode))
        {
            let job = match (self.strategy, self.ps_mode) {
                (StrategyKind::ParameterServer, PsModeKind::Sync) => "--ps-mode sync".to_string(),
                (StrategyKind::ParameterServer, _) => "--ps-mode hybrid".to_string(),
                (other, _) => format!("--strategy {}", other.name()),
            };
            return Err(Error::Usage(format!(
                "--stale-rate applies to --strategy parameter-server's async and stale modes, whose pushes can be stale ({job} has none on its ps tasks' dense variables); drop it"
            )));
        }
        if self.no_lookahead && self.strategy != StrategyKind::ParameterServer {
            return Err(Error::Usage(format!(
                "--no-lookahead applies to --strategy parameter-server, whose pushes can be stale (--strategy {} has none); drop it",
                self.strategy.name()
            )));
        }
        Ok(())
    }

    /// Refuses the all-reduce's flags on an async, sync or stale parameter-server job, whose
    /// workers push and pull (only a hybrid job's workers all-reduce).
    fn check_push_pull_flags(&self) -> Result<()> {
        if self.strategy == StrategyKind::ParameterServer && self.ps_mode != PsModeKind::Hybrid {
            let flags = [
                ("--bucket-mib", self.bucket_mib.is_some()),
                ("--row-block-mib", self.row_block_mib.is_some()),
                ("--collective-timeout", self.collective_timeout.is_some()),
                ("--auto-shard", self.auto_shard.is_some()),
            ];
            if let Some((flag, _)) = flags.iter().find(|(_, set)| *set) {
                let mode = clap::ValueEnum::to_possible_value(&self.ps_mode)
                    .map_or_else(String::new, |v| v.get_name().to_string());
                return Err(Error::Usage(format!(
                    "{flag} applies to workers that all-reduce (multi-worker-mirrored, mirrored, --ps-mode hybrid), and a --ps-mode {mode} job's workers push and pull; drop it"
                )));
            }
        }
        Ok(())
    }

    /// Refuses flags that do not apply to `--model` (or the strategy), one line each.
    pub(crate) fn check_model_flags(&self) -> Result<()> {
        if let Some(n) = self.min_workers {
            if self.strategy != StrategyKind::MultiWorkerMirrored {
                return Err(Error::Usage(format!(
                    "--min-workers applies to --strategy multi-worker-mirrored, whose workers keep identical copies a lost one can be dropped from (--strategy {} is not elastic); drop it",
                    self.strategy.name()
                )));
            }
            if n == 0 {
                return Err(Error::Usage("--min-workers 0: a job needs a worker to train; pass 1 or more".into()));
            }
            if self.auto_shard() == AutoShardKind::File {
                return Err(Error::Usage(
                    "--min-workers with --auto-shard file: whole files belong to workers, and an elastic job re-splits every step over the workers that live; use --auto-shard data".into(),
                ));
            }
            if self.coordinator.is_none() {
                return Err(Error::Usage(format!(
                    "--min-workers {n}: an elastic job needs a coordination service that outlives its workers; run it under strata launch (which serves one), or pass --coordinator HOST:PORT"
                )));
            }
        }
        if self.max_restarts > 0 && self.strategy != StrategyKind::ParameterServer {
            return Err(Error::Usage(format!(
                "--max-restarts {} applies to --strategy parameter-server's local cluster; a multi-worker-mirrored job's lost task is restarted by strata launch --max-restarts (with --min-workers), drop it",
                self.max_restarts
            )));
        }
        self.check_staleness_flags()?;
        self.check_push_pull_flags()?;
        // A hybrid job's workers train as multi-worker mirrored does, and trace their replicas.
        if self.timeline.is_some()
            && self.strategy == StrategyKind::ParameterServer
            && self.ps_mode != PsModeKind::Hybrid
        {
            return Err(Error::Usage(
                "--timeline traces the replicas of this process, and a parameter-server job's steps run in its worker processes: use --metrics for their step records (or --ps-mode hybrid), and drop it".into(),
            ));
        }
        if let Some(limit) = self.memory_limit {
            let limit = strata_core::device::format_bytes(limit);
            if self.strategy == StrategyKind::ParameterServer || self.gpus.is_some() {
                return Err(Error::Usage(format!(
                    "--memory-limit {limit} applies to the logical CPU devices of one-device, mirrored, central-storage and multi-worker-mirrored jobs (not to the parameter server's tasks nor to --gpus); drop it"
                )));
            }
        }
        if !self.zero_units.is_empty() && !self.zero_stage.shards_parameters() {
            return Err(Error::Usage(format!(
                "--zero-units applies to --zero-stage 3, which gathers parameters by unit (this run is at stage {}); drop it or add --zero-stage 3",
                self.zero_stage
            )));
        }
        if self.zero_stage != ZeroStage::Off {
            let stage = self.zero_stage;
            strata::refusals::zero_stage_of(stage, self.strategy, self.optimizer)?;
            if self.min_workers.is_some() {
                // The trainer refuses it too, but only once the workers have joined. fp16's loss
                // scale is state the optimizer keeps too.
                let checkpointed = self.checkpoint_dir.is_some();
                if self.precision.needs_loss_scale() {
                    strata::refusals::elastic_zero_state(stage, true, checkpointed)?;
                }
                strata::refusals::elastic_zero_state_of(stage, self.optimizer, checkpointed)?;
            }
        }
        self.check_local_sgd()?;
        match (self.strategy, self.compression) {
            (_, Compression::None) | (StrategyKind::MultiWorkerMirrored, _) => {}
            // The workers' pushes and pulls travel in 16 bits; PowerSGD is refused here as the
            // strategy would refuse it, but before the ps and worker tasks start.
            (StrategyKind::ParameterServer, c) => {
                strata::ParameterServerOptions::wire_format_of(c)?;
            }
            (strategy, c) => {
                return Err(Error::Usage(format!(
                    "--compression {c} applies to --strategy multi-worker-mirrored and parameter-server, whose gradients cross a network (--strategy {} has none on a wire); drop it",
                    strategy.name()
                )));
            }
        }
        self.check_ctr_flags()?;
        let m = self.model.name();
        let refuse = |flag: &str, applies: &str| {
            Err(Error::Usage(format!("{flag} applies to {applies}, not --model {m}; drop it")))
        };
        if self.model != ModelKind::Mlp && self.hidden_flag.is_some() {
            return refuse("--hidden", "--model mlp");
        }
        if self.model == ModelKind::Cnn && self.recompute {
            return refuse("--recompute", "--model mlp or transformer");
        }
        if let Some(initial) = self.initial_loss_scale {
            if !self.precision.needs_loss_scale() {
                return Err(Error::Usage(format!(
                    "--initial-loss-scale applies to --precision fp16, not --precision {}; drop it",
                    self.precision
                )));
            }
            strata::LossScale { initial, ..Default::default() }
                .check()
                .map_err(|e| Error::Usage(format!("--initial-loss-scale: {e}")))?;
        }
        if self.precision.needs_loss_scale() && self.strategy == StrategyKind::ParameterServer {
            return Err(Error::Usage(
                "--precision fp16 needs loss scaling, whose skipped steps every worker must skip alike, which asynchronous parameter servers cannot do; use --precision bf16 (no loss scaling) or a synchronous strategy".into(),
            ));
        }
        if self.model != ModelKind::Transformer {
            if self.steps.is_some() {
                return refuse("--steps", "--model transformer");
            }
            for (flag, set) in [("--width", self.width), ("--layers", self.layers), ("--heads", self.heads)] {
                if set.is_some() {
                    return refuse(flag, "--model transformer");
                }
            }
            if self.sample.is_some() {
                return refuse("--sample", "--model transformer");
            }
        } else {
            if self.data.is_some() {
                return refuse("--data", "the digits models (--model mlp or cnn)");
            }
            if self.auto_shard() == AutoShardKind::File {
                return refuse("--auto-shard file", "the digits models (--model mlp or cnn)");
            }
            if self.steps == Some(0) {
                return Err(Error::Usage("--steps 0 trains nothing; pass --steps 1 or more".into()));
            }
            // The library's refusal of a shape that cannot be built (a width the heads do not
            // divide, a zero, more parameters than the limit), before anything starts.
            self.transformer().check()?;
        }
        Ok(())
    }

    /// The slow workers and stragglers the flags ask for.
    pub fn step_delays(&self) -> Result<StepDelays> {
        StepDelays::from_flags(
            &self.worker_slowdown,
            self.straggler_probability,
            self.straggler_delay.as_deref(),
            self.seed,
        )
    }

    /// The slow workers and stragglers the flags ask for, as a trainer's step hook (none when
    /// no step is ever delayed).
    pub fn step_hook(&self) -> Result<Option<Arc<dyn strata::trainer::StepHook>>> {
        let delays = self.step_delays()?;
        Ok((!delays.is_empty()).then(|| Arc::new(delays) as Arc<dyn strata::trainer::StepHook>))
    }

    /// The metrics file's writer, if asked for: the file is started afresh by the process
    /// that writes first (`fresh`, the chief at the start) and appended to by the others (a
    /// worker that leads an elastic job after its chief, or joined it under way).
    pub fn metrics_writer(&self, fresh: bool) -> Result<Option<Arc<strata::metrics::MetricsWriter>>> {
        let open = if fresh { strata::metrics::MetricsWriter::create } else { strata::metrics::MetricsWriter::append };
        self.metrics.as_deref().map(|p| open(p).map(Arc::new)).transpose()
    }
}

fn parse_cross_device_ops(s: &str) -> std::result::Result<strata_cuda::select::CrossDeviceChoice, String> {
    s.parse().map_err(|e: strata_cuda::Error| e.to_string())
}

fn parse_slurm_jobs(s: &str) -> std::result::Result<SlurmJobs, String> {
    s.parse().map_err(|e: strata_core::Error| e.to_string())
}

/// The resolver of `--cluster` (with `--slurm-jobs`).
pub fn resolver(args: &TrainArgs) -> Result<Box<dyn ClusterResolver>> {
    Ok(match (args.cluster, &args.slurm_jobs) {
        (ClusterSource::TfConfig, Some(_)) => {
            return Err(Error::Usage(
                "--slurm-jobs applies to --cluster slurm; with TF_CONFIG the jobs are TF_CONFIG's own".into(),
            ))
        }
        (ClusterSource::TfConfig, None) => Box::new(TFConfigClusterResolver::from_env()?),
        (ClusterSource::Slurm, None) => Box::new(SlurmClusterResolver::from_env()),
        (ClusterSource::Slurm, Some(jobs)) => Box::new(SlurmClusterResolver::from_env().jobs(jobs.clone())),
    })
}

/// `--memory-limit`: a positive size such as 40MiB.
fn parse_memory_limit(s: &str) -> std::result::Result<u64, String> {
    match strata_core::device::parse_bytes(s) {
        Ok(0) => Err("a memory limit of 0 bytes; give a positive size such as 40MiB".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// `--zero-stage`: `0`, `1`, `2` or `3`.
fn parse_zero_stage(s: &str) -> std::result::Result<ZeroStage, String> {
    s.parse::<ZeroStage>().map_err(|e| e.to_string())
}

/// `--outer-optimizer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OuterKind {
    /// Local SGD: the workers' parameters averaged.
    Average,
    /// DiLoCo: Nesterov momentum on the workers' mean outer gradient.
    Nesterov,
}

/// `--compression`: `none`, `fp16`, `bf16`, `int8` or `powersgd:RANK`.
fn parse_compression(s: &str) -> std::result::Result<Compression, String> {
    s.parse::<Compression>().map_err(|e| e.to_string())
}

impl TrainArgs {
    /// Where the trainer's checkpoints go: --checkpoint-dir, or for a hybrid job (whose ps
    /// tasks write theirs under `ps-<index>` of it) its `dense` directory.
    pub(crate) fn trainer_checkpoint_dir(&self) -> Option<PathBuf> {
        let dir = self.checkpoint_dir.as_ref()?;
        Some(match (self.strategy, self.ps_mode) {
            (StrategyKind::ParameterServer, PsModeKind::Hybrid) => dir.join(HYBRID_DENSE_DIR),
            _ => dir.clone(),
        })
    }
}

/// The directory of a hybrid job's dense checkpoints under --checkpoint-dir.
pub(crate) const HYBRID_DENSE_DIR: &str = "dense";

/// Refuses a `--checkpoint-dir` this process cannot write, naming it (exit code 2).
pub(crate) fn checkpoint_dir_writable(dir: &std::path::Path) -> Result<()> {
    strata::checkpoint::check_writable(dir).map_err(|e| match e {
        strata_core::Error::Checkpoint(m) => Error::Usage(format!("--checkpoint-dir {m}")),
        other => other.into(),
    })
}

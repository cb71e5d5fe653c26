//! `strata train`: the main job.

use std::path::PathBuf;
use std::sync::Arc;

use serde::Serialize;
use strata_core::cross_device::compression::Compression;
use strata_core::strategy::AutoShardPolicy;
use strata_core::timeline::Timeline;
use strata_core::{Strategy, StrategyHandle, StrategyOptions, ZeroStage};
use strata_strategies::cluster::{ClusterResolver, SlurmClusterResolver, SlurmJobs, TFConfigClusterResolver};
use strata_strategies::{
    CentralStorageStrategy, CpuReduction, MirroredStrategy, MultiWorkerMirroredStrategy, MultiWorkerOptions,
    OneDeviceStrategy,
};

use strata::cnn::Cnn;
use strata::digits;
use strata::model::Mlp;
use strata::optim::schedule::LrSchedule;
use strata::shakespeare;
use strata::trainer::{FitReport, StopSignal, TrainConfig, Trainer};
use strata::transformer::{CharTransformer, TransformerConfig};
use strata::{OptimizerKind, StrategyKind};
use strata_compare::inject::StepDelays;

use crate::{kind_parser, Error, Result};

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
}

impl ModelKind {
    /// Its name on the command line and in summaries.
    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Mlp => "mlp",
            ModelKind::Cnn => "cnn",
            ModelKind::Transformer => "transformer",
        }
    }
}

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
    /// The model: mlp (digits), cnn (digits as 8x8 images) or transformer (Tiny Shakespeare);
    /// every strategy trains each, parameter servers included.
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
    /// Gradient fusion bucket size in MiB (0: one bucket per tensor); across workers, buckets
    /// are also at most an eighth of the gradient (at least 1 MiB).
    #[arg(long, default_value_t = 25.0)]
    pub bucket_mib: f64,
    /// Across workers, a large weight's gradient is computed and reduced in blocks of rows of
    /// this many MiB, each sent while the backward pass computes the next (0: whole).
    #[arg(long, default_value_t = 2.0)]
    pub row_block_mib: f64,
    /// How gradients cross the network: `none` (f32, exact), `fp16` or `bf16` (16 bits on the
    /// wire: multi-worker-mirrored's ring, every hop adding in f32, or the parameter server's
    /// pushes and pulls), or `powersgd:RANK` (multi-worker-mirrored: matrix gradients as two
    /// rank-RANK factors, with error feedback).
    #[arg(long, default_value = "none", value_parser = parse_compression)]
    pub compression: Compression,
    /// Reduce after the backward pass instead of overlapping the reduction with it.
    #[arg(long)]
    pub no_overlap: bool,
    /// ZeRO: 0 (every replica keeps the whole optimizer state), 1 (each replica, across every
    /// worker, keeps the optimizer state of its shard of the parameters and steps that shard)
    /// or 2 (and keeps the reduced gradient of its shard only); mirrored and
    /// multi-worker-mirrored, with the fused optimizers.
    #[arg(long, default_value = "0", value_parser = parse_zero_stage)]
    pub zero_stage: ZeroStage,
    /// The memory each replica's logical CPU device may give its model state (parameters,
    /// gradients, optimizer state), such as `40MiB` or `2GB`: a job over it stops before
    /// training, naming the bytes and the ZeRO stage that would fit.
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
    /// Multi-worker: how the data is split across workers.
    #[arg(long, value_enum, default_value = "data")]
    pub auto_shard: AutoShardKind,
    /// Deadline of every collective, in seconds.
    #[arg(long, default_value_t = 60.0)]
    pub collective_timeout: f64,
    /// Write checkpoints here (the chief does), and resume from the latest one found.
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
    /// The optimizer's learning rate and momentum (`--lr`, `--momentum`).
    pub fn hyper(&self) -> strata::Hyper {
        strata::Hyper { lr: self.lr, momentum: self.momentum }
    }

    /// The MLP's hidden layer sizes (`--hidden`, or 256,256).
    pub fn hidden(&self) -> Vec<usize> {
        self.hidden_flag.clone().unwrap_or_else(|| vec![256, 256])
    }

    /// Passes over the training set (`--epochs`, or the model's default).
    pub fn epochs(&self) -> usize {
        self.epochs_flag.unwrap_or(if self.model == ModelKind::Transformer { 1 } else { 30 })
    }

    /// The global batch (`--batch`, or the model's default).
    pub fn batch(&self) -> usize {
        self.batch_flag.unwrap_or(if self.model == ModelKind::Transformer { 32 } else { 256 })
    }

    /// Refuses flags that do not apply to `--model` (or the strategy), one line each.
    fn check_model_flags(&self) -> Result<()> {
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
            if self.auto_shard == AutoShardKind::File {
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
        if self.no_lookahead && self.strategy != StrategyKind::ParameterServer {
            return Err(Error::Usage(format!(
                "--no-lookahead applies to --strategy parameter-server, whose pushes can be stale (--strategy {} has none); drop it",
                self.strategy.name()
            )));
        }
        if let Some(limit) = self.memory_limit {
            let limit = strata_core::device::format_bytes(limit);
            if self.strategy == StrategyKind::ParameterServer || self.gpus.is_some() {
                return Err(Error::Usage(format!(
                    "--memory-limit {limit} applies to the logical CPU devices of one-device, mirrored, central-storage and multi-worker-mirrored jobs (not to the parameter server's tasks nor to --gpus); drop it"
                )));
            }
        }
        if self.zero_stage != ZeroStage::Off {
            let stage = self.zero_stage;
            if !matches!(self.strategy, StrategyKind::Mirrored | StrategyKind::MultiWorkerMirrored) {
                return Err(Error::Usage(format!(
                    "--zero-stage {stage} applies to --strategy mirrored and multi-worker-mirrored, whose replicas each keep a whole copy of the optimizer state (--strategy {} does not); drop it",
                    self.strategy.name()
                )));
            }
            if matches!(self.optimizer, OptimizerKind::CandleAdamw | OptimizerKind::CandleSgd) {
                return Err(Error::Usage(format!(
                    "--zero-stage {stage} with --optimizer {}: candle-nn's optimizers step whole variables; use --optimizer adamw or sgd (Strata's fused ones)",
                    self.optimizer
                )));
            }
            if self.min_workers.is_some() && self.optimizer == OptimizerKind::Adamw && self.checkpoint_dir.is_none() {
                return Err(Error::Usage(format!(
                    "--zero-stage {stage} with --min-workers and --optimizer adamw: a lost worker takes its shard of AdamW's state with it, and the job then rolls back to its last checkpoint; add --checkpoint-dir DIR (--checkpoint-every N says how far back), or use --optimizer sgd, which keeps no state"
                )));
            }
        }
        match (self.strategy, self.compression) {
            (_, Compression::None) | (StrategyKind::MultiWorkerMirrored, _) => {}
            // The workers' pushes and pulls travel in 16 bits.
            (StrategyKind::ParameterServer, Compression::Fp16 | Compression::Bf16) => {}
            (StrategyKind::ParameterServer, c @ Compression::PowerSgd { .. }) => {
                return Err(Error::Usage(format!(
                    "--compression {c} applies to --strategy multi-worker-mirrored's ring; use none, fp16 or bf16 with --strategy parameter-server"
                )));
            }
            (strategy, c) => {
                return Err(Error::Usage(format!(
                    "--compression {c} applies to --strategy multi-worker-mirrored and parameter-server, whose gradients cross a network (--strategy {} has none on a wire); drop it",
                    strategy.name()
                )));
            }
        }
        let m = self.model.name();
        let refuse = |flag: &str, applies: &str| {
            Err(Error::Usage(format!("{flag} applies to {applies}, not --model {m}; drop it")))
        };
        if self.model != ModelKind::Mlp && self.hidden_flag.is_some() {
            return refuse("--hidden", "--model mlp");
        }
        if self.model != ModelKind::Transformer {
            if self.steps.is_some() {
                return refuse("--steps", "--model transformer");
            }
            if self.sample.is_some() {
                return refuse("--sample", "--model transformer");
            }
        } else {
            if self.data.is_some() {
                return refuse("--data", "the digits models (--model mlp or cnn)");
            }
            if self.auto_shard == AutoShardKind::File {
                return refuse("--auto-shard file", "the digits models (--model mlp or cnn)");
            }
            if self.steps == Some(0) {
                return Err(Error::Usage("--steps 0 trains nothing; pass --steps 1 or more".into()));
            }
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

/// The JSON summary `--out` writes.
#[derive(Debug, Serialize)]
pub struct Summary {
    /// The model (mlp, cnn, transformer).
    pub model: ModelKind,
    /// The strategy.
    pub strategy: StrategyKind,
    /// Replicas in sync.
    pub replicas: usize,
    /// Hidden layer sizes (the MLP's).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub hidden: Vec<usize>,
    /// Parameters of the model.
    pub parameters: usize,
    /// Epochs.
    pub epochs: usize,
    /// Global batch.
    pub global_batch: usize,
    /// Optimizer.
    pub optimizer: OptimizerKind,
    /// Learning rate.
    pub learning_rate: f64,
    /// Seed.
    pub seed: u64,
    /// Test accuracy after the last epoch (the digits models).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub final_test_accuracy: Option<f32>,
    /// The transformer: validation loss after the last epoch, in nats per character.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub validation_loss: Option<f64>,
    /// The transformer: training tokens per second over the steady-state steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_second: Option<f64>,
    /// Examples per second over the steady-state steps.
    pub examples_per_second: f64,
    /// Wall seconds of the whole run (data loading and evaluation included).
    pub wall_seconds: f64,
    /// Per epoch: loss, test accuracy, step seconds.
    pub history: Vec<strata::trainer::EpochReport>,
    /// Parameter server: what the ps tasks and the coordinator did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameter_servers: Option<crate::ps::PsSummary>,
}

fn parse_cross_device_ops(s: &str) -> std::result::Result<strata_cuda::select::CrossDeviceChoice, String> {
    s.parse().map_err(|e: strata_cuda::Error| e.to_string())
}

/// The refusals of `--gpus N` that depend on the other flags (before any GPU is looked for).
fn check_gpus(args: &TrainArgs, n: usize) -> Result<()> {
    let refusal = match args.strategy {
        _ if n == 0 => {
            "--gpus 0 asks for no GPU; pass 1 or more, or drop --gpus to train on logical CPU devices".to_string()
        }
        StrategyKind::MultiWorkerMirrored if n != 1 => format!(
            "--strategy multi-worker-mirrored --gpus {n}: a worker task holds one GPU; start one task per GPU (e.g. strata launch --workers {n}, or Slurm's --gpus-per-task=1) and pass --gpus 1"
        ),
        StrategyKind::ParameterServer => {
            "--gpus places the replicas of one process; parameter-server jobs keep their replicas on logical CPU devices for now".to_string()
        }
        StrategyKind::OneDevice if n != 1 => {
            format!("--strategy one-device runs 1 replica, not --gpus {n}; use --strategy mirrored")
        }
        _ => return Ok(()),
    };
    Err(Error::Usage(refusal))
}

/// Builds the strategy the flags ask for.
pub fn make_strategy(args: &TrainArgs, options: StrategyOptions) -> Result<StrategyHandle> {
    if let Some(n) = args.gpus {
        check_gpus(args, n)?;
        return strata::gpu::gpu_strategy(args.strategy, n, args.cross_device_ops, options);
    }
    let reduction = match args.reduction {
        ReductionKind::InMemory => CpuReduction::InMemoryAllReduce,
        ReductionKind::ToOneDevice => CpuReduction::ReductionToOneDevice,
    };
    if args.replicas == Some(0) {
        return Err(Error::Usage(
            "--replicas 0: a strategy needs at least one replica; pass --replicas 1 or more".into(),
        ));
    }
    Ok(match args.strategy {
        StrategyKind::OneDevice => {
            if let Some(n) = args.replicas.filter(|&n| n != 1) {
                return Err(Error::Usage(format!(
                    "--strategy one-device runs 1 replica, not {n}; drop --replicas or use --strategy mirrored"
                )));
            }
            let device = cpus(args, 1)?.remove(0);
            OneDeviceStrategy::with_options(device, options)?.handle()
        }
        StrategyKind::Mirrored => {
            let devices = cpus(args, args.replicas.unwrap_or(2))?;
            MirroredStrategy::with_options(devices, reduction, options)?.handle()
        }
        StrategyKind::CentralStorage => {
            let devices = cpus(args, args.replicas.unwrap_or(2))?;
            CentralStorageStrategy::with_options(devices, reduction, options)?.handle()
        }
        StrategyKind::MultiWorkerMirrored | StrategyKind::ParameterServer => {
            return Err(Error::Usage("multi-worker strategies are built by their own functions".into()))
        }
    })
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

/// Joins the multi-worker job this task belongs to.
pub fn make_multi_worker(args: &TrainArgs, options: StrategyOptions) -> Result<MultiWorkerMirroredStrategy> {
    // The GPU checks first: they are this task's own, and fail without a cluster.
    if let Some(n) = args.gpus {
        check_gpus(args, n)?;
    }
    let gpus = args.gpus.map(|n| strata::gpu::multi_worker_gpus(n, args.cross_device_ops)).transpose()?;
    let resolver = resolver(args)?;
    let token = crate::ps::token(args.cluster_token_file.as_deref())?;
    let mut mw = MultiWorkerOptions::new(token)?;
    match gpus {
        Some((devices, ops)) => {
            mw.local_devices = devices;
            mw.cross_worker_ops = ops;
        }
        None => mw.local_devices = cpus(args, args.replicas.unwrap_or(1))?,
    }
    mw.bind = args.bind;
    mw.options = options;
    mw.compression = args.compression;
    if let (Some(min_workers), Some(coordinator)) = (args.min_workers, &args.coordinator) {
        mw.elastic = Some(strata::ElasticOptions { min_workers, coordinator: coordinator.clone() });
    }
    mw.auto_shard = match args.auto_shard {
        AutoShardKind::Data => AutoShardPolicy::Data,
        AutoShardKind::Off => AutoShardPolicy::Off,
        // The command hands each worker its files itself (`worker_data`); what a worker then
        // holds is its own part of every step.
        AutoShardKind::File => AutoShardPolicy::Off,
    };
    Ok(MultiWorkerMirroredStrategy::from_resolver(resolver.as_ref(), mw)?)
}

/// `--zero-stage`: `0`, `1` or `2`.
fn parse_memory_limit(s: &str) -> std::result::Result<u64, String> {
    match strata_core::device::parse_bytes(s) {
        Ok(0) => Err("a memory limit of 0 bytes; give a positive size such as 40MiB".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// `n` logical CPU devices of one thread each, with `--memory-limit` if given.
fn cpus(args: &TrainArgs, n: usize) -> Result<Vec<strata_core::device::LogicalDevice>> {
    let mut devices = strata_core::device::logical_cpus(n)?;
    for d in &mut devices {
        if let strata_core::device::LogicalKind::Cpu { memory_limit, .. } = &mut d.kind {
            *memory_limit = args.memory_limit;
        }
    }
    Ok(devices)
}

fn parse_zero_stage(s: &str) -> std::result::Result<ZeroStage, String> {
    s.parse::<ZeroStage>().map_err(|e| e.to_string())
}

/// `--compression`: `none`, `fp16`, `bf16` or `powersgd:RANK`.
fn parse_compression(s: &str) -> std::result::Result<Compression, String> {
    s.parse::<Compression>().map_err(|e| e.to_string())
}

/// Refuses a `--checkpoint-dir` this process cannot write, naming it (exit code 2).
pub(crate) fn checkpoint_dir_writable(dir: &std::path::Path) -> Result<()> {
    strata::checkpoint::check_writable(dir).map_err(|e| match e {
        strata_core::Error::Checkpoint(m) => Error::Usage(format!("--checkpoint-dir {m}")),
        other => other.into(),
    })
}

/// Trains and reports.
pub fn run(args: &TrainArgs) -> Result<()> {
    let started = std::time::Instant::now();
    args.check_model_flags()?;
    let hidden = args.hidden();
    if hidden.is_empty() || hidden.contains(&0) {
        return Err(Error::Usage("--hidden needs layer sizes of at least 1, e.g. --hidden 256,256".into()));
    }
    strata::model::check_mlp(digits::FEATURES, &hidden, digits::CLASSES)
        .map_err(|e| Error::Usage(format!("--hidden: {e}")))?;
    if args.epochs() == 0 {
        return Err(Error::Usage("--epochs 0 trains nothing; pass --epochs 1 or more".into()));
    }
    if !(args.lr.is_finite() && args.lr > 0.0) {
        return Err(Error::Usage(format!("--lr {} is not a positive learning rate", args.lr)));
    }
    if args.batch() == 0 {
        return Err(Error::Usage("--batch 0: a step needs at least 1 example; pass --batch 1 or more".into()));
    }
    if !(args.bucket_mib.is_finite() && args.bucket_mib >= 0.0) {
        return Err(Error::Usage(format!("--bucket-mib {} must be 0 or more", args.bucket_mib)));
    }
    if !(args.row_block_mib.is_finite() && args.row_block_mib >= 0.0) {
        return Err(Error::Usage(format!("--row-block-mib {} must be 0 or more", args.row_block_mib)));
    }
    let timeline = args.timeline.as_ref().map(|_| Arc::new(Timeline::new()));
    if !(args.collective_timeout.is_finite() && args.collective_timeout > 0.0) {
        return Err(Error::Usage(format!(
            "--collective-timeout {} must be a positive number of seconds",
            args.collective_timeout
        )));
    }
    let delays = args.step_delays()?;
    // The cheap checks of the replica count come before any thread or device exists.
    if let Some(n) = args.replicas {
        strata_core::device::check_replicas(n, "replicas").map_err(|_| {
            Error::Usage(format!(
                "--replicas {n}: over the limit of {} replicas per process (one thread each); pass {} or fewer",
                strata_core::device::MAX_REPLICAS,
                strata_core::device::MAX_REPLICAS
            ))
        })?;
    }
    let distributed = matches!(args.strategy, StrategyKind::MultiWorkerMirrored | StrategyKind::ParameterServer);
    if let Some(dir) = args.checkpoint_dir.as_ref().filter(|_| !distributed) {
        // A multi-worker chief checks it itself (only the chief writes there), and so do the
        // ps tasks (each under `ps-<index>`) and a local parameter-server job's coordinator.
        checkpoint_dir_writable(dir)?;
    }
    if let Some(d) = args.network_delay {
        strata_transport::inject::set_network_delay(d);
    }
    if args.strategy == StrategyKind::ParameterServer {
        return crate::ps::train(args, started);
    }
    let local_replicas = match args.strategy {
        StrategyKind::OneDevice => 1,
        _ => args.gpus.or(args.replicas).unwrap_or(2),
    };
    if args.batch() < local_replicas {
        return Err(Error::Usage(format!(
            "--batch {} is smaller than the {local_replicas} replicas; every replica needs at least one example per step",
            args.batch()
        )));
    }
    if args.strategy != StrategyKind::MultiWorkerMirrored {
        if let Some((w, _)) = delays.slowdown.iter().find(|(w, _)| *w >= local_replicas) {
            return Err(Error::Usage(format!(
                "--worker-slowdown names replica {w}, but this run has {local_replicas}; slow a replica below that"
            )));
        }
    }
    let options = StrategyOptions {
        bucket_bytes: (args.bucket_mib * 1024.0 * 1024.0) as usize,
        timeline: timeline.clone(),
        seed: args.seed,
        collective_timeout: std::time::Duration::from_secs_f64(args.collective_timeout),
        overlap: !args.no_overlap,
        row_block_bytes: (args.row_block_mib * 1024.0 * 1024.0) as usize,
        zero_stage: args.zero_stage,
    };
    // SIGTERM and SIGINT stop training after the current step (with a checkpoint when
    // --checkpoint-dir is set); a second signal ends the process at once.
    let stop = StopSignal::new();
    arm(&stop)?;
    let multi = match args.strategy {
        StrategyKind::MultiWorkerMirrored => Some(make_multi_worker(args, options.clone())?),
        _ => None,
    };
    let result = train_with(
        args,
        started,
        multi.as_ref().map_or_else(|| make_strategy(args, options), |m| Ok(m.handle()))?,
        &timeline,
        multi.as_ref(),
        &stop,
    );
    if let Some(m) = &multi {
        match &result {
            // A stop on request is agreed by every worker: they leave the job cleanly, saying
            // why (a worker that left an elastic job alone has left it already).
            Ok(()) => m.finish()?,
            Err(Error::Stopped { code, .. }) => m.finish_with(Some(*code))?,
            Err(e) => m.report_error(&strata_core::Error::Cluster(e.to_string())),
        }
    }
    result
}

/// Makes SIGTERM, SIGINT and SIGHUP request `stop` (the first one) or end the process at once
/// with 128 + the signal (the second).
fn arm(stop: &StopSignal) -> Result<()> {
    let signals = crate::signals::handle()?;
    let stop = stop.clone();
    std::thread::spawn(move || {
        let mut asked = false;
        while let Ok(signal) = signals.recv() {
            if asked {
                eprintln!("strata train: second signal ({signal}); exiting now");
                std::process::exit(crate::signals::exit_code(signal));
            }
            asked = true;
            eprintln!(
                "strata train: {signal} received; stopping after the current step (a second signal exits at once)"
            );
            stop.request(signal as u32);
        }
    });
    Ok(())
}

/// The error that ends a run stopped on request: where it stopped, and how to resume.
fn stopped_error(args: &TrainArgs, stopped: &strata::trainer::Stopped) -> Error {
    let signal = nix::sys::signal::Signal::try_from(stopped.code as i32)
        .map_or_else(|_| format!("code {}", stopped.code), |s| s.to_string());
    let resume = match (&stopped.checkpoint, &args.checkpoint_dir) {
        (Some(dir), _) => format!(
            "; the checkpoint of step {} is in {}: run the same command again to resume",
            stopped.step,
            dir.display()
        ),
        (None, Some(_)) => String::new(),
        (None, None) => "; without --checkpoint-dir nothing was saved".to_string(),
    };
    if stopped.left_job {
        return Error::Stopped {
            step: stopped.step,
            code: stopped.code,
            detail: format!("asked to stop by {signal}: this worker left the elastic job, which goes on without it"),
        };
    }
    Error::Stopped { step: stopped.step, code: stopped.code, detail: format!("asked to stop by {signal}{resume}") }
}

/// This worker's data and the batch its trainer cuts: every row and `--batch` rows, or, under
/// `--auto-shard file` in a job of `W` workers, the rows of files `i`, `i + W`, ... of the
/// `--data` directory and `--batch / W` rows (this worker's part of each step).
fn worker_data(args: &TrainArgs, multi: Option<&MultiWorkerMirroredStrategy>) -> Result<(strata::data::Batch, usize)> {
    let workers = multi.map_or(1, |m| m.num_workers());
    if args.auto_shard != AutoShardKind::File || workers == 1 {
        return Ok((digits::load(args.data.as_deref())?, args.batch()));
    }
    let Some(dir) = args.data.as_deref() else {
        return Err(Error::Usage(format!(
            "--auto-shard file hands each worker whole files: pass --data with a directory of at least {workers} digits files"
        )));
    };
    let files = digits::shard_files(dir)?;
    if files.len() < workers {
        return Err(Error::Usage(format!(
            "--auto-shard file over {workers} workers needs at least {workers} files, but --data {} has {}; shard the data into more files or use --auto-shard data",
            dir.display(),
            files.len()
        )));
    }
    if !args.batch().is_multiple_of(workers) {
        return Err(Error::Usage(format!(
            "--batch {} over {workers} workers with --auto-shard file: each worker takes an equal part of a step; use a multiple of {workers}",
            args.batch()
        )));
    }
    let index = multi.map_or(0, |m| m.worker_index());
    let mine: Vec<_> = files.into_iter().skip(index).step_by(workers).collect();
    Ok((digits::load_files(&mine)?, args.batch() / workers))
}

fn train_with(
    args: &TrainArgs,
    started: std::time::Instant,
    strategy: StrategyHandle,
    timeline: &Option<Arc<Timeline>>,
    multi: Option<&MultiWorkerMirroredStrategy>,
    stop: &StopSignal,
) -> Result<()> {
    let replicas = strategy.num_replicas_in_sync();
    if args.batch() < replicas {
        return Err(Error::Usage(format!(
            "--batch {} is smaller than the {replicas} replicas; every replica needs at least one example per step",
            args.batch()
        )));
    }
    let is_chief = multi.is_none_or(|m| m.is_chief());
    let joined = multi.and_then(|m| m.extended().workers()).is_some_and(|w| w.joined_under_way());
    let config = |global_batch: usize| -> Result<TrainConfig> {
        Ok(TrainConfig {
            epochs: args.epochs(),
            global_batch,
            seed: args.seed,
            progress: Some(Arc::new(strata_compare::progress::Bar::new(!args.no_progress && is_chief))),
            checkpoint: args.checkpoint_dir.as_ref().map(|dir| strata::trainer::CheckpointConfig {
                dir: dir.clone(),
                every_steps: args.checkpoint_every.max(1),
                keep: 3,
            }),
            max_steps: args.max_steps,
            metrics: args.metrics_writer(is_chief && !joined)?,
            step_hook: args.step_hook()?,
            stop: Some(stop.clone()),
            ..Default::default()
        })
    };
    let run = Run { args, started, timeline, multi, replicas, is_chief };
    match args.model {
        ModelKind::Mlp | ModelKind::Cnn => {
            let (all, global_batch) = worker_data(args, multi)?;
            let (train, test) = digits::train_test_split(&all, 0.2, 0);
            let trainer = Trainer::new(config(global_batch)?);
            if args.model == ModelKind::Mlp {
                let hidden = args.hidden();
                let model =
                    strategy.scope(|s| Mlp::new(s.var_builder(), digits::FEATURES, &hidden, digits::CLASSES))?;
                let report = args.optimizer.fit(args.hyper(), &trainer, &strategy, &model, &train, &test)?;
                run.end(&report, &model)
            } else {
                let model = strategy.scope(|s| Cnn::new(s.var_builder()))?;
                let report = args.optimizer.fit(args.hyper(), &trainer, &strategy, &model, &train, &test)?;
                run.end(&report, &model)
            }
        }
        ModelKind::Transformer => {
            let corpus = shakespeare::load()?;
            let shape = TransformerConfig { vocab: corpus.vocab_size(), ..Default::default() };
            shape.check()?;
            let steps = args.steps.unwrap_or(TRANSFORMER_STEPS);
            let windows = steps.checked_mul(args.batch()).filter(|&n| n <= 1 << 24).ok_or_else(|| {
                Error::Usage(format!(
                    "--steps {steps} of --batch {} draws more than 2^24 windows; use fewer steps per epoch and more --epochs",
                    args.batch()
                ))
            })?;
            let train = corpus.random_windows(windows, shape.context, args.seed)?;
            let validation = corpus.validation_windows(shape.context)?;
            let mut cfg = config(args.batch())?;
            let total = (steps * args.epochs()) as u64;
            cfg.clip_global_norm = Some(1.0);
            cfg.schedule = Some(transformer_schedule(args.lr, total));
            let trainer = Trainer::new(cfg);
            let model = strategy.scope(|s| CharTransformer::new(shape, s.var_builder()))?;
            let task = strata::transformer::task();
            let report =
                args.optimizer.fit_task(args.hyper(), &trainer, &strategy, &model, &task, &train, &validation)?;
            run.end(&report, &model)?;
            if let (Some(n), true) = (args.sample, is_chief) {
                let prompt = corpus.encode("\n")?;
                let ids = model.primary().generate(&prompt, n, 0.8, args.seed)?;
                println!("sample ({n} characters, temperature 0.8):\n{}", corpus.decode(&ids));
            }
            Ok(())
        }
    }
}

/// What the end of a run needs to know about it.
struct Run<'a> {
    args: &'a TrainArgs,
    started: std::time::Instant,
    timeline: &'a Option<Arc<Timeline>>,
    multi: Option<&'a MultiWorkerMirroredStrategy>,
    replicas: usize,
    is_chief: bool,
}

impl Run<'_> {
    /// The end of a fit: the stop error, the timeline, the state's mean, the digest and the
    /// chief's summary (or a worker's own `--save-params`).
    fn end<M>(&self, report: &FitReport, model: &strata_core::Replicated<M>) -> Result<()> {
        let (args, multi) = (self.args, self.multi);
        if let Some(stopped) = &report.stopped {
            // No summary and no final parameters: the run is not over.
            return Err(stopped_error(args, stopped));
        }
        if let (Some(path), Some(t)) = (&args.timeline, self.timeline) {
            t.write_chrome_trace(path)?;
            eprintln!("timeline: {} events written to {}", t.len(), path.display());
        }
        // The saved (and compared) state is the mean over replicas and workers (every worker
        // calls it; the trainer did in an elastic job, where it can survive a loss).
        if !multi.is_some_and(|m| m.is_elastic()) {
            model.sync_state()?;
        }
        if let Some(m) = multi {
            // Every worker must end with the same parameters; print a digest to compare.
            eprintln!("worker {}: parameter digest {}", m.worker_index(), parameter_digest(model)?);
        }
        // `{task}` in --save-params: the worker's rank, or in an elastic job (where ranks change
        // with the membership) its task's place in the cluster spec.
        let index = match multi {
            Some(m) if m.is_elastic() => {
                let c = m.cluster();
                c.spec.sync_workers().iter().position(|t| *t == c.task).unwrap_or_else(|| m.worker_index())
            }
            Some(m) => m.worker_index(),
            None => 0,
        };
        // In an elastic job the chief is worker 0 of the generation that finished.
        if multi.map_or(self.is_chief, |m| m.is_chief()) {
            finish(args, self.started, self.replicas, report, model.variables(0), index, None)?;
        } else if let Some(path) = &args.save_params {
            if path.to_string_lossy().contains("{task}") {
                save_params(path, index, model.variables(0))?;
            }
        }
        Ok(())
    }
}

/// Writes `vars` as safetensors to `path` with `{task}` replaced by `index`.
fn save_params(path: &std::path::Path, index: usize, vars: &[(String, candle_core::Var)]) -> Result<()> {
    let path = PathBuf::from(path.to_string_lossy().replace("{task}", &index.to_string()));
    let tensors: std::collections::HashMap<String, candle_core::Tensor> =
        vars.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
    candle_core::safetensors::save(&tensors, &path)
        .map_err(|e| Error::io(format!("cannot write {}", path.display()), std::io::Error::other(e)))
}

/// The chief's (or coordinator's) end of a run: the one-line result, `--save-params` and `--out`.
pub(crate) fn finish(
    args: &TrainArgs,
    started: std::time::Instant,
    replicas: usize,
    report: &FitReport,
    vars: &[(String, candle_core::Var)],
    task_index: usize,
    parameter_servers: Option<crate::ps::PsSummary>,
) -> Result<()> {
    let transformer = args.model == ModelKind::Transformer;
    let context = TransformerConfig::default().context;
    let validation_loss =
        transformer.then(|| report.final_metrics.iter().find(|m| m.name == "loss").map_or(f64::NAN, |m| m.value));
    let parameters = match args.model {
        ModelKind::Mlp => Mlp::parameter_count(digits::FEATURES, &args.hidden(), digits::CLASSES),
        ModelKind::Cnn => Cnn::parameter_count(),
        ModelKind::Transformer => TransformerConfig::default().parameter_count(),
    };
    let summary = Summary {
        model: args.model,
        strategy: args.strategy,
        replicas,
        parameters,
        hidden: if args.model == ModelKind::Mlp { args.hidden() } else { Vec::new() },
        epochs: args.epochs(),
        global_batch: args.batch(),
        optimizer: args.optimizer,
        learning_rate: args.lr,
        seed: args.seed,
        final_test_accuracy: (!transformer).then_some(report.final_test_accuracy),
        validation_loss,
        tokens_per_second: transformer.then_some(report.examples_per_second * context as f64),
        examples_per_second: report.examples_per_second,
        wall_seconds: started.elapsed().as_secs_f64(),
        history: report.epochs.clone(),
        parameter_servers,
    };
    if let (Some(loss), Some(tokens)) = (summary.validation_loss, summary.tokens_per_second) {
        println!(
            "{} x{}: transformer validation loss {loss:.4} nats per character after {} epochs ({} steps), {tokens:.0} tokens/s in steady state, {:.2} s",
            args.strategy,
            replicas,
            args.epochs(),
            report.steps,
            summary.wall_seconds
        );
    } else {
        println!(
            "{} x{}: {}test accuracy {:.2}% after {} epochs ({} steps), {:.0} examples/s in steady state, {:.2} s",
            args.strategy,
            replicas,
            if args.model == ModelKind::Cnn { "cnn " } else { "" },
            report.final_test_accuracy * 100.0,
            args.epochs(),
            report.steps,
            summary.examples_per_second,
            summary.wall_seconds
        );
    }
    if let Some(path) = &args.save_params {
        save_params(path, task_index, vars)?;
    }
    if let Some(path) = &args.out {
        let json =
            serde_json::to_string_pretty(&summary).map_err(|e| Error::io("cannot encode the summary", e.into()))?;
        std::fs::write(path, json + "\n").map_err(|e| Error::io(format!("cannot write {}", path.display()), e))?;
    }
    Ok(())
}

/// A digest of every parameter's bits (FNV-1a over the f32 bit patterns, in variable order).
pub fn parameter_digest<M>(model: &strata_core::Replicated<M>) -> Result<String> {
    let mut h: u64 = 0xcbf29ce484222325;
    for (name, v) in model.variables(0) {
        for b in name.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100000001b3);
        }
        for x in v.as_tensor().flatten_all()?.to_vec1::<f32>()? {
            h = (h ^ x.to_bits() as u64).wrapping_mul(0x100000001b3);
        }
    }
    Ok(format!("{h:016x}"))
}

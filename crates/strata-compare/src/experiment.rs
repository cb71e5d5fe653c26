//! The experiment file: what `strata compare` runs, as TOML.
//!
//! ```toml
//! [experiment]
//! name = "digits-mlp"
//! model = "mlp"          # mlp (default), cnn, transformer or ctr
//! hidden = [256, 256]    # the MLP's only
//! epochs = 20
//! global_batch = 256
//! lr = 0.003
//! optimizer = "adamw"
//! seed = 0
//! target_accuracy = 0.95
//!
//! [[run]]
//! strategy = "one-device"
//!
//! [[run]]
//! strategy = "parameter-server"
//! mode = "sync"
//! workers = 4
//! backup_workers = 1
//!
//! [[run]]
//! strategy = "multi-worker-mirrored"
//! workers = 2
//! compression = "powersgd:4"   # none (default), fp16, bf16, powersgd:RANK[:START]
//!
//! [[run]]
//! strategy = "multi-worker-mirrored"
//! sync_every = 100               # local SGD / DiLoCo: the workers meet every 100 steps
//! outer_optimizer = "nesterov"   # (default with sync_every above 1) or "average"
//! fragments = 1                  # Streaming DiLoCo: fragments met at staggered steps
//!
//! [injection]
//! slowdown = [{ worker = 1, factor = 3.0 }]
//! stragglers = { probability = 0.1, delay = "exp:20ms" }
//! network_delay = "1ms"
//!
//! [network]              # multi-process runs on emulated hosts (root)
//! hosts = 2              # 2 to 16
//! link = "1gbit"         # a tc rate, or "unshaped"
//! ```
//!
//! `[network]` runs every multi-process run on `hosts` network namespaces on one bridge, each
//! link tbf-shaped at `link` ([`crate::hosts`], which says how tasks map to hosts);
//! single-process runs run as without it. `[simulate]` takes its `bandwidth_gbps` from `link`
//! unless it sets one.
//!
//! `model` picks what every run trains (`strata train --model`): the digits MLP of `hidden`
//! (default `[256, 256]`; the field applies to the MLP only), the digits CNN, or the character
//! transformer on Tiny Shakespeare. The digits models are measured by test accuracy and need
//! `target_accuracy` (in (0, 1]); the transformer by validation loss in nats per character and
//! needs `target_loss` instead (lower is better: time to target is the first evaluation at or
//! below it), takes `steps` (global batches per epoch, `strata train --steps`, default 1200; a
//! parameter-server run schedules `steps × workers` worker steps of `global_batch / workers`
//! windows, the same windows per epoch) and no `data`, and has a simulated mode only where `[simulate]` sets `wire_parameters` and `target_loss` (the simulator learns the digits MLP and sends the transformer's bytes). `global_batch` is in
//! windows of 64 characters for the transformer. See `experiments/transformer.toml`.
//!
//! The ctr model (DLRM-style, on generated click records) is measured by test AUC: it takes
//! `target_auc` (above 0.5, at most 1) or no target at all (the report then gives the final
//! AUC and its gap to the best reachable, the planted model's), and its own settings, each
//! passed on where set: `embedding_rows`, `embedding_dim`, `train_records`, `test_records`
//! (`strata train --embedding-rows ...`), and `table_optimizer` (`sgd`, `adagrad`, `ftrl`,
//! `lazy-adam`) and `table_lr`: the rows' optimizer of the parameter-server runs (whose ps tasks
//! step rows, by default with Adagrad at 0.05) and, where set, of the one-device, mirrored and
//! central-storage runs (whose table is then rows in the process, `strata train
//! --table-optimizer`; without it they step the table as a variable with `optimizer`, as the
//! multi-worker-mirrored runs always do). Its parameter-server runs take a
//! fourth mode, `hybrid` (the tables asynchronous on the ps tasks, the dense layers
//! synchronous on the workers' ring), and one replica per worker. See `experiments/ctr.toml`.
//!
//! `compression` is `strata train --compression`: any of them for multi-worker-mirrored runs,
//! `fp16` or `bf16` for parameter-server runs (their pushes and pulls); a run without a name is
//! named after it (`multi-worker-mirrored-bf16`). Simulated runs model its bytes on the links
//! (`[simulate]`), not its effect on the gradients.
//!
//! `sync_every`, `outer_optimizer` and `fragments` are `strata train --sync-every`,
//! `--outer-optimizer` and `--fragments` (multi-worker-mirrored; `compression` then carries the
//! outer gradients, `int8` included); a run without a name is named after them
//! (`multi-worker-mirrored-diloco100`, `-local50x4` with 4 fragments).
//!
//! Errors name the field and the line: `experiments/x.toml line 12: run[3].workers: ...`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use strata::transformer::TransformerConfig;
use strata_core::cross_device::compression::{Compression, CompressionError};
use strata_core::ZeroStage;

use crate::{Error, Result};

/// The strategies a run can use (the names of `strata train --strategy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RunStrategy {
    /// One device.
    OneDevice,
    /// Mirrored over `replicas` logical CPU devices.
    Mirrored,
    /// CentralStorage over `replicas` logical CPU devices.
    CentralStorage,
    /// MultiWorkerMirrored over `workers` processes.
    MultiWorkerMirrored,
    /// ParameterServer with `workers` worker and `ps_tasks` ps processes.
    ParameterServer,
}

impl RunStrategy {
    /// The name `strata train --strategy` takes.
    pub fn name(self) -> &'static str {
        match self {
            RunStrategy::OneDevice => "one-device",
            RunStrategy::Mirrored => "mirrored",
            RunStrategy::CentralStorage => "central-storage",
            RunStrategy::MultiWorkerMirrored => "multi-worker-mirrored",
            RunStrategy::ParameterServer => "parameter-server",
        }
    }

    /// Whether the run's workers are separate processes (injection applies to them by task
    /// index); in-process strategies apply it to their replicas.
    pub fn is_multi_process(self) -> bool {
        matches!(self, RunStrategy::MultiWorkerMirrored | RunStrategy::ParameterServer)
    }
}

/// The model every run of an experiment trains (`strata train --model`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RunModel {
    /// The digits MLP of `hidden`.
    #[default]
    Mlp,
    /// The digits CNN.
    Cnn,
    /// The character transformer on Tiny Shakespeare.
    Transformer,
    /// The DLRM-style click model on generated records (`[experiment]`'s [`CtrSettings`]),
    /// measured by test AUC.
    Ctr,
}

impl RunModel {
    /// The name `strata train --model` takes.
    pub fn name(self) -> &'static str {
        match self {
            RunModel::Mlp => "mlp",
            RunModel::Cnn => "cnn",
            RunModel::Transformer => "transformer",
            RunModel::Ctr => "ctr",
        }
    }
}

/// The optimizer of an embedding table's rows on the ps tasks (`strata train
/// --table-optimizer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TableOptimizer {
    /// `w -= lr * g`.
    Sgd,
    /// Keras' Adagrad.
    Adagrad,
    /// Keras' FTRL.
    Ftrl,
    /// TensorFlow Addons' LazyAdam.
    LazyAdam,
}

impl TableOptimizer {
    /// The name `strata train --table-optimizer` takes.
    pub fn name(self) -> &'static str {
        match self {
            TableOptimizer::Sgd => "sgd",
            TableOptimizer::Adagrad => "adagrad",
            TableOptimizer::Ftrl => "ftrl",
            TableOptimizer::LazyAdam => "lazy-adam",
        }
    }
}

/// The ctr model's settings (`model = "ctr"`), each passed to `strata train` where the file
/// sets it (`None`: `strata train`'s default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct CtrSettings {
    /// Rows of the embedding table the 26 fields share (`--embedding-rows`).
    pub embedding_rows: Option<u64>,
    /// The embedding dimension (`--embedding-dim`).
    pub embedding_dim: Option<usize>,
    /// Generated training records, one epoch's (`--train-records`).
    pub train_records: Option<u64>,
    /// Generated test records, on which the AUC is measured (`--test-records`).
    pub test_records: Option<u64>,
    /// The optimizer of the table's rows (`--table-optimizer`): the ps tasks', and the one of
    /// the in-process runs' rows (one-device, mirrored, central-storage) where set.
    pub table_optimizer: Option<TableOptimizer>,
    /// Its learning rate (`--table-lr`).
    pub table_lr: Option<f64>,
}

/// `strata train`'s defaults of the ctr model's settings (`strata train --help`; the command
/// line's tests check that they agree): rows, training and test records, the table's optimizer
/// and its learning rate. The dimension's is [`strata::ctr::DlrmConfig::DEFAULT_DIM`].
pub const CTR_DEFAULT_ROWS: u64 = 10_000;
/// See [`CTR_DEFAULT_ROWS`].
pub const CTR_DEFAULT_TRAIN_RECORDS: u64 = 100_000;
/// See [`CTR_DEFAULT_ROWS`].
pub const CTR_DEFAULT_TEST_RECORDS: u64 = 20_000;
/// See [`CTR_DEFAULT_ROWS`].
pub const CTR_DEFAULT_TABLE_OPTIMIZER: TableOptimizer = TableOptimizer::Adagrad;
/// See [`CTR_DEFAULT_ROWS`].
pub const CTR_DEFAULT_TABLE_LR: f64 = 0.05;

impl CtrSettings {
    /// The table's rows a run has.
    pub fn rows(&self) -> u64 {
        self.embedding_rows.unwrap_or(CTR_DEFAULT_ROWS)
    }

    /// The embedding dimension a run has.
    pub fn dim(&self) -> usize {
        self.embedding_dim.unwrap_or(strata::ctr::DlrmConfig::DEFAULT_DIM)
    }

    /// The training records a run generates.
    pub fn train_records(&self) -> u64 {
        self.train_records.unwrap_or(CTR_DEFAULT_TRAIN_RECORDS)
    }

    /// The test records a run measures the AUC on.
    pub fn test_records(&self) -> u64 {
        self.test_records.unwrap_or(CTR_DEFAULT_TEST_RECORDS)
    }

    /// The ps tasks' row optimizer and its learning rate.
    pub fn table_optimizer(&self) -> (TableOptimizer, f64) {
        (self.table_optimizer.unwrap_or(CTR_DEFAULT_TABLE_OPTIMIZER), self.table_lr.unwrap_or(CTR_DEFAULT_TABLE_LR))
    }

    /// The `strata train` flags of the settings the file sets, for a run of `strategy`; the
    /// table's optimizer for every strategy that steps the table by rows
    /// ([`Self::steps_rows`]).
    pub fn args(&self, strategy: RunStrategy) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        let mut flag = |name: &str, v: Option<String>| {
            if let Some(v) = v {
                out.extend([name.to_string(), v]);
            }
        };
        flag("--embedding-rows", self.embedding_rows.map(|v| v.to_string()));
        flag("--embedding-dim", self.embedding_dim.map(|v| v.to_string()));
        flag("--train-records", self.train_records.map(|v| v.to_string()));
        flag("--test-records", self.test_records.map(|v| v.to_string()));
        if Self::steps_rows(strategy) {
            flag("--table-optimizer", self.table_optimizer.map(|o| o.name().to_string()));
            flag("--table-lr", self.table_lr.map(|v| v.to_string()));
        }
        out
    }

    /// Whether a run of `strategy` steps the table by rows with `table_optimizer` (every one
    /// but multi-worker-mirrored's, whose workers step it as a variable with `optimizer`).
    pub fn steps_rows(strategy: RunStrategy) -> bool {
        strategy != RunStrategy::MultiWorkerMirrored
    }
}

/// A parameter-server mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PsMode {
    /// Every push applied as it arrives.
    Async,
    /// One averaged update per round of pushes (with `backup_workers`: the first
    /// `workers - backup_workers` of them).
    Sync,
    /// Async, refusing pushes more than `staleness` updates old.
    Stale,
    /// The embedding tables asynchronous on the ps tasks, the dense layers synchronous across
    /// the workers by ring all-reduce (as multi-worker-mirrored): the ctr model only.
    Hybrid,
}

impl PsMode {
    /// The name `strata train --ps-mode` takes.
    pub fn name(self) -> &'static str {
        match self {
            PsMode::Async => "async",
            PsMode::Sync => "sync",
            PsMode::Stale => "stale",
            PsMode::Hybrid => "hybrid",
        }
    }
}

/// One run of the experiment.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunSpec {
    /// Unique name (default: the strategy, and the mode for parameter servers).
    pub name: String,
    /// The strategy.
    pub strategy: RunStrategy,
    /// Replicas of an in-process strategy (one-device: 1); replicas per worker otherwise.
    pub replicas: usize,
    /// Worker processes (multi-process strategies; 1 otherwise).
    pub workers: usize,
    /// Parameter-server tasks.
    pub ps_tasks: usize,
    /// Parameter-server mode.
    pub mode: Option<PsMode>,
    /// Sync mode: backup workers.
    pub backup_workers: usize,
    /// Stale mode: the largest accepted staleness.
    pub staleness: u64,
    /// This run's own time limit (default: the experiment's `run_timeout`).
    pub timeout: Option<Duration>,
    /// How gradients cross the network (`strata train --compression`): any for
    /// multi-worker-mirrored, `fp16` or `bf16` for the parameter server, `none` otherwise.
    #[serde(serialize_with = "display")]
    pub compression: Compression,
    /// Multi-worker-mirrored: the job is elastic and runs while this many workers live
    /// (`strata train --min-workers`); `None`: a lost worker ends the job.
    pub min_workers: Option<usize>,
    /// How many times a lost worker is replaced: an elastic job's launcher starts a new
    /// process that joins (`strata launch --max-restarts`), a parameter-server job's local
    /// cluster starts a new worker task (`strata train --max-restarts`), and a job that is not
    /// elastic is relaunched whole from its last checkpoint by the harness (restart the
    /// world, as torchrun and TensorFlow do).
    pub restarts: usize,
    /// Multi-worker-mirrored: write a checkpoint every this many steps (in `runs/<name>.ckpt`),
    /// where a relaunch resumes from.
    pub checkpoint_every: Option<usize>,
    /// Whether `[injection] kill` applies to this run (`faults = false`: an undisturbed
    /// reference).
    pub faults: bool,
    /// The ZeRO stage (`strata train --zero-stage`): mirrored and multi-worker-mirrored runs.
    #[serde(serialize_with = "display_stage")]
    pub zero_stage: ZeroStage,
    /// Whether the model's blocks are recomputed in the backward pass (`strata train
    /// --recompute`): the MLP and the transformer.
    pub recompute: bool,
    /// Local SGD or DiLoCo (`sync_every` above 1): its settings; `None`: every step
    /// synchronous.
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "display_opt")]
    pub local_sgd: Option<strata::LocalSgd>,
}

fn display_stage<S: serde::Serializer>(z: &ZeroStage, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.collect_str(z)
}

fn display<S: serde::Serializer>(c: &Compression, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.collect_str(c)
}

fn display_opt<S: serde::Serializer>(l: &Option<strata::LocalSgd>, s: S) -> std::result::Result<S::Ok, S::Error> {
    match l {
        Some(l) => s.collect_str(l),
        None => s.serialize_none(),
    }
}

impl RunSpec {
    /// Replicas or workers: the parallelism the scaling efficiency divides by.
    pub fn parallelism(&self) -> usize {
        if self.strategy.is_multi_process() {
            self.workers
        } else {
            self.replicas
        }
    }

    /// Whether each worker steps alone on its share of the global batch (`global_batch /
    /// workers` a step, as TensorFlow's ParameterServerStrategy): parameter-server runs but
    /// hybrid, whose workers step together over the global batch as multi-worker-mirrored's do.
    pub fn steps_alone(&self) -> bool {
        self.strategy == RunStrategy::ParameterServer && self.mode != Some(PsMode::Hybrid)
    }

    /// The mode as the report shows it: the parameter server's (`async`, `sync, 1 backup`,
    /// `stale <= 4`), or local SGD's (`diloco H=100`, `local SGD H=20`, with `, 4 fragments`).
    pub fn mode_label(&self) -> Option<String> {
        if let Some(l) = self.local_sgd.as_ref().filter(|l| !l.is_synchronous()) {
            let kind = match l.outer {
                strata::OuterOptimizer::Average => "local SGD",
                strata::OuterOptimizer::Nesterov { .. } => "diloco",
            };
            let fragments = if l.fragments > 1 { format!(", {} fragments", l.fragments) } else { String::new() };
            return Some(format!("{kind} H={}{fragments}", l.every));
        }
        self.mode.map(|m| match m {
            PsMode::Async => "async".to_string(),
            PsMode::Sync if self.backup_workers > 0 => format!("sync, {} backup", self.backup_workers),
            PsMode::Sync => "sync".to_string(),
            PsMode::Stale => format!("stale <= {}", self.staleness),
            PsMode::Hybrid => "hybrid".to_string(),
        })
    }
}

/// A delay distribution of random stragglers.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum DelayDistribution {
    /// Always this long.
    Fixed(Duration),
    /// Uniform between the two.
    Uniform(Duration, Duration),
    /// Exponential with this mean.
    Exponential(Duration),
}

impl DelayDistribution {
    /// A delay drawn with `u`, uniform in [0, 1).
    pub fn sample(&self, u: f64) -> Duration {
        match *self {
            DelayDistribution::Fixed(d) => d,
            DelayDistribution::Uniform(a, b) => a + (b.saturating_sub(a)).mul_f64(u),
            DelayDistribution::Exponential(mean) => mean.mul_f64(-(1.0 - u).max(f64::MIN_POSITIVE).ln()),
        }
    }
}

impl std::fmt::Display for DelayDistribution {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |d: Duration| format!("{}ms", d.as_secs_f64() * 1e3);
        match *self {
            DelayDistribution::Fixed(d) => write!(f, "fixed:{}", ms(d)),
            DelayDistribution::Uniform(a, b) => write!(f, "uniform:{}..{}", ms(a), ms(b)),
            DelayDistribution::Exponential(m) => write!(f, "exp:{}", ms(m)),
        }
    }
}

impl std::str::FromStr for DelayDistribution {
    type Err = String;

    /// `fixed:50ms`, `uniform:10ms..50ms`, `exp:20ms` (units: us, ms, s).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad = || format!("{s:?} is not a delay distribution; write fixed:50ms, uniform:10ms..50ms or exp:20ms");
        let (kind, rest) = s.split_once(':').ok_or_else(bad)?;
        let d = |t: &str| parse_duration(t).map_err(|e| format!("{s:?}: {e}"));
        match kind.trim() {
            "fixed" => Ok(DelayDistribution::Fixed(d(rest)?)),
            "exp" | "exponential" => Ok(DelayDistribution::Exponential(d(rest)?)),
            "uniform" => {
                let (a, b) = rest.split_once("..").ok_or_else(bad)?;
                let (a, b) = (d(a)?, d(b)?);
                if b < a {
                    return Err(format!("{s:?}: the uniform range runs from the smaller delay to the larger"));
                }
                Ok(DelayDistribution::Uniform(a, b))
            }
            _ => Err(bad()),
        }
    }
}

/// `250us`, `20ms`, `1.5s`.
pub fn parse_duration(text: &str) -> std::result::Result<Duration, String> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == '+')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale = match unit.trim() {
        "us" => 1e-6,
        "ms" => 1e-3,
        "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        "" => return Err(format!("{t:?} needs a unit: us, ms, s, m or h (e.g. 20ms)")),
        _ => return Err(format!("{t:?} is not a duration (e.g. 20ms, 5s or 1m)")),
    };
    let v: f64 = num.trim().parse().map_err(|_| format!("{t:?} is not a duration (e.g. 20ms, 5s or 1m)"))?;
    if !(v.is_finite() && v >= 0.0) {
        return Err(format!("{t:?} must be a duration of 0 or more"));
    }
    Duration::try_from_secs_f64(v * scale).map_err(|_| format!("{t:?} is too long a duration"))
}

/// [`parse_duration`], where a bare number is seconds (`10` is `10s`).
pub fn parse_duration_or_seconds(text: &str) -> std::result::Result<Duration, String> {
    match text.trim() {
        t if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit() || b == b'.') => parse_duration(&format!("{t}s")),
        t => parse_duration(t),
    }
}

/// Random stragglers: every step of every worker is delayed with `probability`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Stragglers {
    /// The chance that a step is delayed.
    pub probability: f64,
    /// How long.
    pub delay: DelayDistribution,
}

/// What is injected to make the trade-offs show on one machine.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Injection {
    /// Per worker (by index): how many times slower its steps are (1: not slowed).
    pub slowdown: Vec<(usize, f64)>,
    /// Random stragglers.
    pub stragglers: Option<Stragglers>,
    /// Added to every message between processes (one way).
    pub network_delay: Duration,
    /// Worker processes killed (SIGKILL, from outside) once the job has trained a number of
    /// global batches.
    pub kill: Vec<Kill>,
}

/// A worker lost at a step: `kill = [{ worker = 1, at_step = 40 }]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Kill {
    /// The worker task's index (`worker:INDEX`).
    pub worker: usize,
    /// Killed once the job has trained this many global batches (a multi-worker-mirrored
    /// job's steps; a parameter-server job's pushes over its workers).
    pub at_step: u64,
}

impl Injection {
    /// Whether anything is injected.
    pub fn is_empty(&self) -> bool {
        self.slowdown.is_empty() && self.stragglers.is_none() && self.network_delay.is_zero() && self.kill.is_empty()
    }

    /// The slowdown factor of worker `index` (1: none).
    pub fn factor(&self, index: usize) -> f64 {
        self.slowdown.iter().find(|(i, _)| *i == index).map_or(1.0, |(_, f)| *f)
    }

    /// One line per injected effect, for the report.
    pub fn describe(&self) -> Vec<String> {
        let mut out: Vec<String> = self.slowdown.iter().map(|(i, f)| format!("worker {i} is {f}x slower")).collect();
        if let Some(s) = &self.stragglers {
            out.push(format!("random stragglers: probability {} per step, delay {}", s.probability, s.delay));
        }
        if !self.network_delay.is_zero() {
            out.push(format!("network delay {:.3} ms per message", self.network_delay.as_secs_f64() * 1e3));
        }
        for k in &self.kill {
            out.push(format!(
                "worker {} is killed (SIGKILL) after step {} of the multi-process runs that take faults",
                k.worker, k.at_step
            ));
        }
        out
    }
}

/// The experiment: shared settings and the runs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Experiment {
    /// Where it was read from.
    pub path: PathBuf,
    /// Its name (the output directory's).
    pub name: String,
    /// What it studies, for the report.
    pub description: String,
    /// The model every run trains.
    pub model: RunModel,
    /// Hidden layer sizes of the MLP (empty for the other models).
    pub hidden: Vec<usize>,
    /// The transformer's steps per epoch (`None`: `strata train`'s default).
    pub steps: Option<usize>,
    /// The transformer's shape where the file sets `width`, `layers` or `heads` (`strata train
    /// --width --layers --heads`; the others keep the default's); `None`: the default model.
    pub transformer: Option<TransformerConfig>,
    /// The ctr model's settings (`model = "ctr"`; `None` for the other models).
    pub ctr: Option<CtrSettings>,
    /// Passes over the training set (real runs).
    pub epochs: usize,
    /// Examples per synchronous step, over all replicas or workers.
    pub global_batch: usize,
    /// Learning rate.
    pub lr: f64,
    /// Optimizer (`strata train --optimizer`).
    pub optimizer: String,
    /// Seed of initialisation and shuffling.
    pub seed: u64,
    /// What the time-to-target column measures: a test accuracy (digits models), a validation
    /// loss (the transformer) or a test AUC (the ctr model; possibly none).
    pub target: crate::Target,
    /// Digits file (default: the shipped one).
    pub data: Option<PathBuf>,
    /// Seconds a real run may take before it is stopped and reported as failed.
    pub run_timeout: Duration,
    /// The runs.
    pub runs: Vec<RunSpec>,
    /// What is injected.
    pub injection: Injection,
    /// Simulated mode's settings.
    pub simulate: Option<crate::sim_config::SimConfig>,
    /// The emulated hosts multi-process runs run on (`[network]`), or `None`: loopback.
    pub network: Option<crate::hosts::Network>,
}

impl Experiment {
    /// Reads and checks an experiment file.
    pub fn load(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
        Self::parse(&text, path)
    }

    /// Parses and checks `text` (read from `path`). Errors name the line and the field.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let at = Locator { text, path };
        let raw: RawFile = toml::from_str(text).map_err(|e| at.toml_error(&e))?;
        let e = raw.experiment;
        let name = e.name.get_ref().clone();
        if name.is_empty() || name.contains(['/', '\\']) || name.starts_with('.') {
            return Err(at.error(
                e.name.span(),
                "experiment.name",
                format!("{name:?} must be a plain directory name (no slashes), e.g. \"digits-mlp\""),
            ));
        }
        let (model, hidden, steps) = model_fields(&at, &e)?;
        let transformer = transformer_shape(&at, &e, model)?;
        let ctr = ctr_settings(&at, &e, model, &raw.run)?;
        let epochs = at.positive(&e.epochs, "experiment.epochs")?;
        let global_batch = at.positive(&e.global_batch, "experiment.global_batch")?;
        let lr = *e.lr.get_ref();
        if !(lr.is_finite() && lr > 0.0) {
            return Err(at.error(e.lr.span(), "experiment.lr", "must be a positive learning rate, e.g. 0.003"));
        }
        let optimizer = optimizer(&at, &e.optimizer)?;
        let target = target(&at, &e, model)?;
        let run_timeout = match &e.run_timeout {
            Some(t) => parse_duration(t.get_ref()).map_err(|m| at.error(t.span(), "experiment.run_timeout", m))?,
            None => Duration::from_secs(600),
        };
        if raw.run.is_empty() {
            return Err(Error::Usage(format!(
                "{}: no [[run]] tables; add at least one, e.g. [[run]] strategy = \"mirrored\"",
                path.display()
            )));
        }
        let mut runs: Vec<RunSpec> = Vec::new();
        for (i, r) in raw.run.iter().enumerate() {
            let spec = run_spec(&at, i, r, global_batch, optimizer.as_str(), model)?;
            if runs.iter().any(|o| o.name == spec.name) {
                return Err(at.error(
                    r.get_ref().name.as_ref().map_or(r.span(), |n| n.span()),
                    &format!("run[{i}].name"),
                    format!("{:?} is the name of an earlier run; give this one a name = \"...\"", spec.name),
                ));
            }
            runs.push(spec);
        }
        let injection = match raw.injection {
            None => Injection::default(),
            Some(inj) => injection(&at, &inj, &runs)?,
        };
        let simulate = match raw.simulate {
            Some(s) if model == RunModel::Ctr => {
                return Err(at.error(
                    s.span(),
                    "simulate",
                    "simulated mode models the digits MLP, not the ctr model: drop [simulate]",
                ))
            }
            Some(s)
                if model == RunModel::Transformer
                    && (s.get_ref().wire_parameters.is_none() || s.get_ref().target_loss.is_none()) =>
            {
                return Err(at.error(
                    s.span(),
                    "simulate",
                    "simulated mode models the digits MLP, not the transformer: drop [simulate], or set its wire_parameters (the transformer's bytes on the wire) and target_loss (the MLP's test loss)",
                ))
            }
            Some(s) => {
                s.get_ref().validate().map_err(|m| at.error(s.span(), "simulate", m))?;
                Some(s.into_inner())
            }
            None => None,
        };
        let network = raw.network.map(|n| network(&at, n, &injection, &runs)).transpose()?;
        // The simulator's links are the emulated hosts' unless [simulate] names its own
        // bandwidth (explicit wins; an unshaped link keeps the simulator's default).
        let simulate = match (simulate, &network) {
            (Some(mut cfg), Some(crate::hosts::Network { rate_bps: Some(bits), .. }))
                if !simulate_sets_bandwidth(text) =>
            {
                cfg.bandwidth_gbps = bits / 1e9;
                Some(cfg)
            }
            (s, _) => s,
        };
        Ok(Experiment {
            path: path.to_path_buf(),
            name,
            description: e.description.unwrap_or_default(),
            model,
            hidden,
            steps,
            transformer,
            ctr,
            epochs,
            global_batch,
            lr,
            optimizer,
            seed: e.seed,
            target,
            data: e.data.map(Spanned::into_inner),
            run_timeout,
            runs,
            injection,
            simulate,
            network,
        })
    }
}

/// `[experiment]`'s model and the fields that apply to one model only: the MLP's `hidden`, the
/// transformer's `steps`, and the digits models' `data`.
fn model_fields(at: &Locator<'_>, e: &RawExperiment) -> Result<(RunModel, Vec<usize>, Option<usize>)> {
    let model = e.model.as_ref().map_or(RunModel::Mlp, |m| *m.get_ref());
    let hidden = match &e.hidden {
        Some(h) if model != RunModel::Mlp => {
            return Err(at.not_for(h.span(), "experiment.hidden", "model = \"mlp\"", model))
        }
        Some(h) => h.get_ref().clone(),
        None if model == RunModel::Mlp => vec![256, 256],
        None => Vec::new(),
    };
    if model == RunModel::Mlp && (hidden.is_empty() || hidden.contains(&0)) {
        let span = e.hidden.as_ref().map_or(0..0, |h| h.span());
        return Err(at.error(span, "experiment.hidden", "needs layer sizes of at least 1, e.g. [256, 256]"));
    }
    let steps = match &e.steps {
        Some(v) if model != RunModel::Transformer => {
            return Err(at.not_for(v.span(), "experiment.steps", "model = \"transformer\"", model))
        }
        Some(v) if *v.get_ref() == 0 => return Err(at.error(v.span(), "experiment.steps", "must be at least 1")),
        Some(v) => Some(*v.get_ref()),
        None => None,
    };
    if let (RunModel::Transformer | RunModel::Ctr, Some(d)) = (model, &e.data) {
        return Err(at.not_for(d.span(), "experiment.data", "the digits models (model = \"mlp\" or \"cnn\")", model));
    }
    Ok((model, hidden, steps))
}

/// `[experiment]`'s `width`, `layers` and `heads` (the transformer's; any left out keeps the
/// default model's), checked as `strata train` checks them.
fn transformer_shape(at: &Locator<'_>, e: &RawExperiment, model: RunModel) -> Result<Option<TransformerConfig>> {
    let keys = [("width", &e.width), ("layers", &e.layers), ("heads", &e.heads)];
    let Some(first) = keys.iter().find_map(|(_, v)| v.as_ref()) else { return Ok(None) };
    if model != RunModel::Transformer {
        let (key, v) = keys.iter().find(|(_, v)| v.is_some()).map(|(k, v)| (*k, v.as_ref().unwrap())).unwrap();
        return Err(at.not_for(v.span(), &format!("experiment.{key}"), "model = \"transformer\"", model));
    }
    let mut c = TransformerConfig::DEFAULT;
    for (key, v) in keys {
        if let Some(v) = v {
            let n = at.positive(v, &format!("experiment.{key}"))?;
            match key {
                "width" => c.width = n,
                "layers" => c.layers = n,
                _ => c.heads = n,
            }
        }
    }
    c.check().map_err(|m| at.error(first.span(), "experiment.width", m))?;
    Ok(Some(c))
}

/// `[experiment]`'s optimizer: one `strata train --optimizer` takes (every strategy steps each
/// of them).
fn optimizer(at: &Locator<'_>, optimizer: &Spanned<String>) -> Result<String> {
    let name = optimizer.get_ref().clone();
    if name.parse::<strata::OptimizerKind>().is_err() {
        return Err(at.error(
            optimizer.span(),
            "experiment.optimizer",
            format!("{name:?} is not one of adamw, sgd, momentum, adagrad"),
        ));
    }
    Ok(name)
}

/// What time to target measures: `target_accuracy` for the digits models, `target_loss` for the
/// transformer (the one its model needs, and not the other).
fn target(at: &Locator<'_>, e: &RawExperiment, model: RunModel) -> Result<crate::Target> {
    if model == RunModel::Ctr {
        return auc_target(at, e);
    }
    if let Some(a) = &e.target_auc {
        return Err(at.not_for(a.span(), "experiment.target_auc", "model = \"ctr\"", model));
    }
    Ok(match (model, &e.target_accuracy, &e.target_loss) {
        (RunModel::Transformer, Some(a), _) => {
            return Err(at.error(
                a.span(),
                "experiment.target_accuracy",
                "the transformer is measured by validation loss; set target_loss (nats per character, e.g. 1.9) instead",
            ))
        }
        (RunModel::Transformer, None, Some(l)) => {
            let t = *l.get_ref();
            if !(t.is_finite() && t > 0.0) {
                return Err(at.error(
                    l.span(),
                    "experiment.target_loss",
                    "must be a positive loss in nats per character, e.g. 1.9",
                ));
            }
            crate::Target::Loss(t)
        }
        (RunModel::Transformer, None, None) => {
            return Err(Error::Usage(format!(
                "{}: experiment.target_loss: model = \"transformer\" needs a target validation loss, e.g. target_loss = 1.9",
                at.path.display()
            )))
        }
        (_, _, Some(l)) => return Err(at.not_for(l.span(), "experiment.target_loss", "model = \"transformer\"", model)),
        (_, Some(a), None) => {
            let t = *a.get_ref();
            if !(t > 0.0 && t <= 1.0) {
                return Err(at.error(a.span(), "experiment.target_accuracy", "must be in (0, 1], e.g. 0.95"));
            }
            crate::Target::Accuracy(t)
        }
        (_, None, None) => {
            return Err(Error::Usage(format!(
                "{}: experiment.target_accuracy: model = \"{}\" needs a target test accuracy, e.g. target_accuracy = 0.95",
                at.path.display(),
                model.name()
            )))
        }
    })
}

/// The ctr model's target: `target_auc` if the file sets one (above 0.5, at most 1), and
/// neither `target_accuracy` nor `target_loss`.
fn auc_target(at: &Locator<'_>, e: &RawExperiment) -> Result<crate::Target> {
    let other = e.target_accuracy.as_ref().map(|a| ("target_accuracy", a.span()));
    if let Some((field, span)) = other.or(e.target_loss.as_ref().map(|l| ("target_loss", l.span()))) {
        return Err(at.error(
            span,
            &format!("experiment.{field}"),
            "the ctr model is measured by test AUC; set target_auc (e.g. 0.77) instead, or no target",
        ));
    }
    match &e.target_auc {
        None => Ok(crate::Target::Auc(None)),
        Some(a) if !(*a.get_ref() > 0.5 && *a.get_ref() <= 1.0) => Err(at.error(
            a.span(),
            "experiment.target_auc",
            "must be an AUC above 0.5 (guessing) and at most 1, e.g. 0.77",
        )),
        Some(a) => Ok(crate::Target::Auc(Some(*a.get_ref()))),
    }
}

/// `[experiment]`'s ctr settings: refused on the other models, checked as `strata train`
/// checks them on the ctr model (the table's optimizer only where a parameter-server run
/// steps the rows on ps tasks).
fn ctr_settings(
    at: &Locator<'_>,
    e: &RawExperiment,
    model: RunModel,
    runs: &[Spanned<RawRun>],
) -> Result<Option<CtrSettings>> {
    let spans = [
        ("embedding_rows", e.embedding_rows.as_ref().map(|v| v.span())),
        ("embedding_dim", e.embedding_dim.as_ref().map(|v| v.span())),
        ("train_records", e.train_records.as_ref().map(|v| v.span())),
        ("test_records", e.test_records.as_ref().map(|v| v.span())),
        ("table_optimizer", e.table_optimizer.as_ref().map(|v| v.span())),
        ("table_lr", e.table_lr.as_ref().map(|v| v.span())),
    ];
    if model != RunModel::Ctr {
        return match spans.into_iter().find_map(|(k, s)| s.map(|s| (k, s))) {
            Some((key, span)) => Err(at.not_for(span, &format!("experiment.{key}"), "model = \"ctr\"", model)),
            None => Ok(None),
        };
    }
    let c = CtrSettings {
        embedding_rows: e.embedding_rows.as_ref().map(|v| *v.get_ref()),
        embedding_dim: e.embedding_dim.as_ref().map(|v| *v.get_ref()),
        train_records: e.train_records.as_ref().map(|v| *v.get_ref()),
        test_records: e.test_records.as_ref().map(|v| *v.get_ref()),
        table_optimizer: e.table_optimizer.as_ref().map(|v| *v.get_ref()),
        table_lr: e.table_lr.as_ref().map(|v| *v.get_ref()),
    };
    let shape = strata::ctr::DlrmConfig::new(c.rows(), c.dim());
    if let Err(err) = shape.check() {
        let (key, span) =
            if c.embedding_dim.is_some_and(|d| !(1..=1024).contains(&d)) { spans[1].clone() } else { spans[0].clone() };
        return Err(at.error(span.unwrap_or(0..0), &format!("experiment.{key}"), err));
    }
    for (k, v) in [(2, c.train_records), (3, c.test_records)] {
        if v.is_some_and(|n| n == 0 || n > 1 << 32) {
            let (key, span) = spans[k].clone();
            return Err(at.error(
                span.unwrap_or(0..0),
                &format!("experiment.{key}"),
                "must be 1 to 2^32 records (they are held as tensors)",
            ));
        }
    }
    if let Some(lr) = &e.table_lr {
        if !(lr.get_ref().is_finite() && *lr.get_ref() > 0.0) {
            return Err(at.error(lr.span(), "experiment.table_lr", "must be a positive learning rate, e.g. 0.05"));
        }
    }
    if !runs.iter().any(|r| CtrSettings::steps_rows(r.get_ref().strategy)) {
        if let Some((key, Some(span))) = spans[4..].iter().find(|(_, s)| s.is_some()).cloned() {
            return Err(at.error(
                span,
                &format!("experiment.{key}"),
                "applies to the runs that step the table's rows (parameter-server, one-device, mirrored, central-storage); multi-worker-mirrored steps the table with experiment.optimizer: drop it",
            ));
        }
    }
    Ok(Some(c))
}

/// One `[[run]]` table, the `i`th: errors name `run[i].<field>`.
struct RunAt<'a> {
    at: &'a Locator<'a>,
    i: usize,
    run: &'a RawRun,
    /// The whole table's.
    span: std::ops::Range<usize>,
}

impl RunAt<'_> {
    fn error(&self, span: std::ops::Range<usize>, field: &str, message: impl std::fmt::Display) -> Error {
        self.at.error(span, &format!("run[{}].{field}", self.i), message)
    }

    /// A count that must be at least 1, or `default` when the table leaves it out.
    fn positive_or(&self, v: &Option<Spanned<usize>>, field: &str, default: usize) -> Result<usize> {
        match v {
            Some(v) => self.at.positive(v, &format!("run[{}].{field}", self.i)),
            None => Ok(default),
        }
    }
}

/// The `i`th `[[run]]` table, checked against itself and `global_batch` (not against the other
/// runs: the caller checks that its name is new).
fn run_spec(
    at: &Locator<'_>,
    i: usize,
    r: &Spanned<RawRun>,
    global_batch: usize,
    optimizer: &str,
    model: RunModel,
) -> Result<RunSpec> {
    let run = RunAt { at, i, run: r.get_ref(), span: r.span() };
    let r = run.run;
    let (replicas, workers, ps_tasks) = run_processes(&run)?;
    let (mode, backup_workers, staleness) = ps_mode(&run, workers)?;
    run_tables(&run, model, mode, replicas)?;
    let compression = run_compression(&run)?;
    let multi = r.strategy.is_multi_process();
    let total = if multi { workers * replicas } else { replicas };
    if global_batch < total {
        return Err(at.error(
            run.span.clone(),
            &format!("run[{i}]"),
            format!("experiment.global_batch {global_batch} is smaller than its {total} replicas; every replica needs an example per step"),
        ));
    }
    if r.strategy == RunStrategy::ParameterServer && !global_batch.is_multiple_of(workers) {
        return Err(run.error(
            r.workers.as_ref().map_or(run.span.clone(), |w| w.span()),
            "workers",
            format!(
                "experiment.global_batch {global_batch} does not split evenly over {workers} workers; each pushes global_batch / workers examples per step"
            ),
        ));
    }
    let (min_workers, checkpoint_every, restarts) = run_recovery(&run, workers)?;
    let (zero_stage, recompute) =
        run_memory(&run, optimizer, model, min_workers.is_some(), checkpoint_every.is_some())?;
    let local_sgd = run_local_sgd(&run, compression, zero_stage)?;
    let mut spec = RunSpec {
        name: String::new(),
        strategy: r.strategy,
        replicas,
        workers,
        ps_tasks,
        mode,
        backup_workers,
        staleness,
        timeout: match &r.timeout {
            Some(t) => Some(parse_duration(t.get_ref()).map_err(|m| run.error(t.span(), "timeout", m))?),
            None => None,
        },
        compression,
        min_workers,
        restarts,
        checkpoint_every,
        faults: r.faults.as_ref().is_none_or(|f| *f.get_ref()),
        zero_stage,
        recompute,
        local_sgd,
    };
    spec.name = match &r.name {
        Some(n) => n.get_ref().clone(),
        None => default_run_name(&spec),
    };
    if spec.name.is_empty() || spec.name.contains(['/', '\\', ',', '"']) {
        return Err(run.error(
            r.name.as_ref().map_or(run.span.clone(), |n| n.span()),
            "name",
            "must be non-empty, without slashes, commas or quotes",
        ));
    }
    Ok(spec)
}

/// A run's ZeRO stage and recomputation, refused where `strata train` would refuse them (a
/// strategy or optimizer the stage does not take, an elastic run whose sharded state has no
/// checkpoint, recomputation of the CNN), before any run starts.
fn run_memory(
    run: &RunAt<'_>,
    optimizer: &str,
    model: RunModel,
    elastic: bool,
    checkpointed: bool,
) -> Result<(ZeroStage, bool)> {
    let r = run.run;
    let stage = match &r.zero_stage {
        None => ZeroStage::Off,
        Some(z) => {
            let stage: ZeroStage = z.get_ref().to_string().parse().map_err(|e| run.error(z.span(), "zero_stage", e))?;
            let refused = |e: strata::Error| run.error(z.span(), "zero_stage", e);
            let strategy: strata::StrategyKind =
                r.strategy.name().parse().map_err(|e| run.error(z.span(), "zero_stage", e))?;
            let optimizer: strata::OptimizerKind =
                optimizer.parse().map_err(|e| run.error(z.span(), "zero_stage", e))?;
            if stage != ZeroStage::Off {
                strata::refusals::zero_stage_of(stage, strategy, optimizer).map_err(refused)?;
                if elastic {
                    strata::refusals::elastic_zero_state_of(stage, optimizer, checkpointed).map_err(refused)?;
                }
            }
            stage
        }
    };
    let recompute = match &r.recompute {
        Some(v) if *v.get_ref() && matches!(model, RunModel::Cnn | RunModel::Ctr) => {
            return Err(run.error(
                v.span(),
                "recompute",
                format!("applies to model = \"mlp\" or \"transformer\", not model = \"{}\"; drop it", model.name()),
            ))
        }
        Some(v) => *v.get_ref(),
        None => false,
    };
    Ok((stage, recompute))
}

/// A run's replicas (per worker), worker processes and ps tasks, as its strategy takes them.
fn run_processes(run: &RunAt<'_>) -> Result<(usize, usize, usize)> {
    let r = run.run;
    let multi = r.strategy.is_multi_process();
    let replicas = match r.strategy {
        RunStrategy::OneDevice => {
            if let Some(v) = r.replicas.as_ref().filter(|v| *v.get_ref() != 1) {
                return Err(run.error(v.span(), "replicas", "one-device runs 1 replica; drop it or use mirrored"));
            }
            1
        }
        RunStrategy::Mirrored | RunStrategy::CentralStorage => run.positive_or(&r.replicas, "replicas", 2)?,
        _ => run.positive_or(&r.replicas, "replicas", 1)?,
    };
    if !multi {
        if let Some(v) = r.workers.as_ref().or(r.ps_tasks.as_ref()) {
            return Err(run.error(
                v.span(),
                if r.workers.is_some() { "workers" } else { "ps_tasks" },
                format!("{} runs in one process; set replicas instead", r.strategy.name()),
            ));
        }
    }
    let workers = if multi { run.positive_or(&r.workers, "workers", 2)? } else { 1 };
    let ps_tasks = if r.strategy == RunStrategy::ParameterServer {
        run.positive_or(&r.ps_tasks, "ps_tasks", 1)?
    } else {
        if let Some(v) = &r.ps_tasks {
            return Err(run.error(v.span(), "ps_tasks", "only parameter-server runs have ps tasks"));
        }
        0
    };
    Ok((replicas, workers, ps_tasks))
}

/// A parameter-server run's mode, backup workers (sync) and staleness bound (stale); other runs
/// have none of them.
fn ps_mode(run: &RunAt<'_>, workers: usize) -> Result<(Option<PsMode>, usize, u64)> {
    let r = run.run;
    let mode = match (r.strategy, &r.mode) {
        (RunStrategy::ParameterServer, m) => Some(m.as_ref().map_or(PsMode::Async, |m| *m.get_ref())),
        (_, Some(m)) => return Err(run.error(m.span(), "mode", "only parameter-server runs have a mode; drop it")),
        (_, None) => None,
    };
    let backup_workers = match &r.backup_workers {
        Some(b) if mode != Some(PsMode::Sync) => {
            return Err(run.error(b.span(), "backup_workers", "backup workers need mode = \"sync\""))
        }
        Some(b) if *b.get_ref() >= workers => {
            return Err(run.error(
                b.span(),
                "backup_workers",
                format!("{} backup workers leave none of the {workers} workers; use fewer", b.get_ref()),
            ))
        }
        Some(b) => *b.get_ref(),
        None => 0,
    };
    let staleness = match &r.staleness {
        Some(s) if mode != Some(PsMode::Stale) => {
            return Err(run.error(s.span(), "staleness", "a staleness bound needs mode = \"stale\""))
        }
        Some(s) => *s.get_ref(),
        None => 4,
    };
    Ok((mode, backup_workers, staleness))
}

/// What a run with embedding tables on ps tasks needs: hybrid is the ctr model's mode, and a
/// parameter-server worker of the ctr model runs one replica (as `strata train` refuses more).
fn run_tables(run: &RunAt<'_>, model: RunModel, mode: Option<PsMode>, replicas: usize) -> Result<()> {
    let r = run.run;
    if let (Some(PsMode::Hybrid), Some(m)) = (mode, &r.mode) {
        if model != RunModel::Ctr {
            return Err(run.error(
                m.span(),
                "mode",
                format!("hybrid trains the embedding tables on the ps tasks and the dense layers on the workers' ring: it needs model = \"ctr\", not model = \"{}\"", model.name()),
            ));
        }
    }
    if let (Some(PsMode::Hybrid), Some(k)) = (mode, r.restarts.as_ref().filter(|k| *k.get_ref() > 0)) {
        return Err(run.error(
            k.span(),
            "restarts",
            "a hybrid job's dense layers are synchronous: a lost worker stops the job and none is replaced; drop it",
        ));
    }
    if model == RunModel::Ctr && r.strategy == RunStrategy::ParameterServer && replicas != 1 {
        let span = r.replicas.as_ref().map_or(run.span.clone(), |v| v.span());
        return Err(run.error(
            span,
            "replicas",
            "a parameter-server worker with embedding tables runs one replica; drop it and add workers instead",
        ));
    }
    Ok(())
}

/// A run's compression: any for multi-worker-mirrored, what a parameter server takes for
/// parameter-server runs (its refusal is the strategy's own), none for single-process runs.
fn run_compression(run: &RunAt<'_>) -> Result<Compression> {
    let r = run.run;
    let Some(c) = &r.compression else { return Ok(Compression::None) };
    let parsed: Compression =
        c.get_ref().parse().map_err(|e: CompressionError| run.error(c.span(), "compression", e.to_string()))?;
    match (r.strategy, parsed) {
        (_, Compression::None) | (RunStrategy::MultiWorkerMirrored, _) => {}
        (RunStrategy::ParameterServer, _) => {
            strata::ParameterServerOptions::wire_format_of(parsed)
                .map_err(|e| run.error(c.span(), "compression", e))?;
        }
        (strategy, _) => {
            return Err(run.error(
                c.span(),
                "compression",
                format!(
                    "{} has no gradients on a network; compression applies to multi-worker-mirrored and parameter-server, drop it",
                    strategy.name()
                ),
            ))
        }
    }
    Ok(parsed)
}

/// How a run recovers from a lost worker: its elastic minimum (`min_workers`), its checkpoints
/// (`checkpoint_every`) and the restarts of lost processes.
fn run_recovery(run: &RunAt<'_>, workers: usize) -> Result<(Option<usize>, Option<usize>, usize)> {
    let r = run.run;
    let mwms = r.strategy == RunStrategy::MultiWorkerMirrored;
    let min_workers = match &r.min_workers {
        Some(m) if !mwms => {
            return Err(run.error(
                m.span(),
                "min_workers",
                format!(
                    "{} is not elastic; only multi-worker-mirrored runs take min_workers, drop it",
                    r.strategy.name()
                ),
            ))
        }
        Some(m) if *m.get_ref() == 0 || *m.get_ref() > workers => {
            return Err(run.error(
                m.span(),
                "min_workers",
                format!("{} for a run of {workers} workers; use 1 to {workers}", m.get_ref()),
            ))
        }
        Some(m) => Some(*m.get_ref()),
        None => None,
    };
    let checkpoint_every = match &r.checkpoint_every {
        Some(c) if !mwms => {
            return Err(run.error(
                c.span(),
                "checkpoint_every",
                format!("{} runs are not relaunched from checkpoints here; only multi-worker-mirrored runs take checkpoint_every, drop it", r.strategy.name()),
            ))
        }
        Some(c) => Some(run.at.positive(c, &format!("run[{}].checkpoint_every", run.i))?),
        None => None,
    };
    let restarts = match &r.restarts {
        Some(k) if !r.strategy.is_multi_process() => {
            return Err(run.error(
                k.span(),
                "restarts",
                format!("{} runs in one process and loses no worker; drop it", r.strategy.name()),
            ))
        }
        Some(k) if *k.get_ref() > 0 && mwms && min_workers.is_none() && checkpoint_every.is_none() => {
            return Err(run.error(
                k.span(),
                "restarts",
                "a job that is not elastic is relaunched whole from its last checkpoint: set checkpoint_every (steps), or min_workers for an elastic job",
            ))
        }
        Some(k) => *k.get_ref(),
        None => 0,
    };
    Ok((min_workers, checkpoint_every, restarts))
}

/// The name of a run without one: its strategy, or its parameter servers' mode, and its
/// compression (`ps-sync-backup1`, `multi-worker-mirrored-bf16`).
fn default_run_name(spec: &RunSpec) -> String {
    let base: String = match spec.mode {
        Some(PsMode::Sync) if spec.backup_workers > 0 => format!("ps-sync-backup{}", spec.backup_workers),
        Some(PsMode::Sync) => "ps-sync".into(),
        Some(PsMode::Async) => "ps-async".into(),
        Some(PsMode::Stale) => format!("ps-stale{}", spec.staleness),
        Some(PsMode::Hybrid) => "ps-hybrid".into(),
        None => spec.strategy.name().into(),
    };
    let mut name = match spec.compression {
        Compression::None => base,
        c => format!("{base}-{c}"),
    };
    if spec.zero_stage != ZeroStage::Off {
        name = format!("{name}-zero{}", spec.zero_stage);
    }
    if spec.recompute {
        name.push_str("-recompute");
    }
    if let Some(l) = &spec.local_sgd {
        let kind = match l.outer {
            strata::OuterOptimizer::Average => "local",
            strata::OuterOptimizer::Nesterov { .. } => "diloco",
        };
        name = format!("{name}-{kind}{}", l.every);
        if l.fragments > 1 {
            name = format!("{name}x{}", l.fragments);
        }
    }
    name
}

/// A run's local SGD (`sync_every`, `outer_optimizer`, `fragments`: `strata train
/// --sync-every`, `--outer-optimizer`, `--fragments`): multi-worker-mirrored only, without
/// ZeRO; `None` for per-step synchronous training.
fn run_local_sgd(run: &RunAt<'_>, compression: Compression, zero_stage: ZeroStage) -> Result<Option<strata::LocalSgd>> {
    let r = run.run;
    let span = |f: &Option<Spanned<u64>>| f.as_ref().map_or(run.span.clone(), |v| v.span());
    let every = r.sync_every.as_ref().map_or(1, |v| *v.get_ref());
    let outer = match &r.outer_optimizer {
        None if every > 1 => strata::OuterOptimizer::diloco(),
        None => strata::OuterOptimizer::Average,
        Some(o) => match o.get_ref().as_str() {
            "average" => strata::OuterOptimizer::Average,
            "nesterov" => strata::OuterOptimizer::diloco(),
            other => {
                return Err(run.error(
                    o.span(),
                    "outer_optimizer",
                    format!("unknown outer optimizer {other:?}: use \"average\" or \"nesterov\""),
                ))
            }
        },
    };
    let fragments = r.fragments.as_ref().map_or(1, |f| *f.get_ref());
    let l = strata::LocalSgd { every, outer, fragments, delay: None, wire: compression };
    if l.is_synchronous() {
        if compression == Compression::Int8 {
            let c = r.compression.as_ref().map_or(run.span.clone(), |c| c.span());
            return Err(run.error(
                c,
                "compression",
                "int8 carries local SGD's outer gradients: add sync_every above 1, or use fp16 or bf16",
            ));
        }
        if let Some(f) = r.fragments.as_ref().filter(|f| *f.get_ref() != 1) {
            return Err(run.error(f.span(), "fragments", "applies to local SGD (sync_every above 1): drop it"));
        }
        return Ok(None);
    }
    let at = span(&r.sync_every);
    if r.strategy != RunStrategy::MultiWorkerMirrored {
        return Err(run.error(
            at,
            "sync_every",
            format!("local SGD applies to multi-worker-mirrored, whose workers step on their own between meetings ({} has none): drop it", r.strategy.name()),
        ));
    }
    l.check().map_err(|e| run.error(at.clone(), "sync_every", e))?;
    if zero_stage != ZeroStage::Off {
        return Err(run.error(
            at,
            "sync_every",
            "local SGD steps each worker on its own, and ZeRO shards over every worker: drop zero_stage",
        ));
    }
    Ok(Some(l))
}

/// `[injection]`, checked against the workers of `runs`.
fn injection(at: &Locator<'_>, inj: &RawInjection, runs: &[RunSpec]) -> Result<Injection> {
    let mut out = Injection::default();
    for (k, s) in inj.slowdown.iter().enumerate() {
        let v = s.get_ref();
        if !(v.factor.is_finite() && v.factor >= 1.0) {
            return Err(at.error(
                s.span(),
                &format!("injection.slowdown[{k}].factor"),
                "must be 1 or more (3.0: three times slower)",
            ));
        }
        let max = runs.iter().map(|r| r.parallelism()).max().unwrap_or(1);
        if v.worker >= max {
            return Err(at.error(
                s.span(),
                &format!("injection.slowdown[{k}].worker"),
                format!("worker {} does not exist: the largest run has {max} workers or replicas", v.worker),
            ));
        }
        if out.slowdown.iter().any(|(w, _)| *w == v.worker) {
            return Err(at.error(
                s.span(),
                &format!("injection.slowdown[{k}].worker"),
                format!("worker {} is slowed twice", v.worker),
            ));
        }
        out.slowdown.push((v.worker, v.factor));
    }
    if let Some(s) = &inj.stragglers {
        let v = s.get_ref();
        if !(0.0..=1.0).contains(&v.probability) {
            return Err(at.error(s.span(), "injection.stragglers.probability", "must be between 0 and 1"));
        }
        let delay: DelayDistribution =
            v.delay.parse().map_err(|m: String| at.error(s.span(), "injection.stragglers.delay", m))?;
        out.stragglers = Some(Stragglers { probability: v.probability, delay });
    }
    out.kill = kills(at, &inj.kill, runs)?;
    if let Some(d) = &inj.network_delay {
        out.network_delay =
            parse_duration(d.get_ref()).map_err(|m| at.error(d.span(), "injection.network_delay", m))?;
    }
    Ok(out)
}

/// `[injection]`'s `kill`: each of a worker that the largest multi-process run of `runs` has,
/// at a step of at least 1, at most once per worker.
fn kills(at: &Locator<'_>, raw: &[Spanned<RawKill>], runs: &[RunSpec]) -> Result<Vec<Kill>> {
    let largest = runs.iter().filter(|r| r.strategy.is_multi_process()).map(|r| r.workers).max();
    let mut out: Vec<Kill> = Vec::new();
    for (k, kill) in raw.iter().enumerate() {
        let v = kill.get_ref();
        let Some(max) = largest else {
            return Err(at.error(
                kill.span(),
                &format!("injection.kill[{k}]"),
                "every run is single-process: there is no worker process to kill; add a multi-worker-mirrored or parameter-server run, or drop it",
            ));
        };
        if v.worker >= max {
            return Err(at.error(
                kill.span(),
                &format!("injection.kill[{k}].worker"),
                format!("worker {} does not exist: the largest multi-process run has {max} workers", v.worker),
            ));
        }
        if v.at_step == 0 {
            return Err(at.error(
                kill.span(),
                &format!("injection.kill[{k}].at_step"),
                "must be at least 1 (the worker is killed once the job has trained that many global batches)",
            ));
        }
        if out.iter().any(|o| o.worker == v.worker) {
            return Err(at.error(
                kill.span(),
                &format!("injection.kill[{k}].worker"),
                format!("worker {} is killed twice; each worker is killed at most once", v.worker),
            ));
        }
        out.push(Kill { worker: v.worker, at_step: v.at_step });
    }
    Ok(out)
}

/// `[network]`: the emulated hosts and their link, for an experiment with a multi-process run
/// among `runs` and no kill in `injection`.
fn network(
    at: &Locator<'_>,
    n: Spanned<RawNetwork>,
    injection: &Injection,
    runs: &[RunSpec],
) -> Result<crate::hosts::Network> {
    let (span, n) = (n.span(), n.into_inner());
    let hosts = *n.hosts.get_ref();
    if !(2..=crate::hosts::MAX_HOSTS).contains(&hosts) {
        return Err(at.error(
            n.hosts.span(),
            "network.hosts",
            format!("{hosts} hosts: use 2 to {} (one network namespace each), e.g. hosts = 2", crate::hosts::MAX_HOSTS),
        ));
    }
    let link = n.link.ok_or_else(|| {
        at.error(
            span.clone(),
            "network.link",
            "emulated hosts need a link rate: add link = \"1gbit\" (any tc rate), or link = \"unshaped\"",
        )
    })?;
    let rate_bps = crate::hosts::parse_rate(link.get_ref()).map_err(|m| at.error(link.span(), "network.link", m))?;
    if !injection.kill.is_empty() {
        return Err(at.error(
            span,
            "network",
            "[injection] kill runs on this machine's loopback (the harness finds and restarts the processes there); drop [network] or the kill",
        ));
    }
    if !runs.iter().any(|r| r.strategy.is_multi_process()) {
        return Err(at.error(
            span,
            "network",
            "every run is single-process (one-device, mirrored, central-storage): nothing crosses a link; drop [network] or add a multi-worker-mirrored or parameter-server run",
        ));
    }
    Ok(crate::hosts::Network { hosts, link: link.get_ref().trim().to_string(), rate_bps })
}

/// Whether the file's `[simulate]` table sets `bandwidth_gbps` itself.
fn simulate_sets_bandwidth(text: &str) -> bool {
    toml::from_str::<toml::Table>(text)
        .ok()
        .and_then(|t| t.get("simulate").and_then(|s| s.get("bandwidth_gbps")).map(|_| ()))
        .is_some()
}

use toml::Spanned;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    experiment: RawExperiment,
    #[serde(default)]
    run: Vec<Spanned<RawRun>>,
    injection: Option<RawInjection>,
    simulate: Option<Spanned<crate::sim_config::SimConfig>>,
    network: Option<Spanned<RawNetwork>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNetwork {
    hosts: Spanned<usize>,
    link: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawExperiment {
    name: Spanned<String>,
    description: Option<String>,
    model: Option<Spanned<RunModel>>,
    hidden: Option<Spanned<Vec<usize>>>,
    steps: Option<Spanned<usize>>,
    width: Option<Spanned<usize>>,
    layers: Option<Spanned<usize>>,
    heads: Option<Spanned<usize>>,
    epochs: Spanned<usize>,
    global_batch: Spanned<usize>,
    lr: Spanned<f64>,
    #[serde(default = "default_optimizer")]
    optimizer: Spanned<String>,
    #[serde(default)]
    seed: u64,
    target_accuracy: Option<Spanned<f32>>,
    target_loss: Option<Spanned<f64>>,
    target_auc: Option<Spanned<f64>>,
    embedding_rows: Option<Spanned<u64>>,
    embedding_dim: Option<Spanned<usize>>,
    train_records: Option<Spanned<u64>>,
    test_records: Option<Spanned<u64>>,
    table_optimizer: Option<Spanned<TableOptimizer>>,
    table_lr: Option<Spanned<f64>>,
    data: Option<Spanned<PathBuf>>,
    run_timeout: Option<Spanned<String>>,
}

fn default_optimizer() -> Spanned<String> {
    Spanned::new(0..0, "adamw".to_string())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRun {
    name: Option<Spanned<String>>,
    strategy: RunStrategy,
    replicas: Option<Spanned<usize>>,
    workers: Option<Spanned<usize>>,
    ps_tasks: Option<Spanned<usize>>,
    mode: Option<Spanned<PsMode>>,
    backup_workers: Option<Spanned<usize>>,
    staleness: Option<Spanned<u64>>,
    timeout: Option<Spanned<String>>,
    compression: Option<Spanned<String>>,
    min_workers: Option<Spanned<usize>>,
    restarts: Option<Spanned<usize>>,
    checkpoint_every: Option<Spanned<usize>>,
    faults: Option<Spanned<bool>>,
    zero_stage: Option<Spanned<u8>>,
    recompute: Option<Spanned<bool>>,
    sync_every: Option<Spanned<u64>>,
    outer_optimizer: Option<Spanned<String>>,
    fragments: Option<Spanned<usize>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInjection {
    #[serde(default)]
    slowdown: Vec<Spanned<RawSlow>>,
    stragglers: Option<Spanned<RawStragglers>>,
    network_delay: Option<Spanned<String>>,
    #[serde(default)]
    kill: Vec<Spanned<RawKill>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKill {
    worker: usize,
    at_step: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSlow {
    worker: usize,
    factor: f64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStragglers {
    probability: f64,
    delay: String,
}

/// Turns byte offsets into lines for error messages.
struct Locator<'a> {
    text: &'a str,
    path: &'a Path,
}

impl Locator<'_> {
    fn line(&self, offset: usize) -> usize {
        self.text[..offset.min(self.text.len())].bytes().filter(|b| *b == b'\n').count() + 1
    }

    /// A count that must be at least 1.
    fn positive(&self, v: &Spanned<usize>, field: &str) -> Result<usize> {
        if *v.get_ref() == 0 {
            Err(self.error(v.span(), field, "must be at least 1"))
        } else {
            Ok(*v.get_ref())
        }
    }

    /// A field that applies to another model than `model`.
    fn not_for(&self, span: std::ops::Range<usize>, field: &str, applies: &str, model: RunModel) -> Error {
        self.error(span, field, format!("applies to {applies}, not model = \"{}\"; drop it", model.name()))
    }

    fn error(&self, span: std::ops::Range<usize>, field: &str, message: impl std::fmt::Display) -> Error {
        if span.is_empty() && span.start == 0 {
            return Error::Usage(format!("{}: {field}: {message}", self.path.display()));
        }
        Error::Usage(format!("{} line {}: {field}: {message}", self.path.display(), self.line(span.start)))
    }

    /// toml's own errors (syntax, unknown or missing fields, wrong types), with the line and the
    /// key of the line they point at.
    fn toml_error(&self, e: &toml::de::Error) -> Error {
        let message = e.message().trim().to_string();
        match e.span() {
            Some(span) => {
                let line_no = self.line(span.start);
                let line = self.text.lines().nth(line_no - 1).unwrap_or("").trim();
                let key = line
                    .split_once('=')
                    .map(|(k, _)| k.trim().to_string())
                    .filter(|k| !k.is_empty() && !k.starts_with('['))
                    .unwrap_or_else(|| line.to_string());
                Error::Usage(format!("{} line {line_no}: {key}: {message}", self.path.display()))
            }
            None => Error::Usage(format!("{}: {message}", self.path.display())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[experiment]
name = "t"
hidden = [16]
epochs = 2
global_batch = 64
lr = 0.01
target_accuracy = 0.9

[[run]]
strategy = "one-device"

[[run]]
strategy = "parameter-server"
mode = "sync"
workers = 4
backup_workers = 1

[[run]]
strategy = "parameter-server"
mode = "stale"
workers = 2
staleness = 3

[injection]
slowdown = [{ worker = 1, factor = 3.0 }]
stragglers = { probability = 0.1, delay = "exp:20ms" }
network_delay = "1ms"
"#;

    fn parse(text: &str) -> Result<Experiment> {
        Experiment::parse(text, Path::new("x.toml"))
    }

    fn error(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    #[test]
    fn a_good_file_parses_with_its_defaults() {
        let e = parse(GOOD).unwrap();
        assert_eq!(e.optimizer, "adamw");
        assert_eq!(e.run_timeout, Duration::from_secs(600));
        let names: Vec<&str> = e.runs.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["one-device", "ps-sync-backup1", "ps-stale3"]);
        assert_eq!(e.runs[1].mode_label().as_deref(), Some("sync, 1 backup"));
        assert_eq!(e.runs[1].ps_tasks, 1);
        assert_eq!(e.runs[0].parallelism(), 1);
        assert_eq!(e.runs[1].parallelism(), 4);
        assert_eq!(e.injection.factor(1), 3.0);
        assert_eq!(e.injection.factor(0), 1.0);
        assert_eq!(e.injection.network_delay, Duration::from_millis(1));
        assert_eq!(e.injection.stragglers.unwrap().delay, DelayDistribution::Exponential(Duration::from_millis(20)));
        assert_eq!(e.injection.describe().len(), 3);
    }

    #[test]
    fn a_run_s_zero_stage_and_recomputation_are_named_and_checked() {
        let text = GOOD.to_string()
            + "\n[[run]]\nstrategy = \"mirrored\"\nreplicas = 3\nzero_stage = 3\nrecompute = true\n\
               \n[[run]]\nstrategy = \"multi-worker-mirrored\"\nzero_stage = 2\n";
        let e = parse(&text).unwrap();
        assert_eq!((e.runs[3].zero_stage, e.runs[3].recompute), (ZeroStage::Parameters, true));
        assert_eq!(e.runs[3].name, "mirrored-zero3-recompute");
        assert_eq!(
            (e.runs[4].zero_stage, e.runs[4].name.as_str()),
            (ZeroStage::Gradients, "multi-worker-mirrored-zero2")
        );
        assert_eq!((e.runs[0].zero_stage, e.runs[0].recompute), (ZeroStage::Off, false));
        let bad = |from: &str, to: &str, want: &str| {
            let e = error(&GOOD.replace(from, to));
            assert!(e.contains(want), "{e}");
            assert!(!e.contains('\n'), "{e}");
        };
        let one = "strategy = \"one-device\"";
        bad(one, "strategy = \"one-device\"\nzero_stage = 4", "run[0].zero_stage: zero stage \"4\" is not a stage");
        bad(one, "strategy = \"one-device\"\nzero_stage = 1", "run[0].zero_stage: ");
        bad(one, "strategy = \"one-device\"\nzero_stage = 1", "one replica holds the whole model");
        bad("mode = \"stale\"", "mode = \"stale\"\nzero_stage = 2", "its variables live on the ps tasks");
        // Stage 3 across workers runs; in an elastic job only with checkpoints, whatever the
        // optimizer (a lost worker takes its shard of the parameters).
        let across = GOOD.to_string() + "\n[[run]]\nstrategy = \"multi-worker-mirrored\"\nzero_stage = 3\n";
        assert_eq!(parse(&across).unwrap().runs[3].name, "multi-worker-mirrored-zero3");
        let elastic = error(&(across + "min_workers = 1\n"));
        assert!(elastic.contains("run[3].zero_stage: an elastic job at ZeRO stage 3: a lost worker takes its shard of the parameters with it"), "{elastic}");
        // Stage 0 is every strategy's.
        assert!(parse(&GOOD.replace(one, "strategy = \"one-device\"\nzero_stage = 0")).is_ok());
        // The CNN has no blocks to recompute.
        let cnn = GOOD.replace("[experiment]", "[experiment]\nmodel = \"cnn\"").replace("hidden = [16]\n", "");
        assert!(parse(&cnn).is_ok(), "{}", error(&cnn));
        let refused = error(&cnn.replace(one, "strategy = \"one-device\"\nrecompute = true"));
        assert!(
            refused.contains("run[0].recompute: applies to model = \"mlp\" or \"transformer\", not model = \"cnn\""),
            "{refused}"
        );
    }

    #[test]
    fn the_transformer_s_shape_is_set_checked_and_only_the_transformer_s() {
        let t = "[experiment]\nname = \"t\"\nmodel = \"transformer\"\nepochs = 1\nglobal_batch = 8\nlr = 0.003\ntarget_loss = 2.0\n";
        let run = "[[run]]\nstrategy = \"mirrored\"\n";
        assert_eq!(parse(&format!("{t}{run}")).unwrap().transformer, None);
        let e = parse(&format!("{t}width = 512\nlayers = 8\nheads = 8\n{run}")).unwrap();
        let c = e.transformer.unwrap();
        assert_eq!((c.width, c.layers, c.heads, c.context), (512, 8, 8, TransformerConfig::DEFAULT.context));
        assert_eq!(c.parameter_count(), 25_307_201);
        // One key alone keeps the default's others.
        let c = parse(&format!("{t}layers = 2\n{run}")).unwrap().transformer.unwrap();
        assert_eq!((c.width, c.layers, c.heads), (128, 2, 4));
        let e = error(&format!("{t}width = 130\n{run}"));
        assert!(e.contains("experiment.width") && !e.contains('\n'), "{e}");
        let e = error(&format!("{t}heads = 0\n{run}"));
        assert!(e.contains("experiment.heads: must be at least 1"), "{e}");
        let e = error(&GOOD.replace("[experiment]", "[experiment]\nwidth = 64"));
        assert!(e.contains("experiment.width: applies to model = \"transformer\", not model = \"mlp\""), "{e}");
    }

    #[test]
    fn local_sgd_is_named_checked_and_passed_on() {
        let text = GOOD.to_string()
            + "\n[[run]]\nstrategy = \"multi-worker-mirrored\"\nsync_every = 100\ncompression = \"int8\"\n\
               \n[[run]]\nstrategy = \"multi-worker-mirrored\"\nsync_every = 50\nouter_optimizer = \"average\"\nfragments = 2\n";
        let e = parse(&text).unwrap();
        let diloco = e.runs[e.runs.len() - 2].clone();
        assert_eq!(diloco.name, "multi-worker-mirrored-int8-diloco100");
        assert_eq!(
            diloco.local_sgd.as_ref().map(|l| (l.every, l.outer)),
            Some((100, strata::OuterOptimizer::diloco()))
        );
        let local = e.runs[e.runs.len() - 1].clone();
        assert_eq!(local.name, "multi-worker-mirrored-local50x2");
        assert_eq!(e.runs[0].local_sgd, None);
        let bad = |add: &str, want: &str| {
            let err = parse(&(GOOD.to_string() + add)).unwrap_err().to_string();
            assert!(err.contains(want), "{add}: {err}");
        };
        bad(
            "\n[[run]]\nstrategy = \"mirrored\"\nsync_every = 10\n",
            "sync_every: local SGD applies to multi-worker-mirrored",
        );
        bad(
            "\n[[run]]\nstrategy = \"multi-worker-mirrored\"\ncompression = \"int8\"\n",
            "compression: int8 carries local SGD's outer gradients",
        );
        bad("\n[[run]]\nstrategy = \"multi-worker-mirrored\"\nsync_every = 4\nfragments = 8\n", "use 1 to 4 fragments");
        bad(
            "\n[[run]]\nstrategy = \"multi-worker-mirrored\"\nsync_every = 4\nouter_optimizer = \"adam\"\n",
            "unknown outer optimizer",
        );
    }

    #[test]
    fn compression_is_named_checked_and_passed_on() {
        let text = GOOD.replace("mode = \"stale\"", "mode = \"stale\"\ncompression = \"bf16\"")
            + "\n[[run]]\nstrategy = \"multi-worker-mirrored\"\ncompression = \"powersgd:4:100\"\n";
        let e = parse(&text).unwrap();
        assert_eq!(e.runs[2].compression, Compression::Bf16);
        assert_eq!(e.runs[2].name, "ps-stale3-bf16");
        assert_eq!(e.runs[3].compression, Compression::PowerSgd { rank: 4, start_step: 100 });
        assert_eq!(e.runs[3].name, "multi-worker-mirrored-powersgd:4:100");
        assert_eq!(e.runs[0].compression, Compression::None);
        // runner.rs's tests: it is passed on as --compression.
        let bad = |from: &str, to: &str, want: &str| {
            let e = error(&GOOD.replace(from, to));
            assert!(e.contains(want), "{e}");
        };
        bad(
            "strategy = \"one-device\"",
            "strategy = \"one-device\"\ncompression = \"bf16\"",
            "run[0].compression: one-device has no gradients on a network",
        );
        bad(
            "mode = \"stale\"",
            "mode = \"stale\"\ncompression = \"powersgd:4\"",
            "run[2].compression: compression powersgd:4 applies to multi-worker-mirrored's ring, not to a parameter server's pushes and pulls",
        );
        bad(
            "mode = \"stale\"",
            "mode = \"stale\"\ncompression = \"zstd\"",
            "run[2].compression: unknown compression \"zstd\"",
        );
    }

    #[test]
    fn errors_name_the_field_and_the_line() {
        // An unknown key (toml's error), on line 6.
        let e = error(&GOOD.replace("lr = 0.01", "learning_rate = 0.01"));
        assert!(e.contains("x.toml line 7") && e.contains("learning_rate"), "{e}");
        // A wrong type.
        let e = error(&GOOD.replace("epochs = 2", "epochs = \"two\""));
        assert!(e.contains("line 5") && e.contains("epochs"), "{e}");
        // Values checked after parsing.
        let e = error(&GOOD.replace("epochs = 2", "epochs = 0"));
        assert!(e.contains("line 5: experiment.epochs: must be at least 1"), "{e}");
        let e = error(&GOOD.replace("backup_workers = 1", "backup_workers = 4"));
        assert!(e.contains("line 17: run[1].backup_workers") && e.contains("use fewer"), "{e}");
        let e = error(&GOOD.replace("staleness = 3", "staleness = 3\nbackup_workers = 1"));
        assert!(e.contains("run[2].backup_workers: backup workers need mode = \"sync\""), "{e}");
        let e = error(&GOOD.replace("strategy = \"one-device\"", "strategy = \"one-device\"\nmode = \"async\""));
        assert!(e.contains("line 12: run[0].mode"), "{e}");
        let e = error(&GOOD.replace("strategy = \"one-device\"", "strategy = \"mirrored\"\nworkers = 2"));
        assert!(e.contains("run[0].workers") && e.contains("set replicas instead"), "{e}");
        let e = error(&GOOD.replace("strategy = \"one-device\"", "strategy = \"warp-drive\""));
        assert!(e.contains("line 11") && e.contains("strategy") && e.contains("warp-drive"), "{e}");
        let e = error(&GOOD.replace("factor = 3.0", "factor = 0.5"));
        assert!(e.contains("line 26: injection.slowdown[0].factor"), "{e}");
        let e = error(&GOOD.replace("worker = 1,", "worker = 9,"));
        assert!(e.contains("injection.slowdown[0].worker: worker 9 does not exist"), "{e}");
        let e = error(&GOOD.replace("exp:20ms", "poisson:20ms"));
        assert!(e.contains("line 27: injection.stragglers.delay"), "{e}");
        let e = error(&GOOD.replace("\"1ms\"", "\"1 fortnight\""));
        assert!(e.contains("line 28: injection.network_delay"), "{e}");
        let e = error(&GOOD.replace("global_batch = 64", "global_batch = 63"));
        assert!(e.contains("run[1].workers") && e.contains("does not split evenly"), "{e}");
        let e = error(&GOOD.replace("name = \"t\"", "name = \"../t\""));
        assert!(e.contains("line 3: experiment.name"), "{e}");
        let e = error(&GOOD.replace("target_accuracy = 0.9", "target_accuracy = 90"));
        assert!(e.contains("line 8: experiment.target_accuracy"), "{e}");
        let e = error(&format!("{GOOD}\n[[run]]\nstrategy = \"one-device\"\n"));
        assert!(e.contains("run[3].name") && e.contains("earlier run"), "{e}");
        let e = error(
            &GOOD
                .replace("[[run]]\nstrategy = \"one-device\"", "[[run]]\nstrategy = \"mirrored\"\noptimizer = \"sgd\""),
        );
        assert!(e.contains("line 12") && e.contains("optimizer"), "{e}");
        let e = error("[experiment\nname = 1");
        assert!(e.contains("x.toml line 1"), "{e}");
        // Every strategy steps momentum and Adagrad (the replicas' fused optimizers).
        assert_eq!(
            parse(&GOOD.replace("lr = 0.01", "lr = 0.01\noptimizer = \"momentum\"")).unwrap().optimizer,
            "momentum"
        );
        let e = error(&GOOD.replace("lr = 0.01", "lr = 0.01\noptimizer = \"lamb\""));
        assert!(
            e.contains("line 8: experiment.optimizer: \"lamb\" is not one of adamw, sgd, momentum, adagrad"),
            "{e}"
        );
        let e = error(&format!("{GOOD}\n[simulate]\nworkers = [0]\n"));
        assert!(e.contains("line 30: simulate") && e.contains("at least 1"), "{e}");
        let e = error(&format!("{GOOD}\n[simulate]\nwarp = 1\n"));
        assert!(e.contains("line 31") && e.contains("warp"), "{e}");
        let e = error(&GOOD[..GOOD.find("[[run]]").unwrap()]);
        assert!(e.contains("no [[run]] tables"), "{e}");
    }

    #[test]
    fn the_model_and_its_target_parse_and_fields_of_other_models_are_refused() {
        let e = parse(GOOD).unwrap();
        assert_eq!((e.model, e.target, e.steps), (RunModel::Mlp, crate::Target::Accuracy(0.9), None));
        let cnn = parse(&GOOD.replace("hidden = [16]", "model = \"cnn\"")).unwrap();
        assert_eq!((cnn.model, cnn.hidden.len()), (RunModel::Cnn, 0));
        let t = GOOD
            .replace("hidden = [16]", "model = \"transformer\"\nsteps = 5")
            .replace("target_accuracy = 0.9", "target_loss = 1.9");
        let tr = parse(&t).unwrap();
        assert_eq!((tr.model, tr.target, tr.steps), (RunModel::Transformer, crate::Target::Loss(1.9), Some(5)));
        let e = error(&GOOD.replace("hidden = [16]", "model = \"cnn\"\nhidden = [16]"));
        assert!(e.contains("x.toml line 5: experiment.hidden: applies to model = \"mlp\", not model = \"cnn\""), "{e}");
        let e = error(&t.replace("steps = 5", "steps = 5\nhidden = [8]"));
        assert!(e.contains("line 6: experiment.hidden") && e.contains("not model = \"transformer\""), "{e}");
        let e = error(&t.replace("target_loss = 1.9", "target_accuracy = 0.9"));
        assert!(e.contains("experiment.target_accuracy") && e.contains("target_loss"), "{e}");
        let e = error(&GOOD.replace("target_accuracy = 0.9", "target_loss = 1.9"));
        assert!(e.contains("line 8: experiment.target_loss: applies to model = \"transformer\""), "{e}");
        let e = error(&t.replace("target_loss = 1.9", "target_loss = -1"));
        assert!(e.contains("experiment.target_loss: must be a positive loss"), "{e}");
        let e = error(&GOOD.replace("lr = 0.01", "lr = 0.01\nsteps = 3"));
        assert!(e.contains("experiment.steps: applies to model = \"transformer\""), "{e}");
        let e = error(&GOOD.replace("hidden = [16]", "model = \"rnn\""));
        assert!(e.contains("line 4: model") && e.contains("rnn"), "{e}");
        let e = error(&format!("{t}\n[simulate]\nworkers = [1]\n"));
        assert!(e.contains("simulate: simulated mode models the digits MLP"), "{e}");
    }

    #[test]
    fn the_network_parses_and_bad_values_are_one_line_each() {
        let net = |body: &str| format!("{GOOD}\n[network]\n{body}\n");
        let e = parse(&net("hosts = 2\nlink = \"1gbit\"")).unwrap();
        let n = e.network.unwrap();
        assert_eq!((n.hosts, n.link.as_str(), n.rate_bps), (2, "1gbit", Some(1e9)));
        assert_eq!(parse(&net("hosts = 16\nlink = \"unshaped\"")).unwrap().network.unwrap().rate_bps, None);
        assert_eq!(parse(GOOD).unwrap().network, None);
        // Line 30 is [network], 31 hosts, 32 link.
        assert_eq!(
            error(&net("hosts = 0\nlink = \"1gbit\"")),
            "x.toml line 31: network.hosts: 0 hosts: use 2 to 16 (one network namespace each), e.g. hosts = 2"
        );
        assert_eq!(
            error(&net("hosts = 17\nlink = \"1gbit\"")),
            "x.toml line 31: network.hosts: 17 hosts: use 2 to 16 (one network namespace each), e.g. hosts = 2"
        );
        assert_eq!(
            error(&net("hosts = 2\nlink = \"1 gigabit\"")),
            "x.toml line 32: network.link: \"1 gigabit\" is not a link rate: write a number and one of tc's units bit, kbit, mbit, gbit, bps, kbps, mbps, gbps (bps: bytes per second), e.g. \"1gbit\", or \"unshaped\""
        );
        assert_eq!(
            error(&net("hosts = 2\nlink = \"0mbit\"")),
            "x.toml line 32: network.link: \"0mbit\" is out of range: a link rate from 8kbit to 10tbit, e.g. \"1gbit\""
        );
        assert_eq!(
            error(&net("hosts = 2")),
            "x.toml line 30: network.link: emulated hosts need a link rate: add link = \"1gbit\" (any tc rate), or link = \"unshaped\""
        );
        let e = error(&net("hosts = 2\nlink = \"1gbit\"\nmtu = 9000"));
        assert!(e.starts_with("x.toml line 33: mtu: unknown field `mtu`"), "{e}");
        let single = "[experiment]\nname = \"t\"\nepochs = 1\nglobal_batch = 64\nlr = 0.01\ntarget_accuracy = 0.9\n\n\
            [[run]]\nstrategy = \"one-device\"\n\n[[run]]\nstrategy = \"mirrored\"\n\n[network]\nhosts = 2\nlink = \"1gbit\"\n";
        assert_eq!(
            error(single),
            "x.toml line 14: network: every run is single-process (one-device, mirrored, central-storage): nothing crosses a link; drop [network] or add a multi-worker-mirrored or parameter-server run"
        );
        // The simulator's links are the network's unless [simulate] names its own bandwidth.
        let sim = |extra: &str| {
            parse(&format!("{}[simulate]\nworkers = [1, 2]\n{extra}\n", net("hosts = 2\nlink = \"250mbit\"")))
                .unwrap()
                .simulate
                .unwrap()
                .bandwidth_gbps
        };
        assert_eq!(sim(""), 0.25);
        assert_eq!(sim("bandwidth_gbps = 40.0"), 40.0);
        let unshaped = format!("{GOOD}\n[network]\nhosts = 2\nlink = \"unshaped\"\n\n[simulate]\nworkers = [1]\n");
        assert_eq!(parse(&unshaped).unwrap().simulate.unwrap().bandwidth_gbps, 10.0);
    }

    #[test]
    fn kills_and_recoveries_parse_and_bad_values_are_one_line_each() {
        let runs = "[[run]]\nname = \"el\"\nstrategy = \"multi-worker-mirrored\"\nworkers = 3\nmin_workers = 2\nrestarts = 1\n\
            [[run]]\nname = \"ck\"\nstrategy = \"multi-worker-mirrored\"\nworkers = 3\ncheckpoint_every = 10\nrestarts = 2\n\
            [[run]]\nname = \"ps\"\nstrategy = \"parameter-server\"\nworkers = 3\nrestarts = 1\n\
            [[run]]\nname = \"ref\"\nstrategy = \"multi-worker-mirrored\"\nworkers = 3\nfaults = false\n";
        let head = "[experiment]\nname = \"t\"\nepochs = 2\nglobal_batch = 96\nlr = 0.01\ntarget_accuracy = 0.9\n";
        let file = |runs: &str, kill: &str| format!("{head}{runs}[injection]\nkill = [{kill}]\n");
        let e = parse(&file(runs, "{ worker = 1, at_step = 40 }")).unwrap();
        assert_eq!(e.injection.kill, vec![Kill { worker: 1, at_step: 40 }]);
        let by = |n: &str| e.runs.iter().find(|r| r.name == n).unwrap().clone();
        assert_eq!((by("el").min_workers, by("el").restarts, by("el").faults), (Some(2), 1, true));
        assert_eq!((by("ck").checkpoint_every, by("ck").restarts), (Some(10), 2));
        assert_eq!((by("ps").restarts, by("ref").faults), (1, false));
        assert!(e.injection.describe().iter().any(|l| l.contains("worker 1 is killed (SIGKILL) after step 40")));
        let bad = |runs: &str, kill: &str, want: &str| {
            let m = error(&file(runs, kill));
            assert!(m.contains(want), "{m}\nwants: {want}");
            assert_eq!(m.lines().count(), 1, "{m}");
        };
        let k = "{ worker = 1, at_step = 40 }";
        bad(
            runs,
            "{ worker = 3, at_step = 40 }",
            "injection.kill[0].worker: worker 3 does not exist: the largest multi-process run has 3 workers",
        );
        bad(runs, "{ worker = 1, at_step = 0 }", "injection.kill[0].at_step: must be at least 1");
        bad(runs, &format!("{k}, {k}"), "injection.kill[1].worker: worker 1 is killed twice");
        bad("[[run]]\nstrategy = \"mirrored\"\n", k, "there is no worker process to kill");
        bad(
            "[[run]]\nstrategy = \"parameter-server\"\nworkers = 3\nmin_workers = 2\n",
            k,
            "run[0].min_workers: parameter-server is not elastic",
        );
        bad(
            "[[run]]\nstrategy = \"multi-worker-mirrored\"\nworkers = 3\nmin_workers = 4\n",
            k,
            "run[0].min_workers: 4 for a run of 3 workers; use 1 to 3",
        );
        bad("[[run]]\nstrategy = \"multi-worker-mirrored\"\nworkers = 3\nrestarts = 1\n", k, "run[0].restarts: a job that is not elastic is relaunched whole from its last checkpoint: set checkpoint_every");
        bad(
            "[[run]]\nstrategy = \"mirrored\"\nrestarts = 1\n[[run]]\nstrategy = \"parameter-server\"\nworkers = 3\n",
            k,
            "run[0].restarts: mirrored runs in one process",
        );
        bad(
            "[[run]]\nstrategy = \"parameter-server\"\nworkers = 3\ncheckpoint_every = 5\n",
            k,
            "run[0].checkpoint_every: parameter-server runs are not relaunched",
        );
        bad(
            "[[run]]\nstrategy = \"multi-worker-mirrored\"\nworkers = 3\ncheckpoint_every = 0\n",
            k,
            "run[0].checkpoint_every: must be at least 1",
        );
        let m = error(&format!("{}\n[network]\nhosts = 2\nlink = \"1gbit\"\n", file(runs, k)));
        assert!(m.contains("network: [injection] kill runs on this machine's loopback"), "{m}");
    }

    const CTR: &str = r#"
[experiment]
name = "c"
model = "ctr"
epochs = 2
global_batch = 512
lr = 0.003
embedding_rows = 1000000
embedding_dim = 16
train_records = 200000
test_records = 10000
table_optimizer = "lazy-adam"
table_lr = 0.05
target_auc = 0.8

[[run]]
strategy = "parameter-server"
mode = "sync"
workers = 2
ps_tasks = 2

[[run]]
strategy = "parameter-server"
mode = "hybrid"
workers = 2
ps_tasks = 2

[[run]]
strategy = "one-device"
"#;

    #[test]
    fn the_ctr_model_s_settings_target_and_hybrid_mode_parse() {
        let e = parse(CTR).unwrap();
        assert_eq!((e.model, e.target), (RunModel::Ctr, crate::Target::Auc(Some(0.8))));
        let c = e.ctr.unwrap();
        assert_eq!((c.embedding_rows, c.embedding_dim), (Some(1_000_000), Some(16)));
        assert_eq!((c.train_records, c.test_records, c.train_records()), (Some(200_000), Some(10_000), 200_000));
        assert_eq!((c.table_optimizer, c.table_lr), (Some(TableOptimizer::LazyAdam), Some(0.05)));
        let names: Vec<&str> = e.runs.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["ps-sync", "ps-hybrid", "one-device"]);
        assert_eq!((e.runs[1].mode, e.runs[1].mode_label().as_deref()), (Some(PsMode::Hybrid), Some("hybrid")));
        assert!(e.hidden.is_empty());
        // No target: the report gives the final AUC and its gap only.
        let none = parse(&CTR.replace("target_auc = 0.8\n", "")).unwrap();
        assert_eq!(none.target, crate::Target::Auc(None));
        // The defaults: nothing passed on.
        let bare =
            CTR.lines().filter(|l| !l.starts_with("embedding") && !l.contains("_records") && !l.starts_with("table_"));
        let bare = parse(&bare.collect::<Vec<_>>().join("\n")).unwrap();
        assert_eq!(bare.ctr, Some(CtrSettings::default()));
        assert_eq!(bare.ctr.unwrap().train_records(), CTR_DEFAULT_TRAIN_RECORDS);
        assert!(bare.ctr.unwrap().args(RunStrategy::ParameterServer).is_empty());
        assert_eq!(
            c.args(RunStrategy::MultiWorkerMirrored),
            [
                "--embedding-rows",
                "1000000",
                "--embedding-dim",
                "16",
                "--train-records",
                "200000",
                "--test-records",
                "10000"
            ]
        );
        for strategy in
            [RunStrategy::ParameterServer, RunStrategy::OneDevice, RunStrategy::Mirrored, RunStrategy::CentralStorage]
        {
            assert_eq!(c.args(strategy)[8..], ["--table-optimizer", "lazy-adam", "--table-lr", "0.05"], "{strategy:?}");
        }
    }

    #[test]
    fn bad_ctr_settings_are_one_line_each_naming_the_field_and_the_line() {
        let bad = |from: &str, to: &str, want: &str| {
            let text = CTR.replace(from, to);
            assert_ne!(text, CTR, "{from}");
            let m = error(&text);
            assert!(m.contains(want), "{m}\nwants: {want}");
            assert_eq!(m.lines().count(), 1, "{m}");
        };
        bad(
            "embedding_rows = 1000000",
            "embedding_rows = 10",
            "x.toml line 8: experiment.embedding_rows: an embedding table of 10 rows of 16: use at least 26 rows",
        );
        bad(
            "embedding_dim = 16",
            "embedding_dim = 0",
            "x.toml line 9: experiment.embedding_dim: an embedding dimension of 0 is outside 1..=1024",
        );
        bad(
            "train_records = 200000",
            "train_records = 0",
            "x.toml line 10: experiment.train_records: must be 1 to 2^32 records",
        );
        bad(
            "test_records = 10000",
            "test_records = 5000000000",
            "x.toml line 11: experiment.test_records: must be 1 to 2^32 records",
        );
        bad("\"lazy-adam\"", "\"adam\"", "x.toml line 12: table_optimizer: unknown variant `adam`");
        bad(
            "table_lr = 0.05",
            "table_lr = 0.0",
            "x.toml line 13: experiment.table_lr: must be a positive learning rate, e.g. 0.05",
        );
        bad(
            "target_auc = 0.8",
            "target_auc = 0.5",
            "x.toml line 14: experiment.target_auc: must be an AUC above 0.5 (guessing) and at most 1, e.g. 0.77",
        );
        bad("target_auc = 0.8", "target_accuracy = 0.8", "x.toml line 14: experiment.target_accuracy: the ctr model is measured by test AUC; set target_auc (e.g. 0.77) instead, or no target");
        bad("target_auc = 0.8", "target_loss = 0.4", "experiment.target_loss: the ctr model is measured by test AUC");
        bad(
            "lr = 0.003",
            "lr = 0.003\ndata = \"d.csv\"",
            "x.toml line 8: experiment.data: applies to the digits models",
        );
        bad(
            "mode = \"sync\"\nworkers = 2",
            "mode = \"sync\"\nworkers = 2\nreplicas = 2",
            "x.toml line 20: run[0].replicas: a parameter-server worker with embedding tables runs one replica",
        );
        bad(
            "strategy = \"one-device\"",
            "strategy = \"one-device\"\nrecompute = true",
            "run[2].recompute: applies to model = \"mlp\" or \"transformer\", not model = \"ctr\"",
        );
        bad(
            "mode = \"hybrid\"\nworkers = 2",
            "mode = \"hybrid\"\nworkers = 2\nrestarts = 1",
            "x.toml line 26: run[1].restarts: a hybrid job's dense layers are synchronous",
        );
        assert_eq!(
            parse(&CTR.replace("lr = 0.003", "lr = 0.05\noptimizer = \"adagrad\"")).unwrap().optimizer,
            "adagrad"
        );
        let m = error(&format!("{CTR}\n[simulate]\nworkers = [2]\n"));
        assert!(
            m.contains("simulate: simulated mode models the digits MLP, not the ctr model: drop [simulate]"),
            "{m}"
        );
        // Table settings with no run that steps the rows.
        let one = CTR.split("[[run]]").next().unwrap().to_string() + "[[run]]\nstrategy = \"multi-worker-mirrored\"\n";
        let m = error(&one);
        assert!(
            m.contains("line 12: experiment.table_optimizer: applies to the runs that step the table's rows"),
            "{m}"
        );
        let m = error(&one.replace("table_optimizer = \"lazy-adam\"\n", ""));
        assert!(m.contains("experiment.table_lr: applies to the runs that step the table's rows"), "{m}");
        assert!(parse(&one.replace("multi-worker-mirrored", "mirrored")).is_ok());
        // Fields of the ctr model on another, and hybrid without tables.
        let e = error(&GOOD.replace("lr = 0.01", "lr = 0.01\nembedding_rows = 1000"));
        assert!(
            e.contains("line 8: experiment.embedding_rows: applies to model = \"ctr\", not model = \"mlp\"; drop it"),
            "{e}"
        );
        let e = error(&GOOD.replace("target_accuracy = 0.9", "target_accuracy = 0.9\ntarget_auc = 0.8"));
        assert!(e.contains("experiment.target_auc: applies to model = \"ctr\""), "{e}");
        let e = error(&GOOD.replace("mode = \"stale\"", "mode = \"hybrid\"").replace("staleness = 3\n", ""));
        assert!(
            e.contains("line 21: run[2].mode: hybrid trains the embedding tables on the ps tasks")
                && e.contains("not model = \"mlp\""),
            "{e}"
        );
    }

    #[test]
    fn delay_distributions_parse_and_sample() {
        let d: DelayDistribution = "uniform:10ms..30ms".parse().unwrap();
        assert_eq!(d.sample(0.5), Duration::from_millis(20));
        assert_eq!("fixed:2s".parse::<DelayDistribution>().unwrap().sample(0.9), Duration::from_secs(2));
        let e: DelayDistribution = "exp:10ms".parse().unwrap();
        assert_eq!(e.sample(0.0), Duration::ZERO);
        assert!((e.sample(1.0 - (-1.0f64).exp()).as_secs_f64() - 0.010).abs() < 1e-9);
        assert!("uniform:30ms..10ms".parse::<DelayDistribution>().is_err());
        assert!("fixed:10".parse::<DelayDistribution>().unwrap_err().contains("needs a unit"));
        assert_eq!(parse_duration("250us").unwrap(), Duration::from_micros(250));
    }

    #[test]
    fn the_shipped_experiments_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let e = Experiment::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                // Simulated mode models the digits MLP (and no lost workers), or the
                // transformer's time where [simulate] sends its bytes (wire_parameters): the
                // others run for real only.
                let sends_its_bytes = e.simulate.as_ref().is_some_and(|s| s.wire_parameters.is_some());
                let simulable = (e.model != RunModel::Transformer || sends_its_bytes)
                    && e.model != RunModel::Ctr
                    && e.injection.kill.is_empty();
                assert_eq!(e.simulate.is_some(), simulable, "{}", path.display());
                n += 1;
            }
        }
        assert!(n >= 3);
    }
}

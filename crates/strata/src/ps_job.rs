//! The parameter-server job: the step function every worker registers, and the coordinator's
//! training loop, for each of the three models (`strata train --model mlp|cnn|transformer`).
//!
//! A Rust closure cannot travel to another process, so the step is registered by name
//! ([`TRAIN_STEP`]) in the one binary every task runs: `strata worker` serves it, `strata ps`
//! holds the variables, and `strata train --strategy parameter-server` schedules it. A step
//! carries the job's [`PsJobSpec`] (the model and its sizes, replicas, seed, data) and names its
//! batch by `(epoch, batch)`, so the coordinator sends a few numbers, never data; each worker
//! builds the spec's model once ([`PsWorkerModel`]) and derives the batch itself,
//! deterministically:
//!
//! - the digits models (MLP, CNN): every worker draws the same seeded permutation of the
//!   training set per epoch (the one [`crate::trainer::Trainer`] uses, [`epoch_order`]) and takes
//!   rows `batch * size ..` of it;
//! - the transformer: `batch_size` windows of Tiny Shakespeare at random offsets,
//!   [`crate::shakespeare::Corpus::random_windows`] seeded with [`window_seed`]`(seed, epoch,
//!   batch)`; an epoch is as many steps as the coordinator schedules (`--steps`).
//!
//! Within a worker the step runs on the worker's local replicas: their gradients are reduced to
//! the parameter replica and pushed, once per step (with one replica and no clipping the push
//! starts while the backward pass runs, [`PsWorkerModel::backward_and_push`], unless the spec
//! turns `overlap` off; the transformer's
//! gradient clipped to a global norm of [`TRANSFORMER_CLIP_NORM`] first, as the other
//! strategies clip it; the ps tasks apply it at the rate of the learning-rate schedule the
//! coordinator gave them, by their own update count, or at a constant rate without one). The
//! coordinator evaluates the pulled parameters after every epoch: test accuracy
//! for the digits models, validation loss in nats per character for the transformer
//! ([`train_coordinator`]).
//!
//! Everything in a step arrives from the network, so a worker checks it before it builds or
//! allocates anything ([`PsJobSpec::validate`], [`PsJobSpec::validate_batch`]).

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use strata_core::data::{Batch, BatchData};
use strata_core::{ReduceOp, Strategy};
use strata_strategies::parameter_server::{
    ClusterCoordinator, ParameterServerStrategy, PsModel, PsWorkerModel, StepRegistry, WorkerContext,
};

use crate::cnn::Cnn;
use crate::ctr::{CtrBatch, CtrData, Dlrm, DlrmConfig, Split};
use crate::digits;
use crate::error::into_core;
use crate::model::{Classifier, Mlp};
use crate::shakespeare::{self, Corpus};
use crate::trainer::{EpochReport, FitReport, MetricValue, Progress, StepHook};
use crate::transformer::{CharTransformer, TransformerConfig};
use crate::{Error, Result};

/// The name the training step is registered under (every model's: the spec names the model).
pub const TRAIN_STEP: &str = "digits.train";

/// The transformer's gradient clipping (global norm), as `strata train` clips it under the other
/// strategies.
pub const TRANSFORMER_CLIP_NORM: f64 = 1.0;

/// The most characters one transformer step may hold (windows times context): 2^18, 128 times
/// the default step of 32 windows of 64.
pub const MAX_STEP_TOKENS: usize = 1 << 18;

/// Which model a parameter-server job trains.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PsModelKind {
    /// The digits MLP of [`PsJobSpec::hidden`].
    #[default]
    Mlp,
    /// The digits CNN ([`Cnn`]).
    Cnn,
    /// The character transformer of [`PsJobSpec::transformer`] on Tiny Shakespeare.
    Transformer,
    /// The click-through model of [`PsJobSpec::ctr`] ([`Dlrm`]) on generated records: its
    /// embedding table lives on the ps tasks in shards, and a step pulls only the rows its
    /// batch touches.
    Ctr,
}

impl PsModelKind {
    /// Its name (`strata train --model`'s).
    pub fn name(self) -> &'static str {
        match self {
            PsModelKind::Mlp => "mlp",
            PsModelKind::Cnn => "cnn",
            PsModelKind::Transformer => "transformer",
            PsModelKind::Ctr => "ctr",
        }
    }
}

/// The transformer's shape as a step carries it ([`TransformerConfig`], which is checked with
/// [`TransformerConfig::check`] before anything is built).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransformerShape {
    /// Distinct tokens (Tiny Shakespeare's 65 characters).
    pub vocab: usize,
    /// The embedding width.
    pub width: usize,
    /// Blocks.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// The longest sequence, and the length of every training window.
    pub context: usize,
}

impl From<TransformerConfig> for TransformerShape {
    fn from(c: TransformerConfig) -> Self {
        Self { vocab: c.vocab, width: c.width, layers: c.layers, heads: c.heads, context: c.context }
    }
}

impl From<TransformerShape> for TransformerConfig {
    fn from(s: TransformerShape) -> Self {
        Self { vocab: s.vocab, width: s.width, layers: s.layers, heads: s.heads, context: s.context }
    }
}

/// The click-through model's sizes and records as a step carries them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CtrShape {
    /// Rows of the embedding table (distinct ids over the 26 fields).
    pub embedding_rows: u64,
    /// The embedding dimension.
    pub embedding_dim: usize,
    /// Training records (an epoch).
    pub train_records: u64,
    /// Test records (the coordinator's evaluation).
    pub test_records: u64,
}

/// The most records one click-through step may hold: every id of a batch is pulled in one
/// request per ps task, which carries at most about 130,000 ids (26 per record).
pub const MAX_CTR_BATCH: usize = 4096;

/// The model and data a worker builds once and keeps between steps.
///
/// The JSON of the digits MLP's spec is the one it has always been (`hidden`, `replicas`,
/// `seed`, `data`); `model` defaults to `mlp`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PsJobSpec {
    /// The model.
    #[serde(default)]
    pub model: PsModelKind,
    /// Hidden layer sizes of the MLP (empty for the other models).
    #[serde(default)]
    pub hidden: Vec<usize>,
    /// The transformer's shape (only for the transformer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transformer: Option<TransformerShape>,
    /// Replicas of each worker (logical CPU devices; their gradients are summed before a push).
    pub replicas: usize,
    /// Seed of the shuffles and windows (and of the initial values, which the ps tasks hold).
    pub seed: u64,
    /// The digits file (`None`: the copy built into the binary; always `None` for the
    /// transformer, whose text is built in).
    pub data: Option<PathBuf>,
    /// Whether a worker's push starts while its backward pass runs (`--no-overlap`: after
    /// it); see [`PsWorkerModel::backward_and_push`]. Absent from the JSON when `true`.
    #[serde(default = "overlap_default", skip_serializing_if = "is_true")]
    pub overlap: bool,
    /// Whether a worker computes its gradients at the pulled values extrapolated by the
    /// updates expected to land before its push (`--no-lookahead`: at the pulled values); see
    /// [`PsWorkerModel::set_lookahead`]. Absent from the JSON when `true`.
    #[serde(default = "overlap_default", skip_serializing_if = "is_true")]
    pub lookahead: bool,
    /// Whether the workers recompute the MLP's hidden layers or the transformer's blocks in
    /// the backward pass (`--recompute`; [`strata_core::recompute`]). Absent from the JSON
    /// when `false`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub recompute: bool,
    /// The type the workers' models compute in (`--precision`): f32, or bf16 with f32
    /// variables (fp16 is refused: its loss scaling skips steps every worker would have to
    /// skip alike). Absent from the JSON when f32.
    #[serde(default, skip_serializing_if = "is_f32")]
    pub precision: strata_core::Precision,
    /// The click-through model's sizes and records (only for the ctr model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ctr: Option<CtrShape>,
}

fn is_f32(p: &strata_core::Precision) -> bool {
    *p == strata_core::Precision::F32
}

fn overlap_default() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

/// The digits job's spec under its former name.
pub type DigitsSpec = PsJobSpec;

impl PsJobSpec {
    /// The digits MLP of `hidden`.
    pub fn mlp(hidden: Vec<usize>, replicas: usize, seed: u64, data: Option<PathBuf>) -> Self {
        Self {
            model: PsModelKind::Mlp,
            hidden,
            transformer: None,
            replicas,
            seed,
            data,
            overlap: true,
            lookahead: true,
            recompute: false,
            precision: strata_core::Precision::F32,
            ctr: None,
        }
    }

    /// The digits CNN.
    pub fn cnn(replicas: usize, seed: u64, data: Option<PathBuf>) -> Self {
        Self {
            model: PsModelKind::Cnn,
            hidden: Vec::new(),
            transformer: None,
            replicas,
            seed,
            data,
            overlap: true,
            lookahead: true,
            recompute: false,
            precision: strata_core::Precision::F32,
            ctr: None,
        }
    }

    /// The transformer of `shape` on the built-in Tiny Shakespeare.
    pub fn transformer(shape: TransformerConfig, replicas: usize, seed: u64) -> Self {
        Self {
            model: PsModelKind::Transformer,
            hidden: Vec::new(),
            transformer: Some(shape.into()),
            replicas,
            seed,
            data: None,
            overlap: true,
            lookahead: true,
            recompute: false,
            precision: strata_core::Precision::F32,
            ctr: None,
        }
    }

    /// The click-through model of `shape` on records generated from `seed`, on workers of one
    /// replica (a worker with embedding tables runs one).
    pub fn ctr(shape: CtrShape, seed: u64) -> Self {
        Self { model: PsModelKind::Ctr, ctr: Some(shape), ..Self::cnn(1, seed, None) }
    }

    /// The click-through shape (an error for the other models, or when it is missing).
    fn ctr_shape(&self) -> Result<CtrShape> {
        match (self.model, self.ctr) {
            (PsModelKind::Ctr, Some(s)) => Ok(s),
            (PsModelKind::Ctr, None) => Err(Error::Usage("a ctr spec without its shape (\"ctr\": {...})".into())),
            (m, _) => Err(Error::Usage(format!("the {m} model has no ctr shape", m = m.name()))),
        }
    }

    /// The transformer's shape (an error for the other models, or when it is missing).
    fn shape(&self) -> Result<TransformerConfig> {
        match (self.model, self.transformer) {
            (PsModelKind::Transformer, Some(s)) => Ok(s.into()),
            (PsModelKind::Transformer, None) => {
                Err(Error::Usage("a transformer spec without its shape (\"transformer\": {...})".into()))
            }
            (m, _) => Err(Error::Usage(format!("the {} model has no transformer shape", m.name()))),
        }
    }

    /// Checks what the spec asks a worker to build before it builds anything: the model's
    /// sizes (the MLP's with [`crate::model::check_mlp`], the transformer's with
    /// [`TransformerConfig::check`] and Tiny Shakespeare's vocabulary; fields of another model
    /// are refused), 1 to [`strata_core::device::MAX_REPLICAS`] replicas, and at most
    /// [`crate::model::MAX_PARAMETERS`] times 4 parameters over all of them (each replica
    /// holds a copy of the model). A step's arguments arrive from the network, so a worker
    /// checks them here; an error is `Usage`, which the worker answers `INVALID_ARGUMENT`.
    pub fn validate(&self) -> Result<()> {
        let m = self.model.name();
        if self.model != PsModelKind::Mlp && !self.hidden.is_empty() {
            return Err(Error::Usage(format!("hidden layer sizes apply to the mlp, not the {m}")));
        }
        if self.model != PsModelKind::Transformer && self.transformer.is_some() {
            return Err(Error::Usage(format!("a transformer shape does not apply to the {m}")));
        }
        if self.model != PsModelKind::Ctr && self.ctr.is_some() {
            return Err(Error::Usage(format!("a ctr shape does not apply to the {m}")));
        }
        if self.precision.needs_loss_scale() {
            return Err(Error::Usage(
                "fp16 needs loss scaling, whose skipped steps every worker must skip alike, which asynchronous parameter servers cannot do; use bf16".into(),
            ));
        }
        if self.model == PsModelKind::Cnn && self.recompute {
            return Err(Error::Usage(
                "recomputation applies to the mlp's hidden layers and the transformer's blocks, not the cnn; drop it"
                    .into(),
            ));
        }
        let parameters = match self.model {
            PsModelKind::Mlp => crate::model::check_mlp(digits::FEATURES, &self.hidden, digits::CLASSES)?,
            PsModelKind::Cnn => Cnn::parameter_count(),
            PsModelKind::Transformer => {
                if self.data.is_some() {
                    return Err(Error::Usage(
                        "a data file applies to the digits models; the transformer's text is built in".into(),
                    ));
                }
                let shape = self.shape()?;
                shape.check()?;
                // Tiny Shakespeare's vocabulary (the built-in text's, which the worker loads).
                let vocab = TransformerConfig::default().vocab;
                if shape.vocab != vocab {
                    return Err(Error::Usage(format!(
                        "a transformer of {} tokens on Tiny Shakespeare's {vocab} characters; use a vocabulary of {vocab}",
                        shape.vocab
                    )));
                }
                shape.parameter_count()
            }
            PsModelKind::Ctr => self.check_ctr()?,
        };
        let max = strata_core::device::MAX_REPLICAS;
        if self.replicas == 0 || self.replicas > max {
            return Err(Error::Usage(format!("{} replicas per worker; the limit is 1 to {max}", self.replicas)));
        }
        let limit = 4 * crate::model::MAX_PARAMETERS;
        if parameters.saturating_mul(self.replicas) > limit {
            return Err(Error::Usage(format!(
                "{} replicas of a {parameters}-parameter {m} hold more than {limit} parameters, the limit; use fewer replicas or a smaller model",
                self.replicas
            )));
        }
        Ok(())
    }

    /// The ctr spec's checks; its dense parameter count.
    fn check_ctr(&self) -> Result<usize> {
        let shape = self.ctr_shape()?;
        if self.replicas != 1 || self.data.is_some() || self.recompute || self.precision != strata_core::Precision::F32
        {
            return Err(Error::Usage(
                "the ctr model on parameter servers runs in f32 on workers of one replica, on generated records, without recomputation; drop --replicas, --data, --recompute and --precision".into(),
            ));
        }
        if shape.train_records == 0 || shape.test_records == 0 {
            return Err(Error::Usage("the ctr job needs at least one training and one test record".into()));
        }
        // The table's size, the data's bounds: refused here, before a worker builds anything.
        CtrData::new(self.seed, shape.embedding_rows)?;
        let config = DlrmConfig::new(shape.embedding_rows, shape.embedding_dim);
        config.check()?;
        Ok(config.dense_parameter_count())
    }

    /// Checks a step's batch size: at least 1 example, and for the transformer at most
    /// [`MAX_STEP_TOKENS`] characters (windows times context). The digits models take at most
    /// the training set (a batch past its end is refused when it is cut).
    pub fn validate_batch(&self, batch_size: usize) -> Result<()> {
        if batch_size == 0 {
            return Err(Error::Usage("a batch of 0 examples: a step needs at least 1".into()));
        }
        if self.model == PsModelKind::Ctr && batch_size > MAX_CTR_BATCH {
            return Err(Error::Usage(format!(
                "a batch of {batch_size} click records is over the limit of {MAX_CTR_BATCH} per worker step; use a smaller batch"
            )));
        }
        if self.model == PsModelKind::Transformer {
            let context = self.shape()?.context;
            if batch_size.saturating_mul(context) > MAX_STEP_TOKENS {
                return Err(Error::Usage(format!(
                    "a batch of {batch_size} windows of {context} characters is over the limit of {MAX_STEP_TOKENS} characters per step; use a smaller batch"
                )));
            }
        }
        Ok(())
    }
}

/// The seed of the transformer's windows of batch `batch` of `epoch`: a mix (SplitMix64) of the
/// three, so every (epoch, batch) draws its own windows and every worker draws the same ones.
pub fn window_seed(seed: u64, epoch: u64, batch: u64) -> u64 {
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    mix(mix(mix(seed) ^ epoch) ^ batch)
}

/// One scheduled step: batch `batch` of epoch `epoch`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DigitsStep {
    /// The model and data.
    pub spec: PsJobSpec,
    /// The epoch (the digits permutation's seed is `seed + epoch`).
    pub epoch: u64,
    /// The batch within the epoch.
    pub batch: u64,
    /// Examples (transformer: windows) per batch.
    pub batch_size: usize,
}

/// What a step reports back.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DigitsStepResult {
    /// The batch's mean loss, before the update.
    pub loss: f32,
    /// Examples in the batch.
    pub examples: usize,
    /// The worker that ran it.
    pub worker: usize,
    /// Whether a sync-mode round dropped the update (a backup worker's late push).
    pub dropped: bool,
    /// Seconds the step took on the worker.
    pub seconds: f64,
    /// When the push was answered (seconds since the Unix epoch, on the worker's clock).
    #[serde(default)]
    pub finished_unix: f64,
    /// Updates applied between the pull and the push (the largest over the ps tasks).
    #[serde(default)]
    pub staleness: u64,
    /// The ps tasks' version after the push (the largest): updates applied so far.
    #[serde(default)]
    pub version: u64,
    /// Bytes pushed (and pulled) by the step.
    #[serde(default)]
    pub bytes_sent: u64,
    /// Bytes pulled by the step.
    #[serde(default)]
    pub bytes_received: u64,
}

/// How a worker runs the digits step.
#[derive(Clone, Debug, Default)]
pub struct WorkerStepOptions {
    /// Called between a step's gradients and its push, with the step's pull and compute time
    /// (`strata compare`'s slow workers and stragglers sleep here).
    pub hook: Option<Arc<dyn StepHook>>,
}

/// The model a worker builds from its spec, over the worker's replicas; its optimizer pushes.
enum WorkerModel {
    Mlp(PsWorkerModel<Mlp>),
    Cnn(PsWorkerModel<Cnn>),
    Transformer(PsWorkerModel<CharTransformer>),
    Ctr(PsWorkerModel<Dlrm>),
}

/// Where a worker's batches come from.
enum WorkerData {
    /// The digits training split, and the permutation of the current epoch.
    Digits { train: Batch, order: Option<(u64, Vec<usize>)> },
    /// Tiny Shakespeare.
    Text(Box<Corpus>),
    /// Generated click records.
    Ctr(Box<CtrData>),
}

/// What a worker keeps between steps.
struct WorkerState {
    spec: PsJobSpec,
    data: WorkerData,
    model: WorkerModel,
}

impl WorkerState {
    fn new(spec: &PsJobSpec) -> Result<Self> {
        let options = strata_core::StrategyOptions { seed: spec.seed, overlap: spec.overlap, ..Default::default() };
        let digits_data = || -> Result<WorkerData> {
            let all = digits::load(spec.data.as_deref())?;
            let (train, _) = digits::train_test_split(&all, 0.2, 0);
            Ok(WorkerData::Digits { train, order: None })
        };
        let (data, model) = match spec.model {
            PsModelKind::Mlp => {
                let hidden = spec.hidden.clone();
                let mut worker = PsWorkerModel::new(spec.replicas, options, |s| {
                    Ok(Mlp::new(s.var_builder(), digits::FEATURES, &hidden, digits::CLASSES)?
                        .with_recompute(spec.recompute)
                        .with_precision(spec.precision))
                })?;
                worker.set_lookahead(spec.lookahead);
                (digits_data()?, WorkerModel::Mlp(worker))
            }
            PsModelKind::Cnn => {
                let mut worker = PsWorkerModel::new(spec.replicas, options, |s| {
                    Ok(Cnn::new(s.var_builder())?.with_precision(spec.precision))
                })?;
                worker.set_lookahead(spec.lookahead);
                (digits_data()?, WorkerModel::Cnn(worker))
            }
            PsModelKind::Transformer => {
                let corpus = shakespeare::load()?;
                let shape = spec.shape()?;
                if corpus.vocab_size() != shape.vocab {
                    return Err(Error::Usage(format!(
                        "a transformer of {} tokens on a text of {} characters; use a vocabulary of {}",
                        shape.vocab,
                        corpus.vocab_size(),
                        corpus.vocab_size()
                    )));
                }
                let mut worker = PsWorkerModel::new(spec.replicas, options, |s| {
                    Ok(CharTransformer::new(shape, s.var_builder())?
                        .with_recompute(spec.recompute)
                        .with_precision(spec.precision))
                })?;
                worker.clip_global_norm(TRANSFORMER_CLIP_NORM)?;
                worker.set_lookahead(spec.lookahead);
                (WorkerData::Text(Box::new(corpus)), WorkerModel::Transformer(worker))
            }
            PsModelKind::Ctr => {
                let shape = spec.ctr_shape()?;
                let config = DlrmConfig::new(shape.embedding_rows, shape.embedding_dim);
                let mut worker = PsWorkerModel::new(1, options, |s| Dlrm::new(s, config))?;
                worker.set_lookahead(spec.lookahead);
                let data = CtrData::new(spec.seed, shape.embedding_rows)?;
                (WorkerData::Ctr(Box::new(data)), WorkerModel::Ctr(worker))
            }
        };
        Ok(Self { spec: spec.clone(), data, model })
    }
}

impl WorkerData {
    /// The digits examples of batch `batch` of `epoch` (the permutation of `seed + epoch`).
    fn digits_batch(&mut self, seed: u64, epoch: u64, batch: u64, size: usize) -> Result<Batch> {
        let WorkerData::Digits { train, order } = self else {
            return Err(Error::Usage("the transformer's worker has no digits".into()));
        };
        if order.as_ref().is_none_or(|(e, _)| *e != epoch) {
            *order = Some((epoch, epoch_order(train.len(), seed, epoch)));
        }
        let order = order.as_ref().map(|(_, o)| o.as_slice()).unwrap_or_default();
        let start = (batch as usize).saturating_mul(size);
        if size == 0 || start >= order.len() {
            return Err(Error::Usage(format!(
                "batch {batch} of {size} examples is past the end of the {} training examples",
                order.len()
            )));
        }
        Ok(digits::gather(train, &order[start..(start + size).min(order.len())]))
    }

    /// The transformer's windows of batch `batch` of `epoch` ([`window_seed`]).
    fn text_batch(&self, spec: &PsJobSpec, epoch: u64, batch: u64, size: usize) -> Result<(Tensor, Tensor)> {
        let WorkerData::Text(corpus) = self else {
            return Err(Error::Usage("a digits worker has no text".into()));
        };
        corpus.random_windows(size, spec.shape()?.context, window_seed(spec.seed, epoch, batch))
    }
}

impl WorkerData {
    /// Training records `batch * size ..` of the click data (the same every epoch: records
    /// are a function of their index).
    fn ctr_batch(&self, spec: &PsJobSpec, batch: u64, size: usize) -> Result<CtrBatch> {
        let WorkerData::Ctr(data) = self else {
            return Err(Error::Usage("this worker has no click records".into()));
        };
        let records = spec.ctr_shape()?.train_records;
        let start = batch.saturating_mul(size as u64);
        if start >= records {
            return Err(Error::Usage(format!(
                "batch {batch} of {size} records is past the end of the {records} training records"
            )));
        }
        data.batch(Split::Train, start..(start + size as u64).min(records), &Device::Cpu)
    }
}

/// No table rows to pull ahead (a model without an embedding table).
fn no_rows<M, B>(_: &M, _: &B) -> Result<()> {
    Ok(())
}

/// The click model's loss on a replica's shard.
fn ctr_loss(model: &Dlrm, dev: &Device, batch: &CtrBatch) -> Result<Tensor> {
    let (dense, ids, labels) = batch.to_device(dev)?;
    Ok(model.loss(&dense, &ids, &labels)?)
}

/// The permutation of the training set in `epoch` (the same as [`crate::trainer::Trainer`]'s).
pub fn epoch_order(len: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..len).collect();
    idx.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed.wrapping_add(epoch)));
    idx
}

fn lock(state: &Mutex<Option<WorkerState>>) -> MutexGuard<'_, Option<WorkerState>> {
    state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A digits model's loss on a replica's shard.
fn digits_loss<M: Classifier>(model: &M, dev: &Device, batch: &Batch) -> Result<Tensor> {
    let (x, y) = (batch.features_tensor(dev)?, batch.labels_tensor(dev)?);
    Ok(model.loss(&x, &y)?)
}

/// The transformer's loss on a replica's shard of `(inputs, targets)` windows.
fn text_loss(model: &CharTransformer, dev: &Device, batch: &(Tensor, Tensor)) -> Result<Tensor> {
    let (x, y) = batch.to_device(dev)?;
    Ok(model.loss(&x, &y)?)
}

/// One step of `worker` on the batch `make` returns (made on this thread while another pulls
/// the variables, and its table rows pulled ahead by `prefetch`): the worker's replicas compute
/// their shards' gradients, reduce them to the parameter replica, and the optimizer pushes
/// them (as under any strategy).
fn step_on<M: Send + Sync, B: BatchData>(
    ctx: &WorkerContext,
    worker: &PsWorkerModel<M>,
    make: impl FnOnce() -> Result<B>,
    prefetch: impl FnOnce(&M, &B) -> Result<()>,
    loss_of: impl Fn(&M, &Device, &B) -> Result<Tensor> + Sync,
    hook: (&WorkerStepOptions, u64, Instant),
) -> Result<(f32, strata_strategies::parameter_server::PullTicket, strata_strategies::parameter_server::PushSummary)> {
    let (options, global_step, started) = hook;
    let make = || make().map_err(into_core);
    let prefetch = |m: &M, b: &B| prefetch(m, b).map_err(into_core);
    let out = worker.run_batch_made(ctx, make, prefetch, |rctx, shard| {
        let dev = rctx.candle_device();
        let loss = loss_of(worker.model().on(rctx)?, dev, &shard.batch).map_err(into_core)?;
        // The push starts while the pass runs where the worker overlaps (one replica, no
        // clipping); the hook runs after the pass, before the push is committed.
        worker.backward_and_push_then(rctx, &loss, || {
            if let (Some(hook), 0) = (&options.hook, rctx.replica_id()) {
                hook.after_backward(ctx.worker_index(), global_step, started.elapsed());
            }
        })?;
        Ok(loss.to_scalar::<f32>()? * shard.weight())
    })?;
    let loss = worker.strategy().reduce(ReduceOp::Sum, &out.values)?;
    let pushed = out.push.ok_or_else(|| Error::Usage("the training step pushed nothing".into()))?;
    Ok((loss, out.pull, pushed))
}

fn run_step(
    ctx: &WorkerContext,
    step: DigitsStep,
    state: &Mutex<Option<WorkerState>>,
    options: &WorkerStepOptions,
) -> Result<DigitsStepResult> {
    let started = Instant::now();
    step.spec.validate()?;
    step.spec.validate_batch(step.batch_size)?;
    let mut guard = lock(state);
    if guard.as_ref().is_none_or(|s| s.spec != step.spec) {
        // The old model goes first: the new one is built within the limits, not beside them.
        *guard = None;
        *guard = Some(WorkerState::new(&step.spec)?);
    }
    let st = guard.as_mut().ok_or_else(|| Error::Usage("worker state missing".into()))?;
    let global_step = step.epoch.saturating_mul(1_000_000).saturating_add(step.batch);
    let hook = (options, global_step, started);
    let (epoch, index, size) = (step.epoch, step.batch, step.batch_size);
    let (examples, bytes0, (loss, ticket, pushed)) = match &st.model {
        WorkerModel::Mlp(w) => {
            let batch = st.data.digits_batch(st.spec.seed, epoch, index, size)?;
            let (examples, bytes0) = (batch.len(), strata_transport::inject::bytes());
            (examples, bytes0, step_on(ctx, w, || Ok(batch), no_rows, digits_loss, hook)?)
        }
        WorkerModel::Cnn(w) => {
            let batch = st.data.digits_batch(st.spec.seed, epoch, index, size)?;
            let (examples, bytes0) = (batch.len(), strata_transport::inject::bytes());
            (examples, bytes0, step_on(ctx, w, || Ok(batch), no_rows, digits_loss, hook)?)
        }
        WorkerModel::Transformer(w) => {
            let batch = st.data.text_batch(&st.spec, epoch, index, size)?;
            let bytes0 = strata_transport::inject::bytes();
            (size, bytes0, step_on(ctx, w, || Ok(batch), no_rows, text_loss, hook)?)
        }
        WorkerModel::Ctr(w) => {
            // The records are generated while the variables are pulled.
            let bytes0 = strata_transport::inject::bytes();
            let (data, spec) = (&st.data, &st.spec);
            let rows = std::cell::Cell::new(0);
            let make = || {
                let batch = data.ctr_batch(spec, index, size)?;
                rows.set(batch.rows()?);
                Ok(batch)
            };
            // The batch's rows are pulled as soon as it is made, beside the dense pull.
            let prefetch = |m: &Dlrm, b: &CtrBatch| Ok(m.embedding().prefetch(&b.1)?);
            let stepped = step_on(ctx, w, make, prefetch, ctr_loss, hook)?;
            (rows.get(), bytes0, stepped)
        }
    };
    let bytes1 = strata_transport::inject::bytes();
    let (mut staleness, mut version) = (0, 0);
    for (i, (_, outcome)) in pushed.outcomes.iter().enumerate() {
        let base = ticket.versions().get(i).copied().unwrap_or(0);
        match *outcome {
            strata_transport::ps::PushOutcome::Applied { version: v, .. } => {
                staleness = staleness.max(v.saturating_sub(base + 1));
                version = version.max(v);
            }
            strata_transport::ps::PushOutcome::Dropped { version: v } => version = version.max(v),
        }
    }
    Ok(DigitsStepResult {
        loss,
        examples,
        worker: ctx.worker_index(),
        dropped: pushed.dropped(),
        seconds: started.elapsed().as_secs_f64(),
        finished_unix: unix_now(),
        staleness,
        version,
        bytes_sent: bytes1.0 - bytes0.0,
        bytes_received: bytes1.1 - bytes0.1,
    })
}

/// Seconds since the Unix epoch (the clock every process on this machine shares).
pub fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// The step functions of the digits job, for `strata worker`.
pub fn worker_registry(options: WorkerStepOptions) -> StepRegistry {
    let state: Arc<Mutex<Option<WorkerState>>> = Arc::new(Mutex::new(None));
    let mut registry = StepRegistry::new();
    registry.register(TRAIN_STEP, move |ctx: &WorkerContext, step: DigitsStep| {
        run_step(ctx, step, &state, &options).map_err(into_core)
    });
    registry
}

/// How the coordinator trains.
#[derive(Clone, Debug)]
pub struct PsTrainConfig {
    /// The model and data every worker builds.
    pub spec: PsJobSpec,
    /// Passes over the training set (the transformer: rounds of `steps_per_epoch` steps).
    pub epochs: usize,
    /// Examples (transformer: windows) per scheduled step (one worker's batch).
    pub batch_size: usize,
    /// The transformer's steps per epoch (`--steps`); the digits models step through their
    /// training set (`ceil(examples / batch_size)` steps).
    pub steps_per_epoch: Option<usize>,
    /// Where progress goes.
    pub progress: Option<Arc<dyn Progress>>,
    /// Stop after this many steps.
    pub max_steps: Option<usize>,
    /// Write a record per worker step and per evaluation here.
    pub metrics: Option<Arc<crate::metrics::MetricsWriter>>,
}

/// The coordinator's copy of the model: the variables the ps tasks hold, pulled to evaluate.
#[derive(Debug)]
pub enum PsJobModel {
    /// The digits MLP.
    Mlp(PsModel<Mlp>),
    /// The digits CNN.
    Cnn(PsModel<Cnn>),
    /// The transformer.
    Transformer(PsModel<CharTransformer>),
    /// The click-through model (its table on the ps tasks, never here).
    Ctr(PsModel<Dlrm>),
}

/// What the coordinator evaluates on: the digits test split, or the validation windows.
enum EvalData {
    Digits { x: Tensor, y: Tensor, len: usize },
    Text { inputs: Tensor, targets: Tensor },
    Ctr(CtrBatch),
}

/// Validation windows per forward pass of the transformer's evaluation.
const EVAL_WINDOWS: usize = 256;

impl PsJobModel {
    /// Creates `spec`'s model's variables on the ps tasks (their initial values from the
    /// strategy's seed), after checking the spec.
    pub fn build(strategy: &ParameterServerStrategy, spec: &PsJobSpec) -> Result<Self> {
        spec.validate()?;
        Ok(match spec.model {
            PsModelKind::Mlp => {
                let hidden = spec.hidden.clone();
                PsJobModel::Mlp(
                    strategy.scope(|s| Mlp::new(s.var_builder(), digits::FEATURES, &hidden, digits::CLASSES))?,
                )
            }
            PsModelKind::Cnn => PsJobModel::Cnn(strategy.scope(|s| Cnn::new(s.var_builder()))?),
            PsModelKind::Transformer => {
                let shape = spec.shape()?;
                PsJobModel::Transformer(strategy.scope(|s| CharTransformer::new(shape, s.var_builder()))?)
            }
            PsModelKind::Ctr => {
                let shape = spec.ctr_shape()?;
                let config = DlrmConfig::new(shape.embedding_rows, shape.embedding_dim);
                PsJobModel::Ctr(strategy.scope(|s| Dlrm::new(s, config))?)
            }
        })
    }

    /// The variables (the coordinator's copies, as of the last pull).
    pub fn variables(&self) -> &[(String, candle_core::Var)] {
        match self {
            PsJobModel::Mlp(m) => m.variables(),
            PsJobModel::Cnn(m) => m.variables(),
            PsJobModel::Transformer(m) => m.variables(),
            PsJobModel::Ctr(m) => m.variables(),
        }
    }

    /// Pulls the variables from the ps tasks.
    pub fn pull(&self) -> Result<()> {
        match self {
            PsJobModel::Mlp(m) => m.pull()?,
            PsJobModel::Cnn(m) => m.pull()?,
            PsJobModel::Transformer(m) => m.pull()?,
            PsJobModel::Ctr(m) => m.pull()?,
        };
        Ok(())
    }

    /// The pulled model's metric on `data`: test accuracy (digits) or the mean validation loss
    /// in nats per character (the transformer, over every validation window).
    fn evaluate(&self, data: &EvalData) -> Result<MetricValue> {
        match (self, data) {
            (PsJobModel::Mlp(m), EvalData::Digits { x, y, len }) => accuracy(m.model(), x, y, *len),
            (PsJobModel::Cnn(m), EvalData::Digits { x, y, len }) => accuracy(m.model(), x, y, *len),
            (PsJobModel::Transformer(m), EvalData::Text { inputs, targets }) => {
                let n = inputs.dim(0)?;
                let mut sum = 0f64;
                for start in (0..n).step_by(EVAL_WINDOWS) {
                    let len = EVAL_WINDOWS.min(n - start);
                    let loss = m.model().loss(&inputs.narrow(0, start, len)?, &targets.narrow(0, start, len)?)?;
                    sum += f64::from(loss.to_scalar::<f32>()?) * len as f64;
                }
                Ok(MetricValue { name: "loss".into(), value: sum / n.max(1) as f64 })
            }
            // The table's rows are looked up on the ps tasks as the evaluation reads them.
            (PsJobModel::Ctr(m), EvalData::Ctr(batch)) => {
                Ok(MetricValue { name: "auc".into(), value: m.model().auc(batch)? })
            }
            _ => Err(Error::Usage("the evaluation data does not fit the model".into())),
        }
    }
}

fn accuracy<M: Classifier>(model: &M, x: &Tensor, y: &Tensor, len: usize) -> Result<MetricValue> {
    let correct = model.correct(x, y)?;
    Ok(MetricValue { name: "accuracy".into(), value: correct as f64 / len.max(1) as f64 })
}

/// What the coordinator saw besides the training figures.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CoordinatorStats {
    /// Steps run again (on another worker, or after a parameter server came back).
    pub steps_rescheduled: u64,
    /// Times a worker was found lost.
    pub worker_failures: u64,
    /// Steps whose update a sync round dropped (backup workers' late pushes).
    pub steps_dropped: u64,
}

/// The steps of an epoch and what the coordinator evaluates on: the digits test split, the
/// transformer's validation windows, or the ctr model's test records.
fn epoch_and_evaluation(config: &PsTrainConfig) -> Result<(usize, EvalData)> {
    match config.spec.model {
        PsModelKind::Transformer => {
            let steps = config.steps_per_epoch.filter(|&n| n > 0).ok_or_else(|| {
                Error::Usage("the transformer's epoch needs a number of steps (--steps 1 or more)".into())
            })?;
            let corpus = shakespeare::load()?;
            let (inputs, targets) = corpus.validation_windows(config.spec.shape()?.context)?;
            Ok((steps, EvalData::Text { inputs, targets }))
        }
        PsModelKind::Ctr => {
            let shape = config.spec.ctr_shape()?;
            let data = CtrData::new(config.spec.seed, shape.embedding_rows)?;
            let test = data.batch(Split::Test, 0..shape.test_records, &Device::Cpu)?;
            let steps = usize::try_from(shape.train_records.div_ceil(config.batch_size as u64)).unwrap_or(usize::MAX);
            Ok((steps, EvalData::Ctr(test)))
        }
        PsModelKind::Mlp | PsModelKind::Cnn => {
            let all = digits::load(config.spec.data.as_deref())?;
            let (train, test) = digits::train_test_split(&all, 0.2, 0);
            let (x, y) = (test.features_tensor(&Device::Cpu)?, test.labels_tensor(&Device::Cpu)?);
            Ok((train.len().div_ceil(config.batch_size), EvalData::Digits { x, y, len: test.len() }))
        }
    }
}

/// The job's step to resume from: the step of the checkpoint every ps task was restored from
/// ([`ClusterCoordinator::first_step`]); refused when the job has no step left after it.
fn resume_step(coordinator: &ClusterCoordinator, steps_per_epoch: usize, config: &PsTrainConfig) -> Result<usize> {
    let resumed = usize::try_from(coordinator.first_step()).unwrap_or(usize::MAX);
    let total = steps_per_epoch.saturating_mul(config.epochs);
    let last = config.max_steps.map_or(total, |m| m.min(total));
    if resumed > 0 && resumed >= last {
        let max = config.max_steps.map_or(String::new(), |m| format!(", at most {m} steps"));
        return Err(Error::Usage(format!(
            "the ps tasks were restored from the checkpoint of step {resumed}, and this job ends at step {last} ({} epochs of {steps_per_epoch} steps{max}); train for more epochs to go on from it",
            config.epochs
        )));
    }
    if resumed > 0 {
        tracing::info!(step = resumed, "resuming from the ps tasks' checkpoint");
        eprintln!("resumed from the ps tasks' checkpoint of step {resumed}");
    }
    Ok(resumed)
}

/// The batches of `epoch` a job runs: those after the step it resumed from and within
/// `max_steps` (both counted in the job's steps); `None` when there are none.
fn epoch_batches(
    epoch: usize,
    steps_per_epoch: usize,
    resumed: usize,
    max_steps: Option<usize>,
) -> Option<std::ops::Range<usize>> {
    let before = epoch * steps_per_epoch;
    let first = resumed.saturating_sub(before).min(steps_per_epoch);
    let end = max_steps.map_or(steps_per_epoch, |m| m.saturating_sub(before).min(steps_per_epoch));
    (first < end).then_some(first..end)
}

/// The coordinator's side: schedules every step of every epoch on the workers, evaluates the
/// pulled parameters after each epoch (test accuracy for the digits models, validation loss in
/// nats per character for the transformer), and reports as [`crate::trainer::Trainer::fit`]
/// does. A job whose ps tasks were all restored from the checkpoint of step `s`
/// ([`ParameterServerStrategy::restored_step`]) resumes there: the steps before `s` (the
/// epochs before it, and the first batches of its epoch) are not run again, `--max-steps`
/// counts them, and the report's `resumed_from_step` is `s`.
pub fn train_coordinator(
    strategy: &ParameterServerStrategy,
    model: &PsJobModel,
    config: &PsTrainConfig,
) -> Result<(FitReport, CoordinatorStats)> {
    let started = Instant::now();
    config.spec.validate()?;
    if config.epochs == 0 {
        return Err(Error::Usage("0 epochs train nothing: train for 1 epoch or more".into()));
    }
    config.spec.validate_batch(config.batch_size)?;
    // The digits models' metric is accuracy; the transformer's a loss, the ctr model's the AUC.
    let accuracy_metric = matches!(config.spec.model, PsModelKind::Mlp | PsModelKind::Cnn);
    let (steps_per_epoch, eval_data) = epoch_and_evaluation(config)?;
    let coordinator = strategy.coordinator()?;
    let resumed = resume_step(&coordinator, steps_per_epoch, config)?;
    let progress: &dyn Progress = config.progress.as_deref().unwrap_or(&crate::trainer::Silent);
    progress.begin((steps_per_epoch * config.epochs - resumed) as u64);
    let mut epochs = Vec::with_capacity(config.epochs);
    let (mut steps, mut steady_examples, mut steady_time) = (0usize, 0usize, Duration::ZERO);
    let mut final_metric: Option<MetricValue> = None;
    let mut dropped = 0u64;
    let started_unix = unix_now() - started.elapsed().as_secs_f64();
    let (mut recorded_steps, mut recorded_examples, mut updates) = (0u64, 0u64, 0u64);
    for epoch in 0..config.epochs {
        let Some(batches) = epoch_batches(epoch, steps_per_epoch, resumed, config.max_steps) else { continue };
        let n = batches.len();
        let t0 = Instant::now();
        let values: Vec<_> = batches
            .map(|b| {
                coordinator.schedule::<DigitsStep, DigitsStepResult>(
                    TRAIN_STEP,
                    &DigitsStep {
                        spec: config.spec.clone(),
                        epoch: epoch as u64,
                        batch: b as u64,
                        batch_size: config.batch_size,
                    },
                )
            })
            .collect();
        let (mut loss, mut examples) = (0.0f64, 0usize);
        let mut results = Vec::with_capacity(values.len());
        for v in &values {
            let r = v.fetch()?;
            loss += f64::from(r.loss) * r.examples as f64;
            examples += r.examples;
            dropped += u64::from(r.dropped);
            progress.advance(1);
            results.push(r);
        }
        coordinator.join()?;
        if let Some(m) = &config.metrics {
            // In the order the pushes were answered.
            results.sort_by(|a, b| a.finished_unix.total_cmp(&b.finished_unix));
            for r in &results {
                recorded_steps += 1;
                recorded_examples += r.examples as u64;
                updates = updates.max(r.version);
                let mut rec = crate::metrics::MetricRecord::step(
                    recorded_steps,
                    r.version,
                    (r.finished_unix - started_unix).max(0.0),
                    recorded_examples,
                    r.loss,
                );
                rec.staleness = (!r.dropped).then_some(r.staleness);
                rec.bytes_sent = r.bytes_sent;
                rec.bytes_received = r.bytes_received;
                rec.worker = Some(r.worker as u32);
                rec.dropped = r.dropped;
                m.write(&rec)?;
            }
        }
        let step_time = t0.elapsed();
        steps += n;
        if epoch > 0 || config.epochs == 1 {
            steady_examples += examples;
            steady_time += step_time;
        }
        model.pull()?;
        let metric = model.evaluate(&eval_data)?;
        let test_accuracy = if accuracy_metric { metric.value as f32 } else { 0.0 };
        if let Some(m) = &config.metrics {
            let wall = unix_now() - started_unix;
            let (steps, examples) = (recorded_steps, recorded_examples);
            let record = match config.spec.model {
                PsModelKind::Transformer => {
                    crate::metrics::MetricRecord::eval_loss(steps, updates, wall, examples, metric.value as f32)
                }
                PsModelKind::Ctr => {
                    crate::metrics::MetricRecord::eval_auc(steps, updates, wall, examples, metric.value as f32)
                }
                PsModelKind::Mlp | PsModelKind::Cnn => {
                    crate::metrics::MetricRecord::eval(steps, updates, wall, examples, test_accuracy)
                }
            };
            m.write(&record)?;
        }
        let train_loss = (loss / examples.max(1) as f64) as f32;
        let line = match config.spec.model {
            PsModelKind::Transformer => format!("loss {train_loss:.4} validation loss {:.4}", metric.value),
            PsModelKind::Ctr => format!("loss {train_loss:.4} test auc {:.4}", metric.value),
            _ => format!("loss {train_loss:.4} accuracy {:.2}%", metric.value * 100.0),
        };
        progress.epoch(epoch, &line);
        epochs.push(EpochReport {
            epoch,
            train_loss,
            test_accuracy,
            step_seconds: step_time.as_secs_f64(),
            test_metrics: vec![metric.clone()],
        });
        final_metric = Some(metric);
    }
    progress.end();
    tracing::info!(
        steps,
        rescheduled = coordinator.steps_rescheduled(),
        worker_failures = coordinator.worker_failures(),
        "coordinator finished"
    );
    let stats = CoordinatorStats {
        steps_rescheduled: coordinator.steps_rescheduled(),
        worker_failures: coordinator.worker_failures(),
        steps_dropped: dropped,
    };
    coordinator.shutdown();
    let report = FitReport {
        epochs,
        final_test_accuracy: final_metric.as_ref().filter(|_| accuracy_metric).map_or(0.0, |m| m.value as f32),
        final_metrics: final_metric.into_iter().collect(),
        examples_per_second: steady_examples as f64 / steady_time.as_secs_f64().max(1e-9),
        steps,
        resumed_from_step: resumed,
        skipped_examples: 0,
        wall_seconds: started.elapsed().as_secs_f64(),
        stopped: None,
        peak_footprints: Vec::new(),
        loss_scale: None,
        outer_traffic: None,
    };
    Ok((report, stats))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job resumed from step `s` runs the batches after it, within `--max-steps`, both counted
    /// in the job's steps; a fresh job runs every batch as before.
    #[test]
    fn a_resumed_job_runs_the_batches_after_its_step() {
        let b = |epoch, resumed, max| epoch_batches(epoch, 16, resumed, max);
        assert_eq!((b(0, 0, None), b(1, 0, None), b(0, 0, Some(5))), (Some(0..16), Some(0..16), Some(0..5)));
        assert_eq!((b(0, 15, None), b(1, 15, None), b(0, 16, None)), (Some(15..16), Some(0..16), None));
        assert_eq!((b(1, 20, Some(25)), b(2, 20, Some(25)), b(0, 20, Some(25))), (Some(4..9), None, None));
    }

    #[test]
    fn the_mlp_spec_keeps_its_json_and_other_models_are_checked_before_building() {
        // The digits MLP's JSON as it always was: `model` defaults to mlp.
        let old: PsJobSpec = serde_json::from_str(r#"{"hidden":[16],"replicas":1,"seed":0,"data":null}"#).unwrap();
        assert_eq!(old, PsJobSpec::mlp(vec![16], 1, 0, None));
        old.validate().unwrap();
        let t = PsJobSpec::transformer(TransformerConfig::default(), 2, 3);
        let back: PsJobSpec = serde_json::from_str(&serde_json::to_string(&t).unwrap()).unwrap();
        assert_eq!(back, t);
        t.validate().unwrap();
        PsJobSpec::cnn(1, 0, None).validate().unwrap();
        let err = |s: &PsJobSpec| s.validate().unwrap_err().to_string();
        let e = err(&PsJobSpec { hidden: vec![8], ..PsJobSpec::cnn(1, 0, None) });
        assert!(e.contains("hidden layer sizes apply to the mlp, not the cnn"), "{e}");
        let bad = |f: &dyn Fn(&mut TransformerShape)| {
            let mut s = t.clone();
            f(s.transformer.as_mut().unwrap());
            err(&s)
        };
        assert!(bad(&|s| s.heads = 3).contains("does not split into 3 heads"));
        assert!(bad(&|s| s.width = 1 << 20).contains("the limit"));
        assert!(bad(&|s| s.vocab = 66).contains("use a vocabulary of 65"));
        assert!(bad(&|s| s.layers = 0).contains("at least 1"));
        let e = err(&PsJobSpec { transformer: None, ..t.clone() });
        assert!(e.contains("without its shape"), "{e}");
        let e = err(&PsJobSpec { data: Some("x.csv".into()), ..t.clone() });
        assert!(e.contains("text is built in"), "{e}");
        let e = err(&PsJobSpec { replicas: 0, ..t.clone() });
        assert!(e.contains("replicas per worker"), "{e}");
        assert!(t.validate_batch(0).is_err());
        t.validate_batch(32).unwrap();
        let e = t.validate_batch(1 << 20).unwrap_err().to_string();
        assert!(e.contains("characters per step"), "{e}");
        for e in [err(&PsJobSpec { replicas: 0, ..t.clone() }), bad(&|s| s.heads = 3)] {
            assert_eq!(e.lines().count(), 1, "{e}");
        }
    }

    #[test]
    fn window_seeds_differ_per_step_and_are_deterministic() {
        let seeds: std::collections::HashSet<u64> =
            (0..4).flat_map(|e| (0..100).map(move |b| window_seed(0, e, b))).collect();
        assert_eq!(seeds.len(), 400);
        assert_eq!(window_seed(7, 1, 2), window_seed(7, 1, 2));
        assert_ne!(window_seed(7, 1, 2), window_seed(8, 1, 2));
        assert_ne!(window_seed(0, 1, 2), window_seed(0, 2, 1));
    }
}

//! The digits job under [`ParameterServerStrategy`]: the step function every worker registers,
//! and the coordinator's training loop.
//!
//! A Rust closure cannot travel to another process, so the step is registered by name
//! ([`TRAIN_STEP`]) in the one binary every task runs: `strata worker` serves it, `strata ps`
//! holds the variables, and `strata train --strategy parameter-server` schedules it. A step
//! names its batch by `(epoch, batch)`; every worker draws the same seeded permutation of the
//! training set per epoch (the one [`crate::trainer::Trainer`] uses), so the coordinator sends
//! a few numbers, never data. Within a worker the step runs on the worker's local replicas
//! ([`PsWorkerModel`]): `backward_and_sync` reduces their gradients to the parameter replica
//! and pushes them, once per step.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::Device;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use strata_core::data::Batch;
use strata_core::{ReduceOp, Strategy};
use strata_strategies::parameter_server::{
    ParameterServerStrategy, PsModel, PsWorkerModel, StepRegistry, WorkerContext,
};

use crate::digits;
use crate::model::{Classifier, Mlp};
use crate::trainer::{EpochReport, FitReport, Progress, StepHook};
use crate::{Error, Result};

/// The name the digits training step is registered under.
pub const TRAIN_STEP: &str = "digits.train";

/// The model and data a worker builds once and keeps between steps.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DigitsSpec {
    /// Hidden layer sizes of the MLP.
    pub hidden: Vec<usize>,
    /// Replicas of each worker (logical CPU devices; their gradients are summed before a push).
    pub replicas: usize,
    /// Seed of the shuffles (and of the initial values, which the ps tasks hold).
    pub seed: u64,
    /// The digits file (`None`: the copy built into the binary).
    pub data: Option<PathBuf>,
}

impl DigitsSpec {
    /// Checks what the spec asks a worker to build before it builds anything: the MLP's sizes
    /// ([`crate::model::check_mlp`]), 1 to [`strata_core::device::MAX_REPLICAS`] replicas, and
    /// at most [`crate::model::MAX_PARAMETERS`] times 4 parameters over all of them (each
    /// replica holds a copy of the model). A step's arguments arrive from the network, so a
    /// worker checks them here; an error is `Usage`, which the worker answers
    /// `INVALID_ARGUMENT`.
    pub fn validate(&self) -> Result<()> {
        let parameters = crate::model::check_mlp(digits::FEATURES, &self.hidden, digits::CLASSES)?;
        let max = strata_core::device::MAX_REPLICAS;
        if self.replicas == 0 || self.replicas > max {
            return Err(Error::Usage(format!("{} replicas per worker; the limit is 1 to {max}", self.replicas)));
        }
        let limit = 4 * crate::model::MAX_PARAMETERS;
        if parameters.saturating_mul(self.replicas) > limit {
            return Err(Error::Usage(format!(
                "{} replicas of a {parameters}-parameter MLP hold more than {limit} parameters, the limit; use fewer replicas or smaller layers",
                self.replicas
            )));
        }
        Ok(())
    }
}

/// One scheduled step: batch `batch` of epoch `epoch`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DigitsStep {
    /// The model and data.
    pub spec: DigitsSpec,
    /// The epoch (the permutation's seed is `seed + epoch`).
    pub epoch: u64,
    /// The batch within the epoch.
    pub batch: u64,
    /// Examples per batch.
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

/// What a worker keeps between steps.
struct WorkerState {
    spec: DigitsSpec,
    train: Batch,
    /// The MLP over the worker's replicas; its optimizer pushes.
    worker: PsWorkerModel<Mlp>,
    /// The permutation of the current epoch.
    order: Option<(u64, Vec<usize>)>,
}

impl WorkerState {
    fn new(spec: &DigitsSpec) -> Result<Self> {
        let all = digits::load(spec.data.as_deref())?;
        let (train, _) = digits::train_test_split(&all, 0.2, 0);
        let options = strata_core::StrategyOptions { seed: spec.seed, ..Default::default() };
        let hidden = spec.hidden.clone();
        let worker = PsWorkerModel::new(spec.replicas, options, |s| {
            Mlp::new(s.var_builder(), digits::FEATURES, &hidden, digits::CLASSES)
        })?;
        Ok(Self { spec: spec.clone(), train, worker, order: None })
    }

    /// The examples of batch `batch` of `epoch`.
    fn batch(&mut self, epoch: u64, batch: u64, size: usize) -> Result<Batch> {
        if self.order.as_ref().is_none_or(|(e, _)| *e != epoch) {
            self.order = Some((epoch, epoch_order(self.train.len(), self.spec.seed, epoch)));
        }
        let order = self.order.as_ref().map(|(_, o)| o.as_slice()).unwrap_or_default();
        let start = (batch as usize).saturating_mul(size);
        if size == 0 || start >= order.len() {
            return Err(Error::Usage(format!(
                "batch {batch} of {size} examples is past the end of the {} training examples",
                order.len()
            )));
        }
        Ok(digits::gather(&self.train, &order[start..(start + size).min(order.len())]))
    }
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

fn run_step(
    ctx: &WorkerContext,
    step: DigitsStep,
    state: &Mutex<Option<WorkerState>>,
    options: &WorkerStepOptions,
) -> Result<DigitsStepResult> {
    let started = Instant::now();
    step.spec.validate()?;
    if step.batch_size == 0 {
        return Err(Error::Usage("a batch of 0 examples: a step needs at least 1".into()));
    }
    let mut guard = lock(state);
    if guard.as_ref().is_none_or(|s| s.spec != step.spec) {
        // The old model goes first: the new one is built within the limits, not beside them.
        *guard = None;
        *guard = Some(WorkerState::new(&step.spec)?);
    }
    let st = guard.as_mut().ok_or_else(|| Error::Usage("worker state missing".into()))?;
    let batch = st.batch(step.epoch, step.batch, step.batch_size)?;
    let bytes0 = strata_transport::inject::bytes();
    let global_step = step.epoch * 1_000_000 + step.batch;
    let worker = &st.worker;
    // The step as under any strategy: the worker's replicas compute their shards' gradients,
    // reduce them to the parameter replica, and the optimizer pushes them.
    let out = worker.run_batch(ctx, &batch, |rctx, shard| {
        let dev = rctx.candle_device();
        let (x, y) = (shard.batch.features_tensor(dev)?, shard.batch.labels_tensor(dev)?);
        let loss = worker.model().on(rctx)?.loss(&x, &y)?;
        let grads = loss.backward()?;
        if let (Some(hook), 0) = (&options.hook, rctx.replica_id()) {
            hook.after_backward(ctx.worker_index(), global_step, started.elapsed());
        }
        rctx.sync_and_apply(grads, worker.optimizer())?;
        Ok(loss.to_scalar::<f32>()? * shard.weight())
    })?;
    let loss = worker.strategy().reduce(ReduceOp::Sum, &out.values)?;
    let ticket = out.pull;
    let pushed = out.push.ok_or_else(|| Error::Usage("the digits step pushed nothing".into()))?;
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
        examples: batch.len(),
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

/// A `strata` error as the core error a step function returns (retryable errors stay retryable).
fn into_core(e: Error) -> strata_core::Error {
    match e {
        Error::Core(c) => c,
        Error::Candle(c) => strata_core::Error::Candle(c),
        other => strata_core::Error::InvalidArgument(other.to_string()),
    }
}

/// How the coordinator trains.
#[derive(Clone, Debug)]
pub struct PsTrainConfig {
    /// The model and data every worker builds.
    pub spec: DigitsSpec,
    /// Passes over the training set.
    pub epochs: usize,
    /// Examples per scheduled step (one worker's batch).
    pub batch_size: usize,
    /// Where progress goes.
    pub progress: Option<Arc<dyn Progress>>,
    /// Stop after this many steps.
    pub max_steps: Option<usize>,
    /// Write a record per worker step and per evaluation here.
    pub metrics: Option<Arc<crate::metrics::MetricsWriter>>,
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

/// The coordinator's side: schedules every step of every epoch on the workers, evaluates the
/// pulled parameters after each epoch, and reports as [`crate::trainer::Trainer::fit`] does.
pub fn train_coordinator(
    strategy: &ParameterServerStrategy,
    model: &PsModel<Mlp>,
    config: &PsTrainConfig,
) -> Result<(FitReport, CoordinatorStats)> {
    let started = Instant::now();
    config.spec.validate()?;
    if config.epochs == 0 {
        return Err(Error::Usage("0 epochs train nothing: train for 1 epoch or more".into()));
    }
    if config.batch_size == 0 {
        return Err(Error::Usage("a batch of 0 examples: a step needs at least 1".into()));
    }
    let all = digits::load(config.spec.data.as_deref())?;
    let (train, test) = digits::train_test_split(&all, 0.2, 0);
    let coordinator = strategy.coordinator()?;
    let steps_per_epoch = train.len().div_ceil(config.batch_size);
    let progress: &dyn Progress = config.progress.as_deref().unwrap_or(&crate::trainer::Silent);
    progress.begin((steps_per_epoch * config.epochs) as u64);
    let (x_test, y_test) = (test.features_tensor(&Device::Cpu)?, test.labels_tensor(&Device::Cpu)?);
    let mut epochs = Vec::with_capacity(config.epochs);
    let (mut steps, mut steady_examples, mut steady_time) = (0usize, 0usize, Duration::ZERO);
    let mut final_accuracy = 0.0;
    let mut dropped = 0u64;
    let started_unix = unix_now() - started.elapsed().as_secs_f64();
    let (mut recorded_steps, mut recorded_examples, mut updates) = (0u64, 0u64, 0u64);
    for epoch in 0..config.epochs {
        let mut n = steps_per_epoch;
        if let Some(max) = config.max_steps {
            n = n.min(max.saturating_sub(steps));
        }
        if n == 0 {
            break;
        }
        let t0 = Instant::now();
        let values: Vec<_> = (0..n)
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
        let correct = model.model().correct(&x_test, &y_test)?;
        final_accuracy = correct as f32 / test.len().max(1) as f32;
        if let Some(m) = &config.metrics {
            let wall = unix_now() - started_unix;
            m.write(&crate::metrics::MetricRecord::eval(
                recorded_steps,
                updates,
                wall,
                recorded_examples,
                final_accuracy,
            ))?;
        }
        let train_loss = (loss / examples.max(1) as f64) as f32;
        progress.epoch(epoch, &format!("loss {train_loss:.4} accuracy {:.2}%", final_accuracy * 100.0));
        epochs.push(EpochReport {
            epoch,
            train_loss,
            test_accuracy: final_accuracy,
            step_seconds: step_time.as_secs_f64(),
            test_metrics: vec![crate::trainer::MetricValue { name: "accuracy".into(), value: final_accuracy as f64 }],
        });
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
        final_test_accuracy: final_accuracy,
        final_metrics: vec![crate::trainer::MetricValue { name: "accuracy".into(), value: final_accuracy as f64 }],
        examples_per_second: steady_examples as f64 / steady_time.as_secs_f64().max(1e-9),
        steps,
        resumed_from_step: 0,
        skipped_examples: 0,
        wall_seconds: started.elapsed().as_secs_f64(),
        stopped: None,
    };
    Ok((report, stats))
}

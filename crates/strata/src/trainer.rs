//! `Trainer::fit`: the high-level training loop, for users who do not write their own, over
//! any model.
//!
//! What is trained and measured is a [`Task`]: a loss closure `(model, ctx, batch) -> loss`
//! (the replica's copy of the model, its [`ReplicaContext`], its shard), optionally an
//! evaluation closure that returns [`Outputs`] (loss, logits, targets), and a list of
//! [`Metric`]s ([`Accuracy`], [`Loss`], [`Perplexity`], or the user's own). No model trait is
//! needed; [`Task::classifier`] is the task of a [`Classifier`] such as the shipped MLP.
//!
//! Per epoch: a seeded shuffle of the training set (unless [`TrainConfig::shuffle`] is off), global batches split over the replicas
//! ([`TailPolicy::Split`]: the uneven last batch is weighted exactly), one synchronous step per
//! batch (handed to the replicas a whole epoch at a time, or `steps_per_execution` at a time,
//! with [`Strategy::run_batches`]), then an evaluation on the test set, itself split over the
//! replicas (and workers): every metric is a total and a count per shard (correct rows and
//! rows, say), summed over replicas and workers, so the result is exactly the whole test set's.
//! Gradient clipping by global norm, accumulation over micro-batches and learning-rate
//! schedules are [`TrainConfig`] options that [`Trainer::optimizer`] applies. A [`Progress`] (the `strata` command's progress bar, or
//! [`EpochLog`]'s lines) shows loss and accuracy; tracing spans mark every epoch and step, and
//! the strategy's timeline (if any) records every replica's forward, backward, bucket reductions
//! and optimizer step. A [`StepHook`] sees every replica between its backward pass and its
//! gradient synchronisation (the seam through which `strata compare` slows workers down).
//!
//! A [`StopSignal`] stops a fit cleanly between steps (the seam through which the `strata`
//! command handles SIGTERM and SIGINT, as TensorFlow's `PreemptionCheckpointHandler` does):
//! the fit checks it every [`TrainConfig::stop_check_steps`] steps, every worker of a
//! multi-worker job agrees on it with one all-reduce of a single number (the largest code any
//! worker was asked to stop with), so every worker stops after the same step; the chief then
//! writes a checkpoint of that step, and the fit returns with [`FitReport::stopped`] set.
//! Resuming from that checkpoint ends bit for bit where an uninterrupted run ends.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Tensor, D};
use candle_nn::Optimizer;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;
use strata_core::checkpoint::OptimizerState;
use strata_core::data::{Batch, BatchData, DistributedBatch, TailPolicy};
use strata_core::elastic::{self, Elastic, Position, StatefulOptimizer, Stepped, Stop};
use strata_core::optim::schedule::LrSchedule;
use strata_core::{DistributedOptimizer, Footprint, PerReplica, ReduceOp, ReplicaContext, Replicated, Strategy};

use crate::model::Classifier;
use crate::Result;

/// How to train.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Passes over the training set.
    pub epochs: usize,
    /// Examples per step, over all replicas.
    pub global_batch: usize,
    /// Seed of the shuffles.
    pub seed: u64,
    /// Shuffle the training set every epoch (default true, as Keras' `fit(shuffle=True)`).
    /// `false` takes the examples in their order, the same every epoch: for records that are
    /// already in random order, such as generated ones, so that a run sees them in the order
    /// another job streams them (the click model's parameter-server workers read record `i`
    /// of step `i / batch`).
    pub shuffle: bool,
    /// Steps at the start whose time is not counted in the steady-state throughput.
    pub warmup_steps: usize,
    /// Where progress goes (`None`: nowhere).
    pub progress: Option<Arc<dyn Progress>>,
    /// Steps handed to the replicas at once (`None`: a whole epoch), as Keras'
    /// `steps_per_execution`: fewer hand-offs between the caller and the replica threads.
    pub steps_per_execution: Option<usize>,
    /// Backup and restore (see [`Trainer::fit_checkpointed`]).
    pub checkpoint: Option<CheckpointConfig>,
    /// Stop after this many steps in total (counting a resumed run's earlier steps).
    pub max_steps: Option<usize>,
    /// Write a record per step and per evaluation here (the chief does); steps then run one
    /// per execution, so that each has its own time.
    pub metrics: Option<std::sync::Arc<crate::metrics::MetricsWriter>>,
    /// Called on every replica between each step's backward pass and its gradient
    /// synchronisation; steps then run one per execution, so that each has its own time.
    pub step_hook: Option<Arc<dyn StepHook>>,
    /// Stop cleanly when asked (see [`StopSignal`]). In a multi-worker job every worker must
    /// be given one (or none), with the same [`stop_check_steps`](Self::stop_check_steps).
    pub stop: Option<StopSignal>,
    /// With [`stop`](Self::stop): steps between checks (an execution runs at most this many
    /// steps). Each check of a multi-worker job is one all-reduce of one number.
    pub stop_check_steps: usize,
    /// Clip every optimizer step's gradient to this global norm, computed on the gradient
    /// reduced over every replica and worker (applied by [`Trainer::optimizer`]).
    pub clip_global_norm: Option<f64>,
    /// Micro-batches (global batches of [`global_batch`](Self::global_batch) examples) per
    /// optimizer step, equal to one step on their concatenation (applied by
    /// [`Trainer::optimizer`]; 1: none accumulated).
    pub accumulation: usize,
    /// The learning rate of every optimizer step (applied by [`Trainer::optimizer`]).
    pub schedule: Option<LrSchedule>,
    /// Dynamic loss scaling, for a model that computes in fp16
    /// ([`strata_core::Precision::Fp16`]; applied by [`Trainer::optimizer`]).
    pub loss_scale: Option<strata_core::LossScale>,
}

/// Asks a running fit to stop after the step it is in (cheap to clone; clones share the
/// request). The `strata` command arms one from SIGTERM and SIGINT; a program may request a
/// stop for any reason of its own.
#[derive(Clone, Debug, Default)]
pub struct StopSignal(Arc<AtomicU32>);

impl StopSignal {
    /// A signal not yet raised.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks training to stop. `code` (at least 1) says why, for the caller's own use (the
    /// `strata` command passes the signal's number and exits with 128 plus it); in a
    /// multi-worker job, every worker's fit reports the largest code any worker asked with.
    pub fn request(&self, code: u32) {
        self.0.fetch_max(code.max(1), Ordering::SeqCst);
    }

    /// The code of the request, once one was made.
    pub fn requested(&self) -> Option<u32> {
        Some(self.0.load(Ordering::SeqCst)).filter(|c| *c > 0)
    }
}

/// Where and why a fit stopped on a [`StopSignal`].
#[derive(Clone, Debug, Serialize)]
pub struct Stopped {
    /// The last step trained (counting a resumed run's earlier steps).
    pub step: usize,
    /// The largest code any worker was asked to stop with.
    pub code: u32,
    /// The checkpoint of that step, on the chief, when checkpoints are configured.
    pub checkpoint: Option<std::path::PathBuf>,
    /// In an elastic job: this worker alone was asked to stop, and it left the job, which goes
    /// on without it (enough workers remain); no checkpoint is written for it.
    pub left_job: bool,
}

/// What the trainer reports while it runs: the `strata` command draws a progress bar,
/// [`EpochLog`] prints a line per epoch.
pub trait Progress: Send + Sync {
    /// Training of `steps` steps in all begins.
    fn begin(&self, steps: u64) {
        let _ = steps;
    }
    /// `steps` more steps are done.
    fn advance(&self, steps: u64) {
        let _ = steps;
    }
    /// An epoch ended; `summary` says how it went (loss, accuracy).
    fn epoch(&self, epoch: usize, summary: &str) {
        let _ = (epoch, summary);
    }
    /// Training ended.
    fn end(&self) {}
}

/// A [`Progress`] that prints one line per epoch to standard error.
#[derive(Clone, Copy, Debug, Default)]
pub struct EpochLog;

impl Progress for EpochLog {
    fn epoch(&self, epoch: usize, summary: &str) {
        eprintln!("epoch {}: {summary}", epoch + 1);
    }
}

/// Called on every replica of every step between its backward pass and its gradient
/// synchronisation (or, on a parameter-server worker, between its gradients and its push): the
/// seam through which a test or `strata compare` injects slow workers and stragglers, outside
/// the training loop's own code.
pub trait StepHook: Send + Sync {
    /// The gradients of step `step` (counted from 1) are ready on `worker` (the worker's index
    /// in a multi-worker or parameter-server job, the replica's otherwise), `compute` after the
    /// step began. The hook may block (a slow worker sleeps here).
    fn after_backward(&self, worker: usize, step: u64, compute: Duration);
}

pub use strata_core::elastic::CheckpointConfig;

impl std::fmt::Debug for dyn Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("dyn Progress")
    }
}

impl std::fmt::Debug for dyn StepHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("dyn StepHook")
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            epochs: 30,
            global_batch: 256,
            seed: 0,
            shuffle: true,
            warmup_steps: 3,
            progress: None,
            steps_per_execution: None,
            checkpoint: None,
            max_steps: None,
            metrics: None,
            step_hook: None,
            stop: None,
            stop_check_steps: 10,
            clip_global_norm: None,
            accumulation: 1,
            schedule: None,
            loss_scale: None,
        }
    }
}

/// One epoch's outcome.
#[derive(Clone, Debug, Serialize)]
pub struct EpochReport {
    /// Epoch number, from 0.
    pub epoch: usize,
    /// Mean training loss over the epoch's steps.
    pub train_loss: f32,
    /// Test accuracy after the epoch (0 when the task does not measure [`Accuracy`]).
    pub test_accuracy: f32,
    /// Seconds spent in training steps.
    pub step_seconds: f64,
    /// Every metric of the task on the test set after the epoch, in the task's order.
    #[serde(skip)]
    pub test_metrics: Vec<MetricValue>,
}

/// What a fit did.
#[derive(Clone, Debug, Serialize)]
pub struct FitReport {
    /// Every epoch.
    pub epochs: Vec<EpochReport>,
    /// Test accuracy after the last epoch.
    pub final_test_accuracy: f32,
    /// Every metric of the task on the test set after the last epoch.
    pub final_metrics: Vec<MetricValue>,
    /// Training examples per second over the steps after the warm-up (evaluation excluded).
    pub examples_per_second: f64,
    /// Steps run (by this fit; a resumed fit does not count the steps before its checkpoint).
    pub steps: usize,
    /// The step this fit resumed from (0 for a fresh start).
    pub resumed_from_step: usize,
    /// Examples the tail policy skipped (batches smaller than the replica count).
    pub skipped_examples: usize,
    /// Wall seconds of the whole fit, evaluation included.
    pub wall_seconds: f64,
    /// Set when the fit stopped early on its [`StopSignal`].
    pub stopped: Option<Stopped>,
    /// The most bytes each of this process's replicas held at once in a step, counted
    /// ([`DistributedOptimizer::peak_footprint`]; empty for a parameter-server job).
    pub peak_footprints: Vec<Footprint>,
    /// Where dynamic loss scaling ended (the scale, and the steps skipped for a gradient that
    /// was not finite); `None` without it.
    pub loss_scale: Option<strata_core::LossScaleState>,
    /// Local SGD / DiLoCo: the bytes of outer gradients this worker sent, and the meetings
    /// (of a fragment each) it took part in.
    pub outer_traffic: Option<(u64, u64)>,
}

/// The high-level training loop.
#[derive(Clone, Debug, Default)]
pub struct Trainer {
    /// Its settings.
    pub config: TrainConfig,
}

impl Trainer {
    /// A trainer with `config`.
    pub fn new(config: TrainConfig) -> Self {
        Self { config }
    }

    /// The optimizer of `model` with `config`, and this trainer's clipping, accumulation,
    /// schedule and loss scaling ([`TrainConfig::clip_global_norm`],
    /// [`TrainConfig::accumulation`], [`TrainConfig::schedule`], [`TrainConfig::loss_scale`])
    /// applied.
    pub fn optimizer<M, O: strata_core::optim::OptimizerMemory>(
        &self,
        model: &Replicated<M>,
        config: O::Config,
    ) -> Result<DistributedOptimizer<O>>
    where
        O::Config: Clone,
    {
        let mut opt = model.optimizer::<O>(config)?;
        if let Some(norm) = self.config.clip_global_norm {
            opt = opt.with_clip_global_norm(norm)?;
        }
        if self.config.accumulation != 1 {
            opt = opt.with_accumulation(self.config.accumulation)?;
        }
        if let Some(s) = &self.config.schedule {
            opt = opt.with_schedule(s.clone())?;
        }
        if let Some(scale) = self.config.loss_scale {
            opt = opt.with_loss_scale(scale)?;
        }
        Ok(opt)
    }

    /// Trains `model` with `opt` under `strategy` on `train` as `task` says (its loss),
    /// evaluating `task`'s metrics on `test` each epoch.
    pub fn fit<S, M, O, B>(
        &self,
        strategy: &S,
        model: &Replicated<M>,
        opt: &DistributedOptimizer<O>,
        task: &Task<'_, M, B>,
        train: &B,
        test: &B,
    ) -> Result<FitReport>
    where
        S: Strategy,
        M: Send + Sync,
        O: Optimizer + Send,
        B: BatchData,
    {
        if self.config.checkpoint.is_some() {
            return Err(crate::Error::Usage(
                "checkpoints need an optimizer whose state can be saved (Strata's fused AdamW or SGD); use Trainer::fit_checkpointed".into(),
            ));
        }
        self.fit_inner(strategy, model, opt, task, train, test, None)
    }

    /// [`Trainer::fit`] with backup and restore: if the checkpoint directory holds a
    /// checkpoint, training resumes from it (its variables, optimizer state and step; a
    /// multi-worker chief reads it and broadcasts it to every worker, so the workers need no
    /// shared file system), and the chief writes a checkpoint every
    /// [`CheckpointConfig::every_steps`] steps (atomic and verified, see
    /// `strata_core::checkpoint`). A resumed run ends with the same parameters as an
    /// uninterrupted one, because the shuffles are seeded per epoch.
    pub fn fit_checkpointed<S, M, O, B>(
        &self,
        strategy: &S,
        model: &Replicated<M>,
        opt: &DistributedOptimizer<O>,
        task: &Task<'_, M, B>,
        train: &B,
        test: &B,
    ) -> Result<FitReport>
    where
        S: Strategy,
        M: Send + Sync,
        O: Optimizer + OptimizerState + Send,
        B: BatchData,
    {
        // Under ZeRO the state is gathered from every replica's shard (a collective), and a
        // checkpoint holds it whole, as at stage 0: it resumes at any stage, on any number of
        // replicas and workers.
        self.fit_inner(strategy, model, opt, task, train, test, Some(opt as &dyn StatefulOptimizer))
    }

    /// The fit, with the optimizer's state where it can be saved (checkpoints, resumes and
    /// elastic recovery need it: [`Elastic`]).
    #[allow(clippy::too_many_arguments)]
    fn fit_inner<'f, S, M, O, B>(
        &'f self,
        strategy: &'f S,
        model: &'f Replicated<M>,
        opt: &'f DistributedOptimizer<O>,
        task: &'f Task<'_, M, B>,
        train: &'f B,
        test: &'f B,
        state: Option<&'f dyn StatefulOptimizer>,
    ) -> Result<FitReport>
    where
        S: Strategy,
        M: Send + Sync,
        O: Optimizer + Send,
        B: BatchData,
    {
        let cfg = &self.config;
        if cfg.global_batch == 0 {
            return Err(crate::Error::Usage("a global batch of 0 examples: a step needs at least 1".into()));
        }
        if cfg.epochs == 0 {
            return Err(crate::Error::Usage("0 epochs train nothing: train for 1 epoch or more".into()));
        }
        let start = Instant::now();
        let train_rows = train.rows()?;
        let steps_per_epoch = train_rows.div_ceil(cfg.global_batch);
        let accumulation = opt.accumulation();
        if let Some(c) = cfg.checkpoint.as_ref().filter(|_| accumulation > 1) {
            if !c.every_steps.is_multiple_of(accumulation) || !steps_per_epoch.is_multiple_of(accumulation) {
                return Err(crate::Error::Usage(format!(
                    "checkpoints every {} batches of an epoch of {steps_per_epoch} with gradients accumulated over {accumulation}: checkpoints must fall on optimizer steps; make both multiples of {accumulation}",
                    c.every_steps
                )));
            }
        }
        let workers = strategy.extended().workers();
        // An elastic job: a lost or joining worker costs the step in flight, not the job.
        let elastic_job = workers.is_some_and(|w| w.is_elastic());
        if elastic_job && state.is_none() {
            return Err(crate::Error::Usage(
                "an elastic job hands a joining worker the optimizer's state, which this optimizer cannot give (Strata's fused AdamW or SGD can); use Trainer::fit_checkpointed".into(),
            ));
        }
        let recovery = match state {
            Some(s) => {
                let r = Elastic::new(strategy, model, s)?.with_steps_per_epoch(steps_per_epoch);
                Some(match &cfg.checkpoint {
                    Some(c) => r.with_checkpoints(c.clone()),
                    None => r,
                })
            }
            None => None,
        };
        // A worker that joined an elastic job under way takes the state and the position of
        // the most advanced member, and no checkpoint; others resume from a checkpoint.
        let at = match &recovery {
            Some(r) => r.start()?,
            None => Position::default(),
        };
        let joined = elastic_job && workers.is_some_and(|w| w.joined_under_way());
        if let Some(w) = workers.filter(|w| w.num_workers() > 1 && !joined) {
            agree_on_epochs(w, strategy.extended().auto_shard(), train_rows, steps_per_epoch)?;
        }
        let progress: &dyn Progress = cfg.progress.as_deref().unwrap_or(&Silent);
        progress.begin((steps_per_epoch * cfg.epochs) as u64);
        let mut fit = Fit {
            trainer: self,
            strategy,
            model,
            opt,
            task,
            train,
            test,
            elastic: recovery.filter(|r| r.is_elastic()),
            ckpt: cfg.checkpoint.as_ref().zip(state),
            progress,
            train_rows,
            steps_per_epoch,
            start,
            // The step replica 0 is in (counted from 1), for errors.
            current_step: AtomicUsize::new(at.step),
            counts: Counts::default(),
            epochs: Vec::with_capacity(cfg.epochs),
            saved_step: None,
        };
        let stopped = fit.epochs(at)?;
        // A table store may still hold the last step's rows (it sends a step's with the next
        // step's lookup): they reach their holders before the fit returns.
        if let Some(tables) = &strategy.extended().options().tables {
            tables.flush()?;
        }
        // ZeRO stage 3: every variable whole again on every worker (collective), so that each
        // reads its model after the fit without the others, which may be gone by then. An
        // elastic job's members did it in `Elastic::finish`, where a loss re-forms the job (here
        // nothing is left to do); a worker that left on request, before it left.
        opt.unshard_parameters()?;
        progress.end();
        let peak_footprints: Vec<Footprint> =
            (0..opt.peak_replica_bytes().len()).map(|r| opt.peak_footprint(r).unwrap_or_default()).collect();
        for (replica, f) in peak_footprints.iter().enumerate() {
            tracing::info!(
                replica,
                bytes = f.total(),
                parameters = f.parameters,
                gradients = f.gradients,
                optimizer_state = f.optimizer_state,
                activations = f.activations,
                "the most a replica held at once in a step"
            );
        }
        let c = &fit.counts;
        // A run too short to have a steady state reports the throughput of all its steps.
        let (time, examples) =
            if c.steady_time.is_zero() { (c.all_time, c.all_examples) } else { (c.steady_time, c.steady_examples) };
        let examples_per_second = if time.is_zero() { 0.0 } else { examples as f64 / time.as_secs_f64() };
        Ok(FitReport {
            final_test_accuracy: fit.epochs.last().map_or(0.0, |e| e.test_accuracy),
            final_metrics: fit.epochs.last().map_or_else(Vec::new, |e| e.test_metrics.clone()),
            examples_per_second,
            steps: c.steps,
            resumed_from_step: at.step,
            skipped_examples: c.skipped,
            wall_seconds: start.elapsed().as_secs_f64(),
            stopped,
            epochs: fit.epochs,
            peak_footprints,
            loss_scale: opt.loss_scale_state(),
            outer_traffic: opt.outer_traffic(),
        })
    }
}

/// What a fit counts as it goes.
#[derive(Default)]
struct Counts {
    steps: usize,
    steady_time: Duration,
    steady_examples: usize,
    skipped: usize,
    all_time: Duration,
    all_examples: usize,
}

/// Where a part of a fit left it.
enum Flow {
    /// Done: go on from here.
    Next(Position),
    /// The membership of an elastic job changed: every member goes on from here.
    Moved(Position),
    /// Stopped on request.
    Stopped(Stopped),
}

/// A fit under way: what it trains, and what it counted.
struct Fit<'f, 't, S, M, O, B> {
    trainer: &'f Trainer,
    strategy: &'f S,
    model: &'f Replicated<M>,
    opt: &'f DistributedOptimizer<O>,
    task: &'f Task<'t, M, B>,
    train: &'f B,
    test: &'f B,
    /// In an elastic job: recovery from a change of membership.
    elastic: Option<Elastic<'f, M>>,
    /// Checkpoints, and the optimizer's state they hold.
    ckpt: Option<(&'f CheckpointConfig, &'f dyn StatefulOptimizer)>,
    progress: &'f dyn Progress,
    train_rows: usize,
    steps_per_epoch: usize,
    start: Instant,
    current_step: AtomicUsize,
    counts: Counts,
    epochs: Vec<EpochReport>,
    saved_step: Option<usize>,
}

impl<S, M, O, B> Fit<'_, '_, S, M, O, B>
where
    S: Strategy,
    M: Send + Sync,
    O: Optimizer + Send,
    B: BatchData,
{
    /// Every epoch from `at` on; the stop on request, if one came.
    fn epochs(&mut self, mut at: Position) -> Result<Option<Stopped>> {
        let trainer = self.trainer;
        let cfg = &trainer.config;
        loop {
            if at.ended >= cfg.epochs || cfg.max_steps.is_some_and(|m| at.step >= m) {
                // Every live member of an elastic job ends together.
                if let Some(Stepped::Moved(p)) = self.elastic.as_ref().map(|el| el.finish(at)).transpose()? {
                    at = self.moved(p);
                    continue;
                }
                return Ok(None);
            }
            match self.epoch(at)? {
                Flow::Next(p) => at = p,
                Flow::Moved(p) => at = self.moved(p),
                Flow::Stopped(s) => return Ok(Some(s)),
            }
        }
    }

    /// After a change of membership: goes on from `p` (a roll back to a checkpoint ends its
    /// epochs again).
    fn moved(&mut self, p: Position) -> Position {
        self.epochs.retain(|e| e.epoch < p.ended);
        p
    }

    /// Runs `f`, a collective between steps, through the elastic job's recovery, if any.
    fn guard<T>(&self, at: Position, f: impl FnOnce() -> strata_core::Result<T>) -> Result<Stepped<T>> {
        match &self.elastic {
            Some(el) => Ok(el.guard(at, f)?),
            None => Ok(Stepped::Done(f()?)),
        }
    }

    /// Epoch `at.ended` from step `at.step` (a resumed epoch skips the steps its checkpoint
    /// holds), then its end: the loss over its steps, and the evaluation.
    fn epoch(&mut self, at: Position) -> Result<Flow> {
        let trainer = self.trainer;
        let (cfg, strategy) = (&trainer.config, self.strategy);
        let epoch = at.ended;
        let _e = tracing::info_span!("epoch", epoch).entered();
        let mut idx: Vec<usize> = (0..self.train_rows).collect();
        if cfg.shuffle {
            idx.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(cfg.seed.wrapping_add(epoch as u64)));
        }
        let batches =
            idx.chunks(cfg.global_batch).map(|c| self.train.take_rows(c)).collect::<strata_core::Result<Vec<B>>>()?;
        let mut data = strategy.distribute_dataset(batches, TailPolicy::Split);
        let epoch_batches: Vec<_> = data.by_ref().collect();
        if let Some(e) = data.take_error() {
            return Err(e.into());
        }
        let done_in_epoch = at.step.saturating_sub(epoch * self.steps_per_epoch).min(epoch_batches.len());
        let mut epoch_batches = &epoch_batches[done_in_epoch..];
        if let Some(max) = cfg.max_steps {
            epoch_batches = &epoch_batches[..epoch_batches.len().min(max.saturating_sub(at.step))];
        }
        // An elastic job runs one step per execution: a loss costs one step.
        let per_step = cfg.metrics.is_some() || cfg.step_hook.is_some() || self.elastic.is_some();
        let mut per_execution =
            if per_step { 1 } else { cfg.steps_per_execution.unwrap_or(epoch_batches.len()).max(1) };
        if cfg.stop.is_some() {
            per_execution = per_execution.min(cfg.stop_check_steps.max(1));
        }
        let mut executions = Vec::new();
        let mut next = 0;
        while next < epoch_batches.len() {
            let mut len = per_execution.min(epoch_batches.len() - next);
            if let Some((c, _)) = self.ckpt {
                // Executions end at checkpoint steps.
                let every = c.every_steps.max(1);
                len = len.min(every - (at.step + next) % every);
            }
            executions.push(&epoch_batches[next..next + len]);
            next += len;
        }
        let mut sums =
            EpochSums { time: Duration::ZERO, losses: 0, local_loss: vec![0f32; strategy.extended().num_replicas()] };
        let mut pos = at;
        for (i, execution) in executions.iter().enumerate() {
            let last = epoch + 1 == cfg.epochs && i + 1 == executions.len();
            match self.execution(pos, epoch, execution, last, &mut sums)? {
                Flow::Next(p) => pos = p,
                flow => return Ok(flow),
            }
        }
        self.end_epoch(pos, sums, data.skipped_examples())
    }

    /// The end of epoch `at.ended`: one cross-replica (and cross-worker) reduction of its
    /// losses, then the evaluation on the test set.
    fn end_epoch(&mut self, at: Position, sums: EpochSums, skipped: usize) -> Result<Flow> {
        let trainer = self.trainer;
        let (cfg, strategy, epoch) = (&trainer.config, self.strategy, at.ended);
        let loss_sum =
            match self.guard(at, || strategy.reduce(ReduceOp::Sum, &strata_core::PerReplica::new(sums.local_loss)?))? {
                Stepped::Done(l) => l,
                Stepped::Moved(p) => return Ok(Flow::Moved(p)),
            };
        self.counts.skipped += skipped;
        // Local SGD: the fit ends on the global parameters, the same on every worker (the
        // last evaluation, and the model after the fit, read them).
        if epoch + 1 >= cfg.epochs || cfg.max_steps.is_some_and(|m| at.step >= m) {
            // In an elastic job a change meanwhile re-forms it and meets again what it cut.
            if let Stepped::Moved(p) = self.guard(at, || self.opt.synchronize_local_steps())? {
                return Ok(Flow::Moved(p));
            }
        }
        // Evaluation reads the state (BatchNorm's statistics) as the mean over replicas.
        let evaluated = self.guard(at, || {
            self.model.sync_state()?;
            // Errors other than the core's (a test set too small) end the fit as they are.
            match trainer.evaluate(strategy, self.model, self.task, self.test) {
                Ok(m) => Ok(Ok(m)),
                Err(crate::Error::Core(e)) => Err(e),
                Err(e) => Ok(Err(e)),
            }
        })?;
        let mut test_metrics = match evaluated {
            Stepped::Done(m) => m?,
            Stepped::Moved(p) => return Ok(Flow::Moved(p)),
        };
        test_metrics.extend(self.task.whole_set_metrics(self.model.primary(), self.test)?);
        let acc = accuracy_of(&test_metrics);
        if let Some(m) = cfg.metrics.as_ref().filter(|_| is_chief(strategy)) {
            let g = at.step as u64;
            let mut record = crate::metrics::MetricRecord::eval(
                g,
                g,
                self.start.elapsed().as_secs_f64(),
                self.counts.all_examples as u64,
                acc,
            );
            // A task without accuracy (the transformer's) records its loss instead.
            if !test_metrics.iter().any(|m| m.name == "accuracy") {
                record.accuracy = None;
                record.validation_loss = test_metrics.iter().find(|m| m.name == "loss").map(|m| m.value as f32);
            }
            record.auc = test_metrics.iter().find(|m| m.name == "auc").map(|m| m.value as f32);
            m.write(&record)?;
        }
        let train_loss = loss_sum / sums.losses.max(1) as f32;
        tracing::info!(epoch, train_loss, test_accuracy = acc, "epoch done");
        self.progress.epoch(epoch, &format!("loss {train_loss:.4}{}", describe(&test_metrics)));
        self.epochs.push(EpochReport {
            epoch,
            train_loss,
            test_accuracy: acc,
            step_seconds: sums.time.as_secs_f64(),
            test_metrics,
        });
        Ok(Flow::Next(Position { step: at.step, ended: epoch + 1 }))
    }

    /// One execution (`execution.len()` steps, one in an elastic job) after `at` of epoch
    /// `epoch` (`last`: the fit's last), its records and checkpoint, and the agreement on
    /// stops on request after it.
    fn execution(
        &mut self,
        at: Position,
        epoch: usize,
        execution: &[DistributedBatch<B>],
        last: bool,
        sums: &mut EpochSums,
    ) -> Result<Flow> {
        let trainer = self.trainer;
        let (cfg, strategy, model, opt, task) = (&trainer.config, self.strategy, self.model, self.opt, self.task);
        let workers = strategy.extended().workers();
        let _s = tracing::debug_span!("execution", first_step = self.counts.steps, steps = execution.len()).entered();
        let step_number = (at.step + 1) as u64;
        let current_step = &self.current_step;
        current_step.store(at.step, Ordering::Relaxed);
        // The time and bytes of the steps alone (not an elastic job's admissions, nor its
        // checkpoints).
        let timed = std::cell::Cell::new((Duration::ZERO, (0, 0)));
        let run = || {
            let (t0, bytes0) = (Instant::now(), strata_transport::inject::bytes());
            let losses = strategy
                .run_batches(execution, |ctx, shard| {
                    let started = Instant::now();
                    if ctx.replica_id() == 0 {
                        current_step.fetch_add(1, Ordering::Relaxed);
                    }
                    let fwd = ctx.phase("step", "forward");
                    let loss = (task.loss)(model.on(ctx)?, ctx, &shard.batch)?;
                    drop(fwd);
                    match cfg.step_hook.as_deref() {
                        Some(hook) => {
                            let grads = opt.scale_loss(ctx, &loss)?.backward()?;
                            let worker = workers.map_or(ctx.replica_id(), |w| w.worker_index());
                            hook.after_backward(worker, step_number, started.elapsed());
                            ctx.sync_and_apply(grads, opt)?;
                        }
                        None => ctx.backward_and_sync(&loss, opt)?,
                    }
                    // The replica's share of the global batch's mean loss, and that share.
                    Ok((loss.to_scalar::<f32>()? * shard.weight(), shard.weight()))
                })
                .map_err(|e| match e {
                    strata_core::Error::Cluster(m) => strata_core::Error::Cluster(format!(
                        "training step {} (epoch {epoch}): {m}",
                        current_step.load(Ordering::Relaxed).max(at.step + 1)
                    )),
                    other => other,
                });
            timed.set((t0.elapsed(), bytes0));
            losses
        };
        let losses = match &self.elastic {
            Some(el) => match el.step(at, run)? {
                Stepped::Done(l) => l,
                Stepped::Moved(p) => return Ok(Flow::Moved(p)),
            },
            None => run()?,
        };
        let (dt, bytes0) = timed.get();
        let at = Position { step: at.step + execution.len(), ..at };
        self.count(at.step, execution, dt, &losses, sums);
        if let (Some(m), Some(l)) = (cfg.metrics.as_ref().filter(|_| is_chief(strategy)), losses.last()) {
            // This worker's replicas' mean loss (the whole batch's on one machine).
            let (sum, weight) = l.values().iter().fold((0.0, 0.0), |(s, w), (v, x)| (s + v, w + x));
            let (sent, received) = strata_transport::inject::bytes();
            let mut r = crate::metrics::MetricRecord::step(
                at.step as u64,
                at.step as u64,
                self.start.elapsed().as_secs_f64(),
                self.counts.all_examples as u64,
                sum / weight.max(f32::MIN_POSITIVE),
            );
            // The ring is symmetric: every worker moves what this one did.
            let num_workers = workers.map_or(1, |w| w.num_workers()) as u64;
            r.bytes_sent = (sent - bytes0.0) * num_workers;
            r.bytes_received = (received - bytes0.1) * num_workers;
            m.write(&r)?;
        }
        self.progress.advance(execution.len() as u64);
        if let Some((c, state)) = self.ckpt {
            let due = at.step.is_multiple_of(c.every_steps.max(1));
            match &self.elastic {
                // The elastic job's recovery wrote the checkpoints due.
                Some(el) if last && !due => {
                    if let Stepped::Moved(p) = el.checkpoint(at)? {
                        return Ok(Flow::Moved(p));
                    }
                }
                Some(_) => {}
                None if due || last => {
                    elastic::save_checkpoint(&**strategy.extended(), model, state, c, at.step)?;
                }
                None => {}
            }
            if due || last {
                self.saved_step = Some(at.step);
            }
        }
        self.stop_after(at, epoch)
    }

    /// Adds an execution's time, examples and losses to the counts.
    fn count(
        &mut self,
        step: usize,
        execution: &[DistributedBatch<B>],
        dt: Duration,
        losses: &[PerReplica<(f32, f32)>],
        sums: &mut EpochSums,
    ) {
        let trainer = self.trainer;
        let cfg = &trainer.config;
        let c = &mut self.counts;
        let examples = execution.iter().map(|b| b.global_len()).sum::<usize>();
        sums.time += dt;
        // Executions that include warm-up steps do not count towards the steady state.
        if c.steps >= cfg.warmup_steps {
            c.steady_time += dt;
            c.steady_examples += examples;
        }
        c.all_time += dt;
        c.all_examples += examples;
        c.steps += execution.len();
        for l in losses {
            for (acc, (v, _)) in sums.local_loss.iter_mut().zip(l.values()) {
                *acc += v;
            }
            sums.losses += 1;
        }
        tracing::debug!(step, seconds = dt.as_secs_f64(), "step done");
    }

    /// After the steps up to `at`: whether every worker agrees to stop on request (an elastic
    /// job's worker asked to stop leaves it alone while enough remain); the chief then writes
    /// a checkpoint of `at`.
    fn stop_after(&self, at: Position, epoch: usize) -> Result<Flow> {
        let cfg = &self.trainer.config;
        let Some(signal) = &cfg.stop else { return Ok(Flow::Next(at)) };
        let agreed = match &self.elastic {
            None => agreed_stop(self.strategy, signal).map_err(|e| match e {
                strata_core::Error::Cluster(m) => strata_core::Error::Cluster(format!(
                    "agreeing whether to stop after training step {} (epoch {epoch}): {m}",
                    at.step
                )),
                other => other,
            })?,
            Some(el) => match el.agree_to_stop(at, signal.requested())? {
                Stepped::Moved(p) => return Ok(Flow::Moved(p)),
                Stepped::Done(Stop::GoOn) => None,
                Stepped::Done(Stop::All(code)) => Some(code),
                Stepped::Done(Stop::Left(code)) => {
                    return Ok(Flow::Stopped(Stopped { step: at.step, code, checkpoint: None, left_job: true }))
                }
            },
        };
        let Some(code) = agreed else { return Ok(Flow::Next(at)) };
        let mut checkpoint = None;
        if let Some((c, state)) = self.ckpt {
            if self.saved_step != Some(at.step) {
                elastic::save_checkpoint(&**self.strategy.extended(), self.model, state, c, at.step)?;
            }
            checkpoint = is_chief(self.strategy).then(|| c.dir.clone());
        }
        tracing::info!(step = at.step, code, "stopped on request");
        Ok(Flow::Stopped(Stopped { step: at.step, code, checkpoint, left_job: false }))
    }
}

/// An epoch's sums so far: its steps' time, and its losses per replica.
struct EpochSums {
    time: Duration,
    losses: usize,
    local_loss: Vec<f32>,
}

/// Whether to stop now: this process's request, or in a multi-worker job the largest request
/// of any worker (one all-reduce of one number, so every worker decides alike). Every worker
/// must call it at the same point of its program, as [`Trainer::fit`] does between executions.
pub fn agreed_stop<S: Strategy>(strategy: &S, signal: &StopSignal) -> strata_core::Result<Option<u32>> {
    let code = strata_core::elastic::largest_stop_code(strategy.extended().workers(), signal.requested().unwrap_or(0))?;
    Ok((code > 0).then_some(code))
}

/// Every worker of a job must run as many steps per epoch (each step needs every worker). Under
/// `Data` sharding the workers read the same data set; under `Off` (and `File`, whose workers
/// hold different files) each holds its own: one all-reduce of `[steps, -steps, rows, -rows]`
/// finds the largest and smallest, and differing steps are an error before any step.
fn agree_on_epochs(
    w: &dyn strata_core::strategy::WorkerCollectives,
    policy: strata_core::strategy::AutoShardPolicy,
    rows: usize,
    steps: usize,
) -> Result<()> {
    // Counts below 2^24 are exact in an f32.
    let (r, st) = (rows.min(1 << 24) as f32, steps.min(1 << 24) as f32);
    let mut v = [st, -st, r, -r];
    w.all_reduce(ReduceOp::Max, &mut v)?;
    let (most, least) = (v[0] as usize, (-v[1]) as usize);
    if most != least {
        return Err(crate::Error::Usage(format!(
            "worker {} has {rows} training examples, {steps} steps an epoch, but another worker has {} steps; every step needs every worker: give the workers equal shares of the data (under {policy:?} sharding each reads its own)",
            w.worker_index(),
            if most == steps { least } else { most },
        )));
    }
    if v[2] != -v[3] {
        tracing::warn!(
            rows,
            most = v[2],
            least = -v[3],
            "workers hold different numbers of examples: the last step of an epoch weighs each worker's part as if all were equal"
        );
    }
    Ok(())
}

fn is_chief<S: Strategy>(strategy: &S) -> bool {
    strategy.extended().workers().is_none_or(|w| w.worker_index() == 0)
}

/// The accuracy of `model` on `data` (cross-replica: the primary copy evaluates).
pub fn evaluate<M: Classifier>(model: &M, data: &Batch) -> Result<f32> {
    if data.is_empty() {
        return Ok(0.0);
    }
    let dev = candle_core::Device::Cpu;
    let correct = model.correct(&data.features_tensor(&dev)?, &data.labels_tensor(&dev)?)?;
    Ok(correct as f32 / data.len() as f32)
}

/// The [`Progress`] of a trainer given none.
pub(crate) struct Silent;

impl Progress for Silent {}

/// The loss of a replica's shard: `(the replica's copy of the model, its context, its shard)`.
pub type LossFn<'a, M, B = Batch> =
    dyn Fn(&M, &ReplicaContext<'_>, &B) -> strata_core::Result<Tensor> + Send + Sync + 'a;

/// What evaluation computes on a replica's shard, for the metrics to read.
pub type OutputsFn<'a, M, B = Batch> =
    dyn Fn(&M, &ReplicaContext<'_>, &B) -> strata_core::Result<Outputs> + Send + Sync + 'a;

/// A metric of the whole test set that does not split over shards (the AUC ranks every
/// example against every other): `(the primary copy of the model, the whole test set)`.
pub type WholeSetFn<'a, M, B = Batch> = dyn Fn(&M, &B) -> Result<f64> + Send + Sync + 'a;

/// What [`Trainer::fit`] trains and measures, for a model of any type `M` on batches of any
/// type `B` ([`BatchData`]: a tensor, a tuple or named map of tensors, [`Batch`], a type of the
/// user's own): the loss of a shard (training), what evaluation computes on a shard
/// ([`Outputs`]), and the metrics. The closures name the batch type (`b: &B`), which the
/// data sets given to [`Trainer::fit`] then have.
///
/// ```
/// use candle_core::{Module, Tensor};
/// use strata::data::BatchData;
/// use strata::trainer::{Accuracy, Loss, Outputs, Task};
///
/// struct Linear(candle_nn::Linear); // the user's own model
/// // Batches of (features, labels) tensors, moved to the replica's device.
/// let task = Task::new(|m: &Linear, ctx, b: &(Tensor, Tensor)| {
///     let (x, y) = b.to_device(ctx.candle_device())?;
///     Ok(candle_nn::loss::cross_entropy(&m.0.forward(&x)?, &y)?)
/// })
/// .with_outputs(|m: &Linear, ctx, b: &(Tensor, Tensor)| {
///     let (x, y) = b.to_device(ctx.candle_device())?;
///     Outputs::classification(m.0.forward(&x)?, y)
/// })
/// .with_metrics(vec![Box::new(Accuracy), Box::new(Loss)]);
/// assert_eq!(task.metric_names(), ["accuracy", "loss"]);
/// ```
pub struct Task<'a, M, B = Batch> {
    loss: Box<LossFn<'a, M, B>>,
    outputs: Option<Box<OutputsFn<'a, M, B>>>,
    metrics: Vec<Box<dyn Metric<B> + 'a>>,
    whole_set: Vec<(String, Box<WholeSetFn<'a, M, B>>)>,
}

impl<M, B: BatchData> std::fmt::Debug for Task<'_, M, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Task").field("metrics", &self.metric_names()).finish_non_exhaustive()
    }
}

impl<'a, M, B: BatchData + 'a> Task<'a, M, B> {
    /// A task whose loss on a shard is `loss` (the shard's mean loss: the trainer weighs each
    /// replica's by its share of the global batch). Evaluation measures [`Loss`] with it
    /// until [`with_outputs`](Self::with_outputs) and [`with_metrics`](Self::with_metrics)
    /// say otherwise.
    pub fn new(loss: impl Fn(&M, &ReplicaContext<'_>, &B) -> strata_core::Result<Tensor> + Send + Sync + 'a) -> Self {
        Self { loss: Box::new(loss), outputs: None, metrics: vec![Box::new(Loss)], whole_set: Vec::new() }
    }

    /// What evaluation computes on a shard (the model in evaluation mode, say
    /// `forward_t(x, false)`); without it, evaluation's outputs hold only the loss closure's
    /// loss.
    pub fn with_outputs(
        mut self,
        outputs: impl Fn(&M, &ReplicaContext<'_>, &B) -> strata_core::Result<Outputs> + Send + Sync + 'a,
    ) -> Self {
        self.outputs = Some(Box::new(outputs));
        self
    }

    /// The metrics evaluation reports, in this order.
    pub fn with_metrics(mut self, metrics: Vec<Box<dyn Metric<B> + 'a>>) -> Self {
        self.metrics = metrics;
        self
    }

    /// A metric that does not split over shards, such as the AUC: after each epoch's
    /// evaluation, every worker computes it on its primary copy of the model over the whole
    /// test set (which every worker must hold), and it is reported after the split metrics.
    pub fn with_whole_set_metric(
        mut self,
        name: &str,
        metric: impl Fn(&M, &B) -> Result<f64> + Send + Sync + 'a,
    ) -> Self {
        self.whole_set.push((name.to_string(), Box::new(metric)));
        self
    }

    /// The metrics' names, in order (the whole-set metrics last).
    pub fn metric_names(&self) -> Vec<&str> {
        self.metrics.iter().map(|m| m.name()).chain(self.whole_set.iter().map(|(n, _)| n.as_str())).collect()
    }

    /// The whole-set metrics of `model` (its primary copy) on `data`.
    fn whole_set_metrics(&self, model: &M, data: &B) -> Result<Vec<MetricValue>> {
        self.whole_set.iter().map(|(name, f)| Ok(MetricValue { name: name.clone(), value: f(model, data)? })).collect()
    }

    /// Evaluation's outputs on a shard.
    fn outputs(&self, model: &M, ctx: &ReplicaContext<'_>, batch: &B) -> strata_core::Result<Outputs> {
        match &self.outputs {
            Some(f) => f(model, ctx, batch),
            None => Ok(Outputs { loss: Some((self.loss)(model, ctx, batch)?), logits: None, targets: None }),
        }
    }
}

impl<M: Classifier> Task<'_, M> {
    /// The task of a [`Classifier`] (such as [`crate::model::Mlp`]): its cross-entropy loss on
    /// the batch's features and labels, and [`Accuracy`] on the test set.
    pub fn classifier() -> Self {
        Task::new(|m: &M, ctx, b: &Batch| {
            let (x, y) = (b.features_tensor(ctx.candle_device())?, b.labels_tensor(ctx.candle_device())?);
            Ok(m.loss(&x, &y)?)
        })
        .with_outputs(|m: &M, ctx, b: &Batch| {
            let x = b.features_tensor(ctx.candle_device())?;
            Ok(Outputs {
                loss: None,
                logits: Some(m.logits(&x)?),
                targets: Some(b.labels_tensor(ctx.candle_device())?),
            })
        })
        .with_metrics(vec![Box::new(Accuracy)])
    }
}

/// What evaluation computed on one replica's shard.
#[derive(Clone, Debug)]
pub struct Outputs {
    /// The shard's mean loss (a scalar).
    pub loss: Option<Tensor>,
    /// Scores over classes (or the vocabulary), the classes on the last axis: `(rows,
    /// classes)`, or `(rows, positions, vocabulary)` for a token model.
    pub logits: Option<Tensor>,
    /// The class (or token) of each row (or position), u32: the logits' shape without its
    /// last axis.
    pub targets: Option<Tensor>,
}

impl Outputs {
    /// The outputs of a classifier: `logits` and `targets`, and their mean cross-entropy (over
    /// every position) as the loss.
    pub fn classification(logits: Tensor, targets: Tensor) -> strata_core::Result<Self> {
        let (flat_logits, flat_targets) = flatten_classes(&logits, &targets)?;
        let loss = candle_nn::loss::cross_entropy(&flat_logits, &flat_targets)?;
        Ok(Self { loss: Some(loss), logits: Some(logits), targets: Some(targets) })
    }
}

/// `(positions, classes)` logits and `(positions,)` targets.
fn flatten_classes(logits: &Tensor, targets: &Tensor) -> strata_core::Result<(Tensor, Tensor)> {
    let classes = logits.dims().last().copied().unwrap_or(0);
    if logits.rank() < 2 || logits.dims()[..logits.rank() - 1] != *targets.dims() {
        return Err(strata_core::Error::Dataset(format!(
            "logits of shape {:?} and targets of shape {:?}: give the logits the targets' shape and the classes as their last axis",
            logits.dims(),
            targets.dims()
        )));
    }
    Ok((logits.reshape(((), classes))?, targets.flatten_all()?))
}

/// One metric's value on a data set.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MetricValue {
    /// The metric's name.
    pub name: String,
    /// Its value on the whole data set.
    pub value: f64,
}

/// A metric that evaluation computes on the test set, split over the replicas (and workers):
/// each shard gives a total and a count ([`Metric::measure`]), which are summed over every
/// replica and worker before [`Metric::result`], so the value is exactly the whole set's
/// whatever the split. Implement it for a metric of your own.
///
/// A metric reads the evaluation [`Outputs`] and the shard of the batch type `B` it was
/// computed on ([`Batch`] unless said otherwise); the shipped ones work on every batch type.
pub trait Metric<B = Batch>: Send + Sync {
    /// Its name in reports (`accuracy`, `loss`, ...).
    fn name(&self) -> &str;

    /// `(total, count)` on one shard, such as (rows classified correctly, rows).
    fn measure(&self, batch: &B, outputs: &Outputs) -> strata_core::Result<(f64, f64)>;

    /// The value from the totals and counts summed over every shard: `total / count` unless
    /// the metric says otherwise (0 for no examples).
    fn result(&self, total: f64, count: f64) -> f64 {
        if count > 0.0 {
            total / count
        } else {
            0.0
        }
    }
}

/// The share of rows (or positions) whose largest logit is the target's.
#[derive(Clone, Copy, Debug, Default)]
pub struct Accuracy;

impl<B: BatchData> Metric<B> for Accuracy {
    fn name(&self) -> &str {
        "accuracy"
    }
    fn measure(&self, _: &B, o: &Outputs) -> strata_core::Result<(f64, f64)> {
        let (logits, targets) = logits_and_targets("accuracy", o)?;
        let (logits, targets) = flatten_classes(logits, targets)?;
        let correct = logits.argmax(D::Minus1)?.eq(&targets.to_dtype(DType::U32)?)?;
        let correct = correct.to_dtype(DType::U32)?.sum_all()?.to_scalar::<u32>()?;
        Ok((correct as f64, targets.elem_count() as f64))
    }
}

/// The mean loss per row: the outputs' loss (a shard's mean) weighted by the shard's rows.
#[derive(Clone, Copy, Debug, Default)]
pub struct Loss;

impl<B: BatchData> Metric<B> for Loss {
    fn name(&self) -> &str {
        "loss"
    }
    fn measure(&self, batch: &B, o: &Outputs) -> strata_core::Result<(f64, f64)> {
        let loss = o.loss.as_ref().ok_or_else(|| missing("loss", "a loss"))?;
        let rows = batch.rows()? as f64;
        Ok((loss.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64 * rows, rows))
    }
}

/// `exp` of the mean cross-entropy per position (per token of a language model): from the
/// logits and targets when the outputs have them, from the loss (a per-row mean) otherwise.
#[derive(Clone, Copy, Debug, Default)]
pub struct Perplexity;

impl<B: BatchData> Metric<B> for Perplexity {
    fn name(&self) -> &str {
        "perplexity"
    }
    fn measure(&self, batch: &B, o: &Outputs) -> strata_core::Result<(f64, f64)> {
        if let (Some(logits), Some(targets)) = (&o.logits, &o.targets) {
            let (logits, targets) = flatten_classes(logits, targets)?;
            let n = targets.elem_count();
            let mean = candle_nn::loss::cross_entropy(&logits.to_dtype(DType::F32)?, &targets)?;
            return Ok((mean.to_scalar::<f32>()? as f64 * n as f64, n as f64));
        }
        Loss.measure(batch, o).map_err(|_| missing("perplexity", "logits and targets, or a loss"))
    }
    fn result(&self, total: f64, count: f64) -> f64 {
        if count > 0.0 {
            (total / count).exp()
        } else {
            0.0
        }
    }
}

fn logits_and_targets<'o>(metric: &str, o: &'o Outputs) -> strata_core::Result<(&'o Tensor, &'o Tensor)> {
    match (&o.logits, &o.targets) {
        (Some(l), Some(t)) => Ok((l, t)),
        _ => Err(missing(metric, "logits and targets")),
    }
}

fn missing(metric: &str, what: &str) -> strata_core::Error {
    strata_core::Error::Dataset(format!(
        "the {metric} metric needs {what} in the evaluation outputs; return them from the task's outputs closure (Task::with_outputs)"
    ))
}

/// The accuracy among `values` (0 when not measured).
fn accuracy_of(values: &[MetricValue]) -> f32 {
    values.iter().find(|m| m.name == "accuracy").map_or(0.0, |m| m.value as f32)
}

/// ` test accuracy 97.50% test loss 0.1234`: the epoch line's part after the training loss.
fn describe(values: &[MetricValue]) -> String {
    values
        .iter()
        .map(|m| match m.name.as_str() {
            "accuracy" => format!(" test accuracy {:.2}%", m.value * 100.0),
            name => format!(" test {name} {:.4}", m.value),
        })
        .collect()
}

impl Trainer {
    /// `task`'s metrics of `model` on `data` under `strategy`: global batches of
    /// [`TrainConfig::global_batch`] examples (the last merged into the one before when it is
    /// too small to give every replica an example), split over the replicas and workers as
    /// training's are, each shard's totals and counts summed over every replica and worker.
    /// Reads the model as it is (call [`Replicated::sync_state`] first for state such as
    /// BatchNorm's statistics; [`Trainer::fit`] does).
    pub fn evaluate<S, M, B>(
        &self,
        strategy: &S,
        model: &Replicated<M>,
        task: &Task<'_, M, B>,
        data: &B,
    ) -> Result<Vec<MetricValue>>
    where
        S: Strategy,
        M: Send + Sync,
        B: BatchData,
    {
        let rows = data.rows()?;
        let k = task.metrics.len();
        let mut sums = vec![0f64; 2 * k];
        let replicas = strategy.num_replicas_in_sync().max(1);
        let size = self.config.global_batch.max(replicas);
        let mut ranges: Vec<std::ops::Range<usize>> =
            (0..rows).step_by(size).map(|i| i..(i + size).min(rows)).collect();
        if ranges.len() > 1 && ranges.last().is_some_and(|r| r.len() < replicas) {
            if let Some(last) = ranges.pop() {
                if let Some(prev) = ranges.last_mut() {
                    prev.end = last.end;
                }
            }
        }
        if !ranges.is_empty() && rows < replicas {
            return Err(crate::Error::Usage(format!(
                "a test set of {rows} examples cannot give each of {replicas} replicas an example; evaluate on at least {replicas}"
            )));
        }
        let parts = ranges.into_iter().map(|r| data.slice(r)).collect::<strata_core::Result<Vec<B>>>()?;
        let mut dataset = strategy.distribute_dataset(parts, TailPolicy::Split);
        let batches: Vec<DistributedBatch<B>> = dataset.by_ref().collect();
        if let Some(e) = dataset.take_error() {
            return Err(e.into());
        }
        let per_batch = strategy.run_batches(&batches, |ctx, shard| {
            let outputs = task.outputs(model.on(ctx)?, ctx, &shard.batch)?;
            task.metrics.iter().map(|m| m.measure(&shard.batch, &outputs)).collect::<strata_core::Result<Vec<_>>>()
        })?;
        for per_replica in &per_batch {
            for values in per_replica.values() {
                for (i, (total, count)) in values.iter().enumerate() {
                    sums[2 * i] += total;
                    sums[2 * i + 1] += count;
                }
            }
        }
        if let Some(w) = strategy.extended().workers() {
            let mut across: Vec<f32> = sums.iter().map(|&v| v as f32).collect();
            w.all_reduce(ReduceOp::Sum, &mut across)?;
            sums = across.into_iter().map(f64::from).collect();
        }
        Ok(task
            .metrics
            .iter()
            .enumerate()
            .map(|(i, m)| MetricValue { name: m.name().to_string(), value: m.result(sums[2 * i], sums[2 * i + 1]) })
            .collect())
    }
}

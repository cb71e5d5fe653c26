//! `Trainer::fit`: the high-level training loop, for users who do not write their own, over
//! any model.
//!
//! What is trained and measured is a [`Task`]: a loss closure `(model, ctx, batch) -> loss`
//! (the replica's copy of the model, its [`ReplicaContext`], its shard), optionally an
//! evaluation closure that returns [`Outputs`] (loss, logits, targets), and a list of
//! [`Metric`]s ([`Accuracy`], [`Loss`], [`Perplexity`], or the user's own). No model trait is
//! needed; [`Task::classifier`] is the task of a [`Classifier`] such as the shipped MLP.
//!
//! Per epoch: a seeded shuffle of the training set, global batches split over the replicas
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
use strata_core::checkpoint::{self, CheckpointTensor, OptimizerState};
use strata_core::data::{Batch, BatchData, DistributedBatch, TailPolicy};
use strata_core::optim::schedule::LrSchedule;
use strata_core::{DistributedOptimizer, ReduceOp, ReplicaContext, Replicated, Strategy};

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

/// Where and how often the chief writes checkpoints.
#[derive(Clone, Debug)]
pub struct CheckpointConfig {
    /// The checkpoint root (one `ckpt-<step>` directory per checkpoint).
    pub dir: std::path::PathBuf,
    /// Write a checkpoint every this many steps (and after the last step).
    pub every_steps: usize,
    /// Keep this many checkpoints.
    pub keep: usize,
}

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

    /// The optimizer of `model` with `config`, and this trainer's clipping, accumulation and
    /// schedule ([`TrainConfig::clip_global_norm`], [`TrainConfig::accumulation`],
    /// [`TrainConfig::schedule`]) applied.
    pub fn optimizer<M, O: Optimizer>(
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
        let save = || -> Result<Vec<(String, Tensor)>> { Ok(opt.state_tensors()?) };
        let load = |state: &[(String, Tensor)]| -> Result<()> { Ok(opt.load_state_tensors(state)?) };
        let collective = opt.zero_stage() != strata_core::ZeroStage::Off;
        let reshard = || -> Result<()> { Ok(opt.reshard().map(drop)?) };
        let at_step = |step: u64| opt.set_iterations(step / opt.accumulation().max(1) as u64);
        let hooks = OptimizerHooks {
            save: &save,
            load: &load,
            collective,
            // Only ZeRO asks (copy 0's state is then its shard's: cheap to look at).
            keeps_state: collective && opt.keeps_state()?,
            reshard: &reshard,
            at_step: &at_step,
        };
        self.fit_inner(strategy, model, opt, task, train, test, Some(hooks))
    }

    #[allow(clippy::too_many_arguments)]
    fn fit_inner<S, M, O, B>(
        &self,
        strategy: &S,
        model: &Replicated<M>,
        opt: &DistributedOptimizer<O>,
        task: &Task<'_, M, B>,
        train: &B,
        test: &B,
        hooks: Option<OptimizerHooks<'_>>,
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
        let ckpt = cfg.checkpoint.as_ref().zip(hooks.as_ref());
        let rollback = ckpt.map(|(c, h)| move || restore_latest(strategy, model, c, h));
        let workers = strategy.extended().workers();
        // An elastic job: a lost or joining worker costs the step in flight, not the job.
        let elastic = match workers.filter(|w| w.is_elastic()) {
            Some(w) => {
                let Some(h) = hooks.as_ref() else {
                    return Err(crate::Error::Usage(
                        "an elastic job hands a joining worker the optimizer's state, which this optimizer cannot give (Strata's fused AdamW or SGD can); use Trainer::fit_checkpointed".into(),
                    ));
                };
                if accumulation > 1 {
                    return Err(crate::Error::Usage(format!(
                        "an elastic job re-runs a step a lost worker interrupted, which gradients accumulated over {accumulation} batches would count twice; accumulate over 1 batch in an elastic job"
                    )));
                }
                if h.collective && h.keeps_state && ckpt.is_none() {
                    return Err(crate::Error::Usage(format!(
                        "an elastic job at ZeRO stage {} with an optimizer that keeps state: a lost worker takes its shard of that state with it, and the job then rolls back to its last checkpoint; give it a checkpoint directory (strata train --checkpoint-dir), or train with plain SGD or at stage 0",
                        opt.zero_stage().number()
                    )));
                }
                Some(Elastic {
                    w,
                    h,
                    ops: strategy.extended().cross_device_ops(),
                    prepared: Default::default(),
                    rollback: rollback.as_ref().map(|f| f as &dyn Fn() -> Result<Option<usize>>),
                    steps_per_epoch,
                })
            }
            None => None,
        };
        // A worker that joined an elastic job under way takes the state and the position of
        // the most advanced member, and no checkpoint.
        let joined = match &elastic {
            Some(e) if e.w.joined_under_way() => Some(e.recover(model, None, None)?),
            _ => None,
        };
        let resumed = match (ckpt, joined) {
            (_, Some(p)) => p.step,
            (Some((c, h)), None) => restore(strategy, model, c, h)?,
            (None, None) => 0,
        };
        if let (Some(c), true) = (&cfg.checkpoint, is_chief(strategy)) {
            // Before the first step, not at the first checkpoint: a directory that cannot take
            // one fails the job before it trains.
            checkpoint::check_writable(&c.dir).map_err(|e| match e {
                strata_core::Error::Checkpoint(m) => crate::Error::Usage(format!("checkpoint directory {m}")),
                other => other.into(),
            })?;
        }
        if let (Some(_), Some((c, h)), None, 0) = (&elastic, ckpt, joined, resumed) {
            if h.collective && h.keeps_state {
                // ZeRO in an elastic job: a lost worker's shard of the optimizer state rolls
                // the job back to its latest checkpoint, from the first step on.
                save_checkpoint(strategy, model, c, h, 0)?;
            }
        }
        let mut global_step = resumed;
        let num_workers = workers.map_or(1, |w| w.num_workers()) as u64;
        if let Some(w) = workers.filter(|w| w.num_workers() > 1 && joined.is_none()) {
            agree_on_epochs(w, strategy.extended().auto_shard(), train_rows, steps_per_epoch)?;
        }
        // Only the chief writes records (in an elastic job, whichever worker leads now).
        let metrics = cfg.metrics.clone();
        let progress: &dyn Progress = cfg.progress.as_deref().unwrap_or(&Silent);
        progress.begin((steps_per_epoch * cfg.epochs) as u64);
        let mut epochs = Vec::with_capacity(cfg.epochs);
        let (mut steps, mut steady_time, mut steady_examples, mut skipped) = (0usize, Duration::ZERO, 0usize, 0usize);
        let (mut all_time, mut all_examples) = (Duration::ZERO, 0usize);
        let mut stopped: Option<Stopped> = None;
        // The step replica 0 is in (counted from 1), for errors.
        let current_step = AtomicUsize::new(global_step);
        let mut saved_step = None;
        // Epochs whose end (loss, evaluation) is done; in an elastic job a member may be one
        // step or one epoch end ahead of another when a loss interrupts them.
        let mut ended = joined.map_or(resumed / steps_per_epoch.max(1), |p| p.ended);
        // In an elastic job: re-forms the membership after a failed collective, takes the most
        // advanced member's state and position, and resumes from there.
        macro_rules! recover_or_fail {
            ($label:lifetime, $e:expr) => {{
                let e: strata_core::Error = $e;
                match (&elastic, e) {
                    (Some(el), strata_core::Error::Cluster(m)) => {
                        let p = el.recover(model, Some(Position { step: global_step, ended }), Some(&m))?;
                        global_step = p.step;
                        ended = p.ended;
                        // A roll back to a checkpoint ends its epochs again.
                        epochs.retain(|e: &EpochReport| e.epoch < ended);
                        continue $label;
                    }
                    (_, e) => return Err(e.into()),
                }
            }};
        }
        'epochs: loop {
            if ended >= cfg.epochs || cfg.max_steps.is_some_and(|m| global_step >= m) {
                if let Some(el) = &elastic {
                    // Every live member ends together, with the state's mean: a loss even now
                    // costs nothing, and no member leaves while another still needs it.
                    if let Err(e) = model.sync_state() {
                        recover_or_fail!('epochs, e);
                    }
                    if let Err(e) = el.w.barrier() {
                        recover_or_fail!('epochs, e);
                    }
                }
                break;
            }
            let epoch = ended;
            let _e = tracing::info_span!("epoch", epoch).entered();
            let mut idx: Vec<usize> = (0..train_rows).collect();
            idx.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(cfg.seed.wrapping_add(epoch as u64)));
            let batches =
                idx.chunks(cfg.global_batch).map(|c| train.take_rows(c)).collect::<strata_core::Result<Vec<B>>>()?;
            let mut data = strategy.distribute_dataset(batches, TailPolicy::Split);
            let epoch_batches: Vec<_> = data.by_ref().collect();
            if let Some(e) = data.take_error() {
                return Err(e.into());
            }
            // A resumed epoch skips the steps its checkpoint already holds.
            let done_in_epoch = global_step.saturating_sub(epoch * steps_per_epoch).min(epoch_batches.len());
            let mut epoch_batches = &epoch_batches[done_in_epoch..];
            if let Some(max) = cfg.max_steps {
                epoch_batches = &epoch_batches[..epoch_batches.len().min(max.saturating_sub(global_step))];
            }
            // An elastic job runs one step per execution: a loss costs one step.
            let per_step = cfg.metrics.is_some() || cfg.step_hook.is_some() || elastic.is_some();
            let mut per_execution =
                if per_step { 1 } else { cfg.steps_per_execution.unwrap_or(epoch_batches.len()).max(1) };
            if cfg.stop.is_some() {
                per_execution = per_execution.min(cfg.stop_check_steps.max(1));
            }
            let (mut epoch_time, mut loss_n) = (Duration::ZERO, 0usize);
            let mut local_loss = vec![0f32; strategy.extended().num_replicas()];
            let mut executions = Vec::new();
            let mut at = 0;
            while at < epoch_batches.len() {
                let mut len = per_execution.min(epoch_batches.len() - at);
                if let Some((c, _)) = ckpt {
                    // Executions end at checkpoint steps.
                    let every = c.every_steps.max(1);
                    len = len.min(every - (global_step + at) % every);
                }
                executions.push(&epoch_batches[at..at + len]);
                at += len;
            }
            let mut done = 0;
            for execution in executions {
                if let Some(el) = &elastic {
                    // Workers waiting to join come in at a step boundary that every member agrees on.
                    match el.w.admit_waiting() {
                        Ok(true) => {
                            // ZeRO: the whole optimizer state, before the shards are re-split.
                            if let Err(e) = el.prepare(global_step) {
                                recover_or_fail!('epochs, e);
                            }
                            recover_or_fail!('epochs, strata_core::Error::Cluster("admitting workers that wait to join".into()))
                        }
                        Ok(false) => {}
                        Err(e) => recover_or_fail!('epochs, e),
                    }
                }
                done += execution.len();
                let _s = tracing::debug_span!("execution", first_step = steps, steps = execution.len()).entered();
                let t0 = Instant::now();
                let bytes0 = strata_transport::inject::bytes();
                let step_number = (global_step + 1) as u64;
                current_step.store(global_step, Ordering::Relaxed);
                let losses = match strategy
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
                                let grads = loss.backward()?;
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
                            current_step.load(Ordering::Relaxed).max(global_step + 1)
                        )),
                        other => other,
                    }) {
                    Ok(l) => l,
                    Err(e) => recover_or_fail!('epochs, e),
                };
                let dt = t0.elapsed();
                epoch_time += dt;
                // Executions that include warm-up steps do not count towards the steady state.
                if steps >= cfg.warmup_steps {
                    steady_time += dt;
                    steady_examples += execution.iter().map(|b| b.global_len()).sum::<usize>();
                }
                all_time += dt;
                all_examples += execution.iter().map(|b| b.global_len()).sum::<usize>();
                steps += execution.len();
                global_step += execution.len();
                for l in &losses {
                    for (acc, (v, _)) in local_loss.iter_mut().zip(l.values()) {
                        *acc += v;
                    }
                    loss_n += 1;
                }
                tracing::debug!(step = global_step, seconds = dt.as_secs_f64(), "step done");
                if let (Some(m), Some(l)) = (metrics.as_ref().filter(|_| is_chief(strategy)), losses.last()) {
                    // This worker's replicas' mean loss (the whole batch's on one machine).
                    let (sum, weight) = l.values().iter().fold((0.0, 0.0), |(s, w), (v, x)| (s + v, w + x));
                    let (sent, received) = strata_transport::inject::bytes();
                    let mut r = crate::metrics::MetricRecord::step(
                        global_step as u64,
                        global_step as u64,
                        start.elapsed().as_secs_f64(),
                        all_examples as u64,
                        sum / weight.max(f32::MIN_POSITIVE),
                    );
                    // The ring is symmetric: every worker moves what this one did.
                    r.bytes_sent = (sent - bytes0.0) * num_workers;
                    r.bytes_received = (received - bytes0.1) * num_workers;
                    m.write(&r)?;
                }
                progress.advance(execution.len() as u64);
                if let Some((c, h)) = ckpt {
                    let last = epoch + 1 == cfg.epochs && done == epoch_batches.len();
                    if global_step % c.every_steps.max(1) == 0 || last {
                        if let Err(e) = save_checkpoint(strategy, model, c, h, global_step) {
                            match e {
                                crate::Error::Core(e) => recover_or_fail!('epochs, e),
                                e => return Err(e),
                            }
                        }
                        saved_step = Some(global_step);
                    }
                }
                let agreeing = |e| match e {
                    strata_core::Error::Cluster(m) => strata_core::Error::Cluster(format!(
                        "agreeing whether to stop after training step {global_step} (epoch {epoch}): {m}"
                    )),
                    other => other,
                };
                let agreed = match (&cfg.stop, &elastic) {
                    (None, _) => None,
                    (Some(signal), None) => match agreed_stop(strategy, signal).map_err(agreeing) {
                        Ok(c) => c,
                        Err(e) => recover_or_fail!('epochs, e),
                    },
                    // In an elastic job, workers asked to stop leave it while enough remain.
                    (Some(signal), Some(el)) => match el.stop_agreement(signal).map_err(agreeing) {
                        Ok(StopAgreement::GoOn) => None,
                        Ok(StopAgreement::All(code)) => Some(code),
                        Ok(StopAgreement::Leave(code)) => {
                            // ZeRO: this worker's shard of the optimizer state stays with the
                            // others (a collective, before it leaves).
                            el.prepare(global_step)?;
                            el.w.leave_on_request(code)?;
                            tracing::info!(step = global_step, code, "left the elastic job on request");
                            stopped = Some(Stopped { step: global_step, code, checkpoint: None, left_job: true });
                            break;
                        }
                        Ok(StopAgreement::OthersLeave(n)) => {
                            if let Err(e) = el.prepare(global_step) {
                                recover_or_fail!('epochs, e);
                            }
                            let why = format!("{n} worker(s) left the job on request after step {global_step}");
                            let p = el.recover(model, Some(Position { step: global_step, ended }), Some(&why))?;
                            global_step = p.step;
                            ended = p.ended;
                            epochs.retain(|e: &EpochReport| e.epoch < ended);
                            continue 'epochs;
                        }
                        Err(e) => recover_or_fail!('epochs, e),
                    },
                };
                if let Some(code) = agreed {
                    let mut checkpoint = None;
                    if let Some((c, h)) = ckpt {
                        if saved_step != Some(global_step) {
                            save_checkpoint(strategy, model, c, h, global_step)?;
                        }
                        checkpoint = is_chief(strategy).then(|| c.dir.clone());
                    }
                    tracing::info!(step = global_step, code, "stopped on request");
                    stopped = Some(Stopped { step: global_step, code, checkpoint, left_job: false });
                    break;
                }
            }
            if stopped.is_some() {
                break;
            }
            // One cross-replica (and cross-worker) reduction of the epoch's losses.
            let loss_sum = match strategy.reduce(ReduceOp::Sum, &strata_core::PerReplica::new(local_loss)?) {
                Ok(l) => l,
                Err(e) => recover_or_fail!('epochs, e),
            };
            skipped += data.skipped_examples();
            // Evaluation reads the state (BatchNorm's statistics) as the mean over replicas.
            if let Err(e) = model.sync_state() {
                recover_or_fail!('epochs, e);
            }
            let test_metrics = match self.evaluate(strategy, model, task, test) {
                Ok(m) => m,
                Err(crate::Error::Core(e)) => recover_or_fail!('epochs, e),
                Err(e) => return Err(e),
            };
            let acc = accuracy_of(&test_metrics);
            if let Some(m) = metrics.as_ref().filter(|_| is_chief(strategy)) {
                let g = global_step as u64;
                let mut record =
                    crate::metrics::MetricRecord::eval(g, g, start.elapsed().as_secs_f64(), all_examples as u64, acc);
                // A task without accuracy (the transformer's) records its loss instead.
                if !test_metrics.iter().any(|m| m.name == "accuracy") {
                    record.accuracy = None;
                    record.validation_loss = test_metrics.iter().find(|m| m.name == "loss").map(|m| m.value as f32);
                }
                m.write(&record)?;
            }
            let train_loss = loss_sum / loss_n.max(1) as f32;
            tracing::info!(epoch, train_loss, test_accuracy = acc, "epoch done");
            progress.epoch(epoch, &format!("loss {train_loss:.4}{}", describe(&test_metrics)));
            epochs.push(EpochReport {
                epoch,
                train_loss,
                test_accuracy: acc,
                step_seconds: epoch_time.as_secs_f64(),
                test_metrics,
            });
            ended += 1;
        }
        progress.end();
        // A run too short to have a steady state reports the throughput of all its steps.
        let (time, examples) =
            if steady_time.is_zero() { (all_time, all_examples) } else { (steady_time, steady_examples) };
        let examples_per_second = if time.is_zero() { 0.0 } else { examples as f64 / time.as_secs_f64() };
        Ok(FitReport {
            final_test_accuracy: epochs.last().map_or(0.0, |e| e.test_accuracy),
            final_metrics: epochs.last().map_or_else(Vec::new, |e| e.test_metrics.clone()),
            epochs,
            examples_per_second,
            steps,
            resumed_from_step: resumed,
            skipped_examples: skipped,
            wall_seconds: start.elapsed().as_secs_f64(),
            stopped,
        })
    }
}

/// Whether to stop now: this process's request, or in a multi-worker job the largest request
/// of any worker (one all-reduce of one number, so every worker decides alike). Every worker
/// must call it at the same point of its program, as [`Trainer::fit`] does between executions.
pub fn agreed_stop<S: Strategy>(strategy: &S, signal: &StopSignal) -> strata_core::Result<Option<u32>> {
    let mine = signal.requested().unwrap_or(0);
    let code = match strategy.extended().workers() {
        None => mine,
        Some(w) => {
            // Codes are small integers: exact in an f32.
            let mut v = [mine.min(1 << 24) as f32];
            w.all_reduce(ReduceOp::Max, &mut v)?;
            v[0] as u32
        }
    };
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

/// How the trainer saves and restores an optimizer's state.
type NamedTensors = Vec<(String, Tensor)>;
type SaveState<'a> = &'a dyn Fn() -> Result<NamedTensors>;
type LoadState<'a> = &'a dyn Fn(&[(String, Tensor)]) -> Result<()>;

struct OptimizerHooks<'a> {
    save: SaveState<'a>,
    load: LoadState<'a>,
    /// Whether `save` is a collective every worker calls (ZeRO's shards gathered).
    collective: bool,
    /// Under ZeRO: whether the optimizer keeps state across steps (plain SGD keeps none);
    /// false at stage 0, where nothing asks.
    keeps_state: bool,
    /// ZeRO: lays the shards out over the current membership (fresh state; load it after).
    reshard: &'a dyn Fn() -> Result<()>,
    /// Sets the optimizer steps applied (a schedule reads them) for the training step given.
    at_step: &'a dyn Fn(u64),
}

fn is_chief<S: Strategy>(strategy: &S) -> bool {
    strategy.extended().workers().is_none_or(|w| w.worker_index() == 0)
}

fn save_checkpoint<S: Strategy, M>(
    strategy: &S,
    model: &Replicated<M>,
    c: &CheckpointConfig,
    h: &OptimizerHooks<'_>,
    step: usize,
) -> Result<()> {
    // Every worker: the checkpoint holds the state's mean over replicas and workers.
    model.sync_state()?;
    let gathered = if h.collective { Some((h.save)()?) } else { None };
    if !is_chief(strategy) {
        return Ok(());
    }
    let _s = tracing::info_span!("checkpoint", step).entered();
    let mut entries: Vec<CheckpointTensor> = model
        .variables(0)
        .iter()
        .map(|(name, v)| CheckpointTensor::new(format!("model/{name}"), v.as_tensor().clone()))
        .collect();
    let state = match gathered {
        Some(state) => state,
        None => (h.save)()?,
    };
    for (name, t) in state {
        entries.push(CheckpointTensor::new(format!("optimizer/{name}"), t));
    }
    let mut meta = std::collections::BTreeMap::new();
    meta.insert("strategy".to_string(), strategy.extended().name().to_string());
    let dir = checkpoint::write_checkpoint(&c.dir, step as u64, &entries, &meta)?;
    checkpoint::keep_last(&c.dir, c.keep.max(1))?;
    tracing::info!(dir = %dir.display(), step, "checkpoint written");
    Ok(())
}

/// What the workers of an elastic job agree after a step about stops on request.
enum StopAgreement {
    /// No worker was asked to stop.
    GoOn,
    /// The job stops (every worker was asked to, or too few would remain): the largest code.
    All(u32),
    /// This worker was asked to stop (its code) and leaves; enough workers remain.
    Leave(u32),
    /// That many other workers leave; this one goes on with the rest.
    OthersLeave(usize),
}

impl Elastic<'_> {
    /// Gathers every worker's stop request (a collective, after a step).
    fn stop_agreement(&self, signal: &StopSignal) -> strata_core::Result<StopAgreement> {
        let mine = signal.requested().unwrap_or(0);
        // Codes are small integers: exact in an f32.
        let all = self.w.all_gather(&[mine.min(1 << 24) as f32])?;
        let codes: Vec<u32> = all.iter().map(|v| v.first().copied().unwrap_or(0.0) as u32).collect();
        let stopping = codes.iter().filter(|&&c| c > 0).count();
        let staying = codes.len() - stopping;
        Ok(match stopping {
            0 => StopAgreement::GoOn,
            _ if staying == 0 || staying < self.w.min_workers() => {
                StopAgreement::All(codes.iter().copied().max().unwrap_or(mine))
            }
            _ if mine > 0 => StopAgreement::Leave(mine),
            n => StopAgreement::OthersLeave(n),
        })
    }
}

/// Where a worker is in training: steps completed, and epochs whose end (their loss and
/// evaluation) is done.
#[derive(Clone, Copy, Debug)]
struct Position {
    step: usize,
    ended: usize,
}

/// An elastic job's worker collectives and the optimizer's state hooks.
struct Elastic<'a> {
    w: &'a dyn strata_core::strategy::WorkerCollectives,
    h: &'a OptimizerHooks<'a>,
    /// The reductions, whose state across steps (compression's) follows the membership.
    ops: &'a dyn strata_core::cross_device::CrossDeviceOps,
    /// ZeRO with an optimizer that keeps state: the whole state, gathered over the old
    /// membership before a change it saw coming (a worker admitted, or leaving on request),
    /// with the step it is of.
    prepared: std::cell::RefCell<Option<(usize, NamedTensors)>>,
    /// ZeRO: loads the latest checkpoint (every worker calls it), for a change that lost a
    /// shard of the optimizer state; its step, or `None` where there is none.
    rollback: Option<&'a dyn Fn() -> Result<Option<usize>>>,
    steps_per_epoch: usize,
}

impl Elastic<'_> {
    /// After a failed collective (`why`; `None` for a worker that joined under way): joins the
    /// next generation of the membership, and brings every member to the most advanced
    /// member's state and position (a member that completed the interrupted step hands its
    /// parameters and optimizer state to those that did not, so every step is applied exactly
    /// once). Returns that position. Another loss meanwhile starts over.
    fn recover<M>(&self, model: &Replicated<M>, mine: Option<Position>, why: Option<&str>) -> Result<Position> {
        if let Some(why) = why {
            tracing::warn!(step = mine.map(|p| p.step), %why, "a step failed; re-forming the elastic job");
            self.w.rejoin()?;
        }
        loop {
            match self.sync(model, mine) {
                Ok(p) => {
                    (self.h.at_step)(p.step as u64);
                    tracing::info!(
                        step = p.step,
                        workers = self.w.num_workers(),
                        generation = self.w.generation(),
                        "training goes on"
                    );
                    return Ok(p);
                }
                Err(crate::Error::Core(strata_core::Error::Cluster(m))) => {
                    tracing::warn!(why = %m, "the membership changed again while it was agreed; re-forming");
                    self.w.rejoin()?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// ZeRO with an optimizer that keeps state, before a change of membership every member
    /// sees coming (every member calls it, over the old membership): gathers the whole state,
    /// so that no shard of it leaves with a worker.
    fn prepare(&self, step: usize) -> strata_core::Result<()> {
        if self.h.collective && self.h.keeps_state {
            let state = (self.h.save)().map_err(|e| match e {
                crate::Error::Core(e) => e,
                other => strata_core::Error::Checkpoint(other.to_string()),
            })?;
            *self.prepared.borrow_mut() = Some((step, state));
        }
        Ok(())
    }

    /// Every member's position, the most advanced one's state broadcast when they differ.
    fn sync<M>(&self, model: &Replicated<M>, mine: Option<Position>) -> Result<Position> {
        if self.h.collective {
            return self.sync_shards(model, mine);
        }
        // Counts below 2^24 are exact in an f32; a joiner has none.
        let v = mine.map_or([-1.0, -1.0], |p| [p.step.min(1 << 24) as f32, p.ended.min(1 << 24) as f32]);
        let all = self.w.all_gather(&v)?;
        let at = |x: &[f32]| (x.first().copied().unwrap_or(-1.0), x.get(1).copied().unwrap_or(-1.0));
        let mut source = 0;
        for (rank, x) in all.iter().enumerate() {
            if at(x) > at(&all[source]) {
                source = rank;
            }
        }
        let best = at(&all[source]);
        if best.0 < 0.0 {
            return Err(crate::Error::Usage(
                "every worker of the elastic job joined it under way: none has its state; restart the job".into(),
            ));
        }
        let position = Position { step: best.0 as usize, ended: best.1 as usize };
        let vars: Vec<Tensor> = model.variables(0).iter().map(|(_, v)| v.as_tensor().clone()).collect();
        self.ops.carry_over(&vars, source)?;
        if all.iter().all(|x| at(x) == best) {
            return Ok(position);
        }
        let (vars, state) = state_layout(model, self.h)?;
        let len: usize = vars.iter().chain(state.iter()).map(|(_, t)| t.elem_count()).sum();
        let mut values = Vec::with_capacity(len);
        if self.w.worker_index() == source {
            for (_, t) in vars.iter().chain(state.iter()) {
                values.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
            }
        } else {
            values.resize(len, 0.0);
        }
        self.w.broadcast(source, &mut values)?;
        if self.w.worker_index() != source {
            load_flat(model, self.h, &vars, &state, &values)?;
        }
        Ok(position)
    }
}

impl Elastic<'_> {
    /// [`Self::sync`] under ZeRO, whose shards are laid out again over the new membership: a
    /// member that holds the whole optimizer state of its step (gathered before the change,
    /// [`Self::prepare`]; nothing to hold for an optimizer that keeps none) hands both to every
    /// member, the most advanced such member. Where none can (a lost worker took its shard of
    /// the state with it), every member rolls back to the latest checkpoint.
    fn sync_shards<M>(&self, model: &Replicated<M>, mine: Option<Position>) -> Result<Position> {
        (self.h.reshard)()?;
        let prepared = self.prepared.borrow().as_ref().map(|(step, _)| *step);
        // An elastic job's shards are stepped in copies: a member's parameters are whole at
        // its position even when a loss cut its last step off (`zero::Shards::new`).
        let whole = mine.is_some_and(|p| !self.h.keeps_state || prepared == Some(p.step));
        // Counts below 2^24 are exact in an f32; a joiner has none.
        let v = mine.map_or([-1.0, -1.0, 0.0], |p| {
            [p.step.min(1 << 24) as f32, p.ended.min(1 << 24) as f32, f32::from(u8::from(whole))]
        });
        let all = self.w.all_gather(&v)?;
        let at = |x: &[f32]| (x.first().copied().unwrap_or(-1.0), x.get(1).copied().unwrap_or(-1.0));
        let can = |x: &[f32]| x.get(2).copied().unwrap_or(0.0) == 1.0;
        let mut best = 0;
        let mut source: Option<usize> = None;
        for (rank, x) in all.iter().enumerate() {
            if at(x) > at(&all[best]) {
                best = rank;
            }
            if can(x) && source.is_none_or(|s| at(x) > at(&all[s])) {
                source = Some(rank);
            }
        }
        if at(&all[best]).0 < 0.0 {
            return Err(crate::Error::Usage(
                "every worker of the elastic job joined it under way: none has its state; restart the job".into(),
            ));
        }
        let vars: Vec<Tensor> = model.variables(0).iter().map(|(_, v)| v.as_tensor().clone()).collect();
        match source.filter(|&s| at(&all[s]) == at(&all[best])) {
            Some(source) => {
                self.ops.carry_over(&vars, source)?;
                // The whole state's names and shapes (a collective: every member's shards).
                let (vars, state) = state_layout(model, self.h)?;
                let len: usize = vars.iter().chain(state.iter()).map(|(_, t)| t.elem_count()).sum();
                let mut values = Vec::with_capacity(len);
                if self.w.worker_index() == source {
                    let held = self.prepared.borrow();
                    let held: &[(String, Tensor)] = held.as_ref().map_or(&[], |(_, s)| s.as_slice());
                    for (_, t) in &vars {
                        values.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
                    }
                    for (name, t) in &state {
                        let t = held.iter().find(|(n, _)| n == name).map_or(t, |(_, h)| h);
                        values.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
                    }
                    if values.len() != len {
                        return Err(strata_core::Error::Checkpoint(format!(
                            "the optimizer state gathered before the change holds {} values, {len} expected; every worker must build the same model and optimizer",
                            values.len()
                        ))
                        .into());
                    }
                } else {
                    values.resize(len, 0.0);
                }
                self.w.broadcast(source, &mut values)?;
                load_flat(model, self.h, &vars, &state, &values)?;
                let (step, ended) = at(&all[source]);
                let position = Position { step: step as usize, ended: ended as usize };
                (self.h.at_step)(position.step as u64);
                *self.prepared.borrow_mut() = None;
                tracing::info!(
                    step = position.step,
                    workers = self.w.num_workers(),
                    "re-split ZeRO's shards over the new membership"
                );
                Ok(position)
            }
            None => {
                self.ops.carry_over(&vars, best)?;
                let Some(rollback) = self.rollback else {
                    return Err(strata_core::Error::Checkpoint(
                        "a lost worker took its shard of the optimizer state (ZeRO) with it, and the job has no checkpoint to roll back to; give it a checkpoint directory".into(),
                    )
                    .into());
                };
                let Some(step) = rollback()? else {
                    return Err(strata_core::Error::Checkpoint(
                        "a lost worker took its shard of the optimizer state (ZeRO) with it, and no checkpoint was found to roll back to; keep the checkpoint directory where the leading worker reads it".into(),
                    )
                    .into());
                };
                *self.prepared.borrow_mut() = None;
                tracing::warn!(
                    step,
                    workers = self.w.num_workers(),
                    "rolled back to a checkpoint: a lost worker took its shard of the optimizer state"
                );
                if self.w.worker_index() == 0 {
                    eprintln!(
                        "rolled back to the checkpoint of step {step}: a lost worker took its shard of the optimizer state (ZeRO) with it; the steps since are trained again over {} workers",
                        self.w.num_workers()
                    );
                }
                Ok(Position { step, ended: step / self.steps_per_epoch.max(1) })
            }
        }
    }
}

/// The state a job carries, in a fixed order: the model's variables (copy 0), then the
/// optimizer's state.
fn state_layout<M>(model: &Replicated<M>, h: &OptimizerHooks<'_>) -> Result<(NamedTensors, NamedTensors)> {
    let vars = model.variables(0).iter().map(|(n, v)| (format!("model/{n}"), v.as_tensor().clone())).collect();
    Ok((vars, (h.save)()?))
}

/// Sets every copy of the model's variables and the optimizer's state from `values`, laid out
/// as [`state_layout`] says.
fn load_flat<M>(
    model: &Replicated<M>,
    h: &OptimizerHooks<'_>,
    vars: &[(String, Tensor)],
    state: &[(String, Tensor)],
    values: &[f32],
) -> Result<()> {
    let mut at = 0;
    let mut take = |t: &Tensor| -> Result<Tensor> {
        let n = t.elem_count();
        let v = Tensor::from_slice(&values[at..at + n], t.shape(), t.device())?.to_dtype(t.dtype())?;
        at += n;
        Ok(v)
    };
    let new_vars: Vec<Tensor> = vars.iter().map(|(_, t)| take(t)).collect::<Result<_>>()?;
    let new_state: Vec<(String, Tensor)> =
        state.iter().map(|(n, t)| Ok((n.clone(), take(t)?))).collect::<Result<_>>()?;
    for copy in 0..model.num_copies() {
        for ((_, var), value) in model.variables(copy).iter().zip(&new_vars) {
            var.set(value)?;
        }
    }
    (h.load)(&new_state)
}

/// Loads the latest checkpoint (on the chief) and hands it to every worker; returns its step,
/// or `None` where the chief found none (then nothing changed).
fn restore_latest<S: Strategy, M>(
    strategy: &S,
    model: &Replicated<M>,
    c: &CheckpointConfig,
    h: &OptimizerHooks<'_>,
) -> Result<Option<usize>> {
    let workers = strategy.extended().workers();
    let found = if is_chief(strategy) { checkpoint::read_latest(&c.dir)? } else { None };
    // The local layout: the model's variables, then the optimizer's state, in a fixed order.
    let (vars, state) = state_layout(model, h)?;
    // [1, step] when the chief found a checkpoint, [0, 0] when not: integers, bit for bit.
    let (mut header, mut values) = ([0u64; 2], Vec::new());
    if let Some(ck) = &found {
        header = [1, ck.step];
        let keys =
            vars.iter().map(|(n, t)| (n.clone(), t)).chain(state.iter().map(|(n, t)| (format!("optimizer/{n}"), t)));
        for (key, t) in keys {
            let saved = ck.tensor(&key)?;
            if saved.dims() != t.dims() {
                return Err(strata_core::Error::Checkpoint(format!(
                    "{}: {key} has shape {:?} but the model has {:?}; restore into the model that wrote it",
                    ck.dir.display(),
                    saved.dims(),
                    t.dims()
                ))
                .into());
            }
            values.extend(saved.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        }
    }
    if let Some(w) = workers {
        w.broadcast_u64s(0, &mut header)?;
        if header[0] == 1 && found.is_none() {
            let len: usize = vars.iter().chain(state.iter()).map(|(_, t)| t.elem_count()).sum();
            values = vec![0f32; len];
        }
        if header[0] == 1 {
            w.broadcast(0, &mut values)?;
        }
    }
    let [found_one, step] = header;
    if found_one != 1 {
        return Ok(None);
    }
    load_flat(model, h, &vars, &state, &values)?;
    (h.at_step)(step);
    Ok(Some(step as usize))
}

/// Loads the latest checkpoint, if any (see [`restore_latest`]); returns its step, or 0.
fn restore<S: Strategy, M>(
    strategy: &S,
    model: &Replicated<M>,
    c: &CheckpointConfig,
    h: &OptimizerHooks<'_>,
) -> Result<usize> {
    let Some(step) = restore_latest(strategy, model, c, h)? else { return Ok(0) };
    tracing::info!(step, "resumed from a checkpoint");
    eprintln!("resumed from the checkpoint of step {step} in {}", c.dir.display());
    Ok(step)
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
        Self { loss: Box::new(loss), outputs: None, metrics: vec![Box::new(Loss)] }
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

    /// The metrics' names, in order.
    pub fn metric_names(&self) -> Vec<&str> {
        self.metrics.iter().map(|m| m.name()).collect()
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

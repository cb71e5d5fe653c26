//! `Trainer::fit`: the high-level training loop, for users who do not write their own.
//!
//! Per epoch: a seeded shuffle of the training set, global batches split over the replicas
//! ([`TailPolicy::Split`]: the uneven last batch is weighted exactly), one synchronous step per
//! batch (handed to the replicas a whole epoch at a time, or `steps_per_execution` at a time,
//! with [`Strategy::run_batches`]), then an evaluation on the test set. A progress bar (indicatif, on a terminal) shows
//! loss and accuracy; tracing spans mark every epoch and step, and the strategy's timeline (if
//! any) records every replica's forward, backward, bucket reductions and optimizer step.

use std::time::{Duration, Instant};

use candle_nn::Optimizer;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;
use strata_core::data::{Batch, TailPolicy};
use strata_core::{DistributedOptimizer, ReduceOp, Replicated, Strategy};

use crate::digits::gather;
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
    /// Draw a progress bar (only on a terminal).
    pub progress: bool,
    /// Steps handed to the replicas at once (`None`: a whole epoch), as Keras'
    /// `steps_per_execution`: fewer hand-offs between the caller and the replica threads.
    pub steps_per_execution: Option<usize>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self { epochs: 30, global_batch: 256, seed: 0, warmup_steps: 3, progress: true, steps_per_execution: None }
    }
}

/// One epoch's outcome.
#[derive(Clone, Debug, Serialize)]
pub struct EpochReport {
    /// Epoch number, from 0.
    pub epoch: usize,
    /// Mean training loss over the epoch's steps.
    pub train_loss: f32,
    /// Test accuracy after the epoch.
    pub test_accuracy: f32,
    /// Seconds spent in training steps.
    pub step_seconds: f64,
}

/// What a fit did.
#[derive(Clone, Debug, Serialize)]
pub struct FitReport {
    /// Every epoch.
    pub epochs: Vec<EpochReport>,
    /// Test accuracy after the last epoch.
    pub final_test_accuracy: f32,
    /// Training examples per second over the steps after the warm-up (evaluation excluded).
    pub examples_per_second: f64,
    /// Steps run.
    pub steps: usize,
    /// Examples the tail policy skipped (batches smaller than the replica count).
    pub skipped_examples: usize,
    /// Wall seconds of the whole fit, evaluation included.
    pub wall_seconds: f64,
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

    /// Trains `model` with `opt` under `strategy` on `train`, evaluating on `test` each epoch.
    pub fn fit<S, M, O>(
        &self,
        strategy: &S,
        model: &Replicated<M>,
        opt: &DistributedOptimizer<O>,
        train: &Batch,
        test: &Batch,
    ) -> Result<FitReport>
    where
        S: Strategy,
        M: Classifier,
        O: Optimizer + Send,
    {
        let cfg = &self.config;
        if cfg.global_batch == 0 {
            return Err(crate::Error::Usage("the global batch must be at least 1; pass --batch 1 or more".into()));
        }
        let start = Instant::now();
        let steps_per_epoch = train.len().div_ceil(cfg.global_batch);
        let bar = progress_bar(cfg.progress, (steps_per_epoch * cfg.epochs) as u64);
        let mut epochs = Vec::with_capacity(cfg.epochs);
        let (mut steps, mut steady_time, mut steady_examples, mut skipped) = (0usize, Duration::ZERO, 0usize, 0usize);
        let (mut all_time, mut all_examples) = (Duration::ZERO, 0usize);
        for epoch in 0..cfg.epochs {
            let _e = tracing::info_span!("epoch", epoch).entered();
            let mut idx: Vec<usize> = (0..train.len()).collect();
            idx.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(cfg.seed.wrapping_add(epoch as u64)));
            let batches = idx.chunks(cfg.global_batch).map(|c| gather(train, c));
            let mut data = strategy.distribute_dataset(batches, TailPolicy::Split);
            let epoch_batches: Vec<_> = data.by_ref().collect();
            let per_execution = cfg.steps_per_execution.unwrap_or(epoch_batches.len()).max(1);
            let (mut loss_sum, mut loss_n, mut epoch_time) = (0f32, 0usize, Duration::ZERO);
            for execution in epoch_batches.chunks(per_execution) {
                let _s = tracing::debug_span!("execution", first_step = steps, steps = execution.len()).entered();
                let t0 = Instant::now();
                let losses = strategy.run_batches(execution, |ctx, shard| {
                    let fwd = ctx.phase("step", "forward");
                    let x = shard.batch.features_tensor(ctx.candle_device())?;
                    let y = shard.batch.labels_tensor(ctx.candle_device())?;
                    let loss = model.on(ctx)?.loss(&x, &y)?;
                    drop(fwd);
                    ctx.backward_and_sync(&loss, opt)?;
                    // The replica's share of the global batch's mean loss.
                    Ok(loss.to_scalar::<f32>()? * shard.weight())
                })?;
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
                for l in &losses {
                    loss_sum += strategy.reduce(ReduceOp::Sum, l)?;
                    loss_n += 1;
                }
                bar.inc(execution.len() as u64);
            }
            skipped += data.skipped_examples();
            let acc = evaluate(model.primary(), test)?;
            let train_loss = loss_sum / loss_n.max(1) as f32;
            tracing::info!(epoch, train_loss, test_accuracy = acc, "epoch done");
            bar.set_message(format!("epoch {} loss {train_loss:.4} test accuracy {:.2}%", epoch + 1, acc * 100.0));
            epochs.push(EpochReport { epoch, train_loss, test_accuracy: acc, step_seconds: epoch_time.as_secs_f64() });
        }
        bar.finish_and_clear();
        // A run too short to have a steady state reports the throughput of all its steps.
        let (time, examples) =
            if steady_time.is_zero() { (all_time, all_examples) } else { (steady_time, steady_examples) };
        let examples_per_second = if time.is_zero() { 0.0 } else { examples as f64 / time.as_secs_f64() };
        Ok(FitReport {
            final_test_accuracy: epochs.last().map_or(0.0, |e| e.test_accuracy),
            epochs,
            examples_per_second,
            steps,
            skipped_examples: skipped,
            wall_seconds: start.elapsed().as_secs_f64(),
        })
    }
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

fn progress_bar(show: bool, len: u64) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !show || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} steps {msg}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

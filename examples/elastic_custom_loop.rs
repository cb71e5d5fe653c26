//! An elastic job's hand-written training loop: the digits MLP under MultiWorkerMirrored with
//! `--min-workers`, which survives the loss of any worker (the chief included) and takes in one
//! that joins (a restart by `strata launch --max-restarts`), because [`strata::Elastic`] wraps
//! each step. It trains on the same global batches as `strata train`, so it ends with one
//! device's result.
//!
//! ```text
//! cargo build --release -p strata-examples --example elastic_custom_loop
//! strata launch --workers 3 --max-restarts 1 -- \
//!     target/release/examples/elastic_custom_loop --min-workers 2 --save-params 'p{task}.safetensors'
//! ```
//!
//! Its flags are `strata train`'s: `--hidden`, `--epochs`, `--optimizer` (adamw or sgd),
//! `--lr`, `--batch`, `--seed`, `--min-workers`, `--save-params` (`{task}`: each worker
//! writes its own, named by its task's place in the cluster), `--checkpoint-dir` and
//! `--checkpoint-every`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;

use candle_core::Tensor;
use candle_nn::{Optimizer, ParamsAdamW};
use clap::Parser;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use strata::checkpoint::OptimizerState;
use strata::data::{Batch, BatchData, TailPolicy};
use strata::elastic::CheckpointConfig;
use strata::model::{Classifier, Mlp};
use strata::optim::{FusedAdamW, FusedSgd};
use strata::prelude::*;
use strata::{DistributedOptimizer, Replicated};

/// The digits MLP in an elastic job of your own loop.
#[derive(Parser, Debug)]
struct Args {
    /// Hidden layer sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "256,256")]
    hidden: Vec<usize>,
    /// Passes over the training set.
    #[arg(long, default_value_t = 30)]
    epochs: usize,
    /// Optimizer.
    #[arg(long, value_enum, default_value = "adamw")]
    optimizer: OptimizerChoice,
    /// Learning rate.
    #[arg(long, default_value_t = 0.003)]
    lr: f64,
    /// Global batch size, examples per step over all workers.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Seed of initialisation and shuffling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// An elastic job that runs while at least N of its workers live.
    #[arg(long, value_name = "N")]
    min_workers: Option<usize>,
    /// The elastic job's coordination service (`strata launch` sets STRATA_COORDINATOR).
    #[arg(long, value_name = "HOST:PORT", env = "STRATA_COORDINATOR")]
    coordinator: Option<String>,
    /// Write the final parameters here (safetensors; the chief does, or every worker with
    /// `{task}` in the path, replaced by its task's index).
    #[arg(long)]
    save_params: Option<PathBuf>,
    /// Checkpoints (the leading worker writes them; ZeRO's stateful shards roll back to them).
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints.
    #[arg(long, default_value_t = 100)]
    checkpoint_every: usize,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum OptimizerChoice {
    Adamw,
    Sgd,
}

fn main() -> ExitCode {
    strata::init_cpu_threads();
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code().clamp(1, 255) as u8)
        }
    }
}

fn run(args: &Args) -> strata::Result<()> {
    let resolver = TFConfigClusterResolver::from_env()?;
    let mut options = MultiWorkerOptions::new(ClusterToken::resolve(None)?)?;
    options.options.seed = args.seed;
    if let Some(min_workers) = args.min_workers {
        let Some(coordinator) = args.coordinator.clone() else {
            return Err(strata::Error::Usage(
                "--min-workers: an elastic job needs a coordination service; run under strata launch, or pass --coordinator HOST:PORT".into(),
            ));
        };
        options.elastic = Some(strata::ElasticOptions { min_workers, coordinator });
    }
    let strategy = MultiWorkerMirroredStrategy::from_resolver(&resolver, options)?;
    let result = train(args, &strategy);
    match &result {
        // Every worker leaves the job cleanly (the coordination service reports the outcome).
        Ok(()) => strategy.finish()?,
        Err(e) => strategy.report_error(&strata::CoreError::Cluster(e.to_string())),
    }
    result
}

fn train(args: &Args, strategy: &MultiWorkerMirroredStrategy) -> strata::Result<()> {
    let (train, test) = strata::digits::train_test_split(&strata::digits::load(None)?, 0.2, 0);
    let (input, classes) = (strata::digits::FEATURES, strata::digits::CLASSES);
    let model = strategy.scope(|s| Mlp::new(s.var_builder(), input, &args.hidden, classes))?;
    match args.optimizer {
        OptimizerChoice::Adamw => {
            let config = ParamsAdamW { lr: args.lr, ..Default::default() };
            fit(args, strategy, &model, &model.optimizer::<FusedAdamW>(config)?, &train, &test)
        }
        OptimizerChoice::Sgd => fit(args, strategy, &model, &model.optimizer::<FusedSgd>(args.lr)?, &train, &test),
    }
}

/// The loop: one step per global batch, each wrapped by the elastic job's recovery.
fn fit<O: Optimizer + OptimizerState + Send>(
    args: &Args,
    strategy: &MultiWorkerMirroredStrategy,
    model: &Replicated<Mlp>,
    opt: &DistributedOptimizer<O>,
    train: &Batch,
    test: &Batch,
) -> strata::Result<()> {
    let steps_per_epoch = train.len().div_ceil(args.batch);
    let mut elastic = Elastic::new(strategy, model, opt)?.with_steps_per_epoch(steps_per_epoch);
    if let Some(dir) = &args.checkpoint_dir {
        let every_steps = args.checkpoint_every.max(1);
        elastic = elastic.with_checkpoints(CheckpointConfig { dir: dir.clone(), every_steps, keep: 3 });
    }
    // Step 0, a resumed job's checkpoint, or (a worker that joined under way) where the
    // members are.
    let mut at = elastic.start()?;
    // A negative control for the tests: this step applied twice.
    let mut twice = std::env::var("STRATA_EXAMPLE_STEP_TWICE").ok().and_then(|s| s.parse::<usize>().ok());
    let mut test_accuracy = 0.0;
    loop {
        if at.ended < at.step / steps_per_epoch {
            // The epoch's end: an evaluation, a collective of the loop's own, guarded too.
            match elastic.guard(at, || accuracy(strategy, model, test))? {
                Stepped::Done(acc) => {
                    test_accuracy = acc;
                    if strategy.is_chief() {
                        println!("epoch {}: test accuracy {:.2}%", at.ended + 1, acc * 100.0);
                    }
                    at.ended += 1;
                }
                Stepped::Moved(p) => at = p,
            }
            continue;
        }
        if at.step >= steps_per_epoch * args.epochs {
            // Every live worker ends together, with the same parameters.
            match elastic.finish(at)? {
                Stepped::Done(()) => break,
                Stepped::Moved(p) => at = p,
            }
            continue;
        }
        let batch = global_batch(train, args, at.step, steps_per_epoch)?;
        let step = || -> strata::CoreResult<()> {
            // The split follows the membership: distributed after any change.
            let mut data = strategy.distribute_dataset([batch.clone()], TailPolicy::Split);
            let Some(batch) = data.next() else { return Err(data.take_error().unwrap_or_else(empty)) };
            strategy.run_batch(&batch, |ctx, shard| {
                let x = shard.batch.features_tensor(ctx.candle_device())?;
                let y = shard.batch.labels_tensor(ctx.candle_device())?;
                let loss = model.on(ctx)?.loss(&x, &y)?;
                ctx.backward_and_sync(&loss, opt)
            })?;
            Ok(())
        };
        match elastic.step(at, step)? {
            Stepped::Done(()) if twice == Some(at.step + 1) => twice = None,
            Stepped::Done(()) => at.step += 1,
            Stepped::Moved(p) => at = p,
        }
    }
    if strategy.is_chief() {
        println!(
            "elastic_custom_loop: test accuracy {:.2}% after {} epochs ({} steps) over {} workers",
            test_accuracy * 100.0,
            args.epochs,
            at.step,
            strategy.num_workers()
        );
    }
    save_params(args, strategy, model)
}

/// Step `step`'s global batch: epoch `step / steps_per_epoch`'s seeded shuffle, cut in batches
/// as `strata train` cuts them.
fn global_batch(train: &Batch, args: &Args, step: usize, steps_per_epoch: usize) -> strata::CoreResult<Batch> {
    let epoch = step / steps_per_epoch;
    let mut idx: Vec<usize> = (0..train.len()).collect();
    idx.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(args.seed.wrapping_add(epoch as u64)));
    let chunk = idx.chunks(args.batch).nth(step % steps_per_epoch).unwrap_or_default();
    train.take_rows(chunk)
}

fn empty() -> strata::CoreError {
    strata::CoreError::Dataset("a global batch of no examples".into())
}

/// The test set's accuracy, split over every replica of every worker (collectives).
fn accuracy(strategy: &MultiWorkerMirroredStrategy, model: &Replicated<Mlp>, test: &Batch) -> strata::CoreResult<f32> {
    let mut data = strategy.distribute_dataset([test.clone()], TailPolicy::Split);
    let Some(batch) = data.next() else { return Err(data.take_error().unwrap_or_else(empty)) };
    let correct = strategy.run_batch(&batch, |ctx, shard| {
        let x = shard.batch.features_tensor(ctx.candle_device())?;
        let y = shard.batch.labels_tensor(ctx.candle_device())?;
        Ok(model.on(ctx)?.correct(&x, &y)? as f32)
    })?;
    Ok(strategy.reduce(ReduceOp::Sum, &correct)? / test.len() as f32)
}

/// `--save-params`: the chief writes them, or with `{task}` in the path every worker does,
/// named by its task's place among the cluster's workers (which outlives the membership's
/// ranks), as `strata train` names them.
fn save_params(args: &Args, strategy: &MultiWorkerMirroredStrategy, model: &Replicated<Mlp>) -> strata::Result<()> {
    let Some(path) = &args.save_params else { return Ok(()) };
    let per_task = path.to_string_lossy().contains("{task}");
    if !per_task && !strategy.is_chief() {
        return Ok(());
    }
    let c = strategy.cluster();
    let index = c.spec.sync_workers().iter().position(|t| *t == c.task).unwrap_or_else(|| strategy.worker_index());
    let path = PathBuf::from(path.to_string_lossy().replace("{task}", &index.to_string()));
    let tensors: HashMap<String, Tensor> =
        model.variables(0).iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
    candle_core::safetensors::save(&tensors, &path)
        .map_err(|e| strata::Error::io(format!("cannot write {}", path.display()), std::io::Error::other(e)))
}

//! Runnable Strata programs (see `custom_loop.rs` and `fit.rs` beside this crate):
//!
//! ```text
//! cargo run --release -p strata-examples --example custom_loop -- mirrored 2
//! cargo run --release -p strata-examples --example fit -- central-storage 2
//! ```
//!
//! Both take the strategy (`one-device`, `mirrored`, `central-storage`) and the replica count;
//! the model code does not change between strategies.

use strata::prelude::*;

/// The strategy named on the command line (`args[1]`, `args[2]`): the one line that changes.
pub fn strategy_from_args() -> strata::Result<StrategyHandle> {
    let args: Vec<String> = std::env::args().collect();
    let name = args.get(1).map(String::as_str).unwrap_or("mirrored");
    let replicas: usize = match args.get(2) {
        Some(n) => n.parse().map_err(|_| strata::Error::Usage(format!("replica count {n:?} is not a number")))?,
        None => 2,
    };
    Ok(match name {
        "one-device" => OneDeviceStrategy::cpu()?.handle(),
        "mirrored" => MirroredStrategy::logical_cpus(replicas)?.handle(),
        "central-storage" => CentralStorageStrategy::logical_cpus(replicas)?.handle(),
        other => {
            return Err(strata::Error::Usage(format!(
                "unknown strategy {other:?}: use one-device, mirrored or central-storage"
            )))
        }
    })
}

/// The parameter-server example's step, shared by `ps_worker.rs` (which registers it) and
/// `ps_coordinator.rs` (which schedules it by name): a closure cannot travel between
/// processes, so every task runs code that knows the step by its name.
pub mod ps_step {
    use serde::{Deserialize, Serialize};
    use strata::model::{Classifier, Mlp};
    use strata::parameter_server::{PsWorkerModel, StepRegistry, WorkerContext};
    use strata::prelude::*;

    /// The name the step is registered under.
    pub const NAME: &str = "example.train";
    /// The MLP's hidden layers.
    pub const HIDDEN: [usize; 2] = [128, 128];

    /// Which batch a step trains on.
    #[derive(Clone, Debug, Serialize, Deserialize)]
    pub struct Args {
        /// The epoch (seeds the shuffle).
        pub epoch: u64,
        /// The batch within the epoch.
        pub batch: usize,
        /// Examples per batch.
        pub batch_size: usize,
    }

    /// Registers the step. It reads like a `run_batch` step under any other strategy: the
    /// worker's model pulls the ps tasks' values, each replica computes its shard's loss, and
    /// `backward_and_push` pushes the gradients that exist, once per step, the push starting
    /// while the backward pass runs (the parameter servers apply it whole, exactly once).
    /// Returns the batch's loss.
    pub fn register(registry: &mut StepRegistry) -> strata::Result<()> {
        let (train, _) = strata::digits::train_test_split(&strata::digits::load(None)?, 0.2, 0);
        let worker = PsWorkerModel::new(1, Default::default(), |s| Mlp::new(s.var_builder(), 64, &HIDDEN, 10))?;
        registry.register(NAME, move |ctx: &WorkerContext, args: Args| -> Result<f32, strata::CoreError> {
            // The arguments come from the network: check them before they size anything.
            let n = train.len();
            let start = args.batch.checked_mul(args.batch_size).filter(|&s| s < n);
            let Some(start) = start.filter(|_| (1..=n).contains(&args.batch_size)) else {
                return Err(strata::CoreError::InvalidArgument(format!(
                    "batch {} of {} examples: a batch holds 1 to {n} examples and starts inside the {n} training examples",
                    args.batch, args.batch_size
                )));
            };
            let order = strata::ps_job::epoch_order(n, 0, args.epoch);
            let idx = &order[start..(start + args.batch_size).min(n)];
            let batch = strata::digits::gather(&train, idx);
            let step = worker.run_batch(ctx, &batch, |rctx, shard| {
                let x = shard.batch.features_tensor(rctx.candle_device())?;
                let y = shard.batch.labels_tensor(rctx.candle_device())?;
                let loss = worker.model().on(rctx)?.loss(&x, &y)?;
                worker.backward_and_push(rctx, &loss)?; // push (starting during the pass), applied once
                Ok(loss.to_scalar::<f32>()? * shard.weight())
            })?;
            worker.strategy().reduce(ReduceOp::Sum, &step.values)
        });
        Ok(())
    }
}

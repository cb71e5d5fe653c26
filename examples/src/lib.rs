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
    use strata::parameter_server::{StepRegistry, WorkerContext};
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

    /// Registers the step: pull the variables, compute the batch's gradient on this worker,
    /// push it; the parameter servers apply it. Returns the batch's loss.
    pub fn register(registry: &mut StepRegistry) -> strata::Result<()> {
        let (train, _) = strata::digits::train_test_split(&strata::digits::load(None)?, 0.2, 0);
        let strategy = OneDeviceStrategy::cpu()?;
        let model = strategy.scope(|s| Mlp::new(s.var_builder(), 64, &HIDDEN, 10))?;
        let model = std::sync::Mutex::new(model);
        registry.register(NAME, move |ctx: &WorkerContext, args: Args| -> Result<f32, strata::CoreError> {
            let model = model.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let vars = model.variables(0).to_vec();
            let ticket = ctx.pull(&vars)?; // fresh values from every ps task
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
            let x = batch.features_tensor(&candle_core::Device::Cpu)?;
            let y = batch.labels_tensor(&candle_core::Device::Cpu)?;
            let loss = model.primary().loss(&x, &y)?;
            let grads = loss.backward()?;
            let mut pushed = Vec::with_capacity(vars.len());
            for (name, v) in &vars {
                let g = match grads.get(v.as_tensor()) {
                    Some(g) => g.flatten_all()?.to_vec1::<f32>()?,
                    None => vec![0.0; v.as_tensor().elem_count()],
                };
                pushed.push((name.clone(), g));
            }
            ctx.push(&ticket, &pushed)?; // one update per ps task, applied exactly once
            Ok(loss.to_scalar::<f32>()?)
        });
        Ok(())
    }
}

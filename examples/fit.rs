//! The high-level loop: `Trainer::fit` runs epochs, shuffles, evaluates and reports progress
//! (a line per epoch on standard error).
//!
//! `cargo run --release -p strata-examples --example fit -- central-storage 2`

use candle_nn::ParamsAdamW;
use strata::model::Mlp;
use strata::optim::FusedAdamW;
use strata::prelude::*;
use strata::trainer::{EpochLog, Task, TrainConfig, Trainer};

fn main() -> strata::Result<()> {
    strata::init_cpu_threads();
    let strategy = strata_examples::strategy_from_args()?;
    let (train, test) = strata::digits::train_test_split(&strata::digits::load(None)?, 0.2, 0);
    let model = strategy.scope(|s| Mlp::new(s.var_builder(), 64, &[256, 256], 10))?;
    // Strata's fused AdamW: candle-nn's configuration and results, updated in place.
    let opt = model.optimizer::<FusedAdamW>(ParamsAdamW { lr: 3e-3, ..Default::default() })?;
    let config = TrainConfig { epochs: 20, progress: Some(std::sync::Arc::new(EpochLog)), ..Default::default() };
    let report = Trainer::new(config).fit(&strategy, &model, &opt, &Task::classifier(), &train, &test)?;
    println!(
        "{} replicas: test accuracy {:.2}%, {:.0} examples/s",
        strategy.num_replicas_in_sync(),
        report.final_test_accuracy * 100.0,
        report.examples_per_second
    );
    Ok(())
}

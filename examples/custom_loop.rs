//! The low-level custom training loop of DESIGN.md §1: the strategy owns placement,
//! replication and reduction; the model code is plain candle-nn and does not change.
//!
//! `cargo run --release -p strata-examples --example custom_loop -- mirrored 2`

use candle_nn::{AdamW, ParamsAdamW};
use strata::data::TailPolicy;
use strata::model::{Classifier, Mlp};
use strata::prelude::*;

fn main() -> strata::Result<()> {
    strata::init_cpu_threads();
    let strategy = strata_examples::strategy_from_args()?; // the one line that changes
    let (train, test) = strata::digits::train_test_split(&strata::digits::load(None)?, 0.2, 0);

    let model = strategy.scope(|s| Mlp::new(s.var_builder(), 64, &[256, 256], 10))?; // mirrored or central variables
    let opt = model.optimizer::<AdamW>(ParamsAdamW { lr: 3e-3, ..Default::default() })?;

    let global_batch = 256;
    for epoch in 0..20 {
        let batches =
            (0..train.len()).step_by(global_batch).map(|i| train.slice(i..(i + global_batch).min(train.len())));
        let (mut sum, mut steps) = (0.0, 0);
        for batch in strategy.distribute_dataset(batches, TailPolicy::Split) {
            let losses = strategy.run_batch(&batch, |ctx, shard| {
                let x = shard.batch.features_tensor(ctx.candle_device())?;
                let y = shard.batch.labels_tensor(ctx.candle_device())?;
                let loss = model.on(ctx)?.loss(&x, &y)?; // the replica's copy of the model
                ctx.backward_and_sync(&loss, &opt)?; // all-reduce grads, apply once per replica
                Ok(loss.to_scalar::<f32>()? * shard.weight())
            })?;
            sum += strategy.reduce(ReduceOp::Sum, &losses)?; // cross-replica context
            steps += 1;
        }
        let acc = strata::trainer::evaluate(model.primary(), &test)?;
        println!("epoch {epoch:2}: loss {:.4}, test accuracy {:.2}%", sum / steps as f32, acc * 100.0);
    }
    Ok(())
}

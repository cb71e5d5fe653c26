//! The coordinator of the example job: `scope` creates the model's variables on the parameter
//! servers, `schedule` hands steps to whichever worker is free, `join` waits for them, and the
//! coordinator pulls the trained values to evaluate them. Run it as `ps_server.rs` describes.

use std::time::Duration;

use candle_core::Device;
use strata::cluster::{ClusterSpec, TaskType};
use strata::model::{Classifier, Mlp};
use strata::prelude::*;
use strata_examples::ps_step::{Args, HIDDEN, NAME};

fn main() -> strata::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let list = |i: usize, default: &str| -> Vec<String> {
        args.get(i).map_or(default, String::as_str).split(',').map(String::from).collect()
    };
    let cluster =
        ClusterSpec::new([(TaskType::Ps, list(1, "127.0.0.1:7100")), (TaskType::Worker, list(2, "127.0.0.1:7200"))])?;
    let token = ClusterToken::resolve(None)?;
    let strategy = ParameterServerStrategy::new(cluster, ParameterServerOptions::new(token))?;
    let model = strategy.scope(|s| Mlp::new(s.var_builder(), 64, &HIDDEN, 10))?; // variables on the ps tasks
    let coordinator = strategy.coordinator()?;

    let (train, test) = strata::digits::train_test_split(&strata::digits::load(None)?, 0.2, 0);
    let batch_size = 64;
    for epoch in 0..10u64 {
        let losses: Vec<_> = (0..train.len().div_ceil(batch_size))
            .map(|batch| coordinator.schedule::<Args, f32>(NAME, &Args { epoch, batch, batch_size }))
            .collect();
        coordinator.join()?; // every step ran once (a lost worker's steps ran elsewhere)
        let mean = losses.iter().map(|l| l.fetch()).sum::<Result<f32, _>>()? / losses.len() as f32;
        model.pull()?;
        let x = test.features_tensor(&Device::Cpu)?;
        let y = test.labels_tensor(&Device::Cpu)?;
        let accuracy = model.model().correct(&x, &y)? as f32 / test.len() as f32;
        println!("epoch {epoch}: loss {mean:.4}, test accuracy {:.2}%", accuracy * 100.0);
    }
    // The job is over: every ps task and worker stops serving and exits.
    for (task, answer) in strategy.finish_job("the coordinator finished training", Duration::from_secs(2)) {
        if let Err(e) = answer {
            eprintln!("{task} was not told that the job is over: {e}");
        }
    }
    Ok(())
}

//! A checkpoint written under ZeRO holds the whole optimizer state, gathered from every
//! replica's shard, as stage 0 writes it: the same tensors, bit for bit. So a job resumes at
//! any stage on any number of replicas: 4 replicas at stage 1 resumed on 2 at stage 2, and 2 at
//! stage 2 resumed on 4 at stage 0, end with the parameters of the same jobs run at stage 0
//! throughout, bit for bit.

use candle_nn::ParamsAdamW;
use strata::model::Mlp;
use strata::optim::FusedAdamW;
use strata::trainer::{CheckpointConfig, Task, TrainConfig, Trainer};
use strata::{CpuReduction, MirroredStrategy, Strategy, StrategyOptions, ZeroStage};

/// A model's values and its checkpoint's optimizer tensors, by name.
type Named = Vec<(String, Vec<f32>)>;

/// Trains the digits MLP under Mirrored over `replicas` at `stage`, resuming from the latest
/// checkpoint in `root` if there is one, for `max_steps` steps in all (or 2 epochs); returns
/// the parameters it ends with.
fn train(root: &std::path::Path, replicas: usize, stage: ZeroStage, max_steps: Option<usize>) -> Named {
    let (train, test) = strata::digits::train_test_split(&strata::digits::load(None).unwrap(), 0.2, 0);
    let devices = strata::device::logical_cpus(replicas).unwrap();
    let options = StrategyOptions { zero_stage: stage, ..Default::default() };
    let strategy = MirroredStrategy::with_options(devices, CpuReduction::default(), options).unwrap();
    // 2,410 trainable elements: uneven shards over 4 replicas.
    let model = strategy.scope(|s| Mlp::new(s.var_builder(), 64, &[32], 10)).unwrap();
    let opt = model.optimizer::<FusedAdamW>(ParamsAdamW { lr: 0.01, weight_decay: 0.1, ..Default::default() }).unwrap();
    let trainer = Trainer::new(TrainConfig {
        epochs: 2,
        global_batch: 96,
        checkpoint: Some(CheckpointConfig { dir: root.to_path_buf(), every_steps: 4, keep: 1 }),
        max_steps,
        ..Default::default()
    });
    let report = trainer.fit_checkpointed(&strategy, &model, &opt, &Task::classifier(), &train, &test).unwrap();
    let resumed_from = if max_steps.is_some() { 0 } else { 8 };
    assert_eq!(report.resumed_from_step, resumed_from, "{replicas} replicas at stage {stage}");
    let values = model.values().unwrap();
    values.into_iter().map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect()
}

/// The latest checkpoint's optimizer tensors under `root`.
fn optimizer_state(root: &std::path::Path) -> Named {
    let dir = strata::checkpoint::latest_checkpoint(root).unwrap().unwrap();
    let ck = strata::checkpoint::read_checkpoint(&dir).unwrap();
    let mut out: Named = ck
        .with_prefix("optimizer/")
        .into_iter()
        .map(|(n, t)| {
            (n, t.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap())
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// `replicas.0` replicas at `stages.0` for 8 steps, then `replicas.1` at `stages.1` to the end.
fn resumed(replicas: (usize, usize), stages: (ZeroStage, ZeroStage)) -> (Named, Named) {
    let root = tempfile::tempdir().unwrap();
    train(root.path(), replicas.0, stages.0, Some(8));
    let state = optimizer_state(root.path());
    (state, train(root.path(), replicas.1, stages.1, None))
}

#[test]
fn a_sharded_checkpoint_resumes_at_any_stage_on_another_number_of_replicas_bit_for_bit() {
    use ZeroStage::{Gradients, Off, OptimizerState};
    // 4 -> 2 replicas.
    let (whole_state, whole) = resumed((4, 2), (Off, Off));
    assert!(whole_state.iter().any(|(n, v)| n.starts_with("m.") && v.iter().any(|&x| x != 0.0)));
    let (state, sharded) = resumed((4, 2), (OptimizerState, Gradients));
    assert!(state == whole_state, "the stage 1 checkpoint's optimizer state is not stage 0's");
    assert!(sharded == whole, "4 replicas at stage 1 resumed on 2 at stage 2 differ from stage 0");
    // 2 -> 4 replicas, back to stage 0.
    let (whole_state, whole) = resumed((2, 4), (Off, Off));
    let (state, sharded) = resumed((2, 4), (Gradients, Off));
    assert!(state == whole_state, "the stage 2 checkpoint's optimizer state is not stage 0's");
    assert!(sharded == whole, "2 replicas at stage 2 resumed on 4 at stage 0 differ from stage 0");
}

//! A learning-rate schedule reads the optimizer steps applied so far: a run resumed from a
//! checkpoint goes on with the schedule at the checkpoint's step, not from its start, and
//! ends with the parameters of the same run uninterrupted, bit for bit.

use candle_nn::ParamsAdamW;
use strata::model::Mlp;
use strata::optim::schedule::LrSchedule;
use strata::optim::FusedAdamW;
use strata::trainer::{CheckpointConfig, Task, TrainConfig, Trainer};
use strata::{CpuReduction, MirroredStrategy, Strategy};

/// Trains the digits MLP under Mirrored(2) with a warm-up and cosine schedule over 16 steps,
/// checkpointing into `root` (and resuming from it) when given, for `max_steps` steps in all
/// (or 2 epochs); returns the parameters it ends with and the step it resumed from.
fn train(root: Option<&std::path::Path>, max_steps: Option<usize>) -> (Vec<Vec<f32>>, usize) {
    let (train, test) = strata::digits::train_test_split(&strata::digits::load(None).unwrap(), 0.2, 0);
    let devices = strata::device::logical_cpus(2).unwrap();
    let strategy = MirroredStrategy::with_options(devices, CpuReduction::default(), Default::default()).unwrap();
    let model = strategy.scope(|s| Mlp::new(s.var_builder(), 64, &[32], 10)).unwrap();
    let schedule = LrSchedule::WarmupCosine { peak: 0.02, warmup_steps: 4, total_steps: 16, final_lr: 0.0005 };
    let trainer = Trainer::new(TrainConfig {
        epochs: 2,
        global_batch: 180,
        checkpoint: root.map(|r| CheckpointConfig { dir: r.to_path_buf(), every_steps: 3, keep: 1 }),
        max_steps,
        ..Default::default()
    });
    let opt = model.optimizer::<FusedAdamW>(ParamsAdamW::default()).unwrap().with_schedule(schedule).unwrap();
    let report = trainer.fit_checkpointed(&strategy, &model, &opt, &Task::classifier(), &train, &test).unwrap();
    let values = model.values().unwrap();
    let values = values.into_iter().map(|(_, t)| t.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect();
    (values, report.resumed_from_step)
}

#[test]
fn a_resumed_run_follows_its_schedule_from_the_checkpoints_step() {
    let (whole, _) = train(None, None);
    let root = tempfile::tempdir().unwrap();
    // 6 of the 16 steps (two checkpoints: steps 3 and 6), then resumed to the end.
    train(Some(root.path()), Some(6));
    let (resumed, from) = train(Some(root.path()), None);
    assert_eq!(from, 6);
    assert_eq!(resumed, whole, "the resumed run ends on the uninterrupted run's parameters, bit for bit");
}

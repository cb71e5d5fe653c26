//! `strata::Elastic` around a hand-written loop, without a cluster: every call runs its
//! closure, `step` writes the checkpoints due, and `start` resumes from the latest, so that a
//! resumed loop ends bit for bit where an uninterrupted one does.

use strata::data::{Batch, TailPolicy};
use strata::elastic::{CheckpointConfig, Position};
use strata::model::{Classifier, Mlp};
use strata::optim::FusedAdamW;
use strata::prelude::*;

/// Trains the steps `at.step..steps` of a loop of `Elastic::step`s (checkpoints every 4 steps
/// in `dir`, resuming from the latest there); the parameters and where `start` began.
fn hand_loop(dir: &std::path::Path, steps: usize) -> (Vec<Vec<f32>>, Position) {
    let strategy = MirroredStrategy::logical_cpus(2).unwrap();
    let (train, _) = strata::digits::train_test_split(&strata::digits::load(None).unwrap(), 0.2, 0);
    let batches: Vec<Batch> = (0..steps).map(|i| train.slice(i * 64..(i + 1) * 64)).collect();
    let model = strategy.scope(|s| Mlp::new(s.var_builder(), 64, &[32], 10)).unwrap();
    let opt = model.optimizer::<FusedAdamW>(candle_nn::ParamsAdamW { lr: 1e-2, ..Default::default() }).unwrap();
    let checkpoints = CheckpointConfig { dir: dir.to_path_buf(), every_steps: 4, keep: 2 };
    let elastic = Elastic::new(&strategy, &model, &opt).unwrap().with_steps_per_epoch(5).with_checkpoints(checkpoints);
    assert!(!elastic.is_elastic());
    let begun = elastic.start().unwrap();
    let mut at = begun;
    while at.step < steps {
        let step = || {
            let batch = strategy.distribute_dataset([batches[at.step].clone()], TailPolicy::Split).next().unwrap();
            strategy.run_batch(&batch, |ctx, shard| {
                let x = shard.batch.features_tensor(ctx.candle_device())?;
                let y = shard.batch.labels_tensor(ctx.candle_device())?;
                ctx.backward_and_sync(&model.on(ctx)?.loss(&x, &y)?, &opt)
            })
        };
        match elastic.step(at, step).unwrap() {
            Stepped::Done(_) => at.step += 1,
            Stepped::Moved(p) => panic!("no cluster, no change of membership: moved to {p:?}"),
        }
    }
    assert!(matches!(elastic.finish(at).unwrap(), Stepped::Done(())));
    let params = model.values().unwrap().iter().map(|(_, t)| t.flatten_all().unwrap().to_vec1().unwrap()).collect();
    (params, begun)
}

#[test]
fn a_hand_written_loop_resumes_from_its_checkpoints_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let (whole, begun) = hand_loop(&tmp.path().join("whole"), 10);
    assert_eq!(begun, Position::default());
    // The checkpoints due: steps 4 and 8 (a stop after step 9 leaves the one of step 8).
    let resumed_dir = tmp.path().join("resumed");
    let (_, _) = hand_loop(&resumed_dir, 9);
    assert_eq!(strata::checkpoint::read_latest(&resumed_dir).unwrap().unwrap().step, 8);
    let (resumed, begun) = hand_loop(&resumed_dir, 10);
    assert_eq!(begun, Position { step: 8, ended: 1 }, "5 steps an epoch: the first one ended");
    assert_eq!(resumed, whole, "a resumed loop ends where an uninterrupted one does");
}

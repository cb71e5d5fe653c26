//! A trainer checkpoint is verified whole at restore: every byte of every file a restore reads
//! (`latest`, the manifest, its checksum, the safetensors file), flipped in turn, makes
//! `Trainer::fit_checkpointed` refuse to resume, naming the checkpoint; the untouched
//! checkpoint resumes.

use candle_nn::ParamsAdamW;
use strata::model::Mlp;
use strata::optim::FusedAdamW;
use strata::prelude::*;
use strata::trainer::{CheckpointConfig, Task, TrainConfig, Trainer};

#[test]
fn every_flipped_byte_of_a_trainer_checkpoint_is_refused_at_restore() {
    let root = tempfile::tempdir().unwrap();
    let (train, test) = strata::digits::train_test_split(&strata::digits::load(None).unwrap(), 0.2, 0);
    let strategy = OneDeviceStrategy::cpu().unwrap();
    let model = strategy.scope(|s| Mlp::new(s.var_builder(), 64, &[4], 10)).unwrap();
    let opt = model.optimizer::<FusedAdamW>(ParamsAdamW { lr: 0.007, ..Default::default() }).unwrap();
    let trainer = |epochs| {
        Trainer::new(TrainConfig {
            epochs,
            global_batch: 256,
            checkpoint: Some(CheckpointConfig { dir: root.path().to_path_buf(), every_steps: 3, keep: 1 }),
            ..Default::default()
        })
    };
    let first = trainer(1).fit_checkpointed(&strategy, &model, &opt, &Task::classifier(), &train, &test).unwrap();
    assert_eq!((first.steps, first.resumed_from_step), (6, 0));

    let dir = strata::checkpoint::latest_checkpoint(root.path()).unwrap().unwrap();
    let mut files = vec![root.path().join(strata::checkpoint::LATEST)];
    files.extend(std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()));
    files.sort();
    assert_eq!(files.len(), 4, "{files:?}");
    let mut refused = 0;
    for file in &files {
        let original = std::fs::read(file).unwrap();
        for at in 0..original.len() {
            let mut bytes = original.clone();
            bytes[at] ^= 0x01;
            std::fs::write(file, &bytes).unwrap();
            match trainer(2).fit_checkpointed(&strategy, &model, &opt, &Task::classifier(), &train, &test) {
                Ok(r) => panic!("{}: byte {at} flipped, resumed from step {}", file.display(), r.resumed_from_step),
                Err(e) => {
                    let m = e.to_string();
                    assert!(m.starts_with("checkpoint: ") && m.contains(&root.path().display().to_string()), "{m}");
                    refused += 1;
                }
            }
        }
        std::fs::write(file, &original).unwrap();
    }
    let total: usize = files.iter().map(|f| std::fs::metadata(f).unwrap().len() as usize).sum();
    assert_eq!(refused, total);
    let resumed = trainer(2).fit_checkpointed(&strategy, &model, &opt, &Task::classifier(), &train, &test).unwrap();
    assert_eq!((resumed.resumed_from_step, resumed.steps), (6, 6), "the untouched checkpoint resumes");
}

/// A directory this process cannot write: mode 0555 for a user, `/sys/kernel` (sysfs) for
/// root, whom file modes do not stop.
fn unwritable_dir(tmp: &std::path::Path) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = tmp.join("read-only");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
    if std::fs::File::create(dir.join("probe")).is_ok() {
        return std::path::PathBuf::from("/sys/kernel");
    }
    dir
}

#[test]
fn a_checkpoint_directory_that_cannot_be_written_fails_before_training() {
    let (train, test) = strata::digits::train_test_split(&strata::digits::load(None).unwrap(), 0.2, 0);
    let strategy = OneDeviceStrategy::cpu().unwrap();
    let model = strategy.scope(|s| Mlp::new(s.var_builder(), 64, &[4], 10)).unwrap();
    let opt = model.optimizer::<FusedAdamW>(ParamsAdamW::default()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = unwritable_dir(tmp.path());
    let trainer = Trainer::new(TrainConfig {
        epochs: 1,
        checkpoint: Some(CheckpointConfig { dir: dir.clone(), every_steps: 100, keep: 1 }),
        ..Default::default()
    });
    let e = trainer.fit_checkpointed(&strategy, &model, &opt, &Task::classifier(), &train, &test).unwrap_err();
    assert_eq!(e.exit_code(), 2, "{e}");
    assert!(e.to_string().contains(&dir.display().to_string()) && e.to_string().contains("cannot write"), "{e}");
    let zero = Trainer::new(TrainConfig { epochs: 0, ..Default::default() });
    let e = zero.fit(&strategy, &model, &opt, &Task::classifier(), &train, &test).unwrap_err();
    assert_eq!((e.exit_code(), e.to_string().as_str()), (2, "0 epochs train nothing: train for 1 epoch or more"));
}

//! `Trainer::fit` over a user's own model (a small CNN on the digits' 8x8 images, not the
//! shipped MLP): under Mirrored(2) it ends on one device's parameters and metrics (accuracy,
//! loss, perplexity and a metric of the user's own); evaluation split over replicas equals
//! evaluation on one device; checkpoints land every N steps; clipping, accumulation and
//! schedules set in the configuration train as one device does.

use candle_core::{Device, Tensor};
use candle_nn::{Module, ParamsAdamW};
use strata::data::{Batch, BatchData};
use strata::optim::schedule::LrSchedule;
use strata::optim::{FusedAdamW, FusedSgd};
use strata::prelude::*;
use strata::trainer::{Accuracy, Loss, Metric, MetricValue, Outputs, Perplexity, Task, TrainConfig, Trainer};
use strata::Scope;

/// The user's model: conv2d(1 -> 4, 3x3) -> relu -> max-pool 2 -> linear(36 -> 10).
struct DigitCnn {
    conv: candle_nn::Conv2d,
    fc: candle_nn::Linear,
}

impl DigitCnn {
    fn new(sc: &Scope) -> candle_core::Result<Self> {
        let vb = sc.var_builder();
        Ok(Self {
            conv: candle_nn::conv2d(1, 4, 3, Default::default(), vb.pp("conv"))?,
            fc: candle_nn::linear(36, 10, vb.pp("fc"))?,
        })
    }

    fn logits(&self, b: &Batch, dev: &Device) -> candle_core::Result<Tensor> {
        let x = Tensor::from_slice(&b.features, (b.len(), 1, 8, 8), dev)?;
        self.fc.forward(&self.conv.forward(&x)?.relu()?.max_pool2d(2)?.flatten_from(1)?)
    }
}

/// A metric of the user's own: the mean probability the model gives the right class.
struct Confidence;

impl Metric for Confidence {
    fn name(&self) -> &str {
        "confidence"
    }
    fn measure(&self, batch: &Batch, o: &Outputs) -> strata::CoreResult<(f64, f64)> {
        let logits = o.logits.as_ref().expect("the task returns logits");
        let p = candle_nn::ops::softmax_last_dim(logits)?.to_vec2::<f32>()?;
        let total: f64 = p.iter().zip(&batch.labels).map(|(row, &y)| row[y as usize] as f64).sum();
        Ok((total, batch.len() as f64))
    }
}

fn task<'a>() -> Task<'a, DigitCnn> {
    Task::new(|m: &DigitCnn, ctx, b: &Batch| {
        let y = b.labels_tensor(ctx.candle_device())?;
        Ok(candle_nn::loss::cross_entropy(&m.logits(b, ctx.candle_device())?, &y)?)
    })
    .with_outputs(|m: &DigitCnn, ctx, b: &Batch| {
        Outputs::classification(m.logits(b, ctx.candle_device())?, b.labels_tensor(ctx.candle_device())?)
    })
    .with_metrics(vec![Box::new(Accuracy), Box::new(Loss), Box::new(Perplexity), Box::new(Confidence)])
}

fn digits() -> (Batch, Batch) {
    let all = strata::digits::load(None).unwrap();
    let (train, test) = strata::digits::train_test_split(&all, 0.2, 0);
    // 322 training examples (the last batch of 64 has 2 rows, one per replica), 97 test examples.
    (train.slice(0..322), test.slice(0..97))
}

type Params = Vec<(String, Vec<f32>)>;

fn params<M>(m: &strata::Replicated<M>) -> Params {
    m.values().unwrap().into_iter().map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect()
}

fn max_rel_diff(a: &Params, b: &Params) -> f32 {
    let mut worst = 0f32;
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        let num = va.iter().zip(vb).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
        worst = worst.max(num / va.iter().map(|x| x.abs()).fold(0.0, f32::max).max(1e-6));
    }
    worst
}

/// Fits the CNN under `s` with `config`; returns its parameters, the last epoch's metrics and
/// the optimizer's steps.
fn fit(s: &impl Strategy, config: TrainConfig) -> (Params, Vec<MetricValue>, Vec<f32>, u64) {
    let (train, test) = digits();
    let model = s.scope(DigitCnn::new).unwrap();
    let trainer = Trainer::new(config);
    let opt = trainer.optimizer::<_, FusedAdamW>(&model, ParamsAdamW { lr: 0.01, ..Default::default() }).unwrap();
    let report = trainer.fit(s, &model, &opt, &task(), &train, &test).unwrap();
    let losses = report.epochs.iter().map(|e| e.train_loss).collect();
    (params(&model), report.final_metrics, losses, opt.iterations())
}

fn config() -> TrainConfig {
    TrainConfig { epochs: 2, global_batch: 64, seed: 3, ..Default::default() }
}

fn assert_same_metrics(want: &[MetricValue], got: &[MetricValue]) {
    assert_eq!(want.len(), got.len());
    for (w, g) in want.iter().zip(got) {
        assert_eq!(w.name, g.name);
        let d = (w.value - g.value).abs() / w.value.abs().max(1e-6);
        assert!(d <= 1e-5, "{}: {} against one device's {}", w.name, g.value, w.value);
    }
}

#[test]
fn a_users_model_under_mirrored_2_ends_as_one_device() {
    let (want, want_metrics, want_losses, want_steps) = fit(&OneDeviceStrategy::cpu().unwrap(), config());
    let (got, got_metrics, got_losses, got_steps) = fit(&MirroredStrategy::logical_cpus(2).unwrap(), config());
    let d = max_rel_diff(&want, &got);
    assert!(d <= 1e-5, "parameters: relative difference {d} from one device");
    assert_eq!((want_steps, got_steps), (12, 12), "6 steps per epoch, the last of two examples");
    let names: Vec<&str> = got_metrics.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["accuracy", "loss", "perplexity", "confidence"]);
    assert_same_metrics(&want_metrics, &got_metrics);
    for (w, g) in want_losses.iter().zip(&got_losses) {
        assert!((w - g).abs() <= 1e-5 * w.abs(), "training loss {g} against one device's {w}");
    }
    // Perplexity is exp of the mean loss; accuracy a count over 97 rows.
    let value = |n: &str| got_metrics.iter().find(|m| m.name == n).unwrap().value;
    assert!((value("perplexity") - value("loss").exp()).abs() <= 1e-4 * value("perplexity"));
    let correct = value("accuracy") * 97.0;
    assert!((correct - correct.round()).abs() < 1e-6, "accuracy {} is not a count over 97", value("accuracy"));
}

#[test]
fn evaluation_split_over_replicas_is_the_whole_sets() {
    // 97 rows in batches of 10 over 3 replicas: shards of 4, 3 and 3, and a last batch of 7.
    let (_, test) = digits();
    let trainer = Trainer::new(TrainConfig { global_batch: 10, ..Default::default() });
    let mut results = Vec::new();
    for s in [OneDeviceStrategy::cpu().unwrap().handle(), MirroredStrategy::logical_cpus(3).unwrap().handle()] {
        let model = s.scope(DigitCnn::new).unwrap();
        results.push(trainer.evaluate(&s, &model, &task(), &test).unwrap());
    }
    assert_same_metrics(&results[0], &results[1]);
    // By hand on one device: the mean cross-entropy of the whole set.
    let model = OneDeviceStrategy::cpu().unwrap().scope(DigitCnn::new).unwrap();
    let logits = model.primary().logits(&test, &Device::Cpu).unwrap();
    let loss = candle_nn::loss::cross_entropy(&logits, &test.labels_tensor(&Device::Cpu).unwrap()).unwrap();
    let loss = loss.to_scalar::<f32>().unwrap() as f64;
    let got = results[1].iter().find(|m| m.name == "loss").unwrap().value;
    assert!((got - loss).abs() <= 1e-5 * loss, "loss {got}, the whole set's {loss}");
}

#[test]
fn clipping_accumulation_and_schedules_as_options_train_as_one_device() {
    let c = TrainConfig {
        clip_global_norm: Some(0.5),
        accumulation: 2,
        schedule: Some(LrSchedule::WarmupCosine { peak: 0.02, warmup_steps: 2, total_steps: 6, final_lr: 0.001 }),
        ..config()
    };
    let (want, want_metrics, _, want_steps) = fit(&OneDeviceStrategy::cpu().unwrap(), c.clone());
    let (got, got_metrics, _, got_steps) = fit(&MirroredStrategy::logical_cpus(2).unwrap(), c);
    // 12 batches of two micro-batches each: 6 optimizer steps.
    assert_eq!((want_steps, got_steps), (6, 6));
    let d = max_rel_diff(&want, &got);
    assert!(d <= 1e-5, "relative difference {d} from one device");
    assert_same_metrics(&want_metrics, &got_metrics);
}

#[test]
fn checkpoints_every_n_steps() {
    let dir = tempfile::tempdir().unwrap();
    let (train, test) = digits();
    let s = MirroredStrategy::logical_cpus(2).unwrap();
    let model = s.scope(DigitCnn::new).unwrap();
    let trainer = Trainer::new(TrainConfig {
        checkpoint: Some(strata::trainer::CheckpointConfig { dir: dir.path().into(), every_steps: 4, keep: 10 }),
        ..config()
    });
    let opt = trainer.optimizer::<_, FusedSgd>(&model, 0.1).unwrap();
    trainer.fit_checkpointed(&s, &model, &opt, &task(), &train, &test).unwrap();
    let mut steps: Vec<u64> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("ckpt-")?.parse().ok())
        .collect();
    steps.sort();
    // Every 4 steps of 12, and after the last.
    assert_eq!(steps, [4, 8, 12]);
    // Accumulation must keep checkpoints on optimizer steps.
    let trainer = Trainer::new(TrainConfig {
        accumulation: 3,
        checkpoint: Some(strata::trainer::CheckpointConfig { dir: dir.path().into(), every_steps: 4, keep: 10 }),
        ..config()
    });
    let opt = trainer.optimizer::<_, FusedSgd>(&model, 0.1).unwrap();
    let e = trainer.fit_checkpointed(&s, &model, &opt, &task(), &train, &test).unwrap_err().to_string();
    assert!(e.contains("multiples of 3") && !e.contains('\n'), "{e}");
}

#[test]
fn a_metric_without_what_it_needs_is_a_one_line_error() {
    let (_, test) = digits();
    let s = OneDeviceStrategy::cpu().unwrap();
    let model = s.scope(DigitCnn::new).unwrap();
    let only_loss = Task::new(|m: &DigitCnn, ctx, b: &Batch| {
        let y = b.labels_tensor(ctx.candle_device())?;
        Ok(candle_nn::loss::cross_entropy(&m.logits(b, ctx.candle_device())?, &y)?)
    })
    .with_metrics(vec![Box::new(Loss), Box::new(Accuracy)]);
    let e = Trainer::default().evaluate(&s, &model, &only_loss, &test).unwrap_err().to_string();
    assert!(e.contains("accuracy metric needs logits and targets") && !e.contains('\n'), "{e}");
}

/// The same digits as `(images (N, 1, 8, 8) f32, labels (N,) u32)` tensors.
type Images = (Tensor, Tensor);

fn as_images(b: &Batch) -> Images {
    let x = Tensor::from_slice(&b.features, (b.len(), 1, 8, 8), &Device::Cpu).unwrap();
    (x, b.labels_tensor(&Device::Cpu).unwrap())
}

fn image_task<'a>() -> Task<'a, DigitCnn, Images> {
    let logits = |m: &DigitCnn, x: &Tensor| m.fc.forward(&m.conv.forward(x)?.relu()?.max_pool2d(2)?.flatten_from(1)?);
    Task::new(move |m: &DigitCnn, ctx, b: &Images| {
        let (x, y) = b.to_device(ctx.candle_device())?;
        Ok(candle_nn::loss::cross_entropy(&logits(m, &x)?, &y)?)
    })
    .with_outputs(move |m: &DigitCnn, ctx, b: &Images| {
        let (x, y) = b.to_device(ctx.candle_device())?;
        Outputs::classification(logits(m, &x)?, y)
    })
    .with_metrics(vec![Box::new(Accuracy), Box::new(Loss), Box::new(Perplexity)])
}

#[test]
fn tensor_batches_train_as_the_same_rows_in_a_batch_do() {
    // Trainer::fit over a tuple of tensors (any BatchData): the same shuffles, splits and
    // steps as over `Batch`, so the same parameters and metrics, on one device, Mirrored(2) and
    // CentralStorage(2).
    let (train, test) = digits();
    let (train_t, test_t) = (as_images(&train), as_images(&test));
    let one = OneDeviceStrategy::cpu().unwrap();
    let (want, want_metrics, _, _) = fit(&one, config());
    let central = CentralStorageStrategy::logical_cpus(2).unwrap();
    for s in [one.handle(), MirroredStrategy::logical_cpus(2).unwrap().handle(), central.handle()] {
        let model = s.scope(DigitCnn::new).unwrap();
        let trainer = Trainer::new(config());
        let opt = trainer.optimizer::<_, FusedAdamW>(&model, ParamsAdamW { lr: 0.01, ..Default::default() }).unwrap();
        let report = trainer.fit(&s, &model, &opt, &image_task(), &train_t, &test_t).unwrap();
        assert_eq!((report.steps, report.skipped_examples, opt.iterations()), (12, 0, 12));
        let d = max_rel_diff(&want, &params(&model));
        assert!(d <= 1e-5, "{}: relative difference {d} from Batch rows on one device", s.extended().name());
        assert_same_metrics(&want_metrics[..3], &report.final_metrics);
    }
    // Parts that disagree on their rows: one line, before any step.
    let bad = (train_t.0.clone(), test_t.1.clone());
    let model = one.scope(DigitCnn::new).unwrap();
    let trainer = Trainer::new(config());
    let opt = trainer.optimizer::<_, FusedSgd>(&model, 0.1).unwrap();
    let e = trainer.fit(&one, &model, &opt, &image_task(), &bad, &test_t).unwrap_err().to_string();
    assert!(e.contains("part 0 has 322 rows but part 1 has 97") && !e.contains('\n'), "{e}");
    assert_eq!(opt.iterations(), 0);
}

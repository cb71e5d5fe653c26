//! What a training loop adds to an optimizer step, under every strategy, against one device's
//! reference computation written out by hand: gradient clipping by global norm (on the reduced
//! gradient), gradient accumulation over micro-batches (one step on their concatenation) and
//! learning-rate schedules.

use crate::common;

use crate::common::max_rel_diff;
use crate::common::models::{data, Cnn, Heads, TestModel};
use candle_core::backprop::GradStore;
use candle_nn::{AdamW, Optimizer, ParamsAdamW, SGD};
use strata_core::data::{Batch, DistributedBatch, TailPolicy};
use strata_core::optim::schedule::LrSchedule;
use strata_core::{DistributedOptimizer, Error, Strategy, StrategyHandle};

type Params = Vec<(String, Vec<f32>)>;

fn values<M>(m: &strata_core::Replicated<M>) -> Params {
    m.values().unwrap().into_iter().map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect()
}

/// Trains `M` under `s` on `batches` with the optimizer `make` builds; returns the values.
fn train<M: TestModel, O: Optimizer + Send>(
    s: &impl Strategy,
    batches: Vec<Batch>,
    make: impl Fn(&strata_core::Replicated<M>) -> DistributedOptimizer<O>,
) -> (Params, u64) {
    let model = s.scope(M::build).unwrap();
    let opt = make(&model);
    for (step, db) in s.distribute_dataset(batches, TailPolicy::Split).enumerate() {
        s.run_batch(&db, |ctx, shard| {
            let loss = model.on(ctx)?.loss(step, &shard.batch, ctx.candle_device())?;
            ctx.backward_and_sync(&loss, &opt)
        })
        .unwrap();
    }
    (values(&model), opt.iterations())
}

/// One device by hand: for each batch, the gradient of the whole batch's loss, `edit`ed
/// (clipped, say) with the step number, then plain candle-nn SGD at `lr(step)`.
fn reference<M: TestModel>(
    batches: &[Batch],
    lr: impl Fn(usize) -> f64,
    edit: impl Fn(usize, &[(String, candle_core::Var)], &mut GradStore),
) -> Params {
    let one = common::one_device();
    let model = one.scope(M::build).unwrap();
    let vars = model.variables(0).to_vec();
    let mut sgd = SGD::new(vars.iter().map(|(_, v)| v.clone()).collect(), 0.0).unwrap();
    for (step, b) in batches.iter().enumerate() {
        let loss = model.primary().loss(step, b, &candle_core::Device::Cpu).unwrap();
        let mut grads = loss.backward().unwrap();
        edit(step, &vars, &mut grads);
        sgd.set_learning_rate(lr(step));
        sgd.step(&grads).unwrap();
    }
    values(&model)
}

const MAX_NORM: f64 = 0.3;

strategy_test!(clipping_by_global_norm_is_one_device_clipping, |s: StrategyHandle| {
    let batches: Vec<Batch> = (0..6).map(|k| data(30, 36, 40 + k)).collect();
    let (got, _) = train::<Cnn, SGD>(&s, batches.clone(), |m| {
        m.optimizer::<SGD>(0.5).unwrap().with_clip_global_norm(MAX_NORM).unwrap()
    });
    let clipped = std::sync::atomic::AtomicUsize::new(0);
    let want = reference::<Cnn>(
        &batches,
        |_| 0.5,
        |_, vars, grads| {
            let mut sq = 0f64;
            for (_, v) in vars {
                if let Some(g) = grads.get(v) {
                    sq += g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64;
                }
            }
            let norm = sq.sqrt();
            if norm > MAX_NORM {
                clipped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                for (_, v) in vars {
                    if let Some(g) = grads.remove(v) {
                        grads.insert(v, (g * (MAX_NORM / norm)).unwrap());
                    }
                }
            }
        },
    );
    assert!(clipped.into_inner() > 0, "the norm must bind in some step");
    let d = max_rel_diff(&want, &got);
    assert!(d <= 1e-5, "relative difference {d} from one device clipping its global batch's gradient");
});

strategy_test!(accumulation_is_one_step_on_the_concatenated_batch, |s: StrategyHandle| {
    // Three optimizer steps of three micro-batches of 10, 10 and 7 examples (uneven), with
    // AdamW: the step count (bias correction) must be 3, and the result that of 27-example
    // steps.
    let micro: Vec<Batch> = (0..9).map(|k| data(if k % 3 == 2 { 7 } else { 10 }, 6, 60 + k)).collect();
    let cfg = ParamsAdamW { lr: 0.02, weight_decay: 0.1, ..Default::default() };
    // Heads in phase 0 throughout (the step number is the micro-batch's; even ones only).
    let model_steps = |batches: Vec<Batch>, accumulate: usize| {
        let s2 = &s;
        let model = s2.scope(Heads::build).unwrap();
        let opt = model.optimizer::<AdamW>(cfg.clone()).unwrap().with_accumulation(accumulate).unwrap();
        for db in s2.distribute_dataset(batches, TailPolicy::Split) {
            s2.run_batch(&db, |ctx, shard| {
                let loss = model.on(ctx)?.loss(0, &shard.batch, ctx.candle_device())?;
                ctx.backward_and_sync(&loss, &opt)
            })
            .unwrap();
        }
        (values(&model), opt.iterations())
    };
    let (got, steps) = model_steps(micro.clone(), 3);
    assert_eq!(steps, 3);
    let concatenated: Vec<Batch> = micro
        .chunks(3)
        .map(|c| {
            let mut b = c[0].clone();
            for p in &c[1..] {
                b.features.extend_from_slice(&p.features);
                b.labels.extend_from_slice(&p.labels);
            }
            b
        })
        .collect();
    let one = common::one_device();
    let model = one.scope(Heads::build).unwrap();
    let opt = model.optimizer::<AdamW>(cfg.clone()).unwrap();
    for b in &concatenated {
        let db = DistributedBatch::split(b, 1).unwrap();
        one.run_batch(&db, |ctx, shard| {
            let loss = model.on(ctx)?.loss(0, &shard.batch, ctx.candle_device())?;
            ctx.backward_and_sync(&loss, &opt)
        })
        .unwrap();
    }
    let d = max_rel_diff(&values(&model), &got);
    assert!(d <= 1e-5, "relative difference {d} from one step on the concatenated batches");
});

strategy_test!(a_schedule_sets_every_steps_rate_on_every_copy, |s: StrategyHandle| {
    let batches: Vec<Batch> = (0..8).map(|k| data(30, 6, 80 + k)).collect();
    let schedule = LrSchedule::WarmupCosine { peak: 0.4, warmup_steps: 3, total_steps: 7, final_lr: 0.05 };
    let model = s.scope(Heads::build).unwrap();
    let opt = model.optimizer::<SGD>(1.0).unwrap().with_schedule(schedule).unwrap();
    for (step, db) in s.distribute_dataset(batches.clone(), TailPolicy::Split).enumerate() {
        s.run_batch(&db, |ctx, shard| {
            let loss = model.on(ctx)?.loss(step, &shard.batch, ctx.candle_device())?;
            ctx.backward_and_sync(&loss, &opt)
        })
        .unwrap();
    }
    // The closed form, written out: 0.4 * k / 3 for k < 3, then the cosine from 0.4 to 0.05
    // over steps 3..7, then 0.05.
    let lr = |k: usize| -> f64 {
        if k < 3 {
            0.4 * k as f64 / 3.0
        } else {
            let p = ((k - 3) as f64 / 4.0).min(1.0);
            0.05 + 0.35 * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
        }
    };
    let want = reference::<Heads>(&batches, lr, |_, _, _| {});
    let d = max_rel_diff(&want, &values(&model));
    assert!(d <= 1e-5, "relative difference {d} from one device's scheduled SGD");
    for c in 0..opt.num_copies() {
        assert!((opt.lock(c).learning_rate() - 0.05).abs() < 1e-12, "copy {c} ends at the final rate");
    }
    assert_eq!(opt.iterations(), 8);
});

#[test]
fn bad_settings_are_one_line_errors() {
    let s = common::mirrored(2);
    let model = s.scope(Heads::build).unwrap();
    let e = model.optimizer::<SGD>(0.1).unwrap().with_clip_global_norm(0.0).unwrap_err();
    assert!(matches!(e, Error::OptimizerSetting { .. }) && e.to_string().contains("above 0"), "{e}");
    let e = model.optimizer::<SGD>(0.1).unwrap().with_accumulation(0).unwrap_err();
    assert!(e.to_string().contains("accumulate over 1 or more"), "{e}");
    let bad = LrSchedule::WarmupLinear { peak: 0.1, warmup_steps: 10, total_steps: 4, final_lr: 0.0 };
    let e = model.optimizer::<SGD>(0.1).unwrap().with_schedule(bad).unwrap_err();
    assert!(matches!(e, Error::InvalidSchedule { .. }) && !e.to_string().contains('\n'), "{e}");
}

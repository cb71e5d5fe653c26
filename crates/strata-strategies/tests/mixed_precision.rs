//! Mixed precision under every strategy: variables stay f32 and get f32 gradients while the
//! model computes in 16 bits; fp16's dynamic loss scaling skips exactly the steps whose
//! gradient overflows, on every replica alike (closed-form counts), at ZeRO stages 1 to 3 too,
//! where only one replica's shard overflows; bf16 training ends near one device's.

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use strata_core::data::{Batch, DistributedBatch};
use strata_core::optim::{FusedAdamW, FusedSgd};
use strata_core::{cast_like, LossScale, Precision, Replicated, Strategy, StrategyHandle, StrategyOptions, ZeroStage};
use strata_strategies::{CpuReduction, MirroredStrategy};

/// `w1` (4 x 1) computes in fp16 towards a target of 100, far enough that the scaled gradient
/// of its output overflows fp16 until the scale is small; `w2` (4 x 1) in f32 towards 1. With
/// even shards over two replicas, replica 0 holds `w1` and replica 1 `w2`.
struct Overflowing {
    w1: Tensor,
    w2: Tensor,
}

impl Overflowing {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        let w1 = vb.get_with_hints((4, 1), "a.w", candle_nn::Init::Const(0.0))?;
        let w2 = vb.get_with_hints((4, 1), "b.w", candle_nn::Init::Const(0.0))?;
        Ok(Self { w1, w2 })
    }

    /// The mean over the rows of `(x w1 - 100)^2` (x w1 in fp16) plus `(x w2 - 1)^2`.
    fn loss(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x16 = Precision::Fp16.cast(x)?;
        let y = x16.matmul(&cast_like(&self.w1, &x16)?)?.to_dtype(DType::F32)?;
        let z = x.matmul(&self.w2)?;
        (y - 100.0)?.sqr()?.mean_all()? + (z - 1.0)?.sqr()?.mean_all()?
    }
}

/// `rows` rows of four ones.
fn ones_batch(rows: usize) -> Batch {
    Batch::new(vec![1.0; rows * 4], vec![0; rows], 4).unwrap()
}

/// The steps skipped before the first applied one, in closed form: each row's scaled
/// gradient of the output, `scale * 2 * 100 / rows`, fits fp16, but `w1`'s, summed over the
/// replica's rows, is `scale * 200` whatever the rows, and overflows fp16 (65,504; from 65,520
/// it rounds to infinity) until the scale is halved to 256: seven skipped steps.
fn expected_skips() -> u32 {
    (0..16).find(|k| 32_768.0 / 2f64.powi(*k as i32) * 200.0 <= 65_504.0).unwrap()
}

fn values<M>(m: &Replicated<M>) -> Vec<Vec<Vec<f32>>> {
    (0..m.num_copies())
        .map(|c| m.variables(c).iter().map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap()).collect())
        .collect()
}

/// Trains [`Overflowing`] with loss-scaled SGD for `steps` steps of 24 rows; checks after each
/// step that skipped steps changed nothing, applied ones changed the parameters, every copy
/// holds the same values and the same scale. Returns the skipped steps and the final scale.
fn train_scaled(s: &impl Strategy, steps: usize) -> (u64, f64) {
    let model = s.scope(|sc| Overflowing::new(sc.var_builder())).unwrap();
    let opt = model.optimizer::<FusedSgd>(1e-3).unwrap().with_loss_scale(LossScale::default()).unwrap();
    let global = ones_batch(24);
    let mut before = values(&model);
    for step in 0..steps {
        let skipped_before = opt.loss_scale_state().unwrap().skipped_steps;
        let db = DistributedBatch::split(&global, s.num_replicas_in_sync()).unwrap();
        s.run_batch(&db, |ctx, shard| {
            let x = shard.batch.features_tensor(ctx.candle_device())?;
            let loss = model.on(ctx)?.loss(&x)?;
            ctx.backward_and_sync(&loss, &opt)?;
            Ok(())
        })
        .unwrap();
        let state = opt.loss_scale_state().unwrap();
        let after = values(&model);
        for c in 1..after.len() {
            assert!(after[c] == after[0], "step {step}: copy {c} differs from copy 0");
        }
        if state.skipped_steps > skipped_before {
            assert!(after == before, "step {step} was skipped but changed the parameters");
        } else {
            assert!(after != before, "step {step} was applied but changed nothing");
        }
        assert!(after.iter().flatten().flatten().all(|v| v.is_finite()), "step {step}: a parameter is not finite");
        before = after;
    }
    let state = opt.loss_scale_state().unwrap();
    (state.skipped_steps, state.scale)
}

strategy_test!(fp16_loss_scaling_skips_the_same_steps_on_every_replica, |s: StrategyHandle| {
    // 24 rows over 1, 2, 3 or 4 replicas: 24, 12, 8 or 6 rows each, the same skips.
    let k = expected_skips();
    assert_eq!(k, 7);
    let (skipped, scale) = train_scaled(&s, k as usize + 3);
    assert_eq!(skipped, u64::from(k), "{} replicas", s.num_replicas_in_sync());
    assert_eq!(scale, 32_768.0 / 2f64.powi(k as i32), "halved once per skipped step, not grown");
});

fn mirrored_at(n: usize, stage: ZeroStage) -> StrategyHandle {
    let devices = strata_core::device::logical_cpus(n).unwrap();
    let options = StrategyOptions { zero_stage: stage, ..Default::default() };
    MirroredStrategy::with_options(devices, CpuReduction::default(), options).unwrap().handle()
}

/// Under ZeRO, Mirrored(2) steps `w1` on replica 0 and `w2` on replica 1: only replica 0's
/// shard of the gradient overflows, and replica 1 skips the same steps.
#[test]
fn under_zero_a_step_is_skipped_everywhere_when_one_shard_overflows() {
    let k = expected_skips();
    for stage in [ZeroStage::OptimizerState, ZeroStage::Gradients, ZeroStage::Parameters] {
        let (skipped, scale) = train_scaled(&mirrored_at(2, stage), k as usize + 3);
        assert_eq!((skipped, scale), (u64::from(k), 32_768.0 / 2f64.powi(k as i32)), "{stage:?}");
    }
}

/// The scale grows after `growth_interval` finite steps and is saved with the optimizer's
/// state: a copy of the optimizer loaded from it scales as the original does.
#[test]
fn the_scale_grows_after_the_interval_and_travels_with_the_state() {
    let s = common::mirrored(2);
    let model = s.scope(|sc| Overflowing::new(sc.var_builder())).unwrap();
    let scale = LossScale { initial: 1.0, growth_interval: 2, factor: 2.0 };
    let opt = model.optimizer::<FusedAdamW>(Default::default()).unwrap().with_loss_scale(scale).unwrap();
    for _ in 0..5 {
        let db = DistributedBatch::split(&ones_batch(8), 2).unwrap();
        s.run_batch(&db, |ctx, shard| {
            let x = shard.batch.features_tensor(ctx.candle_device())?;
            ctx.backward_and_sync(&model.on(ctx)?.loss(&x)?, &opt)
        })
        .unwrap();
    }
    // 1 -> 2 after two finite steps, -> 4 after four; the fifth leaves one in the count.
    let state = opt.loss_scale_state().unwrap();
    assert_eq!((state.scale, state.good_steps, state.skipped_steps), (4.0, 1, 0));
    let saved = opt.state_tensors().unwrap();
    assert!(
        saved.iter().any(|(n, _)| n == "strata.loss_scale"),
        "{:?}",
        saved.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    let other = model.optimizer::<FusedAdamW>(Default::default()).unwrap().with_loss_scale(scale).unwrap();
    other.load_state_tensors(&saved).unwrap();
    assert_eq!(other.loss_scale_state(), Some(state));
    // A state without the entry (saved without loss scaling) starts afresh; a damaged one is
    // refused, naming it.
    let plain: Vec<_> = saved.iter().filter(|(n, _)| n != "strata.loss_scale").cloned().collect();
    other.load_state_tensors(&plain).unwrap();
    assert_eq!(other.loss_scale_state(), Some(scale.start()));
    let mut damaged = plain.clone();
    damaged.push(("strata.loss_scale".into(), Tensor::new(&[0.25f64, 0.0, 0.0], &Device::Cpu).unwrap()));
    let e = other.load_state_tensors(&damaged).unwrap_err().to_string();
    assert_eq!(
        e,
        "a checkpoint's loss scale of [0.25, 0.0, 0.0]: expected [scale >= 1, good steps, skipped steps]; the checkpoint is damaged"
    );
    // An optimizer without loss scaling ignores the entry.
    let unscaled = model.optimizer::<FusedAdamW>(Default::default()).unwrap();
    unscaled.load_state_tensors(&saved).unwrap();
    assert_eq!(unscaled.loss_scale_state(), None);
    let e = model.optimizer::<FusedSgd>(0.1).unwrap().with_loss_scale(LossScale { factor: 1.0, ..scale });
    assert_eq!(e.unwrap_err().to_string(), "a loss scale factor of 1: use a finite factor above 1");
}

/// The strategies' tests' MLP (6 -> 16 -> 3, candle-nn's `Linear` layout, or with each weight
/// `(in, out)` when `!linear`), computing in `precision`: its input cast, its variables cast
/// where they are used, the logits in f32.
struct Mixed {
    l1: (Tensor, Tensor),
    l2: (Tensor, Tensor),
    precision: Precision,
    linear: bool,
}

impl Mixed {
    fn new(vb: VarBuilder, precision: Precision) -> candle_core::Result<Self> {
        Self::with_layout(vb, precision, true)
    }

    fn with_layout(vb: VarBuilder, precision: Precision, linear: bool) -> candle_core::Result<Self> {
        let get = |p: &str, (out, inp): (usize, usize)| -> candle_core::Result<(Tensor, Tensor)> {
            let shape = if linear { (out, inp) } else { (inp, out) };
            let w = vb.get_with_hints(shape, &format!("{p}.weight"), candle_nn::init::DEFAULT_KAIMING_NORMAL)?;
            let bound = 1.0 / (inp as f64).sqrt();
            let b = vb.get_with_hints(out, &format!("{p}.bias"), candle_nn::Init::Uniform { lo: -bound, up: bound })?;
            Ok((w, b))
        };
        Ok(Self { l1: get("l1", (16, 6))?, l2: get("l2", (3, 16))?, precision, linear })
    }

    fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let dense = |h: &Tensor, (w, b): &(Tensor, Tensor)| -> candle_core::Result<Tensor> {
            let w = cast_like(w, h)?;
            h.matmul(&if self.linear { w.t()? } else { w })?.broadcast_add(&cast_like(b, h)?)
        };
        let h = dense(&self.precision.cast(x)?, &self.l1)?.relu()?;
        candle_nn::loss::cross_entropy(&dense(&h, &self.l2)?.to_dtype(DType::F32)?, y)
    }
}

fn train_mixed(s: &impl Strategy, precision: Precision, steps: usize) -> Vec<(String, Vec<f32>)> {
    let model = s.scope(|sc| Mixed::new(sc.var_builder(), precision)).unwrap();
    let opt = model.optimizer::<FusedSgd>(0.5).unwrap();
    for step in 0..steps {
        let global = common::data(48, step as u64);
        let db = DistributedBatch::split(&global, s.num_replicas_in_sync()).unwrap();
        s.run_batch(&db, |ctx, shard| {
            let (x, y) = common::tensors(&shard.batch, ctx.candle_device());
            ctx.backward_and_sync(&model.on(ctx)?.loss(&x, &y)?, &opt)
        })
        .unwrap();
    }
    for c in 0..model.num_copies() {
        assert!(model.variables(c).iter().all(|(_, v)| v.dtype() == DType::F32), "the variables stay f32");
    }
    common::params(&model)
}

strategy_test!(bf16_training_keeps_f32_variables_and_ends_near_one_device, |s: StrategyHandle| {
    let one = train_mixed(&common::one_device(), Precision::Bf16, 10);
    let got = train_mixed(&s, Precision::Bf16, 10);
    let f32s = train_mixed(&common::one_device(), Precision::F32, 10);
    // bf16 keeps 8 bits of mantissa: each replica's products round to 2^-9 relative, so the
    // replicas' sum differs from one device's by that order, not by f32's reassociation.
    let d = common::max_rel_diff(&one, &got);
    assert!(d <= 2e-2, "bf16 against one device's bf16: {d}");
    assert!(common::max_rel_diff(&f32s, &got) <= 5e-2, "bf16 against f32");
    assert!(common::max_rel_diff(&f32s, &one) > 0.0, "bf16 computes in bf16");
});

/// Stage 2 with blocks of rows takes a weight cast to 16 bits (mixed precision's autocast,
/// `x.matmul(&w.to_dtype(t).t())` and `x.matmul(&w.to_dtype(t))`) through the backward pass's
/// row seam: its gradient is handed over, reduced and kept block by block as the pass computes
/// it ([`DistributedOptimizer::pass_row_blocks`]), and every replica's copy ends bit for bit
/// where stage 0 ends, under bf16 and under fp16 with loss scaling, on 2 and 3 replicas.
#[test]
fn stage_2_reduces_a_cast_weight_in_blocks_of_rows_bit_for_bit() {
    for precision in [Precision::Bf16, Precision::Fp16] {
        for linear in [true, false] {
            for n in [2, 3] {
                let run = |stage: ZeroStage, precision: Precision| {
                    let devices = strata_core::device::logical_cpus(n).unwrap();
                    // 64 bytes: blocks of 1 to 2 rows, a last block of one row included.
                    let options = StrategyOptions {
                        zero_stage: stage,
                        host_shards: false,
                        row_block_bytes: 64,
                        ..Default::default()
                    };
                    let s = MirroredStrategy::with_options(devices, CpuReduction::default(), options).unwrap().handle();
                    let model = s.scope(|sc| Mixed::with_layout(sc.var_builder(), precision, linear)).unwrap();
                    let mut opt = model.optimizer::<FusedAdamW>(Default::default()).unwrap();
                    if precision.needs_loss_scale() {
                        opt = opt.with_loss_scale(LossScale::default()).unwrap();
                    }
                    for step in 0..4 {
                        let db = DistributedBatch::split(&common::data(24, step), n).unwrap();
                        s.run_batch(&db, |ctx, shard| {
                            let (x, y) = common::tensors(&shard.batch, ctx.candle_device());
                            ctx.backward_and_sync(&model.on(ctx)?.loss(&x, &y)?, &opt)
                        })
                        .unwrap();
                    }
                    let from_pass = (0..n).map(|r| opt.pass_row_blocks(r)).collect::<Vec<_>>();
                    (values(&model), opt.overlap_row_blocks(0).unwrap_or(0), from_pass)
                };
                let case = format!("{precision}, linear {linear}, {n} replicas");
                let (whole, _, _) = run(ZeroStage::Off, precision);
                let (blocks, units, from_pass) = run(ZeroStage::Gradients, precision);
                // l1 (16 x 6 or 6 x 16) and l2 (3 x 16 or 16 x 3) in blocks of 64 bytes: 2 and
                // 1 rows, or 1 and 5 (5, 5, 5, 1); every block from the pass on every replica.
                let expected = if linear { 8 + 3 } else { 6 + 4 };
                assert_eq!(units, expected, "{case}: the weights go in blocks of rows");
                assert_eq!(from_pass, vec![expected; n], "{case}: the pass hands every block over");
                let bits = |v: &[Vec<f32>]| {
                    v.iter().map(|t| t.iter().map(|x| x.to_bits()).collect()).collect::<Vec<Vec<u32>>>()
                };
                assert_eq!(blocks.len(), n, "{case}");
                for (c, copy) in blocks.iter().enumerate() {
                    assert_eq!(bits(copy), bits(&whole[0]), "{case}: copy {c}");
                }
            }
        }
    }
}

//! Non-trainable state under every strategy: BatchNorm's running statistics are each replica's
//! own and read as the replicas' mean (closed form), CentralStorage keeps a copy per replica,
//! and `SyncBatchNorm` trains as one device's BatchNorm on the global batch.

use crate::common;

use crate::common::max_rel_diff;
use crate::common::models::{data, BnNet, TestModel};
use candle_core::{Device, Tensor};
use candle_nn::{AdamW, BatchNormConfig, ModuleT, ParamsAdamW, SGD};
use strata_core::data::{Batch, TailPolicy};
use strata_core::optim::{FusedMomentum, OptimizerMemory, ParamsMomentum};
use strata_core::{Strategy, StrategyHandle, VariableKind};

type Params = Vec<(String, Vec<f32>)>;

fn values<M>(m: &strata_core::Replicated<M>) -> Params {
    m.values().unwrap().into_iter().map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect()
}

fn value(p: &Params, name: &str) -> Vec<f32> {
    p.iter().find(|(n, _)| n == name).unwrap().1.clone()
}

/// One training-mode forward pass of candle-nn's BatchNorm (2 channels, momentum 0.1) on a
/// batch whose replica `r` shard is the rows `[r, 10r]` and `[r + 2, 10r + 2]`: the shard's
/// means are `r + 1` and `10r + 1`, its unbiased variances 2. Each replica's running mean is
/// `0.1 * mean` and running variance `0.9 + 0.1 * 2`; reading gives the mean over replicas.
fn bn_statistics(s: &impl Strategy) -> (Params, Vec<Params>) {
    let n = s.num_replicas_in_sync();
    let model = s
        .scope(|sc| {
            let cfg = BatchNormConfig { momentum: 0.1, ..Default::default() };
            candle_nn::batch_norm(2, cfg, sc.var_builder().pp("bn"))
        })
        .unwrap();
    assert_eq!(model.kind("bn.running_mean"), Some(VariableKind::State));
    assert_eq!(model.kind("bn.weight"), Some(VariableKind::Trainable));
    let mut rows = Vec::new();
    for r in 0..n {
        let r = r as f32;
        rows.extend([r, 10.0 * r, r + 2.0, 10.0 * r + 2.0]);
    }
    let batch = Batch::new(rows, vec![0; 2 * n], 2).unwrap();
    let db = s.distribute_dataset(vec![batch], TailPolicy::Split).next().unwrap();
    s.run_batch(&db, |ctx, shard| {
        let x = shard.batch.features_tensor(ctx.candle_device())?;
        model.on(ctx)?.forward_t(&x, true)?;
        Ok(())
    })
    .unwrap();
    let read = values(&model);
    model.sync_state().unwrap();
    let copies = (0..model.num_copies())
        .map(|c| {
            model
                .variables(c)
                .iter()
                .map(|(n, v)| (n.clone(), v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
                .collect()
        })
        .collect();
    (read, copies)
}

strategy_test!(batch_norm_statistics_read_as_the_replicas_mean, |s: StrategyHandle| {
    let n = s.num_replicas_in_sync() as f32;
    let (read, copies) = bn_statistics(&s);
    // mean over r of 0.1 (r + 1) and of 0.1 (10 r + 1)
    let want_mean = [0.1 * (n + 1.0) / 2.0, 0.1 * (10.0 * (n - 1.0) / 2.0 + 1.0)];
    let got = value(&read, "bn.running_mean");
    for (g, w) in got.iter().zip(want_mean) {
        assert!((g - w).abs() <= 1e-6, "running mean {got:?}, want {want_mean:?}");
    }
    for v in value(&read, "bn.running_var") {
        assert!((v - 1.1).abs() <= 1e-6, "running variance {v}, want 1.1");
    }
    // After sync_state every copy holds the mean.
    for (c, copy) in copies.iter().enumerate() {
        assert_eq!(value(copy, "bn.running_mean"), got, "copy {c}");
    }
});

#[test]
fn central_storage_keeps_a_copy_of_state_per_replica() {
    let s = common::central(2);
    let model = s.scope(|sc| candle_nn::batch_norm(2, 1e-5, sc.var_builder().pp("bn"))).unwrap();
    assert_eq!(model.num_copies(), 2, "one copy of the state per replica");
    let (w0, w1) = (&model.variables(0)[2].1, &model.variables(1)[2].1);
    assert_eq!(model.variables(0)[2].0, "bn.weight");
    assert_eq!(w0.as_tensor().id(), w1.as_tensor().id(), "trainable variables stay central");
    let (m0, m1) = (&model.variables(0)[0].1, &model.variables(1)[0].1);
    assert_ne!(m0.as_tensor().id(), m1.as_tensor().id());
    // The variable's copies: one central weight, two running means.
    assert_eq!(model.variable("bn.weight").unwrap().copies().len(), 1);
    assert_eq!(model.variable("bn.running_mean").unwrap().copies().len(), 2);
    // And a model without state is built once.
    let plain = s.scope(|sc| candle_nn::linear(2, 2, sc.var_builder())).unwrap();
    assert_eq!(plain.num_copies(), 1);
}

/// Trains `M` with `O` on the same global batches as `train` does in tests/variables.rs, the
/// uneven 30-example ones included.
fn train<M: TestModel, O: OptimizerMemory + Send>(s: &impl Strategy, cfg: O::Config, steps: usize) -> Params
where
    O::Config: Clone,
{
    let model = s.scope(M::build).unwrap();
    let opt = model.optimizer::<O>(cfg).unwrap();
    let batches: Vec<Batch> = (0..steps).map(|k| data(30, M::DIM, 700 + k as u64)).collect();
    for (step, db) in s.distribute_dataset(batches, TailPolicy::Split).enumerate() {
        s.run_batch(&db, |ctx, shard| {
            let loss = model.on(ctx)?.loss(step, &shard.batch, ctx.candle_device())?;
            ctx.backward_and_sync(&loss, &opt)
        })
        .unwrap();
    }
    model.sync_state().unwrap();
    values(&model)
}

/// `SyncBatchNorm` under `s` against candle-nn's BatchNorm on one device, for SGD, momentum
/// and AdamW: parameters and running statistics agree to 1e-5.
fn sync_bn_is_one_device_bn(s: &impl Strategy) {
    let one = common::one_device();
    let adamw = ParamsAdamW { lr: 0.01, weight_decay: 0.1, ..Default::default() };
    let m = ParamsMomentum { lr: 0.05, momentum: 0.9, nesterov: false };
    let runs = [
        ("sgd", train::<BnNet<false>, SGD>(&one, 0.1, 5), train::<BnNet<true>, SGD>(s, 0.1, 5)),
        ("momentum", train::<BnNet<false>, FusedMomentum>(&one, m, 5), train::<BnNet<true>, FusedMomentum>(s, m, 5)),
        ("adamw", train::<BnNet<false>, AdamW>(&one, adamw.clone(), 5), train::<BnNet<true>, AdamW>(s, adamw, 5)),
    ];
    for (name, want, got) in runs {
        let d = max_rel_diff(&want, &got);
        assert!(d <= 1e-5, "{name}: relative difference {d} from one device's BatchNorm");
        assert_ne!(value(&got, "bn.running_mean"), vec![0.0; 3], "{name}: the statistics must move");
    }
}

strategy_test!(sync_batch_norm_trains_as_one_device_batch_norm, |s: StrategyHandle| {
    sync_bn_is_one_device_bn(&s);
});

#[test]
fn sync_batch_norm_over_two_workers_is_one_device_batch_norm() {
    common::on_workers(2, 2, |_, s| sync_bn_is_one_device_bn(s));
}

#[test]
fn sync_batch_norm_outside_a_step_is_batch_norm() {
    let vb = candle_nn::VarBuilder::zeros(candle_core::DType::F32, &Device::Cpu);
    let cfg = BatchNormConfig { affine: false, ..Default::default() };
    let sync = strata_core::layers::sync_batch_norm(2, cfg, vb.pp("a")).unwrap();
    let x = Tensor::new(&[[1.0f32, 2.0], [3.0, 6.0], [5.0, 1.0]], &Device::Cpu).unwrap();
    let y = sync.forward_t(&x, true).unwrap().to_vec2::<f32>().unwrap();
    // Channel 0: mean 3, biased variance 8/3.
    let want0 = (1.0 - 3.0) / (8.0f32 / 3.0 + 1e-5).sqrt();
    assert!((y[0][0] - want0).abs() < 1e-5, "{y:?}");
    let e = strata_core::layers::sync_batch_norm(2, BatchNormConfig { eps: -1.0, ..Default::default() }, vb.pp("b"))
        .unwrap_err()
        .to_string();
    let first = e.lines().next().unwrap_or_default();
    assert!(first.contains("eps -1") && first.contains("must not be negative"), "{e}");
}

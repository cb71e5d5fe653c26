//! Every kind of variable behaves as on one device, under every strategy: a CNN, a model with
//! parameters unused in some steps (or on some replicas), and a model with frozen layers, each
//! under SGD, SGD with momentum and AdamW, end on one device's parameters, as does a model whose
//! variables share one gradient tensor in the backward pass; unused and frozen
//! variables are never touched by the optimizer and frozen ones never communicated.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::common::max_rel_diff;
use crate::common::models::{data, Cnn, Frozen, Heads, TestModel, Tied};
use candle_nn::{AdamW, ParamsAdamW, SGD};
use strata_core::data::{Batch, TailPolicy};
use strata_core::optim::{
    FusedAdagrad, FusedAdamW, FusedMomentum, FusedSgd, OptimizerMemory, ParamsAdagrad, ParamsMomentum,
};
use strata_core::{Error, Replicated, Strategy, StrategyHandle, StrategyOptions, VariableKind};
use strata_strategies::{CentralStorageStrategy, CpuReduction, MirroredStrategy};

type Params = Vec<(String, Vec<f32>)>;

fn values<M>(m: &Replicated<M>) -> Params {
    m.values().unwrap().into_iter().map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect()
}

/// Trains `M` for `steps` steps of `O` on global batches of `batch` examples (the same ones
/// under every strategy), freezing `freeze`; returns the initial and final values. Mirrored
/// copies must stay bitwise identical.
fn train<M: TestModel, O: OptimizerMemory + Send>(
    s: &impl Strategy,
    cfg: O::Config,
    steps: usize,
    batch: usize,
    freeze: &[&str],
) -> (Params, Params)
where
    O::Config: Clone,
{
    let mut model = s.scope(M::build).unwrap();
    if !freeze.is_empty() {
        model.freeze(freeze).unwrap();
    }
    let before = values(&model);
    let opt = model.optimizer::<O>(cfg).unwrap();
    let batches: Vec<Batch> = (0..steps).map(|k| data(batch, M::DIM, 100 + k as u64)).collect();
    for (step, db) in s.distribute_dataset(batches, TailPolicy::Split).enumerate() {
        s.run_batch(&db, |ctx, shard| {
            let loss = model.on(ctx)?.loss(step, &shard.batch, ctx.candle_device())?;
            ctx.backward_and_sync(&loss, &opt)
        })
        .unwrap();
        for c in 1..model.num_copies() {
            for ((n, a), (_, b)) in model.variables(0).iter().zip(model.variables(c)) {
                let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert!(a == b, "step {step}: copy {c} of {n} differs from copy 0");
            }
        }
    }
    (before, values(&model))
}

const TOLERANCE: f32 = 1e-5;

/// Trains `M` under `s` and under one device with SGD, momentum SGD, Adagrad and AdamW (candle-nn's
/// and the fused ones); the parameters must agree to [`TOLERANCE`].
fn same_as_one_device<M: TestModel>(s: &StrategyHandle, steps: usize, batch: usize, freeze: &[&str]) {
    let one = common::one_device();
    let adamw = ParamsAdamW { lr: 0.01, weight_decay: 0.1, ..Default::default() };
    let momentum = ParamsMomentum { lr: 0.05, momentum: 0.9, nesterov: false };
    let nesterov = ParamsMomentum { nesterov: true, ..momentum };
    let adagrad = ParamsAdagrad { lr: 0.05, ..Default::default() };
    let runs: Vec<(&str, Params, Params)> = vec![
        ("sgd", train::<M, SGD>(&one, 0.1, steps, batch, freeze).1, train::<M, SGD>(s, 0.1, steps, batch, freeze).1),
        (
            "fused sgd",
            train::<M, FusedSgd>(&one, 0.1, steps, batch, freeze).1,
            train::<M, FusedSgd>(s, 0.1, steps, batch, freeze).1,
        ),
        (
            "momentum",
            train::<M, FusedMomentum>(&one, momentum, steps, batch, freeze).1,
            train::<M, FusedMomentum>(s, momentum, steps, batch, freeze).1,
        ),
        (
            "nesterov",
            train::<M, FusedMomentum>(&one, nesterov, steps, batch, freeze).1,
            train::<M, FusedMomentum>(s, nesterov, steps, batch, freeze).1,
        ),
        (
            "adagrad",
            train::<M, FusedAdagrad>(&one, adagrad, steps, batch, freeze).1,
            train::<M, FusedAdagrad>(s, adagrad, steps, batch, freeze).1,
        ),
        (
            "adamw",
            train::<M, AdamW>(&one, adamw.clone(), steps, batch, freeze).1,
            train::<M, AdamW>(s, adamw.clone(), steps, batch, freeze).1,
        ),
        (
            "fused adamw",
            train::<M, FusedAdamW>(&one, adamw.clone(), steps, batch, freeze).1,
            train::<M, FusedAdamW>(s, adamw, steps, batch, freeze).1,
        ),
    ];
    for (name, want, got) in runs {
        let d = max_rel_diff(&want, &got);
        assert!(d <= TOLERANCE, "{name}: relative difference {d} from one device");
    }
}

strategy_test!(a_cnn_ends_as_on_one_device, |s: StrategyHandle| {
    // 30 examples over 4 replicas (8, 8, 7, 7) weighs uneven shards too.
    same_as_one_device::<Cnn>(&s, 6, 30, &[]);
});

strategy_test!(unused_parameters_end_as_on_one_device, |s: StrategyHandle| {
    same_as_one_device::<Heads>(&s, 8, 30, &[]);
});

strategy_test!(variables_sharing_a_gradient_end_as_on_one_device, |s: StrategyHandle| {
    same_as_one_device::<Tied>(&s, 6, 30, &[]);
});

/// The same with one fusion bucket per tensor, so that a gradient written back by one bucket
/// is in place before a later bucket reads the others (the backward pass gives each variable's
/// gradient its own allocation; `strata-core/tests/backward.rs` checks that directly).
#[test]
fn variables_sharing_a_gradient_in_separate_buckets_end_as_on_one_device() {
    for reduction in [CpuReduction::InMemoryAllReduce, CpuReduction::ReductionToOneDevice] {
        let options = StrategyOptions { bucket_bytes: 4, ..Default::default() };
        let devices = strata_core::device::logical_cpus(2).unwrap();
        let s = MirroredStrategy::with_options(devices, reduction, options).unwrap().handle();
        same_as_one_device::<Tied>(&s, 4, 30, &[]);
    }
}

strategy_test!(frozen_layers_end_as_on_one_device, |s: StrategyHandle| {
    same_as_one_device::<Frozen>(&s, 6, 30, &["late.*"]);
});

strategy_test!(a_head_without_gradients_is_not_touched, |s: StrategyHandle| {
    // Only even steps: head `b` never gets a gradient; with AdamW's decoupled weight decay
    // and momentum it must still end bitwise where it began, as on one device.
    for run in 0..2 {
        let (before, after) = if run == 0 {
            let cfg = ParamsAdamW { lr: 0.01, weight_decay: 0.5, ..Default::default() };
            train_even_steps::<FusedAdamW>(&s, cfg)
        } else {
            train_even_steps::<FusedMomentum>(&s, ParamsMomentum::default())
        };
        for ((n, a), (_, b)) in before.iter().zip(&after) {
            if n.starts_with("b.") {
                assert_eq!(a, b, "run {run}: {n} changed without a gradient");
            } else if n.starts_with("a.") || n.starts_with("trunk.") {
                assert_ne!(a, b, "run {run}: {n} must train");
            }
        }
    }
});

/// Three steps, all even (head `a`), with `O`.
fn train_even_steps<O: OptimizerMemory + Send>(s: &StrategyHandle, cfg: O::Config) -> (Params, Params)
where
    O::Config: Clone,
{
    let model = s.scope(Heads::build).unwrap();
    let before = values(&model);
    let opt = model.optimizer::<O>(cfg).unwrap();
    for k in 0..3 {
        let db = s.distribute_dataset(vec![data(16, 6, k)], TailPolicy::Split).next().unwrap();
        s.run_batch(&db, |ctx, shard| {
            let loss = model.on(ctx)?.loss(0, &shard.batch, ctx.candle_device())?;
            ctx.backward_and_sync(&loss, &opt)
        })
        .unwrap();
    }
    (before, values(&model))
}

strategy_test!(frozen_variables_keep_their_values_and_kinds, |s: StrategyHandle| {
    let (before, after) =
        train::<Frozen, FusedAdamW>(&s, ParamsAdamW { lr: 0.05, ..Default::default() }, 3, 16, &["late.*"]);
    for ((n, a), (_, b)) in before.iter().zip(&after) {
        if n.starts_with("base.") || n.starts_with("late.") {
            assert_eq!(a, b, "{n} is frozen");
        } else {
            assert_ne!(a, b, "{n} must train");
        }
    }
    let mut model = s.scope(Frozen::build).unwrap();
    assert_eq!(model.kind("base.weight"), Some(VariableKind::Frozen));
    assert_eq!(model.kind("late.weight"), Some(VariableKind::Trainable));
    model.freeze(&["late.*"]).unwrap();
    assert_eq!(model.kind("late.bias"), Some(VariableKind::Frozen));
    let names: Vec<String> = model.trainable_variables(0).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, vec!["head.weight".to_string(), "head.bias".to_string()]);
    // A pattern that matches nothing is an error that names it.
    let e = model.freeze(&["lat.*"]).unwrap_err();
    assert!(matches!(e, Error::NoSuchVariable { .. }), "{e}");
    let m = e.to_string();
    assert!(m.contains("\"lat.*\"") && m.contains("late.weight") && !m.contains('\n'), "{m}");
});

/// Ops that count the elements every reduction carries (replica 0's requests).
#[derive(Debug)]
struct Counting {
    inner: strata_core::cross_device::CpuCrossDeviceOps,
    elements: Arc<AtomicUsize>,
}

impl strata_core::cross_device::CrossDeviceOps for Counting {
    fn name(&self) -> &'static str {
        "counting"
    }
    fn reduce(
        &self,
        req: strata_core::cross_device::ReduceRequest<'_>,
        out: &mut dyn FnMut(&[f32]),
    ) -> strata_core::Result<()> {
        if req.replica == 0 {
            self.elements.fetch_add(req.len(), Ordering::SeqCst);
        }
        self.inner.reduce(req, out)
    }
}

#[test]
fn unused_and_frozen_variables_cost_no_communication() {
    for central in [false, true] {
        let elements = Arc::new(AtomicUsize::new(0));
        let devices = strata_core::device::logical_cpus(2).unwrap();
        let inner = strata_core::cross_device::CpuCrossDeviceOps::in_memory_all_reduce(2)
            .unwrap()
            .with_devices(devices.iter().map(|d| d.spec.clone()).collect())
            .unwrap();
        let ops = Box::new(Counting { inner, elements: elements.clone() });
        let s = if central {
            strata_strategies::CentralStorageStrategy::with_cross_device_ops(devices, ops, Default::default())
                .unwrap()
                .handle()
        } else {
            strata_strategies::MirroredStrategy::with_cross_device_ops(devices, ops, Default::default())
                .unwrap()
                .handle()
        };
        // Frozen: base (6*8+8) through the builder, late (8*8+8) by name; head 8*3+3 trains.
        train::<Frozen, FusedSgd>(&s, 0.1, 2, 8, &["late.*"]);
        assert_eq!(elements.swap(0, Ordering::SeqCst), 2 * 27, "central {central}");
        // Heads in even steps: trunk (56) and a (27) only, and `rare` on steps whose batch has
        // a rare example on some replica.
        let model = s.scope(Heads::build).unwrap();
        let opt = model.optimizer::<FusedSgd>(0.1).unwrap();
        let mut want = 0;
        for k in 0..4u64 {
            let batch = data(8, 6, 7 + k);
            want += 56 + 27 + if batch.features.chunks(6).any(|r| r[0] > 0.8) { 27 } else { 0 };
            let db = s.distribute_dataset(vec![batch], TailPolicy::Split).next().unwrap();
            s.run_batch(&db, |ctx, shard| {
                let loss = model.on(ctx)?.loss(0, &shard.batch, ctx.candle_device())?;
                ctx.backward_and_sync(&loss, &opt)
            })
            .unwrap();
        }
        assert_eq!(elements.load(Ordering::SeqCst), want, "central {central}");
    }
}

#[test]
fn any_replica_is_the_union_over_replicas() {
    let s = common::mirrored(3);
    let out = s
        .run(|ctx| {
            let r = ctx.replica_id();
            let mine: Vec<bool> = (0..70).map(|i| i % 3 == r || i == 69 && r == 2).collect();
            ctx.any_replica(&mine)
        })
        .unwrap();
    for v in out.into_values() {
        assert!(v.iter().all(|&b| b));
    }
    let out = s.run(|ctx| ctx.any_replica(&[ctx.replica_id() == 1, false])).unwrap();
    assert!(out.values().iter().all(|v| v == &vec![true, false]));
}

#[test]
fn two_workers_end_as_one_device() {
    // Two MultiWorkerMirrored workers (threads with their own coordination membership and
    // ring) of two replicas each, against one device, on the models with unused and frozen
    // variables and the CNN.
    let adamw = ParamsAdamW { lr: 0.01, weight_decay: 0.1, ..Default::default() };
    let want_heads = train::<Heads, FusedAdamW>(&common::one_device(), adamw.clone(), 8, 30, &[]).1;
    let want_frozen =
        train::<Frozen, FusedMomentum>(&common::one_device(), ParamsMomentum::default(), 6, 30, &["late.*"]).1;
    let want_cnn = train::<Cnn, SGD>(&common::one_device(), 0.1, 4, 30, &[]).1;
    let out = common::on_workers(2, 2, move |_, s| {
        let heads = train::<Heads, FusedAdamW>(s, adamw.clone(), 8, 30, &[]).1;
        let frozen = train::<Frozen, FusedMomentum>(s, ParamsMomentum::default(), 6, 30, &["late.*"]).1;
        let cnn = train::<Cnn, SGD>(s, 0.1, 4, 30, &[]).1;
        (heads, frozen, cnn)
    });
    for (w, (heads, frozen, cnn)) in out.into_iter().enumerate() {
        for (name, want, got) in
            [("heads", &want_heads, heads), ("frozen", &want_frozen, frozen), ("cnn", &want_cnn, cnn)]
        {
            let d = max_rel_diff(want, &got);
            assert!(d <= TOLERANCE, "worker {w}, {name}: relative difference {d}");
        }
    }
}

/// The same across two workers with every weight's gradient in blocks of rows (of one row):
/// blocks reduced as the backward pass computes them, zeros for
/// a head a worker or a replica did not use, a plan learned again when a head was used by no
/// one; the result is one device's, and bit for bit the result without blocks.
#[test]
fn two_workers_with_weight_gradients_in_blocks_of_rows_end_as_one_device() {
    let adamw = ParamsAdamW { lr: 0.01, weight_decay: 0.1, ..Default::default() };
    let want_heads = train::<Heads, FusedAdamW>(&common::one_device(), adamw.clone(), 8, 30, &[]).1;
    let want_frozen =
        train::<Frozen, FusedMomentum>(&common::one_device(), ParamsMomentum::default(), 6, 30, &["late.*"]).1;
    let want_tied = train::<Tied, SGD>(&common::one_device(), 0.1, 6, 30, &[]).1;
    let run = |row_block_bytes: usize| {
        let adamw = adamw.clone();
        common::on_workers_tuned(
            2,
            2,
            move |o| o.options.row_block_bytes = row_block_bytes,
            move |_, s| {
                let heads = train::<Heads, FusedAdamW>(s, adamw.clone(), 8, 30, &[]).1;
                let frozen = train::<Frozen, FusedMomentum>(s, ParamsMomentum::default(), 6, 30, &["late.*"]).1;
                let tied = train::<Tied, SGD>(s, 0.1, 6, 30, &[]).1;
                (heads, frozen, tied)
            },
        )
    };
    // 24 bytes: every weight (3 x 8, 8 x 6, 8 x 8) in blocks of one row.
    let blocks = run(24);
    let whole = run(0);
    for (w, ((heads, frozen, tied), (heads0, frozen0, tied0))) in blocks.into_iter().zip(whole).enumerate() {
        for (name, want, got, without) in [
            ("heads", &want_heads, heads, heads0),
            ("frozen", &want_frozen, frozen, frozen0),
            ("tied", &want_tied, tied, tied0),
        ] {
            let d = max_rel_diff(want, &got);
            assert!(d <= TOLERANCE, "worker {w}, {name}: relative difference {d}");
            assert_eq!(got, without, "worker {w}, {name}: the blocks changed the result");
        }
    }
}

/// Overlapping the reduction with the backward pass (the default: each bucket reduced as soon
/// as its gradients are final, in the order learned in the first step) changes no bit against
/// reducing after the pass: in memory each element's sum keeps its replica order. Small buckets
/// (several per model), in memory and to one device, mirrored and central variables; a CNN, tied
/// variables, frozen layers, and heads that alternate (the plan no longer fits and is learned
/// again, its missing gradients reduced after the pass).
#[test]
fn overlapped_reduction_gives_the_bits_of_reduction_after_the_pass() {
    fn strategy(kind: usize, overlap: bool) -> StrategyHandle {
        // Stage 0 itself: Mirrored on one machine's CPU would otherwise sum in the step.
        let options = StrategyOptions { bucket_bytes: 64, overlap, host_shards: false, ..Default::default() };
        match kind {
            0 => MirroredStrategy::with_options(
                strata_core::device::logical_cpus(2).unwrap(),
                CpuReduction::InMemoryAllReduce,
                options,
            )
            .unwrap()
            .handle(),
            1 => MirroredStrategy::with_options(
                strata_core::device::logical_cpus(3).unwrap(),
                CpuReduction::ReductionToOneDevice,
                options,
            )
            .unwrap()
            .handle(),
            _ => CentralStorageStrategy::with_options(
                strata_core::device::logical_cpus(2).unwrap(),
                CpuReduction::InMemoryAllReduce,
                options,
            )
            .unwrap()
            .handle(),
        }
    }
    fn same<M: TestModel>(kind: usize, freeze: &[&str]) {
        let adamw = ParamsAdamW { lr: 0.01, weight_decay: 0.1, ..Default::default() };
        let on = train::<M, FusedAdamW>(&strategy(kind, true), adamw.clone(), 5, 30, freeze).1;
        let off = train::<M, FusedAdamW>(&strategy(kind, false), adamw, 5, 30, freeze).1;
        for ((name, a), (_, b)) in on.iter().zip(&off) {
            let (a, b): (Vec<u32>, Vec<u32>) =
                (a.iter().map(|x| x.to_bits()).collect(), b.iter().map(|x| x.to_bits()).collect());
            assert!(a == b, "strategy {kind}: overlapped reduction changed {name}");
        }
        assert_eq!(on.len(), off.len());
    }
    for kind in 0..3 {
        same::<Cnn>(kind, &[]);
        same::<Tied>(kind, &[]);
        same::<Frozen>(kind, &["late.*"]);
        same::<Heads>(kind, &[]);
    }
    // The plan is learned in the first step and used from the second (several buckets).
    let s = strategy(0, true);
    let model = s.scope(Cnn::build).unwrap();
    let opt = model.optimizer::<FusedSgd>(0.1).unwrap();
    assert_eq!(opt.overlap_buckets(0), None);
    for step in 0..2 {
        let db = s.distribute_dataset(vec![data(8, Cnn::DIM, step as u64)], TailPolicy::Split).next().unwrap();
        s.run_batch(&db, |ctx, shard| {
            let loss = model.on(ctx)?.loss(step, &shard.batch, ctx.candle_device())?;
            ctx.backward_and_sync(&loss, &opt)
        })
        .unwrap();
        let buckets = opt.overlap_buckets(0).expect("a plan after the first step");
        assert!(buckets > 1, "{buckets} bucket(s): the test wants several");
    }
}

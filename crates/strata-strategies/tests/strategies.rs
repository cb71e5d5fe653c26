//! One test body, every strategy: the defining property of synchronous data parallelism and
//! the contracts of replica contexts, variables and errors.

use crate::common;

use crate::common::{data, max_rel_diff, params, tensors, train, Mlp};
use candle_core::{Device, Tensor};
use candle_nn::{AdamW, ParamsAdamW, SGD};
use strata_core::data::{DistributedBatch, TailPolicy};
use strata_core::{Error, ReduceOp, Strategy, StrategyHandle, SyncOnReadVariable, VariableAggregation};

strategy_test!(same_parameters_as_one_device_sgd, |s: StrategyHandle| {
    // An uneven global batch (30 over 4 replicas is 8,8,7,7) checks the weighting too.
    for batch in [32, 30] {
        let want = train::<SGD>(&common::one_device(), 0.1, 20, batch);
        let got = train::<SGD>(&s, 0.1, 20, batch);
        let d = max_rel_diff(&want, &got);
        assert!(d <= 1e-4, "batch {batch}: relative difference {d}");
    }
});

strategy_test!(same_parameters_as_one_device_adamw, |s: StrategyHandle| {
    let cfg = ParamsAdamW { lr: 0.01, ..Default::default() };
    for batch in [32, 30] {
        let want = train::<AdamW>(&common::one_device(), cfg.clone(), 20, batch);
        let got = train::<AdamW>(&s, cfg.clone(), 20, batch);
        let d = max_rel_diff(&want, &got);
        assert!(d <= 1e-4, "batch {batch}: relative difference {d}");
    }
});

strategy_test!(fused_optimizers_match_candle_nn_on_one_device, |s: StrategyHandle| {
    use strata_core::optim::{FusedAdamW, FusedSgd};
    let cfg = ParamsAdamW { lr: 0.01, ..Default::default() };
    let want = train::<AdamW>(&common::one_device(), cfg.clone(), 20, 30);
    let got = train::<FusedAdamW>(&s, cfg, 20, 30);
    assert!(max_rel_diff(&want, &got) <= 1e-4);
    let want = train::<SGD>(&common::one_device(), 0.1, 20, 30);
    let got = train::<FusedSgd>(&s, 0.1, 20, 30);
    assert!(max_rel_diff(&want, &got) <= 1e-4);
});

strategy_test!(training_changes_the_parameters, |s: StrategyHandle| {
    let before = {
        let m = s.scope(|sc| Mlp::new(sc.var_builder())).unwrap();
        params(&m)
    };
    let after = train::<SGD>(&s, 0.5, 3, 16);
    assert!(max_rel_diff(&before, &after) > 1e-3, "three SGD steps must move the parameters");
});

strategy_test!(all_reduce_and_gather_in_replica_context, |s: StrategyHandle| {
    let n = s.num_replicas_in_sync();
    let out = s
        .run(|ctx| {
            let r = ctx.replica_id() as f32;
            let t = Tensor::new(&[r, 10.0 * r, -r], ctx.candle_device())?;
            let sum = ctx.all_reduce(ReduceOp::Sum, &t)?.to_vec1::<f32>()?;
            let max = ctx.all_reduce(ReduceOp::Max, &t)?.to_vec1::<f32>()?;
            let mean = ctx.all_reduce(ReduceOp::Mean, &t)?.to_vec1::<f32>()?;
            let gathered = ctx.all_gather(&t.unsqueeze(0)?)?;
            Ok((sum, max, mean, gathered.dims().to_vec(), gathered.to_vec2::<f32>()?))
        })
        .unwrap();
    let tri = (n * (n - 1) / 2) as f32;
    let top = (n - 1) as f32;
    for (sum, max, mean, dims, g) in out.into_values() {
        assert_eq!(sum, vec![tri, 10.0 * tri, -tri]);
        assert_eq!(max, vec![top, 10.0 * top, 0.0]);
        assert!((mean[0] - tri / n as f32).abs() < 1e-6);
        assert_eq!(dims, vec![n, 3]);
        for (r, row) in g.iter().enumerate() {
            assert_eq!(row[0], r as f32);
        }
    }
});

strategy_test!(merge_call_runs_once_with_every_value, |s: StrategyHandle| {
    let n = s.num_replicas_in_sync();
    let calls = std::sync::atomic::AtomicUsize::new(0);
    let out = s
        .run(|ctx| {
            ctx.merge_call(ctx.replica_id() * 2, |cross, values| {
                calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                assert_eq!(cross.num_replicas, values.num_replicas());
                Ok(values.values().iter().sum::<usize>())
            })
        })
        .unwrap();
    assert_eq!(calls.into_inner(), 1);
    assert!(out.values().iter().all(|&v| v == n * (n - 1)));
});

strategy_test!(sync_on_read_aggregations, |s: StrategyHandle| {
    let n = s.num_replicas_in_sync() as f32;
    let dev = Device::Cpu;
    let z = Tensor::zeros(2, candle_core::DType::F32, &dev).unwrap();
    let vars = [VariableAggregation::Sum, VariableAggregation::Mean, VariableAggregation::OnlyFirstReplica]
        .map(|a| SyncOnReadVariable::new(s.extended().as_ref(), z.clone(), a));
    for _ in 0..3 {
        s.run(|ctx| {
            let d = Tensor::new(&[1.0f32, ctx.replica_id() as f32], ctx.candle_device())?;
            for v in &vars {
                v.assign_add(ctx, &d)?;
            }
            Ok(())
        })
        .unwrap();
    }
    let read = |v: &SyncOnReadVariable| v.read().unwrap().to_vec1::<f32>().unwrap();
    let tri = n * (n - 1.0) / 2.0;
    assert_eq!(read(&vars[0]), vec![3.0 * n, 3.0 * tri]);
    assert!((read(&vars[1])[1] - 3.0 * tri / n).abs() < 1e-5);
    assert_eq!(read(&vars[2]), vec![3.0, 0.0]);
    vars[0].reset();
    assert_eq!(read(&vars[0]), vec![0.0, 0.0]);
});

strategy_test!(replica_context_writes_keep_copies_identical, |s: StrategyHandle| {
    let model = s.scope(|sc| Mlp::new(sc.var_builder())).unwrap();
    let var = model.variable("l2.bias").unwrap();
    s.run(|ctx| {
        let v = Tensor::new(&[ctx.replica_id() as f32, 1.0, 2.0], ctx.candle_device())?;
        var.assign_on_replica(ctx, &v, VariableAggregation::Mean)
    })
    .unwrap();
    let n = s.num_replicas_in_sync() as f32;
    for c in var.copies() {
        let got = c.as_tensor().to_vec1::<f32>().unwrap();
        assert!((got[0] - (n - 1.0) / 2.0).abs() < 1e-6 && got[1] == 1.0 && got[2] == 2.0, "{got:?}");
    }
    var.assign(&Tensor::new(&[7.0f32, 8.0, 9.0], &Device::Cpu).unwrap()).unwrap();
    assert!(var.copies().iter().all(|c| c.as_tensor().to_vec1::<f32>().unwrap() == vec![7.0, 8.0, 9.0]));
    let e = var.assign(&Tensor::new(&[1.0f32], &Device::Cpu).unwrap()).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
});

strategy_test!(mismatched_all_reduce_shapes_fail_without_hanging, |s: StrategyHandle| {
    if s.num_replicas_in_sync() == 1 {
        return;
    }
    let e = s
        .run(|ctx| {
            let t = Tensor::ones(3 + ctx.replica_id(), candle_core::DType::F32, ctx.candle_device())?;
            ctx.all_reduce(ReduceOp::Sum, &t)
        })
        .unwrap_err();
    let m = e.to_string();
    assert!(m.contains("shape mismatch") && m.contains("every replica must pass the same shape"), "{m}");
});

strategy_test!(collective_order_mismatch_is_reported, |s: StrategyHandle| {
    if s.num_replicas_in_sync() == 1 {
        return;
    }
    let e = s
        .run(|ctx| {
            let t = Tensor::ones(2, candle_core::DType::F32, ctx.candle_device())?;
            if ctx.replica_id() == 1 {
                ctx.all_gather(&t)?;
            } else {
                ctx.all_reduce(ReduceOp::Sum, &t)?;
            }
            Ok(())
        })
        .unwrap_err();
    let m = e.to_string();
    // (multi-worker names the all-reduce's first, local phase: a reduce to replica 0)
    assert!(m.contains("collective order mismatch") && m.contains("all_gather") && m.contains("reduce("), "{m}");
});

strategy_test!(a_failing_replica_releases_its_peers, |s: StrategyHandle| {
    let last = s.num_replicas_in_sync() - 1;
    let e = s
        .run(|ctx| {
            if ctx.replica_id() == last {
                return Err(Error::InvalidArgument("boom on purpose".into()));
            }
            ctx.all_reduce(ReduceOp::Sum, &Tensor::ones(4, candle_core::DType::F32, ctx.candle_device())?)?;
            Ok(())
        })
        .unwrap_err();
    assert!(e.to_string().contains("boom on purpose"), "{e}");
    // The strategy still works afterwards.
    let ok = s.run(|ctx| Ok(ctx.replica_id())).unwrap();
    assert_eq!(ok.num_replicas(), s.num_replicas_in_sync());
});

strategy_test!(a_panicking_replica_is_an_error, |s: StrategyHandle| {
    let e = s
        .run(|ctx| {
            if ctx.replica_id() == 0 {
                panic!("replica panic on purpose");
            }
            ctx.barrier()
        })
        .unwrap_err();
    assert!(e.to_string().contains("replica panic on purpose"), "{e}");
});

strategy_test!(models_and_optimizers_stay_with_their_strategy, |s: StrategyHandle| {
    let other = common::mirrored(2);
    let model = other.scope(|sc| Mlp::new(sc.var_builder())).unwrap();
    let opt = model.optimizer::<SGD>(0.1).unwrap();
    let e = s.run(|ctx| model.on(ctx).map(|_| ())).unwrap_err();
    assert!(e.to_string().contains("build it inside the scope of the strategy that runs it"), "{e}");
    let b = data(8, 0);
    let e = s
        .run(|ctx| {
            let (x, y) = tensors(&b, ctx.candle_device());
            let loss = model.primary().loss(&x, &y)?;
            ctx.backward_and_sync(&loss, &opt)
        })
        .unwrap_err();
    assert!(e.to_string().contains("create it from a model built in the scope"), "{e}");
});

strategy_test!(variables_outside_the_scope_are_refused, |s: StrategyHandle| {
    let mut kept = None;
    s.scope(|sc| {
        kept = Some(sc.var_builder());
        Mlp::new(sc.var_builder())
    })
    .unwrap();
    let e = match candle_nn::linear(2, 2, kept.unwrap().pp("late")) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a variable created after the scope closed must be refused"),
    };
    assert!(e.contains("created outside the scope") && e.contains("strategy.scope"), "{e}");
});

strategy_test!(two_strategies_cannot_be_mixed, |s: StrategyHandle| {
    let other = common::one_device();
    let e = s.scope(|_| other.scope(|sc| Mlp::new(sc.var_builder())).map_err(candle_core::Error::wrap)).unwrap_err();
    assert!(e.to_string().contains("mixing strategies"), "{e}");
    // The same strategy may re-enter its own scope.
    s.scope(|_| s.scope(|sc| Mlp::new(sc.var_builder())).map_err(candle_core::Error::wrap)).unwrap();
});

strategy_test!(distributed_dataset_shards_cover_the_batch, |s: StrategyHandle| {
    let n = s.num_replicas_in_sync();
    let batches: Vec<_> = [9usize, 9, 5].iter().map(|&k| data(k, k as u64)).collect();
    let ds = s.distribute_dataset(batches.clone(), TailPolicy::Split);
    let mut seen = 0;
    for (db, b) in ds.zip(&batches) {
        let labels = s.run_batch(&db, |_, shard| Ok(shard.batch.labels.clone())).unwrap();
        let all: Vec<u32> = labels.into_values().concat();
        assert_eq!(all, b.labels);
        seen += 1;
    }
    assert_eq!(seen, if n > 5 { 2 } else { 3 });
});

#[test]
fn the_default_strategy_answers_outside_any_scope() {
    assert!(!strata_core::has_strategy());
    let s = StrategyHandle::current();
    assert_eq!(s.extended().name(), "default");
    let v = s.run(|ctx| Ok(ctx.replica_id() as f32 + 2.0)).unwrap();
    assert_eq!(s.reduce(ReduceOp::Mean, &v).unwrap(), 2.0);
    // Inside a scope, the scope's strategy answers.
    let m = common::mirrored(2);
    m.scope(|_| {
        assert_eq!(strata_core::get_strategy().id(), m.extended().id());
        Ok(())
    })
    .unwrap();
}

#[test]
fn zero_replicas_and_duplicate_devices_are_refused() {
    assert!(strata_strategies::MirroredStrategy::logical_cpus(0).is_err());
    let mut d = strata_core::device::logical_cpus(2).unwrap();
    d[1] = d[0].clone();
    let e = strata_strategies::MirroredStrategy::new(d).unwrap_err();
    assert!(e.to_string().contains("listed twice"), "{e}");
}

#[test]
fn memory_info_reports_reduction_buffers_and_limits_bound_them() {
    use strata_core::device::{memory_info, MemoryPolicy, MemoryTracker};
    // Devices of their own, so that other tests in this process do not touch their accounts.
    let mut devices = strata_core::device::logical_cpus(2).unwrap();
    for d in &mut devices {
        d.spec = format!("/job:memtest{}", d.spec).parse().unwrap();
    }
    let s = strata_strategies::MirroredStrategy::new(devices.clone()).unwrap();
    s.run(|ctx| ctx.all_reduce(ReduceOp::Sum, &common::ones(1000))).unwrap();
    let info = memory_info(&devices[0].spec);
    assert!(info.current >= 500 * 4 && info.peak >= info.current, "{info:?}");
    drop(s);
    assert_eq!(memory_info(&devices[0].spec).current, 0, "buffers are given back with the strategy");

    MemoryTracker::global().set_policy(&devices[1].spec, MemoryPolicy::Limit(1024)).unwrap();
    let s = strata_strategies::MirroredStrategy::new(devices.clone()).unwrap();
    let e = s.run(|ctx| ctx.all_reduce(ReduceOp::Sum, &common::ones(100_000))).unwrap_err();
    assert!(e.to_string().contains("memtest"), "{e}");
    // Small reductions still fit.
    s.run(|ctx| ctx.all_reduce(ReduceOp::Sum, &common::ones(100))).unwrap();
}

#[test]
fn logical_cpus_of_several_threads_train_like_one_device() {
    use strata_core::device::{split_physical, CpuEnumerator, DeviceEnumerator, LogicalDeviceConfiguration};
    let cpu = CpuEnumerator.physical_devices().unwrap().remove(0);
    let devices =
        split_physical(&cpu, &[LogicalDeviceConfiguration::cpu(2), LogicalDeviceConfiguration::cpu(2)], 0).unwrap();
    let s = strata_strategies::MirroredStrategy::new(devices).unwrap().handle();
    let want = train::<SGD>(&common::one_device(), 0.1, 10, 32);
    let got = train::<SGD>(&s, 0.1, 10, 32);
    assert!(max_rel_diff(&want, &got) <= 1e-4);
}

strategy_test!(run_batches_is_a_loop_of_run_batch, |s: StrategyHandle| {
    // Global batches of 32, 32 and an uneven 29: the weights change between steps.
    let batches: Vec<_> = [32usize, 32, 29].iter().enumerate().map(|(i, &n)| data(n, 50 + i as u64)).collect();
    let run = |many: bool| {
        let model = s.scope(|sc| Mlp::new(sc.var_builder())).unwrap();
        let opt = model.optimizer::<AdamW>(ParamsAdamW { lr: 0.01, ..Default::default() }).unwrap();
        let dist: Vec<_> =
            batches.iter().map(|b| DistributedBatch::split(b, s.num_replicas_in_sync()).unwrap()).collect();
        let step = |ctx: &strata_core::ReplicaContext<'_>, shard: &strata_core::data::Shard| {
            let (x, y) = tensors(&shard.batch, ctx.candle_device());
            let loss = model.on(ctx)?.loss(&x, &y)?;
            ctx.backward_and_sync(&loss, &opt)?;
            Ok(loss.to_scalar::<f32>()? * shard.weight())
        };
        let losses: Vec<f32> = if many {
            s.run_batches(&dist, step).unwrap().iter().map(|l| s.reduce(ReduceOp::Sum, l).unwrap()).collect()
        } else {
            dist.iter().map(|d| s.reduce(ReduceOp::Sum, &s.run_batch(d, step).unwrap()).unwrap()).collect()
        };
        (params(&model), losses)
    };
    let (a, la) = run(false);
    let (b, lb) = run(true);
    assert_eq!(la.len(), 3);
    assert_eq!(la, lb);
    assert_eq!(a, b, "run_batches must apply exactly the updates of a loop of run_batch");
});

/// A replica's parallel kernels run on its own threads only: with a work-stealing pool shared
/// between replicas, a thread could start its replica inside a piece of another replica's
/// kernel it stole, block in a collective for that replica, and hang the step (the CI once
/// timed out so in a convolution). Every piece of every replica's parallel loop, over many
/// steps, names the replica's own pool, whose size is the logical device's thread count.
#[test]
fn a_replicas_parallel_kernels_run_on_its_own_threads_only() {
    use rayon::prelude::*;
    use strata_core::device::{split_physical, CpuEnumerator, DeviceEnumerator, LogicalDeviceConfiguration};
    let cpu = CpuEnumerator.physical_devices().unwrap().remove(0);
    for threads in [vec![1, 1, 1, 1], vec![2, 1, 3]] {
        let configs: Vec<_> = threads.iter().map(|&t| LogicalDeviceConfiguration::cpu(t)).collect();
        let devices = split_physical(&cpu, &configs, 0).unwrap();
        let s = strata_strategies::MirroredStrategy::new(devices).unwrap();
        for step in 0..50 {
            let seen = s
                .run(|ctx| {
                    let pool = rayon::current_num_threads();
                    let names: Vec<String> = (0..256)
                        .into_par_iter()
                        .map(|_| std::thread::current().name().unwrap_or("unnamed").to_string())
                        .collect();
                    // The replicas wait for each other between steps, as a training step does.
                    ctx.all_reduce(ReduceOp::Sum, &Tensor::new(&[1f32], ctx.candle_device())?)?;
                    Ok((pool, names))
                })
                .unwrap();
            for (r, (pool, names)) in seen.into_values().into_iter().enumerate() {
                assert_eq!(pool, threads[r], "replica {r}'s job runs in a pool of {pool} threads");
                let own = format!("strata-replica-{r}-kernels-");
                let stray = names.iter().find(|n| !n.starts_with(&own));
                assert!(stray.is_none(), "step {step}: a piece of replica {r}'s loop ran on {stray:?}");
            }
        }
    }
}

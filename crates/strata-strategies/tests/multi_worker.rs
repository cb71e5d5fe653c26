//! MultiWorkerMirroredStrategy's workers as threads of one test process (each a complete
//! worker: its own coordination membership, ring and replicas, over loopback TCP).

use std::time::Duration;

use strata_core::cross_device::compression::Compression;
use strata_core::{ReduceOp, Strategy};
use strata_strategies::cluster::{ClusterConfig, ClusterSpec, TaskId};
use strata_strategies::{MultiWorkerMirroredStrategy, MultiWorkerOptions};
use strata_transport::ClusterToken;

fn token() -> ClusterToken {
    ClusterToken::new("0123456789abcdef0123456789abcdef").unwrap()
}

fn spec(n: usize) -> ClusterSpec {
    let ports: Vec<u16> = crate::common::loopback_ports(n);
    ClusterSpec::workers(ports.iter().map(|p| format!("127.0.0.1:{p}")).collect::<Vec<_>>()).unwrap()
}

fn options(local: usize) -> MultiWorkerOptions {
    let mut o = MultiWorkerOptions::new(token()).unwrap();
    o.local_devices = strata_core::device::logical_cpus(local).unwrap();
    o.coordination.rendezvous_timeout = Duration::from_secs(20);
    o.options.collective_timeout = Duration::from_secs(20);
    o
}

/// Runs `body(worker index, strategy)` on `n` workers with `local` replicas each.
fn on_workers<T: Send + 'static>(
    n: usize,
    local: usize,
    body: impl Fn(usize, &MultiWorkerMirroredStrategy) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    on_workers_with(n, local, |_| {}, body)
}

/// [`on_workers`] with the options changed by `tune`.
fn on_workers_with<T: Send + 'static>(
    n: usize,
    local: usize,
    tune: impl Fn(&mut MultiWorkerOptions) + Send + Sync + Clone + 'static,
    body: impl Fn(usize, &MultiWorkerMirroredStrategy) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let spec = spec(n);
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let (spec, body, tune) = (spec.clone(), body.clone(), tune.clone());
            std::thread::spawn(move || {
                let config = ClusterConfig::new(spec, TaskId::worker(i)).unwrap();
                let mut o = options(local);
                tune(&mut o);
                let s = MultiWorkerMirroredStrategy::new(config, o).unwrap();
                let out = body(i, &s);
                let _ = s.finish();
                out
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn replica_ids_and_reductions_span_every_worker() {
    let out = on_workers(3, 2, |_, s| {
        assert_eq!(s.num_replicas_in_sync(), 6);
        let ids = s.run(|ctx| Ok(ctx.replica_id_in_sync_group() as f32)).unwrap();
        let sum = s.reduce(ReduceOp::Sum, &ids).unwrap();
        let max = s.reduce(ReduceOp::Max, &ids).unwrap();
        let mean = s.reduce(ReduceOp::Mean, &ids).unwrap();
        // In-step all-reduce of each replica's id: 0 + 1 + ... + 5 = 15 everywhere.
        let in_step =
            s.run(|ctx| ctx.all_reduce_slice(ReduceOp::Sum, &[ctx.replica_id_in_sync_group() as f32, 1.0])).unwrap();
        (sum, max, mean, in_step.into_values())
    });
    for (sum, max, mean, in_step) in out {
        assert_eq!((sum, max, mean), (15.0, 5.0, 2.5));
        for v in in_step {
            assert_eq!(v, vec![15.0, 6.0]);
        }
    }
}

#[test]
fn variables_start_from_the_chiefs_values_and_stay_identical() {
    let digests = on_workers(2, 1, |i, s| {
        // A model whose initial values differ per worker unless the chief's reach everyone.
        let model = s
            .scope(|sc| {
                let w = sc.var_builder().get_with_hints(4, "w", candle_nn::Init::Const(i as f64 + 1.0))?;
                Ok(w)
            })
            .unwrap();
        model.primary().to_vec1::<f32>().unwrap()
    });
    assert_eq!(digests[0], vec![1.0; 4]);
    assert_eq!(digests[1], vec![1.0; 4]);
}

#[test]
fn a_worker_that_calls_collectives_in_another_order_gets_an_error_naming_both() {
    let out = on_workers(2, 1, |i, s| {
        let r = if i == 0 {
            s.run(|ctx| ctx.all_reduce_slice(ReduceOp::Sum, &[1.0; 10])).map(|_| ())
        } else {
            s.run(|ctx| ctx.barrier()).map(|_| ())
        };
        r.unwrap_err().to_string()
    });
    for e in &out {
        assert!(e.contains("worker:0") && e.contains("worker:1"), "{e}");
        assert!(e.contains("barrier") && e.contains("all_reduce"), "{e}");
    }
}

#[test]
fn a_task_with_another_cluster_spec_is_refused_at_rendezvous() {
    let good = spec(2);
    let mut addrs: Vec<String> = good.tasks().map(|(_, a)| a.to_string()).collect();
    addrs.push("127.0.0.1:1".into());
    let bad = ClusterSpec::workers(addrs).unwrap();
    let chief = {
        let good = good.clone();
        std::thread::spawn(move || {
            let mut o = options(1);
            o.coordination.rendezvous_timeout = Duration::from_secs(4);
            MultiWorkerMirroredStrategy::new(ClusterConfig::new(good, TaskId::worker(0)).unwrap(), o).map(|_| ())
        })
    };
    let e = MultiWorkerMirroredStrategy::new(ClusterConfig::new(bad, TaskId::worker(1)).unwrap(), options(1))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("worker:1")
            && e.contains("cluster")
            && e.contains("give every task the same cluster (the cluster spec)"),
        "{e}"
    );
    assert!(chief.join().unwrap().is_err());
}

#[test]
fn a_wrong_token_is_refused() {
    let s = spec(2);
    let chief = {
        let s = s.clone();
        std::thread::spawn(move || {
            let mut o = options(1);
            o.coordination.rendezvous_timeout = Duration::from_secs(4);
            MultiWorkerMirroredStrategy::new(ClusterConfig::new(s, TaskId::worker(0)).unwrap(), o).map(|_| ())
        })
    };
    let mut o = options(1);
    o.token = ClusterToken::new("ffffffffffffffffffffffffffffffff").unwrap();
    let e =
        MultiWorkerMirroredStrategy::new(ClusterConfig::new(s, TaskId::worker(1)).unwrap(), o).unwrap_err().to_string();
    assert!(e.to_lowercase().contains("unauthenticated") || e.contains("token"), "{e}");
    assert!(chief.join().unwrap().is_err());
}

#[test]
fn input_pipelines_are_one_per_worker_and_auto_sharding_keeps_each_workers_slice() {
    use strata_core::data::{Batch, TailPolicy};
    let out = on_workers(2, 2, |i, s| {
        // distribute_datasets_from_function: one pipeline per worker, built on that worker.
        let mut seen = None;
        let mut pipes = s
            .distribute_datasets_from_function(|ctx| {
                seen = Some(*ctx);
                let per = ctx.per_replica_batch_size(8)?;
                Ok((0..2).map(move |_| Batch::new(vec![0.0; per], vec![0; per], 1).unwrap()))
            })
            .unwrap();
        let ctx = seen.unwrap();
        assert_eq!((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync), (2, i, 4));
        let b = pipes.next().unwrap();
        assert_eq!(b.weights(), vec![0.25, 0.25]);
        // distribute_dataset with Data: each worker keeps its replicas' shards of the global batch.
        let rows: Vec<f32> = (0..10).map(|r| r as f32).collect();
        let batch = Batch::new(rows, vec![0; 10], 1).unwrap();
        let mut d = s.distribute_dataset(vec![batch], TailPolicy::Split);
        let db = d.next().unwrap();
        db.shards.values().iter().map(|sh| sh.batch.features.clone()).collect::<Vec<_>>()
    });
    // 10 rows over 4 replicas: 3, 3, 2, 2.
    assert_eq!(out[0], vec![vec![0.0, 1.0, 2.0], vec![3.0, 4.0, 5.0]]);
    assert_eq!(out[1], vec![vec![6.0, 7.0], vec![8.0, 9.0]]);
}

/// Ops that scale a lone replica's input by 10 instead of reducing across workers, to see
/// that a job's `cross_worker_ops` replace the hierarchical ones.
#[derive(Debug)]
struct TimesTen;

impl strata_core::cross_device::CrossDeviceOps for TimesTen {
    fn name(&self) -> &'static str {
        "times-ten"
    }

    fn reduce(
        &self,
        req: strata_core::cross_device::ReduceRequest<'_>,
        out: &mut dyn FnMut(&[f32]),
    ) -> strata_core::Result<()> {
        let mut buf = Vec::new();
        for t in req.input {
            buf.extend(t.flatten_all()?.to_vec1::<f32>()?.into_iter().map(|x| x * req.weight * 10.0));
        }
        out(&buf);
        Ok(())
    }
}

#[test]
fn cross_worker_ops_are_built_with_the_job_and_replace_the_ring() {
    use std::sync::Arc;
    use strata_strategies::{CrossWorkerOps, CrossWorkerSetup};

    let spec = spec(2);
    let handles: Vec<_> = (0..2)
        .map(|i| {
            let spec = spec.clone();
            std::thread::spawn(move || {
                let mut o = options(1);
                o.cross_worker_ops = Some(CrossWorkerOps(Arc::new(|s: &CrossWorkerSetup<'_>| {
                    // Agree a value through the coordination service, as the NCCL id is.
                    let key = "test/agreed";
                    if s.rank == 0 {
                        s.member
                            .set_key(key, b"from the chief")
                            .map_err(|e| strata_core::Error::Cluster(e.to_string()))?;
                    }
                    let agreed =
                        s.member.get_key(key, s.timeout).map_err(|e| strata_core::Error::Cluster(e.to_string()))?;
                    assert_eq!(agreed, b"from the chief");
                    assert_eq!((s.world, s.local_devices.len()), (2, 1));
                    assert_eq!(s.task, format!("worker:{}", s.rank));
                    assert!(s.abort.reason().is_none());
                    Ok(Box::new(TimesTen) as Box<dyn strata_core::cross_device::CrossDeviceOps>)
                })));
                let config = ClusterConfig::new(spec, TaskId::worker(i)).unwrap();
                let s = MultiWorkerMirroredStrategy::new(config, o).unwrap();
                assert_eq!(s.extended().cross_device_ops().name(), "times-ten");
                let r = s.run(|ctx| ctx.all_reduce_slice(ReduceOp::Sum, &[1.0, 2.0])).unwrap();
                // Worker-level collectives (the loss reduction, broadcasts) still use the ring.
                let total = s.reduce(ReduceOp::Sum, &s.run(|_| Ok(1.0f32)).unwrap()).unwrap();
                let _ = s.finish();
                (r.into_values(), total)
            })
        })
        .collect();
    for h in handles {
        let (values, total) = h.join().unwrap();
        assert_eq!(values, vec![vec![10.0, 20.0]]);
        assert_eq!(total, 2.0);
    }
}

#[test]
fn a_cross_worker_ops_failure_fails_the_worker_with_its_message() {
    use std::sync::Arc;
    use strata_strategies::{CrossWorkerOps, CrossWorkerSetup};

    let spec = spec(2);
    let handles: Vec<_> = (0..2)
        .map(|i| {
            let spec = spec.clone();
            std::thread::spawn(move || {
                let mut o = options(1);
                o.options.collective_timeout = Duration::from_secs(10);
                o.cross_worker_ops = Some(CrossWorkerOps(Arc::new(|s: &CrossWorkerSetup<'_>| {
                    if s.rank == 1 {
                        return Err(strata_core::Error::InvalidArgument("no GPU on this worker".into()));
                    }
                    Ok(Box::new(TimesTen) as Box<dyn strata_core::cross_device::CrossDeviceOps>)
                })));
                let config = ClusterConfig::new(spec, TaskId::worker(i)).unwrap();
                match MultiWorkerMirroredStrategy::new(config, o) {
                    Err(e) => Err(e.to_string()),
                    Ok(s) => {
                        // The chief learns it from the service at its next collective.
                        let r = s.reduce(ReduceOp::Sum, &s.run(|_| Ok(1.0f32)).unwrap()).map_err(|e| e.to_string());
                        let _ = s.finish();
                        r.map(|_| String::new())
                    }
                }
            })
        })
        .collect();
    let out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(out[1].as_ref().unwrap_err().contains("no GPU on this worker"), "{out:?}");
    assert!(out[0].is_err(), "the chief must not carry on alone: {out:?}");
}

/// Trains a small MLP for 6 steps of SGD on `workers` workers of `local` replicas, with the
/// reduction overlapped with the backward pass or not, buckets of 256 bytes (several per
/// step) and the weights' gradients in blocks of rows when overlapped; returns each worker's
/// final parameters.
fn train_mlp(workers: usize, local: usize, overlap: bool) -> Vec<Vec<Vec<f32>>> {
    train_mlp_with(workers, local, overlap, Compression::None)
}

/// [`train_mlp`] with gradients compressed on the ring.
fn train_mlp_with(workers: usize, local: usize, overlap: bool, compression: Compression) -> Vec<Vec<Vec<f32>>> {
    train_mlp_batch(workers, local, overlap, compression, 24)
}

/// [`train_mlp_batch`]'s MLP, `6 -> 16 -> 3`, built in `s`'s scope.
fn mlp(s: &impl Strategy) -> strata_core::Replicated<(candle_nn::Linear, candle_nn::Linear)> {
    s.scope(|sc| {
        let vb = sc.var_builder();
        Ok((candle_nn::linear(6, 16, vb.pp("l1"))?, candle_nn::linear(16, 3, vb.pp("l2"))?))
    })
    .unwrap()
}

/// Trains [`train_mlp_batch`]'s MLP (`6 -> 16 -> 3`, cross-entropy) under `s` with `opt`, one
/// step on each global batch `k` of `ks` (`batch` rows of fixed features and labels).
fn mlp_steps<O: candle_nn::Optimizer + Send>(
    s: &impl Strategy,
    model: &strata_core::Replicated<(candle_nn::Linear, candle_nn::Linear)>,
    opt: &strata_core::DistributedOptimizer<O>,
    ks: std::ops::Range<u32>,
    batch: u32,
) {
    mlp_steps_on(s, model, opt, ks, 0..batch);
}

/// [`mlp_steps`] on rows `rows` of each global batch only (one worker's part of it).
fn mlp_steps_on<O: candle_nn::Optimizer + Send>(
    s: &impl Strategy,
    model: &strata_core::Replicated<(candle_nn::Linear, candle_nn::Linear)>,
    opt: &strata_core::DistributedOptimizer<O>,
    ks: std::ops::Range<u32>,
    rows: std::ops::Range<u32>,
) {
    use candle_nn::Module;
    use strata_core::data::{Batch, TailPolicy};
    let batches: Vec<Batch> = ks
        .map(|k| {
            let features = rows
                .clone()
                .flat_map(|r| (r * 6..r * 6 + 6).map(move |i| ((i * 7 + k * 13) % 17) as f32 / 8.0 - 1.0))
                .collect();
            let labels = rows.clone().map(|i| (i + k) % 3).collect();
            Batch::new(features, labels, 6).unwrap()
        })
        .collect();
    for db in s.distribute_dataset(batches, TailPolicy::Split) {
        s.run_batch(&db, |ctx, shard| {
            let (l1, l2) = model.on(ctx)?;
            let x = shard.batch.features_tensor(ctx.candle_device())?;
            let y = shard.batch.labels_tensor(ctx.candle_device())?;
            let loss = candle_nn::loss::cross_entropy(&l2.forward(&l1.forward(&x)?.relu()?)?, &y)?;
            ctx.backward_and_sync(&loss, opt)
        })
        .unwrap();
    }
}

/// [`train_mlp_with`] on global batches of `batch` examples.
fn train_mlp_batch(
    workers: usize,
    local: usize,
    overlap: bool,
    compression: Compression,
    batch: u32,
) -> Vec<Vec<Vec<f32>>> {
    on_workers_with(
        workers,
        local,
        move |o| {
            o.options.overlap = overlap;
            o.options.bucket_bytes = 256;
            // Both weights' gradients in blocks of rows (2 of l1's 16, 1 of l2's 3).
            o.options.row_block_bytes = 48;
            o.compression = compression;
        },
        move |_, s| {
            let model = mlp(s);
            let opt = model.optimizer::<candle_nn::SGD>(0.1).unwrap();
            mlp_steps(s, &model, &opt, 0..6, batch);
            // The weights went in blocks of rows (under PowerSGD, whole).
            let want = match compression {
                Compression::PowerSgd { .. } => 0,
                _ => 8 + 3,
            };
            assert_eq!(opt.overlap_row_blocks(0), overlap.then_some(want));
            model
                .values()
                .unwrap()
                .into_iter()
                .map(|(_, t)| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
                .collect()
        },
    )
}

/// Overlapping the ring's all-reduce with the backward pass (each bucket started on the
/// worker's ring thread as soon as its gradients are final): with two workers every element's
/// sum keeps its order, so the parameters equal reduction after the pass bit for bit; with
/// three, the ring's chunks fall elsewhere in the buckets, so they agree within float
/// reassociation, and the workers stay bitwise identical to each other.
#[test]
fn overlapped_ring_reduction_gives_the_same_parameters() {
    let bits =
        |p: &Vec<Vec<f32>>| p.iter().map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()).collect::<Vec<_>>();
    for local in [1, 2] {
        let on = train_mlp(2, local, true);
        let off = train_mlp(2, local, false);
        assert_eq!(bits(&on[0]), bits(&on[1]), "{local} local replica(s): the workers differ");
        assert_eq!(bits(&on[0]), bits(&off[0]), "{local} local replica(s): overlap changed the parameters");
    }
    let on = train_mlp(3, 1, true);
    let off = train_mlp(3, 1, false);
    assert_eq!(bits(&on[0]), bits(&on[1]));
    assert_eq!(bits(&on[0]), bits(&on[2]));
    for (a, b) in on[0].iter().flatten().zip(off[0].iter().flatten()) {
        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} against {b}");
    }
}

/// Gradients compressed on the ring (`bf16`, `fp16`): every worker decompresses the same sum,
/// so the workers' parameters stay bitwise identical, and after six SGD steps they are within
/// the formats' rounding of the exact run (relative 1e-2 for bf16's 8 bits, 2e-3 for f16's
/// 11).
#[test]
fn compressed_gradients_keep_the_workers_identical_and_near_the_exact_run() {
    let bits =
        |p: &Vec<Vec<f32>>| p.iter().map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()).collect::<Vec<_>>();
    for workers in [2, 3] {
        let exact = train_mlp_with(workers, 1, true, Compression::None);
        for (compression, tolerance) in [(Compression::Bf16, 1e-2f32), (Compression::Fp16, 2e-3)] {
            let got = train_mlp_with(workers, 1, true, compression);
            for w in 1..workers {
                assert_eq!(bits(&got[0]), bits(&got[w]), "{compression}: worker {w} differs from worker 0");
            }
            let (mut num, mut den) = (0f64, 0f64);
            for (a, b) in got[0].iter().flatten().zip(exact[0].iter().flatten()) {
                num += f64::from(a - b).powi(2);
                den += f64::from(*b).powi(2);
            }
            let rel = (num / den).sqrt() as f32;
            assert!(rel <= tolerance, "{workers} workers, {compression}: {rel} from the exact run");
            assert!(rel > 0.0, "{workers} workers, {compression}: no difference at all; was it compressed?");
        }
    }
}

fn bits(p: &[Vec<f32>]) -> Vec<Vec<u32>> {
    p.iter().map(|v| v.iter().map(|x| x.to_bits()).collect()).collect()
}

fn relative(got: &[Vec<f32>], exact: &[Vec<f32>]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (a, b) in got.iter().flatten().zip(exact.iter().flatten()) {
        num += f64::from(a - b).powi(2);
        den += f64::from(*b).powi(2);
    }
    (num / den).sqrt()
}

/// PowerSGD on the ring. The first layer's weight gradient (16 x 6) is a sum of one outer
/// product per example, so on global batches of 4 it has rank 4 or less, and `powersgd:4`
/// reconstructs it exactly (its `P` spans the gradient's columns): the run ends within float
/// rounding of the exact one, with or without overlap, 2 and 3 workers, 1 and 2 replicas a
/// worker, and every worker bitwise identical. On batches of 24 the gradient has rank 6, so
/// rank 1 loses most of it: the workers stay identical and the run is measurably elsewhere.
/// (The second layer's 3 x 16 weight shrinks only at rank 2 or less: at rank 4 it travels in
/// f32, as the biases always do.)
#[test]
fn powersgd_on_the_ring_is_exact_on_gradients_of_rank_r_and_keeps_the_workers_identical() {
    for (workers, local, overlap) in [(2, 1, true), (2, 2, false), (3, 1, true)] {
        let exact = train_mlp_batch(workers, local, overlap, Compression::None, 4);
        let got = train_mlp_batch(workers, local, overlap, Compression::PowerSgd { rank: 4, start_step: 0 }, 4);
        for w in 1..workers {
            assert_eq!(bits(&got[0]), bits(&got[w]), "{workers}x{local}: worker {w} differs from worker 0");
        }
        let rel = relative(&got[0], &exact[0]);
        assert!(rel <= 1e-5, "{workers}x{local} overlap {overlap}: {rel} from the exact run");
    }
    let exact = train_mlp_batch(2, 1, true, Compression::None, 24);
    let got = train_mlp_batch(2, 1, true, Compression::PowerSgd { rank: 1, start_step: 0 }, 24);
    assert_eq!(bits(&got[0]), bits(&got[1]), "rank 1: the workers differ");
    let rel = relative(&got[0], &exact[0]);
    assert!(rel > 1e-4, "rank 1 on rank-6 gradients came within {rel} of the exact run; was it compressed?");
    // `powersgd:1:6`: the six steps' gradients all travel uncompressed (the start step), so
    // this is the exact run bit for bit; `powersgd:1:3` compresses the last three.
    let late = train_mlp_batch(2, 1, true, Compression::PowerSgd { rank: 1, start_step: 6 }, 24);
    assert_eq!(bits(&late[0]), bits(&exact[0]), "powersgd:1:6 compressed one of the first six steps");
    let half = train_mlp_batch(2, 1, true, Compression::PowerSgd { rank: 1, start_step: 3 }, 24);
    assert_eq!(bits(&half[0]), bits(&half[1]), "powersgd:1:3: the workers differ");
    assert!(bits(&half[0]) != bits(&exact[0]) && bits(&half[0]) != bits(&got[0]));
}

/// The MLP of [`train_mlp_batch`] on 2 workers under `powersgd:1` with dynamic loss scaling
/// from `initial`, on batches `first..8` of 24 rows: every worker's parameters, the steps
/// skipped and the final scale.
fn train_loss_scaled(initial: f64, first: usize) -> Vec<(Vec<Vec<f32>>, u64, f64)> {
    on_workers_with(
        2,
        1,
        |o| o.compression = Compression::PowerSgd { rank: 1, start_step: 0 },
        move |_, s| {
            let model = mlp(s);
            let scale = strata_core::LossScale { initial, ..Default::default() };
            let opt = model.optimizer::<candle_nn::SGD>(0.1).unwrap().with_loss_scale(scale).unwrap();
            mlp_steps(s, &model, &opt, first as u32..8, 24);
            let st = opt.loss_scale_state().unwrap();
            let params = model
                .values()
                .unwrap()
                .into_iter()
                .map(|(_, t)| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
                .collect();
            (params, st.skipped_steps, st.scale)
        },
    )
}

/// PowerSGD under fp16's dynamic loss scaling: steps whose scaled gradient overflows (a scale
/// of 2^130, then halved) are skipped, and PowerSGD's error feedback and warm `Q` undo them
/// (`CrossDeviceOps::loss_scale_step`), so the job goes on exactly as one started at the scale
/// that fits on the batches after the skipped ones, bit for bit; without the undo the
/// infinities stay in the error buffer and every later step is skipped.
#[test]
fn powersgd_undoes_a_skipped_loss_scaled_step() {
    let a = train_loss_scaled(2f64.powi(130), 0);
    let (_, skipped, scale) = a[0].clone();
    assert!((1..6).contains(&skipped), "{skipped} steps skipped of 8");
    assert_eq!(scale, 2f64.powi(130 - skipped as i32));
    assert!(a[0].0.iter().flatten().all(|x| x.is_finite()));
    let b = train_loss_scaled(scale, skipped as usize);
    assert_eq!(b[0].1, 0, "the run at the scale that fits skips nothing");
    for (w, (params, _, _)) in a.iter().enumerate() {
        assert_eq!(bits(params), bits(&b[0].0), "worker {w}: the skipped steps left a trace");
    }
}

/// A PowerSGD rank at which none of the model's gradients would shrink is refused when the
/// optimizer is built, naming the rank that would, before any step.
#[test]
fn a_powersgd_rank_that_compresses_nothing_is_refused_naming_the_rank_that_would() {
    let errors = on_workers_with(
        2,
        1,
        |o| o.compression = Compression::PowerSgd { rank: 5, start_step: 0 },
        |_, s| {
            let model = mlp(s);
            model.optimizer::<candle_nn::SGD>(0.1).map(|_| ()).unwrap_err().to_string()
        },
    );
    for e in errors {
        assert_eq!(
            e,
            "powersgd rank 5 compresses none of the model's gradients (the largest matrix, 16x6, shrinks only at rank 4 or less): use a rank of at most 4"
        );
    }
}

/// A worker whose compression differs from the chief's is refused at rendezvous, the message
/// naming both values; the chief fails too, instead of training with a mixed wire.
#[test]
fn a_worker_with_another_compression_is_refused_naming_both() {
    let spec = spec(2);
    let chief = {
        let spec = spec.clone();
        std::thread::spawn(move || {
            let mut o = options(1);
            o.coordination.rendezvous_timeout = Duration::from_secs(4);
            MultiWorkerMirroredStrategy::new(ClusterConfig::new(spec, TaskId::worker(0)).unwrap(), o).map(|_| ())
        })
    };
    let mut o = options(1);
    o.compression = Compression::Bf16;
    let e = MultiWorkerMirroredStrategy::new(ClusterConfig::new(spec, TaskId::worker(1)).unwrap(), o)
        .unwrap_err()
        .to_string();
    assert!(e.contains("compression=bf16") && e.contains("compression=none"), "{e}");
    assert!(chief.join().unwrap().is_err());
}

/// The MLP's trainable values, flattened, in the optimizer's order.
fn trainable_values(model: &strata_core::Replicated<(candle_nn::Linear, candle_nn::Linear)>) -> Vec<Vec<f32>> {
    model
        .trainable_variables(0)
        .iter()
        .map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect()
}

/// Trains the MLP for `steps` steps of SGD (global batches of 24) under local SGD `cfg` on 2
/// or 3 workers of `local` replicas; returns each worker's final trainable values, before and
/// after [`DistributedOptimizer::synchronize_local_steps`], and its outer traffic.
#[allow(clippy::type_complexity)]
fn train_local_sgd(
    workers: usize,
    local: usize,
    cfg: strata_core::LocalSgd,
    compression: Compression,
    steps: u32,
) -> Vec<(Vec<Vec<f32>>, Vec<Vec<f32>>, (u64, u64))> {
    on_workers_with(
        workers,
        local,
        move |o| {
            o.options.local_sgd = Some(cfg.clone());
            o.compression = compression;
        },
        move |_, s| {
            let model = mlp(s);
            let opt = model.optimizer::<candle_nn::SGD>(0.1).unwrap();
            mlp_steps(s, &model, &opt, 0..steps, 24);
            let before = trainable_values(&model);
            opt.synchronize_local_steps().unwrap();
            (before, trainable_values(&model), opt.outer_traffic().unwrap())
        },
    )
}

/// Local SGD's reference, written from the algorithm's definition: one Mirrored(`local`) model
/// per worker, stepped in lock step in this thread, each on its worker's rows of every global
/// batch of 24, and met by hand: at a fragment's meeting each worker's outer gradient
/// `global - local`, their mean, the outer optimizer on the global values, and `delay` steps
/// later every worker takes them (or, with a delay, adds the global step and its own outer
/// gradient to what it holds then). Returns each worker's values after `steps` steps.
fn local_sgd_reference(workers: u32, local: usize, cfg: &strata_core::LocalSgd, steps: u32) -> Vec<Vec<Vec<f32>>> {
    use strata_core::local_sgd::fragment_runs;
    use strata_core::OuterOptimizer;
    use strata_strategies::MirroredStrategy;
    let per = 24 / workers;
    let runs: Vec<_> = (0..workers)
        .map(|_| {
            let s = MirroredStrategy::logical_cpus(local).unwrap();
            let model = mlp(&s);
            let opt = model.optimizer::<candle_nn::SGD>(0.1).unwrap();
            (s, model, opt)
        })
        .collect();
    let mut global = trainable_values(&runs[0].1);
    let sizes: Vec<usize> = global.iter().map(Vec::len).collect();
    let fragments = fragment_runs(&sizes, cfg.fragments);
    let mut velocity: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.0; n]).collect();
    // Each fragment in flight: its outer gradient on every worker.
    let mut in_flight: std::collections::HashMap<usize, Vec<Vec<Vec<f32>>>> = Default::default();
    let d = cfg.delay() as u32;
    let set = |model: &strata_core::Replicated<(candle_nn::Linear, candle_nn::Linear)>, i: usize, values: &[f32]| {
        for c in 0..model.num_copies() {
            let v = &model.trainable_variables(c)[i].1;
            v.set(&candle_core::Tensor::from_slice(values, v.dims(), v.device()).unwrap()).unwrap();
        }
    };
    for step in 1..=steps {
        for (w, (s, model, opt)) in runs.iter().enumerate() {
            let w = w as u32;
            mlp_steps_on(s, model, opt, step - 1..step, w * per..(w + 1) * per);
        }
        let mut land = |f: usize, sent: Vec<Vec<Vec<f32>>>, delayed: bool, global: &mut Vec<Vec<f32>>| {
            for (k, i) in fragments[f].clone().enumerate() {
                let n = sent[0][k].len();
                let mean: Vec<f32> = (0..n)
                    .map(|e| sent.iter().map(|wk| wk[k][e]).reduce(|a, b| a + b).unwrap() / workers as f32)
                    .collect();
                let old = global[i].clone();
                for e in 0..n {
                    match cfg.outer {
                        OuterOptimizer::Average => global[i][e] -= mean[e],
                        OuterOptimizer::Nesterov { lr, momentum } => strata_core::optim::rules::nesterov(
                            &mut global[i][e],
                            &mut velocity[i][e],
                            mean[e],
                            lr,
                            momentum,
                        ),
                    }
                }
                for (w, (_, model, _)) in runs.iter().enumerate() {
                    let now = &trainable_values(model)[i];
                    let values: Vec<f32> = if delayed {
                        (0..n).map(|e| now[e] + ((global[i][e] - old[e]) + sent[w][k][e])).collect()
                    } else {
                        global[i].clone()
                    };
                    set(model, i, &values);
                }
            }
        };
        if d > 0 {
            if let Some(f) = (step > d).then(|| cfg.meeting((step - d) as u64)).flatten() {
                land(f, in_flight.remove(&f).unwrap(), true, &mut global);
            }
        }
        if let Some(f) = cfg.meeting(step as u64) {
            let sent = runs
                .iter()
                .map(|(_, model, _)| {
                    let values = trainable_values(model);
                    fragments[f]
                        .clone()
                        .map(|i| global[i].iter().zip(&values[i]).map(|(g, l)| g - l).collect())
                        .collect()
                })
                .collect();
            in_flight.insert(f, sent);
            if d == 0 {
                land(f, in_flight.remove(&f).unwrap(), false, &mut global);
            }
        }
    }
    runs.iter().map(|(_, model, _)| trainable_values(model)).collect()
}

/// `H = 1` with averaging is per-step synchronous training: bit for bit the job without local
/// SGD, on 1 and 2 replicas a worker.
#[test]
fn local_sgd_every_step_with_averaging_is_synchronous_training_bit_for_bit() {
    let every_step =
        strata_core::LocalSgd { every: 1, outer: strata_core::OuterOptimizer::Average, ..Default::default() };
    for local in [1, 2] {
        let sync = train_mlp_batch(2, local, true, Compression::None, 24);
        let got = on_workers_with(
            2,
            local,
            {
                let c = every_step.clone();
                move |o| {
                    o.options.local_sgd = Some(c.clone());
                    o.options.overlap = true;
                    o.options.bucket_bytes = 256;
                    o.options.row_block_bytes = 48;
                }
            },
            |_, s| {
                let model = mlp(s);
                let opt = model.optimizer::<candle_nn::SGD>(0.1).unwrap();
                mlp_steps(s, &model, &opt, 0..6, 24);
                assert_eq!(opt.outer_traffic(), None, "H = 1 averaging took the local path");
                model
                    .values()
                    .unwrap()
                    .into_iter()
                    .map(|(_, t)| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
                    .collect::<Vec<_>>()
            },
        );
        for w in 0..2 {
            assert_eq!(bits(&got[w]), bits(&sync[w]), "{local} replica(s), worker {w}");
        }
    }
}

/// DiLoCo and local SGD against their definition ([`local_sgd_reference`]): 2 workers, bit for
/// bit (their sums keep their order), on 1 and 2 replicas a worker, with one fragment and with
/// two fragments met at staggered steps whose exchanges run one step behind; the workers
/// differ between meetings and agree after the final synchronisation; the outer traffic is
/// the fragments' f32 bytes per meeting.
#[test]
fn local_sgd_and_diloco_follow_their_definition_bit_for_bit() {
    use strata_core::{LocalSgd, OuterOptimizer};
    let cases = [
        (1, LocalSgd { every: 3, ..Default::default() }),
        (2, LocalSgd { every: 3, ..Default::default() }),
        (1, LocalSgd { every: 2, outer: OuterOptimizer::Average, ..Default::default() }),
        (2, LocalSgd { every: 4, fragments: 2, delay: Some(1), ..Default::default() }),
        (1, LocalSgd { every: 1, ..Default::default() }),
    ];
    for (local, cfg) in cases {
        let steps = 8;
        let want = local_sgd_reference(2, local, &cfg, steps);
        let got = train_local_sgd(2, local, cfg.clone(), Compression::None, steps);
        for w in 0..2 {
            assert_eq!(bits(&got[w].0), bits(&want[w]), "{cfg}, {local} replica(s): worker {w}");
        }
        assert_eq!(bits(&got[0].1), bits(&got[1].1), "{cfg}: the workers differ after the final synchronisation");
        // Each meeting sends its fragment in f32; the final synchronisation meets every fragment
        // with inner steps since it was last sent (one sent at the last step is not met again).
        let sends: Vec<u64> = (1..=steps as u64).filter(|&s| cfg.meeting(s).is_some()).collect();
        let last = |f: usize| sends.iter().copied().filter(|&s| cfg.meeting(s) == Some(f)).max().unwrap_or(0);
        let finals = (0..cfg.fragments).filter(|&f| last(f) < steps as u64).count() as u64;
        let (bytes, met) = got[0].2;
        assert_eq!(met, sends.len() as u64 + finals, "{cfg}");
        let total: u64 = got[0].1.iter().map(|v| v.len() as u64).sum();
        let sizes =
            strata_core::local_sgd::fragment_runs(&got[0].1.iter().map(Vec::len).collect::<Vec<_>>(), cfg.fragments);
        let fragment_bytes = |f: usize| 4 * sizes[f].clone().map(|i| got[0].1[i].len() as u64).sum::<u64>();
        let want: u64 = sends.iter().map(|&s| fragment_bytes(cfg.meeting(s).unwrap())).sum::<u64>()
            + (0..cfg.fragments).filter(|&f| last(f) < steps as u64).map(fragment_bytes).sum::<u64>();
        assert_eq!(bytes, want, "{cfg}: {bytes} bytes of {total} values");
    }
}

/// Three workers (the ring's sums change order by chunk): within float rounding of the
/// definition; outer gradients in bf16 and int8 with error feedback stay near the f32 run.
#[test]
fn diloco_on_three_workers_and_in_bf16_and_int8_stays_near_its_definition() {
    let cfg = strata_core::LocalSgd { every: 3, ..Default::default() };
    let want = local_sgd_reference(3, 1, &cfg, 6);
    let got = train_local_sgd(3, 1, cfg.clone(), Compression::None, 6);
    for w in 0..3 {
        assert!(relative(&got[w].0, &want[w]) < 1e-6, "worker {w}: {}", relative(&got[w].0, &want[w]));
    }
    let half = train_local_sgd(2, 1, cfg.clone(), Compression::Bf16, 6);
    let exact = train_local_sgd(2, 1, cfg, Compression::None, 6);
    let rel = relative(&half[0].1, &exact[0].1);
    assert!(rel > 0.0 && rel < 1e-2, "bf16 outer gradients: {rel} from f32");
    assert_eq!(bits(&half[0].1), bits(&half[1].1));
    // Half the bytes of f32's.
    assert_eq!(2 * half[0].2 .0, exact[0].2 .0);
    // int8 blocks: within a step of each block of the f32 run, 65 bytes per 64 values.
    let int8 = train_local_sgd(2, 1, strata_core::LocalSgd { every: 3, ..Default::default() }, Compression::Int8, 6);
    let rel = relative(&int8[0].1, &exact[0].1);
    assert!(rel > 0.0 && rel < 5e-2, "int8 outer gradients: {rel} from f32");
    assert_eq!(bits(&int8[0].1), bits(&int8[1].1));
    let p: u64 = exact[0].1.iter().map(|v| v.len() as u64).sum();
    let meetings = exact[0].2 .0 / (4 * p);
    assert_eq!(int8[0].2 .0, meetings * (p + p.div_ceil(64)));
}

/// What local SGD cannot take is refused in one line saying what to change.
#[test]
fn local_sgd_refuses_what_it_cannot_take() {
    use strata_core::LocalSgd;
    let cfg = LocalSgd { every: 4, ..Default::default() };
    let config = ClusterConfig::new(spec(1), TaskId::worker(0)).unwrap();
    let mut o = options(1);
    o.options.local_sgd = Some(cfg.clone());
    o.options.zero_stage = strata_core::ZeroStage::OptimizerState;
    let e = MultiWorkerMirroredStrategy::new(config, o).unwrap_err().to_string();
    assert!(e.contains("use zero stage 0 with a synchronisation period above 1"), "{e}");
    let options = strata_core::StrategyOptions { local_sgd: Some(cfg.clone()), ..Default::default() };
    let cpus = strata_core::device::logical_cpus(2).unwrap();
    let e =
        strata_strategies::MirroredStrategy::with_options(cpus, strata_strategies::CpuReduction::default(), options)
            .unwrap_err()
            .to_string();
    assert!(e.contains("applies to multi-worker-mirrored") && e.contains("drop it"), "{e}");
    // More fragments than trainable variables.
    let e = on_workers_with(
        1,
        1,
        |o| o.options.local_sgd = Some(LocalSgd { every: 8, fragments: 5, ..Default::default() }),
        |_, s| mlp(s).optimizer::<candle_nn::SGD>(0.1).map(|_| ()).unwrap_err().to_string(),
    );
    assert!(e[0].contains("5 fragments of a model of 4 trainable variables: use at most 4"), "{}", e[0]);
}

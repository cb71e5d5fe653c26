//! What the strategy tests share: a small MLP, data, and the macro that runs one test body
//! under every strategy (as candle's `test_device!` runs one body on every device).

#![allow(dead_code)]

pub mod models;

use candle_core::{DType, Device, Tensor};
use candle_nn::{Linear, Module, VarBuilder};
use rand::{Rng, SeedableRng};
use strata_core::data::{Batch, DistributedBatch};
use strata_core::optim::OptimizerMemory;
use strata_core::{Strategy, StrategyHandle};
use strata_strategies::{CentralStorageStrategy, CpuReduction, MirroredStrategy, OneDeviceStrategy};

#[derive(Debug)]
pub struct Mlp {
    l1: Linear,
    l2: Linear,
}

impl Mlp {
    pub fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Self { l1: candle_nn::linear(6, 16, vb.pp("l1"))?, l2: candle_nn::linear(16, 3, vb.pp("l2"))? })
    }

    pub fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let logits = self.l2.forward(&self.l1.forward(x)?.relu()?)?;
        candle_nn::loss::cross_entropy(&logits, y)
    }
}

/// `n` examples of 6 features and 3 classes, from a fixed seed.
pub fn data(n: usize, seed: u64) -> Batch {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let features = (0..n * 6).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect();
    let labels = (0..n).map(|_| rng.random_range(0..3u32)).collect();
    Batch::new(features, labels, 6).unwrap()
}

pub fn tensors(b: &Batch, dev: &Device) -> (Tensor, Tensor) {
    (b.features_tensor(dev).unwrap(), b.labels_tensor(dev).unwrap())
}

pub fn one_device() -> StrategyHandle {
    OneDeviceStrategy::cpu().unwrap().handle()
}
pub fn mirrored(n: usize) -> StrategyHandle {
    MirroredStrategy::logical_cpus(n).unwrap().handle()
}
pub fn mirrored_to_one(n: usize) -> StrategyHandle {
    let devices = strata_core::device::logical_cpus(n).unwrap();
    MirroredStrategy::with_options(devices, CpuReduction::ReductionToOneDevice, Default::default()).unwrap().handle()
}
pub fn central(n: usize) -> StrategyHandle {
    CentralStorageStrategy::logical_cpus(n).unwrap().handle()
}

/// The host all-reduce behind the in-place contract of device-resident ops (NCCL, Strata's
/// CUDA kernels): the result is written into the input tensors, `out` is never called. Every
/// strategy test body also runs through it, so the path GPU ops take is tested here.
#[derive(Debug)]
pub struct InPlace(pub strata_core::cross_device::CpuCrossDeviceOps);

struct WriteAt<'a>(usize, &'a [f32]);

impl candle_core::InplaceOp1 for WriteAt<'_> {
    fn name(&self) -> &'static str {
        "test-write-at"
    }
    fn cpu_fwd(&self, s: &mut candle_core::CpuStorage, l: &candle_core::Layout) -> candle_core::Result<()> {
        match (s, l.contiguous_offsets()) {
            (candle_core::CpuStorage::F32(v), Some((lo, _))) => {
                v[lo + self.0..lo + self.0 + self.1.len()].copy_from_slice(self.1);
                Ok(())
            }
            _ => candle_core::bail!("not a contiguous f32 tensor"),
        }
    }
}

impl strata_core::cross_device::CrossDeviceOps for InPlace {
    fn name(&self) -> &'static str {
        "in-place(cpu)"
    }
    fn reduce(
        &self,
        req: strata_core::cross_device::ReduceRequest<'_>,
        _out: &mut dyn FnMut(&[f32]),
    ) -> strata_core::Result<()> {
        let input = req.input;
        let sizes: Vec<usize> = input.iter().map(Tensor::elem_count).collect();
        let (mut cur, mut filled) = (0usize, 0usize);
        let mut failed = None;
        self.0.reduce(req, &mut |mut piece: &[f32]| {
            while !piece.is_empty() {
                while filled == sizes[cur] {
                    (cur, filled) = (cur + 1, 0);
                }
                let take = (sizes[cur] - filled).min(piece.len());
                if let Err(e) = input[cur].inplace_op1(&WriteAt(filled, &piece[..take])) {
                    failed.get_or_insert(e);
                }
                filled += take;
                piece = &piece[take..];
            }
        })?;
        match failed {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }
    fn reduces_in_place(&self) -> bool {
        true
    }
    /// Blocks of rows too: each block's result is written into the block's own input.
    fn takes_row_blocks(&self) -> bool {
        self.0.takes_row_blocks()
    }
}

pub fn in_place_ops(n: usize) -> Box<dyn strata_core::cross_device::CrossDeviceOps> {
    let devices = strata_core::device::logical_cpus(n).unwrap();
    let ops = strata_core::cross_device::CpuCrossDeviceOps::in_memory_all_reduce(n)
        .unwrap()
        .with_devices(devices.into_iter().map(|d| d.spec).collect())
        .unwrap();
    Box::new(InPlace(ops))
}
pub fn mirrored_in_place(n: usize) -> StrategyHandle {
    let devices = strata_core::device::logical_cpus(n).unwrap();
    MirroredStrategy::with_cross_device_ops(devices, in_place_ops(n), Default::default()).unwrap().handle()
}
pub fn central_in_place(n: usize) -> StrategyHandle {
    let devices = strata_core::device::logical_cpus(n).unwrap();
    CentralStorageStrategy::with_cross_device_ops(devices, in_place_ops(n), Default::default()).unwrap().handle()
}

/// `n` loopback ports for this process's test tasks, none handed out twice: taken in turn from
/// 20000-31999, below Linux's ephemeral range (32768-60999), so that no other test's port-0
/// bind or outgoing connection can take one between its choice and the task's bind (what
/// "bind port 0, read it, close it" allowed: a coordination service found its port taken),
/// each checked free when chosen; the start depends on the process id, for concurrent runs.
pub fn loopback_ports(n: usize) -> Vec<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = (std::process::id() % 1000) * 12;
    let mut out = Vec::with_capacity(n);
    for _ in 0..12_000 {
        if out.len() == n {
            break;
        }
        let port = 20_000 + ((start + NEXT.fetch_add(1, Ordering::Relaxed)) % 12_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            out.push(port);
        }
    }
    assert_eq!(out.len(), n, "no {n} free loopback ports in 20000-31999");
    out
}

/// A one-worker MultiWorkerMirrored job of `n` replicas in this process: every collective
/// goes through the hierarchical op, the ring and the coordination service.
pub fn multi_worker(n: usize) -> StrategyHandle {
    use strata_strategies::cluster::{ClusterConfig, ClusterSpec, TaskId};
    let port = loopback_ports(1)[0];
    let spec = ClusterSpec::workers(vec![format!("127.0.0.1:{port}")]).unwrap();
    let token = strata_transport::ClusterToken::new("0123456789abcdef0123456789abcdef").unwrap();
    let mut o = strata_strategies::MultiWorkerOptions::new(token).unwrap();
    o.local_devices = strata_core::device::logical_cpus(n).unwrap();
    strata_strategies::MultiWorkerMirroredStrategy::new(ClusterConfig::new(spec, TaskId::worker(0)).unwrap(), o)
        .unwrap()
        .handle()
}

/// Runs `body(worker index, strategy)` on `n` MultiWorkerMirrored workers of `local` replicas
/// each, one thread per worker (each with its own coordination membership and ring).
pub fn on_workers<T: Send + 'static>(
    n: usize,
    local: usize,
    body: impl Fn(usize, &strata_strategies::MultiWorkerMirroredStrategy) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    on_workers_tuned(n, local, |_| {}, body)
}

/// [`on_workers`] with the options changed by `tune`.
pub fn on_workers_tuned<T: Send + 'static>(
    n: usize,
    local: usize,
    tune: impl Fn(&mut strata_strategies::MultiWorkerOptions) + Send + Sync + Clone + 'static,
    body: impl Fn(usize, &strata_strategies::MultiWorkerMirroredStrategy) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    use strata_strategies::cluster::{ClusterConfig, ClusterSpec, TaskId};
    let ports = loopback_ports(n);
    let spec = ClusterSpec::workers(ports.iter().map(|p| format!("127.0.0.1:{p}")).collect::<Vec<_>>()).unwrap();
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let (spec, body, tune) = (spec.clone(), body.clone(), tune.clone());
            std::thread::spawn(move || {
                let token = strata_transport::ClusterToken::new("0123456789abcdef0123456789abcdef").unwrap();
                let mut o = strata_strategies::MultiWorkerOptions::new(token).unwrap();
                o.local_devices = strata_core::device::logical_cpus(local).unwrap();
                o.coordination.rendezvous_timeout = std::time::Duration::from_secs(30);
                o.options.collective_timeout = std::time::Duration::from_secs(30);
                tune(&mut o);
                let config = ClusterConfig::new(spec, TaskId::worker(i)).unwrap();
                let s = strata_strategies::MultiWorkerMirroredStrategy::new(config, o).unwrap();
                let out = body(i, &s);
                let _ = s.finish();
                out
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Flattened parameter values of a model's primary copy.
pub fn params<M>(m: &strata_core::Replicated<M>) -> Vec<(String, Vec<f32>)> {
    m.values().unwrap().into_iter().map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect()
}

pub fn max_rel_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0f32;
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        let num: f32 = va.iter().zip(vb).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
        let den: f32 = va.iter().map(|x| x.abs()).fold(0.0, f32::max).max(1e-6);
        worst = worst.max(num / den);
    }
    worst
}

pub fn ones(n: usize) -> Tensor {
    Tensor::ones(n, DType::F32, &Device::Cpu).unwrap()
}

/// Runs one test body under every strategy configuration. The body is one function that every
/// configuration's test calls (as candle's `test_device!` does): written inline in each test,
/// its closure and every generic it reaches were compiled once per configuration.
#[macro_export]
macro_rules! strategy_test {
    ($name:ident, $body:expr) => {
        mod $name {
            use super::*;
            fn body(s: strata_core::StrategyHandle) {
                ($body)(s)
            }
            #[test]
            fn one_device() {
                body(common::one_device())
            }
            #[test]
            fn mirrored_2() {
                body(common::mirrored(2))
            }
            #[test]
            fn mirrored_3() {
                body(common::mirrored(3))
            }
            #[test]
            fn mirrored_4() {
                body(common::mirrored(4))
            }
            #[test]
            fn mirrored_reduction_to_one_3() {
                body(common::mirrored_to_one(3))
            }
            #[test]
            fn central_storage_2() {
                body(common::central(2))
            }
            #[test]
            fn central_storage_4() {
                body(common::central(4))
            }
            #[test]
            fn mirrored_in_place_3() {
                body(common::mirrored_in_place(3))
            }
            #[test]
            fn central_storage_in_place_2() {
                body(common::central_in_place(2))
            }
            #[test]
            fn multi_worker_1x2() {
                body(common::multi_worker(2))
            }
        }
    };
}

/// Trains the MLP `steps` steps of optimizer `O` on global batches of `batch` examples.
pub fn train<O: OptimizerMemory + Send>(
    s: &StrategyHandle,
    cfg: O::Config,
    steps: usize,
    batch: usize,
) -> Vec<(String, Vec<f32>)>
where
    O::Config: Clone,
{
    let model = s.scope(|sc| Mlp::new(sc.var_builder())).unwrap();
    let opt = model.optimizer::<O>(cfg).unwrap();
    for step in 0..steps {
        let global = data(batch, step as u64);
        let db = DistributedBatch::split(&global, s.num_replicas_in_sync()).unwrap();
        s.run_batch(&db, |ctx, shard| {
            let (x, y) = tensors(&shard.batch, ctx.candle_device());
            let loss = model.on(ctx)?.loss(&x, &y)?;
            ctx.backward_and_sync(&loss, &opt)?;
            Ok(())
        })
        .unwrap();
        // Mirrored copies are bitwise identical after every step.
        for c in 1..model.num_copies() {
            for ((n, a), (_, b)) in model.variables(0).iter().zip(model.variables(c)) {
                let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert!(a == b, "step {step}: copy {c} of {n} differs from copy 0");
            }
        }
    }
    params(&model)
}

/// Runs `body` in its own thread; panics (failing the test) when it panics or when it does
/// not finish within `limit`.
pub fn with_timeout(limit: std::time::Duration, what: &str, body: impl FnOnce() + Send + 'static) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(what.to_string())
        .spawn(move || {
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
            let _ = tx.send(outcome);
        })
        .unwrap();
    match rx.recv_timeout(limit) {
        Ok(Ok(())) => {}
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("{what} did not finish within {limit:?}"),
    }
}

//! What the strategy tests share: a small MLP, data, and the macro that runs one test body
//! under every strategy (as candle's `test_device!` runs one body on every device).

#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use candle_nn::{Linear, Module, VarBuilder};
use rand::{Rng, SeedableRng};
use strata_core::data::Batch;
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

/// A one-worker MultiWorkerMirrored job of `n` replicas in this process: every collective
/// goes through the hierarchical op, the ring and the coordination service.
pub fn multi_worker(n: usize) -> StrategyHandle {
    use strata_strategies::cluster::{ClusterConfig, ClusterSpec, TaskId};
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let spec = ClusterSpec::workers(vec![format!("127.0.0.1:{port}")]).unwrap();
    let token = strata_transport::ClusterToken::new("0123456789abcdef0123456789abcdef").unwrap();
    let mut o = strata_strategies::MultiWorkerOptions::new(token).unwrap();
    o.local_devices = strata_core::device::logical_cpus(n).unwrap();
    strata_strategies::MultiWorkerMirroredStrategy::new(ClusterConfig::new(spec, TaskId::worker(0)).unwrap(), o)
        .unwrap()
        .handle()
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

/// Runs one test body under every strategy configuration.
#[macro_export]
macro_rules! strategy_test {
    ($name:ident, $body:expr) => {
        mod $name {
            use super::*;
            #[test]
            fn one_device() {
                ($body)(common::one_device())
            }
            #[test]
            fn mirrored_2() {
                ($body)(common::mirrored(2))
            }
            #[test]
            fn mirrored_4() {
                ($body)(common::mirrored(4))
            }
            #[test]
            fn mirrored_reduction_to_one_3() {
                ($body)(common::mirrored_to_one(3))
            }
            #[test]
            fn central_storage_2() {
                ($body)(common::central(2))
            }
            #[test]
            fn central_storage_4() {
                ($body)(common::central(4))
            }
            #[test]
            fn multi_worker_1x2() {
                ($body)(common::multi_worker(2))
            }
        }
    };
}

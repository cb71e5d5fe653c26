//! Training on GPUs (feature `candle-cuda`): Mirrored and CentralStorage over GPUs end with the
//! parameters of one GPU on the same global batch, with NCCL, with Strata's kernels, and on
//! virtual GPUs (one physical GPU split in two, which never uses NCCL). Every test starts with
//! `require_gpus`: it skips with a message where there is no GPU, and fails with
//! `STRATA_REQUIRE_GPU=1`.

#![cfg(feature = "candle-cuda")]

mod common;

use candle_nn::SGD;
use common::{max_rel_diff, train};
use strata_core::device::{DeviceRegistry, DeviceType, LogicalDevice, LogicalDeviceConfiguration};
use strata_core::{Strategy, StrategyHandle};
use strata_cuda::candle_ops::GpuCrossDeviceOps;
use strata_cuda::select::{CrossDeviceChoice, CrossDeviceImpl};
use strata_cuda::testing::require_gpus;
use strata_strategies::{CentralStorageStrategy, MirroredStrategy, OneDeviceStrategy};

/// GPU and CPU kernels sum in different orders: parameters agree to this relative difference.
const TOLERANCE: f32 = 1e-3;

/// The logical GPUs of a registry with the CUDA enumerator; `split`: GPU 0 as two logical GPUs.
fn gpus(split: bool) -> Vec<LogicalDevice> {
    let registry = DeviceRegistry::new();
    strata_cuda::device::register_cuda_enumerator(&registry).unwrap();
    if split {
        let gpu0 = registry.list_physical_devices(Some(DeviceType::Gpu)).unwrap().remove(0);
        let half = LogicalDeviceConfiguration::gpu(1 << 30);
        registry.set_logical_device_configuration(&gpu0, vec![half, half]).unwrap();
    }
    registry.list_logical_devices(Some(DeviceType::Gpu)).unwrap()
}

fn one_gpu(d: &LogicalDevice) -> StrategyHandle {
    OneDeviceStrategy::new(d.clone()).unwrap().handle()
}

fn ops(replicas: &[LogicalDevice], machine: &[LogicalDevice], choice: CrossDeviceChoice) -> GpuCrossDeviceOps {
    GpuCrossDeviceOps::new(replicas, machine, choice).unwrap()
}

fn check(name: &str, s: &StrategyHandle, reference: &StrategyHandle) {
    for batch in [32, 30] {
        let want = train::<SGD>(reference, 0.1, 20, batch);
        let got = train::<SGD>(s, 0.1, 20, batch);
        let d = max_rel_diff(&want, &got);
        assert!(d <= TOLERANCE, "{name}, batch {batch}: relative difference {d}");
    }
}

#[test]
fn mirrored_over_gpus_with_each_cross_device_op_equals_one_gpu() {
    if !require_gpus(2) {
        return;
    }
    let machine = gpus(false);
    for choice in [CrossDeviceChoice::Auto, CrossDeviceChoice::Kernels] {
        let ops = ops(&machine, &machine, choice);
        let what = format!("mirrored over {} GPUs with {}", machine.len(), ops.selection().implementation);
        let s = MirroredStrategy::with_cross_device_ops(machine.clone(), Box::new(ops), Default::default())
            .unwrap()
            .handle();
        check(&what, &s, &one_gpu(&machine[0]));
    }
}

#[test]
fn central_storage_over_gpus_equals_one_gpu() {
    if !require_gpus(2) {
        return;
    }
    let machine = gpus(false);
    let ops = ops(&machine, &machine, CrossDeviceChoice::Auto);
    let s = CentralStorageStrategy::with_cross_device_ops(machine.clone(), Box::new(ops), Default::default())
        .unwrap()
        .handle();
    check("central storage over GPUs", &s, &one_gpu(&machine[0]));
}

#[test]
fn virtual_gpus_use_the_kernels_and_equal_one_gpu() {
    if !require_gpus(1) {
        return;
    }
    let machine = gpus(true);
    let replicas = machine[..2].to_vec();
    let ops = ops(&replicas, &machine, CrossDeviceChoice::Auto);
    assert_eq!(ops.selection().implementation, CrossDeviceImpl::Kernels, "{}", ops.selection().reason);
    let s =
        MirroredStrategy::with_cross_device_ops(replicas.clone(), Box::new(ops), Default::default()).unwrap().handle();
    check("mirrored over 2 virtual GPUs", &s, &one_gpu(&replicas[0]));
    let ops = GpuCrossDeviceOps::new(&replicas, &machine, CrossDeviceChoice::Nccl);
    assert!(ops.is_err(), "NCCL on virtual GPUs must be refused");
}

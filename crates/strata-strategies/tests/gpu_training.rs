//! Training on GPUs (feature `candle-cuda`): Mirrored and CentralStorage over GPUs end with the
//! parameters of one GPU on the same global batch, with NCCL, with Strata's kernels, and on
//! virtual GPUs (one physical GPU split in two, which never uses NCCL). Every test starts with
//! `require_gpus`: it skips with a message where there is no GPU, and fails with
//! `STRATA_REQUIRE_GPU=1`.

#![cfg(feature = "candle-cuda")]

use crate::common;

use crate::common::{max_rel_diff, train};
use candle_nn::SGD;
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

/// `FusedSgd` and `FusedAdamW` on a CUDA variable run Strata's kernels (registered by the GPU
/// cross-device ops, or here directly) and give the CPU's bits.
#[test]
fn fused_optimizers_on_a_gpu_give_the_cpu_bits() {
    use candle_core::backprop::GradStore;
    use candle_core::{Device, Tensor, Var};
    use candle_nn::{Optimizer, ParamsAdamW};
    use strata_core::optim::{FusedAdamW, FusedSgd};
    if !require_gpus(1) {
        return;
    }
    strata_cuda::candle_optim::register();
    fn run<O: Optimizer>(dev: &Device, cfg: O::Config) -> Vec<u32>
    where
        O::Config: Clone,
    {
        let n = 1_000_003;
        let var = Var::from_vec((0..n).map(|i| (i as f32 * 0.37).sin()).collect(), n, dev).unwrap();
        let mut opt = O::new(vec![var.clone()], cfg).unwrap();
        for step in 0..10 {
            let g: Vec<f32> = (0..n).map(|i| ((i * 7 + step) as f32 * 0.011).cos()).collect();
            let mut grads = GradStore::default();
            grads.insert(var.as_tensor(), Tensor::from_vec(g, n, dev).unwrap());
            opt.step(&grads).unwrap();
        }
        var.as_tensor().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
    }
    let gpu = Device::new_cuda(0).unwrap();
    assert!(run::<FusedSgd>(&gpu, 0.1) == run::<FusedSgd>(&Device::Cpu, 0.1), "FusedSgd on a GPU differs from the CPU");
    let cfg = ParamsAdamW { lr: 0.01, weight_decay: 0.1, ..Default::default() };
    assert!(
        run::<FusedAdamW>(&gpu, cfg.clone()) == run::<FusedAdamW>(&Device::Cpu, cfg),
        "FusedAdamW on a GPU differs from the CPU"
    );
}

/// MultiWorkerMirrored with one GPU per worker (two workers as threads of this process, each
/// a complete worker with its own coordination membership and ring) and NCCL across them ends
/// with the parameters of one GPU on the same global batch.
#[cfg(feature = "nccl")]
#[test]
fn multi_worker_mirrored_with_nccl_across_workers_equals_one_gpu() {
    use strata_core::data::TailPolicy;
    use strata_strategies::cluster::{ClusterConfig, ClusterSpec, TaskId};
    use strata_strategies::{MultiWorkerMirroredStrategy, MultiWorkerOptions};

    if !require_gpus(2) {
        return;
    }
    let machine = gpus(false);
    let want = train::<SGD>(&one_gpu(&machine[0]), 0.1, 20, 32);
    let ports: Vec<u16> = crate::common::loopback_ports(2);
    let spec = ClusterSpec::workers(ports.iter().map(|p| format!("127.0.0.1:{p}")).collect::<Vec<_>>()).unwrap();
    let handles: Vec<_> = (0..2)
        .map(|i| {
            let (spec, device) = (spec.clone(), machine[i].clone());
            std::thread::spawn(move || {
                let token = strata_transport::ClusterToken::new("0123456789abcdef0123456789abcdef").unwrap();
                let mut o = MultiWorkerOptions::new(token).unwrap();
                o.local_devices = vec![device];
                o.cross_worker_ops = Some(strata_strategies::nccl::nccl_across_workers());
                let config = ClusterConfig::new(spec, TaskId::worker(i)).unwrap();
                let s = MultiWorkerMirroredStrategy::new(config, o).unwrap();
                assert_eq!(s.extended().cross_device_ops().name(), "nccl");
                let model = s.scope(|sc| common::Mlp::new(sc.var_builder())).unwrap();
                let opt = model.optimizer::<SGD>(0.1).unwrap();
                for step in 0..20u64 {
                    let global = common::data(32, step);
                    let db = s.distribute_dataset(std::iter::once(global), TailPolicy::Split).next().unwrap();
                    s.run_batch(&db, |ctx, shard| {
                        let (x, y) = common::tensors(&shard.batch, ctx.candle_device());
                        let loss = model.on(ctx)?.loss(&x, &y)?;
                        ctx.backward_and_sync(&loss, &opt)?;
                        Ok(())
                    })
                    .unwrap();
                }
                let p = common::params(&model);
                let _ = s.finish();
                p
            })
        })
        .collect();
    let got: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(got[0], got[1], "the two workers' parameters differ");
    let d = max_rel_diff(&want, &got[0]);
    assert!(d <= TOLERANCE, "multi-worker mirrored with nccl: relative difference {d}");
}

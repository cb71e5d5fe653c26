//! GPU replicas: the visible GPUs, the cross-device ops the selection rule picks, and the
//! strategy over them (what `strata train --gpus N` builds).
//!
//! Every step that can fail on a machine without GPUs fails here with one line that says what is
//! missing (exit code 2): a binary built without the `cuda` feature, no CUDA driver, fewer GPUs
//! than asked for, or a binary whose candle computes on the CPU only (`candle-cuda`).

use strata_core::device::{DeviceRegistry, DeviceType, LogicalDevice};
use strata_core::{StrategyHandle, StrategyOptions};
use strata_cuda::select::CrossDeviceChoice;

use crate::kind::StrategyKind;
use crate::{Error, Result};

/// The first `n` logical GPUs of this process (after `CUDA_VISIBLE_DEVICES`, applied by the
/// driver, and any logical device configuration).
pub fn gpu_devices(n: usize) -> Result<Vec<LogicalDevice>> {
    if n == 0 {
        return Err(no_gpu());
    }
    let registry = DeviceRegistry::global();
    if !registry.has_enumerator(DeviceType::Gpu) {
        strata_cuda::device::register_cuda_enumerator(registry)?;
    }
    let gpus = registry.list_logical_devices(Some(DeviceType::Gpu))?;
    if gpus.len() < n {
        return Err(strata_cuda::Error::NoGpu(format!(
            "{n} GPU(s) asked for but this process sees {} (CUDA_VISIBLE_DEVICES={:?}); ask for {} or fewer",
            gpus.len(),
            std::env::var(strata_core::device::CUDA_VISIBLE_DEVICES).unwrap_or_default(),
            gpus.len()
        ))
        .into());
    }
    Ok(gpus[..n].to_vec())
}

fn no_gpu() -> Error {
    Error::Usage("--gpus 0 asks for no GPU; pass 1 or more, or drop --gpus to train on logical CPU devices".into())
}

/// Refuses `n` GPUs asked of the strategy `kind` (`strata train --strategy KIND --gpus N`)
/// where it cannot place them: none asked for, a multi-worker-mirrored task with other than
/// one, a parameter-server job, a one-device strategy with more than one. [`gpu_strategy`] and
/// [`multi_worker_gpus`] call it; a program that takes both from its user calls it before it
/// looks for a driver or a cluster.
pub fn check_gpus(kind: StrategyKind, n: usize) -> Result<()> {
    let refusal = match kind {
        _ if n == 0 => return Err(no_gpu()),
        StrategyKind::MultiWorkerMirrored if n != 1 => format!(
            "--strategy multi-worker-mirrored --gpus {n}: a worker task holds one GPU; start one task per GPU (e.g. strata launch --workers {n}, or Slurm's --gpus-per-task=1) and pass --gpus 1"
        ),
        StrategyKind::ParameterServer => {
            "--gpus places the replicas of one process; parameter-server jobs keep their replicas on logical CPU devices for now".to_string()
        }
        StrategyKind::OneDevice if n != 1 => {
            format!("--strategy one-device runs 1 replica, not --gpus {n}; use --strategy mirrored")
        }
        _ => return Ok(()),
    };
    Err(Error::Usage(refusal))
}

/// The strategy `kind` with one replica on each of the first `n` GPUs, reducing with the ops
/// `choice` selects (refused by [`check_gpus`] where `kind` cannot place them).
pub fn gpu_strategy(
    kind: StrategyKind,
    n: usize,
    choice: CrossDeviceChoice,
    options: StrategyOptions,
) -> Result<StrategyHandle> {
    check_gpus(kind, n)?;
    if kind == StrategyKind::MultiWorkerMirrored {
        return Err(Error::Usage(
            "multi-worker-mirrored places one GPU per worker task: build its worker with multi_worker_gpus".into(),
        ));
    }
    let devices = gpu_devices(n)?;
    build(kind, devices, choice, options)
}

/// A MultiWorkerMirrored worker on GPUs: its one GPU replica (`n` must be 1: start one task
/// per GPU), and the cross-worker reduction `choice` selects: NCCL across every worker's GPU
/// (`auto` when NCCL loads, or `nccl`), or the gradients copied to the host and all-reduced on
/// the TCP ring (`kernels`, or `auto` without NCCL).
/// Returns the worker's replica devices and the cross-worker ops (none: the ring).
pub fn multi_worker_gpus(n: usize, choice: CrossDeviceChoice) -> Result<(Vec<LogicalDevice>, Option<CrossWorkerOps>)> {
    check_gpus(StrategyKind::MultiWorkerMirrored, n)?;
    let devices = gpu_devices(1)?;
    let ops = multi_worker_ops(&devices, choice)?;
    Ok((devices, ops))
}

use strata_strategies::CrossWorkerOps;

#[cfg(feature = "candle-cuda")]
fn multi_worker_ops(_devices: &[LogicalDevice], choice: CrossDeviceChoice) -> Result<Option<CrossWorkerOps>> {
    #[cfg(feature = "nccl")]
    let nccl = strata_cuda::nccl::nccl_available();
    #[cfg(not(feature = "nccl"))]
    let nccl = false;
    let use_nccl = match choice {
        CrossDeviceChoice::Nccl if !nccl => {
            return Err(Error::Usage(
                "nccl cross-device ops asked for, but NCCL is not available to this build (build with the nccl feature and put libnccl.so.2 on the library path), or choose auto".into(),
            ))
        }
        CrossDeviceChoice::Nccl => true,
        CrossDeviceChoice::Auto => nccl,
        _ => false,
    };
    if use_nccl {
        eprintln!("cross-worker ops: nccl (one rank per worker task)");
        #[cfg(feature = "nccl")]
        return Ok(Some(strata_strategies::nccl::nccl_across_workers()));
    }
    eprintln!("cross-worker ops: the gradients copied to the host and all-reduced on the ring");
    Ok(None)
}

#[cfg(not(feature = "candle-cuda"))]
fn multi_worker_ops(devices: &[LogicalDevice], choice: CrossDeviceChoice) -> Result<Option<CrossWorkerOps>> {
    build(StrategyKind::MultiWorkerMirrored, devices.to_vec(), choice, StrategyOptions::default()).map(|_| None)
}

#[cfg(feature = "candle-cuda")]
fn build(
    kind: StrategyKind,
    devices: Vec<LogicalDevice>,
    choice: CrossDeviceChoice,
    options: StrategyOptions,
) -> Result<StrategyHandle> {
    use strata_core::Strategy;
    use strata_strategies::{CentralStorageStrategy, MirroredStrategy, OneDeviceStrategy};
    if kind == StrategyKind::OneDevice {
        return Ok(OneDeviceStrategy::with_options(devices[0].clone(), options)?.handle());
    }
    let machine = DeviceRegistry::global().list_logical_devices(Some(DeviceType::Gpu))?;
    let ops = strata_cuda::candle_ops::GpuCrossDeviceOps::new(&devices, &machine, choice)?;
    eprintln!("cross-device ops: {} ({})", ops.selection().implementation, ops.selection().reason);
    let ops = Box::new(ops);
    Ok(match kind {
        StrategyKind::CentralStorage => CentralStorageStrategy::with_cross_device_ops(devices, ops, options)?.handle(),
        _ => MirroredStrategy::with_cross_device_ops(devices, ops, options)?.handle(),
    })
}

#[cfg(not(feature = "candle-cuda"))]
fn build(
    _kind: StrategyKind,
    devices: Vec<LogicalDevice>,
    _choice: CrossDeviceChoice,
    _options: StrategyOptions,
) -> Result<StrategyHandle> {
    let names: Vec<String> = devices.iter().map(|d| format!("{} ({})", d.spec, d.physical.name)).collect();
    Err(Error::Usage(format!(
        "found {} GPU(s): {}; but this strata's candle computes on the CPU only: rebuild with `--features candle-cuda` to train on GPUs",
        devices.len(),
        names.join(", ")
    )))
}

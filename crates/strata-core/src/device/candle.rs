//! The candle device a logical device computes on.

use candle_core::Device;

use super::logical::LogicalDevice;
use super::spec::DeviceType;
use crate::{Error, Result};

/// The candle device a logical device computes on. A GPU's is candle's CUDA device for the
/// physical GPU's CUDA ordinal, one per ordinal for the whole process (candle tells devices
/// apart by identity, so the model's variables, the batches and the reductions of one replica
/// must share it); logical GPUs split from one physical GPU share its candle device.
pub fn candle_device(d: &LogicalDevice) -> Result<Device> {
    match d.physical.device_type {
        DeviceType::Cpu => Ok(Device::Cpu),
        DeviceType::Gpu => cuda_device(d),
    }
}

#[cfg(feature = "candle-cuda")]
fn cuda_device(d: &LogicalDevice) -> Result<Device> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock, PoisonError};
    static DEVICES: OnceLock<Mutex<HashMap<u32, Device>>> = OnceLock::new();
    let mut devices = DEVICES.get_or_init(Default::default).lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(dev) = devices.get(&d.physical.index) {
        return Ok(dev.clone());
    }
    let dev = Device::new_cuda(d.physical.index as usize)
        .map_err(|e| Error::InvalidArgument(format!("{} (CUDA ordinal {}): {e}", d.spec, d.physical.index)))?;
    devices.insert(d.physical.index, dev.clone());
    Ok(dev)
}

#[cfg(not(feature = "candle-cuda"))]
fn cuda_device(d: &LogicalDevice) -> Result<Device> {
    Err(Error::InvalidArgument(format!(
        "{} is a GPU, but this build computes on the CPU only: rebuild strata with `--features candle-cuda`, or use logical CPU devices",
        d.spec
    )))
}

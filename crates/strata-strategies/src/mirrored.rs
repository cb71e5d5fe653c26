//! `MirroredStrategy`: a variable copy per device, synchronous all-reduce every step.

use std::sync::Arc;

use strata_core::device::LogicalDevice;
use strata_core::{Result, Strategy, StrategyExtended, StrategyOptions, VariablePolicy};

use crate::local::{CpuReduction, LocalStrategy};

/// Synchronous data parallelism on one machine (TensorFlow's `MirroredStrategy`): every
/// replica holds a copy of every variable; gradients are all-reduced each step and every
/// replica applies the same update, so the copies stay bitwise identical.
#[derive(Clone, Debug)]
pub struct MirroredStrategy {
    ext: Arc<dyn StrategyExtended>,
}

impl MirroredStrategy {
    /// One replica per device in `devices`, with the default in-memory all-reduce.
    pub fn new(devices: Vec<LogicalDevice>) -> Result<Self> {
        Self::with_options(devices, CpuReduction::default(), StrategyOptions::default())
    }

    /// One replica per device, with a chosen reduction and options.
    pub fn with_options(
        devices: Vec<LogicalDevice>,
        reduction: CpuReduction,
        options: StrategyOptions,
    ) -> Result<Self> {
        Ok(Self { ext: LocalStrategy::build("mirrored", devices, VariablePolicy::Mirrored, reduction, options)? })
    }

    /// One replica per device, reducing with `ops` (TensorFlow's `cross_device_ops=`): for
    /// GPU replicas, the ops strata-cuda's selection rule picks (NCCL or Strata's kernels).
    /// `ops` must be built for exactly these devices, in this order.
    pub fn with_cross_device_ops(
        devices: Vec<LogicalDevice>,
        ops: Box<dyn strata_core::cross_device::CrossDeviceOps>,
        options: StrategyOptions,
    ) -> Result<Self> {
        Ok(Self { ext: LocalStrategy::build_with_ops("mirrored", devices, VariablePolicy::Mirrored, ops, options)? })
    }

    /// `n` logical CPU devices of one thread each.
    pub fn logical_cpus(n: usize) -> Result<Self> {
        Self::new(strata_core::device::logical_cpus(n)?)
    }
}

impl Strategy for MirroredStrategy {
    fn extended(&self) -> &Arc<dyn StrategyExtended> {
        &self.ext
    }
}

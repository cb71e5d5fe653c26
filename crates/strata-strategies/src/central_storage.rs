//! `CentralStorageStrategy`: one copy of the variables on the parameter device.

use std::sync::Arc;

use strata_core::device::LogicalDevice;
use strata_core::{Result, Strategy, StrategyExtended, StrategyOptions, VariablePolicy};

use crate::local::{CpuReduction, LocalStrategy};

/// Variables live once, on the parameter device (the CPU); every replica computes with them,
/// gradients are reduced to the parameter device, and the update is applied there once
/// (TensorFlow's `CentralStorageStrategy`). Replica 0's thread applies it.
#[derive(Clone, Debug)]
pub struct CentralStorageStrategy {
    ext: Arc<dyn StrategyExtended>,
}

impl CentralStorageStrategy {
    /// Compute on `devices`, variables on the CPU.
    pub fn new(devices: Vec<LogicalDevice>) -> Result<Self> {
        Self::with_options(devices, CpuReduction::default(), StrategyOptions::default())
    }

    /// Compute on `devices`, with a chosen reduction and options.
    pub fn with_options(
        devices: Vec<LogicalDevice>,
        reduction: CpuReduction,
        options: StrategyOptions,
    ) -> Result<Self> {
        let policy = VariablePolicy::Central { parameter_replica: 0 };
        Ok(Self { ext: LocalStrategy::build("central-storage", devices, policy, reduction, options)? })
    }

    /// One replica per device, reducing with `ops` (TensorFlow's `cross_device_ops=`): for
    /// GPU replicas, the ops strata-cuda's selection rule picks (NCCL or Strata's kernels).
    /// `ops` must be built for exactly these devices, in this order.
    pub fn with_cross_device_ops(
        devices: Vec<LogicalDevice>,
        ops: Box<dyn strata_core::cross_device::CrossDeviceOps>,
        options: StrategyOptions,
    ) -> Result<Self> {
        Ok(Self {
            ext: LocalStrategy::build_with_ops(
                "central-storage",
                devices,
                VariablePolicy::Central { parameter_replica: 0 },
                ops,
                options,
            )?,
        })
    }

    /// `n` logical CPU devices of one thread each.
    pub fn logical_cpus(n: usize) -> Result<Self> {
        Self::new(strata_core::device::logical_cpus(n)?)
    }
}

impl Strategy for CentralStorageStrategy {
    fn extended(&self) -> &Arc<dyn StrategyExtended> {
        &self.ext
    }
}

//! `OneDeviceStrategy`: everything on one device, no reduction.

use std::sync::Arc;

use strata_core::device::LogicalDevice;
use strata_core::{Result, Strategy, StrategyExtended, StrategyOptions, VariablePolicy};

use crate::local::{CpuReduction, LocalStrategy};

/// Runs every step on one device (TensorFlow's `OneDeviceStrategy`): the baseline every
/// synchronous strategy must match.
#[derive(Clone, Debug)]
pub struct OneDeviceStrategy {
    ext: Arc<dyn StrategyExtended>,
}

impl OneDeviceStrategy {
    /// One replica on `device`.
    pub fn new(device: LogicalDevice) -> Result<Self> {
        Self::with_options(device, StrategyOptions::default())
    }

    /// One replica on `device`, with options.
    pub fn with_options(device: LogicalDevice, options: StrategyOptions) -> Result<Self> {
        let ext = LocalStrategy::build(
            "one-device",
            vec![device],
            VariablePolicy::Mirrored,
            CpuReduction::default(),
            options,
        )?;
        Ok(Self { ext })
    }

    /// One replica on one logical CPU device of one thread.
    pub fn cpu() -> Result<Self> {
        Self::new(strata_core::device::logical_cpus(1)?.remove(0))
    }
}

impl Strategy for OneDeviceStrategy {
    fn extended(&self) -> &Arc<dyn StrategyExtended> {
        &self.ext
    }
}

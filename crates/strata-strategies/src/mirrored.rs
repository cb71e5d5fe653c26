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

//! The in-process machinery the single-machine strategies share.

use std::sync::Arc;

use strata_core::cross_device::{CpuCrossDeviceOps, CrossDeviceOps};
use strata_core::device::{LogicalDevice, LogicalKind};
use strata_core::runtime::{execute_local, ReplicaPools};
use strata_core::strategy::{AutoShardPolicy, ReplicaJob, WorkerCollectives};
use strata_core::{Error, Result, StrategyExtended, StrategyId, StrategyOptions, VariablePolicy};

/// Which CPU cross-device operation a strategy uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpuReduction {
    /// Each replica thread reduces its own chunk of every buffer (reduce-scatter, then every
    /// replica reads the reduced chunks): the default.
    #[default]
    InMemoryAllReduce,
    /// One replica reduces everything (TensorFlow's `ReductionToOneDevice`).
    ReductionToOneDevice,
}

/// A strategy whose replicas are threads of this process.
#[derive(Debug)]
pub(crate) struct LocalStrategy {
    id: StrategyId,
    name: &'static str,
    devices: Vec<LogicalDevice>,
    policy: VariablePolicy,
    ops: Box<dyn CrossDeviceOps>,
    options: StrategyOptions,
    pools: ReplicaPools,
    /// The other workers (multi-worker strategies only).
    workers: Option<Arc<dyn WorkerCollectives>>,
    auto_shard: AutoShardPolicy,
}

/// What a multi-worker strategy adds to the local machinery.
pub(crate) struct CrossWorker {
    /// Builds the cross-device ops from the local CPU ops.
    pub(crate) ops: Box<dyn FnOnce(CpuCrossDeviceOps) -> Box<dyn CrossDeviceOps>>,
    pub(crate) workers: Arc<dyn WorkerCollectives>,
    pub(crate) auto_shard: AutoShardPolicy,
}

impl LocalStrategy {
    pub(crate) fn build(
        name: &'static str,
        devices: Vec<LogicalDevice>,
        policy: VariablePolicy,
        reduction: CpuReduction,
        options: StrategyOptions,
    ) -> Result<Arc<dyn StrategyExtended>> {
        Self::build_with(name, devices, policy, reduction, options, None)
    }

    /// As [`LocalStrategy::build`], reducing with `ops` (TensorFlow's `cross_device_ops=`
    /// argument): NCCL or Strata's CUDA kernels for GPU replicas, or any other implementation.
    pub(crate) fn build_with_ops(
        name: &'static str,
        devices: Vec<LogicalDevice>,
        policy: VariablePolicy,
        ops: Box<dyn CrossDeviceOps>,
        options: StrategyOptions,
    ) -> Result<Arc<dyn StrategyExtended>> {
        Self::build_inner(name, devices, policy, Err(ops), options, None)
    }

    /// As [`LocalStrategy::build`], with the cross-worker half of a multi-worker strategy.
    pub(crate) fn build_with(
        name: &'static str,
        devices: Vec<LogicalDevice>,
        policy: VariablePolicy,
        reduction: CpuReduction,
        options: StrategyOptions,
        cross: Option<CrossWorker>,
    ) -> Result<Arc<dyn StrategyExtended>> {
        Self::build_inner(name, devices, policy, Ok(reduction), options, cross)
    }

    /// `reduction`: the CPU reduction to build, or ready-made ops.
    fn build_inner(
        name: &'static str,
        devices: Vec<LogicalDevice>,
        policy: VariablePolicy,
        reduction: std::result::Result<CpuReduction, Box<dyn CrossDeviceOps>>,
        options: StrategyOptions,
        cross: Option<CrossWorker>,
    ) -> Result<Arc<dyn StrategyExtended>> {
        if devices.is_empty() {
            return Err(Error::ZeroReplicas);
        }
        strata_core::check_zero_strategy(options.zero_stage, name)?;
        if cross.is_none() {
            strata_core::local_sgd::check_local_sgd_strategy(options.local_sgd.as_ref(), name)?;
        }
        strata_core::device::check_replicas(devices.len(), "replicas")?;
        for (i, d) in devices.iter().enumerate() {
            if let Some(j) = devices[..i].iter().position(|e| e.spec == d.spec) {
                return Err(Error::InvalidDeviceList(format!(
                    "{} is listed twice (replicas {j} and {i}); list each device once",
                    d.spec
                )));
            }
            strata_core::runtime::candle_device(d)?;
        }
        let n = devices.len();
        let (ops, workers, auto_shard): (Box<dyn CrossDeviceOps>, _, _) = match reduction {
            Ok(reduction) => {
                let ops = match reduction {
                    CpuReduction::InMemoryAllReduce => CpuCrossDeviceOps::in_memory_all_reduce(n)?,
                    CpuReduction::ReductionToOneDevice => CpuCrossDeviceOps::reduction_to_one_device(n)?,
                };
                let ops = ops.with_devices(devices.iter().map(|d| d.spec.clone()).collect())?;
                match cross {
                    None => (Box::new(ops), None, AutoShardPolicy::Data),
                    Some(c) => ((c.ops)(ops), Some(c.workers), c.auto_shard),
                }
            }
            Err(ops) => (ops, None, AutoShardPolicy::Data),
        };
        let pools = ReplicaPools::for_devices(&devices)?;
        let candle_threads = candle_core::utils::get_num_threads();
        if let Some(d) = devices
            .iter()
            .find(|d| matches!(d.kind, LogicalKind::Cpu { threads, .. } if threads > 1 && threads != candle_threads))
        {
            tracing::warn!(
                device = %d.spec,
                candle_threads,
                "{} runs its replica on a pool of {:?} threads, but candle splits each matmul for {candle_threads}; set RAYON_NUM_THREADS to the device's thread count before the process starts",
                d.spec,
                d.kind
            );
        }
        if n > 1 && candle_threads > 1 && std::env::var_os("CANDLE_NUM_THREADS").is_none() {
            tracing::warn!(
                candle_threads,
                replicas = n,
                "candle's CPU kernels spread each call over {candle_threads} threads and its element-wise pool serves one caller at a time, so {n} replicas will contend; call strata::init_cpu_threads() first in main (or set CANDLE_NUM_THREADS=1 RAYON_NUM_THREADS=1)"
            );
        }
        tracing::debug!(strategy = name, replicas = n, ops = ops.name(), "strategy created");
        Ok(Arc::new(Self { id: StrategyId::fresh(), name, devices, policy, ops, options, pools, workers, auto_shard }))
    }
}

impl StrategyExtended for LocalStrategy {
    fn id(&self) -> StrategyId {
        self.id
    }
    fn name(&self) -> &'static str {
        self.name
    }
    fn replica_devices(&self) -> &[LogicalDevice] {
        &self.devices
    }
    fn variable_policy(&self) -> VariablePolicy {
        self.policy
    }
    fn cross_device_ops(&self) -> &dyn CrossDeviceOps {
        self.ops.as_ref()
    }
    fn options(&self) -> &StrategyOptions {
        &self.options
    }
    fn execute(&self, weights: &[f32], job: &ReplicaJob<'_>) -> Result<()> {
        execute_local(self, &self.pools, weights, job)
    }
    fn workers(&self) -> Option<&dyn WorkerCollectives> {
        self.workers.as_deref()
    }
    fn worker_collectives(&self) -> Option<Arc<dyn WorkerCollectives>> {
        self.workers.clone()
    }
    fn auto_shard(&self) -> AutoShardPolicy {
        self.auto_shard
    }
}

/// Defines a single-machine strategy type over [`LocalStrategy`]: `pub struct $ty` (holding its
/// `Arc<dyn StrategyExtended>`) with `new`, `with_options`, `with_cross_device_ops` and
/// `logical_cpus`, and its `Strategy` implementation. The types differ only in their name, their
/// [`VariablePolicy`] and the docs of `new` and `with_options`.
macro_rules! local_strategy {
    (
        $(#[$meta:meta])*
        pub struct $ty:ident;
        name: $name:literal,
        policy: $policy:expr,
        new: $new_doc:literal,
        with_options: $options_doc:literal $(,)?
    ) => {
        $(#[$meta])*
        #[derive(Clone, Debug)]
        pub struct $ty {
            ext: std::sync::Arc<dyn strata_core::StrategyExtended>,
        }

        impl $ty {
            #[doc = $new_doc]
            pub fn new(devices: Vec<strata_core::device::LogicalDevice>) -> strata_core::Result<Self> {
                Self::with_options(devices, $crate::local::CpuReduction::default(), strata_core::StrategyOptions::default())
            }

            #[doc = $options_doc]
            pub fn with_options(
                devices: Vec<strata_core::device::LogicalDevice>,
                reduction: $crate::local::CpuReduction,
                options: strata_core::StrategyOptions,
            ) -> strata_core::Result<Self> {
                Ok(Self { ext: $crate::local::LocalStrategy::build($name, devices, $policy, reduction, options)? })
            }

            /// One replica per device, reducing with `ops` (TensorFlow's `cross_device_ops=`): for
            /// GPU replicas, the ops strata-cuda's selection rule picks (NCCL or Strata's kernels).
            /// `ops` must be built for exactly these devices, in this order.
            pub fn with_cross_device_ops(
                devices: Vec<strata_core::device::LogicalDevice>,
                ops: Box<dyn strata_core::cross_device::CrossDeviceOps>,
                options: strata_core::StrategyOptions,
            ) -> strata_core::Result<Self> {
                Ok(Self { ext: $crate::local::LocalStrategy::build_with_ops($name, devices, $policy, ops, options)? })
            }

            /// `n` logical CPU devices of one thread each.
            pub fn logical_cpus(n: usize) -> strata_core::Result<Self> {
                Self::new(strata_core::device::logical_cpus(n)?)
            }
        }

        impl strata_core::Strategy for $ty {
            fn extended(&self) -> &std::sync::Arc<dyn strata_core::StrategyExtended> {
                &self.ext
            }
        }
    };
}

pub(crate) use local_strategy;

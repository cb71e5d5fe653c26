//! # strata-strategies
//!
//! The distribution strategies: [`OneDeviceStrategy`], [`MirroredStrategy`] and
//! [`CentralStorageStrategy`] run their replicas as threads of this process, one thread per
//! logical device. Model code is the same under every one of them:
//!
//! ```
//! use candle_nn::{Module, Optimizer, SGD};
//! use strata_core::{Strategy, ReduceOp};
//! use strata_strategies::MirroredStrategy;
//!
//! let strategy = MirroredStrategy::logical_cpus(2)?;
//! let model = strategy.scope(|s| candle_nn::linear(3, 1, s.var_builder().pp("fc")))?;
//! let opt = model.optimizer::<SGD>(0.1)?;
//! let losses = strategy.run(|ctx| {
//!     let x = candle_core::Tensor::ones((4, 3), candle_core::DType::F32, ctx.candle_device())?;
//!     let loss = model.on(ctx)?.forward(&x)?.sqr()?.mean_all()?;
//!     ctx.backward_and_sync(&loss, &opt)?;
//!     Ok(loss.to_scalar::<f32>()?)
//! })?;
//! let mean = strategy.reduce(ReduceOp::Mean, &losses)?;
//! assert!(mean.is_finite());
//! # Ok::<(), strata_core::Error>(())
//! ```
//!
//! A model's embedding tables are variables under these strategies, or, with a
//! [`LocalTables`] in `StrategyOptions::tables`, rows in this process's memory stepped one by
//! one by a row optimizer (only the rows a step touched change).

// The facade (the strata crate) re-exports this crate's items: every public one is documented.
#![warn(missing_docs)]

mod central_storage;
pub mod cluster;
mod local;
mod local_tables;
mod mirrored;
mod multi_worker;
#[cfg(feature = "nccl")]
pub mod nccl;
mod one_device;
pub mod parameter_server;

pub use central_storage::CentralStorageStrategy;
pub use cluster::{
    ClusterConfig, ClusterResolver, ClusterSpec, SimpleClusterResolver, SlurmClusterResolver, TFConfigClusterResolver,
    TaskId, TaskType,
};
pub use local::CpuReduction;
pub use local_tables::LocalTables;
pub use mirrored::MirroredStrategy;
pub use multi_worker::{
    CrossWorkerOps, CrossWorkerSetup, ElasticOptions, MultiWorkerMirroredStrategy, MultiWorkerOptions,
};
pub use one_device::OneDeviceStrategy;
pub use parameter_server::{
    ClusterCoordinator, ParameterServerOptions, ParameterServerStrategy, Partitioner, PlacementPolicy, PsModel,
    PsWorkerModel, StepRegistry, WorkerContext, WorkerOptions,
};

//! TF's `ParameterServerStrategy`: variables live, split into shards, on `ps` tasks that apply
//! gradients with a server-side optimizer; `worker` tasks run the step functions a
//! [`ClusterCoordinator`] schedules; the coordinator creates the variables
//! ([`ParameterServerStrategy::scope`]) and evaluates the pulled values.
//!
//! Every task runs the same binary, and steps are registered by name on the workers
//! ([`StepRegistry`], see [`worker`]), because a closure cannot travel.

pub mod coordinator;
pub mod partition;
pub mod strategy;
pub mod tables;
mod task_threads;
pub mod worker;
pub mod worker_model;

pub use coordinator::{ClusterCoordinator, CoordinatorOptions, RemoteValue};
pub use partition::{rows_per_shard, shard_range, Partitioner, PlacedShard, Placement, PlacementPolicy};
pub use strategy::{ParameterServerOptions, ParameterServerStrategy, PsModel};
pub use tables::{PsTables, RowsPush, TableTraffic};
pub use worker::{
    serve_worker, OverlappedPush, PullTicket, PushSummary, StepRegistry, WorkerContext, WorkerOptions,
    WorkerStepHandler,
};
pub use worker_model::{PsStep, PsWorkerModel, PushToPs, DEFAULT_PUSH_BUCKET_BYTES};

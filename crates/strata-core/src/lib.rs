//! # strata-core
//!
//! The core of Strata, a framework for data-parallel training with distribution strategies in
//! the spirit of TensorFlow's `tf.distribute`: the user-facing [`Strategy`] trait and the
//! implementer's [`StrategyExtended`], [`ReplicaContext`], devices and their visibility rules,
//! distributed values ([`PerReplica`], [`Mirrored`]) and variables, [`ReduceOp`], the
//! [`CrossDeviceOps`](cross_device::CrossDeviceOps) that combine replicas' values, and
//! datasets that split global batches into per-replica shards.
//!
//! Outside any scope, the default strategy (one replica on the CPU) answers, so library code
//! can reduce unconditionally:
//!
//! ```
//! use strata_core::{Strategy, StrategyHandle, ReduceOp};
//!
//! let strategy = StrategyHandle::current(); // no scope entered: the default strategy
//! assert_eq!(strategy.num_replicas_in_sync(), 1);
//! let per_replica = strategy.run(|ctx| Ok(ctx.replica_id() as f32 + 1.5))?;
//! assert_eq!(strategy.reduce(ReduceOp::Sum, &per_replica)?, 1.5);
//! # Ok::<(), strata_core::Error>(())
//! ```
//!
//! The strategies themselves (`MirroredStrategy`, `CentralStorageStrategy`, ...) live in
//! `strata-strategies`; the `strata` crate re-exports everything.
//!
//! ## Batches
//!
//! Datasets and steps take any batch that splits along its first axis
//! ([`data::BatchData`]): a tensor of any dtype, tuples and named maps of tensors, the
//! features-and-labels [`data::Batch`], or a type of one's own. Each replica gets a
//! contiguous run of the global batch's rows and a weight of its rows over the global rows,
//! so uneven batches train exactly as one device would; across workers the
//! [`AutoShardPolicy`](extended::AutoShardPolicy) (`Data`, `Off`, `File`) applies to every
//! kind, and [`data::files`] streams datasets larger than memory from record files.
//!
//! ## What each strategy does with each kind of variable
//!
//! Every variable a model builds in a [`Scope`] has a [`VariableKind`]; whatever the strategy,
//! training ends where one device's would (the tests of `strata-strategies` check it for a
//! CNN, unused heads, frozen layers and BatchNorm under SGD, momentum and AdamW):
//!
//! | kind | Mirrored | CentralStorage | MultiWorkerMirrored | ParameterServer |
//! |---|---|---|---|---|
//! | **trainable**, with a gradient on some replica | a copy per replica; the gradients are all-reduced (weighted by each shard's share, zeros for replicas without one) and every copy steps its optimizer identically | one central copy; the gradients are reduced to it and one optimizer steps it | as Mirrored, reduced in memory, then on the ring across workers | on the ps tasks; a worker pulls it each step, pushes the reduced gradient, and the task's optimizer applies it (a sync round: the mean over its pushes, zeros for a push without it) |
//! | **unused** in a step (no replica, on any worker, has a gradient) | not reduced, not stepped: no weight decay, its optimizer state unchanged (TensorFlow skips a `None` gradient) | the same | the same: the presence of each gradient is agreed across workers first | not pushed, not updated; the task counts the step |
//! | **frozen** ([`Scope::frozen_var_builder`], or [`Replicated::freeze`] by name) | never reduced, never updated, never communicated; the frozen builder also spares computing its gradient | the same | the same | pulled once per worker, never pushed nor updated |
//! | **non-trainable state** (BatchNorm's running statistics, [`Scope::state_var_builder`]) | each replica updates its own copy in training; reading it ([`Replicated::values`], [`Replicated::sync_state`], evaluation, checkpoints) gives the mean over replicas: TensorFlow's sync-on-read `MEAN` | a copy per replica (never one copy written by two threads), read as their mean | each worker's replicas' mean, and after [`Replicated::sync_state`] (which evaluation, checkpoints and `--save-params` call) the mean over every replica of every worker | on the ps tasks: each step pulls it and pushes the replicas' mean change, which the task adds (no optimizer) |
//! | **[`layers::SyncBatchNorm`]** | the batch statistics of the global batch (all-reduced in forward and backward), so training equals one device's BatchNorm on the global batch | the same | the same, across workers | the statistics of the worker's batch, over its own replicas |
//!
//! ## Layers
//!
//! The modules form layers; a module uses only those below it (`tests/module_graph.rs` checks
//! that the `crate::` paths between them have no cycle):
//!
//! - [`error`](Error), `reduce` ([`ReduceOp`]), `values` ([`PerReplica`], [`Mirrored`]),
//!   [`timeline`], [`group`], [`device`], [`checkpoint`], [`embedding`] (tables, their rows'
//!   initial values and owners): the leaf vocabulary;
//!   [`optim`] uses the checkpoint's `OptimizerState`;
//! - [`cross_device`]: the collective interfaces and their CPU implementations;
//! - [`extended`]: what a strategy implementation provides ([`StrategyExtended`] and its
//!   vocabulary) and the [`ReplicaContext`] type a job receives;
//! - [`context`]: the replica context's collectives, and [`context::ReplicaHandle`] (a
//!   replica's collectives for layers, found through the thread);
//! - [`layers`]: layers whose computation spans the replicas ([`layers::SyncBatchNorm`]);
//! - [`runtime`]: running a step on replica threads, the default strategy;
//! - [`scope`]: the scope stack ([`get_strategy`]);
//! - [`data`]: batches ([`data::BatchData`]), shards, distributed datasets, record files;
//! - `overlap_plan`: the plan of a step's reductions (buckets, blocks of rows, their order);
//! - `zero`: ZeRO's shards ([`ZeroStage`]): their layout on that plan, pieces and step, gather,
//!   memory check, checkpoint state and re-split, and stage 3's released variables brought
//!   back from the shards by unit ([`unit_name`]);
//! - [`variables`]: the scope's variables ([`Scope`], [`Replicated`], [`DistributedVariable`],
//!   [`SyncOnReadVariable`]);
//! - [`embedding_layer`]: the [`Embedding`] layer, a table made in a scope (a whole trainable
//!   variable under the strategies that keep variables whole);
//! - [`local_sgd`]: local SGD and DiLoCo's outer synchronisation ([`LocalSgd`]), fragments
//!   met at staggered steps, their exchanges overlapped with the inner steps;
//! - [`distributed_optimizer`]: the [`DistributedOptimizer`] (build, apply, clipping, schedule,
//!   accumulation), over the optimizers' [`optim::OptimizerMemory`] and
//!   [`optim::ShardableOptimizer`];
//! - `overlap`: a replica's step ([`ReplicaContext::backward_and_sync`]), its reductions
//!   overlapped with the backward pass;
//! - `footprint`: the bytes a replica holds live in a step, counted ([`Footprint`]);
//! - [`strategy`]: the user-facing [`Strategy`] and [`StrategyHandle`];
//! - [`elastic`]: recovery of an elastic job's training loop ([`Elastic`]) and checkpoints of
//!   a model and its optimizer.

// The facade (the strata crate) re-exports this crate's items: every public one is documented.
#![warn(missing_docs)]

pub mod checkpoint;
pub mod context;
pub mod cross_device;
pub mod data;
pub mod device;
pub mod distributed_optimizer;
pub mod elastic;
pub mod embedding;
pub mod embedding_layer;
mod error;
pub mod extended;
mod footprint;
pub mod group;
pub mod layers;
pub mod local_sgd;
pub mod optim;
mod overlap;
mod overlap_plan;
pub mod precision;
mod recompute;
mod reduce;
pub mod runtime;
pub mod scope;
pub mod strategy;
pub mod table_rows;
pub mod timeline;
mod units;
mod values;
pub mod variables;
mod zero;

pub use checkpoint::{
    keep_last, latest_checkpoint, read_checkpoint, write_checkpoint, Checkpoint, CheckpointTensor, CheckpointWriter,
    LoadedTensor, OptimizerState, ShardInfo,
};
pub use distributed_optimizer::DistributedOptimizer;
pub use elastic::{Elastic, StatefulOptimizer};
pub use embedding_layer::Embedding;
pub use error::{Error, MemoryLimitExceeded, MemoryLimitInStep, Result};
pub use extended::{
    CrossReplicaContext, ReplicaContext, StrategyExtended, StrategyId, StrategyOptions, VariablePolicy, ZeroStage,
};
pub use footprint::Footprint;
pub use local_sgd::{LocalSgd, OuterOptimizer};
pub use precision::{cast_like, LossScale, LossScaleState, Precision};
pub use recompute::recompute;
pub use reduce::ReduceOp;
pub use scope::{get_strategy, has_strategy};
pub use strategy::{Strategy, StrategyHandle};
pub use values::{Mirrored, PerReplica};
pub use variables::{DistributedVariable, Replicated, Scope, SyncOnReadVariable, VariableAggregation, VariableKind};
pub use zero::{check_zero_optimizer, check_zero_strategy, unit_name};

//! # Strata
//!
//! Distribution strategies for data-parallel training in Rust, in the spirit of TensorFlow's
//! `tf.distribute`: a program that trains a candle model on one device trains it on several by
//! changing one line, the strategy.
//!
//! ```
//! use candle_nn::{AdamW, ParamsAdamW};
//! use strata::prelude::*;
//! use strata::model::{Classifier, Mlp};
//! use strata::data::TailPolicy;
//!
//! let strategy = MirroredStrategy::logical_cpus(2)?;       // or OneDeviceStrategy::cpu()?
//! let model = strategy.scope(|s| Mlp::new(s.var_builder(), 64, &[32], 10))?;
//! let opt = model.optimizer::<AdamW>(ParamsAdamW { lr: 0.01, ..Default::default() })?;
//!
//! let (train, _test) = strata::digits::train_test_split(&strata::digits::load(None)?, 0.2, 0);
//! let batches = train.labels.chunks(256).enumerate().map(|(i, c)| train.slice(i * 256..i * 256 + c.len()));
//! for batch in strategy.distribute_dataset(batches, TailPolicy::Split) {
//!     let losses = strategy.run_batch(&batch, |ctx, shard| {
//!         let x = shard.batch.features_tensor(ctx.candle_device())?;
//!         let y = shard.batch.labels_tensor(ctx.candle_device())?;
//!         let loss = model.on(ctx)?.loss(&x, &y)?;       // the replica's copy of the model
//!         ctx.backward_and_sync(&loss, &opt)?;           // all-reduce grads, apply on every replica
//!         Ok(loss.to_scalar::<f32>()? * shard.weight())
//!     })?;
//!     let loss = strategy.reduce(ReduceOp::Sum, &losses)?;
//!     assert!(loss.is_finite());
//! }
//! # Ok::<(), strata::Error>(())
//! ```
//!
//! Any candle model works the same way: build it from the scope's `VarBuilder` (frozen parts
//! from `frozen_var_builder`, or frozen afterwards by name with [`Replicated::freeze`]), and
//! train it with a loop like the one above or with [`trainer::Trainer::fit`] and a
//! [`trainer::Task`] (a loss closure and metrics). What each strategy does with trainable,
//! unused and frozen variables, with non-trainable state such as BatchNorm's statistics, and
//! with [`layers::SyncBatchNorm`], is tabled in the crate docs of `strata_core` (under "What
//! each strategy does with each kind of variable"): in short, every strategy ends where one
//! device would; unused and frozen variables are never stepped and frozen ones never
//! communicated; state is each replica's own and reads as the mean over replicas and workers
//! (TensorFlow's sync-on-read `MEAN`), on the ps tasks it is pulled and its mean change pushed.
//!
//! Call [`init_cpu_threads`] first thing in `main` so that every replica runs candle's CPU
//! kernels on its own thread (the `strata` binary does).
//!
//! ## Main types
//!
//! - The strategies: [`OneDeviceStrategy`] (one device, the baseline), [`MirroredStrategy`]
//!   (replicas on this machine, gradients all-reduced), [`CentralStorageStrategy`] (variables
//!   once on the CPU, replicas compute), [`MultiWorkerMirroredStrategy`] (mirrored across worker
//!   processes) and [`ParameterServerStrategy`] (variables on ps tasks, steps scheduled on
//!   workers by a [`ClusterCoordinator`]).
//! - [`Strategy`]: what every strategy offers (`scope`, `run_batch`, `reduce`, datasets);
//!   [`StrategyExtended`]: what a strategy implements; [`StrategyHandle`]: one chosen at run time.
//! - [`Scope`]: what the scope closure gets, the `VarBuilder`s that create the strategy's
//!   variables.
//! - [`ReplicaContext`]: one replica's view of a step (its device, collectives,
//!   `backward_and_sync`).
//! - [`PerReplica`] / [`Mirrored`]: one value per replica / identical copies on every replica.
//! - [`ReduceOp`]: how the replicas' values combine (sum, mean, max, min).
//! - [`trainer::Trainer`], [`trainer::Task`], [`trainer::TrainConfig`]: the training loop
//!   (`fit`), what it trains (a loss and metrics), and how (epochs, batch, checkpoints).
//! - [`Elastic`]: elastic recovery around the steps of a loop of your own (a lost, leaving or
//!   joining worker costs the step in flight, not the job), as `Trainer::fit` uses it.
//! - [`data::BatchData`] / [`data::TailPolicy`]: a batch a strategy can split among replicas /
//!   what happens to batches too small to split evenly.
//! - [`optim::FusedAdamW`] / [`optim::FusedSgd`]: in-place optimizers with candle's results.
//! - [`cluster::TFConfigClusterResolver`], [`cluster::SlurmClusterResolver`],
//!   [`cluster::SimpleClusterResolver`] ([`cluster::ClusterResolver`]s): where a job's cluster
//!   and this process's task come from.
//! - [`ClusterToken`]: the secret every task of a cluster shares.
//! - [`Error`] / [`Result`]: this crate's error, into which every error of the crates it
//!   re-exports converts with `?`; [`Error::exit_code`] is the process's exit code for it.
//!
//! ## Where to read more
//!
//! The modules below document the rest (models, data sets, fused kernels, the parameter-server
//! job, metrics; [`ctr`]: a click-through workload, generated Criteo-shaped records and a
//! DLRM-style model over an embedding table). The user guide is the mdBook in the repository's `docs/` directory
//! (`mdbook build docs`): getting started, each strategy, your own model and data, multi-worker
//! and parameter-server jobs, GPUs, faults and checkpoints, limits and errors.

#![deny(missing_docs)]

pub mod cnn;
pub mod ctr;
pub mod digits;
#[cfg(doctest)]
mod doc_snippets;
mod error;
pub mod fused;
pub mod gpu;
pub mod kind;
pub mod metrics;
pub mod model;
pub mod ps_job;
pub mod refusals;
pub mod shakespeare;
pub mod trainer;
pub mod transformer;

pub use error::{Error, Result};
pub use kind::{Hyper, NamedKind, OptimizerKind, StrategyKind};
pub use strata_core::checkpoint;
pub use strata_core::elastic;
pub use strata_core::elastic::{Elastic, Position, StatefulOptimizer, Stepped};
pub use strata_core::recompute;
pub use strata_core::Error as CoreError;
pub use strata_core::Result as CoreResult;
pub use strata_core::{
    cast_like, context, cross_device, data, device, group, layers, local_sgd, optim, precision, timeline,
    CrossReplicaContext, DistributedOptimizer, DistributedVariable, Footprint, LocalSgd, LossScale, LossScaleState,
    Mirrored, OuterOptimizer, PerReplica, Precision, ReduceOp, ReplicaContext, Replicated, Scope, Strategy,
    StrategyExtended, StrategyHandle, StrategyOptions, SyncOnReadVariable, VariableAggregation, VariableKind,
    VariablePolicy, ZeroStage,
};
pub use strata_strategies::cluster;
pub use strata_strategies::parameter_server;
pub use strata_strategies::parameter_server::{ClusterCoordinator, ParameterServerOptions, ParameterServerStrategy};
pub use strata_strategies::{
    CentralStorageStrategy, CpuReduction, ElasticOptions, LocalTables, MirroredStrategy, MultiWorkerMirroredStrategy,
    MultiWorkerOptions, OneDeviceStrategy,
};
pub use strata_transport::ps;
pub use strata_transport::ClusterToken;

/// The names most programs need.
pub mod prelude {
    pub use crate::cluster::{ClusterResolver, SlurmClusterResolver, TFConfigClusterResolver};
    pub use crate::{
        CentralStorageStrategy, ClusterCoordinator, ClusterToken, MirroredStrategy, MultiWorkerMirroredStrategy,
        MultiWorkerOptions, OneDeviceStrategy, ParameterServerOptions, ParameterServerStrategy, PerReplica, ReduceOp,
        ReplicaContext, Strategy, StrategyHandle,
    };
    pub use crate::{Elastic, Stepped};
}

/// Makes candle's CPU kernels single-threaded per caller, so that each replica thread is one
/// core's worth of work (a logical CPU device of one thread), unless the user already chose
/// through `CANDLE_NUM_THREADS` / `RAYON_NUM_THREADS`.
///
/// candle reads these variables once, when its thread pools start, and its element-wise pool
/// serialises concurrent callers, so replicas running in parallel must not share it. Call this
/// first thing in `main`, before any thread is started: changing the environment while other
/// threads may read it is not sound.
pub fn init_cpu_threads() {
    for var in ["CANDLE_NUM_THREADS", "RAYON_NUM_THREADS"] {
        if std::env::var_os(var).is_none() {
            std::env::set_var(var, "1");
        }
    }
}

/// The CPU backend candle's matrix products run on in this build, and the widest vector
/// kernels it uses on this CPU (detected now), for instance
/// `"gemm crate, x86-v4 kernels on (AVX-512 in use)"`; where candle's `rows_gemm` takes the
/// products of two row-major f32 operands from gemm (AVX2 code), it says so. Benchmarks print
/// it beside their figures.
pub fn cpu_backend() -> String {
    let widest = match simd_level() {
        SIMD_V4 => "AVX-512 in use",
        SIMD_V3 if cpu_has_avx512() => "AVX2 in use; this CPU has AVX-512, which the avx512 feature would use",
        SIMD_V3 => "AVX2 in use",
        _ => "no AVX2: SSE or scalar kernels",
    };
    let v4 = if cfg!(feature = "avx512") { "on" } else { "off" };
    // candle's own f32 kernel for two row-major operands, where it takes them from gemm.
    let rows = if simd_level() == SIMD_V3 && candle_core::cpu_backend::rows_gemm::available() {
        "; f32 products of two row-major operands (k and n from 512): rows_gemm, AVX2"
    } else {
        ""
    };
    format!("gemm crate, x86-v4 kernels {v4} ({widest}){rows}")
}

const SIMD_V4: &str = "x86-v4 (AVX-512)";
const SIMD_V3: &str = "x86-v3 (AVX2 and FMA)";

fn cpu_has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::is_x86_feature_detected!("avx512f");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The vector instructions the CPU kernels of this build run on this CPU: `"x86-v4
/// (AVX-512)"`, `"x86-v3 (AVX2 and FMA)"` or `"baseline (SSE2 or scalar)"`. gemm (candle's
/// matrix products) and [`fused`]'s kernels choose at run time, between the levels this build
/// has: x86-v4 only with the `avx512` feature, so a build without it (`cargo build
/// --no-default-features`) runs as on an AVX2 host whatever the CPU.
pub fn simd_level() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    let avx2 = false;
    match (cfg!(feature = "avx512") && cpu_has_avx512(), avx2) {
        (true, _) => SIMD_V4,
        (false, true) => SIMD_V3,
        (false, false) => "baseline (SSE2 or scalar)",
    }
}

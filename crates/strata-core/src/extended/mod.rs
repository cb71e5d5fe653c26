//! What a strategy implementation provides: [`StrategyExtended`] (TensorFlow's name) and the
//! vocabulary it is written in ([`StrategyId`], [`VariablePolicy`], [`StrategyOptions`],
//! [`AutoShardPolicy`], [`WorkerCollectives`], [`ReplicaJob`]), and the type a job receives on
//! each replica, [`ReplicaContext`] (with its step's [`StepShared`]).
//!
//! This is the bottom of the strategy machinery: it depends only on the leaf vocabulary
//! (devices, errors, the timeline, the replica group and the collective interfaces of
//! [`cross_device`](crate::cross_device), where [`WorkerCollectives`] is defined next to
//! `CrossDeviceOps` since the hierarchical cross-device op uses it; it is re-exported here).
//! The context's type lives in this file because the two refer to each other (a job receives
//! a `ReplicaContext`, a context holds its strategy: one file, so that no two files import
//! each other); its collectives are in
//! [`context`](crate::context), the optimizer step in
//! [`distributed_optimizer`](crate::distributed_optimizer) and `overlap`, and the user-facing [`Strategy`](crate::strategy::Strategy) sits above all of them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use crate::cross_device::WorkerCollectives;

pub mod local_sgd;
use crate::cross_device::{CrossDeviceOps, DEFAULT_BUCKET_BYTES, DEFAULT_ROW_BLOCK_BYTES};
use crate::device::{candle_device, LogicalDevice};
use crate::group::{ReplicaGroup, DEFAULT_COLLECTIVE_TIMEOUT};
use crate::timeline::{Timeline, TimelineSpan};
use crate::{Error, Result};
use candle_core::Device;

/// Identifies one strategy object; values and variables remember the strategy that made them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StrategyId(u64);

impl StrategyId {
    /// A fresh id.
    pub fn fresh() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        StrategyId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

impl std::fmt::Display for StrategyId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Where a strategy keeps variables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VariablePolicy {
    /// A copy per replica, kept identical by synchronised writes (Mirrored, OneDevice).
    Mirrored,
    /// One copy on the parameter device; replicas read it and reduce their gradients to it.
    /// `parameter_replica` is the replica thread that applies the update.
    Central {
        /// The replica that applies updates on behalf of the parameter device.
        parameter_replica: usize,
    },
}

/// Settings every strategy shares.
#[derive(Clone, Debug)]
pub struct StrategyOptions {
    /// Gradient fusion bucket size in bytes (default 25 MiB, DDP's; 0 disables fusion). An
    /// overlapped step across workers also cuts its buckets at an eighth of the model's
    /// gradient (at least 1 MiB), so that the first starts well before the pass ends.
    pub bucket_bytes: usize,
    /// Deadline of every collective (default 60 s).
    pub collective_timeout: Duration,
    /// Where step phases are recorded, if anywhere.
    pub timeline: Option<Arc<Timeline>>,
    /// Seed of variable initialisation.
    pub seed: u64,
    /// Reduce each bucket of gradients as soon as its last gradient is final, while the
    /// backward pass goes on (default `true`; the buckets follow the order gradients became
    /// ready in the first step, which reduces without overlap). The results are the same: bit
    /// for bit where each element's sum keeps its order (in memory, two workers).
    pub overlap: bool,
    /// With overlap across workers, the gradient of a weight used once, as `x.matmul(&w.t())`
    /// (candle-nn's `Linear`) or `x.matmul(&w)`, of at least two blocks of this many bytes is
    /// computed and reduced in blocks of rows, each sent while the backward pass computes the
    /// next (default 2 MiB; 0 keeps every gradient whole). A large layer's gradient then
    /// crosses the link while it is being computed, instead of after. Not under PowerSGD,
    /// which compresses whole matrices, nor with ops that reduce on a GPU.
    pub row_block_bytes: usize,
    /// How the optimizer state is split over the replicas ([ZeRO](ZeroStage); default
    /// [`ZeroStage::Off`], a whole copy on every replica). Mirrored and MultiWorkerMirrored
    /// take it; the other strategies refuse any stage but [`ZeroStage::Off`].
    pub zero_stage: ZeroStage,
    /// ZeRO stage 3's units, as FSDP2's `fully_shard` names modules: each a prefix of variable
    /// names (`block3`, `encoder.layer.0`). A trainable variable is in the longest one its name
    /// starts with (followed by a dot, or the whole name), otherwise in its default unit
    /// ([`unit_name`](crate::unit_name)). Empty by default; a prefix that names no trainable
    /// variable is refused in one line when the optimizer is built, and below stage 3 they are
    /// not used.
    pub zero_units: Vec<String>,
    /// At [`ZeroStage::Off`], mirrored replicas on one machine's CPU (no workers) step as
    /// stage 1 does where the optimizer steps shards
    /// ([`ShardableOptimizer`](crate::optim::ShardableOptimizer)): each replica steps its
    /// shard, summing every replica's gradient in the step with the in-memory CPU reductions
    /// (no reduction pass), keeps its shard's state, and the shards are written into every
    /// copy. The same bits as every replica stepping the whole model, with one pass of the
    /// optimizer per machine instead of one per replica (default `true`; `false` steps every
    /// copy whole).
    pub host_shards: bool,
    /// Local SGD or DiLoCo ([`LocalSgd`](local_sgd::LocalSgd)): every step local to a
    /// worker, the workers meeting every `H` steps (`None`, the default, or `H = 1` averaging:
    /// every step synchronous). MultiWorkerMirrored takes it; the other strategies refuse it.
    pub local_sgd: Option<local_sgd::LocalSgd>,
    /// Where embedding tables live when not as variables
    /// ([`TableStore`](crate::embedding::TableStore): a parameter-server worker's ps tasks, or
    /// hybrid training's). `None` (the default): every table is a variable of the model,
    /// reduced as any other.
    pub tables: Option<Arc<dyn crate::embedding::TableStore>>,
}

/// ZeRO's stages (DeepSpeed; PyTorch's `ZeroRedundancyOptimizer`): what each replica, across
/// every worker, keeps of its own shard only. The shards split the model's trainable
/// parameters, flattened in the optimizer's order, evenly at element granularity, so one large
/// weight is shared too. Results are the same as [`ZeroStage::Off`]'s, bit for bit: every
/// replica steps its shard with the same reduced gradient, and an all-gather brings every
/// replica's parameters back.
///
/// Stage 3 shards the parameters too: each replica holds its shard of every trainable
/// parameter, and a variable's whole value exists only while it is in use: brought back from
/// every replica's shard on its first use in a step, and released again when the step moves on
/// to another unit of variables (see `zero::params`).
///
/// Non-exhaustive: a later stage is a new variant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ZeroStage {
    /// Stage 0: every replica keeps the whole optimizer state and steps every parameter.
    #[default]
    Off,
    /// Stage 1: every replica keeps the optimizer state of its shard and steps its shard only.
    OptimizerState,
    /// Stage 2: stage 1, and every replica keeps the reduced gradient of its shard only: the
    /// reduction writes back only the shard's elements, and the whole gradient buffers are
    /// released once reduced, before the optimizer steps.
    Gradients,
    /// Stage 3: stage 2, and every replica holds its shard of every trainable parameter only;
    /// a unit of variables (by default those that share the first part of their names, or the
    /// first two when the second is a number: `layer.3`) is gathered whole from every replica's
    /// shard when the step first uses it and released when it moves on to another unit.
    Parameters,
}

impl ZeroStage {
    /// The stage's number (0 to 3).
    pub fn number(self) -> u8 {
        match self {
            ZeroStage::Off => 0,
            ZeroStage::OptimizerState => 1,
            ZeroStage::Gradients => 2,
            ZeroStage::Parameters => 3,
        }
    }

    /// Whether each replica keeps the reduced gradient of its shard only (stages 2 and 3).
    pub fn shards_gradients(self) -> bool {
        matches!(self, ZeroStage::Gradients | ZeroStage::Parameters)
    }

    /// Whether each replica holds its shard of the parameters only (stage 3).
    pub fn shards_parameters(self) -> bool {
        self == ZeroStage::Parameters
    }
}

impl std::fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.number())
    }
}

impl std::str::FromStr for ZeroStage {
    type Err = crate::Error;

    /// `0`, `1`, `2` or `3`.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "0" => Ok(ZeroStage::Off),
            "1" => Ok(ZeroStage::OptimizerState),
            "2" => Ok(ZeroStage::Gradients),
            "3" => Ok(ZeroStage::Parameters),
            other => Err(crate::Error::InvalidArgument(format!(
                "zero stage {other:?} is not a stage; use 0 (whole optimizer state on every replica), 1 (each replica keeps its shard's), 2 (and its shard's gradient) or 3 (and its shard's parameters)"
            ))),
        }
    }
}

impl Default for StrategyOptions {
    fn default() -> Self {
        Self {
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            collective_timeout: DEFAULT_COLLECTIVE_TIMEOUT,
            timeline: None,
            seed: 0,
            overlap: true,
            row_block_bytes: DEFAULT_ROW_BLOCK_BYTES,
            zero_stage: ZeroStage::Off,
            zero_units: Vec::new(),
            host_shards: true,
            local_sgd: None,
            tables: None,
        }
    }
}

/// How a multi-worker strategy splits input across workers (TensorFlow's `AutoShardPolicy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AutoShardPolicy {
    /// Every worker reads the same global batches and keeps its slice of each: the job trains
    /// on exactly the batches one process would (the default).
    #[default]
    Data,
    /// No sharding: each worker's batches are its own part of the step.
    Off,
    /// Each worker reads whole files of a sharded dataset (files `i`, `i + W`, ... on worker
    /// `i` of `W`; TensorFlow's `AutoShardPolicy.FILE`) and its batches are its own part of
    /// the step, through [`Strategy::distribute_files`](crate::Strategy::distribute_files);
    /// other datasets are sharded by data.
    File,
}

/// A job run once on every replica.
pub type ReplicaJob<'a> = dyn Fn(&ReplicaContext<'_>) -> Result<()> + Sync + 'a;

/// What a strategy implementation provides (TensorFlow's `StrategyExtended`). Users call
/// [`Strategy`](crate::Strategy); implementers fill this in. Object safe, so strategies chosen at run time work
/// through `Arc<dyn StrategyExtended>`.
pub trait StrategyExtended: Send + Sync + std::fmt::Debug {
    /// This strategy object's id.
    fn id(&self) -> StrategyId;
    /// The strategy's name (`one-device`, `mirrored`, `central-storage`, ...).
    fn name(&self) -> &'static str;
    /// One logical device per replica, in replica order.
    fn replica_devices(&self) -> &[LogicalDevice];
    /// Where variables live.
    fn variable_policy(&self) -> VariablePolicy;
    /// How the replicas combine values.
    fn cross_device_ops(&self) -> &dyn CrossDeviceOps;
    /// Shared settings.
    fn options(&self) -> &StrategyOptions;
    /// Runs `job` once per replica, concurrently, and returns when every replica is done. The
    /// `weights` are each replica's share of the global batch (they sum to 1).
    fn execute(&self, weights: &[f32], job: &ReplicaJob<'_>) -> Result<()>;

    /// The number of replicas of this worker (one per replica device).
    fn num_replicas(&self) -> usize {
        self.replica_devices().len()
    }

    /// The other workers of a multi-worker strategy, if it has any.
    fn workers(&self) -> Option<&dyn WorkerCollectives> {
        None
    }

    /// The other workers of a multi-worker strategy, shared (for handles that outlive a
    /// borrow of the strategy, such as a replica's [`ReplicaHandle`](crate::context::ReplicaHandle)).
    fn worker_collectives(&self) -> Option<Arc<dyn WorkerCollectives>> {
        None
    }

    /// The workers a step's collectives span: [`workers`](Self::workers), but none under
    /// local SGD ([`StrategyOptions::local_sgd`]), whose steps stay on their worker and whose
    /// workers meet between steps.
    fn step_workers(&self) -> Option<&dyn WorkerCollectives> {
        match self.options().local_sgd {
            Some(_) => None,
            None => self.workers(),
        }
    }

    /// How input is split across workers.
    fn auto_shard(&self) -> AutoShardPolicy {
        AutoShardPolicy::Data
    }

    /// The number of replicas in sync across every worker.
    fn num_replicas_in_sync(&self) -> usize {
        self.num_replicas() * self.workers().map_or(1, |w| w.num_workers())
    }
}

// The type a job receives on each replica, and its accessors (its collectives are in
// `context`).

/// What the replicas of one step share.
pub struct StepShared<'a> {
    pub(crate) ext: &'a dyn StrategyExtended,
    pub(crate) group: std::sync::Arc<ReplicaGroup>,
    pub(crate) weights: &'a [f32],
    pub(crate) devices: Vec<Device>,
}

impl<'a> StepShared<'a> {
    /// The shared state of one step of `ext` whose replicas carry `weights` of the batch.
    pub fn new(ext: &'a dyn StrategyExtended, weights: &'a [f32]) -> Result<Self> {
        let n = ext.num_replicas();
        if weights.len() != n {
            return Err(Error::InvalidArgument(format!("{} batch weights for {n} replicas", weights.len())));
        }
        let devices = ext.replica_devices().iter().map(candle_device).collect::<Result<_>>()?;
        let group = std::sync::Arc::new(ReplicaGroup::new(n, ext.options().collective_timeout)?);
        Ok(Self { ext, group, weights, devices })
    }

    /// The group the replicas meet in.
    pub fn group(&self) -> &ReplicaGroup {
        &self.group
    }
}

/// The cross-replica context handed to a [`ReplicaContext::merge_call`] function.
#[derive(Debug)]
pub struct CrossReplicaContext {
    /// The strategy's id.
    pub strategy: StrategyId,
    /// The number of replicas.
    pub num_replicas: usize,
}

/// One replica's view of a step (TensorFlow's `ReplicaContext`).
pub struct ReplicaContext<'a> {
    pub(crate) shared: &'a StepShared<'a>,
    pub(crate) replica: usize,
    /// This replica's share of the current global batch (changes between the steps of one
    /// execution, see [`Strategy::run_batches`](crate::Strategy::run_batches)).
    weight: std::sync::atomic::AtomicU32,
    /// The number of examples in the current global batch, over every worker.
    global_len: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for ReplicaContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaContext")
            .field("strategy", &self.shared.ext.name())
            .field("replica", &self.replica)
            .field("num_replicas", &self.num_replicas_in_sync())
            .finish()
    }
}

impl<'a> ReplicaContext<'a> {
    /// The context of `replica` in a step.
    pub fn new(shared: &'a StepShared<'a>, replica: usize) -> Self {
        Self {
            shared,
            replica,
            weight: std::sync::atomic::AtomicU32::new(shared.weights[replica].to_bits()),
            global_len: std::sync::atomic::AtomicU64::new(shared.ext.num_replicas_in_sync() as u64),
        }
    }

    /// Sets this replica's share of the global batch for the next step.
    pub fn set_batch_weight(&self, weight: f32) {
        self.weight.store(weight.to_bits(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Sets this replica's share of the global batch for the next step, and the global batch's
    /// number of examples (over every worker).
    pub fn set_batch(&self, weight: f32, global_len: usize) {
        self.set_batch_weight(weight);
        self.global_len.store(global_len as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// The number of examples in the current global batch, over every worker (the number of
    /// replicas in sync for a step without a batch, whose replicas each count one).
    pub fn batch_global_len(&self) -> usize {
        self.global_len.load(std::sync::atomic::Ordering::Relaxed) as usize
    }

    /// This replica's id, `0..num_replicas_in_sync()`.
    pub fn replica_id(&self) -> usize {
        self.replica
    }

    /// The number of replicas in sync.
    pub fn num_replicas_in_sync(&self) -> usize {
        self.shared.ext.num_replicas_in_sync()
    }

    /// This replica's index among every replica in sync, across workers (TensorFlow's
    /// `replica_id_in_sync_group`); [`ReplicaContext::replica_id`] is its index on this worker.
    pub fn replica_id_in_sync_group(&self) -> usize {
        let w = self.shared.ext.workers().map_or(0, |w| w.worker_index());
        w * self.shared.group.num_replicas() + self.replica
    }

    /// The id of the strategy running this step.
    pub fn strategy_id(&self) -> StrategyId {
        self.shared.ext.id()
    }

    /// The strategy running this step.
    pub fn strategy(&self) -> &dyn StrategyExtended {
        self.shared.ext
    }

    /// This replica's logical device.
    pub fn device(&self) -> &LogicalDevice {
        &self.shared.ext.replica_devices()[self.replica]
    }

    /// The candle device this replica computes on.
    pub fn candle_device(&self) -> &Device {
        &self.shared.devices[self.replica]
    }

    /// This replica's share of the global batch.
    pub fn batch_weight(&self) -> f32 {
        f32::from_bits(self.weight.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Starts a timeline phase on this replica (nothing is recorded without a timeline).
    pub fn phase(&self, cat: &'static str, name: &str) -> Option<TimelineSpan<'_>> {
        self.shared.ext.options().timeline.as_ref().map(|t| t.span(self.replica, cat, name))
    }
}

//! The user-facing [`Strategy`] and the implementer's [`StrategyExtended`].

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use candle_core::Tensor;

use crate::context::ReplicaContext;
use crate::cross_device::{CrossDeviceOps, DEFAULT_BUCKET_BYTES};
use crate::data::{DistributedBatch, DistributedDataset, InputContext, TailPolicy};
use crate::device::LogicalDevice;
use crate::group::DEFAULT_COLLECTIVE_TIMEOUT;
use crate::timeline::Timeline;
use crate::variables::{Replicated, Scope};
use crate::{Error, PerReplica, ReduceOp, Result};

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
    /// Gradient fusion bucket size in bytes (default 25 MiB; 0 disables fusion).
    pub bucket_bytes: usize,
    /// Deadline of every collective (default 60 s).
    pub collective_timeout: Duration,
    /// Where step phases are recorded, if anywhere.
    pub timeline: Option<Arc<Timeline>>,
    /// Seed of variable initialisation.
    pub seed: u64,
}

impl Default for StrategyOptions {
    fn default() -> Self {
        Self {
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            collective_timeout: DEFAULT_COLLECTIVE_TIMEOUT,
            timeline: None,
            seed: 0,
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
}

/// The cross-worker half of a multi-worker strategy: collectives between the workers of a
/// job. On each worker one replica thread calls them (after the worker's replicas have
/// combined their values locally), in the same order on every worker; the implementation
/// numbers them and checks that order.
pub trait WorkerCollectives: Send + Sync + std::fmt::Debug {
    /// The number of workers in sync.
    fn num_workers(&self) -> usize;
    /// This worker's index (0 is the chief).
    fn worker_index(&self) -> usize;
    /// All-reduces `data` in place across the workers (`Mean` averages over workers).
    fn all_reduce(&self, op: ReduceOp, data: &mut [f32]) -> Result<()>;
    /// Gathers every worker's `mine` (lengths may differ), in worker order.
    fn all_gather(&self, mine: &[f32]) -> Result<Vec<Vec<f32>>>;
    /// Overwrites `data` on every worker with worker `root`'s.
    fn broadcast(&self, root: usize, data: &mut [f32]) -> Result<()>;
    /// Waits until every worker reaches this point.
    fn barrier(&self) -> Result<()>;
}

/// A job run once on every replica.
pub type ReplicaJob<'a> = dyn Fn(&ReplicaContext<'_>) -> Result<()> + Sync + 'a;

/// What a strategy implementation provides (TensorFlow's `StrategyExtended`). Users call
/// [`Strategy`]; implementers fill this in. Object safe, so strategies chosen at run time work
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

    /// How input is split across workers.
    fn auto_shard(&self) -> AutoShardPolicy {
        AutoShardPolicy::Data
    }

    /// The number of replicas in sync across every worker.
    fn num_replicas_in_sync(&self) -> usize {
        self.num_replicas() * self.workers().map_or(1, |w| w.num_workers())
    }
}

thread_local! {
    static SCOPES: RefCell<Vec<Arc<dyn StrategyExtended>>> = const { RefCell::new(Vec::new()) };
}

/// The strategy whose scope the current thread is in, or the default one-device strategy.
/// Library code can call [`Strategy::reduce`] on what this returns unconditionally.
pub fn get_strategy() -> Arc<dyn StrategyExtended> {
    SCOPES.with(|s| s.borrow().last().cloned()).unwrap_or_else(|| default_strategy().clone())
}

/// Whether the current thread is inside some strategy's scope.
pub fn has_strategy() -> bool {
    SCOPES.with(|s| !s.borrow().is_empty())
}

static DEFAULT: OnceLock<Arc<dyn StrategyExtended>> = OnceLock::new();

/// Registers the default strategy (done by `strata-strategies`; the first registration wins).
pub fn set_default_strategy(s: Arc<dyn StrategyExtended>) {
    let _ = DEFAULT.set(s);
}

fn default_strategy() -> &'static Arc<dyn StrategyExtended> {
    DEFAULT.get_or_init(|| Arc::new(crate::runtime::DefaultStrategy::new()))
}

pub(crate) struct ScopeGuard;

impl ScopeGuard {
    pub(crate) fn enter(ext: &Arc<dyn StrategyExtended>) -> Result<Self> {
        SCOPES.with(|s| {
            let mut s = s.borrow_mut();
            if let Some(outer) = s.last() {
                if outer.id() != ext.id() {
                    return Err(Error::MixedStrategies(format!(
                        "entered the scope of {} {} inside the scope of {} {}; leave one scope before entering another",
                        ext.name(),
                        ext.id(),
                        outer.name(),
                        outer.id()
                    )));
                }
            }
            s.push(ext.clone());
            Ok(ScopeGuard)
        })
    }
}

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        SCOPES.with(|s| {
            s.borrow_mut().pop();
        });
    }
}

/// The user-facing strategy API (TensorFlow's `tf.distribute.Strategy`). Model code written
/// against it does not change when the strategy does.
pub trait Strategy {
    /// The implementation.
    fn extended(&self) -> &Arc<dyn StrategyExtended>;

    /// The number of replicas that run each step in sync.
    fn num_replicas_in_sync(&self) -> usize {
        self.extended().num_replicas_in_sync()
    }

    /// Builds variables the strategy's way. `build` creates one copy of the model from the
    /// [`Scope`]'s `VarBuilder`; a mirrored strategy calls it once per replica, every copy
    /// starting from identical values, a central one once.
    fn scope<M>(&self, build: impl FnMut(&Scope) -> candle_core::Result<M>) -> Result<Replicated<M>> {
        crate::variables::build_replicated(self.extended(), build)
    }

    /// Runs `step` on every replica with no input; returns each replica's result.
    fn run<T: Send>(&self, step: impl Fn(&ReplicaContext<'_>) -> Result<T> + Sync) -> Result<PerReplica<T>> {
        let n = self.extended().num_replicas();
        let weights = vec![1.0 / self.num_replicas_in_sync() as f32; n];
        crate::runtime::run_collect(self.extended().as_ref(), &weights, |ctx| step(ctx))
    }

    /// Runs `step` on every replica with its shard of `batch`; returns each replica's result.
    fn run_batch<T: Send>(
        &self,
        batch: &DistributedBatch,
        step: impl Fn(&ReplicaContext<'_>, &crate::data::Shard) -> Result<T> + Sync,
    ) -> Result<PerReplica<T>> {
        self.run_batches(std::slice::from_ref(batch), step)?
            .pop()
            .ok_or_else(|| Error::Scope("a step returned no value".into()))
    }

    /// Runs one step per batch of `batches`, in order, in a single execution: every replica
    /// goes through its shards of all of them without returning to the caller in between
    /// (Keras' `steps_per_execution`). The steps synchronise as usual inside their
    /// collectives; what is saved is handing every step to the replica threads and waiting for
    /// them, which on a step of a few milliseconds is a visible cost. Returns one
    /// `PerReplica` per batch.
    fn run_batches<T: Send>(
        &self,
        batches: &[DistributedBatch],
        step: impl Fn(&ReplicaContext<'_>, &crate::data::Shard) -> Result<T> + Sync,
    ) -> Result<Vec<PerReplica<T>>> {
        let n = self.extended().num_replicas();
        if let Some(b) = batches.iter().find(|b| b.shards.num_replicas() != n) {
            return Err(Error::Dataset(format!(
                "a batch was split for {} replicas but this worker of the strategy has {n}; distribute it with this strategy",
                b.shards.num_replicas()
            )));
        }
        let Some(first) = batches.first() else { return Ok(Vec::new()) };
        let per_replica = crate::runtime::run_collect(self.extended().as_ref(), &first.weights(), |ctx| {
            let r = ctx.replica_id();
            batches
                .iter()
                .map(|b| {
                    let shard = &b.shards.values()[r];
                    ctx.set_batch_weight(shard.weight());
                    step(ctx, shard)
                })
                .collect::<Result<Vec<T>>>()
        })?;
        // Transpose: replica-major to batch-major.
        let mut columns: Vec<std::vec::IntoIter<T>> =
            per_replica.into_values().into_iter().map(Vec::into_iter).collect();
        (0..batches.len())
            .map(|b| {
                let values = columns
                    .iter_mut()
                    .map(|c| c.next().ok_or_else(|| Error::Scope(format!("a replica returned no value for step {b}"))))
                    .collect::<Result<Vec<T>>>()?;
                PerReplica::new(values)
            })
            .collect()
    }

    /// Reduces per-replica scalars in cross-replica context (across every worker of a
    /// multi-worker strategy).
    fn reduce(&self, op: ReduceOp, value: &PerReplica<f32>) -> Result<f32> {
        let v: Vec<f64> = value.values().iter().map(|&x| x as f64).collect();
        let local = op.reduce_scalars(&v) as f32;
        match self.extended().workers() {
            None => Ok(local),
            Some(w) => {
                let mut data = [local];
                w.all_reduce(op, &mut data)?;
                Ok(data[0])
            }
        }
    }

    /// Reduces per-replica tensors element-wise in cross-replica context (across every worker
    /// of a multi-worker strategy).
    fn reduce_tensors(&self, op: ReduceOp, value: &PerReplica<Tensor>) -> Result<Tensor> {
        let local = crate::runtime::reduce_tensors(op, value)?;
        match self.extended().workers() {
            None => Ok(local),
            Some(w) => {
                let mut data = local.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                w.all_reduce(op, &mut data)?;
                Ok(Tensor::from_vec(data, local.shape(), local.device())?.to_dtype(local.dtype())?)
            }
        }
    }

    /// Splits each global batch of `batches` into per-replica shards.
    fn distribute_dataset<I>(&self, batches: I, tail: TailPolicy) -> DistributedDataset<I::IntoIter>
    where
        I: IntoIterator<Item = crate::data::Batch>,
    {
        let ext = self.extended();
        match ext.workers() {
            None => DistributedDataset::new(batches.into_iter(), ext.num_replicas(), tail),
            Some(w) => DistributedDataset::for_worker(
                batches.into_iter(),
                ext.num_replicas(),
                w.num_workers(),
                w.worker_index(),
                ext.auto_shard(),
                tail,
            ),
        }
    }

    /// Gives each input pipeline an [`InputContext`] and lets it build its own per-replica
    /// batches; each step takes one batch per replica from the pipelines in turn.
    fn distribute_datasets_from_function<I, F>(&self, make: F) -> Result<crate::data::PipelineDataset<I>>
    where
        I: Iterator<Item = crate::data::Batch>,
        F: FnMut(&InputContext) -> Result<I>,
    {
        let ext = self.extended();
        match ext.workers() {
            None => crate::data::PipelineDataset::new(ext.num_replicas(), 1, make),
            Some(w) => {
                crate::data::PipelineDataset::for_worker(ext.num_replicas(), w.num_workers(), w.worker_index(), make)
            }
        }
    }

    /// A strategy-independent handle (for choosing strategies at run time).
    fn handle(&self) -> StrategyHandle {
        StrategyHandle(self.extended().clone())
    }
}

/// Any strategy, chosen at run time.
#[derive(Clone, Debug)]
pub struct StrategyHandle(pub Arc<dyn StrategyExtended>);

impl Strategy for StrategyHandle {
    fn extended(&self) -> &Arc<dyn StrategyExtended> {
        &self.0
    }
}

impl StrategyHandle {
    /// The strategy of the current scope, or the default one.
    pub fn current() -> Self {
        StrategyHandle(get_strategy())
    }
}

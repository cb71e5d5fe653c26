//! The type of [`ReplicaContext`] (what a step sees on one replica) and its accessors; its
//! collectives are in [`context`](crate::context).

use candle_core::Device;

use super::{StrategyExtended, StrategyId};
use crate::device::{candle_device, LogicalDevice};
use crate::group::ReplicaGroup;
use crate::timeline::TimelineSpan;
use crate::{Error, Result};

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

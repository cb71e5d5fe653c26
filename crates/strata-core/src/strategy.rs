//! The user-facing [`Strategy`] (with its default methods) and [`StrategyHandle`]: the top of
//! strata-core's strategy machinery. The implementer's [`StrategyExtended`] and its vocabulary
//! live in [`extended`](crate::extended) and the scope stack in [`scope`](crate::scope); both
//! are re-exported here, so `strata_core::strategy::*` names everything a strategy is.

use std::sync::Arc;

use candle_core::Tensor;

use crate::data::{BatchData, DistributedBatch, DistributedDataset, InputContext, Shard, TailPolicy};
use crate::extended::ReplicaContext;
pub use crate::extended::{
    AutoShardPolicy, ReplicaJob, StrategyExtended, StrategyId, StrategyOptions, VariablePolicy, WorkerCollectives,
};
pub use crate::scope::{get_strategy, has_strategy, set_default_strategy};
use crate::variables::{Replicated, Scope};
use crate::{Error, PerReplica, ReduceOp, Result};

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
        let in_step = if self.extended().step_workers().is_some() { self.num_replicas_in_sync() } else { n };
        let weights = vec![1.0 / in_step as f32; n];
        crate::runtime::run_collect(self.extended().as_ref(), &weights, |ctx| step(ctx))
    }

    /// Runs `step` on every replica with its shard of `batch` (any [`BatchData`]); returns each
    /// replica's result.
    fn run_batch<B: BatchData, T: Send>(
        &self,
        batch: &DistributedBatch<B>,
        step: impl Fn(&ReplicaContext<'_>, &Shard<B>) -> Result<T> + Sync,
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
    ///
    /// Under a strategy with a [`TableStore`](crate::embedding::TableStore)
    /// ([`StrategyOptions::tables`](crate::StrategyOptions::tables)) every step is an execution
    /// of its own: the store takes a step's rows when its replicas end it
    /// ([`TableStore::end_step`](crate::embedding::TableStore::end_step)), before the next step
    /// looks rows up.
    fn run_batches<B: BatchData, T: Send>(
        &self,
        batches: &[DistributedBatch<B>],
        step: impl Fn(&ReplicaContext<'_>, &Shard<B>) -> Result<T> + Sync,
    ) -> Result<Vec<PerReplica<T>>> {
        let n = self.extended().num_replicas();
        if let Some(b) = batches.iter().find(|b| b.shards.num_replicas() != n) {
            return Err(Error::Dataset(format!(
                "a batch was split for {} replicas but this worker of the strategy has {n}; distribute it with this strategy",
                b.shards.num_replicas()
            )));
        }
        if batches.is_empty() {
            return Ok(Vec::new());
        }
        let per_execution = if self.extended().options().tables.is_some() { 1 } else { batches.len() };
        // Under local SGD a step is the worker's own: its shards make up the batch it steps on.
        let local = self.extended().workers().is_some() && self.extended().step_workers().is_none();
        let share = |b: &DistributedBatch<B>, r: usize| -> (f32, usize) {
            let shard = &b.shards.values()[r];
            if !local {
                return (shard.weight(), shard.global_len);
            }
            let rows = |s: &Shard<B>| s.batch.rows().unwrap_or(0);
            let len: usize = b.shards.values().iter().map(rows).sum();
            (rows(shard) as f32 / len.max(1) as f32, len)
        };
        let mut out = Vec::with_capacity(batches.len());
        for execution in batches.chunks(per_execution) {
            let weights: Vec<f32> = (0..n).map(|r| share(&execution[0], r).0).collect();
            let per_replica = crate::runtime::run_collect(self.extended().as_ref(), &weights, |ctx| {
                let r = ctx.replica_id();
                execution
                    .iter()
                    .map(|b| {
                        let (weight, len) = share(b, r);
                        ctx.set_batch(weight, len);
                        step(ctx, &b.shards.values()[r])
                    })
                    .collect::<Result<Vec<T>>>()
            })?;
            // Transpose: replica-major to batch-major.
            let mut columns: Vec<std::vec::IntoIter<T>> =
                per_replica.into_values().into_iter().map(Vec::into_iter).collect();
            for b in 0..execution.len() {
                let values = columns
                    .iter_mut()
                    .map(|c| c.next().ok_or_else(|| Error::Scope(format!("a replica returned no value for step {b}"))))
                    .collect::<Result<Vec<T>>>()?;
                out.push(PerReplica::new(values)?);
            }
        }
        Ok(out)
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

    /// Splits each global batch of `batches` (any [`BatchData`]: a tensor, tuples and named
    /// maps of tensors, [`Batch`](crate::data::Batch), a type of one's own) into per-replica
    /// shards of contiguous rows, each weighted by its rows over the global batch's; across
    /// workers by the strategy's [`AutoShardPolicy`] (`File` shards a dataset that is not
    /// files by data; see [`Strategy::distribute_files`]). A batch whose parts disagree on
    /// their rows ends the iteration, and the dataset's
    /// [`take_error`](DistributedDataset::take_error) returns the error.
    fn distribute_dataset<I>(&self, batches: I, tail: TailPolicy) -> DistributedDataset<I::IntoIter>
    where
        I: IntoIterator,
        I::Item: BatchData,
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

    /// Batches of a dataset stored as `files` (shards of records), each file opened with `read`
    /// (which streams its batches, as [`TokenRecords`](crate::data::files::TokenRecords)
    /// does), cut to `global_batch` examples across file boundaries and split over the
    /// replicas like [`Strategy::distribute_dataset`]'s. Memory stays within one batch and one
    /// read. Across workers, by the strategy's [`AutoShardPolicy`]:
    ///
    /// - `File`: worker `i` of `W` reads whole files `i`, `i + W`, ... (TensorFlow's
    ///   `AutoShardPolicy.FILE`), in batches of `global_batch / W` that are its part of each
    ///   step. The workers must hold as many batches each (files of equal sizes), since every
    ///   step needs every worker.
    /// - `Data`: every worker reads every file and keeps its replicas' slice of each global
    ///   batch (exactly one process's split).
    /// - `Off`: every worker reads every file, in batches of `global_batch / W`.
    ///
    /// An error, before anything is read, if there are fewer files than workers under `File`,
    /// or `global_batch` is zero or (under `File` and `Off`) not a multiple of the workers. A
    /// file that cannot be opened or read ends the iteration; the dataset's
    /// [`take_error`](DistributedDataset::take_error) says why.
    fn distribute_files<B, I, F>(
        &self,
        files: &[std::path::PathBuf],
        global_batch: usize,
        tail: TailPolicy,
        read: F,
    ) -> Result<DistributedDataset<crate::data::files::FileBatches<B, I, F>>>
    where
        B: BatchData,
        I: Iterator<Item = Result<B>>,
        F: FnMut(&std::path::Path) -> Result<I>,
    {
        let ext = self.extended();
        let (workers, index) = ext.workers().map_or((1, 0), |w| (w.num_workers(), w.worker_index()));
        let policy = if workers > 1 { ext.auto_shard() } else { AutoShardPolicy::Data };
        if global_batch == 0 || (policy != AutoShardPolicy::Data && !global_batch.is_multiple_of(workers)) {
            return Err(Error::Dataset(format!(
                "a global batch of {global_batch} examples over {workers} workers: use a positive multiple of {workers}"
            )));
        }
        let (mine, size, shard_by) = match policy {
            AutoShardPolicy::Data => (files.to_vec(), global_batch, AutoShardPolicy::Data),
            AutoShardPolicy::File => {
                if files.len() < workers {
                    return Err(Error::TooFewFiles { files: files.len(), workers });
                }
                let mine = files.iter().skip(index).step_by(workers).cloned().collect();
                (mine, global_batch / workers, AutoShardPolicy::Off)
            }
            AutoShardPolicy::Off => (files.to_vec(), global_batch / workers, AutoShardPolicy::Off),
        };
        let slot = crate::data::ErrorSlot::default();
        let batches = crate::data::files::FileBatches::new(mine, size, read, slot.clone());
        let d = if workers > 1 {
            DistributedDataset::for_worker(batches, ext.num_replicas(), workers, index, shard_by, tail)
        } else {
            DistributedDataset::new(batches, ext.num_replicas(), tail)
        };
        Ok(d.with_error_slot(slot))
    }

    /// Gives each input pipeline an [`InputContext`] and lets it build its own per-replica
    /// batches; each step takes one batch per replica from the pipelines in turn.
    fn distribute_datasets_from_function<I, F>(&self, make: F) -> Result<crate::data::PipelineDataset<I>>
    where
        I: Iterator,
        I::Item: BatchData,
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

//! Datasets: global batches, their per-replica shards, and input pipelines.
//!
//! # How a global batch is split
//!
//! [`DistributedDataset`] splits each global batch of `B` examples over `N` replicas into
//! contiguous shards whose sizes differ by at most one: the first `B % N` replicas get
//! `B / N + 1` examples, the others `B / N`. Each replica's gradient is weighted by its share
//! of the batch (`shard / B`) before the sum across replicas, so a step on an uneven batch
//! (usually the last one of an epoch) applies exactly the update one device would apply to
//! the whole batch. A batch with fewer examples than replicas cannot give every replica an
//! example: with [`TailPolicy::Split`] (the default) it is skipped and counted in
//! [`DistributedDataset::skipped_examples`]; with [`TailPolicy::DropRemainder`] every batch
//! smaller than the first one is skipped, as `drop_remainder=True` does in TensorFlow.
//!
//! # Any batch
//!
//! A batch is anything that splits along its first axis ([`BatchData`]): a candle tensor of
//! any dtype (images `(N, C, H, W)`, token ids `(N, T)`, masks, targets), tuples and named maps
//! of them, [`Batch`] (row-major f32 features and u32 labels), or a type of one's own that
//! says how many rows it has, how to take a run of them and how to join batches. Every part
//! of a batch is cut at the same rows, and the shard's weight is its rows over the global
//! batch's, whatever the parts hold (the loss a step computes should be the mean over its
//! shard's examples, as one device's is over the batch's). A batch whose parts disagree on
//! the number of rows ends the iteration with [`Error::BatchRows`],
//! which [`DistributedDataset::take_error`] returns.
//!
//! # Across workers
//!
//! A multi-worker strategy shards input by its
//! [`AutoShardPolicy`](crate::extended::AutoShardPolicy), for every kind of batch: `Data`
//! (every worker reads the same global batches and keeps its replicas' shards), `Off` (every
//! worker's batches are its own part of the step), and `File` (worker `i` of `W` reads whole
//! files `i`, `i + W`, ... of a dataset stored as files, through
//! [`Strategy::distribute_files`](crate::Strategy::distribute_files); a dataset that is not
//! files is sharded by data, as TensorFlow's `AUTO` does).
//!
//! # Datasets larger than memory
//!
//! [`files`] streams batches from files of fixed-size records (token sequences and their
//! next-token targets: [`files::TokenRecords`]) a window of records at a time, and re-cuts
//! them into global batches across file boundaries ([`files::FileBatches`]); memory stays
//! within one batch and one read, whatever the files' sizes. A file whose size is not a whole
//! number of records is [`Error::RecordFile`].

use std::sync::{Arc, Mutex, PoisonError};

use crate::{Error, PerReplica, Result};

pub mod batch;
pub mod files;
mod labelled;

pub use batch::BatchData;
pub use labelled::Batch;

/// One replica's part of a global batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Shard<B = Batch> {
    /// The replica's examples.
    pub batch: B,
    /// The number of examples in the whole global batch.
    pub global_len: usize,
}

impl<B: BatchData> Shard<B> {
    /// This shard's share of the global batch.
    pub fn weight(&self) -> f32 {
        self.batch.rows().unwrap_or(0) as f32 / self.global_len.max(1) as f32
    }
}

/// A global batch split into one shard per replica.
#[derive(Clone, Debug)]
pub struct DistributedBatch<B = Batch> {
    /// The shards, in replica order.
    pub shards: PerReplica<Shard<B>>,
}

impl<B: BatchData> DistributedBatch<B> {
    /// Splits `batch` over `n` replicas (sizes differ by at most one, in replica order). An
    /// error if its parts disagree on the number of examples, or it has fewer than `n`.
    pub fn split(batch: &B, n: usize) -> Result<Self> {
        if n == 0 {
            return Err(Error::ZeroReplicas);
        }
        let rows = batch.rows()?;
        if rows < n {
            return Err(Error::Dataset(format!(
                "a batch of {rows} examples cannot give each of {n} replicas an example; use a global batch of at least {n}"
            )));
        }
        let (q, r) = (rows / n, rows % n);
        let mut start = 0;
        let shards = (0..n)
            .map(|i| {
                let len = q + usize::from(i < r);
                let s = Shard { batch: batch.slice(start..start + len)?, global_len: rows };
                start += len;
                Ok(s)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { shards: PerReplica::new(shards)? })
    }

    /// Each replica's share of the global batch.
    pub fn weights(&self) -> Vec<f32> {
        self.shards.values().iter().map(Shard::weight).collect()
    }

    /// The number of examples in the global batch, over every worker (a multi-worker
    /// strategy's batch holds only this worker's shards).
    pub fn global_len(&self) -> usize {
        self.shards.values().first().map_or(0, |s| s.global_len)
    }

    /// The number of examples in this worker's shards.
    pub fn local_len(&self) -> usize {
        self.shards.values().iter().map(|s| s.batch.rows().unwrap_or(0)).sum()
    }
}

/// What happens to batches that cannot be split evenly enough (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TailPolicy {
    /// Uneven batches are split as evenly as possible and weighted; a batch smaller than the
    /// number of replicas is skipped and counted.
    #[default]
    Split,
    /// Every batch smaller than the first is skipped and counted.
    DropRemainder,
}

/// Where a dataset leaves the error that ended it (an iterator of batches yields batches).
pub type ErrorSlot = Arc<Mutex<Option<Error>>>;

/// Global batches split into per-replica shards. A batch that cannot be split (its parts
/// disagree on the number of examples, say) or a file that cannot be read ends the iteration;
/// [`DistributedDataset::take_error`] then says why.
#[derive(Debug)]
pub struct DistributedDataset<I> {
    inner: I,
    n: usize,
    tail: TailPolicy,
    first_len: Option<usize>,
    skipped: usize,
    /// Multi-worker: (workers, this worker, policy).
    worker: Option<(usize, usize, crate::extended::AutoShardPolicy)>,
    error: ErrorSlot,
}

impl<I> DistributedDataset<I>
where
    I: Iterator,
    I::Item: BatchData,
{
    /// Splits `inner`'s global batches over `n` replicas.
    pub fn new(inner: I, n: usize, tail: TailPolicy) -> Self {
        Self { inner, n: n.max(1), tail, first_len: None, skipped: 0, worker: None, error: ErrorSlot::default() }
    }

    /// Leaves errors in `slot` (shared with the source of the batches, such as a file reader).
    pub fn with_error_slot(mut self, slot: ErrorSlot) -> Self {
        self.error = slot;
        self
    }

    /// The error that ended the iteration, if one did (taken: a second call returns `None`).
    pub fn take_error(&self) -> Option<Error> {
        self.error.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    fn fail(&self, e: Error) {
        tracing::error!(error = %e, "a distributed dataset stopped");
        self.error.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert(e);
    }

    /// Splits for worker `index` of `workers`, each with `local` replicas. With
    /// [`AutoShardPolicy::Data`](crate::extended::AutoShardPolicy::Data) every worker reads the
    /// same global batches, splits each over all `local * workers` replicas and keeps its own
    /// replicas' shards, so the job computes exactly what one process would on that batch.
    /// With `Off`, each worker's batches are its own part of the step (weighted as if every
    /// worker's batch had the same size). `File` shards these batches (not files) by data.
    pub fn for_worker(
        inner: I,
        local: usize,
        workers: usize,
        index: usize,
        policy: crate::extended::AutoShardPolicy,
        tail: TailPolicy,
    ) -> Self {
        let mut d = Self::new(inner, local, tail);
        d.worker = Some((workers.max(1), index, policy));
        d
    }

    /// Examples skipped so far by the tail policy.
    pub fn skipped_examples(&self) -> usize {
        self.skipped
    }

    /// The source of the global batches (a [`files::FileBatches`], say, to see what it holds).
    pub fn get_ref(&self) -> &I {
        &self.inner
    }
}

impl<I> Iterator for DistributedDataset<I>
where
    I: Iterator,
    I::Item: BatchData,
{
    type Item = DistributedBatch<I::Item>;

    fn next(&mut self) -> Option<Self::Item> {
        use crate::extended::AutoShardPolicy;
        loop {
            let b = self.inner.next()?;
            let rows = match b.rows() {
                Ok(r) => r,
                Err(e) => {
                    self.fail(e);
                    return None;
                }
            };
            let first = *self.first_len.get_or_insert(rows);
            // A dataset that is not files is sharded by data under the file policy (as
            // TensorFlow's AUTO falls back to); `Strategy::distribute_files` hands out whole
            // files and shards its batches as `Off`.
            let split_over = match self.worker {
                Some((w, _, AutoShardPolicy::Data | AutoShardPolicy::File)) => self.n * w,
                _ => self.n,
            };
            let keep = match self.tail {
                TailPolicy::Split => rows >= split_over,
                TailPolicy::DropRemainder => rows >= first && rows >= split_over,
            };
            if !keep {
                tracing::debug!(examples = rows, replicas = self.n, "skipping a batch by the tail policy");
                self.skipped += rows;
                continue;
            }
            let split = match self.worker {
                None => DistributedBatch::split(&b, self.n),
                Some((w, index, AutoShardPolicy::Data | AutoShardPolicy::File)) => {
                    DistributedBatch::split(&b, self.n * w).and_then(|all| {
                        let mine: Vec<Shard<I::Item>> =
                            all.shards.into_values().into_iter().skip(index * self.n).take(self.n).collect();
                        Ok(DistributedBatch { shards: PerReplica::new(mine)? })
                    })
                }
                Some((w, _, AutoShardPolicy::Off)) => DistributedBatch::split(&b, self.n).and_then(|local| {
                    let shards =
                        local.shards.into_values().into_iter().map(|s| Shard { global_len: s.global_len * w, ..s });
                    Ok(DistributedBatch { shards: PerReplica::new(shards.collect())? })
                }),
            };
            return match split {
                Ok(d) => Some(d),
                Err(e) => {
                    self.fail(e);
                    None
                }
            };
        }
    }
}

/// What an input pipeline knows about its place in the job (TensorFlow's `InputContext`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputContext {
    /// How many input pipelines the job has (one per worker).
    pub num_input_pipelines: usize,
    /// This pipeline's index.
    pub input_pipeline_id: usize,
    /// How many replicas run each step in sync.
    pub num_replicas_in_sync: usize,
}

impl InputContext {
    /// The per-replica batch size for a global batch size; the global batch must divide evenly.
    pub fn per_replica_batch_size(&self, global_batch_size: usize) -> Result<usize> {
        if self.num_replicas_in_sync == 0 || !global_batch_size.is_multiple_of(self.num_replicas_in_sync) {
            return Err(Error::Dataset(format!(
                "the global batch size {global_batch_size} is not divisible by the {} replicas in sync; pick a multiple of {}",
                self.num_replicas_in_sync, self.num_replicas_in_sync
            )));
        }
        Ok(global_batch_size / self.num_replicas_in_sync)
    }
}

/// Per-replica batches from input pipelines built by a function: each step takes one batch
/// per replica, from the pipelines in turn. The iteration ends when a pipeline runs dry or
/// yields a batch that cannot be split ([`PipelineDataset::take_error`] says which).
#[derive(Debug)]
pub struct PipelineDataset<I> {
    pipelines: Vec<I>,
    n: usize,
    /// How many workers' pipelines make up a step (their batches are assumed equal in size).
    workers: usize,
    error: Option<Error>,
}

impl<I> PipelineDataset<I>
where
    I: Iterator,
    I::Item: BatchData,
{
    /// Calls `make` once per pipeline, with its [`InputContext`].
    pub fn new(n: usize, num_pipelines: usize, mut make: impl FnMut(&InputContext) -> Result<I>) -> Result<Self> {
        if n == 0 {
            return Err(Error::ZeroReplicas);
        }
        let pipelines = (0..num_pipelines.max(1))
            .map(|id| {
                make(&InputContext {
                    num_input_pipelines: num_pipelines.max(1),
                    input_pipeline_id: id,
                    num_replicas_in_sync: n,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { pipelines, n, workers: 1, error: None })
    }

    /// The pipeline of worker `index` of `workers` (each with `local` replicas): `make` is
    /// called once, with `input_pipeline_id = index` and `num_input_pipelines = workers`.
    pub fn for_worker(
        local: usize,
        workers: usize,
        index: usize,
        mut make: impl FnMut(&InputContext) -> Result<I>,
    ) -> Result<Self> {
        if local == 0 {
            return Err(Error::ZeroReplicas);
        }
        let p = make(&InputContext {
            num_input_pipelines: workers.max(1),
            input_pipeline_id: index,
            num_replicas_in_sync: local * workers.max(1),
        })?;
        Ok(Self { pipelines: vec![p], n: local, workers: workers.max(1), error: None })
    }

    /// The error that ended the iteration (a batch whose parts disagree on their rows), if
    /// one did (taken: a second call returns `None`).
    pub fn take_error(&mut self) -> Option<Error> {
        self.error.take()
    }
}

impl<I> Iterator for PipelineDataset<I>
where
    I: Iterator,
    I::Item: BatchData,
{
    type Item = DistributedBatch<I::Item>;

    fn next(&mut self) -> Option<Self::Item> {
        let p = self.pipelines.len();
        let mut batches = Vec::with_capacity(self.n);
        let mut local = 0;
        for r in 0..self.n {
            let b = self.pipelines[r % p].next()?;
            match b.rows() {
                Ok(0) => return None,
                Ok(rows) => local += rows,
                Err(e) => {
                    tracing::error!(error = %e, "an input pipeline's batch cannot be split");
                    self.error.get_or_insert(e);
                    return None;
                }
            }
            batches.push(b);
        }
        let global: usize = local * self.workers;
        let shards = batches.into_iter().map(|batch| Shard { batch, global_len: global }).collect();
        PerReplica::new(shards).ok().map(|shards| DistributedBatch { shards })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(rows: usize) -> Batch {
        Batch::new((0..rows * 2).map(|x| x as f32).collect(), (0..rows as u32).collect(), 2).unwrap()
    }

    #[test]
    fn even_and_uneven_splits() {
        let d = DistributedBatch::split(&batch(8), 4).unwrap();
        assert!(d.shards.values().iter().all(|s| s.batch.len() == 2 && s.weight() == 0.25));
        let d = DistributedBatch::split(&batch(7), 3).unwrap();
        let lens: Vec<_> = d.shards.values().iter().map(|s| s.batch.len()).collect();
        assert_eq!(lens, vec![3, 2, 2]);
        assert_eq!(d.shards.values()[1].batch.labels, vec![3, 4]);
        assert_eq!(d.shards.values()[1].batch.features, vec![6.0, 7.0, 8.0, 9.0]);
        assert!((d.weights().iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(DistributedBatch::split(&batch(2), 3).is_err());
    }

    #[test]
    fn tail_policies() {
        let batches = vec![batch(8), batch(8), batch(5), batch(2)];
        let mut ds = DistributedDataset::new(batches.clone().into_iter(), 3, TailPolicy::Split);
        let lens: Vec<_> = ds.by_ref().map(|b| b.global_len()).collect();
        assert_eq!(lens, vec![8, 8, 5]);
        assert_eq!(ds.skipped_examples(), 2);
        let mut ds = DistributedDataset::new(batches.into_iter(), 3, TailPolicy::DropRemainder);
        assert_eq!(ds.by_ref().count(), 2);
        assert_eq!(ds.skipped_examples(), 7);
    }

    #[test]
    fn input_context_and_pipelines() {
        let ctx = InputContext { num_input_pipelines: 1, input_pipeline_id: 0, num_replicas_in_sync: 4 };
        assert_eq!(ctx.per_replica_batch_size(256).unwrap(), 64);
        assert!(ctx.per_replica_batch_size(250).is_err());
        let mut seen = None;
        let ds = PipelineDataset::new(2, 1, |c| {
            seen = Some(*c);
            let per = c.per_replica_batch_size(8)?;
            Ok((0..5).map(move |_| batch(per)))
        })
        .unwrap();
        assert_eq!(seen.unwrap().num_replicas_in_sync, 2);
        let steps: Vec<_> = ds.collect();
        assert_eq!(steps.len(), 2); // 5 per-replica batches make 2 whole steps of 2
        assert!(steps.iter().all(|s| s.global_len() == 8 && s.weights() == vec![0.5, 0.5]));
    }
}

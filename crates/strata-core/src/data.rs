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

use candle_core::{Device, Tensor};

use crate::{Error, PerReplica, Result};

/// A batch of examples: row-major f32 features and u32 class labels.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// `rows * dim` features, row-major.
    pub features: Vec<f32>,
    /// One label per row.
    pub labels: Vec<u32>,
    /// Features per row.
    pub dim: usize,
}

impl Batch {
    /// A batch, checked: `features.len() == labels.len() * dim`.
    pub fn new(features: Vec<f32>, labels: Vec<u32>, dim: usize) -> Result<Self> {
        if dim == 0 || features.len() != labels.len() * dim {
            return Err(Error::Dataset(format!(
                "a batch of {} labels with {dim} features per row needs {} features, got {}",
                labels.len(),
                labels.len() * dim,
                features.len()
            )));
        }
        Ok(Self { features, labels, dim })
    }

    /// The number of examples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether the batch has no example.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Rows `range` as a new batch.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Batch {
        Batch {
            features: self.features[range.start * self.dim..range.end * self.dim].to_vec(),
            labels: self.labels[range].to_vec(),
            dim: self.dim,
        }
    }

    /// The features as a `(rows, dim)` tensor on `device`.
    pub fn features_tensor(&self, device: &Device) -> Result<Tensor> {
        Ok(Tensor::from_slice(&self.features, (self.len(), self.dim), device)?)
    }

    /// The labels as a `(rows,)` u32 tensor on `device`.
    pub fn labels_tensor(&self, device: &Device) -> Result<Tensor> {
        Ok(Tensor::from_slice(&self.labels, self.len(), device)?)
    }
}

/// One replica's part of a global batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Shard {
    /// The replica's examples.
    pub batch: Batch,
    /// The number of examples in the whole global batch.
    pub global_len: usize,
}

impl Shard {
    /// This shard's share of the global batch.
    pub fn weight(&self) -> f32 {
        self.batch.len() as f32 / self.global_len.max(1) as f32
    }
}

/// A global batch split into one shard per replica.
#[derive(Clone, Debug)]
pub struct DistributedBatch {
    /// The shards, in replica order.
    pub shards: PerReplica<Shard>,
}

impl DistributedBatch {
    /// Splits `batch` over `n` replicas (sizes differ by at most one, in replica order).
    pub fn split(batch: &Batch, n: usize) -> Result<Self> {
        if n == 0 {
            return Err(Error::ZeroReplicas);
        }
        if batch.len() < n {
            return Err(Error::Dataset(format!(
                "a batch of {} examples cannot give each of {n} replicas an example; use a global batch of at least {n}",
                batch.len()
            )));
        }
        let (q, r) = (batch.len() / n, batch.len() % n);
        let mut start = 0;
        let shards = (0..n)
            .map(|i| {
                let len = q + usize::from(i < r);
                let s = Shard { batch: batch.slice(start..start + len), global_len: batch.len() };
                start += len;
                s
            })
            .collect();
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
        self.shards.values().iter().map(|s| s.batch.len()).sum()
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

/// Global batches split into per-replica shards.
#[derive(Debug)]
pub struct DistributedDataset<I> {
    inner: I,
    n: usize,
    tail: TailPolicy,
    first_len: Option<usize>,
    skipped: usize,
    /// Multi-worker: (workers, this worker, policy).
    worker: Option<(usize, usize, crate::extended::AutoShardPolicy)>,
}

impl<I: Iterator<Item = Batch>> DistributedDataset<I> {
    /// Splits `inner`'s global batches over `n` replicas.
    pub fn new(inner: I, n: usize, tail: TailPolicy) -> Self {
        Self { inner, n: n.max(1), tail, first_len: None, skipped: 0, worker: None }
    }

    /// Splits for worker `index` of `workers`, each with `local` replicas. With
    /// [`AutoShardPolicy::Data`](crate::extended::AutoShardPolicy::Data) every worker reads the
    /// same global batches, splits each over all `local * workers` replicas and keeps its own
    /// replicas' shards, so the job computes exactly what one process would on that batch.
    /// With `Off`, each worker's batches are its own part of the step (weighted as if every
    /// worker's batch had the same size).
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
}

impl<I: Iterator<Item = Batch>> Iterator for DistributedDataset<I> {
    type Item = DistributedBatch;

    fn next(&mut self) -> Option<DistributedBatch> {
        loop {
            let b = self.inner.next()?;
            let first = *self.first_len.get_or_insert(b.len());
            let split_over = match self.worker {
                Some((w, _, crate::extended::AutoShardPolicy::Data)) => self.n * w,
                _ => self.n,
            };
            let keep = match self.tail {
                TailPolicy::Split => b.len() >= split_over,
                TailPolicy::DropRemainder => b.len() >= first && b.len() >= split_over,
            };
            if !keep {
                tracing::debug!(examples = b.len(), replicas = self.n, "skipping a batch by the tail policy");
                self.skipped += b.len();
                continue;
            }
            return match self.worker {
                None => DistributedBatch::split(&b, self.n).ok(),
                Some((w, index, crate::extended::AutoShardPolicy::Data)) => {
                    let all = DistributedBatch::split(&b, self.n * w).ok()?;
                    let mine: Vec<Shard> =
                        all.shards.into_values().into_iter().skip(index * self.n).take(self.n).collect();
                    PerReplica::new(mine).ok().map(|shards| DistributedBatch { shards })
                }
                Some((w, _, crate::extended::AutoShardPolicy::Off)) => {
                    let mut local = DistributedBatch::split(&b, self.n).ok()?;
                    let shards: Vec<Shard> = local
                        .shards
                        .into_values()
                        .into_iter()
                        .map(|s| Shard { global_len: s.global_len * w, ..s })
                        .collect();
                    local.shards = PerReplica::new(shards).ok()?;
                    Some(local)
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
/// per replica, from the pipelines in turn. The step ends when a pipeline runs dry.
#[derive(Debug)]
pub struct PipelineDataset<I> {
    pipelines: Vec<I>,
    n: usize,
    /// How many workers' pipelines make up a step (their batches are assumed equal in size).
    workers: usize,
}

impl<I: Iterator<Item = Batch>> PipelineDataset<I> {
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
        Ok(Self { pipelines, n, workers: 1 })
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
        Ok(Self { pipelines: vec![p], n: local, workers: workers.max(1) })
    }
}

impl<I: Iterator<Item = Batch>> Iterator for PipelineDataset<I> {
    type Item = DistributedBatch;

    fn next(&mut self) -> Option<DistributedBatch> {
        let p = self.pipelines.len();
        let mut batches = Vec::with_capacity(self.n);
        for r in 0..self.n {
            let b = self.pipelines[r % p].next()?;
            if b.is_empty() {
                return None;
            }
            batches.push(b);
        }
        let global: usize = batches.iter().map(Batch::len).sum::<usize>() * self.workers;
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

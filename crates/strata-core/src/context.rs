//! [`ReplicaContext`]'s collectives: `barrier`, `all_reduce`, `all_gather`, `merge_call` and
//! the fused gradient reduction of a step. The type itself (and its accessors) is defined with
//! the implementer's traits in [`extended`](crate::extended), since a job receives it and it
//! holds its strategy; it is re-exported here.

use std::any::Any;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, TensorId, Var};

use crate::cross_device::{plan_buckets, Destination, ReduceRequest, WorkerCollectives};
pub use crate::extended::{CrossReplicaContext, ReplicaContext, StepShared};
use crate::group::{OpKey, ReplicaGroup};
use crate::{Error, PerReplica, ReduceOp, Result};

impl ReplicaContext<'_> {
    /// A handle to this replica's collectives that outlives the context (see
    /// [`ReplicaHandle`]).
    pub fn handle(&self) -> ReplicaHandle {
        ReplicaHandle {
            group: self.shared.group.clone(),
            replica: self.replica,
            // Under local SGD a step's collectives stay on its worker.
            workers: self.shared.ext.worker_collectives().filter(|_| self.shared.ext.step_workers().is_some()),
        }
    }

    /// This replica's request for the next collective reduction of the step.
    pub(crate) fn request<'r>(
        &'r self,
        op: ReduceOp,
        dest: Destination,
        input: &'r [Tensor],
        weight: f32,
    ) -> ReduceRequest<'r> {
        let (group, replica) = (&self.shared.group, self.replica);
        ReduceRequest { group, replica, seq: group.next_seq(replica), op, dest, input, weight }
    }

    pub(crate) fn next_key(&self, op: String, shape: Vec<usize>) -> OpKey {
        OpKey { seq: self.shared.group.next_seq(self.replica), op, shape }
    }

    /// Waits until every replica reaches this point.
    pub fn barrier(&self) -> Result<()> {
        let key = self.next_key("barrier".into(), vec![]);
        self.shared.group.arrive(self.replica, &key)?;
        if let Some(w) = self.shared.ext.step_workers() {
            let r = if self.replica == 0 { w.barrier().map_err(|e| e.to_string()) } else { Ok(()) };
            self.share_from_first("barrier(workers)", r)?;
        }
        Ok(())
    }

    /// Replica 0's result, handed to every local replica.
    pub(crate) fn share_from_first<T: Any + Send + Clone>(
        &self,
        what: &str,
        mine: std::result::Result<T, String>,
    ) -> Result<T> {
        let key = self.next_key(what.into(), vec![]);
        let all = self.shared.group.exchange(self.replica, &key, mine)?;
        match all.into_iter().next() {
            Some(Ok(v)) => Ok(v),
            Some(Err(e)) => Err(Error::Cluster(e)),
            None => Err(Error::Scope(format!("{what} produced no result"))),
        }
    }

    /// All-reduces `values` (f32) with `op`; every replica gets the result.
    pub fn all_reduce_slice(&self, op: ReduceOp, values: &[f32]) -> Result<Vec<f32>> {
        let t = Tensor::from_slice(values, values.len(), &Device::Cpu)?;
        Ok(self.all_reduce(op, &t)?.to_vec1::<f32>()?)
    }

    /// All-reduces a tensor with `op`; every replica gets a tensor of the same shape.
    pub fn all_reduce(&self, op: ReduceOp, t: &Tensor) -> Result<Tensor> {
        let _p = self.phase("collective", &format!("all_reduce({op})"));
        let _s = tracing::trace_span!("all_reduce", replica = self.replica, %op, elements = t.elem_count()).entered();
        let input = t.to_dtype(candle_core::DType::F32)?.contiguous()?;
        let ops = self.shared.ext.cross_device_ops();
        if ops.reduces_in_place() {
            // A copy of its own: the reduction overwrites it, and `t` stays the caller's.
            let buf = input.copy()?;
            ops.reduce(self.request(op, Destination::AllReplicas, std::slice::from_ref(&buf), 1.0), &mut |_| {})?;
            return Ok(buf.to_dtype(t.dtype())?);
        }
        let mut out = Vec::with_capacity(input.elem_count());
        let req = self.request(op, Destination::AllReplicas, std::slice::from_ref(&input), 1.0);
        ops.reduce(req, &mut |p| out.extend_from_slice(p))?;
        Ok(Tensor::from_vec(out, t.shape(), self.candle_device())?.to_dtype(t.dtype())?)
    }

    /// Gathers every replica's tensor and concatenates them along dimension 0, in replica order.
    /// The tensors must agree in every dimension but the first.
    pub fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let _p = self.phase("collective", "all_gather");
        let rest: Vec<usize> = t.dims().iter().skip(1).copied().collect();
        let key = self.next_key("all_gather".into(), rest);
        let all = self.shared.group.exchange(self.replica, &key, t.clone())?;
        let on_mine = all.iter().map(|x| x.to_device(self.candle_device())).collect::<candle_core::Result<Vec<_>>>()?;
        let local = Tensor::cat(&on_mine, 0)?;
        let Some(w) = self.shared.ext.step_workers() else { return Ok(local) };
        let gathered = if self.replica == 0 {
            (|| -> Result<Vec<f32>> {
                let flat = local.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                Ok(w.all_gather(&flat)?.concat())
            })()
            .map_err(|e| e.to_string())
        } else {
            Ok(Vec::new())
        };
        let flat = self.share_from_first("all_gather(workers)", gathered.map(Arc::new))?;
        let row: usize = rest_len(t);
        let rows = flat.len().checked_div(row).unwrap_or(0);
        let mut shape = t.dims().to_vec();
        if shape.is_empty() {
            shape.push(rows);
        } else {
            shape[0] = rows;
        }
        Ok(Tensor::from_slice(&flat, shape, self.candle_device())?.to_dtype(t.dtype())?)
    }

    /// Steps into cross-replica context (TensorFlow's `merge_call`): every replica passes its
    /// `value`; `f` runs once, with all of them, and its result is returned on every replica.
    pub fn merge_call<T, R>(
        &self,
        value: T,
        f: impl FnOnce(&CrossReplicaContext, PerReplica<T>) -> Result<R>,
    ) -> Result<R>
    where
        T: Any + Send + Clone,
        R: Any + Send + Clone,
    {
        let key = self.next_key(format!("merge_call<{}>", std::any::type_name::<T>()), vec![]);
        let values = self.shared.group.exchange(self.replica, &key, value)?;
        let mine: std::result::Result<Option<R>, String> = if self.replica == 0 {
            let cross = CrossReplicaContext { strategy: self.strategy_id(), num_replicas: self.num_replicas_in_sync() };
            f(&cross, PerReplica::new(values)?).map(Some).map_err(|e| e.to_string())
        } else {
            Ok(None)
        };
        let key = self.next_key(format!("merge_call result<{}>", std::any::type_name::<R>()), vec![]);
        let results = self.shared.group.exchange(self.replica, &key, mine)?;
        match results.into_iter().next() {
            Some(Ok(Some(r))) => Ok(r),
            Some(Err(e)) => Err(Error::Scope(format!("merge_call function failed on replica 0: {e}"))),
            _ => Err(Error::Scope("merge_call produced no result".into())),
        }
    }

    /// Which of `mine` is true on any replica of the step, on any worker: a small collective
    /// (the flags travel as bits between local replicas and as one f32 per flag between
    /// workers). Every replica calls it with as many flags.
    pub fn any_replica(&self, mine: &[bool]) -> Result<Vec<bool>> {
        let mut words = vec![0u64; mine.len().div_ceil(64)];
        for (i, _) in mine.iter().enumerate().filter(|(_, b)| **b) {
            words[i / 64] |= 1 << (i % 64);
        }
        let key = self.next_key("any_replica".into(), vec![mine.len()]);
        let all = self.shared.group.exchange(self.replica, &key, Arc::new(words))?;
        let mut any = vec![0u64; mine.len().div_ceil(64)];
        for w in &all {
            any.iter_mut().zip(w.iter()).for_each(|(a, w)| *a |= w);
        }
        let bit = |words: &[u64], i: usize| words[i / 64] >> (i % 64) & 1 == 1;
        let local: Vec<bool> = (0..mine.len()).map(|i| bit(&any, i)).collect();
        let Some(w) = self.shared.ext.step_workers() else { return Ok(local) };
        let across = if self.replica == 0 {
            let mut flags: Vec<f32> = local.iter().map(|&b| f32::from(u8::from(b))).collect();
            w.all_reduce(ReduceOp::Max, &mut flags).map(|()| Arc::new(flags)).map_err(|e| e.to_string())
        } else {
            Ok(Arc::new(Vec::new()))
        };
        let flags = self.share_from_first("any_replica(workers)", across)?;
        Ok(flags.iter().map(|&f| f > 0.0).collect())
    }

    /// Reduces this replica's gradients of `vars` (from `grads`) with the strategy's
    /// cross-device op, in fused buckets: the sum over every replica (and worker) of each
    /// replica's gradient times its share of the batch. Only the variables that some replica,
    /// on some worker, has a gradient for are reduced (a replica without one contributes
    /// zeros); which those are is agreed first with [`ReplicaContext::any_replica`]. Returns
    /// the reduced gradients, in the order of `vars` and `None` for a variable no replica has
    /// a gradient for, on the replicas `dest` names, and `None` on the others. Collective:
    /// every replica calls it with the same variables.
    pub fn reduce_gradients(
        &self,
        grads: &GradStore,
        vars: &[Var],
        dest: Destination,
    ) -> Result<Option<Vec<Option<Tensor>>>> {
        let local: Vec<Option<Tensor>> = vars.iter().map(|v| grads.get(v).cloned()).collect();
        self.reduce_present(local, vars, dest, self.batch_weight(), None, None)
    }

    /// [`ReplicaContext::reduce_gradients`] of gradients already taken from a store, in the
    /// order of `vars`, each multiplied by `weight`.
    /// `keep`, by variable: the elements of its gradient this replica needs reduced (the rest
    /// may keep its own values). `max_run`: see [`ReplicaContext::reduce_in_buckets`].
    pub(crate) fn reduce_present(
        &self,
        local: Vec<Option<Tensor>>,
        vars: &[Var],
        dest: Destination,
        weight: f32,
        keep: Option<&[std::ops::Range<usize>]>,
        max_run: Option<usize>,
    ) -> Result<Option<Vec<Option<Tensor>>>> {
        let mine: Vec<bool> = local.iter().map(Option::is_some).collect();
        let present = self.any_replica(&mine)?;
        let index: Vec<usize> = (0..vars.len()).filter(|&i| present[i]).collect();
        let grads: Vec<Tensor> = index
            .iter()
            .map(|&i| match &local[i] {
                Some(g) => Ok(g.contiguous()?),
                None => Ok(vars[i].zeros_like()?),
            })
            .collect::<Result<_>>()?;
        let ids: Vec<TensorId> = index.iter().map(|&i| vars[i].id()).collect();
        let keep: Option<Vec<std::ops::Range<usize>>> = keep.map(|k| index.iter().map(|&i| k[i].clone()).collect());
        self.reduce_in_buckets(&grads, &ids, dest, weight, keep.as_deref(), max_run)?;
        if !dest.receives(self.replica) {
            return Ok(None);
        }
        let mut out: Vec<Option<Tensor>> = vec![None; vars.len()];
        for (i, g) in index.into_iter().zip(grads) {
            out[i] = Some(g);
        }
        Ok(Some(out))
    }
}

impl ReplicaContext<'_> {
    /// Reduces `grads` (contiguous f32 tensors) with the strategy's cross-device op, in fused
    /// buckets of the strategy's size, each replica's contribution times `weight` (gradients:
    /// [`CrossDeviceOps::start_gradients`](crate::cross_device::CrossDeviceOps::start_gradients),
    /// compressed where the strategy compresses them; `ids` are their variables'); the result
    /// is written back into the receiving replicas' `grads`. Collective.
    ///
    /// `keep`, by tensor: the elements this replica needs the result of (ZeRO's shard); the
    /// others keep this replica's own values.
    ///
    /// `max_run`: no reduction is larger than this many elements; a larger tensor is reduced
    /// in runs of its elements (views of its flattened storage). Only for ops that reduce
    /// element by element ([`CrossDeviceOps::takes_row_blocks`](crate::cross_device::CrossDeviceOps::takes_row_blocks)),
    /// whose results do not depend on how a buffer is cut: ZeRO stage 2 keeps the ops' own
    /// buffers, and the peak of the step, that small.
    pub(crate) fn reduce_in_buckets(
        &self,
        grads: &[Tensor],
        ids: &[TensorId],
        dest: Destination,
        weight: f32,
        keep: Option<&[std::ops::Range<usize>]>,
        max_run: Option<usize>,
    ) -> Result<()> {
        if let Some(max) = max_run.filter(|&m| m > 0 && grads.iter().any(|g| g.elem_count() > m)) {
            let (mut runs, mut run_ids, mut run_keep) = (Vec::new(), Vec::new(), Vec::new());
            for (i, g) in grads.iter().enumerate() {
                let flat = g.flatten_all()?;
                let len = flat.elem_count();
                for at in (0..len.max(1)).step_by(max) {
                    let n = max.min(len - at);
                    runs.push(flat.narrow(0, at, n)?);
                    run_ids.push(ids[i]);
                    if let Some(k) = keep {
                        let (lo, hi) = (k[i].start.max(at), k[i].end.min(at + n));
                        run_keep.push(if lo < hi { lo - at..hi - at } else { 0..0 });
                    }
                }
            }
            let keep = keep.map(|_| run_keep.as_slice());
            let bytes = self.shared.ext.options().bucket_bytes.min(max * std::mem::size_of::<f32>());
            return self.reduce_runs(&runs, &run_ids, dest, weight, keep, bytes);
        }
        self.reduce_runs(grads, ids, dest, weight, keep, self.shared.ext.options().bucket_bytes)
    }

    /// [`ReplicaContext::reduce_in_buckets`] in buckets of at most `bucket_bytes`.
    fn reduce_runs(
        &self,
        grads: &[Tensor],
        ids: &[TensorId],
        dest: Destination,
        weight: f32,
        keep: Option<&[std::ops::Range<usize>]>,
        bucket_bytes: usize,
    ) -> Result<()> {
        let sizes: Vec<usize> = grads.iter().map(Tensor::elem_count).collect();
        let ops = self.shared.ext.cross_device_ops();
        // The reduced gradient is written back into this replica's own gradient tensors: after
        // a bucket's second rendezvous no peer reads them any more, their pages are already
        // mapped (no allocation, no page faults), and the optimizer then reads them as usual.
        // A failure to write back is reported after the last bucket: every replica takes part
        // in every collective.
        let mut failed = Ok(());
        for (b, bucket) in plan_buckets(&sizes, bucket_bytes).iter().enumerate() {
            let _p = self.phase("reduce", &format!("bucket {b}"));
            let _s =
                tracing::trace_span!("reduce_bucket", replica = self.replica, bucket = b, elements = bucket.elements)
                    .entered();
            let tensors = &grads[bucket.tensors.clone()];
            let mut sink =
                Scatter::new(tensors, ops.reduces_in_place()).keeping(keep.map(|k| &k[bucket.tensors.clone()]));
            let req = self.request(ReduceOp::Sum, dest, tensors, weight);
            let started = ops.start_gradients(req, &ids[bucket.tensors.clone()], &mut |piece| sink.write(piece))?;
            ops.finish(req, started, &mut |piece| sink.write(piece))?;
            failed = failed.and(sink.check());
        }
        failed
    }
}

/// Writes consecutive pieces of a bucket's reduced values back into its tensors, in place
/// (nothing for device-resident ops, which write the result themselves).
pub(crate) struct Scatter<'t> {
    tensors: &'t [Tensor],
    in_place: bool,
    /// The elements of each tensor to write (all where `None`): a replica that steps only its
    /// shard of the parameters (ZeRO) needs the reduced values of that shard only.
    keep: Option<&'t [std::ops::Range<usize>]>,
    cur: usize,
    filled: usize,
    failed: Option<candle_core::Error>,
}

impl<'t> Scatter<'t> {
    pub(crate) fn new(tensors: &'t [Tensor], in_place: bool) -> Self {
        Self { tensors, in_place, keep: None, cur: 0, filled: 0, failed: None }
    }

    /// Goes on over the same `tensors` where [`pause`](Self::pause) left off.
    pub(crate) fn resume(tensors: &'t [Tensor], in_place: bool, at: ScatterPos) -> Self {
        Self { tensors, in_place, keep: None, cur: at.cur, filled: at.filled, failed: at.failed }
    }

    /// Writes only elements `keep[i]` of tensor `i` (the others keep what they held).
    pub(crate) fn keeping(mut self, keep: Option<&'t [std::ops::Range<usize>]>) -> Self {
        self.keep = keep;
        self
    }

    /// Where the writes got to (and their first failure), for [`resume`](Self::resume) to go
    /// on from: a reduction's start and finish write one bucket at two times.
    pub(crate) fn pause(self) -> ScatterPos {
        ScatterPos { cur: self.cur, filled: self.filled, failed: self.failed }
    }

    pub(crate) fn write(&mut self, mut piece: &[f32]) {
        if self.in_place {
            return;
        }
        while !piece.is_empty() {
            while self.cur < self.tensors.len() && self.filled == self.tensors[self.cur].elem_count() {
                (self.cur, self.filled) = (self.cur + 1, 0);
            }
            let Some(t) = self.tensors.get(self.cur) else {
                self.failed.get_or_insert_with(|| {
                    candle_core::Error::Msg("a reduction returned more values than its bucket holds".into())
                });
                return;
            };
            let take = (t.elem_count() - self.filled).min(piece.len());
            let (lo, hi) = match self.keep.and_then(|k| k.get(self.cur)) {
                Some(k) => (k.start.max(self.filled), k.end.min(self.filled + take)),
                None => (self.filled, self.filled + take),
            };
            if lo < hi {
                let data = &piece[lo - self.filled..hi - self.filled];
                if let Err(e) = t.inplace_op1(&WriteAt { offset: lo, data }) {
                    self.failed.get_or_insert(e);
                }
            }
            self.filled += take;
            piece = &piece[take..];
        }
    }

    /// The first failure to write, if any.
    pub(crate) fn check(self) -> Result<()> {
        match self.failed {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }
}

/// A paused [`Scatter`]'s position.
#[derive(Default)]
pub(crate) struct ScatterPos {
    cur: usize,
    filled: usize,
    failed: Option<candle_core::Error>,
}

/// A handle to the collectives of the replica the current thread runs, for code that has no
/// [`ReplicaContext`] at hand: a layer's forward or backward pass (candle's `Module` takes a
/// tensor), such as [`SyncBatchNorm`](crate::layers::SyncBatchNorm)'s. Every replica thread of
/// a step sets it (TensorFlow's `get_replica_context()`); outside a step there is none.
#[derive(Clone)]
pub struct ReplicaHandle {
    group: Arc<ReplicaGroup>,
    replica: usize,
    workers: Option<Arc<dyn WorkerCollectives>>,
}

impl std::fmt::Debug for ReplicaHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaHandle")
            .field("replica", &self.replica)
            .field("replicas", &self.group.num_replicas())
            .field("workers", &self.workers.as_ref().map(|w| w.num_workers()))
            .finish()
    }
}

thread_local! {
    static CURRENT: std::cell::RefCell<Option<ReplicaHandle>> = const { std::cell::RefCell::new(None) };
}

/// Restores the thread's previous replica handle when dropped.
pub(crate) struct CurrentReplica(Option<ReplicaHandle>);

impl Drop for CurrentReplica {
    fn drop(&mut self) {
        let previous = self.0.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

impl ReplicaHandle {
    /// The handle of the replica this thread runs, if it runs one.
    pub fn current() -> Option<ReplicaHandle> {
        CURRENT.with(|c| c.borrow().clone())
    }

    /// Makes `self` the thread's current replica until the returned guard drops.
    pub(crate) fn enter(self) -> CurrentReplica {
        CurrentReplica(CURRENT.with(|c| c.borrow_mut().replace(self)))
    }

    /// This replica's index on its worker.
    pub fn replica_id(&self) -> usize {
        self.replica
    }

    /// Whether this replica is the only one in sync (nothing to combine).
    pub fn is_single(&self) -> bool {
        self.group.num_replicas() == 1 && self.workers.is_none()
    }

    /// The element-wise sum of every replica's `data` (on every worker), in replica then
    /// worker order, so every replica gets the same bits. Collective: every replica calls it
    /// with as many values and the same `tag`, which names it in a mismatch.
    pub fn all_reduce_sum(&self, tag: &str, data: Vec<f32>) -> Result<Vec<f32>> {
        let (group, replica) = (&*self.group, self.replica);
        let key = OpKey { seq: group.next_seq(replica), op: format!("all_reduce_sum({tag})"), shape: vec![data.len()] };
        let all = group.exchange(replica, &key, Arc::new(data))?;
        let mut sum = all[0].as_ref().clone();
        for v in &all[1..] {
            sum.iter_mut().zip(v.iter()).for_each(|(s, x)| *s += x);
        }
        let Some(w) = &self.workers else { return Ok(sum) };
        let mine = if replica == 0 {
            w.all_reduce(ReduceOp::Sum, &mut sum).map(|()| Arc::new(sum)).map_err(|e| e.to_string())
        } else {
            Ok(Arc::new(Vec::new()))
        };
        let key = OpKey { seq: group.next_seq(replica), op: format!("all_reduce_sum({tag}, workers)"), shape: vec![] };
        match group.exchange(replica, &key, mine)?.into_iter().next() {
            Some(Ok(v)) => Ok(v.as_ref().clone()),
            Some(Err(e)) => Err(Error::Cluster(e)),
            None => Err(Error::Scope(format!("all_reduce_sum({tag}) produced no result"))),
        }
    }
}

fn rest_len(t: &Tensor) -> usize {
    t.dims().iter().skip(1).product()
}

/// Writes `data` into a contiguous f32 CPU tensor at element `offset`, in place.
struct WriteAt<'a> {
    offset: usize,
    data: &'a [f32],
}

impl candle_core::InplaceOp1 for WriteAt<'_> {
    fn name(&self) -> &'static str {
        "strata-write-at"
    }

    fn cpu_fwd(&self, storage: &mut candle_core::CpuStorage, layout: &candle_core::Layout) -> candle_core::Result<()> {
        match (storage, layout.contiguous_offsets()) {
            (candle_core::CpuStorage::F32(v), Some((lo, hi))) if self.offset + self.data.len() <= hi - lo => {
                let at = lo + self.offset;
                v[at..at + self.data.len()].copy_from_slice(self.data);
                Ok(())
            }
            _ => candle_core::bail!("reduced gradients are written back into contiguous f32 gradients only"),
        }
    }
}

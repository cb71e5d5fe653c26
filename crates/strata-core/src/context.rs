//! [`ReplicaContext`]: what a step sees on one replica.

use std::any::Any;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_nn::Optimizer;

use crate::cross_device::{plan_buckets, Destination};
use crate::device::LogicalDevice;
use crate::group::{OpKey, ReplicaGroup};
use crate::strategy::{StrategyExtended, StrategyId, VariablePolicy};
use crate::timeline::TimelineSpan;
use crate::variables::DistributedOptimizer;
use crate::{Error, PerReplica, ReduceOp, Result};

/// What the replicas of one step share.
pub struct StepShared<'a> {
    pub(crate) ext: &'a dyn StrategyExtended,
    pub(crate) group: ReplicaGroup,
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
        let devices = ext.replica_devices().iter().map(crate::runtime::candle_device).collect::<Result<_>>()?;
        Ok(Self { ext, group: ReplicaGroup::new(n, ext.options().collective_timeout)?, weights, devices })
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
    shared: &'a StepShared<'a>,
    replica: usize,
    /// This replica's share of the current global batch (changes between the steps of one
    /// execution, see [`Strategy::run_batches`](crate::Strategy::run_batches)).
    weight: std::sync::atomic::AtomicU32,
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
        Self { shared, replica, weight: std::sync::atomic::AtomicU32::new(shared.weights[replica].to_bits()) }
    }

    /// Sets this replica's share of the global batch for the next step.
    pub fn set_batch_weight(&self, weight: f32) {
        self.weight.store(weight.to_bits(), std::sync::atomic::Ordering::Relaxed);
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

    fn next_key(&self, op: String, shape: Vec<usize>) -> OpKey {
        OpKey { seq: self.shared.group.next_seq(self.replica), op, shape }
    }

    /// Waits until every replica reaches this point.
    pub fn barrier(&self) -> Result<()> {
        let key = self.next_key("barrier".into(), vec![]);
        self.shared.group.arrive(self.replica, &key)?;
        if let Some(w) = self.shared.ext.workers() {
            let r = if self.replica == 0 { w.barrier().map_err(|e| e.to_string()) } else { Ok(()) };
            self.share_from_first("barrier(workers)", r)?;
        }
        Ok(())
    }

    /// Replica 0's result, handed to every local replica.
    fn share_from_first<T: Any + Send + Clone>(&self, what: &str, mine: std::result::Result<T, String>) -> Result<T> {
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
        let seq = self.shared.group.next_seq(self.replica);
        let ops = self.shared.ext.cross_device_ops();
        if ops.reduces_in_place() {
            // A copy of its own: the reduction overwrites it, and `t` stays the caller's.
            let buf = input.copy()?;
            let group = &self.shared.group;
            ops.reduce(
                group,
                self.replica,
                seq,
                op,
                Destination::AllReplicas,
                std::slice::from_ref(&buf),
                1.0,
                &mut |_| {},
            )?;
            return Ok(buf.to_dtype(t.dtype())?);
        }
        let mut out = Vec::with_capacity(input.elem_count());
        self.shared.ext.cross_device_ops().reduce(
            &self.shared.group,
            self.replica,
            seq,
            op,
            Destination::AllReplicas,
            std::slice::from_ref(&input),
            1.0,
            &mut |p| out.extend_from_slice(p),
        )?;
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
        let Some(w) = self.shared.ext.workers() else { return Ok(local) };
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

    /// Computes the gradients of `loss` and synchronises and applies them the strategy's way:
    /// mirrored variables all-reduce and every replica applies the same update to its copy;
    /// central variables reduce to the parameter device, which applies the update once.
    pub fn backward_and_sync<O: Optimizer>(&self, loss: &Tensor, opt: &DistributedOptimizer<O>) -> Result<()> {
        let grads = {
            let _p = self.phase("step", "backward");
            let _s = tracing::trace_span!("backward", replica = self.replica).entered();
            loss.backward()?
        };
        self.sync_and_apply(grads, opt)
    }

    /// Synchronises already computed gradients and applies them (see
    /// [`ReplicaContext::backward_and_sync`]).
    pub fn sync_and_apply<O: Optimizer>(&self, grads: GradStore, opt: &DistributedOptimizer<O>) -> Result<()> {
        opt.check_strategy(self)?;
        let n = self.shared.group.num_replicas();
        let policy = opt.policy();
        let copy = match policy {
            VariablePolicy::Mirrored => self.replica,
            VariablePolicy::Central { .. } => 0,
        };
        if n == 1 && self.shared.ext.workers().is_none() {
            let _p = self.phase("step", "optimizer");
            return Ok(opt.lock(0).step(&grads)?);
        }
        let vars = opt.vars(copy);
        let dest = match policy {
            VariablePolicy::Mirrored => Destination::AllReplicas,
            VariablePolicy::Central { parameter_replica } => Destination::Replica(parameter_replica),
        };
        if let Some(reduced) = self.reduce_gradients(&grads, &vars, dest)? {
            let _p = self.phase("step", "optimizer");
            let mut store = GradStore::default();
            for (v, g) in vars.iter().zip(reduced) {
                store.insert(v.as_tensor(), g);
            }
            opt.lock(copy).step(&store)?;
        }
        if matches!(policy, VariablePolicy::Central { .. }) {
            // Replicas read the central variables only after the update is applied.
            self.barrier()?;
        }
        Ok(())
    }

    /// Reduces this replica's gradients of `vars` (from `grads`; a variable without one counts
    /// as zeros) with the strategy's cross-device op, in fused buckets: the sum over every
    /// replica (and worker) of each replica's gradient times its share of the batch. Returns the
    /// reduced gradients, in the order of `vars`, on the replicas `dest` names, and `None` on
    /// the others. Collective: every replica calls it with the same variables.
    pub fn reduce_gradients(&self, grads: &GradStore, vars: &[Var], dest: Destination) -> Result<Option<Vec<Tensor>>> {
        let grads: Vec<Tensor> = vars
            .iter()
            .map(|v| match grads.get(v) {
                Some(g) => Ok(g.contiguous()?),
                None => Ok(v.zeros_like()?),
            })
            .collect::<Result<_>>()?;
        let sizes: Vec<usize> = grads.iter().map(Tensor::elem_count).collect();
        let ops = self.shared.ext.cross_device_ops();
        // The reduced gradient is written back into this replica's own gradient tensors: after
        // a bucket's second rendezvous no peer reads them any more, their pages are already
        // mapped (no allocation, no page faults), and the optimizer then reads them as usual.
        let mut failed: Option<candle_core::Error> = None;
        for (b, bucket) in plan_buckets(&sizes, self.shared.ext.options().bucket_bytes).iter().enumerate() {
            let _p = self.phase("reduce", &format!("bucket {b}"));
            let _s =
                tracing::trace_span!("reduce_bucket", replica = self.replica, bucket = b, elements = bucket.elements)
                    .entered();
            let seq = self.shared.group.next_seq(self.replica);
            let range = bucket.tensors.clone();
            let (mut cur, mut filled) = (range.start, 0usize);
            // Device-resident ops write the result into `grads` themselves.
            let in_place = ops.reduces_in_place();
            ops.reduce(
                &self.shared.group,
                self.replica,
                seq,
                ReduceOp::Sum,
                dest,
                &grads[range.clone()],
                self.batch_weight(),
                &mut |mut piece: &[f32]| {
                    if in_place {
                        return;
                    }
                    while !piece.is_empty() {
                        while filled == sizes[cur] {
                            (cur, filled) = (cur + 1, 0);
                        }
                        let take = (sizes[cur] - filled).min(piece.len());
                        if let Err(e) = grads[cur].inplace_op1(&WriteAt { offset: filled, data: &piece[..take] }) {
                            failed.get_or_insert(e);
                        }
                        filled += take;
                        piece = &piece[take..];
                    }
                },
            )?;
        }
        if let Some(e) = failed {
            return Err(e.into());
        }
        let receives = match dest {
            Destination::AllReplicas => true,
            Destination::Replica(p) => p == self.replica,
        };
        Ok(receives.then_some(grads))
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

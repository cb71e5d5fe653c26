//! Cross-device operations: how the replicas of a step combine their values, and the
//! collectives between the workers of a multi-worker job.
//!
//! A [`CrossDeviceOps`] is a *collective*: every replica thread of a step calls it with its own
//! contribution (a [`ReduceRequest`]), and it returns when the result is available. GPU
//! implementations live in strata-cuda; here are the CPU ones. Two share one data path
//! ([`CpuCrossDeviceOps`]):
//!
//! - [`CpuCrossDeviceOps::in_memory_all_reduce`]: each replica thread reduces its own chunk of
//!   every replica's buffer, reading the replicas' tensors in place (a reduce-scatter: `K`
//!   buffers read once, one result written, the least memory traffic a reduction can have),
//!   then every replica reads the reduced chunks in place (the all-gather) as it consumes them.
//! - [`CpuCrossDeviceOps::reduction_to_one_device`]: the destination replica reduces every
//!   chunk alone, as TensorFlow's `ReductionToOneDevice` does.
//!
//! [`HierarchicalOps`] (MultiWorkerMirrored's default) reduces a worker's replicas in memory to
//! replica 0, which all-reduces across the workers through [`WorkerCollectives`] (the
//! cross-worker half, implemented over the ring by strata-strategies), and every local replica
//! receives the result.
//!
//! Gradients are fused into buckets ([`plan_buckets`]) of at most
//! [`DEFAULT_BUCKET_BYTES`] so that one collective carries many small tensors.

mod bucket;
pub mod compression;
mod cpu;
mod hierarchical;

pub use bucket::{plan_buckets, Bucket, DEFAULT_BUCKET_BYTES, DEFAULT_ROW_BLOCK_BYTES};
pub(crate) use cpu::read_slices;
pub use cpu::CpuCrossDeviceOps;
pub use hierarchical::HierarchicalOps;

use candle_core::Tensor;

use crate::group::ReplicaGroup;
use crate::{ReduceOp, Result};

/// Where a reduction's result goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Destination {
    /// Every replica receives the result (all-reduce).
    AllReplicas,
    /// Only this replica (the parameter device's) receives the result (reduce).
    Replica(usize),
}

impl Destination {
    /// Whether `replica` receives the result.
    pub fn receives(self, replica: usize) -> bool {
        match self {
            Destination::AllReplicas => true,
            Destination::Replica(d) => d == replica,
        }
    }
}

/// One replica's part of a collective reduction: every replica of `group` makes the same
/// request (the same `seq`, `op`, `dest` and total input length), each with its own
/// `replica`, `input` and `weight`.
///
/// The replica's contribution is the concatenation of the (flattened, f32, contiguous) `input`
/// tensors, each element multiplied by `weight`; peers may read the tensors in place, so they
/// are not copied. Where the result goes depends on the ops' output mode (see
/// [`CrossDeviceOps::reduces_in_place`]):
///
/// - **host pieces** (`reduces_in_place() == false`, the CPU ops): the receiving replicas'
///   `out` sink is called with consecutive pieces of the result, in order; a piece stays valid
///   only during the call, and `input` is left as it was;
/// - **in place** (`reduces_in_place() == true`, device-resident ops: NCCL, Strata's CUDA
///   kernels): the result is written into the receiving replicas' own `input` tensors, on
///   their device, and `out` is never called.
#[derive(Clone, Copy, Debug)]
pub struct ReduceRequest<'a> {
    /// The replicas of the step, where they meet.
    pub group: &'a ReplicaGroup,
    /// The calling replica.
    pub replica: usize,
    /// The collective's sequence number in the step ([`ReplicaGroup::next_seq`]).
    pub seq: u64,
    /// How the contributions combine.
    pub op: ReduceOp,
    /// Which replicas receive the result.
    pub dest: Destination,
    /// This replica's contribution (and, for in-place ops, where its result is written).
    pub input: &'a [Tensor],
    /// The factor every element of this replica's contribution is multiplied by.
    pub weight: f32,
}

impl ReduceRequest<'_> {
    /// The number of elements of this replica's contribution.
    pub fn len(&self) -> usize {
        self.input.iter().map(Tensor::elem_count).sum()
    }

    /// Whether the contribution has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the calling replica receives the result.
    pub fn receives(&self) -> bool {
        self.dest.receives(self.replica)
    }
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
    /// Gathers every worker's `mine` into `out`, worker after worker, where every worker's
    /// length is known beforehand (`counts[w]`, one per worker, summing to `out.len()`): an
    /// implementation with a network of its own receives each worker's values straight into
    /// their place. A worker whose length is not its count is an error. The default gathers
    /// with [`all_gather`](WorkerCollectives::all_gather) and copies.
    fn all_gather_into(&self, mine: &[f32], out: &mut [f32], counts: &[usize]) -> Result<()> {
        let all = self.all_gather(mine)?;
        let lens: Vec<usize> = all.iter().map(Vec::len).collect();
        if lens != counts || counts.iter().sum::<usize>() != out.len() {
            return Err(crate::Error::Cluster(format!(
                "an all-gather into {} values expected {counts:?} from the workers and got {lens:?}; every worker must build the same model",
                out.len()
            )));
        }
        let mut at = 0;
        for v in all {
            out[at..at + v.len()].copy_from_slice(&v);
            at += v.len();
        }
        Ok(())
    }
    /// Overwrites `data` on every worker with worker `root`'s.
    fn broadcast(&self, root: usize, data: &mut [f32]) -> Result<()>;
    /// Overwrites `data` on every worker with worker `root`'s: integers (a step, a flag), bit
    /// for bit, where [`broadcast`](WorkerCollectives::broadcast) carries f32 values.
    fn broadcast_u64s(&self, root: usize, data: &mut [u64]) -> Result<()>;
    /// Waits until every worker reaches this point.
    fn barrier(&self) -> Result<()>;
    /// Starts an all-reduce of `data` across the workers and returns without waiting for it,
    /// so that the caller can compute meanwhile (a bucket of gradients reduced while the
    /// backward pass goes on); [`PendingAllReduce::wait`] gives the result. Collectives run in
    /// the order they are called, started ones included: a collective called after a start
    /// runs after it. The default runs the all-reduce at once.
    fn start_all_reduce(&self, op: ReduceOp, mut data: Vec<f32>) -> PendingAllReduce {
        PendingAllReduce::ready(self.all_reduce(op, &mut data).map(|()| data))
    }
    /// [`start_all_reduce`](WorkerCollectives::start_all_reduce) of a sum whose values cross
    /// the network in 16 bits (`format`), each hop adding in f32 (gradient compression); every
    /// worker gets the same bits. An implementation without a network of its own sums in f32
    /// (the default).
    fn start_all_reduce_half(&self, data: Vec<f32>, format: compression::HalfFormat) -> PendingAllReduce {
        let _ = format;
        self.start_all_reduce(ReduceOp::Sum, data)
    }
    /// [`start_all_reduce`](WorkerCollectives::start_all_reduce) of a sum whose values cross
    /// the network in int8 blocks ([`compression::Int8Blocks`]), each hop adding in f32 (local
    /// SGD's outer gradients); every worker gets the same bits. An implementation without a
    /// network of its own sums in f32 (the default).
    fn start_all_reduce_int8(&self, data: Vec<f32>) -> PendingAllReduce {
        self.start_all_reduce(ReduceOp::Sum, data)
    }
    /// The elements of a buffer of `len` a reduce-scatter leaves reduced on worker `worker`
    /// ([`start_reduce_scatter`](WorkerCollectives::start_reduce_scatter)): the ring's
    /// segment `(worker + 1) mod n` of `n` even segments, which is where a ring all-reduce
    /// finishes its first half on that worker. ZeRO across workers lays each worker's shard out
    /// on these segments.
    fn scatter_segment(&self, len: usize, worker: usize) -> std::ops::Range<usize> {
        let n = self.num_workers().max(1);
        let at = |k: usize| (len as u128 * k as u128 / n as u128) as usize;
        let k = (worker + 1) % n;
        at(k)..at(k + 1)
    }
    /// Starts a reduce-scatter of `data` across the workers: the result holds this worker's
    /// [`scatter_segment`](WorkerCollectives::scatter_segment) of the all-reduce, bit for bit
    /// as [`start_all_reduce`](WorkerCollectives::start_all_reduce) leaves it there, for about
    /// half the bytes; what the result holds elsewhere is unspecified (NaN over the ring). The
    /// default runs the whole all-reduce.
    fn start_reduce_scatter(&self, op: ReduceOp, data: Vec<f32>) -> PendingAllReduce {
        self.start_all_reduce(op, data)
    }
    /// Elastic jobs: the current generation of the job's membership, which changes when a
    /// worker is lost or joins (0 in a job that is not elastic). State agreed between the
    /// workers (an overlap plan, compression's state) is agreed again in a new generation.
    fn generation(&self) -> u64 {
        0
    }
    /// Whether the job is elastic: a lost worker costs a step, not the job.
    fn is_elastic(&self) -> bool {
        false
    }
    /// Elastic jobs: whether this worker joined a job under way, so that it takes its state
    /// (parameters, optimizer state, step) from a member instead of starting afresh.
    fn joined_under_way(&self) -> bool {
        false
    }
    /// Elastic jobs: after a collective failed (a worker was lost, or the members agreed to
    /// admit waiting workers), joins the next generation with the live workers and returns once
    /// its collectives connect. [`num_workers`](WorkerCollectives::num_workers) and
    /// [`worker_index`](WorkerCollectives::worker_index) are the new generation's. Fails when
    /// the job cannot go on (too few workers left, or this worker was declared lost).
    fn rejoin(&self) -> Result<()> {
        Err(crate::Error::Cluster("this job is not elastic: a failed collective ends it".into()))
    }
    /// Elastic jobs: the fewest workers the job may go on with (in a job that is not elastic,
    /// every worker: [`num_workers`](WorkerCollectives::num_workers)).
    fn min_workers(&self) -> usize {
        self.num_workers()
    }
    /// Elastic jobs: this worker alone stops on request (`code`, a signal's number) and leaves
    /// the job, which goes on without it: the others [`rejoin`](WorkerCollectives::rejoin)
    /// at once, without waiting for its heartbeat timeout. Its collectives end.
    fn leave_on_request(&self, code: u32) -> Result<()> {
        let _ = code;
        Err(crate::Error::Cluster("this job is not elastic: a worker cannot leave it alone".into()))
    }
    /// Elastic jobs: whether the workers agree to admit the workers waiting to join (worker
    /// 0's view, broadcast: a collective, called at step boundaries). When it returns true,
    /// every worker calls [`rejoin`](WorkerCollectives::rejoin).
    fn admit_waiting(&self) -> Result<bool> {
        Ok(false)
    }
    /// Ends this generation's collectives on this worker at once (`why`, a lower-case
    /// sentence): every one under way, called or started after it fails, and so do the other
    /// workers' that need this one. An elastic job goes on in the next generation
    /// ([`rejoin`](WorkerCollectives::rejoin)); any other job fails. ZeRO stage 3 calls it
    /// where an op could not bring a released variable back from a peer and computed on with a
    /// stand-in, which no collective may carry. Nothing by default.
    fn abort_generation(&self, why: &str) {
        let _ = why;
    }
    /// ZeRO stage 3 across workers: starts answering the other workers' requests for this
    /// worker's pieces of the parameters from `source`, and returns what requests theirs
    /// ([`PeerPieces`]). Collective: every worker calls it at the same point (the optimizer's
    /// build, and in an elastic job again in each generation of the membership, whose ring
    /// serves it; the earlier service stops when its handle is dropped). Requests and answers run beside the collectives, in no order with
    /// them, so a worker may bring a variable back whenever it uses it. The default serves
    /// nothing: stage 3 across workers is refused.
    fn serve_pieces(&self, source: std::sync::Weak<dyn PieceSource>) -> Result<std::sync::Arc<dyn PeerPieces>> {
        let _ = source;
        Err(crate::Error::ZeroStage {
            stage: 3,
            what: format!("{} workers whose collectives serve no pieces of the parameters", self.num_workers()),
            fix: "use stage 2 across these workers, or multi-worker-mirrored, whose ring serves them",
        })
    }
}

/// What a worker answers its peers' requests for its pieces of ZeRO stage 3's parameters with
/// ([`WorkerCollectives::serve_pieces`]).
pub trait PieceSource: Send + Sync {
    /// This worker's elements of trainable variable `var` (every local replica's runs of it,
    /// replica after replica, each in order) as they are after `version` of its updates
    /// (optimizer steps and loads, which every worker counts alike): waits until the worker
    /// reaches `version`, and fails where it does not by `deadline`, where it is past it, or
    /// where `var` is no variable of the model.
    fn pieces(&self, var: usize, version: u64, deadline: std::time::Instant) -> Result<Vec<f32>>;
}

/// Requests to the other workers for their pieces of ZeRO stage 3's parameters.
pub trait PeerPieces: Send + Sync + std::fmt::Debug {
    /// Worker `worker`'s [`PieceSource::pieces`] of variable `var` at `version`: `len` values,
    /// or an error naming the worker (lost, too slow, or answering another length).
    fn pull(&self, worker: usize, var: usize, version: u64, len: usize) -> Result<Vec<f32>>;
}

/// A cross-worker all-reduce started by [`WorkerCollectives::start_all_reduce`].
#[derive(Debug)]
pub struct PendingAllReduce(Pending);

#[derive(Debug)]
enum Pending {
    Ready(Result<Vec<f32>>),
    Waiting(std::sync::mpsc::Receiver<Result<Vec<f32>>>),
}

impl PendingAllReduce {
    /// An all-reduce that already finished with `result`.
    pub fn ready(result: Result<Vec<f32>>) -> Self {
        Self(Pending::Ready(result))
    }

    /// An all-reduce whose result `receiver` will get.
    pub fn waiting(receiver: std::sync::mpsc::Receiver<Result<Vec<f32>>>) -> Self {
        Self(Pending::Waiting(receiver))
    }

    /// Waits for the result.
    pub fn wait(self) -> Result<Vec<f32>> {
        match self.0 {
            Pending::Ready(r) => r,
            Pending::Waiting(rx) => rx.recv().unwrap_or_else(|_| {
                Err(crate::Error::Cluster("a started cross-worker all-reduce ended without a result".into()))
            }),
        }
    }
}

/// What [`CrossDeviceOps::start`] leaves for [`CrossDeviceOps::finish`].
#[derive(Debug)]
pub enum Started {
    /// The reduction is complete.
    Done,
    /// The local part is done; the cross-worker all-reduce runs (its handle on the replica
    /// that started it, `None` on the others).
    AcrossWorkers(Option<PendingAllReduce>),
}

/// A collective reduction across the replicas of one machine.
pub trait CrossDeviceOps: Send + Sync + std::fmt::Debug {
    /// A short name for logs and benchmarks.
    fn name(&self) -> &'static str;

    /// Collective: every replica of `req.group` calls this with its [`ReduceRequest`], and it
    /// returns when this replica's part is done (its result delivered, if it receives one).
    /// Host implementations hand the result to `out`; in-place ones write it into
    /// `req.input` and ignore `out` (see [`CrossDeviceOps::reduces_in_place`]).
    fn reduce(&self, req: ReduceRequest<'_>, out: &mut dyn FnMut(&[f32])) -> Result<()>;

    /// The output mode: `true` for device-resident implementations (NCCL, Strata's CUDA
    /// kernels) whose [`reduce`](CrossDeviceOps::reduce) writes the result into the request's
    /// `input` tensors themselves, on their device, and never calls `out`: the caller then
    /// reads the result from its inputs (where it receives one). The host implementations
    /// return `false` and hand the result to `out` in pieces.
    fn reduces_in_place(&self) -> bool {
        false
    }

    /// The first half of [`reduce`](CrossDeviceOps::reduce), to overlap a reduction with
    /// computation: starts it and returns what [`finish`](CrossDeviceOps::finish) completes.
    /// Collective like `reduce`: every replica starts the same reductions in the same order
    /// and finishes them in that order; `out` may be called by either half. The default
    /// reduces at once, and its `finish` has nothing left to do.
    fn start(&self, req: ReduceRequest<'_>, out: &mut dyn FnMut(&[f32])) -> Result<Started> {
        self.reduce(req, out).map(|()| Started::Done)
    }

    /// [`start`](CrossDeviceOps::start) for a bucket of gradients, `ids` naming the variable
    /// of each input tensor (stable from step to step): where the ops carry gradients over a
    /// network with [compression](compression::Compression), this is where it applies, with
    /// any state it keeps per variable (other reductions, such as a layer's statistics, stay
    /// exact). The default is `start`; [`finish`](CrossDeviceOps::finish) completes either.
    fn start_gradients(
        &self,
        req: ReduceRequest<'_>,
        ids: &[candle_core::TensorId],
        out: &mut dyn FnMut(&[f32]),
    ) -> Result<Started> {
        let _ = ids;
        self.start(req, out)
    }

    /// [`start_gradients`](CrossDeviceOps::start_gradients) where every replica needs only
    /// its worker's [`scatter_segment`](WorkerCollectives::scatter_segment) of the result
    /// (ZeRO across workers): ops that reduce across workers may then reduce-scatter there,
    /// and the result elsewhere is unspecified. The default is `start_gradients`.
    fn start_scatter(
        &self,
        req: ReduceRequest<'_>,
        ids: &[candle_core::TensorId],
        out: &mut dyn FnMut(&[f32]),
    ) -> Result<Started> {
        self.start_gradients(req, ids, out)
    }

    /// Refuses gradients of `shapes` (a model's trainable variables) the ops cannot carry as
    /// configured: a PowerSGD rank at which none of them is compressed
    /// ([`Compression::check_model`](compression::Compression::check_model)). Called when an
    /// optimizer is built; the default accepts every model.
    fn check_gradients(&self, shapes: &[&[usize]]) -> Result<()> {
        let _ = shapes;
        Ok(())
    }

    /// Whether a gradient may be reduced in blocks of its rows, each a request of its own
    /// (same variable id), with the result the whole gradient's reduction would give: true for
    /// elementwise reductions that hand their result to `out`. The default is `false`, which
    /// keeps every gradient whole.
    fn takes_row_blocks(&self) -> bool {
        false
    }

    /// Whether the replicas of one machine may sum their gradients in the optimizer's step
    /// instead of this op reducing them: each replica reads every replica's gradient in place
    /// for the elements it steps (ZeRO's shards, stage 1), and the sum is the one the op would
    /// make. True for ops whose result is each element's inputs times their weights summed in
    /// replica order, as the in-memory CPU reductions make it; `replica` is about to hand
    /// `elements` elements to such a step, to be counted as a reduction of them would be. The
    /// default is `false`: the op reduces.
    fn sums_in_step(&self, replica: usize, elements: usize) -> bool {
        let _ = (replica, elements);
        false
    }

    /// Elastic jobs, after the membership changed (every worker calls it, once the new
    /// generation's collectives connect, before the next step): brings the state the ops keep
    /// from step to step (compression's, by variable) to the new membership. A step abandoned
    /// by the change is undone, state kept alike on every worker comes from worker `source`
    /// (the member whose parameters the others take), and state each worker keeps for itself
    /// is pooled and re-split over the members. `vars` are the model's variables, on this
    /// worker, in the order every worker creates them. The default keeps nothing.
    fn carry_over(&self, vars: &[candle_core::Tensor], source: usize) -> Result<()> {
        let _ = (vars, source);
        Ok(())
    }

    /// A loss-scaled step ended (fp16's dynamic loss scaling; every worker's replica 0 calls it
    /// once per optimizer step, after the step, alike on every worker): `applied` false when
    /// the step was skipped for a gradient that was not finite, `factor` what the scale was
    /// multiplied by (1 when unchanged, 1/2 after a skip, 2 after growth). State the ops keep
    /// from step to step in the gradients' units undoes a skipped step and follows the scale
    /// (PowerSGD's error feedback). Nothing by default.
    fn loss_scale_step(&self, applied: bool, factor: f64) {
        let _ = (applied, factor);
    }

    /// Completes a reduction [`start`](CrossDeviceOps::start) began, given the same request.
    fn finish(&self, req: ReduceRequest<'_>, started: Started, out: &mut dyn FnMut(&[f32])) -> Result<()> {
        let _ = (req, out);
        match started {
            Started::Done => Ok(()),
            Started::AcrossWorkers(_) => Err(crate::Error::Scope(format!(
                "{} cannot finish a cross-worker reduction it did not start",
                self.name()
            ))),
        }
    }
}

//! Cross-device operations: how the replicas of one machine combine their values.
//!
//! A [`CrossDeviceOps`] is a *collective*: every replica thread of a step calls it with its own
//! contribution, and it returns when the result is available. Two CPU implementations share one
//! data path ([`CpuCrossDeviceOps`]):
//!
//! - [`CpuCrossDeviceOps::in_memory_all_reduce`]: each replica thread reduces its own chunk of
//!   every replica's buffer, reading the replicas' tensors in place (a reduce-scatter: `K`
//!   buffers read once, one result written, the least memory traffic a reduction can have),
//!   then every replica reads the reduced chunks in place (the all-gather) as it consumes them.
//! - [`CpuCrossDeviceOps::reduction_to_one_device`]: the destination replica reduces every
//!   chunk alone, as TensorFlow's `ReductionToOneDevice` does.
//!
//! Gradients are fused into buckets ([`plan_buckets`]) of at most
//! [`DEFAULT_BUCKET_BYTES`] so that one collective carries many small tensors.

mod bucket;
mod cpu;

pub use bucket::{plan_buckets, Bucket, DEFAULT_BUCKET_BYTES};
pub use cpu::CpuCrossDeviceOps;

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

/// A collective reduction across the replicas of one machine.
pub trait CrossDeviceOps: Send + Sync + std::fmt::Debug {
    /// A short name for logs and benchmarks.
    fn name(&self) -> &'static str;

    /// Collective: every replica of `group` calls this with the same `seq`, `op`, length and
    /// `dest`. The replica's contribution is the concatenation of the (flattened, f32,
    /// contiguous) `input` tensors, each element multiplied by `weight`; peers read it in place,
    /// so it is not copied. When the result reaches this replica (every replica for
    /// [`Destination::AllReplicas`]), `out` is called with consecutive pieces of it, in order;
    /// the pieces stay valid only during the call.
    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &self,
        group: &ReplicaGroup,
        replica: usize,
        seq: u64,
        op: ReduceOp,
        dest: Destination,
        input: &[Tensor],
        weight: f32,
        out: &mut dyn FnMut(&[f32]),
    ) -> Result<()>;

    /// `true` for device-resident implementations (NCCL, Strata's CUDA kernels) whose
    /// [`reduce`](CrossDeviceOps::reduce) writes the result into the `input` tensors themselves,
    /// on their device, and never calls `out`: the caller then reads the result from its
    /// inputs (where it receives one). The host implementations return `false`.
    fn reduces_in_place(&self) -> bool {
        false
    }
}

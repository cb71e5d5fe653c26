//! Layers whose computation spans the replicas of a step: [`SyncBatchNorm`]; and, re-exported
//! from [`embedding_layer`](crate::embedding_layer), the [`Embedding`] table.
//!
//! A layer's forward pass has no [`ReplicaContext`](crate::ReplicaContext) at hand (candle's
//! `Module` takes a tensor), so these layers find the replica they run on through
//! [`ReplicaHandle::current`], which every replica thread of a step sets.

use candle_core::{CpuStorage, DType, Device, Layout, Shape, Tensor, Var};
use candle_nn::{BatchNormConfig, Init, ModuleT, VarBuilder};

use crate::context::ReplicaHandle;
pub use crate::embedding_layer::Embedding;

/// The sum over every replica (and worker) of a step, as a differentiable op: every replica
/// gets the sum; in backward, replica `r`'s gradient is `sum over r' of w_r' g_r'`, divided by
/// `w_r`, where `w` are the replicas' shares of the batch and `g` the gradients each computed.
/// Since the reduction of the parameters' gradients weighs replica `r`'s by `w_r`, that is what
/// the gradient of the global batch's loss needs.
struct CrossReplicaSum {
    handle: ReplicaHandle,
    tag: &'static str,
    weight: f32,
}

impl candle_core::CustomOp1 for CrossReplicaSum {
    fn name(&self) -> &'static str {
        "strata-cross-replica-sum"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let data: Vec<f32> = match (storage, layout.contiguous_offsets()) {
            (CpuStorage::F32(v), Some((lo, hi))) => v[lo..hi].to_vec(),
            _ => candle_core::bail!("a cross-replica sum takes a contiguous f32 CPU tensor"),
        };
        let sum = self.handle.all_reduce_sum(self.tag, data).map_err(candle_core::Error::wrap)?;
        Ok((CpuStorage::F32(sum), layout.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let mine = grad.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let w = self.weight;
        let weighted: Vec<f32> = mine.iter().map(|g| g * w).collect();
        let sum = self.handle.all_reduce_sum(self.tag, weighted).map_err(candle_core::Error::wrap)?;
        let back: Vec<f32> = sum.iter().map(|s| s / w).collect();
        Ok(Some(Tensor::from_vec(back, grad.shape(), grad.device())?.to_dtype(grad.dtype())?))
    }
}

/// `t` (f32, any device) summed over every replica and worker of the current step,
/// differentiably; `t` itself outside a step.
fn cross_replica_sum(t: &Tensor, tag: &'static str, weight: f32) -> candle_core::Result<Tensor> {
    let Some(handle) = ReplicaHandle::current() else { return Ok(t.clone()) };
    if handle.is_single() {
        return Ok(t.clone());
    }
    let on_cpu = t.to_device(&Device::Cpu)?.contiguous()?;
    on_cpu.apply_op1(CrossReplicaSum { handle, tag, weight })?.to_device(t.device())
}

/// Batch normalisation whose statistics are those of the global batch: the mean and variance
/// over every replica's (and worker's) examples, all-reduced in the forward pass and their
/// gradients in the backward pass (PyTorch's `SyncBatchNorm`, Keras'
/// `BatchNormalization(synchronized=True)`). Training under any strategy then computes what
/// one device's BatchNorm computes on the global batch, and every replica's running statistics
/// stay equal. Its variables have candle-nn's `batch_norm`'s names (`weight`, `bias`,
/// `running_mean`, `running_var`), so checkpoints of either load into the other; the running
/// statistics are [state](crate::VariableKind::State).
///
/// It assumes what `run_batch` arranges: each replica's loss is the mean over its shard, and
/// its gradient is weighted by the shard's share of the global batch. Outside a step (or on
/// one replica) it is candle-nn's BatchNorm.
#[derive(Clone, Debug)]
pub struct SyncBatchNorm {
    running_mean: Var,
    running_var: Var,
    weight_and_bias: Option<(Tensor, Tensor)>,
    eps: f64,
    momentum: f64,
}

/// A [`SyncBatchNorm`] of `num_features` channels (the second axis), as
/// `candle_nn::batch_norm` makes a `BatchNorm`.
pub fn sync_batch_norm<C: Into<BatchNormConfig>>(
    num_features: usize,
    config: C,
    vb: VarBuilder,
) -> candle_core::Result<SyncBatchNorm> {
    let config = config.into();
    if config.eps < 0.0 || !(0.0..=1.0).contains(&config.momentum) {
        candle_core::bail!(
            "sync batch-norm with eps {} and momentum {}: eps must not be negative and momentum must be in [0, 1]",
            config.eps,
            config.momentum
        );
    }
    let running_mean = vb.get_with_hints(num_features, "running_mean", Init::Const(0.0))?;
    let running_var = vb.get_with_hints(num_features, "running_var", Init::Const(1.0))?;
    let weight_and_bias = if config.affine {
        let weight = vb.get_with_hints(num_features, "weight", Init::Const(1.0))?;
        let bias = vb.get_with_hints(num_features, "bias", Init::Const(0.0))?;
        Some((weight, bias))
    } else {
        None
    };
    Ok(SyncBatchNorm {
        running_mean: Var::from_tensor(&running_mean)?,
        running_var: Var::from_tensor(&running_var)?,
        weight_and_bias,
        eps: config.eps,
        momentum: config.momentum,
    })
}

impl SyncBatchNorm {
    /// The running mean (this replica's copy; equal on every replica).
    pub fn running_mean(&self) -> &Tensor {
        self.running_mean.as_tensor()
    }

    /// The running variance (unbiased, as candle-nn's).
    pub fn running_var(&self) -> &Tensor {
        self.running_var.as_tensor()
    }

    fn forward_train(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let channels = self.running_mean.dim(0)?;
        if x.rank() < 2 || x.dim(1)? != channels {
            candle_core::bail!("sync batch-norm of {channels} channels got an input of shape {:?}", x.shape());
        }
        let dtype = x.dtype();
        let xt = x.to_dtype(DType::F32)?.transpose(0, 1)?;
        let dims = xt.dims().to_vec();
        let xt = xt.flatten_from(1)?.contiguous()?;
        let local = xt.dim(1)?;
        // The global count first (not differentiated), then the sums.
        let counts = match ReplicaHandle::current() {
            Some(h) if !h.is_single() => {
                h.all_reduce_sum("sync_batch_norm(count)", vec![local as f32]).map_err(candle_core::Error::wrap)?[0]
            }
            _ => local as f32,
        };
        let count = counts as f64;
        let weight = (local as f64 / count) as f32;
        let sum = cross_replica_sum(&xt.sum_keepdim(1)?, "sync_batch_norm(sum)", weight)?;
        let mean = (sum / count)?;
        let centered = xt.broadcast_sub(&mean)?;
        let sq = cross_replica_sum(&centered.sqr()?.sum_keepdim(1)?, "sync_batch_norm(sum of squares)", weight)?;
        let var = (sq / count)?;
        let m = self.momentum;
        let rm = ((self.running_mean.as_tensor() * (1.0 - m))? + (mean.detach().flatten_all()? * m)?)?;
        self.running_mean.set(&rm)?;
        let unbiased = if count > 1.0 { m * count / (count - 1.0) } else { m };
        let rv = ((self.running_var.as_tensor() * (1.0 - m))? + (var.detach().flatten_all()? * unbiased)?)?;
        self.running_var.set(&rv)?;
        let y = centered.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        let y = match &self.weight_and_bias {
            None => y,
            Some((w, b)) => y.broadcast_mul(&w.reshape(((), 1))?)?.broadcast_add(&b.reshape(((), 1))?)?,
        };
        y.reshape(dims)?.transpose(0, 1)?.to_dtype(dtype)
    }

    fn forward_eval(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let shape: Vec<usize> = x.dims().iter().enumerate().map(|(i, d)| if i == 1 { *d } else { 1 }).collect();
        let mean = self.running_mean.as_detached_tensor().reshape(shape.as_slice())?;
        let var = self.running_var.as_detached_tensor().reshape(shape.as_slice())?;
        let y = x.broadcast_sub(&mean)?.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        match &self.weight_and_bias {
            None => Ok(y),
            Some((w, b)) => {
                y.broadcast_mul(&w.reshape(shape.as_slice())?)?.broadcast_add(&b.reshape(shape.as_slice())?)
            }
        }
    }
}

impl ModuleT for SyncBatchNorm {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        if train {
            self.forward_train(x)
        } else {
            self.forward_eval(x)
        }
    }
}

//! Cross-device ops for replicas that compute with candle's CUDA backend (feature
//! `candle-cuda`): [`GpuCrossDeviceOps`] implements strata-core's
//! [`CrossDeviceOps`] for GPU replicas, with the implementation the selection rule
//! ([`crate::select`]) picks: NCCL between whole physical GPUs when it loads, Strata's CUDA
//! kernels otherwise (and always on virtual GPUs).
//!
//! One collective, for a bucket of gradient tensors:
//!
//! 1. every replica concatenates its (flattened, f32) tensors into one buffer on its GPU and
//!    multiplies it by its weight; the replicas exchange handles to these buffers;
//! 2. the *leader* (replica 0 for an all-reduce, the destination for a reduce) combines them:
//!    - **NCCL**: a copy of each buffer, owned by Strata, is all-reduced in place with one
//!      grouped call over the process's communicators ([`NcclComms::all_local`]);
//!    - **kernels**: the buffers are copied to the leader's GPU (device to device), reduced
//!      there by `strata_reduce_f32` ([`Kernels::reduce`]) in replica order (so every run gives
//!      the same bits), and, for an all-reduce, the result is copied to every replica's GPU
//!      (TensorFlow's reduction to one device followed by a hierarchical copy);
//! 3. after a rendezvous, every replica that receives the result writes it into its own input
//!    tensors (candle's in-place `slice_set`): [`CrossDeviceOps::reduces_in_place`] is `true`,
//!    so the strategy reads the reduced gradients from the tensors it passed.
//!
//! The leader's failure (NCCL, a kernel, a copy) poisons the replica group, so every replica
//! returns the error instead of waiting.
//!
//! Across worker processes ([`GpuCrossDeviceOps::across_processes`], MultiWorkerMirrored with
//! one GPU per worker): the communicator is one rank of a job-wide NCCL communicator
//! ([`NcclComms::join`]), so step 2's grouped call all-reduces across every worker's GPU at
//! once; the job's failure signal is checked while it waits, as the ring checks it.
//!
//! This module builds only with candle's CUDA backend, whose kernels candle compiles with
//! `nvcc` at build time: `scripts/check-candle-cuda` type-checks it outside CI, and it has not
//! run on a GPU.

use std::sync::{Mutex, PoisonError};

#[cfg(feature = "nccl")]
use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Device, Storage, Tensor};
use cudarc::driver::CudaSlice;
use strata_core::cross_device::{CrossDeviceOps, Destination, ReduceRequest};
use strata_core::device::LogicalDevice;
use strata_core::group::OpKey;
use strata_core::ReduceOp;

use crate::kernels::launch::Kernels;
#[cfg(feature = "nccl")]
use crate::nccl::{nccl_available, NcclComms};
use crate::select::{select_cross_device_ops, CrossDeviceChoice, CrossDeviceImpl, Selection};
use crate::{Error, Result};

/// The job's failure signal, as [`NcclComms::join`] takes it.
#[cfg(feature = "nccl")]
pub type AbortCheck = std::sync::Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// GPU cross-device ops over candle CUDA tensors (see the [module docs](self)).
pub struct GpuCrossDeviceOps {
    selection: Selection,
    devices: Vec<LogicalDevice>,
    #[cfg(feature = "nccl")]
    nccl: Option<Mutex<NcclComms>>,
    /// The job's failure signal (`Some(reason)` once the job failed elsewhere), checked while
    /// a multi-process NCCL all-reduce is waited for.
    #[cfg(feature = "nccl")]
    abort: Option<AbortCheck>,
    /// The leader's results, one per replica, alternating by collective number.
    results: [Mutex<std::result::Result<Vec<Option<Tensor>>, String>>; 2],
}

impl std::fmt::Debug for GpuCrossDeviceOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuCrossDeviceOps")
            .field("implementation", &self.selection.implementation)
            .field("devices", &self.devices.iter().map(|d| d.spec.to_string()).collect::<Vec<_>>())
            .finish()
    }
}

impl GpuCrossDeviceOps {
    /// Ops for `replicas` (logical GPUs, one per replica, in replica order). `machine_gpus` are
    /// the machine's logical GPUs (to see which physical GPUs are split), `choice` the user's
    /// request ([`CrossDeviceChoice::Auto`] applies TensorFlow's rule).
    pub fn new(replicas: &[LogicalDevice], machine_gpus: &[LogicalDevice], choice: CrossDeviceChoice) -> Result<Self> {
        #[cfg(not(feature = "nccl"))]
        let nccl_available = || false;
        let selection = select_cross_device_ops(replicas, machine_gpus, nccl_available(), choice)?;
        if selection.implementation == CrossDeviceImpl::Cpu {
            return Err(Error::CrossDeviceChoice {
                choice: "GPU cross-device ops",
                reason: format!("{}; use strata-core's CpuCrossDeviceOps", selection.reason),
            });
        }
        #[cfg(feature = "nccl")]
        let nccl = match selection.implementation {
            CrossDeviceImpl::Nccl => {
                let ordinals: Vec<usize> = replicas.iter().map(|d| d.physical.index as usize).collect();
                Some(Mutex::new(NcclComms::all_local(&ordinals)?))
            }
            _ => None,
        };
        // The optimizer then updates GPU variables with Strata's fused kernels too.
        crate::candle_optim::register();
        tracing::info!(implementation = %selection.implementation, reason = %selection.reason, "GPU cross-device ops");
        Ok(Self {
            selection,
            devices: replicas.to_vec(),
            #[cfg(feature = "nccl")]
            nccl,
            #[cfg(feature = "nccl")]
            abort: None,
            results: [Mutex::new(Ok(vec![])), Mutex::new(Ok(vec![]))],
        })
    }

    /// Ops for a worker process with one GPU replica (`replica`) that holds one rank of a
    /// job-wide communicator (`comms`, from [`NcclComms::join`]): every all-reduce is one NCCL
    /// all-reduce across the workers' GPUs, waited for with the communicator's timeout and
    /// `abort` (the job's failure signal).
    #[cfg(feature = "nccl")]
    pub fn across_processes(replica: LogicalDevice, comms: NcclComms, abort: AbortCheck) -> Result<Self> {
        if comms.ranks().len() != 1 || comms.ordinals() != [replica.physical.index as usize] {
            return Err(Error::CrossDeviceChoice {
                choice: "nccl across processes",
                reason: format!(
                    "the communicator holds ranks {:?} on GPUs {:?}, but the worker's replica is {}; join one rank on the replica's GPU",
                    comms.ranks(),
                    comms.ordinals(),
                    replica.spec
                ),
            });
        }
        crate::candle_optim::register();
        let selection = Selection {
            implementation: CrossDeviceImpl::Nccl,
            reason: format!("one rank per worker process of a {}-rank NCCL communicator", comms.world_size()),
        };
        tracing::info!(world = comms.world_size(), ranks = ?comms.ranks(), "GPU cross-device ops across processes: nccl");
        Ok(Self {
            selection,
            devices: vec![replica],
            nccl: Some(Mutex::new(comms)),
            abort: Some(abort),
            results: [Mutex::new(Ok(vec![])), Mutex::new(Ok(vec![]))],
        })
    }

    /// What was chosen, and why.
    pub fn selection(&self) -> &Selection {
        &self.selection
    }

    /// The leader's part: every replica's result (those that receive one).
    fn combine(&self, op: ReduceOp, dest: Destination, flats: &[Tensor], leader: usize) -> Result<Vec<Option<Tensor>>> {
        let n = flats.len();
        #[cfg(feature = "nccl")]
        if let Some(comms) = &self.nccl {
            let mut bufs = flats.iter().map(owned_copy).collect::<Result<Vec<_>>>()?;
            let mut comms = comms.lock().unwrap_or_else(PoisonError::into_inner);
            match &self.abort {
                Some(abort) => {
                    comms.all_reduce_in_place_async(&mut bufs, op)?;
                    let streams: Vec<_> = bufs.iter().map(|b| b.stream().clone()).collect();
                    comms.synchronize(&streams, &|| abort())?;
                }
                None => comms.all_reduce_in_place(&mut bufs, op)?,
            }
            drop(comms);
            return bufs
                .into_iter()
                .zip(flats)
                .enumerate()
                .map(|(r, (buf, flat))| if dest.receives(r) { wrap(buf, flat.device()).map(Some) } else { Ok(None) })
                .collect();
        }
        let home = flats[leader].device().clone();
        let on_leader = flats.iter().map(|t| t.to_device(&home)).collect::<candle_core::Result<Vec<Tensor>>>()?;
        let reduced = reduce_with_kernels(op, &on_leader, &home)?;
        (0..n)
            .map(|r| {
                if !dest.receives(r) {
                    Ok(None)
                } else if r == leader {
                    Ok(Some(reduced.clone()))
                } else {
                    Ok(Some(reduced.to_device(flats[r].device())?))
                }
            })
            .collect()
    }
}

/// A copy of a contiguous f32 CUDA tensor's elements, owned by Strata, on the tensor's stream.
#[cfg(feature = "nccl")]
fn owned_copy(t: &Tensor) -> Result<CudaSlice<f32>> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(not_cuda(t));
    };
    let Some((lo, hi)) = layout.contiguous_offsets() else {
        return Err(invalid(format!("a non-contiguous tensor of shape {:?}", t.dims())));
    };
    let slice = cs.as_cuda_slice::<f32>()?;
    let stream = cs.device().cuda_stream();
    stream.clone_dtod(&slice.slice(lo..hi)).map_err(Error::driver("cuMemcpyDtoDAsync"))
}

/// A 1-D tensor owning `buf`, on `device` (the device `buf` lives on).
fn wrap(buf: CudaSlice<f32>, device: &Device) -> Result<Tensor> {
    let Device::Cuda(dev) = device else {
        return Err(invalid(format!("a result for a replica on {device:?}, which is not a CUDA device")));
    };
    let len = buf.len();
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(buf, dev.clone()));
    Ok(Tensor::from_storage(storage, len, BackpropOp::none(), false))
}

/// `op` over `srcs` (1-D f32 tensors of one length, all on `home`) with Strata's kernel.
fn reduce_with_kernels(op: ReduceOp, srcs: &[Tensor], home: &Device) -> Result<Tensor> {
    let Device::Cuda(dev) = home else {
        return Err(invalid(format!("reduction to {home:?}, which is not a CUDA device")));
    };
    let stream = dev.cuda_stream();
    let kernels = Kernels::get(stream.context())?;
    let len = srcs.first().map_or(0, Tensor::elem_count);
    let mut out: CudaSlice<f32> = stream.alloc_zeros(len).map_err(Error::driver("cuMemAllocAsync"))?;
    {
        let guards: Vec<_> = srcs.iter().map(Tensor::storage_and_layout).collect();
        let mut views = Vec::with_capacity(srcs.len());
        for ((storage, layout), t) in guards.iter().zip(srcs) {
            let Storage::Cuda(cs) = &**storage else {
                return Err(not_cuda(t));
            };
            let Some((lo, hi)) = layout.contiguous_offsets() else {
                return Err(invalid(format!("a non-contiguous tensor of shape {:?}", t.dims())));
            };
            views.push(cs.as_cuda_slice::<f32>()?.slice(lo..hi));
        }
        let refs: Vec<&_> = views.iter().collect();
        kernels.reduce(&stream, op, &refs, &mut out)?;
    }
    wrap(out, home)
}

fn invalid(detail: String) -> Error {
    Error::InvalidLaunch { kernel: "GPU cross-device reduction", detail }
}

fn not_cuda(t: &Tensor) -> Error {
    invalid(format!("a tensor on {:?}: GPU cross-device ops take CUDA tensors only", t.device()))
}

impl CrossDeviceOps for GpuCrossDeviceOps {
    fn name(&self) -> &'static str {
        match self.selection.implementation {
            CrossDeviceImpl::Nccl => "nccl",
            _ => "cuda-kernels",
        }
    }

    fn reduce(&self, req: ReduceRequest<'_>, _out: &mut dyn FnMut(&[f32])) -> strata_core::Result<()> {
        let ReduceRequest { group, replica, seq, op, dest, input, weight } = req;
        let leader = match dest {
            Destination::AllReplicas => 0,
            Destination::Replica(d) => d,
        };
        // 1. this replica's contribution, one buffer on its GPU
        let flat = (|| -> candle_core::Result<Tensor> {
            if let Some(t) = input.iter().find(|t| t.dtype() != DType::F32 || !t.is_contiguous()) {
                candle_core::bail!(
                    "GPU reductions write their result into contiguous f32 tensors; got {:?} of shape {:?}",
                    t.dtype(),
                    t.dims()
                )
            }
            let parts = input.iter().map(Tensor::flatten_all).collect::<candle_core::Result<Vec<_>>>()?;
            let flat = Tensor::cat(&parts, 0)?;
            if weight == 1.0 {
                Ok(flat)
            } else {
                flat.affine(f64::from(weight), 0.0)
            }
        })();
        let flat = match flat {
            Ok(f) => f,
            Err(e) => {
                group.poison(format!("replica {replica} could not prepare its input to a GPU reduction: {e}"));
                return Err(e.into());
            }
        };
        let len = flat.elem_count();
        let key = OpKey {
            seq,
            op: match dest {
                Destination::AllReplicas => format!("all_reduce({op}) on GPUs"),
                Destination::Replica(d) => format!("reduce({op}) to replica {d} on GPUs"),
            },
            shape: vec![len],
        };
        let flats = group.exchange(replica, &key, flat)?;
        // 2. the leader combines
        let slot = &self.results[(seq % 2) as usize];
        if replica == leader {
            let combined = self.combine(op, dest, &flats, leader).map_err(|e| e.to_string());
            if let Err(e) = &combined {
                group.poison(format!("replica {replica} (the leader) failed the GPU reduction {}: {e}", key.op));
            }
            *slot.lock().unwrap_or_else(PoisonError::into_inner) = combined;
        }
        drop(flats);
        group.arrive(replica, &OpKey { op: format!("{} (combined)", key.op), ..key.clone() })?;
        group.release(replica, seq);
        // 3. the receivers write the result into their own inputs
        let mine = match &*slot.lock().unwrap_or_else(PoisonError::into_inner) {
            Ok(results) => results.get(replica).cloned().flatten(),
            Err(e) => return Err(strata_core::Error::Cluster(format!("GPU reduction {}: {e}", key.op))),
        };
        if let Some(result) = mine {
            let mut offset = 0usize;
            for t in input {
                let n = t.elem_count();
                let piece = result.narrow(0, offset, n)?;
                t.flatten_all()?.slice_set(&piece, 0, 0)?;
                offset += n;
            }
        }
        Ok(())
    }

    fn reduces_in_place(&self) -> bool {
        true
    }
}

//! strata-core's fused optimizers on GPUs (feature `candle-cuda`): [`CudaFusedUpdates`]
//! implements [`DeviceFusedUpdates`] with Strata's kernels (`strata_sgd_f32`,
//! `strata_sgd_momentum_f32`, `strata_adamw_f32`, one pass per variable), so `FusedSgd`,
//! `FusedMomentum` (heavy ball) and `FusedAdamW` update CUDA
//! variables in place, as they do CPU ones, instead of through candle-nn's dozen whole-tensor
//! operations. This is what CentralStorage applies once per step on its parameter GPU, and
//! Mirrored on every replica's. [`register`] installs it (a GPU strategy built with
//! [`GpuCrossDeviceOps`](crate::candle_ops::GpuCrossDeviceOps) does).
//!
//! The kernels compute the same f32 operations in the same order as the CPU optimizers, without
//! FMA contraction (their CPU references are checked bitwise against `FusedSgd` and
//! `FusedAdamW`). AdamW writes four buffers, and candle lends one tensor's storage mutably per
//! in-place op, so the step nests three of them: `m`, then `v`, then the variable with its
//! gradient; the innermost launches the kernel on the variable's stream.
//!
//! Type-checked by `scripts/check-candle-cuda`; it has not run on a GPU.

use std::cell::RefCell;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, DType, Device, InplaceOp1, InplaceOp2, Layout, Tensor, Var};
use candle_nn::ParamsAdamW;
use cudarc::driver::CudaViewMut;
use strata_core::optim::{register_device_fused_updates, DeviceFusedUpdates, ParamsMomentum};

use crate::kernels::launch::Kernels;
use crate::kernels::AdamWScalars;

/// Strata's CUDA kernels as strata-core's fused updates for CUDA variables of f32.
#[derive(Debug, Default)]
pub struct CudaFusedUpdates;

static UPDATES: CudaFusedUpdates = CudaFusedUpdates;

/// Registers [`CudaFusedUpdates`] with strata-core (once per process; later calls do nothing).
pub fn register() {
    register_device_fused_updates(&UPDATES);
}

fn served(t: &Tensor) -> bool {
    matches!(t.device(), Device::Cuda(_)) && t.dtype() == DType::F32 && t.is_contiguous()
}

fn candle_err(e: crate::Error) -> candle_core::Error {
    candle_core::Error::Cuda(Box::new(e))
}

fn range(l: &Layout, what: &str) -> candle_core::Result<(usize, usize)> {
    l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg(format!("fused update: {what} is not contiguous")))
}

impl DeviceFusedUpdates for CudaFusedUpdates {
    fn sgd(&self, var: &Var, g: &Tensor, lr: f64) -> Option<candle_core::Result<()>> {
        if !(served(var) && served(g)) {
            return None;
        }
        Some(var.inplace_op2(g, &Sgd { lr: lr as f32 }))
    }

    fn adamw(
        &self,
        var: &Var,
        g: &Tensor,
        m: &Var,
        v: &Var,
        p: &ParamsAdamW,
        step_t: usize,
    ) -> Option<candle_core::Result<()>> {
        if ![var.as_tensor(), g, m.as_tensor(), v.as_tensor()].into_iter().all(served) {
            return None;
        }
        let s = AdamWScalars::new(p.lr, p.beta1, p.beta2, p.eps, p.weight_decay, step_t);
        Some(m.inplace_op1(&WithM { var, g, v, s }))
    }

    /// The heavy ball with `strata_sgd_momentum_f32`; Nesterov has no kernel and takes
    /// candle's formulation.
    fn momentum(&self, var: &Var, g: &Tensor, velocity: &Var, p: &ParamsMomentum) -> Option<candle_core::Result<()>> {
        if p.nesterov || ![var.as_tensor(), g, velocity.as_tensor()].into_iter().all(served) {
            return None;
        }
        Some(velocity.inplace_op1(&WithVelocity { var, g, lr: p.lr as f32, momentum: p.momentum as f32 }))
    }
}

/// The outer op of a momentum step: holds the velocity mutably, then the variable.
struct WithVelocity<'a> {
    var: &'a Var,
    g: &'a Tensor,
    lr: f32,
    momentum: f32,
}

impl InplaceOp1 for WithVelocity<'_> {
    fn name(&self) -> &'static str {
        "strata-cuda-momentum"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("strata-cuda's fused momentum runs on CUDA variables only")
    }

    fn cuda_fwd(&self, v: &mut CudaStorage, lv: &Layout) -> candle_core::Result<()> {
        let (lo, hi) = range(lv, "the velocity")?;
        let mut v = v.as_cuda_slice_mut::<f32>()?.slice_mut(lo..hi);
        let v = RefCell::new(Some(&mut v));
        self.var.inplace_op2(self.g, &MomentumParam { v: &v, lr: self.lr, momentum: self.momentum })
    }
}

/// The inner op of a momentum step: the variable and its gradient; launches
/// `strata_sgd_momentum_f32`.
struct MomentumParam<'a, 'v, 'vb> {
    v: &'a Slot<'v, 'vb>,
    lr: f32,
    momentum: f32,
}

impl InplaceOp2 for MomentumParam<'_, '_, '_> {
    fn name(&self) -> &'static str {
        "strata-cuda-momentum"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("strata-cuda's fused momentum runs on CUDA variables only")
    }

    fn cuda_fwd(&self, p: &mut CudaStorage, lp: &Layout, g: &CudaStorage, lg: &Layout) -> candle_core::Result<()> {
        let ((plo, phi), (glo, ghi)) = (range(lp, "the variable")?, range(lg, "the gradient")?);
        let Some(v) = self.v.borrow_mut().take() else {
            candle_core::bail!("strata-cuda's fused momentum: the velocity was already used")
        };
        let stream = p.device().cuda_stream();
        let kernels = Kernels::get(stream.context()).map_err(candle_err)?;
        let g = g.as_cuda_slice::<f32>()?.slice(glo..ghi);
        let mut p = p.as_cuda_slice_mut::<f32>()?.slice_mut(plo..phi);
        kernels.sgd_momentum(&stream, self.lr, self.momentum, &mut p, &g, v).map_err(candle_err)
    }
}

/// `var -= lr * g` with `strata_sgd_f32`.
struct Sgd {
    lr: f32,
}

impl InplaceOp2 for Sgd {
    fn name(&self) -> &'static str {
        "strata-cuda-sgd"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("strata-cuda's fused SGD runs on CUDA variables only")
    }

    fn cuda_fwd(&self, p: &mut CudaStorage, lp: &Layout, g: &CudaStorage, lg: &Layout) -> candle_core::Result<()> {
        let ((plo, phi), (glo, ghi)) = (range(lp, "the variable")?, range(lg, "the gradient")?);
        let stream = p.device().cuda_stream();
        let kernels = Kernels::get(stream.context()).map_err(candle_err)?;
        let g = g.as_cuda_slice::<f32>()?.slice(glo..ghi);
        let mut p = p.as_cuda_slice_mut::<f32>()?.slice_mut(plo..phi);
        kernels.sgd(&stream, self.lr, &mut p, &g).map_err(candle_err)
    }
}

/// The outer op of an AdamW step: holds `m` mutably, then `v`.
struct WithM<'a> {
    var: &'a Var,
    g: &'a Tensor,
    v: &'a Var,
    s: AdamWScalars,
}

impl InplaceOp1 for WithM<'_> {
    fn name(&self) -> &'static str {
        "strata-cuda-adamw"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("strata-cuda's fused AdamW runs on CUDA variables only")
    }

    fn cuda_fwd(&self, m: &mut CudaStorage, lm: &Layout) -> candle_core::Result<()> {
        let (lo, hi) = range(lm, "the first moment")?;
        let mut m = m.as_cuda_slice_mut::<f32>()?.slice_mut(lo..hi);
        let m = RefCell::new(Some(&mut m));
        self.v.inplace_op1(&WithV { var: self.var, g: self.g, m: &m, s: self.s })
    }
}

/// A moment's buffer, lent mutably from an outer op to the inner one.
type Slot<'x, 'y> = RefCell<Option<&'x mut CudaViewMut<'y, f32>>>;

/// The middle op: holds `v` mutably, then the variable.
struct WithV<'a, 'm, 'mb> {
    var: &'a Var,
    g: &'a Tensor,
    m: &'a Slot<'m, 'mb>,
    s: AdamWScalars,
}

impl InplaceOp1 for WithV<'_, '_, '_> {
    fn name(&self) -> &'static str {
        "strata-cuda-adamw"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("strata-cuda's fused AdamW runs on CUDA variables only")
    }

    fn cuda_fwd(&self, v: &mut CudaStorage, lv: &Layout) -> candle_core::Result<()> {
        let (lo, hi) = range(lv, "the second moment")?;
        let mut v = v.as_cuda_slice_mut::<f32>()?.slice_mut(lo..hi);
        let v = RefCell::new(Some(&mut v));
        self.var.inplace_op2(self.g, &WithParam { m: self.m, v: &v, s: self.s })
    }
}

/// The inner op: the variable and its gradient; launches `strata_adamw_f32`.
struct WithParam<'a, 'm, 'mb, 'v, 'vb> {
    m: &'a Slot<'m, 'mb>,
    v: &'a Slot<'v, 'vb>,
    s: AdamWScalars,
}

impl InplaceOp2 for WithParam<'_, '_, '_, '_, '_> {
    fn name(&self) -> &'static str {
        "strata-cuda-adamw"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("strata-cuda's fused AdamW runs on CUDA variables only")
    }

    fn cuda_fwd(&self, p: &mut CudaStorage, lp: &Layout, g: &CudaStorage, lg: &Layout) -> candle_core::Result<()> {
        let ((plo, phi), (glo, ghi)) = (range(lp, "the variable")?, range(lg, "the gradient")?);
        let (Some(m), Some(v)) = (self.m.borrow_mut().take(), self.v.borrow_mut().take()) else {
            candle_core::bail!("strata-cuda's fused AdamW: the moments were already used")
        };
        let stream = p.device().cuda_stream();
        let kernels = Kernels::get(stream.context()).map_err(candle_err)?;
        let g = g.as_cuda_slice::<f32>()?.slice(glo..ghi);
        let mut p = p.as_cuda_slice_mut::<f32>()?.slice_mut(plo..phi);
        kernels.adamw(&stream, &self.s, &mut p, &g, m, v).map_err(candle_err)
    }
}

//! Fused optimizers: candle-nn's `AdamW` and `SGD`, computed in place in one pass per tensor,
//! SGD with momentum ([`FusedMomentum`]) and Adagrad ([`FusedAdagrad`]), which candle-nn lacks.
//!
//! candle-nn's optimizers build each update from a dozen whole-tensor operations, every one
//! allocating a new tensor and making a pass over memory; on a model of a few million
//! parameters that is a large part of a step. [`FusedAdamW`] and [`FusedSgd`] implement the
//! same [`Optimizer`] trait with the same configuration types and compute the same f32
//! operations in the same order (so their results are bitwise identical, as the tests check),
//! but update the variables in place: AdamW makes one pass (parameter, gradient and both
//! moments together) instead of about fifteen, SGD one instead of three, and neither allocates.
//!
//! They run on CPU tensors of f32; on other devices they use the [`DeviceFusedUpdates`] a device
//! crate registered (strata-cuda's CUDA kernels on GPUs), and otherwise, like other dtypes, fall
//! back to candle-nn's formulation.
//!
//! The element-wise formulas themselves are in [`rules`], which the parameter server's
//! optimizers and the CUDA kernels' references share. Every optimizer here skips a variable
//! without a gradient in a step (no decay, no moment or velocity update), as candle-nn's do.
//!
//! What the distributed optimizer asks of an optimizer (its state per element; whether it can
//! step ZeRO's shards) is in [`shardable`]: [`OptimizerMemory`] and [`ShardableOptimizer`].

use candle_core::{CpuStorage, DType, Layout, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};

pub mod rules;
pub mod schedule;
pub mod shardable;
mod summed;

pub use shardable::{OptimizerMemory, ShardableOptimizer};
pub(crate) use summed::sum_of;

use rules::AdamWScalars;

fn slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((lo, hi))) => Ok(&v[lo..hi]),
        _ => candle_core::bail!("fused optimizer: {what} must be a contiguous f32 tensor"),
    }
}

fn slice_mut<'a>(s: &'a mut CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((lo, hi))) => Ok(&mut v[lo..hi]),
        _ => candle_core::bail!("fused optimizer: {what} must be a contiguous f32 tensor"),
    }
}

/// The destination and the gradient of an in-place update, checked to be the same length.
fn with_gradient<'a>(
    dst: &'a mut CpuStorage,
    dst_l: &Layout,
    what: &str,
    g: &'a CpuStorage,
    g_l: &Layout,
) -> candle_core::Result<(&'a mut [f32], &'a [f32])> {
    let d = slice_mut(dst, dst_l, what)?;
    let g = slice(g, g_l, "gradient")?;
    if d.len() != g.len() {
        candle_core::bail!("fused optimizer: {what} of {} elements, gradient of {}", d.len(), g.len());
    }
    Ok((d, g))
}

/// One AdamW step on a variable and its moments in one pass over memory: each element's
/// parameter, gradient and both moments read once and the parameter and moments written once
/// (28 bytes an element), where a pass per moment and one for the parameter moved 40
/// ([`rules::adamw`]: the same operations in the same order, so the same bits). candle lets an
/// in-place operation write one tensor, so the three are nested: the parameter's operation holds
/// its slice while the first moment's runs inside it, and that one holds both while the second
/// moment's runs the loop. The moments belong to the optimizer alone, so the nested locks wait
/// on nothing. The loop runs under pulp's run-time dispatch (AVX-512 or AVX2 where the CPU and
/// build have them): the update is memory-bound only if its square root and division are vector
/// instructions.
fn adamw_in_one_pass(var: &Var, g: &Tensor, m: &Var, v: &Var, s: &AdamWScalars) -> candle_core::Result<()> {
    var.inplace_op2(g, &OnParameter { m, v, s })
}

struct OnParameter<'a> {
    m: &'a Var,
    v: &'a Var,
    s: &'a AdamWScalars,
}

impl candle_core::InplaceOp2 for OnParameter<'_> {
    fn name(&self) -> &'static str {
        "strata-adamw"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dst_l: &Layout, g: &CpuStorage, g_l: &Layout) -> candle_core::Result<()> {
        let (theta, g) = with_gradient(dst, dst_l, "parameter", g, g_l)?;
        let s = self.s;
        let run = |theta: &mut [f32], m: &mut [f32], v: &mut [f32]| {
            pulp::Arch::new().dispatch(AdamWLoop { theta, m, v, g, s });
            Ok(())
        };
        self.m.inplace_op1(&OnFirstMoment { theta: std::cell::Cell::new(Some(theta)), v: self.v, run: &run })
    }
}

/// The innermost loop of an AdamW pass, over the parameter and both moments (of one length),
/// with the gradient it reads (one slice here; weighted terms in `summed.rs`).
type MomentsLoop<'a> = &'a dyn Fn(&mut [f32], &mut [f32], &mut [f32]) -> candle_core::Result<()>;

/// The first moment's operation inside the parameter's: holds both, runs the second moment's.
struct OnFirstMoment<'a> {
    theta: std::cell::Cell<Option<&'a mut [f32]>>,
    v: &'a Var,
    run: MomentsLoop<'a>,
}

impl candle_core::InplaceOp1 for OnFirstMoment<'_> {
    fn name(&self) -> &'static str {
        "strata-adamw-first-moment"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dst_l: &Layout) -> candle_core::Result<()> {
        let m = slice_mut(dst, dst_l, "first moment")?;
        let Some(theta) = self.theta.take() else { candle_core::bail!("fused optimizer: the AdamW step ran twice") };
        self.v.inplace_op1(&OnSecondMoment { rest: std::cell::Cell::new(Some((theta, m))), run: self.run })
    }
}

struct OnSecondMoment<'a, 'b> {
    rest: std::cell::Cell<Option<(&'a mut [f32], &'b mut [f32])>>,
    run: MomentsLoop<'a>,
}

impl candle_core::InplaceOp1 for OnSecondMoment<'_, '_> {
    fn name(&self) -> &'static str {
        "strata-adamw-second-moment"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dst_l: &Layout) -> candle_core::Result<()> {
        let v = slice_mut(dst, dst_l, "second moment")?;
        let Some((theta, m)) = self.rest.take() else {
            candle_core::bail!("fused optimizer: the AdamW step ran twice")
        };
        if theta.len() != m.len() || theta.len() != v.len() {
            candle_core::bail!("fused optimizer: parameter, moments and gradient differ in size");
        }
        (self.run)(theta, m, v)
    }
}

/// [`rules::adamw`] over the elements, compiled for the vector width pulp chooses.
struct AdamWLoop<'a> {
    theta: &'a mut [f32],
    m: &'a mut [f32],
    v: &'a mut [f32],
    g: &'a [f32],
    s: &'a AdamWScalars,
}

impl pulp::WithSimd for AdamWLoop<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let s = *self.s;
        for (((theta, m), v), g) in self.theta.iter_mut().zip(self.m.iter_mut()).zip(self.v.iter_mut()).zip(self.g) {
            rules::adamw(theta, m, v, *g, &s);
        }
    }
}

/// `theta = theta - (g * lr + 0)` ([`rules::sgd`]).
struct SgdParam {
    lr: f32,
}

impl candle_core::InplaceOp2 for SgdParam {
    fn name(&self) -> &'static str {
        "strata-sgd"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
    ) -> candle_core::Result<()> {
        let (t, g) = with_gradient(dst, dst_l, "parameter", src, src_l)?;
        let lr = self.lr;
        t.iter_mut().zip(g).for_each(|(t, g)| rules::sgd(t, *g, lr));
        Ok(())
    }
}

/// Fused updates for variables that are not on the CPU, registered by a device crate
/// (strata-cuda registers its CUDA kernels when a GPU strategy is built); without one, or where
/// it answers `None`, such variables take candle-nn's formulation. strata-core itself calls no
/// device library.
pub trait DeviceFusedUpdates: Send + Sync {
    /// `var -= lr * g` in place, or `None` where `var` is not on a device this serves.
    fn sgd(&self, var: &Var, g: &Tensor, lr: f64) -> Option<candle_core::Result<()>>;

    /// One AdamW step (`step_t` counts from 1) on `var` and its moments `m` and `v`, in place,
    /// with [`FusedAdamW`]'s results; or `None` where `var` is not on a device this serves.
    fn adamw(
        &self,
        var: &Var,
        g: &Tensor,
        m: &Var,
        v: &Var,
        params: &ParamsAdamW,
        step_t: usize,
    ) -> Option<candle_core::Result<()>>;

    /// One step of SGD with momentum ([`FusedMomentum`]'s results) on `var` and its
    /// `velocity`, in place; or `None` where `var` is not on a device this serves or the form
    /// (Nesterov, say) has no kernel. The default serves nothing.
    fn momentum(
        &self,
        var: &Var,
        g: &Tensor,
        velocity: &Var,
        params: &ParamsMomentum,
    ) -> Option<candle_core::Result<()>> {
        let _ = (var, g, velocity, params);
        None
    }
}

static DEVICE_UPDATES: std::sync::OnceLock<&'static dyn DeviceFusedUpdates> = std::sync::OnceLock::new();

/// Registers the fused updates of a device crate, once per process; `false` if some were
/// registered already (they stay).
pub fn register_device_fused_updates(updates: &'static dyn DeviceFusedUpdates) -> bool {
    DEVICE_UPDATES.set(updates).is_ok()
}

fn device_updates() -> Option<&'static dyn DeviceFusedUpdates> {
    DEVICE_UPDATES.get().copied()
}

fn fusable(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous()
}

#[derive(Debug)]
struct AdamWVar {
    var: Var,
    m: Var,
    v: Var,
}

/// AdamW, fused and in place; the same configuration and results as `candle_nn::AdamW`.
#[derive(Debug)]
pub struct FusedAdamW {
    vars: Vec<AdamWVar>,
    step_t: usize,
    params: ParamsAdamW,
}

impl Optimizer for FusedAdamW {
    type Config = ParamsAdamW;

    fn new(vars: Vec<Var>, params: ParamsAdamW) -> candle_core::Result<Self> {
        let vars = vars
            .into_iter()
            .filter(|v| v.dtype().is_float())
            .map(|var| {
                let m = Var::zeros(var.shape(), var.dtype(), var.device())?;
                let v = Var::zeros(var.shape(), var.dtype(), var.device())?;
                Ok(AdamWVar { var, m, v })
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(Self { vars, step_t: 0, params })
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr
    }

    fn step(&mut self, grads: &candle_core::backprop::GradStore) -> candle_core::Result<()> {
        self.step_t += 1;
        let p = &self.params;
        let (lr, beta1, beta2) = (p.lr, p.beta1, p.beta2);
        let lr_lambda = lr * p.weight_decay;
        let scale_m = 1f64 / (1f64 - beta1.powi(self.step_t as i32));
        let scale_v = 1f64 / (1f64 - beta2.powi(self.step_t as i32));
        let s = AdamWScalars::new(lr, beta1, beta2, p.eps, p.weight_decay, self.step_t);
        for AdamWVar { var, m, v } in &self.vars {
            let Some(g) = grads.get(var) else { continue };
            let g = if g.is_contiguous() { g.clone() } else { g.contiguous()? };
            if !(fusable(var) && fusable(&g)) {
                if let Some(done) = device_updates().and_then(|d| d.adamw(var, &g, m, v, p, self.step_t)) {
                    done?;
                    continue;
                }
                // candle-nn's formulation, for devices and dtypes the fused kernels do not cover.
                let next_m = ((m.as_tensor() * beta1)? + (&g * (1.0 - beta1))?)?;
                let next_v = ((v.as_tensor() * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
                let adjusted = ((&next_m * scale_m)? / ((&next_v * scale_v)?.sqrt()? + p.eps)?)?;
                let next = ((var.as_tensor() * (1f64 - lr_lambda))? - (adjusted * lr)?)?;
                m.set(&next_m)?;
                v.set(&next_v)?;
                var.set(&next)?;
                continue;
            }
            adamw_in_one_pass(var, &g, m, v, &s)?;
        }
        Ok(())
    }
}

/// SGD, in place; the same configuration (the learning rate) and results as `candle_nn::SGD`.
#[derive(Debug)]
pub struct FusedSgd {
    vars: Vec<Var>,
    lr: f64,
}

impl Optimizer for FusedSgd {
    type Config = f64;

    fn new(vars: Vec<Var>, lr: f64) -> candle_core::Result<Self> {
        Ok(Self { vars: vars.into_iter().filter(|v| v.dtype().is_float()).collect(), lr })
    }

    fn learning_rate(&self) -> f64 {
        self.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.lr = lr
    }

    fn step(&mut self, grads: &candle_core::backprop::GradStore) -> candle_core::Result<()> {
        for var in &self.vars {
            let Some(g) = grads.get(var) else { continue };
            let g = if g.is_contiguous() { g.clone() } else { g.contiguous()? };
            if fusable(var) && fusable(&g) {
                var.inplace_op2(&g, &SgdParam { lr: self.lr as f32 })?;
            } else if let Some(done) = device_updates().and_then(|d| d.sgd(var, &g, self.lr)) {
                done?;
            } else {
                var.set(&var.sub(&(g * self.lr)?)?)?;
            }
        }
        Ok(())
    }
}

/// The configuration of [`FusedMomentum`]: SGD with momentum in PyTorch's form (no dampening,
/// no weight decay), as the parameter server's `Momentum` and the CUDA kernel compute it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ParamsMomentum {
    /// The learning rate.
    pub lr: f64,
    /// The momentum, in `[0, 1)`.
    pub momentum: f64,
    /// Nesterov momentum ([`rules::nesterov`]) instead of the heavy ball ([`rules::momentum`]).
    pub nesterov: bool,
}

impl Default for ParamsMomentum {
    /// PyTorch's and Keras' usual choice: learning rate 0.01, momentum 0.9, heavy ball.
    fn default() -> Self {
        Self { lr: 0.01, momentum: 0.9, nesterov: false }
    }
}

/// `v = v * momentum + g` ([`rules::velocity`]).
struct Velocity {
    momentum: f32,
}

impl candle_core::InplaceOp2 for Velocity {
    fn name(&self) -> &'static str {
        "strata-velocity"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
    ) -> candle_core::Result<()> {
        let (v, g) = with_gradient(dst, dst_l, "velocity", src, src_l)?;
        let m = self.momentum;
        v.iter_mut().zip(g).for_each(|(v, g)| rules::velocity(v, *g, m));
        Ok(())
    }
}

/// The parameter from the updated velocity: [`rules::momentum_param`], or with the gradient
/// [`rules::nesterov_param`].
struct MomentumParam {
    lr: f32,
    momentum: f32,
}

impl candle_core::InplaceOp2 for MomentumParam {
    fn name(&self) -> &'static str {
        "strata-momentum-param"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
    ) -> candle_core::Result<()> {
        let (t, v) = with_gradient(dst, dst_l, "parameter", src, src_l)?;
        let lr = self.lr;
        t.iter_mut().zip(v).for_each(|(t, v)| rules::momentum_param(t, *v, lr));
        Ok(())
    }
}

impl candle_core::InplaceOp3 for MomentumParam {
    fn name(&self) -> &'static str {
        "strata-nesterov-param"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
        g: &CpuStorage,
        g_l: &Layout,
    ) -> candle_core::Result<()> {
        let (t, v) = with_gradient(dst, dst_l, "parameter", v, v_l)?;
        let g = slice(g, g_l, "gradient")?;
        if g.len() != t.len() {
            candle_core::bail!("fused optimizer: parameter of {} elements, gradient of {}", t.len(), g.len());
        }
        let (lr, m) = (self.lr, self.momentum);
        for ((t, v), g) in t.iter_mut().zip(v).zip(g) {
            rules::nesterov_param(t, *v, *g, lr, m);
        }
        Ok(())
    }
}

/// SGD with momentum (PyTorch's `SGD(momentum=..)`, Keras' at a constant learning rate), in
/// place: one velocity per variable, starting at zero, updated with [`rules::velocity`] and
/// the parameter with [`rules::momentum_param`] (or Nesterov's), the formulas the parameter
/// servers and the CUDA kernel apply. A variable without a gradient in a step is skipped:
/// neither its velocity nor its value changes (PyTorch skips parameters whose `grad` is
/// `None`). candle-nn has no momentum SGD; this is Strata's.
#[derive(Debug)]
pub struct FusedMomentum {
    vars: Vec<(Var, Var)>,
    params: ParamsMomentum,
}

impl Optimizer for FusedMomentum {
    type Config = ParamsMomentum;

    fn new(vars: Vec<Var>, params: ParamsMomentum) -> candle_core::Result<Self> {
        if !(0.0..1.0).contains(&params.momentum) || !params.lr.is_finite() {
            candle_core::bail!(
                "momentum SGD with learning rate {} and momentum {}: use a finite learning rate and a momentum in [0, 1)",
                params.lr,
                params.momentum
            );
        }
        let vars = vars
            .into_iter()
            .filter(|v| v.dtype().is_float())
            .map(|var| {
                let v = Var::zeros(var.shape(), var.dtype(), var.device())?;
                Ok((var, v))
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(Self { vars, params })
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr
    }

    fn step(&mut self, grads: &candle_core::backprop::GradStore) -> candle_core::Result<()> {
        let p = self.params;
        let (lr, m) = (p.lr as f32, p.momentum as f32);
        for (var, v) in &self.vars {
            let Some(g) = grads.get(var) else { continue };
            let g = if g.is_contiguous() { g.clone() } else { g.contiguous()? };
            if fusable(var) && fusable(&g) && fusable(v) {
                v.inplace_op2(&g, &Velocity { momentum: m })?;
                let param = MomentumParam { lr, momentum: m };
                if p.nesterov {
                    var.inplace_op3(v.as_tensor(), &g, &param)?;
                } else {
                    var.inplace_op2(v.as_tensor(), &param)?;
                }
            } else if let Some(done) = device_updates().and_then(|d| d.momentum(var, &g, v, &p)) {
                done?;
            } else {
                // candle's formulation, for devices and dtypes the fused kernels do not cover.
                let next_v = ((v.as_tensor() * p.momentum)? + &g)?;
                let step = if p.nesterov { (&g + (&next_v * p.momentum)?)? } else { next_v.clone() };
                var.set(&var.sub(&(step * p.lr)?)?)?;
                v.set(&next_v)?;
            }
        }
        Ok(())
    }
}

/// The configuration of [`FusedAdagrad`]: Keras' Adagrad, as the parameter servers' Adagrad and
/// the row optimizer of embedding tables step it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ParamsAdagrad {
    /// The learning rate.
    pub lr: f64,
    /// Every accumulator's starting value (Keras' `initial_accumulator_value`, 0.1).
    pub initial_accumulator: f64,
    /// Added to the accumulator's square root (Keras' `epsilon`, 1e-7).
    pub eps: f64,
}

impl Default for ParamsAdagrad {
    /// Keras' defaults: learning rate 0.001, accumulators from 0.1, epsilon 1e-7.
    fn default() -> Self {
        Self { lr: 0.001, initial_accumulator: 0.1, eps: 1e-7 }
    }
}

/// `acc = acc + g * g`, the first half of [`rules::adagrad`].
struct Accumulate;

impl candle_core::InplaceOp2 for Accumulate {
    fn name(&self) -> &'static str {
        "strata-adagrad-accumulate"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
    ) -> candle_core::Result<()> {
        let (acc, g) = with_gradient(dst, dst_l, "accumulator", src, src_l)?;
        acc.iter_mut().zip(g).for_each(|(a, g)| *a += g * g);
        Ok(())
    }
}

/// `theta = theta - lr * g / (sqrt(acc) + eps)` from the updated accumulator, the second half of
/// [`rules::adagrad`].
struct AdagradParam {
    lr: f32,
    eps: f32,
}

impl candle_core::InplaceOp3 for AdagradParam {
    fn name(&self) -> &'static str {
        "strata-adagrad-param"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        acc: &CpuStorage,
        acc_l: &Layout,
        g: &CpuStorage,
        g_l: &Layout,
    ) -> candle_core::Result<()> {
        let (t, acc) = with_gradient(dst, dst_l, "parameter", acc, acc_l)?;
        let g = slice(g, g_l, "gradient")?;
        if g.len() != t.len() {
            candle_core::bail!("fused optimizer: parameter of {} elements, gradient of {}", t.len(), g.len());
        }
        let (lr, eps) = (self.lr, self.eps);
        for ((t, a), g) in t.iter_mut().zip(acc).zip(g) {
            *t -= lr * g / (a.sqrt() + eps);
        }
        Ok(())
    }
}

/// Adagrad in Keras' form ([`rules::adagrad`]), in place: one accumulator per variable,
/// starting at `initial_accumulator`, the formulas the parameter servers apply to dense
/// variables and to embedding rows. A variable without a gradient in a step is skipped: its
/// accumulator and value stay. candle-nn has no Adagrad; this is Strata's.
#[derive(Debug)]
pub struct FusedAdagrad {
    vars: Vec<(Var, Var)>,
    params: ParamsAdagrad,
}

impl Optimizer for FusedAdagrad {
    type Config = ParamsAdagrad;

    fn new(vars: Vec<Var>, params: ParamsAdagrad) -> candle_core::Result<Self> {
        let ParamsAdagrad { lr, initial_accumulator, eps } = params;
        if !(lr.is_finite() && initial_accumulator.is_finite() && initial_accumulator >= 0.0 && eps.is_finite()) {
            candle_core::bail!(
                "adagrad with learning rate {lr}, initial accumulator {initial_accumulator} and epsilon {eps}: use finite values and an accumulator of 0 or more"
            );
        }
        let vars = vars
            .into_iter()
            .filter(|v| v.dtype().is_float())
            .map(|var| {
                let acc =
                    Var::from_tensor(&(Tensor::ones(var.shape(), var.dtype(), var.device())? * initial_accumulator)?)?;
                Ok((var, acc))
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(Self { vars, params })
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr
    }

    fn step(&mut self, grads: &candle_core::backprop::GradStore) -> candle_core::Result<()> {
        let p = self.params;
        for (var, acc) in &self.vars {
            let Some(g) = grads.get(var) else { continue };
            let g = if g.is_contiguous() { g.clone() } else { g.contiguous()? };
            if fusable(var) && fusable(&g) && fusable(acc) {
                acc.inplace_op2(&g, &Accumulate)?;
                var.inplace_op3(acc.as_tensor(), &g, &AdagradParam { lr: p.lr as f32, eps: p.eps as f32 })?;
            } else {
                // The same formula in tensor operations, for devices and dtypes the fused
                // kernels do not cover.
                let next_acc = (acc.as_tensor() + g.sqr()?)?;
                let step = ((&g * p.lr)? / (next_acc.sqrt()? + p.eps)?)?;
                var.set(&var.sub(&step)?)?;
                acc.set(&next_acc)?;
            }
        }
        Ok(())
    }
}

/// The state of a fused optimizer, checked against the variables it would be loaded into.
fn state_error(optimizer: &str, what: String) -> crate::Error {
    crate::Error::Checkpoint(format!("optimizer state for {optimizer}: {what}"))
}

/// Checks that `tensor` fits `var` (same shape and dtype) and moves it to `var`'s device.
fn state_for(optimizer: &str, key: &str, tensor: &Tensor, var: &Var) -> crate::Result<Tensor> {
    if tensor.dims() != var.dims() || tensor.dtype() != var.dtype() {
        return Err(state_error(
            optimizer,
            format!(
                "tensor {key:?} has shape {:?} and dtype {}, the variable has {:?} and {}; load state saved from the same model",
                tensor.dims(),
                tensor.dtype().as_str(),
                var.dims(),
                var.dtype().as_str()
            ),
        ));
    }
    Ok(tensor.to_device(var.device())?.contiguous()?)
}

/// `FusedAdamW` saves `t` (the step count, an i64 scalar) and, for the i-th floating-point
/// variable it was created with, `m.{i}` and `v.{i}` (the first and second moments).
impl crate::checkpoint::OptimizerState for FusedAdamW {
    fn state_tensors(&self) -> crate::Result<Vec<(String, Tensor)>> {
        let mut state = Vec::with_capacity(1 + 2 * self.vars.len());
        state.push(("t".to_string(), Tensor::new(self.step_t as i64, &candle_core::Device::Cpu)?));
        for (i, AdamWVar { m, v, .. }) in self.vars.iter().enumerate() {
            // copies: the moments are updated in place by later steps
            state.push((format!("m.{i}"), m.as_tensor().copy()?));
            state.push((format!("v.{i}"), v.as_tensor().copy()?));
        }
        Ok(state)
    }

    fn renew(&self, vars: Vec<Var>) -> Option<crate::Result<Self>> {
        Some(Self::new(vars, self.params.clone()).map_err(Into::into))
    }

    fn load_state_tensors(&mut self, state: &[(String, Tensor)]) -> crate::Result<()> {
        const NAME: &str = "FusedAdamW";
        let mut by_name = std::collections::HashMap::with_capacity(state.len());
        for (key, tensor) in state {
            if by_name.insert(key.as_str(), tensor).is_some() {
                return Err(state_error(NAME, format!("tensor {key:?} is given twice")));
            }
        }
        let n = self.vars.len();
        fn take<'a>(
            by_name: &mut std::collections::HashMap<&str, &'a Tensor>,
            key: &str,
            n: usize,
        ) -> crate::Result<&'a Tensor> {
            by_name.remove(key).ok_or_else(|| {
                state_error(
                    NAME,
                    format!("tensor {key:?} is missing (the optimizer has {n} variables); load state saved from the same model"),
                )
            })
        }
        let t = take(&mut by_name, "t", n)?;
        let step_t = match (t.rank(), t.dtype()) {
            (0, DType::I64 | DType::U32 | DType::U8) => t.to_dtype(DType::I64)?.to_scalar::<i64>()?,
            _ => {
                return Err(state_error(
                    NAME,
                    format!(
                        "tensor \"t\" must be an integer scalar, got shape {:?} and dtype {}",
                        t.dims(),
                        t.dtype().as_str()
                    ),
                ))
            }
        };
        let step_t = usize::try_from(step_t)
            .map_err(|_| state_error(NAME, format!("tensor \"t\" holds a negative step count {step_t}")))?;
        let mut moments = Vec::with_capacity(n);
        for (i, AdamWVar { var, .. }) in self.vars.iter().enumerate() {
            let (mk, vk) = (format!("m.{i}"), format!("v.{i}"));
            let m = state_for(NAME, &mk, take(&mut by_name, &mk, n)?, var)?;
            let v = state_for(NAME, &vk, take(&mut by_name, &vk, n)?, var)?;
            moments.push((m, v));
        }
        if let Some(extra) = by_name.keys().min() {
            return Err(state_error(
                NAME,
                format!(
                    "unknown tensor {extra:?} (the optimizer has {n} variables); load state saved from the same model"
                ),
            ));
        }
        // everything is checked: now change the optimizer
        for (AdamWVar { m, v, .. }, (next_m, next_v)) in self.vars.iter().zip(moments) {
            m.set(&next_m)?;
            v.set(&next_v)?;
        }
        self.step_t = step_t;
        Ok(())
    }
}

/// `FusedSgd` (plain SGD, no momentum) keeps no state: it saves nothing and loads nothing.
impl crate::checkpoint::OptimizerState for FusedSgd {
    fn state_tensors(&self) -> crate::Result<Vec<(String, Tensor)>> {
        Ok(Vec::new())
    }

    fn renew(&self, vars: Vec<Var>) -> Option<crate::Result<Self>> {
        Some(Self::new(vars, self.lr).map_err(Into::into))
    }

    fn load_state_tensors(&mut self, state: &[(String, Tensor)]) -> crate::Result<()> {
        match state.first() {
            None => Ok(()),
            Some((key, _)) => Err(state_error(
                "FusedSgd",
                format!("unknown tensor {key:?}; plain SGD keeps no state, load state saved from FusedSgd"),
            )),
        }
    }
}

/// Loads the state of an optimizer that keeps one tensor per variable (`vars`: each variable
/// and its state), saved as `{prefix}.{i}` for the i-th: every tensor checked (given once, none
/// missing, none unknown, each fitting its variable) before any is set.
fn load_one_state_per_variable(
    name: &str,
    prefix: &str,
    vars: &[(Var, Var)],
    state: &[(String, Tensor)],
) -> crate::Result<()> {
    let n = vars.len();
    let mut by_name = std::collections::HashMap::with_capacity(state.len());
    for (key, tensor) in state {
        if by_name.insert(key.as_str(), tensor).is_some() {
            return Err(state_error(name, format!("tensor {key:?} is given twice")));
        }
    }
    let mut next = Vec::with_capacity(n);
    for (i, (var, _)) in vars.iter().enumerate() {
        let key = format!("{prefix}.{i}");
        let t = by_name.remove(key.as_str()).ok_or_else(|| {
            state_error(
                name,
                format!(
                    "tensor {key:?} is missing (the optimizer has {n} variables); load state saved from the same model"
                ),
            )
        })?;
        next.push(state_for(name, &key, t, var)?);
    }
    if let Some(extra) = by_name.keys().min() {
        return Err(state_error(
            name,
            format!("unknown tensor {extra:?} (the optimizer has {n} variables); load state saved from the same model"),
        ));
    }
    for ((_, s), t) in vars.iter().zip(next) {
        s.set(&t)?;
    }
    Ok(())
}

/// `FusedMomentum` saves, for the i-th floating-point variable it was created with, `v.{i}`
/// (its velocity).
impl crate::checkpoint::OptimizerState for FusedMomentum {
    fn state_tensors(&self) -> crate::Result<Vec<(String, Tensor)>> {
        self.vars.iter().enumerate().map(|(i, (_, v))| Ok((format!("v.{i}"), v.as_tensor().copy()?))).collect()
    }

    fn renew(&self, vars: Vec<Var>) -> Option<crate::Result<Self>> {
        Some(Self::new(vars, self.params).map_err(Into::into))
    }

    fn load_state_tensors(&mut self, state: &[(String, Tensor)]) -> crate::Result<()> {
        load_one_state_per_variable("FusedMomentum", "v", &self.vars, state)
    }
}

/// `FusedAdagrad` saves, for the i-th floating-point variable it was created with, `acc.{i}`
/// (its accumulator).
impl crate::checkpoint::OptimizerState for FusedAdagrad {
    fn state_tensors(&self) -> crate::Result<Vec<(String, Tensor)>> {
        self.vars.iter().enumerate().map(|(i, (_, a))| Ok((format!("acc.{i}"), a.as_tensor().copy()?))).collect()
    }

    fn renew(&self, vars: Vec<Var>) -> Option<crate::Result<Self>> {
        Some(Self::new(vars, self.params).map_err(Into::into))
    }

    fn load_state_tensors(&mut self, state: &[(String, Tensor)]) -> crate::Result<()> {
        load_one_state_per_variable("FusedAdagrad", "acc", &self.vars, state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use candle_nn::{AdamW, SGD};
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|i| if i % 17 == 0 { 0.0 } else { r.random::<f32>() * 2.0 - 1.0 }).collect()
    }

    /// Runs `steps` steps of `O` on a (5, 7) and a (3,) variable with fixed random gradients.
    fn run<O: Optimizer>(cfg: O::Config, steps: usize) -> Vec<Vec<f32>> {
        let dev = Device::Cpu;
        let a = Var::from_vec(random(35, 1), (5, 7), &dev).unwrap();
        let b = Var::from_vec(random(3, 2), 3, &dev).unwrap();
        let mut opt = O::new(vec![a.clone(), b.clone()], cfg).unwrap();
        for s in 0..steps {
            let mut grads = candle_core::backprop::GradStore::default();
            grads.insert(a.as_tensor(), Tensor::from_vec(random(35, 10 + s as u64), (5, 7), &dev).unwrap());
            // a transposed (non-contiguous) gradient for b's (3,) is not possible; use a strided one
            let wide = Tensor::from_vec(random(6, 100 + s as u64), (3, 2), &dev).unwrap();
            grads.insert(b.as_tensor(), wide.narrow(1, 1, 1).unwrap().squeeze(1).unwrap());
            opt.step(&grads).unwrap();
        }
        [a, b].iter().map(|v| v.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect()
    }

    #[test]
    fn fused_adamw_is_bitwise_candle_nn_adamw() {
        for cfg in [ParamsAdamW::default(), ParamsAdamW { lr: 0.05, weight_decay: 0.1, ..Default::default() }] {
            let want = run::<AdamW>(cfg.clone(), 25);
            let got = run::<FusedAdamW>(cfg, 25);
            assert_eq!(want, got);
        }
    }

    /// The one-pass AdamW step is the scalar rule bit for bit, at this CPU's vector width and at
    /// pulp's scalar level, on sizes around the vector widths (1, 7, 8, 15, 16, 17, 31, 33) and
    /// larger, the step count and decay varied.
    #[test]
    fn adamw_in_one_pass_is_the_rule_at_every_width_and_size() {
        let dev = Device::Cpu;
        for (k, n) in [1usize, 7, 8, 15, 16, 17, 31, 33, 1000, 4099].into_iter().enumerate() {
            let s = AdamWScalars::new(0.01, 0.9, 0.999, 1e-8, 0.05 * k as f64, 1 + k);
            let (theta, m, v, g) = (random(n, 1 + k as u64), random(n, 2), random(n, 3), random(n, 4));
            let v: Vec<f32> = v.into_iter().map(f32::abs).collect();
            let mut want = (theta.clone(), m.clone(), v.clone());
            for (((t, m), v), g) in want.0.iter_mut().zip(want.1.iter_mut()).zip(want.2.iter_mut()).zip(&g) {
                rules::adamw(t, m, v, *g, &s);
            }
            let (mut t1, mut m1, mut v1) = (theta.clone(), m.clone(), v.clone());
            pulp::WithSimd::with_simd(
                AdamWLoop { theta: &mut t1, m: &mut m1, v: &mut v1, g: &g, s: &s },
                pulp::Scalar::new(),
            );
            assert_eq!((t1, m1, v1), want, "{n} elements, scalar level");
            let (var, mv, vv) = (
                Var::from_vec(theta, n, &dev).unwrap(),
                Var::from_vec(m, n, &dev).unwrap(),
                Var::from_vec(v, n, &dev).unwrap(),
            );
            adamw_in_one_pass(&var, &Tensor::from_vec(g, n, &dev).unwrap(), &mv, &vv, &s).unwrap();
            let got = [&var, &mv, &vv].map(|x| x.as_tensor().to_vec1::<f32>().unwrap());
            assert_eq!((got[0].clone(), got[1].clone(), got[2].clone()), want, "{n} elements, dispatched");
        }
    }

    #[test]
    fn fused_sgd_is_bitwise_candle_nn_sgd() {
        assert_eq!(run::<SGD>(0.3, 25), run::<FusedSgd>(0.3, 25));
    }

    /// The fused momentum optimizer applies the element-wise rules (and so the parameter
    /// servers' and the CUDA kernel's updates) bit for bit, its fallback agrees to rounding,
    /// and a variable without a gradient keeps its value and velocity.
    #[test]
    fn fused_momentum_applies_the_rules() {
        for nesterov in [false, true] {
            let p = ParamsMomentum { lr: 0.05, momentum: 0.9, nesterov };
            let got = run::<FusedMomentum>(p, 7);
            let (mut a, mut va) = (random(35, 1), vec![0f32; 35]);
            for s in 0..7 {
                let g = random(35, 10 + s as u64);
                for ((w, v), g) in a.iter_mut().zip(va.iter_mut()).zip(g) {
                    if nesterov {
                        rules::nesterov(w, v, g, 0.05, 0.9);
                    } else {
                        rules::momentum(w, v, g, 0.05, 0.9);
                    }
                }
            }
            assert_eq!(got[0], a, "nesterov {nesterov}");
        }
        // A step without a gradient for `b` leaves it and its velocity alone.
        let dev = Device::Cpu;
        let a = Var::from_vec(vec![1.0f32, 2.0], 2, &dev).unwrap();
        let b = Var::from_vec(vec![3.0f32], 1, &dev).unwrap();
        let mut opt =
            FusedMomentum::new(vec![a.clone(), b.clone()], ParamsMomentum { lr: 0.5, momentum: 0.5, nesterov: false })
                .unwrap();
        let mut grads = candle_core::backprop::GradStore::default();
        grads.insert(a.as_tensor(), Tensor::new(&[2.0f32, -2.0], &dev).unwrap());
        grads.insert(b.as_tensor(), Tensor::new(&[4.0f32], &dev).unwrap());
        opt.step(&grads).unwrap(); // v_b = 4, b = 3 - 2 = 1
        let mut only_a = candle_core::backprop::GradStore::default();
        only_a.insert(a.as_tensor(), Tensor::new(&[2.0f32, -2.0], &dev).unwrap());
        opt.step(&only_a).unwrap();
        assert_eq!(b.to_vec1::<f32>().unwrap(), vec![1.0]);
        let state = crate::checkpoint::OptimizerState::state_tensors(&opt).unwrap();
        assert_eq!(state[1].1.to_vec1::<f32>().unwrap(), vec![4.0], "b's velocity is untouched");
        // v_a = 2 then 2 * 0.5 + 2 = 3: a = 1 - 1 - 1.5
        assert_eq!(a.to_vec1::<f32>().unwrap()[0], -1.5);
        assert!(FusedMomentum::new(vec![a], ParamsMomentum { momentum: 1.0, ..Default::default() }).is_err());
    }

    /// The fused Adagrad applies Keras' rule ([`rules::adagrad`], the parameter servers') bit
    /// for bit, its tensor fallback agrees to rounding, a variable without a gradient keeps its
    /// value and accumulator, and its state round-trips.
    #[test]
    fn fused_adagrad_applies_keras_rule() {
        let p = ParamsAdagrad { lr: 0.05, initial_accumulator: 0.1, eps: 1e-7 };
        let got = run::<FusedAdagrad>(p, 7);
        let (mut a, mut acc) = (random(35, 1), vec![0.1f32; 35]);
        for s in 0..7 {
            for ((w, c), g) in a.iter_mut().zip(acc.iter_mut()).zip(random(35, 10 + s as u64)) {
                rules::adagrad(w, c, g, 0.05, 1e-7);
            }
        }
        assert_eq!(got[0], a);
        let dev = Device::Cpu;
        let x = Var::from_vec(vec![1.0f32, 2.0], 2, &dev).unwrap();
        let y = Var::from_vec(vec![3.0f32], 1, &dev).unwrap();
        let q = ParamsAdagrad { lr: 0.5, initial_accumulator: 0.0, eps: 0.0 };
        let mut opt = FusedAdagrad::new(vec![x.clone(), y.clone()], q).unwrap();
        let mut grads = candle_core::backprop::GradStore::default();
        grads.insert(x.as_tensor(), Tensor::new(&[2.0f32, -4.0], &dev).unwrap());
        opt.step(&grads).unwrap(); // acc = 4, 16: x = 1 - 0.5 * 2 / 2, 2 + 0.5 * 4 / 4
        assert_eq!(x.to_vec1::<f32>().unwrap(), vec![0.5, 2.5]);
        assert_eq!(y.to_vec1::<f32>().unwrap(), vec![3.0], "no gradient, no step");
        let state = crate::checkpoint::OptimizerState::state_tensors(&opt).unwrap();
        assert_eq!(state[0].1.to_vec1::<f32>().unwrap(), vec![4.0, 16.0]);
        assert_eq!(state[1].1.to_vec1::<f32>().unwrap(), vec![0.0], "y's accumulator is untouched");
        let mut again = FusedAdagrad::new(vec![x.clone(), y.clone()], q).unwrap();
        crate::checkpoint::OptimizerState::load_state_tensors(&mut again, &state).unwrap();
        assert_eq!(
            crate::checkpoint::OptimizerState::state_tensors(&again).unwrap()[0].1.to_vec1::<f32>().unwrap(),
            vec![4.0, 16.0]
        );
        let bad = ParamsAdagrad { initial_accumulator: -1.0, ..q };
        assert!(FusedAdagrad::new(vec![x], bad).is_err());
    }

    #[test]
    fn fused_adamw_skips_variables_without_a_gradient() {
        let dev = Device::Cpu;
        let a = Var::from_vec(vec![1.0f32, 2.0], 2, &dev).unwrap();
        let b = Var::from_vec(vec![3.0f32], 1, &dev).unwrap();
        let cfg = ParamsAdamW { lr: 0.1, weight_decay: 0.5, ..Default::default() };
        let mut opt = FusedAdamW::new(vec![a.clone(), b.clone()], cfg).unwrap();
        let mut grads = candle_core::backprop::GradStore::default();
        grads.insert(a.as_tensor(), Tensor::new(&[2.0f32, -2.0], &dev).unwrap());
        opt.step(&grads).unwrap();
        assert_eq!(b.to_vec1::<f32>().unwrap(), vec![3.0], "no decay without a gradient");
        let state = crate::checkpoint::OptimizerState::state_tensors(&opt).unwrap();
        assert!(state.iter().filter(|(k, _)| k.ends_with(".1")).all(|(_, t)| t.to_vec1::<f32>().unwrap() == vec![0.0]));
    }

    #[test]
    fn updates_are_in_place() {
        let dev = Device::Cpu;
        let a = Var::from_vec(vec![1.0f32, 2.0], 2, &dev).unwrap();
        let model_view = a.as_tensor().clone();
        let mut opt = FusedSgd::new(vec![a.clone()], 0.5).unwrap();
        let mut grads = candle_core::backprop::GradStore::default();
        grads.insert(a.as_tensor(), Tensor::new(&[2.0f32, -2.0], &dev).unwrap());
        opt.step(&grads).unwrap();
        assert_eq!(model_view.to_vec1::<f32>().unwrap(), vec![0.0, 3.0]);
    }
}

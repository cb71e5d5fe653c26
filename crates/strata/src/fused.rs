//! Fused CPU kernels, with their backward passes, for the element-wise work of a transformer
//! step: GELU, the causal softmax of attention and layer norm; and (module `conv`) a
//! convolutional network's convolution and pooling: [`conv2d`], [`max_pool2d`],
//! [`relu_max_pool2d`].
//!
//! Written with candle's basic operations, each of these is a chain of element-wise passes,
//! every pass allocating a tensor, and their backward passes are chains again (candle's GELU
//! gradient alone is a dozen passes with two `powf` and a `tanh`); they took more of a
//! transformer step on a CPU than its matrix products. Here each is one pass forward and one
//! backward, as [`candle_core::CustomOp1`]/[`candle_core::CustomOp2`]/[`candle_core::CustomOp3`]
//! with `bwd`, so autograd (`loss.backward()`) goes through them.
//!
//! The kernels compute what the composed operations compute, in the same order per element
//! (the reference tests in this module compare them, forward and backward, within 1e-5). They
//! run on f32 CPU tensors; on any other device or dtype the functions fall back to the composed
//! operations, so a model written with them runs everywhere.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D};

mod conv;
pub use conv::{conv2d, max_pool2d, relu_max_pool2d};

/// Whether the fused kernels apply to `x`: an f32 tensor on the CPU.
fn fusable(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32
}

/// The elements of a contiguous f32 CPU tensor.
fn f32s<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [f32]> {
    let data = s.as_slice::<f32>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("{op} needs a contiguous tensor"),
    }
}

fn same_shape(a: &Layout, b: &Layout, op: &str) -> Result<()> {
    if a.shape() != b.shape() {
        candle_core::bail!("{op}: shapes {:?} and {:?} differ", a.shape(), b.shape());
    }
    Ok(())
}

const SQRT_TWO_OVER_PI: f32 = 0.797_884_6;
const GELU_A: f32 = 0.044_715;

/// `tanh(x)` as a rational function of `x` (Eigen's `ptanh_float`: degree 13 over 6, the input
/// clamped to +-7.9, where f32's tanh is +-1), within a few ulp of libm's `tanhf` and about ten
/// times faster: pure arithmetic, so the loops over a tensor vectorize. libm's `tanhf` was a
/// quarter of a transformer step here.
#[inline]
fn tanh(x: f32) -> f32 {
    let x = x.clamp(-7.905_311, 7.905_311);
    if x.abs() < 0.0004 {
        return x;
    }
    let x2 = x * x;
    let p = x2 * -2.760_768_5e-16 + 2.000_188e-13;
    let p = x2 * p + -8.604_672e-11;
    let p = x2 * p + 5.122_297e-8;
    let p = x2 * p + 1.485_722_4e-5;
    let p = x2 * p + 6.372_619_3e-4;
    let p = x2 * p + 4.893_524_6e-3;
    let q = x2 * 1.198_258_4e-6 + 1.185_347_1e-4;
    let q = x2 * q + 2.268_434_6e-3;
    let q = x2 * q + 4.893_525e-3;
    x * p / q
}

/// GELU, tanh approximation, as candle's `gelu` computes it.
#[inline]
fn gelu1(v: f32) -> f32 {
    0.5 * v * (1.0 + tanh(SQRT_TWO_OVER_PI * v * (1.0 + GELU_A * v * v)))
}

/// The derivative of [`gelu1`].
#[inline]
fn gelu1_grad(v: f32) -> f32 {
    let t = tanh(SQRT_TWO_OVER_PI * v * (1.0 + GELU_A * v * v));
    0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * SQRT_TWO_OVER_PI * (1.0 + 3.0 * GELU_A * v * v)
}

struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "strata-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32s(s, l, self.name())?;
        Ok((CpuStorage::F32(x.iter().map(|&v| gelu1(v)).collect()), l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(arg.apply_op2_no_bwd(&grad.contiguous()?, &GeluGrad)?))
    }
}

/// `(x, g) -> g * gelu'(x)`.
struct GeluGrad;

impl CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "strata-gelu-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        same_shape(l1, l2, self.name())?;
        let (x, g) = (f32s(s1, l1, self.name())?, f32s(s2, l2, self.name())?);
        Ok((CpuStorage::F32(x.iter().zip(g).map(|(&v, &g)| g * gelu1_grad(v)).collect()), l1.shape().clone()))
    }
}

/// GELU (tanh approximation) of `x`, one pass forward and one backward on f32 CPU tensors;
/// candle's `gelu` elsewhere.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if fusable(x) {
        x.contiguous()?.apply_op1(Gelu)
    } else {
        x.gelu()
    }
}

/// Softmax over the last axis of `(..., t, t)` scores, row `i` of each `t x t` square over
/// columns `0..=i` only (the others 0): attention's causal mask and softmax in one pass.
struct CausalSoftmax;

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "strata-causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32s(s, l, self.name())?;
        let t = square_side(l.shape(), self.name())?;
        let mut out = vec![0f32; x.len()];
        for (r, (xr, yr)) in x.chunks_exact(t).zip(out.chunks_exact_mut(t)).enumerate() {
            let n = r % t + 1;
            let (xr, yr) = (&xr[..n], &mut yr[..n]);
            let max = xr.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for (y, &v) in yr.iter_mut().zip(xr) {
                *y = (v - max).exp();
                sum += *y;
            }
            for y in yr.iter_mut() {
                *y /= sum;
            }
        }
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(res.apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxGrad)?))
    }
}

/// The side `t` of the last two axes, which must be equal.
fn square_side(shape: &Shape, op: &str) -> Result<usize> {
    let dims = shape.dims();
    match dims {
        [.., a, b] if a == b && *a > 0 => Ok(*a),
        _ => candle_core::bail!("{op} needs (..., t, t) scores, not {shape:?}"),
    }
}

/// `(y, g) -> y * (g - sum(g * y))` per row of the last axis: the gradient of a softmax whose
/// output is `y` (masked entries, where `y` is 0, get 0).
struct SoftmaxGrad;

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "strata-softmax-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        same_shape(l1, l2, self.name())?;
        let (y, g) = (f32s(s1, l1, self.name())?, f32s(s2, l2, self.name())?);
        let t = l1.shape().dims().last().copied().unwrap_or(1).max(1);
        let mut out = vec![0f32; y.len()];
        for ((yr, gr), dr) in y.chunks_exact(t).zip(g.chunks_exact(t)).zip(out.chunks_exact_mut(t)) {
            let dot: f32 = yr.iter().zip(gr).map(|(a, b)| a * b).sum();
            for ((d, &y), &g) in dr.iter_mut().zip(yr).zip(gr) {
                *d = y * (g - dot);
            }
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// Attention's causal softmax: `scores` `(..., t, t)`, row `i` of each square normalised over
/// columns `0..=i` and 0 beyond. One pass each way on f32 CPU tensors; elsewhere the composed
/// operations (adding a `-inf` mask above the diagonal, then softmax).
pub fn causal_softmax(scores: &Tensor) -> Result<Tensor> {
    if fusable(scores) {
        square_side(scores.shape(), "causal_softmax")?;
        return scores.contiguous()?.apply_op1(CausalSoftmax);
    }
    let t = square_side(scores.shape(), "causal_softmax")?;
    let mask: Vec<f32> =
        (0..t).flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 })).collect();
    let mask = Tensor::from_vec(mask, (t, t), scores.device())?.to_dtype(scores.dtype())?;
    softmax_composed(&scores.broadcast_add(&mask)?)
}

/// Softmax over the last axis from candle's basic operations (they all have a backward pass).
pub fn softmax_composed(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// Layer norm over the last axis: `(x - mean) / sqrt(var + eps) * weight + bias`.
struct LayerNormOp {
    eps: f32,
}

/// Rows of `x` of `d` elements: their mean and `1 / sqrt(var + eps)`.
fn row_stats(row: &[f32], eps: f32) -> (f32, f32) {
    let d = row.len() as f32;
    let mean = row.iter().sum::<f32>() / d;
    let var = row.iter().map(|&v| (v - mean) * (v - mean)).sum::<f32>() / d;
    (mean, 1.0 / (var + eps).sqrt())
}

fn vector_of(l: &Layout, d: usize, what: &str) -> Result<()> {
    if l.shape().dims() != [d] {
        candle_core::bail!("layer_norm: a {what} of shape {:?} for rows of {d}", l.shape());
    }
    Ok(())
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "strata-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32s(s1, l1, self.name())?;
        let d = l1.shape().dims().last().copied().unwrap_or(1).max(1);
        vector_of(l2, d, "weight")?;
        vector_of(l3, d, "bias")?;
        let (w, b) = (f32s(s2, l2, self.name())?, f32s(s3, l3, self.name())?);
        let mut out = vec![0f32; x.len()];
        for (xr, yr) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            let (mean, rstd) = row_stats(xr, self.eps);
            for (((y, &v), &w), &b) in yr.iter_mut().zip(xr).zip(w).zip(b) {
                *y = (v - mean) * rstd * w + b;
            }
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = w.elem_count();
        let rows = x.elem_count() / d.max(1);
        let packed = x.apply_op3_no_bwd(w, &grad.contiguous()?, &LayerNormGrad { eps: self.eps })?;
        let dx = packed.narrow(0, 0, rows)?.reshape(x.shape())?;
        Ok((Some(dx), Some(packed.get(rows)?), Some(packed.get(rows + 1)?)))
    }
}

/// `(x, weight, g)` -> `(rows + 2, d)`: the rows of `dx`, then `dweight`, then `dbias`.
struct LayerNormGrad {
    eps: f32,
}

impl CustomOp3 for LayerNormGrad {
    fn name(&self) -> &'static str {
        "strata-layer-norm-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        same_shape(l1, l3, self.name())?;
        let (x, w, g) = (f32s(s1, l1, self.name())?, f32s(s2, l2, self.name())?, f32s(s3, l3, self.name())?);
        let d = w.len().max(1);
        let rows = x.len() / d;
        let mut out = vec![0f32; (rows + 2) * d];
        let (dx, dwb) = out.split_at_mut(rows * d);
        let (dw, db) = dwb.split_at_mut(d);
        let mut xhat = vec![0f32; d];
        for ((xr, gr), dxr) in x.chunks_exact(d).zip(g.chunks_exact(d)).zip(dx.chunks_exact_mut(d)) {
            let (mean, rstd) = row_stats(xr, self.eps);
            let (mut mean_gw, mut mean_gw_xhat) = (0f32, 0f32);
            for (((h, &v), &g), &w) in xhat.iter_mut().zip(xr).zip(gr).zip(w) {
                *h = (v - mean) * rstd;
                mean_gw += g * w;
                mean_gw_xhat += g * w * *h;
            }
            mean_gw /= d as f32;
            mean_gw_xhat /= d as f32;
            for (j, dxj) in dxr.iter_mut().enumerate() {
                let (g, h) = (gr[j], xhat[j]);
                *dxj = rstd * (g * w[j] - mean_gw - h * mean_gw_xhat);
                dw[j] += g * h;
                db[j] += g;
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((rows + 2, d))))
    }
}

/// Layer norm over the last axis of `x` with a learned `weight` and `bias` (both of the last
/// axis' size): one pass each way on f32 CPU tensors; candle-nn's `layer_norm_slow` (composed
/// operations) elsewhere.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    if fusable(x) && fusable(weight) && fusable(bias) {
        x.contiguous()?.apply_op3(&weight.contiguous()?, &bias.contiguous()?, LayerNormOp { eps: eps as f32 })
    } else {
        candle_nn::ops::layer_norm_slow(x, weight, bias, eps as f32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn close(a: &Tensor, b: &Tensor, tol: f32) {
        let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max) / scale;
        assert!(worst <= tol, "worst relative difference {worst}");
    }

    /// The fused op and its composed reference on the same input: outputs and the gradients of
    /// `sum(out * r)` (a random `r`, so each output gets its own weight) agree.
    fn check(
        shape: &[usize],
        fused: impl Fn(&Tensor) -> Result<Tensor>,
        reference: impl Fn(&Tensor) -> Result<Tensor>,
    ) {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&(Tensor::randn(0f32, 2.0, shape, &dev).unwrap())).unwrap();
        let r = Tensor::randn(0f32, 1.0, shape, &dev).unwrap();
        let (a, b) = (fused(x.as_tensor()).unwrap(), reference(x.as_tensor()).unwrap());
        close(&a, &b, 1e-5);
        let ga = (a * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (b * &r).unwrap().sum_all().unwrap().backward().unwrap();
        close(ga.get(x.as_tensor()).unwrap(), gb.get(x.as_tensor()).unwrap(), 1e-5);
    }

    #[test]
    fn the_rational_tanh_is_libms_within_a_few_ulp() {
        let mut worst = 0f32;
        for i in -200_000..=200_000 {
            let x = i as f32 * 1e-4; // -20 to 20
            let (a, b) = (tanh(x), x.tanh());
            worst = worst.max((a - b).abs() / b.abs().max(f32::MIN_POSITIVE));
        }
        assert!(worst < 1e-6, "worst relative error {worst}");
    }

    #[test]
    fn gelu_matches_candle_forward_and_backward() {
        check(&[7, 33], gelu, |x| x.gelu());
        // A non-contiguous input is made contiguous first.
        check(&[6, 6], |x| gelu(&x.t()?), |x| x.t()?.gelu());
    }

    #[test]
    fn causal_softmax_matches_the_masked_softmax_forward_and_backward() {
        let composed = |x: &Tensor| {
            let t = x.dim(D::Minus1)?;
            let m: Vec<f32> =
                (0..t).flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 })).collect();
            softmax_composed(&x.broadcast_add(&Tensor::from_vec(m, (t, t), x.device())?)?)
        };
        check(&[2, 3, 9, 9], causal_softmax, composed);
        let y = causal_softmax(&Tensor::randn(0f32, 1.0, (4, 4), &Device::Cpu).unwrap()).unwrap();
        let y = y.to_vec2::<f32>().unwrap();
        assert_eq!(y[0], [1.0, 0.0, 0.0, 0.0]);
        for row in &y {
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        }
        assert!(causal_softmax(&Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap()).is_err());
    }

    #[test]
    fn layer_norm_matches_candle_nn_forward_and_backward() {
        let dev = Device::Cpu;
        let d = 24;
        let w = Var::from_tensor(&Tensor::randn(1f32, 0.5, d, &dev).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::randn(0f32, 0.5, d, &dev).unwrap()).unwrap();
        check(
            &[5, 3, d],
            |x| layer_norm(x, w.as_tensor(), b.as_tensor(), 1e-5),
            |x| candle_nn::ops::layer_norm_slow(x, w.as_tensor(), b.as_tensor(), 1e-5),
        );
        // The weight's and the bias' gradients.
        let x = Tensor::randn(0f32, 3.0, (11, d), &dev).unwrap();
        let r = Tensor::randn(0f32, 1.0, (11, d), &dev).unwrap();
        let fused = layer_norm(&x, w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
        let composed = candle_nn::ops::layer_norm_slow(&x, w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
        let ga = (fused * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (composed * &r).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&w, &b] {
            close(ga.get(v.as_tensor()).unwrap(), gb.get(v.as_tensor()).unwrap(), 1e-5);
        }
    }
}

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
//! The kernels compute what the composed operations compute (the reference tests in this module
//! compare them, forward and backward, within 1e-5); sums over a row are taken in 16 lanes, and
//! `exp` and `tanh` are polynomials within a few ulp of libm's, so that every loop vectorizes.
//! Each kernel runs under pulp's run-time dispatch ([`pulp::Arch::dispatch`]), compiled for the widest vector instructions the CPU has
//! (AVX-512 or AVX2, chosen at run time), with the same result on every CPU: the operations and
//! their order are the source's, whatever the vector width. They run on f32 CPU tensors; on any
//! other device or dtype the functions fall back to the composed operations, so a model written
//! with them runs everywhere.

use std::borrow::Cow;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D};
use half::slice::HalfFloatSliceExt;
use half::vec::HalfFloatVecExt;

mod attention;
mod conv;
mod gelu;
mod loss;
mod vector;
pub use attention::{causal_attention, causal_attention_packed};
pub use conv::{conv2d, max_pool2d, relu_max_pool2d};
pub use loss::cross_entropy;
use vector::{load, simd_vectors, VectorKernel};

/// A loop nest that [`simd`] compiles for the CPU's vector width.
pub(crate) trait Kernel {
    /// The loops; every implementation is `#[inline(always)]`, so that it is compiled inside
    /// pulp's `#[target_feature]` function.
    fn run(self);
}

struct Dispatch<K>(K);

impl<K: Kernel> pulp::WithSimd for Dispatch<K> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        self.0.run()
    }
}

/// Runs `k` compiled for the widest vector instructions this CPU has: pulp's run-time dispatch
/// (AVX-512 with the `avx512` feature, else AVX2/FMA, else the baseline). Only what is inlined
/// into [`Kernel::run`] is compiled so, hence the `#[inline(always)]` helpers below. Rust allows
/// no floating-point contraction or reassociation, so the result is the same on every CPU.
pub(crate) fn simd(k: impl Kernel) {
    pulp::Arch::new().dispatch(Dispatch(k))
}

/// Elements a kernel computes into a stack block before appending them to its output, where
/// its loop also writes elsewhere (a bias gradient's sums): appended from such an iterator with
/// `Vec::extend`, the rows did not vectorize. A plain `map` over slices is appended with
/// `Vec::extend` (it vectorizes): the output written once, with no zeroing pass over it first
/// (safe Rust cannot fill a `Vec`'s spare capacity in place) and no block to copy.
const BLOCK: usize = 256;

/// Appends `f(x)` for each element of `x` to `out`.
#[inline(always)]
fn append1(out: &mut Vec<f32>, x: &[f32], f: impl Fn(f32) -> f32) {
    out.extend(x.iter().map(|&x| f(x)));
}

/// Lanes of the row sums: 16 f32 are one AVX-512 register.
const LANES: usize = 16;

/// The sum of `f(x, y)` over pairs of elements of `x` and `y`, in [`LANES`] partial sums (pair
/// `i` into lane `i % LANES`) added pairwise at the end: a fixed order that vectorizes.
#[inline(always)]
fn lane_sum2(x: &[f32], y: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let (mut xc, mut yc) = (x.chunks_exact(LANES), y.chunks_exact(LANES));
    for (xs, ys) in (&mut xc).zip(&mut yc) {
        for ((a, &x), &y) in acc.iter_mut().zip(xs).zip(ys) {
            *a += f(x, y);
        }
    }
    for ((a, &x), &y) in acc.iter_mut().zip(xc.remainder()).zip(yc.remainder()) {
        *a += f(x, y);
    }
    halves(acc)
}

/// The sum of the [`LANES`] partial sums, added pairwise: the upper half into the lower, until
/// one is left.
#[inline(always)]
fn halves(mut acc: [f32; LANES]) -> f32 {
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        let (lo, hi) = acc.split_at_mut(w);
        for (a, &b) in lo.iter_mut().zip(&hi[..w]) {
            *a += b;
        }
    }
    acc[0]
}

/// [`lane_sum2`] with its main loop in explicit vectors of `S`, its [`LANES`] partial sums in
/// `LANES / lanes` registers (`fv` is `f` on vectors): the same sums in the same order, so the
/// same bits. Compiled from `lane_sum2`'s arrays, the partial sums of a layer norm's rows were
/// split into pieces of registers and scalar additions, and the rows took three times as long.
#[inline(always)]
fn vector_lane_sum2<S: pulp::Simd>(
    simd: S,
    x: &[f32],
    y: &[f32],
    fv: impl Fn(S::f32s, S::f32s) -> S::f32s,
    f: impl Fn(f32, f32) -> f32,
) -> f32 {
    let lanes = std::mem::size_of::<S::f32s>() / 4;
    if lanes > LANES {
        return lane_sum2(x, y, f);
    }
    let mut acc = [simd.splat_f32s(0.0); LANES];
    let (mut xc, mut yc) = (x.chunks_exact(LANES), y.chunks_exact(LANES));
    for (xs, ys) in (&mut xc).zip(&mut yc) {
        for (r, a) in acc.iter_mut().enumerate().take(LANES / lanes) {
            *a = simd.add_f32s(*a, fv(load::<S>(&xs[r * lanes..]), load::<S>(&ys[r * lanes..])));
        }
    }
    let mut sums = [0f32; LANES];
    for (s, a) in sums.chunks_exact_mut(lanes).zip(&acc) {
        s.copy_from_slice(pulp::bytemuck::cast_slice(std::slice::from_ref(a)));
    }
    for ((a, &x), &y) in sums.iter_mut().zip(xc.remainder()).zip(yc.remainder()) {
        *a += f(x, y);
    }
    halves(sums)
}

/// The sum of `f(x)` over the elements of `x`, in the order of [`lane_sum2`].
#[inline(always)]
fn lane_sum(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    lane_sum2(x, x, |x, _| f(x))
}

/// The maximum of `xs` (not empty; no NaN expected), in [`LANES`] lanes.
#[inline(always)]
fn lane_max(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    for (a, &v) in acc.iter_mut().zip(chunks.remainder()) {
        *a = if v > *a { v } else { *a };
    }
    acc.iter().copied().fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m })
}

/// `e^x` (Cephes' `expf`: `2^k e^r` with `r` in +-ln(2)/2 and a degree-6 polynomial), within
/// 2 ulp of libm's `expf` for `x` in -87.3 to 88 and clamped outside (about 1e-38 below,
/// 1.7e38 above): pure arithmetic, so the softmax loops vectorize. Its steps are fused
/// multiply-adds ([`f32::mul_add`], one rounding each: the same bits wherever it runs, and in
/// vector code one instruction where a product and a sum were two, each waiting on the other).
#[inline(always)]
fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.336_55, 88.0);
    let k = x.mul_add(std::f32::consts::LOG2_E, 0.5).floor();
    let r = (-k).mul_add(-2.121_944_4e-4, (-k).mul_add(0.693_359_4, x));
    let p = 1.987_569_1e-4f32;
    let p = p.mul_add(r, 1.398_199_9e-3);
    let p = p.mul_add(r, 8.333_452e-3);
    let p = p.mul_add(r, 4.166_579_6e-2);
    let p = p.mul_add(r, 1.666_666_5e-1);
    let p = p.mul_add(r, 0.5);
    let y = p.mul_add(r * r, r) + 1.0;
    // 2^k from the bits of k + 1.5 * 2^23 (whose low mantissa bits are k as an integer): a
    // float-to-int cast (`as i32`) saturates and checks for NaN, which does not vectorize.
    let k_bits = (k + 12_582_912.0).to_bits().wrapping_sub(0x4b40_0000).wrapping_add(127);
    y * f32::from_bits(k_bits << 23)
}

/// [`exp`] on a vector of `S`: the same steps, so the same bits in every lane. Its floor is
/// the rounding of the magic number `1.5 * 2^23` (exact here, where the operand is below 2^7),
/// less one where that rounded up; `2^k` the bits of `k`, shifted by a multiplication.
#[inline(always)]
fn exp_vector<S: pulp::Simd>(simd: S, x: S::f32s) -> S::f32s {
    let c = |v: f32| simd.splat_f32s(v);
    let (lo, hi) = (c(-87.336_55), c(88.0));
    let x = simd.select_f32s(simd.less_than_f32s(x, lo), lo, x);
    let x = simd.select_f32s(simd.greater_than_f32s(x, hi), hi, x);
    let y = simd.mul_add_f32s(x, c(std::f32::consts::LOG2_E), c(0.5));
    let magic = c(12_582_912.0);
    let r = simd.sub_f32s(simd.add_f32s(y, magic), magic);
    let k = simd.select_f32s(simd.greater_than_f32s(r, y), simd.sub_f32s(r, c(1.0)), r);
    let nk = simd.xor_f32s(k, c(-0.0));
    let r = simd.mul_add_f32s(nk, c(-2.121_944_4e-4), simd.mul_add_f32s(nk, c(0.693_359_4), x));
    let mut p = c(1.987_569_1e-4);
    for a in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
        p = simd.mul_add_f32s(p, r, c(a));
    }
    let y = simd.add_f32s(simd.mul_add_f32s(p, simd.mul_f32s(r, r), r), c(1.0));
    let bits = simd.transmute_u32s_f32s(simd.add_f32s(k, magic));
    let bits = simd.add_u32s(simd.sub_u32s(bits, simd.splat_u32s(0x4b40_0000)), simd.splat_u32s(127));
    let scale = simd.transmute_f32s_u32s(simd.mul_u32s(bits, simd.splat_u32s(1 << 23)));
    simd.mul_f32s(y, scale)
}

/// `y = f(h + b)` row by row: a dense layer's bias and activation in one pass.
struct BiasActFwd<'a, F> {
    h: &'a [f32],
    b: &'a [f32],
    f: F,
    y: &'a mut Vec<f32>,
}

impl<F: Fn(f32) -> f32> Kernel for BiasActFwd<'_, F> {
    #[inline(always)]
    fn run(self) {
        let (b, d, f) = (self.b, self.b.len().max(1), self.f);
        // Each row appended from an iterator of exactly its length, as [`LayerNormFwd`]'s: the
        // output written once, with no zeroing pass and no stack block to copy.
        self.y.reserve(self.h.len());
        for hr in self.h.chunks_exact(d) {
            self.y.extend(hr.iter().zip(b).map(|(&h, &b)| f(h + b)));
        }
    }
}

/// Appends `(rows + 1, d)`: the rows of `dh = grad(h + b, g)`, then `db` (their sum over rows,
/// from 0 and row by row: the order of candle's sum over a batch's rows, so the same bits).
struct BiasActBwd<'a, G> {
    h: &'a [f32],
    b: &'a [f32],
    g: &'a [f32],
    grad: G,
    out: &'a mut Vec<f32>,
}

impl<G: Fn(f32, f32) -> f32> Kernel for BiasActBwd<'_, G> {
    #[inline(always)]
    fn run(self) {
        let (b, d, grad) = (self.b, self.b.len().max(1), self.grad);
        let mut db = vec![0f32; d];
        // Through a stack block ([`BLOCK`]): appended from an iterator that also adds into
        // `db`, the rows took 30 times as long.
        let mut block = [0f32; BLOCK];
        for (hr, gr) in self.h.chunks_exact(d).zip(self.g.chunks_exact(d)) {
            let chunks = hr.chunks(BLOCK).zip(gr.chunks(BLOCK)).zip(b.chunks(BLOCK)).zip(db.chunks_mut(BLOCK));
            for (((hc, gc), bc), dbc) in chunks {
                let out = &mut block[..hc.len()];
                for ((((dh, db), &h), &b), &g) in out.iter_mut().zip(dbc.iter_mut()).zip(hc).zip(bc).zip(gc) {
                    *dh = grad(h + b, g);
                    *db += *dh;
                }
                self.out.extend_from_slice(out);
            }
        }
        self.out.extend_from_slice(&db);
    }
}

/// `x + (y + b)` row by row, `b` of the rows' length.
struct ResidualBiasFwd<'a> {
    x: &'a [f32],
    y: &'a [f32],
    b: &'a [f32],
    out: &'a mut Vec<f32>,
}

impl Kernel for ResidualBiasFwd<'_> {
    #[inline(always)]
    fn run(self) {
        let (b, d) = (self.b, self.b.len().max(1));
        // Each row appended from an iterator of its length, as the bias and activation.
        self.out.reserve(self.x.len());
        for (xr, yr) in self.x.chunks_exact(d).zip(self.y.chunks_exact(d)) {
            self.out.extend(xr.iter().zip(yr).zip(b).map(|((&x, &y), &b)| x + (y + b)));
        }
    }
}

struct CausalSoftmaxFwd<'a> {
    x: &'a [f32],
    t: usize,
    y: &'a mut Vec<f32>,
}

impl Kernel for CausalSoftmaxFwd<'_> {
    #[inline(always)]
    fn run(self) {
        let t = self.t;
        // The output zeroed once (the masked columns stay 0), then each row's first `n`
        // columns written in place: no row buffer to copy, no exp of a masked column. The sum
        // over the `n` columns is the sum over the row of `t` (its lanes get the same elements
        // in the same order, the masked ones adding exact zeros).
        // The exps are taken over whole vectors of [`LANES`] columns (up to `t`), the columns
        // past `n` then set back to 0: a row's last partial vector would otherwise run the
        // scalar exp, which cost more than the rest of the row.
        self.y.resize(self.x.len(), 0.0);
        for (r, (xr, yr)) in self.x.chunks_exact(t).zip(self.y.chunks_exact_mut(t)).enumerate() {
            let n = r % t + 1;
            let max = lane_max(&xr[..n]);
            let whole = (n.div_ceil(LANES) * LANES).min(t);
            let (xr, yr) = (&xr[..whole], &mut yr[..whole]);
            let (mut xc, mut yc) = (xr.chunks_exact(LANES), yr.chunks_exact_mut(LANES));
            for (ys, xs) in (&mut yc).zip(&mut xc) {
                for (y, &v) in ys.iter_mut().zip(xs) {
                    *y = exp(v - max);
                }
            }
            for (y, &v) in yc.into_remainder().iter_mut().zip(xc.remainder()) {
                *y = exp(v - max);
            }
            for y in &mut yr[n..] {
                *y = 0.0;
            }
            let sum = lane_sum(yr, |y| y);
            for y in yr.iter_mut() {
                *y /= sum;
            }
        }
    }
}

struct SoftmaxBwd<'a> {
    y: &'a [f32],
    g: &'a [f32],
    t: usize,
    d: &'a mut Vec<f32>,
}

impl Kernel for SoftmaxBwd<'_> {
    #[inline(always)]
    fn run(self) {
        let t = self.t;
        self.d.resize(self.y.len(), 0.0);
        for ((yr, gr), dr) in self.y.chunks_exact(t).zip(self.g.chunks_exact(t)).zip(self.d.chunks_exact_mut(t)) {
            let dot = lane_sum2(yr, gr, |y, g| y * g);
            for ((d, &y), &g) in dr.iter_mut().zip(yr).zip(gr) {
                *d = y * (g - dot);
            }
        }
    }
}

struct LayerNormFwd<'a> {
    x: &'a [f32],
    w: &'a [f32],
    b: &'a [f32],
    eps: f32,
    y: &'a mut Vec<f32>,
    /// Each row's mean and `1 / sqrt(var + eps)`, appended for the backward pass.
    stats: &'a mut Vec<f32>,
}

impl VectorKernel for LayerNormFwd<'_> {
    #[inline(always)]
    fn run<S: pulp::Simd>(self, simd: S) {
        let d = self.w.len().max(1);
        let (w, b) = (&self.w[..d], &self.b[..d]);
        // Each row appended from an iterator of exactly its length: written once, with no
        // zeroing pass before it (zeroing the whole output first was as long a pass as the
        // rows' own writes) and no stack block to copy.
        self.y.reserve(self.x.len() / d * d);
        for xr in self.x.chunks_exact(d) {
            let (mean, rstd) = row_stats(simd, xr, self.eps);
            self.stats.extend([mean, rstd]);
            self.y.extend(xr.iter().zip(w).zip(b).map(|((&v, &w), &b)| (v - mean) * rstd * w + b));
        }
    }
}

/// Appends `(rows + 2, d)`: the rows of `dx`, then `dweight`, then `dbias`.
struct LayerNormBwd<'a> {
    x: &'a [f32],
    w: &'a [f32],
    g: &'a [f32],
    eps: f32,
    /// The forward pass' [`LayerNormFwd::stats`], if kept (the same bits as computing them
    /// again, which the rows otherwise do: two sums, a square root and a division a row, each
    /// waiting on the one before).
    stats: Option<&'a [f32]>,
    out: &'a mut Vec<f32>,
}

impl VectorKernel for LayerNormBwd<'_> {
    #[inline(always)]
    fn run<S: pulp::Simd>(self, simd: S) {
        let (w, d) = (self.w, self.w.len().max(1));
        let rows = self.x.len() / d;
        // The rows of `dx` appended as [`LayerNormFwd`] appends its rows; the sums for the
        // weight and the bias in their own rows, appended last.
        self.out.reserve((rows + 2) * d);
        let (mut dw, mut db) = (vec![0f32; d], vec![0f32; d]);
        let (mut xhat, mut gw) = (vec![0f32; d], vec![0f32; d]);
        let stats = self.stats.filter(|s| s.len() == 2 * rows);
        for (r, (xr, gr)) in self.x.chunks_exact(d).zip(self.g.chunks_exact(d)).enumerate() {
            let (mean, rstd) = match stats {
                Some(s) => (s[2 * r], s[2 * r + 1]),
                None => row_stats(simd, xr, self.eps),
            };
            for (h, &v) in xhat.iter_mut().zip(xr) {
                *h = (v - mean) * rstd;
            }
            for ((gw, &g), &w) in gw.iter_mut().zip(gr).zip(w) {
                *gw = g * w;
            }
            let mean_gw = vector_lane_sum2(simd, &gw, &gw, |x, _| x, |x, _| x) / d as f32;
            let mean_gw_xhat =
                vector_lane_sum2(simd, &gw, &xhat, |gw, h| simd.mul_f32s(gw, h), |gw, h| gw * h) / d as f32;
            self.out
                .extend(gr.iter().zip(w).zip(&xhat).map(|((&g, &w), &h)| rstd * (g * w - mean_gw - h * mean_gw_xhat)));
            for (((dw, db), &g), &h) in dw.iter_mut().zip(db.iter_mut()).zip(gr).zip(&xhat) {
                *dw += g * h;
                *db += g;
            }
        }
        self.out.extend_from_slice(&dw);
        self.out.extend_from_slice(&db);
    }
}

/// Whether the f32 kernels apply to `x`: an f32 tensor on the CPU.
fn fusable(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32
}

/// Whether the element-wise kernels (GELU, bias and GELU, the causal softmax, layer norm)
/// apply to `xs`: CPU tensors of one type, f32 or (mixed precision) bf16 or f16. A 16-bit
/// tensor is widened to f32 as the kernel reads it, computed in f32, and its result narrowed
/// back: the same arithmetic as f32's, on 16-bit inputs, keeping 16-bit outputs (so a
/// backward pass keeps half the bytes).
fn fusable16(xs: &[&Tensor]) -> bool {
    let dtype = xs[0].dtype();
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
        && xs.iter().all(|x| x.device().is_cpu() && x.dtype() == dtype)
}

/// The elements of a contiguous CPU tensor as f32: an f32 tensor's own, a 16-bit tensor's
/// widened.
fn f32s<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<Cow<'a, [f32]>> {
    let Some((a, b)) = l.contiguous_offsets() else { candle_core::bail!("{op} needs a contiguous tensor") };
    Ok(match s {
        CpuStorage::F32(v) => Cow::Borrowed(&v[a..b]),
        CpuStorage::BF16(v) => Cow::Owned(v[a..b].to_f32_vec()),
        CpuStorage::F16(v) => Cow::Owned(v[a..b].to_f32_vec()),
        _ => candle_core::bail!("{op} takes f32, bf16 or f16 tensors"),
    })
}

/// The elements of a contiguous f32 CPU tensor (the convolution's kernels, f32 only).
fn f32_only<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [f32]> {
    let data = s.as_slice::<f32>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("{op} needs a contiguous tensor"),
    }
}

/// `v` stored in the type of `like` (f32, or narrowed to bf16 or f16, rounding to nearest).
fn stored(like: &CpuStorage, v: Vec<f32>) -> CpuStorage {
    match like {
        CpuStorage::BF16(_) => CpuStorage::BF16(Vec::from_f32_slice(&v)),
        CpuStorage::F16(_) => CpuStorage::F16(Vec::from_f32_slice(&v)),
        _ => CpuStorage::F32(v),
    }
}

fn same_shape(a: &Layout, b: &Layout, op: &str) -> Result<()> {
    if a.shape() != b.shape() {
        candle_core::bail!("{op}: shapes {:?} and {:?} differ", a.shape(), b.shape());
    }
    Ok(())
}

struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "strata-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32s(s, l, self.name())?;
        let mut y = Vec::with_capacity(x.len());
        simd_vectors(gelu::GeluFwd { x: &x, y: &mut y });
        Ok((stored(s, y), l.shape().clone()))
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
        let mut d = Vec::with_capacity(x.len());
        simd_vectors(gelu::GeluBwd { x: &x, g: &g, d: &mut d });
        Ok((stored(s1, d), l1.shape().clone()))
    }
}

/// GELU (tanh approximation) of `x`, one pass forward and one backward on f32 CPU tensors;
/// candle's `gelu` elsewhere.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if fusable16(&[x]) {
        x.contiguous()?.apply_op1(Gelu)
    } else {
        x.gelu()
    }
}

/// The activation a fused dense layer applies after its bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Act {
    /// GELU, tanh approximation, as candle's `gelu`.
    Gelu,
    /// ReLU, as candle's `relu` (`max(v, 0)`; its gradient passes where `v >= 0`).
    Relu,
}

/// ReLU as candle computes it.
#[inline(always)]
fn relu1(v: f32) -> f32 {
    v.max(0f32)
}

/// `g` times ReLU's derivative at `v`, as candle's backward pass computes it (`g * 1` where
/// `v >= 0`, `g * 0` elsewhere, so a NaN or infinite `g` stays one).
#[inline(always)]
fn relu1_grad(v: f32, g: f32) -> f32 {
    g * if v >= 0.0 { 1.0 } else { 0.0 }
}

impl Act {
    fn names(self) -> (&'static str, &'static str) {
        match self {
            Act::Gelu => ("strata-bias-gelu", "strata-bias-gelu-grad"),
            Act::Relu => ("strata-bias-relu", "strata-bias-relu-grad"),
        }
    }
}

/// `act(h + b)`: a bias `b` of the last axis' size added to `h`, then the activation; a dense
/// layer's bias and activation in one pass, and in one backward pass that also sums the bias'
/// gradient.
struct BiasAct(Act);

impl CustomOp2 for BiasAct {
    fn name(&self) -> &'static str {
        self.0.names().0
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (h, b) = (f32s(s1, l1, self.name())?, f32s(s2, l2, self.name())?);
        bias_of(l1, l2, self.name())?;
        let mut y = Vec::with_capacity(h.len());
        match self.0 {
            Act::Gelu => simd_vectors(gelu::BiasGeluFwd { h: &h, b: &b, y: &mut y }),
            Act::Relu => simd(BiasActFwd { h: &h, b: &b, f: relu1, y: &mut y }),
        }
        Ok((stored(s1, y), l1.shape().clone()))
    }

    fn bwd(&self, h: &Tensor, b: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let rows = h.elem_count() / b.elem_count().max(1);
        let packed = h.apply_op3_no_bwd(b, &grad.contiguous()?, &BiasActGrad(self.0))?;
        Ok((Some(packed.narrow(0, 0, rows)?.reshape(h.shape())?), Some(packed.get(rows)?)))
    }
}

/// `(h, b, g)` -> `(rows + 1, d)`: the rows of `dh`, then `db`.
struct BiasActGrad(Act);

impl CustomOp3 for BiasActGrad {
    fn name(&self) -> &'static str {
        self.0.names().1
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
        bias_of(l1, l2, self.name())?;
        let (h, b, g) = (f32s(s1, l1, self.name())?, f32s(s2, l2, self.name())?, f32s(s3, l3, self.name())?);
        let d = b.len().max(1);
        let mut out = Vec::with_capacity(h.len() + d);
        match self.0 {
            Act::Gelu => simd_vectors(gelu::BiasGeluBwd { h: &h, b: &b, g: &g, out: &mut out }),
            Act::Relu => simd(BiasActBwd { h: &h, b: &b, g: &g, grad: relu1_grad, out: &mut out }),
        }
        Ok((stored(s1, out), Shape::from((h.len() / d + 1, d))))
    }
}

/// `b` is a vector of `h`'s last axis' size (not 0).
fn bias_of(h: &Layout, b: &Layout, op: &str) -> Result<()> {
    let d = h.shape().dims().last().copied().unwrap_or(1);
    vector_of(b, d.max(1), op, "bias")
}

/// `gelu(h + b)` for a bias `b` of `h`'s last axis' size: one pass forward and one backward
/// (which also sums the bias' gradient) on f32 CPU tensors; `gelu(h.broadcast_add(b))`
/// elsewhere.
pub fn bias_gelu(h: &Tensor, b: &Tensor) -> Result<Tensor> {
    if fusable16(&[h, b]) {
        h.contiguous()?.apply_op2(&b.contiguous()?, BiasAct(Act::Gelu))
    } else {
        gelu(&h.broadcast_add(b)?)
    }
}

/// `relu(h + b)` for a bias `b` of `h`'s last axis' size: one pass forward and one backward
/// (which also sums the bias' gradient) on f32 CPU tensors, with the same bits as candle's
/// `h.broadcast_add(b)?.relu()` and its backward pass (the same arithmetic, the bias' gradient
/// summed over the rows in candle's order); the composed operations elsewhere (16-bit types
/// too, whose sums candle takes in 16 bits).
pub fn bias_relu(h: &Tensor, b: &Tensor) -> Result<Tensor> {
    if fusable(h) && fusable(b) {
        h.contiguous()?.apply_op2(&b.contiguous()?, BiasAct(Act::Relu))
    } else {
        h.broadcast_add(b)?.relu()
    }
}

/// `x + (y + b)`: a residual `x` added to a dense layer's product `y` and bias `b` (of the last
/// axis' size), in one pass where the composed operations take two; its backward pass gives
/// the gradient itself to `x` and `y` and sums it over the rows for `b`, as candle's `add` and
/// `broadcast_add` do.
struct ResidualBias;

impl CustomOp3 for ResidualBias {
    fn name(&self) -> &'static str {
        "strata-residual-bias"
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
        same_shape(l1, l2, self.name())?;
        bias_of(l1, l3, self.name())?;
        let (x, y, b) = (f32s(s1, l1, self.name())?, f32s(s2, l2, self.name())?, f32s(s3, l3, self.name())?);
        let mut out = Vec::with_capacity(x.len());
        simd(ResidualBiasFwd { x: &x, y: &y, b: &b, out: &mut out });
        Ok((stored(s1, out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _y: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The bias' gradient as candle's `broadcast_add` takes it: summed over the axes it was
        // broadcast along, in one reduction.
        let leading: Vec<usize> = (0..grad.rank().saturating_sub(b.rank())).collect();
        let db = grad.sum_keepdim(leading)?.reshape(b.shape())?;
        Ok((Some(grad.clone()), Some(grad.clone()), Some(db)))
    }
}

/// `x + (y + b)` for `x` and `y` of one shape and a bias `b` of their last axis' size: a
/// residual connection around a dense layer's product `y`, in one pass on f32 CPU tensors
/// with the same bits as `x + y.broadcast_add(b)` forward and backward, which it is elsewhere
/// (16-bit types, other devices).
pub fn residual_bias(x: &Tensor, y: &Tensor, b: &Tensor) -> Result<Tensor> {
    if fusable(x) && fusable(y) && fusable(b) && b.rank() == 1 {
        x.contiguous()?.apply_op3(&y.contiguous()?, &b.contiguous()?, ResidualBias)
    } else {
        x + y.broadcast_add(b)?
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
        let mut out = Vec::with_capacity(x.len());
        simd(CausalSoftmaxFwd { x: &x, t, y: &mut out });
        Ok((stored(s, out), l.shape().clone()))
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
        let mut out = Vec::with_capacity(y.len());
        simd(SoftmaxBwd { y: &y, g: &g, t, d: &mut out });
        Ok((stored(s1, out), l1.shape().clone()))
    }
}

/// Attention's causal softmax: `scores` `(..., t, t)`, row `i` of each square normalised over
/// columns `0..=i` and 0 beyond. One pass each way on f32 CPU tensors; elsewhere the composed
/// operations (adding a `-inf` mask above the diagonal, then softmax).
pub fn causal_softmax(scores: &Tensor) -> Result<Tensor> {
    if fusable16(&[scores]) {
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
    /// The forward pass' rows' statistics ([`LayerNormFwd::stats`]), for the backward pass: 8
    /// bytes a row, held by the operation (as the attention's probabilities are), so
    /// [`strata_core::Footprint`] does not count them.
    stats: std::sync::OnceLock<Vec<f32>>,
}

/// A row of `d` elements: its mean and `1 / sqrt(var + eps)`, each sum [`lane_sum`]'s.
#[inline(always)]
fn row_stats<S: pulp::Simd>(simd: S, row: &[f32], eps: f32) -> (f32, f32) {
    let d = row.len() as f32;
    let mean = vector_lane_sum2(simd, row, row, |x, _| x, |x, _| x) / d;
    let m = simd.splat_f32s(mean);
    let centered = |x| {
        let c = simd.sub_f32s(x, m);
        simd.mul_f32s(c, c)
    };
    let var = vector_lane_sum2(simd, row, row, |x, _| centered(x), |v, _| (v - mean) * (v - mean)) / d;
    (mean, 1.0 / (var + eps).sqrt())
}

/// `l` is a vector of `d` elements: `op`'s `what` for rows of `d`.
fn vector_of(l: &Layout, d: usize, op: &str, what: &str) -> Result<()> {
    if l.shape().dims() != [d] {
        candle_core::bail!("{op}: a {what} of shape {:?} for rows of {d}", l.shape());
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
        vector_of(l2, d, "layer_norm", "weight")?;
        vector_of(l3, d, "layer_norm", "bias")?;
        let (w, b) = (f32s(s2, l2, self.name())?, f32s(s3, l3, self.name())?);
        let mut out = Vec::with_capacity(x.len());
        let mut stats = Vec::with_capacity(2 * (x.len() / d));
        simd_vectors(LayerNormFwd { x: &x, w: &w, b: &b, eps: self.eps, y: &mut out, stats: &mut stats });
        // A second forward pass of the same operation (none in candle) would keep the first's.
        let _ = self.stats.set(stats);
        Ok((stored(s1, out), l1.shape().clone()))
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
        let grad_op = LayerNormGrad { eps: self.eps, stats: self.stats.get().map(Vec::as_slice) };
        let packed = x.apply_op3_no_bwd(w, &grad.contiguous()?, &grad_op)?;
        let dx = packed.narrow(0, 0, rows)?.reshape(x.shape())?;
        Ok((Some(dx), Some(packed.get(rows)?), Some(packed.get(rows + 1)?)))
    }
}

/// `(x, weight, g)` -> `(rows + 2, d)`: the rows of `dx`, then `dweight`, then `dbias`.
struct LayerNormGrad<'a> {
    eps: f32,
    /// [`LayerNormOp::stats`].
    stats: Option<&'a [f32]>,
}

impl CustomOp3 for LayerNormGrad<'_> {
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
        let mut out = Vec::with_capacity((rows + 2) * d);
        simd_vectors(LayerNormBwd { x: &x, w: &w, g: &g, eps: self.eps, stats: self.stats, out: &mut out });
        Ok((stored(s1, out), Shape::from((rows + 2, d))))
    }
}

/// Layer norm over the last axis of `x` with a learned `weight` and `bias` (both of the last
/// axis' size): one pass each way on f32 CPU tensors; candle-nn's `layer_norm_slow` (composed
/// operations) elsewhere.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    if fusable16(&[x, weight, bias]) {
        x.contiguous()?.apply_op3(
            &weight.contiguous()?,
            &bias.contiguous()?,
            LayerNormOp { eps: eps as f32, stats: Default::default() },
        )
    } else {
        candle_nn::ops::layer_norm_slow(x, weight, bias, eps as f32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use vector::VectorDispatch;

    /// [`check`]'s bound on the largest difference, relative to the reference's largest value.
    const CHECK_TOLERANCE: f32 = 2e-5;

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
        // The inputs are random on every run: the fused GELU's rational tanh has been seen
        // 1.06e-5 (relative to the largest value) from candle's tanh, so the bound is 2e-5.
        close(&a, &b, CHECK_TOLERANCE);
        let ga = (a * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (b * &r).unwrap().sum_all().unwrap().backward().unwrap();
        close(ga.get(x.as_tensor()).unwrap(), gb.get(x.as_tensor()).unwrap(), CHECK_TOLERANCE);
    }

    /// A fused op on 16-bit inputs (`dtype`, all of them) against the same op on those inputs
    /// widened to f32, its output narrowed: the same bits forward, and for the gradients of
    /// `sum(out * r)` (`r` 16-bit too) the f32 op's gradients narrowed. Shapes include rows
    /// shorter than a vector and with a tail. An op whose backward pass reads its output (the
    /// softmax) reads the 16-bit output, not f32's: its gradients are compared within
    /// `from_output`'s relative bound instead.
    fn check16(dtype: DType, shapes: &[&[usize]], from_output: Option<f32>, op: impl Fn(&[Tensor]) -> Result<Tensor>) {
        let dev = Device::Cpu;
        let narrow = |t: &Tensor| t.to_dtype(dtype).unwrap();
        let bits = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let inputs: Vec<Tensor> = shapes.iter().map(|s| narrow(&Tensor::randn(0f32, 2.0, *s, &dev).unwrap())).collect();
        let vars16: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let vars32: Vec<Var> =
            inputs.iter().map(|t| Var::from_tensor(&t.to_dtype(DType::F32).unwrap()).unwrap()).collect();
        let t16: Vec<Tensor> = vars16.iter().map(|v| v.as_tensor().clone()).collect();
        let t32: Vec<Tensor> = vars32.iter().map(|v| v.as_tensor().clone()).collect();
        let (a, b) = (op(&t16).unwrap(), op(&t32).unwrap());
        assert_eq!(a.dtype(), dtype, "the output keeps the inputs' type");
        assert_eq!(bits(&a), bits(&narrow(&b)), "{dtype:?} forward");
        let r = narrow(&Tensor::randn(0f32, 1.0, a.shape(), &dev).unwrap());
        let ga = (a * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (b * r.to_dtype(DType::F32).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
        for (v16, v32) in vars16.iter().zip(&vars32) {
            let (x, y) = (ga.get(v16.as_tensor()).unwrap(), gb.get(v32.as_tensor()).unwrap());
            assert_eq!(x.dtype(), dtype);
            match from_output {
                None => assert_eq!(bits(x), bits(&narrow(y)), "{dtype:?} gradient"),
                Some(tol) => close(&x.to_dtype(DType::F32).unwrap(), y, tol),
            }
        }
    }

    #[test]
    fn the_kernels_on_16_bit_inputs_compute_in_f32_and_narrow() {
        for dtype in [DType::BF16, DType::F16] {
            for d in [1usize, 7, 16, 37] {
                check16(dtype, &[&[3, d]], None, |t| gelu(&t[0]));
                check16(dtype, &[&[5, d], &[d]], None, |t| bias_gelu(&t[0], &t[1]));
                check16(dtype, &[&[4, d], &[d], &[d]], None, |t| layer_norm(&t[0], &t[1], &t[2], 1e-5));
                // bf16's output keeps 8 bits: its gradient is f32's within a few of its ulps.
                check16(dtype, &[&[2, 3, d, d]], Some(3e-2), |t| causal_softmax(&t[0]));
            }
        }
        // Mixed types are not fused: candle's composed operations refuse them as they would.
        let dev = Device::Cpu;
        let h = Tensor::ones((2, 4), DType::BF16, &dev).unwrap();
        assert!(bias_gelu(&h, &Tensor::ones(4, DType::F32, &dev).unwrap()).is_err());
    }

    #[test]
    fn the_rational_tanh_is_libms_within_a_few_ulp() {
        let mut worst = 0f32;
        for i in -200_000..=200_000 {
            let x = i as f32 * 1e-4; // -20 to 20
            let (a, b) = (gelu::tanh(x), x.tanh());
            worst = worst.max((a - b).abs() / b.abs().max(f32::MIN_POSITIVE));
        }
        assert!(worst < 1e-6, "worst relative error {worst}");
    }

    #[test]
    fn the_polynomial_exp_is_libms_within_a_few_ulp() {
        let mut worst = 0f32;
        for i in -873_000..=880_000 {
            let x = i as f32 * 1e-4; // -87.3 to 88
            let (a, b) = (exp(x), x.exp());
            worst = worst.max((a - b).abs() / b);
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NEG_INFINITY) < 1e-37 && exp(-1e9) < 1e-37, "clamped below");
    }

    /// [`exp_vector`] on `xs`, vector by vector (whole vectors of `S`; the tail left out).
    struct ExpVectors<'a> {
        xs: &'a [f32],
        out: &'a mut Vec<f32>,
    }

    impl VectorKernel for ExpVectors<'_> {
        fn run<S: pulp::Simd>(self, simd: S) {
            let lanes = std::mem::size_of::<S::f32s>() / 4;
            for c in self.xs.chunks_exact(lanes) {
                let e = exp_vector(simd, load::<S>(c));
                self.out.extend_from_slice(pulp::bytemuck::cast_slice(std::slice::from_ref(&e)));
            }
        }
    }

    #[test]
    fn the_vector_exp_gives_the_scalar_exps_bits() {
        let mut xs: Vec<f32> = (-900_000..=900_000).map(|i| i as f32 * 1e-4).collect();
        let edges = [f32::NEG_INFINITY, f32::INFINITY, -0.0, 0.0, -87.4, -87.336_55, 88.0, 88.1, 1e9, -1e9];
        xs.extend(edges);
        xs.extend((0..64).map(|i| f32::from_bits(0x3f80_0000 + i * 0x0001_2345)));
        xs.truncate(xs.len() / 16 * 16);
        let want: Vec<u32> = xs.iter().map(|&x| exp(x).to_bits()).collect();
        let check = |out: Vec<f32>, path: &str| {
            assert_eq!(out.len(), xs.len(), "{path}");
            for ((&x, &w), o) in xs.iter().zip(&want).zip(out) {
                assert_eq!(o.to_bits(), w, "{path}: exp({x:e}) = {o:e}, the scalar exp {:e}", f32::from_bits(w));
            }
        };
        let mut out = Vec::new();
        simd_vectors(ExpVectors { xs: &xs, out: &mut out });
        check(out, "widest");
        #[cfg(target_arch = "x86_64")]
        if let Some(v3) = pulp::x86::V3::try_new() {
            let mut out = Vec::new();
            pulp::Simd::vectorize(v3, VectorDispatch(ExpVectors { xs: &xs, out: &mut out }));
            check(out, "avx2");
        }
        let mut out = Vec::new();
        pulp::Simd::vectorize(pulp::Scalar::new(), VectorDispatch(ExpVectors { xs: &xs, out: &mut out }));
        check(out, "scalar");
    }

    #[test]
    fn lane_sums_add_every_element_once() {
        for n in [0, 1, 15, 16, 17, 33, 64, 100] {
            let x: Vec<f32> = (0..n).map(|i| (i + 1) as f32).collect();
            let y: Vec<f32> = (0..n).map(|i| (i % 3) as f32).collect();
            assert_eq!(lane_sum(&x, |v| v), (n * (n + 1) / 2) as f32, "n = {n}");
            let dot: f32 = x.iter().zip(&y).map(|(a, b)| a * b).sum();
            assert_eq!(lane_sum2(&x, &y, |a, b| a * b), dot, "n = {n}");
            if n > 0 {
                assert_eq!(lane_max(&x), n as f32);
            }
        }
    }

    /// Each kernel run compiled for this CPU's widest vectors and compiled for the baseline
    /// (pulp's scalar path, SSE2 on x86-64): the same bits.
    #[test]
    fn kernels_give_the_same_bits_at_every_vector_width() {
        let r = |n: usize| -> Vec<f32> { Tensor::randn(0f32, 2.0, n, &Device::Cpu).unwrap().to_vec1().unwrap() };
        let (rows, d, t) = (37, 48, 13);
        let (x, g, w) = (r(rows * d), r(rows * d), r(d));
        let (sq, sg) = (r(5 * t * t), r(5 * t * t));
        let run = |k: &dyn Fn(&mut Vec<f32>, bool)| {
            let (mut a, mut s) = (Vec::new(), Vec::new());
            k(&mut a, true);
            k(&mut s, false);
            assert_eq!(a.len(), s.len());
            assert!(a.iter().zip(&s).all(|(a, s)| a.to_bits() == s.to_bits()));
            assert!(!a.is_empty());
        };
        fn go(k: impl Kernel, wide: bool) {
            if wide {
                simd(k)
            } else {
                pulp::Simd::vectorize(pulp::Scalar::new(), Dispatch(k))
            }
        }
        // GELU's explicit vectors: `gelu::tests`.
        run(&|o, wide| go(BiasActFwd { h: &x, b: &w, f: relu1, y: o }, wide));
        run(&|o, wide| go(BiasActBwd { h: &x, b: &w, g: &g, grad: relu1_grad, out: o }, wide));
        // Layer norm's explicit vectors: the widest, AVX2's (where the CPU has it) and the
        // scalar path; rows of whole vectors and rows with a tail.
        fn go_vectors(k: impl VectorKernel, wide: bool, avx2: bool) {
            match (wide, avx2) {
                (true, false) => simd_vectors(k),
                #[cfg(target_arch = "x86_64")]
                (true, true) => match pulp::x86::V3::try_new() {
                    Some(v3) => pulp::Simd::vectorize(v3, VectorDispatch(k)),
                    None => simd_vectors(k),
                },
                _ => pulp::Simd::vectorize(pulp::Scalar::new(), VectorDispatch(k)),
            }
        }
        for avx2 in [false, true] {
            for d in [48, 53, 7] {
                let n = x.len() / d * d;
                let (x, g) = (&x[..n], &g[..n]);
                let (w, b) = (r(d), r(d));
                let fwd = |o: &mut Vec<f32>, stats: &mut Vec<f32>, wide| {
                    go_vectors(LayerNormFwd { x, w: &w, b: &b, eps: 1e-5, y: o, stats }, wide, avx2)
                };
                run(&|o, wide| fwd(o, &mut Vec::new(), wide));
                // The rows' statistics the forward pass keeps: the same bits at every width,
                // and the backward pass given them the same bits as computing them again.
                let stats = |wide| {
                    let mut s = Vec::new();
                    fwd(&mut Vec::new(), &mut s, wide);
                    s
                };
                let kept = stats(true);
                assert_eq!(kept.len(), 2 * (n / d));
                assert!(kept.iter().zip(&stats(false)).all(|(a, b)| a.to_bits() == b.to_bits()));
                for stats in [None, Some(&kept[..])] {
                    run(&|o, wide| go_vectors(LayerNormBwd { x, w: &w, g, eps: 1e-5, stats, out: o }, wide, avx2));
                }
                let bwd = |stats| {
                    let mut o = Vec::new();
                    go_vectors(LayerNormBwd { x, w: &w, g, eps: 1e-5, stats, out: &mut o }, true, avx2);
                    o
                };
                let (again, given) = (bwd(None), bwd(Some(&kept[..])));
                assert!(again.iter().zip(&given).all(|(a, b)| a.to_bits() == b.to_bits()));
            }
        }
        run(&|o, wide| go(CausalSoftmaxFwd { x: &sq, t, y: o }, wide));
        let mut y = Vec::new();
        simd(CausalSoftmaxFwd { x: &sq, t, y: &mut y });
        run(&|o, wide| go(SoftmaxBwd { y: &y, g: &sg, t, d: o }, wide));
    }

    #[test]
    fn gelu_matches_candle_forward_and_backward() {
        check(&[7, 33], gelu, |x| x.gelu());
        // A non-contiguous input is made contiguous first.
        check(&[6, 6], |x| gelu(&x.t()?), |x| x.t()?.gelu());
    }

    #[test]
    fn bias_gelu_matches_the_composed_operations_forward_and_backward() {
        let b = Var::from_tensor(&Tensor::randn(0f32, 1.0, 40, &Device::Cpu).unwrap()).unwrap();
        check(&[3, 7, 40], |h| bias_gelu(h, b.as_tensor()), |h| h.broadcast_add(b.as_tensor())?.gelu());
        let h = Tensor::randn(0f32, 2.0, (9, 40), &Device::Cpu).unwrap();
        let r = Tensor::randn(0f32, 1.0, (9, 40), &Device::Cpu).unwrap();
        let ga = (bias_gelu(&h, b.as_tensor()).unwrap() * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (h.broadcast_add(b.as_tensor()).unwrap().gelu().unwrap() * &r)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        close(ga.get(b.as_tensor()).unwrap(), gb.get(b.as_tensor()).unwrap(), 1e-5);
        let e = bias_gelu(&h, &Tensor::zeros(39, DType::F32, &Device::Cpu).unwrap()).unwrap_err().to_string();
        assert!(e.contains("a bias of shape [39] for rows of 40"), "{e}");
    }

    /// `bias_relu` is candle's `broadcast_add` then `relu` bit for bit, forward and backward
    /// (the input's gradient and the bias'), on shapes with rows shorter than a vector and with
    /// a tail, zeros and negative zeros in the sums, and a 3-axis input; 16-bit inputs take the
    /// composed operations.
    #[test]
    fn bias_relu_is_the_composed_operations_bit_for_bit() {
        let dev = Device::Cpu;
        let bits = |t: &Tensor| {
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        for (shape, d) in [(vec![9usize, 40], 40usize), (vec![3, 7, 17], 17), (vec![1, 1], 1), (vec![300, 2048], 2048)]
        {
            let mut values: Vec<f32> =
                Tensor::randn(0f32, 2.0, shape.as_slice(), &dev).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            for v in values.iter_mut().step_by(5) {
                *v = 0.0;
            }
            let h = Var::from_tensor(&Tensor::from_vec(values, shape.as_slice(), &dev).unwrap()).unwrap();
            let mut bias: Vec<f32> = Tensor::randn(0f32, 1.0, d, &dev).unwrap().to_vec1().unwrap();
            bias[0] = -0.0;
            let b = Var::from_tensor(&Tensor::from_vec(bias, d, &dev).unwrap()).unwrap();
            let mut r: Vec<f32> =
                Tensor::randn(0f32, 1.0, shape.as_slice(), &dev).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            for v in r.iter_mut().step_by(7) {
                *v = -0.0;
            }
            let r = Tensor::from_vec(r, shape.as_slice(), &dev).unwrap();
            let fused = bias_relu(h.as_tensor(), b.as_tensor()).unwrap();
            let composed = h.as_tensor().broadcast_add(b.as_tensor()).unwrap().relu().unwrap();
            assert_eq!(bits(&fused), bits(&composed), "{shape:?} forward");
            let ga = (fused * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let gb = (composed * &r).unwrap().sum_all().unwrap().backward().unwrap();
            for v in [&h, &b] {
                assert_eq!(
                    bits(ga.get(v.as_tensor()).unwrap()),
                    bits(gb.get(v.as_tensor()).unwrap()),
                    "{shape:?} gradient"
                );
            }
        }
        let h = Tensor::randn(0f32, 2.0, (4, 8), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let b = Tensor::randn(0f32, 1.0, 8, &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let (fused, composed) = (bias_relu(&h, &b).unwrap(), h.broadcast_add(&b).unwrap().relu().unwrap());
        assert_eq!(fused.dtype(), DType::BF16);
        assert_eq!(
            fused.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap(),
            composed.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap()
        );
        let e = bias_relu(
            &Tensor::zeros((2, 40), DType::F32, &dev).unwrap(),
            &Tensor::zeros(39, DType::F32, &dev).unwrap(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("a bias of shape [39] for rows of 40"), "{e}");
    }

    #[test]
    fn the_residual_and_bias_in_one_pass_are_candles_add_and_broadcast_add_bit_for_bit() {
        let dev = Device::Cpu;
        let bits = |t: &Tensor| -> Vec<u32> {
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
        };
        let randn = |shape: &[usize]| {
            let mut v: Vec<f32> =
                Tensor::randn(0f32, 1.0, shape, &dev).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            for x in v.iter_mut().step_by(5) {
                *x = -0.0;
            }
            Var::from_tensor(&Tensor::from_vec(v, shape, &dev).unwrap()).unwrap()
        };
        for shape in [vec![1, 1], vec![5, 7], vec![33, 48], vec![300, 17], vec![3, 4, 17]] {
            let d = *shape.last().unwrap();
            let (x, y, b, r) = (randn(&shape), randn(&shape), randn(&[d]), randn(&shape));
            let fused = residual_bias(x.as_tensor(), y.as_tensor(), b.as_tensor()).unwrap();
            let composed = (x.as_tensor() + y.as_tensor().broadcast_add(b.as_tensor()).unwrap()).unwrap();
            assert_eq!(bits(&fused), bits(&composed), "{shape:?} forward");
            let ga = (fused * r.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
            let gb = (composed * r.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
            for v in [&x, &y, &b] {
                let (a, c) = (ga.get(v.as_tensor()).unwrap(), gb.get(v.as_tensor()).unwrap());
                assert_eq!(a.shape(), c.shape(), "{shape:?}");
                assert_eq!(bits(a), bits(c), "{shape:?} gradient");
            }
        }
        // 16-bit types take the composed operations.
        let (x, y) =
            (Tensor::ones((2, 3), DType::BF16, &dev).unwrap(), Tensor::ones((2, 3), DType::BF16, &dev).unwrap());
        let b = Tensor::new(&[1f32, 2.0, 3.0], &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let out = residual_bias(&x, &y, &b).unwrap();
        assert_eq!(out.dtype(), DType::BF16);
        assert_eq!(out.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap(), [[3f32, 4.0, 5.0], [3.0, 4.0, 5.0]]);
        let z = |s: &[usize]| Tensor::zeros(s, DType::F32, &dev).unwrap();
        let e = residual_bias(&z(&[2, 40]), &z(&[2, 40]), &z(&[39])).unwrap_err().to_string();
        assert!(e.contains("a bias of shape [39] for rows of 40"), "{e}");
        let e = residual_bias(&z(&[2, 40]), &z(&[3, 40]), &z(&[40])).unwrap_err().to_string();
        assert!(e.contains("strata-residual-bias: shapes [2, 40] and [3, 40] differ"), "{e}");
    }

    /// The causal softmax kernel, at this CPU's widest vectors and at pulp's scalar level,
    /// against a plain scalar reference of the same arithmetic (each row's first `n` columns:
    /// their maximum, `exp(v - max)`, [`lane_sum`]'s order, the division): the same bits, on
    /// sides below, at and above a vector, with ties, large and tiny scores.
    #[test]
    fn causal_softmax_is_its_scalar_reference_bit_for_bit() {
        for t in [1usize, 2, 13, 16, 17, 31, 32, 33, 64, 100] {
            let mut x: Vec<f32> = Tensor::randn(0f32, 3.0, 3 * t * t, &Device::Cpu).unwrap().to_vec1().unwrap();
            for (i, v) in x.iter_mut().enumerate() {
                match i % 11 {
                    0 => *v = 0.0,
                    1 => *v = -0.0,
                    2 => *v = 80.0,
                    3 => *v = -80.0,
                    _ => {}
                }
            }
            let mut reference = vec![0f32; x.len()];
            for (r, (xr, yr)) in x.chunks_exact(t).zip(reference.chunks_exact_mut(t)).enumerate() {
                let n = r % t + 1;
                let whole = (n.div_ceil(LANES) * LANES).min(t);
                let max = xr[..n].iter().copied().fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m });
                for j in 0..n {
                    yr[j] = exp(xr[j] - max);
                }
                let sum = lane_sum(&yr[..whole], |y| y);
                for y in &mut yr[..n] {
                    *y /= sum;
                }
            }
            for wide in [true, false] {
                let mut y = Vec::new();
                let k = CausalSoftmaxFwd { x: &x, t, y: &mut y };
                if wide {
                    simd(k)
                } else {
                    pulp::Simd::vectorize(pulp::Scalar::new(), Dispatch(k))
                }
                let wrong = y.iter().zip(&reference).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                assert_eq!(wrong, 0, "t = {t}, wide = {wide}");
            }
        }
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

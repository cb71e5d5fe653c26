//! GELU's loops, forward and backward, with and without a bias, in explicit vectors of `S`,
//! [`CHAINS`] vectors a step.
//!
//! Each element's GELU is a chain of about twenty dependent operations (the inner argument, the
//! tanh's two polynomials, a division), some 70 cycles long. Compiled from the scalar
//! functions ([`gelu1`], [`gelu1_grad`]) the loop took one vector a step, and
//! the CPU's schedulers, which hold a few dozen waiting operations, kept only two or three
//! steps' chains in flight: the loop ran at the chains' latency, about 17 cycles a vector of 8
//! on AVX2 (2.2 cycles an element), where its multiplications alone would take about 9 on two
//! FMA pipes. Here each operation is written for [`CHAINS`] independent vectors one after
//! another, so that the chains advance side by side: bias + GELU 1.4-1.6x faster forward and
//! 1.33-1.44x both ways on AVX2 (`strata bench kernels`, record
//! `docs/bench/2026-12-07-1616-gelu-chains.md`), unchanged on AVX-512. Every lane takes the
//! scalar functions' operations in their order, so the bits are theirs at every vector width
//! (tested below against the scalar functions, at the widest width, AVX2 and the scalar path).

use super::vector::{load, VectorKernel};

const SQRT_TWO_OVER_PI: f32 = 0.797_884_6;
const GELU_A: f32 = 0.044_715;

/// `tanh(x)` as a rational function of `x` (Eigen's `ptanh_float`: degree 13 over 6, the input
/// clamped to +-7.9, where f32's tanh is +-1), within a few ulp of libm's `tanhf` and about ten
/// times faster: pure arithmetic, so the loops over a tensor vectorize. libm's `tanhf` was a
/// quarter of a transformer step here. Horner's steps are fused multiply-adds, as in `exp`.
#[inline(always)]
pub(super) fn tanh(x: f32) -> f32 {
    // No branch for small `x` (Eigen returns `x` below 0.0004): there `p / q` is 1 within
    // 1e-7, and the branch was three more vector operations in a loop the divider and the
    // multiply-adds' latency already bound.
    let x = x.clamp(-TANH_CLAMP, TANH_CLAMP);
    let x2 = x * x;
    let mut p = x2.mul_add(TANH_P[0], TANH_P[1]);
    for &a in &TANH_P[2..] {
        p = x2.mul_add(p, a);
    }
    let mut q = x2.mul_add(TANH_Q[0], TANH_Q[1]);
    for &b in &TANH_Q[2..] {
        q = x2.mul_add(q, b);
    }
    x * p / q
}

/// Where [`tanh`] clamps its input: f32's tanh is +-1 beyond.
const TANH_CLAMP: f32 = 7.905_311;

/// [`tanh`]'s numerator, `x` times a polynomial in `x^2`, its coefficients from the highest.
const TANH_P: [f32; 7] =
    [-2.760_768_5e-16, 2.000_188e-13, -8.604_672e-11, 5.122_297e-8, 1.485_722_4e-5, 6.372_619_3e-4, 4.893_524_6e-3];

/// [`tanh`]'s denominator, a polynomial in `x^2`, its coefficients from the highest.
const TANH_Q: [f32; 4] = [1.198_258_4e-6, 1.185_347_1e-4, 2.268_434_6e-3, 4.893_525e-3];

/// GELU's inner argument, `sqrt(2 / pi) (v + 0.044715 v^3)`.
#[inline(always)]
fn gelu_inner(v: f32) -> f32 {
    SQRT_TWO_OVER_PI * v * (GELU_A * v).mul_add(v, 1.0)
}

/// GELU, tanh approximation, as candle's `gelu` computes it (within rounding: fused
/// multiply-adds where it takes a product and a sum).
#[inline(always)]
pub(super) fn gelu1(v: f32) -> f32 {
    let h = 0.5 * v;
    h.mul_add(tanh(gelu_inner(v)), h)
}

/// The derivative of [`gelu1`].
#[inline(always)]
pub(super) fn gelu1_grad(v: f32) -> f32 {
    let t = tanh(gelu_inner(v));
    let inner = SQRT_TWO_OVER_PI * (3.0 * GELU_A * v).mul_add(v, 1.0);
    (0.5 * v * t.mul_add(-t, 1.0)).mul_add(inner, t.mul_add(0.5, 0.5))
}

/// `[f(0), .., f(K - 1)]` for vectors of `S`, in a loop: `std::array::from_fn` and `map` take
/// a closure, which is compiled outside the kernel's vector instructions, and each operation
/// in it was a call.
macro_rules! each {
    ($s:expr, $n:expr, |$k:ident| $e:expr) => {{
        let mut out = [$s.splat_f32s(0.0); $n];
        for $k in 0..$n {
            out[$k] = $e;
        }
        out
    }};
}

/// Vectors each step takes together (see the module's comment).
const CHAINS: usize = 4;

/// The GELU functions on `K` vectors of `S` at a time, each operation taken for all `K` before
/// the next.
#[derive(Clone, Copy)]
struct Gelus<S: pulp::Simd> {
    simd: S,
}

impl<S: pulp::Simd> Gelus<S> {
    const LANES: usize = std::mem::size_of::<S::f32s>() / 4;

    #[inline(always)]
    fn c(self, v: f32) -> S::f32s {
        self.simd.splat_f32s(v)
    }

    /// [`tanh`].
    #[inline(always)]
    fn tanh<const K: usize>(self, x: [S::f32s; K]) -> [S::f32s; K] {
        let s = self.simd;
        let (lo, hi) = (self.c(-TANH_CLAMP), self.c(TANH_CLAMP));
        // A maximum and a minimum (one operation each where a comparison and a selection are
        // two), `x` second: on x86 a NaN stays one, as in `clamp` (on the scalar path, where
        // `f32::max` drops it, the result is NaN all the same: the NaN is in `v` too).
        let x = each!(s, K, |k| s.min_f32s(hi, s.max_f32s(lo, x[k])));
        let x2 = each!(s, K, |k| s.mul_f32s(x[k], x[k]));
        let mut p = each!(s, K, |k| s.mul_add_f32s(x2[k], self.c(TANH_P[0]), self.c(TANH_P[1])));
        let mut q = each!(s, K, |k| s.mul_add_f32s(x2[k], self.c(TANH_Q[0]), self.c(TANH_Q[1])));
        for (i, &a) in TANH_P[2..].iter().enumerate() {
            p = each!(s, K, |k| s.mul_add_f32s(x2[k], p[k], self.c(a)));
            if let Some(&b) = TANH_Q.get(i + 2) {
                q = each!(s, K, |k| s.mul_add_f32s(x2[k], q[k], self.c(b)));
            }
        }
        each!(s, K, |k| s.div_f32s(s.mul_f32s(x[k], p[k]), q[k]))
    }

    /// [`gelu_inner`].
    #[inline(always)]
    fn inner<const K: usize>(self, v: [S::f32s; K]) -> [S::f32s; K] {
        let s = self.simd;
        let a = each!(s, K, |k| s.mul_add_f32s(s.mul_f32s(self.c(GELU_A), v[k]), v[k], self.c(1.0)));
        each!(s, K, |k| s.mul_f32s(s.mul_f32s(self.c(SQRT_TWO_OVER_PI), v[k]), a[k]))
    }

    /// [`gelu1`].
    #[inline(always)]
    fn gelu<const K: usize>(self, v: [S::f32s; K]) -> [S::f32s; K] {
        let s = self.simd;
        let t = self.tanh(self.inner(v));
        let h = each!(s, K, |k| s.mul_f32s(self.c(0.5), v[k]));
        each!(s, K, |k| s.mul_add_f32s(h[k], t[k], h[k]))
    }

    /// `g * `[`gelu1_grad`]`(v)`.
    #[inline(always)]
    fn grad<const K: usize>(self, v: [S::f32s; K], g: [S::f32s; K]) -> [S::f32s; K] {
        let s = self.simd;
        let t = self.tanh(self.inner(v));
        let a = each!(s, K, |k| s.mul_add_f32s(s.mul_f32s(self.c(3.0 * GELU_A), v[k]), v[k], self.c(1.0)));
        let slope = each!(s, K, |k| s.mul_f32s(self.c(SQRT_TWO_OVER_PI), a[k]));
        let left = each!(s, K, |k| {
            let one_less = s.mul_add_f32s(t[k], s.xor_f32s(t[k], self.c(-0.0)), self.c(1.0));
            s.mul_f32s(s.mul_f32s(self.c(0.5), v[k]), one_less)
        });
        let d = each!(s, K, |k| s.mul_add_f32s(left[k], slope[k], s.mul_add_f32s(t[k], self.c(0.5), self.c(0.5))));
        each!(s, K, |k| s.mul_f32s(g[k], d[k]))
    }
}

/// The `K` vectors of `x` from `at`.
#[inline(always)]
fn vectors<S: pulp::Simd, const K: usize>(simd: S, x: &[f32], at: usize) -> [S::f32s; K] {
    each!(simd, K, |k| load::<S>(&x[at + k * Gelus::<S>::LANES..]))
}

/// `K` vectors as the f32 they hold.
#[inline(always)]
fn elements<S: pulp::Simd, const K: usize>(x: &[S::f32s; K]) -> &[f32] {
    pulp::bytemuck::cast_slice(x.as_slice())
}

/// A loop body over a span of elements, on `K` vectors from a start or on one element.
trait Step<S: pulp::Simd> {
    fn vectors<const K: usize>(&mut self, g: Gelus<S>, at: usize);
    fn element(&mut self, at: usize);
}

/// Runs `step` over `len` elements: [`CHAINS`] vectors at a time, then one vector at a time,
/// then one element at a time, in the order of the elements.
#[inline(always)]
fn steps<S: pulp::Simd>(simd: S, len: usize, mut step: impl Step<S>) {
    let g = Gelus { simd };
    let (wide, lanes) = (CHAINS * Gelus::<S>::LANES, Gelus::<S>::LANES);
    let (wide_end, vector_end) = (len / wide * wide, len / lanes * lanes);
    for at in (0..wide_end).step_by(wide) {
        step.vectors::<CHAINS>(g, at);
    }
    for at in (wide_end..vector_end).step_by(lanes) {
        step.vectors::<1>(g, at);
    }
    for at in vector_end..len {
        step.element(at);
    }
}

/// `y = gelu(x)`, appended.
pub(super) struct GeluFwd<'a> {
    pub(super) x: &'a [f32],
    pub(super) y: &'a mut Vec<f32>,
}

impl<S: pulp::Simd> Step<S> for GeluFwd<'_> {
    #[inline(always)]
    fn vectors<const K: usize>(&mut self, g: Gelus<S>, at: usize) {
        self.y.extend_from_slice(elements::<S, K>(&g.gelu(vectors::<S, K>(g.simd, self.x, at))));
    }

    #[inline(always)]
    fn element(&mut self, at: usize) {
        self.y.push(gelu1(self.x[at]));
    }
}

impl VectorKernel for GeluFwd<'_> {
    #[inline(always)]
    fn run<S: pulp::Simd>(self, simd: S) {
        self.y.reserve(self.x.len());
        steps(simd, self.x.len(), self);
    }
}

/// `d = g * gelu'(x)`, appended.
pub(super) struct GeluBwd<'a> {
    pub(super) x: &'a [f32],
    pub(super) g: &'a [f32],
    pub(super) d: &'a mut Vec<f32>,
}

impl<S: pulp::Simd> Step<S> for GeluBwd<'_> {
    #[inline(always)]
    fn vectors<const K: usize>(&mut self, g: Gelus<S>, at: usize) {
        let d = g.grad(vectors::<S, K>(g.simd, self.x, at), vectors::<S, K>(g.simd, self.g, at));
        self.d.extend_from_slice(elements::<S, K>(&d));
    }

    #[inline(always)]
    fn element(&mut self, at: usize) {
        self.d.push(self.g[at] * gelu1_grad(self.x[at]));
    }
}

impl VectorKernel for GeluBwd<'_> {
    #[inline(always)]
    fn run<S: pulp::Simd>(self, simd: S) {
        let n = self.x.len().min(self.g.len());
        self.d.reserve(n);
        steps(simd, n, self);
    }
}

/// `y = gelu(h + b)` row by row, `b` of the rows' length: a dense layer's bias and GELU.
pub(super) struct BiasGeluFwd<'a> {
    pub(super) h: &'a [f32],
    pub(super) b: &'a [f32],
    pub(super) y: &'a mut Vec<f32>,
}

/// One row of [`BiasGeluFwd`].
struct BiasGeluRow<'a, 'y> {
    h: &'a [f32],
    b: &'a [f32],
    y: &'y mut Vec<f32>,
}

impl<S: pulp::Simd> Step<S> for BiasGeluRow<'_, '_> {
    #[inline(always)]
    fn vectors<const K: usize>(&mut self, g: Gelus<S>, at: usize) {
        let (h, b) = (vectors::<S, K>(g.simd, self.h, at), vectors::<S, K>(g.simd, self.b, at));
        let v = each!(g.simd, K, |k| g.simd.add_f32s(h[k], b[k]));
        self.y.extend_from_slice(elements::<S, K>(&g.gelu(v)));
    }

    #[inline(always)]
    fn element(&mut self, at: usize) {
        self.y.push(gelu1(self.h[at] + self.b[at]));
    }
}

impl VectorKernel for BiasGeluFwd<'_> {
    #[inline(always)]
    fn run<S: pulp::Simd>(self, simd: S) {
        let (b, d) = (self.b, self.b.len().max(1));
        self.y.reserve(self.h.len() / d * d);
        for h in self.h.chunks_exact(d) {
            steps(simd, b.len(), BiasGeluRow { h, b, y: &mut *self.y });
        }
    }
}

/// Appends `(rows + 1, d)`: the rows of `dh = g * gelu'(h + b)`, then `db` (their sum over
/// rows, from 0 and row by row: the order of candle's sum over a batch's rows, so the same
/// bits).
pub(super) struct BiasGeluBwd<'a> {
    pub(super) h: &'a [f32],
    pub(super) b: &'a [f32],
    pub(super) g: &'a [f32],
    pub(super) out: &'a mut Vec<f32>,
}

/// One row of [`BiasGeluBwd`], adding into the bias' gradient `db`.
struct BiasGeluGradRow<'a, 'o> {
    h: &'a [f32],
    b: &'a [f32],
    g: &'a [f32],
    db: &'o mut [f32],
    out: &'o mut Vec<f32>,
}

impl<S: pulp::Simd> Step<S> for BiasGeluGradRow<'_, '_> {
    #[inline(always)]
    fn vectors<const K: usize>(&mut self, gs: Gelus<S>, at: usize) {
        let s = gs.simd;
        let (h, b) = (vectors::<S, K>(s, self.h, at), vectors::<S, K>(s, self.b, at));
        let v = each!(s, K, |k| s.add_f32s(h[k], b[k]));
        let dh = gs.grad(v, vectors::<S, K>(s, self.g, at));
        let db = vectors::<S, K>(s, self.db, at);
        let db = each!(s, K, |k| s.add_f32s(db[k], dh[k]));
        let n = K * Gelus::<S>::LANES;
        self.db[at..at + n].copy_from_slice(elements::<S, K>(&db));
        self.out.extend_from_slice(elements::<S, K>(&dh));
    }

    #[inline(always)]
    fn element(&mut self, at: usize) {
        let dh = self.g[at] * gelu1_grad(self.h[at] + self.b[at]);
        self.db[at] += dh;
        self.out.push(dh);
    }
}

impl VectorKernel for BiasGeluBwd<'_> {
    #[inline(always)]
    fn run<S: pulp::Simd>(self, simd: S) {
        let (b, d) = (self.b, self.b.len().max(1));
        let mut db = vec![0f32; d];
        self.out.reserve(self.h.len() / d * d + b.len());
        for (h, g) in self.h.chunks_exact(d).zip(self.g.chunks_exact(d)) {
            steps(simd, b.len(), BiasGeluGradRow { h, b, g, db: &mut db, out: &mut *self.out });
        }
        self.out.extend_from_slice(&db);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::vector::{simd_vectors, VectorDispatch};

    /// Random values, with the edges mixed in: zeros of both signs, values past the tanh's
    /// clamp, huge and tiny ones, infinities and a NaN.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let edges = [0.0, -0.0, 7.9, -7.9, 8.5, -30.0, 1e30, -1e30, 1e-40, f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if i % 17 == 5 {
                    edges[(x % edges.len() as u64) as usize]
                } else {
                    (x >> 40) as f32 / (1u64 << 24) as f32 * 12.0 - 6.0
                }
            })
            .collect()
    }

    /// The kernel's output at every width this CPU runs.
    fn at_every_width(run: impl Fn(&mut Vec<f32>, Width)) -> Vec<Vec<f32>> {
        let mut widths = vec![Width::Widest, Width::Scalar];
        #[cfg(target_arch = "x86_64")]
        if pulp::x86::V3::try_new().is_some() {
            widths.push(Width::Avx2);
        }
        widths
            .into_iter()
            .map(|w| {
                let mut out = Vec::new();
                run(&mut out, w);
                out
            })
            .collect()
    }

    /// Where a kernel runs: compiled for the widest vectors, for AVX2, for the scalar path.
    #[derive(Clone, Copy)]
    enum Width {
        Widest,
        Avx2,
        Scalar,
    }

    fn go(k: impl VectorKernel, w: Width) {
        match w {
            Width::Widest => simd_vectors(k),
            #[cfg(target_arch = "x86_64")]
            Width::Avx2 => pulp::Simd::vectorize(pulp::x86::V3::try_new().expect("AVX2"), VectorDispatch(k)),
            #[cfg(not(target_arch = "x86_64"))]
            Width::Avx2 => simd_vectors(k),
            Width::Scalar => pulp::Simd::vectorize(pulp::Scalar::new(), VectorDispatch(k)),
        }
    }

    /// The same bits, NaN for NaN.
    fn same(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "{what}: element {i}: {a} for {b}");
        }
    }

    #[test]
    fn the_gelu_kernels_are_the_scalar_functions_bit_for_bit_at_every_width() {
        // Row widths of whole steps of 4 vectors, of single vectors and of tails, at 8 and 16
        // lanes; one element; none.
        for d in [512, 64, 48, 53, 7, 1, 0] {
            let rows = 5;
            let (h, g, b) = (values(rows * d, 1 + d as u64), values(rows * d, 2), values(d, 3));
            let sum = |i: usize| h[i] + b[i % d.max(1)];
            let fwd: Vec<f32> = (0..h.len()).map(|i| gelu1(h[i])).collect();
            let bwd: Vec<f32> = (0..h.len()).map(|i| g[i] * gelu1_grad(h[i])).collect();
            let bias_fwd: Vec<f32> = (0..h.len()).map(|i| gelu1(sum(i))).collect();
            let mut bias_bwd: Vec<f32> = (0..h.len()).map(|i| g[i] * gelu1_grad(sum(i))).collect();
            let mut db = vec![0f32; d.max(1)];
            for row in bias_bwd.chunks_exact(d.max(1)) {
                for (db, &x) in db.iter_mut().zip(row) {
                    *db += x;
                }
            }
            bias_bwd.extend(&db);
            let what = |k: &str| format!("{k} at a width of {d}");
            for out in at_every_width(|y, w| go(GeluFwd { x: &h, y }, w)) {
                same(&out, &fwd, &what("gelu"));
            }
            for out in at_every_width(|d, w| go(GeluBwd { x: &h, g: &g, d }, w)) {
                same(&out, &bwd, &what("gelu's gradient"));
            }
            for out in at_every_width(|y, w| go(BiasGeluFwd { h: &h, b: &b, y }, w)) {
                same(&out, &bias_fwd, &what("bias + gelu"));
            }
            for out in at_every_width(|o, w| go(BiasGeluBwd { h: &h, b: &b, g: &g, out: o }, w)) {
                same(&out, &bias_bwd, &what("bias + gelu's gradient"));
            }
        }
    }
}

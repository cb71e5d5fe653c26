//! STRATA PATCH: f32 products `A B` with both operands row-major and a long inner dimension,
//! on x86-64 CPUs with AVX2 and FMA, where gemm's AVX-512 kernels are not in use.
//!
//! Given a row-major `B` (`x.matmul(&w)` for a weight stored `(in, out)`, and the input's
//! gradient of candle-nn's `Linear`), gemm transposes the whole problem and packs `B^T` a
//! column of 16 floats at a time, one cache line from each of `k` rows `n` floats apart. With
//! `n` a power of two those reads and the packed writes fall on the same few cache sets, and
//! gemm's AVX2 kernels ran the 4.3M MLP's hidden forward product (128 x 2048 by 2048 x 2048) at
//! 68-69% of the FMA peak of one AMD EPYC core. Here both operands are packed as BLIS does it,
//! `B` by whole rows into panels of 16 columns whose starts are not a power of two apart, `A`
//! into panels of 6 rows; a 6 x 16 microkernel keeps its tile in twelve registers. Same machine
//! and shape, alternated: 80-84% of the peak (docs/bench/2026-12-07-1100-rows-gemm.md).
//!
//! The order of every sum is fixed by `k` alone: each element is, block by block of [`KC`]
//! along the inner dimension, a chain of fused multiply-adds from zero in the order of `k`,
//! the blocks' chains added in order. It does not depend on `m`, `n`, the tile an element is
//! in, or the number of threads (threads split the columns), so a replica's product of half
//! the rows gives the bits of the same rows in a product of all of them. `reference` computes
//! the same order with scalar code; the tests compare the two bit for bit.

/// The inner dimension's block: each element's sum is a chain over this many terms at most,
/// then added to the blocks before it.
pub const KC: usize = 256;
const MR: usize = 6;
const NR: usize = 16;
/// Rows of `A` packed at once (about 240 KiB with [`KC`]).
const MC: usize = 240;
/// Floats between two packed panels of `B` beyond their `kb * NR`: panels a power of two apart
/// make packing's stores share cache sets with its loads.
const PAD: usize = 32;

/// Whether candle's CPU backend computes an `m x n` by `k` product whose operands have these
/// column strides with [`matmul`]: both row-major, `k` and `n` at least 512, more than one row,
/// and this CPU has AVX2 and FMA ([`available`]) while gemm's AVX-512 kernels are not in use
/// (a build without candle-core's `gemm-x86-v4` feature, or a CPU without AVX-512). The rule
/// reads `m` only to leave one-row products to gemm's matrix-vector code, as gemm does.
pub fn applies(m: usize, n: usize, k: usize, lhs_cs: usize, rhs_cs: usize) -> bool {
    m > 1 && k >= 512 && n >= 512 && lhs_cs == 1 && rhs_cs == 1 && available() && !gemm_avx512()
}

/// Whether this CPU has what the kernel needs (x86-64 with AVX2 and FMA).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether gemm runs its AVX-512 kernels here (its `x86-v4` feature and an AVX-512 CPU).
pub(crate) fn gemm_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        cfg!(feature = "gemm-x86-v4") && std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `c = a b`: `a` is `m x k` with rows `lda` apart, `b` is `k x n` with rows `ldb` apart and `c`
/// is `m x n`, row-major and contiguous. Writes every element of `c`, which may be memory not
/// yet written. With `threads > 1` the columns are split between rayon's threads.
///
/// Panics unless [`available`], every dimension is above zero and the slices hold what the
/// shapes say.
pub fn matmul(
    (m, n, k): (usize, usize, usize),
    (a, lda): (&[f32], usize),
    (b, ldb): (&[f32], usize),
    c: &mut [std::mem::MaybeUninit<f32>],
    threads: usize,
) {
    assert!(available(), "rows_gemm::matmul on a CPU without AVX2 and FMA");
    assert!(m > 0 && k > 0 && n > 0);
    assert!(a.len() >= (m - 1) * lda + k && lda >= k);
    assert!(b.len() >= (k - 1) * ldb + n && ldb >= n);
    assert!(c.len() >= m * n);
    #[cfg(target_arch = "x86_64")]
    {
        let parts = threads.clamp(1, n.div_ceil(NR));
        let width = n.div_ceil(NR).div_ceil(parts) * NR;
        let dst = Dst(c.as_mut_ptr().cast::<f32>());
        let run = |j0: usize| {
            let nb = width.min(n - j0);
            // SAFETY: AVX2 and FMA are available (asserted above); the operands hold the
            // shapes (asserted above); the parts write disjoint columns `j0..j0 + nb` of `c`.
            unsafe { x86::gemm(m, nb, k, a, lda, &b[j0..], ldb, dst.column(j0), n) }
        };
        if parts == 1 {
            run(0);
        } else {
            use rayon::prelude::*;
            (0..n).step_by(width).collect::<Vec<_>>().into_par_iter().for_each(|j0| run(j0));
        }
    }
}

/// [`matmul`] into a new vector: the product of `a` (`m x k`, rows `lda` apart) and `b` (`k x n`,
/// rows `ldb` apart), row-major.
pub fn product(shape: (usize, usize, usize), a: (&[f32], usize), b: (&[f32], usize), threads: usize) -> Vec<f32> {
    let (m, n, _) = shape;
    let mut c = Vec::with_capacity(m * n);
    matmul(shape, a, b, &mut c.spare_capacity_mut()[..m * n], threads);
    // SAFETY: `matmul` wrote all m * n elements.
    unsafe { c.set_len(m * n) };
    c
}

/// The destination of [`matmul`]'s parts, which write disjoint columns of it.
#[derive(Clone, Copy)]
struct Dst(*mut f32);

impl Dst {
    /// Column `j` of the destination's first row (a method, so that closures capture the
    /// whole `Dst`, which is `Sync`, and not its pointer).
    fn column(self, j: usize) -> *mut f32 {
        self.0.wrapping_add(j)
    }
}
// SAFETY: each part writes only its own columns of the destination (see `matmul`).
unsafe impl Send for Dst {}
// SAFETY: as above.
unsafe impl Sync for Dst {}

/// `c = a b` in [`matmul`]'s order of sums, with scalar code: the reference the tests check
/// the kernel against, bit for bit.
pub fn reference(m: usize, n: usize, k: usize, a: &[f32], lda: usize, b: &[f32], ldb: usize) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut total = 0f32;
            for p0 in (0..k).step_by(KC) {
                let mut s = 0f32;
                for p in p0..(p0 + KC).min(k) {
                    s = a[i * lda + p].mul_add(b[p * ldb + j], s);
                }
                total = if p0 == 0 { s } else { total + s };
            }
            c[i * n + j] = total;
        }
    }
    c
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{KC, MC, MR, NR, PAD};
    use std::arch::x86_64::*;
    use std::cell::RefCell;

    thread_local! {
        /// Each thread's packing buffers, kept between calls up to [`KEEP`] floats.
        static PACKED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }

    /// The most floats a thread keeps packed between calls (8 MiB: the 4.3M MLP's products need
    /// 2.1 MiB); a product with more columns (a vocabulary of 50,000 needs 52 MiB) allocates its
    /// buffer for the call and frees it after.
    const KEEP: usize = 2 << 20;

    /// `c = a b` for the `m x n` block of `c` at `c` (rows `ldc` apart).
    ///
    /// # Safety
    /// AVX2 and FMA must be available, `a` and `b` must hold the shapes, and `c` must point to
    /// `m` rows of `n` writable floats, `ldc` apart.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn gemm(m: usize, n: usize, k: usize, a: &[f32], lda: usize, b: &[f32], ldb: usize, c: *mut f32, ldc: usize) {
        let panels = n.div_ceil(NR);
        let stride = KC * NR + PAD;
        let a_len = MC.min(m).div_ceil(MR) * MR * KC;
        PACKED.with(|packed| {
            let mut packed = packed.borrow_mut();
            if packed.len() < panels * stride + a_len {
                packed.resize(panels * stride + a_len, 0.0);
            }
            let (pb, pa) = packed.split_at_mut(panels * stride);
            for p0 in (0..k).step_by(KC) {
                let kb = KC.min(k - p0);
                pack_b(&b[p0 * ldb..], ldb, kb, n, stride, pb);
                for i0 in (0..m).step_by(MC) {
                    let mb = MC.min(m - i0);
                    pack_a(&a[i0 * lda + p0..], lda, mb, kb, pa);
                    for jp in 0..panels {
                        let nr = NR.min(n - jp * NR);
                        let bp = pb[jp * stride..][..kb * NR].as_ptr();
                        let mut i = 0;
                        while i < mb {
                            let mr = MR.min(mb - i);
                            let ap = pa[i * kb..][..kb * MR].as_ptr();
                            // SAFETY: the caller's contract covers rows i0 + i.. of `c`, and
                            // columns jp * NR..jp * NR + nr are inside its n.
                            let cp = unsafe { c.add((i0 + i) * ldc + jp * NR) };
                            let t = Tile { kb, a: ap, b: bp, c: cp, ldc, nr, first: p0 == 0 };
                            // SAFETY: AVX2 and FMA (the caller's contract); the panels hold kb
                            // steps of MR and NR floats.
                            unsafe {
                                match mr {
                                    6 => tile::<6>(t),
                                    5 => tile::<5>(t),
                                    4 => tile::<4>(t),
                                    3 => tile::<3>(t),
                                    2 => tile::<2>(t),
                                    _ => tile::<1>(t),
                                }
                            }
                            i += mr;
                        }
                    }
                }
            }
            if packed.len() > KEEP {
                *packed = Vec::new();
            }
        })
    }

    /// Rows `0..kb` of `b` (each `n` long, `ldb` apart) into panels of NR columns `stride`
    /// apart, row p of a panel at `p * NR`; the last panel's missing columns are zeros.
    fn pack_b(b: &[f32], ldb: usize, kb: usize, n: usize, stride: usize, out: &mut [f32]) {
        let full = n / NR;
        for p in 0..kb {
            let row = &b[p * ldb..][..n];
            for (jp, src) in row.chunks_exact(NR).enumerate() {
                let d: &mut [f32; NR] = (&mut out[jp * stride + p * NR..][..NR]).try_into().unwrap();
                *d = src.try_into().unwrap();
            }
            let rest = n - full * NR;
            if rest > 0 {
                let d = &mut out[full * stride + p * NR..][..NR];
                d[..rest].copy_from_slice(&row[full * NR..]);
                d[rest..].fill(0.0);
            }
        }
    }

    /// Rows `0..mb`, columns `0..kb` of `a` (rows `lda` apart) into panels of MR rows, each
    /// `kb * MR` (row r of step p at `p * MR + r`). A last panel of fewer rows is read only for
    /// the rows it has ([`tile`] with `R` below MR).
    fn pack_a(a: &[f32], lda: usize, mb: usize, kb: usize, out: &mut [f32]) {
        for (ip, panel) in out.chunks_mut(kb * MR).take(mb.div_ceil(MR)).enumerate() {
            let rows = MR.min(mb - ip * MR);
            for r in 0..rows {
                let src = &a[(ip * MR + r) * lda..][..kb];
                for (p, &x) in src.iter().enumerate() {
                    panel[p * MR + r] = x;
                }
            }
        }
    }

    /// One microkernel call: an `R x nr` tile of `c` from `kb` steps of packed panels.
    #[derive(Clone, Copy)]
    struct Tile {
        kb: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        nr: usize,
        /// The first block of the inner dimension: store, else add to what `c` holds.
        first: bool,
    }

    /// # Safety
    /// AVX2 and FMA must be available; `t.a` must hold `kb * MR` floats, `t.b` `kb * NR`, and
    /// `t.c` `R` rows of `t.nr` floats, `t.ldc` apart.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const R: usize>(t: Tile) {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for p in 0..t.kb {
            // SAFETY: p < kb, inside both panels (the contract).
            unsafe {
                let b0 = _mm256_loadu_ps(t.b.add(p * NR));
                let b1 = _mm256_loadu_ps(t.b.add(p * NR + 8));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let x = _mm256_broadcast_ss(&*t.a.add(p * MR + r));
                    acc[0] = _mm256_fmadd_ps(x, b0, acc[0]);
                    acc[1] = _mm256_fmadd_ps(x, b1, acc[1]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            // SAFETY: row r < R of the tile, columns 0..nr (the contract).
            unsafe {
                let cp = t.c.add(r * t.ldc);
                if t.nr == NR {
                    let (mut x0, mut x1) = (acc[0], acc[1]);
                    if !t.first {
                        x0 = _mm256_add_ps(_mm256_loadu_ps(cp), x0);
                        x1 = _mm256_add_ps(_mm256_loadu_ps(cp.add(8)), x1);
                    }
                    _mm256_storeu_ps(cp, x0);
                    _mm256_storeu_ps(cp.add(8), x1);
                } else {
                    let mut row = [0f32; NR];
                    _mm256_storeu_ps(row.as_mut_ptr(), acc[0]);
                    _mm256_storeu_ps(row.as_mut_ptr().add(8), acc[1]);
                    for (j, &x) in row.iter().enumerate().take(t.nr) {
                        *cp.add(j) = if t.first { x } else { *cp.add(j) + x };
                    }
                }
            }
        }
    }
}

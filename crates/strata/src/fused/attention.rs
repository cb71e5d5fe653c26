//! Causal multi-head attention, forward and backward, one `(example, head)` at a time: the
//! scores, the causal softmax and the weighted sum of the values in buffers that stay in the
//! core's L1 and L2 caches, and only the products below the diagonal computed.
//!
//! Composed from candle's operations, a head's queries, keys and values are first copied out of
//! the `(n t, width)` projections into `(n, heads, t, hd)` tensors, the scores and the softmax
//! are `(n, heads, t, t)` tensors written to memory and read back, the products cover the whole
//! `t x t` square of which the mask then zeroes half, and the output is copied back into
//! `(n t, width)`; the backward pass does all of it again in reverse with four more products.
//! Here each head reads its columns of the projections in place and writes its columns of the
//! result, and the scores are computed transposed (`S^T = K Q^T`), so that the softmax runs
//! down columns, one position per vector lane: the maximum, the exps, their sum and the
//! division are whole-vector operations, with no sum across lanes (a row's softmax over its
//! 1 to 64 columns spent most of its time in those). The operation keeps each head's
//! probabilities, `(tp, tp)` with `tp` the positions rounded up to 32, for its backward pass (as
//! the composed operations keep theirs): computing them again there instead, as FlashAttention
//! does, made the transformer's step about 5% slower here. They are held by the operation, not
//! by a tensor of the graph, so [`strata_core::Footprint`] does not count them: 2 MiB a layer
//! for the benchmark transformer's 32 windows of 64 positions and 4 heads.
//!
//! Every product is computed in tiles of 4 rows by 32 columns (AVX-512) or 16 (AVX2 and
//! narrower) in explicit SIMD ([`tile`]), each element one chain of fused multiply-adds in the
//! order of its inner index from 0, and the softmax's sums in the order of the position: the
//! same bits on AVX-512, AVX2 and the scalar fallback (tested, against a scalar reference, bit
//! for bit). The orders differ from gemm's and from the row softmax's, and the products skip
//! the terms the mask makes 0, so the results differ from the composed operations within
//! rounding (tested within 1e-5, forward and backward).

use std::ops::Range;

use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Storage, Tensor};

use super::{f32_only, fusable, LANES};

/// Rows of a tile.
const R: usize = 4;

/// The padded sizes are multiples of this: a tile's widest column span.
const PAD: usize = 32;

/// A left factor: `a(i, kk) = data[i * rs + kk * cs]`, rows past `last` read as row `last` (the
/// rows of a last, partial group of `R`, whose results are not used).
#[derive(Clone, Copy)]
struct Factor<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
    last: usize,
    transposed: bool,
}

impl<'a> Factor<'a> {
    /// The matrix whose rows are `m`'s, up to row `last`.
    fn rows(m: Rows<'a>, last: usize) -> Self {
        Self { data: m.data, rs: m.rs, cs: 1, last, transposed: false }
    }

    /// The transpose of the matrix whose rows are `m`'s.
    fn transposed(m: Rows<'a>) -> Self {
        Self { data: m.data, rs: 1, cs: m.rs, last: usize::MAX, transposed: true }
    }
}

/// A row-major matrix: element `(row, col)` at `data[row * rs + col]`.
#[derive(Clone, Copy)]
struct Rows<'a> {
    data: &'a [f32],
    rs: usize,
}

/// `c[i][c0..c0 + V * lanes]` for the `R` rows `i` from `i0` (rows of `c_rs`): the sum over the
/// inner index `kk` of `a(i, kk) * b[kk][c0..c0 + V * lanes]`, `a` yielding each `kk`'s `R`
/// values and `b` each `kk`'s row from column `c0`; each element a chain of fused multiply-adds
/// in the order of `kk`, from 0. `R x V` vector registers of sums.
#[inline(always)]
fn tile<'b, S: pulp::Simd, const V: usize>(
    simd: S,
    a: impl Iterator<Item = [f32; R]>,
    b: impl Iterator<Item = &'b [f32]>,
    c: &mut [f32],
    c_rs: usize,
    (i0, c0): (usize, usize),
) {
    let lanes = std::mem::size_of::<S::f32s>() / 4;
    let mut acc = [[simd.splat_f32s(0.0); V]; R];
    // `b` first: its row's bounds check ends a basic block, and with `a`'s loads before it the
    // broadcasts, in the next block, could not take their loads along (each was a scalar load
    // and a register broadcast, which takes a slot of the FMA pipes); after it, each broadcast
    // is one load from memory.
    for (br, av) in b.zip(a) {
        let br = &br[..V * lanes];
        let bv: [S::f32s; V] = std::array::from_fn(|v| super::load::<S>(&br[v * lanes..]));
        for (acc, &av) in acc.iter_mut().zip(&av) {
            let av = simd.splat_f32s(av);
            for (x, &bv) in acc.iter_mut().zip(&bv) {
                *x = simd.mul_add_f32s(av, bv, *x);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let row = &mut c[(i0 + r) * c_rs + c0..][..V * lanes];
        row.copy_from_slice(pulp::bytemuck::cast_slice(acc.as_slice()));
    }
}

/// `c = a b` over the rows `0..rows` (in groups of `R` from 0), for each group starting at `i0`
/// the columns `cols(i0)` (a range whose start is a multiple of the tile's width, its end
/// rounded up to one) and the inner indices `ks(i0)`; `c` has rows of `c_rs`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn product<S: pulp::Simd, const V: usize>(
    simd: S,
    a: Factor,
    b: Rows,
    c: &mut [f32],
    c_rs: usize,
    rows: usize,
    cols: impl Fn(usize) -> Range<usize>,
    ks: impl Fn(usize) -> Range<usize>,
) {
    let width = V * std::mem::size_of::<S::f32s>() / 4;
    for i0 in (0..rows).step_by(R) {
        let ks = ks(i0);
        for c0 in cols(i0).step_by(width) {
            let brows = b.data[ks.start * b.rs + c0..].chunks(b.rs).take(ks.len());
            if a.transposed {
                // a(i, kk) = data[kk * cs + i]: a group's R values of one kk are adjacent.
                let col = |kk: usize| -> [f32; R] { a.data[kk * a.cs + i0..][..R].try_into().expect("R values") };
                tile::<S, V>(simd, ks.clone().map(col), brows, c, c_rs, (i0, c0));
            } else {
                let row = |r: usize| &a.data[(i0 + r).min(a.last) * a.rs..][ks.clone()];
                let [r0, r1, r2, r3] = [row(0), row(1), row(2), row(3)];
                let col = r0.iter().zip(r1).zip(r2).zip(r3).map(|(((&x0, &x1), &x2), &x3)| [x0, x1, x2, x3]);
                tile::<S, V>(simd, col, brows, c, c_rs, (i0, c0));
            }
        }
    }
}

/// The shapes of one attention: `n` examples of `t` positions, `heads` heads of `hd` columns
/// in rows of `w = heads * hd` (the queries', keys' and values' rows `rs` apart: `w`, or `3 w`
/// where they are the thirds of one projection's rows); the buffers' padded sizes `tp` and
/// `hdp`.
#[derive(Clone, Copy, Debug)]
struct Dims {
    n: usize,
    t: usize,
    heads: usize,
    hd: usize,
    tp: usize,
    hdp: usize,
    rs: usize,
}

impl Dims {
    fn new(n: usize, t: usize, heads: usize, hd: usize, rs: usize) -> Self {
        Self { n, t, heads, hd, tp: t.div_ceil(PAD) * PAD, hdp: hd.div_ceil(PAD) * PAD, rs }
    }

    fn w(&self) -> usize {
        self.heads * self.hd
    }

    /// The columns `i >= j` of the `(tp, tp)` transposed scores that rows `j0..j0 + R` need,
    /// from a multiple of `cols`.
    fn upper(&self, j0: usize, cols: usize) -> Range<usize> {
        j0 / cols * cols..self.t
    }

    /// Example `b`'s rows of `x` (rows of `rs`, `w` columns used), from its first row's start
    /// to its last row's `w`-th column; in the projections' packed rows, most of all three's.
    fn example<'a>(&self, x: &'a [f32], b: usize, rs: usize) -> &'a [f32] {
        &x[b * self.t * rs..][..(self.t - 1) * rs + self.w()]
    }

    /// The memory example `b`'s queries, keys and values occupy: one span of its whole rows
    /// where they are the thirds of one projection's rows (`rs = 3 w`, `q` the rows
    /// themselves), else each one's [`Dims::example`].
    fn examples<'a>(&self, [q, k, v]: [&'a [f32]; 3], b: usize) -> [&'a [f32]; 3] {
        if self.rs == 3 * self.w() {
            [&q[b * self.t * self.rs..][..self.t * self.rs], &[], &[]]
        } else {
            [q, k, v].map(|x| self.example(x, b, self.rs))
        }
    }

    /// Where head `h` of example `b` starts in `n t` rows of `rs`.
    fn base(&self, b: usize, h: usize, rs: usize) -> usize {
        b * self.t * rs + h * self.hd
    }
}

/// One head's buffers, padded with zeros that stay zeros: transposes `(hdp, tp)`, `(tp, tp)`
/// squares, and (for heads whose width is not a multiple of the tiles') `(tp, hdp)` rows.
struct Head {
    /// The transposed queries (forward) or output gradient (backward).
    xt: Vec<f32>,
    /// The transposed scores `S^T = K Q^T`, then (backward) the transposed gradient of the
    /// probabilities `dP^T = V dY^T`.
    st: Vec<f32>,
    /// The transposed probabilities `P^T`.
    pt: Vec<f32>,
    /// The transposed gradient of the scores `dS^T`.
    dst: Vec<f32>,
    /// Padded copies of the operands' rows and of a result's.
    rows: [Vec<f32>; 5],
}

impl Head {
    fn new(d: Dims) -> Self {
        let (rows, sq) = (d.tp * d.hdp, d.tp * d.tp);
        let z = |n: usize| vec![0f32; n];
        Self { xt: z(rows), st: z(sq), pt: z(sq), dst: z(sq), rows: std::array::from_fn(|_| z(rows)) }
    }
}

/// Copies `src` into `dst` (of its length) [`LANES`] elements at a time: moves of a fixed size,
/// which compile to vector loads and stores where a copy of a row's length (a head's 32
/// elements) is a call to `memcpy`, which cost more than the copy.
#[inline(always)]
fn copy(dst: &mut [f32], src: &[f32]) {
    let (mut dc, mut sc) = (dst.chunks_exact_mut(LANES), src.chunks_exact(LANES));
    for (d, s) in (&mut dc).zip(&mut sc) {
        let s: &[f32; LANES] = s.try_into().expect("a chunk of LANES");
        d.copy_from_slice(s);
    }
    for (d, &s) in dc.into_remainder().iter_mut().zip(sc.remainder()) {
        *d = s;
    }
}

/// Reads one vector from each cache line of `x` (16 f32 of 64 bytes), into four independent
/// maxima, so that the loads have no chain between them and many lines are in flight at once.
/// The heads of an example read its rows column by column (each head 2 lines of each row, and
/// its probabilities a column block at a time), and read that way every line was a miss waited
/// on in the middle of a product; warmed first, they are in the core's L2.
#[inline(always)]
fn warm<S: pulp::Simd>(simd: S, x: &[f32]) {
    let step = 16.max(std::mem::size_of::<S::f32s>() / 4);
    // Four maxima in four variables (an array indexed by the line's number was kept on the
    // stack, each maximum a store and a load).
    let mut m = [simd.splat_f32s(0.0); 4];
    let mut lines = x.chunks_exact(4 * step);
    for c in &mut lines {
        let [m0, m1, m2, m3] = &mut m;
        *m0 = simd.max_f32s(*m0, super::load::<S>(c));
        *m1 = simd.max_f32s(*m1, super::load::<S>(&c[step..]));
        *m2 = simd.max_f32s(*m2, super::load::<S>(&c[2 * step..]));
        *m3 = simd.max_f32s(*m3, super::load::<S>(&c[3 * step..]));
    }
    for c in lines.remainder().chunks_exact(step) {
        m[0] = simd.max_f32s(m[0], super::load::<S>(c));
    }
    std::hint::black_box(m);
}

/// Warms part `h` of `parts` of each of `spans` (see [`warm`]): the next example's rows, a part
/// beside each head of the current one, so that its misses overlap the current one's products
/// rather than stall a loop of loads.
#[inline(always)]
fn warm_part<S: pulp::Simd>(simd: S, spans: &[&[f32]], h: usize, parts: usize) {
    for x in spans {
        let part = x.len().div_ceil(parts).next_multiple_of(LANES);
        let (start, end) = ((h * part).min(x.len()), ((h + 1) * part).min(x.len()));
        warm(simd, &x[start..end]);
    }
}

/// The rows of the head at `base` of rows `x` (`rs` apart): `x` itself where the tiles' columns
/// divide the head's (`fast`), else a copy into `(tp, hdp)` rows `buf`.
#[inline(always)]
fn source<'a>(fast: bool, d: Dims, x: &'a [f32], (base, rs): (usize, usize), buf: &'a mut [f32]) -> Rows<'a> {
    if fast {
        return Rows { data: &x[base..], rs };
    }
    for i in 0..d.t {
        copy(&mut buf[i * d.hdp..][..d.hd], &x[base + i * rs..][..d.hd]);
    }
    Rows { data: buf, rs: d.hdp }
}

/// The transpose `(hdp, tp)` of the head at `base` of rows `x` (`rs` apart; zeros past `t` and
/// `hd`), in blocks of [`LANES`] x [`LANES`], each read into registers row by row and written
/// column by column.
#[inline(always)]
fn transpose(d: Dims, x: &[f32], (base, rs): (usize, usize), xt: &mut [f32]) {
    for i0 in (0..d.tp).step_by(LANES) {
        for c0 in (0..d.hdp).step_by(LANES) {
            let mut block = [[0f32; LANES]; LANES];
            let width = d.hd.saturating_sub(c0).min(LANES);
            let rows = if width == 0 { 0 } else { d.t.saturating_sub(i0) };
            for (r, row) in block.iter_mut().enumerate().take(rows) {
                copy(&mut row[..width], &x[base + (i0 + r) * rs + c0..][..width]);
            }
            for c in 0..LANES {
                let mut col = [0f32; LANES];
                for (x, row) in col.iter_mut().zip(&block) {
                    *x = row[c];
                }
                xt[(c0 + c) * d.tp + i0..][..LANES].copy_from_slice(&col);
            }
        }
    }
}

/// Where a result of `(t, hd)` is computed, and the stride of its rows: the example's rows `ex`
/// themselves (from `at`, rows `rs` apart, `R` spare rows after the last) where the tiles'
/// columns divide the head's (`fast`; a last, partial group of rows spills into the spare
/// rows), else `buf`, which [`finish`] copies into `ex`. (Not a function taking the product as
/// a closure: a closure need not be inlined into the vectorized code, and this one was not.)
#[inline(always)]
fn target<'a>(
    fast: bool,
    d: Dims,
    ex: &'a mut [f32],
    (at, rs): (usize, usize),
    buf: &'a mut [f32],
) -> (&'a mut [f32], usize) {
    if fast {
        (&mut ex[at..], rs)
    } else {
        (buf, d.hdp)
    }
}

/// Copies a result computed in `buf` (see [`target`]) into `ex` at `at`, rows `rs` apart.
#[inline(always)]
fn finish(fast: bool, d: Dims, ex: &mut [f32], (at, rs): (usize, usize), buf: &[f32]) {
    if !fast {
        for i in 0..d.t {
            copy(&mut ex[at + i * rs..][..d.hd], &buf[i * d.hdp..][..d.hd]);
        }
    }
}

/// The block of [`LANES`] positions from `i0` as `N = LANES / lanes` vectors of `S` (a
/// constant, so that the sums of a block stay in registers: indexed by a count known only at
/// run time, they were kept in memory and each addition waited on a store), and which of its
/// lanes see a position `j` (`j <= i0 + l` for lane `l`).
#[derive(Clone, Copy)]
struct Lanes<S: pulp::Simd, const N: usize> {
    simd: S,
    /// Each vector's lane numbers from the block's start, as f32.
    number: [S::f32s; N],
}

impl<S: pulp::Simd, const N: usize> Lanes<S, N> {
    #[inline(always)]
    fn new(simd: S) -> Self {
        let all: [f32; LANES] = std::array::from_fn(|l| l as f32);
        Self { simd, number: std::array::from_fn(|v| super::load::<S>(&all[v * Self::LANES_OF_S..])) }
    }

    const LANES_OF_S: usize = std::mem::size_of::<S::f32s>() / 4;

    /// Vector `v` of the block at `at` of `x`.
    #[inline(always)]
    fn load(&self, x: &[f32], at: usize, v: usize) -> S::f32s {
        super::load::<S>(&x[at + v * Self::LANES_OF_S..])
    }

    /// Stores `x` as vector `v` of the block at `at` of `out`.
    #[inline(always)]
    fn store(&self, out: &mut [f32], at: usize, v: usize, x: S::f32s) {
        let lanes = Self::LANES_OF_S;
        out[at + v * lanes..][..lanes].copy_from_slice(pulp::bytemuck::cast_slice(std::slice::from_ref(&x)));
    }

    /// `x` in the lanes of vector `v` that see position `j` of the block from `i0`, `other`
    /// elsewhere (every lane sees `j <= i0`).
    #[inline(always)]
    fn seen(&self, (j, i0): (usize, usize), v: usize, x: S::f32s, other: f32) -> S::f32s {
        if j <= i0 {
            return x;
        }
        let sees = self.simd.greater_than_or_equal_f32s(self.number[v], self.simd.splat_f32s((j - i0) as f32));
        self.simd.select_f32s(sees, x, self.simd.splat_f32s(other))
    }
}

/// A loop over blocks of [`LANES`] positions, given them as `N` vectors of `S`.
trait BlockKernel {
    fn run<S: pulp::Simd, const N: usize>(self, b: Lanes<S, N>);
}

/// Runs `k` with [`LANES`] as a constant count of vectors of `S` (1 of AVX-512, 2 of AVX2, 4
/// of 128 bits, 16 scalars).
#[inline(always)]
fn blocks<S: pulp::Simd>(simd: S, k: impl BlockKernel) {
    match LANES / (std::mem::size_of::<S::f32s>() / 4) {
        1 => k.run(Lanes::<S, 1>::new(simd)),
        2 => k.run(Lanes::<S, 2>::new(simd)),
        4 => k.run(Lanes::<S, 4>::new(simd)),
        n => {
            assert_eq!(n, LANES, "vectors of more than {LANES} f32 lanes");
            k.run(Lanes::<S, LANES>::new(simd))
        }
    }
}

/// Blocks of [`LANES`] positions that the softmax kernels take together: each block's maximum
/// and sum is a chain down its column (each step waits on the one before), and the chains of
/// [`GROUP`] blocks interleave, where one block at a time left the vector units waiting on
/// each chain's latency.
const GROUP: usize = 4;

/// The blocks from `g0` ([`GROUP`] of them, fewer at the end): each one's first position `i0`
/// and `jend`, the end of its rows `j <= i` (and `t`).
#[inline(always)]
fn group(t: usize, g0: usize) -> [(usize, usize); GROUP] {
    std::array::from_fn(|q| {
        let i0 = g0 + q * LANES;
        (i0, if i0 < t { (i0 + LANES).min(t) } else { 0 })
    })
}

/// The transposed probabilities `pt` from the transposed scores `st` (both `(tp, tp)`): for
/// each block of [`LANES`] positions `i` (a column of each, one lane each), the softmax over
/// `j <= i` down the column, the entries `j > i` 0. Written for `j` below the block's end (and
/// `t`); the columns are independent, so every operation is a whole vector's: the maximum, the
/// exps, their sum in the order of `j`, its reciprocal, the products by it. In explicit vectors
/// (written on arrays with a branch a lane, the loops compiled to scalar code), [`GROUP`]
/// blocks at a time (each lane's operations in the same order as one block at a time).
struct SoftmaxColumns<'a> {
    d: Dims,
    st: &'a [f32],
    pt: &'a mut [f32],
}

impl BlockKernel for SoftmaxColumns<'_> {
    #[inline(always)]
    fn run<S: pulp::Simd, const N: usize>(self, b: Lanes<S, N>) {
        let (Self { d, st, pt }, simd) = (self, b.simd);
        let (t, tp) = (d.t, d.tp);
        for g0 in (0..t).step_by(GROUP * LANES) {
            let blocks = group(t, g0);
            let last = blocks.iter().map(|&(_, e)| e).max().unwrap_or(0);
            let mut max = [[simd.splat_f32s(f32::NEG_INFINITY); N]; GROUP];
            for j in 0..last {
                for (max, &(i0, jend)) in max.iter_mut().zip(&blocks) {
                    if j < jend {
                        for (v, m) in max.iter_mut().enumerate() {
                            let x = b.seen((j, i0), v, b.load(st, j * tp + i0, v), f32::NEG_INFINITY);
                            *m = simd.select_f32s(simd.greater_than_f32s(x, *m), x, *m);
                        }
                    }
                }
            }
            let mut sum = [[simd.splat_f32s(0.0); N]; GROUP];
            for j in 0..last {
                for ((sum, max), &(i0, jend)) in sum.iter_mut().zip(&max).zip(&blocks) {
                    if j < jend {
                        for (v, (s, &m)) in sum.iter_mut().zip(max).enumerate() {
                            let e = super::exp_vector(simd, simd.sub_f32s(b.load(st, j * tp + i0, v), m));
                            let e = b.seen((j, i0), v, e, 0.0);
                            *s = simd.add_f32s(*s, e);
                            b.store(pt, j * tp + i0, v, e);
                        }
                    }
                }
            }
            // One division a position, then products (a division a probability cost more
            // than the exps).
            for (sum, &(i0, jend)) in sum.iter().zip(&blocks) {
                let inv = sum.map(|s| simd.div_f32s(simd.splat_f32s(1.0), s));
                for j in 0..jend {
                    for (v, &r) in inv.iter().enumerate() {
                        let p = simd.mul_f32s(b.load(pt, j * tp + i0, v), r);
                        b.store(pt, j * tp + i0, v, p);
                    }
                }
            }
        }
    }
}

/// The transposed gradient of the scores `dS^T = P^T (dP^T - dot)`, `dot` each column's sum of
/// `P^T dP^T` in the order of `j`, the entries `j > i` 0 (as [`SoftmaxColumns`] writes them).
struct SoftmaxColumnsGrad<'a> {
    d: Dims,
    pt: &'a [f32],
    dpt: &'a [f32],
    dst: &'a mut [f32],
}

impl BlockKernel for SoftmaxColumnsGrad<'_> {
    #[inline(always)]
    fn run<S: pulp::Simd, const N: usize>(self, b: Lanes<S, N>) {
        let (Self { d, pt, dpt, dst }, simd) = (self, b.simd);
        let (t, tp) = (d.t, d.tp);
        for g0 in (0..t).step_by(GROUP * LANES) {
            let blocks = group(t, g0);
            let last = blocks.iter().map(|&(_, e)| e).max().unwrap_or(0);
            let mut dots = [[simd.splat_f32s(0.0); N]; GROUP];
            for j in 0..last {
                for (dot, &(i0, jend)) in dots.iter_mut().zip(&blocks) {
                    if j < jend {
                        for (v, s) in dot.iter_mut().enumerate() {
                            let (p, g) = (b.load(pt, j * tp + i0, v), b.load(dpt, j * tp + i0, v));
                            *s = simd.add_f32s(*s, b.seen((j, i0), v, simd.mul_f32s(p, g), 0.0));
                        }
                    }
                }
            }
            for (dot, &(i0, jend)) in dots.iter().zip(&blocks) {
                for j in 0..jend {
                    for (v, &s) in dot.iter().enumerate() {
                        let (p, g) = (b.load(pt, j * tp + i0, v), b.load(dpt, j * tp + i0, v));
                        let x = b.seen((j, i0), v, simd.mul_f32s(p, simd.sub_f32s(g, s)), 0.0);
                        b.store(dst, j * tp + i0, v, x);
                    }
                }
            }
        }
    }
}

/// One head's transposed probabilities `pt` from its keys' rows and its queries' transpose
/// `qt`: `S^T = K Q^T` for `i >= j` into `st` (tiles of `COLS` columns), then
/// [`SoftmaxColumns`].
#[inline(always)]
fn probabilities<S: pulp::Simd, const V: usize>(simd: S, d: Dims, k: Rows, qt: &[f32], st: &mut [f32], pt: &mut [f32]) {
    let (qt, cols) = (Rows { data: qt, rs: d.tp }, tile_width::<S, V>());
    product::<S, V>(simd, Factor::rows(k, d.t - 1), qt, st, d.tp, d.t, |j0| d.upper(j0, cols), |_| 0..d.hd);
    blocks(simd, SoftmaxColumns { d, st, pt });
}

/// The forward pass: appends the `(n t, w)` rows of the attention's output to `out`.
pub(super) struct AttentionFwd<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    d: Dims,
    out: &'a mut Vec<f32>,
    /// Where to append each head's `(tp, tp)` transposed probabilities, head after head, for
    /// the backward pass, if they are kept.
    probs: Option<&'a mut Vec<f32>>,
}

/// The backward pass: appends the `(n t, w)` gradients of the queries, keys and values.
pub(super) struct AttentionBwd<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    d: Dims,
    /// The forward pass' transposed probabilities, if kept; else they are computed again.
    probs: Option<&'a [f32]>,
    grads: Grads<'a>,
}

/// A loop nest compiled for the CPU's vector width, given tiles of `V` vectors a row.
pub(super) trait TiledKernel {
    fn run<S: pulp::Simd, const V: usize>(self, simd: S);
}

/// The columns of a tile of `V` vectors of `S`.
#[inline(always)]
fn tile_width<S: pulp::Simd, const V: usize>() -> usize {
    V * std::mem::size_of::<S::f32s>() / 4
}

/// A [`TiledKernel`] as a [`super::VectorKernel`], its tiles' width chosen for the vector type.
struct Tiled<K>(K);

impl<K: TiledKernel> super::VectorKernel for Tiled<K> {
    /// Tiles 4 rows by 32 columns (8 AVX-512 registers of sums) or by 16 (8 AVX2 registers, or
    /// narrower vectors): each element's sum the same chain of fused multiply-adds, so the same
    /// bits on every CPU.
    #[inline(always)]
    fn run<S: pulp::Simd>(self, simd: S) {
        if std::mem::size_of::<S::f32s>() >= 32 {
            self.0.run::<S, 2>(simd)
        } else {
            self.0.run::<S, 4>(simd)
        }
    }
}

/// Runs `k` compiled for the widest vector instructions this CPU has (see [`super::simd`]).
pub(super) fn simd_tiled(k: impl TiledKernel) {
    super::simd_vectors(Tiled(k))
}

impl TiledKernel for AttentionFwd<'_> {
    #[inline(always)]
    fn run<S: pulp::Simd, const V: usize>(mut self, simd: S) {
        let d = self.d;
        let (t, tp, cols) = (d.t, d.tp, tile_width::<S, V>());
        let fast = d.hd.is_multiple_of(cols);
        let mut hh = Head::new(d);
        let [kb, vb, yb, ..] = &mut hh.rows;
        // One example's rows, R spare, appended to the output once all its heads are in.
        let mut ex = vec![0f32; (t + R) * d.w()];
        let (q, k, v) = (self.q, self.k, self.v);
        let spans = |b: usize| -> [&[f32]; 3] {
            if b < d.n {
                d.examples([q, k, v], b)
            } else {
                [&[]; 3]
            }
        };
        warm_part(simd, &spans(0), 0, 1);
        for b in 0..d.n {
            let next = spans(b + 1);
            for h in 0..d.heads {
                warm_part(simd, &next, h, d.heads);
                let at = (d.base(b, h, d.rs), d.rs);
                transpose(d, self.q, at, &mut hh.xt);
                let (k, v) = (source(fast, d, self.k, at, kb), source(fast, d, self.v, at, vb));
                probabilities::<S, V>(simd, d, k, &hh.xt, &mut hh.st, &mut hh.pt);
                if let Some(probs) = self.probs.as_mut() {
                    probs.extend_from_slice(&hh.pt);
                }
                // Y = P V: P read from its transpose, the terms j > i (0) skipped.
                let p = Factor::transposed(Rows { data: &hh.pt, rs: tp });
                let at = (h * d.hd, d.w());
                let (y, rs) = target(fast, d, &mut ex, at, yb);
                product::<S, V>(simd, p, v, y, rs, t, |_| 0..d.hd, |i0| 0..(i0 + R).min(t));
                finish(fast, d, &mut ex, at, yb);
            }
            self.out.extend_from_slice(&ex[..t * d.w()]);
        }
    }
}

impl TiledKernel for AttentionBwd<'_> {
    #[inline(always)]
    fn run<S: pulp::Simd, const V: usize>(mut self, simd: S) {
        let d = self.d;
        let (t, tp, cols) = (d.t, d.tp, tile_width::<S, V>());
        let fast = d.hd.is_multiple_of(cols);
        let mut hh = Head::new(d);
        let [qb, kb, vb, gb, xb] = &mut hh.rows;
        // One example's rows of the three gradients, each row the query's, key's and value's
        // gradient rows one after another (the packed projection's layout), R spare.
        let w3 = 3 * d.w();
        let mut ex = vec![0f32; (t + R) * w3];
        let (q, k, v, g, probs) = (self.q, self.k, self.v, self.g, self.probs);
        let spans = |b: usize| -> [&[f32]; 5] {
            if b < d.n {
                let per = d.heads * tp * tp;
                let p = probs.map_or(&[][..], |p| &p[b * per..][..per]);
                let [q, k, v] = d.examples([q, k, v], b);
                [q, k, v, d.example(g, b, d.w()), p]
            } else {
                [&[]; 5]
            }
        };
        warm_part(simd, &spans(0), 0, 1);
        for b in 0..d.n {
            let next = spans(b + 1);
            for h in 0..d.heads {
                warm_part(simd, &next, h, d.heads);
                let (at, at_g) = ((d.base(b, h, d.rs), d.rs), (d.base(b, h, d.w()), d.w()));
                let (q, k) = (source(fast, d, self.q, at, qb), source(fast, d, self.k, at, kb));
                let (v, dy) = (source(fast, d, self.v, at, vb), source(fast, d, self.g, at_g, gb));
                let pt: &[f32] = match self.probs {
                    Some(all) => &all[(b * d.heads + h) * tp * tp..][..tp * tp],
                    None => {
                        transpose(d, self.q, at, &mut hh.xt);
                        probabilities::<S, V>(simd, d, k, &hh.xt, &mut hh.st, &mut hh.pt);
                        &hh.pt
                    }
                };
                // dP^T = V dY^T for i >= j, into `st`; then dS^T.
                transpose(d, self.g, at_g, &mut hh.xt);
                let dyt = Rows { data: &hh.xt, rs: tp };
                let upper = |j0: usize| d.upper(j0, cols);
                product::<S, V>(simd, Factor::rows(v, t - 1), dyt, &mut hh.st, tp, t, upper, |_| 0..d.hd);
                blocks(simd, SoftmaxColumnsGrad { d, pt, dpt: &hh.st, dst: &mut hh.dst });
                // dV = P^T dY, dQ = dS K, dK = dS^T Q: the terms where P is 0 skipped.
                let (ptr, dsr) = (Rows { data: pt, rs: tp }, Rows { data: &hh.dst, rs: tp });
                let (below, above) = (|i0: usize| 0..(i0 + R).min(t), |j0: usize| j0..t);
                let part = |p: usize| (p * d.w() + h * d.hd, w3);
                let (c, rs) = target(fast, d, &mut ex, part(2), xb);
                product::<S, V>(simd, Factor::rows(ptr, tp - 1), dy, c, rs, t, |_| 0..d.hd, above);
                finish(fast, d, &mut ex, part(2), xb);
                let (c, rs) = target(fast, d, &mut ex, part(0), xb);
                product::<S, V>(simd, Factor::transposed(dsr), k, c, rs, t, |_| 0..d.hd, below);
                finish(fast, d, &mut ex, part(0), xb);
                let (c, rs) = target(fast, d, &mut ex, part(1), xb);
                product::<S, V>(simd, Factor::rows(dsr, tp - 1), q, c, rs, t, |_| 0..d.hd, above);
                finish(fast, d, &mut ex, part(1), xb);
            }
            self.grads.append(d, &ex);
        }
    }
}

/// Where the backward pass appends the gradients: three `(n t, w)` tensors' elements, or one
/// `(n t, 3 w)` tensor's (each row the query's, key's and value's gradient rows one after another).
pub(super) enum Grads<'a> {
    Apart([&'a mut Vec<f32>; 3]),
    Packed(&'a mut Vec<f32>),
}

impl Grads<'_> {
    /// Appends one example's `t` rows of each gradient, from `(t + R, 3 w)` rows each the
    /// query's, key's and value's gradient rows one after another: as they are where the
    /// gradient is one tensor (one copy an example), row by row into the three otherwise.
    #[inline(always)]
    fn append(&mut self, d: Dims, ex: &[f32]) {
        let (t, w) = (d.t, d.w());
        match self {
            Self::Apart(outs) => {
                for row in ex[..t * 3 * w].chunks_exact(3 * w) {
                    for (out, part) in outs.iter_mut().zip(row.chunks_exact(w)) {
                        out.extend_from_slice(part);
                    }
                }
            }
            Self::Packed(out) => out.extend_from_slice(&ex[..t * 3 * w]),
        }
    }
}

/// `softmax(q k^T, causal) v` per head, on `(n t, w)` rows of f32.
struct CausalAttention {
    n: usize,
    t: usize,
    heads: usize,
    /// The forward pass' transposed probabilities, `(n, heads, tp, tp)`, for the backward
    /// pass (which computes them again if they are missing).
    probs: std::sync::OnceLock<Vec<f32>>,
}

impl CausalAttention {
    fn dims(&self, l: &Layout) -> Result<Dims> {
        let (rows, w) = l.shape().dims2()?;
        if rows != self.n * self.t || !w.is_multiple_of(self.heads) {
            candle_core::bail!(
                "causal_attention: rows of {w} columns for {} examples of {} positions in {} heads, got {:?}",
                self.n,
                self.t,
                self.heads,
                l.shape()
            );
        }
        Ok(Dims::new(self.n, self.t, self.heads, w / self.heads, w))
    }

    /// The forward pass over queries, keys and values in rows `d.rs` apart: the output's
    /// elements, the probabilities kept.
    fn forward(&self, d: Dims, [q, k, v]: [&[f32]; 3]) -> Vec<f32> {
        let mut out = Vec::with_capacity(d.n * d.t * d.w());
        let mut probs = Vec::with_capacity(d.n * d.heads * d.tp * d.tp);
        simd_tiled(AttentionFwd { q, k, v, d, out: &mut out, probs: Some(&mut probs) });
        // A second forward pass of the same operation (none in candle) would keep the first's.
        let _ = self.probs.set(probs);
        out
    }
}

/// The contiguous f32 elements of a CPU tensor (a view into its storage, which `guard` holds).
fn cpu_f32s<'a>(guard: &'a candle_core::StorageRef<'a>, l: &Layout, name: &str) -> Result<&'a [f32]> {
    match &**guard {
        Storage::Cpu(s) => f32_only(s, l, name),
        _ => candle_core::bail!("{name}'s backward pass runs on the CPU"),
    }
}

impl CustomOp3 for CausalAttention {
    fn name(&self) -> &'static str {
        "strata-causal-attention"
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
        let d = self.dims(l1)?;
        super::same_shape(l1, l2, self.name())?;
        super::same_shape(l1, l3, self.name())?;
        let (q, k, v) =
            (f32_only(s1, l1, self.name())?, f32_only(s2, l2, self.name())?, f32_only(s3, l3, self.name())?);
        Ok((CpuStorage::F32(self.forward(d, [q, k, v])), l1.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let name = self.name();
        let ((sq, lq), (sk, lk), (sv, lv), (sg, lg)) =
            (q.storage_and_layout(), k.storage_and_layout(), v.storage_and_layout(), grad.storage_and_layout());
        let d = self.dims(lq)?;
        super::same_shape(lq, lg, name)?;
        let (qs, ks, vs, g) =
            (cpu_f32s(&sq, lq, name)?, cpu_f32s(&sk, lk, name)?, cpu_f32s(&sv, lv, name)?, cpu_f32s(&sg, lg, name)?);
        let len = qs.len();
        let (mut dq, mut dk, mut dv) = (Vec::with_capacity(len), Vec::with_capacity(len), Vec::with_capacity(len));
        let probs = self.probs.get().map(|p| p.as_slice());
        let grads = Grads::Apart([&mut dq, &mut dk, &mut dv]);
        simd_tiled(AttentionBwd { q: qs, k: ks, v: vs, g, d, probs, grads });
        let shape = lq.shape().clone();
        let device = q.device();
        Ok((
            Some(Tensor::from_vec(dq, shape.clone(), device)?),
            Some(Tensor::from_vec(dk, shape.clone(), device)?),
            Some(Tensor::from_vec(dv, shape, device)?),
        ))
    }
}

/// [`causal_attention`] of the thirds of one projection's `(n t, 3 w)` rows.
struct PackedAttention(CausalAttention);

impl PackedAttention {
    fn dims(&self, l: &Layout) -> Result<Dims> {
        let (rows, w3) = l.shape().dims2()?;
        let c = &self.0;
        if rows != c.n * c.t || !w3.is_multiple_of(3 * c.heads) {
            candle_core::bail!(
                "causal_attention_packed: rows of {w3} columns for {} examples of {} positions in {} heads, got {:?}",
                c.n,
                c.t,
                c.heads,
                l.shape()
            );
        }
        Ok(Dims::new(c.n, c.t, c.heads, w3 / 3 / c.heads, w3))
    }
}

impl CustomOp1 for PackedAttention {
    fn name(&self) -> &'static str {
        "strata-causal-attention-packed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = self.dims(l)?;
        let x = f32_only(s, l, self.name())?;
        let w = d.w();
        let out = self.0.forward(d, [x, &x[w..], &x[2 * w..]]);
        Ok((CpuStorage::F32(out), Shape::from((d.n * d.t, w))))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let name = self.name();
        let ((sx, lx), (sg, lg)) = (x.storage_and_layout(), grad.storage_and_layout());
        let d = self.dims(lx)?;
        let (xs, g) = (cpu_f32s(&sx, lx, name)?, cpu_f32s(&sg, lg, name)?);
        let w = d.w();
        if g.len() != d.n * d.t * w {
            candle_core::bail!("{name}: a gradient of {:?} for an output of {} rows of {w}", lg.shape(), d.n * d.t);
        }
        let mut dx = Vec::with_capacity(xs.len());
        let probs = self.0.probs.get().map(|p| p.as_slice());
        let grads = Grads::Packed(&mut dx);
        simd_tiled(AttentionBwd { q: xs, k: &xs[w..], v: &xs[2 * w..], g, d, probs, grads });
        Ok(Some(Tensor::from_vec(dx, lx.shape().clone(), x.device())?))
    }
}

/// [`causal_attention`] of `qkv` `(n, t, 3 width)`: the queries its first `width` columns, the
/// keys the next, the values the last, as one projection computes them (its backward pass then
/// gives one gradient, where three separate tensors sliced from it would each be padded back
/// to the whole and added). Returns `(n, t, width)`.
pub fn causal_attention_packed(qkv: &Tensor, heads: usize) -> Result<Tensor> {
    let (n, t, w3) = qkv.dims3()?;
    if heads == 0 || !w3.is_multiple_of(3 * heads) {
        candle_core::bail!("causal_attention_packed: {w3} columns are not three widths that split into {heads} heads");
    }
    let w = w3 / 3;
    if fusable(qkv) && n * t > 0 && w > 0 {
        let op = PackedAttention(CausalAttention { n, t, heads, probs: Default::default() });
        return qkv.reshape((n * t, w3))?.contiguous()?.apply_op1(op)?.reshape((n, t, w));
    }
    let part = |i: usize| qkv.narrow(2, i * w, w);
    causal_attention(&part(0)?, &part(1)?, &part(2)?, heads)
}

/// Causal multi-head self-attention: `q`, `k` and `v` `(n, t, width)`, each head `h` the
/// columns `h * hd..(h + 1) * hd` (`hd = width / heads`); returns `(n, t, width)`, head `h`'s
/// columns `softmax(q_h k_h^T) v_h` with position `i` attending to positions `0..=i`. No
/// `1 / sqrt(hd)`: scale `q` (or its weight) first. On f32 CPU tensors one pass each way per
/// example and head, each head's columns read in place and only the products below the
/// diagonal computed, the same bits on every vector width (within 1e-5 of candle's operations,
/// which sum in another order); elsewhere candle's operations with [`super::causal_softmax`].
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize) -> Result<Tensor> {
    let (n, t, w) = q.dims3()?;
    if heads == 0 || !w.is_multiple_of(heads) {
        candle_core::bail!("causal_attention: a width of {w} does not split into {heads} heads");
    }
    for (x, name) in [(k, "k"), (v, "v")] {
        if x.dims() != q.dims() {
            candle_core::bail!(
                "causal_attention: {name} is {:?}, q is {:?}; give all three one shape",
                x.dims(),
                q.dims()
            );
        }
    }
    if [q, k, v].iter().all(|x| fusable(x)) && n * t > 0 && w > 0 {
        let flat = |x: &Tensor| x.reshape((n * t, w))?.contiguous();
        let op = CausalAttention { n, t, heads, probs: Default::default() };
        return flat(q)?.apply_op3(&flat(k)?, &flat(v)?, op)?.reshape((n, t, w));
    }
    let hd = w / heads;
    let split = |x: &Tensor| x.reshape((n, t, heads, hd))?.transpose(1, 2)?.contiguous();
    let (q, k, v) = (split(q)?, split(k)?, split(v)?);
    let y = super::causal_softmax(&q.matmul(&k.t()?)?)?.matmul(&v)?;
    y.transpose(1, 2)?.reshape((n, t, w))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::exp;
    use candle_core::{DType, Device, Var};

    /// Random values in -2..2 (deterministic).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    /// The attention of one head, forward and backward, in plain loops: every sum a chain of
    /// fused multiply-adds in the order of its index from 0 over the terms the mask keeps, the
    /// softmax's maximum, exps and sum down each position's column as the kernel takes them.
    /// Returns `(y, dq, dk, dv)` as `(t, hd)` rows each.
    #[allow(clippy::type_complexity)]
    fn reference(t: usize, hd: usize, q: &[f32], k: &[f32], v: &[f32], g: &[f32]) -> [Vec<f32>; 4] {
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |acc, (&x, &y)| x.mul_add(y, acc));
        let row = |m: &[f32], i: usize| m[i * hd..(i + 1) * hd].to_vec();
        let mut p = vec![0f32; t * t];
        for i in 0..t {
            let s: Vec<f32> = (0..=i).map(|j| dot(&row(k, j), &row(q, i))).collect();
            let max = s.iter().copied().fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m });
            let e: Vec<f32> = s.iter().map(|&v| exp(v - max)).collect();
            let sum = e.iter().fold(0f32, |a, &x| a + x);
            for j in 0..=i {
                p[i * t + j] = e[j] * (1.0 / sum);
            }
        }
        let mut ds = vec![0f32; t * t];
        for i in 0..t {
            let dp: Vec<f32> = (0..=i).map(|j| dot(&row(v, j), &row(g, i))).collect();
            let dotp = (0..=i).fold(0f32, |a, j| a + p[i * t + j] * dp[j]);
            for j in 0..=i {
                ds[i * t + j] = p[i * t + j] * (dp[j] - dotp);
            }
        }
        let mut out: [Vec<f32>; 4] = std::array::from_fn(|_| vec![0f32; t * hd]);
        for i in 0..t {
            for c in 0..hd {
                out[0][i * hd + c] = (0..=i).fold(0f32, |a, j| p[i * t + j].mul_add(v[j * hd + c], a));
                out[1][i * hd + c] = (0..=i).fold(0f32, |a, j| ds[i * t + j].mul_add(k[j * hd + c], a));
                out[2][i * hd + c] = (i..t).fold(0f32, |a, r| ds[r * t + i].mul_add(q[r * hd + c], a));
                out[3][i * hd + c] = (i..t).fold(0f32, |a, r| p[r * t + i].mul_add(g[r * hd + c], a));
            }
        }
        out
    }

    /// Head `h` of example `b` of `(n t, heads hd)` rows, as `(t, hd)` rows.
    fn head(x: &[f32], d: Dims, b: usize, h: usize) -> Vec<f32> {
        (0..d.t).flat_map(|i| x[d.base(b, h, d.w()) + i * d.w()..][..d.hd].to_vec()).collect()
    }

    /// Runs the kernels under `arch` (`None`: the widest this CPU has).
    fn run(d: Dims, xs: [&[f32]; 4], keep: bool, arch: Option<&str>) -> [Vec<f32>; 4] {
        let [q, k, v, g] = xs;
        let (mut y, mut probs) = (Vec::new(), Vec::new());
        let (mut dq, mut dk, mut dv) = (Vec::new(), Vec::new(), Vec::new());
        let fwd = AttentionFwd { q, k, v, d, out: &mut y, probs: keep.then_some(&mut probs) };
        match arch {
            None => simd_tiled(fwd),
            Some("scalar") => {
                pulp::Simd::vectorize(pulp::Scalar::new(), super::super::vector::VectorDispatch(Tiled(fwd)))
            }
            Some(_) => pulp::Simd::vectorize(
                pulp::x86::V3::try_new().expect("AVX2"),
                super::super::vector::VectorDispatch(Tiled(fwd)),
            ),
        }
        let probs = keep.then_some(probs.as_slice());
        let bwd = AttentionBwd { q, k, v, g, d, probs, grads: Grads::Apart([&mut dq, &mut dk, &mut dv]) };
        match arch {
            None => simd_tiled(bwd),
            Some("scalar") => {
                pulp::Simd::vectorize(pulp::Scalar::new(), super::super::vector::VectorDispatch(Tiled(bwd)))
            }
            Some(_) => pulp::Simd::vectorize(
                pulp::x86::V3::try_new().expect("AVX2"),
                super::super::vector::VectorDispatch(Tiled(bwd)),
            ),
        }
        [y, dq, dk, dv]
    }

    #[test]
    fn attention_is_its_scalar_reference_on_every_vector_width() {
        let mut arches = vec![None, Some("scalar")];
        if pulp::x86::V3::try_new().is_some() {
            arches.push(Some("avx2"));
        }
        // The transformer's heads, one position, widths that are and are not multiples of the
        // tiles', lengths that are not multiples of 4 or 16, more than one block of 16.
        for (n, t, heads, hd) in
            [(2, 64, 4, 32), (1, 1, 1, 1), (3, 13, 2, 7), (2, 33, 3, 16), (1, 17, 1, 40), (2, 70, 2, 32)]
        {
            let d = Dims::new(n, t, heads, hd, heads * hd);
            let len = n * t * heads * hd;
            let xs: Vec<Vec<f32>> = (0..4).map(|i| values(len, 7 + i)).collect();
            for keep in [true, false] {
                for &arch in &arches {
                    let got = run(d, [&xs[0], &xs[1], &xs[2], &xs[3]], keep, arch);
                    for b in 0..n {
                        for h in 0..heads {
                            let [q, k, v, g] = [0, 1, 2, 3].map(|i| head(&xs[i], d, b, h));
                            let want = reference(t, hd, &q, &k, &v, &g);
                            for (which, (got, want)) in got.iter().zip(&want).enumerate() {
                                let got = head(got, d, b, h);
                                // `==`: a term the mask makes 0 may turn a -0 sum into +0.
                                let wrong = got.iter().zip(want).filter(|(a, b)| a != b).count();
                                assert_eq!(wrong, 0, "output {which} of {d:?}, head {h} of {b}, keep {keep}, {arch:?}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn attention_matches_candles_operations_forward_and_backward() {
        let dev = Device::Cpu;
        for (n, t, heads, w) in [(2usize, 64usize, 4usize, 128usize), (3, 13, 2, 14), (1, 5, 1, 3)] {
            let mk = |seed: u64| Var::from_vec(values(n * t * w, seed), (n, t, w), &dev).unwrap();
            let (q, k, v) = (mk(1), mk(2), mk(3));
            let g = Tensor::from_vec(values(n * t * w, 4), (n, t, w), &dev).unwrap();
            let composed = |q: &Tensor, k: &Tensor, v: &Tensor| -> Result<Tensor> {
                let hd = w / heads;
                let split = |x: &Tensor| x.reshape((n, t, heads, hd))?.transpose(1, 2)?.contiguous();
                let (q, k, v) = (split(q)?, split(k)?, split(v)?);
                let y = crate::fused::causal_softmax(&q.matmul(&k.t()?)?)?.matmul(&v)?;
                y.transpose(1, 2)?.reshape((n, t, w))
            };
            let fused = causal_attention(&q, &k, &v, heads).unwrap();
            let want = composed(&q, &k, &v).unwrap();
            let close = |a: &Tensor, b: &Tensor, what: &str| {
                let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                let scale = b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1.0);
                assert!(diff <= 1e-5 * scale, "{what} of {:?}: {diff} apart", (n, t, heads, w));
            };
            close(&fused, &want, "the output");
            let gf = (fused * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let gc = (want * &g).unwrap().sum_all().unwrap().backward().unwrap();
            for (x, name) in [(&q, "q"), (&k, "k"), (&v, "v")] {
                close(gf.get(x).unwrap(), gc.get(x).unwrap(), name);
            }
            // The same function off the fused path (f64 takes candle's operations).
            let q64 = q.as_tensor().to_dtype(DType::F64).unwrap();
            let (k64, v64) = (k.as_tensor().to_dtype(DType::F64).unwrap(), v.as_tensor().to_dtype(DType::F64).unwrap());
            let y64 = causal_attention(&q64, &k64, &v64, heads).unwrap().to_dtype(DType::F32).unwrap();
            close(&y64, &composed(&q, &k, &v).unwrap(), "the f64 output");
            // Position i sees only 0..=i: changing the last position's keys and values leaves
            // every earlier output as it was.
            let last = |x: &Tensor| x.narrow(1, t - 1, 1).unwrap().affine(3.0, 1.0).unwrap();
            let cut = |x: &Tensor| Tensor::cat(&[&x.narrow(1, 0, t - 1).unwrap(), &last(x)], 1).unwrap();
            let y2 = causal_attention(&q, &cut(&k), &cut(&v), heads).unwrap();
            if t > 1 {
                let early =
                    |y: &Tensor| y.narrow(1, 0, t - 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let y1 = causal_attention(&q, &k, &v, heads).unwrap();
                assert_eq!(early(&y1), early(&y2));
            }
        }
    }

    #[test]
    fn one_packed_projection_is_the_three_apart_bit_for_bit() {
        let dev = Device::Cpu;
        for (n, t, heads, w) in [(2usize, 64usize, 4usize, 128usize), (3, 13, 2, 14), (1, 1, 1, 1)] {
            let qkv = Var::from_vec(values(n * t * 3 * w, 5), (n, t, 3 * w), &dev).unwrap();
            let g = Tensor::from_vec(values(n * t * w, 6), (n, t, w), &dev).unwrap();
            let packed = causal_attention_packed(&qkv, heads).unwrap();
            let parts: Vec<Tensor> = (0..3).map(|i| qkv.narrow(2, i * w, w).unwrap().contiguous().unwrap()).collect();
            let apart = causal_attention(&parts[0], &parts[1], &parts[2], heads).unwrap();
            let bits = |x: &Tensor| -> Vec<u32> {
                x.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
            };
            assert_eq!(bits(&packed), bits(&apart));
            let gp = (packed * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let ga = (apart * &g).unwrap().sum_all().unwrap().backward().unwrap();
            // The three parts' gradients come back padded to the whole and added (`==`: a
            // padding zero added may turn a -0 into +0).
            let values = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(values(gp.get(&qkv).unwrap()), values(ga.get(&qkv).unwrap()));
            let e = causal_attention_packed(&Tensor::zeros((1, 2, 3 * w + 1), DType::F32, &dev).unwrap(), heads);
            assert!(e.unwrap_err().to_string().contains("are not three widths"));
        }
    }

    #[test]
    fn bad_shapes_are_one_line_errors() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((2, 4, 6), DType::F32, &dev).unwrap();
        let e = causal_attention(&x, &x, &x, 4).unwrap_err().to_string();
        assert!(e.contains("does not split into 4 heads"), "{e}");
        let y = Tensor::zeros((2, 5, 6), DType::F32, &dev).unwrap();
        let e = causal_attention(&x, &y, &x, 2).unwrap_err().to_string();
        assert!(e.contains("give all three one shape"), "{e}");
        assert!(causal_attention(&Tensor::zeros((2, 6), DType::F32, &dev).unwrap(), &x, &x, 2).is_err());
    }
}

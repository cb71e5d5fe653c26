//! The fused optimizers' step on a gradient given as weighted terms
//! ([`ShardableOptimizer::step_summed`](super::ShardableOptimizer::step_summed)): where the
//! replicas of one machine step their shards, each reads every replica's gradient in place,
//! and the sum the in-memory reduction would have written (`g0·w0 + g1·w1`, then `+ g2·w2`...,
//! element by element) is made in the update's own loop (AdamW with up to four terms), or a
//! block at a time in a buffer that stays in the core's cache, then the update runs over the
//! block. The same operations in the same order as the reduction
//! followed by [`FusedAdamW`](super::FusedAdamW)'s or [`FusedSgd`](super::FusedSgd)'s step, so
//! the same bits, without the reduction's pass over memory nor the copy of its result.
//!
//! This module must not know where the terms come from: it sums what it is handed.

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, Layout, Storage, Tensor, Var};

use super::rules::{self, AdamWScalars};
use super::{fusable, slice_mut, AdamWVar, FusedAdamW, FusedSgd, OnFirstMoment};

/// Elements summed at a time: 4 KiB of buffer, in the L1 cache while the update reads it.
const BLOCK: usize = 1024;

/// A variable's gradient terms and their weights.
type Terms = Vec<(Tensor, f32)>;

/// Each variable's terms (by index among `vars`) where every variable with a gradient has one
/// in every store, and every one of them and their variables is an f32 CPU tensor the fused
/// loops take; `None` otherwise.
fn terms_of<'a>(vars: impl Iterator<Item = &'a Var>, terms: &[(&GradStore, f32)]) -> Option<Vec<(usize, Terms)>> {
    let (first, _) = terms.first()?;
    let mut out = Vec::new();
    for (i, var) in vars.enumerate() {
        if first.get(var).is_none() {
            continue;
        }
        let gs: Vec<(Tensor, f32)> =
            terms.iter().map(|(s, w)| s.get(var).map(|g| (g.clone(), *w))).collect::<Option<_>>()?;
        if !fusable(var) || gs.iter().any(|(g, _)| !fusable(g) || g.elem_count() != var.elem_count()) {
            return None;
        }
        out.push((i, gs));
    }
    Some(out)
}

/// Runs `f` over the terms' elements, read in place under their storages' read locks.
fn with_slices<R>(
    gs: &[(Tensor, f32)],
    f: impl FnOnce(&[(&[f32], f32)]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let guards: Vec<_> = gs.iter().map(|(g, _)| g.storage_and_layout()).collect();
    let mut slices = Vec::with_capacity(gs.len());
    for ((storage, layout), (_, w)) in guards.iter().zip(gs) {
        match (&**storage, layout.contiguous_offsets()) {
            (Storage::Cpu(CpuStorage::F32(v)), Some((lo, hi))) => slices.push((&v[lo..hi], *w)),
            _ => candle_core::bail!("fused optimizer: a gradient term must be a contiguous f32 CPU tensor"),
        }
    }
    f(&slices)
}

/// `buf[..len]` = the terms' weighted sum over elements `at..at + len`, in the reduction's
/// order.
#[inline(always)]
fn sum_block(buf: &mut [f32], terms: &[(&[f32], f32)], at: usize) {
    let len = buf.len();
    let (t0, w0) = terms[0];
    buf.iter_mut().zip(&t0[at..at + len]).for_each(|(o, x)| *o = x * w0);
    for &(t, w) in &terms[1..] {
        buf.iter_mut().zip(&t[at..at + len]).for_each(|(o, x)| *o += x * w);
    }
}

/// The terms' weighted sum, made whole: what an optimizer without
/// [`step_summed`](super::ShardableOptimizer::step_summed) steps with (same bits as the
/// blocks).
pub(crate) fn sum_of(gs: &[(Tensor, f32)]) -> candle_core::Result<Tensor> {
    let Some((first, _)) = gs.first() else { candle_core::bail!("a sum of no gradient terms") };
    let shape = first.shape().clone();
    let mut out = vec![0f32; first.elem_count()];
    let gs = gs.iter().map(|(g, w)| Ok((g.to_dtype(candle_core::DType::F32)?.contiguous()?, *w)));
    let gs = gs.collect::<candle_core::Result<Vec<_>>>()?;
    with_slices(&gs, |terms| {
        if terms.iter().any(|(t, _)| t.len() != out.len()) {
            candle_core::bail!("gradient terms of different sizes");
        }
        sum_block(&mut out, terms, 0);
        Ok(())
    })?;
    Tensor::from_vec(out, shape, first.device())?.to_dtype(first.dtype())
}

impl FusedAdamW {
    /// [`ShardableOptimizer::step_summed`](super::ShardableOptimizer::step_summed).
    pub(crate) fn summed_step(&mut self, terms: &[(&GradStore, f32)]) -> Option<candle_core::Result<()>> {
        let work = terms_of(self.vars.iter().map(|v| &v.var), terms)?;
        self.step_t += 1;
        let p = &self.params;
        let s = AdamWScalars::new(p.lr, p.beta1, p.beta2, p.eps, p.weight_decay, self.step_t);
        let run = || {
            for (i, gs) in work {
                let AdamWVar { var, m, v } = &self.vars[i];
                with_slices(&gs, |terms| var.inplace_op1(&AdamWSummed { m, v, terms, s: &s }))?;
            }
            Ok(())
        };
        Some(run())
    }
}

impl FusedSgd {
    /// [`ShardableOptimizer::step_summed`](super::ShardableOptimizer::step_summed).
    pub(crate) fn summed_step(&mut self, terms: &[(&GradStore, f32)]) -> Option<candle_core::Result<()>> {
        let work = terms_of(self.vars.iter(), terms)?;
        let lr = self.lr as f32;
        let run = || {
            for (i, gs) in work {
                with_slices(&gs, |terms| self.vars[i].inplace_op1(&SgdSummed { terms, lr }))?;
            }
            Ok(())
        };
        Some(run())
    }
}

/// AdamW's parameter, moments and summed gradient in one pass: the parameter's operation here,
/// the moments' nested as for a whole gradient (`OnFirstMoment`), running [`AdamWSummedLoop`].
struct AdamWSummed<'a> {
    m: &'a Var,
    v: &'a Var,
    terms: &'a [(&'a [f32], f32)],
    s: &'a AdamWScalars,
}

impl candle_core::InplaceOp1 for AdamWSummed<'_> {
    fn name(&self) -> &'static str {
        "strata-adamw-summed"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dst_l: &Layout) -> candle_core::Result<()> {
        let theta = slice_mut(dst, dst_l, "parameter")?;
        let (terms, s) = (self.terms, self.s);
        if terms.iter().any(|(t, _)| t.len() != theta.len()) {
            candle_core::bail!("fused optimizer: parameter and gradient terms differ in size");
        }
        let run = |theta: &mut [f32], m: &mut [f32], v: &mut [f32]| {
            pulp::Arch::new().dispatch(AdamWSummedLoop { theta, m, v, terms, s });
            Ok(())
        };
        self.m.inplace_op1(&OnFirstMoment { theta: std::cell::Cell::new(Some(theta)), v: self.v, run: &run })
    }
}

/// [`rules::adamw`] over the elements, each gradient the terms' sum: for up to
/// [`FUSED_TERMS`] terms summed in the same loop as the update (one pass over memory, which
/// the update's arithmetic overlaps), for more a block at a time.
struct AdamWSummedLoop<'a> {
    theta: &'a mut [f32],
    m: &'a mut [f32],
    v: &'a mut [f32],
    terms: &'a [(&'a [f32], f32)],
    s: &'a AdamWScalars,
}

impl pulp::WithSimd for AdamWSummedLoop<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let s = *self.s;
        let update = |theta: &mut f32, m: &mut f32, v: &mut f32, g: f32| rules::adamw(theta, m, v, g, &s);
        match self.terms.len() {
            1 => return fused::<1>(self.theta, self.m, self.v, self.terms, update),
            2 => return fused::<2>(self.theta, self.m, self.v, self.terms, update),
            3 => return fused::<3>(self.theta, self.m, self.v, self.terms, update),
            FUSED_TERMS => return fused::<FUSED_TERMS>(self.theta, self.m, self.v, self.terms, update),
            _ => {}
        }
        let mut buf = [0f32; BLOCK];
        let n = self.theta.len();
        let mut at = 0;
        while at < n {
            let len = BLOCK.min(n - at);
            let g = &mut buf[..len];
            sum_block(g, self.terms, at);
            let (theta, m, v) = (&mut self.theta[at..at + len], &mut self.m[at..at + len], &mut self.v[at..at + len]);
            for (((theta, m), v), g) in theta.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g.iter()) {
                rules::adamw(theta, m, v, *g, &s);
            }
            at += len;
        }
    }
}

/// The most gradient terms [`AdamWSummedLoop`] sums in the update's own loop.
const FUSED_TERMS: usize = 4;

/// `update(theta[i], m[i], v[i], g)` for every element, `g` the `N` terms' weighted sum made as
/// [`sum_block`] makes it (`t0 * w0`, then `+ t1 * w1`, ...: the same bits), in one loop: on
/// a replica's half of the 4.3M MLP (two terms) the update's pass over memory, no longer
/// preceded by the sums' own, took 16-25% less time on an AMD EPYC without AVX-512
/// (docs/bench/zen1-experiments-2026-12-08.txt). The slices are cut to one length first, so
/// that the loop's indexing needs no bounds checks and vectorizes.
#[inline(always)]
fn fused<const N: usize>(
    theta: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    terms: &[(&[f32], f32)],
    update: impl Fn(&mut f32, &mut f32, &mut f32, f32),
) {
    let n = theta.len();
    let (m, v) = (&mut m[..n], &mut v[..n]);
    let terms: [(&[f32], f32); N] = std::array::from_fn(|j| (&terms[j].0[..n], terms[j].1));
    for i in 0..n {
        let mut g = terms[0].0[i] * terms[0].1;
        for (t, w) in &terms[1..] {
            g += t[i] * w;
        }
        update(&mut theta[i], &mut m[i], &mut v[i], g);
    }
}

/// `theta = theta - (g * lr + 0)` ([`rules::sgd`]), each gradient the terms' sum.
struct SgdSummed<'a> {
    terms: &'a [(&'a [f32], f32)],
    lr: f32,
}

impl candle_core::InplaceOp1 for SgdSummed<'_> {
    fn name(&self) -> &'static str {
        "strata-sgd-summed"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dst_l: &Layout) -> candle_core::Result<()> {
        let theta = slice_mut(dst, dst_l, "parameter")?;
        if self.terms.iter().any(|(t, _)| t.len() != theta.len()) {
            candle_core::bail!("fused optimizer: parameter and gradient terms differ in size");
        }
        let mut buf = [0f32; BLOCK];
        let mut at = 0;
        while at < theta.len() {
            let len = BLOCK.min(theta.len() - at);
            let g = &mut buf[..len];
            sum_block(g, self.terms, at);
            theta[at..at + len].iter_mut().zip(g.iter()).for_each(|(t, g)| rules::sgd(t, *g, self.lr));
            at += len;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::ShardableOptimizer;
    use candle_core::Device;
    use candle_nn::{Optimizer, ParamsAdamW};
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|i| if i % 13 == 0 { -0.0 } else { r.random::<f32>() * 2.0 - 1.0 }).collect()
    }

    /// The reference: the reduction's sum (`fused` in `cross_device::cpu`, each element's
    /// terms times their weights, left to right), made whole, then the optimizer's own step.
    fn reduced(terms: &[(Vec<f32>, f32)]) -> Vec<f32> {
        let mut out: Vec<f32> = terms[0].0.iter().map(|x| x * terms[0].1).collect();
        for (t, w) in &terms[1..] {
            out.iter_mut().zip(t).for_each(|(o, x)| *o += x * w);
        }
        out
    }

    /// Steps `O` over variables of `sizes` for 3 steps, each with `k` weighted gradient terms
    /// per variable, through `step_summed` (or, `whole`, their reference sums through `step`).
    fn run<O: ShardableOptimizer>(cfg: O::Config, sizes: &[usize], k: usize, whole: bool) -> Vec<Vec<f32>>
    where
        O::Config: Clone,
    {
        let dev = Device::Cpu;
        let vars: Vec<Var> =
            sizes.iter().enumerate().map(|(i, &n)| Var::from_vec(random(n, 1 + i as u64), n, &dev).unwrap()).collect();
        let mut opt = O::new(vars.clone(), cfg).unwrap();
        for step in 0..3u64 {
            let weights: Vec<f32> = (0..k).map(|j| 1.0 / (k as f32 + j as f32 * 0.37)).collect();
            let mut stores: Vec<GradStore> = (0..k).map(|_| GradStore::default()).collect();
            let mut sums = GradStore::default();
            for (i, v) in vars.iter().enumerate() {
                let n = v.elem_count();
                let terms: Vec<(Vec<f32>, f32)> =
                    (0..k).map(|j| (random(n, 100 * step + 10 * i as u64 + j as u64 + 7), weights[j])).collect();
                sums.insert(v.as_tensor(), Tensor::from_vec(reduced(&terms), n, &dev).unwrap());
                for (s, (t, _)) in stores.iter_mut().zip(terms) {
                    s.insert(v.as_tensor(), Tensor::from_vec(t, n, &dev).unwrap());
                }
            }
            if whole {
                opt.step(&sums).unwrap();
            } else {
                let terms: Vec<(&GradStore, f32)> = stores.iter().zip(weights).collect();
                opt.step_summed(&terms).expect("the fused optimizer steps summed terms").unwrap();
            }
        }
        vars.iter().map(|v| v.as_tensor().to_vec1::<f32>().unwrap()).collect()
    }

    /// AdamW's and SGD's steps on summed terms are the reduction followed by their own step,
    /// bit for bit (zeros of both signs among the terms), for 1 to 5 terms and sizes around the
    /// block (1, 15, 1023, 1024, 1025, 3000), at this CPU's vector width.
    #[test]
    fn a_step_on_summed_terms_is_the_reduction_then_the_step() {
        let sizes = [1, 15, 1023, 1024, 1025, 3000];
        let adamw = ParamsAdamW { lr: 0.01, weight_decay: 0.1, ..Default::default() };
        for k in 1..=5 {
            assert_eq!(
                run::<FusedAdamW>(adamw.clone(), &sizes, k, false),
                run::<FusedAdamW>(adamw.clone(), &sizes, k, true),
                "adamw, {k} terms"
            );
            assert_eq!(run::<FusedSgd>(0.1, &sizes, k, false), run::<FusedSgd>(0.1, &sizes, k, true), "sgd, {k} terms");
        }
    }

    /// The summed AdamW loop at pulp's scalar level and at this CPU's vector width is the
    /// scalar rule on the reference sums, bit for bit.
    #[test]
    fn the_summed_adamw_loop_is_the_rule_at_every_width() {
        for (k, n) in [(1, 1), (2, 17), (2, 1024), (3, 2049), (4, 33), (5, 4099)] {
            let s = AdamWScalars::new(0.01, 0.9, 0.999, 1e-8, 0.05, 1 + k);
            let terms: Vec<(Vec<f32>, f32)> =
                (0..k).map(|j| (random(n, 40 + j as u64), 0.5 - j as f32 * 0.1)).collect();
            let (theta, m) = (random(n, 1), random(n, 2));
            let v: Vec<f32> = random(n, 3).into_iter().map(f32::abs).collect();
            let mut want = (theta.clone(), m.clone(), v.clone());
            let g = reduced(&terms);
            for (((t, m), v), g) in want.0.iter_mut().zip(want.1.iter_mut()).zip(want.2.iter_mut()).zip(&g) {
                rules::adamw(t, m, v, *g, &s);
            }
            let slices: Vec<(&[f32], f32)> = terms.iter().map(|(t, w)| (t.as_slice(), *w)).collect();
            for scalar in [true, false] {
                let (mut t1, mut m1, mut v1) = (theta.clone(), m.clone(), v.clone());
                let run = AdamWSummedLoop { theta: &mut t1, m: &mut m1, v: &mut v1, terms: &slices, s: &s };
                if scalar {
                    pulp::WithSimd::with_simd(run, pulp::Scalar::new());
                } else {
                    pulp::Arch::new().dispatch(run);
                }
                assert_eq!((t1, m1, v1), want, "{k} terms, {n} elements, scalar level {scalar}");
            }
        }
    }

    /// `sum_of` (what an optimizer without `step_summed` is handed) is the reference sum.
    #[test]
    fn the_sum_handed_to_other_optimizers_is_the_reduction_s() {
        let dev = Device::Cpu;
        for k in 1..=5 {
            let terms: Vec<(Vec<f32>, f32)> = (0..k).map(|j| (random(1500, j as u64), 0.3 + j as f32)).collect();
            let tensors: Vec<(Tensor, f32)> =
                terms.iter().map(|(t, w)| (Tensor::from_vec(t.clone(), (30, 50), &dev).unwrap(), *w)).collect();
            let got = sum_of(&tensors).unwrap();
            assert_eq!(got.dims(), [30, 50]);
            assert_eq!(got.flatten_all().unwrap().to_vec1::<f32>().unwrap(), reduced(&terms), "{k} terms");
        }
    }

    /// A term that is not an f32 CPU tensor of the variable's size leaves the step to the sums
    /// (`None`), with nothing stepped.
    #[test]
    fn terms_the_loops_cannot_take_are_declined_before_anything_is_stepped() {
        let dev = Device::Cpu;
        let v = Var::from_vec(vec![1f32, 2.0, 3.0], 3, &dev).unwrap();
        let mut opt = FusedAdamW::new(vec![v.clone()], ParamsAdamW::default()).unwrap();
        let (mut a, mut b) = (GradStore::default(), GradStore::default());
        a.insert(v.as_tensor(), Tensor::new(&[1f32, 1.0, 1.0], &dev).unwrap());
        b.insert(v.as_tensor(), Tensor::new(&[1f32, 1.0], &dev).unwrap());
        assert!(opt.summed_step(&[(&a, 0.5), (&b, 0.5)]).is_none());
        let mut c = GradStore::default();
        c.insert(v.as_tensor(), Tensor::new(&[1f64, 1.0, 1.0], &dev).unwrap());
        assert!(opt.summed_step(&[(&a, 0.5), (&c, 0.5)]).is_none());
        assert_eq!(v.as_tensor().to_vec1::<f32>().unwrap(), [1.0, 2.0, 3.0]);
        assert_eq!(opt.step_t, 0);
    }
}

//! The optimizers of embedding tables: updates of one row at a time, in f32, with TensorFlow's
//! semantics for sparse (`IndexedSlices`) gradients: only the rows a gradient touches change,
//! their optimizer slots included.
//!
//! Which agree with the dense [`ServerOptimizer`] applied to the whole table with gradient rows
//! of zeros outside the touched rows: SGD always (its rule is strata-core's [`rules::sgd`], and a
//! zero gradient leaves a value as it is); Adagrad on touched rows bit for bit (the same
//! [`rules::adagrad`]), and on untouched rows too unless the accumulator starts at 0 with an
//! epsilon of 0 (where the dense update divides 0 by 0). FTRL and LazyAdam have no dense
//! counterpart that agrees: a dense FTRL recomputes every row from its `linear` slot (an
//! untouched row would lose its initial value), and a dense Adam decays the moments of
//! untouched rows and keeps moving them.

use std::fmt;

use serde::{Deserialize, Serialize};
use strata_core::optim::rules;
use strata_core::optim::schedule::LrSchedule;

/// The optimizer of one embedding table, applied to the rows an update touches.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum RowOptimizer {
    /// `w -= lr * g` ([`rules::sgd`]).
    Sgd {
        /// The learning rate.
        lr: f64,
    },
    /// Keras' Adagrad: `acc += g^2; w -= lr * g / (sqrt(acc) + eps)` ([`rules::adagrad`]).
    Adagrad {
        /// The learning rate.
        lr: f64,
        /// The accumulator's start value (Keras: 0.1).
        initial_accumulator: f64,
        /// Added to the denominator.
        eps: f64,
    },
    /// Keras' `Ftrl` (FTRL-Proximal, no L2 shrinkage), with `p = lr_power`:
    /// `accum' = accum + g^2; linear += g - (accum'^(-p) - accum^(-p)) / lr * w;
    /// quadratic = (beta + accum'^(-p)) / lr + 2 * l2;
    /// w = |linear| > l1 ? (sign(linear) * l1 - linear) / quadratic : 0`. Slots: the
    /// accumulator, then `linear`.
    Ftrl {
        /// The learning rate.
        lr: f64,
        /// The power of the accumulator (Keras: -0.5).
        lr_power: f64,
        /// The accumulator's start value (Keras: 0.1).
        initial_accumulator: f64,
        /// L1 regularization strength.
        l1: f64,
        /// L2 regularization strength.
        l2: f64,
        /// Keras' `beta` (0 by default).
        beta: f64,
    },
    /// TensorFlow Addons' `LazyAdam`: Adam whose moments change on the touched rows only, at
    /// update number `t` (from 1): `lr_t = lr * sqrt(1 - beta2^t) / (1 - beta1^t);
    /// m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; w -= lr_t * m / (sqrt(v) + eps)`.
    /// Slots: `m`, then `v`.
    LazyAdam {
        /// The learning rate.
        lr: f64,
        /// The first moment's decay.
        beta1: f64,
        /// The second moment's decay.
        beta2: f64,
        /// Added to the denominator.
        eps: f64,
    },
}

impl RowOptimizer {
    /// `sgd`, `adagrad`, `ftrl` or `lazy_adam`.
    pub fn name(&self) -> &'static str {
        match self {
            RowOptimizer::Sgd { .. } => "sgd",
            RowOptimizer::Adagrad { .. } => "adagrad",
            RowOptimizer::Ftrl { .. } => "ftrl",
            RowOptimizer::LazyAdam { .. } => "lazy_adam",
        }
    }

    /// The learning rate.
    pub fn learning_rate(&self) -> f64 {
        match *self {
            RowOptimizer::Sgd { lr }
            | RowOptimizer::Adagrad { lr, .. }
            | RowOptimizer::Ftrl { lr, .. }
            | RowOptimizer::LazyAdam { lr, .. } => lr,
        }
    }

    /// The same optimizer at learning rate `lr` (any number, not checked).
    pub fn with_learning_rate(&self, lr: f64) -> RowOptimizer {
        let mut o = self.clone();
        match &mut o {
            RowOptimizer::Sgd { lr: l }
            | RowOptimizer::Adagrad { lr: l, .. }
            | RowOptimizer::Ftrl { lr: l, .. }
            | RowOptimizer::LazyAdam { lr: l, .. } => *l = lr,
        }
        o
    }

    /// The optimizer of the task's update number `n` (0 for the first) under `schedule`: the
    /// schedule's shape scaled to this table's own rate, `schedule.at(n) * (lr / peak)` (the
    /// peak of a constant schedule is its rate), so a table whose rate is the schedule's peak
    /// follows the schedule exactly, and one at half the peak at half its rate every step.
    /// Without a schedule the optimizer as it is.
    pub fn at_step(&self, schedule: Option<&LrSchedule>, n: u64) -> RowOptimizer {
        let Some(s) = schedule else { return self.clone() };
        let peak = match *s {
            LrSchedule::Constant { lr } => lr,
            LrSchedule::WarmupCosine { peak, .. } | LrSchedule::WarmupLinear { peak, .. } => peak,
        };
        let rate = s.at(n);
        if peak == 0.0 || rate == 0.0 {
            return self.with_learning_rate(0.0);
        }
        self.with_learning_rate(rate * (self.learning_rate() / peak))
    }

    /// How many f32 slots per element the optimizer keeps.
    pub fn slots(&self) -> usize {
        match self {
            RowOptimizer::Sgd { .. } => 0,
            RowOptimizer::Adagrad { .. } => 1,
            RowOptimizer::Ftrl { .. } | RowOptimizer::LazyAdam { .. } => 2,
        }
    }

    /// Writes a new row's slots at their start values into `slots` (`slots()` blocks of the
    /// row's width, one after the other): Adagrad's and FTRL's accumulators start at
    /// `initial_accumulator`, everything else at 0.
    pub fn init_slots(&self, slots: &mut [f32]) {
        slots.fill(0.0);
        let dim = slots.len() / self.slots().max(1);
        match *self {
            RowOptimizer::Adagrad { initial_accumulator, .. } | RowOptimizer::Ftrl { initial_accumulator, .. } => {
                slots[..dim].fill(initial_accumulator as f32)
            }
            RowOptimizer::Sgd { .. } | RowOptimizer::LazyAdam { .. } => {}
        }
    }

    /// Applies the gradient `g` of one row to its values `w` and its `slots` (`slots()` blocks
    /// of `w.len()` elements, one after the other, as [`RowOptimizer::init_slots`] writes
    /// them). `t` is the update's number, from 1 (LazyAdam's bias correction).
    pub fn apply(&self, w: &mut [f32], g: &[f32], slots: &mut [f32], t: u64) {
        let dim = w.len();
        match *self {
            RowOptimizer::Sgd { lr } => {
                let lr = lr as f32;
                for (w, &g) in w.iter_mut().zip(g) {
                    rules::sgd(w, g, lr);
                }
            }
            RowOptimizer::Adagrad { lr, eps, .. } => {
                let (lr, eps) = (lr as f32, eps as f32);
                for ((w, &g), a) in w.iter_mut().zip(g).zip(slots.iter_mut()) {
                    rules::adagrad(w, a, g, lr, eps);
                }
            }
            RowOptimizer::Ftrl { lr, lr_power, l1, l2, beta, .. } => {
                let (acc, linear) = slots.split_at_mut(dim.min(slots.len()));
                let s = FtrlScalars { lr: lr as f32, lr_power, l1: l1 as f32, l2: l2 as f32, beta: beta as f32 };
                for (((w, &g), a), l) in w.iter_mut().zip(g).zip(acc.iter_mut()).zip(linear.iter_mut()) {
                    s.step(w, a, l, g);
                }
            }
            RowOptimizer::LazyAdam { lr, beta1, beta2, eps } => {
                let t = i32::try_from(t.max(1)).unwrap_or(i32::MAX);
                let lr_t = (lr * (1.0 - beta2.powi(t)).sqrt() / (1.0 - beta1.powi(t))) as f32;
                let (b1, b2, eps) = (beta1 as f32, beta2 as f32, eps as f32);
                let (c1, c2) = ((1.0 - beta1) as f32, (1.0 - beta2) as f32);
                let (m, v) = slots.split_at_mut(dim.min(slots.len()));
                for (((w, &g), m), v) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                    *m = b1 * *m + c1 * g;
                    *v = b2 * *v + c2 * (g * g);
                    *w -= lr_t * *m / (v.sqrt() + eps);
                }
            }
        }
    }
}

/// FTRL's parameters in f32 (TensorFlow's kernels compute in the variable's type).
struct FtrlScalars {
    lr: f32,
    lr_power: f64,
    l1: f32,
    l2: f32,
    beta: f32,
}

impl FtrlScalars {
    /// `acc^(-lr_power)`: a square root for Keras' default power -0.5, as TensorFlow's
    /// kernel special-cases it.
    fn pow(&self, acc: f32) -> f32 {
        if self.lr_power == -0.5 {
            acc.sqrt()
        } else {
            acc.powf(-self.lr_power as f32)
        }
    }

    fn step(&self, w: &mut f32, acc: &mut f32, linear: &mut f32, g: f32) {
        let acc_new = *acc + g * g;
        let (p_new, p_old) = (self.pow(acc_new), self.pow(*acc));
        *linear += g - (p_new - p_old) / self.lr * *w;
        let quadratic = (self.beta + p_new) / self.lr + 2.0 * self.l2;
        *w = if linear.abs() > self.l1 { (linear.signum() * self.l1 - *linear) / quadratic } else { 0.0 };
        *acc = acc_new;
    }
}

impl fmt::Display for RowOptimizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(lr {})", self.name(), self.learning_rate())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ServerOptimizer;

    /// One element's value and slots after `grads`, applied at updates 1, 2, ...
    fn run(opt: &RowOptimizer, w0: f32, grads: &[f32]) -> (f32, Vec<f32>) {
        let mut w = [w0];
        let mut slots = vec![0.0; opt.slots()];
        opt.init_slots(&mut slots);
        for (i, &g) in grads.iter().enumerate() {
            opt.apply(&mut w, &[g], &mut slots, i as u64 + 1);
        }
        (w[0], slots)
    }

    /// `a` (f32) within 1e-6 of `b`, relative to `b` beyond 1.
    fn close(a: f32, b: f64) {
        assert!((f64::from(a) - b).abs() < 1e-6 * b.abs().max(1.0), "{a} vs {b}");
    }

    #[test]
    fn sgd_closed_form() {
        // 1 - 0.5*2 = 0; 0 - 0.5*4 = -2.
        assert_eq!(run(&RowOptimizer::Sgd { lr: 0.5 }, 1.0, &[2.0, 4.0]).0, -2.0);
    }

    #[test]
    fn adagrad_closed_form() {
        // acc1 = 0.1 + 1 = 1.1, w1 = 1 - 0.1*1/sqrt(1.1); acc2 = 1.1 + 4 = 5.1,
        // w2 = w1 - 0.1*2/sqrt(5.1).
        let (w, slots) = run(&RowOptimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 0.0 }, 1.0, &[1.0, 2.0]);
        close(w, 1.0 - 0.1 / 1.1f64.sqrt() - 0.2 / 5.1f64.sqrt());
        close(slots[0], 5.1);
    }

    #[test]
    fn ftrl_closed_form() {
        // lr 0.1, lr_power -0.5, acc0 0.1, l1 0.01, l2 0.1, beta 0.5; w0 = 1.
        let (lr, l1, l2, beta) = (0.1f64, 0.01f64, 0.1f64, 0.5f64);
        let opt = RowOptimizer::Ftrl { lr, lr_power: -0.5, initial_accumulator: 0.1, l1, l2, beta };
        // Step 1, g = 1: acc1 = 1.1; linear1 = 0 + 1 - (sqrt(1.1) - sqrt(0.1)) / 0.1 * 1;
        // quadratic1 = (0.5 + sqrt(1.1)) / 0.1 + 0.2; w1 = (sign(l) 0.01 - l) / q.
        let lin1 = 1.0 - (1.1f64.sqrt() - 0.1f64.sqrt()) / lr;
        let w1 = (lin1.signum() * l1 - lin1) / ((beta + 1.1f64.sqrt()) / lr + 2.0 * l2);
        // Step 2, g = -2: acc2 = 5.1; linear2 = lin1 - 2 - (sqrt(5.1) - sqrt(1.1)) / 0.1 * w1.
        let lin2 = lin1 - 2.0 - (5.1f64.sqrt() - 1.1f64.sqrt()) / lr * w1;
        let w2 = (lin2.signum() * l1 - lin2) / ((beta + 5.1f64.sqrt()) / lr + 2.0 * l2);
        let (w, slots) = run(&opt, 1.0, &[1.0]);
        close(w, w1);
        let (w, slots2) = run(&opt, 1.0, &[1.0, -2.0]);
        close(w, w2);
        close(slots[1], lin1);
        close(slots2[0], 5.1);
        close(slots2[1], lin2);
        // |linear| at most l1: the weight is exactly 0.
        let opt = RowOptimizer::Ftrl { lr, lr_power: -0.5, initial_accumulator: 0.1, l1: 100.0, l2, beta };
        assert_eq!(run(&opt, 1.0, &[1.0]).0, 0.0);
        // Another power: acc^0.25.
        let opt = RowOptimizer::Ftrl { lr, lr_power: -0.25, initial_accumulator: 0.1, l1: 0.0, l2: 0.0, beta: 0.0 };
        let lin = 1.0 - (1.1f64.powf(0.25) - 0.1f64.powf(0.25)) / lr;
        close(run(&opt, 1.0, &[1.0]).0, -lin / (1.1f64.powf(0.25) / lr));
    }

    #[test]
    fn lazy_adam_closed_form() {
        let (lr, b1, b2, eps) = (0.01f64, 0.9f64, 0.999f64, 1e-7f64);
        let (mut w, mut m, mut v) = (1.0f64, 0.0f64, 0.0f64);
        for (t, g) in [(1, 0.5f64), (2, -1.5f64)] {
            let lr_t = lr * (1.0 - b2.powi(t)).sqrt() / (1.0 - b1.powi(t));
            m = b1 * m + (1.0 - b1) * g;
            v = b2 * v + (1.0 - b2) * g * g;
            w -= lr_t * m / (v.sqrt() + eps);
        }
        let (got, slots) = run(&RowOptimizer::LazyAdam { lr, beta1: b1, beta2: b2, eps }, 1.0, &[0.5, -1.5]);
        close(got, w);
        close(slots[0], m);
        close(slots[1], v);
    }

    /// SGD and Adagrad rows are the dense optimizers' elements bit for bit; a zero gradient
    /// leaves an SGD or Adagrad (accumulator above 0) element as it is, so the dense update of
    /// a whole table whose gradient is zero outside some rows equals the row update of those
    /// rows, everywhere.
    #[test]
    fn sgd_and_adagrad_rows_are_the_dense_updates_bit_for_bit() {
        let dim = 5;
        let w0: Vec<f32> = (0..4 * dim).map(|i| ((i * 37) % 101) as f32 * 0.02 - 1.0).collect();
        let touched = [1usize, 3];
        let pairs = [
            (ServerOptimizer::Sgd { lr: 0.3 }, RowOptimizer::Sgd { lr: 0.3 }),
            (
                ServerOptimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-7 },
                RowOptimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-7 },
            ),
        ];
        for (dense, rows) in pairs {
            let (mut dw, mut ds) = (w0.clone(), dense.new_slots(w0.len()));
            let (mut rw, mut rs) = (w0.clone(), vec![0.0f32; w0.len() * rows.slots()]);
            for r in 0..4 {
                rows.init_slots(&mut rs[r * dim * rows.slots()..(r + 1) * dim * rows.slots()]);
            }
            for step in 0..3u64 {
                let mut g = vec![0.0f32; w0.len()];
                for &r in &touched {
                    for j in 0..dim {
                        g[r * dim + j] = ((r * 13 + j * 7 + step as usize * 3) % 17) as f32 * 0.25 - 2.0;
                    }
                }
                let mut refs: Vec<&mut [f32]> = ds.iter_mut().map(Vec::as_mut_slice).collect();
                dense.apply(&mut dw, &g, &mut refs, step + 1);
                for &r in &touched {
                    let k = rows.slots();
                    rows.apply(
                        &mut rw[r * dim..(r + 1) * dim],
                        &g[r * dim..(r + 1) * dim],
                        &mut rs[r * dim * k..(r + 1) * dim * k],
                        step + 1,
                    );
                }
            }
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&dw), bits(&rw), "{rows}");
            if rows.slots() == 1 {
                assert_eq!(bits(&ds[0]), bits(&rs), "{rows} slots");
            }
        }
    }

    #[test]
    fn schedules_scale_the_tables_rate() {
        let s = LrSchedule::WarmupLinear { peak: 0.5, warmup_steps: 2, total_steps: 6, final_lr: 0.05 };
        let at = |lr: f64, n| RowOptimizer::Sgd { lr }.at_step(Some(&s), n).learning_rate();
        for n in 0..8 {
            assert_eq!(at(0.5, n).to_bits(), s.at(n).to_bits(), "the peak's rate follows the schedule exactly");
            assert!((at(0.25, n) - s.at(n) / 2.0).abs() < 1e-12);
        }
        assert_eq!(RowOptimizer::Sgd { lr: 0.3 }.at_step(None, 5).learning_rate(), 0.3);
    }
}

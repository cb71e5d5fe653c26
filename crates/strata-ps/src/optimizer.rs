//! The server-side optimizers: element-wise updates over a range of a variable, in f32, so a
//! pushed chunk is applied where it lands without assembling the whole gradient. The formulas
//! are strata-core's [`rules`], the ones the fused CPU optimizers and the CUDA kernels apply.

use std::fmt;

use serde::{Deserialize, Serialize};
use strata_core::optim::rules::{self, AdamWScalars};
use strata_core::optim::schedule::LrSchedule;

/// The optimizer a parameter server applies to every update, in f32, with strata-core's
/// element-wise [`rules`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ServerOptimizer {
    /// `w -= g * lr` ([`rules::sgd`]).
    Sgd {
        /// The learning rate.
        lr: f64,
    },
    /// SGD with momentum in PyTorch's form, as the CUDA kernel computes it:
    /// `v = v * m + g; w -= v * lr` ([`rules::momentum`]); Nesterov: `w -= (g + m * v) * lr`
    /// ([`rules::nesterov`]). At a constant learning rate this is Keras' form
    /// (`v' = m * v' - lr * g; w += v'`), whose velocity is `-lr` times this one.
    Momentum {
        /// The learning rate.
        lr: f64,
        /// The momentum `m`.
        momentum: f64,
        /// Nesterov momentum.
        nesterov: bool,
    },
    /// Adam with decoupled weight decay in candle-nn's formulation (strata-core's `FusedAdamW`,
    /// [`rules::adamw`]): `w = w * (1 - lr * wd) - lr * m_hat / (sqrt(v_hat) + eps)` with the
    /// bias-corrected moments, `eps` outside the square root.
    AdamW {
        /// The learning rate.
        lr: f64,
        /// The first moment's decay.
        beta1: f64,
        /// The second moment's decay.
        beta2: f64,
        /// Added to the denominator.
        eps: f64,
        /// The decoupled weight decay.
        weight_decay: f64,
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
}

impl ServerOptimizer {
    /// `sgd`, `momentum`, `adamw` or `adagrad`.
    pub fn name(&self) -> &'static str {
        match self {
            ServerOptimizer::Sgd { .. } => "sgd",
            ServerOptimizer::Momentum { .. } => "momentum",
            ServerOptimizer::AdamW { .. } => "adamw",
            ServerOptimizer::Adagrad { .. } => "adagrad",
        }
    }

    /// The learning rate.
    pub fn learning_rate(&self) -> f64 {
        match *self {
            ServerOptimizer::Sgd { lr }
            | ServerOptimizer::Momentum { lr, .. }
            | ServerOptimizer::AdamW { lr, .. }
            | ServerOptimizer::Adagrad { lr, .. } => lr,
        }
    }

    /// The same optimizer at learning rate `lr` (a schedule's rate for one step; any number,
    /// not checked: the schedule was).
    pub fn with_learning_rate(&self, lr: f64) -> ServerOptimizer {
        let mut o = self.clone();
        match &mut o {
            ServerOptimizer::Sgd { lr: l }
            | ServerOptimizer::Momentum { lr: l, .. }
            | ServerOptimizer::AdamW { lr: l, .. }
            | ServerOptimizer::Adagrad { lr: l, .. } => *l = lr,
        }
        o
    }

    /// How many f32 slots per element the optimizer keeps.
    pub fn slots(&self) -> usize {
        match self {
            ServerOptimizer::Sgd { .. } => 0,
            ServerOptimizer::Momentum { .. } | ServerOptimizer::Adagrad { .. } => 1,
            ServerOptimizer::AdamW { .. } => 2,
        }
    }

    /// Applies one update exactly as a ps task does: gradient `g` to `w` and its optimizer
    /// `slots` (as many as [`ServerOptimizer::slots`], each as long as `w`, zero at the start;
    /// Adagrad's accumulator starts at its initial value, see [`ServerOptimizer::new_slots`]).
    /// `t` is the update's number, from 1 (AdamW's bias correction). Used by
    /// `strata compare --simulate`.
    pub fn apply(&self, w: &mut [f32], g: &[f32], slots: &mut [&mut [f32]], t: u64) {
        apply_iter(self, w, g.iter().copied(), slots, t)
    }

    /// The optimizer's slots for a variable of `n` elements, at their start values.
    pub fn new_slots(&self, n: usize) -> Vec<Vec<f32>> {
        match *self {
            ServerOptimizer::Sgd { .. } => Vec::new(),
            ServerOptimizer::Momentum { .. } => vec![vec![0.0; n]],
            ServerOptimizer::AdamW { .. } => vec![vec![0.0; n], vec![0.0; n]],
            ServerOptimizer::Adagrad { initial_accumulator, .. } => vec![vec![initial_accumulator as f32; n]],
        }
    }

    /// [`ServerOptimizer::new_slots`], or `None` when the memory cannot be allocated (a ps
    /// task refuses the request then, and serves on).
    pub fn try_new_slots(&self, n: usize) -> Option<Vec<Vec<f32>>> {
        let init = match *self {
            ServerOptimizer::Adagrad { initial_accumulator, .. } => initial_accumulator as f32,
            _ => 0.0,
        };
        let mut slots = Vec::new();
        slots.try_reserve_exact(self.slots()).ok()?;
        for _ in 0..self.slots() {
            slots.push(filled(n, init)?);
        }
        Some(slots)
    }
}

/// A learning-rate schedule's kind, as the protocol and messages name it: `constant`,
/// `warmup_cosine` or `warmup_linear`.
pub fn schedule_kind(schedule: &LrSchedule) -> &'static str {
    match schedule {
        LrSchedule::Constant { .. } => "constant",
        LrSchedule::WarmupCosine { .. } => "warmup_cosine",
        LrSchedule::WarmupLinear { .. } => "warmup_linear",
    }
}

/// `n` copies of `value`, or `None` when the memory cannot be allocated.
pub(crate) fn filled(n: usize, value: f32) -> Option<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).ok()?;
    v.resize(n, value);
    Some(v)
}

impl fmt::Display for ServerOptimizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(lr {})", self.name(), self.learning_rate())
    }
}

/// [`ServerOptimizer::apply`] with the gradient as little-endian f32 bytes at any alignment (a
/// received frame), read in place.
pub(crate) fn apply_le_bytes(opt: &ServerOptimizer, w: &mut [f32], g: &[u8], slots: &mut [&mut [f32]], t: u64) {
    apply_iter(opt, w, g.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])), slots, t)
}

/// [`apply_le_bytes`] out of place: writes into `w` and `slots` the update of `w0` and `slots0`
/// (ranges of the same length), which stay as they are. The same bits as copying `w0` and
/// `slots0` over and applying in place, which is what it does: the ranges are a frame's worth
/// (256 KiB at most), so the copies are still in cache when the update reads them.
pub(crate) fn apply_le_bytes_from(
    opt: &ServerOptimizer,
    w0: &[f32],
    w: &mut [f32],
    g: &[u8],
    slots0: &[&[f32]],
    slots: &mut [&mut [f32]],
    t: u64,
) {
    w.copy_from_slice(w0);
    for (s, s0) in slots.iter_mut().zip(slots0) {
        s.copy_from_slice(s0);
    }
    apply_le_bytes(opt, w, g, slots, t)
}

fn apply_iter(opt: &ServerOptimizer, w: &mut [f32], g: impl Iterator<Item = f32>, slots: &mut [&mut [f32]], t: u64) {
    match *opt {
        ServerOptimizer::Sgd { lr } => {
            let lr = lr as f32;
            for (w, g) in w.iter_mut().zip(g) {
                rules::sgd(w, g, lr);
            }
        }
        ServerOptimizer::Momentum { lr, momentum, nesterov } => {
            let (lr, mu) = (lr as f32, momentum as f32);
            let [v] = slots else { return };
            if nesterov {
                for ((w, g), v) in w.iter_mut().zip(g).zip(v.iter_mut()) {
                    rules::nesterov(w, v, g, lr, mu);
                }
            } else {
                for ((w, g), v) in w.iter_mut().zip(g).zip(v.iter_mut()) {
                    rules::momentum(w, v, g, lr, mu);
                }
            }
        }
        ServerOptimizer::AdamW { lr, beta1, beta2, eps, weight_decay } => {
            let [m, v] = slots else { return };
            let step = usize::try_from(t.max(1)).unwrap_or(usize::MAX);
            let s = AdamWScalars::new(lr, beta1, beta2, eps, weight_decay, step);
            for (((w, g), m), v) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                rules::adamw(w, m, v, g, &s);
            }
        }
        ServerOptimizer::Adagrad { lr, eps, .. } => {
            let [acc] = slots else { return };
            let (lr, eps) = (lr as f32, eps as f32);
            for ((w, g), a) in w.iter_mut().zip(g).zip(acc.iter_mut()) {
                rules::adagrad(w, a, g, lr, eps);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(opt: ServerOptimizer, w0: f32, grads: &[f32]) -> f32 {
        let mut w = [w0];
        let mut slots = opt.new_slots(1);
        for (i, &g) in grads.iter().enumerate() {
            let mut refs: Vec<&mut [f32]> = slots.iter_mut().map(|s| s.as_mut_slice()).collect();
            opt.apply(&mut w, &[g], &mut refs, i as u64 + 1);
        }
        w[0]
    }

    #[test]
    fn sgd_closed_form() {
        assert_eq!(run(ServerOptimizer::Sgd { lr: 0.5 }, 1.0, &[2.0, 4.0]), 1.0 - 1.0 - 2.0);
    }

    #[test]
    fn momentum_closed_form() {
        // v1 = 1, w1 = 1 - 0.1*1 = 0.9; v2 = 0.9*1 + 2 = 2.9, w2 = 0.9 - 0.1*2.9 = 0.61 (Keras'
        // velocity is -0.1 times this one: -0.1, then -0.29).
        let w = run(ServerOptimizer::Momentum { lr: 0.1, momentum: 0.9, nesterov: false }, 1.0, &[1.0, 2.0]);
        assert!((w - 0.61).abs() < 1e-6, "{w}");
        // Nesterov: v1 = 1, w1 = 1 - 0.1*(1 + 0.9*1) = 0.81; v2 = 2.9, w2 = 0.81 - 0.1*(2 + 0.9*2.9)
        // = 0.349.
        let w = run(ServerOptimizer::Momentum { lr: 0.1, momentum: 0.9, nesterov: true }, 1.0, &[1.0, 2.0]);
        assert!((w - 0.349).abs() < 1e-6, "{w}");
    }

    #[test]
    fn adamw_closed_form() {
        let (lr, b1, b2, eps, wd) = (0.01f64, 0.9f64, 0.999f64, 1e-7f64, 0.1f64);
        let mut w = 1.0f64;
        let (mut m, mut v) = (0.0f64, 0.0f64);
        for (t, g) in [(1, 0.5f64), (2, -1.5f64)] {
            w -= lr * wd * w;
            m = b1 * m + (1.0 - b1) * g;
            v = b2 * v + (1.0 - b2) * g * g;
            let mhat = m / (1.0 - b1.powi(t));
            let vhat = v / (1.0 - b2.powi(t));
            w -= lr * mhat / (vhat.sqrt() + eps);
        }
        let got = run(ServerOptimizer::AdamW { lr, beta1: b1, beta2: b2, eps, weight_decay: wd }, 1.0, &[0.5, -1.5]);
        assert!((got as f64 - w).abs() < 1e-6, "{got} vs {w}");
    }

    #[test]
    fn adagrad_closed_form() {
        // acc1 = 0.1 + 1 = 1.1, w1 = 1 - 0.1*1/sqrt(1.1); acc2 = 1.1 + 4 = 5.1, w2 = w1 - 0.1*2/sqrt(5.1).
        let expected = 1.0 - 0.1 / 1.1f64.sqrt() - 0.2 / 5.1f64.sqrt();
        let got = run(ServerOptimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 0.0 }, 1.0, &[1.0, 2.0]);
        assert!((got as f64 - expected).abs() < 1e-6, "{got} vs {expected}");
    }

    /// The server's AdamW and momentum are the fused CPU optimizers' and the CUDA kernels'
    /// formulas, bit for bit: the same rules, element by element.
    #[test]
    fn adamw_and_momentum_are_the_shared_rules_bit_for_bit() {
        let w0: Vec<f32> = (0..257).map(|i| ((i * 37) % 101) as f32 * 0.02 - 1.0).collect();
        let grads: Vec<Vec<f32>> =
            (0..5).map(|s| (0..257).map(|i| ((i * 13 + s * 7) % 89) as f32 * 0.05 - 2.0).collect()).collect();
        let (lr, beta1, beta2, eps, weight_decay) = (0.01, 0.9, 0.999, 1e-7, 0.1);
        let adamw = ServerOptimizer::AdamW { lr, beta1, beta2, eps, weight_decay };
        let (mut w, mut slots) = (w0.clone(), adamw.new_slots(w0.len()));
        let (mut rw, mut rm, mut rv) = (w0.clone(), vec![0.0f32; w0.len()], vec![0.0f32; w0.len()]);
        for (t, g) in grads.iter().enumerate() {
            let mut refs: Vec<&mut [f32]> = slots.iter_mut().map(Vec::as_mut_slice).collect();
            adamw.apply(&mut w, g, &mut refs, t as u64 + 1);
            let s = AdamWScalars::new(lr, beta1, beta2, eps, weight_decay, t + 1);
            for i in 0..rw.len() {
                rules::adamw(&mut rw[i], &mut rm[i], &mut rv[i], g[i], &s);
            }
        }
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!((bits(&w), bits(&slots[0]), bits(&slots[1])), (bits(&rw), bits(&rm), bits(&rv)));

        let momentum = ServerOptimizer::Momentum { lr: 0.1, momentum: 0.9, nesterov: false };
        let (mut w, mut slots) = (w0.clone(), momentum.new_slots(w0.len()));
        let (mut rw, mut rv) = (w0.clone(), vec![0.0f32; w0.len()]);
        for (t, g) in grads.iter().enumerate() {
            let mut refs: Vec<&mut [f32]> = slots.iter_mut().map(Vec::as_mut_slice).collect();
            momentum.apply(&mut w, g, &mut refs, t as u64 + 1);
            for i in 0..rw.len() {
                rules::momentum(&mut rw[i], &mut rv[i], g[i], 0.1, 0.9);
            }
        }
        assert_eq!((bits(&w), bits(&slots[0])), (bits(&rw), bits(&rv)));
    }
}

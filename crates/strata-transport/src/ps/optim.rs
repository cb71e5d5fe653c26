//! The server-side optimizers: elementwise updates over a range of a variable, in f32, so a
//! pushed chunk is applied where it lands without assembling the whole gradient.

use super::ServerOptimizer;

/// Applies one update with gradient `g` (as many values as `w` has) to `w` (a range of a
/// variable) and its optimizer slots over the same range. `t` is the variable's step count
/// after this update (1 for its first update), used by AdamW's bias correction.
pub(crate) fn apply(opt: &ServerOptimizer, w: &mut [f32], g: &[f32], slots: &mut [&mut [f32]], t: u64) {
    apply_iter(opt, w, g.iter().copied(), slots, t)
}

/// [`apply`] with the gradient as little-endian f32 bytes at any alignment (a received frame),
/// read in place.
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
                *w -= lr * g;
            }
        }
        ServerOptimizer::Momentum { lr, momentum, nesterov } => {
            let (lr, m) = (lr as f32, momentum as f32);
            let [v] = slots else { return };
            if nesterov {
                for ((w, g), v) in w.iter_mut().zip(g).zip(v.iter_mut()) {
                    *v = m * *v - lr * g;
                    *w += m * *v - lr * g;
                }
            } else {
                for ((w, g), v) in w.iter_mut().zip(g).zip(v.iter_mut()) {
                    *v = m * *v - lr * g;
                    *w += *v;
                }
            }
        }
        ServerOptimizer::AdamW { lr, beta1, beta2, eps, weight_decay } => {
            let [m, v] = slots else { return };
            let t = t.max(1) as i32;
            let c1 = 1.0 - beta1.powi(t);
            let c2 = 1.0 - beta2.powi(t);
            let (lr, b1, b2, eps, decay) =
                (lr as f32, beta1 as f32, beta2 as f32, eps as f32, (lr * weight_decay) as f32);
            let (c1, c2) = (c1 as f32, c2 as f32);
            for (((w, g), m), v) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                *w -= decay * *w;
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
                let mhat = *m / c1;
                let vhat = *v / c2;
                *w -= lr * mhat / (vhat.sqrt() + eps);
            }
        }
        ServerOptimizer::Adagrad { lr, eps, .. } => {
            let [acc] = slots else { return };
            let (lr, eps) = (lr as f32, eps as f32);
            for ((w, g), a) in w.iter_mut().zip(g).zip(acc.iter_mut()) {
                *a += g * g;
                *w -= lr * g / (a.sqrt() + eps);
            }
        }
    }
}

/// The optimizer's slots for a variable of `n` elements, at their start values.
pub(crate) fn new_slots(opt: &ServerOptimizer, n: usize) -> Vec<Vec<f32>> {
    match *opt {
        ServerOptimizer::Sgd { .. } => Vec::new(),
        ServerOptimizer::Momentum { .. } => vec![vec![0.0; n]],
        ServerOptimizer::AdamW { .. } => vec![vec![0.0; n], vec![0.0; n]],
        ServerOptimizer::Adagrad { initial_accumulator, .. } => vec![vec![initial_accumulator as f32; n]],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(opt: ServerOptimizer, w0: f32, grads: &[f32]) -> f32 {
        let mut w = [w0];
        let mut slots = new_slots(&opt, 1);
        for (i, &g) in grads.iter().enumerate() {
            let mut refs: Vec<&mut [f32]> = slots.iter_mut().map(|s| s.as_mut_slice()).collect();
            apply(&opt, &mut w, &[g], &mut refs, i as u64 + 1);
        }
        w[0]
    }

    #[test]
    fn sgd_closed_form() {
        assert_eq!(run(ServerOptimizer::Sgd { lr: 0.5 }, 1.0, &[2.0, 4.0]), 1.0 - 1.0 - 2.0);
    }

    #[test]
    fn momentum_closed_form() {
        // v1 = -0.1*1 = -0.1, w1 = 0.9; v2 = 0.9*-0.1 - 0.1*2 = -0.29, w2 = 0.61.
        let w = run(ServerOptimizer::Momentum { lr: 0.1, momentum: 0.9, nesterov: false }, 1.0, &[1.0, 2.0]);
        assert!((w - 0.61).abs() < 1e-6, "{w}");
        // Nesterov: w1 = 1 + 0.9*-0.1 - 0.1 = 0.81; v2 = -0.29, w2 = 0.81 + 0.9*-0.29 - 0.2 = 0.349.
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
}

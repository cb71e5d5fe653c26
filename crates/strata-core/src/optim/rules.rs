//! The element-wise update rules of Strata's optimizers: one set of f32 formulas that every
//! optimizer applies, so that they agree bit for bit.
//!
//! - strata-core's [`FusedSgd`](super::FusedSgd) and [`FusedAdamW`](super::FusedAdamW) (and
//!   through them candle-nn's `SGD` and `AdamW`, whose formulation these are),
//! - the parameter server's optimizers (strata-ps' `ServerOptimizer`), over the range of a
//!   variable a pushed chunk covers,
//! - the CPU references of strata-cuda's kernels (`kernels/optim.cu`), which the kernels equal
//!   bit for bit.
//!
//! Each rule is a plain function of f32 values, written as the sequence of rounded f32
//! operations it performs; Rust never contracts `a * b + c` into a fused multiply-add, so the
//! order written is the order computed. The `+ 0.0` terms are candle's `affine(x, mul, 0)`: they
//! turn a negative zero into a positive one, which matters for bitwise equality.
//!
//! ```
//! use strata_core::optim::rules;
//!
//! let (mut w, mut v) = (1.0f32, 0.0f32);
//! rules::momentum(&mut w, &mut v, 2.0, 0.1, 0.9);
//! assert_eq!((w, v), (0.8, 2.0));
//! ```

/// candle's `affine(x, mul, 0.0)`: `x * mul + 0`.
#[inline]
pub fn affine0(x: f32, mul: f32) -> f32 {
    x * mul + 0.0
}

/// Plain SGD (candle-nn's `SGD`): `theta - (g * lr + 0)`.
#[inline]
pub fn sgd(theta: &mut f32, g: f32, lr: f32) {
    *theta -= affine0(g, lr);
}

/// SGD with momentum, PyTorch's heavy ball (no dampening; the velocity starts at zero and is
/// in units of the gradient): `v = v * momentum + g`, then `theta = theta - (v * lr + 0)`.
///
/// At a constant learning rate this is Keras' form (`v' = momentum * v' - lr * g; theta += v'`)
/// with `v' = -lr * v`. With `momentum = 0` and a finite velocity it equals [`sgd`] bit for
/// bit.
#[inline]
pub fn momentum(theta: &mut f32, v: &mut f32, g: f32, lr: f32, momentum: f32) {
    velocity(v, g, momentum);
    momentum_param(theta, *v, lr);
}

/// The velocity of SGD with momentum (heavy ball and Nesterov): `v = v * momentum + g`.
#[inline]
pub fn velocity(v: &mut f32, g: f32, momentum: f32) {
    *v = *v * momentum + g;
}

/// The heavy ball's parameter update from the velocity already updated ([`velocity`]):
/// `theta = theta - (v * lr + 0)`. [`momentum`] is [`velocity`] then this.
#[inline]
pub fn momentum_param(theta: &mut f32, v: f32, lr: f32) {
    *theta -= affine0(v, lr);
}

/// SGD with Nesterov momentum, as PyTorch computes it: `v = v * momentum + g`, then
/// `g' = g + v * momentum` and `theta = theta - (g' * lr + 0)`.
#[inline]
pub fn nesterov(theta: &mut f32, v: &mut f32, g: f32, lr: f32, momentum: f32) {
    velocity(v, g, momentum);
    nesterov_param(theta, *v, g, lr, momentum);
}

/// Nesterov's parameter update from the velocity already updated ([`velocity`]):
/// `theta = theta - ((g + v * momentum) * lr + 0)`. [`nesterov`] is [`velocity`] then this.
#[inline]
pub fn nesterov_param(theta: &mut f32, v: f32, g: f32, lr: f32, momentum: f32) {
    let look_ahead = g + v * momentum;
    *theta -= affine0(look_ahead, lr);
}

/// The f32 scalars of one AdamW step, computed from the hyper-parameters (f64, as candle-nn's
/// `ParamsAdamW` holds them) and the step count exactly as candle-nn's `AdamW` does: in f64,
/// then rounded to f32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWScalars {
    /// The first moment's decay.
    pub beta1: f32,
    /// `1 - beta1`
    pub one_minus_beta1: f32,
    /// The second moment's decay.
    pub beta2: f32,
    /// `1 - beta2`
    pub one_minus_beta2: f32,
    /// `1 / (1 - beta1^t)`
    pub scale_m: f32,
    /// `1 / (1 - beta2^t)`
    pub scale_v: f32,
    /// Added to the denominator, outside the square root.
    pub eps: f32,
    /// The learning rate.
    pub lr: f32,
    /// `1 - lr * weight_decay`
    pub keep: f32,
}

impl AdamWScalars {
    /// The scalars of step `step_t` (1 for the first step) with the given hyper-parameters
    /// (`candle_nn::ParamsAdamW { lr, beta1, beta2, eps, weight_decay }`).
    pub fn new(lr: f64, beta1: f64, beta2: f64, eps: f64, weight_decay: f64, step_t: usize) -> Self {
        let lr_lambda = lr * weight_decay;
        let scale_m = 1f64 / (1f64 - beta1.powi(step_t as i32));
        let scale_v = 1f64 / (1f64 - beta2.powi(step_t as i32));
        AdamWScalars {
            beta1: beta1 as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            scale_m: scale_m as f32,
            scale_v: scale_v as f32,
            eps: eps as f32,
            lr: lr as f32,
            keep: (1f64 - lr_lambda) as f32,
        }
    }
}

/// An exponential moving average as candle-nn's AdamW updates its moments:
/// `m = (m * decay + 0) + (x * scale + 0)`, where `x` is the gradient for the first moment
/// and its square `g * g` for the second.
///
/// Computed as `(m * decay + x * scale) + 0`, one addition fewer and the same bits for every
/// input: `+ 0` only turns a negative zero into a positive one (and keeps a NaN), a sum with a
/// nonzero result is the same whatever the signs of zero among its terms, and a sum whose
/// result is zero comes out `+0` either way (`-0 + -0`, the only sum that gives `-0`, is
/// `+0` once the final `+ 0` is added). A NaN in gives a NaN out in both (Rust fixes no NaN's
/// sign or payload, in either form).
/// `moment_is_candle_nn_s_literal_formula_bit_for_bit` checks it on special and random values.
#[inline]
pub fn moment(m: &mut f32, x: f32, decay: f32, scale: f32) {
    *m = (*m * decay + x * scale) + 0.0;
}

/// AdamW's parameter update from the moments already updated (candle-nn's formulation):
/// `theta = (theta * keep + 0) - ((m * scale_m + 0) / (sqrt(v * scale_v + 0) * 1 + eps) * lr + 0)`.
///
/// Computed with two additions fewer (and no multiplication by one) and the same bits for
/// every input (with [`moment`]'s, the additions of `+ 0` dropped were a third of the rule's
/// work on a CPU whose adders bound it):
/// `theta = (theta * keep - (m * scale_m) / (sqrt(v * scale_v + 0) + eps) * lr) + 0`.
/// - `(a + 0) - (b + 0)` is `(a - b) + 0`: a nonzero difference does not depend on the signs
///   of zero among its operands, and a zero one is `+0` in both (`-0 - +0`, the only
///   difference that gives `-0`, is `+0` once `+ 0` is added); a NaN operand gives a NaN in
///   both.
/// - After that final `+ 0` the sign of a zero `b` no longer matters, so `m * scale_m` needs no
///   `+ 0`: the sign of its zero reaches only the sign of a zero quotient (`0 / 0` is NaN for
///   either sign).
/// - `x * 1` is `x`. `v * scale_v + 0` keeps its `+ 0`: with `eps = -0` the sign of a zero
///   square root reaches the quotient's infinity.
///
/// `adamw_param_is_candle_nn_s_literal_formula_bit_for_bit` checks it on special and random
/// values and scalars (negative, zero and infinite ones included).
#[inline]
pub fn adamw_param(theta: &mut f32, m: f32, v: f32, s: &AdamWScalars) {
    let m_hat = m * s.scale_m;
    let v_hat = affine0(v, s.scale_v);
    let adjusted = m_hat / (v_hat.sqrt() + s.eps);
    *theta = (*theta * s.keep - adjusted * s.lr) + 0.0;
}

/// One AdamW step of one element: both moments ([`moment`]), then the parameter
/// ([`adamw_param`]). The same bits as candle-nn's three whole-tensor passes, since each
/// element's operations depend on that element only.
#[inline]
pub fn adamw(theta: &mut f32, m: &mut f32, v: &mut f32, g: f32, s: &AdamWScalars) {
    moment(m, g, s.beta1, s.one_minus_beta1);
    moment(v, g * g, s.beta2, s.one_minus_beta2);
    adamw_param(theta, *m, *v, s);
}

/// Keras' Adagrad: `acc = acc + g * g`, then `theta = theta - (lr * g) / (sqrt(acc) + eps)`
/// (the accumulator starts at Keras' `initial_accumulator_value`).
#[inline]
pub fn adagrad(theta: &mut f32, acc: &mut f32, g: f32, lr: f32, eps: f32) {
    *acc += g * g;
    *theta -= lr * g / (acc.sqrt() + eps);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_momentum_is_sgd_and_affine_makes_negative_zeros_positive() {
        for (w0, g) in [(1.0f32, 0.25f32), (-3.5, 7.0), (0.0, -0.0), (-0.0, 0.0), (1e-30, 3e-9)] {
            let (mut a, mut b, mut v) = (w0, w0, 0.0f32);
            sgd(&mut a, g, 0.3);
            momentum(&mut b, &mut v, g, 0.3, 0.0);
            assert_eq!(a.to_bits(), b.to_bits(), "{w0} {g}");
        }
        assert_eq!(affine0(-0.0, 1.0).to_bits(), 0.0f32.to_bits());
    }

    /// Heavy ball and Nesterov at a constant learning rate equal Keras' forms (in exact
    /// arithmetic; here to a few ulps), whose velocity is `-lr` times this one.
    #[test]
    fn momentum_forms_equal_keras_at_a_constant_learning_rate() {
        let (lr, mu) = (0.1f64, 0.9f64);
        let grads = [1.0f64, 2.0, -0.5, 0.25, 3.0];
        for nesterov_form in [false, true] {
            let (mut w, mut v) = (1.0f32, 0.0f32);
            let (mut kw, mut kv) = (1.0f64, 0.0f64);
            for &g in &grads {
                if nesterov_form {
                    nesterov(&mut w, &mut v, g as f32, lr as f32, mu as f32);
                    kv = mu * kv - lr * g;
                    kw += mu * kv - lr * g;
                } else {
                    momentum(&mut w, &mut v, g as f32, lr as f32, mu as f32);
                    kv = mu * kv - lr * g;
                    kw += kv;
                }
                assert!((w as f64 - kw).abs() < 1e-6, "nesterov {nesterov_form}: {w} vs {kw}");
                assert!((-(lr * v as f64) - kv).abs() < 1e-6, "nesterov {nesterov_form}: velocity {v} vs {kv}");
            }
        }
    }

    /// candle-nn's formulas as written: each `affine` with its `+ 0`.
    fn literal_moment(m: f32, x: f32, decay: f32, scale: f32) -> f32 {
        affine0(m, decay) + affine0(x, scale)
    }

    fn literal_adamw_param(theta: f32, m: f32, v: f32, s: &AdamWScalars) -> f32 {
        let m_hat = affine0(m, s.scale_m);
        let v_hat = affine0(v, s.scale_v);
        #[allow(clippy::identity_op)]
        let adjusted = m_hat / (v_hat.sqrt() * 1.0 + s.eps);
        affine0(theta, s.keep) - affine0(adjusted, s.lr)
    }

    /// Values that exercise every case of the rules' proofs: zeros of both signs, the
    /// smallest subnormals and normals, infinities, NaNs with different payloads, and
    /// ordinary magnitudes of both signs; then pseudo-random bit patterns.
    fn values() -> Vec<f32> {
        let mut v = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            f32::from_bits(1),
            f32::from_bits(0x8000_0001),
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::from_bits(0x7fc0_0001),
            f32::from_bits(0xffc0_0002),
            0.5,
            -3.25,
            1e-20,
            -1e-20,
            1e20,
        ];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..40 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v.push(f32::from_bits((x >> 32) as u32));
            v.push(((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0);
        }
        v
    }

    /// The same bits, or both NaN: Rust leaves a NaN's sign and payload unspecified (LLVM may
    /// swap an addition's operands), so the literal formula fixes no NaN's bits either.
    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn moment_is_candle_nn_s_literal_formula_bit_for_bit() {
        let vals = values();
        for &m in &vals {
            for &x in &vals {
                for (decay, scale) in [(0.9, 0.1), (0.999, 0.001), (-0.5, 2.0), (0.0, -0.0), (1.0, f32::INFINITY)] {
                    let mut got = m;
                    moment(&mut got, x, decay, scale);
                    let want = literal_moment(m, x, decay, scale);
                    assert!(same(got, want), "m {m:e} x {x:e} decay {decay} scale {scale}: {got:e} != {want:e}");
                }
            }
        }
    }

    #[test]
    fn adamw_param_is_candle_nn_s_literal_formula_bit_for_bit() {
        let vals = values();
        let scalars = [
            AdamWScalars::new(1e-3, 0.9, 0.999, 1e-8, 0.01, 1),
            AdamWScalars::new(0.05, 0.9, 0.999, 1e-8, 0.1, 7),
            AdamWScalars::new(0.05, 0.9, 0.999, 0.0, 0.0, 3),
            AdamWScalars {
                scale_m: -2.0,
                scale_v: -0.5,
                keep: -1.0,
                lr: -0.1,
                ..AdamWScalars::new(0.1, 0.9, 0.99, 0.0, 0.0, 2)
            },
            AdamWScalars { lr: f32::INFINITY, eps: -0.0, ..AdamWScalars::new(0.1, 0.9, 0.99, 0.0, 0.0, 2) },
            AdamWScalars { scale_v: -0.5, eps: -0.0, ..AdamWScalars::new(0.1, 0.9, 0.99, 0.0, 0.0, 2) },
            AdamWScalars { lr: 0.0, keep: 0.0, scale_m: 0.0, ..AdamWScalars::new(0.1, 0.9, 0.99, 1e-8, 0.0, 2) },
        ];
        for s in &scalars {
            for &theta in &vals {
                for &m in &vals {
                    for &v in vals.iter().step_by(3).chain(&[-0.0f32]) {
                        let mut got = theta;
                        adamw_param(&mut got, m, v, s);
                        let want = literal_adamw_param(theta, m, v, s);
                        assert!(same(got, want), "theta {theta:e} m {m:e} v {v:e} {s:?}: {got:e} != {want:e}");
                    }
                }
            }
        }
    }

    #[test]
    fn adamw_scalars_are_candle_nn_s() {
        let s = AdamWScalars::new(0.01, 0.9, 0.999, 1e-7, 0.1, 2);
        assert_eq!(s.one_minus_beta1, (1.0f64 - 0.9) as f32);
        assert_eq!(s.scale_m, (1.0f64 / (1.0 - 0.9f64.powi(2))) as f32);
        assert_eq!(s.scale_v, (1.0f64 / (1.0 - 0.999f64.powi(2))) as f32);
        assert_eq!(s.keep, (1.0f64 - 0.01 * 0.1) as f32);
    }
}

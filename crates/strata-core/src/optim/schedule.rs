//! Learning-rate schedules: the learning rate of every optimizer step, from the step's number
//! (Keras' `LearningRateSchedule`, PyTorch's schedulers stepped once per optimizer step).
//! [`DistributedOptimizer::with_schedule`](crate::DistributedOptimizer::with_schedule) applies
//! one on every replica before each step, so every copy uses the same rate.
//!
//! ```
//! use strata_core::optim::schedule::LrSchedule;
//!
//! let s = LrSchedule::WarmupCosine { peak: 0.1, warmup_steps: 10, total_steps: 110, final_lr: 0.0 };
//! assert_eq!(s.at(0), 0.0);           // warm-up from zero (the first step's rate is 0)
//! assert_eq!(s.at(5), 0.05);
//! assert_eq!(s.at(10), 0.1);          // the peak after the warm-up
//! assert!((s.at(60) - 0.05).abs() < 1e-12); // half way down the cosine
//! assert_eq!(s.at(500), 0.0);         // the final rate after the last step
//! ```

use crate::{Error, Result};

/// The learning rate as a function of the optimizer step (0 for the first).
#[derive(Clone, Debug, PartialEq)]
pub enum LrSchedule {
    /// The same rate every step.
    Constant {
        /// The learning rate.
        lr: f64,
    },
    /// A linear warm-up from 0 to `peak` over `warmup_steps`, then a cosine decay to
    /// `final_lr` at `total_steps` (and `final_lr` after it).
    WarmupCosine {
        /// The rate after the warm-up.
        peak: f64,
        /// Steps of linear warm-up (0: none).
        warmup_steps: u64,
        /// The step at which the decay ends.
        total_steps: u64,
        /// The rate at and after `total_steps`.
        final_lr: f64,
    },
    /// A linear warm-up from 0 to `peak` over `warmup_steps`, then a linear decay to
    /// `final_lr` at `total_steps` (and `final_lr` after it).
    WarmupLinear {
        /// The rate after the warm-up.
        peak: f64,
        /// Steps of linear warm-up (0: none).
        warmup_steps: u64,
        /// The step at which the decay ends.
        total_steps: u64,
        /// The rate at and after `total_steps`.
        final_lr: f64,
    },
}

impl LrSchedule {
    /// Checks the schedule: finite rates that are not negative, a peak above zero, and a decay
    /// that ends after the warm-up.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str, detail: String| Err(Error::InvalidSchedule { schedule: what.to_string(), detail });
        match *self {
            LrSchedule::Constant { lr } => {
                if !(lr.is_finite() && lr >= 0.0) {
                    return bad("constant", format!("learning rate {lr}: use a finite rate of 0 or more"));
                }
            }
            LrSchedule::WarmupCosine { peak, warmup_steps, total_steps, final_lr }
            | LrSchedule::WarmupLinear { peak, warmup_steps, total_steps, final_lr } => {
                let name =
                    if matches!(self, LrSchedule::WarmupCosine { .. }) { "warm-up cosine" } else { "warm-up linear" };
                if !(peak.is_finite() && peak > 0.0 && final_lr.is_finite() && final_lr >= 0.0) {
                    return bad(
                        name,
                        format!(
                            "peak {peak} and final rate {final_lr}: use a positive peak and a final rate of 0 or more"
                        ),
                    );
                }
                if total_steps <= warmup_steps {
                    return bad(name, format!("{total_steps} total steps with {warmup_steps} of warm-up: the decay must end after the warm-up"));
                }
            }
        }
        Ok(())
    }

    /// The learning rate of optimizer step `step` (0 for the first).
    pub fn at(&self, step: u64) -> f64 {
        match *self {
            LrSchedule::Constant { lr } => lr,
            LrSchedule::WarmupCosine { peak, warmup_steps, total_steps, final_lr }
            | LrSchedule::WarmupLinear { peak, warmup_steps, total_steps, final_lr } => {
                if step < warmup_steps {
                    return peak * step as f64 / warmup_steps as f64;
                }
                let span = total_steps.saturating_sub(warmup_steps).max(1) as f64;
                let progress = ((step - warmup_steps) as f64 / span).min(1.0);
                if matches!(self, LrSchedule::WarmupCosine { .. }) {
                    final_lr + (peak - final_lr) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
                } else {
                    peak + (final_lr - peak) * progress
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_decay_and_validation() {
        let s = LrSchedule::WarmupLinear { peak: 1.0, warmup_steps: 2, total_steps: 6, final_lr: 0.2 };
        let want = [0.0, 0.5, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2];
        for (k, w) in want.iter().enumerate() {
            assert!((s.at(k as u64) - w).abs() < 1e-12, "step {k}: {} vs {w}", s.at(k as u64));
        }
        assert!(s.validate().is_ok());
        let e = LrSchedule::WarmupLinear { peak: 1.0, warmup_steps: 5, total_steps: 5, final_lr: 0.0 }
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("must end after the warm-up"), "{e}");
        assert!(LrSchedule::Constant { lr: f64::NAN }.validate().is_err());
        assert_eq!(LrSchedule::Constant { lr: 0.3 }.at(1000), 0.3);
    }
}

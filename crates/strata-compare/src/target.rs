//! What an experiment's time to target measures ([`Target`]): a test accuracy or a validation
//! loss, and whether an evaluation reached it.

use serde::Serialize;

use strata::metrics::MetricRecord;

/// What the time-to-target columns measure: the first evaluation at or above a test accuracy
/// (the digits models), or at or below a validation loss (the transformer, nats per character;
/// lower is better).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    /// Test accuracy in (0, 1].
    Accuracy(f32),
    /// Validation loss in nats per character.
    Loss(f64),
}

impl Target {
    /// Whether evaluation `r` reached the target.
    pub fn reached(&self, r: &MetricRecord) -> bool {
        match *self {
            Target::Accuracy(t) => r.accuracy.is_some_and(|a| a >= t),
            Target::Loss(t) => r.validation_loss.is_some_and(|l| f64::from(l) <= t),
        }
    }

    /// The target accuracy, if it is one.
    pub fn accuracy(&self) -> Option<f32> {
        match *self {
            Target::Accuracy(t) => Some(t),
            Target::Loss(_) => None,
        }
    }

    /// `97.00% test accuracy` or `a validation loss of 1.90 nats per character`.
    pub fn describe(&self) -> String {
        match *self {
            Target::Accuracy(t) => format!("{:.2}% test accuracy", f64::from(t) * 100.0),
            Target::Loss(t) => format!("a validation loss of {t:.2} nats per character"),
        }
    }

    /// The target as a short value: `97.00%` or `loss 1.90`.
    pub fn short(&self) -> String {
        match *self {
            Target::Accuracy(t) => format!("{:.2}%", f64::from(t) * 100.0),
            Target::Loss(t) => format!("loss {t:.2}"),
        }
    }
}

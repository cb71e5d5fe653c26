//! What an experiment's time to target measures ([`Target`]): a test accuracy, a validation
//! loss or a test AUC, and whether an evaluation reached it.

use serde::Serialize;

use strata::metrics::MetricRecord;

/// What the time-to-target columns measure: the first evaluation at or above a test accuracy
/// (the digits models), at or below a validation loss (the transformer, nats per character;
/// lower is better), or at or above a test AUC (the ctr model, whose experiment may set no
/// target: its report then gives the final AUC and its gap to the best reachable only).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    /// Test accuracy in (0, 1].
    Accuracy(f32),
    /// Validation loss in nats per character.
    Loss(f64),
    /// Test AUC in (0.5, 1], or `None`: no target.
    Auc(Option<f64>),
}

impl Target {
    /// Whether evaluation `r` reached the target (never, for an AUC without a target).
    pub fn reached(&self, r: &MetricRecord) -> bool {
        match *self {
            Target::Accuracy(t) => r.accuracy.is_some_and(|a| a >= t),
            Target::Loss(t) => r.validation_loss.is_some_and(|l| f64::from(l) <= t),
            Target::Auc(t) => t.is_some_and(|t| r.auc.is_some_and(|a| f64::from(a) >= t)),
        }
    }

    /// Whether there is a target to reach (an AUC experiment may set none).
    pub fn is_set(&self) -> bool {
        !matches!(self, Target::Auc(None))
    }

    /// The target accuracy, if it is one.
    pub fn accuracy(&self) -> Option<f32> {
        match *self {
            Target::Accuracy(t) => Some(t),
            Target::Loss(_) | Target::Auc(_) => None,
        }
    }

    /// The target AUC, if it is one.
    pub fn auc(&self) -> Option<f64> {
        match *self {
            Target::Auc(t) => t,
            Target::Accuracy(_) | Target::Loss(_) => None,
        }
    }

    /// `97.00% test accuracy`, `a validation loss of 1.90 nats per character` or `a test AUC of
    /// 0.7700`.
    pub fn describe(&self) -> String {
        match *self {
            Target::Accuracy(t) => format!("{:.2}% test accuracy", f64::from(t) * 100.0),
            Target::Loss(t) => format!("a validation loss of {t:.2} nats per character"),
            Target::Auc(Some(t)) => format!("a test AUC of {t:.4}"),
            Target::Auc(None) => "no target AUC (target_auc not set)".to_string(),
        }
    }

    /// The target as a short value: `97.00%`, `loss 1.90` or `AUC 0.7700`.
    pub fn short(&self) -> String {
        match *self {
            Target::Accuracy(t) => format!("{:.2}%", f64::from(t) * 100.0),
            Target::Loss(t) => format!("loss {t:.2}"),
            Target::Auc(Some(t)) => format!("AUC {t:.4}"),
            Target::Auc(None) => "no target".to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_auc_target_is_reached_at_or_above_it_and_none_is_never_reached() {
        let eval = |auc: f32| MetricRecord::eval_auc(1, 1, 1.0, 10, auc);
        assert!(Target::Auc(Some(0.75)).reached(&eval(0.75)));
        assert!(!Target::Auc(Some(0.75)).reached(&eval(0.7499)));
        assert!(!Target::Auc(None).reached(&eval(0.99)));
        assert!(!Target::Auc(Some(0.5)).reached(&MetricRecord::eval(1, 1, 1.0, 10, 0.9)));
        assert!(!Target::Accuracy(0.5).reached(&eval(0.9)));
        assert_eq!((Target::Auc(Some(0.77)).short(), Target::Auc(None).is_set()), ("AUC 0.7700".to_string(), false));
        assert_eq!(Target::Auc(Some(0.77)).auc(), Some(0.77));
    }
}

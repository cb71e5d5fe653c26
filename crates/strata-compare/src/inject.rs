//! Heterogeneity injection: slow workers and random stragglers, so that the trade-offs
//! between synchronous and asynchronous training show on one machine.
//!
//! A step of worker `w` that computed for `c` sleeps `c * (factor(w) - 1)` (a worker that is
//! `factor` times slower), plus, with the stragglers' probability, a delay drawn from their
//! distribution. The draw depends only on the seed, the worker and the step, so a run can be
//! repeated. [`StepDelays`] is a [`StepHook`]: the trainer and the parameter-server worker call
//! it between a step's gradients and their synchronisation, so the delays stay out of the
//! training loop's own code. Network delay is the transport's (`strata_transport::inject`).

use std::time::Duration;

use rand::{Rng, SeedableRng};

use strata::trainer::StepHook;

use crate::experiment::{DelayDistribution, Stragglers};
use crate::{Error, Result};

/// The step delays of one process.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepDelays {
    /// Worker index and factor.
    pub slowdown: Vec<(usize, f64)>,
    /// Random stragglers.
    pub stragglers: Option<Stragglers>,
    /// Seed of the straggler draws.
    pub seed: u64,
}

impl StepDelays {
    /// Whether no step is ever delayed.
    pub fn is_empty(&self) -> bool {
        self.slowdown.iter().all(|(_, f)| *f == 1.0) && self.stragglers.is_none()
    }

    /// The factor of worker `w`.
    pub fn factor(&self, w: usize) -> f64 {
        self.slowdown.iter().find(|(i, _)| *i == w).map_or(1.0, |(_, f)| *f)
    }

    /// How long step `step` of worker `w`, which computed for `compute`, sleeps.
    pub fn delay(&self, w: usize, step: u64, compute: Duration) -> Duration {
        let mut d = compute.mul_f64((self.factor(w) - 1.0).max(0.0));
        if let Some(s) = &self.stragglers {
            let key =
                self.seed ^ (w as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ step.wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(key);
            if rng.random::<f64>() < s.probability {
                d += s.delay.sample(rng.random::<f64>());
            }
        }
        d
    }

    /// From the flags of `strata train` / `strata worker`.
    pub fn from_flags(slowdown: &[String], probability: f64, delay: Option<&str>, seed: u64) -> Result<Self> {
        let mut out = StepDelays { seed, ..Default::default() };
        for s in slowdown {
            let bad =
                || Error::Usage(format!("--worker-slowdown {s:?} is not INDEX=FACTOR with FACTOR >= 1, e.g. 2=5"));
            let (i, f) = s.split_once('=').ok_or_else(bad)?;
            let (i, f): (usize, f64) = (i.trim().parse().map_err(|_| bad())?, f.trim().parse().map_err(|_| bad())?);
            if !(f.is_finite() && f >= 1.0) {
                return Err(bad());
            }
            out.slowdown.push((i, f));
        }
        if !(0.0..=1.0).contains(&probability) {
            return Err(Error::Usage(format!("--straggler-probability {probability} must be between 0 and 1")));
        }
        match (probability > 0.0, delay) {
            (true, Some(d)) => {
                let delay: DelayDistribution =
                    d.parse().map_err(|e: String| Error::Usage(format!("--straggler-delay: {e}")))?;
                out.stragglers = Some(Stragglers { probability, delay });
            }
            (true, None) => {
                return Err(Error::Usage(
                    "--straggler-probability needs --straggler-delay (e.g. exp:20ms, fixed:50ms, uniform:10ms..50ms)"
                        .into(),
                ))
            }
            (false, _) => {}
        }
        Ok(out)
    }

    /// The flags that give a worker process these delays.
    pub fn to_worker_flags(&self, worker: usize) -> Vec<String> {
        let mut args = vec!["--slowdown".to_string(), self.factor(worker).to_string()];
        if let Some(s) = &self.stragglers {
            args.extend([
                "--straggler-probability".into(),
                s.probability.to_string(),
                "--straggler-delay".into(),
                s.delay.to_string(),
            ]);
        }
        args.extend(["--inject-seed".into(), self.seed.to_string()]);
        args
    }
}

impl StepHook for StepDelays {
    fn after_backward(&self, worker: usize, step: u64, compute: Duration) {
        std::thread::sleep(self.delay(worker, step, compute));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slow_workers_sleep_in_proportion_and_stragglers_are_reproducible() {
        let d = StepDelays::from_flags(&["1=3".into()], 0.0, None, 0).unwrap();
        assert_eq!(d.delay(1, 5, Duration::from_millis(10)), Duration::from_millis(20));
        assert_eq!(d.delay(0, 5, Duration::from_millis(10)), Duration::ZERO);
        let s = StepDelays::from_flags(&[], 0.25, Some("fixed:7ms"), 42).unwrap();
        let hits: Vec<bool> = (0..4000).map(|k| s.delay(0, k, Duration::ZERO) == Duration::from_millis(7)).collect();
        let n = hits.iter().filter(|h| **h).count();
        assert!((800..1200).contains(&n), "{n} of 4000 steps delayed with p = 0.25");
        let again: Vec<bool> = (0..4000).map(|k| s.delay(0, k, Duration::ZERO) == Duration::from_millis(7)).collect();
        assert_eq!(hits, again);
        assert!(StepDelays::from_flags(&["1=0.5".into()], 0.0, None, 0).is_err());
        assert!(StepDelays::from_flags(&[], 0.5, None, 0).unwrap_err().to_string().contains("--straggler-delay"));
        assert!(StepDelays::from_flags(&[], 1.5, Some("exp:1ms"), 0).is_err());
        let back = StepDelays::from_flags(
            &[],
            0.5,
            Some(&"uniform:1ms..3ms".parse::<DelayDistribution>().unwrap().to_string()),
            0,
        );
        assert_eq!(
            back.unwrap().stragglers.unwrap().delay,
            DelayDistribution::Uniform(Duration::from_millis(1), Duration::from_millis(3))
        );
    }
}

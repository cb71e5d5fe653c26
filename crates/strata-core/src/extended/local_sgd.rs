//! Local SGD and DiLoCo's settings ([`LocalSgd`], in
//! [`StrategyOptions::local_sgd`](super::StrategyOptions)): the vocabulary a strategy takes;
//! the outer synchronisation that runs them is `crate::local_sgd`'s.

use std::fmt;
use std::ops::Range;

use crate::cross_device::compression::Compression;
use crate::{Error, Result};

/// DiLoCo's outer learning rate.
pub const DILOCO_OUTER_LR: f32 = 0.7;
/// DiLoCo's outer momentum.
pub const DILOCO_OUTER_MOMENTUM: f32 = 0.9;

/// How the global parameters take the workers' mean outer gradient `d` at a meeting.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OuterOptimizer {
    /// Local SGD: the global parameters become the workers' mean (`global - d`).
    Average,
    /// DiLoCo: SGD with Nesterov momentum in PyTorch's form on `d`, from a velocity of zero.
    Nesterov {
        /// The outer learning rate (DiLoCo: 0.7).
        lr: f32,
        /// The outer momentum (DiLoCo: 0.9).
        momentum: f32,
    },
}

impl OuterOptimizer {
    /// DiLoCo's: Nesterov with learning rate 0.7 and momentum 0.9.
    pub fn diloco() -> Self {
        Self::Nesterov { lr: DILOCO_OUTER_LR, momentum: DILOCO_OUTER_MOMENTUM }
    }
}

impl fmt::Display for OuterOptimizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Average => write!(f, "average"),
            Self::Nesterov { lr, momentum } => write!(f, "nesterov(lr={lr},momentum={momentum})"),
        }
    }
}

/// A multi-worker job's synchronisation period: local SGD (`Average`) or DiLoCo (`Nesterov`).
/// `every: 1` with `Average` is per-step synchronous training itself (the gradient all-reduced
/// every step, bit for bit today's), and so is no `LocalSgd` at all.
#[derive(Clone, Debug, PartialEq)]
pub struct LocalSgd {
    /// `H`: inner steps between two meetings of a fragment (at least 1).
    pub every: u64,
    /// The outer optimizer.
    pub outer: OuterOptimizer,
    /// `F`: the parameters split into this many fragments (whole variables, near-equal in
    /// elements), fragment `f` met at the steps `s` with `s mod H = (f + 1) H / F mod H` (1 to
    /// `H`, and no more than the trainable variables; 1: every parameter at every `H`th step).
    pub fragments: usize,
    /// Inner steps a fragment's exchange runs behind before it is applied (`None`: 0 with one
    /// fragment, half the steps between two fragments' meetings with several). At most
    /// `H / F - 1`, so that one exchange at most is in flight at a time.
    pub delay: Option<u64>,
    /// How outer gradients cross the network: `None` (f32), `Fp16` or `Bf16` (16 bits), or
    /// `Int8` (int8 blocks of 64 values with a power-of-two scale): f32 sums at every hop, with
    /// error feedback of what the rounding dropped. A multi-worker strategy sets it from its
    /// own compression.
    pub wire: Compression,
}

impl Default for LocalSgd {
    /// DiLoCo's outer optimizer, Nesterov (0.7, 0.9), every `H = 100` inner steps (the paper's
    /// 500 is for runs of tens of thousands of steps), one fragment, f32.
    fn default() -> Self {
        Self { every: 100, outer: OuterOptimizer::diloco(), fragments: 1, delay: None, wire: Compression::None }
    }
}

impl fmt::Display for LocalSgd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "every={},outer={},fragments={},delay={}", self.every, self.outer, self.fragments, self.delay())
    }
}

impl LocalSgd {
    /// Whether this is per-step synchronous training (`H = 1`, averaging).
    pub fn is_synchronous(&self) -> bool {
        self.every == 1 && self.outer == OuterOptimizer::Average
    }

    /// The steps between two fragments' meetings.
    fn window(&self) -> u64 {
        self.every / self.fragments.max(1) as u64
    }

    /// The inner steps an exchange runs behind.
    pub fn delay(&self) -> u64 {
        self.delay.unwrap_or(if self.fragments > 1 { self.window() / 2 } else { 0 })
    }

    /// Refuses settings that cannot run, each in one line saying what to change.
    pub fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::InvalidArgument(what));
        if self.every == 0 {
            return bad("a synchronisation period of 0 steps: use a period of 1 step or more".into());
        }
        if self.fragments == 0 || self.fragments as u64 > self.every {
            return bad(format!(
                "{} fragments with a synchronisation every {} steps: use 1 to {} fragments (each is met once per period)",
                self.fragments, self.every, self.every
            ));
        }
        if let OuterOptimizer::Nesterov { lr, momentum } = self.outer {
            if !(lr.is_finite() && lr > 0.0) {
                return bad(format!("an outer learning rate of {lr}: use a positive one, e.g. 0.7"));
            }
            if !(momentum.is_finite() && (0.0..1.0).contains(&momentum)) {
                return bad(format!("an outer momentum of {momentum}: use one in [0, 1), e.g. 0.9"));
            }
        }
        if self.delay() > 0 && self.delay() >= self.window() {
            return bad(format!(
                "an exchange delay of {} steps with a fragment met every {} steps: use at most {}",
                self.delay(),
                self.window(),
                self.window().saturating_sub(1)
            ));
        }
        if matches!(self.wire, Compression::PowerSgd { .. }) {
            return bad(format!(
                "compression {} reduces per-step gradients; outer gradients cross in none, fp16, bf16 or int8",
                self.wire
            ));
        }
        Ok(())
    }

    /// The fragment met at inner step `step` (counted from 1), if any.
    pub fn meeting(&self, step: u64) -> Option<usize> {
        let f = self.fragments as u64;
        (0..f).find(|&i| ((i + 1) * self.every / f) % self.every == step % self.every).map(|i| i as usize)
    }
}

/// Refuses local SGD in a strategy whose workers do not step on their own
/// (`strategy`: its name): every strategy but MultiWorkerMirrored.
pub fn check_local_sgd_strategy(local_sgd: Option<&LocalSgd>, strategy: &str) -> Result<()> {
    match local_sgd {
        Some(l) if !l.is_synchronous() => Err(Error::InvalidArgument(format!(
            "a synchronisation period of {} steps (local SGD) applies to multi-worker-mirrored, whose workers step on their own between meetings; {strategy} has none: drop it",
            l.every
        ))),
        _ => Ok(()),
    }
}

/// Splits variables of `sizes` elements (the optimizer's order) into `f` fragments: runs of
/// whole variables, near-equal in elements, each at least one variable.
pub fn fragment_runs(sizes: &[usize], f: usize) -> Vec<Range<usize>> {
    let total: usize = sizes.iter().sum();
    let mut out = Vec::with_capacity(f);
    let (mut start, mut acc) = (0, 0);
    for k in 0..f {
        if k + 1 == f {
            out.push(start..sizes.len());
            break;
        }
        let target = total * (k + 1) / f;
        let mut end = start + 1;
        acc += sizes[start];
        // Take variables while the run is short of its share, leaving one for each later run.
        while end < sizes.len() - (f - k - 1) && acc + sizes[end] / 2 <= target {
            acc += sizes[end];
            end += 1;
        }
        out.push(start..end);
        start = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragments_are_runs_of_whole_variables_near_equal_in_elements() {
        assert_eq!(fragment_runs(&[10, 10, 10, 10], 2), vec![0..2, 2..4]);
        assert_eq!(fragment_runs(&[96, 16, 48, 3], 2), vec![0..1, 1..4]);
        assert_eq!(fragment_runs(&[1, 1, 1], 3), vec![0..1, 1..2, 2..3]);
        assert_eq!(fragment_runs(&[100, 1, 1, 1], 3), vec![0..1, 1..2, 2..4]);
        assert_eq!(fragment_runs(&[5], 1), vec![0..1]);
    }

    #[test]
    fn fragments_meet_at_staggered_steps_once_a_period() {
        let cfg = LocalSgd { every: 8, fragments: 4, ..LocalSgd::default() };
        let met: Vec<Option<usize>> = (1..=16).map(|s| cfg.meeting(s)).collect();
        let want = [None, Some(0), None, Some(1), None, Some(2), None, Some(3)];
        assert_eq!(met[..8], want);
        assert_eq!(met[8..], want);
        let one = LocalSgd { every: 3, ..LocalSgd::default() };
        assert_eq!((1..=6).map(|s| one.meeting(s)).collect::<Vec<_>>(), [None, None, Some(0), None, None, Some(0)]);
        assert_eq!(cfg.delay(), 1);
        assert_eq!(one.delay(), 0);
    }

    #[test]
    fn bad_settings_are_refused_in_one_line_saying_what_to_change() {
        let e = |c: LocalSgd| c.check().unwrap_err().to_string();
        assert!(e(LocalSgd { every: 0, ..LocalSgd::default() }).contains("use a period of 1 step or more"));
        assert!(e(LocalSgd { every: 4, fragments: 5, ..LocalSgd::default() }).contains("use 1 to 4 fragments"));
        assert!(e(LocalSgd { outer: OuterOptimizer::Nesterov { lr: 0.7, momentum: 1.0 }, ..LocalSgd::default() })
            .contains("use one in [0, 1)"));
        assert!(e(LocalSgd { every: 8, fragments: 4, delay: Some(2), ..LocalSgd::default() }).contains("use at most 1"));
        assert!(e(LocalSgd { wire: Compression::PowerSgd { rank: 2, start_step: 0 }, ..LocalSgd::default() })
            .contains("outer gradients cross in none, fp16, bf16 or int8"));
        assert!(LocalSgd { every: 1, outer: OuterOptimizer::Average, ..LocalSgd::default() }.is_synchronous());
    }
}

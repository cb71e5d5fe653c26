//! What the distributed optimizer asks of an optimizer before it builds one:
//! [`OptimizerMemory`] (the state it keeps per element, for the memory check, and whether it
//! can step shards), which every optimizer [`Replicated::optimizer`](crate::Replicated::optimizer)
//! builds implements, and [`ShardableOptimizer`], the capability ZeRO's stages 1 and 2 need:
//! stepping any run of a variable's elements as the whole variable would be stepped.
//!
//! This module must not know ZeRO's shards nor the strategies: it states what an optimizer is.

use candle_core::backprop::GradStore;
use candle_nn::Optimizer;

use super::{FusedAdagrad, FusedAdamW, FusedMomentum, FusedSgd};

/// An optimizer that steps any run of a variable's elements exactly as it steps them within the
/// whole variable: every element's update depends on that element's gradient and state only
/// (element-wise rules such as SGD, momentum and AdamW; not LAMB or LARS, whose update takes
/// a norm over the whole variable). ZeRO's stages 1 and 2 build each replica's copy of it over
/// its shard's runs of the variables ([`ZeroStage`](crate::ZeroStage)), and refuse an optimizer
/// that does not implement it. Strata's [`FusedAdamW`], [`FusedSgd`] and [`FusedMomentum`] do.
///
/// Implementing it implements [`OptimizerMemory`] too. For checkpoints and elastic jobs under
/// ZeRO the optimizer also implements [`OptimizerState`](crate::checkpoint::OptimizerState),
/// naming the state of its `i`-th variable `<name>.<i>` (as `"m.3"`), so that every shard's
/// state can be put together into the whole model's and cut again, and `renew`, so that a new
/// membership's shards get a copy of it.
///
/// A user's own optimizer joins in a line:
///
/// ```
/// use candle_core::backprop::GradStore;
/// use candle_core::Var;
/// use candle_nn::Optimizer;
/// use strata_core::optim::ShardableOptimizer;
///
/// /// SGD: each element steps by its own gradient, so any run of a variable steps alike.
/// struct MySgd {
///     vars: Vec<Var>,
///     lr: f64,
/// }
///
/// impl Optimizer for MySgd {
///     type Config = f64;
///
///     fn new(vars: Vec<Var>, lr: f64) -> candle_core::Result<Self> {
///         Ok(Self { vars, lr })
///     }
///
///     fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
///         for v in &self.vars {
///             if let Some(g) = grads.get(v) {
///                 v.set(&v.sub(&(g * self.lr)?)?)?;
///             }
///         }
///         Ok(())
///     }
///
///     fn learning_rate(&self) -> f64 {
///         self.lr
///     }
///
///     fn set_learning_rate(&mut self, lr: f64) {
///         self.lr = lr;
///     }
/// }
///
/// impl ShardableOptimizer for MySgd {
///     fn state_per_element() -> u64 {
///         0 // no state: plain SGD
///     }
/// }
///
/// // Stage 1 then builds each replica's `MySgd` over its shard:
/// // `model.optimizer::<MySgd>(0.1)?` under a strategy with `zero_stage: ZeroStage::OptimizerState`.
/// ```
pub trait ShardableOptimizer: Optimizer {
    /// Floats of state the optimizer keeps per element it steps (AdamW's two moments: 2,
    /// momentum's velocity: 1, SGD: 0), for the memory check of each replica's shard.
    fn state_per_element() -> u64;

    /// One step with each variable's gradient given as weighted terms, `terms[k]`'s gradient
    /// times its weight, summed element by element in the order of `terms` (`g0·w0 + g1·w1`,
    /// then `+ g2·w2`...: the sum the in-memory reduction computes), without the sum being
    /// written anywhere: where replicas of one machine step their shards, each reads every
    /// replica's gradient in place instead of a reduced copy. Every store holds the same
    /// variables. `None` (the default): the optimizer does not; the sums are then made first
    /// and [`Optimizer::step`] takes them, with the same bits.
    fn step_summed(&mut self, terms: &[(&GradStore, f32)]) -> Option<candle_core::Result<()>> {
        let _ = terms;
        None
    }
}

/// What [`Replicated::optimizer`](crate::Replicated::optimizer) asks of every optimizer it
/// builds, before it builds one: the floats of state it keeps per element (for the check against
/// a device's `memory_limit`) and whether it steps shards (ZeRO's stages 1 and 2).
///
/// Every [`ShardableOptimizer`] implements it (with its own figure). An optimizer that steps
/// whole variables only implements it directly, in a line if it keeps no state the memory check
/// should count: `impl OptimizerMemory for MyOptimizer {}`. candle-nn's `SGD` (0) and `AdamW`
/// (2) implement it here; ZeRO refuses them, naming [`ShardableOptimizer`].
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not say what state it keeps: implement `strata::optim::OptimizerMemory` for it",
    label = "`model.optimizer::<{Self}>` needs `{Self}: OptimizerMemory`",
    note = "one line does it where the optimizer keeps no per-element state: `impl strata::optim::OptimizerMemory for {Self} {{}}`; an optimizer that updates element by element implements `strata::optim::ShardableOptimizer` instead, and then also runs on ZeRO's shards"
)]
pub trait OptimizerMemory: Optimizer {
    /// Floats of state the optimizer keeps per element it steps (0 unless said otherwise).
    fn state_per_element() -> u64 {
        0
    }

    /// Whether the optimizer steps any run of a variable's elements as the whole variable:
    /// true exactly for a [`ShardableOptimizer`] (leave it to that trait).
    fn steps_shards() -> bool {
        false
    }

    /// [`ShardableOptimizer::step_summed`] (leave it to that trait): `None` for an optimizer
    /// that steps whole variables only.
    fn step_summed(&mut self, terms: &[(&GradStore, f32)]) -> Option<candle_core::Result<()>> {
        let _ = terms;
        None
    }
}

impl<O: ShardableOptimizer> OptimizerMemory for O {
    fn state_per_element() -> u64 {
        <O as ShardableOptimizer>::state_per_element()
    }

    fn steps_shards() -> bool {
        true
    }

    fn step_summed(&mut self, terms: &[(&GradStore, f32)]) -> Option<candle_core::Result<()>> {
        <O as ShardableOptimizer>::step_summed(self, terms)
    }
}

impl ShardableOptimizer for FusedAdamW {
    fn state_per_element() -> u64 {
        2
    }

    fn step_summed(&mut self, terms: &[(&GradStore, f32)]) -> Option<candle_core::Result<()>> {
        self.summed_step(terms)
    }
}

impl ShardableOptimizer for FusedMomentum {
    fn state_per_element() -> u64 {
        1
    }
}

impl ShardableOptimizer for FusedAdagrad {
    fn state_per_element() -> u64 {
        1
    }
}

impl ShardableOptimizer for FusedSgd {
    fn state_per_element() -> u64 {
        0
    }

    fn step_summed(&mut self, terms: &[(&GradStore, f32)]) -> Option<candle_core::Result<()>> {
        self.summed_step(terms)
    }
}

/// Its two moments, whole: candle-nn's AdamW steps whole variables.
impl OptimizerMemory for candle_nn::AdamW {
    fn state_per_element() -> u64 {
        2
    }
}

impl OptimizerMemory for candle_nn::SGD {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fused_optimizers_step_shards_and_candle_nns_do_not() {
        assert!(<FusedAdamW as OptimizerMemory>::steps_shards());
        assert!(<FusedSgd as OptimizerMemory>::steps_shards());
        assert!(<FusedMomentum as OptimizerMemory>::steps_shards());
        assert!(!<candle_nn::AdamW as OptimizerMemory>::steps_shards());
        assert!(!<candle_nn::SGD as OptimizerMemory>::steps_shards());
        let state = [
            <FusedAdamW as OptimizerMemory>::state_per_element(),
            <FusedMomentum as OptimizerMemory>::state_per_element(),
            <FusedSgd as OptimizerMemory>::state_per_element(),
            <candle_nn::AdamW as OptimizerMemory>::state_per_element(),
            <candle_nn::SGD as OptimizerMemory>::state_per_element(),
        ];
        assert_eq!(state, [2, 1, 0, 2, 0]);
    }
}

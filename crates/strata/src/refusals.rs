//! Refusals of settings that cannot work together, as functions: the library calls each where
//! the settings meet, and a program that takes them from its user (the `strata` command) calls
//! the same function before it starts anything, so that each refusal is written once and reads
//! the same from both. Each is a usage error (the `strata` command's exit code 2) in one line.
//!
//! The refusals that belong to a lower layer live there, beside the setting they check:
//! - a compression a parameter server does not take (PowerSGD, the ring's):
//!   [`ParameterServerOptions::wire_format_of`](crate::ParameterServerOptions::wire_format_of);
//! - an elastic job's minimum outside its cluster's workers:
//!   [`ElasticOptions::check_min_workers`](crate::ElasticOptions::check_min_workers);
//! - an elastic job at a ZeRO stage whose optimizer keeps state, or at stage 3, without
//!   checkpoints:
//!   [`strata_core::elastic::check_zero_state`] ([`elastic_zero_state`] here);
//! - a ZeRO stage under a strategy without a copy per replica, or with an optimizer that steps
//!   whole variables: [`strata_core::check_zero_strategy`] and
//!   [`strata_core::check_zero_optimizer`] ([`zero_stage_of`] here);
//! - GPUs asked of a strategy that cannot place them: [`crate::gpu::check_gpus`].

use strata_core::optim::{FusedAdamW, FusedSgd, OptimizerMemory};
use strata_core::ZeroStage;

use crate::kind::{OptimizerKind, StrategyKind};
use crate::Result;

/// Refuses an elastic job at a ZeRO `stage` above 0 whose optimizer keeps state
/// (`keeps_state`), or at stage 3, without checkpoints (`checkpointed` false): a lost worker
/// takes its shard of that state (at stage 3 of the parameters) with it, and only a checkpoint
/// can bring the whole state back. Stage 0, stages 1 and 2 with an optimizer without state
/// (plain SGD), or a job with checkpoints pass.
///
/// The refusal is the strategy layer's ([`strata_core::elastic::check_zero_state`], which an
/// elastic job's recovery calls when it starts); call this to refuse such a job before any
/// worker starts.
pub fn elastic_zero_state(stage: ZeroStage, keeps_state: bool, checkpointed: bool) -> Result<()> {
    Ok(strata_core::elastic::check_zero_state(stage, keeps_state, checkpointed)?)
}

/// [`elastic_zero_state`] for an optimizer chosen by name (a command line's `--optimizer`):
/// every optimizer keeps state but the plain SGDs.
pub fn elastic_zero_state_of(stage: ZeroStage, optimizer: OptimizerKind, checkpointed: bool) -> Result<()> {
    let keeps_state = !matches!(optimizer, OptimizerKind::Sgd | OptimizerKind::CandleSgd);
    elastic_zero_state(stage, keeps_state, checkpointed)
}

/// Refuses ZeRO `stage` under the strategy `strategy` or with the optimizer `optimizer`, both
/// chosen by name (a command line's `--strategy` and `--optimizer`), as the strategy's build
/// ([`strata_core::check_zero_strategy`]) and the optimizer's
/// ([`strata_core::check_zero_optimizer`]) would refuse them once the job runs.
pub fn zero_stage_of(stage: ZeroStage, strategy: StrategyKind, optimizer: OptimizerKind) -> Result<()> {
    strata_core::check_zero_strategy(stage, strategy.name())?;
    let steps_shards = match optimizer {
        OptimizerKind::Adamw => <FusedAdamW as OptimizerMemory>::steps_shards(),
        OptimizerKind::Sgd => <FusedSgd as OptimizerMemory>::steps_shards(),
        OptimizerKind::CandleAdamw => <candle_nn::AdamW as OptimizerMemory>::steps_shards(),
        OptimizerKind::CandleSgd => <candle_nn::SGD as OptimizerMemory>::steps_shards(),
        OptimizerKind::Momentum => <strata_core::optim::FusedMomentum as OptimizerMemory>::steps_shards(),
        OptimizerKind::Adagrad => <strata_core::optim::FusedAdagrad as OptimizerMemory>::steps_shards(),
    };
    Ok(strata_core::check_zero_optimizer(stage, optimizer.name(), steps_shards)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_elastic_job_s_sharded_state_needs_a_checkpoint() {
        let refused = elastic_zero_state(ZeroStage::OptimizerState, true, false).unwrap_err();
        assert_eq!(refused.exit_code(), 2);
        let text = refused.to_string();
        assert!(text.starts_with("an elastic job at ZeRO stage 1 with an optimizer that keeps state"), "{text}");
        assert!(!text.contains('\n') && !text.ends_with('.'), "{text}");
        // Each way out passes: stage 0, no state, a checkpoint.
        assert!(elastic_zero_state(ZeroStage::Off, true, false).is_ok());
        assert!(elastic_zero_state(ZeroStage::Gradients, false, false).is_ok());
        assert!(elastic_zero_state(ZeroStage::Gradients, true, true).is_ok());
        // By name: AdamW keeps state, SGD none.
        assert!(elastic_zero_state_of(ZeroStage::Gradients, OptimizerKind::Adamw, false).is_err());
        assert!(elastic_zero_state_of(ZeroStage::Gradients, OptimizerKind::Sgd, false).is_ok());
    }

    #[test]
    fn a_zero_stage_by_name_is_refused_as_the_library_refuses_it() {
        let stage = ZeroStage::OptimizerState;
        for (strategy, fix) in [
            (StrategyKind::OneDevice, "one replica holds the whole model"),
            (StrategyKind::CentralStorage, "its one central copy is stepped once"),
            (StrategyKind::ParameterServer, "its variables live on the ps tasks"),
        ] {
            let text = zero_stage_of(stage, strategy, OptimizerKind::Adamw).unwrap_err().to_string();
            assert!(text.starts_with(&format!("zero stage 1 with the {strategy} strategy: {fix}")), "{text}");
        }
        let refused = zero_stage_of(stage, StrategyKind::Mirrored, OptimizerKind::CandleAdamw).unwrap_err();
        assert_eq!(refused.exit_code(), 2);
        let text = refused.to_string();
        assert!(text.starts_with("zero stage 1 with the optimizer candle-adamw: it steps whole variables"), "{text}");
        assert!(!text.contains('\n') && !text.ends_with('.'), "{text}");
        for optimizer in [OptimizerKind::Adamw, OptimizerKind::Sgd] {
            assert!(zero_stage_of(stage, StrategyKind::MultiWorkerMirrored, optimizer).is_ok());
        }
        assert!(zero_stage_of(ZeroStage::Off, StrategyKind::OneDevice, OptimizerKind::CandleSgd).is_ok());
    }
}

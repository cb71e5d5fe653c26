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
//! - an elastic job at a ZeRO stage whose optimizer keeps state, without checkpoints:
//!   [`strata_core::elastic::check_zero_state`] ([`elastic_zero_state`] here).

use strata_core::ZeroStage;

use crate::kind::OptimizerKind;
use crate::Result;

/// Refuses an elastic job at a ZeRO `stage` above 0 whose optimizer keeps state
/// (`keeps_state`) without checkpoints (`checkpointed` false): a lost worker takes its shard of
/// that state with it, and only a checkpoint can bring the whole state back. Stage 0, an
/// optimizer without state (plain SGD) or a job with checkpoints passes.
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
}

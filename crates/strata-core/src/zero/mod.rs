//! ZeRO's shards ([`ZeroStage`]), their one home: the trainable parameters split over every
//! replica in sync (across workers too) at element granularity. On one machine the parameters,
//! flattened in the optimizer's order, are split evenly ([`even_layout`](layout::even_layout)); across workers each
//! worker holds its reduce-scatter segment of every reduction of the step's plan, split evenly
//! over its replicas ([`segment_layout`](layout::segment_layout)), so that the reduce-scatter leaves it exactly the
//! gradient it steps, bit for bit what the all-reduce leaves there, at half the bytes.
//! Each replica's optimizer is built over its shard only, so it keeps that shard's state
//! (AdamW's moments, momentum's velocity), steps that shard with the reduced gradient, and an
//! all-gather writes every shard back into every replica's copy of the parameters.
//!
//! A shard meets a variable in a `Piece`: a run of the variable's flattened elements, in a
//! `Var` that the optimizer steps. On a CPU device that `Var` is a view of the variable's own
//! storage (`Var::run_view`, from Strata's candle patch), so the step updates the variable in
//! place; elsewhere it is a copy that takes the variable's current values before each step.
//! Either way a write to the variable between steps (a restore, say) is seen, and the
//! piece's gradient is the same run of the reduced gradient: the update of
//! every element is the one a whole-variable step computes, bit for bit, for optimizers that
//! update element by element (those that implement
//! [`ShardableOptimizer`](crate::optim::ShardableOptimizer)).
//!
//! Following a stage from the optimizer's build to the wire, in this module's files:
//! [`shards_for`] refuses what cannot run on shards and lays them out (`layout.rs`: the
//! [`Run`]s, [`fixed_plan`]; `shards.rs`: [`lay_out_shards`]), `memory.rs` checks that they fit
//! ([`check_memory_limits`]), `shards.rs` holds each replica's pieces and steps them
//! ([`Shards::step`]), `gather.rs` writes every shard back into every copy, `state.rs` turns the
//! shards' optimizer state into a whole model's for checkpoints and back, and
//! [`Shards::reshard`] lays them out again over an elastic job's new membership.
//!
//! This module must not know the distributed optimizer nor the overlapped step that use it: it
//! takes the variables, the strategy and the optimizer's type, and hands back shards; the
//! reduction keeps its runs through [`Shards::keep`] and [`Shards::shard_of`].

mod ahead;
mod gather;
mod layout;
mod memory;
mod params;
mod shards;
mod state;

use std::sync::Arc;

use candle_core::Var;

pub(crate) use layout::fixed_plan;
pub(crate) use memory::{check_memory_limits, check_step_footprint, ModelShape, Stages};
pub use params::unit_name;
pub(crate) use params::{check_units, two_largest_units, Residency};
pub(crate) use shards::lay_out_shards;
pub(crate) use shards::{Shards, SummedStep};

use crate::extended::{StrategyExtended, VariablePolicy};
use crate::optim::OptimizerMemory;
use crate::{Error, Result, ZeroStage};

/// ZeRO's shards of `vars` (every local copy's trainable variables, of a model whose variables
/// follow `policy` under the strategy `ext` named `strategy_name`) over every replica in sync,
/// for an optimizer `O`: refused, in one line, for a central model (stepped once) and for an
/// optimizer that does not implement [`ShardableOptimizer`](crate::optim::ShardableOptimizer) (it steps whole variables).
pub(crate) fn shards_for<O: OptimizerMemory>(
    stage: ZeroStage,
    policy: VariablePolicy,
    strategy_name: &str,
    vars: &[Vec<Var>],
    ext: Arc<dyn StrategyExtended>,
) -> Result<Shards> {
    if let VariablePolicy::Central { .. } = policy {
        return Err(refusal(stage, format!("the {strategy_name} strategy"), CENTRAL));
    }
    check_zero_optimizer(stage, std::any::type_name::<O>(), O::steps_shards())?;
    lay_out_shards(stage, vars, ext)
}

/// Refuses ZeRO `stage` (above [`ZeroStage::Off`]) under a strategy named `strategy` (its
/// name as [`StrategyExtended::name`](crate::StrategyExtended::name) and `strata train --strategy` spell it) whose replicas do not each keep a whole copy of the
/// optimizer state: one-device (one replica), central-storage (one central copy) and
/// parameter-server (the ps tasks step the variables). Every other name passes: mirrored,
/// multi-worker-mirrored and a program's own strategies, whose variables' policy the
/// optimizer's build checks again. The strategies call it when they are built; a program that
/// takes both settings from its user (the `strata` command) calls it before it starts anything,
/// so that the refusal reads the same from both.
pub fn check_zero_strategy(stage: ZeroStage, strategy: &str) -> Result<()> {
    let fix = match strategy {
        _ if stage == ZeroStage::Off => return Ok(()),
        "one-device" => ONE_REPLICA,
        "central-storage" => CENTRAL,
        "parameter-server" => PS_TASKS,
        _ => return Ok(()),
    };
    Err(refusal(stage, format!("the {strategy} strategy"), fix))
}

/// Refuses ZeRO `stage` (above [`ZeroStage::Off`]) with an optimizer named `optimizer` that
/// does not step runs of a variable's elements (`steps_shards` false:
/// [`OptimizerMemory::steps_shards`], true exactly for a
/// [`ShardableOptimizer`](crate::optim::ShardableOptimizer)). The optimizer's build calls it
/// with the type's name; a program that picks an optimizer by name calls it with that name
/// before it starts anything.
pub fn check_zero_optimizer(stage: ZeroStage, optimizer: &str, steps_shards: bool) -> Result<()> {
    if stage == ZeroStage::Off || steps_shards {
        return Ok(());
    }
    Err(refusal(stage, format!("the optimizer {optimizer}"), NOT_SHARDABLE))
}

fn refusal(stage: ZeroStage, what: String, fix: &'static str) -> Error {
    Error::ZeroStage { stage: stage.number(), what, fix }
}

/// Why OneDevice is refused a stage above 0.
const ONE_REPLICA: &str = "one replica holds the whole model; use stage 0, or mirrored over several devices";

/// Why a central model (CentralStorage's) is refused a stage above 0.
const CENTRAL: &str = "its one central copy is stepped once, on the parameter device; use stage 0, or mirrored";

/// Why the parameter-server strategy is refused a stage above 0.
const PS_TASKS: &str = "its variables live on the ps tasks, which step each of them once; use stage 0, or mirrored or multi-worker-mirrored";

/// Why an optimizer that does not implement [`ShardableOptimizer`](crate::optim::ShardableOptimizer) is refused at stages 1 to 3.
const NOT_SHARDABLE: &str = "it steps whole variables; stages 1 to 3 step runs of a variable's elements, which needs an optimizer that implements ShardableOptimizer (strata's FusedAdamW, FusedSgd and FusedMomentum do)";

impl Shards {
    /// The shards laid out again over every replica in sync now (an elastic job's new
    /// membership), after checking that a replica's model state still fits its device's
    /// memory limit at their new size (fewer workers, larger shards; see
    /// [`check_memory_limits`] for `per_element`, `params`, `vars` and `stages`). Nothing
    /// collective runs in it. At stage 3 a released variable's pieces are zeros: the caller
    /// loads every variable after it.
    pub(crate) fn reshard(
        &self,
        policy: VariablePolicy,
        per_element: u64,
        params: &[u64],
        vars: &[Vec<Var>],
        stages: Stages,
    ) -> Result<Shards> {
        // An elastic job's shards are copies.
        let stages = Stages { copies: true, ..stages };
        let shape = ModelShape { policy, stage: self.stage(), per_element, params, vars, stages };
        check_memory_limits(&**self.ext(), &shape)?;
        lay_out_shards(self.stage(), vars, self.ext().clone())
    }
}

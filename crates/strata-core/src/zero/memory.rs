//! The memory check of a replica's model state against its logical device's `memory_limit`
//! at a ZeRO stage ([`check_memory_limits`]): parameters (a shard's and the units gathered at
//! once at stage 3), gradients (a shard's at stage 2, and the gathered units' at stage 3) and
//! optimizer state (a shard's at stages 1 and 2, by the optimizer's
//! [`OptimizerMemory::state_per_element`](crate::optim::OptimizerMemory::state_per_element)), naming the stage that fits.
//!
//! This module must not know where the shards lie: it counts bytes.

use candle_core::Var;

use crate::extended::{StrategyExtended, VariablePolicy};
use crate::{Error, Result, ZeroStage};

/// The stages a job may run, for [`check_memory_limits`]: what stage 3 holds whole besides its
/// shard (`gathered` bytes: the two largest units), and the highest stage the job can run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Stages {
    pub(crate) gathered: u64,
    pub(crate) max_stage: u8,
}

/// Refuses a replica whose device has a `memory_limit` its model state exceeds at `stage` over
/// the replicas in sync now: every variable's copy (`params[c]` bytes for copy `c`), the
/// gradients of the trainable ones `vars` (its shard's at stage 2) and the optimizer's state
/// (its shard's at stages 1 and 2: `per_element` floats of state per element it steps, the
/// optimizer's [`OptimizerMemory::state_per_element`](crate::optim::OptimizerMemory::state_per_element)), naming the lowest stage that fits. Called when the
/// optimizer is built and again when an elastic job's shards are laid out over a new
/// membership (fewer workers, larger shards).
pub(crate) fn check_memory_limits(
    ext: &dyn StrategyExtended,
    policy: VariablePolicy,
    stage: ZeroStage,
    per_element: u64,
    params: &[u64],
    vars: &[Vec<Var>],
    stages: Stages,
) -> Result<()> {
    let Stages { gathered, max_stage } = stages;
    let devices = ext.replica_devices();
    let in_sync = ext.num_replicas_in_sync().max(1) as u64;
    for (c, copy) in vars.iter().enumerate() {
        let Some(limit) = devices.get(c).and_then(|d| d.kind.memory_limit()) else { continue };
        let params = params.get(c).copied().unwrap_or(0);
        let trainable: u64 = copy.iter().map(|v| v.elem_count() as u64).sum();
        let size = copy.first().map_or(4, |v| v.dtype().size_in_bytes()) as u64;
        let shard = trainable.div_ceil(in_sync);
        // Parameter, gradient and state bytes at stages 0 to 3; central copies are never sharded.
        let need = |s: u8| {
            let sharded = policy == VariablePolicy::Mirrored;
            let params = if s >= 3 && sharded {
                params.saturating_sub(trainable * size) + shard * size + gathered.min(trainable * size)
            } else {
                params
            };
            let grads = if s >= 3 && sharded {
                shard * size + gathered.min(trainable * size)
            } else if s >= 2 && sharded {
                shard * size
            } else {
                trainable * size
            };
            let state = if s >= 1 && sharded { shard } else { trainable } * per_element * size;
            (params, grads, state)
        };
        let (params, grads, state) = need(stage.number());
        if params + grads + state <= limit {
            continue;
        }
        let total = |s: u8| {
            let (p, g, st) = need(s);
            p + g + st
        };
        let fits = (stage.number() + 1..=max_stage).find(|&s| total(s) <= limit).map(|s| (s, total(s)));
        return Err(Error::MemoryLimit(Box::new(crate::MemoryLimitExceeded {
            replica: c,
            device: devices[c].spec.to_string(),
            stage: stage.number(),
            params,
            grads,
            state,
            limit,
            fits,
            least: (0..=max_stage).map(|s| (s, total(s))).min_by_key(|&(_, b)| b).unwrap_or((0, total(0))),
        })));
    }
    Ok(())
}

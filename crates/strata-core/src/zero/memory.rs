//! The memory check of a replica's model state against its logical device's `memory_limit`
//! at a ZeRO stage ([`check_memory_limits`]): parameters (a shard's and the units gathered at
//! once at stage 3), gradients (a shard's at stage 2, and the gathered units' at stage 3) and
//! optimizer state (a shard's at stages 1 and 2, by the optimizer's
//! [`OptimizerMemory::state_per_element`](crate::optim::OptimizerMemory::state_per_element)), naming the stage that fits.
//!
//! This module must not know where the shards lie: it counts bytes.

use candle_core::Var;

use crate::extended::{StrategyExtended, VariablePolicy};
use crate::{Error, Footprint, Result, ZeroStage};

/// The highest ZeRO stage.
const MAX_STAGE: u8 = 3;

/// The stages a job may run, for [`check_memory_limits`]: what stage 3 holds whole besides its
/// shard (`gathered` bytes: the two largest units), and how stages 1 and 2 hold their shard.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Stages {
    pub(crate) gathered: u64,
    /// Whether stages 1 and 2 step copies of a replica's shard (an elastic job's, or on a
    /// device other than the CPU) instead of views of its variables: a shard's parameters more.
    pub(crate) copies: bool,
}

/// A replica's model state as a ZeRO stage shards it, the shape both checks below count:
/// every variable's copy (`params[c]` bytes for copy `c`), the gradients of the trainable ones
/// `vars` (its shard's at stage 2) and the optimizer's state (its shard's at stages 1 and 2:
/// `per_element` floats of state per element it steps, the optimizer's
/// [`OptimizerMemory::state_per_element`](crate::optim::OptimizerMemory::state_per_element)),
/// at `stage` and every stage up to stage 3.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ModelShape<'a> {
    pub(crate) policy: VariablePolicy,
    pub(crate) stage: ZeroStage,
    pub(crate) per_element: u64,
    pub(crate) params: &'a [u64],
    pub(crate) vars: &'a [Vec<Var>],
    pub(crate) stages: Stages,
}

impl ModelShape<'_> {
    /// Copy `copy`'s model state at stage `s` over `in_sync` replicas: (parameters, gradients,
    /// optimizer state) bytes.
    fn at(&self, copy: usize, s: u8, in_sync: u64) -> (u64, u64, u64) {
        let vars = self.vars.get(copy).map_or(&[][..], Vec::as_slice);
        let trainable: u64 = vars.iter().map(|v| v.elem_count() as u64).sum();
        let size = vars.first().map_or(4, |v| v.dtype().size_in_bytes()) as u64;
        let params = self.params.get(copy).copied().unwrap_or(0);
        let Stages { gathered, copies, .. } = self.stages;
        model_state(self.policy, s, self.per_element, params, trainable, size, in_sync, (gathered, copies))
    }

    /// [`Self::at`], summed.
    fn total(&self, copy: usize, s: u8, in_sync: u64) -> u64 {
        let (p, g, st) = self.at(copy, s, in_sync);
        p + g + st
    }
}

/// Refuses a replica whose device has a `memory_limit` its model state (`shape`) exceeds at
/// `shape.stage` over the replicas in sync now, naming the lowest stage that fits. Called when
/// the optimizer is built and again when an elastic job's shards are laid out over a new
/// membership (fewer workers, larger shards).
pub(crate) fn check_memory_limits(ext: &dyn StrategyExtended, shape: &ModelShape<'_>) -> Result<()> {
    let devices = ext.replica_devices();
    let in_sync = ext.num_replicas_in_sync().max(1) as u64;
    let (stage, max_stage) = (shape.stage, MAX_STAGE);
    for c in 0..shape.vars.len() {
        let Some(limit) = devices.get(c).and_then(|d| d.kind.memory_limit()) else { continue };
        let (params, grads, state) = shape.at(c, stage.number(), in_sync);
        if params + grads + state <= limit {
            continue;
        }
        let total = |s: u8| shape.total(c, s, in_sync);
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

/// A replica's model state at stage `s`, computed: (parameters, gradients, optimizer state)
/// bytes, for `params` bytes of every variable of its copy, `trainable` elements of `size`
/// bytes, over `in_sync` replicas, stage 3 holding `gathered` bytes of units whole besides its
/// shard, and stages 1 and 2 a copy of the shard where `copies`; central copies are never
/// sharded.
#[allow(clippy::too_many_arguments)]
fn model_state(
    policy: VariablePolicy,
    s: u8,
    per_element: u64,
    params: u64,
    trainable: u64,
    size: u64,
    in_sync: u64,
    (gathered, copies): (u64, bool),
) -> (u64, u64, u64) {
    let shard = trainable.div_ceil(in_sync);
    let sharded = policy == VariablePolicy::Mirrored;
    let whole = trainable * size;
    let params = if s >= 3 && sharded {
        params.saturating_sub(whole) + shard * size + gathered.min(whole)
    } else if s >= 1 && sharded && copies {
        params + shard * size
    } else {
        params
    };
    let grads = if s >= 3 && sharded {
        shard * size + gathered.min(whole)
    } else if s >= 2 && sharded {
        shard * size
    } else {
        whole
    };
    let state = if s >= 1 && sharded { shard } else { trainable } * per_element * size;
    (params, grads, state)
}

/// What a replica held in a step, counted (`held`), against its device's `memory_limit`: over
/// it, the step fails naming the lowest higher stage whose model state (`shape`, computed as
/// [`check_memory_limits`] does) and these activations fit. `replica` runs on
/// `ext.replica_devices()[replica]` with copy `copy` of the variables.
pub(crate) fn check_step_footprint(
    ext: &dyn StrategyExtended,
    shape: &ModelShape<'_>,
    (replica, copy, step): (usize, usize, u64),
    held: Footprint,
) -> Result<()> {
    let devices = ext.replica_devices();
    let Some(device) = devices.get(replica) else { return Ok(()) };
    let Some(limit) = device.kind.memory_limit() else { return Ok(()) };
    if held.total() <= limit {
        return Ok(());
    }
    let in_sync = ext.num_replicas_in_sync().max(1) as u64;
    let stage = shape.stage;
    let fits = (stage.number() + 1..=MAX_STAGE)
        .map(|s| (s, shape.total(copy, s, in_sync) + held.activations))
        .find(|&(_, bytes)| bytes <= limit);
    Err(Error::MemoryLimitInStep(Box::new(crate::MemoryLimitInStep {
        replica,
        device: device.spec.to_string(),
        step,
        stage: stage.number(),
        held,
        limit,
        fits,
    })))
}

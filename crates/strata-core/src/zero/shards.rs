//! ZeRO's [`Shards`]: each local replica's [`Piece`]s of the variables (the `Var`s its
//! optimizer copy steps), which runs of each reduced gradient it keeps, and the step of one
//! shard with them ([`Shards::step`]).
//!
//! This module must not know how the gradient was reduced, nor which optimizer steps: any
//! `Optimizer` over the pieces, chosen where the shards are built.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::Optimizer;

use super::layout::{even_layout, fixed_plan, segment_layout, unit_runs, Run};
use crate::extended::StrategyExtended;
use crate::{Error, ReplicaContext, Result, ZeroStage};

/// Elements `start..start + len` of variable `var` (flattened), as one replica's shard holds
/// them, and the variable the optimizer steps for them.
#[derive(Debug)]
pub(crate) struct Piece {
    pub(super) var: usize,
    pub(super) start: usize,
    pub(super) len: usize,
    /// Where the piece starts in its replica's kept gradient of the variable (its runs of
    /// the variable one after another, in order: stage 2).
    pub(super) kept_at: usize,
    pub(super) value: Var,
    /// Whether `value` shares the variable's storage (a view of its run, on CPU devices): the
    /// optimizer then updates the variable's elements in place, nothing is copied before a
    /// step, and the gather leaves this run alone. Otherwise `value` is a copy of its own,
    /// refreshed from the variable before each step and gathered back after it.
    pub(super) aliased: bool,
}

/// Where every replica's shard lies, and this worker's replicas' pieces.
#[derive(Debug)]
pub(crate) struct Shards {
    pub(super) stage: ZeroStage,
    /// Each variable's first element in the flattened model.
    pub(super) offsets: Vec<usize>,
    /// Each local replica's pieces, in the order its optimizer steps them.
    pub(super) pieces: Vec<Vec<Piece>>,
    /// Each local replica's runs of each variable (by index; in order, none where its shard
    /// meets none): the only elements of the reduced gradient it needs.
    pub(super) runs: Vec<Vec<Vec<Range<usize>>>>,
    /// Each local replica's span of each variable, from its first run's start to its last
    /// run's end (empty where it has none).
    pub(super) keep: Vec<Vec<Range<usize>>>,
    /// Every replica's shard, by its index in sync: the runs of its pieces, in order.
    pub(super) layout: Vec<Vec<Run>>,
    /// Whether the shards lie on the workers' reduce-scatter segments ([`segment_layout`](super::layout::segment_layout)).
    pub(super) segments: bool,
    /// Each variable's shape.
    pub(super) shapes: Vec<candle_core::Shape>,
    /// The strategy, whose workers' collectives gather the optimizer state for a checkpoint.
    pub(super) ext: Arc<dyn StrategyExtended>,
}

impl Shards {
    /// The shards of `vars` (each local replica's copy of the optimizer's variables) laid out
    /// as `layout` says (every replica's runs, by its index in sync), of which this worker's
    /// replicas are `first..first + vars.len()`; `segments` says whether the layout is a
    /// [`segment_layout`](super::layout::segment_layout).
    pub(crate) fn new(
        stage: ZeroStage,
        vars: &[Vec<Var>],
        first: usize,
        layout: Vec<Vec<Run>>,
        segments: bool,
        ext: Arc<dyn StrategyExtended>,
    ) -> Result<Self> {
        let elastic = ext.workers().is_some_and(|w| w.is_elastic());
        let sizes: Vec<usize> = vars.first().map_or(Vec::new(), |v| v.iter().map(|v| v.elem_count()).collect());
        let shapes = vars.first().map_or(Vec::new(), |v| v.iter().map(|v| v.shape().clone()).collect());
        let mut offsets = Vec::with_capacity(sizes.len());
        let mut total = 0;
        for n in &sizes {
            offsets.push(total);
            total += n;
        }
        if let Some(g) = layout.iter().position(Vec::is_empty) {
            return Err(Error::ZeroStage {
                stage: stage.number(),
                what: format!(
                    "{total} trainable elements over {} replicas (replica {g}'s shard is empty)",
                    layout.len()
                ),
                fix: "every replica's shard needs at least one element; use stage 0 or fewer replicas",
            });
        }
        let mut pieces = Vec::with_capacity(vars.len());
        let mut runs = Vec::with_capacity(vars.len());
        let mut keep = Vec::with_capacity(vars.len());
        for (c, copy) in vars.iter().enumerate() {
            let shard = layout.get(first + c).ok_or_else(|| {
                Error::Scope(format!("replica {} has no shard in a layout of {}", first + c, layout.len()))
            })?;
            let mut var_runs: Vec<Vec<Range<usize>>> = vec![Vec::new(); copy.len()];
            for r in shard {
                if r.var >= copy.len() || r.start + r.len > sizes[r.var] {
                    return Err(Error::Scope(format!(
                        "a shard's run {r:?} lies outside the model's {} variables",
                        copy.len()
                    )));
                }
                var_runs[r.var].push(r.start..r.start + r.len);
            }
            for v in &mut var_runs {
                v.sort_by_key(|r| r.start);
            }
            let mut mine = Vec::with_capacity(shard.len());
            for r in shard {
                let v = &copy[r.var];
                let (start, len) = (r.start, r.len);
                let kept_at = var_runs[r.var].iter().take_while(|k| k.start < start).map(|k| k.len()).sum();
                // An elastic job steps copies: a step cut off by a lost worker then leaves the
                // variables as they were, whole, for the members to go on from.
                // Stage 3 releases the variables: its pieces are copies, the master values.
                let aliased = v.device().is_cpu() && v.is_contiguous() && !elastic && !stage.shards_parameters();
                let value = if aliased {
                    v.run_view(start, len)?
                } else if v.is_released() {
                    // Stage 3 laid out again over an elastic job's new membership: a released
                    // variable is not brought back (from the old membership's pieces), since
                    // every variable takes the values the members go on from right after.
                    Var::zeros(len, v.dtype(), v.device())?
                } else {
                    Var::from_tensor(&v.flatten_all()?.narrow(0, start, len)?.force_contiguous()?)?
                };
                mine.push(Piece { var: r.var, start, len, kept_at, value, aliased });
            }
            keep.push(
                var_runs
                    .iter()
                    .map(|v| match (v.first(), v.last()) {
                        (Some(a), Some(b)) => a.start..b.end,
                        _ => 0..0,
                    })
                    .collect(),
            );
            pieces.push(mine);
            runs.push(var_runs);
        }
        Ok(Self { stage, offsets, pieces, runs, keep, layout, segments, shapes, ext })
    }

    /// Whether the shards lie on the workers' reduce-scatter segments, so that a reduction of
    /// the plan they were laid out for may reduce-scatter.
    pub(crate) fn on_segments(&self) -> bool {
        self.segments
    }

    /// Local replica `copy`'s runs of variable `var`, in order.
    pub(crate) fn runs(&self, copy: usize, var: usize) -> &[Range<usize>] {
        &self.runs[copy][var]
    }

    /// The variables local replica `copy`'s optimizer steps: its pieces.
    pub(crate) fn piece_vars(&self, copy: usize) -> Vec<Var> {
        self.pieces[copy].iter().map(|p| p.value.clone()).collect()
    }

    /// Local replica `copy`'s span of each variable, by index: from its first run's start to
    /// its last run's end. It has one run of a variable that is reduced whole, in a bucket.
    pub(crate) fn keep(&self, copy: usize) -> &[Range<usize>] {
        &self.keep[copy]
    }

    /// The strategy the shards were laid out for.
    pub(crate) fn ext(&self) -> &Arc<dyn StrategyExtended> {
        &self.ext
    }

    /// The stage.
    pub(crate) fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// Elements of the optimizer's state-bearing copy local replica `copy` keeps.
    pub(crate) fn elements(&self, copy: usize) -> usize {
        self.pieces[copy].iter().map(|p| p.len).sum()
    }

    /// Local replica `copy`'s runs of the reduced gradient `g` of variable `var`, one after
    /// another: a copy of its own, so that the whole gradient can be released (stage 2).
    pub(crate) fn shard_of(&self, copy: usize, var: usize, g: &Tensor) -> Result<Option<Tensor>> {
        let runs = &self.runs[copy][var];
        if runs.is_empty() {
            return Ok(None);
        }
        let flat = g.flatten_all()?;
        // `force_contiguous`, not `copy`: candle's `copy` clones the whole storage under the view.
        let parts = runs.iter().map(|k| flat.narrow(0, k.start, k.len())).collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Some(if parts.len() == 1 { parts[0].force_contiguous()? } else { Tensor::cat(&parts, 0)? }))
    }

    /// Steps local replica `copy`'s shard of `vars` with `opt` and the reduced `grads` (by
    /// variable, whole or, at stage 2, already cut to the replica's run ([`Self::shard_of`]);
    /// `None` for a variable no replica has a gradient for, whose pieces the optimizer then
    /// skips), then gathers every shard into `vars`. Collective over every replica of every
    /// worker. At stage 2 the whole gradients are released before the optimizer steps.
    /// With `unscale` (loss scaling), the gradient is multiplied by it first, and where any
    /// replica's shard of it is not finite no replica steps (returns false).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn step<O: Optimizer>(
        &self,
        ctx: &ReplicaContext<'_>,
        copy: usize,
        vars: &[Var],
        grads: Vec<Option<Tensor>>,
        clip_global_norm: Option<f64>,
        unscale: Option<f64>,
        opt: &mut O,
    ) -> Result<bool> {
        let mut mine = Vec::new();
        for p in &self.pieces[copy] {
            // A copy takes the variable's values, which a program may have written; at stage 3
            // only from a variable written since it was brought back (the others hold the
            // pieces' values, or none), which the residency's `settle` has taken already.
            let stale = if self.stage.shards_parameters() {
                !vars[p.var].is_released() && vars[p.var].written_since_restore()
            } else {
                !p.aliased
            };
            if stale {
                p.value.set(&vars[p.var].flatten_all()?.narrow(0, p.start, p.len)?)?;
            }
            if let Some(g) = &grads[p.var] {
                let g = g.flatten_all()?;
                // The whole gradient, or (stage 2) this replica's runs of it one after another.
                let at = if g.elem_count() == self.shapes[p.var].elem_count() { p.start } else { p.kept_at };
                let g = if at == 0 && g.elem_count() == p.len {
                    g
                } else if self.stage.shards_gradients() {
                    g.narrow(0, at, p.len)?.force_contiguous()?
                } else {
                    g.narrow(0, at, p.len)?.contiguous()?
                };
                mine.push((p, g));
            }
        }
        drop(grads);
        if let Some(k) = unscale {
            // Every replica of every worker learns whether any shard is not finite, and all
            // skip the step alike.
            let local = !crate::precision::all_finite(mine.iter().map(|(_, g)| g))?;
            if ctx.all_reduce_slice(crate::ReduceOp::Sum, &[f32::from(u8::from(local))])?[0] > 0.0 {
                return Ok(false);
            }
            for (_, g) in &mut mine {
                *g = (&*g * k)?;
            }
        }
        if let Some(max) = clip_global_norm {
            // The global norm: every shard's sum of squares (in f64, piece by piece), summed
            // over every replica of every worker.
            let mut sq = 0f64;
            for (_, g) in &mine {
                sq += g.to_dtype(DType::F32)?.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
            }
            let norm = (ctx.all_reduce_slice(crate::ReduceOp::Sum, &[sq as f32])?[0] as f64).sqrt();
            if norm > max {
                let k = max / norm;
                for (_, g) in &mut mine {
                    *g = (&*g * k)?;
                }
            }
        }
        let mut store = GradStore::default();
        for (p, g) in mine {
            store.insert(p.value.as_tensor(), g);
        }
        opt.step(&store)?;
        if self.stage.shards_parameters() {
            // Stage 3 gathers nothing: the next use of a variable brings it back. Every
            // replica's pieces are stepped before any is read again.
            ctx.barrier()?;
            return Ok(true);
        }
        self.gather(ctx, copy, vars)?;
        Ok(true)
    }
}

/// What [`Shards::step_summed`] calls to step with weighted terms: an optimizer's
/// [`ShardableOptimizer::step_summed`](crate::optim::ShardableOptimizer::step_summed).
pub(crate) type SummedStep<O> = fn(&mut O, &[(&GradStore, f32)]) -> Option<candle_core::Result<()>>;

impl Shards {
    /// Stage 1 on one machine, the reduction made in the step: steps local replica `copy`'s
    /// shard of `vars` with `all` (every local replica's gradients of the variables, `None`
    /// where it has none, and its weight, in replica order), each element's gradient the sum
    /// the in-memory reduction makes (a replica without a gradient of a variable that another
    /// has adds zeros, as the reduction does; a variable none has a gradient for is skipped),
    /// read where the replicas' backward passes wrote it; then gathers every shard into `vars`.
    /// `summed` steps with the terms; an optimizer that cannot is handed their sums.
    /// Collective over this machine's replicas.
    pub(crate) fn step_summed<O: Optimizer>(
        &self,
        ctx: &ReplicaContext<'_>,
        copy: usize,
        vars: &[Var],
        all: &[(Vec<Option<Tensor>>, f32)],
        summed: Option<SummedStep<O>>,
        opt: &mut O,
    ) -> Result<()> {
        let mut stores: Vec<GradStore> = all.iter().map(|_| GradStore::default()).collect();
        let mut sums = GradStore::default();
        for p in &self.pieces[copy] {
            if !p.aliased {
                p.value.set(&vars[p.var].flatten_all()?.narrow(0, p.start, p.len)?)?;
            }
            let Some(some) = all.iter().find_map(|(g, _)| g[p.var].as_ref()) else { continue };
            let mut terms = Vec::with_capacity(all.len());
            for (g, w) in all {
                let t = match &g[p.var] {
                    Some(g) => g.flatten_all()?.narrow(0, p.start, p.len)?,
                    None => Tensor::zeros(p.len, some.dtype(), some.device())?,
                };
                terms.push((t, *w));
            }
            if summed.is_some() {
                for (store, (t, _)) in stores.iter_mut().zip(terms) {
                    store.insert(p.value.as_tensor(), t);
                }
            } else {
                sums.insert(p.value.as_tensor(), crate::optim::sum_of(&terms)?);
            }
        }
        let terms: Vec<(&GradStore, f32)> = stores.iter().zip(all.iter().map(|(_, w)| *w)).collect();
        match summed.and_then(|f| f(opt, &terms)) {
            Some(done) => done?,
            None if summed.is_some() => {
                // The optimizer declined the terms (a dtype or device its loops do not take):
                // their sums, made whole.
                for p in &self.pieces[copy] {
                    let ts: Vec<(Tensor, f32)> = stores
                        .iter()
                        .zip(all)
                        .filter_map(|(s, (_, w))| s.get(p.value.as_tensor()).map(|t| (t.clone(), *w)))
                        .collect();
                    if !ts.is_empty() {
                        sums.insert(p.value.as_tensor(), crate::optim::sum_of(&ts)?);
                    }
                }
                opt.step(&sums)?;
            }
            None => opt.step(&sums)?,
        }
        drop(stores);
        self.gather(ctx, copy, vars)
    }
}

/// ZeRO's shards of `vars` (every local copy's trainable variables) over every replica in
/// sync now (in an elastic job, of the current membership).
pub(crate) fn lay_out_shards(stage: ZeroStage, vars: &[Vec<Var>], ext: Arc<dyn StrategyExtended>) -> Result<Shards> {
    let workers = ext.workers();
    let local = ext.num_replicas();
    let first = workers.map_or(0, |w| w.worker_index()) * local;
    let sizes: Vec<usize> = vars.first().map_or(Vec::new(), |v| v.iter().map(|v| v.elem_count()).collect());
    // Across workers each worker's shard is its reduce-scatter segment of every reduction
    // of the plan an overlapped step follows (fixed here, `fixed_plan`), so that the
    // reduce-scatter leaves each replica exactly the gradient it steps. Where some replica
    // would get no element that way (a tiny model over many replicas), the even split.
    if let (Some(w), Some(copy)) = (workers.filter(|w| w.num_workers() > 1), vars.first()) {
        let plan = fixed_plan(&*ext, copy, HashMap::new(), stage.shards_gradients());
        let layout =
            segment_layout(&unit_runs(&plan, copy), w.num_workers(), local, |len, g| w.scatter_segment(len, g));
        if layout.iter().all(|s| !s.is_empty()) {
            return Shards::new(stage, vars, first, layout, true, ext.clone());
        }
    }
    let layout = even_layout(&sizes, ext.num_replicas_in_sync());
    Shards::new(stage, vars, first, layout, false, ext)
}

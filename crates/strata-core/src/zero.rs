//! ZeRO's shards ([`ZeroStage`]): the trainable parameters split over every replica in sync
//! (across workers too) at element granularity. On one machine the parameters, flattened in
//! the optimizer's order, are split evenly ([`even_layout`]); across workers each worker holds
//! its reduce-scatter segment of every reduction of the step's plan, split evenly over its
//! replicas ([`segment_layout`]), so that the reduce-scatter leaves it exactly the gradient it
//! steps, bit for bit what the all-reduce leaves there, at half the bytes.
//! Each replica's optimizer is built over its shard only, so it keeps that shard's state
//! (AdamW's moments, momentum's velocity), steps that shard with the reduced gradient, and an
//! all-gather writes every shard back into every replica's copy of the parameters.
//!
//! A shard meets a variable in a [`Piece`]: a run of the variable's flattened elements, in a
//! `Var` that the optimizer steps. On a CPU device that `Var` is a view of the variable's own
//! storage (`Var::run_view`, from Strata's candle patch), so the step updates the variable in
//! place; elsewhere it is a copy that takes the variable's current values before each step.
//! Either way a write to the variable between steps (a restore, say) is seen, and the
//! piece's gradient is the same run of the reduced gradient: the update of
//! every element is the one a whole-variable step computes, bit for bit, for optimizers that
//! update element by element (Strata's fused ones).

use std::ops::Range;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::Optimizer;

use crate::{Error, ReplicaContext, Result, StrategyExtended, ZeroStage};

/// Elements `start..start + len` of variable `var` (flattened), as one replica's shard holds
/// them, and the variable the optimizer steps for them.
#[derive(Debug)]
pub(crate) struct Piece {
    var: usize,
    start: usize,
    len: usize,
    /// Where the piece starts in its replica's kept gradient of the variable (its runs of
    /// the variable one after another, in order: stage 2).
    kept_at: usize,
    value: Var,
    /// Whether `value` shares the variable's storage (a view of its run, on CPU devices): the
    /// optimizer then updates the variable's elements in place, nothing is copied before a
    /// step, and the gather leaves this run alone. Otherwise `value` is a copy of its own,
    /// refreshed from the variable before each step and gathered back after it.
    aliased: bool,
}

/// Elements `start..start + len` of variable `var`, flattened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) var: usize,
    pub(crate) start: usize,
    pub(crate) len: usize,
}

/// The runs of `spans` (one after another) that positions `range` of their concatenation
/// cover, in order; a run that continues the one before it is joined to it.
fn cut(spans: &[Run], range: Range<usize>, into: &mut Vec<Run>) {
    let mut at = 0;
    for s in spans {
        let (lo, hi) = (range.start.max(at), range.end.min(at + s.len));
        if lo < hi {
            let run = Run { var: s.var, start: s.start + lo - at, len: hi - lo };
            match into.last_mut() {
                Some(last) if last.var == run.var && last.start + last.len == run.start => last.len += run.len,
                _ => into.push(run),
            }
        }
        at += s.len;
        if at >= range.end {
            break;
        }
    }
}

/// Every replica's shard (by its index in sync) when the flattened variables of `sizes` are
/// split evenly at element granularity: replica `g` of `n` holds elements `g·T/n ..
/// (g+1)·T/n` of the `T`.
pub(crate) fn even_layout(sizes: &[usize], in_sync: usize) -> Vec<Vec<Run>> {
    let spans: Vec<Run> = sizes.iter().enumerate().map(|(var, &len)| Run { var, start: 0, len }).collect();
    let total = sizes.iter().sum();
    (0..in_sync)
        .map(|g| {
            let mut runs = Vec::new();
            cut(&spans, shard_range(total, in_sync, g), &mut runs);
            runs
        })
        .collect()
}

/// Every replica's shard (by its index in sync) when each of the reductions `units` (each the
/// runs it reduces, one after another) is reduce-scattered across `workers` workers of
/// `local` replicas: worker `w` holds its `segment(len, w)` of every unit, split evenly over
/// its replicas. Each replica then receives from the reduce-scatter exactly the gradient it
/// steps.
pub(crate) fn segment_layout(
    units: &[Vec<Run>],
    workers: usize,
    local: usize,
    segment: impl Fn(usize, usize) -> Range<usize>,
) -> Vec<Vec<Run>> {
    let mut layout = vec![Vec::new(); workers * local];
    for unit in units {
        let len: usize = unit.iter().map(|r| r.len).sum();
        for w in 0..workers {
            let seg = segment(len, w);
            for c in 0..local {
                let mine = shard_range(seg.len(), local, c);
                cut(unit, seg.start + mine.start..seg.start + mine.end, &mut layout[w * local + c]);
            }
        }
    }
    layout
}

/// Where every replica's shard lies, and this worker's replicas' pieces.
#[derive(Debug)]
pub(crate) struct Shards {
    stage: ZeroStage,
    /// Each variable's first element in the flattened model.
    offsets: Vec<usize>,
    /// Each local replica's pieces, in the order its optimizer steps them.
    pieces: Vec<Vec<Piece>>,
    /// Each local replica's runs of each variable (by index; in order, none where its shard
    /// meets none): the only elements of the reduced gradient it needs.
    runs: Vec<Vec<Vec<Range<usize>>>>,
    /// Each local replica's span of each variable, from its first run's start to its last
    /// run's end (empty where it has none).
    keep: Vec<Vec<Range<usize>>>,
    /// Every replica's shard, by its index in sync: the runs of its pieces, in order.
    layout: Vec<Vec<Run>>,
    /// Whether the shards lie on the workers' reduce-scatter segments ([`segment_layout`]).
    segments: bool,
    /// Each variable's shape.
    shapes: Vec<candle_core::Shape>,
    /// The strategy, whose workers' collectives gather the optimizer state for a checkpoint.
    ext: Arc<dyn StrategyExtended>,
}

/// Shard `g` of `total` elements split over `n` replicas: the sizes differ by at most one.
pub(crate) fn shard_range(total: usize, n: usize, g: usize) -> Range<usize> {
    let at = |i: usize| (total as u128 * i as u128 / n.max(1) as u128) as usize;
    at(g)..at(g + 1)
}

/// The optimizers that update element by element, and so give a whole variable's results on
/// any run of its elements.
pub(crate) fn shardable<O: Optimizer>() -> bool {
    let o = typeid::of::<O>();
    [
        typeid::of::<crate::optim::FusedAdamW>(),
        typeid::of::<crate::optim::FusedSgd>(),
        typeid::of::<crate::optim::FusedMomentum>(),
    ]
    .contains(&o)
}

/// Floats of state the optimizer keeps per element it steps (AdamW's two moments, momentum's
/// velocity), for the memory check of `Replicated::optimizer`; 0 for an optimizer it does not
/// know.
pub(crate) fn state_per_element<O: Optimizer>() -> u64 {
    let o = typeid::of::<O>();
    if o == typeid::of::<crate::optim::FusedAdamW>() || o == typeid::of::<candle_nn::AdamW>() {
        2
    } else if o == typeid::of::<crate::optim::FusedMomentum>() {
        1
    } else {
        0
    }
}

impl Shards {
    /// The shards of `vars` (each local replica's copy of the optimizer's variables) laid out
    /// as `layout` says (every replica's runs, by its index in sync), of which this worker's
    /// replicas are `first..first + vars.len()`; `segments` says whether the layout is a
    /// [`segment_layout`].
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
                let aliased = v.device().is_cpu() && v.is_contiguous() && !elastic;
                let value = if aliased {
                    v.run_view(start, len)?
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
    pub(crate) fn step<O: Optimizer>(
        &self,
        ctx: &ReplicaContext<'_>,
        copy: usize,
        vars: &[Var],
        grads: Vec<Option<Tensor>>,
        clip_global_norm: Option<f64>,
        opt: &mut O,
    ) -> Result<()> {
        let mut mine = Vec::new();
        for p in &self.pieces[copy] {
            if !p.aliased {
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
        self.gather(ctx, copy, vars)
    }

    /// Which piece of local replica `copy` a shard's state tensor `key` (`"m.3"`: per piece,
    /// as the fused optimizers name theirs) belongs to, with the name before the index; `None`
    /// for a tensor of the whole optimizer (AdamW's step count `t`).
    fn piece_key<'k>(&self, copy: usize, key: &'k str, t: &Tensor) -> Option<(&'k str, usize)> {
        let (name, i) = key.rsplit_once('.')?;
        let i: usize = i.parse().ok()?;
        (self.pieces[copy].get(i)?.len == t.elem_count()).then_some((name, i))
    }

    /// The optimizer state of every local replica's shard (`states`, by local replica, as
    /// each copy's optimizer saves it) gathered into the state one optimizer over the whole
    /// model saves at stage 0: `name.i` for the model's `i`-th variable, in its shape. Across
    /// workers every worker must call it (an all-gather).
    pub(crate) fn gather_state(&self, states: Vec<Vec<(String, Tensor)>>) -> Result<Vec<(String, Tensor)>> {
        let first = states.first().ok_or_else(|| Error::Checkpoint("no optimizer copy to save".into()))?;
        // The names of per-piece tensors in copy 0's order (every shard has a piece).
        let mut names: Vec<String> = Vec::new();
        let mut out = Vec::new();
        for (key, t) in first {
            match self.piece_key(0, key, t) {
                Some((name, _)) => {
                    if !names.iter().any(|n| n == name) {
                        names.push(name.to_string());
                    }
                }
                None => out.push((key.clone(), t.clone())),
            }
        }
        // This worker's run of each name: its replicas' pieces in order, one after another.
        let mut run: Vec<f32> = Vec::new();
        let mut dtypes = vec![DType::F32; names.len()];
        for (k, name) in names.iter().enumerate() {
            for (c, state) in states.iter().enumerate() {
                let mut pieces: Vec<Option<&Tensor>> = vec![None; self.pieces[c].len()];
                for (key, t) in state {
                    if let Some((n, i)) = self.piece_key(c, key, t).filter(|(n, _)| n == name) {
                        debug_assert_eq!(n, name);
                        pieces[i] = Some(t);
                    }
                }
                for (i, t) in pieces.into_iter().enumerate() {
                    let t = t.ok_or_else(|| {
                        Error::Checkpoint(format!(
                            "the optimizer of replica copy {c} saved no {name:?} for its piece {i}"
                        ))
                    })?;
                    dtypes[k] = t.dtype();
                    run.extend(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
                }
            }
        }
        let all: Vec<f32> = match self.ext.workers() {
            Some(w) if w.num_workers() > 1 => w.all_gather(&run)?.concat(),
            _ => run,
        };
        let total: usize = self.shapes.iter().map(|s| s.elem_count()).sum();
        if all.len() != total * names.len() {
            return Err(Error::Checkpoint(format!(
                "the gathered optimizer state holds {} values, {} tensors of the model's {total} elements need {}; every worker must build the same model and optimizer",
                all.len(),
                names.len(),
                total * names.len()
            )));
        }
        // `all` holds, worker by worker, each name's run (its replicas' pieces one after
        // another): put every piece in its place, name by name.
        let mut by_name: Vec<Vec<f32>> = vec![vec![0.0; total]; names.len()];
        let local = self.ext.num_replicas();
        let mut at = 0;
        for g in 0..self.workers_runs() {
            let shards = &self.layout[g * local..(g + 1) * local];
            for v in by_name.iter_mut() {
                for r in shards.iter().flatten() {
                    let to = self.offsets[r.var] + r.start;
                    v[to..to + r.len].copy_from_slice(&all[at..at + r.len]);
                    at += r.len;
                }
            }
        }
        for (k, name) in names.iter().enumerate() {
            for (i, shape) in self.shapes.iter().enumerate() {
                let flat = &by_name[k][self.offsets[i]..self.offsets[i] + shape.elem_count()];
                let t = Tensor::from_slice(flat, shape.clone(), &candle_core::Device::Cpu)?.to_dtype(dtypes[k])?;
                out.push((format!("{name}.{i}"), t));
            }
        }
        Ok(out)
    }

    /// The number of workers whose runs [`Self::gather_state`] receives.
    fn workers_runs(&self) -> usize {
        self.ext.workers().map_or(1, |w| w.num_workers().max(1))
    }

    /// The state local replica `copy`'s optimizer loads, cut from the state of one optimizer
    /// over the whole model (stage 0's, or [`Self::gather_state`]'s): for each piece, its run
    /// of each `name.i` of its variable; tensors of the whole optimizer as they are.
    pub(crate) fn cut_state(&self, copy: usize, state: &[(String, Tensor)]) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (key, t) in state {
            let var = key
                .rsplit_once('.')
                .and_then(|(name, i)| Some((name, i.parse::<usize>().ok()?)))
                .filter(|&(_, i)| self.shapes.get(i).is_some_and(|s| s.elem_count() == t.elem_count()));
            match var {
                Some((name, i)) => {
                    for (k, p) in self.pieces[copy].iter().enumerate().filter(|(_, p)| p.var == i) {
                        out.push((format!("{name}.{k}"), t.flatten_all()?.narrow(0, p.start, p.len)?.contiguous()?));
                    }
                }
                None => out.push((key.clone(), t.clone())),
            }
        }
        Ok(out)
    }

    /// Writes every replica's shard into this replica's `vars`.
    fn gather(&self, ctx: &ReplicaContext<'_>, copy: usize, vars: &[Var]) -> Result<()> {
        let mine: Vec<Tensor> = self.pieces[copy].iter().map(|p| p.value.as_tensor().clone()).collect();
        // This worker's replicas' pieces, one tensor each, and one run per other worker (its
        // replicas' pieces one after another).
        let local = self.pieces.len();
        let counts: Vec<usize> = (0..self.workers_runs())
            .map(|g| self.layout[g * local..(g + 1) * local].iter().flatten().map(|r| r.len).sum())
            .collect();
        let gathered = ctx.gather_runs(mine, &counts)?;
        let me = self.ext.workers().map_or(0, |w| w.worker_index());
        let mut placed: Vec<(Run, Tensor)> = Vec::with_capacity(gathered.len());
        let mut tensors = gathered.into_iter();
        for g in 0..self.workers_runs() {
            let shards = &self.layout[g * local..(g + 1) * local];
            if g == me {
                for r in shards.iter().flatten() {
                    let t = tensors
                        .next()
                        .ok_or_else(|| Error::Scope("the gathered shards are fewer than the pieces".into()))?;
                    placed.push((*r, t));
                }
            } else {
                let t =
                    tensors.next().ok_or_else(|| Error::Scope(format!("worker {g}'s gathered shard is missing")))?;
                let runs = shards.concat();
                let expected: usize = runs.iter().map(|r| r.len).sum();
                if t.elem_count() != expected {
                    return Err(Error::Scope(format!(
                        "worker {g}'s gathered shard holds {} elements, its layout {expected}; every replica must build the same model",
                        t.elem_count()
                    )));
                }
                let mut at = 0;
                for r in runs {
                    placed.push((r, t.narrow(0, at, r.len)?));
                    at += r.len;
                }
            }
        }
        // Each variable's parts, by where they start in it.
        let mut parts: Vec<Vec<(usize, Tensor)>> = vec![Vec::new(); vars.len()];
        for (r, t) in placed {
            if r.len != t.elem_count() {
                return Err(Error::Scope(format!(
                    "a gathered shard's run of variable {} holds {} elements, {} expected; every replica must build the same model",
                    r.var,
                    t.elem_count(),
                    r.len
                )));
            }
            parts[r.var].push((r.start, t));
        }
        for (v, mut parts) in vars.iter().zip(parts) {
            parts.sort_by_key(|(at, _)| *at);
            let covered: usize = parts.iter().map(|(_, p)| p.elem_count()).sum();
            if covered != v.elem_count() {
                return Err(Error::Scope(format!(
                    "the gathered shards hold {covered} of a variable's {} elements; every replica must build the same model",
                    v.elem_count()
                )));
            }
            if v.is_contiguous()
                && parts.iter().all(|(_, p)| p.dtype() == v.dtype() && p.device().same_device(v.device()))
            {
                // In place, run by run: no whole copy of the variable is made. A run that is a
                // view of this very variable (this replica's own piece, which the optimizer
                // stepped in place) is there already. The other runs may be views of the other
                // replicas' variables, which they write at the same time: `copy_run_from`
                // takes the two locks in one order.
                for (at, part) in &parts {
                    v.as_tensor().copy_run_from(*at, part)?;
                }
            } else {
                let parts: Vec<Tensor> = parts
                    .into_iter()
                    .map(|(_, p)| Ok(p.to_dtype(v.dtype())?.to_device(v.device())?))
                    .collect::<Result<_>>()?;
                v.set(&Tensor::cat(&parts, 0)?.reshape(v.shape())?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_split_evenly_and_cover_every_element_once() {
        for (total, n) in [(10, 3), (7, 7), (5, 8), (4_325_386, 4), (0, 2)] {
            let ranges: Vec<_> = (0..n).map(|g| shard_range(total, n, g)).collect();
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[n - 1].end, total);
            for w in ranges.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            let (lo, hi) = (ranges.iter().map(|r| r.len()).min(), ranges.iter().map(|r| r.len()).max());
            assert!(hi.unwrap() - lo.unwrap() <= 1, "{total} over {n}: {ranges:?}");
        }
    }

    /// Each variable's elements, marked by the replicas whose runs hold them.
    fn owners(sizes: &[usize], layout: &[Vec<Run>]) -> Vec<Vec<Vec<usize>>> {
        let mut owner: Vec<Vec<Vec<usize>>> = sizes.iter().map(|&n| vec![Vec::new(); n]).collect();
        for (g, runs) in layout.iter().enumerate() {
            for r in runs {
                for o in &mut owner[r.var][r.start..r.start + r.len] {
                    o.push(g);
                }
            }
        }
        owner
    }

    #[test]
    fn the_even_layout_is_the_flattened_model_cut_evenly() {
        let sizes = [5, 1, 7, 3];
        let layout = even_layout(&sizes, 3);
        assert_eq!(layout[0], vec![Run { var: 0, start: 0, len: 5 }]);
        assert_eq!(layout[1], vec![Run { var: 1, start: 0, len: 1 }, Run { var: 2, start: 0, len: 4 }]);
        assert_eq!(layout[2], vec![Run { var: 2, start: 4, len: 3 }, Run { var: 3, start: 0, len: 3 }]);
    }

    #[test]
    fn the_segment_layout_gives_each_worker_its_segment_of_every_unit() {
        // Two buckets and a matrix of 4 x 5 in blocks of 2 rows.
        let sizes = [3, 20, 4, 6];
        let units = vec![
            vec![Run { var: 3, start: 0, len: 6 }, Run { var: 2, start: 0, len: 4 }],
            vec![Run { var: 1, start: 0, len: 10 }],
            vec![Run { var: 1, start: 10, len: 10 }],
            vec![Run { var: 0, start: 0, len: 3 }],
        ];
        for (workers, local) in [(2, 1), (3, 1), (2, 2), (3, 2)] {
            let segment = |len: usize, w: usize| {
                let k = (w + 1) % workers;
                len * k / workers..len * (k + 1) / workers
            };
            let layout = segment_layout(&units, workers, local, segment);
            assert_eq!(layout.len(), workers * local);
            // Every element is held by exactly one replica.
            for (v, elems) in owners(&sizes, &layout).iter().enumerate() {
                assert!(elems.iter().all(|o| o.len() == 1), "{workers}x{local}: variable {v}: {elems:?}");
            }
            // Each worker's replicas hold exactly its segment of every unit.
            for unit in &units {
                let len: usize = unit.iter().map(|r| r.len).sum();
                for w in 0..workers {
                    let mut want = Vec::new();
                    cut(unit, segment(len, w), &mut want);
                    let elems = |runs: &[Run]| -> Vec<(usize, usize)> {
                        runs.iter().flat_map(|r| (r.start..r.start + r.len).map(move |e| (r.var, e))).collect()
                    };
                    let in_unit = elems(unit);
                    let mut got: Vec<(usize, usize)> = layout[w * local..(w + 1) * local]
                        .iter()
                        .flat_map(|runs| elems(runs))
                        .filter(|x| in_unit.contains(x))
                        .collect();
                    let mut want: Vec<(usize, usize)> =
                        want.iter().flat_map(|r| (r.start..r.start + r.len).map(move |e| (r.var, e))).collect();
                    got.sort_unstable();
                    want.sort_unstable();
                    assert_eq!(got, want, "{workers}x{local}: worker {w}, unit {unit:?}");
                }
            }
        }
    }
}

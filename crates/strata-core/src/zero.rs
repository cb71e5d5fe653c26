//! ZeRO's shards ([`ZeroStage`]): the trainable parameters, flattened in the optimizer's
//! order, split evenly over every replica in sync (across workers too) at element granularity.
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
    value: Var,
    /// Whether `value` shares the variable's storage (a view of its run, on CPU devices): the
    /// optimizer then updates the variable's elements in place, nothing is copied before a
    /// step, and the gather leaves this run alone. Otherwise `value` is a copy of its own,
    /// refreshed from the variable before each step and gathered back after it.
    aliased: bool,
}

/// Where every replica's shard lies, and this worker's replicas' pieces.
#[derive(Debug)]
pub(crate) struct Shards {
    stage: ZeroStage,
    /// Each variable's first element in the flattened model.
    offsets: Vec<usize>,
    /// Each local replica's pieces, in the order of the flattened model.
    pieces: Vec<Vec<Piece>>,
    /// Each local replica's run of each variable (by index; empty where its shard has none):
    /// the only elements of the reduced gradient it needs.
    keep: Vec<Vec<Range<usize>>>,
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
    /// The shards of `vars` (each local replica's copy of the optimizer's variables) over
    /// `in_sync` replicas, of which this worker's are `first..first + vars.len()`.
    pub(crate) fn new(
        stage: ZeroStage,
        vars: &[Vec<Var>],
        first: usize,
        in_sync: usize,
        ext: Arc<dyn StrategyExtended>,
    ) -> Result<Self> {
        let sizes: Vec<usize> = vars.first().map_or(Vec::new(), |v| v.iter().map(|v| v.elem_count()).collect());
        let shapes = vars.first().map_or(Vec::new(), |v| v.iter().map(|v| v.shape().clone()).collect());
        let mut offsets = Vec::with_capacity(sizes.len());
        let mut total = 0;
        for n in &sizes {
            offsets.push(total);
            total += n;
        }
        if total < in_sync {
            return Err(Error::ZeroStage {
                stage: stage.number(),
                what: format!("{total} trainable elements over {in_sync} replicas"),
                fix: "every replica's shard needs at least one element; use stage 0 or fewer replicas",
            });
        }
        let mut pieces = Vec::with_capacity(vars.len());
        let mut keep = Vec::with_capacity(vars.len());
        for (c, copy) in vars.iter().enumerate() {
            let shard = shard_range(total, in_sync, first + c);
            let mut mine = Vec::new();
            let mut runs = vec![0..0; copy.len()];
            for (i, v) in copy.iter().enumerate() {
                let (lo, hi) = (offsets[i].max(shard.start), (offsets[i] + sizes[i]).min(shard.end));
                if lo >= hi {
                    continue;
                }
                let (start, len) = (lo - offsets[i], hi - lo);
                let aliased = v.device().is_cpu() && v.is_contiguous();
                let value = if aliased {
                    v.run_view(start, len)?
                } else {
                    Var::from_tensor(&v.flatten_all()?.narrow(0, start, len)?.force_contiguous()?)?
                };
                mine.push(Piece { var: i, start, len, value, aliased });
                runs[i] = start..start + len;
            }
            pieces.push(mine);
            keep.push(runs);
        }
        Ok(Self { stage, offsets, pieces, keep, shapes, ext })
    }

    /// The variables local replica `copy`'s optimizer steps: its pieces.
    pub(crate) fn piece_vars(&self, copy: usize) -> Vec<Var> {
        self.pieces[copy].iter().map(|p| p.value.clone()).collect()
    }

    /// Local replica `copy`'s run of each variable, by index.
    pub(crate) fn keep(&self, copy: usize) -> &[Range<usize>] {
        &self.keep[copy]
    }

    /// The stage.
    pub(crate) fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// Elements of the optimizer's state-bearing copy local replica `copy` keeps.
    pub(crate) fn elements(&self, copy: usize) -> usize {
        self.pieces[copy].iter().map(|p| p.len).sum()
    }

    /// Local replica `copy`'s run of the reduced gradient `g` of variable `var`: a copy of its
    /// own, so that the whole gradient can be released (stage 2).
    pub(crate) fn shard_of(&self, copy: usize, var: usize, g: &Tensor) -> Result<Option<Tensor>> {
        let k = &self.keep[copy][var];
        if k.is_empty() {
            return Ok(None);
        }
        // `force_contiguous`, not `copy`: candle's `copy` clones the whole storage under the view.
        Ok(Some(g.flatten_all()?.narrow(0, k.start, k.len())?.force_contiguous()?))
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
                let g = if g.elem_count() == p.len {
                    g
                } else if self.stage.shards_gradients() {
                    g.narrow(0, p.start, p.len)?.force_contiguous()?
                } else {
                    g.narrow(0, p.start, p.len)?.contiguous()?
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
        // `all` holds, worker by worker, each name's run: reorder name by name.
        let mut by_name: Vec<Vec<f32>> = vec![Vec::with_capacity(total); names.len()];
        let mut at = 0;
        for g in 0..self.workers_runs() {
            let len = self.worker_elements(g);
            for v in by_name.iter_mut() {
                v.extend_from_slice(&all[at..at + len]);
                at += len;
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

    /// The elements worker `g`'s replicas' shards hold together.
    fn worker_elements(&self, g: usize) -> usize {
        let total: usize = self.shapes.iter().map(|s| s.elem_count()).sum();
        let local = self.ext.num_replicas();
        let in_sync = self.workers_runs() * local;
        let r = shard_range(total, in_sync, g * local).start..shard_range(total, in_sync, (g + 1) * local - 1).end;
        r.len()
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
        // The flattened model, in order: this worker's replicas' pieces, one run per other
        // worker.
        let runs = ctx.gather_runs(mine)?;
        let total: usize = runs.iter().map(|r| r.elem_count()).sum();
        let expected = self.offsets.last().map_or(0, |&o| o + vars.last().map_or(0, |v| v.elem_count()));
        if total != expected {
            return Err(Error::Scope(format!(
                "the gathered shards hold {total} elements, the model {expected}; every replica must build the same model"
            )));
        }
        let (mut run, mut run_start) = (0, 0);
        for (i, v) in vars.iter().enumerate() {
            let (lo, hi) = (self.offsets[i], self.offsets[i] + v.elem_count());
            let mut parts = Vec::new();
            let mut at = lo;
            while at < hi {
                while run_start + runs[run].elem_count() <= at {
                    run_start += runs[run].elem_count();
                    run += 1;
                }
                let end = hi.min(run_start + runs[run].elem_count());
                parts.push((at - lo, runs[run].narrow(0, at - run_start, end - at)?));
                at = end;
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
}

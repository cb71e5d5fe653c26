//! The overlapped step: a replica's backward pass that starts each reduction of its plan
//! ([`OverlapPlan`]) from candle's gradient hooks as soon as its gradients are final
//! (`OverlapStep`, a `GradHook`), finishes them in order, and hands the reduced gradients to the
//! distributed optimizer; and the entry points of a replica's step,
//! [`ReplicaContext::backward_and_sync`] (which learns and agrees the plan) and
//! [`ReplicaContext::sync_and_apply`] (the reduction after the pass, with accumulation).
//!
//! This module must not know how an optimizer steps or where ZeRO's shards lie: it asks the
//! [`DistributedOptimizer`] to apply, and the shards which runs of each gradient to keep.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_nn::Optimizer;

use crate::context::ReplicaContext;
use crate::cross_device::Destination;
use crate::distributed_optimizer::DistributedOptimizer;
use crate::extended::VariablePolicy;
use crate::overlap_plan::{cut_plan, OverlapPlan, Unit};
use crate::variables::lock;
use crate::zero::{fixed_plan, Shards};
use crate::{Error, ReduceOp, Result};

/// A reduction of an overlapped step, started.
struct Launched {
    /// Its input tensors (a bucket's gradients, or one block of rows).
    input: Vec<Tensor>,
    seq: u64,
    started: crate::cross_device::Started,
    /// A bucket's result as far as `start` handed it over is in its gradients already, up
    /// to this position.
    written: crate::context::ScatterPos,
    /// A block's result as far as `start` handed it over, written out at `finish` (the
    /// whole gradient it goes into may not exist yet).
    early: Vec<f32>,
    /// A bucket's runs to write, by tensor, under ZeRO.
    keep: Option<Vec<std::ops::Range<usize>>>,
}

/// The state of an overlapped step, which the backward pass calls as gradients become final.
struct OverlapStep<'a, 'c> {
    ctx: &'a ReplicaContext<'c>,
    plan: &'a OverlapPlan,
    vars: &'a [Var],
    dest: Destination,
    weight: f32,
    /// This replica's final gradients so far (and, once the reductions finish, their sums).
    local: Vec<Option<Tensor>>,
    /// The blocks of rows computed so far, per variable (each taken when its unit starts).
    blocks: Vec<Vec<Option<Tensor>>>,
    /// Gradients each bucket still waits for.
    left: Vec<usize>,
    /// The units started so far: the plan's first `launched`.
    launched: usize,
    /// The units started and not yet finished, oldest first, with their index in the plan.
    pending: std::collections::VecDeque<(usize, Launched)>,
    /// The error that ended the pass, if a start failed.
    failed: Option<Error>,
    /// The first failure to write a reduced gradient back (reported once every unit is
    /// finished: every replica takes part in every collective).
    unwritten: Result<()>,
    /// This replica's run of each variable under ZeRO (the elements of the reduced gradients
    /// it needs), by variable.
    keep: Option<&'a [std::ops::Range<usize>]>,
    /// ZeRO stage 2: the shards, and this replica's copy. Each unit is then finished as soon
    /// as it can be in the pass, its run of the result kept in `kept` and its whole
    /// gradients released; the pass hands the gradients of the plan's variables over (no
    /// store holds them) and never joins a weight's blocks of rows.
    shards: Option<(&'a Shards, usize)>,
    /// Stage 2: this replica's run of each variable's reduced gradient, by variable.
    kept: Vec<Option<Tensor>>,
    /// Which of the plan's variables this replica has a gradient for (handed over whole or
    /// in blocks of rows).
    had: Vec<bool>,
    /// The plan's variables in the order their gradients came in.
    seen: Vec<usize>,
    /// Whether each replica needs only its worker's reduce-scatter segment of every unit's
    /// result (ZeRO's shards across workers lie on them).
    scatter: bool,
}

/// ZeRO stage 2 across workers: the cross-worker reductions a replica leaves running while the
/// pass goes on, before it finishes the oldest (more overlap, more whole gradients held: at most
/// this many buckets or blocks of rows, 8 MiB at the default 2 MiB blocks). At 2, the 4.3M MLP
/// over 2 hosts at 1 Gbit/s ran at 1,223-1,314 examples/s; at 4, 1,260-1,416 (single runs
/// alternated, 2026-11-28): the backward pass's other products wait less for the wire.
const STAGE2_IN_FLIGHT: usize = 4;

impl OverlapStep<'_, '_> {
    /// Whether the next unit's gradients are all final.
    fn next_ready(&self) -> bool {
        match self.plan.units.get(self.launched) {
            None => false,
            Some(&Unit::Bucket(b)) => self.left[b] == 0,
            Some(&Unit::Rows { var, first, .. }) => {
                self.local[var].is_some() || self.blocks[var].len() > first / self.plan.rows_of[var].unwrap_or(1)
            }
        }
    }

    /// Starts the next unit: this replica's final gradients, zeros for a variable it has none
    /// for (as a reduction after the pass gives them).
    fn launch(&mut self) -> Result<()> {
        let n = self.launched;
        let ctx = self.ctx;
        let (input, ids, label) = match self.plan.units[n] {
            Unit::Bucket(b) => {
                let mut input = Vec::new();
                for &i in &self.plan.order[self.plan.buckets[b].tensors.clone()] {
                    let g = match &self.local[i] {
                        Some(g) => g.clone(),
                        None => self.local[i].insert(self.vars[i].zeros_like()?).clone(),
                    };
                    input.push(g);
                }
                let ids =
                    self.plan.order[self.plan.buckets[b].tensors.clone()].iter().map(|&i| self.vars[i].id()).collect();
                (input, ids, format!("bucket {b}"))
            }
            Unit::Rows { var, first, rows } => {
                let k = first / self.plan.rows_of[var].unwrap_or(1);
                let block = match (&self.local[var], self.blocks[var].get_mut(k).and_then(Option::take)) {
                    (_, Some(block)) => block,
                    (Some(g), None) => g.narrow(0, first, rows)?,
                    (None, None) => Tensor::zeros(
                        (rows, self.vars[var].dims()[1]),
                        self.vars[var].dtype(),
                        self.vars[var].device(),
                    )?,
                };
                (vec![block], vec![self.vars[var].id()], format!("rows {first}.. of variable {var}"))
            }
        };
        let _p = ctx.phase("reduce", &label);
        let ops = ctx.shared.ext.cross_device_ops();
        let req = ctx.request(ReduceOp::Sum, self.dest, &input, self.weight);
        let seq = req.seq;
        let mut early = Vec::new();
        let keep = match (self.plan.units[n], self.keep) {
            (Unit::Bucket(b), Some(k)) => {
                Some(self.plan.order[self.plan.buckets[b].tensors.clone()].iter().map(|&i| k[i].clone()).collect())
            }
            _ => None,
        };
        // ZeRO across workers: each worker needs only its segment of the result, on which its
        // replicas' shards lie.
        let start = |req, ids: &[candle_core::TensorId], out: &mut dyn FnMut(&[f32])| {
            if self.scatter {
                ops.start_scatter(req, ids, out)
            } else {
                ops.start_gradients(req, ids, out)
            }
        };
        let (started, written) = match self.plan.units[n] {
            Unit::Bucket(_) => {
                let mut sink = crate::context::Scatter::new(&input, ops.reduces_in_place()).keeping(keep.as_deref());
                let started = start(req, &ids, &mut |piece| sink.write(piece))?;
                (started, sink.pause())
            }
            Unit::Rows { .. } => (start(req, &ids, &mut |piece| early.extend_from_slice(piece))?, Default::default()),
        };
        self.pending.push_back((n, Launched { input, seq, started, written, early, keep }));
        self.launched += 1;
        Ok(())
    }

    /// Finishes the oldest unit started and not finished: writes its result into this
    /// replica's gradients (stage 2: keeps this replica's run of it and releases the whole).
    fn finish_next(&mut self) -> Result<()> {
        let Some((n, launched)) = self.pending.pop_front() else { return Ok(()) };
        let ctx = self.ctx;
        // Waiting for the unit's reduction (across workers: the ring thread's collective) and
        // writing its result back.
        let _p = ctx.phase("reduce", "finish");
        let ops = ctx.shared.ext.cross_device_ops();
        let Launched { input, seq, started, written, early, keep } = launched;
        let req = crate::cross_device::ReduceRequest {
            group: &ctx.shared.group,
            replica: ctx.replica,
            seq,
            op: ReduceOp::Sum,
            dest: self.dest,
            input: &input,
            weight: self.weight,
        };
        match (self.plan.units[n], self.shards) {
            (Unit::Rows { var, first, rows }, Some((shards, copy))) => {
                let mut result = early;
                ops.finish(req, started, &mut |piece| result.extend_from_slice(piece))?;
                if self.dest.receives(ctx.replica) {
                    let kept = self.keep_rows(shards, copy, var, first, &input[0], &result);
                    self.unwritten = std::mem::replace(&mut self.unwritten, Ok(())).and(kept);
                }
                if first + rows >= self.vars[var].dims()[0] {
                    // The last block: a whole gradient the pass handed over goes too.
                    self.local[var] = None;
                }
            }
            (Unit::Rows { var, first, rows }, None) => {
                // A block's result goes into its rows of the variable's whole gradient (zeros
                // where this replica has none).
                let whole = match &self.local[var] {
                    Some(g) => g.clone(),
                    None => self.local[var].insert(self.vars[var].zeros_like()?).clone(),
                };
                let target = vec![whole.narrow(0, first, rows)?];
                let mut sink = crate::context::Scatter::resume(&target, ops.reduces_in_place(), written);
                sink.write(&early);
                ops.finish(req, started, &mut |piece| sink.write(piece))?;
                self.unwritten = std::mem::replace(&mut self.unwritten, Ok(())).and(sink.check());
            }
            (Unit::Bucket(b), shards) => {
                // A bucket's result goes back into its gradients.
                let mut sink =
                    crate::context::Scatter::resume(&input, ops.reduces_in_place(), written).keeping(keep.as_deref());
                sink.write(&early);
                ops.finish(req, started, &mut |piece| sink.write(piece))?;
                self.unwritten = std::mem::replace(&mut self.unwritten, Ok(())).and(sink.check());
                if let Some((shards, copy)) = shards {
                    // Stage 2: this replica keeps its run of the bucket's reduced gradients;
                    // the whole buffers go now.
                    drop(input);
                    for &i in &self.plan.order[self.plan.buckets[b].tensors.clone()] {
                        if let Some(g) = self.local[i].take() {
                            self.kept[i] = shards.shard_of(copy, i, &g)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Stage 2: writes this replica's runs of the reduced rows `first..` of variable `var`
    /// (`result`, or in place in `block` for ops that reduce in place) into `kept`, where the
    /// variable's runs lie one after another.
    fn keep_rows(
        &mut self,
        shards: &Shards,
        copy: usize,
        var: usize,
        first: usize,
        block: &Tensor,
        result: &[f32],
    ) -> Result<()> {
        let v = &self.vars[var];
        let at = first * v.dims().get(1).copied().unwrap_or(1);
        let mut kept_at = 0;
        for k in shards.runs(copy, var) {
            let (lo, hi) = (k.start.max(at), k.end.min(at + block.elem_count()));
            if lo < hi {
                let part = if self.ctx.shared.ext.cross_device_ops().reduces_in_place() {
                    block.flatten_all()?.narrow(0, lo - at, hi - lo)?
                } else {
                    let values = result.get(lo - at..hi - at).ok_or_else(|| {
                        Error::Scope(format!(
                            "the reduction of rows {first}.. of variable {var} returned {} values, {} expected",
                            result.len(),
                            block.elem_count()
                        ))
                    })?;
                    Tensor::from_slice(values, hi - lo, &Device::Cpu)?.to_dtype(v.dtype())?.to_device(v.device())?
                };
                let dst = match &self.kept[var] {
                    Some(t) => t.clone(),
                    None => {
                        let len = shards.runs(copy, var).iter().map(|r| r.len()).sum::<usize>();
                        self.kept[var].insert(Tensor::zeros(len, v.dtype(), v.device())?).clone()
                    }
                };
                dst.slice_set(&part, 0, kept_at + lo - k.start)?;
            }
            kept_at += k.len();
        }
        Ok(())
    }

    /// Stage 2: finishes the units that can be finished now, oldest first: those already
    /// complete, and cross-worker ones beyond [`STAGE2_IN_FLIGHT`] (every replica and worker
    /// finishes the same units at the same point of its pass).
    fn finish_early(&mut self) -> Result<()> {
        if self.shards.is_none() {
            return Ok(());
        }
        while let Some((_, l)) = self.pending.front() {
            if !matches!(l.started, crate::cross_device::Started::Done) && self.pending.len() <= STAGE2_IN_FLIGHT {
                break;
            }
            self.finish_next()?;
        }
        Ok(())
    }

    /// Starts every unit whose gradients are final, in the plan's order (on every replica
    /// alike); a failure is kept for the step to return and ends the pass.
    fn launch_ready(&mut self) -> candle_core::Result<()> {
        while self.next_ready() {
            if let Err(e) = self.launch().and_then(|()| self.finish_early()) {
                let message = e.to_string();
                self.failed = Some(e);
                return Err(candle_core::Error::Msg(message));
            }
        }
        Ok(())
    }
}

impl candle_core::backprop::GradHook for OverlapStep<'_, '_> {
    fn on_final(&mut self, var: &Tensor, grad: &Tensor) -> candle_core::Result<()> {
        let Some(&i) = self.plan.index.get(&var.id()) else { return Ok(()) };
        if let Some(b) = self.plan.bucket_of[i] {
            self.local[i] = Some(grad.clone());
            self.left[b] -= 1;
        } else if self.plan.rows_of[i].is_some() {
            self.local[i] = Some(grad.clone());
        } else {
            return Ok(());
        }
        if !std::mem::replace(&mut self.had[i], true) {
            self.seen.push(i);
        }
        self.launch_ready()
    }

    fn takes(&mut self, var: &Tensor) -> bool {
        self.shards.is_some()
            && self
                .plan
                .index
                .get(&var.id())
                .is_some_and(|&i| self.plan.bucket_of[i].is_some() || self.plan.rows_of[i].is_some())
    }

    fn joins_rows(&mut self, _var: &Tensor) -> bool {
        self.shards.is_none()
    }

    fn rows_per_block(&mut self, var: &Tensor) -> Option<usize> {
        self.plan.index.get(&var.id()).and_then(|&i| self.plan.rows_of[i])
    }

    fn on_rows(&mut self, var: &Tensor, first: usize, block: &Tensor) -> candle_core::Result<()> {
        let Some(&i) = self.plan.index.get(&var.id()) else { return Ok(()) };
        let Some(n) = self.plan.rows_of[i] else { return Ok(()) };
        if first != self.blocks[i].len() * n || block.dim(0)? != n.min(var.dim(0)? - first) {
            return Ok(());
        }
        self.blocks[i].push(Some(block.clone()));
        if !std::mem::replace(&mut self.had[i], true) {
            self.seen.push(i);
        }
        self.launch_ready()
    }
}

/// How a replica applies its gradients through a [`DistributedOptimizer`] (next to the
/// optimizer, whose copies and policy it uses; the reduction itself is
/// [`ReplicaContext::reduce_gradients`]).
impl ReplicaContext<'_> {
    /// Computes the gradients of `loss` and synchronises and applies them the strategy's way:
    /// mirrored variables all-reduce and every replica applies the same update to its copy;
    /// central variables reduce to the parameter device, which applies the update once. Only
    /// the optimizer's (trainable) variables that some replica, on some worker, computed a
    /// gradient for are reduced and stepped (see [`ReplicaContext::reduce_gradients`]).
    ///
    /// With [`StrategyOptions::overlap`](crate::StrategyOptions::overlap) (the default), the
    /// reduction overlaps the backward pass: the first step learns the order in which the
    /// gradients become ready, and every later step reduces each bucket of that order as soon
    /// as its last gradient is final, while the pass computes the rest. The result is the
    /// same, bit for bit where each element's sum keeps its order. Steps with accumulation
    /// and steps with nothing to reduce (one replica, no workers) take no plan.
    ///
    /// With loss scaling ([`DistributedOptimizer::with_loss_scale`]) the pass differentiates
    /// the loss times the current scale.
    pub fn backward_and_sync<O: Optimizer>(&self, loss: &Tensor, opt: &DistributedOptimizer<O>) -> Result<()> {
        // Loss scaling (fp16): the pass differentiates the scaled loss; the step unscales.
        let scaled = opt.scale_loss(self, loss)?;
        let loss = &scaled;
        if opt.sums_in_step(self) && opt.accumulation == 1 {
            // Nothing to overlap: the step itself sums the replicas' gradients.
            return self.backward_summed(loss, opt, opt.copy_of(self.replica));
        }
        let reduces = self.shared.group.num_replicas() > 1 || self.shared.ext.step_workers().is_some();
        if !reduces || opt.accumulation > 1 || !self.shared.ext.options().overlap {
            let grads = self.backward_phase(|| loss.backward())?;
            return self.sync_and_apply_counted(grads, opt, Some(loss));
        }
        opt.check_strategy(self)?;
        let generation = self.shared.ext.step_workers().map_or(0, |w| w.generation());
        let plan = lock(&opt.overlap[self.replica]).as_ref().filter(|(g, _)| *g == generation).map(|(_, p)| p.clone());
        if let Some(plan) = plan {
            return self.backward_overlapped(loss, opt, &plan).map(drop);
        }
        let vars = opt.vars(opt.copy_of(self.replica));
        let index: HashMap<candle_core::TensorId, usize> = vars.iter().enumerate().map(|(i, v)| (v.id(), i)).collect();
        if let Some(shards) = opt.zero().filter(|s| s.on_segments()) {
            // ZeRO across workers: the plan the shards were laid out on, from the first step on
            // (every worker has it; nothing to agree).
            let plan = Arc::new(fixed_plan(self.shared.ext, vars, index, shards.stage().shards_gradients()));
            *lock(&opt.overlap[self.replica]) = Some((generation, plan.clone()));
            return self.backward_overlapped(loss, opt, &plan).map(drop);
        }
        // No plan yet: reduce after the pass, and learn the order gradients become ready in.
        if opt.shards_gradients() && self.shared.ext.step_workers().is_none() {
            // ZeRO stage 2 on one machine holds no whole gradient of a large matrix even in its
            // first step: that step follows a provisional plan, the variables in the reverse
            // of their order (the order a backward pass mostly makes them final in), and the
            // plan is then learned from the order they came in. Across workers the first step
            // reduces after the pass, as stage 0 does, so that the sums keep stage 0's order.
            let provisional = self.agree_overlap_plan((0..vars.len()).rev().collect(), vars, index.clone(), true)?;
            let seen = self.backward_overlapped(loss, opt, &provisional)?;
            let plan = self.agree_overlap_plan(seen, vars, index, true)?;
            *lock(&opt.overlap[self.replica]) = Some((generation, Arc::new(plan)));
            return Ok(());
        }
        let mut ready = Vec::new();
        let grads = self.backward_phase(|| {
            loss.backward_with_hook(&mut |var, _| {
                ready.extend(index.get(&var.id()).copied());
                Ok(())
            })
        })?;
        let plan = self.agree_overlap_plan(ready, vars, index, opt.shards_gradients())?;
        *lock(&opt.overlap[self.replica]) = Some((generation, Arc::new(plan)));
        self.sync_and_apply_counted(grads, opt, Some(loss))
    }

    /// Stage 1 on one machine with the reduction made in the step (see
    /// [`DistributedOptimizer::sums_in_step`]): the backward pass, then every replica's
    /// gradients handed round (handles, no copy), and each replica steps its shard reading
    /// them in place.
    fn backward_summed<O: Optimizer>(&self, loss: &Tensor, opt: &DistributedOptimizer<O>, copy: usize) -> Result<()> {
        let vars = opt.vars(copy);
        let grads = self.backward_phase(|| loss.backward())?;
        let local = vars
            .iter()
            .map(|v| grads.get(v).map(|g| if g.is_contiguous() { Ok(g.clone()) } else { g.contiguous() }).transpose())
            .collect::<candle_core::Result<Vec<_>>>()?;
        drop(grads);
        opt.record_footprint(self.shared.ext, (self.replica, copy), Some(loss), local.iter().flatten())?;
        self.step_summed(opt, copy, local, self.batch_weight())
    }

    /// Hands this replica's gradients `local` (by variable of copy `copy`) and `weight` round,
    /// and steps its shard with every replica's (see [`DistributedOptimizer::apply_summed`]).
    fn step_summed<O: Optimizer>(
        &self,
        opt: &DistributedOptimizer<O>,
        copy: usize,
        local: Vec<Option<Tensor>>,
        weight: f32,
    ) -> Result<()> {
        let key = self.next_key("sum_in_step".into(), vec![local.len()]);
        let all = {
            let _p = self.phase("reduce", "gradients handed round");
            self.shared.group.exchange(self.replica, &key, (local, weight))?
        };
        let _p = self.phase("step", "optimizer");
        opt.apply_summed(self, copy, &all)?;
        // The step's gather was a collective after every replica read the gradients: the
        // group's handles to this replica's go now, not when the slot is next used.
        self.shared.group.release(self.replica, key.seq);
        Ok(())
    }

    /// Runs `pass` (this replica's backward pass) inside its timeline phase and trace span.
    fn backward_phase<T>(&self, pass: impl FnOnce() -> T) -> T {
        let _p = self.phase("step", "backward");
        let _s = tracing::trace_span!("backward", replica = self.replica).entered();
        pass()
    }

    /// The plan every replica and worker follows: replica 0's order of worker 0, in buckets
    /// of the strategy's size. Collective.
    fn agree_overlap_plan(
        &self,
        ready: Vec<usize>,
        vars: &[Var],
        index: HashMap<candle_core::TensorId, usize>,
        shards_gradients: bool,
    ) -> Result<OverlapPlan> {
        let order: Arc<Vec<usize>> = self.share_from_first("overlap order", Ok(Arc::new(ready)))?;
        let order: Vec<usize> = match self.shared.ext.step_workers() {
            None => order.to_vec(),
            Some(w) => {
                let across = if self.replica == 0 {
                    let mut len = [order.len() as u64];
                    let mut words: Vec<u64> = order.iter().map(|&i| i as u64).collect();
                    w.broadcast_u64s(0, &mut len)
                        .and_then(|()| {
                            words.resize(len[0] as usize, 0);
                            w.broadcast_u64s(0, &mut words)
                        })
                        .map(|()| Arc::new(words))
                        .map_err(|e| e.to_string())
                } else {
                    Ok(Arc::new(Vec::new()))
                };
                let words = self.share_from_first("overlap order(workers)", across)?;
                words.iter().map(|&i| i as usize).collect()
            }
        };
        if let Some(&bad) = order.iter().find(|&&i| i >= vars.len()) {
            return Err(Error::Scope(format!(
                "the overlap plan names variable {bad}, but this replica's optimizer has {}; every replica must build the same model",
                vars.len()
            )));
        }
        Ok(cut_plan(self.shared.ext, order, vars, index, shards_gradients))
    }

    /// A step that reduces each bucket of `plan` as soon as its gradients are final, and each
    /// block of rows of a weight split in rows as soon as it is computed. Returns the order
    /// this replica's gradients came in (a variable split in rows at its first block).
    fn backward_overlapped<O: Optimizer>(
        &self,
        loss: &Tensor,
        opt: &DistributedOptimizer<O>,
        plan: &OverlapPlan,
    ) -> Result<Vec<usize>> {
        let copy = opt.copy_of(self.replica);
        let vars = opt.vars(copy);
        let dest = match opt.policy() {
            VariablePolicy::Mirrored => Destination::AllReplicas,
            VariablePolicy::Central { parameter_replica } => Destination::Replica(parameter_replica),
        };
        let weight = self.batch_weight();
        let zero = opt.zero();
        let shards = zero.as_deref().filter(|s| s.stage().shards_gradients()).map(|s| (s, copy));
        let mut step = OverlapStep {
            ctx: self,
            plan,
            vars,
            dest,
            weight,
            local: vec![None; vars.len()],
            blocks: vec![Vec::new(); vars.len()],
            left: plan.buckets.iter().map(|b| b.tensors.len()).collect(),
            launched: 0,
            pending: Default::default(),
            failed: None,
            unwritten: Ok(()),
            keep: zero.as_deref().map(|s| s.keep(copy)),
            shards,
            kept: vec![None; vars.len()],
            had: vec![false; vars.len()],
            seen: Vec::new(),
            scatter: zero.as_ref().is_some_and(|s| s.on_segments()),
        };
        let grads = self.backward_phase(|| loss.backward_with_hooks(&mut step));
        let grads = match (grads, step.failed.take()) {
            (_, Some(e)) => return Err(e),
            (grads, None) => grads?,
        };
        let from_pass = step.blocks.iter().map(Vec::len).sum();
        if let Some(n) = opt.pass_blocks.get(self.replica) {
            n.store(from_pass, std::sync::atomic::Ordering::Relaxed);
        }
        // What the replica holds at the end of its pass: the activations, the gradients the
        // store keeps and those the reduction holds (whole, or this replica's runs).
        let held = vars
            .iter()
            .filter_map(|v| grads.get(v))
            .chain(step.local.iter().flatten())
            .chain(step.kept.iter().flatten());
        opt.record_footprint(self.shared.ext, (self.replica, copy), Some(loss), held)?;
        while step.launched < plan.units.len() {
            step.launch()?;
            step.finish_early()?;
        }
        while !step.pending.is_empty() {
            step.finish_next()?;
        }
        let OverlapStep { mut local, mut kept, had, unwritten, seen, .. } = step;
        // Which variables some replica, on some worker, has a gradient for.
        let mine: Vec<bool> = vars.iter().zip(&had).map(|(v, &had)| had || grads.get(v).is_some()).collect();
        let present = self.any_replica(&mine)?;
        unwritten?;
        let mut out: Vec<Option<Tensor>> = vec![None; vars.len()];
        for &i in &plan.order {
            if present[i] {
                // Stage 2 keeps only this replica's run of each reduced gradient.
                out[i] = if shards.is_some() { kept[i].take() } else { local[i].take() };
            }
        }
        drop((local, kept));
        // Variables with a gradient the plan does not have: reduced now. The plan no longer
        // fits (it has variables none has a gradient for, or lacks some), so the next step
        // learns it again; `present` is agreed, so every replica decides alike.
        let extra: Vec<usize> = (0..vars.len())
            .filter(|&i| present[i] && plan.bucket_of[i].is_none() && plan.rows_of[i].is_none())
            .collect();
        let fixed = zero.as_ref().is_some_and(|s| s.on_segments());
        if !fixed && (!extra.is_empty() || plan.order.iter().any(|&i| !present[i])) {
            *lock(&opt.overlap[self.replica]) = None;
        }
        if !extra.is_empty() {
            let tensors = extra
                .iter()
                .map(|&i| match grads.get(&vars[i]) {
                    Some(g) => Ok(g.contiguous()?),
                    None => Ok(vars[i].zeros_like()?),
                })
                .collect::<Result<Vec<Tensor>>>()?;
            let ids: Vec<candle_core::TensorId> = extra.iter().map(|&i| vars[i].id()).collect();
            let keep: Option<Vec<std::ops::Range<usize>>> =
                zero.as_deref().map(|s| extra.iter().map(|&i| s.keep(copy)[i].clone()).collect());
            self.reduce_in_buckets(&tensors, &ids, dest, weight, keep.as_deref(), None)?;
            for (i, t) in extra.into_iter().zip(tensors) {
                out[i] = Some(t);
            }
        }
        // Nothing but `out` holds a gradient now: at stage 2 the optimizer's step releases the
        // whole ones it still has.
        drop(grads);
        if dest.receives(self.replica) {
            let _p = self.phase("step", "optimizer");
            opt.apply(self, copy, out)?;
        }
        if matches!(dest, Destination::Replica(_)) {
            // Replicas read the central variables only after the update is applied.
            self.barrier()?;
        }
        Ok(seen)
    }

    /// Synchronises already computed gradients and applies them (see
    /// [`ReplicaContext::backward_and_sync`]).
    pub fn sync_and_apply<O: Optimizer>(&self, grads: GradStore, opt: &DistributedOptimizer<O>) -> Result<()> {
        self.sync_and_apply_counted(grads, opt, None)
    }

    /// [`Self::sync_and_apply`], counting what the replica holds first (with what `loss`
    /// keeps for the backward pass, where the loss is known).
    fn sync_and_apply_counted<O: Optimizer>(
        &self,
        grads: GradStore,
        opt: &DistributedOptimizer<O>,
        loss: Option<&Tensor>,
    ) -> Result<()> {
        opt.check_strategy(self)?;
        let n = self.shared.group.num_replicas();
        let policy = opt.policy();
        let copy = match policy {
            VariablePolicy::Mirrored => self.replica,
            VariablePolicy::Central { .. } => 0,
        };
        let vars = opt.vars(copy);
        opt.record_footprint(self.shared.ext, (self.replica, copy), loss, vars.iter().filter_map(|v| grads.get(v)))?;
        let mut local: Vec<Option<Tensor>> = vars.iter().map(|v| grads.get(v).cloned()).collect();
        drop(grads);
        let mut weight = self.batch_weight();
        if opt.accumulation > 1 {
            // Sum this replica's gradient times its examples; reduce at the last micro-batch.
            let mut acc = lock(&opt.accumulated[self.replica]);
            let global = self.batch_global_len();
            let examples = (self.batch_weight() as f64 * global as f64).round();
            acc.grads.resize(vars.len(), None);
            for (sum, g) in acc.grads.iter_mut().zip(&local) {
                if let Some(g) = g {
                    let g = (g * examples)?;
                    *sum = Some(match sum.take() {
                        Some(s) => (s + g)?,
                        None => g,
                    });
                }
            }
            acc.micro_batches += 1;
            acc.examples += global;
            if acc.micro_batches < opt.accumulation {
                return Ok(());
            }
            let done = std::mem::take(&mut *acc);
            local = done.grads;
            weight = 1.0 / done.examples.max(1) as f32;
        }
        if opt.sums_in_step(self) {
            return self.step_summed(opt, copy, local, weight);
        }
        if n == 1 && self.shared.ext.step_workers().is_none() {
            let _p = self.phase("step", "optimizer");
            if opt.accumulation > 1 {
                local = local
                    .into_iter()
                    .map(|g| g.map(|g| g * weight as f64).transpose())
                    .collect::<candle_core::Result<_>>()?;
            }
            return opt.apply(self, copy, local);
        }
        let dest = match policy {
            VariablePolicy::Mirrored => Destination::AllReplicas,
            VariablePolicy::Central { parameter_replica } => Destination::Replica(parameter_replica),
        };
        // Stage 2 on one machine, with ops that reduce element by element: no reduction larger
        // than a block of rows, so the ops' buffers stay that small.
        let zero = opt.zero();
        let max_run = (zero.as_ref().is_some_and(|s| s.stage().shards_gradients())
            && self.shared.ext.step_workers().is_none()
            && self.shared.ext.cross_device_ops().takes_row_blocks())
        .then_some(self.shared.ext.options().row_block_bytes / std::mem::size_of::<f32>())
        .filter(|&n| n > 0);
        let keep = zero.as_deref().map(|s| s.keep(copy));
        if let Some(reduced) = self.reduce_present(local, vars, dest, weight, keep, max_run)? {
            let _p = self.phase("step", "optimizer");
            opt.apply(self, copy, reduced)?;
        }
        if matches!(policy, VariablePolicy::Central { .. }) {
            // Replicas read the central variables only after the update is applied.
            self.barrier()?;
        }
        Ok(())
    }
}

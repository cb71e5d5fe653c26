//! The distributed optimizer: one optimizer per model copy ([`DistributedOptimizer`]), built
//! from a model's trainable variables ([`Replicated::optimizer`]), and what it adds to a step:
//! applying the reduced gradients, clipping by the global norm, a learning-rate schedule,
//! gradient accumulation, its ZeRO shards (built by `zero`, kept here) and each replica's plan of
//! overlapped reduction (learned by `overlap`, kept here).
//!
//! This module must not know how gradients are reduced or overlapped, nor where ZeRO's shards
//! lie: it builds, keeps and applies.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::Optimizer;

use crate::checkpoint::OptimizerState;
use crate::context::ReplicaContext;
use crate::extended::{StrategyExtended, StrategyId, VariablePolicy};
use crate::footprint::Tally;
use crate::local_sgd::OuterSync;
use crate::optim::schedule::LrSchedule;
use crate::optim::OptimizerMemory;
use crate::overlap_plan::{OverlapPlan, Unit};
use crate::precision::{LossScale, LossScaleState};
use crate::variables::{lock, Replicated};
use crate::zero::{
    check_memory_limits, check_step_footprint, check_units, shards_for, two_largest_units, ModelShape, Residency,
    Shards, Stages,
};
use crate::{Error, Footprint, Result, ZeroStage};

impl<M> Replicated<M> {
    /// Builds one optimizer per copy of the [trainable](crate::VariableKind::Trainable) variables
    /// (candle-nn's `SGD`, `AdamW`, Strata's fused optimizers, or any `Optimizer` that
    /// implements [`OptimizerMemory`]): one per replica for mirrored variables, one for central
    /// ones. Frozen variables and state are left out. At ZeRO stages 1 and 2 the optimizer must
    /// implement [`ShardableOptimizer`](crate::optim::ShardableOptimizer): each copy is built
    /// over its replica's shard only.
    pub fn optimizer<O: OptimizerMemory>(&self, config: O::Config) -> Result<DistributedOptimizer<O>>
    where
        O::Config: Clone,
    {
        let n = match self.policy {
            VariablePolicy::Mirrored => self.vars.len(),
            VariablePolicy::Central { .. } => 1,
        };
        let named: Vec<Vec<(String, Var)>> = (0..n).map(|c| self.trainable_variables(c)).collect();
        let names: Vec<String> = named.first().map_or(Vec::new(), |c| c.iter().map(|(n, _)| n.clone()).collect());
        let vars: Vec<Vec<Var>> = named.into_iter().map(|c| c.into_iter().map(|(_, v)| v).collect()).collect();
        if let Some(first) = vars.first() {
            let shapes: Vec<&[usize]> = first.iter().map(|v| v.dims()).collect();
            self.ext.cross_device_ops().check_gradients(&shapes)?;
        }
        let stage = host_stage::<O>(self.ext.options().zero_stage, self.policy, &*self.ext, &vars);
        let shards = match stage {
            ZeroStage::Off => None,
            _ => Some(shards_for::<O>(stage, self.policy, self.strategy_name, &vars, self.ext.clone())?),
        };
        let params: Vec<u64> = (0..n)
            .map(|c| self.vars[c].iter().map(|(_, v)| (v.elem_count() * v.dtype().size_in_bytes()) as u64).sum())
            .collect();
        let per_element = O::state_per_element();
        let custom = &self.ext.options().zero_units;
        if stage.shards_parameters() {
            check_units(&names, custom)?;
        }
        let gathered_elements = vars.first().map_or(0, |v| two_largest_units(&names, v, custom));
        let gathered = vars.first().and_then(|v| v.first()).map_or(0, |v| v.dtype().size_in_bytes()) as u64
            * gathered_elements as u64;
        // Stages 1 and 2 step copies of the shard in an elastic job and off the CPU.
        let piece_copies = self.ext.workers().is_some_and(|w| w.is_elastic())
            || vars.first().and_then(|v| v.first()).is_some_and(|v| !v.device().is_cpu());
        let stages = Stages { gathered, copies: piece_copies };
        let shape = ModelShape { policy: self.policy, stage, per_element, params: &params, vars: &vars, stages };
        check_memory_limits(&*self.ext, &shape)?;
        let copies = vars
            .iter()
            .enumerate()
            .map(|(c, vs)| {
                let stepped = shards.as_ref().map_or_else(|| vs.clone(), |s| s.piece_vars(c));
                O::new(stepped, config.clone()).map(Mutex::new)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut opt = DistributedOptimizer::from_parts(
            self.strategy,
            self.strategy_name,
            self.policy,
            copies,
            vars,
            self.ext.num_replicas(),
        );
        let shards = shards.map(Arc::new);
        if let Some(s) = shards.as_ref().filter(|s| s.stage().shards_parameters()) {
            opt.residency = Some(Residency::new(s.clone(), opt.vars.clone(), &names, custom)?);
            opt.gathered_elements = gathered_elements;
        }
        opt.shards = RwLock::new(shards);
        if let Some(cfg) = self.ext.options().local_sgd.clone() {
            let workers = self.ext.worker_collectives().ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "local SGD meets the workers of a multi-worker job; {} has none: use multi-worker-mirrored",
                    self.strategy_name
                ))
            })?;
            if let Some(first) = opt.vars.first() {
                opt.outer = Some(OuterSync::new(cfg, workers, first)?);
            }
        }
        opt.params_bytes = params;
        opt.summed = Some(<O as OptimizerMemory>::step_summed);
        opt.state_per_element = per_element;
        opt.stages = stages;
        Ok(opt)
    }
}

/// The stage an optimizer `O` over `vars` (every local copy's trainable variables) runs when
/// `asked` is asked for: stage 1 where stage 0 is asked for, the copies are mirrored replicas
/// on one machine's CPU (no workers), `O` steps shards, and the strategy's
/// [`host_shards`](crate::StrategyOptions::host_shards) is on. Each replica then steps its shard of
/// every copy and keeps that shard's state, and the all-gather writes the shards into every
/// copy: the same bits as stage 0, with one pass of the optimizer over the model per machine
/// where stage 0 made one per replica, and a reduction that writes each replica's shard only.
/// The replicas share the machine's memory bandwidth, which the optimizer and the reduction's
/// copies are bound by; with the gradients summed in the step (`DistributedOptimizer::sums_in_step`) the
/// 4.3M MLP under Mirrored(2) ran 1.07x stage 0's rate (2026-12-07). Any other
/// stage, and any other setting, is left as asked; so is a model with fewer trainable elements
/// than replicas (a shard would be empty).
fn host_stage<O: OptimizerMemory>(
    asked: ZeroStage,
    policy: VariablePolicy,
    ext: &dyn crate::extended::StrategyExtended,
    vars: &[Vec<Var>],
) -> ZeroStage {
    let elements: usize = vars.first().map_or(0, |c| c.iter().map(|v| v.elem_count()).sum());
    let on_host = ext.options().host_shards
        && policy == VariablePolicy::Mirrored
        && ext.workers().is_none()
        && vars.len() > 1
        && elements >= vars.len()
        && vars.iter().flatten().all(|v| v.device().is_cpu());
    if asked == ZeroStage::Off && on_host && O::steps_shards() {
        ZeroStage::OptimizerState
    } else {
        asked
    }
}

/// An overlap plan and the generation of the job's membership it was agreed in.
pub(crate) type AgreedPlan = (u64, Arc<OverlapPlan>);

/// One optimizer per model copy: mirrored copies each apply the same all-reduced gradient;
/// a central copy is updated once, on the parameter device.
///
/// What Keras' and PyTorch Lightning's training loops add to an optimizer step, each the same
/// computation one device makes on the global batch:
/// [`with_clip_global_norm`](Self::with_clip_global_norm) (on the reduced gradient, so every
/// replica and worker scales by the same factor), [`with_schedule`](Self::with_schedule) (the
/// learning rate of every step, on every copy) and
/// [`with_accumulation`](Self::with_accumulation) (several micro-batches per optimizer step,
/// equal to one step on their concatenation).
#[derive(Debug)]
pub struct DistributedOptimizer<O> {
    strategy: StrategyId,
    strategy_name: &'static str,
    policy: VariablePolicy,
    copies: Vec<Mutex<O>>,
    vars: Vec<Vec<Var>>,
    /// Optimizer steps each copy applied.
    steps: Vec<AtomicU64>,
    /// How a copy steps with its gradient as the replicas' weighted terms (stage 1 on one
    /// machine, [`ShardableOptimizer::step_summed`](crate::optim::ShardableOptimizer::step_summed)).
    summed: Option<crate::zero::SummedStep<O>>,
    clip_global_norm: Option<f64>,
    schedule: Option<LrSchedule>,
    /// Micro-batches per optimizer step (1: none accumulated).
    pub(crate) accumulation: usize,
    /// Each local replica's accumulated gradients.
    pub(crate) accumulated: Vec<Mutex<Accumulated>>,
    /// Each replica's overlap plan, learned in its first step, with the generation of the
    /// job's membership it was agreed in (an elastic job agrees a new plan in every generation).
    pub(crate) overlap: Vec<Mutex<Option<AgreedPlan>>>,
    /// Each replica's blocks of rows that its last overlapped step's backward pass handed over
    /// as it computed them ([`Self::pass_row_blocks`]).
    pub(crate) pass_blocks: Vec<AtomicUsize>,
    /// ZeRO's shards, when the strategy's [`ZeroStage`] is not `Off`: then each copy's
    /// optimizer is built over its replica's pieces of the variables only. An elastic job lays
    /// them out again when its membership changes ([`Self::reshard`]).
    shards: RwLock<Option<Arc<Shards>>>,
    /// ZeRO stage 3's variables, released between uses and brought back from the shards.
    residency: Option<Arc<Residency>>,
    /// The elements of the two largest units at stage 3 (0 below it).
    gathered_elements: usize,
    /// The bytes of every variable of each copy (trainable or not), for the memory limit's
    /// check at a re-split ([`Self::reshard`]).
    params_bytes: Vec<u64>,
    /// Floats of state the optimizer keeps per element it steps
    /// ([`OptimizerMemory::state_per_element`]), for the same check.
    state_per_element: u64,
    /// What stage 3 holds whole and the highest stage the job can run, for the checks.
    stages: Stages,
    /// Each local replica's peak of the bytes it held at once in a step, counted.
    peaks: Vec<Mutex<Footprint>>,
    /// Dynamic loss scaling (fp16): its settings, and each copy's state (every copy updates
    /// its own from the same reduced gradient, so all agree).
    loss_scale: Option<(LossScale, Vec<Mutex<LossScaleState>>)>,
    /// Local SGD / DiLoCo: the global parameters and the outer optimizer, met with the other
    /// workers between inner steps.
    outer: Option<OuterSync>,
}

/// A replica's gradients summed over the micro-batches of an optimizer step so far.
#[derive(Debug, Default)]
pub(crate) struct Accumulated {
    /// Per variable of the optimizer: the sum of each micro-batch's gradient times its examples
    /// on this replica.
    pub(crate) grads: Vec<Option<Tensor>>,
    /// Micro-batches so far.
    pub(crate) micro_batches: usize,
    /// Examples of the micro-batches' global batches so far.
    pub(crate) examples: usize,
}

impl<O: Optimizer + OptimizerState> DistributedOptimizer<O> {
    /// The optimizer's state as one optimizer over the whole model saves it (copy 0's at
    /// stage 0): under ZeRO every replica's shard of it gathered, so that a checkpoint resumes
    /// at any stage on any number of replicas and workers. Under ZeRO across workers every
    /// worker must call it (an all-gather).
    ///
    /// Under local SGD it is collective too (every worker calls it at the same step): beside
    /// this worker's state, the outer synchronisation's (the global parameters, the outer
    /// optimizer, the schedule's phase) and every worker's own parameters and state, gathered,
    /// so that a checkpoint resumes every worker where it was.
    pub fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut state = self.own_state_tensors()?;
        if let Some(outer) = &self.outer {
            let entries = outer.state_tensors(&self.vars[0], &state)?;
            state.extend(entries);
        }
        Ok(state)
    }

    /// Whether [`Self::state_tensors`] is a collective every worker calls (under ZeRO, or
    /// local SGD, across workers).
    pub fn gathers_state(&self) -> bool {
        self.zero().is_some() || self.outer.is_some()
    }

    /// This worker's state, without local SGD's.
    fn own_state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut state = match self.zero() {
            None => self.lock(0).state_tensors()?,
            Some(shards) => {
                let states = (0..self.copies.len()).map(|c| self.lock(c).state_tensors()).collect::<Result<_>>()?;
                shards.gather_state(states)?
            }
        };
        if let Some(s) = self.loss_scale_state() {
            state.push((crate::precision::STATE_NAME.to_string(), s.to_tensor()?));
        }
        Ok(state)
    }

    /// Loads `state` (as [`Self::state_tensors`] gives it, at any stage) into every copy:
    /// under ZeRO each copy takes its shard of it. Nothing changes where a copy refuses it.
    /// Under local SGD every worker takes its own parameters and state from the checkpoint
    /// (into every copy of its variables, which must then already hold the checkpoint's
    /// other values) and the outer synchronisation's.
    pub fn load_state_tensors(&self, state: &[(String, Tensor)]) -> Result<()> {
        match &self.outer {
            Some(outer) => {
                let own = outer.load_state(state, &self.own_state_tensors()?, &self.vars)?;
                self.load_own_state_tensors(&own)
            }
            None => self.load_own_state_tensors(state),
        }
    }

    /// Local SGD: the inner steps this worker applied so far (a step whose meeting failed was
    /// applied); `None` without local SGD.
    pub fn local_steps(&self) -> Option<u64> {
        self.outer.as_ref().map(OuterSync::steps)
    }

    /// Local SGD in an elastic job whose membership changed (every member calls it, at the
    /// agreed position `step`): where members `joiners` joined under way, member `source`'s
    /// optimizer state is handed to them (`joined`: this worker is one); then the members agree
    /// on the outer state and meet again every exchange the change interrupted. Without local
    /// SGD it does nothing.
    pub fn rejoin_local_steps(&self, source: usize, joiners: bool, joined: bool, step: u64) -> Result<()> {
        let Some(outer) = &self.outer else { return Ok(()) };
        if joiners {
            let own = self.own_state_tensors()?;
            let len: usize = own.iter().map(|(_, t)| t.elem_count()).sum();
            let mut flat = Vec::with_capacity(len);
            if joined {
                flat.resize(len, 0.0);
            } else {
                for (_, t) in &own {
                    flat.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
                }
            }
            outer.workers().broadcast(source, &mut flat)?;
            if joined {
                let mut at = 0;
                let mut loaded = Vec::with_capacity(own.len());
                for (name, t) in &own {
                    let n = t.elem_count();
                    let v = Tensor::from_slice(&flat[at..at + n], t.shape(), t.device())?.to_dtype(t.dtype())?;
                    loaded.push((name.clone(), v));
                    at += n;
                }
                self.load_own_state_tensors(&loaded)?;
            }
        }
        outer.rejoin(&self.vars, joined, step)
    }

    /// [`Self::load_state_tensors`] of this worker's own state (without local SGD's).
    fn load_own_state_tensors(&self, state: &[(String, Tensor)]) -> Result<()> {
        // The loss scale's entry is the distributed optimizer's own: taken here (a job
        // without loss scaling ignores it; one with it and no entry starts afresh).
        let (scale, rest): (Vec<_>, Vec<_>) =
            state.iter().cloned().partition(|(n, _)| n == crate::precision::STATE_NAME);
        let scale = match scale.first() {
            Some((_, t)) => Some(LossScaleState::from_tensor(t).ok_or_else(|| Error::OptimizerSetting {
                setting: "a checkpoint's loss scale",
                value: match t.flatten_all().and_then(|t| t.to_dtype(DType::F64)).and_then(|t| t.to_vec1::<f64>()) {
                    Ok(v) if v.len() <= 8 => format!("{v:?}"),
                    _ => format!("a tensor of shape {:?}", t.dims()),
                },
                expected: "expected [scale >= 1, good steps, skipped steps]; the checkpoint is damaged",
            })?),
            None => None,
        };
        let state = &rest[..];
        let cut: Vec<Vec<(String, Tensor)>> = match self.zero() {
            None => vec![state.to_vec(); self.copies.len()],
            Some(shards) => (0..self.copies.len()).map(|c| shards.cut_state(c, state)).collect::<Result<_>>()?,
        };
        for (c, state) in cut.iter().enumerate() {
            self.lock(c).load_state_tensors(state)?;
        }
        if let Some(r) = &self.residency {
            // The variables took the checkpoint's values before the state (as
            // `elastic::restore_latest` loads them): a peer that asks for them now waits for it.
            r.loaded();
        }
        if let Some((cfg, states)) = &self.loss_scale {
            let loaded = scale.unwrap_or_else(|| cfg.start());
            for st in states {
                *lock(st) = loaded;
            }
        }
        Ok(())
    }

    /// Whether the optimizer keeps state across steps (AdamW's moments, momentum's velocity;
    /// plain SGD keeps none). Local: copy 0's.
    pub fn keeps_state(&self) -> Result<bool> {
        Ok(self.loss_scale.is_some() || !self.lock(0).state_tensors()?.is_empty())
    }

    /// ZeRO in an elastic job, after its membership changed: lays the shards out again over
    /// every replica of the current membership, and gives each copy a new optimizer over its
    /// new shard, of the same settings and with fresh state. Load the whole state
    /// ([`Self::load_state_tensors`]) after it; at stage 3 load the model's variables too
    /// (before the state, as [`crate::elastic`] does), which the new shards take their
    /// values from. Every worker calls it at the same point: at stage 3 across workers it
    /// starts the piece service over the new membership's ring, a collective (nothing
    /// collective runs in it below stage 3). Returns whether there were shards to lay out
    /// (none at stage 0).
    pub fn reshard(&self) -> Result<bool> {
        let Some(old) = self.zero() else { return Ok(false) };
        // Fewer workers mean larger shards: refused, before anything changes, where they no
        // longer fit a replica's memory limit.
        let new = old.reshard(self.policy, self.state_per_element, &self.params_bytes, &self.vars, self.stages)?;
        let renewed = (0..self.copies.len())
            .map(|c| {
                self.lock(c).renew(new.piece_vars(c)).unwrap_or_else(|| {
                    Err(Error::ZeroStage {
                        stage: old.stage().number(),
                        what: format!("the optimizer {}", std::any::type_name::<O>()),
                        fix: "it cannot be made again over a new shard; use strata's FusedAdamW, FusedSgd or FusedMomentum",
                    })
                })
            })
            .collect::<Result<Vec<O>>>()?;
        for (c, o) in renewed.into_iter().enumerate() {
            *self.lock(c) = o;
        }
        let new = Arc::new(new);
        *self.shards.write().unwrap_or_else(PoisonError::into_inner) = Some(new.clone());
        if let Some(r) = &self.residency {
            // Stage 3: the variables come back from the new shards, over the new membership
            // (a collective: the piece service of the new generation).
            r.reshard(new)?;
        }
        Ok(true)
    }
}

impl<O: Optimizer> DistributedOptimizer<O> {
    /// An optimizer of `copies` (one per copy of `vars`, the variables each updates) for a
    /// model of `strategy` whose variables follow `policy`.
    pub(crate) fn from_parts(
        strategy: StrategyId,
        strategy_name: &'static str,
        policy: VariablePolicy,
        copies: Vec<Mutex<O>>,
        vars: Vec<Vec<Var>>,
        replicas: usize,
    ) -> Self {
        Self {
            strategy,
            strategy_name,
            policy,
            steps: copies.iter().map(|_| AtomicU64::new(0)).collect(),
            summed: None,
            copies,
            vars,
            clip_global_norm: None,
            schedule: None,
            accumulation: 1,
            accumulated: (0..replicas.max(1)).map(|_| Mutex::new(Accumulated::default())).collect(),
            overlap: (0..replicas.max(1)).map(|_| Mutex::new(None)).collect(),
            pass_blocks: (0..replicas.max(1)).map(|_| AtomicUsize::new(0)).collect(),
            shards: Default::default(),
            residency: None,
            gathered_elements: 0,
            params_bytes: Vec::new(),
            state_per_element: 0,
            stages: Stages { gathered: 0, copies: false },
            peaks: (0..replicas.max(1)).map(|_| Mutex::new(Footprint::default())).collect(),
            loss_scale: None,
            outer: None,
        }
    }

    /// Dynamic loss scaling (fp16 training, TensorFlow's `LossScaleOptimizer`):
    /// [`ReplicaContext::backward_and_sync`] multiplies the loss by the current scale before
    /// the backward pass, and each step divides the reduced gradient by it before clipping
    /// and the update. A step whose reduced gradient holds an infinity or a NaN anywhere (on
    /// any replica's shard, under ZeRO) is skipped on every replica and worker, and the scale
    /// shrinks; it grows after a run of finite steps ([`LossScale`]). The scale is saved with
    /// the optimizer's state ([`Self::state_tensors`]). A program that computes gradients
    /// itself scales its loss with [`Self::scale_loss`].
    pub fn with_loss_scale(mut self, scale: LossScale) -> Result<Self> {
        scale.check()?;
        let states = self.copies.iter().map(|_| Mutex::new(scale.start())).collect();
        self.loss_scale = Some((scale, states));
        Ok(self)
    }

    /// Where loss scaling stands (copy 0's, which every copy shares); `None` without it.
    pub fn loss_scale_state(&self) -> Option<LossScaleState> {
        self.loss_scale.as_ref().map(|(_, s)| *lock(&s[0]))
    }

    /// `loss` times the current loss scale for `ctx`'s replica (`loss` itself without loss
    /// scaling): what to call `backward` on when a program computes gradients itself and
    /// hands them to [`ReplicaContext::sync_and_apply`].
    pub fn scale_loss(&self, ctx: &ReplicaContext<'_>, loss: &Tensor) -> Result<Tensor> {
        match &self.loss_scale {
            Some((_, states)) => {
                let scale = lock(&states[self.copy_of(ctx.replica_id())]).scale;
                Ok((loss * scale)?)
            }
            None => Ok(loss.clone()),
        }
    }

    /// Scales each step's gradient so that its global norm (over every variable of the
    /// step, computed on the gradient reduced over every replica and worker) is at most
    /// `max_norm`: TensorFlow's `clip_by_global_norm` (a gradient already within the norm is
    /// left as it is), the same factor on every replica, as one device clipping the global
    /// batch's gradient.
    pub fn with_clip_global_norm(mut self, max_norm: f64) -> Result<Self> {
        if !(max_norm.is_finite() && max_norm > 0.0) {
            return Err(Error::OptimizerSetting {
                setting: "a global clipping norm",
                value: max_norm.to_string(),
                expected: "use a finite norm above 0",
            });
        }
        self.clip_global_norm = Some(max_norm);
        Ok(self)
    }

    /// Sets every copy's learning rate to `schedule.at(step)` before each optimizer step
    /// (counting the steps this optimizer applied, from 0).
    pub fn with_schedule(mut self, schedule: LrSchedule) -> Result<Self> {
        schedule.validate()?;
        self.schedule = Some(schedule);
        Ok(self)
    }

    /// Accumulates the gradients of `micro_batches` calls of
    /// [`ReplicaContext::backward_and_sync`] locally (no communication) and reduces and applies
    /// them at the last: one optimizer step equal to one step on the micro-batches'
    /// concatenated global batch (each micro-batch weighted by its examples, uneven ones
    /// included).
    pub fn with_accumulation(mut self, micro_batches: usize) -> Result<Self> {
        if micro_batches == 0 {
            return Err(Error::OptimizerSetting {
                setting: "gradient accumulation",
                value: "0 micro-batches".into(),
                expected: "accumulate over 1 or more",
            });
        }
        self.accumulation = micro_batches;
        Ok(self)
    }

    /// Micro-batches per optimizer step (1 unless [`with_accumulation`](Self::with_accumulation)
    /// said otherwise).
    pub fn accumulation(&self) -> usize {
        self.accumulation
    }

    /// Optimizer steps applied so far (by the first copy).
    pub fn iterations(&self) -> u64 {
        self.steps[0].load(Ordering::Relaxed)
    }

    /// Sets the optimizer steps applied so far on every copy, which a
    /// [schedule](Self::with_schedule) reads: after a restore from a checkpoint of step `n`
    /// (or a worker that joined an elastic job at step `n`), `n` divided by the accumulation.
    pub fn set_iterations(&self, n: u64) {
        for s in &self.steps {
            s.store(n, Ordering::Relaxed);
        }
    }

    /// The number of optimizer copies (one per replica for mirrored variables, one for
    /// central ones).
    pub fn num_copies(&self) -> usize {
        self.copies.len()
    }

    /// Applies `grads` (in the order of copy `copy`'s variables; `None` for a variable that
    /// no replica computed a gradient for, which the optimizer then skips) with copy `copy`.
    /// With ZeRO's shards, the copy steps its replica's shard and every shard is gathered back
    /// (collective over every replica of every worker).
    pub(crate) fn apply(&self, ctx: &ReplicaContext<'_>, copy: usize, grads: Vec<Option<Tensor>>) -> Result<()> {
        self.apply_inner(ctx, copy, grads)?;
        match &self.outer {
            Some(outer) => outer.after_step(ctx, &self.vars[copy], self.steps[copy].load(Ordering::Relaxed)),
            None => Ok(()),
        }
    }

    /// Local SGD / DiLoCo, outside a step (every worker calls it): the exchanges in flight
    /// applied, then every fragment met once more at once, so that every worker holds the
    /// same, global, parameters (the end of a fit; before reading the model). Without local
    /// SGD it does nothing.
    pub fn synchronize_local_steps(&self) -> Result<()> {
        match &self.outer {
            Some(outer) => outer.synchronize(&self.vars),
            None => Ok(()),
        }
    }

    /// Local SGD / DiLoCo: the bytes of outer gradients this worker sent so far, and the
    /// meetings (of a fragment each) completed; `None` without local SGD.
    pub fn outer_traffic(&self) -> Option<(u64, u64)> {
        self.outer.as_ref().map(OuterSync::traffic)
    }

    /// Whether replica `ctx`'s step may sum the replicas' gradients itself
    /// ([`Self::apply_summed`]) instead of reducing them first: ZeRO stage 1 (asked for, or
    /// Mirrored's on one machine's CPU) over mirrored replicas of one machine, and ops that say
    /// their sums are those the step makes (counting the replica's elements as reduced). Every
    /// replica decides alike.
    pub(crate) fn sums_in_step(&self, ctx: &ReplicaContext<'_>) -> bool {
        let ext = ctx.shared.ext;
        let Some(vars) = self.vars.get(self.copy_of(ctx.replica)).filter(|_| ctx.strategy_id() == self.strategy) else {
            return false;
        };
        let elements = vars.iter().map(|v| v.elem_count()).sum();
        self.policy == VariablePolicy::Mirrored
            && ext.step_workers().is_none()
            && ctx.shared.group.num_replicas() > 1
            && self.outer.is_none()
            && self.residency.is_none()
            && self.zero().is_some_and(|s| s.stage() == ZeroStage::OptimizerState)
            && ext.cross_device_ops().sums_in_step(ctx.replica, elements)
    }

    /// Steps copy `copy`'s shard with `all`, every local replica's gradients and weight (see
    /// [`Shards::step_summed`]), and gathers the shards. Collective over the machine's
    /// replicas, and it ends with a collective (the gather, or a barrier where every replica
    /// skips the step), so that no replica's gradients are let go while another reads them;
    /// only where [`Self::sums_in_step`] said so.
    pub(crate) fn apply_summed(
        &self,
        ctx: &ReplicaContext<'_>,
        copy: usize,
        all: &[(Vec<Option<Tensor>>, f32)],
    ) -> Result<()> {
        let Some(shards) = self.zero() else {
            return Err(Error::Scope("a step summed its gradients without ZeRO's shards".into()));
        };
        let step = self.steps[copy].fetch_add(1, Ordering::Relaxed);
        let mut opt = self.lock(copy);
        if let Some(s) = &self.schedule {
            opt.set_learning_rate(s.at(step));
        }
        if self.clip_global_norm.is_none() && self.loss_scale.is_none() {
            return shards.step_summed(ctx, copy, &self.vars[copy], all, self.summed, &mut *opt);
        }
        // Loss scaling and clipping look at the whole gradient first: every replica makes the
        // whole sums (the reduction's), and then unscales, checks and clips them as stage 0
        // does, so the bits are stage 0's, then steps its shard of them.
        let mut grads = (0..self.vars[copy].len())
            .map(|i| {
                let Some(some) = all.iter().find_map(|(g, _)| g[i].as_ref()) else { return Ok(None) };
                let terms = all
                    .iter()
                    .map(|(g, w)| Ok((g[i].clone().map_or_else(|| some.zeros_like(), Ok)?, *w)))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Ok(Some(crate::optim::sum_of(&terms)?))
            })
            .collect::<Result<Vec<Option<Tensor>>>>()?;
        if let Some((_, st)) = &self.loss_scale {
            let k = 1.0 / lock(&st[copy]).scale;
            let finite = crate::precision::all_finite(grads.iter().flatten())?;
            self.update_loss_scale(ctx, copy, finite);
            if !finite {
                // Every replica skips alike; the collective the step would have ended with
                // keeps the gradients handed round alive until all have read them.
                return ctx.barrier();
            }
            grads = grads.into_iter().map(|g| g.map(|g| g * k).transpose()).collect::<candle_core::Result<_>>()?;
        }
        if let Some(k) = self.clip_global_norm.map(|max| clip_scale(&grads, max)).transpose()?.flatten() {
            grads = grads.into_iter().map(|g| g.map(|g| g * k).transpose()).collect::<candle_core::Result<_>>()?;
        }
        shards.step(ctx, copy, &self.vars[copy], grads, None, None, &mut *opt)?;
        Ok(())
    }

    /// [`Self::apply`]'s inner step.
    fn apply_inner(&self, ctx: &ReplicaContext<'_>, copy: usize, grads: Vec<Option<Tensor>>) -> Result<()> {
        let step = self.steps[copy].fetch_add(1, Ordering::Relaxed);
        let mut opt = self.lock(copy);
        if let Some(s) = &self.schedule {
            opt.set_learning_rate(s.at(step));
        }
        let unscale = self.loss_scale.as_ref().map(|(_, st)| 1.0 / lock(&st[copy]).scale);
        if let Some(shards) = self.zero() {
            if let Some(r) = &self.residency {
                // Nothing computed with a stand-in for a parameter a peer could not give.
                r.check_restored()?;
                r.settle(copy)?;
            }
            // Only the shard's runs of `grads` hold the reduced gradient: the clipping norm,
            // and whether the gradient is finite, are summed over every replica's shard.
            let applied = shards.step(ctx, copy, &self.vars[copy], grads, self.clip_global_norm, unscale, &mut *opt)?;
            self.update_loss_scale(ctx, copy, applied);
            if let Some(r) = &self.residency {
                r.stepped(copy)?;
            }
            return Ok(());
        }
        let mut grads = grads;
        if let Some(k) = unscale {
            // Every copy holds the same reduced gradient, so every copy decides alike.
            let finite = crate::precision::all_finite(grads.iter().flatten())?;
            self.update_loss_scale(ctx, copy, finite);
            if !finite {
                return Ok(());
            }
            grads = grads.into_iter().map(|g| g.map(|g| g * k).transpose()).collect::<candle_core::Result<_>>()?;
        }
        let scale = match self.clip_global_norm {
            Some(max) => clip_scale(&grads, max)?,
            None => None,
        };
        let mut store = GradStore::default();
        for (v, g) in self.vars[copy].iter().zip(grads) {
            if let Some(g) = g {
                let g = match scale {
                    Some(k) => (g * k)?,
                    None => g,
                };
                store.insert(v.as_tensor(), g);
            }
        }
        Ok(opt.step(&store)?)
    }

    /// Copy `copy`'s loss scale after a step whose gradient was finite (`applied`) or not;
    /// copy 0 tells the strategy's cross-device ops (whose state across steps, PowerSGD's
    /// error feedback, follows the scale).
    fn update_loss_scale(&self, ctx: &ReplicaContext<'_>, copy: usize, applied: bool) {
        if let Some((cfg, states)) = &self.loss_scale {
            let mut st = lock(&states[copy]);
            let before = st.scale;
            st.update(applied, cfg);
            let factor = st.scale / before;
            drop(st);
            if copy == 0 {
                ctx.shared.ext.cross_device_ops().loss_scale_step(applied, factor);
            }
        }
    }

    /// ZeRO's shards as they are laid out now (`None` at stage 0).
    pub(crate) fn zero(&self) -> Option<Arc<Shards>> {
        self.shards.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Whether each replica keeps the reduced gradient of its shard only (ZeRO stage 2).
    pub(crate) fn shards_gradients(&self) -> bool {
        self.zero().is_some_and(|s| s.stage().shards_gradients())
    }

    /// The variables are about to take a checkpoint's values (then
    /// [`Self::load_state_tensors`]): at ZeRO stage 3 a released variable written now comes
    /// back without its shards being read, from this worker's or any other's (their values are
    /// about to be replaced, and the other workers may have loaded theirs already). Below
    /// stage 3 it does nothing.
    pub fn begin_load(&self) {
        if let Some(r) = &self.residency {
            r.begin_load();
        }
    }

    /// ZeRO stage 3: brings every variable of every copy back whole and keeps it so (FSDP2's
    /// `unshard` without a `reshard` after it). Across workers it is collective: every worker
    /// calls it after its last step, before it reads its model without the others (a
    /// worker's variables are pulled from the others, who must still be there); it ends with a
    /// barrier. `strata::trainer::Trainer::fit` calls it. Below stage 3 it does
    /// nothing.
    pub fn unshard_parameters(&self) -> Result<()> {
        match &self.residency {
            Some(r) => r.unshard(),
            None => Ok(()),
        }
    }

    /// ZeRO stage 3 across workers: how many times a replica brought a variable back from
    /// values pulled ahead of its use (while it computed with the unit before, in the order its
    /// last step used them), and how many times it had to pull at the use; (0, 0) otherwise.
    /// After a first step, a step that uses its units in the order of the one before pulls
    /// nothing at the use.
    pub fn zero_pulls(&self) -> (u64, u64) {
        self.residency.as_ref().map_or((0, 0), |r| r.pulls())
    }

    /// ZeRO stage 3's units of variables, by name, in the order of their first variable
    /// (empty below stage 3): each is gathered whole when a step first uses one of its
    /// variables, and released when the step moves on to another.
    pub fn zero_units(&self) -> Vec<String> {
        self.residency.as_ref().map_or(Vec::new(), |r| r.unit_names().to_vec())
    }

    /// The elements a replica holds whole at ZeRO stage 3 besides its shard, at most: its two
    /// largest units (one in use, the next), by [`unit_name`](crate::unit_name); 0 below stage 3.
    pub fn gathered_elements(&self) -> usize {
        self.gathered_elements
    }

    /// The ZeRO stage this optimizer runs ([`ZeroStage::Off`] unless
    /// the strategy's options asked for one).
    pub fn zero_stage(&self) -> ZeroStage {
        self.zero().map_or(ZeroStage::Off, |s| s.stage())
    }

    /// The elements of the variables copy `copy`'s optimizer steps and keeps state for: its
    /// replica's shard under ZeRO, every trainable element otherwise.
    pub fn stepped_elements(&self, copy: usize) -> usize {
        match self.zero() {
            Some(s) => s.elements(copy),
            None => self.vars[copy].iter().map(|v| v.elem_count()).sum(),
        }
    }

    /// The most bytes local replica `replica` held at once in a step so far, counted at the end
    /// of each step's backward pass ([`Footprint`]: parameters as resident, gradients,
    /// optimizer state, activations); `None` before its first step.
    pub fn peak_footprint(&self, replica: usize) -> Option<Footprint> {
        let peak = *lock(self.peaks.get(replica)?);
        (peak.total() > 0).then_some(peak)
    }

    /// [`Self::peak_footprint`]'s total for every local replica (0 for one that ran no step).
    pub fn peak_replica_bytes(&self) -> Vec<u64> {
        self.peaks.iter().map(|p| lock(p).total()).collect()
    }

    /// Counts what local replica `replica` (stepping copy `copy`) holds now, at the end of its
    /// backward pass: its variables as resident, its shard's own copies, `grads` (and any
    /// accumulated gradient), its optimizer's state, and what `loss` keeps for the backward
    /// pass. Keeps the peak, and fails where the total exceeds the replica's device's
    /// `memory_limit` (naming a stage that would hold it).
    pub(crate) fn record_footprint<'a>(
        &self,
        ext: &dyn StrategyExtended,
        (replica, copy): (usize, usize),
        loss: Option<&Tensor>,
        grads: impl IntoIterator<Item = &'a Tensor>,
    ) -> Result<Footprint> {
        let mut tally = Tally::default();
        let vars = &self.vars[copy];
        let mut parameters = tally.count(vars.iter().map(|v| v.as_tensor()));
        if let Some(s) = self.zero() {
            parameters += tally.count(s.piece_vars(copy).iter().map(|v| v.as_tensor()));
        }
        let mut gradients = tally.count(grads);
        if self.accumulation > 1 {
            if let Some(acc) = self.accumulated.get(replica) {
                gradients += tally.count(lock(acc).grads.iter().flatten());
            }
        }
        let size = vars.first().map_or(4, |v| v.dtype().size_in_bytes()) as u64;
        let optimizer_state = self.state_per_element * self.stepped_elements(copy) as u64 * size;
        let activations = loss.map_or(0, |l| tally.activations(l));
        let held = Footprint { parameters, gradients, optimizer_state, activations };
        let step = self.steps.get(copy).map_or(0, |s| s.load(Ordering::Relaxed)) + 1;
        if let Some(p) = self.peaks.get(replica) {
            let mut p = lock(p);
            if held.total() > p.total() {
                *p = held;
            }
        }
        check_step_footprint(ext, &self.model_shape(), (replica, copy, step), held)?;
        Ok(held)
    }
    /// The replicas' model state as the memory checks count it.
    fn model_shape(&self) -> ModelShape<'_> {
        ModelShape {
            policy: self.policy,
            stage: self.zero_stage(),
            per_element: self.state_per_element,
            params: &self.params_bytes,
            vars: &self.vars,
            stages: self.stages,
        }
    }

    pub(crate) fn check_strategy(&self, ctx: &ReplicaContext<'_>) -> Result<()> {
        if ctx.strategy_id() != self.strategy {
            return Err(Error::Scope(format!(
                "an optimizer over variables of {} {} was used in a step of {} {}; create it from a model built in the scope of the strategy that runs it",
                self.strategy_name,
                self.strategy,
                ctx.strategy().name(),
                ctx.strategy_id()
            )));
        }
        Ok(())
    }

    pub(crate) fn policy(&self) -> VariablePolicy {
        self.policy
    }

    pub(crate) fn vars(&self, copy: usize) -> &[Var] {
        &self.vars[copy]
    }

    /// The copy replica `replica` steps: its own for mirrored variables, the one central copy
    /// otherwise.
    pub(crate) fn copy_of(&self, replica: usize) -> usize {
        match self.policy {
            VariablePolicy::Mirrored => replica,
            VariablePolicy::Central { .. } => 0,
        }
    }

    /// The buckets of the plan by which local replica `replica` reduces while its backward
    /// pass runs (see [`ReplicaContext::backward_and_sync`]), once a step has learned one.
    pub fn overlap_buckets(&self, replica: usize) -> Option<usize> {
        self.overlap.get(replica).and_then(|p| lock(p).as_ref().map(|p| p.1.buckets.len()))
    }

    /// The blocks of rows that plan reduces on their own (see
    /// [`StrategyOptions::row_block_bytes`](crate::StrategyOptions::row_block_bytes)).
    pub fn overlap_row_blocks(&self, replica: usize) -> Option<usize> {
        self.overlap
            .get(replica)
            .and_then(|p| lock(p).as_ref().map(|p| p.1.units.iter().filter(|u| matches!(u, Unit::Rows { .. })).count()))
    }

    /// Of those, the blocks that local replica `replica`'s last overlapped step had from its
    /// backward pass as the pass computed them. The others were cut from a whole gradient: a
    /// weight the pass cannot hand over in rows (one used more than once, or not as a matrix
    /// product's right operand, `x.matmul(&w)` or `x.matmul(&w.t())`, either through one cast
    /// of its type) is reduced only once its whole gradient is final.
    pub fn pass_row_blocks(&self, replica: usize) -> usize {
        self.pass_blocks.get(replica).map_or(0, |n| n.load(Ordering::Relaxed))
    }

    /// Locks copy `copy`'s optimizer (to change its learning rate, say).
    pub fn lock(&self, copy: usize) -> MutexGuard<'_, O> {
        lock(&self.copies[copy])
    }

    /// Sets the learning rate of every copy.
    pub fn set_learning_rate(&self, lr: f64) {
        for c in &self.copies {
            lock(c).set_learning_rate(lr);
        }
    }

    /// The learning rate of the first copy.
    pub fn learning_rate(&self) -> f64 {
        lock(&self.copies[0]).learning_rate()
    }
}

/// The factor that brings `grads`' global norm to at most `max` (`None`: within it already):
/// `max / norm`, the norm summed in f64 over the variables in order.
fn clip_scale(grads: &[Option<Tensor>], max: f64) -> Result<Option<f64>> {
    let mut sq = 0f64;
    for g in grads.iter().flatten() {
        sq += g.to_dtype(DType::F32)?.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    }
    let norm = sq.sqrt();
    Ok((norm > max).then(|| max / norm))
}

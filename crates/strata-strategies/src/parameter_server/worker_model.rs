//! A model on a parameter-server worker, stepped the way every other strategy steps one.
//!
//! [`PsWorkerModel`] builds the model under a local strategy of the worker's replicas (one
//! device, or CentralStorage over several logical CPUs: one copy of the variables, which the
//! pulls fill) and an optimizer, [`PushToPs`], whose step pushes instead of updating. A step
//! registered for the parameter server then reads like a `run_batch` step:
//!
//! ```no_run
//! # use strata_strategies::parameter_server::{PsWorkerModel, StepRegistry, WorkerContext};
//! # use strata_core::data::Batch;
//! # use strata_core::{ReduceOp, Strategy};
//! # fn batch_for(step: u64) -> Batch { Batch::new(vec![step as f32; 32], vec![0; 8], 4).expect("8 rows of 4") }
//! let worker = PsWorkerModel::new(2, Default::default(), |s| candle_nn::linear(4, 2, s.var_builder().pp("fc")))?;
//! let mut registry = StepRegistry::new();
//! registry.register("train", move |w: &WorkerContext, step: u64| {
//!     let out = worker.run_batch(w, &batch_for(step), |ctx, shard| {
//!         let x = shard.batch.features_tensor(ctx.candle_device())?;
//!         let loss = candle_nn::Module::forward(worker.model().on(ctx)?, &x)?.sqr()?.mean_all()?;
//!         worker.backward_and_push(ctx, &loss)?; // one push per ps task, starting during the pass
//!         Ok(loss.to_scalar::<f32>()? * shard.weight())
//!     })?;
//!     worker.strategy().reduce(ReduceOp::Sum, &out.values)
//! });
//! # Ok::<(), strata_core::Error>(())
//! ```
//!
//! `run_batch` pulls the variables into the model (every trainable variable each step; frozen
//! ones once, since nothing changes them), runs the step on the worker's replicas, and
//! `backward_and_sync` reduces their gradients to the parameter replica as CentralStorage does
//! (only the variables some replica computed a gradient for) and pushes those, with the step's
//! exactly-once identity (coordinator run, step, sequence), one push per ps task;
//! [`backward_and_push`](PsWorkerModel::backward_and_push) does the same, and where it can (one
//! replica, no clipping, overlap on) starts each task's push while the backward pass runs and
//! sends each bucket of gradients as soon as it is final, the push applied whole after the
//! pass ([`OverlappedPush`]). A ps task
//! none of whose variables has a gradient gets an empty push, which counts the update without
//! changing anything: frozen variables and parameters unused in a step are neither pushed nor
//! updated, as on one device.
//!
//! **State** (BatchNorm's running statistics) lives on the ps tasks too, marked as state: each
//! step pulls it, the replicas' forward passes update their copies, and the push carries the
//! change (averaged over the worker's replicas), which the ps task adds instead of applying
//! its optimizer (TensorFlow's workers assign moving averages on the ps tasks the same way).
//! With one worker the ps tasks then hold what the worker's replicas computed, one device's
//! statistics for a worker of one replica; with several, every worker's batches move them, in
//! the order the pushes arrive (async) or by the round's mean change (sync). The coordinator's
//! pulls read them, so its evaluation uses the trained statistics.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use candle_core::{DType, Tensor, Var};
use candle_nn::Optimizer;
use strata_core::data::{BatchData, DistributedBatch, Shard};
use strata_core::{
    DistributedOptimizer, Error, PerReplica, ReplicaContext, Replicated, Result, Scope, Strategy, StrategyHandle,
    StrategyOptions, VariableKind,
};

use super::tables::PsTables;
use super::worker::{OverlappedPush, PullTicket, PushSummary, WorkerContext};
use crate::{CentralStorageStrategy, CpuReduction, OneDeviceStrategy};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The default size of the buckets in which gradients enter an overlapped push
/// ([`PsWorkerModel::backward_and_push`]): 1 MiB. A bucket costs no call of its own (it joins
/// the step's open push to its ps task), so buckets are small, and a bucket's push starts soon
/// after its gradients are final.
pub const DEFAULT_PUSH_BUCKET_BYTES: usize = 1 << 20;

/// Where [`PushToPs`] finds the step it pushes for, and leaves what happened.
#[derive(Default)]
pub struct PushSlot {
    target: Mutex<Option<(WorkerContext, PullTicket)>>,
    outcome: Mutex<Option<Result<PushSummary>>>,
    /// The state's values as pulled (the push carries the change from them).
    state_base: Mutex<Vec<Vec<f32>>>,
    /// The optimizer's variables, in the order it pushes their gradients.
    trainable: Mutex<Vec<(String, Var)>>,
    /// The step's push, started while its backward pass ran
    /// ([`PsWorkerModel::backward_and_push`]): the optimizer's step commits it.
    overlapped: Mutex<Option<OverlappedPush>>,
    /// Steps whose push started while the pass ran and was committed.
    committed: AtomicU64,
    /// Steps whose early push was given up (and pushed after the pass).
    given_up: AtomicU64,
    /// The model's embedding tables on the ps tasks: their rows go with the step's push.
    tables: Arc<PsTables>,
}

impl std::fmt::Debug for PushSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushSlot").field("armed", &lock(&self.target).is_some()).finish()
    }
}

/// The configuration of [`PushToPs`]: the model's variables by name, and the slot a
/// [`PsWorkerModel`] arms for each step.
#[derive(Clone, Debug)]
pub struct PushConfig {
    names: Arc<Vec<(String, Var)>>,
    /// The model's state, by name, with every copy's variable.
    state: Arc<Vec<(String, Vec<Var>)>>,
    slot: Arc<PushSlot>,
}

/// The optimizer of a parameter-server worker: its step pushes the (reduced) gradients of the
/// variables that have one to the ps tasks, whose own optimizer applies them. Made by
/// [`PsWorkerModel`]; stepping it outside [`PsWorkerModel::run_batch`] is an error.
#[derive(Debug)]
pub struct PushToPs {
    vars: Vec<(String, Var)>,
    state: Arc<Vec<(String, Vec<Var>)>>,
    slot: Arc<PushSlot>,
}

/// The worker keeps no optimizer state (the ps tasks do), and the parameter-server strategy has
/// no ZeRO stage to step shards at.
impl strata_core::optim::OptimizerMemory for PushToPs {}

impl Optimizer for PushToPs {
    type Config = PushConfig;

    fn new(vars: Vec<Var>, config: PushConfig) -> candle_core::Result<Self> {
        let vars = vars
            .into_iter()
            .map(|v| {
                let name = config.names.iter().find(|(_, w)| w.as_tensor().id() == v.as_tensor().id());
                match name {
                    Some((n, _)) => Ok((n.clone(), v)),
                    None => candle_core::bail!(
                        "a variable of shape {:?} is not the model's; push the model's own variables",
                        v.dims()
                    ),
                }
            })
            .collect::<candle_core::Result<Vec<(String, Var)>>>()?;
        *lock(&config.slot.trainable) = vars.clone();
        Ok(Self { vars, state: config.state, slot: config.slot })
    }

    /// The ps tasks' optimizer has the learning rate; this one reports 0.
    fn learning_rate(&self) -> f64 {
        0.0
    }

    /// The ps tasks' optimizer has the learning rate; setting it here changes nothing.
    fn set_learning_rate(&mut self, _lr: f64) {}

    fn step(&mut self, grads: &candle_core::backprop::GradStore) -> candle_core::Result<()> {
        let Some((ctx, ticket)) = lock(&self.slot.target).clone() else {
            candle_core::bail!(
                "a parameter-server worker's optimizer was stepped outside PsWorkerModel::run_batch; step inside it"
            )
        };
        let overlapped = lock(&self.slot.overlapped).take();
        let outcome = match overlapped {
            Some(push) => {
                let with: Vec<&str> =
                    self.vars.iter().filter(|(_, v)| grads.get(v).is_some()).map(|(n, _)| n.as_str()).collect();
                if push.matches(&with) {
                    // Every gradient is on its way already: the state's changes, and the end.
                    self.slot.committed.fetch_add(1, Ordering::Relaxed);
                    push.commit(self.state_changes()?)
                } else {
                    self.slot.given_up.fetch_add(1, Ordering::Relaxed);
                    // Other variables have gradients than the push expected: it is given up
                    // (nothing of it applied) and the step pushed after the pass, as the same update.
                    let id = push.id().clone();
                    push.abandon();
                    let pushed = self.pushed(grads)?;
                    ctx.push_as(&id, &ticket, &pushed)
                }
            }
            None => {
                let pushed = self.pushed(grads)?;
                // The rows of embedding tables the step looked up, in the same update.
                let rows = self.slot.tables.take_rows();
                if rows.iter().any(|(r, _)| !r.is_empty()) {
                    ctx.push_with_rows(&ticket, &pushed, &rows)
                } else {
                    ctx.push(&ticket, &pushed)
                }
            }
        };
        let failed = outcome.as_ref().err().map(ToString::to_string);
        *lock(&self.slot.outcome) = Some(outcome);
        match failed {
            Some(m) => candle_core::bail!("{m}"),
            None => Ok(()),
        }
    }
}

impl PushToPs {
    /// The gradients of the variables that have one (in the optimizer's order), then the
    /// state's changes: what a step pushes.
    fn pushed(&self, grads: &candle_core::backprop::GradStore) -> candle_core::Result<Vec<(String, Vec<f32>)>> {
        let mut pushed = Vec::with_capacity(self.vars.len());
        for (name, v) in &self.vars {
            if let Some(g) = grads.get(v) {
                pushed.push((name.clone(), g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?));
            }
        }
        pushed.extend(self.state_changes()?);
        Ok(pushed)
    }

    /// The change the replicas' forward passes made to each state variable, averaged over the
    /// replicas.
    fn state_changes(&self) -> candle_core::Result<Vec<(String, Vec<f32>)>> {
        let base = lock(&self.slot.state_base).clone();
        let mut changes = Vec::with_capacity(self.state.len());
        for ((name, copies), base) in self.state.iter().zip(base) {
            let mut mean = vec![0f32; base.len()];
            for v in copies {
                let now = v.as_tensor().to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                mean.iter_mut().zip(now).for_each(|(m, x)| *m += x);
            }
            let k = copies.len().max(1) as f32;
            changes.push((name.clone(), mean.iter().zip(&base).map(|(m, b)| m / k - b).collect()));
        }
        Ok(changes)
    }
}

/// What [`PsWorkerModel::run_batch`] did.
#[derive(Debug)]
pub struct PsStep<T> {
    /// Every replica's value of the step function.
    pub values: PerReplica<T>,
    /// The versions the step's values were pulled at.
    pub pull: PullTicket,
    /// What the ps tasks did with the push (`None` if the step did not step the optimizer).
    pub push: Option<PushSummary>,
}

/// A model on a parameter-server worker, over the worker's replicas (see the
/// [module docs](self)).
pub struct PsWorkerModel<M> {
    strategy: StrategyHandle,
    model: Replicated<M>,
    optimizer: DistributedOptimizer<PushToPs>,
    slot: Arc<PushSlot>,
    /// Whether the frozen variables were pulled (once per worker process).
    frozen_pulled: AtomicBool,
    /// The global norm each pushed gradient is clipped to, if any.
    clip_global_norm: Option<f64>,
    /// Whether pushes start while the backward pass runs ([`StrategyOptions::overlap`]).
    overlap: bool,
    /// The size of the buckets in which gradients enter an overlapped push.
    push_bucket_bytes: usize,
    /// The order the last step's gradients became final in (the next overlapped push
    /// expects it).
    ready: Mutex<Option<Vec<String>>>,
    /// Whether a step's gradients are computed at values extrapolated to where its push will
    /// land ([`set_lookahead`](Self::set_lookahead)).
    lookahead: bool,
    /// What the look-ahead extrapolates from.
    ahead: Mutex<Ahead>,
}

/// The look-ahead's memory: the last pull and how stale this worker's pushes land.
#[derive(Debug, Default)]
struct Ahead {
    /// The ps tasks' versions at the last pull and the trainable variables' values then.
    last: Option<(Vec<u64>, Vec<Tensor>)>,
    /// The updates other workers applied between this worker's pulls and its pushes: an
    /// exponential average over its pushes (`None` before the first).
    staleness: Option<f64>,
}

/// The weight of the newest push in [`Ahead::staleness`].
const STALENESS_WEIGHT: f64 = 0.1;

impl<M> std::fmt::Debug for PsWorkerModel<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PsWorkerModel")
            .field("replicas", &self.strategy.num_replicas_in_sync())
            .field("variables", &self.model.variables(0).len())
            .finish()
    }
}

impl<M> PsWorkerModel<M> {
    /// Builds the model over `replicas` logical CPUs of this worker (one device for 1,
    /// CentralStorage for more) with `options` (the seed: the ps tasks' values replace the
    /// initial ones at the first pull).
    pub fn new(
        replicas: usize,
        options: StrategyOptions,
        build: impl FnMut(&Scope) -> candle_core::Result<M>,
    ) -> Result<Self> {
        strata_core::check_zero_strategy(options.zero_stage, "parameter-server")?;
        strata_core::local_sgd::check_local_sgd_strategy(options.local_sgd.as_ref(), "parameter-server")?;
        let devices = strata_core::device::logical_cpus(replicas)?;
        let overlap = options.overlap;
        // Embedding tables live on the ps tasks: the model's lookups pull their rows.
        let slot = Arc::new(PushSlot::default());
        let options = StrategyOptions { tables: Some(slot.tables.clone()), ..options };
        let strategy = match devices.len() {
            0 => return Err(Error::ZeroReplicas),
            1 => OneDeviceStrategy::with_options(devices[0].clone(), options)?.handle(),
            _ => CentralStorageStrategy::with_options(devices, CpuReduction::default(), options)?.handle(),
        };
        let model = strategy.scope(build)?;
        let optimizer = Self::push_optimizer(&model, &slot, None)?;
        Ok(Self {
            strategy,
            model,
            optimizer,
            slot,
            frozen_pulled: AtomicBool::new(false),
            clip_global_norm: None,
            overlap,
            push_bucket_bytes: DEFAULT_PUSH_BUCKET_BYTES,
            ready: Mutex::new(None),
            lookahead: true,
            ahead: Mutex::new(Ahead::default()),
        })
    }

    fn push_optimizer(
        model: &Replicated<M>,
        slot: &Arc<PushSlot>,
        clip: Option<f64>,
    ) -> Result<DistributedOptimizer<PushToPs>> {
        let state = (0..model.kinds().len())
            .filter(|&i| model.kinds()[i] == VariableKind::State)
            .map(|i| {
                let copies = (0..model.num_copies()).map(|c| model.variables(c)[i].1.clone()).collect();
                (model.variables(0)[i].0.clone(), copies)
            })
            .collect();
        let config =
            PushConfig { names: Arc::new(model.variables(0).to_vec()), state: Arc::new(state), slot: slot.clone() };
        let optimizer = model.optimizer::<PushToPs>(config)?;
        Ok(match clip {
            Some(norm) => optimizer.with_clip_global_norm(norm)?,
            None => optimizer,
        })
    }

    /// Clips every pushed gradient (the worker's, reduced over its replicas) to a global norm
    /// of `max_norm` before it is pushed ([`DistributedOptimizer::with_clip_global_norm`]).
    pub fn clip_global_norm(&mut self, max_norm: f64) -> Result<()> {
        self.optimizer = Self::push_optimizer(&self.model, &self.slot, Some(max_norm))?;
        self.clip_global_norm = Some(max_norm);
        Ok(())
    }

    /// Sets the size of the buckets in which gradients enter an overlapped push (default
    /// [`DEFAULT_PUSH_BUCKET_BYTES`]; 0: every variable on its own).
    pub fn set_push_bucket_bytes(&mut self, bytes: usize) {
        self.push_bucket_bytes = bytes;
    }

    /// Turns the look-ahead on (the default) or off. A push in async and stale modes is
    /// computed from values that other workers' updates have moved on from by the time it is
    /// applied (staleness). With the look-ahead, each step's gradients are computed at the
    /// pulled values extrapolated by the updates expected to land before its push:
    /// `w + s / n * (w - w_last)`, where `w_last` is this worker's previous pull, `n` the
    /// updates applied between the two pulls, and `s` the average staleness this worker's
    /// pushes have landed with (as DANA's look-ahead, Hakimi et al. 2019, and weight
    /// prediction in pipelined training). Pushes that land at no staleness (one worker, sync
    /// mode) are computed at the pulled values exactly, as without it; state and frozen
    /// variables are never extrapolated. It costs one copy of the trainable variables.
    pub fn set_lookahead(&mut self, on: bool) {
        self.lookahead = on;
        *lock(&self.ahead) = Ahead::default();
    }

    /// Whether the look-ahead is on ([`set_lookahead`](Self::set_lookahead)).
    pub fn lookahead(&self) -> bool {
        self.lookahead
    }

    /// The average staleness this worker's pushes landed with so far (`None` before its first
    /// push, or with the look-ahead off), from which the look-ahead extrapolates.
    pub fn mean_staleness(&self) -> Option<f64> {
        lock(&self.ahead).staleness
    }

    /// Extrapolates the trainable variables just pulled at `ticket` (see
    /// [`set_lookahead`](Self::set_lookahead)) and remembers them for the next pull.
    fn look_ahead(&self, ticket: &PullTicket) -> Result<()> {
        let mut ahead = lock(&self.ahead);
        // Pushes that land as computed need nothing remembered.
        if ahead.staleness == Some(0.0) {
            ahead.last = None;
            return Ok(());
        }
        let trainable: Vec<&Var> = self
            .model
            .variables(0)
            .iter()
            .zip(self.model.kinds())
            .filter(|(_, k)| **k == VariableKind::Trainable)
            .map(|((_, v), _)| v)
            .collect();
        let pulled = trainable.iter().map(|v| v.as_tensor().copy()).collect::<candle_core::Result<Vec<_>>>()?;
        if let (Some((versions, last)), Some(s)) = (&ahead.last, ahead.staleness) {
            let updates = ticket.versions().iter().zip(versions).map(|(now, then)| now.saturating_sub(*then)).max();
            if let Some(n) = updates.filter(|&n| n > 0 && last.len() == pulled.len()) {
                let k = s / n as f64;
                for ((var, w), before) in trainable.iter().zip(&pulled).zip(last) {
                    var.set(&(w + ((w - before)? * k)?)?)?;
                }
            }
        }
        ahead.last = Some((ticket.versions().to_vec(), pulled));
        Ok(())
    }

    /// Takes the staleness `push` landed with into the look-ahead's average.
    fn note_staleness(&self, ticket: &PullTicket, push: &PushSummary) {
        let stale = push
            .outcomes
            .iter()
            .enumerate()
            .filter_map(|(i, (_, outcome))| match *outcome {
                strata_transport::ps::PushOutcome::Applied { version, .. } => {
                    let base = ticket.versions().get(i).copied().unwrap_or(0);
                    Some(version.saturating_sub(base + 1))
                }
                strata_transport::ps::PushOutcome::Dropped { .. } => None,
            })
            .max();
        if let Some(x) = stale {
            let mut ahead = lock(&self.ahead);
            let x = x as f64;
            ahead.staleness = Some(ahead.staleness.map_or(x, |s| s + STALENESS_WEIGHT * (x - s)));
        }
    }

    /// Whether this worker's pushes can start while the backward pass runs: overlap on
    /// ([`StrategyOptions::overlap`]), one replica (several are reduced on the worker first),
    /// and no clipping (which needs every gradient first). See
    /// [`backward_and_push`](Self::backward_and_push).
    pub fn overlaps(&self) -> bool {
        self.overlap
            && self.clip_global_norm.is_none()
            && self.strategy.num_replicas_in_sync() == 1
            && self.slot.tables.tables().is_empty()
    }

    /// How many steps' pushes started while their backward pass ran and were committed so
    /// far, and how many such early pushes were given up (and pushed after the pass, because
    /// other variables had a gradient than the last step's).
    pub fn overlapped_pushes(&self) -> (u64, u64) {
        (self.slot.committed.load(Ordering::Relaxed), self.slot.given_up.load(Ordering::Relaxed))
    }

    /// Computes the gradients of `loss` and pushes them, in a step of
    /// [`run_batch`](Self::run_batch): what [`ReplicaContext::backward_and_sync`] with
    /// [`optimizer`](Self::optimizer) does, but where the worker [`overlaps`](Self::overlaps),
    /// each ps task's push starts while the backward pass runs, and each bucket of gradients
    /// is sent as soon as its last gradient is final (see [`OverlappedPush`]). The first step
    /// learns the order gradients become final in and pushes after its pass; so does a step
    /// whose variables with a gradient differ from the last step's (its early push is given
    /// up, nothing of it applied). The same update is pushed either way.
    pub fn backward_and_push(&self, ctx: &ReplicaContext<'_>, loss: &Tensor) -> Result<()> {
        self.backward_and_push_then(ctx, loss, || ())
    }

    /// [`backward_and_push`](Self::backward_and_push), calling `after_backward` when the
    /// backward pass has ended, before the push is committed (nothing of it is applied before).
    pub fn backward_and_push_then(
        &self,
        ctx: &ReplicaContext<'_>,
        loss: &Tensor,
        after_backward: impl FnOnce(),
    ) -> Result<()> {
        let target = lock(&self.slot.target).clone();
        let Some((w, ticket)) = target.filter(|_| self.overlaps()) else {
            let grads = loss.backward()?;
            after_backward();
            return ctx.sync_and_apply(grads, &self.optimizer);
        };
        let trainable = lock(&self.slot.trainable).clone();
        let index: HashMap<candle_core::TensorId, usize> =
            trainable.iter().enumerate().map(|(i, (_, v))| (v.as_tensor().id(), i)).collect();
        let expected = lock(&self.ready).clone();
        let mut push = match &expected {
            Some(ready) => {
                // The push names the variables in the optimizer's order, as a push after the pass does.
                let gradients: Vec<String> =
                    trainable.iter().filter(|(n, _)| ready.contains(n)).map(|(n, _)| n.clone()).collect();
                let state: Vec<String> = self
                    .model
                    .variables(0)
                    .iter()
                    .zip(self.model.kinds())
                    .filter(|(_, k)| **k == VariableKind::State)
                    .map(|((n, _), _)| n.clone())
                    .collect();
                // A push that cannot start (the pushes after the pass report why) is not overlapped.
                w.start_overlapped_push(&ticket, &gradients, ready, &state, self.push_bucket_bytes).ok()
            }
            None => None,
        };
        let mut ready = Vec::new();
        let grads = loss.backward_with_hook(&mut |var, grad| {
            let Some(&i) = index.get(&var.id()) else { return Ok(()) };
            let name = &trainable[i].0;
            ready.push(name.clone());
            if let Some(p) = push.as_mut() {
                p.stage(name, grad.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
            }
            Ok(())
        });
        // A failed pass returns here, and dropping `push` gives it up.
        let grads = grads?;
        *lock(&self.ready) = Some(ready);
        after_backward();
        *lock(&self.slot.overlapped) = push;
        let done = ctx.sync_and_apply(grads, &self.optimizer);
        // A push the optimizer did not take (its step failed before) is given up.
        drop(lock(&self.slot.overlapped).take());
        done
    }

    /// Freezes the variables whose names match `patterns` (see [`Replicated::freeze`]): they
    /// are pulled once and never pushed.
    pub fn freeze(&mut self, patterns: &[&str]) -> Result<()> {
        self.model.freeze(patterns)?;
        self.optimizer = Self::push_optimizer(&self.model, &self.slot, self.clip_global_norm)?;
        Ok(())
    }

    /// What the steps' embedding-table lookups pulled and pushed so far.
    pub fn table_traffic(&self) -> super::TableTraffic {
        self.slot.tables.traffic()
    }

    /// The model (its copy for a replica: `model().on(ctx)`).
    pub fn model(&self) -> &Replicated<M> {
        &self.model
    }

    /// The optimizer to pass to [`ReplicaContext::backward_and_sync`]: it pushes.
    pub fn optimizer(&self) -> &DistributedOptimizer<PushToPs> {
        &self.optimizer
    }

    /// The worker's local strategy (for `reduce` of the step's values).
    pub fn strategy(&self) -> &StrategyHandle {
        &self.strategy
    }

    /// Pulls the model's variables from the ps tasks (trainable ones and state every time,
    /// frozen ones the first time), splits `batch` (any [`BatchData`]) over the worker's replicas
    /// (uneven shards weighted exactly) and runs `step` on each; a `backward_and_sync` with
    /// [`PsWorkerModel::optimizer`] in it pushes the step's reduced gradients. A stale refusal
    /// comes back as [`Error::Stale`], so the registry runs the step again.
    pub fn run_batch<B: BatchData, T: Send>(
        &self,
        w: &WorkerContext,
        batch: &B,
        step: impl Fn(&ReplicaContext<'_>, &Shard<B>) -> Result<T> + Sync,
    ) -> Result<PsStep<T>> {
        self.slot.tables.bind(w.task(), w.ps_clients());
        let ticket = self.pull_for_step(w)?;
        self.run_pulled(w, ticket, batch, step)
    }

    /// [`Self::run_batch`] of the batch `make` returns, made on this thread while another pulls
    /// the variables: a batch generated for the step (the click model's records) costs the step
    /// no time where the pull waits on the ps tasks. Then, still beside that pull, `prefetch`
    /// gets the model (its copy for replica 0) and the batch, to have the rows of its embedding
    /// tables the step will look up pulled ahead ([`Embedding::prefetch`], e.g. `|m, b|
    /// Ok(m.embedding().prefetch(&b.1)?)`; `|_, _| Ok(())` for none): the step's lookups then
    /// wait for no pull of their own. The pull's error comes first.
    ///
    /// [`Embedding::prefetch`]: strata_core::layers::Embedding::prefetch
    pub fn run_batch_made<B: BatchData, T: Send>(
        &self,
        w: &WorkerContext,
        make: impl FnOnce() -> Result<B>,
        prefetch: impl FnOnce(&M, &B) -> Result<()>,
        step: impl Fn(&ReplicaContext<'_>, &Shard<B>) -> Result<T> + Sync,
    ) -> Result<PsStep<T>>
    where
        M: Sync,
    {
        // The tables know the ps tasks before the prefetch pulls from them.
        self.slot.tables.bind(w.task(), w.ps_clients());
        let (ticket, batch) = std::thread::scope(|s| {
            let pulled = s.spawn(|| self.pull_for_step(w));
            let batch = make().and_then(|b| prefetch(self.model.primary(), &b).map(|()| b));
            let ticket = pulled.join().unwrap_or_else(|_| Err(Error::Cluster("the step's pull panicked".into())));
            (ticket, batch)
        });
        let (ticket, batch) = (ticket?, batch?);
        self.run_pulled(w, ticket, &batch, step)
    }

    /// The pull that begins a step: trainable variables and state every time, frozen ones the
    /// first time, extrapolated by the look-ahead where it is on, mirrored into every copy.
    fn pull_for_step(&self, w: &WorkerContext) -> Result<PullTicket> {
        let first = !self.frozen_pulled.load(Ordering::Acquire);
        let vars: Vec<(String, Var)> = self
            .model
            .variables(0)
            .iter()
            .zip(self.model.kinds())
            .filter(|(_, k)| first || **k != VariableKind::Frozen)
            .map(|(v, _)| v.clone())
            .collect();
        let ticket = w.pull(&vars)?;
        self.frozen_pulled.store(true, Ordering::Release);
        if self.lookahead {
            self.look_ahead(&ticket)?;
        }
        self.mirror_pulled(&vars)?;
        Ok(ticket)
    }

    /// The rest of a step after its pull (`ticket`): see [`Self::run_batch`].
    fn run_pulled<B: BatchData, T: Send>(
        &self,
        w: &WorkerContext,
        ticket: PullTicket,
        batch: &B,
        step: impl Fn(&ReplicaContext<'_>, &Shard<B>) -> Result<T> + Sync,
    ) -> Result<PsStep<T>> {
        let mut base = Vec::new();
        for ((_, v), k) in self.model.variables(0).iter().zip(self.model.kinds()) {
            if *k == VariableKind::State {
                base.push(v.as_tensor().to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
            }
        }
        *lock(&self.slot.state_base) = base;
        *lock(&self.slot.outcome) = None;
        *lock(&self.slot.target) = Some((w.clone(), ticket.clone()));
        let split = DistributedBatch::split(batch, self.strategy.num_replicas_in_sync())?;
        let ran = self.strategy.run_batch(&split, step);
        *lock(&self.slot.target) = None;
        drop(lock(&self.slot.overlapped).take());
        let outcome = lock(&self.slot.outcome).take();
        let push = match (ran, outcome) {
            (Ok(values), Some(Ok(push))) => {
                if self.lookahead {
                    self.note_staleness(&ticket, &push);
                }
                return Ok(PsStep { values, pull: ticket, push: Some(push) });
            }
            (Ok(values), None) => return Ok(PsStep { values, pull: ticket, push: None }),
            // The push's own error (a stale refusal stays one), not the replica's wrapping of it.
            (_, Some(Err(e))) => e,
            (Err(e), _) => e,
        };
        Err(push)
    }

    /// Copies the pulled values of copy 0 into the other copies (central state, one per
    /// replica; trainable and frozen variables are shared).
    fn mirror_pulled(&self, pulled: &[(String, Var)]) -> Result<()> {
        for copy in 1..self.model.num_copies() {
            for ((name, dst), (_, src)) in self.model.variables(copy).iter().zip(self.model.variables(0)) {
                if dst.as_tensor().id() != src.as_tensor().id() && pulled.iter().any(|(n, _)| n == name) {
                    dst.set(&src.as_tensor().to_device(dst.device())?)?;
                }
            }
        }
        Ok(())
    }
}

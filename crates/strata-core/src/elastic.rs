//! Elastic training for any training loop: what a job does when its membership changes.
//!
//! An elastic multi-worker job (a strategy whose
//! [`WorkerCollectives::is_elastic`]) goes
//! on when a worker is lost, leaves on request, or joins. Its synchronous replicas hold identical
//! state after every step, so the state to go on from is in every member's memory; what a
//! loop must do is the same whoever wrote the loop, and [`Elastic`] does it:
//!
//! - a step a change interrupted is abandoned, the members join the next generation, and every
//!   member takes the most advanced member's parameters, optimizer state and position (a member
//!   that completed the step hands it to those that did not: every step is applied exactly
//!   once), then the loop runs the step again from there;
//! - the state the cross-device ops keep from step to step (compression's) follows the
//!   membership ([`CrossDeviceOps::carry_over`]);
//! - ZeRO's shards are laid out again over the new membership; where a lost worker took its
//!   shard of an optimizer's state (or, at stage 3, of the parameters) with it, every member
//!   rolls back to the latest checkpoint;
//! - workers waiting to join are admitted at a step boundary every member agrees on, and a
//!   worker asked to stop leaves alone while enough remain.
//!
//! A hand-written loop calls it around each step:
//!
//! ```no_run
//! # use strata_core::elastic::{Elastic, Position, Stepped};
//! # use strata_core::optim::FusedSgd;
//! # use strata_core::{Replicated, Strategy, StrategyHandle};
//! # fn train(strategy: &StrategyHandle, model: &Replicated<candle_nn::Linear>, steps: usize) -> strata_core::Result<()> {
//! let opt = model.optimizer::<FusedSgd>(0.1)?;
//! let elastic = Elastic::new(strategy, model, &opt)?;
//! let mut at = elastic.start()?; // 0, or a joiner's (or a resumed job's) position
//! while at.step < steps {
//!     match elastic.step(at, || {
//!         // the step: strategy.run_batch(&batches[at.step], |ctx, shard| ...)
//!         Ok(())
//!     })? {
//!         Stepped::Done(()) => at.step += 1,
//!         Stepped::Moved(p) => at = p, // the membership changed: go on from there
//!     }
//! }
//! while let Stepped::Moved(p) = elastic.finish(at)? {
//!     at = p;
//! }
//! # Ok(())
//! # }
//! ```
//!
//! Every collective a loop runs between steps (an evaluation, a reduction of the losses) goes
//! through [`Elastic::guard`], so that a change caught there moves the loop as a failed step
//! does. Without an elastic strategy every call runs its closure and returns its error, so the
//! same loop runs on one device.

use std::cell::{Cell, RefCell};
use std::path::PathBuf;

use candle_core::{DType, Tensor};
use candle_nn::Optimizer;

use crate::checkpoint::{self, CheckpointTensor, OptimizerState};
use crate::cross_device::{CrossDeviceOps, WorkerCollectives};
use crate::{DistributedOptimizer, Error, ReduceOp, Replicated, Result, Strategy, StrategyExtended, ZeroStage};

/// Named tensors: a model's variables or an optimizer's state.
type NamedTensors = Vec<(String, Tensor)>;

/// An optimizer whose whole state can be saved, loaded and laid out again: what checkpoints and
/// elastic recovery need of it. Every [`DistributedOptimizer`] of an optimizer with
/// [`OptimizerState`] (Strata's fused ones, or a user's own) is one.
pub trait StatefulOptimizer {
    /// The whole state, as one optimizer over the whole model saves it (under ZeRO across
    /// workers a collective: every worker's shards gathered).
    fn state_tensors(&self) -> Result<NamedTensors>;
    /// Loads the whole state (under ZeRO each copy takes its shard).
    fn load_state_tensors(&self, state: &[(String, Tensor)]) -> Result<()>;
    /// The model's variables are about to take a checkpoint's values, before
    /// [`load_state_tensors`](Self::load_state_tensors): ZeRO stage 3 then brings a released
    /// variable back without reading its shards (its values are about to be replaced). Nothing
    /// by default.
    fn begin_load(&self) {}
    /// ZeRO stage 3: brings every variable back whole and keeps it so until the shards are
    /// laid out again ([`reshard`](Self::reshard)); collective across workers. Nothing by
    /// default.
    fn unshard_parameters(&self) -> Result<()> {
        Ok(())
    }
    /// Whether the optimizer keeps state across steps (plain SGD keeps none).
    fn keeps_state(&self) -> Result<bool>;
    /// Whether [`state_tensors`](Self::state_tensors) is a collective every worker calls (under
    /// ZeRO, or local SGD, across workers). By default: at a ZeRO stage above 0.
    fn gathers_state(&self) -> bool {
        self.zero_stage() != ZeroStage::Off
    }
    /// Local SGD: the inner steps applied so far (a step whose meeting with the other workers
    /// failed was applied on this one); `None` (the default) without local SGD.
    fn local_steps(&self) -> Option<u64> {
        None
    }
    /// Local SGD in an elastic job whose membership changed (every member calls it, at the
    /// agreed position `step`): a joiner (`joined`; `joiners`: whether any member is one) takes
    /// member `source`'s optimizer state, the members agree on the outer state, and every
    /// exchange the change interrupted is met again. Nothing by default.
    fn rejoin_local_steps(&self, _source: usize, _joiners: bool, _joined: bool, _step: u64) -> Result<()> {
        Ok(())
    }
    /// ZeRO: lays the shards out over the current membership (fresh state; load it after).
    fn reshard(&self) -> Result<bool>;
    /// The ZeRO stage it runs.
    fn zero_stage(&self) -> ZeroStage;
    /// Micro-batches per optimizer step.
    fn accumulation(&self) -> usize;
    /// Sets the optimizer steps applied so far (a schedule reads them).
    fn set_iterations(&self, n: u64);
}

impl<O: Optimizer + OptimizerState> StatefulOptimizer for DistributedOptimizer<O> {
    fn state_tensors(&self) -> Result<NamedTensors> {
        DistributedOptimizer::state_tensors(self)
    }
    fn load_state_tensors(&self, state: &[(String, Tensor)]) -> Result<()> {
        DistributedOptimizer::load_state_tensors(self, state)
    }
    fn begin_load(&self) {
        DistributedOptimizer::begin_load(self)
    }
    fn unshard_parameters(&self) -> Result<()> {
        DistributedOptimizer::unshard_parameters(self)
    }
    fn keeps_state(&self) -> Result<bool> {
        DistributedOptimizer::keeps_state(self)
    }
    fn gathers_state(&self) -> bool {
        DistributedOptimizer::gathers_state(self)
    }
    fn local_steps(&self) -> Option<u64> {
        DistributedOptimizer::local_steps(self)
    }
    fn rejoin_local_steps(&self, source: usize, joiners: bool, joined: bool, step: u64) -> Result<()> {
        DistributedOptimizer::rejoin_local_steps(self, source, joiners, joined, step)
    }
    fn reshard(&self) -> Result<bool> {
        DistributedOptimizer::reshard(self)
    }
    fn zero_stage(&self) -> ZeroStage {
        DistributedOptimizer::zero_stage(self)
    }
    fn accumulation(&self) -> usize {
        DistributedOptimizer::accumulation(self)
    }
    fn set_iterations(&self, n: u64) {
        DistributedOptimizer::set_iterations(self, n)
    }
}

/// Where and how often the chief writes checkpoints.
#[derive(Clone, Debug)]
pub struct CheckpointConfig {
    /// The checkpoint root (one `ckpt-<step>` directory per checkpoint).
    pub dir: PathBuf,
    /// Write a checkpoint every this many steps (and after the last step).
    pub every_steps: usize,
    /// Keep this many checkpoints.
    pub keep: usize,
}

/// Where a worker is in training: steps completed, and epochs whose end (their loss and
/// evaluation) is done. In an elastic job a member may be one step or one epoch end ahead of
/// another when a change interrupts them; the most advanced one leads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Position {
    /// Steps completed (counting a resumed run's earlier steps).
    pub step: usize,
    /// Epochs whose end is done.
    pub ended: usize,
}

/// What a call of [`Elastic`] did.
#[derive(Debug)]
#[must_use = "a moved position is where the loop goes on"]
pub enum Stepped<T> {
    /// It ran, and returned this.
    Done(T),
    /// The membership changed: every member now holds the state of this position, from which
    /// the loop goes on (the step or the work of the call is not done).
    Moved(Position),
}

/// What the workers agreed about stops on request ([`Elastic::agree_to_stop`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// No worker was asked to stop.
    GoOn,
    /// The job stops (every worker was asked to, or too few would remain): the largest code.
    All(u32),
    /// This worker was asked to stop (its code) and left the job, which goes on without it.
    Left(u32),
}

/// Elastic recovery around a training loop's steps (see the [module](self)).
pub struct Elastic<'a, M> {
    ext: &'a dyn StrategyExtended,
    model: &'a Replicated<M>,
    opt: &'a dyn StatefulOptimizer,
    checkpoints: Option<CheckpointConfig>,
    steps_per_epoch: usize,
    /// ZeRO: the state is gathered from every replica's shard (a collective).
    collective: bool,
    /// Under ZeRO: whether the optimizer keeps state (false at stage 0, where nothing asks).
    keeps_state: bool,
    /// ZeRO stage 3: each worker holds its shard of the parameters only.
    shards_parameters: bool,
    /// ZeRO with an optimizer that keeps state, or at stage 3: the whole state, gathered over
    /// the old membership before a change it saw coming (a worker admitted, or leaving on
    /// request), with the step it is of; at stage 3 the parameters were made whole then too.
    prepared: RefCell<Option<(usize, NamedTensors)>>,
    /// A change met after the work of a call was done (a checkpoint written after a step): the
    /// position the next call moves the loop to.
    moved: Cell<Option<Position>>,
}

impl<M> std::fmt::Debug for Elastic<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Elastic")
            .field("elastic", &self.is_elastic())
            .field("checkpoints", &self.checkpoints)
            .field("steps_per_epoch", &self.steps_per_epoch)
            .finish_non_exhaustive()
    }
}

impl<'a, M> Elastic<'a, M> {
    /// Recovery for `model` trained with `opt` under `strategy`. Refuses gradients accumulated
    /// over several batches in an elastic job (a step run again would count them twice).
    pub fn new<S: Strategy + ?Sized>(
        strategy: &'a S,
        model: &'a Replicated<M>,
        opt: &'a dyn StatefulOptimizer,
    ) -> Result<Self> {
        let ext: &'a dyn StrategyExtended = &**strategy.extended();
        let elastic = ext.workers().is_some_and(|w| w.is_elastic());
        let accumulation = opt.accumulation();
        if elastic && accumulation > 1 {
            return Err(Error::InvalidArgument(format!(
                "an elastic job re-runs a step a lost worker interrupted, which gradients accumulated over {accumulation} batches would count twice; accumulate over 1 batch in an elastic job"
            )));
        }
        let collective = opt.zero_stage() != ZeroStage::Off;
        Ok(Self {
            ext,
            model,
            opt,
            checkpoints: None,
            steps_per_epoch: usize::MAX,
            collective,
            // Only ZeRO asks (copy 0's state is then its shard's: cheap to look at).
            keeps_state: collective && opt.keeps_state()?,
            shards_parameters: opt.zero_stage().shards_parameters(),
            prepared: RefCell::default(),
            moved: Cell::default(),
        })
    }

    /// Checkpoints: [`start`](Self::start) resumes from the latest, [`step`](Self::step) writes
    /// one (the chief does) after every [`CheckpointConfig::every_steps`]-th step, and a job
    /// at ZeRO stage 1 or 2 whose lost worker took its shard of the optimizer state rolls back
    /// to the latest.
    pub fn with_checkpoints(mut self, checkpoints: CheckpointConfig) -> Self {
        self.checkpoints = Some(checkpoints);
        self
    }

    /// Steps per epoch, from which a roll back to a checkpoint tells the epochs it ended
    /// ([`Position::ended`]); without it, none.
    pub fn with_steps_per_epoch(mut self, steps: usize) -> Self {
        self.steps_per_epoch = steps.max(1);
        self
    }

    /// Whether the strategy's job is elastic (otherwise every call runs its closure and
    /// returns its errors).
    pub fn is_elastic(&self) -> bool {
        self.workers().is_some_and(|w| w.is_elastic())
    }

    /// The worker collectives of the strategy, in a job of several workers.
    pub fn workers(&self) -> Option<&'a dyn WorkerCollectives> {
        self.ext.workers()
    }

    /// Where training begins, before the first step (every worker calls it): a worker that
    /// joined an elastic job under way takes the state and the position of the most advanced
    /// member; otherwise the latest checkpoint's (read by the chief and handed to every
    /// worker), or step 0. The chief checks that the checkpoint directory takes checkpoints.
    pub fn start(&self) -> Result<Position> {
        let joined = self.is_elastic() && self.workers().is_some_and(|w| w.joined_under_way());
        if self.is_elastic() {
            check_zero_state(self.opt.zero_stage(), self.keeps_state, self.checkpoints.is_some())?;
        }
        let position = match (joined, &self.checkpoints) {
            (true, _) => self.recover(None, None)?,
            (false, Some(c)) => {
                let step = resume(self.ext, self.model, self.opt, c)?;
                Position { step, ended: step / self.steps_per_epoch }
            }
            (false, None) => Position::default(),
        };
        if let Some(c) = &self.checkpoints {
            check_directory(self.ext, c)?;
            if self.is_elastic() && !joined && position.step == 0 && self.sharded_state() {
                // ZeRO in an elastic job: a lost worker's shard of the optimizer state (or of
                // the parameters) rolls the job back to its latest checkpoint, from the first
                // step on.
                save_checkpoint(self.ext, self.model, self.opt, c, 0)?;
            }
        }
        Ok(position)
    }

    /// Runs the step after `at` (`run`: the loop's step, such as `strategy.run_batch(...)`),
    /// first admitting workers that wait to join (a step boundary every member agrees on),
    /// then writing a checkpoint where one is due. `Done` with what `run` returned, or, where
    /// the membership changed, `Moved` to where every member now is: run the step of that
    /// position next.
    pub fn step<T>(&self, at: Position, run: impl FnOnce() -> Result<T>) -> Result<Stepped<T>> {
        if let Some(p) = self.moved.take() {
            return Ok(Stepped::Moved(p));
        }
        if let Some(w) = self.workers().filter(|w| w.is_elastic()) {
            match w.admit_waiting() {
                Ok(true) => {
                    // ZeRO: the whole optimizer state, before the shards are re-split.
                    let why = match self.prepare(at.step) {
                        Ok(()) => "admitting workers that wait to join".to_string(),
                        Err(e) => return self.recover_from(at, e).map(Stepped::Moved),
                    };
                    return self.recover(Some(at), Some(&why)).map(Stepped::Moved);
                }
                Ok(false) => {}
                Err(e) => return self.recover_from(at, e).map(Stepped::Moved),
            }
        }
        let out = match run() {
            Ok(out) => out,
            Err(e) => {
                // Local SGD: a step fails in its meeting with the other workers, after its inner
                // step was applied, which is not applied again.
                let at = match self.opt.local_steps() {
                    Some(n) if n as usize > at.step => Position { step: at.step + 1, ..at },
                    _ => at,
                };
                return self.recover_from(at, e).map(Stepped::Moved);
            }
        };
        let done = Position { step: at.step + 1, ..at };
        if let Some(c) = self.checkpoints.as_ref().filter(|c| done.step.is_multiple_of(c.every_steps.max(1))) {
            if let Err(e) = save_checkpoint(self.ext, self.model, self.opt, c, done.step) {
                // The step is done; the loop moves at its next call.
                self.moved.set(Some(self.recover_from(done, e)?));
            }
        }
        Ok(Stepped::Done(out))
    }

    /// Runs `f`, a collective of the loop's own between steps (an evaluation, a reduction of
    /// the epoch's losses), at position `at`: `Moved` where the membership changed meanwhile
    /// (or at the call before, after its work was done).
    pub fn guard<T>(&self, at: Position, f: impl FnOnce() -> Result<T>) -> Result<Stepped<T>> {
        if let Some(p) = self.moved.take() {
            return Ok(Stepped::Moved(p));
        }
        match f() {
            Ok(v) => Ok(Stepped::Done(v)),
            Err(e) => self.recover_from(at, e).map(Stepped::Moved),
        }
    }

    /// Writes a checkpoint of position `at` now (the chief does; every worker calls it), as
    /// after the last step where it is not one [`step`](Self::step) writes.
    pub fn checkpoint(&self, at: Position) -> Result<Stepped<()>> {
        let Some(c) = &self.checkpoints else { return Ok(Stepped::Done(())) };
        self.guard(at, || save_checkpoint(self.ext, self.model, self.opt, c, at.step))
    }

    /// After a step (every worker calls it at the same point): whether any worker was asked to
    /// stop (`requested`: this worker's code, such as a signal's number). In an elastic job a
    /// worker asked to stop leaves it alone while enough workers remain ([`Stop::Left`]: its
    /// collectives end, handing its shard of ZeRO's state over first), and the others go on at
    /// once (`Moved`); otherwise every worker stops ([`Stop::All`]).
    pub fn agree_to_stop(&self, at: Position, requested: Option<u32>) -> Result<Stepped<Stop>> {
        if let Some(p) = self.moved.take() {
            return Ok(Stepped::Moved(p));
        }
        let mine = requested.unwrap_or(0);
        let agreeing = |e| match e {
            Error::Cluster(m) => {
                Error::Cluster(format!("agreeing whether to stop after training step {}: {m}", at.step))
            }
            other => other,
        };
        let Some(w) = self.workers().filter(|w| w.is_elastic()) else {
            let code = largest_stop_code(self.workers(), mine).map_err(agreeing)?;
            return Ok(Stepped::Done(if code > 0 { Stop::All(code) } else { Stop::GoOn }));
        };
        let all = match w.all_gather(&[mine.min(1 << 24) as f32]) {
            Ok(all) => all,
            Err(e) => return self.recover_from(at, agreeing(e)).map(Stepped::Moved),
        };
        let codes: Vec<u32> = all.iter().map(|v| v.first().copied().unwrap_or(0.0) as u32).collect();
        let stopping = codes.iter().filter(|&&c| c > 0).count();
        let staying = codes.len() - stopping;
        if stopping == 0 {
            return Ok(Stepped::Done(Stop::GoOn));
        }
        if staying == 0 || staying < w.min_workers() {
            return Ok(Stepped::Done(Stop::All(codes.iter().copied().max().unwrap_or(mine))));
        }
        if mine > 0 {
            // ZeRO: this worker's shard of the optimizer state stays with the others (a
            // collective, before it leaves). A handover that fails on this side only (the
            // others finished it and moved on, closing the generation under its last read)
            // does not keep it: the others' own `prepare` decides whether they roll back.
            if let Err(e) = self.prepare(at.step) {
                tracing::warn!(step = at.step, error = %e, "the handover failed on this side; leaving as asked");
            }
            w.leave_on_request(mine)?;
            tracing::info!(step = at.step, code = mine, "left the elastic job on request");
            return Ok(Stepped::Done(Stop::Left(mine)));
        }
        if let Err(e) = self.prepare(at.step) {
            return self.recover_from(at, e).map(Stepped::Moved);
        }
        let why = format!("{stopping} worker(s) left the job on request after step {}", at.step);
        self.recover(Some(at), Some(&why)).map(Stepped::Moved)
    }

    /// The end of training (every worker calls it at `at`, the last position): in an elastic
    /// job every live member ends together with the state's mean
    /// ([`Replicated::sync_state`]) and, at ZeRO stage 3, the whole model
    /// ([`StatefulOptimizer::unshard_parameters`]), so that a loss even now costs nothing and
    /// no member leaves while another still needs it. `Moved` where a change came meanwhile:
    /// train on from there.
    pub fn finish(&self, at: Position) -> Result<Stepped<()>> {
        match self.workers().filter(|w| w.is_elastic()) {
            Some(w) => self.guard(at, || {
                self.model.sync_state()?;
                self.opt.unshard_parameters()?;
                w.barrier()
            }),
            None => self.guard(at, || self.model.sync_state()),
        }
    }

    /// After a collective at `at` failed with `e`: in an elastic job a cluster error re-forms
    /// the membership and gives the position to go on from; any other error is returned.
    fn recover_from(&self, at: Position, e: Error) -> Result<Position> {
        match e {
            Error::Cluster(m) if self.is_elastic() => self.recover(Some(at), Some(&m)),
            e => Err(e),
        }
    }

    /// After a failed collective (`why`; `None` for a worker that joined under way): joins the
    /// next generation of the membership, and brings every member to the most advanced
    /// member's state and position. Another loss meanwhile starts over.
    fn recover(&self, mine: Option<Position>, why: Option<&str>) -> Result<Position> {
        let Some(w) = self.workers() else {
            return Err(Error::Cluster(why.unwrap_or("a collective failed").to_string()));
        };
        if let Some(why) = why {
            tracing::warn!(step = mine.map(|p| p.step), %why, "a step failed; re-forming the elastic job");
            w.rejoin()?;
        }
        loop {
            match self.sync(w, mine) {
                Ok(p) => {
                    self.at_step(p.step);
                    tracing::info!(
                        step = p.step,
                        workers = w.num_workers(),
                        generation = w.generation(),
                        "training goes on"
                    );
                    return Ok(p);
                }
                Err(Error::Cluster(m)) => {
                    tracing::warn!(why = %m, "the membership changed again while it was agreed; re-forming");
                    w.rejoin()?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Sets the optimizer steps applied for the training step given.
    fn at_step(&self, step: usize) {
        self.opt.set_iterations(step as u64 / self.opt.accumulation().max(1) as u64);
    }

    /// Whether a worker holds a shard of state that no other worker has: ZeRO with an
    /// optimizer that keeps state, or stage 3 (a shard of the parameters).
    fn sharded_state(&self) -> bool {
        self.collective && (self.keeps_state || self.shards_parameters)
    }

    /// ZeRO with an optimizer that keeps state, or at stage 3, before a change of membership
    /// every member sees coming (every member calls it, over the old membership): gathers the
    /// whole state, and at stage 3 makes the parameters whole, so that no shard of either
    /// leaves with a worker.
    fn prepare(&self, step: usize) -> Result<()> {
        if self.sharded_state() {
            self.opt.unshard_parameters()?;
            *self.prepared.borrow_mut() = Some((step, self.opt.state_tensors()?));
        }
        Ok(())
    }

    /// Every member's position, the most advanced one's state broadcast when they differ.
    fn sync(&self, w: &dyn WorkerCollectives, mine: Option<Position>) -> Result<Position> {
        if self.collective {
            return self.sync_shards(w, mine);
        }
        if self.opt.local_steps().is_some() {
            return self.sync_local(w, mine);
        }
        // Counts below 2^24 are exact in an f32; a joiner has none.
        let v = mine.map_or([-1.0, -1.0], |p| [p.step.min(1 << 24) as f32, p.ended.min(1 << 24) as f32]);
        let all = w.all_gather(&v)?;
        let mut source = 0;
        for (rank, x) in all.iter().enumerate() {
            if at(x) > at(&all[source]) {
                source = rank;
            }
        }
        let best = at(&all[source]);
        if best.0 < 0.0 {
            return Err(none_has_state());
        }
        let position = Position { step: best.0 as usize, ended: best.1 as usize };
        self.ops().carry_over(&self.vars(), source)?;
        if all.iter().all(|x| at(x) == best) {
            return Ok(position);
        }
        let (vars, state) = state_layout(self.model, self.opt)?;
        let len: usize = vars.iter().chain(state.iter()).map(|(_, t)| t.elem_count()).sum();
        let mut values = Vec::with_capacity(len);
        if w.worker_index() == source {
            for (_, t) in vars.iter().chain(state.iter()) {
                values.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
            }
        } else {
            values.resize(len, 0.0);
        }
        w.broadcast(source, &mut values)?;
        if w.worker_index() != source {
            load_flat(self.model, self.opt, &vars, &state, &values)?;
        }
        Ok(position)
    }

    /// [`Self::sync`] under local SGD, whose members each keep their own parameters and
    /// optimizer state: the members agree on the most advanced position (a member behind it,
    /// which had not finished the step a change interrupted, skips that step), a joiner takes
    /// the most advanced member's variables and optimizer state, and the outer synchronisation
    /// re-forms ([`StatefulOptimizer::rejoin_local_steps`]).
    fn sync_local(&self, w: &dyn WorkerCollectives, mine: Option<Position>) -> Result<Position> {
        // Counts below 2^24 are exact in an f32; a joiner has none.
        let v = mine.map_or([-1.0, -1.0], |p| [p.step.min(1 << 24) as f32, p.ended.min(1 << 24) as f32]);
        let all = w.all_gather(&v)?;
        let source = (0..all.len()).fold(0, |b, r| if at(&all[r]) > at(&all[b]) { r } else { b });
        let best = at(&all[source]);
        if best.0 < 0.0 {
            return Err(none_has_state());
        }
        let position = Position { step: best.0 as usize, ended: best.1 as usize };
        self.ops().carry_over(&self.vars(), source)?;
        let joiners = all.iter().any(|x| at(x).0 < 0.0);
        if joiners {
            // The model's variables, its state beside the parameters too, to the joiners.
            let vars = self.vars();
            let len: usize = vars.iter().map(Tensor::elem_count).sum();
            let mut values = Vec::with_capacity(len);
            if mine.is_some() {
                for t in &vars {
                    values.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
                }
            } else {
                values.resize(len, 0.0);
            }
            w.broadcast(source, &mut values)?;
            if mine.is_none() {
                let mut at = 0;
                let new: Vec<Tensor> = vars
                    .iter()
                    .map(|t| {
                        let n = t.elem_count();
                        let v = Tensor::from_slice(&values[at..at + n], t.shape(), t.device())?.to_dtype(t.dtype());
                        at += n;
                        v
                    })
                    .collect::<candle_core::Result<_>>()?;
                for copy in 0..self.model.num_copies() {
                    for ((_, var), value) in self.model.variables(copy).iter().zip(&new) {
                        var.set(value)?;
                    }
                }
            }
        }
        self.opt.rejoin_local_steps(source, joiners, mine.is_none(), position.step as u64)?;
        Ok(position)
    }

    /// [`Self::sync`] under ZeRO, whose shards are laid out again over the new membership: a
    /// member that holds the whole optimizer state of its step (gathered before the change,
    /// [`Self::prepare`]; nothing to hold for an optimizer that keeps none) hands both to every
    /// member, the most advanced such member. Where none can (a lost worker took its shard of
    /// the state with it), every member rolls back to the latest checkpoint.
    fn sync_shards(&self, w: &dyn WorkerCollectives, mine: Option<Position>) -> Result<Position> {
        self.opt.reshard()?;
        let prepared = self.prepared.borrow().as_ref().map(|(step, _)| *step);
        // An elastic job's shards are stepped in copies: below stage 3 a member's parameters
        // are whole at its position even when a loss cut its last step off.
        let whole = mine.is_some_and(|p| !self.sharded_state() || prepared == Some(p.step));
        // Counts below 2^24 are exact in an f32; a joiner has none.
        let v = mine.map_or([-1.0, -1.0, 0.0], |p| {
            [p.step.min(1 << 24) as f32, p.ended.min(1 << 24) as f32, f32::from(u8::from(whole))]
        });
        let all = w.all_gather(&v)?;
        let can = |x: &[f32]| x.get(2).copied().unwrap_or(0.0) == 1.0;
        let mut best = 0;
        let mut source: Option<usize> = None;
        for (rank, x) in all.iter().enumerate() {
            if at(x) > at(&all[best]) {
                best = rank;
            }
            if can(x) && source.is_none_or(|s| at(x) > at(&all[s])) {
                source = Some(rank);
            }
        }
        if at(&all[best]).0 < 0.0 {
            return Err(none_has_state());
        }
        match source.filter(|&s| at(&all[s]) == at(&all[best])) {
            Some(source) => self.hand_over_shards(w, source, at(&all[source])),
            None => self.roll_back(w, best),
        }
    }

    /// ZeRO: member `source` (at `position`) hands its parameters and the whole optimizer
    /// state to every member, which each take their new shard of it.
    fn hand_over_shards(&self, w: &dyn WorkerCollectives, source: usize, position: (f32, f32)) -> Result<Position> {
        self.ops().carry_over(&self.vars(), source)?;
        // The whole state's names and shapes (a collective: every member's shards).
        let (vars, state) = state_layout(self.model, self.opt)?;
        let len: usize = vars.iter().chain(state.iter()).map(|(_, t)| t.elem_count()).sum();
        let mut values = Vec::with_capacity(len);
        if w.worker_index() == source {
            let held = self.prepared.borrow();
            let held: &[(String, Tensor)] = held.as_ref().map_or(&[], |(_, s)| s.as_slice());
            for (_, t) in &vars {
                values.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
            }
            for (name, t) in &state {
                let t = held.iter().find(|(n, _)| n == name).map_or(t, |(_, h)| h);
                values.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
            }
            if values.len() != len {
                return Err(Error::Checkpoint(format!(
                    "the optimizer state gathered before the change holds {} values, {len} expected; every worker must build the same model and optimizer",
                    values.len()
                )));
            }
        } else {
            values.resize(len, 0.0);
        }
        w.broadcast(source, &mut values)?;
        load_flat(self.model, self.opt, &vars, &state, &values)?;
        let position = Position { step: position.0 as usize, ended: position.1 as usize };
        self.at_step(position.step);
        *self.prepared.borrow_mut() = None;
        tracing::info!(
            step = position.step,
            workers = w.num_workers(),
            "re-split ZeRO's shards over the new membership"
        );
        Ok(position)
    }

    /// ZeRO, where a lost worker took its shard of the optimizer state (or of the parameters):
    /// every member rolls back to the latest checkpoint (member `best`'s compression state
    /// carried over).
    fn roll_back(&self, w: &dyn WorkerCollectives, best: usize) -> Result<Position> {
        self.ops().carry_over(&self.vars(), best)?;
        let what = self.lost_shard();
        let Some(c) = &self.checkpoints else {
            return Err(Error::Checkpoint(format!(
                "a lost worker took {what} with it, and the job has no checkpoint to roll back to; give it a checkpoint directory"
            )));
        };
        let Some(step) = restore_latest(self.ext, self.model, self.opt, c)? else {
            return Err(Error::Checkpoint(format!(
                "a lost worker took {what} with it, and no checkpoint was found to roll back to; keep the checkpoint directory where the leading worker reads it"
            )));
        };
        *self.prepared.borrow_mut() = None;
        tracing::warn!(step, workers = w.num_workers(), "rolled back to a checkpoint: a lost worker took {what}");
        if w.worker_index() == 0 {
            eprintln!(
                "rolled back to the checkpoint of step {step}: a lost worker took {what} with it; the steps since are trained again over {} workers",
                w.num_workers()
            );
        }
        Ok(Position { step, ended: step / self.steps_per_epoch })
    }

    /// What a lost worker takes with it: its shard of the parameters at stage 3, otherwise of
    /// the optimizer state.
    fn lost_shard(&self) -> &'static str {
        if self.shards_parameters {
            "its shard of the parameters (ZeRO stage 3)"
        } else {
            "its shard of the optimizer state (ZeRO)"
        }
    }

    /// The reductions, whose state across steps (compression's) follows the membership.
    fn ops(&self) -> &'a dyn CrossDeviceOps {
        self.ext.cross_device_ops()
    }

    /// The model's variables on this worker (copy 0), in creation order.
    fn vars(&self) -> Vec<Tensor> {
        self.model.variables(0).iter().map(|(_, v)| v.as_tensor().clone()).collect()
    }
}

/// Refuses an elastic job at a ZeRO `stage` above 0 whose optimizer keeps state
/// (`keeps_state`), or at stage 3, without checkpoints (`checkpointed` false): a lost worker
/// takes its shard of that state (at stage 3 of the parameters) with it, and only a checkpoint
/// can bring the whole state back. Stage 0, stages 1 and 2 with an optimizer without state
/// (plain SGD), or a job with checkpoints pass. [`Elastic::start`] calls it; a program may call
/// it before any worker starts.
pub fn check_zero_state(stage: ZeroStage, keeps_state: bool, checkpointed: bool) -> Result<()> {
    if stage == ZeroStage::Off || checkpointed {
        return Ok(());
    }
    if stage.shards_parameters() {
        return Err(Error::InvalidArgument(
            "an elastic job at ZeRO stage 3: a lost worker takes its shard of the parameters with it, and the job then rolls back to its last checkpoint; give it a checkpoint directory (strata train --checkpoint-dir DIR; --checkpoint-every N says how far back), or train at stage 2, whose workers each hold the whole parameters".into(),
        ));
    }
    if !keeps_state {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "an elastic job at ZeRO stage {stage} with an optimizer that keeps state, such as AdamW: a lost worker takes its shard of that state with it, and the job then rolls back to its last checkpoint; give it a checkpoint directory (strata train --checkpoint-dir DIR; --checkpoint-every N says how far back), or train with plain SGD (--optimizer sgd), which keeps no state, or at stage 0"
    )))
}

/// A member's gathered `(step, ended)`; -1 for a joiner.
fn at(x: &[f32]) -> (f32, f32) {
    (x.first().copied().unwrap_or(-1.0), x.get(1).copied().unwrap_or(-1.0))
}

fn none_has_state() -> Error {
    Error::InvalidArgument(
        "every worker of the elastic job joined it under way: none has its state; restart the job".into(),
    )
}

fn is_chief(ext: &dyn StrategyExtended) -> bool {
    ext.workers().is_none_or(|w| w.worker_index() == 0)
}

/// The chief (worker 0) checks that `c`'s directory takes checkpoints, before the first step:
/// a directory that cannot take one fails the job before it trains.
fn check_directory(ext: &dyn StrategyExtended, c: &CheckpointConfig) -> Result<()> {
    if !is_chief(ext) {
        return Ok(());
    }
    checkpoint::check_writable(&c.dir).map_err(|e| match e {
        Error::Checkpoint(m) => Error::InvalidArgument(format!("checkpoint directory {m}")),
        other => other,
    })
}

/// Writes a checkpoint of `step` to `c` (every worker calls it: the checkpoint holds the
/// state's mean over replicas and workers, under ZeRO the optimizer state gathered from every
/// shard, under local SGD every worker's own parameters and state, and the rows of a table
/// store in this process; the chief writes it, atomic and verified).
pub fn save_checkpoint<M>(
    ext: &dyn StrategyExtended,
    model: &Replicated<M>,
    opt: &dyn StatefulOptimizer,
    c: &CheckpointConfig,
    step: usize,
) -> Result<()> {
    model.sync_state()?;
    let gathered = if opt.gathers_state() { Some(opt.state_tensors()?) } else { None };
    // Rows on ps tasks: checkpointed once every worker pushed its rows of the step, and before
    // any pushes a later one.
    if let Some(tables) = ext.options().tables.as_ref().filter(|t| t.checkpoints_elsewhere()) {
        let workers = ext.workers();
        // A worker's rows of the step it still holds go first; one that cannot send them does
        // not reach the barrier, so no checkpoint is written without them.
        tables.flush()?;
        if let Some(w) = workers {
            w.barrier()?;
        }
        let saved = if is_chief(ext) { tables.checkpoint(step as u64) } else { Ok(()) };
        if let Some(w) = workers {
            w.barrier()?;
        }
        saved?;
    }
    if !is_chief(ext) {
        return Ok(());
    }
    let _s = tracing::info_span!("checkpoint", step).entered();
    let mut entries: Vec<CheckpointTensor> = Vec::new();
    for (name, v) in model.variables(0) {
        // ZeRO stage 3 released it: brought back here, where a failure (a peer worker lost
        // while its runs are pulled) is this call's error, not a panic of the write, and
        // copied, since reading the next unit releases this one.
        let t = v.as_tensor();
        let value = if t.is_released() { t.make_resident().and_then(|()| t.copy())? } else { t.clone() };
        entries.push(CheckpointTensor::new(format!("model/{name}"), value));
    }
    let state = match gathered {
        Some(state) => state,
        None => opt.state_tensors()?,
    };
    for (name, t) in state {
        entries.push(CheckpointTensor::new(format!("optimizer/{name}"), t));
    }
    // Embedding rows a table store holds in this process.
    if let Some(tables) = &ext.options().tables {
        for (name, t) in tables.state_tensors()? {
            entries.push(CheckpointTensor::new(format!("{TABLES_PREFIX}{name}"), t));
        }
    }
    let mut meta = std::collections::BTreeMap::new();
    meta.insert("strategy".to_string(), ext.name().to_string());
    let dir = checkpoint::write_checkpoint(&c.dir, step as u64, &entries, &meta)?;
    checkpoint::keep_last(&c.dir, c.keep.max(1))?;
    tracing::info!(dir = %dir.display(), step, "checkpoint written");
    Ok(())
}

/// The prefix of a table store's tensors in a checkpoint ([`TableStore::state_tensors`]).
///
/// [`TableStore::state_tensors`]: crate::embedding::TableStore::state_tensors
pub const TABLES_PREFIX: &str = "tables/";

/// Loads the latest checkpoint of `c` (the chief reads it and hands it to every worker, so
/// the workers need no shared file system); returns its step, or `None` where the chief found
/// none (then nothing changed).
pub fn restore_latest<M>(
    ext: &dyn StrategyExtended,
    model: &Replicated<M>,
    opt: &dyn StatefulOptimizer,
    c: &CheckpointConfig,
) -> Result<Option<usize>> {
    let found = if is_chief(ext) { checkpoint::read_latest(&c.dir)? } else { None };
    // The local layout: the model's variables, then the optimizer's state, in a fixed order.
    let (vars, state) = state_layout(model, opt)?;
    // [1, step] when the chief found a checkpoint, [0, 0] when not: integers, bit for bit.
    let (mut header, mut values) = ([0u64; 2], Vec::new());
    if let Some(ck) = &found {
        header = [1, ck.step];
        let keys =
            vars.iter().map(|(n, t)| (n.clone(), t)).chain(state.iter().map(|(n, t)| (format!("optimizer/{n}"), t)));
        for (key, t) in keys {
            let saved = match ck.get(&key) {
                None if key.contains(crate::local_sgd::PREFIX) => {
                    return Err(Error::Checkpoint(format!(
                        "{}: holds no {key}, which a job under local SGD of these settings on this many workers writes; resume it with the settings and the number of workers it was written with",
                        ck.dir.display()
                    )))
                }
                _ => ck.tensor(&key)?,
            };
            if saved.dims() != t.dims() {
                return Err(Error::Checkpoint(format!(
                    "{}: {key} has shape {:?} but the model has {:?}; restore into the model that wrote it",
                    ck.dir.display(),
                    saved.dims(),
                    t.dims()
                )));
            }
            values.extend(saved.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        }
    }
    if let Some(w) = ext.workers() {
        w.broadcast_u64s(0, &mut header)?;
        if header[0] == 1 && found.is_none() {
            let len: usize = vars.iter().chain(state.iter()).map(|(_, t)| t.elem_count()).sum();
            values = vec![0f32; len];
        }
        if header[0] == 1 {
            w.broadcast(0, &mut values)?;
        }
    }
    let [found_one, step] = header;
    if found_one != 1 {
        return Ok(None);
    }
    // The rows of a table store in this process first: checked whole, so that a checkpoint
    // without them changes nothing.
    if let (Some(ck), Some(tables)) = (&found, &ext.options().tables) {
        tables.load_state_tensors(&ck.with_prefix(TABLES_PREFIX))?;
    }
    load_flat(model, opt, &vars, &state, &values)?;
    opt.set_iterations(step / opt.accumulation().max(1) as u64);
    Ok(Some(step as usize))
}

/// Resumes from the latest checkpoint of `c`, if any (see [`restore_latest`]), saying so on
/// standard error; returns its step, or 0.
pub fn resume<M>(
    ext: &dyn StrategyExtended,
    model: &Replicated<M>,
    opt: &dyn StatefulOptimizer,
    c: &CheckpointConfig,
) -> Result<usize> {
    let Some(step) = restore_latest(ext, model, opt, c)? else { return Ok(0) };
    tracing::info!(step, "resumed from a checkpoint");
    eprintln!("resumed from the checkpoint of step {step} in {}", c.dir.display());
    Ok(step)
}

/// The state a job carries, in a fixed order: the model's variables (copy 0), then the
/// optimizer's state.
fn state_layout<M>(model: &Replicated<M>, opt: &dyn StatefulOptimizer) -> Result<(NamedTensors, NamedTensors)> {
    let vars = model.variables(0).iter().map(|(n, v)| (format!("model/{n}"), v.as_tensor().clone())).collect();
    Ok((vars, opt.state_tensors()?))
}

/// Sets every copy of the model's variables and the optimizer's state from `values`, laid out
/// as [`state_layout`] says.
fn load_flat<M>(
    model: &Replicated<M>,
    opt: &dyn StatefulOptimizer,
    vars: &[(String, Tensor)],
    state: &[(String, Tensor)],
    values: &[f32],
) -> Result<()> {
    let mut at = 0;
    let mut take = |t: &Tensor| -> Result<Tensor> {
        let n = t.elem_count();
        let v = Tensor::from_slice(&values[at..at + n], t.shape(), t.device())?.to_dtype(t.dtype())?;
        at += n;
        Ok(v)
    };
    let new_vars: Vec<Tensor> = vars.iter().map(|(_, t)| take(t)).collect::<Result<_>>()?;
    let new_state: Vec<(String, Tensor)> =
        state.iter().map(|(n, t)| Ok((n.clone(), take(t)?))).collect::<Result<_>>()?;
    opt.begin_load();
    for copy in 0..model.num_copies() {
        for ((_, var), value) in model.variables(copy).iter().zip(&new_vars) {
            var.set(value)?;
        }
    }
    opt.load_state_tensors(&new_state)
}

/// The largest stop code any worker asks for (`mine` alone without workers): one all-reduce
/// of one number, so every worker decides alike. Every worker must call it at the same point
/// of its program. 0 means no worker asked to stop.
pub fn largest_stop_code(workers: Option<&dyn WorkerCollectives>, mine: u32) -> Result<u32> {
    let Some(w) = workers else { return Ok(mine) };
    // Codes are small integers: exact in an f32.
    let mut v = [mine.min(1 << 24) as f32];
    w.all_reduce(ReduceOp::Max, &mut v)?;
    Ok(v[0] as u32)
}

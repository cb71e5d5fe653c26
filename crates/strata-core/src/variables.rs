//! Distributed variables: how a model built inside [`Strategy::scope`](crate::Strategy::scope)
//! gets its variables, and the optimizers that update them.
//!
//! - **Mirrored** (Mirrored, OneDevice): every replica holds a copy of each variable; copies
//!   start identical and stay identical because every write is synchronised.
//! - **Central** (CentralStorage): one copy on the parameter device, read by every replica.
//! - **Sync-on-read** ([`SyncOnReadVariable`]): each replica updates its own value (metrics,
//!   counters); reading aggregates them with a [`VariableAggregation`].
//!
//! Initial values come from a seeded generator keyed by the variable's name, so the same model
//! under any strategy starts from the same parameters.
//!
//! # Kinds of variables, and what every strategy does with them
//!
//! Every variable of a model built in a scope has a [`VariableKind`]:
//!
//! | kind | made by | in a step | read (values, evaluation, checkpoints) |
//! |---|---|---|---|
//! | [`Trainable`](VariableKind::Trainable) | [`Scope::var_builder`] | its gradient is reduced over every replica and worker and the optimizer applies it, **if any replica (or worker) computed one**; a variable no replica computed a gradient for is neither reduced nor stepped (no decay, no moment or velocity update), as on one device; one that only some replicas computed a gradient for is reduced with zeros for the others | the value (every copy holds the same) |
//! | [`Frozen`](VariableKind::Frozen) | [`Scope::frozen_var_builder`], or [`Replicated::freeze`] by name | never reduced, never updated, no communication; made through the frozen builder, the model holds it detached, so backward does not even compute its gradient | the value |
//! | [`State`](VariableKind::State) | [`Scope::state_var_builder`], and every variable candle-nn's `batch_norm` names `running_mean` or `running_var` | each replica updates its own copy in its forward pass (TensorFlow's sync-on-read variables with `MEAN` aggregation); no optimizer touches it | the mean over the replicas (and, after [`Replicated::sync_state`], over the workers) |
//!
//! Per strategy: **Mirrored** and **OneDevice** keep a copy of every variable per replica;
//! **CentralStorage** keeps one copy of trainable and frozen variables and, for a model with
//! state, one copy of its state per replica (so no two replica threads write one copy);
//! **MultiWorkerMirrored** is Mirrored on every worker, with gradients and the presence of
//! gradients reduced across workers and [`Replicated::sync_state`] averaging state across
//! them. The parameter-server strategy's variables live on its ps tasks (see
//! `strata_strategies::parameter_server`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, Optimizer, VarBuilder};
use rand::{Rng, SeedableRng};

use crate::context::ReplicaContext;
use crate::cross_device::Destination;
use crate::device::candle_device;
use crate::extended::{StrategyExtended, StrategyId, VariablePolicy, WorkerCollectives};
use crate::scope::ScopeGuard;
use crate::{Error, ReduceOp, Result};

/// How per-replica values of a variable combine when it is read or written across replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VariableAggregation {
    /// The sum over replicas.
    Sum,
    /// The mean over replicas.
    Mean,
    /// The first replica's value (for counters every replica increments identically).
    OnlyFirstReplica,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A stable 64-bit hash (FNV-1a) of a variable name, for per-variable seeds.
fn name_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The values of `init` for `shape`, drawn from a generator seeded by `seed`.
pub fn init_values(init: &Init, shape: &Shape, seed: u64) -> Vec<f32> {
    let n = shape.elem_count();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let uniform = |rng: &mut rand_chacha::ChaCha8Rng, lo: f64, up: f64| -> Vec<f32> {
        (0..n).map(|_| (lo + (up - lo) * rng.random::<f64>()) as f32).collect()
    };
    let normal = |rng: &mut rand_chacha::ChaCha8Rng, mean: f64, std: f64| -> Vec<f32> {
        (0..n)
            .map(|_| {
                // Box-Muller
                let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
                let u2: f64 = rng.random();
                (mean + std * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
            })
            .collect()
    };
    match init {
        Init::Const(c) => vec![*c as f32; n],
        Init::Uniform { lo, up } => uniform(&mut rng, *lo, *up),
        Init::Randn { mean, stdev } => normal(&mut rng, *mean, *stdev),
        Init::Kaiming { dist, fan, non_linearity } => {
            let std = non_linearity.gain() / (fan.for_shape(shape).max(1) as f64).sqrt();
            match dist {
                candle_nn::init::NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    uniform(&mut rng, -bound, bound)
                }
                candle_nn::init::NormalOrUniform::Normal => normal(&mut rng, 0.0, std),
            }
        }
    }
}

/// What a variable is, which decides what a strategy does with it (see the
/// [module docs](self#kinds-of-variables-and-what-every-strategy-does-with-them)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum VariableKind {
    /// Updated by the optimizer from its gradient, reduced over every replica and worker.
    Trainable,
    /// Never reduced, never updated, never communicated (TensorFlow's `trainable=False`).
    Frozen,
    /// Non-trainable state that the forward pass updates (BatchNorm's running statistics):
    /// each replica updates its own copy; reading gives the mean over replicas (TensorFlow's
    /// sync-on-read variables with `MEAN` aggregation).
    State,
}

impl VariableKind {
    /// The kind of a variable made through a builder of `kind` (`None`: the plain builder):
    /// the names candle-nn's `batch_norm` gives its running statistics are state whatever
    /// the builder, everything else takes the builder's kind.
    fn of(name: &str, kind: Option<VariableKind>) -> VariableKind {
        let last = name.rsplit('.').next().unwrap_or(name);
        if matches!(last, "running_mean" | "running_var") {
            return VariableKind::State;
        }
        kind.unwrap_or(VariableKind::Trainable)
    }
}

/// One created variable: its name, the variable, its kind.
type Created = (String, Var, VariableKind);

/// The `VarBuilder` backend of a scope: creates (copy 0) or mirrors (other copies) variables;
/// under a central policy, copies after the first share copy 0's trainable and frozen
/// variables and get state of their own.
struct ScopeBackend {
    copy: usize,
    seed: u64,
    strategy: String,
    /// The kind this builder gives (`None`: trainable, or state by candle-nn's names).
    kind: Option<VariableKind>,
    open: Arc<AtomicBool>,
    created: Arc<Mutex<Vec<Created>>>,
    primary: Option<Arc<HashMap<String, Tensor>>>,
    /// Central copies after the first: copy 0's variables to share, by name.
    shared: Option<Arc<HashMap<String, (Var, VariableKind)>>>,
}

impl ScopeBackend {
    fn existing(&self, name: &str) -> Option<(Var, VariableKind)> {
        lock(&self.created).iter().find(|(n, _, _)| n == name).map(|(_, v, k)| (v.clone(), *k))
    }
}

/// What the model holds of a variable: a frozen one detached, so that backward computes no
/// gradient for it (the storage is the variable's, so assignments reach the model).
fn held(var: &Var, kind: VariableKind) -> Tensor {
    match kind {
        VariableKind::Frozen => var.as_tensor().detach(),
        VariableKind::Trainable | VariableKind::State => var.as_tensor().clone(),
    }
}

impl SimpleBackend for ScopeBackend {
    fn get(&self, s: Shape, name: &str, h: Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        if !self.open.load(Ordering::Acquire) {
            candle_core::bail!(
                "variable {name:?} created outside the scope of {}: create every variable inside strategy.scope(...)",
                self.strategy
            );
        }
        if let Some((v, kind)) = self.existing(name) {
            if v.shape() != &s {
                candle_core::bail!(
                    "variable {name:?} was created with shape {:?} and is now asked for with {:?}",
                    v.shape(),
                    s
                );
            }
            return Ok(held(&v, kind));
        }
        let kind = VariableKind::of(name, self.kind);
        if let Some(shared) = &self.shared {
            match shared.get(name) {
                Some((v, k)) if *k != VariableKind::State && v.shape() == &s => {
                    lock(&self.created).push((name.to_string(), v.clone(), *k));
                    return Ok(held(v, *k));
                }
                _ => {}
            }
        }
        let value = match &self.primary {
            None => Tensor::from_vec(init_values(&h, &s, name_seed(self.seed, name)), s.clone(), dev)?,
            Some(p) => match p.get(name) {
                Some(t) if t.shape() == &s => t.to_device(dev)?,
                Some(t) => candle_core::bail!(
                    "copy {} of the model asked for variable {name:?} with shape {:?} but copy 0 made it {:?}; the scope closure must build the same model every time",
                    self.copy, s, t.shape()
                ),
                None => candle_core::bail!(
                    "copy {} of the model created variable {name:?} that copy 0 did not; the scope closure must build the same model every time",
                    self.copy
                ),
            },
        };
        let var = Var::from_tensor(&value.to_dtype(dtype)?)?;
        lock(&self.created).push((name.to_string(), var.clone(), kind));
        Ok(held(&var, kind))
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> candle_core::Result<Tensor> {
        match self.existing(name) {
            Some((v, kind)) => Ok(held(&v, kind)),
            None => candle_core::bail!("variable {name:?} does not exist in this scope"),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.existing(name).is_some() || self.primary.as_ref().is_some_and(|p| p.contains_key(name))
    }
}

/// What the scope closure gets: `VarBuilder`s whose variables are created the strategy's way.
pub struct Scope<'a> {
    vb: VarBuilder<'static>,
    frozen: VarBuilder<'static>,
    state: VarBuilder<'static>,
    copy: usize,
    copies: usize,
    ext: &'a Arc<dyn StrategyExtended>,
}

impl std::fmt::Debug for Scope<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope").field("copy", &self.copy).field("copies", &self.copies).finish()
    }
}

impl Scope<'_> {
    /// The `VarBuilder` to build the model with (candle-nn layers take it unchanged): its
    /// variables are trainable, except the running statistics of candle-nn's `batch_norm`,
    /// which are [state](VariableKind::State).
    pub fn var_builder(&self) -> VarBuilder<'static> {
        self.vb.clone()
    }

    /// A `VarBuilder` whose variables are [frozen](VariableKind::Frozen) (Keras'
    /// `trainable = False`): the model holds them detached, so backward computes no gradient
    /// for them, and no strategy reduces, updates or communicates them. Running statistics
    /// made through it stay [state](VariableKind::State) (a frozen BatchNorm in training mode
    /// still updates them; run it with `forward_t(x, false)` to keep them too).
    pub fn frozen_var_builder(&self) -> VarBuilder<'static> {
        self.frozen.clone()
    }

    /// A `VarBuilder` whose variables are [state](VariableKind::State): updated by the model's
    /// own forward pass (with `Var::set`), per replica, and read as the mean over replicas.
    pub fn state_var_builder(&self) -> VarBuilder<'static> {
        self.state.clone()
    }

    /// The strategy whose scope this is, shared (for layers that keep it, such as
    /// `SyncBatchNorm`).
    pub fn strategy_arc(&self) -> Arc<dyn StrategyExtended> {
        self.ext.clone()
    }

    /// Which copy of the model is being built (always 0 for central variables).
    pub fn copy_index(&self) -> usize {
        self.copy
    }

    /// How many copies the strategy builds.
    pub fn num_copies(&self) -> usize {
        self.copies
    }

    /// The strategy whose scope this is.
    pub fn strategy(&self) -> &dyn StrategyExtended {
        self.ext.as_ref()
    }
}

/// A model built in a strategy's scope: one copy per replica (mirrored) or one shared copy
/// (central; with state, one copy per replica sharing the central variables). Get the
/// replica's copy with [`Replicated::on`].
#[derive(Debug)]
pub struct Replicated<M> {
    strategy: StrategyId,
    strategy_name: &'static str,
    policy: VariablePolicy,
    copies: Vec<M>,
    vars: Vec<Vec<(String, Var)>>,
    kinds: Vec<VariableKind>,
    /// The strategy's cross-worker collectives (for [`Replicated::sync_state`]).
    ext: Arc<dyn StrategyExtended>,
}

pub(crate) fn build_replicated<M>(
    ext: &Arc<dyn StrategyExtended>,
    mut build: impl FnMut(&Scope) -> candle_core::Result<M>,
) -> Result<Replicated<M>> {
    let _guard = ScopeGuard::enter(ext)?;
    let policy = ext.variable_policy();
    let mut n = match policy {
        VariablePolicy::Mirrored => ext.num_replicas(),
        VariablePolicy::Central { .. } => 1,
    };
    let open = Arc::new(AtomicBool::new(true));
    let devices = ext.replica_devices();
    let mut copies = Vec::with_capacity(n);
    let mut vars: Vec<Vec<(String, Var)>> = Vec::with_capacity(n);
    let mut kinds: Vec<VariableKind> = Vec::new();
    let mut primary: Option<Arc<HashMap<String, Tensor>>> = None;
    let mut shared: Option<Arc<HashMap<String, (Var, VariableKind)>>> = None;
    let mut copy = 0;
    while copy < n {
        let created = Arc::new(Mutex::new(Vec::new()));
        let backend = |kind| ScopeBackend {
            copy,
            seed: ext.options().seed,
            strategy: format!("{} {}", ext.name(), ext.id()),
            kind,
            open: open.clone(),
            created: created.clone(),
            primary: primary.clone(),
            shared: shared.clone(),
        };
        // Central copies after the first compute on copy 0's device, as the central variables.
        let device = if shared.is_some() { &devices[0] } else { &devices[copy] };
        let dev = candle_device(device)?;
        let vb = VarBuilder::from_backend(Box::new(backend(None)), DType::F32, dev.clone());
        let frozen = VarBuilder::from_backend(Box::new(backend(Some(VariableKind::Frozen))), DType::F32, dev.clone());
        let state = VarBuilder::from_backend(Box::new(backend(Some(VariableKind::State))), DType::F32, dev);
        let model = build(&Scope { vb, frozen, state, copy, copies: n, ext })?;
        let made = std::mem::take(&mut *lock(&created));
        if let Some(first) = vars.first() {
            let a: Vec<&str> = first.iter().map(|(n, _)| n.as_str()).collect();
            let b: Vec<&str> = made.iter().map(|(n, _, _)| n.as_str()).collect();
            if a != b {
                return Err(Error::Scope(format!(
                    "copy {copy} of the model created variables {b:?} but copy 0 created {a:?}; the scope closure must build the same model every time"
                )));
            }
        } else {
            let values = made.iter().map(|(n, v, _)| Ok((n.clone(), v.as_tensor().copy()?)));
            primary = Some(Arc::new(values.collect::<candle_core::Result<_>>()?));
            kinds = made.iter().map(|(_, _, k)| *k).collect();
            // Central state: one copy per replica, so that no two replica threads write one.
            if matches!(policy, VariablePolicy::Central { .. }) && kinds.contains(&VariableKind::State) {
                n = ext.num_replicas();
                shared = Some(Arc::new(made.iter().map(|(n, v, k)| (n.clone(), (v.clone(), *k))).collect()));
            }
        }
        copies.push(model);
        vars.push(made.into_iter().map(|(n, v, _)| (n, v)).collect());
        copy += 1;
    }
    open.store(false, Ordering::Release);
    // A worker that joined an elastic job under way takes its values from a member when it
    // takes part in its first step, not from a broadcast the members are not in.
    if let Some(w) = ext.workers().filter(|w| !w.joined_under_way()) {
        broadcast_from_chief(w, &vars)?;
    }
    Ok(Replicated { strategy: ext.id(), strategy_name: ext.name(), policy, copies, vars, kinds, ext: ext.clone() })
}

/// Whether `name` matches `pattern`, where `*` matches any run of characters (`backbone.*`,
/// `*.bias`, an exact name).
fn glob(pattern: &str, name: &str) -> bool {
    let (p, n) = (pattern.as_bytes(), name.as_bytes());
    let (mut pi, mut ni, mut star, mut mark) = (0, 0, None, 0);
    while ni < n.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some(pi);
            mark = ni;
            pi += 1;
        } else if pi < p.len() && p[pi] == n[ni] {
            pi += 1;
            ni += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ni = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

/// Multi-worker: the chief's initial values reach every worker before the first step (they
/// agree already when every worker seeds the same way; this makes it so whatever the model's
/// initialisers do).
fn broadcast_from_chief(w: &dyn WorkerCollectives, vars: &[Vec<(String, Var)>]) -> Result<()> {
    let Some(first) = vars.first() else { return Ok(()) };
    let mut data = Vec::new();
    for (_, v) in first {
        data.extend(v.as_tensor().to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
    }
    w.broadcast(0, &mut data)?;
    for copy in vars {
        let mut at = 0;
        for (_, v) in copy {
            let n = v.elem_count();
            let t = Tensor::from_slice(&data[at..at + n], v.shape(), v.device())?.to_dtype(v.dtype())?;
            v.set(&t)?;
            at += n;
        }
    }
    Ok(())
}

impl<M> Replicated<M> {
    fn check(&self, ctx: &ReplicaContext<'_>) -> Result<()> {
        if ctx.strategy_id() != self.strategy {
            return Err(Error::Scope(format!(
                "a model built in the scope of {} {} was used in a step of {} {}; build it inside the scope of the strategy that runs it",
                self.strategy_name,
                self.strategy,
                ctx.strategy().name(),
                ctx.strategy_id()
            )));
        }
        Ok(())
    }

    /// The copy a replica computes with.
    pub fn on(&self, ctx: &ReplicaContext<'_>) -> Result<&M> {
        self.check(ctx)?;
        Ok(self.copies.get(ctx.replica_id()).unwrap_or(&self.copies[0]))
    }

    /// The first copy, for cross-replica reads (evaluation, checkpoints). Its
    /// [state](VariableKind::State) is replica 0's own until [`Replicated::sync_state`] makes
    /// every copy hold the mean.
    pub fn primary(&self) -> &M {
        &self.copies[0]
    }

    /// The number of copies of the model (one per replica, or one for a central model
    /// without state).
    pub fn num_copies(&self) -> usize {
        self.copies.len()
    }

    /// The kind of every variable, in creation order.
    pub fn kinds(&self) -> &[VariableKind] {
        &self.kinds
    }

    /// The kind of variable `name`.
    pub fn kind(&self, name: &str) -> Option<VariableKind> {
        self.vars[0].iter().position(|(n, _)| n == name).map(|i| self.kinds[i])
    }

    /// Freezes every trainable variable whose name matches one of `patterns` (`*` matches any
    /// run of characters: `backbone.*`, `*.bias`, an exact name): optimizers made afterwards
    /// ([`Replicated::optimizer`]) leave them out, so they are never reduced, updated or
    /// communicated. The model still computes their gradients (use
    /// [`Scope::frozen_var_builder`] to spare that too). A pattern that matches no variable is
    /// an error naming it.
    pub fn freeze(&mut self, patterns: &[&str]) -> Result<()> {
        for p in patterns {
            if !self.vars[0].iter().any(|(n, _)| glob(p, n)) {
                let names: Vec<&str> = self.vars[0].iter().map(|(n, _)| n.as_str()).collect();
                return Err(Error::NoSuchVariable { pattern: p.to_string(), variables: names.join(", ") });
            }
        }
        for ((name, _), kind) in self.vars[0].iter().zip(self.kinds.iter_mut()) {
            if *kind == VariableKind::Trainable && patterns.iter().any(|p| glob(p, name)) {
                *kind = VariableKind::Frozen;
            }
        }
        Ok(())
    }

    /// Copy `copy`'s trainable variables, by name, in creation order (what an optimizer made
    /// now would update).
    pub fn trainable_variables(&self, copy: usize) -> Vec<(String, Var)> {
        self.of_kind(copy, VariableKind::Trainable)
    }

    fn of_kind(&self, copy: usize, kind: VariableKind) -> Vec<(String, Var)> {
        self.vars[copy].iter().zip(&self.kinds).filter(|(_, k)| **k == kind).map(|(v, _)| v.clone()).collect()
    }

    /// Makes every copy's [state](VariableKind::State) the mean over the replicas and, in a
    /// multi-worker job, over the workers (a collective there: every worker calls it at the
    /// same point). Cross-replica context. Evaluation and checkpoints then read the mean from
    /// any copy. Since state such as BatchNorm's running statistics is updated linearly
    /// (an exponential moving average), averaging the copies at any point leaves the mean of
    /// later reads as if each replica had kept its own.
    pub fn sync_state(&self) -> Result<()> {
        let idx: Vec<usize> = (0..self.kinds.len()).filter(|&i| self.kinds[i] == VariableKind::State).collect();
        if idx.is_empty() {
            return Ok(());
        }
        let mut means = Vec::with_capacity(idx.len());
        for &i in &idx {
            means.push(self.local_mean(i)?);
        }
        if let Some(w) = self.ext.workers() {
            let mut flat = Vec::new();
            for m in &means {
                flat.extend(m.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
            }
            w.all_reduce(ReduceOp::Mean, &mut flat)?;
            let mut at = 0;
            for m in &mut means {
                let k = m.elem_count();
                *m = Tensor::from_slice(&flat[at..at + k], m.shape(), m.device())?.to_dtype(m.dtype())?;
                at += k;
            }
        }
        for (&i, mean) in idx.iter().zip(&means) {
            for copy in &self.vars {
                let v = &copy[i].1;
                v.set(&mean.to_device(v.device())?.to_dtype(v.dtype())?)?;
            }
        }
        Ok(())
    }

    /// The mean over this worker's copies of variable `i` (its value where all copies are one).
    fn local_mean(&self, i: usize) -> Result<Tensor> {
        let first = self.vars[0][i].1.as_tensor();
        if self.vars.len() == 1 || self.kinds[i] != VariableKind::State {
            return Ok(first.copy()?);
        }
        let mut sum = first.to_dtype(DType::F32)?;
        for copy in &self.vars[1..] {
            sum = (sum + copy[i].1.as_tensor().to_device(first.device())?.to_dtype(DType::F32)?)?;
        }
        Ok((sum / self.vars.len() as f64)?.to_dtype(first.dtype())?)
    }

    /// The strategy that built this model.
    pub fn strategy_id(&self) -> StrategyId {
        self.strategy
    }

    /// Where the variables live.
    pub fn policy(&self) -> VariablePolicy {
        self.policy
    }

    /// Copy `copy`'s variables, by name, in creation order.
    pub fn variables(&self, copy: usize) -> &[(String, Var)] {
        &self.vars[copy]
    }

    /// The variable `name` with all its copies (one for a central variable; central state has
    /// one per replica).
    pub fn variable(&self, name: &str) -> Option<DistributedVariable> {
        let i = self.vars[0].iter().position(|(n, _)| n == name)?;
        let central = matches!(self.policy, VariablePolicy::Central { .. });
        let (policy, copies) = if central && self.kinds[i] != VariableKind::State {
            (self.policy, vec![self.vars[0][i].1.clone()])
        } else if central {
            (VariablePolicy::Mirrored, self.vars.iter().map(|v| v[i].1.clone()).collect())
        } else {
            (self.policy, self.vars.iter().map(|v| v[i].1.clone()).collect())
        };
        Some(DistributedVariable { name: name.to_string(), policy, copies })
    }

    /// The values, by name: the primary copy's, and for [state](VariableKind::State) the mean
    /// over this worker's copies (call [`Replicated::sync_state`] first in a multi-worker job
    /// for the mean over every worker).
    pub fn values(&self) -> Result<Vec<(String, Tensor)>> {
        self.vars[0].iter().enumerate().map(|(i, (n, _))| Ok((n.clone(), self.local_mean(i)?))).collect()
    }

    /// Builds one optimizer per copy of the [trainable](VariableKind::Trainable) variables
    /// (candle-nn's `SGD`, `AdamW`, Strata's fused optimizers, or any `Optimizer`): one per
    /// replica for mirrored variables, one for central ones. Frozen variables and state are
    /// left out.
    pub fn optimizer<O: Optimizer>(&self, config: O::Config) -> Result<DistributedOptimizer<O>>
    where
        O::Config: Clone,
    {
        let n = match self.policy {
            VariablePolicy::Mirrored => self.vars.len(),
            VariablePolicy::Central { .. } => 1,
        };
        let vars: Vec<Vec<Var>> =
            (0..n).map(|c| self.trainable_variables(c).into_iter().map(|(_, v)| v).collect()).collect();
        if let Some(first) = vars.first() {
            let shapes: Vec<&[usize]> = first.iter().map(|v| v.dims()).collect();
            self.ext.cross_device_ops().check_gradients(&shapes)?;
        }
        let stage = self.ext.options().zero_stage;
        let shards = match stage {
            crate::ZeroStage::Off => None,
            _ => Some(self.shards::<O>(stage, &vars)?),
        };
        let params: Vec<u64> = (0..n)
            .map(|c| self.vars[c].iter().map(|(_, v)| (v.elem_count() * v.dtype().size_in_bytes()) as u64).sum())
            .collect();
        check_memory_limits::<O>(&*self.ext, self.policy, stage, &params, &vars)?;
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
        opt.shards = std::sync::RwLock::new(shards.map(Arc::new));
        opt.params_bytes = params;
        Ok(opt)
    }

    /// ZeRO's shards of `vars` (every local copy's trainable variables) over every replica in
    /// sync, refusing what cannot run on shards.
    fn shards<O: Optimizer>(&self, stage: crate::ZeroStage, vars: &[Vec<Var>]) -> Result<crate::zero::Shards> {
        let refuse = |what: String, fix: &'static str| Error::ZeroStage { stage: stage.number(), what, fix };
        if self.policy != VariablePolicy::Mirrored {
            return Err(refuse(
                format!("the {} strategy", self.strategy_name),
                "its one central copy is stepped once; use stage 0, or mirrored",
            ));
        }
        if !crate::zero::shardable::<O>() {
            return Err(refuse(
                format!("the optimizer {}", std::any::type_name::<O>()),
                "it steps whole variables; use strata's FusedAdamW, FusedSgd or FusedMomentum, which step any run of a variable's elements",
            ));
        }
        lay_out_shards(stage, vars, self.ext.clone())
    }
}

/// Refuses a replica whose device has a `memory_limit` its model state exceeds at `stage` over
/// the replicas in sync now: every variable's copy (`params[c]` bytes for copy `c`), the
/// gradients of the trainable ones `vars` (its shard's at stage 2) and the optimizer's state
/// (its shard's at stages 1 and 2), naming the lowest stage that fits. Called when the
/// optimizer is built and again when an elastic job's shards are laid out over a new
/// membership (fewer workers, larger shards).
fn check_memory_limits<O: Optimizer>(
    ext: &dyn StrategyExtended,
    policy: VariablePolicy,
    stage: crate::ZeroStage,
    params: &[u64],
    vars: &[Vec<Var>],
) -> Result<()> {
    let devices = ext.replica_devices();
    let in_sync = ext.num_replicas_in_sync().max(1) as u64;
    let per_element = crate::zero::state_per_element::<O>();
    for (c, copy) in vars.iter().enumerate() {
        let Some(limit) = devices.get(c).and_then(|d| d.kind.memory_limit()) else { continue };
        let params = params.get(c).copied().unwrap_or(0);
        let trainable: u64 = copy.iter().map(|v| v.elem_count() as u64).sum();
        let size = copy.first().map_or(4, |v| v.dtype().size_in_bytes()) as u64;
        let shard = trainable.div_ceil(in_sync);
        // Gradient and state bytes at stage 0, 1 and 2; central copies are never sharded.
        let need = |s: u8| {
            let sharded = policy == VariablePolicy::Mirrored;
            let grads = if s >= 2 && sharded { shard } else { trainable } * size;
            let state = if s >= 1 && sharded { shard } else { trainable } * per_element * size;
            (grads, state)
        };
        let (grads, state) = need(stage.number());
        if params + grads + state <= limit {
            continue;
        }
        let total = |s: u8| {
            let (g, st) = need(s);
            params + g + st
        };
        let fits = (stage.number() + 1..=2).find(|&s| total(s) <= limit).map(|s| (s, total(s)));
        return Err(Error::MemoryLimit(Box::new(crate::MemoryLimitExceeded {
            replica: c,
            device: devices[c].spec.to_string(),
            stage: stage.number(),
            params,
            grads,
            state,
            limit,
            fits,
            least: total(2),
        })));
    }
    Ok(())
}

/// ZeRO's shards of `vars` (every local copy's trainable variables) over every replica in
/// sync now (in an elastic job, of the current membership).
fn lay_out_shards(
    stage: crate::ZeroStage,
    vars: &[Vec<Var>],
    ext: Arc<dyn StrategyExtended>,
) -> Result<crate::zero::Shards> {
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
        let layout = crate::zero::segment_layout(&plan.unit_runs(copy), w.num_workers(), local, |len, g| {
            w.scatter_segment(len, g)
        });
        if layout.iter().all(|s| !s.is_empty()) {
            return crate::zero::Shards::new(stage, vars, first, layout, true, ext.clone());
        }
    }
    let layout = crate::zero::even_layout(&sizes, ext.num_replicas_in_sync());
    crate::zero::Shards::new(stage, vars, first, layout, false, ext)
}

/// One variable with its copies: mirrored (one per replica) or central (one).
#[derive(Clone, Debug)]
pub struct DistributedVariable {
    name: String,
    policy: VariablePolicy,
    copies: Vec<Var>,
}

impl DistributedVariable {
    /// The variable's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The value (the primary copy).
    pub fn value(&self) -> Tensor {
        self.copies[0].as_tensor().clone()
    }

    /// Every copy (one for a central variable).
    pub fn copies(&self) -> &[Var] {
        &self.copies
    }

    /// Cross-replica write: sets every copy to `value` (mirrored variables stay identical).
    pub fn assign(&self, value: &Tensor) -> Result<()> {
        for v in &self.copies {
            if v.shape() != value.shape() {
                return Err(Error::ShapeMismatch {
                    op: format!("assign to {}", self.name),
                    detail: format!("variable has shape {:?}, value has {:?}", v.shape(), value.shape()),
                });
            }
            v.set(&value.to_device(v.device())?.to_dtype(v.dtype())?)?;
        }
        Ok(())
    }

    /// Replica-context write: every replica passes its value; they are combined by
    /// `aggregation` and the result written to every copy, so copies stay identical.
    pub fn assign_on_replica(
        &self,
        ctx: &ReplicaContext<'_>,
        value: &Tensor,
        aggregation: VariableAggregation,
    ) -> Result<()> {
        let combined = match aggregation {
            VariableAggregation::Sum => ctx.all_reduce(ReduceOp::Sum, value)?,
            VariableAggregation::Mean => ctx.all_reduce(ReduceOp::Mean, value)?,
            VariableAggregation::OnlyFirstReplica => {
                ctx.merge_call(value.clone(), |_, all| Ok(all.values()[0].clone()))?
            }
        };
        match self.policy {
            VariablePolicy::Mirrored => {
                let v = &self.copies[ctx.replica_id()];
                v.set(&combined.to_device(v.device())?.to_dtype(v.dtype())?)?;
            }
            VariablePolicy::Central { parameter_replica } => {
                if ctx.replica_id() == parameter_replica {
                    self.copies[0].set(&combined.to_dtype(self.copies[0].dtype())?)?;
                }
                ctx.barrier()?;
            }
        }
        Ok(())
    }
}

/// An overlap plan and the generation of the job's membership it was agreed in.
type AgreedPlan = (u64, Arc<OverlapPlan>);

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
    steps: Vec<std::sync::atomic::AtomicU64>,
    clip_global_norm: Option<f64>,
    schedule: Option<crate::optim::schedule::LrSchedule>,
    /// Micro-batches per optimizer step (1: none accumulated).
    accumulation: usize,
    /// Each local replica's accumulated gradients.
    accumulated: Vec<Mutex<Accumulated>>,
    /// Each local replica's plan of overlapped reduction, learned in the first step.
    /// Each replica's overlap plan, with the generation of the job's membership it was agreed
    /// in (an elastic job agrees a new plan in every generation).
    overlap: Vec<Mutex<Option<AgreedPlan>>>,
    /// ZeRO's shards, when the strategy's [`ZeroStage`](crate::ZeroStage) is not `Off`: then
    /// each copy's optimizer is built over its replica's pieces of the variables only. An
    /// elastic job lays them out again when its membership changes ([`Self::reshard`]).
    shards: std::sync::RwLock<Option<Arc<crate::zero::Shards>>>,
    /// The bytes of every variable of each copy (trainable or not), for the memory limit's
    /// check at a re-split ([`Self::reshard`]).
    params_bytes: Vec<u64>,
}

/// How a replica reduces its gradients while the backward pass runs: the order in which the
/// gradients became ready in a step without overlap (the first, or one after the variables
/// with gradients changed), agreed by every replica and worker, cut into buckets that are
/// reduced in that order, each as soon as its last gradient is final.
#[derive(Debug)]
struct OverlapPlan {
    /// Indices of the optimizer's variables, in the order the buckets take them.
    order: Vec<usize>,
    /// The buckets, as ranges of `order`.
    buckets: Vec<crate::cross_device::Bucket>,
    /// Each variable's bucket (by variable index), if the plan has the variable in one.
    bucket_of: Vec<Option<usize>>,
    /// Each variable's rows per block, for a weight whose gradient is reduced in blocks of
    /// rows, each as soon as the backward pass has computed it (outside the buckets).
    rows_of: Vec<Option<usize>>,
    /// The reductions of a step, in the order every replica and worker starts them.
    units: Vec<Unit>,
    /// A variable's index by the id of this replica's copy of it.
    index: HashMap<candle_core::TensorId, usize>,
}

/// One reduction of an overlapped step.
#[derive(Clone, Copy, Debug)]
enum Unit {
    /// A bucket of whole gradients.
    Bucket(usize),
    /// Rows `first..first + rows` of variable `var`'s gradient.
    Rows { var: usize, first: usize, rows: usize },
}

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

/// The smallest bucket an overlapped step across workers cuts its gradient into (DDP's first
/// bucket).
const MIN_SPLIT_BUCKET_BYTES: usize = 1024 * 1024;

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
    shards: Option<(&'a crate::zero::Shards, usize)>,
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
        shards: &crate::zero::Shards,
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

/// The plan ZeRO's shards across workers are laid out on, and every step there follows: the
/// variables in the reverse of their order (the order a backward pass mostly makes them final
/// in), fixed from the optimizer's creation.
fn fixed_plan(
    ext: &dyn StrategyExtended,
    vars: &[Var],
    index: HashMap<candle_core::TensorId, usize>,
    shards_gradients: bool,
) -> OverlapPlan {
    cut_plan(ext, (0..vars.len()).rev().collect(), vars, index, shards_gradients)
}

/// The plan of an overlapped step that reduces the variables in `order`: `vars` (a replica's
/// copy of the optimizer's variables, `index` naming them by id) in buckets of the strategy's
/// size, a large matrix's gradient in blocks of rows where the ops take them.
fn cut_plan(
    ext: &dyn StrategyExtended,
    order: Vec<usize>,
    vars: &[Var],
    index: HashMap<candle_core::TensorId, usize>,
    shards_gradients: bool,
) -> OverlapPlan {
    // Across workers, and at ZeRO stage 2 (which then never holds a large matrix's whole
    // gradient), with ops that reduce blocks of rows as they reduce whole gradients, a
    // large matrix's gradient goes in blocks of rows; the variables between two such
    // matrices go in buckets.
    let ops = ext.cross_device_ops();
    let block_bytes = ext.options().row_block_bytes;
    let by_rows = (ext.workers().is_some() || shards_gradients) && ops.takes_row_blocks() && block_bytes > 0;
    let mut rows_of: Vec<Option<usize>> = vec![None; vars.len()];
    for &i in order.iter().filter(|_| by_rows) {
        if let &[rows, cols] = vars[i].dims() {
            let n = (block_bytes / (cols * std::mem::size_of::<f32>()).max(1)).max(1);
            rows_of[i] = (rows >= 2 * n).then_some(n);
        }
    }
    // Across workers, where a bucket's bytes take time to cross, the buckets are also at
    // most an eighth of the gradient (at least 1 MiB), so that a model of a few megabytes
    // does not wait for the whole backward pass before its first bucket starts.
    let mut bucket_bytes = ext.options().bucket_bytes;
    if ext.workers().is_some() && bucket_bytes > 0 {
        let total: usize = order.iter().map(|&i| vars[i].elem_count() * std::mem::size_of::<f32>()).sum();
        bucket_bytes = bucket_bytes.min((total / 8).max(MIN_SPLIT_BUCKET_BYTES));
    }
    let (mut buckets, mut units, mut bucket_of) = (Vec::new(), Vec::new(), vec![None; vars.len()]);
    let mut start = 0;
    for end in 0..=order.len() {
        let split = order.get(end).and_then(|&i| rows_of[i].map(|n| (i, n)));
        if end < order.len() && split.is_none() {
            continue;
        }
        let sizes: Vec<usize> = order[start..end].iter().map(|&i| vars[i].elem_count()).collect();
        for bucket in crate::cross_device::plan_buckets(&sizes, bucket_bytes) {
            let tensors = start + bucket.tensors.start..start + bucket.tensors.end;
            for &i in &order[tensors.clone()] {
                bucket_of[i] = Some(buckets.len());
            }
            units.push(Unit::Bucket(buckets.len()));
            buckets.push(crate::cross_device::Bucket { tensors, elements: bucket.elements });
        }
        if let Some((var, n)) = split {
            let total = vars[var].dims()[0];
            units.extend((0..total).step_by(n).map(|first| Unit::Rows { var, first, rows: n.min(total - first) }));
        }
        start = end + 1;
    }
    OverlapPlan { order, buckets, bucket_of, rows_of, units, index }
}

impl OverlapPlan {
    /// The runs of the variables each unit reduces, one after another, in the order they are
    /// started (ZeRO across workers lays its shards out on them).
    fn unit_runs(&self, vars: &[Var]) -> Vec<Vec<crate::zero::Run>> {
        use crate::zero::Run;
        self.units
            .iter()
            .map(|u| match *u {
                Unit::Bucket(b) => self.order[self.buckets[b].tensors.clone()]
                    .iter()
                    .map(|&var| Run { var, start: 0, len: vars[var].elem_count() })
                    .collect(),
                Unit::Rows { var, first, rows } => {
                    let cols = vars[var].dims().get(1).copied().unwrap_or(1);
                    vec![Run { var, start: first * cols, len: rows * cols }]
                }
            })
            .collect()
    }
}

/// A replica's gradients summed over the micro-batches of an optimizer step so far.
#[derive(Debug, Default)]
struct Accumulated {
    /// Per variable of the optimizer: the sum of each micro-batch's gradient times its examples
    /// on this replica.
    grads: Vec<Option<Tensor>>,
    /// Micro-batches so far.
    micro_batches: usize,
    /// Examples of the micro-batches' global batches so far.
    examples: usize,
}

impl<O: Optimizer + crate::checkpoint::OptimizerState> DistributedOptimizer<O> {
    /// The optimizer's state as one optimizer over the whole model saves it (copy 0's at
    /// stage 0): under ZeRO every replica's shard of it gathered, so that a checkpoint resumes
    /// at any stage on any number of replicas and workers. Under ZeRO across workers every
    /// worker must call it (an all-gather).
    pub fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        match self.zero() {
            None => self.lock(0).state_tensors(),
            Some(shards) => {
                let states = (0..self.copies.len()).map(|c| self.lock(c).state_tensors()).collect::<Result<_>>()?;
                shards.gather_state(states)
            }
        }
    }

    /// Loads `state` (as [`Self::state_tensors`] gives it, at any stage) into every copy:
    /// under ZeRO each copy takes its shard of it. Nothing changes where a copy refuses it.
    pub fn load_state_tensors(&self, state: &[(String, Tensor)]) -> Result<()> {
        let cut: Vec<Vec<(String, Tensor)>> = match self.zero() {
            None => vec![state.to_vec(); self.copies.len()],
            Some(shards) => (0..self.copies.len()).map(|c| shards.cut_state(c, state)).collect::<Result<_>>()?,
        };
        for (c, state) in cut.iter().enumerate() {
            self.lock(c).load_state_tensors(state)?;
        }
        Ok(())
    }

    /// Whether the optimizer keeps state across steps (AdamW's moments, momentum's velocity;
    /// plain SGD keeps none). Local: copy 0's.
    pub fn keeps_state(&self) -> Result<bool> {
        Ok(!self.lock(0).state_tensors()?.is_empty())
    }

    /// ZeRO in an elastic job, after its membership changed: lays the shards out again over
    /// every replica of the current membership, and gives each copy a new optimizer over its
    /// new shard, of the same settings and with fresh state. Load the whole state
    /// ([`Self::load_state_tensors`]) after it. Every worker calls it, and nothing collective
    /// runs in it. Returns whether there were shards to lay out (none at stage 0).
    pub fn reshard(&self) -> Result<bool> {
        let Some(old) = self.zero() else { return Ok(false) };
        // Fewer workers mean larger shards: refused, before anything changes, where they no
        // longer fit a replica's memory limit.
        check_memory_limits::<O>(&**old.ext(), self.policy, old.stage(), &self.params_bytes, &self.vars)?;
        let new = lay_out_shards(old.stage(), &self.vars, old.ext().clone())?;
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
        *self.shards.write().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(new));
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
            steps: copies.iter().map(|_| std::sync::atomic::AtomicU64::new(0)).collect(),
            copies,
            vars,
            clip_global_norm: None,
            schedule: None,
            accumulation: 1,
            accumulated: (0..replicas.max(1)).map(|_| Mutex::new(Accumulated::default())).collect(),
            overlap: (0..replicas.max(1)).map(|_| Mutex::new(None)).collect(),
            shards: Default::default(),
            params_bytes: Vec::new(),
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
    pub fn with_schedule(mut self, schedule: crate::optim::schedule::LrSchedule) -> Result<Self> {
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
        self.steps[0].load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets the optimizer steps applied so far on every copy, which a
    /// [schedule](Self::with_schedule) reads: after a restore from a checkpoint of step `n`
    /// (or a worker that joined an elastic job at step `n`), `n` divided by the accumulation.
    pub fn set_iterations(&self, n: u64) {
        for s in &self.steps {
            s.store(n, std::sync::atomic::Ordering::Relaxed);
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
        let step = self.steps[copy].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut opt = self.lock(copy);
        if let Some(s) = &self.schedule {
            opt.set_learning_rate(s.at(step));
        }
        if let Some(shards) = self.zero() {
            // Only the shard's runs of `grads` hold the reduced gradient: the clipping norm is
            // summed over every replica's shard.
            return shards.step(ctx, copy, &self.vars[copy], grads, self.clip_global_norm, &mut *opt);
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

    /// ZeRO's shards as they are laid out now (`None` at stage 0).
    pub(crate) fn zero(&self) -> Option<Arc<crate::zero::Shards>> {
        self.shards.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Whether each replica keeps the reduced gradient of its shard only (ZeRO stage 2).
    fn shards_gradients(&self) -> bool {
        self.zero().is_some_and(|s| s.stage().shards_gradients())
    }

    /// The ZeRO stage this optimizer runs ([`ZeroStage::Off`](crate::ZeroStage::Off) unless
    /// the strategy's options asked for one).
    pub fn zero_stage(&self) -> crate::ZeroStage {
        self.zero().map_or(crate::ZeroStage::Off, |s| s.stage())
    }

    /// The elements of the variables copy `copy`'s optimizer steps and keeps state for: its
    /// replica's shard under ZeRO, every trainable element otherwise.
    pub fn stepped_elements(&self, copy: usize) -> usize {
        match self.zero() {
            Some(s) => s.elements(copy),
            None => self.vars[copy].iter().map(|v| v.elem_count()).sum(),
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
    pub fn backward_and_sync<O: Optimizer>(&self, loss: &Tensor, opt: &DistributedOptimizer<O>) -> Result<()> {
        let reduces = self.shared.group.num_replicas() > 1 || self.shared.ext.workers().is_some();
        if !reduces || opt.accumulation > 1 || !self.shared.ext.options().overlap {
            let grads = self.backward_phase(|| loss.backward())?;
            return self.sync_and_apply(grads, opt);
        }
        opt.check_strategy(self)?;
        let generation = self.shared.ext.workers().map_or(0, |w| w.generation());
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
        if opt.shards_gradients() && self.shared.ext.workers().is_none() {
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
        self.sync_and_apply(grads, opt)
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
        let order: Vec<usize> = match self.shared.ext.workers() {
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
        opt.check_strategy(self)?;
        let n = self.shared.group.num_replicas();
        let policy = opt.policy();
        let copy = match policy {
            VariablePolicy::Mirrored => self.replica,
            VariablePolicy::Central { .. } => 0,
        };
        let vars = opt.vars(copy);
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
        if n == 1 && self.shared.ext.workers().is_none() {
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
            && self.shared.ext.workers().is_none()
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

/// A variable each replica updates on its own and that is aggregated when read: metrics and
/// counters (TensorFlow's `SyncOnReadVariable`).
#[derive(Debug)]
pub struct SyncOnReadVariable {
    strategy: StrategyId,
    aggregation: VariableAggregation,
    initial: Tensor,
    values: Vec<Mutex<Tensor>>,
}

impl SyncOnReadVariable {
    /// A variable of `strategy`, every replica's value starting at `initial`.
    pub fn new(strategy: &dyn StrategyExtended, initial: Tensor, aggregation: VariableAggregation) -> Self {
        let values = (0..strategy.num_replicas()).map(|_| Mutex::new(initial.clone())).collect();
        Self { strategy: strategy.id(), aggregation, initial, values }
    }

    fn slot(&self, ctx: &ReplicaContext<'_>) -> Result<&Mutex<Tensor>> {
        if ctx.strategy_id() != self.strategy {
            return Err(Error::Scope(format!(
                "a sync-on-read variable of strategy {} was updated in a step of strategy {}; create it with the strategy that runs the step",
                self.strategy,
                ctx.strategy_id()
            )));
        }
        Ok(&self.values[ctx.replica_id()])
    }

    /// Adds `delta` to this replica's value.
    pub fn assign_add(&self, ctx: &ReplicaContext<'_>, delta: &Tensor) -> Result<()> {
        let mut v = lock(self.slot(ctx)?);
        if v.shape() != delta.shape() {
            return Err(Error::ShapeMismatch {
                op: "sync-on-read assign_add".into(),
                detail: format!("variable has shape {:?}, delta has {:?}", v.shape(), delta.shape()),
            });
        }
        *v = v.add(&delta.to_dtype(v.dtype())?)?;
        Ok(())
    }

    /// Sets this replica's value.
    pub fn assign(&self, ctx: &ReplicaContext<'_>, value: &Tensor) -> Result<()> {
        *lock(self.slot(ctx)?) = value.clone();
        Ok(())
    }

    /// Cross-replica read: the replicas' values combined by the aggregation.
    pub fn read(&self) -> Result<Tensor> {
        let vals: Vec<Tensor> = self.values.iter().map(|v| lock(v).clone()).collect();
        Ok(match self.aggregation {
            VariableAggregation::OnlyFirstReplica => vals[0].clone(),
            VariableAggregation::Sum => Tensor::stack(&vals, 0)?.sum(0)?,
            VariableAggregation::Mean => Tensor::stack(&vals, 0)?.mean(0)?,
        })
    }

    /// Every replica's value back to the initial one.
    pub fn reset(&self) {
        for v in &self.values {
            *lock(v) = self.initial.clone();
        }
    }
}

//! Distributed variables: how a model built inside [`Strategy::scope`](crate::Strategy::scope)
//! gets its variables (the scope's seeded `VarBuilder` backend, [`Scope`], [`Replicated`]),
//! one variable with its copies ([`DistributedVariable`]) and variables aggregated when read
//! ([`SyncOnReadVariable`]).
//!
//! This module must not know how variables are updated: the optimizer over them is
//! [`distributed_optimizer`](crate::distributed_optimizer), a step's reductions `overlap`,
//! ZeRO's shards `zero`.
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

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use rand::{Rng, SeedableRng};

use crate::context::ReplicaContext;
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

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
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
    /// Initial values given by [`Scope::var_from_values`] for the variable about to be made.
    given: Arc<Mutex<HashMap<String, Vec<f32>>>>,
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
        let given = lock(&self.given).remove(name);
        let value = match &self.primary {
            None => {
                let values = given.unwrap_or_else(|| init_values(&h, &s, name_seed(self.seed, name)));
                Tensor::from_vec(values, s.clone(), dev)?
            }
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
    given: Arc<Mutex<HashMap<String, Vec<f32>>>>,
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

    /// The seed every variable's initial value is drawn from ([`StrategyOptions::seed`](crate::StrategyOptions::seed)).
    pub fn seed(&self) -> u64 {
        self.ext.options().seed
    }

    /// A trainable variable `name` (the full name, no `VarBuilder` prefix) of `shape` whose
    /// initial values `fill` writes (row-major, f32), for layers whose values must not depend
    /// on the strategy's generator, such as [`Embedding`](crate::embedding_layer::Embedding)'s
    /// rows. `fill` runs once, for the first copy of the model; the other copies take the
    /// first's values, as every variable's. An existing variable of that name is returned as
    /// it is.
    pub fn var_from_values(
        &self,
        name: &str,
        shape: impl Into<Shape>,
        fill: impl FnOnce(&mut [f32]),
    ) -> candle_core::Result<Tensor> {
        let shape: Shape = shape.into();
        if self.copy == 0 && !self.vb.contains_tensor(name) {
            let mut values = vec![0f32; shape.elem_count()];
            fill(&mut values);
            lock(&self.given).insert(name.to_string(), values);
        }
        let t = self.vb.get_with_hints(shape, name, Init::Const(0.0));
        lock(&self.given).remove(name);
        t
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
    pub(crate) strategy: StrategyId,
    pub(crate) strategy_name: &'static str,
    pub(crate) policy: VariablePolicy,
    copies: Vec<M>,
    pub(crate) vars: Vec<Vec<(String, Var)>>,
    kinds: Vec<VariableKind>,
    /// The strategy (its cross-worker collectives for [`Replicated::sync_state`], its options
    /// for the optimizer).
    pub(crate) ext: Arc<dyn StrategyExtended>,
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
        let given = Arc::new(Mutex::new(HashMap::new()));
        let backend = |kind| ScopeBackend {
            copy,
            seed: ext.options().seed,
            strategy: format!("{} {}", ext.name(), ext.id()),
            kind,
            open: open.clone(),
            created: created.clone(),
            primary: primary.clone(),
            shared: shared.clone(),
            given: given.clone(),
        };
        // Central copies after the first compute on copy 0's device, as the central variables.
        let device = if shared.is_some() { &devices[0] } else { &devices[copy] };
        let dev = candle_device(device)?;
        let vb = VarBuilder::from_backend(Box::new(backend(None)), DType::F32, dev.clone());
        let frozen = VarBuilder::from_backend(Box::new(backend(Some(VariableKind::Frozen))), DType::F32, dev.clone());
        let state = VarBuilder::from_backend(Box::new(backend(Some(VariableKind::State))), DType::F32, dev);
        let model = build(&Scope { vb, frozen, state, given, copy, copies: n, ext })?;
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

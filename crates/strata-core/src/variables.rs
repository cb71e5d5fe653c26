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

/// The `VarBuilder` backend of a scope: creates (copy 0) or mirrors (other copies) variables.
struct ScopeBackend {
    copy: usize,
    seed: u64,
    strategy: String,
    open: Arc<AtomicBool>,
    created: Arc<Mutex<Vec<(String, Var)>>>,
    primary: Option<Arc<HashMap<String, Tensor>>>,
}

impl ScopeBackend {
    fn existing(&self, name: &str) -> Option<Var> {
        lock(&self.created).iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
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
        if let Some(v) = self.existing(name) {
            if v.shape() != &s {
                candle_core::bail!(
                    "variable {name:?} was created with shape {:?} and is now asked for with {:?}",
                    v.shape(),
                    s
                );
            }
            return Ok(v.as_tensor().clone());
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
        lock(&self.created).push((name.to_string(), var.clone()));
        Ok(var.as_tensor().clone())
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> candle_core::Result<Tensor> {
        match self.existing(name) {
            Some(v) => Ok(v.as_tensor().clone()),
            None => candle_core::bail!("variable {name:?} does not exist in this scope"),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.existing(name).is_some() || self.primary.as_ref().is_some_and(|p| p.contains_key(name))
    }
}

/// What the scope closure gets: a `VarBuilder` whose variables are created the strategy's way.
pub struct Scope<'a> {
    vb: VarBuilder<'static>,
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
    /// The `VarBuilder` to build the model with (candle-nn layers take it unchanged).
    pub fn var_builder(&self) -> VarBuilder<'static> {
        self.vb.clone()
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
/// (central). Get the replica's copy with [`Replicated::on`].
#[derive(Debug)]
pub struct Replicated<M> {
    strategy: StrategyId,
    strategy_name: &'static str,
    policy: VariablePolicy,
    copies: Vec<M>,
    vars: Vec<Vec<(String, Var)>>,
}

pub(crate) fn build_replicated<M>(
    ext: &Arc<dyn StrategyExtended>,
    mut build: impl FnMut(&Scope) -> candle_core::Result<M>,
) -> Result<Replicated<M>> {
    let _guard = ScopeGuard::enter(ext)?;
    let policy = ext.variable_policy();
    let n = match policy {
        VariablePolicy::Mirrored => ext.num_replicas(),
        VariablePolicy::Central { .. } => 1,
    };
    let open = Arc::new(AtomicBool::new(true));
    let devices = ext.replica_devices();
    let mut copies = Vec::with_capacity(n);
    let mut vars: Vec<Vec<(String, Var)>> = Vec::with_capacity(n);
    let mut primary: Option<Arc<HashMap<String, Tensor>>> = None;
    for (copy, device) in devices.iter().enumerate().take(n) {
        let created = Arc::new(Mutex::new(Vec::new()));
        let backend = ScopeBackend {
            copy,
            seed: ext.options().seed,
            strategy: format!("{} {}", ext.name(), ext.id()),
            open: open.clone(),
            created: created.clone(),
            primary: primary.clone(),
        };
        let dev = candle_device(device)?;
        let vb = VarBuilder::from_backend(Box::new(backend), DType::F32, dev);
        let model = build(&Scope { vb, copy, copies: n, ext })?;
        let made = std::mem::take(&mut *lock(&created));
        if let Some(first) = vars.first() {
            let a: Vec<&str> = first.iter().map(|(n, _)| n.as_str()).collect();
            let b: Vec<&str> = made.iter().map(|(n, _)| n.as_str()).collect();
            if a != b {
                return Err(Error::Scope(format!(
                    "copy {copy} of the model created variables {b:?} but copy 0 created {a:?}; the scope closure must build the same model every time"
                )));
            }
        } else {
            let values = made.iter().map(|(n, v)| Ok((n.clone(), v.as_tensor().copy()?)));
            primary = Some(Arc::new(values.collect::<candle_core::Result<_>>()?));
        }
        copies.push(model);
        vars.push(made);
    }
    open.store(false, Ordering::Release);
    if let Some(w) = ext.workers() {
        broadcast_from_chief(w, &vars)?;
    }
    Ok(Replicated { strategy: ext.id(), strategy_name: ext.name(), policy, copies, vars })
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
        Ok(match self.policy {
            VariablePolicy::Mirrored => &self.copies[ctx.replica_id()],
            VariablePolicy::Central { .. } => &self.copies[0],
        })
    }

    /// The first copy, for cross-replica reads (evaluation, checkpoints).
    pub fn primary(&self) -> &M {
        &self.copies[0]
    }

    /// The number of copies.
    pub fn num_copies(&self) -> usize {
        self.copies.len()
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

    /// The variable `name` with all its copies.
    pub fn variable(&self, name: &str) -> Option<DistributedVariable> {
        let i = self.vars[0].iter().position(|(n, _)| n == name)?;
        Some(DistributedVariable {
            name: name.to_string(),
            policy: self.policy,
            copies: self.vars.iter().map(|v| v[i].1.clone()).collect(),
        })
    }

    /// The primary copy's values, by name.
    pub fn values(&self) -> Result<Vec<(String, Tensor)>> {
        self.vars[0].iter().map(|(n, v)| Ok((n.clone(), v.as_tensor().copy()?))).collect()
    }

    /// Builds one optimizer per copy (candle-nn's `SGD`, `AdamW`, or any `Optimizer`).
    pub fn optimizer<O: Optimizer>(&self, config: O::Config) -> Result<DistributedOptimizer<O>>
    where
        O::Config: Clone,
    {
        let copies = self
            .vars
            .iter()
            .map(|vs| O::new(vs.iter().map(|(_, v)| v.clone()).collect(), config.clone()).map(Mutex::new))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(DistributedOptimizer {
            strategy: self.strategy,
            strategy_name: self.strategy_name,
            policy: self.policy,
            copies,
            vars: self.vars.iter().map(|vs| vs.iter().map(|(_, v)| v.clone()).collect()).collect(),
        })
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

/// One optimizer per model copy: mirrored copies each apply the same all-reduced gradient;
/// a central copy is updated once, on the parameter device.
#[derive(Debug)]
pub struct DistributedOptimizer<O> {
    strategy: StrategyId,
    strategy_name: &'static str,
    policy: VariablePolicy,
    copies: Vec<Mutex<O>>,
    vars: Vec<Vec<Var>>,
}

impl<O: Optimizer> DistributedOptimizer<O> {
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

/// How a replica applies its gradients through a [`DistributedOptimizer`] (next to the
/// optimizer, whose copies and policy it uses; the reduction itself is
/// [`ReplicaContext::reduce_gradients`]).
impl ReplicaContext<'_> {
    /// Computes the gradients of `loss` and synchronises and applies them the strategy's way:
    /// mirrored variables all-reduce and every replica applies the same update to its copy;
    /// central variables reduce to the parameter device, which applies the update once.
    pub fn backward_and_sync<O: Optimizer>(&self, loss: &Tensor, opt: &DistributedOptimizer<O>) -> Result<()> {
        let grads = {
            let _p = self.phase("step", "backward");
            let _s = tracing::trace_span!("backward", replica = self.replica).entered();
            loss.backward()?
        };
        self.sync_and_apply(grads, opt)
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
        if n == 1 && self.shared.ext.workers().is_none() {
            let _p = self.phase("step", "optimizer");
            return Ok(opt.lock(0).step(&grads)?);
        }
        let vars = opt.vars(copy);
        let dest = match policy {
            VariablePolicy::Mirrored => Destination::AllReplicas,
            VariablePolicy::Central { parameter_replica } => Destination::Replica(parameter_replica),
        };
        if let Some(reduced) = self.reduce_gradients(&grads, vars, dest)? {
            let _p = self.phase("step", "optimizer");
            let mut store = GradStore::default();
            for (v, g) in vars.iter().zip(reduced) {
                store.insert(v.as_tensor(), g);
            }
            opt.lock(copy).step(&store)?;
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

//! [`ParameterServerStrategy`]: the coordinator's side of a parameter-server job.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use candle_core::{DType, Var};
use strata_core::cross_device::compression::Compression;
use strata_core::{Error, Replicated, Result, Strategy, StrategyOptions};
use strata_transport::ps::{
    LrSchedule, PsClient, PsClientConfig, PsMode, RowOptimizer, ServerOptimizer, StaleRate, TableInfo, VariableInfo,
    WireFormat,
};
use strata_transport::{AbortSignal, ClusterToken};

use super::coordinator::{ClusterCoordinator, CoordinatorOptions, PsControl};
use super::partition::{shard_range, Partitioner, Placement, PlacementPolicy};
use super::tables::PsTables;
use super::worker::pull_assign;
use crate::cluster::{ClusterResolver, ClusterSpec, TaskId, TaskType};
use crate::OneDeviceStrategy;

/// How a [`ParameterServerStrategy`] creates and updates its variables.
#[derive(Clone, Debug)]
pub struct ParameterServerOptions {
    /// The cluster token every task shares.
    pub token: ClusterToken,
    /// The optimizer the ps tasks apply pushed gradients with (default Keras's AdamW).
    pub optimizer: ServerOptimizer,
    /// The learning-rate schedule the ps tasks apply the optimizer at, in place of its constant
    /// rate (default none). Each ps task follows it by its own update count: its version
    /// before the update, one per applied push in async and stale modes (every worker step
    /// pushes once to every ps task, so a task's count is the job's applied worker steps) and
    /// one per applied round in sync mode (see [`PsClient::create_variables_scheduled`]). Give
    /// `total_steps` in that count.
    pub schedule: Option<LrSchedule>,
    /// The rate the ps tasks apply a stale push's dense variables at, async and stale modes
    /// (default [`StaleRate::Constant`], TensorFlow's; [`StaleRate::Inverse`]: `lr / (1 + s)`
    /// for a push `s` updates stale). Embedding tables' rows keep their optimizer's rate.
    pub stale_rate: StaleRate,
    /// Async, sync or bounded-staleness updates (default async).
    pub mode: PsMode,
    /// How variables are split (default not at all).
    pub partitioner: Partitioner,
    /// Which ps task holds each shard (default balanced bytes).
    pub placement: PlacementPolicy,
    /// Timeouts and retries of ps RPCs.
    pub rpc: PsClientConfig,
    /// Completed steps between ps checkpoints (`None`: never).
    pub checkpoint_every: Option<u64>,
    /// How long a step may keep failing as unavailable before its value fails (default 120 s).
    pub step_retry_for: Duration,
    /// The seed of variable initialisation (the same seed gives every strategy the same values).
    pub seed: u64,
    /// Where the cluster comes from, as messages name it (see
    /// [`ClusterResolver::source`]).
    pub cluster_source: &'static str,
    /// Whether a lost ps task will be restarted from its checkpoint, so that the coordinator
    /// waits for it instead of ending the job (see
    /// [`CoordinatorOptions::wait_for_restarted_ps`]; default false).
    pub wait_for_restarted_ps: bool,
    /// What the workers' pushes and pulls carry: [`Compression::None`] (default) exact f32,
    /// [`Compression::Fp16`] or [`Compression::Bf16`] 16 bits per element, rounded to nearest
    /// even (gradients by the worker, values by the ps task; the ps tasks keep f32 variables
    /// and apply in f32). [`scope`](ParameterServerStrategy::scope) records it on the ps tasks
    /// when it creates the variables, and every worker reads it there
    /// ([`PsClient::create_variables_for_job`]), so it is set here only. The coordinator's own
    /// pulls ([`PsModel::pull`]) stay f32. [`Compression::PowerSgd`] is refused by
    /// [`ParameterServerStrategy::new`]: it applies to multi-worker-mirrored's ring.
    pub compression: Compression,
    /// The optimizer of the embedding tables' rows on the ps tasks (default Keras' Adagrad:
    /// lr 0.05, initial accumulator 0.1, eps 1e-7): each table's touched rows are stepped with
    /// it, TensorFlow's sparse semantics.
    pub table_optimizer: RowOptimizer,
}

impl ParameterServerOptions {
    /// The defaults: AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-7, weight decay 0.004, as Keras)
    /// at a constant rate, async, no partitioning, balanced placement, no checkpoints, 120 s of
    /// step retries, seed 0.
    pub fn new(token: ClusterToken) -> Self {
        Self {
            token,
            optimizer: ServerOptimizer::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-7, weight_decay: 0.004 },
            schedule: None,
            stale_rate: StaleRate::Constant,
            mode: PsMode::Async,
            partitioner: Partitioner::None,
            placement: PlacementPolicy::BalancedBytes,
            rpc: PsClientConfig::default(),
            checkpoint_every: None,
            step_retry_for: Duration::from_secs(120),
            seed: 0,
            cluster_source: "the cluster spec",
            wait_for_restarted_ps: false,
            compression: Compression::None,
            table_optimizer: RowOptimizer::Adagrad { lr: 0.05, initial_accumulator: 0.1, eps: 1e-7 },
        }
    }

    /// The element type of the workers' pushes and pulls ([`compression`](Self::compression)),
    /// or the refusal of one a parameter server does not take (PowerSGD).
    pub fn wire_format(&self) -> Result<WireFormat> {
        Self::wire_format_of(self.compression)
    }

    /// [`wire_format`](Self::wire_format) of `compression`: what a program checks before it
    /// builds the options or starts a task (the `strata` command does).
    pub fn wire_format_of(compression: Compression) -> Result<WireFormat> {
        WireFormat::of(compression).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "compression {compression} applies to multi-worker-mirrored's ring, not to a parameter server's pushes and pulls; use none, fp16 or bf16 with the parameter server"
            ))
        })
    }
}

/// TF's `ParameterServerStrategy`: variables live (sharded) on the `ps` tasks, `worker` tasks
/// run the steps a [`ClusterCoordinator`] schedules, and this process is the coordinator.
///
/// Every task runs the same binary: the ps tasks serve variables
/// ([`strata_transport::ps::PsServerHandle`]), the workers serve the step functions registered
/// by name ([`super::worker::serve_worker`]), and the coordinator creates the variables with
/// [`scope`](Self::scope) and schedules steps with [`coordinator`](Self::coordinator).
pub struct ParameterServerStrategy {
    cluster: ClusterSpec,
    options: ParameterServerOptions,
    ps_clients: Vec<PsClient>,
    placement: Mutex<Option<Arc<Placement>>>,
    /// Raised when the job fails: the ps clients' calls give up at once.
    abort: AbortSignal,
}

impl std::fmt::Debug for ParameterServerStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParameterServerStrategy")
            .field("cluster", &self.cluster)
            .field("optimizer", &self.options.optimizer)
            .field("schedule", &self.options.schedule)
            .field("mode", &self.options.mode)
            .field("partitioner", &self.options.partitioner)
            .field("compression", &self.options.compression)
            .finish()
    }
}

/// [`PsControl`] over a [`PsClient`] of a task of a job of `.1` ps tasks, for the coordinator.
struct PsTask(PsClient, u32);

impl PsControl for PsTask {
    fn ps_task(&self) -> String {
        self.0.task().to_string()
    }

    fn checkpoint(&self, step: u64) -> std::result::Result<PathBuf, String> {
        self.0.checkpoint_of_job(step, self.1).map(|(path, _)| path).map_err(|e| e.to_string())
    }

    fn configure(&self, live_workers: u32) -> std::result::Result<(), String> {
        self.0.configure(live_workers).map_err(|e| e.to_string())
    }

    fn probe(&self, deadline: Duration) -> std::result::Result<(), String> {
        self.0.probe(deadline).map_err(|e| e.to_string())
    }
}

impl ParameterServerStrategy {
    /// The strategy of `cluster` (at least one `ps` and one `worker` task), with a client of
    /// every ps task (connected lazily). A [`ParameterServerOptions::compression`] a parameter
    /// server does not take (PowerSGD) is [`Error::InvalidArgument`].
    pub fn new(cluster: ClusterSpec, options: ParameterServerOptions) -> Result<Self> {
        options.wire_format()?;
        let num_ps = cluster.num_tasks(TaskType::Ps);
        if num_ps == 0 {
            return Err(Error::InvalidCluster(
                "a parameter-server strategy needs at least one ps task; add a \"ps\" job to the cluster spec".into(),
            ));
        }
        if cluster.num_tasks(TaskType::Worker) == 0 {
            return Err(Error::InvalidCluster(
                "a parameter-server strategy needs at least one worker task; add a \"worker\" job to the cluster spec"
                    .into(),
            ));
        }
        // A node name nobody resolves fails here, at once, not after the connect retries.
        crate::cluster::check_hosts(&cluster, options.cluster_source)?;
        let abort = AbortSignal::new();
        let mut ps_clients = Vec::with_capacity(num_ps);
        for i in 0..num_ps {
            let address = cluster.address(TaskId::ps(i))?;
            ps_clients.push(
                PsClient::connect(address, &format!("ps:{i}"), options.token.clone(), options.rpc.clone())?
                    .with_abort(abort.clone()),
            );
        }
        Ok(Self { cluster, options, ps_clients, placement: Mutex::new(None), abort })
    }

    /// The strategy of the cluster `resolver` describes.
    pub fn from_resolver(resolver: &dyn ClusterResolver, options: ParameterServerOptions) -> Result<Self> {
        Self::new(resolver.resolve()?.spec, options)
    }

    /// Builds the model once on this process's CPU (with the same initial values as every other
    /// strategy for the same seed), splits and places its variables, and creates them on the ps
    /// tasks with the optimizer and mode. Variables a ps task already holds (restored from a
    /// checkpoint) keep their values, which are pulled into the returned copy.
    ///
    /// Embedding tables the model declares ([`strata_core::layers::Embedding`]) are never
    /// built here: each ps task gets its shard of every table (a fixed table's run of rows, an
    /// id-space table's ids hashed to it), stepped with
    /// [`table_optimizer`](ParameterServerOptions::table_optimizer), whose rows appear as
    /// they are first pulled; the coordinator's copy looks them up on the ps tasks.
    pub fn scope<M>(&self, build: impl FnMut(&strata_core::Scope) -> candle_core::Result<M>) -> Result<PsModel<M>> {
        let cpu = strata_core::device::logical_cpus(1)?.remove(0);
        let tables = Arc::new(PsTables::new("chief", self.ps_clients.clone()));
        let options = StrategyOptions { seed: self.options.seed, tables: Some(tables.clone()), ..Default::default() };
        let local = OneDeviceStrategy::with_options(cpu, options)?;
        let model = local.scope(build)?;
        let num_ps = self.ps_clients.len() as u32;
        let table_shards = |ps: usize| -> Vec<TableInfo> {
            tables
                .tables()
                .into_iter()
                .map(|config| TableInfo {
                    config,
                    seed: self.options.seed,
                    shard: ps as u32,
                    num_shards: num_ps,
                    optimizer: self.options.table_optimizer.clone(),
                })
                .collect()
        };
        let vars: Vec<(String, Var)> = model.variables(0).to_vec();
        let mut shapes = Vec::with_capacity(vars.len());
        let mut values = Vec::with_capacity(vars.len());
        for (name, var) in &vars {
            if var.dtype() != DType::F32 {
                return Err(Error::InvalidArgument(format!(
                    "variable {name:?} is {:?}; parameter servers hold f32 variables, build the model in f32",
                    var.dtype()
                )));
            }
            shapes.push((name.clone(), var.dims().to_vec()));
            values.push(var.as_tensor().flatten_all()?.to_vec1::<f32>()?);
        }
        let mut placement =
            Placement::plan(&shapes, self.ps_clients.len(), &self.options.partitioner, self.options.placement)?;
        // State (BatchNorm's statistics) takes the workers' changes, not the optimizer.
        let state: Vec<&str> = vars
            .iter()
            .zip(model.kinds())
            .filter(|(_, k)| **k == strata_core::VariableKind::State)
            .map(|((n, _), _)| n.as_str())
            .collect();
        placement.mark_state(&state);
        let placement = Arc::new(placement);
        let position = |var: &str| shapes.iter().position(|(n, _)| n == var);
        let results: Vec<Result<bool>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .ps_clients
                .iter()
                .enumerate()
                .map(|(ps, client)| {
                    let placement = &placement;
                    let values = &values;
                    let options = &self.options;
                    let table_shards = &table_shards;
                    s.spawn(move || -> Result<bool> {
                        let mut shards: Vec<(VariableInfo, &[f32])> = Vec::new();
                        for info in placement.on_task(ps) {
                            let v = position(&info.variable).ok_or_else(|| {
                                Error::InvalidArgument(format!("shard {:?} has no variable", info.name))
                            })?;
                            shards.push((info.clone(), &values[v][shard_range(info)]));
                        }
                        let outcome = client.create_with_tables(
                            &shards,
                            &table_shards(ps),
                            &options.optimizer,
                            options.schedule.as_ref(),
                            options.stale_rate,
                            options.mode,
                            options.wire_format()?,
                        )?;
                        Ok(outcome.existed)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| Err(Error::Cluster("creating variables on a ps task panicked".into())))
                })
                .collect()
        });
        let mut existed = false;
        for r in results {
            existed |= r?;
        }
        *self.placement.lock().unwrap_or_else(PoisonError::into_inner) = Some(placement.clone());
        let ps_model = PsModel { model, vars, placement, clients: self.ps_clients.clone() };
        if existed {
            ps_model.pull()?;
        }
        Ok(ps_model)
    }

    /// The step the job resumes from: the step of the checkpoint every ps task was restored
    /// from (`strata ps --restore`, its own checkpoint or the whole job's), when they all were,
    /// from the same step; otherwise 0 (a fresh job, or a task restarted from its checkpoint
    /// while the others kept running).
    pub fn restored_step(&self) -> Result<u64> {
        let mut steps = Vec::with_capacity(self.ps_clients.len());
        for c in &self.ps_clients {
            steps.push(c.status()?.restored_step);
        }
        match steps.split_first() {
            Some((&first, rest)) if first > 0 && rest.iter().all(|&s| s == first) => Ok(first),
            _ => {
                if steps.iter().any(|&s| s > 0) {
                    tracing::warn!(
                        ?steps,
                        "the ps tasks were restored from checkpoints of different steps; the job starts from step 0"
                    );
                }
                Ok(0)
            }
        }
    }

    /// A coordinator that schedules steps on this cluster's workers and checkpoints the ps tasks
    /// every [`ParameterServerOptions::checkpoint_every`] steps, counting the job's steps from
    /// [`restored_step`](Self::restored_step) ([`ClusterCoordinator::first_step`]). Must not be
    /// called from inside a tokio runtime.
    pub fn coordinator(&self) -> Result<ClusterCoordinator> {
        let mut workers = Vec::new();
        for i in 0..self.cluster.num_tasks(TaskType::Worker) {
            workers.push((format!("worker:{i}"), self.cluster.address(TaskId::worker(i))?.to_string()));
        }
        let num_ps = u32::try_from(self.ps_clients.len()).unwrap_or(u32::MAX);
        let ps: Vec<Arc<dyn PsControl>> =
            self.ps_clients.iter().map(|c| Arc::new(PsTask(c.clone(), num_ps)) as Arc<dyn PsControl>).collect();
        let mut options = CoordinatorOptions::new(self.options.token.clone());
        options.step_retry_for = self.options.step_retry_for;
        options.checkpoint_every = self.options.checkpoint_every;
        options.first_step = self.restored_step()?;
        options.wait_for_restarted_ps = self.options.wait_for_restarted_ps;
        options.abort = self.abort.clone();
        ClusterCoordinator::with_ps_tasks(workers, ps, options)
    }

    /// The number of ps tasks.
    pub fn num_ps(&self) -> usize {
        self.ps_clients.len()
    }

    /// The number of worker tasks.
    pub fn num_workers(&self) -> usize {
        self.cluster.num_tasks(TaskType::Worker)
    }

    /// A client of every ps task, by index.
    pub fn ps_clients(&self) -> &[PsClient] {
        &self.ps_clients
    }

    /// Where the variables live, once [`scope`](Self::scope) created them.
    pub fn placement(&self) -> Option<Arc<Placement>> {
        self.placement.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The cluster.
    pub fn cluster(&self) -> &ClusterSpec {
        &self.cluster
    }

    /// The options.
    pub fn options(&self) -> &ParameterServerOptions {
        &self.options
    }

    /// Ends the job on every ps task and worker of the cluster
    /// ([`strata_transport::control`]): each answers, stops serving and exits 0, instead of
    /// serving until it is killed. The chief calls it last, once it has read what it needs
    /// from the ps tasks, whether training succeeded or not; `reason` (at most 256 bytes) ends
    /// up in each task's last line. Every task is asked at once, each within `deadline`; one
    /// that does not answer is listed with its error (it ends when it has heard nothing for its
    /// own chief timeout). `Ok(true)`: the task had been finished already.
    pub fn finish_job(&self, reason: &str, deadline: Duration) -> Vec<(TaskId, strata_transport::Result<bool>)> {
        let tasks: Vec<(TaskId, &str)> =
            self.cluster.tasks().filter(|(t, _)| matches!(t.kind, TaskType::Ps | TaskType::Worker)).collect();
        let mut out = Vec::with_capacity(tasks.len());
        // At most 32 threads at a time, however large the cluster.
        for some in tasks.chunks(32) {
            std::thread::scope(|s| {
                let calls: Vec<_> = some
                    .iter()
                    .map(|&(task, address)| {
                        let token = self.options.token.clone();
                        s.spawn(move || {
                            strata_transport::control::finish_task(address, &task.to_string(), token, reason, deadline)
                        })
                    })
                    .collect();
                for (&(task, _), call) in some.iter().zip(calls) {
                    let answer = call.join().unwrap_or_else(|_| {
                        Err(strata_transport::Error::Aborted(format!("finishing {task} panicked")))
                    });
                    out.push((task, answer));
                }
            });
        }
        out
    }
}

/// A model whose variables live on the parameter servers, with the coordinator's copy.
pub struct PsModel<M> {
    model: Replicated<M>,
    vars: Vec<(String, Var)>,
    placement: Arc<Placement>,
    clients: Vec<PsClient>,
}

impl<M> std::fmt::Debug for PsModel<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PsModel").field("variables", &self.placement.variables()).finish()
    }
}

impl<M> PsModel<M> {
    /// The coordinator's copy of the model (for evaluation; [`pull`](Self::pull) refreshes it).
    pub fn model(&self) -> &M {
        self.model.primary()
    }

    /// The coordinator's copy of the variables, by name.
    pub fn variables(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// Where the variables live.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Assigns the ps tasks' current values to the coordinator's copy; returns every task's
    /// version, by index.
    pub fn pull(&self) -> Result<Vec<u64>> {
        pull_assign(&self.clients, &self.placement, &self.vars, None)
    }
}

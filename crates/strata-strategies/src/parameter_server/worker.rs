//! The worker side of a parameter-server job.
//!
//! **Steps are registered by name, because a closure cannot travel.** TF ships a traced
//! function to the workers; Rust cannot send a closure over the network, so every task runs the
//! same binary (`strata worker`, `strata ps` and the coordinator, or your own binary in three
//! roles), the worker registers its step functions by name in a [`StepRegistry`], and the
//! coordinator's [`ClusterCoordinator::schedule`](super::ClusterCoordinator::schedule) names the
//! function and sends its arguments as JSON.
//!
//! A step function gets a [`WorkerContext`]: it [`pull`](WorkerContext::pull)s the current values
//! of the variables it needs from the ps tasks, computes gradients, and
//! [`push`](WorkerContext::push)es them; the ps tasks apply them with the server-side optimizer,
//! exactly once per `(coordinator run, step, push)` even when the step is re-run on another
//! worker. A push the ps tasks refuse as stale (bounded staleness) re-runs the function, which
//! pulls fresh values at its start.
//!
//! ```
//! use strata_strategies::parameter_server::{StepRegistry, WorkerContext};
//!
//! let mut registry = StepRegistry::new();
//! // The same name is scheduled by the coordinator: `coordinator.schedule::<(f32, f32), f32>("add", &(1.0, 2.0))`.
//! registry.register("add", |_ctx: &WorkerContext, (a, b): (f32, f32)| Ok(a + b));
//! assert_eq!(registry.functions(), vec!["add".to_string()]);
//! // In the worker process: `serve_worker(bind, registry, WorkerOptions::new(index, ps_addresses, token))?.wait()`.
//! ```

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{Tensor, Var};
use serde::de::DeserializeOwned;
use serde::Serialize;
use strata_core::{Error, Result};
use strata_transport::executor::{StepFailure, StepHandler, WorkerExecutorHandle};
use strata_transport::ps::{
    F32Bytes, PsClient, PsClientConfig, PushOutcome, RowGrads, StagedPush, UpdateId, VariableInfo, WireFormat,
};
use strata_transport::ClusterToken;

use super::partition::Placement;

/// How many times a step function runs again after a stale push before its step fails.
const MAX_STALE_RERUNS: usize = 20;

/// Why an erased step function did not return.
enum RunError {
    Stale(String),
    Step(StepFailure),
}

type ErasedStep = dyn Fn(&WorkerContext, &[u8]) -> std::result::Result<Vec<u8>, RunError> + Send + Sync;

/// The step functions of a worker, by name.
#[derive(Default)]
pub struct StepRegistry {
    functions: BTreeMap<String, Arc<ErasedStep>>,
}

impl std::fmt::Debug for StepRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepRegistry").field("functions", &self.functions()).finish()
    }
}

impl StepRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `f` as the step function `name` (replacing one of the same name): its
    /// arguments arrive as JSON of `A`, its result goes back as JSON of `R`.
    /// Arguments that do not decode, and an [`Error::InvalidArgument`] from `f` (arguments over
    /// what the step allows: check sizes that come from the network before using them), are
    /// answered `INVALID_ARGUMENT`.
    pub fn register<A, R>(
        &mut self,
        name: impl Into<String>,
        f: impl Fn(&WorkerContext, A) -> Result<R> + Send + Sync + 'static,
    ) where
        A: DeserializeOwned,
        R: Serialize,
    {
        let name = name.into();
        let fname = name.clone();
        let erased = move |ctx: &WorkerContext, args: &[u8]| -> std::result::Result<Vec<u8>, RunError> {
            let a: A = serde_json::from_slice(args).map_err(|e| {
                RunError::Step(StepFailure::InvalidArgument(format!(
                    "step function {fname:?} cannot decode its arguments as {}: {e}; schedule it with that type",
                    std::any::type_name::<A>()
                )))
            })?;
            let r = f(ctx, a).map_err(|e| match e {
                Error::Stale(m) => RunError::Stale(m),
                Error::Unavailable(m) => RunError::Step(StepFailure::Unavailable(m)),
                Error::InvalidArgument(m) => {
                    RunError::Step(StepFailure::InvalidArgument(format!("step function {fname:?}: {m}")))
                }
                other => RunError::Step(StepFailure::Failed(format!("step function {fname:?} failed: {other}"))),
            })?;
            serde_json::to_vec(&r).map_err(|e| {
                RunError::Step(StepFailure::Failed(format!(
                    "step function {fname:?} cannot encode its result {}: {e}",
                    std::any::type_name::<R>()
                )))
            })
        };
        self.functions.insert(name, Arc::new(erased));
    }

    /// The names of the registered functions, sorted.
    pub fn functions(&self) -> Vec<String> {
        self.functions.keys().cloned().collect()
    }
}

/// Where a worker task finds the parameter servers.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// This worker's index (`worker:<task_index>`).
    pub task_index: usize,
    /// The address of every ps task, by index.
    pub ps_addresses: Vec<String>,
    /// The cluster token every task shares.
    pub token: ClusterToken,
    /// Timeouts and retries of ps RPCs.
    pub rpc: PsClientConfig,
}

impl WorkerOptions {
    /// Worker `task_index` of a job with ps tasks at `ps_addresses`, default RPC settings.
    pub fn new(task_index: usize, ps_addresses: Vec<String>, token: ClusterToken) -> Self {
        Self { task_index, ps_addresses, token, rpc: PsClientConfig::default() }
    }
}

/// Reusable pull buffers: per ps task, one buffer per shard.
type BufferPool = Mutex<Vec<Vec<Vec<f32>>>>;

/// What every step of one worker process shares.
struct WorkerShared {
    task: String,
    index: usize,
    /// A client of every ps task, in f32 (for `Status`).
    clients: Vec<PsClient>,
    /// The same clients in the job's wire format, as the ps tasks report it (cached with the
    /// placement): what pushes and pulls use.
    wire: Mutex<Option<Arc<Vec<PsClient>>>>,
    placement: Mutex<Option<Arc<Placement>>>,
    buffers: BufferPool,
}

impl WorkerShared {
    /// The placement and the job's wire format as the ps tasks report them now (cached when
    /// there are variables).
    fn refresh(&self) -> Result<Arc<Placement>> {
        let mut tasks = Vec::with_capacity(self.clients.len());
        let mut formats = Vec::with_capacity(self.clients.len());
        for c in &self.clients {
            let status = c.status()?;
            formats.push(status.wire_format);
            tasks.push(status.variables.into_iter().map(|(info, _)| info).collect::<Vec<VariableInfo>>());
        }
        let placement = Arc::new(Placement::from_tasks(tasks)?);
        if !placement.variables().is_empty() {
            let wire = self.clients.iter().zip(formats).map(|(c, f)| c.clone().with_wire_format(f)).collect();
            *self.wire.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(wire));
            *self.placement.lock().unwrap_or_else(PoisonError::into_inner) = Some(placement.clone());
        }
        Ok(placement)
    }

    /// The clients pushes and pulls use: in the job's wire format once the ps tasks reported
    /// it (with the placement), f32 before.
    fn wire_clients(&self) -> Arc<Vec<PsClient>> {
        self.wire
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .unwrap_or_else(|| Arc::new(self.clients.clone()))
    }

    /// The element type this worker's pushes and pulls to ps task `ps` carry now.
    fn wire_format(&self, ps: usize) -> WireFormat {
        self.wire_clients().get(ps).map_or(WireFormat::F32, PsClient::wire_format)
    }

    fn placement(&self) -> Result<Arc<Placement>> {
        if let Some(p) = self.placement.lock().unwrap_or_else(PoisonError::into_inner).clone() {
            return Ok(p);
        }
        self.refresh()
    }
}

/// The step handler of a worker task: runs the registered functions for the executor server.
pub struct WorkerStepHandler {
    registry: StepRegistry,
    shared: Arc<WorkerShared>,
}

impl std::fmt::Debug for WorkerStepHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerStepHandler")
            .field("task", &self.shared.task)
            .field("functions", &self.registry.functions())
            .finish()
    }
}

impl WorkerStepHandler {
    /// The handler of `registry`'s functions, with a client of every ps task (connected lazily).
    pub fn new(registry: StepRegistry, options: WorkerOptions) -> Result<Self> {
        if options.ps_addresses.is_empty() {
            return Err(Error::InvalidCluster(
                "a worker of a parameter-server job needs the ps task addresses; pass at least one".into(),
            ));
        }
        let mut clients = Vec::with_capacity(options.ps_addresses.len());
        for (i, address) in options.ps_addresses.iter().enumerate() {
            clients.push(PsClient::connect(address, &format!("ps:{i}"), options.token.clone(), options.rpc.clone())?);
        }
        Ok(Self {
            registry,
            shared: Arc::new(WorkerShared {
                task: format!("worker:{}", options.task_index),
                index: options.task_index,
                clients,
                wire: Mutex::new(None),
                placement: Mutex::new(None),
                buffers: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The worker's task name, `worker:<index>`.
    pub fn task(&self) -> &str {
        &self.shared.task
    }
}

impl StepHandler for WorkerStepHandler {
    fn functions(&self) -> Vec<String> {
        self.registry.functions()
    }

    fn run(&self, function: &str, step: u64, client: &str, args: &[u8]) -> std::result::Result<Vec<u8>, StepFailure> {
        let f = self.registry.functions.get(function).ok_or_else(|| StepFailure::NotFound(function.to_string()))?;
        let mut last = String::new();
        for _ in 0..=MAX_STALE_RERUNS {
            let ctx = WorkerContext {
                shared: self.shared.clone(),
                step,
                client: client.to_string(),
                seq: Arc::new(AtomicU64::new(0)),
            };
            let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| f(&ctx, args))).unwrap_or_else(|p| {
                let message = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".into());
                Err(RunError::Step(StepFailure::Failed(format!("step function {function:?} panicked: {message}"))))
            });
            match outcome {
                Ok(result) => return Ok(result),
                Err(RunError::Step(failure)) => return Err(failure),
                Err(RunError::Stale(m)) => {
                    tracing::debug!(function, step, "stale push; running the step again with fresh values");
                    last = m;
                }
            }
        }
        Err(StepFailure::Failed(format!(
            "step function {function:?} pushed stale gradients {} times in a row (last: {last}); raise the \
             staleness bound or use fewer workers",
            MAX_STALE_RERUNS + 1
        )))
    }
}

/// Serves `registry`'s step functions on `bind` as worker `options.task_index`.
pub fn serve_worker(bind: SocketAddr, registry: StepRegistry, options: WorkerOptions) -> Result<WorkerExecutorHandle> {
    let token = options.token.clone();
    let handler = WorkerStepHandler::new(registry, options)?;
    let task = handler.task().to_string();
    Ok(WorkerExecutorHandle::start(bind, task, token, Arc::new(handler))?)
}

/// The versions of every ps task that a pull saw; a push computed from those values names them.
#[derive(Clone, Debug)]
pub struct PullTicket {
    versions: Vec<u64>,
    placement: Arc<Placement>,
}

impl PullTicket {
    /// Every ps task's version at the pull, by index (0 for a task nothing was pulled from).
    pub fn versions(&self) -> &[u64] {
        &self.versions
    }
}

/// What the ps tasks did with one push.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushSummary {
    /// Every ps task pushed to (`ps:<i>`) and its outcome.
    pub outcomes: Vec<(String, PushOutcome)>,
}

impl PushSummary {
    /// Whether every ps task applied the update (a duplicate counts as applied).
    pub fn applied(&self) -> bool {
        self.outcomes.iter().all(|(_, o)| matches!(o, PushOutcome::Applied { .. }))
    }

    /// Whether any ps task dropped the update (a sync round's late push).
    pub fn dropped(&self) -> bool {
        self.outcomes.iter().any(|(_, o)| matches!(o, PushOutcome::Dropped { .. }))
    }

    /// Whether any ps task had applied this update before (a re-run step).
    pub fn duplicate(&self) -> bool {
        self.outcomes.iter().any(|(_, o)| matches!(o, PushOutcome::Applied { duplicate: true, .. }))
    }
}

/// What a step function gets: the step, and the parameter servers. Clones share the step's
/// push sequence, so every push of the step keeps its own number.
#[derive(Clone)]
pub struct WorkerContext {
    shared: Arc<WorkerShared>,
    step: u64,
    client: String,
    seq: Arc<AtomicU64>,
}

impl std::fmt::Debug for WorkerContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerContext")
            .field("task", &self.shared.task)
            .field("step", &self.step)
            .field("client", &self.client)
            .finish()
    }
}

impl WorkerContext {
    /// This worker's task name, `worker:<index>`.
    pub fn task(&self) -> &str {
        &self.shared.task
    }

    /// This worker's index.
    pub fn worker_index(&self) -> usize {
        self.shared.index
    }

    /// The step's id (schedule order).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The coordinator run that scheduled the step.
    pub fn client(&self) -> &str {
        &self.client
    }

    /// Where the variables live, as the ps tasks report it (fetched once per worker process).
    pub fn placement(&self) -> Result<Arc<Placement>> {
        self.shared.placement()
    }

    /// The element type of this worker's pushes to and pulls from ps task `ps`: the job's
    /// [`ParameterServerOptions::compression`](super::ParameterServerOptions::compression),
    /// as the task reports it (read with the placement; f32 before).
    pub fn wire_format(&self, ps: usize) -> WireFormat {
        self.shared.wire_format(ps)
    }

    /// Assigns the ps tasks' current values of `vars` (whole variables, by name) to them,
    /// pulling from every ps task in parallel.
    pub fn pull(&self, vars: &[(String, Var)]) -> Result<PullTicket> {
        let placement = self.shared.placement()?;
        let pool = Some(&self.shared.buffers);
        match pull_assign(&self.shared.wire_clients(), &placement, vars, pool) {
            Ok(versions) => Ok(PullTicket { versions, placement }),
            Err(e) if e.is_retryable() => Err(e),
            Err(e) => {
                let fresh = self.shared.refresh()?;
                if *fresh == *placement {
                    return Err(e);
                }
                let versions = pull_assign(&self.shared.wire_clients(), &fresh, vars, pool)?;
                Ok(PullTicket { versions, placement: fresh })
            }
        }
    }

    /// Pushes gradients of whole variables (row-major f32, by name), computed from the values
    /// of `ticket`, to the ps tasks holding them, one push per task in parallel. Each push of a
    /// step has its own sequence number, so a re-run of the step is applied once. Every ps task
    /// gets a push, an empty one where none of its variables has a gradient: it counts the
    /// update (AdamW's step, a sync round) without changing any variable, as one device's
    /// optimizer step skips variables without a gradient.
    pub fn push(&self, ticket: &PullTicket, grads: &[(String, Vec<f32>)]) -> Result<PushSummary> {
        let id = self.next_update_id();
        self.push_as(&id, ticket, grads)
    }

    /// The identity of the step's next push.
    fn next_update_id(&self) -> UpdateId {
        UpdateId {
            worker: self.shared.task.clone(),
            client: self.client.clone(),
            step: self.step,
            seq: self.seq.fetch_add(1, Ordering::SeqCst),
        }
    }

    /// Checks that the variables are on as many ps tasks as this worker knows.
    fn check_tasks(&self, placement: &Placement) -> Result<()> {
        let num_ps = placement.num_ps();
        if num_ps != self.shared.clients.len() {
            return Err(Error::InvalidCluster(format!(
                "the variables are on {num_ps} ps tasks but this worker knows {}; give every task the same ps list",
                self.shared.clients.len()
            )));
        }
        Ok(())
    }

    /// The clients of the ps tasks, by index, in the job's wire format (what pushes and pulls
    /// use).
    pub fn ps_clients(&self) -> Arc<Vec<PsClient>> {
        self.shared.wire_clients()
    }

    /// [`push`](Self::push) of the step's gradients with rows of embedding tables: per ps task,
    /// the rows it owns (pulled under their lease by this worker) and their version, as
    /// [`PsTables::take_rows`](super::tables::PsTables::take_rows) gives them. Each task gets
    /// one update carrying its variables' gradients and its rows.
    pub fn push_with_rows(
        &self,
        ticket: &PullTicket,
        grads: &[(String, Vec<f32>)],
        rows: &[(Vec<RowGrads>, u64)],
    ) -> Result<PushSummary> {
        let id = self.next_update_id();
        self.push_rows_as(&id, ticket, grads, rows)
    }

    /// [`push`](Self::push) as update `id` (an overlapped push given up is pushed again as the
    /// same update).
    pub(crate) fn push_as(
        &self,
        id: &UpdateId,
        ticket: &PullTicket,
        grads: &[(String, Vec<f32>)],
    ) -> Result<PushSummary> {
        self.push_rows_as(id, ticket, grads, &[])
    }

    /// [`push_with_rows`](Self::push_with_rows) as update `id`.
    fn push_rows_as(
        &self,
        id: &UpdateId,
        ticket: &PullTicket,
        grads: &[(String, Vec<f32>)],
        rows: &[(Vec<RowGrads>, u64)],
    ) -> Result<PushSummary> {
        let placement = &ticket.placement;
        self.check_tasks(placement)?;
        let num_ps = placement.num_ps();
        let mut per_task: Vec<Vec<(&str, &[f32])>> = vec![Vec::new(); num_ps];
        for (name, g) in grads {
            for (ps, shard, part) in placement.split(name, g)? {
                per_task[ps].push((shard, part));
            }
        }
        let clients = self.shared.wire_clients();
        let results: Vec<Result<PushOutcome>> = std::thread::scope(|s| {
            let handles: Vec<_> = per_task
                .iter()
                .enumerate()
                .map(|(ps, list)| {
                    let client = &clients[ps];
                    let base = ticket.versions.get(ps).copied().unwrap_or(0);
                    let rows = rows.get(ps).map_or(&[][..], |(r, _)| r.as_slice());
                    s.spawn(move || {
                        if rows.is_empty() {
                            client.push(id, base, list).map_err(Error::from)
                        } else {
                            client.push_rows(id, base, list, rows).map_err(Error::from)
                        }
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(Error::Cluster("a push thread panicked".into()))))
                .collect()
        });
        summarize(results)
    }

    /// Starts the push of this step's gradients before they are computed (see
    /// [`OverlappedPush`]): one push per ps task, as [`push`](Self::push) makes, each open
    /// from now on, carrying `gradients` (whole variables, in push order) and then `state`
    /// (their changes, staged at [`OverlappedPush::commit`]). The gradients are expected to
    /// become final in the order `ready` (the same variables), and are handed to each task's
    /// push in buckets of about `bucket_bytes` along that order.
    pub fn start_overlapped_push(
        &self,
        ticket: &PullTicket,
        gradients: &[String],
        ready: &[String],
        state: &[String],
        bucket_bytes: usize,
    ) -> Result<OverlappedPush> {
        let placement = ticket.placement.clone();
        self.check_tasks(&placement)?;
        let num_ps = placement.num_ps();
        let mut names: Vec<Vec<String>> = vec![Vec::new(); num_ps];
        let mut lens: Vec<Vec<usize>> = vec![Vec::new(); num_ps];
        let mut routes: HashMap<String, Route> = HashMap::new();
        for (name, is_state) in gradients.iter().map(|n| (n, false)).chain(state.iter().map(|n| (n, true))) {
            let numel: usize = placement
                .shape_of(name)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "variable {name:?} is not on the parameter servers; create it in scope"
                    ))
                })?
                .iter()
                .product();
            let mut parts = Vec::new();
            for s in placement.shards_of(name) {
                parts.push((s.ps, names[s.ps].len(), s.range()));
                names[s.ps].push(s.info.name.clone());
                lens[s.ps].push(s.range().len());
            }
            if routes.insert(name.clone(), Route { numel, parts, state: is_state, staged: false }).is_some() {
                return Err(Error::InvalidArgument(format!("variable {name:?} is pushed twice; push it once")));
            }
        }
        // Each task's buckets: its shards of the gradients, in the order they should be ready.
        let mut bucket_of: Vec<Vec<Option<usize>>> = lens.iter().map(|l| vec![None; l.len()]).collect();
        let mut left: Vec<Vec<usize>> = vec![Vec::new(); num_ps];
        for ps in 0..num_ps {
            let mut order: Vec<usize> = Vec::new();
            for name in ready {
                let route = routes.get(name).filter(|r| !r.state).ok_or_else(|| {
                    Error::InvalidArgument(format!("variable {name:?} is expected ready but not among the gradients"))
                })?;
                order.extend(route.parts.iter().filter(|(p, _, _)| *p == ps).map(|(_, i, _)| *i));
            }
            let sizes: Vec<usize> = order.iter().map(|&i| lens[ps][i]).collect();
            for (b, bucket) in strata_core::cross_device::plan_buckets(&sizes, bucket_bytes).iter().enumerate() {
                for &i in &order[bucket.tensors.clone()] {
                    bucket_of[ps][i] = Some(b);
                }
                left[ps].push(bucket.tensors.len());
            }
        }
        let id = self.next_update_id();
        let clients = self.shared.wire_clients();
        let mut push = OverlappedPush {
            id: id.clone(),
            ticket: ticket.clone(),
            gradients: gradients.to_vec(),
            routes,
            pending: left.iter().map(|l| vec![Vec::new(); l.len()]).collect(),
            bucket_of,
            left,
            staged: Vec::with_capacity(num_ps),
            threads: Vec::with_capacity(num_ps),
            broken: None,
        };
        for (ps, (names, lens)) in names.into_iter().zip(lens).enumerate() {
            let staged = Arc::new(StagedPush::new(lens));
            let client = clients[ps].clone();
            let base = ticket.versions.get(ps).copied().unwrap_or(0);
            let (id, source) = (id.clone(), staged.clone());
            let thread = std::thread::Builder::new()
                .name(format!("push-ps{ps}"))
                .spawn(move || {
                    let names: Vec<&str> = names.iter().map(String::as_str).collect();
                    client.push_staged(&id, base, &names, &source).map_err(Error::from)
                })
                .map_err(|e| Error::Cluster(format!("cannot start the thread of the push to ps:{ps}: {e}")));
            push.staged.push(staged);
            // Dropping `push` on an error abandons (and joins) the threads started so far.
            push.threads.push(thread?);
        }
        Ok(push)
    }
}

/// Where a variable of an [`OverlappedPush`] goes.
#[derive(Debug)]
struct Route {
    numel: usize,
    /// Per shard: its ps task, its index in that task's push, and its elements.
    parts: Vec<(usize, usize, std::ops::Range<usize>)>,
    /// A state variable's change (staged at commit), not a gradient.
    state: bool,
    staged: bool,
}

/// A step's push started before the backward pass ends: one push per ps task, as
/// [`WorkerContext::push`] makes (the same update identity, the same header, the same chunks),
/// open from the start; each variable's gradient is handed over as soon as it is final
/// ([`stage`](Self::stage)), a bucket at a time, and sent while the pass goes on. The ps tasks
/// apply nothing before [`commit`](Self::commit) ends the pushes, so the step's update stays
/// whole: one update per task, applied, dropped or refused (stale) as a whole. Dropped before
/// its commit (or after a [`stage`](Self::stage) it does not expect, see
/// [`matches`](Self::matches)), the push is abandoned: every call is cancelled before its end,
/// nothing of it is applied, and the same update can be pushed again.
pub struct OverlappedPush {
    id: UpdateId,
    ticket: PullTicket,
    gradients: Vec<String>,
    routes: HashMap<String, Route>,
    /// Per ps task, per bucket: the shards staged, and how many are still to come.
    pending: Vec<Vec<Vec<(usize, F32Bytes)>>>,
    bucket_of: Vec<Vec<Option<usize>>>,
    left: Vec<Vec<usize>>,
    staged: Vec<Arc<StagedPush>>,
    threads: Vec<std::thread::JoinHandle<Result<PushOutcome>>>,
    /// Why the push cannot be committed, if it cannot.
    broken: Option<String>,
}

impl std::fmt::Debug for OverlappedPush {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OverlappedPush")
            .field("id", &self.id)
            .field("gradients", &self.gradients)
            .field("broken", &self.broken)
            .finish()
    }
}

impl OverlappedPush {
    /// The update this push is (pushed again as itself when it is given up).
    pub fn id(&self) -> &UpdateId {
        &self.id
    }

    /// The pull this push's gradients were computed from.
    pub fn ticket(&self) -> &PullTicket {
        &self.ticket
    }

    /// Hands over the final gradient of variable `name` (row-major f32). Its shards are sent
    /// with their bucket, once the bucket's last one is here. A variable the push does not
    /// carry, or one staged twice, makes the push one that [`matches`](Self::matches) nothing.
    pub fn stage(&mut self, name: &str, grad: Vec<f32>) {
        if self.broken.is_some() {
            return;
        }
        let Some(route) = self.routes.get_mut(name).filter(|r| !r.state && !r.staged) else {
            self.broken = Some(format!("variable {name:?} got a gradient this push does not expect"));
            return;
        };
        if grad.len() != route.numel {
            self.broken = Some(format!("variable {name:?} has {} elements, its gradient {}", route.numel, grad.len()));
            return;
        }
        route.staged = true;
        let whole = F32Bytes::from_vec(grad);
        let parts: Vec<_> = route.parts.clone();
        for (ps, i, range) in parts {
            let part = whole.slice(range);
            let Some(b) = self.bucket_of[ps][i] else {
                // Not in the expected order: sent on its own.
                if let Err(e) = self.staged[ps].stage(vec![(i, part)]) {
                    self.broken = Some(e.to_string());
                }
                continue;
            };
            self.pending[ps][b].push((i, part));
            self.left[ps][b] -= 1;
            if self.left[ps][b] == 0 {
                let bucket = std::mem::take(&mut self.pending[ps][b]);
                if let Err(e) = self.staged[ps].stage(bucket) {
                    self.broken = Some(e.to_string());
                }
            }
        }
    }

    /// Whether the push carries exactly the gradients of `with_gradient` (in push order), and
    /// every one of them was staged: then [`commit`](Self::commit) pushes what
    /// [`WorkerContext::push`] of the same gradients would.
    pub fn matches(&self, with_gradient: &[&str]) -> bool {
        self.broken.is_none()
            && self.gradients.len() == with_gradient.len()
            && self.gradients.iter().zip(with_gradient).all(|(a, b)| a == b)
            && self.routes.values().all(|r| r.state || r.staged)
    }

    /// Stages `state` (the state variables' changes, in push order) and ends every task's
    /// push; waits for their answers. A push that does not [`match`](Self::matches) its
    /// gradients is refused ([`Error::InvalidArgument`]) and abandoned.
    pub fn commit(mut self, state: Vec<(String, Vec<f32>)>) -> Result<PushSummary> {
        for (name, values) in state {
            let Some(route) = self.routes.get_mut(&name).filter(|r| r.state && !r.staged) else {
                self.broken = Some(format!("state {name:?} is not in this push, or was staged twice"));
                break;
            };
            if values.len() != route.numel {
                self.broken = Some(format!("state {name:?} has {} elements, its change {}", route.numel, values.len()));
                break;
            }
            route.staged = true;
            let whole = F32Bytes::from_vec(values);
            for (ps, i, range) in route.parts.clone() {
                if let Err(e) = self.staged[ps].stage(vec![(i, whole.slice(range))]) {
                    self.broken = Some(e.to_string());
                }
            }
        }
        if self.broken.is_none() {
            if let Some((name, _)) = self.routes.iter().find(|(_, r)| !r.staged) {
                self.broken = Some(format!("variable {name:?} was never staged"));
            }
        }
        if let Some(why) = self.broken.take() {
            return Err(Error::InvalidArgument(format!("an overlapped push cannot be committed: {why}")));
        }
        for s in &self.staged {
            if let Err(e) = s.commit() {
                return Err(Error::InvalidArgument(format!("an overlapped push cannot be committed: {e}")));
            }
        }
        let results = std::mem::take(&mut self.threads)
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::Cluster("a push thread panicked".into()))))
            .collect();
        summarize(results)
    }

    /// Gives the push up: every task's call is cancelled before its end, so nothing of it is
    /// applied; returns once the calls have ended.
    pub fn abandon(self) {
        drop(self);
    }
}

impl Drop for OverlappedPush {
    fn drop(&mut self) {
        for s in &self.staged {
            s.abandon();
        }
        for h in std::mem::take(&mut self.threads) {
            let _ = h.join();
        }
    }
}

/// One push's answers from every ps task (in task order), or its first error: a stale
/// refusal wins, so the step runs again and the others' pushes repeat as duplicates.
fn summarize(results: Vec<Result<PushOutcome>>) -> Result<PushSummary> {
    let mut outcomes = Vec::new();
    let mut first_error = None;
    for (ps, r) in results.into_iter().enumerate() {
        match r {
            Ok(o) => outcomes.push((format!("ps:{ps}"), o)),
            Err(e) if first_error.is_none() || matches!(e, Error::Stale(_)) => first_error = Some(e),
            Err(_) => {}
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(PushSummary { outcomes }),
    }
}

/// Pulls every shard of `vars` from the ps tasks (one thread per task), assembles the whole
/// variables and assigns them; returns each task's version (0 where nothing was pulled).
pub(crate) fn pull_assign(
    clients: &[PsClient],
    placement: &Placement,
    vars: &[(String, Var)],
    pool: Option<&BufferPool>,
) -> Result<Vec<u64>> {
    let num_ps = placement.num_ps();
    if clients.len() != num_ps {
        return Err(Error::InvalidCluster(format!(
            "the variables are on {num_ps} ps tasks but {} ps clients were given; give every task the same ps list",
            clients.len()
        )));
    }
    let mut wanted: Vec<Vec<(usize, &VariableInfo)>> = vec![Vec::new(); num_ps];
    for (vi, (name, var)) in vars.iter().enumerate() {
        let shape = placement.shape_of(name).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "variable {name:?} is not on the parameter servers; build the model with the coordinator's scope"
            ))
        })?;
        if var.dims() != shape {
            return Err(Error::InvalidArgument(format!(
                "variable {name:?} has shape {:?} here but {shape:?} on the parameter servers; build the same model",
                var.dims()
            )));
        }
        for s in placement.shards_of(name) {
            wanted[s.ps].push((vi, &s.info));
        }
    }
    let mut buffers: Vec<Vec<Vec<f32>>> =
        pool.map(|p| std::mem::take(&mut *p.lock().unwrap_or_else(PoisonError::into_inner))).unwrap_or_default();
    buffers.resize_with(num_ps, Vec::new);
    let results: Vec<Result<u64>> = std::thread::scope(|s| {
        let handles: Vec<_> = wanted
            .iter()
            .zip(buffers.iter_mut())
            .zip(clients)
            .map(|((want, buf), client)| {
                s.spawn(move || -> Result<u64> {
                    if want.is_empty() {
                        return Ok(0);
                    }
                    buf.resize_with(want.len(), Vec::new);
                    for (b, (_, info)) in buf.iter_mut().zip(want.iter()) {
                        b.resize(info.numel(), 0.0);
                    }
                    let names: Vec<&str> = want.iter().map(|(_, i)| i.name.as_str()).collect();
                    let mut out: Vec<&mut [f32]> = buf.iter_mut().take(want.len()).map(Vec::as_mut_slice).collect();
                    Ok(client.pull_into(&names, 0, &mut out)?)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::Cluster("a pull thread panicked".into()))))
            .collect()
    });
    let versions = results.into_iter().collect::<Result<Vec<u64>>>();
    let assigned = versions.and_then(|versions| {
        let mut wholes: Vec<Vec<f32>> = vars.iter().map(|(_, v)| vec![0.0; v.elem_count()]).collect();
        for (want, buf) in wanted.iter().zip(&buffers) {
            for ((vi, info), part) in want.iter().zip(buf) {
                Placement::assemble(info, part, &mut wholes[*vi])?;
            }
        }
        for ((_, var), whole) in vars.iter().zip(wholes) {
            var.set(&Tensor::from_vec(whole, var.dims(), var.device())?)?;
        }
        Ok(versions)
    });
    if let Some(p) = pool {
        *p.lock().unwrap_or_else(PoisonError::into_inner) = buffers;
    }
    assigned
}

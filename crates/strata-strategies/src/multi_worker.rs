//! `MultiWorkerMirroredStrategy`: a variable copy on every replica of every worker,
//! synchronous, with hierarchical all-reduce (local, then a ring across workers, then local).
//!
//! Each worker process resolves its cluster (TF_CONFIG, Slurm or an explicit spec). The chief
//! (the `chief` task, or `worker:0` when there is none) serves the coordination service; every
//! worker registers there (the rendezvous checks that every task runs the same cluster and
//! strategy), starts heartbeats, and joins a ring of TCP connections between the workers'
//! data planes. A collective between workers is numbered the same way on every worker; the
//! ring checks the numbers, shapes and kinds in every frame, so a worker that calls
//! collectives in another order is reported with both sides named. A lost worker (its
//! connections close, or its heartbeats stop) fails every survivor's next or current
//! collective with an error naming the task, the collective and its number.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use strata_core::cross_device::compression::{Compression, HalfFormat};
use strata_core::cross_device::{CrossDeviceOps, HierarchicalOps, PendingAllReduce};
use strata_core::device::LogicalDevice;
use strata_core::strategy::{AutoShardPolicy, WorkerCollectives};
use strata_core::timeline::Timeline;
use strata_core::{Error, ReduceOp, Result, Strategy, StrategyExtended, StrategyOptions, VariablePolicy};
use strata_transport::coordination::{MembershipView, Progress};
use strata_transport::ring::{AbortSignal, Ring, RingConfig};
use strata_transport::{ClusterToken, CoordinationConfig, CoordinationMember, CoordinationServerHandle};

use crate::cluster::{ClusterConfig, ClusterResolver, TaskId};
use crate::local::{CpuReduction, CrossWorker, LocalStrategy};

/// Settings of a [`MultiWorkerMirroredStrategy`] besides the cluster.
#[derive(Clone, Debug)]
pub struct MultiWorkerOptions {
    /// This worker's replica devices (default: one logical CPU).
    pub local_devices: Vec<LogicalDevice>,
    /// The cluster token every task shares.
    pub token: ClusterToken,
    /// The address servers bind to (default: loopback; `0.0.0.0` for a real cluster).
    pub bind: IpAddr,
    /// Rendezvous and heartbeat timing.
    pub coordination: CoordinationConfig,
    /// Shared strategy settings; `collective_timeout` is every cross-worker collective's
    /// deadline too.
    pub options: StrategyOptions,
    /// How input is split across workers.
    pub auto_shard: AutoShardPolicy,
    /// Cross-device ops that replace the hierarchical ones (in memory, then the ring), built
    /// once every worker has joined: NCCL across every worker's GPU
    /// (`strata_strategies::nccl::nccl_across_workers`, features `nccl` and `candle-cuda`).
    pub cross_worker_ops: Option<CrossWorkerOps>,
    /// How gradients cross the network between workers (TensorFlow's
    /// `CommunicationOptions`): `None` (f32, exact), `Fp16` / `Bf16` (16 bits on the wire,
    /// every hop adding in f32, every worker decompressing the same sum), or `PowerSgd`
    /// (matrix-shaped gradients as two rank-R factors, each all-reduced in f32, with error
    /// feedback and a warm-started `Q`; other gradients in f32). Every worker must use the
    /// same (checked at rendezvous); a PowerSGD rank at which none of a model's gradients
    /// shrinks is refused when its optimizer is built.
    pub compression: Compression,
    /// Elastic membership (`None`: a lost worker ends the job, as in TensorFlow).
    pub elastic: Option<ElasticOptions>,
}

/// The elastic membership of a [`MultiWorkerMirroredStrategy`]: the job runs while at least
/// `min_workers` of the cluster's workers live. A lost worker (killed, stopped, cut off; the
/// chief included) costs the step in flight: the others agree on the new membership, re-form
/// the ring, and go on from the last step any of them completed, with the same global batch
/// split over fewer workers. A worker that starts later joins at the next step boundary and
/// takes its state from a member. A process declared lost is fenced: it is refused and stops.
/// The membership is held by a coordination service that outlives every worker
/// ([`strata_transport::CoordinationServerHandle::start_elastic`], which `strata launch` serves).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ElasticOptions {
    /// The fewest workers the job runs with (1 to the cluster's workers).
    pub min_workers: usize,
    /// Where the elastic coordination service listens (`host:port`).
    pub coordinator: String,
}

impl ElasticOptions {
    /// Refuses a `min_workers` outside 1 to the job's `workers`: what
    /// [`MultiWorkerMirroredStrategy::new`] checks first, and a launcher that knows the
    /// cluster checks before it starts a task (`strata launch` does).
    pub fn check_min_workers(min_workers: usize, workers: usize) -> Result<()> {
        Ok(strata_transport::coordination::check_min_workers(min_workers, workers)?)
    }
}

/// What a [`CrossWorkerOps`] factory gets: this worker's place in the job, its membership of
/// the coordination service (whose key-value store agrees an NCCL id), and the job's failure
/// signal.
pub struct CrossWorkerSetup<'a> {
    /// This worker's rank, from 0 (the chief).
    pub rank: usize,
    /// The number of workers.
    pub world: usize,
    /// This task's name, e.g. `worker:1`.
    pub task: &'a str,
    /// This worker's replica devices.
    pub local_devices: &'a [LogicalDevice],
    /// The coordination service, through this task's membership.
    pub member: &'a CoordinationMember,
    /// Raised (with the reason) when the job failed elsewhere.
    pub abort: AbortSignal,
    /// The deadline of every collective (and of joining a communicator).
    pub timeout: std::time::Duration,
}

/// A function that builds a multi-worker job's cross-device ops.
pub type CrossWorkerOpsFn = dyn Fn(&CrossWorkerSetup<'_>) -> Result<Box<dyn CrossDeviceOps>> + Send + Sync;

/// Builds the cross-device ops of a multi-worker job from its [`CrossWorkerSetup`].
#[derive(Clone)]
pub struct CrossWorkerOps(
    /// The factory.
    pub Arc<CrossWorkerOpsFn>,
);

impl std::fmt::Debug for CrossWorkerOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CrossWorkerOps(..)")
    }
}

impl MultiWorkerOptions {
    /// Defaults with `token`.
    pub fn new(token: ClusterToken) -> Result<Self> {
        Ok(Self {
            local_devices: strata_core::device::logical_cpus(1)?,
            token,
            bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
            coordination: CoordinationConfig::default(),
            options: StrategyOptions::default(),
            auto_shard: AutoShardPolicy::Data,
            cross_worker_ops: None,
            compression: Compression::None,
            elastic: None,
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One generation of a job's membership, as this worker takes part in it: the ring, this
/// worker's rank, the collectives' counter and the signal that stops them. A job that is not
/// elastic has one.
#[derive(Debug)]
struct Gen {
    ring: Ring,
    rank: usize,
    generation: u64,
    seq: AtomicU64,
    abort: AbortSignal,
}

/// What re-joining an elastic job takes.
#[derive(Debug)]
struct Rejoin {
    cluster_fingerprint: String,
    strategy_fingerprint: String,
    bind: IpAddr,
    host: String,
    token: String,
    collective_timeout: Duration,
    connect_timeout: Duration,
    /// The membership as the heartbeats report it.
    view: Arc<MembershipView>,
    /// Why the job cannot go on (set by the heartbeats: the job failed, or this process was
    /// fenced): re-joining fails with it.
    fatal: Arc<Mutex<Option<String>>>,
    /// The most workers the job has (each loss may cost a re-join one more generation).
    tasks: usize,
    /// The fewest it may go on with.
    min: usize,
}

/// The cross-worker state of one worker: its generation (ring), its membership of the job,
/// and (on the chief of a job that is not elastic) the coordination service.
#[derive(Debug)]
struct WorkerJob {
    current: RwLock<Arc<Gen>>,
    /// The current generation's number and abort signal, for the heartbeats.
    abort_cell: Arc<Mutex<(u64, AbortSignal)>>,
    member: Mutex<Option<CoordinationMember>>,
    server: Mutex<Option<CoordinationServerHandle>>,
    progress: Arc<Progress>,
    task: String,
    /// Collectives started ahead, run in order on a thread of their own.
    ahead: Ahead,
    /// Elastic jobs: what re-joining takes.
    rejoin: Option<Rejoin>,
    /// Whether this worker joined an elastic job under way.
    under_way: bool,
    /// Where each collective across workers is recorded (row [`Timeline::RING`]).
    timeline: Option<Arc<Timeline>>,
}

/// A job for the thread that runs started collectives.
type AheadJob = Box<dyn FnOnce(&WorkerJob) + Send>;

/// The collectives started with [`WorkerCollectives::start_all_reduce`]: a thread of their own
/// runs them in the order they were started (so a bucket's ring all-reduce crosses the link
/// while the backward pass goes on), and a collective called directly first waits until every
/// started one is done, so that every worker runs them in the same order.
#[derive(Debug, Default)]
struct Ahead {
    /// The thread's queue, made at the first start; it ends with the job.
    queue: Mutex<Option<std::sync::mpsc::Sender<AheadJob>>>,
    /// This worker's job, for the thread (set once the job is shared).
    job: std::sync::OnceLock<std::sync::Weak<WorkerJob>>,
    /// Started collectives not yet done.
    outstanding: Mutex<usize>,
    done: std::sync::Condvar,
}

impl Ahead {
    /// Runs `run` on the thread after every collective started before it.
    fn start(&self, run: AheadJob) -> Result<()> {
        let mut queue = lock(&self.queue);
        if queue.is_none() {
            let job = self.job.get().cloned().ok_or_else(|| {
                Error::Scope("a collective was started before the multi-worker job was set up".into())
            })?;
            let (tx, rx) = std::sync::mpsc::channel::<AheadJob>();
            std::thread::Builder::new()
                .name("strata-ring-ahead".into())
                .spawn(move || {
                    while let Ok(run) = rx.recv() {
                        let Some(job) = job.upgrade() else { break };
                        run(&job);
                        let mut n = lock(&job.ahead.outstanding);
                        *n -= 1;
                        job.ahead.done.notify_all();
                    }
                })
                .map_err(|e| Error::io("starting the thread of started collectives", e))?;
            *queue = Some(tx);
        }
        *lock(&self.outstanding) += 1;
        let sent = queue.as_ref().is_some_and(|tx| tx.send(run).is_ok());
        if !sent {
            *lock(&self.outstanding) -= 1;
            return Err(Error::Scope("the thread of started collectives has ended".into()));
        }
        Ok(())
    }

    /// Waits until every started collective is done.
    fn drain(&self) {
        let mut n = lock(&self.outstanding);
        while *n > 0 {
            n = self.done.wait(n).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl WorkerJob {
    /// The current generation.
    fn gen(&self) -> Arc<Gen> {
        self.current.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Runs a collective called directly: after every started one.
    fn collective<T>(
        &self,
        what: &'static str,
        elems: usize,
        f: impl FnOnce(&Ring, u64) -> strata_transport::Result<T>,
    ) -> Result<T> {
        self.ahead.drain();
        let gen = self.gen();
        self.run_collective(&gen, what, elems, |seq| f(&gen.ring, seq))
    }

    /// Starts `run` on the thread of started collectives; its result comes back through the
    /// handle.
    fn start_ahead(&self, run: impl FnOnce(&WorkerJob, &Gen) -> Result<Vec<f32>> + Send + 'static) -> PendingAllReduce {
        let (tx, rx) = std::sync::mpsc::channel();
        // A started collective belongs to the generation it was started in.
        let gen = self.gen();
        let job: AheadJob = Box::new(move |job: &WorkerJob| {
            let _ = tx.send(run(job, &gen));
        });
        match self.ahead.start(job) {
            Ok(()) => PendingAllReduce::waiting(rx),
            Err(e) => PendingAllReduce::ready(Err(e)),
        }
    }

    /// Runs collective `what` of this worker's input of `elems` values (recorded on the
    /// timeline's ring row).
    fn run_collective<T>(
        &self,
        gen: &Gen,
        what: &'static str,
        elems: usize,
        f: impl FnOnce(u64) -> strata_transport::Result<T>,
    ) -> Result<T> {
        let seq = gen.seq.fetch_add(1, Ordering::Relaxed);
        self.progress.enter(seq, what);
        let _span = self.timeline.as_ref().map(|t| {
            t.span(Timeline::RING, "ring", what)
                .with_args(serde_json::json!({ "collective": seq, "elements": elems, "workers": gen.ring.size() }))
        });
        f(seq).map_err(|e| {
            let failed = matches!(e, strata_transport::Error::Aborted(_));
            let message = e.to_string();
            // In an elastic job a failed collective is a change of membership, not the job's
            // end: the coordination service learns it from the members' joins.
            if !failed && self.rejoin.is_none() {
                // Tell the others at once (they would learn it from their heartbeats anyway).
                if let Some(m) = lock(&self.member).as_ref() {
                    let _ = m.report_error(&message);
                }
            }
            Error::Cluster(format!("task {}: {message}", self.task))
        })
    }
}

impl WorkerCollectives for WorkerJob {
    fn num_workers(&self) -> usize {
        self.gen().ring.size()
    }
    fn worker_index(&self) -> usize {
        self.gen().rank
    }
    fn all_reduce(&self, op: ReduceOp, data: &mut [f32]) -> Result<()> {
        self.collective("all_reduce", data.len(), |ring, seq| ring.all_reduce(seq, op, data))
    }
    fn all_gather(&self, mine: &[f32]) -> Result<Vec<Vec<f32>>> {
        self.collective("all_gather", mine.len(), |ring, seq| ring.all_gather(seq, mine))
    }
    fn all_gather_into(&self, mine: &[f32], out: &mut [f32], counts: &[usize]) -> Result<()> {
        self.collective("all_gather", mine.len(), |ring, seq| ring.all_gather_into(seq, mine, out, counts))
    }
    fn broadcast(&self, root: usize, data: &mut [f32]) -> Result<()> {
        self.collective("broadcast", data.len(), |ring, seq| ring.broadcast(seq, root, data))
    }
    fn broadcast_u64s(&self, root: usize, data: &mut [u64]) -> Result<()> {
        self.collective("broadcast_u64s", data.len(), |ring, seq| ring.broadcast_u64s(seq, root, data))
    }
    fn barrier(&self) -> Result<()> {
        self.collective("barrier", 0, |ring, seq| ring.barrier(seq))
    }
    fn start_all_reduce_half(&self, mut data: Vec<f32>, format: HalfFormat) -> PendingAllReduce {
        self.start_ahead(move |job, gen| {
            job.run_collective(gen, "all_reduce", data.len(), |seq| gen.ring.all_reduce_half(seq, &mut data, format))
                .map(|()| data)
        })
    }
    fn start_all_reduce_int8(&self, mut data: Vec<f32>) -> PendingAllReduce {
        self.start_ahead(move |job, gen| {
            job.run_collective(gen, "all_reduce", data.len(), |seq| gen.ring.all_reduce_int8(seq, &mut data))
                .map(|()| data)
        })
    }
    fn start_all_reduce(&self, op: ReduceOp, mut data: Vec<f32>) -> PendingAllReduce {
        self.start_ahead(move |job, gen| {
            job.run_collective(gen, "all_reduce", data.len(), |seq| gen.ring.all_reduce(seq, op, &mut data))
                .map(|()| data)
        })
    }
    fn scatter_segment(&self, len: usize, worker: usize) -> std::ops::Range<usize> {
        self.gen().ring.scatter_segment(len, worker)
    }
    fn start_reduce_scatter(&self, op: ReduceOp, mut data: Vec<f32>) -> PendingAllReduce {
        self.start_ahead(move |job, gen| {
            let own = job
                .run_collective(gen, "reduce_scatter", data.len(), |seq| gen.ring.reduce_scatter(seq, op, &mut data))?;
            // Nothing outside this worker's segment is reduced: NaN there, so that a reader of
            // it cannot go unnoticed.
            data[..own.start].fill(f32::NAN);
            data[own.end..].fill(f32::NAN);
            Ok(data)
        })
    }
    fn generation(&self) -> u64 {
        self.gen().generation
    }
    fn is_elastic(&self) -> bool {
        self.rejoin.is_some()
    }
    fn joined_under_way(&self) -> bool {
        self.under_way
    }
    fn rejoin(&self) -> Result<()> {
        let Some(r) = &self.rejoin else {
            return Err(Error::Cluster(format!(
                "task {}: this job is not elastic: a failed collective ends it",
                self.task
            )));
        };
        // Started collectives end first (they fail at once on a stopped ring).
        let old = self.gen();
        old.abort.abort(format!("task {} left generation {}", self.task, old.generation));
        self.ahead.drain();
        let join = |data_address: &str, after: u64| {
            let guard = lock(&self.member);
            let member = guard.as_ref().ok_or_else(|| Error::Cluster(format!("task {}: left the job", self.task)))?;
            member
                .join(&r.cluster_fingerprint, &r.strategy_fingerprint, data_address, after)
                .map_err(|e| Error::Cluster(format!("task {}: {e}", self.task)))
        };
        let (g, ring, abort) = join_generation(r, &self.task, &self.abort_cell, old.generation, &join)?;
        tracing::info!(task = %self.task, generation = g.generation, rank = g.rank, workers = g.task_names.len(), members = %g.task_names.join(","), "re-formed the job");
        *self.current.write().unwrap_or_else(PoisonError::into_inner) =
            Arc::new(Gen { ring, rank: g.rank, generation: g.generation, seq: AtomicU64::new(0), abort });
        Ok(())
    }
    fn min_workers(&self) -> usize {
        self.rejoin.as_ref().map_or_else(|| self.num_workers(), |r| r.min)
    }
    fn leave_on_request(&self, code: u32) -> Result<()> {
        if self.rejoin.is_none() {
            return Err(Error::Cluster(format!(
                "task {}: this job is not elastic: a worker cannot leave it alone",
                self.task
            )));
        }
        let old = self.gen();
        old.abort.abort(format!("task {} left the job on request", self.task));
        self.ahead.drain();
        if let Some(mut m) = lock(&self.member).take() {
            m.leave_on_request(code, true).map_err(|e| Error::Cluster(format!("task {}: {e}", self.task)))?;
        }
        tracing::info!(task = %self.task, generation = old.generation, "left the elastic job on request; it goes on without this task");
        Ok(())
    }
    fn serve_pieces(
        &self,
        source: std::sync::Weak<dyn strata_core::cross_device::PieceSource>,
    ) -> Result<Arc<dyn strata_core::cross_device::PeerPieces>> {
        // In an elastic job every generation's members start one over their ring (ZeRO stage
        // 3's shards follow the membership); the earlier one's connections close with it.
        let pieces = self.collective("serve_pieces", 0, |ring, seq| ring.serve_pieces(seq, source))?;
        Ok(Arc::new(pieces))
    }
    fn abort_generation(&self, why: &str) {
        let gen = self.gen();
        gen.abort.abort(format!("task {}: {why}", self.task));
        if self.rejoin.is_none() {
            // The job fails: the others learn it at once.
            if let Some(m) = lock(&self.member).as_ref() {
                let _ = m.report_error(why);
            }
        }
    }
    fn admit_waiting(&self) -> Result<bool> {
        let Some(r) = &self.rejoin else { return Ok(false) };
        let mut flag = [u64::from(self.gen().rank == 0 && r.view.waiting() > 0)];
        self.broadcast_u64s(0, &mut flag)?;
        Ok(flag[0] == 1)
    }
}

/// Elastic jobs: joins the generation after `after` (0: the first) through `join` (given this
/// worker's data address) and connects its ring. A generation whose ring cannot connect (a
/// member lost meanwhile: the next one is forming) is left for the next one, a bounded number of
/// times. Returns the generation, its ring and the ring's abort signal (also in `abort_cell`,
/// for the heartbeats).
fn join_generation(
    r: &Rejoin,
    task: &str,
    abort_cell: &Mutex<(u64, AbortSignal)>,
    mut after: u64,
    join: &dyn Fn(&str, u64) -> Result<strata_transport::Generation>,
) -> Result<(strata_transport::Generation, Ring, AbortSignal)> {
    let attempts = 8.max(2 * r.tasks);
    let mut attempt = 1;
    loop {
        if let Some(why) = lock(&r.fatal).clone() {
            return Err(Error::Cluster(format!("task {task}: {why}")));
        }
        let (listener, data_address) = bind_data_plane(r.bind, &r.host, task)?;
        let g = join(&data_address, after)?;
        let abort = AbortSignal::new();
        *lock(abort_cell) = (g.generation, abort.clone());
        match connect_ring(&g, listener, r, task, abort.clone()) {
            Ok(ring) => return Ok((g, ring, abort)),
            Err(e) if attempt < attempts => {
                tracing::warn!(task = %task, generation = g.generation, why = %e, "the generation's ring did not connect; joining the next one");
                (after, attempt) = (g.generation, attempt + 1);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Binds a data-plane listener on `bind` (a free port) and says where peers reach it.
fn bind_data_plane(bind: IpAddr, host: &str, task: &str) -> Result<(std::net::TcpListener, String)> {
    let data_bind = SocketAddr::new(bind, 0);
    let listener = std::net::TcpListener::bind(data_bind).map_err(|e| {
        strata_core::Error::from(strata_transport::Error::bind(format!("the data plane of {task}"), data_bind, e))
    })?;
    let port = listener.local_addr().map_err(|e| Error::io("reading the data plane's address", e))?.port();
    Ok((listener, format!("{host}:{port}")))
}

/// Connects the ring of an elastic job's generation `g`.
fn connect_ring(
    g: &strata_transport::Generation,
    listener: std::net::TcpListener,
    r: &Rejoin,
    task: &str,
    abort: AbortSignal,
) -> Result<Ring> {
    let addresses = resolve_all(&g.data_addresses)?;
    let mut rc = RingConfig::new(g.rank, addresses);
    rc.listener = Some(listener);
    rc.task_names = g.task_names.clone();
    rc.token = Some(r.token.clone());
    // A process of another generation (a fenced one) is refused by every peer.
    rc.fingerprint = format!("{};{};generation={}", r.cluster_fingerprint, r.strategy_fingerprint, g.generation);
    rc.timeout = r.collective_timeout;
    rc.connect_timeout = r.connect_timeout;
    Ring::connect(rc, abort).map_err(|e| Error::Cluster(format!("task {task}: {e}")))
}

fn resolve_all(addresses: &[String]) -> Result<Vec<SocketAddr>> {
    addresses
        .iter()
        .map(|a| {
            a.to_socket_addrs().ok().and_then(|mut it| it.next()).ok_or_else(|| {
                Error::InvalidCluster(format!("the data-plane address {a:?} of a peer does not resolve"))
            })
        })
        .collect()
}

/// What joining a multi-worker job needs to know, whichever way it is joined.
struct JoinPlan<'a> {
    config: &'a ClusterConfig,
    options: &'a MultiWorkerOptions,
    /// The job's workers, in rank order.
    names: &'a [String],
    task: &'a str,
    /// Where peers reach this worker's host.
    own_host: &'a String,
    strategy_fingerprint: &'a String,
    /// The current generation's number and abort signal, for the heartbeats.
    abort_cell: &'a Arc<Mutex<(u64, AbortSignal)>>,
}

/// What joining a multi-worker job gives a worker.
struct Joined {
    member: CoordinationMember,
    /// The coordination service, which the chief of a job that is not elastic serves.
    server: Option<CoordinationServerHandle>,
    gen: Gen,
    rejoin: Option<Rejoin>,
    /// Whether it joined an elastic job under way.
    under_way: bool,
}

impl JoinPlan<'_> {
    /// Joins an elastic job through the coordination service that outlives its workers: starts
    /// the heartbeats that abort the step in flight when the membership changes, then joins the
    /// first generation it can connect the ring of.
    fn elastic(&self, e: &ElasticOptions) -> Result<Joined> {
        let (options, task, abort_cell) = (self.options, self.task, self.abort_cell);
        let (spec, names) = (&self.config.spec, self.names);
        let (own_host, strategy_fingerprint) = (self.own_host, self.strategy_fingerprint);
        let mut member = CoordinationMember::connect(
            &e.coordinator,
            "coordinator",
            task,
            options.token.clone(),
            options.coordination.clone(),
        )?;
        let fatal = Arc::new(Mutex::new(None::<String>));
        {
            let (cell, fatal_cell, forming_cell) = (abort_cell.clone(), fatal.clone(), abort_cell.clone());
            member.start_heartbeats_with(
                move |reason| {
                    *lock(&fatal_cell) = Some(reason.clone());
                    lock(&cell).1.abort(reason);
                },
                move |view: &MembershipView| {
                    // The next generation forms from this one: leave the step in flight.
                    let cell = lock(&forming_cell);
                    if view.forming() && view.generation() == cell.0 {
                        cell.1.abort("the job's membership is changing (a worker was lost)");
                    }
                },
            );
            let r = Rejoin {
                tasks: names.len(),
                min: e.min_workers,
                cluster_fingerprint: spec.fingerprint(),
                strategy_fingerprint: strategy_fingerprint.clone(),
                bind: options.bind,
                host: own_host.clone(),
                token: options.token.secret().to_string(),
                collective_timeout: options.options.collective_timeout,
                connect_timeout: options.coordination.rendezvous_timeout,
                view: member.membership(),
                fatal,
            };
            let join = |data_address: &str, after: u64| {
                member
                    .join(&r.cluster_fingerprint, &r.strategy_fingerprint, data_address, after)
                    .map_err(|e| Error::Cluster(format!("task {task}: {e}")))
            };
            let (g, ring, abort) = join_generation(&r, task, abort_cell, 0, &join)?;
            let gen = Gen { ring, rank: g.rank, generation: g.generation, seq: AtomicU64::new(0), abort };
            Ok(Joined { member, server: None, gen, rejoin: Some(r), under_way: g.resumed })
        }
    }

    /// Joins a job that is not elastic: the chief (`rank` 0) serves the coordination service,
    /// every worker registers with it at `chief_address` and connects the one ring.
    fn fixed(&self, rank: usize, chief: TaskId, chief_address: String) -> Result<Joined> {
        let (options, task, abort_cell, config) = (self.options, self.task, self.abort_cell, self.config);
        let (spec, names) = (&config.spec, self.names);
        let (own_host, strategy_fingerprint) = (self.own_host, self.strategy_fingerprint);
        let (listener, data_address) = bind_data_plane(options.bind, own_host, task)?;
        let abort = lock(abort_cell).1.clone();
        let server = if rank == 0 {
            let port = spec.port(config.task)?;
            Some(
                CoordinationServerHandle::start(
                    SocketAddr::new(options.bind, port),
                    names.to_vec(),
                    spec.fingerprint(),
                    strategy_fingerprint.clone(),
                    options.token.clone(),
                    options.coordination.clone(),
                )
                .map_err(|e| Error::Cluster(format!("task {}: {e}", config.task)))?,
            )
        } else {
            None
        };
        let coordinator =
            if rank == 0 { format!("{}:{}", loopback_for(options.bind), spec.port(chief)?) } else { chief_address };
        let mut member = CoordinationMember::connect(
            &coordinator,
            &chief.to_string(),
            task,
            options.token.clone(),
            options.coordination.clone(),
        )?;
        let reg = member.register(&spec.fingerprint(), strategy_fingerprint, &data_address)?;
        let addresses = resolve_all(&reg.data_addresses)?;
        let mut rc = RingConfig::new(reg.rank, addresses);
        rc.listener = Some(listener);
        rc.task_names = reg.task_names.clone();
        rc.token = Some(options.token.secret().to_string());
        rc.fingerprint = format!("{};{strategy_fingerprint}", spec.fingerprint());
        rc.timeout = options.options.collective_timeout;
        rc.connect_timeout = options.coordination.rendezvous_timeout;
        let ring = Ring::connect(rc, abort.clone()).map_err(|e| Error::Cluster(format!("task {task}: {e}")))?;
        {
            let abort = abort.clone();
            member.start_heartbeats(move |reason| abort.abort(reason));
        }
        let gen = Gen { ring, rank: reg.rank, generation: 0, seq: AtomicU64::new(0), abort };
        Ok(Joined { member, server, gen, rejoin: None, under_way: false })
    }
}

/// Synchronous training across worker processes (TensorFlow's
/// `MultiWorkerMirroredStrategy`). User code is the same as under `MirroredStrategy`.
#[derive(Clone, Debug)]
pub struct MultiWorkerMirroredStrategy {
    ext: Arc<dyn StrategyExtended>,
    job: Arc<WorkerJob>,
    config: ClusterConfig,
}

impl MultiWorkerMirroredStrategy {
    /// Joins the job described by `resolver` (rendezvous, heartbeats, the ring). Returns when
    /// every worker has joined.
    pub fn from_resolver(resolver: &dyn ClusterResolver, mut options: MultiWorkerOptions) -> Result<Self> {
        options.coordination.cluster_source = resolver.source();
        Self::new(resolver.resolve()?, options)
    }

    /// Joins the job of `config` as its task.
    pub fn new(config: ClusterConfig, mut options: MultiWorkerOptions) -> Result<Self> {
        let spec = &config.spec;
        let Some(rank) = config.rank() else {
            return Err(Error::InvalidCluster(format!(
                "task {} takes no part in multi-worker mirrored training (only the chief and the workers do); start it with a worker task",
                config.task
            )));
        };
        // A node name nobody resolves fails here, at once, not at the rendezvous deadline.
        crate::cluster::check_hosts(spec, options.coordination.cluster_source)?;
        let workers = spec.sync_workers();
        let names: Vec<String> = workers.iter().map(ToString::to_string).collect();
        let chief = workers[0];
        let chief_address = spec.address(chief)?.to_string();
        let own_address = spec.address(config.task)?.to_string();
        let own_host = host_of(&own_address);
        let local_n = options.local_devices.len();
        if options.compression == Compression::Int8 && options.options.local_sgd.is_none() {
            return Err(Error::InvalidArgument(
                "compression int8 carries local SGD's outer gradients, not per-step gradients: use it with a synchronisation period above 1, or use fp16 or bf16".into(),
            ));
        }
        if options.compression != Compression::None && options.cross_worker_ops.is_some() {
            return Err(Error::InvalidArgument(format!(
                "compression {} applies to the ring, not to cross-worker ops of your own (NCCL); use none with them",
                options.compression
            )));
        }
        // Local SGD: `H = 1` averaging is per-step synchronous training itself.
        if options.options.local_sgd.as_ref().is_some_and(|l| l.is_synchronous()) {
            options.options.local_sgd = None;
        }
        if let Some(l) = options.options.local_sgd.as_mut() {
            // The outer gradients cross under the job's compression.
            l.wire = options.compression;
            check_local_sgd(&options)?;
        }
        if let Some(e) = &options.elastic {
            ElasticOptions::check_min_workers(e.min_workers, names.len())?;
            if options.cross_worker_ops.is_some() {
                return Err(Error::InvalidArgument(
                    "elastic membership re-forms the ring, not cross-worker ops of your own (NCCL); use the ring with it".into(),
                ));
            }
        }
        let elastic_fingerprint =
            options.elastic.as_ref().map(|e| format!(";elastic_min={}", e.min_workers)).unwrap_or_default();
        let local_sgd_fingerprint =
            options.options.local_sgd.as_ref().map(|l| format!(";local_sgd={l}")).unwrap_or_default();
        let strategy_fingerprint = format!(
            "multi-worker-mirrored;replicas_per_worker={local_n};auto_shard={:?};bucket_bytes={};seed={};compression={}{elastic_fingerprint}{local_sgd_fingerprint}",
            options.auto_shard, options.options.bucket_bytes, options.options.seed, options.compression
        );
        let task = config.task.to_string();
        let abort_cell = Arc::new(Mutex::new((0, AbortSignal::new())));
        let join = JoinPlan {
            config: &config,
            options: &options,
            names: &names,
            task: &task,
            own_host: &own_host,
            strategy_fingerprint: &strategy_fingerprint,
            abort_cell: &abort_cell,
        };
        let Joined { member, server, gen, rejoin, under_way } = match &options.elastic {
            Some(e) => join.elastic(e)?,
            None => join.fixed(rank, chief, chief_address)?,
        };
        let progress = member.progress();
        tracing::info!(task = %task, rank = gen.rank, workers = gen.ring.size(), generation = gen.generation, "joined the multi-worker job");
        let job = Arc::new(WorkerJob {
            current: RwLock::new(Arc::new(gen)),
            abort_cell,
            member: Mutex::new(Some(member)),
            server: Mutex::new(server),
            progress,
            task,
            ahead: Ahead::default(),
            rejoin,
            under_way,
            timeline: options.options.timeline.clone(),
        });
        let _ = job.ahead.job.set(Arc::downgrade(&job));
        let custom = match &options.cross_worker_ops {
            Some(factory) => {
                let guard = lock(&job.member);
                let member =
                    guard.as_ref().ok_or_else(|| Error::Cluster(format!("task {}: left the job", job.task)))?;
                let gen = job.gen();
                let setup = CrossWorkerSetup {
                    rank: gen.rank,
                    world: gen.ring.size(),
                    task: &job.task,
                    local_devices: &options.local_devices,
                    member,
                    abort: gen.abort.clone(),
                    timeout: options.options.collective_timeout,
                };
                let ops = (factory.0)(&setup).inspect_err(|e| {
                    let _ = member.report_error(&e.to_string());
                })?;
                tracing::info!(task = %job.task, ops = ops.name(), "cross-worker ops");
                Some(ops)
            }
            None => None,
        };
        let ops_job = job.clone();
        let (compression, seed) = (options.compression, options.options.seed);
        let local_steps = options.options.local_sgd.is_some();
        let cross = CrossWorker {
            ops: Box::new(move |local| match custom {
                Some(ops) => ops,
                // Local SGD: a step's gradients meet on this worker only (as Mirrored's).
                None if local_steps => Box::new(local) as Box<dyn CrossDeviceOps>,
                None => Box::new(HierarchicalOps::new(local, ops_job).with_compression(compression, seed))
                    as Box<dyn CrossDeviceOps>,
            }),
            workers: job.clone(),
            auto_shard: options.auto_shard,
        };
        let ext = LocalStrategy::build_with(
            "multi-worker-mirrored",
            options.local_devices,
            VariablePolicy::Mirrored,
            CpuReduction::InMemoryAllReduce,
            options.options,
            Some(cross),
        )?;
        Ok(Self { ext, job, config })
    }

    /// This task's cluster configuration.
    pub fn cluster(&self) -> &ClusterConfig {
        &self.config
    }

    /// Whether this worker is the chief (it writes checkpoints and summaries).
    pub fn is_chief(&self) -> bool {
        self.job.gen().rank == 0
    }

    /// This worker's index (0 is the chief; in an elastic job, in the current generation).
    pub fn worker_index(&self) -> usize {
        self.job.gen().rank
    }

    /// The number of workers in sync (in an elastic job, in the current generation).
    pub fn num_workers(&self) -> usize {
        self.job.gen().ring.size()
    }

    /// Tells every task that this one failed (its next collective or heartbeat fails). When
    /// the job already failed elsewhere (the coordination service said so, or is lost), there
    /// is nothing to tell, and nothing waits on a lost task.
    pub fn report_error(&self, error: &Error) {
        let abort = self.job.gen().abort.clone();
        let known = abort.reason().is_some();
        abort.abort(error.to_string());
        if known {
            return;
        }
        if let Some(m) = lock(&self.job.member).as_ref() {
            let _ = m.report_error(&error.to_string());
        }
    }

    /// Whether the job is elastic ([`MultiWorkerOptions::elastic`]).
    pub fn is_elastic(&self) -> bool {
        self.job.rejoin.is_some()
    }

    /// Leaves the job cleanly: sends what a table store still holds of the last step
    /// ([`TableStore::flush`](strata_core::embedding::TableStore::flush)), waits for every worker
    /// at a final barrier, then (on the chief) stops the coordination service once every task
    /// has left. An elastic job's members have met at the end of training already
    /// (`Trainer::fit` does it, re-forming if a worker is lost there), so they only leave.
    pub fn finish(&self) -> Result<()> {
        self.finish_with(None)
    }

    /// [`finish`](Self::finish) after training ended as `stopped` says: `None` when it
    /// finished, else the code (a signal's number) of the stop on request that ended it, which
    /// an elastic job's coordination service reports as the job's outcome.
    pub fn finish_with(&self, stopped: Option<u32>) -> Result<()> {
        if let Some(tables) = &self.ext.options().tables {
            tables.flush()?;
        }
        if !self.is_elastic() {
            self.job.barrier()?;
        }
        if let Some(mut m) = lock(&self.job.member).take() {
            m.leave_on_request(stopped.unwrap_or(0), false)
                .map_err(|e| Error::Cluster(format!("task {}: {e}", self.job.task)))?;
        }
        if let Some(s) = lock(&self.job.server).take() {
            s.shutdown_after_all_left(Duration::from_secs(30));
        }
        Ok(())
    }
}

/// Refuses local SGD with what it cannot take, each in one line saying what to change.
fn check_local_sgd(options: &MultiWorkerOptions) -> Result<()> {
    let Some(l) = &options.options.local_sgd else { return Ok(()) };
    l.check()?;
    let refuse = |what: &str| Err(Error::InvalidArgument(what.into()));
    if options.options.zero_stage != strata_core::ZeroStage::Off {
        return refuse(&format!(
            "zero stage {} shards over every worker's replicas, but local SGD steps each worker on its own: use zero stage 0 with a synchronisation period above 1",
            options.options.zero_stage
        ));
    }
    if options.cross_worker_ops.is_some() {
        return refuse(
            "local SGD meets the workers on the ring, not on cross-worker ops of your own (NCCL): use the ring with it",
        );
    }
    Ok(())
}

fn host_of(address: &str) -> String {
    match address.rsplit_once(':') {
        Some((h, _)) => h.to_string(),
        None => address.to_string(),
    }
}

/// Where the chief reaches its own coordination service: loopback when it binds every address,
/// else the one address it binds (a host of a real network binds that network's address).
fn loopback_for(bind: IpAddr) -> String {
    match bind {
        IpAddr::V6(a) if a.is_unspecified() => "[::1]".into(),
        IpAddr::V4(a) if a.is_unspecified() => "127.0.0.1".into(),
        IpAddr::V6(a) => format!("[{a}]"),
        IpAddr::V4(a) => a.to_string(),
    }
}

impl Strategy for MultiWorkerMirroredStrategy {
    fn extended(&self) -> &Arc<dyn StrategyExtended> {
        &self.ext
    }
}

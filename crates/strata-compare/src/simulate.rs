//! Simulated mode (`strata compare --simulate`): the experiment's strategies in *virtual* time,
//! over up to hundreds of workers, with the real update rules and real gradients of a small
//! model.
//!
//! Every figure a simulated run reports is virtual: the seconds are the model's seconds (compute
//! and communication times below), not measured ones, and [`RunResult::simulated`] is `true`.
//! What is real is the learning: the model is Strata's [`Mlp`] (of [`SimConfig::hidden`]) on
//! the digits data, the gradients are candle's backward pass on the parameter values a worker
//! actually had (stale ones, for asynchronous parameter servers), and every update is applied
//! with the parameter server's own optimizer, [`ServerOptimizer::apply`]. Accuracy, loss and
//! staleness therefore follow from the simulated schedule exactly as they would on a cluster
//! that ran with those timings.
//!
//! # The model
//!
//! The MLP is built once per call inside a [`OneDeviceStrategy`] scope seeded with the seed
//! ([`SimConfig::seed`], or the experiment's), so its initial values are those every real run
//! of the experiment starts from. One flat `f32` vector per variable holds the server's (the
//! model's) values; a gradient is computed by loading the values a worker pulled into the
//! model's variables, taking the mean cross-entropy of the worker's batch and reading the
//! gradients after `backward`. The optimizer is the experiment's `optimizer` and `lr` (or
//! [`SimConfig::optimizer`] / [`SimConfig::lr`]) mapped the way `strata train` maps them for a
//! parameter server ([`SimConfig::server_optimizer`], momentum 0.9, `strata train`'s
//! default); every strategy, synchronous or not, applies its updates with it, so the strategies
//! differ only in *which* gradients are applied and *when*.
//!
//! A synchronous round applies the mean of its workers' gradients. It is computed as one
//! backward pass over the workers' batches together (in worker order): with equal batches
//! and a mean loss that is the mean of the per-worker gradients (up to float rounding), at
//! the cost of one candle pass instead of N. The loss is candle-nn's `cross_entropy`
//! (log-softmax, the label's entry, the mean) written out with a weight per distinct row, so a
//! row drawn by several workers is computed once: a 256-worker round over the 1,438 training
//! rows costs at most 1,438 rows. Plain synchronous strategies (one-device, mirrored,
//! central-storage, multi-worker-mirrored, and parameter-server sync without backup workers)
//! apply exactly the same updates for a given worker count (only their clocks differ), so
//! their trajectory (losses and accuracies per update) is computed once per worker count and
//! shared. An asynchronous push's gradient is computed from the values its worker pulled when
//! the push is applied (it depends on nothing else), so a refused push costs no gradient.
//!
//! Each worker draws its batches of [`SimConfig::per_worker_batch`] examples from its own
//! seeded shuffle of the training split (80% of the data, as `strata train` splits it),
//! reshuffled every epoch; the k-th batch of worker w is the same under every strategy.
//!
//! # Time
//!
//! A worker's step (one gradient on its batch) takes `compute_ms x slowdown(w)` plus, with the
//! injection's random stragglers, a delay drawn with the straggler probability from the
//! injection's distribution. The draws come from a generator per worker seeded from the seed
//! and the worker's index, so the k-th step of worker w is equally slow under every strategy.
//!
//! Communication, with `L = latency_us + network_delay` (the injection's delay is added to
//! every message of every strategy), link bandwidth `B = bandwidth_gbps` and `M` = the model's
//! bytes (4 x parameters; with [`SimConfig::wire_parameters`], that model's):
//!
//! - **one-device**: one worker, no communication; a step takes the compute time.
//! - **mirrored, multi-worker-mirrored**: a ring all-reduce of the gradients after the slowest
//!   worker's compute: `2(N-1) (L + M / (N B))`, less what overlaps the backward pass
//!   ([`SimConfig::overlap`] of the compute). Each worker sends and receives `2(N-1) M / N`
//!   bytes.
//!
//! A run's `compression` sets `M` to the bytes its messages carry ([`SimConfig::wire_bytes`]:
//! half of f32 for fp16 and bf16, PowerSGD's factors for the weights that shrink at its rank).
//! Its effect on the gradients is not modelled: the trajectory is the uncompressed one (the
//! real runs measure it; see the guide's across-hosts chapter).
//! - **multi-worker-mirrored with `sync_every` above 1** (local SGD, DiLoCo): every worker
//!   steps on its own clock and its own copy of the model; a meeting is a ring all-reduce of
//!   the fragment's outer gradient, blocking without delay and behind the inner steps with
//!   one (see `local.rs`). Its learning is the real algorithm on the MLP.
//! - **central-storage**: the gradients are reduced onto the parameter device and the new
//!   values broadcast back, each phase one latency plus `N M / B` through the parameter
//!   device's link: `2 (L + N M / B)`. `N M` bytes each way.
//! - **parameter-server**: every pull and push is one message of `M` bytes split evenly over
//!   the `ps_tasks` tasks. Each task's link is a FIFO (one queue for pulls and pushes alike):
//!   a message reaches it after `L`, waits for the messages ahead of it, and occupies it for
//!   `M / ps_tasks / B`; the worker's own link needs `M / B`, so an uncontended message takes
//!   `L + M / B` and hundreds of asynchronous workers saturate the ps links.
//!   - *sync*: every round, all N workers pull, compute and push; the round ends when the
//!     `N - b` th push is delivered (`b` = backup workers), whose gradients are averaged into
//!     one update; the `b` late pushes are dropped (cancelled with the round, so their traffic
//!     does not delay the next one).
//!   - *async*: a discrete-event simulation: each worker pulls (the server's values when the
//!     pull is issued), computes, pushes; the server applies each push on delivery.
//!     Staleness = updates applied between the pull and the push's delivery. Events at the
//!     same virtual time keep the order they were scheduled in, so without stragglers the
//!     same workers win every race.
//!   - *stale* (bounded staleness): as async, but a push whose staleness is above the bound is
//!     refused and the worker pulls again and recomputes the same batch (the time is wasted).
//!
//! A run ends after [`SimConfig::max_updates`] updates, or at [`SimConfig::max_virtual_s`]
//! (no update is applied after it), whichever comes first.
//!
//! # Records
//!
//! - Synchronous strategies write one `Step` record per round (the N workers' steps
//!   aggregated, to keep 256-worker CSVs small): `step` counts rounds (as real runs of these
//!   strategies count replica-group steps), `loss` is the mean batch loss of the round, the
//!   bytes are summed over workers, `worker` is unset. Parameter-server sync rounds count
//!   pushes in `step` (as real parameter-server runs do), report `staleness` 0, and are
//!   followed by one `dropped` record per late backup push (its `worker` set, no `loss`).
//! - Asynchronous and stale runs write one `Step` record per push: `worker`, `staleness`,
//!   `loss` (of the gradient pushed), `bytes_sent` = the push, `bytes_received` = the pull
//!   before it. A refused stale push is a `dropped` record without `loss` or `staleness` (its
//!   staleness exceeded the bound and was not applied), so the staleness figures describe the
//!   applied pushes.
//! - `examples` counts the examples processed (gradients computed), dropped ones included, as
//!   real parameter-server runs count them.
//! - An `Eval` record (test accuracy and, as `validation_loss`, the mean cross-entropy in nats
//!   on the 20% test split) follows every
//!   [`SimConfig::eval_every_updates`]-th update and the `max_updates`-th.

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashMap};

use std::rc::Rc;

use candle_core::{Device, Tensor};
use strata_core::cross_device::compression::Compression;
use strata_core::data::Batch;
use strata_core::{Strategy, StrategyOptions};
use strata_strategies::OneDeviceStrategy;
use strata_transport::ps::ServerOptimizer;

use super::experiment::{Experiment, Injection, PsMode, RunSpec, RunStrategy};
use super::RunResult;
use strata::digits;
use strata::metrics::MetricRecord;
use strata::model::Mlp;

mod local;
mod parts;

pub use parts::Network;

use parts::{Clock, Evaluation, Net, Params, Progress, PsLink, Server, SimCore, Stream, SyncTrajectory};

use crate::sim_config::optimizer_kind;
pub use crate::sim_config::{SimConfig, MAX_WORKERS};
use crate::{Error, Result};

/// Momentum of `optimizer = "momentum"` and AdamW's beta1 (`strata train --momentum`'s default).
pub const MOMENTUM: f64 = 0.9;

/// What a simulated run does that depends on the experiment as well as on `[simulate]`.
impl SimConfig {
    /// The optimizer simulated runs apply (the override, or the experiment's).
    pub fn server_optimizer(&self, exp: &Experiment) -> Result<ServerOptimizer> {
        let name = self.optimizer.as_deref().unwrap_or(&exp.optimizer);
        let kind = optimizer_kind(name).map_err(Error::Usage)?;
        let lr = self.lr.unwrap_or(exp.lr);
        if !(lr.is_finite() && lr > 0.0) {
            return Err(Error::Usage(format!("lr must be a number above 0, not {lr}")));
        }
        Ok(kind.server_optimizer(strata::Hyper { lr, momentum: MOMENTUM }))
    }

    /// The network as this configuration models it, with `network_delay` added to every
    /// message.
    pub fn network(&self, network_delay: std::time::Duration) -> Network {
        Network {
            latency_s: self.latency_us * 1e-6 + network_delay.as_secs_f64(),
            bytes_per_s: self.bandwidth_gbps * 1e9 / 8.0,
            model_bytes: self.model_bytes() as f64,
        }
    }
}

/// Simulates every run of `exp` at every worker count of `cfg` (one-device once, with one
/// worker; a sync run with `backup_workers >= N` is skipped at that N), in the order of the
/// experiment's runs and, within a run, of `cfg.workers`.
///
/// A result is named `"{run}/N={n}"`, or just `"{run}"` when `cfg.workers` has one count.
/// `progress(name, fraction)` is called as each run advances (fraction in `[0, 1]`, 1 at its
/// end). Fails on an invalid `cfg` or optimizer, or if the digits data cannot be read.
pub fn simulate(exp: &Experiment, cfg: &SimConfig, progress: &dyn Fn(&str, f64)) -> Result<Vec<RunResult>> {
    simulate_with(exp, cfg, true, progress)
}

/// [`simulate`]'s clock alone: the same records and times, without the learning (every loss
/// 0, no evaluation). Only for synchronous and local-SGD runs, whose times do not depend on
/// what they learn; asynchronous parameter-server runs are simulated in full.
pub fn simulate_clock(exp: &Experiment, cfg: &SimConfig) -> Result<Vec<RunResult>> {
    simulate_with(exp, cfg, false, &|_, _| {})
}

fn simulate_with(
    exp: &Experiment,
    cfg: &SimConfig,
    learn: bool,
    progress: &dyn Fn(&str, f64),
) -> Result<Vec<RunResult>> {
    cfg.validate().map_err(Error::Usage)?;
    let mut sim = Simulator::new(exp, cfg)?;
    sim.learn = learn;
    sim.check_local_sgd(&exp.runs)?;
    let mut out = Vec::new();
    for spec in &exp.runs {
        let counts: Vec<usize> = if spec.strategy == RunStrategy::OneDevice { vec![1] } else { cfg.workers.clone() };
        for n in counts {
            if spec.mode == Some(PsMode::Sync) && spec.backup_workers >= n {
                continue;
            }
            let name = if cfg.workers.len() == 1 { spec.name.clone() } else { format!("{}/N={n}", spec.name) };
            out.push(sim.run(spec, n, &name, progress)?);
        }
    }
    Ok(out)
}

/// Why `--extrapolate` cannot run.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ExtrapolateError {
    /// No `[simulate] target_loss`.
    #[error("--extrapolate measures time to a test loss: set target_loss in [simulate], e.g. target_loss = 0.5")]
    NoTarget,
    /// No run to sweep.
    #[error("--extrapolate found no run of multi-worker-mirrored or parameter-server in the experiment: add one")]
    NoRuns,
}

impl From<ExtrapolateError> for Error {
    fn from(e: ExtrapolateError) -> Self {
        Error::Usage(e.to_string())
    }
}

/// One cell of the extrapolation: a run at one worker count and link rate.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Extrapolated {
    /// The run's name in the experiment.
    pub run: String,
    /// What it is: `sync`, `async ps`, `sync, powersgd:4`, `diloco H=100`, ...
    pub label: String,
    /// Workers.
    pub workers: usize,
    /// The link rate, gigabits per second.
    pub link_gbps: f64,
    /// Virtual seconds to the first evaluation at or below the target test loss.
    pub time_to_target_s: Option<f64>,
    /// Updates (rounds of inner steps, or pushes applied) until then.
    pub updates_to_target: Option<u64>,
    /// Bytes each worker sent until then (mean over workers).
    pub bytes_per_worker_to_target: Option<f64>,
    /// Whether the loss is modelled (`false`: PowerSGD, whose time is modelled on the
    /// uncompressed trajectory).
    pub loss_modelled: bool,
}

/// Time to `[simulate] target_loss` for every multi-worker run of `exp` (one-device and
/// central-storage left out) at every worker count of `cfg.workers` and link rate of
/// `cfg.links_gbps`. The learning of synchronous and local-SGD runs does not depend on the
/// link, so it is computed once per worker count; asynchronous runs are simulated again at
/// every rate (their staleness does depend on it).
pub fn extrapolate(exp: &Experiment, cfg: &SimConfig, progress: &dyn Fn(&str, f64)) -> Result<Vec<Extrapolated>> {
    cfg.validate().map_err(Error::Usage)?;
    let target = cfg.target_loss.ok_or(ExtrapolateError::NoTarget)?;
    let specs: Vec<&RunSpec> = exp
        .runs
        .iter()
        .filter(|s| matches!(s.strategy, RunStrategy::MultiWorkerMirrored | RunStrategy::ParameterServer))
        .collect();
    if specs.is_empty() {
        return Err(ExtrapolateError::NoRuns.into());
    }
    let mut sim = Simulator::new(exp, cfg)?;
    sim.check_local_sgd(&exp.runs)?;
    let mut out = Vec::new();
    for &gbps in &cfg.links_gbps {
        sim.network.bytes_per_s = gbps * 1e9 / 8.0;
        for spec in &specs {
            for &n in &cfg.workers {
                if spec.mode == Some(PsMode::Sync) && spec.backup_workers >= n {
                    continue;
                }
                let name = format!("{}/N={n}/{gbps}gbps", spec.name);
                let run = sim.run(spec, n, &name, progress)?;
                let hit = run.records.iter().find(|r| {
                    r.kind == strata::metrics::RecordKind::Eval
                        && r.validation_loss.is_some_and(|l| f64::from(l) <= target)
                });
                let bytes = hit.map(|h| {
                    run.records
                        .iter()
                        .filter(|r| r.kind == strata::metrics::RecordKind::Step && r.wall_s <= h.wall_s)
                        .map(|r| r.bytes_sent as f64)
                        .sum::<f64>()
                        / n as f64
                });
                out.push(Extrapolated {
                    run: spec.name.clone(),
                    label: extrapolation_label(spec),
                    workers: n,
                    link_gbps: gbps,
                    time_to_target_s: hit.map(|h| h.wall_s),
                    updates_to_target: hit.map(|h| h.updates),
                    bytes_per_worker_to_target: bytes,
                    loss_modelled: !matches!(spec.compression, Compression::PowerSgd { .. }),
                });
            }
        }
    }
    Ok(out)
}

/// A run's kind in the extrapolation table.
fn extrapolation_label(spec: &RunSpec) -> String {
    let base = match (spec.strategy, spec.mode_label(), &spec.local_sgd) {
        (RunStrategy::ParameterServer, Some(m), _) => format!("{m} ps"),
        (_, _, Some(l)) if !l.is_synchronous() => spec.mode_label().unwrap_or_else(|| "local SGD".into()),
        _ => "sync".into(),
    };
    match spec.compression {
        Compression::None => base,
        c => format!("{base}, {c}"),
    }
}

/// The model, the data and the settings shared by all runs of one call.
struct Simulator<'a> {
    cfg: &'a SimConfig,
    injection: &'a Injection,
    seed: u64,
    net: Net,
    train: Batch,
    test_x: Tensor,
    test_y: Tensor,
    test_len: usize,
    opt: ServerOptimizer,
    network: Network,
    /// The model's initial values (the variables themselves hold whatever was loaded last).
    initial: Params,
    /// Plain synchronous trajectories by worker count.
    sync_cache: HashMap<usize, SyncTrajectory>,
    /// Local-SGD trajectories by worker count and setting (its `Display`, the wire left out).
    local_cache: HashMap<(usize, String), Rc<local::LocalTrajectory>>,
    /// Whether synchronous and local-SGD runs learn (false: their clock only).
    learn: bool,
}

/// How a synchronous round's communication is timed.
#[derive(Clone, Copy, PartialEq)]
enum SyncComm {
    None,
    Ring,
    Central,
    Ps { ps_tasks: usize, backup: usize },
}

/// An event of the asynchronous simulation, ordered by time then by creation.
#[derive(PartialEq)]
struct Event {
    t: f64,
    seq: u64,
    worker: usize,
    arrive: bool,
}

impl Eq for Event {}

impl Ord for Event {
    fn cmp(&self, other: &Self) -> Ordering {
        self.t.total_cmp(&other.t).then(self.seq.cmp(&other.seq))
    }
}

impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// The asynchronous simulation's pending events.
#[derive(Default)]
struct Queue {
    heap: BinaryHeap<Reverse<Event>>,
    seq: u64,
}

impl Queue {
    /// Worker `worker`'s push is sent (`arrive` false) or delivered (true) at `t`.
    fn push(&mut self, t: f64, worker: usize, arrive: bool) {
        self.heap.push(Reverse(Event { t, seq: self.seq, worker, arrive }));
        self.seq += 1;
    }
}

/// An asynchronous worker's step in flight: the values it pulled and its batch. The gradient
/// is computed when the push is applied (it depends on nothing else), so refused pushes cost
/// no gradient.
struct Pending {
    rows: Vec<usize>,
    params: Rc<Params>,
    base: u64,
}

/// The asynchronous workers: batches, clocks and steps in flight.
struct AsyncWorkers {
    streams: Vec<Stream>,
    clock: Clock,
    pending: Vec<Option<Pending>>,
    /// The server's values at `snapshot_version`, shared by every pull of that version.
    snapshot: Option<(u64, Rc<Params>)>,
    per_worker: usize,
}

impl AsyncWorkers {
    /// Worker `w` pulls at `now` (the server's current values) and computes on `rows` (its
    /// next batch if none); its push is sent when the compute time has passed.
    fn start(
        &mut self,
        w: usize,
        now: f64,
        rows: Option<Vec<usize>>,
        server: &Server,
        queue: &mut Queue,
        link: &mut PsLink,
    ) {
        let rows = rows.unwrap_or_else(|| {
            let mut r = Vec::with_capacity(self.per_worker);
            self.streams[w].next_into(self.per_worker, &mut r);
            r
        });
        let params = match &self.snapshot {
            Some((v, p)) if *v == server.version => Rc::clone(p),
            _ => {
                let p = Rc::new(server.params.clone());
                self.snapshot = Some((server.version, Rc::clone(&p)));
                p
            }
        };
        let pulled = link.send(now);
        self.pending[w] = Some(Pending { rows, params, base: server.version });
        queue.push(pulled + self.clock.step_s(w), w, false);
    }
}

impl<'a> Simulator<'a> {
    fn new(exp: &'a Experiment, cfg: &'a SimConfig) -> Result<Self> {
        let seed = cfg.seed.unwrap_or(exp.seed);
        let opt = cfg.server_optimizer(exp)?;
        let all = digits::load(exp.data.as_deref())?;
        let (train, test) = digits::train_test_split(&all, 0.2, 0);
        let device = strata_core::device::logical_cpus(1)?.remove(0);
        let strategy = OneDeviceStrategy::with_options(device, StrategyOptions { seed, ..Default::default() })?;
        let hidden = cfg.hidden.clone();
        let model = strategy.scope(|s| Mlp::new(s.var_builder(), digits::FEATURES, &hidden, digits::CLASSES))?;
        let vars = model.variables(0).iter().map(|(_, v)| v.clone()).collect();
        let net = Net { model, vars };
        let initial =
            net.vars.iter().map(|v| Ok(v.as_tensor().flatten_all()?.to_vec1::<f32>()?)).collect::<Result<Params>>()?;
        Ok(Self {
            initial,
            cfg,
            injection: &exp.injection,
            seed,
            test_x: test.features_tensor(&Device::Cpu)?,
            test_y: test.labels_tensor(&Device::Cpu)?,
            test_len: test.len(),
            train,
            net,
            opt,
            network: cfg.network(exp.injection.network_delay),
            sync_cache: HashMap::new(),
            local_cache: HashMap::new(),
            learn: true,
        })
    }

    fn run(&mut self, spec: &RunSpec, n: usize, name: &str, progress: &dyn Fn(&str, f64)) -> Result<RunResult> {
        // Every message of this run carries the compressed bytes.
        let plain = self.network;
        self.network.model_bytes = self.cfg.wire_bytes(spec.compression) as f64;
        let result = self.run_compressed(spec, n, name, progress);
        self.network = plain;
        result
    }

    fn run_compressed(
        &mut self,
        spec: &RunSpec,
        n: usize,
        name: &str,
        progress: &dyn Fn(&str, f64),
    ) -> Result<RunResult> {
        let mut progress = Progress { name, f: progress, last: -1.0 };
        progress.update(0.0);
        let (records, wall_s) = match (spec.strategy, spec.mode) {
            (RunStrategy::MultiWorkerMirrored, _) if spec.local_sgd.as_ref().is_some_and(|l| !l.is_synchronous()) => {
                let l = spec.local_sgd.as_ref().expect("checked above");
                self.run_local(l, n, &mut progress)?
            }
            (RunStrategy::OneDevice, _) => self.run_sync(n, SyncComm::None, &mut progress)?,
            (RunStrategy::Mirrored | RunStrategy::MultiWorkerMirrored, _) => {
                self.run_sync(n, SyncComm::Ring, &mut progress)?
            }
            (RunStrategy::CentralStorage, _) => self.run_sync(n, SyncComm::Central, &mut progress)?,
            (RunStrategy::ParameterServer, None | Some(PsMode::Async)) => {
                self.run_async(n, spec.ps_tasks, None, &mut progress)?
            }
            (RunStrategy::ParameterServer, Some(PsMode::Stale)) => {
                self.run_async(n, spec.ps_tasks, Some(spec.staleness), &mut progress)?
            }
            (RunStrategy::ParameterServer, Some(PsMode::Sync)) => {
                self.run_sync(n, SyncComm::Ps { ps_tasks: spec.ps_tasks, backup: spec.backup_workers }, &mut progress)?
            }
            // The experiment file refuses [simulate] for the ctr model, hybrid's only one.
            (_, Some(PsMode::Hybrid)) => {
                return Err(Error::Usage(format!(
                    "{name}: hybrid parameter servers are not simulated (the simulator models the digits MLP, which has no embedding table); drop --simulate"
                )))
            }
        };
        (progress.f)(name, 1.0);
        Ok(RunResult {
            name: name.to_string(),
            strategy: spec.strategy.name().to_string(),
            mode: spec.mode_label(),
            workers: n,
            global_batch: n * self.cfg.per_worker_batch,
            simulated: true,
            records,
            error: None,
            wall_s,
            hosts: 0,
            link_goodput_bps: None,
            faults: Vec::new(),
            relaunches: 0,
            local_sgd: None,
            ctr: None,
        })
    }

    fn core(&self) -> SimCore<'_> {
        SimCore {
            cfg: self.cfg,
            net: &self.net,
            train: &self.train,
            test_x: &self.test_x,
            test_y: &self.test_y,
            test_len: self.test_len,
            opt: &self.opt,
        }
    }

    /// The loss of update `round + 1` of the plain synchronous trajectory with `n` workers,
    /// and the accuracy after it if it is evaluated.
    fn plain_round(&mut self, n: usize, round: u64) -> Result<(f32, Option<Evaluation>)> {
        // Out of the cache while it advances (the model and data stay borrowed from `self`).
        let mut traj = match self.sync_cache.remove(&n) {
            Some(t) => t,
            None => SyncTrajectory {
                state: self.core().sync_state(Server::new(self.initial.clone(), &self.opt), self.seed, n),
                losses: Vec::new(),
                accuracy: HashMap::new(),
            },
        };
        let advanced = self.advance(&mut traj, n, round);
        self.sync_cache.insert(n, traj);
        advanced
    }

    /// Advances `traj` (of `n` workers) through update `round + 1`.
    fn advance(&self, traj: &mut SyncTrajectory, n: usize, round: u64) -> Result<(f32, Option<Evaluation>)> {
        let core = self.core();
        let all = vec![true; n];
        while traj.losses.len() as u64 <= round {
            let loss = traj.state.round(&core, &all)?;
            traj.losses.push(loss);
            let updates = traj.losses.len() as u64;
            if core.evaluates(updates) {
                traj.accuracy.insert(updates, core.accuracy(&traj.state.server.params)?);
            }
        }
        Ok((traj.losses[round as usize], traj.accuracy.get(&(round + 1)).copied()))
    }

    /// A synchronous run: one update per round.
    fn run_sync(&mut self, n: usize, comm: SyncComm, progress: &mut Progress<'_>) -> Result<(Vec<MetricRecord>, f64)> {
        let cfg = self.cfg;
        let m = self.network.model_bytes as u64;
        let nu = n as u64;
        let b = cfg.per_worker_batch as u64;
        let mut clock = Clock::new(cfg, self.injection, self.seed, n);
        let backup = match comm {
            SyncComm::Ps { backup, .. } => backup,
            _ => 0,
        };
        // Backup workers change which gradients are applied: their trajectory is their own.
        let mut own = if backup > 0 {
            let server = Server::new(self.initial.clone(), &self.opt);
            Some(self.core().sync_state(server, self.seed, n))
        } else {
            None
        };
        let mut link = match comm {
            SyncComm::Ps { ps_tasks, .. } => Some(PsLink::new(&self.network, ps_tasks)),
            _ => None,
        };
        let (mut records, mut t, mut steps, mut examples) = (Vec::new(), 0.0f64, 0u64, 0u64);
        let mut compute = vec![0.0; n];
        for round in 0..cfg.max_updates {
            for (w, c) in compute.iter_mut().enumerate() {
                *c = clock.step_s(w);
            }
            let slowest = compute.iter().copied().fold(0.0, f64::max);
            let (end, applied, sent, received) = match comm {
                SyncComm::None => (t + slowest, vec![true; n], 0, 0),
                SyncComm::Ring => {
                    let bytes = 2 * (nu - 1) * m;
                    let exposed = (self.network.ring_allreduce_s(n) - cfg.overlap * slowest).max(0.0);
                    (t + slowest + exposed, vec![true; n], bytes, bytes)
                }
                SyncComm::Central => (t + slowest + self.network.central_storage_s(n), vec![true; n], nu * m, nu * m),
                SyncComm::Ps { .. } => {
                    let link = link.as_mut().expect("ps runs have a link");
                    link.free = t;
                    let pulled: Vec<f64> = (0..n).map(|_| link.send(t)).collect();
                    let mut order: Vec<usize> = (0..n).collect();
                    order.sort_by(|&a, &c| {
                        (pulled[a] + compute[a]).total_cmp(&(pulled[c] + compute[c])).then(a.cmp(&c))
                    });
                    let mut delivered: Vec<(f64, usize)> =
                        order.iter().map(|&w| (link.send(pulled[w] + compute[w]), w)).collect();
                    delivered.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)));
                    let mut applied = vec![false; n];
                    for &(_, w) in &delivered[..n - backup] {
                        applied[w] = true;
                    }
                    (delivered[n - backup - 1].0, applied, (nu - backup as u64) * m, nu * m)
                }
            };
            if cfg.max_virtual_s.is_some_and(|cap| end > cap) {
                break;
            }
            t = end;
            let updates = round + 1;
            let (loss, accuracy) = match own.as_mut() {
                Some(state) => {
                    let core = self.core();
                    let loss = state.round(&core, &applied)?;
                    let acc = if core.evaluates(updates) { Some(core.accuracy(&state.server.params)?) } else { None };
                    (loss, acc)
                }
                None if !self.learn => (0.0, None),
                None => self.plain_round(n, round)?,
            };
            let is_ps = matches!(comm, SyncComm::Ps { .. });
            let used = (n - backup) as u64;
            steps += if is_ps { used } else { 1 };
            examples += used * b;
            let mut r = MetricRecord::step(steps, updates, t, examples, loss);
            r.bytes_sent = sent;
            r.bytes_received = received;
            if is_ps {
                r.staleness = Some(0);
            }
            records.push(r);
            for w in (0..n).filter(|&w| !applied[w]) {
                steps += 1;
                examples += b;
                let mut d = MetricRecord::step(steps, updates, t, examples, 0.0);
                d.loss = None;
                d.bytes_sent = m;
                d.worker = Some(w as u32);
                d.dropped = true;
                records.push(d);
            }
            if let Some(a) = accuracy {
                records.push(a.record(steps, updates, t, examples));
            }
            progress.update(self.fraction(updates, t));
        }
        Ok((records, t))
    }

    /// Refuses a local-SGD run the simulated MLP cannot split into its fragments.
    fn check_local_sgd(&self, runs: &[RunSpec]) -> Result<()> {
        let vars = self.net.vars.len();
        for spec in runs {
            if let Some(l) = spec.local_sgd.as_ref().filter(|l| l.fragments > vars) {
                return Err(Error::Usage(format!(
                    "run {}: {} fragments of the simulated MLP's {vars} variables: use at most {vars} fragments, or more hidden layers in [simulate] hidden",
                    spec.name, l.fragments
                )));
            }
        }
        Ok(())
    }

    /// A local-SGD (DiLoCo) run: the trajectory (cached), then its clock.
    fn run_local(
        &mut self,
        l: &strata::LocalSgd,
        n: usize,
        progress: &mut Progress<'_>,
    ) -> Result<(Vec<MetricRecord>, f64)> {
        let key = (n, l.to_string());
        let traj = match self.local_cache.get(&key) {
            _ if !self.learn => Rc::new(local::LocalTrajectory::clock_only(self.cfg.max_updates)),
            Some(t) => Rc::clone(t),
            None => {
                let t = Rc::new(local::trajectory(&self.core(), &self.initial, self.seed, n, l, progress)?);
                self.local_cache.insert(key, Rc::clone(&t));
                t
            }
        };
        let shapes: Vec<Vec<usize>> = self.net.vars.iter().map(|v| v.dims().to_vec()).collect();
        let frag = local::fragment_bytes(l, &shapes, self.network.model_bytes, self.cfg.wire_parameters.is_some());
        let network = self.network;
        let ring = move |bytes: f64| network.ring_s(n, bytes);
        let clock = Clock::new(self.cfg, self.injection, self.seed, n);
        Ok(local::timeline(&traj, l, self.cfg, clock, &ring, &frag, n))
    }

    fn fraction(&self, updates: u64, t: f64) -> f64 {
        let by_updates = updates as f64 / self.cfg.max_updates as f64;
        match self.cfg.max_virtual_s {
            Some(cap) => by_updates.max(t / cap),
            None => by_updates,
        }
    }

    /// An asynchronous (or, with a bound, bounded-staleness) parameter-server run.
    fn run_async(
        &self,
        n: usize,
        ps_tasks: usize,
        bound: Option<u64>,
        progress: &mut Progress<'_>,
    ) -> Result<(Vec<MetricRecord>, f64)> {
        let cfg = self.cfg;
        let core = self.core();
        let m = self.network.model_bytes as u64;
        let b = cfg.per_worker_batch;
        let mut link = PsLink::new(&self.network, ps_tasks);
        let mut server = Server::new(self.initial.clone(), &self.opt);
        let mut workers = AsyncWorkers {
            streams: (0..n).map(|w| Stream::new(self.seed, w, self.train.len())).collect(),
            clock: Clock::new(cfg, self.injection, self.seed, n),
            pending: (0..n).map(|_| None).collect(),
            snapshot: None,
            per_worker: b,
        };
        let mut queue = Queue::default();
        let mut counts = vec![0u32; self.train.len()];
        for w in 0..n {
            workers.start(w, 0.0, None, &server, &mut queue, &mut link);
        }
        let (mut records, mut t, mut steps, mut examples) = (Vec::new(), 0.0f64, 0u64, 0u64);
        while let Some(Reverse(ev)) = queue.heap.pop() {
            if !ev.arrive {
                queue.push(link.send(ev.t), ev.worker, true);
                continue;
            }
            if cfg.max_virtual_s.is_some_and(|cap| ev.t > cap) {
                break;
            }
            t = ev.t;
            let w = ev.worker;
            let p = workers.pending[w].take().expect("a push in flight has its step");
            let staleness = server.version - p.base;
            steps += 1;
            examples += b as u64;
            let mut r = MetricRecord::step(steps, server.version, t, examples, 0.0);
            r.bytes_sent = m;
            r.bytes_received = m;
            r.worker = Some(w as u32);
            if bound.is_some_and(|s| staleness > s) {
                r.loss = None;
                r.dropped = true;
                records.push(r);
                workers.start(w, t, Some(p.rows), &server, &mut queue, &mut link);
                continue;
            }
            let (loss, grad) = core.net.gradient(&p.params, core.train, &p.rows, &mut counts)?;
            drop(p);
            server.apply(core.opt, &grad);
            r.updates = server.version;
            r.loss = Some(loss);
            r.staleness = Some(staleness);
            records.push(r);
            if core.evaluates(server.version) {
                let a = core.accuracy(&server.params)?;
                records.push(a.record(steps, server.version, t, examples));
            }
            progress.update(self.fraction(server.version, t));
            if server.version >= cfg.max_updates {
                break;
            }
            workers.start(w, t, None, &server, &mut queue, &mut link);
        }
        Ok((records, t))
    }
}

//! `strata ps`, `strata worker`, and `strata train --strategy parameter-server`.
//!
//! Every task of a ParameterServerStrategy job runs this one binary: `strata ps` serves
//! variables, `strata worker` runs the step functions registered in it (the training step of every model), and
//! `strata train --strategy parameter-server` is the coordinator. Without `TF_CONFIG`, `strata
//! train` starts the ps and worker processes itself on loopback, and stops them when it ends,
//! fails or is interrupted; with `TF_CONFIG`, each task acts as its `task.type` says.

use std::net::{IpAddr, SocketAddr};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use strata_strategies::cluster::{
    ClusterConfig, ClusterResolver, ClusterSpec, TFConfigClusterResolver, TaskId, TaskType,
};
use strata_strategies::parameter_server::{
    serve_worker, ParameterServerOptions, ParameterServerStrategy, Partitioner, WorkerOptions,
};
use strata_transport::ps::{job_task_dir, FaultInjection, PsMode, PsServerConfig, PsServerHandle};
use strata_transport::{ClusterToken, MutualTls};

use strata::ps_job::{self, PsJobModel, PsJobSpec, PsTrainConfig, WorkerStepOptions};
use strata_compare::inject::StepDelays;

use crate::cluster_token::{self, TOKEN_VAR};
use crate::launch;
pub use crate::summary::{PsSummary, PsTaskSummary};
use crate::train_args::{self, ClusterSource, ModelKind, PsModeKind, StaleRateKind, TrainArgs, TRANSFORMER_STEPS};
use crate::{Error, Result};

/// `strata ps` flags: serve one parameter-server task until the chief ends the job, SIGTERM or
/// Ctrl-C.
#[derive(clap::Args, Debug, Clone)]
pub struct PsArgs {
    /// Listen here (host:port). Default: this task's address in `TF_CONFIG`, on --bind.
    #[arg(long)]
    pub address: Option<String>,
    /// This task's index (`ps:<index>`) when --address is given without `TF_CONFIG`.
    #[arg(long, default_value_t = 0)]
    pub task_index: usize,
    /// The IP address to bind to with `TF_CONFIG`'s port (0.0.0.0 on a real cluster).
    #[arg(long, default_value = "127.0.0.1")]
    pub bind: IpAddr,
    /// The cluster token's file (default: the STRATA_CLUSTER_TOKEN variable).
    #[arg(long)]
    pub cluster_token_file: Option<PathBuf>,
    /// Write checkpoints here when the coordinator asks (`ckpt-<step>` directories).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Start from the latest checkpoint in this directory (or this `ckpt-<step>` directory); or,
    /// when it holds every ps task's checkpoints of an earlier job (`ps-0`, `ps-1`, ...: what
    /// `strata train --checkpoint-dir` writes), from their latest common step, onto this task of
    /// a job of any number of ps tasks (its index and their number from `TF_CONFIG`, or
    /// --task-index and --ps-tasks).
    #[arg(long)]
    pub restore: Option<PathBuf>,
    /// The step of --restore to restore (default: the latest; for a whole job's checkpoints,
    /// the latest every ps task has).
    #[arg(long, value_name = "STEP", requires = "restore")]
    pub restore_step: Option<u64>,
    /// This job's number of ps tasks, when --address is given without `TF_CONFIG`: what a
    /// --restore of a whole job's checkpoints needs (with --task-index).
    #[arg(long, value_name = "N")]
    pub ps_tasks: Option<usize>,
    /// Checkpoints to keep.
    #[arg(long, default_value_t = 3)]
    pub keep_checkpoints: usize,
    /// Apply async and stale pushes of at least this many MiB while they arrive, each chunk as
    /// it comes (the task then keeps a spare copy of the variables and slots they update).
    #[arg(long, default_value_t = 2.0)]
    pub stream_min_mib: f64,
    /// Apply every push after its last chunk, in place: no spare copy of the variables.
    #[arg(long)]
    pub no_stream: bool,
    /// Exit with an error once no call at all has come for this long (the chief probes every
    /// task twice a second, so silence means the chief is gone for good), e.g. 60s; 0 serves
    /// until stopped. The chief's end of the job (`Finish`) ends the task at once, exit code 0.
    #[arg(long, default_value = "60s", value_name = "DURATION", value_parser = strata_compare::experiment::parse_duration_or_seconds)]
    pub chief_timeout: Duration,
    /// Test facility: apply every Nth push but answer it as lost (UNAVAILABLE).
    #[arg(long, hide = true, default_value_t = 0)]
    pub inject_drop_reply_every: u64,
    /// Test facility: refuse every Nth push before applying it (UNAVAILABLE).
    #[arg(long, hide = true, default_value_t = 0)]
    pub inject_drop_request_every: u64,
}

/// `strata worker` flags: run the registered step functions for a coordinator until it ends the
/// job, or SIGTERM.
#[derive(clap::Args, Debug, Clone)]
pub struct WorkerArgs {
    /// Listen here (host:port). Default: this task's address in `TF_CONFIG`, on --bind.
    #[arg(long)]
    pub address: Option<String>,
    /// This task's index (`worker:<index>`) when --address is given without `TF_CONFIG`.
    #[arg(long, default_value_t = 0)]
    pub task_index: usize,
    /// The parameter servers, comma-separated host:port in task order (default: `TF_CONFIG`'s).
    #[arg(long, value_delimiter = ',')]
    pub ps: Vec<String>,
    /// The IP address to bind to with `TF_CONFIG`'s port (0.0.0.0 on a real cluster).
    #[arg(long, default_value = "127.0.0.1")]
    pub bind: IpAddr,
    /// The cluster token's file (default: the STRATA_CLUSTER_TOKEN variable).
    #[arg(long)]
    pub cluster_token_file: Option<PathBuf>,
    /// Slow this worker down by this factor (a straggler, for experiments).
    #[arg(long, default_value_t = 1.0)]
    pub slowdown: f64,
    /// Random stragglers: the chance that a step is delayed (with --straggler-delay).
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    pub straggler_probability: f64,
    /// Random stragglers: fixed:50ms, uniform:10ms..50ms or exp:20ms.
    #[arg(long, value_name = "DISTRIBUTION")]
    pub straggler_delay: Option<String>,
    /// Seed of the straggler draws.
    #[arg(long, default_value_t = 0)]
    pub inject_seed: u64,
    /// Add this delay to every pull and push, e.g. 2ms.
    #[arg(long, value_name = "DURATION", value_parser = strata_compare::experiment::parse_duration)]
    pub network_delay: Option<Duration>,
    /// Exit with an error once no call at all has come for this long (the chief probes every
    /// task twice a second, so silence means the chief is gone for good), e.g. 60s; 0 serves
    /// until stopped. The chief's end of the job (`Finish`) ends the task at once, exit code 0.
    #[arg(long, default_value = "60s", value_name = "DURATION", value_parser = strata_compare::experiment::parse_duration_or_seconds)]
    pub chief_timeout: Duration,
}

/// This task's cluster from `TF_CONFIG`, if the variable is set.
fn tf_config() -> Result<Option<ClusterConfig>> {
    if std::env::var_os("TF_CONFIG").is_none() {
        return Ok(None);
    }
    let resolver = TFConfigClusterResolver::from_env()?;
    Ok(Some(resolver.resolve()?))
}

/// Where a task listens: --address, or its `TF_CONFIG` port on --bind.
fn listen_address(
    address: &Option<String>,
    bind: IpAddr,
    cluster: Option<&ClusterConfig>,
    kind: TaskType,
) -> Result<SocketAddr> {
    if let Some(a) = address {
        return a.parse().map_err(|_| {
            Error::Usage(format!("--address {a:?} is not host:port with an IP host, e.g. 127.0.0.1:2222"))
        });
    }
    let Some(c) = cluster else {
        return Err(Error::Usage(format!(
            "no address for this {kind} task: pass --address host:port, or set TF_CONFIG with a {kind} task"
        )));
    };
    if c.task.kind != kind {
        return Err(Error::Usage(format!(
            "TF_CONFIG says this task is {}, but `strata {kind}` runs a {kind} task; fix task.type in TF_CONFIG",
            c.task
        )));
    }
    Ok(SocketAddr::new(bind, c.port()?))
}

/// Serves until SIGINT, SIGTERM or SIGHUP (handled from the start of the subcommand, see
/// `signals`), the chief's end of the job, or `chief_timeout` (not zero) without a call after
/// the first; then stops serving. `task` (`ps:0`) names the task in its last line.
fn serve_until_done<K>(
    task: &str,
    server: strata_transport::ServerHandle<K>,
    signals: &std::sync::mpsc::Receiver<Signal>,
    chief_timeout: Duration,
) -> Result<()> {
    use std::sync::mpsc::RecvTimeoutError;
    let outcome = loop {
        match signals.recv_timeout(Duration::from_millis(100)) {
            Ok(signal) => {
                eprintln!("{task}: {signal} received; stopping");
                break Ok(());
            }
            Err(RecvTimeoutError::Disconnected) => break Ok(()),
            Err(RecvTimeoutError::Timeout) => {}
        }
        if let Some(why) = server.finished() {
            eprintln!("{task}: {why}; the job is over, exiting");
            break Ok(());
        }
        if let Some(silent) = server.idle_for().filter(|s| !chief_timeout.is_zero() && *s >= chief_timeout) {
            break Err(Error::ChiefLost { task: task.to_string(), silent });
        }
    };
    server.shutdown();
    outcome
}

/// Runs `strata ps`.
pub fn run_ps(args: &PsArgs) -> Result<()> {
    let cluster = if args.address.is_some() { None } else { tf_config()? };
    run_ps_in(args, cluster)
}

/// Runs a ps task of `cluster` (resolved by the caller), or of `--address` alone.
fn run_ps_in(args: &PsArgs, cluster: Option<ClusterConfig>) -> Result<()> {
    let address = listen_address(&args.address, args.bind, cluster.as_ref(), TaskType::Ps)?;
    let index = cluster.as_ref().map_or(args.task_index, |c| c.task.index);
    if let Some(dir) = &args.checkpoint_dir {
        train_args::checkpoint_dir_writable(dir)?;
    }
    let signals = crate::signals::handle()?;
    let mut config =
        PsServerConfig::new(format!("ps:{index}"), cluster_token::resolve(args.cluster_token_file.as_deref())?);
    config.checkpoint_dir = args.checkpoint_dir.clone();
    config.keep_checkpoints = args.keep_checkpoints.max(1);
    config.restore = args.restore.clone();
    config.restore_step = args.restore_step;
    config.job_place = job_place(args, cluster.as_ref(), index)?;
    config.faults = FaultInjection {
        drop_reply_every: args.inject_drop_reply_every,
        drop_request_every: args.inject_drop_request_every,
    };
    if !(args.stream_min_mib.is_finite() && args.stream_min_mib >= 0.0) {
        return Err(Error::Usage(format!(
            "--stream-min-mib {} is not a size: give a number of MiB, 0 or more (or --no-stream)",
            args.stream_min_mib
        )));
    }
    config.stream_min_bytes = (!args.no_stream).then_some((args.stream_min_mib * (1 << 20) as f64) as usize);
    let server = PsServerHandle::start(address, config).map_err(strata_core::Error::from)?;
    eprintln!("ps:{index} listening on {}", server.address());
    serve_until_done(&format!("ps:{index}"), server, &signals, args.chief_timeout)
}

/// Runs `strata worker`.
pub fn run_worker(args: &WorkerArgs) -> Result<()> {
    let cluster = if args.address.is_some() && !args.ps.is_empty() { None } else { tf_config()? };
    run_worker_in(args, cluster)
}

/// This ps task's index and its job's number of ps tasks (`TF_CONFIG`'s, or --task-index and
/// --ps-tasks), checked; required when --restore names a whole job's checkpoints.
fn job_place(args: &PsArgs, cluster: Option<&ClusterConfig>, index: usize) -> Result<Option<(u32, u32)>> {
    let num = match (cluster, args.ps_tasks) {
        (Some(c), Some(n)) if n != c.spec.num_tasks(TaskType::Ps) => {
            return Err(Error::Usage(format!(
                "--ps-tasks {n}, but TF_CONFIG's cluster has {} ps tasks; drop --ps-tasks",
                c.spec.num_tasks(TaskType::Ps)
            )))
        }
        (Some(c), _) => Some(c.spec.num_tasks(TaskType::Ps)),
        (None, n) => n,
    };
    let job_tasks = match &args.restore {
        Some(dir) => strata_transport::ps::job_checkpoint_tasks(dir)?,
        None => None,
    };
    let Some(num) = num else {
        if let (Some(dir), Some(old)) = (&args.restore, job_tasks) {
            return Err(Error::Usage(format!(
                "--restore {} holds the checkpoints of a job's {old} ps tasks (ps-0, ps-1, ...): pass --ps-tasks N, this job's number of ps tasks, with --task-index (or set TF_CONFIG)",
                dir.display()
            )));
        }
        return Ok(None);
    };
    match (u32::try_from(index), u32::try_from(num)) {
        (Ok(i), Ok(n)) if i < n => Ok(Some((i, n))),
        _ => Err(Error::Usage(format!(
            "ps task {index} of {num}: --task-index must be below --ps-tasks (or TF_CONFIG's number of ps tasks)"
        ))),
    }
}

/// Runs a worker task of `cluster` (resolved by the caller), or of `--address` and `--ps`.
fn run_worker_in(args: &WorkerArgs, cluster: Option<ClusterConfig>) -> Result<()> {
    if !(args.slowdown.is_finite() && args.slowdown >= 1.0) {
        return Err(Error::Usage(format!("--slowdown {} must be 1 or more", args.slowdown)));
    }
    let address = listen_address(&args.address, args.bind, cluster.as_ref(), TaskType::Worker)?;
    let index = cluster.as_ref().map_or(args.task_index, |c| c.task.index);
    let ps: Vec<String> = if !args.ps.is_empty() {
        args.ps.clone()
    } else {
        let c = cluster.as_ref().ok_or_else(|| Error::Usage("pass --ps host:port,... or set TF_CONFIG".into()))?;
        c.spec.require_ps()?;
        (0..c.spec.num_tasks(TaskType::Ps))
            .map(|i| c.spec.address(TaskId::ps(i)).map(str::to_string))
            .collect::<Result<_, _>>()?
    };
    let signals = crate::signals::handle()?;
    let mut options = WorkerOptions::new(index, ps, cluster_token::resolve(args.cluster_token_file.as_deref())?);
    options.task_index = index;
    let mut delays =
        StepDelays::from_flags(&[], args.straggler_probability, args.straggler_delay.as_deref(), args.inject_seed)?;
    delays.slowdown = vec![(index, args.slowdown)];
    if let Some(d) = args.network_delay {
        strata_transport::inject::set_network_delay(d);
    }
    let hook = (!delays.is_empty()).then(|| Arc::new(delays) as Arc<dyn strata::trainer::StepHook>);
    let registry = ps_job::worker_registry(WorkerStepOptions { hook });
    let server = serve_worker(address, registry, options)?;
    eprintln!("worker:{index} listening on {}", server.address());
    serve_until_done(&format!("worker:{index}"), server, &signals, args.chief_timeout)
}

fn ps_mode(args: &TrainArgs, workers: usize) -> Result<PsMode> {
    Ok(match args.ps_mode {
        PsModeKind::Async => PsMode::Async,
        PsModeKind::Sync => {
            if args.backup_workers as usize >= workers {
                return Err(Error::Usage(format!(
                    "--backup-workers {} leaves no worker to aggregate out of {workers}; pass fewer than {workers}",
                    args.backup_workers
                )));
            }
            PsMode::Sync { workers: workers as u32, backup_workers: args.backup_workers }
        }
        PsModeKind::Stale => PsMode::Stale { staleness: args.staleness },
        // The ps tasks of a hybrid job apply each worker's rows as they arrive.
        PsModeKind::Hybrid => PsMode::Async,
    })
}

/// The ps tasks' learning-rate schedule: the transformer's, as under the other strategies
/// ([`train_args::transformer_schedule`]), over the optimizer steps the ps tasks will count:
/// every scheduled step is one applied push to every ps task in async and stale modes, and a
/// sync round takes one step of each of the `workers` (backups' dropped ones included), so a
/// task counts `ceil(--steps / workers)` rounds per epoch. The digits models keep the constant
/// `--lr` (as they do under the other strategies).
fn ps_schedule(args: &TrainArgs, mode: PsMode, workers: usize) -> Option<strata_transport::ps::LrSchedule> {
    if args.model != ModelKind::Transformer {
        return None;
    }
    let steps = args.steps.unwrap_or(TRANSFORMER_STEPS);
    let per_epoch = match mode {
        PsMode::Sync { .. } => steps.div_ceil(workers.max(1)),
        PsMode::Async | PsMode::Stale { .. } => steps,
    };
    let total = per_epoch.saturating_mul(args.epochs()) as u64;
    // Without a step the job is refused for its --steps, not for its schedule.
    (total > 0).then(|| train_args::transformer_schedule(args.lr, total))
}

/// The slow workers and stragglers of `--worker-slowdown` and `--straggler-*`, checked
/// against the number of workers.
fn step_delays(args: &TrainArgs, workers: usize) -> Result<StepDelays> {
    let delays = args.step_delays()?;
    if let Some((i, _)) = delays.slowdown.iter().find(|(i, _)| *i >= workers) {
        return Err(Error::Usage(format!("--worker-slowdown {i}=...: the index must be below --workers {workers}")));
    }
    Ok(delays)
}

/// Child processes of a local run, stopped (SIGTERM, then SIGKILL) when dropped, on Ctrl-C, and
/// when a ps task dies.
pub(crate) struct LocalCluster {
    children: Arc<Mutex<Vec<(TaskId, Child)>>>,
    /// Raised when the chief ends the job: tasks that exit from then on are not lost.
    pub(crate) finishing: Arc<std::sync::atomic::AtomicBool>,
}

fn stop_children(children: &Mutex<Vec<(TaskId, Child)>>) {
    let mut children = children.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    for (_, c) in children.iter() {
        let group = Pid::from_raw(-(c.id() as i32));
        let _ = kill(group, Signal::SIGTERM);
        // A stopped task (SIGSTOP) holds a handled SIGTERM until it runs again.
        let _ = kill(group, Signal::SIGCONT);
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    for (_, c) in children.iter_mut() {
        while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if matches!(c.try_wait(), Ok(None)) {
            let _ = kill(Pid::from_raw(-(c.id() as i32)), Signal::SIGKILL);
            let _ = c.wait();
        }
    }
    children.clear();
}

impl LocalCluster {
    /// Stops every task this cluster started (what a process that exits at once does first).
    pub(crate) fn stopper(&self) -> impl Fn() + Send + Sync + 'static {
        let children = self.children.clone();
        move || stop_children(&children)
    }

    /// Waits up to `within` for every task to exit by itself (after the chief ended the job).
    pub(crate) fn wait_exited(&self, within: Duration) {
        let deadline = Instant::now() + within;
        let mut children = self.children.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        while Instant::now() < deadline && children.iter_mut().any(|(_, c)| matches!(c.try_wait(), Ok(None))) {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        stop_children(&self.children);
    }
}

impl LocalCluster {
    /// Starts the ps and worker tasks of `cluster` as processes of this executable: `strata ps`
    /// and `strata worker` tasks, or, for a hybrid job (`hybrid`), every worker but worker 0
    /// (this process) as `strata train` with this process's arguments.
    pub(crate) fn start(
        args: &TrainArgs,
        cluster: &ClusterSpec,
        token: &str,
        delays: &StepDelays,
        hybrid: bool,
        resume: Option<u64>,
    ) -> Result<Self> {
        let exe = std::env::current_exe().map_err(|e| Error::io("finding the strata executable", e))?;
        let children: Arc<Mutex<Vec<(TaskId, Child)>>> = Arc::new(Mutex::new(Vec::new()));
        let finishing = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let me = Self { children: children.clone(), finishing: finishing.clone() };
        // A hybrid job's worker 0 is a trainer, whose first signal stops the job after the
        // current step (with a checkpoint, agreed by every worker); its second stops the tasks
        // ([`Self::stopper`]) and exits.
        if !hybrid {
            let children = children.clone();
            // Ctrl-C or SIGTERM: stop every task, then exit as that signal would.
            let signals = crate::signals::handle()?;
            std::thread::spawn(move || {
                if let Ok(signal) = signals.recv() {
                    eprintln!("strata train: {signal} received; stopping the ps and worker tasks");
                    stop_children(&children);
                    std::process::exit(crate::signals::exit_code(signal));
                }
            });
        }
        let (events, _drain) = std::sync::mpsc::channel();
        let tasks: Vec<TaskId> = (0..cluster.num_tasks(TaskType::Ps))
            .map(TaskId::ps)
            .chain((usize::from(hybrid)..cluster.num_tasks(TaskType::Worker)).map(TaskId::worker))
            .collect();
        let checkpoint_dir = args.checkpoint_dir.clone();
        let (network_delay, chief_timeout) = (args.network_delay, args.chief_timeout);
        let (cluster, token, delays) = (cluster.clone(), token.to_string(), delays.clone());
        let spawn = move |task: TaskId| -> Result<Child> {
            let mut cmd = Command::new(&exe);
            match task.kind {
                TaskType::Ps => {
                    cmd.arg("ps");
                    if let Some(dir) = &checkpoint_dir {
                        cmd.arg("--checkpoint-dir").arg(dir.join(format!("ps-{}", task.index)));
                    }
                    if let (Some(dir), Some(step)) = (&checkpoint_dir, resume) {
                        cmd.args(ps_restore_args(dir, task.index, step));
                    }
                }
                // The same command (with TF_CONFIG naming its task), which takes every flag.
                _ if hybrid => {
                    cmd.args(std::env::args_os().skip(1));
                }
                _ => {
                    cmd.arg("worker").args(delays.to_worker_flags(task.index));
                    if let Some(d) = network_delay {
                        cmd.arg("--network-delay").arg(format!("{}us", d.as_micros()));
                    }
                }
            }
            if !(hybrid && task.kind == TaskType::Worker) {
                cmd.arg("--chief-timeout").arg(format!("{}ms", chief_timeout.as_millis()));
            }
            cmd.env("TF_CONFIG", launch::tf_config(&cluster, task)?)
                .env(launch::TASK_VAR, task.to_string())
                .env(TOKEN_VAR, &token)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0);
            let mut child = cmd.spawn().map_err(|e| Error::io(format!("starting {task}"), e))?;
            let prefix = format!("[{task}] ");
            if let Some(out) = child.stdout.take() {
                launch::forward_lines(out, prefix.clone(), false, events.clone(), None);
            }
            if let Some(err) = child.stderr.take() {
                launch::forward_lines(err, prefix, true, events.clone(), None);
            }
            Ok(child)
        };
        for task in tasks {
            let child = spawn(task)?;
            children.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((task, child));
        }
        // A ps task that dies ends the run (nobody restarts it here); a worker that dies is
        // survived (its steps run on the others), and started again up to --max-restarts
        // times (the coordinator gives the new process steps once it answers).
        let max_restarts = args.max_restarts;
        let mut restarts: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(200));
            let mut guard = children.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if guard.is_empty() || finishing.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            let mut ps_died = None;
            for (task, c) in guard.iter_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    if task.kind == TaskType::Ps && ps_died.is_none() {
                        ps_died = Some(format!("task {task} {}", strata_compare::runner::describe(status)));
                    }
                    let done = restarts.entry(task.index).or_insert(0);
                    if task.kind == TaskType::Worker && !status.success() && *done < max_restarts {
                        *done += 1;
                        eprintln!(
                            "strata train: task {task} {}; a new process takes its place (restart {done} of {max_restarts})",
                            strata_compare::runner::describe(status)
                        );
                        match spawn(*task) {
                            Ok(child) => *c = child,
                            Err(e) => eprintln!("strata train: cannot restart {task}: {e}"),
                        }
                    }
                }
            }
            drop(guard);
            if let Some(why) = ps_died {
                eprintln!(
                    "error: {why}; its variables are gone, so training stops (restart it with --restore to resume)"
                );
                stop_children(&children);
                std::process::exit(1);
            }
        });
        Ok(me)
    }
}

/// The job every worker builds: `--model` (the MLP of `--hidden`, the CNN, or the transformer
/// of `--width`, `--layers` and `--heads`), `--replicas` per worker, `--seed`, `--data` and `--no-overlap`.
/// The ctr model's embedding table lives on the ps tasks in shards (`--embedding-rows`,
/// `--embedding-dim`, `--train-records`, `--test-records`).
pub fn job_spec(args: &TrainArgs) -> Result<PsJobSpec> {
    let replicas = args.replicas.unwrap_or(1);
    let mut spec = match args.model {
        ModelKind::Ctr => {
            let config = args.ctr();
            let (train_records, test_records) = args.ctr_records();
            let shape = strata::ps_job::CtrShape {
                embedding_rows: config.embedding_rows,
                embedding_dim: config.embedding_dim,
                train_records,
                test_records,
            };
            PsJobSpec::ctr(shape, args.seed)
        }
        ModelKind::Mlp => PsJobSpec::mlp(args.hidden(), replicas, args.seed, args.data.clone()),
        ModelKind::Cnn => PsJobSpec::cnn(replicas, args.seed, args.data.clone()),
        ModelKind::Transformer => PsJobSpec::transformer(args.transformer(), replicas, args.seed),
    };
    spec.overlap = !args.no_overlap;
    // The inverse rate compensates staleness on the ps tasks: the workers compute at the pulled
    // values (both at once compensate twice: measured worse).
    spec.lookahead = !args.no_lookahead && args.stale_rate() == StaleRateKind::Constant;
    spec.recompute = args.recompute;
    spec.precision = args.precision;
    Ok(spec)
}

/// Trains `--model` under ParameterServerStrategy (the coordinator's side), starting the ps and
/// worker tasks on loopback unless `TF_CONFIG` describes the cluster.
pub fn train(args: &TrainArgs, started: Instant) -> Result<()> {
    // The job's sizes are checked before any task starts (the workers check them again).
    let job = job_spec(args)?;
    job.validate()?;
    job.validate_batch(args.batch())?;
    let (from_env, cluster_source) = cluster_from_env(args)?;
    let mut token_text = String::new();
    let (cluster, local_tasks) = match from_env {
        Some(_) if args.max_restarts > 0 => {
            return Err(Error::Usage(format!(
                "--max-restarts {}: TF_CONFIG describes a cluster this process did not start, so its cluster manager restarts lost tasks (a restarted worker is given steps); drop it",
                args.max_restarts
            )))
        }
        Some(c) => match c.task.kind {
            TaskType::Ps | TaskType::Worker => return serve_task(args, c),
            TaskType::Chief => {
                c.spec.require_ps()?;
                (c.spec.clone(), None)
            }
            other => {
                return Err(Error::Usage(format!(
                    "TF_CONFIG names a {other} task; a parameter-server job has chief (the coordinator), worker and ps tasks"
                )))
            }
        },
        None => {
            let (spec, local, token) = start_local_cluster(args)?;
            token_text = token;
            (spec, Some(local))
        }
    };
    let token = match &local_tasks {
        // The tasks it started take the same token from their environment, and mutual TLS from
        // STRATA_TLS_DIR as this process does.
        Some(_) => {
            let token = ClusterToken::new(&token_text).map_err(|e| Error::Usage(e.to_string()))?;
            match MutualTls::from_env().map_err(|e| Error::Usage(e.to_string()))? {
                Some(tls) => token.with_tls(tls),
                None => token,
            }
        }
        None => cluster_token::resolve(args.cluster_token_file.as_deref())?,
    };
    let workers = cluster.num_tasks(TaskType::Worker);
    let mut options = ParameterServerOptions::new(token);
    options.optimizer = args.optimizer.server_optimizer(args.hyper());
    options.mode = ps_mode(args, workers)?;
    options.schedule = ps_schedule(args, options.mode, workers);
    options.stale_rate = args.stale_rate().into();
    options.partitioner = Partitioner::parse(&args.partitioner)?;
    options.table_optimizer = args.row_optimizer();
    options.seed = args.seed;
    options.cluster_source = cluster_source;
    options.compression = args.compression;
    options.checkpoint_every = args.checkpoint_dir.as_ref().map(|_| args.checkpoint_every.max(1) as u64);
    // With TF_CONFIG and checkpoints, a lost ps task can be restarted with --restore (by hand or
    // by the cluster manager): wait for it. A local cluster restarts nothing.
    options.wait_for_restarted_ps = local_tasks.is_none() && args.checkpoint_dir.is_some();
    let strategy = ParameterServerStrategy::new(cluster, options)?;
    let outcome = coordinate(args, started, &strategy, job, workers);
    end_job(&strategy, &outcome, local_tasks.as_ref());
    outcome
}

/// The cluster `TF_CONFIG` (or `--cluster`'s resolver) describes, and where it came from;
/// `None`: no `TF_CONFIG`, so this process starts the job's tasks itself.
pub(crate) fn cluster_from_env(args: &TrainArgs) -> Result<(Option<ClusterConfig>, &'static str)> {
    Ok(match args.cluster {
        ClusterSource::TfConfig if args.slurm_jobs.is_none() => (tf_config()?, "TF_CONFIG"),
        _ => {
            let resolver = train_args::resolver(args)?;
            (Some(resolver.resolve()?), resolver.source())
        }
    })
}

/// A ps or worker task of a parameter-server job whose cluster is in `TF_CONFIG` (`c`): serves
/// as `strata ps` or `strata worker` would, with the flags of `strata train` that apply.
pub(crate) fn serve_task(args: &TrainArgs, c: ClusterConfig) -> Result<()> {
    match c.task.kind {
        TaskType::Ps => {
            let checkpoint_dir = args.checkpoint_dir.as_ref().map(|d| d.join(format!("ps-{}", c.task.index)));
            let resume = ps_resume(args, c.spec.num_tasks(TaskType::Ps))?;
            run_ps_in(
                &PsArgs {
                    address: None,
                    task_index: 0,
                    bind: args.bind,
                    cluster_token_file: args.cluster_token_file.clone(),
                    checkpoint_dir,
                    restore: resume.zip(args.checkpoint_dir.as_ref()).map(|(_, d)| job_task_dir(d, c.task.index)),
                    restore_step: resume,
                    ps_tasks: None,
                    keep_checkpoints: 3,
                    stream_min_mib: 2.0,
                    no_stream: false,
                    inject_drop_reply_every: 0,
                    inject_drop_request_every: 0,
                    chief_timeout: args.chief_timeout,
                },
                Some(c),
            )
        }
        // A worker (the caller hands over ps and worker tasks only).
        _ => {
            let slowdown = args.step_delays()?.factor(c.task.index);
            run_worker_in(
                &WorkerArgs {
                    address: None,
                    task_index: 0,
                    ps: Vec::new(),
                    bind: args.bind,
                    cluster_token_file: args.cluster_token_file.clone(),
                    slowdown,
                    straggler_probability: args.straggler_probability,
                    straggler_delay: args.straggler_delay.clone(),
                    inject_seed: args.seed,
                    network_delay: args.network_delay,
                    chief_timeout: args.chief_timeout,
                },
                Some(c),
            )
        }
    }
}

/// The step a job's ps tasks resume from when `strata train` runs again with the same
/// --checkpoint-dir (of a job of `ps_tasks` ps tasks), each from its own checkpoints
/// (`ps-<i>`, [`ps_restore_args`]): `None`, a fresh start, when no ps task has a checkpoint there.
/// For a hybrid job it is the step of its dense layers' latest checkpoint (its ps tasks
/// checkpoint a step before its chief does, so they have it; with none the job starts afresh),
/// for a parameter-server job the latest step every ps task has. Refused in one line: checkpoints
/// of another number of ps tasks (the new tasks' would lie beside them), and ps tasks without the
/// step.
pub(crate) fn ps_resume(args: &TrainArgs, ps_tasks: usize) -> Result<Option<u64>> {
    let Some(dir) = &args.checkpoint_dir else { return Ok(None) };
    let Some(old) = strata_transport::ps::job_checkpoint_tasks(dir)? else { return Ok(None) };
    let steps = |root: &std::path::Path| -> Result<Vec<u64>> {
        if !root.is_dir() {
            return Ok(Vec::new());
        }
        Ok(strata::checkpoint::checkpoint_steps(root)?.into_iter().map(|(step, _)| step).collect())
    };
    let held: Vec<Vec<u64>> = (0..old).map(|i| steps(&job_task_dir(dir, i))).collect::<Result<_>>()?;
    if held.iter().all(Vec::is_empty) {
        return Ok(None);
    }
    if old != ps_tasks {
        return Err(Error::Usage(format!(
            "--checkpoint-dir {} holds the checkpoints of {old} ps tasks, and this job has {ps_tasks}: resume with --ps-tasks {old}, or restore them onto {ps_tasks} with `strata ps --restore {}` into a new --checkpoint-dir",
            dir.display(),
            dir.display()
        )));
    }
    let dense = dir.join(crate::train_args::HYBRID_DENSE_DIR);
    let hybrid = args.ps_mode == crate::train_args::PsModeKind::Hybrid;
    // Which kind of job wrote them: a hybrid job's chief keeps its dense layers under `dense`,
    // and its ps tasks hold tables only; a parameter-server job's ps tasks hold its variables.
    if !hybrid && strata::checkpoint::latest_checkpoint(&dense)?.is_some() {
        return Err(Error::Usage(format!(
            "--checkpoint-dir {} holds a hybrid job's checkpoints (its dense layers under {}): resume it with --ps-mode hybrid, or start this job in a new --checkpoint-dir",
            dir.display(),
            crate::train_args::HYBRID_DENSE_DIR
        )));
    }
    if hybrid {
        let (i, h) = held.iter().enumerate().find(|(_, h)| !h.is_empty()).unwrap_or((0, &held[0]));
        if strata_transport::ps::checkpoint_holds_variables(&job_task_dir(dir, i))? {
            return Err(Error::Usage(format!(
                "--checkpoint-dir {} holds the checkpoints of a parameter-server job that is not hybrid (ps-{i} at step {} holds its dense variables): resume it with the --ps-mode it ran with, or start this job in a new --checkpoint-dir",
                dir.display(),
                h.last().map_or("none".into(), u64::to_string)
            )));
        }
    }
    let step = if hybrid {
        // The step the trainer resumes from: its latest checkpoint's.
        let Some(latest) = strata::checkpoint::latest_checkpoint(&dense)? else { return Ok(None) };
        let found = strata::checkpoint::checkpoint_steps(&dense)?.into_iter().find(|(_, p)| *p == latest);
        let Some((step, _)) = found else { return Ok(None) };
        step
    } else {
        let common = held[0].iter().copied().filter(|s| held.iter().all(|h| h.contains(s))).max();
        match common {
            Some(step) => step,
            None => {
                let latest: Vec<String> = held
                    .iter()
                    .enumerate()
                    .map(|(i, h)| format!("ps-{i} at {}", h.last().map_or("none".into(), u64::to_string)))
                    .collect();
                return Err(Error::Usage(format!(
                    "--checkpoint-dir {}: the ps tasks' checkpoints have no step in common ({}); resume from a directory of one job's checkpoints, or start afresh in a new one",
                    dir.display(),
                    latest.join(", ")
                )));
            }
        }
    };
    if let Some((i, h)) = held.iter().enumerate().find(|(_, h)| !h.contains(&step)) {
        return Err(Error::Usage(format!(
            "--checkpoint-dir {}: the dense layers' checkpoint of step {step} has no ps-{i} checkpoint of it (its latest: {}); resume from a directory of one job's checkpoints, or start afresh in a new one",
            dir.display(),
            h.last().map_or("none".into(), u64::to_string)
        )));
    }
    Ok(Some(step))
}

/// `strata ps`'s flags that restore ps task `index` of a job resumed at `step` ([`ps_resume`])
/// from its own checkpoints under --checkpoint-dir `dir`: its variables and rows as it held them,
/// so a task restarted in the middle of a job serves at once (the chief creates no variable
/// again).
fn ps_restore_args(dir: &std::path::Path, index: usize, step: u64) -> [std::ffi::OsString; 4] {
    ["--restore".into(), job_task_dir(dir, index).into_os_string(), "--restore-step".into(), step.to_string().into()]
}

/// Refuses a local cluster of `--ps-tasks` and `--workers` (of a `job` job) without one of
/// each, or over the processes one machine starts.
pub(crate) fn check_local_sizes(args: &TrainArgs, job: &str) -> Result<()> {
    if args.ps_tasks == 0 || args.workers == 0 {
        return Err(Error::Usage(format!(
            "--ps-tasks {} --workers {}: a {job} job needs at least one of each",
            args.ps_tasks, args.workers
        )));
    }
    if args.ps_tasks.saturating_add(args.workers) > launch::MAX_LOCAL_TASKS {
        return Err(Error::Usage(format!(
            "--ps-tasks {} --workers {}: over the limit of {} processes started on this machine; start fewer, or give TF_CONFIG a cluster of several machines",
            args.ps_tasks,
            args.workers,
            launch::MAX_LOCAL_TASKS
        )));
    }
    Ok(())
}

/// Starts a local cluster of `--ps-tasks` ps tasks and `--workers` worker tasks on loopback
/// (this process is the chief): its spec, its processes and the token they share.
fn start_local_cluster(args: &TrainArgs) -> Result<(ClusterSpec, LocalCluster, String)> {
    check_local_sizes(args, "parameter-server")?;
    if let Some(dir) = &args.checkpoint_dir {
        train_args::checkpoint_dir_writable(dir)?;
    }
    let tasks = launch::tasks(true, args.workers, args.ps_tasks);
    let addresses = launch::free_addresses(args.bind, tasks.len())?;
    let spec = launch::cluster_spec(&tasks, &addresses)?;
    let token = cluster_token::for_local_cluster();
    let delays = step_delays(args, args.workers)?;
    let resume = ps_resume(args, args.ps_tasks)?;
    let local = LocalCluster::start(args, &spec, &token, &delays, false, resume)?;
    Ok((spec, local, token))
}

/// The end of the job: every ps task and worker is told, stops serving and exits 0, instead of
/// serving until it is killed. After a failure a local cluster's tasks are stopped as before
/// (when `local_tasks` is dropped), and a remote cluster's are told within a short deadline,
/// so that a task that cannot answer (the one whose loss failed the job) delays the error
/// little.
fn end_job(strategy: &ParameterServerStrategy, outcome: &Result<()>, local_tasks: Option<&LocalCluster>) {
    let deadline = match (outcome, local_tasks) {
        (Ok(()), _) => Some(FINISH_DEADLINE),
        (Err(_), None) => Some(FINISH_DEADLINE_AFTER_FAILURE),
        (Err(_), Some(_)) => None,
    };
    if let Some(deadline) = deadline {
        let reason = match outcome {
            Ok(()) => "the chief finished training".to_string(),
            Err(e) => format!("the chief failed: {e}"),
        };
        if let Some(local) = local_tasks {
            // Its tasks exiting from now on are not lost.
            local.finishing.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        let reason = within_bytes(&reason, strata_transport::control::MAX_REASON_BYTES);
        for (task, answer) in strategy.finish_job(&reason, deadline) {
            if let Err(e) = answer {
                eprintln!(
                    "strata train: {task} was not told that the job is over ({e}); it stops after its --chief-timeout"
                );
            }
        }
        if let Some(local) = local_tasks {
            local.wait_exited(FINISH_DEADLINE);
        }
    }
}

/// How long the chief waits for each task to take the end of the job, and a local cluster's
/// tasks to exit after it.
pub(crate) const FINISH_DEADLINE: Duration = Duration::from_secs(2);

/// The same after the job failed (a task that cannot answer may be why).
pub(crate) const FINISH_DEADLINE_AFTER_FAILURE: Duration = Duration::from_millis(500);

/// `text` cut to at most `max` bytes, at a character boundary.
pub(crate) fn within_bytes(text: &str, max: usize) -> String {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

/// The chief's part of a parameter-server job on `strategy`: builds the model, trains it and
/// writes the summary.
fn coordinate(
    args: &TrainArgs,
    started: Instant,
    strategy: &ParameterServerStrategy,
    job: PsJobSpec,
    workers: usize,
) -> Result<()> {
    let model = PsJobModel::build(strategy, &job)?;
    let config = PsTrainConfig {
        spec: job,
        epochs: args.epochs(),
        batch_size: args.batch(),
        steps_per_epoch: (args.model == ModelKind::Transformer).then(|| args.steps.unwrap_or(TRANSFORMER_STEPS)),
        progress: Some(Arc::new(strata_compare::progress::Bar::new(!args.no_progress))),
        max_steps: args.max_steps,
        metrics: args.metrics_writer(true)?,
    };
    let (report, stats) = ps_job::train_coordinator(strategy, &model, &config)?;
    let (mode, stale_rate, tasks) = task_summaries(strategy.ps_clients())?;
    let ps = PsSummary { mode, stale_rate: Some(stale_rate), workers, coordinator: Some(stats), tasks };
    let replicas = workers * args.replicas.unwrap_or(1);
    let ctr = (args.model == ModelKind::Ctr).then(|| ctr_summary(args, &report, model.variables())).transpose()?;
    crate::summary::finish(args, started, replicas, &report, model.variables(), 0, Some(ps), ctr)
}

/// The ctr run's figures: the coordinator's test AUC (its lookups on the ps tasks), the
/// planted model's on the same records, and the dense gradient a worker pushes each step (the
/// table's rows go as rows: their bytes are in the step records' `bytes_sent`).
fn ctr_summary(
    args: &TrainArgs,
    report: &strata::trainer::FitReport,
    vars: &[(String, candle_core::Var)],
) -> Result<crate::summary::CtrSummary> {
    let config = args.ctr();
    let (train_records, test_records) = args.ctr_records();
    let data = strata::ctr::CtrData::new(args.seed, config.embedding_rows)?;
    Ok(crate::summary::CtrSummary {
        embedding_rows: config.embedding_rows,
        embedding_dim: config.embedding_dim,
        train_records,
        test_records,
        final_test_auc: report.final_metrics.iter().find(|m| m.name == "auc").map_or(f64::NAN, |m| m.value),
        best_test_auc: data.best_auc(strata::ctr::Split::Test, test_records),
        dense_gradient_bytes_per_step: vars.iter().map(|(_, v)| v.elem_count() as u64 * 4).sum(),
        table_bytes_pulled_per_step: None,
        table_bytes_pushed_per_step: None,
    })
}

/// Every ps task's counters (from its status) and the mode they report.
pub(crate) fn task_summaries(
    clients: &[strata_transport::ps::PsClient],
) -> Result<(String, String, Vec<PsTaskSummary>)> {
    let mut tasks = Vec::new();
    let (mut mode, mut stale_rate) = (String::new(), String::new());
    for (i, c) in clients.iter().enumerate() {
        let s = c.status().map_err(strata_core::Error::from)?;
        mode = s.mode.to_string();
        stale_rate = s.stale_rate.to_string();
        let bytes = s.variables.iter().map(|(v, _)| v.numel() as u64 * 4).sum::<u64>()
            + s.tables.iter().map(|t| t.bytes).sum::<u64>();
        tasks.push(PsTaskSummary {
            task: format!("ps:{i}"),
            version: s.version,
            pushes_applied: s.pushes_applied,
            pushes_duplicate: s.pushes_duplicate,
            pushes_dropped: s.pushes_dropped,
            pushes_stale: s.pushes_stale,
            pushes_streamed: s.pushes_streamed,
            pushes_aborted: s.pushes_aborted,
            restored_step: s.restored_step,
            restored_version: s.restored_version,
            rounds: s.rounds,
            applied_by_worker: s.applied_by_worker,
            bytes,
        });
    }
    Ok((mode, stale_rate, tasks))
}

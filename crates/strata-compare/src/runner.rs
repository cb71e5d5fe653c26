//! Real runs: every run of an experiment is `strata train` in its own processes on this
//! machine (`strata launch` for MultiWorkerMirrored, the parameter-server job's own local
//! cluster for ParameterServer), one run after another so that they do not share the cores.
//!
//! A run writes its records with `--metrics` and its summary with `--out`; its output goes to
//! `runs/<name>.log`. A run that fails or outlasts the experiment's `run_timeout` (its whole
//! process group is killed) is kept with its error and the records it wrote; the others go on.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use std::os::unix::process::CommandExt;

use strata_core::cross_device::compression::Compression;

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Mutex;

use super::experiment::{Experiment, PsMode, RunModel, RunSpec, RunStrategy};
use super::RunResult;
use crate::hosts::{Hosts, TaskKind};
use crate::{Error, Result};

/// The arguments of `strata` (after the executable) that run `spec` on this machine.
pub fn command_line(exp: &Experiment, spec: &RunSpec, metrics: &Path, summary: &Path) -> Vec<String> {
    let train = train_args(exp, spec, metrics, summary);
    if spec.strategy == RunStrategy::MultiWorkerMirrored {
        let mut launch: Vec<String> = vec!["launch".into(), "--workers".into(), spec.workers.to_string()];
        if spec.min_workers.is_some() && spec.restarts > 0 {
            // The launcher starts a new process that joins the elastic job.
            launch.extend(["--max-restarts".into(), spec.restarts.to_string()]);
        }
        launch.extend(["--".into(), "strata".into()]);
        launch.extend(train);
        return launch;
    }
    train
}

/// The `strata train ...` arguments of `spec` (one process's; `strata launch` or the emulated
/// hosts start one per worker).
pub fn train_args(exp: &Experiment, spec: &RunSpec, metrics: &Path, summary: &Path) -> Vec<String> {
    let mut train: Vec<String> = vec!["train".into(), "--strategy".into(), spec.strategy.name().into()];
    train.extend(["--model".into(), exp.model.name().into()]);
    if exp.model == RunModel::Mlp {
        let hidden = exp.hidden.iter().map(|h| h.to_string()).collect::<Vec<_>>().join(",");
        train.extend(["--hidden".into(), hidden]);
    }
    if let Some(c) = &exp.transformer {
        for (flag, n) in [("--width", c.width), ("--layers", c.layers), ("--heads", c.heads)] {
            train.extend([flag.into(), n.to_string()]);
        }
    }
    if let Some(c) = &exp.ctr {
        train.extend(c.args(spec.strategy));
    }
    if spec.zero_stage != strata_core::ZeroStage::Off {
        train.extend(["--zero-stage".into(), spec.zero_stage.to_string()]);
    }
    if spec.recompute {
        train.push("--recompute".into());
    }
    if exp.model == RunModel::Transformer {
        // `steps` counts global batches: a parameter-server run's worker steps take a
        // worker's share each, so it schedules `workers` times as many (the same windows per
        // epoch as every other run).
        train.extend(["--steps".into(), transformer_steps(exp, spec).to_string()]);
    }
    // Each parameter-server worker pushes its share of the global batch per step, as
    // TensorFlow's per-replica batch of a ParameterServerStrategy job (hybrid's workers step
    // together over the global batch).
    let batch = if spec.steps_alone() { exp.global_batch / spec.workers.max(1) } else { exp.global_batch };
    train.extend([
        "--epochs".into(),
        exp.epochs.to_string(),
        "--batch".into(),
        batch.to_string(),
        "--lr".into(),
        exp.lr.to_string(),
        "--optimizer".into(),
        exp.optimizer.clone(),
        "--seed".into(),
        exp.seed.to_string(),
        "--no-progress".into(),
        "--metrics".into(),
        metrics.display().to_string(),
        "--out".into(),
        summary.display().to_string(),
    ]);
    if spec.strategy != RunStrategy::OneDevice {
        train.extend(["--replicas".into(), spec.replicas.to_string()]);
    }
    if let Some(d) = &exp.data {
        train.extend(["--data".into(), d.display().to_string()]);
    }
    let inj = &exp.injection;
    for (w, f) in &inj.slowdown {
        if *w < spec.parallelism() {
            train.extend(["--worker-slowdown".into(), format!("{w}={f}")]);
        }
    }
    if let Some(s) = &inj.stragglers {
        train.extend([
            "--straggler-probability".into(),
            s.probability.to_string(),
            "--straggler-delay".into(),
            s.delay.to_string(),
        ]);
    }
    if !inj.network_delay.is_zero() {
        train.extend(["--network-delay".into(), format!("{}us", inj.network_delay.as_micros())]);
    }
    if spec.compression != Compression::None {
        train.extend(["--compression".into(), spec.compression.to_string()]);
    }
    if let Some(l) = &spec.local_sgd {
        let outer = match l.outer {
            strata::OuterOptimizer::Average => "average",
            strata::OuterOptimizer::Nesterov { .. } => "nesterov",
        };
        train.extend(["--sync-every".into(), l.every.to_string(), "--outer-optimizer".into(), outer.into()]);
        train.extend(["--fragments".into(), l.fragments.to_string()]);
    }
    if let Some(n) = spec.min_workers {
        train.extend(["--min-workers".into(), n.to_string()]);
    }
    if let Some(every) = spec.checkpoint_every {
        train.extend([
            "--checkpoint-dir".into(),
            checkpoint_dir(metrics).display().to_string(),
            "--checkpoint-every".into(),
            every.to_string(),
        ]);
    }
    if spec.strategy == RunStrategy::ParameterServer && spec.restarts > 0 {
        train.extend(["--max-restarts".into(), spec.restarts.to_string()]);
    }
    match spec.strategy {
        RunStrategy::ParameterServer => {
            train.extend([
                "--workers".into(),
                spec.workers.to_string(),
                "--ps-tasks".into(),
                spec.ps_tasks.to_string(),
                "--ps-mode".into(),
                spec.mode.unwrap_or(PsMode::Async).name().into(),
                "--backup-workers".into(),
                spec.backup_workers.to_string(),
                "--staleness".into(),
                spec.staleness.to_string(),
            ]);
            train
        }
        _ => train,
    }
}

/// Where a run whose records go to `metrics` (`runs/<name>.jsonl`) writes its checkpoints:
/// `runs/<name>.ckpt`.
pub fn checkpoint_dir(metrics: &Path) -> PathBuf {
    metrics.with_extension("ckpt")
}

/// `strata train`'s steps per epoch of the transformer when `steps` is not given.
const TRANSFORMER_DEFAULT_STEPS: usize = 1200;

/// The transformer's `--steps` for `spec`: the experiment's `steps` (global batches per
/// epoch), times the workers for a parameter-server run.
fn transformer_steps(exp: &Experiment, spec: &RunSpec) -> usize {
    let steps = exp.steps.unwrap_or(TRANSFORMER_DEFAULT_STEPS);
    if spec.steps_alone() {
        steps * spec.workers.max(1)
    } else {
        steps
    }
}

/// Steps a run makes (for its progress bar).
fn expected_steps(exp: &Experiment, spec: &RunSpec, train_len: usize) -> u64 {
    if exp.model == RunModel::Transformer {
        return (transformer_steps(exp, spec) * exp.epochs) as u64;
    }
    let batch = if spec.steps_alone() { exp.global_batch / spec.workers.max(1) } else { exp.global_batch };
    (train_len.div_ceil(batch.max(1)) * exp.epochs) as u64
}

/// The signal that asked the runs to stop (0: none).
static STOP: AtomicI32 = AtomicI32::new(0);
/// The process groups of the runs' processes now running, for [`emergency_cleanup`].
static GROUPS: Mutex<Vec<i32>> = Mutex::new(Vec::new());
/// Whether this process built emulated hosts that still exist.
static HOSTS_UP: AtomicBool = AtomicBool::new(false);

/// Asks the runs to stop (a signal handler's job): the run in progress is killed, the
/// emulated hosts removed, and [`run_all`] returns an error.
pub fn request_stop(signal: i32) {
    STOP.store(signal.max(1), Ordering::SeqCst);
}

/// The signal that asked the runs to stop, if one did.
pub fn stop_requested() -> Option<i32> {
    match STOP.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// What a signal handler does when [`run_all`] does not stop in time: kills every run's
/// process group and, if this process built emulated hosts, every process in them and the
/// hosts themselves.
pub fn emergency_cleanup() {
    use nix::sys::signal::{kill, Signal};
    let groups: Vec<i32> = GROUPS.lock().map(|g| g.clone()).unwrap_or_default();
    for g in groups {
        let _ = kill(nix::unistd::Pid::from_raw(-g), Signal::SIGKILL);
    }
    if HOSTS_UP.load(Ordering::SeqCst) {
        crate::hosts::remove_leftovers();
    }
}

fn register_group(pid: u32, on: bool) {
    if let Ok(mut g) = GROUPS.lock() {
        g.retain(|p| *p != pid as i32);
        if on {
            g.push(pid as i32);
        }
    }
}

/// Runs every run of `exp` (or those named in `only`), writing their logs and records under
/// `dir/runs`. With `[network]`, the multi-process runs run on emulated hosts
/// ([`crate::hosts`]), built once before the first run and removed after the last (or on an
/// error, or when [`request_stop`] is called).
pub fn run_all(exp: &Experiment, dir: &Path, only: &[String], progress: bool) -> Result<Vec<RunResult>> {
    let exe = std::env::current_exe().map_err(|e| Error::io("finding the strata executable", e))?;
    for name in only {
        if !exp.runs.iter().any(|r| &r.name == name) {
            let names: Vec<&str> = exp.runs.iter().map(|r| r.name.as_str()).collect();
            return Err(Error::Usage(format!("--only {name:?}: no such run; the runs are {}", names.join(", "))));
        }
    }
    let selected: Vec<&RunSpec> = exp.runs.iter().filter(|r| only.is_empty() || only.contains(&r.name)).collect();
    let network = exp.network.as_ref().filter(|_| selected.iter().any(|r| r.strategy.is_multi_process()));
    let hosts_error = |e: crate::hosts::HostsError| match e {
        crate::hosts::HostsError::Io { .. } => Error::from(e),
        e => Error::Usage(format!("{}: network.hosts: {e}", exp.path.display())),
    };
    // Root and the tools before anything is created.
    if network.is_some() {
        crate::hosts::preflight().map_err(hosts_error)?;
    }
    let runs_dir = dir.join("runs");
    let train_len = match exp.model {
        RunModel::Transformer => 0,
        RunModel::Ctr => usize::try_from(exp.ctr.unwrap_or_default().train_records()).unwrap_or(usize::MAX),
        _ => strata::digits::train_test_split(&strata::digits::load(exp.data.as_deref())?, 0.2, 0).0.len(),
    };
    // The lock (another harness's hosts) before the output directory.
    let mut hosts = match network {
        Some(net) => {
            let h = crate::hosts::Hosts::build(net).map_err(hosts_error)?;
            HOSTS_UP.store(true, Ordering::SeqCst);
            Some(h)
        }
        None => None,
    };
    std::fs::create_dir_all(&runs_dir).map_err(|e| Error::io(format!("cannot create {}", runs_dir.display()), e))?;
    let goodput = match (&hosts, network) {
        (Some(h), Some(net)) => {
            let g = h.measure_goodput(1.5);
            match g {
                Some(g) => eprintln!("{}; one link's TCP goodput: {:.3} Gbit/s", net.describe(), g / 1e9),
                None => eprintln!("{}; one link's TCP goodput could not be measured", net.describe()),
            }
            g
        }
        _ => None,
    };
    let mut results = Vec::new();
    for (k, spec) in selected.iter().enumerate() {
        if stop_requested().is_some() {
            break;
        }
        let bar = crate::progress::bar(progress, expected_steps(exp, spec, train_len));
        bar.set_message(spec.name.clone());
        let result = match &hosts {
            Some(h) if spec.strategy.is_multi_process() => {
                let mut r = run_on_hosts(&exe, exp, spec, &runs_dir, &bar, h, k);
                r.link_goodput_bps = goodput;
                r
            }
            _ => run_one(&exe, exp, spec, &runs_dir, &bar),
        };
        match &result.error {
            Some(e) => bar.abandon_with_message(format!("{}: failed: {e}", spec.name)),
            None => bar.finish_with_message(format!("{}: done in {:.1} s", spec.name, result.wall_s)),
        }
        if !progress || bar.is_hidden() {
            match &result.error {
                Some(e) => eprintln!("{}: failed after {:.1} s: {e}", spec.name, result.wall_s),
                None => eprintln!("{}: done in {:.1} s", spec.name, result.wall_s),
            }
        }
        results.push(result);
    }
    if let Some(mut h) = hosts.take() {
        h.teardown();
        HOSTS_UP.store(false, Ordering::SeqCst);
    }
    if let Some(signal) = stop_requested() {
        return Err(Error::Usage(format!("stopped by signal {signal}; the runs' processes and hosts are removed")));
    }
    Ok(results)
}

/// One task of a run on emulated hosts.
struct HostTask {
    kind: TaskKind,
    index: usize,
    host: usize,
    port: u16,
}

impl HostTask {
    fn label(&self) -> String {
        format!("{}-{}", self.kind.name(), self.index)
    }
}

/// A run's tasks on `hosts` hosts: workers (and, for parameter servers, the ps tasks and the
/// chief, which coordinates the workers' steps; a hybrid job has none, its workers step
/// together) mapped by [`crate::hosts::host_of`], each on a port of its own from `base`.
fn host_tasks(spec: &RunSpec, hosts: usize, base: u16) -> Vec<HostTask> {
    let mut kinds: Vec<(TaskKind, usize)> = Vec::new();
    if spec.strategy == RunStrategy::ParameterServer {
        if spec.steps_alone() {
            kinds.push((TaskKind::Chief, 0));
        }
        kinds.extend((0..spec.ps_tasks).map(|j| (TaskKind::Ps, j)));
    }
    kinds.extend((0..spec.workers).map(|i| (TaskKind::Worker, i)));
    kinds
        .into_iter()
        .enumerate()
        .map(|(k, (kind, index))| HostTask {
            kind,
            index,
            host: crate::hosts::host_of(kind, index, hosts, spec.workers, spec.ps_tasks),
            port: base.wrapping_add(k as u16),
        })
        .collect()
}

/// The `TF_CONFIG` of every task: the cluster of all of them, and its own task.
fn tf_configs(tasks: &[HostTask], addr: impl Fn(usize) -> std::net::Ipv4Addr) -> Vec<String> {
    let mut cluster = serde_json::Map::new();
    for kind in [TaskKind::Chief, TaskKind::Ps, TaskKind::Worker] {
        let addrs: Vec<serde_json::Value> = tasks
            .iter()
            .filter(|t| t.kind == kind)
            .map(|t| serde_json::Value::String(format!("{}:{}", addr(t.host), t.port)))
            .collect();
        if !addrs.is_empty() {
            cluster.insert(kind.name().into(), serde_json::Value::Array(addrs));
        }
    }
    tasks
        .iter()
        .map(|t| serde_json::json!({"cluster": cluster, "task": {"type": t.kind.name(), "index": t.index}}).to_string())
        .collect()
}

/// `--metrics` and `--out` sent to `/dev/null`: only the chief (the coordinator, or worker 0)
/// writes them, but every MultiWorkerMirrored worker must be given them (with per-step
/// records the workers agree after every step whether to stop, a collective all must make).
fn without_outputs(args: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len());
    let mut replace = false;
    for a in args {
        if replace {
            out.push("/dev/null".to_string());
            replace = false;
        } else {
            replace = a == "--metrics" || a == "--out";
            out.push(a.clone());
        }
    }
    out
}

/// Runs a multi-process `spec` on the emulated hosts: one `strata train` per task, started with
/// `ip netns exec` on its host, `TF_CONFIG` naming every task's address, `--bind` its host's
/// address and one cluster token. Each task's output goes to `runs/<name>.<task>.log`.
fn run_on_hosts(
    exe: &Path,
    exp: &Experiment,
    spec: &RunSpec,
    runs_dir: &Path,
    bar: &indicatif::ProgressBar,
    hosts: &Hosts,
    run_index: usize,
) -> RunResult {
    let metrics = runs_dir.join(format!("{}.jsonl", spec.name));
    let summary = runs_dir.join(format!("{}.json", spec.name));
    let _ = std::fs::remove_file(&metrics);
    let _ = std::fs::remove_file(&summary);
    let started = Instant::now();
    let base = 21_000 + ((run_index * 64) % 40_000) as u16;
    let tasks = host_tasks(spec, hosts.len(), base);
    let configs = tf_configs(&tasks, |i| hosts.addr(i));
    let token: String = (0..32).map(|_| format!("{:02x}", rand::random::<u8>())).collect();
    let args = train_args(exp, spec, &metrics, &summary);
    // The task that writes the records and the summary, and whose kind the run waits for:
    // a parameter-server job's coordinator, else worker 0 (every worker).
    let chief = if spec.steps_alone() { TaskKind::Chief } else { TaskKind::Worker };
    let mut plan = Vec::new();
    for (t, config) in tasks.iter().zip(&configs) {
        let mut a = if t.kind == chief && t.index == 0 { args.clone() } else { without_outputs(&args) };
        a.extend(["--bind".into(), hosts.addr(t.host).to_string()]);
        let mut cmd = hosts.command(t.host, exe);
        cmd.args(&a).env("TF_CONFIG", config).env("STRATA_CLUSTER_TOKEN", &token);
        let log = runs_dir.join(format!("{}.{}.log", spec.name, t.label()));
        plan.push((t.label(), t.kind == chief, cmd, log, format!("host {} ({})", t.host, hosts.netns(t.host))));
    }
    // The run's own log: where each task ran.
    let index: String =
        plan.iter().map(|(label, _, _, log, at)| format!("{label}: {at}; log {}\n", log.display())).collect();
    let _ = std::fs::write(runs_dir.join(format!("{}.log", spec.name)), index);
    // Servers first (ps tasks, workers of a parameter-server job), the chief last (a hybrid
    // job's workers after its ps tasks).
    plan.sort_by_key(|p| p.1 && spec.strategy == RunStrategy::ParameterServer);
    let outcome = spawn_tasks_and_wait(plan, spec.timeout.unwrap_or(exp.run_timeout), &metrics, bar);
    hosts.kill_all();
    finish(exp, spec, outcome, &metrics, started.elapsed().as_secs_f64(), hosts.len())
}

/// Starts every `(label, primary, command, log, where)` and waits for the primary ones (the
/// run is over when they are): the first task that fails, the time limit or a stop request
/// ends the others.
fn spawn_tasks_and_wait(
    plan: Vec<(String, bool, Command, PathBuf, String)>,
    timeout: Duration,
    metrics: &Path,
    bar: &indicatif::ProgressBar,
) -> std::result::Result<(), String> {
    let mut children: Vec<(String, bool, std::process::Child, PathBuf)> = Vec::new();
    let kill_all = |children: &mut Vec<(String, bool, std::process::Child, PathBuf)>| {
        for (_, _, c, _) in children.iter_mut() {
            kill_group(c);
        }
    };
    for (label, primary, mut cmd, log, _) in plan {
        let started = std::fs::File::create(&log)
            .and_then(|f| Ok((f.try_clone()?, f)))
            .map_err(|e| format!("cannot create {}: {e}", log.display()))
            .and_then(|(out, err)| {
                cmd.stdin(Stdio::null())
                    .stdout(Stdio::from(out))
                    .stderr(Stdio::from(err))
                    .process_group(0)
                    .spawn()
                    .map_err(|e| format!("cannot start {label} (ip netns exec): {e}"))
            });
        match started {
            Ok(child) => {
                register_group(child.id(), true);
                children.push((label, primary, child, log));
            }
            Err(e) => {
                kill_all(&mut children);
                return Err(e);
            }
        }
    }
    let deadline = Instant::now() + timeout;
    let result = loop {
        let mut failed = None;
        let mut primaries_done = true;
        for (label, primary, c, log) in children.iter_mut() {
            match c.try_wait() {
                Ok(Some(status)) if !status.success() => {
                    failed = Some(task_error(label, status, log));
                    break;
                }
                Ok(Some(_)) => {}
                Ok(None) => primaries_done &= !*primary,
                Err(e) => {
                    failed = Some(format!("cannot wait for {label}: {e}"));
                    break;
                }
            }
        }
        if let Some(e) = failed {
            break Err(e);
        }
        if primaries_done {
            break Ok(());
        }
        if let Some(signal) = stop_requested() {
            break Err(format!("stopped by signal {signal}"));
        }
        if Instant::now() >= deadline {
            break Err(format!("stopped after its time limit of {} s", timeout.as_secs_f64()));
        }
        if !bar.is_hidden() {
            if let Ok(text) = std::fs::read_to_string(metrics) {
                bar.set_position(text.lines().filter(|l| l.contains("\"kind\":\"step\"")).count() as u64);
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // The servers (ps and worker tasks of a parameter-server job) end when the chief ends the
    // job; any still running (after a failure) are stopped.
    kill_all(&mut children);
    for (_, _, c, _) in &children {
        register_group(c.id(), false);
    }
    result
}

/// `worker-1 exited with code 1: <its last error line>`.
fn task_error(label: &str, status: std::process::ExitStatus, log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let last = text.lines().rev().find_map(|l| {
        let l = l.trim();
        l.find("error: ").map(|i| l[i + "error: ".len()..].trim().to_string())
    });
    match last {
        Some(e) => format!("{label}: {e}"),
        None => format!("{label} {}; see {}", describe(status), log.display()),
    }
}

/// The result of a run from its outcome and the records it wrote.
fn finish(
    exp: &Experiment,
    spec: &RunSpec,
    outcome: std::result::Result<(), String>,
    metrics: &Path,
    wall_s: f64,
    hosts: usize,
) -> RunResult {
    let (records, read_error) = match strata::metrics::read(metrics) {
        Ok(r) => (r, None),
        Err(_) if outcome.is_err() => (Vec::new(), None),
        Err(e) => (Vec::new(), Some(e.to_string())),
    };
    let mut error = outcome.err().or(read_error);
    if error.is_none() && !records.iter().any(|r| r.kind == strata::metrics::RecordKind::Eval) {
        error = Some("the run wrote no evaluation".into());
    }
    let summary = std::fs::read_to_string(metrics.with_extension("json")).ok();
    RunResult {
        name: spec.name.clone(),
        strategy: spec.strategy.name().into(),
        mode: spec.mode_label(),
        workers: spec.parallelism(),
        global_batch: exp.global_batch,
        simulated: false,
        records,
        error,
        wall_s,
        hosts,
        link_goodput_bps: None,
        faults: Vec::new(),
        relaunches: 0,
        // The chief's summary, `runs/<name>.json` beside the records.
        local_sgd: summary.as_deref().and_then(crate::results::OuterTraffic::from_summary),
        ctr: summary.as_deref().and_then(crate::results::CtrFigures::from_summary),
    }
}

fn run_one(exe: &Path, exp: &Experiment, spec: &RunSpec, runs_dir: &Path, bar: &indicatif::ProgressBar) -> RunResult {
    let metrics = runs_dir.join(format!("{}.jsonl", spec.name));
    let summary = runs_dir.join(format!("{}.json", spec.name));
    let log = runs_dir.join(format!("{}.log", spec.name));
    let _ = std::fs::remove_file(&metrics);
    let _ = std::fs::remove_file(&summary);
    // A checkpoint left by an earlier harness would be resumed from.
    let _ = std::fs::remove_dir_all(checkpoint_dir(&metrics));
    let started = Instant::now();
    let timeout = spec.timeout.unwrap_or(exp.run_timeout);
    let kills: &[crate::experiment::Kill] =
        if spec.faults && spec.strategy.is_multi_process() { &exp.injection.kill } else { &[] };
    let kills: Vec<_> = kills.iter().copied().filter(|k| k.worker < spec.workers).collect();
    let per_batch = if spec.steps_alone() { spec.workers as u64 } else { 1 };
    let mut killer = crate::faults::Killer::new(&kills, per_batch, started);
    let args = command_line(exp, spec, &metrics, &summary);
    // Earlier attempts' records (a job relaunched from its checkpoint), on the run's clock.
    let mut earlier: Vec<strata::metrics::MetricRecord> = Vec::new();
    let mut relaunches = 0;
    let outcome = loop {
        let attempt_start = started.elapsed().as_secs_f64();
        let kills_before = killer.done.len();
        let log = if relaunches == 0 {
            log.clone()
        } else {
            runs_dir.join(format!("{}.relaunch-{relaunches}.log", spec.name))
        };
        let left = timeout.saturating_sub(started.elapsed());
        let outcome = spawn_and_wait(exe, &args, &log, left, &metrics, bar, Some(&mut killer));
        let mut records = strata::metrics::read(&metrics).unwrap_or_default();
        let shift = killer.end_attempt(attempt_start);
        for r in &mut records {
            r.wall_s += shift;
        }
        earlier.extend(records);
        // Restart the world: a job that is not elastic and lost a worker to a kill is
        // relaunched whole, and resumes from its last checkpoint.
        let relaunch = outcome.is_err()
            && spec.min_workers.is_none()
            && spec.checkpoint_every.is_some()
            && relaunches < spec.restarts
            && killer.done.len() > kills_before
            && stop_requested().is_none()
            && started.elapsed() < timeout;
        if !relaunch {
            break outcome;
        }
        relaunches += 1;
        let _ = std::fs::remove_file(&metrics);
    };
    let mut result = finish(exp, spec, outcome, &metrics, started.elapsed().as_secs_f64(), 0);
    if relaunches > 0 {
        result.records = earlier;
        if result.error.is_none() && !result.records.iter().any(|r| r.kind == strata::metrics::RecordKind::Eval) {
            result.error = Some("the run wrote no evaluation".into());
        }
    }
    result.faults = killer.done;
    result.relaunches = relaunches;
    result
}

/// What a run's metrics file holds so far, read as it grows: only the bytes appended since the
/// last look are read.
#[derive(Default)]
struct MetricsTail {
    /// Bytes read so far.
    pos: u64,
    /// The last line, not yet ended.
    partial: String,
    /// Step records so far.
    steps: u64,
    /// The last step record.
    last_step: Option<String>,
}

impl MetricsTail {
    /// Reads what was appended to `path`; whether a new step record came. A file that shrank
    /// (a relaunch writes it afresh) is read again from its start.
    fn update(&mut self, path: &Path) -> bool {
        use std::io::{Read, Seek, SeekFrom};
        let Ok(mut f) = std::fs::File::open(path) else { return false };
        let len = f.metadata().map_or(0, |m| m.len());
        if len < self.pos {
            *self = Self::default();
        }
        let mut new = Vec::new();
        if len == self.pos || f.seek(SeekFrom::Start(self.pos)).is_err() || f.read_to_end(&mut new).is_err() {
            return false;
        }
        self.pos += new.len() as u64;
        self.partial.push_str(&String::from_utf8_lossy(&new));
        let mut stepped = false;
        while let Some(end) = self.partial.find('\n') {
            let line: String = self.partial.drain(..=end).collect();
            if line.contains("\"kind\":\"step\"") {
                self.steps += 1;
                self.last_step = Some(line);
                stepped = true;
            }
        }
        stepped
    }
}

/// Runs `strata ARGS` with its output in `log`; the error is the process's own last `error:`
/// line where it printed one.
fn spawn_and_wait(
    exe: &Path,
    args: &[String],
    log: &Path,
    timeout: Duration,
    metrics: &Path,
    bar: &indicatif::ProgressBar,
    mut killer: Option<&mut crate::faults::Killer>,
) -> std::result::Result<(), String> {
    let file = std::fs::File::create(log).map_err(|e| format!("cannot create {}: {e}", log.display()))?;
    let err_file = file.try_clone().map_err(|e| format!("cannot open {}: {e}", log.display()))?;
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(file))
        .stderr(Stdio::from(err_file))
        .process_group(0)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", exe.display()))?;
    register_group(child.id(), true);
    let deadline = Instant::now() + timeout;
    let mut tail = MetricsTail::default();
    let status = loop {
        if let Some(signal) = stop_requested() {
            kill_group(&mut child);
            register_group(child.id(), false);
            return Err(format!("stopped by signal {signal}"));
        }
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= deadline => {
                kill_group(&mut child);
                register_group(child.id(), false);
                return Err(format!("stopped after its time limit of {} s", timeout.as_secs_f64()));
            }
            Ok(None) => {
                let watched = killer.as_ref().is_some_and(|k| k.is_active());
                if (!bar.is_hidden() || watched) && tail.update(metrics) {
                    bar.set_position(tail.steps);
                    if let (Some(k), Some(last)) = (killer.as_deref_mut(), &tail.last_step) {
                        if let Some(progress) = k.observe(last) {
                            k.poll(child.id(), progress);
                        }
                    }
                }
                // A run with kills is watched closely (a step of a small model takes
                // milliseconds, and the clocks' offset is known to within the interval).
                std::thread::sleep(Duration::from_millis(if watched { 5 } else { 100 }));
            }
            Err(e) => {
                kill_group(&mut child);
                register_group(child.id(), false);
                return Err(format!("cannot wait for the run: {e}"));
            }
        }
    };
    register_group(child.id(), false);
    if status.success() {
        return Ok(());
    }
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let last_error = text.lines().rev().find_map(|l| {
        let l = l.trim();
        l.find("error: ").map(|i| l[i + "error: ".len()..].trim().to_string())
    });
    Err(last_error.unwrap_or_else(|| format!("{}; see {}", describe(status), log.display())))
}

/// How a process ended, for an error message: `exited with code 3`, `was killed by SIGKILL`.
pub fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(signal)) => match nix::sys::signal::Signal::try_from(signal) {
            Ok(s) => format!("was killed by {s}"),
            Err(_) => format!("was killed by signal {signal}"),
        },
        _ => format!("ended with {status}"),
    }
}

/// SIGTERM to the run's process group (`strata train` and `strata launch` stop their own
/// tasks on it), then SIGKILL to whatever is left after 5 s.
fn kill_group(child: &mut std::process::Child) {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let group = Pid::from_raw(-(child.id() as i32));
    let _ = kill(group, Signal::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(5);
    while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = kill(group, Signal::SIGKILL);
    let _ = child.wait();
}

/// Where a real experiment's output goes by default.
pub fn default_dir(exp: &Experiment, simulated: bool) -> PathBuf {
    let name = if simulated { format!("{}-simulated", exp.name) } else { exp.name.clone() };
    PathBuf::from("compare-out").join(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parameter_server_run_maps_its_tasks_to_hosts_and_names_them_in_tf_config() {
        let text = "[experiment]\nname = \"t\"\nepochs = 1\nglobal_batch = 96\nlr = 0.01\ntarget_accuracy = 0.9\n\
            [[run]]\nstrategy = \"parameter-server\"\nworkers = 3\nps_tasks = 2\n\
            [[run]]\nstrategy = \"multi-worker-mirrored\"\nworkers = 2\n";
        let exp = Experiment::parse(text, Path::new("x.toml")).unwrap();
        let tasks = host_tasks(&exp.runs[0], 2, 21_000);
        let placed: Vec<(String, usize, u16)> = tasks.iter().map(|t| (t.label(), t.host, t.port)).collect();
        let want = [("chief-0", 0, 21_000), ("ps-0", 0, 21_001), ("ps-1", 1, 21_002)]
            .into_iter()
            .chain([("worker-0", 0, 21_003), ("worker-1", 1, 21_004), ("worker-2", 0, 21_005)])
            .map(|(l, h, p)| (l.to_string(), h, p))
            .collect::<Vec<_>>();
        assert_eq!(placed, want);
        let configs = tf_configs(&tasks, |i| std::net::Ipv4Addr::new(10, 0, 0, 11 + i as u8));
        let v: serde_json::Value = serde_json::from_str(&configs[4]).unwrap();
        assert_eq!(v["task"], serde_json::json!({"type": "worker", "index": 1}));
        assert_eq!(v["cluster"]["chief"], serde_json::json!(["10.0.0.11:21000"]));
        assert_eq!(v["cluster"]["ps"], serde_json::json!(["10.0.0.11:21001", "10.0.0.12:21002"]));
        assert_eq!(v["cluster"]["worker"][2], "10.0.0.11:21005");
        let mwms = host_tasks(&exp.runs[1], 2, 21_064);
        assert_eq!(
            mwms.iter().map(|t| (t.kind, t.host)).collect::<Vec<_>>(),
            [(TaskKind::Worker, 0), (TaskKind::Worker, 1)]
        );
        let args = train_args(&exp, &exp.runs[1], Path::new("m.jsonl"), Path::new("s.json"));
        assert!(args.contains(&"--metrics".to_string()) && !args.contains(&"launch".to_string()));
        let rest = without_outputs(&args);
        assert!(!rest.iter().any(|a| a == "m.jsonl" || a == "s.json"));
        let at = rest.iter().position(|a| a == "--metrics").unwrap();
        assert_eq!((rest[at + 1].as_str(), rest.len()), ("/dev/null", args.len()));
    }

    #[test]
    fn a_run_s_compression_is_passed_on() {
        let text = "[experiment]\nname = \"t\"\nepochs = 1\nglobal_batch = 64\nlr = 0.01\ntarget_accuracy = 0.9\n\
            [[run]]\nstrategy = \"multi-worker-mirrored\"\ncompression = \"powersgd:4:100\"\n";
        let e = Experiment::parse(text, Path::new("x.toml")).unwrap();
        let line = command_line(&e, &e.runs[0], Path::new("m.jsonl"), Path::new("s.json"));
        let at = line.iter().position(|a| a == "--compression").expect("--compression passed on");
        assert_eq!(line[at + 1], "powersgd:4:100");
    }

    #[test]
    fn a_run_s_local_sgd_is_passed_on() {
        let text = "[experiment]\nname = \"t\"\nepochs = 1\nglobal_batch = 64\nlr = 0.01\ntarget_accuracy = 0.9\n\
            [[run]]\nstrategy = \"multi-worker-mirrored\"\nsync_every = 20\nfragments = 2\ncompression = \"int8\"\n";
        let e = Experiment::parse(text, Path::new("x.toml")).unwrap();
        let line = command_line(&e, &e.runs[0], Path::new("m.jsonl"), Path::new("s.json"));
        let value = |flag: &str| line.iter().position(|a| a == flag).map(|at| line[at + 1].clone());
        assert_eq!(value("--sync-every").as_deref(), Some("20"));
        assert_eq!(value("--outer-optimizer").as_deref(), Some("nesterov"));
        assert_eq!(value("--fragments").as_deref(), Some("2"));
        assert_eq!(value("--compression").as_deref(), Some("int8"));
    }

    #[test]
    fn the_ctr_settings_and_the_hybrid_mode_are_passed_on() {
        let text = "[experiment]\nname = \"t\"\nmodel = \"ctr\"\nepochs = 2\nglobal_batch = 512\nlr = 0.003\n\
            embedding_rows = 100000\nembedding_dim = 8\ntrain_records = 4096\ntest_records = 1000\n\
            table_optimizer = \"ftrl\"\ntable_lr = 0.1\n\
            [[run]]\nstrategy = \"parameter-server\"\nmode = \"hybrid\"\nworkers = 2\nps_tasks = 2\n\
            [[run]]\nstrategy = \"multi-worker-mirrored\"\n";
        let e = Experiment::parse(text, Path::new("x.toml")).unwrap();
        let line = command_line(&e, &e.runs[0], Path::new("m.jsonl"), Path::new("s.json"));
        let value = |line: &[String], flag: &str| line.iter().position(|a| a == flag).map(|at| line[at + 1].clone());
        for (flag, want) in [
            ("--model", "ctr"),
            ("--embedding-rows", "100000"),
            ("--embedding-dim", "8"),
            ("--train-records", "4096"),
            ("--test-records", "1000"),
            ("--table-optimizer", "ftrl"),
            ("--table-lr", "0.1"),
            ("--ps-mode", "hybrid"),
            // Its workers step together over the global batch, as multi-worker-mirrored's.
            ("--batch", "512"),
            ("--replicas", "1"),
        ] {
            assert_eq!(value(&line, flag).as_deref(), Some(want), "{flag}: {line:?}");
        }
        assert!(!line.iter().any(|a| a == "--hidden" || a == "launch"), "{line:?}");
        // The ring's workers step the table as a variable: no row optimizer.
        let mwms = command_line(&e, &e.runs[1], Path::new("m.jsonl"), Path::new("s.json"));
        assert_eq!(value(&mwms, "--embedding-rows").as_deref(), Some("100000"));
        assert!(!mwms.iter().any(|a| a == "--table-optimizer" || a == "--table-lr"), "{mwms:?}");
        // An in-process run steps the rows in the process with the same optimizer.
        let mut mirrored = e.runs[1].clone();
        mirrored.strategy = RunStrategy::Mirrored;
        let line = command_line(&e, &mirrored, Path::new("m.jsonl"), Path::new("s.json"));
        assert_eq!(value(&line, "--table-optimizer").as_deref(), Some("ftrl"), "{line:?}");
        assert_eq!(value(&line, "--table-lr").as_deref(), Some("0.1"), "{line:?}");
        // 4096 records in global batches of 512: 8 steps an epoch, 2 epochs; an async job's
        // workers push 256 each, 16 worker steps an epoch.
        assert_eq!(expected_steps(&e, &e.runs[0], 4096), 16);
        let mut async_ps = e.runs[0].clone();
        async_ps.mode = Some(PsMode::Async);
        assert_eq!(expected_steps(&e, &async_ps, 4096), 32);
        let line = command_line(&e, &async_ps, Path::new("m.jsonl"), Path::new("s.json"));
        assert_eq!(value(&line, "--batch").as_deref(), Some("256"));
    }

    #[test]
    fn the_shape_zero_stage_and_recomputation_are_passed_on() {
        let text = "[experiment]\nname = \"t\"\nmodel = \"transformer\"\nwidth = 256\nheads = 8\nepochs = 1\n\
            global_batch = 8\nlr = 0.003\ntarget_loss = 2.0\n\
            [[run]]\nstrategy = \"mirrored\"\nzero_stage = 3\nrecompute = true\n[[run]]\nstrategy = \"one-device\"\n";
        let e = Experiment::parse(text, Path::new("x.toml")).unwrap();
        let line = command_line(&e, &e.runs[0], Path::new("m.jsonl"), Path::new("s.json"));
        let value = |flag: &str| line.iter().position(|a| a == flag).map(|at| line[at + 1].clone());
        assert_eq!(value("--width").as_deref(), Some("256"));
        assert_eq!(value("--layers").as_deref(), Some("4"));
        assert_eq!(value("--heads").as_deref(), Some("8"));
        assert_eq!(value("--zero-stage").as_deref(), Some("3"));
        assert!(line.iter().any(|a| a == "--recompute"));
        let plain = command_line(&e, &e.runs[1], Path::new("m.jsonl"), Path::new("s.json"));
        assert!(!plain.iter().any(|a| a == "--zero-stage" || a == "--recompute"), "{plain:?}");
    }
}

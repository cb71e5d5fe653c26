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

use super::experiment::{Experiment, PsMode, RunModel, RunSpec, RunStrategy};
use super::RunResult;
use crate::{Error, Result};

/// The arguments of `strata` (after the executable) that run `spec`.
pub fn command_line(exp: &Experiment, spec: &RunSpec, metrics: &Path, summary: &Path) -> Vec<String> {
    let mut train: Vec<String> = vec!["train".into(), "--strategy".into(), spec.strategy.name().into()];
    train.extend(["--model".into(), exp.model.name().into()]);
    if exp.model == RunModel::Mlp {
        let hidden = exp.hidden.iter().map(|h| h.to_string()).collect::<Vec<_>>().join(",");
        train.extend(["--hidden".into(), hidden]);
    }
    if exp.model == RunModel::Transformer {
        // `steps` counts global batches: a parameter-server run's worker steps take a
        // worker's share each, so it schedules `workers` times as many (the same windows per
        // epoch as every other run).
        train.extend(["--steps".into(), transformer_steps(exp, spec).to_string()]);
    }
    let batch = match spec.strategy {
        // Each worker pushes its share of the global batch per step, as TensorFlow's
        // per-replica batch of a ParameterServerStrategy job.
        RunStrategy::ParameterServer => exp.global_batch / spec.workers.max(1),
        _ => exp.global_batch,
    };
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
    match spec.strategy {
        RunStrategy::ParameterServer => {
            train.extend([
                "--workers".into(),
                spec.workers.to_string(),
                "--ps-tasks".into(),
                spec.ps_tasks.to_string(),
                "--ps-mode".into(),
                match spec.mode.unwrap_or(PsMode::Async) {
                    PsMode::Async => "async",
                    PsMode::Sync => "sync",
                    PsMode::Stale => "stale",
                }
                .into(),
                "--backup-workers".into(),
                spec.backup_workers.to_string(),
                "--staleness".into(),
                spec.staleness.to_string(),
            ]);
            train
        }
        RunStrategy::MultiWorkerMirrored => {
            let mut launch: Vec<String> =
                vec!["launch".into(), "--workers".into(), spec.workers.to_string(), "--".into(), "strata".into()];
            launch.extend(train);
            launch
        }
        _ => train,
    }
}

/// `strata train`'s steps per epoch of the transformer when `steps` is not given.
const TRANSFORMER_DEFAULT_STEPS: usize = 1200;

/// The transformer's `--steps` for `spec`: the experiment's `steps` (global batches per
/// epoch), times the workers for a parameter-server run.
fn transformer_steps(exp: &Experiment, spec: &RunSpec) -> usize {
    let steps = exp.steps.unwrap_or(TRANSFORMER_DEFAULT_STEPS);
    match spec.strategy {
        RunStrategy::ParameterServer => steps * spec.workers.max(1),
        _ => steps,
    }
}

/// Steps a run makes (for its progress bar).
fn expected_steps(exp: &Experiment, spec: &RunSpec, train_len: usize) -> u64 {
    if exp.model == RunModel::Transformer {
        return (transformer_steps(exp, spec) * exp.epochs) as u64;
    }
    let batch = match spec.strategy {
        RunStrategy::ParameterServer => exp.global_batch / spec.workers.max(1),
        _ => exp.global_batch,
    };
    (train_len.div_ceil(batch.max(1)) * exp.epochs) as u64
}

/// Runs every run of `exp` (or those named in `only`), writing their logs and records under
/// `dir/runs`.
pub fn run_all(exp: &Experiment, dir: &Path, only: &[String], progress: bool) -> Result<Vec<RunResult>> {
    let exe = std::env::current_exe().map_err(|e| Error::io("finding the strata executable", e))?;
    let runs_dir = dir.join("runs");
    std::fs::create_dir_all(&runs_dir).map_err(|e| Error::io(format!("cannot create {}", runs_dir.display()), e))?;
    let train_len = match exp.model {
        RunModel::Transformer => 0,
        _ => strata::digits::train_test_split(&strata::digits::load(exp.data.as_deref())?, 0.2, 0).0.len(),
    };
    for name in only {
        if !exp.runs.iter().any(|r| &r.name == name) {
            let names: Vec<&str> = exp.runs.iter().map(|r| r.name.as_str()).collect();
            return Err(Error::Usage(format!("--only {name:?}: no such run; the runs are {}", names.join(", "))));
        }
    }
    let mut results = Vec::new();
    for spec in exp.runs.iter().filter(|r| only.is_empty() || only.contains(&r.name)) {
        let bar = crate::progress::bar(progress, expected_steps(exp, spec, train_len));
        bar.set_message(spec.name.clone());
        let result = run_one(&exe, exp, spec, &runs_dir, &bar);
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
    Ok(results)
}

fn run_one(exe: &Path, exp: &Experiment, spec: &RunSpec, runs_dir: &Path, bar: &indicatif::ProgressBar) -> RunResult {
    let metrics = runs_dir.join(format!("{}.jsonl", spec.name));
    let summary = runs_dir.join(format!("{}.json", spec.name));
    let log = runs_dir.join(format!("{}.log", spec.name));
    let _ = std::fs::remove_file(&metrics);
    let _ = std::fs::remove_file(&summary);
    let started = Instant::now();
    let outcome = spawn_and_wait(
        exe,
        &command_line(exp, spec, &metrics, &summary),
        &log,
        spec.timeout.unwrap_or(exp.run_timeout),
        &metrics,
        bar,
    );
    let wall_s = started.elapsed().as_secs_f64();
    let (records, read_error) = match strata::metrics::read(&metrics) {
        Ok(r) => (r, None),
        Err(_) if outcome.is_err() => (Vec::new(), None),
        Err(e) => (Vec::new(), Some(e.to_string())),
    };
    let mut error = outcome.err().or(read_error);
    if error.is_none() && !records.iter().any(|r| r.kind == strata::metrics::RecordKind::Eval) {
        error = Some("the run wrote no evaluation".into());
    }
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
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= deadline => {
                kill_group(&mut child);
                return Err(format!("stopped after its time limit of {} s", timeout.as_secs_f64()));
            }
            Ok(None) => {
                if !bar.is_hidden() {
                    if let Ok(text) = std::fs::read_to_string(metrics) {
                        bar.set_position(text.lines().filter(|l| l.contains("\"kind\":\"step\"")).count() as u64);
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => {
                kill_group(&mut child);
                return Err(format!("cannot wait for the run: {e}"));
            }
        }
    };
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

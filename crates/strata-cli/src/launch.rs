//! `strata launch`: a local cluster of processes, one per task, like torchrun.
//!
//! The launcher picks a free loopback port for every task, writes each task's `TF_CONFIG` as
//! TensorFlow writes it, starts the processes, prefixes their output lines with the task, and
//! supervises them: a signal to the launcher reaches every task, and the first task that fails
//! stops the whole group.
//!
//! Every task runs in its own process group, and signals go to that group, so a task's own
//! children (a shell's `sleep`, a Python worker's data loaders) are stopped with it, and a
//! Ctrl-C in the terminal reaches the tasks once, through the launcher, not twice.

use std::ffi::{OsStr, OsString};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use strata_compare::experiment::parse_duration_or_seconds;
use strata_strategies::cluster::{ClusterConfig, ClusterSpec, TaskId, TaskType};

use crate::cluster_token::{self, TOKEN_VAR};
use crate::{Error, Result};

/// The environment variable that names the task, e.g. `worker:1`.
pub const TASK_VAR: &str = "STRATA_TASK";

/// The most processes a local cluster starts on this machine.
pub(crate) const MAX_LOCAL_TASKS: usize = 256;

/// How often the launcher looks for tasks that have exited.
const POLL: Duration = Duration::from_millis(20);
/// How long the launcher waits for the last output of tasks that have exited.
const DRAIN: Duration = Duration::from_secs(2);

/// The long help of `strata launch`, also the documentation of [`LaunchArgs`].
macro_rules! launch_help {
    () => {
        "Every task runs PROGRAM with ARGS; `strata` as PROGRAM runs this very executable, so
`strata launch --workers 2 -- strata train --strategy multi-worker-mirrored` needs no strata on PATH.
Tasks: `chief:0` with --chief, `worker:0` .. `worker:N-1`, `ps:0` .. `ps:M-1`.

Each task's environment has:
- TF_CONFIG: the cluster and the task as TensorFlow writes it, on free ports of --host, empty jobs
  left out, e.g. {\"cluster\":{\"worker\":[\"127.0.0.1:40001\",\"127.0.0.1:40002\"]},\"task\":{\"type\":\"worker\",\"index\":1}};
- STRATA_TASK: the task, e.g. `worker:1`;
- STRATA_CLUSTER_TOKEN: the launcher's own if it has one, else a fresh random token shared by the
  tasks, so that the local cluster is private.

Each line a task writes is printed with the task in front, `[worker:1] ...`, its stdout on stdout
and its stderr on stderr. Stdin is closed. Each task runs in its own process group.

SIGINT (Ctrl-C), SIGTERM and SIGHUP to the launcher are forwarded to every task; tasks still running
after --grace-period are killed (a second signal kills them at once). When a task exits non-zero or
is killed, the launcher names it, stops the other tasks (SIGTERM, then SIGKILL after
--grace-period) and exits with the code of the task that had the error: the first failed task
whose stderr carried an `error:` line (or the task that line names as lost or failed, when that
one failed too), else the first that exited with a non-zero code, else the first killed by a
signal (128 + the signal). When that is not the task that exited first, a last
line names it and its error. A stopped task (SIGSTOP), which cannot act on SIGTERM, is killed
at once instead of after the grace period; when another task reported it lost, the last line
names it with that report, and the launcher exits with the reporter's code, not its own kill's.
It exits 0 when every task exits 0, and 128 + the signal when it was interrupted and every task
still exited 0.

An elastic job (the program's `--min-workers N`): the launcher serves the job's coordination
service itself and gives every task its address in STRATA_COORDINATOR. A task that is lost no
longer stops the others: the job goes on while N workers live, --max-restarts K starts a new
process for a lost task (it joins the running job) up to K times per task, a stopped task is
killed at once when the others are done, and the launcher exits with the job's outcome, naming
the tasks lost on the way."
    };
}

/// `strata launch` flags: start a local cluster, one process per task, each with its `TF_CONFIG`.
///
#[doc = launch_help!()]
#[derive(clap::Args, Debug, Clone)]
#[command(after_long_help = launch_help!())]
pub struct LaunchArgs {
    /// Worker tasks (`worker:0` .. `worker:N-1`); without --chief, worker 0 acts as chief.
    #[arg(long, value_name = "N")]
    pub workers: usize,
    /// Also start a chief task (`chief:0`).
    #[arg(long)]
    pub chief: bool,
    /// Parameter-server tasks (`ps:0` .. `ps:M-1`).
    #[arg(long, value_name = "M", default_value_t = 0)]
    pub ps: usize,
    /// The address the tasks listen on; a free port is picked on it for every task.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// How long tasks have to exit after a signal before they are killed (e.g. 5s, 500ms, 1m).
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration_or_seconds)]
    pub grace_period: Duration,
    /// In an elastic job (the program's `--min-workers`): start a new process for a task that
    /// is lost (exits non-zero or is killed) up to K times per task; it joins the running job.
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub max_restarts: usize,
    /// The program every task runs, and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "PROGRAM [ARGS]")]
    pub command: Vec<OsString>,
}

/// The environment variable that tells the tasks of an elastic job where its coordination
/// service listens (`strata train --coordinator`).
pub const COORDINATOR_VAR: &str = "STRATA_COORDINATOR";

/// The program's `--min-workers N` (or `--min-workers=N`): the job is elastic.
fn elastic_min_workers(args: &[OsString]) -> Result<Option<usize>> {
    let mut it = args.iter().map(|a| a.to_string_lossy());
    while let Some(a) = it.next() {
        let value = if a == "--min-workers" {
            it.next().map(|v| v.into_owned())
        } else if let Some(v) = a.strip_prefix("--min-workers=") {
            Some(v.to_string())
        } else {
            continue;
        };
        let v = value.unwrap_or_default();
        return v.parse::<usize>().map(Some).map_err(|_| {
            Error::Usage(format!("--min-workers {v:?}: not a number of workers; pass a whole number such as 2"))
        });
    }
    Ok(None)
}

/// The tasks of a cluster of an optional chief, `workers` workers and `ps` parameter servers,
/// in that order.
pub fn tasks(chief: bool, workers: usize, ps: usize) -> Vec<TaskId> {
    let chief = (0..usize::from(chief)).map(|_| TaskId::chief());
    chief.chain((0..workers).map(TaskId::worker)).chain((0..ps).map(TaskId::ps)).collect()
}

/// The `TF_CONFIG` JSON of `task` in `cluster`, as TensorFlow writes it.
pub fn tf_config(cluster: &ClusterSpec, task: TaskId) -> Result<String> {
    Ok(ClusterConfig::new(cluster.clone(), task)?.to_tf_config())
}

/// Picks `n` distinct free ports on `host`, below the kernel's ephemeral range so that no
/// connection takes one before its task binds it ([`strata_transport::ports::free_ports`]).
pub(crate) fn free_addresses(host: IpAddr, n: usize) -> Result<Vec<String>> {
    let ports = strata_transport::ports::free_ports(host, n).map_err(|e| {
        Error::Usage(format!(
            "--host {host}: cannot bind a port ({e}); pass an address of this machine such as 127.0.0.1"
        ))
    })?;
    Ok(ports.into_iter().map(|port| SocketAddr::new(host, port).to_string()).collect())
}

/// The cluster spec of `tasks` at `addresses` (one per task, in order).
pub(crate) fn cluster_spec(tasks: &[TaskId], addresses: &[String]) -> Result<ClusterSpec> {
    let jobs = [TaskType::Chief, TaskType::Worker, TaskType::Ps].map(|kind| {
        let addrs: Vec<String> =
            tasks.iter().zip(addresses).filter(|(t, _)| t.kind == kind).map(|(_, a)| a.clone()).collect();
        (kind, addrs)
    });
    Ok(ClusterSpec::new(jobs.into_iter().filter(|(_, a)| !a.is_empty()))?)
}

/// What the supervisor hears about.
pub(crate) enum Event {
    /// A signal to the launcher.
    Signal(Signal),
    /// One of the tasks' output pipes reached its end.
    OutputClosed,
    /// Task number `.0` wrote a line beginning with `error:` on its stderr (`.1`).
    ErrorLine(usize, String),
}

/// A started task.
struct Running {
    task: TaskId,
    child: Child,
    /// The task's process group (its own pid).
    group: Pid,
    status: Option<ExitStatus>,
}

/// Sends `signal` to the process groups of the tasks not yet reaped (a group whose leader is not
/// reaped cannot have its id reused, so this never reaches an unrelated process).
fn signal_running(running: &[Running], signal: Signal) {
    for r in running.iter().filter(|r| r.status.is_none()) {
        // ESRCH: the group is already gone.
        let _ = kill(Pid::from_raw(-r.group.as_raw()), signal);
    }
}

/// Whether the process `pid` is stopped (SIGSTOP, SIGTSTP, a debugger): it cannot act on
/// SIGTERM until it is continued.
fn is_stopped(pid: Pid) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()))
        .is_some_and(|state| matches!(state, 'T' | 't'))
}

/// Asks the tasks not yet reaped to stop with `signal`: a stopped task, which could not act on
/// it, is killed at once (and marked in `killed`); the others get `signal` and then SIGCONT, so
/// that one stopped in the meantime still receives it.
fn stop_running(running: &[Running], signal: Signal, killed: &mut [bool]) {
    for (i, r) in running.iter().enumerate().filter(|(_, r)| r.status.is_none()) {
        let group = Pid::from_raw(-r.group.as_raw());
        if is_stopped(r.group) {
            let _ = kill(group, Signal::SIGKILL);
            killed[i] = true;
        } else {
            let _ = kill(group, signal);
            let _ = kill(group, Signal::SIGCONT);
        }
    }
}

/// The exit code a launcher passes on for a task's status: the code, or 128 + the signal.
fn exit_code(status: ExitStatus) -> i32 {
    status.code().or_else(|| status.signal().map(|s| 128 + s)).unwrap_or(1)
}

/// Copies `source` to the launcher's stdout or stderr line by line, each line prefixed; a last
/// line without a newline is still printed. Write errors (a closed terminal) are ignored so
/// that the task never blocks on a full pipe. With `task`, the first line that begins with
/// `error:` is reported as [`Event::ErrorLine`].
pub(crate) fn forward_lines(
    source: impl Read + Send + 'static,
    prefix: String,
    to_stderr: bool,
    events: Sender<Event>,
    task: Option<usize>,
) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(source);
        let mut text = Vec::new();
        let mut line = Vec::new();
        loop {
            text.clear();
            match reader.read_until(b'\n', &mut text) {
                Ok(0) => break,
                Ok(_) => {
                    if text.last() == Some(&b'\n') {
                        text.pop();
                    }
                    if let Some(t) = task.filter(|_| text.starts_with(b"error:")) {
                        let line = String::from_utf8_lossy(&text[..text.len().min(512)]).into_owned();
                        let _ = events.send(Event::ErrorLine(t, line));
                    }
                    line.clear();
                    line.extend_from_slice(prefix.as_bytes());
                    line.extend_from_slice(&text);
                    line.push(b'\n');
                    let _ = if to_stderr {
                        write_line(io::stderr().lock(), &line)
                    } else {
                        write_line(io::stdout().lock(), &line)
                    };
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        let _ = events.send(Event::OutputClosed);
    });
}

fn write_line(mut out: impl Write, line: &[u8]) -> io::Result<()> {
    out.write_all(line)?;
    out.flush()
}

/// What every task of a launch starts with.
#[derive(Clone, Copy)]
struct Spawn<'a> {
    program: &'a OsStr,
    executable: &'a OsStr,
    args: &'a [OsString],
    cluster: &'a ClusterSpec,
    token: &'a str,
    coordinator: Option<&'a str>,
}

/// Starts every task; on failure, kills those already started and names the program.
fn start(spawn: &Spawn<'_>, tasks: &[TaskId], events: &Sender<Event>) -> Result<Vec<Running>> {
    let Spawn { program, executable, args, cluster, token, coordinator } = *spawn;
    let mut running: Vec<Running> = Vec::with_capacity(tasks.len());
    for task in tasks {
        let mut command = Command::new(executable);
        if let Some(c) = coordinator {
            command.env(COORDINATOR_VAR, c);
        }
        let spawned = command
            .args(args)
            .env("TF_CONFIG", tf_config(cluster, *task)?)
            .env(TASK_VAR, task.to_string())
            .env(TOKEN_VAR, token)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                signal_running(&running, Signal::SIGKILL);
                for r in &mut running {
                    let _ = r.child.wait();
                }
                let why = match e.kind() {
                    io::ErrorKind::NotFound => "no such program".to_string(),
                    io::ErrorKind::PermissionDenied => "permission denied".to_string(),
                    _ => e.to_string(),
                };
                return Err(Error::Usage(format!(
                    "cannot start `{}` for task {task}: {why}; pass a program on PATH or the path of an executable after --",
                    program.to_string_lossy()
                )));
            }
        };
        let prefix = format!("[{task}] ");
        if let Some(out) = child.stdout.take() {
            forward_lines(out, prefix.clone(), false, events.clone(), None);
        }
        if let Some(err) = child.stderr.take() {
            let index = tasks.iter().position(|t| t == task).unwrap_or(running.len());
            forward_lines(err, prefix, true, events.clone(), Some(index));
        }
        let group = Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
        running.push(Running { task: *task, child, group, status: None });
    }
    Ok(running)
}

/// Runs `strata launch`. Returns when every task exited 0; otherwise ends the process with the
/// failed task's exit code (or 128 + the signal that interrupted the launcher).
pub fn run(args: &LaunchArgs) -> Result<()> {
    if args.workers == 0 && !args.chief {
        return Err(Error::Usage("--workers 0 without --chief starts no task; pass --workers 1 or more".into()));
    }
    if args.workers.saturating_add(args.ps).saturating_add(usize::from(args.chief)) > MAX_LOCAL_TASKS {
        return Err(Error::Usage(format!(
            "--workers {} --ps {}: over the limit of {MAX_LOCAL_TASKS} tasks started on this machine; start fewer",
            args.workers, args.ps
        )));
    }
    let Some((program, program_args)) = args.command.split_first() else {
        return Err(Error::Usage(
            "no program to launch; pass it after --, e.g. strata launch --workers 2 -- strata train".into(),
        ));
    };
    let executable: OsString = if program == "strata" {
        std::env::current_exe().map_err(|e| Error::io("finding the strata executable", e))?.into_os_string()
    } else {
        PathBuf::from(program).into_os_string()
    };

    let tasks = tasks(args.chief, args.workers, args.ps);
    let addresses = free_addresses(args.host, tasks.len())?;
    let cluster = cluster_spec(&tasks, &addresses)?;
    let token = cluster_token::for_local_cluster();
    let service = elastic_service(args, program_args, &cluster, &token)?;
    let coordinator = service.as_ref().map(|s| s.address().to_string());

    // Handlers, not a blocked mask: a mask is inherited by the tasks (std's Command does not
    // reset it), which then never see SIGINT or SIGTERM (see `signals`).
    let signals = crate::signals::handle()?;
    let (events, received) = mpsc::channel();
    {
        let events = events.clone();
        std::thread::spawn(move || {
            while let Ok(signal) = signals.recv() {
                if events.send(Event::Signal(signal)).is_err() {
                    break;
                }
            }
        });
    }

    let spawn = Spawn {
        program,
        executable: &executable,
        args: program_args,
        cluster: &cluster,
        token: &token,
        coordinator: coordinator.as_deref(),
    };
    let running = start(&spawn, &tasks, &events)?;
    let mut supervisor = Supervisor::new(args, &spawn, &events, service.as_ref(), running);
    while supervisor.running.iter().any(|r| r.status.is_none()) {
        supervisor.supervise_once(&received)?;
    }
    supervisor.drain(&received);
    supervisor.finish()
}

/// An elastic job (the program's `--min-workers N`): the launcher serves its coordination
/// service, which outlives any task. `None` for a job that is not elastic, which
/// `--max-restarts` does not apply to.
fn elastic_service(
    args: &LaunchArgs,
    program_args: &[OsString],
    cluster: &ClusterSpec,
    token: &str,
) -> Result<Option<strata_transport::CoordinationServerHandle>> {
    let elastic = elastic_min_workers(program_args)?;
    if args.max_restarts > 0 && elastic.is_none() {
        return Err(Error::Usage(format!(
            "--max-restarts {} restarts a lost task into an elastic job, and this one is not: pass --min-workers N to the program (strata train --strategy multi-worker-mirrored --min-workers N)",
            args.max_restarts
        )));
    }
    let Some(min) = elastic else { return Ok(None) };
    let names: Vec<String> = cluster.sync_workers().iter().map(ToString::to_string).collect();
    strata_strategies::ElasticOptions::check_min_workers(min, names.len())?;
    let service = strata_transport::CoordinationServerHandle::start_elastic(
        SocketAddr::new(args.host, 0),
        names,
        min,
        strata_transport::ClusterToken::new(token)?,
        strata_transport::CoordinationConfig::default(),
    )?;
    Ok(Some(service))
}

/// The launcher's watch over its tasks, from the first start to the last exit.
struct Supervisor<'a> {
    args: &'a LaunchArgs,
    spawn: &'a Spawn<'a>,
    events: &'a Sender<Event>,
    /// An elastic job's coordination service.
    service: Option<&'a strata_transport::CoordinationServerHandle>,
    running: Vec<Running>,
    /// Per task: the processes started in place of lost ones.
    restarts: Vec<usize>,
    /// Task outputs (stdout and stderr) not yet closed.
    outputs_open: usize,
    failure: Option<i32>,
    /// The first task to fail, and each task's first `error:` line in the order they arrived.
    first_failed: Option<usize>,
    error_lines: Vec<(usize, String)>,
    interrupted: Option<Signal>,
    kill_at: Option<Instant>,
    killed: bool,
    /// The tasks the launcher killed itself: their status is its doing, not their failure.
    killed_by_launcher: Vec<bool>,
}

impl<'a> Supervisor<'a> {
    fn new(
        args: &'a LaunchArgs,
        spawn: &'a Spawn<'a>,
        events: &'a Sender<Event>,
        service: Option<&'a strata_transport::CoordinationServerHandle>,
        running: Vec<Running>,
    ) -> Self {
        let n = running.len();
        Self {
            args,
            spawn,
            events,
            service,
            running,
            restarts: vec![0; n],
            outputs_open: 2 * n,
            failure: None,
            first_failed: None,
            error_lines: Vec::new(),
            interrupted: None,
            kill_at: None,
            killed: false,
            killed_by_launcher: vec![false; n],
        }
    }

    /// One round of the watch: an event (or a poll's wait), every task's exit, the elastic
    /// job's state, and the kill after the grace period.
    fn supervise_once(&mut self, received: &Receiver<Event>) -> Result<()> {
        match received.recv_timeout(POLL) {
            Ok(Event::Signal(signal)) => self.on_signal(signal),
            Ok(Event::OutputClosed) => self.outputs_open = self.outputs_open.saturating_sub(1),
            Ok(Event::ErrorLine(t, line)) => note_error(&mut self.error_lines, t, line),
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {}
        }
        for i in 0..self.running.len() {
            self.reap(i)?;
        }
        if let Some(service) = self.service {
            self.watch_elastic_job(service);
        }
        if !self.killed && self.kill_at.is_some_and(|at| Instant::now() >= at) {
            signal_running(&self.running, Signal::SIGKILL);
            mark_running(&self.running, &mut self.killed_by_launcher);
            self.killed = true;
        }
        Ok(())
    }

    /// A signal to the launcher: the first is forwarded to every task (killed after the grace
    /// period), the second kills them at once.
    fn on_signal(&mut self, signal: Signal) {
        if self.interrupted.is_none() {
            self.interrupted = Some(signal);
            eprintln!(
                "strata launch: {signal} received; forwarding it to every task (killed after {:?}, or at a second signal)",
                self.args.grace_period
            );
            stop_running(&self.running, signal, &mut self.killed_by_launcher);
            self.kill_at.get_or_insert(Instant::now() + self.args.grace_period);
        } else if !self.killed {
            eprintln!("strata launch: second signal ({signal}); killing every task");
            signal_running(&self.running, Signal::SIGKILL);
            mark_running(&self.running, &mut self.killed_by_launcher);
            self.killed = true;
        }
    }

    /// Task `i`'s exit, if it has exited: a failure stops the others, unless the elastic job
    /// goes on without it (and a new process may take its place).
    fn reap(&mut self, i: usize) -> Result<()> {
        if self.running[i].status.is_some() {
            return Ok(());
        }
        let status = match self.running[i].child.try_wait() {
            Ok(None) => return Ok(()),
            Ok(Some(status)) => status,
            Err(e) => {
                // Cannot happen for our own child; treat the task as failed.
                eprintln!("strata launch: waiting for task {}: {e}", self.running[i].task);
                ExitStatus::from_raw(1 << 8)
            }
        };
        self.running[i].status = Some(status);
        if status.success() || self.failure.is_some() {
            return Ok(());
        }
        if self.service.is_some_and(|s| s.error().is_none() && self.kill_at.is_none()) {
            return self.lost_from_elastic_job(i, status);
        }
        self.failure = Some(exit_code(status));
        self.first_failed = Some(i);
        let task = &self.running[i].task;
        if self.kill_at.is_none() {
            eprintln!(
                "strata launch: task {task} {}; stopping the other tasks",
                strata_compare::runner::describe(status)
            );
            stop_running(&self.running, Signal::SIGTERM, &mut self.killed_by_launcher);
            self.kill_at = Some(Instant::now() + self.args.grace_period);
        } else {
            eprintln!("strata launch: task {task} {}", strata_compare::runner::describe(status));
        }
        Ok(())
    }

    /// An elastic job goes on without task `i` (its members re-form); a restart joins it at the
    /// next step boundary.
    fn lost_from_elastic_job(&mut self, i: usize, status: ExitStatus) -> Result<()> {
        let task = self.running[i].task;
        let why = strata_compare::runner::describe(status);
        if self.service.is_some_and(|s| s.left_on_request().contains(&task.to_string())) {
            // Asked to stop alone (not by this launcher): it left; nothing to restart.
            eprintln!("strata launch: task {task} left the elastic job on request; the job goes on without it");
            return Ok(());
        }
        if self.restarts[i] < self.args.max_restarts {
            self.restarts[i] += 1;
            eprintln!(
                "strata launch: task {task} {why}; the elastic job goes on, and a new process joins it (restart {} of {})",
                self.restarts[i], self.args.max_restarts
            );
            let mut again = start(self.spawn, &[task], self.events)?;
            if let Some(r) = again.pop() {
                self.outputs_open += 2;
                self.running[i] = r;
            }
        } else {
            eprintln!("strata launch: task {task} {why}; the elastic job goes on without it");
        }
        Ok(())
    }

    /// An elastic job that failed stops the tasks left; one whose live tasks are all stopped
    /// (fenced when continued) after every member left is over.
    fn watch_elastic_job(&mut self, service: &strata_transport::CoordinationServerHandle) {
        if self.kill_at.is_none() && service.error().is_some() {
            // The elastic job failed (too few workers left, or a task's error): stop the rest.
            eprintln!("strata launch: the elastic job failed; stopping the other tasks");
            stop_running(&self.running, Signal::SIGTERM, &mut self.killed_by_launcher);
            self.kill_at = Some(Instant::now() + self.args.grace_period);
        } else if self.kill_at.is_none() {
            // The job is over when every live task has exited: a stopped one (fenced when it
            // is continued) is killed at once.
            let running = &self.running;
            let pending: Vec<usize> = (0..running.len()).filter(|&i| running[i].status.is_none()).collect();
            if !pending.is_empty() && pending.iter().all(|&i| is_stopped(running[i].group)) && service.all_left() {
                stop_running(&self.running, Signal::SIGTERM, &mut self.killed_by_launcher);
                self.kill_at = Some(Instant::now() + self.args.grace_period);
            }
        }
    }

    /// The last lines of output, which may still be on their way.
    fn drain(&mut self, received: &Receiver<Event>) {
        let drained_by = Instant::now() + DRAIN;
        while self.outputs_open > 0 {
            let left = drained_by.saturating_duration_since(Instant::now());
            match received.recv_timeout(left) {
                Ok(Event::OutputClosed) => self.outputs_open -= 1,
                Ok(Event::ErrorLine(t, line)) => note_error(&mut self.error_lines, t, line),
                Ok(Event::Signal(_)) => {}
                Err(_) => break,
            }
        }
    }

    /// The launcher's outcome: the elastic job's, or that of the task to blame (named when it
    /// is not the first that failed), or the interrupting signal's.
    fn finish(mut self) -> Result<()> {
        if let Some(service) = self.service.filter(|s| s.error().is_none()) {
            return elastic_outcome(service, self.interrupted);
        }
        let running = &self.running;
        let statuses: Vec<Option<ExitStatus>> = running.iter().map(|r| r.status).collect();
        let names: Vec<String> = running.iter().map(|r| r.task.to_string()).collect();
        let error_lines = &self.error_lines;
        let reported_lost =
            |blamed: usize| error_lines.iter().find(|(t, l)| *t != blamed && blames_task(l, &names[blamed])).cloned();
        if let Some((blamed, (reporter, report))) = blamed_task(&names, &statuses, error_lines)
            .filter(|(b, line)| line.is_none() && self.killed_by_launcher[*b])
            .and_then(|(b, _)| reported_lost(b).map(|r| (b, r)))
        {
            // The launcher's own kill of a task another reported lost (a stopped task cannot act
            // on SIGTERM) is not the cause: name the task and the report, and exit as the reporter.
            eprintln!(
                "strata launch: the job failed in task {}, which task {} reported lost: {report}",
                running[blamed].task, running[reporter].task
            );
            if let Some(status) = statuses[reporter] {
                self.failure = Some(exit_code(status));
            }
        } else if let Some((blamed, line)) = blamed_task(&names, &statuses, error_lines) {
            if self.first_failed.is_some_and(|f| f != blamed) {
                let status = statuses[blamed].map_or_else(|| "failed".to_string(), strata_compare::runner::describe);
                match line {
                    Some(line) => {
                        eprintln!("strata launch: the job failed in task {} ({status}): {line}", running[blamed].task)
                    }
                    None => eprintln!("strata launch: the job failed in task {} ({status})", running[blamed].task),
                }
            }
            if let Some(status) = statuses[blamed] {
                self.failure = Some(exit_code(status));
            }
        }
        match self.failure.or(self.interrupted.map(|s| 128 + s as i32)) {
            None => Ok(()),
            Some(code) => exit_now(code),
        }
    }
}

/// The outcome of an elastic job that completed (or stopped on request): the launcher's,
/// whatever tasks were lost on the way.
fn elastic_outcome(service: &strata_transport::CoordinationServerHandle, interrupted: Option<Signal>) -> Result<()> {
    for l in service.lost_tasks() {
        eprintln!("strata launch: lost on the way: {l}");
    }
    let (generation, members) = service.membership();
    let stopped = service.stopped();
    let ended = if stopped.is_some() { "stopped on request" } else { "completed" };
    eprintln!("strata launch: the elastic job {ended} in generation {generation} with {}", members.join(", "));
    let code = interrupted.map(|s| 128 + s as i32).or(stopped.map(|c| 128 + c.min(127) as i32));
    match code {
        Some(code) => exit_now(code),
        None => Ok(()),
    }
}

/// Ends the launcher with `code`, its output flushed.
fn exit_now(code: i32) -> ! {
    let _ = io::stdout().flush();
    let _ = io::stderr().flush();
    std::process::exit(code)
}

/// Marks the tasks not yet reaped as killed by the launcher.
fn mark_running(running: &[Running], killed: &mut [bool]) {
    for (i, r) in running.iter().enumerate() {
        if r.status.is_none() {
            killed[i] = true;
        }
    }
}

/// Whether an `error:` line says task `name` was lost or failed.
fn blames_task(line: &str, name: &str) -> bool {
    line.contains(&format!("lost task {name}")) || line.contains(&format!("task {name} failed"))
}

/// Keeps a task's first `error:` line, in arrival order.
fn note_error(lines: &mut Vec<(usize, String)>, task: usize, line: String) {
    if !lines.iter().any(|(t, _)| *t == task) {
        lines.push((task, line));
    }
}

/// The task a failed job is blamed on, and its `error:` line if it wrote one: the first failed
/// task (by when its `error:` line arrived) whose stderr carried one, followed to the task that
/// line blames when it says another failed task was lost or failed (`lost task worker:0`,
/// `task worker:0 failed`); else the first task, in task order, that exited with a non-zero
/// code; else the first killed by a signal. `None` when no task failed. The task that exits or
/// complains first is often a bystander: a worker that lost its peer ends before the chief that
/// had the error has finished reporting it.
fn blamed_task(
    names: &[String],
    statuses: &[Option<ExitStatus>],
    error_lines: &[(usize, String)],
) -> Option<(usize, Option<String>)> {
    let failed = |t: usize| statuses.get(t).copied().flatten().is_some_and(|s| !s.success());
    if let Some((mut t, mut line)) = error_lines.iter().find(|(t, _)| failed(*t)).cloned() {
        for _ in 0..names.len() {
            let blames = |n: &String| blames_task(&line, n);
            let next = (0..names.len()).find(|&o| o != t && failed(o) && blames(&names[o]));
            let Some(o) = next else { break };
            t = o;
            match error_lines.iter().find(|(e, _)| *e == o) {
                Some((_, l)) => line = l.clone(),
                None => return Some((o, None)),
            }
        }
        return Some((t, Some(line)));
    }
    let coded = (0..statuses.len()).find(|&t| failed(t) && statuses[t].is_some_and(|s| s.code().is_some()));
    coded.or_else(|| (0..statuses.len()).find(|&t| failed(t))).map(|t| (t, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_task_with_the_error_is_blamed_not_the_first_to_exit() {
        let code = |c: i32| Some(ExitStatus::from_raw(c << 8));
        let killed = |s: i32| Some(ExitStatus::from_raw(s));
        let names: Vec<String> = ["worker:0", "worker:1", "worker:2"].map(String::from).to_vec();
        let corrupt = "error: checkpoint: corrupt".to_string();
        let lost = "error: task worker:1: lost task worker:0 during broadcast(root 0, 2 u64)".to_string();
        // The chief wrote the error first; worker 1 exited first.
        let statuses = [code(1), code(1), Some(ExitStatus::from_raw(0))];
        let lines = vec![(0, corrupt.clone()), (1, lost.clone())];
        assert_eq!(blamed_task(&names, &statuses, &lines), Some((0, Some(corrupt.clone()))));
        // Worker 1's line arrived first, but it blames the chief, which failed too.
        let lines = vec![(1, lost.clone()), (0, corrupt.clone())];
        assert_eq!(blamed_task(&names, &statuses, &lines), Some((0, Some(corrupt.clone()))));
        let reported =
            vec![(2, "error: task worker:1 failed: out of memory".to_string()), (1, "error: out of memory".into())];
        assert_eq!(
            blamed_task(&names, &[code(1), code(1), code(1)], &reported),
            Some((1, Some("error: out of memory".into())))
        );
        // A task whose error line came first but that exited 0 is not blamed, nor followed to.
        let statuses = [Some(ExitStatus::from_raw(0)), code(3), None];
        assert_eq!(blamed_task(&names, &statuses, &lines), Some((1, Some(lost))));
        // Without error lines: a non-zero code before a signal.
        assert_eq!(blamed_task(&names, &[killed(15), code(7)], &[]), Some((1, None)));
        assert_eq!(blamed_task(&names, &[killed(9), None], &[]), Some((0, None)));
        assert_eq!(blamed_task(&names, &[code(0), None], &[]), None);
    }

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration_or_seconds("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration_or_seconds("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration_or_seconds("1.5m"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration_or_seconds("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration_or_seconds("0s"), Ok(Duration::ZERO));
        assert!(parse_duration_or_seconds("5 parsecs").is_err());
        assert!(parse_duration_or_seconds("-1s").is_err());
        assert!(parse_duration_or_seconds("").is_err());
    }

    #[test]
    fn tf_config_is_tensorflows() {
        let tasks = tasks(true, 2, 1);
        let addresses: Vec<String> = (0..4).map(|i| format!("127.0.0.1:{}", 1000 + i)).collect();
        let spec = cluster_spec(&tasks, &addresses).unwrap();
        assert_eq!(
            tf_config(&spec, tasks[2]).unwrap(),
            r#"{"cluster":{"chief":["127.0.0.1:1000"],"worker":["127.0.0.1:1001","127.0.0.1:1002"],"ps":["127.0.0.1:1003"]},"task":{"type":"worker","index":1}}"#
        );
        let only_workers = cluster_spec(&tasks[1..3], &addresses[1..3]).unwrap();
        assert_eq!(
            tf_config(&only_workers, tasks[1]).unwrap(),
            r#"{"cluster":{"worker":["127.0.0.1:1001","127.0.0.1:1002"]},"task":{"type":"worker","index":0}}"#
        );
    }
}

//! The cluster coordinator of a parameter-server job (TF's
//! `tf.distribute.experimental.coordinator.ClusterCoordinator`, typed, with step functions
//! registered by name in the binary every task runs, because a Rust closure cannot travel).
//!
//! - [`ClusterCoordinator::schedule`] queues a step (ids 0, 1, 2, ... in schedule order) and
//!   returns a [`RemoteValue`] at once. One dispatcher thread per worker takes the next step
//!   whenever its worker is free, so steps run on any free worker.
//! - A worker found unreachable is marked lost: its step goes back to the **front** of the queue
//!   and runs on another worker (the parameter servers apply the re-run's pushes exactly once,
//!   because its `(client, step, seq)` repeat), every ps task is told the number of live workers
//!   (`Configure`), and the worker is pinged every 500 ms until it comes back.
//! - A step that reports a parameter server unavailable is retried (backoff 200 ms to 2 s) for
//!   [`CoordinatorOptions::step_retry_for`], then its value fails. Any other failure fails the
//!   value at once, and [`ClusterCoordinator::join`] returns the first one.
//! - Every [`CoordinatorOptions::checkpoint_every`] completed steps, every ps task writes a
//!   checkpoint. A checkpoint that cannot be written stops the job cleanly: the steps still
//!   queued fail with an error that names the failure and the last good checkpoint, and
//!   [`ClusterCoordinator::join`] returns it (never a job that ends well without the
//!   checkpoints it was asked for). A job resumed from its ps tasks' checkpoint of step `s`
//!   ([`CoordinatorOptions::first_step`]) counts its steps from `s`, and names its checkpoints
//!   so.
//! - **Liveness.** Every ps task and every worker is probed (a health check, a ping) every
//!   [`CoordinatorOptions::probe_interval`], each probe with a deadline that ends when
//!   [`CoordinatorOptions::probe_timeout`] does: a task that stops answering (killed, stopped
//!   with SIGSTOP, cut off; a stopped task's TCP connection stays open and never fails) is lost
//!   within the timeout. A lost worker's step in flight is abandoned and runs elsewhere (the ps
//!   tasks answer its pushes, should they still come, as duplicates of the re-run's). A lost ps
//!   task ends the job at once, naming it and the steps in flight, unless
//!   [`CoordinatorOptions::wait_for_restarted_ps`] says it will come back from its checkpoint;
//!   ending it raises [`CoordinatorOptions::abort`], which abandons every call in flight, so no
//!   shutdown waits on the lost task.

use std::collections::VecDeque;
use std::marker::PhantomData;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;
use strata_core::{Error, Result};
use strata_transport::executor::{WorkerClient, STEP_UNAVAILABLE, WORKER_UNREACHABLE};
use strata_transport::{AbortSignal, ClusterToken};

/// How long the queue stays empty before sync rounds stop waiting for idle workers, when no
/// one waits in [`ClusterCoordinator::join`] (a loop of `schedule` calls is not a drain).
const DRAIN_GRACE: Duration = Duration::from_millis(50);
/// How often a lost worker is pinged.
const REVIVE_INTERVAL: Duration = Duration::from_millis(500);
/// The first and the longest wait before a step whose ps task was unavailable runs again.
const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// How the coordinator talks to workers and parameter servers.
#[derive(Clone, Debug)]
pub struct CoordinatorOptions {
    /// The cluster token every task shares.
    pub token: ClusterToken,
    /// The deadline of one step's RPC (default 300 s).
    pub rpc_timeout: Duration,
    /// How long [`ClusterCoordinator::with_ps_tasks`] waits for a first worker to answer
    /// (default 60 s).
    pub connect_timeout: Duration,
    /// Once one worker answers, how long [`ClusterCoordinator::with_ps_tasks`] waits for the
    /// others (default 10 s). A worker that has not answered by then starts the job lost: it is
    /// pinged every 500 ms and given steps once it answers (a worker task that starts after the
    /// job began), as a lost worker that comes back is.
    pub start_grace: Duration,
    /// How long a step may keep failing as unavailable (a ps task down, every worker lost)
    /// before its value fails (default 120 s).
    pub step_retry_for: Duration,
    /// Completed steps between parameter-server checkpoints (`None`: never).
    pub checkpoint_every: Option<u64>,
    /// The job's steps completed before this coordinator started (default 0): a job resumed
    /// from its ps tasks' checkpoint of step `s` counts from `s`, so that its checkpoints are
    /// named for the job's steps (`ckpt-<s + k>`), after the one it resumed from.
    pub first_step: u64,
    /// How often every ps task and worker is probed (default 500 ms).
    pub probe_interval: Duration,
    /// How long a task may leave probes unanswered before it is lost (default 3 s).
    pub probe_timeout: Duration,
    /// Whether a lost ps task will be restarted from its checkpoint (`strata ps --restore`):
    /// the job then waits, its steps retried for `step_retry_for`, instead of ending at once
    /// (default false).
    pub wait_for_restarted_ps: bool,
    /// Raised when the job fails; calls that carry it give up at once (the strategy's ps
    /// clients do).
    pub abort: AbortSignal,
}

impl CoordinatorOptions {
    /// The defaults, with the cluster token.
    pub fn new(token: ClusterToken) -> Self {
        Self {
            token,
            rpc_timeout: Duration::from_secs(300),
            connect_timeout: Duration::from_secs(60),
            start_grace: Duration::from_secs(10),
            step_retry_for: Duration::from_secs(120),
            checkpoint_every: None,
            first_step: 0,
            probe_interval: Duration::from_millis(500),
            probe_timeout: Duration::from_secs(3),
            wait_for_restarted_ps: false,
            abort: AbortSignal::new(),
        }
    }
}

/// What the coordinator asks of one parameter-server task: checkpoints, and the number of live
/// workers (sync mode). Implemented by [`strata_transport::ps::PsClient`]; tests may fake it.
pub trait PsControl: Send + Sync + 'static {
    /// The task's name (`ps:<index>`).
    fn ps_task(&self) -> String;
    /// Writes a checkpoint of the task's variables as of `step`; returns where.
    fn checkpoint(&self, step: u64) -> std::result::Result<PathBuf, String>;
    /// Tells the task how many workers are live.
    fn configure(&self, live_workers: u32) -> std::result::Result<(), String>;
    /// Whether the task answers within `deadline` (a liveness probe; default: always).
    fn probe(&self, deadline: Duration) -> std::result::Result<(), String> {
        let _ = deadline;
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A step's error, kept so that every fetch of its value gets an equal [`Error`].
#[derive(Clone, Debug)]
enum StepError {
    Unavailable(String),
    Stale(String),
    Invalid(String),
    Cluster(String),
}

impl StepError {
    fn from_core(e: Error) -> Self {
        match e {
            Error::Unavailable(m) => StepError::Unavailable(m),
            Error::Stale(m) => StepError::Stale(m),
            Error::InvalidArgument(m) => StepError::Invalid(m),
            other => StepError::Cluster(other.to_string()),
        }
    }

    fn to_error(&self) -> Error {
        match self {
            StepError::Unavailable(m) => Error::Unavailable(m.clone()),
            StepError::Stale(m) => Error::Stale(m.clone()),
            StepError::Invalid(m) => Error::InvalidArgument(m.clone()),
            StepError::Cluster(m) => Error::Cluster(m.clone()),
        }
    }
}

type Outcome = std::result::Result<Vec<u8>, StepError>;

/// Where a step's outcome lands.
#[derive(Debug)]
struct Slot {
    step: u64,
    function: String,
    outcome: Mutex<Option<Outcome>>,
    ready: Condvar,
}

impl Slot {
    fn set(&self, outcome: Outcome) {
        let mut o = lock(&self.outcome);
        if o.is_none() {
            *o = Some(outcome);
        }
        self.ready.notify_all();
    }
}

/// The result of a scheduled step, available once the step ran. Cheap to clone.
pub struct RemoteValue<R> {
    slot: Arc<Slot>,
    _result: PhantomData<fn() -> R>,
}

impl<R> Clone for RemoteValue<R> {
    fn clone(&self) -> Self {
        Self { slot: self.slot.clone(), _result: PhantomData }
    }
}

impl<R> std::fmt::Debug for RemoteValue<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteValue")
            .field("step", &self.slot.step)
            .field("function", &self.slot.function)
            .field("ready", &self.is_ready())
            .finish()
    }
}

impl<R: DeserializeOwned> RemoteValue<R> {
    /// Waits until the step ran and returns its result, or the error that ended it.
    pub fn fetch(&self) -> Result<R> {
        let mut o = lock(&self.slot.outcome);
        loop {
            match &*o {
                Some(Ok(bytes)) => {
                    return serde_json::from_slice(bytes).map_err(|e| {
                        Error::InvalidArgument(format!(
                        "the result of step {} ({}) is not a {}: {e}; fetch it as the type the step function returns",
                        self.slot.step,
                        self.slot.function,
                        std::any::type_name::<R>()
                    ))
                    })
                }
                Some(Err(e)) => return Err(e.to_error()),
                None => o = self.slot.ready.wait(o).unwrap_or_else(PoisonError::into_inner),
            }
        }
    }
}

impl<R> RemoteValue<R> {
    /// Whether the step finished (successfully or not).
    pub fn is_ready(&self) -> bool {
        lock(&self.slot.outcome).is_some()
    }

    /// The step's id (its position in schedule order).
    pub fn step(&self) -> u64 {
        self.slot.step
    }
}

/// A step waiting in the queue.
struct Pending {
    slot: Arc<Slot>,
    args: Vec<u8>,
    unavailable_since: Option<Instant>,
    retries: u32,
    not_before: Option<Instant>,
}

struct State {
    queue: VecDeque<Pending>,
    running: usize,
    next_step: u64,
    first_error: Option<StepError>,
    live: Vec<bool>,
    all_lost_since: Option<Instant>,
    stopping: bool,
    /// No step is handed out while the ps tasks are told a larger number of workers.
    paused: bool,
    /// Callers waiting in `join`.
    joining: usize,
    /// When the queue last became empty (`None` while steps are queued).
    empty_since: Option<Instant>,
    /// The error that ended the job (a lost ps task): every step fails with it.
    fatal: Option<StepError>,
    /// Per worker: the step it runs (id, function), and how to abandon it.
    running_on: Vec<Option<(u64, String, AbortSignal)>>,
}

/// The last checkpoint every ps task wrote: its step (0: none yet) and where each task wrote it.
#[derive(Debug, Default)]
struct LastCheckpoint {
    step: u64,
    paths: Vec<PathBuf>,
}

struct Shared {
    run_id: String,
    names: Vec<String>,
    workers: Vec<WorkerClient>,
    ps: Vec<Arc<dyn PsControl>>,
    options: CoordinatorOptions,
    state: Mutex<State>,
    changed: Condvar,
    completed: AtomicU64,
    failures: AtomicU64,
    rescheduled: AtomicU64,
    last_checkpoint: Mutex<LastCheckpoint>,
    /// The number of workers the ps tasks were last told to expect per sync round (0: none yet).
    announced: Mutex<u32>,
}

impl Shared {
    fn live_count(st: &State) -> usize {
        st.live.iter().filter(|l| **l).count()
    }

    /// The number of pushes a sync round should wait for: every live worker while steps are
    /// queued; once the queue has drained (someone waits in `join`, or it stayed empty for
    /// [`DRAIN_GRACE`]), only the steps still running, so the last round of a batch of steps
    /// does not wait for a worker that has nothing to run.
    fn desired(st: &State) -> u32 {
        let live = Self::live_count(st);
        let drained =
            st.queue.is_empty() && (st.joining > 0 || st.empty_since.is_none_or(|t| t.elapsed() >= DRAIN_GRACE));
        let want = if drained { live.min(st.running.max(1)) } else { live };
        u32::try_from(want.max(1)).unwrap_or(u32::MAX)
    }

    /// Tells every ps task the number of pushes per sync round, when it changed. Callers hold
    /// no lock; the announcement lock orders concurrent announcements.
    fn reannounce(&self) {
        if self.ps.is_empty() {
            return;
        }
        let mut announced = lock(&self.announced);
        let want = Self::desired(&lock(&self.state));
        if want != *announced {
            self.configure_all(want);
            *announced = want;
        }
    }

    fn configure_all(&self, live: u32) {
        for p in &self.ps {
            if let Err(e) = p.configure(live) {
                tracing::warn!(ps = %p.ps_task(), live, error = %e, "telling a ps task the live workers failed");
            }
        }
    }

    fn is_live(&self, i: usize) -> bool {
        lock(&self.state).live.get(i).copied().unwrap_or(false)
    }

    fn stopping(&self) -> bool {
        lock(&self.state).stopping
    }

    /// Takes the first step that may run now; `None` when the coordinator stops.
    fn next_step(&self) -> Option<Pending> {
        let mut st = lock(&self.state);
        loop {
            if st.stopping || st.fatal.is_some() {
                return None;
            }
            let now = Instant::now();
            if st.paused {
                st = self.changed.wait_timeout(st, Duration::from_millis(10)).unwrap_or_else(PoisonError::into_inner).0;
                continue;
            }
            if let Some(at) = st.queue.iter().position(|p| p.not_before.is_none_or(|t| t <= now)) {
                let p = st.queue.remove(at)?;
                st.running += 1;
                if st.queue.is_empty() {
                    st.empty_since = Some(now);
                }
                return Some(p);
            }
            if st.queue.is_empty() && st.empty_since.is_some_and(|t| t.elapsed() >= DRAIN_GRACE) {
                // The queue drained: let sync rounds complete with the steps still running.
                drop(st);
                self.reannounce();
                st = lock(&self.state);
                if st.queue.is_empty() {
                    st = self
                        .changed
                        .wait_timeout(st, Duration::from_millis(100))
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
                continue;
            }
            let wait = st
                .queue
                .iter()
                .filter_map(|p| p.not_before)
                .min()
                .map_or(Duration::from_millis(100), |t| t.saturating_duration_since(now))
                .clamp(Duration::from_millis(1), Duration::from_millis(100));
            st = self.changed.wait_timeout(st, wait).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    fn fail(&self, st: &mut State, p: Pending, e: StepError) {
        if st.first_error.is_none() {
            st.first_error = Some(e.clone());
        }
        p.slot.set(Err(e));
    }

    fn finish(&self, worker: usize, mut p: Pending, result: strata_transport::Result<Vec<u8>>) {
        let name = &self.names[worker];
        let (step, function) = (p.slot.step, p.slot.function.clone());
        lock(&self.state).running_on[worker] = None;
        let e = match result {
            Ok(bytes) => {
                p.slot.set(Ok(bytes));
                self.completed.fetch_add(1, Ordering::SeqCst);
                {
                    let mut st = lock(&self.state);
                    st.running -= 1;
                }
                self.changed.notify_all();
                self.reannounce();
                self.maybe_checkpoint();
                return;
            }
            Err(e) => e,
        };
        let detail = match &e {
            strata_transport::Error::Unavailable { detail, .. } => Some(detail.as_str()),
            _ => None,
        };
        let mut st = lock(&self.state);
        st.running -= 1;
        if let Some(fatal) = st.fatal.clone() {
            // The job failed: the step was abandoned with it.
            p.slot.set(Err(fatal));
            drop(st);
            self.changed.notify_all();
            return;
        }
        match detail {
            Some(d) if d.starts_with(WORKER_UNREACHABLE) => {
                // The worker is lost: its step runs again on another worker.
                self.mark_lost(&mut st, worker);
                let live = Self::live_count(&st);
                tracing::warn!(worker = %name, step, %function, live, error = %e, "lost a worker; rescheduling its step");
                self.rescheduled.fetch_add(1, Ordering::SeqCst);
                if st.stopping {
                    self.fail(
                        &mut st,
                        p,
                        StepError::Cluster(format!(
                            "the coordinator shut down before step {step} ({function}) completed"
                        )),
                    );
                } else {
                    st.queue.push_front(p);
                }
                drop(st);
                self.changed.notify_all();
                self.reannounce();
            }
            Some(d) if d.starts_with(STEP_UNAVAILABLE) || !d.is_empty() => {
                let since = *p.unavailable_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= self.options.step_retry_for || st.stopping {
                    let m = format!(
                        "step {step} ({function}) stayed unavailable for {:.1} s (the limit is {:?}; raise step_retry_for or bring the parameter servers back): {e}",
                        since.elapsed().as_secs_f64(),
                        self.options.step_retry_for
                    );
                    self.fail(&mut st, p, StepError::Unavailable(m));
                } else {
                    let backoff = BACKOFF_MIN.saturating_mul(1 << p.retries.min(8)).min(BACKOFF_MAX);
                    p.retries += 1;
                    p.not_before = Some(Instant::now() + backoff);
                    tracing::debug!(worker = %name, step, %function, ?backoff, error = %e, "step unavailable; retrying");
                    self.rescheduled.fetch_add(1, Ordering::SeqCst);
                    st.queue.push_front(p);
                }
                drop(st);
                self.changed.notify_all();
                self.reannounce();
            }
            _ => {
                let m = StepError::from_core(Error::from(e));
                tracing::warn!(worker = %name, step, %function, error = ?m, "step failed");
                self.fail(&mut st, p, m);
                drop(st);
                self.changed.notify_all();
                self.reannounce();
            }
        }
    }

    /// Fails every queued step once every worker has been lost for longer than step_retry_for.
    fn fail_if_all_lost(&self) {
        let mut st = lock(&self.state);
        let Some(since) = st.all_lost_since else { return };
        if Self::live_count(&st) > 0 || since.elapsed() < self.options.step_retry_for || st.queue.is_empty() {
            return;
        }
        let names = self.names.join(", ");
        while let Some(p) = st.queue.pop_front() {
            let m = format!(
                "step {} ({}) was not run: every worker ({names}) has been lost for {:.1} s (the limit is {:?}); restart the worker tasks",
                p.slot.step,
                p.slot.function,
                since.elapsed().as_secs_f64(),
                self.options.step_retry_for
            );
            self.fail(&mut st, p, StepError::Unavailable(m));
        }
        drop(st);
        self.changed.notify_all();
    }

    fn revive(&self, worker: usize, incarnation: u64) {
        let live = {
            let mut st = lock(&self.state);
            st.live[worker] = true;
            st.all_lost_since = None;
            Self::live_count(&st)
        };
        tracing::info!(worker = %self.names[worker], incarnation, live, "a lost worker is back");
        self.changed.notify_all();
        self.reannounce();
    }

    fn maybe_checkpoint(&self) {
        let Some(every) = self.options.checkpoint_every.filter(|k| *k > 0) else { return };
        if self.ps.is_empty() {
            return;
        }
        let mut last = lock(&self.last_checkpoint);
        let done = self.options.first_step + self.completed.load(Ordering::SeqCst);
        if done < last.step + every || lock(&self.state).stopping {
            return;
        }
        let mut paths = Vec::with_capacity(self.ps.len());
        for ps in &self.ps {
            match ps.checkpoint(done) {
                Ok(path) => {
                    tracing::info!(ps = %ps.ps_task(), step = done, path = %path.display(), "checkpoint written");
                    paths.push(path);
                }
                Err(e) => {
                    let good = if last.step == 0 {
                        "no checkpoint was written before it".to_string()
                    } else if last.paths.is_empty() {
                        format!("the last good checkpoint is the one of step {} the job resumed from", last.step)
                    } else {
                        let at: Vec<String> = last.paths.iter().map(|p| p.display().to_string()).collect();
                        format!("the last good checkpoint is step {} ({})", last.step, at.join(", "))
                    };
                    let m = format!(
                        "the checkpoint of step {done} failed on {}: {e}; training stopped there, and {good}",
                        ps.ps_task()
                    );
                    tracing::error!(ps = %ps.ps_task(), step = done, error = %e, "a checkpoint failed; stopping");
                    self.stop_with(StepError::Cluster(m));
                    return;
                }
            }
        }
        *last = LastCheckpoint { step: done, paths };
    }

    /// Stops handing out steps: every queued step fails with `e`, which [`ClusterCoordinator::join`]
    /// returns; running steps finish.
    fn stop_with(&self, e: StepError) {
        let mut st = lock(&self.state);
        st.stopping = true;
        if st.first_error.is_none() {
            st.first_error = Some(e.clone());
        }
        while let Some(p) = st.queue.pop_front() {
            p.slot.set(Err(e.clone()));
        }
        drop(st);
        self.changed.notify_all();
    }

    /// Marks `worker` lost (counted once per loss) and abandons the step it runs.
    fn mark_lost(&self, st: &mut State, worker: usize) {
        if st.live[worker] {
            st.live[worker] = false;
            self.failures.fetch_add(1, Ordering::SeqCst);
        }
        if Self::live_count(st) == 0 && st.all_lost_since.is_none() {
            st.all_lost_since = Some(Instant::now());
        }
        if let Some((_, _, cancel)) = &st.running_on[worker] {
            cancel.abort(format!("{} stopped answering", self.names[worker]));
        }
    }

    /// "steps 57 (train) on worker:0, 58 (train) on worker:1; 55 completed"
    fn doing(&self, st: &State) -> String {
        let running: Vec<String> = st
            .running_on
            .iter()
            .zip(&self.names)
            .filter_map(|(r, name)| r.as_ref().map(|(step, f, _)| format!("{step} ({f}) on {name}")))
            .collect();
        let done = self.completed.load(Ordering::SeqCst);
        match running.len() {
            0 => format!("no step was running; {done} completed"),
            1 => format!("step {} was running; {done} completed", running[0]),
            _ => format!("steps {} were running; {done} completed", running.join(", ")),
        }
    }

    /// Ends the job: every queued, running and later step fails with `message`, and every call
    /// that carries the job's abort signal gives up.
    fn fail_job(&self, message: String) {
        let mut st = lock(&self.state);
        if st.fatal.is_some() {
            return;
        }
        tracing::error!(%message, "the job failed");
        // Raised before any step fails with the error, so that whoever sees the error sees
        // the job's calls abandoned too.
        self.options.abort.abort(message.clone());
        let e = StepError::Cluster(message.clone());
        st.fatal = Some(e.clone());
        st.first_error = Some(e.clone());
        while let Some(p) = st.queue.pop_front() {
            p.slot.set(Err(e.clone()));
        }
        for (_, _, cancel) in st.running_on.iter().flatten() {
            cancel.abort(message.clone());
        }
        drop(st);
        self.changed.notify_all();
    }

    /// Probes task `name` with `probe` until the coordinator stops; `lost` is called (with the
    /// silence and the last error) each time the task has not answered for the timeout, and
    /// `back` when it answers again.
    fn watch(
        &self,
        name: &str,
        probe: &dyn Fn(Duration) -> std::result::Result<(), String>,
        lost: &dyn Fn(Duration, &str),
        back: &dyn Fn(),
    ) {
        let (interval, timeout) =
            (self.options.probe_interval.max(Duration::from_millis(10)), self.options.probe_timeout);
        let mut last_ok = Instant::now();
        let mut is_lost = false;
        while !self.stopping() && lock(&self.state).fatal.is_none() {
            let left = (last_ok + timeout).saturating_duration_since(Instant::now());
            let began = Instant::now();
            match probe(interval.min(left).max(Duration::from_millis(10))) {
                Ok(()) => {
                    last_ok = Instant::now();
                    if is_lost {
                        is_lost = false;
                        tracing::info!(task = name, "answers probes again");
                        back();
                    }
                    self.sleep_until(began + interval);
                }
                Err(e) => {
                    tracing::debug!(task = name, error = %e, silent = ?last_ok.elapsed(), "a probe failed");
                    if last_ok.elapsed() >= timeout {
                        is_lost = true;
                        lost(last_ok.elapsed(), &e);
                    }
                    self.sleep_until(Instant::now() + Duration::from_millis(100).min(left));
                }
            }
        }
    }

    fn sleep_until(&self, until: Instant) {
        while Instant::now() < until && !self.stopping() {
            std::thread::sleep((until - Instant::now()).min(Duration::from_millis(20)));
        }
    }

    /// Watches ps task `i`: a lost one ends the job, unless it will be restarted.
    fn watch_ps(&self, i: usize) {
        let ps = self.ps[i].clone();
        let name = ps.ps_task();
        let warned = std::sync::atomic::AtomicBool::new(false);
        self.watch(&name, &|d| ps.probe(d), &|silent, e| {
            if self.options.wait_for_restarted_ps {
                if !warned.swap(true, Ordering::SeqCst) {
                    tracing::warn!(ps = %name, error = %e, "lost a ps task; waiting for it to be restarted from its checkpoint");
                }
                return;
            }
            let doing = self.doing(&lock(&self.state));
            self.fail_job(format!(
                "lost task {name}: no answer to health checks for {:.1} s ({e}); {doing}; its variables are gone: relaunch the job (ps tasks that write checkpoints can be restarted from them instead)",
                silent.as_secs_f64()
            ));
        }, &|| warned.store(false, Ordering::SeqCst));
    }

    /// Watches worker `i`: a lost one's step runs elsewhere.
    fn watch_worker(&self, i: usize) {
        let name = self.names[i].clone();
        let client = self.workers[i].clone();
        self.watch(&name, &|d| client.ping_within(d).map(|_| ()).map_err(|e| e.to_string()), &|silent, e| {
            let mut st = lock(&self.state);
            if st.live[i] {
                tracing::warn!(worker = %name, error = %e, silent = silent.as_secs_f64(), "a worker stopped answering; its step runs elsewhere");
            }
            self.mark_lost(&mut st, i);
            drop(st);
            self.changed.notify_all();
        }, &|| {});
    }

    fn dispatch(&self, worker: usize) {
        loop {
            if !self.is_live(worker) {
                if self.stopping() {
                    return;
                }
                match self.workers[worker].ping_within(self.options.probe_interval.max(Duration::from_millis(100))) {
                    Ok(info) if info.task == self.names[worker] => self.revive(worker, info.incarnation),
                    Ok(info) => {
                        tracing::warn!(worker = %self.names[worker], answered = %info.task, "another task answers at a worker's address; it is given no steps");
                        std::thread::sleep(REVIVE_INTERVAL);
                    }
                    Err(_) => {
                        self.fail_if_all_lost();
                        let until = Instant::now() + REVIVE_INTERVAL;
                        while Instant::now() < until {
                            if self.stopping() {
                                return;
                            }
                            std::thread::sleep(Duration::from_millis(20));
                        }
                    }
                }
                continue;
            }
            let Some(p) = self.next_step() else { return };
            self.reannounce();
            let cancel = AbortSignal::new();
            {
                let mut st = lock(&self.state);
                st.running_on[worker] = Some((p.slot.step, p.slot.function.clone(), cancel.clone()));
                if !st.live[worker] || st.fatal.is_some() {
                    // Found lost (or the job failed) between taking the step and now.
                    cancel.abort(format!("{} was lost", self.names[worker]));
                }
            }
            let result =
                self.workers[worker].run_step_until(&p.slot.function, p.slot.step, &self.run_id, &p.args, &cancel);
            self.finish(worker, p, result);
        }
    }
}

/// Schedules steps on the workers of a parameter-server job and collects their results.
pub struct ClusterCoordinator {
    shared: Arc<Shared>,
    dispatchers: Vec<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for ClusterCoordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCoordinator")
            .field("run_id", &self.shared.run_id)
            .field("workers", &self.shared.names)
            .finish()
    }
}

impl ClusterCoordinator {
    /// A coordinator of `workers` (`("worker:<i>", address)`), with every ps task in `ps` (for
    /// checkpoints and, in sync mode, the number of live workers). Pings every worker until it
    /// answers or `connect_timeout` passes. Must not be called from inside a tokio runtime.
    pub fn with_ps_tasks(
        workers: Vec<(String, String)>,
        ps: Vec<Arc<dyn PsControl>>,
        options: CoordinatorOptions,
    ) -> Result<Self> {
        if workers.is_empty() {
            return Err(Error::InvalidCluster(
                "a cluster coordinator needs at least one worker task; add workers to the cluster spec".into(),
            ));
        }
        let mut clients = Vec::with_capacity(workers.len());
        for (name, address) in &workers {
            clients.push(WorkerClient::connect(address, name, options.token.clone(), options.rpc_timeout)?);
        }
        let deadline = Instant::now() + options.connect_timeout;
        let mut answered = vec![false; workers.len()];
        let mut first: Option<Instant> = None;
        loop {
            for (i, ((name, address), client)) in workers.iter().zip(&clients).enumerate() {
                if answered[i] {
                    continue;
                }
                match client.ping_within(Duration::from_millis(500)) {
                    Ok(info) if info.task != *name => {
                        return Err(Error::InvalidCluster(format!(
                            "the worker at {address} says it is {}, not {name}; give every task the same cluster spec",
                            info.task
                        )))
                    }
                    Ok(_) => {
                        answered[i] = true;
                        first.get_or_insert_with(Instant::now);
                    }
                    Err(e @ strata_transport::Error::Unauthenticated(_)) => return Err(e.into()),
                    Err(e) if first.is_none() && Instant::now() >= deadline => {
                        return Err(Error::Unavailable(format!(
                            "no worker answered within {:?} (worker {name} at {address}: {e}); start the worker tasks (or raise connect_timeout)",
                            options.connect_timeout
                        )))
                    }
                    Err(_) => {}
                }
            }
            if answered.iter().all(|&a| a) || first.is_some_and(|t| t.elapsed() >= options.start_grace) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        for ((name, _), _) in workers.iter().zip(&answered).filter(|(_, &a)| !a) {
            tracing::warn!(worker = %name, grace = ?options.start_grace, "a worker did not answer; the job starts without it and gives it steps once it does");
        }
        let n = workers.len();
        let last_checkpoint = LastCheckpoint { step: options.first_step, paths: Vec::new() };
        let shared = Arc::new(Shared {
            run_id: format!("coordinator-{:016x}", random_u64()),
            names: workers.iter().map(|(n, _)| n.clone()).collect(),
            workers: clients,
            ps,
            options,
            state: Mutex::new(State {
                queue: VecDeque::new(),
                running: 0,
                next_step: 0,
                first_error: None,
                live: answered.clone(),
                all_lost_since: None,
                stopping: false,
                paused: false,
                joining: 0,
                empty_since: None,
                fatal: None,
                running_on: vec![None; n],
            }),
            changed: Condvar::new(),
            completed: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            rescheduled: AtomicU64::new(0),
            last_checkpoint: Mutex::new(last_checkpoint),
            announced: Mutex::new(0),
        });
        let mut me = Self { shared: shared.clone(), dispatchers: Vec::with_capacity(n) };
        for i in 0..n {
            let s = shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("strata-dispatch-{i}"))
                .spawn(move || s.dispatch(i))
                .map_err(|e| Error::io("starting a coordinator dispatcher thread", e))?;
            me.dispatchers.push(h);
        }
        // (thread name, whether it watches a ps task, the task's index)
        let watchers: Vec<(String, bool, usize)> = (0..me.shared.ps.len())
            .map(|i| (format!("strata-probe-ps{i}"), true, i))
            .chain((0..n).map(|i| (format!("strata-probe-w{i}"), false, i)))
            .collect();
        for (thread, ps, i) in watchers {
            let s = shared.clone();
            let h = std::thread::Builder::new()
                .name(thread)
                .spawn(move || if ps { s.watch_ps(i) } else { s.watch_worker(i) })
                .map_err(|e| Error::io("starting a coordinator probe thread", e))?;
            me.dispatchers.push(h);
        }
        tracing::info!(run_id = %me.shared.run_id, workers = n, "cluster coordinator started");
        Ok(me)
    }

    /// The run's id, `coordinator-<16 hex>`: the `client` of every step it schedules.
    pub fn run_id(&self) -> &str {
        &self.shared.run_id
    }

    /// Queues a run of the step function registered as `function` with `args` (as JSON), and
    /// returns its value at once.
    pub fn schedule<A: Serialize, R: DeserializeOwned + Send + 'static>(
        &self,
        function: &str,
        args: &A,
    ) -> RemoteValue<R> {
        // Announcement lock first (the order every path takes), so a step scheduled after an
        // empty queue is not handed out before the ps tasks expect every live worker again.
        let mut announced = lock(&self.shared.announced);
        let mut st = lock(&self.shared.state);
        let step = st.next_step;
        st.next_step += 1;
        let slot =
            Arc::new(Slot { step, function: function.to_string(), outcome: Mutex::new(None), ready: Condvar::new() });
        let value = RemoteValue { slot: slot.clone(), _result: PhantomData };
        let args = match serde_json::to_vec(args) {
            Ok(a) => a,
            Err(e) => {
                let m =
                    StepError::Invalid(format!("the arguments of step {step} ({function}) cannot be serialized: {e}"));
                if st.first_error.is_none() {
                    st.first_error = Some(m.clone());
                }
                slot.set(Err(m));
                return value;
            }
        };
        let pending = Pending { slot, args, unavailable_since: None, retries: 0, not_before: None };
        if let Some(e) = st.fatal.clone() {
            self.shared.fail(&mut st, pending, e);
            return value;
        }
        if st.stopping {
            let m = StepError::Cluster(format!("the coordinator shut down; step {step} ({function}) was not run"));
            self.shared.fail(&mut st, pending, m);
            return value;
        }
        st.queue.push_back(pending);
        st.empty_since = None;
        let want = Shared::desired(&st);
        let change = !self.shared.ps.is_empty() && want != *announced;
        st.paused = change;
        drop(st);
        if change {
            self.shared.configure_all(want);
            *announced = want;
            lock(&self.shared.state).paused = false;
        }
        drop(announced);
        self.shared.changed.notify_all();
        value
    }

    /// Waits until every scheduled step finished; the first step error since the last join.
    pub fn join(&self) -> Result<()> {
        lock(&self.shared.state).joining += 1;
        loop {
            // Waiting here means no more steps are coming: sync rounds need not wait for idle
            // workers.
            self.shared.reannounce();
            let st = lock(&self.shared.state);
            if st.queue.is_empty() && st.running == 0 || st.fatal.is_some() {
                break;
            }
            drop(
                self.shared.changed.wait_timeout(st, Duration::from_millis(50)).unwrap_or_else(PoisonError::into_inner),
            );
        }
        let mut st = lock(&self.shared.state);
        st.joining -= 1;
        if let Some(e) = &st.fatal {
            return Err(e.to_error());
        }
        match st.first_error.take() {
            Some(e) => Err(e.to_error()),
            None => Ok(()),
        }
    }

    /// Whether no step is queued or running.
    pub fn done(&self) -> bool {
        let st = lock(&self.shared.state);
        st.queue.is_empty() && st.running == 0
    }

    /// Waits for `value` and returns it (same as [`RemoteValue::fetch`]).
    pub fn fetch<R: DeserializeOwned>(&self, value: &RemoteValue<R>) -> Result<R> {
        value.fetch()
    }

    /// The job's steps completed before this coordinator started
    /// ([`CoordinatorOptions::first_step`]): the step a resumed job continues from.
    pub fn first_step(&self) -> u64 {
        self.shared.options.first_step
    }

    /// How many steps completed successfully (this coordinator's, not counting
    /// [`first_step`](Self::first_step)).
    pub fn steps_completed(&self) -> u64 {
        self.shared.completed.load(Ordering::SeqCst)
    }

    /// How many workers are live now.
    pub fn live_workers(&self) -> usize {
        Shared::live_count(&lock(&self.shared.state))
    }

    /// How many times a worker was found lost.
    pub fn worker_failures(&self) -> u64 {
        self.shared.failures.load(Ordering::SeqCst)
    }

    /// How many times a step went back to the queue (its worker was lost, or a ps task was
    /// unavailable).
    pub fn steps_rescheduled(&self) -> u64 {
        self.shared.rescheduled.load(Ordering::SeqCst)
    }

    /// Stops: queued steps fail, running steps finish, then the dispatchers end.
    pub fn shutdown(self) {}

    fn stop(&mut self) {
        {
            let mut st = lock(&self.shared.state);
            st.stopping = true;
            while let Some(p) = st.queue.pop_front() {
                let m = format!("the coordinator shut down; step {} ({}) was not run", p.slot.step, p.slot.function);
                p.slot.set(Err(StepError::Cluster(m)));
            }
        }
        self.shared.changed.notify_all();
        for h in self.dispatchers.drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for ClusterCoordinator {
    fn drop(&mut self) {
        self.stop();
    }
}

fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.finish()
}

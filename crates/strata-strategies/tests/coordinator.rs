//! The cluster coordinator over real gRPC on loopback, with in-process worker executors.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_strategies::parameter_server::coordinator::{ClusterCoordinator, CoordinatorOptions, PsControl};
use strata_transport::executor::{StepFailure, StepHandler, WorkerExecutorHandle};
use strata_transport::ClusterToken;

const TOKEN: &str = "0123456789abcdef0123";

fn token() -> ClusterToken {
    ClusterToken::new(TOKEN).unwrap()
}

/// The step functions every test worker registers.
struct Steps {
    runs: AtomicU64,
    started: AtomicU64,
    flaky: Arc<Mutex<HashMap<u64, u32>>>,
}

impl StepHandler for Steps {
    fn functions(&self) -> Vec<String> {
        ["add", "sleep", "fail", "flaky"].map(String::from).to_vec()
    }

    fn run(&self, function: &str, step: u64, _client: &str, args: &[u8]) -> Result<Vec<u8>, StepFailure> {
        self.started.fetch_add(1, Ordering::SeqCst);
        let bad = |e: serde_json::Error| StepFailure::Failed(e.to_string());
        let out = match function {
            "add" => {
                let (a, b): (i64, i64) = serde_json::from_slice(args).map_err(bad)?;
                std::thread::sleep(Duration::from_millis(2));
                serde_json::to_vec(&(a + b)).map_err(bad)?
            }
            "sleep" => {
                let ms: u64 = serde_json::from_slice(args).map_err(bad)?;
                std::thread::sleep(Duration::from_millis(ms));
                serde_json::to_vec(&step).map_err(bad)?
            }
            "fail" => return Err(StepFailure::Failed(format!("bad step {step}"))),
            "flaky" => {
                let mut seen = self.flaky.lock().unwrap();
                let n = seen.entry(step).or_insert(0);
                *n += 1;
                if *n <= 2 {
                    return Err(StepFailure::Unavailable(format!("ps:0 is down (try {n} of step {step})")));
                }
                serde_json::to_vec(&step).map_err(bad)?
            }
            other => return Err(StepFailure::NotFound(other.to_string())),
        };
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok(out)
    }
}

struct Cluster {
    servers: Vec<Option<WorkerExecutorHandle>>,
    steps: Vec<Arc<Steps>>,
    addresses: Vec<(String, String)>,
}

fn cluster(n: usize) -> Cluster {
    let flaky = Arc::new(Mutex::new(HashMap::new()));
    let mut c = Cluster { servers: vec![], steps: vec![], addresses: vec![] };
    for i in 0..n {
        let steps = Arc::new(Steps { runs: AtomicU64::new(0), started: AtomicU64::new(0), flaky: flaky.clone() });
        let name = format!("worker:{i}");
        let server =
            WorkerExecutorHandle::start("127.0.0.1:0".parse().unwrap(), name.clone(), token(), steps.clone()).unwrap();
        c.addresses.push((name, server.address().to_string()));
        c.servers.push(Some(server));
        c.steps.push(steps);
    }
    c
}

fn options() -> CoordinatorOptions {
    let mut o = CoordinatorOptions::new(token());
    o.rpc_timeout = Duration::from_secs(30);
    o.connect_timeout = Duration::from_secs(10);
    o.step_retry_for = Duration::from_secs(20);
    o
}

fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A fake ps task that records what the coordinator asks of it.
#[derive(Default)]
struct FakePs {
    checkpoints: Mutex<Vec<u64>>,
    configured: Mutex<Vec<u32>>,
    /// The checkpoints from this one on (counted from 0) fail.
    fail_from: Option<usize>,
    /// Probes fail (after sleeping out their deadline) once this is set.
    silent: std::sync::atomic::AtomicBool,
}

impl PsControl for FakePs {
    fn ps_task(&self) -> String {
        "ps:0".into()
    }
    fn checkpoint(&self, step: u64) -> Result<PathBuf, String> {
        let mut done = self.checkpoints.lock().unwrap();
        done.push(step);
        if self.fail_from.is_some_and(|k| done.len() > k) {
            return Err("disk full".into());
        }
        Ok(PathBuf::from(format!("/tmp/ckpt-{step}")))
    }
    fn configure(&self, live_workers: u32) -> Result<(), String> {
        self.configured.lock().unwrap().push(live_workers);
        Ok(())
    }
    fn probe(&self, deadline: Duration) -> Result<(), String> {
        if self.silent.load(Ordering::SeqCst) {
            std::thread::sleep(deadline);
            return Err("no answer".into());
        }
        Ok(())
    }
}

#[test]
fn a_ps_task_that_stops_answering_ends_the_job_within_the_probe_timeout() {
    let c = cluster(2);
    let ps = Arc::new(FakePs::default());
    let mut o = options();
    o.probe_timeout = Duration::from_millis(800);
    o.probe_interval = Duration::from_millis(100);
    let abort = o.abort.clone();
    let coord =
        ClusterCoordinator::with_ps_tasks(c.addresses.clone(), vec![ps.clone() as Arc<dyn PsControl>], o).unwrap();
    // Steps that take a while, so that some are running when the ps task goes silent.
    let values: Vec<_> = (0..40).map(|_| coord.schedule::<_, u64>("sleep", &200u64)).collect();
    std::thread::sleep(Duration::from_millis(300));
    ps.silent.store(true, Ordering::SeqCst);
    let silent = Instant::now();
    let e = coord.join().unwrap_err().to_string();
    let took = silent.elapsed();
    assert!(took < Duration::from_millis(800 + 600), "{took:?}");
    assert!(e.contains("lost task ps:0: no answer to health checks") && e.contains("completed"), "{e}");
    assert!(e.contains("(sleep) on worker:"), "the steps in flight: {e}");
    assert!(abort.reason().is_some_and(|r| r.contains("lost task ps:0")), "the job's calls were not abandoned");
    // Every step that did not complete failed with the job, at once; later ones too.
    let failed = values.iter().filter(|v| v.fetch().is_err()).count();
    assert!(failed >= 30, "{failed} of 40 failed");
    assert!(coord.schedule::<_, i64>("add", &(1, 1)).fetch().unwrap_err().to_string().contains("lost task ps:0"));
    let t0 = Instant::now();
    coord.shutdown();
    assert!(t0.elapsed() < Duration::from_secs(1), "shutting down took {:?}", t0.elapsed());
}

#[test]
fn a_lost_ps_task_that_will_be_restarted_is_waited_for() {
    let c = cluster(1);
    let ps = Arc::new(FakePs::default());
    let mut o = options();
    o.probe_timeout = Duration::from_millis(300);
    o.probe_interval = Duration::from_millis(50);
    o.wait_for_restarted_ps = true;
    let coord =
        ClusterCoordinator::with_ps_tasks(c.addresses.clone(), vec![ps.clone() as Arc<dyn PsControl>], o).unwrap();
    ps.silent.store(true, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(800));
    ps.silent.store(false, Ordering::SeqCst);
    assert_eq!(coord.schedule::<_, i64>("add", &(2, 3)).fetch().unwrap(), 5);
    coord.join().unwrap();
}

#[test]
fn many_steps_over_three_workers() {
    let c = cluster(3);
    let coord = ClusterCoordinator::with_ps_tasks(c.addresses.clone(), vec![], options()).unwrap();
    assert!(coord.run_id().starts_with("coordinator-") && coord.run_id().len() == "coordinator-".len() + 16);
    assert!(coord.done());
    let values: Vec<_> = (0..200i64).map(|i| coord.schedule::<_, i64>("add", &(i, 2 * i))).collect();
    for (i, v) in values.iter().enumerate() {
        assert_eq!(v.step(), i as u64);
        assert_eq!(coord.fetch(v).unwrap(), 3 * i as i64);
    }
    coord.join().unwrap();
    assert!(coord.done());
    assert_eq!(coord.steps_completed(), 200);
    let runs: Vec<u64> = c.steps.iter().map(|s| s.runs.load(Ordering::SeqCst)).collect();
    assert_eq!(runs.iter().sum::<u64>(), 200);
    assert!(runs.iter().all(|r| *r >= 1), "every worker ran a step: {runs:?}");
    assert_eq!((coord.live_workers(), coord.worker_failures(), coord.steps_rescheduled()), (3, 0, 0));
    coord.shutdown();
}

#[test]
fn join_returns_the_first_error_and_later_steps_still_run() {
    let c = cluster(2);
    let coord = ClusterCoordinator::with_ps_tasks(c.addresses.clone(), vec![], options()).unwrap();
    let before: Vec<_> = (0..5i64).map(|i| coord.schedule::<_, i64>("add", &(i, 1))).collect();
    let failed = coord.schedule::<_, i64>("fail", &());
    let after: Vec<_> = (0..5i64).map(|i| coord.schedule::<_, i64>("add", &(i, 10))).collect();
    let e = coord.join().unwrap_err().to_string();
    assert!(e.contains("bad step 5"), "{e}");
    assert!(e.contains("step 5 (fail) failed in worker:"), "{e}");
    assert!(failed.is_ready());
    assert!(failed.fetch().unwrap_err().to_string().contains("bad step 5"));
    for (i, v) in before.iter().enumerate() {
        assert_eq!(v.fetch().unwrap(), i as i64 + 1);
    }
    for (i, v) in after.iter().enumerate() {
        assert_eq!(v.fetch().unwrap(), i as i64 + 10);
    }
    // The error was reported once; the next join sees only what came after it.
    assert_eq!(coord.schedule::<_, i64>("add", &(1, 1)).fetch().unwrap(), 2);
    coord.join().unwrap();
    assert_eq!(coord.steps_completed(), 11);
}

#[test]
fn done_before_and_after() {
    let c = cluster(1);
    let coord = ClusterCoordinator::with_ps_tasks(c.addresses.clone(), vec![], options()).unwrap();
    assert!(coord.done());
    let v = coord.schedule::<_, u64>("sleep", &300u64);
    assert!(!coord.done());
    coord.join().unwrap();
    assert!(coord.done());
    assert!(v.is_ready());
    assert_eq!(v.fetch().unwrap(), 0);
}

#[test]
fn a_lost_worker_steps_run_elsewhere_and_it_comes_back() {
    let mut c = cluster(3);
    let ps = Arc::new(FakePs::default());
    let coord =
        ClusterCoordinator::with_ps_tasks(c.addresses.clone(), vec![ps.clone() as Arc<dyn PsControl>], options())
            .unwrap();
    let values: Vec<_> = (0..30).map(|_| coord.schedule::<_, u64>("sleep", &100u64)).collect();
    wait_for("worker:1 to start a step", || c.steps[1].started.load(Ordering::SeqCst) >= 1);
    let address: std::net::SocketAddr = c.addresses[1].1.parse().unwrap();
    c.servers[1].take().unwrap().shutdown();
    for (i, v) in values.iter().enumerate() {
        assert_eq!(v.fetch().unwrap(), i as u64);
    }
    coord.join().unwrap();
    assert_eq!(coord.steps_completed(), 30);
    assert!(coord.worker_failures() >= 1);
    assert!(coord.steps_rescheduled() >= 1);
    assert_eq!(coord.live_workers(), 2);
    // While steps were queued the ps tasks were told of the 2 live workers; once the queue
    // drained, of only the steps still running (down to 1).
    wait_for("ps configure(2)", || ps.configured.lock().unwrap().contains(&2));
    wait_for("ps configure(1) after the drain", || ps.configured.lock().unwrap().last() == Some(&1));
    let lost_at = ps.configured.lock().unwrap().iter().rposition(|&n| n == 2).unwrap();
    // A restarted worker process at the same address is found again.
    let steps = Arc::new(Steps { runs: AtomicU64::new(0), started: AtomicU64::new(0), flaky: Default::default() });
    let restarted = WorkerExecutorHandle::start(address, "worker:1".into(), token(), steps.clone()).unwrap();
    wait_for("worker:1 to be live again", || coord.live_workers() == 3);
    let more: Vec<_> = (0..60).map(|_| coord.schedule::<_, u64>("sleep", &5u64)).collect();
    // Steps queued again: every live worker, the revived one included, is expected per round.
    assert!(ps.configured.lock().unwrap()[lost_at..].contains(&3), "{:?}", ps.configured.lock().unwrap());
    for (i, v) in more.iter().enumerate() {
        assert_eq!(v.fetch().unwrap(), 30 + i as u64);
    }
    coord.join().unwrap();
    coord.shutdown();
    restarted.shutdown();
}

#[test]
fn flaky_steps_succeed_after_retries() {
    let c = cluster(2);
    let coord = ClusterCoordinator::with_ps_tasks(c.addresses.clone(), vec![], options()).unwrap();
    let values: Vec<_> = (0..4).map(|_| coord.schedule::<_, u64>("flaky", &())).collect();
    for (i, v) in values.iter().enumerate() {
        assert_eq!(v.fetch().unwrap(), i as u64);
    }
    coord.join().unwrap();
    assert_eq!(coord.steps_rescheduled(), 8);
    assert_eq!(coord.worker_failures(), 0);
}

#[test]
fn a_step_unavailable_for_too_long_fails() {
    let c = cluster(1);
    let mut o = options();
    o.step_retry_for = Duration::from_millis(100);
    let coord = ClusterCoordinator::with_ps_tasks(c.addresses.clone(), vec![], o).unwrap();
    let e = coord.schedule::<_, u64>("flaky", &()).fetch().unwrap_err();
    assert!(matches!(e, strata_core::Error::Unavailable(_)), "{e:?}");
    let m = e.to_string();
    assert!(m.contains("step 0 (flaky) stayed unavailable"), "{m}");
    assert!(m.contains("step unavailable: ps:0 is down"), "{m}");
    assert!(coord.join().is_err());
}

#[test]
fn an_unknown_function_names_itself_and_the_fix() {
    let c = cluster(1);
    let coord = ClusterCoordinator::with_ps_tasks(c.addresses.clone(), vec![], options()).unwrap();
    let e = coord.schedule::<_, u64>("train_step", &1).fetch().unwrap_err().to_string();
    assert!(e.contains("no step function named train_step is registered in worker:0"), "{e}");
    assert!(e.contains("register it in the binary every task runs"), "{e}");
    assert!(coord.join().is_err());
    // A result of the wrong type says so.
    let e = coord.schedule::<_, String>("add", &(1, 2)).fetch().unwrap_err().to_string();
    assert!(e.contains("the result of step 1 (add) is not a"), "{e}");
}

#[test]
fn checkpoints_every_n_steps() {
    let c = cluster(1);
    // Without ps tasks, checkpoint_every does nothing.
    let mut o = options();
    o.checkpoint_every = Some(3);
    let coord = ClusterCoordinator::with_ps_tasks(c.addresses.clone(), vec![], o.clone()).unwrap();
    for i in 0..10i64 {
        coord.schedule::<_, i64>("add", &(i, i));
    }
    coord.join().unwrap();
    assert_eq!(coord.steps_completed(), 10);
    coord.shutdown();
    // With one worker the completions are sequential: exactly every 3 steps.
    let ps = Arc::new(FakePs::default());
    let coord =
        ClusterCoordinator::with_ps_tasks(c.addresses.clone(), vec![ps.clone() as Arc<dyn PsControl>], o.clone())
            .unwrap();
    for i in 0..10i64 {
        coord.schedule::<_, i64>("add", &(i, i));
    }
    coord.join().unwrap();
    assert_eq!(*ps.checkpoints.lock().unwrap(), vec![3, 6, 9]);
}

/// A job resumed from its ps tasks' checkpoint of step 40 counts the job's steps from there: its
/// checkpoints are those of steps 43, 46 and 49, and a failing one names the step resumed from.
#[test]
fn a_resumed_job_names_its_checkpoints_after_the_step_it_resumed_from() {
    let c = cluster(1);
    let mut o = options();
    o.checkpoint_every = Some(3);
    o.first_step = 40;
    let ps = Arc::new(FakePs::default());
    let coord =
        ClusterCoordinator::with_ps_tasks(c.addresses.clone(), vec![ps.clone() as Arc<dyn PsControl>], o.clone())
            .unwrap();
    assert_eq!(coord.first_step(), 40);
    for i in 0..10i64 {
        coord.schedule::<_, i64>("add", &(i, i));
    }
    coord.join().unwrap();
    assert_eq!((ps.checkpoints.lock().unwrap().clone(), coord.steps_completed()), (vec![43, 46, 49], 10));
    coord.shutdown();
    let ps = Arc::new(FakePs { fail_from: Some(0), ..FakePs::default() });
    let coord =
        ClusterCoordinator::with_ps_tasks(c.addresses.clone(), vec![ps.clone() as Arc<dyn PsControl>], o).unwrap();
    for i in 0..10i64 {
        coord.schedule::<_, i64>("add", &(i, i));
    }
    let e = coord.join().unwrap_err().to_string();
    assert!(e.contains("the checkpoint of step 43 failed on ps:0: disk full; training stopped there, and the last good checkpoint is the one of step 40 the job resumed from"), "{e}");
    coord.shutdown();
}

/// A checkpoint that cannot be written stops the job there: the steps still queued fail with
/// an error naming the failure and the last good checkpoint, and `join` returns it.
#[test]
fn a_failing_checkpoint_stops_the_job_naming_the_last_good_one() {
    let c = cluster(1);
    let mut o = options();
    o.checkpoint_every = Some(3);
    for (fail_from, good) in
        [(0, "no checkpoint was written before it"), (1, "the last good checkpoint is step 3 (/tmp/ckpt-3)")]
    {
        let ps = Arc::new(FakePs { fail_from: Some(fail_from), ..FakePs::default() });
        let coord =
            ClusterCoordinator::with_ps_tasks(c.addresses.clone(), vec![ps.clone() as Arc<dyn PsControl>], o.clone())
                .unwrap();
        let values: Vec<_> = (0..10i64).map(|i| coord.schedule::<_, i64>("add", &(i, i))).collect();
        let e = coord.join().unwrap_err().to_string();
        let failed_at = 3 * (fail_from as u64 + 1);
        assert!(
            e.contains(&format!("the checkpoint of step {failed_at} failed on ps:0: disk full")) && e.contains(good),
            "{e}"
        );
        assert_eq!(ps.checkpoints.lock().unwrap().last(), Some(&failed_at), "no checkpoint after the failure");
        assert!(coord.steps_completed() < 10, "the job stopped: {}", coord.steps_completed());
        let last = values.last().unwrap().fetch().unwrap_err().to_string();
        assert!(last.contains("disk full") && last.contains(good), "{last}");
        coord.shutdown();
    }
}

#[test]
fn steps_fail_when_every_worker_is_lost() {
    let mut c = cluster(1);
    let mut o = options();
    o.step_retry_for = Duration::from_millis(500);
    let coord = ClusterCoordinator::with_ps_tasks(c.addresses.clone(), vec![], o).unwrap();
    c.servers[0].take().unwrap().shutdown();
    let v = coord.schedule::<_, i64>("add", &(1, 2));
    let e = v.fetch().unwrap_err();
    assert!(matches!(e, strata_core::Error::Unavailable(_)), "{e:?}");
    assert!(e.to_string().contains("every worker (worker:0) has been lost"), "{e}");
    assert!(coord.join().is_err());
    assert_eq!((coord.live_workers(), coord.worker_failures()), (0, 1));
}

#[test]
fn a_coordinator_without_workers_is_refused() {
    let e = ClusterCoordinator::with_ps_tasks(vec![], vec![], options()).unwrap_err().to_string();
    assert!(e.contains("at least one worker"), "{e}");
    let mut o = options();
    o.connect_timeout = Duration::from_millis(300);
    let e = ClusterCoordinator::with_ps_tasks(vec![("worker:0".into(), "127.0.0.1:1".into())], vec![], o)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no worker answered within 300ms (worker worker:0 at 127.0.0.1:1"), "{e}");
}

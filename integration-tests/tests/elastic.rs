//! Elastic MultiWorkerMirrored under `strata launch`, with real processes: a worker lost
//! mid-job (the chief included, killed or stopped) costs a step, not the job; a restarted
//! worker joins the running job; and the job still ends with one device's parameters, since
//! every global batch is the same whatever the membership (SGD, so that the sums' order is
//! the only difference). Every wait has a hard deadline.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use strata_integration_tests::{strata, wait};

/// The longest a job of these tests may run.
const TIMEOUT: Duration = Duration::from_secs(180);

/// The model and its training: 301K parameters, SGD, epochs of 6 steps of 256 examples.
const TRAIN: &[&str] = &["--hidden", "512,512", "--optimizer", "sgd", "--no-progress"];

/// The reference: one process, one device, the same global batches, 30 epochs.
fn one_device(dir: &Path) -> HashMap<String, Tensor> {
    one_device_for(dir, 30)
}

/// The reference after `epochs` epochs.
fn one_device_for(dir: &Path, epochs: usize) -> HashMap<String, Tensor> {
    one_device_model(dir, TRAIN, epochs)
}

/// The reference of `model` (the model and its optimizer) after `epochs` epochs: trained once
/// per test binary (the tests run in parallel; the first to ask trains it while the others
/// wait) and kept in memory, its file written in `dir` of the test that trained it.
fn one_device_model(dir: &Path, model: &[&str], epochs: usize) -> HashMap<String, Tensor> {
    type References = std::sync::Mutex<HashMap<(String, usize), HashMap<String, Tensor>>>;
    static REFERENCES: std::sync::OnceLock<References> = std::sync::OnceLock::new();
    let mut trained = REFERENCES.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    trained.entry((model.join(" "), epochs)).or_insert_with(|| train_one_device(dir, model, epochs)).clone()
}

/// One process, one device: `strata train --strategy one-device` with `model`, for `epochs`.
fn train_one_device(dir: &Path, model: &[&str], epochs: usize) -> HashMap<String, Tensor> {
    let path = dir.join(format!("one-device-{}-{epochs}.safetensors", model.join("").replace([',', '-'], "")));
    let child = strata()
        .args(["train", "--strategy", "one-device"])
        .args(model)
        .args(["--epochs", &epochs.to_string()])
        .arg("--save-params")
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("strata runs");
    let o = wait(child, Instant::now() + TIMEOUT);
    assert!(o.status.success(), "one device: {}", String::from_utf8_lossy(&o.stderr));
    candle_core::safetensors::load(&path, &candle_core::Device::Cpu).expect("the reference's parameters")
}

/// A job's stderr as a failed assertion shows it: without the per-epoch lines, which would push
/// the membership's changes (generations formed, warnings, the launcher's lines) out of a log
/// that is cut in the middle.
fn shown(stderr: &str) -> String {
    let kept: Vec<&str> = stderr.lines().filter(|l| !l.contains("epoch done")).collect();
    let dropped = stderr.lines().count() - kept.len();
    format!("({dropped} lines of finished epochs left out)\n{}", kept.join("\n"))
}

/// ‖a - b‖ / ‖b‖ over every parameter.
fn l2_relative(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> f64 {
    assert_eq!(a.len(), b.len(), "the same parameters");
    let (mut diff, mut norm) = (0f64, 0f64);
    for (name, tb) in b {
        let ta = &a[name];
        let va = ta.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let vb = tb.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (x, y) in va.iter().zip(&vb) {
            diff += f64::from(x - y).powi(2);
            norm += f64::from(*y).powi(2);
        }
    }
    (diff / norm).sqrt()
}

/// An elastic job of `workers` under `strata launch` (min 2), whose tasks carry `marker` in
/// their environment so that the test can find their processes.
struct Job {
    child: std::process::Child,
    marker: String,
    dir: PathBuf,
}

impl Job {
    fn start(dir: &Path, workers: usize, launch: &[&str]) -> Job {
        Job::start_with(dir, workers, launch, &["--epochs", "30"])
    }

    /// A job whose `strata train` also takes `train` (its epochs among them).
    fn start_with(dir: &Path, workers: usize, launch: &[&str], train: &[&str]) -> Job {
        Job::start_model(dir, workers, launch, TRAIN, train)
    }

    /// A job whose `strata train` takes `model` (the model and its optimizer) and `train`.
    fn start_model(dir: &Path, workers: usize, launch: &[&str], model: &[&str], train: &[&str]) -> Job {
        let mut program: Vec<OsString> =
            ["strata", "train", "--strategy", "multi-worker-mirrored", "--min-workers", "2"]
                .iter()
                .chain(model)
                .chain(train)
                .map(OsString::from)
                .collect();
        program.extend(["--metrics".into(), dir.join("metrics.jsonl").into_os_string()]);
        Job::start_program(dir, workers, launch, program, &[])
    }

    /// A job of `program` (with `--save-params` added) under `strata launch`, every task with
    /// `env` too.
    fn start_program(dir: &Path, workers: usize, launch: &[&str], program: Vec<OsString>, env: &[(&str, &str)]) -> Job {
        let marker = format!("{}-{}", std::process::id(), dir.file_name().unwrap().to_string_lossy());
        let mut cmd = strata();
        cmd.env("STRATA_TEST_JOB", &marker).env("STRATA_LOG", "info").envs(env.iter().copied());
        cmd.args(["launch", "--workers", &workers.to_string()]).args(launch).arg("--");
        cmd.args(program);
        cmd.arg("--save-params").arg(dir.join("p{task}.safetensors"));
        let child =
            cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("strata runs");
        Job { child, marker, dir: dir.to_path_buf() }
    }

    /// The process of `task` (the one started last, after a restart).
    fn pid(&self, task: &str) -> Pid {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let mut found = None;
            for entry in std::fs::read_dir("/proc").unwrap().flatten() {
                let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
                let Ok(env) = std::fs::read(entry.path().join("environ")) else { continue };
                let vars: Vec<&[u8]> = env.split(|&b| b == 0).collect();
                let has = |v: String| vars.contains(&v.as_bytes());
                if has(format!("STRATA_TEST_JOB={}", self.marker)) && has(format!("STRATA_TASK={task}")) {
                    found = found.max(Some(pid));
                }
            }
            if let Some(pid) = found {
                return Pid::from_raw(pid);
            }
            assert!(Instant::now() < deadline, "no process of {task}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until the chief's metrics record `step` steps.
    fn wait_for_step(&self, step: usize) {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let text = std::fs::read_to_string(self.dir.join("metrics.jsonl")).unwrap_or_default();
            if text.lines().filter(|l| l.contains("\"kind\":\"step\"")).count() >= step {
                return;
            }
            assert!(Instant::now() < deadline, "step {step} never came; metrics: {text}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn finish(self) -> Output {
        wait(self.child, Instant::now() + TIMEOUT)
    }
}

/// The finished job's parameters, as the workers that ended it wrote them: all bitwise equal.
fn parameters(dir: &Path, o: &Output) -> HashMap<String, Tensor> {
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "the elastic job completes: {}", shown(&stderr));
    let mut found: Vec<HashMap<String, Tensor>> = Vec::new();
    for i in 0..4 {
        let path = dir.join(format!("p{i}.safetensors"));
        if path.exists() {
            found.push(candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap());
        }
    }
    assert!(found.len() >= 2, "the surviving workers wrote their parameters: {}", shown(&stderr));
    for other in &found[1..] {
        assert_eq!(l2_relative(other, &found[0]), 0.0, "every worker holds the same bits: {}", shown(&stderr));
    }
    found.swap_remove(0)
}

fn check_against(reference: &HashMap<String, Tensor>, dir: &Path, o: &Output, what: &str) {
    check_epochs(reference, dir, o, what, 30);
}

/// How far from one device's parameters an elastic job of SGD may end (L2-relative): sums in
/// another order. Measured (2026-12-02, these tests with the 301K MLP,
/// docs/bench/2026-12-02-elastic-distances.md): 8.3e-9 to 1.09e-8 for every job, disturbed or
/// not; a step applied twice lands at 8.3e-5, far outside it
/// (`a_step_applied_twice_fails_the_bound`). The other order can also tip the trajectory into a
/// second outcome, 2.378e-7 from one device: Mirrored over 3, 4 or 7 replicas of one process
/// ends there, with no membership change at all, and so does this suite's stopped worker when
/// the job re-forms after step 52, 55 or 58 (docs/bench/2026-12-05-2230-elastic-bound.md). The
/// bound is 4.2 times that outcome and 83 times below a step applied twice.
const ONE_DEVICE_BOUND: f64 = 1e-6;

/// Whether `d` (from one device) is within [`ONE_DEVICE_BOUND`]: the check every test here
/// makes, the negative control included.
fn within_one_device_bound(d: f64) -> bool {
    d < ONE_DEVICE_BOUND
}

fn check_epochs(reference: &HashMap<String, Tensor>, dir: &Path, o: &Output, what: &str, epochs: usize) {
    let stderr = String::from_utf8_lossy(&o.stderr);
    let got = parameters(dir, o);
    let d = l2_relative(&got, reference);
    eprintln!("{what}: L2-relative distance from one device {d:.3e} (bound {ONE_DEVICE_BOUND:.0e})");
    assert!(within_one_device_bound(d), "{what}: {d:.3e} from one device; stderr: {}", shown(&stderr));
    assert!(stderr.contains("the elastic job completed"), "{}", shown(&stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("test accuracy") && stdout.contains(&format!("after {epochs} epochs")), "{stdout}");
}

#[test]
fn a_lost_worker_costs_a_step_and_the_result_is_still_one_devices() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = one_device(tmp.path());

    // Undisturbed: the baseline distance.
    let dir = tmp.path().join("undisturbed");
    std::fs::create_dir(&dir).unwrap();
    let o = Job::start(&dir, 3, &[]).finish();
    check_against(&reference, &dir, &o, "undisturbed");

    // worker:1 killed at step 60: the others go on without it.
    let dir = tmp.path().join("kill-1");
    std::fs::create_dir(&dir).unwrap();
    let job = Job::start(&dir, 3, &[]);
    job.wait_for_step(60);
    kill(job.pid("worker:1"), Signal::SIGKILL).unwrap();
    let o = job.finish();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        stderr.contains("task worker:1 was killed by SIGKILL; the elastic job goes on without it"),
        "{}",
        shown(&stderr)
    );
    assert!(stderr.contains("the elastic job completed in generation 2 with worker:0, worker:2"), "{}", shown(&stderr));
    check_against(&reference, &dir, &o, "worker:1 killed");

    // The chief killed at step 100 with a restart allowed: the others go on, and the new
    // process of worker:0 joins them at a step boundary, taking its state from a member.
    let dir = tmp.path().join("chief-and-stop");
    std::fs::create_dir(&dir).unwrap();
    let job = Job::start(&dir, 3, &["--max-restarts", "1"]);
    job.wait_for_step(100);
    let chief = job.pid("worker:0");
    kill(chief, Signal::SIGKILL).unwrap();
    let o = job.finish();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        stderr.contains(
            "task worker:0 was killed by SIGKILL; the elastic job goes on, and a new process joins it (restart 1 of 1)"
        ),
        "{}",
        shown(&stderr)
    );
    // The new process of worker:0 joined: the job ended with all three.
    // (in generation 2 when it joined before the old one was declared lost, else 3).
    let last = stderr.lines().find(|l| l.contains("the elastic job completed in generation")).unwrap_or_default();
    assert!(last.ends_with("with worker:0, worker:1, worker:2"), "{}", shown(&stderr));
    check_against(&reference, &dir, &o, "the chief killed and restarted");
}

/// A stopped worker (SIGSTOP) is declared lost and the others go on without it; continued
/// (SIGCONT) once they have, it carries an old generation: it is fenced and exits with one line.
#[test]
fn a_stopped_worker_is_fenced_and_the_job_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = one_device(tmp.path());
    let dir = tmp.path().join("stop");
    std::fs::create_dir(&dir).unwrap();
    let job = Job::start(&dir, 3, &[]);
    job.wait_for_step(50);
    let stopped = job.pid("worker:2");
    kill(stopped, Signal::SIGSTOP).unwrap();
    // No step completes without worker:2 until the others have re-formed without it.
    job.wait_for_step(60);
    kill(stopped, Signal::SIGCONT).unwrap();
    let o = job.finish();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(stderr.contains("lost on the way: worker:2 (no heartbeat for"), "{}", shown(&stderr));
    let fenced = stderr.lines().find(|l| l.starts_with("[worker:2] error:")).unwrap_or_default();
    assert!(
        fenced.contains("task worker:2 was declared lost") && fenced.contains("this process stops"),
        "the continued process is fenced: {}",
        shown(&stderr)
    );
    check_against(&reference, &dir, &o, "worker:2 stopped, then continued");
}

#[test]
fn elastic_flags_that_cannot_work_are_refused_in_one_line() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["train", "--strategy", "mirrored", "--min-workers", "2"],
            "--min-workers applies to --strategy multi-worker-mirrored",
        ),
        (
            &["train", "--strategy", "multi-worker-mirrored", "--min-workers", "0", "--coordinator", "127.0.0.1:1"],
            "--min-workers 0",
        ),
        (&["train", "--strategy", "multi-worker-mirrored", "--min-workers", "2"], "needs a coordination service"),
        (
            &["launch", "--workers", "2", "--max-restarts", "1", "--", "strata", "train"],
            "--max-restarts 1 restarts a lost task into an elastic job",
        ),
        (
            &["launch", "--workers", "2", "--", "strata", "train", "--min-workers", "3"],
            "an elastic job of 2 workers cannot run with at least 3: give a minimum from 1 to 2",
        ),
        (
            &["train", "--strategy", "multi-worker-mirrored", "--max-restarts", "1"],
            "--max-restarts 1 applies to --strategy parameter-server's local cluster",
        ),
        (
            &[
                "train",
                "--strategy",
                "multi-worker-mirrored",
                "--min-workers",
                "2",
                "--coordinator",
                "127.0.0.1:1",
                "--zero-stage",
                "1",
            ],
            "an elastic job at ZeRO stage 1 with an optimizer that keeps state, such as AdamW: a lost worker takes its shard of that state with it",
        ),
    ];
    for (args, expected) in cases {
        let o = strata().args(*args).env_remove("STRATA_COORDINATOR").stdin(Stdio::null()).output().unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", shown(&stderr));
        assert!(stderr.contains(expected), "{args:?}: {}", shown(&stderr));
        assert_eq!(stderr.lines().filter(|l| l.starts_with("error:")).count(), 1, "{args:?}: {}", shown(&stderr));
    }
    // A parameter-server job's cluster from TF_CONFIG is restarted by its cluster manager.
    let tf_config = r#"{"cluster":{"chief":["127.0.0.1:1"],"ps":["127.0.0.1:2"],"worker":["127.0.0.1:3"]},"task":{"type":"chief","index":0}}"#;
    let o = strata()
        .args(["train", "--strategy", "parameter-server", "--max-restarts", "2"])
        .env("TF_CONFIG", tf_config)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{}", shown(&stderr));
    assert!(
        stderr.contains("--max-restarts 2: TF_CONFIG describes a cluster this process did not start"),
        "{}",
        shown(&stderr)
    );
}

/// The chief killed while it writes a checkpoint, then another worker lost while the others
/// re-form without it: the two left go on, the new leader writes the checkpoints, and a
/// relaunch of the whole job from them resumes where the job ended.
#[test]
fn the_chief_lost_in_a_checkpoint_write_and_a_second_loss_in_a_row() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("lost-in-write");
    std::fs::create_dir(&dir).unwrap();
    let ckpt = dir.join("ckpt");
    let ckpt_arg = ckpt.to_str().unwrap();
    let every_step = ["--epochs", "20", "--checkpoint-every", "1", "--checkpoint-dir", ckpt_arg];
    let job = Job::start_with(&dir, 4, &[], &every_step);
    job.wait_for_step(40);
    let chief = job.pid("worker:0");
    // Caught in a write: its temporary directory exists (a checkpoint a step).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let entries = std::fs::read_dir(&ckpt).into_iter().flatten().flatten();
        if entries.map(|e| e.file_name().to_string_lossy().into_owned()).any(|n| n.starts_with(".tmp-ckpt-")) {
            kill(chief, Signal::SIGKILL).unwrap();
            break;
        }
        assert!(Instant::now() < deadline, "no checkpoint write was caught in a minute");
        std::thread::sleep(Duration::from_micros(200));
    }
    // The second loss comes while the others wait out the chief's heartbeat timeout (3 s).
    std::thread::sleep(Duration::from_secs(1));
    kill(job.pid("worker:2"), Signal::SIGKILL).unwrap();
    let o = job.finish();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    for task in ["worker:0", "worker:2"] {
        assert!(
            stderr.contains(&format!("task {task} was killed by SIGKILL; the elastic job goes on")),
            "{}",
            shown(&stderr)
        );
    }
    let last = stderr.lines().find(|l| l.contains("the elastic job completed in generation")).unwrap_or_default();
    assert!(last.ends_with("with worker:1, worker:3"), "{}", shown(&stderr));
    check_epochs(&one_device_for(tmp.path(), 20), &dir, &o, "the chief lost in a write, then worker:2", 20);
    // The last step's checkpoint, complete, written by the new leader.
    let latest = strata::checkpoint::read_latest(&ckpt).unwrap().expect("a checkpoint");
    assert_eq!(latest.step, 120);
    // Without the log's colours: the text before the first escape, then each escape's rest.
    let plain = |l: &str| {
        let mut parts = l.split('\x1b');
        let first = parts.next().unwrap_or_default().to_string();
        first + &parts.map(|p| p.split_once('m').map_or(p, |(_, rest)| rest)).collect::<String>()
    };
    assert!(
        stderr
            .lines()
            .map(plain)
            .any(|l| l.starts_with("[worker:1]") && l.contains("checkpoint written") && l.contains("step=120")),
        "worker:1 leads after the chief: {}",
        shown(&stderr)
    );

    // The whole job relaunched for 10 more epochs resumes from that checkpoint.
    let again = tmp.path().join("relaunched");
    std::fs::create_dir(&again).unwrap();
    let o = Job::start_with(&again, 3, &[], &["--epochs", "30", "--checkpoint-dir", ckpt_arg]).finish();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(stderr.contains("resumed from the checkpoint of step 120"), "{}", shown(&stderr));
    check_epochs(&one_device(tmp.path()), &again, &o, "relaunched from the new leader's checkpoint", 30);
}

/// A job of 3 workers training with `train` in `dir` (created), worker:1 killed (SIGKILL) at
/// step 60 and its new process joining: the job goes on and ends with all three.
fn worker_1_killed_and_replaced(dir: &Path, train: &[&str]) -> Output {
    std::fs::create_dir(dir).unwrap();
    let job = Job::start_with(dir, 3, &["--max-restarts", "1"], train);
    job.wait_for_step(60);
    kill(job.pid("worker:1"), Signal::SIGKILL).unwrap();
    let o = job.finish();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        stderr.contains("task worker:1 was killed by SIGKILL; the elastic job goes on, and a new process joins it"),
        "{}",
        shown(&stderr)
    );
    let last = stderr.lines().find(|l| l.contains("the elastic job completed in generation")).unwrap_or_default();
    assert!(last.ends_with("with worker:0, worker:1, worker:2"), "{}", shown(&stderr));
    o
}

/// PowerSGD's state follows the membership: the steps of a job that loses a worker and takes
/// in its replacement are carried on by the members' warm `Q`s and pooled error feedback
/// (only the lost worker's own residual is lost), so the job ends near the undisturbed one.
#[test]
fn powersgd_state_follows_a_loss_and_a_join() {
    let tmp = tempfile::tempdir().unwrap();
    let train = ["--epochs", "30", "--compression", "powersgd:4"];
    let dir = tmp.path().join("undisturbed");
    std::fs::create_dir(&dir).unwrap();
    let o = Job::start_with(&dir, 3, &[], &train).finish();
    let undisturbed = parameters(&dir, &o);

    let dir = tmp.path().join("lost-and-replaced");
    let o = worker_1_killed_and_replaced(&dir, &train);
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    let got = parameters(&dir, &o);
    let d = l2_relative(&got, &undisturbed);
    eprintln!("powersgd:4, worker:1 lost at step 60 and replaced: {d:.3e} from the undisturbed job");
    // Measured 2.0e-4 (2026-12-02; the lost worker's own error buffer, and sums in another order).
    assert!(d > 0.0 && d < 1.5e-3, "{d:.3e} from the undisturbed job: {}", shown(&stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("test accuracy") && stdout.contains("after 30 epochs"), "{stdout}");
}

/// SIGTERM to one worker of an elastic job (a pod evicted, a node drained): that worker alone
/// leaves at the next step boundary, the others go on at once (it is not declared lost, and the
/// launcher does not restart it), and the job completes with one device's result. SIGTERM to
/// every worker stops the job, and its outcome says so.
#[test]
fn sigterm_to_one_worker_makes_it_leave_and_the_job_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = one_device(tmp.path());
    let dir = tmp.path().join("term-one");
    std::fs::create_dir(&dir).unwrap();
    let job = Job::start(&dir, 3, &["--max-restarts", "1"]);
    job.wait_for_step(60);
    kill(job.pid("worker:1"), Signal::SIGTERM).unwrap();
    let o = job.finish();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        stderr.contains("task worker:1 left the elastic job on request; the job goes on without it"),
        "{}",
        shown(&stderr)
    );
    // Generation 2 as a rule (the two that stay form it at once). A clean-clone CI run under
    // load once ended in generation 3 with the same two, which no run here repeated (12 runs,
    // 2 or 3 at a time): a later generation is allowed, with the properties that matter held
    // below (not declared lost, nothing restarted, one device's result), and its log printed.
    let last = stderr.lines().find(|l| l.contains("the elastic job completed in generation")).unwrap_or_default();
    assert!(last.ends_with("with worker:0, worker:2"), "{}", shown(&stderr));
    if !last.contains("in generation 2 ") {
        eprintln!("the job ended in a later generation than 2:\n{}", shown(&stderr));
    }
    assert!(!stderr.contains("a new process joins it"), "the launcher restarted nothing: {}", shown(&stderr));
    let left = stderr.lines().find(|l| l.starts_with("[worker:1] error:")).unwrap_or_default();
    assert!(left.contains("this worker left the elastic job, which goes on without it"), "{}", shown(&stderr));
    assert!(!stderr.contains("no heartbeat for"), "nobody waited for a heartbeat timeout: {}", shown(&stderr));
    check_against(&reference, &dir, &o, "worker:1 asked to stop (SIGTERM)");

    let dir = tmp.path().join("term-all");
    std::fs::create_dir(&dir).unwrap();
    let job = Job::start(&dir, 3, &[]);
    job.wait_for_step(60);
    for task in ["worker:0", "worker:1", "worker:2"] {
        kill(job.pid(task), Signal::SIGTERM).unwrap();
    }
    let o = job.finish();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(143), "{}", shown(&stderr));
    assert!(stderr.contains("the elastic job stopped on request in generation"), "{}", shown(&stderr));
}

/// A lost worker grows every member's shard: where the larger shard no longer fits a
/// replica's `--memory-limit`, the job fails in one line naming the bytes instead of training
/// on past the limit. The 301K MLP under AdamW at stage 1 with 16 examples per worker: a step
/// over 3 workers holds 3.6 MiB, counted (parameters and the copy of their shard an elastic job
/// steps, the whole gradient, a third of the two moments, 0.19 MiB of activations), within
/// 4,000,000 bytes (3.8 MiB) as the run-time check requires; the model state over 2 needs 4.0
/// MiB, which stage 2 would hold.
#[test]
fn a_lost_worker_whose_shards_no_longer_fit_the_memory_limit_fails_the_job_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("zero-limit");
    std::fs::create_dir(&dir).unwrap();
    let ckpt = dir.join("ckpt");
    let adamw: &[&str] = &["--hidden", "512,512", "--optimizer", "adamw", "--no-progress"];
    let train = ["--epochs", "30", "--batch", "48", "--zero-stage", "1", "--memory-limit", "4000000"];
    let saved = ["--checkpoint-every", "30", "--checkpoint-dir", ckpt.to_str().unwrap()];
    let job = Job::start_model(&dir, 3, &[], adamw, &[&train[..], &saved[..]].concat());
    job.wait_for_step(30);
    kill(job.pid("worker:1"), Signal::SIGKILL).unwrap();
    let o = job.finish();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success(), "{}", shown(&stderr));
    assert!(stderr.contains("task worker:1 was killed by SIGKILL; the elastic job goes on"), "{}", shown(&stderr));
    assert!(!stderr.contains(" held "), "no step went over the limit before the loss: {}", shown(&stderr));
    let line = stderr
        .lines()
        .find(|l| l.contains("at zero stage 1") && l.contains("over its memory_limit of 3.8 MiB"))
        .unwrap_or_else(|| panic!("no memory-limit error: {}", shown(&stderr)));
    assert!(line.contains("needs 4.0 MiB") && line.contains("use it (--zero-stage 2)"), "{line}");
    assert!(!stderr.contains("the elastic job completed"), "{}", shown(&stderr));
}

/// How far from one device an AdamW job at ZeRO stage 1 or 2 may end, disturbed or not
/// (measured 1.97e-5 on 2026-12-02 on an AVX-512 CPU, every job alike; 1.356e-4 on
/// 2026-12-07 on an AMD EPYC without AVX-512, whose AVX2 products sum in other orders, which
/// AdamW's division by the second moment magnifies). A coarse check: what tells a step
/// applied twice or lost is [`ADAMW_UNDISTURBED_BOUND`], against the undisturbed job on the
/// same CPU.
const ADAMW_ONE_DEVICE_BOUND: f64 = 5e-4;
/// How far from the undisturbed AdamW job a disturbed one may end (measured 3.8e-8 and 4.0e-8).
const ADAMW_UNDISTURBED_BOUND: f64 = 3e-7;

/// ZeRO's shards follow the membership. Plain SGD keeps no state: a lost worker takes nothing
/// with it, and the members go on from the most advanced one's parameters (an elastic job's
/// shards are stepped in copies, so a step cut off leaves every member's parameters whole).
/// AdamW's moments are sharded: a worker that joins or leaves on request is re-split in
/// memory (the whole state gathered before the change), and a lost one rolls the job back to
/// its last checkpoint. Every case ends with one device's result.
#[test]
fn zero_shards_follow_a_loss_a_join_and_a_leave() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = one_device(tmp.path());
    let resplit = "re-split ZeRO's shards over the new membership";

    // SGD at stage 2: worker:1 killed at step 60 and replaced.
    let dir = tmp.path().join("sgd-kill-join");
    std::fs::create_dir(&dir).unwrap();
    let job = Job::start_with(&dir, 3, &["--max-restarts", "1"], &["--epochs", "30", "--zero-stage", "2"]);
    job.wait_for_step(60);
    kill(job.pid("worker:1"), Signal::SIGKILL).unwrap();
    let o = job.finish();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(stderr.contains("task worker:1 was killed by SIGKILL; the elastic job goes on"), "{}", shown(&stderr));
    let last = stderr.lines().find(|l| l.contains("the elastic job completed in generation")).unwrap_or_default();
    assert!(last.ends_with("with worker:0, worker:1, worker:2"), "{}", shown(&stderr));
    assert!(stderr.contains(resplit), "{}", shown(&stderr));
    assert!(!stderr.contains("rolled back"), "plain SGD loses nothing: {}", shown(&stderr));
    check_against(&reference, &dir, &o, "ZeRO stage 2, SGD: worker:1 killed and replaced");

    // AdamW: the reference, and an undisturbed job at stage 1 for the distance it ends at. The
    // 1.1M MLP: with the 301K one a roll back to the checkpoint of step 48 or of step 60 ends
    // 6.3e-5 from the undisturbed job (a roll back to step 24 or 72, or a hand-over, 4e-8 to
    // 6e-8), which these bounds would not tell from a step applied twice.
    let adamw: &[&str] = &["--hidden", "1024,1024", "--optimizer", "adamw", "--lr", "0.0005", "--no-progress"];
    let reference = one_device_model(tmp.path(), adamw, 30);
    let dir = tmp.path().join("adamw-undisturbed");
    std::fs::create_dir(&dir).unwrap();
    let ckpt = dir.join("ckpt");
    let train = ["--epochs", "30", "--zero-stage", "1", "--checkpoint-every", "12", "--checkpoint-dir"];
    let o = Job::start_model(&dir, 3, &[], adamw, &[&train[..], &[ckpt.to_str().unwrap()]].concat()).finish();
    let undisturbed_params = parameters(&dir, &o);
    let undisturbed = l2_relative(&undisturbed_params, &reference);
    eprintln!("ZeRO stage 1, AdamW, undisturbed: {undisturbed:.3e} from one device");
    assert!(
        undisturbed < ADAMW_ONE_DEVICE_BOUND,
        "{undisturbed:.3e} from one device: {}",
        shown(&String::from_utf8_lossy(&o.stderr))
    );

    // AdamW at stage 1: worker:1 stopped (SIGSTOP) at step 66 and declared lost, so its
    // shard of the moments is lost: the job rolls back to the checkpoint of step 60 (or 72,
    // had one been written meanwhile) and goes on with 2 workers. Once it has, the stopped
    // process is killed and restarted: the new one joins at a step boundary, the whole state
    // gathered before the members admit it and re-split in memory, with no roll back.
    let dir = tmp.path().join("adamw-lose-join");
    std::fs::create_dir(&dir).unwrap();
    let ckpt = dir.join("ckpt");
    let job =
        Job::start_model(&dir, 3, &["--max-restarts", "1"], adamw, &[&train[..], &[ckpt.to_str().unwrap()]].concat());
    job.wait_for_step(66);
    let stopped = job.pid("worker:1");
    kill(stopped, Signal::SIGSTOP).unwrap();
    // The others declare it lost (3 s), roll back and train on (the chief records every step
    // it trains, the steps trained again included).
    job.wait_for_step(90);
    kill(stopped, Signal::SIGKILL).unwrap();
    let o = job.finish();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    let lines: Vec<&str> = stderr.lines().collect();
    let rolled = lines.iter().position(|l| l.contains("rolled back to the checkpoint of step")).unwrap_or(usize::MAX);
    let rolled_line = lines.get(rolled).copied().unwrap_or_default();
    assert!(
        (rolled_line.contains("step 60:") || rolled_line.contains("step 72:"))
            && rolled_line.ends_with("over 2 workers"),
        "{}",
        shown(&stderr)
    );
    assert_eq!(lines.iter().filter(|l| l.contains("rolled back to the checkpoint")).count(), 1, "{}", shown(&stderr));
    assert!(
        lines[rolled..].iter().any(|l| l.contains(resplit)),
        "the new process's join re-split the shards in memory: {}",
        shown(&stderr)
    );
    let last = stderr.lines().find(|l| l.contains("the elastic job completed in generation")).unwrap_or_default();
    assert!(last.ends_with("with worker:0, worker:1, worker:2"), "{}", shown(&stderr));
    let got = parameters(&dir, &o);
    let d = l2_relative(&got, &reference);
    let u = l2_relative(&got, &undisturbed_params);
    eprintln!("ZeRO stage 1, AdamW, worker:1 lost (rolled back) and replaced (joined): {d:.3e} from one device, {u:.3e} from the undisturbed job");
    // The job ends 4e-8 from the undisturbed one (sums in another order while 2 workers trained), and as
    // far from one device as the undisturbed job (2e-5: AdamW's division by the second moment
    // magnifies the sums' order).
    assert!(d < ADAMW_ONE_DEVICE_BOUND, "{d:.3e} from one device ({undisturbed:.3e} undisturbed): {}", shown(&stderr));
    assert!(u < ADAMW_UNDISTURBED_BOUND, "{u:.3e} from the undisturbed job: {}", shown(&stderr));

    // AdamW at stage 2: worker:1 asked to stop (SIGTERM) at step 60 hands its shard over
    // before it leaves: no roll back.
    let dir = tmp.path().join("adamw-term");
    std::fs::create_dir(&dir).unwrap();
    let ckpt = dir.join("ckpt");
    let train2 = ["--epochs", "30", "--zero-stage", "2", "--checkpoint-every", "12", "--checkpoint-dir"];
    let job = Job::start_model(&dir, 3, &[], adamw, &[&train2[..], &[ckpt.to_str().unwrap()]].concat());
    job.wait_for_step(60);
    kill(job.pid("worker:1"), Signal::SIGTERM).unwrap();
    let o = job.finish();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        stderr.contains("task worker:1 left the elastic job on request; the job goes on without it"),
        "{}",
        shown(&stderr)
    );
    assert!(stderr.contains(resplit), "{}", shown(&stderr));
    assert!(!stderr.contains("rolled back"), "the leaver handed its shard over: {}", shown(&stderr));
    let got = parameters(&dir, &o);
    let d = l2_relative(&got, &reference);
    let u = l2_relative(&got, &undisturbed_params);
    eprintln!("ZeRO stage 2, AdamW, worker:1 asked to stop at step 60: {d:.3e} from one device, {u:.3e} from the undisturbed job at stage 1");
    assert!(d < ADAMW_ONE_DEVICE_BOUND, "{d:.3e} from one device ({undisturbed:.3e} undisturbed): {}", shown(&stderr));
    assert!(u < ADAMW_UNDISTURBED_BOUND, "{u:.3e} from the undisturbed job at stage 1: {}", shown(&stderr));
}

/// ZeRO stage 3's shards of the parameters follow the membership too. A lost worker takes its
/// shard of the parameters with it, whatever the optimizer: the members that pulled from it
/// fail the step (not a panic), the job rolls back to its last checkpoint and goes on, and the
/// restarted process joins (in the recovery, or at a step boundary after it: the model made
/// whole over the old membership before the members admit it, then re-split in memory). A worker asked to stop hands its shard over before it leaves: no roll back. Plain
/// SGD, so that every case ends with one device's result.
#[test]
fn zero_stage_3_follows_a_loss_a_join_and_a_leave() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = one_device(tmp.path());
    let resplit = "re-split ZeRO's shards over the new membership";
    let train = ["--epochs", "30", "--zero-stage", "3", "--checkpoint-every", "12", "--checkpoint-dir"];

    // worker:1 asked to stop (SIGTERM) after step 60.
    let dir = tmp.path().join("term");
    std::fs::create_dir(&dir).unwrap();
    let ckpt = dir.join("ckpt");
    let job = Job::start_with(&dir, 3, &[], &[&train[..], &[ckpt.to_str().unwrap()]].concat());
    job.wait_for_step(60);
    kill(job.pid("worker:1"), Signal::SIGTERM).unwrap();
    let o = job.finish();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        stderr.contains("task worker:1 left the elastic job on request; the job goes on without it"),
        "{}",
        shown(&stderr)
    );
    assert!(stderr.contains(resplit), "{}", shown(&stderr));
    assert!(!stderr.contains("rolled back"), "the leaver handed its shard over: {}", shown(&stderr));
    check_against(&reference, &dir, &o, "ZeRO stage 3, SGD: worker:1 asked to stop");
    // worker:1 killed after step 60 and restarted.
    let dir = tmp.path().join("kill-join");
    std::fs::create_dir(&dir).unwrap();
    let ckpt = dir.join("ckpt");
    let job = Job::start_with(&dir, 3, &["--max-restarts", "1"], &[&train[..], &[ckpt.to_str().unwrap()]].concat());
    job.wait_for_step(60);
    kill(job.pid("worker:1"), Signal::SIGKILL).unwrap();
    let o = job.finish();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    let lines: Vec<&str> = stderr.lines().collect();
    let rolled = lines.iter().position(|l| l.contains("rolled back to the checkpoint of step")).unwrap_or(usize::MAX);
    let rolled_line = lines.get(rolled).copied().unwrap_or_default();
    // The restarted process joins the recovery itself (over 3 workers) or the step boundary
    // after it (over 2, then a re-split in memory), as fast as it starts.
    assert!(
        rolled_line.contains("a lost worker took its shard of the parameters (ZeRO stage 3) with it")
            && (rolled_line.ends_with("over 3 workers")
                || rolled_line.ends_with("over 2 workers") && lines[rolled..].iter().any(|l| l.contains(resplit))),
        "{}",
        shown(&stderr)
    );
    assert_eq!(lines.iter().filter(|l| l.contains("rolled back to the checkpoint")).count(), 1, "{}", shown(&stderr));
    let last = stderr.lines().find(|l| l.contains("the elastic job completed in generation")).unwrap_or_default();
    assert!(last.ends_with("with worker:0, worker:1, worker:2"), "{}", shown(&stderr));
    check_against(&reference, &dir, &o, "ZeRO stage 3, SGD: worker:1 killed (rolled back) and replaced (joined)");
}

/// `examples/elastic_custom_loop.rs`, built as the harness builds the `strata` binary (the
/// tests' profile, the workspace selected, so that neither build undoes the other's).
fn custom_loop_bin() -> PathBuf {
    let dir = strata_integration_tests::build_in_workspace(&["--example", "elastic_custom_loop"], "the example");
    let bin = dir.join("examples").join("elastic_custom_loop");
    assert!(bin.is_file(), "the example is not at {}", bin.display());
    bin
}

/// The example's command line: `strata train`'s flags for the model of these tests.
fn custom_loop(bin: &Path) -> Vec<OsString> {
    let mut program = vec![bin.as_os_str().to_os_string()];
    let flags = ["--hidden", "512,512", "--optimizer", "sgd", "--lr", "0.003", "--epochs", "30", "--min-workers", "2"];
    program.extend(flags.iter().map(OsString::from));
    program
}

/// A job's standard output, read as it comes (the example's chief prints a line per epoch).
struct Watched {
    text: std::sync::Arc<std::sync::Mutex<String>>,
    reader: std::thread::JoinHandle<()>,
}

impl Job {
    fn watch(&mut self) -> Watched {
        use std::io::BufRead;
        let out = self.child.stdout.take().expect("the job's stdout is piped");
        let text = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let into = text.clone();
        let reader = std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let mut t = into.lock().unwrap();
                t.push_str(&line);
                t.push('\n');
            }
        });
        Watched { text, reader }
    }

    /// Waits until the job's stdout holds `needle`.
    fn wait_for_output(&self, watched: &Watched, needle: &str) {
        let deadline = Instant::now() + TIMEOUT;
        while !watched.text.lock().unwrap().contains(needle) {
            assert!(Instant::now() < deadline, "{needle:?} never came; stdout: {}", watched.text.lock().unwrap());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn finish_watched(self, watched: Watched) -> Output {
        let mut o = self.finish();
        watched.reader.join().unwrap();
        o.stdout = watched.text.lock().unwrap().clone().into_bytes();
        o
    }
}

/// The hand-written loop of `examples/elastic_custom_loop.rs` (`strata::Elastic` around each
/// step) under `strata launch`: the chief killed mid-job, then in another job a worker that is
/// not the chief; the others go on each time, and end with one device's parameters.
#[test]
fn a_hand_written_loop_survives_a_lost_chief_with_one_devices_result() {
    let bin = custom_loop_bin();
    let tmp = tempfile::tempdir().unwrap();
    let reference = one_device(tmp.path());
    for (task, epoch, rest) in [("worker:0", 16, "worker:1, worker:2"), ("worker:2", 8, "worker:0, worker:1")] {
        let dir = tmp.path().join(format!("custom-loop-{}", task.replace(':', "")));
        std::fs::create_dir(&dir).unwrap();
        let mut job = Job::start_program(&dir, 3, &[], custom_loop(&bin), &[]);
        let watched = job.watch();
        // 6 steps an epoch: the kill comes in the epoch after.
        job.wait_for_output(&watched, &format!("epoch {epoch}: test accuracy"));
        kill(job.pid(task), Signal::SIGKILL).unwrap();
        let o = job.finish_watched(watched);
        let stderr = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(
            stderr.contains(&format!("task {task} was killed by SIGKILL; the elastic job goes on without it")),
            "{}",
            shown(&stderr)
        );
        assert!(
            stderr.contains(&format!("the elastic job completed in generation 2 with {rest}")),
            "{}",
            shown(&stderr)
        );
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(stdout.contains("elastic_custom_loop: test accuracy"), "{stdout}");
        check_against(&reference, &dir, &o, &format!("the hand-written loop, {task} killed after epoch {epoch}"));
    }
}

/// The negative control of [`ONE_DEVICE_BOUND`]: the same hand-written loop, undisturbed,
/// with one step (the 90th of 180) applied twice, ends outside it.
#[test]
fn a_step_applied_twice_fails_the_bound() {
    let bin = custom_loop_bin();
    let tmp = tempfile::tempdir().unwrap();
    let reference = one_device(tmp.path());
    let dir = tmp.path().join("twice");
    std::fs::create_dir(&dir).unwrap();
    let o = Job::start_program(&dir, 3, &[], custom_loop(&bin), &[("STRATA_EXAMPLE_STEP_TWICE", "90")]).finish();
    let d = l2_relative(&parameters(&dir, &o), &reference);
    eprintln!(
        "the hand-written loop with step 90 applied twice: {d:.3e} from one device (bound {ONE_DEVICE_BOUND:.0e})"
    );
    assert!(!within_one_device_bound(d), "a step applied twice passes the bound: {d:.3e}");
}

/// The open question of the AdamW runs above, kept to reproduce it: on the 301K MLP, AdamW at
/// ZeRO stage `STRATA_PROBE_STAGE` (1), `worker:1` killed once the chief recorded step
/// `STRATA_PROBE_AT` (66; `STRATA_PROBE_TERM=1`: asked to stop instead), against the undisturbed
/// job. Measured 2026-12-02 (docs/bench/2026-12-02-elastic-distances.md): a roll back to step 48
/// or 60 ends 6.3e-5 from it, to step 24 or 72 or a hand-over 4e-8 to 6e-8; on 2026-12-03
/// (docs/bench/2026-12-03-elastic-adamw.md) a hand-over near step 50 ended at the same 6.3e-5,
/// which a discontinuity of the trajectory 30 steps later causes, not the roll back. It asserts
/// nothing.
#[test]
#[ignore = "a measurement: cargo test ... --test elastic -- --ignored --nocapture"]
fn adamw_roll_back_on_the_301k_mlp() {
    let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_string());
    let hidden = var("STRATA_PROBE_HIDDEN", "512,512");
    let stage = var("STRATA_PROBE_STAGE", "1");
    let adamw: &[&str] = &["--hidden", &hidden, "--optimizer", "adamw", "--lr", "0.0005", "--no-progress"];
    let train = ["--epochs", "30", "--zero-stage", &stage, "--checkpoint-every", "12", "--checkpoint-dir"];
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str| {
        let dir = tmp.path().join(name);
        std::fs::create_dir(&dir).unwrap();
        let ckpt = dir.join("ckpt");
        (Job::start_model(&dir, 3, &[], adamw, &[&train[..], &[ckpt.to_str().unwrap()]].concat()), dir)
    };
    let (job, dir) = run("undisturbed");
    let undisturbed = parameters(&dir, &job.finish());
    let (job, dir) = run("disturbed");
    job.wait_for_step(var("STRATA_PROBE_AT", "66").parse().expect("a step"));
    let signal = if std::env::var_os("STRATA_PROBE_TERM").is_some() { Signal::SIGTERM } else { Signal::SIGKILL };
    kill(job.pid("worker:1"), signal).unwrap();
    let o = job.finish();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    let rolled = stderr.lines().find(|l| l.contains("rolled back to the checkpoint")).unwrap_or("no roll back");
    let d = l2_relative(&parameters(&dir, &o), &undisturbed);
    eprintln!(
        "AdamW, stage {stage}, --hidden {hidden}, {signal:?} after step {}: {rolled}; {d:.3e} from the undisturbed job",
        var("STRATA_PROBE_AT", "66")
    );
}

/// The final test accuracy a job's chief printed, in percent.
fn test_accuracy(o: &Output) -> f64 {
    let stdout = String::from_utf8_lossy(&o.stdout);
    stdout
        .split("test accuracy")
        .nth(1)
        .and_then(|t| t.split(|c: char| !(c.is_ascii_digit() || c == '.')).find(|w| !w.is_empty()))
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no test accuracy: {stdout}"))
}

/// Streaming DiLoCo in an elastic job (2 fragments met every 4 steps, each landing a step
/// after it is sent, so a change always finds an exchange in flight or cut): worker:1 killed
/// at step 60 and its new process joining, then worker:2 killed for good. The job goes on
/// each time and every worker ends on the same bits; what a loss costs is the lost worker's
/// inner steps since its fragments last met, so the job ends near the undisturbed one
/// (measured 2026-12-04: 1.6e-3 and 1.5e-3 from it, L2-relative, at its accuracy of 96.1%).
#[test]
fn local_sgd_follows_a_loss_and_a_join() {
    let tmp = tempfile::tempdir().unwrap();
    let diloco = ["--epochs", "30", "--sync-every", "4", "--fragments", "2", "--lr", "0.05"];
    let dir = tmp.path().join("undisturbed");
    std::fs::create_dir(&dir).unwrap();
    let o = Job::start_with(&dir, 3, &[], &diloco).finish();
    let undisturbed = parameters(&dir, &o);
    let undisturbed_accuracy = test_accuracy(&o);

    let dir = tmp.path().join("kill-join");
    let o = worker_1_killed_and_replaced(&dir, &diloco);
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    let joined = parameters(&dir, &o);
    let d = l2_relative(&joined, &undisturbed);
    let acc = test_accuracy(&o);
    eprintln!(
        "DiLoCo, worker:1 killed and replaced: {d:.3e} from undisturbed, accuracy {acc} ({undisturbed_accuracy})"
    );
    assert!(d > 0.0 && d < 0.05, "{d:.3e}: {}", shown(&stderr));
    assert!(acc > undisturbed_accuracy - 2.0, "{acc}% against {undisturbed_accuracy}%");

    let dir = tmp.path().join("kill");
    std::fs::create_dir(&dir).unwrap();
    let job = Job::start_with(&dir, 3, &[], &diloco);
    job.wait_for_step(90);
    kill(job.pid("worker:2"), Signal::SIGKILL).unwrap();
    let o = job.finish();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(stderr.contains("the elastic job completed in generation 2 with worker:0, worker:1"), "{}", shown(&stderr));
    let lost = parameters(&dir, &o);
    let d = l2_relative(&lost, &undisturbed);
    let acc = test_accuracy(&o);
    eprintln!("DiLoCo, worker:2 killed: {d:.3e} from undisturbed, accuracy {acc} ({undisturbed_accuracy})");
    assert!(d > 0.0 && d < 0.05, "{d:.3e}: {}", shown(&stderr));
    assert!(acc > undisturbed_accuracy - 2.0, "{acc}% against {undisturbed_accuracy}%");
}

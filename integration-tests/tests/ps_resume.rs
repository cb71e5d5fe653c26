//! A parameter-server job resumed by running the same `strata train` command again, with real
//! processes: a local job's ps tasks restore the checkpoints they wrote under `--checkpoint-dir`
//! (`ps-<i>`), and a hybrid job's chief writes its dense layers' under `dense`, at the steps its
//! ps tasks checkpoint (every worker's rows of the step, and none of a later one). A hybrid job
//! of one worker (whose pushes land in step order) stopped by `--max-steps` and run again ends
//! bit for bit where an uninterrupted run ends; of two, every ps task has applied each worker's
//! pushes exactly once per step over both runs; stopped by SIGTERM, it stops after a step with
//! both halves checkpointed at it, and resumes there. Every process has a hard deadline.

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use strata_integration_tests::{strata, wait};

/// The click model's flags, the same for every job: 25,600 records, 100 steps of 256.
const MODEL: [&str; 10] = [
    "--model",
    "ctr",
    "--embedding-rows",
    "20000",
    "--embedding-dim",
    "8",
    "--train-records",
    "25600",
    "--test-records",
    "2000",
];

/// Runs `strata train` on `ps` ps tasks and `workers` workers (`hybrid` or async), checkpoints
/// every 20 steps in `dir`, with `extra` flags; the summary goes to `out`.
fn train(hybrid: bool, ps: usize, workers: usize, dir: &Path, out: &Path, extra: &[&str]) -> Output {
    let cmd = command(hybrid, ps, workers, dir, out, extra);
    wait(cmd, Instant::now() + Duration::from_secs(240))
}

/// [`train`]'s process, started.
fn command(hybrid: bool, ps: usize, workers: usize, dir: &Path, out: &Path, extra: &[&str]) -> std::process::Child {
    let mut cmd = strata();
    cmd.args(["train", "--strategy", "parameter-server", "--ps-mode", if hybrid { "hybrid" } else { "async" }])
        .args(["--ps-tasks", &ps.to_string(), "--workers", &workers.to_string()])
        .args(MODEL)
        .args(["--checkpoint-every", "20", "--no-progress", "--checkpoint-dir"])
        .arg(dir)
        .arg("--out")
        .arg(out)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd.spawn().unwrap()
}

fn ok(o: &Output) -> String {
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "exit {:?}\n{stderr}", o.status);
    stderr
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("written")).expect("JSON")
}

/// Every worker's parameter digest, in the order they were printed.
fn digests(stderr: &str) -> Vec<String> {
    stderr.lines().filter_map(|l| l.split("parameter digest ").nth(1)).map(|d| d.trim().to_string()).collect()
}

/// The steps of the `ckpt-<step>` directories under `dir`.
fn steps(dir: &Path) -> Vec<u64> {
    strata::checkpoint::checkpoint_steps(dir).unwrap().into_iter().map(|(s, _)| s).collect()
}

#[test]
fn a_hybrid_job_of_one_worker_resumes_bit_for_bit_where_it_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let (full, half) = (dir.path().join("full"), dir.path().join("half"));
    let out = dir.path().join("out.json");
    let whole = digests(&ok(&train(true, 2, 1, &full, &out, &[])));
    assert_eq!(whole.len(), 1);
    // Stopped at step 50: checkpoints of steps 20, 40 and 50, dense and on both ps tasks.
    let first = ok(&train(true, 2, 1, &half, &out, &["--max-steps", "50"]));
    assert_ne!(digests(&first), whole, "50 steps are not 100");
    assert_eq!(steps(&half.join("dense")), [20, 40, 50]);
    for k in 0..2 {
        assert_eq!(steps(&half.join(format!("ps-{k}"))), [20, 40, 50], "ps:{k}");
    }
    // The same command again: the ps tasks restore step 50, the worker resumes there.
    let second = ok(&train(true, 2, 1, &half, &out, &[]));
    assert!(second.contains("resumed from the checkpoint of step 50"), "{second}");
    assert_eq!(digests(&second), whole, "the resumed job ends where the uninterrupted one does: {second}");
    // One push per step in all.
    restored_with_pushes(&json(&out), 50, &[100]);
}

#[test]
fn a_hybrid_job_of_two_workers_resumes_with_every_push_applied_once() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let out = dir.path().join("out.json");
    ok(&train(true, 2, 2, &ck, &out, &["--max-steps", "30"]));
    assert_eq!(steps(&ck.join("dense")), [20, 30]);
    // As if the chief died between the ps tasks' checkpoint of step 30 and its own: the ps
    // tasks are restored at the dense layers' step, 20, although they have a later one.
    let dense = ck.join("dense");
    std::fs::remove_dir_all(dense.join(strata::checkpoint::checkpoint_dir_name(30))).unwrap();
    std::fs::remove_file(dense.join("latest")).unwrap();
    assert_eq!(steps(&ck.join("ps-0")), [20, 30]);
    let second = ok(&train(true, 2, 2, &ck, &out, &[]));
    assert!(second.contains("resumed from the checkpoint of step 20"), "{second}");
    let d = digests(&second);
    assert_eq!(d.len(), 2, "{second}");
    assert_eq!(d[0], d[1], "the dense layers stay synchronous after the resume: {second}");
    let s = json(&out);
    // 20 steps' pushes of each worker in the checkpoint, 80 after it: none lost, none twice.
    restored_with_pushes(&s, 20, &[100, 100]);
    for t in s["parameter_servers"]["tasks"].as_array().unwrap() {
        assert_eq!(t["version"].as_u64(), Some(200), "{t}");
    }
    assert!(s["final_test_auc"].as_f64().unwrap() > 0.6, "the resumed job trains on: {s}");
}

#[test]
fn an_async_job_run_again_resumes_from_its_ps_tasks_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let out = dir.path().join("out.json");
    ok(&train(false, 2, 1, &ck, &out, &["--max-steps", "40"]));
    let second = ok(&train(false, 2, 1, &ck, &out, &["--epochs", "2"]));
    assert!(second.contains("resumed from the ps tasks' checkpoint of step 40"), "{second}");
    let s = json(&out);
    for t in s["parameter_servers"]["tasks"].as_array().unwrap() {
        // 2 epochs of 100 steps, 40 of them before the checkpoint: one update per step.
        assert_eq!(t["restored_step"].as_u64(), Some(40), "{t}");
        assert_eq!(t["version"].as_u64(), Some(200), "{t}");
    }
    // Run again with the job done: nothing left to train, said in one line.
    let done = train(false, 2, 1, &ck, &out, &["--epochs", "2"]);
    let e = String::from_utf8_lossy(&done.stderr);
    assert_eq!(done.status.code(), Some(2), "{e}");
    assert!(e.contains("restored from the checkpoint of step 200, and this job ends at step 200"), "{e}");
    // Another number of ps tasks than the checkpoints': refused in one line, nothing started.
    let other = train(false, 3, 1, &ck, &out, &["--epochs", "3"]);
    let e = String::from_utf8_lossy(&other.stderr).trim().to_string();
    assert_eq!(other.status.code(), Some(2), "{e}");
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(e.contains("holds the checkpoints of 2 ps tasks, and this job has 3: resume with --ps-tasks 2"), "{e}");
    assert_eq!(steps(&ck.join("ps-0")).last(), Some(&200), "nothing written by the refused job");
}

/// A hybrid job over an async job's checkpoints (its ps tasks hold dense variables), and an
/// async job over a hybrid job's (its dense layers under `dense`): each refused in one line
/// before anything starts, and nothing written over the other job's checkpoints.
#[test]
fn a_job_over_another_mode_s_checkpoints_is_refused_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.json");
    let (async_ck, hybrid_ck) = (dir.path().join("async"), dir.path().join("hybrid"));
    ok(&train(false, 2, 1, &async_ck, &out, &["--max-steps", "40"]));
    ok(&train(true, 2, 1, &hybrid_ck, &out, &["--max-steps", "40"]));
    let refused = |o: Output, want: &str| {
        let e = String::from_utf8_lossy(&o.stderr).trim().to_string();
        assert_eq!(o.status.code(), Some(2), "{e}");
        assert_eq!(e.lines().count(), 1, "{e}");
        assert!(e.contains(want), "{e}");
    };
    refused(
        train(true, 2, 1, &async_ck, &out, &[]),
        "holds the checkpoints of a parameter-server job that is not hybrid (ps-0 at step 40 holds its dense variables)",
    );
    assert!(!async_ck.join("dense").exists(), "no dense layers written beside the async job's");
    assert_eq!(steps(&async_ck.join("ps-0")), [20, 40]);
    refused(
        train(false, 2, 1, &hybrid_ck, &out, &[]),
        "holds a hybrid job's checkpoints (its dense layers under dense)",
    );
    assert_eq!(steps(&hybrid_ck.join("ps-0")), [20, 40]);
}

#[test]
fn a_hybrid_job_stopped_by_sigterm_checkpoints_both_halves_at_its_last_step_and_resumes_there() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let out = dir.path().join("out.json");
    // 300 steps of 2 workers; SIGTERM once the first checkpoint (step 20) is written.
    let epochs = ["--epochs", "3"];
    let mut child = command(true, 2, 2, &ck, &out, &epochs);
    let deadline = Instant::now() + Duration::from_secs(120);
    while steps_or_none(&ck.join("dense")).is_empty() {
        assert!(Instant::now() < deadline, "no checkpoint within 120 s");
        assert!(child.try_wait().unwrap().is_none(), "the job ended before its first checkpoint");
        std::thread::sleep(Duration::from_millis(20));
    }
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    let stopped = wait(child, Instant::now() + Duration::from_secs(120));
    let e = String::from_utf8_lossy(&stopped.stderr).to_string();
    assert_eq!(stopped.status.code(), Some(143), "{e}");
    let step: u64 = e
        .lines()
        .find_map(|l| l.strip_prefix("error: training stopped after step "))
        .and_then(|l| l.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no stop step in {e}"));
    assert!(step < 300, "stopped before the end: {e}");
    // Both halves of the job hold the step it stopped after.
    let last = |d: &Path| steps(d).last().copied();
    assert_eq!(last(&ck.join("dense")), Some(step), "{e}");
    for k in 0..2 {
        assert_eq!(last(&ck.join(format!("ps-{k}"))), Some(step), "ps:{k}: {e}");
    }
    let second = ok(&train(true, 2, 2, &ck, &out, &epochs));
    assert!(second.contains(&format!("resumed from the checkpoint of step {step}")), "{second}");
    restored_with_pushes(&json(&out), step, &[300, 300]);
}

/// Every ps task of the run `summary` describes was restored at step `restored` and has applied
/// `pushes[i]` pushes of worker `i` over all runs.
fn restored_with_pushes(summary: &serde_json::Value, restored: u64, pushes: &[u64]) {
    let tasks = summary["parameter_servers"]["tasks"].as_array().unwrap();
    assert!(!tasks.is_empty(), "{summary}");
    for t in tasks {
        assert_eq!(t["restored_step"].as_u64(), Some(restored), "{t}");
        for (i, &n) in pushes.iter().enumerate() {
            assert_eq!(t["applied_by_worker"][format!("worker:{i}")].as_u64(), Some(n), "worker:{i}: {t}");
        }
    }
}

/// [`steps`] of a directory that may not exist yet.
fn steps_or_none(dir: &Path) -> Vec<u64> {
    if dir.is_dir() {
        steps(dir)
    } else {
        Vec::new()
    }
}

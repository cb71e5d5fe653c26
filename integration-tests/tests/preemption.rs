//! SIGTERM (what Slurm's `scancel` and time limits, and Kubernetes' evictions, send) and
//! SIGINT, to `strata train` and to `strata launch`: the job finishes its current step, writes a
//! checkpoint, leaves cleanly and exits 128 + the signal; relaunching resumes from that
//! checkpoint and ends bit for bit where an uninterrupted run ends. Real processes, a hard
//! timeout on every wait.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use strata_integration_tests::{strata, strata_command, wait};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("strata-preempt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The step of the checkpoint `latest` names in `ckpt`.
fn latest_step(ckpt: &Path) -> u64 {
    let latest = std::fs::read_to_string(ckpt.join("latest")).unwrap();
    // Its first line names the checkpoint; the second is that line's crc32.
    let name = latest.lines().next().unwrap_or("").trim().rsplit('/').next().unwrap().to_string();
    name.strip_prefix("ckpt-").and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("latest names {latest:?}"))
}

/// Waits until the first checkpoint exists (training is under way), at most 120 s.
fn wait_for_checkpoint(ckpt: &Path, child: &mut Child) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !ckpt.join("latest").exists() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the job ended ({status}) before its first checkpoint");
        }
        assert!(Instant::now() < deadline, "no checkpoint was written");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn run_to_end(mut cmd: Command) -> Output {
    let o = wait(
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap(),
        Instant::now() + Duration::from_secs(240),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    o
}

/// The run to interrupt: long enough that SIGTERM comes mid-training.
const TRAIN: &[&str] =
    &["--no-progress", "--epochs", "60", "--batch", "64", "--hidden", "64", "--optimizer", "adamw", "--seed", "3"];

fn train_command(dir: &Path, extra: &[&str]) -> Command {
    let mut c = strata();
    c.arg("train").args(TRAIN).args(extra).current_dir(dir);
    c
}

#[test]
fn sigterm_to_train_checkpoints_the_current_step_exits_143_and_resumes_bitwise() {
    let dir = tmp("train");
    run_to_end(train_command(&dir, &["--save-params", "uninterrupted.safetensors"]));
    let ckpt = dir.join("ckpt");
    let args = ["--checkpoint-dir", "ckpt", "--checkpoint-every", "20", "--save-params", "resumed.safetensors"];
    let mut child = train_command(&dir, &args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    wait_for_checkpoint(&ckpt, &mut child);
    kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
    let signalled = Instant::now();
    let o = wait(child, signalled + Duration::from_secs(20));
    let took = signalled.elapsed();
    let err = String::from_utf8_lossy(&o.stderr);
    eprintln!("strata train exited {:?} {took:?} after SIGTERM: {}", o.status.code(), err.trim());
    assert_eq!(o.status.code(), Some(143), "{err}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    let step = latest_step(&ckpt);
    assert!(err.contains(&format!("training stopped after step {step}: asked to stop by SIGTERM")), "{err}");
    assert!(!dir.join("resumed.safetensors").exists(), "a stopped run wrote its final parameters");
    // The relaunch resumes from the stop's checkpoint.
    let o = run_to_end(train_command(&dir, &args));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(&format!("resumed from the checkpoint of step {step}")), "{err}");
    let a = std::fs::read(dir.join("uninterrupted.safetensors")).unwrap();
    let b = std::fs::read(dir.join("resumed.safetensors")).unwrap();
    assert!(a == b, "the resumed run's parameters differ from the uninterrupted run's");
    let _ = std::fs::remove_dir_all(&dir);
}

fn launch_command(dir: &Path, extra: &[&str]) -> Command {
    let mut c = strata_command();
    c.env_remove("TF_CONFIG").env_remove("STRATA_CLUSTER_TOKEN").env("STRATA_LOG", "warn");
    c.args(["launch", "--workers", "2", "--", "strata", "train", "--strategy", "multi-worker-mirrored"])
        .args(TRAIN)
        .args(extra)
        .current_dir(dir)
        .stdin(Stdio::null());
    c
}

#[test]
fn sigterm_to_launch_stops_every_worker_at_one_step_with_a_checkpoint_and_resumes_bitwise() {
    let dir = tmp("launch");
    run_to_end(launch_command(&dir, &["--save-params", "uninterrupted.safetensors"]));
    let ckpt = dir.join("ckpt");
    let args = ["--checkpoint-dir", "ckpt", "--checkpoint-every", "20", "--save-params", "resumed.safetensors"];
    let mut launcher = launch_command(&dir, &args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    wait_for_checkpoint(&ckpt, &mut launcher);
    kill(Pid::from_raw(launcher.id() as i32), Signal::SIGTERM).unwrap();
    let signalled = Instant::now();
    let o = wait(launcher, signalled + Duration::from_secs(30));
    let took = signalled.elapsed();
    let err = String::from_utf8_lossy(&o.stderr);
    eprintln!("strata launch exited {:?} {took:?} after SIGTERM:\n{}", o.status.code(), err.trim());
    assert_eq!(o.status.code(), Some(143), "{err}");
    // Within the launcher's grace period (5 s): no task was SIGKILLed.
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(!err.contains("SIGKILL"), "{err}");
    let step = latest_step(&ckpt);
    for task in ["worker:0", "worker:1"] {
        let line = format!("[{task}] error: training stopped after step {step}: asked to stop by SIGTERM");
        assert!(err.contains(&line), "{task} did not stop after step {step}: {err}");
    }
    let o = run_to_end(launch_command(&dir, &args));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(&format!("[worker:0] resumed from the checkpoint of step {step}")), "{err}");
    let a = std::fs::read(dir.join("uninterrupted.safetensors")).unwrap();
    let b = std::fs::read(dir.join("resumed.safetensors")).unwrap();
    assert!(a == b, "the resumed job's parameters differ from the uninterrupted job's");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigint_to_train_without_a_checkpoint_directory_exits_130_at_once() {
    let dir = tmp("sigint");
    let mut child = strata()
        .args(["train", "--no-progress", "--epochs", "100000", "--batch", "64", "--hidden", "64"])
        .args(["--metrics", "m.jsonl"])
        .current_dir(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::fs::metadata(dir.join("m.jsonl")).map_or(0, |m| m.len()) == 0 {
        assert!(Instant::now() < deadline && child.try_wait().unwrap().is_none(), "training did not start");
        std::thread::sleep(Duration::from_millis(5));
    }
    kill(Pid::from_raw(child.id() as i32), Signal::SIGINT).unwrap();
    let signalled = Instant::now();
    let o = wait(child, signalled + Duration::from_secs(20));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert!(signalled.elapsed() < Duration::from_secs(5), "{:?}", signalled.elapsed());
    assert!(err.contains("asked to stop by SIGINT; without --checkpoint-dir nothing was saved"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

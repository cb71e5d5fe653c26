//! `strata compare` with `[network]`: the multi-process runs run on emulated hosts (network
//! namespaces on a bridge, tbf-shaped links), finish with the right number of steps and
//! updates, and leave no namespace and no process behind, whether they end normally or the
//! harness is stopped with SIGTERM; bad input is one line, exit code 2, nothing created.
//!
//! Needs root, `ip` and `tc`: skipped with a message otherwise (a failure with
//! `STRATA_REQUIRE_CLUSTER=1`).

use std::path::Path;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use strata_integration_tests::cluster::{or_skip, Skip};
use strata_integration_tests::{run_compare, strata, wait};

/// The harness takes a machine-wide lock: one test at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const TINY: &str = r#"
[experiment]
name = "tiny-hosts"
hidden = [32]
epochs = 1
global_batch = 128
lr = 0.01
seed = 3
target_accuracy = 0.5
run_timeout = "60s"

[network]
hosts = 2
link = "1gbit"

[[run]]
strategy = "multi-worker-mirrored"
workers = 2

[[run]]
strategy = "parameter-server"
mode = "async"
workers = 2
"#;

fn can_build_hosts() -> Result<(), Skip> {
    if !nix::unistd::geteuid().is_root() {
        return Err(Skip("emulated hosts need root (network namespaces, tc)".into()));
    }
    for tool in ["ip", "tc"] {
        if std::process::Command::new(tool).arg("-V").output().is_err() {
            return Err(Skip(format!("`{tool}` is not installed (Debian: iproute2)")));
        }
    }
    Ok(())
}

fn namespaces_left() -> Vec<String> {
    let out = std::process::Command::new("ip").args(["netns", "list"]).output().expect("ip netns list runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("strata-cx-"))
        .map(str::to_string)
        .collect()
}

/// Processes the harness started and left: their command line names `dir` (the chief's
/// metrics path is there) or their `TF_CONFIG` names the emulated hosts' subnet (every task's).
fn processes_naming(dir: &Path) -> Vec<String> {
    let needle = dir.display().to_string();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) || pid == std::process::id().to_string() {
            continue;
        }
        let read =
            |f: &str| std::fs::read(entry.path().join(f)).map(|b| String::from_utf8_lossy(&b).replace('\0', " "));
        let cmd = read("cmdline").unwrap_or_default();
        let env = read("environ").unwrap_or_default();
        if cmd.contains(&needle) || env.contains("10.213.78.") {
            found.push(format!("{pid}: {cmd}"));
        }
    }
    found
}

#[test]
fn runs_on_emulated_hosts_finish_and_leave_nothing_behind() {
    if or_skip(can_build_hosts()).is_none() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (dir, out_dir, out) = run_compare("tiny-hosts.toml", TINY, Duration::from_secs(90));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stderr}", String::from_utf8_lossy(&out.stdout));
    assert!(stderr.contains("2 emulated hosts"), "{stderr}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(json["network"]["hosts"], 2);
    assert_eq!(json["network"]["rate_bps"], 1e9);
    // The digits' training split is 1,437 examples: 12 global batches of 128 an epoch for
    // MultiWorkerMirrored (one update each), 23 pushes of 64 for the asynchronous parameter
    // server (one update each).
    let runs = json["runs"].as_array().unwrap();
    let want = [("multi-worker-mirrored", 12, 12), ("ps-async", 23, 23)];
    assert_eq!(runs.len(), want.len());
    for (r, (name, steps, updates)) in runs.iter().zip(want) {
        assert_eq!(r["name"], name);
        assert!(r["error"].is_null(), "{name}: {}", r["error"]);
        assert_eq!(r["hosts"], 2, "{name}");
        assert_eq!(r["steps"], steps, "{name}");
        assert_eq!(r["updates"], updates, "{name}");
    }
    // Each task ran in its host's namespace, with its own log.
    for log in ["multi-worker-mirrored.worker-1.log", "ps-async.chief-0.log", "ps-async.worker-1.log"] {
        assert!(out_dir.join("runs").join(log).is_file(), "{log} missing");
    }
    let index = std::fs::read_to_string(out_dir.join("runs/ps-async.log")).unwrap();
    assert!(index.contains("worker-1: host 1 (strata-cx-h2)"), "{index}");
    assert_eq!(namespaces_left(), Vec::<String>::new());
    assert_eq!(processes_naming(dir.path()), Vec::<String>::new());
}

#[test]
fn sigterm_removes_the_hosts_and_the_runs_processes() {
    if or_skip(can_build_hosts()).is_none() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("long.toml");
    // Long enough to be stopped in the middle of its first run.
    let text = TINY.replace("epochs = 1", "epochs = 5000").replace("run_timeout = \"60s\"", "run_timeout = \"300s\"");
    std::fs::write(&file, text).unwrap();
    let out_dir = dir.path().join("out");
    let child = strata()
        .arg("compare")
        .arg(&file)
        .arg("--out")
        .arg(&out_dir)
        .arg("--no-progress")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = out_dir.join("runs/multi-worker-mirrored.jsonl");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(&metrics).is_ok_and(|t| t.contains("\"kind\":\"step\"")) {
        assert!(Instant::now() < deadline, "the run did not start in 60 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(namespaces_left().len(), 3, "the bridge and 2 hosts while the run is on");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    let out = wait(child, Instant::now() + Duration::from_secs(45));
    assert_eq!(out.status.code(), Some(143), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(namespaces_left(), Vec::<String>::new());
    assert_eq!(processes_naming(dir.path()), Vec::<String>::new());
}

#[test]
fn a_bad_link_is_one_line_exit_2_and_nothing_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(&file, TINY.replace("\"1gbit\"", "\"fast\"")).unwrap();
    let out_dir = dir.path().join("out");
    let out = strata().arg("compare").arg(&file).arg("--out").arg(&out_dir).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("line 14: network.link: \"fast\" is not a link rate"), "{stderr}");
    assert!(!out_dir.exists());
}

//! `strata train --strategy parameter-server --compression fp16|bf16`: the workers' pushes and
//! pulls travel in 16 bits and the job trains; PowerSGD (the ring's) and a compression for a
//! strategy with no wire are usage errors (exit code 2) naming what to use.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use strata_integration_tests::{strata, wait};

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn a_bf16_parameter_server_job_trains_a_few_steps() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("out.json");
    let mut cmd = strata();
    cmd.args(["train", "--strategy", "parameter-server", "--ps-tasks", "1", "--workers", "1", "--ps-mode", "sync"])
        .args(["--compression", "bf16", "--epochs", "1", "--max-steps", "3", "--no-progress", "--out"])
        .arg(&out_path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let out = wait(cmd.spawn().unwrap(), Instant::now() + Duration::from_secs(180));
    assert!(out.status.success(), "exit {:?}\nstderr:\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    let summary = read_json(&out_path);
    assert_eq!(summary["strategy"], "parameter-server");
    assert!(summary["final_test_accuracy"].as_f64().unwrap().is_finite(), "{summary}");
    let tasks = summary["parameter_servers"]["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 1);
    assert!(tasks[0]["pushes_applied"].as_u64().unwrap() >= 1, "{summary}");
}

#[test]
fn powersgd_and_compression_without_a_wire_are_usage_errors() {
    let cases = [
        (
            vec!["--strategy", "parameter-server", "--compression", "powersgd:2"],
            "compression powersgd:2 applies to multi-worker-mirrored's ring, not to a parameter server's pushes and pulls; use none, fp16 or bf16 with the parameter server",
        ),
        (vec!["--strategy", "mirrored", "--compression", "fp16"], "(--strategy mirrored has none on a wire); drop it"),
    ];
    for (args, message) in cases {
        let mut cmd = strata();
        cmd.arg("train").args(&args).args(["--no-progress"]).stdout(Stdio::piped()).stderr(Stdio::piped());
        let out = wait(cmd.spawn().unwrap(), Instant::now() + Duration::from_secs(60));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(message), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: one line: {err}");
    }
}

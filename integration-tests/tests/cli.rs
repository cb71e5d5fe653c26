//! The `strata` binary, run as a user runs it.

use std::process::{Command, Output};

fn strata(args: &[&str]) -> Output {
    Command::new(strata_integration_tests::strata_bin()).args(args).output().expect("the strata binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A usage error: exit code 2 and exactly one line on stderr.
fn assert_one_line_error(o: &Output, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "exit code; stderr: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line expected, got: {err}");
    assert!(err.contains(needle), "{needle:?} not in: {err}");
}

fn summary(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("--out was written")).expect("--out is JSON")
}

#[test]
fn the_main_job_with_defaults_reaches_95_percent() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("summary.json");
    let o = strata(&["train", "--no-progress", "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "stderr: {}", stderr(&o));
    let s = summary(&out);
    assert_eq!(s["strategy"], "mirrored");
    assert_eq!(s["replicas"], 2);
    assert_eq!(s["hidden"], serde_json::json!([256, 256]));
    assert_eq!(s["global_batch"], 256);
    let acc = s["final_test_accuracy"].as_f64().unwrap();
    assert!(acc >= 0.95, "test accuracy {acc}");
    assert!(s["examples_per_second"].as_f64().unwrap() > 0.0);
    assert!(s["wall_seconds"].as_f64().unwrap() > 0.0);
    assert_eq!(s["history"].as_array().unwrap().len(), 30);
}

#[test]
fn every_strategy_learns_digits() {
    let dir = tempfile::tempdir().unwrap();
    for (strategy, replicas) in [("one-device", "1"), ("central-storage", "2"), ("mirrored", "4")] {
        let out = dir.path().join(format!("{strategy}.json"));
        let o = strata(&[
            "train",
            "--no-progress",
            "--strategy",
            strategy,
            "--replicas",
            replicas,
            "--epochs",
            "20",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{strategy}: {}", stderr(&o));
        let s = summary(&out);
        assert_eq!(s["replicas"].as_u64().unwrap().to_string(), replicas);
        let acc = s["final_test_accuracy"].as_f64().unwrap();
        assert!(acc >= 0.95, "{strategy}: test accuracy {acc}");
    }
}

#[test]
fn unknown_flags_are_a_one_line_error() {
    assert_one_line_error(&strata(&["train", "--no-such-flag"]), "--no-such-flag");
    assert_one_line_error(&strata(&["train", "--strategy", "parameter-sever"]), "parameter-sever");
    assert_one_line_error(&strata(&["train", "--hidden", "12,x"]), "'x'");
}

#[test]
fn a_missing_data_file_is_a_one_line_error() {
    assert_one_line_error(&strata(&["train", "--data", "/nonexistent/digits.csv.gz"]), "/nonexistent/digits.csv.gz");
}

#[test]
fn a_corrupt_data_file_is_a_one_line_error() {
    let dir = tempfile::tempdir().unwrap();
    let gz = dir.path().join("broken.csv.gz");
    std::fs::write(&gz, [0x1f, 0x8b, 8, 0, 1, 2, 3, 4]).unwrap();
    assert_one_line_error(&strata(&["train", "--data", gz.to_str().unwrap()]), "gzip");
    let csv = dir.path().join("short.csv");
    std::fs::write(&csv, "1,2,3\n").unwrap();
    assert_one_line_error(&strata(&["train", "--data", csv.to_str().unwrap()]), "line 1");
}

#[test]
fn zero_replicas_is_a_one_line_error() {
    assert_one_line_error(&strata(&["train", "--replicas", "0"]), "at least one replica");
    assert_one_line_error(&strata(&["train", "--strategy", "one-device", "--replicas", "3"]), "one-device");
    assert_one_line_error(&strata(&["train", "--batch", "2", "--replicas", "4"]), "--batch 2");
}

#[test]
fn the_timeline_shows_every_phase_of_every_replica() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.json");
    let o = strata(&[
        "train",
        "--no-progress",
        "--epochs",
        "1",
        "--replicas",
        "2",
        "--bucket-mib",
        "0.1",
        "--timeline",
        trace.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    for replica in 0..2 {
        for name in ["forward", "backward", "bucket 0", "bucket 1", "optimizer"] {
            assert!(
                events.iter().any(|e| e["tid"] == replica && e["name"] == name && e["ph"] == "X"),
                "no {name} event for replica {replica}"
            );
        }
    }
}

#[test]
fn devices_lists_the_cpu() {
    let o = strata(&["devices"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("CPU"), "{text}");
}

/// Asking for GPUs where there are none (this test machine: no driver, and the default build has
/// no GPU support) is one line that says what is missing, with exit code 2: never a panic.
#[test]
fn gpus_without_cuda_are_a_one_line_error() {
    for strategy in ["mirrored", "central-storage"] {
        let o = strata(&["train", "--strategy", strategy, "--gpus", "2", "--epochs", "1", "--no-progress"]);
        let err = stderr(&o);
        let needle = if cfg!(feature = "cuda") { "no CUDA driver found" } else { "rebuild with `--features cuda`" };
        if cfg!(feature = "cuda") && strata_cuda::probe::driver().is_ok() {
            continue; // a machine with a driver: the GPU tests cover it
        }
        assert_one_line_error(&o, needle);
        assert!(!err.contains("panicked"), "{err}");
    }
    let o = strata(&["train", "--gpus", "0", "--epochs", "1"]);
    assert_one_line_error(&o, "--gpus 0 asks for no GPU; pass 1 or more");
    // A multi-worker task holds one GPU, and says so before it looks for its cluster.
    let o = strata(&["train", "--strategy", "multi-worker-mirrored", "--gpus", "2", "--epochs", "1"]);
    assert_one_line_error(&o, "a worker task holds one GPU; start one task per GPU");
    if !(cfg!(feature = "cuda") && strata_cuda::probe::driver().is_ok()) {
        let o = strata(&["train", "--strategy", "multi-worker-mirrored", "--gpus", "1", "--epochs", "1"]);
        let needle = if cfg!(feature = "cuda") { "no CUDA driver found" } else { "rebuild with `--features cuda`" };
        assert_one_line_error(&o, needle);
    }
    let o = strata(&["train", "--gpus", "1", "--cross-device-ops", "fastest"]);
    assert_one_line_error(&o, "\"fastest\" is not one of auto, nccl, kernels, cpu");
}

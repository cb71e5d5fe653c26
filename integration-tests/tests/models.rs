//! `strata train --model cnn` and `--model transformer`, run as a user runs them (short
//! runs), 2-worker MultiWorkerMirrored jobs training the transformer and the ctr model with
//! real processes (hard timeouts), and the refusals of flags that do not apply to a model.

use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use strata_integration_tests::{free_ports, strata, wait};

fn run(args: &[&str]) -> Output {
    let child = strata().args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("strata runs");
    wait(child, Instant::now() + Duration::from_secs(240))
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn summary(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("--out was written")).expect("--out is JSON")
}

/// A usage error: exit code 2 and exactly one line on stderr.
fn assert_one_line_error(o: &Output, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "exit code; stderr: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line expected, got: {err}");
    assert!(err.contains(needle), "{needle:?} not in: {err}");
}

#[test]
fn the_cnn_trains_under_mirrored() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cnn.json");
    let o = run(&[
        "train",
        "--model",
        "cnn",
        "--strategy",
        "mirrored",
        "--epochs",
        "4",
        "--batch",
        "64",
        "--no-progress",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "stderr: {}", stderr(&o));
    let s = summary(&out);
    assert_eq!(s["model"], "cnn");
    assert_eq!(s["strategy"], "mirrored");
    assert_eq!(s["parameters"], 13_706);
    assert!(s.get("hidden").is_none(), "{s}");
    let acc = s["final_test_accuracy"].as_f64().unwrap();
    assert!(acc >= 0.85, "test accuracy {acc} after 4 epochs");
}

#[test]
fn the_transformer_trains_and_samples() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("transformer.json");
    let o = run(&[
        "train",
        "--model",
        "transformer",
        "--strategy",
        "central-storage",
        "--steps",
        "4",
        "--batch",
        "8",
        "--sample",
        "40",
        "--no-progress",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "stderr: {}", stderr(&o));
    let s = summary(&out);
    assert_eq!(s["model"], "transformer");
    assert_eq!(s["global_batch"], 8);
    assert_eq!(s["parameters"], 816_705);
    let loss = s["validation_loss"].as_f64().unwrap();
    assert!(loss.is_finite() && loss < 4.6, "validation loss {loss} nats per character");
    assert!(s["tokens_per_second"].as_f64().unwrap() > 0.0);
    assert!(s.get("final_test_accuracy").is_none(), "{s}");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("transformer validation loss"), "{stdout}");
    let sample = stdout.split_once("temperature 0.8):\n").map(|(_, t)| t).unwrap_or_default();
    assert_eq!(sample.trim_end_matches('\n').chars().count(), 40, "{stdout}");
}

#[test]
fn two_workers_train_the_transformer_to_the_same_parameters() {
    let ports = free_ports(2);
    let workers: Vec<String> = ports.iter().map(|p| format!("\"127.0.0.1:{p}\"")).collect();
    let deadline = Instant::now() + Duration::from_secs(240);
    let children: Vec<_> = (0..2)
        .map(|i| {
            let tf_config =
                format!(r#"{{"cluster":{{"worker":[{}]}},"task":{{"type":"worker","index":{i}}}}}"#, workers.join(","));
            strata()
                .args(["train", "--strategy", "multi-worker-mirrored", "--model", "transformer", "--no-progress"])
                .args(["--steps", "3", "--batch", "8", "--collective-timeout", "180"])
                .env("TF_CONFIG", tf_config)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = children.into_iter().map(|c| wait(c, deadline)).collect();
    let mut digests = Vec::new();
    for (i, o) in outs.iter().enumerate() {
        let err = stderr(o);
        assert!(o.status.success(), "worker {i} failed: {err}");
        let digest = err.lines().find_map(|l| l.split_once("parameter digest ").map(|(_, d)| d.to_string()));
        digests.push(digest.unwrap_or_else(|| panic!("worker {i} printed no digest: {err}")));
    }
    assert_eq!(digests[0], digests[1], "the workers end with different parameters");
    assert!(String::from_utf8_lossy(&outs[0].stdout).contains("transformer validation loss"));
}

/// `--model ctr` under MultiWorkerMirrored with real processes: both workers end with the same
/// parameters, the chief prints the AUCs; on parameter servers it is refused in one line.
#[test]
fn two_workers_train_the_ctr_model_to_the_same_parameters() {
    let ports = free_ports(2);
    let workers: Vec<String> = ports.iter().map(|p| format!("\"127.0.0.1:{p}\"")).collect();
    let deadline = Instant::now() + Duration::from_secs(240);
    let children: Vec<_> = (0..2)
        .map(|i| {
            let tf_config =
                format!(r#"{{"cluster":{{"worker":[{}]}},"task":{{"type":"worker","index":{i}}}}}"#, workers.join(","));
            strata()
                .args(["train", "--strategy", "multi-worker-mirrored", "--model", "ctr", "--no-progress"])
                .args(["--embedding-rows", "2000", "--train-records", "5000", "--test-records", "2000"])
                .args(["--collective-timeout", "180"])
                .env("TF_CONFIG", tf_config)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = children.into_iter().map(|c| wait(c, deadline)).collect();
    let mut digests = Vec::new();
    for (i, o) in outs.iter().enumerate() {
        let err = stderr(o);
        assert!(o.status.success(), "worker {i} failed: {err}");
        let digest = err.lines().find_map(|l| l.split_once("parameter digest ").map(|(_, d)| d.to_string()));
        digests.push(digest.unwrap_or_else(|| panic!("worker {i} printed no digest: {err}")));
    }
    assert_eq!(digests[0], digests[1], "the workers end with different parameters");
    let chief = String::from_utf8_lossy(&outs[0].stdout).into_owned();
    assert!(chief.contains("ctr test auc") && chief.contains("planted best"), "{chief}");
    assert_one_line_error(
        &run(&["train", "--model", "ctr", "--strategy", "parameter-server", "--replicas", "2"]),
        "a parameter-server worker with embedding tables runs one replica",
    );
}

#[test]
fn flags_that_do_not_apply_to_the_model_are_one_line_errors() {
    assert_one_line_error(&run(&["train", "--model", "cnn", "--hidden", "8"]), "--hidden applies to --model mlp");
    assert_one_line_error(&run(&["train", "--steps", "3"]), "--steps applies to --model transformer");
    assert_one_line_error(
        &run(&["train", "--model", "cnn", "--sample", "3"]),
        "--sample applies to --model transformer",
    );
    assert_one_line_error(&run(&["train", "--model", "transformer", "--data", "x.csv"]), "--data applies to");
    assert_one_line_error(&run(&["train", "--model", "rnn"]), "rnn");
    assert_one_line_error(&run(&["train", "--width", "64"]), "--width applies to --model transformer");
    assert_one_line_error(
        &run(&["train", "--model", "cnn", "--layers", "2"]),
        "--layers applies to --model transformer",
    );
    assert_one_line_error(&run(&["train", "--heads", "2"]), "--heads applies to --model transformer");
    // The library's refusals of a shape that cannot be built, before anything starts.
    let transformer = |flags: &[&str]| run(&[&["train", "--model", "transformer"], flags].concat());
    assert_one_line_error(&transformer(&["--heads", "3"]), "a width of 128 does not split into 3 heads");
    assert_one_line_error(&transformer(&["--layers", "0"]), "of at least 1");
    assert_one_line_error(&transformer(&["--width", "4096", "--layers", "64"]), "parameters, the limit");
}

/// `--width`, `--layers` and `--heads` shape the transformer under every kind of strategy: the
/// summary counts the parameters of that shape (12 W^2 + 10 W per block, embeddings and head
/// besides: 31,553 at width 32, 2 layers, 65 characters, a context of 64), and a
/// parameter-server job's processes build the same shape from the job they are given.
#[test]
fn the_transformers_shape_is_set_by_flags() {
    let dir = tempfile::tempdir().unwrap();
    let shape = ["--model", "transformer", "--width", "32", "--layers", "2", "--heads", "4"];
    let short = ["--steps", "3", "--batch", "8", "--epochs", "1", "--no-progress"];
    for (name, strategy) in [
        ("one-device", &["--strategy", "one-device"][..]),
        ("mirrored", &["--strategy", "mirrored"][..]),
        ("ps", &["--strategy", "parameter-server", "--ps-tasks", "1", "--workers", "1"][..]),
    ] {
        let out = dir.path().join(format!("{name}.json"));
        let o = run(&[&["train"], &shape[..], &short[..], strategy, &["--out", out.to_str().unwrap()]].concat());
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let s = summary(&out);
        assert_eq!(s["parameters"], 31_553, "{name}: {s}");
        assert!(String::from_utf8_lossy(&o.stdout).contains("transformer validation loss"), "{name}");
    }
}

//! The parameter-server job trains every model: `strata train --strategy parameter-server
//! --model transformer` (1 ps task, 2 workers, async and sync) and `--model cnn` with real
//! processes, counting the updates the ps task applied and the records the coordinator wrote;
//! `strata compare` on a transformer experiment (`model`, `target_loss`); and `hidden` refused
//! for another model, naming its line. Every process has a hard deadline.

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use strata_integration_tests::{strata, wait};

/// ln(65): the loss of a uniform guess over Tiny Shakespeare's characters.
const UNIFORM_LOSS: f64 = 4.174;

fn run(args: &[&str], limit: Duration) -> Output {
    let child = strata().args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("strata runs");
    wait(child, Instant::now() + limit)
}

fn ok(o: &Output) {
    assert!(
        o.status.success(),
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("written")).expect("JSON")
}

/// The metrics file's records: (steps, evals).
fn records(path: &Path) -> (Vec<serde_json::Value>, Vec<serde_json::Value>) {
    let text = std::fs::read_to_string(path).expect("--metrics was written");
    let all: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect();
    all.into_iter().partition(|r| r["kind"] == "step")
}

/// Trains the transformer on 1 ps task and 2 workers; returns the summary and the records.
fn transformer(
    mode: &str,
    epochs: usize,
    steps: usize,
) -> (serde_json::Value, Vec<serde_json::Value>, Vec<serde_json::Value>) {
    let dir = tempfile::tempdir().unwrap();
    let (out, metrics) = (dir.path().join("out.json"), dir.path().join("metrics.jsonl"));
    let (epochs, steps) = (epochs.to_string(), steps.to_string());
    let o = run(
        &[
            "train",
            "--strategy",
            "parameter-server",
            "--model",
            "transformer",
            "--ps-tasks",
            "1",
            "--workers",
            "2",
            "--ps-mode",
            mode,
            "--epochs",
            &epochs,
            "--steps",
            &steps,
            "--batch",
            "8",
            "--no-progress",
            "--out",
            out.to_str().unwrap(),
            "--metrics",
            metrics.to_str().unwrap(),
        ],
        Duration::from_secs(240),
    );
    ok(&o);
    assert!(String::from_utf8_lossy(&o.stdout).contains("transformer validation loss"));
    let (steps, evals) = records(&metrics);
    (json(&out), steps, evals)
}

/// The summary's and the records' validation losses: finite, below a uniform guess, equal.
fn check_loss(summary: &serde_json::Value, evals: &[serde_json::Value], below: f64) {
    assert_eq!(summary["model"], "transformer");
    assert_eq!(summary["parameters"], 816_705);
    assert!(summary.get("final_test_accuracy").is_none(), "{summary}");
    let loss = summary["validation_loss"].as_f64().unwrap();
    assert!(loss.is_finite() && loss < below, "validation loss {loss} nats per character, not below {below}");
    let last = evals.last().expect("an eval record");
    assert!(last.get("accuracy").is_none(), "{last}");
    assert!((last["validation_loss"].as_f64().unwrap() - loss).abs() < 1e-5, "{last} vs {loss}");
    assert!(summary["tokens_per_second"].as_f64().unwrap() > 0.0);
}

#[test]
fn the_transformer_trains_on_parameter_servers_in_async_mode() {
    // 1 epoch of 16 worker steps: 16 pushes, each applied once.
    let (s, steps, evals) = transformer("async", 1, 16);
    let t = &s["parameter_servers"]["tasks"][0];
    assert_eq!((t["pushes_applied"].as_u64(), t["version"].as_u64()), (Some(16), Some(16)), "{t}");
    assert_eq!(s["parameter_servers"]["mode"], "async", "{s}");
    assert_eq!(steps.len(), 16);
    assert_eq!(evals.len(), 1);
    assert_eq!(evals[0]["updates"], 16);
    assert_eq!(s["history"].as_array().unwrap().len(), 1);
    check_loss(&s, &evals, UNIFORM_LOSS - 0.2);
}

#[test]
fn the_transformer_trains_on_parameter_servers_in_sync_mode() {
    // 1 epoch of 16 worker steps: 8 rounds of one push per worker, 16 pushes applied.
    let (s, steps, evals) = transformer("sync", 1, 16);
    let t = &s["parameter_servers"]["tasks"][0];
    assert_eq!((t["rounds"].as_u64(), t["pushes_applied"].as_u64()), (Some(8), Some(16)), "{t}");
    assert_eq!(s["parameter_servers"]["mode"].as_str().map(|m| m.starts_with("sync")), Some(true), "{s}");
    assert_eq!(steps.len(), 16);
    assert_eq!(evals.len(), 1);
    assert_eq!(evals[0]["updates"], 8);
    check_loss(&s, &evals, UNIFORM_LOSS - 0.2);
}

#[test]
fn the_cnn_trains_on_parameter_servers_in_every_mode() {
    // 6 epochs of ceil(1438 / 64) = 23 worker steps, each applied once (a stale push refused is
    // computed again and applied then); sync: rounds of 2, the last of each epoch of 1.
    for (mode, rounds, least) in [("async", 0, 0.7), ("sync", 72, 0.85), ("stale", 0, 0.7)] {
        let dir = tempfile::tempdir().unwrap();
        let (out, metrics) = (dir.path().join("out.json"), dir.path().join("metrics.jsonl"));
        let o = run(
            &[
                "train",
                "--strategy",
                "parameter-server",
                "--model",
                "cnn",
                "--ps-tasks",
                "1",
                "--workers",
                "2",
                "--ps-mode",
                mode,
                "--staleness",
                "1",
                "--epochs",
                "6",
                "--batch",
                "64",
                "--no-progress",
                "--out",
                out.to_str().unwrap(),
                "--metrics",
                metrics.to_str().unwrap(),
            ],
            Duration::from_secs(240),
        );
        ok(&o);
        let s = json(&out);
        assert_eq!((s["model"].as_str(), s["parameters"].as_u64()), (Some("cnn"), Some(13_706)));
        let t = &s["parameter_servers"]["tasks"][0];
        assert_eq!((t["pushes_applied"].as_u64(), t["rounds"].as_u64()), (Some(138), Some(rounds)), "{mode}: {t}");
        let (steps, evals) = records(&metrics);
        assert_eq!((steps.len(), evals.len()), (138, 6), "{mode}");
        let acc = s["final_test_accuracy"].as_f64().unwrap();
        assert!(acc >= least, "{mode}: cnn test accuracy {acc} after 6 epochs on parameter servers");
        let last = evals[5]["accuracy"].as_f64().unwrap();
        assert!((last - acc).abs() < 1e-6 && evals[5].get("validation_loss").is_none(), "{mode}: {:?}", evals[5]);
    }
}

const TRANSFORMER_EXPERIMENT: &str = r#"
[experiment]
name = "tiny-transformer"
model = "transformer"
steps = 6
epochs = 1
global_batch = 8
lr = 0.003
seed = 1
target_loss = 4.1
run_timeout = "200s"

[[run]]
strategy = "one-device"

[[run]]
strategy = "parameter-server"
mode = "sync"
workers = 2
"#;

#[test]
fn compare_runs_a_transformer_experiment_against_a_loss_target() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("t.toml");
    std::fs::write(&file, TRANSFORMER_EXPERIMENT).unwrap();
    let out_dir = dir.path().join("out");
    let args = ["compare", file.to_str().unwrap(), "--out", out_dir.to_str().unwrap(), "--no-progress"];
    let o = run(&args, Duration::from_secs(420));
    ok(&o);
    let summary = json(&out_dir.join("summary.json"));
    assert_eq!(summary["experiment"]["model"], "transformer");
    assert_eq!(summary["experiment"]["target_loss"], 4.1);
    let runs = summary["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for r in runs {
        assert!(r["error"].is_null(), "{r}");
        let loss = r["final_validation_loss"].as_f64().unwrap();
        assert!(loss.is_finite(), "{r}");
        assert!(r["final_accuracy"].is_null(), "{r}");
        // Reached exactly when the last evaluation is at or below the target.
        assert_eq!(r["status"] == "ok", loss <= 4.1, "{r}");
        assert_eq!(r["time_to_target_s"].is_number(), loss <= 4.1, "{r}");
    }
    // The parameter-server run scheduled steps x workers worker steps of global_batch / workers.
    let ps = runs.iter().find(|r| r["name"] == "ps-sync").unwrap();
    assert_eq!((ps["steps"].as_u64(), ps["updates"].as_u64()), (Some(12), Some(6)), "{ps}");
    assert!(ps["final_validation_loss"].as_f64().unwrap() < UNIFORM_LOSS - 0.2, "{ps}");
    let csv = std::fs::read_to_string(out_dir.join("runs.csv")).unwrap();
    assert!(csv.lines().next().unwrap().ends_with(",accuracy,validation_loss,auc"), "{csv}");
    let report = std::fs::read_to_string(out_dir.join("REPORT.md")).unwrap();
    assert!(report.contains("a validation loss of 4.10 nats per character"), "{report}");
}

#[test]
fn hidden_with_another_model_is_refused_naming_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    for (model, line) in [("cnn", 5), ("transformer", 5)] {
        let text = TRANSFORMER_EXPERIMENT
            .replace("model = \"transformer\"", &format!("model = \"{model}\"\nhidden = [16]"))
            .replace("target_loss = 4.1", if model == "cnn" { "target_accuracy = 0.5" } else { "target_loss = 4.1" })
            .replace("steps = 6\n", if model == "cnn" { "" } else { "steps = 6\n" });
        std::fs::write(&file, text).unwrap();
        let o = run(&["compare", file.to_str().unwrap()], Duration::from_secs(30));
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line expected: {err}");
        let want =
            format!("bad.toml line {line}: experiment.hidden: applies to model = \"mlp\", not model = \"{model}\"");
        assert!(err.contains(&want), "{want:?} not in: {err}");
    }
    // And `strata train` refuses --hidden with another model, on parameter servers too.
    let o = run(
        &["train", "--strategy", "parameter-server", "--model", "transformer", "--hidden", "8"],
        Duration::from_secs(30),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--hidden applies to --model mlp"), "{err}");
}

/// The click model on parameter servers in real processes (2 ps tasks, 2 workers, a table of
/// 200,000 rows): its table lives on the ps tasks in shards (neither the coordinator nor a
/// worker holds it), a step pulls exactly its batch's distinct rows and the dense variables,
/// and the job learns (test AUC well above chance, below the planted best), in every mode.
#[test]
fn the_ctr_model_trains_with_its_table_on_the_ps_tasks() {
    for mode in ["async", "sync"] {
        let dir = tempfile::tempdir().unwrap();
        let (out, metrics) = (dir.path().join("out.json"), dir.path().join("metrics.jsonl"));
        let o = run(
            &[
                "train",
                "--strategy",
                "parameter-server",
                "--model",
                "ctr",
                "--ps-tasks",
                "2",
                "--workers",
                "2",
                "--ps-mode",
                mode,
                "--embedding-rows",
                "200000",
                "--train-records",
                "51200",
                "--test-records",
                "4000",
                "--no-progress",
                "--out",
                out.to_str().unwrap(),
                "--metrics",
                metrics.to_str().unwrap(),
            ],
            Duration::from_secs(240),
        );
        ok(&o);
        let s = json(&out);
        let (auc, best) = (s["final_test_auc"].as_f64().unwrap(), s["best_test_auc"].as_f64().unwrap());
        assert!(auc > 0.65 && auc < best, "{mode}: test auc {auc}, planted best {best}");
        let tasks = s["parameter_servers"]["tasks"].as_array().unwrap();
        assert_eq!(tasks.len(), 2);
        // Each task holds rows of the table (created as batches touched them), far fewer
        // bytes than the whole 200,000 x 16 table and its Adagrad slot on either.
        let whole = 200_000u64 * 16 * 4 * 2;
        for t in tasks {
            let bytes = t["bytes"].as_u64().unwrap();
            assert!(bytes > 0 && bytes < whole, "{mode}: {t}");
        }
        let (steps, _) = records(&metrics);
        assert_eq!(steps.len(), 200, "{mode}: 51,200 records in steps of 256");
        // A step pulls the dense variables and its distinct rows (at most 26 x 256 of 16).
        let dense = s["dense_gradient_bytes_per_step"].as_u64().unwrap();
        for r in &steps {
            let pulled = r["bytes_received"].as_u64().unwrap();
            assert!(pulled > dense && pulled <= dense + 26 * 256 * 16 * 4, "{mode}: {r}");
            assert_eq!((pulled - dense) % (16 * 4), 0, "{mode}: whole rows: {r}");
        }
    }
}

/// Every strategy takes the click records in the same order (record `i` in step `i / batch`),
/// so a parameter-server job with one asynchronous worker (2 ps tasks, real processes: no
/// push is ever stale) ends on one device's bits: the dense layers saved by both are the same
/// bytes, and so is the test AUC, under Adagrad on the table's rows and on the dense layers;
/// so does the job at either `--stale-rate` (inverse, the click model's default, and constant).
#[test]
fn the_ctr_model_on_one_async_worker_ends_on_one_device_s_bits() {
    let dir = tempfile::tempdir().unwrap();
    let common = [
        "train",
        "--model",
        "ctr",
        "--embedding-rows",
        "200000",
        "--train-records",
        "25600",
        "--test-records",
        "2000",
        "--batch",
        "256",
        "--optimizer",
        "adagrad",
        "--lr",
        "0.05",
        "--table-optimizer",
        "adagrad",
        "--table-lr",
        "0.05",
        "--no-progress",
    ];
    let mut runs = Vec::new();
    for (name, strategy) in [
        ("one", &["--strategy", "one-device"][..]),
        ("ps", &["--strategy", "parameter-server", "--ps-tasks", "2", "--workers", "1"][..]),
        // A worker of its own never pushes stale: the inverse rate (the click model's default)
        // is the rate, and so is the constant one.
        (
            "constant",
            &["--strategy", "parameter-server", "--ps-tasks", "2", "--workers", "1", "--stale-rate", "constant"][..],
        ),
    ] {
        let (out, params) = (dir.path().join(format!("{name}.json")), dir.path().join(format!("{name}.safetensors")));
        let mut args = common.to_vec();
        args.extend_from_slice(strategy);
        args.extend_from_slice(&["--out", out.to_str().unwrap(), "--save-params", params.to_str().unwrap()]);
        ok(&run(&args, Duration::from_secs(240)));
        let summary = json(&out);
        if name != "one" {
            let want = if name == "constant" { "constant" } else { "inverse" };
            assert_eq!(summary["parameter_servers"]["stale_rate"], want, "the ps tasks' rate of stale pushes");
        }
        runs.push((summary["final_test_auc"].as_f64().unwrap(), std::fs::read(&params).unwrap()));
    }
    for (name, run) in ["one async worker", "one async worker, --stale-rate constant"].iter().zip(&runs[1..]) {
        assert_eq!(runs[0].0.to_bits(), run.0.to_bits(), "test auc: one device {}, {name} {}", runs[0].0, run.0);
        assert!(runs[0].1 == run.1, "the dense layers of {name} differ from one device's");
    }
}

/// Hybrid training of the click model in real processes (2 ps tasks, 2 workers, this command
/// worker 0 of them): the table on the ps tasks, trained asynchronously row by row, the dense
/// layers all-reduced, so both workers end with the same dense parameters (one digest); each
/// ps task applies exactly one push of rows per worker per step; a step pulls whole rows, at
/// most the batch's distinct ones; the job learns and its ps tasks exit when it ends.
#[test]
fn the_ctr_model_trains_hybrid_its_table_async_on_the_ps_tasks_its_dense_layers_all_reduced() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.json");
    let o = run(
        &[
            "train",
            "--strategy",
            "parameter-server",
            "--ps-mode",
            "hybrid",
            "--model",
            "ctr",
            "--ps-tasks",
            "2",
            "--workers",
            "2",
            "--embedding-rows",
            "200000",
            "--train-records",
            "51200",
            "--test-records",
            "4000",
            "--no-progress",
            "--out",
            out.to_str().unwrap(),
        ],
        Duration::from_secs(240),
    );
    ok(&o);
    let stderr = String::from_utf8_lossy(&o.stderr);
    let digests: Vec<&str> =
        stderr.lines().filter_map(|l| l.split("parameter digest ").nth(1)).map(str::trim).collect();
    assert_eq!(digests.len(), 2, "{stderr}");
    assert_eq!(digests[0], digests[1], "the dense layers are synchronous: {stderr}");
    for k in 0..2 {
        assert!(stderr.contains(&format!("ps:{k}: the hybrid job finished training")), "{stderr}");
    }
    let s = json(&out);
    assert_eq!(s["parameter_servers"]["mode"], "hybrid");
    let (auc, best) = (s["final_test_auc"].as_f64().unwrap(), s["best_test_auc"].as_f64().unwrap());
    assert!(auc > 0.65 && auc < best, "test auc {auc}, planted best {best}");
    // 51,200 records in global steps of 256: 200 steps, each worker's half a push per task.
    for t in s["parameter_servers"]["tasks"].as_array().unwrap() {
        let by = &t["applied_by_worker"];
        assert_eq!((by["worker:0"].as_u64(), by["worker:1"].as_u64()), (Some(200), Some(200)), "{t}");
        assert!(t["bytes"].as_u64().unwrap() < 200_000 * 16 * 4 * 2, "only touched rows: {t}");
    }
    // A worker's step pulls whole rows of 16 f32, at most 26 per example of its 128.
    let pulled = s["table_bytes_pulled_per_step"].as_f64().unwrap();
    assert!(pulled > 0.0 && pulled <= (26 * 128 * 16 * 4) as f64, "{pulled}");
    let dense = s["dense_gradient_bytes_per_step"].as_u64().unwrap();
    assert!(dense < 200_000 * 16 * 4, "the table is not all-reduced: {dense}");
}

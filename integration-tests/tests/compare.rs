//! `strata compare` with real processes: every run is `strata train`, so the accuracy the
//! harness records is the one `strata train` gives for the same strategy and seed; a run that
//! fails is reported with its error and the others go on; a malformed file names the field
//! and the line.

use std::process::Stdio;
use std::time::{Duration, Instant};

use strata_integration_tests::{run_compare, strata, wait};

const EXPERIMENT: &str = r#"
[experiment]
name = "tiny"
hidden = [32]
epochs = 3
global_batch = 128
lr = 0.01
optimizer = "adamw"
seed = 7
target_accuracy = 0.5
run_timeout = "120s"

[[run]]
strategy = "one-device"

[[run]]
strategy = "mirrored"
replicas = 2

[[run]]
strategy = "central-storage"
replicas = 2

[[run]]
strategy = "multi-worker-mirrored"
workers = 2

[[run]]
strategy = "parameter-server"
mode = "sync"
workers = 2

[[run]]
name = "cut-short"
strategy = "parameter-server"
mode = "async"
workers = 2
timeout = "1ms"

[injection]
network_delay = "200us"
"#;

fn accuracy_of_train(args: &[&str], dir: &std::path::Path, name: &str) -> f32 {
    let out_path = dir.join(format!("{name}.train.json"));
    let mut cmd = strata();
    cmd.arg("train").args(args).args([
        "--hidden",
        "32",
        "--epochs",
        "3",
        "--batch",
        "128",
        "--lr",
        "0.01",
        "--seed",
        "7",
        "--no-progress",
        "--network-delay",
        "200us",
        "--out",
    ]);
    cmd.arg(&out_path).stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = wait(cmd.spawn().unwrap(), Instant::now() + Duration::from_secs(120));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out_path).unwrap()).unwrap();
    v["final_test_accuracy"].as_f64().unwrap() as f32
}

#[test]
fn the_harness_records_what_strata_train_gives_and_survives_a_failed_run() {
    let (dir, out_dir, out) = run_compare("tiny.toml", EXPERIMENT, Duration::from_secs(300));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for f in ["runs.csv", "summary.json", "REPORT.md", "loss_vs_time.png", "accuracy_vs_steps.svg"] {
        assert!(out_dir.join(f).is_file(), "{f} missing");
    }
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("summary.json")).unwrap()).unwrap();
    let runs = summary["runs"].as_array().expect("summary.json has runs");
    let run = |name: &str| runs.iter().find(|r| r["name"] == name).unwrap_or_else(|| panic!("no run {name}"));

    // The failed run is in the table with its error, and every other run finished.
    let cut = run("cut-short");
    assert_eq!(cut["status"], "failed");
    assert!(cut["error"].as_str().unwrap().contains("time limit"), "{cut}");
    let report = std::fs::read_to_string(out_dir.join("REPORT.md")).unwrap();
    assert!(report.contains("cut-short") && report.contains("time limit"), "{report}");
    for name in ["one-device", "mirrored", "central-storage", "multi-worker-mirrored", "ps-sync"] {
        assert_ne!(run(name)["status"], "failed", "{name}: {}", run(name));
    }

    // Deterministic strategies: the harness's final accuracy is strata train's, to the bit
    // of the f32 it printed.
    let harness = |name: &str| run(name)["final_accuracy"].as_f64().unwrap() as f32;
    let d = dir.path();
    assert_eq!(harness("one-device"), accuracy_of_train(&["--strategy", "one-device"], d, "one"));
    assert_eq!(harness("mirrored"), accuracy_of_train(&["--strategy", "mirrored", "--replicas", "2"], d, "mir"));
    assert_eq!(
        harness("central-storage"),
        accuracy_of_train(&["--strategy", "central-storage", "--replicas", "2"], d, "cs")
    );
    // The runs' own summaries (written by strata train inside the harness) agree too.
    for name in ["one-device", "mirrored", "central-storage", "multi-worker-mirrored", "ps-sync"] {
        let own: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out_dir.join(format!("runs/{name}.json"))).unwrap()).unwrap();
        assert_eq!(own["final_test_accuracy"].as_f64().unwrap() as f32, harness(name), "{name}");
    }

    // runs.csv: per-step records with the multi-process runs' bytes, and staleness 0 for
    // sync parameter servers.
    let csv = std::fs::read_to_string(out_dir.join("runs.csv")).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let col = |n: &str| header.iter().position(|h| *h == n).unwrap_or_else(|| panic!("no column {n}"));
    let rows: Vec<Vec<&str>> = csv.lines().skip(1).map(|l| l.split(',').collect()).collect();
    let steps = |run: &str| -> Vec<&Vec<&str>> {
        rows.iter().filter(|r| r[col("run")] == run && r[col("kind")] == "step").collect()
    };
    // 1437 training examples (80% of 1797) at 128 a step: 12 steps an epoch.
    assert_eq!(steps("one-device").len(), 36);
    assert_eq!(steps("multi-worker-mirrored").len(), 36);
    assert!(steps("one-device").iter().all(|r| r[col("bytes_sent")] == "0"));
    assert!(steps("multi-worker-mirrored").iter().all(|r| r[col("bytes_sent")].parse::<u64>().unwrap() > 0));
    let ps = steps("ps-sync");
    assert_eq!(ps.len(), 69, "two workers push 64 examples each: 23 pushes an epoch");
    assert!(ps.iter().all(|r| r[col("staleness")] == "0"));
    assert!(stdout.contains("report:"));
}

#[test]
fn a_malformed_experiment_names_the_field_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(
        &file,
        EXPERIMENT.replace(
            "workers = 2\n\n[[run]]\nstrategy = \"parameter-server\"\nmode = \"sync\"",
            "workers = 0\n\n[[run]]\nstrategy = \"parameter-server\"\nmode = \"sync\"",
        ),
    )
    .unwrap();
    let out = wait(
        strata().arg("compare").arg(&file).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap(),
        Instant::now() + Duration::from_secs(30),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("bad.toml line 26: run[3].workers: must be at least 1"), "{err}");
    // A run that is not in the file.
    std::fs::write(&file, EXPERIMENT).unwrap();
    for simulate in [false, true] {
        let mut cmd = strata();
        cmd.arg("compare").arg(&file).args(["--only", "mirrored,warp-drive"]);
        if simulate {
            cmd.arg("--simulate");
        }
        let out = wait(
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap(),
            Instant::now() + Duration::from_secs(30),
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("--only \"warp-drive\": no such run; the runs are one-device, mirrored"), "{err}");
    }
}

const LOST_WORKER: &str = r#"
[experiment]
name = "lost"
hidden = [64]
epochs = 6
global_batch = 48
lr = 0.05
optimizer = "sgd"
seed = 3
target_accuracy = 0.8
run_timeout = "200s"

[[run]]
name = "elastic"
strategy = "multi-worker-mirrored"
workers = 3
min_workers = 2
restarts = 1

[[run]]
name = "restart"
strategy = "multi-worker-mirrored"
workers = 3
checkpoint_every = 20
restarts = 1

[[run]]
name = "no-recovery"
strategy = "multi-worker-mirrored"
workers = 3

[[run]]
name = "ps"
strategy = "parameter-server"
mode = "async"
workers = 3
restarts = 1

[[run]]
name = "undisturbed"
strategy = "multi-worker-mirrored"
workers = 3
faults = false

[injection]
kill = [{ worker = 1, at_step = 50 }]
"#;

/// `[injection] kill`: worker 1 is killed from outside after 50 global batches of every run
/// that takes faults. The elastic job goes on and ends where the undisturbed one does; the job
/// restarted from its checkpoint ends bit for bit where it does (every step applied once);
/// the job without recovery fails naming the loss; the parameter-server job's new worker
/// process is given steps and every push is applied once.
#[test]
fn a_worker_killed_at_a_step_is_survived_as_each_recovery_says() {
    let (_dir, out_dir, out) = run_compare("lost.toml", LOST_WORKER, Duration::from_secs(600));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("summary.json")).unwrap()).unwrap();
    let runs = summary["runs"].as_array().expect("summary.json has runs");
    let run = |name: &str| runs.iter().find(|r| r["name"] == name).unwrap_or_else(|| panic!("no run {name}"));
    let log = |name: &str| std::fs::read_to_string(out_dir.join(format!("runs/{name}"))).unwrap_or_default();

    for name in ["elastic", "restart", "no-recovery", "ps"] {
        let faults = run(name)["faults"].as_array().unwrap_or_else(|| panic!("{name} was not killed: {}", run(name)));
        assert_eq!(faults.len(), 1, "{name}");
        assert_eq!(faults[0]["worker"], 1, "{name}");
        assert!(faults[0]["step"].as_u64().unwrap() >= 50, "{name}: {}", faults[0]);
        assert!(run(name)["killed_at_s"].as_f64().unwrap() > 0.0, "{name}");
    }
    assert!(run("undisturbed")["faults"].is_null(), "faults = false: not killed");

    // 1437 training examples at 48 a step: 30 steps an epoch, 180 in all.
    let csv = std::fs::read_to_string(out_dir.join("runs.csv")).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let col = |n: &str| header.iter().position(|h| *h == n).unwrap();
    let rows: Vec<Vec<&str>> = csv.lines().skip(1).map(|l| l.split(',').collect()).collect();
    let steps = |run: &str| -> Vec<u64> {
        rows.iter()
            .filter(|r| r[col("run")] == run && r[col("kind")] == "step")
            .map(|r| r[col("step")].parse().unwrap())
            .collect()
    };
    let acc = |name: &str| run(name)["final_accuracy"].as_f64().unwrap();

    // Elastic: every step recorded once, in order, and the job ends where the undisturbed
    // one does (SGD; the global batch is re-split over the live workers).
    let elastic = &run("elastic");
    assert_eq!(elastic["status"], "ok", "{elastic}");
    assert_eq!(steps("elastic"), (1..=180).collect::<Vec<u64>>());
    assert!(log("elastic.log").contains("a new process joins it"), "{}", log("elastic.log"));
    assert!((acc("elastic") - acc("undisturbed")).abs() <= 1.0 / 360.0 + 1e-9, "{elastic}");

    // Restart the world: the job failed, was relaunched once, resumed from its checkpoint
    // and ends bit for bit where the undisturbed job does.
    let restart = &run("restart");
    assert_eq!(restart["status"], "ok", "{restart}");
    assert_eq!(restart["relaunches"], 1);
    let relaunch = log("restart.relaunch-1.log");
    assert!(relaunch.contains("resumed from the checkpoint of step"), "{relaunch}");
    let restart_steps = steps("restart");
    assert_eq!(restart_steps.last(), Some(&180));
    let killed_at = restart["faults"][0]["step"].as_u64().unwrap();
    // Steps after the last checkpoint (a multiple of 20) are trained again, no others: none
    // when the kill came right after a checkpoint was written (the CI met that once).
    let resumed_from: u64 = relaunch
        .split("resumed from the checkpoint of step ")
        .nth(1)
        .and_then(|t| t.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the relaunch names no step it resumed from: {relaunch}"));
    if let Some(w) = restart_steps.windows(2).find(|w| w[1] <= w[0]) {
        assert_eq!(w[1] - 1, resumed_from, "{restart_steps:?}");
    } else {
        assert_eq!(restart_steps, (1..=180).collect::<Vec<u64>>(), "no step repeated");
    }
    assert_eq!(resumed_from % 20, 0, "{restart_steps:?}");
    assert!(resumed_from <= killed_at && resumed_from + 20 > killed_at - 3, "{resumed_from} {killed_at}");
    assert_eq!(restart["steps_repeated"].as_u64().unwrap(), restart_steps.len() as u64 - 180);
    assert_eq!(acc("restart").to_bits(), acc("undisturbed").to_bits(), "{restart}");

    // No recovery: the job fails, naming the lost worker.
    let none = &run("no-recovery");
    assert_eq!(none["status"], "failed", "{none}");
    assert!(none["error"].as_str().unwrap().contains("worker:1"), "{none}");

    // Parameter servers: a new worker process took worker 1's place, and every one of the
    // 540 pushes (90 an epoch of 16 examples) is applied once.
    let ps = &run("ps");
    assert_eq!(ps["status"], "ok", "{ps}");
    assert!(log("ps.log").contains("a new process takes its place"), "{}", log("ps.log"));
    assert_eq!(ps["updates"], 540, "{ps}");

    // The report and the time-to-accuracy plot.
    let report = std::fs::read_to_string(out_dir.join("REPORT.md")).unwrap();
    assert!(report.contains("### Lost workers"), "{report}");
    assert!(report.contains("restart the world: relaunched whole from its last checkpoint (every 20 steps)"));
    // The wall time over the undisturbed twin (the same strategy and workers, faults = false):
    // given for the runs that finished, not for the one that failed.
    let over = |run: &str| -> String {
        let section = &report[report.find("### Lost workers").unwrap()..];
        let row = section.lines().find(|l| l.starts_with(&format!("| {run} |"))).unwrap_or_else(|| panic!("{report}"));
        row.split('|').nth(7).unwrap().trim().to_string()
    };
    for run in ["elastic", "restart"] {
        let v = over(run);
        assert!(v.starts_with(['+', '-']) && v.ends_with(" s"), "{run}: {v:?}");
    }
    assert_eq!(over("no-recovery"), "—");
    assert_eq!(over("ps"), "—", "no undisturbed parameter-server run");
    assert!(report.contains("![Test accuracy against wall time](accuracy_vs_time.png)"), "{report}");
    assert!(out_dir.join("accuracy_vs_time.svg").is_file());
}

const CTR: &str = r#"
[experiment]
name = "ctr"
model = "ctr"
epochs = 3
global_batch = 256
lr = 0.003
optimizer = "adamw"
seed = 1
embedding_rows = 5000
embedding_dim = 8
train_records = 8192
test_records = 2000
table_optimizer = "adagrad"
table_lr = 0.05
target_auc = 0.55
run_timeout = "180s"

[[run]]
strategy = "parameter-server"
mode = "async"
workers = 2
ps_tasks = 2

[[run]]
strategy = "parameter-server"
mode = "sync"
workers = 2
ps_tasks = 2

[[run]]
strategy = "parameter-server"
mode = "hybrid"
workers = 2
ps_tasks = 2
"#;

/// The click model under async, sync and hybrid parameter servers, each a real `strata train`
/// job of 2 ps tasks and 2 workers: every run finishes and evaluates after each epoch, the
/// report measures the test AUC (the one each run's own summary gives, above chance), its gap
/// to the best reachable and the bytes a worker step moves: the async and sync workers pull
/// the dense variables with their rows, the hybrid's only the rows.
#[test]
fn a_ctr_experiment_reports_the_test_auc_under_async_sync_and_hybrid_parameter_servers() {
    let (_dir, out_dir, out) = run_compare("ctr.toml", CTR, Duration::from_secs(400));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("summary.json")).unwrap()).unwrap();
    let runs = summary["runs"].as_array().expect("summary.json has runs");
    let run = |name: &str| runs.iter().find(|r| r["name"] == name).unwrap_or_else(|| panic!("no run {name}"));
    for name in ["ps-async", "ps-sync", "ps-hybrid"] {
        let r = run(name);
        assert_eq!(r["status"], "ok", "{name}: {r}");
        let auc = r["final_auc"].as_f64().unwrap_or_else(|| panic!("{name} has no final AUC: {r}"));
        assert!(auc.is_finite() && auc > 0.5 && auc <= 1.0, "{name}: {auc}");
        assert!(r["auc_gap"].as_f64().is_some_and(f64::is_finite), "{name}: {r}");
        assert!(r["time_to_target_s"].as_f64().is_some(), "{name}: {r}");
        // The harness's AUC is the run's own summary's.
        let own: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out_dir.join(format!("runs/{name}.json"))).unwrap()).unwrap();
        assert_eq!(own["final_test_auc"].as_f64(), Some(auc), "{name}");
        assert!(r["pulled_per_step"].as_f64().is_some_and(|b| b > 0.0), "{name}: {r}");
        assert!(r["pushed_per_step"].as_f64().is_some_and(|b| b > 0.0), "{name}: {r}");
    }
    let pulled = |name: &str| run(name)["pulled_per_step"].as_f64().unwrap();
    assert!(pulled("ps-hybrid") < pulled("ps-async"), "the hybrid pulls no dense variables");
    assert_eq!(run("ps-sync")["max_staleness"], 0);

    // runs.csv: an evaluation with a test AUC after each of the 3 epochs of every run.
    let csv = std::fs::read_to_string(out_dir.join("runs.csv")).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let col = |n: &str| header.iter().position(|h| *h == n).unwrap_or_else(|| panic!("no column {n}"));
    for name in ["ps-async", "ps-sync", "ps-hybrid"] {
        let evals: Vec<f64> = csv
            .lines()
            .skip(1)
            .map(|l| l.split(',').collect::<Vec<_>>())
            .filter(|r| r[col("run")] == name && r[col("kind")] == "eval")
            .map(|r| r[col("auc")].parse().unwrap_or_else(|_| panic!("{name}: an evaluation without an AUC")))
            .collect();
        assert_eq!(evals.len(), 3, "{name}");
        assert!(evals.iter().all(|a| *a > 0.5 && *a <= 1.0), "{name}: {evals:?}");
    }

    // The report names the AUC, not accuracy.
    let report = std::fs::read_to_string(out_dir.join("REPORT.md")).unwrap();
    assert!(report.contains("| final AUC | gap to best |") && report.contains("time to AUC 0.5500"), "{report}");
    assert!(!report.contains("final accuracy"), "{report}");
    assert!(report.contains("![Test AUC against wall time](auc_vs_time.png)"), "{report}");
    assert!(out_dir.join("auc_vs_steps.svg").is_file());
    assert!(stdout.contains("auc "), "{stdout}");
}

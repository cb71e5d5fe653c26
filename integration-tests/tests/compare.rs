//! `strata compare` with real processes: every run is `strata train`, so the accuracy the
//! harness records is the one `strata train` gives for the same strategy and seed; a run that
//! fails is reported with its error and the others go on; a malformed file names the field
//! and the line.

use std::process::Stdio;
use std::time::{Duration, Instant};

use strata_integration_tests::{strata, wait};

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
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tiny.toml");
    std::fs::write(&file, EXPERIMENT).unwrap();
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
    let out = wait(child, Instant::now() + Duration::from_secs(300));
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

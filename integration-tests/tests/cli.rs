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
    // A missing argument is named on the one line.
    assert_one_line_error(
        &strata(&["ps", "--address", "127.0.0.1:0", "--restore-step", "5"]),
        "the following required arguments were not provided: --restore <RESTORE>",
    );
    let cnn = strata(&["train", "--model", "cnn", "--recompute"]);
    assert_one_line_error(&cnn, "--recompute applies to --model mlp or transformer, not --model cnn; drop it");
    let ps = strata(&["train", "--strategy", "parameter-server", "--model", "cnn", "--recompute"]);
    assert_one_line_error(&ps, "--recompute applies to --model mlp or transformer");
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
    // The default: AdamW's shards step with every replica's gradients read in place (no
    // reduction); candle-nn's AdamW steps whole variables, reduced bucket by bucket.
    for (optimizer, phases) in [
        ("adamw", ["forward", "backward", "gradients handed round", "optimizer", "gather_runs"]),
        ("candle-adamw", ["forward", "backward", "bucket 0", "bucket 1", "optimizer"]),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let trace = dir.path().join("trace.json");
        let o = strata(&[
            "train",
            "--no-progress",
            "--epochs",
            "1",
            "--replicas",
            "2",
            "--optimizer",
            optimizer,
            "--bucket-mib",
            "0.1",
            "--timeline",
            trace.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
        let events = v["traceEvents"].as_array().unwrap();
        for replica in 0..2 {
            for name in phases {
                assert!(
                    events.iter().any(|e| e["tid"] == replica && e["name"] == name && e["ph"] == "X"),
                    "{optimizer}: no {name} event for replica {replica}"
                );
            }
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

/// A directory this process cannot write: mode 0555 for a user, `/sys/kernel` (sysfs) for
/// root, whom file modes do not stop.
fn unwritable_dir(tmp: &std::path::Path) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = tmp.join("read-only");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
    if std::fs::File::create(dir.join("probe")).is_ok() {
        return std::path::PathBuf::from("/sys/kernel");
    }
    dir
}

#[test]
fn zero_epochs_is_a_one_line_error() {
    assert_one_line_error(&strata(&["train", "--epochs", "0"]), "--epochs 0 trains nothing; pass --epochs 1 or more");
    assert_one_line_error(
        &strata(&["train", "--strategy", "parameter-server", "--epochs", "0"]),
        "--epochs 0 trains nothing",
    );
}

/// Replica counts beyond what the batch or the machine can take are refused before any thread
/// starts: at once, where 100,000 replicas took about a minute of starting threads.
#[test]
fn absurd_replica_counts_are_refused_before_any_thread_starts() {
    let started = std::time::Instant::now();
    assert_one_line_error(
        &strata(&["train", "--replicas", "100000"]),
        "--replicas 100000: over the limit of 1024 replicas per process (one thread each); pass 1024 or fewer",
    );
    assert_one_line_error(
        &strata(&["train", "--replicas", "1000", "--batch", "256"]),
        "--batch 256 is smaller than the 1000 replicas",
    );
    assert_one_line_error(
        &strata(&["train", "--strategy", "parameter-server", "--ps-tasks", "1", "--workers", "100000"]),
        "over the limit of 256 processes started on this machine",
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(30), "{:?}", started.elapsed());
}

#[test]
fn absurd_model_sizes_are_a_one_line_error() {
    assert_one_line_error(
        &strata(&["train", "--hidden", "1099511627776"]),
        "--hidden: a hidden layer of 1099511627776 units, over the limit of 65536",
    );
    assert_one_line_error(&strata(&["train", "--hidden", "65536,65536"]), "parameters, the limit");
}

/// A data file that never ends, or whose lines never do, is refused after its first line.
#[test]
fn endless_data_files_are_a_one_line_error() {
    assert_one_line_error(
        &strata(&["train", "--data", "/dev/zero"]),
        "data file /dev/zero: line 1 is longer than 4096 bytes, the limit",
    );
    // A sparse file of 8 GiB: no line ends in it either.
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("huge.csv");
    std::fs::File::create(&big).unwrap().set_len(8 << 30).unwrap();
    assert_one_line_error(&strata(&["train", "--data", big.to_str().unwrap()]), "line 1 is longer than 4096 bytes");
}

/// A data file of short lines that goes on past 256 MiB of text is refused at the limit, not
/// read to its end.
#[test]
fn a_data_file_over_the_text_limit_is_a_one_line_error() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("blank.csv");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&big).unwrap());
    // Blank lines of 4 KiB (each within the line limit, and skipped), 257 MiB of them.
    let line = format!("{}\n", " ".repeat(4095));
    for _ in 0..(257 << 8) {
        f.write_all(line.as_bytes()).unwrap();
    }
    f.flush().unwrap();
    drop(f);
    assert_one_line_error(
        &strata(&["train", "--data", big.to_str().unwrap()]),
        "more than 268435456 bytes of text, the limit; a digits file is a few MiB",
    );
}

#[test]
fn a_checkpoint_dir_that_cannot_be_written_fails_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let ro = unwritable_dir(tmp.path());
    let ro_text = ro.display().to_string();
    let o = strata(&["train", "--epochs", "1", "--checkpoint-dir", &ro_text]);
    assert_one_line_error(&o, &format!("--checkpoint-dir {ro_text}: cannot write a file in it"));
    let o = strata(&["train", "--strategy", "parameter-server", "--epochs", "1", "--checkpoint-dir", &ro_text]);
    assert_one_line_error(&o, &format!("--checkpoint-dir {ro_text}: cannot write a file in it"));
    let o = strata(&["ps", "--address", "127.0.0.1:0", "--checkpoint-dir", &ro_text]);
    assert_one_line_error(&o, &format!("--checkpoint-dir {ro_text}: cannot write a file in it"));
}

/// `strata` runs with mimalloc's purge delay at 30 s and without transparent huge pages: a
/// process started without `MIMALLOC_PURGE_DELAY` or `MIMALLOC_ALLOW_THP` executes itself once
/// more with them set (the same process, so its `/proc/<pid>/environ` changes), and a value
/// the user set is kept.
#[test]
fn strata_sets_mimallocs_options_unless_the_user_did() {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let cases = [
        (None, None, ["MIMALLOC_PURGE_DELAY=30000", "MIMALLOC_ALLOW_THP=0"]),
        (Some("250"), None, ["MIMALLOC_PURGE_DELAY=250", "MIMALLOC_ALLOW_THP=0"]),
        (None, Some("1"), ["MIMALLOC_PURGE_DELAY=30000", "MIMALLOC_ALLOW_THP=1"]),
    ];
    for (delay, thp, expected) in cases {
        let mut c = Command::new(strata_integration_tests::strata_bin());
        c.args(["train", "--epochs", "100000", "--no-progress"])
            .env_remove("MIMALLOC_PURGE_DELAY")
            .env_remove("MIMALLOC_ALLOW_THP");
        for (var, value) in [("MIMALLOC_PURGE_DELAY", delay), ("MIMALLOC_ALLOW_THP", thp)] {
            if let Some(v) = value {
                c.env(var, v);
            }
        }
        let mut child = c.stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("strata starts");
        let environ = format!("/proc/{}/environ", child.id());
        let deadline = Instant::now() + Duration::from_secs(30);
        let found = loop {
            let vars = std::fs::read(&environ).unwrap_or_default();
            let vars: Vec<String> = vars.split(|&b| b == 0).map(|v| String::from_utf8_lossy(v).into_owned()).collect();
            let found: Vec<String> = vars.into_iter().filter(|v| v.starts_with("MIMALLOC_")).collect();
            if expected.iter().all(|e| found.iter().any(|v| v == e)) || Instant::now() > deadline {
                break found;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let still_running = child.try_wait().expect("the child can be waited for").is_none();
        let _ = child.kill();
        let _ = child.wait();
        for e in expected {
            assert!(found.iter().any(|v| v == e), "{e} not among {found:?}");
        }
        assert!(still_running, "strata exited before it was looked at");
    }
}

#[test]
fn momentum_sets_adamw_s_beta1_and_a_bad_one_is_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let run = |momentum: Option<&str>| {
        let out = dir.path().join(format!("m{}.json", momentum.unwrap_or("default")));
        let mut args =
            vec!["train", "--no-progress", "--strategy", "one-device", "--epochs", "1", "--out", out.to_str().unwrap()];
        let flag = momentum.map(|m| format!("--momentum={m}"));
        args.extend(flag.as_deref());
        let o = strata(&args);
        assert!(o.status.success(), "stderr: {}", stderr(&o));
        // Losses and accuracies, not the epochs' timings.
        let s = summary(&out);
        let h = s["history"].as_array().expect("a history").iter();
        h.map(|e| (e["train_loss"].as_f64(), e["test_accuracy"].as_f64())).collect::<Vec<_>>()
    };
    let default = run(None);
    assert_eq!(run(Some("0.9")), default, "--momentum 0.9 is the default beta1");
    assert_ne!(run(Some("0.4")), default, "--momentum 0.4 trains with another beta1");
    for bad in ["1", "-0.1", "nan", "x"] {
        let o = strata(&["train", &format!("--momentum={bad}"), "--epochs", "1"]);
        assert_eq!(o.status.code(), Some(2), "{bad}: {}", stderr(&o));
        assert!(stderr(&o).contains("is not a coefficient in [0, 1)"), "{bad}: {}", stderr(&o));
    }
}

/// Mixed precision from the command line: bf16 and fp16 learn the digits with f32 variables
/// and report what they computed in (fp16 its loss scale); what cannot run is refused in one
/// line with exit code 2 and nothing started.
#[test]
fn mixed_precision_trains_and_bad_precision_flags_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for precision in ["bf16", "fp16"] {
        let out = dir.path().join(format!("{precision}.json"));
        let o = strata(&[
            "train",
            "--no-progress",
            "--precision",
            precision,
            "--epochs",
            "10",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{precision}: {}", stderr(&o));
        let s = summary(&out);
        assert_eq!(s["precision"], precision);
        assert!(s["final_test_accuracy"].as_f64().unwrap() >= 0.9, "{precision}: {}", s["final_test_accuracy"]);
        assert_eq!(s["loss_scale"].is_object(), precision == "fp16", "{s}");
        // Activations are kept in 16 bits: fewer bytes than the f32 run's (checked in the
        // strategies' tests; here, that they are reported).
        assert!(s["peak_replica"][0]["activations"].as_u64().unwrap() > 0);
    }
    let refused = [
        (vec!["--precision", "fp16", "--strategy", "parameter-server"], "use --precision bf16"),
        (
            vec!["--precision", "bf16", "--initial-loss-scale", "1024"],
            "--initial-loss-scale applies to --precision fp16",
        ),
        (vec!["--precision", "fp16", "--initial-loss-scale", "0.5"], "use a finite scale of at least 1"),
    ];
    for (args, needle) in refused {
        let o = strata(&[&["train", "--no-progress"], &args[..]].concat());
        assert_one_line_error(&o, needle);
    }
    let o = strata(&["train", "--precision", "f8"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("use f32, bf16 or fp16"), "{}", stderr(&o));
}

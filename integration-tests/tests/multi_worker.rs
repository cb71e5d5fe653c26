//! MultiWorkerMirroredStrategy with real worker processes on loopback: identical parameters on
//! every worker, equal to one process on the same global batch; a worker killed mid-training;
//! relaunching from a checkpoint. Every wait has a hard deadline.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use strata_integration_tests::{free_ports, strata, wait, worker_tf_config};

/// Starts `n` workers of `strata train --strategy multi-worker-mirrored ARGS`.
fn start_workers(n: usize, args: &[&str], dir: &Path) -> Vec<Child> {
    let ports = free_ports(n);
    (0..n)
        .map(|i| {
            strata()
                .args(["train", "--strategy", "multi-worker-mirrored", "--no-progress"])
                .args(args)
                .env("TF_CONFIG", worker_tf_config(&ports, i))
                .current_dir(dir)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect()
}

fn run_job(n: usize, args: &[&str], dir: &Path) -> Vec<Output> {
    let deadline = Instant::now() + Duration::from_secs(240);
    let outs: Vec<Output> = start_workers(n, args, dir).into_iter().map(|c| wait(c, deadline)).collect();
    for (i, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "worker {i} failed: {}", String::from_utf8_lossy(&o.stderr));
    }
    outs
}

fn load(path: &Path) -> HashMap<String, Vec<f32>> {
    candle_core::safetensors::load(path, &candle_core::Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

fn assert_close(a: &HashMap<String, Vec<f32>>, b: &HashMap<String, Vec<f32>>, rel: f32) {
    assert_eq!(a.len(), b.len());
    for (k, x) in a {
        let y = &b[k];
        let scale = x.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        let worst = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
        assert!(worst <= rel * scale, "{k}: max difference {worst} exceeds {rel} of {scale}");
    }
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("strata-mw-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

const TRAIN: &[&str] = &["--epochs", "2", "--batch", "128", "--hidden", "64", "--optimizer", "sgd", "--lr", "0.1"];

fn equal_to_one_process(workers: usize) {
    let dir = tmp(&format!("equal{workers}"));
    let mut args = TRAIN.to_vec();
    args.extend(["--save-params", "params-{task}.safetensors", "--out", "out.json"]);
    run_job(workers, &args, &dir);
    let first = std::fs::read(dir.join("params-0.safetensors")).unwrap();
    for i in 1..workers {
        let other = std::fs::read(dir.join(format!("params-{i}.safetensors"))).unwrap();
        assert!(first == other, "worker {i}'s parameters differ from the chief's");
    }
    let out: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("out.json")).unwrap()).unwrap();
    assert_eq!(out["strategy"], "multi-worker-mirrored");
    assert_eq!(out["replicas"], workers);
    // One process, one device, the same global batch.
    let mut single = strata();
    single.args(["train", "--strategy", "one-device", "--no-progress", "--save-params", "single.safetensors"]);
    let o = wait(
        single.args(TRAIN).current_dir(&dir).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap(),
        Instant::now() + Duration::from_secs(120),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_close(&load(&dir.join("params-0.safetensors")), &load(&dir.join("single.safetensors")), 1e-4);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--timeline` in a job of two processes on one host: each worker writes its own file (worker
/// 0 the path given, worker 1 `-worker1` beside it), as its own process of the trace, with its
/// collectives across workers on the ring row and every phase's thread CPU time.
#[test]
fn every_worker_writes_its_own_timeline_with_its_ring() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["--epochs", "1", "--batch", "64", "--hidden", "64", "--replicas", "2", "--timeline", "t.json"];
    run_job(2, &args, dir.path());
    for (w, file) in ["t.json", "t-worker1.json"].iter().enumerate() {
        let text = std::fs::read_to_string(dir.path().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let events = v["traceEvents"].as_array().unwrap();
        let pid = w as u64 + 1;
        assert!(events.iter().all(|e| e["pid"] == pid), "{file}: every event of process {pid}");
        let named = |tid: u64, name: &str| {
            events.iter().any(|e| e["ph"] == "M" && e["tid"] == tid && e["args"]["name"] == name)
        };
        assert!(named(0, "replica 0") && named(1, "replica 1") && named(1 << 16, "ring"), "{file}");
        assert!(events
            .iter()
            .any(|e| e["ph"] == "M" && e["name"] == "process_name" && e["args"]["name"] == format!("worker {w}")));
        let ring: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X" && e["tid"] == 1 << 16).collect();
        // Every step's gradients cross the ring: 22 or more steps of 64 (the training split).
        assert!(ring.iter().filter(|e| e["name"] == "all_reduce").count() >= 22, "{file}");
        assert!(ring.iter().any(|e| e["args"]["elements"].as_u64().unwrap_or(0) > 0), "{file}");
        for e in events.iter().filter(|e| e["ph"] == "X") {
            let (dur, cpu) = (e["dur"].as_f64().unwrap(), e["args"]["cpu_ms"].as_f64().unwrap());
            assert!(cpu >= 0.0 && cpu * 1e3 <= dur + 1e3, "{file}: {e}");
        }
        for name in ["forward", "backward", "finish", "optimizer"] {
            assert!(events.iter().any(|e| e["tid"] == 0 && e["name"] == name), "{file}: no {name}");
        }
    }
}

#[test]
fn two_workers_end_bitwise_identical_and_equal_to_one_process() {
    equal_to_one_process(2);
}

#[test]
fn four_workers_end_bitwise_identical_and_equal_to_one_process() {
    equal_to_one_process(4);
}

#[test]
fn a_killed_worker_fails_the_others_and_a_relaunch_resumes_to_the_same_parameters() {
    let dir = tmp("kill");
    let base = ["--epochs", "12", "--batch", "64", "--hidden", "64", "--optimizer", "adamw"];
    // The uninterrupted run.
    let mut args = base.to_vec();
    args.extend(["--save-params", "uninterrupted.safetensors"]);
    run_job(3, &args, &dir);
    // The same run with checkpoints; worker 1 is killed after the first checkpoint.
    let ckpt = dir.join("ckpt");
    let ckpt_s = ckpt.to_string_lossy().to_string();
    let mut args = base.to_vec();
    args.extend(["--checkpoint-dir", &ckpt_s, "--checkpoint-every", "20", "--save-params", "resumed.safetensors"]);
    let mut children = start_workers(3, &args, &dir);
    let deadline = Instant::now() + Duration::from_secs(120);
    while !ckpt.join("latest").exists() {
        assert!(Instant::now() < deadline, "no checkpoint was written");
        std::thread::sleep(Duration::from_millis(5));
    }
    let victim = children.remove(1);
    let killed = Instant::now();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(victim.id() as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    let _ = wait(victim, deadline);
    for (i, c) in children.into_iter().enumerate() {
        let o = wait(c, killed + Duration::from_secs(20));
        let err = String::from_utf8_lossy(&o.stderr);
        eprintln!("survivor {i} after {:?}: {}", killed.elapsed(), err.lines().last().unwrap_or(""));
        assert!(!o.status.success(), "a survivor exited 0: {err}");
        assert!(err.contains("worker:1"), "survivor {i}'s error does not name the lost task: {err}");
        assert!(
            err.contains("all_reduce")
                || err.contains("broadcast")
                || err.contains("barrier")
                || err.contains("heartbeat"),
            "survivor {i}'s error does not name the collective: {err}"
        );
        // One counter per message: the training steps, never a collective's number beside them.
        let line = err.lines().rfind(|l| l.starts_with("error:")).unwrap_or_default();
        assert!(!line.contains(" at step ") && !line.contains('#'), "survivor {i}: more than one counter: {line}");
    }
    assert!(killed.elapsed() < Duration::from_secs(20));
    // The relaunch resumes from the last checkpoint.
    let outs = run_job(3, &args, &dir);
    let err = String::from_utf8_lossy(&outs[0].stderr);
    assert!(err.contains("resumed from the checkpoint of step"), "{err}");
    let a = std::fs::read(dir.join("uninterrupted.safetensors")).unwrap();
    let b = std::fs::read(dir.join("resumed.safetensors")).unwrap();
    assert!(a == b, "the resumed run's parameters differ from the uninterrupted run's");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A corrupt checkpoint: the chief refuses it at restore, naming the file, and `strata launch`
/// blames the chief, whichever task exits first.
#[test]
fn a_corrupt_checkpoint_is_refused_and_the_launcher_blames_the_chief() {
    let dir = tmp("corrupt");
    let ckpt = dir.join("ckpt");
    let ckpt_s = ckpt.to_string_lossy().to_string();
    let launch = |dir: &Path| {
        let o = wait(
            strata()
                .args(["launch", "--workers", "2", "--", "strata", "train", "--strategy", "multi-worker-mirrored"])
                .args(["--no-progress", "--epochs", "1", "--batch", "64", "--hidden", "16"])
                .args(["--checkpoint-dir", &ckpt_s, "--checkpoint-every", "5"])
                .current_dir(dir)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
            Instant::now() + Duration::from_secs(120),
        );
        (o.status.code(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let (code, err) = launch(&dir);
    assert_eq!(code, Some(0), "{err}");
    // One bit of the metadata: a digit of when the checkpoint was written (still valid JSON).
    let latest = std::fs::read_to_string(ckpt.join("latest")).unwrap();
    let manifest = ckpt.join(latest.lines().next().unwrap()).join("manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let at = text.find("\"created_unix_ms\": ").unwrap() + 23;
    let mut bytes = text.into_bytes();
    bytes[at] ^= 0x01;
    std::fs::write(&manifest, bytes).unwrap();
    let (code, err) = launch(&dir);
    assert_eq!(code, Some(1), "{err}");
    let chief_error = err.lines().find(|l| l.starts_with("[worker:0] error:")).unwrap_or_else(|| panic!("{err}"));
    assert!(chief_error.contains("checksum mismatch") && chief_error.contains("manifest.json"), "{chief_error}");
    let named: Vec<&str> = err.lines().filter(|l| l.starts_with("strata launch:")).collect();
    let first = named.first().unwrap_or_else(|| panic!("{err}"));
    if !first.contains("task worker:0") {
        assert!(
            named
                .iter()
                .any(|l| l.starts_with("strata launch: the job failed in task worker:0 (exited with code 1): error:")),
            "the launcher does not name the chief: {err}"
        );
    }
    assert!(!err.contains("the job failed in task worker:1"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The heartbeat timeout `strata train` runs with.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(3);

fn signal(child: &Child, signal: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), signal);
}

/// Starts 3 workers, stops worker `victim` with SIGSTOP once training is under way, and checks
/// that every survivor fails within the heartbeat timeout (plus slack for a loaded machine),
/// naming the stopped task. Returns the survivors' times.
fn a_stopped_worker_fails_every_survivor(victim: usize) -> Vec<Duration> {
    let dir = tmp(&format!("sigstop{victim}"));
    let ckpt = dir.join("ckpt");
    let ckpt_s = ckpt.to_string_lossy().to_string();
    let args = [
        "--epochs",
        "500",
        "--batch",
        "64",
        "--hidden",
        "64",
        "--optimizer",
        "sgd",
        "--checkpoint-dir",
        &ckpt_s,
        "--checkpoint-every",
        "10",
    ];
    let mut children = start_workers(3, &args, &dir);
    let deadline = Instant::now() + Duration::from_secs(120);
    while !ckpt.join("latest").exists() {
        assert!(Instant::now() < deadline, "no checkpoint was written");
        std::thread::sleep(Duration::from_millis(5));
    }
    let stopped = children.remove(victim);
    signal(&stopped, nix::sys::signal::Signal::SIGSTOP);
    let at = Instant::now();
    let mut times = Vec::new();
    let mut failures = Vec::new();
    for (i, c) in children.into_iter().enumerate() {
        let o = wait(c, at + HEARTBEAT_TIMEOUT + Duration::from_secs(10));
        let took = at.elapsed();
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        eprintln!("survivor {i} failed {took:?} after worker:{victim} stopped: {}", err.lines().last().unwrap_or(""));
        times.push(took);
        failures.push((o.status, err));
    }
    // SIGKILL ends a stopped process too.
    signal(&stopped, nix::sys::signal::Signal::SIGKILL);
    let _ = wait(stopped, Instant::now() + Duration::from_secs(10));
    for (status, err) in &failures {
        assert!(!status.success(), "a survivor exited 0: {err}");
        let last = err.lines().last().unwrap_or("");
        assert!(last.contains(&format!("lost task worker:{victim}")), "the error does not name the lost task: {err}");
        assert!(last.contains("training step"), "the error does not name the step: {err}");
    }
    for t in &times {
        assert!(
            *t < HEARTBEAT_TIMEOUT + Duration::from_secs(3),
            "a survivor took {t:?} (asked for: the timeout + 1 s; asserted with 2 s more for a loaded machine)"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    times
}

#[test]
fn a_stopped_worker_fails_the_others_within_the_heartbeat_timeout() {
    a_stopped_worker_fails_every_survivor(1);
}

#[test]
fn a_stopped_chief_fails_the_others_within_the_heartbeat_timeout() {
    // worker:0 serves the coordination service.
    a_stopped_worker_fails_every_survivor(0);
}

#[test]
fn a_worker_with_the_wrong_token_fails_the_chief_within_seconds_naming_it() {
    let dir = tmp("token");
    let ports = free_ports(2);
    let start = |i: usize, token: &str| {
        strata()
            .args(["train", "--strategy", "multi-worker-mirrored", "--no-progress"])
            .args(TRAIN)
            .env("TF_CONFIG", worker_tf_config(&ports, i))
            .env("STRATA_CLUSTER_TOKEN", token)
            .current_dir(&dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let chief = start(0, strata_integration_tests::TOKEN);
    let refused = wait(start(1, "ffffffffffffffffffffffffffffffff"), Instant::now() + Duration::from_secs(60));
    let at = Instant::now();
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(err.contains("wrong cluster token"), "{err}");
    // The rendezvous' own timeout is 120 s.
    let o = wait(chief, at + Duration::from_secs(30));
    let took = at.elapsed();
    let err = String::from_utf8_lossy(&o.stderr);
    eprintln!("the chief failed {took:?} after the refused worker exited: {}", err.trim());
    assert!(!o.status.success());
    assert!(err.contains("worker:1 was refused: wrong cluster token"), "{err}");
    assert!(took < Duration::from_secs(8), "{took:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Writes `rows` rows of the shipped digits (from row `from`) as a plain CSV at `path`.
fn digits_shard(path: &Path, from: usize, rows: usize) {
    let all = strata::digits::load(None).unwrap();
    let mut text = String::new();
    for i in from..from + rows {
        let px = &all.features[i * 64..(i + 1) * 64];
        let fields: Vec<String> = px.iter().map(|v| format!("{}", (v * 16.0).round() as u32)).collect();
        text.push_str(&format!("{},{}\n", fields.join(","), all.labels[i]));
    }
    std::fs::write(path, text).unwrap();
}

#[test]
fn auto_shard_file_gives_each_worker_whole_files() {
    // Two identical shards: under --auto-shard file each worker reads its own (files 0 and 1),
    // so a step of --batch 128 is the same 64 rows twice, and the job ends where one process
    // ends with --batch 64 on one shard. A worker that read both files would run twice the
    // steps and end elsewhere.
    let dir = tmp("autoshard");
    let shards = dir.join("shards");
    std::fs::create_dir_all(&shards).unwrap();
    digits_shard(&shards.join("part-0.csv"), 0, 600);
    digits_shard(&shards.join("part-1.csv"), 0, 600);
    let common = ["--epochs", "2", "--hidden", "32", "--optimizer", "sgd", "--lr", "0.1"];
    let mut args = common.to_vec();
    args.extend([
        "--auto-shard",
        "file",
        "--batch",
        "128",
        "--data",
        "shards",
        "--save-params",
        "p-{task}.safetensors",
    ]);
    run_job(2, &args, &dir);
    let (a, b) =
        (std::fs::read(dir.join("p-0.safetensors")).unwrap(), std::fs::read(dir.join("p-1.safetensors")).unwrap());
    assert!(a == b, "the workers' parameters differ");
    let mut single = strata();
    single.args(["train", "--strategy", "one-device", "--no-progress", "--save-params", "single.safetensors"]);
    single.args(common).args(["--batch", "64", "--data", "shards/part-0.csv"]);
    let o = wait(
        single.current_dir(&dir).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap(),
        Instant::now() + Duration::from_secs(120),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_close(&load(&dir.join("p-0.safetensors")), &load(&dir.join("single.safetensors")), 1e-5);

    // Refusals, one line and exit code 2 on every worker: fewer files than workers, a batch
    // that does not divide, shards of unequal steps.
    let refused = |args: &[&str], want: &str| {
        let deadline = Instant::now() + Duration::from_secs(120);
        for (i, o) in start_workers(2, args, &dir).into_iter().map(|c| wait(c, deadline)).enumerate() {
            let err = String::from_utf8_lossy(&o.stderr);
            let line = err.lines().find(|l| l.starts_with("error:")).unwrap_or_default();
            assert_eq!(o.status.code(), Some(2), "worker {i}: {err}");
            assert!(line.contains(want), "worker {i}: {err}");
        }
    };
    let one = dir.join("one");
    std::fs::create_dir_all(&one).unwrap();
    digits_shard(&one.join("only.csv"), 0, 100);
    refused(
        &["--auto-shard", "file", "--data", "one", "--epochs", "1"],
        "needs at least 2 files, but --data one has 1",
    );
    refused(&["--auto-shard", "file", "--data", "shards", "--batch", "127", "--epochs", "1"], "use a multiple of 2");
    digits_shard(&shards.join("part-1.csv"), 0, 300);
    refused(&["--auto-shard", "file", "--data", "shards", "--batch", "64", "--epochs", "1"], "steps an epoch");
    let _ = std::fs::remove_dir_all(&dir);
}

/// DiLoCo under `strata train`, real processes: 2 workers meeting every 4 steps (SGD inner
/// steps, Nesterov outer), in one fragment and in two met at staggered steps. Each ends on the
/// same parameters (the fit's final synchronisation), the summary counts the meetings and the
/// outer bytes in closed form (24 steps: 2 epochs of 12 batches of 128 of the 1,437 training
/// rows), and the model learns (well above chance).
#[test]
fn diloco_workers_meet_every_h_steps_and_end_on_the_same_parameters() {
    // Meetings: one fragment at steps 4, 8, ..., 24 (the last needs no final one); two at 2,
    // 6, ..., 22 and 4, ..., 24, and the first met once more at the end.
    for (fragments, meetings) in [("1", 6), ("2", 13)] {
        let dir = tmp(&format!("diloco{fragments}"));
        let mut args = TRAIN.to_vec();
        args.extend(["--sync-every", "4", "--fragments", fragments]);
        args.extend(["--save-params", "params-{task}.safetensors", "--out", "out.json"]);
        run_job(2, &args, &dir);
        let first = std::fs::read(dir.join("params-0.safetensors")).unwrap();
        let other = std::fs::read(dir.join("params-1.safetensors")).unwrap();
        assert!(first == other, "{fragments} fragment(s): the workers end on different parameters");
        let out: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("out.json")).unwrap()).unwrap();
        let l = &out["local_sgd"];
        assert_eq!(l["sync_every"], 4);
        assert_eq!(l["outer_optimizer"], "nesterov(lr=0.7,momentum=0.9)");
        assert_eq!(l["meetings"], meetings, "{fragments} fragment(s): {l}");
        // Every fragment in f32 once per 4 steps (6 times in 24), the first fragment of two
        // once more at the end.
        let params = out["parameters"].as_u64().unwrap();
        let bytes = l["outer_bytes_sent"].as_u64().unwrap();
        if fragments == "1" {
            assert_eq!(bytes, 4 * params * 6, "{l}");
        } else {
            assert!(bytes > 4 * params * 6 && bytes < 4 * params * 7, "{l}");
        }
        let acc = out["final_test_accuracy"].as_f64().unwrap();
        // Ten classes: chance is 0.1 (DiLoCo's 24 steps reach 0.69 here, per-step sync's 0.9).
        assert!(acc > 0.5, "{fragments} fragment(s): test accuracy {acc}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Local SGD's checkpoints, real processes: 2 workers under Streaming DiLoCo (AdamW inner
/// steps, 2 fragments met every 4 steps, each landing a step after it is sent, outer gradients
/// in bf16 with error feedback) write a checkpoint every 5 steps; the job is killed after one
/// with an exchange in flight (step 10: the fragment sent at step 10 lands at 11), and the
/// relaunch resumes every worker's own parameters and AdamW state, the global parameters, the
/// outer momentum, the rounding's error and the exchange in flight, ending bit for bit on the
/// uninterrupted run's parameters. A relaunch on another number of workers is refused.
#[test]
fn local_sgd_checkpoints_resume_every_worker_bit_for_bit() {
    let dir = tmp("diloco-ckpt");
    let base = [
        "--epochs",
        "6",
        "--batch",
        "128",
        "--hidden",
        "64",
        "--optimizer",
        "adamw",
        "--lr",
        "0.003",
        "--sync-every",
        "4",
        "--fragments",
        "2",
        "--compression",
        "bf16",
        "--checkpoint-every",
        "5",
    ];
    let run = |ckpt: &str, save: &str| {
        let mut a = base.to_vec();
        a.extend(["--checkpoint-dir", ckpt, "--save-params", save]);
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let uninterrupted = run("ckpt-a", "a-{task}.safetensors");
    run_job(2, &uninterrupted.iter().map(String::as_str).collect::<Vec<_>>(), &dir);
    let resumed = run("ckpt-b", "b-{task}.safetensors");
    let resumed: Vec<&str> = resumed.iter().map(String::as_str).collect();
    let mut children = start_workers(2, &resumed, &dir);
    let latest = dir.join("ckpt-b").join("latest");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let step = std::fs::read_to_string(&latest)
            .ok()
            .and_then(|t| t.lines().next().and_then(|l| l.strip_prefix("ckpt-")).and_then(|n| n.parse::<u64>().ok()));
        if step.is_some_and(|s| s >= 10) {
            break;
        }
        assert!(Instant::now() < deadline, "no checkpoint of step 10 or later was written");
        std::thread::sleep(Duration::from_millis(2));
    }
    for c in &children {
        signal(c, nix::sys::signal::Signal::SIGKILL);
    }
    for c in children.drain(..) {
        let _ = wait(c, deadline);
    }
    let outs = run_job(2, &resumed, &dir);
    let err = String::from_utf8_lossy(&outs[0].stderr);
    let step: u64 = err
        .split("resumed from the checkpoint of step ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the relaunch did not resume: {err}"));
    // 6 epochs of 12 steps: the checkpoint resumed must be one of the run's middle.
    assert!((10..72).contains(&step), "resumed from step {step}");
    for task in 0..2 {
        let a = std::fs::read(dir.join(format!("a-{task}.safetensors"))).unwrap();
        let b = std::fs::read(dir.join(format!("b-{task}.safetensors"))).unwrap();
        assert!(a == b, "worker {task}: the resumed run (from step {step}) ends on other parameters");
    }
    // The checkpoint holds 2 workers' local state: 3 workers are refused, in one line.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut again = base.to_vec();
    again.extend(["--checkpoint-dir", "ckpt-a"]);
    let outs: Vec<Output> = start_workers(3, &again, &dir).into_iter().map(|c| wait(c, deadline)).collect();
    let err = String::from_utf8_lossy(&outs[0].stderr);
    let want = "resume it with the settings and the number of workers it was written with";
    assert!(!outs[0].status.success() && err.contains(want), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Workers that disagree on local SGD's settings (the period, the fragments, the outer
/// optimizer) are refused at the rendezvous, the error naming both settings on every worker
/// (exit code 2, one line), and the job fails at once, before any step.
#[test]
fn workers_that_disagree_on_local_sgd_are_refused_at_the_rendezvous_naming_both() {
    let dir = tmp("diloco-disagree");
    for (chief, other, theirs) in [
        (&["--sync-every", "4"][..], &["--sync-every", "8"][..], "every=8"),
        (&["--sync-every", "4"][..], &["--sync-every", "4", "--fragments", "2"][..], "fragments=2"),
        (&["--sync-every", "4"][..], &["--sync-every", "4", "--outer-optimizer", "average"][..], "outer=average"),
    ] {
        // free_ports releases its ports before the job binds them: a port another process took
        // meanwhile (the chief cannot bind, the other worker then waits for a service that never
        // comes) is tried again with fresh ports, at most 3 times.
        let mut outs = None;
        for _ in 0..3 {
            let ports = free_ports(2);
            let start = |i: usize, flags: &[&str]| {
                strata()
                    .args(["train", "--strategy", "multi-worker-mirrored", "--no-progress"])
                    .args(TRAIN)
                    .args(flags)
                    .env("TF_CONFIG", worker_tf_config(&ports, i))
                    .current_dir(&dir)
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            };
            let mut children = vec![start(0, chief), start(1, other)];
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline && children.iter_mut().any(|c| c.try_wait().unwrap().is_none()) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let finished = children.iter_mut().all(|c| c.try_wait().unwrap().is_some());
            for c in &mut children {
                let _ = c.kill();
            }
            let o: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
            let chief_err = String::from_utf8_lossy(&o[0].stderr).to_string();
            if finished && !chief_err.contains("holds the port") {
                outs = Some(o);
                break;
            }
            eprintln!("a port was taken meanwhile; trying again: {chief_err}");
        }
        let outs = outs.expect("the job ran on free ports in 3 tries");
        // Both the refused worker and the chief: one line naming both settings, exit code 2.
        for i in [1, 0] {
            let err = String::from_utf8_lossy(&outs[i].stderr);
            assert_eq!(outs[i].status.code(), Some(2), "worker {i}: {err}");
            assert_eq!(err.trim().lines().count(), 1, "worker {i}: {err}");
            let line = err.lines().find(|l| l.starts_with("error:")).unwrap_or_else(|| panic!("{err}"));
            assert!(line.contains(theirs) && line.contains("every=4,outer=nesterov"), "worker {i}: {line}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Local SGD's flags where they cannot apply: one line saying what to change, exit code 2,
/// before any worker joins.
#[test]
fn local_sgd_flags_that_cannot_apply_are_refused_in_one_line() {
    let cases: [(&[&str], &str); 4] = [
        (
            &["--strategy", "mirrored", "--sync-every", "8"],
            "--sync-every 8 applies to --strategy multi-worker-mirrored",
        ),
        (
            &["--strategy", "multi-worker-mirrored", "--fragments", "2"],
            "--fragments and --sync-delay apply to local SGD",
        ),
        (&["--strategy", "multi-worker-mirrored", "--sync-every", "4", "--fragments", "8"], "use 1 to 4 fragments"),
        (
            &["--strategy", "multi-worker-mirrored", "--sync-every", "4", "--zero-stage", "1", "--optimizer", "adamw"],
            "use --zero-stage 0 with it",
        ),
    ];
    for (args, want) in cases {
        let o = wait(
            strata()
                .arg("train")
                .args(args)
                .env("TF_CONFIG", worker_tf_config(&free_ports(1), 0))
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
            Instant::now() + Duration::from_secs(30),
        );
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
    }
}

//! ParameterServerStrategy with real `strata ps`, `strata worker` and coordinator processes on
//! loopback: accuracy in async mode, sync mode equal to the averaged steps of one process,
//! exactly-once pushes under injected faults, a worker killed mid-run, a ps killed and restored
//! from its checkpoint, a straggler under backup workers, and what a private cluster refuses.
//! Every wait has a hard deadline.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor, Var};
use strata::model::{Classifier, Mlp};
use strata::Strategy;
use strata_transport::ps::{PsClient, PsClientConfig, PsMode, ServerOptimizer, UpdateId, VariableInfo};
use strata_transport::{ClusterToken, Error as TransportError};

use strata_integration_tests::{free_ports, strata, wait, TOKEN};

/// A cluster of a chief, `workers` workers and `ps` ps tasks on free loopback ports.
struct Cluster {
    chief: u16,
    workers: Vec<u16>,
    ps: Vec<u16>,
}

impl Cluster {
    fn new(workers: usize, ps: usize) -> Self {
        let ports = free_ports(1 + workers + ps);
        Self { chief: ports[0], workers: ports[1..=workers].to_vec(), ps: ports[1 + workers..].to_vec() }
    }

    fn tf_config(&self, kind: &str, index: usize) -> String {
        let list = |ports: &[u16]| ports.iter().map(|p| format!("\"127.0.0.1:{p}\"")).collect::<Vec<_>>().join(",");
        format!(
            r#"{{"cluster":{{"chief":["127.0.0.1:{}"],"worker":[{}],"ps":[{}]}},"task":{{"type":"{kind}","index":{index}}}}}"#,
            self.chief,
            list(&self.workers),
            list(&self.ps)
        )
    }

    fn ps_address(&self, i: usize) -> String {
        format!("127.0.0.1:{}", self.ps[i])
    }
}

fn spawn(mut cmd: Command) -> Child {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
}

fn stop(children: Vec<Child>) {
    for mut c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn ok(out: &Output) {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn client(address: &str, task: &str, token: &str) -> PsClient {
    let config = PsClientConfig { timeout: Duration::from_secs(20), retry_for: Duration::from_secs(20) };
    PsClient::connect(address, task, ClusterToken::new(token).unwrap(), config).unwrap()
}

/// Polls `check` every 50 ms until it holds, or panics after `limit`.
fn eventually(limit: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn ps_tasks(summary: &serde_json::Value) -> Vec<serde_json::Value> {
    summary["parameter_servers"]["tasks"].as_array().unwrap().clone()
}

#[test]
fn async_mode_with_two_ps_tasks_and_three_workers_reaches_93_percent() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("out.json");
    let mut cmd = strata();
    cmd.args(["train", "--strategy", "parameter-server", "--ps-tasks", "2", "--workers", "3", "--ps-mode", "async"])
        // 30 epochs (the default): at 20 the accuracy is still climbing through 0.93-0.98, and
        // an unlucky order of stale updates on a loaded machine ended one CI run at 0.928.
        .args(["--epochs", "30", "--no-progress", "--out"])
        .arg(&out_path);
    let out = wait(spawn(cmd), Instant::now() + Duration::from_secs(300));
    ok(&out);
    let summary = read_json(&out_path);
    let accuracy = summary["final_test_accuracy"].as_f64().unwrap();
    assert!(accuracy >= 0.93, "async PS reached only {accuracy}");
    assert_eq!(summary["strategy"], "parameter-server");
    // 30 epochs of ceil(1438 / 256) = 6 steps; each applied exactly once on each ps task.
    let tasks = ps_tasks(&summary);
    assert_eq!(tasks.len(), 2);
    for t in &tasks {
        assert_eq!(t["pushes_applied"], 180, "{t}");
        assert_eq!(t["version"], 180, "{t}");
    }
    // Size-balanced placement: neither task holds more than the biggest variable above half.
    let bytes: Vec<u64> = tasks.iter().map(|t| t["bytes"].as_u64().unwrap()).collect();
    assert_eq!(bytes.iter().sum::<u64>(), 85_002 * 4);
}

/// The sync run's reference: one process, the same initial values, and per round the mean of
/// the gradients of `workers` consecutive batches, applied with SGD.
fn sync_reference(workers: usize, epochs: u64, batch: usize, lr: f64, seed: u64) -> HashMap<String, Vec<f32>> {
    let all = strata::digits::load(None).unwrap();
    let (train, _) = strata::digits::train_test_split(&all, 0.2, 0);
    let options = strata::StrategyOptions { seed, ..Default::default() };
    let strategy =
        strata::OneDeviceStrategy::with_options(strata::device::logical_cpus(1).unwrap().remove(0), options).unwrap();
    let model = strategy.scope(|s| Mlp::new(s.var_builder(), 64, &[256, 256], 10)).unwrap();
    let vars: Vec<(String, Var)> = model.variables(0).to_vec();
    let net = model.primary();
    for epoch in 0..epochs {
        let order = strata::ps_job::epoch_order(train.len(), seed, epoch);
        let batches: Vec<_> = order.chunks(batch).map(|idx| strata::digits::gather(&train, idx)).collect();
        for round in batches.chunks(workers) {
            let mut sum: Vec<Vec<f32>> = vars.iter().map(|(_, v)| vec![0.0; v.as_tensor().elem_count()]).collect();
            for b in round {
                let x = b.features_tensor(&Device::Cpu).unwrap();
                let y = b.labels_tensor(&Device::Cpu).unwrap();
                let grads = net.loss(&x, &y).unwrap().backward().unwrap();
                for ((_, v), acc) in vars.iter().zip(&mut sum) {
                    let g = grads.get(v.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    acc.iter_mut().zip(g).for_each(|(a, g)| *a += g);
                }
            }
            for ((_, v), acc) in vars.iter().zip(&sum) {
                let w = v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let k = round.len() as f32;
                let new: Vec<f32> = w.iter().zip(acc).map(|(w, g)| w - (lr as f32) * (g / k)).collect();
                v.set(&Tensor::from_vec(new, v.as_tensor().shape(), &Device::Cpu).unwrap()).unwrap();
            }
        }
    }
    vars.iter().map(|(n, v)| (n.clone(), v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect()
}

#[test]
fn sync_mode_equals_one_process_doing_the_averaged_steps() {
    let dir = tempfile::tempdir().unwrap();
    let params = dir.path().join("params.safetensors");
    let out_path = dir.path().join("out.json");
    let mut cmd = strata();
    cmd.args(["train", "--strategy", "parameter-server", "--ps-tasks", "2", "--workers", "3", "--ps-mode", "sync"])
        .args(["--epochs", "2", "--batch", "64", "--optimizer", "sgd", "--lr", "0.1", "--seed", "3"])
        .args(["--partitioner", "fixed:2", "--no-progress", "--save-params"])
        .arg(&params)
        .arg("--out")
        .arg(&out_path);
    let out = wait(spawn(cmd), Instant::now() + Duration::from_secs(300));
    ok(&out);
    let got = candle_core::safetensors::load(&params, &Device::Cpu).unwrap();
    let want = sync_reference(3, 2, 64, 0.1, 3);
    assert_eq!(got.len(), want.len());
    for (name, w) in &want {
        let g = got[name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let worst = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(worst <= 1e-5, "{name}: the sync PS run differs from the averaged steps by {worst}");
    }
    // 2 epochs of 23 batches: rounds of 3, the last of each epoch of 2 (drained).
    let summary = read_json(&out_path);
    for t in ps_tasks(&summary) {
        assert_eq!(t["rounds"], 16, "{t}");
        assert_eq!(t["pushes_applied"], 46, "{t}");
    }
}

#[test]
fn pushes_are_applied_exactly_once_under_dropped_replies_and_requests() {
    let port = free_ports(1)[0];
    let address = format!("127.0.0.1:{port}");
    let mut cmd = strata();
    cmd.args(["ps", "--address", &address, "--inject-drop-reply-every", "3", "--inject-drop-request-every", "5"]);
    let server = spawn(cmd);
    let c = client(&address, "ps:0", TOKEN);
    let zeros = vec![0.0f32; 4096];
    eventually(Duration::from_secs(30), "the ps task to answer", || {
        c.create_variables(
            &[(VariableInfo::whole("w", vec![4096]), &zeros)],
            &ServerOptimizer::Sgd { lr: 1.0 },
            PsMode::Async,
        )
        .is_ok()
    });
    let (workers, pushes) = (4usize, 30u64);
    std::thread::scope(|s| {
        for w in 0..workers {
            let c = c.clone();
            s.spawn(move || {
                let ones = vec![1.0f32; 4096];
                for step in 0..pushes {
                    let id = UpdateId { worker: format!("worker:{w}"), client: format!("worker:{w}"), step, seq: 0 };
                    c.push(&id, 0, &[("w", &ones)]).unwrap();
                }
            });
        }
    });
    let pulled = c.pull(&["w"], 0).unwrap();
    let logical = (workers as u64 * pushes) as f32;
    assert!(pulled.variables[0].2.iter().all(|&x| x == -logical), "expected every element to be {}", -logical);
    let status = c.status().unwrap();
    assert_eq!(status.pushes_applied, workers as u64 * pushes);
    assert!(status.pushes_duplicate > 0, "no reply was dropped: the fault injection did not run");
    stop(vec![server]);
}

#[test]
fn a_private_ps_refuses_strangers_and_malformed_pushes_and_keeps_serving() {
    let port = free_ports(1)[0];
    let address = format!("127.0.0.1:{port}");
    let mut cmd = strata();
    cmd.args(["ps", "--address", &address]);
    let server = spawn(cmd);
    let good = client(&address, "ps:0", TOKEN);
    let init = vec![0.5f32; 6];
    eventually(Duration::from_secs(30), "the ps task to answer", || {
        good.create_variables(
            &[(VariableInfo::whole("w", vec![2, 3]), &init)],
            &ServerOptimizer::Sgd { lr: 1.0 },
            PsMode::Async,
        )
        .is_ok()
    });
    let stranger = PsClient::connect(
        &address,
        "ps:0",
        ClusterToken::new("the-wrong-token-of-32-characters").unwrap(),
        PsClientConfig { timeout: Duration::from_secs(10), retry_for: Duration::ZERO },
    )
    .unwrap();
    let id = |step| UpdateId { worker: "worker:0".into(), client: "t".into(), step, seq: 0 };
    let ones = vec![1.0f32; 6];
    assert!(matches!(stranger.push(&id(0), 0, &[("w", &ones)]), Err(TransportError::Unauthenticated(_))));
    assert!(matches!(stranger.pull(&["w"], 0), Err(TransportError::Unauthenticated(_))));
    assert!(matches!(stranger.status(), Err(TransportError::Unauthenticated(_))));
    let code = |r: Result<_, TransportError>| match r {
        Err(TransportError::Rejected { code, detail, .. }) => format!("{code}: {detail}"),
        other => panic!("expected a refusal, got {other:?}"),
    };
    let e = code(good.push(&id(1), 0, &[("nope", &ones)]));
    assert!(e.contains("NotFound") || e.contains("NOT_FOUND") || e.contains("not found"), "{e}");
    let e = code(good.push(&id(2), 0, &[("w", &ones[..5])]));
    assert!(e.contains("6") && e.contains("5"), "{e}");
    // Nothing of the refused pushes was applied, and the server still serves.
    let pulled = good.pull(&["w"], 0).unwrap();
    assert_eq!(pulled.variables[0].2, init);
    good.push(&id(3), 0, &[("w", &ones)]).unwrap();
    assert_eq!(good.pull(&["w"], 0).unwrap().variables[0].2, vec![-0.5f32; 6]);
    stop(vec![server]);
}

/// Starts the ps tasks, workers and coordinator of `cluster` as separate processes.
fn start_ps(cluster: &Cluster, i: usize, extra: &[&str]) -> Child {
    let mut cmd = strata();
    cmd.arg("ps").args(extra).env("TF_CONFIG", cluster.tf_config("ps", i));
    spawn(cmd)
}

fn start_worker(cluster: &Cluster, i: usize, extra: &[&str]) -> Child {
    let mut cmd = strata();
    cmd.arg("worker").args(extra).env("TF_CONFIG", cluster.tf_config("worker", i));
    spawn(cmd)
}

fn start_coordinator(cluster: &Cluster, args: &[&str], out: &Path) -> Child {
    let mut cmd = strata();
    cmd.args(["train", "--strategy", "parameter-server", "--no-progress", "--out"])
        .arg(out)
        .args(args)
        .env("TF_CONFIG", cluster.tf_config("chief", 0));
    spawn(cmd)
}

#[test]
fn a_worker_killed_mid_run_does_not_lose_a_step() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("out.json");
    let cluster = Cluster::new(3, 2);
    let ps: Vec<Child> = (0..2).map(|i| start_ps(&cluster, i, &[])).collect();
    let mut workers: Vec<Option<Child>> =
        (0..3).map(|i| Some(start_worker(&cluster, i, &["--slowdown", "3"]))).collect();
    let coordinator = start_coordinator(&cluster, &["--epochs", "6", "--batch", "64"], &out_path);
    let watch = client(&cluster.ps_address(0), "ps:0", TOKEN);
    eventually(Duration::from_secs(120), "20 updates on ps:0", || watch.status().is_ok_and(|s| s.version >= 20));
    let mut victim = workers[1].take().unwrap();
    victim.kill().unwrap();
    victim.wait().unwrap();
    let out = wait(coordinator, Instant::now() + Duration::from_secs(300));
    ok(&out);
    let summary = read_json(&out_path);
    // 6 epochs of 23 batches, every one applied exactly once on each ps task.
    for t in ps_tasks(&summary) {
        assert_eq!(t["pushes_applied"], 138, "{t}");
    }
    assert!(summary["parameter_servers"]["coordinator"]["worker_failures"].as_u64().unwrap() >= 1);
    stop(ps.into_iter().chain(workers.into_iter().flatten()).collect());
}

/// A worker task that starts after the job began (the coordinator starts without it after its
/// start grace, 10 s) is given steps once it answers, and every step is still applied once.
#[test]
fn a_worker_that_starts_after_the_job_began_is_given_steps() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("out.json");
    let cluster = Cluster::new(3, 1);
    let ps = vec![start_ps(&cluster, 0, &[])];
    let mut workers: Vec<Child> = (0..2).map(|i| start_worker(&cluster, i, &["--slowdown", "3"])).collect();
    let coordinator = start_coordinator(&cluster, &["--epochs", "12", "--batch", "64"], &out_path);
    let watch = client(&cluster.ps_address(0), "ps:0", TOKEN);
    eventually(Duration::from_secs(120), "20 updates on ps:0", || watch.status().is_ok_and(|s| s.version >= 20));
    workers.push(start_worker(&cluster, 2, &["--slowdown", "3"]));
    let out = wait(coordinator, Instant::now() + Duration::from_secs(300));
    ok(&out);
    let summary = read_json(&out_path);
    let t = &ps_tasks(&summary)[0];
    // 12 epochs of 23 batches, every one applied exactly once.
    assert_eq!(t["pushes_applied"], 276, "{t}");
    let late = t["applied_by_worker"]["worker:2"].as_u64().unwrap_or(0);
    assert!(late > 0, "worker:2 was given steps once it answered: {t}");
    stop(ps.into_iter().chain(workers).collect());
}

#[test]
fn a_ps_killed_and_restored_resumes_from_its_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("out.json");
    let cluster = Cluster::new(2, 2);
    let ckpt = |i: usize| dir.path().join(format!("ps-{i}"));
    let ckpt1 = ckpt(1).to_string_lossy().to_string();
    let mut ps: Vec<Option<Child>> =
        (0..2).map(|i| Some(start_ps(&cluster, i, &["--checkpoint-dir", &ckpt(i).to_string_lossy()]))).collect();
    let workers: Vec<Child> = (0..2).map(|i| start_worker(&cluster, i, &["--slowdown", "3"])).collect();
    let every = 10u64;
    let coordinator = start_coordinator(
        &cluster,
        &[
            "--epochs",
            "8",
            "--batch",
            "64",
            "--checkpoint-dir",
            &dir.path().to_string_lossy(),
            "--checkpoint-every",
            "10",
        ],
        &out_path,
    );
    let watch = client(&cluster.ps_address(1), "ps:1", TOKEN);
    eventually(Duration::from_secs(120), "a checkpoint of ps:1 and 35 updates", || {
        ckpt(1).join("latest").exists() && watch.status().is_ok_and(|s| s.version >= 35)
    });
    let mut victim = ps[1].take().unwrap();
    victim.kill().unwrap();
    victim.wait().unwrap();
    ps[1] = Some(start_ps(&cluster, 1, &["--checkpoint-dir", &ckpt1, "--restore", &ckpt1]));
    let out = wait(coordinator, Instant::now() + Duration::from_secs(300));
    ok(&out);
    let summary = read_json(&out_path);
    let tasks = ps_tasks(&summary);
    let steps = 8 * 23;
    assert_eq!(tasks[0]["pushes_applied"], steps, "ps:0 lost nothing");
    let restored_step = tasks[1]["restored_step"].as_u64().unwrap();
    let restored_version = tasks[1]["restored_version"].as_u64().unwrap();
    assert!(restored_step > 0 && restored_version > 0, "ps:1 did not restore: {}", tasks[1]);
    let lost = steps - tasks[1]["version"].as_u64().unwrap();
    // Updates applied after the last checkpoint and before the kill are lost: at most the
    // checkpoint interval plus the steps in flight (one per worker).
    assert!(lost <= every + 2, "ps:1 lost {lost} updates, more than the checkpoint interval allows");
    stop(ps.into_iter().flatten().chain(workers).collect());
}

#[test]
fn sync_mode_with_a_backup_worker_does_not_wait_for_a_5x_straggler() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("out.json");
    let mut cmd = strata();
    cmd.args(["train", "--strategy", "parameter-server", "--ps-tasks", "1", "--workers", "3", "--ps-mode", "sync"])
        .args(["--backup-workers", "1", "--worker-slowdown", "2=5", "--epochs", "3", "--batch", "64", "--no-progress"])
        .arg("--out")
        .arg(&out_path);
    let out = wait(spawn(cmd), Instant::now() + Duration::from_secs(300));
    ok(&out);
    let summary = read_json(&out_path);
    let t = &ps_tasks(&summary)[0];
    let by = |w: &str| t["applied_by_worker"][w].as_u64().unwrap_or(0);
    let (slow, fast) = (by("worker:2"), by("worker:0").min(by("worker:1")));
    // Rounds close with the two fast workers; the straggler's late pushes are dropped (at most
    // the last round of an epoch, drained, may take its update).
    assert!(slow <= 3 + 1, "the straggler contributed to {slow} rounds: rounds waited for it");
    assert!(fast >= 4 * slow.max(1), "fast workers applied only {fast} updates");
    assert!(t["pushes_dropped"].as_u64().unwrap() >= 1);
}

#[test]
fn bad_tf_config_is_a_one_line_error_that_says_what_to_fix() {
    let cases = [
        (r#"{"cluster":{"chief":["127.0.0.1:1"],"worker":["127.0.0.1:2"]},"task":{"type":"chief","index":0}}"#, "ps"),
        (
            r#"{"cluster":{"chief":["127.0.0.1:1","127.0.0.1:5"],"worker":["127.0.0.1:2"],"ps":["127.0.0.1:3"]},"task":{"type":"chief","index":0}}"#,
            "chief",
        ),
        (
            r#"{"cluster":{"chief":["127.0.0.1:1"],"worker":["127.0.0.1:2"],"ps":["127.0.0.1:3"]},"task":{"type":"ps","index":4}}"#,
            "index",
        ),
        (
            r#"{"cluster":{"chief":["127.0.0.1:1"],"worker":["localhost"],"ps":["127.0.0.1:3"]},"task":{"type":"chief","index":0}}"#,
            "localhost",
        ),
    ];
    for (json, needle) in cases {
        let out = strata()
            .args(["train", "--strategy", "parameter-server", "--no-progress"])
            .env("TF_CONFIG", json)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{json}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{json}: not one line: {err}");
        assert!(err.contains(needle), "{json}: {err} does not mention {needle}");
    }
}

/// Writes a cluster's TLS directory into `dir`: a CA and one identity (a certificate for
/// localhost and 127.0.0.1, server and client use) that every task shares.
fn write_tls_dir(dir: &Path) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "strata test cluster CA");
    let ca_key = KeyPair::generate().unwrap();
    let ca = ca.self_signed(&ca_key).unwrap();
    let mut task = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    task.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    let key = KeyPair::generate().unwrap();
    let cert = task.signed_by(&key, &ca, &ca_key).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    std::fs::write(dir.join("cert.pem"), cert.pem()).unwrap();
    std::fs::write(dir.join("key.pem"), key.serialize_pem()).unwrap();
}

/// (6) With STRATA_TLS_DIR every process of a parameter-server job (coordinator, ps tasks,
/// workers) talks mutual TLS, and the job trains with every push applied once; a TLS
/// directory that lacks its files stops the job with an error naming the file.
#[test]
fn a_job_over_mutual_tls_trains_and_a_broken_tls_dir_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let tls = dir.path().join("tls");
    std::fs::create_dir(&tls).unwrap();
    write_tls_dir(&tls);
    let out_path = dir.path().join("out.json");
    let mut cmd = strata();
    cmd.env("STRATA_TLS_DIR", &tls)
        .args(["train", "--strategy", "parameter-server", "--ps-tasks", "1", "--workers", "2"])
        .args(["--epochs", "2", "--no-progress", "--out"])
        .arg(&out_path);
    let out = wait(spawn(cmd), Instant::now() + Duration::from_secs(300));
    ok(&out);
    let tasks = ps_tasks(&read_json(&out_path));
    // 2 epochs of ceil(1438 / 256) = 6 steps, each applied once.
    assert_eq!((tasks[0]["pushes_applied"].as_u64(), tasks[0]["version"].as_u64()), (Some(12), Some(12)), "{tasks:?}");

    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let mut cmd = strata();
    cmd.env("STRATA_TLS_DIR", &empty).args([
        "train",
        "--strategy",
        "parameter-server",
        "--epochs",
        "1",
        "--no-progress",
    ]);
    let out = wait(spawn(cmd), Instant::now() + Duration::from_secs(120));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("ca.pem") && stderr.contains("STRATA_TLS_DIR"), "{stderr}");
}

/// The processes whose parent is `parent` and whose `STRATA_TASK` is `task`.
fn children_named(parent: u32, task: &str) -> Vec<i32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        let ppid = stat.rsplit_once(") ").and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if ppid != Some(parent) {
            continue;
        }
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        if environ.split(|b| *b == 0).any(|v| v == format!("STRATA_TASK={task}").as_bytes()) {
            found.push(pid);
        }
    }
    found
}

#[test]
fn a_stopped_ps_task_ends_the_job_within_the_heartbeat_timeout() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = strata();
    cmd.args(["train", "--strategy", "parameter-server", "--ps-tasks", "2", "--workers", "2", "--no-progress"])
        .args(["--epochs", "1000", "--batch", "64", "--metrics"])
        .arg(dir.path().join("m.jsonl"));
    let coordinator = spawn(cmd);
    // Training is under way once steps are recorded.
    eventually(Duration::from_secs(120), "the first steps", || {
        std::fs::read_to_string(dir.path().join("m.jsonl")).is_ok_and(|t| t.lines().count() >= 10)
    });
    let ps1 = children_named(coordinator.id(), "ps:1");
    assert_eq!(ps1.len(), 1, "one ps:1 process");
    kill(Pid::from_raw(ps1[0]), Signal::SIGSTOP).unwrap();
    let stopped = Instant::now();
    let out = wait(coordinator, stopped + Duration::from_secs(30));
    let took = stopped.elapsed();
    let _ = kill(Pid::from_raw(ps1[0]), Signal::SIGKILL);
    let err = String::from_utf8_lossy(&out.stderr);
    let last = err.lines().rfind(|l| l.starts_with("error:")).unwrap_or("");
    eprintln!("the coordinator failed {took:?} after ps:1 stopped: {last}");
    assert!(!out.status.success(), "{err}");
    assert!(last.contains("lost task ps:1"), "{err}");
    assert!(last.contains("step") && last.contains("completed"), "what the job was doing: {err}");
    assert!(
        took < Duration::from_secs(3 + 3),
        "{took:?} (asked for: a 3 s timeout + 1 s; asserted with 2 s more for a loaded machine)"
    );
}

#[test]
fn a_stopped_worker_has_its_steps_run_elsewhere_and_no_step_is_lost() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("out.json");
    let cluster = Cluster::new(3, 2);
    let ps: Vec<Child> = (0..2).map(|i| start_ps(&cluster, i, &[])).collect();
    let workers: Vec<Child> = (0..3).map(|i| start_worker(&cluster, i, &["--slowdown", "3"])).collect();
    let coordinator = start_coordinator(&cluster, &["--epochs", "6", "--batch", "64"], &out_path);
    let watch = client(&cluster.ps_address(0), "ps:0", TOKEN);
    eventually(Duration::from_secs(120), "20 updates on ps:0", || watch.status().is_ok_and(|s| s.version >= 20));
    // Stopped, not dead: its connections stay open and its step never answers.
    kill(Pid::from_raw(workers[1].id() as i32), Signal::SIGSTOP).unwrap();
    let out = wait(coordinator, Instant::now() + Duration::from_secs(300));
    let _ = kill(Pid::from_raw(workers[1].id() as i32), Signal::SIGKILL);
    ok(&out);
    let summary = read_json(&out_path);
    for t in ps_tasks(&summary) {
        assert_eq!(t["pushes_applied"], 138, "6 epochs of 23 steps, each applied once: {t}");
    }
    assert!(summary["parameter_servers"]["coordinator"]["worker_failures"].as_u64().unwrap() >= 1);
    stop(ps.into_iter().chain(workers).collect());
}

#[test]
fn the_chief_ends_every_task_of_a_finished_job_and_they_exit_0() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("out.json");
    let cluster = Cluster::new(2, 1);
    let ps = start_ps(&cluster, 0, &[]);
    let workers: Vec<Child> = (0..2).map(|i| start_worker(&cluster, i, &[])).collect();
    let coordinator = start_coordinator(&cluster, &["--epochs", "2", "--batch", "64"], &out_path);
    ok(&wait(coordinator, Instant::now() + Duration::from_secs(300)));
    // Told by the chief, each task stops serving and exits 0 by itself.
    for (task, child) in std::iter::once(("ps:0", ps)).chain(["worker:0", "worker:1"].into_iter().zip(workers)) {
        let out = wait(child, Instant::now() + Duration::from_secs(30));
        ok(&out);
        let err = String::from_utf8_lossy(&out.stderr);
        let line = format!("{task}: the chief finished training; the job is over, exiting");
        assert!(err.lines().any(|l| l == line), "{task} did not say why it ended:\n{err}");
    }
}

#[test]
fn tasks_whose_chief_is_killed_stop_serving_after_their_chief_timeout() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("out.json");
    let cluster = Cluster::new(1, 1);
    let timeout = ["--chief-timeout", "2s"];
    let ps = start_ps(&cluster, 0, &timeout);
    let worker = start_worker(&cluster, 0, &[&timeout[..], &["--slowdown", "3"]].concat());
    let coordinator = start_coordinator(&cluster, &["--epochs", "1000", "--batch", "64"], &out_path);
    let watch = client(&cluster.ps_address(0), "ps:0", TOKEN);
    eventually(Duration::from_secs(120), "10 updates on ps:0", || watch.status().is_ok_and(|s| s.version >= 10));
    drop(watch);
    kill(Pid::from_raw(coordinator.id() as i32), Signal::SIGKILL).unwrap();
    let _ = wait(coordinator, Instant::now() + Duration::from_secs(10));
    // No call for 2 s: each task ends with one line that says why, exit code 1.
    for (task, child) in [("ps:0", ps), ("worker:0", worker)] {
        let out = wait(child, Instant::now() + Duration::from_secs(30));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{task}:\n{err}");
        let last = err.lines().rfind(|l| l.starts_with("error:")).unwrap_or("");
        assert!(
            last.starts_with(&format!("error: {task}: no call from the chief or any task for "))
                && last.contains("the job's chief is gone")
                && last.contains("--chief-timeout"),
            "{task}'s last line: {last}\n{err}"
        );
    }
}

#[test]
fn a_chief_timeout_that_is_not_a_duration_is_refused() {
    let out = strata().args(["ps", "--address", "127.0.0.1:1", "--chief-timeout", "soon"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--chief-timeout") && err.contains("soon"), "{err}");
}

#[test]
fn no_lookahead_outside_a_parameter_server_job_is_refused() {
    let out = strata().args(["train", "--strategy", "mirrored", "--no-lookahead", "--no-progress"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(err.contains("--no-lookahead applies to --strategy parameter-server") && err.contains("drop it"), "{err}");
}

/// `--stale-rate inverse` where no push to a ps task's dense variables can be stale (another
/// strategy, sync mode, hybrid, whose dense layers are all-reduced) is one line naming the
/// flag, before any task starts.
#[test]
fn a_stale_rate_where_no_push_is_stale_is_refused() {
    for (job, names) in [
        (&["--strategy", "mirrored"][..], "--strategy mirrored"),
        (&["--strategy", "parameter-server", "--ps-mode", "sync"][..], "--ps-mode sync"),
        (&["--strategy", "parameter-server", "--ps-mode", "hybrid", "--model", "ctr"][..], "--ps-mode hybrid"),
    ] {
        let mut args = vec!["train", "--stale-rate", "inverse", "--no-progress"];
        args.extend_from_slice(job);
        let out = strata().args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
        assert!(err.contains("--stale-rate applies to") && err.contains(names) && err.contains("drop it"), "{err}");
    }
}

#[test]
fn a_timeline_of_a_parameter_server_job_is_refused_before_any_task_starts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("timeline.json");
    let out = strata()
        .args(["train", "--strategy", "parameter-server", "--no-progress", "--timeline"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(err.contains("--timeline") && err.contains("--metrics") && err.contains("drop it"), "{err}");
    assert!(!path.exists(), "nothing written");
}

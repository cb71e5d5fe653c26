//! A parameter-server job's checkpoint restored onto another number of ps tasks, with real
//! processes: `strata train --model ctr` on 2 ps tasks writes checkpoints (`--checkpoint-dir`:
//! `ps-0`, `ps-1`); 3 `strata ps --restore DIR` processes serve, once the variables are created
//! as a coordinator of 3 tasks creates them, every dense variable and every table row of the
//! checkpoint bit for bit (pulled, and in a checkpoint of theirs: values, optimizer slots,
//! versions, when each row was last seen); a chief and a worker started against them resume
//! from the checkpoint's step and train on; and the 3 tasks' checkpoints restore onto 2 the
//! same way. Every process has a hard deadline.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use strata::cluster::{ClusterSpec, TaskType};
use strata::ps::{job_task_dir, read_snapshot, PsClient, PsClientConfig, Snapshot};
use strata::ps_job::{CtrShape, PsJobModel, PsJobSpec};
use strata::{ClusterToken, ParameterServerOptions, ParameterServerStrategy};
use strata_integration_tests::{free_ports, strata, wait, TOKEN};

/// The ctr model's flags, the same for every job.
const MODEL: [&str; 10] = [
    "--model",
    "ctr",
    "--embedding-rows",
    "5000",
    "--embedding-dim",
    "8",
    "--train-records",
    "4000",
    "--test-records",
    "1000",
];

/// 4000 records in batches of 256.
const STEPS_PER_EPOCH: u64 = 16;

/// A chief, one worker and `ps` ps tasks on free loopback ports.
struct Cluster {
    ports: Vec<u16>,
    ps: usize,
}

impl Cluster {
    fn new(ps: usize) -> Self {
        Self { ports: free_ports(2 + ps), ps }
    }

    fn address(&self, i: usize) -> String {
        format!("127.0.0.1:{}", self.ports[i])
    }

    fn ps_addresses(&self) -> Vec<String> {
        (0..self.ps).map(|i| self.address(2 + i)).collect()
    }

    fn tf_config(&self, kind: &str, index: usize) -> String {
        let list = |v: Vec<String>| v.iter().map(|a| format!("\"{a}\"")).collect::<Vec<_>>().join(",");
        format!(
            r#"{{"cluster":{{"chief":["{}"],"worker":["{}"],"ps":[{}]}},"task":{{"type":"{kind}","index":{index}}}}}"#,
            self.address(0),
            self.address(1),
            list(self.ps_addresses())
        )
    }

    /// `strata <subcommand>` as task `index` of `kind`.
    fn command(&self, subcommand: &str, kind: &str, index: usize) -> Command {
        let mut cmd = strata();
        cmd.arg(subcommand).env("TF_CONFIG", self.tf_config(kind, index));
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        cmd
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

fn stop(children: Vec<Child>) {
    for mut c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn client(address: &str, task: &str) -> PsClient {
    let config = PsClientConfig { timeout: Duration::from_secs(20), retry_for: Duration::from_secs(60) };
    PsClient::connect(address, task, ClusterToken::new(TOKEN).unwrap(), config).unwrap()
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Whole dense variables: values, optimizer slots (bits) and version.
type Dense = BTreeMap<String, (Vec<u32>, Vec<Vec<u32>>, u64)>;
/// Table rows by (table, id): values, slots (bits) and when last seen.
type Rows = BTreeMap<(String, u64), (Vec<u32>, Vec<u32>, u64)>;

/// The dense variables and table rows of every task's snapshot, put together; each task's
/// tables must be its shard of `snaps.len()`.
fn held(snaps: &[Snapshot]) -> (Dense, Rows) {
    let (mut dense, mut rows) = (Dense::new(), Rows::new());
    for (k, snap) in snaps.iter().enumerate() {
        for (info, version, value, slots) in &snap.variables {
            let row: usize = info.full_shape.iter().skip(1).product();
            let at = info.row_offset as usize * row..info.row_offset as usize * row + value.len();
            let n: usize = info.full_shape.iter().product();
            let whole =
                dense.entry(info.variable.clone()).or_insert_with(|| (vec![0; n], vec![vec![0; n]; slots.len()], 0));
            whole.0[at.clone()].copy_from_slice(&bits(value));
            for (w, s) in whole.1.iter_mut().zip(slots) {
                w[at.clone()].copy_from_slice(&bits(s));
            }
            whole.2 = *version;
        }
        for t in &snap.tables {
            assert_eq!((t.info.shard as usize, t.info.num_shards as usize), (k, snaps.len()), "{}", t.info.config.name);
            let (dim, width) = (t.info.config.dim, t.slots.len() / t.ids.len().max(1));
            for (r, &id) in t.ids.iter().enumerate() {
                let row = (bits(&t.values[r * dim..][..dim]), bits(&t.slots[r * width..][..width]), t.last_seen[r]);
                assert!(rows.insert((t.info.config.name.clone(), id), row).is_none(), "row {id} held twice");
            }
        }
    }
    (dense, rows)
}

/// Starts the ps tasks of `cluster`, each restoring the job's checkpoint in `old` and writing
/// its own under `new/ps-<k>`, and checks that they serve the checkpoint of `step` (the latest
/// every old task has) bit for bit once a coordinator of the new job created the variables.
fn restore_and_check(cluster: &Cluster, old: &Path, old_tasks: usize, new: &Path, step: u64) -> Vec<Child> {
    let children: Vec<Child> = (0..cluster.ps)
        .map(|k| {
            let mut cmd = cluster.command("ps", "ps", k);
            cmd.arg("--restore").arg(old).arg("--checkpoint-dir").arg(job_task_dir(new, k));
            cmd.spawn().unwrap()
        })
        .collect();
    let clients: Vec<PsClient> =
        cluster.ps_addresses().iter().enumerate().map(|(k, a)| client(a, &format!("ps:{k}"))).collect();
    let status = clients[0].status().unwrap();
    for (k, c) in clients.iter().enumerate() {
        assert_eq!(c.status().unwrap().restored_step, step, "ps:{k} restored the latest common step");
    }
    let old_snaps: Vec<Snapshot> = (0..old_tasks)
        .map(|i| read_snapshot(&job_task_dir(old, i).join(strata::checkpoint::checkpoint_dir_name(step))).unwrap().0)
        .collect();
    let want = held(&old_snaps);
    // The coordinator of a job of `cluster.ps` tasks creates the variables (its placement).
    let mut options = ParameterServerOptions::new(ClusterToken::new(TOKEN).unwrap());
    options.optimizer = status.optimizer.clone().unwrap();
    options.schedule = status.schedule.clone();
    options.stale_rate = status.stale_rate;
    options.mode = status.mode;
    options.table_optimizer = status.tables[0].info.optimizer.clone();
    options.seed = status.tables[0].info.seed;
    let spec = ClusterSpec::new([(TaskType::Ps, cluster.ps_addresses()), (TaskType::Worker, vec![cluster.address(1)])]);
    let strategy = ParameterServerStrategy::new(spec.unwrap(), options).unwrap();
    let shape = CtrShape { embedding_rows: 5000, embedding_dim: 8, train_records: 4000, test_records: 1000 };
    let model = PsJobModel::build(&strategy, &PsJobSpec::ctr(shape, 0)).unwrap();
    assert_eq!(strategy.restored_step().unwrap(), step);
    // Pulled: every dense variable's values, bit for bit.
    let mut pulled = BTreeMap::new();
    for c in &clients {
        for (info, _, values) in c.pull(&[], 0).unwrap().variables {
            assert_eq!(info.num_parts, 1, "the ctr job splits no variable");
            pulled.insert(info.variable, bits(&values));
        }
    }
    let want_values: BTreeMap<String, Vec<u32>> = want.0.iter().map(|(n, v)| (n.clone(), v.0.clone())).collect();
    assert_eq!(pulled, want_values, "the dense variables pulled");
    assert_eq!(model.variables().len(), want_values.len());
    // Saved: values, slots and versions of the variables, and every table row.
    let new_snaps: Vec<Snapshot> = clients
        .iter()
        .enumerate()
        .map(|(k, c)| {
            c.checkpoint_of_job(step, cluster.ps as u32).unwrap();
            read_snapshot(&job_task_dir(new, k)).unwrap().0
        })
        .collect();
    let got = held(&new_snaps);
    assert!(!want.0.is_empty() && !want.1.is_empty(), "the checkpoint holds dense variables and table rows");
    assert_eq!(got.0, want.0, "dense variables: values, slots, versions");
    assert_eq!(got.1, want.1, "table rows: values, slots, last seen");
    children
}

/// `strata ps --restore` of a job's checkpoint without this task's place, or of an incomplete
/// set of old tasks (`partial`: `old`'s ps-0 alone), is refused in one line saying what to
/// change.
fn refusals(partial: &Path, old: &Path) {
    let run = |restore: &Path, extra: &[&str]| {
        let mut cmd = strata();
        cmd.args(["ps", "--address", "127.0.0.1:0"]).arg("--restore").arg(restore).args(extra);
        let out = wait(
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap(),
            Instant::now() + Duration::from_secs(60),
        );
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        (out.status.code(), stderr)
    };
    let (code, e) = run(old, &[]);
    assert_eq!(code, Some(2), "{e}");
    assert!(e.contains("holds the checkpoints of a job's 2 ps tasks (ps-0, ps-1, ...): pass --ps-tasks N"), "{e}");
    std::fs::create_dir(partial).unwrap();
    std::os::unix::fs::symlink(job_task_dir(old, 0), job_task_dir(partial, 0)).unwrap();
    let (code, e) = run(partial, &["--ps-tasks", "3", "--task-index", "1"]);
    assert_eq!(code, Some(2), "{e}");
    assert!(e.contains("but their checkpoints of step 15 were written by a job of 2 ps tasks"), "{e}");
}

#[test]
fn a_ctr_job_checkpoint_restores_onto_three_ps_tasks_and_back_onto_two() {
    let dir = tempfile::tempdir().unwrap();
    let (old, new, newer) = (dir.path().join("two"), dir.path().join("three"), dir.path().join("two-again"));
    // 1 epoch of 16 steps on 2 ps tasks, checkpoints every 5: steps 5, 10, 15.
    let first = dir.path().join("first.json");
    let mut cmd = strata();
    cmd.args(["train", "--strategy", "parameter-server", "--ps-tasks", "2", "--workers", "1"])
        .args(MODEL)
        .args(["--epochs", "1", "--checkpoint-every", "5", "--no-progress", "--checkpoint-dir"])
        .arg(&old)
        .arg("--out")
        .arg(&first)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    ok(&wait(cmd.spawn().unwrap(), Instant::now() + Duration::from_secs(300)));

    refusals(&dir.path().join("partial"), &old);

    // Onto 3 ps tasks, then a chief and a worker of 2 epochs resume from step 15.
    let cluster = Cluster::new(3);
    let mut ps = restore_and_check(&cluster, &old, 2, &new, 15);
    let out = dir.path().join("resumed.json");
    let worker = cluster.command("worker", "worker", 0).spawn().unwrap();
    let mut chief = cluster.command("train", "chief", 0);
    chief
        .args(["--strategy", "parameter-server"])
        .args(MODEL)
        .args(["--epochs", "2", "--checkpoint-every", "5", "--no-progress", "--checkpoint-dir"])
        .arg(&new)
        .arg("--out")
        .arg(&out);
    let done = wait(chief.spawn().unwrap(), Instant::now() + Duration::from_secs(300));
    ps.push(worker);
    ok(&done);
    let summary = read_json(&out);
    let tasks = summary["parameter_servers"]["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 3);
    for t in tasks {
        // The steps after 15 of 2 epochs of 16, one update each on every task.
        let (restored, version) = (t["restored_version"].as_u64().unwrap(), t["version"].as_u64().unwrap());
        assert_eq!(t["restored_step"].as_u64(), Some(15), "{t}");
        assert_eq!(version - restored, 2 * STEPS_PER_EPOCH - 15, "{t}");
    }
    let auc = summary["final_test_auc"].as_f64().unwrap();
    assert!(auc > 0.5, "the resumed job trains on: test auc {auc}");
    // Its checkpoints go on from the step it resumed from.
    let last = strata::checkpoint::latest_checkpoint(&job_task_dir(&new, 2)).unwrap().unwrap();
    assert!(last.ends_with(strata::checkpoint::checkpoint_dir_name(30)), "{}", last.display());
    stop(ps);

    // The 3 tasks' checkpoints onto 2.
    let cluster = Cluster::new(2);
    stop(restore_and_check(&cluster, &new, 3, &newer, 30));
}

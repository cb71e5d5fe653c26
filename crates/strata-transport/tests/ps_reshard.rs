//! A whole job's checkpoint restored onto another number of ps tasks over real gRPC on
//! loopback: two tasks train a variable split in parts, a whole one and a table, and checkpoint
//! as a job of 2 (`ps-0`, `ps-1`); three tasks started with `restore` on that directory serve,
//! once the coordinator creates the variables in other parts on other tasks, the checkpoint's
//! values bit for bit, hold the table's rows they own with their slots, and train on.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use strata_core::embedding::{owner_of, RowInit, TableConfig, TableSize};
use strata_transport::ps::{
    job_task_dir, read_snapshot, PsClient, PsClientConfig, PsMode, PsServerConfig, PsServerHandle, RowGrads,
    RowOptimizer, ServerOptimizer, StaleRate, TableInfo, UpdateId, VariableInfo, WireFormat,
};
use strata_transport::ClusterToken;

use crate::common::within_limit;

const MOMENTUM: ServerOptimizer = ServerOptimizer::Momentum { lr: 0.05, momentum: 0.9, nesterov: false };
const ROWS: u64 = 100;

fn token() -> ClusterToken {
    ClusterToken::new("0123456789abcdef0123456789abcdef").unwrap()
}

/// Task `k` of a job of `m`, writing checkpoints under `root/ps-k`, restored from `restore`.
fn start(k: usize, m: usize, root: &Path, restore: Option<&Path>) -> (PsServerHandle, PsClient) {
    let task = format!("ps:{k}");
    let mut config = PsServerConfig::new(task.clone(), token());
    config.checkpoint_dir = Some(job_task_dir(root, k));
    config.restore = restore.map(Path::to_path_buf);
    config.job_place = Some((k as u32, m as u32));
    let server = PsServerHandle::start("127.0.0.1:0".parse().unwrap(), config).unwrap();
    let rpc = PsClientConfig { timeout: Duration::from_secs(30), retry_for: Duration::from_secs(30) };
    let client = PsClient::connect(&server.address().to_string(), &task, token(), rpc).unwrap();
    (server, client)
}

fn table(shard: usize, num_shards: usize) -> TableInfo {
    let config =
        TableConfig { name: "emb".into(), dim: 4, size: TableSize::Rows(ROWS), init: RowInit::Normal { std: 0.5 } };
    let optimizer = RowOptimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-7 };
    TableInfo { config, seed: 11, shard: shard as u32, num_shards: num_shards as u32, optimizer }
}

/// Each task's variables in a job of `m` tasks: `w` (`[6, 2]`) in `m` parts of equal rows, one
/// per task, and `b` (`[3]`) on the last task.
fn placement(m: usize) -> Vec<Vec<VariableInfo>> {
    let rows = 6 / m;
    let mut tasks: Vec<Vec<VariableInfo>> = (0..m)
        .map(|k| {
            vec![VariableInfo {
                name: format!("w/part_{k}"),
                shape: vec![rows, 2],
                variable: "w".into(),
                part: k as u32,
                num_parts: m as u32,
                row_offset: (k * rows) as u64,
                full_shape: vec![6, 2],
                state: false,
            }]
        })
        .collect();
    tasks[m - 1].push(VariableInfo::whole("b", vec![3]));
    tasks
}

/// The elements of `info` in its whole variable.
fn range(info: &VariableInfo) -> std::ops::Range<usize> {
    let start = info.row_offset as usize * info.full_shape.iter().skip(1).product::<usize>();
    start..start + info.numel()
}

/// Element `e` of variable `var`'s initial value (`step` 0) or gradient at `step`.
fn value(var: &str, e: usize, step: u64) -> f32 {
    ((e as f32 + 1.5) * 0.61 + var.len() as f32 + step as f32 * 1.3).cos()
}

/// One step of a job whose tasks are `tasks`: each pulls the batch's rows it owns and pushes
/// its parts' gradients and those rows'.
fn step(tasks: &[(PsServerHandle, PsClient)], parts: &[Vec<VariableInfo>], step: u64) {
    let m = tasks.len();
    let batch: Vec<u64> = (0..8).map(|j| (step * 13 + j * 17) % ROWS).collect();
    for (k, ((_, c), parts)) in tasks.iter().zip(parts).enumerate() {
        let mine: Vec<u64> = batch.iter().copied().filter(|&id| owner_of(TableSize::Rows(ROWS), id, m) == k).collect();
        c.pull_rows("worker:0", step, &[("emb", &mine)]).unwrap();
        let grads: Vec<Vec<f32>> =
            parts.iter().map(|p| range(p).map(|e| value(&p.variable, e, step)).collect()).collect();
        let dense: Vec<(&str, &[f32])> = parts.iter().zip(&grads).map(|(p, g)| (p.name.as_str(), &g[..])).collect();
        let g = mine.iter().flat_map(|&id| (0..4).map(move |j| value("row", id as usize * 4 + j, step))).collect();
        let rows = [RowGrads { table: "emb".into(), lease: step, ids: mine.clone(), grads: g }];
        let id = UpdateId { worker: "worker:0".into(), client: "coordinator-x".into(), step, seq: 0 };
        let base = c.status().unwrap().version;
        let rows: &[RowGrads] = if mine.is_empty() { &[] } else { &rows };
        c.push_rows(&id, base, &dense, rows).unwrap();
    }
}

/// Whole variables (values and slots, as bits) and table rows (values, slots, last seen, as
/// bits) in the checkpoints of every task of a job under `root`.
type Held = (BTreeMap<String, (Vec<u32>, Vec<u32>)>, BTreeMap<u64, (Vec<u32>, Vec<u32>, u64)>);

fn held(root: &Path, m: usize) -> Held {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let (mut wholes, mut rows) = (BTreeMap::new(), BTreeMap::new());
    for k in 0..m {
        let (snap, _) = read_snapshot(&job_task_dir(root, k)).unwrap();
        for (info, _, value, slots) in snap.variables {
            let n: usize = info.full_shape.iter().product();
            let (v, s) = wholes.entry(info.variable.clone()).or_insert_with(|| (vec![0; n], vec![0; n]));
            v[range(&info)].copy_from_slice(&bits(&value));
            s[range(&info)].copy_from_slice(&bits(&slots[0]));
        }
        let t = &snap.tables[0];
        for (r, &id) in t.ids.iter().enumerate() {
            assert_eq!(owner_of(TableSize::Rows(ROWS), id, m), k, "row {id} is on its owner");
            rows.insert(id, (bits(&t.values[r * 4..][..4]), bits(&t.slots[r * 4..][..4]), t.last_seen[r]));
        }
    }
    (wholes, rows)
}

#[test]
fn a_job_checkpoint_restores_onto_three_tasks_over_grpc() {
    within_limit("a_job_checkpoint_restores_onto_three_tasks_over_grpc", || {
        let (old_root, new_root) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let old: Vec<_> = (0..2).map(|k| start(k, 2, old_root.path(), None)).collect();
        let old_parts = placement(2);
        for (k, ((_, c), parts)) in old.iter().zip(&old_parts).enumerate() {
            let values: Vec<Vec<f32>> =
                parts.iter().map(|p| range(p).map(|e| value(&p.variable, e, 0)).collect()).collect();
            let vars: Vec<(VariableInfo, &[f32])> = parts.iter().cloned().zip(values.iter().map(|v| &v[..])).collect();
            c.create_with_tables(
                &vars,
                &[table(k, 2)],
                &MOMENTUM,
                None,
                StaleRate::Constant,
                PsMode::Async,
                WireFormat::F32,
            )
            .unwrap();
        }
        for s in 1..=3 {
            step(&old, &old_parts, s);
        }
        for (_, c) in &old {
            c.checkpoint_of_job(3, 2).unwrap();
        }
        let pulled_old: Vec<Vec<f32>> = {
            let mut whole = vec![0f32; 12];
            for ((_, c), parts) in old.iter().zip(&old_parts) {
                let p = c.pull(&[parts[0].name.as_str()], 0).unwrap();
                whole[range(&parts[0])].copy_from_slice(&p.variables[0].2);
            }
            let b = old[1].1.pull(&["b"], 0).unwrap().variables[0].2.clone();
            vec![whole, b]
        };
        let at_checkpoint = held(old_root.path(), 2);

        // Without its place in the new job, a task refuses the job's checkpoint.
        let mut config = PsServerConfig::new("ps:0", token());
        config.restore = Some(old_root.path().to_path_buf());
        let e = PsServerHandle::start("127.0.0.1:0".parse().unwrap(), config).map(|_| ()).unwrap_err();
        assert!(e.to_string().contains("holds the checkpoints of a job's 2 ps tasks"), "{e}");

        let new: Vec<_> = (0..3).map(|k| start(k, 3, new_root.path(), Some(old_root.path()))).collect();
        let new_parts = placement(3);
        for (k, ((_, c), parts)) in new.iter().zip(&new_parts).enumerate() {
            let status = c.status().unwrap();
            assert_eq!((status.restored_step, status.version, status.variables.len()), (3, 3, 0), "ps:{k}");
            let garbage: Vec<Vec<f32>> = parts.iter().map(|p| vec![7.0; p.numel()]).collect();
            let vars: Vec<(VariableInfo, &[f32])> = parts.iter().cloned().zip(garbage.iter().map(|v| &v[..])).collect();
            let out = c.create_with_tables(
                &vars,
                &[table(k, 3)],
                &MOMENTUM,
                None,
                StaleRate::Constant,
                PsMode::Async,
                WireFormat::F32,
            );
            assert!(out.unwrap().existed, "ps:{k} serves the checkpoint's values");
            for p in parts {
                let pulled = c.pull(&[p.name.as_str()], 0).unwrap();
                let whole = if p.variable == "w" { &pulled_old[0][range(p)] } else { &pulled_old[1][..] };
                assert_eq!(pulled.variables[0].2, whole, "{} on ps:{k}", p.name);
            }
            c.checkpoint_of_job(3, 3).unwrap();
        }
        assert_eq!(held(new_root.path(), 3), at_checkpoint, "values, slots, rows and last seen, bit for bit");
        // Training goes on: every task applies the next step.
        step(&new, &new_parts, 4);
        for (k, (_, c)) in new.iter().enumerate() {
            assert_eq!(c.status().unwrap().version, 4, "ps:{k}");
        }
    });
}

//! Tests of a whole job's checkpoint restored onto another number of ps tasks, through the
//! tasks' public API: a job of `n` tasks (a dense variable split in parts by a partitioner,
//! whole ones, a table sharded by rows) trains, checkpoints and goes on; a job of `m` tasks
//! restored from the checkpoint, its variables created in other parts on other tasks, goes on
//! with the same gradients and ends with the same bits.

use std::collections::BTreeMap;
use std::path::Path;

use bytes::Bytes;
use strata_core::embedding::{owner_of, RowInit, TableConfig, TableSize};

use crate::{
    job_checkpoint_tasks, job_task_dir, read_job_checkpoint, read_job_checkpoint_at, read_snapshot, write_job_snapshot,
    write_snapshot, Chunk, CreateHeader, Error, ErrorKind, PsMode, PushHeader, RowGrads, RowOptimizer, RowPull,
    ServerOptimizer, State, TableInfo, UpdateId, VariableInfo, WireFormat,
};

const ADAMW: ServerOptimizer =
    ServerOptimizer::AdamW { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-7, weight_decay: 0.1 };
const ADAGRAD: RowOptimizer = RowOptimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-7 };
const TABLE_ROWS: u64 = 40;
const DIM: usize = 3;

/// The job's whole variables: `w` (split in parts), `b` and the scalar `s`.
fn whole_shapes() -> [(&'static str, Vec<usize>); 3] {
    [("w", vec![7, 3]), ("b", vec![4]), ("s", vec![])]
}

fn f32s(x: &[f32]) -> Bytes {
    Bytes::copy_from_slice(bytemuck::cast_slice(x))
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Element `e` of variable `var`'s initial value (or, at `step`, of its gradient).
fn value(var: &str, e: usize, step: Option<u64>) -> f32 {
    let salt = var.len() as f32 + step.map_or(0.0, |s| s as f32 * 1.7 + 0.3);
    ((e as f32 + 1.0) * 0.37 + salt).sin()
}

fn table(shard: u32, num_shards: u32) -> TableInfo {
    let init = RowInit::Uniform { low: -0.5, high: 0.5 };
    let config = TableConfig { name: "t".into(), dim: DIM, size: TableSize::Rows(TABLE_ROWS), init };
    TableInfo { config, seed: 3, shard, num_shards, optimizer: ADAGRAD }
}

/// Each task's parts of a job of `n` tasks whose partitioner splits `w` in `w_parts`: `w`'s
/// parts round robin from task 0, `b` on the last task, `s` on task 0.
fn placement(n: usize, w_parts: usize) -> Vec<Vec<VariableInfo>> {
    let mut tasks = vec![Vec::new(); n];
    let full = vec![7, 3];
    let mut offset = 0;
    for i in 0..w_parts {
        let rows = 7 / w_parts + usize::from(i < 7 % w_parts);
        tasks[i % n].push(VariableInfo {
            name: if w_parts > 1 { format!("w/part_{i}") } else { "w".into() },
            shape: vec![rows, 3],
            variable: "w".into(),
            part: i as u32,
            num_parts: w_parts as u32,
            row_offset: offset as u64,
            full_shape: full.clone(),
            state: false,
        });
        offset += rows;
    }
    tasks[n - 1].push(VariableInfo::whole("b", vec![4]));
    tasks[0].push(VariableInfo::whole("s", vec![]));
    tasks
}

/// The elements of `info`'s part in its whole variable.
fn range(info: &VariableInfo) -> std::ops::Range<usize> {
    let row: usize = info.full_shape.iter().skip(1).product();
    let start = info.row_offset as usize * row;
    start..start + info.numel()
}

/// The chunks of `infos`, element `e` of each part's variable given by `f`.
fn chunks(infos: &[VariableInfo], f: impl Fn(&str, usize) -> f32) -> Vec<Chunk> {
    let chunk = |(k, i): (usize, &VariableInfo)| {
        let v: Vec<f32> = range(i).map(|e| f(&i.variable, e)).collect();
        Chunk { var: k as u32, offset: 0, pieces: vec![f32s(&v)] }
    };
    infos.iter().enumerate().map(chunk).collect()
}

fn header(infos: &[VariableInfo], shard: u32, num_shards: u32) -> CreateHeader {
    CreateHeader {
        variables: infos.to_vec(),
        optimizer: ADAMW,
        schedule: None,
        stale_rate: crate::StaleRate::Constant,
        mode: PsMode::Async,
        wire_format: WireFormat::F32,
        tables: vec![table(shard, num_shards)],
    }
}

/// Whole variables (values, slots, version) and table rows (values, slots, last seen), as bits.
type Wholes = BTreeMap<String, (Vec<u32>, Vec<Vec<u32>>, u64)>;
type Rows = BTreeMap<u64, (Vec<u32>, Vec<u32>, u64)>;

/// A job's ps tasks and their parts.
struct Job {
    tasks: Vec<State>,
    parts: Vec<Vec<VariableInfo>>,
}

impl Job {
    /// A fresh job of `n` tasks, `w` in `w_parts` parts.
    fn new(n: usize, w_parts: usize) -> Self {
        let parts = placement(n, w_parts);
        let tasks = (0..n)
            .map(|k| {
                let mut s = State::new(format!("ps:{k}"), None);
                let c = chunks(&parts[k], |var, e| value(var, e, None));
                s.create(&header(&parts[k], k as u32, n as u32), &c).unwrap();
                s
            })
            .collect();
        Self { tasks, parts }
    }

    /// A job of `m` tasks, `w` in `w_parts` parts, restored from the job's checkpoint in `dir`:
    /// the coordinator creates the variables with initial values that are not the checkpoint's.
    fn restored(dir: &Path, m: usize, w_parts: usize) -> Self {
        let parts = placement(m, w_parts);
        let tasks = (0..m)
            .map(|k| {
                let mut s = State::new(format!("ps:{k}"), None);
                s.restore_job(read_job_checkpoint(dir, k as u32, m as u32).unwrap());
                let out = s.create(&header(&parts[k], k as u32, m as u32), &chunks(&parts[k], |_, _| 99.0)).unwrap();
                assert!(out.existed, "the values are the checkpoint's, not the request's");
                s
            })
            .collect();
        Self { tasks, parts }
    }

    /// One step of the job: every task pulls the rows of the batch it owns, then gets one push
    /// of its parts' gradients and those rows' gradients.
    fn step(&mut self, step: u64) {
        let n = self.tasks.len();
        let batch: Vec<u64> = (0..6).map(|j| (step * 7 + j * 11) % TABLE_ROWS).collect();
        for (k, (task, parts)) in self.tasks.iter_mut().zip(&self.parts).enumerate() {
            let mine: Vec<u64> =
                batch.iter().copied().filter(|&id| owner_of(TableSize::Rows(TABLE_ROWS), id, n) == k).collect();
            let worker = "worker:0".to_string();
            let req = RowPull { worker: worker.clone(), lease: step, table: "t".into(), ids: mine.clone() };
            task.pull_rows(&req).unwrap();
            let grads =
                mine.iter().flat_map(|&id| (0..DIM).map(move |j| value("row", id as usize * DIM + j, Some(step))));
            let rows = RowGrads { table: "t".into(), lease: step, ids: mine.clone(), grads: grads.collect() };
            let h = PushHeader {
                id: UpdateId { worker: worker.clone(), client: "c".into(), step, seq: 0 },
                base_version: task.version(),
                variables: parts.iter().map(|p| p.name.clone()).collect(),
                rows: if mine.is_empty() { vec![] } else { vec![rows] },
            };
            task.push(&h, &chunks(parts, |var, e| value(var, e, Some(step)))).unwrap();
        }
    }

    /// Writes every task's checkpoint of `step` (those of `only`, if given) under `dir`.
    fn checkpoint(&self, dir: &Path, step: u64, only: Option<usize>) {
        for (k, task) in self.tasks.iter().enumerate().filter(|(k, _)| only.is_none_or(|o| o == *k)) {
            write_job_snapshot(&job_task_dir(dir, k), step, task.snapshot(), 10, self.tasks.len() as u32).unwrap();
        }
    }

    /// The whole variables, assembled from every task's parts, and the table's rows of every
    /// task (each row held by its owner only).
    fn held(&self) -> (Wholes, Rows) {
        let mut wholes = Wholes::new();
        for (name, shape) in whole_shapes() {
            let n: usize = shape.iter().product();
            wholes.insert(name.into(), (vec![0; n], vec![vec![0; n]; 2], 0));
        }
        let mut rows = Rows::new();
        let m = self.tasks.len();
        for (k, task) in self.tasks.iter().enumerate() {
            let snap = task.snapshot();
            for (info, version, value, slots) in snap.variables {
                let (v, s, ver) = wholes.get_mut(&info.variable).unwrap();
                v[range(&info)].copy_from_slice(&bits(&value));
                for (whole, slot) in s.iter_mut().zip(&slots) {
                    whole[range(&info)].copy_from_slice(&bits(slot));
                }
                *ver = version;
            }
            let t = &snap.tables[0];
            assert_eq!((t.info.shard, t.info.num_shards), (k as u32, m as u32));
            for (r, &id) in t.ids.iter().enumerate() {
                assert_eq!(owner_of(TableSize::Rows(TABLE_ROWS), id, m), k, "row {id} held by its owner");
                let held = (bits(&t.values[r * DIM..][..DIM]), bits(&t.slots[r * DIM..][..DIM]), t.last_seen[r]);
                assert!(rows.insert(id, held).is_none());
            }
        }
        (wholes, rows)
    }
}

/// A job of 2 tasks checkpointed at steps 2 and 4 (and ps:0 alone at 5) restores onto 3 tasks
/// (another split of `w`), onto 1 and onto 2 again: the step 4 every task has, each variable and
/// table row with its bits, slots and versions; and, pushed the same gradients, the restored
/// jobs end where the old job ends, bit for bit.
#[test]
fn a_job_checkpoint_restores_onto_any_number_of_tasks_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let mut old = Job::new(2, 2);
    for step in 0..4 {
        old.step(step);
        if step % 2 == 1 {
            old.checkpoint(dir.path(), step + 1, None);
        }
    }
    let at_checkpoint = old.held();
    old.step(4);
    old.checkpoint(dir.path(), 5, Some(0));
    for step in 5..8 {
        old.step(step);
    }
    let end = old.held();
    assert_eq!(job_checkpoint_tasks(dir.path()).unwrap(), Some(2));
    for (m, w_parts) in [(3, 3), (1, 1), (2, 2), (3, 2)] {
        let mut new = Job::restored(dir.path(), m, w_parts);
        assert_eq!(new.held(), at_checkpoint, "{m} tasks, w in {w_parts} parts");
        for (k, task) in new.tasks.iter().enumerate() {
            let status = task.status();
            assert_eq!((status.restored_step, status.version), (4, 4), "ps:{k} of {m}");
        }
        for step in 4..8 {
            new.step(step);
        }
        assert_eq!(new.held(), end, "{m} tasks, w in {w_parts} parts, after 4 more steps");
    }
}

/// A job's checkpoint restored at a named step (a hybrid job's ps tasks, at its dense layers'
/// step): an earlier step every task has gives that step's state, bit for bit, although a later
/// one is common; a step some task lacks is refused naming the first such task and its latest.
#[test]
fn a_job_checkpoint_restores_at_a_named_step_every_task_has() {
    let dir = tempfile::tempdir().unwrap();
    let mut old = Job::new(2, 2);
    let mut at = BTreeMap::new();
    for step in 0..4 {
        old.step(step);
        if step % 2 == 1 {
            old.checkpoint(dir.path(), step + 1, None);
            at.insert(step + 1, old.held());
        }
    }
    old.step(4);
    old.checkpoint(dir.path(), 5, Some(0));
    for m in [1, 2, 3] {
        let restored = |step| -> Job {
            let parts = placement(m, 2);
            let tasks = (0..m)
                .map(|k| {
                    let mut s = State::new(format!("ps:{k}"), None);
                    s.restore_job(read_job_checkpoint_at(dir.path(), k as u32, m as u32, step).unwrap());
                    s.create(&header(&parts[k], k as u32, m as u32), &chunks(&parts[k], |_, _| 99.0)).unwrap();
                    s
                })
                .collect();
            Job { tasks, parts }
        };
        for (step, want) in [(Some(2), &at[&2]), (Some(4), &at[&4]), (None, &at[&4])] {
            let job = restored(step);
            assert_eq!(&job.held(), want, "{m} tasks at {step:?}");
            assert_eq!(job.tasks[0].status().restored_step, step.unwrap_or(4), "{m} tasks at {step:?}");
        }
    }
    for (step, says) in [
        (5, "ps-1 has no checkpoint of step 5 (its latest: 4)"),
        (3, "ps-0 has no checkpoint of step 3 (its latest: 5)"),
    ] {
        let e = read_job_checkpoint_at(dir.path(), 0, 2, Some(step)).unwrap_err();
        check_message(&e, ErrorKind::Internal, says);
    }
}

fn check_message(e: &Error, kind: ErrorKind, contains: &str) {
    let m = e.to_string();
    assert_eq!(e.kind(), kind, "{m}");
    assert!(!m.contains('\n') && !m.ends_with('.') && !m.starts_with(char::is_uppercase), "{m}");
    assert!(m.contains(contains), "{m:?} should say {contains:?}");
}

/// A restored task refuses a variable the checkpoint lacks or of another shape, naming it,
/// and changes nothing; once it applied an update, it creates no variable it does not hold.
#[test]
fn a_restored_task_creates_only_the_checkpoints_variables_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let mut old = Job::new(2, 2);
    old.step(0);
    old.checkpoint(dir.path(), 1, None);
    let parts = placement(1, 1);
    let mut s = State::new("ps:0".into(), None);
    s.restore_job(read_job_checkpoint(dir.path(), 0, 1).unwrap());
    let mut extra = parts[0].clone();
    extra.push(VariableInfo::whole("bias2", vec![2]));
    let e = s.create(&header(&extra, 0, 1), &chunks(&extra, |_, _| 1.0)).unwrap_err();
    check_message(&e, ErrorKind::FailedPrecondition, "which has no variable bias2; create the model");
    let mut wider = parts[0].clone();
    wider[1] = VariableInfo::whole("b", vec![5]);
    let e = s.create(&header(&wider, 0, 1), &chunks(&wider, |_, _| 1.0)).unwrap_err();
    check_message(&e, ErrorKind::FailedPrecondition, "holds variable b of shape [4], not [5]");
    assert!(s.status().variables.is_empty(), "nothing was created");
    assert!(s.create(&header(&parts[0], 0, 1), &chunks(&parts[0], |_, _| 1.0)).unwrap().existed);
    let mut job = Job { tasks: vec![s], parts };
    job.step(1);
    let late = [VariableInfo::whole("b", vec![4])];
    let e = job.tasks[0].create(&header(&late, 0, 1), &chunks(&late, |_, _| 1.0)).unwrap();
    assert!(e.existed, "a variable the task holds is answered as before");
    let late = [VariableInfo::whole("late", vec![2])];
    let e = job.tasks[0].create(&header(&late, 0, 1), &chunks(&late, |_, _| 1.0)).unwrap_err();
    check_message(&e, ErrorKind::FailedPrecondition, "released its job checkpoint's variables");
}

/// The set of old tasks is checked: a gap, a directory missing for the job that wrote the
/// checkpoints, no common step, another task's checkpoint, another optimizer, and a place
/// outside the new job are refused in one line saying what to change.
#[test]
fn incomplete_or_mixed_job_checkpoints_are_refused() {
    let make = |n: usize| {
        let dir = tempfile::tempdir().unwrap();
        let mut job = Job::new(n, 2);
        job.step(0);
        job.checkpoint(dir.path(), 1, None);
        (dir, job)
    };
    let restore = |dir: &Path| read_job_checkpoint(dir, 0, 2).unwrap_err();
    // One task's own root is not a job's (the single-task form reads it).
    let (dir, _) = make(2);
    assert_eq!(job_checkpoint_tasks(&job_task_dir(dir.path(), 1)).unwrap(), None);
    assert!(read_snapshot(&job_task_dir(dir.path(), 1)).is_ok());
    check_message(&read_job_checkpoint(dir.path(), 2, 2).unwrap_err(), ErrorKind::InvalidArgument, "ps task 2 of 2");
    // ps-1 of 3 missing.
    let (dir, _) = make(3);
    std::fs::remove_dir_all(job_task_dir(dir.path(), 1)).unwrap();
    check_message(&restore(dir.path()), ErrorKind::Internal, "ps-1 is missing while ps-2 is there");
    // The last task's directory missing: the checkpoints say their job had 3 tasks.
    let (dir, _) = make(3);
    std::fs::remove_dir_all(job_task_dir(dir.path(), 2)).unwrap();
    check_message(&restore(dir.path()), ErrorKind::Internal, "written by a job of 3 ps tasks");
    // No step in common.
    let (dir, job) = make(2);
    std::fs::remove_dir_all(job_task_dir(dir.path(), 1)).unwrap();
    job.checkpoint(dir.path(), 3, Some(1));
    check_message(&restore(dir.path()), ErrorKind::Internal, "no step in common (the latest: ps-0 at 1, ps-1 at 3)");
    // A task without checkpoints.
    std::fs::remove_dir_all(job_task_dir(dir.path(), 1)).unwrap();
    std::fs::create_dir(job_task_dir(dir.path(), 1)).unwrap();
    check_message(&restore(dir.path()), ErrorKind::Internal, "no checkpoint to restore");
    // Another task's checkpoint under ps-1.
    let (dir, job) = make(2);
    std::fs::remove_dir_all(job_task_dir(dir.path(), 1)).unwrap();
    write_snapshot(&job_task_dir(dir.path(), 1), 1, job.tasks[0].snapshot(), 1).unwrap();
    check_message(&restore(dir.path()), ErrorKind::Internal, "holds the checkpoint of ps:0, not of ps:1");
    // Another optimizer on ps-1.
    let (dir, _) = make(2);
    std::fs::remove_dir_all(job_task_dir(dir.path(), 1)).unwrap();
    let mut other = State::new("ps:1".into(), None);
    let mut h = header(&[], 1, 2);
    h.optimizer = ServerOptimizer::Sgd { lr: 0.1 };
    other.create(&h, &[]).unwrap();
    write_snapshot(&job_task_dir(dir.path(), 1), 1, other.snapshot(), 1).unwrap();
    check_message(&restore(dir.path()), ErrorKind::Internal, "ps-1's checkpoint has another optimizer than ps-0's");
}

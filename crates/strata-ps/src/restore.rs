//! A whole job's checkpoint restored onto one task of a job of any number of ps tasks.
//!
//! The checkpoint root of a job (`strata train --checkpoint-dir DIR`) holds one directory per
//! ps task, `DIR/ps-<i>`, each with that task's `ckpt-<step>` directories. Restoring it onto
//! task `k` of `m` ([`read_job_checkpoint`]) reads the latest step every old task has, one old
//! task at a time, and gives:
//!
//! - **the tables' rows** task `k` owns of `m` ([`reshard_tables`]): values, optimizer slots
//!   and when each row was last seen, bit for bit;
//! - **a restore pool** of every old task's dense variables ([`RestorePool`]), which the
//!   coordinator's `CreateVariables` draws from, wherever the old job placed them and however
//!   its partitioner splits them now (see [`RestorePool`]); the task holds no variable until
//!   then, and releases the pool at its first applied update;
//! - **what every task of the job shares**: the optimizer, the learning-rate schedule and the
//!   mode (which the old tasks must agree on); the task's version, the largest of the old
//!   tasks' (their versions are equal when every step reaches every task, as a job's steps
//!   do: it is the schedule's and AdamW's update count); the counters, each the largest of the
//!   old tasks'; and the applied-update table, every old task's, so that no update of the
//!   old job is applied twice.

use std::path::{Path, PathBuf};

use strata_core::checkpoint::{checkpoint_dir_name, checkpoint_steps, latest_checkpoint, MANIFEST};

use crate::checkpoint::read_snapshot_of_job;
use crate::limits::MAX_TABLE_SHARDS;
use crate::state::{Answer, Counters, Snapshot, State, UpdateKey, MAX_REMEMBERED_UPDATES};
use crate::{reshard_tables, Error, PsMode, RestorePool, Result, ServerOptimizer, StaleRate, TableRows};
use strata_core::optim::schedule::LrSchedule;

/// The prefix of an old task's directory in a job's checkpoint root: `ps-<index>`.
const TASK_DIR_PREFIX: &str = "ps-";

/// The directory of old task `index` in a job's checkpoint root `dir`.
pub fn job_task_dir(dir: &Path, index: usize) -> PathBuf {
    dir.join(format!("{TASK_DIR_PREFIX}{index}"))
}

/// The number of old ps tasks whose checkpoints `dir` holds as a job's checkpoint root
/// (`ps-0`, `ps-1`, ... directories), or `None` when it is one task's checkpoint (a
/// `ckpt-<step>` directory, or a root holding them) or holds no `ps-<i>` directory. A gap
/// among the `ps-<i>` directories is refused ([`Error::JobTaskMissing`]).
pub fn job_checkpoint_tasks(dir: &Path) -> Result<Option<usize>> {
    if dir.join(MANIFEST).is_file() || latest_checkpoint(dir)?.is_some() {
        return Ok(None);
    }
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(_) => return Ok(None),
    };
    let mut present = vec![false; 0];
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(index) = name.to_str().and_then(task_index) else { continue };
        if entry.path().is_dir() {
            if present.len() <= index {
                present.resize(index + 1, false);
            }
            present[index] = true;
        }
    }
    if present.is_empty() {
        return Ok(None);
    }
    if let Some(missing) = present.iter().position(|p| !p) {
        let present = present.len() - 1;
        return Err(Error::JobTaskMissing { dir: dir.to_path_buf(), missing, present });
    }
    Ok(Some(present.len()))
}

/// The index of a `ps-<index>` directory name (below [`MAX_TABLE_SHARDS`], digits only).
fn task_index(name: &str) -> Option<usize> {
    let digits = name.strip_prefix(TASK_DIR_PREFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) || digits.len() > 6 {
        return None;
    }
    digits.parse().ok().filter(|&i| i < MAX_TABLE_SHARDS as usize)
}

/// A job's checkpoint as one task of a new job restores it: see the module's documentation.
#[derive(Clone, Debug, PartialEq)]
pub struct JobRestore {
    /// The step restored: the latest every old task has.
    pub step: u64,
    /// The old job's ps tasks.
    pub old_tasks: usize,
    /// The task's state: no variables (they are in `pool`), the tables' rows it owns, and what
    /// every task of the job shares.
    pub snapshot: Snapshot,
    /// Every old task's dense variables.
    pub pool: RestorePool,
}

/// The latest step every old task of a job's checkpoint root has a checkpoint of.
fn common_step(dir: &Path, tasks: usize) -> Result<u64> {
    let mut common: Option<Vec<u64>> = None;
    let mut latest = Vec::with_capacity(tasks);
    for i in 0..tasks {
        let root = job_task_dir(dir, i);
        let steps: Vec<u64> = checkpoint_steps(&root)?.into_iter().map(|(step, _)| step).collect();
        let Some(&last) = steps.last() else {
            return Err(Error::NoCheckpoint { path: root });
        };
        latest.push(last);
        common = Some(match common {
            None => steps,
            Some(c) => c.into_iter().filter(|s| steps.binary_search(s).is_ok()).collect(),
        });
    }
    common.and_then(|c| c.last().copied()).ok_or_else(|| Error::NoCommonStep { dir: dir.to_path_buf(), latest })
}

/// What every old task of a job must agree on: its optimizer, schedule, mode and stale rate.
type Agreed = (Option<ServerOptimizer>, Option<LrSchedule>, Option<PsMode>, StaleRate);

/// What the old tasks share, their largest version and counters, and their applied updates,
/// gathered one old task at a time.
#[derive(Default)]
struct Shared {
    first: Option<Agreed>,
    version: u64,
    counters: Counters,
    table: Vec<(UpdateKey, Answer)>,
    seen: std::collections::HashSet<UpdateKey>,
}

impl Shared {
    /// Takes old task `index`'s snapshot (but its variables and tables).
    fn add(&mut self, dir: &Path, index: usize, snap: &mut Snapshot) -> Result<()> {
        let mine = (snap.optimizer.take(), snap.schedule.take(), snap.mode.take(), snap.stale_rate);
        match &self.first {
            None => self.first = Some(mine),
            Some(first) => {
                let field = if first.0 != mine.0 {
                    Some("optimizer")
                } else if first.1 != mine.1 {
                    Some("schedule")
                } else if first.2 != mine.2 {
                    Some("mode")
                } else if first.3 != mine.3 {
                    Some("stale_rate")
                } else {
                    None
                };
                if let Some(field) = field {
                    return Err(Error::JobMismatch { dir: dir.to_path_buf(), task: index, field });
                }
            }
        }
        self.version = self.version.max(snap.version);
        let (c, o) = (&mut self.counters, &snap.counters);
        c.pushes_applied = c.pushes_applied.max(o.pushes_applied);
        c.pushes_duplicate = c.pushes_duplicate.max(o.pushes_duplicate);
        c.pushes_dropped = c.pushes_dropped.max(o.pushes_dropped);
        c.pushes_stale = c.pushes_stale.max(o.pushes_stale);
        c.rounds = c.rounds.max(o.rounds);
        c.pushes_streamed = c.pushes_streamed.max(o.pushes_streamed);
        c.pushes_aborted = c.pushes_aborted.max(o.pushes_aborted);
        for (worker, &n) in &o.applied_by_worker {
            let have = c.applied_by_worker.entry(worker.clone()).or_default();
            *have = (*have).max(n);
        }
        for (key, answer) in std::mem::take(&mut snap.table) {
            if self.table.len() < MAX_REMEMBERED_UPDATES && self.seen.insert(key.clone()) {
                self.table.push((key, answer));
            }
        }
        Ok(())
    }
}

/// Reads the checkpoint of old task `index` of step `step` and checks that it is that task's,
/// written by a job of `tasks` ps tasks (when the checkpoint says).
fn read_old_task(dir: &Path, index: usize, tasks: usize, step: u64) -> Result<Snapshot> {
    let path = job_task_dir(dir, index).join(checkpoint_dir_name(step));
    let (snap, _, job_tasks) = read_snapshot_of_job(&path)?;
    let expected = format!("ps:{index}");
    if snap.task != expected {
        return Err(Error::JobTaskName { dir: path, expected, task: snap.task });
    }
    if let Some(written_by) = job_tasks.filter(|&j| j as usize != tasks) {
        return Err(Error::JobSize { dir: dir.to_path_buf(), tasks, step, written_by });
    }
    Ok(snap)
}

/// Restores the job's checkpoint under `dir` (`ps-0`, `ps-1`, ...: see
/// [`job_checkpoint_tasks`]) onto task `shard` of a job of `num_shards` ps tasks: the latest
/// step every old task has, read one old task at a time (each read bounded as
/// [`read_snapshot`](crate::read_snapshot) bounds it), refused when the old tasks are
/// incomplete, have no step in common or disagree on the optimizer, the schedule or the mode.
/// See the module's documentation for what the task gets.
pub fn read_job_checkpoint(dir: &Path, shard: u32, num_shards: u32) -> Result<JobRestore> {
    read_job_checkpoint_at(dir, shard, num_shards, None)
}

/// [`read_job_checkpoint`] of step `step` (every old task must have it; refused naming the
/// first that has not), or of the latest step every old task has (`None`): a job whose other
/// part checkpoints elsewhere (a hybrid job's dense layers, on its workers) restores its ps
/// tasks at the step of that part's latest checkpoint.
pub fn read_job_checkpoint_at(dir: &Path, shard: u32, num_shards: u32, step: Option<u64>) -> Result<JobRestore> {
    if num_shards == 0 || num_shards > MAX_TABLE_SHARDS || shard >= num_shards {
        return Err(Error::JobPlace { shard, num_shards });
    }
    let tasks = job_checkpoint_tasks(dir)?.ok_or_else(|| Error::NotJobCheckpoint { path: dir.to_path_buf() })?;
    let step = match step {
        Some(step) => {
            for task in 0..tasks {
                let steps = checkpoint_steps(&job_task_dir(dir, task))?;
                if !steps.iter().any(|&(s, _)| s == step) {
                    let latest = steps.last().map(|&(s, _)| s);
                    return Err(Error::StepNotInJob { dir: dir.to_path_buf(), step, task, latest });
                }
            }
            step
        }
        None => common_step(dir, tasks)?,
    };
    let mut shared = Shared::default();
    let mut pool = RestorePool::default();
    let old = (0..tasks).map(|i| -> Result<Vec<TableRows>> {
        let mut snap = read_old_task(dir, i, tasks, step)?;
        shared.add(dir, i, &mut snap)?;
        for v in std::mem::take(&mut snap.variables) {
            pool.insert(v)?;
        }
        Ok(snap.tables)
    });
    let tables = reshard_tables(old, shard, num_shards)?;
    pool.check_complete()?;
    let (optimizer, schedule, mode, stale_rate) = shared.first.unwrap_or_default();
    let snapshot = Snapshot {
        task: format!("ps:{shard}"),
        version: shared.version,
        variables: Vec::new(),
        optimizer,
        schedule,
        stale_rate,
        mode,
        counters: shared.counters,
        table: shared.table,
        tables,
    };
    Ok(JobRestore { step, old_tasks: tasks, snapshot, pool })
}

impl State {
    /// Replaces the state with one restored from a whole job's checkpoint
    /// ([`read_job_checkpoint`]): its tables' rows and what the job's tasks share, and no
    /// variable: every variable the coordinator then creates is drawn from the job's variables
    /// (a variable the checkpoint lacks, or of another shape, is refused naming it,
    /// [`Error::NotInCheckpoint`], [`Error::CheckpointShape`]), until the task applies its first
    /// update, which releases them ([`Error::PoolReleased`] from then on).
    pub fn restore_job(&mut self, restored: JobRestore) {
        self.restore_with_pool(restored.snapshot, restored.step, restored.pool);
    }
}

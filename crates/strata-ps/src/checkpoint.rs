//! A parameter-server task's checkpoints: strata-core's checkpoint format (safetensors files
//! and a manifest, written to a temporary directory, fsynced, renamed) holding `var/<name>`
//! (each variable's values, with its version and shard) and `slot/<name>/<k>` (its optimizer
//! slots), `table/<name>/{ids,values,slots,last_seen}` (each embedding table's rows created and
//! not evicted: ids and last-seen versions as i64 bit patterns of their u64s, values `[rows,
//! dim]`, slots `[rows, k, dim]`), and the task's metadata ([`PsMeta`], JSON under the
//! manifest's `strata.ps` key; the tables' descriptions with their floats as bit patterns).

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use strata_core::checkpoint::{self, CheckpointTensor, CheckpointWriter, ShardInfo};
use strata_core::embedding::{owner_of, RowInit, TableConfig, TableSize};
use strata_core::optim::schedule::LrSchedule;

use crate::checks::check_schedule;
use crate::limits::{MAX_TABLES, MAX_TABLE_BYTES};
use crate::optimizer::schedule_kind;
use crate::state::{Answer, Counters, Snapshot, UpdateKey};
use crate::{Error, PsMode, Result, RowOptimizer, ServerOptimizer, StaleRate, TableInfo, TableRows, VariableInfo};

/// The safetensors file of a ps checkpoint.
pub const VARIABLES_FILE: &str = "variables.safetensors";

/// The manifest's metadata key of a ps checkpoint.
pub const META_KEY: &str = "strata.ps";

/// The version of [`PsMeta`] this build writes. 1: the momentum optimizer's slot holds
/// PyTorch's velocity (`v = m * v + g`, in units of the gradient). 0 (checkpoints written
/// before the field existed): it holds Keras' velocity (`v' = m * v' - lr * g`, `-lr` times
/// PyTorch's), which [`read_snapshot`] converts.
pub const PS_META_FORMAT: u32 = 1;

/// The metadata of a ps checkpoint (in the manifest, as JSON).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PsMeta {
    /// The task's name.
    pub task: String,
    /// The task's version.
    pub version: u64,
    /// The variables and their versions (their values and slots are tensors).
    pub variables: Vec<(VariableInfo, u64)>,
    /// The optimizer.
    pub optimizer: Option<ServerOptimizer>,
    /// The learning-rate schedule the task follows; absent in checkpoints of tasks without
    /// one (and in those written before schedules existed). Its step is the task's `version`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<ScheduleMeta>,
    /// The rate of stale pushes' dense variables; absent for [`StaleRate::Constant`] (and in
    /// checkpoints written before the field existed).
    #[serde(default, skip_serializing_if = "is_constant")]
    pub stale_rate: StaleRate,
    /// The mode.
    pub mode: Option<PsMode>,
    /// The counters.
    pub counters: Counters,
    /// The applied-update table, oldest first.
    pub table: Vec<(UpdateKey, Answer)>,
    /// [`PS_META_FORMAT`] when written; absent (0) in older checkpoints.
    #[serde(default)]
    pub format: u32,
    /// The embedding tables' shards (their rows are tensors); absent in checkpoints of tasks
    /// without tables.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tables: Vec<TableMeta>,
    /// The number of ps tasks of the job whose coordinator asked for the checkpoint, when it
    /// said (absent in older checkpoints): what a restore of the whole job's checkpoints onto
    /// another number of tasks checks its set of old tasks against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_tasks: Option<u32>,
}

/// An embedding table's shard in a checkpoint's metadata, its floats (the initializer's and
/// the optimizer's parameters) as bit patterns, so that a restored shard creates and updates
/// rows bit for bit as before.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableMeta {
    /// The table's name.
    pub name: String,
    /// Its dim.
    pub dim: usize,
    /// Its size.
    pub size: TableSize,
    /// The initializer: `zeros`, `uniform` or `normal`.
    pub init: String,
    /// `f32::to_bits` of the initializer's parameters: `[]`, `[low, high]` or `[std]`.
    pub init_bits: Vec<u32>,
    /// The seed of the rows' initial values.
    pub seed: u64,
    /// The shard.
    pub shard: u32,
    /// The table's shards.
    pub num_shards: u32,
    /// The optimizer: `sgd`, `adagrad`, `ftrl` or `lazy_adam`.
    pub optimizer: String,
    /// `f64::to_bits` of the optimizer's parameters in the order its variant declares them.
    pub optimizer_bits: Vec<u64>,
    /// The rows the tensors hold.
    pub rows: u64,
    /// The rows evicted so far.
    pub evicted: u64,
}

impl TableMeta {
    /// The metadata of `rows`' table.
    pub fn of(rows: &TableRows) -> Self {
        let (info, c) = (&rows.info, &rows.info.config);
        let (init, init_bits) = match c.init {
            RowInit::Zeros => ("zeros", vec![]),
            RowInit::Uniform { low, high } => ("uniform", vec![low.to_bits(), high.to_bits()]),
            RowInit::Normal { std } => ("normal", vec![std.to_bits()]),
        };
        let params = match info.optimizer {
            RowOptimizer::Sgd { lr } => vec![lr],
            RowOptimizer::Adagrad { lr, initial_accumulator, eps } => vec![lr, initial_accumulator, eps],
            RowOptimizer::Ftrl { lr, lr_power, initial_accumulator, l1, l2, beta } => {
                vec![lr, lr_power, initial_accumulator, l1, l2, beta]
            }
            RowOptimizer::LazyAdam { lr, beta1, beta2, eps } => vec![lr, beta1, beta2, eps],
        };
        Self {
            name: c.name.clone(),
            dim: c.dim,
            size: c.size,
            init: init.into(),
            init_bits,
            seed: info.seed,
            shard: info.shard,
            num_shards: info.num_shards,
            optimizer: info.optimizer.name().into(),
            optimizer_bits: params.iter().map(|p| p.to_bits()).collect(),
            rows: rows.ids.len() as u64,
            evicted: rows.evicted,
        }
    }

    /// The table's description, checked as a task checks one it is asked to create; `None`
    /// when the initializer or optimizer is unknown or has the wrong number of parameters.
    pub fn info(&self) -> Option<TableInfo> {
        let f = |i: usize| self.init_bits.get(i).copied().map(f32::from_bits);
        let init = match (self.init.as_str(), self.init_bits.len()) {
            ("zeros", 0) => RowInit::Zeros,
            ("uniform", 2) => RowInit::Uniform { low: f(0)?, high: f(1)? },
            ("normal", 1) => RowInit::Normal { std: f(0)? },
            _ => return None,
        };
        let p: Vec<f64> = self.optimizer_bits.iter().map(|&b| f64::from_bits(b)).collect();
        let optimizer = match (self.optimizer.as_str(), p.as_slice()) {
            ("sgd", &[lr]) => RowOptimizer::Sgd { lr },
            ("adagrad", &[lr, initial_accumulator, eps]) => RowOptimizer::Adagrad { lr, initial_accumulator, eps },
            ("ftrl", &[lr, lr_power, initial_accumulator, l1, l2, beta]) => {
                RowOptimizer::Ftrl { lr, lr_power, initial_accumulator, l1, l2, beta }
            }
            ("lazy_adam", &[lr, beta1, beta2, eps]) => RowOptimizer::LazyAdam { lr, beta1, beta2, eps },
            _ => return None,
        };
        let config = TableConfig { name: self.name.clone(), dim: self.dim, size: self.size, init };
        Some(TableInfo { config, seed: self.seed, shard: self.shard, num_shards: self.num_shards, optimizer })
    }
}

/// A learning-rate schedule in a checkpoint's metadata, its rates as f64 bit patterns: JSON's
/// decimal numbers are read back to the nearest f64 only at best effort, and a restored task
/// must follow its schedule bit for bit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleMeta {
    /// `constant`, `warmup_cosine` or `warmup_linear`.
    pub kind: String,
    /// `f64::to_bits` of the rates: `[lr]` (constant), `[peak, final_lr]` (the others).
    pub rate_bits: Vec<u64>,
    /// The warm-up's steps (0 for a constant schedule).
    pub warmup_steps: u64,
    /// The step at which the decay ends (0 for a constant schedule).
    pub total_steps: u64,
}

impl ScheduleMeta {
    /// The metadata of `schedule`.
    pub fn of(schedule: &LrSchedule) -> Self {
        let kind = schedule_kind(schedule).to_string();
        match *schedule {
            LrSchedule::Constant { lr } => {
                Self { kind, rate_bits: vec![lr.to_bits()], warmup_steps: 0, total_steps: 0 }
            }
            LrSchedule::WarmupCosine { peak, warmup_steps, total_steps, final_lr }
            | LrSchedule::WarmupLinear { peak, warmup_steps, total_steps, final_lr } => {
                Self { kind, rate_bits: vec![peak.to_bits(), final_lr.to_bits()], warmup_steps, total_steps }
            }
        }
    }

    /// The schedule, checked as a task checks one it is asked to follow.
    pub fn schedule(&self) -> Result<LrSchedule> {
        let rate = |i: usize| self.rate_bits.get(i).copied().map(f64::from_bits).unwrap_or(f64::NAN);
        let (warmup_steps, total_steps) = (self.warmup_steps, self.total_steps);
        let s = match self.kind.as_str() {
            "constant" => LrSchedule::Constant { lr: rate(0) },
            "warmup_cosine" => LrSchedule::WarmupCosine { peak: rate(0), warmup_steps, total_steps, final_lr: rate(1) },
            "warmup_linear" => LrSchedule::WarmupLinear { peak: rate(0), warmup_steps, total_steps, final_lr: rate(1) },
            other => return Err(Error::UnknownSchedule { kind: other.into() }),
        };
        check_schedule(&s)?;
        Ok(s)
    }
}

fn to_tensor(name: &str, values: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
    Tensor::from_vec(values, shape, &Device::Cpu)
        .map_err(|e| Error::BuildTensor { tensor: name.into(), source: Box::new(e) })
}

/// Writes `snap` as the checkpoint of `step` under `root` (`root/ckpt-<step>`), and removes all
/// but the `keep` newest checkpoints there. Returns the checkpoint's directory. The metadata
/// (versions, the optimizer and its learning rate, the learning-rate schedule, the mode, the
/// counters, the applied-update table) is in the manifest, which its checksum covers like the
/// tensors.
pub fn write_snapshot(root: &Path, step: u64, snap: Snapshot, keep: usize) -> Result<PathBuf> {
    write_snapshot_as(root, step, snap, keep, PS_META_FORMAT, None)
}

/// [`write_snapshot`] of a task of a job of `job_tasks` ps tasks, recorded in the metadata
/// ([`PsMeta::job_tasks`]), so that a restore of the job's checkpoints onto another number of
/// tasks ([`read_job_checkpoint`](crate::read_job_checkpoint)) can tell whether it has every
/// old task's.
pub fn write_job_snapshot(root: &Path, step: u64, snap: Snapshot, keep: usize, job_tasks: u32) -> Result<PathBuf> {
    write_snapshot_as(root, step, snap, keep, PS_META_FORMAT, Some(job_tasks))
}

/// [`write_snapshot`] with the metadata's `format` and `job_tasks` fields set.
fn write_snapshot_as(
    root: &Path,
    step: u64,
    snap: Snapshot,
    keep: usize,
    format: u32,
    job_tasks: Option<u32>,
) -> Result<PathBuf> {
    let mut entries = Vec::new();
    let mut infos = Vec::new();
    for (info, version, value, slots) in snap.variables {
        let shard = (info.num_parts > 1).then_some(ShardInfo {
            index: info.part as usize,
            count: info.num_parts as usize,
            offset: info.row_offset as usize,
        });
        let name = format!("var/{}", info.name);
        let mut t = CheckpointTensor::new(name.clone(), to_tensor(&name, value, &info.shape)?).with_version(version);
        if let Some(s) = shard {
            t = t.with_shard(s);
        }
        entries.push(t);
        for (k, slot) in slots.into_iter().enumerate() {
            let name = format!("slot/{}/{k}", info.name);
            entries.push(CheckpointTensor::new(name.clone(), to_tensor(&name, slot, &info.shape)?));
        }
        infos.push((info, version));
    }
    let mut tables = Vec::with_capacity(snap.tables.len());
    for rows in snap.tables {
        tables.push(TableMeta::of(&rows));
        entries.extend(table_tensors(rows)?);
    }
    let meta = PsMeta {
        tables,
        task: snap.task,
        version: snap.version,
        variables: infos,
        optimizer: snap.optimizer,
        schedule: snap.schedule.as_ref().map(ScheduleMeta::of),
        stale_rate: snap.stale_rate,
        mode: snap.mode,
        counters: snap.counters,
        table: snap.table,
        format,
        job_tasks,
    };
    let meta = serde_json::to_string(&meta).map_err(Error::EncodeMetadata)?;
    let dir = CheckpointWriter::new(root, step).meta(META_KEY, meta).file(VARIABLES_FILE, entries).write()?;
    checkpoint::keep_last(root, keep)?;
    Ok(dir)
}

/// The tensors of one table's rows.
fn table_tensors(rows: TableRows) -> Result<Vec<CheckpointTensor>> {
    let (name, dim, k) = (rows.info.config.name.clone(), rows.info.config.dim, rows.info.optimizer.slots());
    let n = rows.ids.len();
    let as_i64 = |v: Vec<u64>| v.into_iter().map(|x| x as i64).collect::<Vec<i64>>();
    let int = |suffix: &str, v: Vec<u64>| -> Result<CheckpointTensor> {
        let tensor = format!("table/{name}/{suffix}");
        let t = Tensor::from_vec(as_i64(v), n, &Device::Cpu)
            .map_err(|e| Error::BuildTensor { tensor: tensor.clone(), source: Box::new(e) })?;
        Ok(CheckpointTensor::new(tensor, t))
    };
    let mut out = vec![int("ids", rows.ids)?, int("last_seen", rows.last_seen)?];
    let values = format!("table/{name}/values");
    out.push(CheckpointTensor::new(values.clone(), to_tensor(&values, rows.values, &[n, dim])?));
    if k > 0 {
        let slots = format!("table/{name}/slots");
        out.push(CheckpointTensor::new(slots.clone(), to_tensor(&slots, rows.slots, &[n, k, dim])?));
    }
    Ok(out)
}

/// Reads one table's rows from a checkpoint whose metadata describes it as `meta`, after
/// checking that what the metadata declares fits what a task may hold (`budget`: the table
/// bytes left), so that a corrupt checkpoint cannot make a restore allocate without bound;
/// the ids must be ascending and owned by the shard.
fn read_table(ckpt: &checkpoint::Checkpoint, meta: &TableMeta, budget: &mut u64) -> Result<TableRows> {
    let dir = &ckpt.dir;
    let corrupt = |detail: String| Error::CorruptTable { dir: dir.clone(), table: meta.name.clone(), detail };
    let info = meta
        .info()
        .ok_or_else(|| corrupt(format!("unknown initializer {:?} or optimizer {:?}", meta.init, meta.optimizer)))?;
    info.validate().map_err(|e| corrupt(e.to_string()))?;
    let (dim, k) = (info.config.dim as u64, info.optimizer.slots() as u64);
    let bytes = meta.rows.saturating_mul(dim.saturating_mul(4 * (1 + k)).saturating_add(16));
    if bytes > *budget {
        return Err(corrupt(format!(
            "{} rows do not fit the {MAX_TABLE_BYTES} bytes of table rows a task holds",
            meta.rows
        )));
    }
    *budget -= bytes;
    let n = meta.rows as usize;
    let name = &meta.name;
    let read = |suffix: &str, numel: usize| -> Result<Tensor> {
        let tensor = format!("table/{name}/{suffix}");
        let t = ckpt.tensor(&tensor)?.flatten_all().map_err(|e| Error::ReadTensor {
            dir: dir.clone(),
            tensor: tensor.clone(),
            source: Box::new(e),
        })?;
        if t.elem_count() != numel {
            return Err(Error::TensorSize { dir: dir.clone(), tensor, elements: t.elem_count(), expected: numel });
        }
        Ok(t)
    };
    let tensor_err = |suffix: &str, e| Error::ReadTensor {
        dir: dir.clone(),
        tensor: format!("table/{name}/{suffix}"),
        source: Box::new(e),
    };
    let u64s = |suffix: &str| -> Result<Vec<u64>> {
        let v = read(suffix, n)?.to_vec1::<i64>().map_err(|e| tensor_err(suffix, e))?;
        Ok(v.into_iter().map(|x| x as u64).collect())
    };
    let f32s = |suffix: &str, numel: usize| -> Result<Vec<f32>> {
        read(suffix, numel)?.to_vec1::<f32>().map_err(|e| tensor_err(suffix, e))
    };
    let ids = u64s("ids")?;
    let last_seen = u64s("last_seen")?;
    let values = f32s("values", n * dim as usize)?;
    let slots = if k > 0 { f32s("slots", n * (k * dim) as usize)? } else { Vec::new() };
    if let Some(w) = ids.windows(2).find(|w| w[0] >= w[1]) {
        return Err(corrupt(format!("ids are not ascending at {}", w[1])));
    }
    let (size, shard, shards) = (info.config.size, info.shard, info.num_shards as usize);
    if let Some(&id) = ids.iter().find(|&&id| {
        owner_of(size, id, shards) != shard as usize || matches!(size, TableSize::Rows(rows) if id >= rows)
    }) {
        return Err(corrupt(format!("row id {id} is not a row of shard {shard} of {shards}")));
    }
    Ok(TableRows { info, evicted: meta.evicted, ids, values, slots, last_seen })
}

/// Reads a ps checkpoint: `path` is one `ckpt-*` directory or a root holding them (the latest
/// is read). Returns the snapshot and the checkpoint's step. A checkpoint of an older format
/// is converted to this build's meaning of the optimizer slots.
pub fn read_snapshot(path: &Path) -> Result<(Snapshot, u64)> {
    read_snapshot_of_job(path).map(|(snap, step, _)| (snap, step))
}

/// Whether a ps checkpoint holds variables (a parameter-server job's dense variables), read
/// from its metadata alone: `path` is one `ckpt-*` directory or a root holding them (the latest
/// is read). A hybrid job's ps tasks hold tables only.
pub fn checkpoint_holds_variables(path: &Path) -> Result<bool> {
    read_meta(path).map(|(_, meta)| !meta.variables.is_empty())
}

/// The ps checkpoint at `path` (one `ckpt-*` directory, or the latest under a root) and its
/// metadata, its tensors not read yet.
fn read_meta(path: &Path) -> Result<(checkpoint::Checkpoint, PsMeta)> {
    let ckpt = if path.join(checkpoint::MANIFEST).is_file() {
        checkpoint::read_checkpoint(path)?
    } else {
        checkpoint::read_latest(path)?.ok_or_else(|| Error::NoCheckpoint { path: path.to_path_buf() })?
    };
    let dir = ckpt.dir.clone();
    let meta = ckpt.metadata.get(META_KEY).ok_or_else(|| Error::NotPsCheckpoint { dir: dir.clone() })?;
    let meta: PsMeta = serde_json::from_str(meta).map_err(|source| Error::CorruptMetadata { dir, source })?;
    Ok((ckpt, meta))
}

/// [`read_snapshot`], with the number of ps tasks of the job that wrote it, if recorded
/// ([`PsMeta::job_tasks`]).
pub(crate) fn read_snapshot_of_job(path: &Path) -> Result<(Snapshot, u64, Option<u32>)> {
    let (ckpt, meta) = read_meta(path)?;
    let dir = ckpt.dir.clone();
    let slots = meta.optimizer.as_ref().map_or(0, ServerOptimizer::slots);
    let read = |name: &str, numel: usize| -> Result<Vec<f32>> {
        let t = ckpt.tensor(name)?;
        let v = t
            .flatten_all()
            .and_then(|t| t.to_dtype(candle_core::DType::F32))
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| Error::ReadTensor { dir: dir.clone(), tensor: name.into(), source: Box::new(e) })?;
        if v.len() != numel {
            return Err(Error::TensorSize {
                dir: dir.clone(),
                tensor: name.into(),
                elements: v.len(),
                expected: numel,
            });
        }
        Ok(v)
    };
    let mut variables = Vec::new();
    for (info, version) in meta.variables {
        let n = info.numel();
        let value = read(&format!("var/{}", info.name), n)?;
        let mut slots = (0..slots).map(|k| read(&format!("slot/{}/{k}", info.name), n)).collect::<Result<Vec<_>>>()?;
        if meta.format == 0 {
            if let (Some(ServerOptimizer::Momentum { lr, .. }), [velocity]) = (&meta.optimizer, slots.as_mut_slice()) {
                from_keras_velocity(velocity, *lr);
            }
        }
        variables.push((info, version, value, slots));
    }
    let schedule = meta.schedule.as_ref().map(ScheduleMeta::schedule).transpose()?;
    if meta.tables.len() > MAX_TABLES {
        let table = format!("#{MAX_TABLES}");
        return Err(Error::CorruptTable {
            dir,
            table,
            detail: format!("{} tables, over the limit of {MAX_TABLES}", meta.tables.len()),
        });
    }
    let mut budget = MAX_TABLE_BYTES;
    let mut tables = Vec::with_capacity(meta.tables.len());
    for t in &meta.tables {
        tables.push(read_table(&ckpt, t, &mut budget)?);
    }
    let snap = Snapshot {
        tables,
        task: meta.task,
        version: meta.version,
        variables,
        optimizer: meta.optimizer,
        schedule,
        stale_rate: meta.stale_rate,
        mode: meta.mode,
        counters: meta.counters,
        table: meta.table,
    };
    Ok((snap, ckpt.step, meta.job_tasks))
}

fn is_constant(rate: &StaleRate) -> bool {
    *rate == StaleRate::Constant
}

/// Keras' momentum velocity (`v' = m * v' - lr * g`) as PyTorch's (`v = m * v + g`): at a
/// constant learning rate `v' = -lr * v`.
fn from_keras_velocity(velocity: &mut [f32], lr: f64) {
    for v in velocity {
        *v = (-f64::from(*v) / lr) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Chunk, CreateHeader, PushHeader, State, UpdateId};

    fn task(optimizer: &ServerOptimizer) -> State {
        let mut s = State::new("ps:0".into(), None);
        let header = CreateHeader {
            variables: vec![VariableInfo::whole("w", vec![2, 2])],
            optimizer: optimizer.clone(),
            schedule: None,
            stale_rate: crate::StaleRate::Constant,
            mode: PsMode::Async,
            wire_format: crate::WireFormat::F32,
            tables: Vec::new(),
        };
        let x = [1.0f32, -2.0, 0.5, 3.0];
        let chunk = Chunk { var: 0, offset: 0, pieces: vec![bytes::Bytes::copy_from_slice(bytemuck::cast_slice(&x))] };
        s.create(&header, &[chunk]).unwrap();
        s
    }

    fn push(s: &mut State, step: u64, g: [f32; 4]) {
        let h = PushHeader {
            id: UpdateId { worker: "worker:0".into(), client: "c".into(), step, seq: 0 },
            base_version: s.version(),
            variables: vec!["w".into()],
            rows: Vec::new(),
        };
        let chunk = Chunk { var: 0, offset: 0, pieces: vec![bytes::Bytes::copy_from_slice(bytemuck::cast_slice(&g))] };
        s.push(&h, &[chunk]).unwrap();
    }

    fn values(s: &State) -> Vec<f32> {
        s.snapshot().variables[0].2.clone()
    }

    /// A snapshot written and read back restores the same task: values, slots, versions, the
    /// applied-update table and the counters; and it goes on with the same bits.
    #[test]
    fn snapshots_round_trip() {
        let tmp = tempfile::tempdir().unwrap();
        let optimizer = ServerOptimizer::AdamW { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-7, weight_decay: 0.1 };
        let mut s = task(&optimizer);
        push(&mut s, 0, [0.5, -1.0, 2.0, 0.0]);
        let dir = write_snapshot(tmp.path(), 7, s.snapshot(), 2).unwrap();
        assert!(dir.starts_with(tmp.path()));
        let (snap, step) = read_snapshot(tmp.path()).unwrap();
        assert_eq!(step, 7);
        let mut r = State::new("ps:0".into(), None);
        r.restore(snap, step);
        let (a, b) = (s.snapshot(), r.snapshot());
        assert_eq!((a.version, &a.counters, &a.table), (b.version, &b.counters, &b.table));
        assert_eq!(a.variables, b.variables);
        assert_eq!((r.status().restored_step, r.status().restored_version), (7, 1));
        push(&mut s, 1, [1.0, 1.0, -1.0, 0.25]);
        push(&mut r, 1, [1.0, 1.0, -1.0, 0.25]);
        assert_eq!(values(&s), values(&r));
    }

    /// A checkpoint written before the format field (Keras' momentum velocity) restores to the
    /// task it was: the next update gives the values Keras' form would.
    #[test]
    fn older_momentum_checkpoints_restore_with_their_velocity_converted() {
        let tmp = tempfile::tempdir().unwrap();
        let (lr, mu) = (0.1f64, 0.9f64);
        let optimizer = ServerOptimizer::Momentum { lr, momentum: mu, nesterov: false };
        let mut s = task(&optimizer);
        push(&mut s, 0, [1.0, 2.0, -1.0, 0.5]);
        // What the task before this format held: the same values, Keras' velocity -lr * g.
        let mut old = s.snapshot();
        for v in &mut old.variables[0].3[0] {
            *v = (-lr * f64::from(*v)) as f32;
        }
        // Format 0 reads as a checkpoint written before the field existed (`#[serde(default)]`).
        let dir = write_snapshot_as(tmp.path(), 1, old, 1, 0, None).unwrap();
        let text = std::fs::read_to_string(dir.join(checkpoint::MANIFEST)).unwrap();
        assert!(text.contains("\\\"format\\\":0"), "{text}");
        // ... as one without the field does.
        let ckpt = checkpoint::read_checkpoint(&dir).unwrap();
        let meta = ckpt.metadata[META_KEY].replace(",\"format\":0", "");
        assert!(!meta.contains("format"), "{meta}");
        assert_eq!(serde_json::from_str::<PsMeta>(&meta).unwrap().format, 0);
        let (snap, step) = read_snapshot(&dir).unwrap_or_else(|e| panic!("{e}"));
        let mut r = State::new("ps:0".into(), None);
        r.restore(snap, step);
        push(&mut s, 1, [0.5, 0.5, 0.5, 0.5]);
        push(&mut r, 1, [0.5, 0.5, 0.5, 0.5]);
        for (a, b) in values(&s).iter().zip(values(&r)) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
    }

    /// Every byte of every file a restore reads, flipped in turn (three ways each), is refused:
    /// the values, the slots, and the metadata (the learning rate, the versions, the table).
    #[test]
    fn every_flipped_byte_of_a_ps_checkpoint_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let optimizer = ServerOptimizer::AdamW { lr: 0.007, beta1: 0.9, beta2: 0.999, eps: 1e-7, weight_decay: 0.0 };
        let mut s = task(&optimizer);
        push(&mut s, 0, [0.5, -1.0, 2.0, 0.0]);
        let dir = write_snapshot(tmp.path(), 96, s.snapshot(), 2).unwrap();
        let mut files = vec![tmp.path().join(checkpoint::LATEST)];
        files.extend(std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()));
        files.sort();
        assert_eq!(files.len(), 4, "latest, the manifest, its checksum, the variables: {files:?}");
        let text = std::fs::read_to_string(dir.join(checkpoint::MANIFEST)).unwrap();
        assert!(text.contains("0.007") && text.contains("version"), "the metadata is in the manifest: {text}");
        let mut refused = 0;
        for file in &files {
            let original = std::fs::read(file).unwrap();
            for at in 0..original.len() {
                for mask in [0x01u8, 0x20, 0x80] {
                    let mut bytes = original.clone();
                    bytes[at] ^= mask;
                    std::fs::write(file, &bytes).unwrap();
                    match read_snapshot(tmp.path()) {
                        Ok((snap, step)) => panic!(
                            "{}: byte {at} ^ {mask:#04x} was restored (step {step}, version {}, {:?})",
                            file.display(),
                            snap.version,
                            snap.optimizer
                        ),
                        Err(e) => {
                            assert!(matches!(e, Error::Checkpoint(_)), "{}: byte {at}: {e}", file.display());
                            refused += 1;
                        }
                    }
                }
            }
            std::fs::write(file, &original).unwrap();
        }
        let total: usize = files.iter().map(|f| std::fs::metadata(f).unwrap().len() as usize).sum();
        assert_eq!(refused, 3 * total);
        let (snap, step) = read_snapshot(tmp.path()).unwrap();
        assert_eq!((step, snap.version, snap.optimizer), (96, 1, Some(optimizer)));
    }

    #[test]
    fn what_is_not_a_ps_checkpoint_is_refused_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        let e = read_snapshot(tmp.path()).unwrap_err();
        assert!(matches!(&e, Error::NoCheckpoint { path } if path == tmp.path()), "{e:?}");
        assert!(e.to_string().contains("no checkpoint to restore"), "{e}");
    }
}

// A test of the schedule through a checkpoint, with the schedule tests' task: here, so that the
// state module's tests do not import this module (which imports the state).
#[cfg(test)]
mod schedule_tests {
    use super::*;
    use crate::state::schedule_tests::{bits, grad, push, task, w, SCHEDULE};
    use crate::{CreateHeader, State, WireFormat};

    /// A task restored from a checkpoint goes on with the schedule where it was: the same bits
    /// as the task that went on without stopping, and `value - lr(k) * g` at each later step.
    /// The rates survive the manifest bit for bit, also those JSON's decimals would not.
    #[test]
    fn a_restored_task_continues_the_schedule() {
        let tmp = tempfile::tempdir().unwrap();
        let lr = 3e-3f64;
        let odd = LrSchedule::WarmupCosine { peak: lr, warmup_steps: 2, total_steps: 6, final_lr: lr / 10.0 };
        for (i, schedule) in [SCHEDULE, odd].into_iter().enumerate() {
            let mut s = task(Some(schedule.clone()), PsMode::Async, None);
            for k in 0..3 {
                push(&mut s, "worker:0", k, &grad(k));
            }
            let dir = tmp.path().join(i.to_string());
            crate::write_snapshot(&dir, 3, s.snapshot(), 1).unwrap();
            let (snap, step) = crate::read_snapshot(&dir).unwrap();
            let mut r = State::new("ps:0".into(), None);
            r.restore(snap, step);
            let restored = r.status().schedule.unwrap();
            let rate_bits = |s: &LrSchedule| match *s {
                LrSchedule::WarmupCosine { peak, final_lr, .. } => (peak.to_bits(), final_lr.to_bits()),
                _ => unreachable!(),
            };
            assert_eq!((&restored, rate_bits(&restored)), (&schedule, rate_bits(&schedule)));
            assert_eq!(r.version(), 3);
            for k in 3..9 {
                let before = w(&r);
                push(&mut s, "worker:0", k, &grad(k));
                push(&mut r, "worker:0", k, &grad(k));
                assert_eq!(bits(&w(&r)), bits(&w(&s)), "step {k}");
                let lr = schedule.at(k) as f32;
                let want: Vec<f32> = before.iter().zip(grad(k)).map(|(w, g)| w - lr * g).collect();
                assert_eq!(bits(&w(&r)), bits(&want), "step {k}");
            }
            // A coordinator that creates the variables again with the same schedule is answered
            // with their versions; with another, it is refused.
            let header = |schedule| CreateHeader {
                variables: vec![VariableInfo::whole("w", vec![3])],
                optimizer: ServerOptimizer::Sgd { lr: 7.0 },
                schedule,
                stale_rate: crate::StaleRate::Constant,
                mode: PsMode::Async,
                wire_format: WireFormat::F32,
                tables: Vec::new(),
            };
            assert!(r.create(&header(Some(schedule.clone())), &[]).unwrap().existed);
            let e = r.create(&header(None), &[]).unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::FailedPrecondition, "{e}");
            assert!(e.to_string().starts_with("ps:0 follows the learning-rate schedule"), "{e}");
        }
    }

    /// A table whose metadata declares more rows than a task may hold is refused before its
    /// tensors are read (a corrupt checkpoint cannot make a restore allocate without bound), as
    /// is one whose tensors hold another number of rows than the metadata.
    #[test]
    fn table_reads_are_bounded_by_their_metadata() {
        use strata_core::embedding::TableConfig;
        let tmp = tempfile::tempdir().unwrap();
        let mut s = State::new("ps:0".into(), None);
        let info = TableInfo {
            config: TableConfig::rows("t", 100, 4),
            seed: 1,
            shard: 0,
            num_shards: 1,
            optimizer: RowOptimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-7 },
        };
        let header = CreateHeader {
            variables: vec![],
            optimizer: ServerOptimizer::Sgd { lr: 0.1 },
            schedule: None,
            stale_rate: crate::StaleRate::Constant,
            mode: PsMode::Async,
            wire_format: crate::WireFormat::F32,
            tables: vec![info],
        };
        s.create(&header, &[]).unwrap();
        let pull = crate::RowPull { worker: "w".into(), lease: 0, table: "t".into(), ids: vec![3, 9] };
        s.pull_rows(&pull).unwrap();
        let dir = write_snapshot(tmp.path(), 1, s.snapshot(), 1).unwrap();
        let ckpt = checkpoint::read_checkpoint(&dir).unwrap();
        let meta: PsMeta = serde_json::from_str(&ckpt.metadata[META_KEY]).unwrap();
        let mut t = meta.tables[0].clone();
        assert_eq!(read_table(&ckpt, &t, &mut MAX_TABLE_BYTES.clone()).unwrap().ids, vec![3, 9]);
        t.rows = u64::MAX / 2;
        let e = read_table(&ckpt, &t, &mut MAX_TABLE_BYTES.clone()).unwrap_err();
        assert!(matches!(e, Error::CorruptTable { .. }) && e.to_string().contains("do not fit"), "{e}");
        t.rows = 3;
        let e = read_table(&ckpt, &t, &mut MAX_TABLE_BYTES.clone()).unwrap_err();
        assert!(matches!(e, Error::TensorSize { elements: 2, expected: 3, .. }), "{e}");
        t.rows = 2;
        t.optimizer = "adam".into();
        assert!(matches!(read_table(&ckpt, &t, &mut MAX_TABLE_BYTES.clone()), Err(Error::CorruptTable { .. })));
    }
}

//! Embedding tables in this process's memory, stepped row by row under the in-process
//! strategies: [`LocalTables`] is the [`TableStore`] a OneDevice, Mirrored or CentralStorage
//! strategy gets in [`StrategyOptions::tables`], so that a model's [`Embedding`] tables are
//! held as strata-ps table shards ([`TableShard`]: rows created when first looked up, evicted
//! from a bounded id-space shard as on a ps task) and stepped by a [`RowOptimizer`] with
//! TensorFlow's sparse semantics: only the rows a step touched change, their optimizer slots
//! included, where a table held as a variable is stepped whole by the dense optimizer.
//!
//! A step's rows are reduced row-wise: each replica's lookups hand the store their rows'
//! gradients (of the replica's loss, a mean over its batch rows); when the last replica ends
//! the step ([`TableStore::end_step`]) the store weighs replica `r`'s gradient by its share of
//! the global batch, `rows_r / rows` in f32, exactly as the strategies weigh a variable's
//! gradient (`Shard::weight`), sums each row's weighted gradients in replica order, as the
//! in-memory all-reduce sums each element, and applies every table's rows once, in id order.
//! A table's rows thus end a step of SGD on the bits a table held as a variable ends on
//! under the same strategy, and nothing depends on which replica finished first.
//!
//! Not under MultiWorkerMirrored (each worker would hold and step the whole table alone) nor
//! a parameter-server job's coordinator: those tables live on ps tasks (`PsTables`).
//!
//! [`StrategyOptions::tables`]: strata_core::StrategyOptions::tables
//! [`Embedding`]: strata_core::layers::Embedding

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use candle_core::{Device, Tensor};
use strata_core::embedding::{init_row, owner_of, TableConfig, TableScope, TableStore};
use strata_core::{Error, Result};
use strata_ps::{RowOptimizer, TableInfo, TableRows, TableShard, TableStatus};

/// The store's name in its refusals.
const STORE: &str = "local tables (embedding rows in this process)";

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A strata-ps refusal as strata-core's error: a full id-space shard as
/// [`Error::TableFull`], the rest (bounds of one read, checked as a ps task checks them) as
/// the invalid arguments they are.
fn core_error(e: strata_ps::Error) -> Error {
    match e {
        strata_ps::Error::TableFull { table, bound, rows } => Error::TableFull { table, bound, rows },
        other => Error::InvalidArgument(other.to_string()),
    }
}

/// The strategy the store serves, from the first model built with it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Attached {
    strategy: String,
    replicas: usize,
    seed: u64,
}

/// A declared table and its shards.
#[derive(Debug)]
struct Table {
    config: TableConfig,
    shards: Vec<TableShard>,
}

/// One replica's part of a step: each table's rows' gradients (summed over its lookups, by
/// id) and the batch rows its loss is the mean over.
#[derive(Debug, Default)]
struct ReplicaGrads {
    rows: usize,
    tables: BTreeMap<String, BTreeMap<u64, Vec<f32>>>,
}

/// The step in progress: the replicas that ended it, whether one failed, their gradients.
#[derive(Debug, Default)]
struct Step {
    ended: usize,
    failed: bool,
    replicas: Vec<ReplicaGrads>,
}

#[derive(Debug, Default)]
struct State {
    attached: Option<Attached>,
    tables: BTreeMap<String, Table>,
    /// The updates applied (steps whose rows were stepped): the shards' version.
    version: u64,
    step: Step,
}

/// The [`TableStore`] of the in-process strategies (OneDevice, Mirrored, CentralStorage) whose
/// tables live in this process: each table in strata-ps [`TableShard`]s, its rows created when
/// a batch first looks them up and stepped by a [`RowOptimizer`] with TensorFlow's sparse
/// semantics (only the rows a step touched change, their slots included).
///
/// A step's rows are reduced row-wise: when the last replica ends the step, replica `r`'s
/// gradient of a row (its loss's, a mean over its batch rows) is weighed by its share of the
/// global batch, `rows_r / rows` in f32, as the strategies weigh a variable's gradient, and each
/// row's weighted gradients are summed in replica order, as the in-memory all-reduce sums an
/// element; every table's rows are then applied once, in id order. Under SGD a table's rows end
/// a step on the bits a table held as a variable ends on under the same strategy.
/// MultiWorkerMirrored is refused ([`LocalTables::check_strategy`]).
///
/// The rows are stepped at the end of every step by the row optimizer alone: what the
/// distributed optimizer adds to the dense variables (accumulation over micro-batches,
/// clipping by the global norm, a learning-rate schedule, fp16's loss scale) does not reach
/// them, as it does not reach rows on ps tasks. The strategies' checkpoints hold the rows
/// ([`TableStore::state_tensors`]); the model's variables (`Replicated::values`, a saved
/// model) do not.
///
/// ```
/// use std::sync::Arc;
/// use strata_core::embedding::TableConfig;
/// use strata_core::layers::Embedding;
/// use strata_core::{Strategy, StrategyOptions};
/// use strata_ps::RowOptimizer;
/// use strata_strategies::{LocalTables, OneDeviceStrategy};
///
/// let tables = Arc::new(LocalTables::new(RowOptimizer::Sgd { lr: 0.1 }));
/// let options = StrategyOptions { tables: Some(tables.clone()), ..Default::default() };
/// let strategy = OneDeviceStrategy::with_options(strata_core::device::logical_cpus(1)?.remove(0), options)?;
/// let model = strategy.scope(|s| Embedding::new(s, TableConfig::rows("emb", 1_000_000, 8)).map_err(candle_core::Error::wrap))?;
/// assert!(model.primary().table().is_none(), "no variable holds the table");
/// assert_eq!(tables.status("emb")?[0].rows, 0, "rows appear when a batch first looks them up");
/// # Ok::<(), strata_core::Error>(())
/// ```
#[derive(Debug)]
pub struct LocalTables {
    optimizer: RowOptimizer,
    shards: usize,
    state: Mutex<State>,
}

impl LocalTables {
    /// A store stepping every table's rows with `optimizer`, each table one shard.
    pub fn new(optimizer: RowOptimizer) -> Self {
        Self { optimizer, shards: 1, state: Mutex::new(State::default()) }
    }

    /// The same store with every table in `shards` shards (at least 1), as a ps job of that
    /// many tasks splits it: a fixed table's contiguous row ranges, an id-space table's ids
    /// hashed, each shard bounded by the table's `max_rows_per_shard`.
    pub fn with_shards(mut self, shards: usize) -> Self {
        self.shards = shards.max(1);
        self
    }

    /// The rows' optimizer.
    pub fn optimizer(&self) -> &RowOptimizer {
        &self.optimizer
    }

    /// Refuses a strategy the store cannot serve, in one line: a multi-worker job's (each
    /// worker would hold and step the whole table alone) and a parameter-server job's (its
    /// tables live on the ps tasks).
    pub fn check_strategy(strategy: &str, multi_worker: bool) -> Result<()> {
        if multi_worker || strategy == "multi-worker-mirrored" || strategy == "parameter-server" {
            return Err(Error::TableStoreStrategy {
                store: STORE,
                strategy: strategy.into(),
                why: "every worker would hold and step the whole table alone; put the tables on parameter servers, or train under one-device, mirrored or central-storage",
            });
        }
        Ok(())
    }

    /// The tables declared so far, by name.
    pub fn tables(&self) -> Vec<TableConfig> {
        lock(&self.state).tables.values().map(|t| t.config.clone()).collect()
    }

    /// The updates applied so far (steps that stepped some row).
    pub fn version(&self) -> u64 {
        lock(&self.state).version
    }

    /// Each shard of `table`: its rows held, rows evicted, bytes.
    pub fn status(&self, table: &str) -> Result<Vec<TableStatus>> {
        let state = lock(&self.state);
        Ok(state.table(table)?.shards.iter().map(TableShard::status).collect())
    }

    /// Each shard's rows of `table` (values, slots, when last seen), by ascending id: what a
    /// checkpoint of the rows holds.
    pub fn rows(&self, table: &str) -> Result<Vec<TableRows>> {
        let state = lock(&self.state);
        Ok(state.table(table)?.shards.iter().map(TableShard::rows).collect())
    }

    /// The current values of `ids` of `table`, `dim` per id, without creating rows: a row no
    /// step touched (or evicted) has its initial value. For evaluation and tests; lookups in
    /// a step read through the layer.
    pub fn read(&self, table: &str, ids: &[u64]) -> Result<Vec<f32>> {
        let state = lock(&self.state);
        let t = state.table(table)?;
        let seed = state.attached.as_ref().map_or(0, |a| a.seed);
        let (config, n) = (&t.config, t.shards.len());
        let mut out = vec![0f32; ids.len() * config.dim];
        for (&id, row) in ids.iter().zip(out.chunks_exact_mut(config.dim)) {
            config.check_id(id)?;
            match t.shards[owner_of(config.size, id, n)].row(id) {
                Some(held) => row.copy_from_slice(held),
                None => init_row(seed, &config.name, config.init, id, row),
            }
        }
        Ok(out)
    }

    /// Replaces every declared table's rows with `rows` (shards as [`LocalTables::rows`]
    /// gave them, for the same tables, shards, seed and optimizer) and the store's version
    /// with `version`; checked whole first, nothing changes on an error.
    pub fn restore(&self, rows: Vec<TableRows>, version: u64) -> Result<()> {
        let mut state = lock(&self.state);
        let mut restored: BTreeMap<String, Vec<Option<TableShard>>> =
            state.tables.iter().map(|(name, t)| (name.clone(), (0..t.shards.len()).map(|_| None).collect())).collect();
        for r in rows {
            let name = r.info.config.name.clone();
            let Some(t) = state.tables.get(&name) else {
                return Err(Error::Checkpoint(format!(
                    "rows of embedding table {name:?}, which the model does not declare"
                )));
            };
            let want = &t.shards[0].info();
            let same = r.info.config == t.config
                && r.info.seed == want.seed
                && r.info.optimizer == want.optimizer
                && r.info.num_shards == want.num_shards;
            let slot = restored.get_mut(&name).and_then(|s| s.get_mut(r.info.shard as usize));
            match slot {
                Some(slot @ None) if same => {
                    let shard = TableShard::from_rows(r)
                        .map_err(|e| Error::Checkpoint(format!("rows of embedding table {name:?}: {e}")))?;
                    *slot = Some(shard);
                }
                _ => {
                    return Err(Error::Checkpoint(format!(
                        "rows of shard {} of embedding table {name:?} that do not fit it (another shard count, seed, optimizer or configuration, or given twice); restore into the store that wrote them",
                        r.info.shard
                    )))
                }
            }
        }
        let mut shards = BTreeMap::new();
        for (name, slots) in restored {
            let Some(all) = slots.into_iter().collect::<Option<Vec<_>>>() else {
                return Err(Error::Checkpoint(format!("no rows of some shard of embedding table {name:?}")));
            };
            shards.insert(name, all);
        }
        for (name, s) in shards {
            if let Some(t) = state.tables.get_mut(&name) {
                t.shards = s;
            }
        }
        state.version = version;
        state.step = Step::default();
        Ok(())
    }
}

impl State {
    fn table(&self, name: &str) -> Result<&Table> {
        self.tables.get(name).ok_or_else(|| {
            Error::InvalidArgument(format!("embedding table {name:?} was not declared; build the model in the scope"))
        })
    }

    /// The replicas of a step: the attached strategy's (1 before a model attached).
    fn replicas(&self) -> usize {
        self.attached.as_ref().map_or(1, |a| a.replicas)
    }

    /// Releases every shard's reads of the step in progress.
    fn release_reads(&mut self) {
        let version = self.version;
        for t in self.tables.values_mut() {
            for s in &mut t.shards {
                s.release(version);
            }
        }
    }
}

/// Each replica's weight in a step: its batch rows over the step's, in f32, as the
/// strategies weigh a replica's gradient (`Shard::weight`); a replica with no gradient
/// weighs nothing.
fn replica_weights(replicas: &[ReplicaGrads]) -> Vec<f32> {
    let total: usize = replicas.iter().filter(|r| !r.tables.is_empty()).map(|r| r.rows).sum();
    replicas.iter().map(|r| if r.tables.is_empty() { 0.0 } else { r.rows as f32 / total.max(1) as f32 }).collect()
}

/// A table's rows of a step reduced row-wise: each row's gradient is the sum, in replica
/// order, of every replica's gradient of the row times its weight (the first term alone where
/// one replica touched it), as the in-memory all-reduce sums an element; by ascending id.
fn reduce_rows(replicas: &[ReplicaGrads], weights: &[f32], table: &str) -> BTreeMap<u64, Vec<f32>> {
    let mut sums: BTreeMap<u64, Vec<f32>> = BTreeMap::new();
    for (r, w) in replicas.iter().zip(weights) {
        let Some(rows) = r.tables.get(table) else { continue };
        for (&id, g) in rows {
            match sums.get_mut(&id) {
                Some(sum) => sum.iter_mut().zip(g).for_each(|(s, g)| *s += g * w),
                None => {
                    sums.insert(id, g.iter().map(|g| g * w).collect());
                }
            }
        }
    }
    sums
}

/// A shard's rows of an update: their ids and gradients, `dim` per id.
type ShardRows = (Vec<u64>, Vec<f32>);

impl LocalTables {
    /// Applies a step's rows: every table's rows reduced row-wise, split by shard, all checked
    /// (each row read in the step, each gradient finite) before any is stepped, then stepped
    /// in table and id order as the update after the store's version.
    fn apply(&self, state: &mut State, step: Step) -> Result<()> {
        let weights = replica_weights(&step.replicas);
        let version = state.version;
        // Per table (by name), per shard, the ids and their gradients.
        let mut updates: Vec<(String, Vec<ShardRows>)> = Vec::new();
        for (name, t) in &state.tables {
            let n = t.shards.len();
            let mut per_shard = vec![(Vec::new(), Vec::new()); n];
            for (id, g) in reduce_rows(&step.replicas, &weights, name) {
                let (ids, grads) = &mut per_shard[owner_of(t.config.size, id, n)];
                ids.push(id);
                grads.extend_from_slice(&g);
            }
            for (shard, (ids, grads)) in t.shards.iter().zip(&per_shard) {
                if let Err(e) = shard.check(ids, grads) {
                    state.release_reads();
                    return Err(core_error(e));
                }
            }
            updates.push((name.clone(), per_shard));
        }
        let any = updates.iter().any(|(_, shards)| shards.iter().any(|(ids, _)| !ids.is_empty()));
        if !any {
            state.release_reads();
            return Ok(());
        }
        for (name, per_shard) in updates {
            let Some(t) = state.tables.get_mut(&name) else { continue };
            for (shard, (ids, grads)) in t.shards.iter_mut().zip(per_shard) {
                shard.apply(&self.optimizer, &ids, &grads, version).map_err(core_error)?;
            }
        }
        state.version = version + 1;
        Ok(())
    }
}

impl TableStore for LocalTables {
    fn attach(&self, scope: &TableScope<'_>) -> Result<()> {
        Self::check_strategy(scope.strategy, scope.workers.is_some())?;
        let mut state = lock(&self.state);
        let at = Attached { strategy: scope.strategy.into(), replicas: scope.replicas, seed: scope.seed };
        match &state.attached {
            Some(have) if *have != at => Err(Error::TableStoreStrategy {
                store: STORE,
                strategy: scope.strategy.into(),
                why: "the store serves another strategy already (other replicas or another seed); give each strategy a store of its own",
            }),
            Some(_) => Ok(()),
            None => {
                state.attached = Some(at);
                Ok(())
            }
        }
    }

    fn declare(&self, table: &TableConfig) -> Result<()> {
        table.check()?;
        let mut state = lock(&self.state);
        let Some(seed) = state.attached.as_ref().map(|a| a.seed) else {
            return Err(Error::InvalidArgument(format!(
                "embedding table {:?} was declared before the store learnt its strategy; build the model with the Embedding layer in the strategy's scope",
                table.name
            )));
        };
        if let Some(t) = state.tables.get(&table.name) {
            if t.config != *table {
                return Err(Error::InvalidArgument(format!(
                    "embedding table {:?} is declared twice, differently ({:?}, then {table:?}); build the same model every time",
                    table.name, t.config
                )));
            }
            return Ok(());
        }
        let n = self.shards as u32;
        let shards = (0..n)
            .map(|k| {
                let info = TableInfo {
                    config: table.clone(),
                    seed,
                    shard: k,
                    num_shards: n,
                    optimizer: self.optimizer.clone(),
                };
                TableShard::new(info).map_err(core_error)
            })
            .collect::<Result<Vec<_>>>()?;
        state.tables.insert(table.name.clone(), Table { config: table.clone(), shards });
        Ok(())
    }

    fn pull(&self, _replica: usize, table: &str, ids: &[u64]) -> Result<Vec<f32>> {
        let mut state = lock(&self.state);
        let version = state.version;
        let t = state.tables.get_mut(table).ok_or_else(|| {
            Error::InvalidArgument(format!("embedding table {table:?} was not declared; build the model in the scope"))
        })?;
        let (dim, n) = (t.config.dim, t.shards.len());
        // Every id checked before any row is created.
        for &id in ids {
            t.config.check_id(id)?;
        }
        if n == 1 {
            return t.shards[0].read(ids, version).map_err(core_error);
        }
        let mut per_shard: Vec<Vec<u64>> = vec![Vec::new(); n];
        let mut place = Vec::with_capacity(ids.len());
        for &id in ids {
            let k = owner_of(t.config.size, id, n);
            place.push((k, per_shard[k].len()));
            per_shard[k].push(id);
        }
        let mut read = Vec::with_capacity(n);
        for (shard, mine) in t.shards.iter_mut().zip(&per_shard) {
            read.push(if mine.is_empty() { Vec::new() } else { shard.read(mine, version).map_err(core_error)? });
        }
        let mut values = vec![0f32; ids.len() * dim];
        for (row, (k, at)) in values.chunks_exact_mut(dim).zip(place) {
            row.copy_from_slice(&read[k][at * dim..(at + 1) * dim]);
        }
        Ok(values)
    }

    /// Kept per replica until the step ends, summed over the replica's lookups of the row.
    fn gradient(&self, replica: usize, table: &str, ids: &[u64], grad: Vec<f32>, batch_rows: usize) -> Result<()> {
        let mut state = lock(&self.state);
        let dim = state.table(table)?.config.dim;
        if grad.len() != ids.len() * dim {
            return Err(Error::InvalidArgument(format!(
                "{} gradient values for {} rows of embedding table {table:?} of dimension {dim}",
                grad.len(),
                ids.len()
            )));
        }
        let replicas = state.replicas();
        if replica >= replicas {
            return Err(Error::InvalidArgument(format!(
                "replica {replica} handed a gradient of embedding table {table:?} to a store serving {replicas} replicas; build the model in the scope of the strategy that runs it"
            )));
        }
        let step = &mut state.step;
        if step.replicas.len() < replicas {
            step.replicas.resize_with(replicas, ReplicaGrads::default);
        }
        let mine = &mut step.replicas[replica];
        mine.rows = mine.rows.max(batch_rows);
        let rows = mine.tables.entry(table.to_string()).or_default();
        for (&id, g) in ids.iter().zip(grad.chunks_exact(dim)) {
            match rows.get_mut(&id) {
                Some(sum) => sum.iter_mut().zip(g).for_each(|(s, g)| *s += g),
                None => {
                    rows.insert(id, g.to_vec());
                }
            }
        }
        Ok(())
    }

    /// `version` (the updates applied), then per table and shard `<table>/<shard>/ids`,
    /// `last_seen` (u64s as i64 bit patterns, as a ps task's checkpoint holds them), `values`
    /// `[rows, dim]`, `slots` `[rows, slots x dim]` and `evicted`: the rows created and not
    /// evicted, by ascending id.
    fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let state = lock(&self.state);
        let cpu = &Device::Cpu;
        let longs = |v: Vec<i64>| Tensor::from_vec(v.clone(), v.len(), cpu);
        let mut out = vec![("version".to_string(), longs(vec![state.version as i64])?)];
        for (name, t) in &state.tables {
            for (k, shard) in t.shards.iter().enumerate() {
                let rows = shard.rows();
                let (n, dim) = (rows.ids.len(), t.config.dim);
                let key = |what: &str| format!("{name}/{k}/{what}");
                out.push((key("ids"), longs(rows.ids.iter().map(|&i| i as i64).collect())?));
                out.push((key("last_seen"), longs(rows.last_seen.iter().map(|&i| i as i64).collect())?));
                out.push((key("values"), Tensor::from_vec(rows.values, (n, dim), cpu)?));
                let width = self.optimizer.slots() * dim;
                out.push((key("slots"), Tensor::from_vec(rows.slots, (n, width), cpu)?));
                out.push((key("evicted"), longs(vec![rows.evicted as i64])?));
            }
        }
        Ok(out)
    }

    fn load_state_tensors(&self, state: &[(String, Tensor)]) -> Result<()> {
        let get = |key: &str| -> Result<&Tensor> {
            state.iter().find(|(n, _)| n == key).map(|(_, t)| t).ok_or_else(|| {
                Error::Checkpoint(format!(
                    "no {key:?} among the embedding rows the checkpoint holds; resume with the table optimizer, shards and model that wrote it (a checkpoint of a table held as a variable has no rows)"
                ))
            })
        };
        let longs = |key: &str| -> Result<Vec<u64>> {
            Ok(get(key)?.flatten_all()?.to_vec1::<i64>()?.into_iter().map(|v| v as u64).collect())
        };
        let floats = |key: &str| -> Result<Vec<f32>> { Ok(get(key)?.flatten_all()?.to_vec1::<f32>()?) };
        let version = longs("version")?.first().copied().unwrap_or(0);
        let shards: Vec<TableInfo> = {
            let state = lock(&self.state);
            state.tables.values().flat_map(|t| t.shards.iter().map(|s| s.info().clone())).collect()
        };
        let mut rows = Vec::with_capacity(shards.len());
        for info in shards {
            let key = |what: &str| format!("{}/{}/{what}", info.config.name, info.shard);
            let evicted = longs(&key("evicted"))?.first().copied().unwrap_or(0);
            let (ids, last_seen) = (longs(&key("ids"))?, longs(&key("last_seen"))?);
            let (values, slots) = (floats(&key("values"))?, floats(&key("slots"))?);
            rows.push(TableRows { info, evicted, ids, values, slots, last_seen });
        }
        self.restore(rows, version)
    }

    /// The last replica to end the step applies it (a failed step's rows are dropped).
    fn end_step(&self, _replica: usize, failed: bool) -> Result<()> {
        let mut state = lock(&self.state);
        state.step.ended += 1;
        state.step.failed |= failed;
        if state.step.ended < state.replicas() {
            return Ok(());
        }
        let step = std::mem::take(&mut state.step);
        if step.failed {
            state.release_reads();
            return Ok(());
        }
        self.apply(&mut state, step)
    }
}

//! Embedding tables on the ps tasks, seen from a worker: [`PsTables`] is the
//! [`TableStore`] a worker's strategy gets in [`StrategyOptions::tables`], so that the model's
//! embedding lookups pull only the rows their batch touches from the ps tasks that own them,
//! and the rows' gradients (summed per row on the worker) go back as rows and ids.
//!
//! Every step pulls under a lease (the store's step count), so a push names rows the task
//! knows this worker pulled; each push is an update `(worker, run, step, 0)`, sent again with
//! the same identity while a task is unavailable, so it is applied exactly once. After the
//! step (at the end of the strategy's run, or at the first lookup after the step's backward
//! when one run trains several steps) it is pushed, to every ps task holding some of its
//! rows, in parallel, or, if the store is built so ([`RowsPush::WithNextPull`]), with the
//! next step's pull of that task's rows, in the same call (applied first, so the pull reads
//! it: one round trip a step instead of two). Told the next step's ids during a step
//! ([`TableStore::expect_next`], the click model's records made ahead), such a store starts
//! that call as soon as the step's lookups have their gradients, on its task threads, beside
//! the rest of the step (the dense layers' all-reduce and update); the next lookup takes its
//! rows if it asks for those ids, and otherwise pulls its own (the push was applied either
//! way, once). A step that fails after its rows were final has them applied: hybrid rows are
//! asynchronous, and a failed hybrid step ends the job. So embeddings train asynchronously beside
//! whatever the strategy does with the dense variables (hybrid training, PERSIA's); in a ps
//! job, the rows are handed to the step's push of the dense gradients instead
//! ([`PsTables::take_rows`]), so that both are one update per ps task.
//!
//! [`StrategyOptions::tables`]: strata_core::StrategyOptions::tables

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use strata_core::embedding::{owner_of, TableConfig, TableStore};
use strata_core::{Error, Result};
use strata_transport::ps::{
    PsClient, PsMode, RowGrads, RowOptimizer, RowsPulled, ServerOptimizer, StaleRate, TableInfo, UpdateId, WireFormat,
};

use super::task_threads::{Started, TaskCall, TaskThreads};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A step's rows of one table: what was pulled (per ps task, with the task's version) and the
/// gradients the backward pass gave, summed per row.
#[derive(Debug, Default)]
struct StepTable {
    /// Per ps task, the version its rows were pulled at.
    versions: BTreeMap<usize, u64>,
    /// The ids with a gradient, ascending, each once.
    ids: Vec<u64>,
    /// Their gradients, row after row (`dim` values each, in the order of `ids`), each summed
    /// over the step's lookups (of its one replica): one allocation for the step's rows, not
    /// one per row.
    values: Vec<f32>,
    /// Rows pulled ahead for a lookup ([`TableStore::prefetch`]): the lease they were pulled
    /// under, their ids (distinct, ascending) and values.
    prefetched: Option<(u64, Vec<u64>, Vec<f32>)>,
}

impl StepTable {
    /// Adds the gradient `grad` (row after row, `dim` values each) of the rows `ids`.
    fn add(&mut self, ids: &[u64], grad: Vec<f32>, dim: usize) {
        if self.ids.is_empty() && ids.windows(2).all(|w| w[0] < w[1]) {
            // A step's one lookup of the table (the usual case): its rows as they come.
            self.ids = ids.to_vec();
            self.values = grad;
            return;
        }
        // Several lookups of the table in a step, or ids out of order: every row in id order
        // (a stable sort: the rows already held first, then the new ones as they came), equal
        // ids summed in that order.
        let (held_ids, held) = (std::mem::take(&mut self.ids), std::mem::take(&mut self.values));
        let chunk = dim.max(1);
        let mut rows: Vec<(u64, &[f32])> = held_ids
            .iter()
            .copied()
            .zip(held.chunks_exact(chunk))
            .chain(ids.iter().copied().zip(grad.chunks_exact(chunk)))
            .collect();
        rows.sort_by_key(|&(id, _)| id);
        for (id, row) in rows {
            if self.ids.last() == Some(&id) {
                let start = self.values.len() - row.len();
                self.values[start..].iter_mut().zip(row).for_each(|(v, g)| *v += g);
            } else {
                self.ids.push(id);
                self.values.extend_from_slice(row);
            }
        }
    }
}

/// What the store knows of the current step.
#[derive(Debug, Default)]
struct Step {
    /// The lease (and update step) of this step's pulls and push.
    lease: u64,
    tables: HashMap<String, StepTable>,
    /// The step's lookups that pulled, and the gradients given back so far: when they are as
    /// many, the step's rows are final.
    lookups: usize,
    gradients: usize,
    /// Whether the step's rows were taken for the next step's pull, started early (or held
    /// for the next lookup, if that could not start).
    pushed_early: bool,
}

/// The rows a lookup of the next step will ask for ([`TableStore::expect_next`]): taken by
/// the first step whose rows become final after it was told.
#[derive(Debug)]
struct Next {
    table: String,
    ids: Vec<u64>,
}

/// A pull of rows started, its results still to come: the rows `ids` of `table` under
/// `lease`, and the push it carries.
#[derive(Debug)]
struct InFlight {
    lease: u64,
    table: String,
    ids: Vec<u64>,
    /// Per id, its ps task and its place in that task's rows.
    place: Vec<(usize, usize)>,
    /// Per ps task, the ids asked of it.
    counts: Vec<usize>,
    pending: Option<Arc<Pending>>,
    started: Started<TaskRows>,
}

/// What a store's training steps moved: the steps that pushed rows, the bytes of row values
/// they pulled (f32) and the bytes of row gradients and ids they pushed. A training step pulls
/// each of its distinct rows once and pushes a gradient for each, so its pulled bytes are its
/// pushed rows x dim x 4; lookups of no training step (evaluation's) are not counted.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct TableTraffic {
    /// Steps that pushed rows.
    pub steps: u64,
    /// Bytes of row values pulled by those steps.
    pub bytes_pulled: u64,
    /// Bytes of row gradients (f32) and their ids (8 bytes each) pushed.
    pub bytes_pushed: u64,
    /// Rows pushed (distinct per step and ps task).
    pub rows_pushed: u64,
    /// Pulls of rows sent (one per lookup or prefetch that pulled, whatever the number of ps
    /// tasks asked): a lookup served by rows pulled ahead sends none.
    pub pulls: u64,
    /// Of those, the pulls a lookup took that were started before its step, with the step
    /// before's push, once that step's rows were final ([`TableStore::expect_next`]).
    pub pulls_early: u64,
}

/// Who a store pulls and pushes as, and to which ps tasks.
#[derive(Debug, Default)]
struct Binding {
    /// The pulling and pushing worker (`worker:<i>`): the leases' owner.
    worker: String,
    /// Who numbers this store's updates: the worker and a run id, so that a restarted worker's
    /// updates are never taken for its predecessor's.
    client: String,
    /// A client of every ps task, by index, in the job's wire format.
    clients: Arc<Vec<PsClient>>,
}

/// The [`TableStore`] of a worker whose tables live on ps tasks (see the [module docs](self)).
#[derive(Debug)]
pub struct PsTables {
    binding: Mutex<Binding>,
    /// Whether [`end_step`](TableStore::end_step) pushes (`false`: the dense push takes them).
    push_at_end: bool,
    /// When a step's rows leave (see [`RowsPush`]).
    rows_push: RowsPush,
    /// The threads that call the ps tasks, one per task.
    threads: TaskThreads,
    /// An ended step's push, not yet sent: it goes with the next pull, or at a flush.
    pending: Mutex<Option<Pending>>,
    /// The rows the next step will look up, if told ([`TableStore::expect_next`]).
    next: Mutex<Option<Next>>,
    /// The next step's pull, started with this step's push once its rows were final.
    early: Mutex<Option<InFlight>>,
    /// Whether the last call to the ps tasks succeeded (a store that is dropped sends what it
    /// holds only then, not into a job whose tasks are gone).
    healthy: std::sync::atomic::AtomicBool,
    tables: Mutex<HashMap<String, TableConfig>>,
    step: Mutex<Step>,
    traffic: Mutex<TableTraffic>,
}

/// An unbound store whose rows the step's dense push takes (a parameter-server worker's).
impl Default for PsTables {
    fn default() -> Self {
        Self::unbound().pushed_with_the_dense_gradients()
    }
}

impl PsTables {
    /// The store of `worker` (`worker:<i>`) over the ps tasks of `clients` (by index), whose
    /// rows' gradients are pushed at the end of each step.
    pub fn new(worker: impl Into<String>, clients: Vec<PsClient>) -> Self {
        let store = Self::unbound();
        store.bind(&worker.into(), Arc::new(clients));
        store
    }

    /// A store that knows no ps task yet ([`bind`](Self::bind) it before a step looks up a
    /// table): a ps worker's model is built before its first step tells it the ps tasks.
    pub fn unbound() -> Self {
        Self {
            binding: Mutex::new(Binding::default()),
            push_at_end: true,
            rows_push: RowsPush::default(),
            threads: TaskThreads::default(),
            pending: Mutex::new(None),
            next: Mutex::new(None),
            early: Mutex::new(None),
            healthy: std::sync::atomic::AtomicBool::new(true),
            tables: Mutex::new(HashMap::new()),
            step: Mutex::new(Step::default()),
            traffic: Mutex::new(TableTraffic::default()),
        }
    }

    /// Pulls and pushes as `worker` from the ps tasks of `clients` (by index) from now on.
    pub fn bind(&self, worker: &str, clients: Arc<Vec<PsClient>>) {
        let mut b = lock(&self.binding);
        if b.worker != worker {
            let run = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
            b.worker = worker.to_string();
            b.client = format!("{worker}/tables-{run:x}");
        }
        b.clients = clients;
    }

    /// The worker, its update numbering and the ps tasks' clients, or why there are none.
    fn bound(&self) -> Result<(String, String, Arc<Vec<PsClient>>)> {
        let b = lock(&self.binding);
        if b.clients.is_empty() {
            return Err(Error::InvalidArgument(
                "an embedding table on parameter servers was looked up before the worker knew its ps tasks; step through PsWorkerModel::run_batch".into(),
            ));
        }
        Ok((b.worker.clone(), b.client.clone(), b.clients.clone()))
    }

    /// The same store, whose rows are taken by the step's own push ([`take_rows`](Self::take_rows))
    /// instead of pushed at the end of the step.
    pub fn pushed_with_the_dense_gradients(mut self) -> Self {
        self.push_at_end = false;
        self
    }

    /// When a step's rows leave for the ps tasks ([`RowsPush`]; by default at the end of the
    /// step).
    pub fn pushing_rows(mut self, when: RowsPush) -> Self {
        self.rows_push = when;
        self
    }

    /// Creates every declared table's shard on every ps task of this store (shard `k` of as
    /// many as there are tasks, rows stepped by `optimizer`, initial values from `seed`), with
    /// no variables: what a strategy that keeps its dense variables itself does before its
    /// first step (hybrid training: the dense layers synchronous across the workers, the
    /// tables asynchronous on the ps tasks). Every worker may call it: a task answers a table
    /// that exists as described without changing it, and refuses one described differently.
    pub fn create_tables(&self, seed: u64, optimizer: &RowOptimizer, mode: PsMode) -> Result<()> {
        let (_, _, clients) = self.bound()?;
        let n = clients.len() as u32;
        let tables = self.tables();
        for (k, client) in clients.iter().enumerate() {
            let shards: Vec<TableInfo> = tables
                .iter()
                .map(|config| TableInfo {
                    config: config.clone(),
                    seed,
                    shard: k as u32,
                    num_shards: n,
                    optimizer: optimizer.clone(),
                })
                .collect();
            // The tasks' dense optimizer steps nothing here (no variables); every worker names
            // the same one, so that creating again finds the task as described.
            let dense = ServerOptimizer::Sgd { lr: 1.0 };
            client.create_with_tables(&[], &shards, &dense, None, StaleRate::Constant, mode, WireFormat::F32)?;
        }
        Ok(())
    }

    /// The tables declared so far.
    pub fn tables(&self) -> Vec<TableConfig> {
        let mut t: Vec<TableConfig> = lock(&self.tables).values().cloned().collect();
        t.sort_by(|a, b| a.name.cmp(&b.name));
        t
    }

    /// Starts the next step: its lease, no lookups yet.
    fn next_step(&self) {
        let mut step = lock(&self.step);
        step.lease += 1;
        step.lookups = 0;
        step.gradients = 0;
        step.pushed_early = false;
    }

    /// Whether the current step's backward gave gradients already.
    fn has_gradients(&self) -> bool {
        lock(&self.step).tables.values().any(|t| !t.ids.is_empty())
    }

    /// The current step's lease (the number of steps this store has ended).
    pub fn lease(&self) -> u64 {
        lock(&self.step).lease
    }

    fn config(&self, table: &str) -> Result<TableConfig> {
        lock(&self.tables).get(table).cloned().ok_or_else(|| {
            Error::InvalidArgument(format!("embedding table {table:?} was not declared; build the model in the scope"))
        })
    }

    /// What this store's training steps pulled and pushed so far.
    pub fn traffic(&self) -> TableTraffic {
        *lock(&self.traffic)
    }

    /// The step's row gradients, per ps task (each table's rows that task owns, ids ascending),
    /// and the version each task's rows were pulled at; the step's gradients are cleared.
    pub fn take_rows(&self) -> Vec<(Vec<RowGrads>, u64)> {
        let n = lock(&self.binding).clients.len();
        let mut step = lock(&self.step);
        let lease = step.lease;
        let mut per_task: Vec<(Vec<RowGrads>, u64)> = vec![(Vec::new(), 0); n];
        let tables = lock(&self.tables);
        let mut names: Vec<String> = step.tables.keys().cloned().collect();
        names.sort();
        for name in names {
            let Some(st) = step.tables.remove(&name) else { continue };
            let Some(config) = tables.get(&name) else { continue };
            let mut rows: Vec<RowGrads> =
                (0..n).map(|_| RowGrads { table: name.clone(), lease, ids: Vec::new(), grads: Vec::new() }).collect();
            let dim = config.dim;
            for (&id, row) in st.ids.iter().zip(st.values.chunks_exact(dim.max(1))) {
                let k = owner_of(config.size, id, n);
                rows[k].ids.push(id);
                rows[k].grads.extend_from_slice(row);
            }
            for (k, r) in rows.into_iter().enumerate() {
                if !r.ids.is_empty() {
                    per_task[k].1 = per_task[k].1.max(st.versions.get(&k).copied().unwrap_or(0));
                    per_task[k].0.push(r);
                }
            }
        }
        let rows: u64 = per_task.iter().flat_map(|(r, _)| r).map(|r| r.ids.len() as u64).sum();
        if rows > 0 {
            let values: u64 = per_task.iter().flat_map(|(r, _)| r).map(|r| r.grads.len() as u64).sum();
            let mut t = lock(&self.traffic);
            t.steps += 1;
            t.bytes_pulled += values * 4;
            t.bytes_pushed += values * 4 + rows * 8;
            t.rows_pushed += rows;
        }
        per_task
    }

    /// Pulls the rows `ids` (distinct, ascending) of `table` from the ps tasks that own them,
    /// in parallel, under the step's lease, and records each task's version for the push. An
    /// ended step's push the store holds goes with the pull to each task it has rows for (on
    /// its own to a task this pull asks nothing of); it is held again if a call fails, and sent
    /// again with the same identity, so that it is applied once.
    fn pull_now(&self, table: &str, config: &TableConfig, ids: &[u64]) -> Result<Vec<f32>> {
        let (calls, flight) = self.pull_calls(table, config, ids, self.lease())?;
        let results = self.threads.run("rows pull", calls);
        self.finish_pull(flight, results)
    }

    /// The calls of a pull of `ids` of `table` under `lease` carrying the push the store holds
    /// (taken from it), and what [`finish_pull`](Self::finish_pull) needs of them (its
    /// `started` a placeholder until they are started).
    fn pull_calls(
        &self,
        table: &str,
        config: &TableConfig,
        ids: &[u64],
        lease: u64,
    ) -> Result<(Vec<TaskCall<TaskRows>>, InFlight)> {
        let (worker, _, clients) = self.bound()?;
        let n = clients.len();
        let mut per_task: Vec<Vec<u64>> = vec![Vec::new(); n];
        let mut place = Vec::with_capacity(ids.len());
        for &id in ids {
            config.check_id(id)?;
            let k = owner_of(config.size, id, n);
            place.push((k, per_task[k].len()));
            per_task[k].push(id);
        }
        lock(&self.traffic).pulls += 1;
        let pending = lock(&self.pending).take().map(Arc::new);
        let counts: Vec<usize> = per_task.iter().map(Vec::len).collect();
        let calls: Vec<TaskCall<TaskRows>> = per_task
            .into_iter()
            .enumerate()
            .map(|(k, mine)| -> TaskCall<TaskRows> {
                let (clients, pending, worker, table) =
                    (clients.clone(), pending.clone(), worker.clone(), table.to_string());
                Box::new(move || {
                    let client = &clients[k];
                    let push = pending.as_deref().filter(|p| !p.per_task[k].0.is_empty());
                    let values = |r: RowsPulled| Some((r.values.into_iter().next().unwrap_or_default(), r.version));
                    match (push, mine.is_empty()) {
                        (None, true) => Ok(None),
                        (Some(p), true) => {
                            let (rows, base) = &p.per_task[k];
                            client.push_rows(&p.id, *base, &[], rows).map(|_| None).map_err(Error::from)
                        }
                        (None, false) => {
                            client.pull_rows(&worker, lease, &[(&table, &mine)]).map(values).map_err(Error::from)
                        }
                        (Some(p), false) => {
                            let (rows, base) = &p.per_task[k];
                            let (_, r) = client
                                .push_rows_and_pull(&p.id, *base, rows, &worker, lease, &[(&table, &mine)])
                                .map_err(Error::from)?;
                            Ok(values(r))
                        }
                    }
                })
            })
            .collect();
        let flight = InFlight {
            lease,
            table: table.to_string(),
            ids: ids.to_vec(),
            place,
            counts,
            pending,
            started: Started::empty(),
        };
        Ok((calls, flight))
    }

    /// The rows of `flight`'s pull from its calls' `results`, each task's version recorded for
    /// the step's push; a failed call holds the carried push again and is the error.
    fn finish_pull(&self, flight: InFlight, results: Vec<Result<TaskRows>>) -> Result<Vec<f32>> {
        let InFlight { table, ids, place, counts, pending, .. } = flight;
        // Every call has ended: the push is this store's alone again.
        let pending = pending.map(|p| Arc::try_unwrap(p).unwrap_or_else(|p| (*p).clone()));
        let pulled = match results.into_iter().collect::<Result<Vec<_>>>() {
            Ok(p) => p,
            Err(e) => {
                self.hold_again(pending);
                return Err(e);
            }
        };
        self.healthy.store(true, std::sync::atomic::Ordering::Relaxed);
        let dim = self.config(&table)?.dim;
        let mut values = vec![0f32; ids.len() * dim];
        for (i, &(k, at)) in place.iter().enumerate() {
            let Some((rows, _)) = &pulled[k] else { continue };
            let row = rows.get(at * dim..(at + 1) * dim).ok_or_else(|| {
                Error::Cluster(format!(
                    "ps:{k} returned {} values of table {table:?} for {} rows",
                    rows.len(),
                    counts[k]
                ))
            })?;
            values[i * dim..(i + 1) * dim].copy_from_slice(row);
        }
        let mut step = lock(&self.step);
        step.lookups += 1;
        let st = step.tables.entry(table).or_default();
        for (k, p) in pulled.iter().enumerate() {
            if let Some((_, version)) = p {
                st.versions.insert(k, *version);
            }
        }
        Ok(values)
    }

    /// Once the step's lookups all have their gradients, and the next step's rows are known
    /// ([`TableStore::expect_next`]): starts the next step's pull of them under the next lease,
    /// carrying this step's push, beside the rest of this step (its dense all-reduce and
    /// update). The next lookup takes its rows if it asks for them.
    fn start_early_if_told(&self) -> Result<()> {
        if !(self.push_at_end && self.rows_push == RowsPush::WithNextPull) {
            return Ok(());
        }
        let lease = self.lease();
        {
            let step = lock(&self.step);
            if step.lookups == 0 || step.gradients < step.lookups {
                return Ok(());
            }
        }
        // A push still held (a failed call's) goes the usual way, with the next lookup; a pull
        // in flight is this step's, not yet taken (its lookup comes first).
        if lock(&self.pending).is_some() || lock(&self.early).is_some() {
            return Ok(());
        }
        let Some(next) = lock(&self.next).take() else { return Ok(()) };
        let Ok(config) = self.config(&next.table) else { return Ok(()) };
        let Some(push) = self.step_push(lease)? else { return Ok(()) };
        *lock(&self.pending) = Some(push);
        // The step's rows have left it: the next lookup begins the next step.
        lock(&self.step).pushed_early = true;
        let (calls, mut flight) = match self.pull_calls(&next.table, &config, &next.ids, lease + 1) {
            Ok(c) => c,
            Err(e) => {
                // An id the table refuses: the push waits for the next lookup, as without this.
                tracing::debug!(error = %e, "the next step's rows were not pulled early");
                return Ok(());
            }
        };
        flight.started = self.threads.start(calls);
        *lock(&self.early) = Some(flight);
        Ok(())
    }

    /// The pull started early, if one is in flight, waited for: its rows if it pulled `ids` of
    /// `table` under the current lease (`wanted`); otherwise `None`, its rows dropped (its push
    /// was applied, or is held again if a call failed, and goes with the next pull).
    fn settle_early(&self, wanted: Option<(&str, &[u64])>) -> Option<Vec<f32>> {
        let mut flight = lock(&self.early).take()?;
        let results = std::mem::replace(&mut flight.started, Started::empty()).wait("rows pull");
        let lease = self.lease();
        if wanted.is_some_and(|(table, ids)| flight.lease == lease && flight.table == table && flight.ids == ids) {
            // A failed call holds the push again: the lookup then pulls on its own, carrying it.
            let values = self.finish_pull(flight, results).ok()?;
            lock(&self.traffic).pulls_early += 1;
            return Some(values);
        }
        let pending = flight.pending.take().map(|p| Arc::try_unwrap(p).unwrap_or_else(|p| (*p).clone()));
        if results.iter().any(Result::is_err) {
            self.hold_again(pending);
        } else {
            self.healthy.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        None
    }

    /// Holds `pending` again after a call that should have sent it failed (it is sent again
    /// with the same identity: a task that applied it answers the retry as a duplicate).
    fn hold_again(&self, pending: Option<Pending>) {
        self.healthy.store(false, std::sync::atomic::Ordering::Relaxed);
        if let Some(p) = pending {
            *lock(&self.pending) = Some(p);
        }
    }

    /// The step's rows, as update `(worker, client, lease, 0)` per ps task, or `None` when the
    /// step has none.
    fn step_push(&self, lease: u64) -> Result<Option<Pending>> {
        let (worker, client, _) = self.bound()?;
        let per_task = self.take_rows();
        if per_task.iter().all(|(rows, _)| rows.is_empty()) {
            return Ok(None);
        }
        Ok(Some(Pending { id: UpdateId { worker, client, step: lease, seq: 0 }, per_task }))
    }

    /// Ends the step of `lease` for the push: sent now, or held for the next pull (an older
    /// push still held is sent first).
    fn push(&self, lease: u64) -> Result<()> {
        let Some(push) = self.step_push(lease)? else { return Ok(()) };
        if self.rows_push == RowsPush::WithNextPull {
            self.send_pending()?;
            *lock(&self.pending) = Some(push);
            return Ok(());
        }
        self.send(Some(push))
    }

    /// Sends the push the store holds, if any (after the pull started early, which may carry
    /// it, has ended).
    fn send_pending(&self) -> Result<()> {
        self.settle_early(None);
        let pending = lock(&self.pending).take();
        self.send(pending)
    }

    /// Pushes `push` to every ps task it has rows for, in parallel; held again if a call fails.
    fn send(&self, push: Option<Pending>) -> Result<()> {
        let Some(p) = push else { return Ok(()) };
        let (_, _, clients) = self.bound()?;
        let p = Arc::new(p);
        let calls: Vec<TaskCall<()>> = (0..p.per_task.len())
            .filter(|&k| !p.per_task[k].0.is_empty())
            .map(|k| -> TaskCall<()> {
                let (clients, p) = (clients.clone(), p.clone());
                Box::new(move || {
                    let (rows, base) = &p.per_task[k];
                    clients[k].push_rows(&p.id, *base, &[], rows).map(drop).map_err(Error::from)
                })
            })
            .collect();
        let results = self.threads.run("rows push", calls);
        let p = Arc::try_unwrap(p).unwrap_or_else(|p| (*p).clone());
        match results.into_iter().collect::<Result<()>>() {
            Ok(()) => {
                self.healthy.store(true, std::sync::atomic::Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                self.hold_again(Some(p));
                Err(e)
            }
        }
    }
}

/// When a step's rows leave a [`PsTables`] store for the ps tasks. Both ways apply each step's
/// rows exactly once, before the worker's next pull of rows from a task reads them (it reads
/// its own updates).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RowsPush {
    /// At the end of the step, on their own: when the strategy's run returns, its rows are
    /// applied.
    #[default]
    AtStepEnd,
    /// With the next step's pull of each task's rows, in the same call (`PullRows` carrying
    /// the push, applied first): one call to a task a step instead of two, what a hybrid job
    /// does (`strata train --ps-mode hybrid`). Until then the push waits in the store, and
    /// other workers do not see it: [`flush`](TableStore::flush) sends it. A trainer's fit
    /// does after its last step, every worker before a checkpoint of the tables, a
    /// multi-worker strategy's `finish`, and dropping the store when its calls were
    /// succeeding.
    WithNextPull,
}

/// An ended step's push: its update identity and, per ps task, its rows and the version they
/// were pulled at.
#[derive(Clone, Debug)]
struct Pending {
    id: UpdateId,
    per_task: Vec<(Vec<RowGrads>, u64)>,
}

/// A store dropped while it holds a step's push sends it, if its calls were succeeding: a
/// program that steps a table and ends loses no step (one that stops after a failed call
/// does not wait on tasks that may be gone).
impl Drop for PsTables {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.settle_early(None);
        }
        let held = self.pending.get_mut().map_or_else(|p| p.into_inner().is_some(), |p| p.is_some());
        if !held || std::thread::panicking() {
            return;
        }
        if !self.healthy.load(std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                "an embedding table store was dropped after a failed call, holding a step's rows it did not push"
            );
            return;
        }
        if let Err(e) = self.send_pending() {
            tracing::warn!(error = %e, "an embedding table store was dropped holding a step's rows, and could not push them");
        }
    }
}

/// The rows one ps task returned and its version (`None`: none of the step's rows is there).
type TaskRows = Option<(Vec<f32>, u64)>;

/// A worker of one replica only: the store keeps one step's rows.
fn one_replica(replica: usize) -> Result<()> {
    if replica != 0 {
        return Err(Error::InvalidArgument(format!(
            "replica {replica} looked up an embedding table on parameter servers; a worker with tables runs one replica, so start more workers instead"
        )));
    }
    Ok(())
}

impl TableStore for PsTables {
    fn declare(&self, table: &TableConfig) -> Result<()> {
        table.check()?;
        let mut tables = lock(&self.tables);
        match tables.get(&table.name) {
            Some(t) if t != table => Err(Error::InvalidArgument(format!(
                "embedding table {:?} is declared twice, differently ({t:?}, then {table:?}); build the same model every time",
                table.name
            ))),
            Some(_) => Ok(()),
            None => {
                tables.insert(table.name.clone(), table.clone());
                Ok(())
            }
        }
    }

    fn pull(&self, replica: usize, table: &str, ids: &[u64]) -> Result<Vec<f32>> {
        one_replica(replica)?;
        let config = self.config(table)?;
        // A lookup after the step's backward starts the next step (several steps in one run
        // of the strategy, as a trainer's execution has): the last one's rows go first (or
        // went, with the next step's pull started early).
        let pushed_early = lock(&self.step).pushed_early;
        if self.push_at_end && pushed_early {
            self.next_step();
        } else if self.push_at_end && self.has_gradients() {
            let lease = self.lease();
            self.push(lease)?;
            self.next_step();
        }
        if let Some(values) = self.settle_early(Some((table, ids))) {
            return Ok(values);
        }
        // Rows pulled ahead for this step, if it asks for the same ones (their versions were
        // taken then); else they are dropped and the rows pulled now.
        let ahead = lock(&self.step).tables.get_mut(table).and_then(|st| st.prefetched.take());
        if let Some((lease, pulled, values)) = ahead {
            if lease == self.lease() && pulled == ids {
                return Ok(values);
            }
        }
        self.pull_now(table, &config, ids)
    }

    fn prefetch(&self, replica: usize, table: &str, ids: &[u64]) -> Result<()> {
        // Always a fresh pull: a step tried again under the same lease (its first try failed
        // before the strategy ran it) does not take the first try's rows.
        if let Some(st) = lock(&self.step).tables.get_mut(table) {
            st.prefetched = None;
        }
        let values = self.pull(replica, table, ids)?;
        let mut step = lock(&self.step);
        let lease = step.lease;
        step.tables.entry(table.to_string()).or_default().prefetched = Some((lease, ids.to_vec(), values));
        Ok(())
    }

    /// One replica: the gradient is its loss's (a mean over its batch rows), as a worker of one
    /// replica pushes its variables' gradients.
    fn gradient(&self, replica: usize, table: &str, ids: &[u64], grad: Vec<f32>, _batch_rows: usize) -> Result<()> {
        one_replica(replica)?;
        let dim = self.config(table)?.dim;
        if grad.len() != ids.len() * dim {
            return Err(Error::InvalidArgument(format!(
                "{} gradient values for {} rows of embedding table {table:?} of dimension {dim}",
                grad.len(),
                ids.len()
            )));
        }
        {
            let mut step = lock(&self.step);
            step.tables.entry(table.to_string()).or_default().add(ids, grad, dim);
            step.gradients += 1;
        }
        self.start_early_if_told()
    }

    fn expect_next(&self, replica: usize, table: &str, ids: &[u64]) -> Result<()> {
        one_replica(replica)?;
        if self.push_at_end && self.rows_push == RowsPush::WithNextPull {
            *lock(&self.next) = Some(Next { table: table.to_string(), ids: ids.to_vec() });
            self.start_early_if_told()?;
        }
        Ok(())
    }

    /// A store that pushes its own rows (hybrid training) has the ps tasks checkpoint them; in
    /// a parameter-server job the coordinator does.
    fn checkpoints_elsewhere(&self) -> bool {
        self.push_at_end
    }

    /// Sends the push a store that pushes with the next pull holds ([`RowsPush::WithNextPull`]).
    fn flush(&self) -> Result<()> {
        self.send_pending()
    }

    /// Every ps task writes its checkpoint of `step` (as of a whole job of them: `ps-<i>` of the
    /// job's checkpoint root), in parallel, once the push this store holds is applied.
    fn checkpoint(&self, step: u64) -> Result<()> {
        self.send_pending()?;
        let (_, _, clients) = self.bound()?;
        let tasks = u32::try_from(clients.len())
            .map_err(|_| Error::InvalidArgument(format!("{} ps tasks to checkpoint", clients.len())))?;
        let calls: Vec<TaskCall<()>> = (0..clients.len())
            .map(|k| -> TaskCall<()> {
                let clients = clients.clone();
                Box::new(move || clients[k].checkpoint_of_job(step, tasks).map(drop).map_err(Error::from))
            })
            .collect();
        self.threads.run("checkpoint", calls).into_iter().collect()
    }

    fn end_step(&self, replica: usize, failed: bool) -> Result<()> {
        if replica != 0 {
            return Ok(());
        }
        let lease = self.lease();
        let pushed = if failed {
            lock(&self.step).tables.clear();
            Ok(())
        } else if self.push_at_end {
            self.push(lease)
        } else {
            Ok(())
        };
        self.next_step();
        pushed
    }
}

#[cfg(test)]
mod tests {
    use super::StepTable;

    #[test]
    fn a_step_s_row_gradients_are_summed_per_id_in_id_order() {
        let mut t = StepTable::default();
        // The usual case: one lookup's distinct ids, ascending, taken as they come.
        t.add(&[2, 5, 9], vec![1.0, 1.5, 2.0, 2.5, 3.0, 3.5], 2);
        assert_eq!(
            (t.ids.as_slice(), t.values.as_slice()),
            ([2, 5, 9].as_slice(), [1.0, 1.5, 2.0, 2.5, 3.0, 3.5].as_slice())
        );
        // A second lookup, unordered and with a repeated id: merged in id order, the rows
        // already held first, then the new ones in the order they came.
        t.add(&[9, 1, 5, 9], vec![10.0, 0.0, 20.0, 0.0, 30.0, 0.0, 0.25, 0.5], 2);
        assert_eq!(t.ids, [1, 2, 5, 9]);
        assert_eq!(t.values, [20.0, 0.0, 1.0, 1.5, 32.0, 2.5, 13.25, 4.0]);
        // Into an empty table, ids out of order.
        let mut u = StepTable::default();
        u.add(&[7, 3, 7], vec![1.0, 2.0, 3.0], 1);
        assert_eq!((u.ids.as_slice(), u.values.as_slice()), ([3, 7].as_slice(), [2.0, 4.0].as_slice()));
    }
}

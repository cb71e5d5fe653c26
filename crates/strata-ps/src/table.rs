//! Embedding tables on a ps task: one table's shard, its rows created when first pulled, the
//! leases under which workers pulled rows (and may push their gradients), eviction of rows
//! unseen for long, snapshots of the rows, and resharding them.
//!
//! A shard keeps its rows in one slab: row `r` is `ids[r]`, its values `values.row(r)`, its
//! optimizer slots `slots.row(r)` (`k` slots of `dim` each), when it was last seen and how
//! many leases pin it; values and slots lie in blocks of rows ([`Slab`]), so the slab grows
//! without moving a row. An evicted row's place takes the slab's last row, so the slab stays
//! dense; snapshots list rows by ascending id, whatever the slab's order.

use std::collections::{BTreeMap, VecDeque};
use std::collections::{HashMap, HashSet};

use strata_core::embedding::{init_row, owner_of, TableSize};

use crate::limits::{
    MAX_IDS_PER_REQUEST, MAX_LEASED_IDS, MAX_LEASES_PER_WORKER, MAX_ROW_VALUES_PER_REQUEST, MAX_TABLE_BYTES,
    MAX_WORKERS,
};
use crate::slab::Slab;
use crate::{Error, Result, RowGrads, RowOptimizer, TableInfo, TableStatus};

/// One table shard's rows, as a [`Snapshot`](crate::Snapshot) and a checkpoint hold them:
/// the rows created (and not evicted), by ascending id. A row not listed has its initial value.
#[derive(Clone, Debug, PartialEq)]
pub struct TableRows {
    /// The table's shard.
    pub info: TableInfo,
    /// The rows evicted from the shard so far (a count; evicted rows are not held).
    pub evicted: u64,
    /// The rows' ids, ascending.
    pub ids: Vec<u64>,
    /// Their values, `dim` per row, in the order of `ids`.
    pub values: Vec<f32>,
    /// Their optimizer slots: per row, the optimizer's [`slots`](RowOptimizer::slots) blocks
    /// of `dim` values one after the other, rows in the order of `ids`.
    pub slots: Vec<f32>,
    /// The task's version when each row was last pulled or pushed.
    pub last_seen: Vec<u64>,
}

/// The ids a worker pulled under one lease, sorted; they are pinned against eviction while
/// the lease lives (and, in sync mode, while the push that used it waits for its round).
#[derive(Debug)]
pub(crate) struct Lease {
    number: u64,
    ids: Vec<u64>,
    /// Each id's row (slab index) when it was pulled: where a push finds it without hashing,
    /// checked against the row's id (an eviction moves the last row into the evicted one's).
    rows: Vec<usize>,
}

/// One embedding table's shard on a task.
pub(crate) struct Table {
    pub(crate) info: TableInfo,
    ids: Vec<u64>,
    values: Slab<f32>,
    slots: Slab<f32>,
    last_seen: Vec<u64>,
    /// Per row, how many leases (live or held by a pending sync push) hold it.
    pins: Vec<u32>,
    /// Row ids to slab indices, hashed with foldhash (seeded per process: fast on u64 keys,
    /// and ids a client chooses cannot be made to collide without knowing the seed).
    index: RowIndex,
    evicted: u64,
    /// Per worker, its leases, oldest first.
    leases: BTreeMap<String, VecDeque<Lease>>,
    /// The ids in `leases`, all workers together.
    leased: usize,
}

/// A table's index of its rows.
type RowIndex = HashMap<u64, usize, foldhash::fast::RandomState>;

/// An empty vector with room for `n` elements, or the task's refusal when there is no memory.
pub(crate) fn try_with_capacity<T>(task: &str, n: usize, what: &'static str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::OutOfMemory {
        task: task.into(),
        bytes: n.saturating_mul(std::mem::size_of::<T>()),
        what,
    })?;
    Ok(v)
}

/// Adds one push's rows to a sync round's sums, as the dense round sums: the first gradient
/// of a row is `g + 0`, later ones are added in the order given (the round's update order).
pub(crate) fn sum_rows(sums: &mut BTreeMap<u64, Vec<f32>>, ids: &[u64], grads: &[f32], dim: usize) {
    for (&id, g) in ids.iter().zip(grads.chunks_exact(dim.max(1))) {
        match sums.get_mut(&id) {
            Some(sum) => {
                for (s, g) in sum.iter_mut().zip(g) {
                    *s += g;
                }
            }
            None => {
                sums.insert(id, g.iter().map(|g| g + 0.0).collect());
            }
        }
    }
}

/// What a validated pull changes.
struct PullPlan {
    /// The worker's leases the pull drops: the one it replaces, or its oldest.
    drop: Option<usize>,
    /// The rows to evict, by slab index.
    evict: Vec<usize>,
    /// The ids to create, in the pull's order.
    create: Vec<u64>,
    /// Each id's row as the plan found it (`None`: to create), in the pull's order: valid
    /// while no row is evicted.
    found: Vec<Option<usize>>,
    /// The pull's ids, sorted (the new lease).
    sorted: Vec<u64>,
}

impl Table {
    /// An empty shard of the table `info` describes.
    pub(crate) fn new(info: TableInfo) -> Self {
        let (dim, sw) = (info.config.dim, info.optimizer.slots() * info.config.dim);
        Self {
            info,
            ids: Vec::new(),
            values: Slab::new(dim),
            slots: Slab::new(sw),
            last_seen: Vec::new(),
            pins: Vec::new(),
            index: RowIndex::default(),
            evicted: 0,
            leases: BTreeMap::new(),
            leased: 0,
        }
    }

    /// A shard holding `rows` (from a snapshot), with no leases.
    pub(crate) fn from_rows(rows: TableRows) -> Self {
        let TableRows { info, evicted, ids, values, slots, last_seen } = rows;
        let (dim, sw) = (info.config.dim, info.optimizer.slots() * info.config.dim);
        let (values, slots) = (Slab::from_slice(dim, ids.len(), &values), Slab::from_slice(sw, ids.len(), &slots));
        let index = ids.iter().enumerate().map(|(r, &id)| (id, r)).collect();
        let pins = vec![0; ids.len()];
        Self { info, ids, values, slots, last_seen, pins, index, evicted, leases: BTreeMap::new(), leased: 0 }
    }

    /// The table's name.
    pub(crate) fn name(&self) -> &str {
        &self.info.config.name
    }

    fn dim(&self) -> usize {
        self.info.config.dim
    }

    /// The f32 slot values per row.
    fn slot_width(&self) -> usize {
        self.info.optimizer.slots() * self.dim()
    }

    /// The bytes of one row: its values and slots.
    pub(crate) fn row_bytes(&self) -> u64 {
        (self.dim() + self.slot_width()) as u64 * 4
    }

    /// The bytes of the rows present.
    pub(crate) fn bytes(&self) -> u64 {
        self.ids.len() as u64 * self.row_bytes()
    }

    /// The shard's counts.
    pub(crate) fn status(&self) -> TableStatus {
        TableStatus { info: self.info.clone(), rows: self.ids.len() as u64, evicted: self.evicted, bytes: self.bytes() }
    }

    /// The rows present, by ascending id.
    pub(crate) fn rows(&self) -> TableRows {
        let mut order: Vec<usize> = (0..self.ids.len()).collect();
        order.sort_unstable_by_key(|&r| self.ids[r]);
        let (dim, sw) = (self.dim(), self.slot_width());
        let mut rows = TableRows {
            info: self.info.clone(),
            evicted: self.evicted,
            ids: Vec::with_capacity(order.len()),
            values: Vec::with_capacity(order.len() * dim),
            slots: Vec::with_capacity(order.len() * sw),
            last_seen: Vec::with_capacity(order.len()),
        };
        for r in order {
            rows.ids.push(self.ids[r]);
            rows.values.extend_from_slice(self.values.row(r));
            rows.slots.extend_from_slice(self.slots.row(r));
            rows.last_seen.push(self.last_seen[r]);
        }
        rows
    }

    /// Refuses more ids (or values) than one request may carry.
    fn check_count(&self, ids: usize) -> Result<()> {
        if ids > MAX_IDS_PER_REQUEST || ids.saturating_mul(self.dim()) > MAX_ROW_VALUES_PER_REQUEST {
            return Err(Error::TooManyIds { table: self.name().into(), ids, dim: self.dim() });
        }
        Ok(())
    }

    /// Refuses `ids` if one appears twice (no copy where they come ascending, as a worker
    /// sends them).
    fn check_distinct(&self, task: &str, ids: &[u64]) -> Result<()> {
        if ids.windows(2).all(|w| w[0] < w[1]) {
            return Ok(());
        }
        self.sorted_distinct(task, ids).map(drop)
    }

    /// The row of `id`, held at `hint` when it was leased unless an eviction moved it since.
    fn row_at(&self, id: u64, hint: usize) -> Option<usize> {
        if self.ids.get(hint) == Some(&id) {
            return Some(hint);
        }
        self.index.get(&id).copied()
    }

    /// `ids` sorted, refused if one appears twice.
    fn sorted_distinct(&self, task: &str, ids: &[u64]) -> Result<Vec<u64>> {
        let mut sorted = try_with_capacity(task, ids.len(), "a request's row ids")?;
        sorted.extend_from_slice(ids);
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::DuplicateRowId { table: self.name().into(), id: w[0] });
        }
        Ok(sorted)
    }

    /// Refuses an id outside a fixed table's rows or owned by another shard.
    fn check_owned(&self, ids: &[u64]) -> Result<()> {
        let (size, shard, num_shards) = (self.info.config.size, self.info.shard, self.info.num_shards);
        for &id in ids {
            if let TableSize::Rows(rows) = size {
                if id >= rows {
                    return Err(Error::RowIdOutOfRange { table: self.name().into(), id, rows });
                }
            }
            let owner = owner_of(size, id, num_shards as usize);
            if owner != shard as usize {
                return Err(Error::RowIdNotOwned { table: self.name().into(), id, owner, shard, num_shards });
            }
        }
        Ok(())
    }

    /// `PullRows` on this shard: validates everything, then drops the lease the pull replaces
    /// (or the worker's oldest, when it holds the most), evicts what room needs, creates the
    /// rows not present from their initial values, marks the pulled rows seen at `version`,
    /// records the lease and returns the rows' values. `other_bytes` is what the task's other
    /// tables hold. On an error nothing changed.
    pub(crate) fn pull(
        &mut self,
        task: &str,
        worker: &str,
        lease: u64,
        ids: &[u64],
        version: u64,
        other_bytes: u64,
    ) -> Result<Vec<f32>> {
        let plan = self.plan_pull(task, worker, lease, ids, version, other_bytes)?;
        let dim = self.dim();
        let mut out = try_with_capacity(task, ids.len() * dim, "pulled rows")?;
        let mut rows = try_with_capacity(task, ids.len(), "a lease's rows")?;
        let n = plan.create.len();
        let reserved = self.ids.try_reserve(n).is_ok()
            && self.values.try_reserve(n).is_ok()
            && self.slots.try_reserve(n).is_ok()
            && self.last_seen.try_reserve(n).is_ok()
            && self.pins.try_reserve(n).is_ok()
            && self.index.try_reserve(n).is_ok();
        if !reserved {
            let bytes = usize::try_from(n as u64 * (self.row_bytes() + 32)).unwrap_or(usize::MAX);
            return Err(Error::OutOfMemory { task: task.into(), bytes, what: "new table rows" });
        }
        // Everything is checked and reserved: change the shard.
        if let Some(k) = plan.drop {
            if let Some(old) = self.leases.get_mut(worker).and_then(|ls| ls.remove(k)) {
                self.leased -= old.ids.len();
                self.unpin(&old);
            }
        }
        let mut evict = plan.evict;
        evict.sort_unstable_by(|a, b| b.cmp(a));
        let moved = !evict.is_empty();
        for r in evict {
            self.evict(r);
        }
        for id in plan.create {
            self.create(id, version);
        }
        for (id, found) in ids.iter().zip(plan.found) {
            // One probe of the index a row: the plan's, unless an eviction moved rows.
            let r = match found {
                Some(r) if !moved => r,
                _ => self.index[id],
            };
            self.last_seen[r] = version;
            self.pins[r] += 1;
            out.extend_from_slice(self.values.row(r));
            rows.push(r);
        }
        if plan.sorted != ids {
            // The lease's rows in the order of its sorted ids.
            rows.clear();
            rows.extend(plan.sorted.iter().map(|id| self.index[id]));
        }
        self.leased += plan.sorted.len();
        let held = Lease { number: lease, ids: plan.sorted, rows };
        self.leases.entry(worker.to_string()).or_default().push_back(held);
        Ok(out)
    }

    /// Validates a pull and computes what it changes (nothing is changed).
    fn plan_pull(
        &self,
        task: &str,
        worker: &str,
        lease: u64,
        ids: &[u64],
        version: u64,
        other_bytes: u64,
    ) -> Result<PullPlan> {
        self.check_count(ids.len())?;
        let sorted = self.sorted_distinct(task, ids)?;
        self.check_owned(ids)?;
        let held = self.leases.get(worker);
        if held.is_none() && self.leases.len() >= MAX_WORKERS as usize {
            return Err(Error::TooManyLeaseWorkers { table: self.name().into() });
        }
        let drop = held.and_then(|ls| {
            ls.iter().position(|l| l.number == lease).or((ls.len() >= MAX_LEASES_PER_WORKER).then_some(0))
        });
        let dropped = drop.and_then(|k| held.and_then(|ls| ls.get(k)));
        let leased = self.leased - dropped.map_or(0, |l| l.ids.len()) + sorted.len();
        if leased > MAX_LEASED_IDS {
            return Err(Error::TooManyLeasedIds { table: self.name().into(), ids: leased });
        }
        let mut found = try_with_capacity(task, ids.len(), "a pull's rows")?;
        found.extend(ids.iter().map(|id| self.index.get(id).copied()));
        let mut create = try_with_capacity(task, ids.len(), "a pull's new row ids")?;
        create.extend(ids.iter().zip(&found).filter(|(_, f)| f.is_none()).map(|(&id, _)| id));
        let evict = self.plan_eviction(task, create.len(), &sorted, dropped, version)?;
        let rows = (self.ids.len() - evict.len() + create.len()) as u64;
        let bytes = other_bytes.saturating_add(rows.saturating_mul(self.row_bytes()));
        if bytes > MAX_TABLE_BYTES {
            return Err(Error::TableBytes { task: task.into(), table: self.name().into(), bytes });
        }
        Ok(PullPlan { drop, evict, create, found, sorted })
    }

    /// The rows to evict so that `new` more fit an id-space table's bound: rows unseen for
    /// more than `evict_after` updates (`version - last_seen > evict_after`), pinned by no
    /// lease but `dropped` and not pulled now (`pulled`, sorted), least recently seen first
    /// (then by id). Refused with [`Error::TableFull`] when there are not enough.
    fn plan_eviction(
        &self,
        task: &str,
        new: usize,
        pulled: &[u64],
        dropped: Option<&Lease>,
        version: u64,
    ) -> Result<Vec<usize>> {
        let TableSize::Ids { max_rows_per_shard: bound, evict_after } = self.info.config.size else {
            return Ok(Vec::new());
        };
        let total = (self.ids.len() + new) as u64;
        let need = total.saturating_sub(bound) as usize;
        if need == 0 {
            return Ok(Vec::new());
        }
        let full =
            |evictable: usize| Error::TableFull { table: self.name().into(), bound, rows: total - evictable as u64 };
        let Some(after) = evict_after else { return Err(full(0)) };
        // Pins the dropped lease releases.
        let released: HashSet<usize> =
            dropped.map(|l| l.ids.iter().filter_map(|id| self.index.get(id).copied()).collect()).unwrap_or_default();
        let mut candidates: Vec<(u64, u64, usize)> = try_with_capacity(task, self.ids.len(), "eviction candidates")?;
        for (r, (&id, &seen)) in self.ids.iter().zip(&self.last_seen).enumerate() {
            let pins = self.pins[r].saturating_sub(u32::from(released.contains(&r)));
            if version.saturating_sub(seen) > after && pins == 0 && pulled.binary_search(&id).is_err() {
                candidates.push((seen, id, r));
            }
        }
        if candidates.len() < need {
            return Err(full(candidates.len()));
        }
        if need < candidates.len() {
            candidates.select_nth_unstable(need);
        }
        Ok(candidates[..need].iter().map(|&(_, _, r)| r).collect())
    }

    fn evict(&mut self, r: usize) {
        self.index.remove(&self.ids[r]);
        self.values.swap_remove(r);
        self.slots.swap_remove(r);
        self.ids.swap_remove(r);
        self.last_seen.swap_remove(r);
        self.pins.swap_remove(r);
        if let Some(&moved) = self.ids.get(r) {
            self.index.insert(moved, r);
        }
        self.evicted += 1;
    }

    /// Creates row `id` at its initial value (memory reserved).
    fn create(&mut self, id: u64, version: u64) {
        let (config, seed) = (&self.info.config, self.info.seed);
        init_row(seed, &config.name, config.init, id, self.values.push());
        self.info.optimizer.init_slots(self.slots.push());
        self.index.insert(id, self.ids.len());
        self.ids.push(id);
        self.last_seen.push(version);
        self.pins.push(0);
        debug_assert_eq!((self.values.len(), self.slots.len()), (self.ids.len(), self.ids.len()));
    }

    fn unpin(&mut self, lease: &Lease) {
        for (&id, &hint) in lease.ids.iter().zip(&lease.rows) {
            if let Some(r) = self.row_at(id, hint) {
                self.pins[r] = self.pins[r].saturating_sub(1);
            }
        }
    }

    /// Removes `worker`'s lease `number` from the live leases without unpinning its rows (a
    /// sync push holds them until its round applies), if it is there.
    pub(crate) fn take_lease(&mut self, worker: &str, number: u64) -> Option<Lease> {
        let ls = self.leases.get_mut(worker)?;
        let k = ls.iter().position(|l| l.number == number)?;
        let lease = ls.remove(k)?;
        if ls.is_empty() {
            self.leases.remove(worker);
        }
        self.leased -= lease.ids.len();
        Some(lease)
    }

    /// Releases a lease taken with [`Table::take_lease`]: its rows are no longer pinned by it.
    pub(crate) fn release(&mut self, lease: Lease) {
        self.unpin(&lease);
    }

    /// Validates the rows of a push from `worker`: the count, the gradients' width, distinct
    /// ids, each pulled under the push's lease, finite gradients. Returns the rows' slab
    /// indices.
    pub(crate) fn check_push(&self, task: &str, worker: &str, rg: &RowGrads) -> Result<Vec<usize>> {
        let (n, dim) = (rg.ids.len(), self.dim());
        self.check_count(n)?;
        if rg.grads.len() != n * dim {
            return Err(Error::RowWidth { table: self.name().into(), dim, ids: n, grads: rg.grads.len() });
        }
        self.check_distinct(task, &rg.ids)?;
        let lease = self.leases.get(worker).and_then(|ls| ls.iter().find(|l| l.number == rg.lease));
        let mut rows = try_with_capacity(task, n, "a push's rows")?;
        for &id in &rg.ids {
            let r = lease.and_then(|l| l.ids.binary_search(&id).ok().and_then(|j| self.row_at(id, l.rows[j])));
            let Some(r) = r else {
                return Err(Error::NotLeased { table: self.name().into(), id, lease: rg.lease });
            };
            rows.push(r);
        }
        for (&id, g) in rg.ids.iter().zip(rg.grads.chunks_exact(dim)) {
            if let Some((element, &value)) = g.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(Error::NonFiniteRowGradient { table: self.name().into(), id, element, value });
            }
        }
        Ok(rows)
    }

    /// Validates an update of the rows `ids` held by the shard (no lease: a process's own
    /// shard, [`TableShard`](crate::TableShard)): the count, the gradients' width, distinct
    /// ids, each held, finite gradients. Returns the rows' slab indices.
    pub(crate) fn check_update(&self, task: &str, ids: &[u64], grads: &[f32]) -> Result<Vec<usize>> {
        let (n, dim) = (ids.len(), self.dim());
        self.check_count(n)?;
        if grads.len() != n * dim {
            return Err(Error::RowWidth { table: self.name().into(), dim, ids: n, grads: grads.len() });
        }
        self.sorted_distinct(task, ids)?;
        let mut rows = try_with_capacity(task, n, "an update's rows")?;
        for &id in ids {
            let Some(&r) = self.index.get(&id) else {
                return Err(Error::RowNotRead { table: self.name().into(), id });
            };
            rows.push(r);
        }
        for (&id, g) in ids.iter().zip(grads.chunks_exact(dim)) {
            if let Some((element, &value)) = g.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(Error::NonFiniteRowGradient { table: self.name().into(), id, element, value });
            }
        }
        Ok(rows)
    }

    /// The values of row `id`, if the shard holds it.
    pub(crate) fn row_values(&self, id: u64) -> Option<&[f32]> {
        self.index.get(&id).map(|&r| self.values.row(r))
    }

    /// Steps rows `rows` (slab indices) by their gradients `grads` (`dim` each) with `opt` at
    /// update number `t`, and marks them seen at `version`.
    pub(crate) fn apply(&mut self, opt: &RowOptimizer, rows: &[usize], grads: &[f32], t: u64, version: u64) {
        for (&r, g) in rows.iter().zip(grads.chunks_exact(self.dim())) {
            opt.apply(self.values.row_mut(r), g, self.slots.row_mut(r), t);
            self.last_seen[r] = version;
        }
    }

    /// Steps each row of `sums` (a sync round's sums, by id) by its sum times `scale` (the
    /// round's mean), at update number `t`, and marks them seen at `version`. Rows a pending
    /// push holds are pinned, so all are present.
    pub(crate) fn apply_mean(
        &mut self,
        opt: &RowOptimizer,
        sums: BTreeMap<u64, Vec<f32>>,
        scale: f32,
        t: u64,
        version: u64,
    ) {
        for (id, mut mean) in sums {
            for m in &mut mean {
                *m *= scale;
            }
            if let Some(&r) = self.index.get(&id) {
                self.apply(opt, &[r], &mean, t, version);
            }
        }
    }
}

/// The rows new shard `shard` of `num_shards` owns, from the table rows of every old shard
/// (each item: one old task's tables, as its snapshot holds them, e.g. read one file at a
/// time). Every old shard of a table must be given once, all describing the same table;
/// the rows are taken bit for bit (values, slots, last seen), by ascending id, with the
/// shard's description renumbered and the eviction count at 0. A row no old shard held has
/// its initial value, which depends on the seed, the table and the id only, so it is the same
/// on the new shard. The rows kept may not exceed what a task holds ([`MAX_TABLE_BYTES`],
/// [`Error::ReshardTooLarge`]), checked as they are taken.
pub fn reshard_tables<I>(old: I, shard: u32, num_shards: u32) -> Result<Vec<TableRows>>
where
    I: IntoIterator<Item = Result<Vec<TableRows>>>,
{
    // Per table: the rows kept so far and which old shards were seen.
    let mut tables: BTreeMap<String, (TableRows, Vec<bool>)> = BTreeMap::new();
    let mut bytes = 0u64;
    for tables_of_task in old {
        for t in tables_of_task? {
            let name = t.info.config.name.clone();
            let (acc, seen) = tables.entry(name.clone()).or_insert_with(|| {
                let info = TableInfo { shard, num_shards, ..t.info.clone() };
                let empty =
                    TableRows { info, evicted: 0, ids: vec![], values: vec![], slots: vec![], last_seen: vec![] };
                (empty, vec![false; t.info.num_shards as usize])
            });
            let mismatch = |field| Err(Error::ReshardMismatch { table: name.clone(), field });
            if t.info.config != acc.info.config {
                return mismatch("config");
            }
            if t.info.seed != acc.info.seed {
                return mismatch("seed");
            }
            if t.info.optimizer != acc.info.optimizer {
                return mismatch("optimizer");
            }
            if t.info.num_shards as usize != seen.len() || t.info.shard >= t.info.num_shards {
                return mismatch("num_shards");
            }
            let old_shard = t.info.shard;
            if std::mem::replace(&mut seen[old_shard as usize], true) {
                let problem = "given twice";
                return Err(Error::ReshardShards {
                    table: name,
                    shard: old_shard,
                    num_shards: t.info.num_shards,
                    problem,
                });
            }
            let (dim, sw) = (t.info.config.dim, t.info.optimizer.slots() * t.info.config.dim);
            let n = t.ids.len();
            if t.values.len() != n * dim || t.slots.len() != n * sw || t.last_seen.len() != n {
                return mismatch("rows");
            }
            for (k, &id) in t.ids.iter().enumerate() {
                if owner_of(t.info.config.size, id, num_shards as usize) == shard as usize {
                    bytes += (dim + sw) as u64 * 4;
                    if bytes > MAX_TABLE_BYTES {
                        return Err(Error::ReshardTooLarge { shard, num_shards, bytes });
                    }
                    acc.ids.push(id);
                    acc.values.extend_from_slice(&t.values[k * dim..(k + 1) * dim]);
                    acc.slots.extend_from_slice(&t.slots[k * sw..(k + 1) * sw]);
                    acc.last_seen.push(t.last_seen[k]);
                }
            }
        }
    }
    let mut out = Vec::with_capacity(tables.len());
    for (name, (acc, seen)) in tables {
        if let Some(missing) = seen.iter().position(|s| !s) {
            let num_shards = seen.len() as u32;
            return Err(Error::ReshardShards { table: name, shard: missing as u32, num_shards, problem: "missing" });
        }
        acc.info.validate()?;
        out.push(sorted_by_id(acc));
    }
    Ok(out)
}

/// `rows` with its rows by ascending id.
fn sorted_by_id(rows: TableRows) -> TableRows {
    Table::from_rows(rows).rows()
}

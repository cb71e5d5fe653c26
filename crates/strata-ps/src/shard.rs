//! One embedding table's shard held by a process of its own, outside any ps task: what an
//! in-process table store (the in-process strategies' `LocalTables`) keeps its tables in, with
//! a ps task's semantics for rows: created from their initial values when first read, evicted
//! by the same rule when an id-space shard is at its bound, stepped by the shard's
//! [`RowOptimizer`] on the rows an update touches only (their slots included).
//!
//! There is one reader, the process itself, so there are no workers and no exactly-once
//! bookkeeping: the reads of an update (a step) are recorded under one lease, the update's
//! number, which pins their rows as a pull's lease does on a task, and applying the update
//! releases it.

use crate::table::{Table, TableRows};
use crate::{Error, Result, RowOptimizer, TableInfo, TableStatus};

/// The lease holder of a shard's reads: the process itself.
const READER: &str = "local";

/// The name errors give the shard's holder (a task's name on a ps task).
const HOLDER: &str = "this process";

/// One table's shard in this process's memory: its rows created from their initial values
/// when first read, evicted by a ps task's rule when an id-space shard is at its bound, and
/// stepped by the shard's [`RowOptimizer`] on the rows an update touches only (their slots
/// included). The reads of an update are recorded under one lease, which pins their rows until
/// the update is applied or released; there are no workers and no exactly-once bookkeeping.
pub struct TableShard {
    table: Table,
}

impl std::fmt::Debug for TableShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableShard").field("info", &self.table.info).field("status", &self.table.status()).finish()
    }
}

impl TableShard {
    /// An empty shard of the table `info` describes, checked as a task checks a table it is
    /// asked to create.
    pub fn new(info: TableInfo) -> Result<Self> {
        info.validate()?;
        Ok(Self { table: Table::new(info) })
    }

    /// A shard holding `rows` (a checkpoint's, or [`TableShard::rows`]'), checked.
    pub fn from_rows(rows: TableRows) -> Result<Self> {
        rows.info.validate()?;
        let (dim, sw) = (rows.info.config.dim, rows.info.optimizer.slots() * rows.info.config.dim);
        let n = rows.ids.len();
        if rows.values.len() != n * dim || rows.slots.len() != n * sw || rows.last_seen.len() != n {
            return Err(Error::ReshardMismatch { table: rows.info.config.name.clone(), field: "rows" });
        }
        Ok(Self { table: Table::from_rows(rows) })
    }

    /// The shard's description.
    pub fn info(&self) -> &TableInfo {
        &self.table.info
    }

    /// The shard's counts: rows held, rows evicted, bytes.
    pub fn status(&self) -> TableStatus {
        self.table.status()
    }

    /// The rows held, by ascending id (values, slots, when last seen).
    pub fn rows(&self) -> TableRows {
        self.table.rows()
    }

    /// The values of row `id`, if the shard holds it (a row not held has its initial value).
    pub fn row(&self, id: u64) -> Option<&[f32]> {
        self.table.row_values(id)
    }

    /// The values of `ids` (distinct, each owned by this shard) for the update that follows
    /// `version` (the updates applied so far): rows not held are created from their initial
    /// values (evicting, in an id-space shard at its bound, rows unseen for more than
    /// `evict_after` updates), and every row read is marked seen at `version` and pinned until
    /// the update is applied ([`TableShard::apply`]) or dropped ([`TableShard::release`]).
    /// Every read of one update is recorded under one lease, so a row read twice in an update
    /// is pinned once. Validated first: on an error nothing changed.
    pub fn read(&mut self, ids: &[u64], version: u64) -> Result<Vec<f32>> {
        self.table.pull(HOLDER, READER, version, ids, version, 0)
    }

    /// Checks an update of the rows `ids` (distinct) by `grads` (`dim` each): every row held,
    /// every gradient finite; what [`TableShard::apply`] checks before it changes anything.
    pub fn check(&self, ids: &[u64], grads: &[f32]) -> Result<()> {
        self.table.check_update(HOLDER, ids, grads).map(drop)
    }

    /// Applies the update that follows `version`: steps the rows `ids` (distinct, read for it)
    /// by `grads` (`dim` each) with `optimizer` at update number `version + 1`, marks them
    /// seen at `version + 1`, and releases the update's reads, as a ps task applies a push
    /// pulled at `version`. Checked first ([`TableShard::check`]): on an error nothing
    /// changed.
    pub fn apply(&mut self, optimizer: &RowOptimizer, ids: &[u64], grads: &[f32], version: u64) -> Result<()> {
        let rows = self.table.check_update(HOLDER, ids, grads)?;
        self.table.apply(optimizer, &rows, grads, version + 1, version + 1);
        self.release(version);
        Ok(())
    }

    /// Releases the reads of the update that follows `version` (one that applies nothing to
    /// this shard, or was dropped): their rows are no longer pinned by it.
    pub fn release(&mut self, version: u64) {
        if let Some(lease) = self.table.take_lease(READER, version) {
            self.table.release(lease);
        }
    }
}

#[cfg(test)]
mod tests {
    use strata_core::embedding::{init_row, RowInit, TableConfig, TableSize};

    use super::*;

    fn shard(size: TableSize) -> TableShard {
        let config =
            TableConfig { size, init: RowInit::Uniform { low: -1.0, high: 1.0 }, ..TableConfig::rows("t", 1, 2) };
        let optimizer = RowOptimizer::Adagrad { lr: 0.5, initial_accumulator: 0.1, eps: 1e-7 };
        TableShard::new(TableInfo { config, seed: 3, shard: 0, num_shards: 1, optimizer }).unwrap()
    }

    fn init(id: u64) -> Vec<f32> {
        let mut r = vec![0f32; 2];
        init_row(3, "t", RowInit::Uniform { low: -1.0, high: 1.0 }, id, &mut r);
        r
    }

    /// Reads create rows at their initial values; an update steps only its rows, with the
    /// shard's optimizer at update number `version + 1`; a refused update changes nothing.
    #[test]
    fn reads_create_rows_and_updates_step_only_theirs() {
        let mut s = shard(TableSize::Rows(10));
        assert_eq!(s.read(&[4, 7], 0).unwrap(), [init(4), init(7)].concat());
        let before = s.rows();
        // Row 9 was not read; a NaN gradient: both refused, nothing changed.
        let e = s.apply(&s.info().optimizer.clone(), &[4, 9], &[1.0; 4], 0).unwrap_err();
        assert!(matches!(e, Error::RowNotRead { id: 9, .. }), "{e}");
        let e = s.apply(&s.info().optimizer.clone(), &[4], &[1.0, f32::NAN], 0).unwrap_err();
        assert!(matches!(e, Error::NonFiniteRowGradient { id: 4, element: 1, .. }), "{e}");
        assert_eq!(s.rows(), before);
        let opt = s.info().optimizer.clone();
        s.apply(&opt, &[7], &[0.5, -2.0], 0).unwrap();
        let (mut w, mut slots) = (init(7), vec![0.1f32; 2]);
        opt.apply(&mut w, &[0.5, -2.0], &mut slots, 1);
        let rows = s.rows();
        assert_eq!((rows.ids.clone(), rows.last_seen.clone()), (vec![4, 7], vec![0, 1]));
        assert_eq!(rows.values, [init(4), w].concat(), "row 4 untouched, row 7 stepped");
        assert_eq!(rows.slots, [vec![0.1f32; 2], slots].concat(), "row 4's slots untouched");
        assert_eq!(TableShard::from_rows(rows.clone()).unwrap().rows(), rows);
        assert!(s.read(&[10], 1).is_err(), "outside the fixed table");
    }

    /// A bounded id-space shard evicts rows unseen for more than `evict_after` updates once
    /// their update released them, and refuses a read when none may go.
    #[test]
    fn a_bounded_shard_evicts_released_rows_only() {
        let mut s = shard(TableSize::Ids { max_rows_per_shard: 2, evict_after: Some(1) });
        let opt = s.info().optimizer.clone();
        s.read(&[1, 2], 0).unwrap();
        s.apply(&opt, &[1, 2], &[1.0; 4], 0).unwrap();
        // Seen at 1: at version 2 they are 1 update old, not more.
        let e = s.read(&[3], 2).unwrap_err();
        assert!(matches!(e, Error::TableFull { bound: 2, rows: 3, .. }), "{e}");
        s.read(&[3], 3).unwrap();
        assert_eq!((s.status().rows, s.status().evicted), (2, 1));
        assert_eq!(s.rows().ids, vec![2, 3], "the least recently seen, then the lowest id, went");
    }
}

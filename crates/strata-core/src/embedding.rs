//! Embedding tables: what a table is ([`TableConfig`]), how its rows start ([`RowInit`],
//! [`init_row`]) and which shard owns a row ([`owner_of`]), as every strategy and every
//! parameter-server task computes them. A row's initial value depends only on the seed, the
//! table's name and the row's id, never on the order rows are created in or on how the table is
//! sharded, so a table trained on one device, on replicas, or grown row by row on ps tasks
//! starts from the same values, and a restarted ps task recreates a row exactly.
//!
//! A strategy that does not keep a table as a variable (parameter servers, hybrid training)
//! gives its scope a [`TableStore`]: the rows a step's batch touches are pulled from it, and
//! their gradients handed back to it after the backward pass.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The largest embedding dimension a table may have.
pub const MAX_EMBEDDING_DIM: usize = 1 << 16;

/// How many rows a table has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TableSize {
    /// A fixed table of `rows` rows: ids are `0..rows`; any other id is an error.
    Rows(u64),
    /// A table declared by id space: any `u64` is an id, and a row exists once it is first
    /// seen (created from the table's [`RowInit`]). Each shard holds at most
    /// `max_rows_per_shard` rows; with `evict_after`, a row unseen for that many updates of its
    /// shard may be evicted to make room (and is created again, from its initial value, when
    /// next seen).
    Ids {
        /// The bound on rows per shard (a ps task).
        max_rows_per_shard: u64,
        /// Updates of the shard after which an unseen row may be evicted (`None`: never).
        evict_after: Option<u64>,
    },
}

/// The initial value of a table's rows.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum RowInit {
    /// Every element 0.
    Zeros,
    /// Uniform in `[low, high)`.
    Uniform {
        /// The lower bound.
        low: f32,
        /// The upper bound.
        high: f32,
    },
    /// Normal with mean 0 and standard deviation `std`.
    Normal {
        /// The standard deviation.
        std: f32,
    },
}

impl Default for RowInit {
    /// Keras' `Embedding` default: uniform in `[-0.05, 0.05)`.
    fn default() -> Self {
        RowInit::Uniform { low: -0.05, high: 0.05 }
    }
}

/// An embedding table: its name (the variable's), its row width and its size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TableConfig {
    /// The table's name, as a variable's (`ctr.emb3`).
    pub name: String,
    /// The embedding dimension (elements per row), `1..=MAX_EMBEDDING_DIM`.
    pub dim: usize,
    /// Fixed rows, or an id space whose rows appear when first seen.
    pub size: TableSize,
    /// How rows start.
    pub init: RowInit,
}

impl TableConfig {
    /// A fixed table of `rows` rows of `dim` elements, initialised as Keras' `Embedding`.
    pub fn rows(name: impl Into<String>, rows: u64, dim: usize) -> Self {
        Self { name: name.into(), dim, size: TableSize::Rows(rows), init: RowInit::default() }
    }

    /// Checks the configuration: a name, `1 <= dim <= MAX_EMBEDDING_DIM`, at least one row (or
    /// a positive bound per shard), a finite initialiser with `low < high` and `std >= 0`.
    pub fn check(&self) -> Result<()> {
        let name = &self.name;
        let bad = |what: String| Err(Error::InvalidArgument(format!("embedding table {name:?}: {what}")));
        if name.is_empty() {
            return Err(Error::InvalidArgument("an embedding table needs a name".into()));
        }
        if self.dim == 0 || self.dim > MAX_EMBEDDING_DIM {
            return bad(format!("dimension {} is outside 1..={MAX_EMBEDDING_DIM}", self.dim));
        }
        match self.size {
            TableSize::Rows(0) => return bad("0 rows; give it at least one".into()),
            TableSize::Ids { max_rows_per_shard: 0, .. } => {
                return bad("a bound of 0 rows per shard; give it at least one".into())
            }
            TableSize::Ids { evict_after: Some(0), .. } => {
                return bad("evict_after is 0; give a positive number of updates, or none".into())
            }
            _ => {}
        }
        match self.init {
            RowInit::Uniform { low, high } if !(low.is_finite() && high.is_finite() && low < high) => {
                bad(format!("uniform initialiser [{low}, {high}) needs finite bounds with low < high"))
            }
            RowInit::Normal { std } if !(std.is_finite() && std >= 0.0) => {
                bad(format!("normal initialiser's std {std} must be finite and not negative"))
            }
            _ => Ok(()),
        }
    }

    /// Checks that `id` names a row of the table: below the row count of a fixed table (any
    /// id of an id-space table); [`Error::EmbeddingId`] otherwise, whatever the strategy.
    pub fn check_id(&self, id: u64) -> Result<()> {
        match self.size {
            TableSize::Rows(rows) if id >= rows => {
                Err(Error::EmbeddingId { table: self.name.clone(), id: i64::try_from(id).unwrap_or(i64::MAX), rows })
            }
            _ => Ok(()),
        }
    }

    /// [`Error::EmbeddingId`] for a negative id (an i64 id tensor's).
    pub fn negative_id(&self, id: i64) -> Error {
        let rows = match self.size {
            TableSize::Rows(rows) => rows,
            TableSize::Ids { .. } => 0,
        };
        Error::EmbeddingId { table: self.name.clone(), id, rows }
    }

    /// The refusal of ids of `dtype` (ids are u32 or i64).
    pub fn id_dtype(&self, dtype: impl std::fmt::Debug) -> Error {
        Error::InvalidArgument(format!(
            "embedding table {:?} takes u32 or i64 ids, not {dtype:?}; cast the ids to u32",
            self.name
        ))
    }

    /// The bytes of one row's values (f32).
    pub fn row_bytes(&self) -> usize {
        self.dim * 4
    }
}

/// SplitMix64's finaliser: a bijection of `u64` whose output bits all depend on every input bit.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A stable 64-bit hash (FNV-1a) of a table's name under `seed`.
fn table_seed(seed: u64, table: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in table.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A uniform draw in `[0, 1)` from 53 bits of `bits`.
fn unit(bits: u64) -> f64 {
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Writes row `id`'s initial value into `out` (`dim` elements): a function of `seed`, the
/// table's name, `id` and the element's index only (a counter-based generator), so any
/// process, in any order, on any sharding, computes the same row.
pub fn init_row(seed: u64, table: &str, init: RowInit, id: u64, out: &mut [f32]) {
    let base = mix64(table_seed(seed, table) ^ mix64(id));
    let draw = |j: u64| mix64(base.wrapping_add(j.wrapping_mul(0xd1b5_4a32_d192_ed03)));
    match init {
        RowInit::Zeros => out.fill(0.0),
        RowInit::Uniform { low, high } => {
            for (j, x) in out.iter_mut().enumerate() {
                let u = unit(draw(j as u64));
                *x = (f64::from(low) + (f64::from(high) - f64::from(low)) * u) as f32;
                // Rounding to f32 can reach `high`; keep the interval half-open.
                if *x >= high {
                    *x = low.max(high.next_down());
                }
            }
        }
        RowInit::Normal { std } => {
            for (j, x) in out.iter_mut().enumerate() {
                // Box-Muller on two independent draws.
                let u1 = unit(draw(2 * j as u64)).max(f64::MIN_POSITIVE);
                let u2 = unit(draw(2 * j as u64 + 1));
                *x = (f64::from(std) * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32;
            }
        }
    }
}

/// How many rows of a fixed table of `rows` rows shard `index` of `shards` holds: the ids `i`
/// with `i % shards == index` ([`owner_of`]), so the first `rows % shards` shards hold one row
/// more.
pub fn shard_len(rows: u64, shards: usize, index: usize) -> u64 {
    let n = shards.max(1) as u64;
    rows / n + u64::from((index as u64) < rows % n)
}

/// The shard (of `shards`) that owns row `id`: for a fixed table `id % shards` (TensorFlow's
/// `mod` partition strategy of `embedding_lookup`: neighbouring ids, which a field's popular
/// range is made of, go to different tasks, so the tasks share the work of a skewed table),
/// for an id-space table `mix64(id) % shards` (ids spread evenly whatever their pattern).
pub fn owner_of(size: TableSize, id: u64, shards: usize) -> usize {
    let n = shards.max(1) as u64;
    match size {
        TableSize::Rows(_) => (id % n) as usize,
        TableSize::Ids { .. } => (mix64(id) % n) as usize,
    }
}

/// The distinct ids of `ids`, sorted, and for each position of `ids` the index of its id among
/// them: what a step pulls (each row once) and how its batch reads the pulled rows.
pub fn distinct_ids(ids: &[u64]) -> (Vec<u64>, Vec<u32>) {
    let mut distinct = ids.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    let index = ids.iter().map(|id| distinct.partition_point(|d| d < id) as u32).collect();
    (distinct, index)
}

/// Where a strategy keeps embedding tables it does not hold as variables (ps tasks): a step
/// pulls the rows its batch touches, and the backward pass hands their gradients back.
/// [`StrategyOptions::tables`](crate::StrategyOptions::tables) gives a strategy one; the
/// embedding layer then asks it for rows instead of making the table a variable.
///
/// Gradients arrive per replica, as each replica's backward pass computes them, each with the
/// number of batch rows the replica's loss is the mean over: a store that combines replicas
/// weighs each by its rows (what `run_batch` does to the variables' gradients).
pub trait TableStore: Send + Sync + std::fmt::Debug {
    /// The strategy a model declaring a table is built under, told by the layer before each
    /// [`declare`](Self::declare) (once per copy of the model). A store that combines the
    /// replicas' gradients itself learns their number and the seed here; one that cannot
    /// serve the strategy refuses it ([`Error::TableStoreStrategy`]). Nothing by default.
    fn attach(&self, scope: &TableScope<'_>) -> Result<()> {
        let _ = scope;
        Ok(())
    }

    /// Declares a table a model builds (once per copy of the model, the same configuration
    /// every time; a different one is an error naming the table).
    fn declare(&self, table: &TableConfig) -> Result<()>;

    /// The current values of `ids` (distinct, sorted) of `table` for `replica`'s step:
    /// `ids.len() * dim` values, row after row.
    fn pull(&self, replica: usize, table: &str, ids: &[u64]) -> Result<Vec<f32>>;

    /// Pulls ahead the rows `ids` (distinct, sorted) of `table` that a lookup of `replica`'s
    /// coming step will ask for, so that the pull runs beside other work of the step (a
    /// parameter-server worker's pull of its dense variables): a [`pull`](Self::pull) of the
    /// same ids in the same step returns them, and one of other ids pulls as it would have.
    /// Nothing by default (a store whose rows are in this process).
    fn prefetch(&self, replica: usize, table: &str, ids: &[u64]) -> Result<()> {
        let _ = (replica, table, ids);
        Ok(())
    }

    /// Tells the store, during a step of `replica`, the rows `ids` (distinct, sorted) of
    /// `table` that a lookup of its next step will ask for (its records made ahead): a store
    /// that sends a step's rows with the next step's pull may send both as soon as this step's
    /// lookups have their gradients, beside the rest of the step. A lookup of other ids pulls
    /// as it would have. Nothing by default.
    fn expect_next(&self, replica: usize, table: &str, ids: &[u64]) -> Result<()> {
        let _ = (replica, table, ids);
        Ok(())
    }

    /// Adds the gradient `grad` (`ids.len() * dim`, row after row) of the rows `ids` that
    /// `replica` pulled, computed from a loss that is the mean over `batch_rows` rows.
    fn gradient(&self, replica: usize, table: &str, ids: &[u64], grad: Vec<f32>, batch_rows: usize) -> Result<()>;

    /// `replica`'s step ended (`failed`: with an error; its gradients are dropped): the store
    /// sends what the step's replicas gave it, if the strategy's optimizer did not (now, or
    /// with the next step's lookup, until [`flush`](Self::flush)). Every
    /// replica of a step ends it once, after its backward pass; a strategy with a store runs
    /// one step per execution ([`Strategy::run_batches`](crate::Strategy::run_batches)), so
    /// that each step ends here before the next one looks a row up.
    fn end_step(&self, replica: usize, failed: bool) -> Result<()>;

    /// Sends what ended steps gave the store and it still holds: a store may keep a step's
    /// rows until the next step's lookup, to send both in one call ([`end_step`](Self::end_step)
    /// then only records them). Called where every ended step must have reached the rows'
    /// holders: by every worker before a checkpoint of the tables
    /// ([`save_checkpoint`](crate::elastic::save_checkpoint)), and by a trainer after its last
    /// step. Nothing by default.
    fn flush(&self) -> Result<()> {
        Ok(())
    }

    /// The rows the store holds, as named tensors, for a checkpoint of the strategy's (the
    /// trainer's, [`save_checkpoint`](crate::elastic::save_checkpoint), which writes them under
    /// `tables/`): what a resumed job needs to step on as if it never stopped. None by default
    /// (a store whose rows live on ps tasks, which checkpoint their own).
    fn state_tensors(&self) -> Result<Vec<(String, candle_core::Tensor)>> {
        Ok(Vec::new())
    }

    /// Whether the rows live in other processes that checkpoint them on request
    /// ([`checkpoint`](Self::checkpoint)): ps tasks. `false` by default.
    fn checkpoints_elsewhere(&self) -> bool {
        false
    }

    /// Has the processes that hold the rows checkpoint them as of step `step`; called by the
    /// chief's [`save_checkpoint`](crate::elastic::save_checkpoint) between two barriers of every
    /// worker (so that every worker's rows of the step, and none of a later one, are in it),
    /// before the chief writes its own checkpoint of the step: a checkpoint of the dense part
    /// never exists without the rows'. Nothing by default.
    fn checkpoint(&self, step: u64) -> Result<()> {
        let _ = step;
        Ok(())
    }

    /// Restores the rows [`state_tensors`](Self::state_tensors) gave, read back from a
    /// checkpoint (`tables/` removed), into the tables the model declared; checked whole first:
    /// on an error nothing changed. Nothing by default.
    fn load_state_tensors(&self, state: &[(String, candle_core::Tensor)]) -> Result<()> {
        let _ = state;
        Ok(())
    }
}

/// The strategy a model's tables are built under, as [`TableStore::attach`] is told it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableScope<'a> {
    /// The strategy's name (`one-device`, `mirrored`, ...).
    pub strategy: &'a str,
    /// The replicas of a step in this process, each of which looks tables up and ends the
    /// step ([`TableStore::end_step`]).
    pub replicas: usize,
    /// The worker processes of a multi-worker job (`None` for the in-process strategies).
    pub workers: Option<usize>,
    /// The seed of the tables' initial rows ([`init_row`]).
    pub seed: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_depend_on_seed_table_and_id_only() {
        let mut a = [0f32; 16];
        let mut b = [0f32; 16];
        let init = RowInit::default();
        init_row(7, "t", init, 42, &mut a);
        init_row(7, "t", init, 42, &mut b);
        assert_eq!(a, b);
        init_row(7, "t", init, 43, &mut b);
        assert_ne!(a, b);
        init_row(8, "t", init, 42, &mut b);
        assert_ne!(a, b);
        init_row(7, "u", init, 42, &mut b);
        assert_ne!(a, b);
        assert!(a.iter().all(|x| (-0.05..0.05).contains(x)), "{a:?}");
    }

    #[test]
    fn initialisers_have_their_moments() {
        let n = 200_000;
        let mut row = vec![0f32; n];
        init_row(1, "t", RowInit::Uniform { low: -1.0, high: 3.0 }, 9, &mut row);
        let mean = row.iter().map(|&x| f64::from(x)).sum::<f64>() / n as f64;
        assert!((mean - 1.0).abs() < 0.02, "{mean}");
        init_row(1, "t", RowInit::Normal { std: 2.0 }, 9, &mut row);
        let mean = row.iter().map(|&x| f64::from(x)).sum::<f64>() / n as f64;
        let var = row.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.03 && (var.sqrt() - 2.0).abs() < 0.03, "{mean} {var}");
        init_row(1, "t", RowInit::Zeros, 9, &mut row);
        assert!(row.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn shards_cover_the_rows_once_and_owners_agree() {
        for rows in [1u64, 2, 7, 10, 1000, 1001] {
            for shards in 1..6 {
                let mut held = vec![0u64; shards];
                for id in 0..rows {
                    held[owner_of(TableSize::Rows(rows), id, shards)] += 1;
                }
                for (i, &h) in held.iter().enumerate() {
                    assert_eq!(h, shard_len(rows, shards, i), "{rows} rows, {shards} shards, shard {i}");
                }
                assert_eq!(held.iter().sum::<u64>(), rows);
                // A run of neighbouring ids (a field's popular range) is spread over every task.
                assert!(
                    rows < shards as u64
                        || (0..shards as u64).all(|id| owner_of(TableSize::Rows(rows), id, shards) == id as usize)
                );
            }
        }
        let ids = TableSize::Ids { max_rows_per_shard: 10, evict_after: None };
        let mut count = [0usize; 3];
        for id in 0..30_000u64 {
            count[owner_of(ids, id, 3)] += 1;
        }
        assert!(count.iter().all(|&c| (9_000..11_000).contains(&c)), "{count:?}");
    }

    #[test]
    fn distinct_ids_index_the_batch() {
        let (d, i) = distinct_ids(&[5, 3, 5, 9, 3]);
        assert_eq!(d, vec![3, 5, 9]);
        assert_eq!(i, vec![1, 0, 1, 2, 0]);
    }

    #[test]
    fn bad_tables_and_ids_are_refused_in_one_line() {
        let ok = TableConfig::rows("t", 10, 4);
        ok.check().unwrap();
        let cases = [
            TableConfig { dim: 0, ..ok.clone() },
            TableConfig { size: TableSize::Rows(0), ..ok.clone() },
            TableConfig { size: TableSize::Ids { max_rows_per_shard: 0, evict_after: None }, ..ok.clone() },
            TableConfig { init: RowInit::Uniform { low: 1.0, high: 1.0 }, ..ok.clone() },
            TableConfig { init: RowInit::Normal { std: f32::NAN }, ..ok.clone() },
        ];
        for c in cases {
            let e = c.check().unwrap_err().to_string();
            assert!(e.contains("\"t\"") && !e.contains('\n'), "{e}");
        }
        assert!(ok.check_id(9).is_ok());
        let e = ok.check_id(10).unwrap_err().to_string();
        assert!(e.contains("id 10") && e.contains("\"t\""), "{e}");
    }
}

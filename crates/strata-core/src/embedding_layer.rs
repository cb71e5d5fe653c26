//! The [`Embedding`] layer: a table of [`TableConfig`] made in a strategy's [`Scope`], looked
//! up by ids of any shape. The model code is the same under every strategy; how the table is
//! held is the layer's own affair (a private inner enum), so a sparse table (rows pulled from
//! and pushed to parameter servers) can come in later behind the same type.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::embedding::{init_row, TableConfig, TableScope, TableSize, TableStore};
use crate::variables::Scope;
use crate::{Error, Result};

/// How the table is held.
#[derive(Clone, Debug)]
enum Inner {
    /// The whole table, an ordinary trainable variable of shape `(rows, dim)`.
    Dense(Tensor),
    /// Rows pulled from the strategy's [`TableStore`] for each lookup, their gradients handed
    /// back to it ([`crate::table_rows`]).
    Store(Arc<dyn TableStore>),
}

/// An embedding table: `forward(ids)` gives the rows of `ids`, of shape `ids.shape() x dim`.
///
/// Under the strategies that keep variables whole (OneDevice, Mirrored, CentralStorage,
/// MultiWorkerMirrored) the table is an ordinary trainable variable named `config.name`, of
/// shape `(rows, dim)`; its gradient is the dense `(rows, dim)` tensor candle's `index_select`
/// produces (the output gradient scatter-added into the looked-up rows, zeros elsewhere), and
/// it is reduced densely like every other gradient: a step sends `rows x dim` values whatever
/// the batch touched. Reducing only the rows a step touched (their ids and values) is future
/// work, to be measured against this dense reduction.
///
/// Row `id` starts at [`init_row`]`(seed, name, init, id)` with the scope's seed, whatever the
/// strategy, so a table trained on one device, on replicas, or created row by row on
/// parameter-server tasks starts from the same numbers.
///
/// A table declared by id space ([`TableSize::Ids`]) cannot be one tensor: under these
/// strategies it is refused ([`Error::IdSpaceTable`]).
///
/// Under a strategy with a [`TableStore`] ([`StrategyOptions::tables`](crate::StrategyOptions::tables):
/// a parameter-server worker, hybrid training, or an in-process strategy's local tables, rows
/// in this process's memory stepped by a row optimizer) the table is no variable of the model:
/// each lookup pulls the distinct rows its ids name from the store, and the backward pass hands
/// their gradients (summed per row) back to it ([`crate::table_rows`]). Both kinds of table
/// work there.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use strata_core::embedding::TableConfig;
/// use strata_core::layers::Embedding;
/// use strata_core::{Strategy, StrategyHandle};
///
/// let strategy = StrategyHandle::current();
/// let model = strategy.scope(|s| Embedding::new(s, TableConfig::rows("emb", 100, 8)).map_err(candle_core::Error::wrap))?;
/// let ids = Tensor::new(&[[3u32, 7], [99, 0]], &Device::Cpu)?;
/// assert_eq!(model.primary().forward(&ids)?.dims(), [2, 2, 8]);
/// # Ok::<(), strata_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Embedding {
    config: TableConfig,
    inner: Inner,
}

impl Embedding {
    /// The table of `config`, made in `scope` (under the name `config.name`). Refuses a
    /// configuration that does not check ([`TableConfig::check`]), a table declared by id space
    /// ([`Error::IdSpaceTable`]) and one too large to address.
    pub fn new(scope: &Scope, config: TableConfig) -> Result<Self> {
        config.check()?;
        if let Some(store) = &scope.strategy().options().tables {
            let ext = scope.strategy();
            store.attach(&TableScope {
                strategy: ext.name(),
                replicas: ext.num_replicas(),
                workers: ext.workers().map(|w| w.num_workers()),
                seed: scope.seed(),
            })?;
            store.declare(&config)?;
            return Ok(Self { config, inner: Inner::Store(store.clone()) });
        }
        let rows = match config.size {
            TableSize::Rows(rows) => rows,
            TableSize::Ids { .. } => {
                return Err(Error::IdSpaceTable {
                    table: config.name.clone(),
                    strategy: scope.strategy().name().into(),
                })
            }
        };
        let elements = usize::try_from(rows)
            .ok()
            .and_then(|r| r.checked_mul(config.dim))
            .filter(|&n| n <= isize::MAX as usize / 4);
        let Some(_) = elements else {
            return Err(Error::InvalidArgument(format!(
                "embedding table {:?} of {rows} rows of {} is too large to hold as one tensor; declare fewer rows",
                config.name, config.dim
            )));
        };
        let (seed, dim, init) = (scope.seed(), config.dim, config.init);
        let table = scope.var_from_values(&config.name, (rows as usize, dim), |values| {
            for (id, row) in values.chunks_exact_mut(dim).enumerate() {
                init_row(seed, &config.name, init, id as u64, row);
            }
        })?;
        Ok(Self { config, inner: Inner::Dense(table) })
    }

    /// The table's configuration.
    pub fn config(&self) -> &TableConfig {
        &self.config
    }

    /// The whole table, `(rows, dim)` (this copy's variable); `None` when a [`TableStore`]
    /// holds it.
    pub fn table(&self) -> Option<&Tensor> {
        match &self.inner {
            Inner::Dense(t) => Some(t),
            Inner::Store(_) => None,
        }
    }

    /// The device the looked-up rows are on: the table's, or the CPU for a store's rows
    /// (looked up on the ids' device).
    pub fn device(&self) -> Device {
        match &self.inner {
            Inner::Dense(t) => t.device().clone(),
            Inner::Store(_) => Device::Cpu,
        }
    }

    /// Has the table's store pull ahead the rows a [`forward`](Self::forward) of `ids` in the
    /// coming step will ask for ([`TableStore::prefetch`]), e.g. while a parameter-server
    /// worker pulls its dense variables; the ids are checked as `forward` checks them. Nothing
    /// for a table held whole.
    pub fn prefetch(&self, ids: &Tensor) -> candle_core::Result<()> {
        match &self.inner {
            Inner::Dense(_) => Ok(()),
            Inner::Store(store) => crate::table_rows::prefetch(store, &self.config, ids),
        }
    }

    /// Tells the table's store the ids a [`forward`](Self::forward) of the next step will look
    /// up ([`TableStore::expect_next`]), e.g. from records made ahead: a store on parameter
    /// servers may then pull them beside the end of this step. Checked as `forward` checks
    /// them. Nothing for a table held whole.
    pub fn expect_next(&self, ids: &Tensor) -> candle_core::Result<()> {
        match &self.inner {
            Inner::Dense(_) => Ok(()),
            Inner::Store(store) => crate::table_rows::expect_next(store, &self.config, ids),
        }
    }

    /// The rows of `ids` (u32 or i64, any shape `S`): a tensor of shape `S x dim`. An id
    /// outside the table's rows is an error naming the table ([`Error::EmbeddingId`]; checked
    /// here, since `index_select` would not), as are ids of another dtype.
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let table = match &self.inner {
            Inner::Dense(table) => table,
            Inner::Store(store) => return crate::table_rows::lookup(store, &self.config, ids),
        };
        self.check_ids(ids).map_err(candle_core::Error::wrap)?;
        let mut dims = ids.dims().to_vec();
        dims.push(self.config.dim);
        table.index_select(&ids.flatten_all()?, 0)?.reshape(dims)
    }

    /// Every id of `ids` within `0..rows`.
    fn check_ids(&self, ids: &Tensor) -> Result<()> {
        if ids.elem_count() == 0 {
            return Ok(());
        }
        let flat = ids.flatten_all()?;
        // The largest id (and a negative one) tells, without copying the ids to the host.
        match ids.dtype() {
            DType::U32 => self.config.check_id(u64::from(flat.max(0)?.to_scalar::<u32>()?)),
            DType::I64 => match flat.min(0)?.to_scalar::<i64>()? {
                min if min < 0 => Err(self.config.negative_id(min)),
                _ => self.config.check_id(flat.max(0)?.to_scalar::<i64>()? as u64),
            },
            other => Err(self.config.id_dtype(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;
    use crate::embedding::RowInit;
    use crate::{Strategy, StrategyHandle};

    fn table(config: TableConfig) -> crate::Replicated<Embedding> {
        StrategyHandle::current()
            .scope(|s| Embedding::new(s, config.clone()).map_err(candle_core::Error::wrap))
            .unwrap()
    }

    #[test]
    fn forward_gathers_the_rows_of_any_shape_of_ids() {
        let m = table(TableConfig::rows("t", 10, 3));
        let e = m.primary();
        let rows = e.table().unwrap().to_vec2::<f32>().unwrap();
        let ids = Tensor::new(&[[1u32, 9, 1], [0, 4, 7]], &Device::Cpu).unwrap();
        let out = e.forward(&ids).unwrap();
        assert_eq!(out.dims(), [2, 3, 3]);
        let got = out.to_vec3::<f32>().unwrap();
        for (i, r) in [[1usize, 9, 1], [0, 4, 7]].iter().enumerate() {
            for (j, &id) in r.iter().enumerate() {
                assert_eq!(got[i][j], rows[id]);
            }
        }
        let long = Tensor::new(&[9i64, 0], &Device::Cpu).unwrap();
        assert_eq!(e.forward(&long).unwrap().to_vec2::<f32>().unwrap(), vec![rows[9].clone(), rows[0].clone()]);
    }

    #[test]
    fn the_gradient_is_the_output_gradient_scatter_added() {
        let m = table(TableConfig::rows("t", 6, 2));
        let e = m.primary();
        let ids = [2u32, 5, 2, 0, 2];
        let out = e.forward(&Tensor::new(&ids, &Device::Cpu).unwrap()).unwrap();
        // loss = sum of out * w: the output gradient is w.
        let w: Vec<f32> = (0..10).map(|i| i as f32 - 3.5).collect();
        let wt = Tensor::from_vec(w.clone(), (5, 2), &Device::Cpu).unwrap();
        let grads = (out * wt).unwrap().sum_all().unwrap().backward().unwrap();
        let g = grads.get(e.table().unwrap()).unwrap().to_vec2::<f32>().unwrap();
        let mut want = vec![vec![0f32; 2]; 6];
        for (k, &id) in ids.iter().enumerate() {
            want[id as usize][0] += w[2 * k];
            want[id as usize][1] += w[2 * k + 1];
        }
        assert_eq!(g, want);
    }

    #[test]
    fn ids_out_of_range_are_refused_naming_the_table() {
        let m = table(TableConfig::rows("clicks", 4, 2));
        let e = m.primary();
        // The first line: candle appends a backtrace to a wrapped error under RUST_BACKTRACE.
        let msg = |ids: Tensor| e.forward(&ids).unwrap_err().to_string().lines().next().unwrap().to_string();
        let m1 = msg(Tensor::new(&[0u32, 4], &Device::Cpu).unwrap());
        assert_eq!(
            m1,
            "id 4 is outside embedding table \"clicks\"'s 4 rows; map ids into 0..4 or declare the table by id space"
        );
        let m2 = msg(Tensor::new(&[-1i64, 2], &Device::Cpu).unwrap());
        assert!(m2.contains("id -1") && m2.contains("\"clicks\""), "{m2}");
        let m3 = msg(Tensor::new(&[1f32], &Device::Cpu).unwrap());
        assert!(m3.contains("u32 or i64"), "{m3}");
    }

    #[test]
    fn rows_start_at_init_row_and_id_spaces_are_refused() {
        let config = TableConfig { init: RowInit::Normal { std: 0.5 }, ..TableConfig::rows("emb", 7, 5) };
        let m = table(config.clone());
        let rows = m.primary().table().unwrap().to_vec2::<f32>().unwrap();
        let seed = StrategyHandle::current().extended().options().seed;
        for (id, row) in rows.iter().enumerate() {
            let mut want = [0f32; 5];
            init_row(seed, "emb", config.init, id as u64, &mut want);
            assert_eq!(row.as_slice(), want.as_slice());
        }
        let ids = TableConfig { size: TableSize::Ids { max_rows_per_shard: 10, evict_after: None }, ..config };
        let mut refused = None;
        let _ = StrategyHandle::current().scope(|s| {
            refused = Embedding::new(s, ids.clone()).err().map(|e| e.to_string());
            Ok(())
        });
        let e = refused.unwrap();
        assert!(e.contains("declare rows, or train it on parameter servers") && !e.contains('\n'), "{e}");
    }
}

//! An embedding table's rows read through a [`TableStore`]: a step's lookup pulls the distinct
//! rows its ids name (each once), gathers them for the batch, and its backward pass sums each
//! row's gradient over the ids that name it (the worker-side sum of TensorFlow's
//! `IndexedSlices`) and hands it to the store, which sends it as rows and ids. The table is
//! never a variable of the model: a worker holds only the rows of its step.

use std::sync::Arc;

use candle_core::{CpuStorage, DType, Device, Layout, Shape, Tensor, Var};

use crate::context::ReplicaHandle;
use crate::embedding::{distinct_ids, TableConfig, TableStore};

/// The ids of `ids` (u32 or i64, any shape), each checked against `table` as the dense
/// layer checks them ([`TableConfig::check_id`]).
pub fn ids_of(table: &TableConfig, ids: &Tensor) -> candle_core::Result<Vec<u64>> {
    let flat = ids.flatten_all()?;
    let values: Vec<u64> = match flat.dtype() {
        DType::U32 => flat.to_vec1::<u32>()?.into_iter().map(u64::from).collect(),
        DType::I64 => {
            let raw = flat.to_vec1::<i64>()?;
            if let Some(&bad) = raw.iter().find(|&&v| v < 0) {
                return Err(candle_core::Error::wrap(table.negative_id(bad)));
            }
            raw.into_iter().map(|v| v as u64).collect()
        }
        other => return Err(candle_core::Error::wrap(table.id_dtype(other))),
    };
    for &id in &values {
        table.check_id(id).map_err(candle_core::Error::wrap)?;
    }
    Ok(values)
}

/// Gathers a step's pulled rows (the op's input, `distinct x dim`) for every id of the batch;
/// its backward pass hands the rows' gradients to the store.
struct GatherRows {
    store: Arc<dyn TableStore>,
    table: String,
    dim: usize,
    replica: usize,
    /// The distinct ids pulled, in the order of the input's rows.
    ids: Arc<Vec<u64>>,
    /// For every id of the batch, its row among the input's.
    index: Arc<Vec<u32>>,
    /// The rows of the batch the replica's loss is the mean over.
    batch_rows: usize,
}

impl candle_core::CustomOp1 for GatherRows {
    fn name(&self) -> &'static str {
        "strata-gather-table-rows"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let rows = match (storage, layout.contiguous_offsets()) {
            (CpuStorage::F32(v), Some((lo, hi))) => &v[lo..hi],
            _ => candle_core::bail!("table rows must be a contiguous f32 tensor"),
        };
        let dim = self.dim;
        let mut out = Vec::with_capacity(self.index.len() * dim);
        for &i in self.index.iter() {
            let start = i as usize * dim;
            out.extend_from_slice(&rows[start..start + dim]);
        }
        Ok((CpuStorage::F32(out), Shape::from((self.index.len(), dim))))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let grad = grad.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
        let dim = self.dim;
        // Each row's gradient summed over the ids that name it, in the batch's order.
        let mut rows = vec![0f32; self.ids.len() * dim];
        for (k, &i) in self.index.iter().enumerate() {
            let (src, dst) = (&grad[k * dim..(k + 1) * dim], &mut rows[i as usize * dim..(i as usize + 1) * dim]);
            dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
        }
        self.store
            .gradient(self.replica, &self.table, &self.ids, rows, self.batch_rows)
            .map_err(candle_core::Error::wrap)?;
        // The pulled rows are no variable of the model: nothing to hand back to them.
        Ok(None)
    }
}

/// Has `store` pull ahead the rows a [`lookup`] of `ids` in the coming step will ask for
/// ([`TableStore::prefetch`]): the same ids, checked the same way, for the replica this thread
/// runs (replica 0 outside a step).
pub fn prefetch(store: &Arc<dyn TableStore>, table: &TableConfig, ids: &Tensor) -> candle_core::Result<()> {
    let (distinct, _) = distinct_ids(&ids_of(table, ids)?);
    let replica = ReplicaHandle::current().map_or(0, |h| h.replica_id());
    store.prefetch(replica, &table.name, &distinct).map_err(candle_core::Error::wrap)
}

/// Tells `store` the rows a [`lookup`] of `ids` in the next step will ask for
/// ([`TableStore::expect_next`]): the same ids, checked the same way, for the replica this
/// thread runs (replica 0 outside a step).
pub fn expect_next(store: &Arc<dyn TableStore>, table: &TableConfig, ids: &Tensor) -> candle_core::Result<()> {
    let (distinct, _) = distinct_ids(&ids_of(table, ids)?);
    let replica = ReplicaHandle::current().map_or(0, |h| h.replica_id());
    store.expect_next(replica, &table.name, &distinct).map_err(candle_core::Error::wrap)
}

/// `ids`' rows of `table` from `store`, shaped `ids.dims() x dim` on `ids`' device, for the
/// replica this thread runs (replica 0 outside a step): the distinct ids pulled once, their
/// gradients handed to the store by the backward pass.
pub fn lookup(store: &Arc<dyn TableStore>, table: &TableConfig, ids: &Tensor) -> candle_core::Result<Tensor> {
    let all = ids_of(table, ids)?;
    let (distinct, index) = distinct_ids(&all);
    let replica = ReplicaHandle::current().map_or(0, |h| h.replica_id());
    let values = store.pull(replica, &table.name, &distinct).map_err(candle_core::Error::wrap)?;
    if values.len() != distinct.len() * table.dim {
        candle_core::bail!(
            "the store of embedding table {:?} returned {} values for {} rows of {}",
            table.name,
            values.len(),
            distinct.len(),
            table.dim
        );
    }
    // A variable, so that the backward pass reaches the gather below it.
    let rows = Var::from_tensor(&Tensor::from_vec(values, (distinct.len(), table.dim), &Device::Cpu)?)?;
    let batch_rows = if ids.rank() == 0 { 1 } else { ids.dim(0)? };
    let op = GatherRows {
        store: store.clone(),
        table: table.name.clone(),
        dim: table.dim,
        replica,
        ids: Arc::new(distinct),
        index: Arc::new(index),
        batch_rows,
    };
    let gathered = rows.as_tensor().apply_op1(op)?;
    let mut dims = ids.dims().to_vec();
    dims.push(table.dim);
    gathered.reshape(dims)?.to_device(ids.device())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use super::*;
    use crate::embedding::{init_row, RowInit};
    use crate::Result;

    /// A step's gradient of some rows: their ids, values and the batch rows of its loss.
    type Pending = (Vec<u64>, Vec<f32>, usize);

    /// A table store in this process that steps touched rows with SGD at the end of a step:
    /// the reference the layer's lookups are checked against.
    #[derive(Debug, Default)]
    struct SgdRows {
        lr: f32,
        rows: Mutex<HashMap<u64, Vec<f32>>>,
        pending: Mutex<Vec<Pending>>,
        config: Mutex<Option<TableConfig>>,
    }

    impl TableStore for SgdRows {
        fn declare(&self, table: &TableConfig) -> Result<()> {
            *self.config.lock().unwrap() = Some(table.clone());
            Ok(())
        }

        fn pull(&self, _replica: usize, _table: &str, ids: &[u64]) -> Result<Vec<f32>> {
            let config = self.config.lock().unwrap().clone().unwrap();
            let mut rows = self.rows.lock().unwrap();
            let mut out = Vec::new();
            for &id in ids {
                let row = rows.entry(id).or_insert_with(|| {
                    let mut r = vec![0f32; config.dim];
                    init_row(0, &config.name, config.init, id, &mut r);
                    r
                });
                out.extend_from_slice(row);
            }
            Ok(out)
        }

        fn gradient(&self, _replica: usize, _table: &str, ids: &[u64], grad: Vec<f32>, rows: usize) -> Result<()> {
            self.pending.lock().unwrap().push((ids.to_vec(), grad, rows));
            Ok(())
        }

        fn end_step(&self, _replica: usize, _failed: bool) -> Result<()> {
            let dim = self.config.lock().unwrap().as_ref().unwrap().dim;
            let mut rows = self.rows.lock().unwrap();
            for (ids, grad, _) in self.pending.lock().unwrap().drain(..) {
                for (k, id) in ids.iter().enumerate() {
                    let row = rows.get_mut(id).unwrap();
                    for (w, g) in row.iter_mut().zip(&grad[k * dim..(k + 1) * dim]) {
                        *w -= self.lr * g;
                    }
                }
            }
            Ok(())
        }
    }

    /// Rows looked up through a store and stepped there with SGD end, bit for bit, where a
    /// dense table (a variable, `index_select`, SGD on the whole gradient) ends on the rows the
    /// batches touched; the rows no batch touched keep their initial values.
    #[test]
    fn rows_from_a_store_train_as_a_dense_table_does() -> candle_core::Result<()> {
        let table = TableConfig { init: RowInit::Uniform { low: -1.0, high: 1.0 }, ..TableConfig::rows("t", 50, 3) };
        let store = Arc::new(SgdRows { lr: 0.1, ..Default::default() });
        store.declare(&table).map_err(candle_core::Error::wrap)?;
        let dyn_store: Arc<dyn TableStore> = store.clone();
        let mut init = vec![0f32; 50 * 3];
        for id in 0..50u64 {
            init_row(0, "t", table.init, id, &mut init[id as usize * 3..id as usize * 3 + 3]);
        }
        let dense = Var::from_tensor(&Tensor::from_vec(init.clone(), (50, 3), &Device::Cpu)?)?;
        let batches: [&[u32]; 3] = [&[4, 7, 4, 9, 0, 7], &[9, 9, 1, 2, 4, 30], &[49, 4, 7, 8, 8, 8]];
        for ids in batches {
            let ids = Tensor::new(ids, &Device::Cpu)?.reshape((3, 2))?;
            let target = Tensor::arange(0f32, 18.0, &Device::Cpu)?.reshape((3, 2, 3))?;
            let loss = |rows: &Tensor| (rows - &target)?.sqr()?.mean_all();
            // Dense.
            let gathered = dense.as_tensor().index_select(&ids.flatten_all()?, 0)?.reshape((3, 2, 3))?;
            let grads = loss(&gathered)?.backward()?;
            let g = grads.get(&dense).unwrap();
            dense.set(&(dense.as_tensor() - (g * 0.1)?)?)?;
            // Through the store.
            loss(&lookup(&dyn_store, &table, &ids)?)?.backward()?;
            store.end_step(0, false).map_err(candle_core::Error::wrap)?;
        }
        let dense = dense.as_tensor().to_vec2::<f32>()?;
        let rows = store.rows.lock().unwrap();
        for (id, want) in dense.iter().enumerate() {
            match rows.get(&(id as u64)) {
                Some(got) => assert_eq!(got, want, "row {id}"),
                None => assert_eq!(want, &init[id * 3..id * 3 + 3], "row {id}, untouched"),
            }
        }
        // The pending gradients were each step's mean over its 3 batch rows.
        assert!(store.pending.lock().unwrap().is_empty());
        Ok(())
    }

    #[test]
    fn bad_ids_are_refused_in_one_line_naming_the_table() -> candle_core::Result<()> {
        let table = TableConfig::rows("emb", 10, 2);
        let store: Arc<dyn TableStore> = Arc::new(SgdRows::default());
        store.declare(&table).map_err(candle_core::Error::wrap)?;
        for (ids, want) in [
            (Tensor::new(&[1u32, 10], &Device::Cpu)?, "id 10"),
            (Tensor::new(&[-3i64], &Device::Cpu)?, "id -3"),
            (Tensor::new(&[1f32], &Device::Cpu)?, "u32 or i64 ids"),
        ] {
            // candle appends a backtrace under RUST_BACKTRACE: the message is the first line.
            let e = lookup(&store, &table, &ids).unwrap_err().to_string();
            let line = e.lines().next().unwrap_or_default();
            assert!(line.contains(want) && line.contains("\"emb\""), "{e}");
        }
        Ok(())
    }
}

//! The DLRM-style click model ([`Dlrm`]), its loss and its task.

use candle_core::{DType, Device, Tensor, D};
use strata_core::data::BatchData;
use strata_core::embedding::TableConfig;
use strata_core::layers::Embedding;
use strata_core::Scope;

use super::data::{CtrBatch, CtrData, DENSE, FIELDS};
use crate::model::Dense;
use crate::trainer::Task;
use crate::{Error, Result};

/// Pairwise interactions among the bottom output and the 26 embeddings: 27 x 26 / 2.
pub const INTERACTIONS: usize = (FIELDS + 1) * FIELDS / 2;

/// The shape of a [`Dlrm`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DlrmConfig {
    /// Rows of the one embedding table the 26 fields share.
    pub embedding_rows: u64,
    /// The embedding dimension `D` (the bottom MLP's output too).
    pub embedding_dim: usize,
    /// The hidden width of the bottom MLP (13 -> hidden -> D) and of the top MLP
    /// (D + 351 -> hidden -> 1).
    pub hidden: usize,
}

impl DlrmConfig {
    /// The default embedding dimension.
    pub const DEFAULT_DIM: usize = 16;
    /// The MLPs' hidden width.
    pub const HIDDEN: usize = 64;
    /// The most parameters outside the table (the MLPs), as the other models' limit.
    pub const MAX_TABLE_ELEMENTS: u64 = 1 << 34;

    /// A model of `embedding_rows` rows of `embedding_dim`, hidden layers of 64.
    pub fn new(embedding_rows: u64, embedding_dim: usize) -> Self {
        Self { embedding_rows, embedding_dim, hidden: Self::HIDDEN }
    }

    /// The parameters outside the table.
    pub fn dense_parameter_count(&self) -> usize {
        let (d, h) = (self.embedding_dim, self.hidden);
        (DENSE * h + h) + (h * d + d) + ((d + INTERACTIONS) * h + h) + (h + 1)
    }

    /// Every parameter: the table's `rows x D` and the MLPs'.
    pub fn parameter_count(&self) -> u64 {
        self.embedding_rows * self.embedding_dim as u64 + self.dense_parameter_count() as u64
    }

    /// Checks the sizes before anything is allocated: a dimension of `1..=1024`, at least 26
    /// rows (one per field), a table of at most 2^34 elements (64 GiB of f32).
    pub fn check(&self) -> Result<()> {
        if !(1..=1024).contains(&self.embedding_dim) {
            return Err(Error::Usage(format!(
                "an embedding dimension of {} is outside 1..=1024; use e.g. 16",
                self.embedding_dim
            )));
        }
        let elements = self.embedding_rows.checked_mul(self.embedding_dim as u64);
        if self.embedding_rows < super::data::MIN_ROWS || elements.is_none_or(|n| n > Self::MAX_TABLE_ELEMENTS) {
            return Err(Error::Usage(format!(
                "an embedding table of {} rows of {}: use at least {} rows (one per field) and at most 2^34 elements",
                self.embedding_rows,
                self.embedding_dim,
                super::data::MIN_ROWS
            )));
        }
        Ok(())
    }
}

/// A DLRM-style click model (Naumov et al., 2019): the 26 fields' ids looked up in one
/// [`Embedding`] table (`ctr.embedding`, `rows x D`), a bottom MLP on the 13 dense features
/// (13 -> 64 -> D, ReLU after each), the dot products of every pair of the 27 vectors (the
/// bottom output and the 26 embeddings: 351, the upper triangle without the diagonal),
/// concatenated with the bottom output, and a top MLP (D + 351 -> 64 -> 1, ReLU between) to
/// the click logit. Variables: `ctr.embedding`, `ctr.bottom{0,1}.{weight,bias}`,
/// `ctr.top{0,1}.{weight,bias}`.
///
/// Built from the scope itself (the table is made through [`Scope::var_from_values`]), it runs
/// unchanged under every strategy that keeps variables whole.
#[derive(Debug)]
pub struct Dlrm {
    config: DlrmConfig,
    embedding: Embedding,
    bottom: [Dense; 2],
    top: [Dense; 2],
    /// The positions of the upper triangle (without the diagonal) in a flattened 27 x 27.
    pairs: Tensor,
}

impl Dlrm {
    /// The model of `config`, its variables made in `scope`.
    pub fn new(scope: &Scope, config: DlrmConfig) -> candle_core::Result<Self> {
        config.check().map_err(candle_core::Error::wrap)?;
        let vb = scope.var_builder().pp("ctr");
        let (d, h) = (config.embedding_dim, config.hidden);
        let table = TableConfig::rows("ctr.embedding", config.embedding_rows, d);
        let embedding = Embedding::new(scope, table).map_err(candle_core::Error::wrap)?;
        let n = FIELDS + 1;
        let pairs: Vec<u32> = (0..n).flat_map(|i| (i + 1..n).map(move |j| (i * n + j) as u32)).collect();
        Ok(Self {
            config,
            embedding,
            bottom: [Dense::new(DENSE, h, vb.pp("bottom0"))?, Dense::new(h, d, vb.pp("bottom1"))?],
            top: [Dense::new(d + INTERACTIONS, h, vb.pp("top0"))?, Dense::new(h, 1, vb.pp("top1"))?],
            pairs: Tensor::new(pairs, vb.device())?,
        })
    }

    /// Its shape.
    pub fn config(&self) -> DlrmConfig {
        self.config
    }

    /// The embedding table.
    pub fn embedding(&self) -> &Embedding {
        &self.embedding
    }

    /// The click logits `(B,)` of dense features f32 `(B, 13)` and ids u32 `(B, 26)`.
    pub fn logits(&self, dense: &Tensor, ids: &Tensor) -> candle_core::Result<Tensor> {
        let b = dense.dim(0)?;
        let bottom = self.bottom[1].forward_relu(&self.bottom[0].forward_relu(dense)?)?;
        let embedded = self.embedding.forward(ids)?; // (B, 26, D)
        let z = Tensor::cat(&[&bottom.unsqueeze(1)?, &embedded], 1)?.contiguous()?; // (B, 27, D)
        let dots = z.matmul(&z.transpose(1, 2)?)?.reshape((b, (FIELDS + 1) * (FIELDS + 1)))?;
        let dots = dots.index_select(&self.pairs, 1)?;
        let x = Tensor::cat(&[&bottom, &dots], 1)?;
        self.top[1].forward(&self.top[0].forward_relu(&x)?)?.squeeze(D::Minus1)
    }

    /// The mean binary cross-entropy of the logits against `labels` (f32 0 or 1, `(B,)`).
    pub fn loss(&self, dense: &Tensor, ids: &Tensor, labels: &Tensor) -> candle_core::Result<Tensor> {
        bce_with_logits(&self.logits(dense, ids)?, labels)
    }

    /// The click probabilities of `batch`'s records, computed in chunks of 4,096 on the model's
    /// device.
    pub fn predict(&self, batch: &CtrBatch) -> Result<Vec<f64>> {
        let device = &self.embedding.device();
        let rows = batch.rows()?;
        let mut out = Vec::with_capacity(rows);
        for start in (0..rows).step_by(4096) {
            let (dense, ids, _) = batch.slice(start..(start + 4096).min(rows))?.to_device(device)?;
            let p = candle_nn::ops::sigmoid(&self.logits(&dense, &ids)?)?;
            out.extend(p.to_dtype(DType::F64)?.to_vec1::<f64>()?);
        }
        Ok(out)
    }

    /// The AUC of the model's predictions on `batch` against its labels.
    pub fn auc(&self, batch: &CtrBatch) -> Result<f64> {
        let labels = batch.2.to_vec1::<f32>()?;
        Ok(super::auc(&self.predict(batch)?, &labels))
    }

    /// The AUC of the model's predictions on the records of `keys` ([`CtrData::keys`]),
    /// generated 4,096 at a time: the same value as [`auc`](Self::auc) on their batch, without
    /// holding it.
    pub fn auc_of_keys(&self, data: &CtrData, keys: &Tensor) -> Result<f64> {
        let n = keys.dim(0)?;
        let (mut scores, mut labels) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for start in (0..n).step_by(4096) {
            let batch = data.batch_of_keys(&keys.narrow(0, start, (start + 4096).min(n) - start)?, &Device::Cpu)?;
            scores.extend(self.predict(&batch)?);
            labels.extend(batch.2.to_vec1::<f32>()?);
        }
        Ok(super::auc(&scores, &labels))
    }
}

/// The mean of `max(x, 0) - x y + log(1 + exp(-|x|))`: binary cross-entropy on logits `x`
/// against labels `y`, stable for any `x`.
pub fn bce_with_logits(logits: &Tensor, labels: &Tensor) -> candle_core::Result<Tensor> {
    let softplus = (logits.abs()?.neg()?.exp()? + 1.0)?.log()?;
    (logits.relu()? - (logits * labels)? + softplus)?.mean_all()
}

/// The task of [`crate::trainer::Trainer::fit`] for the click model on record keys
/// ([`CtrData::keys`]): each step generates its shard's records from their keys, as a
/// parameter-server worker generates its step's, so that no process holds the records (8 bytes
/// a record instead of 160) and a step's time includes making its batch; otherwise [`task`]'s
/// loss and metrics, with the same values. Each replica's next records are made on a thread of
/// their own while its step runs, as `tf.data`'s `prefetch` makes them: the next step's keys
/// guessed from the stride of the last two steps' runs of consecutive keys, a wrong guess
/// dropped (the step then makes its own), the same bits either way. The next step's ids go to
/// the table's store ([`Embedding::expect_next`]), which on parameter servers pulls their rows
/// with this step's push as soon as this step's backward pass has given the rows' gradients.
///
/// [`Embedding::expect_next`]: strata_core::layers::Embedding::expect_next
pub fn streamed_task(data: &CtrData) -> Task<'_, Dlrm, Tensor> {
    let ahead = super::ahead::Ahead::new(data);
    Task::new(move |m: &Dlrm, ctx, keys: &Tensor| {
        let ((dense, ids, labels), next) = ahead.batch(keys, ctx.candle_device()).map_err(crate::error::into_core)?;
        // The next step's rows, known now: a store on ps tasks may pull them beside this step's end.
        if let Some(next) = next {
            m.embedding().expect_next(&next)?;
        }
        Ok(m.loss(&dense, &ids, &labels)?)
    })
    .with_whole_set_metric("auc", move |m: &Dlrm, keys: &Tensor| m.auc_of_keys(data, keys))
}

/// The task of [`crate::trainer::Trainer::fit`] for the click model on [`CtrBatch`]es: its
/// loss, and the evaluation's metrics: the log loss (`loss`, split over the shards) and the
/// test AUC (`auc`, which does not split: [`Dlrm::auc`] on the primary copy over the whole
/// test set, a whole-set metric).
pub fn task<'a>() -> Task<'a, Dlrm, CtrBatch> {
    Task::new(|m: &Dlrm, ctx, b: &CtrBatch| {
        let (dense, ids, labels) = b.to_device(ctx.candle_device())?;
        Ok(m.loss(&dense, &ids, &labels)?)
    })
    .with_whole_set_metric("auc", |m: &Dlrm, b: &CtrBatch| m.auc(b))
}

#[cfg(test)]
mod tests {
    use candle_core::Device;
    use strata_core::{Strategy, StrategyHandle};

    use super::*;
    use crate::ctr::{CtrData, Split};

    #[test]
    fn shapes_parameters_and_the_loss_closed_form() {
        let config = DlrmConfig::new(500, 8);
        let model = StrategyHandle::current().scope(|s| Dlrm::new(s, config)).unwrap();
        let n: usize = model.variables(0).iter().map(|(_, v)| v.elem_count()).sum();
        assert_eq!(n as u64, config.parameter_count());
        let data = CtrData::new(3, 500).unwrap();
        let (dense, ids, labels) = data.batch(Split::Train, 0..10, &Device::Cpu).unwrap();
        let logits = model.primary().logits(&dense, &ids).unwrap();
        assert_eq!(logits.dims(), [10]);
        let x = Tensor::new(&[-30f32, 0.0, 2.0], &Device::Cpu).unwrap();
        let y = Tensor::new(&[0f32, 1.0, 1.0], &Device::Cpu).unwrap();
        let got = bce_with_logits(&x, &y).unwrap().to_scalar::<f32>().unwrap();
        let want = ((1.0 + (-30f32).exp()).ln() + 2f32.ln() + (1.0 + (-2f32).exp()).ln()) / 3.0;
        assert!((got - want).abs() < 1e-6, "{got} {want}");
        assert!(model.primary().loss(&dense, &ids, &labels).unwrap().to_scalar::<f32>().unwrap().is_finite());
        assert!(DlrmConfig::new(25, 8).check().is_err() && DlrmConfig::new(100, 0).check().is_err());
    }

    /// Keys in place of records: the same training bit for bit (the shards' records generated
    /// in their steps), the same AUC, and a key that names no record refused.
    #[test]
    fn the_streamed_task_on_keys_trains_as_the_task_on_records() {
        use crate::trainer::{TrainConfig, Trainer};
        let data = CtrData::new(5, 500).unwrap();
        let cpu = Device::Cpu;
        let run = |streamed: bool| {
            let strategy = StrategyHandle::current();
            let model = strategy.scope(|s| Dlrm::new(s, DlrmConfig::new(500, 8))).unwrap();
            let trainer = Trainer::new(TrainConfig { epochs: 2, global_batch: 64, ..Default::default() });
            let opt = trainer.optimizer::<_, candle_nn::SGD>(&model, 0.05).unwrap();
            let report = if streamed {
                let (train, test) =
                    (data.keys(Split::Train, 0..300, &cpu).unwrap(), data.keys(Split::Test, 0..200, &cpu).unwrap());
                let auc = model.primary().auc_of_keys(&data, &test).unwrap();
                let r = trainer.fit(&strategy, &model, &opt, &streamed_task(&data), &train, &test).unwrap();
                (r, auc)
            } else {
                let (train, test) =
                    (data.batch(Split::Train, 0..300, &cpu).unwrap(), data.batch(Split::Test, 0..200, &cpu).unwrap());
                let auc = model.primary().auc(&test).unwrap();
                (trainer.fit(&strategy, &model, &opt, &task(), &train, &test).unwrap(), auc)
            };
            let params: Vec<Vec<u32>> = model
                .variables(0)
                .iter()
                .map(|(_, v)| v.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect())
                .collect();
            (params, report.0.final_metrics.iter().map(|m| m.value.to_bits()).collect::<Vec<_>>(), report.1)
        };
        let (a, b) = (run(false), run(true));
        assert_eq!(a.0, b.0, "parameters");
        assert_eq!(a.1, b.1, "final metrics");
        assert_eq!(a.2.to_bits(), b.2.to_bits(), "the untrained model's auc");
        let bad = Tensor::new(&[3i64, -1], &cpu).unwrap();
        assert!(data.batch_of_keys(&bad, &cpu).unwrap_err().to_string().contains("-1 is not a record key"));
    }

    #[test]
    fn the_fit_reports_the_auc_of_the_whole_test_set_after_each_epoch() {
        use crate::trainer::{TrainConfig, Trainer};
        let task = task();
        assert_eq!(task.metric_names(), ["loss", "auc"]);
        let strategy = StrategyHandle::current();
        let model = strategy.scope(|s| Dlrm::new(s, DlrmConfig::new(500, 8))).unwrap();
        let data = CtrData::new(3, 500).unwrap();
        let train = data.batch(Split::Train, 0..512, &Device::Cpu).unwrap();
        let test = data.batch(Split::Test, 0..300, &Device::Cpu).unwrap();
        let trainer = Trainer::new(TrainConfig { epochs: 2, global_batch: 128, ..Default::default() });
        let opt = trainer.optimizer::<_, candle_nn::SGD>(&model, 0.05).unwrap();
        let report = trainer.fit(&strategy, &model, &opt, &task, &train, &test).unwrap();
        let auc = |metrics: &[crate::trainer::MetricValue]| metrics.iter().find(|m| m.name == "auc").map(|m| m.value);
        assert!(report.epochs.iter().all(|e| auc(&e.test_metrics).is_some_and(|a| a > 0.0 && a < 1.0)));
        assert_eq!(auc(&report.final_metrics), Some(model.primary().auc(&test).unwrap()));
    }
}

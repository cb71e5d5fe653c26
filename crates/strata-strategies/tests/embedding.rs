//! The Embedding layer under every strategy that keeps variables whole: the same initial rows
//! and the same table after training as on one device.

use crate::common;

use crate::common::{max_rel_diff, params};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Linear, Module, SGD};
use rand::{Rng, SeedableRng};
use strata_core::data::DistributedBatch;
use strata_core::embedding::{init_row, RowInit, TableConfig};
use strata_core::layers::Embedding;
use strata_core::{Strategy, StrategyHandle};

const ROWS: u64 = 40;
const DIM: usize = 4;
const FIELDS: usize = 3;

struct Model {
    emb: Embedding,
    head: Linear,
}

impl Model {
    fn new(s: &strata_core::Scope) -> candle_core::Result<Self> {
        let config = TableConfig { init: RowInit::Normal { std: 0.3 }, ..TableConfig::rows("emb", ROWS, DIM) };
        let emb = Embedding::new(s, config).map_err(candle_core::Error::wrap)?;
        Ok(Self { emb, head: candle_nn::linear(FIELDS * DIM, 3, s.var_builder().pp("head"))? })
    }

    fn loss(&self, ids: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let x = self.emb.forward(ids)?.flatten_from(1)?;
        candle_nn::loss::cross_entropy(&self.head.forward(&x)?, y)
    }
}

/// `n` examples of 3 Zipf-ish ids (so that some rows are hit by several replicas and some by
/// none) and a class.
fn batch(n: usize, seed: u64) -> (Tensor, Tensor) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let ids: Vec<u32> = (0..n * FIELDS).map(|_| (rng.random::<f32>().powi(3) * ROWS as f32) as u32).collect();
    let labels: Vec<u32> = (0..n).map(|_| rng.random_range(0..3u32)).collect();
    (Tensor::from_vec(ids, (n, FIELDS), &Device::Cpu).unwrap(), Tensor::from_vec(labels, n, &Device::Cpu).unwrap())
}

fn train(s: &StrategyHandle, steps: usize, global: usize) -> Vec<(String, Vec<f32>)> {
    let model = s.scope(Model::new).unwrap();
    let opt = model.optimizer::<SGD>(0.5).unwrap();
    for step in 0..steps {
        let db = DistributedBatch::split(&batch(global, step as u64), s.num_replicas_in_sync()).unwrap();
        s.run_batch(&db, |ctx, shard| {
            let (ids, y) =
                (shard.batch.0.to_device(ctx.candle_device())?, shard.batch.1.to_device(ctx.candle_device())?);
            let loss = model.on(ctx)?.loss(&ids, &y)?;
            ctx.backward_and_sync(&loss, &opt)?;
            Ok(())
        })
        .unwrap();
    }
    params(&model)
}

strategy_test!(embedding_rows_start_at_init_row_and_train_as_on_one_device, |s: StrategyHandle| {
    let model = s.scope(Model::new).unwrap();
    let table = model.variable("emb").expect("the table is a variable named as the table");
    let rows = table.value().to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
    for (id, row) in rows.iter().enumerate() {
        let mut want = [0f32; DIM];
        init_row(s.extended().options().seed, "emb", RowInit::Normal { std: 0.3 }, id as u64, &mut want);
        assert_eq!(row.as_slice(), want.as_slice(), "row {id}");
    }
    // 30 over the replicas is uneven for 4, which checks the weighting too.
    let want = train(&common::one_device(), 8, 30);
    let got = train(&s, 8, 30);
    let d = max_rel_diff(&want, &got);
    assert!(d <= 1e-4, "relative difference {d}");
    let before: Vec<f32> = rows.concat();
    let after = &got.iter().find(|(n, _)| n == "emb").unwrap().1;
    assert!(before.iter().zip(after).any(|(a, b)| a != b), "training moved the table");
});

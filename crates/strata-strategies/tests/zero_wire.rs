//! ZeRO across workers crosses the wire with stage 0's bytes: each worker's shard is its ring
//! segment of every reduction, so a reduce-scatter leaves it the gradient it steps, and the
//! parameters' all-gather costs what the all-reduce's second half did. Counted by the data
//! plane's byte counter (the process's, which every in-process worker shares: this binary holds
//! one test so that nothing else counts), never timed.

use crate::common;

use crate::common::models::data;
use candle_core::{Device, Tensor};
use candle_nn::{Linear, Module, ParamsAdamW};
use strata_core::data::TailPolicy;
use strata_core::optim::FusedAdamW;
use strata_core::{Scope, Strategy, ZeroStage};

const DIM: usize = 64;

/// 64 -> 512 -> 512 -> 3: 300k parameters, so the reductions take the ring (not the direct
/// exchange of small buffers), and the 512 x 512 weight goes in blocks of rows.
struct Wide {
    l1: Linear,
    l2: Linear,
    l3: Linear,
}

impl Wide {
    fn build(sc: &Scope) -> candle_core::Result<Self> {
        let vb = sc.var_builder();
        Ok(Self {
            l1: candle_nn::linear(DIM, 512, vb.pp("l1"))?,
            l2: candle_nn::linear(512, 512, vb.pp("l2"))?,
            l3: candle_nn::linear(512, 3, vb.pp("l3"))?,
        })
    }

    fn loss(&self, b: &strata_core::data::Batch, dev: &Device) -> candle_core::Result<Tensor> {
        let x = Tensor::from_slice(&b.features, (b.len(), DIM), dev)?;
        let y = Tensor::from_slice(&b.labels, b.len(), dev)?;
        let h = self.l2.forward(&self.l1.forward(&x)?.relu()?)?.relu()?;
        candle_nn::loss::cross_entropy(&self.l3.forward(&h)?, &y)
    }
}

const STEPS: usize = 4;

/// A model's parameters by name, flattened.
type Params = Vec<(String, Vec<f32>)>;

/// Trains `Wide` for [`STEPS`] steps on 2 workers of `local` replicas at `stage`: every
/// worker's parameters after the last step, and the bytes the workers sent over the steps.
fn run(stage: ZeroStage, local: usize) -> (Vec<Params>, u64) {
    let sent = std::sync::Arc::new(std::sync::Mutex::new(0u64));
    let counted = sent.clone();
    let params = common::on_workers_tuned(
        2,
        local,
        move |o| {
            o.options.zero_stage = stage;
            o.options.row_block_bytes = 256 << 10;
        },
        move |w, s| {
            let model = s.scope(Wide::build).unwrap();
            let opt = model.optimizer::<FusedAdamW>(ParamsAdamW { lr: 0.01, ..Default::default() }).unwrap();
            let batches: Vec<_> = (0..STEPS).map(|k| data(16, DIM, 40 + k as u64)).collect();
            // Both workers are built; count from here (worker 0 reads, after a barrier).
            let w_ops = s.extended().workers().unwrap();
            w_ops.barrier().unwrap();
            let before = strata_transport::inject::bytes().0;
            for db in s.distribute_dataset(batches, TailPolicy::Split) {
                s.run_batch(&db, |ctx, shard| {
                    let loss = model.on(ctx)?.loss(&shard.batch, ctx.candle_device())?;
                    ctx.backward_and_sync(&loss, &opt)
                })
                .unwrap();
            }
            w_ops.barrier().unwrap();
            if w == 0 {
                *counted.lock().unwrap() = strata_transport::inject::bytes().0 - before;
            }
            w_ops.barrier().unwrap();
            common::params(&model)
        },
    );
    let sent = *sent.lock().unwrap();
    (params, sent)
}

#[test]
fn stages_1_and_2_across_workers_send_stage_0_s_bytes_and_its_parameters() {
    strata_transport::inject::install();
    common::with_timeout(std::time::Duration::from_secs(300), "zero on the wire", || {
        for local in [1, 2] {
            let (whole, whole_bytes) = run(ZeroStage::Off, local);
            assert!(whole_bytes > 0, "nothing counted");
            for stage in [ZeroStage::OptimizerState, ZeroStage::Gradients] {
                let (sharded, bytes) = run(stage, local);
                // Two workers: each element's sum has two terms, so any order gives its bits.
                assert_eq!(sharded, whole, "2x{local}, stage {stage}: not stage 0's parameters bit for bit");
                // The reduce-scatter and the parameters' all-gather together send what the
                // all-reduce does (stage 0 also agrees its overlap plan in its first step); an
                // all-reduce and an all-gather would send half as much again.
                let ratio = bytes as f64 / whole_bytes as f64;
                eprintln!("2x{local}, stage {stage}: {bytes} bytes sent, stage 0 {whole_bytes}: {ratio:.4}");
                assert!(ratio <= 1.02, "2x{local}, stage {stage}: {bytes} bytes sent against stage 0's {whole_bytes}");
                assert!(ratio >= 0.98, "2x{local}, stage {stage}: {bytes} bytes sent against stage 0's {whole_bytes}");
            }
        }
    });
}

//! Every kind of variable under MultiWorkerMirrored with two real worker processes (two
//! replicas each) ends where one device does: a CNN, a model with heads unused in some steps
//! (or on some replicas), a model with frozen layers (by the builder and by name), and a model
//! with `SyncBatchNorm` (against candle-nn's BatchNorm on one device), each under SGD, SGD with
//! momentum and AdamW, on the same global batches (relative 1e-5), and the two workers end
//! bitwise equal.
//!
//! The workers are this test executable run again (the `worker_process` test, which does
//! nothing unless `STRATA_VARIABLE_KINDS_OUT` is set): each joins the job from `TF_CONFIG`,
//! trains every case and writes its parameters as safetensors. Every wait has a hard deadline.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use candle_nn::{Module, ModuleT, ParamsAdamW};
use strata::data::{Batch, TailPolicy};
use strata::optim::{FusedAdamW, FusedMomentum, FusedSgd, OptimizerMemory, ParamsMomentum};
use strata::prelude::*;
use strata::{Replicated, Scope};
use strata_integration_tests::{free_ports, wait, worker_tf_config, TOKEN};

/// A model of the matrix: built in a scope, a loss for step `step` on a shard.
trait Case: Sized + Send + Sync {
    const NAME: &'static str;
    /// Features per example.
    const DIM: usize;
    /// Variables frozen by name after building.
    const FREEZE: &'static [&'static str] = &[];
    fn build(sc: &Scope) -> candle_core::Result<Self>;
    fn loss(&self, step: usize, b: &Batch, dev: &Device) -> candle_core::Result<Tensor>;
}

/// conv2d(1 -> 4, 3x3) -> relu -> max-pool 2 -> linear(16 -> 3), on 6x6 images.
struct Cnn {
    conv: candle_nn::Conv2d,
    fc: candle_nn::Linear,
}

impl Case for Cnn {
    const NAME: &'static str = "cnn";
    const DIM: usize = 36;
    fn build(sc: &Scope) -> candle_core::Result<Self> {
        let vb = sc.var_builder();
        Ok(Self {
            conv: candle_nn::conv2d(1, 4, 3, Default::default(), vb.pp("conv"))?,
            fc: candle_nn::linear(16, 3, vb.pp("fc"))?,
        })
    }
    fn loss(&self, _: usize, b: &Batch, dev: &Device) -> candle_core::Result<Tensor> {
        let x = Tensor::from_slice(&b.features, (b.len(), 1, 6, 6), dev)?;
        let h = self.conv.forward(&x)?.relu()?.max_pool2d(2)?.flatten_from(1)?;
        candle_nn::loss::cross_entropy(&self.fc.forward(&h)?, &b.labels_tensor(dev).map_err(to_candle)?)
    }
}

/// A trunk and three heads: `a` in even steps, `b` in odd ones, and `rare` only for the rows
/// whose first feature exceeds 0.8 (some replicas, or none, have such rows in a step).
struct Heads {
    trunk: candle_nn::Linear,
    a: candle_nn::Linear,
    b: candle_nn::Linear,
    rare: candle_nn::Linear,
}

impl Case for Heads {
    const NAME: &'static str = "unused";
    const DIM: usize = 6;
    fn build(sc: &Scope) -> candle_core::Result<Self> {
        let vb = sc.var_builder();
        Ok(Self {
            trunk: candle_nn::linear(6, 8, vb.pp("trunk"))?,
            a: candle_nn::linear(8, 3, vb.pp("a"))?,
            b: candle_nn::linear(8, 3, vb.pp("b"))?,
            rare: candle_nn::linear(8, 3, vb.pp("rare"))?,
        })
    }
    fn loss(&self, step: usize, b: &Batch, dev: &Device) -> candle_core::Result<Tensor> {
        let x = Tensor::from_slice(&b.features, (b.len(), 6), dev)?;
        let y = Tensor::from_slice(&b.labels, b.len(), dev)?;
        let h = self.trunk.forward(&x)?.tanh()?;
        let head = if step.is_multiple_of(2) { &self.a } else { &self.b };
        let mut loss = candle_nn::loss::cross_entropy(&head.forward(&h)?, &y)?;
        let rare: Vec<u32> = (0..b.len() as u32).filter(|&i| b.features[i as usize * 6] > 0.8).collect();
        if !rare.is_empty() {
            let idx = Tensor::from_slice(&rare, rare.len(), dev)?;
            let extra = candle_nn::loss::cross_entropy(
                &self.rare.forward(&h.index_select(&idx, 0)?)?,
                &y.index_select(&idx, 0)?,
            )?;
            loss = (loss + (extra * (rare.len() as f64 / b.len() as f64))?)?;
        }
        Ok(loss)
    }
}

/// `base` frozen by the builder, `late` by name, `head` trained.
struct Frozen {
    base: candle_nn::Linear,
    late: candle_nn::Linear,
    head: candle_nn::Linear,
}

impl Case for Frozen {
    const NAME: &'static str = "frozen";
    const DIM: usize = 6;
    const FREEZE: &'static [&'static str] = &["late.*"];
    fn build(sc: &Scope) -> candle_core::Result<Self> {
        Ok(Self {
            base: candle_nn::linear(6, 8, sc.frozen_var_builder().pp("base"))?,
            late: candle_nn::linear(8, 8, sc.var_builder().pp("late"))?,
            head: candle_nn::linear(8, 3, sc.var_builder().pp("head"))?,
        })
    }
    fn loss(&self, _: usize, b: &Batch, dev: &Device) -> candle_core::Result<Tensor> {
        let x = Tensor::from_slice(&b.features, (b.len(), 6), dev)?;
        let h = self.late.forward(&self.base.forward(&x)?.tanh()?)?.tanh()?;
        candle_nn::loss::cross_entropy(&self.head.forward(&h)?, &Tensor::from_slice(&b.labels, b.len(), dev)?)
    }
}

/// conv2d (no bias) -> batch norm -> relu -> max-pool 2 -> linear, on 6x6 images: candle-nn's
/// BatchNorm (`SYNC = false`, the one-device reference) or Strata's `SyncBatchNorm`.
struct BnNet<const SYNC: bool> {
    conv: candle_nn::Conv2d,
    plain: Option<candle_nn::BatchNorm>,
    sync: Option<strata::layers::SyncBatchNorm>,
    fc: candle_nn::Linear,
}

impl<const SYNC: bool> Case for BnNet<SYNC> {
    const NAME: &'static str = "batchnorm";
    const DIM: usize = 36;
    fn build(sc: &Scope) -> candle_core::Result<Self> {
        let vb = sc.var_builder();
        let cfg = candle_nn::BatchNormConfig { momentum: 0.2, ..Default::default() };
        let (plain, sync) = if SYNC {
            (None, Some(strata::layers::sync_batch_norm(3, cfg, vb.pp("bn"))?))
        } else {
            (Some(candle_nn::batch_norm(3, cfg, vb.pp("bn"))?), None)
        };
        Ok(Self {
            conv: candle_nn::conv2d_no_bias(1, 3, 3, Default::default(), vb.pp("conv"))?,
            plain,
            sync,
            fc: candle_nn::linear(12, 3, vb.pp("fc"))?,
        })
    }
    fn loss(&self, _: usize, b: &Batch, dev: &Device) -> candle_core::Result<Tensor> {
        let x = Tensor::from_slice(&b.features, (b.len(), 1, 6, 6), dev)?;
        let h = self.conv.forward(&x)?;
        let h = match (&self.plain, &self.sync) {
            (Some(bn), _) => bn.forward_t(&h, true)?,
            (_, Some(bn)) => bn.forward_t(&h, true)?,
            _ => h,
        };
        let h = h.relu()?.max_pool2d(2)?.flatten_from(1)?;
        candle_nn::loss::cross_entropy(&self.fc.forward(&h)?, &Tensor::from_slice(&b.labels, b.len(), dev)?)
    }
}

fn to_candle(e: strata::CoreError) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// `n` examples of `dim` features in [-1, 1) and 3 classes, from a fixed seed (a 64-bit LCG).
fn data(n: usize, dim: usize, seed: u64) -> Batch {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut next = || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 40) as u32
    };
    let features = (0..n * dim).map(|_| next() as f32 / (1u32 << 24) as f32 * 2.0 - 1.0).collect();
    let labels = (0..n).map(|_| next() % 3).collect();
    Batch::new(features, labels, dim).unwrap()
}

const STEPS: usize = 6;
/// 30 examples over 4 replicas: shards of 8, 8, 7 and 7, weighted unevenly.
const BATCH: usize = 30;
const OPTIMIZERS: [&str; 3] = ["sgd", "momentum", "adamw"];

/// Trains `M` with the optimizer named `opt` under `s`; returns its values (state read as the
/// mean over replicas and workers).
fn train<M: Case>(s: &impl Strategy, opt: &str) -> Vec<(String, Tensor)> {
    let adamw = ParamsAdamW { lr: 0.01, weight_decay: 0.1, ..Default::default() };
    let momentum = ParamsMomentum { lr: 0.05, momentum: 0.9, nesterov: false };
    match opt {
        "sgd" => train_with::<M, FusedSgd>(s, 0.1),
        "momentum" => train_with::<M, FusedMomentum>(s, momentum),
        _ => train_with::<M, FusedAdamW>(s, adamw),
    }
}

fn train_with<M: Case, O: OptimizerMemory + Send>(s: &impl Strategy, cfg: O::Config) -> Vec<(String, Tensor)>
where
    O::Config: Clone,
{
    let mut model: Replicated<M> = s.scope(M::build).unwrap();
    if !M::FREEZE.is_empty() {
        model.freeze(M::FREEZE).unwrap();
    }
    let opt = model.optimizer::<O>(cfg).unwrap();
    let batches: Vec<Batch> = (0..STEPS).map(|k| data(BATCH, M::DIM, 100 + k as u64)).collect();
    for (step, db) in s.distribute_dataset(batches, TailPolicy::Split).enumerate() {
        s.run_batch(&db, |ctx, shard| {
            let loss = model.on(ctx)?.loss(step, &shard.batch, ctx.candle_device())?;
            ctx.backward_and_sync(&loss, &opt)
        })
        .unwrap();
    }
    model.sync_state().unwrap();
    model.values().unwrap()
}

/// Every case under `s`: `(case-optimizer, values)`; the batch-norm case trains `SyncBatchNorm`
/// when `sync`, candle-nn's BatchNorm otherwise.
fn all_cases(s: &impl Strategy, sync: bool) -> Vec<(String, Vec<(String, Tensor)>)> {
    let mut out = Vec::new();
    for opt in OPTIMIZERS {
        out.push((format!("{}-{opt}", Cnn::NAME), train::<Cnn>(s, opt)));
        out.push((format!("{}-{opt}", Heads::NAME), train::<Heads>(s, opt)));
        out.push((format!("{}-{opt}", Frozen::NAME), train::<Frozen>(s, opt)));
        let bn = if sync { train::<BnNet<true>>(s, opt) } else { train::<BnNet<false>>(s, opt) };
        out.push((format!("{}-{opt}", BnNet::<true>::NAME), bn));
    }
    out
}

/// A worker process of the job: does nothing unless started by `two_processes_end_as_one_device`.
#[test]
fn worker_process() {
    let Some(out) = std::env::var_os("STRATA_VARIABLE_KINDS_OUT") else { return };
    let out = PathBuf::from(out);
    let resolver = strata::cluster::TFConfigClusterResolver::from_env().unwrap();
    let mut options = MultiWorkerOptions::new(ClusterToken::new(TOKEN).unwrap()).unwrap();
    options.local_devices = strata::device::logical_cpus(2).unwrap();
    let s = MultiWorkerMirroredStrategy::from_resolver(&resolver, options).unwrap();
    let index = s.worker_index();
    for (name, values) in all_cases(&s, true) {
        let tensors: HashMap<String, Tensor> = values.into_iter().collect();
        candle_core::safetensors::save(&tensors, out.join(format!("{name}-{index}.safetensors"))).unwrap();
    }
    s.finish().unwrap();
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn load(path: &Path) -> HashMap<String, Vec<f32>> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap().into_iter().map(|(k, v)| (k, flat(&v))).collect()
}

#[test]
fn two_processes_end_as_one_device() {
    let dir = tempfile::tempdir().unwrap();
    let ports = free_ports(2);
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|i| {
            Command::new(&exe)
                .args(["--exact", "worker_process", "--nocapture", "--test-threads", "1"])
                .env("STRATA_VARIABLE_KINDS_OUT", dir.path())
                .env("TF_CONFIG", worker_tf_config(&ports, i))
                .env("CANDLE_NUM_THREADS", "1")
                .env("RAYON_NUM_THREADS", "1")
                .env("STRATA_LOG", "warn")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // One device's references meanwhile, in this process.
    let want = all_cases(&OneDeviceStrategy::cpu().unwrap(), false);
    let deadline = Instant::now() + Duration::from_secs(300);
    for (i, c) in children.into_iter().enumerate() {
        let o = wait(c, deadline);
        assert!(
            o.status.success(),
            "worker {i} failed: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    assert_eq!(want.len(), 12);
    for (name, values) in want {
        let w0 = load(&dir.path().join(format!("{name}-0.safetensors")));
        let w1 = load(&dir.path().join(format!("{name}-1.safetensors")));
        assert_eq!(w0, w1, "{name}: the workers' parameters differ");
        assert_eq!(w0.len(), values.len(), "{name}");
        let mut moved = false;
        for (var, t) in values {
            let (want, got) = (flat(&t), &w0[&var]);
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
            let worst = want.iter().zip(got).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
            assert!(worst <= 1e-5 * scale, "{name} {var}: relative difference {} from one device", worst / scale);
            moved |= var.starts_with("bn.running_mean") && want.iter().any(|&v| v != 0.0);
        }
        if name.starts_with("batchnorm") {
            assert!(moved, "{name}: the running statistics must move");
        }
    }
}

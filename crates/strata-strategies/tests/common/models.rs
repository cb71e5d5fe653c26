//! Small models whose variables are of every kind, for the tests of what strategies do with
//! them: a CNN, a model with heads unused in some steps (or on some replicas), a model with
//! frozen layers, a model whose variables' gradients are one tensor.

use candle_core::{Device, Tensor};
use candle_nn::Module;
use rand::{Rng, SeedableRng};
use strata_core::data::Batch;
use strata_core::Scope;

/// A model the tests train: built in a scope, a loss for step `step` on a shard.
pub trait TestModel: Sized + Send + Sync {
    /// Features per example.
    const DIM: usize;
    fn build(sc: &Scope) -> candle_core::Result<Self>;
    fn loss(&self, step: usize, b: &Batch, dev: &Device) -> candle_core::Result<Tensor>;
}

/// conv2d(1 -> 4, 3x3) -> relu -> max-pool 2 -> linear(16 -> 3), on 6x6 images.
pub struct Cnn {
    conv: candle_nn::Conv2d,
    fc: candle_nn::Linear,
}

impl TestModel for Cnn {
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
        let y = Tensor::from_slice(&b.labels, b.len(), dev)?;
        candle_nn::loss::cross_entropy(&self.fc.forward(&h)?, &y)
    }
}

/// A trunk and three heads: `a` in even steps, `b` in odd steps (a head not used in this
/// phase), and `rare` only for the examples whose first feature exceeds 0.8, so that in some
/// steps only some replicas compute its gradient, and in some none.
pub struct Heads {
    trunk: candle_nn::Linear,
    a: candle_nn::Linear,
    b: candle_nn::Linear,
    rare: candle_nn::Linear,
}

impl TestModel for Heads {
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
            // The summed cross-entropy of the rare rows over the shard's size: the global
            // batch's loss is then the weighted sum of the replicas' losses, as for `a` and `b`.
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

/// A frozen first layer (through the frozen builder) and a trainable second one; a third
/// layer frozen by name with [`Replicated::freeze`] (`late.*`).
pub struct Frozen {
    base: candle_nn::Linear,
    late: candle_nn::Linear,
    head: candle_nn::Linear,
}

impl TestModel for Frozen {
    const DIM: usize = 6;
    fn build(sc: &Scope) -> candle_core::Result<Self> {
        Ok(Self {
            base: candle_nn::linear(6, 8, sc.frozen_var_builder().pp("base"))?,
            late: candle_nn::linear(8, 8, sc.var_builder().pp("late"))?,
            head: candle_nn::linear(8, 3, sc.var_builder().pp("head"))?,
        })
    }
    fn loss(&self, _: usize, b: &Batch, dev: &Device) -> candle_core::Result<Tensor> {
        let x = Tensor::from_slice(&b.features, (b.len(), 6), dev)?;
        let y = Tensor::from_slice(&b.labels, b.len(), dev)?;
        let h = self.late.forward(&self.base.forward(&x)?.tanh()?)?.tanh()?;
        candle_nn::loss::cross_entropy(&self.head.forward(&h)?, &y)
    }
}

/// Variables used only through sums and reshapes: `x (w1 + w2 + reshape(w3)) + (b1 + b2) + t`.
/// The backward pass hands `w1`, `w2` and `reshape(w3)` one gradient tensor (an add passes it
/// through), `b1` and `b2` another, and `t` the loss's own seed; a strategy that reduced those
/// gradients in place without their having allocations of their own would reduce them twice.
pub struct Tied {
    w1: Tensor,
    w2: Tensor,
    w3: Tensor,
    b1: Tensor,
    b2: Tensor,
    t: Tensor,
}

impl TestModel for Tied {
    const DIM: usize = 6;
    fn build(sc: &Scope) -> candle_core::Result<Self> {
        let vb = sc.var_builder();
        let init = candle_nn::init::Init::Uniform { lo: -0.5, up: 0.5 };
        Ok(Self {
            w1: vb.get_with_hints((6, 3), "w1", init)?,
            w2: vb.get_with_hints((6, 3), "w2", init)?,
            w3: vb.get_with_hints(18, "w3", init)?,
            b1: vb.get_with_hints(3, "b1", init)?,
            b2: vb.get_with_hints(3, "b2", init)?,
            t: vb.get_with_hints(1, "t", init)?,
        })
    }
    fn loss(&self, _: usize, b: &Batch, dev: &Device) -> candle_core::Result<Tensor> {
        let x = Tensor::from_slice(&b.features, (b.len(), 6), dev)?;
        let y = Tensor::from_slice(&b.labels, b.len(), dev)?;
        let w = ((&self.w1 + &self.w2)? + self.w3.reshape((6, 3))?)?;
        let logits = x.matmul(&w)?.broadcast_add(&(&self.b1 + &self.b2)?)?;
        let ce = candle_nn::loss::cross_entropy(&logits, &y)?.reshape(1)?;
        // `t` adds a constant to the loss: its gradient is the loss's seed, 1 on each replica
        // weighted by its share, and AdamW moves it by the same step on every strategy.
        (ce + &self.t)?.squeeze(0)
    }
}

/// `n` examples of `dim` features in [-1, 1) and 3 classes.
pub fn data(n: usize, dim: usize, seed: u64) -> Batch {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let features = (0..n * dim).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect();
    let labels = (0..n).map(|_| rng.random_range(0..3u32)).collect();
    Batch::new(features, labels, dim).unwrap()
}

/// conv2d(1 -> 3, 3x3, no bias: the batch norm's mean would cancel it, leaving its gradient
/// rounding noise that AdamW would amplify) -> batch norm -> relu -> max-pool 2 ->
/// linear(12 -> 3), on 6x6 images; the batch norm is candle-nn's (`SYNC = false`) or Strata's
/// `SyncBatchNorm` (`true`), with the same variable names.
pub struct BnNet<const SYNC: bool> {
    conv: candle_nn::Conv2d,
    plain: Option<candle_nn::BatchNorm>,
    sync: Option<strata_core::layers::SyncBatchNorm>,
    fc: candle_nn::Linear,
}

impl<const SYNC: bool> TestModel for BnNet<SYNC> {
    const DIM: usize = 36;
    fn build(sc: &Scope) -> candle_core::Result<Self> {
        let vb = sc.var_builder();
        let cfg = candle_nn::BatchNormConfig { momentum: 0.2, ..Default::default() };
        let (plain, sync) = if SYNC {
            (None, Some(strata_core::layers::sync_batch_norm(3, cfg, vb.pp("bn"))?))
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
        use candle_nn::ModuleT;
        let x = Tensor::from_slice(&b.features, (b.len(), 1, 6, 6), dev)?;
        let h = self.conv.forward(&x)?;
        let h = match (&self.plain, &self.sync) {
            (Some(bn), _) => bn.forward_t(&h, true)?,
            (_, Some(bn)) => bn.forward_t(&h, true)?,
            _ => h,
        };
        let h = h.relu()?.max_pool2d(2)?.flatten_from(1)?;
        let y = Tensor::from_slice(&b.labels, b.len(), dev)?;
        candle_nn::loss::cross_entropy(&self.fc.forward(&h)?, &y)
    }
}

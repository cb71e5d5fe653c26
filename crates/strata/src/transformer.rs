//! A decoder-only character language model (GPT-style): token and learned position
//! embeddings, blocks of (layer norm, causal multi-head self-attention, residual, layer norm,
//! MLP 4x with GELU, residual), a final layer norm and a linear head to the vocabulary. Plain
//! candle code built from the scope's `VarBuilder`, unchanged under every strategy:
//!
//! ```no_run
//! use strata::prelude::*;
//! use strata::transformer::{CharTransformer, TransformerConfig};
//!
//! let strategy = MirroredStrategy::logical_cpus(2)?;
//! let config = TransformerConfig::default();
//! let model = strategy.scope(|s| CharTransformer::new(config, s.var_builder()))?;
//! # Ok::<(), strata::Error>(())
//! ```
//!
//! Batches are `(inputs, targets)` of u32 `(N, T)` character ids ([`crate::shakespeare`]); the
//! loss is the mean cross-entropy over every position, in nats per character.
//!
//! Only operations with a backward pass are used: candle-nn's fused `layer_norm` and
//! `softmax_last_dim` are forward-only (their gradients would silently be missing). Layer
//! norm, GELU and the causal attention are [`crate::fused`]'s kernels, one pass each way on the
//! CPU (candle's composed operations on other devices; the attention's heads are the columns
//! of the `(N * T, width)` projections, read in place). Activations stay `(N * T, width)`
//! matrices, so every dense layer is one matrix product with a contiguous gradient ([`Dense`]
//! keeps its weight `(in, out)`).

use candle_core::{DType, Device, Tensor};
use candle_nn::{Init, VarBuilder};
use rand::SeedableRng;
use strata_core::{cast_like, Precision};

use crate::model::Dense;
use crate::trainer::Task;

/// The most parameters a transformer built from a command line may have (2^26, as the MLP's).
pub const MAX_PARAMETERS: usize = 1 << 26;

/// The shape of a [`CharTransformer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TransformerConfig {
    /// Distinct tokens (65 characters for Tiny Shakespeare).
    pub vocab: usize,
    /// The embedding width.
    pub width: usize,
    /// Blocks.
    pub layers: usize,
    /// Attention heads (they divide the width).
    pub heads: usize,
    /// The longest sequence (learned positions).
    pub context: usize,
}

impl Default for TransformerConfig {
    /// [`TransformerConfig::DEFAULT`].
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl TransformerConfig {
    /// 4 layers, width 128, 4 heads, context 64, Tiny Shakespeare's 65 characters: 0.82M
    /// parameters.
    pub const DEFAULT: Self = Self { vocab: 65, width: 128, layers: 4, heads: 4, context: 64 };

    /// The number of parameters (816,705 for the default).
    pub fn parameter_count(&self) -> usize {
        let (v, c, l, t) = (self.vocab, self.width, self.layers, self.context);
        let block = 2 * (2 * c) + c * 3 * c + (c * c + c) + (c * 4 * c + 4 * c) + (4 * c * c + c);
        v * c + t * c + l * block + 2 * c + (c * v + v)
    }

    /// Checks the sizes before anything is allocated; one line saying what to change.
    pub fn check(&self) -> crate::Result<()> {
        let usage = |m: String| Err(crate::Error::Usage(m));
        if self.vocab == 0 || self.width == 0 || self.layers == 0 || self.heads == 0 || self.context == 0 {
            return usage(format!(
                "a transformer needs a vocabulary, width, layers, heads and context of at least 1, not {self:?}"
            ));
        }
        if !self.width.is_multiple_of(self.heads) {
            return usage(format!(
                "a width of {} does not split into {} heads; use a width that is a multiple of the heads",
                self.width, self.heads
            ));
        }
        let fits = [self.vocab, self.width, self.layers, self.context].iter().all(|&n| n <= 1 << 16);
        if !fits || self.parameter_count() > MAX_PARAMETERS {
            return usage(format!(
                "a transformer of {self:?} has more than {MAX_PARAMETERS} parameters, the limit; use a smaller width or fewer layers"
            ));
        }
        Ok(())
    }
}

/// Layer norm over the last axis with a learned scale (`weight`, from 1) and shift (`bias`, from 0).
#[derive(Clone, Debug)]
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
}

impl LayerNorm {
    fn new(width: usize, vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Self {
            weight: vb.get_with_hints(width, "weight", Init::Const(1.0))?,
            bias: vb.get_with_hints(width, "bias", Init::Const(0.0))?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        crate::fused::layer_norm(x, &cast_like(&self.weight, x)?, &cast_like(&self.bias, x)?, 1e-5)
    }
}

#[derive(Clone, Debug)]
struct Block {
    ln1: LayerNorm,
    qkv: Dense,
    proj: Dense,
    ln2: LayerNorm,
    fc: Dense,
    out: Dense,
}

impl Block {
    fn new(c: &TransformerConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let w = c.width;
        // GPT-2's initialisation: 0.02, the projections into the residual stream scaled down
        // by the square root of twice the depth.
        let residual = 0.02 / ((2 * c.layers) as f64).sqrt();
        Ok(Self {
            ln1: LayerNorm::new(w, vb.pp("ln1"))?,
            // No bias: the keys' would get no gradient (the softmax ignores a shift shared by
            // every key), only rounding noise that Adam would turn into full-size steps.
            qkv: Dense::no_bias(w, 3 * w, 0.02, vb.pp("attn.qkv"))?,
            proj: Dense::with_stdev(w, w, residual, vb.pp("attn.proj"))?,
            ln2: LayerNorm::new(w, vb.pp("ln2"))?,
            fc: Dense::with_stdev(w, 4 * w, 0.02, vb.pp("mlp.fc"))?,
            out: Dense::with_stdev(4 * w, w, residual, vb.pp("mlp.proj"))?,
        })
    }

    /// `x`: `(n * t, width)`.
    fn forward(&self, x: &Tensor, n: usize, t: usize, heads: usize) -> candle_core::Result<Tensor> {
        let w = x.dim(1)?;
        let hd = w / heads;
        let h = self.ln1.forward(x)?;
        // q, k and v from one product with the whole `(width, 3 width)` weight, the queries'
        // 1 / sqrt(hd) scaling their `(width, width)` block of it rather than the `(n t, width)`
        // queries; the fused attention reads each head's columns of the three thirds in place,
        // and its backward pass gives the one `(n t, 3 width)` gradient
        // (`fused::causal_attention_packed`).
        // The scaling is one product by a `(3 width)` vector of columns' factors (1 for the
        // keys' and values'): a narrow, a scaling of its strided view and a concatenation took
        // three passes each way, the backward pass' narrow padding its gradient with zeros.
        let qkv = cast_like(self.qkv.weight(), &h)?;
        let scale = (1.0 / (hd as f64).sqrt()) as f32;
        let columns: Vec<f32> = (0..3 * w).map(|c| if c < w { scale } else { 1.0 }).collect();
        let columns = cast_like(&Tensor::from_vec(columns, 3 * w, h.device())?, &h)?;
        let qkv = h.matmul(&qkv.broadcast_mul(&columns)?)?.reshape((n, t, 3 * w))?;
        let y = crate::fused::causal_attention_packed(&qkv, heads)?.reshape((n * t, w))?;
        let x = self.proj.forward_residual(&y, x)?;
        let h = self.fc.forward_gelu(&self.ln2.forward(&x)?)?;
        self.out.forward_residual(&h, &x)
    }
}

/// The character language model; see the module docs. Variables: `tok.weight`, `pos.weight`,
/// `block{i}.attn.qkv.weight`, `block{i}.{ln1,attn.proj,ln2,mlp.fc,mlp.proj}.{weight,bias}`, `ln_f.{weight,bias}`,
/// `head.{weight,bias}`.
#[derive(Debug)]
pub struct CharTransformer {
    config: TransformerConfig,
    tok: Tensor,
    pos: Tensor,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    head: Dense,
    device: Device,
    recompute: bool,
    precision: Precision,
}

impl CharTransformer {
    /// The model of `config`, its variables made by `vb` (the scope's `VarBuilder`).
    pub fn new(config: TransformerConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let c = config;
        let embed = Init::Randn { mean: 0.0, stdev: 0.02 };
        Ok(Self {
            tok: vb.get_with_hints((c.vocab, c.width), "tok.weight", embed)?,
            pos: vb.get_with_hints((c.context, c.width), "pos.weight", embed)?,
            blocks: (0..c.layers).map(|i| Block::new(&c, vb.pp(format!("block{i}")))).collect::<Result<_, _>>()?,
            ln_f: LayerNorm::new(c.width, vb.pp("ln_f"))?,
            head: Dense::with_stdev(c.width, c.vocab, 0.02, vb.pp("head"))?,
            device: vb.device().clone(),
            config,
            recompute: false,
            precision: Precision::F32,
        })
    }

    /// The model recomputing each block's inner activations in the backward pass instead of
    /// keeping them ([`strata_core::recompute`]; `strata train --recompute`): each block keeps
    /// only its input, for the same gradients.
    pub fn with_recompute(mut self, recompute: bool) -> Self {
        self.recompute = recompute;
        self
    }

    /// The model computing at `precision` (`strata train --precision`): the embeddings cast to
    /// its compute type, every block, the final norm and the head computed in it, the logits
    /// back in f32; the variables stay f32.
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// Its shape.
    pub fn config(&self) -> TransformerConfig {
        self.config
    }

    /// Logits `(n, t, vocab)` of the next character at every position of `ids` (u32 `(n, t)`,
    /// `t` at most the context).
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (n, t) = ids.dims2()?;
        if t > self.config.context {
            candle_core::bail!("sequences of {t} tokens are longer than the context of {}", self.config.context);
        }
        let w = self.config.width;
        let x = self.precision.cast(&self.tok.index_select(&ids.flatten_all()?, 0)?.reshape((n, t, w))?)?;
        let mut x = x.broadcast_add(&cast_like(&self.pos.narrow(0, 0, t)?, &x)?)?.reshape((n * t, w))?;
        let heads = self.config.heads;
        for b in &self.blocks {
            x = if self.recompute {
                let b = b.clone();
                strata_core::recompute(&[x], move |xs| b.forward(&xs[0], n, t, heads))?
            } else {
                b.forward(&x, n, t, heads)?
            };
        }
        self.head.forward(&self.ln_f.forward(&x)?)?.reshape((n, t, self.config.vocab))?.to_dtype(DType::F32)
    }

    /// The mean cross-entropy of the next character over every position of `(ids, targets)`
    /// (both u32 `(n, t)`), in nats per character.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        let logits = self.forward(ids)?;
        crate::fused::cross_entropy(&logits.flatten_to(1)?, &targets.flatten_all()?)
    }

    /// `count` tokens sampled after `prompt` (at least one token), each from the softmax of the
    /// last position's logits divided by `temperature` (seeded: the same seed gives the same
    /// text), the input cut to the last `context` tokens.
    pub fn generate(&self, prompt: &[u32], count: usize, temperature: f64, seed: u64) -> candle_core::Result<Vec<u32>> {
        if prompt.is_empty() || !(temperature.is_finite() && temperature > 0.0) {
            candle_core::bail!("sampling needs a prompt of at least one token and a positive temperature");
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut ids = prompt.to_vec();
        for _ in 0..count {
            let start = ids.len().saturating_sub(self.config.context);
            let window = Tensor::new(&ids[start..], &self.device)?.unsqueeze(0)?;
            let logits = self.forward(&window)?.get(0)?.get(ids.len() - start - 1)?;
            let p = crate::fused::softmax_composed(&(logits.to_dtype(DType::F32)? / temperature)?)?.to_vec1::<f32>()?;
            let r: f32 = rand::Rng::random(&mut rng);
            let mut acc = 0f32;
            let next = p.iter().position(|&x| {
                acc += x;
                acc > r
            });
            ids.push(next.unwrap_or(p.len() - 1) as u32);
        }
        Ok(ids[prompt.len()..].to_vec())
    }
}

/// The task of [`crate::trainer::Trainer::fit`] for the transformer on `(inputs, targets)`
/// batches: its loss, and the loss (nats per character) as the evaluation's metric.
pub fn task<'a>() -> Task<'a, CharTransformer, (Tensor, Tensor)> {
    Task::new(|m: &CharTransformer, ctx, b: &(Tensor, Tensor)| {
        use strata_core::data::BatchData;
        let (x, y) = b.to_device(ctx.candle_device())?;
        Ok(m.loss(&x, &y)?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_has_0_82m_parameters_and_bad_shapes_are_refused() {
        assert_eq!(TransformerConfig::default().parameter_count(), 816_705);
        let vm = candle_nn::VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
        CharTransformer::new(TransformerConfig::default(), vb).unwrap();
        let n: usize = vm.all_vars().iter().map(|v| v.elem_count()).sum();
        assert_eq!(n, 816_705);
        let e = TransformerConfig { heads: 3, ..Default::default() }.check().unwrap_err().to_string();
        assert!(e.contains("does not split into 3 heads"), "{e}");
        assert!(TransformerConfig { layers: 0, ..Default::default() }.check().is_err());
    }

    #[test]
    fn the_attention_is_causal_and_every_variable_gets_a_gradient() {
        let vm = candle_nn::VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
        let c = TransformerConfig { vocab: 11, width: 16, layers: 2, heads: 2, context: 8 };
        let m = CharTransformer::new(c, vb).unwrap();
        let a = Tensor::new(&[[1u32, 2, 3, 4, 5, 6]], &Device::Cpu).unwrap();
        let b = Tensor::new(&[[1u32, 2, 3, 9, 9, 9]], &Device::Cpu).unwrap();
        let (la, lb) = (m.forward(&a).unwrap(), m.forward(&b).unwrap());
        let prefix = |l: &Tensor| l.narrow(1, 0, 3).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(prefix(&la), prefix(&lb), "a position sees no later token");
        assert_ne!(
            la.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            lb.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
        let loss = m.loss(&a, &b).unwrap();
        let grads = loss.backward().unwrap();
        for v in vm.all_vars() {
            let g = grads.get(v.as_tensor()).expect("every variable has a gradient");
            let norm = g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(norm > 0.0 && norm.is_finite(), "a gradient of norm {norm}");
        }
        let text = m.generate(&[1, 2], 20, 1.0, 3).unwrap();
        assert_eq!(text.len(), 20);
        assert!(text.iter().all(|&i| i < 11));
        assert_eq!(text, m.generate(&[1, 2], 20, 1.0, 3).unwrap());
    }
}

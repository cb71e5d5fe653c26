//! The MLP the main job trains: plain candle-nn code, unchanged under every strategy.

use candle_core::{Tensor, D};
use candle_nn::{Init, VarBuilder};

/// A model that maps a batch of features to class logits.
pub trait Classifier: Send + Sync {
    /// Logits of shape `(rows, classes)`.
    fn logits(&self, x: &Tensor) -> candle_core::Result<Tensor>;

    /// The mean cross-entropy loss on `(x, y)`.
    fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        candle_nn::loss::cross_entropy(&self.logits(x)?, y)
    }

    /// The number of rows of `(x, y)` classified correctly.
    fn correct(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<usize> {
        let pred = self.logits(x)?.argmax(D::Minus1)?;
        Ok(pred.eq(y)?.to_dtype(candle_core::DType::U32)?.sum_all()?.to_scalar::<u32>()? as usize)
    }
}

/// A dense layer `y = x W + b` with `W` stored `(in, out)`, as TensorFlow's `Dense` keeps it.
///
/// candle-nn's `Linear` stores `(out, in)` and multiplies by the transpose; its weight gradient
/// then arrives as a transposed view that candle's backward accumulates with a strided pass, a
/// large part of a step on the 4.3M-parameter MLP. Storing `(in, out)` makes every gradient
/// contiguous. The initialisation is candle-nn's: Kaiming normal over the fan-in for the
/// weight, uniform in `±1/sqrt(in)` for the bias.
#[derive(Debug)]
pub struct Dense {
    weight: Tensor,
    bias: Tensor,
}

impl Dense {
    /// A layer of `input -> output` whose variables are `weight` and `bias` under `vb`.
    pub fn new(input: usize, output: usize, vb: VarBuilder) -> candle_core::Result<Self> {
        let std = 2f64.sqrt() / (input as f64).sqrt();
        let weight = vb.get_with_hints((input, output), "weight", Init::Randn { mean: 0.0, stdev: std })?;
        let bound = 1.0 / (input as f64).sqrt();
        let bias = vb.get_with_hints(output, "bias", Init::Uniform { lo: -bound, up: bound })?;
        Ok(Self { weight, bias })
    }

    /// `x W + b`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.matmul(&self.weight)?.broadcast_add(&self.bias)
    }
}

/// A multi-layer perceptron of [`Dense`] layers with ReLU between them.
#[derive(Debug)]
pub struct Mlp {
    layers: Vec<Dense>,
}

impl Mlp {
    /// `input -> hidden[0] -> ... -> classes`; layer `i`'s variables are `layer{i}.weight` and
    /// `layer{i}.bias`.
    pub fn new(vb: VarBuilder, input: usize, hidden: &[usize], classes: usize) -> candle_core::Result<Self> {
        let dims: Vec<usize> = std::iter::once(input).chain(hidden.iter().copied()).chain([classes]).collect();
        let layers = dims
            .windows(2)
            .enumerate()
            .map(|(i, w)| Dense::new(w[0], w[1], vb.pp(format!("layer{i}"))))
            .collect::<candle_core::Result<_>>()?;
        Ok(Self { layers })
    }

    /// The number of parameters of an MLP of these sizes.
    pub fn parameter_count(input: usize, hidden: &[usize], classes: usize) -> usize {
        let dims: Vec<usize> = std::iter::once(input).chain(hidden.iter().copied()).chain([classes]).collect();
        dims.windows(2).map(|w| w[0] * w[1] + w[1]).sum()
    }
}

impl Classifier for Mlp {
    fn logits(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for (i, l) in self.layers.iter().enumerate() {
            h = l.forward(&h)?;
            if i + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_of_the_benchmark_models() {
        assert_eq!(Mlp::parameter_count(64, &[256, 256], 10), 85_002);
        assert_eq!(Mlp::parameter_count(64, &[2048, 2048], 10), 4_349_962);
    }
}

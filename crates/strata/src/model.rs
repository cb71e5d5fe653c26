//! The MLP the main job trains: plain candle-nn code, unchanged under every strategy.

use candle_core::{Tensor, D};
use candle_nn::{Init, VarBuilder};
use strata_core::{cast_like, Precision};

/// The most hidden layers of an MLP built from a command line or a step's arguments.
pub const MAX_HIDDEN_LAYERS: usize = 64;
/// The widest hidden layer: 65,536 units.
pub const MAX_LAYER_UNITS: usize = 1 << 16;
/// The most parameters of such an MLP: 2^26, 256 MiB of f32 per copy (the benchmarks' large
/// MLP has 4.3 million); a replica holds its copy, its gradients and its optimizer's state.
pub const MAX_PARAMETERS: usize = 1 << 26;

/// Checks the sizes of an MLP `input -> hidden... -> classes` against [`MAX_HIDDEN_LAYERS`],
/// [`MAX_LAYER_UNITS`] and [`MAX_PARAMETERS`] before anything is allocated; returns its number
/// of parameters.
pub fn check_mlp(input: usize, hidden: &[usize], classes: usize) -> crate::Result<usize> {
    let usage = |m: String| crate::Error::Usage(m);
    if hidden.is_empty() || hidden.contains(&0) {
        return Err(usage("hidden layer sizes of at least 1 are needed, e.g. 256,256".into()));
    }
    if hidden.len() > MAX_HIDDEN_LAYERS {
        return Err(usage(format!("{} hidden layers, over the limit of {MAX_HIDDEN_LAYERS}", hidden.len())));
    }
    if let Some(&wide) = hidden.iter().find(|&&h| h > MAX_LAYER_UNITS) {
        return Err(usage(format!("a hidden layer of {wide} units, over the limit of {MAX_LAYER_UNITS}")));
    }
    let dims: Vec<usize> = std::iter::once(input).chain(hidden.iter().copied()).chain([classes]).collect();
    let count = dims
        .windows(2)
        .try_fold(0usize, |n, w| w[0].checked_mul(w[1])?.checked_add(w[1])?.checked_add(n))
        .filter(|&n| n <= MAX_PARAMETERS);
    count.ok_or_else(|| {
        usage(format!(
            "hidden layers {hidden:?} make an MLP of more than {MAX_PARAMETERS} parameters, the limit; use smaller layers"
        ))
    })
}

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
/// weight, uniform in `±1/sqrt(in)` for the bias. The layer computes in its input's type: with
/// a 16-bit input (mixed precision, [`Precision`]) its f32 variables are cast to it
/// ([`cast_like`]), so their gradients still arrive in f32.
#[derive(Clone, Debug)]
pub struct Dense {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Dense {
    /// A layer of `input -> output` whose variables are `weight` and `bias` under `vb`.
    pub fn new(input: usize, output: usize, vb: VarBuilder) -> candle_core::Result<Self> {
        let std = 2f64.sqrt() / (input as f64).sqrt();
        let weight = vb.get_with_hints((input, output), "weight", Init::Randn { mean: 0.0, stdev: std })?;
        let bound = 1.0 / (input as f64).sqrt();
        let bias = vb.get_with_hints(output, "bias", Init::Uniform { lo: -bound, up: bound })?;
        Ok(Self { weight, bias: Some(bias) })
    }

    /// A layer of `input -> output` whose weight is drawn from a normal of mean 0 and `stdev`
    /// and whose bias starts at zero (GPT-2's initialisation, which the transformer uses).
    pub fn with_stdev(input: usize, output: usize, stdev: f64, vb: VarBuilder) -> candle_core::Result<Self> {
        let weight = vb.get_with_hints((input, output), "weight", Init::Randn { mean: 0.0, stdev })?;
        let bias = vb.get_with_hints(output, "bias", Init::Const(0.0))?;
        Ok(Self { weight, bias: Some(bias) })
    }

    /// [`Dense::with_stdev`] without a bias: `x W`, whose only variable is `weight`.
    pub fn no_bias(input: usize, output: usize, stdev: f64, vb: VarBuilder) -> candle_core::Result<Self> {
        let weight = vb.get_with_hints((input, output), "weight", Init::Randn { mean: 0.0, stdev })?;
        Ok(Self { weight, bias: None })
    }

    /// The weight, `(input, output)`.
    pub(crate) fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// `gelu(x W + b)` (tanh approximation), the bias and the activation in one fused pass
    /// ([`crate::fused::bias_gelu`]).
    pub fn forward_gelu(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = x.matmul(&cast_like(&self.weight, x)?)?;
        match &self.bias {
            Some(b) => crate::fused::bias_gelu(&y, &cast_like(b, x)?),
            None => crate::fused::gelu(&y),
        }
    }

    /// `relu(x W + b)`, the bias and the activation in one fused pass
    /// ([`crate::fused::bias_relu`], the same bits as `forward` then `relu`).
    pub fn forward_relu(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = x.matmul(&cast_like(&self.weight, x)?)?;
        match &self.bias {
            Some(b) => crate::fused::bias_relu(&y, &cast_like(b, x)?),
            None => y.relu(),
        }
    }

    /// `x W + b`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = x.matmul(&cast_like(&self.weight, x)?)?;
        match &self.bias {
            Some(b) => y.broadcast_add(&cast_like(b, x)?),
            None => Ok(y),
        }
    }

    /// `residual + (x W + b)`: a residual connection around the layer, the bias and the
    /// residual added in one pass ([`crate::fused::residual_bias`]), with the same bits as
    /// `residual + self.forward(x)`.
    pub fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> candle_core::Result<Tensor> {
        let y = x.matmul(&cast_like(&self.weight, x)?)?;
        match &self.bias {
            Some(b) => crate::fused::residual_bias(residual, &y, &cast_like(b, x)?),
            None => residual + y,
        }
    }
}

/// A multi-layer perceptron of [`Dense`] layers with ReLU between them.
#[derive(Debug)]
pub struct Mlp {
    layers: Vec<Dense>,
    recompute: bool,
    precision: Precision,
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
        Ok(Self { layers, recompute: false, precision: Precision::F32 })
    }

    /// The model recomputing each hidden layer's `relu(x W + b)` in the backward pass instead
    /// of keeping its product ([`strata_core::recompute`]; `strata train --recompute`), for
    /// the same gradients.
    pub fn with_recompute(mut self, recompute: bool) -> Self {
        self.recompute = recompute;
        self
    }

    /// The model computing at `precision` (`strata train --precision`): the input cast to its
    /// compute type, every layer computed in it, the logits back in f32 (for the loss); the
    /// variables stay f32.
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// The number of parameters of an MLP of these sizes.
    pub fn parameter_count(input: usize, hidden: &[usize], classes: usize) -> usize {
        let dims: Vec<usize> = std::iter::once(input).chain(hidden.iter().copied()).chain([classes]).collect();
        dims.windows(2).map(|w| w[0] * w[1] + w[1]).sum()
    }
}

impl Classifier for Mlp {
    fn logits(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = self.precision.cast(x)?;
        for (i, l) in self.layers.iter().enumerate() {
            h = if i + 1 == self.layers.len() {
                l.forward(&h)?
            } else if self.recompute {
                let l = l.clone();
                strata_core::recompute(&[h], move |xs| l.forward_relu(&xs[0]))?
            } else {
                l.forward_relu(&h)?
            };
        }
        h.to_dtype(candle_core::DType::F32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_of_the_benchmark_models() {
        assert_eq!(Mlp::parameter_count(64, &[256, 256], 10), 85_002);
        assert_eq!(Mlp::parameter_count(64, &[2048, 2048], 10), 4_349_962);
        assert_eq!(check_mlp(64, &[2048, 2048], 10).unwrap(), 4_349_962);
    }

    #[test]
    fn absurd_sizes_are_refused_before_anything_is_allocated() {
        let e = check_mlp(64, &[1 << 40], 10).unwrap_err().to_string();
        assert_eq!(e, "a hidden layer of 1099511627776 units, over the limit of 65536");
        let e = check_mlp(64, &[65_536, 65_536], 10).unwrap_err().to_string();
        assert!(e.contains("more than 67108864 parameters, the limit"), "{e}");
        let e = check_mlp(64, &[8; 65], 10).unwrap_err().to_string();
        assert_eq!(e, "65 hidden layers, over the limit of 64");
        assert!(check_mlp(64, &[], 10).is_err() && check_mlp(64, &[3, 0], 10).is_err());
        assert!(check_mlp(usize::MAX, &[2], 10).is_err(), "overflow is refused, not wrapped");
    }
}

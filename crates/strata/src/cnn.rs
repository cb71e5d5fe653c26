//! A small convolutional network on the digits as 1x8x8 images: candle-nn layers, unchanged
//! under every strategy (`strategy.scope(|s| Cnn::new(s.var_builder()))`), computed with the
//! fused convolution and pooling of [`crate::fused`] (candle's own on other devices).

use candle_core::{DType, Tensor};
use candle_nn::{Conv2d, Conv2dConfig, VarBuilder};
use strata_core::Precision;

use crate::fused::{conv2d, relu_max_pool2d};
use crate::model::{Classifier, Dense};

/// candle-nn's layer computed by [`crate::fused::conv2d`], always in f32 (as autocasting
/// keeps some operations in f32): a 16-bit input is widened for it and the output narrowed
/// back. candle's CPU convolution has no bf16 kernel, and its f16 one is slow.
fn conv(layer: &Conv2d, x: &Tensor) -> candle_core::Result<Tensor> {
    let y = conv2d(&x.to_dtype(DType::F32)?, layer.weight(), layer.bias(), layer.config())?;
    y.to_dtype(x.dtype())
}

/// The digits' image side (8x8 pixels).
pub const SIDE: usize = 8;

/// conv2d(1 -> 16, 3x3, padding 1), relu, max-pool 2, conv2d(16 -> 32, 3x3, padding 1), relu,
/// max-pool 2 (each pooling window's gradient to its largest element: see [`crate::fused`]), flatten (32 x 2 x 2 = 128), dense 128 -> 64, relu, dense 64 -> 10.
///
/// It takes the digits' feature rows `(N, 64)` (row-major 8x8 images, as [`crate::digits`]
/// loads them) or images `(N, 1, 8, 8)`. Variables: `conv1.{weight,bias}`,
/// `conv2.{weight,bias}`, `fc1.{weight,bias}`, `fc2.{weight,bias}`.
#[derive(Debug)]
pub struct Cnn {
    conv1: Conv2d,
    conv2: Conv2d,
    fc1: Dense,
    fc2: Dense,
    precision: Precision,
}

impl Cnn {
    /// The network, its variables made by `vb` (the scope's `VarBuilder`).
    pub fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        let same = Conv2dConfig { padding: 1, ..Default::default() };
        Ok(Self {
            conv1: candle_nn::conv2d(1, 16, 3, same, vb.pp("conv1"))?,
            conv2: candle_nn::conv2d(16, 32, 3, same, vb.pp("conv2"))?,
            fc1: Dense::new(32 * 2 * 2, 64, vb.pp("fc1"))?,
            fc2: Dense::new(64, crate::digits::CLASSES, vb.pp("fc2"))?,
            precision: Precision::F32,
        })
    }

    /// The network computing at `precision` (`strata train --precision`): the images cast to
    /// its compute type, the convolutions in f32 (see `conv`), the pooling and dense layers in
    /// the compute type, the logits back in f32; the variables stay f32.
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// The number of parameters: 13,706.
    pub fn parameter_count() -> usize {
        (16 * 9 + 16) + (32 * 16 * 9 + 32) + (128 * 64 + 64) + (64 * 10 + 10)
    }
}

impl Classifier for Cnn {
    fn logits(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let n = x.dim(0)?;
        let x = self.precision.cast(&x.reshape((n, 1, SIDE, SIDE))?)?;
        let h = relu_max_pool2d(&conv(&self.conv1, &x)?, 2)?;
        let h = relu_max_pool2d(&conv(&self.conv2, &h)?, 2)?.flatten_from(1)?;
        self.fc2.forward(&self.fc1.forward_relu(&h)?)?.to_dtype(DType::F32)
    }
}

//! Mixed precision: the compute in 16 bits, the variables in f32.
//!
//! As TensorFlow's `mixed_bfloat16` and `mixed_float16` policies do it, every variable stays
//! an f32 master value (so the optimizer, its state, ZeRO's shards, checkpoints and elastic
//! jobs see f32 only), and a model casts to the policy's compute type as it computes: its
//! input once ([`Precision::cast`]), each variable where a layer uses it ([`cast_like`]:
//! to the type of the layer's input, nothing for f32). The cast is an operation of the graph,
//! so a variable's gradient arrives in f32 and is reduced with f32 sums; the activations the
//! backward pass keeps are 16-bit.
//!
//! fp16's range is small (up to 65,504, and gradients below 2^-24 vanish), so it needs loss
//! scaling ([`LossScale`], TensorFlow's `LossScaleOptimizer`): the loss is multiplied by a
//! scale before the backward pass, the reduced gradient divided by it before the step, and a
//! step whose gradient is not finite is skipped, and the scale halved, on every replica and
//! worker alike (see `DistributedOptimizer::with_loss_scale`).

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Tensor};

/// The type a model computes in (TensorFlow's dtype policy): f32 (the default), or bf16 or
/// fp16 with f32 variables.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in f32.
    #[default]
    F32,
    /// Forward and backward in bfloat16 (f32's range, 8 bits of mantissa); no loss scaling.
    Bf16,
    /// Forward and backward in IEEE half precision, with dynamic loss scaling.
    Fp16,
}

impl Precision {
    /// The type activations are computed in.
    pub fn compute_dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
            Self::Fp16 => DType::F16,
        }
    }

    /// Whether training at this precision needs loss scaling (fp16).
    pub fn needs_loss_scale(self) -> bool {
        self == Self::Fp16
    }

    /// The name `--precision` takes: `f32`, `bf16` or `fp16`.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::Fp16 => "fp16",
        }
    }

    /// `x` in the compute type when it holds floats (a model's input); integer tensors (ids,
    /// labels) and tensors already of that type as they are.
    pub fn cast(self, x: &Tensor) -> candle_core::Result<Tensor> {
        if x.dtype().is_float() {
            x.to_dtype(self.compute_dtype())
        } else {
            Ok(x.clone())
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(Self::F32),
            "bf16" | "bfloat16" | "mixed_bfloat16" => Ok(Self::Bf16),
            "fp16" | "f16" | "float16" | "mixed_float16" => Ok(Self::Fp16),
            other => Err(format!("unknown precision {other:?}; use f32, bf16 or fp16")),
        }
    }
}

/// A variable `w` in the type of a layer's input `x` (TensorFlow's autocasting of variables):
/// `w` itself where they agree or `x` is not a float, else a cast (an operation of the graph,
/// so `w`'s gradient still arrives in `w`'s type).
pub fn cast_like(w: &Tensor, x: &Tensor) -> candle_core::Result<Tensor> {
    if x.dtype().is_float() && w.dtype().is_float() {
        w.to_dtype(x.dtype())
    } else {
        Ok(w.clone())
    }
}

/// Dynamic loss scaling, as TensorFlow's `LossScaleOptimizer` does it: start at
/// [`initial`](Self::initial); a step whose gradient holds an infinity or a NaN is skipped
/// and the scale divided by [`factor`](Self::factor) (never below 1); after
/// [`growth_interval`](Self::growth_interval) finite steps in a row the scale is multiplied by
/// it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScale {
    /// The first scale: 2^15.
    pub initial: f64,
    /// Finite steps in a row before the scale grows: 2,000.
    pub growth_interval: u64,
    /// What the scale is multiplied by to grow and divided by to shrink: 2.
    pub factor: f64,
}

impl Default for LossScale {
    /// TensorFlow's defaults: 2^15, 2,000 steps, 2.
    fn default() -> Self {
        Self { initial: 32_768.0, growth_interval: 2_000, factor: 2.0 }
    }
}

impl LossScale {
    /// Checks the settings: a finite initial scale of at least 1, a growth interval of at
    /// least 1 and a factor above 1.
    pub fn check(&self) -> crate::Result<()> {
        let bad = |setting, value: String, expected| Err(crate::Error::OptimizerSetting { setting, value, expected });
        if !(self.initial.is_finite() && self.initial >= 1.0) {
            return bad("an initial loss scale", self.initial.to_string(), "use a finite scale of at least 1");
        }
        if self.growth_interval == 0 {
            return bad("a loss scale growth interval", "0".into(), "use at least 1 step");
        }
        if !(self.factor.is_finite() && self.factor > 1.0) {
            return bad("a loss scale factor", self.factor.to_string(), "use a finite factor above 1");
        }
        Ok(())
    }

    /// The state a job starts in.
    pub fn start(&self) -> LossScaleState {
        LossScaleState { scale: self.initial, good_steps: 0, skipped_steps: 0 }
    }
}

/// Where dynamic loss scaling stands: the scale, the finite steps since it last changed, and
/// the steps skipped so far. Saved in checkpoints with the optimizer's state.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct LossScaleState {
    /// The scale the next step's loss is multiplied by.
    pub scale: f64,
    /// Finite steps in a row since the scale last changed.
    pub good_steps: u64,
    /// Steps skipped for a gradient that was not finite, over the job.
    pub skipped_steps: u64,
}

/// The name of the loss scale's entry among an optimizer's state tensors.
pub(crate) const STATE_NAME: &str = "strata.loss_scale";

impl LossScaleState {
    /// After a step whose gradient was `finite` or not (TensorFlow's update rule).
    pub fn update(&mut self, finite: bool, cfg: &LossScale) {
        if finite {
            if self.good_steps + 1 >= cfg.growth_interval {
                let grown = self.scale * cfg.factor;
                if grown.is_finite() {
                    self.scale = grown;
                }
                self.good_steps = 0;
            } else {
                self.good_steps += 1;
            }
        } else {
            self.scale = (self.scale / cfg.factor).max(1.0);
            self.good_steps = 0;
            self.skipped_steps += 1;
        }
    }

    /// As a state tensor (f64: the scale, the good steps, the skipped steps).
    pub(crate) fn to_tensor(self) -> candle_core::Result<Tensor> {
        Tensor::new(&[self.scale, self.good_steps as f64, self.skipped_steps as f64], &candle_core::Device::Cpu)
    }

    /// From [`Self::to_tensor`]'s tensor; `None` for anything else.
    pub(crate) fn from_tensor(t: &Tensor) -> Option<Self> {
        let v = t.to_dtype(DType::F64).ok()?.flatten_all().ok()?.to_vec1::<f64>().ok()?;
        match v[..] {
            [scale, good, skipped] if scale.is_finite() && scale >= 1.0 && good >= 0.0 && skipped >= 0.0 => {
                Some(Self { scale, good_steps: good as u64, skipped_steps: skipped as u64 })
            }
            _ => None,
        }
    }
}

/// Whether every element of every gradient is finite (no infinity, no NaN): `g - g` is 0
/// for a finite element and NaN otherwise, so its sum is 0 exactly when all are.
pub(crate) fn all_finite<'a>(grads: impl IntoIterator<Item = &'a Tensor>) -> candle_core::Result<bool> {
    for g in grads {
        // `g - g` on purpose: the difference is what tells a finite element from the others.
        #[allow(clippy::eq_op)]
        let z = (g - g)?.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        if z != 0.0 {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn tensorflows_rule_halves_on_overflow_and_doubles_after_the_interval() {
        let cfg = LossScale { growth_interval: 3, ..Default::default() };
        let mut s = cfg.start();
        assert_eq!(s.scale, 32_768.0);
        s.update(false, &cfg);
        assert_eq!((s.scale, s.good_steps, s.skipped_steps), (16_384.0, 0, 1));
        s.update(true, &cfg);
        s.update(true, &cfg);
        assert_eq!((s.scale, s.good_steps), (16_384.0, 2));
        s.update(true, &cfg); // the third finite step in a row
        assert_eq!((s.scale, s.good_steps), (32_768.0, 0));
        let mut low = LossScaleState { scale: 1.5, good_steps: 7, skipped_steps: 0 };
        low.update(false, &cfg);
        assert_eq!((low.scale, low.good_steps, low.skipped_steps), (1.0, 0, 1), "never below 1");
        let back = LossScaleState::from_tensor(&s.to_tensor().unwrap()).unwrap();
        assert_eq!(back, s);
        assert!(LossScaleState::from_tensor(&Tensor::new(&[0.5f64, 0., 0.], &Device::Cpu).unwrap()).is_none());
    }

    #[test]
    fn finiteness_is_exact_and_bad_settings_are_refused() {
        let d = Device::Cpu;
        let big = Tensor::new(&[3.0e38f32, 3.0e38, -1.0], &d).unwrap();
        assert!(all_finite([&big]).unwrap(), "finite values whose sum overflows are finite");
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let t = Tensor::new(&[1f32, bad, 2.0], &d).unwrap();
            assert!(!all_finite([&big, &t]).unwrap(), "{bad}");
        }
        let half = Tensor::new(&[1f32, 70_000.0], &d).unwrap().to_dtype(DType::F16).unwrap();
        assert!(!all_finite([&half]).unwrap(), "70,000 overflows fp16");
        assert!(LossScale { initial: 0.5, ..Default::default() }.check().is_err());
        assert!(LossScale { growth_interval: 0, ..Default::default() }.check().is_err());
        assert!(LossScale { factor: 1.0, ..Default::default() }.check().is_err());
        assert_eq!("mixed_bfloat16".parse::<Precision>().unwrap(), Precision::Bf16);
        assert_eq!("fp16".parse::<Precision>().unwrap().compute_dtype(), DType::F16);
        assert!("f8".parse::<Precision>().unwrap_err().contains("use f32, bf16 or fp16"));
    }

    #[test]
    fn a_cast_variable_gets_its_gradient_in_f32() {
        let d = Device::Cpu;
        let w = candle_core::Var::new(&[[1f32, 2.0], [3.0, 4.0]], &d).unwrap();
        let x = Precision::Bf16.cast(&Tensor::new(&[[1f32, 1.0]], &d).unwrap()).unwrap();
        assert_eq!(x.dtype(), DType::BF16);
        let y = x.matmul(&cast_like(w.as_tensor(), &x).unwrap()).unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        let g = y.to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
        let gw = g.get(w.as_tensor()).unwrap();
        assert_eq!(gw.dtype(), DType::F32);
        assert_eq!(gw.to_vec2::<f32>().unwrap(), vec![vec![1.0, 1.0], vec![1.0, 1.0]]);
        let ids = Tensor::new(&[1u32, 2], &d).unwrap();
        assert_eq!(Precision::Fp16.cast(&ids).unwrap().dtype(), DType::U32);
        assert_eq!(cast_like(w.as_tensor(), &ids).unwrap().dtype(), DType::F32);
    }
}

//! The mean cross-entropy of rows of logits against class indices, forward and backward, one
//! pass over each row each way.
//!
//! candle-nn's `cross_entropy` is a log-softmax composed of six operations (a maximum, a
//! broadcast subtraction, the exps, their sum, its log, a second broadcast subtraction), then a
//! gather and a mean; the backward pass runs each of them again in reverse. On the
//! transformer's `(2048, 65)` logits the broadcasts take candle's strided paths, and the loss
//! cost about 1% of a step. Here each row's maximum, sum of exps and log are taken once, and
//! the backward pass writes `softmax - one-hot` scaled by the loss' gradient in one pass. The
//! sums are [`super::lane_sum`]'s and the exps [`super::exp`], not candle's, so the results
//! differ from the composed operations within rounding (tested within 1e-6).

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::{append1, exp, f32_only, fusable, lane_max, lane_sum, simd, Kernel};

/// The sum over rows of `ln(sum(exp(row))) - row[target]`.
struct CrossEntropyFwd<'a> {
    x: &'a [f32],
    targets: &'a [u32],
    classes: usize,
    out: &'a mut f32,
}

impl Kernel for CrossEntropyFwd<'_> {
    #[inline(always)]
    fn run(self) {
        let mut total = 0f32;
        for (row, &t) in self.x.chunks_exact(self.classes).zip(self.targets) {
            let max = lane_max(row);
            let sum = lane_sum(row, |x| exp(x - max));
            total += (max + sum.ln()) - row[t as usize];
        }
        *self.out = total;
    }
}

/// `scale * (softmax(row) - one_hot(target))` for each row.
struct CrossEntropyBwd<'a> {
    x: &'a [f32],
    targets: &'a [u32],
    classes: usize,
    scale: f32,
    out: &'a mut Vec<f32>,
}

impl Kernel for CrossEntropyBwd<'_> {
    #[inline(always)]
    fn run(self) {
        let scale = self.scale;
        for (row, &t) in self.x.chunks_exact(self.classes).zip(self.targets) {
            let max = lane_max(row);
            let sum = lane_sum(row, |x| exp(x - max));
            let at = scale / sum;
            let start = self.out.len();
            append1(self.out, row, |x| exp(x - max) * at);
            self.out[start + t as usize] -= scale;
        }
    }
}

/// The rows, classes and targets of `(logits, targets)`: `(rows, classes)` f32 logits, `rows`
/// u32 targets each below `classes`.
fn checked<'a>(
    (s1, l1): (&'a CpuStorage, &Layout),
    (s2, l2): (&'a CpuStorage, &Layout),
) -> Result<(&'a [f32], &'a [u32], usize)> {
    let name = "cross_entropy";
    let (rows, classes) = l1.shape().dims2()?;
    if rows == 0 || classes == 0 {
        candle_core::bail!("{name}: logits of shape {:?} have no rows or no classes", l1.shape());
    }
    if l2.shape().dims() != [rows] {
        candle_core::bail!("{name}: targets of shape {:?} for {rows} rows of logits", l2.shape());
    }
    let x = f32_only(s1, l1, name)?;
    let targets = match (s2, l2.contiguous_offsets()) {
        (CpuStorage::U32(v), Some((a, b))) => &v[a..b],
        _ => candle_core::bail!("{name}: the targets must be a contiguous u32 tensor"),
    };
    if let Some((i, &t)) = targets.iter().enumerate().find(|(_, &t)| t as usize >= classes) {
        candle_core::bail!("{name}: target {t} of row {i} is not one of the {classes} classes");
    }
    Ok((x, targets, classes))
}

/// The mean cross-entropy; its backward pass gives the logits' gradient.
struct CrossEntropy;

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "strata-cross-entropy"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, targets, classes) = checked((s1, l1), (s2, l2))?;
        let mut total = 0f32;
        simd(CrossEntropyFwd { x, targets, classes, out: &mut total });
        Ok((CpuStorage::F32(vec![total / targets.len() as f32]), Shape::from(())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let rows = logits.dim(0)?;
        let scale = grad.to_dtype(DType::F32)?.to_scalar::<f32>()? / rows as f32;
        Ok((Some(logits.apply_op2_no_bwd(targets, &CrossEntropyGrad(scale))?), None))
    }
}

/// `(logits, targets)` -> the logits' gradient, for a loss gradient of `rows * .0`.
struct CrossEntropyGrad(f32);

impl CustomOp2 for CrossEntropyGrad {
    fn name(&self) -> &'static str {
        "strata-cross-entropy-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, targets, classes) = checked((s1, l1), (s2, l2))?;
        let mut out = Vec::with_capacity(x.len());
        simd(CrossEntropyBwd { x, targets, classes, scale: self.0, out: &mut out });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// The mean over rows of `-log softmax(logits)[target]` for `(rows, classes)` logits and `rows`
/// u32 class indices: `candle_nn::loss::cross_entropy`, in one pass each way on f32 CPU
/// tensors (within rounding of it: other sums and exps), and it elsewhere. A target that is not
/// a class is an error, not a read out of bounds.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if fusable(logits) && targets.device().is_cpu() && targets.dtype() == DType::U32 {
        logits.contiguous()?.apply_op2(&targets.contiguous()?, CrossEntropy)
    } else {
        candle_nn::loss::cross_entropy(logits, targets)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn the_loss_and_its_gradient_are_candles_within_rounding() {
        let dev = Device::Cpu;
        for (rows, classes) in [(1, 1), (1, 2), (7, 65), (300, 3), (4, 100)] {
            let logits = Var::from_tensor(&(Tensor::randn(0f32, 3.0, (rows, classes), &dev).unwrap())).unwrap();
            let targets: Vec<u32> = (0..rows).map(|i| ((i * 7 + 3) % classes) as u32).collect();
            let targets = Tensor::new(targets.as_slice(), &dev).unwrap();
            let fused = cross_entropy(logits.as_tensor(), &targets).unwrap();
            let composed = candle_nn::loss::cross_entropy(logits.as_tensor(), &targets).unwrap();
            let (a, b) = (fused.to_scalar::<f32>().unwrap(), composed.to_scalar::<f32>().unwrap());
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "({rows}, {classes}): {a} against {b}");
            // A gradient of 3 on the loss, so the scale reaches the logits.
            let ga = (fused * 3.0).unwrap().backward().unwrap();
            let gb = (composed * 3.0).unwrap().backward().unwrap();
            let (ga, gb) = (ga.get(logits.as_tensor()).unwrap(), gb.get(logits.as_tensor()).unwrap());
            let (ga, gb) = (
                ga.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                gb.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            for (x, y) in ga.iter().zip(&gb) {
                assert!((x - y).abs() <= 1e-6, "({rows}, {classes}): gradient {x} against {y}");
            }
            // Each row's gradient sums to 0 (softmax less a one-hot).
            for row in ga.chunks(classes) {
                assert!(row.iter().sum::<f32>().abs() < 1e-5);
            }
        }
        // Large logits: the maximum is taken out first.
        let logits = Tensor::new(&[[1000f32, -1000.0, 0.0], [-1000.0, 1000.0, 999.0]], &dev).unwrap();
        let l = cross_entropy(&logits, &Tensor::new(&[0u32, 2], &dev).unwrap()).unwrap().to_scalar::<f32>().unwrap();
        // Row 0's loss is 0 (to 1e-400); row 1's is 1000 + ln(1 + e^-1) - 999.
        assert!((l - (1.0 + (-1f32).exp().ln_1p()) / 2.0).abs() < 1e-4, "{l}");
    }

    #[test]
    fn bad_targets_are_one_line_errors() {
        let dev = Device::Cpu;
        let logits = Tensor::zeros((3, 5), DType::F32, &dev).unwrap();
        let e = cross_entropy(&logits, &Tensor::new(&[0u32, 5, 1], &dev).unwrap()).unwrap_err().to_string();
        assert!(e.contains("cross_entropy: target 5 of row 1 is not one of the 5 classes"), "{e}");
        let e = cross_entropy(&logits, &Tensor::new(&[0u32, 1], &dev).unwrap()).unwrap_err().to_string();
        assert!(e.contains("cross_entropy: targets of shape [2] for 3 rows of logits"), "{e}");
        let e = cross_entropy(
            &Tensor::zeros((0, 5), DType::F32, &dev).unwrap(),
            &Tensor::zeros(0, DType::U32, &dev).unwrap(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("no rows or no classes"), "{e}");
    }
}

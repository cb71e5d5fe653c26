//! Activation recomputation: a block whose inner activations are not kept, its forward run
//! again in the backward pass (TensorFlow's `recompute_grad`, PyTorch's
//! `torch.utils.checkpoint`).
//!
//! [`recompute`] runs the block once on detached copies of its inputs and keeps only its
//! output, the inputs and the variables it used (found in the block's graph, then dropped with
//! every activation in it). In the backward pass the block's node runs the forward again on
//! the inputs, now tracked, and a backward pass over that sub-graph alone from the node's
//! gradient (the vendored candle's `Tensor::with_backward` and `Tensor::backward_from`), and
//! hands the inputs' and variables' gradients to the outer pass. The recomputed forward gives
//! the same bits as the first (it is checked), so the gradients are those of the pass without
//! recomputation, bit for bit where no variable or input gets three or more contributions whose
//! order the two passes could take differently.
//!
//! Under ZeRO stage 3 the recomputed forward brings the block's unit back once, and the
//! sub-graph's backward pass uses it while it is still there: one gather for both uses.

use std::sync::Arc;

use candle_core::backprop::BackwardFn;
use candle_core::{Tensor, Var};

/// `forward(inputs)` without keeping its inner activations: they are computed again in the
/// backward pass. The block must be a function of its inputs and the variables it reads
/// (no random draws of its own; a layer that writes state in its forward, such as batch
/// normalisation's running statistics, writes it again when recomputed: keep those outside).
/// A recomputed output that differs from the first is an error of the backward pass.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
///
/// let w = Var::new(&[[2f32, 0.0], [0.0, 3.0]], &Device::Cpu)?;
/// let x = Var::new(&[[1f32, 1.0]], &Device::Cpu)?;
/// let block = {
///     let w = w.as_tensor().clone();
///     move |xs: &[Tensor]| xs[0].matmul(&w)?.relu()?.sqr()
/// };
/// let y = strata_core::recompute(&[x.as_tensor().clone()], block)?;
/// let grads = y.sum_all()?.backward()?;
/// // d/dw of sum((x w)^2) = 2 x^T (x w)
/// assert_eq!(grads.get(w.as_tensor()).unwrap().to_vec2::<f32>()?, [[4.0, 6.0], [4.0, 6.0]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn recompute<F>(inputs: &[Tensor], forward: F) -> candle_core::Result<Tensor>
where
    F: Fn(&[Tensor]) -> candle_core::Result<Tensor> + Send + Sync + 'static,
{
    let detached: Vec<Tensor> = inputs.iter().map(Tensor::detach).collect();
    let out = forward(&detached)?;
    // The variables the block read: the leaves of its graph (which stops at the detached
    // inputs), in the graph's order.
    let variables: Vec<Tensor> = out.sorted_nodes().into_iter().filter(|n| n.is_variable()).cloned().collect();
    let value = out.detach();
    drop(out);
    let mut operands = inputs.to_vec();
    operands.extend(variables);
    let block = Recompute { inputs: inputs.len(), forward };
    Ok(Tensor::with_backward(&value, operands, Arc::new(block)))
}

/// The node of one [`recompute`]d block.
struct Recompute<F> {
    /// How many of the node's operands are the block's inputs (the rest are its variables).
    inputs: usize,
    forward: F,
}

impl<F> BackwardFn for Recompute<F>
where
    F: Fn(&[Tensor]) -> candle_core::Result<Tensor> + Send + Sync,
{
    fn backward(&self, operands: &[Tensor], node: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        // The inputs again, each a variable of the sub-graph where a gradient flows to it.
        let inputs = operands[..self.inputs]
            .iter()
            .map(|t| {
                if t.track_op() && t.dtype().is_float() {
                    Ok(Var::from_tensor(&t.detach())?.as_tensor().clone())
                } else {
                    Ok(t.detach())
                }
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let again = (self.forward)(&inputs)?;
        check_same(node, &again)?;
        let grads = again.backward_from(grad)?;
        // An input that tracks no gradient gets none (the sub-graph's pass may have stored
        // one for it on the way). Each gradient is handed over detached: the sub-graph's pass
        // computed it from the recomputed activations (a weight's gradient is `x^T g`), and a
        // gradient still holding that graph would keep every recomputed block's activations
        // alive until the outer pass ends, the memory recomputation is there to save.
        let detached = |g: &Tensor| g.detach();
        Ok(inputs
            .iter()
            .zip(operands)
            .map(|(t, outer)| grads.get(t).filter(|_| outer.track_op()).map(detached))
            .chain(operands[self.inputs..].iter().map(|v| grads.get(v).map(detached)))
            .collect())
    }
}

/// The recomputed output is the first one, bit for bit (a NaN where the first had one).
fn check_same(first: &Tensor, again: &Tensor) -> candle_core::Result<()> {
    if first.shape() != again.shape() || first.dtype() != again.dtype() {
        candle_core::bail!(
            "a recomputed block gave a {:?} {:?} where its forward pass gave a {:?} {:?}; the block must be a function of its inputs and variables",
            again.dtype(),
            again.dims(),
            first.dtype(),
            first.dims()
        )
    }
    let differ = again.ne(first)?.to_dtype(candle_core::DType::U32)?.sum_all()?.to_scalar::<u32>()?;
    if differ > 0 {
        let nan = first.ne(first)?.to_dtype(candle_core::DType::U32)?.sum_all()?.to_scalar::<u32>()?;
        if differ > nan {
            candle_core::bail!(
                "a recomputed block gave {} of {} values other than its forward pass did; recompute only a block that is a function of its inputs and variables (no random draws, no state it writes)",
                differ - nan,
                first.elem_count()
            )
        }
    }
    Ok(())
}

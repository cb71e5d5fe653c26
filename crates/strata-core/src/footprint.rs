//! The bytes a replica holds live in a step, counted from its tensors' storages
//! ([`Footprint`]): its variables as they are resident now (ZeRO stage 3's released units hold
//! nothing), its shard's own copies, its gradients, its optimizer's state and the activations its
//! loss keeps for the backward pass. Counted at the end of each step's backward pass, when the
//! activations and the gradients are both alive; the optimizer keeps each replica's peak
//! ([`DistributedOptimizer::peak_footprint`](crate::DistributedOptimizer::peak_footprint)).
//!
//! This module must not know which strategy, stage or optimizer made the tensors: it counts
//! storages, each once however many tensors share it.

use std::collections::HashSet;

use candle_core::Tensor;
use serde::Serialize;

/// The bytes one replica held at once in a step, by kind. Each allocation is counted once, in
/// the first kind that holds it (in the order of the fields).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Footprint {
    /// Its trainable variables as they are resident (stage 3: its shard's copies and the units
    /// gathered at that moment).
    pub parameters: u64,
    /// Its gradients: what the backward pass stored for its variables, and what the reduction
    /// keeps of them (its shard's runs at stages 2 and 3), accumulated ones included.
    pub gradients: u64,
    /// Its optimizer's state: the floats per element the optimizer declares
    /// ([`OptimizerMemory::state_per_element`](crate::optim::OptimizerMemory::state_per_element))
    /// over the elements it steps.
    pub optimizer_state: u64,
    /// What its loss keeps for the backward pass: every tensor of the loss's graph on the way
    /// to a variable (recomputed blocks keep only their inputs); the batch itself is not
    /// counted.
    pub activations: u64,
}

impl Footprint {
    /// Every kind together.
    pub fn total(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer_state + self.activations
    }
}

/// Counts storages once each.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    seen: HashSet<usize>,
}

impl Tally {
    /// The bytes of the storages of `tensors` not counted before.
    pub(crate) fn count<'a>(&mut self, tensors: impl IntoIterator<Item = &'a Tensor>) -> u64 {
        tensors
            .into_iter()
            .map(|t| {
                let (key, bytes) = t.storage_footprint();
                if self.seen.insert(key) {
                    bytes as u64
                } else {
                    0
                }
            })
            .sum()
    }

    /// The bytes of what `loss` keeps for the backward pass: the tensors of its graph that lead
    /// to a variable, the variables themselves left out (counted as parameters).
    pub(crate) fn activations(&mut self, loss: &Tensor) -> u64 {
        let nodes = loss.sorted_nodes();
        self.count(nodes.into_iter().filter(|t| !t.is_variable()))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use super::Tally;

    /// A view counts nothing more than its storage; a released variable counts nothing.
    #[test]
    fn views_are_counted_once() -> candle_core::Result<()> {
        let w = Var::ones((8, 4), candle_core::DType::F32, &Device::Cpu)?;
        let mut t = Tally::default();
        assert_eq!(t.count([w.as_tensor(), &w.t()?, &w.narrow(0, 2, 3)?]), 8 * 4 * 4);
        let x = Tensor::ones((3, 8), candle_core::DType::F32, &Device::Cpu)?;
        // loss = sum(x w): the product (3 x 4) and the scalar; x tracks no gradient.
        let loss = x.matmul(w.as_tensor())?.sum_all()?;
        let mut t = Tally::default();
        t.count([w.as_tensor()]);
        assert_eq!(t.activations(&loss), (3 * 4 + 1) * 4);
        Ok(())
    }
}

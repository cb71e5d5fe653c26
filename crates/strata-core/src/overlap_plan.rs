//! The plan of a step's reductions: which gradients go together (buckets of whole gradients,
//! blocks of rows of a large matrix's) and in what order every replica and worker starts them
//! ([`OverlapPlan`], cut by [`cut_plan`]). The overlapped step follows it while the backward
//! pass runs, the distributed optimizer keeps each replica's, and ZeRO across workers lays its
//! shards out on one fixed when the optimizer is built.
//!
//! This module must not know the optimizer, ZeRO's shards or how a unit is reduced: it decides
//! positions from the variables' shapes and the strategy's options.

use std::collections::HashMap;

use candle_core::Var;

use crate::cross_device::{plan_buckets, Bucket};
use crate::extended::StrategyExtended;

/// How a replica reduces its gradients while the backward pass runs: the order in which the
/// gradients became ready in a step without overlap (the first, or one after the variables
/// with gradients changed), agreed by every replica and worker, cut into buckets that are
/// reduced in that order, each as soon as its last gradient is final.
#[derive(Debug)]
pub(crate) struct OverlapPlan {
    /// Indices of the optimizer's variables, in the order the buckets take them.
    pub(crate) order: Vec<usize>,
    /// The buckets, as ranges of `order`.
    pub(crate) buckets: Vec<Bucket>,
    /// Each variable's bucket (by variable index), if the plan has the variable in one.
    pub(crate) bucket_of: Vec<Option<usize>>,
    /// Each variable's rows per block, for a weight whose gradient is reduced in blocks of
    /// rows, each as soon as the backward pass has computed it (outside the buckets).
    pub(crate) rows_of: Vec<Option<usize>>,
    /// The reductions of a step, in the order every replica and worker starts them.
    pub(crate) units: Vec<Unit>,
    /// A variable's index by the id of this replica's copy of it.
    pub(crate) index: HashMap<candle_core::TensorId, usize>,
}

/// One reduction of an overlapped step.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Unit {
    /// A bucket of whole gradients.
    Bucket(usize),
    /// Rows `first..first + rows` of variable `var`'s gradient.
    Rows { var: usize, first: usize, rows: usize },
}

/// The smallest bucket an overlapped step across workers cuts its gradient into (DDP's first
/// bucket).
const MIN_SPLIT_BUCKET_BYTES: usize = 1024 * 1024;

/// The plan of an overlapped step that reduces the variables in `order`: `vars` (a replica's
/// copy of the optimizer's variables, `index` naming them by id) in buckets of the strategy's
/// size, a large matrix's gradient in blocks of rows where the ops take them.
pub(crate) fn cut_plan(
    ext: &dyn StrategyExtended,
    order: Vec<usize>,
    vars: &[Var],
    index: HashMap<candle_core::TensorId, usize>,
    shards_gradients: bool,
) -> OverlapPlan {
    // Across workers, and at ZeRO stage 2 (which then never holds a large matrix's whole
    // gradient), with ops that reduce blocks of rows as they reduce whole gradients, a
    // large matrix's gradient goes in blocks of rows; the variables between two such
    // matrices go in buckets.
    let ops = ext.cross_device_ops();
    let block_bytes = ext.options().row_block_bytes;
    let by_rows = (ext.step_workers().is_some() || shards_gradients) && ops.takes_row_blocks() && block_bytes > 0;
    let mut rows_of: Vec<Option<usize>> = vec![None; vars.len()];
    for &i in order.iter().filter(|_| by_rows) {
        if let &[rows, cols] = vars[i].dims() {
            let n = (block_bytes / (cols * std::mem::size_of::<f32>()).max(1)).max(1);
            rows_of[i] = (rows >= 2 * n).then_some(n);
        }
    }
    // Across workers, where a bucket's bytes take time to cross, the buckets are also at
    // most an eighth of the gradient (at least 1 MiB), so that a model of a few megabytes
    // does not wait for the whole backward pass before its first bucket starts.
    let mut bucket_bytes = ext.options().bucket_bytes;
    if ext.step_workers().is_some() && bucket_bytes > 0 {
        let total: usize = order.iter().map(|&i| vars[i].elem_count() * std::mem::size_of::<f32>()).sum();
        bucket_bytes = bucket_bytes.min((total / 8).max(MIN_SPLIT_BUCKET_BYTES));
    }
    let (mut buckets, mut units, mut bucket_of) = (Vec::new(), Vec::new(), vec![None; vars.len()]);
    let mut start = 0;
    for end in 0..=order.len() {
        let split = order.get(end).and_then(|&i| rows_of[i].map(|n| (i, n)));
        if end < order.len() && split.is_none() {
            continue;
        }
        let sizes: Vec<usize> = order[start..end].iter().map(|&i| vars[i].elem_count()).collect();
        for bucket in plan_buckets(&sizes, bucket_bytes) {
            let tensors = start + bucket.tensors.start..start + bucket.tensors.end;
            for &i in &order[tensors.clone()] {
                bucket_of[i] = Some(buckets.len());
            }
            units.push(Unit::Bucket(buckets.len()));
            buckets.push(Bucket { tensors, elements: bucket.elements });
        }
        if let Some((var, n)) = split {
            let total = vars[var].dims()[0];
            units.extend((0..total).step_by(n).map(|first| Unit::Rows { var, first, rows: n.min(total - first) }));
        }
        start = end + 1;
    }
    OverlapPlan { order, buckets, bucket_of, rows_of, units, index }
}

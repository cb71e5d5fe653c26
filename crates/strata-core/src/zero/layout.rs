//! Where ZeRO's shards lie: every replica's [`Run`]s of the flattened variables, split evenly
//! on one machine ([`even_layout`]) or on the workers' reduce-scatter segments of every
//! reduction of the plan fixed when the optimizer is built across workers ([`fixed_plan`],
//! [`segment_layout`]); [`lay_out_shards`](super::shards::lay_out_shards) picks one and builds the shards.
//!
//! This module computes positions only: it must not know the shards, the optimizer, nor move
//! a value.

use std::collections::HashMap;
use std::ops::Range;

use candle_core::Var;

use crate::extended::StrategyExtended;
use crate::overlap_plan::{cut_plan, OverlapPlan, Unit};

/// Elements `start..start + len` of variable `var`, flattened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) var: usize,
    pub(crate) start: usize,
    pub(crate) len: usize,
}

/// The runs of `spans` (one after another) that positions `range` of their concatenation
/// cover, in order; a run that continues the one before it is joined to it.
fn cut(spans: &[Run], range: Range<usize>, into: &mut Vec<Run>) {
    let mut at = 0;
    for s in spans {
        let (lo, hi) = (range.start.max(at), range.end.min(at + s.len));
        if lo < hi {
            let run = Run { var: s.var, start: s.start + lo - at, len: hi - lo };
            match into.last_mut() {
                Some(last) if last.var == run.var && last.start + last.len == run.start => last.len += run.len,
                _ => into.push(run),
            }
        }
        at += s.len;
        if at >= range.end {
            break;
        }
    }
}

/// Every replica's shard (by its index in sync) when the flattened variables of `sizes` are
/// split evenly at element granularity: replica `g` of `n` holds elements `g·T/n ..
/// (g+1)·T/n` of the `T`.
pub(crate) fn even_layout(sizes: &[usize], in_sync: usize) -> Vec<Vec<Run>> {
    let spans: Vec<Run> = sizes.iter().enumerate().map(|(var, &len)| Run { var, start: 0, len }).collect();
    let total = sizes.iter().sum();
    (0..in_sync)
        .map(|g| {
            let mut runs = Vec::new();
            cut(&spans, shard_range(total, in_sync, g), &mut runs);
            runs
        })
        .collect()
}

/// Every replica's shard (by its index in sync) when each of the reductions `units` (each the
/// runs it reduces, one after another) is reduce-scattered across `workers` workers of
/// `local` replicas: worker `w` holds its `segment(len, w)` of every unit, split evenly over
/// its replicas. Each replica then receives from the reduce-scatter exactly the gradient it
/// steps.
pub(crate) fn segment_layout(
    units: &[Vec<Run>],
    workers: usize,
    local: usize,
    segment: impl Fn(usize, usize) -> Range<usize>,
) -> Vec<Vec<Run>> {
    let mut layout = vec![Vec::new(); workers * local];
    for unit in units {
        let len: usize = unit.iter().map(|r| r.len).sum();
        for w in 0..workers {
            let seg = segment(len, w);
            for c in 0..local {
                let mine = shard_range(seg.len(), local, c);
                cut(unit, seg.start + mine.start..seg.start + mine.end, &mut layout[w * local + c]);
            }
        }
    }
    layout
}

/// Shard `g` of `total` elements split over `n` replicas: the sizes differ by at most one.
pub(crate) fn shard_range(total: usize, n: usize, g: usize) -> Range<usize> {
    let at = |i: usize| (total as u128 * i as u128 / n.max(1) as u128) as usize;
    at(g)..at(g + 1)
}

/// The plan ZeRO's shards across workers are laid out on, and every step there follows: the
/// variables in the reverse of their order (the order a backward pass mostly makes them final
/// in), fixed from the optimizer's creation.
pub(crate) fn fixed_plan(
    ext: &dyn StrategyExtended,
    vars: &[Var],
    index: HashMap<candle_core::TensorId, usize>,
    shards_gradients: bool,
) -> OverlapPlan {
    cut_plan(ext, (0..vars.len()).rev().collect(), vars, index, shards_gradients)
}

/// The runs of the variables each unit of `plan` reduces, one after another, in the order they
/// are started: what [`segment_layout`] cuts across workers.
pub(super) fn unit_runs(plan: &OverlapPlan, vars: &[Var]) -> Vec<Vec<Run>> {
    plan.units
        .iter()
        .map(|u| match *u {
            Unit::Bucket(b) => plan.order[plan.buckets[b].tensors.clone()]
                .iter()
                .map(|&var| Run { var, start: 0, len: vars[var].elem_count() })
                .collect(),
            Unit::Rows { var, first, rows } => {
                let cols = vars[var].dims().get(1).copied().unwrap_or(1);
                vec![Run { var, start: first * cols, len: rows * cols }]
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_split_evenly_and_cover_every_element_once() {
        for (total, n) in [(10, 3), (7, 7), (5, 8), (4_325_386, 4), (0, 2)] {
            let ranges: Vec<_> = (0..n).map(|g| shard_range(total, n, g)).collect();
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[n - 1].end, total);
            for w in ranges.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            let (lo, hi) = (ranges.iter().map(|r| r.len()).min(), ranges.iter().map(|r| r.len()).max());
            assert!(hi.unwrap() - lo.unwrap() <= 1, "{total} over {n}: {ranges:?}");
        }
    }

    /// Each variable's elements, marked by the replicas whose runs hold them.
    fn owners(sizes: &[usize], layout: &[Vec<Run>]) -> Vec<Vec<Vec<usize>>> {
        let mut owner: Vec<Vec<Vec<usize>>> = sizes.iter().map(|&n| vec![Vec::new(); n]).collect();
        for (g, runs) in layout.iter().enumerate() {
            for r in runs {
                for o in &mut owner[r.var][r.start..r.start + r.len] {
                    o.push(g);
                }
            }
        }
        owner
    }

    #[test]
    fn the_even_layout_is_the_flattened_model_cut_evenly() {
        let sizes = [5, 1, 7, 3];
        let layout = even_layout(&sizes, 3);
        assert_eq!(layout[0], vec![Run { var: 0, start: 0, len: 5 }]);
        assert_eq!(layout[1], vec![Run { var: 1, start: 0, len: 1 }, Run { var: 2, start: 0, len: 4 }]);
        assert_eq!(layout[2], vec![Run { var: 2, start: 4, len: 3 }, Run { var: 3, start: 0, len: 3 }]);
    }

    #[test]
    fn the_segment_layout_gives_each_worker_its_segment_of_every_unit() {
        // Two buckets and a matrix of 4 x 5 in blocks of 2 rows.
        let sizes = [3, 20, 4, 6];
        let units = vec![
            vec![Run { var: 3, start: 0, len: 6 }, Run { var: 2, start: 0, len: 4 }],
            vec![Run { var: 1, start: 0, len: 10 }],
            vec![Run { var: 1, start: 10, len: 10 }],
            vec![Run { var: 0, start: 0, len: 3 }],
        ];
        for (workers, local) in [(2, 1), (3, 1), (2, 2), (3, 2)] {
            let segment = |len: usize, w: usize| {
                let k = (w + 1) % workers;
                len * k / workers..len * (k + 1) / workers
            };
            let layout = segment_layout(&units, workers, local, segment);
            assert_eq!(layout.len(), workers * local);
            // Every element is held by exactly one replica.
            for (v, elems) in owners(&sizes, &layout).iter().enumerate() {
                assert!(elems.iter().all(|o| o.len() == 1), "{workers}x{local}: variable {v}: {elems:?}");
            }
            // Each worker's replicas hold exactly its segment of every unit.
            for unit in &units {
                let len: usize = unit.iter().map(|r| r.len).sum();
                for w in 0..workers {
                    let mut want = Vec::new();
                    cut(unit, segment(len, w), &mut want);
                    let elems = |runs: &[Run]| -> Vec<(usize, usize)> {
                        runs.iter().flat_map(|r| (r.start..r.start + r.len).map(move |e| (r.var, e))).collect()
                    };
                    let in_unit = elems(unit);
                    let mut got: Vec<(usize, usize)> = layout[w * local..(w + 1) * local]
                        .iter()
                        .flat_map(|runs| elems(runs))
                        .filter(|x| in_unit.contains(x))
                        .collect();
                    let mut want: Vec<(usize, usize)> =
                        want.iter().flat_map(|r| (r.start..r.start + r.len).map(move |e| (r.var, e))).collect();
                    got.sort_unstable();
                    want.sort_unstable();
                    assert_eq!(got, want, "{workers}x{local}: worker {w}, unit {unit:?}");
                }
            }
        }
    }
}

//! Reduction operators.

use std::fmt;
use std::str::FromStr;

/// How values from the replicas are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over the replicas.
    Mean,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

impl ReduceOp {
    /// All operators, for tests and benchmarks.
    pub const ALL: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];

    /// Combines `acc` with `x` in place (for `Mean`, this sums; call [`ReduceOp::finish`] after).
    #[inline]
    pub fn combine(self, acc: &mut [f32], x: &[f32]) {
        debug_assert_eq!(acc.len(), x.len());
        match self {
            ReduceOp::Sum | ReduceOp::Mean => acc.iter_mut().zip(x).for_each(|(a, b)| *a += *b),
            ReduceOp::Max => acc.iter_mut().zip(x).for_each(|(a, b)| *a = a.max(*b)),
            ReduceOp::Min => acc.iter_mut().zip(x).for_each(|(a, b)| *a = a.min(*b)),
        }
    }

    /// Finishes a reduction of `n` values (divides by `n` for `Mean`).
    #[inline]
    pub fn finish(self, acc: &mut [f32], n: usize) {
        if self == ReduceOp::Mean && n > 1 {
            let inv = 1.0 / n as f32;
            acc.iter_mut().for_each(|a| *a *= inv);
        }
    }

    /// Reduces scalars, in replica order.
    pub fn reduce_scalars(self, values: &[f64]) -> f64 {
        let n = values.len().max(1) as f64;
        match self {
            ReduceOp::Sum => values.iter().sum(),
            ReduceOp::Mean => values.iter().sum::<f64>() / n,
            ReduceOp::Max => values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            ReduceOp::Min => values.iter().copied().fold(f64::INFINITY, f64::min),
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        })
    }
}

impl FromStr for ReduceOp {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "sum" => Ok(ReduceOp::Sum),
            "mean" | "avg" => Ok(ReduceOp::Mean),
            "max" => Ok(ReduceOp::Max),
            "min" => Ok(ReduceOp::Min),
            _ => Err(crate::Error::InvalidArgument(format!("unknown reduce op {s:?}: use sum, mean, max or min"))),
        }
    }
}

//! Strata's CUDA kernels: their sources, their CPU references, and (with the `cuda` feature)
//! their compilation by NVRTC and checked launches.
//!
//! The sources live in `kernels/*.cu` (the repository root), are self-contained (no `#include`) and
//! are embedded here with `include_str!` ([`SOURCES`]). NVRTC compiles each one at first use per
// The modules that compile and launch them exist with the `cuda` feature only: linked there,
// named without it (a link to an item the build leaves out is broken).
#![cfg_attr(
    feature = "cuda",
    doc = "compute capability ([`nvrtc`], cached) and each device loads them once ([`launch::Kernels`])."
)]
#![cfg_attr(
    not(feature = "cuda"),
    doc = "compute capability (`nvrtc`, cached) and each device loads them once (`launch::Kernels`; both \
           with the `cuda` feature)."
)]
//!
//! Every kernel has a CPU reference in [`reference`](mod@reference) with the same contract: the
//! same argument validation ([`validate`], shared with the launchers, so it is tested without a
//! GPU) and the same f32 operations in the same order, so results are equal bit for bit. The optimizers'
//! references apply strata-core's element-wise rules ([`strata_core::optim::rules`]), the one
//! set of formulas the fused CPU optimizers and the parameter server share. The exceptions are
//! NaN payloads of arithmetic results (axpy, scale, the optimizers), which differ between CPUs
//! and GPUs: there a NaN result is only guaranteed to be a NaN. The reductions write every NaN
//! result as the canonical quiet NaN `0x7FC00000`, so they are equal bit for bit everywhere.
//!
//! | kernel | source | reference |
//! |---|---|---|
//! | sum, mean, max, min of N buffers into one | `reduce.cu` | [`reference::reduce`] |
//! | chunked all-reduce step over peer buffers | `reduce.cu` | [`reference::allreduce_chunk`] |
//! | `dst += alpha * src`, `dst = alpha * src` | `axpy.cu` | [`reference::axpy`], [`reference::scale`] |
//! | f32 to and from bf16 / f16 | `cast.cu` | [`reference::f32_to_bf16`] and the others |
//! | SGD, SGD with momentum, AdamW | `optim.cu` | [`reference::sgd`], [`reference::sgd_momentum`], [`reference::adamw`] |

#[cfg(feature = "cuda")]
pub mod bench;
#[cfg(feature = "cuda")]
pub mod launch;
#[cfg(feature = "cuda")]
pub mod nvrtc;
pub mod reference;
pub mod validate;

use strata_core::ReduceOp;

/// One kernel source file: its name, its text and the `extern "C"` functions it defines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Source {
    /// The file name under `kernels/` (the repository root), e.g. `"reduce.cu"`.
    pub name: &'static str,
    /// The CUDA C++ source.
    pub code: &'static str,
    /// The kernels it defines (`extern "C" __global__`), loaded by name.
    pub functions: &'static [&'static str],
}

/// `reduce.cu`: reduction of N buffers into one, and the chunked all-reduce step.
pub const REDUCE: Source = Source {
    name: "reduce.cu",
    code: include_str!("../../../../kernels/reduce.cu"),
    functions: &[
        "strata_reduce_f32",
        "strata_reduce_f32_v4",
        "strata_allreduce_chunk_f32",
        "strata_allreduce_chunk_f32_v4",
    ],
};

/// `axpy.cu`: scaled accumulate and scale.
pub const AXPY: Source = Source {
    name: "axpy.cu",
    code: include_str!("../../../../kernels/axpy.cu"),
    functions: &["strata_axpy_f32", "strata_axpy_f32_v4", "strata_scale_f32", "strata_scale_f32_v4"],
};

/// `cast.cu`: f32 to and from bf16 and f16.
pub const CAST: Source = Source {
    name: "cast.cu",
    code: include_str!("../../../../kernels/cast.cu"),
    functions: &["strata_f32_to_bf16", "strata_f32_to_f16", "strata_bf16_to_f32", "strata_f16_to_f32"],
};

/// `optim.cu`: fused SGD, SGD with momentum and AdamW.
pub const OPTIM: Source = Source {
    name: "optim.cu",
    code: include_str!("../../../../kernels/optim.cu"),
    functions: &["strata_sgd_f32", "strata_sgd_momentum_f32", "strata_adamw_f32"],
};

/// Every kernel source, in a fixed order.
pub const SOURCES: &[Source] = &[REDUCE, AXPY, CAST, OPTIM];

/// Threads per block of every launch.
pub const BLOCK: u32 = 256;

/// The most blocks of one launch: the kernels use grid-stride loops, so a larger length is
/// covered by fewer blocks looping more (65 535 is within every architecture's `gridDim.x`).
pub const MAX_GRID: u32 = 65_535;

/// The byte alignment every pointer of a vectorized (`_v4`, `float4`) launch needs.
pub const VECTOR_ALIGN: u64 = 16;

/// The `op` argument of the reduction kernels (`reduce.cu`'s `STRATA_SUM` 0, `STRATA_MEAN` 1,
/// `STRATA_MAX` 2, `STRATA_MIN` 3). On the GPU and in [`reference::reduce`] and
/// [`reference::allreduce_chunk`]: `Sum` is the f32 sum in replica order, `Mean` that sum divided
/// by the number of buffers (as f32), `Max` and `Min` are NaN if any input is NaN and take the
/// earlier replica's value on ties.
pub fn op_code(op: ReduceOp) -> i32 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Mean => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
    }
}

/// The canonical quiet NaN the reductions write for every NaN result.
pub const CANONICAL_NAN: u32 = 0x7FC0_0000;

/// The f32 scalars of one AdamW step (strata-core's [`rules::AdamWScalars`](strata_core::optim::rules::AdamWScalars),
/// which `FusedAdamW` and the parameter server compute the same way).
pub use strata_core::optim::rules::AdamWScalars;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_source_defines_its_functions_and_includes_nothing() {
        for s in SOURCES {
            assert!(
                !s.code.lines().any(|l| l.trim_start().starts_with("#include")),
                "{} must be self-contained",
                s.name
            );
            for f in s.functions {
                let decl = format!("extern \"C\" __global__ void {f}(");
                assert!(s.code.contains(&decl), "{} does not define {f}", s.name);
            }
            let defined = s.code.matches("extern \"C\" __global__").count();
            assert_eq!(defined, s.functions.len(), "{}: functions listed and defined differ", s.name);
        }
    }

    #[test]
    fn op_codes_match_the_kernel_defines() {
        for op in ReduceOp::ALL {
            let name = format!("{op:?}").to_uppercase();
            assert!(REDUCE.code.contains(&format!("#define STRATA_{name} {}", op_code(op))), "{op:?}");
        }
    }
}

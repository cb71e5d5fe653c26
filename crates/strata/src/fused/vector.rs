//! Loop nests in explicit vectors of `S`, compiled for the CPU's vector width at run time:
//! [`VectorKernel`] and [`simd_vectors`], which every kernel of `strata::fused` written with the
//! vector type in hand runs under, and [`load`].

/// A loop nest written with explicit vectors of `S`, which [`simd_vectors`] compiles for the
/// CPU's vector width (as `fused::Kernel`, with the vector type in hand).
pub(crate) trait VectorKernel {
    /// The loops; every implementation is `#[inline(always)]`.
    fn run<S: pulp::Simd>(self, simd: S);
}

/// A [`VectorKernel`] as pulp's [`pulp::WithSimd`], for its run-time dispatch.
pub(crate) struct VectorDispatch<K>(pub(crate) K);

impl<K: VectorKernel> pulp::WithSimd for VectorDispatch<K> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, simd: S) {
        self.0.run(simd)
    }
}

/// Runs `k` compiled for the widest vector instructions this CPU has, as `fused::simd` does.
pub(crate) fn simd_vectors(k: impl VectorKernel) {
    pulp::Arch::new().dispatch(VectorDispatch(k))
}

/// The vector of `S` at the start of `x`.
#[inline(always)]
pub(crate) fn load<S: pulp::Simd>(x: &[f32]) -> S::f32s {
    pulp::bytemuck::pod_read_unaligned(pulp::bytemuck::cast_slice(&x[..std::mem::size_of::<S::f32s>() / 4]))
}

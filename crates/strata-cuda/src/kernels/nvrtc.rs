//! Compilation of the kernel sources to PTX by NVRTC (loaded at run time through cudarc), once
//! per source and compute capability, cached for the life of the process.
//!
//! Every compilation uses the same options: `--gpu-architecture=compute_XY`, `--fmad=false`
//! (no FMA contraction), `--ftz=false` (subnormals kept), `--prec-div=true` and
//! `--prec-sqrt=true` (IEEE division and square root), `-default-device` and `--std=c++17`. The
//! kernels use `_rn` intrinsics besides, so these flags are a second guard of the bit-for-bit
//! agreement with the CPU references.
//!
//! The PTX is JIT-compiled by the driver when a module is loaded, so the driver must support the
//! PTX ISA of the NVRTC in use: an NVRTC newer than the driver gives
//! `CUDA_ERROR_UNSUPPORTED_PTX_VERSION` at load time (CI pins NVRTC 13.0, whose PTX every CUDA 13
//! driver loads).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use super::Source;
use crate::{probe, Error, Result};

/// The NVRTC options for a virtual architecture such as `"compute_80"`.
pub fn options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--fmad=false".to_string(),
        "--ftz=false".to_string(),
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
        "-default-device".to_string(),
        "--std=c++17".to_string(),
    ]
}

/// The virtual architecture of a compute capability: `(8, 6)` is `"compute_86"`.
pub fn arch_of(compute_capability: (i32, i32)) -> String {
    format!("compute_{}{}", compute_capability.0, compute_capability.1)
}

/// Compiles `source` to PTX for `arch` (e.g. `"compute_80"`), uncached. Errors: NVRTC missing
/// ([`Error::LibraryMissing`], never cudarc's panic), or the compile failing ([`Error::Compile`],
/// with NVRTC's log).
pub fn compile(source: &Source, arch: &str) -> Result<String> {
    probe::nvrtc()?;
    let opts = cudarc::nvrtc::CompileOptions {
        options: options(arch),
        name: Some(source.name.to_string()),
        ..Default::default()
    };
    let compile_error = |log: String| Error::Compile { file: source.name, arch: arch.to_string(), log };
    match cudarc::nvrtc::compile_ptx_with_opts(source.code, opts) {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. }) => {
            let log = log.to_string_lossy().trim().to_string();
            Err(compile_error(if log.is_empty() { format!("{nvrtc:?}") } else { log }))
        }
        Err(e) => Err(compile_error(format!("{e:?}"))),
    }
}

type PtxCache = Mutex<HashMap<(&'static str, String), Arc<str>>>;

/// The PTX of `source` for `arch`, compiled at the first call for that pair and cached; later
/// calls (from any thread, for any device of the same compute capability) return the same text.
pub fn ptx(source: &Source, arch: &str) -> Result<Arc<str>> {
    static CACHE: OnceLock<PtxCache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    // held while compiling, so that concurrent first uses compile once
    let mut cache = cache.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let key = (source.name, arch.to_string());
    if let Some(ptx) = cache.get(&key) {
        return Ok(ptx.clone());
    }
    let ptx: Arc<str> = compile(source, arch)?.into();
    tracing::debug!(file = source.name, arch, bytes = ptx.len(), "nvrtc compiled a kernel source");
    cache.insert(key, ptx.clone());
    Ok(ptx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_pin_the_arithmetic() {
        let o = options("compute_90");
        assert_eq!(o[0], "--gpu-architecture=compute_90");
        for f in ["--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true"] {
            assert!(o.iter().any(|x| x == f), "{f}");
        }
        assert_eq!(arch_of((8, 6)), "compute_86");
    }

    #[test]
    fn without_nvrtc_compiling_is_an_error_not_a_panic() {
        if probe::nvrtc().is_ok() {
            return; // covered by tests/ptx.rs where NVRTC is present
        }
        let e = compile(&super::super::REDUCE, "compute_80").unwrap_err().to_string();
        assert!(e.contains("not on the library path"), "{e}");
    }
}

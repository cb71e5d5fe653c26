//! Probes for the CUDA libraries, done before cudarc touches them: cudarc panics when a library
//! it needs is missing; these return [`Error::LibraryMissing`] instead.

use crate::{Error, Result};

/// The CUDA driver (`libcuda.so.1`), needed for any GPU work.
pub fn driver() -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        #[cfg(not(feature = "candle-cuda"))]
        // SAFETY: is_culib_present only tries to dlopen the library by its candidate names and
        // closes it again; it runs no library code besides the loader's.
        let present = unsafe { cudarc::driver::sys::is_culib_present() };
        // With candle's CUDA, cudarc is linked to libcuda: the process could not have started
        // without it.
        #[cfg(feature = "candle-cuda")]
        let present = true;
        if present {
            return Ok(());
        }
        Err(Error::LibraryMissing {
            what: "CUDA driver",
            library: "libcuda.so.1",
            hint: " (install the NVIDIA driver, or run on a machine with a GPU)",
        })
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::NotBuilt { feature: "cuda", what: "GPUs" })
    }
}

/// NVRTC (`libnvrtc.so`), which compiles Strata's kernels at first use.
pub fn nvrtc() -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        #[cfg(not(feature = "candle-cuda"))]
        // SAFETY: as in `driver`: a dlopen attempt and nothing else.
        let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
        #[cfg(feature = "candle-cuda")]
        let present = true;
        if present {
            return Ok(());
        }
        Err(Error::LibraryMissing {
            what: "NVRTC",
            library: "libnvrtc.so",
            hint: " (install the CUDA toolkit's nvrtc, or `pip install nvidia-cuda-nvrtc` and add its lib directory to LD_LIBRARY_PATH)",
        })
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::NotBuilt { feature: "cuda", what: "NVRTC" })
    }
}

/// NCCL (`libnccl.so`, a link to NCCL's `libnccl.so.2`), for all-reduce across GPUs.
pub fn nccl() -> Result<()> {
    #[cfg(feature = "nccl")]
    {
        #[cfg(not(feature = "candle-cuda"))]
        // SAFETY: as in `driver`: a dlopen attempt and nothing else.
        let present = unsafe { cudarc::nccl::sys::is_culib_present() };
        #[cfg(feature = "candle-cuda")]
        let present = true;
        if present {
            return Ok(());
        }
        Err(Error::LibraryMissing {
            what: "NCCL",
            library: "libnccl.so",
            // cudarc opens `libnccl.so` (or `.so.1`, `.so.9` to `.so.13`), never NCCL's soname
            // `libnccl.so.2`, which is all that NCCL's runtime packages and the PyPI wheel ship.
            hint: " (install NCCL, or `pip install nvidia-nccl-cu13`; NCCL ships libnccl.so.2, so put a link libnccl.so -> libnccl.so.2 in a directory on LD_LIBRARY_PATH, as scripts/gpu-test does)",
        })
    }
    #[cfg(not(feature = "nccl"))]
    {
        Err(Error::NotBuilt { feature: "nccl", what: "NCCL" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_never_panic_and_say_what_is_missing() {
        for (name, r) in [("driver", driver()), ("nvrtc", nvrtc()), ("nccl", nccl())] {
            if let Err(e) = r {
                let msg = e.to_string();
                assert!(msg.contains("not on the library path") || msg.contains("rebuild with"), "{name}: {msg}");
            }
        }
    }
}

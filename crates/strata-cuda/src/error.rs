//! The one error type of `strata-cuda`.

/// Errors from strata-cuda. Messages are lower case, without a trailing period, and say what to
/// change where the cause is the caller's input or the machine's setup.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Strata was built without the feature a call needs.
    #[error("strata was built without the `{feature}` feature; rebuild with `--features {feature}` to use {what}")]
    NotBuilt {
        /// The Cargo feature.
        feature: &'static str,
        /// What needs it.
        what: &'static str,
    },

    /// A CUDA library is not on the library path.
    #[error("no {what} found: {library} is not on the library path{hint}")]
    LibraryMissing {
        /// What the library provides (the CUDA driver, NVRTC, NCCL).
        what: &'static str,
        /// The library's file name.
        library: &'static str,
        /// How to install it or make it found, in parentheses after a space (or empty).
        hint: &'static str,
    },

    /// Fewer GPUs than asked for.
    #[error("{0}")]
    NoGpu(String),

    /// A kernel launch or copy whose arguments do not hold (lengths, grid sizes, alignment).
    #[error("invalid launch of {kernel}: {detail}")]
    InvalidLaunch {
        /// The kernel.
        kernel: &'static str,
        /// Which argument does not hold.
        detail: String,
    },

    /// NVRTC did not compile a kernel source (`log` is NVRTC's program log, or its status).
    #[error("nvrtc could not compile {file} for {arch}: {log}")]
    Compile {
        /// The kernel source's file.
        file: &'static str,
        /// The GPU architecture compiled for.
        arch: String,
        /// NVRTC's program log, or its status.
        log: String,
    },

    /// A CUDA driver call failed (`call` is the driver function, e.g. `cuMemAlloc`).
    #[cfg(feature = "cuda")]
    #[error("{call} failed: {source}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// Its status.
        #[source]
        source: DriverError,
    },

    /// An allocation that would take a (logical) device past its memory limit. Sizes are exact
    /// bytes; `limit_source` says where the limit comes from and `fix` what to change.
    #[error(
        "cannot allocate {requested} bytes on {device}: {in_use} bytes are in use and the limit is {limit} bytes \
         ({limit_source}); {fix}"
    )]
    MemoryLimit {
        /// The device.
        device: String,
        /// The bytes asked for.
        requested: u64,
        /// The bytes already in use.
        in_use: u64,
        /// The limit, in bytes.
        limit: u64,
        /// Where the limit comes from.
        limit_source: String,
        /// What to change.
        fix: String,
    },

    /// The device, or the memory reserved on it, has no room for an allocation.
    #[error("out of memory on {device}: cannot allocate {requested} bytes: {detail}")]
    OutOfMemory {
        /// The device.
        device: String,
        /// The bytes asked for.
        requested: u64,
        /// The allocator's or the driver's account.
        detail: String,
    },

    /// An NCCL call failed (`call`: the NCCL function; `place`: the rank and GPU, as
    /// `rank 1 of 4 (GPU 1)`; `detail`: NCCL's last error message, if any).
    #[cfg(feature = "nccl")]
    #[error("{call} failed on {place}: {source}{detail}")]
    Nccl {
        /// The NCCL function.
        call: &'static str,
        /// The rank and GPU, as `rank 1 of 4 (GPU 1)`.
        place: String,
        /// NCCL's status.
        #[source]
        source: NcclError,
        /// NCCL's last error message in parentheses, after a space (empty if it has none).
        detail: String,
    },

    /// An NCCL initialisation or collective did not finish within its timeout (a peer process
    /// is lost, stuck, or never joined); the communicator was aborted.
    #[error("nccl {what} on {place} timed out after {timeout:?}; the communicator was aborted (a peer process is lost, stuck or never joined)")]
    NcclTimeout {
        /// The initialisation or collective.
        what: &'static str,
        /// The rank and GPU.
        place: String,
        /// The timeout.
        timeout: std::time::Duration,
    },

    /// An NCCL initialisation or collective was abandoned because the job failed elsewhere (or
    /// the communicator had been aborted before); the communicator is aborted.
    #[error("nccl {what} on {place} was aborted: {reason}")]
    NcclAborted {
        /// The initialisation or collective.
        what: &'static str,
        /// The rank and GPU.
        place: String,
        /// Why it was abandoned.
        reason: String,
    },

    /// Bytes that are not an NCCL unique id.
    #[error("invalid nccl unique id: {0}")]
    InvalidNcclId(String),

    /// An explicit choice of cross-device ops that cannot work on the replica devices.
    #[error("cannot use {choice} for cross-device ops: {reason}")]
    CrossDeviceChoice {
        /// The cross-device ops chosen.
        choice: &'static str,
        /// Why they cannot work.
        reason: String,
    },

    /// An error from candle's CUDA backend (GPU cross-device ops on candle tensors).
    #[cfg(feature = "candle-cuda")]
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// An error from strata-core (device lists, visibility, memory configuration).
    #[error(transparent)]
    Core(#[from] strata_core::Error),
}

/// A status code of the CUDA driver, as cudarc reports it; displays as
/// `CUDA_ERROR_OUT_OF_MEMORY: out of memory`.
#[cfg(feature = "cuda")]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct DriverError(pub cudarc::driver::DriverError);

#[cfg(feature = "cuda")]
impl DriverError {
    /// Whether this is `CUDA_ERROR_OUT_OF_MEMORY`.
    pub fn is_out_of_memory(&self) -> bool {
        self.0 .0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
    }
}

#[cfg(feature = "cuda")]
impl std::fmt::Debug for DriverError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DriverError({:?})", self.0 .0)
    }
}

#[cfg(feature = "cuda")]
impl std::fmt::Display for DriverError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The code's name is known without calling into the driver; its description needs
        // the driver, which is loaded whenever an error came from it.
        let name = format!("{:?}", self.0 .0);
        match self.0.error_string() {
            Ok(text) => write!(f, "{name}: {}", text.to_string_lossy()),
            Err(_) => f.write_str(&name),
        }
    }
}

#[cfg(feature = "cuda")]
impl std::error::Error for DriverError {}

#[cfg(feature = "cuda")]
impl Error {
    /// A closure for `map_err` that wraps a cudarc driver error of the driver function `call`.
    pub fn driver(call: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
        move |e| Error::Driver { call, source: DriverError(e) }
    }
}

/// `Result` with strata-cuda's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(feature = "nccl")]
pub use nccl_status::NcclError;

#[cfg(feature = "nccl")]
mod nccl_status {
    use std::ffi::CStr;
    use std::fmt;

    use cudarc::nccl::sys;

    /// An NCCL status code (`ncclResult_t`) as cudarc reports it; displays as
    /// `ncclRemoteError: remote process exited or there was a network error`.
    #[derive(Clone, PartialEq, Eq)]
    pub struct NcclError(pub cudarc::nccl::result::NcclError);

    impl NcclError {
        /// The status code.
        pub fn code(&self) -> sys::ncclResult_t {
            self.0 .0
        }

        /// Whether NCCL blames a peer or the network (`ncclRemoteError`, `ncclSystemError`):
        /// the multi-worker layer reports these as a lost task.
        pub fn is_remote(&self) -> bool {
            matches!(self.code(), sys::ncclResult_t::ncclRemoteError | sys::ncclResult_t::ncclSystemError)
        }

        /// Whether NCCL itself timed out (`ncclTimeout`, NCCL 2.30 and later).
        pub fn is_timeout(&self) -> bool {
            self.code() == sys::ncclResult_t::ncclTimeout
        }
    }

    impl fmt::Debug for NcclError {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "NcclError({:?})", self.code())
        }
    }

    impl fmt::Display for NcclError {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            let name = format!("{:?}", self.code());
            // SAFETY: an NcclError only comes from a call into libnccl, so the library is
            // loaded; ncclGetErrorString returns a pointer to a static NUL-terminated string
            // (or null, checked).
            let text = unsafe {
                let p = sys::ncclGetErrorString(self.code());
                (!p.is_null()).then(|| CStr::from_ptr(p).to_string_lossy().into_owned())
            };
            match text {
                Some(t) if !t.is_empty() => write!(f, "{name}: {t}"),
                _ => f.write_str(&name),
            }
        }
    }

    impl std::error::Error for NcclError {}
}

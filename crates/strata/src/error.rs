//! The one error type of the `strata` crate and CLI.

/// Errors from the `strata` facade and CLI.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// From the core.
    #[error(transparent)]
    Core(#[from] strata_core::Error),
    /// From candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// From the GPU path (a missing driver or feature, too few GPUs, a CUDA failure).
    #[error(transparent)]
    Cuda(#[from] strata_cuda::Error),
    /// A data file that is missing, unreadable or malformed.
    #[error("data file {path}: {reason}")]
    Data {
        /// The file.
        path: String,
        /// What is wrong, and what to do.
        reason: String,
    },
    /// A command-line value that cannot be used; the message says what to pass instead.
    #[error("{0}")]
    Usage(String),
    /// Training stopped early, cleanly, on request (a [`crate::trainer::StopSignal`]; the
    /// `strata` command's on SIGTERM or SIGINT, `code` being the signal's number).
    #[error("training stopped after step {step}: {detail}")]
    Stopped {
        /// The last step trained.
        step: usize,
        /// The request's code.
        code: u32,
        /// Why, and how to resume.
        detail: String,
    },
    /// An I/O error with context.
    #[error("{context}: {source}")]
    Io {
        /// The path or operation.
        context: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// The process exit code for this error: 2 for input the user can fix (flags, files,
    /// replica counts, device lists), 128 plus the code of a stop on request (143 after
    /// SIGTERM), 1 for failures at run time.
    pub fn exit_code(&self) -> i32 {
        use strata_core::Error as C;
        match self {
            Error::Data { .. } | Error::Usage(_) => 2,
            // As a process killed by that signal would (128 + SIGTERM: 143).
            Error::Stopped { code, .. } => 128 + (*code).min(127) as i32,
            Error::Core(
                C::ZeroReplicas
                | C::InvalidDeviceSpec { .. }
                | C::InvalidDeviceList(_)
                | C::UnknownDevice(_)
                | C::InvalidMemoryConfig(_)
                | C::InvalidArgument(_)
                | C::InvalidCluster(_),
            ) => 2,
            Error::Cuda(
                strata_cuda::Error::NotBuilt { .. }
                | strata_cuda::Error::LibraryMissing { .. }
                | strata_cuda::Error::NoGpu(_)
                | strata_cuda::Error::CrossDeviceChoice { .. },
            ) => 2,
            _ => 1,
        }
    }

    /// An I/O error with context.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }
}

/// The result type of the `strata` crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

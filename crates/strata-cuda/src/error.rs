//! The one error type of `strata-cuda`.

/// Errors from strata-cuda. Messages are lower case, without a trailing period, and say what to
/// change where the cause is the caller's input or the machine's setup.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Strata was built without the feature a call needs.
    #[error("strata was built without the `{feature}` feature; rebuild with `--features {feature}` to use {what}")]
    NotBuilt { feature: &'static str, what: &'static str },

    /// A CUDA library is not on the library path.
    #[error("no {what} found: {library} is not on the library path{hint}")]
    LibraryMissing { what: &'static str, library: &'static str, hint: &'static str },

    /// Fewer GPUs than asked for.
    #[error("{0}")]
    NoGpu(String),

    /// A kernel launch or copy whose arguments do not hold (lengths, grid sizes, alignment).
    #[error("invalid launch of {kernel}: {detail}")]
    InvalidLaunch { kernel: &'static str, detail: String },

    /// An error from strata-core (device lists, visibility, memory configuration).
    #[error(transparent)]
    Core(#[from] strata_core::Error),
}

/// `Result` with strata-cuda's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

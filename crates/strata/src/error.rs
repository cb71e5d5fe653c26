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
    /// From the transport: a cluster token that is missing or invalid
    /// ([`ClusterToken::resolve`](crate::ClusterToken::resolve)), a peer that refused this task's
    /// token, a server that cannot listen on its address, or an RPC to a parameter server or a
    /// worker that failed ([`ps::PsClient`](crate::ps::PsClient), the strategies' clients).
    #[error(transparent)]
    Transport(#[from] strata_transport::Error),
    /// A parameter-server setting or variable that does not validate
    /// ([`ps::ServerOptimizer::validate`](crate::ps::ServerOptimizer::validate),
    /// [`ps::VariableInfo::validate`](crate::ps::VariableInfo::validate)).
    #[error(transparent)]
    Ps(#[from] strata_transport::ps::PsError),
    /// A strategy or optimizer name that is none of the names
    /// ([`StrategyKind`](crate::StrategyKind) and [`OptimizerKind`](crate::OptimizerKind) parse
    /// with it).
    #[error(transparent)]
    UnknownName(#[from] UnknownName),
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
    /// A ps or worker task heard nothing from its job (not even the chief's probes) for its
    /// chief timeout: the chief is gone for good, so the task stops serving.
    #[error("{task}: no call from the chief or any task for {:.1} s: the job's chief is gone, so this task stops serving (a longer --chief-timeout waits longer, 0 serves until stopped)", silent.as_secs_f64())]
    ChiefLost {
        /// The task (`ps:0`, `worker:1`).
        task: String,
        /// How long it heard nothing.
        silent: std::time::Duration,
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
    /// replica counts, device lists, cluster specs, the cluster token, names, a parameter
    /// server's settings), 128 plus the code of a stop on request (143 after SIGTERM), 1 for
    /// failures at run time.
    pub fn exit_code(&self) -> i32 {
        use strata_transport::Error as T;
        match self {
            Error::Data { .. } | Error::Usage(_) | Error::UnknownName(_) => 2,
            // As a process killed by that signal would (128 + SIGTERM: 143).
            Error::Stopped { code, .. } => 128 + (*code).min(127) as i32,
            Error::Core(e) | Error::Cuda(strata_cuda::Error::Core(e)) => core_exit_code(e),
            Error::Cuda(
                strata_cuda::Error::NotBuilt { .. }
                | strata_cuda::Error::LibraryMissing { .. }
                | strata_cuda::Error::NoGpu(_)
                | strata_cuda::Error::CrossDeviceChoice { .. },
            ) => 2,
            // A token missing, malformed or not the cluster's; an address to listen on that this
            // host cannot take (every cause's hint names the address or port to change).
            Error::Transport(T::Config(_) | T::MinWorkers { .. } | T::Unauthenticated(_) | T::Bind { .. }) => 2,
            // A file the user named (the token file, the TLS directory's) missing or unreadable.
            Error::Transport(T::Io { source, .. })
                if matches!(source.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied) =>
            {
                2
            }
            Error::Transport(T::Checkpoint(e)) => core_exit_code(e),
            // A setting or request that can never be taken (its kind says so); the others are
            // the task's state or its failures.
            Error::Ps(e) if e.kind() == strata_transport::ps::PsErrorKind::InvalidArgument => 2,
            _ => 1,
        }
    }

    /// An I/O error with context.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }
}

/// The exit code of a strata-core error: 2 for input the user can fix, else 1.
fn core_exit_code(e: &strata_core::Error) -> i32 {
    use strata_core::Error as C;
    match e {
        C::ZeroReplicas
        | C::InvalidDeviceSpec { .. }
        | C::InvalidDeviceList(_)
        | C::UnknownDevice(_)
        | C::InvalidMemoryConfig(_)
        | C::MemoryLimit(_)
        | C::MemoryLimitInStep(_)
        | C::InvalidArgument(_)
        | C::InvalidCluster(_)
        | C::ZeroStage { .. }
        | C::ZeroUnit { .. } => 2,
        _ => 1,
    }
}

/// The result type of the `strata` crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A name that is none of a kind's names ([`NamedKind`](crate::NamedKind)).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {given:?}; use one of: {}", .names.join(", "))]
pub struct UnknownName {
    /// What was named (`strategy`, `optimizer`).
    pub what: &'static str,
    /// The name given.
    pub given: String,
    /// The names there are.
    pub names: Vec<&'static str>,
}

/// A `strata` error as the core error a step function returns (retryable errors stay retryable).
pub(crate) fn into_core(e: Error) -> strata_core::Error {
    match e {
        Error::Core(c) => c,
        Error::Candle(c) => strata_core::Error::Candle(c),
        other => strata_core::Error::InvalidArgument(other.to_string()),
    }
}

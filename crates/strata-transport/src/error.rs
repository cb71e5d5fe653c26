//! The one error type of `strata-transport`.

use std::time::Duration;

/// Errors from strata-transport. Messages are lower case, without a trailing period, and name
/// the peer task and the operation. `tonic::Status` is converted into these at the transport
/// boundary and nowhere else. The collective's number (`step` in the ring's variants) is kept
/// for the program and the log, not shown: an error names one counter, the training step its
/// caller adds, and a number is shown only where it is the disagreement itself (a mismatch of
/// numbers, in the calls the [`Error::Mismatch`] names).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration that cannot be used (addresses, sizes, tokens).
    #[error("invalid transport configuration: {0}")]
    Config(String),

    /// An elastic job's minimum of workers outside 1 to the number of its workers.
    #[error("an elastic job of {workers} workers cannot run with at least {min}: give a minimum from 1 to {workers}")]
    MinWorkers {
        /// The minimum asked for.
        min: usize,
        /// The job's workers.
        workers: usize,
    },

    /// A peer did not present the cluster token (or presented a wrong one).
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),

    /// A peer task was lost (connection closed, reset, or its heartbeats stopped) while this
    /// task needed it.
    #[error("lost task {task} during {collective}: {detail}")]
    PeerLost {
        /// The lost task.
        task: String,
        /// The collective or RPC that needed it.
        collective: String,
        /// The collective's number (kept for the program and the log, not shown).
        step: u64,
        /// How it was lost.
        detail: String,
    },

    /// A collective or RPC did not complete within its deadline.
    #[error("{collective} timed out after {timeout:?} waiting for task {task}")]
    Timeout {
        /// The task waited for.
        task: String,
        /// The collective or RPC.
        collective: String,
        /// The collective's number (kept for the program and the log, not shown).
        step: u64,
        /// The deadline.
        timeout: Duration,
    },

    /// Peers issued different collectives at the same sequence number.
    #[error("collective order mismatch: task {me} called {mine} but task {peer} called {theirs}")]
    Mismatch {
        /// The sequence number both called at.
        step: u64,
        /// This task.
        me: String,
        /// The collective this task called.
        mine: String,
        /// The peer task.
        peer: String,
        /// The collective the peer called.
        theirs: String,
    },

    /// The collective was aborted because the cluster failed elsewhere.
    #[error("{0}")]
    Aborted(String),

    /// A peer sent bytes that do not follow the protocol.
    #[error("protocol error from task {peer}: {detail}")]
    Protocol {
        /// The peer task.
        peer: String,
        /// What was wrong with its bytes.
        detail: String,
    },

    /// A peer task could not be reached (connection refused or reset, or it answered
    /// UNAVAILABLE); the operation may be retried once the task is back.
    #[error("task {peer} is unavailable during {rpc}: {detail}")]
    Unavailable {
        /// The peer task.
        peer: String,
        /// The RPC or operation.
        rpc: String,
        /// What happened.
        detail: String,
    },

    /// A parameter server refused a push computed from a version too far behind its own
    /// (bounded-staleness mode); pull fresh values and compute the update again.
    #[error("stale push refused by {peer}: computed from version {base}, the task is at version {current}, the bound is {bound}; pull and recompute")]
    Stale {
        /// The parameter server.
        peer: String,
        /// The version the push was computed from.
        base: u64,
        /// The server's version.
        current: u64,
        /// The largest staleness it accepts, in versions.
        bound: u64,
    },

    /// A server refused a request it understood (unknown variable, shape mismatch, oversize
    /// chunk, conflicting spec); `code` is the gRPC status code's name.
    #[error("{peer} refused {rpc} ({code}): {detail}")]
    Rejected {
        /// The server.
        peer: String,
        /// The RPC.
        rpc: String,
        /// The gRPC status code's name.
        code: String,
        /// The server's reason.
        detail: String,
    },

    /// An RPC failed; `status` is the gRPC status, converted here.
    #[error("rpc {rpc} to {peer} failed: {status}")]
    Rpc {
        /// The RPC.
        rpc: String,
        /// The server.
        peer: String,
        /// The gRPC status, as text.
        status: String,
    },

    /// A parameter server's checkpoint could not be written or read (the message names the
    /// file and what to do).
    #[error("{0}")]
    Checkpoint(#[from] strata_core::Error),

    /// A server could not listen on its address: the address, and what to check.
    #[error("{what} cannot listen on {address}: {source}; {hint}")]
    Bind {
        /// The server.
        what: String,
        /// The address it was given.
        address: std::net::SocketAddr,
        /// What to check for the cause.
        hint: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },

    /// An I/O error, with the operation or address it concerns.
    #[error("{context}: {source}")]
    Io {
        /// The operation or address.
        context: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// The result type of strata-transport.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An I/O error with context.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }

    /// `what` could not listen on `address`; the hint says what to check for the usual
    /// causes (an address no interface has, a port in use).
    pub fn bind(what: impl Into<String>, address: std::net::SocketAddr, source: std::io::Error) -> Self {
        let hint = match source.kind() {
            std::io::ErrorKind::AddrNotAvailable => {
                "no interface of this host has that address: bind to one of this host's addresses, or to 0.0.0.0"
            }
            std::io::ErrorKind::AddrInUse => {
                "another process (or another task given the same port) holds the port: stop it, or give this task another port"
            }
            std::io::ErrorKind::PermissionDenied => "ports below 1024 need privileges: use a port of 1024 or more",
            _ => "check the address and port of this task",
        };
        Error::Bind { what: what.into(), address, hint, source }
    }
}

impl Error {
    /// Whether the operation may succeed if retried later (the peer was unavailable, or the
    /// push was stale and will be recomputed).
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::Unavailable { .. } | Error::PeerLost { .. } | Error::Stale { .. })
    }
}

impl From<Error> for strata_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Config(m) => strata_core::Error::InvalidCluster(m),
            e @ Error::MinWorkers { .. } => strata_core::Error::InvalidArgument(e.to_string()),
            Error::Checkpoint(e) => e,
            e @ (Error::Unavailable { .. } | Error::PeerLost { .. }) => strata_core::Error::Unavailable(e.to_string()),
            e @ Error::Stale { .. } => strata_core::Error::Stale(e.to_string()),
            other => strata_core::Error::Cluster(other.to_string()),
        }
    }
}

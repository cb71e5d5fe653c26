//! The one error type of `strata-transport`.

use std::time::Duration;

/// Errors from strata-transport. Messages are lower case, without a trailing period, and name
/// the peer task and the operation. `tonic::Status` is converted into these at the transport
/// boundary and nowhere else.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration that cannot be used (addresses, sizes, tokens).
    #[error("invalid transport configuration: {0}")]
    Config(String),

    /// A peer did not present the cluster token (or presented a wrong one).
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),

    /// A peer task was lost (connection closed, reset, or its heartbeats stopped) while this
    /// task needed it.
    #[error("lost task {task} during {collective} (collective #{step}): {detail}")]
    PeerLost { task: String, collective: String, step: u64, detail: String },

    /// A collective or RPC did not complete within its deadline.
    #[error("{collective} (collective #{step}) timed out after {timeout:?} waiting for task {task}")]
    Timeout { task: String, collective: String, step: u64, timeout: Duration },

    /// Peers issued different collectives at the same sequence number.
    #[error(
        "collective order mismatch at collective #{step}: task {me} called {mine} but task {peer} called {theirs}"
    )]
    Mismatch { step: u64, me: String, mine: String, peer: String, theirs: String },

    /// The collective was aborted because the cluster failed elsewhere.
    #[error("{0}")]
    Aborted(String),

    /// A peer sent bytes that do not follow the protocol.
    #[error("protocol error from task {peer}: {detail}")]
    Protocol { peer: String, detail: String },

    /// An RPC failed; `status` is the gRPC status, converted here.
    #[error("rpc {rpc} to {peer} failed: {status}")]
    Rpc { rpc: String, peer: String, status: String },

    /// An I/O error, with the operation or address it concerns.
    #[error("{context}: {source}")]
    Io {
        context: String,
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
}

impl From<Error> for strata_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Config(m) => strata_core::Error::InvalidCluster(m),
            other => strata_core::Error::Cluster(other.to_string()),
        }
    }
}

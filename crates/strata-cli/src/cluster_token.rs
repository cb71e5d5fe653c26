//! The cluster token every task of a multi-worker or parameter-server job presents to the
//! others: the variable that carries it, how a task finds its own, and the fresh one a local
//! cluster (`strata launch`, a parameter-server job's loopback tasks) hands its tasks.

use strata_transport::ClusterToken;

use crate::{Error, Result};

/// The environment variable that carries the cluster token every task's servers require.
pub const TOKEN_VAR: &str = "STRATA_CLUSTER_TOKEN";

/// This task's token: `--cluster-token-file` when given, else the [`TOKEN_VAR`] variable; a
/// usage error (exit code 2) when neither is set.
pub(crate) fn resolve(file: Option<&std::path::Path>) -> Result<ClusterToken> {
    let unset = match std::env::var(TOKEN_VAR) {
        Ok(t) => t.trim().is_empty(),
        Err(e) => e == std::env::VarError::NotPresent,
    };
    if file.is_none() && unset {
        return Err(Error::Usage(format!(
            "no cluster token: set {TOKEN_VAR} to the same secret in every task (strata launch does this for you), or pass --cluster-token-file"
        )));
    }
    ClusterToken::resolve(file).map_err(|e| Error::Usage(e.to_string()))
}

/// The token of a local cluster this process starts: its own [`TOKEN_VAR`] when set and not
/// empty, else 32 fresh random bytes in hex.
pub(crate) fn for_local_cluster() -> String {
    match std::env::var(TOKEN_VAR) {
        Ok(token) if !token.is_empty() => token,
        _ => rand::random::<[u8; 32]>().iter().map(|b| format!("{b:02x}")).collect(),
    }
}

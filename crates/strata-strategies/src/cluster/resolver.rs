//! What every resolver is ([`ClusterResolver`]), the one of an explicit cluster
//! ([`SimpleClusterResolver`]), and the check that a cluster's host names resolve
//! ([`check_hosts`]).

use super::spec::{split_host_port, ClusterConfig, ClusterSpec, TaskId};
use strata_core::Result;

/// Finds the cluster this process belongs to and the task it runs.
pub trait ClusterResolver: Send + Sync {
    /// The cluster and this process's task; an
    /// [`Error::InvalidCluster`](strata_core::Error::InvalidCluster) naming the field when the
    /// configuration cannot be used.
    fn resolve(&self) -> Result<ClusterConfig>;

    /// Where the cluster comes from, as messages name it: `"TF_CONFIG"`, `"Slurm's job
    /// step"`, or `"the cluster spec"` for an explicit one.
    fn source(&self) -> &'static str {
        "the cluster spec"
    }
}

/// Checks that every host name in `spec` resolves on this host, so that a node name no
/// resolver knows fails the task at once, naming the host, instead of being retried until the
/// rendezvous deadline. `source` (see [`ClusterResolver::source`]) says where the name came
/// from. Addresses given as IPs need no lookup.
pub fn check_hosts(spec: &ClusterSpec, source: &str) -> Result<()> {
    use std::net::ToSocketAddrs;
    let mut seen = std::collections::HashSet::new();
    for (task, address) in spec.tasks() {
        let Ok((host, port)) = split_host_port(address) else { continue };
        if host.parse::<std::net::IpAddr>().is_ok() || !seen.insert(host.to_string()) {
            continue;
        }
        match (host, port).to_socket_addrs() {
            Ok(mut addrs) => {
                if addrs.next().is_none() {
                    return Err(unresolved(host, task, source, "no address"));
                }
            }
            Err(e) => return Err(unresolved(host, task, source, &e.to_string())),
        }
    }
    Ok(())
}

fn unresolved(host: &str, task: TaskId, source: &str, why: &str) -> strata_core::Error {
    strata_core::Error::InvalidCluster(format!(
        "host {host:?} of task {task} (from {source}) does not resolve on this host ({why}); make every node name \
         resolve on every host (DNS or /etc/hosts), or give the cluster IP addresses"
    ))
}

/// A resolver over an explicit cluster spec and task.
#[derive(Debug, Clone)]
pub struct SimpleClusterResolver {
    config: ClusterConfig,
}

impl SimpleClusterResolver {
    /// The cluster `spec`, seen from `task` (checked by [`resolve`](ClusterResolver::resolve)).
    pub fn new(spec: ClusterSpec, task: TaskId) -> Self {
        SimpleClusterResolver { config: ClusterConfig { spec, task, rpc_layer: None, environment: None } }
    }

    /// Sets the `rpc_layer`.
    pub fn with_rpc_layer(mut self, rpc_layer: impl Into<String>) -> Self {
        self.config.rpc_layer = Some(rpc_layer.into());
        self
    }
}

impl ClusterResolver for SimpleClusterResolver {
    fn resolve(&self) -> Result<ClusterConfig> {
        self.config.validate()?;
        Ok(self.config.clone())
    }
}

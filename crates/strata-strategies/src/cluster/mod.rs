//! Cluster resolution for the multi-worker and parameter-server strategies.
//!
//! A [`ClusterResolver`] tells a process which cluster it belongs to and which task of it it
//! runs, as a [`ClusterConfig`]:
//!
//! - [`TFConfigClusterResolver`] reads `TF_CONFIG`, exactly as TensorFlow, the Kubeflow TFJob
//!   operator or Ray write it;
//! - [`SlurmClusterResolver`] reads the variables `srun` sets (`SLURM_PROCID`, `SLURM_NTASKS`,
//!   `SLURM_JOB_NODELIST`...);
//! - [`SimpleClusterResolver`] takes an explicit [`ClusterSpec`] and task.
//!
//! Bad input is an [`Error::InvalidCluster`](strata_core::Error::InvalidCluster) whose one-line
//! message names the field and says what to change.
//!
//! ```
//! use strata_strategies::cluster::{ClusterResolver, ClusterSpec, SimpleClusterResolver, TaskId, TaskType};
//! let spec = ClusterSpec::new([
//!     (TaskType::Chief, vec!["chief:2222"]),
//!     (TaskType::Worker, vec!["w0:2222", "w1:2222"]),
//! ])?;
//! let config = SimpleClusterResolver::new(spec, TaskId::worker(0)).resolve()?;
//! assert_eq!(config.rank(), Some(1)); // the chief is rank 0
//! assert_eq!(
//!     config.to_tf_config(),
//!     r#"{"cluster":{"chief":["chief:2222"],"worker":["w0:2222","w1:2222"]},"task":{"type":"worker","index":0}}"#
//! );
//! # Ok::<(), strata_core::Error>(())
//! ```

mod slurm;
mod spec;
mod tf_config;

pub use slurm::{expand_nodelist, SlurmClusterResolver, SlurmJobs, SlurmLayout};
pub use spec::{split_host_port, ClusterConfig, ClusterSpec, TaskId, TaskType};
pub use tf_config::TFConfigClusterResolver;

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

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

pub use slurm::{expand_nodelist, SlurmClusterResolver, SlurmLayout};
pub use spec::{split_host_port, ClusterConfig, ClusterSpec, TaskId, TaskType};
pub use tf_config::TFConfigClusterResolver;

use strata_core::Result;

/// Finds the cluster this process belongs to and the task it runs.
pub trait ClusterResolver: Send + Sync {
    /// The cluster and this process's task; an
    /// [`Error::InvalidCluster`](strata_core::Error::InvalidCluster) naming the field when the
    /// configuration cannot be used.
    fn resolve(&self) -> Result<ClusterConfig>;
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

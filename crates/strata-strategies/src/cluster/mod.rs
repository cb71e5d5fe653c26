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

mod resolver;
mod slurm;
mod spec;
mod tf_config;

pub use resolver::{check_hosts, ClusterResolver, SimpleClusterResolver};
pub use slurm::{expand_nodelist, SlurmClusterResolver, SlurmJobs, SlurmLayout};
pub use spec::{split_host_port, ClusterConfig, ClusterSpec, TaskId, TaskType};
pub use tf_config::TFConfigClusterResolver;

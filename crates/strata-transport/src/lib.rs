//! Strata's transport: the coordination service of a multi-worker job, the cross-worker
//! collectives (a ring of TCP connections), and the cluster token that keeps both private.
//! `tonic::Status` is converted into [`Error`] here and nowhere else.
//!
//! ```
//! use strata_transport::{ClusterToken, CoordinationConfig, CoordinationMember, CoordinationServerHandle};
//!
//! // The chief serves the coordination service; every task (here, one) registers with it.
//! let token = ClusterToken::new("0123456789abcdef0123")?;
//! let server = CoordinationServerHandle::start(
//!     "127.0.0.1:0".parse().unwrap(),
//!     vec!["worker:0".into()],
//!     "worker=127.0.0.1:2222".into(),
//!     "multi-worker-mirrored".into(),
//!     token.clone(),
//!     CoordinationConfig::default(),
//! )?;
//! let member =
//!     CoordinationMember::connect(&server.address().to_string(), "worker:0", "worker:0", token, CoordinationConfig::default())?;
//! let job = member.register("worker=127.0.0.1:2222", "multi-worker-mirrored", "127.0.0.1:7000")?;
//! assert_eq!((job.rank, job.data_addresses.len()), (0, 1));
//! # Ok::<(), strata_transport::Error>(())
//! ```

// The facade (the strata crate) re-exports this crate's items: every public one is documented.
#![warn(missing_docs)]

pub mod auth;
pub mod control;
pub mod coordination;
mod error;
pub mod executor;
mod guard;
pub mod hooks;
pub mod inject;
pub mod lifecycle;
pub mod ports;
pub mod probe;
pub mod ps;
pub mod ring;
pub mod rt;

pub use auth::{ClusterToken, MutualTls};
pub use coordination::{
    CoordinationConfig, CoordinationMember, CoordinationServerHandle, Generation, MembershipView, Registration,
};
pub use error::{Error, Result};
pub use lifecycle::ServerHandle;
pub use ring::AbortSignal;

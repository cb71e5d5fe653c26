//! Strata's transport: the coordination service of a multi-worker job, the cross-worker
//! collectives (a ring of TCP connections), and the cluster token that keeps both private.
//! `tonic::Status` is converted into [`Error`] here and nowhere else.

pub mod auth;
pub mod coordination;
mod error;
pub mod ring;
pub mod rt;

pub use auth::ClusterToken;
pub use coordination::{CoordinationConfig, CoordinationMember, CoordinationServerHandle, Registration};
pub use error::{Error, Result};

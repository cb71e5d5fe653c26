//! Strata's transport: the coordination service, cross-worker collectives, and (later) the
//! parameter server's servers and clients.

mod error;
pub mod ring;

pub use error::{Error, Result};

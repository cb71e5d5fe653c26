//! # strata-cuda
//!
//! Strata's GPU path, and the only crate of the workspace with cudarc and `unsafe`. It builds
//! everywhere: without the `cuda` feature it holds the kernel sources and their CPU references;
//! with `cuda` (and `nccl`) the CUDA driver, NVRTC and NCCL are loaded at run time, so a machine
//! with no toolkit and no GPU still compiles it, and asking it for a GPU there is a clear error.
//!
//! ```
//! use strata_cuda::probe;
//!
//! // On a machine without a CUDA driver this is an error that says what is missing; it never
//! // panics.
//! match probe::driver() {
//!     Ok(()) => println!("a CUDA driver is present"),
//!     Err(e) => println!("{e}"),
//! }
//! ```

// The facade (the strata crate) re-exports this crate's items: every public one is documented.
#![warn(missing_docs)]

pub mod alloc;
#[cfg(feature = "candle-cuda")]
pub mod candle_ops;
#[cfg(feature = "candle-cuda")]
pub mod candle_optim;
pub mod device;
mod error;
pub mod kernels;
pub mod nccl;
pub mod probe;
pub mod select;
pub mod testing;

#[cfg(feature = "cuda")]
pub use error::DriverError;
pub use error::{Error, Result};

//! strata's integration tests, one binary: each file of `tests/` is a module of it. One binary
//! compiles the shared code and the generics it instantiates once instead of once per file;
//! `cargo test -p strata --test suite trainer::` runs one file's. `backend` is a binary of its
//! own, which CI runs alone in the portable build too; `common` is what it shares with the GPU
//! module.

#[cfg(feature = "candle-cuda")]
mod common;

mod checkpoint_restore;
mod elastic_loop;
mod errors;
mod gpu_models;
mod models;
mod schedule_resume;
mod trainer;
mod zero_checkpoint;

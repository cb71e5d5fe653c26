//! strata-strategies' integration tests, one binary: each file of `tests/` is a module of it
//! (`common` is what they share). One binary compiles the shared code and candle's generics
//! once instead of once per file (a clean test build spent about 390 s of CPU on this crate's
//! 14 test binaries); `cargo test -p strata-strategies --test suite zero::` runs one file's.

#[macro_use]
mod common;

mod batches;
mod cluster;
mod coordinator;
mod embedding;
mod gpu_training;
mod local_tables;
mod mixed_precision;
mod multi_worker;
mod parameter_server;
mod ps_compression;
mod ps_overlap;
mod ps_tables;
mod state;
mod strategies;
mod training_loop;
mod variables;
mod zero;
mod zero_wire;

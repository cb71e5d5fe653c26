//! strata-transport's integration tests, one binary: each file of `tests/` is a module of it
//! (`common` is what they share). One binary compiles the shared code and the generics
//! it instantiates once instead of once per file; `cargo test -p strata-transport --test suite ps::` runs
//! one file's.

mod common;

mod control;
mod coordination;
mod elastic;
mod executor;
mod fuzz;
mod pieces;
mod ps;
mod ps_half;
mod ps_reshard;
mod ps_tables;
mod ring;
mod tls;

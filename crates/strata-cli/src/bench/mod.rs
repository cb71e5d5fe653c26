//! Benchmarks (`strata bench ...`): each prints the machine's own ceiling, measured in the same
//! run, beside Strata's figure.

pub mod allreduce;
pub mod gpu;
pub mod ps;
pub mod train;
pub mod transport;

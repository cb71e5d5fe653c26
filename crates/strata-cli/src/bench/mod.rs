//! Benchmarks (`strata bench ...`): each prints the machine's own ceiling, measured in the same
//! run, beside Strata's figure.

pub mod allreduce;
mod common;
pub mod gpu;
pub mod kernels;
pub mod ps;
pub mod train;
pub mod transport;

use crate::Result;

/// `strata bench allreduce`: on the GPUs with `--gpus` ([`gpu::run`]), else on CPU replicas or
/// worker processes ([`allreduce::run_plan`]).
pub fn allreduce(args: &allreduce::AllreduceArgs) -> Result<()> {
    let plan = args.plan()?;
    if args.gpus {
        return gpu::run(&plan);
    }
    allreduce::run_plan(args, &plan)
}

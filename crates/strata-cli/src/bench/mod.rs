//! Benchmarks (`strata bench ...`): each prints the machine's own ceiling, measured in the same
//! run, beside Strata's figure.

pub mod allreduce;
pub mod gpu;
pub mod kernels;
pub mod ps;
pub mod train;
pub mod transport;

use crate::Result;

/// The median of `v`: the middle value, or the mean of the two middle ones; 0 for none.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// This machine's CPU as `/proc/cpuinfo` names it (its first `model name`), where it says.
pub(crate) fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_string())
}

/// `strata bench allreduce`: on the GPUs with `--gpus` ([`gpu::run`]), else on CPU replicas or
/// worker processes ([`allreduce::run_plan`]).
pub fn allreduce(args: &allreduce::AllreduceArgs) -> Result<()> {
    let plan = args.plan()?;
    if args.gpus {
        return gpu::run(&plan);
    }
    allreduce::run_plan(args, &plan)
}

//! Runnable Strata programs (see `custom_loop.rs` and `fit.rs` beside this crate):
//!
//! ```text
//! cargo run --release -p strata-examples --example custom_loop -- mirrored 2
//! cargo run --release -p strata-examples --example fit -- central-storage 2
//! ```
//!
//! Both take the strategy (`one-device`, `mirrored`, `central-storage`) and the replica count;
//! the model code does not change between strategies.

use strata::prelude::*;

/// The strategy named on the command line (`args[1]`, `args[2]`): the one line that changes.
pub fn strategy_from_args() -> strata::Result<StrategyHandle> {
    let args: Vec<String> = std::env::args().collect();
    let name = args.get(1).map(String::as_str).unwrap_or("mirrored");
    let replicas: usize = match args.get(2) {
        Some(n) => n.parse().map_err(|_| strata::Error::Usage(format!("replica count {n:?} is not a number")))?,
        None => 2,
    };
    Ok(match name {
        "one-device" => OneDeviceStrategy::cpu()?.handle(),
        "mirrored" => MirroredStrategy::logical_cpus(replicas)?.handle(),
        "central-storage" => CentralStorageStrategy::logical_cpus(replicas)?.handle(),
        other => {
            return Err(strata::Error::Usage(format!(
                "unknown strategy {other:?}: use one-device, mirrored or central-storage"
            )))
        }
    })
}

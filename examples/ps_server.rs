//! One parameter-server task of the example job: it holds its share of the variables, applies
//! the optimizer the coordinator configured to every push, and answers pulls.
//!
//! ```text
//! export STRATA_CLUSTER_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
//! cargo run --release -p strata-examples --example ps_server -- 127.0.0.1:7100 0
//! cargo run --release -p strata-examples --example ps_server -- 127.0.0.1:7101 1
//! cargo run --release -p strata-examples --example ps_worker -- 127.0.0.1:7200 0 127.0.0.1:7100,127.0.0.1:7101
//! cargo run --release -p strata-examples --example ps_worker -- 127.0.0.1:7201 1 127.0.0.1:7100,127.0.0.1:7101
//! cargo run --release -p strata-examples --example ps_coordinator -- 127.0.0.1:7100,127.0.0.1:7101 127.0.0.1:7200,127.0.0.1:7201
//! ```
//!
//! `strata ps`, `strata worker` and `strata train --strategy parameter-server` are the same
//! programs with flags, `TF_CONFIG` and checkpoints.

use strata::ps::{PsServerConfig, PsServerHandle};
use strata::ClusterToken;

fn main() -> strata::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let address = args.get(1).map_or("127.0.0.1:7100", String::as_str);
    let index: usize = args.get(2).and_then(|i| i.parse().ok()).unwrap_or(0);
    let token = ClusterToken::resolve(None)?;
    let bind = address.parse().map_err(|_| strata::Error::Usage(format!("{address:?} is not ip:port")))?;
    let server = PsServerHandle::start(bind, PsServerConfig::new(format!("ps:{index}"), token))?;
    eprintln!("ps:{index} serving on {}", server.address());
    let why = server.wait_finished(); // until the coordinator ends the job
    eprintln!("ps:{index}: {why}; exiting");
    Ok(())
}

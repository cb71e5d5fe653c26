//! One worker task of the example job: it serves the steps registered in this binary (see
//! `strata_examples::ps_step`), pulling from and pushing to the parameter servers. Run it as
//! `ps_server.rs` describes.

use strata::parameter_server::{serve_worker, StepRegistry, WorkerOptions};
use strata::ClusterToken;

fn main() -> strata::Result<()> {
    strata::init_cpu_threads();
    let args: Vec<String> = std::env::args().collect();
    let address = args.get(1).map_or("127.0.0.1:7200", String::as_str);
    let index: usize = args.get(2).and_then(|i| i.parse().ok()).unwrap_or(0);
    let ps: Vec<String> = args.get(3).map_or("127.0.0.1:7100", String::as_str).split(',').map(String::from).collect();
    let token = ClusterToken::resolve(None)?;

    let mut registry = StepRegistry::new();
    strata_examples::ps_step::register(&mut registry)?; // steps travel by name, not as closures

    let bind = address.parse().map_err(|_| strata::Error::Usage(format!("{address:?} is not ip:port")))?;
    let server = serve_worker(bind, registry, WorkerOptions::new(index, ps, token))?;
    eprintln!("worker:{index} serving on {}", server.address());
    let why = server.wait_finished(); // until the coordinator ends the job
    eprintln!("worker:{index}: {why}; exiting");
    Ok(())
}

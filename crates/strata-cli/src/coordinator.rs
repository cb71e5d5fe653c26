//! `strata coordinator`: the coordination service of an elastic multi-worker job, served on its
//! own so that it outlives every worker (on Slurm, a task on the batch script's host; on
//! Kubernetes, a pod of its own). `strata launch` serves it itself.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use strata_transport::{CoordinationConfig, CoordinationServerHandle};

use crate::{Error, Result};

/// `strata coordinator` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct CoordinatorArgs {
    /// The job's worker tasks (`worker:0` .. `worker:N-1`): the most it runs with.
    #[arg(long, value_name = "N")]
    pub workers: usize,
    /// The job also has a chief task (`chief:0`), which trains as worker 0 does.
    #[arg(long)]
    pub chief: bool,
    /// The fewest workers the job runs with (the workers' `--min-workers`).
    #[arg(long, value_name = "M")]
    pub min_workers: usize,
    /// The address to listen on (`0.0.0.0` for a real cluster).
    #[arg(long, default_value = "127.0.0.1")]
    pub bind: IpAddr,
    /// The port to listen on (0: a free one, printed).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// A file that holds the cluster token (default: STRATA_CLUSTER_TOKEN).
    #[arg(long)]
    pub cluster_token_file: Option<PathBuf>,
}

/// Serves the job's coordination service until every worker has left (exit 0) or the job
/// failed (its error, exit 1).
pub fn run(args: &CoordinatorArgs) -> Result<()> {
    let n = args.workers + usize::from(args.chief);
    if n == 0 {
        return Err(Error::Usage("--workers 0 without --chief: a job needs a worker; pass --workers 1 or more".into()));
    }
    if args.min_workers == 0 || args.min_workers > n {
        return Err(Error::Usage(format!(
            "--min-workers {}: this job has {n} workers; pass a minimum from 1 to {n}",
            args.min_workers
        )));
    }
    let token = crate::cluster_token::resolve(args.cluster_token_file.as_deref())?;
    let chief = (0..usize::from(args.chief)).map(|_| "chief:0".to_string());
    let names: Vec<String> = chief.chain((0..args.workers).map(|i| format!("worker:{i}"))).collect();
    let service = CoordinationServerHandle::start_elastic(
        SocketAddr::new(args.bind, args.port),
        names,
        args.min_workers,
        token,
        CoordinationConfig::default(),
    )?;
    println!("strata coordinator: listening on {}", service.address());
    loop {
        if let Some(e) = service.error() {
            return Err(strata_core::Error::Cluster(e).into());
        }
        if service.all_left() {
            let (generation, members) = service.membership();
            for l in service.lost_tasks() {
                eprintln!("strata coordinator: lost on the way: {l}");
            }
            for t in service.left_on_request() {
                eprintln!("strata coordinator: left on request: {t}");
            }
            if let Some(code) = service.stopped() {
                // Stopped, not completed: a scheduler sees the stop's status (143 after SIGTERM).
                println!(
                    "strata coordinator: the job stopped on request in generation {generation} with {}",
                    members.join(", ")
                );
                let _ = std::io::Write::flush(&mut std::io::stdout());
                std::process::exit(128 + code.min(127) as i32);
            }
            println!("strata coordinator: the job completed in generation {generation} with {}", members.join(", "));
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

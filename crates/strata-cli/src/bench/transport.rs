//! `strata bench transport`: one-way throughput of a gRPC client stream (tonic, 1 MiB
//! messages, large HTTP/2 windows) against one raw TCP connection, on loopback, in the same
//! run. This is the measurement behind the choice of raw TCP for the cross-worker data plane.

use crate::{Error, Result};

/// `strata bench transport` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchTransportArgs {
    /// Repetitions per size (the median is printed).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Message (gRPC) and write (TCP) size in KiB.
    #[arg(long, default_value_t = 1024)]
    pub chunk_kib: usize,
}

/// Runs the probe and prints the table.
pub fn run(args: &BenchTransportArgs) -> Result<()> {
    if args.reps == 0 || args.chunk_kib == 0 {
        return Err(Error::Usage("--reps and --chunk-kib must be at least 1".into()));
    }
    let chunk = args.chunk_kib * 1024;
    println!(
        "# strata bench transport: one-way loopback throughput, {} KiB messages/writes, median of {} runs",
        args.chunk_kib, args.reps
    );
    println!("{:>10} {:>14} {:>14} {:>12}", "size", "raw TCP GB/s", "gRPC GB/s", "gRPC/TCP");
    for mib in [1usize, 4, 16, 64, 256] {
        let total = mib << 20;
        let tcp = strata_transport::probe::tcp_seconds(total, chunk, args.reps).map_err(strata_core::Error::from)?;
        let grpc =
            strata_transport::probe::grpc_stream_seconds(total, chunk, args.reps).map_err(strata_core::Error::from)?;
        let (a, b) = (total as f64 / tcp / 1e9, total as f64 / grpc / 1e9);
        println!("{:>9}M {:>14.2} {:>14.2} {:>11.0}%", mib, a, b, 100.0 * b / a);
    }
    Ok(())
}

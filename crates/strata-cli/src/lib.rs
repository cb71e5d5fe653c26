//! The `strata` command: its subcommands (`train`, `launch`, `ps`, `worker`, `devices`,
//! `compare`, `ctr-data`) and the benchmarks (`strata bench ...`). The library a training program depends
//! on is the `strata` crate; this crate owns the command line (clap), process control (nix,
//! signal handlers in `signals`), progress bars (indicatif) and the allocator (mimalloc), and converts its flags into
//! the library's types here, at the edge.

pub mod bench;
pub mod cluster_token;
pub mod compare;
pub(crate) mod coordinator;
pub mod ctr_data;
pub(crate) mod hybrid;
pub(crate) mod kinds;
pub(crate) mod launch;
pub(crate) mod local_tables;
#[cfg(test)]
mod local_tables_tests;
pub use cluster_token::TOKEN_VAR;
pub mod ps;
pub(crate) mod signals;
pub mod summary;
pub mod train;
pub mod train_args;

use clap::{Parser, Subcommand};
pub use strata::{Error, Result};

/// Strata: distribution strategies for data-parallel training.
#[derive(Parser, Debug)]
#[command(name = "strata", version, about, propagate_version = true)]
pub struct Cli {
    /// Log filter (tracing's env-filter syntax, e.g. `info` or `strata_core=debug`).
    #[arg(long, global = true, default_value = "warn", env = "STRATA_LOG")]
    pub log: String,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Train a model: the digits MLP (the main job), the digits CNN, the character
    /// transformer or the click model (--model).
    Train(Box<train::TrainArgs>),
    /// Start a local cluster: one process per task, each with its TF_CONFIG (like torchrun).
    Launch(launch::LaunchArgs),
    /// Serve the coordination service of an elastic multi-worker job (the workers'
    /// --coordinator), which outlives every worker, until the job ends.
    Coordinator(coordinator::CoordinatorArgs),
    /// Serve one parameter-server task (variables, the optimizer, checkpoints) until SIGTERM.
    Ps(ps::PsArgs),
    /// Serve one worker task: run the step functions registered in this binary for a
    /// coordinator, until SIGTERM.
    Worker(ps::WorkerArgs),
    /// List physical and logical devices as the visibility rules resolve them, and the GPUs
    /// with the CUDA_VISIBLE_DEVICES entry that selected each, their memory and peer access.
    Devices(DevicesArgs),
    /// Write the ctr model's generated click records as files of 160-byte records
    /// (`train.bin`, `test.bin`) and `meta.json`, for other frameworks.
    CtrData(ctr_data::CtrDataArgs),
    /// Run the same training under several strategies (real processes, or --simulate'd in
    /// virtual time), and write runs.csv, summary.json, plots and REPORT.md.
    Compare(compare::CompareArgs),
    /// Benchmarks; each prints this machine's ceiling measured in the same run.
    Bench {
        /// Which benchmark.
        #[command(subcommand)]
        which: BenchCommand,
    },
}

/// Options of `strata devices`.
#[derive(clap::Args, Debug)]
pub struct DevicesArgs {
    /// Also ask the CUDA driver for each GPU's free memory (this creates a context on every GPU).
    #[arg(long)]
    pub driver_memory: bool,
}

/// The benchmarks.
#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// All-reduce bandwidth in the style of nccl-tests, beside the memcpy floor.
    Allreduce(bench::allreduce::AllreduceArgs),
    /// Training throughput and peak RSS of one device and Mirrored, beside the ceiling of K
    /// independent copies of the step.
    Train(bench::train::BenchTrainArgs),
    /// Parameter-server push/pull throughput and push rate beside raw loopback TCP, and async
    /// PS training throughput beside the ceiling.
    Ps(bench::ps::BenchPsArgs),
    /// gRPC streaming against raw TCP throughput on loopback (why the data plane is raw TCP).
    Transport(bench::transport::BenchTransportArgs),
    /// The CPU kernels the benchmark models spend their time in, one thread each, beside the
    /// machine's compute and memory peaks, and which vector code ran.
    Kernels(bench::kernels::BenchKernelsArgs),
}

/// Runs the command line.
pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train(args) => train::run(&args),
        Command::Launch(args) => launch::run(&args),
        Command::Coordinator(args) => coordinator::run(&args),
        Command::Ps(args) => ps::run_ps(&args),
        Command::Worker(args) => ps::run_worker(&args),
        Command::Devices(args) => devices(&args),
        Command::Compare(args) => compare::run(&args),
        Command::CtrData(args) => ctr_data::run(&args),
        Command::Bench { which: BenchCommand::Allreduce(args) } => bench::allreduce(&args),
        Command::Bench { which: BenchCommand::Train(args) } => bench::train::run(&args),
        Command::Bench { which: BenchCommand::Transport(args) } => bench::transport::run(&args),
        Command::Bench { which: BenchCommand::Ps(args) } => bench::ps::run(&args),
        Command::Bench { which: BenchCommand::Kernels(args) } => bench::kernels::run(&args),
    }
}

/// `strata devices`: the registry's report, with the GPUs from the CUDA driver when there is
/// one; without a driver (or a build without the `cuda` feature) one line says why.
fn devices(args: &DevicesArgs) -> Result<()> {
    let registry = strata_core::device::DeviceRegistry::global();
    let registered = strata_cuda::device::register_cuda_enumerator(registry);
    let mut text = strata_core::device::describe_devices(registry)?;
    match registered {
        Ok(()) => match strata_cuda::device::discover()
            .and_then(|topology| strata_cuda::device::describe_gpus(registry, &topology, args.driver_memory))
        {
            Ok(gpus) => text.push_str(&gpus),
            Err(strata_cuda::Error::Core(e)) => return Err(e.into()),
            Err(e) => text.push_str(&format!("GPUs: {e}\n")),
        },
        Err(strata_cuda::Error::Core(e)) => return Err(e.into()),
        Err(e) => {
            let line = format!("GPUs: {e}\n");
            let generic = "GPUs: no GPU enumerator registered (build with the cuda feature)\n";
            if text.contains(generic) {
                text = text.replace(generic, &line);
            } else {
                text.push_str(&line);
            }
        }
    }
    print!("{text}");
    Ok(())
}

//! `strata bench ps`: the parameter server's data path. Push and pull throughput of one
//! variable from 4 KiB to 64 MiB against a `strata ps` process on loopback, beside one raw TCP
//! connection's throughput measured in the same run (the ceiling of any transport on this
//! machine); the RPC rate of 4 KiB pushes from 1 and from several clients; and the training
//! throughput of async ParameterServerStrategy (1 ps, 2 workers) on the two benchmark MLPs,
//! beside the ceiling of 2 independent copies of the step and TensorFlow's figure.
//!
//! The table follows nccl-tests: size, count, type, time, algbw, and a wrong count that
//! checks every value after the pushes (SGD with lr 1 on gradients of ones: exactly minus the
//! number of pushes).

use super::common::median;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use strata_transport::ps::{F32Bytes, PsClient, PsClientConfig, PsMode, ServerOptimizer, UpdateId, VariableInfo};
use strata_transport::ClusterToken;

use crate::{Error, Result};

/// `strata bench ps` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchPsArgs {
    /// Largest variable, MiB (sizes go from 4 KiB up by 4x, and 16 and 64 MiB).
    #[arg(long, default_value_t = 64)]
    pub max_mib: usize,
    /// Only these variable sizes, e.g. `16M,64M` or `4K` (K and M are KiB and MiB; a multiple
    /// of 4 bytes); instead of the 4 KiB to `--max-mib` ladder.
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    pub sizes: Vec<usize>,
    /// Seconds each throughput figure runs (in 3 rounds, interleaved with the others; each round
    /// at least 3 operations).
    #[arg(long, default_value_t = 1.0)]
    pub seconds: f64,
    /// Concurrent clients for the RPC rate (besides the single-client figure).
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Training models: `small`, `large`, or `none` to skip the training figures.
    #[arg(long, default_value = "small,large", value_delimiter = ',')]
    pub models: Vec<String>,
    /// Epochs of each training run (the first is warm-up).
    #[arg(long, default_value_t = 6)]
    pub epochs: usize,
}

/// Kills the ps process when dropped.
struct PsProcess(Child);

impl Drop for PsProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A size such as `4K`, `16M` or `4096` (bytes), a positive multiple of 4.
fn parse_size(text: &str) -> std::result::Result<usize, String> {
    let t = text.trim();
    let (digits, unit) = match t.strip_suffix(['K', 'k']) {
        Some(d) => (d, 1usize << 10),
        None => match t.strip_suffix(['M', 'm']) {
            Some(d) => (d, 1 << 20),
            None => (t, 1),
        },
    };
    let n: usize = digits.parse().map_err(|_| format!("{text:?} is not a size: write it as 4096, 4K or 16M"))?;
    match n.checked_mul(unit) {
        Some(b) if b > 0 && b % 4 == 0 && b <= 1 << 30 => Ok(b),
        _ => Err(format!("{text:?}: a size must be a positive multiple of 4 bytes, at most 1024M")),
    }
}

fn gbps(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / seconds.max(1e-12) / 1e9
}

fn size_label(bytes: usize) -> String {
    if bytes.is_multiple_of(1 << 20) {
        format!("{}M", bytes >> 20)
    } else if bytes.is_multiple_of(1 << 10) {
        format!("{}K", bytes >> 10)
    } else {
        format!("{bytes}B")
    }
}

/// Rounds of each figure per size (the table gives their medians).
const ROUNDS: usize = 3;

/// Repeats `op` for `seconds` (at least 3 times); (count, seconds per op).
fn repeat(seconds: f64, mut op: impl FnMut(u64) -> Result<()>) -> Result<(u64, f64)> {
    op(0)?; // warm-up: connection, allocation
    let t0 = Instant::now();
    let mut n = 0u64;
    while n < 3 || t0.elapsed().as_secs_f64() < seconds {
        op(n + 1)?;
        n += 1;
    }
    Ok((n, t0.elapsed().as_secs_f64() / n as f64))
}

/// Runs the benchmark and prints its tables.
pub fn run(args: &BenchPsArgs) -> Result<()> {
    if args.clients == 0 || args.seconds.is_nan() || args.seconds <= 0.0 {
        return Err(Error::Usage("--clients must be at least 1 and --seconds positive".into()));
    }
    let (ps, client) = start_ps_task()?;
    print_throughput_header();
    let mut worst_large = f64::INFINITY;
    for bytes in sizes(args) {
        let (push_ratio, pull_ratio) = measure_size(&client, args, bytes)?;
        if bytes >= 16 << 20 {
            worst_large = worst_large.min(push_ratio).min(pull_ratio);
        }
    }
    if worst_large.is_finite() {
        println!(
            "# at 16 MiB and more, the slower of push and pull reaches {:.0}% of raw TCP (target: 50%)",
            100.0 * worst_large
        );
    }
    push_rate(&client, args)?;
    drop(ps);
    training_throughput(args)
}

/// Starts a `strata ps` task of this executable on a free loopback port, with a fresh token,
/// and a client of it once it answers.
fn start_ps_task() -> Result<(PsProcess, PsClient)> {
    let token_text: String = rand::random::<[u8; 16]>().iter().map(|b| format!("{b:02x}")).collect();
    let token = ClusterToken::new(&token_text).map_err(|e| Error::Usage(e.to_string()))?;
    let port =
        strata_transport::ports::free_ports([127, 0, 0, 1].into(), 1).map_err(|e| Error::io("picking a port", e))?[0];
    let address = format!("127.0.0.1:{port}");
    let exe = std::env::current_exe().map_err(|e| Error::io("finding the strata executable", e))?;
    let ps = PsProcess(
        Command::new(exe)
            .args(["ps", "--address", &address])
            .env(crate::TOKEN_VAR, &token_text)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| Error::io("starting the ps task", e))?,
    );
    let config = PsClientConfig { timeout: Duration::from_secs(120), retry_for: Duration::from_secs(30) };
    let client = PsClient::connect(&address, "ps:0", token, config).map_err(strata_core::Error::from)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while client.status().is_err() {
        if Instant::now() > deadline {
            return Err(Error::Usage(format!("the ps task at {address} did not answer in 30 s")));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok((ps, client))
}

/// The throughput table's header.
fn print_throughput_header() {
    println!("# strata bench ps: one variable on a `strata ps` process over loopback gRPC (1 MiB chunks), SGD lr 1 on the server");
    println!("# raw TCP: one loopback connection in the same run (the ceiling); push/pull: GB/s of f32 payload");
    println!(
        "# each figure: the median of {ROUNDS} rounds, the four figures of a size measured in turn in every round"
    );
    println!(
        "# push: push_shared (the caller's buffer is sent as it is); copy: push from a borrowed slice (one more copy)"
    );
    println!(
        "#{:>9} {:>11} {:>6} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>8} {:>8} {:>6}",
        "size",
        "count",
        "type",
        "push(us)",
        "push GB/s",
        "copy GB/s",
        "pull(us)",
        "pull GB/s",
        "TCP GB/s",
        "push/TCP",
        "pull/TCP",
        "wrong"
    );
}

/// The variable sizes measured: `--sizes`, or 4 KiB times powers of 4 up to `--max-mib`.
fn sizes(args: &BenchPsArgs) -> Vec<usize> {
    if args.sizes.is_empty() {
        let mut ladder: Vec<usize> =
            std::iter::successors(Some(4usize << 10), |s| Some(s * 4)).take_while(|&s| s < 16 << 20).collect();
        ladder.extend([16 << 20, 64 << 20].into_iter().filter(|&s| s <= args.max_mib << 20));
        ladder
    } else {
        args.sizes.clone()
    }
}

/// Measures and prints the row of one variable of `bytes`: push, copying push, pull and raw
/// TCP, and the values after the pushes checked. Returns push and pull as shares of TCP.
fn measure_size(client: &PsClient, args: &BenchPsArgs, bytes: usize) -> Result<(f64, f64)> {
    let count = bytes / 4;
    let name = format!("v{bytes}");
    let zeros = vec![0f32; count];
    client
        .create_variables(
            &[(VariableInfo::whole(&name, vec![count]), &zeros)],
            &ServerOptimizer::Sgd { lr: 1.0 },
            PsMode::Async,
        )
        .map_err(strata_core::Error::from)?;
    // `push_shared`: the gradient's memory goes to the connection (what workers do); `push`
    // from a borrowed slice copies it once more, into the buffers it sends from.
    let ones = vec![1f32; count];
    let shared = F32Bytes::from_vec(ones.clone());
    let (mut pushes, mut step) = (0u64, 0u64);
    let mut out = vec![0f32; count];
    let reps = (((256usize << 20) / bytes).clamp(3, 200)).min(50).div_ceil(ROUNDS);
    let (mut push_t, mut copy_t, mut pull_t, mut tcp_t) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // Rounds of each figure in turn, medians: a spell in which other tenants slow the
    // machine then lowers the ceiling too, not only one figure.
    for _ in 0..ROUNDS {
        let round = args.seconds / ROUNDS as f64;
        push_t.push(
            repeat(round, |_| {
                let id = UpdateId { worker: "bench".into(), client: format!("bench-{name}"), step, seq: 0 };
                client.push_shared(&id, 0, &[(name.as_str(), shared.clone())]).map_err(strata_core::Error::from)?;
                (pushes, step) = (pushes + 1, step + 1);
                Ok(())
            })?
            .1,
        );
        copy_t.push(
            repeat(round, |_| {
                let id = UpdateId { worker: "bench".into(), client: format!("bench-{name}"), step, seq: 0 };
                client.push(&id, 0, &[(name.as_str(), &ones)]).map_err(strata_core::Error::from)?;
                (pushes, step) = (pushes + 1, step + 1);
                Ok(())
            })?
            .1,
        );
        pull_t.push(
            repeat(round, |_| {
                let mut slots = [out.as_mut_slice()];
                client.pull_into(&[name.as_str()], 0, &mut slots).map_err(strata_core::Error::from)?;
                Ok(())
            })?
            .1,
        );
        tcp_t.push(
            strata_transport::probe::tcp_seconds(bytes, bytes.min(1 << 20), reps).map_err(strata_core::Error::from)?,
        );
    }
    let want = -(pushes as f32);
    let wrong = out.iter().filter(|&&x| x != want).count();
    let [push_s, copy_s, pull_s, tcp_s] = [push_t, copy_t, pull_t, tcp_t].map(median);
    let (push, pull, tcp) = (gbps(bytes, push_s), gbps(bytes, pull_s), gbps(bytes, tcp_s));
    println!(
        "{:>10} {:>11} {:>6} {:>11.1} {:>11.2} {:>11.2} {:>11.1} {:>11.2} {:>11.2} {:>7.0}% {:>7.0}% {:>6}",
        size_label(bytes),
        count,
        "float",
        push_s * 1e6,
        push,
        gbps(bytes, copy_s),
        pull_s * 1e6,
        pull,
        tcp,
        100.0 * push / tcp,
        100.0 * pull / tcp,
        wrong
    );
    Ok((push / tcp, pull / tcp))
}

/// The RPC rate of small pushes (4 KiB, one RPC each) from 1 client and from `--clients`.
fn push_rate(client: &PsClient, args: &BenchPsArgs) -> Result<()> {
    let small = vec![1f32; 1024];
    let zeros = vec![0f32; 1024];
    client
        .create_variables(
            &[(VariableInfo::whole("rate", vec![1024]), &zeros)],
            &ServerOptimizer::Sgd { lr: 1.0 },
            PsMode::Async,
        )
        .map_err(strata_core::Error::from)?;
    println!("# 4 KiB pushes (one RPC each, applied on the server): target 10,000/s");
    for clients in [1, args.clients] {
        let t0 = Instant::now();
        let counts: Vec<Result<u64>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..clients)
                .map(|c| {
                    let (client, small) = (client.clone(), &small);
                    s.spawn(move || -> Result<u64> {
                        let mut n = 0u64;
                        while t0.elapsed().as_secs_f64() < args.seconds.max(1.0) {
                            let id = UpdateId {
                                worker: format!("c{c}"),
                                client: format!("rate{clients}-{c}"),
                                step: n,
                                seq: 0,
                            };
                            client.push(&id, 0, &[("rate", small)]).map_err(strata_core::Error::from)?;
                            n += 1;
                        }
                        Ok(n)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(Error::Usage("a client thread panicked".into()))))
                .collect()
        });
        let total: u64 = counts.into_iter().sum::<Result<u64>>()?;
        let rate = total as f64 / t0.elapsed().as_secs_f64();
        println!("{:>10} clients: {:>10.0} pushes/s ({:.1} us each)", clients, rate, 1e6 / rate * clients as f64);
    }
    Ok(())
}

/// Async ParameterServerStrategy's training throughput on `--models`, beside the ceiling of 2
/// independent copies of the step.
fn training_throughput(args: &BenchPsArgs) -> Result<()> {
    let models: Vec<&String> = args.models.iter().filter(|m| m.as_str() != "none").collect();
    if !models.is_empty() {
        println!("# async ParameterServerStrategy, 1 ps + 2 workers (processes), batch 256 per step, AdamW on the ps");
        println!("# ceiling: 2 independent single-thread copies of the same step (plain candle) at once, same run");
        println!("{:>8} {:>14} {:>14} {:>10}", "model", "PS ex/s", "ceiling ex/s", "of ceiling");
    }
    for model in models {
        let bm = super::train::BenchModel::one(model)?;
        let super::train::BenchModel::Mlp(_, hidden) = &bm else {
            return Err(Error::Usage(format!("strata bench ps measures the MLPs small and large, not {model}")));
        };
        let ps = train_ps(hidden, args.epochs)?;
        let ceiling = super::train::ceiling_examples_per_second(&bm, 2, 512, 2.0)?;
        println!("{:>8} {:>14.0} {:>14.0} {:>9.0}%", model, ps, ceiling, 100.0 * ps / ceiling);
    }
    Ok(())
}

/// Steady-state examples/s of `strata train --strategy parameter-server` with 1 ps and 2 workers.
fn train_ps(hidden: &[usize], epochs: usize) -> Result<f64> {
    let dir = tempfile_dir()?;
    let out = dir.join("out.json");
    let exe = std::env::current_exe().map_err(|e| Error::io("finding the strata executable", e))?;
    let hidden_arg = hidden.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
    let status = Command::new(exe)
        .args(["train", "--strategy", "parameter-server", "--ps-tasks", "1", "--workers", "2", "--ps-mode", "async"])
        .args(["--hidden", &hidden_arg, "--epochs", &epochs.max(2).to_string(), "--batch", "256", "--no-progress"])
        .arg("--out")
        .arg(&out)
        .env_remove("TF_CONFIG")
        .stdout(Stdio::null())
        .status()
        .map_err(|e| Error::io("running strata train", e))?;
    if !status.success() {
        return Err(Error::Usage(format!("strata train --strategy parameter-server failed: {status}")));
    }
    let text = std::fs::read_to_string(&out).map_err(|e| Error::io(format!("reading {}", out.display()), e))?;
    let _ = std::fs::remove_dir_all(&dir);
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::io("parsing the summary", e.into()))?;
    Ok(v["examples_per_second"].as_f64().unwrap_or(0.0))
}

fn tempfile_dir() -> Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("strata-bench-ps-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    Ok(dir)
}

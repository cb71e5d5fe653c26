//! `strata bench allreduce`: all-reduce timed the way nccl-tests times NCCL's (`size count type
//! redop time algbw busbw #wrong`), beside the ceiling this machine allows, measured in the same
//! run.
//!
//! - `--local`: the CPU all-reduce of one machine's replicas, beside the floor of reading the
//!   `K` replica buffers once and writing one result at the memcpy bandwidth. Every row runs
//!   `K` persistent replica threads, each holding its own f32 input tensor whose reduction has a
//!   closed form exact in f32; every result element of every replica is checked against it on
//!   the first warm-up and after the timed iterations (`#wrong`).
//! - `--workers N`: MultiWorkerMirrored's cross-worker all-reduce ([`strata_transport::ring`])
//!   between `N` processes of this binary on loopback, beside raw loopback TCP throughput. Each
//!   worker refills its buffer, meets the others at a barrier, times one all-reduce, and meets
//!   them again before checking every result against the closed form (so that no untimed work
//!   competes with a slower worker's timed all-reduce); the time is the slowest worker's median.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use strata_core::cross_device::{CpuCrossDeviceOps, CrossDeviceOps, Destination, ReduceRequest};
use strata_core::device::{format_bytes, parse_bytes};
use strata_core::group::{OpKey, ReplicaGroup, DEFAULT_COLLECTIVE_TIMEOUT};
use strata_core::ReduceOp;
use strata_transport::ring::{self, AbortSignal, Ring, RingConfig};

use crate::{Error, Result};

const MIB: u64 = 1 << 20;
/// Rows at least this large count in the per-replica-count summary.
const SUMMARY_MIN_BYTES: u64 = 16 * MIB;
/// The target for the median time/floor of the summary rows.
const TARGET_TIME_OVER_FLOOR: f64 = 1.4;
/// Timed time per loop when `--iters` is not given (two loops a row: ~0.3 s).
const ADAPTIVE_LOOP_SECS: f64 = 0.15;
const ADAPTIVE_MIN_ITERS: usize = 5;
const ADAPTIVE_MAX_ITERS: usize = 1000;
/// Time spent on each thread count of one memcpy measurement.
const MEMCPY_SECS: f64 = 0.04;
const MEMCPY_MIN_REPEATS: usize = 5;
const MEMCPY_MAX_REPEATS: usize = 200;
/// The buffer of the header's memcpy ceiling.
const CEILING_BYTES: usize = 64 << 20;
/// Element `i` of replica `r`'s input is `(i % PERIOD) + r / 2`: every partial sum is a multiple
/// of 0.5 far below 2^23, so sums are exact in f32 in any order.
const PERIOD: usize = 251;

/// Which CPU cross-device implementation to time.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Impl {
    /// `CpuCrossDeviceOps::in_memory_all_reduce`: each replica thread reduces its own chunk.
    InMemory,
    /// `CpuCrossDeviceOps::reduction_to_one_device`: replica 0 reduces everything.
    ToOneDevice,
}

impl Impl {
    /// The cross-device ops for `n` replicas.
    pub fn build(self, n: usize) -> Result<CpuCrossDeviceOps> {
        Ok(match self {
            Impl::InMemory => CpuCrossDeviceOps::in_memory_all_reduce(n)?,
            Impl::ToOneDevice => CpuCrossDeviceOps::reduction_to_one_device(n)?,
        })
    }

    /// The flag value and the constructor, for the header.
    fn describe(self) -> &'static str {
        match self {
            Impl::InMemory => "in-memory (CpuCrossDeviceOps::in_memory_all_reduce)",
            Impl::ToOneDevice => "to-one-device (CpuCrossDeviceOps::reduction_to_one_device)",
        }
    }
}

fn parse_size(s: &str) -> std::result::Result<u64, String> {
    parse_bytes(s).map_err(|e| e.to_string())
}

fn parse_op(s: &str) -> std::result::Result<ReduceOp, String> {
    s.parse::<ReduceOp>().map_err(|e| e.to_string())
}

/// `strata bench allreduce`: time the all-reduce of this machine's replicas (`--local`) or of
/// worker processes on loopback (`--workers N`).
#[derive(clap::Args, Debug, Clone)]
pub struct AllreduceArgs {
    /// All-reduce between the replica threads of this machine.
    #[arg(long)]
    pub local: bool,
    /// All-reduce between this many worker processes on loopback (MultiWorkerMirrored's
    /// cross-worker ring); comma-separated counts run one after the other.
    #[arg(long, value_delimiter = ',', conflicts_with = "local")]
    pub workers: Vec<usize>,
    /// NCCL all-reduce across every visible GPU of this machine, beside the device-to-device
    /// copy bandwidth of the same GPUs (needs a build with `--features nccl` and a GPU).
    #[arg(long, conflicts_with_all = ["local", "workers"])]
    pub gpus: bool,
    /// Replica counts to time with --local, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    pub replicas: Vec<usize>,
    /// Smallest buffer per replica (bytes, or with a unit: 4KiB, 1MiB); sizes step x4.
    #[arg(long, value_parser = parse_size, default_value = "4KiB")]
    pub min_bytes: u64,
    /// Largest buffer per replica.
    #[arg(long, value_parser = parse_size, default_value = "256MiB")]
    pub max_bytes: u64,
    /// Reduction: sum, mean, max or min.
    #[arg(long, value_parser = parse_op, default_value = "sum")]
    pub op: ReduceOp,
    /// Timed iterations per row [default: adaptive, ~0.3 s a row, 5 to 1000].
    #[arg(long)]
    pub iters: Option<usize>,
    /// Untimed iterations before timing (the first one, always run, checks the result).
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// The implementation to time with --local.
    #[arg(long = "impl", value_enum, default_value_t = Impl::InMemory)]
    pub implementation: Impl,
    /// With --workers: the ring's pipelining chunk [default: the ring's default].
    #[arg(long, value_parser = parse_size)]
    pub chunk_bytes: Option<u64>,
    /// With --workers: the largest buffer exchanged directly with every peer instead of around
    /// the ring [default: the ring's default].
    #[arg(long, value_parser = parse_size)]
    pub small_bytes: Option<u64>,
    /// With --workers: time the reduce-scatter (each worker left with its segment of the
    /// reduced buffer, ZeRO's gradient reduction) instead of the all-reduce.
    #[arg(long)]
    pub reduce_scatter: bool,
    /// With --workers: time the all-gather (each worker contributes an even segment of the
    /// buffer and receives the others' into place, ZeRO's gather of the parameters) instead of
    /// the all-reduce; the size is the whole gathered buffer, as nccl-tests counts it.
    #[arg(long, conflicts_with = "reduce_scatter")]
    pub all_gather: bool,
    /// Internal: run as this rank of a --workers benchmark (started by the benchmark itself).
    #[arg(long, hide = true, requires = "worker_count")]
    pub worker_rank: Option<usize>,
    /// Internal: the number of workers of a --workers benchmark.
    #[arg(long, hide = true)]
    pub worker_count: Option<usize>,
    /// Internal: the raw socket throughput (Unix sockets, or loopback TCP with
    /// `STRATA_RING_UNIX=0`) measured by the launching process, GB/s.
    #[arg(long, hide = true)]
    pub tcp_ceiling: Option<f64>,
}

/// A validated benchmark plan.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Replica counts, in order (`--local`).
    pub replicas: Vec<usize>,
    /// Worker process counts, in order (`--workers`; empty with `--local`).
    pub workers: Vec<usize>,
    /// Bytes per replica buffer (multiples of 4: f32), in order.
    pub sizes: Vec<u64>,
    /// The reduction.
    pub op: ReduceOp,
    /// Timed iterations per row; `None`: adaptive.
    pub iters: Option<usize>,
    /// Untimed iterations per row (at least one runs).
    pub warmup: usize,
    /// The implementation (`--local`).
    pub implementation: Impl,
    /// The ring's pipelining chunk (`--workers`).
    pub chunk_bytes: usize,
    /// The ring's direct-exchange limit (`--workers`).
    pub small_bytes: usize,
    /// The cross-worker collective timed (`--workers`).
    pub collective: WorkerCollective,
}

/// The collective a --workers benchmark times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerCollective {
    /// `Ring::all_reduce`.
    AllReduce,
    /// `Ring::reduce_scatter` (each worker keeps its segment).
    ReduceScatter,
    /// `Ring::all_gather_into` (each worker contributes its segment).
    AllGather,
}

impl WorkerCollective {
    /// The number of times each byte crosses a link, over (N-1)/N: busbw = algbw * this * (N-1)/N.
    fn hops(self) -> f64 {
        match self {
            WorkerCollective::AllReduce => 2.0,
            WorkerCollective::ReduceScatter | WorkerCollective::AllGather => 1.0,
        }
    }
}

/// Sizes from `min` to `max` bytes (inclusive), stepping x4: 4KiB..256MiB gives 9 sizes.
pub fn sizes(min: u64, max: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut s = min;
    while s > 0 && s <= max {
        out.push(s);
        match s.checked_mul(4) {
            Some(next) => s = next,
            None => break,
        }
    }
    out
}

impl AllreduceArgs {
    /// Checks the flags and turns them into a [`Plan`].
    pub fn plan(&self) -> Result<Plan> {
        if !self.local && !self.gpus && self.workers.is_empty() && self.worker_rank.is_none() {
            return Err(Error::Usage(
                "strata bench allreduce: pass --local (the replicas of this machine), --workers N (N worker \
                 processes on loopback, MultiWorkerMirrored's cross-worker ring) or --gpus (NCCL across this \
                 machine's GPUs)"
                    .into(),
            ));
        }
        if self.workers.contains(&0) {
            return Err(Error::Usage(format!(
                "--workers {:?}: give one or more worker counts of at least 1, such as --workers 2,4",
                self.workers
            )));
        }
        let to_usize = |flag: &str, v: Option<u64>, default: usize| -> Result<usize> {
            match v {
                None => Ok(default),
                Some(b) => usize::try_from(b).map_err(|_| Error::Usage(format!("{flag} {b}: too large"))),
            }
        };
        let chunk_bytes = to_usize("--chunk-bytes", self.chunk_bytes, ring::DEFAULT_CHUNK_BYTES)?;
        if !(4..=ring::MAX_CHUNK_BYTES).contains(&chunk_bytes) {
            return Err(Error::Usage(format!(
                "--chunk-bytes {chunk_bytes}: use 4 bytes to {}",
                format_bytes(ring::MAX_CHUNK_BYTES as u64)
            )));
        }
        let small_bytes = to_usize("--small-bytes", self.small_bytes, ring::DEFAULT_SMALL_BYTES)?;
        let collective = match (self.reduce_scatter, self.all_gather) {
            (true, _) => WorkerCollective::ReduceScatter,
            (_, true) => WorkerCollective::AllGather,
            _ => WorkerCollective::AllReduce,
        };
        if collective != WorkerCollective::AllReduce && self.workers.is_empty() && self.worker_rank.is_none() {
            let flag = if self.reduce_scatter { "--reduce-scatter" } else { "--all-gather" };
            return Err(Error::Usage(format!("{flag} times a collective of the cross-worker ring: add --workers N")));
        }
        if self.replicas.is_empty() || self.replicas.contains(&0) {
            return Err(Error::Usage(format!(
                "--replicas {:?}: give one or more replica counts of at least 1, such as --replicas 2,4",
                self.replicas
            )));
        }
        if self.min_bytes < 4 {
            return Err(Error::Usage(format!(
                "--min-bytes {}: a buffer needs at least one f32 (4 bytes)",
                self.min_bytes
            )));
        }
        if self.min_bytes > self.max_bytes {
            return Err(Error::Usage(format!(
                "--min-bytes {} is larger than --max-bytes {}",
                format_bytes(self.min_bytes),
                format_bytes(self.max_bytes)
            )));
        }
        if self.iters == Some(0) {
            return Err(Error::Usage("--iters 0: time at least one iteration".into()));
        }
        // f32 buffers: round each size down to whole elements.
        let mut sizes: Vec<u64> = sizes(self.min_bytes, self.max_bytes).into_iter().map(|s| s / 4 * 4).collect();
        sizes.dedup();
        Ok(Plan {
            replicas: self.replicas.clone(),
            workers: self.workers.clone(),
            sizes,
            op: self.op,
            iters: self.iters,
            warmup: self.warmup,
            implementation: self.implementation,
            chunk_bytes,
            small_bytes,
            collective,
        })
    }
}

/// One measured row: `K` replicas all-reducing `bytes` each.
#[derive(Clone, Debug)]
pub struct Row {
    /// Replicas (`K`).
    pub replicas: usize,
    /// Bytes per replica buffer.
    pub bytes: u64,
    /// f32 elements per replica buffer.
    pub count: usize,
    /// The reduction.
    pub op: ReduceOp,
    /// Timed iterations of each loop.
    pub iters: usize,
    /// Median time of one all-reduce, the result read in place.
    pub time: Duration,
    /// Median time of one all-reduce that copies the result into every replica's own buffer.
    pub copy_time: Duration,
    /// Time to move `(K+1) * bytes` (read `K` buffers, write one) at the memcpy bandwidth.
    pub floor: Duration,
    /// The memcpy thread count that gave the floor.
    pub floor_threads: usize,
    /// Result elements that differ from the closed form, over every check and replica.
    pub wrong: usize,
}

impl Row {
    /// Algorithm bandwidth: bytes per replica / time, GB/s.
    pub fn algbw(&self) -> f64 {
        self.bytes as f64 / self.time.as_secs_f64().max(1e-12) / 1e9
    }

    /// Bus bandwidth, nccl-tests' all-reduce convention: algbw * 2(K-1)/K, GB/s.
    pub fn busbw(&self) -> f64 {
        let k = self.replicas as f64;
        self.algbw() * 2.0 * (k - 1.0) / k
    }

    /// How far the time is above the floor.
    pub fn time_over_floor(&self) -> f64 {
        self.time.as_secs_f64() / self.floor.as_secs_f64().max(1e-12)
    }
}

fn median(times: &mut [Duration]) -> Duration {
    if times.is_empty() {
        return Duration::ZERO;
    }
    times.sort_unstable();
    times[times.len() / 2]
}

fn median_f64(xs: &mut [f64]) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    xs.sort_by(f64::total_cmp);
    let m = xs.len() / 2;
    Some(if xs.len() % 2 == 1 { xs[m] } else { (xs[m - 1] + xs[m]) / 2.0 })
}

fn cores() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

// ---------------------------------------------------------------------------------------------
// The memcpy floor.

/// Median times to copy `src` into `dst` with `threads` persistent threads copying disjoint
/// parts (the calling thread copies the first); `repeats` rounds.
fn copy_median(src: &[u8], dst: &mut [u8], threads: usize, repeats: usize) -> Duration {
    let threads = threads.clamp(1, src.len().max(1));
    let mut times = Vec::with_capacity(repeats);
    if threads == 1 {
        for _ in 0..repeats {
            let t0 = Instant::now();
            dst.copy_from_slice(src);
            times.push(t0.elapsed());
        }
        return median(&mut times);
    }
    let part = src.len().div_ceil(threads);
    let go = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let mut parts = dst.chunks_mut(part).zip(src.chunks(part));
    let (own_dst, own_src) = parts.next().expect("a non-empty buffer has a first part");
    std::thread::scope(|s| {
        let helpers = parts.len();
        for (d, sr) in parts {
            let (go, done) = (&go, &done);
            s.spawn(move || {
                for round in 1..=repeats {
                    spin_until(|| go.load(Ordering::Acquire) >= round);
                    d.copy_from_slice(sr);
                    done.fetch_add(1, Ordering::Release);
                }
            });
        }
        for round in 1..=repeats {
            let t0 = Instant::now();
            go.store(round, Ordering::Release);
            own_dst.copy_from_slice(own_src);
            spin_until(|| done.load(Ordering::Acquire) >= round * helpers);
            times.push(t0.elapsed());
        }
    });
    median(&mut times)
}

fn spin_until(mut ready: impl FnMut() -> bool) {
    // Spin, yielding every 64 polls: there may be more threads than cores.
    let mut polls = 0u32;
    while !ready() {
        polls += 1;
        if polls == 64 {
            polls = 0;
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// The memcpy time of `bytes` bytes: the best over 1..=`max_threads` threads of the median of
/// several repeats, between two pre-faulted buffers. Returns the time and the thread count.
fn memcpy_time(bytes: usize, max_threads: usize) -> (Duration, usize) {
    let bytes = bytes.max(1);
    // Non-zero fills write every page, so nothing is faulted in while timed.
    let src = vec![1u8; bytes];
    let mut dst = vec![2u8; bytes];
    // A first copy warms the caches and gives the repeat count.
    let t0 = Instant::now();
    dst.copy_from_slice(&src);
    let once = t0.elapsed().as_secs_f64().max(1e-8);
    let repeats = ((MEMCPY_SECS / once).ceil() as usize).clamp(MEMCPY_MIN_REPEATS, MEMCPY_MAX_REPEATS);
    (1..=max_threads.max(1))
        .map(|t| (copy_median(&src, &mut dst, t, repeats), t))
        .min()
        .expect("at least one thread count")
}

// ---------------------------------------------------------------------------------------------
// The replicas.

/// Replica `r`'s input element `i`.
fn value(r: usize, i: usize) -> f32 {
    (i % PERIOD) as f32 + r as f32 * 0.5
}

/// The closed-form result at `i % PERIOD`; `Mean` accepts `sum * (1/K)` or `sum / K`.
struct Expected {
    main: Vec<f32>,
    alt: Vec<f32>,
}

impl Expected {
    fn new(op: ReduceOp, k: usize) -> Self {
        let kf = k as f32;
        // Sum over r of (j + r/2) = K*j + K(K-1)/4, exact in f32.
        let sum = |j: usize| kf * j as f32 + (k * (k - 1)) as f32 * 0.25;
        let (main, alt) = (0..PERIOD)
            .map(|j| match op {
                ReduceOp::Sum => (sum(j), sum(j)),
                ReduceOp::Mean => (sum(j) * (1.0 / kf), sum(j) / kf),
                ReduceOp::Max => (value(k - 1, j), value(k - 1, j)),
                ReduceOp::Min => (value(0, j), value(0, j)),
            })
            .unzip();
        Self { main, alt }
    }

    /// The elements of the result's part starting at element `start` that differ from the
    /// closed form.
    fn count_wrong_at(&self, start: usize, data: &[f32]) -> usize {
        let mut c = self.checker();
        c.j = start % PERIOD;
        c.piece(data);
        c.wrong
    }

    fn checker(&self) -> Checker<'_> {
        Checker { expected: self, seen: 0, j: 0, wrong: 0 }
    }
}

/// Checks consecutive result pieces against the closed form.
struct Checker<'a> {
    expected: &'a Expected,
    seen: usize,
    j: usize,
    wrong: usize,
}

impl Checker<'_> {
    fn piece(&mut self, piece: &[f32]) {
        let (main, alt) = (&self.expected.main, &self.expected.alt);
        for &x in piece {
            if x != main[self.j] && x != alt[self.j] {
                self.wrong += 1;
            }
            self.j += 1;
            if self.j == PERIOD {
                self.j = 0;
            }
        }
        self.seen += piece.len();
    }

    /// Mismatches, counting missing or extra elements as wrong.
    fn finish(self, count: usize) -> usize {
        self.wrong + self.seen.abs_diff(count)
    }
}

/// What every replica thread of a row shares.
struct RowCtx<'a> {
    ops: &'a CpuCrossDeviceOps,
    group: &'a ReplicaGroup,
    op: ReduceOp,
    count: usize,
    iters: Option<usize>,
    warmup: usize,
    expected: &'a Expected,
}

/// What one replica thread measured.
struct ReplicaOutcome {
    iters: usize,
    times: Vec<Duration>,
    copy_times: Vec<Duration>,
    wrong: usize,
}

/// Timed iterations for a row whose one iteration takes `per_iter` (~0.15 s of timing, 5 to 1000).
pub(crate) fn adaptive_iters(per_iter: Duration) -> usize {
    let t = per_iter.as_secs_f64().max(1e-9);
    ((ADAPTIVE_LOOP_SECS / t).ceil() as usize).clamp(ADAPTIVE_MIN_ITERS, ADAPTIVE_MAX_ITERS)
}

fn replica_main(ctx: &RowCtx<'_>, r: usize) -> Result<ReplicaOutcome> {
    let count = ctx.count;
    let input = vec![Tensor::from_vec((0..count).map(|i| value(r, i)).collect::<Vec<f32>>(), count, &Device::Cpu)?];
    // NaN, not zero: written now (so pre-faulted) and never mistaken for a result.
    let mut output = vec![f32::NAN; count];
    let start = OpKey { seq: 0, op: "bench allreduce: start".into(), shape: vec![] };
    let end = OpKey { seq: 0, op: "bench allreduce: end".into(), shape: vec![] };
    let mut seq = 0u64;
    let mut wrong = 0usize;

    // One iteration: all replicas meet, the all-reduce, all replicas meet; timed in between.
    let mut iterate = |out: &mut dyn FnMut(&[f32])| -> Result<Duration> {
        ctx.group.arrive(r, &start)?;
        let t0 = Instant::now();
        let (group, op, dest) = (ctx.group, ctx.op, Destination::AllReplicas);
        ctx.ops.reduce(ReduceRequest { group, replica: r, seq, op, dest, input: &input, weight: 1.0 }, out)?;
        seq += 1;
        ctx.group.arrive(r, &end)?;
        Ok(t0.elapsed())
    };

    // Warm-up; the first iteration checks every element in place.
    let mut check = ctx.expected.checker();
    let checked = iterate(&mut |p| check.piece(p))?;
    wrong += check.finish(count);
    let mut warm = Vec::new();
    let mut seen = 0usize;
    for _ in 1..ctx.warmup.max(1) {
        warm.push(iterate(&mut |p| seen += p.len())?);
    }
    wrong += seen.abs_diff(warm.len() * count);

    let iters = match ctx.iters {
        Some(n) => n,
        None => {
            // Replica 0 decides, from its warm-up, so that every replica runs the same count.
            // (The checked iteration is slower: it reads every element; the others are not.)
            let estimate = warm.iter().min().copied().unwrap_or(checked);
            let key = OpKey { seq: 0, op: "bench allreduce: iterations".into(), shape: vec![] };
            ctx.group.exchange(r, &key, adaptive_iters(estimate))?[0]
        }
    };

    // Timed: the result read in place (the pieces are only counted).
    let mut times = Vec::with_capacity(iters);
    let mut seen = 0usize;
    for _ in 0..iters {
        times.push(iterate(&mut |p| seen += p.len())?);
    }
    wrong += seen.abs_diff(iters * count);
    let mut check = ctx.expected.checker();
    iterate(&mut |p| check.piece(p))?;
    wrong += check.finish(count);

    // Timed: every replica copies the result into its own buffer.
    let mut copy_times = Vec::with_capacity(iters);
    let mut bad_len = 0usize;
    for _ in 0..iters {
        let mut at = 0usize;
        let mut overflow = 0usize;
        copy_times.push(iterate(&mut |p| {
            match output.get_mut(at..at + p.len()) {
                Some(dst) => dst.copy_from_slice(p),
                None => overflow += p.len(),
            }
            at += p.len();
        })?);
        bad_len += at.abs_diff(count).max(overflow);
    }
    let mut check = ctx.expected.checker();
    check.piece(&output);
    wrong += check.finish(count) + bad_len;

    Ok(ReplicaOutcome { iters, times, copy_times, wrong })
}

/// Measures one row: `k` replicas all-reducing `bytes` bytes each.
pub fn measure_row(plan: &Plan, k: usize, bytes: u64) -> Result<Row> {
    let count = usize::try_from(bytes / 4)
        .map_err(|_| Error::Usage(format!("{} does not fit in this machine's memory", format_bytes(bytes))))?;
    let bytes = count as u64 * 4;
    let threads = k.min(cores());
    let (floor, floor_threads) = memcpy_time((k + 1) * count * 4 / 2, threads);

    let ops = plan.implementation.build(k)?;
    let group = ReplicaGroup::new(k, DEFAULT_COLLECTIVE_TIMEOUT)?;
    let expected = Expected::new(plan.op, k);
    let ctx = RowCtx {
        ops: &ops,
        group: &group,
        op: plan.op,
        count,
        iters: plan.iters,
        warmup: plan.warmup,
        expected: &expected,
    };
    let outcomes: Vec<Result<ReplicaOutcome>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..k)
            .map(|r| {
                let ctx = &ctx;
                s.spawn(move || {
                    let res = replica_main(ctx, r);
                    if let Err(e) = &res {
                        // Release the peers now rather than at the collective deadline.
                        ctx.group.poison(format!("replica {r} failed in the all-reduce benchmark: {e}"));
                    }
                    res
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    });

    // Report the cause, not a peer's "the step was abandoned".
    let is_echo = |e: &Error| matches!(e, Error::Core(strata_core::Error::Scope(_)));
    if let Some(pos) = outcomes.iter().position(|o| o.as_ref().is_err_and(|e| !is_echo(e))) {
        return Err(outcomes.into_iter().nth(pos).and_then(|o| o.err()).expect("an error at pos"));
    }
    let mut wrong = 0;
    let mut first = None;
    for o in outcomes {
        let o = o?;
        wrong += o.wrong;
        first.get_or_insert(o);
    }
    let mut first = first.expect("at least one replica");
    Ok(Row {
        replicas: k,
        bytes,
        count,
        op: plan.op,
        iters: first.iters,
        time: median(&mut first.times),
        copy_time: median(&mut first.copy_times),
        floor,
        floor_threads,
        wrong,
    })
}

/// Measures every size of `plan` with `k` replicas, calling `on_row` as each row completes.
pub fn measure(plan: &Plan, k: usize, on_row: &mut dyn FnMut(&Row)) -> Result<Vec<Row>> {
    let mut rows = Vec::with_capacity(plan.sizes.len());
    for &bytes in &plan.sizes {
        let row = measure_row(plan, k, bytes)?;
        on_row(&row);
        rows.push(row);
    }
    Ok(rows)
}

// ---------------------------------------------------------------------------------------------
// Printing.

fn print_header(plan: &Plan) {
    let cores = cores();
    println!("# strata bench allreduce --local");
    println!(
        "# machine: {cores} cores (available parallelism), {} {}{}",
        std::env::consts::OS,
        std::env::consts::ARCH,
        super::common::cpu_model().map(|m| format!(", {m}")).unwrap_or_default()
    );
    println!("# implementation: {}", plan.implementation.describe());
    println!(
        "# op {}, f32, warmup {}, iters {}",
        plan.op,
        plan.warmup.max(1),
        match plan.iters {
            Some(n) => n.to_string(),
            None => format!(
                "adaptive (~{:.1} s a row, {ADAPTIVE_MIN_ITERS} to {ADAPTIVE_MAX_ITERS})",
                2.0 * ADAPTIVE_LOOP_SECS
            ),
        }
    );
    let per_thread: Vec<String> = memcpy_ceiling(cores)
        .into_iter()
        .map(|(t, d)| {
            let gbs = CEILING_BYTES as f64 / d.as_secs_f64().max(1e-12) / 1e9;
            format!("{t} thread{}: {gbs:.2} GB/s", if t == 1 { "" } else { "s" })
        })
        .collect();
    println!(
        "# memcpy ceiling ({} buffers, bytes copied per second; read+write traffic is twice that): {}",
        format_bytes(CEILING_BYTES as u64),
        per_thread.join(", ")
    );
    println!(
        "# floor = time to read K buffers once and write one result at the memcpy bandwidth measured now (best of 1..T threads)"
    );
    println!("# +copy = time when every replica also copies the result into its own buffer; time reads it in place");
}

/// The median time to copy [`CEILING_BYTES`] with each thread count from 1 to `max_threads`.
fn memcpy_ceiling(max_threads: usize) -> Vec<(usize, Duration)> {
    let src = vec![1u8; CEILING_BYTES];
    let mut dst = vec![2u8; CEILING_BYTES];
    dst.copy_from_slice(&src);
    (1..=max_threads.max(1)).map(|t| (t, copy_median(&src, &mut dst, t, 9))).collect()
}

fn print_table_header(k: usize) {
    println!("#");
    println!(
        "# {k} replica{} (threads), T = {} memcpy thread{}",
        if k == 1 { "" } else { "s" },
        k.min(cores()),
        if k.min(cores()) == 1 { "" } else { "s" }
    );
    println!(
        "# {:>10} {:>12} {:>6} {:>6} {:>11} {:>12} {:>12} {:>7} {:>11} {:>10} {:>11}",
        "size",
        "count",
        "type",
        "redop",
        "time(us)",
        "algbw(GB/s)",
        "busbw(GB/s)",
        "#wrong",
        "floor(us)",
        "time/floor",
        "+copy(us)"
    );
}

fn print_row(row: &Row) {
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "  {:>10} {:>12} {:>6} {:>6} {:>11.1} {:>12.2} {:>12.2} {:>7} {:>11.1} {:>10.2} {:>11.1}",
        row.bytes,
        row.count,
        "float",
        row.op.to_string(),
        us(row.time),
        row.algbw(),
        row.busbw(),
        row.wrong,
        us(row.floor),
        row.time_over_floor(),
        us(row.copy_time)
    );
}

/// The median time/floor over the rows of at least 16 MiB, if any.
pub fn summary(rows: &[Row]) -> Option<f64> {
    let mut xs: Vec<f64> = rows.iter().filter(|r| r.bytes >= SUMMARY_MIN_BYTES).map(Row::time_over_floor).collect();
    median_f64(&mut xs)
}

fn print_summary(k: usize, rows: &[Row]) {
    match summary(rows) {
        Some(x) => println!(
            "# K={k}: median time/floor over rows >= {}: {x:.2}x, {} the {TARGET_TIME_OVER_FLOOR}x target",
            format_bytes(SUMMARY_MIN_BYTES),
            if x <= TARGET_TIME_OVER_FLOOR { "meets" } else { "misses" }
        ),
        None => println!(
            "# K={k}: no rows >= {} to compare with the {TARGET_TIME_OVER_FLOOR}x target (raise --max-bytes)",
            format_bytes(SUMMARY_MIN_BYTES)
        ),
    }
}

/// Runs the benchmark of `plan` (`args` checked) on CPU replicas, or on worker processes with
/// `--workers`, and prints an nccl-tests style table to stdout. Fails if any result differed
/// from the closed form (after printing every row). `--gpus` is [`super::gpu::run`]'s
/// ([`super::allreduce()`] picks).
pub fn run_plan(args: &AllreduceArgs, plan: &Plan) -> Result<()> {
    if let Some(rank) = args.worker_rank {
        return worker_main(plan, rank, args.worker_count.unwrap_or(0), args.tcp_ceiling);
    }
    if !plan.workers.is_empty() {
        return run_workers(args, plan);
    }
    print_header(plan);
    let mut wrong = 0usize;
    let mut busbw = Vec::new();
    for &k in &plan.replicas {
        print_table_header(k);
        let rows = measure(plan, k, &mut print_row)?;
        print_summary(k, &rows);
        wrong += rows.iter().map(|r| r.wrong).sum::<usize>();
        busbw.extend(rows.iter().map(Row::busbw));
    }
    println!("#");
    println!("# wrong values: {wrong} {}", if wrong == 0 { "OK" } else { "FAILED" });
    println!("# avg bus bandwidth: {:.3} GB/s", busbw.iter().sum::<f64>() / busbw.len().max(1) as f64);
    if wrong > 0 {
        return Err(Error::io(
            "strata bench allreduce",
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{wrong} all-reduce result values differ from the closed form (see #wrong)"),
            ),
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// --workers: the cross-worker ring between processes on loopback.

/// The environment variable that hands the cluster token to the worker processes.
const TOKEN_ENV: &str = "STRATA_BENCH_TOKEN";
/// The deadline of each collective in a worker.
const WORKER_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(300);
/// How long the launcher waits for the workers to report their ports.
const WORKER_START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long one group of workers may run.
const WORKER_GROUP_TIMEOUT: Duration = Duration::from_secs(3600);
/// Bytes per timed stream of the raw TCP ceiling, and the write size.
const TCP_CEILING_BYTES: usize = 512 << 20;
const TCP_WRITE_BYTES: usize = 4 << 20;

fn transport_error(e: strata_transport::Error) -> Error {
    Error::Core(e.into())
}

/// One measured row of the cross-worker benchmark.
#[derive(Clone, Debug)]
pub struct WorkerRow {
    /// Worker processes.
    pub workers: usize,
    /// Bytes per worker buffer.
    pub bytes: u64,
    /// f32 elements per buffer.
    pub count: usize,
    /// The reduction.
    pub op: ReduceOp,
    /// The collective timed.
    pub collective: WorkerCollective,
    /// Timed iterations.
    pub iters: usize,
    /// The slowest worker's median time of one collective.
    pub time: Duration,
    /// Result elements that differ from the closed form, over every iteration and worker.
    pub wrong: u64,
}

impl WorkerRow {
    /// Algorithm bandwidth: bytes per worker / time, GB/s.
    pub fn algbw(&self) -> f64 {
        self.bytes as f64 / self.time.as_secs_f64().max(1e-12) / 1e9
    }

    /// Bus bandwidth, nccl-tests' convention: algbw * 2(N-1)/N for the all-reduce, algbw *
    /// (N-1)/N for the reduce-scatter (each byte crosses a link once, not twice), GB/s.
    pub fn busbw(&self) -> f64 {
        let n = self.workers as f64;
        self.algbw() * self.collective.hops() * (n - 1.0) / n
    }
}

/// The raw throughput of the sockets the ring runs on between processes of this host, GB/s per
/// stream: one stream alone, and each of two streams running in opposite directions at once
/// (what every link of a ring of two carries). Unix stream sockets with the ring's buffers
/// (`unix`), else loopback TCP.
pub fn stream_ceiling(unix: bool) -> Result<(f64, f64)> {
    let mut one = Vec::new();
    let mut two = Vec::new();
    for _ in 0..3 {
        one.push(socket_streams(unix, 1)?);
        two.push(socket_streams(unix, 2)?);
    }
    Ok((median_f64(&mut one).unwrap_or(0.0), median_f64(&mut two).unwrap_or(0.0)))
}

/// Runs `streams` streams of [`TCP_CEILING_BYTES`] at once over one connection (the second in
/// the opposite direction); GB/s per stream.
fn socket_streams(unix: bool, streams: usize) -> Result<f64> {
    let io = |what: &str, e: std::io::Error| Error::io(format!("measuring the socket ceiling: {what}"), e);
    if unix {
        let (a, b) = std::os::unix::net::UnixStream::pair().map_err(|e| io("socket pair", e))?;
        for s in [&a, &b] {
            let sock = socket2::SockRef::from(s);
            let _ = sock.set_send_buffer_size(strata_transport::ring::UNIX_BUFFER);
            let _ = sock.set_recv_buffer_size(strata_transport::ring::UNIX_BUFFER);
        }
        let pairs = [(a.try_clone(), b.try_clone()), (b.try_clone(), a.try_clone())];
        return timed_streams(pairs, streams).map_err(|e| io("transfer", e));
    }
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| io("bind", e))?;
    let addr = listener.local_addr().map_err(|e| io("local address", e))?;
    let dialed = TcpStream::connect(addr).map_err(|e| io("connect", e))?;
    let (accepted, _) = listener.accept().map_err(|e| io("accept", e))?;
    for s in [&dialed, &accepted] {
        s.set_nodelay(true).map_err(|e| io("TCP_NODELAY", e))?;
    }
    let pairs = [(dialed.try_clone(), accepted.try_clone()), (accepted.try_clone(), dialed.try_clone())];
    timed_streams(pairs, streams).map_err(|e| io("transfer", e))
}

/// Writes [`TCP_CEILING_BYTES`] from the writer of each of the first `streams` pairs and reads
/// them at its reader, all at once; GB/s per stream.
fn timed_streams<S: Read + Write + Send>(
    pairs: [(std::io::Result<S>, std::io::Result<S>); 2],
    streams: usize,
) -> std::io::Result<f64> {
    let t0 = Instant::now();
    let moved: Vec<std::io::Result<usize>> = std::thread::scope(|s| {
        let mut handles = Vec::new();
        for (w, r) in pairs.into_iter().take(streams) {
            let (mut w, mut r) = (w?, r?);
            handles.push(s.spawn(move || -> std::io::Result<usize> {
                let buf = vec![7u8; TCP_WRITE_BYTES];
                let mut sent = 0;
                while sent < TCP_CEILING_BYTES {
                    w.write_all(&buf)?;
                    sent += buf.len();
                }
                Ok(sent)
            }));
            handles.push(s.spawn(move || -> std::io::Result<usize> {
                let mut buf = vec![0u8; TCP_WRITE_BYTES];
                let mut got = 0;
                while got < TCP_CEILING_BYTES {
                    match r.read(&mut buf)? {
                        0 => break,
                        k => got += k,
                    }
                }
                Ok(got)
            }));
        }
        Ok::<_, std::io::Error>(
            handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect(),
        )
    })?;
    let elapsed = t0.elapsed().as_secs_f64().max(1e-9);
    for m in moved {
        m?;
    }
    Ok(TCP_CEILING_BYTES as f64 / elapsed / 1e9)
}

/// Kills the worker processes that are still running when dropped.
struct WorkerGroup(Vec<Child>);

impl Drop for WorkerGroup {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

fn run_workers(args: &AllreduceArgs, plan: &Plan) -> Result<()> {
    println!(
        "# strata bench allreduce --workers {}",
        plan.workers.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
    );
    println!(
        "# machine: {} cores (available parallelism), {} {}{}",
        cores(),
        std::env::consts::OS,
        std::env::consts::ARCH,
        super::common::cpu_model().map(|m| format!(", {m}")).unwrap_or_default()
    );
    let unix = strata_transport::ring::RingConfig::new(0, Vec::new()).unix_sockets;
    println!(
        "# transport: strata_transport::ring over {} (one process per worker); ring all-reduce above \
         {}, direct exchange up to it; chunk {}",
        if unix {
            "Unix sockets between the processes of this host (STRATA_RING_UNIX=0: loopback TCP)"
        } else {
            "loopback TCP (STRATA_RING_UNIX=0)"
        },
        format_bytes(plan.small_bytes as u64),
        format_bytes(plan.chunk_bytes as u64)
    );
    println!(
        "# {}, op {}, f32, warmup {}, iters {}; time = the slowest worker's median of (refill, barrier, timed \
         collective, barrier, check)",
        collective_name(plan),
        plan.op,
        plan.warmup.max(1),
        match plan.iters {
            Some(n) => n.to_string(),
            None => format!("adaptive (~{ADAPTIVE_LOOP_SECS} s a row, {ADAPTIVE_MIN_ITERS} to {ADAPTIVE_MAX_ITERS})"),
        }
    );
    let (one, two) = stream_ceiling(unix)?;
    println!(
        "# raw {} ceiling (measured now, {} writes): one stream {one:.2} GB/s; two streams in opposite \
         directions at once {two:.2} GB/s each",
        if unix { "Unix socket" } else { "loopback TCP" },
        format_bytes(TCP_WRITE_BYTES as u64)
    );
    for &n in &plan.workers {
        run_group(args, plan, n, one)?;
    }
    Ok(())
}

/// The collective a --workers plan times.
fn collective_name(plan: &Plan) -> &'static str {
    match plan.collective {
        WorkerCollective::AllReduce => "all_reduce (busbw = algbw * 2(N-1)/N)",
        WorkerCollective::ReduceScatter => "reduce_scatter (each worker keeps its segment; busbw = algbw * (N-1)/N)",
        WorkerCollective::AllGather => {
            "all_gather (each worker gives an even segment of size; busbw = algbw * (N-1)/N)"
        }
    }
}

/// The arguments that give a worker the same plan as this process.
fn worker_args(args: &AllreduceArgs, plan: &Plan, rank: usize, n: usize, ceiling: f64) -> Vec<String> {
    let mut a: Vec<String> = vec!["bench".into(), "allreduce".into()];
    let mut flag = |k: &str, v: String| {
        a.push(k.into());
        a.push(v);
    };
    flag("--worker-rank", rank.to_string());
    flag("--worker-count", n.to_string());
    flag("--min-bytes", args.min_bytes.to_string());
    flag("--max-bytes", args.max_bytes.to_string());
    flag("--op", plan.op.to_string());
    flag("--warmup", plan.warmup.to_string());
    flag("--chunk-bytes", plan.chunk_bytes.to_string());
    flag("--small-bytes", plan.small_bytes.to_string());
    flag("--tcp-ceiling", format!("{ceiling:.4}"));
    if let Some(i) = plan.iters {
        flag("--iters", i.to_string());
    }
    match plan.collective {
        WorkerCollective::AllReduce => {}
        WorkerCollective::ReduceScatter => a.push("--reduce-scatter".into()),
        WorkerCollective::AllGather => a.push("--all-gather".into()),
    }
    a
}

/// Starts `n` workers, gives them each other's addresses, forwards rank 0's table, and fails
/// (stopping the others) as soon as one worker fails.
fn run_group(args: &AllreduceArgs, plan: &Plan, n: usize, ceiling: f64) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| Error::io("finding the strata executable", e))?;
    let token = format!("{:016x}{:016x}", rand::random::<u64>(), rand::random::<u64>());
    let (tx, rx) = mpsc::channel::<(usize, String)>();
    let mut group = WorkerGroup(Vec::with_capacity(n));
    for r in 0..n {
        let mut child = Command::new(&exe)
            .args(worker_args(args, plan, r, n, ceiling))
            .env(TOKEN_ENV, &token)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| Error::io(format!("starting worker {r} ({})", exe.display()), e))?;
        if let Some(out) = child.stdout.take() {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(std::result::Result::ok) {
                    if tx.send((r, line)).is_err() {
                        break;
                    }
                }
            });
        }
        group.0.push(child);
    }
    drop(tx);
    let failed = |group: &mut WorkerGroup| -> Option<Error> {
        group.0.iter_mut().enumerate().find_map(|(r, c)| match c.try_wait() {
            Ok(Some(s)) if !s.success() => Some(Error::io(
                format!("strata bench allreduce --workers {n}"),
                std::io::Error::other(format!("worker {r} failed ({s}); its error is above")),
            )),
            _ => None,
        })
    };

    // Ports first.
    let started = Instant::now();
    let mut ports: Vec<Option<u16>> = vec![None; n];
    while ports.iter().any(Option::is_none) {
        if let Some(e) = failed(&mut group) {
            return Err(e);
        }
        if started.elapsed() > WORKER_START_TIMEOUT {
            return Err(Error::io(
                "strata bench allreduce",
                std::io::Error::new(std::io::ErrorKind::TimedOut, "the workers did not report their ports within 60 s"),
            ));
        }
        if let Ok((r, line)) = rx.recv_timeout(Duration::from_millis(100)) {
            if let Some(p) = line.strip_prefix("PORT ").and_then(|p| p.trim().parse().ok()) {
                ports[r] = Some(p);
            }
        }
    }
    let addrs: Vec<String> = ports.iter().flatten().map(|p| format!("127.0.0.1:{p}")).collect();
    for c in &mut group.0 {
        if let Some(stdin) = c.stdin.as_mut() {
            writeln!(stdin, "ADDRS {}", addrs.join(","))
                .map_err(|e| Error::io("handing the workers their peers", e))?;
        }
    }

    // Then rank 0's table, until every worker has exited.
    let started = Instant::now();
    loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok((0, line)) => println!("{line}"),
            Ok(_) => {}
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if let Some(e) = failed(&mut group) {
            return Err(e);
        }
        if started.elapsed() > WORKER_GROUP_TIMEOUT {
            return Err(Error::io(
                "strata bench allreduce",
                std::io::Error::new(std::io::ErrorKind::TimedOut, "the workers ran for more than an hour"),
            ));
        }
    }
    for (r, c) in group.0.iter_mut().enumerate() {
        let s = c.wait().map_err(|e| Error::io(format!("waiting for worker {r}"), e))?;
        if !s.success() {
            return Err(Error::io(
                format!("strata bench allreduce --workers {n}"),
                std::io::Error::other(format!("worker {r} failed ({s}); its error is above")),
            ));
        }
    }
    Ok(())
}

/// A worker process: reports its port, learns its peers, and runs every row.
fn worker_main(plan: &Plan, rank: usize, n: usize, ceiling: Option<f64>) -> Result<()> {
    if n == 0 || rank >= n {
        return Err(Error::Usage(format!("--worker-rank {rank} --worker-count {n}: the rank must be below the count")));
    }
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| Error::io("binding a worker's ring port", e))?;
    let port = listener.local_addr().map_err(|e| Error::io("a worker's ring port", e))?.port();
    println!("PORT {port}");
    std::io::stdout().flush().map_err(|e| Error::io("reporting a worker's port", e))?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).map_err(|e| Error::io("reading the workers' addresses", e))?;
    let addresses: Vec<SocketAddr> = line
        .trim()
        .strip_prefix("ADDRS ")
        .unwrap_or_default()
        .split(',')
        .filter(|a| !a.is_empty())
        .map(|a| a.parse().map_err(|_| Error::Usage(format!("worker address {a:?} is not host:port"))))
        .collect::<Result<_>>()?;
    if addresses.len() != n {
        return Err(Error::Usage(format!("{} worker addresses for {n} workers", addresses.len())));
    }
    let mut cfg = RingConfig::new(rank, addresses);
    cfg.listener = Some(listener);
    cfg.token = std::env::var(TOKEN_ENV).ok();
    cfg.fingerprint = format!(
        "strata bench allreduce: {n} workers, {} sizes, op {}, {}",
        plan.sizes.len(),
        plan.op,
        collective_name(plan)
    );
    cfg.timeout = WORKER_COLLECTIVE_TIMEOUT;
    cfg.connect_timeout = WORKER_START_TIMEOUT;
    cfg.chunk_bytes = plan.chunk_bytes;
    cfg.small_bytes = plan.small_bytes;
    let ring = Ring::connect(cfg, AbortSignal::new()).map_err(transport_error)?;

    if rank == 0 {
        print_worker_table_header(n);
    }
    let mut step = 0u64;
    let mut rows = Vec::with_capacity(plan.sizes.len());
    for &bytes in &plan.sizes {
        let row = measure_worker_row(&ring, plan, bytes, &mut step)?;
        if rank == 0 {
            print_worker_row(&row, ceiling);
        }
        rows.push(row);
    }
    if rank == 0 {
        print_worker_summary(n, &rows);
    }
    let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
    if wrong > 0 {
        return Err(Error::io(
            "strata bench allreduce",
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{wrong} {} result values differ from the closed form (see #wrong)", collective_name(plan)),
            ),
        ));
    }
    Ok(())
}

/// Measures one row on this worker; every worker returns the same row.
pub fn measure_worker_row(ring: &Ring, plan: &Plan, bytes: u64, step: &mut u64) -> Result<WorkerRow> {
    let (rank, n) = (ring.rank(), ring.size());
    let count = usize::try_from(bytes / 4)
        .map_err(|_| Error::Usage(format!("{} does not fit in this machine's memory", format_bytes(bytes))))?;
    let input: Vec<f32> = (0..count).map(|i| value(rank, i)).collect();
    let mut data = input.clone();
    let expected = Expected::new(plan.op, n);
    // --all-gather: worker k gives elements [k*count/n, (k+1)*count/n) of its input.
    let edge = |k: usize| (count as u128 * k as u128 / n as u128) as usize;
    let gather_counts: Vec<usize> = (0..n).map(|k| edge(k + 1) - edge(k)).collect();
    let mut wrong = 0u64;
    let mut one = |data: &mut Vec<f32>, step: &mut u64| -> Result<Duration> {
        data.copy_from_slice(&input);
        ring.barrier(*step).map_err(transport_error)?;
        let t0 = Instant::now();
        let reduced = match plan.collective {
            WorkerCollective::ReduceScatter => {
                ring.reduce_scatter(*step + 1, plan.op, data).map_err(transport_error)?
            }
            WorkerCollective::AllReduce => {
                ring.all_reduce(*step + 1, plan.op, data).map_err(transport_error)?;
                0..data.len()
            }
            WorkerCollective::AllGather => {
                let at = gather_counts[..rank].iter().sum::<usize>();
                let mine = &input[at..at + gather_counts[rank]];
                ring.all_gather_into(*step + 1, mine, data, &gather_counts).map_err(transport_error)?;
                0..0
            }
        };
        let t = t0.elapsed();
        // Nobody checks (untimed work) while a slower worker is still in its timed collective.
        ring.barrier(*step + 2).map_err(transport_error)?;
        *step += 3;
        if plan.collective == WorkerCollective::AllGather {
            // Element i comes from the worker whose segment holds it.
            let mut at = 0;
            for (owner, &c) in gather_counts.iter().enumerate() {
                wrong += (at..at + c).filter(|&i| data[i].to_bits() != value(owner, i).to_bits()).count() as u64;
                at += c;
            }
        } else {
            wrong += expected.count_wrong_at(reduced.start, &data[reduced]) as u64;
        }
        Ok(t)
    };
    let mut warm = Vec::new();
    for _ in 0..plan.warmup.max(1) {
        warm.push(one(&mut data, step)?);
    }
    let iters = match plan.iters {
        Some(i) => i,
        None => {
            // Rank 0 decides, so that every worker runs the same count.
            let mut v = [adaptive_iters(warm.iter().min().copied().unwrap_or_default()) as f32];
            ring.broadcast(*step, 0, &mut v).map_err(transport_error)?;
            *step += 1;
            v[0] as usize
        }
    };
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        times.push(one(&mut data, step)?);
    }
    // The slowest worker's median, and every worker's wrong count (split to stay exact in f32).
    let mut slowest = [median(&mut times).as_secs_f64() as f32];
    ring.all_reduce(*step, ReduceOp::Max, &mut slowest).map_err(transport_error)?;
    let mut w = [(wrong >> 20) as f32, (wrong & 0xf_ffff) as f32];
    ring.all_reduce(*step + 1, ReduceOp::Sum, &mut w).map_err(transport_error)?;
    *step += 2;
    Ok(WorkerRow {
        workers: n,
        bytes: count as u64 * 4,
        count,
        op: plan.op,
        collective: plan.collective,
        iters,
        time: Duration::from_secs_f64(f64::from(slowest[0]).max(0.0)),
        wrong: ((w[0] as u64) << 20) + w[1] as u64,
    })
}

fn print_worker_table_header(n: usize) {
    println!("#");
    println!("# {n} worker processes");
    println!(
        "# {:>10} {:>12} {:>6} {:>6} {:>11} {:>12} {:>12} {:>7} {:>10} {:>6}",
        "size", "count", "type", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong", "busbw/ceil", "iters"
    );
}

fn print_worker_row(row: &WorkerRow, ceiling: Option<f64>) {
    let ratio = match ceiling {
        Some(c) if c > 0.0 => format!("{:.2}", row.busbw() / c),
        _ => "-".into(),
    };
    println!(
        "  {:>10} {:>12} {:>6} {:>6} {:>11.1} {:>12.3} {:>12.3} {:>7} {:>10} {:>6}",
        row.bytes,
        row.count,
        "float",
        row.op.to_string(),
        row.time.as_secs_f64() * 1e6,
        row.algbw(),
        row.busbw(),
        row.wrong,
        ratio,
        row.iters
    );
}

fn print_worker_summary(n: usize, rows: &[WorkerRow]) {
    if let Some(small) = rows.iter().min_by_key(|r| r.bytes) {
        println!(
            "# {n} workers: median latency at {}: {:.1} us",
            format_bytes(small.bytes),
            small.time.as_secs_f64() * 1e6
        );
    }
    let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
    println!("# {n} workers: wrong values: {wrong} {}", if wrong == 0 { "OK" } else { "FAILED" });
    let avg = rows.iter().map(WorkerRow::busbw).sum::<f64>() / rows.len().max(1) as f64;
    println!("# {n} workers: avg bus bandwidth: {avg:.3} GB/s");
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    const KIB: u64 = 1 << 10;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        args: AllreduceArgs,
    }

    fn args(flags: &[&str]) -> AllreduceArgs {
        Cli::try_parse_from(std::iter::once("bench").chain(flags.iter().copied())).unwrap().args
    }

    #[test]
    fn sizes_step_by_four_from_min_to_max() {
        let s = sizes(4 * KIB, 256 * MIB);
        assert_eq!(s.len(), 9);
        assert_eq!(s[0], 4096);
        assert_eq!(s[1], 16384);
        assert_eq!(*s.last().unwrap(), 256 * MIB);
        assert_eq!(sizes(4 * KIB, 16 * KIB), vec![4096, 16384]);
        assert_eq!(sizes(4 * KIB, 60 * KIB), vec![4096, 16384]);
        assert!(sizes(8 * KIB, 4 * KIB).is_empty());
    }

    #[test]
    fn defaults_and_flags() {
        let a = args(&["--local"]);
        assert_eq!(a.replicas, vec![2, 4]);
        assert_eq!((a.min_bytes, a.max_bytes), (4 * KIB, 256 * MIB));
        assert_eq!(a.op, ReduceOp::Sum);
        assert_eq!((a.iters, a.warmup, a.implementation), (None, 3, Impl::InMemory));
        assert_eq!(a.plan().unwrap().sizes.len(), 9);

        let a = args(&["--local", "--replicas", "3", "--min-bytes", "1MiB", "--max-bytes", "4MiB", "--op", "mean"]);
        assert_eq!(a.replicas, vec![3]);
        assert_eq!(a.plan().unwrap().sizes, vec![MIB, 4 * MIB]);
        assert_eq!(a.op, ReduceOp::Mean);
        assert_eq!(args(&["--local", "--impl", "to-one-device"]).implementation, Impl::ToOneDevice);
        assert!(Cli::try_parse_from(["bench", "--op", "prod"]).is_err());
        assert!(Cli::try_parse_from(["bench", "--min-bytes", "lots"]).is_err());
    }

    #[test]
    fn without_local_is_a_usage_error() {
        let e = args(&[]).plan().unwrap_err();
        assert!(matches!(&e, Error::Usage(m) if m.contains("--local") && m.contains("--workers N")), "{e}");
        assert_eq!(e.exit_code(), 2);
        assert!(matches!(args(&["--local", "--replicas", "0"]).plan(), Err(Error::Usage(_))));
        assert!(matches!(
            args(&["--local", "--min-bytes", "1MiB", "--max-bytes", "4KiB"]).plan(),
            Err(Error::Usage(_))
        ));
    }

    #[test]
    fn closed_form_is_what_a_reduction_gives() {
        for op in ReduceOp::ALL {
            for k in 1..=5 {
                let e = Expected::new(op, k);
                for j in [0, 1, 17, PERIOD - 1] {
                    let mut acc: Vec<f32> = vec![value(0, j)];
                    for r in 1..k {
                        op.combine(&mut acc, &[value(r, j)]);
                    }
                    op.finish(&mut acc, k);
                    assert_eq!(acc[0], e.main[j], "{op} k={k} j={j}");
                }
            }
        }
    }

    #[test]
    fn the_checker_counts_wrong_missing_and_extra_elements() {
        let e = Expected::new(ReduceOp::Sum, 2);
        let good: Vec<f32> = (0..600).map(|i| value(0, i) + value(1, i)).collect();
        let mut c = e.checker();
        c.piece(&good[..100]);
        c.piece(&good[100..]);
        assert_eq!(c.finish(600), 0);
        let mut bad = good.clone();
        bad[7] += 1.0;
        bad[300] = f32::NAN;
        let mut c = e.checker();
        c.piece(&bad);
        assert_eq!(c.finish(600), 2);
        let mut c = e.checker();
        c.piece(&good[..590]);
        assert_eq!(c.finish(600), 10);
        // A segment is checked against the closed form at its own offset.
        assert_eq!(e.count_wrong_at(250, &good[250..]), 0);
        assert_eq!(e.count_wrong_at(250, &bad[250..]), 1);
        assert_eq!(e.count_wrong_at(251, &good[250..]), 350);
    }

    #[test]
    fn tiny_end_to_end_run_has_no_wrong_values() {
        for (implementation, op) in [(Impl::InMemory, ReduceOp::Sum), (Impl::ToOneDevice, ReduceOp::Mean)] {
            let plan = Plan {
                replicas: vec![2],
                sizes: sizes(4 * KIB, 16 * KIB),
                op,
                iters: Some(3),
                warmup: 1,
                implementation,
                workers: vec![],
                chunk_bytes: ring::DEFAULT_CHUNK_BYTES,
                small_bytes: ring::DEFAULT_SMALL_BYTES,
                collective: WorkerCollective::AllReduce,
            };
            let mut printed = 0;
            let rows = measure(&plan, 2, &mut |_| printed += 1).unwrap();
            assert_eq!((rows.len(), printed), (2, 2));
            for row in &rows {
                assert_eq!(row.wrong, 0, "{row:?}");
                assert_eq!((row.replicas, row.iters, row.count), (2, 3, row.bytes as usize / 4));
                assert!(row.time > Duration::ZERO && row.copy_time > Duration::ZERO && row.floor > Duration::ZERO);
                assert!(row.algbw() > 0.0 && (row.busbw() - row.algbw()).abs() < 1e-9, "K=2: busbw = algbw");
            }
        }
        // Adaptive iteration counts agree across replicas (exchanged from replica 0).
        let plan = Plan {
            replicas: vec![3],
            sizes: vec![4 * KIB],
            op: ReduceOp::Max,
            iters: None,
            warmup: 2,
            implementation: Impl::InMemory,
            workers: vec![],
            chunk_bytes: ring::DEFAULT_CHUNK_BYTES,
            small_bytes: ring::DEFAULT_SMALL_BYTES,
            collective: WorkerCollective::AllReduce,
        };
        let rows = measure(&plan, 3, &mut |_| {}).unwrap();
        assert_eq!(rows[0].wrong, 0);
        assert!((ADAPTIVE_MIN_ITERS..=ADAPTIVE_MAX_ITERS).contains(&rows[0].iters));
    }

    #[test]
    fn workers_flags_and_the_worker_command_line_give_the_same_plan() {
        let a = args(&[
            "--workers",
            "2,4",
            "--min-bytes",
            "1MiB",
            "--max-bytes",
            "16MiB",
            "--op",
            "max",
            "--chunk-bytes",
            "64KiB",
            "--reduce-scatter",
        ]);
        let plan = a.plan().unwrap();
        assert_eq!((plan.workers.clone(), plan.sizes.clone()), (vec![2, 4], vec![MIB, 4 * MIB, 16 * MIB]));
        assert_eq!((plan.chunk_bytes, plan.small_bytes), (64 << 10, ring::DEFAULT_SMALL_BYTES));
        let argv = worker_args(&a, &plan, 1, 4, 2.5);
        assert_eq!(&argv[..2], ["bench", "allreduce"]);
        let w = Cli::try_parse_from(std::iter::once("bench").chain(argv[2..].iter().map(String::as_str))).unwrap().args;
        assert_eq!((w.worker_rank, w.worker_count, w.tcp_ceiling), (Some(1), Some(4), Some(2.5)));
        assert!(plan.collective == WorkerCollective::ReduceScatter && w.reduce_scatter);
        let wp = w.plan().unwrap();
        assert_eq!(
            (wp.sizes, wp.op, wp.chunk_bytes, wp.small_bytes, wp.iters),
            (plan.sizes, ReduceOp::Max, 64 << 10, plan.small_bytes, None)
        );
        assert!(Cli::try_parse_from(["bench", "--local", "--workers", "2"]).is_err());
        assert!(matches!(args(&["--workers", "0"]).plan(), Err(Error::Usage(_))));
        assert!(matches!(args(&["--workers", "2", "--chunk-bytes", "2"]).plan(), Err(Error::Usage(_))));
        assert!(
            matches!(args(&["--local", "--reduce-scatter"]).plan(), Err(Error::Usage(m)) if m.contains("--workers"))
        );
        assert!(
            matches!(args(&["--local", "--all-gather"]).plan(), Err(Error::Usage(m)) if m.contains("--all-gather"))
        );
        let g = args(&["--workers", "3", "--all-gather"]);
        assert_eq!(g.plan().unwrap().collective, WorkerCollective::AllGather);
        assert!(worker_args(&g, &g.plan().unwrap(), 1, 3, 1.0).contains(&"--all-gather".to_string()));
        assert!(Cli::try_parse_from(["bench", "--workers", "2", "--all-gather", "--reduce-scatter"]).is_err());
    }

    #[test]
    fn worker_rows_on_a_ring_of_threads_have_no_wrong_values() {
        worker_rows_have_no_wrong_values(WorkerCollective::AllReduce);
        worker_rows_have_no_wrong_values(WorkerCollective::ReduceScatter);
        worker_rows_have_no_wrong_values(WorkerCollective::AllGather);
    }

    fn worker_rows_have_no_wrong_values(collective: WorkerCollective) {
        let n = 3;
        let listeners: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        let plan = Plan {
            replicas: vec![],
            workers: vec![n],
            sizes: vec![4096, MIB],
            op: ReduceOp::Mean,
            iters: None,
            warmup: 1,
            implementation: Impl::InMemory,
            chunk_bytes: 4096 + 4,
            small_bytes: ring::DEFAULT_SMALL_BYTES,
            collective,
        };
        let rows: Vec<Vec<WorkerRow>> = std::thread::scope(|s| {
            let handles: Vec<_> = listeners
                .into_iter()
                .enumerate()
                .map(|(r, l)| {
                    let (addrs, plan) = (addrs.clone(), &plan);
                    s.spawn(move || {
                        let mut cfg = RingConfig::new(r, addrs);
                        cfg.listener = Some(l);
                        cfg.chunk_bytes = plan.chunk_bytes;
                        cfg.timeout = Duration::from_secs(60);
                        cfg.connect_timeout = Duration::from_secs(60);
                        let ring = Ring::connect(cfg, AbortSignal::new()).unwrap();
                        let mut step = 0;
                        plan.sizes.iter().map(|&b| measure_worker_row(&ring, plan, b, &mut step).unwrap()).collect()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, rs) in rows.iter().enumerate() {
            assert_eq!(rs.len(), 2);
            for (row, first) in rs.iter().zip(&rows[0]) {
                assert_eq!(row.wrong, 0, "rank {r}: {row:?}");
                // Every worker reports the same agreed row.
                assert_eq!((row.iters, row.time, row.count, row.workers), (first.iters, first.time, first.count, 3));
                assert!((ADAPTIVE_MIN_ITERS..=ADAPTIVE_MAX_ITERS).contains(&row.iters));
                let hops = if collective == WorkerCollective::AllReduce { 4.0 / 3.0 } else { 2.0 / 3.0 };
                assert!((row.busbw() / row.algbw() - hops).abs() < 1e-9);
            }
        }
    }

    #[test]
    fn summary_takes_the_median_of_large_rows() {
        let row = |bytes: u64, time_us: u64| Row {
            replicas: 2,
            bytes,
            count: bytes as usize / 4,
            op: ReduceOp::Sum,
            iters: 5,
            time: Duration::from_micros(time_us),
            copy_time: Duration::from_micros(time_us),
            floor: Duration::from_micros(100),
            floor_threads: 1,
            wrong: 0,
        };
        assert_eq!(summary(&[row(4 * KIB, 1000)]), None);
        let rows = [row(4 * KIB, 1000), row(16 * MIB, 120), row(64 * MIB, 130), row(256 * MIB, 200)];
        assert!((summary(&rows).unwrap() - 1.3).abs() < 1e-9);
    }
}

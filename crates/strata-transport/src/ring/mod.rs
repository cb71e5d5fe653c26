//! Cross-worker collectives over raw TCP (Unix sockets between the workers of one host): the
//! data plane of `MultiWorkerMirroredStrategy`.
//!
//! [`Ring::connect`] builds a mesh of TCP connections between the workers (each dials the lower
//! ranks and accepts the higher ones, in any start order, retrying until the connect
//! deadline), authenticated by the cluster token and checked against the cluster fingerprint.
//! The collectives then run over it: ring all-reduce (reduce-scatter then all-gather, pipelined
//! in chunks) for large buffers, a direct exchange for small ones, reduce-scatter (the same two
//! algorithms' first half), all-gather, broadcast (of f32s, or of u64s for integers) and barrier. The algorithms are described in `algo.rs`, the bytes on the wire in `wire.rs`.
//!
//! # No hangs
//!
//! Every collective has a deadline ([`RingConfig::timeout`]) and checks its [`AbortSignal`]
//! every 50 ms. Every message starts with an OPEN frame (step, collective, op, length) that the
//! receiver compares with its own call: a peer that called something else is reported as
//! [`Error::Mismatch`] naming both tasks and both calls. A peer whose connection closes or
//! resets gives [`Error::PeerLost`] naming it. A task that fails sends its error to every peer
//! in an ERROR frame and closes its connections, so the peers fail with the same cause rather
//! than wait for their deadline. After an error the ring is broken: every later call fails.
//!
//! # Why raw TCP, on a single-threaded tokio runtime
//!
//! The data plane is raw TCP, not gRPC streams: a collective moves f32 bytes between fixed
//! peers, and protobuf framing, HTTP/2 flow control and per-message allocation would only add
//! copies to what is, on loopback, a memory-bandwidth problem (the kernel's two copies per byte
//! are most of the cost). Each ring owns a current-thread tokio runtime and drives every
//! collective on the calling thread: one future sends on the link to the right while another
//! receives from the left and reduces straight out of the socket's read buffer, sharing the
//! tensor split into its chunks, one `RefCell` each (no `unsafe`, no second thread, no lock on
//! the hot path): an f32 chunk is written to the socket from the tensor itself (a vectored
//! write of the frame header and the chunk) and an all-gather's chunk is read from the socket
//! straight into the tensor, so the only pass over the data outside the kernel is the sum. The
//! alternative, blocking sockets with a sender thread per link, measured the same bandwidth on
//! this 2-core machine (64 MiB exchanged both ways between two processes: 0.65 GB/s blocking
//! against 0.74 GB/s tokio at 256 KiB chunks, 0.62 and 0.61 at 64 KiB, under load from other
//! builds) and a lower 4 KiB exchange latency (15 us against 21 us), but it needs a second
//! thread per worker (more threads than cores when 4 workers share 2), `unsafe` or a copy to
//! hand pieces of the tensor between threads, and read timeouts to poll for aborts, where tokio
//! gives deadlines, abort polling and concurrent reads from n-1 peers directly.
//!
//! Measured choices (`strata bench allreduce --workers 2,4`, 2 cores shared with other builds):
//! 256 KiB chunks over 64 KiB and 1 MiB; the direct exchange up to 64 KiB (the ring wins from
//! 256 KiB: 0.2 ms against 0.3 ms for 2 workers, 0.9 ms against 1.8 ms for 4); transfers in
//! order rather than interleaved so that chunks move on while still in cache (that caps the
//! bytes in flight, and every scheduling hiccup then stalls the ring: 2 workers fell from
//! ~1.5 GB/s to ~0.8 GB/s); Linux's socket buffer autotuning left on (see `SOCKET_BUFFER`).
//! AF_UNIX sockets were once measured no faster than loopback TCP here (about 4 GB/s one way,
//! both, with the default 208 KiB buffers); with 4 MiB buffers and both directions at once they
//! cost 2-3x less CPU per byte, so connections between workers of one host now move to Unix
//! sockets after the TCP handshake (`local.rs`): `strata bench allreduce --workers 2` went from
//! 2.5-2.8 to 4.4-4.5 GB/s busbw at 16-64 MiB (2026-12-05, alternated, `STRATA_RING_UNIX=0`
//! for TCP).
//!
//! Where it stands (medians of 3 runs against PyTorch 2.15's gloo, `scripts/bench/compare-allreduce.sh`,
//! same sizes and timing method, this 2-core machine partly loaded by other builds): busbw for 2
//! workers 1.86 / 1.50 / 1.61 / 1.49 GB/s at 1 / 16 / 64 / 256 MiB (gloo 0.70 / 0.92 / 1.06 /
//! 1.31), for 4 workers 0.89 / 0.83 / 0.82 / 0.84 (gloo 0.17 / 0.73 / 0.75 / 0.79); 4 KiB
//! latency 19 us for 2 workers and 85 us for 4 (gloo 370 us and 5.7 ms). Inside the ring the
//! CPU is busy, mostly with the kernel's two copies per byte: the large sizes are CPU-bound.
//! Sending chunks in place and storing the all-gather straight from the socket (2026-11-27,
//! 2 workers, 16 MiB, three alternating rounds beside gloo and the same run's raw TCP of two
//! opposite streams) took busbw from 1.77 / 1.53 / 1.60 to 1.94 / 2.04 / 1.88 GB/s: 0.90 /
//! 1.17 / 0.91 of the two streams' 2.15 / 1.75 / 2.07 GB/s each, and 2.17 / 1.74 / 2.19x gloo
//! (0.90 / 1.18 / 0.86 GB/s).

mod abort;
mod algo;
mod connect;
mod link;
mod local;
mod pieces;
mod wire;

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use strata_core::cross_device::compression::{HalfFormat, SumWire};
use strata_core::ReduceOp;
use tokio::runtime::Runtime;

use crate::{Error, Result};
pub(crate) use abort::raised;
pub use abort::{AbortSignal, ABORT_POLL};
use link::{try_join_all, Ctx, Links, Reader, Writer};
pub use local::UNIX_BUFFER;
pub use pieces::Pieces;
use wire::{Call, WireError};

/// The default deadline of each collective.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// The default deadline for building the ring.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(60);
/// The default pipelining chunk: the bytes of one DATA frame.
pub const DEFAULT_CHUNK_BYTES: usize = 256 << 10;
/// The default size up to which an all-reduce or broadcast takes the direct exchange.
pub const DEFAULT_SMALL_BYTES: usize = 64 << 10;
/// The largest chunk accepted.
pub const MAX_CHUNK_BYTES: usize = 64 << 20;
/// How long a failing task spends telling its peers why.
const FAREWELL: Duration = Duration::from_millis(250);

/// How to build a [`Ring`].
pub struct RingConfig {
    /// This worker's rank, `0..addresses.len()`.
    pub rank: usize,
    /// The data-plane address of every rank.
    pub addresses: Vec<SocketAddr>,
    /// This rank's listener, already bound (tests bind `127.0.0.1:0` first); `None`: bind
    /// `addresses[rank]`.
    pub listener: Option<std::net::TcpListener>,
    /// The task name of every rank (such as `worker:1`), used in every error message; empty:
    /// `worker:<rank>`.
    pub task_names: Vec<String>,
    /// The cluster token every connection must present (compared in constant time).
    pub token: Option<String>,
    /// The cluster spec and strategy fingerprint; a peer with another one is refused.
    pub fingerprint: String,
    /// The deadline of each collective.
    pub timeout: Duration,
    /// The deadline for building the ring (peers may start in any order until then).
    pub connect_timeout: Duration,
    /// The pipelining chunk in bytes (rounded down to whole f32s; 4 bytes to 64 MiB).
    pub chunk_bytes: usize,
    /// All-reduces and broadcasts of at most this many bytes exchange buffers directly with
    /// every peer (one network hop) instead of going around the ring.
    pub small_bytes: usize,
    /// Whether connections to workers on this host move to Unix sockets (see `local.rs`); from
    /// `STRATA_RING_UNIX` (`0` keeps TCP), else on.
    pub unix_sockets: bool,
}

impl RingConfig {
    /// A configuration with the default deadlines and sizes, tasks named `worker:<rank>`, no
    /// token and an empty fingerprint.
    pub fn new(rank: usize, addresses: Vec<SocketAddr>) -> Self {
        Self {
            rank,
            addresses,
            listener: None,
            task_names: Vec::new(),
            token: None,
            fingerprint: String::new(),
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            small_bytes: DEFAULT_SMALL_BYTES,
            unix_sockets: local::allowed_by_env(),
        }
    }
}

impl std::fmt::Debug for RingConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingConfig")
            .field("rank", &self.rank)
            .field("addresses", &self.addresses)
            .field("listener", &self.listener)
            .field("task_names", &self.task_names)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("fingerprint", &self.fingerprint)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("chunk_bytes", &self.chunk_bytes)
            .field("small_bytes", &self.small_bytes)
            .field("unix_sockets", &self.unix_sockets)
            .finish()
    }
}

/// A connected group of workers and the collectives between them.
///
/// Every rank must call the same collectives in the same order with the same `step` (the
/// caller's agreed sequence number). Calls on one ring are serialized. A collective blocks its
/// thread; called from inside a tokio runtime it runs on a helper thread (prefer a plain
/// thread or `spawn_blocking`, so that no async worker thread is blocked).
pub struct Ring {
    rank: usize,
    names: Vec<String>,
    timeout: Duration,
    chunk_elems: usize,
    small_bytes: usize,
    abort: AbortSignal,
    rt: Option<Runtime>,
    state: Mutex<State>,
    /// How the mesh was built: the piece service builds its own the same way.
    params: Arc<connect::Params>,
    /// Connections on Unix sockets (to workers on this host).
    unix: usize,
}

struct State {
    links: Links,
    /// Why the ring is unusable, after a failed collective.
    broken: Option<String>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("rank", &self.rank).field("tasks", &self.names).finish_non_exhaustive()
    }
}

/// Runs `f` on this thread, or, when this thread is inside a tokio runtime (an async task, or
/// `spawn_blocking`), on a helper thread: a ring drives its own runtime with `block_on`, which
/// tokio does not allow inside another runtime.
fn off_runtime<T: Send>(f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    if tokio::runtime::Handle::try_current().is_err() {
        return f();
    }
    std::thread::scope(|s| s.spawn(f).join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
}

impl Ring {
    /// Connects to every peer (retrying until `connect_timeout`) and returns the ring.
    pub fn connect(cfg: RingConfig, abort: AbortSignal) -> Result<Ring> {
        off_runtime(move || Self::connect_here(cfg, abort))
    }

    fn connect_here(cfg: RingConfig, abort: AbortSignal) -> Result<Ring> {
        let n = cfg.addresses.len();
        if n == 0 || cfg.rank >= n {
            return Err(Error::Config(format!(
                "rank {} is not a rank of a ring of {n} addresses: give every worker's address and a rank below {n}",
                cfg.rank
            )));
        }
        let names = if cfg.task_names.is_empty() {
            (0..n).map(|r| format!("worker:{r}")).collect()
        } else if cfg.task_names.len() == n {
            cfg.task_names.clone()
        } else {
            return Err(Error::Config(format!(
                "{} task names for {n} addresses: give one task name per address",
                cfg.task_names.len()
            )));
        };
        let chunk_bytes = cfg.chunk_bytes / 4 * 4;
        if !(4..=MAX_CHUNK_BYTES).contains(&chunk_bytes) {
            return Err(Error::Config(format!(
                "chunk_bytes {}: use 4 bytes to {MAX_CHUNK_BYTES} bytes (such as {DEFAULT_CHUNK_BYTES})",
                cfg.chunk_bytes
            )));
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| Error::io("starting the ring's runtime", e))?;
        let params = Arc::new(connect::Params {
            rank: cfg.rank,
            addresses: cfg.addresses.clone(),
            names: names.clone(),
            token: cfg.token.map(String::into_bytes),
            fingerprint: cfg.fingerprint.into_bytes(),
            chunk_bytes,
            small_bytes: cfg.small_bytes,
            connect_timeout: cfg.connect_timeout,
            socket_buffer: SOCKET_BUFFER,
        });
        let me = names[cfg.rank].clone();
        let listener = cfg.listener;
        let addr = cfg.addresses[cfg.rank];
        let streams = rt.block_on(async {
            let listener = if cfg.rank + 1 < n {
                let std_listener = match listener {
                    Some(l) => l,
                    None => std::net::TcpListener::bind(addr)
                        .map_err(|e| Error::io(format!("task {me} binding its ring address {addr}"), e))?,
                };
                std_listener
                    .set_nonblocking(true)
                    .map_err(|e| Error::io("making the ring listener non-blocking", e))?;
                Some(
                    tokio::net::TcpListener::from_std(std_listener)
                        .map_err(|e| Error::io("registering the ring listener", e))?,
                )
            } else {
                None
            };
            let streams = connect::build(params.clone(), listener, &abort).await?;
            // Peers on this host move to Unix sockets, every connection at once.
            let mut upgrades = tokio::task::JoinSet::new();
            for (p, s) in streams.into_iter().enumerate() {
                if let Some(s) = s {
                    let (rank, name, allow) = (cfg.rank, names[p].clone(), cfg.unix_sockets);
                    upgrades.spawn(async move { (p, local::upgrade(s, rank, p, &name, allow).await) });
                }
            }
            let mut links: Vec<Option<local::Stream>> = (0..n).map(|_| None).collect();
            while let Some(done) = upgrades.join_next().await {
                let (p, s) = done.map_err(|e| Error::Config(format!("moving a ring connection failed: {e}")))?;
                links[p] = Some(s?);
            }
            Ok::<_, Error>(links)
        })?;
        let unix = streams.iter().flatten().filter(|s| s.is_unix()).count();
        let mut readers = Vec::with_capacity(n);
        let mut writers = Vec::with_capacity(n);
        for (p, s) in streams.into_iter().enumerate() {
            match s {
                Some(s) => {
                    let (rd, wr) = s.into_split();
                    readers.push(Some(Reader::new(p, rd)));
                    writers.push(Some(Writer::new(p, wr)));
                }
                None => {
                    readers.push(None);
                    writers.push(None);
                }
            }
        }
        Ok(Ring {
            rank: cfg.rank,
            names,
            timeout: cfg.timeout,
            chunk_elems: chunk_bytes / 4,
            small_bytes: cfg.small_bytes,
            abort,
            rt: Some(rt),
            state: Mutex::new(State { links: Links { readers, writers }, broken: None }),
            params,
            unix,
        })
    }

    /// This worker's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of workers.
    pub fn size(&self) -> usize {
        self.names.len()
    }

    /// The task name of every rank.
    pub fn task_names(&self) -> &[String] {
        &self.names
    }

    /// How many of this worker's connections run on Unix sockets (to workers on this host);
    /// the others are TCP.
    pub fn unix_links(&self) -> usize {
        self.unix
    }

    /// All-reduces `data` in place across the workers (`Mean` divides the sum by the number of
    /// workers). Every worker ends with bitwise-identical values.
    pub fn all_reduce(&self, step: u64, op: ReduceOp, data: &mut [f32]) -> Result<()> {
        off_runtime(|| self.all_reduce_here(step, op, data))
    }

    /// Sums `data` across the workers with every value on the wire in 16 bits (`format`), each
    /// hop adding in f32 (a gradient compressed for the link): the ring algorithm whatever the
    /// size, and every task ends with the same bits, the sum as the 16-bit wire carries it.
    pub fn all_reduce_half(&self, step: u64, data: &mut [f32], format: HalfFormat) -> Result<()> {
        off_runtime(|| self.all_reduce_inner(step, ReduceOp::Sum, data, Some(SumWire::Half(format))))
    }

    /// Sums `data` across the workers with the values on the wire in int8 blocks
    /// ([`Int8Blocks`](strata_core::cross_device::compression::Int8Blocks): 65 bytes per 64
    /// values), each hop adding in f32: the ring algorithm whatever the size, and every task
    /// ends with the same bits.
    pub fn all_reduce_int8(&self, step: u64, data: &mut [f32]) -> Result<()> {
        off_runtime(|| self.all_reduce_inner(step, ReduceOp::Sum, data, Some(SumWire::Int8)))
    }

    fn all_reduce_here(&self, step: u64, op: ReduceOp, data: &mut [f32]) -> Result<()> {
        self.all_reduce_inner(step, op, data, None)
    }

    fn all_reduce_inner(&self, step: u64, op: ReduceOp, data: &mut [f32], half: Option<SumWire>) -> Result<()> {
        let call = match half {
            None => Call::AllReduce { op, count: data.len() as u64 },
            Some(SumWire::Half(half)) => Call::AllReduceHalf { half, count: data.len() as u64 },
            Some(SumWire::Int8) => Call::AllReduceInt8 { count: data.len() as u64 },
        };
        let mut st = self.begin(step, &call)?;
        if self.size() == 1 {
            op.finish(data, 1);
            return Ok(());
        }
        let ctx = self.ctx(step, call);
        let direct = half.is_none() && data.len().saturating_mul(4) <= self.small_bytes;
        let res = if direct {
            self.drive(&ctx, algo::direct_all_reduce(&ctx, &mut st.links, op, data))
        } else {
            self.drive(&ctx, algo::ring_all_reduce(&ctx, &mut st.links, op, data, half))
        };
        self.conclude(&mut st, res)
    }

    /// Reduces `data` across the workers and leaves this worker with its part of the result
    /// only: [`Ring::scatter_segment`] of `data` holds the reduced values (bit for bit what
    /// [`Ring::all_reduce`] puts there), the rest partial values. Each worker sends and
    /// receives half the bytes of an all-reduce. Returns the segment.
    pub fn reduce_scatter(&self, step: u64, op: ReduceOp, data: &mut [f32]) -> Result<Range<usize>> {
        off_runtime(|| self.reduce_scatter_here(step, op, data))
    }

    /// The segment of a `len`-element buffer that [`Ring::reduce_scatter`] leaves reduced on
    /// `rank`: segment `(rank + 1) mod n` of the n even segments (`[k*len/n, (k+1)*len/n)`).
    pub fn scatter_segment(&self, len: usize, rank: usize) -> Range<usize> {
        algo::scatter_segment(len, self.size(), rank)
    }

    fn reduce_scatter_here(&self, step: u64, op: ReduceOp, data: &mut [f32]) -> Result<Range<usize>> {
        let call = Call::ReduceScatter { op, count: data.len() as u64 };
        let mut st = self.begin(step, &call)?;
        let own = self.scatter_segment(data.len(), self.rank);
        if self.size() == 1 {
            op.finish(data, 1);
            return Ok(own);
        }
        let ctx = self.ctx(step, call);
        let res = if data.len().saturating_mul(4) <= self.small_bytes {
            self.drive(&ctx, algo::direct_reduce_scatter(&ctx, &mut st.links, op, data))
        } else {
            self.drive(&ctx, algo::ring_reduce_scatter(&ctx, &mut st.links, op, data))
        };
        self.conclude(&mut st, res).map(|()| own)
    }

    /// Gathers every worker's buffer (lengths may differ): element `r` is rank `r`'s.
    pub fn all_gather(&self, step: u64, mine: &[f32]) -> Result<Vec<Vec<f32>>> {
        off_runtime(|| self.all_gather_here(step, mine))
    }

    fn all_gather_here(&self, step: u64, mine: &[f32]) -> Result<Vec<Vec<f32>>> {
        let call = Call::AllGather { count: mine.len() as u64 };
        let mut st = self.begin(step, &call)?;
        if self.size() == 1 {
            return Ok(vec![mine.to_vec()]);
        }
        let ctx = self.ctx(step, call);
        let res = self.drive(&ctx, algo::all_gather(&ctx, &mut st.links, mine));
        self.conclude(&mut st, res)
    }

    /// Gathers every worker's buffer into `out`, rank after rank, where every rank's length is
    /// known beforehand (`counts[r]` for rank `r`): no buffer is allocated, each peer's values
    /// are received straight into their place, and a peer that sends another count is an
    /// error before any of its values are stored. `counts` must have one entry per rank, this
    /// rank's must be `mine.len()`, and they must sum to `out.len()`.
    pub fn all_gather_into(&self, step: u64, mine: &[f32], out: &mut [f32], counts: &[usize]) -> Result<()> {
        if counts.len() != self.size()
            || counts.get(self.rank) != Some(&mine.len())
            || counts.iter().try_fold(0usize, |a, &c| a.checked_add(c)) != Some(out.len())
        {
            return Err(Error::Config(format!(
                "all_gather_into of {} f32 into {} with counts {counts:?}: one count per rank of {}, this rank's {} its own length, summing to the output's",
                mine.len(),
                out.len(),
                self.size(),
                self.rank
            )));
        }
        off_runtime(|| self.all_gather_into_here(step, mine, out, counts))
    }

    fn all_gather_into_here(&self, step: u64, mine: &[f32], out: &mut [f32], counts: &[usize]) -> Result<()> {
        let call = Call::AllGather { count: mine.len() as u64 };
        let mut st = self.begin(step, &call)?;
        if self.size() == 1 {
            out.copy_from_slice(mine);
            return Ok(());
        }
        let ctx = self.ctx(step, call);
        let res = self.drive(&ctx, algo::all_gather_into(&ctx, &mut st.links, mine, out, counts));
        self.conclude(&mut st, res)
    }

    /// Copies `root`'s `data` into every worker's `data` (the lengths must agree).
    pub fn broadcast(&self, step: u64, root: usize, data: &mut [f32]) -> Result<()> {
        off_runtime(|| self.broadcast_here(step, root, data))
    }

    fn broadcast_here(&self, step: u64, root: usize, data: &mut [f32]) -> Result<()> {
        self.check_root(root)?;
        let call = Call::Broadcast { root: root as u32, count: data.len() as u64 };
        let mut st = self.begin(step, &call)?;
        if self.size() == 1 {
            return Ok(());
        }
        let ctx = self.ctx(step, call);
        let res = if data.len().saturating_mul(4) <= self.small_bytes {
            self.drive(&ctx, algo::direct_broadcast(&ctx, &mut st.links, root, data))
        } else {
            self.drive(&ctx, algo::chain_broadcast(&ctx, &mut st.links, root, data))
        };
        self.conclude(&mut st, res)
    }

    /// Copies `root`'s `data` (integers, bit for bit) into every worker's `data` (the lengths
    /// must agree): the same OPEN and DATA frame checks as [`Ring::broadcast`], always sent
    /// directly from the root to every peer.
    pub fn broadcast_u64s(&self, step: u64, root: usize, data: &mut [u64]) -> Result<()> {
        off_runtime(|| self.broadcast_u64s_here(step, root, data))
    }

    fn broadcast_u64s_here(&self, step: u64, root: usize, data: &mut [u64]) -> Result<()> {
        self.check_root(root)?;
        let call = Call::BroadcastU64 { root: root as u32, count: data.len() as u64 };
        let mut st = self.begin(step, &call)?;
        if self.size() == 1 {
            return Ok(());
        }
        let ctx = self.ctx(step, call);
        let res = self.drive(&ctx, algo::broadcast_u64s(&ctx, &mut st.links, root, data));
        self.conclude(&mut st, res)
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.size() {
            return Err(Error::Config(format!(
                "broadcast root {root} is not a rank of this ring of {} workers",
                self.size()
            )));
        }
        Ok(())
    }

    /// Returns once every worker has called `barrier` with this `step`.
    pub fn barrier(&self, step: u64) -> Result<()> {
        off_runtime(|| self.barrier_here(step))
    }

    fn barrier_here(&self, step: u64) -> Result<()> {
        let mut st = self.begin(step, &Call::Barrier)?;
        if self.size() == 1 {
            return Ok(());
        }
        let ctx = self.ctx(step, Call::Barrier);
        let res = self.drive(&ctx, algo::barrier(&ctx, &mut st.links));
        self.conclude(&mut st, res)
    }

    fn ctx(&self, step: u64, call: Call) -> Ctx<'_> {
        Ctx::new(self.rank, &self.names, step, call, self.chunk_elems)
    }

    /// Locks the ring for one collective; fails if it is broken or aborted.
    fn begin(&self, step: u64, call: &Call) -> Result<MutexGuard<'_, State>> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = &st.broken {
            tracing::debug!(%call, step, "a collective on a broken ring");
            return Err(Error::Aborted(format!(
                "{call} on task {}: the ring is unusable after an earlier failure: {why}",
                self.names[self.rank]
            )));
        }
        Ok(st)
    }

    fn runtime(&self) -> Result<&Runtime> {
        self.rt.as_ref().ok_or_else(|| Error::Config("the ring's runtime is gone".into()))
    }

    /// Runs one collective to completion, its deadline, or an abort.
    fn drive<T>(&self, ctx: &Ctx<'_>, work: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        let timeout = self.timeout;
        self.runtime()?.block_on(async {
            let deadline = tokio::time::Instant::now() + timeout;
            let mut tick = tokio::time::interval(ABORT_POLL);
            tokio::pin!(work);
            loop {
                tokio::select! {
                    biased;
                    r = &mut work => return r,
                    _ = tokio::time::sleep_until(deadline) => return Err(ctx.timed_out(timeout)),
                    _ = tick.tick() => {
                        if let Some(reason) = self.abort.reason() {
                            tracing::debug!(call = %ctx.call, step = ctx.step, "a collective aborted");
                            return Err(Error::Aborted(format!(
                                "{} on task {} was aborted: {reason}",
                                ctx.call, ctx.me()
                            )));
                        }
                    }
                }
            }
        })
    }

    /// On failure: tells every peer why, closes the connections and marks the ring broken.
    fn conclude<T>(&self, st: &mut State, res: Result<T>) -> Result<T> {
        let e = match res {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        let frame = WireError::from_error(&e).frame();
        if let Ok(rt) = self.runtime() {
            let links = &mut st.links;
            rt.block_on(async {
                // One deadline for both: a stopped or cut-off peer neither reads the farewell
                // (its buffers are full) nor closes its side, and must not hold this task up.
                let farewells: Vec<_> = links
                    .writers
                    .iter_mut()
                    .flatten()
                    .map(|w| async {
                        w.send_error(&frame).await;
                        Ok::<_, Error>(())
                    })
                    .collect();
                // Read what the peers already sent, so that closing does not reset the
                // connections before they have read the ERROR frames.
                let drains: Vec<_> = links.readers.iter_mut().flatten().map(Reader::drain).collect();
                let _ = tokio::time::timeout(FAREWELL, async {
                    tokio::join!(try_join_all(farewells), try_join_all(drains))
                })
                .await;
            });
        }
        st.links.readers.iter_mut().for_each(|r| *r = None);
        st.links.writers.iter_mut().for_each(|w| *w = None);
        st.broken = Some(e.to_string());
        Err(e)
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // Never blocks, so a ring may be dropped anywhere (even inside an async task).
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// The socket buffer size set on every connection; `None` leaves Linux's autotuning on. Setting
/// SO_SNDBUF/SO_RCVBUF caps them at `net.core.{w,r}mem_max` (often 4 MiB or less) and turns
/// autotuning off, while autotuning grows a loopback receive buffer to `tcp_rmem`'s maximum
/// (32 MiB here): 4 MiB buffers measured no better, and sometimes worse.
const SOCKET_BUFFER: Option<usize> = None;

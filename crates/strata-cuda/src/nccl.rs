//! NCCL all-reduce across GPUs: the GPUs of one process
// What calls NCCL exists with the `nccl` feature only: linked there, named without it (a link to
// an item the build leaves out is broken).
#![cfg_attr(feature = "nccl", doc = "([`NcclComms::all_local`], one")]
#![cfg_attr(not(feature = "nccl"), doc = "(`NcclComms::all_local`, feature `nccl`; one")]
//! communicator per device, created together with `ncclCommInitAll`), or one GPU in each of
//! several processes
#![cfg_attr(feature = "nccl", doc = "([`NcclComms::join`],")]
#![cfg_attr(not(feature = "nccl"), doc = "(`NcclComms::join`,")]
//! from an [`NcclId`] that one process creates and the others receive, in Strata through the
//! coordination service's key-value store).
//!
//! - **Grouped calls.** An all-reduce over several devices is one `ncclGroupStart` /
//!   `ncclGroupEnd` around one `ncclAllReduce` per device, in place or out of place, on the
//!   stream that owns each buffer (cudarc's event tracking orders it after the buffer's earlier
//!   work, and later work after it).
//! - **Reductions.** `Sum`, `Max` and `Min` are NCCL's; `Mean` is `ncclAvg`, which NCCL computes
//!   for floating-point types as a sum of inputs premultiplied by `1/n` (exact when `n` is a
//!   power of two; otherwise within `n` ulps of `sum / n`).
//! - **Element types.** `f32`, `f64`, `half::f16`, `half::bf16`
#![cfg_attr(feature = "nccl", doc = "  ([`NcclElement`]).")]
#![cfg_attr(not(feature = "nccl"), doc = "  (`NcclElement`).")]
//! - **Failures.** Every NCCL status is an
#![cfg_attr(feature = "nccl", doc = "  [`Error::Nccl`]")]
#![cfg_attr(not(feature = "nccl"), doc = "  `Error::Nccl`")]
//!   naming the call, the rank and the GPU, with NCCL's last error message. Waiting is bounded:
//!   a communicator whose initialisation or collective does not finish within its timeout (a
//!   peer process is lost or stuck) is aborted with `ncclCommAbort` and the call returns
//!   [`Error::NcclTimeout`]; a caller-supplied abort check (the multi-worker job's failure
//!   signal) turns the wait into [`Error::NcclAborted`]. The multi-worker layer maps these to
//!   the errors of its ring (`PeerLost`, `Timeout`, `Aborted`).
//! - **Multi-process communicators are non-blocking** (`ncclConfig_t.blocking = 0`): no NCCL
//!   call waits on a peer inside NCCL, so the timeout and the abort check always get to run.
//!   Communicators of one process come from `ncclCommInitAll` (blocking: no peer process can be
//!   lost).
//!
//! [`NcclId`] and the checks on buffers are plain Rust and work without the `nccl` feature;
//! everything that calls NCCL needs it, and probes for NCCL (`libnccl.so`) and the driver first.

use std::fmt;
use std::time::Duration;

use crate::{Error, Result};

/// The size of an NCCL unique id (`ncclUniqueId`), in bytes.
pub const NCCL_ID_BYTES: usize = 128;

/// How long a communicator's initialisation or a collective may take before the communicator
/// is aborted, unless set otherwise.
pub const DEFAULT_NCCL_TIMEOUT: Duration = Duration::from_secs(300);

/// The unique id every process of a multi-process communicator starts from (`ncclUniqueId`):
/// one process creates it with [`NcclId::new`], the others receive its
/// [`to_bytes`](NcclId::to_bytes) and rebuild it with [`from_bytes`](NcclId::from_bytes).
///
/// ```
/// use strata_cuda::nccl::{NcclId, NCCL_ID_BYTES};
///
/// let id = NcclId::from_bytes(&[7u8; NCCL_ID_BYTES]).unwrap();
/// assert_eq!(NcclId::from_bytes(&id.to_bytes()).unwrap(), id);
/// assert!(NcclId::from_bytes(&[0u8; 12]).is_err());
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct NcclId([u8; NCCL_ID_BYTES]);

impl NcclId {
    /// A fresh id from `ncclGetUniqueId` (the process that calls this hosts NCCL's bootstrap).
    pub fn new() -> Result<Self> {
        #[cfg(feature = "nccl")]
        {
            crate::probe::nccl()?;
            let raw = cudarc::nccl::result::get_uniqueid().map_err(|e| Error::Nccl {
                call: "ncclGetUniqueId",
                place: "this process".into(),
                source: NcclError(e),
                detail: String::new(),
            })?;
            Ok(Self(raw.internal.map(|c| c as u8)))
        }
        #[cfg(not(feature = "nccl"))]
        {
            Err(Error::NotBuilt { feature: "nccl", what: "NCCL" })
        }
    }

    /// The id from the bytes [`to_bytes`](NcclId::to_bytes) gave; exactly
    /// [`NCCL_ID_BYTES`] bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let arr: [u8; NCCL_ID_BYTES] = bytes
            .try_into()
            .map_err(|_| Error::InvalidNcclId(format!("expected {NCCL_ID_BYTES} bytes, got {} bytes", bytes.len())))?;
        Ok(Self(arr))
    }

    /// The id's bytes, to send to the other processes.
    pub fn to_bytes(&self) -> [u8; NCCL_ID_BYTES] {
        self.0
    }

    /// The id's bytes, borrowed.
    pub fn as_bytes(&self) -> &[u8; NCCL_ID_BYTES] {
        &self.0
    }

    /// A short fingerprint for logs (the id itself holds the host's bootstrap address).
    pub fn fingerprint(&self) -> String {
        // FNV-1a: stable, dependency-free, and enough to tell two ids apart in a log.
        let h = self.0.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        format!("{:016x}", h)
    }
}

impl fmt::Debug for NcclId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NcclId({})", self.fingerprint())
    }
}

/// Where an NCCL call ran, for error messages: `rank 1 of 4 (GPU 1)`.
pub fn place(rank: usize, world: usize, ordinal: usize) -> String {
    format!("rank {rank} of {world} (GPU {ordinal})")
}

/// Checks the buffers of a grouped all-reduce: one per local rank, all of the same length.
/// Returns that length.
pub fn check_buffer_lens(kernel: &'static str, local_ranks: usize, lens: &[usize]) -> Result<usize> {
    if lens.len() != local_ranks {
        return Err(Error::InvalidLaunch {
            kernel,
            detail: format!(
                "{} buffer(s) for {local_ranks} device(s): give one buffer per device of the communicator, in its order",
                lens.len()
            ),
        });
    }
    let Some(&first) = lens.first() else {
        return Err(Error::InvalidLaunch { kernel, detail: "the communicator holds no device".into() });
    };
    if let Some((i, &len)) = lens.iter().enumerate().find(|(_, &l)| l != first) {
        return Err(Error::InvalidLaunch {
            kernel,
            detail: format!(
                "buffer {i} holds {len} elements but buffer 0 holds {first}; every device reduces the same count"
            ),
        });
    }
    Ok(first)
}

/// Whether NCCL can be used here: built with the `nccl` feature, and both the CUDA driver and
/// `libnccl.so` load. (Whether the GPUs suit NCCL is [`crate::select`]'s question.)
pub fn nccl_available() -> bool {
    crate::probe::driver().is_ok() && crate::probe::nccl().is_ok()
}

#[cfg(feature = "nccl")]
pub use imp::*;

#[cfg(feature = "nccl")]
mod imp {
    use std::ffi::CStr;
    use std::fmt;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
    use cudarc::nccl::sys;
    use strata_core::ReduceOp;

    use super::{check_buffer_lens, place, NcclId, DEFAULT_NCCL_TIMEOUT, NCCL_ID_BYTES};
    use crate::{Error, Result};

    // The error module holds NCCL's status (an error's source), so that it does not import
    // this module.
    pub use crate::error::NcclError;

    /// The NCCL version that was loaded, `(major, minor, patch)`.
    pub fn nccl_version() -> Result<(u32, u32, u32)> {
        crate::probe::nccl()?;
        let v = cudarc::nccl::result::get_nccl_version().map_err(|e| Error::Nccl {
            call: "ncclGetVersion",
            place: "this process".into(),
            source: NcclError(e),
            detail: String::new(),
        })?;
        let v = v.max(0) as u32;
        // NCCL_VERSION(X,Y,Z): X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z after.
        Ok(if v >= 10000 { (v / 10000, v / 100 % 100, v % 100) } else { (v / 1000, v / 100 % 10, v % 100) })
    }

    /// A type NCCL reduces.
    pub trait NcclElement: Copy + 'static {
        /// NCCL's name for it.
        const DTYPE: sys::ncclDataType_t;
        /// The name nccl-tests prints (`float`, `half`, `bfloat16`, `double`).
        const NAME: &'static str;
    }

    impl NcclElement for f32 {
        const DTYPE: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat32;
        const NAME: &'static str = "float";
    }
    impl NcclElement for f64 {
        const DTYPE: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat64;
        const NAME: &'static str = "double";
    }
    impl NcclElement for half::f16 {
        const DTYPE: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat16;
        const NAME: &'static str = "half";
    }
    impl NcclElement for half::bf16 {
        const DTYPE: sys::ncclDataType_t = sys::ncclDataType_t::ncclBfloat16;
        const NAME: &'static str = "bfloat16";
    }

    /// NCCL's reduction for Strata's [`ReduceOp`] (`Mean` is `ncclAvg`).
    pub fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
        match op {
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOp::Mean => sys::ncclRedOp_t::ncclAvg,
            ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
            ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
        }
    }

    /// One rank of a communicator held by this process.
    struct Rank {
        comm: sys::ncclComm_t,
        ctx: Arc<CudaContext>,
        rank: usize,
        ordinal: usize,
    }

    /// NCCL communicators held by this process: one per local GPU (a single-process
    /// communicator over several GPUs) or one (this process's rank of a multi-process
    /// communicator). Dropping them aborts them (`ncclCommAbort`, which never waits on a peer).
    ///
    /// Operations take `&mut self`: NCCL forbids concurrent calls on one communicator. Share it
    /// between threads behind a `Mutex`.
    pub struct NcclComms {
        ranks: Vec<Rank>,
        world: usize,
        blocking: bool,
        timeout: Duration,
        /// Why the communicators were aborted; every later call fails with it.
        aborted: Option<String>,
    }

    // SAFETY: an ncclComm_t may be used from any thread as long as calls on it are not
    // concurrent; NcclComms only calls NCCL through `&mut self` (or in Drop), so moving it to
    // another thread is sound. It is deliberately not Sync.
    unsafe impl Send for NcclComms {}

    impl fmt::Debug for NcclComms {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("NcclComms")
                .field("world", &self.world)
                .field("ranks", &self.ranks.iter().map(|r| r.rank).collect::<Vec<_>>())
                .field("gpus", &self.ordinals())
                .field("blocking", &self.blocking)
                .field("aborted", &self.aborted)
                .finish()
        }
    }

    /// A poll loop's pause: spin briefly (a collective of a few KiB takes microseconds), then
    /// sleep in short steps.
    fn pause(started: Instant) {
        if started.elapsed() < Duration::from_millis(2) {
            std::hint::spin_loop();
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn last_error(comm: sys::ncclComm_t) -> String {
        // SAFETY: `comm` is a communicator NCCL created (or null, which ncclGetLastError
        // accepts); the returned pointer is a NUL-terminated string owned by NCCL, read at once.
        let s = unsafe {
            let p = sys::ncclGetLastError(comm);
            if p.is_null() {
                return String::new();
            }
            CStr::from_ptr(p).to_string_lossy().into_owned()
        };
        let s = s.trim();
        if s.is_empty() {
            String::new()
        } else {
            format!(" ({s})")
        }
    }

    impl NcclComms {
        /// One communicator per GPU of `ordinals` (CUDA ordinals, after `CUDA_VISIBLE_DEVICES`),
        /// created together with `ncclCommInitAll`; rank `i` is `ordinals[i]`.
        pub fn all_local(ordinals: &[usize]) -> Result<Self> {
            crate::probe::driver()?;
            crate::probe::nccl()?;
            if ordinals.is_empty() {
                return Err(Error::InvalidLaunch { kernel: "ncclCommInitAll", detail: "no GPU given".into() });
            }
            let mut seen = std::collections::HashSet::new();
            if let Some(dup) = ordinals.iter().find(|o| !seen.insert(**o)) {
                return Err(Error::InvalidLaunch {
                    kernel: "ncclCommInitAll",
                    detail: format!(
                        "GPU {dup} is listed twice: NCCL needs one communicator per physical GPU (virtual GPUs of one device use Strata's kernels)"
                    ),
                });
            }
            let ctxs = ordinals
                .iter()
                .map(|&o| CudaContext::new(o).map_err(Error::driver("cuDevicePrimaryCtxRetain")))
                .collect::<Result<Vec<_>>>()?;
            let n = ordinals.len();
            let devlist: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
            let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); n];
            // SAFETY: `comms` has room for `n` handles and `devlist` holds `n` device ordinals,
            // each with a live primary context (held in `ctxs`); NCCL writes one handle per
            // device.
            let r = unsafe { cudarc::nccl::result::comm_init_all(comms.as_mut_ptr(), n as i32, devlist.as_ptr()) };
            if let Err(e) = r {
                return Err(Error::Nccl {
                    call: "ncclCommInitAll",
                    place: format!("GPUs {ordinals:?} of this process"),
                    source: NcclError(e),
                    detail: last_error(std::ptr::null_mut()),
                });
            }
            let ranks = comms
                .into_iter()
                .zip(ctxs)
                .zip(ordinals)
                .enumerate()
                .map(|(rank, ((comm, ctx), &ordinal))| Rank { comm, ctx, rank, ordinal })
                .collect();
            Ok(Self { ranks, world: n, blocking: true, timeout: DEFAULT_NCCL_TIMEOUT, aborted: None })
        }

        /// This process's rank `rank` of a `world`-rank communicator across processes, on GPU
        /// `ordinal`, from the `id` rank 0 created. Non-blocking: waits at most `timeout` for
        /// every rank to join, checking `abort` (the job's failure signal: `Some(reason)` once
        /// the job failed elsewhere) while it waits.
        pub fn join(
            id: &NcclId,
            rank: usize,
            world: usize,
            ordinal: usize,
            timeout: Duration,
            abort: &dyn Fn() -> Option<String>,
        ) -> Result<Self> {
            crate::probe::driver()?;
            crate::probe::nccl()?;
            if world == 0 || rank >= world {
                return Err(Error::InvalidLaunch {
                    kernel: "ncclCommInitRankConfig",
                    detail: format!("rank {rank} of {world}: the rank must be below the world size"),
                });
            }
            let (nranks, nrank) = (
                i32::try_from(world).map_err(|_| Error::InvalidLaunch {
                    kernel: "ncclCommInitRankConfig",
                    detail: format!("world size {world} is too large"),
                })?,
                rank as i32,
            );
            let ctx = CudaContext::new(ordinal).map_err(Error::driver("cuDevicePrimaryCtxRetain"))?;
            ctx.bind_to_thread().map_err(Error::driver("cuCtxSetCurrent"))?;
            let mut config = nonblocking_config();
            let raw_id = sys::ncclUniqueId { internal: id.to_bytes().map(|b| b as std::ffi::c_char) };
            debug_assert_eq!(raw_id.internal.len(), NCCL_ID_BYTES);
            let mut comm: sys::ncclComm_t = std::ptr::null_mut();
            // SAFETY: `comm` is a valid out-pointer, `config` is a fully initialised
            // ncclConfig_t (NCCL_CONFIG_INITIALIZER's values) that outlives the call and the
            // wait below, and the device of the current context is the rank's GPU.
            let r = unsafe { sys::ncclCommInitRankConfig(&mut comm, nranks, raw_id, nrank, &mut config) };
            let where_ = place(rank, world, ordinal);
            if let Err(e) = r.result() {
                if !comm.is_null() {
                    // SAFETY: a handle NCCL returned, aborted once and never used again.
                    unsafe {
                        let _ = sys::ncclCommAbort(comm);
                    }
                }
                return Err(Error::Nccl {
                    call: "ncclCommInitRankConfig",
                    place: where_,
                    source: NcclError(e),
                    detail: last_error(std::ptr::null_mut()),
                });
            }
            let mut me =
                Self { ranks: vec![Rank { comm, ctx, rank, ordinal }], world, blocking: false, timeout, aborted: None };
            // `config` stays alive (it is a local of this frame) while NCCL initialises.
            me.wait_ready("initialisation", "ncclCommInitRankConfig", Instant::now(), abort)?;
            Ok(me)
        }

        /// The number of ranks of the communicator (all processes).
        pub fn world_size(&self) -> usize {
            self.world
        }

        /// The ranks this process holds, in order.
        pub fn ranks(&self) -> Vec<usize> {
            self.ranks.iter().map(|r| r.rank).collect()
        }

        /// The CUDA ordinals of this process's ranks, in order.
        pub fn ordinals(&self) -> Vec<usize> {
            self.ranks.iter().map(|r| r.ordinal).collect()
        }

        /// The CUDA contexts of this process's ranks, in order.
        pub fn contexts(&self) -> Vec<Arc<CudaContext>> {
            self.ranks.iter().map(|r| r.ctx.clone()).collect()
        }

        /// How long a collective may take before the communicators are aborted.
        pub fn timeout(&self) -> Duration {
            self.timeout
        }

        /// Sets how long a collective may take before the communicators are aborted.
        pub fn set_timeout(&mut self, timeout: Duration) {
            self.timeout = timeout;
        }

        /// Why the communicators were aborted, if they were.
        pub fn aborted(&self) -> Option<&str> {
            self.aborted.as_deref()
        }

        fn where_(&self) -> String {
            match self.ranks.as_slice() {
                [r] => place(r.rank, self.world, r.ordinal),
                rs => format!(
                    "ranks {:?} of {} (GPUs {:?})",
                    rs.iter().map(|r| r.rank).collect::<Vec<_>>(),
                    self.world,
                    self.ordinals()
                ),
            }
        }

        fn check_usable(&self, what: &'static str) -> Result<()> {
            match &self.aborted {
                Some(reason) => Err(Error::NcclAborted { what, place: self.where_(), reason: reason.clone() }),
                None => Ok(()),
            }
        }

        /// Aborts every communicator (`ncclCommAbort`): in-flight collectives stop, and every
        /// later call fails with `reason`.
        pub fn abort(&mut self, reason: impl Into<String>) {
            if self.aborted.is_some() {
                return;
            }
            self.aborted = Some(reason.into());
            for r in &self.ranks {
                let _ = r.ctx.bind_to_thread();
                // SAFETY: each handle is a live communicator of ours, aborted exactly once
                // (`aborted` is set above, and Drop skips aborted communicators).
                unsafe {
                    let _ = sys::ncclCommAbort(r.comm);
                }
            }
        }

        /// Polls the communicators' asynchronous state until none is `ncclInProgress`
        /// (non-blocking communicators), failing on an error, the deadline or `abort`.
        fn wait_ready(
            &mut self,
            what: &'static str,
            call: &'static str,
            started: Instant,
            abort: &dyn Fn() -> Option<String>,
        ) -> Result<()> {
            if self.blocking {
                return Ok(());
            }
            loop {
                let mut pending = false;
                for r in &self.ranks {
                    let mut state = sys::ncclResult_t::ncclSuccess;
                    // SAFETY: a live communicator of ours and a valid out-pointer.
                    let q = unsafe { sys::ncclCommGetAsyncError(r.comm, &mut state) };
                    let failed = match q.result() {
                        Err(e) => Some(e),
                        Ok(_) => match state {
                            sys::ncclResult_t::ncclInProgress => {
                                pending = true;
                                None
                            }
                            s => s.result().err(),
                        },
                    };
                    if let Some(e) = failed {
                        let err = Error::Nccl {
                            call,
                            place: place(r.rank, self.world, r.ordinal),
                            source: NcclError(e),
                            detail: last_error(r.comm),
                        };
                        self.abort(err.to_string());
                        return Err(err);
                    }
                }
                if !pending {
                    return Ok(());
                }
                self.check_deadline(what, started, abort)?;
                pause(started);
            }
        }

        fn check_deadline(
            &mut self,
            what: &'static str,
            started: Instant,
            abort: &dyn Fn() -> Option<String>,
        ) -> Result<()> {
            if let Some(reason) = abort() {
                let place = self.where_();
                self.abort(reason.clone());
                return Err(Error::NcclAborted { what, place, reason });
            }
            if started.elapsed() >= self.timeout {
                let place = self.where_();
                let timeout = self.timeout;
                self.abort(format!("nccl {what} timed out after {timeout:?}"));
                return Err(Error::NcclTimeout { what, place, timeout });
            }
            Ok(())
        }

        /// Checks that buffer `i` lives on rank `i`'s GPU.
        fn check_devices<'a>(
            &self,
            kernel: &'static str,
            streams: impl Iterator<Item = &'a Arc<CudaStream>>,
        ) -> Result<()> {
            for (i, (s, r)) in streams.zip(&self.ranks).enumerate() {
                if **s.context() != *r.ctx {
                    return Err(Error::InvalidLaunch {
                        kernel,
                        detail: format!(
                            "buffer {i} is on GPU {} but rank {} of the communicator is on GPU {}",
                            s.context().ordinal(),
                            r.rank,
                            r.ordinal
                        ),
                    });
                }
            }
            Ok(())
        }

        /// Runs `enqueue` for every rank between `ncclGroupStart` and `ncclGroupEnd`, then
        /// waits for NCCL to have enqueued the work (non-blocking communicators). `enqueue`
        /// returns the guards of the buffers it used, dropped only after that.
        fn grouped<'b>(
            &mut self,
            what: &'static str,
            call: &'static str,
            abort: &dyn Fn() -> Option<String>,
            mut enqueue: impl FnMut(
                &Rank,
            )
                -> (std::result::Result<(), cudarc::nccl::result::NcclError>, Vec<SyncOnDrop<'b>>),
        ) -> Result<()> {
            let started = Instant::now();
            let mut guards: Vec<SyncOnDrop<'b>> = Vec::new();
            cudarc::nccl::result::group_start().map_err(|e| Error::Nccl {
                call: "ncclGroupStart",
                place: self.where_(),
                source: NcclError(e),
                detail: String::new(),
            })?;
            let mut first_err = None;
            for r in &self.ranks {
                let (res, g) = enqueue(r);
                guards.extend(g);
                if let Err(e) = res {
                    first_err.get_or_insert(Error::Nccl {
                        call,
                        place: place(r.rank, self.world, r.ordinal),
                        source: NcclError(e),
                        detail: last_error(r.comm),
                    });
                }
            }
            // The group is always closed, even after a failed call inside it.
            let end = cudarc::nccl::result::group_end();
            if let Some(e) = first_err {
                self.abort(e.to_string());
                return Err(e);
            }
            if let Err(e) = end {
                let err = Error::Nccl {
                    call: "ncclGroupEnd",
                    place: self.where_(),
                    source: NcclError(e),
                    detail: self.ranks.first().map(|r| last_error(r.comm)).unwrap_or_default(),
                };
                self.abort(err.to_string());
                return Err(err);
            }
            let ready = self.wait_ready(what, call, started, abort);
            // The work is on the streams now: record the buffers' read/write events after it.
            drop(guards);
            ready
        }

        /// Enqueues an in-place all-reduce of `bufs` (one per rank of this process, in rank
        /// order, equal lengths) on each buffer's stream; returns once NCCL has enqueued it.
        /// [`synchronize`](Self::synchronize) waits for it with the timeout.
        pub fn all_reduce_in_place_async<T: NcclElement>(
            &mut self,
            bufs: &mut [CudaSlice<T>],
            op: ReduceOp,
        ) -> Result<()> {
            self.all_reduce_in_place_async_with(bufs, op, &|| None)
        }

        /// [`all_reduce_in_place_async`](Self::all_reduce_in_place_async), checking `abort`
        /// while NCCL enqueues.
        pub fn all_reduce_in_place_async_with<T: NcclElement>(
            &mut self,
            bufs: &mut [CudaSlice<T>],
            op: ReduceOp,
            abort: &dyn Fn() -> Option<String>,
        ) -> Result<()> {
            const CALL: &str = "ncclAllReduce";
            self.check_usable("all-reduce")?;
            let lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
            let count = check_buffer_lens(CALL, self.ranks.len(), &lens)?;
            self.check_devices(CALL, bufs.iter().map(|b| b.stream()))?;
            let streams: Vec<Arc<CudaStream>> = bufs.iter().map(|b| b.stream().clone()).collect();
            let redop = nccl_op(op);
            let mut slots: Vec<Option<&mut CudaSlice<T>>> = bufs.iter_mut().map(Some).collect();
            let mut i = 0usize;
            self.grouped("all-reduce", CALL, abort, |r| {
                let buf = slots[i].take().expect("one buffer per rank");
                let stream = &streams[i];
                i += 1;
                let (ptr, guard) = buf.device_ptr_mut(stream);
                // SAFETY: `ptr` addresses `count` elements of T on this rank's GPU (checked
                // above), kept alive and exclusively borrowed until the guards drop after NCCL
                // has enqueued the work; the stream belongs to the same context.
                let res = unsafe {
                    sys::ncclAllReduce(
                        ptr as *const std::ffi::c_void,
                        ptr as *mut std::ffi::c_void,
                        count,
                        T::DTYPE,
                        redop,
                        r.comm,
                        stream.cu_stream() as sys::cudaStream_t,
                    )
                };
                (res.result().map(|_| ()), vec![guard])
            })
        }

        /// Enqueues an out-of-place all-reduce: `recv[i]` gets the reduction of every rank's
        /// `send`. Both on rank `i`'s GPU, equal lengths; runs on `recv[i]`'s stream.
        pub fn all_reduce_async<T: NcclElement>(
            &mut self,
            send: &[CudaSlice<T>],
            recv: &mut [CudaSlice<T>],
            op: ReduceOp,
        ) -> Result<()> {
            self.all_reduce_async_with(send, recv, op, &|| None)
        }

        /// [`all_reduce_async`](Self::all_reduce_async), checking `abort` while NCCL enqueues.
        pub fn all_reduce_async_with<T: NcclElement>(
            &mut self,
            send: &[CudaSlice<T>],
            recv: &mut [CudaSlice<T>],
            op: ReduceOp,
            abort: &dyn Fn() -> Option<String>,
        ) -> Result<()> {
            const CALL: &str = "ncclAllReduce";
            self.check_usable("all-reduce")?;
            let mut lens: Vec<usize> = send.iter().map(|b| b.len()).collect();
            let count = check_buffer_lens(CALL, self.ranks.len(), &lens)?;
            lens = recv.iter().map(|b| b.len()).collect();
            let rcount = check_buffer_lens(CALL, self.ranks.len(), &lens)?;
            if rcount != count {
                return Err(Error::InvalidLaunch {
                    kernel: CALL,
                    detail: format!("send buffers hold {count} elements but receive buffers {rcount}"),
                });
            }
            self.check_devices(CALL, send.iter().map(|b| b.stream()))?;
            self.check_devices(CALL, recv.iter().map(|b| b.stream()))?;
            let streams: Vec<Arc<CudaStream>> = recv.iter().map(|b| b.stream().clone()).collect();
            let redop = nccl_op(op);
            let mut slots: Vec<Option<&mut CudaSlice<T>>> = recv.iter_mut().map(Some).collect();
            let mut i = 0usize;
            self.grouped("all-reduce", CALL, abort, |r| {
                let dst = slots[i].take().expect("one buffer per rank");
                let stream = &streams[i];
                let (src_ptr, g1) = send[i].device_ptr(stream);
                let (dst_ptr, g2) = dst.device_ptr_mut(stream);
                i += 1;
                // SAFETY: both pointers address `count` elements of T on this rank's GPU
                // (checked above), alive until the guards drop after NCCL has enqueued the
                // work; `send` is only read and `recv` exclusively borrowed.
                let res = unsafe {
                    sys::ncclAllReduce(
                        src_ptr as *const std::ffi::c_void,
                        dst_ptr as *mut std::ffi::c_void,
                        count,
                        T::DTYPE,
                        redop,
                        r.comm,
                        stream.cu_stream() as sys::cudaStream_t,
                    )
                };
                (res.result().map(|_| ()), vec![g1, g2])
            })
        }

        /// Waits until all work enqueued so far on `streams` (the streams of the buffers
        /// reduced) has finished, polling NCCL's asynchronous errors; aborts the communicators
        /// after the timeout or when `abort` gives a reason.
        pub fn synchronize(&mut self, streams: &[Arc<CudaStream>], abort: &dyn Fn() -> Option<String>) -> Result<()> {
            self.check_usable("all-reduce")?;
            let started = Instant::now();
            let events: Vec<CudaEvent> = streams
                .iter()
                .map(|s| s.record_event(None).map_err(Error::driver("cuEventRecord")))
                .collect::<Result<_>>()?;
            loop {
                let mut done = true;
                for e in &events {
                    if !e.try_is_complete().map_err(Error::driver("cuEventQuery"))? {
                        done = false;
                        break;
                    }
                }
                if done {
                    return Ok(());
                }
                // A peer's failure shows up here while the kernels wait for it.
                for r in &self.ranks {
                    let mut state = sys::ncclResult_t::ncclSuccess;
                    // SAFETY: a live communicator of ours and a valid out-pointer.
                    let q = unsafe { sys::ncclCommGetAsyncError(r.comm, &mut state) };
                    if let Some(e) = q.result().err().or_else(|| match state {
                        sys::ncclResult_t::ncclInProgress => None,
                        s => s.result().err(),
                    }) {
                        let err = Error::Nccl {
                            call: "ncclAllReduce",
                            place: place(r.rank, self.world, r.ordinal),
                            source: NcclError(e),
                            detail: last_error(r.comm),
                        };
                        self.abort(err.to_string());
                        return Err(err);
                    }
                }
                self.check_deadline("all-reduce", started, abort)?;
                pause(started);
            }
        }

        /// An in-place all-reduce of `bufs`, waited for (with the timeout).
        pub fn all_reduce_in_place<T: NcclElement>(&mut self, bufs: &mut [CudaSlice<T>], op: ReduceOp) -> Result<()> {
            self.all_reduce_in_place_async(bufs, op)?;
            let streams: Vec<Arc<CudaStream>> = bufs.iter().map(|b| b.stream().clone()).collect();
            self.synchronize(&streams, &|| None)
        }

        /// An out-of-place all-reduce of `send` into `recv`, waited for (with the timeout).
        pub fn all_reduce<T: NcclElement>(
            &mut self,
            send: &[CudaSlice<T>],
            recv: &mut [CudaSlice<T>],
            op: ReduceOp,
        ) -> Result<()> {
            self.all_reduce_async(send, recv, op)?;
            let streams: Vec<Arc<CudaStream>> = recv.iter().map(|b| b.stream().clone()).collect();
            self.synchronize(&streams, &|| None)
        }
    }

    impl Drop for NcclComms {
        fn drop(&mut self) {
            // ncclCommAbort frees a communicator without waiting on its peers (ncclCommDestroy
            // may: it finalizes first). Work already enqueued on our streams has been waited for
            // by whoever needed its result.
            self.abort("the communicators were dropped");
        }
    }

    /// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`.
    fn nonblocking_config() -> sys::ncclConfig_t {
        const UNDEF_INT: i32 = i32::MIN;
        sys::ncclConfig_t {
            size: std::mem::size_of::<sys::ncclConfig_t>(),
            magic: 0xcafe_beef,
            // NCCL_VERSION_CODE of the headers cudarc's bindings come from (2.30.0): NCCL reads
            // the fields a struct of that version has, at most as many as it knows.
            version: 2 * 10000 + 30 * 100,
            blocking: 0,
            cgaClusterSize: UNDEF_INT,
            minCTAs: UNDEF_INT,
            maxCTAs: UNDEF_INT,
            netName: std::ptr::null(),
            splitShare: UNDEF_INT,
            trafficClass: UNDEF_INT,
            commName: std::ptr::null(),
            collnetEnable: UNDEF_INT,
            CTAPolicy: UNDEF_INT,
            shrinkShare: UNDEF_INT,
            nvlsCTAs: UNDEF_INT,
            nChannelsPerNetPeer: UNDEF_INT,
            nvlinkCentricSched: UNDEF_INT,
            graphUsageMode: UNDEF_INT,
            numRmaCtx: UNDEF_INT,
            maxP2pPeers: UNDEF_INT,
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn config_is_nccl_config_initializer_with_blocking_off() {
            let c = nonblocking_config();
            assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
            assert_eq!(c.magic, 0xcafebeef);
            assert_eq!(c.version, 23000);
            assert_eq!(c.blocking, 0);
            assert_eq!(c.minCTAs, i32::MIN);
            assert!(c.netName.is_null() && c.commName.is_null());
        }

        #[test]
        fn ops_map_to_nccl_reductions() {
            assert_eq!(nccl_op(ReduceOp::Sum), sys::ncclRedOp_t::ncclSum);
            assert_eq!(nccl_op(ReduceOp::Mean), sys::ncclRedOp_t::ncclAvg);
            assert_eq!(nccl_op(ReduceOp::Max), sys::ncclRedOp_t::ncclMax);
            assert_eq!(nccl_op(ReduceOp::Min), sys::ncclRedOp_t::ncclMin);
        }

        #[test]
        fn remote_and_timeout_codes_are_classified() {
            let e = NcclError(cudarc::nccl::result::NcclError(sys::ncclResult_t::ncclRemoteError));
            assert!(e.is_remote() && !e.is_timeout());
            let e = NcclError(cudarc::nccl::result::NcclError(sys::ncclResult_t::ncclTimeout));
            assert!(e.is_timeout() && !e.is_remote());
            assert_eq!(format!("{e:?}"), "NcclError(ncclTimeout)");
        }

        /// Runs where libnccl loads, GPU or not (a `libnccl.so` link to the PyPI wheel's `libnccl.so.2` will do).
        #[test]
        fn libnccl_reports_its_version_and_makes_ids() {
            if crate::probe::nccl().is_err() {
                eprintln!("skipped: libnccl.so is not on the library path");
                return;
            }
            let (major, minor, patch) = nccl_version().unwrap();
            eprintln!("NCCL {major}.{minor}.{patch} loaded");
            assert!(major == 2 && minor >= 10, "ncclAvg needs NCCL 2.10 or later, loaded {major}.{minor}");
            // ncclGetUniqueId needs no GPU (it opens NCCL's bootstrap socket); where NCCL
            // refuses anyway, the error names the call.
            match (NcclId::new(), NcclId::new()) {
                (Ok(a), Ok(b)) => {
                    eprintln!("ncclGetUniqueId: {a:?}, {b:?}");
                    assert_ne!(a.as_bytes(), &[0u8; NCCL_ID_BYTES]);
                    assert_ne!(a, b, "two ids from one process must differ");
                }
                (Err(e), _) | (_, Err(e)) => assert!(e.to_string().starts_with("ncclGetUniqueId failed"), "{e}"),
            }
        }

        #[test]
        fn without_a_driver_comms_are_an_error_not_a_panic() {
            if crate::probe::driver().is_ok() && crate::probe::nccl().is_ok() {
                return; // a GPU host: tests/gpu_nccl.rs covers it
            }
            let e = NcclComms::all_local(&[0]).unwrap_err().to_string();
            assert!(e.contains("not on the library path"), "{e}");
            let id = NcclId::from_bytes(&[0; NCCL_ID_BYTES]).unwrap();
            let e = NcclComms::join(&id, 0, 1, 0, Duration::from_secs(1), &|| None).unwrap_err().to_string();
            assert!(e.contains("not on the library path"), "{e}");
        }
    }
}

/// The GPU side of `strata bench allreduce --gpus`: NCCL all-reduce timed the way nccl-tests
/// times it (host clock around `iters` back-to-back collectives and one synchronisation), every
/// result checked against a closed form, and the device-to-device copy bandwidth of the same
/// GPUs. The strata crate prints the table; it holds no cudarc.
#[cfg(feature = "nccl")]
pub mod bench {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
    use strata_core::ReduceOp;

    use super::NcclComms;
    use crate::{Error, Result};

    /// Element `i` of rank `r`'s input: `(i % PERIOD) + r / 2`, so that every partial sum is a
    /// multiple of 0.5 far below 2^24 (exact in f32 in any order).
    pub const PERIOD: usize = 251;

    /// Rank `r`'s input element `i`.
    pub fn value(r: usize, i: usize) -> f32 {
        (i % PERIOD) as f32 + r as f32 * 0.5
    }

    /// Whether `x` is the all-reduce of `n` ranks at element `i`: exact, except `Mean` over a
    /// world size that is not a power of two (NCCL's `ncclAvg` premultiplies by `1/n`): within
    /// `n` ulps.
    pub fn is_right(op: ReduceOp, n: usize, i: usize, x: f32) -> bool {
        let j = i % PERIOD;
        let sum = n as f32 * j as f32 + (n * (n - 1)) as f32 * 0.25;
        let want = match op {
            ReduceOp::Sum => sum,
            ReduceOp::Mean => sum / n as f32,
            ReduceOp::Max => value(n - 1, i),
            ReduceOp::Min => value(0, i),
        };
        if op == ReduceOp::Mean && !n.is_power_of_two() {
            (x - want).abs() <= n as f32 * f32::EPSILON * want.abs().max(1.0)
        } else {
            x == want
        }
    }

    /// One measured all-reduce: median-free, as nccl-tests: the mean over `iters` back-to-back
    /// collectives.
    #[derive(Clone, Copy, Debug)]
    pub struct Timing {
        /// Time of one all-reduce.
        pub time: Duration,
        /// Timed iterations.
        pub iters: usize,
        /// Result elements (over every rank) that differ from the closed form, checked after
        /// the first warm-up and after the timed iterations.
        pub wrong: usize,
    }

    /// NCCL communicators over GPUs `0..n` of this process, with one stream per GPU.
    #[derive(Debug)]
    pub struct AllReduceBench {
        comms: NcclComms,
        streams: Vec<Arc<CudaStream>>,
    }

    impl AllReduceBench {
        /// Communicators over every GPU in `ordinals`.
        pub fn new(ordinals: &[usize]) -> Result<Self> {
            let comms = NcclComms::all_local(ordinals)?;
            let streams = comms
                .contexts()
                .iter()
                .map(|c| c.new_stream().map_err(Error::driver("cuStreamCreate")))
                .collect::<Result<Vec<_>>>()?;
            Ok(Self { comms, streams })
        }

        /// The number of GPUs.
        pub fn gpus(&self) -> usize {
            self.streams.len()
        }

        fn upload(&self, count: usize, fill: impl Fn(usize, usize) -> f32) -> Result<Vec<CudaSlice<f32>>> {
            self.streams
                .iter()
                .enumerate()
                .map(|(r, s)| {
                    let host: Vec<f32> = (0..count).map(|i| fill(r, i)).collect();
                    s.clone_htod(&host).map_err(Error::driver("cuMemcpyHtoD"))
                })
                .collect()
        }

        fn count_wrong(&self, op: ReduceOp, bufs: &[CudaSlice<f32>]) -> Result<usize> {
            let n = self.gpus();
            let mut wrong = 0;
            for b in bufs {
                let host = b.stream().clone_dtoh(b).map_err(Error::driver("cuMemcpyDtoH"))?;
                wrong += host.iter().enumerate().filter(|&(i, &x)| !is_right(op, n, i, x)).count();
            }
            Ok(wrong)
        }

        /// Times the all-reduce of `count` f32 per GPU, out of place or in place. `iters`:
        /// the timed iterations, or `None` for `adaptive(time of one warm-up iteration)`.
        pub fn run(
            &mut self,
            count: usize,
            op: ReduceOp,
            in_place: bool,
            warmup: usize,
            iters: Option<usize>,
            adaptive: &dyn Fn(Duration) -> usize,
        ) -> Result<Timing> {
            // Out of place: `send` holds the inputs throughout, `recv` (poisoned with NaN) the
            // results. In place: `bufs` holds inputs, then results; it is refilled before every
            // checked run (timed iterations reduce already reduced values, which costs the same).
            let send = if in_place { Vec::new() } else { self.upload(count, value)? };
            let mut recv = if in_place { Vec::new() } else { self.upload(count, |_, _| f32::NAN)? };
            let mut bufs = if in_place { self.upload(count, value)? } else { Vec::new() };
            let streams = self.streams.clone();
            let once = |me: &mut Self, bufs: &mut Vec<CudaSlice<f32>>, recv: &mut Vec<CudaSlice<f32>>| {
                if in_place {
                    me.comms.all_reduce_in_place_async(bufs, op)
                } else {
                    me.comms.all_reduce_async(&send, recv, op)
                }
            };
            let checked = |me: &Self, bufs: &Vec<CudaSlice<f32>>, recv: &Vec<CudaSlice<f32>>| {
                me.count_wrong(op, if in_place { bufs } else { recv })
            };
            // The first warm-up is checked.
            let t0 = Instant::now();
            once(self, &mut bufs, &mut recv)?;
            self.comms.synchronize(&streams, &|| None)?;
            let mut estimate = t0.elapsed();
            let mut wrong = checked(self, &bufs, &recv)?;
            for _ in 1..warmup.max(1) {
                let t = Instant::now();
                once(self, &mut bufs, &mut recv)?;
                self.comms.synchronize(&streams, &|| None)?;
                estimate = estimate.min(t.elapsed());
            }
            let iters = iters.unwrap_or_else(|| adaptive(estimate)).max(1);
            let t = Instant::now();
            for _ in 0..iters {
                once(self, &mut bufs, &mut recv)?;
            }
            self.comms.synchronize(&streams, &|| None)?;
            let time = t.elapsed() / iters as u32;
            // Checked again after the timed loop (in place: on refilled inputs).
            if in_place {
                bufs = self.upload(count, value)?;
                once(self, &mut bufs, &mut recv)?;
                self.comms.synchronize(&streams, &|| None)?;
            }
            wrong += checked(self, &bufs, &recv)?;
            Ok(Timing { time, iters, wrong })
        }
    }

    /// A device-to-device copy bandwidth, bytes copied per second (read + write traffic is
    /// twice that).
    #[derive(Clone, Debug)]
    pub struct CopyBandwidth {
        /// `GPU 0` (`cuMemcpyDtoDAsync` within one GPU) or `GPU 0 -> GPU 1` (peer copy).
        pub what: String,
        /// Bytes copied per second.
        pub bytes_per_sec: f64,
    }

    fn time_copies(
        stream: &Arc<CudaStream>,
        src: &CudaSlice<u8>,
        dst: &mut CudaSlice<u8>,
        repeats: usize,
    ) -> Result<Duration> {
        stream.memcpy_dtod(src, dst).map_err(Error::driver("cuMemcpyDtoDAsync"))?;
        stream.synchronize().map_err(Error::driver("cuStreamSynchronize"))?;
        let t = Instant::now();
        for _ in 0..repeats {
            stream.memcpy_dtod(src, dst).map_err(Error::driver("cuMemcpyDtoDAsync"))?;
        }
        stream.synchronize().map_err(Error::driver("cuStreamSynchronize"))?;
        Ok(t.elapsed() / repeats.max(1) as u32)
    }

    /// The copy bandwidth of `bytes` within each GPU of `ordinals`, and from the first GPU to
    /// each other one (a peer copy where the GPUs allow it, staged by the driver otherwise).
    pub fn copy_bandwidth(ordinals: &[usize], bytes: usize, repeats: usize) -> Result<Vec<CopyBandwidth>> {
        crate::probe::driver()?;
        let ctxs = ordinals
            .iter()
            .map(|&o| CudaContext::new(o).map_err(Error::driver("cuDevicePrimaryCtxRetain")))
            .collect::<Result<Vec<_>>>()?;
        let mut out = Vec::new();
        let alloc = |ctx: &Arc<CudaContext>| -> Result<(Arc<CudaStream>, CudaSlice<u8>, CudaSlice<u8>)> {
            let s = ctx.new_stream().map_err(Error::driver("cuStreamCreate"))?;
            let a = s.alloc_zeros::<u8>(bytes).map_err(Error::driver("cuMemAlloc"))?;
            let b = s.alloc_zeros::<u8>(bytes).map_err(Error::driver("cuMemAlloc"))?;
            Ok((s, a, b))
        };
        let mut bufs = ctxs.iter().map(alloc).collect::<Result<Vec<_>>>()?;
        for (o, (s, a, b)) in ordinals.iter().zip(bufs.iter_mut()) {
            let t = time_copies(s, a, b, repeats)?;
            out.push(CopyBandwidth {
                what: format!("GPU {o}"),
                bytes_per_sec: bytes as f64 / t.as_secs_f64().max(1e-12),
            });
        }
        if bufs.len() > 1 {
            let (first, rest) = bufs.split_at_mut(1);
            let src = &first[0].1;
            for (o, (s, _, b)) in ordinals[1..].iter().zip(rest.iter_mut()) {
                let t = time_copies(s, src, b, repeats)?;
                out.push(CopyBandwidth {
                    what: format!("GPU {} -> GPU {o}", ordinals[0]),
                    bytes_per_sec: bytes as f64 / t.as_secs_f64().max(1e-12),
                });
            }
        }
        Ok(out)
    }

    /// The name of GPU `ordinal` as the driver reports it.
    pub fn gpu_name(ordinal: usize) -> Result<String> {
        let ctx = CudaContext::new(ordinal).map_err(Error::driver("cuDevicePrimaryCtxRetain"))?;
        ctx.name().map_err(Error::driver("cuDeviceGetName"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_reject_wrong_lengths() {
        let bytes: Vec<u8> = (0..NCCL_ID_BYTES as u32).map(|i| (i * 7 % 251) as u8).collect();
        let id = NcclId::from_bytes(&bytes).unwrap();
        assert_eq!(id.to_bytes().as_slice(), bytes.as_slice());
        assert_eq!(NcclId::from_bytes(id.as_bytes()).unwrap(), id);
        for len in [0, 1, 127, 129, 256] {
            let e = NcclId::from_bytes(&vec![0u8; len]).unwrap_err().to_string();
            assert_eq!(e, format!("invalid nccl unique id: expected 128 bytes, got {len} bytes"));
        }
    }

    #[test]
    fn id_debug_shows_a_fingerprint_not_the_bytes() {
        let a = NcclId::from_bytes(&[1; NCCL_ID_BYTES]).unwrap();
        let b = NcclId::from_bytes(&[2; NCCL_ID_BYTES]).unwrap();
        assert_ne!(a.fingerprint(), b.fingerprint());
        let d = format!("{a:?}");
        assert!(d.starts_with("NcclId(") && d.len() == "NcclId()".len() + 16, "{d}");
    }

    #[test]
    fn buffer_checks() {
        assert_eq!(check_buffer_lens("k", 2, &[5, 5]).unwrap(), 5);
        assert_eq!(check_buffer_lens("k", 1, &[0]).unwrap(), 0);
        let e = check_buffer_lens("k", 2, &[5]).unwrap_err().to_string();
        assert!(e.contains("1 buffer(s) for 2 device(s)"), "{e}");
        let e = check_buffer_lens("k", 3, &[5, 5, 4]).unwrap_err().to_string();
        assert!(e.contains("buffer 2 holds 4 elements but buffer 0 holds 5"), "{e}");
        assert!(check_buffer_lens("k", 0, &[]).is_err());
    }

    #[test]
    fn places_name_rank_and_gpu() {
        assert_eq!(place(1, 4, 3), "rank 1 of 4 (GPU 3)");
    }

    #[test]
    fn without_nccl_the_id_is_a_clear_error() {
        if nccl_available() {
            return;
        }
        // Either not built with `nccl`, or libnccl is missing, or (libnccl present, no GPU) NCCL
        // itself refuses; never a panic.
        if let Err(e) = NcclId::new() {
            assert!(!e.to_string().is_empty());
        }
    }
}

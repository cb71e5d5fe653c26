//! A caching allocator for the device buffers Strata owns, one pool per logical device.
//!
//! The policy is pure code, generic over a small [`MemoryBackend`] (the thing that really
//! allocates: the CUDA driver behind the `cuda` feature, [`SimulatedBackend`] in tests), so it
//! is compiled and tested everywhere.
//!
//! # Modes
//!
//! * **Growth** (`MemoryPolicy::Growth`, TF's `allow_growth`): blocks are allocated from the
//!   backend on demand. A freed block goes to a cache keyed by its size and is handed out again
//!   to a request of the same size class (a cached block is reused for a request of `n` bytes
//!   when its size lies in `[n, n + n/8]`, after rounding). When the backend is out of memory,
//!   or a new block would take the bytes the pool holds past its limit, the cache is released
//!   (largest blocks first) before the allocation is retried or refused.
//! * **Reservation** (`grab-all`, TF's default, and `limit:` / `fraction:`): the pool's budget
//!   is allocated from the backend in one piece at the first allocation, and buffers are
//!   sub-allocated from it (best fit, freed ranges coalesce). `grab-all` reserves 95% of the
//!   memory the backend reports free at that moment (the rest is left to the driver, cuBLAS
//!   workspaces and other libraries, as TF leaves a margin); `limit:` and `fraction:` reserve
//!   exactly their budget. The reservation is kept until the pool is dropped (or
//!   [`Pool::empty_cache`] while nothing is in use).
//!
//! # Limits and accounting
//!
//! Sizes are rounded up to [`GRANULE`] bytes (and 0 to one granule). A pool's limit is the
//! logical device's `memory_limit` when it has one, else the budget of the [`MemoryPolicy`]
//! (the device's whole memory for `grab-all` and `growth`). An allocation that would take the
//! bytes in use past the limit fails with [`Error::MemoryLimit`], naming the device, the
//! request, the bytes in use and the limit (exact bytes) and what to change; in growth mode the
//! bytes held from the backend (in use plus cached) never exceed the limit either, so logical
//! devices sharing one GPU stay within their shares.
//!
//! Every block handed out is recorded, at its rounded size, in strata-core's
//! [`MemoryTracker`] under the logical device's spec (the global tracker by default), so
//! [`strata_core::device::memory_info`] reports the current and peak bytes of Strata's live
//! buffers on that device. Cached and reserved-but-unused bytes are not counted there; they
//! show in [`PoolStats`].
//!
//! ```
//! use strata_core::device::{DeviceSpec, MemoryPolicy, MemoryTracker};
//! use strata_cuda::alloc::{Pool, PoolConfig, SimulatedBackend};
//!
//! let tracker: &'static MemoryTracker = Box::leak(Box::new(MemoryTracker::new()));
//! let device = DeviceSpec::gpu(0);
//! // A 1 MiB device, in growth mode.
//! let config = PoolConfig::resolve(device.clone(), "GPU 0", MemoryPolicy::Growth, None, Some(1 << 20))?
//!     .with_tracker(tracker);
//! let backend = SimulatedBackend::new(1 << 20);
//! let pool = Pool::new(config, backend.clone());
//! let a = pool.allocate(1000)?; // rounded to 1024 bytes
//! drop(a); // back to the cache
//! let b = pool.allocate(1000)?; // the cached block again
//! assert_eq!(backend.stats().allocations, 1);
//! assert_eq!(tracker.memory_info(&device).current, 1024);
//! let err = pool.allocate(2 << 20).unwrap_err();
//! assert!(err.to_string().contains("cannot allocate 2097152 bytes on /device:GPU:0"), "{err}");
//! # drop(b);
//! # Ok::<(), strata_cuda::Error>(())
//! ```

#[cfg(feature = "cuda")]
mod cuda;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use strata_core::device::{format_bytes, DeviceSpec, LogicalDevice, LogicalKind, MemoryPolicy, MemoryTracker};

use crate::{Error, Result};

#[cfg(feature = "cuda")]
pub use cuda::{CudaBackend, GpuAllocators, GpuBuffer, GpuPool};

/// Allocation granularity in bytes: every block is a multiple of it, and blocks carved from a
/// reservation start at multiples of it (CUDA's own allocations are 256-byte aligned).
pub const GRANULE: u64 = 512;

/// The share of the free memory `grab-all` reserves, in percent.
pub const GRAB_ALL_PERCENT: u64 = 95;

/// The size a request of `bytes` takes: rounded up to [`GRANULE`], at least one granule.
/// `None` on overflow.
pub fn round_size(bytes: u64) -> Option<u64> {
    let bytes = bytes.max(1);
    bytes.checked_add(GRANULE - 1).map(|b| b / GRANULE * GRANULE)
}

/// Why a backend allocation failed.
#[derive(Debug)]
pub enum BackendError {
    /// The device has no room (`CUDA_ERROR_OUT_OF_MEMORY`): the pool may release its cache
    /// and retry.
    OutOfMemory,
    /// Anything else, passed on.
    Failed(Error),
}

/// What really allocates device memory, in large blocks the [`Pool`] manages.
pub trait MemoryBackend: Send + 'static {
    /// One allocation of the backend (owns it; freed by [`MemoryBackend::free`]).
    type Chunk: Send;

    /// Allocates `bytes` bytes (a multiple of [`GRANULE`], never 0).
    fn allocate(&mut self, bytes: u64) -> Result<Self::Chunk, BackendError>;

    /// Frees a chunk; called once per chunk, after every buffer carved from it is released.
    fn free(&mut self, chunk: Self::Chunk) -> Result<()>;

    /// The device address of the chunk's first byte.
    fn address(&self, chunk: &Self::Chunk) -> u64;

    /// The bytes the device has free now (`cuMemGetInfo`), for `grab-all`; `None` when
    /// unknown.
    fn free_bytes(&mut self) -> Result<Option<u64>>;
}

/// Where a pool's limit comes from, and so what to change when it is hit.
#[derive(Clone, Debug, PartialEq)]
pub enum LimitSource {
    /// The `memory_limit` of the logical device's `LogicalDeviceConfiguration`.
    LogicalDevice,
    /// The memory policy (`limit:` or `fraction:`).
    Policy(MemoryPolicy),
    /// The device's whole memory (`grab-all`, `growth`), or the reservation `grab-all` got.
    Device,
}

impl LimitSource {
    fn describe(&self) -> String {
        match self {
            LimitSource::LogicalDevice => "the memory_limit of the logical device".to_string(),
            LimitSource::Policy(p) => format!("memory policy {p}"),
            LimitSource::Device => "the device's memory".to_string(),
        }
    }

    fn fix(&self) -> String {
        match self {
            LimitSource::LogicalDevice => "free buffers, allocate less, or raise memory_limit in the \
                                           logical device's LogicalDeviceConfiguration"
                .to_string(),
            LimitSource::Policy(_) => {
                "free buffers, allocate less, or raise the memory policy (a larger limit:<size> or \
                 fraction:<f>, or growth)"
                    .to_string()
            }
            LimitSource::Device => "free buffers, allocate less, or spread the work over more GPUs".to_string(),
        }
    }
}

/// How a pool gets memory from its backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolMode {
    /// Blocks on demand, cached when freed.
    Growth,
    /// One reservation up front (at the first allocation), sub-allocated.
    Reserve(Reservation),
}

/// How much a reserving pool reserves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reservation {
    /// Exactly this many bytes (a multiple of [`GRANULE`]).
    Bytes(u64),
    /// [`GRAB_ALL_PERCENT`] of what the backend reports free, capped by the limit.
    FreeMemory,
}

/// The configuration of one pool.
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// The logical device (the key in the [`MemoryTracker`]).
    pub device: DeviceSpec,
    /// The physical device, for messages (`"GPU 0"`).
    pub physical: String,
    /// Growth or reservation.
    pub mode: PoolMode,
    /// The most bytes in use at once (and, in growth mode, held), `None` for no limit.
    pub limit: Option<u64>,
    /// Where the limit comes from.
    pub limit_source: LimitSource,
    /// Where allocations are accounted.
    pub tracker: &'static MemoryTracker,
}

impl PoolConfig {
    /// The pool of logical device `device` on physical device `physical` (a label for
    /// messages) of `device_total` bytes, under `policy`, with the logical device's
    /// `memory_limit` if it has one:
    ///
    /// * with a `memory_limit`, that is the limit (it overrides the policy's size, as a virtual
    ///   device's `memory_limit` does in TF); `growth` allocates on demand up to it, every
    ///   other policy reserves it;
    /// * otherwise `growth` allocates on demand up to the device's memory, `grab-all` reserves
    ///   [`GRAB_ALL_PERCENT`] of the free memory, and `limit:` / `fraction:` reserve their
    ///   budget ([`MemoryPolicy::budget`], which fails when a limit exceeds the device or a
    ///   fraction is asked of a device of unknown size).
    ///
    /// Accounts to [`MemoryTracker::global`]; see [`PoolConfig::with_tracker`].
    pub fn resolve(
        device: DeviceSpec,
        physical: &str,
        policy: MemoryPolicy,
        memory_limit: Option<u64>,
        device_total: Option<u64>,
    ) -> Result<PoolConfig> {
        policy.validate()?;
        let (mode, limit, limit_source) = match memory_limit {
            Some(0) => {
                return Err(Error::Core(strata_core::Error::InvalidMemoryConfig(format!(
                    "{device} has a memory_limit of 0; give it a positive number of bytes"
                ))))
            }
            Some(limit) => {
                let mode = match policy {
                    MemoryPolicy::Growth => PoolMode::Growth,
                    _ => PoolMode::Reserve(Reservation::Bytes(round_down(limit))),
                };
                (mode, Some(limit), LimitSource::LogicalDevice)
            }
            None => {
                let budget = policy.budget(device_total).map_err(|e| Error::Core(prefix_memory_error(&device, e)))?;
                match policy {
                    MemoryPolicy::Growth => (PoolMode::Growth, budget, LimitSource::Device),
                    MemoryPolicy::GrabAll => (PoolMode::Reserve(Reservation::FreeMemory), budget, LimitSource::Device),
                    MemoryPolicy::Limit(_) | MemoryPolicy::Fraction(_) => {
                        let bytes = budget.unwrap_or(0);
                        let reserve = round_down(bytes);
                        if reserve == 0 {
                            return Err(Error::Core(strata_core::Error::InvalidMemoryConfig(format!(
                                "{device}: memory policy {policy} gives {bytes} bytes, less than one block of \
                                 {GRANULE}; use a larger limit or fraction"
                            ))));
                        }
                        (PoolMode::Reserve(Reservation::Bytes(reserve)), Some(bytes), LimitSource::Policy(policy))
                    }
                }
            }
        };
        Ok(PoolConfig {
            device,
            physical: physical.to_string(),
            mode,
            limit,
            limit_source,
            tracker: MemoryTracker::global(),
        })
    }

    /// [`PoolConfig::resolve`] for a logical device: its spec, physical device, total memory
    /// and `memory_limit`. Fails for a device that is not a GPU.
    pub fn for_logical_device(device: &LogicalDevice, policy: MemoryPolicy) -> Result<PoolConfig> {
        let LogicalKind::Gpu { memory_limit } = device.kind else {
            return Err(Error::Core(strata_core::Error::InvalidArgument(format!(
                "{} is not a GPU; device memory pools are for GPUs",
                device.spec
            ))));
        };
        PoolConfig::resolve(
            device.spec.clone(),
            &device.physical.label(),
            policy,
            memory_limit,
            device.physical.memory_bytes,
        )
    }

    /// This configuration accounting to `tracker` instead of the global one.
    pub fn with_tracker(mut self, tracker: &'static MemoryTracker) -> Self {
        self.tracker = tracker;
        self
    }

    fn label(&self) -> String {
        format!("{} ({})", self.device, self.physical)
    }
}

fn round_down(bytes: u64) -> u64 {
    bytes / GRANULE * GRANULE
}

fn prefix_memory_error(device: &DeviceSpec, e: strata_core::Error) -> strata_core::Error {
    match e {
        strata_core::Error::InvalidMemoryConfig(msg) => {
            strata_core::Error::InvalidMemoryConfig(format!("{device}: {msg}"))
        }
        other => other,
    }
}

/// What a pool holds and has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes of live buffers (rounded sizes).
    pub in_use: u64,
    /// The most bytes in use at once.
    pub peak: u64,
    /// Bytes held from the backend: in use, cached, and the unused part of a reservation.
    pub held: u64,
    /// Bytes of freed blocks kept for reuse (growth), or free in the reservation.
    pub cached: u64,
    /// Live buffers.
    pub buffers: u64,
    /// Allocations made from the backend.
    pub backend_allocations: u64,
    /// Chunks returned to the backend.
    pub backend_frees: u64,
    /// Requests served from the cache (growth mode).
    pub cache_hits: u64,
    /// The limit, `None` for none.
    pub limit: Option<u64>,
}

struct ChunkEntry<C> {
    chunk: C,
    address: u64,
    size: u64,
}

struct State<B: MemoryBackend> {
    backend: B,
    /// Chunks by id; `None` once freed.
    chunks: Vec<Option<ChunkEntry<B::Chunk>>>,
    /// Growth: cached chunk ids by size.
    cache: BTreeMap<u64, Vec<usize>>,
    /// Reservation: the chunk id of the reservation, and its free ranges (offset -> size).
    reservation: Option<usize>,
    free_ranges: BTreeMap<u64, u64>,
    /// The limit in force (for grab-all: the reservation once made).
    limit: Option<u64>,
    limit_source: LimitSource,
    stats: PoolStats,
}

struct Shared<B: MemoryBackend> {
    config: PoolConfig,
    state: Mutex<State<B>>,
}

/// The memory pool of one logical device. Cheap to clone (shared); thread-safe.
pub struct Pool<B: MemoryBackend> {
    shared: Arc<Shared<B>>,
}

impl<B: MemoryBackend> Clone for Pool<B> {
    fn clone(&self) -> Self {
        Pool { shared: self.shared.clone() }
    }
}

impl<B: MemoryBackend> std::fmt::Debug for Pool<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("device", &self.shared.config.device.to_string())
            .field("mode", &self.shared.config.mode)
            .field("stats", &self.stats())
            .finish()
    }
}

/// A block of a [`Pool`], returned to the pool when dropped.
pub struct Block<B: MemoryBackend> {
    shared: Arc<Shared<B>>,
    chunk: usize,
    offset: u64,
    size: u64,
    requested: u64,
    address: u64,
}

impl<B: MemoryBackend> std::fmt::Debug for Block<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block")
            .field("device", &self.shared.config.device.to_string())
            .field("address", &format_args!("{:#x}", self.address))
            .field("size", &self.size)
            .field("requested", &self.requested)
            .finish()
    }
}

impl<B: MemoryBackend> Block<B> {
    /// The device address of the block's first byte.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// The block's size: the request rounded up to [`GRANULE`], or a little more when a cached
    /// block was reused.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The bytes that were asked for.
    pub fn requested(&self) -> u64 {
        self.requested
    }

    /// The logical device.
    pub fn device(&self) -> &DeviceSpec {
        &self.shared.config.device
    }
}

impl<B: MemoryBackend> Drop for Block<B> {
    fn drop(&mut self) {
        self.shared.release(self.chunk, self.offset, self.size);
    }
}

impl<B: MemoryBackend> Pool<B> {
    /// A pool over `backend`; nothing is allocated until the first [`Pool::allocate`].
    pub fn new(config: PoolConfig, backend: B) -> Self {
        let state = State {
            backend,
            chunks: Vec::new(),
            cache: BTreeMap::new(),
            reservation: None,
            free_ranges: BTreeMap::new(),
            limit: config.limit,
            limit_source: config.limit_source.clone(),
            stats: PoolStats { limit: config.limit, ..PoolStats::default() },
        };
        Pool { shared: Arc::new(Shared { config, state: Mutex::new(state) }) }
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.shared.config
    }

    /// The logical device.
    pub fn device(&self) -> &DeviceSpec {
        &self.shared.config.device
    }

    /// What the pool holds and has done.
    pub fn stats(&self) -> PoolStats {
        self.shared.lock().stats
    }

    /// Runs `f` with the backend (under the pool's lock).
    pub fn with_backend<T>(&self, f: impl FnOnce(&mut B) -> T) -> T {
        f(&mut self.shared.lock().backend)
    }

    /// A block of at least `bytes` bytes, or an error: [`Error::MemoryLimit`] when it would take
    /// the device past its limit, [`Error::OutOfMemory`] when the backend (after the cache is
    /// released) or the reservation has no room.
    pub fn allocate(&self, bytes: u64) -> Result<Block<B>> {
        let shared = &self.shared;
        let config = &shared.config;
        let size = round_size(bytes).ok_or_else(|| Error::OutOfMemory {
            device: config.label(),
            requested: bytes,
            detail: "the size overflows".to_string(),
        })?;
        let mut state = shared.lock();
        if let Some(limit) = state.limit {
            let in_use = state.stats.in_use;
            if in_use.checked_add(size).is_none_or(|total| total > limit) {
                let mut fix = state.limit_source.fix();
                if size != bytes {
                    fix.push_str(&format!(" (the request takes {size} bytes: blocks are multiples of {GRANULE})"));
                }
                return Err(Error::MemoryLimit {
                    device: config.label(),
                    requested: bytes,
                    in_use,
                    limit,
                    limit_source: format!("{}, {}", state.limit_source.describe(), format_bytes(limit)),
                    fix,
                });
            }
        }
        let placed = match config.mode {
            PoolMode::Growth => state.take_growth(config, bytes, size),
            PoolMode::Reserve(reservation) => state.take_reserved(config, reservation, bytes, size),
        };
        let (chunk, offset, size) = placed?;
        if let Err(e) = config.tracker.allocate(&config.device, size) {
            // Another policy set on the tracker refused it: give the block back.
            state.put_back(config.mode, chunk, offset, size);
            return Err(e.into());
        }
        let address = state.chunks[chunk].as_ref().map_or(0, |c| c.address) + offset;
        let stats = &mut state.stats;
        stats.in_use += size;
        stats.peak = stats.peak.max(stats.in_use);
        stats.buffers += 1;
        drop(state);
        Ok(Block { shared: shared.clone(), chunk, offset, size, requested: bytes, address })
    }

    /// Returns cached blocks (growth mode) to the backend; in reservation mode, returns the
    /// reservation when nothing is in use (the next allocation reserves again). Returns the
    /// bytes given back.
    pub fn empty_cache(&self) -> Result<u64> {
        let mut state = self.shared.lock();
        let before = state.stats.held;
        match self.shared.config.mode {
            PoolMode::Growth => state.release_cache(u64::MAX)?,
            PoolMode::Reserve(_) => {
                if state.stats.in_use == 0 {
                    if let Some(id) = state.reservation.take() {
                        state.free_ranges.clear();
                        state.free_chunk(id)?;
                        state.stats.cached = 0;
                    }
                }
            }
        }
        Ok(before - state.stats.held)
    }
}

impl<B: MemoryBackend> Shared<B> {
    fn lock(&self) -> MutexGuard<'_, State<B>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn release(&self, chunk: usize, offset: u64, size: u64) {
        let mut state = self.lock();
        state.stats.in_use -= size;
        state.stats.buffers -= 1;
        self.config.tracker.free(&self.config.device, size);
        state.put_back(self.config.mode, chunk, offset, size);
    }
}

impl<B: MemoryBackend> Drop for Shared<B> {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for id in 0..state.chunks.len() {
            if state.chunks[id].is_some() {
                if let Err(e) = state.free_chunk(id) {
                    tracing::warn!("freeing device memory of {}: {e}", self.config.device);
                }
            }
        }
    }
}

impl<B: MemoryBackend> State<B> {
    /// Growth: a cached block in `[size, size + size/8]`, else a new one (releasing the cache
    /// when the limit or the backend needs it). Returns (chunk, offset, size).
    fn take_growth(&mut self, config: &PoolConfig, requested: u64, size: u64) -> Result<(usize, u64, u64)> {
        let max_size = size.saturating_add(size / 8);
        let fits = self.cache.range(size..=max_size).next().map(|(&s, _)| s);
        if let Some(cached_size) = fits {
            // Sizes above `size` only when the limit leaves room for the whole block.
            let room = self.limit.is_none_or(|l| self.stats.in_use + cached_size <= l);
            if room {
                let ids = self.cache.get_mut(&cached_size).expect("present");
                let id = ids.pop().expect("non-empty");
                if ids.is_empty() {
                    self.cache.remove(&cached_size);
                }
                self.stats.cached -= cached_size;
                self.stats.cache_hits += 1;
                return Ok((id, 0, cached_size));
            }
        }
        // A new block must keep what the pool holds within the limit.
        if let Some(limit) = self.limit {
            if self.stats.held + size > limit {
                self.release_cache(self.stats.held + size - limit)?;
            }
        }
        match self.new_chunk(size) {
            Ok(id) => Ok((id, 0, size)),
            Err(BackendError::Failed(e)) => Err(e),
            Err(BackendError::OutOfMemory) => {
                let released = self.stats.cached;
                self.release_cache(u64::MAX)?;
                match self.new_chunk(size) {
                    Ok(id) => Ok((id, 0, size)),
                    Err(BackendError::Failed(e)) => Err(e),
                    Err(BackendError::OutOfMemory) => {
                        let free = self.backend.free_bytes().ok().flatten();
                        Err(Error::OutOfMemory {
                            device: config.label(),
                            requested,
                            detail: format!(
                                "the device has no room for a block of {size} bytes{} ({} bytes of Strata's \
                                 buffers are in use on this logical device; {released} cached bytes were \
                                 released first); free buffers, allocate less, or leave more of the GPU to \
                                 Strata",
                                free.map_or(String::new(), |f| format!(", {f} bytes free on it")),
                                self.stats.in_use,
                            ),
                        })
                    }
                }
            }
        }
    }

    /// Reservation: reserves at the first call, then a best-fit free range.
    fn take_reserved(
        &mut self,
        config: &PoolConfig,
        reservation: Reservation,
        requested: u64,
        size: u64,
    ) -> Result<(usize, u64, u64)> {
        let id = match self.reservation {
            Some(id) => id,
            None => self.reserve(config, reservation, requested)?,
        };
        let total_free = self.stats.cached;
        let best = self
            .free_ranges
            .iter()
            .filter(|(_, &len)| len >= size)
            .min_by_key(|(&offset, &len)| (len, offset))
            .map(|(&offset, &len)| (offset, len));
        let Some((offset, len)) = best else {
            let largest = self.free_ranges.values().copied().max().unwrap_or(0);
            let reserved = self.chunks[id].as_ref().map_or(0, |c| c.size);
            return Err(Error::OutOfMemory {
                device: config.label(),
                requested,
                detail: format!(
                    "the {reserved} bytes reserved for it have {total_free} bytes free, but the largest free \
                     range is {largest} bytes (fragmentation); free buffers, allocate less, or use a \
                     larger limit"
                ),
            });
        };
        self.free_ranges.remove(&offset);
        if len > size {
            self.free_ranges.insert(offset + size, len - size);
        }
        self.stats.cached -= size;
        Ok((id, offset, size))
    }

    fn reserve(&mut self, config: &PoolConfig, reservation: Reservation, requested: u64) -> Result<usize> {
        let bytes = match reservation {
            Reservation::Bytes(bytes) => bytes,
            Reservation::FreeMemory => {
                let free = self.backend.free_bytes()?.or(self.limit).ok_or_else(|| Error::OutOfMemory {
                    device: config.label(),
                    requested,
                    detail: "grab-all needs the device's free memory, which is unknown; use limit:<size> or \
                             growth"
                        .to_string(),
                })?;
                let share = round_down(free / 100 * GRAB_ALL_PERCENT + free % 100 * GRAB_ALL_PERCENT / 100);
                let bytes = self.limit.map_or(share, |l| share.min(round_down(l)));
                // What was reserved is the limit from now on.
                self.limit = Some(bytes);
                self.stats.limit = Some(bytes);
                self.limit_source = LimitSource::Device;
                bytes
            }
        };
        if bytes == 0 {
            return Err(Error::OutOfMemory {
                device: config.label(),
                requested,
                detail: "the device has no free memory to reserve; use growth, or free memory on the GPU".to_string(),
            });
        }
        match self.new_chunk(bytes) {
            Ok(id) => {
                self.reservation = Some(id);
                self.free_ranges.insert(0, bytes);
                self.stats.cached += bytes;
                Ok(id)
            }
            Err(BackendError::Failed(e)) => Err(e),
            Err(BackendError::OutOfMemory) => {
                let free = self.backend.free_bytes().ok().flatten();
                Err(Error::OutOfMemory {
                    device: config.label(),
                    requested,
                    detail: format!(
                        "could not reserve {bytes} bytes up front{} (reservation for {}); use growth, a smaller \
                         limit, or free memory on the GPU",
                        free.map_or(String::new(), |f| format!(": the device has {f} bytes free")),
                        match config.mode {
                            PoolMode::Reserve(Reservation::FreeMemory) => "grab-all".to_string(),
                            _ => self.limit_source.describe(),
                        }
                    ),
                })
            }
        }
    }

    fn new_chunk(&mut self, size: u64) -> Result<usize, BackendError> {
        let chunk = self.backend.allocate(size)?;
        let address = self.backend.address(&chunk);
        self.stats.backend_allocations += 1;
        self.stats.held += size;
        let entry = Some(ChunkEntry { chunk, address, size });
        match self.chunks.iter().position(Option::is_none) {
            Some(id) => {
                self.chunks[id] = entry;
                Ok(id)
            }
            None => {
                self.chunks.push(entry);
                Ok(self.chunks.len() - 1)
            }
        }
    }

    fn free_chunk(&mut self, id: usize) -> Result<()> {
        if let Some(entry) = self.chunks[id].take() {
            self.stats.held -= entry.size;
            self.stats.backend_frees += 1;
            self.backend.free(entry.chunk)?;
        }
        Ok(())
    }

    /// Frees cached blocks, largest first, until at least `at_least` bytes are freed or the
    /// cache is empty.
    fn release_cache(&mut self, at_least: u64) -> Result<()> {
        let mut freed = 0u64;
        while freed < at_least {
            let Some((&size, _)) = self.cache.iter().next_back() else { break };
            let ids = self.cache.get_mut(&size).expect("present");
            let id = ids.pop().expect("non-empty");
            if ids.is_empty() {
                self.cache.remove(&size);
            }
            self.stats.cached -= size;
            self.free_chunk(id)?;
            freed += size;
        }
        Ok(())
    }

    /// Returns a block to the cache (growth) or the free ranges (reservation).
    fn put_back(&mut self, mode: PoolMode, chunk: usize, offset: u64, size: u64) {
        self.stats.cached += size;
        match mode {
            PoolMode::Growth => self.cache.entry(size).or_default().push(chunk),
            PoolMode::Reserve(_) => self.insert_free_range(offset, size),
        }
    }

    /// Returns `[offset, offset + size)` to the free ranges, merging with its neighbours.
    fn insert_free_range(&mut self, mut offset: u64, mut size: u64) {
        if let Some((&prev, &prev_len)) = self.free_ranges.range(..offset).next_back() {
            if prev + prev_len == offset {
                self.free_ranges.remove(&prev);
                offset = prev;
                size += prev_len;
            }
        }
        if let Some(&next_len) = self.free_ranges.get(&(offset + size)) {
            self.free_ranges.remove(&(offset + size));
            size += next_len;
        }
        self.free_ranges.insert(offset, size);
    }
}

/// The pools of several logical devices, one each, keyed by the logical device's spec.
pub struct DevicePools<B: MemoryBackend> {
    pools: Vec<Pool<B>>,
}

impl<B: MemoryBackend> std::fmt::Debug for DevicePools<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.pools.iter()).finish()
    }
}

impl<B: MemoryBackend> DevicePools<B> {
    /// One pool per GPU among `devices` (other devices are skipped), configured by
    /// [`PoolConfig::for_logical_device`] with `policy`, accounting to `tracker`, each over the
    /// backend `backend_for` makes for it (logical devices of one physical GPU get backends on
    /// that GPU). No backend memory is allocated yet.
    pub fn new(
        devices: &[LogicalDevice],
        policy: MemoryPolicy,
        tracker: &'static MemoryTracker,
        mut backend_for: impl FnMut(&LogicalDevice) -> Result<B>,
    ) -> Result<Self> {
        let mut pools = Vec::new();
        for device in devices.iter().filter(|d| matches!(d.kind, LogicalKind::Gpu { .. })) {
            let config = PoolConfig::for_logical_device(device, policy)?.with_tracker(tracker);
            pools.push(Pool::new(config, backend_for(device)?));
        }
        Ok(DevicePools { pools })
    }

    /// The pool of the logical device `device` (e.g. `/device:GPU:1`).
    pub fn pool(&self, device: &DeviceSpec) -> Result<&Pool<B>> {
        let pattern = device.device_part();
        self.pools.iter().find(|p| p.device().matches(&pattern) && pattern.device_index.is_some()).ok_or_else(|| {
            let names: Vec<String> = self.pools.iter().map(|p| p.device().to_string()).collect();
            Error::Core(strata_core::Error::UnknownDevice(format!(
                "{device}: no memory pool for it (the GPU pools are {}); name a logical GPU",
                if names.is_empty() { "none".to_string() } else { names.join(", ") }
            )))
        })
    }

    /// Every pool, in the order of the logical devices.
    pub fn pools(&self) -> &[Pool<B>] {
        &self.pools
    }
}

/// A backend that simulates a device of a given capacity: addresses are made up, no memory is
/// touched, and every allocation and free is counted. Clones share the device, so several
/// pools (logical devices) can share one simulated GPU. For tests of the policy.
#[derive(Clone, Debug)]
pub struct SimulatedBackend {
    device: Arc<Mutex<Simulated>>,
}

#[derive(Debug)]
struct Simulated {
    capacity: u64,
    stats: SimulatedStats,
    next_address: u64,
}

/// What a [`SimulatedBackend`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimulatedStats {
    /// Successful allocations.
    pub allocations: u64,
    /// Frees.
    pub frees: u64,
    /// Allocations refused for lack of room.
    pub out_of_memory: u64,
    /// Bytes allocated now.
    pub allocated: u64,
    /// Most bytes allocated at once.
    pub peak: u64,
}

/// A chunk of a [`SimulatedBackend`].
#[derive(Debug)]
pub struct SimulatedChunk {
    address: u64,
    size: u64,
}

impl SimulatedBackend {
    /// A device of `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        SimulatedBackend {
            device: Arc::new(Mutex::new(Simulated {
                capacity,
                stats: SimulatedStats::default(),
                next_address: 1 << 32,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Simulated> {
        self.device.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The counts so far.
    pub fn stats(&self) -> SimulatedStats {
        self.lock().stats
    }

    /// Takes `bytes` of the device for something else (another process): later allocations
    /// see less room.
    pub fn occupy(&self, bytes: u64) {
        let mut d = self.lock();
        d.capacity = d.capacity.saturating_sub(bytes);
    }
}

impl MemoryBackend for SimulatedBackend {
    type Chunk = SimulatedChunk;

    fn allocate(&mut self, bytes: u64) -> Result<SimulatedChunk, BackendError> {
        let mut d = self.lock();
        if d.stats.allocated + bytes > d.capacity {
            d.stats.out_of_memory += 1;
            return Err(BackendError::OutOfMemory);
        }
        d.stats.allocations += 1;
        d.stats.allocated += bytes;
        d.stats.peak = d.stats.peak.max(d.stats.allocated);
        let address = d.next_address;
        // Leave a gap so that chunks are never adjacent.
        d.next_address += bytes + GRANULE;
        Ok(SimulatedChunk { address, size: bytes })
    }

    fn free(&mut self, chunk: SimulatedChunk) -> Result<()> {
        let mut d = self.lock();
        d.stats.frees += 1;
        d.stats.allocated -= chunk.size;
        Ok(())
    }

    fn address(&self, chunk: &SimulatedChunk) -> u64 {
        chunk.address
    }

    fn free_bytes(&mut self) -> Result<Option<u64>> {
        let d = self.lock();
        Ok(Some(d.capacity - d.stats.allocated))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding() {
        assert_eq!(round_size(0), Some(GRANULE));
        assert_eq!(round_size(1), Some(GRANULE));
        assert_eq!(round_size(GRANULE), Some(GRANULE));
        assert_eq!(round_size(GRANULE + 1), Some(2 * GRANULE));
        assert_eq!(round_size(u64::MAX), None);
    }

    #[test]
    fn free_ranges_coalesce() {
        let tracker: &'static MemoryTracker = Box::leak(Box::new(MemoryTracker::new()));
        let config = PoolConfig::resolve(DeviceSpec::gpu(0), "GPU 0", MemoryPolicy::Limit(8 * GRANULE), None, None)
            .unwrap()
            .with_tracker(tracker);
        let pool = Pool::new(config, SimulatedBackend::new(1 << 20));
        let blocks: Vec<_> = (0..8).map(|_| pool.allocate(GRANULE).unwrap()).collect();
        let base = blocks[0].address();
        for (i, b) in blocks.iter().enumerate() {
            assert_eq!(b.address(), base + i as u64 * GRANULE);
        }
        let mut blocks: Vec<Option<_>> = blocks.into_iter().map(Some).collect();
        // Free 1, 3, 2: one range [1, 4).
        for i in [1, 3, 2] {
            blocks[i] = None;
        }
        let state = pool.shared.lock();
        assert_eq!(state.free_ranges.iter().map(|(&o, &l)| (o, l)).collect::<Vec<_>>(), vec![(GRANULE, 3 * GRANULE)]);
        drop(state);
        let big = pool.allocate(3 * GRANULE).unwrap();
        assert_eq!(big.address(), base + GRANULE);
    }
}

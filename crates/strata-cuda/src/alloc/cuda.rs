//! The CUDA backend of the caching allocator, and typed device buffers carved from it.
//!
//! A [`GpuPool`] (a [`Pool`] over a [`CudaBackend`]) belongs to one logical GPU; all pools of
//! one physical GPU use that GPU's shared context ([`crate::device::context`]), created at the
//! pool's first allocation, and its default stream (the pool's *home stream*).
//!
//! Reuse is stream-ordered on the home stream, as in cudarc's own allocations and PyTorch's
//! caching allocator: dropping a [`GpuBuffer`] makes the home stream wait for the buffer's
//! recorded uses on other streams (cudarc's event tracking), then returns the block to the
//! pool, where the next buffer handed out may reuse it at once. Work enqueued on the home
//! stream is therefore ordered after every earlier use. Work on another stream must be ordered
//! after the home stream before it touches a fresh buffer (`stream.join(&pool.stream()?)`).
//! Blocks go back to the driver (`cuMemFree`) only after the home stream is synchronized.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{result, CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use strata_core::device::{DeviceRegistry, DeviceSpec, DeviceType, LogicalDevice, MemoryPolicy, MemoryTracker};

use super::{BackendError, Block, DevicePools, MemoryBackend, Pool};
use crate::{Error, Result};

/// Device memory of one GPU through the CUDA driver (`cuMemAlloc` / `cuMemFree`), with the
/// context and home stream created at the first use.
#[derive(Debug)]
pub struct CudaBackend {
    ordinal: u32,
    ready: Option<(Arc<CudaContext>, Arc<CudaStream>)>,
}

/// A `cuMemAlloc` allocation.
#[derive(Debug)]
pub struct CudaChunk {
    ptr: CUdeviceptr,
}

impl CudaBackend {
    /// The backend of GPU `ordinal` (the CUDA ordinal in this process); creates nothing yet.
    pub fn new(ordinal: u32) -> Self {
        CudaBackend { ordinal, ready: None }
    }

    /// The CUDA ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The context and home stream, created at the first call.
    pub fn context_and_stream(&mut self) -> Result<(Arc<CudaContext>, Arc<CudaStream>)> {
        if let Some(ready) = &self.ready {
            return Ok(ready.clone());
        }
        let ctx = crate::device::context(self.ordinal)?;
        let stream = ctx.default_stream();
        self.ready = Some((ctx.clone(), stream.clone()));
        Ok((ctx, stream))
    }
}

impl MemoryBackend for CudaBackend {
    type Chunk = CudaChunk;

    fn allocate(&mut self, bytes: u64) -> Result<CudaChunk, BackendError> {
        let (ctx, _) = self.context_and_stream().map_err(BackendError::Failed)?;
        ctx.bind_to_thread().map_err(|e| BackendError::Failed(Error::driver("cuCtxSetCurrent")(e)))?;
        let bytes = usize::try_from(bytes).map_err(|_| BackendError::OutOfMemory)?;
        // SAFETY: the context is current on this thread; cuMemAlloc returns a fresh allocation
        // of `bytes` bytes, owned by the returned chunk until `free`.
        match unsafe { result::malloc_sync(bytes) } {
            Ok(ptr) => Ok(CudaChunk { ptr }),
            Err(e) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(BackendError::OutOfMemory),
            Err(e) => Err(BackendError::Failed(Error::driver("cuMemAlloc")(e))),
        }
    }

    fn free(&mut self, chunk: CudaChunk) -> Result<()> {
        let (ctx, stream) = self.context_and_stream()?;
        // Work still queued on the home stream may use the memory.
        stream.synchronize().map_err(Error::driver("cuStreamSynchronize"))?;
        ctx.bind_to_thread().map_err(Error::driver("cuCtxSetCurrent"))?;
        // SAFETY: `chunk.ptr` came from cuMemAlloc in this context and is freed once (the pool
        // frees each chunk once, after every buffer carved from it was dropped and the home
        // stream, on which their frees were ordered, has drained).
        unsafe { result::free_sync(chunk.ptr) }.map_err(Error::driver("cuMemFree"))
    }

    fn address(&self, chunk: &CudaChunk) -> u64 {
        chunk.ptr
    }

    fn free_bytes(&mut self) -> Result<Option<u64>> {
        let (ctx, _) = self.context_and_stream()?;
        let (free, _) = ctx.mem_get_info().map_err(Error::driver("cuMemGetInfo"))?;
        Ok(Some(free as u64))
    }
}

/// The memory pool of one logical GPU.
pub type GpuPool = Pool<CudaBackend>;

impl Pool<CudaBackend> {
    /// The CUDA ordinal of the pool's physical GPU.
    pub fn ordinal(&self) -> u32 {
        self.with_backend(|b| b.ordinal())
    }

    /// The GPU's shared context (created at the first call).
    pub fn context(&self) -> Result<Arc<CudaContext>> {
        self.with_backend(|b| b.context_and_stream().map(|(ctx, _)| ctx))
    }

    /// The home stream of the pool's buffers (the context's default stream).
    pub fn stream(&self) -> Result<Arc<CudaStream>> {
        self.with_backend(|b| b.context_and_stream().map(|(_, stream)| stream))
    }

    /// A buffer of `len` elements of `T` whose contents are whatever the memory held.
    ///
    /// # Safety
    ///
    /// As cudarc's `CudaStream::alloc`: the memory is not initialized; write it before reading
    /// it as `T`.
    pub unsafe fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<GpuBuffer<T>> {
        let bytes = len.checked_mul(std::mem::size_of::<T>()).and_then(|b| u64::try_from(b).ok()).ok_or_else(|| {
            Error::OutOfMemory {
                device: self.device().to_string(),
                requested: u64::MAX,
                detail: format!("{len} elements of {} bytes overflow", std::mem::size_of::<T>()),
            }
        })?;
        let stream = self.stream()?;
        let block = self.allocate(bytes)?;
        // SAFETY: the block is a live device allocation of at least `bytes` bytes in the
        // stream's context, aligned to 512 bytes, and owned by the buffer: the slice is leaked
        // (never freed by cudarc) before the block returns to the pool.
        let slice = unsafe { stream.upgrade_device_ptr::<T>(block.address(), len) };
        Ok(GpuBuffer { slice: Some(slice), block })
    }

    /// A buffer of `len` zeros.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<GpuBuffer<T>> {
        // SAFETY: zeroed below before it is returned.
        let mut buffer = unsafe { self.alloc::<T>(len) }?;
        let stream = self.stream()?;
        stream.memset_zeros(buffer.slice_mut()).map_err(Error::driver("cuMemsetD8Async"))?;
        Ok(buffer)
    }

    /// A buffer holding a copy of `src` (copied on the home stream).
    pub fn clone_htod<T: DeviceRepr>(&self, src: &[T]) -> Result<GpuBuffer<T>> {
        // SAFETY: every element is written by the copy below.
        let mut buffer = unsafe { self.alloc::<T>(src.len()) }?;
        let stream = self.stream()?;
        stream.memcpy_htod(src, buffer.slice_mut()).map_err(Error::driver("cuMemcpyHtoDAsync"))?;
        Ok(buffer)
    }
}

/// A typed device buffer from a [`GpuPool`]: derefs to cudarc's [`CudaSlice`] (for kernel
/// launches, copies and NCCL), and returns its memory to the pool when dropped.
pub struct GpuBuffer<T> {
    /// `Some` until dropped.
    slice: Option<CudaSlice<T>>,
    block: Block<CudaBackend>,
}

impl<T> std::fmt::Debug for GpuBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuBuffer").field("len", &self.len()).field("block", &self.block).finish()
    }
}

impl<T> GpuBuffer<T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.slice().len()
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The logical device it lives on.
    pub fn device(&self) -> &DeviceSpec {
        self.block.device()
    }

    /// The bytes it takes from its pool (its size rounded up to the pool's granule).
    pub fn block_size(&self) -> u64 {
        self.block.size()
    }

    /// The cudarc slice.
    pub fn slice(&self) -> &CudaSlice<T> {
        self.slice.as_ref().expect("present until dropped")
    }

    /// The cudarc slice, mutably.
    pub fn slice_mut(&mut self) -> &mut CudaSlice<T> {
        self.slice.as_mut().expect("present until dropped")
    }
}

impl<T> Deref for GpuBuffer<T> {
    type Target = CudaSlice<T>;

    fn deref(&self) -> &CudaSlice<T> {
        self.slice()
    }
}

impl<T> DerefMut for GpuBuffer<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        self.slice_mut()
    }
}

impl<T> Drop for GpuBuffer<T> {
    fn drop(&mut self) {
        if let Some(slice) = self.slice.take() {
            // Orders the home stream after the slice's uses on other streams, and gives up
            // the pointer without freeing it; `block` then returns the memory to the pool.
            let _ = slice.leak();
        }
    }
}

/// One [`GpuPool`] per logical GPU.
#[derive(Debug)]
pub struct GpuAllocators {
    pools: DevicePools<CudaBackend>,
}

impl GpuAllocators {
    /// Pools for the GPUs among `devices` under `policy` (see
    /// [`PoolConfig::resolve`](super::PoolConfig::resolve)), accounting to the global
    /// [`MemoryTracker`]. Creates no context.
    pub fn new(devices: &[LogicalDevice], policy: MemoryPolicy) -> Result<Self> {
        Self::with_tracker(devices, policy, MemoryTracker::global())
    }

    /// [`GpuAllocators::new`] accounting to `tracker`.
    pub fn with_tracker(
        devices: &[LogicalDevice],
        policy: MemoryPolicy,
        tracker: &'static MemoryTracker,
    ) -> Result<Self> {
        let pools = DevicePools::new(devices, policy, tracker, |d| Ok(CudaBackend::new(d.physical.index)))?;
        Ok(GpuAllocators { pools })
    }

    /// Pools for the logical GPUs of `registry` (initializing its devices).
    pub fn from_registry(registry: &DeviceRegistry, policy: MemoryPolicy) -> Result<Self> {
        let devices = registry.list_logical_devices(Some(DeviceType::Gpu))?;
        Self::new(&devices, policy)
    }

    /// The pool of logical GPU `device` (`/device:GPU:1`).
    pub fn pool(&self, device: &DeviceSpec) -> Result<&GpuPool> {
        self.pools.pool(device)
    }

    /// Every pool, in logical order.
    pub fn pools(&self) -> &[GpuPool] {
        self.pools.pools()
    }
}

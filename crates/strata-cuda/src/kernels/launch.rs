//! Checked launches of the kernels on a device.
//!
//! [`Kernels::get`] compiles every source for the context's compute capability (NVRTC, cached
//! per architecture by [`nvrtc::ptx`]) and loads it into the context once (cached per context).
//! Its methods validate their arguments with [`validate`] (the checks the CPU references make,
//! plus: buffers and stream on this context, non-null raw pointers), return
//! [`Error::InvalidLaunch`] with the reason, do nothing for empty buffers, cap the grid, choose
//! the `float4` kernel when every pointer is 16-byte aligned, and launch asynchronously on the
//! given stream.
//!
//! Two kinds of method:
//! - safe ones on cudarc buffers of this context ([`CudaSlice`], [`CudaView`](cudarc::driver::CudaView),
//!   [`CudaViewMut`](cudarc::driver::CudaViewMut)), which take part in cudarc's stream
//!   synchronisation like any cudarc launch;
//! - `unsafe` `*_raw` ones on device addresses ([`RawBuf`]), for buffers of other devices reached
//!   through peer access (reduction to one device, the all-reduce chunk step), where the caller
//!   orders the work across devices.
//!
//! The results equal [`reference`](super::reference) bit for bit (NaN payloads of arithmetic
//! results aside, see [`kernels`](super)).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use strata_core::ReduceOp;

use super::{nvrtc, op_code, validate, AdamWScalars, SOURCES};
use crate::{Error, Result};

/// A device buffer of `len` elements at device address `ptr`, for the `*_raw` launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawBuf {
    /// The device address (a `CUdeviceptr`; with unified addressing, valid on every device that
    /// has peer access to the owning one).
    pub ptr: u64,
    /// The number of elements.
    pub len: usize,
}

/// Strata's kernels loaded into one CUDA context.
#[derive(Debug)]
pub struct Kernels {
    ctx: Arc<CudaContext>,
    arch: String,
    functions: HashMap<&'static str, CudaFunction>,
}

type Loaded = Mutex<HashMap<usize, Arc<Kernels>>>;

fn invalid(kernel: &'static str, detail: impl Into<String>) -> Error {
    Error::InvalidLaunch { kernel, detail: detail.into() }
}

fn config((grid, block): (u32, u32)) -> LaunchConfig {
    LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

impl Kernels {
    /// The kernels of `ctx`: at the first call for a context, every source is compiled for its
    /// compute capability (once per capability in the process) and loaded; later calls return
    /// the same loaded kernels. Errors: NVRTC missing or failing, the driver refusing the PTX
    /// (e.g. `CUDA_ERROR_UNSUPPORTED_PTX_VERSION` when NVRTC is newer than the driver).
    pub fn get(ctx: &Arc<CudaContext>) -> Result<Arc<Kernels>> {
        static LOADED: OnceLock<Loaded> = OnceLock::new();
        let loaded = LOADED.get_or_init(Default::default);
        // the cached Kernels holds its context, so a key (the CUcontext address) is never reused
        let key = ctx.cu_ctx() as usize;
        let mut loaded = loaded.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(k) = loaded.get(&key) {
            return Ok(k.clone());
        }
        let cc = ctx.compute_capability().map_err(Error::driver("cuDeviceGetAttribute"))?;
        let arch = nvrtc::arch_of(cc);
        let mut functions = HashMap::new();
        for source in SOURCES {
            let ptx = nvrtc::ptx(source, &arch)?;
            let module = ctx.load_module(Ptx::from_src(ptx.to_string())).map_err(Error::driver("cuModuleLoadData"))?;
            for &name in source.functions {
                let f = module.load_function(name).map_err(Error::driver("cuModuleGetFunction"))?;
                functions.insert(name, f);
            }
        }
        tracing::debug!(ordinal = ctx.ordinal(), arch, "strata kernels loaded");
        let k = Arc::new(Kernels { ctx: ctx.clone(), arch, functions });
        loaded.insert(key, k.clone());
        Ok(k)
    }

    /// The context the kernels are loaded into.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The virtual architecture they were compiled for, e.g. `"compute_90"`.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    fn function(&self, name: &'static str) -> &CudaFunction {
        self.functions.get(name).expect("every function of SOURCES is loaded")
    }

    fn check_stream(&self, kernel: &'static str, stream: &CudaStream) -> Result<()> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(invalid(
                kernel,
                format!(
                    "the stream belongs to device {}, the kernels to device {}",
                    stream.context().ordinal(),
                    self.ctx.ordinal()
                ),
            ));
        }
        Ok(())
    }

    fn check_buffer(&self, kernel: &'static str, what: &str, stream: &CudaStream) -> Result<()> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(invalid(
                kernel,
                format!(
                    "{what} lives on device {}, the launch is on device {}; buffers of other devices go through the *_raw launches with peer access",
                    stream.context().ordinal(),
                    self.ctx.ordinal()
                ),
            ));
        }
        Ok(())
    }

    fn check_raw(kernel: &'static str, what: &str, bufs: &[RawBuf]) -> Result<()> {
        if let Some((i, _)) = bufs.iter().enumerate().find(|(_, b)| b.ptr == 0 && b.len > 0) {
            return Err(invalid(kernel, format!("{what} {i} is a null pointer")));
        }
        Ok(())
    }

    /// Uploads the pointer table of a reduction and launches `kernel` (or its `_v4` variant).
    ///
    /// # Safety
    /// Every pointer is valid for the elements the launch touches, on this device, until the
    /// launch completes on `stream`, with no conflicting access meanwhile.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_table(
        &self,
        stream: &Arc<CudaStream>,
        kernel: &'static str,
        kernel_v4: &'static str,
        ptrs: &[u64],
        vectorized: bool,
        n: u32,
        off: Option<u64>,
        len: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let items = if vectorized { validate::vector_items(len) } else { len as u64 };
        let Some(dims) = validate::grid(kernel, items)? else { return Ok(()) };
        let table: CudaSlice<u64> = stream.clone_htod(ptrs).map_err(Error::driver("cuMemcpyHtoDAsync"))?;
        let f = self.function(if vectorized { kernel_v4 } else { kernel });
        let (len, code) = (len as u64, op_code(op));
        // strata_allreduce_chunk_f32(bufs, n, off, len, op), or strata_reduce_f32(srcs, n, dst,
        // len, op) where dst is the last entry of the table
        let third = off.unwrap_or(ptrs[ptrs.len() - 1]);
        let mut b = stream.launch_builder(f);
        b.arg(&table).arg(&n).arg(&third);
        b.arg(&len).arg(&code);
        // SAFETY: the argument list matches the kernel's signature (pointer table, u32, u64 or
        // pointer, u64, i32); the pointers are valid per this function's contract, the table
        // is a live device allocation read by the kernel on this stream (cudarc records the read
        // and frees it stream-ordered), and the grid covers `items` with grid-stride loops.
        unsafe { b.launch(config(dims)) }.map_err(Error::driver("cuLaunchKernel"))?;
        Ok(())
    }

    /// `dst = op(srcs...)` element-wise over buffers of this context (see
    /// [`reference::reduce`](super::reference::reduce)).
    pub fn reduce<S: DevicePtr<f32>, D: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        op: ReduceOp,
        srcs: &[&S],
        dst: &mut D,
    ) -> Result<()> {
        const K: &str = "strata_reduce_f32";
        self.check_stream(K, stream)?;
        for (r, s) in srcs.iter().enumerate() {
            self.check_buffer(K, &format!("source {r}"), s.stream())?;
        }
        self.check_buffer(K, "the destination", dst.stream())?;
        let lens: Vec<usize> = srcs.iter().map(|s| s.len()).collect();
        validate::reduce(K, &lens, dst.len())?;
        let len = dst.len();
        let mut guards = Vec::with_capacity(srcs.len() + 1);
        let mut bufs = Vec::with_capacity(srcs.len());
        for s in srcs {
            let (ptr, g) = s.device_ptr(stream);
            bufs.push(RawBuf { ptr, len });
            guards.push(g);
        }
        let (ptr, g) = dst.device_ptr_mut(stream);
        guards.push(g);
        // SAFETY: the pointers come from live cudarc buffers of this context, of the lengths
        // checked above, borrowed until the guards record the launch on `stream` (cudarc's
        // synchronisation orders other streams' accesses).
        let r = unsafe { self.reduce_raw(stream, op, &bufs, RawBuf { ptr, len }) };
        drop(guards);
        r
    }

    /// `dst = op(srcs...)` element-wise over device addresses (sources typically on peer devices):
    /// the reduction-to-one-device step. Checks as [`reduce`](Self::reduce), plus non-null
    /// pointers; `dst` may be one of the sources.
    ///
    /// # Safety
    /// Every buffer is valid for `len` f32 and readable (dst: writable) from this context's
    /// device (peer access enabled where it lives elsewhere) until the launch completes on
    /// `stream`, and nothing else writes them meanwhile (the caller orders the other devices'
    /// work, e.g. with events).
    pub unsafe fn reduce_raw(
        &self,
        stream: &Arc<CudaStream>,
        op: ReduceOp,
        srcs: &[RawBuf],
        dst: RawBuf,
    ) -> Result<()> {
        const K: &str = "strata_reduce_f32";
        self.check_stream(K, stream)?;
        let lens: Vec<usize> = srcs.iter().map(|s| s.len).collect();
        let n = validate::reduce(K, &lens, dst.len)?;
        Self::check_raw(K, "source", srcs)?;
        Self::check_raw(K, "destination", &[dst])?;
        let mut ptrs: Vec<u64> = srcs.iter().map(|s| s.ptr).collect();
        let vectorized = validate::vector_aligned(ptrs.iter().copied().chain([dst.ptr]));
        ptrs.push(dst.ptr);
        // SAFETY: the caller's contract; the table holds the sources then the destination, and
        // the kernel reads only its first n entries as sources
        unsafe { self.launch_table(stream, K, "strata_reduce_f32_v4", &ptrs, vectorized, n, None, dst.len, op) }
    }

    /// The chunked all-reduce step run by this device: reduces elements `[off, off + len)` of
    /// every buffer (in buffer order) and writes the result into every buffer there (see
    /// [`reference::allreduce_chunk`](super::reference::allreduce_chunk)). Each device runs it
    /// for its own disjoint chunk; when all have finished, every buffer holds the result.
    ///
    /// # Safety
    /// Every buffer is valid for its `len` f32, readable and writable from this context's device
    /// (peer access enabled), until the launch completes on `stream`; no other work touches the
    /// chunk meanwhile, and chunks run concurrently by other devices do not overlap it.
    pub unsafe fn allreduce_chunk_raw(
        &self,
        stream: &Arc<CudaStream>,
        op: ReduceOp,
        bufs: &[RawBuf],
        off: usize,
        len: usize,
    ) -> Result<()> {
        const K: &str = "strata_allreduce_chunk_f32";
        self.check_stream(K, stream)?;
        let lens: Vec<usize> = bufs.iter().map(|b| b.len).collect();
        let n = validate::allreduce_chunk(K, &lens, off, len)?;
        Self::check_raw(K, "buffer", bufs)?;
        let ptrs: Vec<u64> = bufs.iter().map(|b| b.ptr).collect();
        let vectorized = validate::chunk_vector_aligned(ptrs.iter().copied(), off);
        // SAFETY: the caller's contract; the chunk lies inside every buffer (validated)
        unsafe {
            self.launch_table(
                stream,
                K,
                "strata_allreduce_chunk_f32_v4",
                &ptrs,
                vectorized,
                n,
                Some(off as u64),
                len,
                op,
            )
        }
    }

    /// # Safety
    /// `dst` and `src` are valid for `len` f32 on this device until the launch completes.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_axpy(
        &self,
        stream: &Arc<CudaStream>,
        kernel: &'static str,
        kernel_v4: &'static str,
        alpha: f32,
        dst: u64,
        src: u64,
        len: usize,
    ) -> Result<()> {
        let vectorized = validate::vector_aligned([dst, src]);
        let items = if vectorized { validate::vector_items(len) } else { len as u64 };
        let Some(dims) = validate::grid(kernel, items)? else { return Ok(()) };
        let f = self.function(if vectorized { kernel_v4 } else { kernel });
        let len = len as u64;
        let mut b = stream.launch_builder(f);
        b.arg(&dst).arg(&src).arg(&alpha).arg(&len);
        // SAFETY: (float*, const float*, float, u64) is the kernels' signature; the pointers are
        // valid for len elements per this function's contract.
        unsafe { b.launch(config(dims)) }.map_err(Error::driver("cuLaunchKernel"))?;
        Ok(())
    }

    /// `dst[i] += alpha * src[i]` (see [`reference::axpy`](super::reference::axpy)).
    pub fn axpy<S: DevicePtr<f32>, D: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        alpha: f32,
        src: &S,
        dst: &mut D,
    ) -> Result<()> {
        const K: &str = "strata_axpy_f32";
        self.check_stream(K, stream)?;
        self.check_buffer(K, "src", src.stream())?;
        self.check_buffer(K, "dst", dst.stream())?;
        let len = validate::same_len(K, &[("dst", dst.len()), ("src", src.len())])?;
        let (s, _gs) = src.device_ptr(stream);
        let (d, _gd) = dst.device_ptr_mut(stream);
        // SAFETY: live cudarc buffers of this context of `len` elements, borrowed until the
        // guards record the launch
        unsafe { self.launch_axpy(stream, K, "strata_axpy_f32_v4", alpha, d, s, len) }
    }

    /// `dst[i] += alpha * src[i]` on device addresses (`src` typically on a peer device).
    ///
    /// # Safety
    /// As [`reduce_raw`](Self::reduce_raw): both valid for their lengths from this device until
    /// the launch completes on `stream`, no conflicting access meanwhile.
    pub unsafe fn axpy_raw(&self, stream: &Arc<CudaStream>, alpha: f32, src: RawBuf, dst: RawBuf) -> Result<()> {
        const K: &str = "strata_axpy_f32";
        self.check_stream(K, stream)?;
        let len = validate::same_len(K, &[("dst", dst.len), ("src", src.len)])?;
        Self::check_raw(K, "buffer", &[dst, src])?;
        // SAFETY: the caller's contract
        unsafe { self.launch_axpy(stream, K, "strata_axpy_f32_v4", alpha, dst.ptr, src.ptr, len) }
    }

    /// `dst[i] = alpha * src[i]` (see [`reference::scale`](super::reference::scale)).
    pub fn scale<S: DevicePtr<f32>, D: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        alpha: f32,
        src: &S,
        dst: &mut D,
    ) -> Result<()> {
        const K: &str = "strata_scale_f32";
        self.check_stream(K, stream)?;
        self.check_buffer(K, "src", src.stream())?;
        self.check_buffer(K, "dst", dst.stream())?;
        let len = validate::same_len(K, &[("dst", dst.len()), ("src", src.len())])?;
        let (s, _gs) = src.device_ptr(stream);
        let (d, _gd) = dst.device_ptr_mut(stream);
        // SAFETY: as in `axpy`
        unsafe { self.launch_axpy(stream, K, "strata_scale_f32_v4", alpha, d, s, len) }
    }

    /// `dst *= alpha` in place.
    pub fn scale_in_place<D: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        alpha: f32,
        dst: &mut D,
    ) -> Result<()> {
        const K: &str = "strata_scale_f32";
        self.check_stream(K, stream)?;
        self.check_buffer(K, "dst", dst.stream())?;
        let len = dst.len();
        let (d, _gd) = dst.device_ptr_mut(stream);
        // SAFETY: one live buffer of this context, read and written element by element by the
        // same thread
        unsafe { self.launch_axpy(stream, K, "strata_scale_f32_v4", alpha, d, d, len) }
    }

    /// # Safety
    /// `src` and `dst` valid for `len` elements of their types until the launch completes.
    unsafe fn launch_cast(
        &self,
        stream: &Arc<CudaStream>,
        kernel: &'static str,
        src: u64,
        dst: u64,
        len: usize,
    ) -> Result<()> {
        let Some(dims) = validate::grid(kernel, len as u64)? else { return Ok(()) };
        let len = len as u64;
        let mut b = stream.launch_builder(self.function(kernel));
        b.arg(&src).arg(&dst).arg(&len);
        // SAFETY: (const T*, U*, u64) is the cast kernels' signature; valid pointers per the
        // contract
        unsafe { b.launch(config(dims)) }.map_err(Error::driver("cuLaunchKernel"))?;
        Ok(())
    }

    fn cast<A, B, S: DevicePtr<A>, D: DevicePtrMut<B>>(
        &self,
        kernel: &'static str,
        stream: &Arc<CudaStream>,
        src: &S,
        dst: &mut D,
    ) -> Result<()> {
        self.check_stream(kernel, stream)?;
        self.check_buffer(kernel, "src", src.stream())?;
        self.check_buffer(kernel, "dst", dst.stream())?;
        let len = validate::same_len(kernel, &[("dst", dst.len()), ("src", src.len())])?;
        let (s, _gs) = src.device_ptr(stream);
        let (d, _gd) = dst.device_ptr_mut(stream);
        // SAFETY: live cudarc buffers of this context with `len` elements of the kernel's types
        unsafe { self.launch_cast(stream, kernel, s, d, len) }
    }

    /// f32 to bf16 bits (see [`reference::f32_to_bf16`](super::reference::f32_to_bf16)).
    pub fn f32_to_bf16<S: DevicePtr<f32>, D: DevicePtrMut<u16>>(
        &self,
        stream: &Arc<CudaStream>,
        src: &S,
        dst: &mut D,
    ) -> Result<()> {
        self.cast("strata_f32_to_bf16", stream, src, dst)
    }

    /// f32 to f16 bits (see [`reference::f32_to_f16`](super::reference::f32_to_f16)).
    pub fn f32_to_f16<S: DevicePtr<f32>, D: DevicePtrMut<u16>>(
        &self,
        stream: &Arc<CudaStream>,
        src: &S,
        dst: &mut D,
    ) -> Result<()> {
        self.cast("strata_f32_to_f16", stream, src, dst)
    }

    /// bf16 bits to f32 (see [`reference::bf16_to_f32`](super::reference::bf16_to_f32)).
    pub fn bf16_to_f32<S: DevicePtr<u16>, D: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        src: &S,
        dst: &mut D,
    ) -> Result<()> {
        self.cast("strata_bf16_to_f32", stream, src, dst)
    }

    /// f16 bits to f32 (see [`reference::f16_to_f32`](super::reference::f16_to_f32)).
    pub fn f16_to_f32<S: DevicePtr<u16>, D: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        src: &S,
        dst: &mut D,
    ) -> Result<()> {
        self.cast("strata_f16_to_f32", stream, src, dst)
    }

    /// Plain SGD on one variable (see [`reference::sgd`](super::reference::sgd)).
    pub fn sgd<P: DevicePtrMut<f32>, G: DevicePtr<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        lr: f32,
        param: &mut P,
        grad: &G,
    ) -> Result<()> {
        const K: &str = "strata_sgd_f32";
        self.check_stream(K, stream)?;
        self.check_buffer(K, "param", param.stream())?;
        self.check_buffer(K, "grad", grad.stream())?;
        let len = validate::same_len(K, &[("param", param.len()), ("grad", grad.len())])?;
        let Some(dims) = validate::grid(K, len as u64)? else { return Ok(()) };
        let (p, _gp) = param.device_ptr_mut(stream);
        let (g, _gg) = grad.device_ptr(stream);
        let len = len as u64;
        let mut b = stream.launch_builder(self.function(K));
        b.arg(&p).arg(&g).arg(&lr).arg(&len);
        // SAFETY: (float*, const float*, float, u64) is the kernel's signature; live buffers of
        // this context of `len` elements, borrowed until the guards record the launch
        unsafe { b.launch(config(dims)) }.map_err(Error::driver("cuLaunchKernel"))?;
        Ok(())
    }

    /// SGD with momentum on one variable (see [`reference::sgd_momentum`](super::reference::sgd_momentum)).
    pub fn sgd_momentum<P: DevicePtrMut<f32>, G: DevicePtr<f32>, V: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        lr: f32,
        momentum: f32,
        param: &mut P,
        grad: &G,
        velocity: &mut V,
    ) -> Result<()> {
        const K: &str = "strata_sgd_momentum_f32";
        self.check_stream(K, stream)?;
        self.check_buffer(K, "param", param.stream())?;
        self.check_buffer(K, "grad", grad.stream())?;
        self.check_buffer(K, "velocity", velocity.stream())?;
        let len = validate::same_len(K, &[("param", param.len()), ("grad", grad.len()), ("velocity", velocity.len())])?;
        let Some(dims) = validate::grid(K, len as u64)? else { return Ok(()) };
        let (p, _gp) = param.device_ptr_mut(stream);
        let (g, _gg) = grad.device_ptr(stream);
        let (v, _gv) = velocity.device_ptr_mut(stream);
        let len = len as u64;
        let mut b = stream.launch_builder(self.function(K));
        b.arg(&p).arg(&g).arg(&v).arg(&lr).arg(&momentum).arg(&len);
        // SAFETY: (float*, const float*, float*, float, float, u64) is the kernel's signature;
        // live, distinct buffers of this context of `len` elements
        unsafe { b.launch(config(dims)) }.map_err(Error::driver("cuLaunchKernel"))?;
        Ok(())
    }

    /// One AdamW step on one variable (see [`reference::adamw`](super::reference::adamw));
    /// `s` from [`AdamWScalars::new`].
    pub fn adamw<P: DevicePtrMut<f32>, G: DevicePtr<f32>, M: DevicePtrMut<f32>, V: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        s: &AdamWScalars,
        param: &mut P,
        grad: &G,
        m: &mut M,
        v: &mut V,
    ) -> Result<()> {
        const K: &str = "strata_adamw_f32";
        self.check_stream(K, stream)?;
        self.check_buffer(K, "param", param.stream())?;
        self.check_buffer(K, "grad", grad.stream())?;
        self.check_buffer(K, "m", m.stream())?;
        self.check_buffer(K, "v", v.stream())?;
        let len =
            validate::same_len(K, &[("param", param.len()), ("grad", grad.len()), ("m", m.len()), ("v", v.len())])?;
        let Some(dims) = validate::grid(K, len as u64)? else { return Ok(()) };
        let (p, _gp) = param.device_ptr_mut(stream);
        let (g, _gg) = grad.device_ptr(stream);
        let (mp, _gm) = m.device_ptr_mut(stream);
        let (vp, _gv) = v.device_ptr_mut(stream);
        let len = len as u64;
        let mut b = stream.launch_builder(self.function(K));
        b.arg(&p).arg(&g).arg(&mp).arg(&vp);
        b.arg(&s.beta1).arg(&s.one_minus_beta1).arg(&s.beta2).arg(&s.one_minus_beta2);
        b.arg(&s.scale_m).arg(&s.scale_v).arg(&s.eps).arg(&s.lr).arg(&s.keep).arg(&len);
        // SAFETY: (float* x2 const, ..., 9 floats, u64) is the kernel's signature, in this
        // order; live, distinct buffers of this context of `len` elements
        unsafe { b.launch(config(dims)) }.map_err(Error::driver("cuLaunchKernel"))?;
        Ok(())
    }
}

//! Timing of Strata's reduction kernel (`strata_reduce_f32`) for `strata bench allreduce
//! --gpus`: `inputs` buffers on one GPU reduced into a fresh one, as the reduction to one device
//! does once the replicas' buffers are on the destination GPU. Results are checked element by
//! element against the CPU reference ([`reference::reduce`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream};
use strata_core::ReduceOp;

use super::launch::Kernels;
use super::reference;
use crate::{Error, Result};

/// One measured reduction: the mean over `iters` back-to-back launches.
#[derive(Clone, Copy, Debug)]
pub struct KernelTiming {
    /// Time of one reduction.
    pub time: Duration,
    /// Timed launches.
    pub iters: usize,
    /// Result elements that differ from the CPU reference (checked after the first warm-up and
    /// after the timed launches).
    pub wrong: usize,
}

/// `inputs` buffers reduced into one, on one GPU.
#[derive(Debug)]
pub struct KernelReduceBench {
    kernels: Arc<Kernels>,
    stream: Arc<CudaStream>,
    inputs: usize,
}

/// Input `r`'s element `i`: small multiples of 0.5, exact in f32 in any order.
fn value(r: usize, i: usize) -> f32 {
    (i % 251) as f32 + r as f32 * 0.5
}

impl KernelReduceBench {
    /// The kernels of GPU `ordinal` (compiled by NVRTC at first use), reducing `inputs` buffers.
    pub fn new(ordinal: u32, inputs: usize) -> Result<Self> {
        crate::kernels::validate::buffer_count("strata_reduce_f32", inputs)?;
        let ctx = crate::device::context(ordinal)?;
        let kernels = Kernels::get(&ctx)?;
        let stream = ctx.new_stream().map_err(Error::driver("cuStreamCreate"))?;
        Ok(Self { kernels, stream, inputs })
    }

    /// The number of input buffers.
    pub fn inputs(&self) -> usize {
        self.inputs
    }

    fn wrong(&self, op: ReduceOp, count: usize, out: &CudaSlice<f32>) -> Result<usize> {
        let host: Vec<Vec<f32>> = (0..self.inputs).map(|r| (0..count).map(|i| value(r, i)).collect()).collect();
        let srcs: Vec<&[f32]> = host.iter().map(Vec::as_slice).collect();
        let mut want = vec![0f32; count];
        reference::reduce(op, &srcs, &mut want)?;
        let got = self.stream.clone_dtoh(out).map_err(Error::driver("cuMemcpyDtoH"))?;
        Ok(got.iter().zip(&want).filter(|(g, w)| g.to_bits() != w.to_bits()).count())
    }

    /// Times the reduction of `count` f32 per input. `iters`: the timed launches, or `None` for
    /// `adaptive(time of one warm-up launch)`.
    pub fn run(
        &self,
        count: usize,
        op: ReduceOp,
        warmup: usize,
        iters: Option<usize>,
        adaptive: &dyn Fn(Duration) -> usize,
    ) -> Result<KernelTiming> {
        let srcs: Vec<CudaSlice<f32>> = (0..self.inputs)
            .map(|r| {
                let host: Vec<f32> = (0..count).map(|i| value(r, i)).collect();
                self.stream.clone_htod(&host).map_err(Error::driver("cuMemcpyHtoD"))
            })
            .collect::<Result<_>>()?;
        let mut out = self.stream.clone_htod(&vec![f32::NAN; count]).map_err(Error::driver("cuMemcpyHtoD"))?;
        let refs: Vec<&CudaSlice<f32>> = srcs.iter().collect();
        let sync = || self.stream.synchronize().map_err(Error::driver("cuStreamSynchronize"));
        let t0 = Instant::now();
        self.kernels.reduce(&self.stream, op, &refs, &mut out)?;
        sync()?;
        let mut estimate = t0.elapsed();
        let mut wrong = self.wrong(op, count, &out)?;
        for _ in 1..warmup.max(1) {
            let t = Instant::now();
            self.kernels.reduce(&self.stream, op, &refs, &mut out)?;
            sync()?;
            estimate = estimate.min(t.elapsed());
        }
        let iters = iters.unwrap_or_else(|| adaptive(estimate)).max(1);
        let t = Instant::now();
        for _ in 0..iters {
            self.kernels.reduce(&self.stream, op, &refs, &mut out)?;
        }
        sync()?;
        let time = t.elapsed() / iters as u32;
        wrong += self.wrong(op, count, &out)?;
        Ok(KernelTiming { time, iters, wrong })
    }
}

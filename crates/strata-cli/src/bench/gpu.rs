//! `strata bench allreduce --gpus`: NCCL all-reduce across every visible GPU, printed as
//! nccl-tests prints it (`size count type redop`, then `time algbw busbw #wrong` out of place
//! and in place), beside the device-to-device copy bandwidth of the same GPUs measured in the
//! same run (`cuMemcpyDtoDAsync` within each GPU, a peer copy from the first GPU to each other
//! one). Every result element of every GPU is checked against a closed form after the first
//! warm-up and after the timed iterations (`#wrong`).
//!
//! Timing follows nccl-tests: the host clock around `iters` back-to-back all-reduces and one
//! synchronisation, divided by `iters`. busbw = algbw * 2(n-1)/n.
//!
//! The GPU work lives in strata-cuda (`strata_cuda::nccl::bench`); this crate holds no cudarc.
//! Without the `nccl` feature, without a CUDA driver, without NCCL or without a GPU it says so
//! in one line and exits with code 2.
//!
//! Strata's own reduction kernel (`strata_reduce_f32`, the reduction to one device) gets its own
//! table: its memory traffic against the copy's, the target being 80% or more from 64 MiB up.

use super::allreduce::Plan;
#[cfg(not(feature = "nccl"))]
use crate::Error;
use crate::Result;

/// Runs the GPU benchmark (see the module docs).
pub fn run(plan: &Plan) -> Result<()> {
    #[cfg(feature = "nccl")]
    {
        imp::run(plan)
    }
    #[cfg(not(feature = "nccl"))]
    {
        let _ = plan;
        Err(Error::Usage(
            "strata bench allreduce --gpus: this strata was built without the `nccl` feature; rebuild with \
             `cargo build --release -p strata --features nccl` on a machine with GPUs"
                .into(),
        ))
    }
}

#[cfg(feature = "nccl")]
mod imp {
    use std::time::Duration;

    use strata_core::device::format_bytes;
    use strata_cuda::kernels::bench::KernelReduceBench;
    use strata_cuda::nccl::bench::{copy_bandwidth, gpu_name, AllReduceBench, Timing};

    use super::super::allreduce::{adaptive_iters, Plan};
    use crate::{Error, Result};

    /// The buffer of the copy-bandwidth ceiling.
    const COPY_BYTES: usize = 64 << 20;
    const COPY_REPEATS: usize = 20;

    /// A strata-cuda error: the machine's setup (no driver, no NCCL, no GPU) is exit code 2,
    /// anything else a run-time failure.
    fn gpu_error(e: strata_cuda::Error) -> Error {
        use strata_cuda::Error as C;
        let msg = format!("strata bench allreduce --gpus: {e}");
        match e {
            C::NotBuilt { .. } | C::LibraryMissing { .. } | C::NoGpu(_) => Error::Usage(msg),
            _ => Error::io("strata bench allreduce --gpus", std::io::Error::other(e.to_string())),
        }
    }

    fn busbw(algbw: f64, n: usize) -> f64 {
        algbw * 2.0 * (n as f64 - 1.0) / n as f64
    }

    fn cells(t: &Timing, bytes: u64, n: usize) -> String {
        let algbw = bytes as f64 / t.time.as_secs_f64().max(1e-12) / 1e9;
        format!("{:>10.1} {:>8.2} {:>8.2} {:>7}", t.time.as_secs_f64() * 1e6, algbw, busbw(algbw, n), t.wrong)
    }

    /// The NCCL table's header, as nccl-tests prints it, for `n` GPUs.
    fn print_nccl_header(n: usize) {
        println!("#");
        println!("# NCCL all-reduce, {n} GPU(s)");
        println!("# {:>10} {:>12} {:>6} {:>6}  {:^35}  {:^35}", "", "", "", "", "out-of-place", "in-place");
        println!(
            "# {:>10} {:>12} {:>6} {:>6}  {:>10} {:>8} {:>8} {:>7}  {:>10} {:>8} {:>8} {:>7}",
            "size",
            "count",
            "type",
            "redop",
            "time(us)",
            "algbw",
            "busbw",
            "#wrong",
            "time(us)",
            "algbw",
            "busbw",
            "#wrong"
        );
    }

    pub(super) fn run(plan: &Plan) -> Result<()> {
        strata_cuda::probe::driver().map_err(gpu_error)?;
        let n = strata_cuda::testing::gpu_count()
            .map_err(|e| Error::Usage(format!("strata bench allreduce --gpus: {e}")))?;
        if n == 0 {
            return Err(Error::Usage(
                "strata bench allreduce --gpus: no GPU is visible (check CUDA_VISIBLE_DEVICES and nvidia-smi)".into(),
            ));
        }
        strata_cuda::probe::nccl().map_err(gpu_error)?;
        let ordinals: Vec<usize> = (0..n).collect();
        let (major, minor, patch) = strata_cuda::nccl::nccl_version().map_err(gpu_error)?;

        println!("# strata bench allreduce --gpus");
        let names: Vec<String> = ordinals
            .iter()
            .map(|&o| gpu_name(o).map(|name| format!("GPU {o}: {name}")))
            .collect::<Result<_, _>>()
            .map_err(gpu_error)?;
        println!("# {n} GPU(s): {}", names.join(", "));
        println!(
            "# NCCL {major}.{minor}.{patch}, one communicator per GPU (ncclCommInitAll), grouped calls from one thread"
        );
        println!(
            "# op {}, float, warmup {}, iters {}",
            plan.op,
            plan.warmup.max(1),
            plan.iters.map_or_else(|| "adaptive (~0.15 s a row, 5 to 1000)".to_string(), |i| i.to_string())
        );
        let copies = copy_bandwidth(&ordinals, COPY_BYTES, COPY_REPEATS).map_err(gpu_error)?;
        let ceiling: Vec<String> =
            copies.iter().map(|c| format!("{}: {:.1} GB/s", c.what, c.bytes_per_sec / 1e9)).collect();
        println!(
            "# device-to-device copy ceiling ({} buffers, bytes copied per second; read+write traffic is twice that): {}",
            format_bytes(COPY_BYTES as u64),
            ceiling.join(", ")
        );
        let local_copy = copies.first().map(|c| c.bytes_per_sec).unwrap_or(0.0);

        let mut bench = AllReduceBench::new(&ordinals).map_err(gpu_error)?;
        print_nccl_header(n);
        let adaptive = |d: Duration| adaptive_iters(d);
        let mut wrong = 0usize;
        let mut busbws = Vec::new();
        let mut large = Vec::new();
        for &bytes in &plan.sizes {
            let count = usize::try_from(bytes / 4).map_err(|_| Error::Usage(format!("{bytes} bytes is too large")))?;
            let bytes = count as u64 * 4;
            let out = bench.run(count, plan.op, false, plan.warmup, plan.iters, &adaptive).map_err(gpu_error)?;
            let inp = bench.run(count, plan.op, true, plan.warmup, plan.iters, &adaptive).map_err(gpu_error)?;
            println!(
                "  {:>10} {:>12} {:>6} {:>6}  {}  {}",
                bytes,
                count,
                "float",
                plan.op.to_string(),
                cells(&out, bytes, n),
                cells(&inp, bytes, n)
            );
            wrong += out.wrong + inp.wrong;
            let algbw = bytes as f64 / out.time.as_secs_f64().max(1e-12) / 1e9;
            busbws.push(busbw(algbw, n));
            if bytes >= 64 << 20 {
                large.push(algbw * 1e9);
            }
        }
        // Strata's reduction kernel on GPU 0: the reduction to one device once the replicas'
        // buffers are there. It reads `inputs` buffers and writes one: (inputs + 1) x size of
        // memory traffic, against the copy's 2 x size.
        println!("#");
        let inputs = n.max(2);
        let kernel_bench = KernelReduceBench::new(0, inputs).map_err(gpu_error)?;
        println!(
            "# Strata's strata_reduce_f32 on GPU 0: {inputs} input buffers into one (traffic = {} x size; the copy moves 2 x size)",
            inputs + 1
        );
        println!(
            "# {:>10} {:>12} {:>6} {:>6}  {:>10} {:>8} {:>10} {:>9} {:>7}",
            "size", "count", "type", "redop", "time(us)", "algbw", "traffic", "of copy", "#wrong"
        );
        let mut kernel_large = Vec::new();
        for &bytes in &plan.sizes {
            let count = usize::try_from(bytes / 4).map_err(|_| Error::Usage(format!("{bytes} bytes is too large")))?;
            let bytes = count as u64 * 4;
            let t = kernel_bench.run(count, plan.op, plan.warmup, plan.iters, &adaptive).map_err(gpu_error)?;
            let secs = t.time.as_secs_f64().max(1e-12);
            let traffic = (inputs + 1) as f64 * bytes as f64 / secs;
            let of_copy = if local_copy > 0.0 { traffic / (2.0 * local_copy) } else { 0.0 };
            println!(
                "  {:>10} {:>12} {:>6} {:>6}  {:>10.1} {:>8.2} {:>10.2} {:>8.0}% {:>7}",
                bytes,
                count,
                "float",
                plan.op.to_string(),
                secs * 1e6,
                bytes as f64 / secs / 1e9,
                traffic / 1e9,
                of_copy * 100.0,
                t.wrong
            );
            wrong += t.wrong;
            if bytes >= 64 << 20 {
                kernel_large.push(of_copy);
            }
        }
        if !kernel_large.is_empty() {
            kernel_large.sort_by(f64::total_cmp);
            println!(
                "# strata_reduce_f32 memory traffic over rows >= 64 MiB: median {:.0}% of the copy's (target: 80% or more)",
                kernel_large[kernel_large.len() / 2] * 100.0
            );
        }
        if !large.is_empty() && local_copy > 0.0 {
            large.sort_by(f64::total_cmp);
            let median = large[large.len() / 2];
            println!(
                "# NCCL out-of-place algbw over rows >= 64 MiB: median {:.1} GB/s = {:.2}x the device-to-device copy ceiling",
                median / 1e9,
                median / local_copy
            );
        }
        println!("# wrong values: {wrong} {}", if wrong == 0 { "OK" } else { "FAILED" });
        println!("# avg bus bandwidth: {:.3} GB/s", busbws.iter().sum::<f64>() / busbws.len().max(1) as f64);
        if wrong > 0 {
            return Err(Error::io(
                "strata bench allreduce --gpus",
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{wrong} all-reduce result values differ from the closed form (see #wrong)"),
                ),
            ));
        }
        Ok(())
    }
}

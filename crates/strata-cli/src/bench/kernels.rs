//! `strata bench kernels`: the CPU kernels the benchmark models spend their time in, one thread
//! each, beside this machine's peaks measured in the same run: which code ran (gemm's and
//! `strata::fused`'s vector instructions, chosen at run time), and each kernel's share of the
//! peak that bounds it.
//!
//! - The compute peak: one thread's fused multiply-adds on registers only (12 independent
//!   accumulators, the widest vectors this build and CPU choose), in GFLOP/s. The matrix
//!   products' share is of it.
//! - The memory peak: one thread moving the kernel's own bytes, the better of a copy and an
//!   in-place add (so a kernel whose data sits in cache is measured against streams that sit in
//!   cache too, and the optimizer's 122 MB against memory), in GB/s of bytes read and written. The element-wise kernels' and the
//!   optimizer's share is of it. The optimizer counts the 28 bytes a parameter that one pass
//!   must move (parameter, gradient and both moments read; parameter and moments written).
//!
//! The shapes are the models' own (`strata bench train`): the large MLP's hidden layer at a
//! Mirrored(2) replica's 128 rows, the transformer's projections and attention at 16 windows of
//! 64 tokens, width 128, 4 heads. Nothing here is asserted; medians of `--reps` runs.

use std::hint::black_box;
use std::time::Instant;

use candle_core::{backprop::GradStore, DType, Device, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};
use strata_core::optim::FusedAdamW;

use crate::{Error, Result};

/// `strata bench kernels` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchKernelsArgs {
    /// Seconds each kernel is timed (after a warm-up call).
    #[arg(long, default_value_t = 0.5)]
    pub seconds: f64,
    /// Repetitions of each timing; the median is printed.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
}

/// What bounds a kernel, so which peak its share is of.
#[derive(Clone, Copy)]
enum Bound {
    /// FLOPs a call.
    Compute(f64),
    /// Bytes a call reads and writes.
    Memory(f64),
}

struct Row {
    kernel: &'static str,
    shape: String,
    code: &'static str,
    seconds: f64,
    bound: Bound,
}

/// The median seconds of one call of `f`, over `reps` timings of about `seconds` each.
fn time(args: &BenchKernelsArgs, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?; // warm-up: pages, packing buffers
    let mut runs = Vec::with_capacity(args.reps);
    for _ in 0..args.reps {
        let t0 = Instant::now();
        let mut calls = 0u64;
        while calls == 0 || t0.elapsed().as_secs_f64() < args.seconds {
            f()?;
            calls += 1;
        }
        runs.push(t0.elapsed().as_secs_f64() / calls as f64);
    }
    Ok(super::common::median(runs))
}

/// One thread's register-only FMA throughput in GFLOP/s, at the widest vectors pulp chooses
/// here (the same dispatch as `strata::fused`'s kernels).
fn fma_peak(args: &BenchKernelsArgs) -> Result<f64> {
    struct Fmas {
        iters: u64,
    }
    impl pulp::WithSimd for Fmas {
        type Output = (f32, usize);
        #[inline(always)]
        fn with_simd<S: pulp::Simd>(self, simd: S) -> (f32, usize) {
            let lanes = core::mem::size_of::<S::f32s>() / 4;
            let a = simd.splat_f32s(0.999_999);
            let b = simd.splat_f32s(1e-7);
            let mut acc = [simd.splat_f32s(1.0); 12];
            for _ in 0..self.iters {
                for x in acc.iter_mut() {
                    *x = simd.mul_add_f32s(*x, a, b);
                }
            }
            let mut total = simd.splat_f32s(0.0);
            for x in acc {
                total = simd.add_f32s(total, x);
            }
            (simd.reduce_sum_f32s(total), lanes)
        }
    }
    let iters = 1u64 << 20;
    let mut lanes = 0;
    let s = time(args, || {
        let (sum, l) = pulp::Arch::new().dispatch(Fmas { iters: black_box(iters) });
        black_box(sum);
        lanes = l;
        Ok(())
    })?;
    Ok(iters as f64 * 12.0 * lanes as f64 * 2.0 / s / 1e9)
}

/// One thread's memory bandwidth over `bytes` (read and written), GB/s: the better of a copy
/// (half the bytes read, half written) and an in-place add (`a += b`: two thirds read, one
/// third written, as the optimizer's streams are mostly read and written back in place).
fn memory_peak(args: &BenchKernelsArgs, bytes: usize) -> Result<f64> {
    let n = (bytes / 2 / 4).max(1);
    let src = vec![1f32; n];
    let mut dst = vec![0f32; n];
    let copy = time(args, || {
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
        Ok(())
    })?;
    let n3 = (bytes / 3 / 4).max(1);
    let (mut a, b) = (vec![0f32; n3], vec![1f32; n3]);
    let add = time(args, || {
        for (a, b) in a.iter_mut().zip(black_box(&b)) {
            *a += *b;
        }
        black_box(&mut a);
        Ok(())
    })?;
    Ok((8.0 * n as f64 / copy).max(12.0 * n3 as f64 / add) / 1e9)
}

/// Keeps a result from being optimized away, and passes its error on.
fn done<T>(r: candle_core::Result<T>) -> Result<()> {
    black_box(r?);
    Ok(())
}

fn randn(shape: &[usize]) -> Result<Tensor> {
    Ok(Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?)
}

/// The three products of one linear layer `y = x w` as `strata::model::Dense` stores it (x: `m
/// x k`, w: `k x n`): forward, the input's gradient (`dy w^T`) and the weight's (`x^T dy`), the
/// transposes as candle's autograd passes them (strided views, no copy).
/// `input_grad`: whether the step computes the input's gradient (not for the first layer, whose
/// input is the data).
fn linear(
    args: &BenchKernelsArgs,
    name: &'static str,
    (m, k, n): (usize, usize, usize),
    input_grad: bool,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let (x, w, dy) = (randn(&[m, k])?, randn(&[k, n])?, randn(&[m, n])?);
    let flops = 2.0 * (m * k * n) as f64;
    let (wt, xt) = (w.t()?, x.t()?);
    // The column strides of each product's operands, which (with the shape) decide whether
    // candle's `rows_gemm` computes it rather than gemm.
    for (kernel, f, (mm, nn, kk), strides) in [
        ("matmul forward", Box::new(|| done(x.matmul(&w))) as Box<dyn Fn() -> Result<()>>, (m, n, k), (1, 1)),
        ("matmul grad input", Box::new(|| done(dy.matmul(&wt))), (m, k, n), (1, n)),
        ("matmul grad weight", Box::new(|| done(xt.matmul(&dy))), (k, n, m), (k, 1)),
    ] {
        if kernel == "matmul grad input" && !input_grad {
            continue;
        }
        let seconds = time(args, f)?;
        let rows_gemm = candle_core::cpu_backend::rows_gemm::applies(mm, nn, kk, strides.0, strides.1);
        rows.push(Row {
            kernel,
            shape: format!("{name}: {m}x{k} by {k}x{n}"),
            code: if rows_gemm { "rows_gemm AVX2" } else { code_names().0 },
            seconds,
            bound: Bound::Compute(flops),
        });
    }
    Ok(())
}

/// The names of the code that runs here: gemm's microkernels and `strata::fused`'s level.
fn code_names() -> (&'static str, &'static str) {
    let level = strata::simd_level();
    if level.starts_with("x86-v4") {
        ("gemm avx512f", "fused, pulp V4")
    } else if level.starts_with("x86-v3") {
        ("gemm fma (AVX2)", "fused, pulp V3")
    } else {
        ("gemm scalar", "fused, scalar")
    }
}

/// An element-wise kernel's forward and forward plus backward (autograd seeds the output's
/// gradient with ones), with the bytes each reads and writes.
fn elementwise(
    args: &BenchKernelsArgs,
    e: Elementwise,
    x: &Var,
    f: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let code = code_names().1;
    let (fwd, bwd) = (4.0 * (2 * x.elem_count()) as f64, 4.0 * (3 * x.elem_count()) as f64);
    let seconds = time(args, || done(f(x.as_tensor())))?;
    rows.push(Row { kernel: e.forward, shape: e.shape.clone(), code, seconds, bound: Bound::Memory(fwd) });
    let seconds = time(args, || done(f(x.as_tensor())?.backward()))?;
    rows.push(Row { kernel: e.both, shape: e.shape, code, seconds, bound: Bound::Memory(fwd + bwd) });
    Ok(())
}

/// An element-wise kernel's rows: its forward reads and writes a tensor of its input's size,
/// its backward reads the input and the output's gradient and writes the input's.
struct Elementwise {
    forward: &'static str,
    both: &'static str,
    shape: String,
}

/// Runs the kernels and prints the table.
pub fn run(args: &BenchKernelsArgs) -> Result<()> {
    if args.reps == 0 || !args.seconds.is_finite() || args.seconds <= 0.0 {
        return Err(Error::Usage("--reps must be at least 1 and --seconds above 0".into()));
    }
    let mut rows = Vec::new();
    // The large MLP's hidden layer and its first, at a Mirrored(2) replica's rows (the last,
    // 2048 by 10, is a small share of the step).
    linear(args, "large MLP hidden", (128, 2048, 2048), true, &mut rows)?;
    linear(args, "large MLP first", (128, 64, 2048), false, &mut rows)?;
    // The transformer's projections at 16 windows of 64 tokens (a Mirrored(2) replica), width 128.
    let tokens = 16 * 64;
    linear(args, "transformer qkv", (tokens, 128, 384), true, &mut rows)?;
    linear(args, "transformer MLP up", (tokens, 128, 512), true, &mut rows)?;
    linear(args, "transformer MLP down", (tokens, 512, 128), true, &mut rows)?;
    // Attention: 16 x 4 heads of 64 x 32 queries by the keys' transpose, as the model multiplies.
    let (q, k) = (randn(&[16, 4, 64, 32])?, randn(&[16, 4, 64, 32])?);
    let kt = k.t()?;
    let seconds = time(args, || done(q.matmul(&kt)))?;
    rows.push(Row {
        kernel: "batched matmul",
        shape: "attention scores: 64 x (64x32 by 32x64)".into(),
        code: code_names().0,
        seconds,
        bound: Bound::Compute(2.0 * (64 * 64 * 32 * 64) as f64),
    });

    // The fused causal attention over the same heads (each head's columns of the (n t, width)
    // projections): its FLOPs counted over the whole t x t square, as `bench train` counts the
    // model's (it computes only the products below the diagonal).
    let qkv: Vec<Var> = (0..3).map(|_| Ok(Var::from_tensor(&randn(&[16, 64, 128])?)?)).collect::<Result<_>>()?;
    let attention = || strata::fused::causal_attention(qkv[0].as_tensor(), qkv[1].as_tensor(), qkv[2].as_tensor(), 4);
    let square = 2.0 * (16 * 4 * 64 * 64 * 32) as f64;
    let shape = "attention: 16 x 4 heads of 64x32, causal";
    let seconds = time(args, || done(attention()))?;
    let fused = code_names().1;
    rows.push(Row {
        kernel: "causal attention fwd",
        shape: shape.into(),
        code: fused,
        seconds,
        bound: Bound::Compute(2.0 * square),
    });
    let seconds = time(args, || done(attention()?.sum_all()?.backward()))?;
    rows.push(Row {
        kernel: "causal attention f+b",
        shape: shape.into(),
        code: fused,
        seconds,
        bound: Bound::Compute(6.0 * square),
    });

    let f4 = |n: usize| 4.0 * n as f64;
    let x = Var::from_tensor(&randn(&[tokens, 512])?)?;
    let b = Var::from_tensor(&randn(&[512])?)?;
    elementwise(
        args,
        Elementwise { forward: "bias + GELU forward", both: "bias + GELU fwd+bwd", shape: format!("{tokens}x512") },
        &x,
        |x| strata::fused::bias_gelu(x, b.as_tensor()),
        &mut rows,
    )?;
    let s = Var::from_tensor(&randn(&[16, 4, 64, 64])?)?;
    elementwise(
        args,
        Elementwise { forward: "causal softmax forward", both: "causal softmax fwd+bwd", shape: "16x4x64x64".into() },
        &s,
        strata::fused::causal_softmax,
        &mut rows,
    )?;
    let h = Var::from_tensor(&randn(&[tokens, 128])?)?;
    let (g, beta) = (Tensor::ones(128, DType::F32, &Device::Cpu)?, Tensor::zeros(128, DType::F32, &Device::Cpu)?);
    elementwise(
        args,
        Elementwise { forward: "layer norm forward", both: "layer norm fwd+bwd", shape: format!("{tokens}x128") },
        &h,
        |x| strata::fused::layer_norm(x, &g, &beta, 1e-5),
        &mut rows,
    )?;
    // The reductions: a bias gradient (a column sum) and the loss's log-softmax over the vocabulary.
    let d = randn(&[128, 2048])?;
    let seconds = time(args, || done(d.sum_keepdim(0)))?;
    rows.push(Row {
        kernel: "column sum",
        shape: "bias gradient: 128x2048".into(),
        code: "candle",
        seconds,
        bound: Bound::Memory(f4(128 * 2048 + 2048)),
    });
    let logits = randn(&[tokens, 65])?;
    let seconds = time(args, || done(candle_nn::ops::log_softmax(&logits, 1)))?;
    rows.push(Row {
        kernel: "log-softmax",
        shape: format!("loss: {tokens}x65"),
        code: "candle",
        seconds,
        bound: Bound::Memory(f4(2 * tokens * 65)),
    });
    // The transformer's loss, forward and backward: candle-nn's composed cross-entropy and
    // Strata's fused one (each reads the logits twice and writes their gradient once).
    let logits = Var::from_tensor(&logits)?;
    let targets = Tensor::new((0..tokens as u32).map(|i| i * 7 % 65).collect::<Vec<_>>(), &Device::Cpu)?;
    type Loss = fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>;
    let loss_rows: [(&str, Loss); 2] =
        [("candle", candle_nn::loss::cross_entropy), (code_names().1, strata::fused::cross_entropy)];
    for (code, loss) in loss_rows {
        let seconds = time(args, || done(loss(logits.as_tensor(), &targets)?.backward()))?;
        rows.push(Row {
            kernel: "cross-entropy f+b",
            shape: format!("loss: {tokens}x65"),
            code,
            seconds,
            bound: Bound::Memory(f4(3 * tokens * 65)),
        });
    }

    // The optimizer over the large MLP's 4,349,962 parameters.
    let shapes: [&[usize]; 6] = [&[2048, 64], &[2048], &[2048, 2048], &[2048], &[10, 2048], &[10]];
    let vars = shapes.iter().map(|s| Ok(Var::from_tensor(&randn(s)?)?)).collect::<Result<Vec<_>>>()?;
    let params: usize = vars.iter().map(|v| v.elem_count()).sum();
    // Gradients of random directions: the sum of each variable times a random tensor.
    let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu)?;
    for v in &vars {
        loss = (loss + (v.as_tensor() * randn(v.dims())?.affine(1e-3, 0.0)?)?.sum_all()?)?;
    }
    let grads: GradStore = loss.backward()?;
    let mut opt = FusedAdamW::new(vars, ParamsAdamW { lr: 1e-6, ..Default::default() })?;
    let seconds = time(args, || Ok(opt.step(&grads)?))?;
    rows.push(Row {
        kernel: "AdamW step",
        shape: format!("large MLP: {params} parameters"),
        code: "FusedAdamW, pulp",
        seconds,
        bound: Bound::Memory(28.0 * params as f64),
    });

    let peak = fma_peak(args)?;
    println!("# strata bench kernels: one thread, median of {} timings of {:.2} s per kernel", args.reps, args.seconds);
    println!(
        "# machine: {}, {} cores; vector code: {} (gemm and strata::fused choose it at run time; built {} the avx512 feature)",
        super::common::cpu_model().unwrap_or_else(|| "unknown CPU".into()),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        strata::simd_level(),
        if cfg!(feature = "avx512") { "with" } else { "without" }
    );
    println!("# compute peak: {peak:.1} GFLOP/s (one thread, fused multiply-adds on registers only, measured now)");
    println!("# memory peak: one thread moving each kernel's own bytes (read + written), the better of a copy and an in-place add, measured now beside it");
    println!(
        "{:<24} {:<44} {:<18} {:>10} {:>9} {:>8} {:>9} {:>8}",
        "kernel", "shape", "code", "time(us)", "GFLOP/s", "GB/s", "peak", "of peak"
    );
    for r in &rows {
        let (gflops, gbs, peak_text, share) = match r.bound {
            Bound::Compute(flops) => {
                let g = flops / r.seconds / 1e9;
                (format!("{g:.1}"), "-".to_string(), format!("{peak:.0} GF"), 100.0 * g / peak)
            }
            Bound::Memory(bytes) => {
                let g = bytes / r.seconds / 1e9;
                let copy = memory_peak(args, bytes as usize)?;
                ("-".to_string(), format!("{g:.1}"), format!("{copy:.1} GB/s"), 100.0 * g / copy)
            }
        };
        println!(
            "{:<24} {:<44} {:<18} {:>10.1} {:>9} {:>8} {:>9} {:>7.1}%",
            r.kernel,
            r.shape,
            r.code,
            r.seconds * 1e6,
            gflops,
            gbs,
            peak_text,
            share
        );
    }
    Ok(())
}

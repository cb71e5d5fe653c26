//! Every kernel on a GPU against its CPU reference: seeded random inputs, poisoned outputs (NaN
//! bits `0xFFFFFFFF` written before each launch), sizes that are not multiples of the block
//! (1, 255, 257, 1 000 003), aligned (`float4`) and misaligned (element-wise) buffers, and the
//! launchers' checks. Gated by `require_gpus`: skipped without a GPU, failing instead with
//! `STRATA_REQUIRE_GPU=1`.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use rand::{Rng, SeedableRng};
use strata_core::ReduceOp;
use strata_cuda::kernels::launch::{Kernels, RawBuf};
use strata_cuda::kernels::{reference as r, AdamWScalars};
use strata_cuda::testing::require_gpus;
use strata_cuda::Error;

const SIZES: [usize; 4] = [1, 255, 257, 1_000_003];
const POISON: u32 = 0xFFFF_FFFF;

struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    k: Arc<Kernels>,
}

fn gpu(ordinal: usize) -> Gpu {
    let ctx = CudaContext::new(ordinal).expect("a CUDA context");
    let stream = ctx.default_stream();
    let k = Kernels::get(&ctx).expect("the kernels compile and load");
    Gpu { ctx, stream, k }
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|i| match i % 101 {
            0 => 0.0,
            1 => -0.0,
            _ => (rng.random::<f32>() * 2.0 - 1.0) * 10f32.powi(rng.random_range(-3..4)),
        })
        .collect()
}

fn poisoned(g: &Gpu, n: usize) -> CudaSlice<f32> {
    g.stream.clone_htod(&vec![f32::from_bits(POISON); n]).unwrap()
}

fn up(g: &Gpu, v: &[f32]) -> CudaSlice<f32> {
    g.stream.clone_htod(v).unwrap()
}

fn down<T: cudarc::driver::DeviceRepr + Default + Clone>(g: &Gpu, s: &CudaSlice<T>) -> Vec<T> {
    g.stream.clone_dtoh(s).unwrap()
}

/// Bit-for-bit, except that two NaNs are equal (arithmetic NaN payloads differ CPU / GPU).
fn assert_same(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "{what}: element {i}: gpu {a:e} ({:#010x}), cpu {b:e} ({:#010x})",
            a.to_bits(),
            b.to_bits()
        );
    }
}

/// Exactly bit for bit (the reductions canonicalise NaNs).
fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "{what}: element {i}: gpu {a:e}, cpu {b:e}");
    }
}

#[test]
fn reduce_matches_the_reference() {
    if !require_gpus(1) {
        return;
    }
    let g = gpu(0);
    for len in SIZES {
        for n in [1usize, 2, 3, 8] {
            let mut host: Vec<Vec<f32>> = (0..n).map(|b| random(len, (len * 10 + b) as u64)).collect();
            // NaNs and infinities in a few places
            host[0][len / 2] = f32::from_bits(0x7FC0_1234);
            if n > 1 {
                host[n - 1][len - 1] = f32::INFINITY;
                host[0][len - 1] = f32::NEG_INFINITY;
            }
            let srcs: Vec<CudaSlice<f32>> = host.iter().map(|h| up(&g, h)).collect();
            let refs: Vec<&CudaSlice<f32>> = srcs.iter().collect();
            let views: Vec<&[f32]> = host.iter().map(|h| h.as_slice()).collect();
            for op in ReduceOp::ALL {
                let mut dst = poisoned(&g, len);
                g.k.reduce(&g.stream, op, &refs, &mut dst).unwrap();
                let mut want = vec![0.0; len];
                r::reduce(op, &views, &mut want).unwrap();
                assert_bits(&down(&g, &dst), &want, &format!("reduce {op:?} n={n} len={len}"));
            }
        }
    }
}

#[test]
fn reduce_on_misaligned_views_and_in_place() {
    if !require_gpus(1) {
        return;
    }
    let g = gpu(0);
    let len = 257;
    let a = random(len + 1, 1);
    let b = random(len + 1, 2);
    let (da, db) = (up(&g, &a), up(&g, &b));
    // views starting one element in: 4-byte aligned only, so the element-wise kernel runs
    let (va, vb) = (da.slice(1..), db.slice(1..));
    let mut dst = poisoned(&g, len + 1);
    let mut vdst = dst.slice_mut(1..);
    g.k.reduce(&g.stream, ReduceOp::Sum, &[&va, &vb], &mut vdst).unwrap();
    let mut want = vec![0.0; len];
    r::reduce(ReduceOp::Sum, &[&a[1..], &b[1..]], &mut want).unwrap();
    let got = down(&g, &dst);
    assert_eq!(got[0].to_bits(), POISON, "the element before the view is untouched");
    assert_bits(&got[1..], &want, "misaligned sum");

    // in place: the destination is source 0 (raw addresses)
    let (x, y) = (up(&g, &a), up(&g, &b));
    let (px, py) = {
        let (px, _gx) = x.device_ptr(&g.stream);
        let (py, _gy) = y.device_ptr(&g.stream);
        (px, py)
    };
    let n = len + 1;
    // SAFETY: x and y are live buffers of n f32 on this device; the stream is synchronised
    // below before they are read or dropped.
    unsafe {
        g.k.reduce_raw(
            &g.stream,
            ReduceOp::Max,
            &[RawBuf { ptr: px, len: n }, RawBuf { ptr: py, len: n }],
            RawBuf { ptr: px, len: n },
        )
        .unwrap()
    };
    g.stream.synchronize().unwrap();
    let mut want = vec![0.0; n];
    r::reduce(ReduceOp::Max, &[&a, &b], &mut want).unwrap();
    let got: Vec<f32> = g.stream.clone_dtoh(&x).unwrap();
    assert_bits(&got, &want, "in-place max");
}

#[test]
fn allreduce_chunk_on_one_device_matches_the_reference() {
    if !require_gpus(1) {
        return;
    }
    let g = gpu(0);
    for len in SIZES {
        let n = 3;
        let host: Vec<Vec<f32>> = (0..n).map(|b| random(len, (len * 7 + b) as u64)).collect();
        // two "devices'" chunks: [0, c) from offset 0 (the float4 kernel), then [c, len) with c
        // not a multiple of 4 where len > 1 (the element-wise kernel)
        let c = (len / 3 + 1).min(len);
        for op in ReduceOp::ALL {
            let bufs: Vec<CudaSlice<f32>> = host.iter().map(|h| up(&g, h)).collect();
            let raws: Vec<RawBuf> = bufs
                .iter()
                .map(|b| {
                    let (ptr, _guard) = b.device_ptr(&g.stream);
                    RawBuf { ptr, len }
                })
                .collect();
            // SAFETY: live buffers of len f32 on this device, synchronised before reading
            unsafe {
                g.k.allreduce_chunk_raw(&g.stream, op, &raws, 0, c).unwrap();
                g.k.allreduce_chunk_raw(&g.stream, op, &raws, c, len - c).unwrap();
            }
            g.stream.synchronize().unwrap();
            let views: Vec<&[f32]> = host.iter().map(|h| h.as_slice()).collect();
            let mut want = vec![0.0; len];
            r::reduce(op, &views, &mut want).unwrap();
            for (i, b) in bufs.iter().enumerate() {
                assert_bits(&down(&g, b), &want, &format!("chunk {op:?} len={len} buffer {i}"));
            }
        }
    }
}

#[test]
fn allreduce_chunk_across_two_gpus_with_peer_access() {
    if !require_gpus(2) {
        return;
    }
    let (g0, g1) = (gpu(0), gpu(1));
    for (a, b) in [(&g0, &g1), (&g1, &g0)] {
        a.ctx.bind_to_thread().unwrap();
        // SAFETY: enables access from the current context (a's) to b's; both are live.
        let res = unsafe { cudarc::driver::sys::cuCtxEnablePeerAccess(b.ctx.cu_ctx(), 0) };
        use cudarc::driver::sys::CUresult::*;
        assert!(matches!(res, CUDA_SUCCESS | CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED), "peer access: {res:?}");
    }
    for len in SIZES {
        let h0 = random(len, 500 + len as u64);
        let h1 = random(len, 600 + len as u64);
        let b0 = up(&g0, &h0);
        let b1 = up(&g1, &h1);
        g0.stream.synchronize().unwrap();
        g1.stream.synchronize().unwrap();
        let (p0, _) = b0.device_ptr(&g0.stream);
        let (p1, _) = b1.device_ptr(&g1.stream);
        let raws = [RawBuf { ptr: p0, len }, RawBuf { ptr: p1, len }];
        let half = len / 2;
        // SAFETY: both buffers are live, of len f32, reachable from both devices (peer access);
        // the two chunks are disjoint and both streams are synchronised before reading.
        unsafe {
            g0.k.allreduce_chunk_raw(&g0.stream, ReduceOp::Sum, &raws, 0, half).unwrap();
            g1.k.allreduce_chunk_raw(&g1.stream, ReduceOp::Sum, &raws, half, len - half).unwrap();
        }
        g0.stream.synchronize().unwrap();
        g1.stream.synchronize().unwrap();
        let mut want = vec![0.0; len];
        r::reduce(ReduceOp::Sum, &[&h0, &h1], &mut want).unwrap();
        assert_bits(&down(&g0, &b0), &want, &format!("two-GPU chunk len={len} on gpu 0"));
        assert_bits(&down(&g1, &b1), &want, &format!("two-GPU chunk len={len} on gpu 1"));

        // reduction to one device: gpu 0 sums its buffer and gpu 1's into a fresh one
        let h1b = random(len, 700 + len as u64);
        let b1b = up(&g1, &h1b);
        g1.stream.synchronize().unwrap();
        let (p1b, _) = b1b.device_ptr(&g1.stream);
        let out = poisoned(&g0, len);
        let (po, _) = out.device_ptr(&g0.stream);
        // SAFETY: as above; `out` is on gpu 0, the source on gpu 1 is reached by peer access
        unsafe {
            g0.k.reduce_raw(
                &g0.stream,
                ReduceOp::Mean,
                &[RawBuf { ptr: p0, len }, RawBuf { ptr: p1b, len }],
                RawBuf { ptr: po, len },
            )
            .unwrap();
        }
        g0.stream.synchronize().unwrap();
        let mut want2 = vec![0.0; len];
        r::reduce(ReduceOp::Mean, &[&want, &h1b], &mut want2).unwrap();
        assert_bits(&down(&g0, &out), &want2, &format!("reduce to gpu 0 len={len}"));
    }
}

#[test]
fn axpy_and_scale_match_the_reference() {
    if !require_gpus(1) {
        return;
    }
    let g = gpu(0);
    for len in SIZES {
        let src = random(len, 11 + len as u64);
        let dst0 = random(len, 12 + len as u64);
        for alpha in [0.5f32, -1.25, 3.3e-3] {
            let s = up(&g, &src);
            let mut d = up(&g, &dst0);
            g.k.axpy(&g.stream, alpha, &s, &mut d).unwrap();
            let mut want = dst0.clone();
            r::axpy(alpha, &src, &mut want).unwrap();
            assert_same(&down(&g, &d), &want, &format!("axpy {alpha} len={len}"));

            let mut out = poisoned(&g, len);
            g.k.scale(&g.stream, alpha, &s, &mut out).unwrap();
            let mut want = vec![0.0; len];
            r::scale(alpha, &src, &mut want).unwrap();
            assert_same(&down(&g, &out), &want, &format!("scale {alpha} len={len}"));

            g.k.scale_in_place(&g.stream, alpha, &mut d).unwrap();
            let mut twice = dst0.clone();
            r::axpy(alpha, &src, &mut twice).unwrap();
            let t = twice.clone();
            r::scale(alpha, &t, &mut twice).unwrap();
            assert_same(&down(&g, &d), &twice, &format!("scale in place {alpha} len={len}"));
        }
        // misaligned views: the element-wise kernel
        if len > 1 {
            let s = up(&g, &src);
            let mut d = up(&g, &dst0);
            let vs = s.slice(1..);
            let mut vd = d.slice_mut(1..);
            g.k.axpy(&g.stream, 2.0, &vs, &mut vd).unwrap();
            let mut want = dst0.clone();
            r::axpy(2.0, &src[1..], &mut want[1..]).unwrap();
            assert_same(&down(&g, &d), &want, &format!("misaligned axpy len={len}"));
        }
    }
}

#[test]
fn casts_match_the_reference() {
    if !require_gpus(1) {
        return;
    }
    let g = gpu(0);
    // every 16-bit pattern to f32
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let dall = g.stream.clone_htod(&all).unwrap();
    for (name, f) in
        [("bf16", r::bf16_to_f32 as fn(&[u16], &mut [f32]) -> strata_cuda::Result<()>), ("f16", r::f16_to_f32)]
    {
        let mut out = poisoned(&g, all.len());
        if name == "bf16" {
            g.k.bf16_to_f32(&g.stream, &dall, &mut out).unwrap();
        } else {
            g.k.f16_to_f32(&g.stream, &dall, &mut out).unwrap();
        }
        let mut want = vec![0.0; all.len()];
        f(&all, &mut want).unwrap();
        assert_bits(&down(&g, &out), &want, &format!("{name} to f32, all patterns"));
    }
    // f32 to 16 bits: random bit patterns (NaNs, subnormals, infinities included) and values
    for len in SIZES {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(len as u64);
        let src: Vec<f32> = (0..len)
            .map(|i| if i % 2 == 0 { f32::from_bits(rng.random()) } else { (rng.random::<f32>() - 0.5) * 1e5 })
            .collect();
        let s = up(&g, &src);
        let mut out16: CudaSlice<u16> = g.stream.clone_htod(&vec![0xFFFFu16; len]).unwrap();
        let mut want = vec![0u16; len];
        g.k.f32_to_bf16(&g.stream, &s, &mut out16).unwrap();
        r::f32_to_bf16(&src, &mut want).unwrap();
        assert_eq!(down(&g, &out16), want, "f32 to bf16 len={len}");
        g.k.f32_to_f16(&g.stream, &s, &mut out16).unwrap();
        r::f32_to_f16(&src, &mut want).unwrap();
        assert_eq!(down(&g, &out16), want, "f32 to f16 len={len}");
    }
}

#[test]
fn optimizers_match_the_reference() {
    if !require_gpus(1) {
        return;
    }
    let g = gpu(0);
    for len in SIZES {
        let init = random(len, 21 + len as u64);
        // SGD
        let mut p = up(&g, &init);
        let mut want = init.clone();
        for step in 0..3 {
            let grad = random(len, 100 + step);
            g.k.sgd(&g.stream, 0.1, &mut p, &up(&g, &grad)).unwrap();
            r::sgd(0.1, &mut want, &grad).unwrap();
        }
        assert_same(&down(&g, &p), &want, &format!("sgd len={len}"));
        // SGD with momentum
        let mut p = up(&g, &init);
        let mut vel = g.stream.alloc_zeros::<f32>(len).unwrap();
        let (mut want, mut want_v) = (init.clone(), vec![0.0f32; len]);
        for step in 0..3 {
            let grad = random(len, 200 + step);
            g.k.sgd_momentum(&g.stream, 0.05, 0.9, &mut p, &up(&g, &grad), &mut vel).unwrap();
            r::sgd_momentum(0.05, 0.9, &mut want, &grad, &mut want_v).unwrap();
        }
        assert_same(&down(&g, &p), &want, &format!("sgd momentum len={len}"));
        assert_same(&down(&g, &vel), &want_v, &format!("sgd momentum velocity len={len}"));
        // AdamW
        let mut p = up(&g, &init);
        let mut m = g.stream.alloc_zeros::<f32>(len).unwrap();
        let mut v = g.stream.alloc_zeros::<f32>(len).unwrap();
        let (mut want, mut wm, mut wv) = (init.clone(), vec![0.0f32; len], vec![0.0f32; len]);
        for step in 1..=4 {
            let grad = random(len, 300 + step as u64);
            let s = AdamWScalars::new(1e-3, 0.9, 0.999, 1e-8, 0.01, step);
            g.k.adamw(&g.stream, &s, &mut p, &up(&g, &grad), &mut m, &mut v).unwrap();
            r::adamw(&s, &mut want, &grad, &mut wm, &mut wv).unwrap();
        }
        assert_same(&down(&g, &p), &want, &format!("adamw len={len}"));
        assert_same(&down(&g, &m), &wm, &format!("adamw m len={len}"));
        assert_same(&down(&g, &v), &wv, &format!("adamw v len={len}"));
    }
}

#[test]
fn launchers_reject_what_the_references_reject() {
    if !require_gpus(1) {
        return;
    }
    let g = gpu(0);
    let a = up(&g, &[1.0; 4]);
    let b = up(&g, &[1.0; 3]);
    let mut d = poisoned(&g, 4);
    let detail = |e: Error| match e {
        Error::InvalidLaunch { kernel, detail } => format!("{kernel}: {detail}"),
        other => panic!("expected InvalidLaunch, got {other}"),
    };
    let e = g.k.reduce(&g.stream, ReduceOp::Sum, &[&a, &b], &mut d).unwrap_err();
    assert_eq!(detail(e), "strata_reduce_f32: source 1 has 3 elements, the destination 4");
    let none: [&CudaSlice<f32>; 0] = [];
    let e = g.k.reduce(&g.stream, ReduceOp::Sum, &none, &mut d).unwrap_err();
    assert_eq!(detail(e), "strata_reduce_f32: no buffers to reduce: a reduction needs at least one");
    let e = g.k.axpy(&g.stream, 1.0, &b, &mut d).unwrap_err();
    assert_eq!(detail(e), "strata_axpy_f32: src has 3 elements, dst has 4");
    // SAFETY: the launch is rejected before any pointer is used
    let e =
        unsafe { g.k.reduce_raw(&g.stream, ReduceOp::Sum, &[RawBuf { ptr: 0, len: 4 }], RawBuf { ptr: 0, len: 4 }) }
            .unwrap_err();
    assert_eq!(detail(e), "strata_reduce_f32: source 0 is a null pointer");
    // SAFETY: as above
    let e =
        unsafe { g.k.allreduce_chunk_raw(&g.stream, ReduceOp::Sum, &[RawBuf { ptr: 16, len: 4 }], 2, 3) }.unwrap_err();
    assert_eq!(detail(e), "strata_allreduce_chunk_f32: chunk [2, 2 + 3) does not lie inside buffers of 4 elements");
    // empty buffers: no launch, no error, nothing written
    let empty = g.stream.alloc_zeros::<f32>(0).unwrap();
    let mut empty_dst = g.stream.alloc_zeros::<f32>(0).unwrap();
    g.k.reduce(&g.stream, ReduceOp::Mean, &[&empty], &mut empty_dst).unwrap();
    g.k.axpy(&g.stream, 1.0, &empty, &mut empty_dst).unwrap();
    assert!(down(&g, &d).iter().all(|x| x.to_bits() == POISON));
    // the same context's kernels are loaded once
    assert!(Arc::ptr_eq(&g.k, &Kernels::get(&g.ctx).unwrap()));
}

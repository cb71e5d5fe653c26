//! The kernels' CPU references, on the CPU: closed forms, the documented NaN / tie / empty-input
//! semantics, the casts against the `half` crate, and the optimizers bit for bit against
//! strata-core's FusedSgd / FusedAdamW (candle-nn's SGD / AdamW). No feature and no GPU needed.

use candle_core::{Device, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};
use rand::{Rng, SeedableRng};
use strata_core::ReduceOp;
use strata_cuda::kernels::{reference as r, AdamWScalars, CANONICAL_NAN};
use strata_cuda::Error;

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|i| if i % 17 == 0 { 0.0 } else { rng.random::<f32>() * 2.0 - 1.0 }).collect()
}

fn invalid_detail(e: Error) -> (&'static str, String) {
    match e {
        Error::InvalidLaunch { kernel, detail } => (kernel, detail),
        other => panic!("expected InvalidLaunch, got {other}"),
    }
}

#[test]
fn reduce_closed_forms() {
    // buffer r holds r + 1 + i / 1024 (exact in f32): sum = n(n+1)/2 + n i / 1024
    let n = 5usize;
    let len = 1000;
    let bufs: Vec<Vec<f32>> = (0..n).map(|r| (0..len).map(|i| (r + 1) as f32 + i as f32 / 1024.0).collect()).collect();
    let srcs: Vec<&[f32]> = bufs.iter().map(|b| b.as_slice()).collect();
    let mut dst = vec![f32::NAN; len];
    for op in ReduceOp::ALL {
        r::reduce(op, &srcs, &mut dst).unwrap();
        for (i, &d) in dst.iter().enumerate() {
            let x = i as f32 / 1024.0;
            let want = match op {
                ReduceOp::Sum => 15.0 + 5.0 * x,
                ReduceOp::Mean => 3.0 + x,
                ReduceOp::Max => 5.0 + x,
                ReduceOp::Min => 1.0 + x,
            };
            assert_eq!(d, want, "{op:?} at {i}");
        }
    }
}

#[test]
fn reduce_sums_in_replica_order() {
    // 1e8 + 1 - 1e8 = 0 in f32 left to right (1e8 + 1 rounds to 1e8), 1 in another order
    let (a, b, c) = ([1e8f32], [1.0f32], [-1e8f32]);
    let mut d = [f32::NAN];
    r::reduce(ReduceOp::Sum, &[&a, &b, &c], &mut d).unwrap();
    assert_eq!(d[0], 0.0);
    r::reduce(ReduceOp::Sum, &[&a, &c, &b], &mut d).unwrap();
    assert_eq!(d[0], 1.0);
    // one buffer: a copy (mean divides by 1)
    for op in ReduceOp::ALL {
        let mut out = [0.0f32; 2];
        r::reduce(op, &[&[1.5f32, -0.0][..]], &mut out).unwrap();
        assert_eq!(out.map(f32::to_bits), [1.5f32.to_bits(), (-0.0f32).to_bits()], "{op:?}");
    }
}

#[test]
fn reduce_nan_and_tie_semantics() {
    let nan_payload = f32::from_bits(0x7FC0_1234);
    let neg_nan = f32::from_bits(0xFFC0_0001);
    let a = [1.0f32, nan_payload, 2.0, -0.0, 0.0, f32::INFINITY];
    let b = [neg_nan, 3.0, 2.0, 0.0, -0.0, f32::NEG_INFINITY];
    let mut d = [0.0f32; 6];
    for op in ReduceOp::ALL {
        r::reduce(op, &[&a, &b], &mut d).unwrap();
        // NaN in, canonical NaN out, for every op; inf + -inf too
        assert_eq!(d[0].to_bits(), CANONICAL_NAN, "{op:?}");
        assert_eq!(d[1].to_bits(), CANONICAL_NAN, "{op:?}");
        match op {
            ReduceOp::Sum | ReduceOp::Mean => {
                assert_eq!(d[5].to_bits(), CANONICAL_NAN);
                assert_eq!(d[3].to_bits(), 0.0f32.to_bits()); // -0 + 0 = +0
            }
            ReduceOp::Max | ReduceOp::Min => {
                // ties keep the earlier replica's value
                assert_eq!(d[3].to_bits(), (-0.0f32).to_bits(), "{op:?}");
                assert_eq!(d[4].to_bits(), 0.0f32.to_bits(), "{op:?}");
                assert_eq!(d[2], 2.0);
            }
        }
    }
    r::reduce(ReduceOp::Max, &[&a, &b], &mut d).unwrap();
    assert_eq!(d[5], f32::INFINITY);
    r::reduce(ReduceOp::Min, &[&a, &b], &mut d).unwrap();
    assert_eq!(d[5], f32::NEG_INFINITY);
    // NaN is sticky whichever replica it comes from
    let mut one = [0.0f32];
    r::reduce(ReduceOp::Max, &[&[f32::NAN][..], &[5.0][..], &[7.0][..]], &mut one).unwrap();
    assert_eq!(one[0].to_bits(), CANONICAL_NAN);
    r::reduce(ReduceOp::Min, &[&[5.0][..], &[7.0][..], &[f32::NAN][..]], &mut one).unwrap();
    assert_eq!(one[0].to_bits(), CANONICAL_NAN);
}

#[test]
fn reduce_validates_like_the_launcher() {
    let a = [1.0f32; 3];
    let (k, d) = invalid_detail(r::reduce(ReduceOp::Sum, &[], &mut [0.0; 3]).unwrap_err());
    assert_eq!((k, d.as_str()), ("strata_reduce_f32", "no buffers to reduce: a reduction needs at least one"));
    let (_, d) = invalid_detail(r::reduce(ReduceOp::Sum, &[&a, &a[..2]], &mut [0.0; 3]).unwrap_err());
    assert_eq!(d, "source 1 has 2 elements, the destination 3");
    // empty buffers: valid, nothing to do
    r::reduce(ReduceOp::Mean, &[&[][..], &[][..]], &mut []).unwrap();
}

#[test]
fn allreduce_chunk_writes_the_reduction_into_every_buffer() {
    let n = 4;
    let len = 103;
    let orig: Vec<Vec<f32>> = (0..n).map(|b| random(len, 40 + b as u64)).collect();
    for op in ReduceOp::ALL {
        let mut bufs = orig.clone();
        let (off, clen) = (17, 50);
        {
            let mut views: Vec<&mut [f32]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            r::allreduce_chunk(op, &mut views, off, clen).unwrap();
        }
        let srcs: Vec<&[f32]> = orig.iter().map(|b| b.as_slice()).collect();
        let mut want = vec![0.0f32; len];
        r::reduce(op, &srcs, &mut want).unwrap();
        for (b, buf) in bufs.iter().enumerate() {
            for i in 0..len {
                let expected = if (off..off + clen).contains(&i) { want[i] } else { orig[b][i] };
                assert_eq!(buf[i].to_bits(), expected.to_bits(), "{op:?} buffer {b} element {i}");
            }
        }
    }
    // chunks of every "device" in turn: every buffer ends up with the full reduction
    let mut bufs = orig.clone();
    let chunks = [(0, 26), (26, 26), (52, 26), (78, 25)];
    for (off, clen) in chunks {
        let mut views: Vec<&mut [f32]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        r::allreduce_chunk(ReduceOp::Sum, &mut views, off, clen).unwrap();
    }
    let srcs: Vec<&[f32]> = orig.iter().map(|b| b.as_slice()).collect();
    let mut want = vec![0.0f32; len];
    r::reduce(ReduceOp::Sum, &srcs, &mut want).unwrap();
    for buf in &bufs {
        assert_eq!(buf, &want);
    }
}

#[test]
fn allreduce_chunk_validates_like_the_launcher() {
    let mut a = vec![0.0f32; 10];
    let mut b = vec![0.0f32; 10];
    let mut c = vec![0.0f32; 9];
    let (k, d) = invalid_detail(r::allreduce_chunk(ReduceOp::Sum, &mut [&mut a, &mut b], 5, 6).unwrap_err());
    assert_eq!(k, "strata_allreduce_chunk_f32");
    assert_eq!(d, "chunk [5, 5 + 6) does not lie inside buffers of 10 elements");
    let (_, d) = invalid_detail(r::allreduce_chunk(ReduceOp::Sum, &mut [&mut a, &mut c], 0, 1).unwrap_err());
    assert_eq!(d, "buffer 1 has 9 elements, buffer 0 has 10");
    assert!(r::allreduce_chunk(ReduceOp::Sum, &mut [], 0, 0).is_err());
    r::allreduce_chunk(ReduceOp::Sum, &mut [&mut a, &mut b], 10, 0).unwrap();
}

#[test]
fn axpy_and_scale() {
    let src: Vec<f32> = (0..100).map(|i| i as f32).collect();
    let mut dst: Vec<f32> = (0..100).map(|i| 0.5 * i as f32).collect();
    r::axpy(-0.5, &src, &mut dst).unwrap();
    assert!(dst.iter().all(|&x| x == 0.0));
    r::axpy(2.0, &src, &mut dst).unwrap();
    assert_eq!(dst, (0..100).map(|i| 2.0 * i as f32).collect::<Vec<_>>());
    let mut out = vec![f32::NAN; 100];
    r::scale(0.25, &src, &mut out).unwrap();
    assert_eq!(out, (0..100).map(|i| i as f32 / 4.0).collect::<Vec<_>>());
    // no FMA: with x = 1 + 2^-12, x * x rounds to 1 + 2^-11 (a tie, to even), so
    // -(x * x) + x * x is 0 with two roundings, and 2^-24 with a fused multiply-add
    let x = 1.0f32 + 1.0 / 4096.0;
    let mut d = [-(x * x)];
    r::axpy(x, &[x], &mut d).unwrap();
    assert_eq!(d[0].to_bits(), 0.0f32.to_bits());
    assert_eq!(x.mul_add(x, -(x * x)), 1.0 / 16_777_216.0);
    let (k, d) = invalid_detail(r::axpy(1.0, &[1.0; 3], &mut [0.0; 4]).unwrap_err());
    assert_eq!((k, d.as_str()), ("strata_axpy_f32", "src has 3 elements, dst has 4"));
    let (k, _) = invalid_detail(r::scale(1.0, &[1.0; 3], &mut [0.0; 4]).unwrap_err());
    assert_eq!(k, "strata_scale_f32");
}

/// Specials and values around the rounding boundaries of bf16 and f16.
fn f32_specials() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7F80_0001), // signalling NaN
        f32::from_bits(0xFFBF_FFFF),
        f32::from_bits(0x7FC0_1234),
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        f32::from_bits(1), // smallest subnormal
        65504.0,           // f16 max
        65520.0,           // rounds to f16 infinity
        65519.99,
        6.1035156e-5, // f16 min normal
        5.9604645e-8, // f16 min subnormal
        2.9802322e-8, // half of it: ties to even, to zero
        2.9802326e-8, // just above: rounds up
    ];
    // neighbours of every bf16 / f16 tie: x.5 ulp, below and above, even and odd
    for base in [0x3F80_0000u32, 0x3F81_0000, 0x4780_0000, 0x3380_0000, 0x0080_0000] {
        for low in [0x7FFFu32, 0x8000, 0x8001, 0x18000, 0x17FFF, 0x0FFF, 0x1000, 0x1001, 0x3000, 0x2FFF] {
            v.push(f32::from_bits(base + low));
            v.push(-f32::from_bits(base + low));
        }
    }
    v
}

#[test]
fn casts_equal_the_half_crate() {
    // every 16-bit pattern to f32
    for bits in 0..=u16::MAX {
        let want_bf = half::bf16::from_bits(bits).to_f32();
        assert_eq!(r::bf16_bits_to_f32(bits).to_bits(), want_bf.to_bits(), "bf16 {bits:#06x}");
        let want_h = half::f16::from_bits(bits).to_f32();
        assert_eq!(r::f16_bits_to_f32(bits).to_bits(), want_h.to_bits(), "f16 {bits:#06x}");
    }
    // f32 to 16 bits: the specials, a stride through all 2^32 patterns, random values
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let strided = (0..=u32::MAX).step_by(65_537 * 3).map(f32::from_bits);
    let randoms = (0..200_000).map(|_| f32::from_bits(rng.random::<u32>()));
    let small = (0..200_000).map(|i| (i as f32 - 100_000.0) * 1.3e-6);
    for x in f32_specials().into_iter().chain(strided).chain(randoms).chain(small) {
        assert_eq!(r::f32_to_bf16_bits(x), half::bf16::from_f32(x).to_bits(), "bf16 of {x:e} ({:#010x})", x.to_bits());
        assert_eq!(r::f32_to_f16_bits(x), half::f16::from_f32(x).to_bits(), "f16 of {x:e} ({:#010x})", x.to_bits());
    }
}

#[test]
fn casts_round_to_nearest_even_and_keep_nans() {
    // 1 + 2^-8 is a bf16 tie between 1 and 1 + 2^-7: even is 1
    assert_eq!(r::f32_to_bf16_bits(1.0 + 1.0 / 256.0), 0x3F80);
    // 1 + 3 * 2^-8 ties between 1 + 2^-7 (odd) and 1 + 2^-6 (even)
    assert_eq!(r::f32_to_bf16_bits(1.0 + 3.0 / 256.0), 0x3F82);
    assert_eq!(r::f32_to_f16_bits(65520.0), 0x7C00);
    assert_eq!(r::f32_to_f16_bits(-1e-10), 0x8000);
    // NaN: still a NaN, quiet, with its sign and the top of its payload
    let snan = f32::from_bits(0xFF80_4000);
    let b = r::f32_to_bf16_bits(snan);
    assert!(half::bf16::from_bits(b).is_nan());
    assert_eq!(b, 0xFFC0);
    let h = r::f32_to_f16_bits(f32::from_bits(0x7FA0_0000));
    assert_eq!(h, 0x7C00 | 0x0200 | 0x0100); // quiet bit, payload 0x0020_0000 >> 13
    assert!(r::bf16_bits_to_f32(0x7F81).is_nan());
    assert!(r::f16_bits_to_f32(0xFC01).is_nan() && r::f16_bits_to_f32(0xFC01).is_sign_negative());
    // round trips of every representable value
    for bits in 0..=u16::MAX {
        let hb = half::f16::from_bits(bits);
        if !hb.is_nan() {
            assert_eq!(r::f32_to_f16_bits(r::f16_bits_to_f32(bits)), bits);
        }
        if !half::bf16::from_bits(bits).is_nan() {
            assert_eq!(r::f32_to_bf16_bits(r::bf16_bits_to_f32(bits)), bits);
        }
    }
    // the slice forms validate
    let mut out = [0u16; 2];
    r::f32_to_bf16(&[1.0, 2.0], &mut out).unwrap();
    assert_eq!(out, [0x3F80, 0x4000]);
    let (k, d) = invalid_detail(r::f32_to_f16(&[1.0], &mut out).unwrap_err());
    assert_eq!((k, d.as_str()), ("strata_f32_to_f16", "src has 1 elements, dst has 2"));
    let mut back = [0.0f32; 2];
    r::bf16_to_f32(&out, &mut back).unwrap();
    assert_eq!(back, [1.0, 2.0]);
    r::f16_to_f32(&[0x3C00, 0xC000], &mut back).unwrap();
    assert_eq!(back, [1.0, -2.0]);
}

/// Runs `steps` steps of a strata-core optimizer on one variable with fixed random gradients;
/// returns the variable after each step, and the gradients.
fn run_core<O: Optimizer>(cfg: O::Config, init: &[f32], steps: usize) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let dev = Device::Cpu;
    let v = Var::from_vec(init.to_vec(), init.len(), &dev).unwrap();
    let mut opt = O::new(vec![v.clone()], cfg).unwrap();
    let mut after = Vec::new();
    let mut grads_used = Vec::new();
    for s in 0..steps {
        let g = random(init.len(), 1000 + s as u64);
        let mut grads = candle_core::backprop::GradStore::default();
        grads.insert(v.as_tensor(), Tensor::from_vec(g.clone(), init.len(), &dev).unwrap());
        opt.step(&grads).unwrap();
        after.push(v.as_tensor().to_vec1::<f32>().unwrap());
        grads_used.push(g);
    }
    (after, grads_used)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn sgd_is_bitwise_fused_sgd() {
    let init = random(1001, 1);
    for lr in [0.3f64, 1e-3, 0.0] {
        let (after, grads) = run_core::<strata_core::optim::FusedSgd>(lr, &init, 10);
        let mut p = init.clone();
        for (want, g) in after.iter().zip(&grads) {
            r::sgd(lr as f32, &mut p, g).unwrap();
            assert_eq!(bits(&p), bits(want), "lr {lr}");
        }
    }
    let (k, d) = invalid_detail(r::sgd(0.1, &mut [0.0; 2], &[0.0; 3]).unwrap_err());
    assert_eq!((k, d.as_str()), ("strata_sgd_f32", "grad has 3 elements, param has 2"));
}

#[test]
fn sgd_momentum_closed_form_and_zero_momentum_is_sgd() {
    // constant gradient g, momentum mu: velocity after t steps is g (1 + mu + ... + mu^(t-1))
    let (lr, mu, g) = (0.5f32, 0.5f32, 1.0f32);
    let mut p = [10.0f32];
    let mut v = [0.0f32];
    let mut want = 10.0f32;
    for t in 1..=6 {
        r::sgd_momentum(lr, mu, &mut p, &[g], &mut v).unwrap();
        let vel = (1.0 - mu.powi(t)) / (1.0 - mu) * g; // exact for these powers of two
        assert_eq!(v[0], vel);
        want -= lr * vel;
        assert_eq!(p[0], want);
    }
    // momentum 0 equals plain SGD bit for bit
    let init = random(500, 2);
    let (mut a, mut b) = (init.clone(), init.clone());
    let mut vel = vec![0.0f32; 500];
    for s in 0..5 {
        let g = random(500, 50 + s);
        r::sgd(0.1, &mut a, &g).unwrap();
        r::sgd_momentum(0.1, 0.0, &mut b, &g, &mut vel).unwrap();
        assert_eq!(bits(&a), bits(&b));
    }
    let (k, d) = invalid_detail(r::sgd_momentum(0.1, 0.9, &mut [0.0; 2], &[0.0; 2], &mut [0.0; 1]).unwrap_err());
    assert_eq!((k, d.as_str()), ("strata_sgd_momentum_f32", "velocity has 1 elements, param has 2"));
}

#[test]
fn adamw_is_bitwise_fused_adamw() {
    let init = random(1001, 3);
    let configs = [
        ParamsAdamW::default(),
        ParamsAdamW { lr: 0.05, weight_decay: 0.1, ..Default::default() },
        ParamsAdamW { lr: 0.2, beta1: 0.5, beta2: 0.7, eps: 1e-3, weight_decay: 0.0 },
    ];
    for cfg in configs {
        let (after, grads) = run_core::<strata_core::optim::FusedAdamW>(cfg.clone(), &init, 12);
        let mut p = init.clone();
        let (mut m, mut v) = (vec![0.0f32; init.len()], vec![0.0f32; init.len()]);
        for (t, (want, g)) in after.iter().zip(&grads).enumerate() {
            let s = AdamWScalars::new(cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, t + 1);
            r::adamw(&s, &mut p, g, &mut m, &mut v).unwrap();
            assert_eq!(bits(&p), bits(want), "{cfg:?} step {}", t + 1);
        }
    }
    let s = AdamWScalars::new(1e-3, 0.9, 0.999, 1e-8, 0.01, 1);
    let (k, d) = invalid_detail(r::adamw(&s, &mut [0.0; 2], &[0.0; 2], &mut [0.0; 2], &mut [0.0; 3]).unwrap_err());
    assert_eq!((k, d.as_str()), ("strata_adamw_f32", "v has 3 elements, param has 2"));
}

#[test]
fn adamw_scalars_of_the_first_step() {
    let s = AdamWScalars::new(0.1, 0.5, 0.75, 1e-8, 0.5, 1);
    assert_eq!((s.beta1, s.one_minus_beta1, s.beta2, s.one_minus_beta2), (0.5, 0.5, 0.75, 0.25));
    assert_eq!((s.scale_m, s.scale_v), (2.0, 4.0));
    assert_eq!(s.keep, (1.0f64 - 0.05) as f32);
    assert_eq!(s.lr, 0.1f32);
}

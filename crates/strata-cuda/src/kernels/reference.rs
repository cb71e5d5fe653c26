//! CPU references of the kernels: the same contract (arguments, validation through
//! [`validate`], errors) and the same f32 operations in the same order as
//! `kernels/*.cu`, so a kernel's output equals its reference bit for bit (see the module
//! [`kernels`](super) for the NaN payload exception). Rust never contracts `a * b + c` into an
//! FMA, and the kernels use `_rn` intrinsics, so neither side fuses.
//!
//! 16-bit floats are passed as their bits (`u16`), as the kernels take them; the conversions
//! are the `half` crate's, which `cast.cu` matches bit for bit (the crate's slice conversions
//! use the CPU's F16C instructions where there are some: 4-6x faster than a loop of our own for
//! f16, `docs/bench/2026-12-02-half-conversion.md`).

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use strata_core::optim::rules;
use strata_core::ReduceOp;

use super::{validate, AdamWScalars, CANONICAL_NAN};
use crate::Result;

fn combine(op: ReduceOp, acc: f32, x: f32) -> f32 {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => acc + x,
        ReduceOp::Max => {
            if x > acc || x.is_nan() {
                x
            } else {
                acc
            }
        }
        ReduceOp::Min => {
            if x < acc || x.is_nan() {
                x
            } else {
                acc
            }
        }
    }
}

fn finish(op: ReduceOp, acc: f32, n: u32) -> f32 {
    let acc = if op == ReduceOp::Mean { acc / n as f32 } else { acc };
    if acc.is_nan() {
        f32::from_bits(CANONICAL_NAN)
    } else {
        acc
    }
}

/// One element of a reduction: `srcs` yields the inputs in replica order.
fn reduce_one(op: ReduceOp, n: u32, mut values: impl Iterator<Item = f32>) -> f32 {
    let first = values.next().expect("validated: at least one buffer");
    finish(op, values.fold(first, |acc, x| combine(op, acc, x)), n)
}

/// `strata_reduce_f32`: `dst[i] = op(srcs[0][i], srcs[1][i], ...)`, in replica order; every NaN
/// result is the canonical NaN. At least one source, every source as long as `dst`.
pub fn reduce(op: ReduceOp, srcs: &[&[f32]], dst: &mut [f32]) -> Result<()> {
    let lens: Vec<usize> = srcs.iter().map(|s| s.len()).collect();
    let n = validate::reduce("strata_reduce_f32", &lens, dst.len())?;
    for (i, d) in dst.iter_mut().enumerate() {
        *d = reduce_one(op, n, srcs.iter().map(|s| s[i]));
    }
    Ok(())
}

/// `strata_allreduce_chunk_f32`: reduces elements `[off, off + len)` of every buffer (as
/// [`reduce`] does) and writes the result into every buffer at those elements. At least one
/// buffer, all of the same length, the chunk inside them.
pub fn allreduce_chunk(op: ReduceOp, bufs: &mut [&mut [f32]], off: usize, len: usize) -> Result<()> {
    let lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
    let n = validate::allreduce_chunk("strata_allreduce_chunk_f32", &lens, off, len)?;
    for i in off..off + len {
        let r = reduce_one(op, n, bufs.iter().map(|b| b[i]));
        for b in bufs.iter_mut() {
            b[i] = r;
        }
    }
    Ok(())
}

/// `strata_axpy_f32`: `dst[i] = dst[i] + alpha * src[i]` (two rounded operations).
pub fn axpy(alpha: f32, src: &[f32], dst: &mut [f32]) -> Result<()> {
    validate::same_len("strata_axpy_f32", &[("dst", dst.len()), ("src", src.len())])?;
    dst.iter_mut().zip(src).for_each(|(d, s)| *d += alpha * *s);
    Ok(())
}

/// `strata_scale_f32`: `dst[i] = alpha * src[i]`.
pub fn scale(alpha: f32, src: &[f32], dst: &mut [f32]) -> Result<()> {
    validate::same_len("strata_scale_f32", &[("dst", dst.len()), ("src", src.len())])?;
    dst.iter_mut().zip(src).for_each(|(d, s)| *d = alpha * *s);
    Ok(())
}

/// f32 to bf16 bits: round to nearest even, NaN kept (quiet, sign and top payload bits).
pub fn f32_to_bf16_bits(value: f32) -> u16 {
    half::bf16::from_f32(value).to_bits()
}

/// bf16 bits to f32, exact (a NaN is made quiet).
pub fn bf16_bits_to_f32(i: u16) -> f32 {
    half::bf16::from_bits(i).to_f32()
}

/// f32 to f16 bits: round to nearest even, overflow to infinity, subnormals, NaN kept.
pub fn f32_to_f16_bits(value: f32) -> u16 {
    half::f16::from_f32(value).to_bits()
}

/// f16 bits to f32, exact (subnormals normalised, a NaN made quiet).
pub fn f16_bits_to_f32(i: u16) -> f32 {
    half::f16::from_bits(i).to_f32()
}

/// `strata_f32_to_bf16`.
pub fn f32_to_bf16(src: &[f32], dst: &mut [u16]) -> Result<()> {
    validate::same_len("strata_f32_to_bf16", &[("dst", dst.len()), ("src", src.len())])?;
    dst.reinterpret_cast_mut::<half::bf16>().convert_from_f32_slice(src);
    Ok(())
}

/// `strata_f32_to_f16`.
pub fn f32_to_f16(src: &[f32], dst: &mut [u16]) -> Result<()> {
    validate::same_len("strata_f32_to_f16", &[("dst", dst.len()), ("src", src.len())])?;
    dst.reinterpret_cast_mut::<half::f16>().convert_from_f32_slice(src);
    Ok(())
}

/// `strata_bf16_to_f32`.
pub fn bf16_to_f32(src: &[u16], dst: &mut [f32]) -> Result<()> {
    validate::same_len("strata_bf16_to_f32", &[("dst", dst.len()), ("src", src.len())])?;
    src.reinterpret_cast::<half::bf16>().convert_to_f32_slice(dst);
    Ok(())
}

/// `strata_f16_to_f32`.
pub fn f16_to_f32(src: &[u16], dst: &mut [f32]) -> Result<()> {
    validate::same_len("strata_f16_to_f32", &[("dst", dst.len()), ("src", src.len())])?;
    src.reinterpret_cast::<half::f16>().convert_to_f32_slice(dst);
    Ok(())
}

/// `strata_sgd_f32`: `param = param - (grad * lr + 0)` ([`rules::sgd`]), strata-core's
/// `FusedSgd` (candle-nn's `SGD`) on one variable.
pub fn sgd(lr: f32, param: &mut [f32], grad: &[f32]) -> Result<()> {
    validate::same_len("strata_sgd_f32", &[("param", param.len()), ("grad", grad.len())])?;
    param.iter_mut().zip(grad).for_each(|(t, g)| rules::sgd(t, *g, lr));
    Ok(())
}

/// `strata_sgd_momentum_f32`: `velocity = velocity * momentum + grad`, then
/// `param = param - (velocity * lr + 0)` ([`rules::momentum`]: heavy ball, no dampening; the
/// velocity starts at zero), the parameter server's momentum on one variable.
pub fn sgd_momentum(lr: f32, momentum: f32, param: &mut [f32], grad: &[f32], velocity: &mut [f32]) -> Result<()> {
    validate::same_len(
        "strata_sgd_momentum_f32",
        &[("param", param.len()), ("grad", grad.len()), ("velocity", velocity.len())],
    )?;
    for ((t, g), v) in param.iter_mut().zip(grad).zip(velocity.iter_mut()) {
        rules::momentum(t, v, *g, lr, momentum);
    }
    Ok(())
}

/// `strata_adamw_f32`: one step of strata-core's `FusedAdamW` (candle-nn's `AdamW`) on one
/// variable in one pass ([`rules::adamw`], as the CPU's `FusedAdamW` computes it); `s` from [`AdamWScalars::new`].
pub fn adamw(s: &AdamWScalars, param: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32]) -> Result<()> {
    validate::same_len(
        "strata_adamw_f32",
        &[("param", param.len()), ("grad", grad.len()), ("m", m.len()), ("v", v.len())],
    )?;
    for (((t, g), m), v) in param.iter_mut().zip(grad).zip(m.iter_mut()).zip(v.iter_mut()) {
        rules::adamw(t, m, v, *g, s);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // The conversions as they were before they were the `half` crate's (a copy of its software
    // fallback), kept as the oracle of the test below.
    /// f32 to bf16 bits: round to nearest even, NaN kept (quiet, sign and top payload bits).
    fn old_f32_to_bf16_bits(value: f32) -> u16 {
        let x = value.to_bits();
        if x & 0x7FFF_FFFF > 0x7F80_0000 {
            return ((x >> 16) | 0x0040) as u16;
        }
        let round_bit = 0x0000_8000u32;
        if (x & round_bit) != 0 && (x & (3 * round_bit - 1)) != 0 {
            ((x >> 16) + 1) as u16
        } else {
            (x >> 16) as u16
        }
    }

    /// bf16 bits to f32, exact (a NaN is made quiet).
    fn old_bf16_bits_to_f32(i: u16) -> f32 {
        let b = u32::from(i);
        if b & 0x7FFF > 0x7F80 {
            f32::from_bits((b | 0x0040) << 16)
        } else {
            f32::from_bits(b << 16)
        }
    }

    /// f32 to f16 bits: round to nearest even, overflow to infinity, subnormals, NaN kept.
    fn old_f32_to_f16_bits(value: f32) -> u16 {
        let x = value.to_bits();
        let sign = x & 0x8000_0000;
        let exp = x & 0x7F80_0000;
        let man = x & 0x007F_FFFF;
        if exp == 0x7F80_0000 {
            let nan_bit = if man == 0 { 0 } else { 0x0200 };
            return ((sign >> 16) | 0x7C00 | nan_bit | (man >> 13)) as u16;
        }
        let half_sign = sign >> 16;
        let half_exp = (exp >> 23) as i32 - 127 + 15;
        if half_exp >= 0x1F {
            return (half_sign | 0x7C00) as u16;
        }
        if half_exp <= 0 {
            if 14 - half_exp > 24 {
                return half_sign as u16;
            }
            let m = man | 0x0080_0000;
            let mut half_man = m >> (14 - half_exp);
            let round_bit = 1u32 << (13 - half_exp);
            if (m & round_bit) != 0 && (m & (3 * round_bit - 1)) != 0 {
                half_man += 1;
            }
            return (half_sign | half_man) as u16;
        }
        let bits = half_sign | ((half_exp as u32) << 10) | (man >> 13);
        let round_bit = 0x0000_1000u32;
        if (man & round_bit) != 0 && (man & (3 * round_bit - 1)) != 0 {
            (bits + 1) as u16
        } else {
            bits as u16
        }
    }

    /// f16 bits to f32, exact (subnormals normalised, a NaN made quiet).
    fn old_f16_bits_to_f32(i: u16) -> f32 {
        let h = u32::from(i);
        if h & 0x7FFF == 0 {
            return f32::from_bits(h << 16);
        }
        let half_sign = h & 0x8000;
        let half_exp = h & 0x7C00;
        let half_man = h & 0x03FF;
        if half_exp == 0x7C00 {
            if half_man == 0 {
                return f32::from_bits((half_sign << 16) | 0x7F80_0000);
            }
            return f32::from_bits((half_sign << 16) | 0x7FC0_0000 | (half_man << 13));
        }
        let sign = half_sign << 16;
        if half_exp == 0 {
            let e = (half_man.leading_zeros() as i32 - 16) - 6;
            let exp32 = ((127 - 15 - e) as u32) << 23;
            let man32 = (half_man << (14 + e)) & 0x7F_FFFF;
            return f32::from_bits(sign | exp32 | man32);
        }
        let unbiased = (half_exp as i32 >> 10) - 15;
        f32::from_bits(sign | (((unbiased + 127) as u32) << 23) | (half_man << 13))
    }

    #[test]
    fn conversions_are_the_old_ones_bit_for_bit() {
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let (mut bf, mut h) = (vec![0f32; all.len()], vec![0f32; all.len()]);
        bf16_to_f32(&all, &mut bf).unwrap();
        f16_to_f32(&all, &mut h).unwrap();
        for (&b, (x, y)) in all.iter().zip(bf.iter().zip(&h)) {
            assert_eq!(x.to_bits(), old_bf16_bits_to_f32(b).to_bits(), "bf16 {b:#06x}");
            assert_eq!(y.to_bits(), old_f16_bits_to_f32(b).to_bits(), "f16 {b:#06x}");
            assert_eq!(bf16_bits_to_f32(b).to_bits(), x.to_bits(), "bf16 {b:#06x}, one at a time");
            assert_eq!(f16_bits_to_f32(b).to_bits(), y.to_bits(), "f16 {b:#06x}, one at a time");
        }
        // Every upper half with the lower halves around bf16's and f16's rounding points
        // (ties, just off them, the extremes): zeros, subnormals of both formats, f16's
        // overflow, infinities, quiet and signalling NaNs. Every f32 was compared once, in
        // the measurement's throwaway program.
        let lows = [0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x3000, 0x7FFF, 0x8000, 0x8001, 0xFFFF];
        let xs: Vec<f32> = (0..=u16::MAX)
            .flat_map(|hi| lows.iter().map(move |lo| f32::from_bits((u32::from(hi) << 16) | lo)))
            .collect();
        let (mut bf, mut h) = (vec![0u16; xs.len()], vec![0u16; xs.len()]);
        f32_to_bf16(&xs, &mut bf).unwrap();
        f32_to_f16(&xs, &mut h).unwrap();
        for (x, (b, f)) in xs.iter().zip(bf.iter().zip(&h)) {
            assert_eq!(*b, old_f32_to_bf16_bits(*x), "bf16 of {:#010x}", x.to_bits());
            assert_eq!(*f, old_f32_to_f16_bits(*x), "f16 of {:#010x}", x.to_bits());
            assert_eq!(f32_to_bf16_bits(*x), *b, "bf16 of {:#010x}, one at a time", x.to_bits());
            assert_eq!(f32_to_f16_bits(*x), *f, "f16 of {:#010x}, one at a time", x.to_bits());
        }
    }
}

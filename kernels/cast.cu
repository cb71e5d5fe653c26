// Casts between f32 and the 16-bit floats of compressed reduction (bf16, f16), done on the bits
// so that they equal the `half` crate's conversions (and strata_cuda::kernels::reference) bit for
// bit, NaN payloads included:
//   - f32 -> bf16 and f32 -> f16 round to nearest, ties to even; overflow gives infinity, f16
//     underflow gives subnormals or a signed zero;
//   - a NaN stays a NaN with its sign and the top bits of its payload, and is made quiet;
//   - bf16 -> f32 and f16 -> f32 are exact (f16 subnormals are normalised).
// 16-bit values are passed as their bits (unsigned short). Self-contained (no #include, the
// hardware cvt instructions would canonicalise NaNs), compiled by NVRTC.

typedef unsigned long long u64;

__device__ __forceinline__ u64 strata_tid() {
    return (u64)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ u64 strata_threads() {
    return (u64)gridDim.x * blockDim.x;
}

__device__ __forceinline__ unsigned short strata_f32_to_bf16_bits(float value) {
    const unsigned int x = __float_as_uint(value);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
        return (unsigned short)((x >> 16) | 0x0040u);
    }
    const unsigned int round_bit = 0x00008000u;
    if ((x & round_bit) != 0 && (x & (3 * round_bit - 1)) != 0) {
        return (unsigned short)((x >> 16) + 1);
    }
    return (unsigned short)(x >> 16);
}

__device__ __forceinline__ float strata_bf16_bits_to_f32(unsigned short i) {
    const unsigned int b = i;
    if ((b & 0x7FFFu) > 0x7F80u) {
        return __uint_as_float((b | 0x0040u) << 16);
    }
    return __uint_as_float(b << 16);
}

__device__ __forceinline__ unsigned short strata_f32_to_f16_bits(float value) {
    const unsigned int x = __float_as_uint(value);
    const unsigned int sign = x & 0x80000000u;
    const unsigned int exp = x & 0x7F800000u;
    const unsigned int man = x & 0x007FFFFFu;
    if (exp == 0x7F800000u) {
        const unsigned int nan_bit = man == 0 ? 0u : 0x0200u;
        return (unsigned short)((sign >> 16) | 0x7C00u | nan_bit | (man >> 13));
    }
    const unsigned int half_sign = sign >> 16;
    const int half_exp = ((int)(exp >> 23)) - 127 + 15;
    if (half_exp >= 0x1F) {
        return (unsigned short)(half_sign | 0x7C00u);
    }
    if (half_exp <= 0) {
        if (14 - half_exp > 24) {
            return (unsigned short)half_sign;
        }
        const unsigned int m = man | 0x00800000u;
        unsigned int half_man = m >> (14 - half_exp);
        const unsigned int round_bit = 1u << (13 - half_exp);
        if ((m & round_bit) != 0 && (m & (3 * round_bit - 1)) != 0) {
            half_man += 1;
        }
        return (unsigned short)(half_sign | half_man);
    }
    const unsigned int bits = half_sign | ((unsigned int)half_exp << 10) | (man >> 13);
    const unsigned int round_bit = 0x00001000u;
    if ((man & round_bit) != 0 && (man & (3 * round_bit - 1)) != 0) {
        return (unsigned short)(bits + 1);
    }
    return (unsigned short)bits;
}

__device__ __forceinline__ float strata_f16_bits_to_f32(unsigned short i) {
    const unsigned int h = i;
    if ((h & 0x7FFFu) == 0) {
        return __uint_as_float(h << 16);
    }
    const unsigned int half_sign = h & 0x8000u;
    const unsigned int half_exp = h & 0x7C00u;
    const unsigned int half_man = h & 0x03FFu;
    if (half_exp == 0x7C00u) {
        if (half_man == 0) {
            return __uint_as_float((half_sign << 16) | 0x7F800000u);
        }
        return __uint_as_float((half_sign << 16) | 0x7FC00000u | (half_man << 13));
    }
    const unsigned int sign = half_sign << 16;
    if (half_exp == 0) {
        // leading zeros of half_man as a 16-bit number, minus the 6 bits of sign and exponent
        const int e = (__clz(half_man) - 16) - 6;
        const unsigned int exp32 = (unsigned int)(127 - 15 - e) << 23;
        const unsigned int man32 = (half_man << (14 + e)) & 0x7FFFFFu;
        return __uint_as_float(sign | exp32 | man32);
    }
    const int unbiased = ((int)half_exp >> 10) - 15;
    const unsigned int exp32 = (unsigned int)(unbiased + 127) << 23;
    return __uint_as_float(sign | exp32 | (half_man << 13));
}

extern "C" __global__ void strata_f32_to_bf16(const float* src, unsigned short* dst, u64 len) {
    for (u64 i = strata_tid(); i < len; i += strata_threads()) {
        dst[i] = strata_f32_to_bf16_bits(src[i]);
    }
}

extern "C" __global__ void strata_f32_to_f16(const float* src, unsigned short* dst, u64 len) {
    for (u64 i = strata_tid(); i < len; i += strata_threads()) {
        dst[i] = strata_f32_to_f16_bits(src[i]);
    }
}

extern "C" __global__ void strata_bf16_to_f32(const unsigned short* src, float* dst, u64 len) {
    for (u64 i = strata_tid(); i < len; i += strata_threads()) {
        dst[i] = strata_bf16_bits_to_f32(src[i]);
    }
}

extern "C" __global__ void strata_f16_to_f32(const unsigned short* src, float* dst, u64 len) {
    for (u64 i = strata_tid(); i < len; i += strata_threads()) {
        dst[i] = strata_f16_bits_to_f32(src[i]);
    }
}

// Scaled accumulate and scale, in f32:
//   strata_axpy_f32:  dst[i] = dst[i] + alpha * src[i]   (__fmul_rn then __fadd_rn: never an FMA)
//   strata_scale_f32: dst[i] = alpha * src[i]            (dst may equal src: in-place scaling)
//
// Self-contained (no #include), compiled by NVRTC. Results equal strata_cuda::kernels::reference
// bit for bit, except that a NaN result's payload is unspecified (CPUs and GPUs propagate NaN
// payloads differently). The _v4 variants need dst and src 16-byte aligned (checked on the host);
// the len % 4 tail is done element by element.

typedef unsigned long long u64;

__device__ __forceinline__ u64 strata_tid() {
    return (u64)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ u64 strata_threads() {
    return (u64)gridDim.x * blockDim.x;
}

__device__ __forceinline__ float strata_axpy1(float d, float s, float alpha) {
    return __fadd_rn(d, __fmul_rn(alpha, s));
}

extern "C" __global__ void strata_axpy_f32(float* dst, const float* src, float alpha, u64 len) {
    for (u64 i = strata_tid(); i < len; i += strata_threads()) {
        dst[i] = strata_axpy1(dst[i], src[i], alpha);
    }
}

extern "C" __global__ void strata_axpy_f32_v4(float* dst, const float* src, float alpha, u64 len) {
    const u64 len4 = len / 4;
    float4* d4 = reinterpret_cast<float4*>(dst);
    const float4* s4 = reinterpret_cast<const float4*>(src);
    for (u64 j = strata_tid(); j < len4; j += strata_threads()) {
        float4 d = d4[j];
        const float4 s = s4[j];
        d.x = strata_axpy1(d.x, s.x, alpha);
        d.y = strata_axpy1(d.y, s.y, alpha);
        d.z = strata_axpy1(d.z, s.z, alpha);
        d.w = strata_axpy1(d.w, s.w, alpha);
        d4[j] = d;
    }
    const u64 i = len4 * 4 + strata_tid();
    if (i < len) {
        dst[i] = strata_axpy1(dst[i], src[i], alpha);
    }
}

extern "C" __global__ void strata_scale_f32(float* dst, const float* src, float alpha, u64 len) {
    for (u64 i = strata_tid(); i < len; i += strata_threads()) {
        dst[i] = __fmul_rn(alpha, src[i]);
    }
}

extern "C" __global__ void strata_scale_f32_v4(float* dst, const float* src, float alpha, u64 len) {
    const u64 len4 = len / 4;
    float4* d4 = reinterpret_cast<float4*>(dst);
    const float4* s4 = reinterpret_cast<const float4*>(src);
    for (u64 j = strata_tid(); j < len4; j += strata_threads()) {
        const float4 s = s4[j];
        d4[j] = make_float4(__fmul_rn(alpha, s.x), __fmul_rn(alpha, s.y), __fmul_rn(alpha, s.z),
                            __fmul_rn(alpha, s.w));
    }
    const u64 i = len4 * 4 + strata_tid();
    if (i < len) {
        dst[i] = __fmul_rn(alpha, src[i]);
    }
}

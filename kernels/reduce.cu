// Strata's reduction kernels: N f32 buffers reduced into one (sum, mean, max, min), and the chunked
// step of an on-node all-reduce over peer-accessible buffers.
//
// Self-contained (no #include): compiled by NVRTC at first use, for the device's compute
// capability, with --fmad=false --ftz=false --prec-div=true --prec-sqrt=true; the arithmetic
// below uses the _rn intrinsics anyway, so no contraction or approximation can change a result.
//
// Semantics, matched bit for bit by strata_cuda::kernels::reference:
//   - the sources are combined in replica order: acc = src[0][i]; acc = op(acc, src[r][i]) for
//     r = 1..n, so the result does not depend on the launch configuration;
//   - sum adds in f32 (__fadd_rn); mean is that sum divided by (float)n (__fdiv_rn);
//   - max and min propagate NaN (any NaN input gives NaN); on ties (including -0 versus +0) the
//     earlier replica's value is kept;
//   - every NaN result is written as the canonical quiet NaN 0x7FC00000 (payloads differ between
//     CPUs and GPUs, so they are not kept);
//   - n >= 1 and len >= 1 (the host wrappers reject n == 0 and do not launch for len == 0).
//
// op: 0 sum, 1 mean, 2 max, 3 min.
//
// The _v4 variants load and store float4: every pointer they touch (srcs[r] + off, dst + off) must
// be 16-byte aligned, which the host wrappers check; the len % 4 tail is done element by element.

typedef unsigned long long u64;

#define STRATA_SUM 0
#define STRATA_MEAN 1
#define STRATA_MAX 2
#define STRATA_MIN 3

template <int OP>
__device__ __forceinline__ float strata_combine(float acc, float x) {
    if (OP == STRATA_SUM || OP == STRATA_MEAN) {
        return __fadd_rn(acc, x);
    } else if (OP == STRATA_MAX) {
        // NaN is sticky: once acc is NaN, neither test is true
        return (x > acc || x != x) ? x : acc;
    } else {
        return (x < acc || x != x) ? x : acc;
    }
}

template <int OP>
__device__ __forceinline__ float strata_finish(float acc, unsigned int n) {
    if (OP == STRATA_MEAN) {
        acc = __fdiv_rn(acc, (float)n);
    }
    return acc != acc ? __int_as_float(0x7FC00000) : acc;
}

template <int OP>
__device__ __forceinline__ float strata_reduce_at(const float* const* srcs, unsigned int n, u64 i) {
    float acc = srcs[0][i];
    for (unsigned int r = 1; r < n; ++r) {
        acc = strata_combine<OP>(acc, srcs[r][i]);
    }
    return strata_finish<OP>(acc, n);
}

template <int OP>
__device__ __forceinline__ float4 strata_reduce_at4(const float* const* srcs, unsigned int n, u64 j) {
    float4 acc = reinterpret_cast<const float4*>(srcs[0])[j];
    for (unsigned int r = 1; r < n; ++r) {
        float4 x = reinterpret_cast<const float4*>(srcs[r])[j];
        acc.x = strata_combine<OP>(acc.x, x.x);
        acc.y = strata_combine<OP>(acc.y, x.y);
        acc.z = strata_combine<OP>(acc.z, x.z);
        acc.w = strata_combine<OP>(acc.w, x.w);
    }
    acc.x = strata_finish<OP>(acc.x, n);
    acc.y = strata_finish<OP>(acc.y, n);
    acc.z = strata_finish<OP>(acc.z, n);
    acc.w = strata_finish<OP>(acc.w, n);
    return acc;
}

__device__ __forceinline__ u64 strata_tid() {
    return (u64)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ u64 strata_threads() {
    return (u64)gridDim.x * blockDim.x;
}

// ---- reduction of n buffers into dst (dst may be one of the sources: each element is read
// from every source before it is written)

template <int OP>
__device__ void strata_reduce_body(const float* const* srcs, unsigned int n, float* dst, u64 len) {
    for (u64 i = strata_tid(); i < len; i += strata_threads()) {
        dst[i] = strata_reduce_at<OP>(srcs, n, i);
    }
}

template <int OP>
__device__ void strata_reduce_body4(const float* const* srcs, unsigned int n, float* dst, u64 len) {
    const u64 len4 = len / 4;
    for (u64 j = strata_tid(); j < len4; j += strata_threads()) {
        reinterpret_cast<float4*>(dst)[j] = strata_reduce_at4<OP>(srcs, n, j);
    }
    const u64 i = len4 * 4 + strata_tid();
    if (i < len) {
        dst[i] = strata_reduce_at<OP>(srcs, n, i);
    }
}

extern "C" __global__ void strata_reduce_f32(const float* const* srcs, unsigned int n, float* dst, u64 len,
                                             int op) {
    switch (op) {
    case STRATA_SUM: strata_reduce_body<STRATA_SUM>(srcs, n, dst, len); break;
    case STRATA_MEAN: strata_reduce_body<STRATA_MEAN>(srcs, n, dst, len); break;
    case STRATA_MAX: strata_reduce_body<STRATA_MAX>(srcs, n, dst, len); break;
    case STRATA_MIN: strata_reduce_body<STRATA_MIN>(srcs, n, dst, len); break;
    default: break;
    }
}

extern "C" __global__ void strata_reduce_f32_v4(const float* const* srcs, unsigned int n, float* dst, u64 len,
                                                int op) {
    switch (op) {
    case STRATA_SUM: strata_reduce_body4<STRATA_SUM>(srcs, n, dst, len); break;
    case STRATA_MEAN: strata_reduce_body4<STRATA_MEAN>(srcs, n, dst, len); break;
    case STRATA_MAX: strata_reduce_body4<STRATA_MAX>(srcs, n, dst, len); break;
    case STRATA_MIN: strata_reduce_body4<STRATA_MIN>(srcs, n, dst, len); break;
    default: break;
    }
}

// ---- the chunked step of an on-node all-reduce: the device running this kernel reduces
// elements [off, off + len) of all n (peer-accessible) buffers and writes the result into every
// buffer at those elements, so after each device has run it for its own disjoint chunk, every
// buffer holds the full result (no separate broadcast step). Each element is read from every
// buffer by the one thread that then writes it, so the in-place update is race-free within the
// chunk; chunks of different devices must not overlap (the host side partitions them).

template <int OP>
__device__ void strata_chunk_body(float* const* bufs, unsigned int n, u64 off, u64 len) {
    const float* const* srcs = (const float* const*)bufs;
    for (u64 k = strata_tid(); k < len; k += strata_threads()) {
        const u64 i = off + k;
        const float r = strata_reduce_at<OP>(srcs, n, i);
        for (unsigned int b = 0; b < n; ++b) {
            bufs[b][i] = r;
        }
    }
}

template <int OP>
__device__ void strata_chunk_body4(float* const* bufs, unsigned int n, u64 off, u64 len) {
    // off is a multiple of 4 (checked on the host), so float4 index off / 4 + j is element off + 4j
    const float* const* srcs = (const float* const*)bufs;
    const u64 len4 = len / 4;
    const u64 base4 = off / 4;
    for (u64 j = strata_tid(); j < len4; j += strata_threads()) {
        const float4 r = strata_reduce_at4<OP>(srcs, n, base4 + j);
        for (unsigned int b = 0; b < n; ++b) {
            reinterpret_cast<float4*>(bufs[b])[base4 + j] = r;
        }
    }
    const u64 k = len4 * 4 + strata_tid();
    if (k < len) {
        const u64 i = off + k;
        const float r = strata_reduce_at<OP>(srcs, n, i);
        for (unsigned int b = 0; b < n; ++b) {
            bufs[b][i] = r;
        }
    }
}

extern "C" __global__ void strata_allreduce_chunk_f32(float* const* bufs, unsigned int n, u64 off, u64 len,
                                                      int op) {
    switch (op) {
    case STRATA_SUM: strata_chunk_body<STRATA_SUM>(bufs, n, off, len); break;
    case STRATA_MEAN: strata_chunk_body<STRATA_MEAN>(bufs, n, off, len); break;
    case STRATA_MAX: strata_chunk_body<STRATA_MAX>(bufs, n, off, len); break;
    case STRATA_MIN: strata_chunk_body<STRATA_MIN>(bufs, n, off, len); break;
    default: break;
    }
}

extern "C" __global__ void strata_allreduce_chunk_f32_v4(float* const* bufs, unsigned int n, u64 off, u64 len,
                                                         int op) {
    switch (op) {
    case STRATA_SUM: strata_chunk_body4<STRATA_SUM>(bufs, n, off, len); break;
    case STRATA_MEAN: strata_chunk_body4<STRATA_MEAN>(bufs, n, off, len); break;
    case STRATA_MAX: strata_chunk_body4<STRATA_MAX>(bufs, n, off, len); break;
    case STRATA_MIN: strata_chunk_body4<STRATA_MIN>(bufs, n, off, len); break;
    default: break;
    }
}

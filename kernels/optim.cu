// Fused optimizer updates for CentralStorage on a GPU, one pass over the parameter, in f32, with
// the operations (and their order) of strata-core's FusedSgd / FusedAdamW, which are candle-nn's
// SGD / AdamW bit for bit. Every operation is an _rn intrinsic: no FMA contraction, IEEE division
// and square root, subnormals kept (the module is compiled with --ftz=false), so results equal
// strata_cuda::kernels::reference (and candle-nn on the CPU) bit for bit, except that a NaN
// result's payload is unspecified. Self-contained (no #include), compiled by NVRTC.
//
// candle's `affine(x, mul, add)` computes x * mul + add as two rounded operations, and candle-nn
// uses it with add = 0, which turns -0 into +0; the `+ 0` below reproduces that.

typedef unsigned long long u64;

__device__ __forceinline__ u64 strata_tid() {
    return (u64)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ u64 strata_threads() {
    return (u64)gridDim.x * blockDim.x;
}

// x * a + 0, two rounded operations (candle's affine with add = 0)
__device__ __forceinline__ float strata_affine0(float x, float a) {
    return __fadd_rn(__fmul_rn(x, a), 0.0f);
}

// Plain SGD (candle-nn's SGD, strata-core's FusedSgd): theta = theta - (g * lr + 0).
extern "C" __global__ void strata_sgd_f32(float* param, const float* grad, float lr, u64 len) {
    for (u64 i = strata_tid(); i < len; i += strata_threads()) {
        param[i] = __fsub_rn(param[i], strata_affine0(grad[i], lr));
    }
}

// SGD with momentum (heavy ball, no dampening, no Nesterov; the velocity starts at zero):
//   velocity = velocity * momentum + g
//   theta    = theta - (velocity * lr + 0)
// With momentum = 0 and a finite velocity this equals plain SGD bit for bit.
extern "C" __global__ void strata_sgd_momentum_f32(float* param, const float* grad, float* velocity, float lr,
                                                   float momentum, u64 len) {
    for (u64 i = strata_tid(); i < len; i += strata_threads()) {
        const float v = __fadd_rn(__fmul_rn(velocity[i], momentum), grad[i]);
        velocity[i] = v;
        param[i] = __fsub_rn(param[i], strata_affine0(v, lr));
    }
}

// AdamW (candle-nn's AdamW, strata-core's FusedAdamW), all three of its passes fused:
//   m     = (m * beta1 + 0) + (g * one_minus_beta1 + 0)
//   v     = (v * beta2 + 0) + ((g * g) * one_minus_beta2 + 0)
//   m_hat = m * scale_m + 0
//   v_hat = v * scale_v + 0
//   theta = (theta * keep + 0) - ((m_hat / (sqrt(v_hat) * 1 + eps)) * lr + 0)
// where the scalars are computed on the host in f64 and rounded to f32 as FusedAdamW does:
// scale_m = 1 / (1 - beta1^t), scale_v = 1 / (1 - beta2^t), keep = 1 - lr * weight_decay.
extern "C" __global__ void strata_adamw_f32(float* param, const float* grad, float* m, float* v, float beta1,
                                            float one_minus_beta1, float beta2, float one_minus_beta2,
                                            float scale_m, float scale_v, float eps, float lr, float keep,
                                            u64 len) {
    for (u64 i = strata_tid(); i < len; i += strata_threads()) {
        const float g = grad[i];
        const float mi = __fadd_rn(strata_affine0(m[i], beta1), strata_affine0(g, one_minus_beta1));
        const float vi = __fadd_rn(strata_affine0(v[i], beta2), strata_affine0(__fmul_rn(g, g), one_minus_beta2));
        m[i] = mi;
        v[i] = vi;
        const float m_hat = strata_affine0(mi, scale_m);
        const float v_hat = strata_affine0(vi, scale_v);
        const float adjusted = __fdiv_rn(m_hat, __fadd_rn(__fmul_rn(__fsqrt_rn(v_hat), 1.0f), eps));
        param[i] = __fsub_rn(strata_affine0(param[i], keep), strata_affine0(adjusted, lr));
    }
}

// gemm_epilogue.cuh — the GEMMs' output epilogues, one definition for the
// tensor-core kernels (gemm_mma.cu, gemm_stream.cu) and the FMA kernel (gemm.cu):
//   EPI 0: y = acc    EPI 1: y = r + acc (r may be y)    EPI 2: y = silu(gate) * up
#pragma once

// expf, not __expf: the epilogue is off the hot path and the reference is exact.
__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }

// One output element: a is the dot product, u the up dot product (EPI 2 only).
template <int EPI>
__device__ __forceinline__ void epilogue_store(float* y, const float* r, long long o, float a, float u)
{
    if (EPI == 0) y[o] = a;
    else if (EPI == 1) y[o] = r[o] + a;
    else y[o] = silu(a) * u;
}

// gemm_epilogue.cuh — the GEMMs' output epilogues, one definition for the
// tensor-core kernels (gemm_mma.cu, gemm_stream.cu, gemm_wgmma.cu):
//   EPI 0: y = acc    EPI 1: y = r + acc (r may be y)    EPI 2: y = silu(gate) * up
// y is f32, or (the stream kernels' Y16 option) 16-bit bits of the weight type WT: the
// f32 value rounded to nearest even, as a single-rounding GEMM reading it would round it.
#pragma once
#include "bits16.cuh"

// expf, not __expf: the epilogue is off the hot path and the reference is exact.
__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }

template <int EPI>
__device__ __forceinline__ float epilogue_value(const float* r, long long o, float a, float u)
{
    if (EPI == 0) return a;
    if (EPI == 1) return r[o] + a;
    return silu(a) * u;
}

// One output element: a is the dot product, u the up dot product (EPI 2 only).
template <int EPI, int WT = 0>
__device__ __forceinline__ void epilogue_store(float* y, const float* r, long long o, float a, float u)
{
    y[o] = epilogue_value<EPI>(r, o, a, u);
}

template <int EPI, int WT>
__device__ __forceinline__ void epilogue_store(unsigned short* y, const float* r, long long o, float a, float u)
{
    y[o] = (unsigned short)to_bits16<WT>(epilogue_value<EPI>(r, o, a, u));
}

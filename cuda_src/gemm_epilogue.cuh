// gemm_epilogue.cuh — the GEMMs' output epilogues, one definition for the
// tensor-core kernels (gemm_stream.cu, gemm_wgmma.cu):
//   EPI 0: y = acc    EPI 1: y = r + acc (r may be y)    EPI 2: y = silu(gate) * up
// y is f32, or (the stream kernels' Y16 option) 16-bit bits of the weight type WT: the
// f32 value rounded to nearest even, as a single-rounding GEMM reading it would round it.
#pragma once
#include "bits16.cuh"

// expf, not __expf: the epilogue is off the hot path and the reference is exact. The
// division is the approximate reciprocal refined by one Newton step (within an ulp of
// v / d), not IEEE division: that one has a divergent slow path, and divergent code
// before the next tile's wgmmas in gemm_wgmma.cu's tile loop makes ptxas serialise them
// (C7520). d = 1 + e^-v >= 1; past 2^126 (v < -87.3) the reciprocal is 0: silu is -0
// (exactly: a value below 1e-36).
__device__ __forceinline__ float silu(float v) {
    const float d = 1.0f + expf(-v);
    float r = __fdividef(1.0f, d);       // 0 for d > 2^126 (d = inf included)
    r = fmaf(r, fmaf(-d, r, 1.0f), r);   // Newton: NaN-free since r = 0 only where d is huge
    return (d < 0x1p126f) ? v * r : v * 0.0f;
}

// rv: the residual r[o] (EPI 1; ignored otherwise), loaded by the caller, e.g. as part of a
// vector or batched with others so that their loads are in flight together.
template <int EPI>
__device__ __forceinline__ float epilogue_value_r(float rv, float a, float u)
{
    if (EPI == 0) return a;
    if (EPI == 1) return rv + a;
    return silu(a) * u;
}

template <int EPI>
__device__ __forceinline__ float epilogue_value(const float* r, long long o, float a, float u)
{
    return epilogue_value_r<EPI>(EPI == 1 ? r[o] : 0.0f, a, u);
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

// The same with the residual given (rv = r[o] for EPI 1).
template <int EPI, int WT = 0>
__device__ __forceinline__ void epilogue_store_r(float* y, float rv, long long o, float a, float u)
{
    y[o] = epilogue_value_r<EPI>(rv, a, u);
}

template <int EPI, int WT>
__device__ __forceinline__ void epilogue_store_r(unsigned short* y, float rv, long long o, float a, float u)
{
    y[o] = (unsigned short)to_bits16<WT>(epilogue_value_r<EPI>(rv, a, u));
}

// bits16.cuh — f32 <-> the 16-bit weight type's bits (round to nearest even),
// for the tensor-core GEMMs that feed f32 activations to f16/bf16 MMAs.
// WTYPE: 1 = f16, 2 = bf16 (dtypes.CODE).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

template <int WTYPE>
__device__ __forceinline__ unsigned int to_bits16(float v)
{
    if (WTYPE == 2) return (unsigned int)__bfloat16_as_ushort(__float2bfloat16(v));
    return (unsigned int)__half_as_ushort(__float2half(v));
}

template <int WTYPE>
__device__ __forceinline__ float from_bits16(unsigned int b)
{
    if (WTYPE == 2) return __bfloat162float(__ushort_as_bfloat16((unsigned short)b));
    return __half2float(__ushort_as_half((unsigned short)b));
}

// warp.cuh — reductions across the 32 lanes of a warp (xor butterfly: every
// lane ends with the result). Call from warp-uniform code: all 32 lanes.
#pragma once

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// warp_sum of N values at once: each value's additions in warp_sum's order (the same bits),
// the N shuffle chains interleaved so their latencies overlap.
template <int N>
__device__ __forceinline__ void warp_sum_n(float* v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int k = 0; k < N; k++) v[k] += __shfl_xor_sync(0xffffffffu, v[k], o);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

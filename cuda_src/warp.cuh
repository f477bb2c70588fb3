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

// warp_sum of G values at once (G a power of two <= 32), transposed: at the first log2(G)
// xor offsets a lane sends half of its values and keeps the other half, so each value's
// additions are warp_sum's (the same bits) with G - 1 + 5 - log2(G) shuffles instead of 5 G.
// Afterwards v[0] of lane l holds the sum of value l >> (5 - log2 G); the rest of v is spent.
template <int G, int O = 16>
__device__ __forceinline__ void warp_sum_transposed(float* v, int lane) {
    static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "G must be a power of two <= 32");
    if constexpr (O > 0) {
        if constexpr (G > 1) {
            constexpr int H = G / 2;
            const bool hi = (lane & O) != 0;   // this lane keeps the upper half
#pragma unroll
            for (int i = 0; i < H; i++) {
                const float send = hi ? v[i] : v[i + H];
                const float keep = hi ? v[i + H] : v[i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
            }
            warp_sum_transposed<H, O / 2>(v, lane);
        } else {
            v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
            warp_sum_transposed<1, O / 2>(v, lane);
        }
    }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

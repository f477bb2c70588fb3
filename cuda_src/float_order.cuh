// float_order.cuh — the total order the token kernels rank logits by: an f32's
// bits mapped to a u32 that compares like the float (-inf < ... < -0 < +0 < ...
// < +inf), NaN mapped to 0, below everything. Shared by the fused lm_head
// argmax (gemm_stream.cu, GS_EPI 3) and the sampler (sample.cu) so both pick
// the same token.
#pragma once

__device__ __forceinline__ unsigned int order_key(float z)
{
    const unsigned int u = __float_as_uint(z);
    if (z != z) return 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(unsigned int k)
{
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// (key, index) pairs: the larger key wins, the lower index among equal keys
// (torch.argmax's tie rule).
__device__ __forceinline__ bool key_wins(unsigned int k, int i, unsigned int bk, int bi)
{
    return k > bk || (k == bk && i < bi);
}

// The warp's winning (key, index) pair, in every lane (an xor butterfly of key_wins).
__device__ __forceinline__ void warp_key_argmax(unsigned int& k, int& i)
{
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        const unsigned int ok = __shfl_xor_sync(0xffffffffu, k, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (key_wins(ok, oi, k, i)) { k = ok; i = oi; }
    }
}

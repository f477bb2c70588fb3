// gemm_mma.cu — small-M weight-streaming GEMM on tensor cores (f16 / bf16 weights).
//
// Computes, for m < M rows and n < N output columns,
//     acc[m, n] = sum_k rnd(x[m, k]) * W[n, k]      (f32 accumulation)
// where rnd rounds the f32 activation to the weight's type (round to nearest
// even) — the tensor cores take both operands in that type, as cuBLAS does.
//   GM_EPI 0:  y[m, n] = acc[m, n]
//   GM_EPI 1:  y[m, n] = r[m, n] + acc[m, n]        (r may be y itself)
//   GM_EPI 2:  y[m, n] = silu(acc_gate) * acc_up    (W has 2N rows: gate 0..N-1, up N..2N-1)
//
// Layouts (row-major, C-contiguous, 16-byte aligned; K % 8 == 0):
//   x [M, K] f32      W [N or 2N, K] f16/bf16 bits (GM_WTYPE 1 / 2)      y, r [M, N] f32
//
// Launch: block = GM_WARPS*32 threads; grid = (ceil(N / (GM_WARPS*8)), ceil(M / (16*GM_MT)));
// dynamic shared memory = 16*GM_MT * (GM_KT + 8) * 2 bytes (the x tile in the weight type).
//
// Why this shape: at M <= 64 a drafter GEMM is a stream of weights; with bf16
// weights each element feeds 16-64 multiply-adds, more than the f32 FMA units
// sustain at HBM speed on Hopper, so the products go to mma.sync m16n8k16.
// Warp w owns 8 output columns (x2 weight rows for GM_EPI 2) and all GM_MT
// 16-row M tiles; it streams its 8 weight rows once, 16 bytes per lane per
// 32-wide K step. The dot product's K order is free, so each lane's 8
// consecutive weights W[n][k..k+7] serve two MMAs directly: elements k+0..3
// play the fragment's columns {2t, 2t+1, 2t+8, 2t+9} of the first, k+4..7 of
// the second, and the x tile is read with the same permutation (one 16-byte
// shared-memory load per 8 activations). No shuffles, no ldmatrix.
//
// nvrtc-check: -DGM_WTYPE=1 -DGM_EPI=0 -DGM_K=5120 -DGM_MT=1 -DGM_KT=1024
// nvrtc-check: -DGM_WTYPE=2 -DGM_EPI=1 -DGM_K=4096 -DGM_MT=4 -DGM_KT=352
// nvrtc-check: -DGM_WTYPE=2 -DGM_EPI=2 -DGM_K=5120 -DGM_MT=2 -DGM_KT=736
// nvrtc-check: -DGM_WTYPE=1 -DGM_EPI=2 -DGM_K=40 -DGM_MT=2 -DGM_KT=64

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "mma.cuh"

#ifndef GM_WTYPE
#define GM_WTYPE 2
#endif
#ifndef GM_EPI
#define GM_EPI 0
#endif
#ifndef GM_K
#define GM_K 256
#endif
#ifndef GM_MT
#define GM_MT 1
#endif
#ifndef GM_WARPS
#define GM_WARPS 4
#endif
#if GM_MT != 1 && GM_MT != 2 && GM_MT != 4
#error "GM_MT must be 1, 2 or 4 (ptxas spills at 3)"
#endif
#ifndef GM_KT
#define GM_KT 256
#endif

#if GM_K % 8 != 0
#error "GM_K must be a multiple of 8 (16-byte weight loads)"
#endif
#if GM_KT % 32 != 0
#error "GM_KT must be a multiple of 32"
#endif
#if GM_WTYPE != 1 && GM_WTYPE != 2
#error "GM_WTYPE must be 1 (f16) or 2 (bf16)"
#endif

namespace gemm_mma_detail {

constexpr int K = GM_K;
constexpr int KT = GM_KT;
constexpr int XS = GM_KT + 8;                 // x tile row stride (elements): staggers banks
constexpr int ROWS = 16 * GM_MT;
constexpr int NW = (GM_EPI == 2) ? 2 : 1;     // weight rows per output column
constexpr int THREADS = GM_WARPS * 32;

// Two f32 -> one register of two 16-bit values, lower k in the low half.
__device__ __forceinline__ unsigned int pack2(float lo, float hi) {
#if GM_WTYPE == 2
    return (unsigned int)__bfloat16_as_ushort(__float2bfloat16(lo)) |
           ((unsigned int)__bfloat16_as_ushort(__float2bfloat16(hi)) << 16);
#else
    return (unsigned int)__half_as_ushort(__float2half(lo)) |
           ((unsigned int)__half_as_ushort(__float2half(hi)) << 16);
#endif
}

__device__ __forceinline__ void mma(float d[4], const unsigned int a[4], const unsigned int b[2]) {
#if GM_WTYPE == 2
    mma_m16n8k16_bf16(d, a, b, d);
#else
    mma_m16n8k16_f16(d, a, b, d);
#endif
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }  // expf: off the hot path, matches the reference

}  // namespace gemm_mma_detail

extern "C" __global__ void __launch_bounds__(GM_WARPS * 32)
gemm_mma(const float* __restrict__ x, const unsigned short* __restrict__ w, float* y,
         const float* r, int M, int N) {
    using namespace gemm_mma_detail;
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned short* xs = reinterpret_cast<unsigned short*>(smem);

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.y * ROWS;
    const int n0 = (blockIdx.x * GM_WARPS + warp) * 8;      // this warp's 8 columns
    const int n = n0 + g;                                    // the weight row this lane streams
    const bool n_ok = n < N;
    const unsigned short* wrow[NW];
    wrow[0] = w + (long long)(n_ok ? n : 0) * K;
    if (NW == 2) wrow[NW - 1] = w + (long long)(n_ok ? n + N : 0) * K;

    float acc[GM_MT][NW][4];
#pragma unroll
    for (int i = 0; i < GM_MT; i++)
#pragma unroll
        for (int j = 0; j < NW; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

    for (int kc = 0; kc < K; kc += KT) {
        __syncthreads();  // every warp is done with the previous x tile
        // Stage x[m0 .. m0+ROWS, kc .. kc+KT) rounded to the weight type; zeros
        // past M and K (shared memory starts out as garbage, 0 * NaN poisons).
        for (int i = threadIdx.x; i < ROWS * (KT / 4); i += THREADS) {
            const int row = i / (KT / 4), c4 = (i % (KT / 4)) * 4, k = kc + c4;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (m0 + row < M && k < K) v = *reinterpret_cast<const float4*>(x + (long long)(m0 + row) * K + k);
            uint2 p;
            p.x = pack2(v.x, v.y);
            p.y = pack2(v.z, v.w);
            *reinterpret_cast<uint2*>(xs + row * XS + c4) = p;
        }
        __syncthreads();
        const int kend = (K - kc < KT) ? (K - kc) : KT;
#pragma unroll 4
        for (int kb = 0; kb < kend; kb += 32) {
            const int k = kc + kb + t * 8;
            uint4 wv[NW];
#pragma unroll
            for (int j = 0; j < NW; j++) {
                wv[j] = make_uint4(0u, 0u, 0u, 0u);
                if (n_ok && k < K) wv[j] = *reinterpret_cast<const uint4*>(wrow[j] + k);
            }
#pragma unroll
            for (int i = 0; i < GM_MT; i++) {
                const uint4 xa = *reinterpret_cast<const uint4*>(xs + (i * 16 + g) * XS + kb + t * 8);
                const uint4 xb = *reinterpret_cast<const uint4*>(xs + (i * 16 + g + 8) * XS + kb + t * 8);
                const unsigned int a_lo[4] = {xa.x, xb.x, xa.y, xb.y};
                const unsigned int a_hi[4] = {xa.z, xb.z, xa.w, xb.w};
#pragma unroll
                for (int j = 0; j < NW; j++) {
                    const unsigned int b_lo[2] = {wv[j].x, wv[j].y};
                    const unsigned int b_hi[2] = {wv[j].z, wv[j].w};
                    mma(acc[i][j], a_lo, b_lo);
                    mma(acc[i][j], a_hi, b_hi);
                }
            }
        }
    }

    // acc[i][j][e] holds output row m0 + 16i + g (+8 for e >= 2), column n0 + 2t + (e & 1).
#pragma unroll
    for (int i = 0; i < GM_MT; i++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int row = m0 + i * 16 + g + ((e & 2) ? 8 : 0);
            const int col = n0 + 2 * t + (e & 1);
            if (row >= M || col >= N) continue;
            const long long o = (long long)row * N + col;
#if GM_EPI == 0
            y[o] = acc[i][0][e];
#elif GM_EPI == 1
            y[o] = r[o] + acc[i][0][e];
#else
            y[o] = silu(acc[i][0][e]) * acc[i][NW - 1][e];
#endif
        }
    }
}

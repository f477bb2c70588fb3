// gemm_mma.cu — small-M weight-streaming GEMM on tensor cores (f16 / bf16 weights).
//
// Computes, for m < M rows and n < N output columns,
//     acc[m, n] = sum_k xe[m, k] * W[n, k]          (f32 accumulation)
// The tensor cores take both operands in the weight's 16-bit type, so the f32
// activation is split: hi = rnd(x), lo = rnd(x - hi) (round to nearest even)
// and xe = hi + lo with GM_SPLIT 2 (about 16 significant bits: f32-like
// accuracy for twice the MMAs, which a weight-streaming GEMM has to spare), or
// xe = hi with GM_SPLIT 1 (what cuBLAS does with 16-bit inputs).
//   GM_EPI 0:  y[m, n] = acc[m, n]
//   GM_EPI 1:  y[m, n] = r[m, n] + acc[m, n]        (r may be y itself)
//   GM_EPI 2:  y[m, n] = silu(acc_gate) * acc_up    (W has 2N rows: gate 0..N-1, up N..2N-1)
//
// Layouts (row-major, C-contiguous, 16-byte aligned; K % 8 == 0):
//   x [M, K] f32      W [N or 2N, K] f16/bf16 bits (GM_WTYPE 1 / 2)      y, r [M, N] f32
//
// Launch: block = GM_WARPS*32 threads; grid = (ceil(N / (GM_WARPS*8)), ceil(M / (16*GM_MT)), GM_KSPLIT);
// dynamic shared memory = GM_SPLIT * 16*GM_MT * (GM_KT + 8) * 2 bytes (x tiles in the weight type).
//
// Split K (GM_KSPLIT > 1, one M tile only): an N of a few thousand gives too few
// blocks to keep enough weight loads in flight on 132 SMs, so blockIdx.z takes
// one K slice, writes its partial tile to ws [GM_KSPLIT][NW][16*GM_MT][N] f32,
// and the last block of each column group to arrive (counters[blockIdx.x],
// zero between launches: that block resets it) sums the slices in z order
// (deterministic: replays are bit-identical) and applies the epilogue.
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
// nvrtc-check: -DGM_WTYPE=1 -DGM_EPI=0 -DGM_K=5120 -DGM_MT=1 -DGM_KT=736 -DGM_SPLIT=2
// nvrtc-check: -DGM_WTYPE=2 -DGM_EPI=1 -DGM_K=4096 -DGM_MT=4 -DGM_KT=160 -DGM_SPLIT=2
// nvrtc-check: -DGM_WTYPE=2 -DGM_EPI=2 -DGM_K=5120 -DGM_MT=2 -DGM_KT=352 -DGM_SPLIT=2
// nvrtc-check: -DGM_WTYPE=2 -DGM_EPI=2 -DGM_K=5120 -DGM_MT=4 -DGM_KT=352 -DGM_SPLIT=1
// nvrtc-check: -DGM_WTYPE=1 -DGM_EPI=2 -DGM_K=40 -DGM_MT=2 -DGM_KT=64 -DGM_SPLIT=1
// nvrtc-check: -DGM_WTYPE=2 -DGM_EPI=2 -DGM_K=17408 -DGM_MT=4 -DGM_KT=160 -DGM_SPLIT=2 -DGM_KSPLIT=3
// nvrtc-check: -DGM_WTYPE=2 -DGM_EPI=1 -DGM_K=5120 -DGM_MT=1 -DGM_KT=736 -DGM_SPLIT=2 -DGM_KSPLIT=4

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "arrive.cuh"
#include "bits16.cuh"
#include "gemm_epilogue.cuh"
#include "mma.cuh"
#include "pdl.cuh"

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
#ifndef GM_SPLIT
#define GM_SPLIT 2
#endif
#ifndef GM_KSPLIT
#define GM_KSPLIT 1
#endif
#if GM_SPLIT != 1 && GM_SPLIT != 2
#error "GM_SPLIT must be 1 (x rounded) or 2 (x as hi + lo)"
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

// Output columns per warp: one n8 MMA tile (read by ops/gemm.py).
#define GM_WARP_COLS 8

namespace gemm_mma_detail {

constexpr int K = GM_K;
constexpr int KT = GM_KT;
constexpr int XS = GM_KT + 8;                 // x tile row stride (elements): staggers banks
constexpr int ROWS = 16 * GM_MT;
constexpr int NW = (GM_EPI == 2) ? 2 : 1;     // weight rows per output column
constexpr int THREADS = GM_WARPS * 32;
constexpr int KZ = ((K + GM_KSPLIT - 1) / GM_KSPLIT + 31) / 32 * 32;   // K per slice

// f32 -> the weight type's bits (nearest even) and back.
__device__ __forceinline__ unsigned int to16(float v) { return to_bits16<GM_WTYPE>(v); }
__device__ __forceinline__ float from16(unsigned int b) { return from_bits16<GM_WTYPE>(b); }

// Four activations -> hi (and lo = rnd(x - hi)) as two registers each, lower k
// in the low half.
__device__ __forceinline__ void split4(float4 v, uint2& hi, uint2& lo) {
    const unsigned int h0 = to16(v.x), h1 = to16(v.y), h2 = to16(v.z), h3 = to16(v.w);
    hi.x = h0 | (h1 << 16);
    hi.y = h2 | (h3 << 16);
    lo.x = to16(v.x - from16(h0)) | (to16(v.y - from16(h1)) << 16);
    lo.y = to16(v.z - from16(h2)) | (to16(v.w - from16(h3)) << 16);
}

__device__ __forceinline__ void mma(float d[4], const unsigned int a[4], const unsigned int b[2]) {
#if GM_WTYPE == 2
    mma_m16n8k16_bf16(d, a, b, d);
#else
    mma_m16n8k16_f16(d, a, b, d);
#endif
}

__device__ __forceinline__ void store(float* y, const float* r, long long o, float a, float u) {
    epilogue_store<GM_EPI>(y, r, o, a, u);
}

}  // namespace gemm_mma_detail

extern "C" __global__ void __launch_bounds__(GM_WARPS * 32, 1)  // min 1 block: ptxas otherwise spills a few bytes
gemm_mma(const float* __restrict__ x, const unsigned short* __restrict__ w, float* y,
         const float* r, int M, int N, float* ws, int* counters) {
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    using namespace gemm_mma_detail;
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned short* xs = reinterpret_cast<unsigned short*>(smem);   // hi tile, then lo tile

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.y * ROWS;
    const int n0 = (blockIdx.x * GM_WARPS + warp) * GM_WARP_COLS;   // this warp's columns
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

    // This block's K slice (all of K unless split); its ends are multiples of 8,
    // so each lane's 8-element loads are wholly inside or outside it.
    const int k_begin = blockIdx.z * KZ;
    const int k_end = (k_begin + KZ < K) ? k_begin + KZ : K;
    for (int kc = k_begin; kc < k_end; kc += KT) {
        __syncthreads();  // every warp is done with the previous x tile
        // Stage x[m0 .. m0+ROWS, kc .. kc+KT) rounded to the weight type; zeros
        // past M and the slice (shared memory starts out as garbage, 0 * NaN poisons).
        for (int i = threadIdx.x; i < ROWS * (KT / 4); i += THREADS) {
            const int row = i / (KT / 4), c4 = (i % (KT / 4)) * 4, k = kc + c4;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (m0 + row < M && k < k_end) v = *reinterpret_cast<const float4*>(x + (long long)(m0 + row) * K + k);
            uint2 hi, lo;
            split4(v, hi, lo);
            *reinterpret_cast<uint2*>(xs + row * XS + c4) = hi;
            if (GM_SPLIT == 2) *reinterpret_cast<uint2*>(xs + ROWS * XS + row * XS + c4) = lo;
        }
        __syncthreads();
        const int kend = (k_end - kc < KT) ? (k_end - kc) : KT;
#pragma unroll 4
        for (int kb = 0; kb < kend; kb += 32) {
            const int k = kc + kb + t * 8;
            uint4 wv[NW];
#pragma unroll
            for (int j = 0; j < NW; j++) {
                wv[j] = make_uint4(0u, 0u, 0u, 0u);
                if (n_ok && k < k_end) wv[j] = *reinterpret_cast<const uint4*>(wrow[j] + k);
            }
#pragma unroll
            for (int s = 0; s < GM_SPLIT; s++) {       // hi part, then (GM_SPLIT 2) lo part
#pragma unroll
                for (int i = 0; i < GM_MT; i++) {
                    const unsigned short* xr = xs + s * ROWS * XS + (i * 16 + g) * XS + kb + t * 8;
                    const uint4 xa = *reinterpret_cast<const uint4*>(xr);
                    const uint4 xb = *reinterpret_cast<const uint4*>(xr + 8 * XS);
                    // k+0..3 of this lane -> first MMA, k+4..7 -> second (see the header)
                    const unsigned int a0[4] = {xa.x, xb.x, xa.y, xb.y};
                    const unsigned int a1[4] = {xa.z, xb.z, xa.w, xb.w};
#pragma unroll
                    for (int j = 0; j < NW; j++) {
                        const unsigned int b0[2] = {wv[j].x, wv[j].y};
                        const unsigned int b1[2] = {wv[j].z, wv[j].w};
                        mma(acc[i][j], a0, b0);
                        mma(acc[i][j], a1, b1);
                    }
                }
            }
        }
    }

    // acc[i][j][e] holds output row m0 + 16i + g (+8 for e >= 2), column n0 + 2t + (e & 1).
#if GM_KSPLIT == 1
    (void)ws;
    (void)counters;
#pragma unroll
    for (int i = 0; i < GM_MT; i++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int row = m0 + i * 16 + g + ((e & 2) ? 8 : 0);
            const int col = n0 + 2 * t + (e & 1);
            if (row < M && col < N) store(y, r, (long long)row * N + col, acc[i][0][e], acc[i][NW - 1][e]);
        }
    }
#else
    // ---- split K: publish this slice's partial tile, the last slice to finish reduces.
#pragma unroll
    for (int i = 0; i < GM_MT; i++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int lrow = i * 16 + g + ((e & 2) ? 8 : 0);
            const int col = n0 + 2 * t + (e & 1);
            if (m0 + lrow >= M || col >= N) continue;
#pragma unroll
            for (int j = 0; j < NW; j++)
                ws[((long long)(blockIdx.z * NW + j) * ROWS + lrow) * N + col] = acc[i][j][e];
        }
    }
    __shared__ int ticket;
    if (!last_block_to_arrive(&counters[blockIdx.x], GM_KSPLIT, &ticket)) return;   // arrive.cuh
    constexpr int COLS = GM_WARPS * GM_WARP_COLS;  // output columns per block
    const int c0 = blockIdx.x * COLS;
    for (int idx = threadIdx.x; idx < ROWS * COLS; idx += THREADS) {
        const int lrow = idx / COLS, col = c0 + idx % COLS;
        if (m0 + lrow >= M || col >= N) continue;
        float a[NW];
#pragma unroll
        for (int j = 0; j < NW; j++) {
            a[j] = 0.0f;
            for (int z = 0; z < GM_KSPLIT; z++)  // fixed order: bit-identical every launch
                a[j] += __ldcg(ws + ((long long)(z * NW + j) * ROWS + lrow) * N + col);
        }
        store(y, r, (long long)(m0 + lrow) * N + col, a[0], a[NW - 1]);
    }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // ready for the next launch (or replay)
#endif
}

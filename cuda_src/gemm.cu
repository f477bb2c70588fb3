// gemm.cu — small-M weight-streaming GEMM with fused epilogues.
//
// Computes, for m < M rows and n < N output columns,
//     acc[m, n] = sum_k x[m, k] * W[n, k]            (f32 accumulation)
//   GEMM_EPI 0:  y[m, n] = acc[m, n]
//   GEMM_EPI 1:  y[m, n] = r[m, n] + acc[m, n]       (r may be y itself: h += a @ wo.T)
//   GEMM_EPI 2:  y[m, n] = silu(acc_gate) * acc_up   (W has 2N rows: gate 0..N-1, up N..2N-1)
//
// Layouts (all row-major, C-contiguous):
//   x [M, K] f32, row stride K        W [N or 2N, K] (HF [out, in]) of GEMM_WTYPE
//   y [M, N] f32, row stride N        r [M, N] f32 (GEMM_EPI 1 only; may alias y exactly)
//   GEMM_WTYPE 0 = f32, 1 = f16 (unsigned short bits), 2 = bf16 (unsigned short bits).
//
// Launch: block = GEMM_WARPS*32 threads, 1-D grid of
//   ceil(M / GEMM_MAX_M) * ceil(N / (GEMM_WARPS*GEMM_R)) blocks,
//   dynamic shared memory = min(M, GEMM_MAX_M) * GEMM_KT * 4 bytes.
// blockIdx.x = nblk * mtiles + mtile: the M tiles of one weight slice are adjacent
// block ids, so for M > GEMM_MAX_M (bulk append) they run together and the slice's
// second read hits L2 instead of DRAM; within one M tile every weight element is
// read from memory exactly once.
//
// Work split: warp w of a block owns GEMM_R consecutive output columns (x2 weight rows
// for EPI 2) and keeps acc[GEMM_R][rows][GEMM_MAX_M] in registers for the whole K loop,
// so the weights stream through once while the x tile (<= GEMM_MAX_M rows by GEMM_KT
// columns) is staged in shared memory and reused by every weight row of the block.
// Each lane reads 4 consecutive K elements per step (float4 / 8-byte loads) and the
// partial sums are folded across the warp at the end, up to 8 rows per transposed xor
// reduction. (The tensor-core kernels for f16/bf16 weights are gemm_stream.cu and
// gemm_wgmma.cu; this one serves f32 weights, K tails and unrounded activations.)
//
// K tails: K need not be a multiple of 4. When it is (GEMM_K % 4 == 0) weight and x
// loads are vectorised (the launcher checks 16-byte alignment of every pointer);
// otherwise every load is a guarded scalar load. The x tile is zero-filled past K
// because shared memory may hold NaNs (0 * NaN would poison the sum).
//
// nvrtc-check: -DGEMM_WTYPE=0 -DGEMM_EPI=0 -DGEMM_K=4096 -DGEMM_MAX_M=64 -DGEMM_R=1 -DGEMM_KT=128
// nvrtc-check: -DGEMM_WTYPE=1 -DGEMM_EPI=1 -DGEMM_K=4096 -DGEMM_MAX_M=16 -DGEMM_R=4 -DGEMM_KT=640
// nvrtc-check: -DGEMM_WTYPE=2 -DGEMM_EPI=2 -DGEMM_K=4096 -DGEMM_MAX_M=64 -DGEMM_R=1 -DGEMM_KT=128
// nvrtc-check: -DGEMM_WTYPE=1 -DGEMM_EPI=2 -DGEMM_K=1024 -DGEMM_MAX_M=16 -DGEMM_R=2 -DGEMM_KT=768
// nvrtc-check: -DGEMM_WTYPE=2 -DGEMM_EPI=0 -DGEMM_K=33 -DGEMM_MAX_M=3 -DGEMM_R=4 -DGEMM_KT=128
// nvrtc-check: -DGEMM_WTYPE=0 -DGEMM_EPI=1 -DGEMM_K=19 -DGEMM_MAX_M=1 -DGEMM_R=4 -DGEMM_KT=128

#include <cuda_fp16.h>
#include "gemm_epilogue.cuh"
#include "warp.cuh"
#include "pdl.cuh"

#ifndef GEMM_WTYPE
#define GEMM_WTYPE 1
#endif
#ifndef GEMM_EPI
#define GEMM_EPI 0
#endif
#ifndef GEMM_K
#define GEMM_K 256
#endif
#ifndef GEMM_MAX_M
#define GEMM_MAX_M 16
#endif
#ifndef GEMM_R
#define GEMM_R 2
#endif
#ifndef GEMM_WARPS
#define GEMM_WARPS 4
#endif
#ifndef GEMM_KT
#define GEMM_KT 256
#endif

#define GEMM_LANE_K 4                    // K elements per lane per step
#define GEMM_WARP_K (32 * GEMM_LANE_K)   // K elements per warp per step

#if GEMM_KT % GEMM_WARP_K != 0
#error "GEMM_KT must be a multiple of 128"
#endif
#if GEMM_WTYPE < 0 || GEMM_WTYPE > 2
#error "GEMM_WTYPE must be 0 (f32), 1 (f16) or 2 (bf16)"
#endif
#if GEMM_EPI < 0 || GEMM_EPI > 2
#error "GEMM_EPI must be 0 (store), 1 (residual) or 2 (silu*up)"
#endif

#if GEMM_WTYPE == 0
typedef float gemm_w_t;
#else
typedef unsigned short gemm_w_t;
#endif

namespace gemm_detail {

constexpr int K = GEMM_K;
constexpr int KT = GEMM_KT;
constexpr int KTILES = (K + KT - 1) / KT;
constexpr int KSTEPS = KT / GEMM_WARP_K;
constexpr bool VEC = (K % GEMM_LANE_K) == 0;
constexpr int NW = (GEMM_EPI == 2) ? 2 : 1;   // weight rows per output column
// Rows per transposed reduction: GEMM_MAX_M rounded up to a power of two, at most 8
// (8 rows: 9 shuffles; more would save little and cost more for short M tiles).
constexpr int RG = GEMM_MAX_M > 4 ? 8 : GEMM_MAX_M > 2 ? 4 : GEMM_MAX_M;
constexpr int RG_SHIFT = RG == 8 ? 2 : RG == 4 ? 3 : RG == 2 ? 4 : 5;   // 5 - log2(RG)

__device__ __forceinline__ float w_to_float(gemm_w_t v) {
#if GEMM_WTYPE == 0
    return v;
#elif GEMM_WTYPE == 1
    return __half2float(__ushort_as_half(v));
#else
    // bf16 is the top half of an f32: widening is a shift, exact.
    return __uint_as_float(((unsigned int)v) << 16);
#endif
}

// Four weights W[row, k..k+3] as floats, zero past K (and for rows past the end).
__device__ __forceinline__ float4 load_w4(const gemm_w_t* row, int k, bool valid) {
    float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
    if (!valid) return r;
    if (VEC) {
        if (k < K) {  // K % 4 == 0, so k < K implies k + 3 < K
#if GEMM_WTYPE == 0
            r = *reinterpret_cast<const float4*>(row + k);
#else
            const uint2 v = *reinterpret_cast<const uint2*>(row + k);
            r.x = w_to_float((unsigned short)(v.x & 0xffffu));
            r.y = w_to_float((unsigned short)(v.x >> 16));
            r.z = w_to_float((unsigned short)(v.y & 0xffffu));
            r.w = w_to_float((unsigned short)(v.y >> 16));
#endif
        }
    } else {
        if (k + 0 < K) r.x = w_to_float(row[k + 0]);
        if (k + 1 < K) r.y = w_to_float(row[k + 1]);
        if (k + 2 < K) r.z = w_to_float(row[k + 2]);
        if (k + 3 < K) r.w = w_to_float(row[k + 3]);
    }
    return r;
}


}  // namespace gemm_detail

extern "C" __global__ void __launch_bounds__(GEMM_WARPS * 32)
gemm(const float* x, const gemm_w_t* w, float* y, const float* r, int m, int n)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    using namespace gemm_detail;
    extern __shared__ __align__(16) unsigned char smem[];
    float* xs = reinterpret_cast<float*>(smem);   // [mt, KT]

    const int mtiles = (m + GEMM_MAX_M - 1) / GEMM_MAX_M;
    const int mtile = blockIdx.x % mtiles;
    const int nblk = blockIdx.x / mtiles;
    const int m0 = mtile * GEMM_MAX_M;
    const int mt = min(GEMM_MAX_M, m - m0);
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int col0 = (nblk * GEMM_WARPS + warp) * GEMM_R;

    float acc[GEMM_R][NW][GEMM_MAX_M];
#pragma unroll
    for (int i = 0; i < GEMM_R; ++i)
#pragma unroll
        for (int j = 0; j < NW; ++j)
#pragma unroll
            for (int mm = 0; mm < GEMM_MAX_M; ++mm) acc[i][j][mm] = 0.f;

    const gemm_w_t* wrow[GEMM_R][NW];
    bool wvalid[GEMM_R];
#pragma unroll
    for (int i = 0; i < GEMM_R; ++i) {
        wvalid[i] = col0 + i < n;
#pragma unroll
        for (int j = 0; j < NW; ++j)
            wrow[i][j] = w + ((long long)j * n + (col0 + i)) * K;
    }

    for (int t = 0; t < KTILES; ++t) {
        const int k0 = t * KT;
        __syncthreads();   // every warp is done with the previous x tile
        if (VEC) {
            const int n4 = mt * (KT / 4);
            for (int i = threadIdx.x; i < n4; i += GEMM_WARPS * 32) {
                const int mm = i / (KT / 4);
                const int kk = (i - mm * (KT / 4)) * 4;
                float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                if (k0 + kk < K)
                    v = *reinterpret_cast<const float4*>(x + (long long)(m0 + mm) * K + k0 + kk);
                *reinterpret_cast<float4*>(xs + mm * KT + kk) = v;
            }
        } else {
            const int n1 = mt * KT;
            for (int i = threadIdx.x; i < n1; i += GEMM_WARPS * 32) {
                const int mm = i / KT;
                const int kk = i - mm * KT;
                xs[i] = (k0 + kk < K) ? x[(long long)(m0 + mm) * K + k0 + kk] : 0.f;
            }
        }
        __syncthreads();

#pragma unroll
        for (int s = 0; s < KSTEPS; ++s) {
            if (k0 + s * GEMM_WARP_K >= K) break;   // block-uniform: last tile may be short
            const int kk = s * GEMM_WARP_K + lane * GEMM_LANE_K;
            float4 wv[GEMM_R][NW];
#pragma unroll
            for (int i = 0; i < GEMM_R; ++i)
#pragma unroll
                for (int j = 0; j < NW; ++j) wv[i][j] = load_w4(wrow[i][j], k0 + kk, wvalid[i]);
#pragma unroll
            for (int mm = 0; mm < GEMM_MAX_M; ++mm) {
                if (mm < mt) {
                    const float4 xv = *reinterpret_cast<const float4*>(xs + mm * KT + kk);
#pragma unroll
                    for (int i = 0; i < GEMM_R; ++i)
#pragma unroll
                        for (int j = 0; j < NW; ++j) {
                            float a = acc[i][j][mm];
                            a = fmaf(xv.x, wv[i][j].x, a);
                            a = fmaf(xv.y, wv[i][j].y, a);
                            a = fmaf(xv.z, wv[i][j].z, a);
                            a = fmaf(xv.w, wv[i][j].w, a);
                            acc[i][j][mm] = a;
                        }
                }
            }
        }
    }

    // Fold the lanes' partial sums: RG rows at a time with warp.cuh's transposed warp_sum
    // (the same bits as one warp_sum per row, a third of the shuffles); afterwards lane l
    // holds row g0 + (l >> RG_SHIFT) and the first lane of each such group stores it.
#pragma unroll
    for (int i = 0; i < GEMM_R; ++i) {
        if (!wvalid[i]) continue;   // warp-uniform
        const int col = col0 + i;
#pragma unroll
        for (int g0 = 0; g0 < GEMM_MAX_M; g0 += RG) {
            if (g0 >= mt) break;   // warp-uniform
            float s[NW][RG];
#pragma unroll
            for (int j = 0; j < NW; ++j) {
#pragma unroll
                for (int rr = 0; rr < RG; ++rr) s[j][rr] = (g0 + rr < GEMM_MAX_M) ? acc[i][j][g0 + rr] : 0.f;
                warp_sum_transposed<RG>(s[j], lane);
            }
            const int row = g0 + (lane >> RG_SHIFT);
            if ((lane & ((1 << RG_SHIFT) - 1)) == 0 && row < mt) {
                const long long o = (long long)(m0 + row) * n + col;
#if GEMM_EPI == 0
                y[o] = s[0][0];
#elif GEMM_EPI == 1
                y[o] = r[o] + s[0][0];   // same thread reads then writes: r == y is safe
#else
                y[o] = silu(s[0][0]) * s[NW - 1][0];
#endif
            }
        }
    }
}

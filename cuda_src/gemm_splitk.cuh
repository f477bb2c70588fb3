// gemm_splitk.cuh — the split-K reduction shared by the weight-streaming GEMMs
// (gemm_stream.cu, gemm_wgmma.cu): the last K slice of a (column group, row block) to
// arrive sums every slice's partial tile in z order (bit-identical replays) and applies
// the epilogue.
//
// Workspace: the caller's layout. A (column group, row block) tile's slices are at wsb:
//   partial tiles [ks][NW][ROWS][COLS]   (NW = 2 for silu_mul: gate, then up)
// and, with NORM, each slice's row sums of squares at ssw: [ks][ROWS].
// *counter (one per block x): zero between launches (the reducing block resets it).
#pragma once
#include "gemm_epilogue.cuh"

// float4 items a reducing thread sums at once (over NW matrices): their loads are in flight
// together (64 registers of accumulators).
#define SPLITK_CHUNK 16

// The calling block wrote its partial tile (and row sums) for its slice of the ks slices.
// Returns after the reduction (the last slice to arrive) or at once (the others).
// `stored(lrow)`: whether local row lrow < live is stored (its 16-row tile is live). All
// threads of the block call this. y: f32, or 16-bit bits of the weight type WT
// (gemm_epilogue.cuh). EPI 3 (gemm_wgmma.cu's qkv epilogue): the reduced values (scaled by
// the folded norm's row scale, as y would get them) go to tile (shared memory, row stride
// tile_stride floats, local rows and columns) instead of y, for the caller to finish.
// Returns whether this block reduced (block-uniform).
template <int NW, int ROWS, int COLS, int THREADS, int EPI, int NORM, int K, int WT, typename Y, typename Stored>
__device__ __forceinline__ bool splitk_reduce(const float* wsb, const float* ssw, int ks, int* counter, Y* y,
                                              const float* r, int m0, int live, int c0, int N, float eps,
                                              int norm_lo, Stored stored, float* tile = nullptr, int tile_stride = 0) {
    __shared__ int ticket;
    __threadfence();  // the partial tile is visible device-wide before the count says so
    __syncthreads();
    if (threadIdx.x == 0) ticket = atomicAdd(counter, 1);
    __syncthreads();
    if (ticket != ks - 1) return false;
    __threadfence();
    __shared__ float sc_s[NORM ? ROWS : 1];
    if (NORM) {
        if ((int)threadIdx.x < live) {
            float ss = 0.0f;
            for (int z = 0; z < ks; z++) ss += __ldcg(ssw + z * ROWS + threadIdx.x);  // z order
            sc_s[threadIdx.x] = (m0 + (int)threadIdx.x >= norm_lo) ? rsqrtf(ss * (1.0f / K) + eps) : 1.0f;
        }
        __syncthreads();
    }
    // Each thread owns items idx = threadIdx.x + j * THREADS (a float4 of one row); they are
    // reduced SPLITK_CHUNK / NW at a time, every slice's loads of a chunk independent of the
    // others' sums, so a chunk costs about one L2 round trip per slice rather than one per
    // item and slice (z order per element: bit-identical to summing item by item).
    constexpr int C4 = COLS / 4;
    constexpr int JMAX = (ROWS * C4 + THREADS - 1) / THREADS;   // items per thread of a full tile
    constexpr int JC = (SPLITK_CHUNK / NW < JMAX) ? SPLITK_CHUNK / NW : JMAX;
    const int items = live * C4;
    for (int j0 = threadIdx.x; j0 < items; j0 += JC * THREADS) {
        float4 a[JC][NW];
#pragma unroll
        for (int j = 0; j < JC; j++)
#pragma unroll
            for (int jw = 0; jw < NW; jw++) a[j][jw] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int z = 0; z < ks; z++) {  // fixed order: bit-identical every launch
#pragma unroll
            for (int j = 0; j < JC; j++) {
                const int idx = j0 + j * THREADS;
                const int lrow = idx / C4, lc = (idx - lrow * C4) * 4;
                if (idx < items && c0 + lc < N && stored(lrow)) {  // what is stored: no load for the rest
#pragma unroll
                    for (int jw = 0; jw < NW; jw++) {
                        const float4 v = __ldcg(reinterpret_cast<const float4*>(wsb + ((long long)(z * NW + jw) * ROWS + lrow) * COLS + lc));
                        a[j][jw].x += v.x;
                        a[j][jw].y += v.y;
                        a[j][jw].z += v.z;
                        a[j][jw].w += v.w;
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < JC; j++) {
            const int idx = j0 + j * THREADS;
            if (idx >= items) continue;
            const int lrow = idx / C4, lc = (idx - lrow * C4) * 4, col = c0 + lc;
            if (col >= N || !stored(lrow)) continue;
            const long long o = (long long)(m0 + lrow) * N + col;
            float sc = 1.0f;
            if (NORM) sc = sc_s[lrow];
            const float4 g = a[j][0], u = a[j][NW - 1];
            if (EPI == 3) {   // (tile_stride and lc multiples of 4: 16-byte aligned)
                float* tp = tile + lrow * tile_stride + lc;
                const float sc4 = NORM ? sc : 1.0f;
                if (col + 3 < N) {
                    *reinterpret_cast<float4*>(tp) = make_float4(g.x * sc4, g.y * sc4, g.z * sc4, g.w * sc4);
                } else {
                    tp[0] = g.x * sc4;
                    if (col + 1 < N) tp[1] = g.y * sc4;
                    if (col + 2 < N) tp[2] = g.z * sc4;
                }
            } else if (NORM) {
                epilogue_store<EPI, WT>(y, r, o, g.x * sc, u.x * sc);
                if (col + 1 < N) epilogue_store<EPI, WT>(y, r, o + 1, g.y * sc, u.y * sc);
                if (col + 2 < N) epilogue_store<EPI, WT>(y, r, o + 2, g.z * sc, u.z * sc);
                if (col + 3 < N) epilogue_store<EPI, WT>(y, r, o + 3, g.w * sc, u.w * sc);
            } else {
                epilogue_store<EPI, WT>(y, r, o, g.x, u.x);
                if (col + 1 < N) epilogue_store<EPI, WT>(y, r, o + 1, g.y, u.y);
                if (col + 2 < N) epilogue_store<EPI, WT>(y, r, o + 2, g.z, u.z);
                if (col + 3 < N) epilogue_store<EPI, WT>(y, r, o + 3, g.w, u.w);
            }
        }
    }
    if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (or replay)
    return true;
}

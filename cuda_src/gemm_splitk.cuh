// gemm_splitk.cuh — the split-K reduction shared by the weight-streaming GEMMs
// (gemm_stream.cu, gemm_wgmma.cu): the last K slice of a (column group, row block) to
// arrive sums every slice's partial tile in z order (bit-identical replays) and applies
// the epilogue.
//
// Workspace of one launch (f32), indexed by the linear block x = column group * row
// blocks + row block:
//   partial tiles [grid x][ks][NW][ROWS][COLS]   (NW = 2 for silu_mul: gate, then up)
//   then, with NORM, each slice's row sums of squares [grid x][ks][ROWS]
// counters[block x]: zero between launches (the reducing block resets it).
#pragma once
#include "gemm_epilogue.cuh"

// The calling block wrote its partial tile (and row sums) for slice blockIdx.z. Returns after
// the reduction (the last slice) or at once (the others). `stored(lrow)`: whether local row
// lrow < live is stored (its 16-row tile is live). All threads of the block call this.
template <int NW, int ROWS, int COLS, int THREADS, int EPI, int NORM, int K, typename Stored>
__device__ __forceinline__ void splitk_reduce(float* ws, int* counters, float* y, const float* r, int bx, int m0,
                                              int live, int c0, int N, float eps, int norm_lo, Stored stored) {
    __shared__ int ticket;
    const int ks = (int)gridDim.z;
    const float* wsb = ws + (long long)bx * ks * (NW * ROWS * COLS);
    __threadfence();  // the partial tile is visible device-wide before the count says so
    __syncthreads();
    if (threadIdx.x == 0) ticket = atomicAdd(&counters[bx], 1);
    __syncthreads();
    if (ticket != ks - 1) return;
    __threadfence();
    __shared__ float sc_s[NORM ? ROWS : 1];
    if (NORM) {
        const float* ssw = ws + (long long)gridDim.x * ks * NW * ROWS * COLS + (long long)bx * ks * ROWS;
        if ((int)threadIdx.x < live) {
            float ss = 0.0f;
            for (int z = 0; z < ks; z++) ss += __ldcg(ssw + z * ROWS + threadIdx.x);  // z order
            sc_s[threadIdx.x] = (m0 + (int)threadIdx.x >= norm_lo) ? rsqrtf(ss * (1.0f / K) + eps) : 1.0f;
        }
        __syncthreads();
    }
    constexpr int C4 = COLS / 4;
    for (int idx = threadIdx.x; idx < live * C4; idx += THREADS) {
        const int lrow = idx / C4, lc = (idx - lrow * C4) * 4, col = c0 + lc;
        if (col >= N || !stored(lrow)) continue;
        float4 a[NW];
#pragma unroll
        for (int jw = 0; jw < NW; jw++) {
            a[jw] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
            for (int z = 0; z < ks; z++) {  // fixed order: bit-identical every launch
                const float4 v = __ldcg(reinterpret_cast<const float4*>(wsb + ((long long)(z * NW + jw) * ROWS + lrow) * COLS + lc));
                a[jw].x += v.x;
                a[jw].y += v.y;
                a[jw].z += v.z;
                a[jw].w += v.w;
            }
        }
        const long long o = (long long)(m0 + lrow) * N + col;
        if (NORM) {
            const float sc = sc_s[lrow];
#pragma unroll
            for (int jw = 0; jw < NW; jw++) {
                a[jw].x *= sc;
                a[jw].y *= sc;
                a[jw].z *= sc;
                a[jw].w *= sc;
            }
        }
        epilogue_store<EPI>(y, r, o, a[0].x, a[NW - 1].x);
        if (col + 1 < N) epilogue_store<EPI>(y, r, o + 1, a[0].y, a[NW - 1].y);
        if (col + 2 < N) epilogue_store<EPI>(y, r, o + 2, a[0].z, a[NW - 1].z);
        if (col + 3 < N) epilogue_store<EPI>(y, r, o + 3, a[0].w, a[NW - 1].w);
    }
    if (threadIdx.x == 0) counters[bx] = 0;  // ready for the next launch (or replay)
}

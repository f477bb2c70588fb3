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
#include "arrive.cuh"
#include "gemm_epilogue.cuh"

// float4 loads of the partial tiles a reducing thread keeps in flight (items x matrices x
// slices, 4 registers each): SPLITK_SLICES slices at a time (a split of 9..16 takes two
// batches) of SPLITK_INFLIGHT_16 / SPLITK_SLICES / NW items for a 16-row tile (gemm_stream's
// GS_MT 1 fits 2 blocks per SM in 128 registers), SPLITK_INFLIGHT / SPLITK_SLICES / NW above.
#define SPLITK_SLICES 8
// the rows' sums of squares (NORM): up to 16 slices' loads at once, one round trip for any split
// gemm_stream plans (MAX_K_SPLIT): one warp's chain before every partial's load; a narrow tile's
// partials batch as many slices where the loads in flight allow
#define SPLITK_SS_SLICES 16
#define SPLITK_INFLIGHT_16 16
#define SPLITK_INFLIGHT_16_ONE 32   // a 16-row tile of a kernel built for one block an SM (SPLITK_ONE_BLOCK 1)
#define SPLITK_INFLIGHT 32
#ifndef SPLITK_ONE_BLOCK
#define SPLITK_ONE_BLOCK 0
#endif

// The calling block wrote its partial tile (and row sums) for its slice of the ks slices.
// Returns after the reduction (the last slice to arrive) or at once (the others).
// `stored(lrow)`: whether local row lrow < live is stored (its 16-row tile is live). All
// threads of the block call this. y: f32, or 16-bit bits of the weight type WT
// (gemm_epilogue.cuh). EPI 3 (gemm_wgmma.cu's qkv epilogue): the reduced values (scaled by
// the folded norm's row scale, as y would get them) go to tile (shared memory, row stride
// tile_stride floats, local rows and columns) instead of y, for the caller to finish.
// Returns whether this block reduced (block-uniform). sc_keep (NORM, shared memory [ROWS]): the
// rows' scales kept there too, for a caller's later use (gemm_conv.cuh's normed x).
template <int NW, int ROWS, int COLS, int THREADS, int EPI, int NORM, int K, int WT, typename Y, typename Stored>
__device__ __forceinline__ bool splitk_reduce(const float* wsb, const float* ssw, int ks, int* counter, Y* y,
                                              const float* r, int m0, int live, int c0, int N, float eps,
                                              int norm_lo, Stored stored, float* tile = nullptr, int tile_stride = 0,
                                              float* sc_keep = nullptr) {
    __shared__ int ticket;
    if (!last_block_to_arrive(counter, ks, &ticket)) return false;   // arrive.cuh: the memory order
    __shared__ float sc_s[NORM ? ROWS : 1];
    if (NORM) {
        if ((int)threadIdx.x < live) {
            float ss = 0.0f;
            for (int z0 = 0; z0 < ks; z0 += SPLITK_SS_SLICES) {   // a batch's loads in flight, summed in z order
                float p[SPLITK_SS_SLICES];
#pragma unroll
                for (int z = 0; z < SPLITK_SS_SLICES; z++)
                    p[z] = (z0 + z < ks) ? __ldcg(ssw + (z0 + z) * ROWS + threadIdx.x) : 0.0f;
#pragma unroll
                for (int z = 0; z < SPLITK_SS_SLICES; z++)
                    if (z0 + z < ks) ss += p[z];
            }
            const float sc = (m0 + (int)threadIdx.x >= norm_lo) ? rsqrtf(ss * (1.0f / K) + eps) : 1.0f;
            sc_s[threadIdx.x] = sc;
            if (sc_keep) sc_keep[threadIdx.x] = sc;
        }
        __syncthreads();
    }
    // Each thread owns items idx = threadIdx.x + j * THREADS (a float4 of one row), reduced JC
    // at a time: the slices' loads of a chunk are issued ZB slices at a time into registers of
    // their own, all before any of them is added, so a chunk costs ceil(ks / ZB) L2 round trips
    // (then every item's sum in z order per element: bit-identical to adding slice by slice).
    // EPI 1's residual of the chunk (float4 where aligned) is issued before its first batch.
    constexpr int C4 = COLS / 4;
    constexpr int JMAX = (ROWS * C4 + THREADS - 1) / THREADS;   // items per thread of a full tile
    constexpr int LOADS = ROWS <= 16 ? (SPLITK_ONE_BLOCK ? SPLITK_INFLIGHT_16_ONE : SPLITK_INFLIGHT_16) : SPLITK_INFLIGHT;
    // slices per batch: SPLITK_SLICES, or up to SPLITK_SS_SLICES where a thread's items of a full
    // tile leave that room in LOADS (a narrow tile: every slice's loads at once, one round trip)
    constexpr int ZR = LOADS / (JMAX * NW) < SPLITK_SS_SLICES ? LOADS / (JMAX * NW) : SPLITK_SS_SLICES;
    constexpr int ZB = ZR > SPLITK_SLICES ? ZR : SPLITK_SLICES;
    constexpr int JL = LOADS / (ZB * NW) > 0 ? LOADS / (ZB * NW) : 1;
    constexpr int JC = JMAX < JL ? JMAX : JL;                         // items per chunk
    constexpr long long SLICE = (long long)NW * ROWS * COLS;   // floats per slice
    const int items = live * C4;
    const bool r4 = EPI == 1 && (N & 3) == 0 && (reinterpret_cast<unsigned long long>(r) & 15ull) == 0ull;
    for (int j0 = threadIdx.x; j0 < items; j0 += JC * THREADS) {
        // item j at offset 4 * (j0 + j * THREADS) of a partial tile (row lrow, column lc)
        int off[JC];
        bool st[JC];      // stored: only these are loaded
#pragma unroll
        for (int j = 0; j < JC; j++) {
            const int idx = j0 + j * THREADS;
            const int lrow = idx / C4, lc = (idx - lrow * C4) * 4;
            off[j] = 4 * idx;
            st[j] = idx < items && c0 + lc < N && stored(lrow);
        }
        float4 rv[JC];    // EPI 1: the residual
        if (EPI == 1) {
#pragma unroll
            for (int j = 0; j < JC; j++) {
                rv[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (!st[j]) continue;
                const int lrow = off[j] / COLS, col = c0 + off[j] - lrow * COLS;
                const float* rp = r + (long long)(m0 + lrow) * N + col;
                if (r4 && col + 3 < N) {
                    rv[j] = *reinterpret_cast<const float4*>(rp);
                } else {
                    rv[j].x = rp[0];
                    if (col + 1 < N) rv[j].y = rp[1];
                    if (col + 2 < N) rv[j].z = rp[2];
                    if (col + 3 < N) rv[j].w = rp[3];
                }
            }
        }
        float4 a[JC][NW];
#pragma unroll
        for (int j = 0; j < JC; j++)
#pragma unroll
            for (int jw = 0; jw < NW; jw++) a[j][jw] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const float4* p = reinterpret_cast<const float4*>(wsb) + j0;   // slice z0's item 0
        for (int z0 = 0; z0 < ks; z0 += ZB, p += ZB * (SLICE / 4)) {  // fixed order: bit-identical every launch
            // a slice past ks adds -0.0f: x + -0 == x for every x (no branch between the loads
            // of one batch and the adds of the last, which would make ptxas wait for them)
            float4 v[ZB][JC][NW];
#pragma unroll
            for (int zb = 0; zb < ZB; zb++)
#pragma unroll
                for (int j = 0; j < JC; j++)
#pragma unroll
                    for (int jw = 0; jw < NW; jw++) {
                        v[zb][j][jw] = make_float4(-0.0f, -0.0f, -0.0f, -0.0f);
                        if (st[j] && z0 + zb < ks)
                            v[zb][j][jw] = __ldcg(p + (zb * NW + jw) * (ROWS * C4) + j * THREADS);
                    }
#pragma unroll
            for (int zb = 0; zb < ZB; zb++)
#pragma unroll
                for (int j = 0; j < JC; j++)
#pragma unroll
                    for (int jw = 0; jw < NW; jw++) {
                        a[j][jw].x += v[zb][j][jw].x;
                        a[j][jw].y += v[zb][j][jw].y;
                        a[j][jw].z += v[zb][j][jw].z;
                        a[j][jw].w += v[zb][j][jw].w;
                    }
        }
#pragma unroll
        for (int j = 0; j < JC; j++) {
            if (!st[j]) continue;
            const int lrow = off[j] / COLS, lc = off[j] - lrow * COLS, col = c0 + lc;
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
            } else if (EPI == 1) {
                const float4 q = rv[j];
                if (NORM) {
                    epilogue_store_r<EPI, WT>(y, q.x, o, g.x * sc, u.x * sc);
                    if (col + 1 < N) epilogue_store_r<EPI, WT>(y, q.y, o + 1, g.y * sc, u.y * sc);
                    if (col + 2 < N) epilogue_store_r<EPI, WT>(y, q.z, o + 2, g.z * sc, u.z * sc);
                    if (col + 3 < N) epilogue_store_r<EPI, WT>(y, q.w, o + 3, g.w * sc, u.w * sc);
                } else {
                    epilogue_store_r<EPI, WT>(y, q.x, o, g.x, u.x);
                    if (col + 1 < N) epilogue_store_r<EPI, WT>(y, q.y, o + 1, g.y, u.y);
                    if (col + 2 < N) epilogue_store_r<EPI, WT>(y, q.z, o + 2, g.z, u.z);
                    if (col + 3 < N) epilogue_store_r<EPI, WT>(y, q.w, o + 3, g.w, u.w);
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

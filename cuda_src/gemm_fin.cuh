// gemm_fin.cuh — gemm_stream.cu's GS_FIN epilogue: DFlash 2's "finish" convolution (conv.cu's
// grouped_conv, half 1, residual added) fused into the GEMM that produces the sublayer output.
// Contract: acc = the GEMM's f32 result [M, N] (N = H, the hidden size: columns are channels),
// staged by the block in shared memory (tile [ROWS][COLS + GEMM_FIN_PAD], local rows and
// columns); for its columns [c0, c0 + COLS) and its stored rows the block writes
//   y[r, c] = res[r, c] + sum_{t < TAPS, i - t >= 0} (base[t, c] + d[r, g(c) * 2 * TAPS + TAPS + t]) * acc[r - t, c]
//   i = r % lane_rows, g(c) = c / GROUP,
// with grouped_conv's rounding: w = base + d in f32, fmaf per tap in tap order from 0, then
// res + sum. d [M, 2 * TAPS * N / GROUP] f32: the kernel_projection's output, columns
// [group][half][tap] (conv.cu's CONV_GMAJOR); base [TAPS, N] f32 (half 1 of base_kernel).
// y may be res itself (each element's residual is loaded before its store). lane_rows 0: no
// convolution, y = res + acc (the variant's unfused split-K launches: one reduction instance).
// The caller guarantees m0 % lane_rows == 0 (a lane block never straddles two row blocks), so
// every row a tap reads is in the tile. A tap row of a tile that is not stored (dead) reads 0.
// Work: a thread per VEC channels of one group (VEC 4 where GROUP % 4 == 0: 16-byte accesses)
// and batches of GEMM_FIN_ROWS rows (in one 16-row tile: one stored flag), the block's threads
// on THREADS * VEC / COLS batches at once: the batch's tile window (RB + TAPS - 1 rows), residuals
// and coefficients (one vector load per row) loaded together, then the sums and stores; a row
// past the block re-reads the last row (in bounds, never stored).
#pragma once
#include "gemm_conv.cuh"   // gemm_conv_ld / gemm_conv_st: VEC-wide f32 accesses

#define GEMM_FIN_PAD 8     // tile row stride COLS + 8 words: 8 mod 32, the fragment stores conflict-free
                           // (ops/gemm_stream.fin_smem reads it)
#define GEMM_FIN_ROWS 4    // rows per batch (a power of two <= 16); profiling/counters.py reads it

// TAPS consecutive coefficients: one 8- or 16-byte load where TAPS is 2 or 4 (d's row stride
// and the group's offset keep them aligned), else one each
template <int TAPS>
__device__ __forceinline__ void gemm_fin_ld_taps(float* o, const float* p) {
    if (TAPS == 2) {
        const float2 v = *reinterpret_cast<const float2*>(p);
        o[0] = v.x; o[TAPS > 1 ? 1 : 0] = v.y;
    } else if (TAPS == 4) {
        const float4 v = *reinterpret_cast<const float4*>(p);
        o[0] = v.x; o[TAPS > 1 ? 1 : 0] = v.y; o[TAPS > 2 ? 2 : 0] = v.z; o[TAPS > 3 ? 3 : 0] = v.w;
    } else {
#pragma unroll
        for (int t = 0; t < TAPS; ++t) o[t] = p[t];
    }
}

template <int TAPS, int GROUP, int ROWS, int COLS, int THREADS, typename Stored>
__device__ __forceinline__ void gemm_fin_finish(const float* tile, const float* r, float* y,
                                                const float* __restrict__ base, const float* __restrict__ d,
                                                int N, int m0, int live, int c0, int lane_rows, Stored stored) {
    constexpr int VEC = GROUP % 4 == 0 ? 4 : 1;      // channels per thread (one group's: one coefficient)
    constexpr int QN = COLS / VEC;                    // channel chunks of the block
    constexpr int RG = THREADS / QN > 0 ? THREADS / QN : 1;   // row batches in flight at once
    constexpr int RB = GEMM_FIN_ROWS;                 // rows per batch (divides 16: one stored flag)
    constexpr int XW = RB + TAPS - 1;                 // tile rows per batch (window)
    constexpr int FS = COLS + GEMM_FIN_PAD;
    const int ds = 2 * TAPS * (N / GROUP);            // d's row stride
    const int top = live - 1;
    for (int it = threadIdx.x; it < QN * RG; it += THREADS) {
        const int lc = (it % QN) * VEC, c = c0 + lc;
        if (c >= N) continue;
        const float* dc = d + (c / GROUP) * 2 * TAPS + TAPS;   // half 1, tap 0 of the chunk's group
        for (int lr0 = (it / QN) * RB; lr0 < live; lr0 += RG * RB) {
            if (!stored(lr0)) continue;   // a dead tile: untouched
            // the batch's loads, all before any store (y may be r), no branch among them: the
            // taps' base (with the batch's: one round trip, where loading it once per chunk before
            // the batches made a round trip of its own; a thread runs one batch at 16 rows), window
            // row w is local row lr0 + w - (TAPS - 1) (before the block, past it, or in a dead
            // tile: 0; the taps of a lane's first rows never reach before it), a row past the
            // block loads the last row's words (in bounds, never stored)
            float bv[TAPS][VEC], av[XW][VEC], rv[RB][VEC], dv[RB][TAPS];
#pragma unroll
            for (int t = 0; t < TAPS; ++t) gemm_conv_ld<VEC>(bv[t], base + t * N + c);
#pragma unroll
            for (int w = 0; w < XW; ++w) {
                const int lr = lr0 + w - (TAPS - 1);
                const bool ok = lr >= 0 && lr <= top && stored(lr >= 0 ? lr : 0);
                gemm_conv_ld<VEC>(av[w], tile + (ok ? lr : lr0) * FS + lc);
#pragma unroll
                for (int e = 0; e < VEC; ++e) av[w][e] = ok ? av[w][e] : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                const long long row = m0 + (lr0 + j <= top ? lr0 + j : top);
                gemm_conv_ld<VEC>(rv[j], r + row * N + c);
                gemm_fin_ld_taps<TAPS>(dv[j], dc + row * ds);
            }
            int i = lane_rows > 0 ? (m0 + lr0) % lane_rows : 0;
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                float o[VEC];
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    float acc = 0.0f;
#pragma unroll
                    for (int t = 0; t < TAPS; ++t)
                        acc = i - t >= 0 ? fmaf(bv[t][e] + dv[j][t], av[j + TAPS - 1 - t][e], acc) : acc;
                    o[e] = rv[j][e] + (lane_rows > 0 ? acc : av[j + TAPS - 1][e]);
                }
                if (lr0 + j <= top) gemm_conv_st<VEC>(y + (long long)(m0 + lr0 + j) * N + c, o);
                i = (i + 1 == lane_rows) ? 0 : i + 1;
            }
        }
    }
}

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
// Work: a thread per column, the block's rows RB at a time (RB divides 16: a batch is in one
// 16-row tile): the batch's residuals, coefficients (one vector load per row) and tile words
// loaded together, then the sums and stores; the taps before a batch read the previous batch's
// tile words, kept in registers; a row past the block re-reads the last row (in bounds), unstored.
#pragma once

#define GEMM_FIN_PAD 8     // tile row stride COLS + 8 words: 8 mod 32, the fragment stores conflict-free
                           // (ops/gemm_stream.fin_smem reads it)
#define GEMM_FIN_LOADS 32  // registers a batch's loads take (rows x (1 + TAPS)); profiling/counters.py reads it

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
    // rows per batch: a power of two <= 16, so a batch lies in one 16-row tile (one stored flag)
    constexpr int RW = GEMM_FIN_LOADS / (TAPS + 1);
    constexpr int RB = RW >= 16 ? 16 : RW >= 8 ? 8 : RW >= 4 ? 4 : RW >= 2 ? 2 : 1;
    constexpr int FS = COLS + GEMM_FIN_PAD;
    constexpr int PV = TAPS > 1 ? TAPS - 1 : 1;      // the rows before a batch its taps read
    const int ds = 2 * TAPS * (N / GROUP);            // d's row stride
    for (int lc = threadIdx.x; lc < COLS; lc += THREADS) {
        const int c = c0 + lc;
        if (c >= N) break;
        const float* dp = d + (long long)m0 * ds + (c / GROUP) * 2 * TAPS + TAPS;   // half 1, tap 0
        const float* rp = r + (long long)m0 * N + c;
        float* yp = y + (long long)m0 * N + c;
        float bv[TAPS], prev[PV];
#pragma unroll
        for (int t = 0; t < TAPS; ++t) bv[t] = base[t * N + c];
#pragma unroll
        for (int k = 0; k < PV; ++k) prev[k] = 0.0f;   // before the block: never read (a lane starts there)
        for (int lr0 = 0; lr0 < live; lr0 += RB) {
            if (!stored(lr0)) {   // a dead tile (block-uniform): untouched, its rows read 0 by later taps
#pragma unroll
                for (int k = 0; k < PV; ++k) prev[k] = 0.0f;
                continue;
            }
            // the batch's loads, all before any store (y may be r), no branch among them: a row
            // past the block loads the last row's words (in bounds, never stored)
            float av[RB], rv[RB], dv[RB][TAPS];
            // running pointers (a row past the block stays on the last: no per-row 64-bit product)
            const float* rq = rp + (long long)lr0 * N;
            const float* dq = dp + (long long)lr0 * ds;
            const float* aq = tile + lr0 * FS + lc;
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                av[j] = *aq;
                rv[j] = *rq;
                gemm_fin_ld_taps<TAPS>(dv[j], dq);
                const bool step = lr0 + j + 1 < live;
                aq += step ? FS : 0;
                rq += step ? N : 0;
                dq += step ? ds : 0;
            }
            float* yb = yp + (long long)lr0 * N;
            int i = lane_rows > 0 ? (m0 + lr0) % lane_rows : 0;
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                float acc = 0.0f;
#pragma unroll
                for (int t = 0; t < TAPS; ++t) {
                    const float a = j - t >= 0 ? av[j - t >= 0 ? j - t : 0] : prev[t - j - 1 < PV ? t - j - 1 : 0];
                    acc = i - t >= 0 ? fmaf(bv[t] + dv[j][t], a, acc) : acc;
                }
                if (lr0 + j < live) *yb = lane_rows > 0 ? rv[j] + acc : rv[j] + av[j];
                yb += N;
                i = (i + 1 == lane_rows) ? 0 : i + 1;
            }
#pragma unroll
            for (int k = PV - 1; k >= 0; --k)   // row lr0 + RB - 1 - k: this batch's, or an older one's
                prev[k] = k < RB ? av[k < RB ? RB - 1 - k : 0] : prev[k >= RB ? k - RB : 0];
        }
    }
}

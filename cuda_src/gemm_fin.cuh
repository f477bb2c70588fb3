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
// y may be res itself (each element's residual is loaded before its store).
// The caller guarantees m0 % lane_rows == 0 (a lane block never straddles two row blocks), so
// every row a tap reads is in the tile. A tap row of a tile that is not stored (dead) reads 0.
// Work: a thread per column, the block's rows RB at a time: the batch's residuals, coefficients
// and tile window (RB + TAPS - 1 rows) loaded together, then the sums and stores; rows past the
// block load a clamped stand-in and are not stored.
#pragma once

#define GEMM_FIN_PAD 8     // tile row stride COLS + 8 words: 8 mod 32, the fragment stores conflict-free
#define GEMM_FIN_LOADS 32  // loads per batch (rows x (1 + TAPS)); ops/gemm_stream.py reads it

template <int TAPS, int GROUP, int ROWS, int COLS, int THREADS, typename Stored>
__device__ __forceinline__ void gemm_fin_finish(const float* tile, const float* r, float* y,
                                                const float* __restrict__ base, const float* __restrict__ d,
                                                int N, int m0, int live, int c0, int lane_rows, Stored stored) {
    constexpr int RB = (GEMM_FIN_LOADS / (TAPS + 1)) > 1 ? GEMM_FIN_LOADS / (TAPS + 1) : 1;   // rows per batch
    constexpr int XW = RB + TAPS - 1;                 // tile rows per batch (window)
    constexpr int FS = COLS + GEMM_FIN_PAD;
    const int ds = 2 * TAPS * (N / GROUP);            // d's row stride
    const int top = live - 1;                         // the block's last local row
    for (int lc = threadIdx.x; lc < COLS; lc += THREADS) {
        const int c = c0 + lc;
        if (c >= N) break;
        const int dc = (c / GROUP) * 2 * TAPS + TAPS;   // half 1's first tap of the column's group
        float bv[TAPS];
#pragma unroll
        for (int t = 0; t < TAPS; ++t) bv[t] = base[t * N + c];
        for (int lr0 = 0; lr0 < live; lr0 += RB) {
            float av[XW], rv[RB], dv[RB][TAPS];
            // window row w: local row lr0 + w - (TAPS - 1), clamped into [0, top] (a clamped row is
            // one no tap reads); a row of a dead tile reads 0
#pragma unroll
            for (int w = 0; w < XW; ++w) {
                int lr = lr0 + w - (TAPS - 1);
                lr = lr < 0 ? 0 : (lr > top ? top : lr);
                av[w] = stored(lr) ? tile[lr * FS + lc] : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                const int lr = (lr0 + j < top) ? lr0 + j : top;
                const long long row = m0 + lr;
                rv[j] = r[row * N + c];
#pragma unroll
                for (int t = 0; t < TAPS; ++t) dv[j][t] = d[row * ds + dc + t];
            }
            int i = (m0 + lr0) % lane_rows;
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                float acc = 0.0f;
#pragma unroll
                for (int t = 0; t < TAPS; ++t)
                    acc = i - t >= 0 ? fmaf(bv[t] + dv[j][t], av[j + TAPS - 1 - t], acc) : acc;
                if (lr0 + j < live && stored(lr0 + j)) y[(long long)(m0 + lr0 + j) * N + c] = rv[j] + acc;
                i = (i + 1 == lane_rows) ? 0 : i + 1;
            }
        }
    }
}

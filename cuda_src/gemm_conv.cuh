// gemm_conv.cuh — gemm_stream.cu's GS_CONV epilogue: DFlash 2's "prepare" convolution
// (conv.cu's grouped_conv, half 0, no residual) fused into the kernel_projection GEMM that
// produces its coefficients, run by the block that holds a column block's final d.
// Contract: d = the GEMM's y [M, N], N = 2 * TAPS * G, columns [half][group][tap] (conv.cu's
// CONV_GMAJOR layout: the projection's rows permuted at upload), so the block owning columns
// [c0, c0 + COLS) holds every tap of the groups whose taps all lie there; for the channels of
// those groups in half 0 (columns < TAPS * G) and its stored rows it writes
//   y[r, c] = sum_{t < TAPS, i - t >= 0} (base[t, c] + d[r, g(c) * TAPS + t]) * x[r - t, c],
//   i = r % lane_rows,
// with grouped_conv's rounding: w = base + d in f32, then fmaf per tap in tap order from 0.
// x [M, H] f32 is the GEMM's own input (H = K), base [TAPS, H] f32, y [M, H] f32.
// Called by all threads of the block after its d is stored (split K: the reducing block);
// d is read back from global memory after a barrier (the block's own stores).
// Work: a thread per VEC channels of one group (VEC 4 where GROUP % 4 == 0: 16-byte x, base
// and y accesses, consecutive threads on consecutive chunks of a row), walking the block's rows
// RB at a time: the rows' x window (RB + TAPS - 1 rows, each tap's earlier row shared) and
// their d issued together, then the sums. A tap before the lane block's first row is not added
// (its load reads an in-bounds stand-in row; the select keeps acc).
#pragma once

template <int TAPS, int GROUP, int H, int COLS, int THREADS, typename Stored>
__device__ __forceinline__ void gemm_conv_prepare(const float* __restrict__ x, const float* d, int N,
                                                  const float* __restrict__ base, float* y, int m0, int live,
                                                  int c0, int lane_rows, Stored stored) {
    constexpr int VEC = (GROUP % 4 == 0 && H % 4 == 0) ? 4 : 1;
    constexpr int RB = (16 / TAPS) > 1 ? 16 / TAPS : 1;   // rows per batch
    constexpr int XW = RB + TAPS - 1;                      // x rows per batch (window)
    const int tg = N / 2;                                  // half 0's columns: TAPS * G
    const int c1 = (c0 + COLS < tg) ? c0 + COLS : tg;
    const int g0 = (c0 + TAPS - 1) / TAPS, g1 = c1 / TAPS;  // groups wholly in [c0, c1)
    if (g1 <= g0) return;
    const int ch0 = g0 * GROUP;
    const int nq = (g1 - g0) * (GROUP / VEC);               // VEC-channel chunks
    __syncthreads();   // every thread's d stores before any load of them
    for (int q = threadIdx.x; q < nq; q += THREADS) {
        const int c = ch0 + q * VEC;
        const int g = c / GROUP;
        float bv[TAPS][VEC];
#pragma unroll
        for (int t = 0; t < TAPS; ++t) {
            if (VEC == 4) {
                const float4 b4 = *reinterpret_cast<const float4*>(base + t * H + c);
                bv[t][0] = b4.x; bv[t][VEC > 1 ? 1 : 0] = b4.y; bv[t][VEC > 2 ? 2 : 0] = b4.z; bv[t][VEC > 3 ? 3 : 0] = b4.w;
            } else {
                bv[t][0] = base[t * H + c];
            }
        }
        for (int lr0 = 0; lr0 < live; lr0 += RB) {
            float xv[XW][VEC], dv[RB][TAPS];
            // window row w: global row m0 + lr0 + w - (TAPS - 1), clamped into [0, m0 + live)
#pragma unroll
            for (int w = 0; w < XW; ++w) {
                int xr = m0 + lr0 + w - (TAPS - 1);
                xr = xr < 0 ? 0 : (xr >= m0 + live ? m0 + live - 1 : xr);
                const float* xp = x + (long long)xr * H + c;
                if (VEC == 4) {
                    const float4 v4 = *reinterpret_cast<const float4*>(xp);
                    xv[w][0] = v4.x; xv[w][VEC > 1 ? 1 : 0] = v4.y; xv[w][VEC > 2 ? 2 : 0] = v4.z; xv[w][VEC > 3 ? 3 : 0] = v4.w;
                } else {
                    xv[w][0] = *xp;
                }
            }
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                const int lr = (lr0 + j < live) ? lr0 + j : live - 1;
#pragma unroll
                for (int t = 0; t < TAPS; ++t) dv[j][t] = d[(long long)(m0 + lr) * N + g * TAPS + t];
            }
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                const int lr = lr0 + j;
                if (lr >= live || !stored(lr)) continue;
                const int r = m0 + lr;
                const int i = r % lane_rows;
                float o[VEC];
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    float acc = 0.0f;
#pragma unroll
                    for (int t = 0; t < TAPS; ++t)
                        acc = i - t >= 0 ? fmaf(bv[t][e] + dv[j][t], xv[j + TAPS - 1 - t][e], acc) : acc;
                    o[e] = acc;
                }
                float* yp = y + (long long)r * H + c;
                if (VEC == 4) {
                    *reinterpret_cast<float4*>(yp) = make_float4(o[0], o[VEC > 1 ? 1 : 0], o[VEC > 2 ? 2 : 0],
                                                                 o[VEC > 3 ? 3 : 0]);
                } else {
                    *yp = o[0];
                }
            }
        }
    }
}

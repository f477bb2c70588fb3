// gemm_conv.cuh — gemm_stream.cu's GS_CONV epilogue: DFlash 2's "prepare" convolution
// (conv.cu's grouped_conv, half 0, no residual) fused into the kernel_projection GEMM that
// produces its coefficients, run by the block that holds a column block's final d.
// Contract: d = the GEMM's y [M, N], N = 2 * TAPS * G, columns [group][half][tap] (conv.cu's
// CONV_GMAJOR layout: the projection's rows permuted at upload), so the block owning columns
// [c0, c0 + COLS) holds both halves of the groups whose 2 * TAPS columns all lie there (every
// column block its share); for the channels of those groups and its stored rows it writes
//   y[r, c] = sum_{t < TAPS, i - t >= 0} (base[t, c] + d[r, g(c) * 2 * TAPS + t]) * x[r - t, c],
//   i = r % lane_rows,
// with grouped_conv's rounding: w = base + d in f32, then fmaf per tap in tap order from 0.
// x [M, H] f32 is the GEMM's own input (H = K), base [TAPS, H] f32, y [M, H] f32.
// NORM (the GEMM folds an RMSNorm, GS_NORM): rows >= norm_lo of x are convolved normed, as
// x'[r, c] = (x[r, c] * ln[c]) * rsc[r - m0], two f32 roundings: the product the GEMM's staging
// feeds its MMAs, times the row scale its epilogue multiplies the sums by (rsc: shared memory,
// the block's rows; the caller keeps every tap inside the block: no lane block straddles two).
// Called by all threads of the block after its d is stored (split K: the reducing block);
// d is read back from global memory after a barrier (the block's own stores).
// Work: the block's rows RB at a time; per batch a thread per VEC channels of one group (VEC 4
// where GROUP % 4 == 0: 16-byte x, base and y accesses, consecutive threads on consecutive
// chunks of a row): the rows' x window (RB + TAPS - 1 rows, each tap's earlier row shared) and
// their d issued together, then the sums. A tap before the lane block's first row is not added
// (its load reads an in-bounds stand-in row; the select keeps acc). Each row's lane index is
// stepped from the batch's first (one division per batch, not per row).
// NORM, lane_rows < 0: y[r, c] = the normed x' below instead, the rows conv.cu's
// grouped_conv then convolves as this would (a launch whose tail would be too long); base is
// still read (any TAPS * H floats: no branch before the loads), its values unused.
#pragma once

// rows x taps per batch: the batch's loads in flight at once in MT 1's 128 registers (16 made
// ptxas interleave them with the sums: 2 to 12 round trips a batch); ops/gemm_stream.py reads it
#define GEMM_CONV_ROWS 8

// VEC consecutive floats (VEC 4: one 16-byte access; the caller keeps them aligned)
template <int VEC>
__device__ __forceinline__ void gemm_conv_ld(float* o, const float* p) {
    if (VEC == 4) {
        const float4 v = *reinterpret_cast<const float4*>(p);
        o[0] = v.x; o[VEC > 1 ? 1 : 0] = v.y; o[VEC > 2 ? 2 : 0] = v.z; o[VEC > 3 ? 3 : 0] = v.w;
    } else {
        o[0] = *p;
    }
}

template <int VEC>
__device__ __forceinline__ void gemm_conv_st(float* p, const float* o) {
    if (VEC == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(o[0], o[VEC > 1 ? 1 : 0], o[VEC > 2 ? 2 : 0], o[VEC > 3 ? 3 : 0]);
    } else {
        *p = o[0];
    }
}

template <int TAPS, int GROUP, int H, int COLS, int THREADS, int NORM, typename Stored>
__device__ __forceinline__ void gemm_conv_prepare(const float* __restrict__ x, const float* d, int N,
                                                  const float* __restrict__ base, float* y, int m0, int live,
                                                  int c0, int lane_rows, Stored stored,
                                                  const float* __restrict__ ln, const float* rsc, int norm_lo) {
    constexpr int VEC = (GROUP % 4 == 0 && H % 4 == 0) ? 4 : 1;
    constexpr int RB = (GEMM_CONV_ROWS / TAPS) > 1 ? GEMM_CONV_ROWS / TAPS : 1;   // rows per batch
    constexpr int XW = RB + TAPS - 1;                      // x rows per batch (window)
    constexpr int GC = 2 * TAPS;                           // a group's columns
    const int c1 = (c0 + COLS < N) ? c0 + COLS : N;
    const int g0 = (c0 + GC - 1) / GC, g1 = c1 / GC;        // groups wholly in [c0, c1)
    if (g1 <= g0) return;
    const int ch0 = g0 * GROUP;
    const int nq = (g1 - g0) * (GROUP / VEC);               // VEC-channel chunks
    __syncthreads();   // every thread's d stores before any load of them
    const int top = m0 + live - 1;                          // the block's last row
    const bool xonly = NORM && lane_rows < 0;               // y = the normed x rows, no sums
    for (int lr0 = 0; lr0 < live; lr0 += RB) {
        const int i0 = xonly ? 0 : (m0 + lr0) % lane_rows;  // the batch's first row's index in its lane
        for (int q = threadIdx.x; q < nq; q += THREADS) {
            const int c = ch0 + q * VEC;
            const int g = c / GROUP;
            float bv[TAPS][VEC], xv[XW][VEC], dv[RB][TAPS], gv[NORM ? VEC : 1];
#pragma unroll
            for (int t = 0; t < TAPS; ++t) gemm_conv_ld<VEC>(bv[t], base + t * H + c);   // xonly: unused
            if (NORM) gemm_conv_ld<VEC>(gv, ln + c);
            // window row w: row m0 + lr0 + w - (TAPS - 1) clamped into [0, top] (a clamped row
            // is one no tap reads), d of rows past the block: the last row's; no branch between
            // the loads and the sums (every load in flight at once)
#pragma unroll
            for (int w = 0; w < XW; ++w) {
                int xr = m0 + lr0 + w - (TAPS - 1);
                xr = xr < 0 ? 0 : (xr > top ? top : xr);
                gemm_conv_ld<VEC>(xv[w], x + ((long long)xr * H + c));
            }
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                const int r = (m0 + lr0 + j < top) ? m0 + lr0 + j : top;
#pragma unroll
                for (int t = 0; t < TAPS; ++t) dv[j][t] = d[(long long)r * N + g * GC + t];
            }
            if (NORM) {   // the normed rows (after every load of the batch is issued)
#pragma unroll
                for (int w = 0; w < XW; ++w) {
                    int xr = m0 + lr0 + w - (TAPS - 1);
                    xr = xr < m0 ? m0 : (xr > top ? top : xr);   // a row no tap reads: any scale
                    const float s = rsc[xr - m0];
#pragma unroll
                    for (int e = 0; e < VEC; ++e)
                        if (xr >= norm_lo) xv[w][e] = __fmul_rn(__fmul_rn(xv[w][e], gv[NORM ? e : 0]), s);
                }
            }
            float* yp = y + ((long long)(m0 + lr0) * H + c);
            int i = i0;
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                float o[VEC];
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    float acc = 0.0f;
#pragma unroll
                    for (int t = 0; t < TAPS; ++t)
                        acc = i - t >= 0 ? fmaf(bv[t][e] + dv[j][t], xv[j + TAPS - 1 - t][e], acc) : acc;
                    o[e] = xonly ? xv[j + TAPS - 1][e] : acc;
                }
                if (lr0 + j < live && stored(lr0 + j)) gemm_conv_st<VEC>(yp + j * H, o);
                i = (i + 1 == lane_rows) ? 0 : i + 1;
            }
        }
    }
}

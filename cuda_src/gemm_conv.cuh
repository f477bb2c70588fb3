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
// Work: a thread per VEC channels of one group (VEC 4 where GROUP % 4 == 0: 16-byte x, base and
// y accesses, consecutive threads on consecutive chunks of a row) and its rows, or where a full
// column block has fewer chunks than threads (a 128-column GS_CONV block: 128 chunks), one of
// PARTS parts of its rows (whole batch pairs, each part's first tap reading the row before it),
// so no thread idles and each one's chain is its part's; a work item's rows RB at a time in two
// register sets: batch b + 1's x window (RB + TAPS - 1 rows, each tap's earlier row shared) and
// d (one access for 2 or 4 taps) are issued before batch b's norm, sums and stores, so a pair of
// batches costs one L2 round trip (ops/gemm_stream.py conv_tail_trips). A row that does not exist
// (past the block's live rows, before row 0) is not loaded, and nothing reads its register; a
// tap before the lane's first row is not added (each row's lane index stepped row by row).
// d is not __restrict__: its loads (this kernel's own stores) stay ahead of the y stores after them.
// NORM, lane_rows < 0: y[r, c] = the normed x' below instead, the rows conv.cu's
// grouped_conv then convolves as this would (a launch whose tail would be too long).
#pragma once

// rows x taps per batch: two batches' loads in flight at once in MT 1's 128 registers (16 rows x
// taps in one batch made ptxas interleave the loads with the sums, or spill); ops/gemm_stream.py
// and profiling/counters.py read it
#define GEMM_CONV_ROWS 8

// V consecutive floats (V 4: one 16-byte access, V 2: one 8-byte access; the caller keeps them
// aligned; any other V: one float at a time)
template <int V>
__device__ __forceinline__ void gemm_conv_ld(float* o, const float* p) {
    if (V == 4) {
        const float4 v = *reinterpret_cast<const float4*>(p);
        o[0] = v.x; o[V > 1 ? 1 : 0] = v.y; o[V > 2 ? 2 : 0] = v.z; o[V > 3 ? 3 : 0] = v.w;
    } else if (V == 2) {
        const float2 v = *reinterpret_cast<const float2*>(p);
        o[0] = v.x; o[V > 1 ? 1 : 0] = v.y;
    } else {
#pragma unroll
        for (int e = 0; e < V; ++e) o[e] = p[e];
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

template <int TAPS, int GROUP, int H, int COLS, int ROWS, int THREADS, int NORM, typename Stored>
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
    const int nlo = norm_lo - m0;                           // the first normed row, block-relative
    if (NORM && lane_rows < 0) {   // the normed rows only, XR a round trip (no base, no d)
        constexpr int XR = 2 * RB;
        for (int q = threadIdx.x; q < nq; q += THREADS) {
            const int c = ch0 + q * VEC;
            const float* xm = x + ((long long)m0 * H + c);
            float* ym = y + ((long long)m0 * H + c);
            float gv[VEC], xv[XR][VEC] = {};
            gemm_conv_ld<VEC>(gv, ln + c);
            for (int lr0 = 0; lr0 < live; lr0 += XR) {
#pragma unroll
                for (int j = 0; j < XR; ++j)
                    if (lr0 + j < live) gemm_conv_ld<VEC>(xv[j], xm + (lr0 + j) * H);
#pragma unroll
                for (int j = 0; j < XR; ++j) {
                    const int r = lr0 + j;
                    if (r < live) {
                        const float s = rsc[r];
#pragma unroll
                        for (int e = 0; e < VEC; ++e)
                            if (r >= nlo) xv[j][e] = __fmul_rn(__fmul_rn(xv[j][e], gv[e]), s);
                        if (stored(r)) gemm_conv_st<VEC>(ym + r * H, xv[j]);
                    }
                }
            }
        }
        return;
    }
    static_assert(16 % RB == 0, "a batch's rows lie in one 16-row tile (stored() once a batch)");
    constexpr int NC = 2 * TAPS * (H / GROUP);              // = N (the caller's contract): d's row stride
    // Work items: a chunk's rows, or where a full column block has fewer chunks (NQF) than
    // threads, PARTS parts of them of PART_ROWS (whole batch pairs; a part's first tap reads the
    // row before it like any batch's): each thread's dependent chain is its part's pairs, not
    // the block's; compile-time bounds, so the divisions are shifts and a part's pairs unroll
    constexpr int NQF = (COLS / GC) * (GROUP / VEC) > 0 ? (COLS / GC) * (GROUP / VEC) : 1;
    constexpr int NPAIRS = (ROWS + 2 * RB - 1) / (2 * RB);
    constexpr int PARTS = THREADS / NQF < 1 ? 1 : (THREADS / NQF < NPAIRS ? THREADS / NQF : NPAIRS);
    constexpr int PART_ROWS = (NPAIRS + PARTS - 1) / PARTS * (2 * RB);
    const int i0 = m0 % lane_rows;                          // the block's first row's index in its lane
    for (int it = threadIdx.x; it < NQF * PARTS; it += THREADS) {
        const int q = it % NQF, r0 = (it / NQF) * PART_ROWS;
        const int rend = (r0 + PART_ROWS < live) ? r0 + PART_ROWS : live;
        if (q >= nq || r0 >= rend) continue;   // (a column block's missing groups; short blocks)
        const int c = ch0 + q * VEC;
        // the part's first row (row offsets below: block-relative, int)
        const float* xm = x + ((long long)(m0 + r0) * H + c);
        const float* dm = d + ((long long)(m0 + r0) * NC + (c / GROUP) * GC);   // its group's half-0 taps
        float* ym = y + ((long long)(m0 + r0) * H + c);
        float bv[TAPS][VEC], gv[NORM ? VEC : 1];
#pragma unroll
        for (int t = 0; t < TAPS; ++t) gemm_conv_ld<VEC>(bv[t], base + t * H + c);
        if (NORM) gemm_conv_ld<VEC>(gv, ln + c);
        // a batch's loads (its first row's x, d at xr, dr): its x window (window row w: row
        // lr0 + w - (TAPS - 1)) and its rows' d, each row that exists (before the block: from
        // row 0; its own: up to live) loaded, no branch among them; a row not loaded keeps an
        // earlier value, which no tap or store reads
        auto issue = [&](float (&xv)[XW][VEC], float (&dv)[RB][TAPS], const float* xr, const float* dr, int lr0) {
#pragma unroll
            for (int w = 0; w < TAPS - 1; ++w)
                if (lr0 + w - (TAPS - 1) >= -m0) gemm_conv_ld<VEC>(xv[w], xr + (w - (TAPS - 1)) * H);
#pragma unroll
            for (int j = 0; j < RB; ++j)
                if (j < rend - lr0) {
                    gemm_conv_ld<VEC>(xv[TAPS - 1 + j], xr + j * H);
                    gemm_conv_ld<TAPS>(dv[j], dr + j * NC);
                }
        };
        // a batch's sums and stores (after its loads arrive), its window normed first
        int i = i0 + r0;   // the row's index in its lane, stepped row by row
        if (i >= lane_rows) i %= lane_rows;
        auto finish = [&](float (&xv)[XW][VEC], const float (&dv)[RB][TAPS], float* yr, int lr0) {
            if (NORM) {   // (rows past live: rsc's entries up to lr0 + RB <= ROWS, read for rows no store reads)
#pragma unroll
                for (int w = 0; w < XW; ++w) {
                    const int r = lr0 + w - (TAPS - 1);
                    const float s = rsc[r < 0 ? 0 : r];   // r < 0: a row no tap reads (NORM: lanes inside the block)
#pragma unroll
                    for (int e = 0; e < VEC; ++e)
                        if (r >= nlo) xv[w][e] = __fmul_rn(__fmul_rn(xv[w][e], gv[NORM ? e : 0]), s);
                }
            }
            const bool st = stored(lr0);   // the batch's 16-row tile's (RB divides 16)
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                float o[VEC];
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    float acc = 0.0f;
#pragma unroll
                    for (int t = 0; t < TAPS; ++t)
                        acc = t == 0 || i >= t ? fmaf(bv[t][e] + dv[j][t], xv[j + TAPS - 1 - t][e], acc) : acc;
                    o[e] = acc;
                }
                if (st && j < rend - lr0) gemm_conv_st<VEC>(yr + j * H, o);
                i = (i + 1 == lane_rows) ? 0 : i + 1;
            }
        };
        // two register sets (batches a and b): the next batch's loads are issued before this
        // one's sums and stores, so a pair of batches costs one round trip
        float xa[XW][VEC] = {}, da[RB][TAPS] = {}, xb[XW][VEC] = {}, db[RB][TAPS] = {};
        const float* xr = xm;   // batch a's first row's
        const float* dr = dm;
        float* yr = ym;
        issue(xa, da, xr, dr, r0);
#pragma unroll
        for (int p0 = 0; p0 < PART_ROWS; p0 += 2 * RB, xr += 2 * RB * H, dr += 2 * RB * NC, yr += 2 * RB * H) {
            const int lr0 = r0 + p0;
            if (lr0 >= rend) break;
            const bool second = lr0 + RB < rend;
            if (second) issue(xb, db, xr + RB * H, dr + RB * NC, lr0 + RB);
            finish(xa, da, yr, lr0);
            if (lr0 + 2 * RB < rend) issue(xa, da, xr + 2 * RB * H, dr + 2 * RB * NC, lr0 + 2 * RB);
            if (second) finish(xb, db, yr + RB * H, lr0 + RB);
        }
    }
}

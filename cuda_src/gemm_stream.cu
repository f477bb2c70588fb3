// gemm_stream.cu — weight-streaming tensor-core GEMM for small M (f16 / bf16 weights).
// Design, budgets and figures: docs/decisions/gemm.md ("gemm_stream.cu").
//
// Contract:  acc[m, n] = sum_k xe[m, k] * W[n, k]  (f32 accumulation), xe = hi + lo
// (GS_SPLIT 2: x as two rounded halves of the weight type) or hi (GS_SPLIT 1).
//   GS_EPI 0: y = acc   1: y = r + acc (r may be y)   2: y = silu(acc_gate) * acc_up (W [2N, K])
//   GS_EPI 3: the lm_head's greedy token: per (row, column block) the best column (float_order.cuh,
//             ties: lowest) into ws as u32 pairs [M][groups][2]; y = acc only with GS_LOGITS 1.
//   GS_EPI 4: top-K (GS_TOPK <= 64): per (row, column block) its K best (order key, id) into ws,
//             u32 [M][groups][K][2], best first, empty slots (0, 0xffffffff): selector.cu's partials
//             (its ranking and merge). y = acc only with GS_LOGITS 1; >= GS_TK_SMEM dynamic smem.
//   GS_NORM 1: rows >= norm_lo enter as rmsnorm(x_row) * ln (fixed-order sums, also across
//             split-K slices: replays bit-identical); rows < norm_lo raw, or with ln_lo (use_ln_lo).
//   GS_CONV 1 (EPI 0, f32 x, y): conv_lane_rows > 0: DFlash 2's prepare convolution of x (GS_NORM: normed)
//             into conv_y by the block holding the final d (gemm_conv.cuh); < 0: that x into conv_y.
//   GS_FIN 1 (EPI 1, f32 y): with fin_lane_rows > 0, y = r + DFlash 2's finish convolution of acc
//             (gemm_fin.cuh; the final tile staged in >= GS_FIN_SMEM dynamic smem), lanes in a block.
//   Rows < row_split are read from x, the rest from x2 (its row 0 first).
//   Padding rows [*pad_lo, pad_hi) count as zero rows (not read; all-padding tiles not computed).
//   use_live: tile_live[t] == 0 (per 16 rows) makes tile t dead: not computed, not stored.
// Layouts: x [M, K] f32 (GS_X16 1, GS_SPLIT 1: the weight type's bits, results bit-identical),
// W [N or 2N, K] 16-bit, y, r [M, N] f32 (GS_Y16 1: the weight type's bits, not with GS_EPI 3);
// row-major, 16-byte aligned, K % 8 == 0.
//
// Launch (ops/gemm_stream.plan): block = GS_WARPS * 32 threads owning COLS = GS_WARPS * 8 * GS_NT
// columns and ROWS = 16 * GS_MT rows; grid = (groups * mblocks, 1, ks), blockIdx.x = cg * mblocks
// + mb (M block fastest: one column group's blocks share its weights through L2), z = K slice
// [z * kz, min(K, z * kz + kz)). kz and kt (x chunk) are multiples of 64; dynamic shared memory =
// GS_SPLIT * 16 * tiles * (kt + 32) * 2 bytes, plus (GS_NORM, f32 x) (16 * tiles + 2) * kt * 4 for
// the raw chunk and its gammas, copied by cp.async one chunk ahead. GS_MT 1, 2, 4 are compiled
// per bucket.
// Split K (gridDim.z > 1): partial tiles in ws [groups * mblocks][ks][NW][ROWS][COLS] (then, with
// GS_NORM, the slices' row sums of squares); the last slice to arrive (counters[blockIdx.x], zero
// between launches, reset by it) sums them in z order and applies the epilogue (gemm_splitk.cuh).
// Inner loop: each warp streams its weight rows through a register ring GS_DEPTH 64-k steps deep
// (two 16-byte ld.global.cs per row and step, no shared memory); x is staged once per chunk into
// a conflict-free shared tile (row stride 64 mod 128 bytes) read by mma.sync m16n8k16 (GS_NORM
// with an f32 x: converted there from the raw chunk that cp.async brought in during the last one).
// Registers: ops/gemm_stream.PTXAS_REGS (held by tests/test_gemm_stream.py).
// NVRTC checks: the launcher's options of each GemmVariant in tests/support/gemm_variants.py.

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "float_order.cuh"
#include "bits16.cuh"
#include "gemm_epilogue.cuh"
// GS_CONV (kernel_projection: K slices of a few column groups, a grid under one wave whatever
// the rows) fits one block an SM (GS_MINB 1): its reduction keeps twice the partial loads in
// flight (gemm_splitk.cuh's SPLITK_INFLIGHT_16_ONE)
#if defined(GS_CONV) && GS_CONV
#define SPLITK_ONE_BLOCK 1
#endif
#include "gemm_splitk.cuh"
#include "gemm_conv.cuh"
#include "gemm_fin.cuh"
#include "mma.cuh"
#include "warp.cuh"
#include "pdl.cuh"

#ifndef GS_WTYPE
#define GS_WTYPE 2
#endif
#ifndef GS_EPI
#define GS_EPI 0
#endif
#ifndef GS_LOGITS
#define GS_LOGITS 0
#endif
#ifndef GS_K
#define GS_K 256
#endif
#ifndef GS_MT
#define GS_MT 1
#endif
#ifndef GS_NT
#define GS_NT 4
#endif
#ifndef GS_WARPS
#define GS_WARPS 8
#endif
#ifndef GS_SPLIT
#define GS_SPLIT 2
#endif
#ifndef GS_NORM
#define GS_NORM 0
#endif
#ifndef GS_X16
#define GS_X16 0
#endif
#if GS_X16
#define GS_XT unsigned short  // x holds the weight type's bits
#else
#define GS_XT float
#endif
#ifndef GS_Y16
#define GS_Y16 0
#endif
#if GS_Y16
#define GS_YT unsigned short  // y written rounded to the weight type
#else
#define GS_YT float
#endif
#ifndef GS_DEPTH
#define GS_DEPTH (GS_MT == 1 ? 2 : 3)  // MT 1 keeps 2 blocks per SM in 128 registers; MT 2, 4 have the room
#endif
#ifndef GS_MINB
#if defined(GS_CONV) && GS_CONV
#define GS_MINB 1                     // (see SPLITK_ONE_BLOCK above)
#else
#define GS_MINB (GS_MT == 1 ? 2 : 1)  // blocks per SM ptxas must fit: MT 1 fits 2 in 128 registers
#endif
#endif

#ifndef GS_CONV
#define GS_CONV 0
#endif
#if GS_CONV && (GS_EPI != 0 || GS_X16 || GS_Y16)
#error "GS_CONV (the fused prepare convolution) needs GS_EPI 0 and an f32 x and y"
#endif
#if GS_CONV && (!defined(GS_CONV_TAPS) || !defined(GS_CONV_GROUP))
#error "GS_CONV needs GS_CONV_TAPS and GS_CONV_GROUP"
#endif
#if GS_CONV && GS_K % GS_CONV_GROUP != 0
#error "GS_CONV: GS_CONV_GROUP must divide the hidden size GS_K"
#endif

#ifndef GS_FIN
#define GS_FIN 0
#endif
#if GS_FIN && (GS_EPI != 1 || GS_NORM || GS_Y16 || GS_CONV)
#error "GS_FIN (the fused finish convolution) needs GS_EPI 1 and an f32 y, no folded norm, no GS_CONV"
#endif
#if GS_FIN && (!defined(GS_CONV_TAPS) || !defined(GS_CONV_GROUP))
#error "GS_FIN needs GS_CONV_TAPS and GS_CONV_GROUP"
#endif
// GS_FIN: the staged tile [ROWS][COLS + GEMM_FIN_PAD] f32 in the x staging's dynamic shared memory
#define GS_FIN_SMEM (16 * GS_MT * (GS_WARPS * 8 * GS_NT + GEMM_FIN_PAD) * 4)

#if GS_EPI == 3 && defined(GS_NORM) && GS_NORM
#error "the fused argmax (GS_EPI 3) does not apply a folded RMSNorm (GS_NORM)"
#endif
#ifndef GS_TOPK
#define GS_TOPK 16
#endif
#if GS_EPI == 4 && (GS_NORM || GS_Y16 || GS_TOPK < 1 || GS_TOPK > 64)
#error "the fused top-K (GS_EPI 4) needs 1 <= GS_TOPK <= 64, no GS_NORM, no GS_Y16"
#endif
// GS_EPI 4: the key tile [ROWS][COLS + 8] u32 in the x staging's dynamic shared memory (the
// launcher provides at least this; row stride 8 mod 32 words: conflict-free stores and reads)
#define GS_TK_SMEM (16 * GS_MT * (GS_WARPS * 8 * GS_NT + 8) * 4)
#if GS_MT != 1 && GS_MT != 2 && GS_MT != 4
#error "GS_MT must be 1, 2 or 4 (16, 32 or 64 rows per block)"
#endif
#if GS_K % 8 != 0
#error "GS_K must be a multiple of 8 (16-byte weight loads)"
#endif
#if GS_SPLIT != 1 && GS_SPLIT != 2
#error "GS_SPLIT must be 1 (x rounded) or 2 (x as hi + lo)"
#endif
#if GS_NORM != 0 && GS_NORM != 1
#error "GS_NORM must be 0 or 1 (RMSNorm of x's rows folded in)"
#endif
#if GS_X16 != 0 && GS_X16 != 1
#error "GS_X16 must be 0 (x f32) or 1 (x in the weight type)"
#endif
#if GS_X16 && GS_SPLIT != 1
#error "GS_X16 needs GS_SPLIT 1: a 16-bit x has no lo half"
#endif
#if GS_Y16 != 0 && GS_Y16 != 1
#error "GS_Y16 must be 0 (y f32) or 1 (y in the weight type)"
#endif
#if GS_Y16 && GS_EPI == 3
#error "GS_Y16 does not apply to the fused argmax (its logits stay f32)"
#endif
#if GS_WTYPE != 1 && GS_WTYPE != 2
#error "GS_WTYPE must be 1 (f16) or 2 (bf16)"
#endif
#if GS_DEPTH < 1 || GS_DEPTH > 4
#error "GS_DEPTH must be 1..4"
#endif

namespace gemm_stream_detail {

constexpr int K = GS_K;
constexpr int MT = GS_MT;
constexpr int NT = GS_NT;
constexpr int NW = (GS_EPI == 2) ? 2 : 1;       // weight rows per output column
constexpr int WT = NT * NW;                     // 8-row weight tiles per warp
constexpr int ROWS = 16 * MT;
constexpr int THREADS = GS_WARPS * 32;
constexpr int COLS = GS_WARPS * 8 * NT;         // output columns per block
constexpr int D = GS_DEPTH;
constexpr int KSTEP = 64;                       // k per ring step
#ifndef GS_XB   // x staging: float4 (uint4 with GS_X16) items a thread loads at once, in the registers
#define GS_XB ((GS_MT == 4 && GS_SPLIT == 2) ? 8 : 4)   // left beside the ring and accumulators
#endif
#define GS_XN 2   // GS_NORM (f32 x): (x, ln) float4 pairs a lane converts at once (from shared memory)
#define GS_RAW (GS_NORM && !GS_X16)   // x and the gammas reach shared memory raw (f32) by cp.async

// cp.async (sm_80+): a 16-byte global -> shared copy that holds no register while in flight;
// the copies of a group (GS_CP_COMMIT) land by GS_CP_WAIT. Macros, so that each copy keeps its
// own source line (the cost model pairs the SASS's LDGSTS with the emulator's counts by line).
// Under the emulator the copy happens at once (as if it had already landed).
#ifdef __CUDA_ARCH__
#define GS_CP_ASYNC16(dst, src)                                                       \
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(                 \
                     (unsigned int)__cvta_generic_to_shared(dst)), "l"(src) : "memory")
#define GS_CP_COMMIT() asm volatile("cp.async.commit_group;\n" ::: "memory")
#define GS_CP_WAIT() asm volatile("cp.async.wait_group 0;\n" ::: "memory")
#else
#define GS_CP_ASYNC16(dst, src) (*reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src))
#define GS_CP_COMMIT() ((void)0)
#define GS_CP_WAIT() ((void)0)
#endif

__device__ __forceinline__ unsigned int to16(float v) { return to_bits16<GS_WTYPE>(v); }
__device__ __forceinline__ float from16(unsigned int b) { return from_bits16<GS_WTYPE>(b); }

__device__ __forceinline__ void mma(float d[4], const unsigned int a[4], unsigned int b0, unsigned int b1) {
    const unsigned int b[2] = {b0, b1};
#if GS_WTYPE == 2
    mma_m16n8k16_bf16(d, a, b, d);
#else
    mma_m16n8k16_f16(d, a, b, d);
#endif
}

__device__ __forceinline__ void store(GS_YT* y, const float* r, long long o, float a, float u) {
#if GS_EPI == 3 || GS_EPI == 4
    if (GS_LOGITS) y[o] = a;  // the fused argmax / top-K: logits only on request
    (void)r;
    (void)u;
#else
    epilogue_store<GS_EPI, GS_WTYPE>(y, r, o, a, u);
#endif
}

// One ring slot: the lane's 16 weights at k + 8t and k + 32 + 8t of each of its WT rows, as two
// 16-byte halves. Rows past N and k past the slice read as zeros (no access):
// the slice end is a multiple of 8, so each 16-byte half is wholly in or out.
struct Slot {
    uint4 v[WT][2];
};

__device__ __forceinline__ void load_slot(Slot& s, const unsigned short* const wrow[WT], unsigned int ok,
                                          int k, int k_end) {
#pragma unroll
    for (int j = 0; j < WT; j++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int kk = k + 32 * h;  // k already includes the lane's 8t
            s.v[j][h] = make_uint4(0u, 0u, 0u, 0u);
            if (((ok >> j) & 1u) && kk < k_end) s.v[j][h] = __ldcs(reinterpret_cast<const uint4*>(wrow[j] + kk));
        }
    }
}

}  // namespace gemm_stream_detail

extern "C" __global__ void __launch_bounds__(GS_WARPS * 32, GS_MINB)
gemm_stream(const GS_XT* __restrict__ x, const unsigned short* __restrict__ w, GS_YT* y, const float* r,
            int M, int N, int kz, int kt, float* ws, int* counters, const int* pad_lo, int pad_hi,
            const float* __restrict__ ln, float eps, int norm_lo, const int* tile_live, int use_live,
            const GS_XT* __restrict__ x2, int row_split, const float* __restrict__ ln_lo, int use_ln_lo,
            const float* __restrict__ conv_base, float* conv_y, int conv_lane_rows,
            const float* __restrict__ fin_base, const float* __restrict__ fin_d, int fin_lane_rows) {
    using namespace gemm_stream_detail;
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned short* xs = reinterpret_cast<unsigned short*>(smem);

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    // Linear block index: M block fastest, so the M blocks of one column group are
    // adjacent in launch order and stream the same weights together (from L2).
    const int mblocks = (M + ROWS - 1) / ROWS;
    const int cg = (int)blockIdx.x / mblocks;                  // column group
    const int m0 = ((int)blockIdx.x - cg * mblocks) * ROWS;
    const int live = (M - m0 < ROWS) ? (M - m0) : ROWS;     // rows of this block that exist
    const int tiles = (live + 15) >> 4;                       // 16-row tiles holding a row < M
    const int xstride = kt + 32;                               // elements; 64 (mod 128) bytes
    const int plane = tiles * 16 * xstride;                    // hi plane, then lo plane
    const int n0 = cg * COLS + warp * 8 * NT;          // this warp's first output column

    // PDL (pdl.cuh): before the wait only the weights, which no kernel of a step writes, are
    // touched: lane t sends its rows' line of ring step t (t < D) to L2 while the kernel before
    // drains, so the ring's first loads below find them there.
    if (t < D && (int)blockIdx.z * kz + t * KSTEP < K) {
#pragma unroll
        for (int j = 0; j < WT; j++) {
            const int n = n0 + 8 * (j % NT) + g;
            if (n < N) prefetch_l2(w + ((long long)n + (j >= NT ? (long long)N : 0ll)) * K + (int)blockIdx.z * kz + t * KSTEP);
        }
    }
    pdl_wait();
    pdl_launch_dependents();

    // The weight ring's first slots depend on nothing the step writes: issued before the
    // row flags below, so both are one L2 round trip, not two (a dead block drops them)
    const int k_begin = blockIdx.z * kz;
    const int k_end = (k_begin + kz < K) ? k_begin + kz : K;
    const int nsteps = (k_end > k_begin) ? (k_end - k_begin + KSTEP - 1) / KSTEP : 0;
    const int spc = kt / KSTEP;                                // ring steps per staged x chunk

    // Weight tile j: gate (or only) rows for j < NT, up rows (N further) for j >= NT.
    const unsigned short* wrow[WT];
    unsigned int ok = 0u;
#pragma unroll
    for (int j = 0; j < WT; j++) {
        const int n = n0 + 8 * (j % NT) + g;
        const bool v = n < N;
        ok |= (v ? 1u : 0u) << j;
        wrow[j] = w + ((long long)(v ? n : 0) + (j >= NT ? (long long)N : 0ll) * (v ? 1 : 0)) * K;
    }

    Slot ring[D];
#pragma unroll
    for (int d = 0; d < D; d++) load_slot(ring[d], wrow, ok, k_begin + d * KSTEP + 8 * t, k_end);

    // Padding rows [lo, pad_hi), lo read from device memory (inside a captured
    // graph the live row count changes per step): they count as zero rows, never
    // read from x, and a 16-row tile with no other row is not computed. Their
    // outputs are the epilogue of acc = 0, as if x held zeros there.
    int lo = pad_hi;
    if (pad_hi > 0) {
        lo = *pad_lo;
        lo = (lo < 0) ? 0 : ((lo > pad_hi) ? pad_hi : lo);
    }
    // Dead tiles (use_live and tile_live[tile] == 0, one flag per 16 rows of the
    // launch, written on the device: lanes that are idle this step) are neither
    // computed nor stored: their y rows keep whatever they hold.
    // Bits 0..MT-1: tiles with a row to compute; bits 8..8+MT-1: tiles whose rows
    // are stored (one register for both; block-uniform).
    // The MT flags are loaded together (one round trip), before any is tested.
    unsigned int live_tiles = 0u;
#pragma unroll
    for (int i = 0; i < MT; i++)
        live_tiles |= (unsigned int)(!use_live || m0 + 16 * i >= M || tile_live[(m0 >> 4) + i] != 0) << i;
    unsigned int tmask = 0u;
#pragma unroll
    for (int i = 0; i < MT; i++) {
        const int a = m0 + 16 * i, b = (a + 16 < M) ? a + 16 : M;
        if (a < b && ((live_tiles >> i) & 1u)) {
            tmask |= 1u << (8 + i);
            if (!(a >= lo && b <= pad_hi)) tmask |= 1u << i;
        }
    }
    // A block with nothing to store has nothing to do. With split K every slice of
    // this (column group, M block) sees the same flags: all leave here, before the
    // arrival count, and its counter stays 0.
    if (tmask == 0u) return;

    // Two inputs: rows < row_split are x's, rows >= row_split x2's from its first row (one
    // matrix: x2 = x + row_split * K), so [context rows; noise rows] need no concatenated copy.
    auto xrow = [&](int grow) {
        return grow < row_split ? x + (long long)grow * K : x2 + (long long)(grow - row_split) * K;
    };
    // GS_NORM: rows >= norm_lo are normalised with ln, rows below with ln_lo when use_ln_lo (else
    // used raw): every row >= scale_lo gets its row scale.
    const int scale_lo = (GS_NORM && use_ln_lo) ? 0 : norm_lo;
#if GS_NORM
    __shared__ float ss_s[ROWS];  // row sums of squares over this block's K range
#if GS_RAW
    // each lane's partial sum of squares of each row across the chunks (k = 128j + 4 lane + 0..3
    // of the slice, the chunks whole multiples of 128): the warp's butterfly once, after the last
    // chunk, so the sums do not depend on kt (gemm_wgmma.cu's order, bit for bit)
    __shared__ float ss_l[ROWS][32];
#endif
    if (threadIdx.x < ROWS) ss_s[threadIdx.x] = 0.0f;  // ordered before use by the staging barrier
#else
    (void)ln;
    (void)eps;
    (void)norm_lo;
    (void)ln_lo;
    (void)use_ln_lo;
    (void)scale_lo;
#endif


#if GS_RAW
    // The x chunk [tiles * 16][kt] f32 and its gammas (ln [kt], then ln_lo [kt]) behind the
    // hi / lo planes, copied by cp.async one chunk ahead: every copy of a chunk is in flight at
    // once (no register holds them), over the weight ring's loads and the previous chunk's MMAs.
    // The same rows and k as the conversion below reads: a warp per row, lanes along k; rows
    // not read and k past the slice are not copied (nor read). ln is copied when a row of a
    // computed tile is >= norm_lo, ln_lo when use_ln_lo and one is below.
    // (addresses and flags recomputed where used: fewer registers live across the ring)
#define GS_XRAW reinterpret_cast<float*>(smem + (size_t)GS_SPLIT * plane * 2)
#define GS_GRAW (GS_XRAW + tiles * 16 * kt)
    auto stage_async = [&](int kc) {
        float* const xraw = GS_XRAW;
        float* const graw = GS_GRAW;
        bool ln_hi = false, ln_low = false;   // a computed tile has a row >= norm_lo / < norm_lo
#pragma unroll
        for (int i = 0; i < MT; i++) {
            if ((tmask >> i) & 1u) {
                ln_hi |= m0 + 16 * i + 15 >= norm_lo;
                ln_low |= use_ln_lo && m0 + 16 * i < norm_lo;
            }
        }
        for (int row = warp; row < tiles * 16; row += GS_WARPS) {
            const int grow = m0 + row;
            if (!((tmask >> (row >> 4)) & 1u) || row >= live || (grow >= lo && grow < pad_hi)) continue;
            for (int c4 = lane * 4; c4 < kt && kc + c4 < k_end; c4 += 128)
                GS_CP_ASYNC16(xraw + row * kt + c4, xrow(grow) + kc + c4);
        }
        for (int c4 = (int)threadIdx.x * 4; c4 < kt && kc + c4 < k_end; c4 += THREADS * 4) {
            if (ln_hi) GS_CP_ASYNC16(graw + c4, ln + kc + c4);
            if (ln_low) GS_CP_ASYNC16(graw + kt + c4, ln_lo + kc + c4);
        }
        GS_CP_COMMIT();
    };
    if (nsteps > 0) stage_async(k_begin);
#endif

    float acc[MT][WT][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < WT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

    for (int s0 = 0; s0 < nsteps; s0 += D) {
#pragma unroll
        for (int d = 0; d < D; d++) {
            const int s = s0 + d;
            if (s < nsteps) {  // block-uniform
                const int kb = (s % spc) * KSTEP;  // offset in the staged chunk
                if (kb == 0) {
                    // Stage x[m0 .. m0+16*tiles, kc .. kc+kt) in the weight type; rows
                    // past M and k past the slice as zeros (0 * NaN poison would leak).
                    const int kc = k_begin + s * KSTEP;
#if GS_RAW
                    GS_CP_WAIT();
#endif
                    __syncthreads();  // every warp is done with the previous chunk
#if GS_NORM && GS_X16
                    // One warp per row, 8 values (16 bytes) per lane: lane l holds k = 256j + 8l
                    // + 0..7. The sum of squares keeps the f32 path's order (below), where
                    // "lane" L sums k = 128jj + 4L + 0..3 over jj: lane l < 16 carries L = 2l
                    // (its values 0..3, jj = 2j) and 2l + 1 (values 4..7), then takes lane
                    // l + 16's values (jj = 2j + 1) by shuffle; before the butterfly lane L
                    // fetches its chain from lane L / 2.
                    for (int row = warp; row < tiles * 16; row += GS_WARPS) {
                        if (!((tmask >> (row >> 4)) & 1u)) continue;  // tile not computed: not staged
                        const int grow = m0 + row;
                        const bool rd = row < live && (grow < lo || grow >= pad_hi);
                        const bool nrm = grow >= scale_lo;
                        const float* gam = grow >= norm_lo ? ln : ln_lo;
                        float sa = 0.0f, sb = 0.0f;
                        for (int c0 = 0; c0 < kt; c0 += 256) {  // warp-uniform (shuffles)
                            const int c8 = c0 + 8 * lane, k = kc + c8;
                            uint4 v = make_uint4(0u, 0u, 0u, 0u);
                            if (rd && c8 < kt && k < k_end) v = *reinterpret_cast<const uint4*>(xrow(grow) + k);
                            const unsigned int q[4] = {v.x, v.y, v.z, v.w};
                            unsigned int u[4];
#pragma unroll
                            for (int e = 0; e < 4; e++) u[e] = __shfl_down_sync(0xffffffffu, q[e], 16);
                            if (lane < 16) {
#pragma unroll
                                for (int e = 0; e < 4; e++) {
                                    const float f0 = from16(q[e] & 0xffffu), f1 = from16(q[e] >> 16);
                                    if (e < 2) { sa = fmaf(f0, f0, sa); sa = fmaf(f1, f1, sa); }
                                    else { sb = fmaf(f0, f0, sb); sb = fmaf(f1, f1, sb); }
                                }
#pragma unroll
                                for (int e = 0; e < 4; e++) {
                                    const float f0 = from16(u[e] & 0xffffu), f1 = from16(u[e] >> 16);
                                    if (e < 2) { sa = fmaf(f0, f0, sa); sa = fmaf(f1, f1, sa); }
                                    else { sb = fmaf(f0, f0, sb); sb = fmaf(f1, f1, sb); }
                                }
                            }
                            unsigned int o[4] = {q[0], q[1], q[2], q[3]};
                            if (rd && nrm) {  // warp-uniform (rows not read stay zeros)
                                // ln[c0 + 8l .. + 7] for lane l, loaded coalesced (lane s: A = ln[c0 + 4s
                                // .. + 3], B = 128 further: 16 whole sectors per request) and handed
                                // over in 8 shuffles: lane l < 16 takes A of lanes 2l, 2l + 1, lane
                                // l >= 16 B of lanes 2l - 32, 2l - 31; each source sends A to one of
                                // its two readers and B to the other per round.
                                const int ca = c0 + 4 * lane;
                                float4 A = make_float4(0.0f, 0.0f, 0.0f, 0.0f), B = A;
                                if (ca < kt && kc + ca < k_end) A = *reinterpret_cast<const float4*>(gam + kc + ca);
                                if (ca + 128 < kt && kc + ca + 128 < k_end) B = *reinterpret_cast<const float4*>(gam + kc + ca + 128);
                                const float a4[4] = {A.x, A.y, A.z, A.w}, b4[4] = {B.x, B.y, B.z, B.w};
                                const bool odd = (lane & 1) != 0, low = lane < 16;
                                float gl[8];
#pragma unroll
                                for (int j = 0; j < 4; j++) {
                                    const float v0 = __shfl_sync(0xffffffffu, odd ? b4[j] : a4[j], (2 * lane + (low ? 0 : 1)) & 31);
                                    const float v1 = __shfl_sync(0xffffffffu, odd ? a4[j] : b4[j], (2 * lane + (low ? 1 : 0)) & 31);
                                    gl[j] = low ? v0 : v1;
                                    gl[4 + j] = low ? v1 : v0;
                                }
#pragma unroll
                                for (int e = 0; e < 4; e++)
                                    o[e] = to16(from16(q[e] & 0xffffu) * gl[2 * e]) |
                                           (to16(from16(q[e] >> 16) * gl[2 * e + 1]) << 16);
                            }
                            if (c8 < kt) *reinterpret_cast<uint4*>(xs + row * xstride + c8) = make_uint4(o[0], o[1], o[2], o[3]);
                        }
                        const float ca = __shfl_sync(0xffffffffu, sa, lane >> 1);
                        const float cb = __shfl_sync(0xffffffffu, sb, lane >> 1);
                        const float ss = warp_sum((lane & 1) ? cb : ca);
                        if (lane == 0) ss_s[row] += ss;  // this warp owns the row: chunk order
                    }
#elif GS_NORM
                    // The chunk copied by stage_async has landed (this thread's copies; the
                    // barrier above shows every thread's). One warp per row, lanes along k: the
                    // row's sum of squares in a fixed order.
                    const float* const xraw = GS_XRAW;
                    const float* const graw = GS_GRAW;
                    for (int row = warp; row < tiles * 16; row += GS_WARPS) {
                        if (!((tmask >> (row >> 4)) & 1u)) continue;  // tile not computed: not staged
                        const int grow = m0 + row;
                        const bool rd = row < live && (grow < lo || grow >= pad_hi);
                        const bool nrm = grow >= scale_lo;
                        const float* gam = graw + (grow >= norm_lo ? 0 : kt);
                        float ss = kc == k_begin ? 0.0f : ss_l[row][lane];
                        for (int cb = lane * 4; cb < kt; cb += GS_XN * 128) {
                            float4 xv[GS_XN], gv[GS_XN];
#pragma unroll
                            for (int u = 0; u < GS_XN; u++) {
                                const int c4 = cb + u * 128, k = kc + c4;
                                xv[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                                gv[u] = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
                                if (rd && c4 < kt && k < k_end) xv[u] = *reinterpret_cast<const float4*>(xraw + row * kt + c4);
                                if (nrm && c4 < kt && k < k_end) gv[u] = *reinterpret_cast<const float4*>(gam + c4);
                            }
#pragma unroll
                            for (int u = 0; u < GS_XN; u++) {
                                const int c4 = cb + u * 128, k = kc + c4;
                                if (c4 >= kt) break;
                                float4 v = xv[u];
                                ss = fmaf(v.x, v.x, ss);
                                ss = fmaf(v.y, v.y, ss);
                                ss = fmaf(v.z, v.z, ss);
                                ss = fmaf(v.w, v.w, ss);
                                if (nrm && k < k_end) {
                                    v.x *= gv[u].x;
                                    v.y *= gv[u].y;
                                    v.z *= gv[u].z;
                                    v.w *= gv[u].w;
                                }
                                const unsigned int h0 = to16(v.x), h1 = to16(v.y), h2 = to16(v.z), h3 = to16(v.w);
                                *reinterpret_cast<uint2*>(xs + row * xstride + c4) = make_uint2(h0 | (h1 << 16), h2 | (h3 << 16));
                                if (GS_SPLIT == 2) {
                                    const unsigned int l0 = to16(v.x - from16(h0)), l1 = to16(v.y - from16(h1));
                                    const unsigned int l2 = to16(v.z - from16(h2)), l3 = to16(v.w - from16(h3));
                                    *reinterpret_cast<uint2*>(xs + plane + row * xstride + c4) =
                                        make_uint2(l0 | (l1 << 16), l2 | (l3 << 16));
                                }
                            }
                        }
                        ss_l[row][lane] = ss;  // this lane owns it
                    }
#elif GS_X16
                    // x already holds the rounded values: 16-byte copies, 8 consecutive threads
                    // per 128 contiguous bytes of a row (kt / 8 is a multiple of 8), one wavefront
                    // per quarter warp
                    const int q8 = kt / 8, n8 = tiles * 16 * q8;
                    for (int i0 = threadIdx.x; i0 < n8; i0 += GS_XB * THREADS) {  // GS_XB loads in flight
                        uint4 v[GS_XB];
#pragma unroll
                        for (int u = 0; u < GS_XB; u++) {
                            const int i = i0 + u * THREADS;
                            const int row = i / q8, k = kc + (i - row * q8) * 8, grow = m0 + row;
                            v[u] = make_uint4(0u, 0u, 0u, 0u);
                            if (i < n8 && ((tmask >> (row >> 4)) & 1u) && row < live && k < k_end && (grow < lo || grow >= pad_hi))
                                v[u] = *reinterpret_cast<const uint4*>(xrow(grow) + k);
                        }
#pragma unroll
                        for (int u = 0; u < GS_XB; u++) {
                            const int i = i0 + u * THREADS;
                            const int row = i / q8, c8 = (i - row * q8) * 8;
                            if (i >= n8 || !((tmask >> (row >> 4)) & 1u)) continue;  // tile not computed: not staged
                            *reinterpret_cast<uint4*>(xs + row * xstride + c8) = v[u];
                        }
                    }
#else
                    // GS_XB items per thread at a time: their loads issued together (one L2 round
                    // trip per batch), then converted and stored
                    const int q4 = kt / 4, n4 = tiles * 16 * q4;
                    for (int i0 = threadIdx.x; i0 < n4; i0 += GS_XB * THREADS) {
                        float4 v[GS_XB];
#pragma unroll
                        for (int u = 0; u < GS_XB; u++) {
                            const int i = i0 + u * THREADS;
                            const int row = i / q4, k = kc + (i - row * q4) * 4, grow = m0 + row;
                            v[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                            if (i < n4 && ((tmask >> (row >> 4)) & 1u) && row < live && k < k_end && (grow < lo || grow >= pad_hi))
                                v[u] = *reinterpret_cast<const float4*>(xrow(grow) + k);
                        }
#pragma unroll
                        for (int u = 0; u < GS_XB; u++) {
                            const int i = i0 + u * THREADS;
                            const int row = i / q4, c4 = (i - row * q4) * 4;
                            if (i >= n4 || !((tmask >> (row >> 4)) & 1u)) continue;  // tile not computed: not staged
                            const unsigned int h0 = to16(v[u].x), h1 = to16(v[u].y), h2 = to16(v[u].z), h3 = to16(v[u].w);
                            *reinterpret_cast<uint2*>(xs + row * xstride + c4) = make_uint2(h0 | (h1 << 16), h2 | (h3 << 16));
                            if (GS_SPLIT == 2) {
                                const unsigned int l0 = to16(v[u].x - from16(h0)), l1 = to16(v[u].y - from16(h1));
                                const unsigned int l2 = to16(v[u].z - from16(h2)), l3 = to16(v[u].w - from16(h3));
                                *reinterpret_cast<uint2*>(xs + plane + row * xstride + c4) =
                                    make_uint2(l0 | (l1 << 16), l2 | (l3 << 16));
                            }
                        }
                    }
#endif
                    __syncthreads();
#if GS_RAW
                    if (kc + kt < k_end) stage_async(kc + kt);  // every warp is past the raw chunk
#endif
                }
#pragma unroll
                for (int i = 0; i < MT; i++) {
                    if ((tmask >> i) & 1u) {  // block-uniform: tiles past M or all padding cost nothing
#pragma unroll
                        for (int sp = 0; sp < GS_SPLIT; sp++) {
                            const unsigned short* xr = xs + sp * plane + (i * 16 + g) * xstride + kb + 8 * t;
                            const uint4 xa0 = *reinterpret_cast<const uint4*>(xr);
                            const uint4 xa1 = *reinterpret_cast<const uint4*>(xr + 32);
                            const uint4 xb0 = *reinterpret_cast<const uint4*>(xr + 8 * xstride);
                            const uint4 xb1 = *reinterpret_cast<const uint4*>(xr + 8 * xstride + 32);
                            // MMA q takes the lane's k + 8t + 32(q / 2) + 4(q % 2) + {0..3} (see the header)
                            const unsigned int a0[4] = {xa0.x, xb0.x, xa0.y, xb0.y};
                            const unsigned int a1[4] = {xa0.z, xb0.z, xa0.w, xb0.w};
                            const unsigned int a2[4] = {xa1.x, xb1.x, xa1.y, xb1.y};
                            const unsigned int a3[4] = {xa1.z, xb1.z, xa1.w, xb1.w};
#pragma unroll
                            for (int j = 0; j < WT; j++) {
                                const uint4 w0 = ring[d].v[j][0], w1 = ring[d].v[j][1];
                                mma(acc[i][j], a0, w0.x, w0.y);
                                mma(acc[i][j], a1, w0.z, w0.w);
                                mma(acc[i][j], a2, w1.x, w1.y);
                                mma(acc[i][j], a3, w1.z, w1.w);
                            }
                        }
                    }
                }
                // Refill the slot just consumed: GS_DEPTH steps ahead (past the slice: no access).
                load_slot(ring[d], wrow, ok, k_begin + (s + D) * KSTEP + 8 * t, k_end);
            }
        }
    }

#if GS_RAW
    if (nsteps > 0) {   // each row's sum: its warp's butterfly over the lane partials
        for (int row = warp; row < tiles * 16; row += GS_WARPS) {
            if (!((tmask >> (row >> 4)) & 1u)) continue;
            const float ss = warp_sum(ss_l[row][lane]);
            if (lane == 0) ss_s[row] = ss;
        }
    }
    __syncthreads();  // ss_s for the epilogue and the split-K partials
#endif
    // acc[i][j][e]: output row m0 + 16i + g (+8 for e >= 2), column n0 + 8(j % NT) + 2t + (e & 1);
    // j < NT gate (or only), j >= NT up.
#if GS_EPI == 3
    {
        // Each lane's best of its columns per row it holds (rows g, g + 8 of each tile),
        // then the 4 lanes of a row (xor 1, 2), then the warps in column order.
        __shared__ unsigned int bkey[GS_WARPS][ROWS];
        __shared__ int bcol[GS_WARPS][ROWS];
#pragma unroll
        for (int i = 0; i < MT; i++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = m0 + i * 16 + g + 8 * h;
                unsigned int bk = 0u;
                int bc = 0x7fffffff;
#pragma unroll
                for (int jn = 0; jn < NT; jn++) {
#pragma unroll
                    for (int c = 0; c < 2; c++) {
                        const int col = n0 + 8 * jn + 2 * t + c;
                        const float v = acc[i][jn][2 * h + c];
                        if (row < M && col < N && ((tmask >> (8 + i)) & 1u)) {
                            store(y, r, (long long)row * N + col, v, v);
                            const unsigned int k = order_key(v);
                            if (key_wins(k, col, bk, bc)) { bk = k; bc = col; }
                        }
                    }
                }
#pragma unroll
                for (int o = 1; o <= 2; o <<= 1) {
                    const unsigned int ok = __shfl_xor_sync(0xffffffffu, bk, o);
                    const int oc = __shfl_xor_sync(0xffffffffu, bc, o);
                    if (key_wins(ok, oc, bk, bc)) { bk = ok; bc = oc; }
                }
                if (t == 0) { bkey[warp][i * 16 + g + 8 * h] = bk; bcol[warp][i * 16 + g + 8 * h] = bc; }
            }
        }
        __syncthreads();
        unsigned int* part = reinterpret_cast<unsigned int*>(ws);
        for (int lr = threadIdx.x; lr < live; lr += THREADS) {
            if (!((tmask >> (8 + (lr >> 4))) & 1u)) continue;  // dead tile: no partial
            unsigned int bk = bkey[0][lr];
            int bc = bcol[0][lr];
            for (int wv = 1; wv < GS_WARPS; wv++)
                if (key_wins(bkey[wv][lr], bcol[wv][lr], bk, bc)) { bk = bkey[wv][lr]; bc = bcol[wv][lr]; }
            const long long o = ((long long)(m0 + lr) * ((int)gridDim.x / mblocks) + cg) * 2;  // [M][groups][2]
            part[o] = bk;
            part[o + 1] = (unsigned int)bc;
        }
        return;
    }
#elif GS_EPI == 4
    {
        // Every thread's order keys into the key tile (y too with GS_LOGITS), then warp w selects
        // rows w, w + GS_WARPS, ...: K rounds, each the largest rank word below the last winner
        // over the row's COLS columns (lane l: columns l + 32u), round r's winner kept by lane
        // r % 32 (r < 32: w0, else w1), stored by those lanes at the end.
        constexpr int TKS = COLS + 8, TKU = COLS / 32, TK = GS_TOPK;
        unsigned int* keys = reinterpret_cast<unsigned int*>(smem);
        unsigned int* part = reinterpret_cast<unsigned int*>(ws);
        const int groups = (int)gridDim.x / mblocks;
        __syncthreads();  // every warp past its MMAs' reads of xs
#pragma unroll
        for (int i = 0; i < MT; i++) {
            if (!((tmask >> (8 + i)) & 1u)) continue;  // dead tile: no partial (block-uniform)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int lr = i * 16 + g + 8 * h, row = m0 + lr;
#pragma unroll
                for (int jn = 0; jn < NT; jn++) {
                    const int lc = warp * 8 * NT + 8 * jn + 2 * t, col = n0 + 8 * jn + 2 * t;
                    const float a0 = acc[i][jn][2 * h], a1 = acc[i][jn][2 * h + 1];
                    if (row < M && col < N) store(y, r, (long long)row * N + col, a0, a0);
                    if (row < M && col + 1 < N) store(y, r, (long long)row * N + col + 1, a1, a1);
                    *reinterpret_cast<uint2*>(keys + lr * TKS + lc) = make_uint2(order_key(a0), order_key(a1));
                }
            }
        }
        __syncthreads();
        for (int lr = warp; lr < live; lr += GS_WARPS) {
            if (!((tmask >> (8 + (lr >> 4))) & 1u)) continue;  // warp-uniform
            unsigned long long wv[TKU];
#pragma unroll
            for (int u = 0; u < TKU; u++) {
                const int col = cg * COLS + lane + 32 * u;
                wv[u] = col < N ? ((unsigned long long)keys[lr * TKS + lane + 32 * u] << 32) |
                                      (0xffffffffu - (unsigned int)col)
                                : 0ull;
            }
            unsigned long long last = ~0ull, w0 = 0ull, w1 = 0ull;
            for (int q = 0; q < TK; q++) {
                unsigned long long mine = 0ull;
#pragma unroll
                for (int u = 0; u < TKU; u++)
                    if (wv[u] < last && wv[u] > mine) mine = wv[u];
#pragma unroll
                for (int o = 16; o; o >>= 1) {
                    const unsigned long long ot = __shfl_xor_sync(0xffffffffu, mine, o);
                    mine = ot > mine ? ot : mine;
                }
                last = mine;
                if (lane == (q & 31)) {
                    if (q < 32) w0 = mine; else w1 = mine;
                }
            }
            unsigned int* out = part + ((long long)(m0 + lr) * groups + cg) * TK * 2;
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int q = lane + 32 * hh;
                const unsigned long long wq = hh ? w1 : w0;
                if (q < TK)
                    *reinterpret_cast<uint2*>(out + 2 * q) =
                        make_uint2((unsigned int)(wq >> 32), wq ? 0xffffffffu - (unsigned int)wq : 0xffffffffu);
            }
        }
        return;
    }
#else
#if GS_FIN
    const bool fin = fin_lane_rows > 0;   // the finish convolution (gemm_fin.cuh) after the split-K part
#else
    constexpr bool fin = false;
    (void)fin_base;
    (void)fin_d;
    (void)fin_lane_rows;
#endif
#if GS_CONV && GS_NORM
    __shared__ float conv_sc[ROWS];   // the rows' scales, as the epilogue takes them (the normed x)
#else
    float* const conv_sc = nullptr;
#endif
    [[maybe_unused]] bool conv_now;   // d final (block-uniform): the prepare tail below, one copy
    if (gridDim.z == 1 && !fin) {
        // GS_EPI 1: every residual this thread adds is loaded first (all in flight together),
        // then the stores (y may be r: each element is read before its own store)
        float rv[MT][2][NT][2];
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int jn = 0; jn < NT; jn++)
#pragma unroll
                    for (int e1 = 0; e1 < 2; e1++) {
                        const int row = m0 + i * 16 + g + 8 * h, col = n0 + 8 * jn + 2 * t + e1;
                        rv[i][h][jn][e1] = 0.0f;
                        if (GS_EPI == 1 && ((tmask >> (8 + i)) & 1u) && row < M && col < N)
                            rv[i][h][jn][e1] = r[(long long)row * N + col];
                    }
#pragma unroll
        for (int i = 0; i < MT; i++) {
            if (!((tmask >> (8 + i)) & 1u)) continue;  // dead tile: y untouched
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = m0 + i * 16 + g + 8 * h;
                float sc = 1.0f;
#if GS_NORM
                if (row >= scale_lo && row - m0 < ROWS) sc = rsqrtf(ss_s[row - m0] * (1.0f / K) + eps);
#endif
#pragma unroll
                for (int jn = 0; jn < NT; jn++) {
#pragma unroll
                    for (int e1 = 0; e1 < 2; e1++) {
                        const int e = 2 * h + e1;
                        const int col = n0 + 8 * jn + 2 * t + e1;
                        if (row < M && col < N)
                            epilogue_store_r<GS_EPI, GS_WTYPE>(y, rv[i][h][jn][e1], (long long)row * N + col,
                                                               acc[i][jn][e] * sc, acc[i][(NW - 1) * NT + jn][e] * sc);
                    }
                }
            }
        }
#if GS_CONV && GS_NORM
        if (conv_lane_rows != 0 && (int)threadIdx.x < live)
            conv_sc[threadIdx.x] = m0 + (int)threadIdx.x >= scale_lo ? rsqrtf(ss_s[threadIdx.x] * (1.0f / K) + eps)
                                                                      : 1.0f;
#endif
        conv_now = true;
    } else {
        // ---- split K: publish this slice's partial tile; the last slice to arrive reduces.
        // ws holds each (column group, M block)'s slices together, [ks][NW][ROWS][COLS] per
        // block x, so the reduction reads 16-byte vectors whatever N is.
        const int ks = (int)gridDim.z;
        const int bx = cg * mblocks + m0 / ROWS;                   // = blockIdx.x
        float* wsb = ws + ((long long)cg * mblocks * ks + (long long)(m0 / ROWS) * ks) * (NW * ROWS * COLS);
#pragma unroll
        for (int i = 0; i < MT; i++) {
#pragma unroll
            for (int j = 0; j < WT; j++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int lrow = i * 16 + g + 8 * h;
                    const int lc = warp * 8 * NT + 8 * (j % NT) + 2 * t;
                    if (lrow < live && ((tmask >> (8 + i)) & 1u) && !(fin && gridDim.z == 1))   // (no partial: finish)
                        *reinterpret_cast<float2*>(wsb + ((long long)(blockIdx.z * NW + j / NT) * ROWS + lrow) * COLS + lc) =
                            make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                }
            }
        }
#if GS_NORM
        // the rows' partial sums of squares of this slice, after every block's partial tiles
        float* ssw = ws + (long long)gridDim.x * ks * NW * ROWS * COLS + (long long)bx * ks * ROWS;
        if (threadIdx.x < live) ssw[blockIdx.z * ROWS + threadIdx.x] = ss_s[threadIdx.x];
#else
        const float* ssw = ws;  // unused
#endif
#if GS_FIN
        {
            // the finish reads rows of other threads: the block's final tile into shared memory (one
            // K slice: its fragments; split K, fused or not: the last slice's reduction, the variant's
            // one instance of it), then the convolution (fin_lane_rows 0: y = r + the tile)
            float* const fin_tile = reinterpret_cast<float*>(smem);
            constexpr int FIN_FS = COLS + GEMM_FIN_PAD;
            auto fin_stored = [&](int lrow) { return ((tmask >> (8 + (lrow >> 4))) & 1u) != 0u; };
            bool mine = true;
            if (gridDim.z == 1) {
                __syncthreads();   // every warp past its MMAs' reads of xs
#pragma unroll
                for (int i = 0; i < MT; i++)
#pragma unroll
                    for (int h = 0; h < 2; h++)
#pragma unroll
                        for (int jn = 0; jn < NT; jn++)
                            *reinterpret_cast<float2*>(fin_tile + (i * 16 + g + 8 * h) * FIN_FS + warp * 8 * NT + 8 * jn + 2 * t) =
                                make_float2(acc[i][jn][2 * h], acc[i][jn][2 * h + 1]);
            } else {
                mine = splitk_reduce<NW, ROWS, COLS, THREADS, 3, 0, K, GS_WTYPE>(
                    wsb, ssw, ks, counters + bx, y, r, m0, live, cg * COLS, N, eps, scale_lo, fin_stored, fin_tile, FIN_FS);
            }
            if (mine) {
                __syncthreads();
                gemm_fin_finish<GS_CONV_TAPS, GS_CONV_GROUP, ROWS, COLS, THREADS>(
                    fin_tile, r, y, fin_base, fin_d, N, m0, live, cg * COLS, fin_lane_rows, fin_stored);
            }
            conv_now = false;
        }
#else
        conv_now = splitk_reduce<NW, ROWS, COLS, THREADS, GS_EPI, GS_NORM, K, GS_WTYPE>(   // the last slice
            wsb, ssw, ks, counters + bx, y, r, m0, live, cg * COLS, N, eps, scale_lo,
            [&](int lrow) { return ((tmask >> (8 + (lrow >> 4))) & 1u) != 0u; }, nullptr, 0, conv_sc);
#endif  // GS_FIN
    }
#if GS_CONV
    if (conv_now && conv_lane_rows != 0)   // the prepare convolution of this column block's groups
        gemm_conv_prepare<GS_CONV_TAPS, GS_CONV_GROUP, K, COLS, ROWS, THREADS, GS_NORM>(
            x, y, N, conv_base, conv_y, m0, live, cg * COLS, conv_lane_rows,
            [&](int lrow) { return ((tmask >> (8 + (lrow >> 4))) & 1u) != 0u; }, ln, conv_sc, norm_lo);
#else
    (void)conv_sc;
    (void)conv_base;
    (void)conv_y;
    (void)conv_lane_rows;
#endif
#endif
}

// nvrtc-arch: sm_90a
// gemm_wgmma.cu — weight-streaming GEMM on Hopper's warpgroup MMA (wgmma) for many rows
// (lane-batched steps: 64 .. 512+ rows), f16 / bf16 weights. Design and figures:
// docs/decisions/gemm.md ("gemm_wgmma.cu").
//
// Contract: gemm_stream.cu's (its parameters, here fields of GemmWgmmaParams, with the same
// padding rows, tile_live, two inputs, folded RMSNorm and split-K workspace):
//     acc[m, n] = sum_k xe[m, k] * W[n, k]   (f32), xe = hi + lo (GW_SPLIT 2) or hi (1) of x
//   GW_EPI 0: y = acc, 1: y = r + acc, 2: y = silu(acc_gate) * acc_up (W [2N, K]);
//   GW_EPI 3 (qkv): rope.cu's qkv_norm_rope folded in: y [M, GW_QW] is its q_out, K (f16) to
//   k_cache[rows[m]] and V to v_cache[rows[m]] (rows outside [0, kv_rows) skipped), per head
//   of GW_HD (dividing COLS) rmsnorm * q_norm / k_norm and RoPE at pos[m] (rope_math.cuh: the
//   same bits as GEMM + qkv_norm_rope); tile_live 2 rows write no Q, padding rows nothing.
//   GW_NORM, GW_X16, GW_Y16: as gemm_stream.cu's GS_NORM, GS_X16, GS_Y16. No argmax epilogue.
// Layouts: x [M, K] f32 (GW_X16: the weight type's bits), W [N or 2N, K] 16-bit, y, r [M, N]
// f32 (GW_Y16: 16-bit), row-major, 16-byte aligned, K % 8 == 0.
//
// Launch (ops/gemm_stream.plan_wgmma; the one argument a GemmWgmmaParams by value):
//   block = GW_WG * 128 threads; block x owns COLS = GW_WG * 128 / NW output columns and BT
//   rows; grid = (groups * tblocks, 1, ks), blockIdx.x = cg * tblocks + tb (row block fastest:
//   one column group's blocks share its weights through L2), z = K slice of kz (a multiple of
//   64). Dynamic shared memory = 2 * GW_SPLIT * 4 * Q_B bytes (plan_wgmma's wg_smem; the qkv
//   epilogue: wg_qkv_smem).
//   Lane batches (GW_SMS = the SM count, with tile_live): the working (column group, row
//   block) tiles and the K split (at most kt slices, gemm_stream.wg_live_split) are found on
//   the device; grid = (slots, 1, 1) strides over the items. GW_SKIP_COLS: tiles marked 2 are
//   dead in the column groups wholly below it.
// Inner loop (64 k per step): weights are wgmma's A operand from registers (8 16-byte
// ld.global.cs per thread and step, one step ahead, GW_DEPTH steps prefetched to L2), x its B
// operand from a double-buffered shared tile (K-major core matrices, wgmma.cuh), one barrier
// per step; chunks of GW_NCH rows with no computed tile issue no wgmma.
// Registers: ops/gemm_stream.WG_PTXAS_REGS (held by tests/test_gemm_wgmma.py).
//
// NVRTC checks: the launcher's options of each GemmVariant in tests/support/gemm_variants.py.

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "bits16.cuh"
#include "gemm_epilogue.cuh"
#include "gemm_splitk.cuh"
#include "rope_math.cuh"
#include "warp.cuh"
#include "wgmma.cuh"
#include "pdl.cuh"

#ifndef GW_WTYPE
#define GW_WTYPE 2
#endif
#ifndef GW_EPI
#define GW_EPI 0
#endif
#ifndef GW_K
#define GW_K 256
#endif
#ifndef GW_BT
#define GW_BT 64
#endif
#ifndef GW_WG
#define GW_WG 2
#endif
#ifndef GW_SPLIT
#define GW_SPLIT 2
#endif
#ifndef GW_NORM
#define GW_NORM 0
#endif
#ifndef GW_DEPTH
#define GW_DEPTH (GW_BT >= 128 ? 2 : 3)
#endif
#ifndef GW_NCH
#define GW_NCH 32
#endif
#ifndef GW_SMS
#define GW_SMS 0  // > 0 (the device's SM count): launches with tile_live choose their K split
#endif
#ifndef GW_SKIP_COLS
#define GW_SKIP_COLS 0  // tiles whose tile_live entry is 2 need only the columns >= this
#endif
#ifndef GW_X16
#define GW_X16 0
#endif
#if GW_X16
#define GW_XT unsigned short  // x holds the weight type's bits
#else
#define GW_XT float
#endif
#ifndef GW_Y16
#define GW_Y16 0
#endif
#if GW_Y16
#define GW_YT unsigned short  // y written rounded to the weight type
#else
#define GW_YT float
#endif

// the qkv epilogue's (row, head) units a warp works on at once: their latency chains overlap
// (read by Python: gemm_stream.WG_EPI_UNITS)
#define GW_EPI_UNITS 2

#if GW_EPI != 0 && GW_EPI != 1 && GW_EPI != 2 && GW_EPI != 3
#error "GW_EPI must be 0, 1, 2 or 3 (qkv; no fused argmax here)"
#endif
#if GW_EPI == 3
#ifndef GW_HD
#define GW_HD 128
#endif
#ifndef GW_QW
#define GW_QW 4096
#endif
#ifndef GW_KVW
#define GW_KVW 1024
#endif
#if GW_Y16
#error "GW_EPI 3 writes Q as f32 (GW_Y16 0)"
#endif
#endif
#if GW_BT != 64 && GW_BT != 128
#error "GW_BT must be 64 or 128 tokens per block"
#endif
#if GW_K % 8 != 0
#error "GW_K must be a multiple of 8 (16-byte weight loads)"
#endif
#if GW_SPLIT != 1 && GW_SPLIT != 2
#error "GW_SPLIT must be 1 (x rounded) or 2 (x as hi + lo)"
#endif
#if GW_WTYPE != 1 && GW_WTYPE != 2
#error "GW_WTYPE must be 1 (f16) or 2 (bf16)"
#endif
#if GW_DEPTH < 2 || GW_DEPTH > 8
#error "GW_DEPTH (weights requested ahead, in 64-k steps) must be 2 .. 8"
#endif
#if GW_NORM != 0 && GW_NORM != 1
#error "GW_NORM must be 0 or 1"
#endif
#if GW_SMS < 0 || GW_SKIP_COLS < 0
#error "GW_SMS and GW_SKIP_COLS must be >= 0"
#endif
#if GW_X16 != 0 && GW_X16 != 1
#error "GW_X16 must be 0 (x f32) or 1 (x in the weight type)"
#endif
#if GW_X16 && GW_SPLIT != 1
#error "GW_X16 needs GW_SPLIT 1: a 16-bit x has no lo half"
#endif
#if GW_Y16 != 0 && GW_Y16 != 1
#error "GW_Y16 must be 0 (y f32) or 1 (y in the weight type)"
#endif

namespace gemm_wgmma_detail {

constexpr int K = GW_K;
constexpr int BT = GW_BT;
constexpr int NW = (GW_EPI == 2) ? 2 : 1;
constexpr int THREADS = GW_WG * 128;
constexpr int COLS = GW_WG * 128 / NW;
constexpr int TILES = BT / 16;                       // 16-row tiles per block (tile_live granularity)
constexpr int NCH = GW_NCH;                          // rows of x per wgmma (its N)
constexpr int NCHUNK = BT / NCH;
constexpr int TPC = NCH / 16;                        // 16-row tiles per chunk
static_assert(BT % NCH == 0 && NCH % 16 == 0, "GW_NCH divides GW_BT in whole 16-row tiles");
static_assert(BT % 32 == 0, "the folded norm's partial sums swizzle tokens inside aligned groups of 32");
constexpr int KSTEP = 64;
static_assert(GW_SKIP_COLS % COLS == 0, "GW_SKIP_COLS is a whole number of column groups");
constexpr int QG = GW_SKIP_COLS / COLS;              // column groups that rows marked 2 skip
// The per-launch K split (GW_SMS > 0 with tile_live): ops/gemm_stream.wg_live_split mirrors
// this rule and its constants (MIN_K_SLICE, WG_BLOCK_STEPS, WG_SPLIT_STEPS).
constexpr int MIN_K_SLICE = 256;
constexpr int BLOCK_STEPS = 2;
constexpr int SPLIT_STEPS = 3;
constexpr int D = GW_DEPTH;
// One k16 instruction's B: BT / 8 core-matrix rows x 2 K-halves x 128 bytes, then 64 bytes
// of padding so that a staging store's two instructions (l8 even / odd) fall 16 banks apart.
constexpr int Q_B = BT * 32 + 64;
constexpr int PLANE_B = 4 * Q_B;                     // one plane (hi or lo) of one 64-k step
constexpr int BUF_B = GW_SPLIT * PLANE_B;            // one buffer
// staging items per step: (token, h, l8) of 4 f32 values, or with GW_X16 (token, h, tt) of 8
// 16-bit values
constexpr int ITEMS = GW_X16 ? BT * 8 : BT * 16;
constexpr int IPT = ITEMS / THREADS;                 // per thread
static_assert(ITEMS % THREADS == 0, "staging items divide over the block");

__device__ __forceinline__ unsigned int to16(float v) { return to_bits16<GW_WTYPE>(v); }
__device__ __forceinline__ float from16(unsigned int b) { return from_bits16<GW_WTYPE>(b); }
// A staging load: plain, or (cg) ld.global.cg (L2 only), which ptxas keeps where it is written
template <typename T>
__device__ __forceinline__ T ldx(const T* p, bool cg) { return cg ? __ldcg(p) : *p; }

// One step's 8 weight loads as they arrive, v[set][row rr][half h] (16 bytes each): a load is
// one weight row, a fragment quad two (rows g, g + 8), so no load can land in a quad; the slot
// keeps them as loaded (registers of their own) until to_frag permutes them at their step.
struct Slot {
    uint4 v[2][2][2];
};
// The A fragments of one step: per set, the 4 k16 instructions' quads.
struct Frag {
    unsigned int a[2][4][4];
};

// Rows past N and k past the slice read as zeros (no access): the slice end is a multiple of
// 8, so each 16-byte half is wholly in or out.
__device__ __forceinline__ void load_slot(Slot& s, const unsigned short* const wrow[2][2], unsigned int ok, int k,
                                          int k_end) {
#pragma unroll
    for (int a = 0; a < 2; a++) {
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {  // row 16q + g, then + 8
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int kk = k + 32 * h;  // k includes the lane's 8t
                uint4 v = make_uint4(0u, 0u, 0u, 0u);
                if (((ok >> (2 * a + rr)) & 1u) && kk < k_end) v = __ldcs(reinterpret_cast<const uint4*>(wrow[a][rr] + kk));
                s.v[a][rr][h] = v;
            }
        }
    }
}

// One step's line of a weight row requested into L2 (k: the step's first k; none past the
// slice or for a row past N).
__device__ __forceinline__ void prefetch_step(const unsigned short* row, bool row_ok, int k, int k_end) {
    if (row_ok && k < k_end) prefetch_l2(row + k);
}

// The step's A fragments from its slot: instruction 2h takes elements 0..3 of half h, 2h + 1
// elements 4..7; regs 0/2: row g, 1/3: row g + 8. z: wgmma_opaque_zero() (the copies stay here).
__device__ __forceinline__ void to_frag(Frag& f, const Slot& s, unsigned int z) {
#pragma unroll
    for (int a = 0; a < 2; a++) {
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint4 v = s.v[a][rr][h];
                f.a[a][2 * h][rr] = v.x | z;
                f.a[a][2 * h][rr + 2] = v.y | z;
                f.a[a][2 * h + 1][rr] = v.z | z;
                f.a[a][2 * h + 1][rr + 2] = v.w | z;
            }
        }
    }
}

// The K split for n_live working blocks, at most cap: whole waves of GW_SMS SMs x (a block's
// steps + its fixed part), the least k on ties; each slice non-empty and, split, >= MIN_K_SLICE.
__device__ __forceinline__ int live_split(int n_live, int cap) {
    constexpr int steps = (K + KSTEP - 1) / KSTEP;
    int best_k = 1;
    long long best = -1;
    for (int k = 1; k <= cap; k++) {
        const int kzk = ((steps + k - 1) / k) * KSTEP;
        if ((K + kzk - 1) / kzk != k || (k > 1 && kzk < MIN_K_SLICE)) continue;
        const long long waves = ((long long)n_live * k + GW_SMS - 1) / (GW_SMS > 0 ? GW_SMS : 1);
        const long long cost = waves * (kzk / KSTEP + BLOCK_STEPS + (k > 1 ? SPLIT_STEPS : 0));
        if (best < 0 || cost < best) {
            best = cost;
            best_k = k;
        }
    }
    return best_k;
}

__device__ __forceinline__ void wgmma(float* d, const unsigned int a[4], unsigned long long desc) {
#if GW_WTYPE == 2
    wgmma_m64nNk16_rs_bf16<NCH>(d, a, desc, 1);
#else
    wgmma_m64nNk16_rs_f16<NCH>(d, a, desc, 1);
#endif
}

#if GW_EPI == 3
constexpr int HD = GW_HD, QW = GW_QW, KVW = GW_KVW;
constexpr int TS = COLS + 4;   // staged tile row stride in floats: the acc stores (rows 2t apart) conflict-free
constexpr int HPG = COLS / HD; // heads per column group
static_assert(HD % 2 == 0 && COLS % HD == 0 && QW % HD == 0 && KVW % HD == 0,
              "GW_HD even, dividing COLS, GW_QW and GW_KVW: every head inside one column group");

// The k-th (from 0) set bit of m (k < popc(m)).
__device__ __forceinline__ int nth_set_bit(unsigned int m, int k) {
    int pos = 0;
#pragma unroll
    for (int sh = 16; sh > 0; sh >>= 1) {
        const int c = __popc(m & ((1u << sh) - 1u));
        if (k >= c) {
            k -= c;
            m >>= sh;
            pos += sh;
        }
    }
    return pos;
}


// The tile's final values [live][COLS] (columns c0 ..) staged at tile: qkv_norm_rope's work on
// each (row, head) unit of it whose row has outputs: a stored row outside the padding rows
// [pad_lo, pad_hi) (absolute; their Q is never read and their K/V would go to the trash slot,
// which every mask hides). A warp takes GW_EPI_UNITS units at a time, each unit's arithmetic exactly
// rope.cu's (rope_math.cuh), so the same bits. The units run 24-ish blocks' worth of warps
// (the final block of each tile), not a grid's: fewer units and overlapped chains are what
// keep this tail short (hw_params.rope_round_clocks).
// Global reads, all issued at once before the rounds (none depends on another, so one round
// trip in all): per row of the tile (lane l of word w: row 32w + l, every warp alike) its cache
// slot, position and tile_live flag (as a mask: the rows with Q heads), each unit taking its
// row's from that lane by shuffle; per lane the norm weights and frequencies of its pairs.
// Every warp runs the same trip count and every shuffle (the row ballots, the row values, the
// warp sums) unconditionally; the stores are predicated: a shuffle in warp-dependent control
// flow inside the tile loop makes ptxas serialise the next tile's wgmmas (C7520).
template <typename Stored>
__device__ __forceinline__ void qkv_epilogue(const float* tile, int c0, int m0, int live, int N, Stored stored,
                                             int pad_lo, int pad_hi, const int* tile_live, int use_live,
                                             const float* q_norm, const float* k_norm, const double* inv_freq,
                                             const int* pos, const int* rows, float* q_out, __half* k_cache,
                                             __half* v_cache, int kv_rows, float eps, float scale) {
    using RH = RopeHead<HD>;
    constexpr int NWARPS = THREADS / 32, WORDS = (BT + 31) / 32, PAIRS = RH::PAIRS;
    const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31;
    // the rows with outputs, one bit each (every warp builds the same masks), and their values
    unsigned int rmask[WORDS], qmask[WORDS];
    int rrow[WORDS], rpos[WORDS];
    int n_rows = 0;
#pragma unroll
    for (int w = 0; w < WORDS; w++) {
        const int lt = 32 * w + lane, row = m0 + lt;
        const bool work = lt < live && stored(lt) && !(row >= pad_lo && row < pad_hi);
        const int tl = (work && use_live) ? tile_live[row >> 4] : 1;
        rrow[w] = work ? rows[row] : -1;
        rpos[w] = work ? pos[row] : 0;
        rmask[w] = __ballot_sync(0xffffffffu, work);
        qmask[w] = __ballot_sync(0xffffffffu, work && tl != 2);   // rows marked 2: no Q heads
        n_rows += __popc(rmask[w]);
    }
    float qwl[PAIRS], qwh[PAIRS], kwl[PAIRS], kwh[PAIRS];
    double fr[PAIRS];
#pragma unroll
    for (int j = 0; j < PAIRS; j++) {
        const int i = lane + 32 * j;
        qwl[j] = qwh[j] = kwl[j] = kwh[j] = 0.f;
        fr[j] = 0.0;
        if (i < RH::HALF) {
            qwl[j] = q_norm[i];
            qwh[j] = q_norm[i + RH::HALF];
            kwl[j] = k_norm[i];
            kwh[j] = k_norm[i + RH::HALF];
            fr[j] = inv_freq[i];
        }
    }
    const int n_units = n_rows * HPG;
    for (int u0 = 0; u0 < n_units; u0 += GW_EPI_UNITS * NWARPS) {
        float lo[GW_EPI_UNITS][PAIRS], hi[GW_EPI_UNITS][PAIRS], c[GW_EPI_UNITS][PAIRS], s[GW_EPI_UNITS][PAIRS];
        float ss[GW_EPI_UNITS];
        int mm[GW_EPI_UNITS], col[GW_EPI_UNITS], kind[GW_EPI_UNITS], row[GW_EPI_UNITS], p[GW_EPI_UNITS];
        bool ok[GW_EPI_UNITS], qrow[GW_EPI_UNITS];
        const float* x[GW_EPI_UNITS];
#pragma unroll
        for (int k = 0; k < GW_EPI_UNITS; k++) {
            const int u = u0 + k * NWARPS + warp;
            const int ui = u < n_units ? u : 0;
            const int idx = ui / HPG;
            int lt = 0, rest = idx;
#pragma unroll
            for (int w = 0; w < WORDS; w++) {   // the idx-th row with outputs
                const int cnt = __popc(rmask[w]);
                if (rest >= 0 && rest < cnt) lt = 32 * w + nth_set_bit(rmask[w], rest);
                rest -= cnt;
            }
            // the row's values from lane lt % 32 (word lt / 32: the same choice in every lane)
            int rv = rrow[0], pv = rpos[0];
            unsigned int qm = qmask[0];
#pragma unroll
            for (int w = 1; w < WORDS; w++) {
                if ((lt >> 5) == w) {
                    rv = rrow[w];
                    pv = rpos[w];
                    qm = qmask[w];
                }
            }
            rv = __shfl_sync(0xffffffffu, rv, lt & 31);
            pv = __shfl_sync(0xffffffffu, pv, lt & 31);
            col[k] = c0 + (ui - idx * HPG) * HD;
            ok[k] = u < n_units && col[k] < N;
            mm[k] = m0 + lt;
            qrow[k] = ((qm >> (lt & 31)) & 1u) != 0u;
            row[k] = ok[k] ? rv : -1;
            kind[k] = col[k] < QW ? 0 : (col[k] < QW + KVW ? 1 : 2);   // Q, K, V
            p[k] = (ok[k] && kind[k] != 2) ? pv : 0;
            x[k] = tile + (ok[k] ? lt * TS + col[k] - c0 : 0);
            ss[k] = RH::partial(x[k], lo[k], hi[k], lane);
        }
        warp_sum_n<GW_EPI_UNITS>(ss);   // every warp: the shuffles stay uniform
#pragma unroll
        for (int k = 0; k < GW_EPI_UNITS; k++) {   // the angles of every unit, rotated or not: chains to overlap
#pragma unroll
            for (int j = 0; j < PAIRS; j++) {
                const int i = lane + 32 * j;
                c[k][j] = 0.f;
                s[k][j] = 0.f;
                if (i < RH::HALF) rope_cos_sin(p[k], fr[j], scale, c[k][j], s[k][j]);
            }
        }
#pragma unroll
        for (int k = 0; k < GW_EPI_UNITS; k++) {
            if (!ok[k]) continue;
            const bool row_ok = row[k] >= 0 && row[k] < kv_rows;
            if (kind[k] == 2) {   // V: f16 as it is
                if (row_ok) {
                    __half* dst = v_cache + (long long)row[k] * KVW + (col[k] - QW - KVW);
                    for (int d = lane; d < HD; d += 32) dst[d] = __float2half_rn(x[k][d]);
                }
                continue;
            }
            if ((kind[k] == 0 && !qrow[k]) || (kind[k] == 1 && !row_ok)) continue;   // a context row's Q is never read
            const float rn = RH::finish(ss[k], eps);
            if (kind[k] == 0)
                RH::store_w(q_out + (long long)mm[k] * QW + col[k], lo[k], hi[k], rn, qwl, qwh, c[k], s[k], lane);
            else
                RH::store_w(k_cache + (long long)row[k] * KVW + (col[k] - QW), lo[k], hi[k], rn, kwl, kwh, c[k], s[k],
                            lane);
        }
    }
}
#endif

}  // namespace gemm_wgmma_detail

// The kernel's arguments (one struct, passed by value; the fields in the order the body
// takes them, so the parameter bank's layout is the positional one's). q_norm .. rope_scale:
// the qkv epilogue's (GW_QKV), unused otherwise.
struct GemmWgmmaParams {
    const GW_XT* x; const unsigned short* w; GW_YT* y; const float* r;
    int M; int N; int kz; int kt; float* ws; int* counters; const int* pad_lo; int pad_hi;
    const float* ln; float eps; int norm_lo; const int* tile_live; int use_live;
    const float* q_norm; const float* k_norm; const double* inv_freq;
    const int* pos; const int* rows; __half* k_cache; __half* v_cache; int kv_rows;
    float rope_eps; float rope_scale;
    const GW_XT* x2; int row_split; const float* ln_lo; int use_ln_lo;
};

// The body, inlined into the entry point: its __restrict__ parameters keep the no-alias
// facts ptxas had when they were the kernel's own.
static __device__ __forceinline__ void
gemm_wgmma_body(const GW_XT* __restrict__ x, const unsigned short* __restrict__ w, GW_YT* y, const float* r,
           int M, int N, int kz, int kt, float* ws, int* counters, const int* pad_lo, int pad_hi,
           const float* __restrict__ ln, float eps, int norm_lo, const int* tile_live, int use_live,
           const float* __restrict__ q_norm, const float* __restrict__ k_norm, const double* __restrict__ inv_freq,
           const int* __restrict__ pos, const int* __restrict__ rows, __half* k_cache, __half* v_cache, int kv_rows,
           float rope_eps, float rope_scale,
           const GW_XT* __restrict__ x2, int row_split, const float* __restrict__ ln_lo, int use_ln_lo) {
    using namespace gemm_wgmma_detail;
    extern __shared__ __align__(128) unsigned char smem[];

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int wg = warp >> 2, wq = warp & 3;
    const int tblocks = (M + BT - 1) / BT;
    // Two inputs (gemm_stream.cu's rule): rows < row_split from x, the rest from x2's row 0 on.
    auto xrow = [&](int grow) {
        return grow < row_split ? x + (long long)grow * K : x2 + (long long)(grow - row_split) * K;
    };
    // GW_NORM: rows < norm_lo normalised with ln_lo when use_ln_lo; every row >= scale_lo is scaled.
    const int scale_lo = (GW_NORM && use_ln_lo) ? 0 : norm_lo;

    // PDL (pdl.cuh): before the wait only weights are touched. A static launch knows its tile
    // from blockIdx: lane t sends its 4 rows' line of step t (t < D) to L2 while the
    // kernel before drains. A live-split launch learns its tiles from tile_live, after the wait.
    if (!(GW_SMS > 0 && use_live) && t < D && (int)blockIdx.z * kz + t * KSTEP < K) {
        const int nb0 = ((int)blockIdx.x / tblocks) * COLS + wg * (128 / NW);
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {
                const int n = nb0 + (NW == 1 ? 64 * a : 0) + 16 * wq + g + 8 * rr;
                if (n < N) prefetch_l2(w + ((long long)n + ((NW == 2 && a == 1) ? (long long)N : 0ll)) * K + (int)blockIdx.z * kz + t * KSTEP);
            }
    }
    pdl_wait();
    pdl_launch_dependents();

    // What this block computes. Static: one tile, blockIdx.x = cg * tblocks + tb, z its K
    // slice of kz. Live split (GW_SMS > 0 with tile_live): the launch's working tiles are
    // found here from tile_live (row block tb works in column group cg if it holds a tile
    // != 0 that is not a 2 skipped there), numbered cg-major (slot: their workspace and
    // counter index) and the K split ks chosen from their count (live_split, at most kt
    // slices); item = z * n_live + slot, and the grid (at most one block per SM) strides over
    // the items. A step with few live rows splits K further and still fills the SMs, and
    // idle lanes cost no blocks, with no recapture.
    int ks = (int)gridDim.z, kzl = kz, n_live = 1, n_items = 1, first = 0, stride = 1;
    int n_any = 0, n_full = 0, qg = 0;
    // the working row blocks in order: [0] those with a tile != 0, [1] with a tile != 0, 2
    __shared__ short sel_s[2][THREADS];
    const bool dyn = GW_SMS > 0 && use_live;
    if (dyn) {  // tblocks <= THREADS (the launcher's check): one row block per thread
        __shared__ int wc_s[2][THREADS / 32];
        const int groups = (N + COLS - 1) / COLS;
        const int b = (int)threadIdx.x;
        bool any = false, full = false;
        int v[TILES];   // the row block's flags: every load issued before the first is used
#pragma unroll
        for (int i = 0; i < TILES; i++) v[i] = (b < tblocks && b * BT + 16 * i < M) ? tile_live[((b * BT) >> 4) + i] : 0;
#pragma unroll
        for (int i = 0; i < TILES; i++) {
            any = any || v[i] != 0;
            full = full || (v[i] != 0 && v[i] != 2);
        }
        const unsigned int ba = __ballot_sync(0xffffffffu, any), bf = __ballot_sync(0xffffffffu, full);
        if (lane == 0) {
            wc_s[0][warp] = __popc(ba);
            wc_s[1][warp] = __popc(bf);
        }
        __syncthreads();
        const unsigned int below = (1u << lane) - 1u;
        int p_any = __popc(ba & below), p_full = __popc(bf & below);
#pragma unroll
        for (int w2 = 0; w2 < THREADS / 32; w2++) {
            n_any += wc_s[0][w2];
            n_full += wc_s[1][w2];
            if (w2 < warp) {
                p_any += wc_s[0][w2];
                p_full += wc_s[1][w2];
            }
        }
        if (any) sel_s[0][p_any] = (short)b;
        if (full) sel_s[1][p_full] = (short)b;
        __syncthreads();
        qg = (QG < groups) ? QG : groups;
        n_live = qg * n_full + (groups - qg) * n_any;
        ks = live_split(n_live, kt);
        kzl = ((K + KSTEP - 1) / KSTEP + ks - 1) / ks * KSTEP;
        n_items = n_live * ks;
        first = (int)blockIdx.x;
        stride = (int)gridDim.x;
    }
    for (int item = first; item < n_items; item += stride) {
        int cg = (int)blockIdx.x / tblocks, tb = (int)blockIdx.x - cg * tblocks;
        int slot = (int)blockIdx.x, zi = (int)blockIdx.z;
        __syncthreads();   // the previous item's shared memory is read (and the warps converge)
        if (dyn) {
            zi = item / n_live;
            slot = item - zi * n_live;
            if (slot < qg * n_full) {   // a column group below GW_SKIP_COLS: rows with a tile != 2
                cg = slot / n_full;
                tb = sel_s[1][slot - cg * n_full];
            } else {
                const int r2 = slot - qg * n_full;
                cg = qg + r2 / n_any;
                tb = sel_s[0][r2 - (cg - qg) * n_any];
            }
        }
        const int m0 = tb * BT;
        const int live = (M - m0 < BT) ? (M - m0) : BT;

        // the row block's tile_live flags and the padding start: loads issued together (one
        // round trip)
        int tv[TILES];
#pragma unroll
        for (int i = 0; i < TILES; i++) tv[i] = (use_live && m0 + 16 * i < M) ? tile_live[(m0 >> 4) + i] : 1;
        int lo = (pad_hi > 0) ? *pad_lo : pad_hi;
        lo = (lo < 0) ? 0 : ((lo > pad_hi) ? pad_hi : lo);
        // cmask: 16-row tiles with a row to compute (staged from x); smask: tiles whose rows are
        // stored. Dead tiles are neither; padding-only tiles are stored (acc 0) but not staged.
        // A tile marked 2 (rows that need only columns >= GW_SKIP_COLS: a lane-batched qkv's
        // context rows, which feed K and V only) is dead in the column groups below.
        unsigned int cmask = 0u, smask = 0u;
#pragma unroll
        for (int i = 0; i < TILES; i++) {
            const int a = m0 + 16 * i, b = (a + 16 < M) ? a + 16 : M;
            const int v = tv[i];
            if (a < b && v != 0 && !(QG > 0 && v == 2 && cg < QG)) {
                smask |= 1u << i;
                if (!(a >= lo && b <= pad_hi)) cmask |= 1u << i;
            }
        }
        // every slice of this tile leaves here: its counter stays 0 (cmask is a subset of smask:
        // tested too, so that pad_lo's load is issued, and waited for, with tile_live's)
        if ((smask | cmask) == 0u) continue;

        const int k_begin = zi * kzl;
        const int k_end = (k_begin + kzl < K) ? k_begin + kzl : K;
        const int nsteps = (k_end > k_begin) ? (k_end - k_begin + KSTEP - 1) / KSTEP : 0;

        // Weight rows of this lane: set a, row 16 wq + g (+8).
        const int nb = cg * COLS + wg * (128 / NW);  // the warpgroup's first output column
        const unsigned short* wrow[2][2];
        unsigned int ok = 0u;
#pragma unroll
        for (int a = 0; a < 2; a++) {
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {
                const int n = nb + (NW == 1 ? 64 * a : 0) + 16 * wq + g + 8 * rr;
                const bool v = n < N;
                ok |= (v ? 1u : 0u) << (2 * a + rr);
                wrow[a][rr] = w + ((long long)(v ? n : 0) + ((NW == 2 && a == 1 && v) ? (long long)N : 0ll)) * K;
            }
        }

        // Staging item j of this thread (i = threadIdx.x + j * THREADS, warp item wi = i / 32):
        // token n = 4 * (wi % (BT / 4)) + (i % 32) / 8, half h = wi / (BT / 4), lane-in-token
        // l8 = i % 8: x[n][k + 32h + 4 l8 .. +3], i.e. real offset r = 32h + 4 l8 of the step, which
        // plays fragment columns of instruction q' = 2h + (l8 & 1), lane group tt = l8 / 2.
#if GW_NORM
        // Each row's sum of squares in gemm_stream.cu's order, so the two kernels agree bit for bit
        // where their GEMMs do (the emulator): there lane L of a warp sums x[k]^2 for k = slice
        // start + 128j + 4L .. +3 over j, then the warp's xor butterfly. Here "lane" L = 16 (s % 2)
        // + 8h + l8 of step s is this thread's item: its partial lives in shared memory (registers
        // here make ptxas serialize every wgmma, C7515) and only its owner thread adds to it.
        // [L][token ^ 4 (L % 8)]: the XOR spreads a staging instruction's 8 "lanes" L x 4 tokens
        // (f32) or 4 x 8 (x16) over 32 banks (unswizzled: 4 banks, 8-way conflicts on every
        // step's read and write of a partial); row_ss's reads of one L stay distinct words.
        __shared__ float ss_p[32][BT];
        auto ss_at = [&](int L, int n) -> float& { return ss_p[L][n ^ ((L & 7) << 2)]; };
#pragma unroll
        for (int j = 0; j < IPT; j++) {
            const int i = (int)threadIdx.x + j * THREADS;
#if GW_X16
            // item (n, h, tt) carries "lanes" L = 8h + 2tt and L + 1 (values 0..3 and 4..7)
            const int wi = i >> 5, n = 8 * (wi % (BT / 8)) + ((i & 31) >> 2), L = 8 * (wi / (BT / 8)) + 2 * (i & 3);
            ss_at(L + 1, n) = 0.0f;
            ss_at(17 + L, n) = 0.0f;
#else
            const int wi = i >> 5, n = 4 * (wi % (BT / 4)) + ((i & 31) >> 3), L = 8 * (wi / (BT / 4)) + (i & 7);
#endif
            ss_at(L, n) = 0.0f;
            ss_at(16 + L, n) = 0.0f;
        }
#endif
        // Staging in batches of XB items per thread: xs_load issues every global load of a batch
        // (x and, GW_NORM, ln) into registers of its own, xs_store (after, e.g. past the MMA
        // issue) sums, scales, rounds and stores them: one L2 round trip per batch.
        // GW_X16 item j (i = threadIdx.x + j * THREADS, warp item wi = i / 32): token n = 8 * (wi %
        // (BT / 8)) + (i % 32) / 4, half h = wi / (BT / 8), tt = i % 4 loads x[n][k + 32h + 8tt .. +7]
        // (16 bytes; a warp: 8 tokens x 64 contiguous bytes). Values 0..3 are the f32 path's item
        // l8 = 2tt (instruction 2h), 4..7 its l8 = 2tt + 1 (instruction 2h + 1); each pair is
        // stored as there: banks 4 (n % 8) + tt (+16 for instruction 2h + 1), 32 distinct per
        // store, one wavefront each.
        // f32 item j: token n = 4 * (wi % (BT / 4)) + (i % 32) / 8, half h = wi / (BT / 4), l8 = i % 8
        // loads x[n][k + 32h + 4 l8 .. +3] (see above).
        // BT 128 (128 accumulators): smaller batches, one at a time, or it spills
#if GW_X16
        constexpr int XB = BT >= 128 ? 1 : 2;
#else
        constexpr int XB = BT < 128 ? 4 : (GW_NORM ? 1 : 2);
#endif
        static_assert(IPT % XB == 0, "staging batches divide a thread's items");
        constexpr bool X_EARLY = BT < 128;  // the first batch's loads issued before the MMAs
        struct XBatch {
#if GW_X16
            uint4 v[XB];
            float4 ga[XB], gb[XB];
#else
            float4 v[XB], g[XB];
#endif
            bool in[XB], sc[XB];
        };
        // staging item j: its token n, half h, lane-in-token l (tt for GW_X16, l8 for f32)
        auto xitem = [&](int j, int& n, int& h, int& l) {
            const int i = (int)threadIdx.x + j * THREADS;
            const int wi = i >> 5;
#if GW_X16
            n = 8 * (wi % (BT / 8)) + ((i & 31) >> 2);
            h = wi / (BT / 8);
            l = i & 3;
#else
            n = 4 * (wi % (BT / 4)) + ((i & 31) >> 3);
            h = wi / (BT / 4);
            l = i & 7;
#endif
        };
        // active: false issues no load (the batch then stores zeros)
        auto xs_load = [&](XBatch& xb, int s, int j0, bool active, bool cg) {
            const int kc = k_begin + s * KSTEP;
#pragma unroll
            for (int jj = 0; jj < XB; jj++) {
                int n, h, l;
                xitem(j0 + jj, n, h, l);
                const int k = kc + 32 * h + (GW_X16 ? 8 : 4) * l;
                const int grow = m0 + n;
                xb.in[jj] = active && ((cmask >> (n >> 4)) & 1u) && n < live && k < k_end && (grow < lo || grow >= pad_hi);
                xb.sc[jj] = xb.in[jj] && GW_NORM && grow >= scale_lo;
#if GW_X16
                xb.v[jj] = make_uint4(0u, 0u, 0u, 0u);
                xb.ga[jj] = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
                xb.gb[jj] = xb.ga[jj];
                if (xb.in[jj]) xb.v[jj] = ldx(reinterpret_cast<const uint4*>(xrow(grow) + k), cg);
#if GW_NORM
                if (xb.sc[jj]) {
                    const float* gam = grow >= norm_lo ? ln : ln_lo;
                    xb.ga[jj] = ldx(reinterpret_cast<const float4*>(gam + k), cg);
                    xb.gb[jj] = ldx(reinterpret_cast<const float4*>(gam + k + 4), cg);
                }
#endif
#else
                xb.v[jj] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                xb.g[jj] = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
                if (xb.in[jj]) xb.v[jj] = ldx(reinterpret_cast<const float4*>(xrow(grow) + k), cg);
#if GW_NORM
                if (xb.sc[jj]) xb.g[jj] = ldx(reinterpret_cast<const float4*>((grow >= norm_lo ? ln : ln_lo) + k), cg);
#endif
#endif
            }
        };
        auto xs_store = [&](const XBatch& xb, int s, int buf, int j0) {
            unsigned char* base = smem + buf * BUF_B;
#pragma unroll
            for (int jj = 0; jj < XB; jj++) {
                int n, h, l;
                xitem(j0 + jj, n, h, l);
#if GW_X16
                const int tt = l;
                uint4 v = xb.v[jj];
#if GW_NORM
                const unsigned int q[4] = {v.x, v.y, v.z, v.w};
                if (xb.in[jj]) {
#pragma unroll
                    for (int hh = 0; hh < 2; hh++) {  // "lane" L + hh: values 4hh .. 4hh + 3
                        float* sp_ = &ss_at(16 * (s & 1) + 8 * h + 2 * tt + hh, n);
                        float ss = *sp_;
#pragma unroll
                        for (int e = 2 * hh; e < 2 * hh + 2; e++) {
                            const float f0 = from16(q[e] & 0xffffu), f1 = from16(q[e] >> 16);
                            ss = fmaf(f0, f0, ss);
                            ss = fmaf(f1, f1, ss);
                        }
                        *sp_ = ss;
                    }
                }
                if (xb.sc[jj]) {
                    const float gl[8] = {xb.ga[jj].x, xb.ga[jj].y, xb.ga[jj].z, xb.ga[jj].w,
                                         xb.gb[jj].x, xb.gb[jj].y, xb.gb[jj].z, xb.gb[jj].w};
                    unsigned int o[4];
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        o[e] = to16(from16(q[e] & 0xffffu) * gl[2 * e]) | (to16(from16(q[e] >> 16) * gl[2 * e + 1]) << 16);
                    v = make_uint4(o[0], o[1], o[2], o[3]);
                }
#endif
                unsigned char* p = base + 2 * h * Q_B + (n >> 3) * 256 + (n & 7) * 16 + 4 * tt;
                *reinterpret_cast<unsigned int*>(p) = v.x;
                *reinterpret_cast<unsigned int*>(p + 128) = v.y;
                *reinterpret_cast<unsigned int*>(p + Q_B) = v.z;
                *reinterpret_cast<unsigned int*>(p + Q_B + 128) = v.w;
#else
                const int l8 = l;
                float4 v = xb.v[jj];
#if GW_NORM
                if (xb.in[jj]) {
                    float* sp_ = &ss_at(16 * (s & 1) + 8 * h + l8, n);
                    float ss = *sp_;
                    ss = fmaf(v.x, v.x, ss);
                    ss = fmaf(v.y, v.y, ss);
                    ss = fmaf(v.z, v.z, ss);
                    ss = fmaf(v.w, v.w, ss);
                    *sp_ = ss;
                }
                if (xb.sc[jj]) {
                    v.x *= xb.g[jj].x;
                    v.y *= xb.g[jj].y;
                    v.z *= xb.g[jj].z;
                    v.w *= xb.g[jj].w;
                }
#endif
                // elements 0, 1 are fragment columns 2tt, 2tt + 1 (core matrix 0), 2, 3 are 2tt + 8,
                // 2tt + 9 (core matrix 1, 128 bytes on)
                const float f[4] = {v.x, v.y, v.z, v.w};
                unsigned char* p = base + (2 * h + (l8 & 1)) * Q_B + (n >> 3) * 256 + (n & 7) * 16 + 4 * (l8 >> 1);
#pragma unroll
                for (int sp = 0; sp < GW_SPLIT; sp++) {
                    unsigned int b[4];
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const unsigned int hi = to16(f[e]);
                        b[e] = (sp == 0) ? hi : to16(f[e] - from16(hi));
                    }
                    *reinterpret_cast<unsigned int*>(p + sp * PLANE_B) = b[0] | (b[1] << 16);
                    *reinterpret_cast<unsigned int*>(p + sp * PLANE_B + 128) = b[2] | (b[3] << 16);
                }
#endif
            }
        };
        // the whole of step s's x into buffer buf, batch by batch
        auto stage = [&](int s, int buf, int j_first) {
#pragma unroll 1  // a batch at a time: unrolled, ptxas hoists the next batches' loads (BT 128: spills)
            for (int j0 = j_first; j0 < IPT; j0 += XB) {
                XBatch xb;
                xs_load(xb, s, j0, true, false);
                xs_store(xb, s, buf, j0);
            }
        };

        // Weights: step s + 1's in registers (raw) while step s computes, steps up to s + D
        // requested into L2 ahead of them (prefetch: no registers, no scoreboard).
        Slot raw;
        Frag frag;
        const unsigned int z0 = wgmma_opaque_zero();
        const int kl = k_begin + 8 * t;  // this lane's first k of a step
        // the row lane t prefetches: set t / 2, row g + 8 (t % 2) (the 4 lanes of a group: its 4 rows)
        const unsigned short* const pf_row = (t & 2) ? ((t & 1) ? wrow[1][1] : wrow[1][0]) : ((t & 1) ? wrow[0][1] : wrow[0][0]);
        const bool pf_ok = ((ok >> t) & 1u) != 0u;
        load_slot(raw, wrow, ok, kl, k_end);
#pragma unroll
        for (int p = 1; p < D; p++) prefetch_step(pf_row, pf_ok, k_begin + p * KSTEP, k_end);

        float acc[2][BT / 2];
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int e = 0; e < BT / 2; e++) acc[a][e] = 0.0f;

        // Step 0's x. BT 64: the batch's loads all issued before any is used (one round trip,
        // with the weights'): as ld.global.cg, which ptxas keeps above the barrier (the default
        // read-only loads it sinks to their uses, item by item, a round trip each). BT 128 (a
        // batch of 1 or 2 items at a time, as in the loop): more in registers spills.
        if (nsteps > 0) {
            if (BT < 128) {
                XBatch xb;
                xs_load(xb, 0, 0, true, true);
                __syncthreads();
                xs_store(xb, 0, 0, 0);
            }
            stage(0, 0, BT < 128 ? XB : 0);
        }
        fence_proxy_async_shared();
        __syncthreads();

#pragma unroll 1
        for (int s = 0; s < nsteps; s++) {
            const unsigned char* bbase = smem + (s & 1) * BUF_B;
            to_frag(frag, raw, z0);  // waits for step s's weights
#pragma unroll
            for (int a = 0; a < 2; a++)
#pragma unroll
                for (int q = 0; q < 4; q++) wgmma_pin_operands<4>(frag.a[a][q]);
            load_slot(raw, wrow, ok, kl + (s + 1) * KSTEP, k_end);  // zeros past the slice
            prefetch_step(pf_row, pf_ok, k_begin + (s + D) * KSTEP, k_end);
            XBatch xb;  // step s + 1's first batch of x, in flight across the MMA issue
            if (X_EARLY) xs_load(xb, s + 1, 0, s + 1 < nsteps, false);
            wgmma_fence();
#pragma unroll
            for (int sp = 0; sp < GW_SPLIT; sp++) {
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const unsigned long long desc = wgmma_desc_kmajor_noswizzle(bbase + sp * PLANE_B + q * Q_B, 128, 256);
#pragma unroll
                    for (int c = 0; c < NCHUNK; c++) {
                        if (!((cmask >> (c * TPC)) & ((1u << TPC) - 1u))) continue;  // block-uniform
#pragma unroll
                        for (int a = 0; a < 2; a++)
                            gemm_wgmma_detail::wgmma(acc[a] + c * (NCH / 2), frag.a[a][q],
                                                     desc + (unsigned long long)((c * NCH * 32) >> 4));
                    }
                }
            }
            wgmma_commit_group();
            // step s + 1's x into the other buffer (step s - 1's: retired before the last barrier)
            // while step s's MMAs run
            if (s + 1 < nsteps) {
                if (X_EARLY) xs_store(xb, s + 1, (s + 1) & 1, 0);
                stage(s + 1, (s + 1) & 1, X_EARLY ? XB : 0);
            }
            wgmma_wait_group<0>();  // step s retired: frag and its x buffer are free ...
            fence_proxy_async_shared();
            __syncthreads();        // ... in every warpgroup, and step s + 1's x is staged
        }
#if GW_NORM
        __syncthreads();  // every item's last sum (nsteps may be 0)
        auto row_ss = [&](int lt) {  // warp_sum's xor butterfly over the 32 partials, lane 0's result
            float v[32];
#pragma unroll
            for (int L = 0; L < 32; L++) v[L] = ss_at(L, lt);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                float w2[32];
#pragma unroll
                for (int L = 0; L < 32; L++) w2[L] = v[L] + v[L ^ o];
#pragma unroll
                for (int L = 0; L < 32; L++) v[L] = w2[L];
            }
            return v[0];
        };
#else
        (void)ln;
        (void)eps;
        (void)norm_lo;
        (void)ln_lo;
#endif
        wgmma_wait_group<0>();
        wgmma_fence_operands<BT>(acc[0]);
        wgmma_fence_operands<BT>(acc[1]);


        // acc[a][4 jn + e]: weight row 16 wq + g + 8 (e >= 2) of set a, token 8 jn + 2t + (e & 1).
        if (ks == 1) {
#if GW_EPI == 3
            // the values y would hold, staged over the x buffers (every warpgroup's wgmmas retired)
            float* tile = reinterpret_cast<float*>(smem);
            __syncthreads();
#pragma unroll
            for (int jn = 0; jn < BT / 8; jn++) {
#pragma unroll
                for (int e1 = 0; e1 < 2; e1++) {
                    const int lt = 8 * jn + 2 * t + e1, row = m0 + lt;
                    if (lt >= live || !((smask >> (lt >> 4)) & 1u)) continue;
                    float sc = 1.0f;
#if GW_NORM
                    if (row >= scale_lo) sc = rsqrtf(row_ss(lt) * (1.0f / K) + eps);
#else
                    (void)row;
#endif
#pragma unroll
                    for (int e2 = 0; e2 < 2; e2++)
#pragma unroll
                        for (int a = 0; a < 2; a++)
                            tile[lt * TS + wg * 128 + 64 * a + 16 * wq + g + 8 * e2] = acc[a][4 * jn + 2 * e2 + e1] * sc;
                }
            }
            __syncthreads();
            qkv_epilogue(tile, cg * COLS, m0, live, N, [&](int lrow) { return ((smask >> (lrow >> 4)) & 1u) != 0u; },
                         lo, pad_hi, tile_live, use_live, q_norm, k_norm, inv_freq, pos, rows, y, k_cache, v_cache, kv_rows,
                         rope_eps, rope_scale);
#else
#pragma unroll
            for (int jn = 0; jn < BT / 8; jn++) {
#pragma unroll
                for (int e1 = 0; e1 < 2; e1++) {
                    const int lt = 8 * jn + 2 * t + e1, row = m0 + lt;
                    if (lt >= live || !((smask >> (lt >> 4)) & 1u)) continue;
                    float sc = 1.0f;
#if GW_NORM
                    if (row >= scale_lo) sc = rsqrtf(row_ss(lt) * (1.0f / K) + eps);
#endif
#pragma unroll
                    for (int e2 = 0; e2 < 2; e2++) {
                        const int e = 2 * e2 + e1;
                        if (NW == 1) {
#pragma unroll
                            for (int a = 0; a < 2; a++) {
                                const int col = nb + 64 * a + 16 * wq + g + 8 * e2;
                                if (col < N) epilogue_store<GW_EPI, GW_WTYPE>(y, r, (long long)row * N + col, acc[a][4 * jn + e] * sc, 0.0f);
                            }
                        } else {
                            const int col = nb + 16 * wq + g + 8 * e2;
                            if (col < N)
                                epilogue_store<GW_EPI, GW_WTYPE>(y, r, (long long)row * N + col, acc[0][4 * jn + e] * sc,
                                                       acc[1][4 * jn + e] * sc);
                        }
                    }
                }
            }
#endif
            continue;
        }

        // ---- split K: this slice's partial tile [NW][BT][COLS] (and row sums), then the reduction.
        // Workspace per slot: the ks partial tiles, then (GW_NORM) the ks slices' row sums.
        float* wss = ws + (long long)slot * ks * (NW * BT * COLS + GW_NORM * BT);
        float* wsb = wss + (long long)zi * (NW * BT * COLS);
#pragma unroll
        for (int jn = 0; jn < BT / 8; jn++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int lt = 8 * jn + 2 * t + (e & 1);
                if (lt >= live || !((smask >> (lt >> 4)) & 1u)) continue;
#pragma unroll
                for (int a = 0; a < 2; a++) {
                    const int jw = (NW == 2) ? a : 0;
                    const int lc = wg * (128 / NW) + (NW == 1 ? 64 * a : 0) + 16 * wq + g + 8 * (e >> 1);
                    wsb[((long long)jw * BT + lt) * COLS + lc] = acc[a][4 * jn + e];
                }
            }
        }
        float* ssw = wss + (long long)ks * NW * BT * COLS;
#if GW_NORM
        if ((int)threadIdx.x < live) ssw[zi * BT + threadIdx.x] = row_ss((int)threadIdx.x);
#endif
#if GW_EPI == 3
        // the reducing block sums the slices into the staged tile (the x buffers: every wgmma of
        // the block retired before splitk_reduce's barrier), then the qkv epilogue as above
        float* tile = reinterpret_cast<float*>(smem);
        if (splitk_reduce<NW, BT, COLS, THREADS, GW_EPI, GW_NORM, K, GW_WTYPE>(
                wss, ssw, ks, counters + slot, y, r, m0, live, cg * COLS, N, eps, scale_lo,
                [&](int lrow) { return ((smask >> (lrow >> 4)) & 1u) != 0u; }, tile, TS)) {
            __syncthreads();
            qkv_epilogue(tile, cg * COLS, m0, live, N, [&](int lrow) { return ((smask >> (lrow >> 4)) & 1u) != 0u; },
                         lo, pad_hi, tile_live, use_live, q_norm, k_norm, inv_freq, pos, rows, y, k_cache, v_cache, kv_rows,
                         rope_eps, rope_scale);
        }
#else
        (void)q_norm;
        (void)k_norm;
        (void)inv_freq;
        (void)pos;
        (void)rows;
        (void)k_cache;
        (void)v_cache;
        (void)kv_rows;
        (void)rope_eps;
        (void)rope_scale;
        splitk_reduce<NW, BT, COLS, THREADS, GW_EPI, GW_NORM, K, GW_WTYPE>(
            wss, ssw, ks, counters + slot, y, r, m0, live, cg * COLS, N, eps, scale_lo,
            [&](int lrow) { return ((smask >> (lrow >> 4)) & 1u) != 0u; });
#endif
    }
}

extern "C" __global__ void __launch_bounds__(GW_WG * 128, 1) gemm_wgmma(const GemmWgmmaParams p) {
    gemm_wgmma_body(p.x, p.w, p.y, p.r, p.M, p.N, p.kz, p.kt, p.ws, p.counters, p.pad_lo, p.pad_hi,
                    p.ln, p.eps, p.norm_lo, p.tile_live, p.use_live, p.q_norm, p.k_norm, p.inv_freq,
                    p.pos, p.rows, p.k_cache, p.v_cache, p.kv_rows, p.rope_eps, p.rope_scale,
                    p.x2, p.row_split, p.ln_lo, p.use_ln_lo);
}

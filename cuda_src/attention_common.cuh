// attention_common.cuh — what the two split-KV attention kernels share
// (attention.cu: CUDA cores, any D; attention_mma.cu: tensor cores): the
// compile-time sizes and their defaults, the key tiling of the splits, the
// partial-result layout, the two ways of merging the splits (below), the
// gate, the lanes, asynchronous copies to shared memory.
//
// Merging the splits (SPLITS > 1). Every split block writes its
// un-normalised partial (part_o, part_ml); the splits are then summed in
// order 0 .. SPLITS-1 with log-sum-exp weights, by one of two compile-time
// choices (FOLD_MERGE) with exactly the same arithmetic, so their outputs
// are bit-identical to each other and run to run:
//  * FOLD_MERGE 0, two launches: ring_attn_combine (attention.cu), launched
//    after the split kernel, merges every row (a thread per output element).
//  * FOLD_MERGE 1, one launch (the folded combine): a "unit" is the set of
//    SPLITS blocks that hold the same query rows over the SPLITS key slices
//    (one lane, one kv head, one row group on the CUDA cores). Each block of
//    a unit takes a ticket from counters[unit] (an int32 per unit, owned by
//    ops/attention.py, zero between launches) after its partial; the block
//    that draws the last ticket merges the unit's splits into `out` and puts
//    the counter back to 0, so the next launch (or a graph replay) starts
//    from zero. Memory order: arrive.cuh's release/acquire ticket; the last
//    block reads the partials from L2 (__ldcg: other SMs wrote them). An idle
//    lane's blocks return before counting: its counters stay 0.
//
// Lanes (LANES > 1): one launch serves LANES independent requests, lane l
// (the grid's lane coordinate) reading and writing only its own slices:
//   q, out   rows [l*LANE_ROWS, l*LANE_ROWS + B) of [LANES*LANE_ROWS, NH*D]
//            (LANE_ROWS >= B: the lane's rows in the step's row space)
//   gate     the same rows of [LANES*LANE_ROWS, NH] or [.., NH*D]
//   k_cache, v_cache the lane's logical rows [0, KV_TOTAL) through its page table
//            pages [LANES, N_PAGES] (step_desc.cuh's page_row; PAGE rows per page, a
//            multiple of TILE: a key tile is one piece of one page, one table load per
//            tile); mask [LANES, B, KV_TOTAL]
//   part_o, part_ml [LANES, SPLITS, ...] (the workspace per lane)
// With use_live, live = the step descriptors [LANES, DESC_LEN] int32 and a lane
// with live[l*DESC_LEN + DESC_ACTIVE] == 0 is idle: its blocks return before
// reading anything and its out rows are untouched. LANES 1 with LANE_ROWS B
// is the single-request kernel (every lane offset 0).
//
// out is f32, or with OUT16 1 / 2 the bits of f16 / bf16 (below); partials stay f32.
#pragma once
#include <cuda_fp16.h>
#include "arrive.cuh"
#include "bits16.cuh"
#include "step_desc.cuh"
#include "warp.cuh"

#ifndef D
#define D 128
#endif
#ifndef NH
#define NH 32
#endif
#ifndef NKV
#define NKV 8
#endif
#ifndef B
#define B 16
#endif
#ifndef KV_TOTAL
#define KV_TOTAL 2080
#endif
#ifndef SPLITS
#define SPLITS 4
#endif
#ifndef GATE
#define GATE 0
#endif
#ifndef LANES
#define LANES 1
#endif
#ifndef LANE_ROWS
#define LANE_ROWS B
#endif
#ifndef PAGE
#define PAGE 32               // K/V rows per page (kv_pages.py)
#endif
// The folded merge saves a launch (a graph node) and the combine's read of the
// whole workspace by a full grid, but the lone merging block of a unit reads
// its unit's partials at one SM's share of the L2 bandwidth: which is faster
// depends on the shape (ops/attention.py: default_merge, and the autotuner on a GPU).
#ifndef FOLD_MERGE
#define FOLD_MERGE 1          // SPLITS > 1: 1 the last split block merges, 0 ring_attn_combine does
#endif
// OUT16: each value rounded to nearest even once, as the o projection reading it
// (a single-rounding GEMM of that weight type, gemm_stream.cu's GS_X16) would
// round it: bit-identical downstream, half the bytes.
#ifndef OUT16
#define OUT16 0               // out: 0 f32, 1 f16 bits, 2 bf16 bits
#endif
#if OUT16
#define OUT_T unsigned short
#else
#define OUT_T float
#endif

#define G (NH / NKV)
#define R (B * G)

#define TILE 32               // keys per shared-memory tile (read by ops/attention.py)
#define MERGE_UNROLL 16        // splits per step of the folded merge (read by profiling/counters.py)
#define COMBINE_THREADS 128    // block of ring_attn_combine (read by ops/attention.py)
#define KV_W (NKV * D)
#define N_TILES ((KV_TOTAL + TILE - 1) / TILE)
#define TILES_PER_SPLIT ((N_TILES + SPLITS - 1) / SPLITS)
#define SPLIT_KEYS (TILES_PER_SPLIT * TILE)
#define N_PAGES ((KV_TOTAL + PAGE - 1) / PAGE)   // page table entries per lane

#if NH % NKV != 0
#error "attention: NH must be a multiple of NKV"
#endif
#if D % 8 != 0 || D > 256
#error "attention: D must be a multiple of 8 and at most 256"
#endif
#if GATE < 0 || GATE > 2
#error "attention: GATE must be 0, 1 or 2"
#endif
#if LANES < 1 || LANE_ROWS < B
#error "attention: LANES must be >= 1 and LANE_ROWS >= B"
#endif
#if PAGE < TILE || PAGE % TILE != 0
#error "attention: PAGE must be a multiple of TILE (a key tile within one page)"
#endif
#if FOLD_MERGE != 0 && FOLD_MERGE != 1
#error "attention: FOLD_MERGE must be 0 or 1"
#endif
#if OUT16 < 0 || OUT16 > 2
#error "attention: OUT16 must be 0 (f32), 1 (f16) or 2 (bf16)"
#endif

#define LOG2E 1.4426950408889634f
#define NEG_INF __int_as_float(0xff800000)

// softplus with PyTorch's threshold (beta 1, threshold 20)
__device__ __forceinline__ float softplus(float x) {
    return x > 20.f ? x : log1pf(expf(x));
}

__device__ __forceinline__ float gate_factor(const float* gate, int qrow, int d) {
#if GATE == 1
    return softplus(gate[qrow]);
#elif GATE == 2
    return softplus(gate[(long long)qrow * D + d]);
#else
    return 1.f;
#endif
}


// One output element, rounded to out's type (OUT16).
__device__ __forceinline__ void store_out(OUT_T* out, long long i, float v) {
#if OUT16
    out[i] = (unsigned short)to_bits16<OUT16>(v);
#else
    out[i] = v;
#endif
}

// Lane l idle this step (its descriptor says so): every block of it returns at once.
__device__ __forceinline__ bool lane_idle(const int* live, int use_live, int lane) {
    return use_live && live[lane * DESC_LEN + DESC_ACTIVE] == 0;
}

// Element offsets of lane l's slices (see the top of this file): q and out
// (q_o), gate, the page table, the mask, part_o and part_ml.
struct LaneOffsets {
    long long q_o, gate, pages, mask, part_o, part_ml;
};

__device__ __forceinline__ LaneOffsets lane_offsets(int lane) {
    const long long rows = (long long)lane * LANE_ROWS * NH;   // q/out head-rows before the lane's
    LaneOffsets o;
    o.q_o = rows * D;
    o.gate = rows * (GATE == 2 ? D : 1);
    o.pages = (long long)lane * N_PAGES;
    o.mask = (long long)lane * B * KV_TOTAL;
    o.part_o = (long long)lane * SPLITS * B * NH * D;
    o.part_ml = (long long)lane * SPLITS * B * NH * 2;
    return o;
}

// The first physical row of the key tile at logical key k0 (a multiple of TILE).
// (int: a pool's rows fit int32, kv_pages.py checks; 32-bit registers where the mma kernel has none to spare)
__device__ __forceinline__ int tile_row(const int* __restrict__ pages, int k0) {
    return page_row(pages, PAGE, k0);
}

// Asynchronous 16-byte copies global -> shared (cp.async.cg, sm_80+): no
// registers hold the data in flight. cp_async16 copies src to dst, or writes
// zeros without reading src when !full; cp_async_commit closes the calling
// thread's group of copies, cp_async_wait_all waits for all of them (a barrier
// after it shows them to the block). Both 16-byte aligned. Under the emulator
// the copy happens at once (as if it had already landed).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool full) {
#ifdef __CUDA_ARCH__
    const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(full ? 16 : 0) : "memory");
#else
    *reinterpret_cast<uint4*>(dst) = full ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

// Called by every thread of a block after it wrote its partial: true in every
// thread of the block that arrived last for `unit` (arrive.cuh: the memory order).
// ticket: an int of the block's shared memory that no thread uses any more.
__device__ __forceinline__ bool last_split_to_arrive(int* counters, int unit, int* ticket) {
    return last_block_to_arrive(&counters[unit], SPLITS, ticket);
}

// The last block's merge of query rows [r_lo, r_hi) (row r = b*G + g: query
// head kvh*G + g of noise row b) of kv head kvh: out = sum_s w_s o_s /
// sum_s w_s l_s (x the gate), w_s = 2^(m_s - max_s m_s), splits in order 0 ..
// SPLITS-1. First a thread per row: its max and weighted sum into ml_s
// (shared scratch of 2 * (r_hi - r_lo) floats no thread uses any more), so the
// output pass has no dependent load before its partials. Then a thread takes
// four dims of a row, D/4 apart: each of its four loads (and stores) is
// coalesced across the warp, and all are independent. One block alone reads
// SPLITS x rows x D x 4 bytes here, bound by its SM's share of L2 bandwidth:
// MERGE_UNROLL splits per step keep 5 x MERGE_UNROLL loads per thread in
// flight (80 at 16: ~40 KB per 128-thread block). Last, counters[unit] = 0.
// `nthreads`: the block's threads.
__device__ __forceinline__ void merge_splits(const float* part_o, const float* part_ml, const float* gate,
                                             OUT_T* out, int kvh, int r_lo, int r_hi, int nthreads,
                                             float* ml_s, int* counters, int unit) {
    constexpr int V4 = D / 4;
    for (int r = r_lo + (int)threadIdx.x; r < r_hi; r += nthreads) {
        const int qrow = (r / G) * NH + kvh * G + r % G;
        float m = NEG_INF, l = 0.f;
#pragma unroll MERGE_UNROLL
        for (int s = 0; s < SPLITS; ++s)
            m = fmaxf(m, __ldcg(part_ml + ((long long)s * (B * NH) + qrow) * 2));
        if (m != NEG_INF) {
#pragma unroll MERGE_UNROLL
            for (int s = 0; s < SPLITS; ++s) {
                const float2 ml = __ldcg(reinterpret_cast<const float2*>(part_ml + ((long long)s * (B * NH) + qrow) * 2));
                l += exp2f(ml.x - m) * ml.y;   // w_s: 0 for empty / fully hidden splits
            }
        }
        ml_s[2 * (r - r_lo)] = m;
        ml_s[2 * (r - r_lo) + 1] = l;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < (r_hi - r_lo) * V4; i += nthreads) {
        const int r = r_lo + i / V4, c = i % V4;
        const int qrow = (r / G) * NH + kvh * G + r % G;
        const float m = ml_s[2 * (r - r_lo)], l = ml_s[2 * (r - r_lo) + 1];
        float o[4] = {0.f, 0.f, 0.f, 0.f};
        if (m != NEG_INF) {
#pragma unroll MERGE_UNROLL
            for (int s = 0; s < SPLITS; ++s) {
                const long long rs = (long long)s * (B * NH) + qrow;
                const float w = exp2f(__ldcg(part_ml + rs * 2) - m);
#pragma unroll
                for (int e = 0; e < 4; ++e) o[e] += w * __ldcg(part_o + rs * D + c + e * V4);
            }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e)
            store_out(out, (long long)qrow * D + c + e * V4, (l > 0.f ? o[e] / l : 0.f) * gate_factor(gate, qrow, c + e * V4));
    }
    if (threadIdx.x == 0) counters[unit] = 0;   // ready for the next launch (or replay)
}

// attention_common.cuh — what the two split-KV attention kernels share
// (attention.cu: CUDA cores, any D; attention_mma.cu: tensor cores): the
// compile-time sizes and their defaults, the key tiling of the splits, the
// partial-result layout read by ring_attn_combine, the gate, the lanes.
//
// Lanes (LANES > 1): one launch serves LANES independent requests, lane l
// (the grid's lane coordinate) reading and writing only its own slices:
//   q, out   rows [l*LANE_ROWS, l*LANE_ROWS + B) of [LANES*LANE_ROWS, NH*D]
//            (LANE_ROWS >= B: the lane's rows in the step's row space)
//   gate     the same rows of [LANES*LANE_ROWS, NH] or [.., NH*D]
//   k_cache, v_cache rows [l*KV_TOTAL, (l+1)*KV_TOTAL), mask [LANES, B, KV_TOTAL]
//   part_o, part_ml [LANES, SPLITS, ...] (the workspace per lane)
// With use_live, live = the step descriptors [LANES, DESC_LEN] int32 and a lane
// with live[l*DESC_LEN + DESC_ACTIVE] == 0 is idle: its blocks return before
// reading anything and its out rows are untouched. LANES 1 with LANE_ROWS B
// is the single-request kernel (every lane offset 0).
#pragma once
#include <cuda_fp16.h>
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

#define G (NH / NKV)
#define R (B * G)

#define TILE 32               // keys per shared-memory tile (read by ops/attention.py)
#define COMBINE_THREADS 128    // block of ring_attn_combine (read by ops/attention.py)
#define KV_W (NKV * D)
#define N_TILES ((KV_TOTAL + TILE - 1) / TILE)
#define TILES_PER_SPLIT ((N_TILES + SPLITS - 1) / SPLITS)
#define SPLIT_KEYS (TILES_PER_SPLIT * TILE)

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


// Lane l idle this step (its descriptor says so): every block of it returns at once.
__device__ __forceinline__ bool lane_idle(const int* live, int use_live, int lane) {
    return use_live && live[lane * DESC_LEN + DESC_ACTIVE] == 0;
}

// Element offsets of lane l's slices (see the top of this file): q and out
// (q_o), gate, the K/V caches, the mask, part_o and part_ml.
struct LaneOffsets {
    long long q_o, gate, kv, mask, part_o, part_ml;
};

__device__ __forceinline__ LaneOffsets lane_offsets(int lane) {
    const long long rows = (long long)lane * LANE_ROWS * NH;   // q/out head-rows before the lane's
    LaneOffsets o;
    o.q_o = rows * D;
    o.gate = rows * (GATE == 2 ? D : 1);
    o.kv = (long long)lane * KV_TOTAL * KV_W;
    o.mask = (long long)lane * B * KV_TOTAL;
    o.part_o = (long long)lane * SPLITS * B * NH * D;
    o.part_ml = (long long)lane * SPLITS * B * NH * 2;
    return o;
}

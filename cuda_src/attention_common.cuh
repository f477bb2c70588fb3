// attention_common.cuh — what the two split-KV attention kernels share
// (attention.cu: CUDA cores, any D; attention_mma.cu: tensor cores): the
// compile-time sizes and their defaults, the key tiling of the splits, the
// partial-result layout read by ring_attn_combine, the gate.
#pragma once
#include <cuda_fp16.h>
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


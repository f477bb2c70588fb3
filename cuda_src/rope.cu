// rope.cu — per-head RMSNorm of Q and K, NEOX RoPE at absolute positions,
// and the f16 scatter of K/V rows into the ring caches (SPEC §2 steps 2-4,
// §3 "cached rows hold K after k_norm and RoPE at their absolute position").
//
// One kernel serves both users:
//   * the append stage (HAS_Q=0): rows of K|V for newly committed context
//     positions; rows[m] is the ring slot, or the trash slot for padding;
//   * the noise rows (HAS_Q=1): Q|K|V of the q_len noise tokens; Q goes to
//     q_out (f32), K/V to the noise scratch rows capacity + i.
//
// Layouts (row-major, all contiguous):
//   qkv       [M, QKV_W] f32, QKV_W = (HAS_Q ? NH*D : 0) + 2*NKV*D:
//             [Q (NH heads of D) | K (NKV heads) | V (NKV heads)]
//   q_norm    [D] f32 (read only when HAS_Q), k_norm [D] f32
//   inv_freq  [D/2] f64: f_i (theta^(-2i/D) for plain RoPE; linear/YaRN
//             scaling is just another table, computed on the host)
//   pos       [M] int32 absolute positions, rows [M] int32 cache rows
//   q_out     [M, NH*D] f32 (HAS_Q only)
//   k_cache, v_cache [kv_rows, NKV*D] f16; rows outside [0, kv_rows) are
//             skipped (a defensive bound: a bad row index must not scribble
//             over other device memory)
//
// Math per head (x = one D-slice):
//   xn = x / sqrt(mean(x^2) + eps) * w          (Q and K; V untouched)
//   a_i = pos * f_i; c = cos(a_i)*mscale, s = sin(a_i)*mscale
//   (xn_i, xn_{i+D/2}) -> (xn_i c - xn_{i+D/2} s, xn_{i+D/2} c + xn_i s)
// The angle is exact at positions >= 2^20 (rope_math.cuh: rope_cos_sin says how).
//
// Launch: grid (M), block (ROPE_THREADS) — ROPE_THREADS a multiple of 32.
//   Step 1: the block computes the D/2 (cos, sin) pairs of its row once into
//           shared memory (shared by every Q and K head of the row).
//   Step 2: each warp takes head units (NH Q heads, NKV K heads, NKV V heads)
//           round-robin; lanes own pairs (i, i+D/2), i = lane + 32*j, so the
//           rotation needs no cross-lane traffic and the norm one warp sum.
//
// Compile-time: D (even), NH, NKV, HAS_Q, ROPE_THREADS.
// Runtime: M, kv_rows, eps, attn_scale_factor (YaRN mscale; 1.0 otherwise);
//   tile_live [ceil(M/16)] int32, read when use_live (the lane batch's flags, as the GEMMs
//   read them): a row of a tile marked 0 is skipped (nothing written), of a tile marked 2
//   (context rows: K and V only; the qkv GEMM left their Q columns unwritten) its Q heads.
// nvrtc-check: -DD=64 -DNH=4 -DNKV=2 -DHAS_Q=0
// nvrtc-check: -DD=80 -DNH=3 -DNKV=1 -DHAS_Q=1
// nvrtc-check: -DD=256 -DNH=16 -DNKV=4 -DHAS_Q=1
#include <cuda_fp16.h>
#include "rope_math.cuh"  // the per-head math, shared with gemm_wgmma.cu's qkv epilogue
#include "pdl.cuh"

#ifndef D
#define D 128
#endif
#ifndef NH
#define NH 32
#endif
#ifndef NKV
#define NKV 8
#endif
#ifndef HAS_Q
#define HAS_Q 1
#endif
#ifndef ROPE_THREADS
#define ROPE_THREADS 128
#endif

#define HALF_D (D / 2)
#define Q_W (HAS_Q ? NH * D : 0)
#define KV_W (NKV * D)
#define QKV_W (Q_W + 2 * KV_W)
#define PAIRS_PER_LANE ((HALF_D + 31) / 32)
#define ROPE_WARPS (ROPE_THREADS / 32)

#if D % 2 != 0
#error "rope.cu: head dim D must be even"
#endif
#if ROPE_THREADS % 32 != 0
#error "rope.cu: ROPE_THREADS must be a multiple of 32"
#endif

extern "C" __global__ void __launch_bounds__(ROPE_THREADS)
qkv_norm_rope(const float* __restrict__ qkv,
              const float* __restrict__ q_norm,
              const float* __restrict__ k_norm,
              const double* __restrict__ inv_freq,
              const int* __restrict__ pos,
              const int* __restrict__ rows,
              float* __restrict__ q_out,
              __half* __restrict__ k_cache,
              __half* __restrict__ v_cache,
              int M, int kv_rows, float eps, float attn_scale_factor,
              const int* __restrict__ tile_live, int use_live)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    __shared__ float cs_cos[HALF_D];
    __shared__ float cs_sin[HALF_D];

    const int m = blockIdx.x;
    if (m >= M) return;  // block-uniform: no barrier is skipped by part of a block
    const int tl = use_live ? tile_live[m >> 4] : 1;
    if (tl == 0) return;  // a dead tile's row (an idle lane's): block-uniform too
    const int p = pos[m];
    const int row = rows[m];
    const bool row_ok = row >= 0 && row < kv_rows;

    for (int i = threadIdx.x; i < HALF_D; i += ROPE_THREADS) rope_cos_sin(p, inv_freq[i], attn_scale_factor, cs_cos[i], cs_sin[i]);
    __syncthreads();

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const float* xrow = qkv + (long long)m * QKV_W;
    const int q_units = (HAS_Q && tl != 2) ? NH : 0;  // a context row's Q is never read
    const int n_units = (HAS_Q ? NH : 0) + 2 * NKV;

    for (int u = (HAS_Q ? NH : 0) - q_units + warp; u < n_units; u += ROPE_WARPS) {
        // unit -> (kind, head): Q heads first, then K heads, then V heads
        int kind, h;
        if (HAS_Q && u < NH) { kind = 0; h = u; }
        else if (u < (HAS_Q ? NH : 0) + NKV) { kind = 1; h = u - (HAS_Q ? NH : 0); }
        else { kind = 2; h = u - (HAS_Q ? NH : 0) - NKV; }

        const float* x = xrow + (kind == 0 ? 0 : Q_W + (kind - 1) * KV_W) + h * D;

        if (kind == 2) {
            if (!row_ok) continue;
            __half* dst = v_cache + (long long)row * KV_W + h * D;
            for (int d = lane; d < D; d += 32) dst[d] = __float2half_rn(x[d]);
            continue;
        }

        float lo[PAIRS_PER_LANE], hi[PAIRS_PER_LANE], c[PAIRS_PER_LANE], sn[PAIRS_PER_LANE];
        const float rn = RopeHead<D>::load(x, lo, hi, lane, eps);
        const float* w = kind == 0 ? q_norm : k_norm;
#pragma unroll
        for (int j = 0; j < PAIRS_PER_LANE; ++j) {
            const int i = lane + 32 * j;
            c[j] = i < HALF_D ? cs_cos[i] : 0.f;
            sn[j] = i < HALF_D ? cs_sin[i] : 0.f;
        }

        if (kind == 0) {
            RopeHead<D>::store(q_out + (long long)m * (NH * D) + h * D, lo, hi, rn, w, c, sn, lane);
        } else {
            if (!row_ok) continue;
            RopeHead<D>::store(k_cache + (long long)row * KV_W + h * D, lo, hi, rn, w, c, sn, lane);
        }
    }
}

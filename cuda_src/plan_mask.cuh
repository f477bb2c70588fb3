// plan_mask.cuh — one column of the step's attention masks (SPEC §3.5, §6), shared by
// tests/cuda/planning_unfused.cu's build_masks (sizes fixed at compile time) and
// step_plan.cu's fused plan_lanes (sizes as launch arguments).
//   mask_full, mask_swa [q_len, kv_total] f16, 0 visible / -inf hidden. Block row q sits at
//   position committed + q; p = slot_pos[c] (the position slot c holds after this step's
//   append). rule: the PLAN_MASK_* bits below (dflash_cupy/mask_rule.py), window: W (0: none).
//   c < cap:  full visible iff lo <= p < committed;
//             swa, per-row rule: lo <= p < committed and (committed + q) - p < W;
//             swa, anchored rule: swa_lo <= p < committed (the same for every row);
//   cap <= c < cap + q_len (block key j = c - cap): visible to row q iff j <= q when the
//             layer kind is causal; swa per-row also needs |q - j| < W;
//   trash and padding columns: hidden.
// One thread per column writes that column of every row: a warp's stores to one
// row are consecutive halves (coalesced).
#pragma once
#include <cuda_fp16.h>
#include "step_desc.cuh"

#define PLAN_F16_ZERO __ushort_as_half((unsigned short)0x0000)
#define PLAN_F16_NEG_INF __ushort_as_half((unsigned short)0xfc00)

// Bits of the rule argument (bits 0 and 1 of plan_lanes' masks argument name the masks written).
#define PLAN_MASK_PER_ROW 4
#define PLAN_MASK_CAUSAL_FULL 8
#define PLAN_MASK_CAUSAL_SLIDING 16

__device__ __forceinline__ void plan_mask_column(const int* __restrict__ desc, int c, int p, int cap, int q_len,
                                                 int kv_total, bool full, bool swa, int rule, int window,
                                                 __half* __restrict__ mask_full, __half* __restrict__ mask_swa)
{
    const int committed = desc[DESC_COMMITTED];
    const bool per_row = (rule & PLAN_MASK_PER_ROW) != 0 && window > 0;
    if (c < cap) {
        const bool in = p >= desc[DESC_LO] && p < committed;
        const __half vf = in ? PLAN_F16_ZERO : PLAN_F16_NEG_INF;
        const __half va = (p >= desc[DESC_SWA_LO] && p < committed) ? PLAN_F16_ZERO : PLAN_F16_NEG_INF;
        // per-row: row q sees p iff (committed - p) + q < window, i.e. q < rows_seen
        const long long rows_seen = in ? (long long)window - ((long long)committed - p) : 0;
        for (int q = 0; q < q_len; ++q) {
            if (full) mask_full[(long long)q * kv_total + c] = vf;
            if (swa) mask_swa[(long long)q * kv_total + c] = !per_row ? va
                                                          : (q < rows_seen ? PLAN_F16_ZERO : PLAN_F16_NEG_INF);
        }
    } else if (c < cap + q_len) {
        const int j = c - cap;
        const bool cf = (rule & PLAN_MASK_CAUSAL_FULL) != 0, cs = (rule & PLAN_MASK_CAUSAL_SLIDING) != 0;
        for (int q = 0; q < q_len; ++q) {
            if (full) mask_full[(long long)q * kv_total + c] = (!cf || j <= q) ? PLAN_F16_ZERO : PLAN_F16_NEG_INF;
            if (swa) {
                const bool v = (!cs || j <= q) && (!per_row || (q - j < window && j - q < window));
                mask_swa[(long long)q * kv_total + c] = v ? PLAN_F16_ZERO : PLAN_F16_NEG_INF;
            }
        }
    } else {
        for (int q = 0; q < q_len; ++q) {
            if (full) mask_full[(long long)q * kv_total + c] = PLAN_F16_NEG_INF;
            if (swa) mask_swa[(long long)q * kv_total + c] = PLAN_F16_NEG_INF;
        }
    }
}

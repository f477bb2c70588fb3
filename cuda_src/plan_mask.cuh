// plan_mask.cuh — one column of the step's attention masks (SPEC §3 step 5),
// shared by tests/cuda/planning_unfused.cu's build_masks (sizes fixed at compile time) and step_plan.cu's
// fused plan_lanes (sizes as launch arguments).
//   mask_full, mask_swa [q_len, kv_total] f16, 0 visible / -inf hidden:
//   c < cap:  full visible iff lo <= p < committed, swa iff swa_lo <= p < committed,
//             p = slot_pos[c] (the position the slot holds after this step's append);
//   cap <= c < cap + q_len (noise j = c - cap): full always visible, swa visible to
//             noise row q iff j <= q (causal);
//   trash and padding columns: hidden.
// One thread per column writes that column of every row: a warp's stores to one
// row are consecutive halves (coalesced).
#pragma once
#include <cuda_fp16.h>
#include "step_desc.cuh"

#define PLAN_F16_ZERO __ushort_as_half((unsigned short)0x0000)
#define PLAN_F16_NEG_INF __ushort_as_half((unsigned short)0xfc00)

__device__ __forceinline__ void plan_mask_column(const int* __restrict__ desc, int c, int p, int cap, int q_len,
                                                 int kv_total, bool full, bool swa,
                                                 __half* __restrict__ mask_full, __half* __restrict__ mask_swa)
{
    const int committed = desc[DESC_COMMITTED];
    if (c < cap) {
        const __half vf = (p >= desc[DESC_LO] && p < committed) ? PLAN_F16_ZERO : PLAN_F16_NEG_INF;
        const __half vs = (p >= desc[DESC_SWA_LO] && p < committed) ? PLAN_F16_ZERO : PLAN_F16_NEG_INF;
        for (int q = 0; q < q_len; ++q) {
            if (full) mask_full[(long long)q * kv_total + c] = vf;
            if (swa) mask_swa[(long long)q * kv_total + c] = vs;
        }
    } else if (c < cap + q_len) {
        const int j = c - cap;
        for (int q = 0; q < q_len; ++q) {
            if (full) mask_full[(long long)q * kv_total + c] = PLAN_F16_ZERO;
            if (swa) mask_swa[(long long)q * kv_total + c] = j <= q ? PLAN_F16_ZERO : PLAN_F16_NEG_INF;
        }
    } else {
        for (int q = 0; q < q_len; ++q) {
            if (full) mask_full[(long long)q * kv_total + c] = PLAN_F16_NEG_INF;
            if (swa) mask_swa[(long long)q * kv_total + c] = PLAN_F16_NEG_INF;
        }
    }
}

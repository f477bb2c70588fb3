// planning_unfused.cu (tests only) — the step graph's planning as separate
// launches: the reference that step_plan.cu's fused plan_step is tested against
// (tests/test_plan.py), with ring_slots.cu's plan_append between them:
//   reset_slots_if, plan_append, gather_features, build_masks == plan_step.
// The product never launches these (tests/support/planning_unfused.py loads
// them); the mask arithmetic is plan_mask.cuh's, shared with plan_step, so
// the independent oracle of both is the NumPy reference.ring_masks.
//
// Compile-time: CAP = ring slots, Q_LEN = noise rows, KV_TOTAL = cache rows
// (> CAP + Q_LEN). desc: the step descriptor (step_desc.cuh).
//
// reset_slots_if (desc, slot_pos): slot_pos[s] = -1 for s < CAP when
//   desc[DESC_RESET]. grid (ceil(CAP / PLAN_SLOT_THREADS)), block (PLAN_SLOT_THREADS).
// build_masks / build_mask_full / build_mask_swa (desc, slot_pos, masks, rule, window):
//   mask_full, mask_swa [Q_LEN, KV_TOTAL] f16, 0 visible / -inf hidden
//   (plan_mask.cuh has the rule; rule: its PLAN_MASK_* bits, window: W). grid (ceil(KV_TOTAL / PLAN_ROW_THREADS)),
//   block (PLAN_ROW_THREADS): one thread per column writes that column of
//   every row. Runs after plan_append in stream order (reads slot_pos).
// nvrtc-check: -DCAP=3 -DQ_LEN=16 -DKV_TOTAL=32
#include <cuda_fp16.h>
#include "step_desc.cuh"
#include "plan_mask.cuh"
#include "pdl.cuh"

#ifndef CAP
#define CAP 1024
#endif
#ifndef Q_LEN
#define Q_LEN 16
#endif
#ifndef KV_TOTAL
#define KV_TOTAL 1056
#endif

#if CAP + Q_LEN >= KV_TOTAL
#error "planning_unfused.cu: KV_TOTAL must exceed CAP + Q_LEN (the trash slot)"
#endif

extern "C" __global__ void __launch_bounds__(PLAN_SLOT_THREADS)
reset_slots_if(const int* __restrict__ desc, int* __restrict__ slot_pos)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    const int s = blockIdx.x * PLAN_SLOT_THREADS + threadIdx.x;
    if (s < CAP && desc[DESC_RESET] != 0) slot_pos[s] = -1;
}

// Visibility of one column for both mask kinds (plan_mask.cuh); the sizes are
// compile-time constants here, so the shared function folds them.
template <bool FULL, bool SWA>
__device__ __forceinline__ void build_masks_impl(const int* __restrict__ desc,
                                                 const int* __restrict__ slot_pos,
                                                 __half* __restrict__ mask_full,
                                                 __half* __restrict__ mask_swa, int rule, int window)
{
    const int c = blockIdx.x * PLAN_ROW_THREADS + threadIdx.x;
    if (c >= KV_TOTAL) return;
    const int p = (c < CAP) ? slot_pos[c] : 0;
    plan_mask_column(desc, c, p, CAP, Q_LEN, KV_TOTAL, FULL, SWA, rule, window, mask_full, mask_swa);
}

extern "C" __global__ void __launch_bounds__(PLAN_ROW_THREADS)
build_masks(const int* __restrict__ desc, const int* __restrict__ slot_pos,
            __half* __restrict__ mask_full, __half* __restrict__ mask_swa, int rule, int window)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    build_masks_impl<true, true>(desc, slot_pos, mask_full, mask_swa, rule, window);
}

extern "C" __global__ void __launch_bounds__(PLAN_ROW_THREADS)
build_mask_full(const int* __restrict__ desc, const int* __restrict__ slot_pos,
                __half* __restrict__ mask_full, int rule, int window)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    build_masks_impl<true, false>(desc, slot_pos, mask_full, mask_full, rule, window);
}

extern "C" __global__ void __launch_bounds__(PLAN_ROW_THREADS)
build_mask_swa(const int* __restrict__ desc, const int* __restrict__ slot_pos,
               __half* __restrict__ mask_swa, int rule, int window)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    build_masks_impl<false, true>(desc, slot_pos, mask_swa, mask_swa, rule, window);
}

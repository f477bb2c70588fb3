// plan.cu — device-side planning of one drafter step (SPEC §3 steps 2-5), so
// the host does O(1) work per step: it fills a small step descriptor in
// pinned memory, one captured copy brings it to the device, and these
// kernels derive append rows, positions, the feature gather and the masks.
//
// The step descriptor's layout and these kernels' block sizes are defined
// once, in step_desc.cuh. The feature gather is step_plan.cu.
//
// Kernels (compile-time CAP = ring slots, Q_LEN = noise rows, KV_TOTAL =
// cache rows; TRASH_SLOT = CAP + Q_LEN):
//   reset_slots     (slot_pos)            slot_pos[s] = -1 for s < CAP
//   reset_slots_if  (desc, slot_pos)      same, only when desc[DESC_RESET]
//       grid (ceil(CAP/PLAN_SLOT_THREADS)), block (PLAN_SLOT_THREADS)
//   plan_append     (desc, ap_pos, ap_rows, slot_pos, pos_q, a_rows, n_q)
//       for i < a_rows: i < n_new -> ap_pos[i] = start+i,
//       ap_rows[i] = (start+i) % CAP, slot_pos[ap_rows[i]] = start+i;
//       else ap_pos[i] = 0, ap_rows[i] = TRASH_SLOT.
//       for j < n_q: pos_q[j] = committed + j (n_q = 0 for bulk chunks).
//       grid (ceil(max(a_rows, n_q)/PLAN_ROW_THREADS)), block (PLAN_ROW_THREADS). The real rows of one
//       launch hit distinct slots (n_new <= min(committed, CAP)), so the
//       slot_pos writes never race.
//   build_masks / build_mask_full / build_mask_swa (desc, slot_pos, masks)
//       mask_full, mask_swa [Q_LEN, KV_TOTAL] f16, 0 visible / -inf hidden:
//       c < CAP:  full visible iff lo <= slot_pos[c] < committed,
//                 swa visible iff swa_lo <= slot_pos[c] < committed;
//       CAP <= c < CAP+Q_LEN (noise j = c-CAP): full always visible,
//                 swa visible to noise row q iff j <= q (causal);
//       trash and padding: hidden.
//       grid (ceil(KV_TOTAL/PLAN_ROW_THREADS)), block (PLAN_ROW_THREADS): one thread per column writes
//       that column of every row (coalesced across the warp). It must run
//       after plan_append in stream order: it reads the updated slot_pos.
//   The step graph runs none of these but reset_slots (bulk path) and plan_append
//   (bulk chunks): its planning is step_plan.cu's plan_step, one launch.
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

#define TRASH_SLOT (CAP + Q_LEN)

#if TRASH_SLOT >= KV_TOTAL
#error "plan.cu: KV_TOTAL must exceed CAP + Q_LEN (the trash slot)"
#endif

extern "C" __global__ void __launch_bounds__(PLAN_SLOT_THREADS)
reset_slots(int* __restrict__ slot_pos)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    const int s = blockIdx.x * PLAN_SLOT_THREADS + threadIdx.x;
    if (s < CAP) slot_pos[s] = -1;
}

extern "C" __global__ void __launch_bounds__(PLAN_SLOT_THREADS)
reset_slots_if(const int* __restrict__ desc, int* __restrict__ slot_pos)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    const int s = blockIdx.x * PLAN_SLOT_THREADS + threadIdx.x;
    if (s < CAP && desc[DESC_RESET] != 0) slot_pos[s] = -1;
}

extern "C" __global__ void __launch_bounds__(PLAN_ROW_THREADS)
plan_append(const int* __restrict__ desc,
            int* __restrict__ ap_pos,
            int* __restrict__ ap_rows,
            int* __restrict__ slot_pos,
            int* __restrict__ pos_q,
            int a_rows, int n_q)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    const int i = blockIdx.x * PLAN_ROW_THREADS + threadIdx.x;
    if (i < a_rows) {
        const int start = desc[DESC_START];
        const int n_new = desc[DESC_N_NEW];
        if (i < n_new) {
            const int p = start + i;
            const int row = p % CAP;
            ap_pos[i] = p;
            ap_rows[i] = row;
            slot_pos[row] = p;
        } else {
            ap_pos[i] = 0;
            ap_rows[i] = TRASH_SLOT;
        }
    }
    if (i < n_q) pos_q[i] = desc[DESC_COMMITTED] + i;
}

// Visibility of one column for both mask kinds (plan_mask.cuh); the sizes are
// compile-time constants here, so the shared function folds them.
template <bool FULL, bool SWA>
__device__ __forceinline__ void build_masks_impl(const int* __restrict__ desc,
                                                 const int* __restrict__ slot_pos,
                                                 __half* __restrict__ mask_full,
                                                 __half* __restrict__ mask_swa)
{
    const int c = blockIdx.x * PLAN_ROW_THREADS + threadIdx.x;
    if (c >= KV_TOTAL) return;
    const int p = (c < CAP) ? slot_pos[c] : 0;
    plan_mask_column(desc, c, p, CAP, Q_LEN, KV_TOTAL, FULL, SWA, mask_full, mask_swa);
}

extern "C" __global__ void __launch_bounds__(PLAN_ROW_THREADS)
build_masks(const int* __restrict__ desc, const int* __restrict__ slot_pos,
            __half* __restrict__ mask_full, __half* __restrict__ mask_swa)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    build_masks_impl<true, true>(desc, slot_pos, mask_full, mask_swa);
}

extern "C" __global__ void __launch_bounds__(PLAN_ROW_THREADS)
build_mask_full(const int* __restrict__ desc, const int* __restrict__ slot_pos,
                __half* __restrict__ mask_full)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    build_masks_impl<true, false>(desc, slot_pos, mask_full, mask_full);
}

extern "C" __global__ void __launch_bounds__(PLAN_ROW_THREADS)
build_mask_swa(const int* __restrict__ desc, const int* __restrict__ slot_pos,
               __half* __restrict__ mask_swa)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    build_masks_impl<false, true>(desc, slot_pos, mask_swa, mask_swa);
}

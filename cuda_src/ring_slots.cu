// ring_slots.cu — the ring's slot table and append rows outside the step graph
// (SPEC §3 steps 2-4): the bulk path of ops/ring_slots.py (a rewind or a jump
// past a_step appends in chunks before the graph runs). The step graph's own
// planning is step_plan.cu's plan_lanes, one launch.
//
// Compile-time: CAP = ring slots, Q_LEN = noise rows, KV_TOTAL = cache rows
// (> CAP + Q_LEN); TRASH_SLOT = CAP + Q_LEN; PAGE = rows per K/V page. desc: the step
// descriptor (step_desc.cuh, its one definition). pages: the lane's page table
// [ceil(KV_TOTAL / PAGE)] int32 (step_desc.cuh's page_row): ap_rows are physical rows.
//
// reset_slots (slot_pos): slot_pos[s] = -1 for s < CAP.
//   grid (ceil(CAP / PLAN_SLOT_THREADS)), block (PLAN_SLOT_THREADS).
// plan_append (desc, pages, ap_pos, ap_rows, slot_pos, pos_q, a_rows, n_q):
//   for i < a_rows: i < n_new -> ap_pos[i] = start + i, s = (start + i) % CAP,
//     ap_rows[i] = page_row(pages, PAGE, s), slot_pos[s] = start + i;
//     else ap_pos[i] = 0, ap_rows[i] = page_row(pages, PAGE, TRASH_SLOT).
//   for j < n_q: pos_q[j] = committed + j (n_q = 0 for bulk chunks).
//   grid (ceil(max(a_rows, n_q) / PLAN_ROW_THREADS)), block (PLAN_ROW_THREADS).
//   The real rows of one launch hit distinct slots (n_new <= min(committed,
//   CAP)), so the slot_pos writes never race.
// nvrtc-check: -DCAP=3 -DQ_LEN=16 -DKV_TOTAL=32
// nvrtc-check: -DCAP=100 -DQ_LEN=16 -DKV_TOTAL=128 -DPAGE=64
#include <cuda_fp16.h>
#include "step_desc.cuh"
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

#ifndef PAGE
#define PAGE 32
#endif

#define TRASH_SLOT (CAP + Q_LEN)

#if TRASH_SLOT >= KV_TOTAL
#error "ring_slots.cu: KV_TOTAL must exceed CAP + Q_LEN (the trash slot)"
#endif

extern "C" __global__ void __launch_bounds__(PLAN_SLOT_THREADS)
reset_slots(int* __restrict__ slot_pos)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    const int s = blockIdx.x * PLAN_SLOT_THREADS + threadIdx.x;
    if (s < CAP) slot_pos[s] = -1;
}

extern "C" __global__ void __launch_bounds__(PLAN_ROW_THREADS)
plan_append(const int* __restrict__ desc,
            const int* __restrict__ pages,
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
            const int slot = p % CAP;
            ap_pos[i] = p;
            ap_rows[i] = page_row(pages, PAGE, slot);
            slot_pos[slot] = p;
        } else {
            ap_pos[i] = 0;
            ap_rows[i] = page_row(pages, PAGE, TRASH_SLOT);
        }
    }
    if (i < n_q) pos_q[i] = desc[DESC_COMMITTED] + i;
}

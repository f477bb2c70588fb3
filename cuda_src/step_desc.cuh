// step_desc.cuh — the step descriptor: int32 [DESC_LEN] the host fills in
// pinned memory each step and one captured copy brings to the device
// (dflash_cupy/ops/step_descriptor.py reads these definitions: this file is
// their only source).
//   [DESC_COMMITTED]  committed tokens (noise positions committed + j)
//   [DESC_LO]         committed - min(committed, capacity): window start
//   [DESC_START]      first position the step (or bulk chunk) appends
//   [DESC_N_NEW]      rows to append; the rest of the launch's rows are padding
//   [DESC_SWA_LO]     committed - eff (the anchored mask rule's sliding-window start)
//   [DESC_RESET]      1: reset_slots_if empties the ring first (rewind)
//   [DESC_ACTIVE]     1: the lane runs this step; 0: an idle lane
//                     (its planning, GEMM tiles and attention blocks are skipped)
//   [DESC_CTX_ROW0]   the lane's first step row of its appended context rows; the
//                     active lanes' rows are packed back to back in lane order
//                     (so a lane appending 6 rows costs 6 GEMM rows, not a 16-row tile)
//   [DESC_CTX_ROWS]   the packed context rows of all lanes this step (the same in
//                     every lane's descriptor, idle lanes' too)
//   the rest          reserved, 0
#pragma once

#define DESC_COMMITTED 0
#define DESC_LO 1
#define DESC_START 2
#define DESC_N_NEW 3
#define DESC_SWA_LO 4
#define DESC_RESET 5
#define DESC_ACTIVE 6
#define DESC_CTX_ROW0 7
#define DESC_CTX_ROWS 8
#define DESC_LEN 10

// Block sizes of the planning kernels (ring_slots.cu, step_plan.cu): one thread per ring slot,
// per appended row, or per cache column.
#define PLAN_SLOT_THREADS 256
#define PLAN_ROW_THREADS 128

// K/V pages (dflash_cupy/kv_pages.py): a lane's logical cache row r (geometry.py's layout) lives
// at physical row pages[r / page] + r % page of its layer's pool; pages: the lane's page table,
// int32 [ceil(kv_total / page)], each entry the first physical row of that page (a dense
// layout is the table of consecutive row starts).
__device__ __forceinline__ int page_row(const int* __restrict__ pages, int page, int r) {
    return pages[r / page] + r % page;
}

// The descriptor copied into registers, its loads issued together: one L2 round trip where
// reading each field at its use made a chain of them (profiling/sass.py). Callers index d with
// constants only, so it stays in registers; the empty asm keeps the compiler from sinking each
// load back to its use (5 round trips in the planning kernel where there were 8).
__device__ __forceinline__ void load_desc(const int* __restrict__ g, int d[DESC_LEN]) {
#pragma unroll
    for (int i = 0; i < DESC_LEN; i++) d[i] = g[i];
#ifdef __CUDA_ARCH__
#pragma unroll
    for (int i = 0; i < DESC_LEN; i++) asm volatile("" ::"r"(d[i]));
#endif
}

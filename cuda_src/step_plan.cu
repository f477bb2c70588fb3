// step_plan.cu — the step's planning kernels: plan_lanes (the step graph's whole device-side
// planning, every lane of the step engine in one launch; a DraftKvCache is one lane) and
// gather_features (a bulk chunk's new feature rows). Both gather the new feature rows from
// the ring, widened to f32 (SPEC §3: fc's input).
//
//   gather_features (desc, ring, ap_feat, a_rows)
//       ap_feat[i, :] = f32(ring[(start+i) % RING_CAP, :]) for i < n_new,
//       0 for n_new <= i < a_rows (padding rows must stay finite).
//       ring [RING_CAP, FC_IN] RING_DTYPE (0 f32, 1 f16, 2 bf16 as unsigned
//       short bit patterns); ap_feat [>= a_rows, FC_IN] f32; desc: the step
//       descriptor (step_desc.cuh).
//       grid (ceil(FC_IN / (GATHER_THREADS*4)), a_rows), block (GATHER_THREADS)
//
//   plan_lanes (desc, ring, ap_feat, a_rows, cs, slot_pos, pos_all, rows_all, tile_live,
//               mask_full, mask_swa, cap, q_len, bs, kv_total, masks, window, lanes,
//               pages, page, n_pages)
//       In one launch, per lane l = blockIdx.y: the reset flag (slot_pos[:] = -1), the
//       append plan (ring_slots.cu's plan_append), the gather above and the masks from the
//       updated slot table (tests/cuda/planning_unfused.cu holds these as separate
//       launches: the reference). masks: bit 0 writes mask_full, bit 1 mask_swa, the rest
//       is the mask rule (plan_mask.cuh's PLAN_MASK_* bits); window: the sliding window W.
//       Per-lane arrays carry a lane axis: desc [lanes, DESC_LEN], ring [lanes,
//       RING_CAP, FC_IN], slot_pos [lanes, cap], masks [lanes, q_len, kv_total].
//       Step rows (pos_all, rows_all [lanes*(cs + bs)], ap_feat [lanes*cs, FC_IN]):
//       ctx rows [0, lanes*cs): the active lanes' appended rows packed back to back
//       (lane l's min(n_new, a_rows) at desc[DESC_CTX_ROW0], T = desc[DESC_CTX_ROWS] in
//       all), then padding rows; then lane l's noise rows at lanes*cs + l*bs. rows_all
//       holds physical cache rows: lane l's logical row r at page_row(pages + l*n_pages,
//       page, r) (step_desc.cuh; pages [lanes, n_pages] int32), rewritten every step for
//       the noise rows too (a lane's pages change between steps). tile_live
//       [lanes*(cs + bs)/16]: 2 for a live context tile, 1 for a live noise tile, 0 else
//       (cs, bs multiples of 16). An idle lane (desc[DESC_ACTIVE] == 0) gathers nothing,
//       clears its noise tiles and leaves its slot table and masks as they are.
//       grid (GX * a_rows + ceil(max(kv_total, cs, bs) / GATHER_THREADS), lanes),
//       block (GATHER_THREADS), GX = ceil(FC_IN / (GATHER_THREADS*4)): blocks
//       [0, GX * a_rows) gather (row b / GX, column chunk b % GX); in the rest thread c
//       owns slot / column c (plan_slot_column), append row c and noise row c.
// nvrtc-check: -DRING_DTYPE=1 -DFC_IN=19
// nvrtc-check: -DRING_DTYPE=2 -DFC_IN=20480
#include <cuda_fp16.h>
#include "step_desc.cuh"
#include "plan_mask.cuh"
#include "pdl.cuh"

#ifndef FC_IN
#define FC_IN 4096
#endif
#ifndef RING_CAP
#define RING_CAP 4096
#endif
#ifndef RING_DTYPE
#define RING_DTYPE 0
#endif
#ifndef GATHER_THREADS
#define GATHER_THREADS 256
#endif

#if RING_DTYPE < 0 || RING_DTYPE > 2
#error "step_plan.cu: RING_DTYPE must be 0 (f32), 1 (f16) or 2 (bf16)"
#endif

#if RING_DTYPE == 0
typedef float ring_t;
__device__ __forceinline__ float ring_to_f32(float x) { return x; }
#elif RING_DTYPE == 1
typedef __half ring_t;
__device__ __forceinline__ float ring_to_f32(__half x) { return __half2float(x); }
#else
typedef unsigned short ring_t;
// bf16 -> f32 is exact: the bf16 bits are the top half of the f32
__device__ __forceinline__ float ring_to_f32(unsigned short x) {
    return __uint_as_float(((unsigned int)x) << 16);
}
#endif

#define GATHER_GX ((FC_IN + GATHER_THREADS * 4 - 1) / (GATHER_THREADS * 4))

// Row i of ap_feat, the block's chunk of GATHER_THREADS*4 columns starting at cb.
__device__ __forceinline__ void gather_chunk(const int* __restrict__ desc, const ring_t* __restrict__ ring,
                                             float* __restrict__ ap_feat, int i, int cb)
{
    const int n_new = desc[DESC_N_NEW];
    float* dst = ap_feat + (long long)i * FC_IN;
    const int c0 = cb + threadIdx.x;
    if (i >= n_new) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int c = c0 + e * GATHER_THREADS;
            if (c < FC_IN) dst[c] = 0.f;
        }
        return;
    }
    // (start + i) >= 0 always; the modulo in 64 bits keeps start + i from
    // overflowing near INT_MAX
    const long long slot = ((long long)desc[DESC_START] + i) % RING_CAP;
    const ring_t* src = ring + slot * FC_IN;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int c = c0 + e * GATHER_THREADS;
        if (c < FC_IN) dst[c] = ring_to_f32(src[c]);
    }
}

// Slot c after this launch's append and column c of the masks from it:
//   p = start + i  if i = (c - start) mod cap < min(n_new, a_rows)  (appended now)
//       -1         else if desc[DESC_RESET]
//       slot_pos[c] otherwise   (written only when it changes).
// No ordering between blocks is needed: slot c is read and written only by its own
// thread, which derives the post-append value itself instead of reading it back (the
// appended rows hit distinct slots because min(n_new, a_rows) <= cap, the host's
// invariant, as for plan_append).
__device__ __forceinline__ void plan_slot_column(const int* __restrict__ desc, int c, int n_app, int cap,
                                                 int q_len, int kv_total, int masks, int window,
                                                 int* __restrict__ slot_pos,
                                                 __half* __restrict__ mask_full, __half* __restrict__ mask_swa)
{
    int p = 0;
    if (c < cap) {
        const int start = desc[DESC_START];
        long long i = ((long long)c - start) % cap;
        if (i < 0) i += cap;
        const int old = slot_pos[c];
        p = (i < n_app) ? start + (int)i : (desc[DESC_RESET] != 0 ? -1 : old);
        if (p != old) slot_pos[c] = p;
    }
    plan_mask_column(desc, c, p, cap, q_len, kv_total, (masks & 1) != 0, (masks & 2) != 0, masks, window,
                     mask_full, mask_swa);
}

extern "C" __global__ void __launch_bounds__(GATHER_THREADS)
gather_features(const int* __restrict__ desc,
                 const ring_t* __restrict__ ring,
                 float* __restrict__ ap_feat,
                 int a_rows)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    const int i = blockIdx.y;
    if (i >= a_rows) return;
    gather_chunk(desc, ring, ap_feat, i, blockIdx.x * (GATHER_THREADS * 4));
}

extern "C" __global__ void __launch_bounds__(GATHER_THREADS)
plan_lanes(const int* __restrict__ desc_all,
           const ring_t* __restrict__ ring_all,
           float* __restrict__ ap_feat_all,
           int a_rows, int cs,
           int* __restrict__ slot_pos_all,
           int* __restrict__ pos_all,
           int* __restrict__ rows_all,
           int* __restrict__ tile_live,
           __half* __restrict__ mask_full_all,
           __half* __restrict__ mask_swa_all,
           int cap, int q_len, int bs, int kv_total, int masks, int window, int lanes,
           const int* __restrict__ pages_all, int page, int n_pages)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    const int lane = blockIdx.y;
    int desc[DESC_LEN];
    load_desc(desc_all + (long long)lane * DESC_LEN, desc);
    const bool active = desc[DESC_ACTIVE] != 0;
    const int n_new = active ? desc[DESC_N_NEW] : 0;
    const int n_app = n_new < a_rows ? n_new : a_rows;
    const int row0 = desc[DESC_CTX_ROW0];
    const int b = blockIdx.x;
    if (b < GATHER_GX * a_rows) {
        const int i = b / GATHER_GX;
        if (i < n_app)
            gather_chunk(desc, ring_all + (long long)lane * RING_CAP * FC_IN, ap_feat_all + (long long)row0 * FC_IN,
                         i, (b % GATHER_GX) * (GATHER_THREADS * 4));
        return;
    }
    const int c = (b - GATHER_GX * a_rows) * GATHER_THREADS + threadIdx.x;
    const int* pages = pages_all + (long long)lane * n_pages;
    if (c < n_app) {   // this lane's packed rows
        const int p = desc[DESC_START] + c;
        pos_all[row0 + c] = p;
        rows_all[row0 + c] = page_row(pages, page, p % cap);
    }
    // Padding rows [T, lanes*cs): position 0, cache row = the trash slot of lane r / cs.
    // Lane l rewrites the padding rows of [l*cs, (l+1)*cs) every step (a row live last step
    // may be padding now). ap_feat rows past T are not written: stale but finite, they only
    // reach padding rows, whose K/V go to a trash slot. A live context tile is 2: its rows
    // feed K and V only, and the qkv GEMM skips their Q columns (gemm_wgmma.cu GW_SKIP_COLS).
    if (c < cs) {      // padding duty for rows [lane*cs, (lane+1)*cs) past the packed ones
        const int r = lane * cs + c, total = desc[DESC_CTX_ROWS];
        if (r >= total) {
            pos_all[r] = 0;
            rows_all[r] = page_row(pages, page, cap + q_len);  // the lane's trash slot
        }
        if (c % 16 == 0) tile_live[r / 16] = (r < total) ? 2 : 0;
    }
    const int noise0 = lanes * cs + lane * bs;
    if (c < bs) {      // noise row c: the lane's noise scratch (padding: its trash slot)
        if (active && c < q_len) pos_all[noise0 + c] = desc[DESC_COMMITTED] + c;
        rows_all[noise0 + c] = page_row(pages, page, cap + (c < q_len ? c : q_len));
        if (c % 16 == 0) tile_live[(noise0 + c) / 16] = active;
    }
    if (!active || c >= kv_total) return;
    const long long mo = (long long)lane * q_len * kv_total;
    plan_slot_column(desc, c, n_app, cap, q_len, kv_total, masks, window, slot_pos_all + (long long)lane * cap,
                     mask_full_all + mo, mask_swa_all + mo);
}

// plan.cu — device-side planning of one drafter step (SPEC §3 steps 2-5), so
// the host does O(1) work per step: it fills a small step descriptor in
// pinned memory, one captured copy brings it to the device, and these
// kernels derive append rows, positions, the feature gather and the masks.
//
// Step descriptor: int32 [DESC_LEN] (mirrored in dflash_cupy/ops/plan.py)
//   [0] DESC_COMMITTED  committed tokens (noise positions committed + j)
//   [1] DESC_LO         committed - min(committed, capacity): window start
//   [2] DESC_START      first position the step (or bulk chunk) appends
//   [3] DESC_N_NEW      rows to append (0 .. a_rows); the rest are padding
//   [4] DESC_SWA_LO     committed - eff (sliding-window start)
//   [5] DESC_RESET      1: reset_slots_if empties the ring first (rewind)
//   [6], [7]            reserved, 0
//
// Kernels (compile-time CAP = ring slots, Q_LEN = noise rows, KV_TOTAL =
// cache rows; TRASH_SLOT = CAP + Q_LEN):
//   reset_slots     (slot_pos)            slot_pos[s] = -1 for s < CAP
//   reset_slots_if  (desc, slot_pos)      same, only when desc[DESC_RESET]
//       grid (ceil(CAP/256)), block (256)
//   plan_append     (desc, ap_pos, ap_rows, slot_pos, pos_q, a_rows, n_q)
//       for i < a_rows: i < n_new -> ap_pos[i] = start+i,
//       ap_rows[i] = (start+i) % CAP, slot_pos[ap_rows[i]] = start+i;
//       else ap_pos[i] = 0, ap_rows[i] = TRASH_SLOT.
//       for j < n_q: pos_q[j] = committed + j (n_q = 0 for bulk chunks).
//       grid (ceil(max(a_rows, n_q)/128)), block (128). The real rows of one
//       launch hit distinct slots (n_new <= min(committed, CAP)), so the
//       slot_pos writes never race.
//   gather_features (desc, ring, ap_feat, a_rows)
//       ap_feat[i, :] = f32(ring[(start+i) % RING_CAP, :]) for i < n_new,
//       0 for n_new <= i < a_rows (padding rows must stay finite).
//       ring [RING_CAP, FC_IN] RING_DTYPE (0 f32, 1 f16, 2 bf16 as unsigned
//       short bit patterns); ap_feat [>= a_rows, FC_IN] f32.
//       grid (ceil(FC_IN / (GATHER_THREADS*4)), a_rows), block (GATHER_THREADS)
//   build_masks / build_mask_full / build_mask_swa (desc, slot_pos, masks)
//       mask_full, mask_swa [Q_LEN, KV_TOTAL] f16, 0 visible / -inf hidden:
//       c < CAP:  full visible iff lo <= slot_pos[c] < committed,
//                 swa visible iff swa_lo <= slot_pos[c] < committed;
//       CAP <= c < CAP+Q_LEN (noise j = c-CAP): full always visible,
//                 swa visible to noise row q iff j <= q (causal);
//       trash and padding: hidden.
//       grid (ceil(KV_TOTAL/128)), block (128): one thread per column writes
//       that column of every row (coalesced across the warp). It must run
//       after plan_append in stream order: it reads the updated slot_pos.
// nvrtc-check: -DRING_DTYPE=1 -DFC_IN=19 -DCAP=3 -DQ_LEN=16 -DKV_TOTAL=32
// nvrtc-check: -DRING_DTYPE=2 -DFC_IN=20480
#include <cuda_fp16.h>

#ifndef CAP
#define CAP 1024
#endif
#ifndef Q_LEN
#define Q_LEN 16
#endif
#ifndef KV_TOTAL
#define KV_TOTAL 1056
#endif
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

#define TRASH_SLOT (CAP + Q_LEN)

#define DESC_COMMITTED 0
#define DESC_LO 1
#define DESC_START 2
#define DESC_N_NEW 3
#define DESC_SWA_LO 4
#define DESC_RESET 5

#if TRASH_SLOT >= KV_TOTAL
#error "plan.cu: KV_TOTAL must exceed CAP + Q_LEN (the trash slot)"
#endif
#if RING_DTYPE < 0 || RING_DTYPE > 2
#error "plan.cu: RING_DTYPE must be 0 (f32), 1 (f16) or 2 (bf16)"
#endif

#define F16_ZERO __ushort_as_half((unsigned short)0x0000)
#define F16_NEG_INF __ushort_as_half((unsigned short)0xfc00)

extern "C" __global__ void __launch_bounds__(256)
reset_slots(int* __restrict__ slot_pos)
{
    const int s = blockIdx.x * 256 + threadIdx.x;
    if (s < CAP) slot_pos[s] = -1;
}

extern "C" __global__ void __launch_bounds__(256)
reset_slots_if(const int* __restrict__ desc, int* __restrict__ slot_pos)
{
    const int s = blockIdx.x * 256 + threadIdx.x;
    if (s < CAP && desc[DESC_RESET] != 0) slot_pos[s] = -1;
}

extern "C" __global__ void __launch_bounds__(128)
plan_append(const int* __restrict__ desc,
            int* __restrict__ ap_pos,
            int* __restrict__ ap_rows,
            int* __restrict__ slot_pos,
            int* __restrict__ pos_q,
            int a_rows, int n_q)
{
    const int i = blockIdx.x * 128 + threadIdx.x;
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

extern "C" __global__ void __launch_bounds__(GATHER_THREADS)
gather_features(const int* __restrict__ desc,
                 const ring_t* __restrict__ ring,
                 float* __restrict__ ap_feat,
                 int a_rows)
{
    const int i = blockIdx.y;
    if (i >= a_rows) return;
    const int n_new = desc[DESC_N_NEW];
    float* dst = ap_feat + (long long)i * FC_IN;
    const int c0 = blockIdx.x * (GATHER_THREADS * 4) + threadIdx.x;
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

// Visibility of one column for both mask kinds; noise columns depend on the row.
template <bool FULL, bool SWA>
__device__ __forceinline__ void build_masks_impl(const int* __restrict__ desc,
                                                 const int* __restrict__ slot_pos,
                                                 __half* __restrict__ mask_full,
                                                 __half* __restrict__ mask_swa)
{
    const int c = blockIdx.x * 128 + threadIdx.x;
    if (c >= KV_TOTAL) return;
    const int committed = desc[DESC_COMMITTED];
    if (c < CAP) {
        const int p = slot_pos[c];
        const __half vf = (p >= desc[DESC_LO] && p < committed) ? F16_ZERO : F16_NEG_INF;
        const __half vs = (p >= desc[DESC_SWA_LO] && p < committed) ? F16_ZERO : F16_NEG_INF;
        for (int q = 0; q < Q_LEN; ++q) {
            if (FULL) mask_full[q * KV_TOTAL + c] = vf;
            if (SWA) mask_swa[q * KV_TOTAL + c] = vs;
        }
    } else if (c < CAP + Q_LEN) {
        const int j = c - CAP;
        for (int q = 0; q < Q_LEN; ++q) {
            if (FULL) mask_full[q * KV_TOTAL + c] = F16_ZERO;
            if (SWA) mask_swa[q * KV_TOTAL + c] = j <= q ? F16_ZERO : F16_NEG_INF;
        }
    } else {
        for (int q = 0; q < Q_LEN; ++q) {
            if (FULL) mask_full[q * KV_TOTAL + c] = F16_NEG_INF;
            if (SWA) mask_swa[q * KV_TOTAL + c] = F16_NEG_INF;
        }
    }
}

extern "C" __global__ void __launch_bounds__(128)
build_masks(const int* __restrict__ desc, const int* __restrict__ slot_pos,
            __half* __restrict__ mask_full, __half* __restrict__ mask_swa)
{
    build_masks_impl<true, true>(desc, slot_pos, mask_full, mask_swa);
}

extern "C" __global__ void __launch_bounds__(128)
build_mask_full(const int* __restrict__ desc, const int* __restrict__ slot_pos,
                __half* __restrict__ mask_full)
{
    build_masks_impl<true, false>(desc, slot_pos, mask_full, mask_full);
}

extern "C" __global__ void __launch_bounds__(128)
build_mask_swa(const int* __restrict__ desc, const int* __restrict__ slot_pos,
               __half* __restrict__ mask_swa)
{
    build_masks_impl<false, true>(desc, slot_pos, mask_swa, mask_swa);
}

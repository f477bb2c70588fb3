// gather.cu — the new feature rows of one step (or bulk chunk) from the
// feature ring, widened to f32 (SPEC §3: the fused context rows' input).
//
//   gather_features (desc, ring, ap_feat, a_rows)
//       ap_feat[i, :] = f32(ring[(start+i) % RING_CAP, :]) for i < n_new,
//       0 for n_new <= i < a_rows (padding rows must stay finite).
//       ring [RING_CAP, FC_IN] RING_DTYPE (0 f32, 1 f16, 2 bf16 as unsigned
//       short bit patterns); ap_feat [>= a_rows, FC_IN] f32; desc: the step
//       descriptor (step_desc.cuh).
//       grid (ceil(FC_IN / (GATHER_THREADS*4)), a_rows), block (GATHER_THREADS)
// nvrtc-check: -DRING_DTYPE=1 -DFC_IN=19
// nvrtc-check: -DRING_DTYPE=2 -DFC_IN=20480
#include <cuda_fp16.h>
#include "step_desc.cuh"

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
#error "gather.cu: RING_DTYPE must be 0 (f32), 1 (f16) or 2 (bf16)"
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

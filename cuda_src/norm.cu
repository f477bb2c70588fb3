// norm.cu — RMSNorm over rows of width NORM_D.
//
//   y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w[r % w_rows, :]
//
// Layouts (row-major, C-contiguous, f32): x [rows, NORM_D], y [rows, NORM_D] (y may be
// x itself: every element is read into registers before the reduction barrier and
// written by the thread that read it), w [w_rows, NORM_D].
// w_rows > 1 serves tensors whose rows cycle through several weight vectors: the aux
// hidden norms view x [M, n_cap*H] as [M*n_cap, H] rows with a weight table [n_cap, H].
// (Per-head q/k norms are fused into rope.cu.)
// NORM_Y16 1 / 2: y [rows, NORM_D] holds f16 / bf16 bits (dtypes.CODE), the f32 result
// rounded once to nearest even (a 16-bit GEMM input: the GEMM reads half the bytes per
// column group; y is then never x).
//
// tile_live [ceil(rows/16)] int32, read when use_live (a lane batch's flags, as its GEMMs
// read them): rows of a tile marked 0 are skipped (y untouched there).
//
// Launch: block = NORM_BLOCK threads; NORM_TPR threads (a multiple of 32 dividing
// NORM_BLOCK) share one row, so a block covers NORM_BLOCK / NORM_TPR rows;
// grid = ceil(rows / (NORM_BLOCK / NORM_TPR)). No dynamic shared memory.
// Each thread keeps its ceil(NORM_D / VEC / NORM_TPR) chunks of the row in registers,
// so x is read once. Sum of squares in f32: warp shuffles, then (NORM_TPR > 32) the
// row's warp partials through shared memory.
// Range: as in the f32 framework implementations no pre-scaling is done, so
// mean(x^2) overflows for |x| >~ 1e18, and under -ftz squares below 2^-126 (|x| <~ 1e-19)
// flush to zero and drop out of the sum.
//
// nvrtc-check: -DNORM_D=4096 -DNORM_TPR=256 -DNORM_BLOCK=256
// nvrtc-check: -DNORM_D=19 -DNORM_TPR=32 -DNORM_BLOCK=128
// nvrtc-check: -DNORM_D=5120 -DNORM_TPR=512 -DNORM_BLOCK=512
// nvrtc-check: -DNORM_D=4096 -DNORM_TPR=256 -DNORM_BLOCK=256 -DNORM_Y16=2
// nvrtc-check: -DNORM_D=19 -DNORM_TPR=32 -DNORM_BLOCK=128 -DNORM_Y16=1

#include "bits16.cuh"
#include "warp.cuh"
#include "pdl.cuh"

#ifndef NORM_D
#define NORM_D 128
#endif
#ifndef NORM_TPR
#define NORM_TPR 32
#endif
#ifndef NORM_BLOCK
#define NORM_BLOCK 128
#endif

#ifndef NORM_Y16
#define NORM_Y16 0
#endif
#if NORM_Y16 < 0 || NORM_Y16 > 2
#error "NORM_Y16 must be 0 (f32), 1 (f16) or 2 (bf16)"
#endif
#if NORM_Y16
typedef unsigned short norm_out_t;
#else
typedef float norm_out_t;
#endif

#if NORM_TPR % 32 != 0 || NORM_BLOCK % NORM_TPR != 0
#error "NORM_TPR must be a multiple of 32 that divides NORM_BLOCK"
#endif

namespace norm_detail {
constexpr int D = NORM_D;
constexpr int VEC = (D % 4 == 0) ? 4 : 1;
constexpr int CHUNKS = D / VEC;
constexpr int PER_THREAD = (CHUNKS + NORM_TPR - 1) / NORM_TPR;
constexpr int ROWS_PER_BLOCK = NORM_BLOCK / NORM_TPR;
constexpr int WARPS_PER_ROW = NORM_TPR / 32;
}  // namespace norm_detail

__device__ __forceinline__ void store4(float* p, float4 o) { *reinterpret_cast<float4*>(p) = o; }
__device__ __forceinline__ void store1(float* p, float o) { *p = o; }
// 16-bit y: 4 values as one 8-byte store (D % 4 == 0 and 16-byte aligned rows of x keep
// y's rows 8-byte aligned)
__device__ __forceinline__ void store4(unsigned short* p, float4 o) {
    *reinterpret_cast<uint2*>(p) = make_uint2(to_bits16<NORM_Y16>(o.x) | (to_bits16<NORM_Y16>(o.y) << 16),
                                              to_bits16<NORM_Y16>(o.z) | (to_bits16<NORM_Y16>(o.w) << 16));
}
__device__ __forceinline__ void store1(unsigned short* p, float o) { *p = (unsigned short)to_bits16<NORM_Y16>(o); }

extern "C" __global__ void __launch_bounds__(NORM_BLOCK)
rmsnorm(const float* x, const float* w, norm_out_t* y, int rows, int w_rows, float eps, const int* tile_live,
        int use_live)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    using namespace norm_detail;
    __shared__ float partial[NORM_BLOCK / 32];

    const int local_row = threadIdx.x / NORM_TPR;
    const int t = threadIdx.x - local_row * NORM_TPR;
    const int row = blockIdx.x * ROWS_PER_BLOCK + local_row;
    // Threads of a missing row still take part in the barrier below.
    const bool valid = row < rows && (!use_live || tile_live[row >> 4] != 0);
    const float* xr = x + (long long)row * D;

    float v[PER_THREAD][VEC];
    float4 gw[VEC == 4 ? PER_THREAD : 1];   // the norm weights, loaded with x (no dependence)
    const float* wr = w + (long long)(row % w_rows) * D;
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int c = t + i * NORM_TPR;
        if (VEC == 4) gw[i] = (valid && c < CHUNKS) ? *reinterpret_cast<const float4*>(wr + c * VEC)
                                                    : make_float4(0.f, 0.f, 0.f, 0.f);
        if (valid && c < CHUNKS) {
            if (VEC == 4) {
                const float4 q = *reinterpret_cast<const float4*>(xr + c * VEC);
                v[i][0] = q.x; v[i][VEC > 1 ? 1 : 0] = q.y;
                v[i][VEC > 2 ? 2 : 0] = q.z; v[i][VEC > 3 ? 3 : 0] = q.w;
            } else {
                v[i][0] = xr[c];
            }
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) v[i][e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) ss = fmaf(v[i][e], v[i][e], ss);
    }

    ss = warp_sum(ss);
    if (WARPS_PER_ROW > 1) {
        if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
        __syncthreads();
        ss = 0.f;
#pragma unroll
        for (int j = 0; j < WARPS_PER_ROW; ++j) ss += partial[local_row * WARPS_PER_ROW + j];
    }
    if (!valid) return;

    const float inv = rsqrtf(ss * (1.0f / D) + eps);
    norm_out_t* yr = y + (long long)row * D;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int c = t + i * NORM_TPR;
        if (c < CHUNKS) {
            if (VEC == 4) {
                const float4 g = gw[VEC == 4 ? i : 0];
                float4 o;
                o.x = v[i][0] * inv * g.x;
                o.y = v[i][VEC > 1 ? 1 : 0] * inv * g.y;
                o.z = v[i][VEC > 2 ? 2 : 0] * inv * g.z;
                o.w = v[i][VEC > 3 ? 3 : 0] * inv * g.w;
                store4(yr + c * VEC, o);
            } else {
                store1(yr + c, v[i][0] * inv * wr[c]);
            }
        }
    }
}

// conv.cu — DFlash 2's grouped dynamic causal depthwise convolution (SPEC §6), block-local:
//   y[r, c] = res[r, c] + sum_{t < CONV_TAPS, i - t >= 0} (base[t, c] + d[r, (half*CONV_TAPS + t)*G + c / CONV_GROUP])
//                                                         * x[r - t, c]
//   i = r % lane_rows: the row's index in its lane's block (rows [l*lane_rows, (l+1)*lane_rows)
//   are lane l's; a tap reaching before the block's first row reads zero, so no state crosses
//   lanes or steps). res = residual with add_residual, else 0. G = CONV_H / CONV_GROUP.
// Layouts (row-major, f32): x, y, residual [rows, CONV_H]; base [CONV_TAPS, CONV_H] (one
//   half of the checkpoint's base_kernel [2, taps, H]); d [rows, 2*CONV_TAPS*G] (the
//   kernel_projection GEMM's output, read at half 0 by "prepare", half 1 by "finish"), its
//   columns [half][tap][group] as published, or with CONV_GMAJOR 1 [group][half][tap] (the
//   projection's rows permuted at upload so a GEMM column block holds whole groups, both
//   halves: gemm_stream.cu's GS_CONV fuses "prepare" there; ops/conv.group_major_rows).
//   y may be residual itself (each element reads its own residual, then writes it), never x.
// Each product-sum is fmaf in tap order t = 0, 1, ... on w = base + d (ops/conv.py's reference
// rounds the same way). Rows of a tile whose tile_live entry is 0 (use_live) are skipped.
// Launch: grid (ceil(CONV_H / CONV_THREADS), rows), block (CONV_THREADS); thread: one channel.
//
// grouped_conv_norm (CONV_NORM_TPR threads per row; default: norm.cu's): the "finish"
// convolution (residual added) fused with the RMSNorm that reads its output: y as
// grouped_conv writes it, and yn[r, :] = y[r, :] * rsqrt(mean(y[r, :]^2) + eps) * w, computed as norm.cu's rmsnorm does
// with NORM_TPR = CONV_NORM_TPR (ops/norm.py's norm_threads): the same channels per thread, the
// same fmaf order, butterfly and warp partials, so yn is that kernel's output bit for bit (a
// launch and a pass fewer). Launch: grid (rows), block (CONV_NORM_TPR): one row per block.
// nvrtc-check: -DCONV_H=48 -DCONV_TAPS=2 -DCONV_GROUP=16
// nvrtc-check: -DCONV_H=6656 -DCONV_TAPS=4 -DCONV_GROUP=16
// nvrtc-check: -DCONV_H=5120 -DCONV_TAPS=2 -DCONV_GROUP=16 -DCONV_NORM_TPR=320
// nvrtc-check: -DCONV_H=6656 -DCONV_TAPS=2 -DCONV_GROUP=16 -DCONV_NORM_TPR=416
// nvrtc-check: -DCONV_H=50 -DCONV_TAPS=3 -DCONV_GROUP=5 -DCONV_NORM_TPR=32
// nvrtc-check: -DCONV_H=5120 -DCONV_TAPS=2 -DCONV_GROUP=16 -DCONV_NORM_TPR=320 -DCONV_GMAJOR=1
#include "pdl.cuh"
#include "warp.cuh"

#ifndef CONV_H
#define CONV_H 4096
#endif
#ifndef CONV_TAPS
#define CONV_TAPS 2
#endif
#ifndef CONV_GROUP
#define CONV_GROUP 16
#endif
#ifndef CONV_THREADS
#define CONV_THREADS 128
#endif
#if CONV_H % CONV_GROUP != 0
#error "conv.cu: CONV_GROUP must divide CONV_H"
#endif
#define CONV_G (CONV_H / CONV_GROUP)
#ifndef CONV_GMAJOR
#define CONV_GMAJOR 0
#endif
// d's column of (half h, tap t, group g): CONV_HOFF(h) + CONV_DOFF(t, g)
#if CONV_GMAJOR
#define CONV_HOFF(h) ((h) * CONV_TAPS)
#define CONV_DOFF(t, g) ((g) * 2 * CONV_TAPS + (t))
#else
#define CONV_HOFF(h) ((h) * CONV_TAPS * CONV_G)
#define CONV_DOFF(t, g) ((t) * CONV_G + (g))
#endif

extern "C" __global__ void __launch_bounds__(CONV_THREADS)
grouped_conv(const float* __restrict__ x, const float* __restrict__ base, const float* __restrict__ d,
             int half, const float* residual, int add_residual, float* y, int lane_rows,
             const int* __restrict__ tile_live, int use_live)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    const int c = blockIdx.x * CONV_THREADS + threadIdx.x;
    const int r = blockIdx.y;
    if (c >= CONV_H || (use_live && tile_live[r / 16] == 0)) return;
    const int i = r % lane_rows;
    const float* dr = d + (long long)r * (2 * CONV_TAPS * CONV_G) + CONV_HOFF(half);
    const int gc = c / CONV_GROUP;
    float acc = 0.0f;
#pragma unroll
    for (int t = 0; t < CONV_TAPS; ++t) {
        if (i - t < 0) break;
        const float w = base[t * CONV_H + c] + dr[CONV_DOFF(t, gc)];
        acc = fmaf(w, x[(long long)(r - t) * CONV_H + c], acc);
    }
    const long long o = (long long)r * CONV_H + c;
    y[o] = add_residual ? residual[o] + acc : acc;
}

#ifndef CONV_NORM_TPR   // default: ops/norm.py's norm_threads(CONV_H), about 4 chunks per thread
#define CONV_NORM_WANT ((((CONV_H % 4 == 0) ? CONV_H / 4 : CONV_H) + 3) / 4)
#define CONV_NORM_TPR (CONV_NORM_WANT <= 32 ? 32 : CONV_NORM_WANT >= 1024 ? 1024 : (CONV_NORM_WANT + 31) / 32 * 32)
#endif
#if CONV_NORM_TPR % 32 != 0
#error "conv.cu: CONV_NORM_TPR must be a multiple of 32"
#endif
namespace conv_norm {
constexpr int VEC = (CONV_H % 4 == 0) ? 4 : 1;   // norm.cu's chunks: VEC channels each
constexpr int CHUNKS = CONV_H / VEC;
constexpr int PER_THREAD = (CHUNKS + CONV_NORM_TPR - 1) / CONV_NORM_TPR;
constexpr int WARPS = CONV_NORM_TPR / 32;
}  // namespace conv_norm

// VEC consecutive floats: one 16-byte load for VEC 4 (CONV_H % 4 == 0 keeps rows aligned)
__device__ __forceinline__ void ld_vec(float* o, const float* p) {
    if (conv_norm::VEC == 4) {
        const float4 q = *reinterpret_cast<const float4*>(p);
        o[0] = q.x; o[conv_norm::VEC > 1 ? 1 : 0] = q.y;
        o[conv_norm::VEC > 2 ? 2 : 0] = q.z; o[conv_norm::VEC > 3 ? 3 : 0] = q.w;
    } else {
        o[0] = *p;
    }
}

__device__ __forceinline__ void st_vec(float* p, const float* o) {
    if (conv_norm::VEC == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(o[0], o[conv_norm::VEC > 1 ? 1 : 0],
                                                    o[conv_norm::VEC > 2 ? 2 : 0], o[conv_norm::VEC > 3 ? 3 : 0]);
    } else {
        *p = o[0];
    }
}

extern "C" __global__ void __launch_bounds__(CONV_NORM_TPR)
grouped_conv_norm(const float* __restrict__ x, const float* __restrict__ base, const float* __restrict__ d,
                  int half, const float* residual, float* y, int lane_rows, const float* __restrict__ w,
                  float eps, float* __restrict__ yn, const int* __restrict__ tile_live, int use_live)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    using namespace conv_norm;
    __shared__ float partial[WARPS];
    const int r = blockIdx.x;
    if (use_live && tile_live[r / 16] == 0) return;   // the whole block: before any barrier
    const int t = threadIdx.x;
    const int i = r % lane_rows;
    const float* dr = d + (long long)r * (2 * CONV_TAPS * CONV_G) + CONV_HOFF(half);
    const long long row = (long long)r * CONV_H;
    // Every load before the first store (y may be residual: no store may precede a load the
    // compiler cannot prove it does not alias), and no branch between them (a chunk past the
    // row and a tap before the block load in-bounds stand-ins; acc keeps its value by a
    // select), so a thread's loads can be in flight together. The sums are grouped_conv's:
    // w = base + d, then fmaf per tap in tap order. VEC 4: 16-byte loads and stores.
    float v[PER_THREAD][VEC], g[PER_THREAD][VEC];   // y, and the norm's weights
#pragma unroll
    for (int p = 0; p < PER_THREAD; ++p) {
        const int ch = t + p * CONV_NORM_TPR;
        const bool in = ch < CHUNKS;
        const int c0 = (in ? ch : CHUNKS - 1) * VEC;
        float xv[CONV_TAPS][VEC], bv[CONV_TAPS][VEC], dv[CONV_TAPS][VEC], rv[VEC], gv[VEC];
        ld_vec(rv, residual + row + c0);
        ld_vec(gv, w + c0);
#pragma unroll
        for (int k = 0; k < CONV_TAPS; ++k) {
            ld_vec(bv[k], base + k * CONV_H + c0);
            ld_vec(xv[k], x + row - (long long)(i - k >= 0 ? k : 0) * CONV_H + c0);
            if (CONV_GROUP % VEC == 0) {   // the chunk's channels share a group: one coefficient
                const float dk = dr[CONV_DOFF(k, c0 / CONV_GROUP)];
#pragma unroll
                for (int e = 0; e < VEC; ++e) dv[k][e] = dk;
            } else {
#pragma unroll
                for (int e = 0; e < VEC; ++e) dv[k][e] = dr[CONV_DOFF(k, (c0 + e) / CONV_GROUP)];
            }
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            float acc = 0.0f;
#pragma unroll
            for (int k = 0; k < CONV_TAPS; ++k)
                acc = i - k >= 0 ? fmaf(bv[k][e] + dv[k][e], xv[k][e], acc) : acc;
            v[p][e] = in ? rv[e] + acc : 0.0f;
            g[p][e] = in ? gv[e] : 0.0f;
        }
    }
    float ss = 0.f;
#pragma unroll
    for (int p = 0; p < PER_THREAD; ++p) {
        const int ch = t + p * CONV_NORM_TPR;
        if (ch < CHUNKS) st_vec(y + row + ch * VEC, v[p]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) ss = fmaf(v[p][e], v[p][e], ss);   // rmsnorm's order
    }
    ss = warp_sum(ss);
    if (WARPS > 1) {
        if ((t & 31) == 0) partial[t >> 5] = ss;
        __syncthreads();
        ss = 0.f;
#pragma unroll
        for (int j = 0; j < WARPS; ++j) ss += partial[j];
    }
    const float inv = rsqrtf(ss * (1.0f / CONV_H) + eps);
#pragma unroll
    for (int p = 0; p < PER_THREAD; ++p) {
        const int ch = t + p * CONV_NORM_TPR;
        if (ch < CHUNKS) {
            float o[VEC];
#pragma unroll
            for (int e = 0; e < VEC; ++e) o[e] = v[p][e] * inv * g[p][e];
            st_vec(yn + row + ch * VEC, o);
        }
    }
}

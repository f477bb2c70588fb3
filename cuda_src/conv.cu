// conv.cu — DFlash 2's grouped dynamic causal depthwise convolution (SPEC §6), block-local:
//   y[r, c] = res[r, c] + sum_{t < CONV_TAPS, i - t >= 0} (base[t, c] + d[r, (half*CONV_TAPS + t)*G + c / CONV_GROUP])
//                                                         * x[r - t, c]
//   i = r % lane_rows: the row's index in its lane's block (rows [l*lane_rows, (l+1)*lane_rows)
//   are lane l's; a tap reaching before the block's first row reads zero, so no state crosses
//   lanes or steps). res = residual with add_residual, else 0. G = CONV_H / CONV_GROUP.
// Layouts (row-major, f32): x, y, residual [rows, CONV_H]; base [CONV_TAPS, CONV_H] (one
//   half of the checkpoint's base_kernel [2, taps, H]); d [rows, 2*CONV_TAPS*G] (the
//   kernel_projection GEMM's output, read at half 0 by "prepare", half 1 by "finish").
//   y may be residual itself (each element reads its own residual, then writes it), never x.
// Each product-sum is fmaf in tap order t = 0, 1, ... on w = base + d (ops/conv.py's reference
// rounds the same way). Rows of a tile whose tile_live entry is 0 (use_live) are skipped.
// Launch: grid (ceil(CONV_H / CONV_THREADS), rows), block (CONV_THREADS); thread: one channel.
// nvrtc-check: -DCONV_H=48 -DCONV_TAPS=2 -DCONV_GROUP=16
// nvrtc-check: -DCONV_H=6656 -DCONV_TAPS=4 -DCONV_GROUP=16
#include "pdl.cuh"

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
    const float* dr = d + (long long)r * (2 * CONV_TAPS * CONV_G) + half * CONV_TAPS * CONV_G + c / CONV_GROUP;
    float acc = 0.0f;
#pragma unroll
    for (int t = 0; t < CONV_TAPS; ++t) {
        if (i - t < 0) break;
        const float w = base[t * CONV_H + c] + dr[t * CONV_G];
        acc = fmaf(w, x[(long long)(r - t) * CONV_H + c], acc);
    }
    const long long o = (long long)r * CONV_H + c;
    y[o] = add_residual ? residual[o] + acc : acc;
}

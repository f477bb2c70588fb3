// rope_math.cuh — the per-head math of the q/k RMSNorm + NEOX RoPE (SPEC §2 steps 2-4), one
// definition for its two users: rope.cu's qkv_norm_rope and gemm_wgmma.cu's qkv epilogue
// (GW_EPI 3). Both must produce the same bits, so every float operation and its order lives
// here once (an expression written twice may be contracted into fmas differently).
//
// One warp per head of HD values: lane owns the pairs (i, i + HD/2), i = lane + 32 j, so the
// rotation needs no cross-lane traffic and the norm one warp sum.
#pragma once
#include <cuda_fp16.h>
#include "warp.cuh"

// 2*pi split in two doubles (Cody-Waite): k*ROPE_TWO_PI_HI is exact under fma, so the
// reduction error stays ~1 ulp of the reduced angle even for k ~ 1e8.
#define ROPE_TWO_PI_HI 6.283185307179586
#define ROPE_TWO_PI_LO 2.4492935982947064e-16
#define ROPE_INV_TWO_PI 0.15915494309189535
#define ROPE_INV_PI 0.3183098861837907

// (cos, sin) of position p times frequency f, times scale (YaRN's mscale; 1 otherwise). The
// angle is formed in double and reduced modulo 2*pi before sincospif (of the reduced angle /
// pi: no slow path for huge arguments, which sincosf carries and which serialises the wgmmas
// of gemm_wgmma.cu's qkv epilogue), so positions >= 2^20 lose nothing against a rebased window
// (an f32 product p*f would have an absolute error of ~p * 2^-24 radians).
__device__ __forceinline__ void rope_cos_sin(int p, double f, float scale, float& c, float& s) {
    const double a = (double)p * f;
    const double k = rint(a * ROPE_INV_TWO_PI);
    double r = fma(-k, ROPE_TWO_PI_HI, a);
    r = fma(-k, ROPE_TWO_PI_LO, r);
    float sn, cs;
    sincospif((float)(r * ROPE_INV_PI), &sn, &cs);
    c = cs * scale;
    s = sn * scale;
}

__device__ __forceinline__ void rope_put(float* p, float v) { *p = v; }
__device__ __forceinline__ void rope_put(__half* p, float v) { *p = __float2half_rn(v); }

template <int HD>
struct RopeHead {
    static constexpr int HALF = HD / 2;
    static constexpr int PAIRS = (HALF + 31) / 32;  // pairs per lane

    // The lane's pairs of head x into lo/hi; returns the lane's part of sum(x^2).
    static __device__ __forceinline__ float partial(const float* x, float* lo, float* hi, int lane) {
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < PAIRS; ++j) {
            const int i = lane + 32 * j;
            lo[j] = 0.f;
            hi[j] = 0.f;
            if (i < HALF) {
                lo[j] = x[i];
                hi[j] = x[i + HALF];
            }
            ss += lo[j] * lo[j] + hi[j] * hi[j];
        }
        return ss;
    }

    // 1 / sqrt(mean(x^2) + eps) from the warp's sum of the partials.
    static __device__ __forceinline__ float finish(float ss, float eps) { return rsqrtf(ss / (float)HD + eps); }

    // partial + warp sum + finish: the head's norm factor. Warp-uniform: all 32 lanes call it.
    // (Several heads at once, for latency: partial each, warp_sum_n, finish each: the same bits.)
    static __device__ __forceinline__ float load(const float* x, float* lo, float* hi, int lane, float eps) {
        return finish(warp_sum(partial(x, lo, hi, lane)), eps);
    }

    // The lane's norm weights of its pairs: wlo[j] = w[i], whi[j] = w[i + HALF] (0 past HALF).
    static __device__ __forceinline__ void weights(const float* w, float* wlo, float* whi, int lane) {
#pragma unroll
        for (int j = 0; j < PAIRS; ++j) {
            const int i = lane + 32 * j;
            wlo[j] = 0.f;
            whi[j] = 0.f;
            if (i < HALF) {
                wlo[j] = w[i];
                whi[j] = w[i + HALF];
            }
        }
    }

    // Pair i (the lane's j-th): (a, b) = (lo, hi) * rn * (wl, wh), rotated by (c, s) and stored:
    // q rows as f32, K rows as f16 (the cache type).
    template <typename T>
    static __device__ __forceinline__ void put_pair(T* dst, int i, float lo, float hi, float rn, float wl, float wh,
                                                    float c, float s) {
        const float a = lo * rn * wl;
        const float b = hi * rn * wh;
        rope_put(dst + i, a * c - b * s);
        rope_put(dst + i + HALF, b * c + a * s);
    }

    // The head's pairs stored, the norm weights read from w here ...
    template <typename T>
    static __device__ __forceinline__ void store(T* dst, const float* lo, const float* hi, float rn, const float* w,
                                                 const float* c, const float* s, int lane) {
#pragma unroll
        for (int j = 0; j < PAIRS; ++j) {
            const int i = lane + 32 * j;
            if (i < HALF) put_pair(dst, i, lo[j], hi[j], rn, w[i], w[i + HALF], c[j], s[j]);
        }
    }

    // ... or taken from weights() (read once for many heads).
    template <typename T>
    static __device__ __forceinline__ void store_w(T* dst, const float* lo, const float* hi, float rn, const float* wlo,
                                                   const float* whi, const float* c, const float* s, int lane) {
#pragma unroll
        for (int j = 0; j < PAIRS; ++j) {
            const int i = lane + 32 * j;
            if (i < HALF) put_pair(dst, i, lo[j], hi[j], rn, wlo[j], whi[j], c[j], s[j]);
        }
    }
};

// cuda_emu.h — run CUDA C kernels on the CPU (g++), the one place where the
// CPU and the GPU differ. Kernel files in cuda_src/ include <cuda_fp16.h> /
// <cuda_bf16.h> / <math_constants.h>; under g++ those resolve to
// dflash_cupy/emu/cuda/include/*.h, which include this file.
//
// Model:
// - A launch runs the blocks of its grid one after another (or spread over a
//   few OS threads, each with its own blocks); the threads of a block are
//   user-space fibers on one OS thread. A fiber runs until it reaches a
//   barrier or a warp collective, then the scheduler picks the next runnable
//   fiber, in forward, reverse or seeded-shuffled order, so a missing
//   __syncthreads shows up as a wrong result rather than hiding behind a
//   friendly order.
// - `__shared__` is `thread_local`: one copy per OS thread, i.e. per block in
//   flight. `extern __shared__` buffers are defined by the launcher generator
//   and poisoned with 0xFF (NaN for f32/f16) before each block.
// - f32 arithmetic runs with FTZ/DAZ set in MXCSR, as CuPy compiles with
//   -ftz=true. Conversions to/from f16/bf16 are bit-exact round-to-nearest-even.
// - Deadlocks (a barrier or a collective not reached by every live thread)
//   and faults (guard pages around every emulated device array, integer
//   division by zero) end the launch with an error message, not a crash.
// - After this header, names that NVRTC lacks (std, <cstdint> types,
//   INFINITY, NAN) are poisoned so g++ rejects what NVRTC would reject.
#pragma once
#ifndef DFLASH_CUDA_EMU_H
#define DFLASH_CUDA_EMU_H

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>
#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

// ---------------------------------------------------------------- keywords
#define __global__
#define __device__
#define __host__
#define __constant__
#define __shared__ thread_local
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __grid_constant__

// ---------------------------------------------------------------- vector types
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 { unsigned int x, y, z; };
#ifndef EMU_COUNTERS
#define EMU_COUNTERS 0  // 1: the counting variant (emu_build.build(..., counters=True))
#endif
namespace emu {
// Defined with the scheduler below: reports a vector load/store whose address
// is not a multiple of the vector's size (the GPU faults on those).
static inline void misaligned(const void* p, unsigned align, const char* type, bool store);
// Counter mode (see "counters" below): the counting state of the launch this OS
// thread runs, null when counting is off. The hooks exist only in modules built
// with -DEMU_COUNTERS=1 (build.py's counting variant): ordinary builds pay nothing.
static thread_local void* tl_cnt;
static int g_counting;  // counted launches running in this module: tested before tl_cnt
// One vector access of `n` bytes as the GPU issues it (a single instruction),
// however g++ splits the copy: counted as one, its pieces are not.
__attribute__((noinline)) static void count_vector(const void* p, unsigned n, bool store);
}
// Vector types that are loaded or stored as one piece on the GPU check the
// alignment of the address they are copied from or to: a misaligned float4 /
// uint2 / half2 access is an error there, however g++ splits the copy.
// (Copy constructors check before they copy, so counter mode sees the vector
// access before its pieces.)
#define EMU_VCHECK(EmuN, EmuA, p, st) \
    do { if ((unsigned long long)(p) & ((EmuA) - 1)) ::emu::misaligned((p), (EmuA), #EmuN, (st)); \
         if (EMU_COUNTERS && ::emu::g_counting && ::emu::tl_cnt) ::emu::count_vector((p), sizeof(EmuN), (st)); \
    } while (0)
#define EMU_VEC2(EmuT, EmuN, EmuA) struct __attribute__((aligned(EmuA))) EmuN { EmuT x, y; \
        EmuN() = default; \
        constexpr EmuN(EmuT x_, EmuT y_) : x(x_), y(y_) {} \
        EmuN(const EmuN& o) { EMU_VCHECK(EmuN, EmuA, &o, false); x = o.x; y = o.y; } \
        EmuN& operator=(const EmuN& o) { EMU_VCHECK(EmuN, EmuA, &o, false); EMU_VCHECK(EmuN, EmuA, this, true); \
            x = o.x; y = o.y; return *this; } }; \
    static inline EmuN make_##EmuN(EmuT x, EmuT y) { return EmuN(x, y); }
#define EMU_VEC3(EmuT, EmuN) struct EmuN { EmuT x, y, z; }; \
    static inline EmuN make_##EmuN(EmuT x, EmuT y, EmuT z) { EmuN r; r.x = x; r.y = y; r.z = z; return r; }
#define EMU_VEC4(EmuT, EmuN, EmuA) struct __attribute__((aligned(EmuA))) EmuN { EmuT x, y, z, w; \
        EmuN() = default; \
        constexpr EmuN(EmuT x_, EmuT y_, EmuT z_, EmuT w_) : x(x_), y(y_), z(z_), w(w_) {} \
        EmuN(const EmuN& o) { EMU_VCHECK(EmuN, EmuA, &o, false); x = o.x; y = o.y; z = o.z; w = o.w; } \
        EmuN& operator=(const EmuN& o) { EMU_VCHECK(EmuN, EmuA, &o, false); EMU_VCHECK(EmuN, EmuA, this, true); \
            x = o.x; y = o.y; z = o.z; w = o.w; return *this; } }; \
    static inline EmuN make_##EmuN(EmuT x, EmuT y, EmuT z, EmuT w) { return EmuN(x, y, z, w); }
EMU_VEC2(char, char2, 2) EMU_VEC4(char, char4, 4)
EMU_VEC2(unsigned char, uchar2, 2) EMU_VEC4(unsigned char, uchar4, 4)
EMU_VEC2(short, short2, 4) EMU_VEC4(short, short4, 8)
EMU_VEC2(unsigned short, ushort2, 4) EMU_VEC4(unsigned short, ushort4, 8)
EMU_VEC2(int, int2, 8) EMU_VEC3(int, int3) EMU_VEC4(int, int4, 16)
EMU_VEC2(unsigned int, uint2, 8) EMU_VEC4(unsigned int, uint4, 16)
EMU_VEC2(float, float2, 8) EMU_VEC3(float, float3) EMU_VEC4(float, float4, 16)
EMU_VEC2(double, double2, 16)
EMU_VEC2(long long, longlong2, 16)
static inline uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) { uint3 r{x, y, z}; return r; }
#undef EMU_VEC2
#undef EMU_VEC3
#undef EMU_VEC4

#define warpSize 32

// ---------------------------------------------------------------- bit casts
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
static inline float __uint_as_float(unsigned int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int i; std::memcpy(&i, &f, 4); return i; }
static inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
static inline long long __double_as_longlong(double d) { long long i; std::memcpy(&i, &d, 8); return i; }

// ---------------------------------------------------------------- math
// CUDA's fast intrinsics map to the accurate libm functions (glibc declares
// these names but does not export them, hence macros rather than functions).
#define __expf(x) expf(x)
#define __exp10f(x) exp10f(x)
#define __logf(x) logf(x)
#define __log2f(x) log2f(x)
#define __log10f(x) log10f(x)
#define __sinf(x) sinf(x)
#define __cosf(x) cosf(x)
#define __tanf(x) tanf(x)
#define __powf(x, y) powf(x, y)
#define __sincosf(x, s, c) sincosf(x, s, c)
// sin(pi x), cos(pi x): glibc has no float sinpi/cospi; the double functions of pi * x rounded
// once to float (within an ulp of the device's)
static inline void sincospif(float x, float* s, float* c) {
    const double a = 3.141592653589793 * (double)x;
    *s = (float)sin(a);
    *c = (float)cos(a);
}
// The device's x * rcp.approx(y): 0 (times x's sign and y's) for 2^126 < |y|; otherwise the
// exact quotient (the device's is within 2 ulp).
static inline float __fdividef(float x, float y) {
    return std::fabs(y) > 0x1p126f ? x * std::copysign(0.0f, y) : x / y;
}
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
static inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
static inline float __frcp_rn(float x) { return 1.0f / x; }
static inline float __fsqrt_rn(float x) { return sqrtf(x); }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : (x == x ? x : 0.0f)); }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
static inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }
static inline int __popc(unsigned int x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned int)x); }
static inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned int __brev(unsigned int x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
    return (x >> 16) | (x << 16);
}
static inline int __mul24(int a, int b) { return a * b; }
static inline int __mulhi(int a, int b) { return (int)(((long long)a * (long long)b) >> 32); }
static inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * (unsigned long long)b) >> 32);
}
template <typename EmuT> static inline EmuT __ldg(const EmuT* p) { return *p; }
template <typename EmuT> static inline EmuT __ldcs(const EmuT* p) { return *p; }
template <typename EmuT> static inline EmuT __ldcg(const EmuT* p) { return *p; }
template <typename EmuT> static inline void __stcs(EmuT* p, EmuT v) { *p = v; }
template <typename EmuT> static inline void __stcg(EmuT* p, EmuT v) { *p = v; }
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
// A GPU's clock64 counts SM clocks; here nanoseconds of the monotonic clock (callers such as
// hold.cu only need time to pass).
static inline long long clock64() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

// ---------------------------------------------------------------- atomics
// Fibers of a block never run concurrently, but blocks on other OS threads
// may: global-memory atomics are real atomics.
#define EMU_ATOMIC_INT(EmuT) \
    static inline EmuT atomicAdd(EmuT* p, EmuT v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); } \
    static inline EmuT atomicSub(EmuT* p, EmuT v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); } \
    static inline EmuT atomicExch(EmuT* p, EmuT v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); } \
    static inline EmuT atomicAnd(EmuT* p, EmuT v) { return __atomic_fetch_and(p, v, __ATOMIC_RELAXED); } \
    static inline EmuT atomicOr(EmuT* p, EmuT v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); } \
    static inline EmuT atomicXor(EmuT* p, EmuT v) { return __atomic_fetch_xor(p, v, __ATOMIC_RELAXED); } \
    static inline EmuT atomicCAS(EmuT* p, EmuT cmp, EmuT v) { \
        __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED); return cmp; } \
    static inline EmuT atomicMax(EmuT* p, EmuT v) { EmuT o = *p; \
        while (o < v && !__atomic_compare_exchange_n(p, &o, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {} return o; } \
    static inline EmuT atomicMin(EmuT* p, EmuT v) { EmuT o = *p; \
        while (o > v && !__atomic_compare_exchange_n(p, &o, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {} return o; }
EMU_ATOMIC_INT(int)
EMU_ATOMIC_INT(unsigned int)
EMU_ATOMIC_INT(unsigned long long)
EMU_ATOMIC_INT(long long)
#undef EMU_ATOMIC_INT
#define EMU_ATOMIC_FP(EmuT, EmuU) \
    static inline EmuT atomicAdd(EmuT* p, EmuT v) { \
        EmuU* q = reinterpret_cast<EmuU*>(p); EmuU o = __atomic_load_n(q, __ATOMIC_RELAXED); \
        for (;;) { EmuT f; std::memcpy(&f, &o, sizeof f); EmuT n = f + v; EmuU nu; std::memcpy(&nu, &n, sizeof nu); \
            if (__atomic_compare_exchange_n(q, &o, nu, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return f; } } \
    static inline EmuT atomicExch(EmuT* p, EmuT v) { \
        EmuU nu; std::memcpy(&nu, &v, sizeof nu); EmuU o = __atomic_exchange_n(reinterpret_cast<EmuU*>(p), nu, __ATOMIC_RELAXED); \
        EmuT f; std::memcpy(&f, &o, sizeof f); return f; }
EMU_ATOMIC_FP(float, unsigned int)
EMU_ATOMIC_FP(double, unsigned long long)
#undef EMU_ATOMIC_FP

// ---------------------------------------------------------------- f16 / bf16
namespace emu {
static inline unsigned short f32_to_f16_bits(float f) {
    unsigned int x = __float_as_uint(f);
    unsigned int sign = (x >> 16) & 0x8000u;
    unsigned int ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return 0x7fffu;               // NaN: CUDA's canonical NaN
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // >= 65520 rounds to inf
    if (ax >= 0x38800000u) {                              // normal half
        unsigned int r = ax - 0x38000000u;
        r += 0x0fffu + ((r >> 13) & 1u);
        return (unsigned short)(sign | (r >> 13));
    }
    if (ax < 0x33000000u) return (unsigned short)sign;  // below half the smallest subnormal
    unsigned int e = ax >> 23, mant = (ax & 0x7fffffu) | 0x800000u;
    unsigned int s = 126u - e;                            // 14..24
    unsigned int q = mant >> s, rem = mant & ((1u << s) - 1u), half = 1u << (s - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (unsigned short)(sign | q);
}
static inline float f16_bits_to_f32(unsigned short h) {
    unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
    unsigned int e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0) {
        if (m == 0) bits = sign;
        else {
            e = 113;
            while (!(m & 0x400u)) { m <<= 1; e--; }
            bits = sign | (e << 23) | ((m & 0x3ffu) << 13);
        }
    } else if (e == 31) bits = sign | 0x7f800000u | (m << 13);
    else bits = sign | ((e + 112u) << 23) | (m << 13);
    return __uint_as_float(bits);
}
static inline unsigned short f32_to_bf16_bits(float f) {
    unsigned int x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
    x += 0x7fffu + ((x >> 16) & 1u);
    return (unsigned short)(x >> 16);
}
static inline float bf16_bits_to_f32(unsigned short b) { return __uint_as_float((unsigned int)b << 16); }
}  // namespace emu

struct __half {
    unsigned short __x;
    __half() = default;
    __half(float f) : __x(emu::f32_to_f16_bits(f)) {}
    __half(double f) : __x(emu::f32_to_f16_bits((float)f)) {}
    __half(int i) : __x(emu::f32_to_f16_bits((float)i)) {}
    operator float() const { return emu::f16_bits_to_f32(__x); }
};
struct __attribute__((aligned(4))) __half2 {
    __half x, y;
    __half2() = default;
    __half2(const __half2& o) { EMU_VCHECK(__half2, 4, &o, false); x = o.x; y = o.y; }
    __half2& operator=(const __half2& o) {
        EMU_VCHECK(__half2, 4, &o, false); EMU_VCHECK(__half2, 4, this, true);
        x = o.x; y = o.y; return *this;
    }
};
struct __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(emu::f32_to_bf16_bits(f)) {}
    __nv_bfloat16(double f) : __x(emu::f32_to_bf16_bits((float)f)) {}
    __nv_bfloat16(int i) : __x(emu::f32_to_bf16_bits((float)i)) {}
    operator float() const { return emu::bf16_bits_to_f32(__x); }
};
struct __attribute__((aligned(4))) __nv_bfloat162 {
    __nv_bfloat16 x, y;
    __nv_bfloat162() = default;
    __nv_bfloat162(const __nv_bfloat162& o) { EMU_VCHECK(__nv_bfloat162, 4, &o, false); x = o.x; y = o.y; }
    __nv_bfloat162& operator=(const __nv_bfloat162& o) {
        EMU_VCHECK(__nv_bfloat162, 4, &o, false); EMU_VCHECK(__nv_bfloat162, 4, this, true);
        x = o.x; y = o.y; return *this;
    }
};
typedef __half half;
typedef __half2 half2;
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;

static inline __half __ushort_as_half(unsigned short u) { __half h; h.__x = u; return h; }
static inline unsigned short __half_as_ushort(__half h) { return h.__x; }
static inline __half __float2half(float f) { return __ushort_as_half(emu::f32_to_f16_bits(f)); }
static inline __half __float2half_rn(float f) { return __float2half(f); }
static inline float __half2float(__half h) { return emu::f16_bits_to_f32(h.__x); }
static inline __half2 __halves2half2(__half a, __half b) { __half2 r; r.x = a; r.y = b; return r; }
static inline __half2 __floats2half2_rn(float a, float b) { return __halves2half2(__float2half(a), __float2half(b)); }
static inline __half2 __float2half2_rn(float a) { return __floats2half2_rn(a, a); }
static inline __half2 __float22half2_rn(float2 f) { return __floats2half2_rn(f.x, f.y); }
static inline float2 __half22float2(__half2 h) { return make_float2(__half2float(h.x), __half2float(h.y)); }
static inline __half __low2half(__half2 h) { return h.x; }
static inline __half __high2half(__half2 h) { return h.y; }
static inline float __low2float(__half2 h) { return __half2float(h.x); }
static inline float __high2float(__half2 h) { return __half2float(h.y); }
static inline __half __hadd(__half a, __half b) { return __float2half(__half2float(a) + __half2float(b)); }
static inline __half __hsub(__half a, __half b) { return __float2half(__half2float(a) - __half2float(b)); }
static inline __half __hmul(__half a, __half b) { return __float2half(__half2float(a) * __half2float(b)); }
static inline __half __hdiv(__half a, __half b) { return __float2half(__half2float(a) / __half2float(b)); }
static inline __half __hneg(__half a) { return __ushort_as_half((unsigned short)(a.__x ^ 0x8000u)); }
static inline __half __habs(__half a) { return __ushort_as_half((unsigned short)(a.__x & 0x7fffu)); }
static inline __half __hfma(__half a, __half b, __half c) {
    return __float2half(fmaf(__half2float(a), __half2float(b), __half2float(c)));
}
static inline __half __hmax(__half a, __half b) { return __half2float(a) >= __half2float(b) ? a : b; }
static inline __half __hmin(__half a, __half b) { return __half2float(a) <= __half2float(b) ? a : b; }
static inline bool __hisinf(__half a) { return (a.__x & 0x7fffu) == 0x7c00u; }
static inline bool __hisnan(__half a) { return (a.__x & 0x7fffu) > 0x7c00u; }
static inline __half2 __hadd2(__half2 a, __half2 b) { return __halves2half2(__hadd(a.x, b.x), __hadd(a.y, b.y)); }
static inline __half2 __hmul2(__half2 a, __half2 b) { return __halves2half2(__hmul(a.x, b.x), __hmul(a.y, b.y)); }
static inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
    return __halves2half2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y));
}
static inline __half operator+(const __half& a, const __half& b) { return __hadd(a, b); }
static inline __half operator-(const __half& a, const __half& b) { return __hsub(a, b); }
static inline __half operator*(const __half& a, const __half& b) { return __hmul(a, b); }
static inline __half operator/(const __half& a, const __half& b) { return __hdiv(a, b); }
static inline __half operator-(const __half& a) { return __hneg(a); }

static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 h; h.__x = u; return h; }
static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
static inline __nv_bfloat16 __float2bfloat16(float f) { return __ushort_as_bfloat16(emu::f32_to_bf16_bits(f)); }
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }
static inline float __bfloat162float(__nv_bfloat16 h) { return emu::bf16_bits_to_f32(h.__x); }
static inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { __nv_bfloat162 r; r.x = a; r.y = b; return r; }
static inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return __halves2bfloat162(__float2bfloat16(a), __float2bfloat16(b));
}
static inline __nv_bfloat162 __float2bfloat162_rn(float a) { return __floats2bfloat162_rn(a, a); }
static inline __nv_bfloat162 __float22bfloat162_rn(float2 f) { return __floats2bfloat162_rn(f.x, f.y); }
static inline float2 __bfloat1622float2(__nv_bfloat162 h) {
    return make_float2(__bfloat162float(h.x), __bfloat162float(h.y));
}
static inline float __low2float(__nv_bfloat162 h) { return __bfloat162float(h.x); }
static inline float __high2float(__nv_bfloat162 h) { return __bfloat162float(h.y); }
static inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 h) { return h.x; }
static inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 h) { return h.y; }
static inline __nv_bfloat16 __hadd(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16(__bfloat162float(a) + __bfloat162float(b)); }
static inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16(__bfloat162float(a) * __bfloat162float(b)); }
static inline __nv_bfloat16 operator+(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hadd(a, b); }
static inline __nv_bfloat16 operator*(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hmul(a, b); }

// ---------------------------------------------------------------- constants
#define CUDART_INF_F __int_as_float(0x7f800000)
#define CUDART_NAN_F __int_as_float(0x7fffffff)
#define CUDART_INF __longlong_as_double(0x7ff0000000000000LL)
#define CUDART_NAN __longlong_as_double(0xfff8000000000000LL)
#define CUDART_PI_F 3.141592654f
#define CUDART_PI 3.1415926535897931e+0
#define CUDART_2PI 6.2831853071795862e+0
#define CUDART_SQRT_HALF_F 0.707106781f
#define CUDART_L2E_F 1.442695041f
#define CUDART_LN2_F 0.693147181f
#define CUDART_ZERO_F 0.0f
#define CUDART_ONE_F 1.0f

// ---------------------------------------------------------------- fibers
// The emulator's own machinery is not instrumented by the memory checks
// (g++ -fsanitize=kernel-address, see "memory checks" below): only kernel code is.
#define EMU_INTERNAL __attribute__((no_sanitize_address))

namespace emu {

enum : int { RUNNABLE = 0, AT_BARRIER = 1, AT_WARP = 2, DONE = 3 };
enum : int { OP_SYNCWARP = 1, OP_SHFL_IDX, OP_SHFL_UP, OP_SHFL_DOWN, OP_SHFL_XOR, OP_BALLOT, OP_ANY, OP_ALL,
             OP_MMA_F16, OP_MMA_BF16, OP_WGMMA };
enum : int { ORDER_FORWARD = 0, ORDER_REVERSE = 1, ORDER_SHUFFLE = 2 };

static const char* const op_names[] = {"?", "__syncwarp", "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                       "__shfl_xor_sync", "__ballot_sync", "__any_sync", "__all_sync",
                                       "mma.sync.m16n8k16 (f16)", "mma.sync.m16n8k16 (bf16)",
                                       "wgmma.mma_async"};

struct Fiber {
    void* sp;
    char* stack;  // usable stack (a PROT_NONE guard page lies just below)
    uint3 tidx;
    int tid;
    int state;
    int bar_result;
    int yield_in;  // shared-memory accesses before this lane hands over (-1: not again in this
                   // interval; -2: not drawn yet)
    unsigned long long warp_result;
    // Counter mode: the bytes of this lane's latest vector load [0] / store [1]
    // whose pieces (g++'s split copy) are still to come and are not counted
    // again, and ldmatrix's gathers (counted as the one instruction they are).
    unsigned long long cv_lo[2], cv_hi[2], cv_left[2];
    int cnt_mute;
    int pdl_waited;  // counter mode: this thread has run pdl_wait() (pdl.cuh)
#if !defined(__x86_64__)
    ucontext_t uc;
#endif
};

// A warp's lanes waiting at collectives. As on Volta and later, each lane
// names the lanes it synchronises with (its mask); several disjoint groups of
// one warp may wait at once, and a group completes when every non-exited
// lane of its mask has arrived at the same collective with the same mask.
struct Warp {
    unsigned exited;   // exited lanes, and lanes past the end of the block
    unsigned waiting;  // lanes at a collective
    // While every waiting lane waits at one op with one mask (the common case)
    // an arriving lane with the same op and mask needs no pairwise checks.
    bool uniform;
    int u_op;
    unsigned u_mask;
    unsigned mask[32];
    int op[32];
    unsigned long long in[32];
    int arg[32], width[32];
};

struct Block {
    uint3 bidx;
    uint3 bdim, gdim;
    int nthreads, live, bar_arrived, bar_count;
    Fiber* fibers;
    Warp* warps;
    void* sched_sp;
#if !defined(__x86_64__)
    ucontext_t sched_uc;
#endif
    void (*body)(void**);
    void** args;
    char* err;
    int errlen;
    bool failed;
    bool pdl_waited;  // counter mode: some thread of the block has run pdl_wait()
};

static thread_local Fiber* tl_fiber;
static thread_local Block* tl_block;

#ifndef EMU_STACK_BYTES
#define EMU_STACK_BYTES 65536  // the launcher generator defines it from emu_build.STACK_BYTES
#endif
static const size_t STACK_BYTES = EMU_STACK_BYTES;

#if defined(__x86_64__)
// Saves callee-saved registers, MXCSR and the x87 control word on the old
// stack, switches stacks and restores the same from the new one.
extern "C" void emu_ctx_switch(void** save_sp, void* new_sp);
asm(".text\n"
    ".p2align 4\n"
    ".globl emu_ctx_switch\n"
    ".hidden emu_ctx_switch\n"
    ".type emu_ctx_switch,@function\n"
    "emu_ctx_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size emu_ctx_switch, .-emu_ctx_switch\n");
#endif

static void fiber_main();

// Fiber stacks come from the caller (the Python side keeps one arena per OS
// thread, shared by every module): STACK_BYTES each, a PROT_NONE guard page
// below each one, so a stack overflow faults instead of corrupting.
struct StackArena {
    char* base;
    int count;
    size_t stride;  // guard page + STACK_BYTES
    EMU_INTERNAL char* get(int i) const { return i < count ? base + (size_t)i * stride + (stride - STACK_BYTES) : nullptr; }
};

static inline void switch_to_scheduler() {
    Fiber* f = tl_fiber;
    Block* b = tl_block;
#if defined(__x86_64__)
    emu_ctx_switch(&f->sp, b->sched_sp);
#else
    swapcontext(&f->uc, &b->sched_uc);
#endif
}

static inline void switch_to_fiber(Block* b, Fiber* f) {
    tl_fiber = f;
#if defined(__x86_64__)
    emu_ctx_switch(&b->sched_sp, f->sp);
#else
    swapcontext(&b->sched_uc, &f->uc);
#endif
}

EMU_INTERNAL static inline void init_fiber(Fiber* f) {
#if defined(__x86_64__)
    // Frame popped by emu_ctx_switch: [mxcsr|fpucw][r15..rbp][ret=fiber_main].
    // After its `ret`, rsp % 16 == 8, as at the entry of a called function.
    unsigned long long* top = (unsigned long long*)(f->stack + STACK_BYTES);
    unsigned long long* sp = top - 9;
    const unsigned int mxcsr = 0x1f80u | 0x8000u | 0x0040u;  // all masked, FTZ, DAZ
    sp[0] = (unsigned long long)mxcsr | (0x037fULL << 32);
    for (int i = 1; i <= 6; i++) sp[i] = 0;
    sp[7] = (unsigned long long)(void*)&fiber_main;
    sp[8] = 0;
    f->sp = sp;
#else
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = f->stack;
    f->uc.uc_stack.ss_size = STACK_BYTES;
    f->uc.uc_link = nullptr;
    makecontext(&f->uc, (void (*)())fiber_main, 0);
#endif
}

EMU_INTERNAL static void arm_yield(Fiber* f);
EMU_INTERNAL static void count_barrier();
EMU_INTERNAL static void count_mma();

EMU_INTERNAL static inline void release_barrier(Block* b) {
    if (EMU_COUNTERS && g_counting && tl_cnt) count_barrier();
    for (int i = 0; i < b->nthreads; i++) {
        Fiber* f = &b->fibers[i];
        if (f->state == AT_BARRIER) { f->state = RUNNABLE; f->bar_result = b->bar_count; arm_yield(f); }
    }
    b->bar_arrived = 0;
    b->bar_count = 0;
}

// A lane outside the group reads its own value, as for a source outside the segment.
EMU_INTERNAL static inline unsigned long long lane_value(const Warp& w, unsigned group, int lane, int src) {
    return (src >= 0 && src < 32 && ((group >> src) & 1u)) ? w.in[src] : w.in[lane];
}

// One lane's operands of mma.sync.m16n8k16.row.col.f32.{f16,bf16}: registers as
// in the PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating point type").
struct MmaLane {
    float* d;
    const unsigned int* a;  // 4 registers, 2 elements each (low half first)
    const unsigned int* b;  // 2 registers
    const float* c;         // 4 accumulators
};

// D = A(16x16) * B(16x8) + C with every lane's fragment gathered, products and
// sums in double and one rounding to f32 (the hardware's f32 accumulation
// differs in the last bits; tests compare with tolerances).
EMU_INTERNAL static inline void resolve_mma(Warp& w, bool bf16) {
    float mma_a[16][16], mma_b[16][8], mma_c[16][8];  // (names clear of kernels' -D macros)
    auto elem = [bf16](unsigned int reg, int hi) {
        unsigned short h = (unsigned short)(hi ? reg >> 16 : reg & 0xffffu);
        return bf16 ? bf16_bits_to_f32(h) : f16_bits_to_f32(h);
    };
    for (int l = 0; l < 32; l++) {
        const MmaLane* m = (const MmaLane*)(unsigned long long)w.in[l];
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 8; i++) {
            const int row = g + ((i & 2) ? 8 : 0), col = t * 2 + (i & 1) + ((i & 4) ? 8 : 0);
            mma_a[row][col] = elem(m->a[i >> 1], i & 1);
        }
        for (int i = 0; i < 4; i++) mma_b[t * 2 + (i & 1) + ((i & 2) ? 8 : 0)][g] = elem(m->b[i >> 1], i & 1);
        for (int i = 0; i < 4; i++) mma_c[g + ((i & 2) ? 8 : 0)][t * 2 + (i & 1)] = m->c[i];
    }
    float mma_d[16][8];
    for (int r = 0; r < 16; r++)
        for (int n = 0; n < 8; n++) {
            double acc = mma_c[r][n];
            for (int k = 0; k < 16; k++) acc += (double)mma_a[r][k] * (double)mma_b[k][n];
            mma_d[r][n] = (float)acc;
        }
    for (int l = 0; l < 32; l++) {
        const MmaLane* m = (const MmaLane*)(unsigned long long)w.in[l];
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 4; i++) m->d[i] = mma_d[g + ((i & 2) ? 8 : 0)][t * 2 + (i & 1)];
    }
}

static inline void fail(Block* b, const char* msg);
// wgmma (the "wgmma" section below): issue at the warp collective, per-thread state at a
// block's start and a thread's exit.
EMU_INTERNAL static void resolve_wgmma(Block* b, int wi, Warp& w);
EMU_INTERNAL static void wg_block_start(Block* b);
EMU_INTERNAL static void wg_thread_exit(Block* b, Fiber* f);

// Completes the collective of the lanes in `group` (all waiting with the same op and mask).
EMU_INTERNAL static void resolve_group(Block* b, int wi, unsigned group) {
    Warp& w = b->warps[wi];
    const int l0 = __builtin_ctz(group);
    const int op = w.op[l0];
    if (op == OP_MMA_F16 || op == OP_MMA_BF16) {
        if (group != 0xffffffffu) {
            char m[160];
            snprintf(m, sizeof m, "%s in warp %d with lanes 0x%08x: it needs all 32", op_names[op], wi, group);
            fail(b, m);
        } else {
            resolve_mma(w, op == OP_MMA_BF16);
            if (EMU_COUNTERS && g_counting && tl_cnt) count_mma();
        }
    }
    if (op == OP_WGMMA) {
        if (group != 0xffffffffu) {
            char m[160];
            snprintf(m, sizeof m, "%s in warp %d with lanes 0x%08x: it needs all 32", op_names[op], wi, group);
            fail(b, m);
        } else {
            resolve_wgmma(b, wi, w);
        }
    }
    unsigned vote = 0;
    for (int l = 0; l < 32; l++)
        if (((group >> l) & 1u) && w.in[l] != 0) vote |= 1u << l;
    for (int l = 0; l < 32; l++) {
        if (!((group >> l) & 1u)) continue;
        Fiber* f = &b->fibers[wi * 32 + l];
        int width = w.width[l], arg = w.arg[l];
        int seg = l & ~(width - 1), src;
        unsigned long long r = 0;
        switch (op) {
            case OP_SHFL_IDX: src = seg + (arg & (width - 1)); r = lane_value(w, group, l, src); break;
            case OP_SHFL_UP: src = l - arg; r = (src < seg) ? w.in[l] : lane_value(w, group, l, src); break;
            case OP_SHFL_DOWN: src = l + arg; r = (src >= seg + width) ? w.in[l] : lane_value(w, group, l, src); break;
            case OP_SHFL_XOR: src = l ^ arg; r = (src >= seg + width) ? w.in[l] : lane_value(w, group, l, src); break;
            case OP_BALLOT: r = vote; break;
            case OP_ANY: r = vote != 0; break;
            case OP_ALL: r = vote == group; break;
            default: r = 0; break;
        }
        f->warp_result = r;
        f->state = RUNNABLE;
        arm_yield(f);
    }
    w.waiting &= ~group;
}

// Resolves the group named by `mask` if all its non-exited lanes wait with that mask.
EMU_INTERNAL static void try_resolve(Block* b, int wi, unsigned mask) {
    Warp& w = b->warps[wi];
    const unsigned need = mask & ~w.exited;
    if (!need || (w.waiting & need) != need) return;
    const int l0 = __builtin_ctz(need);
    for (unsigned m = w.uniform ? 0u : need; m; m &= m - 1) {
        const int l = __builtin_ctz(m);
        if (w.mask[l] != mask || w.op[l] != w.op[l0]) return;
    }
    resolve_group(b, wi, need);
}

static inline void fail(Block* b, const char* msg) {
    if (!b->failed) {
        b->failed = true;
        snprintf(b->err, (size_t)b->errlen, "%s", msg);
    }
}

EMU_INTERNAL static unsigned long long warp_collective(int op, unsigned long long v, int arg, int width,
                                                      unsigned mask) {
    Block* b = tl_block;
    Fiber* f = tl_fiber;
    int wi = f->tid >> 5, lane = f->tid & 31;
    Warp& w = b->warps[wi];
    if (width <= 0 || width > 32 || (width & (width - 1))) {
        char m[160];
        snprintf(m, sizeof m, "%s: width %d is not a power of two in [1, 32] (thread %d)", op_names[op], width, f->tid);
        fail(b, m);
        width = 32;
    }
    if (!((mask >> lane) & 1u)) {
        char m[200];
        snprintf(m, sizeof m, "%s in warp %d: lane %d (thread %d) passes mask 0x%08x, which leaves the lane itself out",
                 op_names[op], wi, lane, f->tid, mask);
        fail(b, m);
        mask |= 1u << lane;
    }
    const bool same = w.waiting == 0 || (w.uniform && w.u_op == op && w.u_mask == mask);
    if (w.waiting == 0) { w.uniform = true; w.u_op = op; w.u_mask = mask; }
    else if (!same) w.uniform = false;
    // Two lanes that each name the other but wait at different collectives or
    // with different masks wait for each other forever (undefined in PTX).
    for (unsigned m = same ? 0u : w.waiting & mask; m; m &= m - 1) {
        const int j = __builtin_ctz(m);
        if (!((w.mask[j] >> lane) & 1u)) continue;
        if (w.op[j] != op) {
            char msg[240];
            snprintf(msg, sizeof msg, "divergent warp collectives in warp %d: lane %d waits at %s while lane %d "
                     "reached %s", wi, j, op_names[w.op[j]], lane, op_names[op]);
            fail(b, msg);
        } else if (w.mask[j] != mask) {
            char msg[240];
            snprintf(msg, sizeof msg, "%s in warp %d: lane %d passes mask 0x%08x but lane %d passes 0x%08x "
                     "(the lanes of one collective must name the same mask)", op_names[op], wi, j, w.mask[j],
                     lane, mask);
            fail(b, msg);
        }
    }
    w.in[lane] = v;
    w.arg[lane] = arg;
    w.width[lane] = width;
    w.op[lane] = op;
    w.mask[lane] = mask;
    w.waiting |= 1u << lane;
    f->state = AT_WARP;
    try_resolve(b, wi, mask);
    switch_to_scheduler();
    return f->warp_result;
}

// A lane's exit may complete groups that were waiting for it.
EMU_INTERNAL static void lane_exited(Block* b, int tid) {
    Warp& w = b->warps[tid >> 5];
    w.exited |= 1u << (tid & 31);
    for (unsigned m = w.waiting; m; m &= m - 1) {
        const int l = __builtin_ctz(m);
        if ((w.waiting >> l) & 1u) try_resolve(b, tid >> 5, w.mask[l]);
    }
}

EMU_INTERNAL static void fiber_main() {
    Block* b = tl_block;
    b->body(b->args);
    Fiber* f = tl_fiber;
    wg_thread_exit(b, f);
    f->state = DONE;
    b->live--;
    lane_exited(b, f->tid);
    if (b->bar_arrived > 0 && b->bar_arrived == b->live) release_barrier(b);
    switch_to_scheduler();
    __builtin_unreachable();
}

struct Rng {  // splitmix64: tiny, seedable, identical everywhere
    unsigned long long s;
    EMU_INTERNAL unsigned long long next() {
        unsigned long long z = (s += 0x9e3779b97f4a7c15ULL);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        return z ^ (z >> 31);
    }
};

EMU_INTERNAL static void describe_deadlock(Block* b) {
    char msg[768];
    int n = snprintf(msg, sizeof msg,
                     "deadlock in block (%u,%u,%u): %d of %d threads still live and none can proceed;",
                     b->bidx.x, b->bidx.y, b->bidx.z, b->live, b->nthreads);
    int at_bar = 0, first_bar = -1;
    for (int i = 0; i < b->nthreads; i++)
        if (b->fibers[i].state == AT_BARRIER) { if (first_bar < 0) first_bar = i; at_bar++; }
    if (at_bar) n += snprintf(msg + n, sizeof msg - n, " %d wait at __syncthreads (first: thread %d);", at_bar, first_bar);
    int nw = (b->nthreads + 31) / 32;
    for (int wi = 0; wi < nw && n < (int)sizeof msg - 96; wi++) {
        Warp& w = b->warps[wi];
        if (w.waiting) {
            const int l = __builtin_ctz(w.waiting);
            n += snprintf(msg + n, sizeof msg - n, " warp %d: lanes 0x%08x wait (lane %d at %s, mask 0x%08x);", wi,
                          w.waiting, l, op_names[w.op[l]], w.mask[l]);
        }
    }
    snprintf(msg + n, sizeof msg - n, " (a barrier or warp collective in divergent code?)");
    fail(b, msg);
}

EMU_INTERNAL static void order_list(int* v, int n, int order, Rng& rng) {
    if (order == ORDER_REVERSE) {
        for (int i = 0, j = n - 1; i < j; i++, j--) { const int t = v[i]; v[i] = v[j]; v[j] = t; }
    } else if (order == ORDER_SHUFFLE) {
        for (int i = n; i > 1; i--) {
            const int j = (int)(rng.next() % (unsigned)i), t = v[i - 1];
            v[i - 1] = v[j];
            v[j] = t;
        }
    }
}

// Runs one block; false on deadlock or misuse (message in b->err).
EMU_INTERNAL static bool run_block(Block* b, int order, Rng& rng, const StackArena& stacks) {
    const int nt = b->nthreads, nw = (nt + 31) / 32;
    b->pdl_waited = false;
    for (int i = 0; i < nt; i++) {
        Fiber* f = &b->fibers[i];
        f->tid = i;
        f->tidx.x = (unsigned)i % b->bdim.x;
        f->tidx.y = ((unsigned)i / b->bdim.x) % b->bdim.y;
        f->tidx.z = (unsigned)i / (b->bdim.x * b->bdim.y);
        f->state = RUNNABLE;
        arm_yield(f);
        f->cv_left[0] = f->cv_left[1] = 0;
        f->cnt_mute = 0;
        f->pdl_waited = 0;
        f->stack = stacks.get(i);
        if (!f->stack) { fail(b, "the fiber stack arena is smaller than the block"); return false; }
        init_fiber(f);
    }
    for (int wi = 0; wi < nw; wi++) {
        Warp& w = b->warps[wi];
        const int nl = nt - wi * 32 < 32 ? nt - wi * 32 : 32;
        w.exited = nl == 32 ? 0u : ~((1u << nl) - 1u);
        w.waiting = 0;
        w.uniform = true;
    }
    b->live = nt;
    b->bar_arrived = b->bar_count = 0;
    wg_block_start(b);
    // Warps run one at a time, each as far as it can get (through its warp
    // collectives, up to a __syncthreads or its end) before the next warp
    // starts, in forward, reverse or shuffled warp order: one warp runs ahead
    // of the others by a whole barrier interval, the worst case for a missing
    // __syncthreads between warps. Lanes inside a warp resume in the same
    // kind of order, so a missing __syncwarp shows too.
    // (Plain arrays and loops: library templates would not inline into this
    // uninstrumented code and would run instrumented, out of line.)
    int warp_order[32], lane_order[32];  // a block has at most 1024 threads
    while (b->live > 0) {
        int nwo = 0;
        for (int wi = 0; wi < nw; wi++) {
            const int l1 = nt < wi * 32 + 32 ? nt : wi * 32 + 32;
            for (int i = wi * 32; i < l1; i++)
                if (b->fibers[i].state == RUNNABLE) { warp_order[nwo++] = wi; break; }
        }
        if (nwo == 0) { describe_deadlock(b); return false; }
        order_list(warp_order, nwo, order, rng);
        for (int k = 0; k < nwo; k++) {
            const int wi = warp_order[k];
            const int l0 = wi * 32, l1 = nt < wi * 32 + 32 ? nt : wi * 32 + 32;
            for (;;) {
                int nlo = 0;
                for (int i = l0; i < l1; i++)
                    if (b->fibers[i].state == RUNNABLE) lane_order[nlo++] = i;
                if (nlo == 0) break;
                order_list(lane_order, nlo, order, rng);
                for (int j = 0; j < nlo; j++) {
                    Fiber* f = &b->fibers[lane_order[j]];
                    if (f->state != RUNNABLE) continue;
                    switch_to_fiber(b, f);
                    if (b->failed) return false;
                }
            }
        }
    }
    return true;
}

// ---------------------------------------------------------------- faults

// ---------------------------------------------------------------- memory checks
// Kernel code is compiled with g++ -fsanitize=kernel-address and every load
// and store of it calls __asan_{load,store}N_noabort below (no shadow memory:
// these are ours). Each launch gets a table of the allocations its pointer
// arguments point into (from guarded_memory.py: data [d0, d1) inside a mapping
// [lo, hi) with guard pages at both ends). An access that touches a page of a
// mapping other than its interior pages is compared with [d0, d1) exactly, so
// a[-1] and a[n] are reported for any byte size; interior pages cost one hash
// probe. Vector alignment is checked by the vector types themselves (g++
// splits struct copies into scalar accesses before instrumenting them).
struct MemRange {
    unsigned long long lo, hi, d0, d1;
    const char* name;  // "`param` (device array shape=... dtype=...)"
    int arg;           // index in the launch's list of ranges (counter mode reports per range)
};
enum : int { MEM_SLOTS = 1024, MEM_MAX_RANGES = 128, JUMP_FAULT = 1, JUMP_REPORT = 2 };
struct MemTable {
    MemRange r[MEM_MAX_RANGES];
    int n;
    // This OS thread's shared memory (static and dynamic), noted before each block.
    // Under the shuffled schedule a lane may hand over to another lane of its warp
    // before any shared-memory access, so lanes interleave between warp-level
    // synchronisation points as they may on Volta and later, not only there.
    struct { unsigned long long lo, len; } sh[32];
    int nsh;
    bool yield;
    bool count;  // counter mode: tl_cnt is this launch's counting state
    unsigned long long yrng;
    unsigned long long key[MEM_SLOTS];  // page number + 1; 0 = empty slot
    int val[MEM_SLOTS];
};
static thread_local MemTable* tl_mem;

EMU_INTERNAL static inline unsigned mem_slot(unsigned long long page) {
    return (unsigned)((page * 0x9e3779b97f4a7c15ULL) >> 54) & (MEM_SLOTS - 1);
}

EMU_INTERNAL static void mem_add_page(MemTable* t, unsigned long long page, int idx, int* used) {
    if (*used >= MEM_SLOTS / 2) return;  // keep probes short; an enormous table only loses coverage
    unsigned h = mem_slot(page);
    while (t->key[h]) {
        if (t->key[h] == page + 1) return;  // an allocation passed twice: the first name wins
        h = (h + 1) & (MEM_SLOTS - 1);
    }
    t->key[h] = page + 1;
    t->val[h] = idx;
    (*used)++;
}

EMU_INTERNAL static void build_mem_table(MemTable* t, const unsigned long long* ranges, const char* const* names,
                                         int nranges) {
    std::memset(t->key, 0, sizeof t->key);
    t->n = 0;
    t->nsh = 0;
    t->yield = false;
    t->count = false;
    t->yrng = 1;
    int used = 0;
    for (int i = 0; i < nranges && t->n < MEM_MAX_RANGES; i++) {
        MemRange& r = t->r[t->n];
        r.lo = ranges[4 * i];
        r.hi = ranges[4 * i + 1];
        r.d0 = ranges[4 * i + 2];
        r.d1 = ranges[4 * i + 3];
        r.name = names[i];
        r.arg = i;
        if (r.hi <= r.lo) continue;
        const int idx = t->n++;
        // Pages from the leading guard page to the first data page, and from
        // the last data page to the trailing guard page.
        for (unsigned long long p = r.lo >> 12; p <= (r.d0 >> 12) && p < (r.hi >> 12); p++) mem_add_page(t, p, idx, &used);
        const unsigned long long last = r.d1 > r.d0 ? (r.d1 - 1) >> 12 : r.d0 >> 12;
        for (unsigned long long p = last; p < (r.hi >> 12); p++) mem_add_page(t, p, idx, &used);
    }
}

static thread_local sigjmp_buf* tl_fault_jmp;

// Ends the launch at once (the fiber does not run on into memory it must not touch).
EMU_INTERNAL [[noreturn]] static void abort_launch(const char* msg) {
    fail(tl_block, msg);
    sigjmp_buf* j = tl_fault_jmp;
    tl_fault_jmp = nullptr;
    siglongjmp(*j, JUMP_REPORT);
}

EMU_INTERNAL static int where_str(char* buf, size_t len) {
    const Block* b = tl_block;
    const Fiber* f = tl_fiber;
    return snprintf(buf, len, "in block (%u,%u,%u) thread (%u,%u,%u)", b->bidx.x, b->bidx.y, b->bidx.z,
                    f ? f->tidx.x : 0u, f ? f->tidx.y : 0u, f ? f->tidx.z : 0u);
}

EMU_INTERNAL [[noreturn]] static void report_oob(const MemRange& r, unsigned long long a, unsigned long long n,
                                                 bool store) {
    char m[768], w[96];
    where_str(w, sizeof w);
    const char* kind = store ? "store" : "load";
    if (a < r.d0)
        snprintf(m, sizeof m, "out-of-bounds %s of %llu bytes at 0x%llx, %llu bytes before the start of array %s "
                 "(%llu bytes) %s", kind, n, a, r.d0 - a, r.name, r.d1 - r.d0, w);
    else
        snprintf(m, sizeof m, "out-of-bounds %s of %llu bytes at 0x%llx, %llu bytes past the end of array %s "
                 "(%llu bytes, access at byte offset %llu) %s", kind, n, a, a >= r.d1 ? a - r.d1 : 0ULL, r.name,
                 r.d1 - r.d0, a - r.d0, w);
    abort_launch(m);
}

EMU_INTERNAL static inline void check_page(const MemTable* t, unsigned long long page, unsigned long long a,
                                           unsigned long long n, bool store) {
    unsigned h = mem_slot(page);
    for (;;) {
        const unsigned long long k = t->key[h];
        if (!k) return;
        if (k == page + 1) {
            const MemRange& r = t->r[t->val[h]];
            if (a < r.d0 || a + n > r.d1) report_oob(r, a, n, store);
            return;
        }
        h = (h + 1) & (MEM_SLOTS - 1);
    }
}

// Each lane hands over once per interval between synchronisation points, at
// a random one of its first shared-memory accesses there (one of the first 8
// or, half the time, of the first 64): one extra fiber switch per lane and
// interval at most, which keeps the cost bounded in kernels that stage
// whole tiles in shared memory.
EMU_INTERNAL static void arm_yield(Fiber* f) { f->yield_in = -2; }  // drawn at the first shared access

EMU_INTERNAL static void shared_yield(MemTable* t) {
    Fiber* f = tl_fiber;
    if (!f || f->state != RUNNABLE) return;
    if (f->yield_in == -2) {
        unsigned long long x = t->yrng;  // xorshift64
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        t->yrng = x;
        f->yield_in = (x & 1) ? (int)((x >> 1) & 7) : (int)((x >> 4) & 63);
    }
    if (f->yield_in >= 0 && f->yield_in-- == 0) switch_to_scheduler();
}

EMU_INTERNAL static inline void check_access(unsigned long long a, unsigned long long n, bool store) {
    MemTable* t = tl_mem;
    if (!t || !n) return;
    // A scalar load or store of 2, 4 or 8 bytes (16: a 128-bit integer) must be aligned to its
    // size: the GPU faults ("misaligned address") on e.g. a 4-byte load through
    // reinterpret_cast<const unsigned int*> at an address that is 2 mod 4, which the CPU runs
    // silently. (Vector types check their own alignment when they are copied, above.)
    if ((n == 2 || n == 4 || n == 8 || n == 16) && (a & (n - 1))) misaligned((const void*)a, (unsigned)n, "scalar", store);
    check_page(t, a >> 12, a, n, store);
    if ((a & 4095) + n > 4096) check_page(t, (a + n - 1) >> 12, a, n, store);
    if (t->yield)
        for (int i = 0; i < t->nsh; i++)
            if (a - t->sh[i].lo < t->sh[i].len) { shared_yield(t); break; }
}

// Called by the generated poison function for each shared-memory region of this OS thread.
EMU_INTERNAL static void note_shared(const void* p, unsigned long long n) {
    MemTable* t = tl_mem;
    if (t && n && t->nsh < 32) {
        t->sh[t->nsh].lo = (unsigned long long)p;
        t->sh[t->nsh].len = n;
        t->nsh++;
    }
}

EMU_INTERNAL static inline void misaligned(const void* p, unsigned align, const char* type, bool store) {
    if (!tl_block || !tl_mem) return;  // not inside a launch
    const unsigned long long a = (unsigned long long)p;
    const char* in = "shared or local memory";
    for (int i = 0; i < tl_mem->n; i++)
        if (a >= tl_mem->r[i].lo && a < tl_mem->r[i].hi) { in = tl_mem->r[i].name; break; }
    char m[768], w[96];
    where_str(w, sizeof w);
    snprintf(m, sizeof m, "misaligned %u-byte %s %s at 0x%llx (address %% %u = %llu) in %s %s", align, type,
             store ? "store" : "load", a, align, a % align, in, w);
    abort_launch(m);
}

// ldmatrix (cuda_src/ldmatrix.cuh): a lane's row address is 16-byte aligned and names 16 bytes
// of this block's shared memory (static or dynamic).
EMU_INTERNAL static void check_ldmatrix_row(const void* row) {
    const MemTable* t = tl_mem;
    if (!tl_block || !t) return;  // not inside a launch
    const unsigned long long a = (unsigned long long)row;
    char m[512], w[96];
    if (a & 15) {
        where_str(w, sizeof w);
        snprintf(m, sizeof m, "ldmatrix: row address 0x%llx is not 16-byte aligned (address %% 16 = %llu) %s", a,
                 a % 16, w);
        abort_launch(m);
    }
    for (int i = 0; i < t->nsh; i++)
        if (a >= t->sh[i].lo && a + 16 <= t->sh[i].lo + t->sh[i].len) return;
    const char* in = "memory that is not this block's shared memory";
    for (int i = 0; i < t->n; i++)
        if (a >= t->r[i].lo && a < t->r[i].hi) { in = t->r[i].name; break; }
    where_str(w, sizeof w);
    snprintf(m, sizeof m, "ldmatrix: row address 0x%llx is not in shared memory (the 16-byte row lies in %s) %s", a,
             in, w);
    abort_launch(m);
}

// ---------------------------------------------------------------- counters
// Counter mode (emu_launch_counted): every access of kernel code that the memory
// checks see is also counted, per warp-level instruction as the GPU would issue
// it. Lanes run one after another as fibers, so an instruction is rebuilt from
// its lanes' accesses: same warp, same site (the return address of the hook, in
// the kernel's code) and the same occurrence of that site in each lane since the
// block's last barrier; groups are complete at a barrier and at the block's end.
// Rules (the same arithmetic as profiling/counters.py):
//  - global: one request per instruction with an active lane; sectors = distinct
//    32-byte sectors its lanes touch; bytes = width x active lanes;
//  - shared: phases of 32 / max(1, w / 4) lanes (w = width: all 32 lanes up to 4 B,
//    16 for 8 B, 8 for 16 B); per phase the most distinct 4-byte words any one of
//    the 32 banks must deliver (lanes reading one word share it); ideal =
//    ceil(active lanes x w / 128);
//  - a vector type (float4, uint2, half2, ...) counts as the one access it is on
//    the GPU (count_vector) and the pieces g++ splits its copy into do not;
//    ldmatrix counts its lanes' 16-byte rows (phases of 8 rows: one per matrix),
//    not its emulated gathers; mma.sync once per warp, __syncthreads once per block;
//  - wgmma.mma_async: once per warpgroup instruction (CNT_WGMMA, counted by its first warp),
//    N / 8 m16n8k16 equivalents per warp (CNT_WGMMA_MMA), and the bytes of B it reads from
//    shared memory, N x 16 x 2 per warpgroup instruction (CNT_WGMMA_SMEM_BYTES; not in the
//    shared-load counts, which are per lane access);
//  - fiber-stack (local) accesses are not counted: on the GPU they are registers.
// Per range (pointer argument): bytes requested (read, written) and distinct bytes
// (a byte mask per 32-byte sector over the whole launch).
// PDL (cuda_src/pdl.cuh): per sector also the bytes read / written by threads that had
// not yet run pdl_wait(), prefetch_l2()'s lines among the reads (not in any count
// above: a prefetch is no load); CNT_PDL_* count the blocks with a thread past its
// wait, the threads that waited, and the threads that triggered their dependents
// before waiting. emu_pdl_export hands the sector table to the ordering check
// (dflash_cupy/emu/pdl_order.py).
enum : int { CNT_GLD_REQ, CNT_GLD_SEC, CNT_GLD_BYTES, CNT_GST_REQ, CNT_GST_SEC, CNT_GST_BYTES,
             CNT_SLD_REQ, CNT_SLD_WF, CNT_SLD_IDEAL, CNT_SST_REQ, CNT_SST_WF, CNT_SST_IDEAL,
             CNT_MMA, CNT_BARRIERS, CNT_BLOCKS, CNT_OTHER_ACC, CNT_OTHER_BYTES, CNT_SITES_MERGED,
             CNT_WGMMA, CNT_WGMMA_MMA, CNT_WGMMA_SMEM_BYTES, CNT_PDL_WAITED_BLOCKS, CNT_PDL_WAITS,
             CNT_PDL_EARLY_TRIGGERS, CNT_TOTALS = 24, CNT_PER_RANGE = 8 };
// then per range: bytes read, written, distinct read, distinct written, load requests, load
// sectors, store requests, store sectors (an instruction counts for its first lane's range)

struct CntOcc { unsigned long long site; int tid; unsigned n; };
struct CntSlot { unsigned long long site; int warp; unsigned occ; int store; int idx; };
struct CntGroup { unsigned long long addr[32], site; unsigned lanes, width; int space, store, range; };
struct CntSec { unsigned long long key; unsigned rd, wr, prd, pwr; };  // p*: before pdl_wait
// Per site (instruction of the g++ build): what its warp-level executions cost.
struct CntSite { unsigned long long site, kind, width, requests, units, ideal, bytes; };  // kind = store | space << 1
enum : int { CNT_SITE_VALS = 7 };
struct Count {
    unsigned long long* out;
    int nranges;
    CntOcc* occ; unsigned occ_bits, occ_used;
    CntSlot* gt; unsigned gt_bits, gt_used;
    CntGroup* g; unsigned ng, g_cap;
    CntSec* sec; unsigned sec_bits, sec_used;
    CntSite* st; unsigned st_n, st_cap;   // a short list: kernels have few hundred sites
};

EMU_INTERNAL static inline unsigned cnt_hash(unsigned long long k, unsigned bits) {
    return (unsigned)((k * 0x9e3779b97f4a7c15ULL) >> (64 - bits));
}

EMU_INTERNAL static void cnt_init(Count* c, unsigned long long* out, int nranges) {
    std::memset(c, 0, sizeof *c);
    c->out = out;
    c->nranges = nranges;
    c->occ_bits = 12; c->occ = (CntOcc*)calloc(1u << 12, sizeof(CntOcc));
    c->gt_bits = 12; c->gt = (CntSlot*)calloc(1u << 12, sizeof(CntSlot));
    c->g_cap = 1024; c->g = (CntGroup*)malloc(c->g_cap * sizeof(CntGroup));
    c->sec_bits = 14; c->sec = (CntSec*)calloc(1u << 14, sizeof(CntSec));
    c->st_cap = 256; c->st = (CntSite*)calloc(c->st_cap, sizeof(CntSite));
}

EMU_INTERNAL static void cnt_free(Count* c) {
    free(c->occ); free(c->gt); free(c->g); free(c->sec); free(c->st);
    c->occ = nullptr; c->gt = nullptr; c->g = nullptr; c->sec = nullptr; c->st = nullptr;
}

// The lane's occurrence number of `site` since the last barrier (0, 1, ...).
EMU_INTERNAL static unsigned cnt_occurrence(Count* c, unsigned long long site, int tid) {
    if (2 * (c->occ_used + 1) > (1u << c->occ_bits)) {  // grow: rehash into twice the slots
        const unsigned ob = c->occ_bits;
        CntOcc* old = c->occ;
        c->occ_bits = ob + 1;
        c->occ = (CntOcc*)calloc(1u << c->occ_bits, sizeof(CntOcc));
        for (unsigned i = 0; i < (1u << ob); i++) {
            if (!old[i].site) continue;
            unsigned h = cnt_hash(old[i].site ^ ((unsigned long long)old[i].tid << 48), c->occ_bits);
            while (c->occ[h].site) h = (h + 1) & ((1u << c->occ_bits) - 1);
            c->occ[h] = old[i];
        }
        free(old);
    }
    const unsigned mask = (1u << c->occ_bits) - 1;
    unsigned h = cnt_hash(site ^ ((unsigned long long)tid << 48), c->occ_bits);
    for (;;) {
        CntOcc& e = c->occ[h];
        if (!e.site) { e.site = site; e.tid = tid; e.n = 1; c->occ_used++; return 0; }
        if (e.site == site && e.tid == tid) return e.n++;
        h = (h + 1) & mask;
    }
}

EMU_INTERNAL static CntGroup* cnt_group(Count* c, int warp, unsigned long long site, unsigned occ, int store,
                                        int space, int range) {
    if (2 * (c->gt_used + 1) > (1u << c->gt_bits)) {
        const unsigned ob = c->gt_bits;
        CntSlot* old = c->gt;
        c->gt_bits = ob + 1;
        c->gt = (CntSlot*)calloc(1u << c->gt_bits, sizeof(CntSlot));
        for (unsigned i = 0; i < (1u << ob); i++) {
            if (!old[i].idx) continue;
            unsigned h = cnt_hash(old[i].site ^ ((unsigned long long)old[i].occ << 32) ^
                                  ((unsigned long long)old[i].warp << 56) ^ (unsigned long long)old[i].store,
                                  c->gt_bits);
            while (c->gt[h].idx) h = (h + 1) & ((1u << c->gt_bits) - 1);
            c->gt[h] = old[i];
        }
        free(old);
    }
    const unsigned mask = (1u << c->gt_bits) - 1;
    unsigned h = cnt_hash(site ^ ((unsigned long long)occ << 32) ^ ((unsigned long long)warp << 56) ^
                          (unsigned long long)store, c->gt_bits);
    for (;;) {
        CntSlot& e = c->gt[h];
        if (!e.idx) break;
        if (e.site == site && e.warp == warp && e.occ == occ && e.store == store) return &c->g[e.idx - 1];
        h = (h + 1) & mask;
    }
    if (c->ng == c->g_cap) {
        c->g_cap *= 2;
        c->g = (CntGroup*)realloc(c->g, c->g_cap * sizeof(CntGroup));
    }
    CntGroup* g = &c->g[c->ng++];
    g->site = site;
    g->lanes = 0;
    g->width = 0;
    g->space = space;
    g->store = store;
    g->range = range;
    CntSlot& e = c->gt[h];
    e.site = site; e.warp = warp; e.occ = occ; e.store = store; e.idx = (int)c->ng;
    c->gt_used++;
    return g;
}

// Distinct bytes per range: a byte mask per (range, 32-byte sector).
// kind: 0 load, 1 store, 2 a prefetch (only its pre-wait bit); pre: before the thread's pdl_wait.
EMU_INTERNAL static void cnt_bytes(Count* c, int range, unsigned long long a, unsigned long long n, int kind,
                                   bool pre) {
    for (unsigned long long s = a >> 5; s <= (a + n - 1) >> 5; s++) {
        const unsigned long long b0 = s << 5 > a ? s << 5 : a, b1 = (s << 5) + 32 < a + n ? (s << 5) + 32 : a + n;
        const unsigned bits = (unsigned)((b1 - b0 >= 32 ? 0xffffffffULL : ((1ULL << (b1 - b0)) - 1)) << (b0 & 31));
        if (2 * (c->sec_used + 1) > (1u << c->sec_bits)) {
            const unsigned ob = c->sec_bits;
            CntSec* old = c->sec;
            c->sec_bits = ob + 1;
            c->sec = (CntSec*)calloc(1u << c->sec_bits, sizeof(CntSec));
            for (unsigned i = 0; i < (1u << ob); i++) {
                if (!old[i].key) continue;
                unsigned h = cnt_hash(old[i].key, c->sec_bits);
                while (c->sec[h].key) h = (h + 1) & ((1u << c->sec_bits) - 1);
                c->sec[h] = old[i];
            }
            free(old);
        }
        const unsigned long long key = ((s << 7) | (unsigned long long)range) + 1;
        unsigned h = cnt_hash(key, c->sec_bits);
        const unsigned mask = (1u << c->sec_bits) - 1;
        while (c->sec[h].key && c->sec[h].key != key) h = (h + 1) & mask;
        CntSec& e = c->sec[h];
        if (!e.key) { e.key = key; c->sec_used++; }
        if (kind == 1) e.wr |= bits; else if (kind == 0) e.rd |= bits;
        if (pre) { if (kind == 1) e.pwr |= bits; else e.prd |= bits; }
    }
}

EMU_INTERNAL static void cnt_site(Count* c, const CntGroup& g, unsigned long long units, unsigned long long ideal,
                                  unsigned long long bytes) {
    const unsigned long long kind = (unsigned long long)g.store | ((unsigned long long)g.space << 1);
    unsigned i = 0;
    while (i < c->st_n && !(c->st[i].site == g.site && c->st[i].kind == kind)) i++;
    if (i == c->st_n) {
        if (c->st_n == c->st_cap) {
            c->st_cap *= 2;
            c->st = (CntSite*)realloc(c->st, c->st_cap * sizeof(CntSite));
        }
        CntSite& e = c->st[c->st_n++];
        std::memset(&e, 0, sizeof e);
        e.site = g.site;
        e.kind = kind;
    }
    CntSite& e = c->st[i];
    if (g.width > e.width) e.width = g.width;
    e.requests++;
    e.units += units;
    e.ideal += ideal;
    e.bytes += bytes;
}

// Counts the instructions gathered since the last barrier; starts a new interval.
EMU_INTERNAL static void cnt_flush(Count* c) {
    unsigned long long* o = c->out;
    for (unsigned i = 0; i < c->ng; i++) {
        const CntGroup& g = c->g[i];
        const unsigned w = g.width ? g.width : 1;
        const int active = __builtin_popcount(g.lanes);
        if (g.space == 0) {
            unsigned long long secs[96];
            int ns = 0;
            for (int l = 0; l < 32; l++) {
                if (!((g.lanes >> l) & 1u)) continue;
                for (unsigned long long s = g.addr[l] >> 5; s <= (g.addr[l] + w - 1) >> 5; s++) {
                    int j = 0;
                    while (j < ns && secs[j] != s) j++;
                    if (j == ns && ns < 96) secs[ns++] = s;
                }
            }
            o[g.store ? CNT_GST_REQ : CNT_GLD_REQ] += 1;
            o[g.store ? CNT_GST_SEC : CNT_GLD_SEC] += (unsigned long long)ns;
            o[g.store ? CNT_GST_BYTES : CNT_GLD_BYTES] += (unsigned long long)w * active;
            if (g.range >= 0 && g.range < c->nranges) {
                unsigned long long* pr = o + CNT_TOTALS + CNT_PER_RANGE * g.range + (g.store ? 6 : 4);
                pr[0] += 1;
                pr[1] += (unsigned long long)ns;
            }
            const unsigned long long nb = (unsigned long long)w * active;
            cnt_site(c, g, (unsigned long long)ns, (nb + 31) / 32, nb);
        } else {
            const int per_phase = w <= 4 ? 32 : (w <= 8 ? 16 : 8);
            unsigned long long wf = 0;
            for (int p0 = 0; p0 < 32; p0 += per_phase) {
                unsigned long long words[64];
                int nw = 0;
                for (int l = p0; l < p0 + per_phase; l++) {
                    if (!((g.lanes >> l) & 1u)) continue;
                    for (unsigned long long wd = g.addr[l] >> 2; wd <= (g.addr[l] + w - 1) >> 2; wd++) {
                        int j = 0;
                        while (j < nw && words[j] != wd) j++;
                        if (j == nw && nw < 64) words[nw++] = wd;
                    }
                }
                int per_bank[32] = {0};
                int most = 0;
                for (int j = 0; j < nw; j++) {
                    const int b = (int)(words[j] & 31);
                    if (++per_bank[b] > most) most = per_bank[b];
                }
                wf += (unsigned long long)most;
            }
            const unsigned long long ideal = ((unsigned long long)active * w + 127) / 128;
            o[g.store ? CNT_SST_REQ : CNT_SLD_REQ] += 1;
            o[g.store ? CNT_SST_WF : CNT_SLD_WF] += wf;
            o[g.store ? CNT_SST_IDEAL : CNT_SLD_IDEAL] += ideal ? ideal : 1;
            cnt_site(c, g, wf, ideal ? ideal : 1, (unsigned long long)w * active);
        }
    }
    c->ng = 0;
    if (c->gt_used) { std::memset(c->gt, 0, sizeof(CntSlot) << c->gt_bits); c->gt_used = 0; }
    if (c->occ_used) { std::memset(c->occ, 0, sizeof(CntOcc) << c->occ_bits); c->occ_used = 0; }
}

EMU_INTERNAL static void cnt_finish(Count* c, unsigned long long* sites_out, int max_sites) {
    cnt_flush(c);
    if (sites_out && max_sites > 0) {  // [0] = sites listed, then CNT_SITE_VALS per site
        const unsigned n = c->st_n < (unsigned)max_sites ? c->st_n : (unsigned)max_sites;
        sites_out[0] = c->st_n;
        for (unsigned i = 0; i < n; i++) {
            const CntSite& e = c->st[i];
            unsigned long long* v = sites_out + 1 + (unsigned long long)CNT_SITE_VALS * i;
            v[0] = e.site; v[1] = e.kind; v[2] = e.width; v[3] = e.requests; v[4] = e.units; v[5] = e.ideal;
            v[6] = e.bytes;
        }
    }
    for (unsigned i = 0; i < (1u << c->sec_bits); i++) {
        const CntSec& e = c->sec[i];
        if (!e.key) continue;
        const int r = (int)((e.key - 1) & 127);
        if (r >= c->nranges) continue;
        unsigned long long* pr = c->out + CNT_TOTALS + CNT_PER_RANGE * r;
        pr[2] += (unsigned long long)__builtin_popcount(e.rd);
        pr[3] += (unsigned long long)__builtin_popcount(e.wr);
    }
}

// 0 global (range in *range), 1 shared, 2 the lane's own stack, 3 anything else.
EMU_INTERNAL static inline int cnt_space(const MemTable* t, const Fiber* f, unsigned long long a, int* range) {
    for (int i = 0; i < t->n; i++)
        if (a >= t->r[i].d0 && a < t->r[i].d1) { *range = t->r[i].arg; return 0; }
    for (int i = 0; i < t->nsh; i++)
        if (a - t->sh[i].lo < t->sh[i].len) return 1;
    if (f->stack && a - (unsigned long long)f->stack < STACK_BYTES) return 2;
    // threadIdx, blockIdx, blockDim, gridDim: special registers on the GPU
    if (a == (unsigned long long)&tl_fiber || a == (unsigned long long)&tl_block) return 2;
    const Block* b = tl_block;
    if (b && (a - (unsigned long long)b->fibers < (unsigned long long)b->nthreads * sizeof(Fiber) ||
              a - (unsigned long long)b < sizeof(Block)))
        return 2;
    return 3;
}

EMU_INTERNAL static void cnt_record(Count* c, Fiber* f, unsigned long long a, unsigned long long n, bool store,
                                    int space, int range, unsigned long long site) {
    if (space == 0 && range < c->nranges) {
        c->out[CNT_TOTALS + CNT_PER_RANGE * range + (store ? 1 : 0)] += n;
        cnt_bytes(c, range, a, n, store ? 1 : 0, !f->pdl_waited);
    }
    const unsigned occ = cnt_occurrence(c, site, f->tid);
    CntGroup* g = cnt_group(c, f->tid >> 5, site, occ, store, space, range);
    const int lane = f->tid & 31;
    g->addr[lane] = a;
    g->lanes |= 1u << lane;
    if (n > g->width) g->width = (unsigned)n;
}

// An access seen by the memory checks (counter mode on).
EMU_INTERNAL __attribute__((noinline)) static void count_access(unsigned long long a, unsigned long long n,
                                                                bool store, unsigned long long site) {
    MemTable* t = tl_mem;
    Fiber* f = tl_fiber;
    Count* c = (Count*)tl_cnt;
    if (!t || !f || !c || f->cnt_mute || !n) return;
    int range = -1;
    const int space = cnt_space(t, f, a, &range);
    if (space == 2) return;
    if (space == 3) { c->out[CNT_OTHER_ACC]++; c->out[CNT_OTHER_BYTES] += n; return; }
    const int k = store ? 1 : 0;
    if (f->cv_left[k]) {  // a piece of the vector access just counted
        if (a >= f->cv_lo[k] && a + n <= f->cv_hi[k]) {
            f->cv_left[k] = f->cv_left[k] > n ? f->cv_left[k] - n : 0;
            return;
        }
        f->cv_left[k] = 0;
    }
    cnt_record(c, f, a, n, store, space, range, site);
}

__attribute__((noinline)) EMU_INTERNAL static void count_vector(const void* p, unsigned n, bool store) {
    MemTable* t = tl_mem;
    Fiber* f = tl_fiber;
    Count* c = (Count*)tl_cnt;
    if (!t || !f || !c || f->cnt_mute) return;
    const unsigned long long a = (unsigned long long)p;
    int range = -1;
    const int space = cnt_space(t, f, a, &range);
    if (space == 2) return;
    if (space == 3) { c->out[CNT_OTHER_ACC]++; c->out[CNT_OTHER_BYTES] += n; return; }
    const int k = store ? 1 : 0;
    f->cv_lo[k] = a;
    f->cv_hi[k] = a + n;
    f->cv_left[k] = n;
    cnt_record(c, f, a, n, store, space, range, (unsigned long long)__builtin_return_address(0));
}

// ldmatrix.x4: each lane's 16-byte row, one shared-memory instruction; the
// emulation's gathers that follow (until emu_ldmatrix_end) are not counted.
__attribute__((noinline)) EMU_INTERNAL static void count_ldmatrix(const void* row) {
    MemTable* t = tl_mem;
    Fiber* f = tl_fiber;
    Count* c = (Count*)tl_cnt;
    if (!t || !f || !c) return;
    int range = -1;
    const unsigned long long a = (unsigned long long)row;
    const int space = cnt_space(t, f, a, &range);
    if (space == 0 || space == 1)
        cnt_record(c, f, a, 16, false, space, range, (unsigned long long)__builtin_return_address(0));
    f->cnt_mute = 1;
}

// The sector table of the current counted launch, for emu_pdl_export (set per launch).
static thread_local unsigned long long* tl_pdl_out;
static thread_local unsigned long long tl_pdl_cap;

// [0] = entries, then 3 per (range, sector): address of the sector, rd | wr << 32, prd | pwr << 32.
EMU_INTERNAL static void pdl_export(const Count* c) {
    unsigned long long* o = tl_pdl_out;
    if (!o) return;
    unsigned long long n = 0;
    for (unsigned i = 0; i < (1u << c->sec_bits); i++) {
        const CntSec& e = c->sec[i];
        if (!e.key) continue;
        if (n < tl_pdl_cap) {
            unsigned long long* v = o + 1 + 3 * n;
            v[0] = ((e.key - 1) >> 7) << 5;
            v[1] = (unsigned long long)e.rd | ((unsigned long long)e.wr << 32);
            v[2] = (unsigned long long)e.prd | ((unsigned long long)e.pwr << 32);
        }
        n++;
    }
    o[0] = n;
    tl_pdl_out = nullptr;
}

EMU_INTERNAL static void count_barrier() {
    Count* c = (Count*)tl_cnt;
    c->out[CNT_BARRIERS]++;
    cnt_flush(c);
}

EMU_INTERNAL static void count_mma() { ((Count*)tl_cnt)->out[CNT_MMA]++; }

// ---------------------------------------------------------------- wgmma
// wgmma.mma_async (cuda_src/wgmma.cuh), the register-A / shared-B form, f32 accumulators.
// On the GPU the MMA runs asynchronously between its issue and the wgmma.wait_group that
// retires its commit group; the emulator must not be kinder than that, so:
//  - issue is a warp collective (all 32 lanes, like mma.sync): the warp's A tile (16 x 16, its
//    rows of the warpgroup's 64), the descriptor, N, the type and scale_d are recorded once
//    per warp, checked (descriptor fields, shared-memory bounds of every core matrix it
//    names, agreement of the lanes, a whole number of warpgroups in the block, a
//    wgmma_fence since the thread last had nothing in flight), and each lane notes the record
//    and its accumulator pointer in its own pending list, tagged with its open group;
//  - commit_group closes the thread's open group; wait_group<n> computes, for that thread
//    only, its accumulators of every wgmma in its committed groups but the newest n, oldest
//    first, reading B from shared memory then: d read before the wait is the old value, and
//    B overwritten before the wait changes the result (as it may on the GPU);
//  - a thread that exits with wgmmas in flight (not waited for, or never committed) fails
//    the launch, and so does a wait that finds the thread's A registers or accumulators of a
//    wgmma it retires changed since the issue (written too early; reads cannot be seen, but
//    they see the old values).
// Arithmetic: per element and k16 step, D = (scale_d ? D : 0) + sum of 16 products, in double
// with one rounding to f32 (resolve_mma's rule; the hardware's f32 accumulation differs in the
// last bits). Descriptor addresses are offsets in a shared-memory window the emulator lays out
// per block: the block's shared arrays (static, then the extern buffer, as noted before the
// block) one after another, 16-byte aligned as their host addresses are.
// Not checked: fence.proxy.async between generic smem writes and the wgmma (a no-op here),
// that the 4 warps of a warpgroup issue the same sequence, register reuse between a wgmma and
// the wgmma_fence that should precede it once the thread has wgmmas in flight.
// Per thread: 2 commit groups of gemm_wgmma.cu with hi + lo, 2 sets and 4 chunks are 128.
enum : int { WG_MAX_PENDING = 256 };
struct WgLaneArgs {  // one lane's operands at issue
    float* d;
    const unsigned int* a;
    unsigned long long desc;
    int n, bf16, scale_d;
};
struct WgRec {  // one warp's share of one wgmma, referenced by its 32 lanes until they retire it
    unsigned short a[16][16];
    unsigned long long desc;
    int n, bf16, scale_d, refs, next_free;
};
struct WgPend {  // one wgmma in flight, as one thread sees it
    int rec;
    unsigned grp;
    float* d;
    const unsigned int* a;
    unsigned int a_copy[4];       // a's registers at issue: they must not change before the wait
    unsigned long long d_hash;    // d's bits as the wgmma will read them (see wg_hash)
};
struct WgThread {
    WgPend p[WG_MAX_PENDING];
    int np;
    unsigned cur;  // the open group's number; groups below it are committed
    int fenced;
};
struct WgState {
    WgRec* recs;
    int nrec, cap, free_head;
    WgThread* th;
    int nth;
};
static thread_local WgState* tl_wg;

// The shared-memory window: region i of tl_mem->sh starts at window offset *vbase.
EMU_INTERNAL static bool wg_window(int i, unsigned long long* vbase) {
    const MemTable* t = tl_mem;
    if (!t || i >= t->nsh) return false;
    unsigned long long acc = 0;
    for (int j = 0; j <= i; j++) {
        const unsigned long long vb = ((acc + 15) & ~15ULL) + (t->sh[j].lo & 15);
        if (j == i) { *vbase = vb; return true; }
        acc = vb + t->sh[j].len;
    }
    return false;
}

EMU_INTERNAL [[noreturn]] static void wg_abort(const char* what) {
    char m[640], w[96];
    where_str(w, sizeof w);
    snprintf(m, sizeof m, "%s %s", what, w);
    abort_launch(m);
}

EMU_INTERNAL static unsigned long long wg_make_desc(const void* p, unsigned lbo, unsigned sbo) {
    const MemTable* t = tl_mem;
    const unsigned long long a = (unsigned long long)p;
    char m[400];
    int region = -1;
    for (int i = 0; t && i < t->nsh; i++)
        if (a - t->sh[i].lo < t->sh[i].len) { region = i; break; }
    if (region < 0) {
        snprintf(m, sizeof m, "wgmma descriptor: address 0x%llx is not in shared memory (B must be in a "
                 "__shared__ array or the extern __shared__ buffer)", a);
        wg_abort(m);
    }
    if (a % 16 || lbo % 16 || sbo % 16) {
        snprintf(m, sizeof m, "wgmma descriptor: start address (%% 16 = %llu), LBO %u and SBO %u bytes must be "
                 "multiples of 16 (the descriptor drops their low 4 bits)", a % 16, lbo, sbo);
        wg_abort(m);
    }
    if (lbo >= (1u << 18) || sbo >= (1u << 18)) {
        snprintf(m, sizeof m, "wgmma descriptor: LBO %u / SBO %u bytes do not fit the 14-bit fields (< 262144)",
                 lbo, sbo);
        wg_abort(m);
    }
    unsigned long long vb = 0;
    wg_window(region, &vb);
    const unsigned long long v = vb + (a - t->sh[region].lo);
    if (v >= (1ULL << 18)) wg_abort("wgmma descriptor: the block's shared memory exceeds the 256 KiB window");
    return (v >> 4) | ((unsigned long long)(lbo >> 4) << 16) | ((unsigned long long)(sbo >> 4) << 32);
}

// The host address of B's first core matrix; checks the fields and that every byte the
// wgmma reads lies in one shared array. Returns null (message in *m) on a bad descriptor.
EMU_INTERNAL static const unsigned char* wg_decode(unsigned long long desc, int n, unsigned* lbo, unsigned* sbo,
                                                   char* m, size_t mlen) {
    const unsigned long long reserved = desc & ~((0x3FFFULL) | (0x3FFFULL << 16) | (0x3FFFULL << 32) |
                                                 (7ULL << 49) | (3ULL << 62));
    if (desc >> 62) {
        snprintf(m, mlen, "wgmma descriptor 0x%016llx: swizzle mode %llu (bits 62-63); only 0 (no swizzle) is "
                 "supported", desc, desc >> 62);
        return nullptr;
    }
    if (reserved || ((desc >> 49) & 7)) {
        snprintf(m, mlen, "wgmma descriptor 0x%016llx: unused bits or the base offset (bits 49-51, no "
                 "meaning without swizzle) are set", desc);
        return nullptr;
    }
    const unsigned long long start = (desc & 0x3FFF) << 4;
    *lbo = (unsigned)(((desc >> 16) & 0x3FFF) << 4);
    *sbo = (unsigned)(((desc >> 32) & 0x3FFF) << 4);
    const MemTable* t = tl_mem;
    for (int i = 0; t && i < t->nsh; i++) {
        unsigned long long vb = 0;
        wg_window(i, &vb);
        if (start < vb || start - vb >= t->sh[i].len) continue;
        const unsigned long long off = start - vb;
        const unsigned long long end = off + (unsigned long long)(n / 8 - 1) * *sbo + *lbo + 128;
        if (end > t->sh[i].len) {
            snprintf(m, mlen, "wgmma descriptor 0x%016llx: B (n=%d, LBO %u, SBO %u) reads bytes [%llu, %llu) of "
                     "a %llu-byte shared array", desc, n, *lbo, *sbo, off, end, t->sh[i].len);
            return nullptr;
        }
        return (const unsigned char*)(t->sh[i].lo + off);
    }
    snprintf(m, mlen, "wgmma descriptor 0x%016llx: start address 0x%llx is in none of the block's shared "
             "arrays", desc, start);
    return nullptr;
}

// The accumulators' bits, hashed (FNV-1a): a write to d between a wgmma and its wait shows as
// a changed hash at the wait without keeping a copy of up to 128 registers per wgmma.
EMU_INTERNAL static unsigned long long wg_hash(const float* d, int n) {
    unsigned long long h = 0xcbf29ce484222325ULL;
    for (int i = 0; i < n; i++) {
        unsigned u;
        std::memcpy(&u, d + i, 4);
        h = (h ^ u) * 0x100000001b3ULL;
    }
    return h;
}

EMU_INTERNAL static WgState* wg_state(int nthreads) {
    WgState* s = tl_wg;
    if (!s) {
        s = (WgState*)calloc(1, sizeof(WgState));
        s->free_head = -1;
        tl_wg = s;
    }
    if (s->nth < nthreads) {
        free(s->th);
        s->th = (WgThread*)calloc((size_t)nthreads, sizeof(WgThread));
        s->nth = nthreads;
    }
    return s;
}

EMU_INTERNAL static void wg_block_start(Block* b) {
    WgState* s = tl_wg;
    if (!s) return;  // no wgmma in this module on this OS thread yet
    wg_state(b->nthreads);
    for (int i = 0; i < b->nthreads; i++) { s->th[i].np = 0; s->th[i].cur = 0; s->th[i].fenced = 0; }
    s->nrec = 0;
    s->free_head = -1;
}

EMU_INTERNAL static int wg_alloc(WgState* s) {
    if (s->free_head >= 0) {
        const int r = s->free_head;
        s->free_head = s->recs[r].next_free;
        return r;
    }
    if (s->nrec == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 64;
        s->recs = (WgRec*)realloc(s->recs, (size_t)s->cap * sizeof(WgRec));
    }
    return s->nrec++;
}

EMU_INTERNAL static void resolve_wgmma(Block* b, int wi, Warp& w) {
    char m[400];
    if (b->nthreads % 128) {
        snprintf(m, sizeof m, "wgmma.mma_async in warp %d of a block of %d threads: a warpgroup is 4 whole "
                 "warps, so the block needs a multiple of 128 threads", wi, b->nthreads);
        fail(b, m);
        return;
    }
    const WgLaneArgs* l0 = (const WgLaneArgs*)(unsigned long long)w.in[0];
    for (int l = 1; l < 32; l++) {
        const WgLaneArgs* x = (const WgLaneArgs*)(unsigned long long)w.in[l];
        if (x->desc != l0->desc || x->n != l0->n || x->bf16 != l0->bf16 || (x->scale_d != 0) != (l0->scale_d != 0)) {
            snprintf(m, sizeof m, "wgmma.mma_async in warp %d: lane %d passes descriptor 0x%016llx, scale_d %d, "
                     "while lane 0 passes 0x%016llx, %d (they must agree)", wi, l, x->desc, x->scale_d,
                     l0->desc, l0->scale_d);
            fail(b, m);
            return;
        }
    }
    unsigned lbo, sbo;
    if (!wg_decode(l0->desc, l0->n, &lbo, &sbo, m, sizeof m)) { fail(b, m); return; }
    WgState* s = wg_state(b->nthreads);
    for (int l = 0; l < 32; l++) {
        const WgThread& th = s->th[wi * 32 + l];
        if (th.np == 0 && !th.fenced) {
            snprintf(m, sizeof m, "wgmma.mma_async in warp %d: thread %d issues it without a wgmma_fence() "
                     "since it last had no wgmma in flight", wi, wi * 32 + l);
            fail(b, m);
            return;
        }
        if (th.np == WG_MAX_PENDING) {
            snprintf(m, sizeof m, "wgmma.mma_async in warp %d: thread %d has %d wgmmas in flight (the "
                     "emulator's limit; wait for some)", wi, wi * 32 + l, WG_MAX_PENDING);
            fail(b, m);
            return;
        }
    }
    const int r = wg_alloc(s);
    WgRec& rec = s->recs[r];
    for (int l = 0; l < 32; l++) {
        const WgLaneArgs* x = (const WgLaneArgs*)(unsigned long long)w.in[l];
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 8; i++) {
            const unsigned reg = x->a[i >> 1];
            rec.a[g + ((i & 2) ? 8 : 0)][t * 2 + (i & 1) + ((i & 4) ? 8 : 0)] =
                (unsigned short)((i & 1) ? reg >> 16 : reg & 0xffffu);
        }
    }
    rec.desc = l0->desc;
    rec.n = l0->n;
    rec.bf16 = l0->bf16;
    rec.scale_d = l0->scale_d != 0;
    rec.refs = 32;
    for (int l = 0; l < 32; l++) {
        WgThread& th = s->th[wi * 32 + l];
        const WgLaneArgs* x = (const WgLaneArgs*)(unsigned long long)w.in[l];
        WgPend& e = th.p[th.np++];
        e.rec = r;
        e.grp = th.cur;
        e.d = x->d;
        e.a = x->a;
        for (int i = 0; i < 4; i++) e.a_copy[i] = x->a[i];
        e.d_hash = wg_hash(x->d, l0->n / 2);
    }
    if (EMU_COUNTERS && g_counting && tl_cnt) {
        unsigned long long* o = ((Count*)tl_cnt)->out;
        o[CNT_WGMMA_MMA] += (unsigned long long)(l0->n / 8);  // this warp's m16n8k16 equivalents
        if (wi % 4 == 0) {  // once per warpgroup instruction: its first warp
            o[CNT_WGMMA]++;
            o[CNT_WGMMA_SMEM_BYTES] += 32ULL * (unsigned long long)l0->n;  // B: N x 16 x 2 bytes
        }
    }
}

// Computes thread `tid`'s accumulators of its wgmmas in groups below `limit`, oldest first.
// Its A registers and accumulators must be as the wgmma left them (on the GPU the MMA reads
// and writes them until the wait: changing them before is undefined).
EMU_INTERNAL static void wg_retire(WgState* s, int tid, unsigned limit) {
    WgThread& th = s->th[tid];
    const int g = (tid & 31) >> 2, t = tid & 3;
    int kept = 0;
    char m[400];
    for (int p = 0; p < th.np; p++) {
        WgPend& e = th.p[p];
        if (e.grp >= limit) { th.p[kept++] = e; continue; }
        WgRec& rec = s->recs[e.rec];
        for (int i = 0; i < 4; i++)
            if (e.a[i] != e.a_copy[i]) {
                snprintf(m, sizeof m, "wgmma_wait_group: a[%d] of a wgmma in flight changed from 0x%08x to 0x%08x "
                         "before the wait that retires it (the MMA reads A's registers until then)", i,
                         e.a_copy[i], e.a[i]);
                wg_abort(m);
            }
        if (wg_hash(e.d, rec.n / 2) != e.d_hash) {
            snprintf(m, sizeof m, "wgmma_wait_group: the accumulators of a wgmma in flight (n=%d) were written "
                     "before the wait that retires it (the MMA owns them until then)", rec.n);
            wg_abort(m);
        }
        unsigned lbo, sbo;
        const unsigned char* bp = wg_decode(rec.desc, rec.n, &lbo, &sbo, m, sizeof m);
        if (!bp) wg_abort(m);  // the shared arrays cannot change within a block: not reached
        const int bf = rec.bf16;
        auto elem = [bf](unsigned short h) { return bf ? bf16_bits_to_f32(h) : f16_bits_to_f32(h); };
        float* d = e.d;
        const unsigned long long before = e.d_hash;
        for (int j = 0; j < rec.n / 8; j++)
            for (int i = 0; i < 4; i++) {
                const int row = g + ((i & 2) ? 8 : 0), col = 8 * j + 2 * t + (i & 1);
                double acc = rec.scale_d ? (double)d[4 * j + i] : 0.0;
                for (int k = 0; k < 16; k++) {
                    unsigned short h;
                    std::memcpy(&h, bp + (col / 8) * sbo + (k / 8) * lbo + (col % 8) * 16 + (k % 8) * 2, 2);
                    acc += (double)elem(rec.a[row][k]) * (double)elem(h);
                }
                d[4 * j + i] = (float)acc;
            }
        // Later wgmmas into the same registers, issued while this one was in flight, read them
        // as this one leaves them.
        const unsigned long long after = wg_hash(d, rec.n / 2);
        for (int q = p + 1; q < th.np; q++)
            if (th.p[q].d == d && th.p[q].d_hash == before) th.p[q].d_hash = after;
        if (--rec.refs == 0) { rec.next_free = s->free_head; s->free_head = e.rec; }
    }
    th.np = kept;
    if (kept == 0) th.fenced = 0;
}

EMU_INTERNAL static void wg_thread_exit(Block* b, Fiber* f) {
    WgState* s = tl_wg;
    if (!s || f->tid >= s->nth || !s->th[f->tid].np) return;
    const WgThread& th = s->th[f->tid];
    int open = 0;
    for (int p = 0; p < th.np; p++) open += th.p[p].grp == th.cur;
    char m[400];
    snprintf(m, sizeof m, "thread (%u,%u,%u) of block (%u,%u,%u) exits with %d wgmma(s) in flight (%d never "
             "committed): wgmma_commit_group() and wgmma_wait_group<0>() must retire every wgmma before the "
             "kernel ends", f->tidx.x, f->tidx.y, f->tidx.z, b->bidx.x, b->bidx.y, b->bidx.z, th.np, open);
    fail(b, m);
}
}  // namespace emu

#define EMU_ASAN_CB(EmuN) \
    extern "C" __attribute__((visibility("hidden"))) EMU_INTERNAL void __asan_load##EmuN##_noabort(void* p) { \
        ::emu::check_access((unsigned long long)p, EmuN, false); \
        if (EMU_COUNTERS && ::emu::tl_mem && ::emu::tl_mem->count) \
            ::emu::count_access((unsigned long long)p, EmuN, false, (unsigned long long)__builtin_return_address(0)); } \
    extern "C" __attribute__((visibility("hidden"))) EMU_INTERNAL void __asan_store##EmuN##_noabort(void* p) { \
        ::emu::check_access((unsigned long long)p, EmuN, true); \
        if (EMU_COUNTERS && ::emu::tl_mem && ::emu::tl_mem->count) \
            ::emu::count_access((unsigned long long)p, EmuN, true, (unsigned long long)__builtin_return_address(0)); }
EMU_ASAN_CB(1) EMU_ASAN_CB(2) EMU_ASAN_CB(4) EMU_ASAN_CB(8) EMU_ASAN_CB(16)
#undef EMU_ASAN_CB
extern "C" __attribute__((visibility("hidden"))) EMU_INTERNAL void __asan_loadN_noabort(void* p, long n) {
    ::emu::check_access((unsigned long long)p, (unsigned long long)n, false);
    if (EMU_COUNTERS && ::emu::tl_mem && ::emu::tl_mem->count)
        ::emu::count_access((unsigned long long)p, (unsigned long long)n, false,
                            (unsigned long long)__builtin_return_address(0));
}
extern "C" __attribute__((visibility("hidden"))) EMU_INTERNAL void __asan_storeN_noabort(void* p, long n) {
    ::emu::check_access((unsigned long long)p, (unsigned long long)n, true);
    if (EMU_COUNTERS && ::emu::tl_mem && ::emu::tl_mem->count)
        ::emu::count_access((unsigned long long)p, (unsigned long long)n, true,
                            (unsigned long long)__builtin_return_address(0));
}
extern "C" __attribute__((visibility("hidden"))) EMU_INTERNAL void __asan_handle_no_return() {}

namespace emu {
static thread_local void* tl_fault_addr;
static thread_local int tl_fault_sig;
static struct sigaction old_actions[3];
static const int fault_sigs[3] = {SIGSEGV, SIGBUS, SIGFPE};

EMU_INTERNAL static void fault_handler(int sig, siginfo_t* si, void* ctx) {
    sigjmp_buf* j = tl_fault_jmp;
    if (j) {
        tl_fault_jmp = nullptr;
        tl_fault_addr = si->si_addr;
        tl_fault_sig = sig;
        siglongjmp(*j, JUMP_FAULT);
    }
    // Not ours: hand over to whoever was installed before (Python's faulthandler, default).
    for (int i = 0; i < 3; i++) {
        if (fault_sigs[i] != sig) continue;
        struct sigaction* o = &old_actions[i];
        if ((o->sa_flags & SA_SIGINFO) && o->sa_sigaction) { o->sa_sigaction(sig, si, ctx); return; }
        if (o->sa_handler != SIG_DFL && o->sa_handler != SIG_IGN) { o->sa_handler(sig); return; }
        sigaction(sig, o, nullptr);  // default action when the faulting instruction re-executes
    }
}

EMU_INTERNAL static void install_fault_handlers() {
    static std::atomic<bool> installed(false);
    bool expected = false;
    if (installed.compare_exchange_strong(expected, true)) {
        for (int i = 0; i < 3; i++) {
            struct sigaction sa;
            std::memset(&sa, 0, sizeof sa);
            sa.sa_sigaction = fault_handler;
            sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
            sigemptyset(&sa.sa_mask);
            sigaction(fault_sigs[i], &sa, &old_actions[i]);
        }
    }
    static thread_local bool alt_done = false;
    if (!alt_done) {  // a fiber stack overflow needs somewhere else to run the handler
        static thread_local char* alt = nullptr;
        const size_t sz = 64 * 1024;
        alt = (char*)mmap(nullptr, sz, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        stack_t ss;
        ss.ss_sp = alt;
        ss.ss_size = sz;
        ss.ss_flags = 0;
        sigaltstack(&ss, nullptr);
        alt_done = true;
    }
}

struct LaunchResult {
    int status;  // 0 ok, 1 error message, 2 fault
    void* fault_addr;
    int fault_sig;
};

// Runs blocks [first, grid_total) with stride `stride` on the calling OS thread.
EMU_INTERNAL static void run_blocks(void (*body)(void**), void** args, const unsigned* grid, const unsigned* block,
                       void (*poison)(unsigned), unsigned shmem, unsigned long long seed, int order,
                       unsigned long long first, unsigned long long stride, const StackArena& stacks,
                       const unsigned long long* ranges, const char* const* names, int nranges,
                       char* err, int errlen, LaunchResult* res,
                       const unsigned long long* ids = nullptr, unsigned long long n_ids = 0,
                       Count* cnt = nullptr) {
    install_fault_handlers();
    const int nt = (int)(block[0] * block[1] * block[2]);
    std::vector<Fiber> fibers((size_t)nt);
    std::vector<Warp> warps((size_t)((nt + 31) / 32));
    Block b;
    std::memset(&b, 0, sizeof b);
    b.bdim = make_uint3(block[0], block[1], block[2]);
    b.gdim = make_uint3(grid[0], grid[1], grid[2]);
    b.nthreads = nt;
    b.fibers = fibers.data();
    b.warps = warps.data();
    b.body = body;
    b.args = args;
    b.err = err;
    b.errlen = errlen;
    const unsigned long long total = (unsigned long long)grid[0] * grid[1] * grid[2];
    sigjmp_buf jb;
    volatile unsigned long long cur = first;
    MemTable mem;
    build_mem_table(&mem, ranges, names, nranges);
    const int jumped = sigsetjmp(jb, 1);
    if (jumped) {
        tl_mem = nullptr;
        tl_cnt = nullptr;
        if (jumped == JUMP_REPORT) {  // a memory check failed; the message is in err
            res->status = 1;
        } else {
            res->status = 2;
            res->fault_addr = tl_fault_addr;
            res->fault_sig = tl_fault_sig;
            unsigned long long c = cur;
            int n = snprintf(err, (size_t)errlen, "block (%llu,%llu,%llu)", c % grid[0], (c / grid[0]) % grid[1],
                             c / ((unsigned long long)grid[0] * grid[1]));
            if (tl_fiber && n < errlen)
                snprintf(err + n, (size_t)(errlen - n), " thread (%u,%u,%u)", tl_fiber->tidx.x, tl_fiber->tidx.y,
                         tl_fiber->tidx.z);
        }
        tl_block = nullptr;
        tl_fiber = nullptr;
        return;
    }
    tl_mem = &mem;
    tl_fault_jmp = &jb;
    tl_block = &b;
    mem.count = cnt != nullptr;
    tl_cnt = cnt;
    // A list of blocks (counter mode's sample) or first, first + stride, ...
    const unsigned long long end = ids ? n_ids : total, step = ids ? 1 : stride;
    for (unsigned long long j = ids ? 0 : first; j < end; j += step) {
        const unsigned long long i = ids ? ids[j] : j;
        cur = i;
        b.bidx.x = (unsigned)(i % grid[0]);
        b.bidx.y = (unsigned)((i / grid[0]) % grid[1]);
        b.bidx.z = (unsigned)(i / ((unsigned long long)grid[0] * grid[1]));
        Rng rng{seed ^ (0x9e3779b97f4a7c15ULL * (i + 1))};
        mem.nsh = 0;
        mem.yield = order == ORDER_SHUFFLE;
        mem.yrng = rng.next() | 1;
        if (poison) poison(shmem);
        if (!run_block(&b, order, rng, stacks)) { res->status = 1; break; }
        if (cnt) {
            cnt_flush(cnt);
            cnt->out[CNT_BLOCKS]++;
            if (b.pdl_waited) cnt->out[CNT_PDL_WAITED_BLOCKS]++;
        }
    }
    tl_fault_jmp = nullptr;
    tl_cnt = nullptr;
    tl_mem = nullptr;
    tl_block = nullptr;
    tl_fiber = nullptr;
}

// Runs blocks first, first+stride, ... of a launch on the calling OS thread;
// the Python side spreads a launch over its persistent worker threads, each
// with its own stack arena (shared memory is per OS thread too).
EMU_INTERNAL static int launch(void (*body)(void**), void** args, const unsigned* grid, const unsigned* block,
                  void (*poison)(unsigned), unsigned shmem, unsigned long long seed, int order,
                  unsigned long long first, unsigned long long stride, void* stack_base, int stack_count,
                  unsigned long long stack_stride, const unsigned long long* ranges, const char* const* names,
                  int nranges, char* err, int errlen, void** fault_addr, int* fault_sig) {
    LaunchResult res{0, nullptr, 0};
    const StackArena stacks{(char*)stack_base, stack_count, (size_t)stack_stride};
    run_blocks(body, args, grid, block, poison, shmem, seed, order, first, stride, stacks, ranges, names, nranges,
               err, errlen, &res);
    *fault_addr = res.fault_addr;
    *fault_sig = res.fault_sig;
    return res.status;
}

// Counter mode: runs blocks ids[0..n_ids) (linear block numbers) of a launch on the
// calling OS thread and adds its counts to `out` (CNT_TOTALS values, then
// CNT_PER_RANGE per range). Results of the blocks not run are not written.
EMU_INTERNAL static int launch_counted(void (*body)(void**), void** args, const unsigned* grid,
                  const unsigned* block, void (*poison)(unsigned), unsigned shmem, unsigned long long seed,
                  int order, const unsigned long long* ids, unsigned long long n_ids, void* stack_base,
                  int stack_count, unsigned long long stack_stride, const unsigned long long* ranges,
                  const char* const* names, int nranges, char* err, int errlen, void** fault_addr,
                  int* fault_sig, unsigned long long* out, unsigned long long* sites_out, int max_sites) {
    LaunchResult res{0, nullptr, 0};
    const StackArena stacks{(char*)stack_base, stack_count, (size_t)stack_stride};
    Count cnt;
    cnt_init(&cnt, out, nranges);
    __atomic_fetch_add(&g_counting, 1, __ATOMIC_RELAXED);
    run_blocks(body, args, grid, block, poison, shmem, seed, order, 0, 1, stacks, ranges, names, nranges,
               err, errlen, &res, ids, n_ids, &cnt);
    __atomic_fetch_sub(&g_counting, 1, __ATOMIC_RELAXED);
    if (res.status == 0) {
        cnt_finish(&cnt, sites_out, max_sites);
        pdl_export(&cnt);
    }
    tl_pdl_out = nullptr;
    cnt_free(&cnt);
    *fault_addr = res.fault_addr;
    *fault_sig = res.fault_sig;
    return res.status;
}

}  // namespace emu
// Counter mode: the next counted launch on this OS thread writes its sector table to `out`
// (cap entries at most; out[0] = the entries it has, which may exceed cap).
extern "C" __attribute__((visibility("default"))) EMU_INTERNAL void emu_pdl_export(unsigned long long* out,
                                                                                   unsigned long long cap) {
    emu::tl_pdl_out = out;
    emu::tl_pdl_cap = cap;
}
namespace emu {
template <typename EmuT> static inline unsigned long long to_bits(EmuT v) {
    static_assert(sizeof(EmuT) <= 8, "warp collectives move at most 8 bytes");
    unsigned long long u = 0;
    std::memcpy(&u, &v, sizeof(EmuT));
    return u;
}
template <typename EmuT> static inline EmuT from_bits(unsigned long long u) {
    EmuT v;
    std::memcpy(&v, &u, sizeof(EmuT));
    return v;
}
}  // namespace emu

// ---------------------------------------------------------------- built-ins
#define threadIdx (::emu::tl_fiber->tidx)
#define blockIdx (::emu::tl_block->bidx)
#define blockDim (::emu::tl_block->bdim)
#define gridDim (::emu::tl_block->gdim)

static inline void __syncthreads() {
    emu::Block* b = emu::tl_block;
    emu::Fiber* f = emu::tl_fiber;
    f->state = emu::AT_BARRIER;
    if (++b->bar_arrived == b->live) emu::release_barrier(b);
    emu::switch_to_scheduler();
}
static inline int emu_sync_count(int pred) {
    emu::Block* b = emu::tl_block;
    emu::Fiber* f = emu::tl_fiber;
    f->state = emu::AT_BARRIER;
    b->bar_count += pred != 0;
    if (++b->bar_arrived == b->live) emu::release_barrier(b);
    emu::switch_to_scheduler();
    return f->bar_result;
}
static inline int __syncthreads_count(int pred) { return emu_sync_count(pred); }
static inline int __syncthreads_or(int pred) { return emu_sync_count(pred) != 0; }
static inline int __syncthreads_and(int pred) {
    const int live = emu::tl_block->live;
    return emu_sync_count(pred) == live;
}
static inline void __syncwarp(unsigned int mask = 0xffffffffu) {
    emu::warp_collective(emu::OP_SYNCWARP, 0, 0, 32, mask);
}
template <typename EmuT> static inline EmuT __shfl_sync(unsigned int mask, EmuT v, int src, int width = 32) {
    return emu::from_bits<EmuT>(emu::warp_collective(emu::OP_SHFL_IDX, emu::to_bits(v), src, width, mask));
}
template <typename EmuT> static inline EmuT __shfl_up_sync(unsigned int mask, EmuT v, unsigned int d, int width = 32) {
    return emu::from_bits<EmuT>(emu::warp_collective(emu::OP_SHFL_UP, emu::to_bits(v), (int)d, width, mask));
}
template <typename EmuT> static inline EmuT __shfl_down_sync(unsigned int mask, EmuT v, unsigned int d, int width = 32) {
    return emu::from_bits<EmuT>(emu::warp_collective(emu::OP_SHFL_DOWN, emu::to_bits(v), (int)d, width, mask));
}
template <typename EmuT> static inline EmuT __shfl_xor_sync(unsigned int mask, EmuT v, int m, int width = 32) {
    return emu::from_bits<EmuT>(emu::warp_collective(emu::OP_SHFL_XOR, emu::to_bits(v), m, width, mask));
}
static inline unsigned int __ballot_sync(unsigned int mask, int pred) {
    return (unsigned int)emu::warp_collective(emu::OP_BALLOT, pred != 0, 0, 32, mask);
}
static inline int __any_sync(unsigned int mask, int pred) {
    return (int)emu::warp_collective(emu::OP_ANY, pred != 0, 0, 32, mask);
}
static inline int __all_sync(unsigned int mask, int pred) {
    return (int)emu::warp_collective(emu::OP_ALL, pred != 0, 0, 32, mask);
}
// Tensor-core MMA for the wrappers in cuda_src/mma.cuh (never called by kernels directly).
static inline void emu_mma_m16n8k16(int bf16, float* d, const unsigned int* a, const unsigned int* b,
                                    const float* c) {
    emu::MmaLane lane{d, a, b, c};
    emu::warp_collective(bf16 ? emu::OP_MMA_BF16 : emu::OP_MMA_F16, (unsigned long long)&lane, 0, 32, 0xffffffffu);
}
// ldmatrix's emulation (cuda_src/ldmatrix.cuh) brackets its gathers with these:
// counter mode counts the instruction's rows, not the gathers. Each lane's row address must
// be 16-byte aligned and its 16 bytes in this block's shared memory (PTX ISA ldmatrix: ".shared"
// state space, rows of 16 bytes "aligned to 16 bytes"); the GPU faults or reads garbage otherwise.
static inline void emu_ldmatrix_begin(const void* row) {
    emu::check_ldmatrix_row(row);
    if (EMU_COUNTERS && emu::g_counting && emu::tl_cnt) emu::count_ldmatrix(row);
}
static inline void emu_ldmatrix_end() {
    if (EMU_COUNTERS && emu::g_counting && emu::tl_cnt) emu::tl_fiber->cnt_mute = 0;
}
// wgmma's emulation (cuda_src/wgmma.cuh; the "wgmma" section above).
EMU_INTERNAL static inline void emu_wgmma_rs(int bf16, int n, float* d, const unsigned int* a, unsigned long long desc,
                                int scale_d) {
    emu::WgLaneArgs lane{d, a, desc, n, bf16, scale_d};
    emu::warp_collective(emu::OP_WGMMA, (unsigned long long)&lane, 0, 32, 0xffffffffu);
}
EMU_INTERNAL static inline void emu_wgmma_fence() {
    emu::wg_state(emu::tl_block->nthreads)->th[emu::tl_fiber->tid].fenced = 1;
}
EMU_INTERNAL static inline void emu_wgmma_commit() {
    emu::wg_state(emu::tl_block->nthreads)->th[emu::tl_fiber->tid].cur++;
}
EMU_INTERNAL static inline void emu_wgmma_wait(int n) {
    emu::WgState* s = emu::wg_state(emu::tl_block->nthreads);
    const unsigned cur = s->th[emu::tl_fiber->tid].cur;
    emu::wg_retire(s, emu::tl_fiber->tid, cur >= (unsigned)n ? cur - (unsigned)n : 0u);
}
EMU_INTERNAL static inline void emu_fence_proxy_async() {}
EMU_INTERNAL static inline unsigned long long emu_wgmma_desc(const void* smem, unsigned int lbo, unsigned int sbo) {
    return emu::wg_make_desc(smem, lbo, sbo);
}
// Programmatic dependent launch (cuda_src/pdl.cuh). Launches run one after another
// here, so the ordering they ask for always holds; the counter build records what
// each thread touches before its wait for the ordering check (pdl_order.py).
EMU_INTERNAL static inline void emu_pdl_wait() {
    emu::Fiber* f = emu::tl_fiber;
    f->pdl_waited = 1;
    emu::tl_block->pdl_waited = true;
    if (EMU_COUNTERS && emu::g_counting && emu::tl_cnt) ((emu::Count*)emu::tl_cnt)->out[emu::CNT_PDL_WAITS]++;
}
EMU_INTERNAL static inline void emu_pdl_launch_dependents() {
    if (EMU_COUNTERS && emu::g_counting && emu::tl_cnt && !emu::tl_fiber->pdl_waited)
        ((emu::Count*)emu::tl_cnt)->out[emu::CNT_PDL_EARLY_TRIGGERS]++;
}
// A prefetch must point into an array (checked as a one-byte load); counted only as a
// pre-wait touch of its byte, never as a load.
EMU_INTERNAL static inline void emu_prefetch_l2(const void* p) {
    const unsigned long long a = (unsigned long long)p;
    emu::check_access(a, 1, false);
    emu::MemTable* t = emu::tl_mem;
    emu::Fiber* f = emu::tl_fiber;
    emu::Count* c = (emu::Count*)emu::tl_cnt;
    if (!EMU_COUNTERS || !emu::g_counting || !c || !t || !t->count || !f || f->pdl_waited) return;
    int range = -1;
    if (emu::cnt_space(t, f, a, &range) == 0 && range < c->nranges) emu::cnt_bytes(c, range, a, 1, 2, true);
}
static inline unsigned int __activemask() { return 0xffffffffu; }
static inline unsigned int __lanemask_lt() { return (1u << (emu::tl_fiber->tid & 31)) - 1u; }

// Names NVRTC does not know: using them in a kernel must fail here too.
#undef INFINITY
#undef NAN
#pragma GCC poison std uint8_t int8_t uint16_t int16_t uint32_t int32_t uint64_t int64_t INFINITY NAN

#endif  // DFLASH_CUDA_EMU_H

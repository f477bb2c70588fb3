// emu_language.h — part of cuda_emu.h (included by it only, after the parts before it).
// The CUDA C language under g++: keywords, vector types (alignment-checked,
// counted as one access), bit casts, math, atomics, __half / __nv_bfloat16, constants.
#pragma once

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
// Defined with the memory checks (emu_memcheck.h): reports a vector load/store whose address
// is not a multiple of the vector's size (the GPU faults on those).
static inline void misaligned(const void* p, unsigned align, const char* type, bool store);
// Counter mode (emu_counters.h): the counting state of the launch this OS
// thread runs, null when counting is off. The hooks exist only in modules built
// with -DEMU_COUNTERS=1 (build.py's counting variant): ordinary builds pay nothing.
EMU_SHARED_TLS void* tl_cnt;
EMU_SHARED int g_counting;  // counted launches running in this module: tested before tl_cnt
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
EMU_VEC2(long long, longlong2, 16) EMU_VEC2(unsigned long long, ulonglong2, 16)
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

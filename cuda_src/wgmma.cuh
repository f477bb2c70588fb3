// wgmma.cuh — Hopper warpgroup MMA (wgmma.mma_async, sm_90a only): with mma.cuh and
// ldmatrix.cuh the only place a kernel meets inline PTX. An including kernel says
// "// nvrtc-arch: sm_90a" on a line of its own (NVRTC checks, emulator) and is compiled with
// dflash_cupy.kernels.arch_options(needs="sm_90a"); ptxas rejects wgmma for plain sm_90.
//
// "Swap AB" form: one warpgroup (128 aligned threads, warp w = (tid / 32) % 4) computes
// D[64][N] (+)= A[64][16] * B[16][N] (PTX ISA "Matrix Fragments for wgmma.mma_async.m64nNk16"):
//   A: registers, warp w rows 16w..16w+15 in mma.m16n8k16's A layout; lane l, g = l >> 2, t = l & 3:
//        a[0] = A[g][2t..2t+1]   a[1] = A[g+8][2t..2t+1]   a[2] = A[g][2t+8..+9]   a[3] = A[g+8][2t+8..+9]
//   B: N x 16 (N = 8..256, step 8) in shared memory, K-major, no swizzle, named by a descriptor;
//   D: f32 registers, N/2 per thread: for n8 chunk j,
//        d[4j+0..1] = D[16w+g][8j+2t..+1]   d[4j+2..3] = D[16w+g+8][8j+2t..+1]
//   scale_d = 0: D = A*B (the old d is ignored); nonzero: D = A*B + D.
// B in shared memory ("core matrices" of 8 n-rows x 16 contiguous bytes): B(k, n) of a k16 step at
//   start + (n / 8) * SBO + (k / 8) * LBO + (n % 8) * 16 + (k % 8) * 2   bytes
// (LBO: between the two 8-wide K halves, SBO: between groups of 8 N rows; the next k16 step is a
// new descriptor at its first core matrix).
// Descriptor (64 bits): bits 0-13 start (shared address >> 4), 16-29 LBO >> 4, 32-45 SBO >> 4,
// 49-51 base offset 0, 62-63 swizzle 0; start, LBO, SBO multiples of 16 bytes.
// Order of use: smem stores of B -> fence_proxy_async_shared() -> __syncthreads()
//   -> wgmma_fence() (before the first wgmma, and after any register write to D or A)
//   -> wgmma_m64nNk16_rs_*<N>(...) x k steps -> wgmma_commit_group()
//   -> wgmma_wait_group<n>() (n groups may stay in flight) -> wgmma_fence_operands<N>(d) -> read d.
// Until the wait that retires it, a wgmma's d and a are neither read nor written and its B does
// not change. Every call is warpgroup-collective: all 128 threads, agreeing arguments.
//
// Sources checked and the readings only a GPU confirms: docs/decisions/gemm.md ("wgmma.cuh").
// DFLASH_FAULT_WGMMA_DESC (tests/test_selfcheck_faults.py only) swaps LBO and SBO in every
// descriptor: the fault the self-check (dflash_cupy/selfcheck.py) must catch. The emulator
// (cuda_emu.h) runs each wgmma at the wait that retires it and reports a bad descriptor, a
// missing fence or wait, d or a written in flight, or partial warpgroups.
#pragma once
#include <cuda_fp16.h>

#ifdef __CUDA_ARCH__
// One asm statement per N: the accumulator list is a literal of N/2 operands.
#define DFLASH_WGMMA_RS_8(TY) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32." TY "." TY " " \
                 "{" \
                 "%0, %1, %2, %3" \
                 "}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d) \
                 : "memory")

#define DFLASH_WGMMA_RS_16(TY) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32." TY "." TY " " \
                 "{" \
                 "%0, %1, %2, %3, %4, %5, %6, %7" \
                 "}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d) \
                 : "memory")

#define DFLASH_WGMMA_RS_32(TY) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " " \
                 "{" \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
                 "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d) \
                 : "memory")

#define DFLASH_WGMMA_RS_64(TY) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " \
                 "{" \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
                 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d) \
                 : "memory")

#define DFLASH_WGMMA_RS_128(TY) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " \
                 "{" \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
                 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d) \
                 : "memory")

#define DFLASH_WGMMA_RS_256(TY) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " " \
                 "{" \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
                 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
                 "}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
                   "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
                   "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
                   "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
                   "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
                   "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
                   "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
                   "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
                   "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d) \
                 : "memory")


namespace wgmma_detail {
template <int N> struct Rs;
#define DFLASH_WGMMA_RS_STRUCT(N)                                                                      \
    template <> struct Rs<N> {                                                                         \
        static __device__ __forceinline__ void bf16(float* d, const unsigned int* a,                   \
                                                    unsigned long long desc, int scale_d) {            \
            DFLASH_WGMMA_RS_##N("bf16");                                                               \
        }                                                                                              \
        static __device__ __forceinline__ void f16(float* d, const unsigned int* a,                    \
                                                   unsigned long long desc, int scale_d) {             \
            DFLASH_WGMMA_RS_##N("f16");                                                                \
        }                                                                                              \
    };
DFLASH_WGMMA_RS_STRUCT(8)
DFLASH_WGMMA_RS_STRUCT(16)
DFLASH_WGMMA_RS_STRUCT(32)
DFLASH_WGMMA_RS_STRUCT(64)
DFLASH_WGMMA_RS_STRUCT(128)
DFLASH_WGMMA_RS_STRUCT(256)
#undef DFLASH_WGMMA_RS_STRUCT
}  // namespace wgmma_detail
#endif

// Registers written by wgmma_* before this point (wgmma_fence) are what the next wgmma reads.
__device__ __forceinline__ void wgmma_fence() {
#ifdef __CUDA_ARCH__
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
    emu_wgmma_fence();
#endif
}

// Closes the group of the wgmmas this thread issued since the last commit.
__device__ __forceinline__ void wgmma_commit_group() {
#ifdef __CUDA_ARCH__
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
    emu_wgmma_commit();
#endif
}

// Waits until at most N committed groups are still in flight (N = 0: all done).
template <int N>
__device__ __forceinline__ void wgmma_wait_group() {
    static_assert(N >= 0 && N <= 7, "wgmma.wait_group takes 0..7");
#ifdef __CUDA_ARCH__
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#else
    emu_wgmma_wait(N);
#endif
}

// Shared-memory writes of this thread (generic proxy) become visible to the async proxy that
// wgmma reads B through; then a __syncthreads makes every thread's writes visible.
__device__ __forceinline__ void fence_proxy_async_shared() {
#ifdef __CUDA_ARCH__
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#else
    emu_fence_proxy_async();
#endif
}

// After a wait: the compiler must not move reads of d above it (nor writes below the next
// wgmma_fence); the asm ties each accumulator register to this point. No instruction.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float* d) {
#ifdef __CUDA_ARCH__
#pragma unroll
    for (int i = 0; i < N / 2; i++) asm volatile("" : "+f"(d[i])::"memory");
#else
    (void)d;
#endif
}

// Before wgmma_fence: register A operands computed before this point are written here, so the
// fence orders them (the compiler may otherwise sink their arithmetic past the fence, and
// ptxas then injects a warpgroup.arrive before each wgmma). No instruction.
template <int N>
__device__ __forceinline__ void wgmma_pin_operands(unsigned int* a) {
#ifdef __CUDA_ARCH__
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+r"(a[i])::"memory");
#else
    (void)a;
#endif
}

// Descriptor of a K-major, unswizzled B operand whose first core matrix is at `smem` (a
// 16-byte aligned shared-memory address); lbo_bytes / sbo_bytes as in the layout above.
__device__ __forceinline__ unsigned long long wgmma_desc_kmajor_noswizzle(const void* smem, unsigned int lbo_bytes,
                                                                       unsigned int sbo_bytes) {
#ifdef DFLASH_FAULT_WGMMA_DESC  // test-only fault (tests/test_selfcheck_faults.py): LBO and SBO swapped
    const unsigned int fault_swap = lbo_bytes;
    lbo_bytes = sbo_bytes;
    sbo_bytes = fault_swap;
#endif
#ifdef __CUDA_ARCH__
    const unsigned int addr = (unsigned int)__cvta_generic_to_shared(smem);
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) |
           ((unsigned long long)((lbo_bytes & 0x3FFFFu) >> 4) << 16) |
           ((unsigned long long)((sbo_bytes & 0x3FFFFu) >> 4) << 32);
#else
    return emu_wgmma_desc(smem, lbo_bytes, sbo_bytes);
#endif
}

// 0, as a value ptxas cannot know: %dynamic_smem_size < 2^18 (the 18-bit shared window every
// descriptor addresses). `a | wgmma_opaque_zero()` is `a`, computed where it is written: a
// register A operand built that way from a vector load's registers keeps those registers
// (and the load in flight) until there, where ptxas would otherwise copy the load into the
// A quads (no 16-byte load fills one: rows g and g + 8) at once, waiting for it.
__device__ __forceinline__ unsigned int wgmma_opaque_zero() {
#ifdef __CUDA_ARCH__
    unsigned int v;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
    return v >> 18;
#else
    return 0u;
#endif
}

// D[64][N] = A[64][16] * B[16][N] (+ D if scale_d), A from registers, B by descriptor.
template <int N>
__device__ __forceinline__ void wgmma_m64nNk16_rs_bf16(float* d, const unsigned int a[4], unsigned long long desc_b,
                                                       int scale_d) {
    static_assert(N == 8 || N == 16 || N == 32 || N == 64 || N == 128 || N == 256,
                  "wgmma_m64nNk16_rs: N is one of 8, 16, 32, 64, 128, 256");
#ifdef __CUDA_ARCH__
    wgmma_detail::Rs<N>::bf16(d, a, desc_b, scale_d);
#else
    emu_wgmma_rs(1, N, d, a, desc_b, scale_d);
#endif
}

template <int N>
__device__ __forceinline__ void wgmma_m64nNk16_rs_f16(float* d, const unsigned int a[4], unsigned long long desc_b,
                                                      int scale_d) {
    static_assert(N == 8 || N == 16 || N == 32 || N == 64 || N == 128 || N == 256,
                  "wgmma_m64nNk16_rs: N is one of 8, 16, 32, 64, 128, 256");
#ifdef __CUDA_ARCH__
    wgmma_detail::Rs<N>::f16(d, a, desc_b, scale_d);
#else
    emu_wgmma_rs(0, N, d, a, desc_b, scale_d);
#endif
}

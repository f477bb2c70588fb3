// mma.cuh — tensor-core MMA wrappers: the only place a kernel meets inline PTX.
//
// mma_m16n8k16_{f16,bf16}(d, a, b, c): one warp computes D = A * B + C for a
// 16x16 (A, row-major) by 16x8 (B, "col": stored as [n][k]) tile, f32
// accumulators, with the register fragments of the PTX ISA ("Matrix Fragments
// for mma.m16n8k16 with floating point type"). For lane l, g = l >> 2, t = l & 3:
//   a[0] = A[g   ][2t..2t+1]   a[1] = A[g+8][2t..2t+1]      (low half = lower column)
//   a[2] = A[g   ][2t+8..+9]   a[3] = A[g+8][2t+8..+9]
//   b[0] = B[2t..2t+1][g]      b[1] = B[2t+8..2t+9][g]
//   c/d[0..1] = C[g][2t..2t+1] c/d[2..3] = C[g+8][2t..2t+1]
// Every lane of the warp must call it together (warp-uniform code), sm_80+.
// Under the emulator the same call gathers all 32 lanes' fragments
// (cuda_emu.h, emu_mma_m16n8k16), so a kernel and its layout assumptions are
// tested on the CPU.
//
// DFLASH_FAULT_MMA_FRAG (defined only by tests/test_selfcheck_faults.py, never by a launcher:
// dflash_cupy.kernels.compile_options refuses DFLASH_FAULT_* names) swaps two registers of the A
// fragment, the fault the self-check (dflash_cupy/selfcheck.py) must catch.
#pragma once
#include <cuda_fp16.h>

__device__ __forceinline__ void mma_m16n8k16_bf16(float d[4], const unsigned int a[4], const unsigned int b[2],
                                                  const float c[4]) {
#ifdef DFLASH_FAULT_MMA_FRAG  // test-only fault (tests/test_selfcheck_faults.py): A registers 1 and 2 swapped
    const unsigned int fault_a[4] = {a[0], a[2], a[1], a[3]};
    a = fault_a;
#endif
#ifdef __CUDA_ARCH__
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
    emu_mma_m16n8k16(1, d, a, b, c);
#endif
}

__device__ __forceinline__ void mma_m16n8k16_f16(float d[4], const unsigned int a[4], const unsigned int b[2],
                                                 const float c[4]) {
#ifdef DFLASH_FAULT_MMA_FRAG  // test-only fault (tests/test_selfcheck_faults.py): A registers 1 and 2 swapped
    const unsigned int fault_a[4] = {a[0], a[2], a[1], a[3]};
    a = fault_a;
#endif
#ifdef __CUDA_ARCH__
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
    emu_mma_m16n8k16(0, d, a, b, c);
#endif
}

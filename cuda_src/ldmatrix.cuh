// ldmatrix.cuh — shared-memory matrix loads for mma.sync fragments: the only
// inline PTX besides mma.cuh.
//
// ldmatrix_x4_trans(r, row): one warp loads four 8x8 b16 matrices from shared
// memory, transposed. Lane l gives the address of one 16-byte matrix row:
// matrix l / 8, row l % 8 (rows may be anywhere, 16-byte aligned). Lane l
// (g = l >> 2, t = l & 3) receives, for matrix i,
//   r[i] = { M_i[2t][g] (low half), M_i[2t+1][g] (high half) },
// which is the "col" B fragment of mma.m16n8k16 (mma.cuh) when the matrix rows
// are the k index: a [k][n] tile (V as [key][dim]) is read without staging it
// transposed. Every lane of the warp must call it together (warp-uniform
// code), sm_75+. Under the emulator the same result is gathered with shuffles
// of the row addresses, which must be 16-byte aligned and in shared memory (checked there).
//
// DFLASH_FAULT_LDMATRIX_NOTRANS (defined only by tests/test_selfcheck_faults.py, never by a
// launcher: dflash_cupy.kernels.compile_options refuses DFLASH_FAULT_* names) reads without
// .trans, the fault the self-check (dflash_cupy/selfcheck.py) must catch.
#pragma once
#include <cuda_fp16.h>

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int r[4], const __half* row) {
#ifdef __CUDA_ARCH__
    const unsigned int a = (unsigned int)__cvta_generic_to_shared(row);
#ifndef DFLASH_FAULT_LDMATRIX_NOTRANS
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
#else  // test-only fault (tests/test_selfcheck_faults.py): the same read without .trans
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
#endif
#else
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    emu_ldmatrix_begin(row);  // counter mode: one instruction reading each lane's 16-byte row
    for (int i = 0; i < 4; ++i) {
#ifndef DFLASH_FAULT_LDMATRIX_NOTRANS
        const __half* r0 = __shfl_sync(0xffffffffu, row, 8 * i + 2 * t);
        const __half* r1 = __shfl_sync(0xffffffffu, row, 8 * i + 2 * t + 1);
        r[i] = (unsigned int)__half_as_ushort(r0[g]) | ((unsigned int)__half_as_ushort(r1[g]) << 16);
#else  // without .trans: lane (g, t) gets M_i[g][2t..2t+1]
        const __half* rg = __shfl_sync(0xffffffffu, row, 8 * i + g);
        r[i] = (unsigned int)__half_as_ushort(rg[2 * t]) | ((unsigned int)__half_as_ushort(rg[2 * t + 1]) << 16);
#endif
    }
    emu_ldmatrix_end();
#endif
}

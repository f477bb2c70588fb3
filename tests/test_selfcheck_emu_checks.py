"""Two faults the GPU raises that the emulator now reports too (dflash_cupy/emu/cuda/cuda_emu.h):

* a misaligned scalar access: a 2-, 4- or 8-byte load or store whose address is not a
  multiple of its size (e.g. ``*reinterpret_cast<const unsigned int*>`` at an address that is
  2 mod 4) faults on the GPU ("misaligned address") and ran silently on the CPU;
* an ldmatrix row address (``cuda_src/ldmatrix.cuh``) that is not 16-byte aligned or not in
  the block's shared memory.

Each has a kernel that breaks the rule, which must fail with a message naming it, and its
corrected twin, which must pass with the right result."""
import numpy as np
import pytest

from dflash_cupy import kernels
from dflash_cupy.backends import KernelLaunchError

SRC = r"""
#include <cuda_fp16.h>
#include "ldmatrix.cuh"

// out[0] = the 4-byte word at byte offset `off` of `a`, read as one unsigned int
extern "C" __global__ void load_u32(const unsigned short* a, unsigned int* out, int off) {
    const char* p = reinterpret_cast<const char*>(a) + off;
    out[0] = *reinterpret_cast<const unsigned int*>(p);
}

// the 2-byte value v stored at byte offset `off` of `a`
extern "C" __global__ void store_u16(unsigned char* a, int off, unsigned short v) {
    *reinterpret_cast<unsigned short*>(a + off) = v;
}

// out[0] = the 8-byte word at byte offset `off` of `a`
extern "C" __global__ void load_u64(const unsigned int* a, unsigned long long* out, int off) {
    out[0] = *reinterpret_cast<const unsigned long long*>(reinterpret_cast<const char*>(a) + off);
}

// ldmatrix_x4_trans of four 8x8 f16 matrices (row r of matrix i: m[(8 i + r) * 8 ..]) staged in
// shared memory at `shift` halves past a 16-byte boundary, or (from_global) read from `g` directly
extern "C" __global__ void ldsm_t(const __half* g, unsigned int* out, int shift, int from_global) {
    __shared__ __align__(16) __half m[32 * 8 + 16];
    for (int i = threadIdx.x; i < 32 * 8; i += 32) m[i + shift] = g[i];
    __syncthreads();
    unsigned int r[4];
    const __half* row = from_global ? g + threadIdx.x * 8 : m + shift + threadIdx.x * 8;
    ldmatrix_x4_trans(r, row);
    for (int i = 0; i < 4; i++) out[threadIdx.x * 4 + i] = r[i];
}
"""


@pytest.fixture
def mod(emu):
    return emu.compile(SRC, kernels.compile_options(), filename="selfcheck_emu_checks_test.cu")


def _run(emu, k, grid, block, args):
    k(grid, block, args)
    emu.synchronize()


def test_misaligned_scalar_load_is_reported(emu, mod):
    a = emu.asarray(np.arange(16, dtype=np.uint16))
    out = emu.zeros((1,), np.uint32)
    k = mod.get_function("load_u32")
    _run(emu, k, (1,), (1,), (a, out, np.int32(4)))          # 4 mod 4: fine, halves 2 and 3
    assert int(emu.to_numpy(out)[0]) == 2 | (3 << 16)
    with pytest.raises(KernelLaunchError, match=r"misaligned 4-byte scalar load .*address % 4 = 2.*`a`"):
        _run(emu, k, (1,), (1,), (a, out, np.int32(6)))      # 2 mod 4: the GPU faults


def test_misaligned_scalar_store_and_8_byte_load_are_reported(emu, mod):
    a = emu.zeros((64,), np.uint8)
    st = mod.get_function("store_u16")
    _run(emu, st, (1,), (1,), (a, np.int32(10), np.uint16(0xBEEF)))
    assert emu.to_numpy(a)[10:12].view(np.uint16)[0] == 0xBEEF
    with pytest.raises(KernelLaunchError, match=r"misaligned 2-byte scalar store .*address % 2 = 1"):
        _run(emu, st, (1,), (1,), (a, np.int32(11), np.uint16(1)))
    w = emu.asarray(np.arange(8, dtype=np.uint32))
    out = emu.zeros((1,), np.uint64)
    ld = mod.get_function("load_u64")
    _run(emu, ld, (1,), (1,), (w, out, np.int32(8)))
    assert int(emu.to_numpy(out)[0]) == 2 | (3 << 32)
    with pytest.raises(KernelLaunchError, match=r"misaligned 8-byte scalar load .*address % 8 = 4"):
        _run(emu, ld, (1,), (1,), (w, out, np.int32(4)))


def _ldsm_expected(m):
    """ldmatrix .x4 .trans: lane (g, t) gets {M_i[2t][g], M_i[2t+1][g]} for matrix i."""
    bits = m.view(np.uint16).reshape(4, 8, 8)
    out = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(4):
            out[lane, i] = int(bits[i, 2 * t, g]) | (int(bits[i, 2 * t + 1, g]) << 16)
    return out


def test_ldmatrix_rows_must_be_aligned_and_in_shared_memory(emu, mod):
    m = np.random.default_rng(3).standard_normal(256).astype(np.float16)
    g = emu.asarray(m)
    out = emu.zeros((128,), np.uint32)
    k = mod.get_function("ldsm_t")
    _run(emu, k, (1,), (32,), (g, out, np.int32(8), np.int32(0)))     # 16 bytes past the start: aligned
    np.testing.assert_array_equal(emu.to_numpy(out).reshape(32, 4), _ldsm_expected(m))
    with pytest.raises(KernelLaunchError, match=r"ldmatrix: row address .* not 16-byte aligned .*% 16 = 8"):
        _run(emu, k, (1,), (32,), (g, out, np.int32(4), np.int32(0)))  # 8 bytes off
    with pytest.raises(KernelLaunchError, match=r"ldmatrix: row address .* not in shared memory .*`g`"):
        _run(emu, k, (1,), (32,), (g, out, np.int32(8), np.int32(1)))  # a global pointer

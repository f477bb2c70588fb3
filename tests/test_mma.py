"""Tensor-core MMA wrappers (cuda_src/mma.cuh) against a plain matrix product.

On the emulated backend this checks the emulator's fragment gathering against
the PTX ISA layouts written in mma.cuh; on a GPU the same test checks those
layouts against the hardware."""
import ml_dtypes
import numpy as np
import pytest

from dflash_cupy.kernels import CUDA_SRC
from tests.support.tolerances import assert_close

WRAPPER_SRC = r"""
#include "mma.cuh"
// A [16][16] and B stored as [n=8][k=16] (16-bit patterns), C and D [16][8] f32.
// Each lane builds its fragments from the layout documented in mma.cuh.
extern "C" __global__ void mma_tile(const unsigned short* A, const unsigned short* Bt, const float* C,
                                   float* D, int bf16) {
    const int l = threadIdx.x, g = l >> 2, t = l & 3;
    unsigned int a[4], b[2];
    float c[4], d[4];
    a[0] = A[g * 16 + 2 * t] | ((unsigned int)A[g * 16 + 2 * t + 1] << 16);
    a[1] = A[(g + 8) * 16 + 2 * t] | ((unsigned int)A[(g + 8) * 16 + 2 * t + 1] << 16);
    a[2] = A[g * 16 + 2 * t + 8] | ((unsigned int)A[g * 16 + 2 * t + 9] << 16);
    a[3] = A[(g + 8) * 16 + 2 * t + 8] | ((unsigned int)A[(g + 8) * 16 + 2 * t + 9] << 16);
    b[0] = Bt[g * 16 + 2 * t] | ((unsigned int)Bt[g * 16 + 2 * t + 1] << 16);
    b[1] = Bt[g * 16 + 2 * t + 8] | ((unsigned int)Bt[g * 16 + 2 * t + 9] << 16);
    for (int i = 0; i < 4; i++) c[i] = C[(g + ((i & 2) ? 8 : 0)) * 8 + 2 * t + (i & 1)];
    if (bf16) mma_m16n8k16_bf16(d, a, b, c);
    else mma_m16n8k16_f16(d, a, b, c);
    for (int i = 0; i < 4; i++) D[(g + ((i & 2) ? 8 : 0)) * 8 + 2 * t + (i & 1)] = d[i];
}
"""

HALF = {"f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_mma_wrapper_matches_matrix_product(backend, rng, kind):
    mod = backend.compile(WRAPPER_SRC, ["-I" + str(CUDA_SRC)], filename="mma_tile.cu")
    dt = HALF[kind]
    a = rng.standard_normal((16, 16)).astype(dt)
    bt = rng.standard_normal((8, 16)).astype(dt)     # B[k][n] = bt[n][k]
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = backend.zeros((16, 8), np.float32)
    mod.get_function("mma_tile")((1,), (32,), (
        backend.asarray(a.view(np.uint16)), backend.asarray(bt.view(np.uint16)), backend.asarray(c), d,
        np.int32(kind == "bf16")))
    ref = a.astype(np.float64) @ bt.astype(np.float64).T + c
    assert_close(backend.to_numpy(d), ref, "f32", f"mma {kind}")


def test_mma_with_missing_lanes_is_an_error(emu):
    from dflash_cupy.backends import KernelLaunchError
    src = r"""
    #include "mma.cuh"
    extern "C" __global__ void partial(float* out) {
        if (threadIdx.x >= 16) return;
        unsigned int a[4] = {0u, 0u, 0u, 0u}, b[2] = {0u, 0u};
        float c[4] = {0.f, 0.f, 0.f, 0.f}, d[4];
        mma_m16n8k16_bf16(d, a, b, c);
        out[threadIdx.x] = d[0];
    }
    """
    mod = emu.compile(src, ["-I" + str(CUDA_SRC)], filename="partial_mma.cu")
    with pytest.raises(KernelLaunchError, match="needs all 32"):
        mod.get_function("partial")((1,), (32,), (emu.zeros((32,), np.float32),))
        emu.synchronize()  # launches run (and fail) when their stream is waited for

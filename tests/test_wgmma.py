"""Warpgroup MMA wrappers (cuda_src/wgmma.cuh) and their emulation (cuda_emu.h, "wgmma").

``tests/cuda/wgmma_micro.cu`` stages a random B (N x 16k, K-major core matrices with padding
between them, the padding NaN) in shared memory, keeps A's 64 rows per warpgroup in registers
and runs one wgmma per k16 step, one commit group each. Against a float64 matrix product:
N = 8 .. 256, bf16 and f16, scale_d 0 and 1, two arrangements of the core matrices (LBO
small / SBO large and the reverse), one and two warpgroups. On the emulated backend this
checks the emulation against the layouts written in wgmma.cuh; on a GPU (the ``backend``
fixture's cuda case) the same test checks those layouts against the hardware.

The emulator's refusals and its deferral (emulated only: on a GPU these are undefined):
d read before the wait is the old value, B overwritten before the wait changes the result,
bad descriptors, a missing fence or wait, a block that is not whole warpgroups. Counter mode
counts wgmma per warpgroup, their m16n8k16 equivalents and the bytes of B they read. NVRTC
builds the micro-kernel for sm_90a with no spills."""
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dflash_cupy import kernels
from dflash_cupy.backends import KernelLaunchError
from dflash_cupy.emu.counting import count_launch
from dflash_cupy.kernels import CUDA_SRC
from tests.support.nvrtc_check import archs_for, nvrtc_check, option_sets
from tests.support.tolerances import assert_close

MICRO = Path(__file__).resolve().parent / "cuda" / "wgmma_micro.cu"
KSTEPS = 2
HALF = {"bf16": np.dtype(ml_dtypes.bfloat16), "f16": np.dtype(np.float16)}
_modules: dict = {}


def _module(backend, n):
    key = (id(backend), n)
    if key not in _modules:
        try:
            arch = kernels.arch_options(backend, "sm_90a")
        except RuntimeError as e:  # a GPU other than Hopper: nothing to check there
            pytest.skip(str(e))
        opts = ["-I" + str(CUDA_SRC), f"-DWG_N={n}", f"-DWG_KSTEPS={KSTEPS}", *arch]
        _modules[key] = backend.compile(MICRO.read_text(), opts, filename=str(MICRO))
    return _modules[key]


def layout(n, arrangement):
    """(lbo, sbo, step_bytes, total bytes) of B [n][16 KSTEPS] as K-major core matrices.
    ``k_inner``: a row group's K-halves 176 bytes apart (48 bytes of padding), row groups
    further; ``n_inner``: row groups 160 bytes apart, K-halves after all of them."""
    if arrangement == "k_inner":
        lbo = 128 + 48
        sbo = 2 * KSTEPS * lbo + 80
    else:
        sbo = 128 + 32
        lbo = (n // 8) * sbo + 96
    total = (n // 8 - 1) * sbo + (2 * KSTEPS - 1) * lbo + 128
    return lbo, sbo, 2 * lbo, (total + 15) // 16 * 16


def stage(bt_bits, lbo, sbo, total):
    """The shared-memory image of B (bt_bits [n][16 KSTEPS] uint16): core matrix (row group
    nb, K-half kb) at nb * sbo + kb * lbo, 8 rows of 16 bytes; every other byte 0xFF (NaN)."""
    img = np.full(total // 2, 0xFFFF, np.uint16)
    n, k = bt_bits.shape
    for nb in range(n // 8):
        for kb in range(k // 8):
            off = (nb * sbo + kb * lbo) // 2
            img[off:off + 64] = bt_bits[8 * nb:8 * nb + 8, 8 * kb:8 * kb + 8].reshape(-1)
    return img.view(np.uint32)


def emulated_rule(a, bt, c, scale_d):
    """The emulator's arithmetic (cuda_emu.h, "wgmma"): per k16 step and element, the old
    value (or 0) plus 16 products added in order in float64, rounded once to float32."""
    d = c.astype(np.float32) if scale_d else np.zeros(c.shape, np.float32)
    a64, b64 = a.astype(np.float64), bt.astype(np.float64).T
    for s in range(KSTEPS):
        acc = d.astype(np.float64)
        for k in range(16 * s, 16 * s + 16):
            acc = acc + a64[:, k:k + 1] * b64[k:k + 1, :]
        d = acc.astype(np.float32)
    return d


def run(backend, n, kind="bf16", scale_d=1, arrangement="k_inner", mode=0, groups=1, seed=0, b2=False,
        block=None):
    """Launch the micro-kernel; returns (D, reference with the staged B, reference with B2,
    C)."""
    rng = np.random.default_rng(seed)
    dt = HALF[kind]
    rows, k = 64 * groups, 16 * KSTEPS
    a = rng.standard_normal((rows, k)).astype(dt)
    bt = rng.standard_normal((n, k)).astype(dt)           # B[k][n] = bt[n][k]
    bt2 = rng.standard_normal((n, k)).astype(dt)
    c = rng.standard_normal((rows, n)).astype(np.float32)
    lbo, sbo, step, total = layout(n, arrangement)
    img, img2 = stage(bt.view(np.uint16), lbo, sbo, total), stage(bt2.view(np.uint16), lbo, sbo, total)
    d = backend.zeros((rows, n), np.float32)
    mod = _module(backend, n)
    mod.get_function("wgmma_tile")((1,), (block or 128 * groups,), (
        backend.asarray(a.view(np.uint16)), backend.asarray(img), backend.asarray(img2), np.int32(total // 16),
        np.int32(lbo), np.int32(sbo), np.int32(step), backend.asarray(c), d, np.int32(kind == "bf16"),
        np.int32(scale_d), np.int32(mode)), shared_mem=total)
    out = backend.to_numpy(d)
    run.exact = emulated_rule(a, bt, c, scale_d)
    base = c.astype(np.float64) if scale_d else 0.0
    ref = base + a.astype(np.float64) @ bt.astype(np.float64).T
    ref2 = base + a.astype(np.float64) @ bt2.astype(np.float64).T
    return out, ref, ref2, c


@pytest.mark.parametrize("n", [8, 16, 64, 128, 256])
def test_wgmma_matches_matrix_product(backend, n):
    for kind in ("bf16", "f16"):
        for scale_d in (0, 1):
            for arrangement in ("k_inner", "n_inner"):
                out, ref, _, _ = run(backend, n, kind, scale_d, arrangement, seed=n + scale_d)
                assert_close(out, ref, "f32", f"wgmma n={n} {kind} scale_d={scale_d} {arrangement}")
                if backend.name == "emulated":  # and bit for bit the rule the emulator states
                    np.testing.assert_array_equal(out, run.exact)


def test_two_warpgroups_and_wait_inside_the_loop(backend):
    """Rows 64..127 come from the second warpgroup's registers; wait<1> after each commit
    leaves one group in flight (mode 9)."""
    out, ref, _, _ = run(backend, 16, groups=2, seed=3)
    assert_close(out, ref, "f32", "two warpgroups")
    out, ref, _, _ = run(backend, 16, mode=9, arrangement="n_inner", seed=4)
    assert_close(out, ref, "f32", "wait<1> in the loop")


# ---- deferral: the emulator is not kinder than the GPU ------------------------------------
def test_accumulators_read_before_the_wait_are_the_old_values(emu):
    out, ref, _, c = run(emu, 16, mode=1, seed=6)
    np.testing.assert_array_equal(out, c)            # bit-exact: nothing was computed yet
    assert not np.allclose(out, ref)


def test_b_overwritten_before_the_wait_changes_the_result(emu):
    out, ref, ref2, _ = run(emu, 16, mode=2, seed=7)
    assert_close(out, ref2, "f32", "B read at the wait")
    assert not np.allclose(out, ref, atol=1e-2)


# ---- refusals ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,message", [
    (3, r"exits with 2 wgmma\(s\) in flight \(0 never committed\)"),
    (4, r"swizzle mode 1 \(bits 62-63\)"),
    (5, r"is not in shared memory"),
    (6, r"must be multiples of 16"),
    (7, r"without a wgmma_fence\(\)"),
    (8, r"reads bytes \[\d+, \d+\) of a \d+-byte shared array"),
    (10, r"accumulators of a wgmma in flight \(n=16\) were written before the wait"),
    (11, r"a\[3\] of a wgmma in flight changed from 0x[0-9a-f]{8} to 0x[0-9a-f]{8} before the wait"),
])
def test_emulator_rejects(emu, mode, message):
    with pytest.raises(KernelLaunchError, match=message):
        run(emu, 16, mode=mode, seed=8)
        emu.synchronize()


def test_block_of_partial_warpgroups_is_rejected(emu):
    with pytest.raises(KernelLaunchError, match="multiple of 128 threads"):
        run(emu, 8, block=96, seed=9)
        emu.synchronize()


def test_descriptor_bits(emu):
    """The descriptor the emulator builds has the PTX fields where wgmma.cuh says: LBO >> 4 at
    bit 16, SBO >> 4 at bit 32, nothing above bit 45; the start is a 16-byte aligned window
    offset below 256 KiB."""
    src = r"""
    #include "wgmma.cuh"
    extern "C" __global__ void desc(unsigned long long* out) {
        __shared__ __align__(16) unsigned char s[4096];
        s[threadIdx.x] = 0;
        out[0] = wgmma_desc_kmajor_noswizzle(s + 256, 176, 784);
        out[1] = wgmma_desc_kmajor_noswizzle(s + 512, 16, 16);
    }
    """
    mod = emu.compile(src, ["-I" + str(CUDA_SRC)], filename="wgmma_desc.cu")
    out = emu.zeros((2,), np.uint64)
    mod.get_function("desc")((1,), (32,), (out,))
    d0, d1 = (int(x) for x in emu.to_numpy(out))
    assert (d0 >> 16) & 0x3FFF == 176 >> 4 and (d0 >> 32) & 0x3FFF == 784 >> 4 and d0 >> 46 == 0
    assert ((d1 & 0x3FFF) - (d0 & 0x3FFF)) == 256 >> 4      # start addresses 256 bytes apart
    assert d0 & (0x3 << 14) == 0 and d0 & (0x3 << 30) == 0


# ---- counter mode --------------------------------------------------------------------------
@pytest.mark.parametrize("n,groups", [(16, 1), (64, 2)])
def test_counter_mode_counts_wgmma(emu, n, groups):
    rng = np.random.default_rng(10)
    rows, k = 64 * groups, 16 * KSTEPS
    lbo, sbo, step, total = layout(n, "k_inner")
    img = stage(rng.standard_normal((n, k)).astype(HALF["bf16"]).view(np.uint16), lbo, sbo, total)
    args = (emu.asarray(rng.standard_normal((rows, k)).astype(HALF["bf16"]).view(np.uint16)), emu.asarray(img),
            emu.asarray(img), np.int32(total // 16), np.int32(lbo), np.int32(sbo), np.int32(step),
            emu.zeros((rows, n), np.float32), emu.zeros((rows, n), np.float32), np.int32(1), np.int32(1),
            np.int32(0))
    c = count_launch(_module(emu, n).get_function("wgmma_tile"), (1,), (128 * groups,), args, shared_mem=total)
    assert c.wgmma == groups * KSTEPS                          # per warpgroup instruction
    assert c.wgmma_mma == 4 * groups * KSTEPS * (n // 8)       # m16n8k16 equivalents
    assert c.wgmma_smem_bytes == groups * KSTEPS * n * 16 * 2  # B: N x 16 halves per wgmma
    assert c.mma == 0


# ---- NVRTC ---------------------------------------------------------------------------------
def test_micro_kernel_declares_sm90a_and_builds_without_spills():
    src = MICRO.read_text()
    assert archs_for(src) == ("sm_90a",)
    for opts in option_sets(src):
        # no warnings, no spills; its modes read accumulators early on purpose: serialized
        info = nvrtc_check(src, str(MICRO), "sm_90a", opts, serialized_ok=True)
        assert set(info) == {"wgmma_tile"}
        assert info["wgmma_tile"]["stack"] == 0, f"{opts}: accumulators or fragments in local memory"
    assert len(option_sets(src)) == 6                           # N = 64 (default), 8, 16, 32, 128, 256


def test_arch_options():
    assert kernels.arch_options("90") == ("-arch=sm_90a",)
    assert kernels.arch_options((9, 0), "sm_90a") == ("-arch=sm_90a",)
    assert kernels.arch_options("sm_90", "sm_80") == ()

    class Dev:
        compute_capability = "90"

    assert kernels.arch_options(Dev()) == ("-arch=sm_90a",)
    # backends that model a device state it (kernels.py names no backend but CUDA's)
    from dflash_cupy.emu.backend import EmulatedBackend
    from profiling.step_trace import RecordingBackend
    for be in (EmulatedBackend, RecordingBackend):
        assert kernels.arch_options(be) == ("-arch=sm_90a",)
    for cc in ("80", "100", (12, 0), 89):
        with pytest.raises(RuntimeError, match="runs only on compute capability 9.0"):
            kernels.arch_options(cc, "sm_90a")
    with pytest.raises(RuntimeError, match="needs sm_90"):
        kernels.arch_options("80", "sm_90")
    with pytest.raises(ValueError, match="needs must name"):
        kernels.arch_options("90", "hopper")
    with pytest.raises(TypeError, match="device must be"):
        kernels.arch_options(3.5)


def test_cupy_compile_path_builds_sm90a(monkeypatch):
    """CuPy's own NVRTC path (cupy.cuda.compiler, as RawModule uses it) with the device query
    replaced by what it answers on an H100/H200 (it appends ``-arch=sm_90``): the micro-kernel
    fails in ptxas without ``arch_options`` and builds a cubin with them."""
    from cupy.cuda import compiler
    from dflash_cupy.backends import nvrtc_info
    compile_ = getattr(compiler, "_compile_using_nvrtc_no_warning", None)
    if compile_ is None or not hasattr(compiler, "_get_arch_for_options_for_nvrtc"):
        pytest.skip("this CuPy's compiler internals differ (private API)")
    monkeypatch.setattr(compiler, "_get_arch_for_options_for_nvrtc", lambda arch=None: (f"-arch=sm_{arch}", "cubin"))
    base = (*nvrtc_info.NVRTC_FLAGS, "-I" + str(CUDA_SRC), *("-I" + d for d in nvrtc_info.cuda_header_dirs()))
    src = MICRO.read_text()
    with pytest.raises(compiler.CompileException, match="not supported on .target 'sm_90'"):
        compile_(src, base, arch="90", filename="wgmma_micro.cu")
    out = compile_(src, base + kernels.arch_options("90", "sm_90a"), arch="90", filename="wgmma_micro.cu")
    cubin = out[0] if isinstance(out, tuple) else out
    assert bytes(cubin[:4]) == b"\x7fELF"

"""The emulated backend refuses every launch the CUDA driver would refuse on sm_90.

Each rule of ``backends/launch_limits.py`` has a kernel that breaks it (must be
caught, with CUDA's wording) and its corrected twin (must run). Per-kernel
numbers come from NVRTC + ptxas (``backends/nvrtc_info.py``), read here too so
the expectations follow the compiler rather than hard-coded register counts.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from dflash_cupy import backends
from dflash_cupy.backends import launch_limits as LL
from dflash_cupy.backends import nvrtc_info
from dflash_cupy.backends.base import BackendError, KernelLaunchError

OOR = "too many resources requested for launch"
INVALID_CONFIG = "invalid configuration argument"
INVALID_VALUE = "invalid argument"

# Enough simultaneously live values that ptxas needs > 64 registers without spilling.
_BODY = r"""
    float a[REG_N];
#pragma unroll
    for (int i = 0; i < REG_N; ++i) a[i] = x[threadIdx.x + i * 1024];
#pragma unroll
    for (int r = 0; r < 3; ++r) {
#pragma unroll
        for (int i = 0; i < REG_N; ++i) a[i] = a[i] * a[(i + 1) % REG_N] + a[(i + 5) % REG_N];
    }
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < REG_N; ++i) s += a[i] * (float)(i + 1);
    y[threadIdx.x] = s;
"""

SRC = r"""
#define REG_N 80
extern "C" __global__ void __launch_bounds__(128) bounded128(float* y) {
    y[blockIdx.x * blockDim.x + threadIdx.x] = (float)threadIdx.x;
}
extern "C" __global__ void many_regs(const float* __restrict__ x, float* y) {""" + _BODY + r"""}
// The corrected twin: __launch_bounds__(1024) makes ptxas fit 1024 threads (<= 64 registers).
extern "C" __global__ void __launch_bounds__(1024) many_regs_bounded(const float* __restrict__ x, float* y) {"""\
    + _BODY + r"""}
extern "C" __global__ void dyn_smem(float* y, int n) {
    extern __shared__ __align__(16) float dbuf[];
    for (int i = threadIdx.x; i < n; i += blockDim.x) dbuf[i] = (float)i;
    __syncthreads();
    if (threadIdx.x == 0) y[blockIdx.x] = dbuf[n - 1];
}
extern "C" __global__ void static_48k(float* y) {
    __shared__ float sbuf[12288];  // exactly 48 KiB: the static limit
    for (int i = threadIdx.x; i < 12288; i += blockDim.x) sbuf[i] = (float)i;
    __syncthreads();
    if (threadIdx.x == 0) y[0] = sbuf[12287];
}
extern "C" __global__ void static_40k_plus_dyn(float* y, int n) {
    __shared__ float sbig[10240];  // 40 KiB static
    extern __shared__ __align__(16) float dbuf[];
    sbig[threadIdx.x] = 1.0f;
    if (n > 0) dbuf[threadIdx.x] = 2.0f;
    __syncthreads();
    if (threadIdx.x == 0) y[0] = sbig[0] + (n > 0 ? dbuf[0] : 0.0f);
}
extern "C" __global__ void count_blocks(unsigned int* c) {
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) atomicAdd(c, 1u);
}
"""

SRC_49K = r"""
extern "C" __global__ void static_49k(float* y) {
    __shared__ float sbuf[12544];  // 49 KiB static: ptxas refuses it
    for (int i = threadIdx.x; i < 12544; i += blockDim.x) sbuf[i] = (float)i;
    __syncthreads();
    if (threadIdx.x == 0) y[0] = sbuf[12543];
}
"""


@pytest.fixture(scope="module")
def mod():
    return backends.get("emulated").compile(SRC, (), filename="launch_limits_probe.cu")


@pytest.fixture(scope="module")
def res():
    return nvrtc_info.cached_compile_info(SRC, "launch_limits_probe.cu").kernels


# ---------------------------------------------------------------- the register rule itself
def test_register_rule_granularity():
    # 64 registers x 1024 threads is exactly the register file.
    assert LL.registers_per_block(64, 1024) == 65536
    assert LL.registers_per_block(65, 1024) > 65536
    # 255 registers: a warp holds 8192, 8 warps fill 65536.
    assert LL.registers_per_block(255, 256) == 65536 and LL.max_threads_for_registers(255) == 256
    # Per-warp allocation unit: 130 registers are charged as 136 (130*32 rounded up to 256).
    assert LL.registers_per_block(130, 32) == 136 * 32 * 4  # one warp counts as 4 (sub-partitions)
    # 130 x 480 = 62400 <= 65536 naively, but 15 warps count as 16 and 136*32*16 = 69632.
    assert 130 * 480 <= 65536 and LL.registers_per_block(130, 480) == 69632
    assert LL.max_threads_for_registers(130) == 384
    # 92 x 672 = 61824 naively fits; 21 warps -> 24 x 3072 = 73728 does not; 640 does.
    assert LL.registers_per_block(92, 672) > 65536 >= LL.registers_per_block(92, 640)


def test_limits_without_resources_still_check_configuration():
    lim = LL.KernelLimits("k", None)
    lim.check((1, 1, 1), (1024, 1, 1), 0)
    with pytest.raises(LL.LaunchResourceError, match=INVALID_CONFIG):
        lim.check((1, 1, 1), (1, 1, 65), 0)
    with pytest.raises(LL.LaunchResourceError, match=INVALID_CONFIG):
        lim.check((1, 65536, 1), (32, 1, 1), 0)


# ---------------------------------------------------------------- NVRTC numbers
def test_nvrtc_reports_what_the_probes_need(res):
    assert res["bounded128"].max_threads == 128
    assert res["many_regs"].max_threads is None
    assert res["many_regs"].registers > 64, res["many_regs"]          # cannot fit 1024 threads
    assert res["many_regs_bounded"].registers <= 64, res["many_regs_bounded"]
    assert res["many_regs_bounded"].max_threads == 1024
    assert res["static_48k"].static_smem == 48 * 1024
    assert res["static_40k_plus_dyn"].static_smem == 40 * 1024


# ---------------------------------------------------------------- rule: threads per block
def test_block_over_1024_threads_refused(emu, mod):
    k = mod.get_function("count_blocks")
    c = emu.zeros(1, np.uint32)
    with pytest.raises(LL.LaunchResourceError, match=INVALID_CONFIG + ".*1056 threads"):
        k(1, (33, 32), (c,))
    with pytest.raises(ValueError, match="max 1024"):  # still a ValueError, as before
        k(1, (33, 32), (c,))
    k(1, (32, 32), (c,))
    assert emu.to_numpy(c)[0] == 1


def test_launch_bounds_enforced(emu, mod):
    k = mod.get_function("bounded128")
    y = emu.zeros(512, np.float32)
    with pytest.raises(LL.LaunchResourceError, match=OOR + r".*256 threads per block > __launch_bounds__\(128\)"):
        k(2, 256, (y,))
    assert not emu.to_numpy(y).any()  # a refused launch changes nothing
    k(4, 128, (y,))  # the corrected twin
    assert emu.to_numpy(y).tolist() == [float(i % 128) for i in range(512)]


# ---------------------------------------------------------------- rule: registers
def test_registers_times_threads_enforced(emu, mod, res):
    regs = res["many_regs"].registers
    fit = LL.max_threads_for_registers(regs)
    assert 0 < fit < 1024
    x = emu.asarray(np.random.default_rng(0).uniform(-0.5, 0.5, 80 * 1024).astype(np.float32))
    y = emu.zeros(1024, np.float32)
    k = mod.get_function("many_regs")
    with pytest.raises(KernelLaunchError, match=OOR + f".*{regs} registers/thread x 1024 threads"):
        k(1, 1024, (x, y))
    with pytest.raises(KernelLaunchError, match=OOR + f".*at most {fit} threads fit"):
        k(1, fit + 32, (x, y))
    k(1, fit, (x, y))  # corrected twin 1: a smaller block
    got_small = emu.to_numpy(y)[:fit]
    y2 = emu.zeros(1024, np.float32)
    mod.get_function("many_regs_bounded")(1, 1024, (x, y2))  # twin 2: __launch_bounds__(1024)
    assert np.array_equal(emu.to_numpy(y2)[:fit], got_small)
    assert np.isfinite(emu.to_numpy(y2)).all()


# ---------------------------------------------------------------- rule: static shared memory
@pytest.mark.eager_build
def test_static_shared_over_48k_fails_to_compile(emu, mod):
    with pytest.raises(BackendError, match=r"(?s)static_49k.*too much shared data"):
        emu.compile(SRC_49K, (), filename="static49.cu")
    y = emu.zeros(1, np.float32)
    mod.get_function("static_48k")(1, 256, (y,))  # the corrected twin: exactly 48 KiB
    assert emu.to_numpy(y)[0] == 12287.0


def test_static_over_48k_in_hand_made_resources_refused():
    r = nvrtc_info.KernelResources("k", registers=16, static_smem=49 * 1024)
    with pytest.raises(LL.LaunchResourceError, match=OOR + ".*static shared memory"):
        LL.KernelLimits("k", r).check((1, 1, 1), (32, 1, 1), 0)


# ---------------------------------------------------------------- rule: dynamic shared memory
def test_dynamic_100k_needs_the_opt_in(res):
    lim = LL.KernelLimits("dyn_smem", res["dyn_smem"])
    n = 100 * 1024
    with pytest.raises(LL.LaunchResourceError, match=INVALID_VALUE + ".*MaxDynamicSharedMemorySize"):
        lim.check((1, 1, 1), (128, 1, 1), n, opt_in=False)
    lim.check((1, 1, 1), (128, 1, 1), 48 * 1024, opt_in=False)  # the default allowance
    lim.set_max_dynamic_smem(n)  # the opt-in call
    lim.check((1, 1, 1), (128, 1, 1), n, opt_in=False)
    with pytest.raises(LL.LaunchResourceError, match=INVALID_VALUE):
        lim.check((1, 1, 1), (128, 1, 1), n + 4, opt_in=False)


def test_dynamic_100k_runs_with_the_backends_opt_in(emu, mod):
    # The emulated kernel opts in itself when asked for more, as CudaKernel.__call__ does.
    k = mod.get_function("dyn_smem")
    y = emu.zeros(2, np.float32)
    n = 100 * 1024 // 4
    k(2, 128, (y, np.int32(n)), shared_mem=100 * 1024)
    assert emu.to_numpy(y).tolist() == [n - 1.0, n - 1.0]
    assert k._launch_limits.max_dynamic_smem == 100 * 1024


def test_static_plus_dynamic_over_227k_refused(emu, mod):
    k = mod.get_function("static_40k_plus_dyn")
    y = emu.zeros(1, np.float32)
    over = 227 * 1024 - 40 * 1024 + 16
    with pytest.raises(LL.LaunchResourceError, match=INVALID_VALUE + ".*opt-in limit"):
        k(1, 64, (y, np.int32(1)), shared_mem=over)
    k(1, 64, (y, np.int32(1)), shared_mem=over - 16)  # exactly 227 KiB in all
    assert emu.to_numpy(y)[0] == 3.0


# ---------------------------------------------------------------- rule: grid dimensions
@pytest.mark.parametrize("axis", [1, 2])
def test_grid_y_z_over_65535_refused(emu, mod, axis):
    k = mod.get_function("count_blocks")
    c = emu.zeros(1, np.uint32)
    grid = [1, 1, 1]
    grid[axis] = 65536
    with pytest.raises(LL.LaunchResourceError, match=INVALID_CONFIG + f".*grid.{'xyz'[axis]}=65536"):
        k(tuple(grid), 1, (c,))
    grid[axis] = 65535
    k(tuple(grid), 1, (c,))
    assert emu.to_numpy(c)[0] == 65535


# ---------------------------------------------------------------- compile cache
def test_resource_cache_warm_hit_and_header_invalidation(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CUPY_EMU_CACHE", str(tmp_path / "cache"))
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "probe_size.cuh").write_text("#define PROBE_N 32\n")
    src = ('#include "probe_size.cuh"\nextern "C" __global__ void probe(float* y) {\n'
           '    __shared__ float s[PROBE_N]; s[threadIdx.x % PROBE_N] = 1.0f; __syncthreads();\n'
           '    y[threadIdx.x] = s[(threadIdx.x + 1) % PROBE_N]; }\n')
    opts = ("-I" + str(inc),)
    t0 = time.perf_counter()
    cold = nvrtc_info.cached_compile_info(src, "probe.cu", opts)
    t_cold = time.perf_counter() - t0
    assert cold.kernels["probe"].static_smem == 128
    calls = []
    real = nvrtc_info.compile_info
    monkeypatch.setattr(nvrtc_info, "compile_info", lambda *a, **k: calls.append(a) or real(*a, **k))
    t0 = time.perf_counter()
    warm = nvrtc_info.cached_compile_info(src, "probe.cu", opts)
    t_warm = time.perf_counter() - t0
    assert warm == cold and calls == []  # served from disk
    assert t_warm < t_cold
    (inc / "probe_size.cuh").write_text("#define PROBE_N 64\n")  # an edited header recompiles
    edited = nvrtc_info.cached_compile_info(src, "probe.cu", opts)
    assert len(calls) == 1 and edited.kernels["probe"].static_smem == 256
    # Rejections are cached too, with their log.
    bad = 'extern "C" __global__ void bad(float* y) { y[0] = nope; }\n'
    for _ in range(2):
        with pytest.raises(nvrtc_info.NvrtcCompileError, match="nope"):
            nvrtc_info.cached_compile_info(bad, "bad.cu", ())
    assert len(calls) == 2


def test_included_headers_follow_nested_and_quoted_includes(tmp_path):
    (tmp_path / "a.cuh").write_text('#include "sub/b.cuh"\n// #include "commented.cuh"\n')
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.cuh").write_text('#include "c.cuh"\n')   # found beside b.cuh
    (tmp_path / "sub" / "c.cuh").write_text("\n")
    (tmp_path / "commented.cuh").write_text("\n")
    src = '#include "a.cuh"\n#include <not_there.h>\n'
    got = nvrtc_info.included_headers(src, str(tmp_path / "x.cu"), [])
    assert [p.name for p in got] == ["a.cuh", "b.cuh", "c.cuh"]
    d1 = nvrtc_info.include_digest(src, str(tmp_path / "x.cu"), [])
    (tmp_path / "sub" / "c.cuh").write_text("// edited\n")
    assert nvrtc_info.include_digest(src, str(tmp_path / "x.cu"), []) != d1


def test_without_nvrtc_the_emulator_warns_and_checks_configuration(monkeypatch):
    def unavailable():
        raise nvrtc_info.NvrtcUnavailable("NVRTC cannot be loaded (test)")
    monkeypatch.setattr(nvrtc_info, "_nvrtc", unavailable)
    monkeypatch.setattr(nvrtc_info, "_warned", False)
    with pytest.warns(RuntimeWarning, match="cannot check launches"):
        assert nvrtc_info.resources_for_emulator("// x\n", "x.cu", ()) is None


@pytest.mark.slow
def test_product_kernels_fit_their_launch_bounds_and_registers():
    """Every product kernel's launch bound is a block the register file can hold
    (what the launchers' own launches are checked against in every kernel test)."""
    from tests.support.nvrtc_check import option_sets
    from dflash_cupy import kernels
    for f in sorted(kernels.CUDA_SRC.glob("*.cu")):
        src = f.read_text()
        for opts in option_sets(src, f.name):
            info = nvrtc_info.cached_compile_info(src, str(f), (*kernels.compile_options(), *opts),
                                                  nvrtc_info.declared_arch(src) or nvrtc_info.ARCH)
            for name, r in info.kernels.items():
                if r.max_threads is not None:
                    need = LL.registers_per_block(r.registers, r.max_threads)
                    assert need <= LL.REGS_PER_BLOCK, (f.name, opts, name, r)
                assert r.static_smem <= LL.STATIC_SMEM_MAX, (f.name, opts, name, r)


def test_launch_config_is_both_backends_shape_check():
    # CudaKernel and EmuKernel both start with launch_config: one parser, one message.
    assert LL.launch_config("k", 3, (32, 2), np.int64(0)) == ((3, 1, 1), (32, 2, 1), 0)
    with pytest.raises(ValueError, match="kernel k: grid dimensions must be >= 1"):
        LL.launch_config("k", (2, 0), 32, 0)
    with pytest.raises(ValueError, match="block must have 1 to 3 dimensions"):
        LL.launch_config("k", 1, (1, 1, 1, 1), 0)
    with pytest.raises(LL.LaunchResourceError, match=INVALID_CONFIG + r".*block.x=1025 > 1024"):
        LL.launch_config("k", 1, 1025, 0)
    with pytest.raises(LL.LaunchResourceError, match=INVALID_VALUE + ".*negative dynamic shared memory"):
        LL.launch_config("k", 1, 32, -1)

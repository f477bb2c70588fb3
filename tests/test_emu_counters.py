"""The emulator's counter mode (dflash_cupy/emu/counting.py, cuda_emu.h
"counters"): micro-kernels whose counts are known by hand, sampling, counting
off, and one real kernel (gemm_stream) against what its header claims."""
import time

import numpy as np
import pytest

from dflash_cupy import backends, kernels
from dflash_cupy.emu.counting import count_launch
from profiling import counters as ctr

SRC = r"""
#include <cuda_fp16.h>
#include "mma.cuh"
#include "ldmatrix.cuh"

extern "C" __global__ void copy4(const float4* a, float4* b, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) b[i] = a[i];
}
// lane i reads a[8 i]: one float of every 32-byte sector
extern "C" __global__ void stride8(const float* a, float* b, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) b[i] = a[8 * i];
}
// one warp: a store and a load of s[lane * stride] (4 bytes), stride 1 / 2 / 32
extern "C" __global__ void bank(float* out, int stride) {
    __shared__ float s[32 * 33];
    s[threadIdx.x * stride] = (float)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = s[threadIdx.x * stride];
}
// a 32 x 32 tile; lane l reads column c of row l, swizzled (c ^ l) or not
extern "C" __global__ void column(float* out, int swizzle, int c) {
    __shared__ float t[32 * 32];
    for (int i = threadIdx.x; i < 32 * 32; i += 32) t[i] = (float)i;
    __syncthreads();
    const int l = threadIdx.x;
    out[l] = t[l * 32 + (swizzle ? (c ^ l) : c)];
}
// 16-byte shared loads, lane l at 16 * (l * stride4) bytes
extern "C" __global__ void wide(float* out, int stride4) {
    __shared__ float4 v[32 * 8];
    for (int i = threadIdx.x; i < 32 * 8; i += 32) v[i] = make_float4(1.0f, 2.0f, 3.0f, (float)i);
    __syncthreads();
    const float4 r = v[threadIdx.x * stride4];
    out[threadIdx.x] = r.x + r.y + r.z + r.w;
}
// `reps` mma.sync per warp
extern "C" __global__ void mmas(float* out, int reps) {
    unsigned int a[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
    unsigned int b[2] = {0x3c003c00u, 0x3c003c00u};
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int r = 0; r < reps; r++) mma_m16n8k16_f16(d, a, b, d);
    out[blockIdx.x * blockDim.x + threadIdx.x] = d[0];
}
// `reps` barriers per block
extern "C" __global__ void barriers(float* out, int reps) {
    __shared__ float s[256];
    float acc = 0.0f;
    for (int r = 0; r < reps; r++) {
        s[threadIdx.x] = (float)(r + threadIdx.x);
        __syncthreads();
        acc += s[(threadIdx.x + 1) % blockDim.x];
        __syncthreads();
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
// ldmatrix.x4.trans: matrix rows `row_bytes` apart (16: each matrix 128 contiguous bytes)
extern "C" __global__ void ldsm(float* out, int row_bytes) {
    __shared__ __align__(16) __half m[32 * 64];
    for (int i = threadIdx.x; i < 32 * 64; i += 32) m[i] = __float2half((float)(i % 7));
    __syncthreads();
    unsigned int r[4];
    ldmatrix_x4_trans(r, m + threadIdx.x * (row_bytes / 2));
    out[threadIdx.x] = (float)(r[0] & 0xffffu) + (float)(r[3] >> 16);
}
// a block-uniform reduction with shared memory and float math (for bit-identical checks)
extern "C" __global__ void reduce(const float* x, float* y, int n) {
    __shared__ float s[128];
    const int i = blockIdx.x * 128 + threadIdx.x;
    s[threadIdx.x] = i < n ? x[i] * 1.0001f + 0.5f : 0.0f;
    __syncthreads();
    for (int h = 64; h > 0; h >>= 1) {
        if (threadIdx.x < h) s[threadIdx.x] += s[threadIdx.x + h];
        __syncthreads();
    }
    if (threadIdx.x == 0) y[blockIdx.x] = sqrtf(fabsf(s[0]));
}
// warp 0 loops n times, the other warps once (a serial walk one warp runs)
extern "C" __global__ void lone(const float* a, float* out, int n) {
    float s = 0.0f;
    const int reps = threadIdx.x < 32 ? n : 1;
    for (int i = 0; i < reps; ++i) s += a[i];
    out[threadIdx.x] = s;
}
"""


@pytest.fixture(scope="module")
def be():
    b = backends.get("emulated")
    b.synchronize()
    return b


@pytest.fixture(scope="module")
def mod(be):
    return be.compile(SRC, kernels.compile_options(), filename="emu_counters_test.cu")


@pytest.mark.parametrize("n", [4096, 4080])
def test_coalesced_float4_copy_uses_every_sector_once(be, mod, n):
    a = be.asarray(np.arange(4 * n, dtype=np.float32))
    b = be.zeros((4 * n,), np.float32)
    c = count_launch(mod.get_function("copy4"), (-(-n // 128),), (128,), [a, b, np.int32(n)])
    nbytes = 16 * n
    # one request per warp each way (the float4 counts once, not as its 4 floats), 16 sectors
    # each; with n = 4080 the last warp has 16 active lanes: one request, 8 sectors
    assert (c.gld_requests, c.gst_requests) == (-(-n // 32), -(-n // 32))
    assert c.gld_sectors == c.gst_sectors == nbytes // 32
    assert c.gld_bytes == c.gst_bytes == nbytes
    assert c.arrays["a"].read == c.arrays["a"].read_distinct == nbytes
    assert c.arrays["b"].written_distinct == nbytes and c.arrays["b"].read == 0
    assert c.arrays["a"].ld_sectors == nbytes // 32
    assert (c.sld_requests, c.mma, c.barriers, c.other_accesses) == (0, 0, 0, 0)
    assert np.array_equal(be.to_numpy(b), be.to_numpy(a))   # counting runs the kernel for real


def test_stride_8_floats_uses_one_eighth_of_each_sector(be, mod):
    n = 512
    a = be.asarray(np.arange(8 * n, dtype=np.float32))
    b = be.zeros((n,), np.float32)
    c = count_launch(mod.get_function("stride8"), (n // 128,), (128,), [a, b, np.int32(n)])
    assert c.gld_requests == n // 32
    assert c.gld_sectors == n                 # 32 sectors per request: one per lane
    assert c.gld_bytes * 8 == c.gld_sectors * 32
    assert c.gst_sectors * 32 == c.gst_bytes == 4 * n   # the store is coalesced
    assert c.arrays["a"].read_distinct == 4 * n
    assert np.array_equal(be.to_numpy(b), np.arange(0, 8 * n, 8, dtype=np.float32))


@pytest.mark.parametrize("stride,ways", [(1, 1), (2, 2), (32, 32), (33, 1)])
def test_bank_conflicts_of_strided_words(be, mod, stride, ways):
    out = be.zeros((32,), np.float32)
    c = count_launch(mod.get_function("bank"), (1,), (32,), [out, np.int32(stride)])
    assert (c.sld_requests, c.sst_requests) == (1, 1)
    assert (c.sld_wavefronts, c.sst_wavefronts) == (ways, ways)
    assert c.sld_ideal == c.sst_ideal == 1
    assert c.barriers == 1
    assert np.array_equal(be.to_numpy(out), np.arange(32, dtype=np.float32))


@pytest.mark.parametrize("c0", [0, 5])
def test_swizzled_column_read_is_conflict_free(be, mod, c0):
    out = be.zeros((32,), np.float32)
    plain = count_launch(mod.get_function("column"), (1,), (32,), [out, np.int32(0), np.int32(c0)])
    sw = count_launch(mod.get_function("column"), (1,), (32,), [out, np.int32(1), np.int32(c0)])
    # fill: 32 conflict-free row stores in both; the column read: 32-way, or 1 swizzled
    assert plain.sst_wavefronts == sw.sst_wavefronts == 32 == sw.sst_requests
    assert (plain.sld_requests, plain.sld_wavefronts) == (1, 32)
    assert (sw.sld_requests, sw.sld_wavefronts, sw.sld_ideal) == (1, 1, 1)
    lanes = np.arange(32)
    assert np.array_equal(be.to_numpy(out), (lanes * 32 + (c0 ^ lanes)).astype(np.float32))


@pytest.mark.parametrize("stride4,wf", [(1, 4), (2, 8), (8, 32)])
def test_16_byte_shared_loads_in_quarter_warp_phases(be, mod, stride4, wf):
    """8 lanes per phase for 16-byte accesses: consecutive float4s need 4 wavefronts
    (the minimum); lanes 32 bytes apart 8 (2-way); 128 bytes apart 32 (8-way)."""
    out = be.zeros((32,), np.float32)
    c = count_launch(mod.get_function("wide"), (1,), (32,), [out, np.int32(stride4)])
    assert (c.sld_requests, c.sld_wavefronts, c.sld_ideal) == (1, wf, 4)
    # the same rule as profiling/counters.py
    assert ctr.smem_wavefronts([16 * stride4 * l for l in range(32)], 16) == wf


@pytest.mark.parametrize("row_bytes,wf", [(16, 4), (128, 32)])
def test_ldmatrix_counts_its_rows_not_its_emulated_gathers(be, mod, row_bytes, wf):
    out = be.zeros((32,), np.float32)
    c = count_launch(mod.get_function("ldsm"), (1,), (32,), [out, np.int32(row_bytes)])
    fill = 32 * 64 * 2 // 64   # 2-byte stores, 32 lanes, conflict-free: one wavefront each
    assert c.sst_requests == c.sst_wavefronts == fill
    assert (c.sld_requests, c.sld_wavefronts, c.sld_ideal) == (1, wf, 4)


def test_mma_count(be, mod):
    out = be.zeros((3 * 64,), np.float32)
    c = count_launch(mod.get_function("mmas"), (3,), (64,), [out, np.int32(5)])
    assert c.mma == 3 * 2 * 5          # blocks x warps x reps
    assert np.all(be.to_numpy(out) == 5 * 16.0)


def test_sites_count_the_busiest_warp(be, mod):
    """A site's warp-level executions and its busiest warp's: warp 0 loads 9 times, the other
    three warps once (profiling.sass_phases bounds a loop one warp runs by that warp's count)."""
    from dflash_cupy.emu.counting import resolve_sites

    a, out = be.asarray(np.arange(16, dtype=np.float32)), be.zeros((128,), np.float32)
    c = count_launch(mod.get_function("lone"), (1,), (128,), [a, out, np.int32(9)])
    resolve_sites(c)
    loads = [s for s in c.sites if s.kind == "global load"]
    assert len(loads) == 1, c.sites
    assert (loads[0].requests, loads[0].warp_requests) == (9 + 3, 9)
    stores = [s for s in c.sites if s.kind == "global store"]
    assert [(s.requests, s.warp_requests) for s in stores] == [(4, 1)]
    assert np.all(be.to_numpy(out)[:32] == np.arange(9).sum()) and np.all(be.to_numpy(out)[32:] == 0.0)


def test_barrier_count(be, mod):
    out = be.zeros((4 * 64,), np.float32)
    c = count_launch(mod.get_function("barriers"), (4,), (64,), [out, np.int32(3)])
    assert c.barriers == 4 * 2 * 3     # per block, not per thread
    # shared traffic: per warp and rep one store and one load, conflict-free
    assert c.sst_requests == c.sld_requests == 4 * 2 * 3
    assert c.sld_wavefronts == c.sld_requests


def test_sampling_a_uniform_grid_scales_exactly(be, mod):
    n_blocks, n = 1000, 1000 * 128
    a = be.asarray(np.arange(4 * n, dtype=np.float32))
    b = be.zeros((4 * n,), np.float32)
    k = mod.get_function("copy4")
    full = count_launch(k, (n_blocks,), (128,), [a, b, np.int32(n)])
    be.to_numpy(b)
    b2 = be.asarray(np.full(4 * n, -1.0, np.float32))
    sample = ctr.sample_blocks((n_blocks, 1, 1), n=8, seed=3)
    part = count_launch(k, (n_blocks,), (128,), [a, b2, np.int32(n)], blocks=sample)
    assert part.blocks_run == 8 and full.blocks_run == n_blocks
    kc = ctr.KernelCounters("copy4", "emulator", n_blocks)
    for f in ("gld_requests", "gld_sectors", "gld_bytes", "gst_requests", "gst_sectors", "gst_bytes"):
        setattr(kc, f, getattr(part, f))
    ctr.scale_sample(kc, part.blocks_run)
    for f in ("gld_requests", "gld_sectors", "gld_bytes", "gst_requests", "gst_sectors", "gst_bytes"):
        assert getattr(kc, f) == getattr(full, f), f
    # only the sampled blocks wrote their outputs
    got = be.to_numpy(b2).reshape(n_blocks, -1)
    ran = sorted(x for x, _, _ in sample)
    assert np.array_equal(got[ran], be.to_numpy(a).reshape(n_blocks, -1)[ran])
    assert np.all(np.delete(got, ran, axis=0) == -1.0)


def test_counting_off_leaves_results_and_speed_unchanged(be, mod):
    n = 128 * 400
    x = be.asarray(np.random.default_rng(11).standard_normal(n).astype(np.float32))
    k = mod.get_function("reduce")
    outs, times = [], []

    def plain():
        y = be.zeros((400,), np.float32)
        be.synchronize()
        t = time.perf_counter()
        k((400,), (128,), (x, y, np.int32(n)))
        be.synchronize()
        times.append(time.perf_counter() - t)
        return be.to_numpy(y)

    before = [plain() for _ in range(3)]
    t_before = sorted(times)[1]
    y = be.zeros((400,), np.float32)
    c = count_launch(k, (400,), (128,), [x, y, np.int32(n)])
    assert c.barriers == 400 * 8 and c.mma == 0
    counted = be.to_numpy(y)
    times.clear()
    after = [plain() for _ in range(3)]
    t_after = sorted(times)[1]
    for r in before[1:] + after + [counted]:
        assert r.tobytes() == before[0].tobytes()   # bit-identical
    assert t_after < 1.5 * t_before + 0.01, (t_before, t_after)
    # counting lives in a separate build: the ordinary module has none of it
    assert not hasattr(mod._lib, "emu_launch_counted")
    from dflash_cupy.emu.counting import counting_module
    assert hasattr(counting_module(mod)._lib, "emu_launch_counted")


def test_bad_block_lists_raise(be, mod):
    out = be.zeros((64,), np.float32)
    k = mod.get_function("mmas")
    with pytest.raises(ValueError, match="outside the grid"):
        count_launch(k, (2,), (32,), [out, np.int32(1)], blocks=[(2, 0, 0)])
    with pytest.raises(ValueError, match="outside the grid"):
        count_launch(k, (2,), (32,), [out, np.int32(1)], blocks=[5])
    with pytest.raises(ValueError, match="twice"):
        count_launch(k, (2,), (32,), [out, np.int32(1)], blocks=[0, (0, 0, 0)])
    with pytest.raises(ValueError, match="empty"):
        count_launch(k, (2,), (32,), [out, np.int32(1)], blocks=[])
    with pytest.raises(TypeError, match="emulated backend"):
        count_launch(object(), (2,), (32,), [out, np.int32(1)])


# ---------------------------------------------------------------- a real kernel
@pytest.mark.parametrize("N,K,M", [(512, 256, 16), (384, 1024, 16)])
def test_gemm_stream_weight_sectors_and_x_tile_wavefronts(be, N, K, M):
    """gemm_stream.cu's header: every weight sector is requested once (4 lanes of a
    row cover 64 contiguous bytes per instruction) and the x-tile reads of the MMA
    loop are conflict-free: 4 wavefronts per 16-byte warp-level read (the minimum)."""
    from dflash_cupy.ops import gemm_stream as gs
    from tests.support.gemm import by_field, no_conv

    sk = gs.StreamKernels(be, gs.GemmVariant(N, K, "bf16"), max_m=M)
    p = sk.plan(M)
    rng = np.random.default_rng(5)
    x = be.asarray(rng.standard_normal((M, K)).astype(np.float32))
    w = be.asarray(rng.integers(0, 1 << 15, (N, K)).astype(np.uint16))
    y = be.zeros((M, N), np.float32)
    args = (x, w, y, y, np.int32(M), np.int32(N), np.int32(p.kz), np.int32(p.kt), sk._ws, sk._counters,
            sk._counters, np.int32(0), x, np.float32(0), np.int32(M), sk._counters, np.int32(0),
            x, np.int32(M), sk._ws, np.int32(0)) + no_conv(sk)   # one input, no ln_lo, no convolution
    c = count_launch(sk._kernels[p.mt], p.grid, (256, 1, 1), by_field(sk._kernels[p.mt], args), p.smem)
    # the grouping of lanes into instructions does not depend on the fiber schedule
    c2 = count_launch(sk._kernels[p.mt], p.grid, (256, 1, 1), by_field(sk._kernels[p.mt], args), p.smem, order="shuffle", seed=9)
    assert c2 == c
    wc = c.arrays["w"]
    assert wc.ld_sectors == N * K * 2 // 32 == wc.read_distinct // 32
    assert wc.read == N * K * 2                        # no weight byte requested twice
    assert wc.ld_requests * 4 * 8 * 16 == N * K * 2    # 8 rows x 4 lanes x 16 B per request
    # the MMA loop's x-tile reads are the only shared loads of this variant
    assert c.sld_requests > 0
    assert c.sld_wavefronts == 4 * c.sld_requests == c.sld_ideal
    assert c.sst_wavefronts == c.sst_ideal              # staging stores: conflict-free too
    # the MMAs: per warp, 64-k step and 16-row tile: 4 per 8-row weight tile, x hi + lo
    steps = -(-K // gs.KSTEP)
    assert c.mma == p.grid[0] * gs.WARPS * steps * gs.WTILES * 4 * 2 * p.tiles


# ---------------------------------------------------------------- the cost model's source
def test_perf_model_with_emulated_counters_matches_the_static_gemm_models(capsys):
    """Every launch of a (tiny) step counted by the emulator at its real shape; the
    gemm_stream variants without a folded RMSNorm have hand-written access models
    that must agree with the measurement exactly (all blocks run at this size)."""
    from profiling import perf_model as pm
    from profiling.emulated_counters import EmulatedSource
    from profiling.hw_params import get_gpu

    src = EmulatedSource()
    m = pm.model_step("tiny", 64, get_gpu("H200"), counter_source=src)
    launches = [t for t in m["nodes"] if t.kernel != "memcpy"]
    assert launches and all(t.counters.source.startswith("emulator") for t in launches)
    assert src.runs <= len(launches)           # repeated launches (the layers) counted once
    checked = 0
    for t in launches:
        c, s = t.counters, t.counters.compare
        assert s["source"].startswith("static estimate")
        if t.kernel == "gemm_stream":
            assert c.mma == s["mma"] > 0, t.label
            if t.label.split("[")[1][:-1] in ("fc", "o", "down"):
                for f in ("gld_requests", "smem_wavefronts", "barriers"):
                    assert getattr(c, f) == s[f], (t.label, f)
                checked += 1
    assert checked >= 3
    assert pm.main(["--drafter", "tiny", "--windows", "64", "--counters", "emulated", "--sample", "4"]) == 0
    out = capsys.readouterr()
    assert "counters: emulator vs static" in out.out and "emulated counters:" in out.err
    with pytest.raises(SystemExit):
        pm.main(["--drafter", "tiny", "--windows", "64", "--sample", "1"])


def test_sites_name_the_wasteful_instruction(be, mod):
    """Per-site counts, resolved to the kernel source's file:line from the counting
    twin's line tables: the strided load is 8x its minimum sectors, the store 1x."""
    import shutil

    from dflash_cupy.emu.counting import resolve_sites

    n = 512
    a = be.asarray(np.arange(8 * n, dtype=np.float32))
    b = be.zeros((n,), np.float32)
    c = count_launch(mod.get_function("stride8"), (n // 128,), (128,), [a, b, np.int32(n)])
    by = {s.kind: s for s in c.sites}
    assert set(by) == {"global load", "global store"}
    ld, st = by["global load"], by["global store"]
    assert (ld.requests, ld.units, ld.ideal, ld.width) == (n // 32, n, n // 8, 4) and ld.waste == 8.0
    assert st.waste == 1.0 and st.units == c.gst_sectors
    if shutil.which("addr2line"):
        resolve_sites(c)
        line = 1 + SRC.split("\n").index("    if (i < n) b[i] = a[8 * i];")
        assert ld.where == st.where == f"emu_counters_test.cu:{line} (stride8)"


def test_a_launch_the_emulator_cannot_run_keeps_its_static_estimate():
    from profiling.emulated_counters import EmulatedSource
    from profiling.step_trace import trace_step
    from profiling.common import drafter_config

    plan = trace_step(drafter_config("tiny"), 64)
    L = next(x for x in plan.launches if x.kernel == "rmsnorm")
    L.defines = dict(L.defines, NORM_D=-1)     # does not compile
    src = EmulatedSource()
    c = src(L)
    assert c.source.startswith("static estimate") and "failed" in c.notes[-1]
    assert src.failures and src.failures[0][0] == "rmsnorm"


def test_a_site_in_an_emulator_header_read_from_another_path_is_not_the_kernel_frame():
    """addr2line's inline chain, innermost first: the emulator's ``__ldg`` inlined into the
    kernel. A precompiled header built by another checkout names the header by that
    checkout's path; it is still the emulator's frame, and the kernel's line is picked."""
    from dflash_cupy.emu.build import EMU_DIR
    from dflash_cupy.emu.counting import kernel_frame

    names = {f.name for f in EMU_DIR.iterdir()}
    assert "emu_language.h" in names
    chain = [("__ldg<float>", "/elsewhere/checkout/dflash_cupy/emu/cuda/emu_language.h:158"),
             ("gemm_stream", "/work/x/cuda_src/gemm_stream.cu:418 (discriminator 2)")]
    assert kernel_frame(chain, names) == chain[1]
    assert kernel_frame(chain[:1], names) == chain[0]          # only emulator frames: the outermost
    assert kernel_frame([("??", "??:0"), chain[1]], names) == chain[1]
    assert kernel_frame([], names) is None

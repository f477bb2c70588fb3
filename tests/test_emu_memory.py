"""The emulator's memory and warp rules (issue 8, parts 3 and 4).

Each rule has a kernel that breaks it, which the emulator must catch (the
message names kernel, block, thread and array, or the result shows poison),
and its corrected twin, which must pass with the right result."""
import numpy as np
import pytest

from dflash_cupy.backends import KernelLaunchError


class _SyncEmu:
    """The emulated backend with every launch and memset waited for: these tests
    read arrays on the host right after a launch and expect its error at once
    (stream ordering has its own tests, tests/test_streams.py)."""

    def __init__(self, be):
        self._be = be

    def __getattr__(self, name):
        return getattr(self._be, name)

    def __setattr__(self, name, value):
        if name == "_be":
            object.__setattr__(self, name, value)
        else:
            setattr(self._be, name, value)

    def zeros(self, shape, dtype):
        a = self._be.zeros(shape, dtype)
        self._be.synchronize()
        return a

    def compile(self, *a, **kw):
        mod, be = self._be.compile(*a, **kw), self._be

        class _Mod:
            def get_function(self, name):
                k = mod.get_function(name)

                def launch(*args, **kwargs):
                    k(*args, **kwargs)
                    be.synchronize()
                return launch
        return _Mod()


@pytest.fixture
def sync_emu(emu):
    emu.synchronize()
    return _SyncEmu(emu)

# ---------------------------------------------------------------- bounds

BOUNDS_SRC = r"""
#include <cuda_fp16.h>
// Only thread (tx, 0, 0) of block (bx, 0, 0) touches element i of a.
extern "C" __global__ void read_at(const ELEM* a, ELEM* out, int i, int bx, int tx) {
    if (blockIdx.x == bx && threadIdx.x == tx) out[0] = a[i];
}
extern "C" __global__ void write_at(ELEM* a, const ELEM* val, int i, int bx, int tx) {
    if (blockIdx.x == bx && threadIdx.x == tx) a[i] = val[0];
}
"""

_CTYPES = {np.int8: "signed char", np.int32: "int", np.float16: "__half", np.float64: "double"}


def _bounds_module(sync_emu, dtype):
    return sync_emu.compile(BOUNDS_SRC, [f"-DELEM={_CTYPES[dtype]}"], filename=f"bounds_{np.dtype(dtype).name}.cu")


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.float16, np.float64])
@pytest.mark.parametrize("n", [1, 3, 5, 16, 50, 1030])
def test_every_out_of_bounds_index_is_caught(sync_emu, dtype, n):
    mod = _bounds_module(sync_emu, dtype)
    read, write = mod.get_function("read_at"), mod.get_function("write_at")
    a = sync_emu.asarray(np.arange(n).astype(dtype))
    out = sync_emu.zeros((1,), dtype)
    val = sync_emu.asarray(np.array([7], dtype))
    where = r"in block \(1,0,0\) thread \(37,0,0\)"
    for i, side in ((-1, "before the start"), (n, "past the end"), (-3, "before the start"),
                    (n + 2, "past the end")):
        args = (np.int32(i), np.int32(1), np.int32(37))
        with pytest.raises(KernelLaunchError, match=rf"kernel read_at: out-of-bounds load .* {side} of array `a` "
                                                    rf".*{where}"):
            read((2,), (64,), (a, out, *args))
        with pytest.raises(KernelLaunchError, match=rf"kernel write_at: out-of-bounds store .* {side} of array "
                                                    rf"`a` .*{where}"):
            write((2,), (64,), (a, val, *args))
    # the twins: the first and the last element are fine, and nothing was clobbered
    for i in (0, n - 1):
        read((2,), (64,), (a, out, np.int32(i), np.int32(1), np.int32(37)))
        assert out[0] == np.arange(n).astype(dtype)[i]
    write((2,), (64,), (a, val, np.int32(n - 1), np.int32(1), np.int32(37)))
    expect = np.arange(n).astype(dtype)
    expect[n - 1] = 7
    np.testing.assert_array_equal(a, expect)


def test_out_of_bounds_through_a_view_is_judged_by_its_allocation(sync_emu):
    # A pointer into the middle of an allocation may reach anywhere inside it (as
    # on the GPU), but not past the allocation.
    mod = _bounds_module(sync_emu, np.int32)
    base = sync_emu.asarray(np.arange(10, dtype=np.int32))
    out = sync_emu.zeros((1,), np.int32)
    mod.get_function("read_at")((1,), (32,), (base[4:], out, np.int32(-4), np.int32(0), np.int32(0)))
    assert out[0] == 0
    with pytest.raises(KernelLaunchError, match=r"before the start of array `a` .*shape=\(10,\)"):
        mod.get_function("read_at")((1,), (32,), (base[4:], out, np.int32(-5), np.int32(0), np.int32(0)))


# ---------------------------------------------------------------- vector alignment

ALIGN_SRC = r"""
#include <cuda_fp16.h>
extern "C" __global__ void load_vec(const float* x, float* y, int off) {
    if (threadIdx.x != 5) return;
#if KIND == 0
    const float4 v = *reinterpret_cast<const float4*>(x + off);
    y[0] = v.x + v.w;                 // g++ keeps only the two scalar loads it needs
#elif KIND == 1
    const uint2 v = *reinterpret_cast<const uint2*>(x + off);
    y[0] = __uint_as_float(v.y);
#elif KIND == 2
    const uint4 v = *reinterpret_cast<const uint4*>(x + off);
    y[0] = __uint_as_float(v.x);
#else
    const __half2 v = *reinterpret_cast<const __half2*>(reinterpret_cast<const __half*>(x) + off);
    y[0] = __low2float(v);
#endif
}
extern "C" __global__ void store_vec(float* y, int off) {
    if (threadIdx.x == 5) *reinterpret_cast<float4*>(y + off) = make_float4(1.f, 2.f, 3.f, 4.f);
}
extern "C" __global__ void shared_vec(const float* x, float* y, int off) {
    __shared__ __align__(16) float s[64];
    s[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 5) {
        const float4 v = *reinterpret_cast<const float4*>(s + off);
        y[0] = v.x + v.y + v.z + v.w;
    }
}
"""


@pytest.mark.parametrize("kind,type_name,nbytes,bad,good", [
    (0, "float4", 16, 1, 4), (0, "float4", 16, 2, 8), (1, "uint2", 8, 1, 2), (2, "uint4", 16, 3, 4),
    (3, "__half2", 4, 1, 2)])
def test_misaligned_vector_loads_are_caught(sync_emu, kind, type_name, nbytes, bad, good):
    mod = sync_emu.compile(ALIGN_SRC, [f"-DKIND={kind}"], filename="align.cu")
    x = sync_emu.asarray(np.arange(64, dtype=np.float32))
    y = sync_emu.zeros((4,), np.float32)
    with pytest.raises(KernelLaunchError, match=rf"kernel load_vec: misaligned {nbytes}-byte {type_name} load .* "
                                                rf"in `x` .*in block \(0,0,0\) thread \(5,0,0\)"):
        mod.get_function("load_vec")((1,), (64,), (x, y, np.int32(bad)))
    mod.get_function("load_vec")((1,), (64,), (x, y, np.int32(good)))
    host = np.arange(64, dtype=np.float32)
    expect = {0: host[good] + host[good + 3], 1: host[good + 1],
              2: host[good], 3: float(host.view(np.float16)[good])}[kind]
    assert y[0] == np.float32(expect)


def test_misaligned_vector_stores_and_shared_loads_are_caught(sync_emu):
    mod = sync_emu.compile(ALIGN_SRC, ["-DKIND=0"], filename="align.cu")
    y = sync_emu.zeros((16,), np.float32)
    with pytest.raises(KernelLaunchError, match=r"kernel store_vec: misaligned 16-byte float4 store .* in `y` "
                                                r".*thread \(5,0,0\)"):
        mod.get_function("store_vec")((1,), (32,), (y, np.int32(2)))
    mod.get_function("store_vec")((1,), (32,), (y, np.int32(4)))
    assert y[4:8].tolist() == [1, 2, 3, 4]
    x = sync_emu.asarray(np.arange(64, dtype=np.float32))
    with pytest.raises(KernelLaunchError, match=r"kernel shared_vec: misaligned 16-byte float4 load .* "
                                                r"in shared or local memory in block \(0,0,0\) thread \(5,0,0\)"):
        mod.get_function("shared_vec")((1,), (64,), (x, y, np.int32(6)))
    mod.get_function("shared_vec")((1,), (64,), (x, y, np.int32(8)))
    assert y[0] == 8 + 9 + 10 + 11


# ---------------------------------------------------------------- poisoning

STATIC_SMEM_SRC = r"""
// Block 0 fills the tile; the other blocks read it without writing it.
extern "C" __global__ void stale_tile(unsigned int* out, int all_write) {
    __shared__ unsigned int tile[64];
    if (blockIdx.x == 0 || all_write) tile[threadIdx.x] = 1000u + threadIdx.x;
    __syncthreads();
    out[blockIdx.x * 64 + threadIdx.x] = tile[63 - threadIdx.x];
}
"""


@pytest.mark.parametrize("threads", [1, 4])
def test_static_shared_memory_is_poisoned_before_each_block(sync_emu, monkeypatch, threads):
    monkeypatch.setattr(sync_emu._be, "threads", threads)
    k = sync_emu.compile(STATIC_SMEM_SRC, filename="static_smem.cu").get_function("stale_tile")
    out = sync_emu.zeros((8 * 64,), np.uint32)
    k((8,), (64,), (out, np.int32(0)))
    got = out.reshape(8, 64)
    assert (got[0] == 1000 + np.arange(63, -1, -1)).all()
    assert (got[1:] == 0xFFFFFFFF).all(), "a block saw another block's (or zeroed) static shared memory"
    k((8,), (64,), (out, np.int32(1)))  # the twin: every block writes before it reads
    assert (out.reshape(8, 64) == 1000 + np.arange(63, -1, -1)).all()


READ_UNWRITTEN_SRC = r"""
extern "C" __global__ void partial_fill(float* y, int n_written) {
    if ((int)threadIdx.x < n_written) y[threadIdx.x] = 1.0f;
}
extern "C" __global__ void total(const float* y, float* out, int n) {
    float s = 0.f;
    for (int i = 0; i < n; i++) s += y[i];
    out[0] = s;
}
"""


def test_empty_device_memory_is_poisoned(sync_emu, monkeypatch):
    mod = sync_emu.compile(READ_UNWRITTEN_SRC, filename="unwritten.cu")
    fill, total = mod.get_function("partial_fill"), mod.get_function("total")
    out = sync_emu.zeros((1,), np.float32)
    y = sync_emu.empty((32,), np.float32)
    assert (y.view(np.uint32) == 0xFFFFFFFF).all() and (sync_emu.empty((3,), np.int32) == -1).all()
    fill((1,), (32,), (y, np.int32(31)))          # the kernel forgets one element ...
    total((1,), (32,), (y, out, np.int32(32)))
    assert np.isnan(out[0])                        # ... and the sum shows it
    fill((1,), (32,), (y, np.int32(32)))          # the twin writes all of them
    total((1,), (32,), (y, out, np.int32(32)))
    assert out[0] == 32
    assert (sync_emu.zeros((5,), np.float32) == 0).all()
    monkeypatch.setenv("DFLASH_CUPY_EMU_POISON", "0")   # the option off: fresh pages read as zero
    assert (sync_emu.empty((7,), np.float32) == 0).all()
    monkeypatch.setenv("DFLASH_CUPY_EMU_POISON", "maybe")
    with pytest.raises(ValueError, match="DFLASH_CUPY_EMU_POISON"):
        sync_emu.empty((7,), np.float32)


# ---------------------------------------------------------------- warps

PARTIAL_MASK_SRC = r"""
// Lanes 0-15 rotate values among themselves; lanes 16-31 vote among themselves
// at the same time; then the whole warp meets at __syncwarp().
extern "C" __global__ void halves(const int* x, int* y) {
    const int lane = threadIdx.x & 31;
    int v = x[threadIdx.x];
    if (lane < 16) v = __shfl_sync(0x0000ffffu, v, (lane + 1) & 15);
    else v = (int)__ballot_sync(0xffff0000u, v & 1);
    __syncwarp();
    y[threadIdx.x] = v;
}
// Lane 5 names only the low half while the others name the whole warp.
extern "C" __global__ void mismatched(const int* x, int* y) {
    const unsigned mask = (threadIdx.x & 31) == 5 ? 0x0000ffffu : 0xffffffffu;
    y[threadIdx.x] = __shfl_xor_sync(mask, x[threadIdx.x], 1);
}
// Every lane names lane 0 only.
extern "C" __global__ void not_in_mask(const int* x, int* y) {
    y[threadIdx.x] = __shfl_sync(0x1u, x[threadIdx.x], 0);
}
"""


def test_partial_mask_collectives_follow_ptx(backend, rng):
    mod = backend.compile(PARTIAL_MASK_SRC, filename="partial_mask.cu")
    xh = rng.integers(0, 1000, 64).astype(np.int32)
    x, y = backend.asarray(xh), backend.zeros((64,), np.int32)
    mod.get_function("halves")((1,), (64,), (x, y))
    expect = np.empty(64, np.int64)
    for w in (0, 32):
        for lane in range(32):
            if lane < 16:
                expect[w + lane] = xh[w + ((lane + 1) & 15)]
            else:
                bits = sum(1 << l for l in range(16, 32) if xh[w + l] & 1)
                expect[w + lane] = np.uint32(bits).view(np.int32)
    np.testing.assert_array_equal(backend.to_numpy(y), expect)


def test_mismatched_masks_are_reported(sync_emu):
    mod = sync_emu.compile(PARTIAL_MASK_SRC, filename="partial_mask.cu")
    x, y = sync_emu.asarray(np.arange(32, dtype=np.int32)), sync_emu.zeros((32,), np.int32)
    with pytest.raises(KernelLaunchError, match=r"kernel mismatched: __shfl_xor_sync in warp 0: lane \d+ passes "
                                                r"mask 0x[0-9a-f]+ but lane \d+ passes 0x[0-9a-f]+"):
        mod.get_function("mismatched")((1,), (32,), (x, y))
    with pytest.raises(KernelLaunchError, match=r"kernel not_in_mask: __shfl_sync in warp 0: lane \d+ "
                                                r"\(thread \d+\) passes mask 0x00000001, which leaves"):
        mod.get_function("not_in_mask")((1,), (32,), (x, y))


WARP_EXCHANGE_SRC = r"""
// Each lane publishes a value in static shared memory and reads its neighbour's:
// without __syncwarp the neighbour may not have written yet (lanes of a warp
// run in any interleaving between warp-level synchronisation points).
extern "C" __global__ void rotate(const float* x, float* y) {
    __shared__ float s[64];
    const int lane = threadIdx.x & 31, base = threadIdx.x - lane;
    s[threadIdx.x] = x[threadIdx.x];
#ifdef WITH_SYNCWARP
    __syncwarp();
#endif
    y[threadIdx.x] = s[base + ((lane + 1) & 31)];
}
"""


@pytest.mark.parametrize("schedule", ["shuffle", "forward", "reverse"])
def test_intra_warp_exchange_needs_syncwarp(sync_emu, monkeypatch, schedule):
    monkeypatch.setattr(sync_emu._be, "schedule", schedule)
    xh = np.arange(64, dtype=np.float32)
    expect = np.concatenate([np.roll(xh[:32], -1), np.roll(xh[32:], -1)])
    for defines, should_pass in ((["-DWITH_SYNCWARP=1"], True), ([], False)):
        y = sync_emu.zeros((64,), np.float32)
        sync_emu.compile(WARP_EXCHANGE_SRC, defines, filename="exchange.cu").get_function("rotate")(
            (1,), (64,), (sync_emu.asarray(xh), y))
        assert np.array_equal(y, expect) == should_pass, f"{schedule} {defines}: {y}"
        if not should_pass:
            assert np.isnan(y).any()  # the early readers saw poison, not stale data


SCRATCH_SRC = r"""
// Each lane stages a value in the slot it is given and reads back the slot it
// is given: private slots (the twin) or one slot the whole warp overwrites
// (the bug). Two index arrays, so neither compiler can forward the store.
extern "C" __global__ void stage(const float* x, const int* wslot, const int* rslot, float* y) {
    __shared__ float tmp[32];
    tmp[wslot[threadIdx.x]] = 2.0f * x[threadIdx.x];
    y[threadIdx.x] = tmp[rslot[threadIdx.x]] + 1.0f;
}
"""


def test_lanes_interleave_between_warp_sync_points(sync_emu, monkeypatch):
    # Running each lane alone up to its next warp-level sync point would hide this
    # bug (every lane reads back its own value); under the shuffled schedule lanes
    # hand over to each other at shared-memory accesses, as a real warp may.
    k = sync_emu.compile(SCRATCH_SRC, filename="scratch.cu").get_function("stage")
    xh = np.arange(32, dtype=np.float32)

    def run(slots):
        y = sync_emu.zeros((32,), np.float32)
        s = sync_emu.asarray(slots.astype(np.int32))
        k((1,), (32,), (sync_emu.asarray(xh), s, sync_emu.asarray(slots.astype(np.int32)), y))
        return np.array_equal(y, 2 * xh + 1)

    # The hand-over point is drawn from the launch's seed: fix the seed sequence (it
    # otherwise depends on how many launches ran before in this process) and give
    # the schedule a few launches to show it.
    monkeypatch.setattr(sync_emu._be, "seed", 12345)
    monkeypatch.setattr(sync_emu._be, "_launch_count", 0)
    assert run(np.arange(32))
    assert not all(run(np.zeros(32)) for _ in range(6))
    monkeypatch.setattr(sync_emu._be, "schedule", "forward")  # the documented limit of the fixed orders
    assert run(np.zeros(32))


def test_reused_addresses_keep_the_newer_registration():
    """A mapping's address may be reused (by another thread) before the old
    mapping's finalizer ran: the late finalizer must not drop the new entry."""
    from dflash_cupy.emu import guarded_memory as M
    base = 0x7E0000000000  # a fake mapping: bookkeeping only
    old = M._register(base, base + 3 * M.PAGE, base + M.PAGE, base + M.PAGE + 16, "device array old")
    new = M._register(base, base + 3 * M.PAGE, base + M.PAGE, base + M.PAGE + 32, "device array new")
    try:
        M._forget(base, old)                      # the old mapping's late finalizer
        assert M._starts.count(base) == 1
        assert M.allocation_of(base + M.PAGE)[4] == "device array new"
    finally:
        M._forget(base, new)
    assert base not in M._starts and M.allocation_of(base + M.PAGE) is None

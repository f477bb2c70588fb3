"""Programmatic dependent launch (PDL): the launch option, the product switch and the
emulator's ordering check (``emu/pdl_order.py``, ``cuda_src/pdl.cuh``).

The emulator runs launches in order, so PDL cannot change a result there; what it can
check is the ordering each kernel promises: nothing it touches before ``pdl_wait()`` may
be written by the kernel before it (or read or written, for its own writes). The check
runs the real step kernels (a single cache and a lane batch, tiny shapes) and catches
deliberately bad kernels (its teeth)."""
import ctypes

import numpy as np
import pytest

from dflash_cupy import DraftKvBatch, DraftKvCache, backends, kernels
from dflash_cupy.backends import cuda_launch_ex
from dflash_cupy.emu import pdl_order as emu_pdl
from dflash_cupy.backends.base import programmatic_launches, resolve_pdl
from dflash_cupy.emu.backend import EmulatedBackend
from tests.support.drafters import Driver, built
from tests.support.lanes import IDLE, make, play


# writer: A; the rest: candidate B's launched with pdl=True right after it
_SRC = r'''
#include "pdl.cuh"
extern "C" __global__ void writer(const float* src, float* a, int n) {
    pdl_wait();
    pdl_launch_dependents();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] = 2.0f * src[i];
}
extern "C" __global__ void good(const float* __restrict__ w, const float* a, float* b, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) prefetch_l2(w + i);          // weights only before the wait
    pdl_wait();
    pdl_launch_dependents();
    if (i < n) b[i] = a[i] + w[i];
}
extern "C" __global__ void read_early(const float* __restrict__ w, const float* a, float* b, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const float v = (i < n) ? a[i] : 0.0f;  // a is the writer's output: read before the wait
    pdl_wait();
    pdl_launch_dependents();
    if (i < n) b[i] = v + w[i];
}
extern "C" __global__ void write_early(const float* __restrict__ w, const float* a, float* src, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i == n - 1) src[i] = 0.0f;          // the writer reads src: written before the wait
    pdl_wait();
    pdl_launch_dependents();
    if (i < n) src[i] = a[i] + w[i];
}
extern "C" __global__ void no_wait(const float* __restrict__ w, const float* a, float* b, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) b[i] = w[i];
}
extern "C" __global__ void early_trigger(const float* __restrict__ w, const float* a, float* b, int n) {
    pdl_launch_dependents();
    pdl_wait();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) b[i] = a[i] + w[i];
}
extern "C" __global__ void one_block_late(const float* __restrict__ w, const float* a, float* b, int n) {
    // block 1 exits at once, block 0 waits; block 2 reads a[64..] before any wait
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (blockIdx.x == 1) return;
    if (blockIdx.x == 2 && i < n) b[i] = a[i];
    pdl_wait();
    if (i < n) b[i] = a[i] + w[i];
}
'''
N = 160


def _setup(check=True):
    be = EmulatedBackend()
    chk = emu_pdl.check_pdl(be) if check else None
    mod = be.compile(_SRC, ["-I" + str(kernels.CUDA_SRC)], filename="pdl_teeth.cu")
    rng = np.random.default_rng(3)
    arrs = dict(src=be.asarray(rng.standard_normal(N).astype(np.float32)),
                w=be.asarray(rng.standard_normal(N).astype(np.float32)),
                a=be.zeros((N,), np.float32), b=be.zeros((N,), np.float32))
    return be, chk, mod, arrs


def _pair(mod, arrs, name, grid=(3,), pdl=True):
    n = np.int32(N)
    mod.get_function("writer")((3,), (64,), (arrs["src"], arrs["a"], n))
    third = arrs["src"] if name == "write_early" else arrs["b"]
    mod.get_function(name)(grid, (64,), (arrs["w"], arrs["a"], third, n), pdl=pdl)


def test_good_kernel_passes_and_prefetch_counts_as_pre_wait_read():
    be, chk, mod, arrs = _setup()
    _pair(mod, arrs, "good")
    be.synchronize()
    src, w = be.to_numpy(arrs["src"]), be.to_numpy(arrs["w"])
    np.testing.assert_array_equal(be.to_numpy(arrs["b"]), 2.0 * src + w)
    rec = chk.log[-1]
    assert (rec.kernel, rec.pdl, rec.after) == ("good", True, "writer")
    assert rec.pre_read_bytes == N and rec.pre_write_bytes == 0 and rec.waited_blocks == rec.blocks == 3


@pytest.mark.parametrize("name, message", [
    ("read_early", "reads a (byte 0) before pdl_wait(), which writer"),
    ("write_early", "writes src (byte 636) before pdl_wait(), which writer"),
    ("no_wait", "no block ran pdl_wait()"),
    ("early_trigger", "ran pdl_launch_dependents() before pdl_wait()"),
    ("one_block_late", "reads a (byte 512) before pdl_wait()"),
])
def test_bad_kernels_are_caught(name, message):
    be, chk, mod, arrs = _setup()
    _pair(mod, arrs, name)
    with pytest.raises(emu_pdl.PdlOrderError, match=message.replace("(", r"\(").replace(")", r"\)")):
        be.synchronize()


@pytest.mark.parametrize("name", ["read_early", "write_early", "no_wait", "early_trigger"])
def test_bad_kernels_pass_without_the_attribute(name):
    # without pdl the previous kernel has ended: the same kernels are fine
    be, chk, mod, arrs = _setup()
    _pair(mod, arrs, name, pdl=False)
    be.synchronize()
    assert chk.log[-1].pdl is False


def test_pdl_launch_after_a_copy_is_refused_by_the_check():
    be, chk, mod, arrs = _setup()
    host = be.pinned_empty((N,), np.float32)
    host[:] = 1.0
    be.copy_h2d_async(arrs["a"], host)
    mod.get_function("good")((3,), (64,), (arrs["w"], arrs["a"], arrs["b"], np.int32(N)), pdl=True)
    with pytest.raises(emu_pdl.PdlOrderError, match="no kernel precedes it"):
        be.synchronize()


def test_pdl_argument_must_be_a_bool():
    be, _, mod, arrs = _setup(check=False)
    with pytest.raises(TypeError, match="pdl must be a bool or None"):
        mod.get_function("good")((3,), (64,), (arrs["w"], arrs["a"], arrs["b"], np.int32(N)), pdl=1)
    with pytest.raises(TypeError, match="on must be a bool"):
        with programmatic_launches("yes"):
            pass
    with pytest.raises(TypeError, match="on must be a bool"):
        emu_pdl.check_pdl(be, 1)
    assert be.pdl_checker is None   # unchanged
    w, lm = built("b")
    for cls, extra in ((DraftKvCache, ()), (DraftKvBatch, (2,))):
        with pytest.raises(TypeError, match=r"pdl must be a bool, got int 1"):
            cls(w, 5, *extra, backend=be, pdl=1)


def test_scope_rule():
    assert resolve_pdl(None, True, "k") is False               # no scope: off
    with programmatic_launches():
        assert resolve_pdl(None, True, "k") is True
        assert resolve_pdl(None, False, "k") is False          # first launch after a copy
        assert resolve_pdl(False, True, "k") is False          # explicit wins
        with programmatic_launches(False):
            assert resolve_pdl(None, True, "k") is False
        assert resolve_pdl(None, True, "k") is True
    assert resolve_pdl(True, False, "k") is True


def _graph_nodes(kv):
    g = kv._graphs[kv._slot]
    return g.nodes


def _assert_pdl_rule(nodes):
    """Every launch right after a launch carries the attribute, no other node does."""
    prev = None
    n_pdl = 0
    for kind, name, pdl in nodes:
        if kind == "launch":
            assert pdl == (prev == "launch"), (name, prev, nodes)
            n_pdl += pdl
        else:
            assert not pdl
        prev = kind
    return n_pdl


@pytest.mark.parametrize("name", ["b", "c"])
def test_cache_with_pdl_is_bit_identical_and_ordered(name):
    be = EmulatedBackend()
    chk = emu_pdl.check_pdl(be)
    on = Driver(be, name, seed=5, pdl=True)
    off = Driver(be, name, seed=5, pdl=False)
    try:
        for c in (3, 4, 5, 2, 5):                 # growth, a rewind
            for d in (on, off):
                if c < d.valid_hi:
                    d.forget_from(c)
                d.step(c)                          # each checked against the oracle too
            for attr in ("hidden_states", "logits", "draft_tokens"):
                a, b = getattr(on.kv, attr), getattr(off.kv, attr)
                if a is not None:
                    np.testing.assert_array_equal(be.to_numpy(a), be.to_numpy(b), err_msg=f"{attr} c={c}")
        nodes = _graph_nodes(on.kv)
        assert _assert_pdl_rule(nodes) >= 8
        assert not any(p for _, _, p in _graph_nodes(off.kv))
        pdl_runs = [r for r in chk.log if r.pdl]
        assert pdl_runs and all(r.after is not None and r.waited_blocks >= 1 for r in pdl_runs)
        # every step kernel writes nothing before its wait; the stream GEMMs prefetch weights
        assert all(r.pre_write_bytes == 0 for r in chk.log)
        if name == "b":   # bf16 weights: the stream GEMM path
            assert any(r.kernel == "gemm_stream" and r.pre_read_bytes > 0 for r in pdl_runs)
    finally:
        on.close()
        off.close()


def test_eager_step_has_no_pdl():
    be = EmulatedBackend()
    chk = emu_pdl.check_pdl(be)
    d = Driver(be, "b", seed=2, pdl=True)
    try:
        d.step(3)
        n = len(chk.log)
        d.step(4, eager=True)
        be.synchronize()
        assert len(chk.log) > n and not any(r.pdl for r in chk.log[n:])
    finally:
        d.close()


def test_batch_with_pdl_is_bit_identical_and_ordered():
    be = EmulatedBackend()
    chk = emu_pdl.check_pdl(be)
    _, on, t_on = make("b", 3, be=be, pdl=True)
    _, off, t_off = make("b", 3, be=be, pdl=False)
    try:
        for ops in ([3, IDLE, 4], [4, 3, IDLE], [IDLE, 5, ("rewind", 2)]):
            play(be, on, t_on, ops)
            play(be, off, t_off, ops)
            for attr in ("hidden_states", "logits", "draft_tokens"):
                a, b = getattr(on, attr), getattr(off, attr)
                if a is not None:
                    np.testing.assert_array_equal(be.to_numpy(a), be.to_numpy(b), err_msg=f"{attr} {ops}")
        assert _assert_pdl_rule(_graph_nodes(on)) >= 8
        pdl_runs = [r for r in chk.log if r.pdl]
        assert pdl_runs and all(r.waited_blocks >= 1 for r in pdl_runs)
        assert all(r.pre_write_bytes == 0 for r in chk.log)
        # the batch's rows take the wgmma kernel with the live split and the folded q/k norm +
        # RoPE + K/V scatter epilogue: checked too
        assert any(r.kernel == "gemm_wgmma" for r in pdl_runs)
        assert not any(r.kernel == "qkv_norm_rope" for r in pdl_runs)
    finally:
        on.close()
        off.close()


def test_recording_backend_marks_the_step_graph():
    from profiling.common import drafter_config
    from profiling.step_trace import Copy, Launch, trace_step
    plan = trace_step(drafter_config("h4096"), 2048, pdl=True)
    prev = None
    marked = 0
    for n in plan.nodes:
        if isinstance(n, Launch):
            assert n.pdl == isinstance(prev, Launch), (n.kernel, prev)
            marked += n.pdl
        prev = n
    copies = sum(isinstance(n, Copy) for n in plan.nodes)
    assert marked == len(plan.launches) - copies  # each copy is followed by an unmarked launch
    assert not any(getattr(n, "pdl", False) for n in plan.prefill)   # bulk appends: eager, never
    assert not any(n.pdl for n in trace_step(drafter_config("h4096"), 2048).launches)


# ---------------------------------------------------------------- cuLaunchKernelEx packing
def test_launch_ex_struct_layout_matches_the_driver_abi():
    assert ctypes.sizeof(cuda_launch_ex.CUlaunchAttribute) == 72
    assert cuda_launch_ex.CUlaunchAttribute.value.offset == 8
    C = cuda_launch_ex.CUlaunchConfig
    assert (C.sharedMemBytes.offset, C.hStream.offset, C.attrs.offset, C.numAttrs.offset) == (24, 32, 40, 48)
    assert ctypes.sizeof(C) == 56


class _Arr:   # what pack_args reads of a CuPy array
    def __init__(self, ptr):
        self.data = type("P", (), {"ptr": ptr})()


def test_launch_ex_passes_the_attribute_grid_stream_and_arguments():
    from dflash_cupy.backends.signatures import parse_kernels
    sig = parse_kernels('extern "C" __global__ void k(const float* x, float* y, int n, float s, '
                        'long long big) {}')[0]
    seen = {}

    def fake(cfg_p, func, params, extra):
        cfg = cfg_p.contents
        seen["grid"] = (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ)
        seen["block"] = (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ)
        seen["smem"], seen["stream"], seen["n"] = cfg.sharedMemBytes, cfg.hStream, cfg.numAttrs
        a = cfg.attrs[0]
        seen["attr"] = (a.id, a.value.programmaticStreamSerializationAllowed)
        seen["func"], seen["extra"] = func, extra
        seen["args"] = (ctypes.cast(params[0], ctypes.POINTER(ctypes.c_void_p))[0],
                        ctypes.cast(params[1], ctypes.POINTER(ctypes.c_void_p))[0],
                        ctypes.cast(params[2], ctypes.POINTER(ctypes.c_int))[0],
                        ctypes.cast(params[3], ctypes.POINTER(ctypes.c_float))[0],
                        ctypes.cast(params[4], ctypes.POINTER(ctypes.c_longlong))[0])
        return 0
    fn = cuda_launch_ex.LAUNCH_EX_PROTO(fake)
    args = (_Arr(0x7000), _Arr(0x8000), np.int32(-5), np.float32(1.5), np.int64(1 << 40))
    cuda_launch_ex.launch(0xF00D, (3, 2, 1), (128, 1, 1), 4096, 0xABC0, sig.params, args, fn=fn)
    assert seen["grid"] == (3, 2, 1) and seen["block"] == (128, 1, 1) and seen["smem"] == 4096
    assert seen["stream"] == 0xABC0 and seen["n"] == 1 and seen["func"] == 0xF00D and seen["extra"] is None
    assert seen["attr"] == (cuda_launch_ex.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1) == (6, 1)
    assert seen["args"] == (0x7000, 0x8000, -5, 1.5, 1 << 40)
    bad = cuda_launch_ex.LAUNCH_EX_PROTO(lambda *a: 1)   # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(cuda_launch_ex.LaunchExError, match="CUresult 1"):
        cuda_launch_ex.launch(1, (1, 1, 1), (1, 1, 1), 0, 0, sig.params, args, fn=bad)


# ---------------------------------------------------------------- the stream GEMMs' prefetch
@pytest.mark.parametrize("config", [("wg128", 2), ("wg64", 1), (2, 3), (1, 1)])
def test_stream_gemms_touch_only_weights_before_the_wait(config):
    """Two GEMMs captured back to back (the second reads the first's output) under
    programmatic_launches: the second's prefetch of its first weight steps (gemm_wgmma.cu,
    gemm_stream.cu, split K or not) is in bounds, reads only its weights, and the replay
    equals the plain one bit for bit."""
    from dflash_cupy.ops.gemm import Gemm
    K, N, m = 520, 300, 70
    outs = {}
    for pdl in (False, True):
        be = EmulatedBackend()
        chk = emu_pdl.check_pdl(be)
        rng = np.random.default_rng(7)
        w1 = be.asarray((rng.standard_normal((K, K)) * K ** -0.5).astype(np.float16))
        w2 = be.asarray((rng.standard_normal((N, K)) * K ** -0.5).astype(np.float16))
        g1 = Gemm(be, K, K, "f16", max_m=200, path="stream")
        g2 = Gemm(be, N, K, "f16", "residual", max_m=200, path="stream")
        for g in (g1, g2):
            g.use_config(m, config)
        x = be.asarray(np.random.default_rng(1).standard_normal((m, K)).astype(np.float32))
        h = be.zeros((m, K), np.float32)
        y = be.asarray(np.ones((m, N), np.float32))
        be.synchronize()   # the zeros' memsets (default stream) before the capture stream's work
        s = be.stream()
        be.begin_capture(s)
        with programmatic_launches(pdl):
            g1(x, w1, h, m, stream=s)
            g2(h, w2, y, m, residual=y, stream=s)
        graph = be.end_capture(s)
        assert graph.n_pdl == (1 if pdl else 0)
        graph.launch(s)
        s.synchronize()
        outs[pdl] = be.to_numpy(y)
        if pdl:
            last = chk.log[-1]
            assert last.pdl and last.after == chk.log[-2].kernel and last.pre_write_bytes == 0
            assert last.pre_read_bytes > 0 and last.kernel == ("gemm_wgmma" if isinstance(config[0], str)
                                                               else "gemm_stream")
    np.testing.assert_array_equal(outs[True], outs[False])


# ---------------------------------------------------------------- on a GPU (gpu_check.sh's tests step)
@pytest.mark.skipif(not backends.gpu_available(), reason="needs a GPU: the CPU half is the tests above")
@pytest.mark.parametrize("name", ["b", "c"])
def test_cuda_step_with_pdl_is_bit_identical(name):
    """On the hardware the PDL graph really overlaps kernels: a kernel that touched
    dependent data before its wait could differ here. The graph must carry the edges."""
    be = backends.get("cuda")
    on = Driver(be, name, seed=5, pdl=True)
    off = Driver(be, name, seed=5, pdl=False)
    try:
        for c in (3, 4, 5, 2, 5, 9, 10):
            for d in (on, off):
                if c < d.valid_hi:
                    d.forget_from(c)
                d.step(c)
            for attr in ("hidden_states", "logits", "draft_tokens"):
                a, b = getattr(on.kv, attr), getattr(off.kv, attr)
                if a is not None:
                    np.testing.assert_array_equal(be.to_numpy(a), be.to_numpy(b), err_msg=f"{attr} c={c}")
        assert on.kv._graphs[on.kv._slot].n_pdl >= 8 and off.kv._graphs[off.kv._slot].n_pdl == 0
    finally:
        on.close()
        off.close()

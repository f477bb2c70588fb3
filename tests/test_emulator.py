"""The CUDA emulation layer: collectives, conversions, barriers, faults, capture.

Kernel-semantics tests take the ``backend`` fixture and so run unchanged on a
GPU; tests of the emulator's own debug aids take ``emu``."""
import ml_dtypes
import numpy as np
import pytest

from dflash_cupy.backends import BackendError, CaptureError, KernelLaunchError

COLLECTIVES_SRC = r"""
#include <cuda_fp16.h>
// out[op][tid]: the result each lane gets from each collective, for one width.
extern "C" __global__ void collectives(const int* in, const int* pred, int* out, int width, int delta) {
    const int t = threadIdx.x, n = blockDim.x;
    const int v = in[t];
    out[0 * n + t] = __shfl_sync(0xffffffffu, v, delta, width);
    out[1 * n + t] = __shfl_up_sync(0xffffffffu, v, (unsigned)delta, width);
    out[2 * n + t] = __shfl_down_sync(0xffffffffu, v, (unsigned)delta, width);
    out[3 * n + t] = __shfl_xor_sync(0xffffffffu, v, delta, width);
    out[4 * n + t] = (int)__ballot_sync(0xffffffffu, pred[t]);
    out[5 * n + t] = __any_sync(0xffffffffu, pred[t]);
    out[6 * n + t] = __all_sync(0xffffffffu, pred[t]);
    out[7 * n + t] = __syncthreads_count(pred[t]);
    out[8 * n + t] = __syncthreads_or(pred[t]);
    out[9 * n + t] = __syncthreads_and(pred[t]);
    // 64-bit and float payloads travel intact
    double d = (double)v * 0.5;
    out[10 * n + t] = (int)(__shfl_xor_sync(0xffffffffu, d, 1, width) * 2.0);
}
"""


def collectives_reference(v, pred, width, delta):
    n = len(v)
    out = np.zeros((11, n), np.int64)
    for t in range(n):
        lane, w0 = t % 32, t - t % 32
        seg = lane & ~(width - 1)
        out[0, t] = v[w0 + seg + (delta & (width - 1))]
        out[1, t] = v[t] if lane - delta < seg else v[t - delta]
        out[2, t] = v[t] if lane + delta >= seg + width else v[t + delta]
        src = lane ^ delta
        out[3, t] = v[t] if src >= seg + width else v[w0 + src]
        src = lane ^ 1
        out[10, t] = v[t] if src >= seg + width else v[w0 + src]
        bits = sum(1 << l for l in range(32) if pred[w0 + l])
        out[4, t] = np.int32(np.uint32(bits).view(np.int32))
        out[5, t] = int(bits != 0)
        out[6, t] = int(bits == 0xFFFFFFFF)
        out[7, t] = int(np.count_nonzero(pred))
        out[8, t] = int(np.count_nonzero(pred) > 0)
        out[9, t] = int(np.count_nonzero(pred) == n)
    return out


@pytest.mark.parametrize("width,delta", [(32, 1), (32, 5), (32, 17), (16, 3), (8, 6), (4, 1), (2, 1), (1, 0)])
def test_warp_collectives_match_ptx_rules(backend, rng, width, delta):
    mod = backend.compile(COLLECTIVES_SRC, filename="collectives.cu")
    n = 64
    v = rng.integers(-1000, 1000, n).astype(np.int32)
    for pred in (rng.integers(0, 2, n), np.ones(n), np.zeros(n)):
        pred = pred.astype(np.int32)
        out = backend.zeros((11, n), np.int32)
        mod.get_function("collectives")((1,), (n,), (backend.asarray(v), backend.asarray(pred), out,
                                                     np.int32(width), np.int32(delta)))
        got = backend.to_numpy(out)
        ref = collectives_reference(v, pred, width, delta)
        names = ["shfl", "shfl_up", "shfl_down", "shfl_xor", "ballot", "any", "all",
                 "syncthreads_count", "syncthreads_or", "syncthreads_and", "shfl_xor(double)"]
        for i, name in enumerate(names):
            np.testing.assert_array_equal(got[i], ref[i], err_msg=f"{name} width={width} delta={delta}")


CONVERT_SRC = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
extern "C" __global__ void f16_to_f32(const unsigned short* h, float* f, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) f[i] = __half2float(__ushort_as_half(h[i]));
}
extern "C" __global__ void f32_to_f16(const float* f, unsigned short* h, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) h[i] = __half_as_ushort(__float2half(f[i]));
}
extern "C" __global__ void bf16_to_f32(const unsigned short* h, float* f, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) f[i] = __bfloat162float(__ushort_as_bfloat16(h[i]));
}
extern "C" __global__ void f32_to_bf16(const float* f, unsigned short* h, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) h[i] = __bfloat16_as_ushort(__float2bfloat16(f[i]));
}
"""


def _run_convert(backend, name, src, out_dtype):
    mod = backend.compile(CONVERT_SRC, filename="convert.cu")
    n = src.size
    d_src = backend.asarray(src)
    d_out = backend.zeros((n,), out_dtype)
    mod.get_function(name)(((n + 255) // 256,), (256,), (d_src, d_out, np.int32(n)))
    return backend.to_numpy(d_out)


def _assert_bits_equal(got_bits, ref_bits, is_nan, what):
    ok = (got_bits == ref_bits) | is_nan
    assert ok.all(), f"{what}: {int((~ok).sum())} mismatches, first at {np.flatnonzero(~ok)[:5]}"


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_all_16bit_patterns_widen_exactly(backend, kind):
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    np_dt = np.float16 if kind == "f16" else ml_dtypes.bfloat16
    got = _run_convert(backend, f"{kind}_to_f32", bits, np.float32)
    ref = bits.view(np_dt).astype(np.float32)
    nan = np.isnan(ref)
    assert np.isnan(got[nan]).all()
    _assert_bits_equal(got.view(np.uint32), ref.view(np.uint32), nan, f"{kind}->f32")


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_f32_narrowing_rounds_to_nearest_even(backend, rng, kind):
    np_dt = np.float16 if kind == "f16" else ml_dtypes.bfloat16
    # every 16-bit value, the midpoints between neighbours (ties), values just off the
    # midpoints, overflow, subnormals, and random bit patterns
    grid = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np_dt)
    with np.errstate(invalid="ignore"):
        grid = grid.astype(np.float64)
    grid = np.sort(grid[np.isfinite(grid)])
    mids = (grid[1:] + grid[:-1]) / 2
    f = np.concatenate([grid, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
                        [65504.0, 65519.99, 65520.0, 1e6, -1e6, np.inf, -np.inf, np.nan, 2.0 ** -25,
                         2.0 ** -24, 3 * 2.0 ** -26, 1e-40, -1e-40]]).astype(np.float32)
    f = np.concatenate([f, rng.integers(0, 2 ** 32, 200000, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    got = _run_convert(backend, f"f32_to_{kind}", f, np.uint16)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = f.astype(np_dt).view(np.uint16)
    nan = np.isnan(f)
    assert np.isnan(got[nan].view(np_dt).astype(np.float32)).all()
    _assert_bits_equal(got, ref, nan, f"f32->{kind}")


REDUCE_SRC = r"""
// One block per row: shared-memory tree reduction with a warp-shuffle tail.
extern "C" __global__ void row_sum(const float* x, float* out, int n) {
    extern __shared__ __align__(16) unsigned char smem[];
    float* s = (float*)smem;
    float acc = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) acc += x[(long long)blockIdx.x * n + i];
    s[threadIdx.x] = acc;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride >= 32; stride /= 2) {
        if (threadIdx.x < stride) s[threadIdx.x] += s[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x < 32) {
        float v = s[threadIdx.x];
        for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
        if (threadIdx.x == 0) out[blockIdx.x] = v;
    }
}
"""


@pytest.mark.parametrize("rows,n,threads", [(1, 1, 32), (3, 19, 64), (33, 1000, 256), (5, 4096, 1024)])
def test_shared_memory_block_reduction(backend, rng, rows, n, threads):
    from tests.support.tolerances import assert_close
    x = rng.standard_normal((rows, n)).astype(np.float32)
    out = backend.zeros((rows,), np.float32)
    k = backend.compile(REDUCE_SRC, filename="reduce.cu").get_function("row_sum")
    k((rows,), (threads,), (backend.asarray(x), out, np.int32(n)), shared_mem=4 * threads)
    assert_close(backend.to_numpy(out), x.astype(np.float64).sum(1), "f32", "row_sum")


MISSING_BARRIER_SRC = r"""
extern "C" __global__ void rotate(const float* x, float* y) {
    extern __shared__ __align__(16) unsigned char smem[];
    float* s = (float*)smem;
    s[threadIdx.x] = x[threadIdx.x];
#ifdef WITH_BARRIER
    __syncthreads();
#endif
    y[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}
"""


@pytest.mark.parametrize("schedule", ["forward", "reverse", "shuffle"])
def test_missing_barrier_is_caught(emu, schedule, monkeypatch):
    monkeypatch.setattr(emu, "schedule", schedule)
    x = emu.asarray(np.arange(128, dtype=np.float32))
    ref = np.roll(np.arange(128, dtype=np.float32), -1)
    for defines, should_pass in ((["-DWITH_BARRIER=1"], True), ([], False)):
        y = emu.zeros((128,), np.float32)
        k = emu.compile(MISSING_BARRIER_SRC, defines, filename="rotate.cu").get_function("rotate")
        k((1,), (128,), (x, y), shared_mem=512)
        y = emu.to_numpy(y)
        assert np.array_equal(y, ref) == should_pass, f"defines={defines}: {y[:8]}"


CROSS_WARP_RACE_SRC = r"""
// Warp w reads the other warp's slot, then overwrites its own: without the
// second barrier a warp that runs ahead clobbers what the other still reads.
extern "C" __global__ void swap_halves(float* out) {
    __shared__ float buf[64];
    const int t = threadIdx.x;
    buf[t] = (float)t;
    __syncthreads();
    float v = buf[(t + 32) % 64];
    v += __shfl_xor_sync(0xffffffffu, v, 1) * 0.0f;   // a warp collective in between
#ifdef WITH_BARRIER
    __syncthreads();
#endif
    buf[t] = v + 1000.0f;
    __syncthreads();
    out[t] = v;
}
"""


@pytest.mark.parametrize("schedule", ["forward", "reverse", "shuffle"])
def test_missing_barrier_between_warps_is_caught(emu, schedule, monkeypatch):
    monkeypatch.setattr(emu, "schedule", schedule)
    ref = ((np.arange(64) + 32) % 64).astype(np.float32)
    for defines, should_pass in ((["-DWITH_BARRIER=1"], True), ([], False)):
        out = emu.zeros((64,), np.float32)
        emu.compile(CROSS_WARP_RACE_SRC, defines, filename="race.cu").get_function("swap_halves")(
            (1,), (64,), (out,))
        out = emu.to_numpy(out)
        assert np.array_equal(out, ref) == should_pass, f"defines={defines}: {out[:4]} {out[32:36]}"


DEADLOCK_SRC = r"""
extern "C" __global__ void split_warp(float* x) {
    if (threadIdx.x < 16) __syncthreads();
    else x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, x[threadIdx.x], 1);
}
extern "C" __global__ void mixed_collectives(int* x) {
    if (threadIdx.x & 1) x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, x[threadIdx.x], 1);
    else x[threadIdx.x] = __ballot_sync(0xffffffffu, 1);
}
extern "C" __global__ void early_exit_ok(float* x) {
    if (threadIdx.x >= 40) return;     // exited threads do not hold a barrier up
    x[threadIdx.x] += 1.0f;
    __syncthreads();
}
"""


def test_deadlock_and_divergent_collectives_reported(emu):
    # Launches run when their stream is waited for: the error surfaces there, as on a GPU.
    mod = emu.compile(DEADLOCK_SRC, filename="deadlock.cu")
    with pytest.raises(KernelLaunchError, match=r"split_warp: deadlock in block \(0,0,0\).*__syncthreads"):
        mod.get_function("split_warp")((1,), (32,), (emu.zeros((32,), np.float32),))
        emu.synchronize()
    with pytest.raises(KernelLaunchError, match=r"mixed_collectives: divergent warp collectives"):
        mod.get_function("mixed_collectives")((1,), (32,), (emu.zeros((32,), np.int32),))
        emu.synchronize()
    x = emu.zeros((64,), np.float32)
    mod.get_function("early_exit_ok")((1,), (64,), (x,))
    x = emu.to_numpy(x)
    assert x[:40].tolist() == [1.0] * 40 and x[40:].tolist() == [0.0] * 24


OOB_SRC = r"""
extern "C" __global__ void overrun(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    y[i] = x[i + n];     // reads n elements too far
}
extern "C" __global__ void div0(int* x, int d) { x[threadIdx.x] = x[threadIdx.x] / d; }
"""


@pytest.mark.parametrize("threads", [1, 4])
def test_out_of_bounds_access_names_kernel_and_array(emu, monkeypatch, threads):
    monkeypatch.setattr(emu, "threads", threads)
    mod = emu.compile(OOB_SRC, filename="oob.cu")
    x = emu.zeros((8, 64, 33), np.float32)
    y = emu.zeros((8 * 64 * 33,), np.float32)
    with pytest.raises(KernelLaunchError, match=r"kernel overrun: out-of-bounds load of 4 bytes .* past the end "
                                                r"of array `x` \(device array shape=\(8, 64, 33\) dtype=float32\)"
                                                r".* in block \(\d+,0,0\) thread \(\d+,0,0\)"):
        mod.get_function("overrun")((66,), (256,), (x, y, np.int32(64)))
        emu.synchronize()
    with pytest.raises(KernelLaunchError, match=r"kernel div0: arithmetic fault"):
        mod.get_function("div0")((1,), (32,), (emu.zeros((32,), np.int32), np.int32(0)))
        emu.synchronize()
    # the backend is still usable afterwards
    mod.get_function("overrun")((1,), (32,), (x, y, np.int32(0)))
    emu.synchronize()


def test_scalar_arguments_must_have_the_exact_c_type(backend):
    k = backend.compile(OOB_SRC, filename="oob.cu").get_function("div0")
    x = backend.zeros((32,), np.int32)
    with pytest.raises(TypeError, match="argument 1"):
        k((1,), (32,), (x, 3))
    with pytest.raises(TypeError, match="argument 1"):
        k((1,), (32,), (x, np.int64(3)))


@pytest.mark.eager_build
def test_compile_error_points_at_cu_line(backend, tmp_path):
    src = "extern \"C\" __global__ void k(float* x) {\n    x[0] = 1.0f;\n    this_is_not_defined(x);\n}\n"
    path = str(tmp_path / "broken_kernel.cu")
    with pytest.raises(BackendError, match=r"broken_kernel\.cu[:(]3"):
        backend.compile(src, filename=path)


@pytest.mark.eager_build
def test_emulator_rejects_what_nvrtc_rejects(emu):
    for bad in ("#include <cstdint>\n", "", "#include <cuda_fp16.h>\n"):
        body = bad + 'extern "C" __global__ void k(float* x) { uint32_t u = 1; x[0] = (float)u; }\n'
        with pytest.raises(BackendError, match="uint32_t"):
            emu.compile(body, filename="std_use.cu")
    with pytest.raises(BackendError, match="INFINITY"):
        emu.compile('extern "C" __global__ void k(float* x) { x[0] = INFINITY; }\n', filename="inf.cu")


GRAPH_SRC = r"""
extern "C" __global__ void bump(int* counter, const int* desc, int* seen, int slot) {
    if (threadIdx.x == 0) { counter[0] += 1; seen[slot] = desc[0]; }
}
"""


def test_graph_replay_counts_and_reads_pinned_at_replay_time(backend):
    k = backend.compile(GRAPH_SRC, filename="graph.cu").get_function("bump")
    counter = backend.zeros((1,), np.int32)
    desc_dev = backend.zeros((1,), np.int32)
    desc_host = backend.pinned_empty((1,), np.int32)
    seen = backend.zeros((100,), np.int32)
    slot = backend.zeros((1,), np.int32)  # not used: slot index travels as data below
    s = backend.stream()
    backend.synchronize()  # the zeros were memset on the default stream; the graph runs on s
    backend.begin_capture(s)
    backend.copy_h2d_async(desc_dev, desc_host, stream=s)
    k((1,), (32,), (counter, desc_dev, seen, np.int32(0)), stream=s)
    g = backend.end_capture(s)
    assert backend.to_numpy(counter)[0] == 0, "capture must not execute anything"
    history = []
    for i in range(100):
        desc_host[0] = 1000 + i     # changed between replays: each replay must see its own value
        g.launch(s)
        s.synchronize()
        history.append(int(backend.to_numpy(seen)[0]))
    assert backend.to_numpy(counter)[0] == 100
    assert history == [1000 + i for i in range(100)]
    del slot


def test_capture_misuse_raises(backend):
    s = backend.stream()
    other = backend.stream()
    k = backend.compile(GRAPH_SRC, filename="graph.cu").get_function("bump")
    counter = backend.zeros((1,), np.int32)
    desc = backend.zeros((1,), np.int32)
    seen = backend.zeros((1,), np.int32)
    backend.synchronize()  # the zeros were memset on the default stream; the graph runs on s
    backend.begin_capture(s)
    try:
        with pytest.raises(CaptureError):
            backend.empty((4,), np.float32)
        with pytest.raises(CaptureError):
            backend.to_numpy(counter)
        with pytest.raises(CaptureError):
            backend.synchronize()
        if backend.name == "emulated":  # CuPy may invalidate the capture instead of raising at once
            with pytest.raises(CaptureError):
                k((1,), (32,), (counter, desc, seen, np.int32(0)), stream=other)
        k((1,), (32,), (counter, desc, seen, np.int32(0)), stream=s)
    finally:
        g = backend.end_capture(s)
    g.launch(s)
    s.synchronize()
    assert backend.to_numpy(counter)[0] == 1
    with pytest.raises(CaptureError):
        backend.end_capture(s)


def test_schedules_agree_on_correct_kernels(emu, rng, monkeypatch):
    x = rng.standard_normal((7, 333)).astype(np.float32)
    results = []
    for sched in ("forward", "reverse", "shuffle"):
        monkeypatch.setattr(emu, "schedule", sched)
        out = emu.zeros((7,), np.float32)
        emu.compile(REDUCE_SRC, filename="reduce.cu").get_function("row_sum")(
            (7,), (128,), (emu.asarray(x), out, np.int32(333)), shared_mem=512)
        results.append(emu.to_numpy(out))
    assert all(np.array_equal(results[0], r) for r in results[1:])


@pytest.mark.eager_build
def test_header_survives_short_size_macros(emu):
    # Kernels take sizes as -D macros (-DD=128, -DB=16 ...); the emulation header,
    # included first, must not use any such name itself.
    # T is the one single letter NVRTC's own builtin header cannot survive (a template
    # parameter name), so the GPU build, and hence the emulated one, rejects -DT=...
    opts = [f"-D{c}=7" for c in "ABCDEFGHIJKLMNOPQRSUVWXYZ"] + [f"-D{c}{d}=7" for c in "NMKD" for d in "HKVTQ"]
    src = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] = (float)(D + B + K); }\n'
    x = emu.zeros((32,), np.float32)
    emu.compile(src, opts, filename="macros.cu").get_function("k")((1,), (32,), (x,))
    assert (emu.to_numpy(x) == 21).all()
    with pytest.raises(BackendError, match="NVRTC error"):
        emu.compile(src, opts + ["-DT=7"], filename="macros.cu")


def test_fiber_stack_overflow_is_reported(emu):
    src = r"""
    extern "C" __global__ void big_locals(float* x, int n) {
        volatile float buf[40000];            // 160 KB of locals: more than a fiber stack holds
        for (int i = 0; i < n; i++) buf[i] = (float)i;
        x[threadIdx.x] = buf[n - 1];
    }
    """
    k = emu.compile(src, filename="stack.cu").get_function("big_locals")
    with pytest.raises(KernelLaunchError, match="big_locals: .*stack overflow"):
        k((1,), (32,), (emu.zeros((32,), np.float32), np.int32(40000)))
        emu.synchronize()


FTZ_SRC = r"""
// -ftz=true (how CuPy compiles): f32 denormal inputs read as zero and denormal
// results flush to zero.
extern "C" __global__ void ftz(const float* x, float* y) {
    const float one = x[3];   // from memory: x * 1.0f would be folded away
    y[0] = x[0] * one;        // a denormal input
    y[1] = x[1] * x[2];       // 1e-30 * 1e-10: a denormal result
    y[2] = x[1] * one;        // a normal value passes
}
"""


def test_f32_flushes_denormals_like_ftz(backend):
    x = np.array([1e-40, 1e-30, 1e-10, 1.0], np.float32)
    assert x[0] != 0 and 0 < abs(np.float32(1e-30) * np.float32(1e-10)) < np.finfo(np.float32).tiny
    y = backend.zeros((3,), np.float32)
    backend.compile(FTZ_SRC, filename="ftz.cu").get_function("ftz")((1,), (32,), (backend.asarray(x), y))
    got = backend.to_numpy(y)
    assert got[0] == 0.0 and got[1] == 0.0 and got[2] == np.float32(1e-30)

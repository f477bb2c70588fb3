"""Exercise CudaBackend's Python logic with faked CUDA calls (no GPU needed).

Run as a script (tests/test_cuda_backend_logic.py runs it in a subprocess, since it
monkeypatches CuPy for the whole process); prints "harness OK" when every check passed."""
import gc, ctypes, sys, pathlib
# This checkout's package, not whichever dflash_cupy is installed (sys.path[0] is tests/support/).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import numpy as np, pytest, cupy
from cupy.cuda import runtime as R, driver as D
import dflash_cupy.backends.cuda as C
from dflash_cupy.backends.base import BackendError, CaptureError, KernelLaunchError

calls = []

class DrvErr(D.CUDADriverError):
    def __init__(self, status): RuntimeError.__init__(self, f"fake driver error {status}")

class RtErr(R.CUDARuntimeError):
    def __init__(self, status): RuntimeError.__init__(self, f"fake runtime error {status}")

def fake_dev_array(shape, dtype):
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    buf = np.zeros(max(n, 1), np.uint8)
    mem = cupy.cuda.UnownedMemory(buf.ctypes.data, n, buf, device_id=0)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0)), buf

class FakeStream(cupy.cuda.ExternalStream):
    n = 0x1000
    def __init__(self):
        FakeStream.n += 0x10
        super().__init__(FakeStream.n, device_id=0)
        self.capturing = False
    def begin_capture(self, mode=None):
        assert not self.capturing; self.capturing = True; calls.append(("begin", self.ptr))
    def end_capture(self):
        assert self.capturing; self.capturing = False; calls.append(("end", self.ptr))
        if getattr(self, "fail", False):
            raise RtErr(901)
        return FakeGraph()
    def synchronize(self): calls.append(("ssync", self.ptr))
    def wait_event(self, ev): calls.append(("swait", self.ptr, ev))
    # CuPy's `with stream:` makes it current (a thread-local stack), faked here
    def __enter__(self): current.append(self); return self
    def __exit__(self, *exc): assert current.pop() is self

class FakeGraph:
    def launch(self, stream=None): calls.append(("glaunch", None if stream is None else stream.ptr))

class FakePinned:
    pass

class PinBuf(np.ndarray):
    pass

pinned_ranges = []   # [start, end) the fake driver reports as page-locked (pool blocks stay so)

def fake_alloc_pinned(n):
    raw = (ctypes.c_char * (-(-n // 512) * 512))()  # buffer exporter, like PinnedMemoryPointer
    raw.ptr = ctypes.addressof(raw) if n else 0
    raw.mem = FakePinned()
    if n:
        pinned_ranges.append((raw.ptr, raw.ptr + len(raw)))
    pinned_keep.append(raw)  # the pool keeps its blocks, so addresses are never reused here
    calls.append(("alloc_pinned", n))
    return raw

pinned_keep = []
attr_fail = []

def fake_pointer_attributes(ptr):
    calls.append(("ptrattr", ptr))
    if attr_fail:
        raise RtErr(1)  # cudaErrorInvalidValue: what drivers before CUDA 11 say for pageable memory
    host = any(s <= ptr < e for s, e in pinned_ranges)
    return R.PointerAttributes(0, 0, ptr, R.memoryTypeHost if host else R.memoryTypeUnregistered)

class FakeRawKernel:
    n = 0xF000
    def __init__(self, name):
        self.name = name; self.max_dynamic_shared_size_bytes = 0
        FakeRawKernel.n += 0x10; self.kernel = type("F", (), {"ptr": FakeRawKernel.n})()   # the CUfunction
    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        assert isinstance(grid, tuple) and isinstance(block, tuple)
        calls.append(("launch", self.name, grid, block, len(args), shared_mem,
                      None if stream is None else stream.ptr, self.max_dynamic_shared_size_bytes))
        launched_args.append(tuple(args))

launched_args = []

class FakeRawModule:
    fail = None
    def __init__(self, code, options, backend):
        assert isinstance(options, tuple) and backend == "nvrtc"
        self.code, self.options = code, options
    def compile(self):
        if FakeRawModule.fail:
            raise cupy.cuda.compiler.CompileException(FakeRawModule.fail, self.code, "x.cu", self.options)
    def get_function(self, name):
        if name == "missing_in_cubin":
            raise DrvErr(500)
        return FakeRawKernel(name)

class MP:  # tiny monkeypatch
    def __init__(self): self.undo = []
    def setattr(self, obj, name, val):
        self.undo.append((obj, name, getattr(obj, name))); setattr(obj, name, val)
    def restore(self):
        for o, n, v in reversed(self.undo): setattr(o, n, v)

mp = MP()
mp.setattr(R, "memcpyAsync", lambda d, s, n, k, st: (calls.append(("memcpyAsync", d, s, n, k, st)), ctypes.memmove(d, s, n)))
mp.setattr(R, "memcpy", lambda d, s, n, k: (calls.append(("memcpy", n, k)), ctypes.memmove(d, s, n)))
mp.setattr(R, "deviceSynchronize", lambda: calls.append(("dsync",)))
mp.setattr(R, "streamSynchronize", lambda st: calls.append(("ssync", st)))
mp.setattr(R, "deviceGetAttribute", lambda a, d: 232448)
mp.setattr(R, "getDevice", lambda: 0)
foreign_streams = set()   # stream handles the fake driver places in another device's context
mp.setattr(D, "streamGetCtx", lambda ptr: 0xB00 if ptr in foreign_streams else 0xA00)
mp.setattr(D, "ctxGetCurrent", lambda: 0xA00)
mp.setattr(cupy.cuda, "alloc_pinned_memory", fake_alloc_pinned)
mp.setattr(R, "pointerGetAttributes", fake_pointer_attributes)
mp.setattr(cupy, "RawModule", FakeRawModule)
keep = []
def fake_empty(shape, dtype):
    a, buf = fake_dev_array(shape if isinstance(shape, tuple) else (shape,), dtype); keep.append(buf); return a
mp.setattr(cupy, "empty", fake_empty)
def fake_zeros(shape, dtype): return fake_empty(shape, dtype)
mp.setattr(cupy, "zeros", fake_zeros)
mp.setattr(cupy, "ascontiguousarray", lambda a: a)
current = [cupy.cuda.ExternalStream(0, device_id=0)]   # CuPy's current-stream stack, faked
mp.setattr(cupy.cuda, "get_current_stream", lambda: current[-1])

be = C.CudaBackend()
mp.setattr(be, "stream", lambda: C.CudaStream(be, FakeStream()))
mp.setattr(C.CudaEvent, "__init__", lambda self, backend: (setattr(self, "_backend", backend), setattr(self, "raw", type("E", (), {"record": lambda s, st=None: calls.append(("erec", None if st is None else st.ptr)), "synchronize": lambda s: calls.append(("esync",)), "done": True})())) and None)

SRC = r'''
extern "C" __global__ void k(const float* __restrict__ x, float* y, int n, float s, long long z) {}
extern "C" __global__ void missing_in_cubin(float* y) {}
'''

# ---- compile
mod = be.compile(SRC, ("-DA=1", "-I", "/inc", "-I /inc2"), filename="/p/x.cu")
assert mod.raw.code.startswith('#line 1 "/p/x.cu"\n'), mod.raw.code[:40]
o = mod.raw.options
assert o[:2] == C.NVRTC_FLAGS and "-DA=1" in o and "-I/inc" in o and "-I/inc2" in o, o
assert any(x.startswith("-I") and "cuda_runtime" in x for x in o), o
k = mod.get_function("k"); assert mod.get_function("k") is k
with pytest.raises(BackendError, match="no extern"): mod.get_function("nope")
with pytest.raises(BackendError, match="could not be loaded"): mod.get_function("missing_in_cubin")
FakeRawModule.fail = "x.cu(3): error: identifier \"q\" is undefined"
with pytest.raises(BackendError, match=r"(?s)NVRTC failed to compile /p/y.cu.*identifier"): be.compile(SRC, (), "/p/y.cu")
FakeRawModule.fail = None
with pytest.raises(BackendError, match="cannot parse|must be a pointer|has type"):
    be.compile('extern "C" __global__ void bad(float& r) {}', (), "bad.cu")

# ---- CuPy's cache key (the code string) covers the content of every included header
import tempfile, pathlib
hdir = pathlib.Path(tempfile.mkdtemp())
(hdir / "outer.cuh").write_text('#include "inner.cuh"\n')
(hdir / "inner.cuh").write_text("#define SCALE 2.0f\n")
HSRC = '#include "outer.cuh"\nextern "C" __global__ void k(float* y) { y[0] = SCALE; }\n'
code1 = be.compile(HSRC, ("-I", str(hdir)), filename="/p/h.cu").raw.code
assert code1.startswith('#line 1 "/p/h.cu"\n' + HSRC), code1[:80]  # line numbers unchanged
assert be.compile(HSRC, ("-I", str(hdir)), filename="/p/h.cu").raw.code == code1  # stable
(hdir / "inner.cuh").write_text("#define SCALE 3.0f\n")  # edit a header included by a header
code2 = be.compile(HSRC, ("-I", str(hdir)), filename="/p/h.cu").raw.code
assert code2 != code1 and code2.startswith('#line 1 "/p/h.cu"\n' + HSRC)

# ---- arrays
x = be.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
assert be.is_device_array(x) and x.shape == (2, 3)
calls.clear()
got = be.to_numpy(x); assert (got == np.arange(6).reshape(2, 3)).all() and got.dtype == np.float32
# cupy.ndarray.get(): an async copy on the current stream, then a wait for that stream only
assert [c[0] for c in calls] == ["memcpyAsync", "ssync"] and calls[0][5] == 0 and calls[1] == ("ssync", 0), calls
assert be.to_numpy(np.ones(2)).tolist() == [1, 1]
with pytest.raises(TypeError): be.to_numpy([1, 2])
with pytest.raises(TypeError, match="uint16"):
    import ml_dtypes; be.empty((2,), ml_dtypes.bfloat16)
calls.clear()
y = be.zeros((2, 3), np.float32)
assert calls == [], "zeros is cupy.zeros: a memset on the current stream, no device sync"
z = be.empty(4, np.float32); assert z.shape == (4,)

# ---- pinned buffers: cupyx.empty_pinned (CuPy's pinned pool), pinned-ness from the driver
calls.clear()
p = be.pinned_empty((2, 3), np.float32)
assert calls[0] == ("alloc_pinned", 24), calls   # through cupy.cuda.alloc_pinned_memory
assert p.shape == (2, 3) and p.dtype == np.float32 and p.flags.writeable and p.flags.c_contiguous
assert be.is_pinned(p) and be.is_pinned(p[1]) and not be.is_pinned(np.empty((2, 3), np.float32))
assert not be.is_pinned([1.0]) and not be.is_pinned(p[:0])
p0 = be.pinned_empty((0, 3), np.int32); assert p0.shape == (0, 3)
with pytest.raises(ValueError, match="negative dimension"): be.pinned_empty((2, -1), np.float32)
q = be.pinned_empty(5, np.int64); v = q[2:]; del q; gc.collect()
assert be.is_pinned(v) and v.ctypes.data == pinned_ranges[-1][0] + 16, "a view keeps the block alive"
# both ends must be page-locked: a range that runs past a pinned block is not pinned
host = np.zeros(4096, np.uint8)
pinned_ranges.append((host.ctypes.data, host.ctypes.data + 1024))
assert be.is_pinned(host[:1024]) and be.is_pinned(host[1000:1024])
assert not be.is_pinned(host[:1025]) and not be.is_pinned(host[1024:2048]) and not be.is_pinned(host)
calls.clear(); be.is_pinned(host[8:16])
assert [c for c in calls if c[0] == "ptrattr"] == [("ptrattr", host.ctypes.data + 8), ("ptrattr", host.ctypes.data + 15)]
attr_fail.append(1); assert not be.is_pinned(p); attr_fail.clear()   # a refusing driver: not pinned
pinned_ranges.pop()

# ---- kernel launch checks
calls.clear()
k((3,), 64, (x, y, np.int32(6), np.float32(2), np.int64(1)))
assert calls[-1][:6] == ("launch", "k", (3, 1, 1), (64, 1, 1), 5, 0), calls[-1]
with pytest.raises(TypeError, match="argument 2 .*NumPy scalar"): k(1, 32, (x, y, 6, np.float32(2), np.int64(1)))
with pytest.raises(TypeError, match="argument 3 .*needs dtype float32"): k(1, 32, (x, y, np.int32(6), np.float64(2), np.int64(1)))
with pytest.raises(TypeError, match="argument 0 .*device array.*host NumPy"): k(1, 32, (np.ones(3), y, np.int32(6), np.float32(2), np.int64(1)))
with pytest.raises(TypeError, match="takes 5 arguments"): k(1, 32, (x, y))
# a struct parameter: checked field by field, passed as its C bytes (an aligned NumPy structured
# scalar) with the device pointers in place
SSRC = 'struct SP { const float* a; float* b; int n; };\nextern "C" __global__ void ks(SP p, float s) {}'
ks = be.compile(SSRC, (), filename="/p/s.cu").get_function("ks")
ks(1, 32, (dict(a=x, b=y, n=np.int32(6)), np.float32(1)))
(packed, _s) = launched_args[-1]
assert isinstance(packed, np.void) and packed.dtype.itemsize == 24, packed.dtype
assert (int(packed["a"]), int(packed["b"]), int(packed["n"])) == (x.data.ptr, y.data.ptr, 6)
with pytest.raises(TypeError, match=r"field \(n: int\) .*NumPy scalar"): ks(1, 32, (dict(a=x, b=y, n=6), np.float32(1)))
with pytest.raises(TypeError, match="must be a mapping"): ks(1, 32, ((x, y, np.int32(6)), np.float32(1)))
with pytest.raises(TypeError, match="must be a tuple"): k(1, 32, x)
with pytest.raises(ValueError, match="grid dimensions must be >= 1"): k((0,), 32, (x, y, np.int32(6), np.float32(2), np.int64(1)))
with pytest.raises(ValueError, match="max 1024"): k(1, (64, 32), (x, y, np.int32(6), np.float32(2), np.int64(1)))
# the launch shape checks are launch_limits.launch_config, the emulator's too
from dflash_cupy.backends.launch_limits import LaunchResourceError
for grid, block, smem, msg in (((1, 65536), 32, 0, r"invalid configuration.*grid.y=65536"),
                               (1, (1, 1, 65), 0, r"invalid configuration.*block.z=65 > 64"),
                               (1, 32, -1, r"invalid argument.*negative dynamic shared memory")):
    n_calls = len(calls)
    with pytest.raises(LaunchResourceError, match=msg): k(grid, block, (x, y, np.int32(6), np.float32(2), np.int64(1)), shared_mem=smem)
    assert len(calls) == n_calls, "a refused launch reaches no CUDA call"
with pytest.raises(ValueError, match="shared_mem"): k(1, 32, (x, y, np.int32(6), np.float32(2), np.int64(1)), shared_mem=232449)
k(1, 32, (x, y, np.int32(6), np.float32(2), np.int64(1)), shared_mem=100000)
assert calls[-1][5] == 100000 and calls[-1][7] == 100000
k(1, 32, (x, y, np.int32(6), np.float32(2), np.int64(1)), shared_mem=1000)
s = be.stream()
k(1, 32, (x, y, np.int32(6), np.float32(2), np.int64(1)), stream=s); assert calls[-1][6] == s.ptr
with pytest.raises(TypeError, match="stream must be"): k(1, 32, (x, y, np.int32(6), np.float32(2), np.int64(1)), stream=5)

# ---- copies
hp = be.pinned_empty((2, 3), np.float32); hp[...] = 7
d = be.empty((2, 3), np.float32)
be.copy_h2d_async(d, hp, stream=s); assert calls[-1][0] == "memcpyAsync" and calls[-1][4] == R.memcpyHostToDevice and calls[-1][5] == s.ptr
assert (be.to_numpy(d) == 7).all()
with pytest.raises(ValueError, match="src is not pinned"): be.copy_h2d_async(d, np.ones((2, 3), np.float32))
with pytest.raises(TypeError, match="dst must be a CuPy"): be.copy_h2d_async(np.ones((2, 3), np.float32), hp)
with pytest.raises(ValueError, match="nbytes"): be.copy_h2d_async(d, hp, nbytes=25)
be.copy_h2d_async(d, hp, nbytes=4); assert calls[-1][3] == 4 and calls[-1][5] == 0
out = np.zeros((2, 3), np.float32)
be.copy_d2h_async(out, d); assert (out == 7).all()
with pytest.raises(ValueError, match="read-only"):
    ro = np.zeros((2, 3), np.float32); ro.flags.writeable = False; be.copy_d2h_async(ro, d)
d2 = be.empty((2, 3), np.float32)
be.copy_d2d_async(d2, d); assert (be.to_numpy(d2) == 7).all()
big = be.empty((8,), np.float32)
with pytest.raises(ValueError, match="overlap"): be.copy_d2d_async(big[2:6], big[0:4])
be.copy_d2d_async(big[4:8], big[0:4])
with pytest.raises(ValueError, match="C-contiguous"): be.copy_d2d_async(d2[:, :2], d[:, :2])

# ---- events
e = be.event(); e.record(s); e.synchronize(); assert e.query() is True

# ---- the current stream (CuPy's), `with stream:`, as_stream, to_numpy on a stream
cur0 = be.current_stream()
assert isinstance(cur0, C.CudaStream) and cur0.ptr == 0 and be.as_stream(None) == cur0
s2 = be.stream()
with s2 as entered:
    assert entered is s2 and be.current_stream() == s2 and cupy.cuda.get_current_stream() is s2.raw
    assert be.as_stream(None) == s2 and be.as_stream(s2.raw) == s2 and be.as_stream(s2) is s2
    calls.clear()
    k(1, 32, (x, y, np.int32(6), np.float32(2), np.int64(1)))   # stream=None: CuPy's current one
    assert calls[-1][6] is None, calls[-1]
    got = be.to_numpy(d)
    assert calls[-2][0] == "memcpyAsync" and calls[-2][5] == s2.ptr and calls[-1] == ("ssync", s2.ptr), calls
assert be.current_stream() == cur0 and be.current_stream() != s2 and hash(be.current_stream()) == hash(cur0)
calls.clear()
be.to_numpy(d, stream=s2); assert calls[-1] == ("ssync", s2.ptr), calls
s2.wait_event(e); assert calls[-1] == ("swait", s2.ptr, e.raw), calls
with pytest.raises(TypeError, match="stream must be"): be.as_stream(5)
other = be.stream(); foreign_streams.add(other.ptr)   # a stream of another device: refused, by name
with pytest.raises(ValueError, match="belongs to another device"): be.as_stream(other)
with pytest.raises(ValueError, match="belongs to another device"): be.as_stream(other.raw)
foreign_streams.clear()

# ---- capture
import cupy.cuda.memory as M
prev_tl = M._get_thread_local_allocator()
with pytest.raises(CaptureError, match="default stream"): be.begin_capture(None)
with pytest.raises(CaptureError, match="default stream"): be.begin_capture(cupy.cuda.ExternalStream(0, device_id=0))
cs = be.stream()
calls.clear()
be.begin_capture(cs)
assert be.is_capturing() and cs.is_capturing() and not s.is_capturing()
with pytest.raises(CaptureError, match="already capturing"): be.begin_capture(cs)
for f in (lambda: be.empty(3, np.float32), lambda: be.zeros(3, np.float32), lambda: be.asarray(np.ones(3)),
          lambda: be.to_numpy(d), be.synchronize, lambda: be.pinned_empty(3, np.float32),
          lambda: be.compile(SRC), cs.synchronize, e.synchronize):
    with pytest.raises(CaptureError, match="not allowed while a stream is capturing"): f()
# CuPy-level allocations in this thread hit the guards
with pytest.raises(CaptureError, match="device allocation during capture"): cupy.cuda.alloc(16)
with pytest.raises(CaptureError, match="pinned host allocation"): cupy.cuda.pinned_memory.alloc_pinned_memory(16)
args = (x, y, np.int32(6), np.float32(2), np.int64(1))
with pytest.raises(CaptureError, match="another stream"): k(1, 32, args)
with pytest.raises(CaptureError, match="another stream"): k(1, 32, args, stream=s)
with pytest.raises(CaptureError, match="another stream"): be.copy_h2d_async(d, hp)
with pytest.raises(CaptureError, match="another stream"): e.record()
k(1, 32, args, stream=cs); k(1, 32, args, stream=cs.raw)
with cs:
    k(1, 32, args)    # stream=None inside `with cs:` is the capturing stream
be.copy_h2d_async(d, hp, stream=cs)
be.copy_d2h_async(hp, d, stream=cs)
with pytest.raises(ValueError, match="during capture dst must be pinned"): be.copy_d2h_async(out, d, stream=cs)
be.copy_d2d_async(d2, d, stream=cs)
e.record(cs)
with pytest.raises(CaptureError, match="not capturing"): be.end_capture(s)
g = be.end_capture(cs)
assert not be.is_capturing() and g.n_launches == 3 and g.n_copies == 3, (g.n_launches, g.n_copies)
assert M._get_thread_local_allocator() is prev_tl
# pinned allocator restored to CuPy's default pool (our fake alloc_pinned_memory is patched on cupy.cuda,
# the real module-level one must work again: allocate 0 bytes, which needs no driver)
cupy.cuda.pinned_memory.alloc_pinned_memory(0)
with pytest.raises(CaptureError, match="not capturing"): be.end_capture(cs)
g.launch(s); assert calls[-1] == ("glaunch", s.ptr)
g.launch(); assert calls[-1] == ("glaunch", None)
# a failing end_capture restores the guards too
be.begin_capture(cs); cs.raw.fail = True
with pytest.raises(CaptureError, match="capture failed at end_capture"): be.end_capture(cs)
cs.raw.fail = False
assert not be.is_capturing() and M._get_thread_local_allocator() is prev_tl
cupy.cuda.pinned_memory.alloc_pinned_memory(0)
# graph launch during capture refused
be.begin_capture(cs)
with pytest.raises(CaptureError, match="graph.launch"): g.launch(cs)
be.end_capture(cs)

# ---- programmatic dependent launch: cuLaunchKernelEx (faked) with the attribute
import dflash_cupy.backends.cuda_launch_ex as LX
from dflash_cupy.backends.base import programmatic_launches
def fake_launch_ex(cfg_p, func, params, extra):
    c = cfg_p.contents; a = c.attrs[0]
    calls.append(("launch_ex", func, (c.gridDimX, c.gridDimY, c.gridDimZ), (c.blockDimX, c.blockDimY, c.blockDimZ),
                  c.sharedMemBytes, c.hStream or 0, c.numAttrs, a.id, a.value.programmaticStreamSerializationAllowed,
                  ctypes.cast(params[0], ctypes.POINTER(ctypes.c_void_p))[0],
                  ctypes.cast(params[2], ctypes.POINTER(ctypes.c_int))[0]))
    return 0
fake_fn = LX.LAUNCH_EX_PROTO(fake_launch_ex)
mp.setattr(LX, "driver_function", lambda: fake_fn)
calls.clear()
k(2, 64, args, stream=s, pdl=True)   # eager, explicit
assert calls == [("launch_ex", k.raw.kernel.ptr, (2, 1, 1), (64, 1, 1), 0, s.ptr, 1, 6, 1, x.data.ptr, 6)], calls
k(2, 64, args, stream=s)             # default: CuPy's own launch
assert calls[-1][0] == "launch", calls[-1]
with pytest.raises(TypeError, match="pdl must be a bool"): k(2, 64, args, stream=s, pdl="on")
calls.clear()
with programmatic_launches():
    k(2, 64, args, stream=s)         # eager: never from the scope
    be.begin_capture(cs)
    k(1, 32, args, stream=cs)        # first node of the capture: no programmatic edge
    k(1, 32, args, stream=cs)        # follows a kernel: programmatic
    k(1, 32, args, stream=cs, pdl=False)
    be.copy_d2d_async(d2, d, stream=cs)
    k(1, 32, args, stream=cs)        # follows a copy: plain
    k(1, 32, args, stream=cs)
    e.record(cs)
    k(1, 32, args, stream=cs)        # follows an event record: plain
    g2 = be.end_capture(cs)
kinds = [c[0] for c in calls if c[0] in ("launch", "launch_ex", "memcpyAsync")]
assert kinds == ["launch", "launch", "launch_ex", "launch", "memcpyAsync", "launch", "launch_ex", "launch"], kinds
assert g2.n_launches == 6 and g2.n_pdl == 2, (g2.n_launches, g2.n_pdl)
assert all(c[5] == cs.ptr for c in calls if c[0] == "launch_ex")
# ---- launch observers (profiling/kernel_times.py): every kernel and copy as issued, capture too
from dflash_cupy.backends.base import observe_launches
seen = []
with observe_launches(lambda kind, name, a, st: seen.append((kind, name, len(a), st))):
    k(1, 32, args, stream=s)
    k(1, 32, args, stream=s, pdl=True)
    be.copy_h2d_async(d, p, stream=s)
    be.copy_d2h_async(p, d, stream=s)
    be.copy_d2d_async(d2, d)
    be.begin_capture(cs)
    k(1, 32, args, stream=cs)
    be.end_capture(cs)
k(1, 32, args, stream=s)             # outside: not observed
assert seen == [("kernel", "k", 5, s), ("kernel", "k", 5, s), ("copy", "h2d", 2, s), ("copy", "d2h", 2, s),
                ("copy", "d2d", 2, None), ("kernel", "k", 5, cs)], seen
mp.setattr(LX, "driver_function", lambda: LX.LAUNCH_EX_PROTO(lambda *a: 700))   # CUDA_ERROR_ILLEGAL_ADDRESS
with pytest.raises(KernelLaunchError, match=r"launch \(programmatic\).*CUresult 700"):
    k(1, 32, args, stream=s, pdl=True)
mp.restore()
print("harness OK")
# 0-d round trip keeps its shape
mp2 = MP()
mp2.setattr(R, "memcpy", lambda d, s, n, k: ctypes.memmove(d, s, n))
mp2.setattr(R, "deviceSynchronize", lambda: None)
mp2.setattr(R, "memcpyAsync", lambda d, s, n, k, st: ctypes.memmove(d, s, n))
mp2.setattr(R, "streamSynchronize", lambda st: None)
mp2.setattr(cupy.cuda, "get_current_stream", lambda: current[-1])
mp2.setattr(cupy, "empty", fake_empty)
s0 = be.asarray(np.float32(3.5)); assert s0.shape == (), s0.shape
r0 = be.to_numpy(s0); assert r0.shape == () and r0 == np.float32(3.5)
nc = be.asarray(np.arange(12, dtype=np.int32).reshape(3, 4)[:, 1:3])
assert be.to_numpy(nc).tolist() == [[1, 2], [5, 6], [9, 10]]
mp2.restore()
print("harness 0-d OK")
